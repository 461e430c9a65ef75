// Engine: ZeRO-sharded parameter, gradient and optimizer-state memory behind one embedding API.
//
// The trainer owns forward and backward; the engine owns the memory (exactly what memory::Plan
// lists), the collectives and the optimizer step. Every rank creates one Engine over its
// Communicator; all ranks must make the same sequence of collective-bearing calls (InitParams,
// Gather, GradReady, Step or ComputeGradNorm + ApplyStep / SkipStep, GatherMasterWeights,
// AllReduceScalars, AllGatherScalars, Barrier).
//
// One micro-step (gradient_accumulation_steps of them per optimizer step):
//
//   (or, without tracking units: engine->AcquireParams(layer_params) ... engine->ReleaseParams(layer_params))
//   for unit in forward order:                 // stage 3 only; no-ops otherwise
//     engine->Gather(unit); forward(unit uses engine->param(i)); engine->Release(unit);
//   for unit in backward order (plan().units order):
//     engine->Gather(unit);                    // stage 3
//     for each param i of unit: write dLoss/dparam into engine->grad(i); engine->GradReady(i);
//     engine->Release(unit);                   // stage 3
//   ASSIGN_OR_RETURN(StepStats stats, engine->Step());   // applies AdamW every GAS micro-steps
//
// Hyperparameters: SetLearningRate / SetHyperparams before a step set what it uses; without
// them the step takes the config's scheduler block, else EngineOptions::lr_schedule(t), else
// the config's optimizer.lr.
// Parameter groups (weight decay and lr multiplier per parameter) come from
// EngineOptions::param_groups, Config::param_groups patterns, or EngineOptions::no_decay_1d.
//
// Split step, when the trainer decides on the norm (skip outliers, its own clipping): on the
// last micro-step of a window call ComputeGradNorm() instead of Step(), then ApplyStep() or
// SkipStep() on every rank alike (the engine checks that the ranks agree).
//
// Buffers:
//  - param(i): the compute-dtype parameter (bf16/fp16 bits, or float in fp32 mode). Stages 0-2:
//    stable for the engine's lifetime. Stage 3: valid between Gather(unit) and Release(unit)
//    (always valid for persistent units).
//  - grad(i): the compute-dtype gradient buffer for this micro-step, zero-filled when handed
//    out; the trainer writes (or adds) the gradient of this micro-batch, scaled by the loss
//    scale in fp16 mode. Valid until GradReady of the last parameter of its unit. Stages 0-1:
//    a stable pointer; stages 2-3: a slot of a reused bucket. Or the trainer's own buffer,
//    handed over with SetGradBuffer (reduced in place where the layout allows).
//  - GradReady: once every parameter of a unit is ready, that unit is reduced at once
//    (all-reduce in stage 0, reduce-scatter otherwise), overlapping the rest of backward.
//
// Step() (on the last micro-step of an accumulation window): one overflow verdict agreed by all
// ranks (an Inf/NaN anywhere skips the step everywhere and leaves parameters, m, v and the step
// count unchanged), the global L2 norm across shards (the same value on every rank), clipping by
// gradient_clipping, AdamW on the owned shards (on the device, or on the host when offloaded),
// then all-gather of the new parameters (stages 1-2). Dynamic fp16 loss scaling follows
// DeepSpeed (initial_scale_power, loss_scale_window, hysteresis, min_loss_scale); an overflow
// at the minimum scale is an error.
//
// Determinism: with a deterministic communicator (the CPU backends), stages 0-3 with and without
// offload give bit-identical fp32 master weights, because every stage reduces each element in
// the same order, accumulates micro-steps after the reduction, and sums the norm from the same
// per-shard partials.
//
// Inside (zero/internal/, one class per mechanism): ShardLayout (this rank's region of every
// unit), GradBuckets (gradient buffers, reduction per unit), ParamGatherer (all-gathers,
// stage-3 slots), StreamOrder (compute and comm streams), HostCollectives, GradNorm,
// OwnedSnapshot, StepTimer; the offloaded step is offload/pipeline.h.
//
// Thread safety: not thread-safe; each rank's Engine is used by that rank's thread.
#ifndef ZERORT_ZERO_ENGINE_H_
#define ZERORT_ZERO_ENGINE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "comm/agree.h"
#include "comm/communicator.h"
#include "memory/plan.h"
#include "device/device.h"
#include "zero/config.h"
#include "zero/hyperparams.h"
#include "zero/loss_scaler.h"

