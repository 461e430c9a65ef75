#include "zero/internal/unit_store.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "offload/cpu_adamw_compact.h"
#include "offload/cpu_kernels.h"

namespace zerort {
namespace zero_internal {

using memory::MasterForm;

UnitStore::UnitStore(const memory::Plan& plan, const ShardLayout& layout, Device* device,
                     Device::Stream compute, comm::HostExchange* exchange, int threads)
    : plan_(plan),
      layout_(layout),
      dev_(device),
      compute_(compute),
      exchange_(exchange),
      c_(DTypeSize(plan.options.compute_dtype)),
      params_on_host_(plan.options.offload_param),
      form_(memory::StateFormOf(plan.options)),
      threads_(threads),
      file_index_(plan.units.size(), -1) {}

absl::StatusOr<std::unique_ptr<UnitStore>> UnitStore::Create(
    const memory::Plan& plan, const ShardLayout& layout, const EngineMemory& memory,
    const Config& config, Device* device, Device::Stream compute,
    comm::HostExchange* exchange) {
  std::unique_ptr<UnitStore> store(
      new UnitStore(plan, layout, device, compute, exchange, config.cpu_threads));
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
    // The form's arrays (memory::OptimizerStateForm): master|m|v in fp32, or fewer bytes.
    const std::vector<int> arrays = form_.ElementBytes();
    ASSIGN_OR_RETURN(state_file_, nvme::NvmeState::Create(aio_.get(), swap_file_.get(), shards,
                                                          plan_.options.nvme_piece_elements,
                                                          slots.base, slots.elements * 4,
                                                          arrays));
    const void* const zeros[nvme::NvmeState::kMaxArrays] = {};
    for (int k = 0; k < static_cast<int>(shards.size()); ++k) {
      RETURN_IF_ERROR(state_file_->StoreArrays(k, zeros));
    }
    params_base = nvme::NvmeState::FileBytes(shards, plan_.options.nvme_piece_elements, arrays);
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
  if (form_.compact()) return StoreCompact(u, master, m, v);
  if (InFile(u)) return state_file_->Store(file_index_[u], master, m, v);
  const Region& reg = layout_.region(u);
  // A frozen unit keeps no state: its weights are the parameters (StoreParams).
  if (reg.frozen) return absl::OkStatus();
  const size_t bytes = static_cast<size_t>(reg.n) * 4;
  auto put = [&](void* dst, const float* src) {
    return src != nullptr ? dev_->Copy(dst, src, bytes, compute_) : dev_->Zero(dst, bytes, compute_);
  };
  if (master != nullptr) RETURN_IF_ERROR(dev_->Copy(reg.master, master, bytes, compute_));
  RETURN_IF_ERROR(put(reg.m, m));
  return put(reg.v, v);
}

absl::Status UnitStore::LoadState(int u, float* master, float* m, float* v) {
  if (form_.compact()) return LoadCompact(u, 0, layout_.region(u).n, master, m, v);
  if (InFile(u)) return state_file_->Load(file_index_[u], master, m, v);
  const Region& reg = layout_.region(u);
  if (reg.frozen) return LoadFrozen(u, 0, reg.n, master, m, v);
  const size_t bytes = static_cast<size_t>(reg.n) * 4;
  const void* src[3] = {reg.master, reg.m, reg.v};
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

// A compact form's state as fp32 arrays, in the stored arrays' order (OptimizerStateForm).
namespace {

// Host arrays of one region's state in the form it is stored in.
struct CompactHost {
  std::vector<char> master;  // fp32, or the compact master's bf16 part
  std::vector<uint16_t> remainder;
  std::vector<char> m, v;    // moment dtype
};

}  // namespace

absl::Status UnitStore::StoreCompact(int u, const float* master, const float* m, const float* v) {
  const Region& reg = layout_.region(u);
  if (reg.frozen) return absl::OkStatus();  // no state: its weights are the parameters
  const int64_t n = reg.n;
  const bool compact_master = form_.master != MasterForm::kF32;
  const DType mdt = form_.moment_dtype;
  const size_t mb = DTypeSize(mdt);
  CompactHost h;
  const void* master_in = master;  // as stored: the fp32 master, or its bf16 part
  if (compact_master && master != nullptr) {
    h.master.resize(static_cast<size_t>(n) * 2);
    uint16_t* hi = reinterpret_cast<uint16_t*>(h.master.data());
    if (form_.master == MasterForm::kBf16Remainder) {
      h.remainder.resize(n);
      RETURN_IF_ERROR(offload::SplitMasters(master, hi, h.remainder.data(), n, threads_));
    } else {
      // The stochastic form's master from an fp32 one: to nearest (even), deterministically.
      offload::Cast(master, DType::kF32, hi, DType::kBF16, n, threads_);
    }
    master_in = hi;
  }
  // Moments in their dtype; null ones are zeros.
  const void* moment_in[2] = {m, v};
  std::vector<char>* moment_host[2] = {&h.m, &h.v};
  for (int k = 0; k < 2; ++k) {
    if (mdt == DType::kF32 && moment_in[k] != nullptr) continue;
    moment_host[k]->assign(static_cast<size_t>(n) * mb, 0);
    if (moment_in[k] != nullptr) {
      offload::Cast(moment_in[k], DType::kF32, moment_host[k]->data(), mdt, n, threads_);
    }
    moment_in[k] = moment_host[k]->data();
  }
  const void* rem_in = h.remainder.empty() ? nullptr : h.remainder.data();
  if (InFile(u)) {
    const void* in[nvme::NvmeState::kMaxArrays] = {};
    int next = 0;
    in[next++] = master_in;
    if (form_.remainder_array()) in[next++] = rem_in;
    in[next++] = moment_in[0];
    in[next++] = moment_in[1];
    return state_file_->StoreArrays(file_index_[u], in);
  }
  if (master_in != nullptr) {
    void* dst = compact_master ? static_cast<void*>(reg.master_bf16) : reg.master;
    RETURN_IF_ERROR(dev_->Copy(dst, master_in, static_cast<size_t>(n) * (compact_master ? 2 : 4),
                               compute_));
    if (rem_in != nullptr) {
      RETURN_IF_ERROR(dev_->Copy(reg.remainder, rem_in, static_cast<size_t>(n) * 2, compute_));
    }
  }
  RETURN_IF_ERROR(dev_->Copy(reg.m, moment_in[0], static_cast<size_t>(n) * mb, compute_));
  RETURN_IF_ERROR(dev_->Copy(reg.v, moment_in[1], static_cast<size_t>(n) * mb, compute_));
  return dev_->Synchronize(compute_);  // before the host arrays go
}

absl::Status UnitStore::LoadCompact(int u, int64_t begin, int64_t n, float* master, float* m,
                                    float* v) {
  const Region& reg = layout_.region(u);
  if (reg.frozen) return LoadFrozen(u, begin, n, master, m, v);
  const bool compact_master = form_.master != MasterForm::kF32;
  const DType mdt = form_.moment_dtype;
  const size_t mb = DTypeSize(mdt);
  const size_t master_bytes = compact_master ? 2 : 4;
  // The stored arrays of elements [begin, begin + n), on the host.
  CompactHost h;
  const bool want_master = master != nullptr;
  if (want_master) {
    h.master.resize(static_cast<size_t>(n) * master_bytes);
    if (form_.remainder_array()) h.remainder.resize(n);
  }
  if (m != nullptr) h.m.resize(static_cast<size_t>(n) * mb);
  if (v != nullptr) h.v.resize(static_cast<size_t>(n) * mb);
  if (InFile(u)) {
    // The file holds whole shards: read the unit's, keep [begin, begin + n).
    CompactHost whole;
    const int64_t all = reg.n;
    void* out[nvme::NvmeState::kMaxArrays] = {};
    int next = 0;
    if (want_master) {
      whole.master.resize(static_cast<size_t>(all) * master_bytes);
      out[next] = whole.master.data();
    }
    ++next;
    if (form_.remainder_array()) {
      if (want_master) {
        whole.remainder.resize(all);
        out[next] = whole.remainder.data();
      }
      ++next;
    }
    if (m != nullptr) whole.m.resize(static_cast<size_t>(all) * mb), out[next] = whole.m.data();
    ++next;
    if (v != nullptr) whole.v.resize(static_cast<size_t>(all) * mb), out[next] = whole.v.data();
    RETURN_IF_ERROR(state_file_->LoadArrays(file_index_[u], out));
    auto slice = [begin, n](const std::vector<char>& from, std::vector<char>* to, size_t eb) {
      if (!to->empty()) std::memcpy(to->data(), from.data() + begin * eb, n * eb);
    };
    slice(whole.master, &h.master, master_bytes);
    slice(whole.m, &h.m, mb);
    slice(whole.v, &h.v, mb);
    if (!h.remainder.empty()) {
      std::memcpy(h.remainder.data(), whole.remainder.data() + begin, n * 2);
    }
  } else {
    if (want_master) {
      const char* src = compact_master ? reinterpret_cast<const char*>(reg.master_bf16)
                                       : reinterpret_cast<const char*>(reg.master);
      RETURN_IF_ERROR(
          dev_->Copy(h.master.data(), src + begin * master_bytes, h.master.size(), compute_));
      if (!h.remainder.empty()) {
        RETURN_IF_ERROR(
            dev_->Copy(h.remainder.data(), reg.remainder + begin, n * 2, compute_));
      }
    }
    if (m != nullptr) RETURN_IF_ERROR(dev_->Copy(h.m.data(), reg.m + begin * mb, h.m.size(), compute_));
    if (v != nullptr) RETURN_IF_ERROR(dev_->Copy(h.v.data(), reg.v + begin * mb, h.v.size(), compute_));
    RETURN_IF_ERROR(dev_->Synchronize(compute_));
  }
  if (want_master) {
    if (!compact_master) {
      std::memcpy(master, h.master.data(), h.master.size());
    } else if (form_.master == MasterForm::kBf16Remainder) {
      RETURN_IF_ERROR(offload::JoinMasters(reinterpret_cast<const uint16_t*>(h.master.data()),
                                           h.remainder.data(), master, n, threads_));
    } else {
      offload::Cast(h.master.data(), DType::kBF16, master, DType::kF32, n, threads_);  // exact
    }
  }
  if (m != nullptr) offload::Cast(h.m.data(), mdt, m, DType::kF32, n, threads_);
  if (v != nullptr) offload::Cast(h.v.data(), mdt, v, DType::kF32, n, threads_);
  return absl::OkStatus();
}

absl::Status UnitStore::BeforeSnapshot(float* master, float* m, float* v, void** param) {
  for (int u = 0; u < layout_.num_units(); ++u) {
    const Region& reg = layout_.region(u);
    const int64_t off = plan_.units[u].shard_offset;
    // A compact form's state is converted here (the snapshot copies fp32 arrays only).
    if (reg.frozen || form_.compact()) {
      RETURN_IF_ERROR(LoadCompact(u, reg.owned_begin, plan_.units[u].shard, master + off,
                                  m + off, v + off));
    }
  }
  for (int u = 0; !form_.compact() && u < layout_.num_units(); ++u) {
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
  RoundToParams(master, values.data(), n);
  RETURN_IF_ERROR(StoreParams(u, values.data()));
  return dev_->Synchronize(compute_);  // before `values` goes
}

void UnitStore::RoundToParams(const float* master, char* out, int64_t n) const {
  if (form_.master != MasterForm::kBf16Remainder) {
    offload::Cast(master, DType::kF32, out, plan_.options.compute_dtype, n, threads_);
    return;
  }
  std::vector<uint16_t> remainder(n);  // not kept: the parameters are the bf16 part alone
  // Cannot fail: no pointer is null and threads_ >= 0 (the config's range).
  offload::SplitMasters(master, reinterpret_cast<uint16_t*>(out), remainder.data(), n, threads_)
      .IgnoreError();
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
      RoundToParams(src, buffer, static_cast<int64_t>(n));
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
    RETURN_IF_ERROR(LoadState(u, master.data(), nullptr, nullptr));
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
