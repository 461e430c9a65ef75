// The GPT example's CUDA kernels. What each element computes is gpt_math.h's (shared with the
// host tests); this file maps rows and elements to threads, reduces in fixed orders and
// dispatches on the compute dtype. Loads and stores of parameters and compute-dtype tensors are
// base/dtype.h's LoadAs / StoreAs, the conversions the CPU backend and the engine use.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "base/dtype.h"
#include "examples/gpt/internal/gpt_kernels.h"
#include "examples/gpt/internal/gpt_math.h"

namespace zerort {
namespace examples {
namespace gpt {
namespace kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = kThreads / kWarp;
constexpr int64_t kMaxBlocks = int64_t{1} << 16;

unsigned GridFor(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

// One warp per row: enough blocks for every row (rows <= 2^31 * 8 by far).
unsigned GridForRows(int64_t rows) {
  return static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

cudaStream_t AsStream(void* stream) { return static_cast<cudaStream_t>(stream); }

__device__ __forceinline__ int64_t GlobalThread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t GridStride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// Butterfly reductions: every lane ends with the same value, in an order fixed by the lane
// layout alone.
__device__ __forceinline__ float WarpSum(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}
__device__ __forceinline__ float WarpMax(float v) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

// Block of kThreads: warp results through shared memory, combined by every thread in warp
// order. `scratch` holds kWarpsPerBlock floats; the call synchronizes the block twice.
template <bool kMax>
__device__ float BlockReduce(float v, float* scratch) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  v = kMax ? WarpMax(v) : WarpSum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = scratch[0];
  for (int w = 1; w < kWarpsPerBlock; ++w) r = kMax ? fmaxf(r, scratch[w]) : r + scratch[w];
  __syncthreads();  // scratch may be reused by the next reduction
  return r;
}

// Calls f(std::integral_constant<DType, D>) for the runtime dtype, then reports the launch.
template <typename F>
int Dispatch(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kF32:
      f(std::integral_constant<DType, DType::kF32>());
      break;
    case DType::kBF16:
      f(std::integral_constant<DType, DType::kBF16>());
      break;
    case DType::kF16:
      f(std::integral_constant<DType, DType::kF16>());
      break;
  }
  return static_cast<int>(cudaGetLastError());
}

// ---------------------------------------------------------------- embedding

template <DType D>
__global__ void EmbedForwardKernel(const int32_t* __restrict__ tokens, const void* wte,
                                   const void* wpe, int64_t n, int seq, int d,
                                   float* __restrict__ x) {
  for (int64_t idx = GlobalThread(); idx < n * d; idx += GridStride()) {
    const int64_t r = idx / d, i = idx % d;
    const int64_t tok = tokens[r];
    x[idx] = math::Embed(LoadAs<D>(wte, tok * d + i), LoadAs<D>(wpe, (r % seq) * d + i));
  }
}

template <DType D>
__global__ void PositionGradKernel(const float* __restrict__ dx, int batch, int seq, int context,
                                   int d, void* dwpe) {
  const int64_t total = static_cast<int64_t>(context) * d;
  for (int64_t idx = GlobalThread(); idx < total; idx += GridStride()) {
    const int64_t t = idx / d, i = idx % d;
    float acc = 0.0f;
    if (t < seq) {
      for (int b = 0; b < batch; ++b) acc += dx[(static_cast<int64_t>(b) * seq + t) * d + i];
    }
    StoreAs<D>(dwpe, idx, acc);
  }
}

__global__ void TokenGradAddKernel(const float* __restrict__ dx, const int32_t* __restrict__ uniq,
                                   const int32_t* __restrict__ starts,
                                   const int32_t* __restrict__ rows, int d,
                                   float* __restrict__ dwte) {
  const int k = blockIdx.x;
  const int64_t token = uniq[k];
  for (int i = threadIdx.x; i < d; i += blockDim.x) {
    float acc = dwte[token * d + i];
    for (int j = starts[k]; j < starts[k + 1]; ++j) acc += dx[static_cast<int64_t>(rows[j]) * d + i];
    dwte[token * d + i] = acc;
  }
}

// ---------------------------------------------------------------- LayerNorm

template <DType D>
__global__ void LayerNormForwardKernel(const float* __restrict__ x, const void* w, const void* b,
                                       int64_t rows, int d, void* y, float* __restrict__ mean,
                                       float* __restrict__ rstd) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= rows) return;
  const float* xr = x + r * d;
  float sum = 0.0f;
  for (int i = lane; i < d; i += kWarp) sum += xr[i];
  const float m = WarpSum(sum) / static_cast<float>(d);
  float sq = 0.0f;
  for (int i = lane; i < d; i += kWarp) sq += (xr[i] - m) * (xr[i] - m);
  const float s = math::LayerNormRstd(WarpSum(sq), d);
  for (int i = lane; i < d; i += kWarp) {
    StoreAs<D>(y, r * d + i, math::LayerNormOut(xr[i], m, s, LoadAs<D>(w, i), LoadAs<D>(b, i)));
  }
  if (lane == 0) {
    mean[r] = m;
    rstd[r] = s;
  }
}

template <DType D>
__global__ void LayerNormBackwardKernel(const float* __restrict__ dy, const float* __restrict__ x,
                                        const void* w, const float* __restrict__ mean,
                                        const float* __restrict__ rstd, int64_t rows, int d,
                                        bool accumulate, float* __restrict__ dres,
                                        void* dres_t) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (r >= rows) return;
  const float* g = dy + r * d;
  const float* xr = x + r * d;
  const float m = mean[r], s = rstd[r];
  float sum = 0.0f, dot = 0.0f;
  for (int i = lane; i < d; i += kWarp) {
    const float gw = g[i] * LoadAs<D>(w, i);
    sum += gw;
    dot += gw * math::LayerNormXhat(xr[i], m, s);
  }
  const float mean_gw = WarpSum(sum) / static_cast<float>(d);
  const float mean_gwx = WarpSum(dot) / static_cast<float>(d);
  for (int i = lane; i < d; i += kWarp) {
    const float dx = math::LayerNormDx(g[i], LoadAs<D>(w, i), math::LayerNormXhat(xr[i], m, s),
                                       mean_gw, mean_gwx, s);
    const float out = accumulate ? dres[r * d + i] + dx : dx;
    dres[r * d + i] = out;
    if (dres_t != nullptr) StoreAs<D>(dres_t, r * d + i, out);
  }
}

