// Per-element arithmetic of the CUDA kernels, written once for nvcc's device pass and for the
// host compiler.
//
// Why both: the kernels must equal the host reference (base/dtype.h, offload/cpu_adamw.h,
// offload/cpu_kernels.h) bit for bit, and most of what can go wrong (a rounding bias in a
// conversion, a reordered AdamW term) is in these few functions. Compiled for the host they are
// tested against the reference on every machine, GPU or not (cuda_device_test); compiled for the
// device they are what the kernels run.
//
// Exactness rules (device side): every multiply, add, fma, sqrt and division is an explicit
// round-to-nearest intrinsic (__fmul_rn, __fadd_rn, __fmaf_rn, __fsqrt_rn, __fdiv_rn), which nvcc
// never contracts or approximates whatever its flags; the conversions are base/half.h's, shared
// with the host reference (integer bit manipulation and one exact product).
// The host side must be compiled with -ffp-contract=off (see zero/BUILD.bazel).
//
// Non-finite inputs: conversions keep NaN payloads exactly as the host does (the same code);
// arithmetic on NaN gives a NaN whose payload may differ from the host's (GPUs return a
// canonical NaN).
//
// Thread safety: pure functions.
#ifndef ZERORT_DEVICE_INTERNAL_CUDA_MATH_H_
#define ZERORT_DEVICE_INTERNAL_CUDA_MATH_H_

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define ZERORT_HD __host__ __device__ __forceinline__
#else
#include <cmath>
#define ZERORT_HD inline
#endif

#include "base/dtype.h"
#include "base/half.h"
#include "offload/compact_state.h"

