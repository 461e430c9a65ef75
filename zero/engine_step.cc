// Engine::Step and the split step (ComputeGradNorm, ApplyStep, SkipStep), each a request to one
// function, Engine::Impl::RunStep, which lists the optimizer step's phases in order; then the
// phases, in that order; then the optimizer's scalars and the scalar collectives.
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

absl::StatusOr<StepStats> Engine::Step() {
  const Stopwatch total;
  RETURN_IF_ERROR(impl_->CheckPending("Step()", /*want=*/false));
  ASSIGN_OR_RETURN(StepStats stats, impl_->RunStep({}));
  stats.total_ms = total.ElapsedMs();
  return stats;
}

bool Engine::last_micro_step() const { return impl_->micro_ + 1 >= impl_->gas_; }

absl::StatusOr<GradNormInfo> Engine::ComputeGradNorm() {
  Impl& m = *impl_;
  if (!m.pending_.active && !last_micro_step()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "ComputeGradNorm() on micro-step ", m.micro_ + 1, " of ", m.gas_,
        " (gradient_accumulation_steps): call Step() for all but the last micro-step of "
        "each window"));
  }
  Impl::StepRequest measure;
  measure.measure_only = true;
  RETURN_IF_ERROR(m.RunStep(measure).status());
  const Impl::Pending& p = m.pending_;
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
  Impl::StepRequest apply;
  apply.clip = options.clip_coef;
  ASSIGN_OR_RETURN(StepStats stats, m.RunStep(apply));
  stats.total_ms = total.ElapsedMs();
  return stats;
}

absl::StatusOr<StepStats> Engine::SkipStep() {
  Impl& m = *impl_;
  const Stopwatch total;
  RETURN_IF_ERROR(m.CheckPending("SkipStep()", /*want=*/true));
  RETURN_IF_ERROR(zero_internal::AgreeOnDecision(*m.host_, /*apply=*/false, std::nullopt));
  Impl::StepRequest skip;
  skip.skip = true;
  ASSIGN_OR_RETURN(StepStats stats, m.RunStep(skip));
  stats.total_ms = total.ElapsedMs();
  return stats;
}

// --- the optimizer step ----------------------------------------------------------------------

// The phases of the optimizer step (docs/architecture.md, section 4). A window measured by an
// earlier ComputeGradNorm (pending_) starts at phase 3.
absl::StatusOr<StepStats> Engine::Impl::RunStep(const StepRequest& request) {
  RETURN_IF_ERROR(CheckUnparked(request.measure_only ? "ComputeGradNorm" : "Step"));
  if (!pending_.active) {
    const Stopwatch measure;
    // 1. Every reduction of this micro-step complete; inside an accumulation window the step
    //    ends here.
    RETURN_IF_ERROR(EndMicroStep());
    if (micro_ != 0) return MicroStepStats();
    // 2. The window's global gradient norm, overflow flag and clip coefficient: the same on
    //    every rank and stage, so no agreement round is needed.
    RETURN_IF_ERROR(MarkDevice(zero_internal::DeviceStepTimer::kStart));
    RETURN_IF_ERROR(MeasureWindow());
    pending_.norm_ms = measure.ElapsedMs();
  }
  if (request.measure_only) return pending_.stats;
  const Stopwatch optimizer;
  // 3. On overflow (fp16 loss scaling), or the trainer's SkipStep, skip everywhere.
  if (request.skip || pending_.g.overflow) return Skip(optimizer.ElapsedMs());
  // 4. Unscaling, the 1/(ranks x micro-steps) average and clipping fold into one factor.
  StepStats stats = pending_.stats;
  stats.grad_norm = pending_.g.norm;
  stats.clip_coef = request.clip.value_or(pending_.clip_coef);
  const float grad_scale = static_cast<float>(stats.clip_coef / pending_.g.scale);
  // 5. The step's AdamW constants. A bad scheduled value fails here, the window still pending
  //    for another ApplyStep; past this point the window is consumed, even if the update fails.
  ASSIGN_OR_RETURN(const RangeLists* ranges, StepConstants(&stats));
  // 5b. Every rank the same engine, the same collectives since the last step and the same
  //     scalars, checked before anything is written: a divergence fails the step everywhere.
  ASSIGN_OR_RETURN(const AdamWScalars scalars, hyper_->ForStep(step_ + 1));
  RETURN_IF_ERROR(zero_internal::AgreeBeforeUpdate(
      *host_, {engine_id_, &digest_, scalars, step_ + 1}));
  pending_.active = false;
  ++step_;
  // 6. AdamW on every owned region, where the optimizer runs (device, or host pipeline).
  RETURN_IF_ERROR(MarkDevice(zero_internal::DeviceStepTimer::kUpdateStart));
  ASSIGN_OR_RETURN(const double pipeline_gather_ms,
                   UpdateOwnedShards(*ranges, grad_scale, &stats));
  RETURN_IF_ERROR(MarkDevice(zero_internal::DeviceStepTimer::kUpdateDone));
  stats.optimizer_ms = pending_.norm_ms + optimizer.ElapsedMs() - pipeline_gather_ms;
  // 7. The updated parameters all-gathered; stale stage-3 copies dropped.
  const Stopwatch gather;
  RETURN_IF_ERROR(GatherUpdatedParams());
  RETURN_IF_ERROR(MarkDeviceStepDone());
  stats.gather_ms += pipeline_gather_ms + gather.ElapsedMs();
  // 8. The loss scaler's update; gradients cleared for the next window.
  RETURN_IF_ERROR(FinishStep(/*overflow=*/false, /*update_scaler=*/true, &stats));
  return stats;
}

