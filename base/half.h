// The scalar conversions between fp32 and the two 2-byte types, written once for the host
// compiler and for nvcc: base/dtype.h offers them to host code, and the CUDA kernels
// (device/internal/cuda_math.h, cuda_kernels.cu) compile the same lines for the device, so the
// GPU's conversions cannot drift from the reference every SIMD path is tested against.
//
//   uint16_t h = FloatToHalf(x);      // round to nearest even; overflow -> inf
//   float y = Bf16ToFloat(FloatToBf16(x));
//
// Half types are raw uint16_t bits, so host code needs no compiler extension. Semantics, which
// every implementation in zerort must match bit for bit (base/dtype_test, device/
// cuda_device_test): round to nearest even, subnormals kept (no flush to zero), a NaN stays a
// NaN with its payload's top bits and the quiet bit set (as F16C's vcvtph2ps / vcvtps2ph do).
// Integer bit manipulation only, plus one multiplication that is exact (see HalfToFloat), so
// neither compiler flags nor fused multiply-adds can change a result.
// One exception, in device code only: the fp16 conversions of a non-NaN use the GPU's cvt
// instruction, which computes the same IEEE result (see each function); NaNs still take these
// lines. The host lines stay the reference.
//
// Thread safety: pure functions.
#ifndef ZERORT_BASE_HALF_H_
#define ZERORT_BASE_HALF_H_

#include <cstdint>
#include <cstring>

// Marks a function callable from host and device code under nvcc; nothing for other compilers.
#if defined(__CUDACC__)
#define ZERORT_HOST_DEVICE __host__ __device__
#else
#define ZERORT_HOST_DEVICE
#endif

namespace zerort {

ZERORT_HOST_DEVICE inline uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

ZERORT_HOST_DEVICE inline float BitsToFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

ZERORT_HOST_DEVICE inline float Bf16ToFloat(uint16_t h) {
  return BitsToFloat(static_cast<uint32_t>(h) << 16);
}

ZERORT_HOST_DEVICE inline uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

ZERORT_HOST_DEVICE inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  // Inf / NaN; a signaling NaN comes back quiet, as F16C's vcvtph2ps returns it.
  if (exp == 0x1f) return BitsToFloat(sign | 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0u));
#if defined(__CUDA_ARCH__)
  // A finite value, on the device: the hardware conversion (one instruction instead of about
  // fifteen integer ops: fp16 Accumulate ran at 0.52 of a device-to-device copy with the code
  // below, compute bound). cvt.f32.f16 widens exactly: every finite binary16 value, subnormals
  // included, is an fp32 value, and without .ftz nothing is flushed. NaNs stay on the line
  // above, as the hardware would return a canonical NaN.
  float hw;
  asm("cvt.f32.f16 %0, %1;" : "=f"(hw) : "h"(h));
  return hw;
#endif
  if (exp != 0) return BitsToFloat(sign | ((exp + 112u) << 23) | (mant << 13));
  // Zero or subnormal: mant * 2^-24 is exact in fp32 (an integer below 2^10 times a power of
  // two, a normal float), so this product has no rounding to differ on, and no loop to
  // normalise the mantissa diverges a GPU warp.
  return BitsToFloat(sign | FloatBits(static_cast<float>(mant) * 5.9604644775390625e-8f));
}

ZERORT_HOST_DEVICE inline uint16_t FloatToHalf(float f) {
  const uint32_t u = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) {  // NaN: quiet, top payload bits kept
    return static_cast<uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
  }
#if defined(__CUDA_ARCH__)
  // The device uses the hardware conversion for everything but a NaN (handled above, as the
  // hardware would return a canonical NaN). cvt.rn.f16.f32 is IEEE 754 binary32 -> binary16
  // conversion rounding to nearest, ties to even: subnormal results are produced (no .ftz),
  // a magnitude that rounds to 65520 or more becomes Inf (no .satfinite), one below half the
  // smallest subnormal becomes a signed zero. That is the code below, case for case; every
  // fp32 pattern is compared on the GPU by cuda_device_test.
  uint16_t hw;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(hw) : "f"(f));
  return hw;
#endif
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero): shift the full mantissa and round to nearest even.
    if (abs < 0x33000000u) return sign;  // below half the smallest subnormal
    const uint32_t e = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;  // 14..24
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  uint32_t v = abs - 0x38000000u;  // rebias exponent 127 -> 15
  v += 0xfffu + ((v >> 13) & 1u);
  return static_cast<uint16_t>(sign | (v >> 13));
}

}  // namespace zerort

#endif  // ZERORT_BASE_HALF_H_
