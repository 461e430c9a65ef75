#include "zero/engine.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/crc32c.h"
#include "base/status.h"
#include "comm/agree.h"
#include "offload/cpu_adamw.h"
#include "offload/cpu_kernels.h"
#include "offload/pipeline.h"
#include "zero/internal/adamw_groups.h"
#include "zero/internal/step_control.h"
#include "zero/internal/engine_memory.h"
#include "zero/internal/grad_buckets.h"
#include "zero/internal/grad_norm.h"
#include "zero/internal/host_collectives.h"
#include "zero/internal/param_gatherer.h"
#include "zero/internal/shard_layout.h"
#include "zero/internal/snapshot.h"
#include "zero/internal/step_timer.h"
#include "zero/internal/stream_order.h"
#include "zero/loss_scaler.h"
#include "zero/lr_schedule.h"
#include "zero/planner.h"

namespace zerort {

using zero_internal::Region;
using zero_internal::Stopwatch;

// The engine's parts, each a class of its own (zero/internal/, offload/pipeline.h), and the
// phases of Step() that tie them together.
class Engine::Impl {
 public:
  Impl(Config config, std::vector<memory::ParamSpec> specs, memory::Plan plan,
       comm::Communicator* comm, Device* device)
      : config_(std::move(config)),
        specs_(std::move(specs)),
        plan_(std::move(plan)),
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
        timer_(world_, c_) {}

  // Allocates the plan and builds the parts over it.
  absl::Status Build(Device::Stream compute);
  // Every rank must have registered the same parameters with the same config: a mismatch would
  // otherwise surface as a hang or a silent corruption inside the first collective.
  absl::Status CheckPeersAgree();

  // --- the phases of Step() ------------------------------------------------------------------
  struct GradMeasure {
    double scale = 1;       // gradients hold the sum over micro-steps times the loss scale
    double norm = 0;        // global L2 norm of the unscaled, averaged gradients
    bool overflow = false;  // an Inf/NaN on some rank, or an infinite norm
  };
  absl::Status CheckGradsReady() const;
  StepStats MicroStepStats() const;
  StepStats BoundaryStats() const;
  absl::StatusOr<GradMeasure> MeasureGradients();
  double ClipCoefficient(double norm) const;
  absl::Status EndMicroStep();
  absl::Status CheckPending(const char* call, bool want) const;
  absl::StatusOr<StepStats> Apply(std::optional<double> clip);
  absl::StatusOr<StepStats> Skip();
  // AdamW on every owned region (device, or the offload pipeline); returns the time the
  // pipeline spent in all-gathers.
  absl::StatusOr<double> UpdateOwnedShards(float grad_scale, StepStats* stats);
  absl::Status GatherUpdatedParams();
  absl::Status FinishStep(bool overflow, bool update_scaler, StepStats* stats);

  absl::Status ReduceUnit(int unit);
  absl::Status RestoreUnit(int unit, const float* const src[3]);
  absl::Status RecoverFromNvme();
  absl::Status StoreParamShard(int u, const char* values, Device::Stream stream);
  absl::Status RederiveNvmeParams();
  absl::Status CheckRange(const char* call, int index, bool unit) const;
  char* At(char* base, int64_t elems) const { return base + elems * static_cast<int64_t>(c_); }
  const Region& region(int u) const { return layout_->region(u); }
  int num_units() const { return static_cast<int>(plan_.units.size()); }

  const Config config_;
  const std::vector<memory::ParamSpec> specs_;
  const memory::Plan plan_;
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
  zero_internal::StepTimer timer_;

  std::unique_ptr<zero_internal::Hyperparams> hyper_;  // the AdamW scalars in force
  // A window measured by ComputeGradNorm and not yet applied or skipped.
  struct Pending {
    bool active = false;
    GradMeasure g;
    StepStats stats;     // BoundaryStats() at the measurement
    double clip_coef = 1;
    double norm_ms = 0;  // time ComputeGradNorm took (part of optimizer_ms)
  };
  Pending pending_;

  // Declared first, destroyed last: every stream below that may still write into the arenas
  // is synchronized by its owner's destructor before they go.
  std::unique_ptr<zero_internal::EngineMemory> memory_;
  std::unique_ptr<zero_internal::ShardLayout> layout_;
  std::unique_ptr<zero_internal::StreamOrder> streams_;
  std::unique_ptr<zero_internal::HostCollectives> host_;
  std::unique_ptr<zero_internal::GradBuckets> grads_;
  std::unique_ptr<zero_internal::ParamGatherer> gatherer_;
  std::unique_ptr<offload::OffloadPipeline> pipeline_;  // with offload_optimizer only

