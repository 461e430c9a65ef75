#include "zero/internal/grad_buckets.h"

#include <algorithm>

#include "absl/base/internal/raw_logging.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace zerort {
namespace zero_internal {

GradBuckets::GradBuckets(const UnitContext& ctx, const ShardLayout& layout,
                         const ModelStateBuffers& state, const SlottedBuffer& buckets, float* wire,
                         char* local)
    : ctx_(ctx),
      layout_(layout),
      gas_(ctx.plan.options.gradient_accumulation_steps),
      grad_dtype_(memory::ReducedGradDType(ctx.plan.options)),
      wire_dtype_(memory::GradWireDType(ctx.plan.options)),
      wire_(wire),
      local_(local),
      grads_(state.grads),
      buckets_(buckets),
      ready_(ctx.plan.params.size(), 0),
      source_(ctx.plan.params.size(), nullptr),
      pending_(ctx.plan.units.size()),
      unit_bucket_(ctx.plan.units.size(), -1),
      bucket_busy_(buckets.count, 0) {
  StartMicroStep();
}

// A frozen parameter has no gradient anywhere: every gradient call on it is the trainer's bug.
absl::Status GradBuckets::CheckTrainable(int i, const char* call) const {
  const memory::ParamLayout& p = ctx_.plan.params[i];
  if (!ctx_.plan.units[p.unit].frozen) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      call, "('", p.name, "'): the parameter is frozen: it has no gradient buffer and is never "
      "reduced (skip it in backward, or re-create the engine with it trainable)"));
}

absl::StatusOr<void*> GradBuckets::Grad(int i) {
  const memory::ParamLayout& p = ctx_.plan.params[i];
  RETURN_IF_ERROR(CheckTrainable(i, "grad"));
  if (ready_[i]) {
    return absl::FailedPreconditionError(absl::StrCat(
        "grad('", p.name, "') after its GradReady in this micro-step: the buffer is being reduced"));
  }
  if (source_[i] != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "grad('", p.name, "'): its gradient is read from the buffer given to SetGradBuffer; "
        "write there, or SetGradBuffer(i, nullptr) first"));
  }
  return Slot(i);
}

absl::StatusOr<void*> GradBuckets::Slot(int i) {
  const memory::ParamLayout& p = ctx_.plan.params[i];
  if (ctx_.stage <= 1) return static_cast<void*>(ctx_.At(grads_, p.flat_offset));
  int b = unit_bucket_[p.unit];
  if (b < 0) {
    ASSIGN_OR_RETURN(b, AcquireBucket(p.unit, p));
  }
  return static_cast<void*>(ctx_.At(buckets_.base, buckets_.offset(b) + p.offset_in_unit));
}

absl::StatusOr<int> GradBuckets::AcquireBucket(int unit, const memory::ParamLayout& p) {
  // Only buckets of the unit's size class (memory/plan.h): a small unit never holds a bucket
  // that a large one needs.
  const int64_t padded = ctx_.plan.units[unit].padded;
  int b = 0, of_class = 0;
  for (; b < buckets_.count; ++b) {
    if (!buckets_.ForUnit(b, padded)) continue;
    ++of_class;
    if (!bucket_busy_[b]) break;
  }
  if (b == buckets_.count) {
    return absl::FailedPreconditionError(absl::StrCat(
        "grad('", p.name, "'): all ", of_class, " gradient buckets for units of ", padded,
        " elements hold units whose GradReady is incomplete; finish a unit before starting "
        "another"));
  }
  bucket_busy_[b] = 1;
  unit_bucket_[unit] = b;
  // Its previous unit's reduce-scatter (on the comm stream) must have read it.
  RETURN_IF_ERROR(ctx_.streams->BeforeBucketReuse(b));
  RETURN_IF_ERROR(ctx_.device->Zero(ctx_.At(buckets_.base, buckets_.offset(b)),
                             ctx_.plan.units[unit].padded * ctx_.c, ctx_.streams->compute()));
  return b;
}

absl::StatusOr<bool> GradBuckets::MarkReady(int i) {
  const memory::ParamLayout& p = ctx_.plan.params[i];
  RETURN_IF_ERROR(CheckTrainable(i, "GradReady"));
  if (ready_[i]) {
    return absl::FailedPreconditionError(
        absl::StrCat("GradReady('", p.name, "') called twice in one micro-step"));
  }
  if (source_[i] != nullptr && !direct(p.unit)) {
    // The trainer's buffer cannot be reduced in place: copy it into the engine's slot.
    ASSIGN_OR_RETURN(void* slot, Slot(i));
    RETURN_IF_ERROR(ctx_.device->Copy(slot, source_[i], p.numel * ctx_.c, ctx_.streams->compute()));
  } else if (ctx_.stage >= 2 && unit_bucket_[p.unit] < 0 && !direct(p.unit)) {
    // The trainer never asked for this gradient: it is zero. Hand out the bucket now.
    RETURN_IF_ERROR(Grad(i).status());
  }
  ready_[i] = 1;
  return --pending_[p.unit] == 0;
}

