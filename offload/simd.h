// Which SIMD instruction set the host kernels (AdamW, casts, norms) run with.
//
// Every level produces bitwise identical results (the kernels use only correctly rounded IEEE
// operations in a fixed order), so the level changes speed, never numbers. The level is chosen
// once from CPUID; tests and benchmarks may force a lower one to compare paths.
//
// Thread-safe: the active level is an atomic; forcing it while kernels run on other threads is
// allowed (each kernel call reads it once) but pointless outside tests.
#ifndef ZERORT_OFFLOAD_SIMD_H_
#define ZERORT_OFFLOAD_SIMD_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace zerort {
namespace offload {

enum class SimdLevel { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// "scalar", "avx2", "avx512".
absl::string_view SimdLevelName(SimdLevel level);

// The best level this CPU and OS support: kAvx512 needs AVX-512F (and the AVX2 set below),
// kAvx2 needs AVX2, FMA and F16C.
SimdLevel DetectSimd();

// The level kernels use now: DetectSimd() unless forced.
SimdLevel ActiveSimd();

// Forces kernels to `level`. FailedPrecondition (naming the level) if the CPU lacks it.
absl::Status ForceSimd(SimdLevel level);

// Back to DetectSimd().
void ResetSimd();

}  // namespace offload
}  // namespace zerort

#endif  // ZERORT_OFFLOAD_SIMD_H_
