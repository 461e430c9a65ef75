// Host AdamW throughput against the memory floor of its own access pattern.
//
// For each size and dtype configuration it measures, at 1 thread and at all threads:
//   adamw        offload::CpuAdamW (the engine's kernel, SIMD level from CPUID)
//   adamw_groups the same over per-range constants as parameter groups give them: ranges of
//                65536 and 768 elements alternating between two sets of constants (a decayed
//                matrix, then a bias or norm gain: GPT-2's density at 1e7 elements, denser below)
//   floor        a streaming kernel touching exactly the arrays AdamW touches, in the same
//                dtypes, with trivial arithmetic: the physical limit of this access pattern
//   scalar_loop  the AdamW a trainer would write (plain loop, bias corrections hoisted)
//   triad        STREAM triad a = b + s*c on fp32, as GB/s and as params/s at AdamW's bytes
// and prints one JSON document. Goal: adamw >= 0.9 * floor for every size above the LLC, and
// adamw_groups within noise of adamw (groups_over_one ~ 1).
//
// "forms": offload::CpuAdamWCompact for each compact optimizer-state form (master fp32, bf16 +
// remainder or stochastic bf16; moments fp32 or bf16; bf16 grads and params), each against a
// floor of its own access pattern (compact_floor: the same arrays in the same dtypes, read and
// written once, one add each) timed interleaved with it. Bytes per parameter (reads + writes):
//   master    moments  bytes              master    moments  bytes
//   f32       f32      28                 f32       bf16     20
//   bf16+rem  f32      26                 bf16+rem  bf16     18
//   bf16 (SR) f32      22                 bf16 (SR) bf16     14
// Goal (issue 26): each form >= 0.95 of its floor at 1e7-1e8 parameters.
//
// Bytes per parameter (reads + writes, ignoring write-allocate): bf16 grads in and bf16 params
// out = 4*3 + 2 read, 4*3 + 2 written = 28; all fp32 = 32.
//
// Usage: adamw_bench [--quick] [--aligned] [--min_params=N] [--max_params=N] [--offsets=a,b,c,d,e]
//                    [--forms=all|only|none]   (default all: the fp32 rows, then the forms)
// Sizes 1e6, 1e7, 1e8, 2e8, 5e8, 1e9 within [min, max] (default max 2e8; 1e9 needs 20 GB);
// --quick: 1e6 and 4e6 only; --aligned: every array page-aligned, to show the 4K-aliasing
// penalty; --offsets: each array's start modulo 4 KiB (master, m, v, grad, param), for
// placement experiments (docs/offload.md).
#include <immintrin.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "benchmarks/bench_util.h"
#include "nlohmann/json.hpp"
#include "offload/compact_state.h"
#include "offload/cpu_adamw.h"
#include "offload/cpu_adamw_compact.h"
#include "offload/simd.h"
#include "offload/thread_pool.h"

