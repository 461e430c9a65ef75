// The "auto" values of a config, resolved: the unit sizes from the model's hidden size
// (ResolveUnitSizes), and every other "auto" from what the trainer knows (AutoFill,
// ResolveAuto), as DeepSpeed's Hugging Face integration fills them. "stage": "auto" is the
// planner's (zero/planner.h), which includes this header.
//
//   AutoFill fill;
//   fill.hidden_size = 768;
//   fill.compute_dtype = DType::kBF16;
//   RETURN_IF_ERROR(ResolveAuto(fill, specs, &config));  // config.notes says what each became
//   ASSIGN_OR_RETURN(PlanChoice choice, ChoosePlan(specs, config, world, rank));
//
// Thread safety: pure functions (ResolveAuto writes only *config).
#ifndef ZERORT_ZERO_AUTO_FILL_H_
#define ZERORT_ZERO_AUTO_FILL_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/dtype.h"
#include "comm/launch_env.h"
#include "memory/plan.h"
#include "zero/config.h"

namespace zerort {

// The unit sizes a plan uses. A reduce_bucket_size left "auto" (kAutoSize, the default) makes
// one unit per registered module (PlanOptions::unit_per_module): the trainer's modules are what
// it gathers in stage 3, and merged modules would size every bucket and slot of their class.
// The other sizes left "auto" follow the model as in DeepSpeed's Hugging Face integration:
// stage3_prefetch_bucket_size = 0.9 * h * h, stage3_param_persistence_threshold = 10 * h, where
// h, the hidden size, is the smaller of the largest parameter's two largest dimensions (a
// vector's: its square root). So a small model gets small units, and stage-3 buckets and gather
// slots shrink with the model instead of staying at DeepSpeed's fixed 5e8-element default.
// Explicit values are kept as written (a written reduce_bucket_size merges modules up to it).
struct UnitSizes {
  int64_t hidden = 0;                 // h (computed whether or not any size is auto)
  int64_t largest_module = 0;         // elements of the largest module
  bool per_module = false;            // reduce_bucket_size "auto": one unit per module
  // PlanOptions::unit_target_elements: as written, or the largest module with per_module.
  int64_t reduce_bucket_size = 0;
  int64_t prefetch_bucket_size = 0;   // PlanOptions::prefetch_elements
  int64_t persistence_threshold = 0;  // PlanOptions::persistence_threshold
  std::string reason;                 // what was derived and from what; "" when nothing was
};
// `hidden` > 0 replaces the h read off `specs` (a trainer that knows its model's hidden size).
UnitSizes ResolveUnitSizes(absl::Span<const memory::ParamSpec> specs, const Config& config,
                           int64_t hidden = 0);

// What a trainer knows that a config may leave "auto" (Hugging Face's convention: "auto" means
// the trainer fills the value in at run time). Every field is optional; an unset one falls back
// to the rule ResolveAuto documents for its key.
struct AutoFill {
  std::optional<int64_t> hidden_size;  // h for the unit sizes; else read off the parameters
  std::optional<int64_t> world_size;   // data-parallel ranks, for the batch-size check
  std::optional<int64_t> train_batch_size;
  std::optional<int64_t> train_micro_batch_size_per_gpu;
  std::optional<int64_t> gradient_accumulation_steps;
  std::optional<DType> compute_dtype;  // decides bf16.enabled / fp16.enabled "auto"
  std::optional<double> lr, beta1, beta2, eps, weight_decay, gradient_clipping;
  // scheduler.params
  std::optional<int64_t> total_num_steps, warmup_num_steps;
  std::optional<double> warmup_min_lr, warmup_max_lr;
};

// Reads an AutoFill from a JSON object whose keys are the field names above ("compute_dtype":
// "bf16"); unknown keys and wrong types are InvalidArgument naming the key. For the C ABI and
// `zerort plan --fill`.
absl::StatusOr<AutoFill> ParseAutoFill(absl::string_view json_text);

// Replaces every "auto" of `config` (config->auto_keys, and the unit sizes left kAutoSize) with a
// value, and adds one note per key: "<path>: auto -> <value> (<why>)". The rules, in
// docs/config.md: the prefetch and persistence sizes from the fill's hidden_size (without one they
// stay kAutoSize and the planner derives h from `specs`); reduce_bucket_size stays kAutoSize, one
// unit per module, noted when the fill has a hidden_size; bf16/fp16.enabled from fill.compute_dtype
// (false without one); optimizer and gradient-clipping values from the fill, else zerort's
// defaults; gradient_accumulation_steps from the fill, else train / (micro * world) when all are
// known, else 1; scheduler warmup_min_lr from the fill, else 0; warmup_max_lr from the fill, else
// the optimizer's lr; warmup_num_steps from the fill, else DeepSpeed's 1000; total_num_steps from
// the fill only. Then checks train_batch_size = micro * gradient_accumulation_steps * world when
// all four are known. Errors (InvalidArgument, all of them in one Status like ParseConfig's): an
// "auto" no rule fills, inconsistent batch sizes, bf16 and fp16 both enabled.
//
// `purpose` kPlan is for a plan alone (`zerort plan`): an "auto" that no rule fills but that
// cannot change the plan (the scheduler's and optimizer's values, gradient_clipping) is not an
// error then but a note carrying the error Engine creation gives for it
// ("... (not needed for a plan; Engine creation refuses it)"), and stays in auto_keys.
enum class AutoPurpose { kEngine, kPlan };
absl::Status ResolveAuto(const AutoFill& fill, absl::Span<const memory::ParamSpec> specs,
                         Config* config, AutoPurpose purpose = AutoPurpose::kEngine);

// zerort.ranks_per_node left 0 (not known): taken from the launcher that started this rank
// (`launch`, from comm::LaunchInfoFromEnv: torchrun's LOCAL_WORLD_SIZE, mpirun's
// OMPI_COMM_WORLD_LOCAL_SIZE, srun's tasks per node), as DeepSpeed infers its node size, but
// only when the launcher describes this engine's ranks placed in consecutive blocks per node:
// its world size and rank are `world_size` and `rank`, its local size L divides the world and
// its local rank is rank % L. A round-robin placement (mpirun --map-by node) fails that and
// keeps 0; Engine::Create does not call it for in-process groups, whose threads share one
// process's variables. Each rank decides alone: where only some ranks pass, Engine::Create's
// agreement check fails on every rank, naming zerort.ranks_per_node and both values.
// Adds a note saying what it took, or why it took nothing when a launcher was found; changes
// nothing when ranks_per_node is set or no launcher variables are present (NotFound).
void FillRanksPerNode(const absl::StatusOr<comm::LaunchInfo>& launch, int world_size, int rank,
                      Config* config);

}  // namespace zerort

#endif  // ZERORT_ZERO_AUTO_FILL_H_
