#include "zero/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "memory/arena.h"
#include "offload/cpu_adamw.h"
#include "offload/cpu_kernels.h"
#include "zero/loss_scaler.h"
#include "zero/planner.h"

namespace zerort {
namespace {

using memory::BufferClass;
using memory::MemoryKind;
using Clock = std::chrono::steady_clock;

double MsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

}  // namespace

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
        scaler_(config_) {}

  ~Impl();
  absl::Status Allocate();
  absl::Status CreateStreams();
  absl::Status CheckPeersAgree();

  // --- buffers -----------------------------------------------------------------------------
  // (E) compute dtype, stages 0-2; (S) stage 3.
  char* params_ = nullptr;
  // (E) compute dtype, stages 0-1; (S) stages 2-3.
  char* grads_ = nullptr;
  // (E) stage 0 / (S) stages 1-3, fp32. master_ is null in fp32 mode without offload: the
  // parameters themselves are the fp32 weights.
  float* master_ = nullptr;
  float* m_ = nullptr;
  float* v_ = nullptr;
  char* accum_ = nullptr;        // (E) stage 0 / (S) stage 1, when gradient accumulation > 1
  char* buckets_ = nullptr;      // (buckets, max_unit) compute dtype, stages 2-3
  char* gather_ = nullptr;       // (slots, max gathered unit) compute dtype, stage 3
  char* persistent_ = nullptr;   // (sum of persistent units' padded) compute dtype, stage 3
  char* staging_ = nullptr;      // (buffer_count, 2 * max shard) compute dtype, offload
  float* norm_table_ = nullptr;  // (world, units + 1) fp32, device; stages 1-3 with world > 1
  int64_t bucket_elems_ = 0, slot_elems_ = 0, staging_chunk_ = 0;
  std::vector<int64_t> persistent_offset_;  // per unit, elements into persistent_

  // --- streams ---------------------------------------------------------------------------------
  // compute_: the trainer's stream; every device operation of the engine is ordered on it. With
  // a stream-ordered communicator (NCCL), collectives and their follow-up run on comm_stream_,
  // which waits for compute_ through events and is joined back where results are needed: at
  // Step() (reduced gradients), when a bucket is handed out again, when a gathered unit is
  // handed to the trainer. The CPU communicators read memory when called: the host then waits
  // for compute_ before each collective, and side_ is compute_ itself.
  Device::Stream compute_ = nullptr;
  Device::Stream comm_stream_ = nullptr;
  Device::Stream side_ = nullptr;               // where collectives and their follow-up run
  Device::Event compute_mark_ = nullptr;        // compute_ -> comm_
  Device::Event comm_mark_ = nullptr;           // comm_ -> compute_
  std::vector<Device::Event> bucket_free_;      // per bucket: its reduce-scatter has read it
  std::vector<Device::Event> slot_ready_;       // per gather slot: its all-gather has landed
  std::vector<Device::Event> slot_free_;        // per gather slot: compute released its unit
  absl::Status BeforeComm();                    // orders compute_'s work before a collective
  absl::Status JoinComm();                      // orders comm_'s work before compute_'s next

  // --- offload pipeline (see OffloadUpdate) ---------------------------------------------------
  Device::Stream d2h_ = nullptr;           // gradient shards down into staging chunks
  Device::Stream h2d_ = nullptr;           // new parameter shards back up
  Device::Event grads_ready_ = nullptr;    // recorded on the trainer's stream before the copies
  std::vector<Device::Event> chunk_in_;    // per chunk: its gradient has arrived
  std::vector<Device::Event> chunk_out_;   // per chunk: its parameters have left
  int downloads_issued_ = 0;  // units 0..n-1 already downloading for this boundary

  // --- snapshots (BeginSnapshot): created on first use -----------------------------------------
  Device::Stream snapshot_stream_ = nullptr;
  Device::Event snapshot_start_ = nullptr;  // compute_ -> snapshot_stream_
  Device::Event snapshot_done_ = nullptr;   // the copies have landed
  bool snapshot_pending_ = false;           // an update must wait for snapshot_done_ first
  // Orders the snapshot's copies before the next write to the owned state: on compute_ for
  // device-side updates, on the host for host-side ones (offload, restore).
  absl::Status FenceSnapshot(bool host);

  char* At(char* base, int64_t elems) const { return base + elems * static_cast<int64_t>(c_); }

  // --- per micro-step ------------------------------------------------------------------------
  std::vector<uint8_t> ready_;        // per param
  std::vector<int> pending_;          // per unit: params not yet ready
  std::vector<int> unit_bucket_;      // per unit: bucket index, or -1
  std::vector<uint8_t> bucket_busy_;
  int micro_ = 0;                     // completed micro-steps in this accumulation window

  // --- stage 3 gather slots -------------------------------------------------------------------
  struct Slot {
    int unit = -1;
    bool held = false;
    uint64_t last_use = 0;
  };
  std::vector<Slot> slots_;
  std::vector<int> unit_slot_;  // per unit, or -1
  uint64_t use_clock_ = 0;
  int last_gathered_ = -1;

  absl::Status ReduceUnit(int u);
  absl::StatusOr<int> AcquireSlot();  // an empty slot, else the least recently used unheld one
  absl::Status GatherIntoSlot(int u, int slot);
  absl::Status Prefetch(int from, int direction);
  absl::StatusOr<StepStats> ApplyStep();
  absl::Status ResetGradients();
  absl::Status AllGatherParams(int u);
  // Collectives over host fp32 buffers (setup, norms, export, restore). Communicators that are
  // complete on return read host memory when called (the GPU in-process ops copy with
  // cudaMemcpyDefault); a stream-ordered one (NCCL) moves device memory only, so the values are
  // staged through `device_scratch` (size() * count floats) or, when null, a transient device
  // allocation.
  absl::Status AllGatherHost(const float* send, float* recv, size_t count,
                             float* device_scratch = nullptr);
  absl::Status BroadcastHost(float* buf, size_t count, int root);
  // All-gathers unit u's parameter shard into `full` (padded elements). With offload_param the
  // shard lives in host memory: it is staged into this rank's block of `full` first and gathered
  // in place, so collectives only ever see device buffers.
  absl::Status GatherShard(int u, char* full);
  // AdamW on the host for every owned region, pipelined through the staging chunks.
  // Enqueues unit u's reduced gradient shard into its staging chunk on the d2h stream.
  absl::Status DownloadGrad(int u);
  // Adds the time spent in all-gathers to *gather_ms and waiting for gradients to *wait_ms.
  absl::Status OffloadUpdate(const offload::AdamWStepParams& params, float grad_scale,
                             double* gather_ms, double* wait_ms);

  // Owned-region views for the optimizer, per unit.
  struct Region {
    int64_t n = 0;
    const char* grad = nullptr;
    float* master = nullptr;
    float* m = nullptr;
    float* v = nullptr;
    char* param = nullptr;  // compute dtype
  };
  Region Owned(int u);

