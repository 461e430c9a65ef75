// The CUDA device against the host reference, bit for bit.
//
// Two halves. "CudaMath" and "CudaElementwise" cases run everywhere: they compile the kernels'
// per-element arithmetic (device/internal/cuda_math.h) and per-thread work
// (device/internal/cuda_elementwise.h) for the host and compare them with base/dtype.h,
// offload::CpuAdamW, offload::SquaredNormF32 and the CPU device, replaying every thread of a
// simulated grid at every misalignment. "CudaDevice" cases need a GPU: each kernel on random
// inputs of awkward sizes and element offsets against the CPU device. Without a GPU they print
// "SKIPPED: no CUDA device: <reason>" and pass.
#include "device/cuda_device.h"
#include "device/testing/gpu_or_skip.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/dtype.h"
#include "catch2/catch.hpp"
#include "comm/inprocess.h"
#include "memory/arena.h"
#include "offload/compact_state.h"
#include "offload/cpu_adamw.h"
#include "offload/cpu_adamw_compact.h"
#include "offload/cpu_kernels.h"
#include "device/testing/one_thread.h"
#include "device/internal/cuda_compact_plan.h"
#include "device/internal/cuda_elementwise.h"
#include "device/internal/cuda_kernels.h"
#include "device/internal/cuda_math.h"
#include "device/internal/cuda_norm_batch.h"

namespace zerort {
namespace {

using cuda_internal::AdamWConstants;

constexpr DType kDTypes[] = {DType::kF32, DType::kBF16, DType::kF16};
// Around every boundary the kernels have: warps, 256-thread blocks, 1024-element norm blocks,
// the 1024-value chunks of the norm's tree (2^20 + 3 elements = 1025 partials: two levels).
constexpr size_t kSizes[] = {1, 7, 31, 255, 1023, 1024, 1025, 8 * 1024 + 9, 100003,
                             (size_t{1} << 20) + 3};

// ------------------------------------------------------------------ host-side helpers

// Random values of every magnitude a gradient or weight may take, as fp32, then stored in
// `dtype` (so that the values are exactly representable there).
std::vector<char> RandomValues(DType dtype, size_t n, uint32_t seed, float lo_exp = -20,
                               float hi_exp = 4) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f), ex(lo_exp, hi_exp);
  std::vector<char> out(n * DTypeSize(dtype));
  for (size_t i = 0; i < n; ++i) {
    float x = mant(rng) * std::exp2(std::floor(ex(rng)));
    if (rng() & 1) x = -x;
    if (rng() % 97 == 0) x = 0.0f;
    switch (dtype) {
      case DType::kF32:
        std::memcpy(out.data() + 4 * i, &x, 4);
        break;
      case DType::kBF16: {
        const uint16_t h = FloatToBf16(x);
        std::memcpy(out.data() + 2 * i, &h, 2);
        break;
      }
      case DType::kF16: {
        const uint16_t h = FloatToHalf(x);
        std::memcpy(out.data() + 2 * i, &h, 2);
        break;
      }
    }
  }
  return out;
}

// Arbitrary bit patterns: NaNs with payloads, infinities, subnormals, everything.
std::vector<char> RandomBits(size_t bytes, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<char> out(bytes);
  for (char& c : out) c = static_cast<char>(rng());
  return out;
}

uint32_t Bits(float f) { return FloatBits(f); }

AdamWConstants ConstantsOf(const offload::AdamWStepParams& p, float grad_scale) {
  return {p.beta1,        p.beta2, p.one_minus_beta1, p.one_minus_beta2, p.eps, -p.step_size,
          p.inv_sqrt_bias2, p.decay, grad_scale};
}

// ------------------------------------------------------------------ CudaMath (no GPU needed)

// One element through the kernels' LoadAs / StoreAs (what cuda_kernels.cu runs), host-compiled.
template <DType D>
float KernelLoad(uint16_t bits) {
  return LoadAs<D>(&bits, 0);
}
template <DType D>
uint16_t KernelStore(float f) {
  uint16_t bits = 0;
  StoreAs<D>(&bits, 0, f);
  return bits;
}

TEST_CASE("CudaMath: widening conversions equal base/dtype.h on all 65536 patterns", "[zero]") {
  for (uint32_t h = 0; h < 65536; ++h) {
    const auto b = static_cast<uint16_t>(h);
    REQUIRE(Bits(KernelLoad<DType::kBF16>(b)) == Bits(Bf16ToFloat(b)));
    REQUIRE(Bits(KernelLoad<DType::kF16>(b)) == Bits(HalfToFloat(b)));
  }
}

TEST_CASE("CudaMath: narrowing conversions equal base/dtype.h at every rounding boundary",
          "[zero]") {
  // For every half / bf16 pattern: the value itself, the exact midpoint to the next pattern
  // (a tie), and one fp32 ulp either side of that midpoint. Plus random fp32 bit patterns.
  std::vector<uint32_t> inputs;
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint32_t bf = h << 16;
    for (uint32_t low : {0u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) inputs.push_back(bf | low);
    const float x = HalfToFloat(static_cast<uint16_t>(h));
    const float next = HalfToFloat(static_cast<uint16_t>(h + 1));
    if (std::isfinite(x) && std::isfinite(next) && (h & 0x7fff) != 0x7bff) {
      const uint32_t mid = Bits((x + next) / 2);  // exact: halves have 11-bit significands
      for (uint32_t d : {mid - 1, mid, mid + 1}) inputs.push_back(d);
    }
    inputs.push_back(Bits(x));
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 1000000; ++i) inputs.push_back(static_cast<uint32_t>(rng()));
  for (uint32_t u : inputs) {
    const float f = BitsToFloat(u);
    // Checked by hand first: a Catch2 message per input would dominate the run time.
    if (KernelStore<DType::kBF16>(f) == FloatToBf16(f) &&
        KernelStore<DType::kF16>(f) == FloatToHalf(f)) {
      continue;
    }
    INFO("fp32 bits 0x" << std::hex << u);
    REQUIRE(KernelStore<DType::kBF16>(f) == FloatToBf16(f));
    REQUIRE(KernelStore<DType::kF16>(f) == FloatToHalf(f));
  }
}

template <DType G, DType P, bool kOut>
void CheckAdamWElements(DType g, DType p, bool out) {
  if (g != G || p != P || out != kOut) return;
  const size_t n = 1037;
  const std::vector<char> grad = RandomValues(G, n, 11, -40, 6);
  std::vector<float> master(n), m(n), v(n);
  const std::vector<char> mv = RandomValues(DType::kF32, 3 * n, 12, -30, 2);
  std::memcpy(master.data(), mv.data(), 4 * n);
  std::memcpy(m.data(), mv.data() + 4 * n, 4 * n);
  std::memcpy(v.data(), mv.data() + 8 * n, 4 * n);
  for (float& x : v) x = std::fabs(x);  // a second moment is never negative
  std::vector<float> master2 = master, m2 = m, v2 = v;
  std::vector<char> out_ref(n * DTypeSize(P)), out_hd(n * DTypeSize(P));

  auto params = offload::MakeAdamWStepParams(3e-4, 0.9, 0.95, 1e-8, 0.1, 7);
  REQUIRE(params.ok());
  const float grad_scale = 1.0f / 1024;
  REQUIRE(offload::CpuAdamW({master.data(), m.data(), v.data(), grad.data(), G,
                             kOut ? out_ref.data() : nullptr, P, n},
                            *params, grad_scale, 1)
              .ok());
  const AdamWConstants c = ConstantsOf(*params, grad_scale);
  for (size_t i = 0; i < n; ++i) {
    cuda_internal::AdamWElement<G, P, kOut>(c, master2.data(), m2.data(), v2.data(), grad.data(),
                                            out_hd.data(), i);
  }
  for (size_t i = 0; i < n; ++i) {
    INFO("element " << i);
    REQUIRE(Bits(master2[i]) == Bits(master[i]));
    REQUIRE(Bits(m2[i]) == Bits(m[i]));
    REQUIRE(Bits(v2[i]) == Bits(v[i]));
  }
  if (kOut) REQUIRE(out_hd == out_ref);
}

template <DType G>
void CheckAdamWForGrad(DType g, DType p, bool out) {
  CheckAdamWElements<G, DType::kF32, false>(g, p, out);
  CheckAdamWElements<G, DType::kF32, true>(g, p, out);
  CheckAdamWElements<G, DType::kBF16, true>(g, p, out);
  CheckAdamWElements<G, DType::kF16, true>(g, p, out);
}

TEST_CASE("CudaMath: the AdamW element equals offload::CpuAdamW bitwise", "[zero]") {
  for (DType g : kDTypes) {
    for (DType p : kDTypes) {
      for (bool out : {false, true}) {
        if (!out && p != DType::kF32) continue;
        DYNAMIC_SECTION("grad " << DTypeName(g) << " param " << DTypeName(p) << " out " << out) {
          CheckAdamWForGrad<DType::kF32>(g, p, out);
          CheckAdamWForGrad<DType::kBF16>(g, p, out);
          CheckAdamWForGrad<DType::kF16>(g, p, out);
        }
      }
    }
  }
}

// One block of NormTreeLevelKernel, replayed on the host: 512 threads each add in[t] and
// in[t + 512] (+0 past count), halve through shared memory down to 64 slots, then warp 0 adds
// slot[l] + slot[l + 32] and shuffles down by 16, 8, 4, 2, 1 (__shfl_down_sync hands lane l
// the value of lane l + k, or its own where l + k >= 32). Returns lane 0's value.
float ReplayTreeBlock(const float* in, size_t count, size_t block) {
  constexpr size_t kThreads = 512;
  float slot[kThreads];
  for (size_t t = 0; t < kThreads; ++t) {
    const size_t i = block * 2 * kThreads + t;
    const float lo = i < count ? in[i] : 0.0f;
    const float hi = i + kThreads < count ? in[i + kThreads] : 0.0f;
    slot[t] = cuda_internal::Add(lo, hi);
  }
  for (size_t stride = kThreads / 2; stride > 32; stride /= 2) {
    for (size_t t = 0; t < stride; ++t) slot[t] = cuda_internal::Add(slot[t], slot[t + stride]);
  }
  float lane[32];
  for (int l = 0; l < 32; ++l) lane[l] = cuda_internal::Add(slot[l], slot[l + 32]);
  for (int k : {16, 8, 4, 2, 1}) {
    float next[32];
    for (int l = 0; l < 32; ++l) {
      next[l] = cuda_internal::Add(lane[l], lane[l + k < 32 ? l + k : l]);
    }
    std::copy(next, next + 32, lane);
  }
  return lane[0];
}

// LaunchNormTreeSum replayed: one launch of ReplayTreeBlock's blocks per level, 1024 values
// per block, until one value is left.
float ReplayTreeLevels(std::vector<float> level) {
  while (level.size() > 1) {
    std::vector<float> next((level.size() + 1023) / 1024);
    for (size_t c = 0; c < next.size(); ++c) {
      next[c] = ReplayTreeBlock(level.data(), level.size(), c);
    }
    level = std::move(next);
  }
  return level[0];
}

// The kernels' norm, replayed on the host: 8 lanes per block, the warp's xor-shuffle tree
// (each lane adds its partner's value: lane l sees acc[l] + acc[l ^ k]), then the tree levels
// (ReplayTreeLevels).
template <DType D>
float ReplayKernelNorm(const void* x, size_t n) {
  std::vector<float> level;
  for (size_t b = 0; b * offload::kNormBlock < n; ++b) {
    const size_t begin = b * offload::kNormBlock;
    const size_t end = std::min(n, begin + offload::kNormBlock);
    float acc[8];
    for (int l = 0; l < 8; ++l) acc[l] = cuda_internal::NormLane<D>(x, begin, end, l);
    for (int k : {1, 2, 4}) {
      float next[8];
      for (int l = 0; l < 8; ++l) next[l] = cuda_internal::Add(acc[l], acc[l ^ k]);
      std::copy(next, next + 8, acc);
    }
    level.push_back(acc[0]);
  }
  return ReplayTreeLevels(std::move(level));
}

// Tree values as the norm's partials are: >= +0, of many magnitudes.
std::vector<float> RandomPartials(size_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f), ex(-30, 30);
  std::vector<float> out(count);
  for (float& v : out) v = rng() % 97 == 0 ? 0.0f : mant(rng) * std::exp2(std::floor(ex(rng)));
  return out;
}