absl::StatusOr<bool> GradBuckets::SetSource(int i, void* buffer) {
  const memory::ParamLayout& p = ctx_.plan.params[i];
  RETURN_IF_ERROR(CheckTrainable(i, "SetGradBuffer"));
  if (pending_[p.unit] != static_cast<int>(ctx_.plan.units[p.unit].params.size()) ||
      unit_bucket_[p.unit] >= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "SetGradBuffer('", p.name, "') while its unit's gradients are being written in this "
        "micro-step: register buffers between micro-steps"));
  }
  source_[i] = static_cast<char*>(buffer);
  return buffer != nullptr && direct(p.unit);
}

bool GradBuckets::direct(int u) const {
  const memory::Unit& unit = ctx_.plan.units[u];
  // The buffer must be the whole padded unit; an fp32 wire without fp32 accumulation needs a
  // compute-dtype block of the engine's to convert back into (Spare).
  return unit.params.size() == 1 && source_[unit.params[0]] != nullptr &&
         ctx_.plan.params[unit.params[0]].numel == unit.padded &&
         !(wire_dtype_ != ctx_.cdt && grad_dtype_ == ctx_.cdt);
}

absl::Status GradBuckets::Reduce(int u, bool first_micro, bool last_micro) {
  ABSL_RAW_CHECK(!layout_.region(u).offloaded || norm_ != nullptr,
                 "gradient offload without SetGradOffload");
  ++reduced_;
  last_micro_ = last_micro;
  const Stopwatch t;
  RETURN_IF_ERROR(ctx_.streams->BeforeComm());
  if (ctx_.stage <= 1) {
    RETURN_IF_ERROR(ReduceFull(ctx_.plan.units[u], u, first_micro));
  } else {
    RETURN_IF_ERROR(ReduceBucket(u, first_micro));
  }
  ctx_.timer->AddReduceMs(t.ElapsedMs());
  return absl::OkStatus();
}

// Reduces `full` (one unit in the compute dtype: the engine's, or a trainer's buffer given to
// SetSource, which is the engine's until Step) in the wire dtype: converted first when that
// is fp32. Stage 0 all-reduces the whole unit, the others reduce-scatter this rank's block,
// into `out` when given and the wire is the compute dtype, else in place.
absl::StatusOr<GradBuckets::Reduced> GradBuckets::Collective(char* full, const memory::Unit& unit,
                                                             char* out) {
  const comm::ReduceOp op = op_;
  const Device::Stream side = ctx_.streams->side();
  const bool all = ctx_.stage == 0;
  Reduced r{full, ctx_.cdt, all ? unit.padded : unit.shard};
  if (wire_dtype_ != ctx_.cdt) {
    RETURN_IF_ERROR(ctx_.device->Cast(full, ctx_.cdt, wire_, wire_dtype_, unit.padded, side));
    r.data = reinterpret_cast<char*>(wire_);
    r.dtype = wire_dtype_;
    out = nullptr;
  }
  const size_t es = DTypeSize(r.dtype);
  char* buf = r.data;
  // Prescaling divides before the sum, so each rank's share is rounded once in the wire dtype
  // (exact for a power-of-two world) and the sum cannot overflow where the gradients do not.
  if (prescale_ != 1.0f) {
    RETURN_IF_ERROR(ctx_.device->Scale(buf, r.dtype, unit.padded, prescale_, side));
  }
  if (all) {
    if (out != nullptr) r.data = out;
    RETURN_IF_ERROR(ctx_.streams->AllReduce(buf, r.data, unit.padded, r.dtype, op));
    ctx_.timer->Sent(unit.shard, 2, es);
    return r;
  }
  r.data = out != nullptr ? out : buf + ctx_.rank * unit.shard * static_cast<int64_t>(es);
  RETURN_IF_ERROR(ctx_.streams->ReduceScatter(buf, r.data, unit.shard, r.dtype, op));
  ctx_.timer->Sent(unit.shard, 1, es);
  ctx_.timer->SentAcrossGroups(unit.shard, es);  // HSDP only
  return r;
}

