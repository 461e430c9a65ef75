#include "comm/internal/reduce.h"

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace zerort {
namespace comm {
namespace internal {
namespace {

// Elements per chunk of the scalar path: its fp32 accumulator (4 KiB) stays in L1 while the n
// sources stream past.
constexpr size_t kChunk = 1024;

inline float MaxOp(float acc, float x) { return (acc > x || acc != acc) ? acc : x; }


// Any NaN result is stored as the positive quiet NaN: which input's payload an IEEE add
// propagates depends on operand order, which compilers treat as commutative, so keeping payloads
// would make the bits depend on the code path (SIMD body versus scalar tail).
constexpr uint32_t kCanonicalNan = 0x7fc00000u;

template <DType D>
inline void Store(void* p, size_t i, float v) {
  if (v != v) v = BitsToFloat(kCanonicalNan);
  StoreAs<D>(p, i, v);
}

template <DType D>
void ScalarImpl(const void* const* srcs, int n, void* dst, size_t count, ReduceOp op) {
  const float divisor = static_cast<float>(n);
  float acc[kChunk];
  for (size_t base = 0; base < count; base += kChunk) {
    const size_t len = count - base < kChunk ? count - base : kChunk;
    for (size_t j = 0; j < len; ++j) acc[j] = LoadAs<D>(srcs[0], base + j);
    for (int k = 1; k < n; ++k) {
      if (op == ReduceOp::kMax) {
        for (size_t j = 0; j < len; ++j) acc[j] = MaxOp(acc[j], LoadAs<D>(srcs[k], base + j));
      } else {
        for (size_t j = 0; j < len; ++j) acc[j] += LoadAs<D>(srcs[k], base + j);
      }
    }
    if (op == ReduceOp::kAvg) {
      for (size_t j = 0; j < len; ++j) acc[j] /= divisor;
    }
    for (size_t j = 0; j < len; ++j) Store<D>(dst, base + j, acc[j]);
  }
}

#if defined(__x86_64__)
// Why a hand-written AVX2/F16C path: single-thread sum of two 8 MiB sources (comm_bench's
// reduce_kernel, shared 2-core Zen 3, GB/s read + written) avx2 vs scalar: fp32 8.0 vs 5.2,
// bf16 6.4 vs 2.1, fp16 7.4 vs 0.75 (the scalar half conversion does not vectorise).
#define ZERORT_SIMD __attribute__((target("avx2,f16c")))

template <DType D>
ZERORT_SIMD inline __m256 Load8(const void* p, size_t i) {
  if (D == DType::kF32) return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  const __m128i h =
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
  if (D == DType::kBF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}

template <DType D>
ZERORT_SIMD inline void Store8(void* p, size_t i, __m256 v) {
  v = _mm256_blendv_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(kCanonicalNan)),
                       _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  if (D == DType::kF32) {
    _mm256_storeu_ps(static_cast<float*>(p) + i, v);
    return;
  }
  __m128i h;
  if (D == DType::kBF16) {
    // Same arithmetic as FloatToBf16: NaN keeps its top bits and becomes quiet, else RNE.
    const __m256i u = _mm256_castps_si256(v);
    const __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    const __m256i is_nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i r = _mm256_blendv_epi8(rounded, quiet, is_nan);
    // packus works per 128-bit lane; gather the two useful quarters into the low half.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    h = _mm256_castsi256_si128(packed);
  } else {
    h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p) + i), h);
}

template <bool kMax>
ZERORT_SIMD inline __m256 Combine8(__m256 a, __m256 x) {
  if (!kMax) return _mm256_add_ps(a, x);
  // MaxOp: keep acc where acc > x or acc is NaN, else take x.
  const __m256 keep = _mm256_or_ps(_mm256_cmp_ps(a, x, _CMP_GT_OQ), _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  return _mm256_blendv_ps(x, a, keep);
}

// The accumulator lives in registers: every source is read once and the result written once,
// with the same per-element order (source 0, then 1, ...) as the scalar path. Keeping it in an L1
// array instead cost a store and a reload per source. comm_bench --quick reduce_kernel (two
// 8 MiB sources, single thread, GB/s read + written, two runs each, shared 2-core machine):
// fp32 8.0-9.0 -> 11.1-11.2, bf16 4.0-7.2 -> 7.6-9.3.
template <DType D, bool kMax, bool kAvg>
ZERORT_SIMD void SimdLoop(const void* const* srcs, int n, void* dst, size_t vec_count) {
  const __m256 divisor = _mm256_set1_ps(static_cast<float>(n));
  size_t i = 0;
  for (; i + 16 <= vec_count; i += 16) {
    __m256 a0 = Load8<D>(srcs[0], i);
    __m256 a1 = Load8<D>(srcs[0], i + 8);
    for (int k = 1; k < n; ++k) {
      a0 = Combine8<kMax>(a0, Load8<D>(srcs[k], i));
      a1 = Combine8<kMax>(a1, Load8<D>(srcs[k], i + 8));
    }
    if (kAvg) {
      a0 = _mm256_div_ps(a0, divisor);
      a1 = _mm256_div_ps(a1, divisor);
    }
    Store8<D>(dst, i, a0);
    Store8<D>(dst, i + 8, a1);
  }
  for (; i < vec_count; i += 8) {
    __m256 a = Load8<D>(srcs[0], i);
    for (int k = 1; k < n; ++k) a = Combine8<kMax>(a, Load8<D>(srcs[k], i));
    if (kAvg) a = _mm256_div_ps(a, divisor);
    Store8<D>(dst, i, a);
  }
}

template <DType D>
ZERORT_SIMD void SimdImpl(const void* const* srcs, int n, void* dst, size_t count, ReduceOp op) {
  const size_t vec_count = count & ~size_t{7};
  switch (op) {
    case ReduceOp::kSum:
      SimdLoop<D, false, false>(srcs, n, dst, vec_count);
      break;
    case ReduceOp::kAvg:
      SimdLoop<D, false, true>(srcs, n, dst, vec_count);
      break;
    case ReduceOp::kMax:
      SimdLoop<D, true, false>(srcs, n, dst, vec_count);
      break;
  }
  if (vec_count < count) {
    // Tail of < 8 elements: the scalar path on offset pointers.
    const size_t es = DTypeSize(D);
    std::vector<const void*> tail(n);
    for (int k = 0; k < n; ++k) tail[k] = static_cast<const char*>(srcs[k]) + vec_count * es;
    ScalarImpl<D>(tail.data(), n, static_cast<char*>(dst) + vec_count * es, count - vec_count, op);
  }
}

// AVX-512 (F, BW, VL): 16 lanes, masked loads and stores for the tail, and optionally
// non-temporal stores. Why: comm_bench reduce_kernel, one thread, 64 MiB per source, 2-core
// Cascade Lake under load, GB/s read + written (memcpy 10.3), avx512+streaming / avx2:
// bf16 2 sources 11.4 / 9.8, 4 sources 11.5 / 7.9; fp32 and fp16 within 10% of each other. After NaN canonicalisation the bf16 rounding needs no NaN case: the
// canonical 0x7fc00000 rounds to 0x7fc0 like any other value.
#define ZERORT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
// GCC 12's avx512fintrin.h builds _mm512_slli/srli_epi32 and _mm512_cvtepu16_epi32 on an
// _mm512_undefined_epi32() pass-through, which -Wmaybe-uninitialized reports at every use.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

template <DType D>
ZERORT_AVX512 inline __m512 Load16(const void* p, size_t i, __mmask16 m) {
  if (D == DType::kF32) return _mm512_maskz_loadu_ps(m, static_cast<const float*>(p) + i);
  const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(p) + i);
  if (D == DType::kBF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_cvtph_ps(h);
}

// kStream: dst + i must be 64-byte aligned (fp32) or 32-byte aligned (16-bit), m all ones.
template <DType D, bool kStream>
ZERORT_AVX512 inline void Store16(void* p, size_t i, __m512 v, __mmask16 m) {
  v = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v,
                           _mm512_castsi512_ps(_mm512_set1_epi32(kCanonicalNan)));
  if (D == DType::kF32) {
    float* q = static_cast<float*>(p) + i;
    if (kStream) {
      _mm512_stream_ps(q, v);
    } else {
      _mm512_mask_storeu_ps(q, m, v);
    }
    return;
  }
  __m256i h;
  if (D == DType::kBF16) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16));
  } else {
    h = _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  uint16_t* q = static_cast<uint16_t*>(p) + i;
  if (kStream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(q), h);
  } else {
    _mm256_mask_storeu_epi16(q, m, h);
  }
}

