#include "zero/engine.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
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
#include "comm/launch_env.h"
#include "offload/cpu_kernels.h"
#include "zero/auto_fill.h"
#include "zero/lr_schedule.h"
#include "zero/internal/engine_impl.h"
#include "zero/planner.h"

namespace zerort {

absl::Status Engine::Impl::Build(Device::Stream compute) {
  RETURN_IF_ERROR(ProbeCompactKernel(compute));
  ASSIGN_OR_RETURN(memory_, zero_internal::EngineMemory::Allocate(plan_, dev_, compute));
  const zero_internal::EngineMemory& mem = *memory_;
  layout_ = std::make_unique<zero_internal::ShardLayout>(plan_, mem.model_state());
  ASSIGN_OR_RETURN(streams_, zero_internal::StreamOrder::Create(dev_, compute, comm_,
                                                                mem.grad_buckets().count,
                                                                mem.gather_slots().count));
  host_ = std::make_unique<zero_internal::HostCollectives>(comm_, dev_, compute);
  if (memory::Hierarchical(plan_.options)) RETURN_IF_ERROR(JoinShardGroup(compute));
  RETURN_IF_ERROR(JoinNodeGroups(mem));
  ASSIGN_OR_RETURN(store_, zero_internal::UnitStore::Create(plan_, *layout_, mem, config_, dev_,
                                                            compute, host_.get()));
  // A pass that has made gradients is a backward one; on the window's last micro-step the
  // optimizer step follows it.
  store_->set_step_next([this] { return micro_ + 1 >= gas_ && grads_->any_ready(); });
  const zero_internal::UnitContext units(plan_, comm_, dev_, streams_.get(), &timer_);
  grads_ = std::make_unique<zero_internal::GradBuckets>(units, *layout_, mem.model_state(),
                                                         mem.grad_buckets(), mem.grad_wire(),
                                                         mem.grad_local());
  gatherer_ = std::make_unique<zero_internal::ParamGatherer>(
      units, mem.model_state().params, mem.gather_slots(), mem.persistent(), store_.get(),
      mem.hpz_secondary());
  norm_ = std::make_unique<zero_internal::GradNorm>(plan_, *layout_, dev_, compute, host_.get(),
                                                   mem.norm_table(), mem.norm_partials());
  snapshot_ = std::make_unique<zero_internal::OwnedSnapshot>(plan_, *layout_, dev_, compute);
  // Trainable units (frozen ones come after): those the host step updates (offload_optimizer)
  // and those the device does (every one without offload; with offload_optimizer.ratio < 1
  // the ones kept on the device).
  for (int u = 0; u < plan_.trainable_units; ++u) {
    (region(u).offloaded ? offloaded_units_ : kept_units_).push_back(u);
  }
  if (offloaded_units_.empty()) return absl::OkStatus();
  // Gradient offload: the reduced shards go to host memory as their reductions complete; the
  // norm is taken on the device before they leave.
  grads_->SetGradOffload(norm_.get(), mem.grad_accum_stage());
  std::vector<offload::PipelineRegion> regions;
  for (int u : offloaded_units_) {
    const Region& r = region(u);
    regions.push_back({r.grad, r.master, r.m, r.v, r.param, r.n, r.master_bf16, r.remainder,
                       static_cast<uint64_t>(r.first_index), u});
  }
  offloaded_ranges_.resize(offloaded_units_.size());
  offload::PipelineOptions o;
  o.dtype = cdt_;
  o.master_form = OffloadMasterForm(plan_.options.master_form);
  o.moment_dtype = plan_.options.moment_dtype;
  o.rounding_seed = config_.stochastic_rounding_seed;
  o.grad_dtype = memory::ReducedGradDType(plan_.options);
  o.staging = mem.staging().base;
  o.chunks = mem.staging().count;  // 0 when the parameter shards are updated in host memory
  o.chunk_elements = mem.staging().elements;
  o.param_on_host = plan_.options.offload_param;
  o.cpu_threads = config_.cpu_threads;
  store_->PipelineStorage(&o);
  // The reduced gradients are copied to the host where the collectives run.
  ASSIGN_OR_RETURN(pipeline_, offload::OffloadPipeline::Create(dev_, std::move(regions), o,
                                                               streams_->side()));
  return absl::OkStatus();
}

// A device that runs the optimizer must have the compact form's kernel: asked with nothing to
// update, so that a device without it fails here, naming itself (and the keys), not at the
// first step.
absl::Status Engine::Impl::ProbeCompactKernel(Device::Stream compute) {
  const memory::OptimizerStateForm form = memory::StateFormOf(plan_.options);
  // The host AdamW has every form; the units offload_optimizer.ratio < 1 keeps on the device
  // run the device's.
  if (!form.compact() || (offload_ && plan_.device_state_elements == 0)) return absl::OkStatus();
  offload::CompactAdamWArrays probe;
  probe.master_form = OffloadMasterForm(form.master);
  probe.moment_dtype = form.moment_dtype;
  probe.param_dtype = cdt_;
  const absl::Status s = dev_->CompactAdamWRanges(probe, {}, 1.0f, compute);
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(
      s.message(), ": the config asks for compact optimizer state (",
      memory::StateFormDescription(plan_.options),
      "; bf16.bf16_optimizer_states, bf16.bf16_master_weights_and_grads, "
      "zerort.store_param_remainders) with the optimizer on the device",
      offload_ ? " (the units zero_optimization.offload_optimizer.ratio < 1 keeps there)" : "",
      "; use zero_optimization.offload_optimizer \"cpu\" with ratio 1 (the host AdamW has "
      "every form) or the fp32 state"));
}