namespace zerort {
namespace {

using offload::AdamWArrays;
using offload::CompactAdamWArrays;
using offload::MasterForm;
using offload::AdamWRange;
using offload::AdamWStepParams;

constexpr float kLr = 1e-3f, kBeta1 = 0.9f, kBeta2 = 0.95f, kEps = 1e-8f, kWd = 0.1f;

// Arrays start at different offsets modulo 4 KiB (slot * 1280 bytes, still 256-aligned):
// arrays that all start on a page boundary make the loads of one stream alias the stores of
// another in the CPU's 4K store-forwarding check, which stalls the long div/sqrt chains
// (--aligned shows the effect).
int g_stagger_bytes = 1280;
int g_offsets[5] = {-1, -1, -1, -1, -1};  // --offsets: bytes mod 4 KiB per slot (experiments)
std::vector<void*> g_allocations;

template <typename T>
T* AllocArray(size_t n, int slot) {
  const size_t bytes = (n * sizeof(T) + 2 * 4096 + 4095) / 4096 * 4096;
  void* p = std::aligned_alloc(4096, bytes);
  if (p == nullptr) {
    std::fprintf(stderr, "adamw_bench: out of memory for %zu elements\n", n);
    std::exit(1);
  }
  g_allocations.push_back(p);
  const int offset = g_offsets[slot] >= 0 ? g_offsets[slot] : (slot * g_stagger_bytes) % 4096;
  return reinterpret_cast<T*>(static_cast<char*>(p) + offset);
}

void FreeArrays() {
  for (void* p : g_allocations) std::free(p);
  g_allocations.clear();
}

// Same split as the kernels: contiguous ranges, 64-element boundaries.
void Parallel(size_t n, int threads, const std::function<void(size_t, size_t)>& fn) {
  const size_t chunk = ((n + threads - 1) / threads + 63) / 64 * 64;
  offload::DefaultThreadPool()->ParallelFor(threads, [&](int t) {
    const size_t b = static_cast<size_t>(t) * chunk;
    if (b < n) fn(b, std::min(n, b + chunk));
  });
}

// The floor: every AdamW array read once and written once, in AdamW's dtypes, one add each.
__attribute__((target("avx2"))) void FloorRange(const AdamWArrays& a, size_t begin,
                                                 size_t end) {
  size_t i = begin;
  const bool bf16_grad = a.grad_dtype == DType::kBF16;
  for (; i + 8 <= end; i += 8) {
    __m256 g;
    if (bf16_grad) {
      const __m128i h = _mm_loadu_si128(
          reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(a.grad) + i));
      g = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      g = _mm256_loadu_ps(static_cast<const float*>(a.grad) + i);
    }
    _mm256_storeu_ps(a.m + i, _mm256_add_ps(_mm256_loadu_ps(a.m + i), g));
    // |g| keeps v >= 0 for the AdamW runs interleaved with this one (sqrt of a negative = NaN).
    const __m256 abs_g = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), g);
    _mm256_storeu_ps(a.v + i, _mm256_add_ps(_mm256_loadu_ps(a.v + i), abs_g));
    const __m256 p = _mm256_add_ps(_mm256_loadu_ps(a.master + i), g);
    _mm256_storeu_ps(a.master + i, p);
    if (a.param_dtype == DType::kBF16) {
      const __m256i b = _mm256_srli_epi32(_mm256_castps_si256(p), 16);  // truncate: trivial
      const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(a.param_out) + i), h);
    } else {
      _mm256_storeu_ps(static_cast<float*>(a.param_out) + i, p);
    }
  }
  for (; i < end; ++i) {
    const float g = bf16_grad ? Bf16ToFloat(static_cast<const uint16_t*>(a.grad)[i])
                              : static_cast<const float*>(a.grad)[i];
    a.m[i] += g;
    a.v[i] += std::fabs(g);
    a.master[i] += g;
    if (a.param_dtype == DType::kBF16) {
      static_cast<uint16_t*>(a.param_out)[i] = static_cast<uint16_t>(FloatBits(a.master[i]) >> 16);
    } else {
      static_cast<float*>(a.param_out)[i] = a.master[i];
    }
  }
}

// What a trainer would write: one readable loop, bias corrections hoisted, no intrinsics.
void ScalarLoopRange(const AdamWArrays& a, int t, size_t begin, size_t end) {
  const float bc1 = 1.0f - std::pow(kBeta1, static_cast<float>(t));
  const float bc2 = 1.0f - std::pow(kBeta2, static_cast<float>(t));
  const bool bf16 = a.grad_dtype == DType::kBF16;
  for (size_t i = begin; i < end; ++i) {
    const float g = bf16 ? Bf16ToFloat(static_cast<const uint16_t*>(a.grad)[i])
                         : static_cast<const float*>(a.grad)[i];
    a.m[i] = kBeta1 * a.m[i] + (1 - kBeta1) * g;
    a.v[i] = kBeta2 * a.v[i] + (1 - kBeta2) * g * g;
    const float mhat = a.m[i] / bc1, vhat = a.v[i] / bc2;
    a.master[i] -= kLr * (mhat / (std::sqrt(vhat) + kEps) + kWd * a.master[i]);
    if (a.param_dtype == DType::kBF16) {
      static_cast<uint16_t*>(a.param_out)[i] = FloatToBf16(a.master[i]);
    } else {
      static_cast<float*>(a.param_out)[i] = a.master[i];
    }
  }
}

