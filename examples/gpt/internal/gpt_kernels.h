// Launchers of the GPT example's CUDA kernels (examples/gpt/internal/gpt_kernels.cu), for the
// CUDA backend (examples/gpt/internal/cuda_model.cc). Matrix products are cuBLAS calls made
// there; these are the rest: embedding, LayerNorm, bias + GELU, causal softmax, the head
// layouts of attention, cross-entropy, column sums, and their backward passes.
//
// A plain C++ header: no CUDA types. Streams travel as void* (a cudaStream_t); each launcher only
// enqueues and returns the cudaError_t (as int, 0 = success) that cudaGetLastError() reported
// right after its launch, which the caller turns into a Status.
//
// Layouts: N = batch * seq rows, row r = (b, t) = (r / seq, r % seq). Activations are fp32
// (`float*`); tensors that feed a matrix product are in the compute dtype `dtype` (`void*`, fp32,
// bf16 or fp16 bits), as are parameters and gradient buffers. Heads: (batch, heads, seq, hs),
// hs = d / heads. Linear weights are (in, out) as in GPT-2.
//
// Determinism: every output element is computed by one thread in a fixed order, and every
// reduction has an order fixed by the shapes alone (no atomics), so a pass is a pure function
// of its inputs; stages and ranks then compare bit for bit.
//
// REQUIRES (all): the owning device is current; pointers are device memory of the sizes stated;
// n, rows, cols > 0. Thread-safe: launches may come from any threads, on any streams.
#ifndef ZERORT_EXAMPLES_GPT_INTERNAL_GPT_KERNELS_H_
#define ZERORT_EXAMPLES_GPT_INTERNAL_GPT_KERNELS_H_

#include <cstdint>

#include "base/dtype.h"

