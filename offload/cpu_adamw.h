// The host AdamW update: the one function the engine calls for every CPU-side optimizer step,
// offloaded or not. A CUDA kernel replicates it, so the arithmetic is fixed to the op:
// per element, all in fp32, with correctly rounded fma, sqrt and division:
//
//   g      = float(grad[i]) * grad_scale
//   m      = fma(beta1, m, one_minus_beta1 * g)
//   v      = fma(beta2, v, (one_minus_beta2 * g) * g)
//   denom  = fma(sqrt(v), inv_sqrt_bias2, eps)          // sqrt(v / (1 - beta2^t)) + eps
//   master = fma(-step_size, m / denom, master * decay)
//   out[i] = master rounded to param dtype (nearest even)
//
// Scalar, AVX2+FMA and AVX-512 paths and any thread count give bitwise identical results (see
// offload/simd.h); docs/offload.md explains why each choice keeps that true.
//
//   ASSIGN_OR_RETURN(AdamWStepParams step, MakeAdamWStepParams(lr, 0.9, 0.95, 1e-8, 0.1, t));
//   RETURN_IF_ERROR(CpuAdamW({master, m, v, grad, DType::kBF16, param, DType::kBF16, n},
//                            step, 1.0f / loss_scale, /*threads=*/0));
//
// Thread-safe: calls on disjoint arrays may run concurrently (they share the thread pool, which
// serialises them).
#ifndef ZERORT_OFFLOAD_CPU_ADAMW_H_
#define ZERORT_OFFLOAD_CPU_ADAMW_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/dtype.h"

namespace zerort {
namespace offload {

// Per-step constants, computed once per step on the host (in double, then rounded to float) and
// shared by the CPU and CUDA kernels.
struct AdamWStepParams {
  float beta1 = 0;
  float beta2 = 0;
  float one_minus_beta1 = 0;  // float(1 - beta1)
  float one_minus_beta2 = 0;  // float(1 - beta2)
  float eps = 0;
  float step_size = 0;        // float(lr / (1 - beta1^t))
  float inv_sqrt_bias2 = 0;   // float(1 / sqrt(1 - beta2^t))
  float decay = 0;            // float(1 - lr * weight_decay)  (decoupled weight decay)
};

// `step` is the global step t, starting at 1. InvalidArgument naming the value unless
// lr >= 0, 0 <= beta1 < 1, 0 <= beta2 < 1, eps > 0, weight_decay >= 0, step >= 1 (all finite).
absl::StatusOr<AdamWStepParams> MakeAdamWStepParams(double lr, double beta1, double beta2,
                                                    double eps, double weight_decay,
                                                    int64_t step);

// The arrays of one update; all hold n elements and must not overlap, except that param_out may
// equal master when param_dtype is fp32.
struct AdamWArrays {
  float* master = nullptr;        // (n) fp32, updated in place
  float* m = nullptr;             // (n) fp32, updated in place
  float* v = nullptr;             // (n) fp32, updated in place
  const void* grad = nullptr;     // (n) grad_dtype
  DType grad_dtype = DType::kF32;
  void* param_out = nullptr;      // (n) param_dtype, or null for no compute-dtype copy
  DType param_dtype = DType::kBF16;
  size_t n = 0;
};

// One AdamW step over the arrays. Each array is read once and written once, no temporaries.
// `threads`: 0 = all hardware threads, else that many ranges on the shared pool.
// InvalidArgument if n > 0 and a required pointer is null, or threads < 0.
// Non-finite inputs propagate (the engine checks gradients before calling).
absl::Status CpuAdamW(const AdamWArrays& arrays, const AdamWStepParams& params, float grad_scale,
                      int threads);

// Elements [begin, end) of the arrays and the constants they take: one parameter group's part
// of a shard (the engine cuts a unit's shard at parameter boundaries).
struct AdamWRange {
  size_t begin = 0;
  size_t end = 0;
  AdamWStepParams params;
};

// CpuAdamW with per-range constants. `ranges` must tile [0, arrays.n) in order (empty ranges
// allowed); InvalidArgument naming the first range that does not. The threads split the whole
// array, not each range, and a range boundary only ends one vector loop early, so any number
// of ranges costs what one does (adamw_bench's "groups" case measures it). Each element gets
// exactly the op sequence above with its range's constants.
absl::Status CpuAdamW(const AdamWArrays& arrays, absl::Span<const AdamWRange> ranges,
                      float grad_scale, int threads);

// InvalidArgument unless `ranges` tile [0, n) in order. `who` prefixes the message.
absl::Status CheckAdamWRanges(absl::Span<const AdamWRange> ranges, size_t n, const char* who);

}  // namespace offload
}  // namespace zerort

#endif  // ZERORT_OFFLOAD_CPU_ADAMW_H_
