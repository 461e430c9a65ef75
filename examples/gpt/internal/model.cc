#include "examples/gpt/internal/model.h"

#include <algorithm>
#include <utility>

#include "base/status.h"
#include "examples/gpt/internal/ops.h"

namespace zerort {
namespace examples {
namespace gpt {
namespace internal {
namespace {

// What backward needs of one block's forward, N = batch * seq rows. Gpt::ParamSpecs(seq)
// declares these bytes per block: keep the two in step (gpt_test measures both).
struct BlockCache {
  Acts x;                             // (N, d) the block's input (the residual stream)
  Acts ln1, ln2;                      // (N, d) LayerNorm outputs
  Acts mean1, rstd1, mean2, rstd2;    // (N)
  Acts qkv;                           // (N, 3d)
  Acts att;                           // (batch, heads, seq, seq) softmax probabilities
  Acts atty;                          // (N, d) attention output, heads concatenated
  Acts x2;                            // (N, d) residual after attention
  Acts fc, gelu;                      // (N, 4d) before and after the GELU
};

class Pass {
 public:
  Pass(const GptShape& shape, int threads, ParamAccess& access, const TokenBatch& batch)
      : shape_(shape), threads_(threads), access_(access), batch_(batch),
        n_(static_cast<int64_t>(batch.batch) * batch.seq), d_(shape.d_model) {}

  absl::StatusOr<std::vector<float>> Run(float grad_scale, std::vector<float>* logits);

 private:
  std::vector<int> BlockParams(int layer, bool forward) const;
  absl::Status Embed();
  absl::Status BlockForward(int layer, BlockCache& c);
  absl::StatusOr<Acts> HeadForward(float grad_scale, std::vector<float>* logits);
  absl::Status HeadBackward();
  absl::Status BlockBackward(int layer, const BlockCache& c);
  absl::Status EmbedBackward();
  // Row r = (b, t) reads token t of sequence b and predicts token t + 1.
  int32_t token(int64_t row, int shift) const {
    return batch_.tokens[row / batch_.seq * (batch_.seq + 1) + row % batch_.seq + shift];
  }