  std::unique_ptr<zero_internal::GradNorm> norm_;
  std::unique_ptr<zero_internal::AdamWGroups> groups_;
  std::unique_ptr<zero_internal::OwnedSnapshot> snapshot_;
};

absl::Status Engine::Impl::Build(Device::Stream compute) {
  ASSIGN_OR_RETURN(memory_, zero_internal::EngineMemory::Allocate(plan_, dev_, compute,
                                                                  zero_internal::NvmeSetupOf(config_)));
  const zero_internal::EngineMemory& mem = *memory_;
  layout_ = std::make_unique<zero_internal::ShardLayout>(plan_, mem.model_state());
  ASSIGN_OR_RETURN(streams_, zero_internal::StreamOrder::Create(
                                 dev_, compute, comm_->stream_ordered(),
                                 mem.grad_buckets().count, mem.gather_slots().count));
  host_ = std::make_unique<zero_internal::HostCollectives>(comm_, dev_, compute);
  const zero_internal::UnitContext units(plan_, comm_, dev_, streams_.get(), &timer_);
  grads_ = std::make_unique<zero_internal::GradBuckets>(units, mem.model_state(),
                                                         mem.grad_buckets(), mem.grad_wire());
  gatherer_ = std::make_unique<zero_internal::ParamGatherer>(
      units, mem.model_state().params, mem.gather_slots(), mem.persistent(), mem.nvme_params(),
      host_.get());
  norm_ = std::make_unique<zero_internal::GradNorm>(plan_, *layout_, dev_, compute, host_.get(),
                                                   mem.norm_table());
  snapshot_ = std::make_unique<zero_internal::OwnedSnapshot>(plan_, *layout_, dev_, compute);
  if (!offload_) return absl::OkStatus();
  std::vector<offload::PipelineRegion> regions;
  for (int u = 0; u < num_units(); ++u) {
    const Region& r = region(u);
    regions.push_back({r.grad, r.master, r.m, r.v, r.param, r.n});
  }
  offload::PipelineOptions o;
  o.dtype = cdt_;
  o.grad_dtype = memory::ReducedGradDType(plan_.options);
  o.staging = mem.staging().base;
  o.chunks = mem.staging().count;
  o.chunk_elements = mem.staging().elements;
  o.param_on_host = plan_.options.offload_param;
  o.cpu_threads = config_.cpu_threads;
  o.nvme = mem.nvme_state();
  o.nvme_params = mem.nvme_params();
  // The reduced gradients are written where the collectives run.
  ASSIGN_OR_RETURN(pipeline_, offload::OffloadPipeline::Create(dev_, std::move(regions), o,
                                                               streams_->side()));
  return absl::OkStatus();
}

absl::Status Engine::Impl::CheckPeersAgree() {
  if (world_ == 1) return absl::OkStatus();
  // CRC32C over a canonical description: absl::Hash is seeded per process, which would make
  // identical models on two MPI processes look different.
  std::string canon = absl::StrCat(plan_.options.stage, "|", plan_.padded_elements, "|",
                                   plan_.units.size(), "|", static_cast<int>(cdt_), "|", gas_,
                                   "|", offload_, "|", plan_.options.fp32_grad_accum, "|",
                                   plan_.options.fp32_grad_comm);
  for (const memory::ParamSpec& s : specs_) {
    absl::StrAppend(&canon, "|", s.name, ":", absl::StrJoin(s.shape, "x"), "@", s.module);
  }
  // Groups too: ranks that decay a parameter differently would drift apart without a sign.
  const zero_internal::GroupChoice& groups = groups_->choice();
  for (int g : groups.of_param) {
    if (g < 0) absl::StrAppend(&canon, "|-");
    if (g >= 0) {
      absl::StrAppend(&canon, "|", absl::StrFormat("%a/%a", groups.groups[g].weight_decay,
                                                   groups.groups[g].lr_scale));
    }
  }
  const uint64_t mine = Crc32c(0, canon.data(), canon.size());
  ASSIGN_OR_RETURN(const std::vector<uint64_t> all, comm::AllGatherU64(*host_, {mine}));
  for (int r = 0; r < world_; ++r) {
    if (all[r] != mine) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", rank_, " and rank ", r, " disagree on the model or the config (parameter "
          "names, shapes, modules, stage, precision, gradient accumulation or parameter "
          "groups): every rank must register the same parameters with the same config"));
    }
  }
  return absl::OkStatus();
}

absl::Status Engine::Impl::CheckRange(const char* call, int index, bool unit) const {
  const int n = unit ? num_units() : static_cast<int>(specs_.size());
  if (index >= 0 && index < n) return absl::OkStatus();
  return absl::OutOfRangeError(absl::StrCat(call, "(", index, "): there are ", n,
                                            unit ? " units" : " parameters"));
}

absl::Status Engine::Impl::ReduceUnit(int u) {
  RETURN_IF_ERROR(grads_->Reduce(u, /*first_micro=*/micro_ == 0));
  // On the last micro-step the reduced shard is final: its download to the first free staging
  // chunk overlaps the rest of backward.
  if (pipeline_ != nullptr && micro_ == gas_ - 1) return pipeline_->GradFinal(u);
  return absl::OkStatus();
}


// --- the phases of Step() --------------------------------------------------------------------

absl::Status Engine::Impl::CheckGradsReady() const {
  const int i = grads_->FirstMissing();
  if (i < 0) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("Step() before every gradient is ready: GradReady('", specs_[i].name,
                   "') is missing in this micro-step"));
}

StepStats Engine::Impl::MicroStepStats() const {
  StepStats stats;
  stats.step = step_;
  stats.loss_scale = scaler_.scale();
  return stats;
}

// What the window accumulated (reductions, stage-3 gathers, bytes), marked as a boundary.
StepStats Engine::Impl::BoundaryStats() const {
  StepStats stats;
  stats.boundary = true;
  stats.reduce_ms = timer_.window().reduce_ms;
  stats.gather_ms = timer_.window().gather_ms;
  stats.loss_scale = scaler_.scale();
  return stats;
}

absl::StatusOr<Engine::Impl::GradMeasure> Engine::Impl::MeasureGradients() {
  GradMeasure g;
  g.scale = scaler_.scale() * gas_;  // gradients hold the sum over micro-steps x the scale
  ASSIGN_OR_RETURN(const zero_internal::GradNorm::Result r, norm_->Measure(g.scale));
  g.norm = r.norm;
  g.overflow = r.overflow;
  return g;
}