// Value counts of the tree: one chunk, a padded one, one full level, several levels (2^20 + 7:
// 1025 chunks, then 2, then 1), beyond what a test-sized norm reaches.
constexpr size_t kTreeCounts[] = {1, 2, 33, 511, 512, 513, 1023, 1024, 1025, 70001,
                                  (size_t{1} << 20) + 7};

TEST_CASE("CudaMath: the kernel's tree levels equal NormTreeSum bitwise", "[zero]") {
  for (size_t count : kTreeCounts) {
    std::vector<float> values = RandomPartials(count, static_cast<uint32_t>(count));
    const float replay = ReplayTreeLevels(values);
    INFO("count=" << count);
    REQUIRE(Bits(replay) == Bits(offload::NormTreeSum(values.data(), count)));
  }
}

TEST_CASE("CudaMath: the kernel's norm order equals SquaredNormF32 bitwise", "[zero]") {
  std::vector<size_t> sizes(std::begin(kSizes), std::end(kSizes));
  sizes.push_back(2 * 1024 * 1024 + 5);  // 2049 partials: three chunks, then one
  for (DType d : kDTypes) {
    for (size_t n : sizes) {
      const std::vector<char> x = RandomValues(d, n, static_cast<uint32_t>(n), -12, 3);
      float replay = 0;
      switch (d) {
        case DType::kF32:
          replay = ReplayKernelNorm<DType::kF32>(x.data(), n);
          break;
        case DType::kBF16:
          replay = ReplayKernelNorm<DType::kBF16>(x.data(), n);
          break;
        case DType::kF16:
          replay = ReplayKernelNorm<DType::kF16>(x.data(), n);
          break;
      }
      INFO(DTypeName(d) << " n=" << n);
      REQUIRE(Bits(replay) == Bits(offload::SquaredNormF32(x.data(), d, n, 1)));
    }
  }
}

// ------------------------------------------------------------------ CudaElementwise (no GPU)

using cuda_internal::AlignedChunk;
using cuda_internal::ElementSplit;
using cuda_internal::kChunk;
using cuda_internal::StridedChunk;
using cuda_internal::VectorOperand;

// Grid widths (gridDim.x * blockDim.x) the schedule is replayed with: one thread, fewer threads
// than chunks, about as many, and more than there is work.
constexpr size_t kThreadCounts[] = {1, 3, 13, 64, 1000};

// Checks SplitForVectors and ForEachChunk for one set of operands over n elements: the chunks of
// all threads cover [0, n) exactly once, every AlignedChunk is 16-byte aligned in every operand,
// and the split is vectorized exactly when some index below kChunk aligns every operand.
void CheckSchedule(const std::vector<VectorOperand>& ops, size_t n) {
  const ElementSplit s =
      cuda_internal::SplitForVectors(ops.data(), static_cast<int>(ops.size()), n);
  bool alignable = false;
  for (size_t h = 0; h < kChunk && !alignable; ++h) {
    bool all = true;
    for (const VectorOperand& o : ops) {
      all = all && o.address % o.elem_size == 0 && (o.address + h * o.elem_size) % 16 == 0;
    }
    alignable = all;
  }
  REQUIRE(s.aligned == alignable);
  if (s.aligned) {
    REQUIRE(s.head <= n);
    REQUIRE(s.head < static_cast<size_t>(kChunk));
    REQUIRE(s.body % kChunk == 0);
    REQUIRE(s.head + s.body <= n);
    REQUIRE(n - s.head - s.body < static_cast<size_t>(kChunk));
    if (s.head < n) {  // the head is the first aligned index, not just some aligned index
      for (const VectorOperand& o : ops) REQUIRE((o.address + s.head * o.elem_size) % 16 == 0);
    }
  } else {
    REQUIRE(s.head == 0);
    REQUIRE(s.body == 0);
  }
  for (size_t threads : kThreadCounts) {
    std::vector<int> seen(n, 0);
    bool ok = true;  // checked by hand: a Catch2 assertion per element would dominate
    for (size_t t = 0; t < threads; ++t) {
      cuda_internal::ForEachChunk(s, n, t, threads, [&](const auto& c) {
        using C = std::decay_t<decltype(c)>;
        if constexpr (std::is_same_v<C, AlignedChunk>) {
          for (const VectorOperand& o : ops) ok = ok && (o.address + c.i * o.elem_size) % 16 == 0;
          ok = ok && s.aligned;
        } else {
          ok = ok && c.count >= 1 && c.count <= kChunk;
        }
        for (int j = 0; j < kChunk; ++j) {
          if (!c.Has(j)) continue;
          const size_t i = c.At(j);
          ok = ok && i < n;
          if (i < n) ++seen[i];
        }
      });
    }
    INFO("threads " << threads << " n " << n << " aligned " << s.aligned << " head " << s.head
                    << " body " << s.body);
    REQUIRE(ok);
    REQUIRE(std::all_of(seen.begin(), seen.end(), [](int k) { return k == 1; }));
    // Enough threads: no chunk beyond what ChunkThreads asks for.
    REQUIRE(cuda_internal::ChunkThreads(s, n) >= 1);
  }
}

// ------------------------------------------------------------------ batched norms (no GPU)

// Runs every launch of `plan` as the kernels would, thread by thread: the block pass's lanes
// (NormLaneFinite, combined by the lane tree the shuffles pair), then each tree level's chunks
// (NormTreeSum over a chunk is the 512-thread block's sum: "the kernel's tree levels" above).
void ReplayNormBatches(const cuda_internal::NormBatchPlan& plan) {
  using cuda_internal::kNormLanes;
  for (const cuda_internal::BlockBatch& b : plan.blocks) {
    REQUIRE(b.count >= 1);
    REQUIRE(b.count <= cuda_internal::kNormBatch);
    for (size_t blk = 0; blk < b.blocks; ++blk) {
      const int j = cuda_internal::BlockEntryOf(b, blk);
      const cuda_internal::BlockEntry& e = b.e[j];
      REQUIRE(blk >= e.first_block);
      const size_t local = blk - e.first_block;
      REQUIRE(local < cuda_internal::BatchBlocks(e.n));
      const size_t begin = local * 1024, end = std::min(begin + 1024, e.n);
      float lane[kNormLanes];
      bool any = false;
      for (int l = 0; l < kNormLanes; ++l) {
        bool bad = false;
        cuda_internal::WithDType(b.dtype, [&](auto d) {
          lane[l] = cuda_internal::NormLaneFinite<decltype(d)::value>(e.x, begin, end, l, &bad);
        });
        any = any || bad;
      }
      using cuda_internal::Add;
      e.partials[local] = Add(Add(Add(lane[0], lane[1]), Add(lane[2], lane[3])),
                              Add(Add(lane[4], lane[5]), Add(lane[6], lane[7])));
      if (any) *e.finite = 0;
    }
  }
  for (const cuda_internal::TreeBatch& t : plan.levels) {
    for (size_t c = 0; c < t.chunks; ++c) {
      const cuda_internal::TreeEntry& e = t.e[cuda_internal::ChunkEntryOf(t, c)];
      const size_t local = c - e.first_chunk;
      REQUIRE(local < cuda_internal::BatchChunks(e.count));
      std::vector<float> chunk(e.in + local * 1024, e.in + std::min(e.count, (local + 1) * 1024));
      e.out[local] = offload::NormTreeSum(chunk.data(), chunk.size());
    }
  }
}

struct NormCase {
  DType dtype;
  size_t n;
  size_t offset;  // elements into the range's buffer: arbitrary alignment
  int poison;     // 0: finite, 1: one Inf, 2: one NaN
};

// Each case's buffer, its range, and the references.
struct NormCases {
  std::vector<std::vector<char>> buffers;
  std::vector<Device::NormRange> ranges;
  std::vector<float> want;
  std::vector<bool> want_finite;
};

NormCases MakeNormCases(const std::vector<NormCase>& cases, uint32_t seed) {
  NormCases out;
  std::mt19937 rng(seed);
  for (const NormCase& k : cases) {
    std::vector<char> buf = RandomValues(k.dtype, k.n + k.offset, seed + rng() % 1000, -12, 3);
    const size_t size = DTypeSize(k.dtype);
    if (k.poison != 0 && k.n > 0) {
      const size_t at = k.offset + rng() % k.n;
      const float bad = k.poison == 1 ? std::numeric_limits<float>::infinity()
                                      : std::numeric_limits<float>::quiet_NaN();
      if (k.dtype == DType::kF32) {
        std::memcpy(buf.data() + 4 * at, &bad, 4);
      } else {
        const uint16_t h = k.dtype == DType::kBF16 ? FloatToBf16(bad) : FloatToHalf(bad);
        std::memcpy(buf.data() + 2 * at, &h, 2);
      }
    }
    out.buffers.push_back(std::move(buf));
    const char* x = out.buffers.back().data() + k.offset * size;
    out.ranges.push_back({x, k.dtype, k.n});
    out.want.push_back(offload::SquaredNormF32(x, k.dtype, k.n, 1));
    out.want_finite.push_back(k.poison == 0 || k.n == 0);
  }
  return out;
}

// Mixed dtypes in runs (a batch holds one dtype), empty and one-block ranges, more ranges than
// one batch holds, ranges of two tree levels, poisoned ones.
std::vector<NormCase> BatchNormCases() {
  std::vector<NormCase> cases;
  std::mt19937 rng(7);
  const size_t sizes[] = {0, 1, 7, 1023, 1024, 1025, 8 * 1024 + 9, 100003};
  for (int i = 0; i < 150; ++i) {
    const DType d = kDTypes[(i / 40) % 3];
    const size_t n = sizes[rng() % 8], offset = rng() % 8;
    const int poison = rng() % 5 == 0 ? 1 + static_cast<int>(rng() % 2) : 0;
    cases.push_back({d, n, offset, poison});
  }
  cases.push_back({DType::kBF16, 1025 * 1024 + 5, 3, 0});  // 1026 partials: two levels
  cases.push_back({DType::kF32, 1025 * 1024, 0, 2});
  cases.push_back({DType::kF16, 3000 * 1024 + 17, 1, 0});
  return cases;
}

TEST_CASE("CudaNormBatch: every launch replayed gives SquaredNormF32 and the finite verdict of "
          "each range bitwise", "[zero]") {
  const NormCases c = MakeNormCases(BatchNormCases(), 11);
  const int count = static_cast<int>(c.ranges.size());
  std::vector<cuda_internal::NormRangeSpec> specs;
  for (const Device::NormRange& r : c.ranges) specs.push_back({r.x, r.dtype, r.n});
  std::vector<float> scratch(cuda_internal::NormBatchScratch(specs.data(), count));
  std::vector<float> results(count, 0.0f);
  std::vector<unsigned char> finite(count, 1);
  const cuda_internal::NormBatchPlan plan = cuda_internal::PlanNormBatches(
      specs.data(), count, scratch.data(), results.data(), finite.data());
  CHECK(plan.scratch_floats == scratch.size());
  CHECK(plan.blocks.size() >= 4);  // 150 ranges in runs of one dtype: several batches
  ReplayNormBatches(plan);
  for (int i = 0; i < count; ++i) {
    INFO("range " << i << " " << DTypeName(c.ranges[i].dtype) << " n=" << c.ranges[i].n);
    CHECK(Bits(results[i]) == Bits(c.want[i]));
    CHECK((finite[i] != 0) == c.want_finite[i]);
  }
  // The default Device::SquaredNormsAndFinite (the CPU device's) agrees.
  auto cpu = testing::OneThreadCpuDevice();
  std::vector<float> sumsq(count, -1.0f);
  std::unique_ptr<bool[]> ok(new bool[count]);
  REQUIRE(cpu->SquaredNormsAndFinite(c.ranges, sumsq.data(), ok.get(), nullptr).ok());
  for (int i = 0; i < count; ++i) {
    CHECK(Bits(sumsq[i]) == Bits(c.want[i]));
    CHECK(ok[i] == c.want_finite[i]);
  }
}