template <bool kMax>
ZERORT_AVX512 inline __m512 Combine16(__m512 a, __m512 x) {
  if (!kMax) return _mm512_add_ps(a, x);
  const __mmask16 keep = _mm512_cmp_ps_mask(a, x, _CMP_GT_OQ) | _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
  return _mm512_mask_blend_ps(keep, x, a);
}

// Elements [begin, end): 32 per step with two register accumulators, then 16 at a time, then
// one masked step. Same per-element order as the scalar path.
template <DType D, bool kMax, bool kAvg, bool kStream>
ZERORT_AVX512 void Avx512Range(const void* const* srcs, int n, void* dst, size_t begin,
                               size_t end) {
  const __m512 divisor = _mm512_set1_ps(static_cast<float>(n));
  const __mmask16 all = 0xffff;
  size_t i = begin;
  for (; i + 32 <= end; i += 32) {
    __m512 a0 = Load16<D>(srcs[0], i, all);
    __m512 a1 = Load16<D>(srcs[0], i + 16, all);
    for (int k = 1; k < n; ++k) {
      a0 = Combine16<kMax>(a0, Load16<D>(srcs[k], i, all));
      a1 = Combine16<kMax>(a1, Load16<D>(srcs[k], i + 16, all));
    }
    if (kAvg) {
      a0 = _mm512_div_ps(a0, divisor);
      a1 = _mm512_div_ps(a1, divisor);
    }
    Store16<D, kStream>(dst, i, a0, all);
    Store16<D, kStream>(dst, i + 16, a1, all);
  }
  for (; i < end; i += 16) {
    const __mmask16 m = end - i >= 16 ? all : static_cast<__mmask16>((1u << (end - i)) - 1);
    __m512 a = Load16<D>(srcs[0], i, m);
    for (int k = 1; k < n; ++k) a = Combine16<kMax>(a, Load16<D>(srcs[k], i, m));
    if (kAvg) a = _mm512_div_ps(a, divisor);
    Store16<D, false>(dst, i, a, m);
  }
}

