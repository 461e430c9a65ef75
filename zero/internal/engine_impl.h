// Engine::Impl, shared by the engine's translation units: engine.cc (creation, parameters,
// gradients, gathers), engine_step.cc (Step and the split step) and engine_state.cc (snapshots,
// restore). Internal: include only from those.
#ifndef ZERORT_ZERO_INTERNAL_ENGINE_IMPL_H_
#define ZERORT_ZERO_INTERNAL_ENGINE_IMPL_H_

#include <memory>
#include <optional>
#include <vector>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "comm/agree.h"
#include "offload/cpu_adamw.h"
#include "offload/cpu_adamw_compact.h"
#include "offload/pipeline.h"
#include "zero/internal/adamw_groups.h"
#include "zero/internal/device_step_timer.h"
#include "zero/internal/step_control.h"
#include "zero/internal/engine_memory.h"
#include "zero/internal/grad_buckets.h"
#include "zero/internal/grad_norm.h"
#include "zero/internal/host_collectives.h"
#include "zero/internal/param_gatherer.h"
#include "zero/internal/parking.h"
#include "zero/internal/shard_layout.h"
#include "zero/internal/snapshot.h"
#include "zero/internal/step_timer.h"
#include "zero/internal/stream_order.h"
#include "zero/internal/unit_store.h"
#include "zero/loss_scaler.h"
#include "zero/engine.h"
#include "zero/planner.h"

namespace zerort {

using zero_internal::Region;

// The plan's master form as the kernels name it (the same values).
inline offload::MasterForm OffloadMasterForm(memory::MasterForm form) {
  static_assert(static_cast<int>(memory::MasterForm::kBf16Remainder) ==
                        static_cast<int>(offload::MasterForm::kBf16Remainder) &&
                    static_cast<int>(memory::MasterForm::kBf16Stochastic) ==
                        static_cast<int>(offload::MasterForm::kBf16Stochastic),
                "memory::MasterForm and offload::MasterForm differ");
  return static_cast<offload::MasterForm>(form);
}
using zero_internal::Stopwatch;

// The engine's parts, each a class of its own (zero/internal/, offload/pipeline.h), and the
// phases of Step() that tie them together.
class Engine::Impl {
 public:
  Impl(Config config, std::vector<memory::ParamSpec> specs, memory::Plan plan,
       DeviceBudget budget, comm::Communicator* comm, Device* device)
      : config_(std::move(config)),
        specs_(std::move(specs)),
        plan_(std::move(plan)),
        budget_(std::move(budget)),
        comm_(comm),
        dev_(device),
        rank_(comm->rank()),
        world_(comm->size()),
        stage_(plan_.options.stage),
        cdt_(plan_.options.compute_dtype),
        c_(DTypeSize(cdt_)),
        gas_(plan_.options.gradient_accumulation_steps),
        offload_(plan_.options.offload_optimizer),
        scaler_(config_),
        // HSDP: collectives count the shard group's peers, plus the across-group reduction.
        timer_(memory::ShardGroupSize(plan_.options), c_,
               world_ / memory::ShardGroupSize(plan_.options)) {}

  // Allocates the plan and builds the parts over it.
  absl::Status Build(Device::Stream compute);
  // Every rank must have registered the same parameters with the same config: a mismatch would
  // otherwise surface as a hang or a silent corruption inside the first collective.
  absl::Status CheckPeersAgree();

  // --- the optimizer step (engine_step.cc) -----------------------------------------------------
  struct GradMeasure {
    double scale = 1;       // gradients hold the sum over micro-steps times the loss scale
    double norm = 0;        // global L2 norm of the unscaled, averaged gradients
    bool overflow = false;  // an Inf/NaN on some rank, or an infinite norm
  };
  // What the caller of RunStep wants of the window: all of the step (Step), only its
  // measurement (ComputeGradNorm), or the rest of a measured window (ApplyStep, SkipStep).
  struct StepRequest {
    bool measure_only = false;
    bool skip = false;                // the trainer's SkipStep
    std::optional<double> clip;       // ApplyStep's clip coefficient, else the config's
  };
  absl::StatusOr<StepStats> RunStep(const StepRequest& request);
  absl::Status EndMicroStep();
  StepStats MicroStepStats() const;
  absl::Status MeasureWindow();
  absl::StatusOr<StepStats> Skip(double elapsed_ms);
  // DeviceStepTimer's point `p` on the compute stream (no-op without device timing).
  absl::Status MarkDevice(zero_internal::DeviceStepTimer::Point p);
  // The step's last points (on compute and side()): the step DeviceTimes reports.
  absl::Status MarkDeviceStepDone();
  using RangeLists = std::vector<std::vector<offload::AdamWRange>>;
  absl::StatusOr<const RangeLists*> StepConstants(StepStats* stats);
  // AdamW on every owned region; returns the time the pipeline spent in all-gathers.
  absl::StatusOr<double> UpdateOwnedShards(const RangeLists& ranges, float grad_scale,
                                           StepStats* stats);
  absl::Status UpdateOnDevice(const RangeLists& ranges, float grad_scale);
  absl::StatusOr<double> UpdateOnHost(const RangeLists& ranges, float grad_scale,
                                      StepStats* stats);
  absl::Status GatherUpdatedParams();
  absl::Status FinishStep(bool overflow, bool update_scaler, StepStats* stats);
  absl::Status CheckGradsReady() const;
  absl::Status CheckPending(const char* call, bool want) const;

