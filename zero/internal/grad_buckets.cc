#include "zero/internal/grad_buckets.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace zerort {
namespace zero_internal {

GradBuckets::GradBuckets(const UnitContext& ctx, const ModelStateBuffers& state,
                         const SlottedBuffer& buckets, float* wire)
    : ctx_(ctx),
      gas_(ctx.plan.options.gradient_accumulation_steps),
      grad_dtype_(memory::ReducedGradDType(ctx.plan.options)),
      wire_dtype_(memory::GradWireDType(ctx.plan.options)),
      wire_(wire),
      grads_(state.grads),
      accum_(state.accum),
      buckets_(buckets),
      ready_(ctx.plan.params.size(), 0),
      pending_(ctx.plan.units.size()),
      unit_bucket_(ctx.plan.units.size(), -1),
      bucket_busy_(buckets.count, 0) {
  StartMicroStep();
}

absl::StatusOr<void*> GradBuckets::Grad(int i) {
  const memory::ParamLayout& p = ctx_.plan.params[i];
  if (ready_[i]) {
    return absl::FailedPreconditionError(absl::StrCat(
        "grad('", p.name, "') after its GradReady in this micro-step: the buffer is being reduced"));
  }
  if (ctx_.stage <= 1) return static_cast<void*>(ctx_.At(grads_, p.flat_offset));
  int b = unit_bucket_[p.unit];
  if (b < 0) {
    ASSIGN_OR_RETURN(b, AcquireBucket(p.unit, p));
  }
  return static_cast<void*>(ctx_.At(buckets_.base, b * buckets_.elements + p.offset_in_unit));
}

absl::StatusOr<int> GradBuckets::AcquireBucket(int unit, const memory::ParamLayout& p) {
  const auto free = std::find(bucket_busy_.begin(), bucket_busy_.end(), 0);
  if (free == bucket_busy_.end()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "grad('", p.name, "'): all ", bucket_busy_.size(), " gradient buckets hold units "
        "whose GradReady is incomplete; finish a unit before starting another"));
  }
  const int b = static_cast<int>(free - bucket_busy_.begin());
  bucket_busy_[b] = 1;
  unit_bucket_[unit] = b;
  // Its previous unit's reduce-scatter (on the comm stream) must have read it.
  RETURN_IF_ERROR(ctx_.streams->BeforeBucketReuse(b));
  RETURN_IF_ERROR(ctx_.device->Zero(ctx_.At(buckets_.base, b * buckets_.elements),
                             ctx_.plan.units[unit].padded * ctx_.c, ctx_.streams->compute()));
  return b;
}

absl::StatusOr<bool> GradBuckets::MarkReady(int i) {
  const memory::ParamLayout& p = ctx_.plan.params[i];
  if (ready_[i]) {
    return absl::FailedPreconditionError(
        absl::StrCat("GradReady('", p.name, "') called twice in one micro-step"));
  }
  if (ctx_.stage >= 2 && unit_bucket_[p.unit] < 0) {
    // The trainer never asked for this gradient: it is zero. Hand out the bucket now.
    RETURN_IF_ERROR(Grad(i).status());
  }
  ready_[i] = 1;
  return --pending_[p.unit] == 0;
}

absl::Status GradBuckets::Reduce(int u, bool first_micro) {
  const Stopwatch t;
  RETURN_IF_ERROR(ctx_.streams->BeforeComm());
  if (ctx_.stage <= 1) {
    RETURN_IF_ERROR(ReduceFull(ctx_.plan.units[u], first_micro));
  } else {
    RETURN_IF_ERROR(ReduceBucket(u, first_micro));
  }
  ctx_.timer->AddReduceMs(t.ElapsedMs());
  return absl::OkStatus();
}