absl::Status Engine::Impl::EndMicroStep() {
  RETURN_IF_ERROR(CheckGradsReady());
  // The reductions of this micro-step, and their follow-up, complete before anything reads
  // the gradients again (the optimizer, or the next micro-step's backward).
  RETURN_IF_ERROR(streams_->JoinComm());
  synced_in_window_ = synced_in_window_ || grads_->sync();
  grads_->StartMicroStep();
  if (++micro_ == gas_) {
    micro_ = 0;
    synced_in_window_ = false;
  }
  return absl::OkStatus();
}

StepStats Engine::Impl::MicroStepStats() const {
  StepStats stats;
  stats.step = step_;
  stats.loss_scale = scaler_.scale();
  return stats;
}

// Per unit and per shard, the squared norm and a finiteness flag, exchanged in one all-gather
// and summed in a fixed (unit, shard) order (GradNorm).
absl::Status Engine::Impl::MeasureWindow() {
  Pending& p = pending_;
  p.stats = StepStats();
  p.stats.boundary = true;
  p.stats.reduce_ms = timer_.window().reduce_ms;
  p.stats.gather_ms = timer_.window().gather_ms;
  p.stats.loss_scale = scaler_.scale();
  // Gradients hold the sum over micro-steps x the loss scale; with a gradient_predivide_factor
  // f and no prescaling the reduction summed gradients / f, and the rest of the average,
  // world / f, is folded in here (in fp32, where DeepSpeed multiplies the reduced tensor).
  const double post = !config_.prescale_gradients && config_.gradient_predivide_factor != 1.0
                          ? comm_->size() / config_.gradient_predivide_factor
                          : 1.0;
  p.g.scale = scaler_.scale() * gas_ * post;
  ASSIGN_OR_RETURN(
      const zero_internal::GradNorm::Result r,
      norm_->Measure(p.g.scale, dtimer_ == nullptr
                                    ? nullptr
                                    : dtimer_->event(zero_internal::DeviceStepTimer::kNormDone)));
  p.g.norm = r.norm;
  p.g.overflow = r.overflow;
  const double clip = config_.gradient_clipping;
  p.clip_coef = !p.g.overflow && clip > 0 && p.g.norm > clip ? clip / (p.g.norm + 1e-6) : 1.0;
  p.active = true;
  return absl::OkStatus();
}

// Parameters, m, v and the step count stay as they are.
absl::StatusOr<StepStats> Engine::Impl::Skip(double elapsed_ms) {
  const Stopwatch optimizer;
  const bool overflow = pending_.g.overflow;
  StepStats stats = pending_.stats;
  stats.skipped = true;
  stats.grad_norm = overflow ? std::numeric_limits<double>::infinity() : pending_.g.norm;
  stats.clip_coef = pending_.clip_coef;
  pending_.active = false;
  // No update and no gathers: their phases have zero length.
  RETURN_IF_ERROR(MarkDevice(zero_internal::DeviceStepTimer::kUpdateStart));
  RETURN_IF_ERROR(MarkDevice(zero_internal::DeviceStepTimer::kUpdateDone));
  RETURN_IF_ERROR(MarkDeviceStepDone());
  // An overflow is the scaler's business; a trainer's skip of finite gradients is not.
  RETURN_IF_ERROR(FinishStep(overflow, /*update_scaler=*/overflow, &stats));
  stats.optimizer_ms = pending_.norm_ms + elapsed_ms + optimizer.ElapsedMs();
  return stats;
}