absl::Status Engine::Impl::JoinShardGroup(Device::Stream compute) {
  const int group = memory::ShardGroupSize(plan_.options);
  // Asked with nothing to reduce, so that a backend without the grouped reduction fails here,
  // on every rank alike, and not at the first gradient.
  RETURN_IF_ERROR(comm_->ReduceScatterInGroups(nullptr, nullptr, 0, cdt_, comm::ReduceOp::kSum,
                                               group, streams_->side()));
  // Key = rank: the group's ranks keep the world's order, so shard position = rank % group.
  ASSIGN_OR_RETURN(shard_comm_, comm_->Split(rank_ / group, rank_));
  streams_->SetShardGroup(shard_comm_.get(), group);
  shard_host_ = std::make_unique<zero_internal::HostCollectives>(shard_comm_.get(), dev_, compute);
  return absl::OkStatus();
}

absl::Status Engine::Impl::JoinNodeGroups(const zero_internal::EngineMemory& mem) {
  const memory::PlanOptions& o = plan_.options;
  // Every Split below is collective: the options that decide them are the same on every rank
  // (a config that differs is caught by CheckPeersAgree after, not by a hang here, because
  // each rank makes the same calls for the same options).
  if (memory::Hpz(o)) {
    // Key = rank: position in the node = rank % K, the block each rank keeps.
    ASSIGN_OR_RETURN(node_comm_, comm_->Split(rank_ / o.hpz_partition_size, rank_));
    streams_->SetNodeGroup(node_comm_.get());
  }
  if (o.hierarchical_gather) {
    const int G = memory::ShardGroupSize(o), L = o.ranks_per_node;
    // One rank per node of the shard group, at this rank's position in its node; then the
    // node's ranks (a node lies within one group: G is a multiple of L).
    ASSIGN_OR_RETURN(across_comm_, comm_->Split((rank_ / G) * L + rank_ % L, rank_));
    ASSIGN_OR_RETURN(within_comm_, comm_->Split(rank_ / L, rank_));
    streams_->SetHierarchicalGather(across_comm_.get(), within_comm_.get(), mem.gather_stage());
  }
  return absl::OkStatus();
}