namespace zerort {

// What one Step() did.
struct StepStats {
  bool boundary = false;    // false: a micro-step inside an accumulation window (nothing applied)
  bool skipped = false;     // overflow: the update was skipped on every rank
  int64_t step = 0;         // optimizer steps applied so far (AdamW's t)
  double loss_scale = 1;    // scale of the gradients of this window (1 unless fp16)
  double grad_norm = 0;     // global L2 norm of the unscaled, averaged gradients before clipping
  double clip_coef = 1;     // factor applied by gradient clipping (1 = not clipped)
  double lr = 0;            // boundary: the base learning rate of this step (before lr_scale)
  double weight_decay = 0;  // boundary: the weight decay of parameters in no group
  int64_t comm_bytes = 0;   // bytes this rank sent since the previous boundary
  double reduce_ms = 0;     // time in gradient reductions since the previous boundary
  double optimizer_ms = 0;  // norm, overflow check and AdamW
  double gather_ms = 0;     // parameter all-gathers (stages 1-3, including stage-3 Gather)
  double offload_wait_ms = 0;  // offload: host time waiting for gradient/parameter copies
  double total_ms = 0;      // wall time of this Step() call
};

// Bytes the engine allocated for each memory kind, beside what the plan listed.
struct MemoryReport {
  int64_t planned[memory::kNumMemoryKinds] = {0, 0, 0, 0};
  int64_t allocated[memory::kNumMemoryKinds] = {0, 0, 0, 0};

  // What the plan counted on this rank's device besides the engine's buffers, so that a trainer
  // which measures its own peak can check the plan against it. The activations are the ones the
  // trainer declared (memory::ParamSpec::activation_bytes_per_sample summed over the model)
  // times the micro-batch (train_micro_batch_size_per_gpu, else 1): per rank, since every rank
  // runs its own micro-batch, and held by the trainer's allocator, never by the engine. All
  // four are 0 and device_budget_bytes is the model-state buffers alone when nothing was
  // declared (the plan then counts neither activations nor reserves: zero/planner.h).
  int64_t activation_bytes_per_sample = 0;
  int64_t micro_batch = 0;
  int64_t activation_bytes = 0;
  // The plan's whole device budget per rank (DeviceBudget::total_bytes): model-state buffers +
  // declared activations + the config's reserves (CUDA context, NCCL, cuBLAS, fragmentation).
  int64_t device_budget_bytes = 0;

  // Gradient hand-off declared before the plan (memory::ParamSpec::grad_buffer): the declared
  // gradients' bytes (the trainer's memory, in the compute dtype), those reduced straight from
  // the trainer's buffers and those copied into the engine's at GradReady
  // (Engine::grad_copy_reason says why); and the engine's own gradient storage, planned and
  // allocated (memory::GradStorageBytes: full gradients, reduced shard, accumulators, buckets).
  int64_t trainer_grad_bytes = 0;
  int64_t trainer_grad_in_place_bytes = 0;
  int64_t trainer_grad_copied_bytes = 0;
  int64_t engine_grad_bytes = 0;
};

// The engine's scalar training state: what a checkpoint stores besides tensors. The loss
// scaler's part (loss_scale, scaler_hysteresis_left, scaler_iter, scaler_last_overflow) is
// zero/loss_scaler.h's ScalerState.
struct EngineState : ScalerState {
  int64_t step = 0;  // optimizer steps applied (AdamW's t)
  // The scalars the trainer last set (SetHyperparams / SetLearningRate), and whether it set
  // any: a restored state with hyperparams_set keeps them; without, the engine's config and
  // lr_schedule stay in charge (so a resumed run may change the config's optimizer block).
  AdamWScalars hyperparams;
  bool hyperparams_set = false;
};

// ComputeGradNorm's verdict, the same on every rank.
struct GradNormInfo {
  double norm = 0;         // global L2 norm of the unscaled, averaged gradients (Inf on overflow)
  bool overflow = false;   // an Inf/NaN on some rank: only SkipStep() is allowed
  double clip_coef = 1;    // what gradient_clipping would apply (1 = not clipped)
  double loss_scale = 1;   // scale of this window's gradients (1 unless fp16)
};

// ApplyStep's per-step overrides of the config.
struct ApplyOptions {
  // Replaces the config's clipping factor for this step (the gradients are multiplied by it
  // before AdamW): finite, >= 0, the same on every rank.
  std::optional<double> clip_coef;
};

// How the engine meets the trainer's device work.
struct EngineOptions {
  // The trainer's compute stream (a cudaStream_t on the CUDA device; nullptr = the default
  // stream). The engine enqueues its device work on it, so gradients written there before
  // GradReady and parameters read there after Gather are ordered without host waits.
  Device::Stream compute_stream = nullptr;