TEST_CASE("CudaNormBatch: three tree levels and many ranges of one level", "[zero]") {
  // Partials only (the block pass is not replayed: x is never read): counts past 2^20 need three
  // levels. Each range's partials are filled where the plan put them, the levels replayed.
  const size_t counts[] = {2, 1024, 1025, (size_t{1} << 20) + 7, 70001, 3};
  std::vector<cuda_internal::NormRangeSpec> specs;
  for (size_t k : counts) specs.push_back({nullptr, DType::kF32, k * 1024});
  for (size_t k = 0; k < 70; ++k) specs.push_back({nullptr, DType::kF32, 2048 + 1024 * k});
  const int count = static_cast<int>(specs.size());
  std::vector<float> scratch(cuda_internal::NormBatchScratch(specs.data(), count));
  std::vector<float> results(count, 0.0f);
  std::vector<unsigned char> finite(count, 1);
  cuda_internal::NormBatchPlan plan = cuda_internal::PlanNormBatches(
      specs.data(), count, scratch.data(), results.data(), finite.data());
  std::vector<std::vector<float>> partials;
  int i = 0;
  for (const cuda_internal::BlockBatch& b : plan.blocks) {
    for (int j = 0; j < b.count; ++j, ++i) {
      const size_t blocks = cuda_internal::BatchBlocks(specs[i].n);
      partials.push_back(RandomPartials(blocks, 900 + static_cast<uint32_t>(i)));
      std::copy(partials.back().begin(), partials.back().end(), b.e[j].partials);
    }
  }
  REQUIRE(i == count);
  plan.blocks.clear();
  CHECK(plan.levels.size() >= 4);  // three levels, the first two batches wide
  ReplayNormBatches(plan);
  for (i = 0; i < count; ++i) {
    INFO("range " << i << " partials " << partials[i].size());
    CHECK(Bits(results[i]) == Bits(offload::NormTreeSum(partials[i].data(), partials[i].size())));
  }
}

TEST_CASE("CudaElementwise: the split covers every element exactly once at every misalignment",
          "[zero]") {
  constexpr uintptr_t kBase = 1 << 20;  // 16-byte aligned; only the low bits matter
  for (size_t n = 0; n <= 100; ++n) {
    INFO("n " << n);
    // One operand of each element size, at every byte misalignment (0..15, element-aligned or
    // not: a misaligned element goes the unaligned way).
    for (size_t size : {size_t{2}, size_t{4}}) {
      for (uintptr_t mis = 0; mis < 16; ++mis) CheckSchedule({{kBase + mis, size}}, n);
    }
    // Two operands of every pair of sizes at every pair of misalignments: the cast's and
    // accumulate's cases, matching and mismatched.
    for (size_t a : {size_t{2}, size_t{4}}) {
      for (size_t b : {size_t{2}, size_t{4}}) {
        for (uintptr_t ma = 0; ma < 16; ma += a) {
          for (uintptr_t mb = 0; mb < 16; mb += b) {
            CheckSchedule({{kBase + ma, a}, {kBase + 4096 + mb, b}}, n);
          }
        }
      }
    }
    // AdamW's five arrays at one element offset into aligned arenas (always vectorizable), and
    // at random independent offsets.
    for (size_t off = 0; off < 16; ++off) {
      for (size_t g : {size_t{2}, size_t{4}}) {
        std::vector<VectorOperand> ops = {{kBase + 4 * off, 4},
                                          {2 * kBase + 4 * off, 4},
                                          {3 * kBase + 4 * off, 4},
                                          {4 * kBase + g * off, g},
                                          {5 * kBase + 2 * off, 2}};
        CheckSchedule(ops, n);
        REQUIRE(cuda_internal::SplitForVectors(ops.data(), 5, n).aligned);
      }
    }
    std::mt19937 rng(static_cast<uint32_t>(n));
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<VectorOperand> ops;
      for (int k = 0; k < 5; ++k) {
        const size_t size = (rng() & 1) ? 4 : 2;
        ops.push_back({kBase * (k + 1) + size * (rng() % 8), size});
      }
      CheckSchedule(ops, n);
    }
  }
}

// memcpy of n bytes where n may be 0: an empty vector's data() may be null, which memcpy must
// not be given even for 0 bytes (UBSan stops the test).
void CopyBytes(void* dst, const void* src, size_t n) {
  if (n > 0) std::memcpy(dst, src, n);
}

// A host buffer whose usable part starts at a chosen byte offset from a 64-byte boundary.
class OffsetBuffer {
 public:
  OffsetBuffer(size_t bytes, size_t offset) : raw_(bytes + 128) {
    const uintptr_t base = reinterpret_cast<uintptr_t>(raw_.data());
    p_ = raw_.data() + ((64 - base % 64) % 64) + offset;
  }
  char* get() { return p_; }
  void Fill(const std::vector<char>& bytes) {
    if (!bytes.empty()) CopyBytes(p_, bytes.data(), bytes.size());  // data() may be null
  }
  std::vector<char> Bytes(size_t n) const { return std::vector<char>(p_, p_ + n); }

 private:
  std::vector<char> raw_;
  char* p_;
};

VectorOperand OperandOf(const void* p, DType d) {
  return {reinterpret_cast<uintptr_t>(p), DTypeSize(d)};
}

// Runs `op` as the kernel would, every thread of a grid of `threads` in turn.
template <class Op>
void Replay(const Op& op, const std::vector<VectorOperand>& ops, size_t n, size_t threads) {
  const ElementSplit s =
      cuda_internal::SplitForVectors(ops.data(), static_cast<int>(ops.size()), n);
  for (size_t t = 0; t < threads; ++t) cuda_internal::ForEachChunk(s, n, t, threads, op);
}

constexpr size_t kReplaySizes[] = {0, 1, 7, 8, 9, 31, 100, 257};
constexpr size_t kReplayThreads[] = {1, 5, 64};
// Element offsets of the (first, second) operand: equal (vector path after a head) and unequal
// (unaligned path unless they happen to agree).
constexpr std::pair<size_t, size_t> kOffsetPairs[] = {{0, 0}, {1, 1}, {3, 3}, {7, 7},
                                                     {0, 1}, {1, 0}, {2, 5}, {4, 0}};

template <DType S, DType D>
void CheckCastReplay(DType s, DType d) {
  if (s != S || d != D) return;
  auto cpu = testing::OneThreadCpuDevice();
  for (auto [os, od] : kOffsetPairs) {
    for (size_t n : kReplaySizes) {
      for (size_t threads : kReplayThreads) {
        INFO(DTypeName(S) << " -> " << DTypeName(D) << " offsets " << os << "," << od << " n "
                          << n << " threads " << threads);
        const std::vector<char> src = RandomBits(n * DTypeSize(S), static_cast<uint32_t>(n + os));
        std::vector<char> want(n * DTypeSize(D), 0);
        REQUIRE(cpu->Cast(src.data(), S, want.data(), D, n, nullptr).ok());
        OffsetBuffer in(src.size(), os * DTypeSize(S)), out(want.size(), od * DTypeSize(D));
        in.Fill(src);
        Replay(cuda_internal::CastOp<S, D>{in.get(), out.get()},
               {OperandOf(in.get(), S), OperandOf(out.get(), D)}, n, threads);
        REQUIRE(out.Bytes(want.size()) == want);
      }
    }
  }
}

template <DType S>
void CheckCastReplayFrom(DType s, DType d) {
  CheckCastReplay<S, DType::kF32>(s, d);
  CheckCastReplay<S, DType::kBF16>(s, d);
  CheckCastReplay<S, DType::kF16>(s, d);
}

TEST_CASE("CudaElementwise: Cast chunks equal the CPU device at every offset", "[zero]") {
  for (DType s : kDTypes) {
    for (DType d : kDTypes) {
      if (s == d) continue;
      CheckCastReplayFrom<DType::kF32>(s, d);
      CheckCastReplayFrom<DType::kBF16>(s, d);
      CheckCastReplayFrom<DType::kF16>(s, d);
    }
  }
}

template <DType D>
void CheckAccumulateReplay() {
  auto cpu = testing::OneThreadCpuDevice();
  for (auto [oa, ox] : kOffsetPairs) {
    for (size_t n : kReplaySizes) {
      for (size_t threads : kReplayThreads) {
        INFO(DTypeName(D) << " offsets " << oa << "," << ox << " n " << n << " threads "
                          << threads);
        std::vector<char> acc = RandomValues(D, n, 100 + static_cast<uint32_t>(n), -14, 4);
        const std::vector<char> x = RandomValues(D, n, 200 + static_cast<uint32_t>(n), -14, 4);
        OffsetBuffer bacc(acc.size(), oa * DTypeSize(D)), bx(x.size(), ox * DTypeSize(D));
        bacc.Fill(acc);
        bx.Fill(x);
        REQUIRE(cpu->Accumulate(acc.data(), x.data(), D, n, nullptr).ok());
        Replay(cuda_internal::AccumulateOp<D>{bacc.get(), bx.get()},
               {OperandOf(bacc.get(), D), OperandOf(bx.get(), D)}, n, threads);
        REQUIRE(bacc.Bytes(acc.size()) == acc);
      }
    }
  }
}

TEST_CASE("CudaElementwise: Accumulate chunks equal the CPU device at every offset", "[zero]") {
  CheckAccumulateReplay<DType::kF32>();
  CheckAccumulateReplay<DType::kBF16>();
  CheckAccumulateReplay<DType::kF16>();
}

template <DType D>
void CheckScaleReplay() {
  auto cpu = testing::OneThreadCpuDevice();
  for (auto [o, unused] : kOffsetPairs) {
    for (size_t n : kReplaySizes) {
      for (size_t threads : kReplayThreads) {
        for (float factor : {0.25f, 1.0f / 3.0f, 1.0f / 24.0f}) {
          INFO(DTypeName(D) << " offset " << o << " n " << n << " threads " << threads
                            << " factor " << factor);
          std::vector<char> x = RandomValues(D, n, 300 + static_cast<uint32_t>(n), -14, 4);
          OffsetBuffer bx(x.size(), o * DTypeSize(D));
          bx.Fill(x);
          REQUIRE(cpu->Scale(x.data(), D, n, factor, nullptr).ok());
          Replay(cuda_internal::ScaleOp<D>{bx.get(), factor}, {OperandOf(bx.get(), D)}, n,
                 threads);
          REQUIRE(bx.Bytes(x.size()) == x);
        }
      }
    }
  }
}

TEST_CASE("CudaElementwise: Scale chunks equal the CPU device at every offset", "[zero]") {
  CheckScaleReplay<DType::kF32>();
  CheckScaleReplay<DType::kBF16>();
  CheckScaleReplay<DType::kF16>();
}

template <DType D>
void CheckFiniteReplay() {
  for (auto [o, unused] : kOffsetPairs) {
    for (size_t n : kReplaySizes) {
      for (size_t threads : kReplayThreads) {
        const std::vector<char> x = RandomValues(D, n, 400 + static_cast<uint32_t>(n));
        // Clean, then one Inf or NaN at each position in turn (every head, body and tail slot).
        for (size_t pos = 0; pos <= n; ++pos) {
          std::vector<char> y = x;
          if (pos < n) {
            const float bad = pos % 2 ? std::numeric_limits<float>::infinity()
                                      : std::numeric_limits<float>::quiet_NaN();
            StoreAs<D>(y.data(), pos, bad);
          }
          OffsetBuffer b(y.size(), o * DTypeSize(D));
          b.Fill(y);
          int bad = 0;
          Replay(cuda_internal::NonFiniteOp<D>{b.get(), &bad}, {OperandOf(b.get(), D)}, n,
                 threads);
          INFO(DTypeName(D) << " offset " << o << " n " << n << " threads " << threads
                            << " pos " << pos);
          REQUIRE((bad == 0) == offload::AllFinite(y.data(), D, n, 1));
          REQUIRE((bad == 0) == (pos == n));
        }
      }
    }
  }
}

TEST_CASE("CudaElementwise: the finite check's chunks find one Inf or NaN anywhere", "[zero]") {
  CheckFiniteReplay<DType::kF32>();
  CheckFiniteReplay<DType::kBF16>();
  CheckFiniteReplay<DType::kF16>();
}

