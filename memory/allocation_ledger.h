// The bookkeeping of a counting RawAllocator (memory/arena.h): its live allocations by address,
// their reserved and resident bytes, and the Decommit/Recommit counts that usage() reports. The
// host mmap allocator and the CUDA device's allocator differ in how they map memory, not in
// what they count, so they keep one ledger each of this one type.
//
// Not thread-safe: the allocator calls it under its own lock, which it also holds while it maps
// or unmaps, so that the ledger and the mappings never disagree.
#ifndef ZERORT_MEMORY_ALLOCATION_LEDGER_H_
#define ZERORT_MEMORY_ALLOCATION_LEDGER_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "memory/arena.h"

namespace zerort {
namespace memory {

// `Extra`: what the allocator needs to free or remap an allocation (a handle, the pointer it
// really got), kept beside the counts.
template <typename Extra>
class AllocationLedger {
 public:
  struct Entry {
    size_t bytes = 0;  // as mapped: rounded to the allocator's page or granularity
    bool committed = true;
    Extra extra{};
  };

  // A new live allocation at `p`, committed.
  void Add(void* p, size_t bytes, Extra extra) {
    live_[p] = Entry{bytes, true, std::move(extra)};
    reserved_ += bytes;
    resident_ += bytes;
  }

  // Forgets `p`; its entry, or nullopt if `p` is not live here.
  std::optional<Entry> Remove(void* p) {
    auto it = live_.find(p);
    if (it == live_.end()) return std::nullopt;
    Entry e = std::move(it->second);
    reserved_ -= e.bytes;
    if (e.committed) resident_ -= e.bytes;
    live_.erase(it);
    return e;
  }

  // The live allocation at `p` of `rounded` bytes whose state is `committed`, for `op` of the
  // caller's `bytes`; FailedPrecondition naming the allocator, the op and the size otherwise.
  absl::StatusOr<Entry*> Find(absl::string_view allocator, const char* op, void* p, size_t bytes,
                              size_t rounded, bool committed) {
    auto it = live_.find(p);
    if (it == live_.end() || it->second.bytes != rounded) {
      return absl::FailedPreconditionError(absl::StrCat(
          allocator, ": ", op, " of ", bytes, " bytes at ", reinterpret_cast<uintptr_t>(p),
          ": not a live allocation of this allocator with that size"));
    }
    if (it->second.committed != committed) {
      return absl::FailedPreconditionError(absl::StrCat(
          allocator, ": ", op, " of ", bytes, " bytes: the allocation is already ",
          committed ? "decommitted" : "committed"));
    }
    return &it->second;
  }

  // After the allocator released (or took back) `e`'s memory, keeping its addresses.
  void Decommitted(Entry* e) {
    e->committed = false;
    resident_ -= e->bytes;
    ++decommits_;
  }
  void Recommitted(Entry* e) {
    e->committed = true;
    resident_ += e->bytes;
    ++recommits_;
  }

  AllocatorUsage usage() const {
    AllocatorUsage u;
    u.allocations = live_.size();
    u.reserved_bytes = reserved_;
    u.resident_bytes = resident_;
    u.decommits = decommits_;
    u.recommits = recommits_;
    return u;
  }

  // f(void* p, Entry& e) for each live allocation, in no particular order.
  template <typename F>
  void ForEach(F&& f) {
    for (auto& [p, e] : live_) f(p, e);
  }

 private:
  absl::flat_hash_map<void*, Entry> live_;
  size_t reserved_ = 0;
  size_t resident_ = 0;
  uint64_t decommits_ = 0;
  uint64_t recommits_ = 0;
};

}  // namespace memory
}  // namespace zerort

#endif  // ZERORT_MEMORY_ALLOCATION_LEDGER_H_