double Engine::Impl::ClipCoefficient(double norm) const {
  const double clip = config_.gradient_clipping;
  return clip > 0 && norm > clip ? clip / (norm + 1e-6) : 1.0;
}

absl::StatusOr<double> Engine::Impl::UpdateOwnedShards(float grad_scale, StepStats* stats) {
  // Scalars first: a bad scheduled value fails the step before anything changes.
  ASSIGN_OR_RETURN(const AdamWScalars scalars, hyper_->ForStep(step_ + 1));
  using RangeLists = std::vector<std::vector<offload::AdamWRange>>;
  ASSIGN_OR_RETURN(const RangeLists* ranges, groups_->Prepare(scalars, step_ + 1));
  // From here the window is consumed, even if the update fails: with NVMe offload the state
  // is then still the previous step's (the step count follows it) and the trainer redoes the
  // window's micro-steps. A bad scalar above leaves it pending for another ApplyStep.
  pending_.active = false;
  ++step_;
  stats->lr = scalars.lr;
  stats->weight_decay = scalars.weight_decay;
  RETURN_IF_ERROR(snapshot_->Fence(/*host=*/offload_));
  if (offload_) {
    offload::OffloadPipeline::Hooks hooks;
    hooks.before_gather = [this](Device::Event e) { return streams_->BeforeCommAfter(e); };
    hooks.gather = [this](int u) { return gatherer_->AllGatherUpdated(u); };
    hooks.agree = [this](const absl::Status& local) { return comm::AgreeOnStatus(*host_, local); };
    absl::StatusOr<offload::OffloadPipeline::Times> update =
        pipeline_->Update(*ranges, grad_scale, hooks);
    // NVMe: a failed step (on any rank: they agreed) leaves the previous state in the file on
    // every rank; the count and the parameters follow it.
    if (!update.ok() && memory_->nvme_state() != nullptr) {
      --step_;
      return Annotate(update.status(), RecoverFromNvme().ok()
                                           ? "the previous step's state and parameters stay"
                                           : "the parameters could not be re-derived either");
    }
    // NVMe parameters with host state: the state's update stands (so does the count), but the
    // shards from the failed write on are old; every rank failed alike (they agreed).
    if (!update.ok() && memory_->nvme_params() != nullptr) {
      return Annotate(update.status(),
                      RederiveNvmeParams().ok()
                          ? "the step's update stands; the parameters were re-derived from it"
                          : "the parameters could not be re-derived either");
    }
    ASSIGN_OR_RETURN(offload::OffloadPipeline::Times t, std::move(update));
    stats->offload_wait_ms += t.wait_ms;
    // The trainer's stream reads the new parameters next (forward, stage-3 gathers).
    RETURN_IF_ERROR(streams_->JoinComm());
    RETURN_IF_ERROR(pipeline_->JoinUploads(streams_->compute()));
    return t.gather_ms;
  }
  const bool write_param = memory_->model_state().master != nullptr;
  for (int u = 0; u < num_units(); ++u) {
    const Region& reg = region(u);
    offload::AdamWArrays a{reg.master, reg.m, reg.v, reg.grad, reg.grad_dtype,
                           write_param ? reg.param : nullptr, cdt_, static_cast<size_t>(reg.n)};
    RETURN_IF_ERROR(dev_->AdamWRanges(a, (*ranges)[u], grad_scale, streams_->compute()));
  }
  return 0.0;
}

absl::Status Engine::Impl::GatherUpdatedParams() {
  if (!offload_) {  // the pipeline gathered as it went
    RETURN_IF_ERROR(streams_->BeforeComm());
    for (int u = 0; u < num_units(); ++u) RETURN_IF_ERROR(gatherer_->AllGatherUpdated(u));
    RETURN_IF_ERROR(streams_->JoinComm());
  }
  // Gathered stage-3 copies are stale now.
  gatherer_->Invalidate();
  return absl::OkStatus();
}

absl::Status Engine::Impl::FinishStep(bool overflow, bool update_scaler, StepStats* stats) {
  // A skipped step leaves the downloads begun in backward: the gradients they read are about
  // to be overwritten.
  if (pipeline_ != nullptr) RETURN_IF_ERROR(pipeline_->AbandonDownloads());
  if (update_scaler) RETURN_IF_ERROR(scaler_.Update(overflow));
  // Reset gradient state for the next window.
  RETURN_IF_ERROR(grads_->ClearFullGradients());
  stats->step = step_;
  stats->comm_bytes = timer_.window().comm_bytes;  // with this step's all-gathers
  timer_.Reset();
  return absl::OkStatus();
}

absl::StatusOr<StepStats> Engine::Step() {
  Impl& m = *impl_;
  const Stopwatch total;
  RETURN_IF_ERROR(m.CheckPending("Step()", /*want=*/false));
  if (!last_micro_step()) {  // inside an accumulation window: nothing to apply
    RETURN_IF_ERROR(m.EndMicroStep());
    StepStats stats = m.MicroStepStats();
    stats.total_ms = total.ElapsedMs();
    return stats;
  }
  ASSIGN_OR_RETURN(const GradNormInfo info, ComputeGradNorm());
  // Every rank holds the same verdict, so no agreement round is needed here.
  ASSIGN_OR_RETURN(StepStats stats, info.overflow ? m.Skip() : m.Apply(std::nullopt));
  stats.total_ms = total.ElapsedMs();
  return stats;
}

