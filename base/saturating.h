// Saturating int64 arithmetic for byte and element counts: a sum or product that does not fit
// in int64 is INT64_MAX instead of a wrapped (possibly negative) value, so that a too-large
// quantity still compares as "does not fit" against any budget.
//
//   int64_t bytes = SatMul(elements, DTypeSize(dtype));        // INT64_MAX if it overflows
//   bool fits = SatAdd(bytes, reserve) <= budget;
//
// Meant for counts (a, b >= 0): any overflow, whatever its sign, gives INT64_MAX.
#ifndef ZERORT_BASE_SATURATING_H_
#define ZERORT_BASE_SATURATING_H_

#include <cstdint>
#include <limits>

namespace zerort {

inline int64_t SatAdd(int64_t a, int64_t b) {
  int64_t r;
  return __builtin_add_overflow(a, b, &r) ? std::numeric_limits<int64_t>::max() : r;
}

inline int64_t SatMul(int64_t a, int64_t b) {
  int64_t r;
  return __builtin_mul_overflow(a, b, &r) ? std::numeric_limits<int64_t>::max() : r;
}

}  // namespace zerort

#endif  // ZERORT_BASE_SATURATING_H_
