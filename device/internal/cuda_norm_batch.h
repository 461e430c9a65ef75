// Many squared norms and finite checks in a few launches (Device::SquaredNormsAndFinite on the CUDA
// device), written once for nvcc's device pass and for the host compiler, like cuda_elementwise.h.
//
// Why: the engine measures every unit's reduced gradient each step, and one SquaredNorm plus one
// AllFinite per unit cost about 40 us of device time per unit whatever its size (an H200,
// 2026-11-26: 2.2 ms of a 4.6 ms step for GPT-2 124M's shapes at 51 units), the GPU waiting on the
// host's per-call work (a scratch allocation, pointer queries, four launches, two copies). Here all
// ranges go through one scratch allocation, one launch of the block pass per batch of up to
// kNormBatch ranges of one dtype, one launch per tree level per batch, and two copies.
//
// Exactness: every range is cut, laned and summed exactly as offload::SquaredNormF32 (its block
// partials by the same NormLane chain and lane tree as the single-range kernel, then
// offload::NormTreeSum's levels, a range's levels in its own chunks), so each result equals the
// range's SquaredNorm bit for bit. The finite flag is AllFinite's verdict: every element is read as
// the float LoadAs gives, which is Inf or NaN exactly when the element is (bf16 and fp16 widen
// exactly, Inf and NaN included).
//
// The plan (PlanNormBatches) is host code; the per-thread lookups (BlockEntryOf, ChunkEntryOf) and the
// lane work (NormLaneFinite) are shared with the host tests, which replay every launch of a plan
// over simulated grids against offload::SquaredNormF32 and the CPU device's AllFinite.
//
// Thread safety: pure functions.
#ifndef ZERORT_DEVICE_INTERNAL_CUDA_NORM_BATCH_H_
#define ZERORT_DEVICE_INTERNAL_CUDA_NORM_BATCH_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "base/dtype.h"
#include "device/internal/cuda_math.h"