  void Sent(int64_t elements_per_rank_block, int factor_num) {
    // nccl-tests' convention: a rank sends (n-1)/n of the buffer per pass.
    stats_.comm_bytes += factor_num * elements_per_rank_block * (world_ - 1) * c_;
  }

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
  const bool offload_param_ = plan_.options.offload_param;
  // Collectives are enqueued on a stream (NCCL) rather than complete on return.
  const bool comm_stream_ordered_ = comm_->stream_ordered();
  LossScaler scaler_;
  int64_t step_ = 0;
  StepStats stats_;  // accumulates between boundaries
  std::unique_ptr<memory::Arena> arenas_[memory::kNumMemoryKinds];
  MemoryReport report_;
};

absl::Status Engine::Impl::Allocate() {
  int64_t need[memory::kNumMemoryKinds] = {0, 0, 0};
  for (const memory::Buffer& b : plan_.buffers) {
    // Each buffer may skip up to kStaggerSlack bytes so that no two start at the same offset
    // modulo 4 KiB (see memory/arena.h: 4 KiB aliasing halves the host AdamW's bandwidth).
    need[static_cast<int>(b.kind)] +=
        static_cast<int64_t>(memory::AlignUp(b.bytes, memory::Arena::kAlignment) +
                             memory::Arena::kStaggerSlack);
    report_.planned[static_cast<int>(b.kind)] += b.bytes;
  }
  static const char* kArenaNames[] = {"device", "pinned_host", "host"};
  for (int k = 0; k < memory::kNumMemoryKinds; ++k) {
    ASSIGN_OR_RETURN(arenas_[k],
                     memory::Arena::Create(kArenaNames[k], need[k],
                                           dev_->allocator(static_cast<MemoryKind>(k))));
  }
  size_t index = 0;
  for (const memory::Buffer& b : plan_.buffers) {
    memory::Arena& arena = *arenas_[static_cast<int>(b.kind)];
    // 1280 = 5 x 256: coprime with 16, so up to 16 buffers get distinct 256-byte residues.
    const size_t residue = (index++ * 1280) % memory::Arena::kStaggerSlack;
    ASSIGN_OR_RETURN(void* p, arena.AllocateStaggered(b.name, b.bytes, residue));
    RETURN_IF_ERROR(dev_->Zero(p, b.bytes, compute_));
    char* cp = static_cast<char*>(p);
    switch (b.cls) {
      case BufferClass::kParams: params_ = cp; break;
      case BufferClass::kGrads: grads_ = cp; break;
      case BufferClass::kMaster: master_ = reinterpret_cast<float*>(cp); break;
      case BufferClass::kExpAvg: m_ = reinterpret_cast<float*>(cp); break;
      case BufferClass::kExpAvgSq: v_ = reinterpret_cast<float*>(cp); break;
      case BufferClass::kGradAccumulator: accum_ = cp; break;
      case BufferClass::kGradBucket:
        buckets_ = cp;
        bucket_elems_ = b.elements / b.count;
        bucket_busy_.assign(b.count, 0);
        break;
      case BufferClass::kGatherBuffer:
        gather_ = cp;
        slot_elems_ = b.elements / b.count;
        slots_.assign(b.count, Slot());
        break;
      case BufferClass::kPersistentParams: persistent_ = cp; break;
      case BufferClass::kOffloadStaging:
        staging_ = cp;
        staging_chunk_ = b.elements / b.count;
        break;
      case BufferClass::kNormTable:
        norm_table_ = reinterpret_cast<float*>(cp);
        break;
    }
  }
  for (int k = 0; k < memory::kNumMemoryKinds; ++k) {
    report_.allocated[k] = static_cast<int64_t>(arenas_[k]->requested());
  }
  const size_t nu = plan_.units.size();
  ready_.assign(specs_.size(), 0);
  pending_.resize(nu);
  for (size_t u = 0; u < nu; ++u) pending_[u] = static_cast<int>(plan_.units[u].params.size());
  unit_bucket_.assign(nu, -1);
  unit_slot_.assign(nu, -1);
  persistent_offset_.assign(nu, -1);
  int64_t off = 0;
  for (size_t u = 0; u < nu; ++u) {
    if (plan_.units[u].persistent) {
      persistent_offset_[u] = off;
      off += plan_.units[u].padded;
    }
  }
  return absl::OkStatus();
}

Engine::Impl::~Impl() {
  // Pending copies write into the arenas, which are destroyed after this body.
  for (Device::Stream s : {d2h_, h2d_, comm_stream_, snapshot_stream_}) {
    if (s != nullptr) {
      dev_->Synchronize(s).IgnoreError();  // a failure was reported by the step that caused it
      dev_->DestroyStream(s);
    }
  }
  for (Device::Event e : {grads_ready_, snapshot_start_, snapshot_done_}) {
    if (e != nullptr) dev_->DestroyEvent(e);
  }
  for (Device::Event e : chunk_in_) dev_->DestroyEvent(e);
  for (Device::Event e : chunk_out_) dev_->DestroyEvent(e);
  for (Device::Event e : {compute_mark_, comm_mark_}) {
    if (e != nullptr) dev_->DestroyEvent(e);
  }
  for (auto* list : {&bucket_free_, &slot_ready_, &slot_free_}) {
    for (Device::Event e : *list) dev_->DestroyEvent(e);
  }
}

absl::Status Engine::Impl::BeforeComm() {
  if (!comm_stream_ordered_) return dev_->Synchronize(compute_);
  RETURN_IF_ERROR(dev_->Record(compute_mark_, compute_));
  return dev_->Wait(comm_stream_, compute_mark_);
}

absl::Status Engine::Impl::JoinComm() {
  if (!comm_stream_ordered_) return absl::OkStatus();
  RETURN_IF_ERROR(dev_->Record(comm_mark_, comm_stream_));
  return dev_->Wait(compute_, comm_mark_);
}

absl::Status Engine::Impl::CreateStreams() {
  side_ = compute_;
  if (comm_stream_ordered_) {
    ASSIGN_OR_RETURN(comm_stream_, dev_->CreateStream());
    side_ = comm_stream_;
    ASSIGN_OR_RETURN(compute_mark_, dev_->CreateEvent());
    ASSIGN_OR_RETURN(comm_mark_, dev_->CreateEvent());
    for (size_t b = 0; b < bucket_busy_.size(); ++b) {
      ASSIGN_OR_RETURN(Device::Event e, dev_->CreateEvent());
      bucket_free_.push_back(e);
    }
    for (size_t k = 0; k < slots_.size(); ++k) {
      ASSIGN_OR_RETURN(Device::Event ready, dev_->CreateEvent());
      slot_ready_.push_back(ready);
      ASSIGN_OR_RETURN(Device::Event free, dev_->CreateEvent());
      slot_free_.push_back(free);
    }
  }
  if (!offload_) return absl::OkStatus();
  ASSIGN_OR_RETURN(d2h_, dev_->CreateStream());
  ASSIGN_OR_RETURN(h2d_, dev_->CreateStream());
  ASSIGN_OR_RETURN(grads_ready_, dev_->CreateEvent());
  for (int k = 0; k < plan_.options.offload_buffer_count; ++k) {
    ASSIGN_OR_RETURN(Device::Event in, dev_->CreateEvent());
    chunk_in_.push_back(in);
    ASSIGN_OR_RETURN(Device::Event out, dev_->CreateEvent());
    chunk_out_.push_back(out);
  }
  return absl::OkStatus();
}

