// The vector instruction sets of the host kernels as lane traits, and the machinery that compiles
// one kernel body once per instruction set.
//
// A kernel's vector path is written once, in a textual `.inc` file, over `V`: the traits of one
// instruction set (Avx2Lanes: 8 fp32 lanes; Avx512Lanes: 16). Each trait is one instruction, so
// the body names exactly the operations of docs/offload.md and nothing is fused that the source
// does not fuse (the kernels are built with -ffp-contract=off). for_each_lanes.inc compiles the
// body once per set, inside a target region, into namespaces `avx2` and `avx512`; the caller
// picks `avx2::Kernel` or `avx512::Kernel` from offload/simd.h at run time.
//
// Why a target region and not one template instantiated twice: a function's target (which
// instructions it may use) comes from its definition, and a body without one cannot inline the
// intrinsics. Why not -mavx512f on a whole file: inline functions from headers would be emitted
// with AVX-512 and might be the copy the linker keeps, breaking CPUs without it.
//
// Usage, in a kernel .cc after its scalar reference:
//   #define ZERORT_LANE_KERNELS "offload/internal/adamw_lanes.inc"
//   #include "offload/internal/for_each_lanes.inc"
//   ... &avx2::AdamWLanes<...>, &avx512::AdamWLanes<...>
//
// Stateless; every function is thread-safe.
#ifndef ZERORT_OFFLOAD_INTERNAL_SIMD_LANES_H_
#define ZERORT_OFFLOAD_INTERNAL_SIMD_LANES_H_

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "base/dtype.h"
#include "offload/internal/simd_convert.h"
#include "offload/simd.h"

// GCC 12 reports the deliberately undefined upper halves inside its own AVX-512 intrinsics
// (_mm512_undefined_*) as maybe-uninitialized; the warning is about the header, not our code.
// File scope on purpose: it must cover the kernels into which the intrinsics are inlined.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#define ZERORT_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define ZERORT_TARGET_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

// Every function defined between ZERORT_LANES_BEGIN and ZERORT_LANES_END is compiled for the
// instruction sets `isa`, inside namespace `ns` where `V` names `lanes`.
#define ZERORT_LANES_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define ZERORT_LANES_PUSH_TARGET(isa) \
  ZERORT_LANES_PRAGMA(clang attribute push(__attribute__((target(isa))), apply_to = function))
#define ZERORT_LANES_POP_TARGET ZERORT_LANES_PRAGMA(clang attribute pop)
#else
#define ZERORT_LANES_PUSH_TARGET(isa) \
  ZERORT_LANES_PRAGMA(GCC push_options) ZERORT_LANES_PRAGMA(GCC target(isa))
#define ZERORT_LANES_POP_TARGET ZERORT_LANES_PRAGMA(GCC pop_options)
#endif
#define ZERORT_LANES_BEGIN(ns, lanes, isa) \
  ZERORT_LANES_PUSH_TARGET(isa)            \
  namespace ns {                           \
  using V = ::zerort::offload::internal::lanes;
#define ZERORT_LANES_END(ns) \
  } /* namespace ns */       \
  ZERORT_LANES_POP_TARGET

namespace zerort {
namespace offload {
namespace internal {

// F: fp32 lanes; I: the same bits as int32 lanes; H: one uint16 per lane (bf16/fp16 bits);
// M: a per-lane condition. Names follow the operation, not the instruction.
struct Avx2Lanes {
  using F = __m256;
  using I = __m256i;
  using H = __m128i;
  using M = __m256i;
  static constexpr size_t kLanes = 8;
  // Prefetching was measured on the AVX-512 path only (see adamw_lanes.inc).
  static constexpr bool kPrefetchNarrowGrads = false;

  ZERORT_TARGET_AVX2 static F Set1(float x) { return _mm256_set1_ps(x); }
  ZERORT_TARGET_AVX2 static F Load(const float* p) { return _mm256_loadu_ps(p); }
  ZERORT_TARGET_AVX2 static void Store(float* p, F x) { _mm256_storeu_ps(p, x); }
  ZERORT_TARGET_AVX2 static F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
  ZERORT_TARGET_AVX2 static F Div(F a, F b) { return _mm256_div_ps(a, b); }
  ZERORT_TARGET_AVX2 static F Sqrt(F a) { return _mm256_sqrt_ps(a); }
  // a * b + c, rounded once.
  ZERORT_TARGET_AVX2 static F Fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }

  ZERORT_TARGET_AVX2 static I Set1I(int32_t x) { return _mm256_set1_epi32(x); }
  ZERORT_TARGET_AVX2 static I AsInt(F x) { return _mm256_castps_si256(x); }
  ZERORT_TARGET_AVX2 static F AsFloat(I x) { return _mm256_castsi256_ps(x); }
  ZERORT_TARGET_AVX2 static I And(I a, I b) { return _mm256_and_si256(a, b); }
  ZERORT_TARGET_AVX2 static I Or(I a, I b) { return _mm256_or_si256(a, b); }
  ZERORT_TARGET_AVX2 static I Add(I a, I b) { return _mm256_add_epi32(a, b); }
  ZERORT_TARGET_AVX2 static I Shl16(I a) { return _mm256_slli_epi32(a, 16); }
  ZERORT_TARGET_AVX2 static I Shr16(I a) { return _mm256_srli_epi32(a, 16); }
  // The compact forms' bit work (offload/compact_state.h): remainders and random bits.
  ZERORT_TARGET_AVX2 static I Sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  ZERORT_TARGET_AVX2 static I Xor(I a, I b) { return _mm256_xor_si256(a, b); }
  // The low 32 bits of a * b.
  ZERORT_TARGET_AVX2 static I MulLo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  template <int k>
  ZERORT_TARGET_AVX2 static I ShrI(I a) { return _mm256_srli_epi32(a, k); }
  // 0, 1, ..., kLanes - 1.
  ZERORT_TARGET_AVX2 static I Iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  // Signed a > b.
  ZERORT_TARGET_AVX2 static M Greater(I a, I b) { return _mm256_cmpgt_epi32(a, b); }
  // `yes` where `m` holds, else `no`.
  ZERORT_TARGET_AVX2 static I Select(M m, I yes, I no) { return _mm256_blendv_epi8(no, yes, m); }

