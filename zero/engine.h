// Engine: ZeRO-sharded parameter, gradient and optimizer-state memory behind one embedding API.
//
// The trainer owns forward and backward; the engine owns the memory (exactly what memory::Plan
// lists), the collectives and the optimizer step. Every rank creates one Engine over its
// Communicator; all ranks must make the same sequence of collective-bearing calls (InitParams,
// Gather, GradReady, Step, GatherMasterWeights).
//
// One micro-step (gradient_accumulation_steps of them per optimizer step):
//
//   for unit in forward order:                 // stage 3 only; no-ops otherwise
//     engine->Gather(unit); forward(unit uses engine->param(i)); engine->Release(unit);
//   for unit in backward order (plan().units order):
//     engine->Gather(unit);                    // stage 3
//     for each param i of unit: write dLoss/dparam into engine->grad(i); engine->GradReady(i);
//     engine->Release(unit);                   // stage 3
//   ASSIGN_OR_RETURN(StepStats stats, engine->Step());   // applies AdamW every GAS micro-steps
//
// Buffers:
//  - param(i): the compute-dtype parameter (bf16/fp16 bits, or float in fp32 mode). Stages 0-2:
//    stable for the engine's lifetime. Stage 3: valid between Gather(unit) and Release(unit)
//    (always valid for persistent units).
//  - grad(i): the compute-dtype gradient buffer for this micro-step, zero-filled when handed
//    out; the trainer writes (or adds) the gradient of this micro-batch, scaled by the loss
//    scale in fp16 mode. Valid until GradReady of the last parameter of its unit. Stages 0-1:
//    a stable pointer; stages 2-3: a slot of a reused bucket.
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
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "comm/communicator.h"
#include "memory/plan.h"
#include "device/device.h"
#include "zero/config.h"
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
};

// The engine's scalar training state: what a checkpoint stores besides tensors. The loss
// scaler's part (loss_scale, scaler_hysteresis_left, scaler_iter, scaler_last_overflow) is
// zero/loss_scaler.h's ScalerState.
struct EngineState : ScalerState {
  int64_t step = 0;  // optimizer steps applied (AdamW's t)
};

// How the engine meets the trainer's device work.
struct EngineOptions {
  // The trainer's compute stream (a cudaStream_t on the CUDA device; nullptr = the default
  // stream). The engine enqueues its device work on it, so gradients written there before
  // GradReady and parameters read there after Gather are ordered without host waits.
  Device::Stream compute_stream = nullptr;
};

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
  ~Engine();

  const memory::Plan& plan() const;
  const Config& config() const;
  int num_params() const;
  int num_units() const;
  int unit_of(int param) const;
  MemoryReport memory_report() const;
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

  // Stage 3: gathers `unit` (prefetching the next ones in the same direction while slots are
  // free); Release lets its slot be reused. No-ops in stages 0-2. Collective.
  absl::Status Gather(int unit);
  absl::Status Release(int unit);

  // Ends a micro-step; on every gradient_accumulation_steps-th call applies the optimizer.
  // FailedPrecondition naming the first parameter whose GradReady is missing.
  absl::StatusOr<StepStats> Step();

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

 private:
  class Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace zerort

#endif  // ZERORT_ZERO_ENGINE_H_