namespace zerort {
namespace examples {
namespace gpt {
namespace kernels {

// ---------------------------------------------------------------- embedding

// x (n, d) = wte[tokens[r]] + wpe[r % seq]; wte (vocab, d), wpe (context, d) in dtype.
int LaunchEmbedForward(const int32_t* tokens, const void* wte, const void* wpe, DType dtype,
                       int64_t n, int seq, int d, float* x, void* stream);
// dwpe (context, d) in dtype: row t < seq = sum over b in order of dx[b * seq + t], rows
// t >= seq zero.
int LaunchPositionGrad(const float* dx, int batch, int seq, int context, int d, void* dwpe,
                       DType dtype, void* stream);
// dwte (vocab, d) fp32 += the rows of dx of each token, in row order: for k < num_tokens,
// token uniq[k] owns rows[starts[k] .. starts[k + 1]) (ascending). A CSR table the host builds.
int LaunchTokenGradAdd(const float* dx, const int32_t* uniq, const int32_t* starts,
                       const int32_t* rows, int num_tokens, int d, float* dwte, void* stream);

// ---------------------------------------------------------------- LayerNorm

// y (rows, d) in dtype = LayerNorm(x) * w + b; mean, rstd (rows) fp32. One warp per row.
int LaunchLayerNormForward(const float* x, const void* w, const void* b, DType dtype,
                           int64_t rows, int d, void* y, float* mean, float* rstd, void* stream);
// dres (rows, d) fp32 = (accumulate ? dres : 0) + dLayerNorm/dx given dy; dres_t (nullable) its
// copy in dtype, for the matrix products that read it next.
int LaunchLayerNormBackward(const float* dy, const float* x, const void* w, DType dtype,
                            const float* mean, const float* rstd, int64_t rows, int d,
                            bool accumulate, float* dres, void* dres_t, void* stream);
// Partial column sums of dy * xhat (into partials_w) and dy (into partials_b), each
// (ColumnChunks(rows), d), for LaunchColumnFinalize.
int LaunchLayerNormParamPartials(const float* dy, const float* x, const float* mean,
                                 const float* rstd, int64_t rows, int d, float* partials_w,
                                 float* partials_b, void* stream);

// ---------------------------------------------------------------- column sums (bias gradients)

// Rows are summed in chunks of kColumnChunkRows (each chunk in row order), then the chunks in
// chunk order: a fixed order for a given row count.
inline constexpr int64_t kColumnChunkRows = 64;
constexpr int64_t ColumnChunks(int64_t rows) {
  return (rows + kColumnChunkRows - 1) / kColumnChunkRows;
}
// partials (ColumnChunks(rows), cols) = per-chunk column sums of a (rows, cols).
int LaunchColumnPartials(const float* a, int64_t rows, int cols, float* partials, void* stream);
// out (cols) in dtype = sum over chunks, in order, of partials (chunks, cols).
int LaunchColumnFinalize(const float* partials, int64_t chunks, int cols, void* out,
                         DType dtype, void* stream);

// ---------------------------------------------------------------- elementwise

// out (n, cols) = y + b + residual (fp32; b in dtype).
int LaunchBiasResidual(const float* y, const void* b, DType dtype, const float* residual,
                       int64_t n, int cols, float* out, void* stream);
// fc (n, cols) += b in place; gelu (n, cols) in dtype = GELU(fc).
int LaunchBiasGelu(float* fc, const void* b, DType dtype, int64_t n, int cols, void* gelu,
                   void* stream);
// dx (count) fp32 = GELU'(x) * dy; dx_t (nullable) its copy in dtype.
int LaunchGeluBackward(const float* dy, const float* x, int64_t count, float* dx, void* dx_t,
                       DType dtype, void* stream);
// dst (count) in dtype = src.
int LaunchCastFromF32(const float* src, void* dst, DType dtype, int64_t count, void* stream);

// ---------------------------------------------------------------- attention

// qkv (batch * seq, 3d) fp32 + bias (3d, dtype) -> q, k, v in dtype, each (batch, heads, seq, hs).
int LaunchQkvToHeads(const float* qkv, const void* bias, DType dtype, int batch, int seq, int d,
                     int heads, void* q, void* k, void* v, void* stream);
// att (bh, seq, seq) fp32 = causal softmax(scale * preatt) per row, zero above the diagonal;
// att_t (nullable) its copy in dtype. One warp per row.
int LaunchCausalSoftmax(const float* preatt, int64_t bh, int seq, float scale, float* att,
                        void* att_t, DType dtype, void* stream);
// dpre (bh, seq, seq) in dtype = SoftmaxBackward(att, datt) (the scale included), zero above the
// diagonal.
int LaunchCausalSoftmaxBackward(const float* att, const float* datt, int64_t bh, int seq,
                                float scale, void* dpre, DType dtype, void* stream);
// heads (batch, heads, seq, hs) fp32 -> rows (batch * seq, d) in dtype.
int LaunchHeadsToRows(const float* heads_in, int batch, int seq, int d, int heads, void* rows,
                      DType dtype, void* stream);
// rows (batch * seq, d) fp32 -> heads (batch, heads, seq, hs) in dtype.
int LaunchRowsToHeads(const float* rows, int batch, int seq, int d, int heads, void* heads_out,
                      DType dtype, void* stream);
// dq, dk, dv (batch, heads, seq, hs) fp32 -> dqkv (batch * seq, 3d) fp32 and, if not null,
// dqkv_t in dtype.
int LaunchHeadsToQkv(const float* dq, const float* dk, const float* dv, int batch, int seq,
                     int d, int heads, float* dqkv, void* dqkv_t, DType dtype, void* stream);

// ---------------------------------------------------------------- cross-entropy

// Per row of logits (n, vocab) fp32: losses[r] = logsumexp - logits[target[r]]; with scale != 0
// also dlogits (n, vocab) in dtype = scale * (softmax - onehot(target)). One block per row.
int LaunchCrossEntropy(const float* logits, const int32_t* targets, int64_t n, int vocab,
                       float scale, float* losses, void* dlogits, DType dtype, void* stream);

}  // namespace kernels
}  // namespace gpt
}  // namespace examples
}  // namespace zerort

#endif  // ZERORT_EXAMPLES_GPT_INTERNAL_GPT_KERNELS_H_
