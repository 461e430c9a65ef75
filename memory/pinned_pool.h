// Page-locked ("pinned") host memory for the whole process.
//
// PinnedSlabCache is THE source of pinned host memory: the devices' kPinnedHost allocators
// (device/cpu_device.cc, device/cuda_device.cc) are this cache, so the engine's pinned arena
// (the offloaded fp32 master, m, v and the offload staging chunks) and the checkpoint snapshot
// buffers are slabs of it. It is a RawAllocator that keeps the slabs its users free, still
// locked, and hands them out again: destroying and re-creating an engine (a reshard, a second
// model, an evaluation copy) then reuses slabs already mapped and locked instead of calling
// mmap + mlock (or cudaHostRegister) again, which faults in and zeroes every page.
//
//   memory::RawAllocator* pinned = memory::SharedPinnedSlabs();  // process-wide, mlock
//   ASSIGN_OR_RETURN(auto arena, Arena::Create("pinned_host", bytes, pinned));
//   arena.reset();                                               // the slab stays cached
//   ASSIGN_OR_RETURN(arena, Arena::Create("pinned_host", bytes, pinned));  // no OS call
//
// Locking: slabs are page-locked through a Locker (mlock by default; the CUDA device plugs in
// cudaHostRegister). Where locking is refused (RLIMIT_MEMLOCK), Locking::kPrefer prints one
// warning per process naming the limit and falls back to unlocked memory, reported as
// stats().unlocked_slabs > 0; Locking::kRequire fails the allocation instead.
//
// Thread-safe. No method synchronizes a stream: free memory only after the copies that use it
// have completed.
#ifndef ZERORT_MEMORY_PINNED_POOL_H_
#define ZERORT_MEMORY_PINNED_POOL_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "memory/arena.h"

namespace zerort {
namespace memory {

// Page-locks memory that was already allocated. Implementations must be thread-safe.
class Locker {
 public:
  virtual ~Locker() = default;
  // REQUIRES: `p` page-aligned. On refusal returns an error whose message names the limit.
  virtual absl::Status Lock(void* p, size_t bytes) = 0;
  // REQUIRES: Lock(p, bytes) succeeded.
  virtual void Unlock(void* p, size_t bytes) = 0;
  virtual absl::string_view name() const = 0;
};

// mlock/munlock; refusal is ResourceExhausted naming RLIMIT_MEMLOCK. Process-wide, never
// destroyed.
Locker* MlockLocker();

// The current RLIMIT_MEMLOCK soft limit in bytes (SIZE_MAX when unlimited).
size_t MemlockLimitBytes();

// What to do when a Locker refuses. kNone: never lock. kPrefer: lock, fall back to unlocked
// memory with one warning per process. kRequire: a refusal fails the allocation.
enum class Locking { kNone, kPrefer, kRequire };

struct PinnedSlabCacheOptions {
  // --- Where slabs come from. Both must outlive the cache.
  // Backing memory; null means HostAllocator() (page-aligned anonymous mmap).
  RawAllocator* allocator = nullptr;
  // Page-locks the backing memory; null means MlockLocker().
  Locker* locker = nullptr;
  // Default kPrefer (RLIMIT_MEMLOCK is 8 MiB on many hosts; unlocked memory still works).
  Locking locking = Locking::kPrefer;

  // --- Retention. Free slabs are kept while cached + in-use bytes stay within the peak of
  // in-use bytes (see PinnedSlabCache) AND cached bytes stay within this. Default: no bound
  // beyond the peak. 0 keeps nothing (every Free returns the slab to the OS).
  size_t max_cached_bytes = SIZE_MAX;

