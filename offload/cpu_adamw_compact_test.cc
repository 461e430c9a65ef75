// CpuAdamWCompact against two references: CpuAdamW itself (the fp32-master path, scalar level)
// where the form must equal it, and a scalar loop written here for every form.
#include "offload/cpu_adamw_compact.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "base/dtype.h"
#include "offload/compact_state.h"
#include "offload/cpu_adamw.h"
#include "offload/simd.h"
#include "offload/testing/simd_levels.h"

namespace zerort {
namespace offload {
namespace {

constexpr double kBeta1 = 0.9, kBeta2 = 0.95, kEps = 1e-8, kWd = 0.1;

AdamWStepParams Params(int t, double lr = 1e-3, double wd = kWd) {
  auto p = MakeAdamWStepParams(lr, kBeta1, kBeta2, kEps, wd, t);
  REQUIRE(p.ok());
  return *p;
}

using testing::AvailableLevels;
using testing::SimdGuard;

// Masters that stress the encodings: ties with even and odd lower neighbours, the carry into
// the largest finite value, subnormals, zeros, infinities and a quiet NaN.
constexpr uint32_t kSpecialMasters[] = {
    0x3f808000, 0x3f818000, 0xbf808000, 0x7f7fffff, 0x7f7f8000, 0xff7fffff, 0x00000001,
    0x0000ffff, 0x00008000, 0x007fffff, 0x80018000, 0x00000000, 0x80000000, 0x7f800000,
    0xff800000, 0x7fc00000, 0x3fffffff, 0x407f8000};

// The fp32 state every form starts from: masters away from zero (so the update is visible),
// specials at every 53rd element, gradients over many magnitudes.
struct Fp32State {
  std::vector<float> master, m, v, grad32;
  std::vector<uint16_t> grad16;
  DType grad_dtype;
  const void* grad() const {
    return grad_dtype == DType::kF32 ? static_cast<const void*>(grad32.data())
                                     : static_cast<const void*>(grad16.data());
  }
};

Fp32State RandomState(size_t n, DType grad_dtype, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(grad_dtype == DType::kF16 ? -20 : -40, 6);
  Fp32State s;
  s.grad_dtype = grad_dtype;
  s.master.resize(n);
  s.m.resize(n);
  s.v.resize(n);
  s.grad32.resize(n);
  s.grad16.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const float u = unit(rng);
    s.master[i] = i % 53 == 3 ? BitsToFloat(kSpecialMasters[(i / 53) % 18])
                              : (u < 0 ? -0.5f : 0.5f) + u;
    s.m[i] = 1e-3f * unit(rng);
    s.v[i] = 1e-6f * std::fabs(unit(rng));
    const float g = (i % 17 == 3) ? 0.0f : std::ldexp(unit(rng), exponent(rng));
    s.grad32[i] = g;
    s.grad16[i] = grad_dtype == DType::kBF16 ? FloatToBf16(g) : FloatToHalf(g);
  }
  return s;
}

// One form's storage, filled from an Fp32State.
struct Compact {
  MasterForm form;
  DType moment_dtype;
  std::vector<float> master, m32, v32;
  std::vector<uint16_t> param, rem, m16, v16;
  const Fp32State* grads;
  StochasticRounding rounding;