namespace zerort {
namespace cuda_internal {

// Ranges per launch: the batch travels by value as the kernel's parameter (at most 4 KiB).
inline constexpr int kNormBatch = 64;
// Elements per block partial and values per tree chunk (offload::kNormBlock, kNormTreeChunk;
// cuda_device.cc checks that they agree).
inline constexpr size_t kBatchNormBlock = 1024;
inline constexpr size_t kBatchTreeChunk = 1024;

// One range of the block pass: its blocks are first_block .. first_block + NormBlocks(n) - 1 of the
// launch's.
struct BlockEntry {
  const void* x;
  size_t n;
  size_t first_block;
  float* partials;        // one per block (the range's result when it has one block)
  unsigned char* finite;  // preset to 1; cleared when an element is Inf or NaN
};

// One launch of the block pass, every range of one dtype.
struct BlockBatch {
  DType dtype;
  int count;
  size_t blocks;  // sum of the ranges' blocks
  BlockEntry e[kNormBatch];
};

// One range's part of one tree level: in[0, count) summed per chunk of kBatchTreeChunk into out[0,
// chunks) (out is the range's result at its last level).
struct TreeEntry {
  const float* in;
  size_t count;
  size_t first_chunk;
  float* out;
};

struct TreeBatch {
  int count;
  size_t chunks;
  TreeEntry e[kNormBatch];
};

static_assert(sizeof(BlockBatch) <= 4096 && sizeof(TreeBatch) <= 4096,
              "a batch must fit the kernel parameter space");

ZERORT_HD size_t BatchBlocks(size_t n) { return (n + kBatchNormBlock - 1) / kBatchNormBlock; }
ZERORT_HD size_t BatchChunks(size_t count) {
  return (count + kBatchTreeChunk - 1) / kBatchTreeChunk;
}

// The last entry of `batch` whose `*First` is at most `at` (entries are in increasing order of it):
// the range holding the launch's block or chunk `at`.
template <class Entry, size_t Entry::*First, class Batch>
ZERORT_HD int LastEntryAtOrBelow(const Batch& batch, size_t at) {
  int lo = 0, hi = batch.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (batch.e[mid].*First <= at) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// The entry holding the launch's block b (b < batch.blocks), and chunk c (c < batch.chunks).
ZERORT_HD int BlockEntryOf(const BlockBatch& batch, size_t b) {
  return LastEntryAtOrBelow<BlockEntry, &BlockEntry::first_block>(batch, b);
}
ZERORT_HD int ChunkEntryOf(const TreeBatch& batch, size_t c) {
  return LastEntryAtOrBelow<TreeEntry, &TreeEntry::first_chunk>(batch, c);
}

// NormLane (the same fma chain over the same elements), and whether one of them is Inf or NaN.
template <DType D>
ZERORT_HD float NormLaneFinite(const void* x, size_t begin, size_t end, int lane, bool* bad) {
  float acc = 0.0f;
  bool any = false;
#if defined(__CUDA_ARCH__)
#pragma unroll 8
#endif
  for (size_t i = begin + static_cast<size_t>(lane); i < end; i += kNormLanes) {
    const float xi = LoadAs<D>(x, i);
    any = any || (FloatBits(xi) & 0x7f800000u) == 0x7f800000u;
    acc = Fma(xi, xi, acc);
  }
  *bad = any;
  return acc;
}

// One range for PlanNormBatches.
struct NormRangeSpec {
  const void* x;
  DType dtype;
  size_t n;
};

// Every launch of one SquaredNormsAndFinite call, in stream order: the block batches, then the tree
// levels (level l of every range before level l + 1 of any).
struct NormBatchPlan {
  std::vector<BlockBatch> blocks;
  std::vector<TreeBatch> levels;
  size_t scratch_floats = 0;  // partials and intermediate levels
};

// Floats of scratch PlanNormBatches needs for `ranges`.
inline size_t NormBatchScratch(const NormRangeSpec* ranges, int count) {
  size_t floats = 0;
  for (int i = 0; i < count; ++i) {
    size_t c = BatchBlocks(ranges[i].n);
    if (c < 2) continue;  // no block (n == 0) or one: straight into the result
    floats += c;
    for (c = BatchChunks(c); c > 1; c = BatchChunks(c)) floats += c;
  }
  return floats;
}

// The launches for `count` ranges: range i's squared norm lands in results[i] and its verdict in
// finite[i]. REQUIRES: results[i] preset to +0 (a range of n == 0 is never written), finite[i] to
// 1; scratch holds NormBatchScratch(ranges, count) floats. Pure host arithmetic on the pointers:
// the memory may be device memory.
inline NormBatchPlan PlanNormBatches(const NormRangeSpec* ranges, int count, float* scratch,
                                     float* results, unsigned char* finite) {
  NormBatchPlan plan;
  struct Pending {
    const float* in;
    size_t count;
    float* result;
  };
  std::vector<Pending> pending;  // ranges whose partials still need the tree
  float* next = scratch;
  for (int i = 0; i < count; ++i) {
    const size_t blocks = BatchBlocks(ranges[i].n);
    if (blocks == 0) continue;
    BlockBatch* b = plan.blocks.empty() ? nullptr : &plan.blocks.back();
    if (b == nullptr || b->dtype != ranges[i].dtype || b->count == kNormBatch) {
      plan.blocks.emplace_back();
      b = &plan.blocks.back();
      b->dtype = ranges[i].dtype;
      b->count = 0;
      b->blocks = 0;
    }
    float* partials = results + i;
    if (blocks > 1) {
      partials = next;
      next += blocks;
      pending.push_back({partials, blocks, results + i});
    }
    b->e[b->count++] = {ranges[i].x, ranges[i].n, b->blocks, partials, finite + i};
    b->blocks += blocks;
  }
  while (!pending.empty()) {
    std::vector<Pending> later;
    TreeBatch* t = nullptr;
    for (const Pending& p : pending) {
      if (t == nullptr || t->count == kNormBatch) {
        plan.levels.emplace_back();
        t = &plan.levels.back();
        t->count = 0;
        t->chunks = 0;
      }
      const size_t chunks = BatchChunks(p.count);
      float* out = p.result;
      if (chunks > 1) {
        out = next;
        next += chunks;
        later.push_back({out, chunks, p.result});
      }
      t->e[t->count++] = {p.in, p.count, t->chunks, out};
      t->chunks += chunks;
    }
    pending.swap(later);
  }
  plan.scratch_floats = static_cast<size_t>(next - scratch);
  return plan;
}

}  // namespace cuda_internal
}  // namespace zerort

#endif  // ZERORT_DEVICE_INTERNAL_CUDA_NORM_BATCH_H_
