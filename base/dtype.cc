#include "base/dtype.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace zerort {

absl::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "fp32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "fp16";
  }
  return "unknown";
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  if (name == "fp32" || name == "float32") return DType::kF32;
  if (name == "bf16" || name == "bfloat16") return DType::kBF16;
  if (name == "fp16" || name == "float16") return DType::kF16;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", name, "': expected one of fp32, bf16, fp16"));
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  // Inf / NaN; a signaling NaN comes back quiet, as F16C's vcvtph2ps returns it.
  if (exp == 0x1f) return BitsToFloat(sign | 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0));
  if (exp != 0) return BitsToFloat(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return BitsToFloat(sign);
  // Subnormal half: normalise into a float.
  int e = -1;
  do {
    ++e;
    mant <<= 1;
  } while ((mant & 0x400u) == 0);
  return BitsToFloat(sign | ((112u - e) << 23) | ((mant & 0x3ffu) << 13));
}

uint16_t FloatToHalf(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u | static_cast<uint16_t>((abs >> 13) & 0x3ffu);
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: inf
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero): shift the full mantissa and round to nearest even.
    if (abs < 0x33000000u) return sign;  // below half the smallest subnormal
    const uint32_t e = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;  // 14..24
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
    return sign | static_cast<uint16_t>(q);
  }
  uint32_t v = abs - 0x38000000u;  // rebias exponent 127 -> 15
  v += 0xfffu + ((v >> 13) & 1u);
  return sign | static_cast<uint16_t>(v >> 13);
}

}  // namespace zerort
