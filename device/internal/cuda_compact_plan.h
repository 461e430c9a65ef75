// How one Device::CompactAdamWRanges call becomes kernel launches on the CUDA device: host-only,
// shared by CudaDevice (which launches each piece) and cuda_device_test (which replays each piece
// through the kernel's chunk code without a GPU), so that the cuts tested are the cuts run.
//
// The cuts are offload::CpuAdamWCompact's: one piece per non-empty range (its own constants),
// and for kBf16Stochastic also where the global index first_index + i reaches a multiple of
// 2^32, so that each piece draws its bits from one offload::StochasticKey and the kernel needs
// only the low word of each element's index (compact_state.h).
//
//   RETURN_IF_ERROR(offload::CheckCompactAdamW(arrays, ranges, "CompactAdamW"));
//   int e = ForEachCompactLaunch(arrays, ranges, grad_scale,
//                                [&](const AdamWConstants& c, const CompactAdamWArgs& piece) {
//                                  return LaunchCompactAdamW(c, piece, stream);
//                                });
//
// Thread safety: pure functions.
#ifndef ZERORT_DEVICE_INTERNAL_CUDA_COMPACT_PLAN_H_
#define ZERORT_DEVICE_INTERNAL_CUDA_COMPACT_PLAN_H_

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "absl/types/span.h"
#include "base/dtype.h"
#include "device/internal/cuda_elementwise.h"
#include "device/internal/cuda_math.h"
#include "offload/compact_state.h"
#include "offload/cpu_adamw.h"
#include "offload/cpu_adamw_compact.h"

namespace zerort {
namespace cuda_internal {

static_assert(static_cast<int>(CompactForm::kF32) == static_cast<int>(offload::MasterForm::kF32) &&
                  static_cast<int>(CompactForm::kBf16Remainder) ==
                      static_cast<int>(offload::MasterForm::kBf16Remainder) &&
                  static_cast<int>(CompactForm::kBf16Stochastic) ==
                      static_cast<int>(offload::MasterForm::kBf16Stochastic),
              "CompactForm mirrors offload::MasterForm");

// A range's constants as the kernels take them. -step_size is exact (a sign flip), so negating
// once here is the reference's fma(-step_size, ...).
inline AdamWConstants AdamWConstantsOf(const offload::AdamWStepParams& p, float grad_scale) {
  return {p.beta1,  p.beta2,        p.one_minus_beta1, p.one_minus_beta2, p.eps,
          -p.step_size, p.inv_sqrt_bias2, p.decay,  grad_scale};
}

// p advanced by `elements` elements of dtype d; null stays null.
template <class T>
T* Advance(T* p, size_t elements, DType d) {
  if (p == nullptr) return nullptr;
  using Byte = std::conditional_t<std::is_const_v<T>, const char, char>;
  return reinterpret_cast<T*>(reinterpret_cast<Byte*>(p) + elements * DTypeSize(d));
}

// The arrays of `a` from element `begin` on, n elements.
inline CompactAdamWArgs CompactPiece(const offload::CompactAdamWArrays& a, size_t begin, size_t n,
                                     StochasticLaunch rounding) {
  return {static_cast<CompactForm>(a.master_form),
          Advance(a.master, begin, DType::kF32),
          Advance(a.param, begin, a.param_dtype),
          a.param_dtype,
          Advance(a.remainder, begin, DType::kBF16),
          Advance(a.m, begin, a.moment_dtype),
          Advance(a.v, begin, a.moment_dtype),
          a.moment_dtype,
          Advance(a.grad, begin, a.grad_dtype),
          a.grad_dtype,
          n,
          rounding};
}

// Calls launch(constants, piece) for each piece of CpuAdamWCompact(a, ranges, grad_scale)'s
// work in element order; a nonzero return stops the walk and is returned (0 when all returned 0).
// REQUIRES: offload::CheckCompactAdamW(a, ranges, ...) is OK.
template <class F>
int ForEachCompactLaunch(const offload::CompactAdamWArrays& a,
                         absl::Span<const offload::AdamWRange> ranges, float grad_scale,
                         F&& launch) {
  const bool stochastic = a.master_form == offload::MasterForm::kBf16Stochastic;
  for (const offload::AdamWRange& r : ranges) {
    const AdamWConstants c = AdamWConstantsOf(r.params, grad_scale);
    for (size_t begin = r.begin; begin < r.end;) {
      size_t end = r.end;
      StochasticLaunch rounding{0, 0};
      if (stochastic) {
        const uint64_t index = a.rounding.first_index + begin;
        const uint64_t to_boundary = (uint64_t{1} << 32) - offload::IndexLow(index);
        if (end - begin > to_boundary) end = begin + static_cast<size_t>(to_boundary);
        rounding = {offload::StochasticKey(a.rounding.seed, a.rounding.step,
                                           offload::IndexHigh(index)),
                    offload::IndexLow(index)};
      }
      if (int e = launch(c, CompactPiece(a, begin, end - begin, rounding)); e != 0) return e;
      begin = end;
    }
  }
  return 0;
}

}  // namespace cuda_internal
}  // namespace zerort

#endif  // ZERORT_DEVICE_INTERNAL_CUDA_COMPACT_PLAN_H_