bool Engine::last_micro_step() const { return impl_->micro_ + 1 >= impl_->gas_; }

absl::StatusOr<GradNormInfo> Engine::ComputeGradNorm() {
  Impl& m = *impl_;
  Impl::Pending& p = m.pending_;
  if (!p.active) {
    if (!last_micro_step()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "ComputeGradNorm() on micro-step ", m.micro_ + 1, " of ", m.gas_,
          " (gradient_accumulation_steps): call Step() for all but the last micro-step of "
          "each window"));
    }
    const Stopwatch optimizer;
    RETURN_IF_ERROR(m.EndMicroStep());
    p.stats = m.BoundaryStats();
    ASSIGN_OR_RETURN(p.g, m.MeasureGradients());
    p.clip_coef = p.g.overflow ? 1.0 : m.ClipCoefficient(p.g.norm);
    p.norm_ms = optimizer.ElapsedMs();
    p.active = true;
  }
  GradNormInfo info;
  info.overflow = p.g.overflow;
  info.norm = p.g.overflow ? std::numeric_limits<double>::infinity() : p.g.norm;
  info.clip_coef = p.clip_coef;
  info.loss_scale = p.stats.loss_scale;
  return info;
}

absl::StatusOr<StepStats> Engine::ApplyStep(const ApplyOptions& options) {
  Impl& m = *impl_;
  const Stopwatch total;
  RETURN_IF_ERROR(m.CheckPending("ApplyStep()", /*want=*/true));
  if (m.pending_.g.overflow) {
    return absl::FailedPreconditionError(
        "ApplyStep() on gradients holding an Inf or NaN (on some rank): call SkipStep()");
  }
  RETURN_IF_ERROR(zero_internal::AgreeOnDecision(*m.host_, /*apply=*/true, options.clip_coef));
  // Checked after the agreement: every rank holds the same value, so all fail alike.
  if (options.clip_coef.has_value() &&
      !(std::isfinite(*options.clip_coef) && *options.clip_coef >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ApplyStep: clip_coef=", *options.clip_coef, " must be finite and >= 0"));
  }
  ASSIGN_OR_RETURN(StepStats stats, m.Apply(options.clip_coef));
  stats.total_ms = total.ElapsedMs();
  return stats;
}

absl::StatusOr<StepStats> Engine::SkipStep() {
  Impl& m = *impl_;
  const Stopwatch total;
  RETURN_IF_ERROR(m.CheckPending("SkipStep()", /*want=*/true));
  RETURN_IF_ERROR(zero_internal::AgreeOnDecision(*m.host_, /*apply=*/false, std::nullopt));
  ASSIGN_OR_RETURN(StepStats stats, m.Skip());
  stats.total_ms = total.ElapsedMs();
  return stats;
}

absl::Status Engine::SetHyperparams(const AdamWScalars& scalars) {
  return impl_->hyper_->Set(scalars, "SetHyperparams");
}

absl::Status Engine::SetLearningRate(double lr) { return impl_->hyper_->SetLearningRate(lr); }

AdamWScalars Engine::hyperparams() const { return impl_->hyper_->current(); }

std::optional<ParamGroup> Engine::param_group(int i) const {
  const zero_internal::GroupChoice& c = impl_->groups_->choice();
  if (i < 0 || i >= static_cast<int>(c.of_param.size()) || c.of_param[i] < 0) {
    return std::nullopt;
  }
  return c.groups[c.of_param[i]];
}

absl::Status Engine::AllReduceScalars(absl::Span<double> values, comm::ReduceOp op) {
  return zero_internal::AllReduceDoubles(*impl_->host_, values, op);
}

absl::Status Engine::Barrier() { return comm::AllGatherU64(*impl_->host_, {0}).status(); }

// --- the split step's parts ---------------------------------------------------------------

absl::Status Engine::Impl::EndMicroStep() {
  RETURN_IF_ERROR(CheckGradsReady());
  // The reductions of this micro-step, and their follow-up, complete before anything reads
  // the gradients again (the optimizer, or the next micro-step's backward).
  RETURN_IF_ERROR(streams_->JoinComm());
  grads_->StartMicroStep();
  if (++micro_ == gas_) micro_ = 0;
  return absl::OkStatus();
}

absl::Status Engine::Impl::CheckPending(const char* call, bool want) const {
  if (pending_.active == want) return absl::OkStatus();
  return absl::FailedPreconditionError(
      want ? absl::StrCat(call, " without ComputeGradNorm(): measure the window first")
           : absl::StrCat(call, " after ComputeGradNorm(): finish that step with ApplyStep() "
                                "or SkipStep() first"));
}

absl::StatusOr<StepStats> Engine::Impl::Apply(std::optional<double> clip) {
  const Stopwatch optimizer;
  StepStats stats = pending_.stats;
  stats.grad_norm = pending_.g.norm;
  stats.clip_coef = clip.value_or(pending_.clip_coef);
  const float grad_scale = static_cast<float>(stats.clip_coef / pending_.g.scale);
  ASSIGN_OR_RETURN(const double pipeline_gather_ms, UpdateOwnedShards(grad_scale, &stats));
  stats.optimizer_ms = pending_.norm_ms + optimizer.ElapsedMs() - pipeline_gather_ms;
  const Stopwatch gather;
  RETURN_IF_ERROR(GatherUpdatedParams());
  stats.gather_ms += pipeline_gather_ms + gather.ElapsedMs();
  RETURN_IF_ERROR(FinishStep(/*overflow=*/false, /*update_scaler=*/true, &stats));
  return stats;
}

absl::StatusOr<StepStats> Engine::Impl::Skip() {
  const Stopwatch optimizer;
  const bool overflow = pending_.g.overflow;
  StepStats stats = pending_.stats;
  // Parameters, m, v and the step count stay as they are.
  stats.skipped = true;
  stats.grad_norm = overflow ? std::numeric_limits<double>::infinity() : pending_.g.norm;
  stats.clip_coef = pending_.clip_coef;
  pending_.active = false;
  // An overflow is the scaler's business; a trainer's skip of finite gradients is not.
  RETURN_IF_ERROR(FinishStep(overflow, /*update_scaler=*/overflow, &stats));
  stats.optimizer_ms = pending_.norm_ms + optimizer.ElapsedMs();
  return stats;
}

// --- Engine --------------------------------------------------------------------------------

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() {
  // A checkpoint writer may still hold a SnapshotWaiter: cut it loose after the copies landed.
  impl_->snapshot_->Detach();
}

namespace {

// The config as the engine runs it: every "auto" filled (by the documented rules, the world
// size being the communicator's; a trainer that knows better calls ResolveAuto first), with
// one note per resolution.
absl::StatusOr<Config> ResolvedForEngine(const Config& config,
                                         absl::Span<const memory::ParamSpec> params,
                                         int world_size) {
  Config resolved = config;
  AutoFill fill;
  fill.world_size = world_size;
  RETURN_IF_ERROR(ResolveAuto(fill, params, &resolved));
  return resolved;
}

// The learning rate of step t (1-based) without a SetLearningRate: the config's scheduler
// block when it has one (as in DeepSpeed, the configured scheduler wins over the trainer's
// hook, with a note), else the trainer's EngineOptions::lr_schedule, else none.
std::function<double(int64_t)> LrScheduleFor(Config* config, const EngineOptions& options) {
  if (config->scheduler.type == SchedulerType::kNone) return options.lr_schedule;
  if (options.lr_schedule) {
    config->notes.push_back(
        "scheduler: EngineOptions::lr_schedule is ignored; the config's scheduler block sets "
        "the learning rate (SetLearningRate still overrides both)");
  }
  return [schedule = LrSchedule(config->scheduler, config->optimizer.lr)](int64_t t) {
    return schedule.LrAt(t - 1);
  };
}

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const Config& config,
                                                       std::vector<memory::ParamSpec> params,
                                                       comm::Communicator* comm, Device* device) {
  return Create(config, std::move(params), comm, device, EngineOptions());
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const Config& config,
                                                       std::vector<memory::ParamSpec> params,
                                                       comm::Communicator* comm, Device* device,
                                                       const EngineOptions& options) {
  if (comm == nullptr || device == nullptr) {
    return absl::InvalidArgumentError("Engine::Create needs a communicator and a device");
  }
  RETURN_IF_ERROR(ValidateConfig(config));
  if (comm->size() < 1 || comm->rank() < 0 || comm->rank() >= comm->size()) {
    return absl::InvalidArgumentError(absl::StrCat("communicator reports rank ", comm->rank(),
                                                   " of size ", comm->size()));
  }
  // The CPU backends copy and reduce with the host's loads and stores; NCCL (or an in-process
  // group with GPU buffer ops) moves device memory. A mismatched pair would crash in the first
  // collective instead of failing here.
  if (device->device_memory() != comm->device_memory()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device '", device->name(), "' cannot be used with the '", comm->backend(), "' ",
        "communicator, which moves ", comm->device_memory() ? "GPU" : "host",
        " memory: use the CPU device with the in-process or MPI communicators, and a CUDA "
        "device with NCCL or an in-process group made with CudaInProcessBufferOps"));
  }
  ASSIGN_OR_RETURN(Config with_notes, ResolvedForEngine(config, params, comm->size()));
  ASSIGN_OR_RETURN(PlanChoice choice,
                   ChoosePlan(params, with_notes, comm->size(), comm->rank()));
  if (!choice.fits) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the plan does not fit zero_optimization.memory_budget: ", choice.reason));
  }
  // Groups are resolved before the engine exists: a pattern that matches nothing is a note of
  // the engine's config.
  std::function<double(int64_t)> lr_schedule = LrScheduleFor(&with_notes, options);
  ASSIGN_OR_RETURN(zero_internal::GroupChoice groups,
                   zero_internal::ResolveParamGroups(params, with_notes.param_groups,
                                                     options.param_groups, options.no_decay_1d,
                                                     &with_notes.notes));
  auto impl = std::make_unique<Impl>(std::move(with_notes), std::move(params),
                                     std::move(choice.plan), comm, device);
  RETURN_IF_ERROR(impl->Build(options.compute_stream));
  impl->groups_ = std::make_unique<zero_internal::AdamWGroups>(impl->plan_, *impl->layout_,
                                                               std::move(groups));
  impl->hyper_ = std::make_unique<zero_internal::Hyperparams>(
      ScalarsOf(impl->config_.optimizer), std::move(lr_schedule));
  RETURN_IF_ERROR(impl->CheckPeersAgree());
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

