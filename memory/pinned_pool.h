// Page-locked ("pinned") host memory for the whole process, in two layers:
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
// PinnedPool hands out buffers of a few fixed size classes (Acquire/Release), carved from
// slabs reserved once in Create(), for a component that borrows and returns buffers while it
// runs. Nothing needs that today: the offload staging chunks are a fixed, plan-sized set that
// the engine carves from its pinned arena and rotates itself with events, so they come from
// the cache through the arena. The size-class API is kept for transient staging of varying
// counts; by default a PinnedPool owns and locks its slabs itself (its Create is the only
// place it calls the OS); to draw them from the cache instead pass
// `allocator = SharedPinnedSlabs()` and `locking = Locking::kNone` (the cache locked them).
//
//   PinnedPoolOptions options;
//   options.classes = {{plan.chunk_bytes, plan.buffer_count}};
//   ASSIGN_OR_RETURN(std::unique_ptr<PinnedPool> pool, PinnedPool::Create(options));
//   ASSIGN_OR_RETURN(PinnedBuffer buf, pool->Acquire(bytes, absl::Seconds(30)));
//   ... enqueue a copy into buf.data(), wait for it, use it ...
//   buf.Release();  // or let it go out of scope
//
// PinnedPool buffers come in the size classes the caller names (e.g. the plan's chunk size;
// nothing is rounded to powers of two). Each buffer is rounded up to 256 bytes and each slab to
// a page, so the rounding loss is under 256 bytes per buffer plus 4 KiB per slab: below 1% of
// the reserved bytes for buffers of 32 KiB and more.
//
// Locking: slabs are page-locked through a Locker (mlock by default; the CUDA device plugs in
// cudaHostRegister). Where locking is refused (RLIMIT_MEMLOCK), Locking::kPrefer prints one
// warning per process naming the limit and falls back to unlocked memory, reported as
// stats().locked == false (PinnedPool) or stats().unlocked_slabs > 0 (PinnedSlabCache);
// Locking::kRequire fails the allocation instead.
//
// Thread-safe, both. No method synchronizes a stream: free or release memory only after the
// copies that use it have completed. REQUIRES: every PinnedBuffer is released before its pool
// is destroyed.
#ifndef ZERORT_MEMORY_PINNED_POOL_H_
#define ZERORT_MEMORY_PINNED_POOL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
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

struct PinnedPoolOptions {
  struct SizeClass {
    size_t bytes = 0;  // > 0: the largest request a buffer of this class serves
    size_t count = 0;  // > 0: buffers of this class
  };
  // Buffer sizes and counts, as the plan computes them. Classes of equal size are merged.
  std::vector<SizeClass> classes;

  // Upper bound of one OS allocation; buffers are packed into slabs no larger than this
  // (a buffer larger than this gets a slab of its own). Default 256 MiB. Must be > 0.
  size_t slab_bytes = size_t{256} << 20;

  using Locking = memory::Locking;
  // kPrefer: lock, fall back to unlocked memory with one warning. Default kPrefer.
  Locking locking = Locking::kPrefer;

  // Backing memory and locking; null means HostAllocator() and MlockLocker(). Must outlive
  // the pool.
  RawAllocator* allocator = nullptr;
  Locker* locker = nullptr;
};

struct PinnedPoolStats {
  size_t reserved_bytes = 0;       // sum of the slab sizes
  size_t in_use_bytes = 0;         // sum of the class sizes of acquired buffers
  size_t high_water_bytes = 0;     // maximum of in_use_bytes since Create
  size_t rounding_loss_bytes = 0;  // reserved bytes no buffer can ever use (alignment, slab tails)
  size_t os_allocations = 0;       // allocator calls made so far (all in Create)
  bool locked = false;             // every slab is page-locked
  size_t buffers = 0;              // total buffers
  size_t buffers_in_use = 0;
  uint64_t acquires = 0;           // successful acquisitions
  uint64_t waits = 0;              // acquisitions that had to wait for a Release
};

class PinnedPool;

// A buffer on loan from a PinnedPool; returns itself to the pool when released or destroyed.
// Move-only. Not thread-safe itself (hand it between threads with the usual happens-before).
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& other) noexcept { *this = std::move(other); }
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  ~PinnedBuffer() { Release(); }

  void* data() const { return data_; }
  size_t size() const { return size_; }          // bytes requested
  size_t capacity() const;                       // bytes of the buffer's class (>= size)
  bool valid() const { return pool_ != nullptr; }
  // Returns the buffer to its pool; no-op on an empty handle.
  void Release();

 private:
  friend class PinnedPool;
  PinnedBuffer(PinnedPool* pool, void* data, size_t size, uint32_t size_class)
      : pool_(pool), data_(data), size_(size), class_(size_class) {}

  PinnedPool* pool_ = nullptr;
  void* data_ = nullptr;
  size_t size_ = 0;
  uint32_t class_ = 0;
};

class PinnedPool {
 public:
  // Reserves and locks every slab. Errors: InvalidArgument (no classes, a zero size or count,
  // zero slab_bytes), ResourceExhausted (allocation, or locking under kRequire).
  static absl::StatusOr<std::unique_ptr<PinnedPool>> Create(const PinnedPoolOptions& options);
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // A buffer of the smallest class that fits `bytes` and has a free buffer (a larger class is
  // used when the best fit is exhausted). Never calls the OS.
  // Errors: InvalidArgument if `bytes` exceeds the largest class; ResourceExhausted if no
  // fitting buffer is free.
  absl::StatusOr<PinnedBuffer> TryAcquire(size_t bytes);
  // As TryAcquire, but waits up to `timeout` for a Release; ResourceExhausted on timeout
  // (naming the request and the wait).
  absl::StatusOr<PinnedBuffer> Acquire(size_t bytes, absl::Duration timeout);

  PinnedPoolStats stats() const;
  // Class sizes, ascending (after merging equal sizes).
  std::vector<size_t> class_bytes() const;

 private:
  friend class PinnedBuffer;
  using Locking = memory::Locking;
  struct Slab {
    char* data;
    size_t bytes;
    bool locked;
  };
  struct SizeClass {
    size_t bytes;
    std::vector<char*> free;  // LIFO: the most recently used buffer is the warmest
  };

  explicit PinnedPool(const PinnedPoolOptions& options);
  // Allocates (and locks, per `locking`) one slab per entry of `slab_bytes` (page-rounded
  // here), recording them in slabs_: the only OS calls the pool ever makes.
  absl::Status ReserveSlabs(const std::vector<size_t>& slab_bytes, Locking locking);
  // Index of the class to take from, or -1 if none fits and is free.
  int PickClass(size_t bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckFits(size_t bytes) const;
  PinnedBuffer Take(int size_class, size_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Give(uint32_t size_class, void* data);

  RawAllocator* const allocator_;
  Locker* const locker_;
  // Constant after Create.
  std::vector<Slab> slabs_;
  std::vector<size_t> sizes_;  // class sizes, ascending; sizes_[i] == classes_[i].bytes
  size_t reserved_bytes_ = 0;
  size_t loss_bytes_ = 0;
  size_t buffers_ = 0;
  bool locked_ = false;

  mutable absl::Mutex mu_;
  absl::CondVar released_;
  std::vector<SizeClass> classes_ ABSL_GUARDED_BY(mu_);
  size_t in_use_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  size_t high_water_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  size_t buffers_in_use_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t acquires_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t waits_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace memory
}  // namespace zerort

#endif  // ZERORT_MEMORY_PINNED_POOL_H_
