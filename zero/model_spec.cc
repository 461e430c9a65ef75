#include "zero/model_spec.h"

#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/json.h"
#include "base/status.h"

namespace zerort {
namespace {

using memory::ParamSpec;

class Builder {
 public:
  void Module(std::string name) { module_ = std::move(name); }
  void Param(absl::string_view name, std::vector<int64_t> shape) {
    specs_.push_back({absl::StrCat(module_, ".", name), std::move(shape), module_});
  }
  std::vector<ParamSpec> Take() { return std::move(specs_); }

 private:
  std::string module_;
  std::vector<ParamSpec> specs_;
};

// GPT-2 (Radford et al. 2019; Hugging Face layout): learned positions, LayerNorm with bias,
// fused QKV, 4x MLP, output head tied to wte.
std::vector<ParamSpec> Gpt2(int64_t layers, int64_t d, int64_t vocab = 50257, int64_t ctx = 1024) {
  Builder b;
  b.Module("embed");
  b.Param("wte", {vocab, d});
  b.Param("wpe", {ctx, d});
  for (int64_t l = 0; l < layers; ++l) {
    b.Module(absl::StrCat("h.", l));
    b.Param("ln_1.weight", {d});
    b.Param("ln_1.bias", {d});
    b.Param("attn.c_attn.weight", {d, 3 * d});
    b.Param("attn.c_attn.bias", {3 * d});
    b.Param("attn.c_proj.weight", {d, d});
    b.Param("attn.c_proj.bias", {d});
    b.Param("ln_2.weight", {d});
    b.Param("ln_2.bias", {d});
    b.Param("mlp.c_fc.weight", {d, 4 * d});
    b.Param("mlp.c_fc.bias", {4 * d});
    b.Param("mlp.c_proj.weight", {4 * d, d});
    b.Param("mlp.c_proj.bias", {d});
  }
  b.Module("ln_f");
  b.Param("weight", {d});
  b.Param("bias", {d});
  return b.Take();
}

// Llama 2 (Touvron et al. 2023): RMSNorm without bias, SwiGLU MLP, untied head, GQA.
std::vector<ParamSpec> Llama2(int64_t layers, int64_t d, int64_t ffn, int64_t kv_dim,
                              int64_t vocab = 32000) {
  Builder b;
  b.Module("embed_tokens");
  b.Param("weight", {vocab, d});
  for (int64_t l = 0; l < layers; ++l) {
    b.Module(absl::StrCat("layers.", l));
    b.Param("input_layernorm.weight", {d});
    b.Param("self_attn.q_proj.weight", {d, d});
    b.Param("self_attn.k_proj.weight", {kv_dim, d});
    b.Param("self_attn.v_proj.weight", {kv_dim, d});
    b.Param("self_attn.o_proj.weight", {d, d});
    b.Param("post_attention_layernorm.weight", {d});
    b.Param("mlp.gate_proj.weight", {ffn, d});
    b.Param("mlp.up_proj.weight", {ffn, d});
    b.Param("mlp.down_proj.weight", {d, ffn});
  }
  b.Module("norm");
  b.Param("weight", {d});
  b.Module("lm_head");
  b.Param("weight", {vocab, d});
  return b.Take();
}

// Shapes are tensors' ranks; no real model comes near this.
constexpr size_t kMaxRank = 1024;

// {"name": "w", "shape": [3, 4]} -> "<module>.w".
absl::StatusOr<ParamSpec> ReadParam(const Json& param, const std::string& path,
                                    const std::string& module) {
  JsonFields p(param, path);
  RETURN_IF_ERROR(
      CheckJsonKeys(param, path, {"name", "shape", "grad_buffer", "grad_buffer_offset"}));
  ASSIGN_OR_RETURN(std::string name, p.String("name"));
  ASSIGN_OR_RETURN(const Json* shape, p.Array("shape", kMaxRank));
  if (shape->empty()) return JsonExpected(p.Path("shape"), "a non-empty array of dimensions", *shape);
  ParamSpec spec;
  spec.module = module;
  spec.name = absl::StrCat(module, ".", name);
  for (size_t d = 0; d < shape->size(); ++d) {
    ASSIGN_OR_RETURN(int64_t dim, JsonToInt((*shape)[d], JsonPath(p.Path("shape"), d), 1,
                                            std::numeric_limits<int64_t>::max(),
                                            IntegralFloats::kRefuse, "a dimension >= 1"));
    spec.shape.push_back(dim);
  }
  // Gradient hand-off (ParamSpec::grad_buffer): the trainer's buffer and, optionally, where in
  // it (else packed after the previous parameter of that buffer).
  if (p.Find("grad_buffer") != nullptr) {
    ASSIGN_OR_RETURN(spec.grad_buffer, p.String("grad_buffer"));
    if (spec.grad_buffer.empty()) {
      return JsonExpected(p.Path("grad_buffer"), "a non-empty buffer name", *p.Find("grad_buffer"));
    }
  }
  if (p.Find("grad_buffer_offset") != nullptr) {
    if (spec.grad_buffer.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          p.Path("grad_buffer_offset"), ": needs grad_buffer (the buffer it is an offset in)"));
    }
    ASSIGN_OR_RETURN(spec.grad_buffer_offset,
                     p.Int("grad_buffer_offset", 0, int64_t{1} << 52));
  }
  return spec;
}

