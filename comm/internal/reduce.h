// Deterministic elementwise reduction of N equal-length blocks, shared by the CPU backends.
//
// For every element i: acc = float(src[0][i]); acc = op(acc, float(src[k][i])) for k = 1..n-1 in
// order; kAvg divides by float(n); then one rounding to dtype. The AVX-512, AVX2/F16C and scalar
// paths give bitwise identical results (all are IEEE fp32 add/div/compare; the conversions round
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

// Outputs of at least this many bytes are written with non-temporal stores (AVX-512 path): a
// result that large leaves the caches before anyone reads it, and streaming it skips the read
// for ownership of every destination line: +4-9% on 64 MiB outputs (comm_bench reduce_kernel,
// docs/comm.md). 4 MiB is four times a core's L2 on the development machine; not tuned.
constexpr size_t kStreamMinBytes = size_t{4} << 20;

// REQUIRES: n >= 1, every srcs[k] and dst valid for count elements (or count == 0).
// Dispatches to the best path this CPU supports.
void ReduceBlocks(const void* const* srcs, int n, void* dst, size_t count, DType dtype,
                  ReduceOp op);

// The kernels, selectable so that tests compare every SIMD path with the scalar one and the
// benchmark times each. All give the same bits for the same inputs.
enum class ReducePath { kScalar, kAvx2, kAvx512 };

// "scalar", "avx2", "avx512".
const char* ReducePathName(ReducePath path);

// kScalar always; kAvx2 needs AVX2 + F16C; kAvx512 needs AVX-512 F, BW and VL (and the OS's
// support for the zmm state).
bool ReducePathSupported(ReducePath path);

// What ReduceBlocks uses on this CPU.
ReducePath ReduceBestPath();

// `stream`: non-temporal stores for the bulk of dst (only the AVX-512 path has them; ignored
// elsewhere). REQUIRES: ReducePathSupported(path), plus ReduceBlocks's requirements.
void ReduceBlocksWith(ReducePath path, bool stream, const void* const* srcs, int n, void* dst,
                      size_t count, DType dtype, ReduceOp op);

}  // namespace internal
}  // namespace comm
}  // namespace zerort

#endif  // ZERORT_COMM_INTERNAL_REDUCE_H_