// ------------------------------------------------------------------ compact forms

// 8 bf16 values as fp32 (exact), and back by truncation (trivial arithmetic, as in the floor).
__attribute__((target("avx2"))) inline __m256 Load8Bf16(const void* p, size_t i) {
  const __m128i h = _mm_loadu_si128(
      reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
__attribute__((target("avx2"))) inline void Store8Bits16(void* p, size_t i, __m256i b) {
  const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p) + i), h);
}
__attribute__((target("avx2"))) inline void Store8Bf16(void* p, size_t i, __m256 x) {
  Store8Bits16(p, i, _mm256_srli_epi32(_mm256_castps_si256(x), 16));
}

template <DType M>
__attribute__((target("avx2"))) inline __m256 Load8(const void* p, size_t i) {
  if constexpr (M == DType::kF32) return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  return Load8Bf16(p, i);
}
template <DType M>
__attribute__((target("avx2"))) inline void Store8(void* p, size_t i, __m256 x) {
  if constexpr (M == DType::kF32) {
    _mm256_storeu_ps(static_cast<float*>(p) + i, x);
  } else {
    Store8Bf16(p, i, x);
  }
}

// The floor of one compact form: each of its arrays read once and written once in its dtype,
// one add each (bf16 grads; the master's arrays as the form keeps them). n % 8 == 0.
template <MasterForm F, DType M>
__attribute__((target("avx2"))) void CompactFloorRange(const CompactAdamWArrays& a, size_t begin,
                                                        size_t end) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (size_t i = begin; i < end; i += 8) {
    const __m256 g = Load8Bf16(a.grad, i);
    Store8<M>(a.m, i, _mm256_add_ps(Load8<M>(a.m, i), g));
    // |g| keeps v >= 0 for the AdamW runs interleaved with this one.
    Store8<M>(a.v, i, _mm256_add_ps(Load8<M>(a.v, i), _mm256_and_ps(g, abs_mask)));
    if constexpr (F == MasterForm::kF32) {
      const __m256 p = _mm256_add_ps(_mm256_loadu_ps(a.master + i), g);
      _mm256_storeu_ps(a.master + i, p);
      Store8Bf16(a.param, i, p);
    } else if constexpr (F == MasterForm::kBf16Remainder) {
      const __m128i r = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a.remainder + i));
      const __m256 joined = _mm256_or_ps(Load8Bf16(a.param, i),
                                         _mm256_castsi256_ps(_mm256_cvtepu16_epi32(r)));
      const __m256i u = _mm256_castps_si256(_mm256_add_ps(joined, g));
      Store8Bits16(a.param, i, _mm256_srli_epi32(u, 16));
      Store8Bits16(a.remainder, i, _mm256_and_si256(u, _mm256_set1_epi32(0xffff)));
    } else {
      Store8Bf16(a.param, i, _mm256_add_ps(Load8Bf16(a.param, i), g));
    }
  }
}

using FloorFn = void (*)(const CompactAdamWArrays&, size_t, size_t);

template <MasterForm F>
FloorFn CompactFloorFor(DType moments) {
  return moments == DType::kBF16 ? &CompactFloorRange<F, DType::kBF16>
                                 : &CompactFloorRange<F, DType::kF32>;
}

FloorFn CompactFloor(MasterForm form, DType moments) {
  switch (form) {
    case MasterForm::kF32:
      return CompactFloorFor<MasterForm::kF32>(moments);
    case MasterForm::kBf16Remainder:
      return CompactFloorFor<MasterForm::kBf16Remainder>(moments);
    case MasterForm::kBf16Stochastic:
      break;
  }
  return CompactFloorFor<MasterForm::kBf16Stochastic>(moments);
}