absl::StatusOr<const Engine::Impl::RangeLists*> Engine::Impl::StepConstants(StepStats* stats) {
  ASSIGN_OR_RETURN(const AdamWScalars scalars, hyper_->ForStep(step_ + 1));
  ASSIGN_OR_RETURN(const RangeLists* ranges, groups_->Prepare(scalars, step_ + 1));
  stats->lr = scalars.lr;
  stats->weight_decay = scalars.weight_decay;
  return ranges;
}

// The offloaded units on the host first, then the units on the device (every unit without
// offload; with offload_optimizer.ratio < 1 the kept ones): a host step that fails leaves the
// device part untouched, so a state file's rollback (UnitStore::AfterFailedUpdate) undoes the
// whole step. A failed update is the store's to recover from (one policy).
absl::StatusOr<double> Engine::Impl::UpdateOwnedShards(const RangeLists& ranges,
                                                       float grad_scale, StepStats* stats) {
  RETURN_IF_ERROR(snapshot_->Fence(/*host=*/offload_));
  auto failed = [&](const absl::Status& s, bool offloaded) {
    const absl::Status out = store_->AfterFailedUpdate(
        s, offloaded, &step_, [this](int u) { return RegatherUnit(u); });
    gatherer_->Invalidate();  // gathered stage-3 copies hold re-derived or half-updated values
    return out;
  };
  double gather_ms = 0;
  if (pipeline_ != nullptr) {
    absl::StatusOr<double> host = UpdateOnHost(ranges, grad_scale, stats);
    if (!host.ok()) return failed(host.status(), /*offloaded=*/true);
    gather_ms = *host;
  }
  if (!kept_units_.empty()) {
    const absl::Status device = UpdateOnDevice(ranges, grad_scale);
    if (!device.ok()) return failed(device, /*offloaded=*/false);
  }
  return gather_ms;
}

absl::Status Engine::Impl::UpdateOnDevice(const RangeLists& ranges, float grad_scale) {
  for (int u : kept_units_) {
    const Region& reg = region(u);
    // Without a master copy AdamW updates the parameters in place; a region without parameters
    // (shards in a file) gets them from the store after the update.
    char* param = reg.params_are_master ? nullptr : reg.param;
    if (reg.compact()) {
      // Compact state (docs/compact_state.md): a compact master is the bf16 parameter shard
      // itself, updated in place; stochastic rounding draws by (seed, step, global index).
      offload::CompactAdamWArrays a;
      a.master_form = OffloadMasterForm(reg.master_form);
      a.master = reg.master;
      a.remainder = reg.remainder;
      a.param = reg.master_form == memory::MasterForm::kF32 ? static_cast<void*>(param)
                                                             : reg.master_bf16;
      a.param_dtype = cdt_;
      a.m = reg.m;
      a.v = reg.v;
      a.moment_dtype = reg.moment_dtype;
      a.grad = reg.grad;
      a.grad_dtype = reg.grad_dtype;
      a.n = static_cast<size_t>(reg.n);
      a.rounding = {static_cast<uint64_t>(config_.stochastic_rounding_seed),
                    static_cast<uint64_t>(step_),
                    static_cast<uint64_t>(reg.first_index)};
      RETURN_IF_ERROR(dev_->CompactAdamWRanges(a, ranges[u], grad_scale, streams_->compute()));
      continue;
    }
    offload::AdamWArrays a{reg.master, reinterpret_cast<float*>(reg.m),
                           reinterpret_cast<float*>(reg.v), reg.grad, reg.grad_dtype,
                           param, cdt_, static_cast<size_t>(reg.n)};
    RETURN_IF_ERROR(dev_->AdamWRanges(a, ranges[u], grad_scale, streams_->compute()));
  }
  return store_->AfterDeviceUpdate();
}

