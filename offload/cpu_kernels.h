// The host kernels the engine needs besides AdamW: squared norm, finite check, scale and dtype
// casts over arrays of fp32 / bf16 / fp16 (half types as uint16_t bits).
//
// Same discipline as offload/cpu_adamw.h: every SIMD level and every thread count gives bitwise
// identical results, and conversions equal base/dtype.h's scalar ones.
//
//   const float partial = SquaredNormF32(grad_shard, DType::kBF16, n);  // this rank's part
//   if (!AllFinite(grad_shard, DType::kBF16, n)) { ... skip the step ... }
//
// Thread-safe. `threads`: 0 = all hardware threads, else at most that many ranges.
// REQUIRES (all functions): pointers non-null when n > 0; threads >= 0.
#ifndef ZERORT_OFFLOAD_CPU_KERNELS_H_
#define ZERORT_OFFLOAD_CPU_KERNELS_H_

#include <cstddef>

#include "base/dtype.h"

namespace zerort {
namespace offload {

// Elements per block of SquaredNormF32.
inline constexpr size_t kNormBlock = 1024;

// Values per chunk of NormTreeSum.
inline constexpr size_t kNormTreeChunk = 1024;

// Sum of x[i]^2 in fp32 with a reduction order fixed by n alone (never by threads or SIMD):
//   - x is cut into blocks of kNormBlock elements (the last may be shorter);
//   - in a block, lane l (0..7) accumulates the elements whose index within the block is
//     l mod 8, in increasing order: acc[l] = fma(x, x, acc[l]), from +0;
//   - block partial = ((acc0 + acc1) + (acc2 + acc3)) + ((acc4 + acc5) + (acc6 + acc7));
//   - result = NormTreeSum(partials, ceil(n / kNormBlock)).
// The engine sums these per-shard values in a fixed order across ranks, so every stage gets the
// same global norm. The CUDA device reproduces it: one warp-quarter per block, then one
// 512-thread block per chunk of each tree level (device/internal/cuda_kernels.cu).
// n == 0 gives +0.
float SquaredNormF32(const void* x, DType dtype, size_t n, int threads = 0);

// The final sum of SquaredNormF32, a fixed tree that depends on `count` alone:
//   while count > 1: cut values into chunks of kNormTreeChunk (the last one padded with +0.0f)
//     and replace each chunk by its pairwise sum: for stride = 512, 256, ..., 1:
//     v[i] = v[i] + v[i + stride] for i < stride; the chunk's sum is v[0].
//   result = the single remaining value (values[0] itself for count == 1; +0 for count == 0).
// A pairwise tree rather than a serial chain, so that a GPU sums 10^6 partials in parallel: with
// one thread adding them in order, a 10^9-element fp32 norm took 8.6 ms on an H200, 0.11 of a
// device-to-device copy's bandwidth. Padding with +0 is exact for squared-norm partials (each
// is >= +0, Inf or NaN).
// Overwrites values[0, count) with intermediate sums. Single-threaded.
// REQUIRES: values non-null when count > 0.
float NormTreeSum(float* values, size_t count);

// True iff no element is Inf or NaN.
bool AllFinite(const void* x, DType dtype, size_t n, int threads = 0);

// x[i] = round_to_dtype(float(x[i]) * scale), in place.
void Scale(void* x, DType dtype, size_t n, float scale, int threads = 0);

// dst[i] = round_to_dst_dtype(float(src[i])). Same dtype copies. REQUIRES: no overlap.
void Cast(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t n,
          int threads = 0);

}  // namespace offload
}  // namespace zerort

#endif  // ZERORT_OFFLOAD_CPU_KERNELS_H_