// Every rank must have registered the same parameters with the same config: a mismatch would
// otherwise surface as a hang or a silent corruption inside the first collective.
absl::Status Engine::Impl::CheckPeersAgree() {
  if (world_ == 1) return absl::OkStatus();
  // FNV-1a over a canonical description: absl::Hash is seeded per process, which would make
  // identical models on two MPI processes look different.
  std::string canon = absl::StrCat(plan_.options.stage, "|", plan_.padded_elements, "|",
                                   plan_.units.size(), "|", static_cast<int>(cdt_), "|", gas_,
                                   "|", offload_);
  for (const memory::ParamSpec& s : specs_) {
    absl::StrAppend(&canon, "|", s.name, ":", absl::StrJoin(s.shape, "x"), "@", s.module);
  }
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : canon) h = (h ^ ch) * 1099511628211ull;
  // Three 21-bit pieces: integers below 2^24 travel exactly as fp32.
  float mine[3];
  for (int i = 0; i < 3; ++i) mine[i] = static_cast<float>((h >> (21 * i)) & 0x1fffff);
  std::vector<float> all(3 * world_);
  RETURN_IF_ERROR(AllGatherHost(mine, all.data(), 3));
  for (int r = 0; r < world_; ++r) {
    if (!std::equal(mine, mine + 3, all.begin() + 3 * r)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", rank_, " and rank ", r, " disagree on the model or the config (parameter "
          "names, shapes, modules, stage, precision or gradient accumulation): every rank must "
          "register the same parameters with the same config"));
    }
  }
  return absl::OkStatus();
}

Engine::Impl::Region Engine::Impl::Owned(int u) {
  const memory::Unit& unit = plan_.units[u];
  Region r;
  const bool full = stage_ == 0;
  r.n = full ? unit.padded : unit.shard;
  const int64_t own = full ? 0 : rank_ * unit.shard;      // offset of the region inside the unit
  const int64_t optim_off = full ? unit.flat_offset : unit.shard_offset;
  switch (stage_) {
    case 0:
      r.grad = At(gas_ > 1 ? accum_ : grads_, unit.flat_offset);
      break;
    case 1:
      r.grad = gas_ > 1 ? At(accum_, unit.shard_offset) : At(grads_, unit.flat_offset + own);
      break;
    default:
      r.grad = At(grads_, unit.shard_offset);
      break;
  }
  r.param = stage_ == 3 ? At(params_, unit.shard_offset) : At(params_, unit.flat_offset + own);
  r.master = master_ != nullptr ? master_ + optim_off : reinterpret_cast<float*>(r.param);
  r.m = m_ + optim_off;
  r.v = v_ + optim_off;
  return r;
}

absl::Status Engine::Impl::ReduceUnit(int u) {
  const memory::Unit& unit = plan_.units[u];
  const auto t0 = Clock::now();
  const bool first = micro_ == 0;
  const auto avg = comm::ReduceOp::kAvg;
  RETURN_IF_ERROR(BeforeComm());
  if (stage_ <= 1) {
    char* g = At(grads_, unit.flat_offset);
    if (stage_ == 0) {
      RETURN_IF_ERROR(comm_->AllReduce(g, g, unit.padded, cdt_, avg, side_));
      Sent(unit.shard, 2);
    } else {
      RETURN_IF_ERROR(
          comm_->ReduceScatter(g, At(g, rank_ * unit.shard), unit.shard, cdt_, avg, side_));
      Sent(unit.shard, 1);
    }
    if (gas_ > 1) {
      // Accumulate after the reduction so that every stage sums in the same order.
      const char* reduced = stage_ == 0 ? g : At(g, rank_ * unit.shard);
      char* acc = stage_ == 0 ? At(accum_, unit.flat_offset) : At(accum_, unit.shard_offset);
      const int64_t n = stage_ == 0 ? unit.padded : unit.shard;
      if (first) {
        RETURN_IF_ERROR(dev_->Copy(acc, reduced, n * c_, side_));
      } else {
        RETURN_IF_ERROR(dev_->Accumulate(acc, reduced, cdt_, n, side_));
      }
      RETURN_IF_ERROR(dev_->Zero(g, unit.padded * c_, side_));
    }
  } else {
    const int b = unit_bucket_[u];
    char* bucket = At(buckets_, b * bucket_elems_);
    char* shard = At(grads_, unit.shard_offset);
    if (first) {
      RETURN_IF_ERROR(comm_->ReduceScatter(bucket, shard, unit.shard, cdt_, avg, side_));
    } else {
      char* mine = At(bucket, rank_ * unit.shard);
      RETURN_IF_ERROR(comm_->ReduceScatter(bucket, mine, unit.shard, cdt_, avg, side_));
      RETURN_IF_ERROR(dev_->Accumulate(shard, mine, cdt_, unit.shard, side_));
    }
    Sent(unit.shard, 1);
    if (comm_stream_ordered_) RETURN_IF_ERROR(dev_->Record(bucket_free_[b], comm_stream_));
    bucket_busy_[b] = 0;
    unit_bucket_[u] = -1;
  }
  stats_.reduce_ms += MsSince(t0);
  // On the last micro-step the reduced shard is final: its download to the first free staging
  // chunk overlaps the rest of backward. Units arrive in plan order; only that prefix is taken.
  if (offload_ && micro_ == gas_ - 1 && u == downloads_issued_ &&
      downloads_issued_ < static_cast<int>(chunk_in_.size())) {
    RETURN_IF_ERROR(DownloadGrad(u));
    ++downloads_issued_;
  }
  return absl::OkStatus();
}

absl::Status Engine::Impl::DownloadGrad(int u) {
  const Region reg = Owned(u);
  const int k = u % static_cast<int>(chunk_in_.size());
  // The reduced gradient was written on side_ (the comm stream, or the trainer's).
  RETURN_IF_ERROR(dev_->Record(grads_ready_, side_));
  RETURN_IF_ERROR(dev_->Wait(d2h_, grads_ready_));
  RETURN_IF_ERROR(dev_->Copy(At(staging_, k * staging_chunk_), reg.grad, reg.n * c_, d2h_));
  return dev_->Record(chunk_in_[k], d2h_);
}

absl::Status Engine::Impl::ResetGradients() {
  std::fill(ready_.begin(), ready_.end(), 0);
  for (size_t u = 0; u < plan_.units.size(); ++u) {
    pending_[u] = static_cast<int>(plan_.units[u].params.size());
  }
  return absl::OkStatus();
}

