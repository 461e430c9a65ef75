// Built with -ffp-contract=off, like cpu_adamw.cc: only the fmas written out may be fused.
#include "offload/cpu_kernels.h"

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cmath>
#include <cstring>
#include <vector>

#include "offload/internal/simd_convert.h"
#include "offload/internal/simd_lanes.h"
#include "offload/simd.h"

namespace zerort {
namespace offload {
namespace {

using internal::ParallelRanges;

constexpr size_t kMinElementsPerTask = size_t{1} << 15;

// ------------------------------------------------------------------ scale and cast

template <DType S, DType D, bool kScale>
void MapScalar(const void* src, void* dst, float scale, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    float v = LoadAs<S>(src, i);
    if constexpr (kScale) v = v * scale;
    StoreAs<D>(dst, i, v);
  }
}

// The vector paths: MapLanes (and the conversions Load, Store) in namespaces avx2 and avx512.
#define ZERORT_LANE_KERNELS "offload/internal/map_lanes.inc"
#include "offload/internal/for_each_lanes.inc"

using MapFn = void (*)(const void*, void*, float, size_t, size_t);

template <DType S, DType D, bool kScale>
MapFn MapForLevel() {
  return internal::PickLevel<MapFn>(ActiveSimd(), &MapScalar<S, D, kScale>,
                                    &avx2::MapLanes<S, D, kScale>, &avx512::MapLanes<S, D, kScale>);
}

template <DType S, bool kScale>
MapFn MapForDst(DType d) {
  switch (d) {
    case DType::kF32:
      return MapForLevel<S, DType::kF32, kScale>();
    case DType::kBF16:
      return MapForLevel<S, DType::kBF16, kScale>();
    case DType::kF16:
      break;
  }
  return MapForLevel<S, DType::kF16, kScale>();
}

template <bool kScale>
MapFn SelectMap(DType s, DType d) {
  switch (s) {
    case DType::kF32:
      return MapForDst<DType::kF32, kScale>(d);
    case DType::kBF16:
      return MapForDst<DType::kBF16, kScale>(d);
    case DType::kF16:
      break;
  }
  return MapForDst<DType::kF16, kScale>(d);
}

// ------------------------------------------------------------------ squared norm

inline float BlockPartial(const float acc[8]) {
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

template <DType D>
float BlockNormScalar(const void* x, size_t begin, size_t end) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (size_t i = begin; i < end; ++i) {
    const float v = LoadAs<D>(x, i);
    acc[(i - begin) % 8] = std::fma(v, v, acc[(i - begin) % 8]);
  }
  return BlockPartial(acc);
}

// The 8 lanes of the definition are exactly one AVX2 register. AVX-512 gains nothing here (the
// loop is memory-bound and 16 lanes would need a second register to keep the order), so the
// AVX-512 level uses this too.
template <DType D>
ZERORT_TARGET_AVX2 float BlockNormAvx2(const void* x, size_t begin, size_t end) {
  __m256 acc = _mm256_setzero_ps();
  size_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 v = avx2::Load<D>(x, i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (size_t l = 0; i < end; ++i, ++l) {
    const float v = LoadAs<D>(x, i);
    lanes[l] = std::fma(v, v, lanes[l]);
  }
  return BlockPartial(lanes);
}

template <DType D>
void BlockNorms(const void* x, size_t n, int threads, float* partials) {
  const bool simd = ActiveSimd() != SimdLevel::kScalar;
  ParallelRanges(n, threads, kMinElementsPerTask, [&](size_t begin, size_t end) {
    // Range boundaries are multiples of 64, not necessarily of kNormBlock: walk whole blocks
    // that start inside the range.
    for (size_t b = (begin + kNormBlock - 1) / kNormBlock; b * kNormBlock < end; ++b) {
      const size_t bb = b * kNormBlock, be = std::min(n, bb + kNormBlock);
      partials[b] = simd ? BlockNormAvx2<D>(x, bb, be) : BlockNormScalar<D>(x, bb, be);
    }
  });
}

// ------------------------------------------------------------------ finite check

template <DType D>
bool AllFiniteScalar(const void* x, size_t begin, size_t end) {
  if constexpr (D == DType::kF32) {
    const auto* u = static_cast<const uint32_t*>(x);
    uint32_t bad = 0;
    for (size_t i = begin; i < end; ++i) bad |= (u[i] & 0x7f800000u) == 0x7f800000u;
    return bad == 0;
  } else {
    const uint16_t mask = D == DType::kBF16 ? 0x7f80u : 0x7c00u;
    const auto* u = static_cast<const uint16_t*>(x);
    uint32_t bad = 0;
    for (size_t i = begin; i < end; ++i) bad |= (u[i] & mask) == mask;
    return bad == 0;
  }
}

template <DType D>
ZERORT_TARGET_AVX2 bool AllFiniteAvx2(const void* x, size_t begin, size_t end) {
  // All-ones exponent means Inf or NaN. 32 bytes per iteration for every dtype.
  const auto* bytes = static_cast<const uint8_t*>(x);
  const size_t esize = DTypeSize(D);
  __m256i bad = _mm256_setzero_si256();
  size_t i = begin;
  const size_t per = 32 / esize;
  for (; i + per <= end; i += per) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + i * esize));
    if constexpr (D == DType::kF32) {
      const __m256i e = _mm256_set1_epi32(0x7f800000);
      bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(v, e), e));
    } else {
      const __m256i e = _mm256_set1_epi16(D == DType::kBF16 ? 0x7f80 : 0x7c00);
      bad = _mm256_or_si256(bad, _mm256_cmpeq_epi16(_mm256_and_si256(v, e), e));
    }
  }
  return _mm256_testz_si256(bad, bad) && AllFiniteScalar<D>(x, i, end);
}

}  // namespace