const memory::Plan& Engine::plan() const { return impl_->plan_; }
const Config& Engine::config() const { return impl_->config_; }
int Engine::num_params() const { return static_cast<int>(impl_->specs_.size()); }
int Engine::num_units() const { return impl_->num_units(); }
int Engine::unit_of(int param) const { return impl_->plan_.params.at(param).unit; }
MemoryReport Engine::memory_report() const {
  MemoryReport r;
  const zero_internal::ByteCounts& b = impl_->memory_->bytes();
  std::copy(std::begin(b.planned), std::end(b.planned), r.planned);
  std::copy(std::begin(b.allocated), std::end(b.allocated), r.allocated);
  return r;
}
double Engine::loss_scale() const { return impl_->scaler_.scale(); }
int64_t Engine::step() const { return impl_->step_; }
comm::Communicator* Engine::communicator() const { return impl_->comm_; }
Device* Engine::device() const { return impl_->dev_; }
Device::Stream Engine::compute_stream() const { return impl_->streams_->compute(); }

absl::Status Engine::InitParams(const Initializer& init, bool from_rank0) {
  Impl& m = *impl_;
  const Device::Stream compute = m.streams_->compute();
  RETURN_IF_ERROR(m.snapshot_->Fence(/*host=*/true));
  for (int u = 0; u < num_units(); ++u) {
    const memory::Unit& unit = m.plan_.units[u];
    std::vector<float> values(unit.padded, 0.0f);  // (padded) fp32, host
    if (!from_rank0 || m.rank_ == 0) {
      for (int i : unit.params) {
        init(i, m.specs_[i], values.data() + m.plan_.params[i].offset_in_unit);
      }
    }
    if (from_rank0) {
      RETURN_IF_ERROR(m.host_->BroadcastHost(values.data(), unit.padded, DType::kF32, 0));
    }
    // The compute-dtype copy is what forward sees: round the fp32 values once, on the host.
    std::vector<char> compute_values(unit.padded * m.c_);
    offload::Cast(values.data(), DType::kF32, compute_values.data(), m.cdt_, unit.padded);
    const Region& reg = m.region(u);
    const int64_t n = reg.n;
    if (offload::NvmeState* nvme = m.memory_->nvme_state()) {
      RETURN_IF_ERROR(nvme->Store(u, values.data() + reg.unit_begin, nullptr, nullptr));
    } else {
      if (m.memory_->model_state().master != nullptr) {
        RETURN_IF_ERROR(m.dev_->Copy(reg.master, values.data() + reg.unit_begin, n * 4, compute));
      }
      RETURN_IF_ERROR(m.dev_->Zero(reg.m, n * 4, compute));
      RETURN_IF_ERROR(m.dev_->Zero(reg.v, n * 4, compute));
    }
    if (m.stage_ <= 2) {  // every rank holds the whole unit
      RETURN_IF_ERROR(m.dev_->Copy(m.At(m.memory_->model_state().params, unit.flat_offset),
                                   compute_values.data(), unit.padded * m.c_, compute));
    } else {
      RETURN_IF_ERROR(m.StoreParamShard(u, m.At(compute_values.data(), reg.unit_begin), compute));
      if (char* whole = m.gatherer_->persistent_copy(u); whole != nullptr) {
        RETURN_IF_ERROR(
            m.dev_->Copy(whole, compute_values.data(), unit.padded * m.c_, compute));
      }
    }
    // `values` and `compute_values` are read by copies that may still be in flight.
    RETURN_IF_ERROR(m.dev_->Synchronize(compute));
  }
  m.gatherer_->Invalidate();
  return m.dev_->Synchronize(compute);
}