absl::Status Engine::Impl::CheckPeersAgree() {
  if (world_ == 1) return absl::OkStatus();
  // CRC32C over a canonical description: absl::Hash is seeded per process, which would make
  // identical models on two MPI processes look different.
  std::string canon = absl::StrCat(plan_.options.stage, "|", plan_.padded_elements, "|",
                                   plan_.units.size(), "|", static_cast<int>(cdt_), "|", gas_,
                                   "|", offload_, "|", plan_.offloaded_state_elements, "|",
                                   plan_.options.fp32_grad_accum, "|",
                                   plan_.options.fp32_grad_comm, "|",
                                   plan_.options.local_grad_accumulation, "|",
                                   plan_.options.shard_group_size, "|",
                                   plan_.options.hpz_partition_size, "|",
                                   plan_.options.hierarchical_gather, "|",
                                   plan_.options.ranks_per_node, "|",
                                   static_cast<int>(plan_.options.master_form), "|",
                                   static_cast<int>(plan_.options.moment_dtype), "|",
                                   config_.stochastic_rounding_seed, "|",
                                   config_.prescale_gradients,
                                   absl::StrFormat("|%a", config_.gradient_predivide_factor));
  for (size_t i = 0; i < specs_.size(); ++i) {
    const memory::ParamSpec& s = specs_[i];
    absl::StrAppend(&canon, "|", s.name, ":", absl::StrJoin(s.shape, "x"), "@", s.module,
                    s.frozen ? "#frozen" : "");
    // Declared gradient buffers change the plan's buffers and the order of reductions.
    const memory::ParamLayout& p = plan_.params[i];
    if (p.grad_buffer >= 0) {
      absl::StrAppend(&canon, "<", plan_.grad_buffers[p.grad_buffer], "+", p.grad_buffer_offset);
    }
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
  // The engine's id, rank 0's proposal: distinct for every engine this process creates, so
  // that engines sharing a communicator tell their steps apart.
  static std::atomic<uint64_t> created{0};
  const uint64_t proposal = (static_cast<uint64_t>(::getpid()) << 32) | created++;
  // The node size travels apart: each rank may take it from its own launcher variables
  // (FillRanksPerNode), so it is the one config value that can differ without a user's mistake
  // in the config, and the error should say so.
  const uint64_t per_node = static_cast<uint64_t>(plan_.options.ranks_per_node);
  ASSIGN_OR_RETURN(const std::vector<uint64_t> all,
                   comm::AllGatherU64(*host_, {mine, proposal, per_node}));
  engine_id_ = all[1];
  for (int r = 0; r < world_; ++r) {
    if (all[3 * r + 2] != per_node) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", rank_, " and rank ", r, " disagree on zerort.ranks_per_node (", per_node,
          " here, ", all[3 * r + 2], " there; 0: unknown): a launcher's placement that is not "
          "consecutive blocks per node on every rank leaves some ranks without it (see this "
          "engine's config notes); set zerort.ranks_per_node in the config"));
    }
    if (all[3 * r] != mine) {
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
  // Every call that checks an index reaches device memory: refused while parked.
  if (index >= 0 && index < n) return CheckUnparked(call);
  return absl::OutOfRangeError(absl::StrCat(call, "(", index, "): there are ", n,
                                            unit ? " units" : " parameters"));
}

absl::Status Engine::Impl::ReduceUnit(int u) {
  digest_.Add(zero_internal::CollectiveDigest::kReduce, u);
  // With local accumulation only the window's last micro-step reduces, unless the trainer asked
  // for every one (SetGradientSync(true)).
  const bool local = memory::LocalAccumulation(plan_.options);
  grads_->set_sync(!local || sync_every_micro_ || micro_ == gas_ - 1);
  return grads_->Reduce(u, /*first_micro=*/!synced_in_window_,
                        /*last_micro=*/micro_ == gas_ - 1);
}


// --- Engine --------------------------------------------------------------------------------

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() {
  // Work still queued on the compute stream (the engine's own, like a stage-3 Release's record,
  // and the trainer's before it) runs before the engine's memory goes: cudaFree would wait for
  // it, the CPU device's arenas do not. A failed stream has nothing left to run.
  if (impl_->streams_ != nullptr) (void)impl_->dev_->Synchronize(impl_->streams_->compute());
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

// DeepSpeed's scaling before the gradient reduction (Config::prescale_gradients,
// gradient_predivide_factor); the scaling after it is the step's (MeasureWindow).
absl::Status ConfigurePrescale(const Config& c, int world, Device* device, Device::Stream stream,
                               zero_internal::GradBuckets* grads) {
  const bool predivide = c.gradient_predivide_factor != 1.0;
  if (!c.prescale_gradients && !predivide) return absl::OkStatus();
  // Asked with no elements: a device without the kernel fails here, naming the key.
  RETURN_IF_ERROR(Annotate(device->Scale(nullptr, DType::kF32, 0, 1.0f, stream),
                           c.prescale_gradients ? "prescale_gradients"
                                                : "gradient_predivide_factor"));
  const double factor = c.prescale_gradients ? 1.0 / world : 1.0 / c.gradient_predivide_factor;
  grads->SetPrescale(static_cast<float>(factor), /*average=*/false);
  return absl::OkStatus();
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
  // Frozen by the config's globs as well as by the trainer's flags: the plan sees both.
  RETURN_IF_ERROR(MarkFrozen(config, &params));
  ASSIGN_OR_RETURN(Config with_notes, ResolvedForEngine(config, params, comm->size()));
  // A launcher describes processes: the threads of an in-process group share one process's
  // variables (a test's reference group inside an mpirun job), so only a communicator of one
  // process per rank takes the node size from them.
  if (comm->backend() != "inprocess") {
    FillRanksPerNode(comm::LaunchInfoFromEnv(), comm->size(), comm->rank(), &with_notes);
  }
  Workload workload;  // declared activations only; the reserves for this communicator
  workload.nccl_communicator = comm->backend() == "nccl";
  ASSIGN_OR_RETURN(PlanChoice choice,
                   ChoosePlan(params, with_notes, comm->size(), comm->rank(), workload));
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
                                     std::move(choice.plan), std::move(choice.budget), comm,
                                     device);
  RETURN_IF_ERROR(impl->Build(options.compute_stream));
  if (options.device_timing) {
    absl::StatusOr<std::unique_ptr<zero_internal::DeviceStepTimer>> timer =
        zero_internal::DeviceStepTimer::Create(device);
    if (!timer.ok()) {
      return absl::Status(timer.status().code(),
                          absl::StrCat("EngineOptions::device_timing: ", timer.status().message()));
    }
    impl->dtimer_ = *std::move(timer);
  }
  RETURN_IF_ERROR(ConfigurePrescale(impl->config_, comm->size(), device,
                                    impl->streams_->compute(), impl->grads_.get()));
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
int64_t Engine::nvme_param_reads_ahead_used() const {
  return impl_->store_->reads_ahead_used();
}
int64_t Engine::nvme_param_reads_ahead_wasted() const {
  return impl_->store_->reads_ahead_wasted();
}
MemoryReport Engine::memory_report() const {
  MemoryReport r;
  const zero_internal::ByteCounts& b = impl_->memory_->bytes();
  std::copy(std::begin(b.planned), std::end(b.planned), r.planned);
  std::copy(std::begin(b.allocated), std::end(b.allocated), r.allocated);
  r.allocated[static_cast<int>(memory::MemoryKind::kNvme)] = impl_->store_->file_bytes();
  const memory::GradHandoff& h = impl_->plan_.grad_handoff;
  r.trainer_grad_bytes = h.bytes;
  r.trainer_grad_in_place_bytes = h.bytes_in_place;
  r.trainer_grad_copied_bytes = h.bytes_copied;
  r.engine_grad_bytes = h.engine_grad_bytes;
  // The budget Create fitted (declared activations only, this communicator's reserves).
  const DeviceBudget& budget = impl_->budget_;
  r.device_budget_bytes = budget.total_bytes;
  if (budget.counted) {
    r.activation_bytes_per_sample = impl_->plan_.activation_bytes_per_sample;
    r.micro_batch = budget.micro_batch;
    r.activation_bytes = budget.activation_bytes;
  }
  return r;
}
double Engine::loss_scale() const { return impl_->scaler_.scale(); }
int64_t Engine::step() const { return impl_->step_; }
comm::Communicator* Engine::communicator() const { return impl_->comm_; }
Device* Engine::device() const { return impl_->dev_; }
Device::Stream Engine::compute_stream() const { return impl_->streams_->compute(); }

std::unique_ptr<comm::HostExchange> Engine::NewHostExchange() const {
  return std::make_unique<zero_internal::HostCollectives>(impl_->comm_, impl_->dev_,
                                                          impl_->streams_->compute());
}

absl::Status Engine::InitParams(const Initializer& init, bool from_rank0) {
  Impl& m = *impl_;
  RETURN_IF_ERROR(m.CheckUnparked("InitParams"));
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
    // The compute-dtype copy is what forward sees: round the fp32 values once, on the host
    // (as the store rounds a master: the lossless form's parameters are its bf16 part).
    std::vector<char> compute_values(unit.padded * m.c_);
    m.store_->RoundToParams(values.data(), compute_values.data(), unit.padded);
    // An initialisation is a restore with m and v at zero.
    const int64_t begin = m.region(u).unit_begin;
    RETURN_IF_ERROR(m.store_->StoreState(u, values.data() + begin, nullptr, nullptr));
    // Stages 0-2 keep the whole unit, owned block included: StoreWhole writes it once.
    if (m.stage_ == 3) {
      RETURN_IF_ERROR(m.store_->StoreParams(u, m.At(compute_values.data(), begin)));
    }
    RETURN_IF_ERROR(m.gatherer_->StoreWhole(u, compute_values.data()));
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
  // i's unit when that completes it, and units that waited for it (a unit reduced in place in
  // the trainer's buffer, whose padding lies over gradients reduced just now).
  ASSIGN_OR_RETURN(const std::vector<int> units, impl_->grads_->MarkReady(i));
  for (int u : units) RETURN_IF_ERROR(impl_->ReduceUnit(u));
  return absl::OkStatus();
}

absl::Status Engine::SetGradientSync(bool sync) {
  Impl& m = *impl_;
  if (m.grads_->any_ready()) {
    return absl::FailedPreconditionError(
        "SetGradientSync inside a micro-step: call it before the micro-step's first GradReady");
  }
  if (!sync && !memory::LocalAccumulation(m.plan_.options)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "SetGradientSync(false) needs zerort.local_grad_accumulation (stage 0 or 1, "
        "gradient_accumulation_steps > 1), which plans the local gradient buffer; this engine "
        "has stage ", m.stage_, ", gradient_accumulation_steps ", m.gas_, " and the key ",
        m.config_.local_grad_accumulation ? "set" : "unset"));
  }
  m.sync_every_micro_ = sync;
  return absl::OkStatus();
}