  // Per parameter (indexed like Create's `params`), or empty: the parameter's group. Unset
  // entries fall to Config::param_groups (first matching glob), then to no_decay_1d.
  std::vector<std::optional<ParamGroup>> param_groups;
  // Puts one-dimensional parameters no earlier rule placed into a group with weight decay 0
  // (biases, norm gains): the usual recipe, only when asked.
  bool no_decay_1d = false;
  // The learning rate of optimizer step t (1-based) while the trainer has not called
  // SetLearningRate / SetHyperparams and the config has no scheduler block; null = the config's
  // optimizer.lr. Must give the same value on every rank. Called once per applied step.
  std::function<double(int64_t step)> lr_schedule;
  // Times every optimizer step's phases on the device's clock (timing events on the engine's
  // streams), for Engine::DeviceTimes. Off by default: timing events make each record and wait
  // slightly dearer on CUDA. Unimplemented at Create on a device without timing events.
  bool device_timing = false;
};

// One optimizer step's phases on the device's own clock (EngineOptions::device_timing). On a
// stream-ordered device Step() returns once its work is enqueued, so StepStats' host timings
// hold the enqueueing; these hold the work.
struct DeviceStepTimes {
  int64_t step = 0;        // the optimizer step these are of (StepStats::step of that Step())
  double norm_ms = 0;      // the window's norm and finite checks (with optimizer offload
                           // these run in backward, as each shard leaves: about 0 here)
  double update_ms = 0;    // AdamW on the device, or the offload pipeline (transfers + host AdamW)
  double gather_ms = 0;    // from the end of the update to the end of the parameter gathers
  double total_ms = 0;     // from the start of the norm to the end of the step's device work
};

// A stacked tensor ([L, ...], e.g. per-layer weights) declared as L parameters
// "name[l]" of shape [...], each in module "module[l]", so that each layer's slice can be its
// own unit and its GradReady starts that unit's reduction while backward goes on (with
// SetGradBuffer(first + l, stacked_grad + l * slice elements) the trainer keeps one stacked
// gradient tensor). A slice gets a unit of its own when it reaches reduce_bucket_size;
// smaller slices are merged with their neighbours as any modules are. [L] gives L
// scalars. REQUIRES: stacked.shape is not empty.
std::vector<memory::ParamSpec> StackedSlices(const memory::ParamSpec& stacked);

class Engine {
 public:
  // Fills `values` (numel floats, row-major) with the initial value of parameter `index`.
  using Initializer =
      std::function<void(int index, const memory::ParamSpec& spec, float* values)>;

