// Built with -ffp-contract=off (see BUILD.bazel): every fma below is written out, and the
// compiler must not fuse the remaining multiply-adds, or the scalar path would differ from the
// vector paths (and from the CUDA kernel) in the last bit.
#include "offload/cpu_adamw.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "offload/internal/simd_convert.h"
#include "offload/internal/simd_lanes.h"
#include "offload/simd.h"

namespace zerort {
namespace offload {
namespace {


// Below this many elements per task, waking another thread costs more than it saves.
constexpr size_t kMinElementsPerTask = size_t{1} << 15;

// The reference op sequence; the vector paths are this, lane by lane, and they finish their
// tails with it.
template <DType G, DType P, bool kOut>
void AdamWScalar(const AdamWArrays& a, const AdamWStepParams& s, float grad_scale, size_t begin,
                 size_t end) {
  for (size_t i = begin; i < end; ++i) {
    const float g = LoadAs<G>(a.grad, i) * grad_scale;
    const float m = std::fma(s.beta1, a.m[i], s.one_minus_beta1 * g);
    const float v = std::fma(s.beta2, a.v[i], (s.one_minus_beta2 * g) * g);
    const float denom = std::fma(std::sqrt(v), s.inv_sqrt_bias2, s.eps);
    const float p = std::fma(-s.step_size, m / denom, a.master[i] * s.decay);
    a.m[i] = m;
    a.v[i] = v;
    a.master[i] = p;
    if constexpr (kOut) StoreAs<P>(a.param_out, i, p);
  }
}

// The vector paths: AdamWLanes in namespaces avx2 and avx512.
#define ZERORT_LANE_KERNELS "offload/internal/adamw_lanes.inc"
#include "offload/internal/for_each_lanes.inc"

using RangeFn = void (*)(const AdamWArrays&, const AdamWStepParams&, float, size_t, size_t);

template <DType G, DType P, bool kOut>
RangeFn ForLevel(SimdLevel level) {
  return internal::PickLevel<RangeFn>(level, &AdamWScalar<G, P, kOut>,
                                      &avx2::AdamWLanes<G, P, kOut>,
                                      &avx512::AdamWLanes<G, P, kOut>);
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

absl::Status CheckAdamWRanges(absl::Span<const AdamWRange> ranges, size_t n, const char* who) {
  size_t expected = 0;
  for (size_t k = 0; k < ranges.size(); ++k) {
    const AdamWRange& r = ranges[k];
    if (r.begin != expected || r.end < r.begin || r.end > n) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": range ", k, " is [", r.begin, ", ", r.end, "); ranges must tile [0, ", n,
          ") in order and this one must start at ", expected));
    }
    expected = r.end;
  }
  if (expected != n) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": the ranges cover [0, ", expected, ") of ", n, " elements"));
  }
  return absl::OkStatus();
}

absl::Status CpuAdamW(const AdamWArrays& a, const AdamWStepParams& params, float grad_scale,
                      int threads) {
  const AdamWRange all{0, a.n, params};
  return CpuAdamW(a, absl::MakeConstSpan(&all, 1), grad_scale, threads);
}

absl::Status CpuAdamW(const AdamWArrays& a, absl::Span<const AdamWRange> ranges,
                      float grad_scale, int threads) {
  if (threads < 0) {
    return absl::InvalidArgumentError(absl::StrCat("CpuAdamW: threads=", threads,
                                                   " must be >= 0 (0 = all cores)"));
  }
  if (absl::Status s = CheckAdamWRanges(ranges, a.n, "CpuAdamW"); !s.ok()) return s;
  if (a.n == 0) return absl::OkStatus();
  if (a.master == nullptr || a.m == nullptr || a.v == nullptr || a.grad == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CpuAdamW: null array for n=", a.n, " (master=", a.master != nullptr,
        " m=", a.m != nullptr, " v=", a.v != nullptr, " grad=", a.grad != nullptr, ")"));
  }
  const RangeFn fn = Select(ActiveSimd(), a.grad_dtype, a.param_out != nullptr, a.param_dtype);
  internal::ParallelRanges(a.n, threads, kMinElementsPerTask, [&](size_t begin, size_t end) {
    // The first range that ends after `begin`, then every range this task's slice touches.
    auto r = std::upper_bound(ranges.begin(), ranges.end(), begin,
                              [](size_t x, const AdamWRange& range) { return x < range.end; });
    for (; r != ranges.end() && r->begin < end; ++r) {
      fn(a, r->params, grad_scale, std::max(begin, r->begin), std::min(end, r->end));
    }
  });
  return absl::OkStatus();
}

}  // namespace offload
}  // namespace zerort