template <DType G, DType P, bool kOut>
void CheckAdamWReplay(DType g, DType p, bool out) {
  if (g != G || p != P || out != kOut) return;
  auto params = offload::MakeAdamWStepParams(3e-4, 0.9, 0.95, 1e-8, 0.1, 7);
  REQUIRE(params.ok());
  const float grad_scale = 1.0f / 1024;
  const AdamWConstants c = ConstantsOf(*params, grad_scale);
  for (auto [of, og] : kOffsetPairs) {
    for (size_t n : kReplaySizes) {
      for (size_t threads : kReplayThreads) {
        INFO("grad " << DTypeName(G) << " param " << DTypeName(P) << " out " << kOut
                     << " offsets " << of << "," << og << " n " << n << " threads " << threads);
        const std::vector<char> grad = RandomValues(G, n, 11 + static_cast<uint32_t>(n), -40, 6);
        const std::vector<char> mv = RandomValues(DType::kF32, 3 * n, 12, -30, 2);
        std::vector<float> master(n), m(n), v(n);
        if (n > 0) {  // data() of an empty vector may be null, which memcpy must not see
          CopyBytes(master.data(), mv.data(), 4 * n);
          CopyBytes(m.data(), mv.data() + 4 * n, 4 * n);
          CopyBytes(v.data(), mv.data() + 8 * n, 4 * n);
        }
        for (float& x : v) x = std::fabs(x);
        // The fp32 state at the first offset, grad and param copy at the second.
        OffsetBuffer bmaster(4 * n, 4 * of), bm(4 * n, 4 * of), bv(4 * n, 4 * of),
            bgrad(grad.size(), og * DTypeSize(G)), bout(n * DTypeSize(P), og * DTypeSize(P));
        CopyBytes(bmaster.get(), master.data(), 4 * n);
        CopyBytes(bm.get(), m.data(), 4 * n);
        CopyBytes(bv.get(), v.data(), 4 * n);
        bgrad.Fill(grad);
        std::vector<char> out_ref(n * DTypeSize(P), 0);
        REQUIRE(offload::CpuAdamW({master.data(), m.data(), v.data(), grad.data(), G,
                                   kOut ? out_ref.data() : nullptr, P, n},
                                  *params, grad_scale, 1)
                    .ok());
        std::vector<VectorOperand> ops = {
            OperandOf(bmaster.get(), DType::kF32), OperandOf(bm.get(), DType::kF32),
            OperandOf(bv.get(), DType::kF32), OperandOf(bgrad.get(), G)};
        if (kOut) ops.push_back(OperandOf(bout.get(), P));
        Replay(cuda_internal::AdamWOp<G, P, kOut>{
                   c, reinterpret_cast<float*>(bmaster.get()), reinterpret_cast<float*>(bm.get()),
                   reinterpret_cast<float*>(bv.get()), bgrad.get(), kOut ? bout.get() : nullptr},
               ops, n, threads);
        auto bytes_of = [](const std::vector<float>& f) {
          std::vector<char> b(4 * f.size());
          CopyBytes(b.data(), f.data(), b.size());
          return b;
        };
        REQUIRE(bmaster.Bytes(4 * n) == bytes_of(master));
        REQUIRE(bm.Bytes(4 * n) == bytes_of(m));
        REQUIRE(bv.Bytes(4 * n) == bytes_of(v));
        if (kOut) REQUIRE(bout.Bytes(out_ref.size()) == out_ref);
      }
    }
  }
}

template <DType G>
void CheckAdamWReplayForGrad(DType g, DType p, bool out) {
  CheckAdamWReplay<G, DType::kF32, false>(g, p, out);
  CheckAdamWReplay<G, DType::kF32, true>(g, p, out);
  CheckAdamWReplay<G, DType::kBF16, true>(g, p, out);
  CheckAdamWReplay<G, DType::kF16, true>(g, p, out);
}

TEST_CASE("CudaElementwise: AdamW chunks equal CpuAdamW at every offset", "[zero]") {
  for (DType g : kDTypes) {
    for (DType p : kDTypes) {
      for (bool out : {false, true}) {
        if (!out && p != DType::kF32) continue;
        CheckAdamWReplayForGrad<DType::kF32>(g, p, out);
        CheckAdamWReplayForGrad<DType::kBF16>(g, p, out);
        CheckAdamWReplayForGrad<DType::kF16>(g, p, out);
      }
    }
  }
}

// ------------------------------------------------------------------ compact-state AdamW

// One combination of CpuAdamWCompact's template arguments: grad dtype, master form, moment dtype
// and (kF32 form only) the parameter copy.
struct CompactCase {
  DType grad;
  offload::MasterForm form;
  DType moments;
  bool out;     // kF32: a parameter copy is written; the bf16 forms always have their param
  DType param;  // kF32 with out: its dtype; the bf16 forms: kBF16
};

std::string CompactName(const CompactCase& k) {
  return absl::StrCat("grad ", DTypeName(k.grad), " master ", offload::MasterFormName(k.form),
                      " moments ", DTypeName(k.moments), " param ",
                      k.out ? DTypeName(k.param) : "none");
}

// Every combination: 3 grad dtypes x (kF32 with 4 param choices, kBf16Remainder,
// kBf16Stochastic) x 2 moment dtypes = 36.
std::vector<CompactCase> AllCompactCases() {
  std::vector<CompactCase> cases;
  for (DType g : kDTypes) {
    for (DType mo : {DType::kF32, DType::kBF16}) {
      cases.push_back({g, offload::MasterForm::kF32, mo, false, DType::kF32});
      for (DType p : kDTypes) cases.push_back({g, offload::MasterForm::kF32, mo, true, p});
      cases.push_back({g, offload::MasterForm::kBf16Remainder, mo, true, DType::kBF16});
      cases.push_back({g, offload::MasterForm::kBf16Stochastic, mo, true, DType::kBF16});
    }
  }
  return cases;
}

// The arrays of one compact update as bytes, in CompactAdamWArrays' field order; an array the
// form does not use is empty.
constexpr int kCompactArrays = 6;
constexpr const char* kCompactArrayNames[kCompactArrays] = {"master", "param", "remainder",
                                                           "m",      "v",     "grad"};
using CompactBytes = std::array<std::vector<char>, kCompactArrays>;

// Element size of array k, and whether the case uses it.
size_t CompactElemSize(const CompactCase& k, int array) {
  const size_t sizes[kCompactArrays] = {4, DTypeSize(k.param), 2, DTypeSize(k.moments),
                                        DTypeSize(k.moments), DTypeSize(k.grad)};
  return sizes[array];
}
bool CompactUses(const CompactCase& k, int array) {
  const bool f32 = k.form == offload::MasterForm::kF32;
  const bool used[kCompactArrays] = {f32, !f32 || k.out,
                                     k.form == offload::MasterForm::kBf16Remainder,
                                     true, true, true};
  return used[array];
}

// A starting state of n elements: masters of every magnitude AdamW meets (the remainder form's
// split from fp32 masters, so the remainders are arbitrary), moments rounded to their dtype,
// v >= 0, a gradient of every magnitude, the parameter copy zeroed.
CompactBytes CompactInitial(const CompactCase& k, size_t n, uint32_t seed) {
  CompactBytes b;
  const std::vector<char> master = RandomValues(DType::kF32, n, seed, -12, 1);
  if (k.form == offload::MasterForm::kF32) {
    b[0] = master;
    if (k.out) b[1].assign(n * DTypeSize(k.param), 0);
  } else {
    b[1].resize(2 * n);
    b[2].resize(2 * n);
    for (size_t i = 0; i < n; ++i) {
      float x;
      std::memcpy(&x, master.data() + 4 * i, 4);
      uint16_t p, r;
      offload::SplitMaster(x, &p, &r);
      if (k.form == offload::MasterForm::kBf16Stochastic) p = FloatToBf16(x);
      std::memcpy(b[1].data() + 2 * i, &p, 2);
      std::memcpy(b[2].data() + 2 * i, &r, 2);
    }
    if (k.form != offload::MasterForm::kBf16Remainder) b[2].clear();
  }
  b[3] = RandomValues(k.moments, n, seed + 1, -30, 2);
  b[4] = RandomValues(k.moments, n, seed + 2, -40, 2);
  for (size_t i = 0; i < n; ++i) {  // a second moment is never negative: clear the sign bit
    const size_t size = DTypeSize(k.moments);
    b[4][i * size + size - 1] = static_cast<char>(b[4][i * size + size - 1] & 0x7f);
  }
  b[5] = RandomValues(k.grad, n, seed + 3, -30, 8);
  return b;
}

// The CompactAdamWArrays of a case over arrays at `p` (an unused array's pointer is ignored).
offload::CompactAdamWArrays CompactArraysAt(const CompactCase& k, size_t n,
                                            const std::array<char*, kCompactArrays>& p,
                                            const offload::StochasticRounding& rounding) {
  auto use = [&](int a) { return CompactUses(k, a) ? p[a] : nullptr; };
  offload::CompactAdamWArrays a;
  a.master_form = k.form;
  a.master = reinterpret_cast<float*>(use(0));
  a.param = use(1);
  a.param_dtype = k.param;
  a.remainder = reinterpret_cast<uint16_t*>(use(2));
  a.m = use(3);
  a.v = use(4);
  a.moment_dtype = k.moments;
  a.grad = use(5);
  a.grad_dtype = k.grad;
  a.n = n;
  a.rounding = rounding;
  return a;
}

offload::CompactAdamWArrays CompactArraysOf(const CompactCase& k, size_t n, CompactBytes& b,
                                            const offload::StochasticRounding& rounding) {
  std::array<char*, kCompactArrays> p;
  for (int a = 0; a < kCompactArrays; ++a) p[a] = b[a].data();
  return CompactArraysAt(k, n, p, rounding);
}

// Ranges with their own constants over [0, n), cut at the given points (clamped into
// [previous cut, n]; equal cuts give empty ranges, which the kernels must skip).
std::vector<offload::AdamWRange> CompactRanges(size_t n, const std::vector<size_t>& cuts,
                                               int step) {
  std::vector<offload::AdamWRange> ranges;
  size_t begin = 0;
  for (size_t k = 0; k <= cuts.size(); ++k) {
    const size_t end = k < cuts.size() ? std::min(std::max(cuts[k], begin), n) : n;
    auto p = offload::MakeAdamWStepParams(1e-3 * (k + 1), 0.9, k % 2 ? 0.95 : 0.999, 1e-8,
                                          0.1 * (k % 3), step);
    REQUIRE(p.ok());
    ranges.push_back({begin, end, *p});
    begin = end;
  }
  return ranges;
}

// Replays every launch ForEachCompactLaunch makes of the call, each through the kernel's chunk
// code over a simulated grid of `threads`; returns the number of launches.
int ReplayCompact(const offload::CompactAdamWArrays& a,
                  const std::vector<offload::AdamWRange>& ranges, float grad_scale,
                  size_t threads) {
  int launches = 0;
  const int e = cuda_internal::ForEachCompactLaunch(
      a, ranges, grad_scale,
      [&](const AdamWConstants& c, const cuda_internal::CompactAdamWArgs& piece) {
        VectorOperand ops[cuda_internal::kMaxCompactOperands];
        const int count = cuda_internal::CompactOperands(piece, ops);
        cuda_internal::WithCompactAdamWOp(c, piece, [&](const auto& op) {
          Replay(op, std::vector<VectorOperand>(ops, ops + count), piece.n, threads);
        });
        ++launches;
        return 0;
      });
  REQUIRE(e == 0);
  return launches;
}

// Places each array of `b` at an element offset from a 64-byte boundary: the state arrays
// (master, remainder, m, v) at `state_off`, grad and param at `io_off` (as the AdamW replay).
struct CompactOffsetArrays {
  std::vector<std::unique_ptr<OffsetBuffer>> bufs;
  std::array<char*, kCompactArrays> p{};

  CompactOffsetArrays(const CompactCase& k, const CompactBytes& b, size_t state_off,
                      size_t io_off) {
    for (int a = 0; a < kCompactArrays; ++a) {
      const size_t off = (a == 1 || a == 5) ? io_off : state_off;
      bufs.push_back(std::make_unique<OffsetBuffer>(b[a].size(), off * CompactElemSize(k, a)));
      bufs.back()->Fill(b[a]);
      p[a] = bufs.back()->get();
    }
  }
  std::vector<char> Bytes(int a, size_t size) const { return bufs[a]->Bytes(size); }
};

void CheckCompactReplay(const CompactCase& k) {
  const float grad_scale = 1.0f / 1024;
  for (auto [os, oi] : kOffsetPairs) {
    for (size_t n : kReplaySizes) {
      // Ranges cut at odd points, and (stochastic form) the global index crossing 2^32 inside
      // the second range.
      const std::vector<offload::AdamWRange> ranges = CompactRanges(n, {3, 3, n / 2 + 1}, 7);
      const offload::StochasticRounding rounding{0x1234567890abcdefull, 7,
                                                 (uint64_t{5} << 32) - n / 3 - 4};
      const CompactBytes init = CompactInitial(k, n, 100 + static_cast<uint32_t>(n + os));
      CompactBytes want = init;
      REQUIRE(offload::CpuAdamWCompact(CompactArraysOf(k, n, want, rounding), ranges, grad_scale,
                                       1)
                  .ok());
      for (size_t threads : kReplayThreads) {
        INFO(CompactName(k) << " offsets " << os << "," << oi << " n " << n << " threads "
                            << threads);
        CompactOffsetArrays got(k, init, os, oi);
        ReplayCompact(CompactArraysAt(k, n, got.p, rounding), ranges, grad_scale, threads);
        for (int a = 0; a < kCompactArrays; ++a) {
          INFO("array " << kCompactArrayNames[a]);
          REQUIRE(got.Bytes(a, want[a].size()) == want[a]);
        }
      }
    }
  }
}

