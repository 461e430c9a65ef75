#include "offload/cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

#include "base/dtype.h"
#include "offload/simd.h"

namespace zerort {
namespace offload {
namespace {

const DType kDTypes[] = {DType::kF32, DType::kBF16, DType::kF16};

struct SimdGuard {
  ~SimdGuard() { ResetSimd(); }
};

std::vector<SimdLevel> AvailableLevels() {
  std::vector<SimdLevel> levels = {SimdLevel::kScalar};
  if (DetectSimd() >= SimdLevel::kAvx2) levels.push_back(SimdLevel::kAvx2);
  if (DetectSimd() >= SimdLevel::kAvx512) levels.push_back(SimdLevel::kAvx512);
  return levels;
}

float ToFloat(const std::vector<uint8_t>& buf, DType d, size_t i) {
  return LoadAs(d, buf.data(), i);
}

void FromFloat(std::vector<uint8_t>& buf, DType d, size_t i, float f) {
  StoreAs(d, buf.data(), i, f);
}

std::vector<uint8_t> RandomArray(size_t n, DType d, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-12, 4);
  std::vector<uint8_t> buf(n * DTypeSize(d));
  for (size_t i = 0; i < n; ++i) FromFloat(buf, d, i, std::ldexp(unit(rng), exponent(rng)));
  return buf;
}

// The documented tree of NormTreeSum, written from the header's definition but recursively:
// after the steps of strides 512 down to s, slot i of a chunk holds
// Slot(i, s) = Slot(i, 2s) + Slot(i + s, 2s), and before any step Slot(i, 1024) is value i
// (or +0 past the end). The chunk's sum is Slot(0, 1).
float Slot(const std::vector<float>& chunk, size_t i, size_t s) {
  if (s == 1024) return i < chunk.size() ? chunk[i] : 0.0f;
  return Slot(chunk, i, 2 * s) + Slot(chunk, i + s, 2 * s);
}

float ReferenceTreeSum(std::vector<float> level) {
  if (level.empty()) return 0.0f;
  while (level.size() > 1) {
    std::vector<float> next;
    for (size_t begin = 0; begin < level.size(); begin += 1024) {
      const size_t end = std::min(level.size(), begin + 1024);
      next.push_back(Slot(std::vector<float>(level.begin() + begin, level.begin() + end), 0, 1));
    }
    level = std::move(next);
  }
  return level[0];
}

// The block partials of the documented order, written from the header's definition.
std::vector<float> ReferencePartials(const std::vector<uint8_t>& buf, DType d, size_t n) {
  std::vector<float> partials;
  for (size_t block = 0; block < n; block += 1024) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (size_t j = 0; block + j < n && j < 1024; ++j) {
      const float x = ToFloat(buf, d, block + j);
      acc[j % 8] = std::fma(x, x, acc[j % 8]);
    }
    partials.push_back(((acc[0] + acc[1]) + (acc[2] + acc[3])) +
                       ((acc[4] + acc[5]) + (acc[6] + acc[7])));
  }
  return partials;
}

TEST_CASE("SquaredNormF32: the documented fixed order, independent of SIMD level and threads",
          "[offload]") {
  SimdGuard guard;
  // 1024 * 1024 + 1 elements: 1025 partials, two tree levels with a padded chunk in each;
  // 2 * 1024 * 1024 + 5: 2049 partials, three chunks at the first level.
  int distinct_from_in_order = 0;
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{9}, size_t{1023},
                   size_t{1024}, size_t{1025}, size_t{100003}, size_t{1024 * 1024},
                   size_t{1024 * 1024 + 1}, size_t{2 * 1024 * 1024 + 5}}) {
    for (DType d : kDTypes) {
      const std::vector<uint8_t> x = RandomArray(n, d, static_cast<uint32_t>(n));
      const std::vector<float> partials = ReferencePartials(x, d, n);
      const float expected = ReferenceTreeSum(partials);
      if (n > 1024 * 1024) {  // the serial sum the tree replaced: the tests must tell them apart
        float in_order = 0.0f;
        for (float p : partials) in_order += p;
        distinct_from_in_order += FloatBits(in_order) != FloatBits(expected);
      }
      double exact = 0;
      for (size_t i = 0; i < n; ++i) exact += double(ToFloat(x, d, i)) * ToFloat(x, d, i);
      INFO("n=" << n << " dtype " << DTypeName(d));
      CHECK(std::fabs(expected - exact) <= 1e-5 * exact);  // and it is a good sum
      for (SimdLevel level : AvailableLevels()) {
        REQUIRE(ForceSimd(level).ok());
        for (int threads : {1, 2, 0}) {
          const float got = SquaredNormF32(x.data(), d, n, threads);
          INFO("level " << SimdLevelName(level) << " threads " << threads);
          CHECK(FloatBits(got) == FloatBits(expected));
        }
      }
    }
  }
  CHECK(distinct_from_in_order > 0);
}

