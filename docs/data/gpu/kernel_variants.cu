// Kernel variants measured side by side on a lent GPU (not part of the build).
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cstring>
#include "device/internal/cuda_elementwise.h"
#include "device/internal/cuda_math.h"
using namespace zerort;
using namespace zerort::cuda_internal;
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e_), __LINE__); exit(1);} } while (0)
constexpr int kT = 256;
constexpr size_t kNB = 1024;

template <class Op> __global__ void __launch_bounds__(kT) EK(Op op, size_t n, ElementSplit s) {
  ForEachChunk(s, n, (size_t)blockIdx.x * blockDim.x + threadIdx.x, (size_t)gridDim.x * blockDim.x, op);
}
// current norm
template <DType D> __global__ void Norm0(const void* __restrict__ x, size_t n, size_t nb, float* __restrict__ p) {
  size_t t = (size_t)blockIdx.x * blockDim.x + threadIdx.x; size_t b = t / kNormLanes; int lane = t % kNormLanes;
  float acc = 0.f;
  if (b < nb) { size_t bg = b * kNB; size_t en = bg + kNB < n ? bg + kNB : n; acc = NormLane<D>(x, bg, en, lane); }
  acc = Add(acc, __shfl_xor_sync(0xffffffffu, acc, 1));
  acc = Add(acc, __shfl_xor_sync(0xffffffffu, acc, 2));
  acc = Add(acc, __shfl_xor_sync(0xffffffffu, acc, 4));
  if (lane == 0 && b < nb) p[b] = acc;
}
// one thread per full norm block, 8 lane accumulators, 16-byte loads, rows unrolled by U.
template <DType D, int U> __global__ void __launch_bounds__(kT) Norm1(const void* __restrict__ x, size_t n, size_t nb, float* __restrict__ p) {
  size_t b = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= nb) return;
  size_t bg = b * kNB; size_t en = bg + kNB < n ? bg + kNB : n;
  float a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  using B = std::conditional_t<D == DType::kF32, float, uint16_t>;
  const B* base = static_cast<const B*>(x);
  if (en - bg == kNB && (reinterpret_cast<uintptr_t>(base + bg) % 16) == 0) {
    for (int r0 = 0; r0 < (int)(kNB / 8); r0 += U) {
      B v[U][8];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const B* q = base + bg + (size_t)(r0 + u) * 8;
        if constexpr (sizeof(B) == 4) { Load16(&v[u][0], q); Load16(&v[u][4], q + 4); }
        else Load16(&v[u][0], q);
      }
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int l = 0; l < 8; ++l) { float xi = LoadAs<D>(v[u], l); a[l] = Fma(xi, xi, a[l]); }
    }
  } else {
    for (int l = 0; l < 8; ++l) a[l] = NormLane<D>(x, bg, en, l);
  }
  p[b] = Add(Add(Add(a[0], a[1]), Add(a[2], a[3])), Add(Add(a[4], a[5]), Add(a[6], a[7])));
}

template <class K, class... A> unsigned Resident(K k) { int d; cudaGetDevice(&d); int sm; cudaDeviceGetAttribute(&sm, cudaDevAttrMultiProcessorCount, d); int per; cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, k, kT, 0); return sm * per; }

template <class F> float Time(F f, int reps) {
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  f(); f(); CK(cudaDeviceSynchronize());
  std::vector<float> ms;
  for (int r = 0; r < reps; ++r) { cudaEventRecord(a); f(); cudaEventRecord(b); CK(cudaEventSynchronize(b)); float m; cudaEventElapsedTime(&m, a, b); ms.push_back(m); }
  CK(cudaGetLastError());
  std::sort(ms.begin(), ms.end()); return ms[ms.size() / 2];
}

__global__ void Fill(uint32_t* w, size_t words, uint32_t seed) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    // finite values of modest magnitude in either interpretation: clear exponent top bits
    w[i] = h & 0x3fff3fffu;
  }
}