TEST_CASE("CudaElementwise: compact AdamW launches equal CpuAdamWCompact at every offset",
          "[zero]") {
  for (const CompactCase& k : AllCompactCases()) CheckCompactReplay(k);
}

TEST_CASE("CudaElementwise: the stochastic form's launches are cut at 2^32 index blocks as the "
          "host cuts", "[zero]") {
  const CompactCase k{DType::kBF16, offload::MasterForm::kBf16Stochastic, DType::kBF16, true,
                      DType::kBF16};
  const size_t n = 1000;
  const CompactBytes init = CompactInitial(k, n, 77);
  struct Cut {
    uint64_t first_index;
    int launches;  // of the three ranges below
  };
  // The boundary inside the first range, at a range's start, at element 0, in the last element,
  // after the array (none), and two boundaries inside one range (impossible: 2^32 apart).
  const Cut cuts[] = {{(uint64_t{1} << 32) - 10, 4},
                      {(uint64_t{1} << 32) - 400, 3},
                      {uint64_t{7} << 32, 3},
                      {(uint64_t{3} << 32) - (n - 1), 4},
                      {0, 3}};
  const std::vector<offload::AdamWRange> ranges = CompactRanges(n, {400, 401}, 3);
  for (const Cut& cut : cuts) {
    INFO("first_index " << cut.first_index);
    const offload::StochasticRounding rounding{42, 3, cut.first_index};
    CompactBytes want = init;
    REQUIRE(offload::CpuAdamWCompact(CompactArraysOf(k, n, want, rounding), ranges, 1.0f, 1).ok());
    for (size_t threads : kReplayThreads) {
      CompactBytes got = init;
      REQUIRE(ReplayCompact(CompactArraysOf(k, n, got, rounding), ranges, 1.0f, threads) ==
              cut.launches);
      REQUIRE(got[1] == want[1]);
    }
    // A launch plan that ignored the boundary (one key for the whole array) would differ in
    // the 990 elements past it: the test can tell.
    if (cut.first_index == (uint64_t{1} << 32) - 10) {
      CompactBytes one_key = init;
      offload::CompactAdamWArrays a = CompactArraysOf(k, n, one_key, rounding);
      cuda_internal::ForEachCompactLaunch(
          a, ranges, 1.0f,
          [&](const AdamWConstants& c, cuda_internal::CompactAdamWArgs piece) {
            piece.rounding.key = offload::StochasticKey(42, 3, offload::IndexHigh(cut.first_index));
            VectorOperand ops[cuda_internal::kMaxCompactOperands];
            const int count = cuda_internal::CompactOperands(piece, ops);
            cuda_internal::WithCompactAdamWOp(c, piece, [&](const auto& op) {
              Replay(op, std::vector<VectorOperand>(ops, ops + count), piece.n, 1);
            });
            return 0;
          });
      REQUIRE(one_key[1] != want[1]);
    }
  }
}

// comm/internal/reduce.h's contract, one element at a time (the former one-element kernel).
template <DType D>
std::vector<char> ReduceReference(const std::vector<std::vector<char>>& srcs, size_t count,
                                  int op) {
  std::vector<char> out(count * DTypeSize(D));
  const int n = static_cast<int>(srcs.size());
  for (size_t i = 0; i < count; ++i) {
    float acc = LoadAs<D>(srcs[0].data(), i);
    for (int k = 1; k < n; ++k) {
      const float x = LoadAs<D>(srcs[k].data(), i);
      acc = op == 2 ? ((acc > x || acc != acc) ? acc : x) : acc + x;
    }
    if (op == 1) acc = acc / static_cast<float>(n);
    cuda_internal::StoreCanonical<D>(out.data(), i, acc);
  }
  return out;
}

std::vector<char> ReduceReference(DType d, const std::vector<std::vector<char>>& srcs,
                                  size_t count, int op) {
  switch (d) {
    case DType::kF32:
      return ReduceReference<DType::kF32>(srcs, count, op);
    case DType::kBF16:
      return ReduceReference<DType::kBF16>(srcs, count, op);
    case DType::kF16:
      break;
  }
  return ReduceReference<DType::kF16>(srcs, count, op);
}

template <DType D, int kOp>
void CheckReduceReplay() {
  for (int ranks : {1, 2, 3, 4, 16}) {
    for (auto [o0, o1] : kOffsetPairs) {
      for (size_t count : kReplaySizes) {
        for (size_t threads : kReplayThreads) {
          INFO(DTypeName(D) << " op " << kOp << " ranks " << ranks << " offsets " << o0 << ","
                            << o1 << " count " << count << " threads " << threads);
          std::vector<std::vector<char>> srcs;
          std::vector<std::unique_ptr<OffsetBuffer>> bufs;
          cuda_internal::ReduceRankOrderOp<D, kOp> op{};
          std::vector<VectorOperand> ops;
          for (int k = 0; k < ranks; ++k) {
            srcs.push_back(RandomValues(D, count, 900 + 31 * k + static_cast<uint32_t>(count),
                                        -8, 8));
            if (count > 2 && k == 1) StoreAs<D>(srcs[k].data(), 2, std::nanf(""));
            // Rank k at the first offset when even, the second when odd.
            bufs.push_back(std::make_unique<OffsetBuffer>(srcs[k].size(),
                                                          (k % 2 ? o1 : o0) * DTypeSize(D)));
            bufs.back()->Fill(srcs[k]);
            op.srcs[k] = bufs.back()->get();
            ops.push_back(OperandOf(bufs.back()->get(), D));
          }
          op.n = ranks;
          // In place into rank 0's buffer, as the in-process reduce-scatter does.
          op.dst = bufs[0]->get();
          ops.push_back(OperandOf(op.dst, D));
          const std::vector<char> want = ReduceReference<D>(srcs, count, kOp);
          Replay(op, ops, count, threads);
          REQUIRE(bufs[0]->Bytes(want.size()) == want);
        }
      }
    }
  }
}

template <DType D>
void CheckReduceReplayOps() {
  CheckReduceReplay<D, 0>();
  CheckReduceReplay<D, 1>();
  CheckReduceReplay<D, 2>();
}

TEST_CASE("CudaElementwise: rank-order reduction chunks equal the reference at every offset",
          "[zero]") {
  CheckReduceReplayOps<DType::kF32>();
  CheckReduceReplayOps<DType::kBF16>();
  CheckReduceReplayOps<DType::kF16>();
}

// ------------------------------------------------------------------ device creation

TEST_CASE("CudaDevice: creation either succeeds or says why", "[zero][gpu]") {
  const auto negative = CreateCudaDevice(-1);
  REQUIRE(negative.status().code() == absl::StatusCode::kInvalidArgument);
  REQUIRE(absl::StrContains(negative.status().message(), "device_ordinal=-1"));

  const auto first = CreateCudaDevice(0);
  if (first.ok()) {
    REQUIRE((*first)->name() == "cuda:0");
    const auto beyond = CreateCudaDevice(1 << 20);
    REQUIRE(beyond.status().code() == absl::StatusCode::kInvalidArgument);
  } else {
    REQUIRE(first.status().code() == absl::StatusCode::kFailedPrecondition);
    REQUIRE(!first.status().message().empty());
  }
}

// ------------------------------------------------------------------ GPU cases

using testing::GpuOrSkip;

// A buffer from one of the device's allocators, freed on scope exit.
memory::Allocation Alloc(Device* dev, memory::MemoryKind kind, size_t bytes) {
  auto a = memory::Allocation::Create(dev->allocator(kind), bytes);
  REQUIRE(a.ok());
  return std::move(*a);
}

std::unique_ptr<memory::Allocation> Upload(Device* dev, const std::vector<char>& host) {
  auto buf =
      std::make_unique<memory::Allocation>(Alloc(dev, memory::MemoryKind::kDevice, host.size()));
  REQUIRE(dev->Copy(buf->get(), host.data(), host.size(), nullptr).ok());
  return buf;
}

std::vector<char> Download(Device* dev, const void* src, size_t bytes) {
  std::vector<char> host(bytes);
  REQUIRE(dev->Copy(host.data(), src, bytes, nullptr).ok());
  REQUIRE(dev->Synchronize(nullptr).ok());
  return host;
}

TEST_CASE("CudaDevice: Cast equals the CPU device bitwise, NaN payloads included",
          "[zero][gpu]") {
  Device* gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  auto cpu = testing::OneThreadCpuDevice();
  for (DType s : kDTypes) {
    for (DType d : kDTypes) {
      for (size_t n : kSizes) {
        INFO(DTypeName(s) << " -> " << DTypeName(d) << " n=" << n);
        const std::vector<char> src = RandomBits(n * DTypeSize(s), static_cast<uint32_t>(n));
        std::vector<char> want(n * DTypeSize(d));
        REQUIRE(cpu->Cast(src.data(), s, want.data(), d, n, nullptr).ok());
        auto dsrc = Upload(gpu, src);
        memory::Allocation ddst = Alloc(gpu, memory::MemoryKind::kDevice, want.size());
        REQUIRE(gpu->Cast(dsrc->get(), s, ddst.get(), d, n, nullptr).ok());
        REQUIRE(Download(gpu, ddst.get(), want.size()) == want);
      }
    }
  }
}

// The kernels convert fp16 with the GPU's cvt instructions (base/half.h, device code): every
// fp32 bit pattern to fp16, and every fp16 pattern to fp32, must give the CPU device's bits.
// 2^32 elements in slices of 2^26 (256 MiB of fp32): seconds on a GPU machine.
// [sanitizer_slow]: 2^32 patterns; compute-sanitizer's racecheck and synccheck skip it.
TEST_CASE("CudaDevice: fp16 conversions equal the CPU device on every bit pattern",
          "[zero][gpu][sanitizer_slow]") {
  Device* gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  auto cpu = testing::OneThreadCpuDevice();
  {
    std::vector<char> src(65536 * 2);
    for (uint32_t h = 0; h < 65536; ++h) {
      const auto bits = static_cast<uint16_t>(h);
      std::memcpy(src.data() + 2 * h, &bits, 2);
    }
    std::vector<char> want(65536 * 4);
    REQUIRE(cpu->Cast(src.data(), DType::kF16, want.data(), DType::kF32, 65536, nullptr).ok());
    auto dsrc = Upload(gpu, src);
    memory::Allocation ddst = Alloc(gpu, memory::MemoryKind::kDevice, want.size());
    REQUIRE(gpu->Cast(dsrc->get(), DType::kF16, ddst.get(), DType::kF32, 65536, nullptr).ok());
    REQUIRE(Download(gpu, ddst.get(), want.size()) == want);
  }
  constexpr size_t kSlice = size_t{1} << 26;
  std::vector<char> src(kSlice * 4), want(kSlice * 2);
  memory::Allocation dsrc = Alloc(gpu, memory::MemoryKind::kDevice, src.size());
  memory::Allocation ddst = Alloc(gpu, memory::MemoryKind::kDevice, want.size());
  for (uint64_t base = 0; base < (uint64_t{1} << 32); base += kSlice) {
    INFO("fp32 patterns from " << base);
    for (size_t i = 0; i < kSlice; ++i) {
      const auto bits = static_cast<uint32_t>(base + i);
      std::memcpy(src.data() + 4 * i, &bits, 4);
    }
    REQUIRE(cpu->Cast(src.data(), DType::kF32, want.data(), DType::kF16, kSlice, nullptr).ok());
    REQUIRE(gpu->Copy(dsrc.get(), src.data(), src.size(), nullptr).ok());
    REQUIRE(gpu->Cast(dsrc.get(), DType::kF32, ddst.get(), DType::kF16, kSlice, nullptr).ok());
    REQUIRE(Download(gpu, ddst.get(), want.size()) == want);
  }
}

