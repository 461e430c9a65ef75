// Deterministic elementwise reduction of N equal-length blocks, shared by the CPU backends.
//
// For every element i: acc = float(src[0][i]); acc = op(acc, float(src[k][i])) for k = 1..n-1 in
// order; kAvg divides by float(n); then one rounding to dtype. The AVX2/F16C path and the scalar
// path give bitwise identical results (both are IEEE fp32 add/div/compare; the conversions round
// to nearest even exactly like base/dtype.h). A NaN result is stored as the positive quiet NaN
// (fp32 0x7fc00000, bf16 0x7fc0, fp16 0x7e00) whatever the inputs' payloads.
//
// dst may alias any src at the same offsets (in-place reduce-scatter); no other overlap allowed.
// Thread-safe (pure function).
#ifndef ZERORT_COMM_INTERNAL_REDUCE_H_
#define ZERORT_COMM_INTERNAL_REDUCE_H_

#include <cstddef>

#include "base/dtype.h"
#include "comm/communicator.h"

namespace zerort {
namespace comm {
namespace internal {

// REQUIRES: n >= 1, every srcs[k] and dst valid for count elements (or count == 0).
void ReduceBlocks(const void* const* srcs, int n, void* dst, size_t count, DType dtype,
                  ReduceOp op);

// The portable path, always available; exposed so tests can compare it with the SIMD path.
void ReduceBlocksScalar(const void* const* srcs, int n, void* dst, size_t count, DType dtype,
                        ReduceOp op);

// True when ReduceBlocks dispatches to the AVX2 + F16C path on this CPU.
bool ReduceUsesSimd();

}  // namespace internal
}  // namespace comm
}  // namespace zerort

#endif  // ZERORT_COMM_INTERNAL_REDUCE_H_