template <DType D, bool kMax, bool kAvg>
ZERORT_AVX512 void Avx512Loop(const void* const* srcs, int n, void* dst, size_t count,
                              bool stream) {
  const size_t es = DTypeSize(D);
  const uintptr_t addr = reinterpret_cast<uintptr_t>(dst);
  if (!stream || addr % es != 0) {
    Avx512Range<D, kMax, kAvg, false>(srcs, n, dst, 0, count);
    return;
  }
  // Streaming stores need an aligned destination: a head with ordinary stores up to the next
  // 64-byte boundary, whole 32-element steps streamed, the rest ordinary again.
  const size_t head = std::min(count, ((64 - addr % 64) % 64) / es);
  const size_t body_end = head + (count - head) / 32 * 32;
  Avx512Range<D, kMax, kAvg, false>(srcs, n, dst, 0, head);
  Avx512Range<D, kMax, kAvg, true>(srcs, n, dst, head, body_end);
  // Streaming stores are weakly ordered: fence them before the caller publishes the result
  // (a barrier releases it to peers on other cores).
  _mm_sfence();
  Avx512Range<D, kMax, kAvg, false>(srcs, n, dst, body_end, count);
}

template <DType D>
void Avx512Impl(const void* const* srcs, int n, void* dst, size_t count, ReduceOp op,
                bool stream) {
  switch (op) {
    case ReduceOp::kSum:
      return Avx512Loop<D, false, false>(srcs, n, dst, count, stream);
    case ReduceOp::kAvg:
      return Avx512Loop<D, false, true>(srcs, n, dst, count, stream);
    case ReduceOp::kMax:
      return Avx512Loop<D, true, false>(srcs, n, dst, count, stream);
  }
}

#pragma GCC diagnostic pop

bool DetectAvx2() {
  // F16C through cpuid (leaf 1, ecx bit 29): not every compiler's __builtin_cpu_supports knows it.
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29)) != 0;
  return f16c && __builtin_cpu_supports("avx2");
}

// __builtin_cpu_supports also checks (XGETBV) that the OS saves the zmm state.
bool DetectAvx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}
#else
bool DetectAvx2() { return false; }
bool DetectAvx512() { return false; }
#endif

// Calls fn(std::integral_constant<DType, D>()) for the D that `dtype` names, so that one generic
// lambda picks the kernel instantiation for every dtype.
template <typename Fn>
void ForDType(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF32:
      return fn(std::integral_constant<DType, DType::kF32>());
    case DType::kBF16:
      return fn(std::integral_constant<DType, DType::kBF16>());
    case DType::kF16:
      return fn(std::integral_constant<DType, DType::kF16>());
  }
}

}  // namespace

const char* ReducePathName(ReducePath path) {
  switch (path) {
    case ReducePath::kScalar:
      return "scalar";
    case ReducePath::kAvx2:
      return "avx2";
    case ReducePath::kAvx512:
      return "avx512";
  }
  return "?";
}

bool ReducePathSupported(ReducePath path) {
  static const bool avx2 = DetectAvx2();
  static const bool avx512 = DetectAvx512();
  switch (path) {
    case ReducePath::kScalar:
      return true;
    case ReducePath::kAvx2:
      return avx2;
    case ReducePath::kAvx512:
      return avx512;
  }
  return false;
}

ReducePath ReduceBestPath() {
  if (ReducePathSupported(ReducePath::kAvx512)) return ReducePath::kAvx512;
  if (ReducePathSupported(ReducePath::kAvx2)) return ReducePath::kAvx2;
  return ReducePath::kScalar;
}

void ReduceBlocksWith(ReducePath path, bool stream, const void* const* srcs, int n, void* dst,
                      size_t count, DType dtype, ReduceOp op) {
  assert(n >= 1);
  assert(ReducePathSupported(path));
  ForDType(dtype, [&](auto dtype_constant) {
    constexpr DType D = decltype(dtype_constant)::value;
    switch (path) {
#if defined(__x86_64__)
      case ReducePath::kAvx512:
        return Avx512Impl<D>(srcs, n, dst, count, op, stream);
      case ReducePath::kAvx2:
        return SimdImpl<D>(srcs, n, dst, count, op);
#endif
      default:
        return ScalarImpl<D>(srcs, n, dst, count, op);
    }
  });
}

void ReduceBlocks(const void* const* srcs, int n, void* dst, size_t count, DType dtype,
                  ReduceOp op) {
  ReduceBlocksWith(ReduceBestPath(), count * DTypeSize(dtype) >= kStreamMinBytes, srcs, n, dst,
                   count, dtype, op);
}

}  // namespace internal
}  // namespace comm
}  // namespace zerort
