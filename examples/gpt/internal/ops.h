// The fp32 CPU kernels of the GPT example: linear layers, LayerNorm, GELU, causal attention and
// the softmax cross-entropy, forward and backward, each over row-major buffers.
//
// Shapes use N = batch * seq rows. Linear weights are (in, out), GPT-2's Conv1D layout, so the
// forward's inner loop is a contiguous axpy over outputs that the compiler vectorises.
//
// Determinism: every output element is computed by exactly one thread in a fixed order, so
// results are bit-identical whatever `threads` is (the stage-equivalence test relies on the
// trainer being a pure function of the parameters).
//
// Thread safety: pure functions over caller-owned buffers; `threads` > 1 runs parts of one call
// on short-lived std::threads.
#ifndef ZERORT_EXAMPLES_GPT_INTERNAL_OPS_H_
#define ZERORT_EXAMPLES_GPT_INTERNAL_OPS_H_

#include <cstdint>
#include <functional>

namespace zerort {
namespace examples {
namespace gpt {
namespace ops {

// Calls fn(begin, end) over [0, n) split into at most `threads` contiguous ranges, on threads
// when threads > 1 and n is large enough. Returns when every range is done.
void ParallelFor(int64_t n, int threads, const std::function<void(int64_t, int64_t)>& fn);

// y (n, out) = x (n, in) * w (in, out) + b (out).
void LinearForward(const float* x, const float* w, const float* b, int64_t n, int in, int out,
                   float* y, int threads);
// Given dy (n, out): dx (n, in) = dy * w^T (overwritten), dw (in, out) and db (out) overwritten.
void LinearBackward(const float* dy, const float* x, const float* w, int64_t n, int in, int out,
                    float* dx, float* dw, float* db, int threads);

// y (n, d) = LayerNorm(x) * w + b with eps 1e-5; mean and rstd (n) are kept for backward.
void LayerNormForward(const float* x, const float* w, const float* b, int64_t n, int d, float* y,
                      float* mean, float* rstd);
// dx (n, d) overwritten; dw, db (d) overwritten.
void LayerNormBackward(const float* dy, const float* x, const float* w, const float* mean,
                       const float* rstd, int64_t n, int d, float* dx, float* dw, float* db);

// GELU, GPT-2's tanh approximation, elementwise over n values.
void GeluForward(const float* x, int64_t n, float* y);
void GeluBackward(const float* dy, const float* x, int64_t n, float* dx);

// Causal multi-head self-attention. qkv (batch * seq, 3d) holds q, k, v side by side; head h
// uses columns [h*hs, (h+1)*hs) of each, hs = d / heads. att (batch, heads, seq, seq) receives
// the softmax probabilities (zero above the diagonal); y (batch * seq, d) the heads concatenated.
void AttentionForward(const float* qkv, int batch, int seq, int d, int heads, float* att,
                      float* y, int threads);
// dqkv (batch * seq, 3d) overwritten.
void AttentionBackward(const float* dy, const float* qkv, const float* att, int batch, int seq,
                       int d, int heads, float* dqkv, int threads);

// logits (n, vocab) = x (n, d) * e^T for the tied embedding e (vocab, d).
void HeadForward(const float* x, const float* e, int64_t n, int d, int vocab, float* logits,
                 int threads);
// Given dlogits (n, vocab): dx (n, d) overwritten, de (vocab, d) overwritten.
void HeadBackward(const float* dlogits, const float* x, const float* e, int64_t n, int d,
                  int vocab, float* dx, float* de, int threads);

// Per row: loss[r] = logsumexp(logits[r]) - logits[r][target[r]]. With `scale` != 0, logits is
// replaced in place by scale * (softmax - onehot(target)), the gradient of scale * sum(loss).
// REQUIRES: 0 <= target[r] < vocab.
void CrossEntropy(float* logits, const int32_t* target, int64_t n, int vocab, float scale,
                  float* loss);

}  // namespace ops
}  // namespace gpt
}  // namespace examples
}  // namespace zerort

#endif  // ZERORT_EXAMPLES_GPT_INTERNAL_OPS_H_