absl::StatusOr<void*> Engine::param(int i) {
  RETURN_IF_ERROR(impl_->CheckRange("param", i, /*unit=*/false));
  return impl_->gatherer_->Param(impl_->plan_.params[i]);
}

absl::StatusOr<void*> Engine::grad(int i) {
  RETURN_IF_ERROR(impl_->CheckRange("grad", i, /*unit=*/false));
  return impl_->grads_->Grad(i);
}

absl::Status Engine::GradReady(int i) {
  RETURN_IF_ERROR(impl_->CheckRange("GradReady", i, /*unit=*/false));
  ASSIGN_OR_RETURN(const bool unit_complete, impl_->grads_->MarkReady(i));
  if (unit_complete) return impl_->ReduceUnit(impl_->plan_.params[i].unit);
  return absl::OkStatus();
}

absl::StatusOr<bool> Engine::SetGradBuffer(int i, void* buffer) {
  RETURN_IF_ERROR(impl_->CheckRange("SetGradBuffer", i, /*unit=*/false));
  return impl_->grads_->SetSource(i, buffer);
}

int Engine::reduced_units() const { return impl_->grads_->reduced_units(); }

std::vector<memory::ParamSpec> StackedSlices(const memory::ParamSpec& stacked) {
  std::vector<memory::ParamSpec> out;
  std::vector<int64_t> slice(stacked.shape.begin() + 1, stacked.shape.end());
  if (slice.empty()) slice = {1};  // [L]: L scalars
  for (int64_t l = 0; l < stacked.shape.at(0); ++l) {
    const std::string suffix = absl::StrCat("[", l, "]");
    out.push_back({stacked.name + suffix, slice, stacked.module + suffix});
  }
  return out;
}

absl::Status Engine::GradReadyUnit(int unit) {
  RETURN_IF_ERROR(impl_->CheckRange("GradReadyUnit", unit, /*unit=*/true));
  for (int i : impl_->plan_.units[unit].params) {
    if (!impl_->grads_->ready(i)) RETURN_IF_ERROR(GradReady(i));
  }
  return absl::OkStatus();
}