  // Plans (resolving "stage": "auto" against the budget) and allocates exactly the plan.
  // `comm` and `device` must outlive the engine. Errors: InvalidArgument for a communicator
  // whose size differs from what the config implies or a bad parameter list; ResourceExhausted
  // when nothing fits the budget or an allocation fails.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const Config& config,
                                                        std::vector<memory::ParamSpec> params,
                                                        comm::Communicator* comm, Device* device);
  static absl::StatusOr<std::unique_ptr<Engine>> Create(const Config& config,
                                                        std::vector<memory::ParamSpec> params,
                                                        comm::Communicator* comm, Device* device,
                                                        const EngineOptions& options);
  // Waits for the compute stream first, so that work queued there (the engine's and the
  // trainer's before it) has run before the engine's memory is released.
  ~Engine();

  const memory::Plan& plan() const;
  const Config& config() const;
  int num_params() const;
  int num_units() const;
  int unit_of(int param) const;
  MemoryReport memory_report() const;
  // offload_param "nvme": pieces of parameter shards the gathers found read ahead, since
  // creation (0 without it). What benchmarks/nvme_param_bench reports as its hit rate.
  int64_t nvme_param_reads_ahead_used() const;
  // offload_param "nvme": pieces read ahead but dropped unread, since creation (0 without it).
  int64_t nvme_param_reads_ahead_wasted() const;
  // Current loss scale (1 unless fp16).
  double loss_scale() const;
  // Optimizer steps applied so far.
  int64_t step() const;

  // Sets every parameter (master, compute copy, m = v = 0). With from_rank0, only rank 0 calls
  // `init` and its values are broadcast; otherwise every rank calls `init`, which must then give
  // the same values on every rank. Collective.
  absl::Status InitParams(const Initializer& init, bool from_rank0 = true);

  absl::StatusOr<void*> param(int i);
  absl::StatusOr<void*> grad(int i);
  absl::Status GradReady(int i);
  // Marks every parameter of `unit` ready.
  absl::Status GradReadyUnit(int unit);

  // Gradient hand-off from the trainer's own buffer: from now on GradReady(i) reads parameter
  // i's gradient from `buffer` (compute dtype, numel elements, in the engine's device memory,
  // written on the compute stream) instead of grad(i), which then fails. Returns true when
  // the unit is reduced straight from `buffer`, without a copy; false when GradReady copies it
  // into the engine's buffer (on the compute stream) first.
  //
  // Declared before the plan (memory::ParamSpec::grad_buffer, grad_buffer_offset): the plan
  // decided (plan().units[u].grad_source), and a unit reduced in place has no gradient storage
  // of the engine's at all; grad_copy_reason(i) says why another is copied. `buffer` must be
  // the declared element of the trainer's buffer: every parameter declared in one buffer is
  // handed over from one base address (else FailedPrecondition naming both; to move a
  // buffer, hand all its parameters back with nullptr first). A unit whose padding lies over
  // other declared gradients of the buffer is reduced once their units are, and the engine
  // zero-fills that padding then. Every declared parameter of a unit reduced in place must be
  // handed over before its GradReady.
  // Not declared: in place when i is alone in its unit and fills it without padding (numel a
  // multiple of world_size * 128 elements, the plan's shard alignment; alone in its unit when
  // it reaches reduce_bucket_size), and not an fp32 wire without fp32 accumulation; the plan
  // keeps the engine's storage for it all the same.
  //
  // Lifetime: the trainer writes `buffer` before GradReady(i); from GradReady(i) until Step()
  // returns (ApplyStep/SkipStep after ComputeGradNorm), the engine may read and overwrite it
  // (the reduction may run in place; stages 0-1 without accumulation keep the reduced gradient
  // there for the step), and, declared, also the trainer's buffer past it up to its unit's
  // padding; so the trainer writes it again, in full, for the next micro-step.
  // nullptr goes back to grad(i) (declared and reduced in place: to no buffer at all).
  // FailedPrecondition while i's unit is part-way through this micro-step (declared: after
  // any GradReady of the micro-step), and between ComputeGradNorm and ApplyStep/SkipStep;
  // register between micro-steps.
  absl::StatusOr<bool> SetGradBuffer(int i, void* buffer);
  // Why parameter i's declared gradient (memory::ParamSpec::grad_buffer) is copied into the
  // engine's buffer rather than reduced in place, naming the tensor and the rule; "" when it is
  // reduced in place or not declared. Valid for the engine's lifetime.
  const std::string& grad_copy_reason(int i) const;
  // Accumulation without communication (FSDP2's set_requires_gradient_sync, Megatron's
  // no_sync). With zerort.local_grad_accumulation (stages 0-1, gradient_accumulation_steps > 1)
  // the micro-steps of a window add their gradients into a local full-size buffer and only the
  // window's last micro-step reduces; SetGradientSync(true) makes the following micro-steps
  // reduce each (the sums stay correct whatever the mix), SetGradientSync(false) goes back to
  // local sums. The last micro-step of a window always reduces. Every rank must make the same
  // calls. FailedPrecondition inside a micro-step (after a GradReady), and for false without
  // the key (naming it: the local buffer is planned at creation).
  absl::Status SetGradientSync(bool sync);
  // Units whose reduction has been issued in this micro-step (reset by Step()): each starts
  // at the GradReady that completes its unit, while backward goes on.
  int reduced_units() const;

