// The optimizer's scalars as a trainer sets them: AdamWScalars for one step (Engine::
// SetHyperparams / SetLearningRate, zero/engine.h) and ParamGroup, the weight decay and lr
// multiplier of the parameters in one group (EngineOptions::param_groups, Config::param_groups).
//
//   engine->SetLearningRate(lr_at(step));   // before the step that uses it
//
// Thread safety: plain values; the functions are pure.
#ifndef ZERORT_ZERO_HYPERPARAMS_H_
#define ZERORT_ZERO_HYPERPARAMS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "zero/config.h"

namespace zerort {

// AdamW's scalars for one step; OptimizerConfig's numbers, the defaults of a run.
struct AdamWScalars {
  double lr = 1e-3;            // >= 0: the base rate, before a group's lr_scale
  double beta1 = 0.9;          // [0, 1)
  double beta2 = 0.999;        // [0, 1)
  double eps = 1e-8;           // > 0
  double weight_decay = 0.01;  // >= 0: of the parameters in no group
};

AdamWScalars ScalarsOf(const OptimizerConfig& optimizer);

// InvalidArgument naming `who` and the first bad value (all finite; ranges as above).
absl::Status ValidateScalars(const AdamWScalars& s, absl::string_view who);

// The AdamW scalars of the parameters of one group: decoupled weight decay (applied as
// lr * lr_scale * weight_decay per step, as PyTorch's per-group lr and decay are) and a
// multiplier of the step's learning rate. Parameters in no group take AdamWScalars'
// weight_decay and lr_scale 1.
struct ParamGroup {
  double weight_decay = 0;  // >= 0
  double lr_scale = 1;      // >= 0
};

// InvalidArgument naming `who` and the value unless both are finite and >= 0.
absl::Status ValidateGroup(const ParamGroup& g, absl::string_view who);

// '*' matches any run of characters (also empty), '?' one character; everything else itself.
bool GlobMatch(absl::string_view pattern, absl::string_view name);

}  // namespace zerort

#endif  // ZERORT_ZERO_HYPERPARAMS_H_
