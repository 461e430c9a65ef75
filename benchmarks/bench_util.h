// What the benchmark binaries share: the --quick flag, the median they report, the clocks they
// read, and the JSON document of the training-step benchmarks.
#ifndef ZERORT_BENCHMARKS_BENCH_UTIL_H_
#define ZERORT_BENCHMARKS_BENCH_UTIL_H_

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "nlohmann/json.hpp"

namespace zerort {
namespace bench {

// Reads `[--quick]` (the CI mode: a few seconds). Returns false after printing the usage line
// for anything else.
inline bool ParseQuick(int argc, char** argv, const char* name, bool* quick) {
  *quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") != 0) {
      std::fprintf(stderr, "usage: %s [--quick]\n", name);
      return false;
    }
    *quick = true;
  }
  return true;
}

// Seconds of the steady clock since `since`.
inline double SecondsSince(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

// CPU time of the calling thread, in milliseconds: its work, not its waits (a thread asleep in a
// wait uses none), whatever else runs on the machine.
inline double ThreadCpuMs() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

// Medians resist the outliers a shared 2-core machine produces. REQUIRES: !v.empty().
inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Prints the JSON document of a training-step benchmark (offload_bench, step_bench): `head` (its
// name, model and setup, in print order), then the step counts, the machine, the baseline its
// ratios are measured against, and the result rows.
inline void PrintStepReport(nlohmann::ordered_json head, int warmup_steps, int measured_steps,
                            const char* baseline, const nlohmann::ordered_json& results) {
  head["warmup_steps"] = warmup_steps;
  head["measured_steps"] = measured_steps;
  head["hardware_threads"] = std::thread::hardware_concurrency();
  head["baseline"] = baseline;
  head["results"] = results;
  std::printf("%s\n", head.dump(2).c_str());
}

}  // namespace bench
}  // namespace zerort

#endif  // ZERORT_BENCHMARKS_BENCH_UTIL_H_
