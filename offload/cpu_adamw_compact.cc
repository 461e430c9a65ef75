// Built with -ffp-contract=off, like cpu_adamw.cc: the op sequence is CpuAdamW's, fma for fma,
// so that the kF32 form (and the kBf16Remainder master) equal CpuAdamW's bit for bit.
#include "offload/cpu_adamw_compact.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <utility>

#include "absl/strings/str_cat.h"
#include "offload/compact_state.h"
#include "offload/internal/simd_convert.h"
#include "offload/internal/simd_lanes.h"
#include "offload/simd.h"

namespace zerort {
namespace offload {
namespace {

// As CpuAdamW: below this many elements per task another thread costs more than it saves.
constexpr size_t kMinElementsPerTask = size_t{1} << 15;

template <MasterForm F>
float LoadMaster(const CompactAdamWArrays& a, size_t i) {
  if constexpr (F == MasterForm::kF32) {
    return a.master[i];
  } else if constexpr (F == MasterForm::kBf16Remainder) {
    return JoinMaster(static_cast<const uint16_t*>(a.param)[i], a.remainder[i]);
  } else {
    return Bf16ToFloat(static_cast<const uint16_t*>(a.param)[i]);
  }
}

template <MasterForm F, DType P, bool kOut>
void StoreMaster(const CompactAdamWArrays& a, size_t i, float x, uint32_t key) {
  if constexpr (F == MasterForm::kF32) {
    a.master[i] = x;
    if constexpr (kOut) StoreAs<P>(a.param, i, x);
  } else if constexpr (F == MasterForm::kBf16Remainder) {
    SplitMaster(x, static_cast<uint16_t*>(a.param) + i, a.remainder + i);
  } else {
    const uint32_t bits = StochasticBits(key, IndexLow(a.rounding.first_index + i));
    static_cast<uint16_t*>(a.param)[i] = Bf16Stochastic(x, bits);
  }
}

// The reference op sequence (CpuAdamW's AdamWScalar with the form's loads and stores); the
// vector paths are this, lane by lane, and finish their tails with it. `key`: the
// StochasticKey of [begin, end), which never crosses a 2^32 boundary of the global index.
template <DType G, MasterForm F, DType M, DType P, bool kOut>
void CompactScalar(const CompactAdamWArrays& a, const AdamWStepParams& s, float grad_scale,
                   uint32_t key, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    const float g = LoadAs<G>(a.grad, i) * grad_scale;
    const float m = std::fma(s.beta1, LoadAs<M>(a.m, i), s.one_minus_beta1 * g);
    const float v = std::fma(s.beta2, LoadAs<M>(a.v, i), (s.one_minus_beta2 * g) * g);
    const float denom = std::fma(std::sqrt(v), s.inv_sqrt_bias2, s.eps);
    const float p = std::fma(-s.step_size, m / denom, LoadMaster<F>(a, i) * s.decay);
    StoreAs<M>(a.m, i, m);
    StoreAs<M>(a.v, i, v);
    StoreMaster<F, P, kOut>(a, i, p, key);
  }
}

// The vector paths: CompactLanes in namespaces avx2 and avx512.
#define ZERORT_LANE_KERNELS "offload/internal/compact_adamw_lanes.inc"
#include "offload/internal/for_each_lanes.inc"

using RangeFn = void (*)(const CompactAdamWArrays&, const AdamWStepParams&, float, uint32_t,
                         size_t, size_t);

template <DType G, MasterForm F, DType M, DType P, bool kOut>
RangeFn ForLevel(SimdLevel level) {
  return internal::PickLevel<RangeFn>(level, &CompactScalar<G, F, M, P, kOut>,
                                      &avx2::CompactLanes<G, F, M, P, kOut>,
                                      &avx512::CompactLanes<G, F, M, P, kOut>);
}

template <DType G, MasterForm F, DType M>
RangeFn ForParam(SimdLevel level, bool out, DType p) {
  if constexpr (F != MasterForm::kF32) {
    return ForLevel<G, F, M, DType::kBF16, true>(level);  // the param is the master's storage
  } else {
    if (!out) return ForLevel<G, F, M, DType::kF32, false>(level);
    if (p == DType::kF32) return ForLevel<G, F, M, DType::kF32, true>(level);
    if (p == DType::kBF16) return ForLevel<G, F, M, DType::kBF16, true>(level);
    return ForLevel<G, F, M, DType::kF16, true>(level);
  }
}

template <DType G>
RangeFn ForForm(SimdLevel level, const CompactAdamWArrays& a) {
  const bool out = a.param != nullptr;
  const bool bf16_moments = a.moment_dtype == DType::kBF16;
  switch (a.master_form) {
    case MasterForm::kF32:
      return bf16_moments ? ForParam<G, MasterForm::kF32, DType::kBF16>(level, out, a.param_dtype)
                          : ForParam<G, MasterForm::kF32, DType::kF32>(level, out, a.param_dtype);
    case MasterForm::kBf16Remainder:
      return bf16_moments ? ForParam<G, MasterForm::kBf16Remainder, DType::kBF16>(level, out, {})
                          : ForParam<G, MasterForm::kBf16Remainder, DType::kF32>(level, out, {});
    case MasterForm::kBf16Stochastic:
      break;
  }
  return bf16_moments ? ForParam<G, MasterForm::kBf16Stochastic, DType::kBF16>(level, out, {})
                      : ForParam<G, MasterForm::kBf16Stochastic, DType::kF32>(level, out, {});
}

RangeFn Select(SimdLevel level, const CompactAdamWArrays& a) {
  switch (a.grad_dtype) {
    case DType::kF32:
      return ForForm<DType::kF32>(level, a);
    case DType::kBF16:
      return ForForm<DType::kBF16>(level, a);
    case DType::kF16:
      break;
  }
  return ForForm<DType::kF16>(level, a);
}

// InvalidArgument naming `field` unless its presence is what the form asks for.
absl::Status CheckPresence(const CompactAdamWArrays& a, const char* who, const char* field,
                           const void* p, bool wanted) {
  if ((p != nullptr) == wanted) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      who, ": master_form=", MasterFormName(a.master_form), " with n=", a.n,
      wanted ? " needs " : " does not use ", field, wanted ? " (null)" : " (set it to null)"));
}

