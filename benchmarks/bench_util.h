// What every benchmark binary shares: its one flag and the median it reports.
#ifndef ZERORT_BENCHMARKS_BENCH_UTIL_H_
#define ZERORT_BENCHMARKS_BENCH_UTIL_H_

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

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

// Medians resist the outliers a shared 2-core machine produces. REQUIRES: !v.empty().
inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace bench
}  // namespace zerort

#endif  // ZERORT_BENCHMARKS_BENCH_UTIL_H_
