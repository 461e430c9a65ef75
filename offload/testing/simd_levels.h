// The SIMD paths a host-kernel test can run on this CPU, and a guard that puts dispatch back,
// shared by the AdamW tests so that every form is checked on the same set of paths.
#ifndef ZERORT_OFFLOAD_TESTING_SIMD_LEVELS_H_
#define ZERORT_OFFLOAD_TESTING_SIMD_LEVELS_H_

#include <vector>

#include "catch2/catch.hpp"
#include "offload/simd.h"

namespace zerort {
namespace offload {
namespace testing {

// Scalar always; AVX2 and AVX-512 where the CPU has them (a warning says when AVX-512 is not
// tested here).
inline std::vector<SimdLevel> AvailableLevels() {
  std::vector<SimdLevel> levels = {SimdLevel::kScalar};
  if (DetectSimd() >= SimdLevel::kAvx2) levels.push_back(SimdLevel::kAvx2);
  if (DetectSimd() >= SimdLevel::kAvx512) {
    levels.push_back(SimdLevel::kAvx512);
  } else {
    WARN("AVX-512 not available on this CPU: its path is compiled but not tested here");
  }
  return levels;
}

// Restores automatic dispatch however the test exits.
struct SimdGuard {
  ~SimdGuard() { ResetSimd(); }
};

}  // namespace testing
}  // namespace offload
}  // namespace zerort

#endif  // ZERORT_OFFLOAD_TESTING_SIMD_LEVELS_H_