  ZERORT_TARGET_AVX2 static H LoadHalf(const uint16_t* p) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  }
  ZERORT_TARGET_AVX2 static void StoreHalf(uint16_t* p, H h) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
  }
  ZERORT_TARGET_AVX2 static I WidenU16(H h) { return _mm256_cvtepu16_epi32(h); }
  // Lanes hold values <= 0xffff, so the unsigned saturating pack is a plain narrowing.
  ZERORT_TARGET_AVX2 static H NarrowU32(I x) {
    return _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  }
  ZERORT_TARGET_AVX2 static F HalfToFloat(H h) { return _mm256_cvtph_ps(h); }
  // Round to nearest even (vcvtps2ph imm 0), equal to FloatToHalf on every input.
  ZERORT_TARGET_AVX2 static H FloatToHalf(F x) {
    return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
};

struct Avx512Lanes {
  using F = __m512;
  using I = __m512i;
  using H = __m256i;
  using M = __mmask16;
  static constexpr size_t kLanes = 16;
  static constexpr bool kPrefetchNarrowGrads = true;

  ZERORT_TARGET_AVX512 static F Set1(float x) { return _mm512_set1_ps(x); }
  ZERORT_TARGET_AVX512 static F Load(const float* p) { return _mm512_loadu_ps(p); }
  ZERORT_TARGET_AVX512 static void Store(float* p, F x) { _mm512_storeu_ps(p, x); }
  ZERORT_TARGET_AVX512 static F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  ZERORT_TARGET_AVX512 static F Div(F a, F b) { return _mm512_div_ps(a, b); }
  ZERORT_TARGET_AVX512 static F Sqrt(F a) { return _mm512_sqrt_ps(a); }
  ZERORT_TARGET_AVX512 static F Fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }

  ZERORT_TARGET_AVX512 static I Set1I(int32_t x) { return _mm512_set1_epi32(x); }
  ZERORT_TARGET_AVX512 static I AsInt(F x) { return _mm512_castps_si512(x); }
  ZERORT_TARGET_AVX512 static F AsFloat(I x) { return _mm512_castsi512_ps(x); }
  ZERORT_TARGET_AVX512 static I And(I a, I b) { return _mm512_and_si512(a, b); }
  ZERORT_TARGET_AVX512 static I Or(I a, I b) { return _mm512_or_si512(a, b); }
  ZERORT_TARGET_AVX512 static I Add(I a, I b) { return _mm512_add_epi32(a, b); }
  ZERORT_TARGET_AVX512 static I Shl16(I a) { return _mm512_slli_epi32(a, 16); }
  ZERORT_TARGET_AVX512 static I Shr16(I a) { return _mm512_srli_epi32(a, 16); }
  ZERORT_TARGET_AVX512 static I Sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  ZERORT_TARGET_AVX512 static I Xor(I a, I b) { return _mm512_xor_si512(a, b); }
  ZERORT_TARGET_AVX512 static I MulLo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  template <int k>
  ZERORT_TARGET_AVX512 static I ShrI(I a) { return _mm512_srli_epi32(a, k); }
  ZERORT_TARGET_AVX512 static I Iota() {
    return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  }
  ZERORT_TARGET_AVX512 static M Greater(I a, I b) { return _mm512_cmpgt_epi32_mask(a, b); }
  ZERORT_TARGET_AVX512 static I Select(M m, I yes, I no) {
    return _mm512_mask_blend_epi32(m, no, yes);
  }

  ZERORT_TARGET_AVX512 static H LoadHalf(const uint16_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  ZERORT_TARGET_AVX512 static void StoreHalf(uint16_t* p, H h) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  }
  ZERORT_TARGET_AVX512 static I WidenU16(H h) { return _mm512_cvtepu16_epi32(h); }
  ZERORT_TARGET_AVX512 static H NarrowU32(I x) { return _mm512_cvtepi32_epi16(x); }
  ZERORT_TARGET_AVX512 static F HalfToFloat(H h) { return _mm512_cvtph_ps(h); }
  ZERORT_TARGET_AVX512 static H FloatToHalf(F x) {
    return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
};

// One kernel's path for `level`: its scalar reference, avx2:: or avx512:: instantiation.
template <typename Fn>
Fn PickLevel(SimdLevel level, Fn scalar, Fn avx2, Fn avx512) {
  switch (level) {
    case SimdLevel::kAvx512:
      return avx512;
    case SimdLevel::kAvx2:
      return avx2;
    case SimdLevel::kScalar:
      break;
  }
  return scalar;
}

}  // namespace internal
}  // namespace offload
}  // namespace zerort

#endif  // ZERORT_OFFLOAD_INTERNAL_SIMD_LANES_H_