// {"name": "layer0", "params": [...]}: appends its parameters to `specs`.
absl::Status ReadModule(const Json& mod, const std::string& path, std::vector<ParamSpec>* specs) {
  JsonFields m(mod, path);
  RETURN_IF_ERROR(CheckJsonKeys(mod, path, {"name", "params", "activation_bytes_per_sample"}));
  ASSIGN_OR_RETURN(std::string module, m.String("name"));
  ASSIGN_OR_RETURN(const Json* params, m.Array("params", std::numeric_limits<size_t>::max()));
  if (params->empty()) {
    return JsonExpected(m.Path("params"), "a non-empty array of parameters", *params);
  }
  int64_t activations = 0;
  if (m.Find("activation_bytes_per_sample") != nullptr) {
    ASSIGN_OR_RETURN(activations, m.Int("activation_bytes_per_sample", 0,
                                        std::numeric_limits<int64_t>::max()));
  }
  for (size_t p = 0; p < params->size(); ++p) {
    ASSIGN_OR_RETURN(ParamSpec spec,
                     ReadParam((*params)[p], JsonPath(m.Path("params"), p), module));
    // The module's declaration rides on its first parameter: the plan sums it per unit.
    if (p == 0) spec.activation_bytes_per_sample = activations;
    specs->push_back(std::move(spec));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<ParamSpec>> ReadModel(const Json& doc) {
  JsonFields root(doc, "");
  RETURN_IF_ERROR(CheckJsonKeys(doc, "", {"modules"}));
  ASSIGN_OR_RETURN(const Json* modules, root.Array("modules", std::numeric_limits<size_t>::max()));
  std::vector<ParamSpec> specs;
  for (size_t m = 0; m < modules->size(); ++m) {
    RETURN_IF_ERROR(ReadModule((*modules)[m], JsonPath("modules", m), &specs));
  }
  if (specs.empty()) {
    return absl::InvalidArgumentError("modules: the model has no parameters");
  }
  return specs;
}

}  // namespace

std::vector<std::string> ModelPresetNames() {
  return {"gpt2-124m", "gpt2-1.5b", "llama2-7b", "llama2-13b", "llama2-70b"};
}

absl::StatusOr<std::vector<ParamSpec>> ModelPreset(absl::string_view name) {
  if (name == "gpt2-124m") return Gpt2(12, 768);
  if (name == "gpt2-1.5b") return Gpt2(48, 1600);
  if (name == "llama2-7b") return Llama2(32, 4096, 11008, 4096);
  if (name == "llama2-13b") return Llama2(40, 5120, 13824, 5120);
  if (name == "llama2-70b") return Llama2(80, 8192, 28672, 1024);
  return absl::NotFoundError(absl::StrCat("unknown model preset '", name, "': known presets are ",
                                          absl::StrJoin(ModelPresetNames(), ", "),
                                          " (or pass a JSON model file)"));
}

absl::StatusOr<TransformerShape> ModelPresetShape(absl::string_view name) {
  // The presets' published hyperparameters (layers, hidden, query heads, vocabulary).
  if (name == "gpt2-124m") return TransformerShape{12, 768, 12, 50257};
  if (name == "gpt2-1.5b") return TransformerShape{48, 1600, 25, 50257};
  if (name == "llama2-7b") return TransformerShape{32, 4096, 32, 32000};
  if (name == "llama2-13b") return TransformerShape{40, 5120, 40, 32000};
  if (name == "llama2-70b") return TransformerShape{80, 8192, 64, 32000};
  return ModelPreset(name).status();  // the same NotFound, listing the names
}

// The largest shape field, sequence length or micro-batch TransformerActivations accepts.
constexpr int64_t kMaxActivationDim = int64_t{1} << 30;

const char* RecomputeName(Recompute r) {
  switch (r) {
    case Recompute::kNone: return "none";
    case Recompute::kSelective: return "selective";
    case Recompute::kFull: return "full";
  }
  return "?";
}

absl::StatusOr<Recompute> ParseRecompute(absl::string_view name) {
  for (Recompute r : {Recompute::kNone, Recompute::kSelective, Recompute::kFull}) {
    if (name == RecomputeName(r)) return r;
  }
  return absl::InvalidArgumentError(absl::StrCat("recompute level '", name,
                                                 "': expected none, selective or full"));
}

absl::StatusOr<ActivationEstimate> TransformerActivations(const TransformerShape& shape,
                                                          int64_t seq, int64_t micro_batch,
                                                          DType dtype, Recompute recompute) {
  for (auto [what, v] : {std::pair<const char*, int64_t>{"layers", shape.layers},
                         {"hidden size", shape.hidden},
                         {"heads", shape.heads},
                         {"vocabulary", shape.vocab},
                         {"sequence length", seq},
                         {"micro-batch", micro_batch}}) {
    if (v < 1 || v > kMaxActivationDim) {
      return absl::InvalidArgumentError(absl::StrCat("activations: ", what, " = ", v,
                                                     " is out of range: expected 1..2^30"));
    }
  }
  // In 128-bit: s*b*a*s alone passes 2^63 for long sequences. With every factor at most 2^30,
  // no product below reaches 2^127; the total is checked against 2^63-1.
  using Wide = __int128;
  const Wide s = seq, b = micro_batch, h = shape.hidden, a = shape.heads, L = shape.layers,
             V = shape.vocab, e = DTypeSize(dtype);
  const Wide sbh = s * b * h;
  const Wide per_layer_linear = sbh * (16 * e + 2);  // e = 2: 34sbh
  const Wide attention_core = a * s * s * b * (2 * e + 1);  // e = 2: 5as^2b
  const Wide full_layer = per_layer_linear + attention_core;
  Wide layers = 0, working = 0;
  switch (recompute) {
    case Recompute::kNone: layers = L * full_layer; break;
    case Recompute::kSelective:
      layers = L * per_layer_linear;
      working = attention_core;
      break;
    case Recompute::kFull:
      layers = L * e * sbh;
      working = full_layer;
      break;
  }
  const Wide logits = 4 * s * b * V;
  const std::pair<const char*, Wide> terms[] = {{"layers", layers},
                                                {"recompute", working},
                                                {"embedding+output", sbh + 2 * e * sbh},
                                                {"logits", logits},
                                                {"logits gradient", logits}};
  Wide total = 0;
  for (const auto& term : terms) total += term.second;
  // Each term is at most the total, so checking the total checks them all.
  if (total > std::numeric_limits<int64_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "activations: the count for sequence length ", seq, " and micro-batch ", micro_batch,
        " exceeds 2^63-1 bytes"));
  }
  ActivationEstimate out;
  for (const auto& [name, bytes] : terms) out.lines.push_back({name, static_cast<int64_t>(bytes)});
  out.bytes = static_cast<int64_t>(total);
  return out;
}

absl::StatusOr<std::vector<ParamSpec>> ParseModelJson(absl::string_view text,
                                                      absl::string_view source) {
  ASSIGN_OR_RETURN(Json doc, ParseJson(text, source));
  absl::StatusOr<std::vector<ParamSpec>> specs = ReadModel(doc);
  if (!specs.ok()) return Annotate(specs.status(), source);
  return specs;
}

absl::StatusOr<std::vector<ParamSpec>> LoadModelFile(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadBoundedFile(path, "model"));
  return ParseModelJson(text, path);
}

absl::StatusOr<std::vector<ParamSpec>> SyntheticModel(int64_t params, int64_t layers) {
  if (layers < 1 || params < layers || layers > kMaxSyntheticLayers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a synthetic model needs params >= layers >= 1 and at most ", kMaxSyntheticLayers,
        " layers (got params=", params, ", layers=", layers, ")"));
  }
  std::vector<ParamSpec> specs;
  specs.reserve(layers);
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t n = params / layers + (l == layers - 1 ? params % layers : 0);
    const std::string module = absl::StrCat("layer", l);
    specs.push_back({module + ".weight", {n}, module});
  }
  return specs;
}

}  // namespace zerort