absl::StatusOr<double> Engine::Impl::UpdateOnHost(const RangeLists& ranges, float grad_scale,
                                                   StepStats* stats) {
  offload::OffloadPipeline::Hooks hooks;
  hooks.before_gather = [this](Device::Event e) { return streams_->BeforeCommAfter(e); };
  hooks.gather = [this](int u) { return gatherer_->AllGatherUpdated(u); };
  hooks.agree = [this](const absl::Status& local) { return comm::AgreeOnStatus(*host_, local); };
  // The pipeline's regions are the offloaded units (every trainable one at ratio 1).
  const RangeLists* host_ranges = &ranges;
  if (!kept_units_.empty()) {
    for (size_t k = 0; k < offloaded_units_.size(); ++k) {
      offloaded_ranges_[k] = ranges[offloaded_units_[k]];
    }
    host_ranges = &offloaded_ranges_;
  }
  ASSIGN_OR_RETURN(const offload::OffloadPipeline::Times t,
                   pipeline_->Update(*host_ranges, grad_scale, hooks,
                                     static_cast<uint64_t>(step_)));
  stats->offload_wait_ms += t.wait_ms;
  // The trainer's stream reads the new parameters next (forward, stage-3 gathers).
  RETURN_IF_ERROR(streams_->JoinComm());
  RETURN_IF_ERROR(pipeline_->JoinUploads(streams_->compute()));
  return t.gather_ms;
}

absl::Status Engine::Impl::MarkDevice(zero_internal::DeviceStepTimer::Point p) {
  if (dtimer_ == nullptr) return absl::OkStatus();
  return dtimer_->Mark(p, streams_->compute());
}

absl::Status Engine::Impl::MarkDeviceStepDone() {
  if (dtimer_ == nullptr) return absl::OkStatus();
  RETURN_IF_ERROR(dtimer_->Mark(zero_internal::DeviceStepTimer::kDoneCompute, streams_->compute()));
  RETURN_IF_ERROR(dtimer_->Mark(zero_internal::DeviceStepTimer::kDoneSide, streams_->side()));
  // A skipped step does not advance step_; it is still the step these times are of.
  dtimer_->StepMarked(step_);
  return absl::OkStatus();
}

absl::StatusOr<DeviceStepTimes> Engine::DeviceTimes() {
  if (impl_->dtimer_ == nullptr) {
    return absl::FailedPreconditionError(
        "DeviceTimes() needs EngineOptions::device_timing (zr_engine_options.device_timing)");
  }
  int64_t step = 0;
  ASSIGN_OR_RETURN(const zero_internal::DevicePhaseTimes t, impl_->dtimer_->Read(&step));
  DeviceStepTimes out;
  out.step = step;
  out.norm_ms = t.norm_ms;
  out.update_ms = t.update_ms;
  out.gather_ms = t.gather_ms;
  out.total_ms = t.total_ms;
  return out;
}

absl::Status Engine::Impl::GatherUpdatedParams() {
  // The units updated on the device; the pipeline gathered the offloaded ones as it went.
  // Frozen units (after the trainable ones) never change.
  if (!kept_units_.empty()) {
    RETURN_IF_ERROR(streams_->BeforeComm());
    for (int u : kept_units_) RETURN_IF_ERROR(gatherer_->AllGatherUpdated(u));
    RETURN_IF_ERROR(streams_->JoinComm());
  }
  // Gathered stage-3 copies are stale now.
  gatherer_->Invalidate();
  return absl::OkStatus();
}

absl::Status Engine::Impl::FinishStep(bool overflow, bool update_scaler, StepStats* stats) {
  if (update_scaler) RETURN_IF_ERROR(scaler_.Update(overflow));
  // Reset gradient state for the next window.
  RETURN_IF_ERROR(grads_->ClearFullGradients());
  digest_.Reset();
  stats->step = step_;
  stats->comm_bytes = timer_.window().comm_bytes;  // with this step's all-gathers
  timer_.Reset();
  return absl::OkStatus();
}

absl::Status Engine::Impl::CheckGradsReady() const {
  const int i = grads_->FirstMissing();
  if (i < 0) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("Step() before every gradient is ready: GradReady('", specs_[i].name,
                   "') is missing in this micro-step"));
}

absl::Status Engine::Impl::CheckPending(const char* call, bool want) const {
  if (pending_.active == want) return absl::OkStatus();
  return absl::FailedPreconditionError(
      want ? absl::StrCat(call, " without ComputeGradNorm(): measure the window first")
           : absl::StrCat(call, " after ComputeGradNorm(): finish that step with ApplyStep() "
                                "or SkipStep() first"));
}

// --- the optimizer's scalars and the scalar collectives ----------------------------------

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

absl::StatusOr<std::vector<double>> Engine::AllGatherScalars(absl::Span<const double> mine) {
  return zero_internal::AllGatherDoubles(*impl_->host_, mine, "AllGatherScalars");
}

absl::Status Engine::Barrier() { return comm::AllGatherU64(*impl_->host_, {0}).status(); }

}  // namespace zerort
