#include "memory/arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cassert>
#include <cerrno>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "memory/allocation_ledger.h"

namespace zerort {
namespace memory {
namespace {

// Buffers of at least one huge page start on a huge-page boundary and ask for transparent huge
// pages, so each 2 MiB of them is physically contiguous. That matters for direct I/O: a 1 MiB
// O_DIRECT request from 4 KiB pages is 256 segments, more than a virtio disk takes in one
// request (max_segments is 254 on these VMs), so the kernel splits it; from huge pages it is
// one segment (nvme_bench's small_pages rows measure the difference, docs/offload.md). It also
// spares the host AdamW's streams TLB misses. Smaller buffers keep plain pages: rounding them up
// would waste memory.
constexpr size_t kHugePage = size_t{2} << 20;

size_t RoundUpToPage(size_t bytes) {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}

class MmapAllocator final : public RawAllocator {
 public:
  explicit MmapAllocator(std::string name) : name_(std::move(name)) {}

  absl::StatusOr<void*> Allocate(size_t bytes) override {
    if (bytes == 0) return nullptr;
    const size_t slack = bytes >= kHugePage ? kHugePage : 0;
    if (bytes > SIZE_MAX / 2) {  // bytes + slack and the page round-up must not wrap
      return absl::ResourceExhaustedError(absl::StrCat(name_, " mmap of ", bytes, " bytes: too large"));
    }
    void* p = mmap(nullptr, bytes + slack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      return absl::ResourceExhaustedError(absl::StrCat(name_, " mmap of ", bytes,
                                                       " bytes failed: ", std::strerror(err)));
    }
    char* start = static_cast<char*>(p);
    if (slack > 0) {
      // Keep the huge-page-aligned [start, start + bytes) and return the rest of the slack.
      char* const base = static_cast<char*>(p);
      start = reinterpret_cast<char*>(
          (reinterpret_cast<uintptr_t>(base) + kHugePage - 1) & ~uintptr_t{kHugePage - 1});
      char* const end = start + RoundUpToPage(bytes);
      if (start > base) munmap(base, start - base);
      if (base + bytes + slack > end) munmap(end, base + bytes + slack - end);
      madvise(start, bytes, MADV_HUGEPAGE);  // a hint: fails harmlessly where THP is off
    }
    absl::MutexLock lock(&mu_);
    ledger_.Add(start, RoundUpToPage(bytes), NoExtra{});
    return static_cast<void*>(start);
  }

  void Free(void* p, size_t bytes) override {
    if (p == nullptr) return;
    {
      absl::MutexLock lock(&mu_);
      ledger_.Remove(p);
    }
    munmap(p, bytes);
  }

  // Inaccessible first, then the pages dropped: a stray write between the two cannot bring a
  // page back. madvise(MADV_DONTNEED) returns the pages of a private anonymous mapping (huge
  // pages included) and leaves the range mapped, so Recommit is an mprotect that cannot lose
  // the range: re-mmapping with MAP_FIXED could, on failure, leave it unmapped for another
  // mapping to take.
  absl::Status Decommit(void* p, size_t bytes) override {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(Ledger::Entry * e,
                     ledger_.Find(name_, "Decommit", p, bytes, RoundUpToPage(bytes),
                                  /*committed=*/true));
    if (mprotect(p, e->bytes, PROT_NONE) != 0 || madvise(p, e->bytes, MADV_DONTNEED) != 0) {
      const int err = errno;
      mprotect(p, e->bytes, PROT_READ | PROT_WRITE);
      return absl::InternalError(absl::StrCat(name_, ": Decommit of ", e->bytes,
                                              " bytes failed: ", std::strerror(err)));
    }
    ledger_.Decommitted(e);
    return absl::OkStatus();
  }

  // The pages come back zero-filled, on first touch.
  absl::Status Recommit(void* p, size_t bytes) override {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(Ledger::Entry * e,
                     ledger_.Find(name_, "Recommit", p, bytes, RoundUpToPage(bytes),
                                  /*committed=*/false));
    if (mprotect(p, e->bytes, PROT_READ | PROT_WRITE) != 0) {
      const int err = errno;
      return absl::ResourceExhaustedError(absl::StrCat(
          name_, ": Recommit of ", e->bytes, " bytes failed: ", std::strerror(err)));
    }
    ledger_.Recommitted(e);
    return absl::OkStatus();
  }

  std::optional<AllocatorUsage> usage() const override {
    absl::MutexLock lock(&mu_);
    return ledger_.usage();
  }

  absl::string_view name() const override { return name_; }

 private:
  struct NoExtra {};
  using Ledger = AllocationLedger<NoExtra>;