absl::Status Engine::Impl::AllGatherParams(int u) {
  const memory::Unit& unit = plan_.units[u];
  if (stage_ == 1 || stage_ == 2) {
    char* full = At(params_, unit.flat_offset);
    RETURN_IF_ERROR(
        comm_->AllGather(At(full, rank_ * unit.shard), full, unit.shard, cdt_, side_));
    Sent(unit.shard, 1);
  } else if (stage_ == 3 && unit.persistent) {
    RETURN_IF_ERROR(GatherShard(u, At(persistent_, persistent_offset_[u])));
  }
  return absl::OkStatus();
}

absl::Status Engine::Impl::AllGatherHost(const float* send, float* recv, size_t count,
                                         float* device_scratch) {
  if (world_ == 1) {
    std::copy(send, send + count, recv);
    return absl::OkStatus();
  }
  if (!comm_stream_ordered_) return comm_->AllGather(send, recv, count, DType::kF32);
  const size_t bytes = world_ * count * sizeof(float);
  memory::Allocation transient;
  if (device_scratch == nullptr) {
    ASSIGN_OR_RETURN(transient, memory::Allocation::Create(
                                    dev_->allocator(MemoryKind::kDevice), bytes));
    device_scratch = transient.as<float>();
  }
  RETURN_IF_ERROR(dev_->Copy(device_scratch + rank_ * count, send, count * sizeof(float), compute_));
  RETURN_IF_ERROR(comm_->AllGather(device_scratch + rank_ * count, device_scratch, count,
                                   DType::kF32, compute_));
  RETURN_IF_ERROR(dev_->Copy(recv, device_scratch, bytes, compute_));
  return dev_->Synchronize(compute_);
}

absl::Status Engine::Impl::BroadcastHost(float* buf, size_t count, int root) {
  if (world_ == 1) return absl::OkStatus();
  if (!comm_stream_ordered_) return comm_->Broadcast(buf, count, DType::kF32, root);
  const size_t bytes = count * sizeof(float);
  ASSIGN_OR_RETURN(memory::Allocation scratch,
                   memory::Allocation::Create(dev_->allocator(MemoryKind::kDevice), bytes));
  RETURN_IF_ERROR(dev_->Copy(scratch.get(), buf, bytes, compute_));
  RETURN_IF_ERROR(comm_->Broadcast(scratch.get(), count, DType::kF32, root, compute_));
  RETURN_IF_ERROR(dev_->Copy(buf, scratch.get(), bytes, compute_));
  return dev_->Synchronize(compute_);
}

absl::Status Engine::Impl::GatherShard(int u, char* full) {
  const memory::Unit& unit = plan_.units[u];
  const char* shard = At(params_, unit.shard_offset);
  if (offload_param_) {
    char* mine = At(full, rank_ * unit.shard);
    RETURN_IF_ERROR(dev_->Copy(mine, shard, unit.shard * c_, side_));
    shard = mine;
  }
  RETURN_IF_ERROR(comm_->AllGather(shard, full, unit.shard, cdt_, side_));
  Sent(unit.shard, 1);
  return absl::OkStatus();
}

absl::StatusOr<int> Engine::Impl::AcquireSlot() {
  int best = -1;
  for (int s = 0; s < static_cast<int>(slots_.size()); ++s) {
    const Slot& slot = slots_[s];
    if (slot.held) continue;
    if (slot.unit < 0) return s;
    if (best < 0 || slot.last_use < slots_[best].last_use) best = s;
  }
  if (best < 0) {
    std::vector<int> held;
    for (const Slot& s : slots_) held.push_back(s.unit);
    return absl::FailedPreconditionError(absl::StrCat(
        "stage 3: all ", slots_.size(), " gather slots are held (units ", absl::StrJoin(held, ", "),
        "); Release units after use, or raise zero_optimization.stage3_max_live_parameters"));
  }
  unit_slot_[slots_[best].unit] = -1;
  slots_[best].unit = -1;
  return best;
}

absl::Status Engine::Impl::GatherIntoSlot(int u, int s) {
  const auto t0 = Clock::now();
  RETURN_IF_ERROR(BeforeComm());
  if (comm_stream_ordered_) RETURN_IF_ERROR(dev_->Wait(comm_stream_, slot_free_[s]));
  RETURN_IF_ERROR(GatherShard(u, At(gather_, s * slot_elems_)));
  if (comm_stream_ordered_) RETURN_IF_ERROR(dev_->Record(slot_ready_[s], comm_stream_));
  slots_[s].unit = u;
  slots_[s].last_use = ++use_clock_;
  unit_slot_[u] = s;
  stats_.gather_ms += MsSince(t0);
  return absl::OkStatus();
}

// Gathers the units after `from` in `direction` into free slots, up to the prefetch budget.
// Only empty slots and slots holding units already passed in this direction are reused, so a
// prefetch never evicts a unit that is about to be needed. Every rank runs the same
// Gather/Release sequence, so every rank prefetches the same units in the same order.
absl::Status Engine::Impl::Prefetch(int from, int direction) {
  int64_t budget = plan_.options.prefetch_elements;
  const int nu = static_cast<int>(plan_.units.size());
  for (int u = from + direction; u >= 0 && u < nu && budget > 0; u += direction) {
    const memory::Unit& unit = plan_.units[u];
    if (unit.persistent) continue;
    budget -= unit.padded;
    if (unit_slot_[u] >= 0) continue;
    int pick = -1;
    for (int s = 0; s < static_cast<int>(slots_.size()); ++s) {
      const Slot& slot = slots_[s];
      if (slot.held) continue;
      if (slot.unit < 0) {
        pick = s;
        break;
      }
      const bool passed = (slot.unit - from) * direction < 0;
      if (passed && (pick < 0 || slot.last_use < slots_[pick].last_use)) pick = s;
    }
    if (pick < 0) break;
    if (slots_[pick].unit >= 0) {
      unit_slot_[slots_[pick].unit] = -1;
      slots_[pick].unit = -1;
    }
    RETURN_IF_ERROR(GatherIntoSlot(u, pick));
  }
  return absl::OkStatus();
}

