#include "offload/simd.h"

#include <cpuid.h>

#include <atomic>

#include "absl/strings/str_cat.h"

namespace zerort {
namespace offload {
namespace {

// -1: not forced.
std::atomic<int> g_forced{-1};

}  // namespace

absl::string_view SimdLevelName(SimdLevel level) {
  switch (level) {
    case SimdLevel::kScalar:
      return "scalar";
    case SimdLevel::kAvx2:
      return "avx2";
    case SimdLevel::kAvx512:
      return "avx512";
  }
  return "unknown";
}

SimdLevel DetectSimd() {
  // CPUID directly (clang's __builtin_cpu_supports does not know f16c), and XGETBV so that an
  // OS which does not save the wide registers counts as lacking the feature.
  static const SimdLevel level = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return SimdLevel::kScalar;
    const bool fma = c & (1u << 12), osxsave = c & (1u << 27), avx = c & (1u << 28),
               f16c = c & (1u << 29);
    if (!(osxsave && avx && fma && f16c)) return SimdLevel::kScalar;
    unsigned xcr0_lo, xcr0_hi;
    __asm__("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    if ((xcr0_lo & 0x6u) != 0x6u) return SimdLevel::kScalar;  // XMM and YMM state
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return SimdLevel::kScalar;
    const bool avx2 = b & (1u << 5), avx512f = b & (1u << 16);
    if (!avx2) return SimdLevel::kScalar;
    // Opmask, ZMM0-15 upper halves and ZMM16-31 state.
    if (avx512f && (xcr0_lo & 0xe6u) == 0xe6u) return SimdLevel::kAvx512;
    return SimdLevel::kAvx2;
  }();
  return level;
}

SimdLevel ActiveSimd() {
  const int forced = g_forced.load(std::memory_order_relaxed);
  return forced < 0 ? DetectSimd() : static_cast<SimdLevel>(forced);
}

absl::Status ForceSimd(SimdLevel level) {
  if (static_cast<int>(level) > static_cast<int>(DetectSimd())) {
    return absl::FailedPreconditionError(absl::StrCat("cannot force SIMD level ",
                                                      SimdLevelName(level), ": this CPU supports ",
                                                      SimdLevelName(DetectSimd()), " at most"));
  }
  g_forced.store(static_cast<int>(level), std::memory_order_relaxed);
  return absl::OkStatus();
}

void ResetSimd() { g_forced.store(-1, std::memory_order_relaxed); }

}  // namespace offload
}  // namespace zerort
