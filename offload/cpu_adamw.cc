// Built with -ffp-contract=off (see BUILD.bazel): every fma below is written out, and the
// compiler must not fuse the remaining multiply-adds, or the scalar path would differ from the
// vector paths (and from the CUDA kernel) in the last bit.
#include "offload/cpu_adamw.h"

#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "offload/internal/simd_convert.h"
#include "offload/simd.h"

// GCC 12 reports the deliberately undefined upper halves inside its own AVX-512 intrinsics
// (_mm512_undefined_*) as maybe-uninitialized; the warning is about the header, not this code.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace zerort {
namespace offload {
namespace {

using internal::LoadAvx2;
using internal::LoadAvx512;
using internal::LoadScalar;
using internal::StoreAvx2;
using internal::StoreAvx512;
using internal::StoreScalar;

// Below this many elements per task, waking another thread costs more than it saves.
constexpr size_t kMinElementsPerTask = size_t{1} << 15;

// The reference op sequence; the vector paths are this, lane by lane, and they finish their
// tails with it.
template <DType G, DType P, bool kOut>
void AdamWScalar(const AdamWArrays& a, const AdamWStepParams& s, float grad_scale, size_t begin,
                 size_t end) {
  for (size_t i = begin; i < end; ++i) {
    const float g = LoadScalar<G>(a.grad, i) * grad_scale;
    const float m = std::fma(s.beta1, a.m[i], s.one_minus_beta1 * g);
    const float v = std::fma(s.beta2, a.v[i], (s.one_minus_beta2 * g) * g);
    const float denom = std::fma(std::sqrt(v), s.inv_sqrt_bias2, s.eps);
    const float p = std::fma(-s.step_size, m / denom, a.master[i] * s.decay);
    a.m[i] = m;
    a.v[i] = v;
    a.master[i] = p;
    if constexpr (kOut) StoreScalar<P>(a.param_out, i, p);
  }
}

template <DType G, DType P, bool kOut>
ZERORT_TARGET_AVX2 void AdamWAvx2(const AdamWArrays& a, const AdamWStepParams& s,
                                  float grad_scale, size_t begin, size_t end) {
  const __m256 scale = _mm256_set1_ps(grad_scale);
  const __m256 beta1 = _mm256_set1_ps(s.beta1);
  const __m256 beta2 = _mm256_set1_ps(s.beta2);
  const __m256 omb1 = _mm256_set1_ps(s.one_minus_beta1);
  const __m256 omb2 = _mm256_set1_ps(s.one_minus_beta2);
  const __m256 eps = _mm256_set1_ps(s.eps);
  const __m256 neg_step = _mm256_set1_ps(-s.step_size);
  const __m256 isb2 = _mm256_set1_ps(s.inv_sqrt_bias2);
  const __m256 decay = _mm256_set1_ps(s.decay);
  size_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 g = _mm256_mul_ps(LoadAvx2<G>(a.grad, i), scale);
    const __m256 m = _mm256_fmadd_ps(beta1, _mm256_loadu_ps(a.m + i), _mm256_mul_ps(omb1, g));
    const __m256 v = _mm256_fmadd_ps(beta2, _mm256_loadu_ps(a.v + i),
                                     _mm256_mul_ps(_mm256_mul_ps(omb2, g), g));
    const __m256 denom = _mm256_fmadd_ps(_mm256_sqrt_ps(v), isb2, eps);
    const __m256 p = _mm256_fmadd_ps(neg_step, _mm256_div_ps(m, denom),
                                     _mm256_mul_ps(_mm256_loadu_ps(a.master + i), decay));
    _mm256_storeu_ps(a.m + i, m);
    _mm256_storeu_ps(a.v + i, v);
    _mm256_storeu_ps(a.master + i, p);
    if constexpr (kOut) StoreAvx2<P>(a.param_out, i, p);
  }
  AdamWScalar<G, P, kOut>(a, s, grad_scale, i, end);
}

template <DType G, DType P, bool kOut>
ZERORT_TARGET_AVX512 void AdamWAvx512(const AdamWArrays& a, const AdamWStepParams& s,
                                      float grad_scale, size_t begin, size_t end) {
  const __m512 scale = _mm512_set1_ps(grad_scale);
  const __m512 beta1 = _mm512_set1_ps(s.beta1);
  const __m512 beta2 = _mm512_set1_ps(s.beta2);
  const __m512 omb1 = _mm512_set1_ps(s.one_minus_beta1);
  const __m512 omb2 = _mm512_set1_ps(s.one_minus_beta2);
  const __m512 eps = _mm512_set1_ps(s.eps);
  const __m512 neg_step = _mm512_set1_ps(-s.step_size);
  const __m512 isb2 = _mm512_set1_ps(s.inv_sqrt_bias2);
  const __m512 decay = _mm512_set1_ps(s.decay);
  size_t i = begin;
  for (; i + 16 <= end; i += 16) {
    if constexpr (G != DType::kF32) {
      // With 2-byte gradients the hardware prefetchers fall behind the four fp32 streams:
      // prefetching 2 KiB ahead measured 1.00 -> 1.07 of the memory floor (adamw_bench, 1e8,
      // Cascade Lake). With fp32 gradients the same prefetches cost 0.91 -> 0.70: none there.
      constexpr size_t kAhead = 512;
      _mm_prefetch(reinterpret_cast<const char*>(a.m + i + kAhead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(a.v + i + kAhead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(a.master + i + kAhead), _MM_HINT_T0);
      _mm_prefetch(static_cast<const char*>(a.grad) + (i + kAhead) * 2, _MM_HINT_T0);
    }
    const __m512 g = _mm512_mul_ps(LoadAvx512<G>(a.grad, i), scale);
    const __m512 m = _mm512_fmadd_ps(beta1, _mm512_loadu_ps(a.m + i), _mm512_mul_ps(omb1, g));
    const __m512 v = _mm512_fmadd_ps(beta2, _mm512_loadu_ps(a.v + i),
                                     _mm512_mul_ps(_mm512_mul_ps(omb2, g), g));
    const __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(v), isb2, eps);
    const __m512 p = _mm512_fmadd_ps(neg_step, _mm512_div_ps(m, denom),
                                     _mm512_mul_ps(_mm512_loadu_ps(a.master + i), decay));
    _mm512_storeu_ps(a.m + i, m);
    _mm512_storeu_ps(a.v + i, v);
    _mm512_storeu_ps(a.master + i, p);
    if constexpr (kOut) StoreAvx512<P>(a.param_out, i, p);
  }
  AdamWScalar<G, P, kOut>(a, s, grad_scale, i, end);
}

using RangeFn = void (*)(const AdamWArrays&, const AdamWStepParams&, float, size_t, size_t);

template <DType G, DType P, bool kOut>
RangeFn ForLevel(SimdLevel level) {
  switch (level) {
    case SimdLevel::kAvx512:
      return &AdamWAvx512<G, P, kOut>;
    case SimdLevel::kAvx2:
      return &AdamWAvx2<G, P, kOut>;
    case SimdLevel::kScalar:
      break;
  }
  return &AdamWScalar<G, P, kOut>;
}

template <DType G>
RangeFn ForParam(SimdLevel level, bool out, DType p) {
  if (!out) return ForLevel<G, DType::kF32, false>(level);
  switch (p) {
    case DType::kF32:
      return ForLevel<G, DType::kF32, true>(level);
    case DType::kBF16:
      return ForLevel<G, DType::kBF16, true>(level);
    case DType::kF16:
      break;
  }
  return ForLevel<G, DType::kF16, true>(level);
}

RangeFn Select(SimdLevel level, DType g, bool out, DType p) {
  switch (g) {
    case DType::kF32:
      return ForParam<DType::kF32>(level, out, p);
    case DType::kBF16:
      return ForParam<DType::kBF16>(level, out, p);
    case DType::kF16:
      break;
  }
  return ForParam<DType::kF16>(level, out, p);
}

absl::Status CheckFinite(const char* name, double value) {
  if (std::isfinite(value)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("AdamW ", name, "=", value, " is not finite"));
}

}  // namespace

absl::StatusOr<AdamWStepParams> MakeAdamWStepParams(double lr, double beta1, double beta2,
                                                    double eps, double weight_decay,
                                                    int64_t step) {
  for (auto [name, value] : {std::pair<const char*, double>{"lr", lr}, {"beta1", beta1},
                             {"beta2", beta2}, {"eps", eps}, {"weight_decay", weight_decay}}) {
    if (absl::Status s = CheckFinite(name, value); !s.ok()) return s;
  }
  if (lr < 0) return absl::InvalidArgumentError(absl::StrCat("AdamW lr=", lr, " must be >= 0"));
  if (beta1 < 0 || beta1 >= 1) {
    return absl::InvalidArgumentError(absl::StrCat("AdamW beta1=", beta1, " must be in [0, 1)"));
  }
  if (beta2 < 0 || beta2 >= 1) {
    return absl::InvalidArgumentError(absl::StrCat("AdamW beta2=", beta2, " must be in [0, 1)"));
  }
  if (!(eps > 0)) {
    return absl::InvalidArgumentError(absl::StrCat("AdamW eps=", eps, " must be > 0"));
  }
  if (weight_decay < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("AdamW weight_decay=", weight_decay, " must be >= 0"));
  }
  if (step < 1) {
    return absl::InvalidArgumentError(absl::StrCat("AdamW step=", step, " must be >= 1"));
  }
  const double t = static_cast<double>(step);
  AdamWStepParams p;
  p.beta1 = static_cast<float>(beta1);
  p.beta2 = static_cast<float>(beta2);
  p.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  p.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  p.eps = static_cast<float>(eps);
  p.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, t)));
  p.inv_sqrt_bias2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(beta2, t)));
  p.decay = static_cast<float>(1.0 - lr * weight_decay);
  return p;
}

absl::Status CpuAdamW(const AdamWArrays& a, const AdamWStepParams& params, float grad_scale,
                      int threads) {
  if (threads < 0) {
    return absl::InvalidArgumentError(absl::StrCat("CpuAdamW: threads=", threads,
                                                   " must be >= 0 (0 = all cores)"));
  }
  if (a.n == 0) return absl::OkStatus();
  if (a.master == nullptr || a.m == nullptr || a.v == nullptr || a.grad == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CpuAdamW: null array for n=", a.n, " (master=", a.master != nullptr,
        " m=", a.m != nullptr, " v=", a.v != nullptr, " grad=", a.grad != nullptr, ")"));
  }
  const RangeFn fn = Select(ActiveSimd(), a.grad_dtype, a.param_out != nullptr, a.param_dtype);
  internal::ParallelRanges(a.n, threads, kMinElementsPerTask, [&](size_t begin, size_t end) {
    fn(a, params, grad_scale, begin, end);
  });
  return absl::OkStatus();
}

}  // namespace offload
}  // namespace zerort