__global__ void LayerNormParamPartialsKernel(const float* __restrict__ dy,
                                             const float* __restrict__ x,
                                             const float* __restrict__ mean,
                                             const float* __restrict__ rstd, int64_t rows, int d,
                                             float* __restrict__ pw, float* __restrict__ pb) {
  const int64_t chunks = ColumnChunks(rows);
  for (int64_t idx = GlobalThread(); idx < chunks * d; idx += GridStride()) {
    const int64_t c = idx / d, j = idx % d;
    const int64_t end = (c + 1) * kColumnChunkRows < rows ? (c + 1) * kColumnChunkRows : rows;
    float sw = 0.0f, sb = 0.0f;
    for (int64_t r = c * kColumnChunkRows; r < end; ++r) {
      const float g = dy[r * d + j];
      sw += g * math::LayerNormXhat(x[r * d + j], mean[r], rstd[r]);
      sb += g;
    }
    pw[idx] = sw;
    pb[idx] = sb;
  }
}

// ---------------------------------------------------------------- column sums

__global__ void ColumnPartialsKernel(const float* __restrict__ a, int64_t rows, int cols,
                                     float* __restrict__ partials) {
  const int64_t chunks = ColumnChunks(rows);
  for (int64_t idx = GlobalThread(); idx < chunks * cols; idx += GridStride()) {
    const int64_t c = idx / cols, j = idx % cols;
    const int64_t end = (c + 1) * kColumnChunkRows < rows ? (c + 1) * kColumnChunkRows : rows;
    float s = 0.0f;
    for (int64_t r = c * kColumnChunkRows; r < end; ++r) s += a[r * cols + j];
    partials[idx] = s;
  }
}

