// The zerort configuration: the JSON file a trainer hands the engine, parsed into plain structs.
//
// Key names follow DeepSpeed wherever DeepSpeed has the setting, so a DeepSpeed config usually
// parses unchanged; docs/config.md lists every key with its default, constraint and DeepSpeed
// equivalent. Parsing is strict: an unknown key, a duplicate key, a value of the wrong type or
// out of range is an error that names the key's JSON path, and one parse reports every such
// problem at once. DeepSpeed keys that have no effect here, and foreign top-level keys, are
// accepted and reported one line each in Config::notes (errors in strict mode). Values written
// "auto" are listed in Config::auto_keys for ResolveAuto (zero/auto_fill.h) to fill.
//
//   ASSIGN_OR_RETURN(zerort::Config config, zerort::LoadConfigFile("ds_config.json"));
//   for (const std::string& note : config.notes) std::cerr << note << "\n";
//   // config.zero.stage_auto: the planner picks the stage within config.zero.memory_budget.
//
// Thread safety: the structs are plain values; the functions are pure and thread-safe.
#ifndef ZERORT_ZERO_CONFIG_H_
#define ZERORT_ZERO_CONFIG_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/dtype.h"

namespace zerort {

// Where offloaded state lives: host memory, or files under nvme_path (ZeRO-Infinity).
enum class OffloadDevice { kNone, kCpu, kNvme };

// zero_optimization.offload_optimizer: fp32 master weights and Adam moments in host memory, or
// in files under nvme_path streamed through pinned buffers.
struct OffloadOptimizerConfig {
  OffloadDevice device = OffloadDevice::kNone;
  bool pin_memory = true;  // page-locked host buffers (faster, asynchronous copies)
  int buffer_count = 4;    // >= 0: host staging buffers for gradient copies in flight (0 = 1)
  std::string nvme_path;   // REQUIRES non-empty when device == kNvme: a directory on local disk
  // [0, 1]: the fraction of each rank's optimizer state that is offloaded (DeepSpeed's
  // meaning); the rest stays on the device, whole units of it (memory::PlanOptions::
  // offload_optimizer_ratio). Read only with a device; stages 1-3, "cpu" or "nvme".
  double ratio = 1.0;
};

// zero_optimization.offload_param: the bf16/fp16 parameter shard in host memory or under
// nvme_path. Stage 3 only. With "nvme" the optimizer step (on the host with offload_optimizer,
// else on the device) writes each new shard to the file through the pinned buffers.
struct OffloadParamConfig {
  OffloadDevice device = OffloadDevice::kNone;
  bool pin_memory = true;
  std::string nvme_path;           // REQUIRES non-empty when device == kNvme
  int buffer_count = 5;            // >= 0; >= 1 with nvme: pinned read-ahead buffers
  int64_t buffer_size = 100000000;  // >= 0; >= 1 with nvme: elements in each of those buffers
};

// aio: DeepSpeed's asynchronous-I/O settings for NVMe offload, with DeepSpeed's defaults.
struct AioConfig {
  int64_t block_size = 1048576;  // >= 4096 bytes, a multiple of 4096: one I/O request
  int queue_depth = 8;           // >= 1: requests in flight per thread
  bool single_submit = false;    // submit requests one at a time instead of in batches
  bool overlap_events = true;    // submit new requests before reaping all completions
  int thread_count = 1;          // >= 1: I/O threads
};

// zero_optimization.memory_budget (ours): what "stage": "auto" must fit into, per rank.
struct MemoryBudget {
  int64_t device_bytes = 0;  // >= 0; 0 = no limit
  int64_t host_bytes = 0;    // >= 0; 0 = no limit
};

// A unit size written as "auto" (the default): the planner derives it from the model's hidden
// size h, as DeepSpeed's Hugging Face integration does (zero/auto_fill.h ResolveUnitSizes).
inline constexpr int64_t kAutoSize = -1;

// zero_optimization. Sizes are in elements, as in DeepSpeed.
struct ZeroConfig {
  bool stage_auto = false;  // "stage": "auto": the planner picks the stage (needs memory_budget)
  int stage = 0;            // 0..3, meaningful when !stage_auto
  // >= 1 elements: the unit (bucket) size target; kAutoSize = h * h
  int64_t reduce_bucket_size = kAutoSize;
  // DeepSpeed switches for what zerort always does: it reduces each unit during backward, keeps
  // gradients in flat buffers and all-gathers one unit at a time. Type-checked and kept as
  // written, but read by nothing: not settings, so operator== and ResolvedConfigJson leave them
  // out, and each one given adds a line to Config::notes.
  int64_t allgather_bucket_size = 500000000;  // >= 1 elements
  bool overlap_comm = true;
  bool contiguous_gradients = true;
  OffloadOptimizerConfig offload_optimizer;
  OffloadParamConfig offload_param;                     // REQUIRES stage 3 when enabled
  // >= 0 elements; 0 = no prefetch; kAutoSize = 0.9 * h * h
  int64_t stage3_prefetch_bucket_size = kAutoSize;
  // >= 0 elements; kAutoSize = 10 * h
  int64_t stage3_param_persistence_threshold = kAutoSize;
  int64_t stage3_max_live_parameters = 1000000000;      // >= 1 elements
  // HSDP / MiCS: shard within groups of this many consecutive ranks, replicate across groups
  // (stages 1-3). -1 (DeepSpeed's default) or 0: flat, one group of every rank. Otherwise it
  // must divide the world size (checked when the plan is made).
  int mics_shard_size = -1;
  // MiCS: with mics_shard_size spanning nodes, each in-group all-gather runs in two steps,
  // across nodes among the ranks of one node position, then within the node (needs
  // zerort.ranks_per_node).
  bool mics_hierarchical_params_gather = false;
  // hpZ (ZeRO++): stage 3 keeps, after a unit's first all-gather since the last update, a
  // secondary copy of 1/K of it, so later gathers run within the K consecutive ranks of a node.
  // 1: off. Otherwise it must divide the world size (checked when the plan is made).
  int zero_hpz_partition_size = 1;
  MemoryBudget memory_budget;
};

// fp16 loss scaling. loss_scale == 0 selects dynamic scaling, which starts at
// 2^initial_scale_power, halves after `hysteresis` consecutive overflows, and doubles after
// `loss_scale_window` clean steps, never going below min_loss_scale.
struct Fp16Config {
  double loss_scale = 0;         // >= 0; 0 = dynamic, else a fixed scale
  int initial_scale_power = 16;  // 0..127
  int loss_scale_window = 1000;  // >= 1 steps
  int hysteresis = 2;            // >= 1 overflows
  double min_loss_scale = 1;     // > 0
};

// optimizer. Weight decay is always decoupled (AdamW); DeepSpeed's "Adam" with its default
// adam_w_mode=true is the same thing and is accepted as "AdamW".
struct OptimizerConfig {
  std::string type = "AdamW";  // always "AdamW" after parsing
  double lr = 1e-3;            // >= 0
  double beta1 = 0.9;          // [0, 1)
  double beta2 = 0.999;        // [0, 1)
  double eps = 1e-8;           // > 0
  double weight_decay = 0.01;  // >= 0
};

// zerort.param_groups[i] (ours): AdamW scalars for the parameters whose names match a pattern.
// A parameter takes the first group whose pattern matches; unmatched ones use `optimizer`.
struct ParamGroupConfig {
  std::string pattern;          // glob on ParamSpec::name ('*', '?')
  double weight_decay = 0;      // >= 0
  double lr_scale = 1;          // >= 0: multiplies the current learning rate
};

// scheduler: DeepSpeed's learning-rate schedules, with DeepSpeed's parameter names and defaults
// (zero/lr_schedule.h computes them). Only the parameters of `type` are read; the others keep
// their defaults.
enum class SchedulerType { kNone, kWarmupLR, kWarmupDecayLR, kWarmupCosineLR, kOneCycle,
                           kLRRangeTest };
enum class WarmupType { kLog, kLinear };
struct SchedulerConfig {
  SchedulerType type = SchedulerType::kNone;  // kNone: constant optimizer.params.lr
  // WarmupLR, WarmupDecayLR: from warmup_min_lr to warmup_max_lr over warmup_num_steps.
  double warmup_min_lr = 0;        // >= 0
  double warmup_max_lr = 0.001;    // >= 0
  int64_t warmup_num_steps = 1000; // >= 0 (DeepSpeed, and zerort, use max(2, this))
  WarmupType warmup_type = WarmupType::kLog;
  // WarmupDecayLR, WarmupCosineLR: >= 1, the step at which the decay reaches its end.
  int64_t total_num_steps = 0;
  // WarmupCosineLR: multiples of optimizer.params.lr.
  double warmup_min_ratio = 0;      // >= 0
  double cos_min_ratio = 0.0001;    // >= 0
  // OneCycle: up from cycle_min_lr to cycle_max_lr in cycle_first_step_size steps, back down in
  // cycle_second_step_size (-1: the same), then cycle_min_lr / (1 + decay_lr_rate * k /
  // decay_step_size) k steps later (no decay when either is 0).
  double cycle_min_lr = 0;                  // >= 0 (DeepSpeed requires it)
  double cycle_max_lr = 0;                  // >= 0 (DeepSpeed requires it)
  double decay_lr_rate = 0;                 // >= 0
  int64_t cycle_first_step_size = 2000;     // >= 1
  int64_t cycle_second_step_size = -1;      // >= 1, or -1 = cycle_first_step_size
  int64_t decay_step_size = 0;              // >= 0
  // LRRangeTest: lr_range_test_min_lr * (1 + lr_range_test_step_rate * step / step_size),
  // with step / step_size floored when lr_range_test_staircase.
  double lr_range_test_min_lr = 0.001;      // >= 0
  int64_t lr_range_test_step_size = 2000;   // >= 1
  double lr_range_test_step_rate = 1.0;     // >= 0
  bool lr_range_test_staircase = false;
};

// zerort.reserves (ours): device memory a training process uses outside the plan's buffers and
// the activations, one named line each in the device budget (zero/planner.h DeviceBudget). The
// defaults are estimates from one measurement (H200, CUDA 13.0, NCCL 2.28.9, world 1;
// docs/memory_budget.md): override them with what your own process measures.
struct ReservesConfig {
  int64_t cuda_context_bytes = 552599552;  // >= 0: 527 MiB, the CUDA context (measured)
  // >= 0: 612 MiB, counted when world_size > 1: the first communicator's 580 MiB at
  // initialisation plus 32 MiB at the first collective (measured; the engine uses one).
  int64_t nccl_communicator_bytes = 641728512;
  // Connection buffers: nccl_channels * min(world_size - 1, 2) * nccl_buffsize bytes, the two
  // ring neighbours of each channel (an estimate: LL/LL128 and tree buffers are not counted).
  int64_t nccl_buffsize = 4194304;  // >= 0 bytes: NCCL_BUFFSIZE's default, 4 MiB
  int nccl_channels = 32;           // >= 0: NCCL's usual channel count on NVLink
  int64_t cublas_workspace_bytes = 33554432;  // >= 0: cuBLAS's recommended 32 MiB on Hopper
  // >= 0: this fraction of (model-state buffers + activations) is kept free for the
  // allocator's fragmentation.
  double fragmentation_fraction = 0.05;
};

struct Config {
  ZeroConfig zero;
  // Compute dtype of parameters and gradients (optimizer state is fp32 unless a compact form
  // below is chosen). DeepSpeed's rule: bf16.enabled -> kBF16, fp16.enabled -> kF16, neither ->
  // kF32 (also when both blocks are absent). Both enabled is an error.
  DType compute_dtype = DType::kF32;
  // Compact optimizer state (docs/compact_state.md), bf16 parameters only (an error naming the
  // key otherwise):
  // bf16.bf16_optimizer_states: Adam's m and v in bf16 (DeepSpeed's meaning), rounded to
  // nearest even on store.
  bool bf16_optimizer_states = false;
  // bf16.bf16_master_weights_and_grads: the master weight is the bf16 parameter itself, rounded
  // stochastically after each update (DeepSpeed rounds to nearest; docs/config.md). Gradients
  // stay in the compute dtype as always (data_types.grad_accum_dtype may still ask for fp32).
  bool bf16_master_weights_and_grads = false;
  // zerort.store_param_remainders (ours; Megatron's store_param_remainders): the master is the
  // bf16 parameter plus a 16-bit remainder, the fp32 master bit for bit in 2 bytes beside the
  // parameter (the parameter then rounds ties away from zero). Not with the one above.
  bool store_param_remainders = false;
  // zerort.stochastic_rounding_seed (ours): >= 0, the seed of the stochastic rounding above;
  // fixed by default so that runs are reproducible.
  int64_t stochastic_rounding_seed = 0;
  Fp16Config fp16;  // read whenever present; used only when compute_dtype == kF16
  OptimizerConfig optimizer;
  // >= 0; global L2 norm limit, 0 = off. 1.0 is DeepSpeed's default since v0.19.3 (zerort's was
  // 0 before): a DeepSpeed config without the key clips here as it does there.
  double gradient_clipping = 1.0;
  int gradient_accumulation_steps = 1;  // >= 1
  // DeepSpeed's gradient scaling around the reduction. prescale_gradients: each rank divides
  // its gradients by the world size before the reduction sums them. Otherwise the gradients
  // are divided by gradient_predivide_factor (> 0) before the sum and by world /
  // gradient_predivide_factor after it (1.0: the reduction averages). docs/config.md states
  // the numerics.
  bool prescale_gradients = false;
  double gradient_predivide_factor = 1.0;
  int64_t comm_timeout_ms = 600000;     // >= 1 (ours): a collective taking longer fails
  int cpu_threads = 0;                  // >= 0 (ours): host AdamW threads, 0 = all cores
  // data_types.grad_accum_dtype: the dtype gradients are accumulated in across micro-steps on
  // the owned shard; nullopt = compute_dtype (DeepSpeed's default). kF32 adds an fp32 buffer.
  std::optional<DType> grad_accum_dtype;
  // communication_data_type: the dtype gradients are reduced in on the wire; nullopt =
  // compute_dtype.
  std::optional<DType> communication_dtype;
  AioConfig aio;
  std::vector<ParamGroupConfig> param_groups;
  // zerort.frozen_params (ours): comma-separated globs on ParamSpec::name; every parameter a
  // glob matches is frozen (no gradient, no optimizer state: memory/plan.h ParamSpec::frozen).
  // "" = none. A glob that matches nothing is an error of the planner, naming it.
  std::string frozen_params;
  // zerort.local_grad_accumulation (ours; stages 0-1): the micro-steps of a window add their
  // gradients locally and only the last one reduces (memory/plan.h PlanOptions); a trainer may
  // still ask for a reduction per micro-step with Engine::SetGradientSync(true).
  bool local_grad_accumulation = false;
  // zerort.ranks_per_node (ours): consecutive ranks that share a node (DeepSpeed infers it from
  // the launcher; torchrun's LOCAL_WORLD_SIZE, mpirun's OMPI_COMM_WORLD_LOCAL_SIZE). 0: not
  // known; an engine over MPI or NCCL then takes it from the launcher (FillRanksPerNode,
  // zero/auto_fill.h). Needed by mics_hierarchical_params_gather; `zerort plan` splits the bytes per step
  // into intra- and inter-node with it. Must divide the world size.
  int ranks_per_node = 0;
  SchedulerConfig scheduler;
  // zerort.strict (ours): every key that would be ignored with a note is an error instead.
  bool strict = false;
  ReservesConfig reserves;  // zerort.reserves (ours)
  // Batch sizes are the trainer's; written ones are kept only to check train_batch_size =
  // train_micro_batch_size_per_gpu * gradient_accumulation_steps * world size (ResolveAuto in
  // zero/auto_fill.h, once the world size is known). 0 = not given, or "auto" (not listed in
  // auto_keys: ResolveAuto takes a 0 from its fill). Not settings: operator== and
  // ResolvedConfigJson leave them out.
  int64_t train_batch_size = 0;
  int64_t train_micro_batch_size_per_gpu = 0;
  // JSON paths written as "auto" (Hugging Face's "the trainer fills this in"), canonical
  // spelling, in document order. The value behind each stays at its default until
  // ResolveAuto (zero/auto_fill.h) fills it; ResolvedConfigJson writes "auto" back for them.
  std::vector<std::string> auto_keys;
  // Accepted-but-ignored DeepSpeed keys and other remarks, one line each, each starting with the
  // JSON path it is about. Diagnostics, not settings: operator== ignores them.
  std::vector<std::string> notes;
};

bool operator==(const OffloadOptimizerConfig& a, const OffloadOptimizerConfig& b);
bool operator==(const OffloadParamConfig& a, const OffloadParamConfig& b);
bool operator==(const MemoryBudget& a, const MemoryBudget& b);
bool operator==(const ZeroConfig& a, const ZeroConfig& b);
bool operator==(const Fp16Config& a, const Fp16Config& b);
bool operator==(const OptimizerConfig& a, const OptimizerConfig& b);
bool operator==(const SchedulerConfig& a, const SchedulerConfig& b);
bool operator==(const AioConfig& a, const AioConfig& b);
bool operator==(const ParamGroupConfig& a, const ParamGroupConfig& b);
// Every setting; not `notes`, not the no-effect ZeroConfig fields, and not `stage` when both are
// "auto".
bool operator==(const Config& a, const Config& b);
inline bool operator!=(const Config& a, const Config& b) { return !(a == b); }

// "none" / "cpu" / "nvme", as written in the JSON. (Dtypes: DTypeName in base/dtype.h.)
absl::string_view OffloadDeviceName(OffloadDevice d);
// DeepSpeed's scheduler type names ("WarmupLR", ...); "" for kNone.
absl::string_view SchedulerTypeName(SchedulerType t);

// How a parse treats keys that have no effect here.
struct ParseOptions {
  // Every ignored key (a DeepSpeed key without effect, a foreign top-level key) is an error
  // instead of a note, as with "zerort": {"strict": true} in the config.
  bool strict = false;
};

// Parses and validates a JSON config. `source` names the text in error messages (a file name).
// Every problem of the document is reported in one Status, one line each, each line
// "<source>: <JSON path>: <problem>" (a first line "<source>: N problems:" when there are
// several). Errors: InvalidArgument for malformed JSON ("<source>:LINE:COL: ..."), unknown or
// duplicate keys, wrong types and out-of-range values, inconsistent keys; Unimplemented when
// every problem is a DeepSpeed feature zerort does not have (e.g. "prescale_gradients": true).
absl::StatusOr<Config> ParseConfig(absl::string_view json_text,
                                   absl::string_view source = "<config>",
                                   const ParseOptions& options = {});

// Reads and parses a file; every error names the file. NotFound / PermissionDenied when it
// cannot be read. "-" reads standard input, and a pipe or FIFO is read to its end, for configs
// generated on the fly; like a file, at most 16 MiB (kMaxJsonFileBytes), else InvalidArgument.
// A stream silent for 10 s (a FIFO nobody writes) is DeadlineExceeded, never waited on forever.
absl::StatusOr<Config> LoadConfigFile(const std::string& path, const ParseOptions& options = {});

// Every setting with its effective value as pretty JSON, in the documented order (the keys that
// have no effect are left out). ParseConfig of the
// result gives back an equal Config, and dumping that again gives the same text.
std::string ResolvedConfigJson(const Config& config);

// Checks a Config built in code (not parsed) against the same rules ParseConfig applies, with the
// same messages. OK for every Config that ParseConfig returns.
absl::Status ValidateConfig(const Config& config);

}  // namespace zerort

#endif  // ZERORT_ZERO_CONFIG_H_
