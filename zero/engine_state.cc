// Engine state access: step boundaries, snapshots, RestoreOwnedState and the recovery after a
// failed NVMe step.
#include "zero/engine.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "offload/cpu_kernels.h"
#include "zero/internal/engine_impl.h"

namespace zerort {

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
  if (nvme::NvmeParams* file = e.memory_->nvme_params(); file != nullptr && param != nullptr) {
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
  nvme::NvmeState* nvme = memory_->nvme_state();
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
  if (nvme::NvmeParams* file = memory_->nvme_params()) return file->Write(u, values);
  return dev_->Copy(region(u).param, values, region(u).n * c_, stream);
}

// NVMe parameter offload: unit u's shard as round(master) (what the optimizer step writes)
// into the file, a pinned buffer at a time, so no host copy of the whole shard exists. Without
// optimizer offload the master is device memory: the device rounds it into the buffer. With
// host state (optimizer offload to "cpu") the host does, as the pipeline would.
absl::Status Engine::Impl::WriteShardFromMaster(int u) {
  const float* master = region(u).master;
  const Device::Stream compute = streams_->compute();
  return memory_->nvme_params()->WriteFrom(u, [&](int64_t offset, char* buffer, int64_t bytes) {
    const float* src = master + offset / static_cast<int64_t>(c_);
    const size_t n = static_cast<size_t>(bytes) / c_;
    if (offload_) {
      offload::Cast(src, DType::kF32, buffer, cdt_, n);
      return absl::OkStatus();
    }
    RETURN_IF_ERROR(dev_->Cast(src, DType::kF32, buffer, cdt_, n, compute));
    return dev_->Synchronize(compute);  // the write reads the buffer next
  });
}

// After a step of the device optimizer with NVMe parameter offload: every unit's new shard
// into the file (the all-gathers after the step read it back). Last unit first: completed
// writes stay in the buffers as read-aheads, so the first units, which the next forward
// gathers first, are the ones left there. The first failed write stops the rest; the ranks
// then agree, so every rank fails alike (or none does).
absl::Status Engine::Impl::WriteBackNvmeParams() {
  absl::Status written;
  for (int u = num_units() - 1; u >= 0 && written.ok(); --u) written = WriteShardFromMaster(u);
  return comm::AgreeOnStatus(*host_, written);
}

// A failed parameter write with the optimizer state in memory (device or host): the step's
// update of master, m and v stands (so does the count), but the shards from the failed write
// on are old: re-derive them all. Every rank failed alike, so all re-derive (collective).
absl::Status Engine::Impl::FailedParamWrite(const absl::Status& failed) {
  return Annotate(failed, RederiveNvmeParams().ok()
                              ? "the step's update stands; the parameters were re-derived from it"
                              : "the step's update stands, but the parameters could not be "
                                "re-derived from it either: restore a checkpoint "
                                "(RestoreOwnedState rewrites them)");
}

// After a failed parameter write with the state in memory: writes every shard again as
// round(master) and refreshes the persistent units (collective, as every rank failed alike).
// A rank whose write fails again still runs every all-gather, so no rank is left in one; the
// ranks then agree on the writes' verdict.
absl::Status Engine::Impl::RederiveNvmeParams() {
  absl::Status written;
  for (int u = 0; u < num_units(); ++u) {
    written.Update(WriteShardFromMaster(u));
    RETURN_IF_ERROR(streams_->BeforeComm());
    RETURN_IF_ERROR(gatherer_->AllGatherUpdated(u));  // a failed read: every rank fails alike
    RETURN_IF_ERROR(streams_->JoinComm());
  }
  gatherer_->Invalidate();  // gathered copies hold the old parameters of the failed units
  return comm::AgreeOnStatus(*host_, written);
}

// After a failed NVMe step: the file's current copy is the previous step's state, but the
// compute-dtype parameters were partly overwritten; re-derive them unit by unit (collective,
// as every rank failed alike).
absl::Status Engine::Impl::RecoverFromNvme() {
  nvme::NvmeState* nvme = memory_->nvme_state();
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