int main(int argc, char** argv) {
  std::vector<size_t> sizes = {100000000ull, 1000000000ull};
  int reps = 10;
  char* buf[3]; size_t cap = 4 * sizes.back() + 64;
  for (auto& b : buf) { CK(cudaMalloc(&b, cap)); Fill<<<1024, 256>>>((uint32_t*)b, cap / 4, 77); }
  float* part; CK(cudaMalloc(&part, (sizes.back() / kNB + 2) * 4)); float* part2; CK(cudaMalloc(&part2, (sizes.back() / kNB + 2) * 4));
  CK(cudaDeviceSynchronize());
  printf("%-44s %12s %10s %8s\n", "variant", "n", "ms", "frac");
  for (size_t n : sizes) {
    int reps_n = n > 200000000ull ? 5 : reps;
    float copy = Time([&] { cudaMemcpyAsync(buf[1], buf[0], 4 * n, cudaMemcpyDeviceToDevice); }, reps_n);
    double copy_bw = 8.0 * n / copy;  // bytes read+written per ms
    printf("%-44s %12zu %10.3f %8.3f\n", "d2d copy 4n bytes", n, copy, 1.0);
    auto report = [&](const char* name, float ms, double bytes) { printf("%-44s %12zu %10.3f %8.3f\n", name, n, ms, bytes / ms / copy_bw); };
    // ---- norms
    auto norms = [&](auto dt, const char* dname, size_t off) {
      constexpr DType D = decltype(dt)::value;
      size_t es = D == DType::kF32 ? 4 : 2;
      const void* x = buf[0] + off * es; size_t m = n - 16; size_t nb = (m + kNB - 1) / kNB;
      float t0 = Time([&] { Norm0<D><<<(unsigned)((nb * 8 + kT - 1) / kT), kT>>>(x, m, nb, part); }, reps_n);
      char nm[80]; snprintf(nm, 80, "norm0 %s off%zu", dname, off); report(nm, t0, (double)m * es);
      auto v1 = [&](auto uc) {
        constexpr int U = decltype(uc)::value;
        cudaMemset(part2, 0xff, nb * 4);
        float t1 = Time([&] { Norm1<D, U><<<(unsigned)((nb + kT - 1) / kT), kT>>>(x, m, nb, part2); }, reps_n);
        std::vector<uint32_t> h0(nb), h1(nb);
        cudaMemcpy(h0.data(), part, nb * 4, cudaMemcpyDeviceToHost); cudaMemcpy(h1.data(), part2, nb * 4, cudaMemcpyDeviceToHost);
        size_t diff = 0; for (size_t i = 0; i < nb; ++i) diff += h0[i] != h1[i];
        char nm2[80]; snprintf(nm2, 80, "norm1<U=%d> %s off%zu bitdiff=%zu", U, dname, off, diff); report(nm2, t1, (double)m * es);
      };
      v1(std::integral_constant<int, 2>{}); v1(std::integral_constant<int, 4>{}); v1(std::integral_constant<int, 8>{});
    };
    norms(std::integral_constant<DType, DType::kF32>{}, "fp32", 0);
    norms(std::integral_constant<DType, DType::kBF16>{}, "bf16", 0);
    norms(std::integral_constant<DType, DType::kF32>{}, "fp32", 1);
    // ---- casts / accumulate with grid caps
    auto elem = [&](auto op, const char* name, double bytes, VectorOperand* ops, int cnt) {
      using Op = decltype(op);
      ElementSplit s = SplitForVectors(ops, cnt, n);
      size_t want = (ChunkThreads(s, n) + kT - 1) / kT; unsigned lim = Resident(EK<Op>);
      for (unsigned mult : {1u, 2u, 4u, 0u}) {
        size_t g = mult == 0 ? want : std::min<size_t>(want, (size_t)lim * mult);
        float t = Time([&] { EK<Op><<<(unsigned)g, kT>>>(op, n, s); }, reps_n);
        char nm[80]; snprintf(nm, 80, "%s gridcap=%s", name, mult == 0 ? "none" : (mult == 1 ? "1x" : mult == 2 ? "2x" : "4x")); report(nm, t, bytes);
      }
    };
    { VectorOperand o[] = {{(uintptr_t)buf[0], 2}, {(uintptr_t)buf[1], 4}}; elem(CastOp<DType::kBF16, DType::kF32>{buf[0], buf[1]}, "cast bf16->fp32", 6.0 * n, o, 2); }
    { VectorOperand o[] = {{(uintptr_t)buf[0], 2}, {(uintptr_t)buf[1], 4}}; elem(CastOp<DType::kF16, DType::kF32>{buf[0], buf[1]}, "cast fp16->fp32", 6.0 * n, o, 2); }
    { VectorOperand o[] = {{(uintptr_t)buf[0], 4}, {(uintptr_t)buf[1], 2}}; elem(CastOp<DType::kF32, DType::kBF16>{buf[0], buf[1]}, "cast fp32->bf16", 6.0 * n, o, 2); }
    { VectorOperand o[] = {{(uintptr_t)buf[1], 4}, {(uintptr_t)buf[0], 4}}; elem(AccumulateOp<DType::kF32>{buf[1], buf[0]}, "accumulate fp32", 12.0 * n, o, 2); }
    { VectorOperand o[] = {{(uintptr_t)buf[1], 2}, {(uintptr_t)buf[0], 2}}; elem(AccumulateOp<DType::kBF16>{buf[1], buf[0]}, "accumulate bf16", 6.0 * n, o, 2); }
    CK(cudaDeviceSynchronize());
  }
  return 0;
}
