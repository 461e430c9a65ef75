// The planner front: turns a Config into memory::PlanOptions and resolves "stage": "auto".
//
// `"stage": "auto"` picks the cheapest configuration whose plan fits the memory budget: the
// lowest stage first (fewer bytes on the wire), then optimizer offload, then parameter offload,
// then (when offload_optimizer.nvme_path is set) the optimizer state on NVMe, which needs little
// host memory, and says which it chose and why. When nothing fits, the error names the smallest requirement
// found and the world size at which the model would fit.
//
//   ASSIGN_OR_RETURN(zerort::PlanChoice choice, zerort::ChoosePlan(specs, config, world, rank));
//   std::cout << choice.reason << "\n";
//
// Thread safety: pure functions.
#ifndef ZERORT_ZERO_PLANNER_H_
#define ZERORT_ZERO_PLANNER_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "memory/plan.h"
// The other "auto" values (unit sizes, the trainer's AutoFill): a caller of ChoosePlan resolves
// them first, and the planner resolves the unit sizes left "auto".
#include "zero/auto_fill.h"
#include "zero/config.h"

namespace zerort {

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
