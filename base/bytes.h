// Byte counts as people write and read them: "80GiB" on a command line, "1.50 KiB" in a plan
// table, "1,234,567" where two exact counts are compared. The one place the project formats or
// parses a byte size.
//
//   ASSIGN_OR_RETURN(int64_t budget, zerort::ParseBytes("80GiB"));  // 85899345920
//   std::cout << zerort::HumanBytes(budget);                          // "80.00 GiB"
//
// Thread safety: pure functions.
#ifndef ZERORT_BASE_BYTES_H_
#define ZERORT_BASE_BYTES_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace zerort {

// 1536 -> "1.50 KiB"; below 1 KiB "N B"; binary units up to PiB, two decimals.
std::string HumanBytes(int64_t bytes);

// 1234567 -> "1,234,567": exact, with thousands separators, for tables where equality matters.
std::string GroupedBytes(int64_t bytes);

// "80GiB", "80 GB", "1.5TiB", "8e10", "1e-3GiB", "123" (bytes). Decimal (kB, MB, GB, TB) and
// binary (KiB, MiB, GiB, TiB; also K, M, G, T) suffixes, case-insensitive. A fractional byte
// count is rounded to the nearest byte (1e-3GiB = 1073741.824 -> 1073742). InvalidArgument names
// the text: negative, unparsable, an unknown unit, more than 9e18 bytes, or a positive size that
// rounds to 0.
absl::StatusOr<int64_t> ParseBytes(absl::string_view text);

}  // namespace zerort

#endif  // ZERORT_BASE_BYTES_H_