  // --- frozen parameters ----------------------------------------------------------------------
  // Whether parameter i is frozen (memory::ParamSpec::frozen, or matched by the config's
  // zerort.frozen_params): it has no gradient (grad, GradReady and SetGradBuffer fail naming it;
  // Step does not wait for it) and no optimizer state; its units come after every trainable
  // unit in plan().units. Checkpoints store its weights as its master with m = v = 0.
  bool frozen(int i) const;
  // OK when parameter i already is as asked. Otherwise FailedPrecondition saying how: the plan
  // is fixed for the engine's life, so re-create the engine with the new set and load a
  // checkpoint into it.
  absl::Status SetFrozen(int i, bool frozen);

  // Stage 3: gathers `unit` (prefetching the next ones in the same direction while slots are
  // free); Release lets its slot be reused. No-ops in stages 0-2. Collective.
  absl::Status Gather(int unit);
  absl::Status Release(int unit);

  // Reference-counted gathers by parameter, so a trainer never tracks units:
  // AcquireParams(params) holds every distinct unit of `params` once more (stage 3 gathers it on
  // its first hold, with prefetch as Gather), ReleaseParams(params) once less (its last hold lets the slot be reused). A
  // unit shared by two layers, or a tied embedding acquired by the embedding and the head, stays
  // gathered until its last Release. param(i) is readable while its unit is held. Holds are
  // counted in every stage (a no-op for memory in stages 0-2 and for persistent units), so an
  // unbalanced Release fails in stage 0 already. Errors: OutOfRange for an index outside the
  // model; FailedPrecondition when the gather slots are all held (naming
  // stage3_prefetch_bucket_size, which sets their count), or, naming the parameter, for a
  // Release of a unit not held; a failed call changes no count. Collective in stage 3.
  absl::Status AcquireParams(absl::Span<const int> params);
  absl::Status ReleaseParams(absl::Span<const int> params);

  // Ends a micro-step; on every gradient_accumulation_steps-th call applies the optimizer
  // (ComputeGradNorm, then SkipStep on overflow, else ApplyStep). FailedPrecondition naming the
  // first parameter whose GradReady is missing, or while a split step is pending.
  absl::StatusOr<StepStats> Step();

  // The last optimizer step's phases on the device's clock; waits for that step's device work.
  // FailedPrecondition without EngineOptions::device_timing, or before the first optimizer step
  // (applied or skipped).
  absl::StatusOr<DeviceStepTimes> DeviceTimes();