  CompactAdamWArrays Arrays() {
    CompactAdamWArrays a;
    a.master_form = form;
    a.master = form == MasterForm::kF32 ? master.data() : nullptr;
    a.remainder = form == MasterForm::kBf16Remainder ? rem.data() : nullptr;
    a.param = param.data();
    a.param_dtype = DType::kBF16;
    const bool bf16 = moment_dtype == DType::kBF16;
    a.m = bf16 ? static_cast<void*>(m16.data()) : static_cast<void*>(m32.data());
    a.v = bf16 ? static_cast<void*>(v16.data()) : static_cast<void*>(v32.data());
    a.moment_dtype = moment_dtype;
    a.grad = grads->grad();
    a.grad_dtype = grads->grad_dtype;
    a.n = param.size();
    a.rounding = rounding;
    return a;
  }
  float Master(size_t i) const {
    if (form == MasterForm::kF32) return master[i];
    if (form == MasterForm::kBf16Remainder) return JoinMaster(param[i], rem[i]);
    return Bf16ToFloat(param[i]);
  }
  float M(size_t i) const { return moment_dtype == DType::kBF16 ? Bf16ToFloat(m16[i]) : m32[i]; }
  float V(size_t i) const { return moment_dtype == DType::kBF16 ? Bf16ToFloat(v16[i]) : v32[i]; }
  void SetMoments(size_t i, float m, float v) {
    if (moment_dtype == DType::kBF16) {
      m16[i] = FloatToBf16(m);
      v16[i] = FloatToBf16(v);
    } else {
      m32[i] = m;
      v32[i] = v;
    }
  }
  void SetMaster(size_t i, float x) {
    if (form == MasterForm::kF32) {
      master[i] = x;
      param[i] = FloatToBf16(x);
    } else if (form == MasterForm::kBf16Remainder) {
      SplitMaster(x, &param[i], &rem[i]);
    } else {
      const uint64_t index = rounding.first_index + i;
      const uint32_t key = StochasticKey(rounding.seed, rounding.step, IndexHigh(index));
      param[i] = Bf16Stochastic(x, StochasticBits(key, IndexLow(index)));
    }
  }
  bool operator==(const Compact& o) const {
    // Bits, not values: NaN masters must match too.
    return param == o.param && rem == o.rem && m16 == o.m16 &&
           v16 == o.v16 && SameFloats(m32, o.m32) && SameFloats(v32, o.v32) &&
           SameFloats(master, o.master);
  }
  static bool SameFloats(const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() &&
           (a.empty() || std::memcmp(a.data(), b.data(), 4 * a.size()) == 0);
  }
};

Compact MakeCompact(const Fp32State& s, MasterForm form, DType moment_dtype) {
  const size_t n = s.master.size();
  Compact c{form, moment_dtype, {}, {}, {}, std::vector<uint16_t>(n), {}, {}, {}, &s, {}};
  c.rounding = {/*seed=*/1234, /*step=*/1, /*first_index=*/0};
  if (form == MasterForm::kBf16Remainder) c.rem.resize(n);
  if (form == MasterForm::kF32) c.master.resize(n);
  if (moment_dtype == DType::kBF16) {
    c.m16.resize(n);
    c.v16.resize(n);
  } else {
    c.m32.resize(n);
    c.v32.resize(n);
  }
  for (size_t i = 0; i < n; ++i) {
    c.SetMaster(i, s.master[i]);
    c.SetMoments(i, s.m[i], s.v[i]);
  }
  return c;
}

// The reference: CpuAdamW's op sequence, one element at a time, through the form's encodings.
void ReferenceStep(Compact& c, const AdamWStepParams& s, float grad_scale) {
  for (size_t i = 0; i < c.param.size(); ++i) {
    const float g = LoadAs(c.grads->grad_dtype, c.grads->grad(), i) * grad_scale;
    const float m = std::fma(s.beta1, c.M(i), s.one_minus_beta1 * g);
    const float v = std::fma(s.beta2, c.V(i), (s.one_minus_beta2 * g) * g);
    const float denom = std::fma(std::sqrt(v), s.inv_sqrt_bias2, s.eps);
    const float p = std::fma(-s.step_size, m / denom, c.Master(i) * s.decay);
    c.SetMoments(i, m, v);
    c.SetMaster(i, p);
  }
}

const DType kGradDTypes[] = {DType::kF32, DType::kBF16, DType::kF16};
const MasterForm kForms[] = {MasterForm::kF32, MasterForm::kBf16Remainder,
                             MasterForm::kBf16Stochastic};

TEST_CASE("CpuAdamWCompact: every form, SIMD level and length equals the scalar reference",
          "[offload]") {
  SimdGuard guard;
  const size_t lengths[] = {0, 1, 7, 8, 9, 15, 16, 17, 1023, 100003};
  for (size_t n : lengths) {
    for (DType gd : kGradDTypes) {
      const Fp32State s = RandomState(n, gd, static_cast<uint32_t>(n + 7));
      for (MasterForm form : kForms) {
        for (DType md : {DType::kF32, DType::kBF16}) {
          Compact ref = MakeCompact(s, form, md);
          std::vector<Compact> got(AvailableLevels().size(), ref);
          for (int t = 1; t <= 3; ++t) {
            ref.rounding.step = got[0].rounding.step = t;
            ReferenceStep(ref, Params(t), 0.75f);
            for (size_t k = 0; k < got.size(); ++k) {
              REQUIRE(ForceSimd(AvailableLevels()[k]).ok());
              got[k].rounding.step = t;
              REQUIRE(CpuAdamWCompact(got[k].Arrays(), Params(t), 0.75f, 1).ok());
            }
          }
          for (size_t k = 0; k < got.size(); ++k) {
            INFO("n=" << n << " grad " << DTypeName(gd) << " form " << MasterFormName(form)
                      << " moments " << DTypeName(md) << " level " << k);
            CHECK(got[k] == ref);
          }
        }
      }
    }
  }
}

TEST_CASE("CpuAdamWCompact: the fp32 form with fp32 moments is CpuAdamW bit for bit",
          "[offload]") {
  SimdGuard guard;
  const Fp32State s = RandomState(30011, DType::kBF16, 5);
  REQUIRE(ForceSimd(SimdLevel::kScalar).ok());
  std::vector<float> master = s.master, m = s.m, v = s.v;
  std::vector<uint16_t> param(s.master.size());
  const AdamWArrays plain{master.data(), m.data(), v.data(), s.grad(),
                          s.grad_dtype,  param.data(), DType::kBF16, master.size()};
  for (int t = 1; t <= 3; ++t) REQUIRE(CpuAdamW(plain, Params(t), 0.5f, 1).ok());
  for (SimdLevel level : AvailableLevels()) {
    REQUIRE(ForceSimd(level).ok());
    Compact c = MakeCompact(s, MasterForm::kF32, DType::kF32);
    for (int t = 1; t <= 3; ++t) REQUIRE(CpuAdamWCompact(c.Arrays(), Params(t), 0.5f, 2).ok());
    CHECK(Compact::SameFloats(c.master, master));
    CHECK(Compact::SameFloats(c.m32, m));
    CHECK(Compact::SameFloats(c.v32, v));
    CHECK(c.param == param);
  }
}

// Checks a remainder-form state against CpuAdamW's fp32 master and its nearest-even bf16 copy:
// the master whole, the parameter equal except on the ties SplitMaster moves.
void CheckAgainstFp32Path(const Compact& c, const std::vector<float>& master,
                          const std::vector<uint16_t>& param) {
  for (size_t i = 0; i < master.size(); ++i) {
    const uint32_t want = FloatBits(master[i]);
    INFO("i=" << i << " master bits 0x" << std::hex << want);
    REQUIRE(FloatBits(c.Master(i)) == want);
    const bool moved_tie = (want & 0xffffu) == 0x8000u && (want >> 16) % 2 == 0 &&
                           (want & 0x7fffffffu) < 0x7f800000u;
    REQUIRE(c.param[i] == (moved_tie ? param[i] + 1 : param[i]));
  }
}

TEST_CASE("CpuAdamWCompact: the remainder form keeps CpuAdamW's master bit for bit",
          "[offload]") {
  SimdGuard guard;
  for (DType gd : kGradDTypes) {
    Fp32State s = RandomState(20011, gd, 17);
    s.grad32[100] = std::nanf("");  // a NaN master from arithmetic (the default NaN)
    s.grad16[100] = gd == DType::kBF16 ? FloatToBf16(s.grad32[100]) : FloatToHalf(s.grad32[100]);
    REQUIRE(ForceSimd(SimdLevel::kScalar).ok());
    std::vector<float> master = s.master, m = s.m, v = s.v;
    std::vector<uint16_t> param(master.size());
    const AdamWArrays plain{master.data(), m.data(), v.data(), s.grad(),
                            gd,            param.data(), DType::kBF16, master.size()};
    std::vector<Compact> got;
    for (SimdLevel level : AvailableLevels()) {
      (void)level;
      got.push_back(MakeCompact(s, MasterForm::kBf16Remainder, DType::kF32));
    }
    for (int t = 1; t <= 4; ++t) {
      REQUIRE(ForceSimd(SimdLevel::kScalar).ok());
      REQUIRE(CpuAdamW(plain, Params(t), 0.5f, 1).ok());
      for (size_t k = 0; k < got.size(); ++k) {
        REQUIRE(ForceSimd(AvailableLevels()[k]).ok());
        REQUIRE(CpuAdamWCompact(got[k].Arrays(), Params(t), 0.5f, 0).ok());
        CheckAgainstFp32Path(got[k], master, param);
        CHECK(Compact::SameFloats(got[k].m32, m));
        CHECK(Compact::SameFloats(got[k].v32, v));
      }
    }
    CHECK(std::isnan(got[0].Master(100)));
  }
}

TEST_CASE("CpuAdamWCompact: the remainder form's vector codec over all 2^16 low halves",
          "[offload]") {
  // lr = 0 and no decay leave every master as it was (grad, m, v zero: the update is -0), so
  // each path must store exactly SplitMaster of the master it loaded.
  SimdGuard guard;
  const uint32_t highs[] = {0x0000, 0x0080, 0x3f80, 0x3f81, 0x7f7f, 0x7fc0, 0x8001, 0xff7f};
  const size_t n = 0x10000 * 8;
  Fp32State s;
  s.grad_dtype = DType::kF32;
  s.master.resize(n);
  s.m.assign(n, 0.0f);
  s.v.assign(n, 0.0f);
  s.grad32.assign(n, 0.0f);
  for (size_t i = 0; i < n; ++i) {
    s.master[i] = BitsToFloat((highs[i >> 16] << 16) | static_cast<uint32_t>(i & 0xffff));
  }
  for (SimdLevel level : AvailableLevels()) {
    REQUIRE(ForceSimd(level).ok());
    Compact c = MakeCompact(s, MasterForm::kBf16Remainder, DType::kF32);
    const Compact before = c;
    REQUIRE(CpuAdamWCompact(c.Arrays(), Params(1, /*lr=*/0.0, /*wd=*/0.0), 1.0f, 0).ok());
    INFO("level " << SimdLevelName(level));
    // (No signaling NaN among the highs: the arithmetic would quiet it, as in CpuAdamW.)
    for (size_t i = 0; i < n; ++i) REQUIRE(FloatBits(c.Master(i)) == FloatBits(s.master[i]));
    CHECK(c.param == before.param);
    CHECK(c.rem == before.rem);
  }
}

TEST_CASE("CpuAdamWCompact: bf16 moments stay within half a bf16 ulp of fp32 moments",
          "[offload]") {
  const Fp32State s = RandomState(10007, DType::kF32, 23);
  Compact f32 = MakeCompact(s, MasterForm::kF32, DType::kF32);
  Compact bf16 = MakeCompact(s, MasterForm::kF32, DType::kBF16);
  // Start both from the same (bf16-representable) moments.
  for (size_t i = 0; i < s.m.size(); ++i) {
    f32.m32[i] = Bf16ToFloat(bf16.m16[i]);
    f32.v32[i] = Bf16ToFloat(bf16.v16[i]);
  }
  REQUIRE(CpuAdamWCompact(f32.Arrays(), Params(1), 1.0f, 0).ok());
  REQUIRE(CpuAdamWCompact(bf16.Arrays(), Params(1), 1.0f, 0).ok());
  for (size_t i = 0; i < s.m.size(); ++i) {
    INFO("i=" << i);
    // Nearest rounding to 8 significant bits: relative error at most the unit roundoff 2^-8.
    CHECK(std::fabs(bf16.M(i) - f32.m32[i]) <= std::ldexp(std::fabs(f32.m32[i]), -8));
    CHECK(std::fabs(bf16.V(i) - f32.v32[i]) <= std::ldexp(std::fabs(f32.v32[i]), -8));
    // The update used the fp32 moments of the step, so the masters agree.
    CHECK(FloatBits(bf16.master[i]) == FloatBits(f32.master[i]));
  }
}

// Runs the stochastic form over [0, n) cut at `cuts`, each piece a call of its own with its
// first_index, and returns the result.
Compact RunInPieces(const Fp32State& s, DType md, uint64_t first_index,
                    const std::vector<size_t>& cuts, int threads) {
  Compact c = MakeCompact(s, MasterForm::kBf16Stochastic, md);
  c.rounding = {99, 5, first_index};
  for (size_t k = 0; k + 1 < cuts.size(); ++k) {
    CompactAdamWArrays a = c.Arrays();
    const size_t b = cuts[k], e = cuts[k + 1];
    a.param = c.param.data() + b;
    const size_t moment_bytes = DTypeSize(md);
    a.m = static_cast<char*>(a.m) + b * moment_bytes;
    a.v = static_cast<char*>(a.v) + b * moment_bytes;
    a.grad = static_cast<const char*>(a.grad) + b * DTypeSize(s.grad_dtype);
    a.n = e - b;
    a.rounding.first_index = first_index + b;
    REQUIRE(CpuAdamWCompact(a, Params(5), 1.0f, threads).ok());
  }
  return c;
}

TEST_CASE("CpuAdamWCompact: stochastic rounding ignores shard cuts, threads and SIMD level",
          "[offload]") {
  SimdGuard guard;
  const size_t n = 100003;
  const Fp32State s = RandomState(n, DType::kBF16, 31);
  // Near a 2^32 boundary of the global index too: the key changes inside the array.
  for (uint64_t first : {uint64_t{0}, uint64_t{77}, (uint64_t{1} << 32) - 50000}) {
    for (DType md : {DType::kF32, DType::kBF16}) {
      Compact ref = MakeCompact(s, MasterForm::kBf16Stochastic, md);
      ref.rounding = {99, 5, first};
      ReferenceStep(ref, Params(5), 1.0f);
      for (SimdLevel level : AvailableLevels()) {
        REQUIRE(ForceSimd(level).ok());
        for (int threads : {1, 3}) {
          const std::vector<std::vector<size_t>> splits = {
              {0, n}, {0, 5, 1000, 1003, 49999, 50000, n}, {0, 1, 64, 65, 65537, n}};
          for (const auto& cuts : splits) {
            INFO("first_index " << first << " moments " << DTypeName(md) << " level "
                                << SimdLevelName(level) << " threads " << threads << " pieces "
                                << cuts.size() - 1);
            CHECK(RunInPieces(s, md, first, cuts, threads) == ref);
          }
        }
      }
    }
  }
}

TEST_CASE("CpuAdamWCompact: stochastic rounding is unbiased through the kernel", "[offload]") {
  // 2^18 identical elements: each computes the same fp32 update x and rounds it with its own
  // bits, so the mean of the bf16 results estimates E[round(x)] = x.
  const size_t n = size_t{1} << 18;
  Fp32State s;
  s.grad_dtype = DType::kF32;
  s.master.assign(n, 1.0f);
  s.m.assign(n, 1e-3f);
  s.v.assign(n, 1e-6f);
  s.grad32.assign(n, 2.5e-3f);
  Compact c = MakeCompact(s, MasterForm::kBf16Stochastic, DType::kF32);
  c.rounding = {2024, 1, 0};
  REQUIRE(CpuAdamWCompact(c.Arrays(), Params(1, /*lr=*/3e-3), 1.0f, 0).ok());
  // The fp32 result, from CpuAdamW on one element.
  float master = 1.0f, m = 1e-3f, v = 1e-6f, grad = 2.5e-3f;
  REQUIRE(CpuAdamW({&master, &m, &v, &grad, DType::kF32, nullptr, DType::kBF16, 1},
                   Params(1, 3e-3), 1.0f, 1)
              .ok());
  const uint32_t down = FloatBits(master) >> 16;
  const double ulp = Bf16ToFloat(static_cast<uint16_t>(down + 1)) - Bf16ToFloat(down);
  const double f = (master - Bf16ToFloat(down)) / ulp;
  REQUIRE((f > 0.05 && f < 0.95));  // a real rounding decision, not a near-exact value
  double sum = 0;
  for (uint16_t p : c.param) {
    REQUIRE((p == down || p == down + 1));
    sum += Bf16ToFloat(p) - master;
  }
  const double mean_in_ulps = sum / n / ulp;
  const double bound = 6 * std::sqrt(f * (1 - f) / n);
  INFO("fraction " << f << " mean error " << mean_in_ulps << " ulp, bound " << bound);
  CHECK(std::fabs(mean_in_ulps) <= bound);
  // Nearest rounding would be off by min(f, 1 - f) ulp on every element.
  CHECK(bound < std::min(f, 1 - f));
}

TEST_CASE("CpuAdamWCompact: a different seed or step draws different bits", "[offload]") {
  const Fp32State s = RandomState(4096, DType::kF32, 41);
  Compact a = MakeCompact(s, MasterForm::kBf16Stochastic, DType::kF32);
  Compact b = a, c = a;
  a.rounding = {1, 1, 0};
  b.rounding = {2, 1, 0};
  c.rounding = {1, 2, 0};
  for (Compact* x : {&a, &b, &c}) REQUIRE(CpuAdamWCompact(x->Arrays(), Params(1), 1, 0).ok());
  CHECK(a.param != b.param);
  CHECK(a.param != c.param);
}

TEST_CASE("CpuAdamWCompact: inconsistent arrays are InvalidArgument naming the field",
          "[offload]") {
  const Fp32State s = RandomState(64, DType::kF32, 1);
  struct Bad {
    const char* what;
    void (*spoil)(CompactAdamWArrays&);
  };
  const Bad bad[] = {
      {"needs remainder", [](CompactAdamWArrays& a) { a.remainder = nullptr; }},
      {"does not use master",
       [](CompactAdamWArrays& a) { a.master = reinterpret_cast<float*>(a.param); }},
      {"param_dtype=fp16", [](CompactAdamWArrays& a) { a.param_dtype = DType::kF16; }},
      {"moment_dtype=fp16", [](CompactAdamWArrays& a) { a.moment_dtype = DType::kF16; }},
      {"needs grad", [](CompactAdamWArrays& a) { a.grad = nullptr; }},
      {"master_form=7",
       [](CompactAdamWArrays& a) { a.master_form = static_cast<MasterForm>(7); }},
  };
  for (const Bad& b : bad) {
    Compact c = MakeCompact(s, MasterForm::kBf16Remainder, DType::kF32);
    CompactAdamWArrays a = c.Arrays();
    b.spoil(a);
    const absl::Status st = CpuAdamWCompact(a, Params(1), 1.0f, 1);
    INFO(b.what << ": " << st);
    CHECK(st.code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(st.message()).find(b.what) != std::string::npos);
  }
  Compact c = MakeCompact(s, MasterForm::kBf16Stochastic, DType::kBF16);
  CHECK(CpuAdamWCompact(c.Arrays(), Params(1), 1.0f, -1).code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("SplitMasters/JoinMasters: whole arrays convert element by element, any threads",
          "[offload]") {
  const Fp32State s = RandomState(300007, DType::kF32, 51);  // specials included
  const size_t n = s.master.size();
  std::vector<uint16_t> want_param(n), want_rem(n);
  for (size_t i = 0; i < n; ++i) SplitMaster(s.master[i], &want_param[i], &want_rem[i]);
  for (int threads : {1, 0, 3}) {
    std::vector<uint16_t> param(n), rem(n);
    std::vector<float> back(n);
    REQUIRE(SplitMasters(s.master.data(), param.data(), rem.data(), n, threads).ok());
    REQUIRE(JoinMasters(param.data(), rem.data(), back.data(), n, threads).ok());
    INFO("threads=" << threads);
    CHECK(param == want_param);
    CHECK(rem == want_rem);
    CHECK(Compact::SameFloats(back, s.master));  // no signaling NaN among the specials
  }
  const absl::Status null_param = SplitMasters(s.master.data(), nullptr, want_rem.data(), n, 1);
  CHECK(null_param.code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(null_param.message()).find("param is null") != std::string::npos);
  CHECK(JoinMasters(want_param.data(), want_rem.data(), nullptr, 0, 1).ok());
  CHECK(JoinMasters(want_param.data(), want_rem.data(), nullptr, n, -1).code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("CpuAdamWCompact: bytes per element follow the form", "[offload]") {
  const Fp32State s = RandomState(8, DType::kBF16, 1);
  struct Row {
    MasterForm form;
    DType moments;
    size_t bytes;
  };
  // grad 2 + moments (read + write) + master traffic.
  for (const Row& r : {Row{MasterForm::kF32, DType::kF32, 28}, Row{MasterForm::kF32, DType::kBF16, 20},
                       Row{MasterForm::kBf16Remainder, DType::kF32, 26},
                       Row{MasterForm::kBf16Remainder, DType::kBF16, 18},
                       Row{MasterForm::kBf16Stochastic, DType::kF32, 22},
                       Row{MasterForm::kBf16Stochastic, DType::kBF16, 14}}) {
    Compact c = MakeCompact(s, r.form, r.moments);
    CHECK(CompactAdamWBytesPerElement(c.Arrays()) == r.bytes);
  }
}

}  // namespace
}  // namespace offload
}  // namespace zerort