// Stores (first micro-step) or adds the reduced block into `dst` (reduced-gradient dtype),
// converting through `spare` (room for r.n elements of that dtype) when the dtypes differ.
absl::Status GradBuckets::Deposit(char* dst, const Reduced& r, bool first, char* spare) {
  Device* dev = ctx_.device;
  const Device::Stream side = ctx_.streams->side();
  if (first) {
    if (dst == r.data) return absl::OkStatus();
    if (r.dtype == grad_dtype_) {
      return dev->Copy(dst, r.data, r.n * DTypeSize(r.dtype), side);
    }
    return dev->Cast(r.data, r.dtype, dst, grad_dtype_, r.n, side);
  }
  const char* x = r.data;
  if (r.dtype != grad_dtype_) {
    RETURN_IF_ERROR(dev->Cast(r.data, r.dtype, spare, grad_dtype_, r.n, side));
    x = spare;
  }
  return dev->Accumulate(dst, x, grad_dtype_, r.n, side);
}

// Deposit for a host-resident `dst` (gradient offload), with the same device operations: the
// value to store is made on the device (the reduced block itself, or its conversion in
// `spare`), or the host sum is brought up into the stage and added to there; then it goes
// down. Everything runs in order on the comm side, so the copy follows the reduction, and the
// next unit's stage use, the bucket's reuse and Step (JoinComm) follow the copy.
absl::Status GradBuckets::DepositToHost(int u, char* dst, const Reduced& r, bool first,
                                        char* spare) {
  Device* dev = ctx_.device;
  const Device::Stream side = ctx_.streams->side();
  const size_t bytes = r.n * DTypeSize(grad_dtype_);
  const char* value = r.data;  // (r.n) grad dtype, device: what the host shard becomes
  if (first) {
    if (r.dtype != grad_dtype_) {
      RETURN_IF_ERROR(dev->Cast(r.data, r.dtype, spare, grad_dtype_, r.n, side));
      value = spare;
    }
  } else {
    ABSL_RAW_CHECK(accum_stage_ != nullptr, "gradient offload accumulates without its stage");
    RETURN_IF_ERROR(dev->Copy(accum_stage_, dst, bytes, side));
    RETURN_IF_ERROR(Deposit(accum_stage_, r, /*first=*/false, spare));
    value = accum_stage_;
  }
  if (last_micro_) {
    RETURN_IF_ERROR(norm_->MeasureUnit(u, value, side));
  }
  return dev->Copy(dst, value, bytes, side);
}

// Where the fp32 / compute-dtype conversion of a unit's reduced block goes: the fp32 scratch
// when the destination is fp32, else the compute-dtype block of `full`, which the fp32 wire
// copy has already consumed.
char* GradBuckets::Spare(char* full, const memory::Unit& unit) const {
  if (grad_dtype_ != ctx_.cdt) return reinterpret_cast<char*>(wire_);
  return ctx_.stage == 0 ? full : ctx_.At(full, ctx_.rank * unit.shard);
}

absl::Status GradBuckets::ReduceFull(const memory::Unit& unit, int u, bool first_micro) {
  char* g = ctx_.At(grads_, unit.flat_offset);
  char* src = direct(u) ? source_[unit.params[0]] : nullptr;  // the trainer's, read in place
  // Accumulate after the reduction so that every stage sums in the same order; without
  // accumulation (and in the compute dtype) the reduced block stays where it was reduced, which
  // is where ShardLayout puts the reduced gradient then.
  const bool to_accum = gas_ > 1 || grad_dtype_ != ctx_.cdt;
  char* dst = layout_.region(u).grad;
  const bool host_grads = layout_.region(u).offloaded;  // gradient offload
  char* full = src != nullptr ? src : g;
  if (!sync_) {
    RETURN_IF_ERROR(AddLocal(unit, full, local_micros_ == 0));
    // grad(i) is handed out zero-filled; the trainer's own buffer it rewrites.
    if (src != nullptr) return absl::OkStatus();
    return ctx_.device->Zero(g, unit.padded * ctx_.c, ctx_.streams->side());
  }
  if (local_micros_ > 0) RETURN_IF_ERROR(MergeLocal(unit, full));
  // The collective cannot write host memory: with gradient offload it reduces in place.
  ASSIGN_OR_RETURN(const Reduced r,
                   Collective(full, unit, to_accum || host_grads ? nullptr : dst));
  if (host_grads) {
    RETURN_IF_ERROR(DepositToHost(u, dst, r, first_micro || !to_accum, Spare(full, unit)));
  } else {
    RETURN_IF_ERROR(Deposit(dst, r, first_micro || !to_accum, Spare(full, unit)));
  }
  if (!to_accum || src != nullptr) return absl::OkStatus();
  return ctx_.device->Zero(g, unit.padded * ctx_.c, ctx_.streams->side());
}