absl::Status Engine::Gather(int unit) {
  RETURN_IF_ERROR(impl_->CheckRange("Gather", unit, /*unit=*/true));
  return impl_->gatherer_->Gather(unit);
}

absl::Status Engine::Release(int unit) {
  RETURN_IF_ERROR(impl_->CheckRange("Release", unit, /*unit=*/true));
  return impl_->gatherer_->Release(unit);
}

absl::Status Engine::AcquireParams(absl::Span<const int> params) {
  for (int i : params) RETURN_IF_ERROR(impl_->CheckRange("Acquire", i, /*unit=*/false));
  return impl_->gatherer_->Acquire(params);
}

absl::Status Engine::ReleaseParams(absl::Span<const int> params) {
  for (int i : params) RETURN_IF_ERROR(impl_->CheckRange("Release", i, /*unit=*/false));
  return impl_->gatherer_->ReleaseParams(params);
}

absl::StatusOr<std::vector<float>> Engine::GatherMasterWeights() {
  Impl& m = *impl_;
  const Device::Stream compute = m.streams_->compute();
  std::vector<int64_t> param_start(m.specs_.size() + 1, 0);  // in the output
  for (size_t i = 0; i < m.specs_.size(); ++i) {
    param_start[i + 1] = param_start[i] + m.plan_.params[i].numel;
  }
  std::vector<float> out(param_start.back());
  for (int u = 0; u < num_units(); ++u) {
    const memory::Unit& unit = m.plan_.units[u];
    std::vector<float> full(unit.padded);  // (padded) fp32, host
    const Region& reg = m.region(u);
    if (reg.whole_unit) {
      RETURN_IF_ERROR(m.dev_->Copy(full.data(), reg.master, unit.padded * 4, compute));
    } else {
      std::vector<float> shard(unit.shard);
      if (offload::NvmeState* nvme = m.memory_->nvme_state()) {
        RETURN_IF_ERROR(nvme->Load(u, shard.data(), nullptr, nullptr));
      } else {
        RETURN_IF_ERROR(m.dev_->Copy(shard.data(), reg.master, unit.shard * 4, compute));
      }
      RETURN_IF_ERROR(m.dev_->Synchronize(compute));
      RETURN_IF_ERROR(m.host_->AllGatherHost(shard.data(), full.data(), unit.shard, DType::kF32));
    }
    RETURN_IF_ERROR(m.dev_->Synchronize(compute));
    for (int i : unit.params) {
      const memory::ParamLayout& p = m.plan_.params[i];
      std::copy(full.begin() + p.offset_in_unit, full.begin() + p.offset_in_unit + p.numel,
                out.begin() + param_start[i]);
    }
  }
  return out;
}

bool Engine::at_step_boundary() const {
  return impl_->micro_ == 0 && !impl_->grads_->any_ready() && !impl_->pending_.active;
}

EngineState Engine::state() const {
  EngineState e;
  static_cast<ScalerState&>(e) = impl_->scaler_.state();
  e.step = impl_->step_;
  e.hyperparams = impl_->hyper_->current();
  e.hyperparams_set = impl_->hyper_->set();
  return e;
}

absl::Status Engine::BeginSnapshot(float* master, float* m, float* v, void* param) {
  Impl& e = *impl_;
  if (!at_step_boundary()) {
    return absl::FailedPreconditionError(
        "BeginSnapshot inside an accumulation window: snapshot between optimizer steps");
  }
  if (master == nullptr || m == nullptr || v == nullptr) {
    return absl::InvalidArgumentError("BeginSnapshot: master, m and v must not be null");
  }
  RETURN_IF_ERROR(e.memory_->LoadNvmeState(e.plan_, master, m, v));  // the copies skip them
  if (offload::NvmeParams* file = e.memory_->nvme_params(); file != nullptr && param != nullptr) {
    for (int u = 0; u < num_units(); ++u) {  // the shards from the file, before Begin returns
      char* dst = static_cast<char*>(param) + e.plan_.units[u].shard_offset * e.c_;
      RETURN_IF_ERROR(file->Read(u, [dst](int64_t offset, const char* data, int64_t bytes) {
        std::memcpy(dst + offset, data, static_cast<size_t>(bytes));
        return absl::OkStatus();
      }));
    }
    param = nullptr;
  }
  return e.snapshot_->Begin(master, m, v, param);
}

absl::Status Engine::WaitSnapshot() {
  // Reads only what BeginSnapshot set before the caller could hand this engine to a thread.
  return impl_->snapshot_->Wait();
}

std::function<absl::Status()> Engine::SnapshotWaiter() const {
  return impl_->snapshot_->Waiter();
}

