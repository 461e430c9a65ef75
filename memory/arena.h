// Arena: one large allocation carved by bump allocation into named, 256-byte-aligned buffers.
//
// The engine allocates exactly what memory::Plan lists, in a few arenas, and then asserts that
// what was allocated equals what was planned; the arena therefore counts every byte: capacity,
// bytes used (including alignment padding), and the requested bytes of each named buffer.
// The backing memory comes from a RawAllocator so that the CUDA device can supply cudaMalloc
// later; HostAllocator() (page-aligned anonymous mmap) is the host implementation.
//
//   ASSIGN_OR_RETURN(std::unique_ptr<Arena> arena,
//                    Arena::Create("host_state", plan.host_bytes, HostAllocator()));
//   ASSIGN_OR_RETURN(void* master, arena->Allocate("master", shard_elems * 4));
//
// Thread-safe (allocation happens at setup, so a mutex costs nothing). Buffers live until the
// arena is destroyed or Reset(); nothing is freed individually.
#ifndef ZERORT_MEMORY_ARENA_H_
#define ZERORT_MEMORY_ARENA_H_

#include <cstddef>
#include <map>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace zerort {
namespace memory {

// What an allocator that counts holds now (RawAllocator::usage()).
struct AllocatorUsage {
  size_t allocations = 0;     // live allocations (Allocate not yet matched by Free)
  size_t reserved_bytes = 0;  // their address space, rounded as the allocator maps it
  size_t resident_bytes = 0;  // of which backed by memory now: reserved minus decommitted
  uint64_t decommits = 0;     // Decommit calls that succeeded, since creation
  uint64_t recommits = 0;     // Recommit calls that succeeded, since creation
};

// Where an arena's (or the pinned slab cache's) big allocations come from. Implementations must be
// thread-safe. Allocate(0) is allowed to return nullptr.
class RawAllocator {
 public:
  virtual ~RawAllocator() = default;
  // Returns memory aligned to at least 4096 bytes, or ResourceExhausted naming `bytes`.
  virtual absl::StatusOr<void*> Allocate(size_t bytes) = 0;
  // REQUIRES: `p` came from Allocate(bytes) on this allocator with the same `bytes`. Also
  // frees a decommitted allocation.
  virtual void Free(void* p, size_t bytes) = 0;
  // For messages: "host", "cuda:0", ...
  virtual absl::string_view name() const = 0;

  // --- Parking (optional; the defaults are Unimplemented naming the allocator).
  // Decommit returns the memory behind the whole allocation `p` to the OS or the driver and
  // keeps its address range reserved, so that pointers into it (the engine's parts hold many)
  // are valid again after Recommit; in between, the contents are gone and touching them
  // faults. Recommit backs the same addresses with new memory, contents undefined. This is how
  // an engine gives its device memory back between RL phases (Engine::Park) without being
  // rebuilt. Errors: FailedPrecondition for a pointer that is not a live allocation of this
  // allocator or is already in the asked state; ResourceExhausted from Recommit when the
  // memory is not available (the allocation stays decommitted: retry later).
  // REQUIRES: no work reading or writing the allocation is pending.
  virtual absl::Status Decommit(void* p, size_t bytes);
  virtual absl::Status Recommit(void* p, size_t bytes);
  // The counts, for tests and reports; nullopt for an allocator that does not count.
  virtual std::optional<AllocatorUsage> usage() const { return std::nullopt; }
};

// Anonymous mmap (zero-filled, never touched until used): page-aligned, and for 2 MiB or more
// 2 MiB-aligned with transparent huge pages asked for (why: memory/arena.cc). Counts its live
// allocations (usage()) and can decommit them: the range is replaced by an inaccessible
// MAP_NORESERVE mapping (pages and commit charge returned, any access faults) and recommitted
// by mapping fresh zero-filled pages at the same address. A process-wide instance that is
// never destroyed.
RawAllocator* HostAllocator();
// An allocator like HostAllocator() whose counts are its own: the CPU device's kDevice memory,
// so that what an engine holds on "the device" is measured apart from every other host
// allocation. REQUIRES: it outlives every allocation made from it.
std::unique_ptr<RawAllocator> NewHostAllocator(std::string name);

// One allocation from a RawAllocator, freed when the owner goes: for transient buffers outside
// any arena (tests, benchmarks, cold paths such as exporting weights). Move-only.
class Allocation {
 public:
  static absl::StatusOr<Allocation> Create(RawAllocator* allocator, size_t bytes) {
    Allocation a;
    auto p = allocator->Allocate(bytes);
    if (!p.ok()) return p.status();
    a.allocator_ = allocator;
    a.bytes_ = bytes;
    a.p_ = *p;
    return a;
  }
  Allocation() = default;
  Allocation(Allocation&& o) noexcept { *this = std::move(o); }
  Allocation& operator=(Allocation&& o) noexcept {
    if (this != &o) {
      Reset();
      allocator_ = o.allocator_;
      bytes_ = o.bytes_;
      p_ = o.p_;
      o.allocator_ = nullptr;
      o.p_ = nullptr;
      o.bytes_ = 0;
    }
    return *this;
  }
  ~Allocation() { Reset(); }