template <DType D>
__global__ void ColumnFinalizeKernel(const float* __restrict__ partials, int64_t chunks, int cols,
                                     void* out) {
  for (int64_t j = GlobalThread(); j < cols; j += GridStride()) {
    float s = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) s += partials[c * cols + j];
    StoreAs<D>(out, j, s);
  }
}

// ---------------------------------------------------------------- elementwise

template <DType D>
__global__ void BiasResidualKernel(const float* __restrict__ y, const void* b,
                                   const float* __restrict__ residual, int64_t n, int cols,
                                   float* __restrict__ out) {
  for (int64_t idx = GlobalThread(); idx < n * cols; idx += GridStride()) {
    out[idx] = (y[idx] + LoadAs<D>(b, idx % cols)) + residual[idx];
  }
}

template <DType D>
__global__ void BiasGeluKernel(float* __restrict__ fc, const void* b, int64_t n, int cols,
                               void* gelu) {
  for (int64_t idx = GlobalThread(); idx < n * cols; idx += GridStride()) {
    const float v = fc[idx] + LoadAs<D>(b, idx % cols);
    fc[idx] = v;
    StoreAs<D>(gelu, idx, math::GeluForward(v));
  }
}

template <DType D>
__global__ void GeluBackwardKernel(const float* __restrict__ dy, const float* __restrict__ x,
                                   int64_t count, float* __restrict__ dx, void* dx_t) {
  for (int64_t idx = GlobalThread(); idx < count; idx += GridStride()) {
    const float g = math::GeluBackward(dy[idx], x[idx]);
    dx[idx] = g;
    if (dx_t != nullptr) StoreAs<D>(dx_t, idx, g);
  }
}

template <DType D>
__global__ void CastFromF32Kernel(const float* __restrict__ src, void* dst, int64_t count) {
  for (int64_t idx = GlobalThread(); idx < count; idx += GridStride()) StoreAs<D>(dst, idx, src[idx]);
}

// ---------------------------------------------------------------- attention

// Index of (b, h, t, j) in a (batch, heads, seq, hs) tensor.
__device__ __forceinline__ int64_t HeadIndex(int64_t b, int64_t h, int64_t t, int64_t j,
                                             int heads, int seq, int hs) {
  return ((b * heads + h) * seq + t) * hs + j;
}

template <DType D>
__global__ void QkvToHeadsKernel(const float* __restrict__ qkv, const void* bias, int batch,
                                 int seq, int d, int heads, void* q, void* k, void* v) {
  const int hs = d / heads;
  const int64_t total = static_cast<int64_t>(batch) * seq * 3 * d;
  for (int64_t idx = GlobalThread(); idx < total; idx += GridStride()) {
    const int64_t r = idx / (3 * d), c = idx % (3 * d);
    const int64_t which = c / d, h = (c % d) / hs, j = c % hs;
    const int64_t dst = HeadIndex(r / seq, h, r % seq, j, heads, seq, hs);
    const float value = qkv[idx] + LoadAs<D>(bias, c);
    StoreAs<D>(which == 0 ? q : which == 1 ? k : v, dst, value);
  }
}

template <DType D>
__global__ void CausalSoftmaxKernel(const float* __restrict__ preatt, int64_t bh, int seq,
                                    float scale, float* __restrict__ att, void* att_t) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= bh * seq) return;
  const int t = static_cast<int>(row % seq);
  const float* z = preatt + row * seq;
  float mx = -INFINITY;
  for (int u = lane; u < seq; u += kWarp) {
    if (math::Visible(t, u)) mx = fmaxf(mx, scale * z[u]);
  }
  mx = WarpMax(mx);
  float sum = 0.0f;
  for (int u = lane; u < seq; u += kWarp) {
    if (math::Visible(t, u)) sum += math::SoftmaxNumerator(scale * z[u], mx);
  }
  sum = WarpSum(sum);
  for (int u = lane; u < seq; u += kWarp) {
    const float p =
        math::Visible(t, u) ? math::SoftmaxProb(math::SoftmaxNumerator(scale * z[u], mx), sum)
                            : 0.0f;
    att[row * seq + u] = p;
    if (att_t != nullptr) StoreAs<D>(att_t, row * seq + u, p);
  }
}