// Writes unit u's master, m and v from this rank's checkpoint ranges `src`, re-derives the
// compute-dtype parameters and all-gathers them.
absl::Status Engine::Impl::RestoreUnit(int ui, const float* const src[3]) {
  const memory::Unit& u = plan_.units[ui];
  const Region& reg = region(ui);
  const Device::Stream compute = streams_->compute();
  offload::NvmeState* nvme = memory_->nvme_state();
  const bool has_master = memory_->model_state().master != nullptr || nvme != nullptr;
  if (nvme != nullptr) RETURN_IF_ERROR(nvme->Store(ui, src[0], src[1], src[2]));
  float* dst[3] = {reg.master, reg.m, reg.v};
  std::vector<float> full;  // (padded) fp32, host: stage 0's whole unit
  for (int k = 0; k < 3; ++k) {
    if (reg.whole_unit) {
      // Every rank holds the whole unit: assemble it from every rank's range.
      full.assign(u.padded, 0.0f);
      RETURN_IF_ERROR(host_->AllGatherHost(src[k], full.data(), u.shard, DType::kF32));
      RETURN_IF_ERROR(dev_->Copy(dst[k], full.data(), u.padded * 4, compute));
      RETURN_IF_ERROR(dev_->Synchronize(compute));  // `full` is reused
    } else if (nvme == nullptr) {
      RETURN_IF_ERROR(dev_->Copy(dst[k], src[k], u.shard * 4, compute));
    }
    if (k == 0 && has_master) {
      // The compute copy is round(master), exactly what Step and InitParams write; rounded on
      // the host (as InitParams does) because the master may live there (offload).
      const float* new_master = reg.whole_unit ? full.data() : src[0];
      std::vector<char> compute_values(reg.n * c_);
      offload::Cast(new_master, DType::kF32, compute_values.data(), cdt_, reg.n);
      RETURN_IF_ERROR(StoreParamShard(ui, compute_values.data(), compute));
      RETURN_IF_ERROR(dev_->Synchronize(compute));  // before `compute_values` goes
    }
  }
  RETURN_IF_ERROR(dev_->Synchronize(compute));
  RETURN_IF_ERROR(streams_->BeforeComm());
  RETURN_IF_ERROR(gatherer_->AllGatherUpdated(ui));
  return streams_->JoinComm();
}

// Unit u's compute-dtype parameters (its region's n elements) from host `values`: into the
// region, or with NVMe parameter offload (stage 3) into the swap file, synchronously.
absl::Status Engine::Impl::StoreParamShard(int u, const char* values, Device::Stream stream) {
  if (offload::NvmeParams* file = memory_->nvme_params()) return file->Write(u, values);
  return dev_->Copy(region(u).param, values, region(u).n * c_, stream);
}

// After a failed parameter write with host state: writes every shard again as round(master)
// and refreshes the persistent units (collective, as every rank failed alike).
absl::Status Engine::Impl::RederiveNvmeParams() {
  const Device::Stream compute = streams_->compute();
  for (int u = 0; u < num_units(); ++u) {
    const Region& reg = region(u);
    std::vector<char> values(reg.n * c_);
    offload::Cast(reg.master, DType::kF32, values.data(), cdt_, reg.n);
    RETURN_IF_ERROR(StoreParamShard(u, values.data(), compute));
    RETURN_IF_ERROR(streams_->BeforeComm());
    RETURN_IF_ERROR(gatherer_->AllGatherUpdated(u));
    RETURN_IF_ERROR(streams_->JoinComm());
  }
  gatherer_->Invalidate();  // gathered copies hold the old parameters of the failed units
  return absl::OkStatus();
}

// After a failed NVMe step: the file's current copy is the previous step's state, but the
// compute-dtype parameters were partly overwritten; re-derive them unit by unit (collective,
// as every rank failed alike).
absl::Status Engine::Impl::RecoverFromNvme() {
  offload::NvmeState* nvme = memory_->nvme_state();
  for (int u = 0; u < num_units(); ++u) {
    const int64_t n = plan_.units[u].shard;
    std::vector<float> master(n), m(n), v(n);
    RETURN_IF_ERROR(nvme->Load(u, master.data(), m.data(), v.data()));
    const float* const src[3] = {master.data(), m.data(), v.data()};
    RETURN_IF_ERROR(RestoreUnit(u, src));
  }
  gatherer_->Invalidate();  // gathered stage-3 copies hold the half-updated parameters
  return absl::OkStatus();
}

absl::Status Engine::RestoreOwnedState(absl::Span<const float> master, absl::Span<const float> m,
                                       absl::Span<const float> v, const EngineState& state) {
  Impl& e = *impl_;
  const int64_t n = e.plan_.shard_elements;
  if (static_cast<int64_t>(master.size()) != n || static_cast<int64_t>(m.size()) != n ||
      static_cast<int64_t>(v.size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RestoreOwnedState: master/m/v hold ", master.size(), "/", m.size(), "/", v.size(),
        " elements; this rank owns ", n));
  }
  if (!at_step_boundary()) {
    return absl::FailedPreconditionError(
        "RestoreOwnedState inside an accumulation window: restore between optimizer steps");
  }
  if (state.hyperparams_set) {  // checked before anything changes
    RETURN_IF_ERROR(ValidateScalars(state.hyperparams, "RestoreOwnedState: hyperparams"));
  }
  RETURN_IF_ERROR(e.snapshot_->Fence(/*host=*/true));
  for (int u = 0; u < num_units(); ++u) {
    const int64_t off = e.plan_.units[u].shard_offset;
    const float* const src[3] = {master.data() + off, m.data() + off, v.data() + off};
    RETURN_IF_ERROR(e.RestoreUnit(u, src));
  }
  // Gathered stage-3 copies hold the old parameters.
  e.gatherer_->Invalidate();
  e.step_ = state.step;
  e.scaler_.set_state(state);
  // The trainer's scalars come back with the state; without any, the config's rule again.
  RETURN_IF_ERROR(e.hyper_->Restore(state.hyperparams_set, state.hyperparams));
  e.timer_.Reset();
  return e.dev_->Synchronize(e.streams_->compute());
}

}  // namespace zerort
