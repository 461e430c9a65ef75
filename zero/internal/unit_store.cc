#include "zero/internal/unit_store.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "offload/cpu_kernels.h"

namespace zerort {
namespace zero_internal {

UnitStore::UnitStore(const memory::Plan& plan, const ShardLayout& layout, Device* device,
                     Device::Stream compute, comm::HostExchange* exchange)
    : plan_(plan),
      layout_(layout),
      dev_(device),
      compute_(compute),
      exchange_(exchange),
      c_(DTypeSize(plan.options.compute_dtype)),
      params_on_host_(plan.options.offload_param),
      file_index_(plan.units.size(), -1) {}

absl::StatusOr<std::unique_ptr<UnitStore>> UnitStore::Create(
    const memory::Plan& plan, const ShardLayout& layout, const EngineMemory& memory,
    const Config& config, Device* device, Device::Stream compute,
    comm::HostExchange* exchange) {
  std::unique_ptr<UnitStore> store(new UnitStore(plan, layout, device, compute, exchange));
  if (StateInFile(plan) || plan.options.offload_param_nvme) {
    RETURN_IF_ERROR(store->CreateFiles(memory, config));
  }
  return store;
}

UnitStore::~UnitStore() {
  param_file_.reset();
  state_file_.reset();
  aio_.reset();
  swap_file_.reset();
  swap_dir_.reset();
}

// The state file holds two copies of every unit's master|m|v; the parameter shards follow it
// (or start the file when only they are on NVMe). Both start zero-filled (m and v at zero; the
// master and the shards at whatever InitParams stores).
absl::Status UnitStore::CreateFiles(const EngineMemory& memory, const Config& config) {
  // pid and a per-process count: two engines of one process (a reshard, an evaluation copy)
  // never share a directory, and a dead pid marks a crashed run's leftovers.
  static std::atomic<int> engines{0};
  const std::string job = absl::StrCat(getpid(), "-", engines++);
  const bool state = StateInFile(plan_);
  // With both on NVMe, the shards take a region of the optimizer state's file, after the state.
  const std::string& dir = state ? config.zero.offload_optimizer.nvme_path
                                 : config.zero.offload_param.nvme_path;
  ASSIGN_OR_RETURN(swap_dir_, nvme::SwapDir::Create(dir, job, plan_.options.rank));
  ASSIGN_OR_RETURN(swap_file_, swap_dir_->CreateFile(state ? "optimizer_state" : "param_shard",
                                                     plan_.nvme_bytes()));
  const AioConfig& a = config.aio;
  ASSIGN_OR_RETURN(aio_, nvme::AioEngine::Create({a.block_size, a.queue_depth, a.single_submit,
                                                  a.overlap_events, a.thread_count, nullptr}));
  // The state file holds the offloaded units' state only (all of them but with
  // offload_optimizer.ratio < 1), in unit order; the parameter shards are every unit's.
  std::vector<int64_t> shards, shard_bytes;
  for (int u = 0; u < static_cast<int>(plan_.units.size()); ++u) {
    const memory::Unit& unit = plan_.units[u];
    if (unit.offloaded) {
      file_index_[u] = static_cast<int>(shards.size());
      shards.push_back(unit.shard);
    }
    shard_bytes.push_back(unit.shard * static_cast<int64_t>(c_));
  }
  int64_t params_base = 0;
  if (state) {
    const SlottedBuffer& slots = memory.nvme_staging();
    ASSIGN_OR_RETURN(state_file_, nvme::NvmeState::Create(aio_.get(), swap_file_.get(), shards,
                                                          plan_.options.nvme_piece_elements,
                                                          slots.base, slots.elements * 4));
    for (int k = 0; k < static_cast<int>(shards.size()); ++k) {
      RETURN_IF_ERROR(state_file_->Store(k, nullptr, nullptr, nullptr));
    }
    params_base = nvme::NvmeState::FileBytes(shards, plan_.options.nvme_piece_elements);
  }
  if (!plan_.options.offload_param_nvme) return absl::OkStatus();
  const SlottedBuffer& buffers = memory.nvme_param_buffers();
  ASSIGN_OR_RETURN(param_file_,
                   nvme::NvmeParams::Create(aio_.get(), swap_file_.get(), params_base,
                                            std::move(shard_bytes), buffers.base, buffers.count,
                                            buffers.elements * static_cast<int64_t>(c_)));
  return absl::OkStatus();
}

// --- optimizer state --------------------------------------------------------------------------

absl::Status UnitStore::StoreState(int u, const float* master, const float* m, const float* v) {
  if (InFile(u)) return state_file_->Store(file_index_[u], master, m, v);
  const Region& reg = layout_.region(u);
  // A frozen unit keeps no state: its weights are the parameters (StoreParams).
  if (reg.frozen) return absl::OkStatus();
  const size_t bytes = static_cast<size_t>(reg.n) * 4;
  auto put = [&](float* dst, const float* src) {
    return src != nullptr ? dev_->Copy(dst, src, bytes, compute_) : dev_->Zero(dst, bytes, compute_);
  };
  if (master != nullptr) RETURN_IF_ERROR(dev_->Copy(reg.master, master, bytes, compute_));
  RETURN_IF_ERROR(put(reg.m, m));
  return put(reg.v, v);
}

absl::Status UnitStore::LoadState(int u, float* master, float* m, float* v) {
  if (InFile(u)) return state_file_->Load(file_index_[u], master, m, v);
  const Region& reg = layout_.region(u);
  if (reg.frozen) return LoadFrozen(u, 0, reg.n, master, m, v);
  const size_t bytes = static_cast<size_t>(reg.n) * 4;
  const float* src[3] = {reg.master, reg.m, reg.v};
  float* dst[3] = {master, m, v};
  for (int k = 0; k < 3; ++k) {
    if (dst[k] != nullptr) RETURN_IF_ERROR(dev_->Copy(dst[k], src[k], bytes, compute_));
  }
  return dev_->Synchronize(compute_);
}

// A frozen unit's fp32 weights are its parameters widened (exact), and its m and v zero: the
// same arrays a trainable unit has, so checkpoints and GatherMasterWeights need no other form.
absl::Status UnitStore::LoadFrozen(int u, int64_t begin, int64_t n, float* master, float* m,
                                   float* v) {
  const Region& reg = layout_.region(u);
  for (float* zero : {m, v}) {
    if (zero != nullptr) std::fill(zero, zero + n, 0.0f);
  }
  if (master == nullptr) return absl::OkStatus();
  std::vector<char> values(static_cast<size_t>(n) * c_);  // (n) compute dtype, host
  RETURN_IF_ERROR(dev_->Copy(values.data(), reg.param + begin * static_cast<int64_t>(c_),
                             values.size(), compute_));
  RETURN_IF_ERROR(dev_->Synchronize(compute_));
  offload::Cast(values.data(), plan_.options.compute_dtype, master, DType::kF32, n);
  return absl::OkStatus();
}

absl::Status UnitStore::BeforeSnapshot(float* master, float* m, float* v, void** param) {
  for (int u = 0; u < layout_.num_units(); ++u) {
    const Region& reg = layout_.region(u);
    const int64_t off = plan_.units[u].shard_offset;
    if (reg.frozen) {
      RETURN_IF_ERROR(LoadFrozen(u, reg.owned_begin, plan_.units[u].shard, master + off,
                                 m + off, v + off));
    }
  }
  for (int u = 0; u < layout_.num_units(); ++u) {
    if (!InFile(u)) continue;  // in memory: the snapshot copies it
    const int64_t off = plan_.units[u].shard_offset;
    RETURN_IF_ERROR(state_file_->Load(file_index_[u], master + off, m + off, v + off));
  }
  if (param_file_ == nullptr || *param == nullptr) return absl::OkStatus();
  for (int u = 0; u < layout_.num_units(); ++u) {  // the shards, before the snapshot begins
    char* dst = static_cast<char*>(*param) + plan_.units[u].shard_offset * c_;
    RETURN_IF_ERROR(param_file_->Read(u, [dst](int64_t offset, const char* data, int64_t bytes) {
      std::memcpy(dst + offset, data, static_cast<size_t>(bytes));
      return absl::OkStatus();
    }));
  }
  *param = nullptr;
  return absl::OkStatus();
}

// --- the parameter shard ----------------------------------------------------------------------

absl::Status UnitStore::StoreParams(int u, const char* values) {
  if (param_file_ != nullptr) return param_file_->Write(u, values);
  const Region& reg = layout_.region(u);
  return dev_->Copy(reg.param, values, reg.n * c_, compute_);
}

// The step and InitParams round on the host too (the master may live there: offload).
absl::Status UnitStore::StoreParamsFromMaster(int u, const float* master) {
  const int64_t n = layout_.region(u).n;
  std::vector<char> values(n * c_);  // (n) compute dtype, host
  offload::Cast(master, DType::kF32, values.data(), plan_.options.compute_dtype, n);
  RETURN_IF_ERROR(StoreParams(u, values.data()));
  return dev_->Synchronize(compute_);  // before `values` goes
}

// Collectives only ever see device buffers: a shard in host memory or in the file is staged
// into this rank's block of the destination and gathered in place.
const char* UnitStore::ShardToSend(int u, char* block) const {
  return params_on_host_ ? block : layout_.region(u).param;
}

absl::Status UnitStore::StageShard(int u, char* block, Device::Stream side,
                                   const std::function<bool(int)>& gathered) {
  const Region& reg = layout_.region(u);
  if (!params_on_host_) return absl::OkStatus();
  if (param_file_ == nullptr) return dev_->Copy(block, reg.param, reg.n * c_, side);
  absl::Status read = param_file_->Read(u, [&](int64_t offset, const char* data, int64_t bytes) {
    RETURN_IF_ERROR(dev_->Copy(block + offset, data, bytes, side));
    return dev_->Synchronize(side);  // the next piece reuses the buffer
  });
  read.Update(ReadAhead(u, gathered));
  return read;
}

// At either end of the units the gathers can only turn round (backward follows forward, and
// forward backward), unless the optimizer step is next.
absl::Status UnitStore::ReadAhead(int u, const std::function<bool(int)>& gathered) {
  const int nu = layout_.num_units();
  int direction = u >= last_read_ ? 1 : -1;
  const bool at_end = u + direction < 0 || u + direction >= nu;
  last_read_ = u;
  if (at_end && step_next_ && step_next_()) return absl::OkStatus();
  if (at_end) direction = -direction;
  // Units still gathered in a slot (the last ones of the pass before a turn) need no read.
  int next = u + direction;
  while (next >= 0 && next < nu && gathered(next)) next += direction;
  if (next >= 0 && next < nu) param_file_->ReadAhead(next, direction);
  return absl::OkStatus();
}

absl::Status UnitStore::AgreeOnRead(const absl::Status& read) {
  return param_file_ != nullptr ? comm::AgreeOnStatus(*exchange_, read) : read;
}

// --- the optimizer step -----------------------------------------------------------------------

void UnitStore::PipelineStorage(offload::PipelineOptions* options) const {
  options->nvme = state_file_.get();
  options->nvme_params = param_file_.get();
}

// Last unit first: completed writes stay in the buffers as read-aheads, so the first units,
// which the next forward gathers first, are the ones left there. The first failed write stops
// the rest; the ranks then agree, so every rank fails alike (or none does). The offloaded units'
// shards (offload_optimizer.ratio < 1) were written by the host step.
absl::Status UnitStore::AfterDeviceUpdate() {
  if (param_file_ == nullptr) return absl::OkStatus();
  absl::Status written;
  for (int u = layout_.num_units() - 1; u >= 0 && written.ok(); --u) {
    if (!layout_.region(u).offloaded) written = WriteShardFromMaster(u);
  }
  return comm::AgreeOnStatus(*exchange_, written);
}

// Unit u's shard as round(master) (what the optimizer step writes) into the file, a pinned
// buffer at a time, so no host copy of the whole shard exists. With the optimizer on the device
// the master is device memory and the device rounds it into the buffer; with host state (an
// offloaded unit) the host does, as the pipeline would. REQUIRES: the master is in memory.
absl::Status UnitStore::WriteShardFromMaster(int u) {
  const float* master = layout_.region(u).master;
  const bool host = layout_.region(u).offloaded;
  const DType cdt = plan_.options.compute_dtype;
  return param_file_->WriteFrom(u, [&](int64_t offset, char* buffer, int64_t bytes) {
    const float* src = master + offset / static_cast<int64_t>(c_);
    const size_t n = static_cast<size_t>(bytes) / c_;
    if (host) {
      offload::Cast(src, DType::kF32, buffer, cdt, n);
      return absl::OkStatus();
    }
    RETURN_IF_ERROR(dev_->Cast(src, DType::kF32, buffer, cdt, n, compute_));
    return dev_->Synchronize(compute_);  // the write reads the buffer next
  });
}

absl::Status UnitStore::AfterFailedUpdate(const absl::Status& failed, bool offloaded,
                                          int64_t* step,
                                          const std::function<absl::Status(int)>& regather) {
  // The state file is written by the host step only: a failure there leaves the offloaded
  // units' previous state, and the kept units (updated after it) are untouched.
  if (state_file_ != nullptr && offloaded) {
    --*step;
    return Annotate(failed, RecoverFromFile(regather).ok()
                                ? "the previous step's state and parameters stay"
                                : "the parameters could not be re-derived either");
  }
  if (param_file_ != nullptr) {
    return Annotate(failed, RederiveShards(offloaded, regather).ok()
                                ? "the step's update stands; the parameters were re-derived "
                                  "from it"
                                : "the step's update stands, but the parameters could not be "
                                  "re-derived from it either: restore a checkpoint "
                                  "(RestoreOwnedState rewrites them)");
  }
  return failed;
}

// The file's current copy is the previous step's state, but the parameters were partly
// overwritten: each unit's are re-derived as round(master) and all-gathered again.
absl::Status UnitStore::RecoverFromFile(const std::function<absl::Status(int)>& regather) {
  for (int u = 0; u < layout_.num_units(); ++u) {
    if (!InFile(u)) continue;  // kept on the device: not updated yet
    std::vector<float> master(layout_.region(u).n);
    RETURN_IF_ERROR(state_file_->Load(file_index_[u], master.data(), nullptr, nullptr));
    RETURN_IF_ERROR(StoreParamsFromMaster(u, master.data()));
    RETURN_IF_ERROR(regather(u));
  }
  return absl::OkStatus();
}

// Every shard of the failed update's part (the offloaded units, or the kept ones) written again
// as round(master), each unit all-gathered again; the other part's shards were not touched. A
// rank whose write fails again still runs every all-gather, so no rank is left in one; the
// ranks then agree on the writes' verdict.
absl::Status UnitStore::RederiveShards(bool offloaded,
                                       const std::function<absl::Status(int)>& regather) {
  absl::Status written;
  for (int u = 0; u < layout_.num_units(); ++u) {
    if (layout_.region(u).offloaded != offloaded) continue;
    written.Update(WriteShardFromMaster(u));
    RETURN_IF_ERROR(regather(u));  // a failed read: every rank fails alike
  }
  return comm::AgreeOnStatus(*exchange_, written);
}

int64_t UnitStore::file_bytes() const {
  return swap_file_ != nullptr ? swap_file_->bytes() : 0;
}
int64_t UnitStore::reads_ahead_used() const {
  return param_file_ != nullptr ? param_file_->reads_ahead_used() : 0;
}
int64_t UnitStore::reads_ahead_wasted() const {
  return param_file_ != nullptr ? param_file_->reads_ahead_wasted() : 0;
}

}  // namespace zero_internal
}  // namespace zerort