absl::StatusOr<bool> Engine::SetGradBuffer(int i, void* buffer) {
  RETURN_IF_ERROR(impl_->CheckRange("SetGradBuffer", i, /*unit=*/false));
  // The measured window's gradients may be in the trainer's buffers, read by ApplyStep.
  RETURN_IF_ERROR(impl_->CheckPending("SetGradBuffer", /*want=*/false));
  return impl_->grads_->SetSource(i, buffer);
}

const std::string& Engine::grad_copy_reason(int i) const {
  static const std::string* const kNone = new std::string();
  if (i < 0 || i >= num_params() || impl_->plan_.params[i].grad_buffer < 0) return *kNone;
  return impl_->plan_.units[impl_->plan_.params[i].unit].grad_copy_reason;
}

int Engine::reduced_units() const { return impl_->grads_->reduced_units(); }

std::vector<memory::ParamSpec> StackedSlices(const memory::ParamSpec& stacked) {
  std::vector<memory::ParamSpec> out;
  std::vector<int64_t> slice(stacked.shape.begin() + 1, stacked.shape.end());
  if (slice.empty()) slice = {1};  // [L]: L scalars
  for (int64_t l = 0; l < stacked.shape.at(0); ++l) {
    const std::string suffix = absl::StrCat("[", l, "]");
    out.push_back({stacked.name + suffix, slice, stacked.module + suffix});
    // A declared stacked gradient: the slices follow one another in it.
    out.back().grad_buffer = stacked.grad_buffer;
    if (!stacked.grad_buffer.empty() && stacked.grad_buffer_offset != memory::kGradBufferPacked) {
      const int64_t n = out.back().numel();
      out.back().grad_buffer_offset = stacked.grad_buffer_offset + l * n;
    }
  }
  return out;
}