// grad_local (in the reduced-gradient dtype) of `unit` = (first ? 0 : itself) + `full`, the
// unit's compute-dtype gradients, converted through the fp32 scratch when the dtypes differ.
absl::Status GradBuckets::AddLocal(const memory::Unit& unit, const char* full, bool first) {
  Device* dev = ctx_.device;
  const Device::Stream side = ctx_.streams->side();
  char* local = local_ + unit.flat_offset * static_cast<int64_t>(DTypeSize(grad_dtype_));
  const size_t bytes = unit.padded * DTypeSize(grad_dtype_);
  if (grad_dtype_ == ctx_.cdt) {
    return first ? dev->Copy(local, full, bytes, side)
                 : dev->Accumulate(local, full, grad_dtype_, unit.padded, side);
  }
  if (first) return dev->Cast(full, ctx_.cdt, local, grad_dtype_, unit.padded, side);
  char* wide = reinterpret_cast<char*>(wire_);  // (unit) fp32
  RETURN_IF_ERROR(dev->Cast(full, ctx_.cdt, wide, grad_dtype_, unit.padded, side));
  return dev->Accumulate(local, wide, grad_dtype_, unit.padded, side);
}

// The synced micro-step of a locally accumulated window: its gradients join the local sum,
// which goes back into `full` (rounded to the compute dtype when that is narrower) to be
// reduced as any unit.
absl::Status GradBuckets::MergeLocal(const memory::Unit& unit, char* full) {
  RETURN_IF_ERROR(AddLocal(unit, full, /*first=*/false));
  const Device::Stream side = ctx_.streams->side();
  char* local = local_ + unit.flat_offset * static_cast<int64_t>(DTypeSize(grad_dtype_));
  if (grad_dtype_ == ctx_.cdt) {
    return ctx_.device->Copy(full, local, unit.padded * ctx_.c, side);
  }
  return ctx_.device->Cast(local, grad_dtype_, full, ctx_.cdt, unit.padded, side);
}

absl::Status GradBuckets::ReduceBucket(int u, bool first_micro) {
  const memory::Unit& unit = ctx_.plan.units[u];
  const int b = unit_bucket_[u];
  char* bucket = direct(u) ? source_[unit.params[0]] : ctx_.At(buckets_.base, buckets_.offset(b));
  char* shard = layout_.region(u).grad;
  const bool host_grads = layout_.region(u).offloaded;  // gradient offload
  // The first micro-step reduce-scatters straight into the shard when the dtypes allow.
  // Gradient offload reduces in place: the shard is in host memory.
  const bool into_shard = first_micro && grad_dtype_ == ctx_.cdt && !host_grads;
  ASSIGN_OR_RETURN(const Reduced r, Collective(bucket, unit, into_shard ? shard : nullptr));
  if (host_grads) {
    RETURN_IF_ERROR(DepositToHost(u, shard, r, first_micro, Spare(bucket, unit)));
  } else {
    RETURN_IF_ERROR(Deposit(shard, r, first_micro, Spare(bucket, unit)));
  }
  if (b < 0) return absl::OkStatus();  // the trainer's buffer: no bucket to hand back
  RETURN_IF_ERROR(ctx_.streams->BucketReduced(b));
  bucket_busy_[b] = 0;
  unit_bucket_[u] = -1;
  return absl::OkStatus();
}

bool GradBuckets::any_ready() const {
  return std::any_of(ready_.begin(), ready_.end(), [](uint8_t r) { return r != 0; });
}

int GradBuckets::FirstMissing() const {
  for (size_t i = 0; i < ready_.size(); ++i) {
    if (!ready_[i] && !ctx_.plan.units[ctx_.plan.params[i].unit].frozen) {
      return static_cast<int>(i);
    }
  }
  return -1;
}

void GradBuckets::StartMicroStep() {
  // The micro-step that ends was summed locally (reduced_ > 0: it had gradients).
  if (!sync_ && reduced_ > 0) ++local_micros_;
  if (sync_) local_micros_ = 0;  // a synced micro-step consumed the local sums
  reduced_ = 0;
  std::fill(ready_.begin(), ready_.end(), 0);
  for (size_t u = 0; u < ctx_.plan.units.size(); ++u) {
    pending_[u] = static_cast<int>(ctx_.plan.units[u].params.size());
  }
}

absl::Status GradBuckets::ClearFullGradients() {
  if (ctx_.stage > 1) return absl::OkStatus();
  return ctx_.device->Zero(grads_, ctx_.plan.trainable_padded_elements * ctx_.c,
                           ctx_.streams->compute());
}

}  // namespace zero_internal
}  // namespace zerort