  const GptShape& shape_;
  const int threads_;
  ParamAccess& access_;
  const TokenBatch& batch_;
  const int64_t n_;
  const int d_;
  Acts x_;                    // (N, d) the residual stream; in backward, its gradient
  Acts xf_, meanf_, rstdf_;   // final LayerNorm output (N, d) and statistics
  Acts probs_;                // (N, vocab) logits, then their gradient
  std::vector<float> dwte_;   // (vocab, d) the tied embedding's gradient, from both uses
  std::vector<std::vector<float>> grads_ = std::vector<std::vector<float>>(kParamsPerBlock);
};

std::vector<int> Pass::BlockParams(int layer, bool forward) const {
  std::vector<int> params;
  for (int p = 0; p < kParamsPerBlock; ++p) params.push_back(BlockParamIndex(layer, p));
  if (!forward) std::reverse(params.begin(), params.end());
  return params;
}

absl::StatusOr<std::vector<float>> Pass::Run(float grad_scale, std::vector<float>* logits) {
  const bool backward = grad_scale != 0;
  std::vector<BlockCache> caches(backward ? shape_.layers : 1);
  RETURN_IF_ERROR(Embed());
  for (int l = 0; l < shape_.layers; ++l) {
    RETURN_IF_ERROR(BlockForward(l, caches[backward ? l : 0]));
  }
  ASSIGN_OR_RETURN(Acts losses, HeadForward(grad_scale, logits));
  if (backward) {
    RETURN_IF_ERROR(HeadBackward());
    for (int l = shape_.layers - 1; l >= 0; --l) RETURN_IF_ERROR(BlockBackward(l, caches[l]));
    RETURN_IF_ERROR(EmbedBackward());
  } else {
    RETURN_IF_ERROR(access_.Fetch({}));
  }
  return std::vector<float>(losses.begin(), losses.end());
}

absl::Status Pass::Embed() {
  RETURN_IF_ERROR(access_.Fetch({kWte, kWpe}));
  const float* wte = access_.Get(kWte);
  const float* wpe = access_.Get(kWpe);
  x_.resize(n_ * d_);
  for (int64_t r = 0; r < n_; ++r) {
    const float* e = wte + static_cast<int64_t>(token(r, 0)) * d_;
    const float* p = wpe + (r % batch_.seq) * d_;
    for (int i = 0; i < d_; ++i) x_[r * d_ + i] = e[i] + p[i];
  }
  return absl::OkStatus();
}

absl::Status Pass::BlockForward(int layer, BlockCache& c) {
  RETURN_IF_ERROR(access_.Fetch(BlockParams(layer, /*forward=*/true)));
  auto w = [&](int p) { return access_.Get(BlockParamIndex(layer, p)); };
  const int d = d_;
  c.x = x_;
  c.ln1.resize(n_ * d), c.mean1.resize(n_), c.rstd1.resize(n_);
  ops::LayerNormForward(c.x.data(), w(kLn1W), w(kLn1B), n_, d, c.ln1.data(), c.mean1.data(),
                        c.rstd1.data());
  c.qkv.resize(n_ * 3 * d);
  ops::LinearForward(c.ln1.data(), w(kQkvW), w(kQkvB), n_, d, 3 * d, c.qkv.data(), threads_);
  c.att.resize(static_cast<int64_t>(batch_.batch) * shape_.heads * batch_.seq * batch_.seq);
  c.atty.resize(n_ * d);
  ops::AttentionForward(c.qkv.data(), batch_.batch, batch_.seq, d, shape_.heads, c.att.data(),
                        c.atty.data(), threads_);
  c.x2.resize(n_ * d);
  ops::LinearForward(c.atty.data(), w(kAttnProjW), w(kAttnProjB), n_, d, d, c.x2.data(),
                     threads_);
  for (int64_t k = 0; k < n_ * d; ++k) c.x2[k] += c.x[k];
  c.ln2.resize(n_ * d), c.mean2.resize(n_), c.rstd2.resize(n_);
  ops::LayerNormForward(c.x2.data(), w(kLn2W), w(kLn2B), n_, d, c.ln2.data(), c.mean2.data(),
                        c.rstd2.data());
  c.fc.resize(n_ * 4 * d), c.gelu.resize(n_ * 4 * d);
  ops::LinearForward(c.ln2.data(), w(kFcW), w(kFcB), n_, d, 4 * d, c.fc.data(), threads_);
  ops::GeluForward(c.fc.data(), n_ * 4 * d, c.gelu.data());
  ops::LinearForward(c.gelu.data(), w(kMlpProjW), w(kMlpProjB), n_, 4 * d, d, x_.data(),
                     threads_);
  for (int64_t k = 0; k < n_ * d; ++k) x_[k] += c.x2[k];
  return absl::OkStatus();
}

absl::StatusOr<Acts> Pass::HeadForward(float grad_scale, std::vector<float>* logits) {
  const int lnf = LnFIndex(shape_.layers);
  // In use order; backward needs the same parameters first, so they stay fetched across.
  RETURN_IF_ERROR(access_.Fetch({lnf, lnf + 1, kWte}));
  xf_.resize(n_ * d_), meanf_.resize(n_), rstdf_.resize(n_);
  ops::LayerNormForward(x_.data(), access_.Get(lnf), access_.Get(lnf + 1), n_, d_, xf_.data(),
                        meanf_.data(), rstdf_.data());
  probs_.resize(n_ * shape_.vocab);
  ops::HeadForward(xf_.data(), access_.OutputEmbedding(), n_, d_, shape_.vocab, probs_.data(),
                   threads_);
  if (logits != nullptr) logits->assign(probs_.begin(), probs_.end());
  std::vector<int32_t, MeteredAllocator<int32_t>> targets(n_);
  for (int64_t r = 0; r < n_; ++r) targets[r] = token(r, 1);
  Acts token_loss(n_);
  ops::CrossEntropy(probs_.data(), targets.data(), n_, shape_.vocab, grad_scale,
                    token_loss.data());
  Acts losses(batch_.batch);
  for (int b = 0; b < batch_.batch; ++b) {
    double sum = 0;
    for (int t = 0; t < batch_.seq; ++t) sum += token_loss[static_cast<int64_t>(b) * batch_.seq + t];
    losses[b] = static_cast<float>(sum / batch_.seq);
  }
  return losses;
}

absl::Status Pass::HeadBackward() {
  const int lnf = LnFIndex(shape_.layers);
  RETURN_IF_ERROR(access_.Fetch({kWte, lnf, lnf + 1}));
  Acts dxf(n_ * d_);
  dwte_.resize(static_cast<int64_t>(shape_.vocab) * d_);
  ops::HeadBackward(probs_.data(), xf_.data(), access_.OutputEmbedding(), n_, d_, shape_.vocab,
                    dxf.data(), dwte_.data(), threads_);
  std::vector<float>& dw = grads_[0];
  std::vector<float>& db = grads_[1];
  dw.resize(d_), db.resize(d_);
  // x_ still holds the last block's output; it becomes the gradient of it.
  const Acts x = x_;
  ops::LayerNormBackward(dxf.data(), x.data(), access_.Get(lnf), meanf_.data(), rstdf_.data(),
                         n_, d_, x_.data(), dw.data(), db.data());
  RETURN_IF_ERROR(access_.Put(lnf + 1, db));
  return access_.Put(lnf, dw);
}

absl::Status Pass::BlockBackward(int layer, const BlockCache& c) {
  RETURN_IF_ERROR(access_.Fetch(BlockParams(layer, /*forward=*/false)));
  auto w = [&](int p) { return access_.Get(BlockParamIndex(layer, p)); };
  auto g = [&](int p, int64_t size) {
    grads_[p].resize(size);
    return grads_[p].data();
  };
  const int d = d_;
  // x_ holds dLoss/d(block output) = dLoss/dx2 through the MLP's residual branch.
  // The backward working set: Gpt::ParamSpecs(seq) declares these 14 (N, d) on top of the
  // caches, since the first block's backward, with every cache still held, is the pass's peak.
  Acts dgelu(n_ * 4 * d), dfc(n_ * 4 * d), dln(n_ * d), dres(n_ * d);
  ops::LinearBackward(x_.data(), c.gelu.data(), w(kMlpProjW), n_, 4 * d, d, dgelu.data(),
                      g(kMlpProjW, 4 * d * d), g(kMlpProjB, d), threads_);
  ops::GeluBackward(dgelu.data(), c.fc.data(), n_ * 4 * d, dfc.data());
  ops::LinearBackward(dfc.data(), c.ln2.data(), w(kFcW), n_, d, 4 * d, dln.data(),
                      g(kFcW, 4 * d * d), g(kFcB, 4 * d), threads_);
  ops::LayerNormBackward(dln.data(), c.x2.data(), w(kLn2W), c.mean2.data(), c.rstd2.data(), n_,
                         d, dres.data(), g(kLn2W, d), g(kLn2B, d));
  for (int64_t k = 0; k < n_ * d; ++k) x_[k] += dres[k];  // now dLoss/dx2
  Acts datty(n_ * d), dqkv(n_ * 3 * d);
  ops::LinearBackward(x_.data(), c.atty.data(), w(kAttnProjW), n_, d, d, datty.data(),
                      g(kAttnProjW, d * d), g(kAttnProjB, d), threads_);
  ops::AttentionBackward(datty.data(), c.qkv.data(), c.att.data(), batch_.batch, batch_.seq, d,
                         shape_.heads, dqkv.data(), threads_);
  ops::LinearBackward(dqkv.data(), c.ln1.data(), w(kQkvW), n_, d, 3 * d, dln.data(),
                      g(kQkvW, 3 * d * d), g(kQkvB, 3 * d), threads_);
  ops::LayerNormBackward(dln.data(), c.x.data(), w(kLn1W), c.mean1.data(), c.rstd1.data(), n_,
                         d, dres.data(), g(kLn1W, d), g(kLn1B, d));
  for (int64_t k = 0; k < n_ * d; ++k) x_[k] += dres[k];  // now dLoss/d(block input)
  // Reverse registration order: the engine's units complete one after another.
  for (int p = kParamsPerBlock - 1; p >= 0; --p) {
    RETURN_IF_ERROR(access_.Put(BlockParamIndex(layer, p), grads_[p]));
  }
  return absl::OkStatus();
}

absl::Status Pass::EmbedBackward() {
  // The embeddings' backward reads no parameter: everything may be released.
  RETURN_IF_ERROR(access_.Fetch({}));
  std::vector<float> dwpe(static_cast<int64_t>(shape_.context) * d_, 0.0f);
  for (int64_t r = 0; r < n_; ++r) {
    float* p = dwpe.data() + (r % batch_.seq) * d_;
    float* e = dwte_.data() + static_cast<int64_t>(token(r, 0)) * d_;
    for (int i = 0; i < d_; ++i) {
      p[i] += x_[r * d_ + i];
      e[i] += x_[r * d_ + i];  // the input use, added to the output projection's gradient
    }
  }
  RETURN_IF_ERROR(access_.Put(kWpe, dwpe));
  return access_.Put(kWte, dwte_);
}

}  // namespace

absl::StatusOr<std::vector<float>> RunPass(const GptShape& shape, int threads,
                                           ParamAccess& access, const TokenBatch& batch,
                                           float grad_scale, std::vector<float>* logits) {
  Pass pass(shape, threads, access, batch);
  return pass.Run(grad_scale, logits);
}

}  // namespace internal
}  // namespace gpt
}  // namespace examples
}  // namespace zerort