absl::Status CheckArrays(const CompactAdamWArrays& a, const char* who) {
  const int form = static_cast<int>(a.master_form);
  if (form < 0 || form > 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": master_form=", form, " is not a MasterForm"));
  }
  if (a.moment_dtype != DType::kF32 && a.moment_dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": moment_dtype=",
                                                   DTypeName(a.moment_dtype),
                                                   " is not supported (f32 or bf16)"));
  }
  const bool f32 = a.master_form == MasterForm::kF32;
  if (!f32 && a.param_dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": master_form=", MasterFormName(a.master_form),
        " keeps the master in a bf16 param; param_dtype=", DTypeName(a.param_dtype)));
  }
  if (a.n == 0) return absl::OkStatus();
  const bool rem = a.master_form == MasterForm::kBf16Remainder;
  for (absl::Status s : {CheckPresence(a, who, "master", a.master, f32),
                         CheckPresence(a, who, "remainder", a.remainder, rem),
                         CheckPresence(a, who, "m", a.m, true),
                         CheckPresence(a, who, "v", a.v, true),
                         CheckPresence(a, who, "grad", a.grad, true)}) {
    if (!s.ok()) return s;
  }
  if (!f32) return CheckPresence(a, who, "param", a.param, true);
  return absl::OkStatus();
}

// Runs fn over [begin, end) in pieces that do not cross a 2^32 boundary of the global index,
// each with its StochasticKey: the per-element work then needs the index's low word only.
void RunKeyed(RangeFn fn, const CompactAdamWArrays& a, const AdamWStepParams& params,
              float grad_scale, size_t begin, size_t end) {
  const bool stochastic = a.master_form == MasterForm::kBf16Stochastic;
  while (begin < end) {
    const uint64_t index = a.rounding.first_index + begin;
    const uint64_t to_boundary = (uint64_t{1} << 32) - IndexLow(index);
    const size_t stop = end - begin > to_boundary ? begin + to_boundary : end;
    const uint32_t key =
        stochastic ? StochasticKey(a.rounding.seed, a.rounding.step, IndexHigh(index)) : 0;
    fn(a, params, grad_scale, key, begin, stop);
    begin = stop;
  }
}

