// The planner front: turns a Config into memory::PlanOptions and resolves "stage": "auto".
//
// `"stage": "auto"` picks the cheapest configuration whose plan fits the memory budget: the
// lowest stage first (fewer bytes on the wire), then optimizer offload, then parameter offload,
// and says which it chose and why. When nothing fits, the error names the smallest requirement
// found and the world size at which the model would fit.
//
//   ASSIGN_OR_RETURN(zerort::PlanChoice choice, zerort::ChoosePlan(specs, config, world, rank));
//   std::cout << choice.reason << "\n";
//
// Thread safety: pure functions.
#ifndef ZERORT_ZERO_PLANNER_H_
#define ZERORT_ZERO_PLANNER_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "memory/plan.h"
#include "zero/config.h"

namespace zerort {

// The unit sizes a plan uses. Each size the config leaves "auto" (kAutoSize, the default)
// follows the model as in DeepSpeed's Hugging Face integration: stage3_prefetch_bucket_size =
// 0.9 * h * h, stage3_param_persistence_threshold = 10 * h, and reduce_bucket_size = h * h but
// never less than the largest module (a unit is also the stage-3 gather unit, and a trainer
// gathers whole modules), where h, the hidden size, is the smaller of the largest parameter's
// two largest dimensions (a vector's: its square root). So a small model gets small units, and
// stage-3 buckets and gather slots shrink with the model instead of staying at DeepSpeed's fixed
// 5e8-element default. Explicit values are kept as written.
struct UnitSizes {
  int64_t hidden = 0;                 // h (computed whether or not any size is auto)
  int64_t largest_module = 0;         // elements of the largest module
  int64_t reduce_bucket_size = 0;     // PlanOptions::unit_target_elements
  int64_t prefetch_bucket_size = 0;   // PlanOptions::prefetch_elements
  int64_t persistence_threshold = 0;  // PlanOptions::persistence_threshold
  std::string reason;                 // what was derived and from what; "" when nothing was
};
UnitSizes ResolveUnitSizes(absl::Span<const memory::ParamSpec> specs, const Config& config);

// Plan options for an explicit stage, with the unit sizes resolved against `specs`.
// REQUIRES: !config.zero.stage_auto (InvalidArgument).
absl::StatusOr<memory::PlanOptions> PlanOptionsFromConfig(absl::Span<const memory::ParamSpec> specs,
                                                          const Config& config, int world_size,
                                                          int rank);

struct PlanChoice {
  memory::Plan plan;
  bool fits = true;     // within config.zero.memory_budget (always true without a budget)
  std::string reason;   // one paragraph: what was chosen and why, and how "auto" sizes resolved
};

// Explicit stage: the plan for it, with `fits` checked against the budget if one is set.
// Auto: the first candidate of (stage 0, 1, 2, 3; then 1, 2, 3 with optimizer offload; then 3
// with optimizer and parameter offload) that fits. ResourceExhausted when none does.
absl::StatusOr<PlanChoice> ChoosePlan(absl::Span<const memory::ParamSpec> specs,
                                      const Config& config, int world_size, int rank);

}  // namespace zerort

#endif  // ZERORT_ZERO_PLANNER_H_
