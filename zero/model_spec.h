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

}  // namespace zerort

#endif  // ZERORT_ZERO_MODEL_SPEC_H_