// InvalidArgument naming the first null array (when n > 0) or a negative thread count.
absl::Status CheckConversion(const char* who, size_t n, int threads,
                             std::initializer_list<std::pair<const char*, const void*>> arrays) {
  if (threads < 0) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": threads=", threads, " must be >= 0"));
  }
  for (const auto& [name, p] : arrays) {
    if (n > 0 && p == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(who, ": ", name, " is null for n=", n));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckCompactAdamW(const CompactAdamWArrays& arrays,
                               absl::Span<const AdamWRange> ranges, const char* who) {
  if (absl::Status s = CheckAdamWRanges(ranges, arrays.n, who); !s.ok()) return s;
  return CheckArrays(arrays, who);
}

const char* MasterFormName(MasterForm form) {
  switch (form) {
    case MasterForm::kF32:
      return "f32";
    case MasterForm::kBf16Remainder:
      return "bf16_remainder";
    case MasterForm::kBf16Stochastic:
      return "bf16_stochastic";
  }
  return "unknown";
}

size_t CompactAdamWBytesPerElement(const CompactAdamWArrays& a) {
  const size_t moments = 2 * 2 * DTypeSize(a.moment_dtype);  // m and v, read and written
  const size_t grad = DTypeSize(a.grad_dtype);
  switch (a.master_form) {
    case MasterForm::kF32:
      return grad + moments + 8 + (a.param != nullptr ? DTypeSize(a.param_dtype) : 0);
    case MasterForm::kBf16Remainder:
      return grad + moments + 8;  // param and remainder, read and written
    case MasterForm::kBf16Stochastic:
      break;
  }
  return grad + moments + 4;
}

absl::Status SplitMasters(const float* master, uint16_t* param, uint16_t* remainder, size_t n,
                          int threads) {
  if (absl::Status s = CheckConversion("SplitMasters", n, threads,
                                       {{"master", master}, {"param", param},
                                        {"remainder", remainder}});
      !s.ok()) {
    return s;
  }
  internal::ParallelRanges(n, threads, kMinElementsPerTask, [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) SplitMaster(master[i], param + i, remainder + i);
  });
  return absl::OkStatus();
}

absl::Status JoinMasters(const uint16_t* param, const uint16_t* remainder, float* master,
                         size_t n, int threads) {
  if (absl::Status s = CheckConversion("JoinMasters", n, threads,
                                       {{"param", param}, {"remainder", remainder},
                                        {"master", master}});
      !s.ok()) {
    return s;
  }
  internal::ParallelRanges(n, threads, kMinElementsPerTask, [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) master[i] = JoinMaster(param[i], remainder[i]);
  });
  return absl::OkStatus();
}

absl::Status CpuAdamWCompact(const CompactAdamWArrays& a, const AdamWStepParams& params,
                             float grad_scale, int threads) {
  const AdamWRange all{0, a.n, params};
  return CpuAdamWCompact(a, absl::MakeConstSpan(&all, 1), grad_scale, threads);
}

absl::Status CpuAdamWCompact(const CompactAdamWArrays& a, absl::Span<const AdamWRange> ranges,
                             float grad_scale, int threads) {
  if (threads < 0) {
    return absl::InvalidArgumentError(absl::StrCat("CpuAdamWCompact: threads=", threads,
                                                   " must be >= 0 (0 = all cores)"));
  }
  if (absl::Status s = CheckCompactAdamW(a, ranges, "CpuAdamWCompact"); !s.ok()) return s;
  if (a.n == 0) return absl::OkStatus();
  const RangeFn fn = Select(ActiveSimd(), a);
  internal::ParallelRanges(a.n, threads, kMinElementsPerTask, [&](size_t begin, size_t end) {
    auto r = std::upper_bound(ranges.begin(), ranges.end(), begin,
                              [](size_t x, const AdamWRange& range) { return x < range.end; });
    for (; r != ranges.end() && r->begin < end; ++r) {
      RunKeyed(fn, a, r->params, grad_scale, std::max(begin, r->begin), std::min(end, r->end));
    }
  });
  return absl::OkStatus();
}

}  // namespace offload
}  // namespace zerort
