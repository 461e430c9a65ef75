// Launchers of the CUDA device's kernels (device/internal/cuda_kernels.cu), for device/cuda_device.cc.
//
// A plain C++ header: no CUDA types, so that it can be included anywhere. Streams travel as
// void* (a cudaStream_t; nullptr is the legacy default stream). Each launcher only enqueues;
// it returns the cudaError_t (as int, 0 = cudaSuccess) that cudaGetLastError() reported right
// after its launches, which the caller turns into a Status.
//
// REQUIRES (all): the caller has made the owning device current (cudaSetDevice); every pointer
// is device-accessible (device memory, pinned host memory, or pageable memory on a device with
// pageable memory access) and holds n elements of its dtype; n > 0.
// Pointers need only be aligned to their element size: the elementwise launchers (Cast,
// Accumulate, Scale, AllFinite, AdamW, CompactAdamW, ReduceRankOrder) use 16-byte vector
// accesses where all their arrays reach a 16-byte boundary at the same element, and an
// unaligned path otherwise (cuda_elementwise.h). One thread per chunk of work (no grid cap:
// cuda_kernels.cu says why).
// Thread-safe: launches on any streams may come from any threads.
#ifndef ZERORT_DEVICE_INTERNAL_CUDA_KERNELS_H_
#define ZERORT_DEVICE_INTERNAL_CUDA_KERNELS_H_

#include <cstddef>

#include "base/dtype.h"
#include "device/internal/cuda_elementwise.h"  // kMaxReduceSources, CompactAdamWArgs
#include "device/internal/cuda_math.h"          // AdamWConstants
#include "device/internal/cuda_norm_batch.h"    // NormBatchPlan

namespace zerort {
namespace cuda_internal {

// dst[i] = round_to_dst(float(src[i])). REQUIRES: src_dtype != dst_dtype, no overlap.
int LaunchCast(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t n,
               void* stream);

// acc[i] = round(float(acc[i]) + float(x[i])).
int LaunchAccumulate(void* acc, const void* x, DType dtype, size_t n, void* stream);

// x[i] = round(float(x[i]) * factor) (gradient prescaling).
int LaunchScale(void* x, DType dtype, size_t n, float factor, void* stream);

// Number of block partials of the squared norm of n elements: ceil(n / offload::kNormBlock).
size_t NormBlocks(size_t n);

// Floats of scratch LaunchSquaredNorm needs for n elements: the block partials, then every tree
// level above them but the last (0 when n <= offload::kNormBlock; about n / 1023 otherwise).
size_t NormScratch(size_t n);

// Floats of scratch LaunchNormTreeSum needs for `count` values: every tree level but the last.
size_t NormTreeScratch(size_t count);

// *out = offload::SquaredNormF32(x, dtype, n), bitwise: one kernel writes the block partials to
// scratch, then one launch per level of offload::NormTreeSum (1024 values per 512-thread block)
// writes the next level after them, until the last writes *out.
// REQUIRES: scratch holds NormScratch(n) floats (may be null when that is 0); out does not
// overlap scratch.
int LaunchSquaredNorm(const void* x, DType dtype, size_t n, float* scratch, float* out,
                      void* stream);

// *out = offload::NormTreeSum(values, count) (values are not modified), for the tests of the
// tree levels beyond what a test-sized norm reaches. For count == 1 it enqueues a 4-byte
// cudaMemcpyAsync and returns that call's error. REQUIRES: values holds count >= 1 floats;
// scratch holds NormTreeScratch(count) floats; no overlaps.
int LaunchNormTreeSum(const float* values, size_t count, float* scratch, float* out, void* stream);

// Enqueues every launch of `plan` (cuda_norm_batch.h's PlanNormBatches) in order: the squared
// norms and finite flags of many ranges. REQUIRES: as PlanNormBatches.
int LaunchNormBatches(const NormBatchPlan& plan, void* stream);

// Clears *finite (a byte preset to 1 by the caller) if any element is Inf or NaN.
int LaunchAllFinite(const void* x, DType dtype, size_t n, unsigned char* finite, void* stream);

// The fused AdamW of offload/cpu_adamw.h. param_out may be null (no compute-dtype copy).
int LaunchAdamW(const AdamWConstants& constants, float* master, float* m, float* v,
                const void* grad, DType grad_dtype, void* param_out, DType param_dtype, size_t n,
                void* stream);

// The compact-state AdamW of offload/cpu_adamw_compact.h over one launch's arrays
// (CompactAdamWArgs, cuda_elementwise.h), every element with the constants `c`; cut a call into
// launches with cuda_compact_plan.h's ForEachCompactLaunch (ranges, 2^32 index blocks).
// REQUIRES: `a` passed offload::CheckCompactAdamW; a.n > 0.
int LaunchCompactAdamW(const AdamWConstants& c, const CompactAdamWArgs& a, void* stream);

// dst[i] = the CPU communicators' reduction (comm/communicator.h): acc = float(srcs[0][i]);
// acc = op(acc, float(srcs[k][i])) for k = 1..n-1 in order; divided by float(n) for avg; one
// rounding to dtype; a NaN result stored as the positive quiet NaN. `op`: 0 sum, 1 avg, 2 max
// (comm::ReduceOp's order). dst may alias a source at the same offsets.
// REQUIRES: 1 <= n <= kMaxReduceSources (else cudaErrorInvalidValue, nothing launched).
int LaunchReduceRankOrder(const void* const* srcs, int n, void* dst, size_t count, DType dtype,
                          int op, void* stream);

}  // namespace cuda_internal
}  // namespace zerort

#endif  // ZERORT_DEVICE_INTERNAL_CUDA_KERNELS_H_