TEST_CASE("NormTreeSum: the documented tree over every level, padding included", "[offload]") {
  // By hand: [2^-24, 2^-24, 1] pads to 1024; stride 2 gives v0 = 2^-24 + 1 = 1 (a tie, to even),
  // v1 = 2^-24; stride 1 gives 1 + 2^-24 = 1. In order it would be 1 + 2^-23.
  std::vector<float> tiny = {std::ldexp(1.0f, -24), std::ldexp(1.0f, -24), 1.0f};
  CHECK(FloatBits(NormTreeSum(tiny.data(), tiny.size())) == FloatBits(1.0f));
  float one = 3.5f;
  CHECK(FloatBits(NormTreeSum(&one, 1)) == FloatBits(3.5f));
  CHECK(FloatBits(NormTreeSum(nullptr, 0)) == FloatBits(0.0f));
  // 1024 * 1024 + 7 values: three levels (1025 chunks, then 2, then 1).
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-20, 20);
  for (size_t count : {size_t{2}, size_t{3}, size_t{511}, size_t{512}, size_t{513}, size_t{1023},
                       size_t{1024}, size_t{1025}, size_t{4097}, size_t{1024 * 1024},
                       size_t{1024 * 1024 + 7}}) {
    std::vector<float> values(count);
    for (float& v : values) v = std::ldexp(unit(rng), exponent(rng));
    const float expected = ReferenceTreeSum(values);
    INFO("count " << count);
    CHECK(FloatBits(NormTreeSum(values.data(), count)) == FloatBits(expected));
  }
  // Inf and NaN partials reach the result.
  std::vector<float> special(3000, 1.0f);
  special[2999] = INFINITY;
  CHECK(std::isinf(NormTreeSum(special.data(), special.size())));
  special.assign(3000, 1.0f);
  special[1500] = std::nanf("");
  CHECK(std::isnan(NormTreeSum(special.data(), special.size())));
}

TEST_CASE("AllFinite: finds one Inf or NaN anywhere, on every path", "[offload]") {
  SimdGuard guard;
  const size_t n = 70001;  // several thread ranges and a vector tail
  for (DType d : kDTypes) {
    std::vector<uint8_t> x = RandomArray(n, d, 4);
    for (SimdLevel level : AvailableLevels()) {
      REQUIRE(ForceSimd(level).ok());
      INFO("dtype " << DTypeName(d) << " level " << SimdLevelName(level));
      CHECK(AllFinite(x.data(), d, n, 0));
      CHECK(AllFinite(x.data(), d, 0, 0));
      for (size_t pos : {size_t{0}, size_t{5}, size_t{40000}, n - 1}) {
        for (float bad : {INFINITY, -INFINITY, std::nanf("")}) {
          std::vector<uint8_t> y = x;
          FromFloat(y, d, pos, bad);
          INFO("pos " << pos << " value " << bad);
          CHECK(!AllFinite(y.data(), d, n, 0));
          CHECK(!AllFinite(y.data(), d, n, 1));
        }
      }
      // Largest finite values are finite.
      std::vector<uint8_t> y = x;
      FromFloat(y, d, 3, d == DType::kF16 ? 65504.0f : 3.0e38f);
      CHECK(AllFinite(y.data(), d, n, 0));
    }
  }
}