absl::Status Engine::GradReadyUnit(int unit) {
  RETURN_IF_ERROR(impl_->CheckRange("GradReadyUnit", unit, /*unit=*/true));
  if (impl_->plan_.units[unit].frozen) {
    return absl::FailedPreconditionError(absl::StrCat(
        "GradReadyUnit(", unit, "): unit '", impl_->plan_.units[unit].name,
        "' holds frozen parameters only: it has no gradients (skip it in backward)"));
  }
  for (int i : impl_->plan_.units[unit].params) {
    if (!impl_->grads_->ready(i)) RETURN_IF_ERROR(GradReady(i));
  }
  return absl::OkStatus();
}

bool Engine::frozen(int i) const {
  return i >= 0 && i < num_params() && impl_->specs_[i].frozen;
}

absl::Status Engine::SetFrozen(int i, bool frozen) {
  RETURN_IF_ERROR(impl_->CheckRange("SetFrozen", i, /*unit=*/false));
  if (impl_->specs_[i].frozen == frozen) return absl::OkStatus();
  // Freezing changes the plan (units, gradient and optimizer-state buffers) on every rank.
  return absl::FailedPreconditionError(absl::StrCat(
      "SetFrozen('", impl_->specs_[i].name, "', ", frozen ? "true" : "false",
      "): a live engine keeps its frozen set; to change it, save a checkpoint, create a new "
      "engine with the new set (ParamSpec::frozen or zerort.frozen_params) and load it there (a "
      "frozen parameter's checkpointed m and v are zero)"));
}