// Best wall times of the candidates, run interleaved (a, b, c, a, b, c, ...) `reps` times and at
// least 0.2 s in all: a slow spell of this shared machine then hits every candidate alike instead
// of whichever ran during it, which is what makes their ratios comparable.
std::vector<double> BestTimes(int reps, const std::vector<std::function<void()>>& fns) {
  std::vector<double> best(fns.size(), 1e30);
  double total = 0;
  for (int r = 0; r < reps || total < 0.2; ++r) {
    for (size_t k = 0; k < fns.size(); ++k) {
      const auto t0 = std::chrono::steady_clock::now();
      fns[k]();
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best[k] = std::min(best[k], s);
      total += s;
    }
    if (r > 1000) break;
  }
  return best;
}

// One compact form's arrays at n elements, placed like the fp32 rows' (slots: master or
// remainder, m, v, grad, param).
CompactAdamWArrays AllocForm(size_t n, MasterForm form, DType moments) {
  CompactAdamWArrays a;
  a.master_form = form;
  a.moment_dtype = moments;
  a.grad_dtype = DType::kBF16;
  a.param_dtype = DType::kBF16;
  a.n = n;
  a.rounding = {/*seed=*/1, /*step=*/1, /*first_index=*/0};
  if (form == MasterForm::kF32) a.master = AllocArray<float>(n, 0);
  if (form == MasterForm::kBf16Remainder) a.remainder = AllocArray<uint16_t>(n, 0);
  const bool bf16 = moments == DType::kBF16;
  a.m = bf16 ? static_cast<void*>(AllocArray<uint16_t>(n, 1)) : AllocArray<float>(n, 1);
  a.v = bf16 ? static_cast<void*>(AllocArray<uint16_t>(n, 2)) : AllocArray<float>(n, 2);
  a.grad = AllocArray<uint16_t>(n, 3);
  a.param = AllocArray<uint16_t>(n, 4);
  return a;
}

// The fp32 rows' values in the form's storage; moments zero. First touch from the threads.
void InitForm(const CompactAdamWArrays& a, int threads) {
  const size_t moment_bytes = DTypeSize(a.moment_dtype);
  uint16_t* param = static_cast<uint16_t*>(a.param);
  Parallel(a.n, threads, [&](size_t b, size_t e) {
    std::memset(static_cast<char*>(a.m) + b * moment_bytes, 0, (e - b) * moment_bytes);
    std::memset(static_cast<char*>(a.v) + b * moment_bytes, 0, (e - b) * moment_bytes);
    for (size_t i = b; i < e; ++i) {
      const float x = 0.01f * static_cast<float>(i % 1000);
      param[i] = FloatToBf16(x);
      if (a.master != nullptr) a.master[i] = x;
      if (a.remainder != nullptr) offload::SplitMaster(x, &param[i], &a.remainder[i]);
      const_cast<uint16_t*>(static_cast<const uint16_t*>(a.grad))[i] =
          FloatToBf16(1e-3f * static_cast<float>(i % 77) - 0.03f);
    }
  });
}

// Optimizer-state bytes a form keeps per parameter besides the bf16 parameter itself.
size_t StateBytes(const CompactAdamWArrays& a) {
  const size_t moments = 2 * DTypeSize(a.moment_dtype);
  if (a.master_form == MasterForm::kF32) return 4 + moments;
  return (a.master_form == MasterForm::kBf16Remainder ? 2 : 0) + moments;
}

