// What the CUDA benchmarks (cuda_bench, gpu_step_bench) share: stopping on a failed CUDA call,
// and timing a piece of work between CUDA events on the legacy default stream.
//
// Why stop: these are tools; a failed runtime call outside the measured work means the
// measurement cannot go on, and the message names the call.
#ifndef ZERORT_BENCHMARKS_CUDA_TIMING_H_
#define ZERORT_BENCHMARKS_CUDA_TIMING_H_

#include <cuda_runtime.h>
#include <errno.h>  // program_invocation_short_name

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

namespace zerort {
namespace bench {

// Prints "<program>: <what>: <CUDA's reason>" and exits 1 unless `e` is cudaSuccess.
inline void CheckCuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s: %s\n", program_invocation_short_name, what,
                 cudaGetErrorString(e));
    std::exit(1);
  }
}

// Seconds of each of `reps` runs of fn(), sorted, from CUDA events recorded on the legacy
// default stream before and after it (so fn's work must run on that stream, or synchronize its
// own). The first call is a warm-up, not counted.
inline std::vector<double> EventTimes(int reps, const std::function<void()>& fn) {
  cudaEvent_t start, stop;
  CheckCuda(cudaEventCreate(&start), "cudaEventCreate");
  CheckCuda(cudaEventCreate(&stop), "cudaEventCreate");
  fn();
  CheckCuda(cudaDeviceSynchronize(), "warm-up");
  std::vector<double> s;
  for (int r = 0; r < reps; ++r) {
    CheckCuda(cudaEventRecord(start, nullptr), "cudaEventRecord");
    fn();
    CheckCuda(cudaEventRecord(stop, nullptr), "cudaEventRecord");
    CheckCuda(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    CheckCuda(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    s.push_back(ms / 1e3);
  }
  CheckCuda(cudaEventDestroy(start), "cudaEventDestroy");
  CheckCuda(cudaEventDestroy(stop), "cudaEventDestroy");
  std::sort(s.begin(), s.end());
  return s;
}

}  // namespace bench
}  // namespace zerort

#endif  // ZERORT_BENCHMARKS_CUDA_TIMING_H_