  // --- For messages: "pinned host (mlock)", ...
  std::string name = "pinned host";
};

struct PinnedSlabCacheStats {
  size_t in_use_bytes = 0;      // slabs handed out (page-rounded sizes)
  size_t in_use_slabs = 0;
  size_t cached_bytes = 0;      // free slabs kept for reuse
  size_t cached_slabs = 0;
  size_t high_water_bytes = 0;  // peak of in_use_bytes: bounds in_use + cached
  uint64_t os_allocations = 0;  // slabs obtained from the OS (allocate + lock): the slow path
  uint64_t reuses = 0;          // Allocate calls served by a cached slab, without an OS call
  uint64_t os_releases = 0;     // slabs unlocked and returned to the OS
  size_t unlocked_slabs = 0;    // in use or cached, not locked (kNone, or a kPrefer refusal)
};

// A process-wide cache of page-locked slabs behind the RawAllocator interface.
//
// Policy, and why:
//  - Whole slabs only. Allocate(n) returns a slab of its own (n rounded up to a page); Free
//    returns it whole. Slabs are never split nor coalesced, so the cache cannot fragment: every
//    slab is exactly one OS allocation, which is also what munlock/cudaHostUnregister need.
//  - Best fit. A request takes the smallest cached slab of at least n bytes, and only one of
//    at most n + n/8 bytes (at most 12.5% of a slab idle), the most recently freed among equal
//    sizes (its pages are the warmest). The engine asks for the same sizes again when it is
//    re-created, so the fit is exact in the case this cache exists for.
//  - Bounded retention. The bytes kept free plus the bytes in use never exceed the peak of
//    bytes in use so far (and cached bytes never exceed max_cached_bytes): caching never makes
//    the process lock more than it once needed at the same time. A miss that would break the
//    bound first returns the least recently freed slabs to the OS; so does a refused lock
//    (cached slabs count against RLIMIT_MEMLOCK) before falling back. Trim() returns them all.
//  - A slab keeps the lock state it got when it was allocated (kPrefer fallbacks stay
//    unlocked until they leave the cache).
//  - Memory is NOT zero-filled: a reused slab holds its previous user's bytes (the engine
//    zeroes every buffer it carves; the snapshot buffer is fully overwritten).
//  - OS calls happen outside the mutex, so ranks creating engines concurrently do not queue
//    behind one another's mmap + mlock. Linear scans: a cache holds a few slabs per engine.
//
// Thread-safe. REQUIRES (Free): `p` came from Allocate on this cache.
class PinnedSlabCache final : public RawAllocator {
 public:
  explicit PinnedSlabCache(PinnedSlabCacheOptions options = {});
  // Returns every slab, cached or not, to the OS. The shared instances are never destroyed.
  ~PinnedSlabCache() override;
  PinnedSlabCache(const PinnedSlabCache&) = delete;
  PinnedSlabCache& operator=(const PinnedSlabCache&) = delete;

  // A page-aligned slab of at least `bytes`; nullptr for 0. Errors: ResourceExhausted (the
  // allocator's, or a refused lock under kRequire, naming the bytes and the limit).
  absl::StatusOr<void*> Allocate(size_t bytes) override;
  // Keeps the slab for reuse, or returns it to the OS when the retention bound says so.
  void Free(void* p, size_t bytes) override;
  absl::string_view name() const override { return options_.name; }

  // Returns every cached slab to the OS (e.g. once training is over).
  void Trim();
  PinnedSlabCacheStats stats() const;

 private:
  struct Slab {
    char* data;
    size_t bytes;  // page-rounded
    bool locked;
    uint64_t freed_at;  // recency among cached slabs
  };

  // Removes cached slabs, least recently freed first, until `fits(cached_bytes_)` holds.
  template <typename Fits>
  std::vector<Slab> EvictLocked(Fits fits) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The cached slab that best fits `bytes` (page-rounded), or -1.
  int BestFitLocked(size_t bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The slow path: allocates and locks a new slab of `bytes` (page-rounded) outside mu_.
  absl::StatusOr<Slab> AllocateSlab(size_t bytes);
  void ReleaseToOs(const std::vector<Slab>& slabs);

  const PinnedSlabCacheOptions options_;  // allocator and locker resolved

  mutable absl::Mutex mu_;
  std::vector<Slab> cached_ ABSL_GUARDED_BY(mu_);
  std::vector<Slab> in_use_ ABSL_GUARDED_BY(mu_);
  size_t cached_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  size_t in_use_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // includes slabs being allocated
  size_t high_water_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t clock_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t os_allocations_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t reuses_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t os_releases_ ABSL_GUARDED_BY(mu_) = 0;
};

// The process-wide cache of mlock-ed host slabs (HostAllocator, MlockLocker, kPrefer): the CPU
// device's kPinnedHost allocator, shared by every engine and checkpointer of the process.
// Never destroyed.
PinnedSlabCache* SharedPinnedSlabs();

}  // namespace memory
}  // namespace zerort

#endif  // ZERORT_MEMORY_PINNED_POOL_H_