// CpuAdamWCompact against its form's floor, timed interleaved.
nlohmann::json FormRow(const CompactAdamWArrays& a, int threads, int reps) {
  const AdamWStepParams step = *offload::MakeAdamWStepParams(kLr, kBeta1, kBeta2, kEps, kWd, 1);
  auto adamw = [&] {
    if (!offload::CpuAdamWCompact(a, step, 1.0f, threads).ok()) std::abort();
  };
  const FloorFn floor_fn = CompactFloor(a.master_form, a.moment_dtype);
  auto floor = [&] { Parallel(a.n, threads, [&](size_t b, size_t e) { floor_fn(a, b, e); }); };
  const std::vector<double> t = BestTimes(reps, {adamw, floor});
  const size_t bytes = offload::CompactAdamWBytesPerElement(a);
  const double n = static_cast<double>(a.n);
  nlohmann::json r;
  r["params"] = a.n;
  r["threads"] = threads;
  r["master_form"] = offload::MasterFormName(a.master_form);
  r["moment_dtype"] = std::string(DTypeName(a.moment_dtype));
  r["bytes_per_param"] = bytes;
  r["state_bytes_per_param"] = StateBytes(a);
  r["adamw_params_per_s"] = n / t[0];
  r["floor_params_per_s"] = n / t[1];
  r["adamw_over_floor"] = t[1] / t[0];
  r["adamw_gbps"] = bytes * n / t[0] / 1e9;
  r["floor_gbps"] = bytes * n / t[1] / 1e9;
  std::fprintf(stderr, "n=%zu form %s moments %s threads=%d adamw %.3g/s floor %.3g/s (%.2f)\n",
               a.n, offload::MasterFormName(a.master_form),
               std::string(DTypeName(a.moment_dtype)).c_str(), threads, n / t[0], n / t[1],
               t[1] / t[0]);
  return r;
}

// The form's arithmetic ceiling on one core: CpuAdamWCompact on 16384 elements (L2-resident,
// one task: it runs on this thread), timed in this thread's CPU time, so a busy machine's other
// processes do not count. Best of 5 batches of 400 steps.
double ComputeCeiling(MasterForm form, DType moments) {
  const size_t n = 16384;
  const CompactAdamWArrays a = AllocForm(n, form, moments);
  InitForm(a, 1);
  const AdamWStepParams step = *offload::MakeAdamWStepParams(kLr, kBeta1, kBeta2, kEps, kWd, 1);
  double best = 1e30;
  for (int batch = 0; batch < 5; ++batch) {
    const double t0 = bench::ThreadCpuMs();
    for (int k = 0; k < 400; ++k) {
      if (!offload::CpuAdamWCompact(a, step, 1.0f, 1).ok()) std::abort();
    }
    best = std::min(best, (bench::ThreadCpuMs() - t0) * 1e-3);
  }
  FreeArrays();
  return 400.0 * n / best;
}

nlohmann::json RunForms(const std::vector<size_t>& sizes, int reps) {
  const int all_threads = offload::DefaultThreadPool()->num_threads();
  std::vector<int> thread_counts = {1};
  if (all_threads > 1) thread_counts.push_back(all_threads);
  nlohmann::json rows = nlohmann::json::array();
  for (size_t n : sizes) {
    for (MasterForm form :
         {MasterForm::kF32, MasterForm::kBf16Remainder, MasterForm::kBf16Stochastic}) {
      for (DType moments : {DType::kF32, DType::kBF16}) {
        const CompactAdamWArrays a = AllocForm(n / 8 * 8, form, moments);
        InitForm(a, all_threads);
        for (int threads : thread_counts) {
          rows.push_back(FormRow(a, threads, reps));
          InitForm(a, all_threads);  // keep the state finite for the next runs
        }
        FreeArrays();
      }
    }
  }
  return rows;
}

