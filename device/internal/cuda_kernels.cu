// The CUDA device's kernels. The arithmetic of each element lives in cuda_math.h (shared with the
// host tests); this file only maps elements to threads and dispatches on dtypes.
//
// Built without --use_fast_math (tools/cuda.bzl): denormals are kept (no flush to zero), like
// the host reference.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "device/internal/cuda_kernels.h"
#include "device/internal/cuda_math.h"

namespace zerort {
namespace cuda_internal {
namespace {

constexpr int kThreads = 256;
// Grid-stride loops: more blocks than this only adds scheduling work (an H200 holds about
// 132 SMs x 8 blocks of 256 threads at once).
constexpr size_t kMaxBlocks = size_t{1} << 16;
// Must equal offload::kNormBlock (checked in cuda_device.cc, which can see both).
constexpr size_t kNormBlockElems = 1024;

unsigned GridFor(size_t n) {
  const size_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

cudaStream_t AsStream(void* stream) { return static_cast<cudaStream_t>(stream); }

__device__ __forceinline__ size_t GlobalThread() {
  return static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ size_t GridStride() {
  return static_cast<size_t>(gridDim.x) * blockDim.x;
}

// ------------------------------------------------------------------ elementwise

template <DType S, DType D>
__global__ void CastKernel(const void* __restrict__ src, void* __restrict__ dst, size_t n) {
  for (size_t i = GlobalThread(); i < n; i += GridStride()) StoreAs<D>(dst, i, LoadAs<S>(src, i));
}

template <DType D>
__global__ void AccumulateKernel(void* acc, const void* x, size_t n) {
  for (size_t i = GlobalThread(); i < n; i += GridStride()) {
    StoreAs<D>(acc, i, Add(LoadAs<D>(acc, i), LoadAs<D>(x, i)));
  }
}

// master carries no __restrict__: param_out may alias it when the param dtype is fp32.
template <DType G, DType P, bool kOut>
__global__ void AdamWKernel(AdamWConstants c, float* master, float* __restrict__ m,
                            float* __restrict__ v, const void* __restrict__ grad,
                            void* param_out, size_t n) {
  for (size_t i = GlobalThread(); i < n; i += GridStride()) {
    AdamWElement<G, P, kOut>(c, master, m, v, grad, param_out, i);
  }
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

constexpr int kSumThreads = 1024;

// The block order of the reference is a serial chain of additions: one thread adds, the block
// only stages the partials through shared memory so that its loads are coalesced. At 1024
// elements per partial this is 1/1024 of the first kernel's loads.
__global__ void SumInOrderKernel(const float* __restrict__ partials, size_t count,
                                 float* __restrict__ out) {
  __shared__ float chunk[kSumThreads];
  float total = 0.0f;
  for (size_t base = 0; base < count; base += kSumThreads) {
    const size_t len = count - base < kSumThreads ? count - base : kSumThreads;
    if (threadIdx.x < len) chunk[threadIdx.x] = partials[base + threadIdx.x];
    __syncthreads();
    if (threadIdx.x == 0) {
      for (size_t i = 0; i < len; ++i) total = Add(total, chunk[i]);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = total;
}

// ------------------------------------------------------------------ finite check

template <DType D>
__global__ void AllFiniteKernel(const void* __restrict__ x, size_t n, unsigned char* finite) {
  int bad = 0;
  for (size_t i = GlobalThread(); i < n; i += GridStride()) bad |= IsNonFinite<D>(x, i);
  // One store per block at most; concurrent stores all write the same 0.
  if (__syncthreads_or(bad) && threadIdx.x == 0) *finite = 0;
}

// ------------------------------------------------------------------ dispatch

// Calls f(std::integral_constant<DType, D>{}) for the run-time dtype d = D: the one switch
// from a launcher's dtype argument to the kernel instance (decltype(tag)::value).
template <typename F>
void WithDType(DType d, F&& f) {
  switch (d) {
    case DType::kF32:
      f(std::integral_constant<DType, DType::kF32>{});
      break;
    case DType::kBF16:
      f(std::integral_constant<DType, DType::kBF16>{});
      break;
    case DType::kF16:
      f(std::integral_constant<DType, DType::kF16>{});
      break;
  }
}

// ------------------------------------------------------------------ rank-order reduction

struct ReduceSources {
  const void* p[kMaxReduceSources];
};

template <DType D>
__device__ __forceinline__ void StoreCanonical(void* dst, size_t i, float acc) {
  if (acc != acc) {  // NaN: one fixed pattern, whichever input's payload an add carried
    if constexpr (D == DType::kF32) {
      static_cast<uint32_t*>(dst)[i] = 0x7fc00000u;
    } else {
      static_cast<uint16_t*>(dst)[i] = D == DType::kBF16 ? 0x7fc0u : 0x7e00u;
    }
  } else {
    StoreAs<D>(dst, i, acc);
  }
}

// kOp: 0 sum, 1 avg, 2 max. Each thread reads element i of every source before writing dst[i],
// so dst may alias a source at the same offsets.
template <DType D, int kOp>
__global__ void ReduceRankOrderKernel(ReduceSources srcs, int n, void* dst, size_t count) {
  for (size_t i = GlobalThread(); i < count; i += GridStride()) {
    float acc = LoadAs<D>(srcs.p[0], i);
    for (int k = 1; k < n; ++k) {
      const float x = LoadAs<D>(srcs.p[k], i);
      if constexpr (kOp == 2) {
        acc = (acc > x || acc != acc) ? acc : x;
      } else {
        acc = Add(acc, x);
      }
    }
    if constexpr (kOp == 1) acc = Div(acc, static_cast<float>(n));
    StoreCanonical<D>(dst, i, acc);
  }
}

template <DType D>
void LaunchReduceFor(const ReduceSources& srcs, int n, void* dst, size_t count, int op,
                     cudaStream_t s) {
  switch (op) {
    case 0:
      ReduceRankOrderKernel<D, 0><<<GridFor(count), kThreads, 0, s>>>(srcs, n, dst, count);
      break;
    case 1:
      ReduceRankOrderKernel<D, 1><<<GridFor(count), kThreads, 0, s>>>(srcs, n, dst, count);
      break;
    default:
      ReduceRankOrderKernel<D, 2><<<GridFor(count), kThreads, 0, s>>>(srcs, n, dst, count);
      break;
  }
}

}  // namespace

int LaunchReduceRankOrder(const void* const* srcs, int n, void* dst, size_t count, DType dtype,
                          int op, void* stream) {
  if (n < 1 || n > kMaxReduceSources || op < 0 || op > 2) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  if (count == 0) return static_cast<int>(cudaSuccess);
  ReduceSources s{};
  for (int k = 0; k < n; ++k) s.p[k] = srcs[k];
  WithDType(dtype, [&](auto d) {
    LaunchReduceFor<decltype(d)::value>(s, n, dst, count, op, AsStream(stream));
  });
  return static_cast<int>(cudaGetLastError());
}

int LaunchCast(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t n,
               void* stream) {
  const cudaStream_t s = AsStream(stream);
  WithDType(src_dtype, [&](auto from) {
    WithDType(dst_dtype, [&](auto to) {
      CastKernel<decltype(from)::value, decltype(to)::value>
          <<<GridFor(n), kThreads, 0, s>>>(src, dst, n);
    });
  });
  return static_cast<int>(cudaGetLastError());
}

int LaunchAccumulate(void* acc, const void* x, DType dtype, size_t n, void* stream) {
  const cudaStream_t s = AsStream(stream);
  WithDType(dtype, [&](auto d) {
    AccumulateKernel<decltype(d)::value><<<GridFor(n), kThreads, 0, s>>>(acc, x, n);
  });
  return static_cast<int>(cudaGetLastError());
}

size_t NormBlocks(size_t n) { return (n + kNormBlockElems - 1) / kNormBlockElems; }

int LaunchSquaredNorm(const void* x, DType dtype, size_t n, float* partials, float* out,
                      void* stream) {
  const cudaStream_t s = AsStream(stream);
  const size_t nblocks = NormBlocks(n);
  const size_t threads = nblocks * kNormLanes;
  const unsigned grid = static_cast<unsigned>((threads + kThreads - 1) / kThreads);
  WithDType(dtype, [&](auto d) {
    NormBlocksKernel<decltype(d)::value><<<grid, kThreads, 0, s>>>(x, n, nblocks, partials);
  });
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return static_cast<int>(e);
  SumInOrderKernel<<<1, kSumThreads, 0, s>>>(partials, nblocks, out);
  return static_cast<int>(cudaGetLastError());
}

int LaunchAllFinite(const void* x, DType dtype, size_t n, unsigned char* finite, void* stream) {
  const cudaStream_t s = AsStream(stream);
  WithDType(dtype, [&](auto d) {
    AllFiniteKernel<decltype(d)::value><<<GridFor(n), kThreads, 0, s>>>(x, n, finite);
  });
  return static_cast<int>(cudaGetLastError());
}

int LaunchAdamW(const AdamWConstants& c, float* master, float* m, float* v, const void* grad,
                DType grad_dtype, void* param_out, DType param_dtype, size_t n, void* stream) {
  const cudaStream_t s = AsStream(stream);
  WithDType(grad_dtype, [&](auto g) {
    constexpr DType G = decltype(g)::value;
    if (param_out == nullptr) {  // no parameter copy: the P argument is unused
      AdamWKernel<G, DType::kF32, false>
          <<<GridFor(n), kThreads, 0, s>>>(c, master, m, v, grad, param_out, n);
      return;
    }
    WithDType(param_dtype, [&](auto p) {
      AdamWKernel<G, decltype(p)::value, true>
          <<<GridFor(n), kThreads, 0, s>>>(c, master, m, v, grad, param_out, n);
    });
  });
  return static_cast<int>(cudaGetLastError());
}

}  // namespace cuda_internal
}  // namespace zerort