  // --- split step ---------------------------------------------------------------------------
  // True when the next Step() / ComputeGradNorm() ends an accumulation window.
  bool last_micro_step() const;
  // Ends the last micro-step of a window and measures its gradients: the global norm, the
  // overflow verdict and the clip factor, identical on every rank. Nothing is applied until
  // ApplyStep() or SkipStep(); a second call returns the same verdict without communicating.
  // FailedPrecondition unless last_micro_step() (use Step() for the others). Collective.
  absl::StatusOr<GradNormInfo> ComputeGradNorm();
  // Applies AdamW to the measured gradients, as Step() would. Every rank must call the same
  // one of ApplyStep / SkipStep with the same options: they check it (one small all-gather)
  // and fail alike with FailedPrecondition otherwise, leaving the decision pending.
  // FailedPrecondition on overflow (only SkipStep then) or without ComputeGradNorm. Collective.
  // A bad learning rate (a schedule's, say) fails before anything changes and leaves the
  // window pending. If the update itself fails (e.g. an NVMe I/O error naming file and
  // offset), the window ends: with NVMe offload the state and step() are still the previous
  // step's, and the trainer may redo the window's micro-steps. With only the parameter shards
  // on NVMe (a failed shard write) the update stands and step() counts it; the shards are
  // re-derived from the master, or, if that fails too (the error says so), rewritten by
  // RestoreOwnedState.
  absl::StatusOr<StepStats> ApplyStep(const ApplyOptions& options = {});
  // Drops the measured gradients: parameters, m, v, the step count and, unless the window
  // overflowed (which the fp16 scaler counts as Step() does), the loss scaler stay as they
  // were. StepStats.skipped is set. Collective.
  absl::StatusOr<StepStats> SkipStep();

  // --- hyperparameters ------------------------------------------------------------------------
  // The scalars of the next steps, on every rank alike (not collective). InvalidArgument naming
  // the value (nothing changes then). Allowed any time, also before the first step; a step
  // reads them when it applies AdamW.
  absl::Status SetHyperparams(const AdamWScalars& scalars);
  absl::Status SetLearningRate(double lr);
  // What the next step uses, except that lr comes from EngineOptions::lr_schedule until the
  // trainer sets one.
  AdamWScalars hyperparams() const;
  // The group of parameter i: nullopt for none (the current weight decay, lr_scale 1).
  std::optional<ParamGroup> param_group(int i) const;

  // --- scalars through the engine's communicator ---------------------------------------------
  // values[k] = op over ranks of values[k] (kSum, kAvg, kMax), reduced in rank order in double,
  // so every rank gets the same bits. Collective; REQUIRES the same values.size() everywhere.
  absl::Status AllReduceScalars(absl::Span<double> values, comm::ReduceOp op);
  // Every rank's `mine` (per-rank logging: each rank's loss, throughput or memory peak), rank
  // r's at [r * mine.size(), (r + 1) * mine.size()), bit for bit, the same on every rank.
  // Collective; InvalidArgument on every rank, naming the counts, when they differ.
  absl::StatusOr<std::vector<double>> AllGatherScalars(absl::Span<const double> mine);
  // Returns once every rank has called it. Collective.
  absl::Status Barrier();

  // The full fp32 master weights (the parameters themselves in fp32 mode), concatenated in
  // registration order. Collective (all-gathers the shards).
  absl::StatusOr<std::vector<float>> GatherMasterWeights();

  // --- checkpoint access (checkpoint/checkpoint.h builds on these) ---------------------------
  // The checkpoint format is the same for every stage: rank r stores elements
  // [r * shard, (r + 1) * shard) of every padded unit (its owned shard; in stage 0, where every
  // rank holds everything, the same range).

  comm::Communicator* communicator() const;
  // The device the engine's buffers live on (trainers copy into grad(i) through it).
  Device* device() const;
  Device::Stream compute_stream() const;
  // An exchange of small host values (comm/agree.h) like the one the engine checks its peers
  // with: straight through the communicator when that reads host memory, staged through this
  // device's memory on compute_stream() when it is stream-ordered (NCCL), where
  // comm::DirectHostExchange fails. It holds only the communicator, the device and the stream,
  // so it stays valid after the engine is destroyed, while those three live (a checkpoint's
  // Finish may run then). Collective calls, on the trainer's thread.
  std::unique_ptr<comm::HostExchange> NewHostExchange() const;
  // True between optimizer steps: no micro-step of an accumulation window has been taken.
  bool at_step_boundary() const;
  EngineState state() const;