absl::Status Engine::Gather(int unit) {
  RETURN_IF_ERROR(impl_->CheckRange("Gather", unit, /*unit=*/true));
  // Only stage 3 gathers on request; the other stages hold every parameter.
  if (impl_->stage_ == 3) impl_->digest_.Add(zero_internal::CollectiveDigest::kGather, unit);
  return impl_->gatherer_->Gather(unit);
}

absl::Status Engine::Release(int unit) {
  RETURN_IF_ERROR(impl_->CheckRange("Release", unit, /*unit=*/true));
  return impl_->gatherer_->Release(unit);
}

absl::Status Engine::AcquireParams(absl::Span<const int> params) {
  for (int i : params) {
    RETURN_IF_ERROR(impl_->CheckRange("Acquire", i, /*unit=*/false));
    if (impl_->stage_ == 3) {
      impl_->digest_.Add(zero_internal::CollectiveDigest::kGather, impl_->plan_.params[i].unit);
    }
  }
  return impl_->gatherer_->Acquire(params);
}

absl::Status Engine::ReleaseParams(absl::Span<const int> params) {
  for (int i : params) RETURN_IF_ERROR(impl_->CheckRange("Release", i, /*unit=*/false));
  return impl_->gatherer_->ReleaseParams(params);
}

absl::StatusOr<std::vector<float>> Engine::GatherMasterWeights() {
  Impl& m = *impl_;
  RETURN_IF_ERROR(m.CheckUnparked("GatherMasterWeights"));
  std::vector<int64_t> param_start(m.specs_.size() + 1, 0);  // in the output
  for (size_t i = 0; i < m.specs_.size(); ++i) {
    param_start[i + 1] = param_start[i] + m.plan_.params[i].numel;
  }
  std::vector<float> out(param_start.back());
  for (int u = 0; u < num_units(); ++u) {
    const memory::Unit& unit = m.plan_.units[u];
    std::vector<float> full(unit.padded);  // (padded) fp32, host
    if (m.region(u).whole_unit) {
      RETURN_IF_ERROR(m.store_->LoadState(u, full.data(), nullptr, nullptr));
    } else {
      std::vector<float> shard(unit.shard);
      RETURN_IF_ERROR(m.store_->LoadState(u, shard.data(), nullptr, nullptr));
      RETURN_IF_ERROR(
          m.shard_host().AllGatherHost(shard.data(), full.data(), unit.shard, DType::kF32));
    }
    for (int i : unit.params) {
      const memory::ParamLayout& p = m.plan_.params[i];
      std::copy(full.begin() + p.offset_in_unit, full.begin() + p.offset_in_unit + p.numel,
                out.begin() + param_start[i]);
    }
  }
  return out;
}