absl::StatusOr<StepStats> Engine::Impl::ApplyStep() {
  const auto t0 = Clock::now();
  const int nu = static_cast<int>(plan_.units.size());
  // Per-(shard, unit) squared-norm partials and a finiteness flag, exchanged in one all-gather
  // (stages 1-3); stage 0 holds every reduced gradient and computes all partials itself.
  // (world, units + 1) fp32
  std::vector<float> table(static_cast<size_t>(world_) * (nu + 1), 0.0f);
  // Written by the device when its stream gets there: valid after the Synchronize below.
  std::unique_ptr<bool[]> unit_finite(new bool[nu]);
  for (int u = 0; u < nu; ++u) {
    const memory::Unit& unit = plan_.units[u];
    const Region reg = Owned(u);
    RETURN_IF_ERROR(dev_->AllFinite(reg.grad, cdt_, reg.n, &unit_finite[u], compute_));
    if (stage_ == 0) {
      for (int q = 0; q < world_; ++q) {
        RETURN_IF_ERROR(dev_->SquaredNorm(reg.grad + q * unit.shard * c_, cdt_, unit.shard,
                                          &table[q * (nu + 1) + u], compute_));
      }
    } else {
      RETURN_IF_ERROR(
          dev_->SquaredNorm(reg.grad, cdt_, reg.n, &table[rank_ * (nu + 1) + u], compute_));
    }
  }
  RETURN_IF_ERROR(dev_->Synchronize(compute_));  // the step's one wait for device results
  const bool finite =
      std::all_of(unit_finite.get(), unit_finite.get() + nu, [](bool f) { return f; });
  if (stage_ == 0) {
    for (int q = 0; q < world_; ++q) table[q * (nu + 1) + nu] = finite ? 1.0f : 0.0f;
  } else {
    table[rank_ * (nu + 1) + nu] = finite ? 1.0f : 0.0f;
    if (world_ > 1) {  // in place: this rank's row is already in the table
      RETURN_IF_ERROR(
          AllGatherHost(&table[rank_ * (nu + 1)], table.data(), nu + 1, norm_table_));
    }
  }
  double sumsq = 0;
  bool all_finite = true;
  for (int q = 0; q < world_; ++q) all_finite = all_finite && table[q * (nu + 1) + nu] == 1.0f;
  for (int u = 0; u < nu; ++u) {
    for (int q = 0; q < world_; ++q) sumsq += table[q * (nu + 1) + u];
  }
  const double scale = scaler_.scale() * gas_;  // gradients hold sum over micro-steps x scale
  const double norm = std::sqrt(sumsq) / scale;
  const bool overflow = !all_finite || !std::isfinite(norm);

  StepStats stats = stats_;
  stats.boundary = true;
  stats.loss_scale = scaler_.scale();
  stats.grad_norm = norm;
  if (overflow) {
    stats.skipped = true;
    stats.grad_norm = std::numeric_limits<double>::infinity();
  } else {
    double coef = 1;
    if (config_.gradient_clipping > 0 && norm > config_.gradient_clipping) {
      coef = config_.gradient_clipping / (norm + 1e-6);
    }
    stats.clip_coef = coef;
    const float grad_scale = static_cast<float>(coef / scale);
    ++step_;
    const OptimizerConfig& oc = config_.optimizer;
    ASSIGN_OR_RETURN(offload::AdamWStepParams params,
                     offload::MakeAdamWStepParams(oc.lr, oc.beta1, oc.beta2, oc.eps,
                                                  oc.weight_decay, step_));
    double gather_ms = 0;
    RETURN_IF_ERROR(FenceSnapshot(/*host=*/offload_));
    if (offload_) {
      RETURN_IF_ERROR(OffloadUpdate(params, grad_scale, &gather_ms, &stats.offload_wait_ms));
    } else {
      for (int u = 0; u < nu; ++u) {
        const Region reg = Owned(u);
        offload::AdamWArrays a{reg.master, reg.m, reg.v, reg.grad, cdt_,
                               master_ != nullptr ? reg.param : nullptr, cdt_,
                               static_cast<size_t>(reg.n)};
        RETURN_IF_ERROR(dev_->AdamW(a, params, grad_scale, compute_));
      }
    }
    stats.optimizer_ms = MsSince(t0) - gather_ms;
    const auto tg = Clock::now();
    if (!offload_) {
      RETURN_IF_ERROR(BeforeComm());
      for (int u = 0; u < nu; ++u) RETURN_IF_ERROR(AllGatherParams(u));
      RETURN_IF_ERROR(JoinComm());
    }
    if (stage_ == 3) {
      // Gathered copies are stale now.
      for (Slot& s : slots_) {
        if (s.unit >= 0 && !s.held) {
          unit_slot_[s.unit] = -1;
          s.unit = -1;
        }
      }
    }
    stats.gather_ms += gather_ms + MsSince(tg);
  }
  if (downloads_issued_ > 0) {
    // A skipped step leaves the downloads begun in backward: the gradients they read are
    // about to be overwritten.
    downloads_issued_ = 0;
    RETURN_IF_ERROR(dev_->Synchronize(d2h_));
  }
  RETURN_IF_ERROR(scaler_.Update(overflow));
  // Reset gradient state for the next window.
  if (stage_ <= 1) RETURN_IF_ERROR(dev_->Zero(grads_, plan_.padded_elements * c_, compute_));
  stats.step = step_;
  stats.comm_bytes = stats_.comm_bytes;
  stats_ = StepStats();
  return stats;
}

// Host AdamW over every owned region, pipelined through the `buffer_count` staging chunks:
//
//   d2h stream:  grad(0) grad(1) ... grad(B-1)   grad(B) ...       (B chunks ahead of the host)
//   host:               AdamW(0)   AdamW(1)  AllGather(0)  AdamW(2)  AllGather(1) ...
//   h2d stream:                 param(0)  param(1)         param(2) ...
//
// Chunk k = u mod B carries unit u's gradient shard down (first half) and its new parameter
// shard up (second half). The host waits for chunk_in[k] before reading a gradient and for
// chunk_out[k] (unit u - B's upload) before overwriting the parameter half; unit u's
// all-gather runs once unit u + 1 has been updated, so it overlaps the next copies. With
// offload_param (stage 3) the parameter shard lives on the host and AdamW writes it in place.
absl::Status Engine::Impl::OffloadUpdate(const offload::AdamWStepParams& params,
                                         float grad_scale, double* gather_ms, double* wait_ms) {
  const int nu = static_cast<int>(plan_.units.size());
  const int chunks = static_cast<int>(chunk_in_.size());
  auto grad_host = [&](int u) { return At(staging_, (u % chunks) * staging_chunk_); };
  auto param_host = [&](int u) { return At(grad_host(u), staging_chunk_ / 2); };
  auto gather = [&](int u) -> absl::Status {
    if (!offload_param_) {
      Device::Event uploaded = chunk_out_[u % chunks];
      // A stream-ordered communicator waits on the device; the others read the buffer when
      // called, so the host waits.
      RETURN_IF_ERROR(comm_stream_ordered_ ? dev_->Wait(comm_stream_, uploaded)
                                           : dev_->WaitHost(uploaded));
    }
    const auto t0 = Clock::now();
    RETURN_IF_ERROR(AllGatherParams(u));
    *gather_ms += MsSince(t0);
    return absl::OkStatus();
  };

  // The first downloads may have started during backward (ReduceUnit).
  for (int u = downloads_issued_; u < std::min(chunks, nu); ++u) RETURN_IF_ERROR(DownloadGrad(u));
  downloads_issued_ = 0;
  for (int u = 0; u < nu; ++u) {
    const Region reg = Owned(u);
    const auto tw = Clock::now();
    RETURN_IF_ERROR(dev_->WaitHost(chunk_in_[u % chunks]));
    if (u >= chunks && !offload_param_) RETURN_IF_ERROR(dev_->WaitHost(chunk_out_[u % chunks]));
    *wait_ms += MsSince(tw);
    char* out = offload_param_ ? reg.param : param_host(u);
    offload::AdamWArrays a{reg.master, reg.m, reg.v, grad_host(u), cdt_, out, cdt_,
                           static_cast<size_t>(reg.n)};
    RETURN_IF_ERROR(offload::CpuAdamW(a, params, grad_scale, config_.cpu_threads));
    if (u + chunks < nu) RETURN_IF_ERROR(DownloadGrad(u + chunks));
    if (!offload_param_) {
      RETURN_IF_ERROR(dev_->Copy(reg.param, out, reg.n * c_, h2d_));
      RETURN_IF_ERROR(dev_->Record(chunk_out_[u % chunks], h2d_));
    }
    if (u > 0) RETURN_IF_ERROR(gather(u - 1));
  }
  if (nu > 0) RETURN_IF_ERROR(gather(nu - 1));
  // The trainer's stream reads the new parameters next (forward, stage-3 gathers).
  RETURN_IF_ERROR(JoinComm());
  if (!offload_param_) {
    for (Device::Event e : chunk_out_) RETURN_IF_ERROR(dev_->Wait(compute_, e));
  }
  return absl::OkStatus();
}