// Reduces `full` (one unit in the compute dtype) in the wire dtype: converted first when that
// is fp32. Stage 0 all-reduces the whole unit, the others reduce-scatter this rank's block,
// into `out` when given and the wire is the compute dtype, else in place.
absl::StatusOr<GradBuckets::Reduced> GradBuckets::Collective(char* full, const memory::Unit& unit,
                                                             char* out) {
  const auto avg = comm::ReduceOp::kAvg;
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
  if (all) {
    RETURN_IF_ERROR(ctx_.comm->AllReduce(buf, buf, unit.padded, r.dtype, avg, side));
    ctx_.timer->Sent(unit.shard, 2, es);
    return r;
  }
  r.data = out != nullptr ? out : buf + ctx_.rank * unit.shard * static_cast<int64_t>(es);
  RETURN_IF_ERROR(ctx_.comm->ReduceScatter(buf, r.data, unit.shard, r.dtype, avg, side));
  ctx_.timer->Sent(unit.shard, 1, es);
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

// Where the fp32 / compute-dtype conversion of a unit's reduced block goes: the fp32 scratch
// when the destination is fp32, else the compute-dtype block of `full`, which the fp32 wire
// copy has already consumed.
char* GradBuckets::Spare(char* full, const memory::Unit& unit) const {
  if (grad_dtype_ != ctx_.cdt) return reinterpret_cast<char*>(wire_);
  return ctx_.stage == 0 ? full : ctx_.At(full, ctx_.rank * unit.shard);
}

absl::Status GradBuckets::ReduceFull(const memory::Unit& unit, bool first_micro) {
  char* g = ctx_.At(grads_, unit.flat_offset);
  const int64_t block = ctx_.stage == 0 ? 0 : ctx_.rank * unit.shard;
  // Accumulate after the reduction so that every stage sums in the same order; without
  // accumulation (and in the compute dtype) the reduced block stays where it was reduced.
  const bool to_accum = gas_ > 1 || grad_dtype_ != ctx_.cdt;
  const int64_t acc_offset = ctx_.stage == 0 ? unit.flat_offset : unit.shard_offset;
  char* dst = to_accum ? accum_ + acc_offset * static_cast<int64_t>(DTypeSize(grad_dtype_))
                       : ctx_.At(g, block);
  ASSIGN_OR_RETURN(const Reduced r, Collective(g, unit, to_accum ? nullptr : dst));
  RETURN_IF_ERROR(Deposit(dst, r, first_micro || !to_accum, Spare(g, unit)));
  if (!to_accum) return absl::OkStatus();
  return ctx_.device->Zero(g, unit.padded * ctx_.c, ctx_.streams->side());
}

absl::Status GradBuckets::ReduceBucket(int u, bool first_micro) {
  const memory::Unit& unit = ctx_.plan.units[u];
  const int b = unit_bucket_[u];
  char* bucket = ctx_.At(buckets_.base, b * buckets_.elements);
  char* shard = grads_ + unit.shard_offset * static_cast<int64_t>(DTypeSize(grad_dtype_));
  // The first micro-step reduce-scatters straight into the shard when the dtypes allow.
  const bool direct = first_micro && grad_dtype_ == ctx_.cdt;
  ASSIGN_OR_RETURN(const Reduced r, Collective(bucket, unit, direct ? shard : nullptr));
  RETURN_IF_ERROR(Deposit(shard, r, first_micro, Spare(bucket, unit)));
  RETURN_IF_ERROR(ctx_.streams->BucketReduced(b));
  bucket_busy_[b] = 0;
  unit_bucket_[u] = -1;
  return absl::OkStatus();
}

bool GradBuckets::any_ready() const {
  return std::any_of(ready_.begin(), ready_.end(), [](uint8_t r) { return r != 0; });
}

int GradBuckets::FirstMissing() const {
  const auto it = std::find(ready_.begin(), ready_.end(), 0);
  return it == ready_.end() ? -1 : static_cast<int>(it - ready_.begin());
}

void GradBuckets::StartMicroStep() {
  std::fill(ready_.begin(), ready_.end(), 0);
  for (size_t u = 0; u < ctx_.plan.units.size(); ++u) {
    pending_[u] = static_cast<int>(ctx_.plan.units[u].params.size());
  }
}

absl::Status GradBuckets::ClearFullGradients() {
  if (ctx_.stage > 1) return absl::OkStatus();
  return ctx_.device->Zero(grads_, ctx_.plan.padded_elements * ctx_.c, ctx_.streams->compute());
}

}  // namespace zero_internal
}  // namespace zerort