// --- parking (RL colocation) -----------------------------------------------------------------

// What Park must not interrupt, in the trainer's words: each leaves device state that only the
// rest of its sequence consumes (a gradient being reduced, a measured window, a gathered unit
// the trainer reads).
absl::Status Engine::Park() {
  Impl& m = *impl_;
  if (m.parked_ != nullptr) {
    return absl::FailedPreconditionError("Park: the engine is already parked; Unpark() first");
  }
  if (m.pending_.active) {
    return absl::FailedPreconditionError(
        "Park between optimizer steps only: a window measured by ComputeGradNorm() awaits "
        "ApplyStep() or SkipStep()");
  }
  if (m.grads_->any_ready()) {
    return absl::FailedPreconditionError(
        "Park between optimizer steps only: a micro-step is in progress (GradReady since the "
        "last Step()): finish it with Step()");
  }
  if (m.micro_ != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Park between optimizer steps only: ", m.micro_, " of ", m.gas_,
        " micro-steps of an accumulation window are done (gradient_accumulation_steps): finish "
        "the window with Step()"));
  }
  std::vector<int> held;
  for (int u = 0; u < num_units(); ++u) {
    if (m.gatherer_->holds(u) > 0) held.push_back(u);
  }
  if (!held.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Park between optimizer steps only: ", held.size(), " unit(s) are held (Gather or "
        "AcquireParams not yet released), first unit ", held.front(), " holding parameter '",
        m.specs_[m.plan_.units[held.front()].params.front()].name, "': Release them first"));
  }
  // The copies of an asynchronous checkpoint read device state: let them land (a checkpoint
  // writer goes on with its host buffers). Then everything queued on the engine's streams,
  // which the step ordered before the compute stream's end.
  RETURN_IF_ERROR(m.snapshot_->Fence(/*host=*/true));
  RETURN_IF_ERROR(m.streams_->JoinComm());
  const Device::Stream compute = m.streams_->compute();
  RETURN_IF_ERROR(m.dev_->Synchronize(compute));
  // The device's own cache first: nothing is parked yet if it fails.
  RETURN_IF_ERROR(m.dev_->ReleaseCachedMemory());
  absl::StatusOr<std::unique_ptr<zero_internal::ParkedArenas>> parked =
      zero_internal::ParkedArenas::Park({m.memory_->arena(memory::MemoryKind::kDevice)}, m.dev_,
                                        compute);
  if (!parked.ok()) {
    return absl::Status(parked.status().code(),
                        absl::StrCat("Park: ", parked.status().message()));
  }
  m.parked_ = *std::move(parked);
  return absl::OkStatus();
}

absl::Status Engine::Unpark() {
  Impl& m = *impl_;
  if (m.parked_ == nullptr) {
    return absl::FailedPreconditionError("Unpark: the engine is not parked");
  }
  absl::Status s = m.parked_->Unpark();
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("Unpark (the engine stays parked): ", s.message()));
  }
  m.parked_.reset();  // the slabs back to the pinned cache, for the next Park
  return absl::OkStatus();
}

bool Engine::parked() const { return impl_->parked_ != nullptr; }

int64_t Engine::parked_device_bytes() const {
  if (impl_->parked_ == nullptr) return 0;
  return static_cast<int64_t>(impl_->memory_->arena(memory::MemoryKind::kDevice)->capacity());
}

int64_t Engine::parked_host_bytes() const {
  if (impl_->parked_ == nullptr) return 0;
  return static_cast<int64_t>(impl_->parked_->host_bytes());
}

}  // namespace zerort
