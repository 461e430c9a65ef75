// Parameter groups of the optimizer step: which group each parameter is in (resolved once at
// Engine::Create) and, per unit, the ranges of this rank's owned region that each group's
// AdamW constants cover.
//
// A unit's shard may span several parameters of different groups, so each region is cut at
// the parameter boundaries inside it; neighbours in the same group share one range, so a model
// without groups has exactly one range per unit (the kernels' single-range path). Padding
// between parameters joins the range of the parameter before it (its values stay zero under
// any constants: zero gradient, zero moments, zero master).
//
// Thread safety: not thread-safe; one per engine.
#ifndef ZERORT_ZERO_INTERNAL_ADAMW_GROUPS_H_
#define ZERORT_ZERO_INTERNAL_ADAMW_GROUPS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "memory/plan.h"
#include "offload/cpu_adamw.h"
#include "zero/config.h"
#include "zero/hyperparams.h"
#include "zero/internal/shard_layout.h"

namespace zerort {
namespace zero_internal {

// Each parameter's group: an index into `groups`, or -1 for none (the step's weight decay,
// lr_scale 1).
struct GroupChoice {
  std::vector<ParamGroup> groups;
  std::vector<int> of_param;
};

// Per parameter, the layer count L of the StackedSlices run it belongs to (L consecutive
// parameters base[0..L-1] in modules mod[0..L-1], all of one shape), or 0.
std::vector<int64_t> StackedLayers(const std::vector<memory::ParamSpec>& specs);

// Per parameter, in order: explicit_groups[i] when set; else the first of `patterns` whose glob
// matches the name; else, with no_decay_1d, {weight_decay 0, lr_scale 1} for a parameter whose
// per-layer tensor is one-dimensional (a StackedSlices slice is decided on its slice shape, so
// llm.c's stacked [L, C] biases and gains, declared as slices, are not decayed); else none.
// `explicit_groups` is empty or has one entry per parameter. InvalidArgument naming the
// parameter or pattern for a bad value; a pattern that matches no parameter appends a line to
// `notes` ("zerort.param_groups[k]: ..."), and so does, with no_decay_1d, a parameter the rule
// decays where the trainer may not mean it ("no_decay_1d: parameter '...'"): a whole
// [L, ...] tensor whose leading dimension is the layer count of the model's stacked slices, a
// slice-like name outside a complete run, a matrix with a dimension of 1.
absl::StatusOr<GroupChoice> ResolveParamGroups(
    const std::vector<memory::ParamSpec>& specs, const std::vector<ParamGroupConfig>& patterns,
    const std::vector<std::optional<ParamGroup>>& explicit_groups, bool no_decay_1d,
    std::vector<std::string>* notes);

class AdamWGroups {
 public:
  AdamWGroups(const memory::Plan& plan, const ShardLayout& layout, GroupChoice choice);

  // Every unit's ranges with the constants of optimizer step `step` under `scalars` (validated
  // by offload::MakeAdamWStepParams: InvalidArgument naming the value). Valid until the next
  // call.
  absl::StatusOr<const std::vector<std::vector<offload::AdamWRange>>*> Prepare(
      const AdamWScalars& scalars, int64_t step);

  const GroupChoice& choice() const { return choice_; }

 private:
  const GroupChoice choice_;
  std::vector<std::vector<offload::AdamWRange>> ranges_;  // per trainable unit; constants from Prepare
  std::vector<std::vector<int>> range_group_;             // per unit, per range: group or -1
  std::vector<offload::AdamWStepParams> by_group_;        // [0]: none; [g + 1]: group g
};

}  // namespace zero_internal
}  // namespace zerort

#endif  // ZERORT_ZERO_INTERNAL_ADAMW_GROUPS_H_
