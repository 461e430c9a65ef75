// Engine::Step and the split step (ComputeGradNorm, ApplyStep, SkipStep), the optimizer's
// scalars and the scalar collectives.
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
      return FailedParamWrite(update.status());
    }
    ASSIGN_OR_RETURN(offload::OffloadPipeline::Times t, std::move(update));
    stats->offload_wait_ms += t.wait_ms;
    // The trainer's stream reads the new parameters next (forward, stage-3 gathers).
    RETURN_IF_ERROR(streams_->JoinComm());
    RETURN_IF_ERROR(pipeline_->JoinUploads(streams_->compute()));
    return t.gather_ms;
  }
  // With NVMe parameter offload the shards are in the file: AdamW updates the device master
  // alone, and the new shards go to the file after it.
  nvme::NvmeParams* nvme_params = memory_->nvme_params();
  const bool write_param = memory_->model_state().master != nullptr && nvme_params == nullptr;
  for (int u = 0; u < num_units(); ++u) {
    const Region& reg = region(u);
    offload::AdamWArrays a{reg.master, reg.m, reg.v, reg.grad, reg.grad_dtype,
                           write_param ? reg.param : nullptr, cdt_, static_cast<size_t>(reg.n)};
    RETURN_IF_ERROR(dev_->AdamWRanges(a, (*ranges)[u], grad_scale, streams_->compute()));
  }
  if (nvme_params != nullptr) {
    const absl::Status written = WriteBackNvmeParams();
    if (!written.ok()) return FailedParamWrite(written);
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

}  // namespace zerort
