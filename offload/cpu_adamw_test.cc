#include "offload/cpu_adamw.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "base/dtype.h"
#include "offload/simd.h"
#include "offload/testing/simd_levels.h"

namespace zerort {
namespace offload {
namespace {

constexpr double kLr = 1e-3, kBeta1 = 0.9, kBeta2 = 0.95, kEps = 1e-8, kWd = 0.1;

// One optimizer state plus a gradient, held in plain vectors.
struct State {
  std::vector<float> master, m, v;
  std::vector<uint16_t> grad16;  // bf16 / fp16 bits
  std::vector<float> grad32;
  std::vector<uint8_t> out;      // param_out bytes
  DType grad_dtype, param_dtype;
  bool with_out;

  AdamWArrays Arrays() {
    AdamWArrays a;
    a.master = master.data();
    a.m = m.data();
    a.v = v.data();
    a.grad = grad_dtype == DType::kF32 ? static_cast<const void*>(grad32.data())
                                       : static_cast<const void*>(grad16.data());
    a.grad_dtype = grad_dtype;
    a.param_out = with_out ? out.data() : nullptr;
    a.param_dtype = param_dtype;
    a.n = master.size();
    return a;
  }
  // The gradient as the kernel sees it (exactly widened to fp32).
  float Grad(size_t i) const {
    switch (grad_dtype) {
      case DType::kF32:
        return grad32[i];
      case DType::kBF16:
        return Bf16ToFloat(grad16[i]);
      case DType::kF16:
        return HalfToFloat(grad16[i]);
    }
    return 0;
  }
};

// Gradients over a wide range of magnitudes (with the fp16-representable range for fp16), some
// exact zeros; params away from zero so relative errors are meaningful.
State RandomState(size_t n, DType grad_dtype, DType param_dtype, bool with_out, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(grad_dtype == DType::kF16 ? -20 : -40, 6);
  State s;
  s.grad_dtype = grad_dtype;
  s.param_dtype = param_dtype;
  s.with_out = with_out;
  s.master.resize(n);
  s.m.resize(n);
  s.v.resize(n);
  s.grad32.resize(n);
  s.grad16.resize(n);
  s.out.assign(n * DTypeSize(param_dtype), 0);
  for (size_t i = 0; i < n; ++i) {
    const float u = unit(rng);
    s.master[i] = (u < 0 ? -0.5f : 0.5f) + u;
    s.m[i] = 1e-3f * unit(rng);
    s.v[i] = 1e-6f * std::fabs(unit(rng));
    float g = (i % 17 == 3) ? 0.0f : std::ldexp(unit(rng), exponent(rng));
    s.grad32[i] = g;
    s.grad16[i] = grad_dtype == DType::kBF16 ? FloatToBf16(g) : FloatToHalf(g);
  }
  return s;
}

// Independent reference: textbook AdamW in double (bias-corrected moments, decoupled decay).
struct Reference {
  std::vector<double> p, m, v;
  void Step(const State& s, double grad_scale, int t) {
    const double bc1 = 1 - std::pow(kBeta1, t), bc2 = 1 - std::pow(kBeta2, t);
    for (size_t i = 0; i < p.size(); ++i) {
      const double g = static_cast<double>(s.Grad(i)) * grad_scale;
      m[i] = kBeta1 * m[i] + (1 - kBeta1) * g;
      v[i] = kBeta2 * v[i] + (1 - kBeta2) * g * g;
      const double mhat = m[i] / bc1, vhat = v[i] / bc2;
      p[i] = p[i] * (1 - kLr * kWd) - kLr * mhat / (std::sqrt(vhat) + kEps);
    }
  }
};

AdamWStepParams Params(int t) {
  auto p = MakeAdamWStepParams(kLr, kBeta1, kBeta2, kEps, kWd, t);
  REQUIRE(p.ok());
  return *p;
}

bool SameBits(const void* a, const void* b, size_t bytes) {
  return bytes == 0 || std::memcmp(a, b, bytes) == 0;
}

using testing::AvailableLevels;
using testing::SimdGuard;

const DType kDTypes[] = {DType::kF32, DType::kBF16, DType::kF16};

TEST_CASE("CpuAdamW: matches a double-precision AdamW within 1e-6 relative over 5 steps",
          "[offload]") {
  const size_t n = 20011;
  const double grad_scale = 1.0 / 256;
  for (DType gd : kDTypes) {
    State s = RandomState(n, gd, DType::kBF16, /*with_out=*/true, 11);
    Reference ref{std::vector<double>(s.master.begin(), s.master.end()),
                  std::vector<double>(s.m.begin(), s.m.end()),
                  std::vector<double>(s.v.begin(), s.v.end())};
    for (int t = 1; t <= 5; ++t) {
      REQUIRE(CpuAdamW(s.Arrays(), Params(t), static_cast<float>(grad_scale), 0).ok());
      ref.Step(s, grad_scale, t);
    }
    double worst = 0;
    for (size_t i = 0; i < n; ++i) {
      worst = std::max(worst, std::fabs(s.master[i] - ref.p[i]) / std::fabs(ref.p[i]));
      // The compute-dtype copy is the master rounded once (base/dtype.h is the reference).
      uint16_t out;
      std::memcpy(&out, &s.out[2 * i], 2);
      REQUIRE(out == FloatToBf16(s.master[i]));
    }
    INFO("grad dtype " << DTypeName(gd) << ", worst relative error " << worst);
    CHECK(worst < 1e-6);
  }
}

TEST_CASE("CpuAdamW: every SIMD level equals the scalar path bitwise, any length and dtype",
          "[offload]") {
  SimdGuard guard;
  const size_t lengths[] = {0, 1, 7, 8, 9, 15, 16, 17, 1023, 100003};
  for (size_t n : lengths) {
    for (DType gd : kDTypes) {
      for (DType pd : kDTypes) {
        for (bool with_out : {true, false}) {
          if (!with_out && pd != DType::kF32) continue;  // no output: param dtype irrelevant
          std::vector<State> results;
          for (SimdLevel level : AvailableLevels()) {
            REQUIRE(ForceSimd(level).ok());
            State s = RandomState(n, gd, pd, with_out, static_cast<uint32_t>(n + 1));
            for (int t = 1; t <= 3; ++t) {
              REQUIRE(CpuAdamW(s.Arrays(), Params(t), 0.75f, 1).ok());
            }
            results.push_back(std::move(s));
          }
          for (size_t k = 1; k < results.size(); ++k) {
            INFO("n=" << n << " grad " << DTypeName(gd) << " param " << DTypeName(pd)
                      << " out=" << with_out << " level " << k);
            CHECK(SameBits(results[k].master.data(), results[0].master.data(), 4 * n));
            CHECK(SameBits(results[k].m.data(), results[0].m.data(), 4 * n));
            CHECK(SameBits(results[k].v.data(), results[0].v.data(), 4 * n));
            CHECK(results[k].out == results[0].out);
          }
        }
      }
    }
  }
}

TEST_CASE("CpuAdamW: any thread count gives the single-thread result bitwise", "[offload]") {
  const size_t n = 300007;
  State single = RandomState(n, DType::kBF16, DType::kBF16, true, 5);
  REQUIRE(CpuAdamW(single.Arrays(), Params(1), 0.5f, 1).ok());
  for (int threads : {0, 2, 3, 7}) {
    State s = RandomState(n, DType::kBF16, DType::kBF16, true, 5);
    REQUIRE(CpuAdamW(s.Arrays(), Params(1), 0.5f, threads).ok());
    INFO("threads=" << threads);
    CHECK(SameBits(s.master.data(), single.master.data(), 4 * n));
    CHECK(SameBits(s.m.data(), single.m.data(), 4 * n));
    CHECK(SameBits(s.v.data(), single.v.data(), 4 * n));
    CHECK(s.out == single.out);
  }
}

// Per-range constants: ranges of odd lengths (so vector loops end early at every boundary),
// each with its own lr and weight decay, as parameter groups give them.
std::vector<AdamWRange> GroupRanges(size_t n, int t) {
  const size_t cuts[] = {0, 13, 13, 1000, 1003, 40000, n};
  const double lr[] = {1e-3, 5e-4, 2e-3, 1e-3, 0.0, 3e-3};
  const double wd[] = {0.1, 0.0, 0.5, 0.0, 0.1, 0.01};
  std::vector<AdamWRange> ranges;
  for (int k = 0; k < 6; ++k) {
    auto p = MakeAdamWStepParams(lr[k], kBeta1, kBeta2, kEps, wd[k], t);
    REQUIRE(p.ok());
    ranges.push_back({cuts[k], cuts[k + 1], *p});
  }
  return ranges;
}

TEST_CASE("CpuAdamW: per-range constants equal one call per range, bitwise, any threads",
          "[offload]") {
  SimdGuard guard;
  const size_t n = 70001;
  for (SimdLevel level : AvailableLevels()) {
    REQUIRE(ForceSimd(level).ok());
    for (int threads : {1, 3}) {
      State grouped = RandomState(n, DType::kBF16, DType::kBF16, true, 21);
      State split = RandomState(n, DType::kBF16, DType::kBF16, true, 21);
      for (int t = 1; t <= 3; ++t) {
        const std::vector<AdamWRange> ranges = GroupRanges(n, t);
        REQUIRE(CpuAdamW(grouped.Arrays(), ranges, 0.5f, threads).ok());
        for (const AdamWRange& r : ranges) {
          AdamWArrays a = split.Arrays();
          a.master += r.begin;
          a.m += r.begin;
          a.v += r.begin;
          a.grad = split.grad16.data() + r.begin;
          a.param_out = split.out.data() + 2 * r.begin;
          a.n = r.end - r.begin;
          REQUIRE(CpuAdamW(a, r.params, 0.5f, 1).ok());
        }
      }
      INFO("level " << static_cast<int>(level) << " threads=" << threads);
      CHECK(SameBits(grouped.master.data(), split.master.data(), 4 * n));
      CHECK(SameBits(grouped.m.data(), split.m.data(), 4 * n));
      CHECK(SameBits(grouped.v.data(), split.v.data(), 4 * n));
      CHECK(grouped.out == split.out);
      // The ranges really took different constants: lr 0 left its range's masters alone.
      State fresh = RandomState(n, DType::kBF16, DType::kBF16, true, 21);
      CHECK(SameBits(grouped.master.data() + 1003, fresh.master.data() + 1003, 4 * 38997));
      CHECK(!SameBits(grouped.master.data(), fresh.master.data(), 4 * 13));
    }
  }
}

TEST_CASE("CpuAdamW: ranges that do not tile the array are InvalidArgument", "[offload]") {
  State s = RandomState(100, DType::kF32, DType::kF32, false, 1);
  const AdamWStepParams p = Params(1);
  const std::vector<std::vector<AdamWRange>> bad = {
      {{0, 50, p}},                   // short
      {{0, 50, p}, {60, 100, p}},     // a gap
      {{0, 60, p}, {50, 100, p}},     // an overlap
      {{0, 120, p}},                  // past the end
  };
  for (const auto& ranges : bad) {
    const absl::Status st = CpuAdamW(s.Arrays(), ranges, 1.0f, 1);
    CHECK(st.code() == absl::StatusCode::kInvalidArgument);
    CHECK(st.message().find("CpuAdamW") != std::string::npos);
  }
  const std::vector<AdamWRange> fine = {{0, 0, p}, {0, 100, p}, {100, 100, p}};
  CHECK(CpuAdamW(s.Arrays(), fine, 1.0f, 1).ok());
}

TEST_CASE("CpuAdamW: NaN and Inf gradients propagate, identically on every path", "[offload]") {
  SimdGuard guard;
  const size_t n = 100;
  std::vector<State> results;
  for (SimdLevel level : AvailableLevels()) {
    REQUIRE(ForceSimd(level).ok());
    State s = RandomState(n, DType::kF32, DType::kBF16, true, 3);
    s.grad32[10] = std::nanf("");
    s.grad32[41] = INFINITY;
    s.grad32[42] = -INFINITY;
    // An infinite second moment stays infinite and freezes the element (m / inf = 0): only the
    // weight decay applies.
    s.v[77] = INFINITY;
    const float before77 = s.master[77];
    REQUIRE(CpuAdamW(s.Arrays(), Params(1), 1.0f, 1).ok());
    CHECK(std::isinf(s.v[77]));
    CHECK(s.master[77] == before77 * Params(1).decay);
    for (size_t i = 0; i < n; ++i) {
      const bool poisoned = i == 10 || i == 41 || i == 42;
      INFO("i=" << i);
      CHECK(std::isnan(s.master[i]) == poisoned);
      uint16_t out;
      std::memcpy(&out, &s.out[2 * i], 2);
      CHECK(((out & 0x7f80) == 0x7f80 && (out & 0x7f) != 0) == poisoned);
    }
    results.push_back(std::move(s));
  }
  for (size_t k = 1; k < results.size(); ++k) {
    CHECK(SameBits(results[k].master.data(), results[0].master.data(), 4 * n));
    CHECK(SameBits(results[k].m.data(), results[0].m.data(), 4 * n));
    CHECK(SameBits(results[k].v.data(), results[0].v.data(), 4 * n));
    CHECK(results[k].out == results[0].out);
  }
}

TEST_CASE("CpuAdamW: fp32 params may be written in place over the master", "[offload]") {
  State a = RandomState(1001, DType::kBF16, DType::kF32, false, 9);
  State b = a;
  REQUIRE(CpuAdamW(a.Arrays(), Params(2), 1.0f, 0).ok());
  AdamWArrays in_place = b.Arrays();
  in_place.param_out = b.master.data();
  in_place.param_dtype = DType::kF32;
  REQUIRE(CpuAdamW(in_place, Params(2), 1.0f, 0).ok());
  CHECK(SameBits(a.master.data(), b.master.data(), 4 * 1001));
}

TEST_CASE("CpuAdamW: step constants follow the closed form and bad values name the key",
          "[offload]") {
  for (int t : {1, 2, 10, 1000}) {
    const AdamWStepParams p = Params(t);
    CHECK(p.step_size == static_cast<float>(kLr / (1 - std::pow(kBeta1, t))));
    CHECK(p.inv_sqrt_bias2 == static_cast<float>(1 / std::sqrt(1 - std::pow(kBeta2, t))));
    CHECK(p.decay == static_cast<float>(1 - kLr * kWd));
    CHECK(p.one_minus_beta1 == static_cast<float>(1 - kBeta1));
    CHECK(p.one_minus_beta2 == static_cast<float>(1 - kBeta2));
  }
  struct Bad {
    double lr, b1, b2, eps, wd;
    int64_t step;
    const char* key;
  };
  for (const Bad& bad : {Bad{-1, 0.9, 0.95, 1e-8, 0, 1, "lr"}, Bad{1e-3, 1.0, 0.95, 1e-8, 0, 1, "beta1"},
                         Bad{1e-3, 0.9, -0.1, 1e-8, 0, 1, "beta2"}, Bad{1e-3, 0.9, 0.95, 0, 0, 1, "eps"},
                         Bad{1e-3, 0.9, 0.95, 1e-8, -1, 1, "weight_decay"},
                         Bad{1e-3, 0.9, 0.95, 1e-8, 0, 0, "step"},
                         Bad{NAN, 0.9, 0.95, 1e-8, 0, 1, "lr"}}) {
    auto p = MakeAdamWStepParams(bad.lr, bad.b1, bad.b2, bad.eps, bad.wd, bad.step);
    REQUIRE(p.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(p.status().message()).find(bad.key) != std::string::npos);
  }
}

TEST_CASE("CpuAdamW: null arrays and negative threads are InvalidArgument", "[offload]") {
  State s = RandomState(10, DType::kF32, DType::kBF16, true, 1);
  AdamWArrays a = s.Arrays();
  CHECK(CpuAdamW(a, Params(1), 1.0f, -1).code() == absl::StatusCode::kInvalidArgument);
  a.v = nullptr;
  CHECK(CpuAdamW(a, Params(1), 1.0f, 0).code() == absl::StatusCode::kInvalidArgument);
  a.n = 0;  // nothing to do: nothing is dereferenced
  CHECK(CpuAdamW(a, Params(1), 1.0f, 0).ok());
}

TEST_CASE("Simd: forcing a level the CPU lacks is FailedPrecondition", "[offload]") {
  SimdGuard guard;
  REQUIRE(ForceSimd(SimdLevel::kScalar).ok());
  CHECK(ActiveSimd() == SimdLevel::kScalar);
  ResetSimd();
  CHECK(ActiveSimd() == DetectSimd());
  if (DetectSimd() < SimdLevel::kAvx512) {
    CHECK(ForceSimd(SimdLevel::kAvx512).code() == absl::StatusCode::kFailedPrecondition);
  }
}

}  // namespace
}  // namespace offload
}  // namespace zerort