template <DType D>
__global__ void CausalSoftmaxBackwardKernel(const float* __restrict__ att,
                                            const float* __restrict__ datt, int64_t bh, int seq,
                                            float scale, void* dpre) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  if (row >= bh * seq) return;
  const int t = static_cast<int>(row % seq);
  const float* p = att + row * seq;
  const float* dp = datt + row * seq;
  float pdp = 0.0f;
  for (int u = lane; u < seq; u += kWarp) {
    if (math::Visible(t, u)) pdp += p[u] * dp[u];
  }
  pdp = WarpSum(pdp);
  for (int u = lane; u < seq; u += kWarp) {
    const float g = math::Visible(t, u) ? math::SoftmaxBackward(p[u], dp[u], pdp, scale) : 0.0f;
    StoreAs<D>(dpre, row * seq + u, g);
  }
}

template <DType D>
__global__ void HeadsToRowsKernel(const float* __restrict__ in, int batch, int seq, int d,
                                  int heads, void* rows) {
  const int hs = d / heads;
  const int64_t total = static_cast<int64_t>(batch) * seq * d;
  for (int64_t idx = GlobalThread(); idx < total; idx += GridStride()) {
    const int64_t r = idx / d, c = idx % d;
    StoreAs<D>(rows, idx, in[HeadIndex(r / seq, c / hs, r % seq, c % hs, heads, seq, hs)]);
  }
}

template <DType D>
__global__ void RowsToHeadsKernel(const float* __restrict__ rows, int batch, int seq, int d,
                                  int heads, void* out) {
  const int hs = d / heads;
  const int64_t total = static_cast<int64_t>(batch) * seq * d;
  for (int64_t idx = GlobalThread(); idx < total; idx += GridStride()) {
    const int64_t r = idx / d, c = idx % d;
    StoreAs<D>(out, HeadIndex(r / seq, c / hs, r % seq, c % hs, heads, seq, hs), rows[idx]);
  }
}

template <DType D>
__global__ void HeadsToQkvKernel(const float* __restrict__ dq, const float* __restrict__ dk,
                                 const float* __restrict__ dv, int batch, int seq, int d,
                                 int heads, float* __restrict__ dqkv, void* dqkv_t) {
  const int hs = d / heads;
  const int64_t total = static_cast<int64_t>(batch) * seq * 3 * d;
  for (int64_t idx = GlobalThread(); idx < total; idx += GridStride()) {
    const int64_t r = idx / (3 * d), c = idx % (3 * d);
    const int64_t which = c / d, h = (c % d) / hs, j = c % hs;
    const float* src = which == 0 ? dq : which == 1 ? dk : dv;
    const float g = src[HeadIndex(r / seq, h, r % seq, j, heads, seq, hs)];
    dqkv[idx] = g;
    if (dqkv_t != nullptr) StoreAs<D>(dqkv_t, idx, g);
  }
}

// ---------------------------------------------------------------- cross-entropy

template <DType D>
__global__ void CrossEntropyKernel(const float* __restrict__ logits,
                                   const int32_t* __restrict__ targets, int vocab, float scale,
                                   float* __restrict__ losses, void* dlogits) {
  __shared__ float scratch[kWarpsPerBlock];
  const int64_t r = blockIdx.x;
  const float* z = logits + r * vocab;
  float mx = -INFINITY;
  for (int v = threadIdx.x; v < vocab; v += blockDim.x) mx = fmaxf(mx, z[v]);
  mx = BlockReduce<true>(mx, scratch);
  float sum = 0.0f;
  for (int v = threadIdx.x; v < vocab; v += blockDim.x) sum += math::SoftmaxNumerator(z[v], mx);
  sum = BlockReduce<false>(sum, scratch);
  const float lse = math::LogSumExp(mx, sum);
  const int target = targets[r];
  if (threadIdx.x == 0) losses[r] = math::CrossEntropyLoss(lse, z[target]);
  if (dlogits == nullptr) return;
  for (int v = threadIdx.x; v < vocab; v += blockDim.x) {
    StoreAs<D>(dlogits, r * vocab + v, math::CrossEntropyGrad(z[v], lse, v == target, scale));
  }
}

}  // namespace

