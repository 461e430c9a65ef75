// Model descriptions for planning: named presets, JSON model files and synthetic models.
//
// `zerort plan` answers "will this model fit?" before any weights exist, so a model here is only
// its parameter shapes grouped into modules (layers), in registration (forward) order: the same
// ParamSpec list a trainer registers with the engine.
//
//   ASSIGN_OR_RETURN(auto specs, zerort::ModelPreset("llama2-70b"));
//   ASSIGN_OR_RETURN(auto specs, zerort::LoadModelFile("my_model.json"));
//
// Thread safety: pure functions.
#ifndef ZERORT_ZERO_MODEL_SPEC_H_
#define ZERORT_ZERO_MODEL_SPEC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/dtype.h"
#include "memory/plan.h"

namespace zerort {

// Names accepted by ModelPreset, in a stable order.
std::vector<std::string> ModelPresetNames();

// gpt2-124m, gpt2-1.5b, llama2-7b, llama2-13b, llama2-70b, built from their published
// hyperparameters (GPT-2 ties the output head to the token embedding; Llama 2 70B uses
// grouped-query attention with 8 key/value heads). NotFound lists the known names.
absl::StatusOr<std::vector<memory::ParamSpec>> ModelPreset(absl::string_view name);

// A JSON model file:
//   {"modules": [{"name": "layer0", "params": [{"name": "w", "shape": [1024, 1024]}, ...]}, ...]}
// A module may declare "activation_bytes_per_sample": N (an integer >= 0): the bytes of
// activations it keeps for backward per sample of a micro-batch (memory::ParamSpec's field of the
// same name, set on the module's first parameter).
// A parameter may declare "grad_buffer": "NAME" and "grad_buffer_offset": N (memory::ParamSpec's
// fields: the trainer keeps its gradient in buffer NAME at element N, or packed after the
// previous parameter of NAME when N is left out).
// Parameter names become "<module>.<param>". Parsed strictly by base/json (duplicate keys, trailing
// bytes refused; an unknown key at any level is refused with the nearest valid one suggested); errors are InvalidArgument naming the file and the JSON path
// ("m.json: modules[0].params[1].shape[0]: expected a dimension >= 1, got 0"). LoadModelFile
// refuses files that are not regular or larger than base/json's kMaxJsonFileBytes.
absl::StatusOr<std::vector<memory::ParamSpec>> ParseModelJson(absl::string_view text,
                                                              absl::string_view source);
absl::StatusOr<std::vector<memory::ParamSpec>> LoadModelFile(const std::string& path);

// The most layers SyntheticModel builds: each is a ParamSpec in memory, and real models have a
// few hundred at most.
constexpr int64_t kMaxSyntheticLayers = 4096;

// `params` elements in `layers` equal one-parameter layers (the last takes the remainder).
// REQUIRES: params >= layers >= 1, layers <= kMaxSyntheticLayers (InvalidArgument otherwise).
absl::StatusOr<std::vector<memory::ParamSpec>> SyntheticModel(int64_t params, int64_t layers);

// ---- Activations of a transformer (docs/memory_budget.md).

// How much of forward is recomputed in backward (Korthikanti et al. 2022, section 5).
enum class Recompute {
  kNone,       // every layer keeps all its activations
  kSelective,  // the attention core (softmax, its dropout, attention over V) is recomputed
  kFull,       // only each layer's input is kept; the whole layer is recomputed in backward
};
const char* RecomputeName(Recompute r);  // "none", "selective", "full"
// InvalidArgument naming the value and the accepted ones.
absl::StatusOr<Recompute> ParseRecompute(absl::string_view name);

// What the activation formula needs of a GPT-style transformer.
struct TransformerShape {
  int64_t layers = 0;  // L
  int64_t hidden = 0;  // h
  int64_t heads = 0;   // a (query heads)
  int64_t vocab = 0;   // V
};

// The shape of a ModelPreset (same names); NotFound as ModelPreset.
absl::StatusOr<TransformerShape> ModelPresetShape(absl::string_view name);

// One named term of an activation count.
struct ActivationLine {
  std::string name;
  int64_t bytes = 0;
};

struct ActivationEstimate {
  std::vector<ActivationLine> lines;  // the terms, in the order of docs/memory_budget.md
  int64_t bytes = 0;                  // their sum: the peak activation bytes of one micro-batch
};

// Peak activation bytes of one rank for a micro-batch of `micro_batch` sequences of `seq` tokens,
// without tensor, sequence or pipeline parallelism (data parallelism does not change them),
// after Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
// section 4 and Table 2. With e bytes per activation element (`dtype`: 2 for bf16/fp16, 4 for
// fp32) and 1-byte dropout masks, one layer keeps sbh(16e + 2) + as^2b(2e + 1) bytes, which for
// e = 2 is the paper's sbh(34 + 5as/h). Lines:
//   "layers"            none: L * that; selective: L * sbh(16e + 2) (the paper's 34sbh);
//                       full: L * e*sbh (each layer's input; the paper's 2sbh)
//   "recompute"         the working set of the one layer being recomputed in backward:
//                       selective: as^2b(2e + 1); full: one layer's full activations; none: 0
//   "embedding+output"  sbh (embedding dropout mask) + 2e*sbh (final norm and output
//                       projection inputs): the paper's section 4.3
//   "logits"            4sbV: fp32 logits kept for the loss
//   "logits gradient"   4sbV: their fp32 gradient, alive with them when backward starts
// REQUIRES: every shape field, seq and micro_batch in 1..2^30 (InvalidArgument naming the field);
// a count past 2^63-1 is InvalidArgument, never wrapped.
absl::StatusOr<ActivationEstimate> TransformerActivations(const TransformerShape& shape,
                                                          int64_t seq, int64_t micro_batch,
                                                          DType dtype, Recompute recompute);

}  // namespace zerort

#endif  // ZERORT_ZERO_MODEL_SPEC_H_
