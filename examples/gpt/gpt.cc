#include "examples/gpt/gpt.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/dtype.h"
#include "base/status.h"
#include "examples/gpt/internal/model.h"
#include "examples/gpt/internal/random.h"

namespace zerort {
namespace examples {
namespace gpt {
namespace {

using internal::BlockParamIndex;
using internal::LnFIndex;

// Stage 3 keeps exactly the units of the parameters in use gathered, through the engine's
// per-parameter holds (AcquireParams / ReleaseParams count them per unit, so a unit shared by
// neighbouring modules needs no bookkeeping here). Parameters are converted to fp32 when
// fetched and dropped at the next Fetch.
class EngineAccess : public internal::ParamAccess {
 public:
  explicit EngineAccess(Engine& engine)
      : engine_(engine), dtype_(engine.plan().options.compute_dtype),
        values_(engine.num_params()) {}

  absl::Status Fetch(const std::vector<int>& params) override {
    // The previous set's holds go first, so no more slots are held than one set needs; a unit
    // in both sets keeps its slot unless the new set's gathers need that slot.
    RETURN_IF_ERROR(engine_.ReleaseParams(held_));
    held_.clear();
    RETURN_IF_ERROR(engine_.AcquireParams(params));
    held_ = params;
    for (std::vector<float>& v : values_) std::vector<float>().swap(v);
    for (int i : params) RETURN_IF_ERROR(Load(i));
    return absl::OkStatus();
  }

  const float* Get(int i) override { return values_[i].data(); }

  absl::Status Put(int i, const std::vector<float>& grad) override {
    if (engine_.frozen(i)) return absl::OkStatus();  // --freeze: no gradient to hand over
    ASSIGN_OR_RETURN(void* dst, engine_.grad(i));
    for (size_t k = 0; k < grad.size(); ++k) StoreAs(dtype_, dst, k, grad[k]);
    return engine_.GradReady(i);
  }

 private:
  absl::Status Load(int i) {
    ASSIGN_OR_RETURN(void* src, engine_.param(i));
    std::vector<float>& v = values_[i];
    v.resize(engine_.plan().params[i].numel);
    for (size_t k = 0; k < v.size(); ++k) v[k] = LoadAs(dtype_, src, k);
    return absl::OkStatus();
  }

  Engine& engine_;
  const DType dtype_;
  std::vector<std::vector<float>> values_;  // per parameter; filled while fetched
  std::vector<int> held_;                   // the parameters of the last Fetch, acquired
};

// A flat fp32 parameter vector in registration order; gradients land in another.
class FlatAccess : public internal::ParamAccess {
 public:
  FlatAccess(const std::vector<memory::ParamSpec>& specs, const std::vector<float>& params,
             const float* output_embedding, std::vector<float>* grads)
      : params_(params), output_embedding_(output_embedding), grads_(grads) {
    int64_t offset = 0;
    for (const memory::ParamSpec& spec : specs) {
      offsets_.push_back(offset);
      offset += spec.numel();
    }
    if (grads_ != nullptr) grads_->assign(offset, 0.0f);
  }

  absl::Status Fetch(const std::vector<int>&) override { return absl::OkStatus(); }
  const float* Get(int i) override { return params_.data() + offsets_[i]; }
  const float* OutputEmbedding() override {
    return output_embedding_ != nullptr ? output_embedding_ : Get(internal::kWte);
  }
  absl::Status Put(int i, const std::vector<float>& grad) override {
    if (grads_ != nullptr) std::copy(grad.begin(), grad.end(), grads_->begin() + offsets_[i]);
    return absl::OkStatus();
  }

