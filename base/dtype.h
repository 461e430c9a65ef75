// Element types zerort moves and reduces, and their scalar conversions.
//
// Parameters and gradients travel in a 2-byte compute dtype (bf16 or fp16) or in fp32; optimizer
// state is always fp32. Half types are stored as raw uint16_t bits so that host code needs no
// compiler extension; these conversions are the scalar reference for every SIMD and CUDA path
// (round to nearest even, NaN preserved as a quiet NaN).
#ifndef ZERORT_BASE_DTYPE_H_
#define ZERORT_BASE_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace zerort {

enum class DType : uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

constexpr size_t DTypeSize(DType t) { return t == DType::kF32 ? 4 : 2; }

// "fp32", "bf16", "fp16".
absl::string_view DTypeName(DType t);

// Accepts the names DTypeName returns (and "float32", "bfloat16", "float16").
absl::StatusOr<DType> ParseDType(absl::string_view name);

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float Bf16ToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

inline uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);

}  // namespace zerort

#endif  // ZERORT_BASE_DTYPE_H_