  void* get() const { return p_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void Reset() {
    if (allocator_ != nullptr) allocator_->Free(p_, bytes_);
    allocator_ = nullptr;
    p_ = nullptr;
  }
  RawAllocator* allocator_ = nullptr;
  size_t bytes_ = 0;
  void* p_ = nullptr;
};

// Rounds `bytes` up to a multiple of `alignment` (a power of two).
constexpr size_t AlignUp(size_t bytes, size_t alignment) {
  return (bytes + alignment - 1) & ~(alignment - 1);
}

class Arena {
 public:
  // Every buffer starts on this boundary: enough for AVX-512 loads, CUDA's 256-byte transactions
  // and NCCL's alignment preferences.
  static constexpr size_t kAlignment = 256;

  // Allocates `capacity` bytes from `allocator` (which must outlive the arena). A zero capacity
  // is allowed (every non-empty Allocate then fails).
  static absl::StatusOr<std::unique_ptr<Arena>> Create(std::string name, size_t capacity,
                                                       RawAllocator* allocator);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // Carves `bytes` (rounded up to kAlignment, except at the very end of the arena) for the
  // buffer `buffer_name`.
  // Zero bytes returns a non-null, aligned pointer that must not be dereferenced (it may equal
  // the next buffer's address).
  // Errors: ResourceExhausted (names the buffer, requested and remaining bytes);
  // AlreadyExists if `buffer_name` was already allocated since the last Reset().
  absl::StatusOr<void*> Allocate(absl::string_view buffer_name, size_t bytes);

  // Like Allocate, but the buffer starts at an offset congruent to `offset_mod_4k` (a multiple of
  // kAlignment below 4096) modulo 4 KiB, skipping up to kStaggerSlack bytes. Streams that start
  // at the same offset modulo 4 KiB alias in the L1 and the store buffer: the host AdamW over
  // master, m, v, grad and param fell to 0.47-0.61 of its memory floor when all five started at
  // the same residue, against 0.86-0.98 when staggered by 1280 bytes (adamw_bench --aligned).
  // Callers that stagger add kStaggerSlack per buffer to the arena's capacity. The skipped bytes
  // count in used(), not in requested().
  static constexpr size_t kStaggerSlack = 4096;
  absl::StatusOr<void*> AllocateStaggered(absl::string_view buffer_name, size_t bytes,
                                          size_t offset_mod_4k);

  // Forgets every buffer (the memory stays reserved). REQUIRES: no buffer is in use.
  void Reset();

  // Parking: Decommit returns the arena's memory to its allocator's OS or driver while its
  // addresses, and every buffer carved from them, stay reserved; Recommit backs them again with
  // undefined contents (zero/internal/parking.h saves and restores the bytes). Errors: the
  // allocator's (Unimplemented where it cannot; ResourceExhausted from Recommit), naming the
  // arena; FailedPrecondition when the arena already is in the asked state. An empty arena
  // changes state without an allocator call. REQUIRES: no work on the arena is pending.
  absl::Status Decommit();
  absl::Status Recommit();
  bool committed() const;

  const std::string& name() const { return name_; }
  char* base() const { return base_; }
  size_t capacity() const { return capacity_; }
  // Bytes carved so far, alignment padding included.
  size_t used() const;
  size_t remaining() const;
  // Sum of the requested sizes (padding excluded): what the plan should agree with.
  size_t requested() const;
  // Requested bytes of one buffer; NotFound if it was never allocated.
  absl::StatusOr<size_t> BufferBytes(absl::string_view buffer_name) const;
  // Every buffer: name -> requested bytes.
  std::map<std::string, size_t> Buffers() const;

 private:
  Arena(std::string name, char* base, size_t capacity, RawAllocator* allocator)
      : name_(std::move(name)), base_(base), capacity_(capacity), allocator_(allocator) {}

  const std::string name_;
  char* const base_;
  const size_t capacity_;
  RawAllocator* const allocator_;

  mutable absl::Mutex mu_;
  size_t used_ ABSL_GUARDED_BY(mu_) = 0;
  size_t requested_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, size_t, std::less<>> buffers_ ABSL_GUARDED_BY(mu_);
  bool committed_ ABSL_GUARDED_BY(mu_) = true;
};

}  // namespace memory
}  // namespace zerort

#endif  // ZERORT_MEMORY_ARENA_H_
