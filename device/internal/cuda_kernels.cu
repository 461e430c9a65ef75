// The CUDA device's kernels. The arithmetic of each element lives in cuda_math.h, the per-thread
// work of the elementwise kernels (alignment split, schedule, register chunks) in
// cuda_elementwise.h; both are shared with the host tests. This file maps threads to that work,
// sizes grids and dispatches on dtypes.
//
// Built without --use_fast_math (tools/cuda.bzl): denormals are kept (no flush to zero), like
// the host reference.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "device/internal/cuda_elementwise.h"
#include "device/internal/cuda_kernels.h"
#include "device/internal/cuda_math.h"
#include "device/internal/cuda_norm_batch.h"

namespace zerort {
namespace cuda_internal {
namespace {

constexpr int kThreads = 256;
// Must equal offload::kNormBlock (checked in cuda_device.cc, which can see both).
constexpr size_t kNormBlockElems = 1024;

cudaStream_t AsStream(void* stream) { return static_cast<cudaStream_t>(stream); }

__device__ __forceinline__ size_t GlobalThread() {
  return static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ size_t GridStride() {
  return static_cast<size_t>(gridDim.x) * blockDim.x;
}

// ------------------------------------------------------------------ grid size

// One thread per unit of work (ChunkThreads), not a grid capped at the blocks the GPU holds at
// once with each thread looping: measured side by side on an H100 (2026-11-26, 1e8 and 1e9
// elements, against a device-to-device copy of the same bytes), the capped grid ran the
// bf16 -> fp32 cast at 0.74-0.76, fp16 -> fp32 at 0.74-0.76, fp32 -> bf16 at 0.96 and
// accumulation at 0.94-0.96; uncapped 0.98, 0.98, 1.02 and 1.02-1.04, the same bits. A looping
// thread issues its next loads only after its previous chunk's stores; a new block starts with
// its loads. The grid-stride loops stay, for sizes past the grid's limit.
unsigned GridFor(size_t threads) {
  constexpr size_t kMaxBlocks = 0x7fffffff;  // gridDim.x
  const size_t want = (threads + kThreads - 1) / kThreads;
  return static_cast<unsigned>(want < kMaxBlocks ? want : kMaxBlocks);
}

VectorOperand Operand(const void* p, DType d) {
  return {reinterpret_cast<uintptr_t>(p), DTypeSize(d)};
}

// ------------------------------------------------------------------ elementwise

// Every elementwise kernel: a grid-stride loop over the chunks of cuda_elementwise.h's schedule,
// each applied by `op` (CastOp, AccumulateOp, ScaleOp, AdamWOp, ReduceRankOrderOp).
template <class Op>
__global__ void __launch_bounds__(kThreads) ElementwiseKernel(Op op, size_t n, ElementSplit split) {
  ForEachChunk(split, n, GlobalThread(), GridStride(), op);
}

// `operands`: every array the op reads or writes, for the alignment split.
template <class Op>
int LaunchElementwise(const Op& op, size_t n, const VectorOperand* operands, int count,
                      cudaStream_t s) {
  const ElementSplit split = SplitForVectors(operands, count, n);
  const unsigned grid = GridFor(ChunkThreads(split, n));
  ElementwiseKernel<Op><<<grid, kThreads, 0, s>>>(op, n, split);
  return static_cast<int>(cudaGetLastError());
}

// ------------------------------------------------------------------ squared norm

// One thread per (norm block, lane): 8 consecutive threads own one block of kNormBlockElems,
// so a warp covers four blocks and every load instruction reads four full 32-byte sectors.
template <DType D>
__global__ void NormBlocksKernel(const void* __restrict__ x, size_t n, size_t nblocks,
                                 float* __restrict__ partials) {
  const size_t t = GlobalThread();
  const size_t b = t / kNormLanes;
  const int lane = static_cast<int>(t % kNormLanes);
  float acc = 0.0f;
  if (b < nblocks) {
    const size_t begin = b * kNormBlockElems;
    const size_t end = begin + kNormBlockElems < n ? begin + kNormBlockElems : n;
    acc = NormLane<D>(x, begin, end, lane);
  }
  // The reference's tree ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)): xor-partners 1, 2, 4
  // pair exactly those operands, and fp addition is commutative, so lane 0 ends with the
  // reference's bits. Every thread of the warp takes part (no early return above).
  acc = Add(acc, __shfl_xor_sync(0xffffffffu, acc, 1));
  acc = Add(acc, __shfl_xor_sync(0xffffffffu, acc, 2));
  acc = Add(acc, __shfl_xor_sync(0xffffffffu, acc, 4));
  if (lane == 0 && b < nblocks) partials[b] = acc;
}

// offload::NormTreeSum's chunk (offload::kNormTreeChunk, checked in cuda_device.cc) and the
// threads that sum one: each thread adds its pair of the first step (stride 512).
constexpr size_t kTreeChunk = 1024;
constexpr int kTreeThreads = kTreeChunk / 2;

// One level of offload::NormTreeSum: block c writes the tree sum of in[c * 1024, +1024) (+0 past
// `count`) to out[c]. Thread i starts with in[i] + in[i + 512] (the stride-512 step, coalesced
// loads), strides 256, 128 and 64 pair slots through shared memory, warp 0 adds stride 32 from
// shared memory and the last five with shfl_down by `stride`, which hands lane i the value of
// lane i + stride: exactly the definition's pairs (fp addition is commutative, so only the
// pairing matters). Lanes at or past `stride` compute values nobody reads.
__device__ __forceinline__ void TreeChunk(const float* __restrict__ in, size_t count,
                                          size_t chunk, float* __restrict__ out) {
  __shared__ float slot[kTreeThreads];
  const int t = threadIdx.x;
  const size_t base = chunk * kTreeChunk;
  const size_t i = base + static_cast<size_t>(t);
  const float lo = i < count ? in[i] : 0.0f;
  const float hi = i + kTreeThreads < count ? in[i + kTreeThreads] : 0.0f;
  slot[t] = Add(lo, hi);
  __syncthreads();
  for (int stride = kTreeThreads / 2; stride > 32; stride /= 2) {
    if (t < stride) slot[t] = Add(slot[t], slot[t + stride]);
    __syncthreads();
  }
  if (t < 32) {
    float v = Add(slot[t], slot[t + 32]);
    for (int stride = 16; stride >= 1; stride /= 2) {
      v = Add(v, __shfl_down_sync(0xffffffffu, v, stride));
    }
    if (t == 0) out[chunk] = v;
  }
}

__global__ void __launch_bounds__(kTreeThreads)
    NormTreeLevelKernel(const float* __restrict__ in, size_t count, float* __restrict__ out) {
  TreeChunk(in, count, blockIdx.x, out);
}

// ------------------------------------------------------------------ batched norms

// cuda_norm_batch.h's block pass: NormBlocksKernel over the blocks of every range of `batch`
// (8 lanes per block, a warp's four blocks possibly of two ranges), with the finite flag.
// __grid_constant__: the batch is read in place in parameter space, indexed at run time.
template <DType D>
__global__ void __launch_bounds__(kThreads)
    BatchNormBlocksKernel(const __grid_constant__ BlockBatch batch) {
  const size_t t = GlobalThread();
  const size_t b = t / kNormLanes;
  const int lane = static_cast<int>(t % kNormLanes);
  float acc = 0.0f;
  bool bad = false;
  int j = 0;
  size_t local = 0;
  if (b < batch.blocks) {
    j = BlockEntryOf(batch, b);
    const BlockEntry& e = batch.e[j];
    local = b - e.first_block;
    const size_t begin = local * kNormBlockElems;
    const size_t end = begin + kNormBlockElems < e.n ? begin + kNormBlockElems : e.n;
    acc = NormLaneFinite<D>(e.x, begin, end, lane, &bad);
  }
  // The lane tree of NormBlocksKernel; the flags OR over the same partners.
  int any = bad ? 1 : 0;
  acc = Add(acc, __shfl_xor_sync(0xffffffffu, acc, 1));
  any |= __shfl_xor_sync(0xffffffffu, any, 1);
  acc = Add(acc, __shfl_xor_sync(0xffffffffu, acc, 2));
  any |= __shfl_xor_sync(0xffffffffu, any, 2);
  acc = Add(acc, __shfl_xor_sync(0xffffffffu, acc, 4));
  any |= __shfl_xor_sync(0xffffffffu, any, 4);
  if (lane == 0 && b < batch.blocks) {
    const BlockEntry& e = batch.e[j];
    e.partials[local] = acc;
    if (any) *e.finite = 0;  // concurrent stores all write the same 0
  }
}

__global__ void __launch_bounds__(kTreeThreads)
    BatchTreeLevelKernel(const __grid_constant__ TreeBatch batch) {
  const int j = ChunkEntryOf(batch, blockIdx.x);
  const TreeEntry& e = batch.e[j];
  TreeChunk(e.in, e.count, blockIdx.x - e.first_chunk, e.out);
}

size_t TreeChunks(size_t count) { return (count + kTreeChunk - 1) / kTreeChunk; }

// Enqueues every level of offload::NormTreeSum over values[0, count): the levels above the
// first go to scratch (each right after the previous), the single last value to *out.
// REQUIRES: count >= 2; scratch holds NormTreeScratch(count) floats.
cudaError_t LaunchTreeLevels(const float* values, size_t count, float* scratch, float* out,
                             cudaStream_t s) {
  while (count > 1) {
    const size_t chunks = TreeChunks(count);
    float* next = chunks == 1 ? out : scratch;
    NormTreeLevelKernel<<<static_cast<unsigned>(chunks), kTreeThreads, 0, s>>>(values, count, next);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    values = next;
    scratch += chunks;
    count = chunks;
  }
  return cudaSuccess;
}

// ------------------------------------------------------------------ finite check

// Read-only: each thread ORs its chunks' flags; one store per block at most (concurrent stores
// all write the same 0).
template <DType D>
__global__ void __launch_bounds__(kThreads)
    AllFiniteKernel(const void* __restrict__ x, size_t n, ElementSplit split,
                    unsigned char* finite) {
  int bad = 0;
  ForEachChunk(split, n, GlobalThread(), GridStride(), NonFiniteOp<D>{x, &bad});
  if (__syncthreads_or(bad) && threadIdx.x == 0) *finite = 0;
}

// ------------------------------------------------------------------ rank-order reduction

template <DType D, int kOp>
int LaunchReduceFor(const void* const* srcs, int n, void* dst, size_t count, cudaStream_t s) {
  ReduceRankOrderOp<D, kOp> op{};
  VectorOperand operands[kMaxReduceSources + 1];
  for (int k = 0; k < n; ++k) {
    op.srcs[k] = srcs[k];
    operands[k] = Operand(srcs[k], D);
  }
  op.n = n;
  op.dst = dst;
  operands[n] = Operand(dst, D);
  return LaunchElementwise(op, count, operands, n + 1, s);
}

}  // namespace

int LaunchReduceRankOrder(const void* const* srcs, int n, void* dst, size_t count, DType dtype,
                          int op, void* stream) {
  if (n < 1 || n > kMaxReduceSources || op < 0 || op > 2) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  if (count == 0) return static_cast<int>(cudaSuccess);
  const cudaStream_t s = AsStream(stream);
  int e = 0;
  WithDType(dtype, [&](auto d) {
    constexpr DType D = decltype(d)::value;
    switch (op) {
      case 0:
        e = LaunchReduceFor<D, 0>(srcs, n, dst, count, s);
        break;
      case 1:
        e = LaunchReduceFor<D, 1>(srcs, n, dst, count, s);
        break;
      default:
        e = LaunchReduceFor<D, 2>(srcs, n, dst, count, s);
        break;
    }
  });
  return e;
}

int LaunchCast(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t n,
               void* stream) {
  const VectorOperand operands[] = {Operand(src, src_dtype), Operand(dst, dst_dtype)};
  int e = 0;
  WithDType(src_dtype, [&](auto from) {
    WithDType(dst_dtype, [&](auto to) {
      e = LaunchElementwise(CastOp<decltype(from)::value, decltype(to)::value>{src, dst}, n,
                            operands, 2, AsStream(stream));
    });
  });
  return e;
}

int LaunchAccumulate(void* acc, const void* x, DType dtype, size_t n, void* stream) {
  const VectorOperand operands[] = {Operand(acc, dtype), Operand(x, dtype)};
  int e = 0;
  WithDType(dtype, [&](auto d) {
    e = LaunchElementwise(AccumulateOp<decltype(d)::value>{acc, x}, n, operands, 2,
                          AsStream(stream));
  });
  return e;
}

int LaunchScale(void* x, DType dtype, size_t n, float factor, void* stream) {
  const VectorOperand operands[] = {Operand(x, dtype)};
  int e = 0;
  WithDType(dtype, [&](auto d) {
    e = LaunchElementwise(ScaleOp<decltype(d)::value>{x, factor}, n, operands, 1,
                          AsStream(stream));
  });
  return e;
}

size_t NormBlocks(size_t n) { return (n + kNormBlockElems - 1) / kNormBlockElems; }

size_t NormTreeScratch(size_t count) {
  size_t floats = 0;
  for (count = TreeChunks(count); count > 1; count = TreeChunks(count)) floats += count;
  return floats;
}

size_t NormScratch(size_t n) {
  const size_t nblocks = NormBlocks(n);
  return nblocks == 1 ? 0 : nblocks + NormTreeScratch(nblocks);
}

int LaunchSquaredNorm(const void* x, DType dtype, size_t n, float* scratch, float* out,
                      void* stream) {
  const cudaStream_t s = AsStream(stream);
  const size_t nblocks = NormBlocks(n);
  // One block: its partial is the result (the tree of one value is that value).
  float* partials = nblocks == 1 ? out : scratch;
  const size_t threads = nblocks * kNormLanes;
  const unsigned grid = static_cast<unsigned>((threads + kThreads - 1) / kThreads);
  WithDType(dtype, [&](auto d) {
    NormBlocksKernel<decltype(d)::value><<<grid, kThreads, 0, s>>>(x, n, nblocks, partials);
  });
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return static_cast<int>(e);
  if (nblocks == 1) return static_cast<int>(cudaSuccess);
  return static_cast<int>(LaunchTreeLevels(partials, nblocks, scratch + nblocks, out, s));
}

int LaunchNormTreeSum(const float* values, size_t count, float* scratch, float* out, void* stream) {
  const cudaStream_t s = AsStream(stream);
  if (count == 1) {
    return static_cast<int>(cudaMemcpyAsync(out, values, sizeof(float), cudaMemcpyDefault, s));
  }
  return static_cast<int>(LaunchTreeLevels(values, count, scratch, out, s));
}

int LaunchNormBatches(const NormBatchPlan& plan, void* stream) {
  const cudaStream_t s = AsStream(stream);
  for (const BlockBatch& b : plan.blocks) {
    const size_t threads = b.blocks * kNormLanes;
    const unsigned grid = static_cast<unsigned>((threads + kThreads - 1) / kThreads);
    WithDType(b.dtype, [&](auto d) {
      BatchNormBlocksKernel<decltype(d)::value><<<grid, kThreads, 0, s>>>(b);
    });
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return static_cast<int>(e);
  }
  for (const TreeBatch& t : plan.levels) {
    BatchTreeLevelKernel<<<static_cast<unsigned>(t.chunks), kTreeThreads, 0, s>>>(t);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return static_cast<int>(e);
  }
  return static_cast<int>(cudaSuccess);
}

int LaunchAllFinite(const void* x, DType dtype, size_t n, unsigned char* finite, void* stream) {
  const VectorOperand operand = Operand(x, dtype);
  const ElementSplit split = SplitForVectors(&operand, 1, n);
  int e = 0;
  WithDType(dtype, [&](auto d) {
    constexpr DType D = decltype(d)::value;
    const unsigned grid = GridFor(ChunkThreads(split, n));
    AllFiniteKernel<D><<<grid, kThreads, 0, AsStream(stream)>>>(x, n, split, finite);
    e = static_cast<int>(cudaGetLastError());
  });
  return e;
}

int LaunchAdamW(const AdamWConstants& c, float* master, float* m, float* v, const void* grad,
                DType grad_dtype, void* param_out, DType param_dtype, size_t n, void* stream) {
  const cudaStream_t s = AsStream(stream);
  const VectorOperand operands[] = {Operand(master, DType::kF32), Operand(m, DType::kF32),
                                    Operand(v, DType::kF32), Operand(grad, grad_dtype),
                                    Operand(param_out, param_dtype)};
  const int count = param_out == nullptr ? 4 : 5;
  int e = 0;
  WithDType(grad_dtype, [&](auto g) {
    constexpr DType G = decltype(g)::value;
    if (param_out == nullptr) {  // no parameter copy: the P argument is unused
      e = LaunchElementwise(AdamWOp<G, DType::kF32, false>{c, master, m, v, grad, nullptr}, n,
                            operands, count, s);
      return;
    }
    WithDType(param_dtype, [&](auto p) {
      e = LaunchElementwise(AdamWOp<G, decltype(p)::value, true>{c, master, m, v, grad, param_out},
                            n, operands, count, s);
    });
  });
  return e;
}

int LaunchCompactAdamW(const AdamWConstants& c, const CompactAdamWArgs& a, void* stream) {
  VectorOperand operands[kMaxCompactOperands];
  const int count = CompactOperands(a, operands);
  int e = 0;
  WithCompactAdamWOp(c, a, [&](const auto& op) {
    e = LaunchElementwise(op, a.n, operands, count, AsStream(stream));
  });
  return e;
}

}  // namespace cuda_internal
}  // namespace zerort
