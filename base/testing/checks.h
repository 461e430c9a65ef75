// Checks shared by tests: bitwise equality of float arrays (the engine's results are compared
// bit for bit, across stages, layouts, resumed runs and devices) and Catch2 requirements on the
// absl::Status values that multi-rank helpers return, one per rank.
#ifndef ZERORT_BASE_TESTING_CHECKS_H_
#define ZERORT_BASE_TESTING_CHECKS_H_

#include <catch2/catch.hpp>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "base/testing/bit_equal.h"  // BitEqual, with the checks below

namespace zerort {
namespace testing {

// REQUIREs every rank's status to be OK, naming the first rank that is not.
inline void RequireAllOk(const std::vector<absl::Status>& st) {
  for (size_t r = 0; r < st.size(); ++r) {
    INFO("rank " << r << ": " << st[r].ToString());
    REQUIRE(st[r].ok());
  }
}

// REQUIREs that `s` failed with `code` and a message that contains `text`.
inline void RequireError(const absl::Status& s, absl::StatusCode code, absl::string_view text) {
  INFO(s.ToString());
  REQUIRE(s.code() == code);
  REQUIRE(absl::StrContains(s.message(), text));
}

}  // namespace testing
}  // namespace zerort

#endif  // ZERORT_BASE_TESTING_CHECKS_H_