  // Unimplemented naming the device when it runs the optimizer and lacks the compact form's
  // kernel (Device::CompactAdamWRanges).
  absl::Status ProbeCompactKernel(Device::Stream compute);
  // HSDP (memory::Hierarchical): splits this rank's shard group off the communicator and hands
  // it to StreamOrder; an error on a backend without ReduceScatterInGroups. Collective.
  absl::Status JoinShardGroup(Device::Stream compute);
  // hpZ: splits the node group of zero_hpz_partition_size ranks off the communicator; MiCS's
  // hierarchical gather: the across-node and within-node groups of the shard group. Hands
  // them to StreamOrder. Nothing otherwise. Collective.
  absl::Status JoinNodeGroups(const zero_internal::EngineMemory& mem);
  // Host all-gathers of unit shards: over the shard group with HSDP, else the communicator.
  zero_internal::HostCollectives& shard_host() const {
    return shard_host_ != nullptr ? *shard_host_ : *host_;
  }

  absl::Status ReduceUnit(int unit);
  absl::Status RestoreUnit(int unit, const float* const src[3]);
  // Unit u's parameters all-gathered again after its shard was rewritten. Collective.
  absl::Status RegatherUnit(int unit);
  absl::Status CheckRange(const char* call, int index, bool unit) const;
  char* At(char* base, int64_t elems) const { return base + elems * static_cast<int64_t>(c_); }
  const Region& region(int u) const { return layout_->region(u); }
  int num_units() const { return static_cast<int>(plan_.units.size()); }

  const Config config_;
  const std::vector<memory::ParamSpec> specs_;
  const memory::Plan plan_;
  // The device budget Create fitted the plan to (memory_report's figures).
  const DeviceBudget budget_;
  comm::Communicator* const comm_;
  Device* const dev_;
  const int rank_, world_, stage_;
  const DType cdt_;
  const size_t c_;
  const int gas_;
  const bool offload_;
  LossScaler scaler_;
  int64_t step_ = 0;
  int micro_ = 0;  // completed micro-steps in this accumulation window
  // A micro-step of this window has reduced: later reductions add to the reduced gradients.
  bool synced_in_window_ = false;
  // Local accumulation: SetGradientSync(true) asked for a reduction in every micro-step.
  bool sync_every_micro_ = false;
  zero_internal::StepTimer timer_;

  std::unique_ptr<zero_internal::Hyperparams> hyper_;  // the AdamW scalars in force
  // The trainer's collective calls since the last step, and this engine's id (rank 0's pick,
  // adopted in CheckPeersAgree): every rank compares them before an update
  // (zero_internal::AgreeBeforeUpdate).
  zero_internal::CollectiveDigest digest_;
  uint64_t engine_id_ = 0;
  // A window measured by ComputeGradNorm and not yet applied or skipped.
  struct Pending {
    bool active = false;
    GradMeasure g;
    StepStats stats;     // the window's reductions and gathers, marked as a boundary
    double clip_coef = 1;
    double norm_ms = 0;  // time the measurement took (part of optimizer_ms)
  };
  Pending pending_;

  // Declared first, destroyed last: every stream below that may still write into the arenas
  // is synchronized by its owner's destructor before they go.
  std::unique_ptr<zero_internal::EngineMemory> memory_;
  // HSDP only: this rank's shard group (Split of comm_) and host collectives over it. Declared
  // before the parts that use them, so that those (StreamOrder's destructor waits for the comm
  // stream) are gone before the group is.
  std::unique_ptr<comm::Communicator> shard_comm_;
  std::unique_ptr<zero_internal::HostCollectives> shard_host_;
  // hpZ only: the node group (JoinNodeGroups); MiCS's hierarchical gather only: the
  // across-node and within-node parts of the shard group. Declared early for the same reason.
  std::unique_ptr<comm::Communicator> node_comm_;
  std::unique_ptr<comm::Communicator> across_comm_;
  std::unique_ptr<comm::Communicator> within_comm_;
  std::unique_ptr<zero_internal::ShardLayout> layout_;
  std::unique_ptr<zero_internal::UnitStore> store_;  // where owned state lives
  std::unique_ptr<zero_internal::StreamOrder> streams_;
  std::unique_ptr<zero_internal::HostCollectives> host_;
  std::unique_ptr<zero_internal::GradBuckets> grads_;
  std::unique_ptr<zero_internal::ParamGatherer> gatherer_;
  // With offload_optimizer, when some unit is offloaded (offload_optimizer.ratio > 0 keeps
  // fewer than all on the device).
  std::unique_ptr<offload::OffloadPipeline> pipeline_;
  // Trainable units updated by the host step (pipeline_'s regions, in order) and on the device.
  std::vector<int> offloaded_units_, kept_units_;
  RangeLists offloaded_ranges_;  // per pipeline region, the step's ranges of its unit

  std::unique_ptr<zero_internal::GradNorm> norm_;
  std::unique_ptr<zero_internal::DeviceStepTimer> dtimer_;  // EngineOptions::device_timing only
  std::unique_ptr<zero_internal::AdamWGroups> groups_;
  std::unique_ptr<zero_internal::OwnedSnapshot> snapshot_;
  // Set between Engine::Park and Engine::Unpark: the device arena's bytes in pinned memory.
  // Declared last, destroyed first: its slabs go back to the cache before anything else.
  std::unique_ptr<zero_internal::ParkedArenas> parked_;

  // FailedPrecondition naming `call` while parked: the device memory is not there.
  absl::Status CheckUnparked(const char* call) const {
    if (parked_ == nullptr) return absl::OkStatus();
    return absl::FailedPreconditionError(
        absl::StrCat(call, ": the engine is parked (Engine::Park): its device memory is in "
                           "pinned host memory; call Unpark() first"));
  }
};

}  // namespace zerort

#endif  // ZERORT_ZERO_INTERNAL_ENGINE_IMPL_H_