// --- Engine --------------------------------------------------------------------------------

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

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
  ASSIGN_OR_RETURN(PlanChoice choice, ChoosePlan(params, config, comm->size(), comm->rank()));
  if (!choice.fits) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the plan does not fit zero_optimization.memory_budget: ", choice.reason));
  }
  auto impl = std::make_unique<Impl>(config, std::move(params), std::move(choice.plan), comm,
                                     device);
  impl->compute_ = options.compute_stream;
  RETURN_IF_ERROR(impl->Allocate());
  RETURN_IF_ERROR(impl->CreateStreams());
  RETURN_IF_ERROR(impl->CheckPeersAgree());
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

const memory::Plan& Engine::plan() const { return impl_->plan_; }
const Config& Engine::config() const { return impl_->config_; }
int Engine::num_params() const { return static_cast<int>(impl_->specs_.size()); }
int Engine::num_units() const { return static_cast<int>(impl_->plan_.units.size()); }
int Engine::unit_of(int param) const { return impl_->plan_.params.at(param).unit; }
MemoryReport Engine::memory_report() const { return impl_->report_; }
double Engine::loss_scale() const { return impl_->scaler_.scale(); }
int64_t Engine::step() const { return impl_->step_; }

absl::Status Engine::InitParams(const Initializer& init, bool from_rank0) {
  Impl& m = *impl_;
  RETURN_IF_ERROR(m.FenceSnapshot(/*host=*/true));
  for (size_t u = 0; u < m.plan_.units.size(); ++u) {
    const memory::Unit& unit = m.plan_.units[u];
    std::vector<float> values(unit.padded, 0.0f);  // (padded) fp32, host
    if (!from_rank0 || m.rank_ == 0) {
      for (int i : unit.params) {
        const memory::ParamLayout& p = m.plan_.params[i];
        init(i, m.specs_[i], values.data() + p.offset_in_unit);
      }
    }
    if (from_rank0 && m.world_ > 1) {
      RETURN_IF_ERROR(m.BroadcastHost(values.data(), unit.padded, 0));
    }
    // The compute-dtype copy is what forward sees: round the fp32 values once, on the host.
    std::vector<char> compute(unit.padded * m.c_);
    offload::Cast(values.data(), DType::kF32, compute.data(), m.cdt_, unit.padded);
    const int64_t own = m.stage_ == 0 ? 0 : m.rank_ * unit.shard;
    const int64_t n = m.stage_ == 0 ? unit.padded : unit.shard;
    const Impl::Region reg = m.Owned(static_cast<int>(u));
    if (m.master_ != nullptr) {
      RETURN_IF_ERROR(m.dev_->Copy(reg.master, values.data() + own, n * 4, m.compute_));
    }
    RETURN_IF_ERROR(m.dev_->Zero(reg.m, n * 4, m.compute_));
    RETURN_IF_ERROR(m.dev_->Zero(reg.v, n * 4, m.compute_));
    if (m.stage_ <= 2) {
      RETURN_IF_ERROR(m.dev_->Copy(m.At(m.params_, unit.flat_offset), compute.data(),
                                   unit.padded * m.c_, m.compute_));
    } else {
      RETURN_IF_ERROR(m.dev_->Copy(m.At(m.params_, unit.shard_offset),
                                   compute.data() + own * m.c_, n * m.c_, m.compute_));
      if (unit.persistent) {
        RETURN_IF_ERROR(m.dev_->Copy(m.At(m.persistent_, m.persistent_offset_[u]),
                                     compute.data(), unit.padded * m.c_, m.compute_));
      }
    }
    // `values` and `compute` are read by copies that may still be in flight.
    RETURN_IF_ERROR(m.dev_->Synchronize(m.compute_));
  }
  for (Impl::Slot& s : m.slots_) {
    if (s.unit >= 0 && !s.held) {
      m.unit_slot_[s.unit] = -1;
      s.unit = -1;
    }
  }
  return m.dev_->Synchronize(m.compute_);
}

absl::StatusOr<void*> Engine::param(int i) {
  Impl& m = *impl_;
  if (i < 0 || i >= num_params()) {
    return absl::OutOfRangeError(absl::StrCat("param(", i, "): there are ", num_params(),
                                              " parameters"));
  }
  const memory::ParamLayout& p = m.plan_.params[i];
  if (m.stage_ <= 2) return static_cast<void*>(m.At(m.params_, p.flat_offset));
  if (m.plan_.units[p.unit].persistent) {
    return static_cast<void*>(m.At(m.persistent_, m.persistent_offset_[p.unit] + p.offset_in_unit));
  }
  const int s = m.unit_slot_[p.unit];
  if (s < 0 || !m.slots_[s].held) {
    return absl::FailedPreconditionError(absl::StrCat("parameter '", p.name, "' (unit ", p.unit,
                                                      ") is not gathered: call Gather(", p.unit,
                                                      ") first"));
  }
  return static_cast<void*>(m.At(m.gather_, s * m.slot_elems_ + p.offset_in_unit));
}

