// Engine state access: step boundaries, snapshots and RestoreOwnedState. Where the owned state
// lives is UnitStore's business (zero/internal/unit_store.h).
#include "zero/engine.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
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
  RETURN_IF_ERROR(e.CheckUnparked("BeginSnapshot"));
  if (!at_step_boundary()) {
    return absl::FailedPreconditionError(
        "BeginSnapshot inside an accumulation window: snapshot between optimizer steps");
  }
  if (master == nullptr || m == nullptr || v == nullptr) {
    return absl::InvalidArgumentError("BeginSnapshot: master, m and v must not be null");
  }
  RETURN_IF_ERROR(e.store_->BeforeSnapshot(master, m, v, &param));
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
  // The region's arrays: this rank's ranges, or in stage 0 (every rank holds the whole unit)
  // the whole unit assembled from every rank's.
  const float* arrays[3] = {src[0], src[1], src[2]};
  std::vector<float> full[3];  // (padded) fp32, host
  for (int k = 0; k < 3 && reg.whole_unit; ++k) {
    full[k].assign(u.padded, 0.0f);
    RETURN_IF_ERROR(host_->AllGatherHost(src[k], full[k].data(), u.shard, DType::kF32));
    arrays[k] = full[k].data();
  }
  RETURN_IF_ERROR(store_->StoreState(ui, arrays[0], arrays[1], arrays[2]));
  // The compute copy is round(master) (UnitStore::StoreParamsFromMaster, as after a failed
  // update read back from a file).
  if (!reg.params_are_master) RETURN_IF_ERROR(store_->StoreParamsFromMaster(ui, arrays[0]));
  RETURN_IF_ERROR(dev_->Synchronize(streams_->compute()));  // before the arrays go
  return RegatherUnit(ui);
}

absl::Status Engine::Impl::RegatherUnit(int u) {
  RETURN_IF_ERROR(streams_->BeforeComm());
  RETURN_IF_ERROR(gatherer_->AllGatherUpdated(u));
  return streams_->JoinComm();
}

absl::Status Engine::RestoreOwnedState(absl::Span<const float> master, absl::Span<const float> m,
                                       absl::Span<const float> v, const EngineState& state) {
  Impl& e = *impl_;
  RETURN_IF_ERROR(e.CheckUnparked("RestoreOwnedState"));
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