  const std::string name_;
  mutable absl::Mutex mu_;
  Ledger ledger_ ABSL_GUARDED_BY(mu_);
};

alignas(Arena::kAlignment) char g_empty_sentinel[Arena::kAlignment];

}  // namespace

absl::Status RawAllocator::Decommit(void* p, size_t bytes) {
  return absl::UnimplementedError(
      absl::StrCat(name(), ": cannot release memory while keeping its addresses (Decommit)"));
}

absl::Status RawAllocator::Recommit(void* p, size_t bytes) {
  return absl::UnimplementedError(
      absl::StrCat(name(), ": cannot release memory while keeping its addresses (Recommit)"));
}

RawAllocator* HostAllocator() {
  static RawAllocator* const allocator = new MmapAllocator("host");
  return allocator;
}

std::unique_ptr<RawAllocator> NewHostAllocator(std::string name) {
  return std::make_unique<MmapAllocator>(std::move(name));
}

absl::StatusOr<std::unique_ptr<Arena>> Arena::Create(std::string name, size_t capacity,
                                                     RawAllocator* allocator) {
  if (allocator == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("arena '", name, "': null allocator"));
  }
  absl::StatusOr<void*> base = allocator->Allocate(capacity);
  if (!base.ok()) {
    return absl::Status(base.status().code(),
                        absl::StrCat("arena '", name, "' (", capacity, " bytes on ",
                                     allocator->name(), "): ", base.status().message()));
  }
  if (capacity > 0 && *base == nullptr) {
    return absl::InternalError(absl::StrCat("arena '", name, "': allocator ", allocator->name(),
                                            " returned null for ", capacity, " bytes"));
  }
  return std::unique_ptr<Arena>(
      new Arena(std::move(name), static_cast<char*>(*base), capacity, allocator));
}

Arena::~Arena() { allocator_->Free(base_, capacity_); }

absl::StatusOr<void*> Arena::Allocate(absl::string_view buffer_name, size_t bytes) {
  absl::MutexLock lock(&mu_);
  if (buffers_.find(buffer_name) != buffers_.end()) {
    return absl::AlreadyExistsError(
        absl::StrCat("arena '", name_, "': buffer '", buffer_name, "' is already allocated"));
  }
  // The last buffer may end in the final partial alignment unit: only the next buffer's start
  // needs the padding.
  if (bytes > capacity_ - used_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("arena '", name_, "': buffer '", buffer_name, "' needs ", bytes,
                     " bytes but only ", capacity_ - used_, " of ", capacity_, " remain"));
  }
  // Zero-byte buffers still get an aligned, non-null address (a sentinel for an empty arena) so
  // callers never special-case null.
  char* p = capacity_ == 0 ? g_empty_sentinel : base_ + used_;
  used_ = std::min(capacity_, used_ + AlignUp(bytes, kAlignment));
  requested_ += bytes;
  buffers_.emplace(std::string(buffer_name), bytes);
  return static_cast<void*>(p);
}

absl::StatusOr<void*> Arena::AllocateStaggered(absl::string_view buffer_name, size_t bytes,
                                               size_t offset_mod_4k) {
  assert(offset_mod_4k % kAlignment == 0 && offset_mod_4k < kStaggerSlack);
  {
    absl::MutexLock lock(&mu_);
    const size_t here = reinterpret_cast<uintptr_t>(base_ + used_) % kStaggerSlack;
    const size_t skip = (offset_mod_4k + kStaggerSlack - here) % kStaggerSlack;
    if (capacity_ > 0 && skip > 0) {
      if (skip > capacity_ - used_) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "arena '", name_, "': buffer '", buffer_name, "' needs ", skip,
            " bytes of stagger but only ", capacity_ - used_, " of ", capacity_, " remain"));
      }
      used_ += skip;
    }
  }
  return Allocate(buffer_name, bytes);
}

absl::Status Arena::Decommit() {
  absl::MutexLock lock(&mu_);
  if (!committed_) {
    return absl::FailedPreconditionError(absl::StrCat("arena '", name_, "' is already decommitted"));
  }
  if (capacity_ > 0) {
    absl::Status s = allocator_->Decommit(base_, capacity_);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("arena '", name_, "' (", capacity_, " bytes on ",
                                                 allocator_->name(), "): ", s.message()));
    }
  }
  committed_ = false;
  return absl::OkStatus();
}

absl::Status Arena::Recommit() {
  absl::MutexLock lock(&mu_);
  if (committed_) {
    return absl::FailedPreconditionError(absl::StrCat("arena '", name_, "' is already committed"));
  }
  if (capacity_ > 0) {
    absl::Status s = allocator_->Recommit(base_, capacity_);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("arena '", name_, "' (", capacity_, " bytes on ",
                                                 allocator_->name(), "): ", s.message()));
    }
  }
  committed_ = true;
  return absl::OkStatus();
}

bool Arena::committed() const {
  absl::MutexLock lock(&mu_);
  return committed_;
}

void Arena::Reset() {
  absl::MutexLock lock(&mu_);
  used_ = 0;
  requested_ = 0;
  buffers_.clear();
}

size_t Arena::used() const {
  absl::MutexLock lock(&mu_);
  return used_;
}

size_t Arena::remaining() const {
  absl::MutexLock lock(&mu_);
  return capacity_ - used_;
}

size_t Arena::requested() const {
  absl::MutexLock lock(&mu_);
  return requested_;
}

absl::StatusOr<size_t> Arena::BufferBytes(absl::string_view buffer_name) const {
  absl::MutexLock lock(&mu_);
  auto it = buffers_.find(buffer_name);
  if (it == buffers_.end()) {
    return absl::NotFoundError(
        absl::StrCat("arena '", name_, "': no buffer named '", buffer_name, "'"));
  }
  return it->second;
}

std::map<std::string, size_t> Arena::Buffers() const {
  absl::MutexLock lock(&mu_);
  return std::map<std::string, size_t>(buffers_.begin(), buffers_.end());
}

}  // namespace memory
}  // namespace zerort