TEST_CASE("CudaDevice: Accumulate equals the CPU device bitwise", "[zero][gpu]") {
  Device* gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  auto cpu = testing::OneThreadCpuDevice();
  for (DType d : kDTypes) {
    for (size_t n : kSizes) {
      INFO(DTypeName(d) << " n=" << n);
      std::vector<char> acc = RandomValues(d, n, 100 + static_cast<uint32_t>(n), -14, 4);
      const std::vector<char> x = RandomValues(d, n, 200 + static_cast<uint32_t>(n), -14, 4);
      auto dacc = Upload(gpu, acc);
      auto dx = Upload(gpu, x);
      REQUIRE(cpu->Accumulate(acc.data(), x.data(), d, n, nullptr).ok());
      REQUIRE(gpu->Accumulate(dacc->get(), dx->get(), d, n, nullptr).ok());
      REQUIRE(Download(gpu, dacc->get(), acc.size()) == acc);
    }
  }
}

TEST_CASE("CudaDevice: SquaredNorm equals SquaredNormF32 bitwise", "[zero][gpu]") {
  Device* gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  // Over 1024 blocks: two tree levels, the first of three chunks (the last padded).
  std::vector<size_t> sizes(std::begin(kSizes), std::end(kSizes));
  sizes.push_back(3000 * 1024 + 17);
  for (DType d : kDTypes) {
    for (size_t n : sizes) {
      INFO(DTypeName(d) << " n=" << n);
      const std::vector<char> x = RandomValues(d, n, 300 + static_cast<uint32_t>(n), -12, 3);
      auto dx = Upload(gpu, x);
      float got = -1;
      REQUIRE(gpu->SquaredNorm(dx->get(), d, n, &got, nullptr).ok());
      REQUIRE(gpu->Synchronize(nullptr).ok());
      REQUIRE(Bits(got) == Bits(offload::SquaredNormF32(x.data(), d, n, 1)));
    }
  }
  // A pinned destination: the copy is truly asynchronous, valid after Synchronize.
  memory::Allocation out = Alloc(gpu, memory::MemoryKind::kPinnedHost, sizeof(float));
  const std::vector<char> x = RandomValues(DType::kBF16, 77777, 5);
  auto dx = Upload(gpu, x);
  REQUIRE(gpu->SquaredNorm(dx->get(), DType::kBF16, 77777, out.as<float>(), nullptr).ok());
  REQUIRE(gpu->Synchronize(nullptr).ok());
  REQUIRE(Bits(*out.as<float>()) ==
          Bits(offload::SquaredNormF32(x.data(), DType::kBF16, 77777, 1)));
}

TEST_CASE("CudaDevice: the norm's tree levels equal NormTreeSum bitwise", "[zero][gpu]") {
  Device* gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  for (size_t count : kTreeCounts) {
    INFO("count=" << count);
    std::vector<float> values = RandomPartials(count, 500 + static_cast<uint32_t>(count));
    std::vector<char> bytes(count * sizeof(float));
    std::memcpy(bytes.data(), values.data(), bytes.size());
    auto dvalues = Upload(gpu, bytes);
    // (scratch levels, then the total) fp32
    const size_t floats = cuda_internal::NormTreeScratch(count);
    memory::Allocation scratch =
        Alloc(gpu, memory::MemoryKind::kDevice, (floats + 1) * sizeof(float));
    float* total = scratch.as<float>() + floats;
    REQUIRE(cuda_internal::LaunchNormTreeSum(dvalues->as<float>(), count, scratch.as<float>(),
                                             total, nullptr) == 0);
    const std::vector<char> got = Download(gpu, total, sizeof(float));
    float g = 0;
    std::memcpy(&g, got.data(), sizeof(float));
    REQUIRE(Bits(g) == Bits(offload::NormTreeSum(values.data(), count)));
    // The input is left as it was.
    REQUIRE(Download(gpu, dvalues->get(), bytes.size()) == bytes);
  }
}

TEST_CASE("CudaDevice: SquaredNormsAndFinite equals SquaredNormF32 and AllFinite per range",
          "[zero][gpu]") {
  Device* gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  const NormCases c = MakeNormCases(BatchNormCases(), 13);
  const int count = static_cast<int>(c.ranges.size());
  std::vector<std::unique_ptr<memory::Allocation>> on_gpu;
  std::vector<Device::NormRange> ranges;
  for (int i = 0; i < count; ++i) {
    on_gpu.push_back(Upload(gpu, c.buffers[i]));
    const size_t offset = static_cast<const char*>(c.ranges[i].x) - c.buffers[i].data();
    ranges.push_back({on_gpu.back()->as<char>() + offset, c.ranges[i].dtype, c.ranges[i].n});
  }
  // Pinned destinations (the engine's readback) and pageable ones.
  for (bool pinned : {true, false}) {
    INFO("pinned " << pinned);
    memory::Allocation host =
        Alloc(gpu, memory::MemoryKind::kPinnedHost, count * (sizeof(float) + 1));
    std::vector<char> pageable(count * (sizeof(float) + 1));
    char* out = pinned ? host.as<char>() : pageable.data();
    std::memset(out, 0xff, count * sizeof(float));
    auto* sumsq = reinterpret_cast<float*>(out);
    auto* finite = reinterpret_cast<bool*>(out + count * sizeof(float));
    REQUIRE(gpu->SquaredNormsAndFinite(ranges, sumsq, finite, nullptr).ok());
    REQUIRE(gpu->Synchronize(nullptr).ok());
    for (int i = 0; i < count; ++i) {
      INFO("range " << i << " " << DTypeName(ranges[i].dtype) << " n=" << ranges[i].n);
      CHECK(Bits(sumsq[i]) == Bits(c.want[i]));
      CHECK(finite[i] == c.want_finite[i]);
    }
  }
}

TEST_CASE("CudaDevice: AllFinite finds one Inf or NaN anywhere", "[zero][gpu]") {
  Device* gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  for (DType d : kDTypes) {
    for (size_t n : kSizes) {
      std::vector<char> x = RandomValues(d, n, 400 + static_cast<uint32_t>(n));
      auto dx = Upload(gpu, x);
      bool finite = false;
      REQUIRE(gpu->AllFinite(dx->get(), d, n, &finite, nullptr).ok());
      REQUIRE(gpu->Synchronize(nullptr).ok());
      REQUIRE(finite == offload::AllFinite(x.data(), d, n, 1));
      REQUIRE(finite);
      for (size_t pos : {size_t{0}, n / 2, n - 1}) {
        for (float bad : {std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN()}) {
          INFO(DTypeName(d) << " n=" << n << " pos=" << pos << " value=" << bad);
          std::vector<char> y = x;
          if (d == DType::kF32) {
            CopyBytes(y.data() + 4 * pos, &bad, 4);
          } else {
            const uint16_t h = d == DType::kBF16 ? FloatToBf16(bad) : FloatToHalf(bad);
            CopyBytes(y.data() + 2 * pos, &h, 2);
          }
          auto dy = Upload(gpu, y);
          bool f = true;
          REQUIRE(gpu->AllFinite(dy->get(), d, n, &f, nullptr).ok());
          REQUIRE(gpu->Synchronize(nullptr).ok());
          REQUIRE(f == offload::AllFinite(y.data(), d, n, 1));
          REQUIRE(!f);
        }
      }
    }
  }
}

// Runs `steps` AdamW steps on the GPU and with CpuAdamW from the same state; compares every
// array bitwise after each step.
void CheckAdamWSteps(Device* gpu, DType g, DType p, bool out, bool alias_master, size_t n) {
  INFO("grad " << DTypeName(g) << " param " << DTypeName(p) << " out " << out << " alias "
               << alias_master << " n=" << n);
  const std::vector<char> init = RandomValues(DType::kF32, 3 * n, 21 + static_cast<uint32_t>(n),
                                              -12, 1);
  std::vector<float> master(n), m(n), v(n);
  CopyBytes(master.data(), init.data(), 4 * n);
  CopyBytes(m.data(), init.data() + 4 * n, 4 * n);
  CopyBytes(v.data(), init.data() + 8 * n, 4 * n);
  for (float& x : v) x = std::fabs(x);
  std::vector<char> param(n * DTypeSize(p));
  auto dmaster = Upload(gpu, std::vector<char>(init.begin(), init.begin() + 4 * n));
  auto dm = Upload(gpu, std::vector<char>(init.begin() + 4 * n, init.begin() + 8 * n));
  std::vector<char> vbytes(4 * n);
  CopyBytes(vbytes.data(), v.data(), 4 * n);
  auto dv = Upload(gpu, vbytes);
  memory::Allocation dparam = Alloc(gpu, memory::MemoryKind::kDevice, param.size());
  memory::Allocation dgrad = Alloc(gpu, memory::MemoryKind::kDevice, n * DTypeSize(g));
  for (int step = 1; step <= 3; ++step) {
    const std::vector<char> grad = RandomValues(g, n, 1000 * step + static_cast<uint32_t>(n),
                                                -30, 8);
    REQUIRE(gpu->Copy(dgrad.get(), grad.data(), grad.size(), nullptr).ok());
    auto params = offload::MakeAdamWStepParams(1e-3 * step, 0.9, 0.999, 1e-8, 0.01, step);
    REQUIRE(params.ok());
    const float grad_scale = 1.0f / static_cast<float>(1 << (4 * step));
    void* cpu_out = out ? (alias_master ? static_cast<void*>(master.data()) : param.data())
                        : nullptr;
    void* gpu_out = out ? (alias_master ? dmaster->get() : dparam.get()) : nullptr;
    REQUIRE(offload::CpuAdamW({master.data(), m.data(), v.data(), grad.data(), g, cpu_out, p, n},
                              *params, grad_scale, 1)
                .ok());
    REQUIRE(gpu->AdamW({dmaster->as<float>(), dm->as<float>(), dv->as<float>(), dgrad.get(), g,
                        gpu_out, p, n},
                       *params, grad_scale, nullptr)
                .ok());
    INFO("step " << step);
    auto bytes_of = [&](const std::vector<float>& f) {
      std::vector<char> b(4 * f.size());
      CopyBytes(b.data(), f.data(), b.size());
      return b;
    };
    REQUIRE(Download(gpu, dmaster->get(), 4 * n) == bytes_of(master));
    REQUIRE(Download(gpu, dm->get(), 4 * n) == bytes_of(m));
    REQUIRE(Download(gpu, dv->get(), 4 * n) == bytes_of(v));
    if (out && !alias_master) REQUIRE(Download(gpu, dparam.get(), param.size()) == param);
  }
}

TEST_CASE("CudaDevice: AdamW over per-range constants equals CpuAdamW's ranges bitwise",
          "[zero][gpu]") {
  Device* gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  const size_t n = 10007;
  const size_t cuts[] = {0, 5, 5, 3000, 3001, n};
  std::vector<offload::AdamWRange> ranges;
  for (int k = 0; k < 5; ++k) {
    auto p = offload::MakeAdamWStepParams(1e-3 * (k + 1), 0.9, 0.95, 1e-8, 0.1 * (k % 2), 1);
    REQUIRE(p.ok());
    ranges.push_back({cuts[k], cuts[k + 1], *p});
  }
  const std::vector<char> init = RandomValues(DType::kF32, 2 * n, 5, -12, 1);
  std::vector<float> master(n), m(n, 0.0f), v(n, 0.0f);
  CopyBytes(master.data(), init.data(), 4 * n);
  const std::vector<char> grad = RandomValues(DType::kBF16, n, 6, -30, 8);
  std::vector<char> param(2 * n);
  auto dmaster = Upload(gpu, std::vector<char>(init.begin(), init.begin() + 4 * n));
  auto dm = Upload(gpu, std::vector<char>(4 * n, 0));
  auto dv = Upload(gpu, std::vector<char>(4 * n, 0));
  auto dgrad = Upload(gpu, grad);
  memory::Allocation dparam = Alloc(gpu, memory::MemoryKind::kDevice, param.size());
  REQUIRE(offload::CpuAdamW({master.data(), m.data(), v.data(), grad.data(), DType::kBF16,
                             param.data(), DType::kBF16, n},
                            ranges, 0.5f, 1)
              .ok());
  REQUIRE(gpu->AdamWRanges({dmaster->as<float>(), dm->as<float>(), dv->as<float>(),
                            dgrad->get(), DType::kBF16, dparam.get(), DType::kBF16, n},
                           ranges, 0.5f, nullptr)
              .ok());
  std::vector<char> want(4 * n);
  CopyBytes(want.data(), master.data(), want.size());
  CHECK(Download(gpu, dmaster->get(), 4 * n) == want);
  CHECK(Download(gpu, dparam.get(), param.size()) == param);
}

