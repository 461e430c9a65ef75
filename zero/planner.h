// The planner front: turns a Config into memory::PlanOptions and resolves "stage": "auto".
//
// `"stage": "auto"` picks the cheapest configuration whose plan fits the memory budget: the
// lowest stage first (fewer bytes on the wire), then optimizer offload, then parameter offload,
// then (when offload_optimizer.nvme_path is set) the optimizer state on NVMe, which needs little
// host memory, and says which it chose and why. Over several nodes (Config::ranks_per_node
// known and smaller than the world, no layout in the config) it tries each of those in HSDP
// shard groups too, node-sized first, since a smaller group sends fewer bytes between nodes.
// Given a Workload (or activations declared on the
// ParamSpecs), "fits" means the whole device budget fits: model-state buffers, the activations of
// one micro-batch and the runtime's reserves (DeviceBudget, docs/memory_budget.md), and the
// reason names the term that decided. When nothing fits, the error names the smallest requirement
// found and the world size at which the model would fit.
//
//   ASSIGN_OR_RETURN(zerort::PlanChoice choice, zerort::ChoosePlan(specs, config, world, rank));
//   std::cout << choice.reason << "\n";
//
// Thread safety: pure functions.
#ifndef ZERORT_ZERO_PLANNER_H_
#define ZERORT_ZERO_PLANNER_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "memory/plan.h"
// The other "auto" values (unit sizes, the trainer's AutoFill): a caller of ChoosePlan resolves
// them first, and the planner resolves the unit sizes left "auto".
#include "zero/auto_fill.h"
#include "zero/config.h"
#include "zero/model_spec.h"

namespace zerort {

// Plan options for an explicit stage, with the unit sizes resolved against `specs`.
// REQUIRES: !config.zero.stage_auto (InvalidArgument).
absl::StatusOr<memory::PlanOptions> PlanOptionsFromConfig(absl::Span<const memory::ParamSpec> specs,
                                                          const Config& config, int world_size,
                                                          int rank);

// What the trainer's forward and backward put on the device besides the plan's buffers: either a
// transformer's shape for the activation formula (TransformerActivations, zero/model_spec.h), or
// the activation bytes the trainer declared on its ParamSpecs (activation_bytes_per_sample).
// With neither, activations and reserves are not counted and the budget says so in its note.
struct Workload {
  // >= 0 sequences per micro-batch; 0: the config's train_micro_batch_size_per_gpu, else 1.
  int64_t micro_batch = 0;
  int64_t seq = 0;  // >= 0 tokens per sequence; the formula needs it (0: not counted)
  std::optional<TransformerShape> shape;  // REQUIRES: not together with declared activations
  Recompute recompute = Recompute::kNone;
  // Whether the rank holds an NCCL communicator (its reserve line). Unset: assumed exactly when
  // the world has more than one rank, which is all `zerort plan` can know; the engine says what
  // its communicator is, since a trainer on one GPU often creates one anyway (the GPT demo does,
  // and the H200 measurement behind the default was at world 1).
  std::optional<bool> nccl_communicator;
};

// One named line of the device budget.
struct BudgetLine {
  std::string name;
  int64_t bytes = 0;
};

// Everything one rank puts on its device: the plan's buffers, the activations of one micro-batch,
// and the runtime's reserves (config.reserves). docs/memory_budget.md writes the lines out.
struct DeviceBudget {
  // Whether activations and reserves are counted; false keeps the old, model-state-only planning
  // (total_bytes == model_state_bytes) and `note` says so.
  bool counted = false;
  std::string note;
  int64_t model_state_bytes = 0;   // plan.device_bytes(): every buffer the engine allocates there
  int64_t micro_batch = 0;         // the micro-batch the activations are for (counted only)
  std::string activation_source;   // the formula and its inputs, or "declared by the model"
  std::vector<BudgetLine> activations;
  int64_t activation_bytes = 0;
  std::vector<BudgetLine> reserves;  // cuda context, nccl, cublas workspace, fragmentation
  int64_t reserve_bytes = 0;
  int64_t total_bytes = 0;  // the sum, saturating at 2^63-1: what the device budget must hold
};

// The budget of `plan` (its options give the world size). InvalidArgument: both a shape and
// declared activations, or the activation formula's own errors.
absl::StatusOr<DeviceBudget> MakeDeviceBudget(const memory::Plan& plan, const Config& config,
                                              const Workload& workload);

struct PlanChoice {
  memory::Plan plan;
  DeviceBudget budget;  // the device lines of `plan`
  bool fits = true;     // within config.zero.memory_budget (always true without a budget)
  std::string reason;   // one paragraph: what was chosen and why, and how "auto" sizes resolved
  // Which term put the candidate auto preferred to this one (or, for an explicit stage that does
  // not fit, this one) over the device budget: "model state" when it is over alone, else the term
  // without which it would have fit, "activations" or "reserves" ("activations and reserves"
  // when either, or only both, would have to go; reserves as counted, fragmentation included);
  // "" when nothing was over, or the host budget decided.
  std::string decided_by;
};

// Explicit stage: the plan for it, with `fits` checked against the budget if one is set.
// Auto: the first candidate of (stage 0, 1, 2, 3; then 1, 2, 3 with optimizer offload; then 3
// with optimizer and parameter offload) that fits; over several nodes, stages 1-3 (then 1-3
// with optimizer offload) at each shard group from the node size up to flat, before parameter
// offload. ResourceExhausted when none does.
// The device figure compared with the budget is DeviceBudget::total_bytes: model state alone
// without a workload (and without declared activations), else activations and reserves too.
absl::StatusOr<PlanChoice> ChoosePlan(absl::Span<const memory::ParamSpec> specs,
                                      const Config& config, int world_size, int rank);
absl::StatusOr<PlanChoice> ChoosePlan(absl::Span<const memory::ParamSpec> specs,
                                      const Config& config, int world_size, int rank,
                                      const Workload& workload);

// Sets ParamSpec::frozen on every parameter that a glob of config.frozen_params matches (the
// flags already set stay). InvalidArgument naming a glob that matches no parameter. ChoosePlan
// and FitMicroBatch apply it themselves; Engine::Create applies it before planning.
absl::Status MarkFrozen(const Config& config, std::vector<memory::ParamSpec>* specs);

// The largest micro-batch of one candidate that fits the budget.
struct MicroBatchFit {
  memory::PlanOptions options;
  std::string description;  // "stage 2 + optimizer offload"
  int64_t micro_batch = 0;  // 0: not even one sequence fits
  DeviceBudget budget;      // at micro_batch (at 1 when that is 0)
  std::string why_none;     // micro_batch == 0: what is over
};

// For each auto candidate (in ChoosePlan's order), the largest micro-batch (at most 2^30) whose
// DeviceBudget::total_bytes fits config.zero.memory_budget.device_bytes and whose host bytes fit
// host_bytes. REQUIRES: a device budget and counted activations (InvalidArgument otherwise).
absl::StatusOr<std::vector<MicroBatchFit>> FitMicroBatch(absl::Span<const memory::ParamSpec> specs,
                                                         const Config& config, int world_size,
                                                         int rank, const Workload& workload);

}  // namespace zerort

#endif  // ZERORT_ZERO_PLANNER_H_