float SquaredNormF32(const void* x, DType dtype, size_t n, int threads) {
  assert(threads >= 0 && (x != nullptr || n == 0));
  if (n == 0) return 0.0f;
  // (ceil(n / 1024)) fp32: 0.1% of an fp32 input, the price of a thread-independent order.
  std::vector<float> partials((n + kNormBlock - 1) / kNormBlock);
  switch (dtype) {
    case DType::kF32:
      BlockNorms<DType::kF32>(x, n, threads, partials.data());
      break;
    case DType::kBF16:
      BlockNorms<DType::kBF16>(x, n, threads, partials.data());
      break;
    case DType::kF16:
      BlockNorms<DType::kF16>(x, n, threads, partials.data());
      break;
  }
  return NormTreeSum(partials.data(), partials.size());
}

float NormTreeSum(float* values, size_t count) {
  assert(values != nullptr || count == 0);
  if (count == 0) return 0.0f;
  while (count > 1) {
    const size_t chunks = (count + kNormTreeChunk - 1) / kNormTreeChunk;
    for (size_t c = 0; c < chunks; ++c) {
      float v[kNormTreeChunk];
      const size_t begin = c * kNormTreeChunk;
      const size_t len = std::min(kNormTreeChunk, count - begin);
      std::copy(values + begin, values + begin + len, v);
      std::fill(v + len, v + kNormTreeChunk, 0.0f);
      for (size_t stride = kNormTreeChunk / 2; stride >= 1; stride /= 2) {
        for (size_t i = 0; i < stride; ++i) v[i] = v[i] + v[i + stride];
      }
      values[c] = v[0];  // c <= begin: chunk c's inputs are already read
    }
    count = chunks;
  }
  return values[0];
}

bool AllFinite(const void* x, DType dtype, size_t n, int threads) {
  assert(threads >= 0 && (x != nullptr || n == 0));
  using Fn = bool (*)(const void*, size_t, size_t);
  const bool simd = ActiveSimd() != SimdLevel::kScalar;
  Fn fn = nullptr;
  switch (dtype) {
    case DType::kF32:
      fn = simd ? &AllFiniteAvx2<DType::kF32> : &AllFiniteScalar<DType::kF32>;
      break;
    case DType::kBF16:
      fn = simd ? &AllFiniteAvx2<DType::kBF16> : &AllFiniteScalar<DType::kBF16>;
      break;
    case DType::kF16:
      fn = simd ? &AllFiniteAvx2<DType::kF16> : &AllFiniteScalar<DType::kF16>;
      break;
  }
  std::atomic<bool> finite{true};
  ParallelRanges(n, threads, kMinElementsPerTask, [&](size_t begin, size_t end) {
    if (!fn(x, begin, end)) finite.store(false, std::memory_order_relaxed);
  });
  return finite.load();
}

void Scale(void* x, DType dtype, size_t n, float scale, int threads) {
  assert(threads >= 0 && (x != nullptr || n == 0));
  const MapFn fn = SelectMap<true>(dtype, dtype);
  ParallelRanges(n, threads, kMinElementsPerTask,
                 [&](size_t begin, size_t end) { fn(x, x, scale, begin, end); });
}

void Cast(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t n, int threads) {
  assert(threads >= 0 && ((src != nullptr && dst != nullptr) || n == 0));
  if (src_dtype == dst_dtype) {
    // A same-dtype "cast" is a copy; fp16 -> fp32 -> fp16 would also be exact, but slower.
    const size_t esize = DTypeSize(src_dtype);
    ParallelRanges(n, threads, kMinElementsPerTask, [&](size_t begin, size_t end) {
      std::memcpy(static_cast<char*>(dst) + begin * esize,
                  static_cast<const char*>(src) + begin * esize, (end - begin) * esize);
    });
    return;
  }
  const MapFn fn = SelectMap<false>(src_dtype, dst_dtype);
  ParallelRanges(n, threads, kMinElementsPerTask,
                 [&](size_t begin, size_t end) { fn(src, dst, 1.0f, begin, end); });
}

}  // namespace offload
}  // namespace zerort