  // Starts copying this rank's range of every unit (plan().units[u].shard elements) of the
  // fp32 master weights, m and v into host buffers of plan().shard_elements floats each, unit
  // u's range at plan().units[u].shard_offset (the layout RestoreOwnedState takes; `param`,
  // when not null, receives the compute-dtype parameters of the same ranges), and returns
  // without waiting. The copies run on a stream of the engine's, after the work enqueued so far on the
  // trainer's stream, so they overlap the next forward and backward passes; the next optimizer
  // update, RestoreOwnedState and the destructor wait for them, so the buffers receive exactly
  // the state at this call. Pinned buffers keep the copies off the host on a GPU. Not
  // collective. REQUIRES: at_step_boundary(); the buffers outlive WaitSnapshot().
  absl::Status BeginSnapshot(float* master, float* m, float* v, void* param);
  // Blocks until the copies of the last BeginSnapshot have landed and returns their status.
  // Unlike every other method it may be called from another thread while the trainer goes on
  // (a checkpoint writer waits here); without a snapshot it returns OK at once.
  absl::Status WaitSnapshot();
  // WaitSnapshot as a closure that stays safe to call after the engine is destroyed (the
  // destructor waits for the copies, and the closure then returns their status): what a
  // checkpoint writer thread that may outlive the engine holds. Thread-safe.
  std::function<absl::Status()> SnapshotWaiter() const;

  // Replaces the optimizer state and the scalar state. `master`, `m` and `v` hold
  // plan().shard_elements floats each, unit u's range at plan().units[u].shard_offset (the
  // layout of BeginSnapshot). The compute-dtype parameters are re-derived from the master
  // weights (round once, as Step and InitParams do) and all-gathered, so every rank ends
  // consistent. Collective. REQUIRES: at_step_boundary(); padding elements are zero.
  absl::Status RestoreOwnedState(absl::Span<const float> master, absl::Span<const float> m,
                                 absl::Span<const float> v, const EngineState& state);

  // --- parking (RL colocation) ----------------------------------------------------------------
  // Park() moves every device buffer of this rank's engine (parameters, gradients, buckets,
  // gather slots, and master, m, v unless offloaded) into pinned host memory from the
  // process-wide memory::PinnedSlabCache and returns the device memory to the device's
  // allocator (on CUDA, to the driver: another process may use it), so that an RL trainer's
  // generation engine can take the GPU between training phases (DeepSpeed's offload_states).
  // Unpark() brings it back, bit for bit, at the same addresses: param(i) and grad(i) pointers
  // are valid again after the pair (the trainer's own SetGradBuffer buffers are not the
  // engine's to move), and training goes on as if nothing had happened. The second and later
  // Parks make no new OS allocation of pinned memory. See docs/embedding.md, section 10.
  //
  // Park only between optimizer steps: FailedPrecondition, naming it, while a micro-step is in
  // progress (a GradReady since the last Step), inside an accumulation window, while a
  // ComputeGradNorm awaits ApplyStep/SkipStep, or while a unit is held (Gather/AcquireParams
  // not yet released); and when already parked. It waits for the copies of a BeginSnapshot
  // still in flight (a checkpoint writer then only works on its host buffers). Not
  // collective: each rank parks its own memory.
  // While parked, every call that touches device memory (param, grad, GradReady, Gather,
  // AcquireParams, Step, ComputeGradNorm, ApplyStep, SkipStep, InitParams, SetGradBuffer,
  // GatherMasterWeights, BeginSnapshot, RestoreOwnedState) is FailedPrecondition saying so; the
  // trainer must not touch the engine's device pointers either (on both devices that faults).
  // Unpark: FailedPrecondition when not parked; ResourceExhausted when the device memory is not
  // available (the engine stays parked: free the memory and call it again).
  absl::Status Park();
  absl::Status Unpark();
  bool parked() const;
  // While parked: the bytes of device memory Park released (the device arena's capacity, as
  // asked of the device's allocator, which may round it up) and the bytes it holds in pinned
  // host memory instead (what the arena had carved). 0 when not parked.
  int64_t parked_device_bytes() const;
  int64_t parked_host_bytes() const;

 private:
  class Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zerort

#endif  // ZERORT_ZERO_ENGINE_H_
