#include "zero/internal/grad_buckets.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace zerort {
namespace zero_internal {

GradBuckets::GradBuckets(const UnitContext& ctx, const ModelStateBuffers& state,
                         const SlottedBuffer& buckets)
    : ctx_(ctx),
      gas_(ctx.plan.options.gradient_accumulation_steps),
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

absl::Status GradBuckets::ReduceFull(const memory::Unit& unit, bool first_micro) {
  const auto avg = comm::ReduceOp::kAvg;
  const Device::Stream side = ctx_.streams->side();
  char* g = ctx_.At(grads_, unit.flat_offset);
  if (ctx_.stage == 0) {
    RETURN_IF_ERROR(ctx_.comm->AllReduce(g, g, unit.padded, ctx_.cdt, avg, side));
    ctx_.timer->Sent(unit.shard, 2);
  } else {
    RETURN_IF_ERROR(
        ctx_.comm->ReduceScatter(g, ctx_.At(g, ctx_.rank * unit.shard), unit.shard, ctx_.cdt, avg, side));
    ctx_.timer->Sent(unit.shard, 1);
  }
  if (gas_ == 1) return absl::OkStatus();
  // Accumulate after the reduction so that every stage sums in the same order.
  const char* reduced = ctx_.stage == 0 ? g : ctx_.At(g, ctx_.rank * unit.shard);
  char* acc = ctx_.stage == 0 ? ctx_.At(accum_, unit.flat_offset) : ctx_.At(accum_, unit.shard_offset);
  const int64_t n = ctx_.stage == 0 ? unit.padded : unit.shard;
  if (first_micro) {
    RETURN_IF_ERROR(ctx_.device->Copy(acc, reduced, n * ctx_.c, side));
  } else {
    RETURN_IF_ERROR(ctx_.device->Accumulate(acc, reduced, ctx_.cdt, n, side));
  }
  return ctx_.device->Zero(g, unit.padded * ctx_.c, side);
}

absl::Status GradBuckets::ReduceBucket(int u, bool first_micro) {
  const memory::Unit& unit = ctx_.plan.units[u];
  const auto avg = comm::ReduceOp::kAvg;
  const Device::Stream side = ctx_.streams->side();
  const int b = unit_bucket_[u];
  char* bucket = ctx_.At(buckets_.base, b * buckets_.elements);
  char* shard = ctx_.At(grads_, unit.shard_offset);
  if (first_micro) {
    RETURN_IF_ERROR(ctx_.comm->ReduceScatter(bucket, shard, unit.shard, ctx_.cdt, avg, side));
  } else {
    char* mine = ctx_.At(bucket, ctx_.rank * unit.shard);
    RETURN_IF_ERROR(ctx_.comm->ReduceScatter(bucket, mine, unit.shard, ctx_.cdt, avg, side));
    RETURN_IF_ERROR(ctx_.device->Accumulate(shard, mine, ctx_.cdt, unit.shard, side));
  }
  ctx_.timer->Sent(unit.shard, 1);
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