int LaunchEmbedForward(const int32_t* tokens, const void* wte, const void* wpe, DType dtype,
                       int64_t n, int seq, int d, float* x, void* stream) {
  return Dispatch(dtype, [&](auto D) {
    EmbedForwardKernel<decltype(D)::value><<<GridFor(n * d), kThreads, 0, AsStream(stream)>>>(tokens, wte, wpe,
                                                                              n, seq, d, x);
  });
}

int LaunchPositionGrad(const float* dx, int batch, int seq, int context, int d, void* dwpe,
                       DType dtype, void* stream) {
  return Dispatch(dtype, [&](auto D) {
    PositionGradKernel<decltype(D)::value><<<GridFor(static_cast<int64_t>(context) * d), kThreads, 0,
                              AsStream(stream)>>>(dx, batch, seq, context, d, dwpe);
  });
}

int LaunchTokenGradAdd(const float* dx, const int32_t* uniq, const int32_t* starts,
                       const int32_t* rows, int num_tokens, int d, float* dwte, void* stream) {
  TokenGradAddKernel<<<num_tokens, kThreads, 0, AsStream(stream)>>>(dx, uniq, starts, rows, d,
                                                                    dwte);
  return static_cast<int>(cudaGetLastError());
}

int LaunchLayerNormForward(const float* x, const void* w, const void* b, DType dtype,
                           int64_t rows, int d, void* y, float* mean, float* rstd, void* stream) {
  return Dispatch(dtype, [&](auto D) {
    LayerNormForwardKernel<decltype(D)::value><<<GridForRows(rows), kThreads, 0, AsStream(stream)>>>(
        x, w, b, rows, d, y, mean, rstd);
  });
}

int LaunchLayerNormBackward(const float* dy, const float* x, const void* w, DType dtype,
                            const float* mean, const float* rstd, int64_t rows, int d,
                            bool accumulate, float* dres, void* dres_t, void* stream) {
  return Dispatch(dtype, [&](auto D) {
    LayerNormBackwardKernel<decltype(D)::value><<<GridForRows(rows), kThreads, 0, AsStream(stream)>>>(
        dy, x, w, mean, rstd, rows, d, accumulate, dres, dres_t);
  });
}

int LaunchLayerNormParamPartials(const float* dy, const float* x, const float* mean,
                                 const float* rstd, int64_t rows, int d, float* partials_w,
                                 float* partials_b, void* stream) {
  LayerNormParamPartialsKernel<<<GridFor(ColumnChunks(rows) * d), kThreads, 0,
                                 AsStream(stream)>>>(dy, x, mean, rstd, rows, d, partials_w,
                                                     partials_b);
  return static_cast<int>(cudaGetLastError());
}

int LaunchColumnPartials(const float* a, int64_t rows, int cols, float* partials, void* stream) {
  ColumnPartialsKernel<<<GridFor(ColumnChunks(rows) * cols), kThreads, 0, AsStream(stream)>>>(
      a, rows, cols, partials);
  return static_cast<int>(cudaGetLastError());
}

int LaunchColumnFinalize(const float* partials, int64_t chunks, int cols, void* out,
                         DType dtype, void* stream) {
  return Dispatch(dtype, [&](auto D) {
    ColumnFinalizeKernel<decltype(D)::value><<<GridFor(cols), kThreads, 0, AsStream(stream)>>>(partials, chunks,
                                                                                cols, out);
  });
}

int LaunchBiasResidual(const float* y, const void* b, DType dtype, const float* residual,
                       int64_t n, int cols, float* out, void* stream) {
  return Dispatch(dtype, [&](auto D) {
    BiasResidualKernel<decltype(D)::value><<<GridFor(n * cols), kThreads, 0, AsStream(stream)>>>(
        y, b, residual, n, cols, out);
  });
}

int LaunchBiasGelu(float* fc, const void* b, DType dtype, int64_t n, int cols, void* gelu,
                   void* stream) {
  return Dispatch(dtype, [&](auto D) {
    BiasGeluKernel<decltype(D)::value><<<GridFor(n * cols), kThreads, 0, AsStream(stream)>>>(fc, b, n, cols,
                                                                              gelu);
  });
}

