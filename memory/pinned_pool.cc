#include "memory/pinned_pool.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/base/internal/raw_logging.h"
#include "absl/strings/str_cat.h"

namespace zerort {
namespace memory {
namespace {

constexpr size_t kBufferAlignment = 256;

size_t PageSize() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

std::string LimitString(size_t limit) {
  return limit == SIZE_MAX ? std::string("unlimited") : absl::StrCat(limit, " bytes");
}

class MlockLockerImpl final : public Locker {
 public:
  absl::Status Lock(void* p, size_t bytes) override {
    if (mlock(p, bytes) == 0) return absl::OkStatus();
    const int err = errno;
    return absl::ResourceExhaustedError(absl::StrCat(
        "mlock of ", bytes, " bytes failed: ", std::strerror(err),
        " (RLIMIT_MEMLOCK soft limit is ", LimitString(MemlockLimitBytes()),
        "; raise it with `ulimit -l` or limits.conf memlock)"));
  }
  void Unlock(void* p, size_t bytes) override { munlock(p, bytes); }
  absl::string_view name() const override { return "mlock"; }
};

// One warning per process, however many pools fall back.
std::atomic<bool> g_warned_unlocked{false};

}  // namespace

Locker* MlockLocker() {
  static Locker* const locker = new MlockLockerImpl();
  return locker;
}

size_t MemlockLimitBytes() {
  struct rlimit limit;
  if (getrlimit(RLIMIT_MEMLOCK, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return SIZE_MAX;
  return static_cast<size_t>(limit.rlim_cur);
}

// ---------------------------------------------------------------------------------------------
// PinnedBuffer

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    Release();
    pool_ = std::exchange(other.pool_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    class_ = std::exchange(other.class_, 0);
  }
  return *this;
}

size_t PinnedBuffer::capacity() const { return pool_ == nullptr ? 0 : pool_->sizes_[class_]; }

void PinnedBuffer::Release() {
  if (pool_ == nullptr) return;
  pool_->Give(class_, data_);
  pool_ = nullptr;
  data_ = nullptr;
  size_ = 0;
}

// ---------------------------------------------------------------------------------------------
// PinnedPool

PinnedPool::PinnedPool(const PinnedPoolOptions& options)
    : allocator_(options.allocator != nullptr ? options.allocator : HostAllocator()),
      locker_(options.locker != nullptr ? options.locker : MlockLocker()) {}

absl::StatusOr<std::unique_ptr<PinnedPool>> PinnedPool::Create(const PinnedPoolOptions& options) {
  if (options.classes.empty()) {
    return absl::InvalidArgumentError("pinned pool: no size classes");
  }
  if (options.slab_bytes == 0) {
    return absl::InvalidArgumentError("pinned pool: slab_bytes must be > 0");
  }
  // Merge equal sizes and sort ascending so that PickClass finds the best fit first.
  std::vector<std::pair<size_t, size_t>> merged;  // (bytes, count)
  for (size_t i = 0; i < options.classes.size(); ++i) {
    const auto& c = options.classes[i];
    if (c.bytes == 0 || c.count == 0) {
      return absl::InvalidArgumentError(absl::StrCat("pinned pool: size class ", i, " has bytes=",
                                                     c.bytes, " count=", c.count,
                                                     "; both must be > 0"));
    }
    if (c.bytes > SIZE_MAX / 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("pinned pool: size class ", i, " bytes=", c.bytes, " is too large"));
    }
    merged.emplace_back(c.bytes, c.count);
  }
  std::sort(merged.begin(), merged.end());
  std::vector<std::pair<size_t, size_t>> classes;
  for (const auto& c : merged) {
    if (!classes.empty() && classes.back().first == c.first) {
      classes.back().second += c.second;
    } else {
      classes.push_back(c);
    }
  }

  std::unique_ptr<PinnedPool> pool(new PinnedPool(options));

  // Layout: largest buffers first, packed into slabs of at most slab_bytes (first fit in the
  // current slab only: with few distinct sizes this already wastes less than one buffer).
  struct Placement {
    size_t size_class;
    size_t slab;
    size_t offset;
  };
  std::vector<Placement> placements;
  std::vector<size_t> slab_content;
  size_t usable = 0;
  for (size_t ci = classes.size(); ci-- > 0;) {
    const size_t stride = AlignUp(classes[ci].first, kBufferAlignment);
    for (size_t k = 0; k < classes[ci].second; ++k) {
      if (slab_content.empty() ||
          (slab_content.back() > 0 && slab_content.back() + stride > options.slab_bytes)) {
        slab_content.push_back(0);
      }
      placements.push_back({ci, slab_content.size() - 1, slab_content.back()});
      slab_content.back() += stride;
      usable += classes[ci].first;
    }
  }

  // Allocate and lock the slabs: the only OS calls the pool ever makes.
  const bool want_lock = options.locking != PinnedPoolOptions::Locking::kNone;
  bool all_locked = want_lock;
  for (size_t s = 0; s < slab_content.size(); ++s) {
    const size_t bytes = AlignUp(slab_content[s], PageSize());
    absl::StatusOr<void*> p = pool->allocator_->Allocate(bytes);
    if (!p.ok()) {
      return absl::Status(p.status().code(),
                          absl::StrCat("pinned pool: slab ", s, " of ", slab_content.size(),
                                       " (", bytes, " bytes on ", pool->allocator_->name(),
                                       "): ", p.status().message()));
    }
    Slab slab{static_cast<char*>(*p), bytes, false};
    if (all_locked) {
      absl::Status locked = pool->locker_->Lock(slab.data, slab.bytes);
      if (locked.ok()) {
        slab.locked = true;
      } else if (options.locking == PinnedPoolOptions::Locking::kRequire) {
        pool->allocator_->Free(slab.data, slab.bytes);
        return absl::Status(locked.code(),
                            absl::StrCat("pinned pool: locking slab ", s, " (", bytes,
                                         " bytes) with ", pool->locker_->name(),
                                         " under Locking::kRequire: ", locked.message()));
      } else {
        all_locked = false;
        if (!g_warned_unlocked.exchange(true)) {
          ABSL_RAW_LOG(WARNING,
                       "zerort pinned pool: could not page-lock %zu bytes of host memory (%s); "
                       "continuing with UNLOCKED memory, host<->device copies will be slower. "
                       "RLIMIT_MEMLOCK is %s.",
                       bytes, std::string(locked.message()).c_str(),
                       LimitString(MemlockLimitBytes()).c_str());
        }
      }
    }
    pool->slabs_.push_back(slab);
    pool->reserved_bytes_ += bytes;
  }

  absl::MutexLock lock(&pool->mu_);
  pool->classes_.resize(classes.size());
  for (size_t ci = 0; ci < classes.size(); ++ci) {
    pool->classes_[ci].bytes = classes[ci].first;
    pool->classes_[ci].free.reserve(classes[ci].second);
    pool->sizes_.push_back(classes[ci].first);
  }
  // Reverse order so that the first Acquire of a class gets its lowest address.
  for (size_t i = placements.size(); i-- > 0;) {
    const Placement& pl = placements[i];
    pool->classes_[pl.size_class].free.push_back(pool->slabs_[pl.slab].data + pl.offset);
  }
  pool->buffers_ = placements.size();
  pool->loss_bytes_ = pool->reserved_bytes_ - usable;
  pool->locked_ = all_locked;
  return pool;
}

PinnedPool::~PinnedPool() {
  {
    absl::MutexLock lock(&mu_);
    assert(buffers_in_use_ == 0 && "PinnedPool destroyed with buffers still acquired");
  }
  for (const Slab& slab : slabs_) {
    if (slab.locked) locker_->Unlock(slab.data, slab.bytes);
    allocator_->Free(slab.data, slab.bytes);
  }
}

absl::Status PinnedPool::CheckFits(size_t bytes) const {
  if (bytes > sizes_.back()) {
    return absl::InvalidArgumentError(absl::StrCat("pinned pool: request of ", bytes,
                                                   " bytes exceeds the largest size class (",
                                                   sizes_.back(), " bytes)"));
  }
  return absl::OkStatus();
}

int PinnedPool::PickClass(size_t bytes) const {
  // Few classes: a linear scan beats anything clever.
  for (size_t ci = 0; ci < classes_.size(); ++ci) {
    if (classes_[ci].bytes >= bytes && !classes_[ci].free.empty()) return static_cast<int>(ci);
  }
  return -1;
}

PinnedBuffer PinnedPool::Take(int size_class, size_t bytes) {
  SizeClass& c = classes_[size_class];
  char* data = c.free.back();
  c.free.pop_back();
  in_use_bytes_ += c.bytes;
  high_water_bytes_ = std::max(high_water_bytes_, in_use_bytes_);
  ++buffers_in_use_;
  ++acquires_;
  return PinnedBuffer(this, data, bytes, static_cast<uint32_t>(size_class));
}

void PinnedPool::Give(uint32_t size_class, void* data) {
  absl::MutexLock lock(&mu_);
  SizeClass& c = classes_[size_class];
  c.free.push_back(static_cast<char*>(data));
  in_use_bytes_ -= c.bytes;
  --buffers_in_use_;
  // Waiters may wait for different classes: wake them all (there are at most a few).
  released_.SignalAll();
}

absl::StatusOr<PinnedBuffer> PinnedPool::TryAcquire(size_t bytes) {
  if (absl::Status fits = CheckFits(bytes); !fits.ok()) return fits;
  absl::MutexLock lock(&mu_);
  const int ci = PickClass(bytes);
  if (ci < 0) {
    return absl::ResourceExhaustedError(absl::StrCat("pinned pool: no free buffer for ", bytes,
                                                     " bytes (", buffers_in_use_, " of ",
                                                     buffers_, " buffers in use)"));
  }
  return Take(ci, bytes);
}

absl::StatusOr<PinnedBuffer> PinnedPool::Acquire(size_t bytes, absl::Duration timeout) {
  if (absl::Status fits = CheckFits(bytes); !fits.ok()) return fits;
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  int ci = PickClass(bytes);
  if (ci >= 0) return Take(ci, bytes);
  ++waits_;
  while ((ci = PickClass(bytes)) < 0) {
    if (released_.WaitWithDeadline(&mu_, deadline)) {  // timed out
      if ((ci = PickClass(bytes)) >= 0) break;
      return absl::ResourceExhaustedError(absl::StrCat(
          "pinned pool: no free buffer for ", bytes, " bytes after waiting ",
          absl::FormatDuration(timeout), " (", buffers_in_use_, " of ", buffers_,
          " buffers in use)"));
    }
  }
  return Take(ci, bytes);
}

PinnedPoolStats PinnedPool::stats() const {
  absl::MutexLock lock(&mu_);
  PinnedPoolStats s;
  s.reserved_bytes = reserved_bytes_;
  s.in_use_bytes = in_use_bytes_;
  s.high_water_bytes = high_water_bytes_;
  s.rounding_loss_bytes = loss_bytes_;
  s.os_allocations = slabs_.size();
  s.locked = locked_;
  s.buffers = buffers_;
  s.buffers_in_use = buffers_in_use_;
  s.acquires = acquires_;
  s.waits = waits_;
  return s;
}

std::vector<size_t> PinnedPool::class_bytes() const { return sizes_; }

}  // namespace memory
}  // namespace zerort