absl::StatusOr<void*> Engine::grad(int i) {
  Impl& m = *impl_;
  if (i < 0 || i >= num_params()) {
    return absl::OutOfRangeError(absl::StrCat("grad(", i, "): there are ", num_params(),
                                              " parameters"));
  }
  const memory::ParamLayout& p = m.plan_.params[i];
  if (m.ready_[i]) {
    return absl::FailedPreconditionError(absl::StrCat(
        "grad('", p.name, "') after its GradReady in this micro-step: the buffer is being reduced"));
  }
  if (m.stage_ <= 1) return static_cast<void*>(m.At(m.grads_, p.flat_offset));
  int b = m.unit_bucket_[p.unit];
  if (b < 0) {
    for (int k = 0; k < static_cast<int>(m.bucket_busy_.size()); ++k) {
      if (!m.bucket_busy_[k]) {
        b = k;
        break;
      }
    }
    if (b < 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "grad('", p.name, "'): all ", m.bucket_busy_.size(), " gradient buckets hold units "
          "whose GradReady is incomplete; finish a unit before starting another"));
    }
    m.bucket_busy_[b] = 1;
    m.unit_bucket_[p.unit] = b;
    // Its previous unit's reduce-scatter (on the comm stream) must have read it.
    if (m.comm_stream_ordered_) RETURN_IF_ERROR(m.dev_->Wait(m.compute_, m.bucket_free_[b]));
    RETURN_IF_ERROR(m.dev_->Zero(m.At(m.buckets_, b * m.bucket_elems_),
                                 m.plan_.units[p.unit].padded * m.c_, m.compute_));
  }
  return static_cast<void*>(m.At(m.buckets_, b * m.bucket_elems_ + p.offset_in_unit));
}

absl::Status Engine::GradReady(int i) {
  Impl& m = *impl_;
  if (i < 0 || i >= num_params()) {
    return absl::OutOfRangeError(absl::StrCat("GradReady(", i, "): there are ", num_params(),
                                              " parameters"));
  }
  const memory::ParamLayout& p = m.plan_.params[i];
  if (m.ready_[i]) {
    return absl::FailedPreconditionError(
        absl::StrCat("GradReady('", p.name, "') called twice in one micro-step"));
  }
  if (m.stage_ >= 2 && m.unit_bucket_[p.unit] < 0) {
    // The trainer never asked for this gradient: it is zero. Hand out the bucket now.
    RETURN_IF_ERROR(grad(i).status());
  }
  m.ready_[i] = 1;
  if (--m.pending_[p.unit] == 0) return m.ReduceUnit(p.unit);
  return absl::OkStatus();
}

absl::Status Engine::GradReadyUnit(int unit) {
  if (unit < 0 || unit >= num_units()) {
    return absl::OutOfRangeError(absl::StrCat("GradReadyUnit(", unit, "): there are ",
                                              num_units(), " units"));
  }
  for (int i : impl_->plan_.units[unit].params) {
    if (!impl_->ready_[i]) RETURN_IF_ERROR(GradReady(i));
  }
  return absl::OkStatus();
}

absl::Status Engine::Gather(int unit) {
  Impl& m = *impl_;
  if (unit < 0 || unit >= num_units()) {
    return absl::OutOfRangeError(absl::StrCat("Gather(", unit, "): there are ", num_units(),
                                              " units"));
  }
  if (m.stage_ != 3 || m.plan_.units[unit].persistent) return absl::OkStatus();
  int s = m.unit_slot_[unit];
  if (s >= 0 && m.slots_[s].held) {
    return absl::FailedPreconditionError(
        absl::StrCat("Gather(", unit, "): the unit is already gathered; Release it first"));
  }
  const int direction = m.last_gathered_ >= 0 && unit > m.last_gathered_ ? 1 : -1;
  if (s < 0) {
    ASSIGN_OR_RETURN(s, m.AcquireSlot());
    RETURN_IF_ERROR(m.GatherIntoSlot(unit, s));
  }
  m.slots_[s].held = true;
  m.slots_[s].last_use = ++m.use_clock_;
  m.last_gathered_ = unit;
  if (m.comm_stream_ordered_) RETURN_IF_ERROR(m.dev_->Wait(m.compute_, m.slot_ready_[s]));
  return m.Prefetch(unit, direction);
}

absl::Status Engine::Release(int unit) {
  Impl& m = *impl_;
  if (unit < 0 || unit >= num_units()) {
    return absl::OutOfRangeError(absl::StrCat("Release(", unit, "): there are ", num_units(),
                                              " units"));
  }
  if (m.stage_ != 3 || m.plan_.units[unit].persistent) return absl::OkStatus();
  const int s = m.unit_slot_[unit];
  if (s < 0 || !m.slots_[s].held) {
    return absl::FailedPreconditionError(
        absl::StrCat("Release(", unit, "): the unit is not gathered"));
  }
  m.slots_[s].held = false;
  // The next all-gather into this slot waits for the trainer's work on this unit.
  if (m.comm_stream_ordered_) RETURN_IF_ERROR(m.dev_->Record(m.slot_free_[s], m.compute_));
  return absl::OkStatus();
}

absl::StatusOr<StepStats> Engine::Step() {
  Impl& m = *impl_;
  const auto t0 = Clock::now();
  for (size_t i = 0; i < m.ready_.size(); ++i) {
    if (!m.ready_[i]) {
      return absl::FailedPreconditionError(absl::StrCat(
          "Step() before every gradient is ready: GradReady('", m.specs_[i].name,
          "') is missing in this micro-step"));
    }
  }
  // The reductions of this micro-step, and their follow-up, complete before anything reads
  // the gradients again (the optimizer, or the next micro-step's backward).
  RETURN_IF_ERROR(m.JoinComm());
  RETURN_IF_ERROR(m.ResetGradients());
  ++m.micro_;
  if (m.micro_ < m.gas_) {
    StepStats stats;
    stats.step = m.step_;
    stats.loss_scale = m.scaler_.scale();
    stats.total_ms = MsSince(t0);
    return stats;
  }
  m.micro_ = 0;
  ASSIGN_OR_RETURN(StepStats stats, m.ApplyStep());
  stats.total_ms = MsSince(t0);
  return stats;
}

absl::StatusOr<std::vector<float>> Engine::GatherMasterWeights() {
  Impl& m = *impl_;
  int64_t total = 0;
  for (const memory::ParamLayout& p : m.plan_.params) total += p.numel;
  std::vector<float> out(total);
  std::vector<int64_t> param_start(m.specs_.size());
  int64_t off = 0;
  for (size_t i = 0; i < m.specs_.size(); ++i) {
    param_start[i] = off;
    off += m.plan_.params[i].numel;
  }
  for (size_t u = 0; u < m.plan_.units.size(); ++u) {
    const memory::Unit& unit = m.plan_.units[u];
    std::vector<float> full(unit.padded);  // (padded) fp32, host
    const Impl::Region reg = m.Owned(static_cast<int>(u));
    if (m.stage_ == 0) {
      RETURN_IF_ERROR(m.dev_->Copy(full.data(), reg.master, unit.padded * 4, m.compute_));
    } else {
      std::vector<float> shard(unit.shard);
      RETURN_IF_ERROR(m.dev_->Copy(shard.data(), reg.master, unit.shard * 4, m.compute_));
      RETURN_IF_ERROR(m.dev_->Synchronize(m.compute_));
      RETURN_IF_ERROR(m.AllGatherHost(shard.data(), full.data(), unit.shard));
    }
    RETURN_IF_ERROR(m.dev_->Synchronize(m.compute_));
    for (int i : unit.params) {
      const memory::ParamLayout& p = m.plan_.params[i];
      std::copy(full.begin() + p.offset_in_unit, full.begin() + p.offset_in_unit + p.numel,
                out.begin() + param_start[i]);
    }
  }
  return out;
}