TEST_CASE("Cast: every half bit pattern widens as base/dtype.h does", "[offload]") {
  SimdGuard guard;
  std::vector<uint16_t> all(65536);
  for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  for (SimdLevel level : AvailableLevels()) {
    REQUIRE(ForceSimd(level).ok());
    for (DType d : {DType::kBF16, DType::kF16}) {
      std::vector<float> out(65536);
      Cast(all.data(), d, out.data(), DType::kF32, all.size(), 0);
      size_t mismatches = 0;
      for (uint32_t i = 0; i < 65536; ++i) {
        const float ref = d == DType::kBF16 ? Bf16ToFloat(all[i]) : HalfToFloat(all[i]);
        mismatches += FloatBits(out[i]) != FloatBits(ref);
      }
      INFO("dtype " << DTypeName(d) << " level " << SimdLevelName(level));
      CHECK(mismatches == 0);
    }
  }
}

TEST_CASE("Cast: fp32 narrowing rounds as base/dtype.h on random and special bit patterns",
          "[offload]") {
  SimdGuard guard;
  std::mt19937 rng(1);
  std::vector<float> src;
  // Every special region: zeros, subnormals of both types, rounding ties, overflow, Inf, NaNs.
  for (uint32_t bits : {0x00000000u, 0x80000000u, 0x00000001u, 0x33000000u, 0x33000001u,
                        0x387fc000u, 0x38800000u, 0x477fe000u, 0x477fefffu, 0x477ff000u,
                        0x7f7fffffu, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u,
                        0xffbfffffu, 0x3f808000u, 0x3f818000u, 0x3f800fffu, 0x3f801000u}) {
    src.push_back(BitsToFloat(bits));
  }
  for (int i = 0; i < 200000; ++i) src.push_back(BitsToFloat(rng()));
  const size_t n = src.size();
  for (SimdLevel level : AvailableLevels()) {
    REQUIRE(ForceSimd(level).ok());
    for (DType d : {DType::kBF16, DType::kF16}) {
      std::vector<uint16_t> out(n);
      Cast(src.data(), DType::kF32, out.data(), d, n, 0);
      size_t mismatches = 0;
      for (size_t i = 0; i < n; ++i) {
        const uint16_t ref = d == DType::kBF16 ? FloatToBf16(src[i]) : FloatToHalf(src[i]);
        mismatches += out[i] != ref;
      }
      INFO("dtype " << DTypeName(d) << " level " << SimdLevelName(level));
      CHECK(mismatches == 0);
    }
  }
}

TEST_CASE("Scale and half-to-half Cast equal the scalar conversion of the fp32 product",
          "[offload]") {
  SimdGuard guard;
  const size_t n = 50021;
  for (SimdLevel level : AvailableLevels()) {
    REQUIRE(ForceSimd(level).ok());
    for (DType d : kDTypes) {
      const std::vector<uint8_t> x = RandomArray(n, d, 8);
      std::vector<uint8_t> scaled = x;
      Scale(scaled.data(), d, n, 1.0f / 3, 0);
      std::vector<uint8_t> expected(x.size());
      for (size_t i = 0; i < n; ++i) FromFloat(expected, d, i, ToFloat(x, d, i) * (1.0f / 3));
      INFO("dtype " << DTypeName(d) << " level " << SimdLevelName(level));
      CHECK(scaled == expected);
      for (DType to : kDTypes) {
        std::vector<uint8_t> cast(n * DTypeSize(to));
        Cast(x.data(), d, cast.data(), to, n, 0);
        std::vector<uint8_t> ref(cast.size());
        for (size_t i = 0; i < n; ++i) FromFloat(ref, to, i, ToFloat(x, d, i));
        INFO("to " << DTypeName(to));
        CHECK(cast == ref);
      }
    }
  }
}

}  // namespace
}  // namespace offload
}  // namespace zerort
