#include "zero/internal/grad_buckets.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace zerort {
namespace zero_internal {

GradBuckets::GradBuckets(const memory::Plan& plan, comm::Communicator* comm, Device* device,
                         StreamOrder* streams, StepTimer* timer, const ModelStateBuffers& state,
                         const SlottedBuffer& buckets)
    : plan_(plan),
      comm_(comm),
      dev_(device),
      streams_(streams),
      timer_(timer),
      rank_(plan.options.rank),
      stage_(plan.options.stage),
      gas_(plan.options.gradient_accumulation_steps),
      cdt_(plan.options.compute_dtype),
      c_(DTypeSize(cdt_)),
      grads_(state.grads),
      accum_(state.accum),
      buckets_(buckets),
      ready_(plan.params.size(), 0),
      pending_(plan.units.size()),
      unit_bucket_(plan.units.size(), -1),
      bucket_busy_(buckets.count, 0) {
  StartMicroStep();
}

absl::StatusOr<void*> GradBuckets::Grad(int i) {
  const memory::ParamLayout& p = plan_.params[i];
  if (ready_[i]) {
    return absl::FailedPreconditionError(absl::StrCat(
        "grad('", p.name, "') after its GradReady in this micro-step: the buffer is being reduced"));
  }
  if (stage_ <= 1) return static_cast<void*>(At(grads_, p.flat_offset));
  int b = unit_bucket_[p.unit];
  if (b < 0) {
    ASSIGN_OR_RETURN(b, AcquireBucket(p.unit, p));
  }
  return static_cast<void*>(At(buckets_.base, b * buckets_.elements + p.offset_in_unit));
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
  RETURN_IF_ERROR(streams_->BeforeBucketReuse(b));
  RETURN_IF_ERROR(dev_->Zero(At(buckets_.base, b * buckets_.elements),
                             plan_.units[unit].padded * c_, streams_->compute()));
  return b;
}

absl::StatusOr<bool> GradBuckets::MarkReady(int i) {
  const memory::ParamLayout& p = plan_.params[i];
  if (ready_[i]) {
    return absl::FailedPreconditionError(
        absl::StrCat("GradReady('", p.name, "') called twice in one micro-step"));
  }
  if (stage_ >= 2 && unit_bucket_[p.unit] < 0) {
    // The trainer never asked for this gradient: it is zero. Hand out the bucket now.
    RETURN_IF_ERROR(Grad(i).status());
  }
  ready_[i] = 1;
  return --pending_[p.unit] == 0;
}

absl::Status GradBuckets::Reduce(int u, bool first_micro) {
  const Stopwatch t;
  RETURN_IF_ERROR(streams_->BeforeComm());
  if (stage_ <= 1) {
    RETURN_IF_ERROR(ReduceFull(plan_.units[u], first_micro));
  } else {
    RETURN_IF_ERROR(ReduceBucket(u, first_micro));
  }
  timer_->AddReduceMs(t.ElapsedMs());
  return absl::OkStatus();
}

absl::Status GradBuckets::ReduceFull(const memory::Unit& unit, bool first_micro) {
  const auto avg = comm::ReduceOp::kAvg;
  const Device::Stream side = streams_->side();
  char* g = At(grads_, unit.flat_offset);
  if (stage_ == 0) {
    RETURN_IF_ERROR(comm_->AllReduce(g, g, unit.padded, cdt_, avg, side));
    timer_->Sent(unit.shard, 2);
  } else {
    RETURN_IF_ERROR(
        comm_->ReduceScatter(g, At(g, rank_ * unit.shard), unit.shard, cdt_, avg, side));
    timer_->Sent(unit.shard, 1);
  }
  if (gas_ == 1) return absl::OkStatus();
  // Accumulate after the reduction so that every stage sums in the same order.
  const char* reduced = stage_ == 0 ? g : At(g, rank_ * unit.shard);
  char* acc = stage_ == 0 ? At(accum_, unit.flat_offset) : At(accum_, unit.shard_offset);
  const int64_t n = stage_ == 0 ? unit.padded : unit.shard;
  if (first_micro) {
    RETURN_IF_ERROR(dev_->Copy(acc, reduced, n * c_, side));
  } else {
    RETURN_IF_ERROR(dev_->Accumulate(acc, reduced, cdt_, n, side));
  }
  return dev_->Zero(g, unit.padded * c_, side);
}

absl::Status GradBuckets::ReduceBucket(int u, bool first_micro) {
  const memory::Unit& unit = plan_.units[u];
  const auto avg = comm::ReduceOp::kAvg;
  const Device::Stream side = streams_->side();
  const int b = unit_bucket_[u];
  char* bucket = At(buckets_.base, b * buckets_.elements);
  char* shard = At(grads_, unit.shard_offset);
  if (first_micro) {
    RETURN_IF_ERROR(comm_->ReduceScatter(bucket, shard, unit.shard, cdt_, avg, side));
  } else {
    char* mine = At(bucket, rank_ * unit.shard);
    RETURN_IF_ERROR(comm_->ReduceScatter(bucket, mine, unit.shard, cdt_, avg, side));
    RETURN_IF_ERROR(dev_->Accumulate(shard, mine, cdt_, unit.shard, side));
  }
  timer_->Sent(unit.shard, 1);
  RETURN_IF_ERROR(streams_->BucketReduced(b));
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
  for (size_t u = 0; u < plan_.units.size(); ++u) {
    pending_[u] = static_cast<int>(plan_.units[u].params.size());
  }
}

absl::Status GradBuckets::ClearFullGradients() {
  if (stage_ > 1) return absl::OkStatus();
  return dev_->Zero(grads_, plan_.padded_elements * c_, streams_->compute());
}

}  // namespace zero_internal
}  // namespace zerort
