// Loads and stores of fp32 / bf16 / fp16 arrays as fp32 vectors, for the host kernels.
//
// Every variant (scalar, AVX2, AVX-512) converts exactly as base/dtype.h does: widening is exact;
// narrowing rounds to nearest even, bf16 NaN keeps its payload with the quiet bit set, fp16 uses
// the hardware's round-to-nearest-even conversion (vcvtps2ph imm 0), which equals FloatToHalf on
// every input including subnormals, overflow and NaN (cpu_kernels_test checks all of them).
//
// Functions carry target attributes instead of the file being compiled with -mavx2: the same
// binary runs on CPUs without AVX2, and the caller picks a variant from offload/simd.h.
#ifndef ZERORT_OFFLOAD_INTERNAL_SIMD_CONVERT_H_
#define ZERORT_OFFLOAD_INTERNAL_SIMD_CONVERT_H_

#include <immintrin.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>

#include "base/dtype.h"
#include "offload/thread_pool.h"

#define ZERORT_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define ZERORT_TARGET_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

namespace zerort {
namespace offload {
namespace internal {

// ------------------------------------------------------------------ scalar

template <DType D>
inline float LoadScalar(const void* p, size_t i) {
  if constexpr (D == DType::kF32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (D == DType::kBF16) {
    return Bf16ToFloat(static_cast<const uint16_t*>(p)[i]);
  } else {
    return HalfToFloat(static_cast<const uint16_t*>(p)[i]);
  }
}

template <DType D>
inline void StoreScalar(void* p, size_t i, float x) {
  if constexpr (D == DType::kF32) {
    static_cast<float*>(p)[i] = x;
  } else if constexpr (D == DType::kBF16) {
    static_cast<uint16_t*>(p)[i] = FloatToBf16(x);
  } else {
    static_cast<uint16_t*>(p)[i] = FloatToHalf(x);
  }
}

// ------------------------------------------------------------------ AVX2 (8 lanes)

template <DType D>
ZERORT_TARGET_AVX2 inline __m256 LoadAvx2(const void* p, size_t i) {
  if constexpr (D == DType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  } else {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
    if constexpr (D == DType::kBF16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

// FloatToBf16 on 8 lanes; result in the low 16 bits of each 32-bit lane.
ZERORT_TARGET_AVX2 inline __m256i Bf16BitsAvx2(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i hi = _mm256_srli_epi32(u, 16);
  const __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i is_nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));
  const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                        _mm256_and_si256(hi, _mm256_set1_epi32(1)));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256i nan = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, nan, is_nan);
}

template <DType D>
ZERORT_TARGET_AVX2 inline void StoreAvx2(void* p, size_t i, __m256 x) {
  if constexpr (D == DType::kF32) {
    _mm256_storeu_ps(static_cast<float*>(p) + i, x);
  } else {
    __m128i h;
    if constexpr (D == DType::kBF16) {
      const __m256i b = Bf16BitsAvx2(x);
      // Lanes hold values <= 0xffff, so the unsigned saturating pack is a plain narrowing.
      h = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    } else {
      h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p) + i), h);
  }
}

// ------------------------------------------------------------------ AVX-512 (16 lanes)

template <DType D>
ZERORT_TARGET_AVX512 inline __m512 LoadAvx512(const void* p, size_t i) {
  if constexpr (D == DType::kF32) {
    return _mm512_loadu_ps(static_cast<const float*>(p) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i));
    if constexpr (D == DType::kBF16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

template <DType D>
ZERORT_TARGET_AVX512 inline void StoreAvx512(void* p, size_t i, __m512 x) {
  if constexpr (D == DType::kF32) {
    _mm512_storeu_ps(static_cast<float*>(p) + i, x);
  } else {
    __m256i h;
    if constexpr (D == DType::kBF16) {
      const __m512i u = _mm512_castps_si512(x);
      const __m512i hi = _mm512_srli_epi32(u, 16);
      const __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
      const __mmask16 is_nan = _mm512_cmpgt_epi32_mask(abs, _mm512_set1_epi32(0x7f800000));
      const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                            _mm512_and_si512(hi, _mm512_set1_epi32(1)));
      const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
      const __m512i nan = _mm512_or_si512(hi, _mm512_set1_epi32(0x40));
      h = _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, nan));
    } else {
      h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p) + i), h);
  }
}

// ------------------------------------------------------------------ threading

// Splits [0, n) into at most `threads` contiguous ranges (0: the default pool's size) of at
// least `min_per_task` elements, boundaries on multiples of 64 elements (whole cache lines for
// every dtype), and runs fn(begin, end) for each on the default pool. Results never depend on
// the split: every kernel computes each element (or each fixed block) independently.
inline void ParallelRanges(size_t n, int threads, size_t min_per_task,
                           const std::function<void(size_t, size_t)>& fn) {
  if (n == 0) return;
  ThreadPool* pool = DefaultThreadPool();
  size_t tasks = threads <= 0 ? static_cast<size_t>(pool->num_threads())
                              : static_cast<size_t>(threads);
  tasks = std::min(tasks, (n + min_per_task - 1) / min_per_task);
  if (tasks <= 1) {
    fn(0, n);
    return;
  }
  const size_t chunk = ((n + tasks - 1) / tasks + 63) / 64 * 64;
  pool->ParallelFor(static_cast<int>(tasks), [&](int t) {
    const size_t begin = static_cast<size_t>(t) * chunk;
    if (begin < n) fn(begin, std::min(n, begin + chunk));
  });
}

}  // namespace internal
}  // namespace offload
}  // namespace zerort

#endif  // ZERORT_OFFLOAD_INTERNAL_SIMD_CONVERT_H_
