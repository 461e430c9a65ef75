// PinnedPool hands out page-locked host buffers for offload copies, carved from a few large
// slabs sized by the memory plan, so that repeated steps never allocate or fragment: every OS
// call (mmap, mlock) happens in Create(); Acquire and Release only move pointers on free lists.
//
//   PinnedPoolOptions options;
//   options.classes = {{plan.chunk_bytes, plan.buffer_count}};
//   ASSIGN_OR_RETURN(std::unique_ptr<PinnedPool> pool, PinnedPool::Create(options));
//   ASSIGN_OR_RETURN(PinnedBuffer buf, pool->Acquire(bytes, absl::Seconds(30)));
//   ... enqueue a copy into buf.data(), wait for it, use it ...
//   buf.Release();  // or let it go out of scope
//
// Buffers come in the size classes the caller names (e.g. the plan's chunk size; nothing is
// rounded to powers of two). Each buffer is rounded up to 256 bytes and each slab to a page, so
// the rounding loss is under 256 bytes per buffer plus 4 KiB per slab: below 1% of the reserved
// bytes for buffers of 32 KiB and more.
//
// Locking: slabs are page-locked through a Locker (mlock by default; the CUDA device plugs in
// cudaHostRegister). Where locking is refused (RLIMIT_MEMLOCK), Locking::kPrefer prints one
// warning per process naming the limit and falls back to unlocked memory, reported as
// stats().locked == false; Locking::kRequire fails Create instead.
//
// Thread-safe. No method synchronizes a stream: release a buffer only after the copy that uses
// it has completed. REQUIRES: every PinnedBuffer is released before the pool is destroyed.
#ifndef ZERORT_MEMORY_PINNED_POOL_H_
#define ZERORT_MEMORY_PINNED_POOL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
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

  enum class Locking { kNone, kPrefer, kRequire };
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
