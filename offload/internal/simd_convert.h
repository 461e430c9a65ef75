// The range splitting of the host kernels. Their scalar paths load and store through
// base/dtype.h's LoadAs / StoreAs; the vector loads and stores of lane_convert.inc (see
// simd_lanes.h) give the same bits.
#ifndef ZERORT_OFFLOAD_INTERNAL_SIMD_CONVERT_H_
#define ZERORT_OFFLOAD_INTERNAL_SIMD_CONVERT_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>

#include "base/dtype.h"
#include "offload/thread_pool.h"

namespace zerort {
namespace offload {
namespace internal {

// ------------------------------------------------------------------ threading

// Splits [0, n) into at most `threads` contiguous ranges (0: the default pool's size) of at
// least `min_per_task` elements, boundaries on multiples of 64 elements (whole cache lines for
// every dtype), and runs fn(begin, end) for each on the default pool. Results never depend on
// the split: every kernel computes each element (or each fixed block) independently.
inline void ParallelRanges(size_t n, int threads, size_t min_per_task,
                           const std::function<void(size_t, size_t)>& fn) {
  if (n == 0) return;
  ThreadPool* pool = DefaultThreadPool();
  size_t tasks = threads <= 0 ? static_cast<size_t>(pool->num_threads())
                              : static_cast<size_t>(threads);
  tasks = std::min(tasks, (n + min_per_task - 1) / min_per_task);
  if (tasks <= 1) {
    fn(0, n);
    return;
  }
  const size_t chunk = ((n + tasks - 1) / tasks + 63) / 64 * 64;
  pool->ParallelFor(static_cast<int>(tasks), [&](int t) {
    const size_t begin = static_cast<size_t>(t) * chunk;
    if (begin < n) fn(begin, std::min(n, begin + chunk));
  });
}

}  // namespace internal
}  // namespace offload
}  // namespace zerort

#endif  // ZERORT_OFFLOAD_INTERNAL_SIMD_CONVERT_H_
