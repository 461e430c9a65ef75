#include "zero/internal/snapshot.h"

#include "base/status.h"

namespace zerort {
namespace zero_internal {

std::shared_ptr<OwnedSnapshot::Link> OwnedSnapshot::MakeLink(OwnedSnapshot* self) {
  auto link = std::make_shared<Link>();
  absl::MutexLock lock(&link->mu);
  link->snapshot = self;
  return link;
}

std::function<absl::Status()> OwnedSnapshot::Waiter() const {
  return [link = link_]() -> absl::Status {
    absl::MutexLock lock(&link->mu);
    return link->snapshot != nullptr ? link->snapshot->Wait() : link->copies;
  };
}

void OwnedSnapshot::Detach() {
  absl::MutexLock lock(&link_->mu);
  if (link_->snapshot == nullptr) return;
  link_->copies = Wait();
  link_->snapshot = nullptr;
}

OwnedSnapshot::~OwnedSnapshot() {
  Detach();
  // The copies write into buffers that outlive this object only by contract.
  if (stream_ != nullptr) {
    dev_->Synchronize(stream_).IgnoreError();  // reported by Wait
    dev_->DestroyStream(stream_);
  }
  for (Device::Event e : {start_, done_}) {
    if (e != nullptr) dev_->DestroyEvent(e);
  }
}

absl::Status OwnedSnapshot::Begin(float* master, float* m, float* v, void* param) {
  if (stream_ == nullptr) {
    ASSIGN_OR_RETURN(stream_, dev_->CreateStream());
    ASSIGN_OR_RETURN(start_, dev_->CreateEvent());
    ASSIGN_OR_RETURN(done_, dev_->CreateEvent());
  }
  // Everything the last step wrote is ordered on the compute stream (the offload pipeline joins
  // its uploads and all-gathers there; its host writes are already done).
  RETURN_IF_ERROR(dev_->Record(start_, compute_));
  RETURN_IF_ERROR(dev_->Wait(stream_, start_));
  const size_t c = DTypeSize(plan_.options.compute_dtype);
  for (int u = 0; u < layout_.num_units(); ++u) {
    const memory::Unit& unit = plan_.units[u];
    const Region& reg = layout_.region(u);
    const int64_t off = unit.shard_offset;
    // The snapshot holds this rank's shard of the region (all of it but in stage 0).
    const int64_t skip = reg.owned_begin;
    const size_t bytes = static_cast<size_t>(unit.shard) * 4;
    // Null when they live in a file, and a compact form's arrays are not fp32: UnitStore read
    // them (BeforeSnapshot) already.
    if (reg.m != nullptr && !reg.compact()) {
      RETURN_IF_ERROR(dev_->Copy(master + off, reg.master + skip, bytes, stream_));
      RETURN_IF_ERROR(dev_->Copy(m + off, reg.m + skip * 4, bytes, stream_));
      RETURN_IF_ERROR(dev_->Copy(v + off, reg.v + skip * 4, bytes, stream_));
    }
    if (param != nullptr) {
      RETURN_IF_ERROR(dev_->Copy(static_cast<char*>(param) + off * c, reg.param + skip * c,
                                 unit.shard * c, stream_));
    }
  }
  RETURN_IF_ERROR(dev_->Record(done_, stream_));
  pending_ = true;
  return absl::OkStatus();
}

absl::Status OwnedSnapshot::Wait() {
  if (done_ == nullptr) return absl::OkStatus();
  return dev_->WaitHost(done_);
}

absl::Status OwnedSnapshot::Fence(bool host) {
  if (!pending_) return absl::OkStatus();
  pending_ = false;
  return host ? dev_->WaitHost(done_) : dev_->Wait(compute_, done_);
}

}  // namespace zero_internal
}  // namespace zerort