TEST_CASE("CudaDevice: AdamW equals CpuAdamW bitwise over three steps", "[zero][gpu]") {
  Device* gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  for (size_t n : {size_t{1}, size_t{1023}, size_t{100003}}) {
    for (DType g : kDTypes) {
      CheckAdamWSteps(gpu, g, DType::kF32, /*out=*/false, false, n);
      for (DType p : kDTypes) CheckAdamWSteps(gpu, g, p, /*out=*/true, false, n);
    }
    CheckAdamWSteps(gpu, DType::kF32, DType::kF32, /*out=*/true, /*alias_master=*/true, n);
  }
}

// Device copies of a compact update's arrays, each at an element offset into its own allocation
// (the state arrays at state_off, grad and param at io_off); unused arrays stay null.
struct CompactDeviceArrays {
  std::vector<std::unique_ptr<memory::Allocation>> bufs;
  std::array<char*, kCompactArrays> p{};

  CompactDeviceArrays(Device* gpu, const CompactCase& k, const CompactBytes& b, size_t state_off,
                      size_t io_off) {
    for (int a = 0; a < kCompactArrays; ++a) {
      if (!CompactUses(k, a) || b[a].empty()) continue;
      const size_t skip = ((a == 1 || a == 5) ? io_off : state_off) * CompactElemSize(k, a);
      std::vector<char> padded(skip, 0);
      padded.insert(padded.end(), b[a].begin(), b[a].end());
      bufs.push_back(Upload(gpu, padded));
      p[a] = static_cast<char*>(bufs.back()->get()) + skip;
    }
  }
};

// Every array of the GPU's state equals the reference's, byte for byte.
void CheckCompactEqual(Device* gpu, const CompactCase& k, const CompactDeviceArrays& got,
                       const CompactBytes& want) {
  for (int a = 0; a < kCompactArrays; ++a) {
    if (got.p[a] == nullptr) continue;
    INFO("array " << kCompactArrayNames[a]);
    REQUIRE(Download(gpu, got.p[a], want[a].size()) == want[a]);
  }
}

TEST_CASE("CudaDevice: CompactAdamW equals CpuAdamWCompact bitwise for every form and dtype "
          "over three steps", "[zero][gpu]") {
  Device* gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  for (const CompactCase& k : AllCompactCases()) {
    for (size_t n : {size_t{1}, size_t{1031}, size_t{70001}}) {
      INFO(CompactName(k) << " n=" << n);
      CompactBytes host = CompactInitial(k, n, 300 + static_cast<uint32_t>(n));
      CompactDeviceArrays dev(gpu, k, host, 0, 0);
      for (int step = 1; step <= 3; ++step) {
        INFO("step " << step);
        host[5] = RandomValues(k.grad, n, 1000 * step + static_cast<uint32_t>(n), -30, 8);
        REQUIRE(gpu->Copy(dev.p[5], host[5].data(), host[5].size(), nullptr).ok());
        auto params = offload::MakeAdamWStepParams(1e-3 * step, 0.9, 0.999, 1e-8, 0.01, step);
        REQUIRE(params.ok());
        const offload::AdamWRange all{0, n, *params};
        const float grad_scale = 1.0f / static_cast<float>(1 << (4 * step));
        // The stochastic form's global index crosses 2^32 in the middle of the array.
        const offload::StochasticRounding rounding{0xfeedf00dull, static_cast<uint64_t>(step),
                                                   (uint64_t{1} << 32) - n / 2};
        REQUIRE(offload::CpuAdamWCompact(CompactArraysOf(k, n, host, rounding),
                                         absl::MakeConstSpan(&all, 1), grad_scale, 1)
                    .ok());
        REQUIRE(gpu->CompactAdamWRanges(CompactArraysAt(k, n, dev.p, rounding),
                                        absl::MakeConstSpan(&all, 1), grad_scale, nullptr)
                    .ok());
        CheckCompactEqual(gpu, k, dev, host);
      }
    }
  }
}

TEST_CASE("CudaDevice: CompactAdamW over ranges at element offsets equals CpuAdamWCompact "
          "bitwise", "[zero][gpu]") {
  Device* gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  auto stream = gpu->CreateStream();
  REQUIRE(stream.ok());
  const size_t n = 10007;
  // Parameter groups cut at odd places, one empty; the stochastic form's index crosses 2^32
  // inside the third range.
  const std::vector<offload::AdamWRange> ranges = CompactRanges(n, {5, 5, 3000, 3001}, 2);
  const offload::StochasticRounding rounding{7, 2, (uint64_t{9} << 32) - 1234};
  constexpr std::pair<size_t, size_t> kOffsets[] = {{1, 1}, {3, 3}, {7, 7},
                                                    {0, 1}, {1, 0}, {2, 5}};
  for (const CompactCase& k : AllCompactCases()) {
    for (auto [os, oi] : kOffsets) {
      INFO(CompactName(k) << " offsets " << os << "," << oi);
      CompactBytes host = CompactInitial(k, n, 500 + static_cast<uint32_t>(os));
      CompactDeviceArrays dev(gpu, k, host, os, oi);
      REQUIRE(offload::CpuAdamWCompact(CompactArraysOf(k, n, host, rounding), ranges, 0.5f, 1)
                  .ok());
      REQUIRE(gpu->CompactAdamWRanges(CompactArraysAt(k, n, dev.p, rounding), ranges, 0.5f,
                                      *stream)
                  .ok());
      REQUIRE(gpu->Synchronize(*stream).ok());
      CheckCompactEqual(gpu, k, dev, host);
    }
  }
  gpu->DestroyStream(*stream);
}

TEST_CASE("CudaDevice: CompactAdamW refuses what CpuAdamWCompact refuses, with its message",
          "[zero][gpu]") {
  Device* gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  const size_t n = 8;
  const CompactCase k{DType::kBF16, offload::MasterForm::kBf16Remainder, DType::kBF16, true,
                      DType::kBF16};
  CompactBytes host = CompactInitial(k, n, 9);
  CompactDeviceArrays dev(gpu, k, host, 0, 0);
  auto params = offload::MakeAdamWStepParams(1e-3, 0.9, 0.999, 1e-8, 0.01, 1);
  REQUIRE(params.ok());
  const offload::AdamWRange all{0, n, *params};
  const offload::AdamWRange short_range{0, n - 1, *params};
  struct Bad {
    const char* what;
    std::function<void(offload::CompactAdamWArrays&)> spoil;
    bool short_ranges;
  };
  const Bad bad[] = {
      {"no remainder", [](offload::CompactAdamWArrays& a) { a.remainder = nullptr; }, false},
      {"a master it does not use",
       [&](offload::CompactAdamWArrays& a) { a.master = reinterpret_cast<float*>(a.m); }, false},
      {"fp16 moments", [](offload::CompactAdamWArrays& a) { a.moment_dtype = DType::kF16; },
       false},
      {"an fp32 param", [](offload::CompactAdamWArrays& a) { a.param_dtype = DType::kF32; },
       false},
      {"ranges short of n", [](offload::CompactAdamWArrays&) {}, true},
  };
  for (const Bad& b : bad) {
    INFO(b.what);
    offload::CompactAdamWArrays host_arrays = CompactArraysOf(k, n, host, {});
    offload::CompactAdamWArrays dev_arrays = CompactArraysAt(k, n, dev.p, {});
    b.spoil(host_arrays);
    b.spoil(dev_arrays);
    const auto span = absl::MakeConstSpan(b.short_ranges ? &short_range : &all, 1);
    const absl::Status want = offload::CpuAdamWCompact(host_arrays, span, 1.0f, 1);
    const absl::Status got = gpu->CompactAdamWRanges(dev_arrays, span, 1.0f, nullptr);
    REQUIRE(want.code() == absl::StatusCode::kInvalidArgument);
    REQUIRE(got.code() == absl::StatusCode::kInvalidArgument);
    // The same message after the caller's name.
    std::string expected(want.message());
    REQUIRE(absl::StartsWith(expected, "CpuAdamWCompact"));
    expected.replace(0, std::string("CpuAdamWCompact").size(), "cuda:0: CompactAdamW");
    REQUIRE(got.message() == expected);
  }
  // Nothing was launched: the state is as it was.
  CheckCompactEqual(gpu, k, dev, CompactInitial(k, n, 9));
}

// The engine passes element offsets into arenas: the vector path after a scalar head (all
// arrays at one offset) and the unaligned path (arrays at different offsets), on the GPU.
TEST_CASE("CudaDevice: elementwise kernels at element offsets equal the CPU device bitwise",
          "[zero][gpu]") {
  Device* gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  auto cpu = testing::OneThreadCpuDevice();
  constexpr std::pair<size_t, size_t> kOffsets[] = {{1, 1}, {3, 3}, {7, 7},
                                                    {0, 1}, {1, 0}, {2, 5}};
  // Bytes of a device copy of `host` starting `off` elements of `d` into a fresh allocation.
  struct AtOffset {
    std::unique_ptr<memory::Allocation> buf;
    char* p;
  };
  auto upload_at = [&](const std::vector<char>& host, size_t off, DType d) {
    std::vector<char> padded(off * DTypeSize(d), 0);
    padded.insert(padded.end(), host.begin(), host.end());
    AtOffset a{Upload(gpu, padded), nullptr};
    a.p = static_cast<char*>(a.buf->get()) + off * DTypeSize(d);
    return a;
  };
  for (auto [o1, o2] : kOffsets) {
    for (size_t n : {size_t{1}, size_t{9}, size_t{1000}, size_t{100003}}) {
      INFO("offsets " << o1 << "," << o2 << " n " << n);
      // Casts: every ordered pair, src at o1, dst at o2.
      for (DType s : kDTypes) {
        for (DType d : kDTypes) {
          if (s == d) continue;
          INFO(DTypeName(s) << " -> " << DTypeName(d));
          const std::vector<char> src = RandomBits(n * DTypeSize(s), static_cast<uint32_t>(n));
          std::vector<char> want(n * DTypeSize(d));
          REQUIRE(cpu->Cast(src.data(), s, want.data(), d, n, nullptr).ok());
          AtOffset dsrc = upload_at(src, o1, s);
          AtOffset ddst = upload_at(std::vector<char>(want.size(), 0), o2, d);
          REQUIRE(gpu->Cast(dsrc.p, s, ddst.p, d, n, nullptr).ok());
          REQUIRE(Download(gpu, ddst.p, want.size()) == want);
        }
      }
      // Accumulate and the finite check, each dtype.
      for (DType d : kDTypes) {
        INFO(DTypeName(d));
        std::vector<char> acc = RandomValues(d, n, 100 + static_cast<uint32_t>(n), -14, 4);
        const std::vector<char> x = RandomValues(d, n, 200 + static_cast<uint32_t>(n), -14, 4);
        AtOffset dacc = upload_at(acc, o1, d), dx = upload_at(x, o2, d);
        REQUIRE(cpu->Accumulate(acc.data(), x.data(), d, n, nullptr).ok());
        REQUIRE(gpu->Accumulate(dacc.p, dx.p, d, n, nullptr).ok());
        REQUIRE(Download(gpu, dacc.p, acc.size()) == acc);
        for (size_t pos : {size_t{0}, n / 2, n - 1}) {
          std::vector<char> y = x;
          StoreAs(d, y.data(), pos, std::numeric_limits<float>::infinity());
          AtOffset dy = upload_at(y, o2, d);
          bool finite = true, clean = false;
          REQUIRE(gpu->AllFinite(dy.p, d, n, &finite, nullptr).ok());
          REQUIRE(gpu->AllFinite(dx.p, d, n, &clean, nullptr).ok());
          REQUIRE(gpu->Synchronize(nullptr).ok());
          REQUIRE(!finite);
          REQUIRE(clean);
        }
      }
      // AdamW: fp32 state at o1, gradient and parameter copy at o2.
      for (DType g : kDTypes) {
        for (int pi = -1; pi < 3; ++pi) {
          const bool out = pi >= 0;
          const DType p = out ? kDTypes[pi] : DType::kF32;
          INFO("adamw grad " << DTypeName(g) << " param " << (out ? DTypeName(p) : "none"));
          const std::vector<char> init = RandomValues(DType::kF32, 3 * n, 21 + o1, -12, 1);
          std::vector<float> master(n), m(n), v(n);
          CopyBytes(master.data(), init.data(), 4 * n);
          CopyBytes(m.data(), init.data() + 4 * n, 4 * n);
          CopyBytes(v.data(), init.data() + 8 * n, 4 * n);
          for (float& e : v) e = std::fabs(e);
          auto bytes_of = [](const std::vector<float>& f) {
            std::vector<char> b(4 * f.size());
            CopyBytes(b.data(), f.data(), b.size());
            return b;
          };
          AtOffset dmaster = upload_at(bytes_of(master), o1, DType::kF32);
          AtOffset dm = upload_at(bytes_of(m), o1, DType::kF32);
          AtOffset dv = upload_at(bytes_of(v), o1, DType::kF32);
          const std::vector<char> grad =
              RandomValues(g, n, 1000 + static_cast<uint32_t>(n), -30, 8);
          AtOffset dgrad = upload_at(grad, o2, g);
          std::vector<char> param(n * DTypeSize(p), 0);
          AtOffset dparam = upload_at(param, o2, p);
          auto params = offload::MakeAdamWStepParams(1e-3, 0.9, 0.999, 1e-8, 0.01, 3);
          REQUIRE(params.ok());
          REQUIRE(offload::CpuAdamW({master.data(), m.data(), v.data(), grad.data(), g,
                                     out ? param.data() : nullptr, p, n},
                                    *params, 0.25f, 1)
                      .ok());
          REQUIRE(gpu->AdamW({reinterpret_cast<float*>(dmaster.p), reinterpret_cast<float*>(dm.p),
                              reinterpret_cast<float*>(dv.p), dgrad.p, g,
                              out ? dparam.p : nullptr, p, n},
                             *params, 0.25f, nullptr)
                      .ok());
          REQUIRE(Download(gpu, dmaster.p, 4 * n) == bytes_of(master));
          REQUIRE(Download(gpu, dm.p, 4 * n) == bytes_of(m));
          REQUIRE(Download(gpu, dv.p, 4 * n) == bytes_of(v));
          if (out) REQUIRE(Download(gpu, dparam.p, param.size()) == param);
        }
      }
      // The in-process group's reduction: 3 ranks, rank k at o1 or o2, in place into rank 0.
      const comm::InProcessBufferOps ops = CudaInProcessBufferOps(0);
      for (DType d : {DType::kF32, DType::kBF16}) {
        for (comm::ReduceOp op :
             {comm::ReduceOp::kSum, comm::ReduceOp::kAvg, comm::ReduceOp::kMax}) {
          INFO("reduce " << DTypeName(d) << " op " << static_cast<int>(op));
          std::vector<std::vector<char>> srcs;
          std::vector<AtOffset> dsrcs;
          const void* ptrs[3];
          for (int k = 0; k < 3; ++k) {
            srcs.push_back(RandomValues(d, n, 500 + 7 * k + static_cast<uint32_t>(n), -8, 8));
            dsrcs.push_back(upload_at(srcs[k], k % 2 ? o2 : o1, d));
            ptrs[k] = dsrcs[k].p;
          }
          const std::vector<char> want = ReduceReference(d, srcs, n, static_cast<int>(op));
          REQUIRE(ops.reduce(ptrs, 3, dsrcs[0].p, n, d, op).ok());
          REQUIRE(Download(gpu, dsrcs[0].p, want.size()) == want);
        }
      }
    }
  }
}