comm::Communicator* Engine::communicator() const { return impl_->comm_; }
Device* Engine::device() const { return impl_->dev_; }
Device::Stream Engine::compute_stream() const { return impl_->compute_; }

bool Engine::at_step_boundary() const {
  const Impl& m = *impl_;
  return m.micro_ == 0 && std::none_of(m.ready_.begin(), m.ready_.end(), [](uint8_t r) { return r; });
}

EngineState Engine::state() const {
  const LossScaler::State s = impl_->scaler_.state();
  EngineState e;
  e.step = impl_->step_;
  e.loss_scale = s.scale;
  e.scaler_hysteresis_left = s.hysteresis_left;
  e.scaler_iter = s.iter;
  e.scaler_last_overflow = s.last_overflow_iter;
  return e;
}

absl::Status Engine::Impl::FenceSnapshot(bool host) {
  if (!snapshot_pending_) return absl::OkStatus();
  snapshot_pending_ = false;
  return host ? dev_->WaitHost(snapshot_done_) : dev_->Wait(compute_, snapshot_done_);
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
  if (e.snapshot_stream_ == nullptr) {
    ASSIGN_OR_RETURN(e.snapshot_stream_, e.dev_->CreateStream());
    ASSIGN_OR_RETURN(e.snapshot_start_, e.dev_->CreateEvent());
    ASSIGN_OR_RETURN(e.snapshot_done_, e.dev_->CreateEvent());
  }
  // Everything the last step wrote is ordered on compute_ (OffloadUpdate joins its uploads and
  // all-gathers there; its host writes are already done).
  RETURN_IF_ERROR(e.dev_->Record(e.snapshot_start_, e.compute_));
  RETURN_IF_ERROR(e.dev_->Wait(e.snapshot_stream_, e.snapshot_start_));
  Device* dev = e.dev_;
  Device::Stream s = e.snapshot_stream_;
  for (int u = 0; u < num_units(); ++u) {
    const memory::Unit& unit = e.plan_.units[u];
    const Impl::Region reg = e.Owned(u);
    const int64_t off = unit.shard_offset;
    // Stage 0 regions cover the whole padded unit; the snapshot holds this rank's range.
    const int64_t skip = e.stage_ == 0 ? e.rank_ * unit.shard : 0;
    const size_t bytes = static_cast<size_t>(unit.shard) * 4;
    RETURN_IF_ERROR(dev->Copy(master + off, reg.master + skip, bytes, s));
    RETURN_IF_ERROR(dev->Copy(m + off, reg.m + skip, bytes, s));
    RETURN_IF_ERROR(dev->Copy(v + off, reg.v + skip, bytes, s));
    if (param != nullptr) {
      RETURN_IF_ERROR(dev->Copy(static_cast<char*>(param) + off * e.c_,
                                reg.param + skip * e.c_, unit.shard * e.c_, s));
    }
  }
  RETURN_IF_ERROR(e.dev_->Record(e.snapshot_done_, e.snapshot_stream_));
  e.snapshot_pending_ = true;
  return absl::OkStatus();
}

absl::Status Engine::WaitSnapshot() {
  // Reads only what BeginSnapshot set before the caller could hand this engine to a thread.
  Impl& e = *impl_;
  if (e.snapshot_done_ == nullptr) return absl::OkStatus();
  return e.dev_->WaitHost(e.snapshot_done_);
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
  RETURN_IF_ERROR(e.FenceSnapshot(/*host=*/true));
  for (size_t ui = 0; ui < e.plan_.units.size(); ++ui) {
    const memory::Unit& u = e.plan_.units[ui];
    const Impl::Region reg = e.Owned(static_cast<int>(ui));
    const float* src[3] = {master.data() + u.shard_offset, m.data() + u.shard_offset,
                           v.data() + u.shard_offset};
    float* dst[3] = {reg.master, reg.m, reg.v};
    std::vector<float> full;  // (padded) fp32, host: stage 0's whole unit
    const float* new_master = src[0];
    for (int k = 0; k < 3; ++k) {
      if (e.stage_ == 0) {
        // Every rank holds the whole unit: assemble it from every rank's range.
        full.assign(u.padded, 0.0f);
        if (e.world_ > 1) {
          RETURN_IF_ERROR(e.AllGatherHost(src[k], full.data(), u.shard));
        } else {
          std::copy(src[k], src[k] + u.shard, full.begin());
        }
        RETURN_IF_ERROR(e.dev_->Copy(dst[k], full.data(), u.padded * 4, e.compute_));
        RETURN_IF_ERROR(e.dev_->Synchronize(e.compute_));  // `full` is reused
        if (k == 0 && e.master_ != nullptr) {
          std::vector<char> compute(u.padded * e.c_);
          offload::Cast(full.data(), DType::kF32, compute.data(), e.cdt_, u.padded);
          RETURN_IF_ERROR(e.dev_->Copy(reg.param, compute.data(), compute.size(), e.compute_));
          RETURN_IF_ERROR(e.dev_->Synchronize(e.compute_));
        }
      } else {
        RETURN_IF_ERROR(e.dev_->Copy(dst[k], src[k], u.shard * 4, e.compute_));
      }
    }
    if (e.stage_ != 0 && e.master_ != nullptr) {
      // The compute copy is round(master), exactly what Step and InitParams write; rounded on
      // the host (as InitParams does) because the master may live there (offload).
      std::vector<char> compute(u.shard * e.c_);
      offload::Cast(new_master, DType::kF32, compute.data(), e.cdt_, u.shard);
      RETURN_IF_ERROR(e.dev_->Copy(reg.param, compute.data(), compute.size(), e.compute_));
      RETURN_IF_ERROR(e.dev_->Synchronize(e.compute_));  // before `compute` goes
    }
    RETURN_IF_ERROR(e.dev_->Synchronize(e.compute_));
    RETURN_IF_ERROR(e.BeforeComm());
    RETURN_IF_ERROR(e.AllGatherParams(static_cast<int>(ui)));
    RETURN_IF_ERROR(e.JoinComm());
  }
  // Gathered stage-3 copies hold the old parameters.
  for (Impl::Slot& s : e.slots_) {
    if (s.unit >= 0 && !s.held) {
      e.unit_slot_[s.unit] = -1;
      s.unit = -1;
    }
  }
  e.step_ = state.step;
  LossScaler::State ls;
  ls.scale = state.loss_scale;
  ls.hysteresis_left = state.scaler_hysteresis_left;
  ls.iter = state.scaler_iter;
  ls.last_overflow_iter = state.scaler_last_overflow;
  e.scaler_.set_state(ls);
  e.stats_ = StepStats();
  return e.dev_->Synchronize(e.compute_);
}

}  // namespace zerort
