// BitEqual: float arrays compared bit for bit, as the engine's results are across stages,
// layouts, resumed runs and devices. No Catch2, so that the MPI tests (plain programs under
// mpirun) use it too; Catch2 tests get it through base/testing/checks.h.
//
//   const bool same = run.ok() && BitEqual(run->master, reference);
#ifndef ZERORT_BASE_TESTING_BIT_EQUAL_H_
#define ZERORT_BASE_TESTING_BIT_EQUAL_H_

#include <cstring>
#include <vector>

namespace zerort {
namespace testing {

// Same length and the same bits (so -0 differs from +0 and NaNs compare by payload).
inline bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace testing
}  // namespace zerort

#endif  // ZERORT_BASE_TESTING_BIT_EQUAL_H_