namespace zerort {
namespace cuda_internal {

// ------------------------------------------------------------------ correctly rounded ops

ZERORT_HD float Mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

ZERORT_HD float Add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

ZERORT_HD float Fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

ZERORT_HD float Sqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

ZERORT_HD float Div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// ------------------------------------------------------------------ conversions (base/half.h)

// Loads and stores are base/dtype.h's LoadAs / StoreAs: the one definition of the
// conversions, compiled here for the device.

// Exponent all ones: Inf or NaN. An fp32 element is read as the float it is (as LoadAs reads
// it), then its bits: the kernels also call this on chunks held in float registers, which must
// not be read through another type.
template <DType D>
ZERORT_HD bool IsNonFinite(const void* p, size_t i) {
  if constexpr (D == DType::kF32) {
    return (FloatBits(static_cast<const float*>(p)[i]) & 0x7f800000u) == 0x7f800000u;
  } else {
    constexpr uint16_t kMask = D == DType::kBF16 ? 0x7f80u : 0x7c00u;
    return (static_cast<const uint16_t*>(p)[i] & kMask) == kMask;
  }
}

// ------------------------------------------------------------------ AdamW (offload/cpu_adamw.h)

// The per-step constants, flattened so that a kernel can take them by value.
struct AdamWConstants {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps, neg_step_size, inv_sqrt_bias2,
      decay, grad_scale;
};

// The new m, v and master of one element.
struct AdamWValues {
  float m, v, master;
};

// The fused update on fp32 values, in the reference's op order: every AdamW kernel (the fp32
// state and the compact forms) differs only in how it loads and stores these values.
ZERORT_HD AdamWValues AdamWUpdate(const AdamWConstants& c, float grad, float m, float v,
                                  float master) {
  const float g = Mul(grad, c.grad_scale);
  const float mi = Fma(c.beta1, m, Mul(c.one_minus_beta1, g));
  const float vi = Fma(c.beta2, v, Mul(Mul(c.one_minus_beta2, g), g));
  const float denom = Fma(Sqrt(vi), c.inv_sqrt_bias2, c.eps);
  const float p = Fma(c.neg_step_size, Div(mi, denom), Mul(master, c.decay));
  return {mi, vi, p};
}

// One element of the fused update over fp32 state (offload::CpuAdamW).
template <DType G, DType P, bool kOut>
ZERORT_HD void AdamWElement(const AdamWConstants& c, float* master, float* m, float* v,
                            const void* grad, void* param_out, size_t i) {
  const AdamWValues r = AdamWUpdate(c, LoadAs<G>(grad, i), m[i], v[i], master[i]);
  m[i] = r.m;
  v[i] = r.v;
  master[i] = r.master;
  if constexpr (kOut) StoreAs<P>(param_out, i, r.master);
}

// ------------------------------------------------ AdamW over compact state (cpu_adamw_compact.h)

// offload::MasterForm, by value (cuda_compact_plan.h checks that they agree): this header is
// compiled by nvcc and does not see the host's AdamW declarations.
enum class CompactForm : int { kF32 = 0, kBf16Remainder = 1, kBf16Stochastic = 2 };

// The stochastic rounding of one launch: every element's global index lies in one 2^32 block
// (the launch plan cuts at block boundaries, as CpuAdamWCompact does), so the block's
// offload::StochasticKey serves all of them and element i needs only its index's low word,
// index_low + i (mod 2^32, as the host's IndexLow(first_index + i)).
struct StochasticLaunch {
  uint32_t key;
  uint32_t index_low;
};

// One element of offload::CpuAdamWCompact's reference (CompactScalar): the form's master load,
// AdamWUpdate on the fp32 values, the form's stores. `i` addresses the arrays (or a chunk's
// registers), `element` is the element's index in the launch (for the stochastic bits).
//   kF32:             master (fp32) read and written; param (P) written when kOut
//   kBf16Remainder:   param (bf16 bits) and remainder read and written; P = kBF16
//   kBf16Stochastic:  param (bf16 bits) read and written; P = kBF16
// m and v: moment dtype M (kF32 or kBF16, rounded to nearest even on store).
template <DType G, CompactForm F, DType M, DType P, bool kOut>
ZERORT_HD void CompactAdamWElement(const AdamWConstants& c, StochasticLaunch rounding,
                                   float* master, void* param, uint16_t* remainder, void* m,
                                   void* v, const void* grad, size_t i, size_t element) {
  float x;
  if constexpr (F == CompactForm::kF32) {
    x = master[i];
  } else if constexpr (F == CompactForm::kBf16Remainder) {
    x = offload::JoinMaster(static_cast<const uint16_t*>(param)[i], remainder[i]);
  } else {
    x = Bf16ToFloat(static_cast<const uint16_t*>(param)[i]);
  }
  const AdamWValues r = AdamWUpdate(c, LoadAs<G>(grad, i), LoadAs<M>(m, i), LoadAs<M>(v, i), x);
  StoreAs<M>(m, i, r.m);
  StoreAs<M>(v, i, r.v);
  if constexpr (F == CompactForm::kF32) {
    master[i] = r.master;
    if constexpr (kOut) StoreAs<P>(param, i, r.master);
  } else if constexpr (F == CompactForm::kBf16Remainder) {
    offload::SplitMaster(r.master, static_cast<uint16_t*>(param) + i, remainder + i);
  } else {
    const uint32_t bits = offload::StochasticBits(
        rounding.key, rounding.index_low + static_cast<uint32_t>(element));
    static_cast<uint16_t*>(param)[i] = offload::Bf16Stochastic(r.master, bits);
  }
}

// ------------------------------------------------------------------ squared norm

// offload::SquaredNormF32's lanes: 8 per block of kNormBlock elements.
inline constexpr int kNormLanes = 8;

// Lane `lane` of the block [begin, end): fma(x, x, acc) over begin + lane, begin + lane + 8, ...
template <DType D>
ZERORT_HD float NormLane(const void* x, size_t begin, size_t end, int lane) {
  float acc = 0.0f;
  // The fma chain is serial by definition; unrolling lets the GPU issue the next loads while
  // the chain runs (a lane walks 128 elements of a full block).
#if defined(__CUDA_ARCH__)
#pragma unroll 8
#endif
  for (size_t i = begin + static_cast<size_t>(lane); i < end; i += kNormLanes) {
    const float xi = LoadAs<D>(x, i);
    acc = Fma(xi, xi, acc);
  }
  return acc;
}

}  // namespace cuda_internal
}  // namespace zerort

#endif  // ZERORT_DEVICE_INTERNAL_CUDA_MATH_H_