 private:
  const std::vector<float>& params_;
  const float* output_embedding_;
  std::vector<float>* grads_;
  std::vector<int64_t> offsets_;
};

// The meter counting this thread's passes (the innermost one), if any.
thread_local ActivationMeter* current_meter = nullptr;

}  // namespace

ActivationMeter::ActivationMeter() : outer_(current_meter) { current_meter = this; }
ActivationMeter::~ActivationMeter() { current_meter = outer_; }

namespace internal {
void CountActivationBytes(int64_t delta) {
  ActivationMeter* meter = current_meter;
  if (meter == nullptr) return;
  meter->live_ += delta;
  meter->peak_ = std::max(meter->peak_, meter->live_);
}
}  // namespace internal

GptShape GptShape::Gpt2Small() {
  GptShape shape;
  shape.vocab = 50257;
  shape.context = 1024;
  shape.layers = 12;
  shape.heads = 12;
  shape.d_model = 768;
  return shape;
}

absl::Status ValidateBatch(const GptShape& shape, const TokenBatch& batch) {
  if (batch.batch < 1 || batch.seq < 1 || batch.seq > shape.context ||
      batch.tokens.size() != static_cast<size_t>(batch.batch) * (batch.seq + 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TokenBatch of ", batch.batch, " sequences of ", batch.seq, " tokens (context ",
        shape.context, ") has ", batch.tokens.size(), " tokens, want batch * (seq + 1)"));
  }
  for (int32_t t : batch.tokens) {
    if (t < 0 || t >= shape.vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("TokenBatch token ", t, " outside the vocabulary [0, ", shape.vocab, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateShape(const GptShape& shape) {
  auto bad = [](absl::string_view field, double value, absl::string_view want) {
    return absl::InvalidArgumentError(
        absl::StrCat("GptShape.", field, " ", value, " must be ", want));
  };
  if (shape.vocab < 256) return bad("vocab", shape.vocab, ">= 256 (tokens are bytes)");
  if (shape.context < 1) return bad("context", shape.context, ">= 1");
  if (shape.layers < 1) return bad("layers", shape.layers, ">= 1");
  if (shape.heads < 1) return bad("heads", shape.heads, ">= 1");
  if (shape.d_model < 1 || shape.d_model % shape.heads != 0) {
    return bad("d_model", shape.d_model, absl::StrCat(">= 1 and a multiple of heads ", shape.heads));
  }
  if (!(shape.init_std > 0)) return bad("init_std", shape.init_std, "> 0");
  return absl::OkStatus();
}

Gpt::Gpt(GptShape shape, int threads) : shape_(std::move(shape)), threads_(std::max(1, threads)) {}

std::vector<memory::ParamSpec> Gpt::ParamSpecs() const {
  const int64_t d = shape_.d_model;
  std::vector<memory::ParamSpec> specs = {{"wte", {shape_.vocab, d}, "wte"},
                                          {"wpe", {shape_.context, d}, "wpe"}};
  for (int l = 0; l < shape_.layers; ++l) {
    const std::string h = absl::StrCat("h", l);
    const std::string ln1 = h + ".ln1", attn = h + ".attn", ln2 = h + ".ln2", mlp = h + ".mlp";
    specs.push_back({ln1 + ".w", {d}, ln1});
    specs.push_back({ln1 + ".b", {d}, ln1});
    specs.push_back({attn + ".qkv.w", {d, 3 * d}, attn});
    specs.push_back({attn + ".qkv.b", {3 * d}, attn});
    specs.push_back({attn + ".proj.w", {d, d}, attn});
    specs.push_back({attn + ".proj.b", {d}, attn});
    specs.push_back({ln2 + ".w", {d}, ln2});
    specs.push_back({ln2 + ".b", {d}, ln2});
    specs.push_back({mlp + ".fc.w", {d, 4 * d}, mlp});
    specs.push_back({mlp + ".fc.b", {4 * d}, mlp});
    specs.push_back({mlp + ".proj.w", {4 * d, d}, mlp});
    specs.push_back({mlp + ".proj.b", {d}, mlp});
  }
  specs.push_back({"ln_f.w", {d}, "ln_f"});
  specs.push_back({"ln_f.b", {d}, "ln_f"});
  return specs;
}

std::vector<memory::ParamSpec> Gpt::ParamSpecs(int seq) const {
  std::vector<memory::ParamSpec> specs = ParamSpecs();
  const int64_t s = seq, d = shape_.d_model, f = sizeof(float);
  for (int l = 0; l < shape_.layers; ++l) {
    specs[BlockParamIndex(l, internal::kLn1W)].activation_bytes_per_sample = f * (2 * s * d + 2 * s);
    specs[BlockParamIndex(l, internal::kQkvW)].activation_bytes_per_sample =
        f * (4 * s * d + static_cast<int64_t>(shape_.heads) * s * s);
    specs[BlockParamIndex(l, internal::kLn2W)].activation_bytes_per_sample = f * (2 * s * d + 2 * s);
    specs[BlockParamIndex(l, internal::kFcW)].activation_bytes_per_sample = f * 8 * s * d;
  }
  specs[LnFIndex(shape_.layers)].activation_bytes_per_sample = f * (s * d + 2 * s);
  specs[internal::kWte].activation_bytes_per_sample = f * (s * d + s * shape_.vocab + 1 + 14 * s * d);
  return specs;
}

int64_t Gpt::num_elements() const {
  int64_t n = 0;
  for (const memory::ParamSpec& spec : ParamSpecs()) n += spec.numel();
  return n;
}

namespace {

// GPT-2's initialisation (as llm.c does it): N(0, std) for embeddings and weights, std /
// sqrt(2 * layers) for the projections that add into the residual stream, LayerNorm gains 1,
// every bias 0.
void InitParam(const GptShape& shape, int index, int64_t numel, float* values) {
  float std_dev = shape.init_std;
  if (index >= 2) {
    const int p = index >= LnFIndex(shape.layers) ? index - LnFIndex(shape.layers)
                                                   : (index - 2) % internal::kParamsPerBlock;
    const bool ln_f = index >= LnFIndex(shape.layers);
    const bool gain = ln_f ? p == 0 : (p == internal::kLn1W || p == internal::kLn2W);
    const bool matrix = !ln_f && (p == internal::kQkvW || p == internal::kAttnProjW ||
                                  p == internal::kFcW || p == internal::kMlpProjW);
    if (!matrix) {
      std::fill(values, values + numel, gain ? 1.0f : 0.0f);
      return;
    }
    if (p == internal::kAttnProjW || p == internal::kMlpProjW) {
      std_dev /= std::sqrt(2.0f * shape.layers);
    }
  }
  internal::Rng rng({shape.seed, static_cast<uint64_t>(index)});
  for (int64_t k = 0; k < numel; ++k) values[k] = std_dev * static_cast<float>(rng.Normal());
}


float Mean(const std::vector<float>& v) {
  double sum = 0;
  for (float x : v) sum += x;
  return static_cast<float>(sum / static_cast<double>(v.size()));
}

}  // namespace

Engine::Initializer Gpt::Initializer() const {
  const GptShape shape = shape_;
  return [shape](int index, const memory::ParamSpec& spec, float* values) {
    InitParam(shape, index, spec.numel(), values);
  };
}

std::vector<float> Gpt::InitialParams() const {
  const std::vector<memory::ParamSpec> specs = ParamSpecs();
  std::vector<float> flat(num_elements());
  int64_t offset = 0;
  for (int i = 0; i < static_cast<int>(specs.size()); ++i) {
    InitParam(shape_, i, specs[i].numel(), flat.data() + offset);
    offset += specs[i].numel();
  }
  return flat;
}

absl::StatusOr<float> Gpt::ForwardBackward(Engine& engine, const TokenBatch& batch) const {
  RETURN_IF_ERROR(ValidateBatch(shape_, batch));
  EngineAccess access(engine);
  // Gradient of the mean token loss, times the loss scale so small fp16 gradients survive.
  const float scale = static_cast<float>(engine.loss_scale()) /
                      (static_cast<float>(batch.batch) * static_cast<float>(batch.seq));
  ASSIGN_OR_RETURN(std::vector<float> losses,
                   internal::RunPass(shape_, threads_, access, batch, scale, nullptr));
  return Mean(losses);
}

absl::StatusOr<std::vector<float>> Gpt::SequenceLosses(Engine& engine,
                                                       const TokenBatch& batch) const {
  RETURN_IF_ERROR(ValidateBatch(shape_, batch));
  EngineAccess access(engine);
  return internal::RunPass(shape_, threads_, access, batch, 0, nullptr);
}

float Gpt::Loss(const std::vector<float>& params, const TokenBatch& batch,
                const float* output_embedding) const {
  FlatAccess access(ParamSpecs(), params, output_embedding, nullptr);
  absl::StatusOr<std::vector<float>> losses =
      internal::RunPass(shape_, threads_, access, batch, 0, nullptr);
  return losses.ok() ? Mean(*losses) : NAN;  // FlatAccess never fails
}

std::vector<float> Gpt::Gradients(const std::vector<float>& params,
                                  const TokenBatch& batch) const {
  std::vector<float> grads;
  FlatAccess access(ParamSpecs(), params, nullptr, &grads);
  const float scale = 1.0f / (static_cast<float>(batch.batch) * static_cast<float>(batch.seq));
  (void)internal::RunPass(shape_, threads_, access, batch, scale, nullptr);
  return grads;
}

std::vector<float> Gpt::Logits(const std::vector<float>& params, const TokenBatch& batch) const {
  std::vector<float> logits;
  FlatAccess access(ParamSpecs(), params, nullptr, nullptr);
  (void)internal::RunPass(shape_, threads_, access, batch, 0, &logits);
  return logits;
}

std::string Gpt::Generate(const std::vector<float>& params, const std::string& prompt,
                          int tokens, float temperature, uint64_t seed) const {
  std::string text = prompt.empty() ? std::string("\n") : prompt;
  internal::Rng rng({seed, 0x5eed});
  const int choices = std::min(shape_.vocab, 256);  // only bytes can be printed
  for (int n = 0; n < tokens; ++n) {
    TokenBatch batch;
    batch.batch = 1;
    batch.seq = static_cast<int>(std::min<size_t>(text.size(), shape_.context));
    for (size_t k = text.size() - batch.seq; k < text.size(); ++k) {
      batch.tokens.push_back(static_cast<unsigned char>(text[k]));
    }
    batch.tokens.push_back(0);  // an unused target
    const std::vector<float> logits = Logits(params, batch);
    const float* last = logits.data() + static_cast<int64_t>(batch.seq - 1) * shape_.vocab;
    int next = static_cast<int>(std::max_element(last, last + choices) - last);
    if (temperature > 0) {
      std::vector<double> p(choices);
      double sum = 0;
      for (int v = 0; v < choices; ++v) sum += p[v] = std::exp((last[v] - last[next]) / temperature);
      double u = rng.Uniform() * sum;
      for (next = 0; next + 1 < choices && (u -= p[next]) > 0; ++next) {}
    }
    text.push_back(static_cast<char>(next));
  }
  return text;
}

}  // namespace gpt
}  // namespace examples
}  // namespace zerort
