#include "base/dtype.h"

#include <cmath>
#include <limits>

#include <catch2/catch.hpp>

namespace zerort {
namespace {

// Independent reference: round a double to the nearest value with `mant_bits` explicit mantissa
// bits and exponent range [emin, emax], ties to even, by exhaustive neighbour search in double.
double RoundToFormat(double x, int mant_bits, int emin, int emax) {
  if (x == 0 || std::isnan(x) || std::isinf(x)) return x;
  const double ax = std::fabs(x);
  int e = std::ilogb(ax);
  if (e < emin) e = emin;  // subnormal spacing
  const double ulp = std::ldexp(1.0, e - mant_bits);
  double q = ax / ulp;
  double fl = std::floor(q);
  double r = q - fl;
  double n = (r > 0.5 || (r == 0.5 && std::fmod(fl, 2.0) == 1.0)) ? fl + 1 : fl;
  double v = n * ulp;
  const double maxv = std::ldexp(2.0 - std::ldexp(1.0, -mant_bits), emax);
  if (v > maxv) v = std::numeric_limits<double>::infinity();
  return std::copysign(v, x);
}

TEST_CASE("DType: sizes and names round-trip", "[base]") {
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    auto parsed = ParseDType(DTypeName(t));
    REQUIRE(parsed.ok());
    CHECK(*parsed == t);
  }
  CHECK(DTypeSize(DType::kF32) == 4);
  CHECK(DTypeSize(DType::kBF16) == 2);
  CHECK_FALSE(ParseDType("int8").ok());
}

TEST_CASE("DType: every half and bf16 bit pattern round-trips through float", "[base]") {
  for (uint32_t b = 0; b < 65536; ++b) {
    const uint16_t h = static_cast<uint16_t>(b);
    const float hf = HalfToFloat(h);
    if (std::isnan(hf)) {
      CHECK(std::isnan(HalfToFloat(FloatToHalf(hf))));
    } else {
      REQUIRE(FloatToHalf(hf) == h);
    }
    const float bf = Bf16ToFloat(h);
    if (!std::isnan(bf)) REQUIRE(FloatToBf16(bf) == h);
  }
}

TEST_CASE("DType: float to half/bf16 rounds to nearest even like the reference", "[base]") {
  uint32_t state = 12345;
  for (int i = 0; i < 200000; ++i) {
    state = state * 1664525u + 1013904223u;
    // Spread over magnitudes including half subnormals and overflow.
    const float f = BitsToFloat((state & 0x8fffffffu) | ((0x30u + (state >> 27)) << 23)) *
                    ((i % 7 == 0) ? 1e-3f : 1.0f);
    const double ref_h = RoundToFormat(f, 10, -14, 15);
    REQUIRE(static_cast<double>(HalfToFloat(FloatToHalf(f))) == ref_h);
    const double ref_b = RoundToFormat(f, 7, -126, 127);
    REQUIRE(static_cast<double>(Bf16ToFloat(FloatToBf16(f))) == ref_b);
  }
}

TEST_CASE("DType: half and bf16 widen to their exact values, NaN payloads kept and quieted",
          "[base]") {
  for (uint32_t b = 0; b < 65536; ++b) {
    const uint16_t h = static_cast<uint16_t>(b);
    const uint32_t sign = (b & 0x8000u) << 16;
    const int exp = static_cast<int>((b >> 10) & 0x1fu);
    const uint32_t mant = b & 0x3ffu;
    if (exp == 0x1f) {
      // Inf, or NaN with the payload shifted into the top bits and the quiet bit set.
      const uint32_t want = sign | 0x7f800000u | (mant << 13) | (mant != 0 ? 0x400000u : 0u);
      REQUIRE(FloatBits(HalfToFloat(h)) == want);
    } else {
      // Independent of the bit tricks: (mant / 1024 + implicit one) * 2^(exp - 15), in double.
      const double magnitude = exp == 0 ? std::ldexp(static_cast<double>(mant), -24)
                                        : std::ldexp(1.0 + mant / 1024.0, exp - 15);
      const float want = static_cast<float>(sign != 0 ? -magnitude : magnitude);
      REQUIRE(FloatBits(HalfToFloat(h)) == FloatBits(want));  // also the sign of zero
    }
    REQUIRE(FloatBits(Bf16ToFloat(h)) == b << 16);
  }
  // A NaN narrows to a quiet NaN keeping its top payload bits.
  CHECK(FloatToHalf(BitsToFloat(0x7f812345u)) == (0x7e00u | ((0x7f812345u >> 13) & 0x3ffu)));
  CHECK(FloatToBf16(BitsToFloat(0xff812345u)) == 0xffc1u);
}

}  // namespace
}  // namespace zerort
