// Element types zerort moves and reduces, and their scalar conversions.
//
// Parameters and gradients travel in a 2-byte compute dtype (bf16 or fp16) or in fp32; optimizer
// state is always fp32. Half types are stored as raw uint16_t bits so that host code needs no
// compiler extension; the scalar conversions (base/half.h, written once for host and device) are
// the reference for every SIMD and CUDA path (round to nearest even, NaN preserved as a quiet
// NaN).
#ifndef ZERORT_BASE_DTYPE_H_
#define ZERORT_BASE_DTYPE_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/half.h"

namespace zerort {

enum class DType : uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

constexpr size_t DTypeSize(DType t) { return t == DType::kF32 ? 4 : 2; }

// "fp32", "bf16", "fp16".
absl::string_view DTypeName(DType t);

// Accepts the names DTypeName returns (and "float32", "bfloat16", "float16").
absl::StatusOr<DType> ParseDType(absl::string_view name);

// FloatBits, BitsToFloat, Bf16ToFloat, FloatToBf16, HalfToFloat and FloatToHalf come from
// base/half.h, shared with the CUDA kernels.

// Element i of an array of dtype D, as fp32, and back: the one typed load and store of the
// host kernels' scalar paths and of the CUDA kernels (compiled by nvcc too).
template <DType D>
ZERORT_HOST_DEVICE inline float LoadAs(const void* p, size_t i) {
  if constexpr (D == DType::kF32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (D == DType::kBF16) {
    return Bf16ToFloat(static_cast<const uint16_t*>(p)[i]);
  } else {
    return HalfToFloat(static_cast<const uint16_t*>(p)[i]);
  }
}

template <DType D>
ZERORT_HOST_DEVICE inline void StoreAs(void* p, size_t i, float x) {
  if constexpr (D == DType::kF32) {
    static_cast<float*>(p)[i] = x;
  } else if constexpr (D == DType::kBF16) {
    static_cast<uint16_t*>(p)[i] = FloatToBf16(x);
  } else {
    static_cast<uint16_t*>(p)[i] = FloatToHalf(x);
  }
}

// The same with the dtype known only at run time: for references, tests and examples, not for
// inner loops.
inline float LoadAs(DType d, const void* p, size_t i) {
  if (d == DType::kF32) return LoadAs<DType::kF32>(p, i);
  return d == DType::kBF16 ? LoadAs<DType::kBF16>(p, i) : LoadAs<DType::kF16>(p, i);
}

inline void StoreAs(DType d, void* p, size_t i, float x) {
  if (d == DType::kF32) {
    StoreAs<DType::kF32>(p, i, x);
  } else if (d == DType::kBF16) {
    StoreAs<DType::kBF16>(p, i, x);
  } else {
    StoreAs<DType::kF16>(p, i, x);
  }
}

}  // namespace zerort

#endif  // ZERORT_BASE_DTYPE_H_
