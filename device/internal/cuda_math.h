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

// One element of the fused update, in the reference's op order.
template <DType G, DType P, bool kOut>
ZERORT_HD void AdamWElement(const AdamWConstants& c, float* master, float* m, float* v,
                            const void* grad, void* param_out, size_t i) {
  const float g = Mul(LoadAs<G>(grad, i), c.grad_scale);
  const float mi = Fma(c.beta1, m[i], Mul(c.one_minus_beta1, g));
  const float vi = Fma(c.beta2, v[i], Mul(Mul(c.one_minus_beta2, g), g));
  const float denom = Fma(Sqrt(vi), c.inv_sqrt_bias2, c.eps);
  const float p = Fma(c.neg_step_size, Div(mi, denom), Mul(master[i], c.decay));
  m[i] = mi;
  v[i] = vi;
  master[i] = p;
  if constexpr (kOut) StoreAs<P>(param_out, i, p);
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