TEST_CASE("CudaDevice: allocators, Copy and Zero across device, pinned and pageable memory",
          "[zero][gpu]") {
  Device* gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  REQUIRE(gpu->allocator(memory::MemoryKind::kPageableHost) == memory::HostAllocator());
  for (memory::MemoryKind kind : {memory::MemoryKind::kDevice, memory::MemoryKind::kPinnedHost,
                                  memory::MemoryKind::kPageableHost}) {
    for (size_t bytes : {size_t{1}, size_t{4095}, size_t{1} << 20, (size_t{1} << 24) + 13}) {
      INFO("kind " << static_cast<int>(kind) << " bytes " << bytes);
      memory::Allocation a = Alloc(gpu, kind, bytes);
      memory::Allocation b = Alloc(gpu, memory::MemoryKind::kDevice, bytes);
      REQUIRE(reinterpret_cast<uintptr_t>(a.get()) % 4096 == 0);
      const std::vector<char> pattern = RandomBits(bytes, static_cast<uint32_t>(bytes));
      REQUIRE(gpu->Copy(a.get(), pattern.data(), bytes, nullptr).ok());
      REQUIRE(gpu->Copy(b.get(), a.get(), bytes, nullptr).ok());
      REQUIRE(Download(gpu, b.get(), bytes) == pattern);
      REQUIRE(gpu->Zero(a.get(), bytes, nullptr).ok());
      REQUIRE(Download(gpu, a.get(), bytes) == std::vector<char>(bytes, 0));
    }
  }
  REQUIRE(gpu->allocator(memory::MemoryKind::kDevice)->Allocate(0).value() == nullptr);
  // More than any GPU has: ResourceExhausted, and the device keeps working afterwards.
  const auto huge = gpu->allocator(memory::MemoryKind::kDevice)->Allocate(size_t{1} << 50);
  REQUIRE(huge.status().code() == absl::StatusCode::kResourceExhausted);
  memory::Allocation c = Alloc(gpu, memory::MemoryKind::kDevice, 4096);
  REQUIRE(gpu->Zero(c.get(), 4096, nullptr).ok());
  REQUIRE(gpu->Synchronize(nullptr).ok());
}

TEST_CASE("CudaDevice: kernels accept pinned memory and refuse inaccessible pageable memory",
          "[zero][gpu]") {
  Device* gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  const size_t n = 5000;
  const std::vector<char> x = RandomValues(DType::kF32, n, 9);
  memory::Allocation pinned = Alloc(gpu, memory::MemoryKind::kPinnedHost, 4 * n);
  CopyBytes(pinned.get(), x.data(), 4 * n);
  float got = -1;
  REQUIRE(gpu->SquaredNorm(pinned.get(), DType::kF32, n, &got, nullptr).ok());
  REQUIRE(gpu->Synchronize(nullptr).ok());
  REQUIRE(Bits(got) == Bits(offload::SquaredNormF32(x.data(), DType::kF32, n, 1)));

  int pageable = 0;
  REQUIRE(cudaDeviceGetAttribute(&pageable, cudaDevAttrPageableMemoryAccess, 0) == cudaSuccess);
  const absl::Status s = gpu->SquaredNorm(x.data(), DType::kF32, n, &got, nullptr);
  if (pageable) {
    REQUIRE(s.ok());
  } else {
    REQUIRE(s.code() == absl::StatusCode::kInvalidArgument);
    REQUIRE(absl::StrContains(s.message(), "SquaredNorm"));
  }
  REQUIRE(gpu->Synchronize(nullptr).ok());
}

TEST_CASE("CudaDevice: two threads on two streams each get the CPU result", "[zero][gpu]") {
  Device* gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  const size_t n = 300007;
  // Buffers come from the main thread: Catch2's assertions are not thread-safe.
  memory::Allocation dx0 = Alloc(gpu, memory::MemoryKind::kDevice, 2 * n);
  memory::Allocation dx1 = Alloc(gpu, memory::MemoryKind::kDevice, 2 * n);
  memory::Allocation dy0 = Alloc(gpu, memory::MemoryKind::kDevice, 4 * n);
  memory::Allocation dy1 = Alloc(gpu, memory::MemoryKind::kDevice, 4 * n);
  memory::Allocation* dx[2] = {&dx0, &dx1};
  memory::Allocation* dy[2] = {&dy0, &dy1};
  auto work = [&](int t, cudaStream_t stream, float* norm, bool* ok) {
    const std::vector<char> x = RandomValues(DType::kBF16, n, 77 + t);
    *ok = gpu->Copy(dx[t]->get(), x.data(), x.size(), stream).ok() &&
          gpu->Cast(dx[t]->get(), DType::kBF16, dy[t]->get(), DType::kF32, n, stream).ok() &&
          gpu->SquaredNorm(dy[t]->get(), DType::kF32, n, norm, stream).ok() &&
          gpu->Synchronize(stream).ok();
  };
  cudaStream_t streams[2];
  for (cudaStream_t& s : streams) REQUIRE(cudaStreamCreate(&s) == cudaSuccess);
  float norms[2] = {-1, -1};
  bool oks[2] = {false, false};
  std::thread a(work, 0, streams[0], &norms[0], &oks[0]);
  std::thread b(work, 1, streams[1], &norms[1], &oks[1]);
  a.join();
  b.join();
  for (cudaStream_t s : streams) REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
  for (int t = 0; t < 2; ++t) {
    REQUIRE(oks[t]);
    const std::vector<char> x = RandomValues(DType::kBF16, n, 77 + t);
    std::vector<float> widened(n);
    offload::Cast(x.data(), DType::kBF16, widened.data(), DType::kF32, n, 1);
    REQUIRE(Bits(norms[t]) == Bits(offload::SquaredNormF32(widened.data(), DType::kF32, n, 1)));
  }
}


// Engine::Park's device half: a kDevice allocation gives its GPU memory back to the driver
// and keeps its address (cuMemUnmap + cuMemRelease), then gets new memory mapped at the same
// address (cuMemCreate + cuMemMap); the bytes saved to pinned memory come back bit for bit.
TEST_CASE("CudaDevice: kDevice memory decommits to the driver and recommits at the same address",
          "[zero][gpu][park]") {
  Device* gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  memory::RawAllocator* alloc = gpu->allocator(memory::MemoryKind::kDevice);
  REQUIRE(alloc->usage().has_value());
  constexpr size_t kBytes = (size_t{64} << 20) + 13;
  memory::Allocation a = Alloc(gpu, memory::MemoryKind::kDevice, kBytes);
  const memory::AllocatorUsage before = *alloc->usage();
  CHECK(before.resident_bytes >= kBytes);
  const std::vector<char> pattern = RandomBits(kBytes, 77);
  REQUIRE(gpu->Copy(a.get(), pattern.data(), kBytes, nullptr).ok());
  memory::Allocation host = Alloc(gpu, memory::MemoryKind::kPinnedHost, kBytes);
  REQUIRE(gpu->Copy(host.get(), a.get(), kBytes, nullptr).ok());
  REQUIRE(gpu->Synchronize(nullptr).ok());

  size_t free0 = 0, free1 = 0, total = 0;
  REQUIRE(cudaMemGetInfo(&free0, &total) == cudaSuccess);
  const absl::Status parked = alloc->Decommit(a.get(), kBytes);
  if (parked.code() == absl::StatusCode::kUnimplemented) {
    WARN("skipping: " << parked.message());
    return;
  }
  REQUIRE(parked.ok());
  REQUIRE(cudaMemGetInfo(&free1, &total) == cudaSuccess);
  const memory::AllocatorUsage during = *alloc->usage();
  const size_t released = before.resident_bytes - during.resident_bytes;
  CHECK(released >= kBytes);
  CHECK(during.reserved_bytes == before.reserved_bytes);
  // The driver's own count: the physical memory is free for another process.
  CHECK(free1 >= free0 + released);
  CHECK(alloc->Decommit(a.get(), kBytes).code() == absl::StatusCode::kFailedPrecondition);
  REQUIRE(gpu->ReleaseCachedMemory().ok());

  REQUIRE(alloc->Recommit(a.get(), kBytes).ok());
  CHECK(alloc->usage()->resident_bytes == before.resident_bytes);
  REQUIRE(gpu->Copy(a.get(), host.get(), kBytes, nullptr).ok());
  REQUIRE(Download(gpu, a.get(), kBytes) == pattern);
  // Kernels still see it as this GPU's memory.
  float norm = -1;
  REQUIRE(gpu->Zero(a.get(), 4096, nullptr).ok());
  REQUIRE(gpu->SquaredNorm(a.get(), DType::kF32, 1024, &norm, nullptr).ok());
  REQUIRE(gpu->Synchronize(nullptr).ok());
  CHECK(norm == 0.0f);
  // Freed while decommitted: the range goes too.
  REQUIRE(alloc->Decommit(a.get(), kBytes).ok());
  a = memory::Allocation();
  CHECK(alloc->usage()->reserved_bytes == before.reserved_bytes - released);
  CHECK(alloc->usage()->allocations == before.allocations - 1);
}

}  // namespace
}  // namespace zerort
