#include "zero/internal/parking.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace zerort {
namespace zero_internal {

ParkedArenas::ParkedArenas(Device* device, Device::Stream stream)
    : device_(device),
      stream_(stream),
      pinned_(device->allocator(memory::MemoryKind::kPinnedHost)) {}

ParkedArenas::~ParkedArenas() {
  // Every copy into or out of a slab was waited for by the call that issued it.
  for (const Saved& s : saved_) pinned_->Free(s.slab, s.bytes);
}

size_t ParkedArenas::host_bytes() const {
  size_t total = 0;
  for (const Saved& s : saved_) total += s.bytes;
  return total;
}

absl::StatusOr<std::unique_ptr<ParkedArenas>> ParkedArenas::Park(
    std::vector<memory::Arena*> arenas, Device* device, Device::Stream stream) {
  std::unique_ptr<ParkedArenas> p(new ParkedArenas(device, stream));
  // Out to the host first, every arena, then one wait: the copies overlap one another. A
  // failure returns the slabs taken so far (the destructor) with the arenas untouched.
  for (memory::Arena* arena : arenas) {
    if (!arena->committed()) {
      return absl::FailedPreconditionError(
          absl::StrCat("parking arena '", arena->name(), "': it is already decommitted"));
    }
    Saved s{arena, nullptr, arena->used()};
    if (s.bytes > 0) {
      absl::StatusOr<void*> slab = p->pinned_->Allocate(s.bytes);
      if (!slab.ok()) {
        return absl::Status(slab.status().code(),
                            absl::StrCat("parking arena '", arena->name(), "' (", s.bytes,
                                         " bytes) in pinned host memory: ",
                                         slab.status().message()));
      }
      s.slab = *slab;
    }
    p->saved_.push_back(s);
    RETURN_IF_ERROR(device->Copy(s.slab, arena->base(), s.bytes, stream));
  }
  RETURN_IF_ERROR(device->Synchronize(stream));
  for (size_t i = 0; i < p->saved_.size(); ++i) {
    absl::Status s = p->saved_[i].arena->Decommit();
    if (!s.ok()) {
      // The first i arenas are decommitted: bring them back with their bytes.
      absl::Status undo = p->RestoreFirst(i);
      if (!undo.ok()) {
        return absl::Status(s.code(), absl::StrCat(s.message(), "; and restoring the arenas "
                                                   "parked before it failed: ", undo.message()));
      }
      return s;
    }
  }
  p->parked_ = true;
  return p;
}

absl::Status ParkedArenas::RestoreFirst(size_t n) {
  absl::Status status;
  size_t recommitted = 0;
  for (; recommitted < n && status.ok(); ++recommitted) {
    status = saved_[recommitted].arena->Recommit();
    if (!status.ok()) break;
  }
  for (size_t i = 0; i < recommitted && status.ok(); ++i) {
    const Saved& s = saved_[i];
    status = device_->Copy(s.arena->base(), s.slab, s.bytes, stream_);
  }
  if (status.ok()) status = device_->Synchronize(stream_);
  if (!status.ok()) {
    // Back to parked: the host copies are still the contents, and a retry starts clean.
    for (size_t i = 0; i < recommitted; ++i) saved_[i].arena->Decommit().IgnoreError();
  }
  return status;
}

absl::Status ParkedArenas::Unpark() {
  if (!parked_) return absl::FailedPreconditionError("the arenas are not parked");
  RETURN_IF_ERROR(RestoreFirst(saved_.size()));
  parked_ = false;
  return absl::OkStatus();
}

}  // namespace zero_internal
}  // namespace zerort