int LaunchGeluBackward(const float* dy, const float* x, int64_t count, float* dx, void* dx_t,
                       DType dtype, void* stream) {
  return Dispatch(dtype, [&](auto D) {
    GeluBackwardKernel<decltype(D)::value><<<GridFor(count), kThreads, 0, AsStream(stream)>>>(dy, x, count, dx,
                                                                              dx_t);
  });
}

int LaunchCastFromF32(const float* src, void* dst, DType dtype, int64_t count, void* stream) {
  return Dispatch(dtype, [&](auto D) {
    CastFromF32Kernel<decltype(D)::value><<<GridFor(count), kThreads, 0, AsStream(stream)>>>(src, dst, count);
  });
}

int LaunchQkvToHeads(const float* qkv, const void* bias, DType dtype, int batch, int seq, int d,
                     int heads, void* q, void* k, void* v, void* stream) {
  return Dispatch(dtype, [&](auto D) {
    QkvToHeadsKernel<decltype(D)::value><<<GridFor(static_cast<int64_t>(batch) * seq * 3 * d), kThreads, 0,
                            AsStream(stream)>>>(qkv, bias, batch, seq, d, heads, q, k, v);
  });
}

int LaunchCausalSoftmax(const float* preatt, int64_t bh, int seq, float scale, float* att,
                        void* att_t, DType dtype, void* stream) {
  return Dispatch(dtype, [&](auto D) {
    CausalSoftmaxKernel<decltype(D)::value><<<GridForRows(bh * seq), kThreads, 0, AsStream(stream)>>>(
        preatt, bh, seq, scale, att, att_t);
  });
}

int LaunchCausalSoftmaxBackward(const float* att, const float* datt, int64_t bh, int seq,
                                float scale, void* dpre, DType dtype, void* stream) {
  return Dispatch(dtype, [&](auto D) {
    CausalSoftmaxBackwardKernel<decltype(D)::value><<<GridForRows(bh * seq), kThreads, 0, AsStream(stream)>>>(
        att, datt, bh, seq, scale, dpre);
  });
}

int LaunchHeadsToRows(const float* heads_in, int batch, int seq, int d, int heads, void* rows,
                      DType dtype, void* stream) {
  return Dispatch(dtype, [&](auto D) {
    HeadsToRowsKernel<decltype(D)::value><<<GridFor(static_cast<int64_t>(batch) * seq * d), kThreads, 0,
                             AsStream(stream)>>>(heads_in, batch, seq, d, heads, rows);
  });
}

int LaunchRowsToHeads(const float* rows, int batch, int seq, int d, int heads, void* heads_out,
                      DType dtype, void* stream) {
  return Dispatch(dtype, [&](auto D) {
    RowsToHeadsKernel<decltype(D)::value><<<GridFor(static_cast<int64_t>(batch) * seq * d), kThreads, 0,
                             AsStream(stream)>>>(rows, batch, seq, d, heads, heads_out);
  });
}

int LaunchHeadsToQkv(const float* dq, const float* dk, const float* dv, int batch, int seq,
                     int d, int heads, float* dqkv, void* dqkv_t, DType dtype, void* stream) {
  return Dispatch(dtype, [&](auto D) {
    HeadsToQkvKernel<decltype(D)::value><<<GridFor(static_cast<int64_t>(batch) * seq * 3 * d), kThreads, 0,
                            AsStream(stream)>>>(dq, dk, dv, batch, seq, d, heads, dqkv, dqkv_t);
  });
}

int LaunchCrossEntropy(const float* logits, const int32_t* targets, int64_t n, int vocab,
                       float scale, float* losses, void* dlogits, DType dtype, void* stream) {
  return Dispatch(dtype, [&](auto D) {
    CrossEntropyKernel<decltype(D)::value><<<static_cast<unsigned>(n), kThreads, 0, AsStream(stream)>>>(
        logits, targets, vocab, scale, losses, scale != 0 ? dlogits : nullptr);
  });
}

}  // namespace kernels
}  // namespace gpt
}  // namespace examples
}  // namespace zerort