int Main(int argc, char** argv) {
  bool quick = false;
  std::string forms = "all";
  double max_params = 2e8, min_params = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--quick") {
      quick = true;
    } else if (arg == "--aligned") {
      g_stagger_bytes = 0;
    } else if (arg.rfind("--offsets=", 0) == 0) {
      const int got = std::sscanf(arg.c_str() + 10, "%d,%d,%d,%d,%d", &g_offsets[0],
                                  &g_offsets[1], &g_offsets[2], &g_offsets[3], &g_offsets[4]);
      // AllocArray leaves a page of slack for the offset.
      const bool in_page =
          std::all_of(g_offsets, g_offsets + 5, [](int o) { return o >= 0 && o < 4096; });
      if (got != 5 || !in_page) {
        std::fprintf(stderr, "adamw_bench: %s: need 5 offsets in [0, 4096)\n", arg.c_str());
        return 2;
      }
    } else if (arg == "--forms=all" || arg == "--forms=only" || arg == "--forms=none") {
      forms = arg.substr(8);
    } else if (arg.rfind("--min_params=", 0) == 0) {
      min_params = std::atof(arg.c_str() + 13);
    } else if (arg.rfind("--max_params=", 0) == 0) {
      max_params = std::atof(arg.c_str() + 13);
    } else {
      std::fprintf(stderr,
                   "usage: adamw_bench [--quick] [--aligned] [--min_params=N] [--max_params=N] "
                   "[--offsets=a,b,c,d,e] [--forms=all|only|none]\n");
      return 2;
    }
  }
  std::vector<size_t> sizes;
  if (quick) {
    sizes = {1000000, 4000000};
  } else {
    for (double s : {1e6, 1e7, 1e8, 2e8, 5e8, 1e9}) {
      if (s >= min_params && s <= max_params) sizes.push_back(static_cast<size_t>(s));
    }
  }
  const int all_threads = offload::DefaultThreadPool()->num_threads();
  const long llc = sysconf(_SC_LEVEL3_CACHE_SIZE) > 0 ? sysconf(_SC_LEVEL3_CACHE_SIZE)
                                                      : sysconf(_SC_LEVEL2_CACHE_SIZE);
  const int reps = quick ? 2 : 5;

  nlohmann::json out;
  out["benchmark"] = "adamw_bench";
  out["simd"] = std::string(offload::SimdLevelName(offload::ActiveSimd()));
  out["threads_all"] = all_threads;
  out["llc_bytes"] = llc;
  out["array_stagger_bytes"] = g_stagger_bytes;
  out["limit"] = "floor: same arrays, same dtypes, trivial arithmetic (memory floor)";
  out["bytes_per_param"] = {{"bf16", 28}, {"fp32", 32}};
  nlohmann::json results = nlohmann::json::array();

  for (size_t n : forms == "only" ? std::vector<size_t>{} : sizes) {
    for (DType d : {DType::kBF16, DType::kF32}) {
      const size_t bytes_per_param = d == DType::kBF16 ? 28 : 32;
      float* master = AllocArray<float>(n, 0);
      float* m = AllocArray<float>(n, 1);
      float* v = AllocArray<float>(n, 2);
      void* grad = d == DType::kBF16 ? static_cast<void*>(AllocArray<uint16_t>(n, 3))
                                     : static_cast<void*>(AllocArray<float>(n, 3));
      void* param = d == DType::kBF16 ? static_cast<void*>(AllocArray<uint16_t>(n, 4))
                                      : static_cast<void*>(AllocArray<float>(n, 4));
      AdamWArrays a{master, m, v, grad, d, param, d, n};
      // First touch from the threads that will use the pages (matters on multi-socket hosts).
      Parallel(n, all_threads, [&](size_t b, size_t e) {
        for (size_t i = b; i < e; ++i) {
          master[i] = 0.01f * static_cast<float>(i % 1000);
          m[i] = 0;
          v[i] = 0;
          const float g = 1e-3f * static_cast<float>(i % 77) - 0.03f;
          if (d == DType::kBF16) {
            static_cast<uint16_t*>(grad)[i] = FloatToBf16(g);
            static_cast<uint16_t*>(param)[i] = 0;
          } else {
            static_cast<float*>(grad)[i] = g;
            static_cast<float*>(param)[i] = 0;
          }
        }
      });
      const AdamWStepParams step = *offload::MakeAdamWStepParams(kLr, kBeta1, kBeta2, kEps, kWd, 1);
      const AdamWStepParams no_decay =
          *offload::MakeAdamWStepParams(kLr, kBeta1, kBeta2, kEps, 0.0, 1);
      std::vector<AdamWRange> groups;
      for (size_t b = 0; b < n;) {
        const bool matrix = groups.size() % 2 == 0;
        const size_t e = std::min(n, b + (matrix ? 65536 : 768));
        groups.push_back({b, e, matrix ? step : no_decay});
        b = e;
      }
      std::vector<int> thread_counts = {1};
      if (all_threads > 1) thread_counts.push_back(all_threads);
      for (int threads : thread_counts) {
        auto adamw = [&] {
          if (!offload::CpuAdamW(a, step, 1.0f, threads).ok()) std::abort();
        };
        auto adamw_groups = [&] {
          if (!offload::CpuAdamW(a, groups, 1.0f, threads).ok()) std::abort();
        };
        auto floor = [&] {
          Parallel(n, threads, [&](size_t b, size_t e) { FloorRange(a, b, e); });
        };
        auto scalar = [&] {
          Parallel(n, threads, [&](size_t b, size_t e) { ScalarLoopRange(a, 1, b, e); });
        };
        // Triad over three fp32 arrays of the same n (master = m + s * v).
        auto triad = [&] {
          Parallel(n, threads, [&](size_t b, size_t e) {
            for (size_t i = b; i < e; ++i) master[i] = m[i] + 0.5f * v[i];
          });
        };
        // The scalar loop is an order of magnitude slower: timed on its own, fewer times.
        const std::vector<double> t = BestTimes(reps, {adamw, adamw_groups, floor, triad});
        const double t_adamw = t[0], t_groups = t[1], t_floor = t[2], t_triad = t[3];
        const double t_scalar = BestTimes(quick ? 1 : 2, {scalar})[0];
        // Keep the state finite for the next AdamW runs.
        Parallel(n, threads, [&](size_t b, size_t e) {
          std::fill(m + b, m + e, 0.0f);
          std::fill(v + b, v + e, 0.0f);
        });
        const double triad_gbps = 12.0 * n / t_triad / 1e9;
        nlohmann::json r;
        r["params"] = n;
        r["dtype"] = std::string(DTypeName(d));
        r["threads"] = threads;
        r["above_llc"] = n * bytes_per_param > static_cast<size_t>(llc);
        r["adamw_params_per_s"] = n / t_adamw;
        r["floor_params_per_s"] = n / t_floor;
        r["adamw_over_floor"] = t_floor / t_adamw;
        r["adamw_groups_params_per_s"] = n / t_groups;
        r["groups_ranges"] = groups.size();
        r["groups_over_one"] = t_adamw / t_groups;
        r["adamw_gbps"] = bytes_per_param * n / t_adamw / 1e9;
        r["scalar_loop_params_per_s"] = n / t_scalar;
        r["triad_gbps"] = triad_gbps;
        r["triad_equiv_params_per_s"] = triad_gbps * 1e9 / bytes_per_param;
        results.push_back(r);
        std::fprintf(stderr,
                     "n=%zu %s threads=%d adamw %.3g/s groups %.3g/s (%.2f) floor %.3g/s (%.2f) "
                     "scalar %.3g/s triad %.1f GB/s\n",
                     n, std::string(DTypeName(d)).c_str(), threads, n / t_adamw, n / t_groups,
                     t_adamw / t_groups, n / t_floor, t_floor / t_adamw, n / t_scalar,
                     triad_gbps);
      }
      FreeArrays();
    }
  }
  out["results"] = results;
  out["forms_limit"] = "compact_floor: the form's own arrays and dtypes, trivial arithmetic";
  if (forms != "none") {
    out["forms"] = RunForms(sizes, reps);
    nlohmann::json ceilings = nlohmann::json::array();
    for (MasterForm form :
         {MasterForm::kF32, MasterForm::kBf16Remainder, MasterForm::kBf16Stochastic}) {
      for (DType moments : {DType::kF32, DType::kBF16}) {
        const double per_s = ComputeCeiling(form, moments);
        ceilings.push_back({{"master_form", offload::MasterFormName(form)},
                            {"moment_dtype", std::string(DTypeName(moments))},
                            {"compute_params_per_s_one_core", per_s}});
        std::fprintf(stderr, "ceiling form %s moments %s: %.3g/s per core (L2, CPU time)\n",
                     offload::MasterFormName(form), std::string(DTypeName(moments)).c_str(),
                     per_s);
      }
    }
    out["forms_compute_ceiling"] = ceilings;
  }
  std::printf("%s\n", out.dump(2).c_str());
  return 0;
}

}  // namespace
}  // namespace zerort

int main(int argc, char** argv) { return zerort::Main(argc, argv); }
