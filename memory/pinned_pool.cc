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
#include <string>
#include <utility>
#include <vector>

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

// One warning per process, however many pools and caches fall back.
std::atomic<bool> g_warned_unlocked{false};

void WarnUnlockedOnce(size_t bytes, const absl::Status& refusal) {
  if (g_warned_unlocked.exchange(true)) return;
  ABSL_RAW_LOG(WARNING,
               "zerort pinned memory: could not page-lock %zu bytes of host memory (%s); "
               "continuing with UNLOCKED memory, host<->device copies will be slower. "
               "RLIMIT_MEMLOCK is %s.",
               bytes, std::string(refusal.message()).c_str(),
               LimitString(MemlockLimitBytes()).c_str());
}

// Size classes merged (equal sizes summed) and sorted ascending, so that PickClass finds the
// best fit first: (bytes, count) pairs.
absl::StatusOr<std::vector<std::pair<size_t, size_t>>> MergeClasses(
    const PinnedPoolOptions& options) {
  if (options.classes.empty()) {
    return absl::InvalidArgumentError("pinned pool: no size classes");
  }
  if (options.slab_bytes == 0) {
    return absl::InvalidArgumentError("pinned pool: slab_bytes must be > 0");
  }
  std::vector<std::pair<size_t, size_t>> merged;
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
  return classes;
}

// Where every buffer goes: largest buffers first, packed into slabs of at most `slab_bytes`
// (first fit in the current slab only: with few distinct sizes this already wastes less than
// one buffer).
struct Layout {
  struct Placement {
    size_t size_class;
    size_t slab;
    size_t offset;
  };
  std::vector<Placement> placements;
  std::vector<size_t> slab_content;  // bytes of buffers in each slab
  size_t usable = 0;                 // sum of the class sizes of every buffer
};

Layout LayOut(const std::vector<std::pair<size_t, size_t>>& classes, size_t slab_bytes) {
  Layout l;
  for (size_t ci = classes.size(); ci-- > 0;) {
    const size_t stride = AlignUp(classes[ci].first, kBufferAlignment);
    for (size_t k = 0; k < classes[ci].second; ++k) {
      if (l.slab_content.empty() ||
          (l.slab_content.back() > 0 && l.slab_content.back() + stride > slab_bytes)) {
        l.slab_content.push_back(0);
      }
      l.placements.push_back({ci, l.slab_content.size() - 1, l.slab_content.back()});
      l.slab_content.back() += stride;
      l.usable += classes[ci].first;
    }
  }
  return l;
}

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
  absl::StatusOr<std::vector<std::pair<size_t, size_t>>> classes = MergeClasses(options);
  if (!classes.ok()) return classes.status();
  const Layout layout = LayOut(*classes, options.slab_bytes);
  std::unique_ptr<PinnedPool> pool(new PinnedPool(options));
  if (absl::Status s = pool->ReserveSlabs(layout.slab_content, options.locking); !s.ok()) {
    return s;
  }
  absl::MutexLock lock(&pool->mu_);
  pool->classes_.resize(classes->size());
  for (size_t ci = 0; ci < classes->size(); ++ci) {
    pool->classes_[ci].bytes = (*classes)[ci].first;
    pool->classes_[ci].free.reserve((*classes)[ci].second);
    pool->sizes_.push_back((*classes)[ci].first);
  }
  // Reverse order so that the first Acquire of a class gets its lowest address.
  for (size_t i = layout.placements.size(); i-- > 0;) {
    const Layout::Placement& pl = layout.placements[i];
    pool->classes_[pl.size_class].free.push_back(pool->slabs_[pl.slab].data + pl.offset);
  }
  pool->buffers_ = layout.placements.size();
  pool->loss_bytes_ = pool->reserved_bytes_ - layout.usable;
  return pool;
}

absl::Status PinnedPool::ReserveSlabs(const std::vector<size_t>& slab_content, Locking locking) {
  locked_ = locking != Locking::kNone;
  for (size_t s = 0; s < slab_content.size(); ++s) {
    const size_t bytes = AlignUp(slab_content[s], PageSize());
    absl::StatusOr<void*> p = allocator_->Allocate(bytes);
    if (!p.ok()) {
      return absl::Status(p.status().code(),
                          absl::StrCat("pinned pool: slab ", s, " of ", slab_content.size(),
                                       " (", bytes, " bytes on ", allocator_->name(),
                                       "): ", p.status().message()));
    }
    Slab slab{static_cast<char*>(*p), bytes, false};
    // After one refusal stop trying: the same limit refuses every later slab.
    if (locked_) {
      const absl::Status refused = locker_->Lock(slab.data, slab.bytes);
      if (refused.ok()) {
        slab.locked = true;
      } else if (locking == Locking::kRequire) {
        allocator_->Free(slab.data, slab.bytes);
        return absl::Status(refused.code(),
                            absl::StrCat("pinned pool: locking slab ", s, " (", bytes,
                                         " bytes) with ", locker_->name(),
                                         " under Locking::kRequire: ", refused.message()));
      } else {
        locked_ = false;
        WarnUnlockedOnce(bytes, refused);
      }
    }
    slabs_.push_back(slab);
    reserved_bytes_ += bytes;
  }
  return absl::OkStatus();
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

// ---------------------------------------------------------------------------------------------
// PinnedSlabCache

namespace {

PinnedSlabCacheOptions Resolved(PinnedSlabCacheOptions o) {
  if (o.allocator == nullptr) o.allocator = HostAllocator();
  if (o.locker == nullptr) o.locker = MlockLocker();
  return o;
}

}  // namespace

PinnedSlabCache::PinnedSlabCache(PinnedSlabCacheOptions options)
    : options_(Resolved(std::move(options))) {}

PinnedSlabCache::~PinnedSlabCache() {
  std::vector<Slab> cached;
  {
    absl::MutexLock lock(&mu_);
    assert(in_use_.empty() && "PinnedSlabCache destroyed with slabs still allocated");
    cached.swap(cached_);
    cached_bytes_ = 0;
  }
  ReleaseToOs(cached);
}

absl::StatusOr<void*> PinnedSlabCache::Allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  if (bytes > SIZE_MAX / 2) {
    return absl::ResourceExhaustedError(
        absl::StrCat(options_.name, ": a slab of ", bytes, " bytes is too large"));
  }
  const size_t need = AlignUp(bytes, PageSize());
  std::vector<Slab> evicted;
  {
    absl::MutexLock lock(&mu_);
    if (const int best = BestFitLocked(need); best >= 0) {
      const Slab slab = cached_[best];
      cached_.erase(cached_.begin() + best);
      cached_bytes_ -= slab.bytes;
      in_use_bytes_ += slab.bytes;
      high_water_bytes_ = std::max(high_water_bytes_, in_use_bytes_);
      in_use_.push_back(slab);
      ++reuses_;
      return static_cast<void*>(slab.data);
    }
    // A miss. Count the slab as in use already, so that concurrent misses see it, and keep
    // in-use + cached bytes within the (possibly new) peak.
    in_use_bytes_ += need;
    high_water_bytes_ = std::max(high_water_bytes_, in_use_bytes_);
    evicted = EvictLocked([this](size_t cached) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return in_use_bytes_ + cached <= high_water_bytes_;
    });
  }
  ReleaseToOs(evicted);
  absl::StatusOr<Slab> slab = AllocateSlab(need);
  absl::MutexLock lock(&mu_);
  if (!slab.ok()) {
    in_use_bytes_ -= need;
    return slab.status();
  }
  in_use_.push_back(*slab);
  ++os_allocations_;
  return static_cast<void*>(slab->data);
}

absl::StatusOr<PinnedSlabCache::Slab> PinnedSlabCache::AllocateSlab(size_t bytes) {
  absl::StatusOr<void*> p = options_.allocator->Allocate(bytes);
  if (!p.ok()) {
    return absl::Status(p.status().code(),
                        absl::StrCat(options_.name, ": a slab of ", bytes, " bytes on ",
                                     options_.allocator->name(), ": ", p.status().message()));
  }
  Slab slab{static_cast<char*>(*p), bytes, false, 0};
  if (options_.locking == Locking::kNone) return slab;
  absl::Status refused = options_.locker->Lock(slab.data, bytes);
  if (!refused.ok()) {
    // Cached slabs count against the same limit: return them to the OS and try once more.
    std::vector<Slab> evicted;
    {
      absl::MutexLock lock(&mu_);
      evicted = EvictLocked([](size_t cached) { return cached == 0; });
    }
    if (!evicted.empty()) {
      ReleaseToOs(evicted);
      refused = options_.locker->Lock(slab.data, bytes);
    }
  }
  if (refused.ok()) {
    slab.locked = true;
  } else if (options_.locking == Locking::kRequire) {
    options_.allocator->Free(slab.data, bytes);
    return absl::Status(refused.code(),
                        absl::StrCat(options_.name, ": a slab of ", bytes, " bytes with ",
                                     options_.locker->name(),
                                     " (Locking::kRequire): ", refused.message()));
  } else {
    WarnUnlockedOnce(bytes, refused);
  }
  return slab;
}

void PinnedSlabCache::Free(void* p, size_t /*bytes: the slab's own size is recorded*/) {
  if (p == nullptr) return;
  std::vector<Slab> evicted;
  {
    absl::MutexLock lock(&mu_);
    auto it = std::find_if(in_use_.begin(), in_use_.end(),
                           [p](const Slab& s) { return s.data == p; });
    ABSL_RAW_CHECK(it != in_use_.end(), "PinnedSlabCache::Free of memory it did not allocate");
    Slab slab = *it;
    *it = in_use_.back();
    in_use_.pop_back();
    in_use_bytes_ -= slab.bytes;
    slab.freed_at = ++clock_;
    cached_.push_back(slab);
    cached_bytes_ += slab.bytes;
    evicted = EvictLocked([this](size_t cached) {
      return cached <= options_.max_cached_bytes;
    });
  }
  ReleaseToOs(evicted);
}

void PinnedSlabCache::Trim() {
  std::vector<Slab> evicted;
  {
    absl::MutexLock lock(&mu_);
    evicted = EvictLocked([](size_t cached) { return cached == 0; });
  }
  ReleaseToOs(evicted);
}

template <typename Fits>
std::vector<PinnedSlabCache::Slab> PinnedSlabCache::EvictLocked(Fits fits) {
  std::vector<Slab> out;
  while (!cached_.empty() && !fits(cached_bytes_)) {
    auto oldest = std::min_element(
        cached_.begin(), cached_.end(),
        [](const Slab& a, const Slab& b) { return a.freed_at < b.freed_at; });
    cached_bytes_ -= oldest->bytes;
    out.push_back(*oldest);
    cached_.erase(oldest);
  }
  os_releases_ += out.size();
  return out;
}

int PinnedSlabCache::BestFitLocked(size_t bytes) const {
  int best = -1;
  for (size_t i = 0; i < cached_.size(); ++i) {
    const Slab& s = cached_[i];
    if (s.bytes < bytes || s.bytes - bytes > bytes / 8) continue;
    if (best < 0 || s.bytes < cached_[best].bytes ||
        (s.bytes == cached_[best].bytes && s.freed_at > cached_[best].freed_at)) {
      best = static_cast<int>(i);
    }
  }
  return best;
}

void PinnedSlabCache::ReleaseToOs(const std::vector<Slab>& slabs) {
  for (const Slab& slab : slabs) {
    if (slab.locked) options_.locker->Unlock(slab.data, slab.bytes);
    options_.allocator->Free(slab.data, slab.bytes);
  }
}

PinnedSlabCacheStats PinnedSlabCache::stats() const {
  absl::MutexLock lock(&mu_);
  PinnedSlabCacheStats s;
  s.in_use_bytes = in_use_bytes_;
  s.in_use_slabs = in_use_.size();
  s.cached_bytes = cached_bytes_;
  s.cached_slabs = cached_.size();
  s.high_water_bytes = high_water_bytes_;
  s.os_allocations = os_allocations_;
  s.reuses = reuses_;
  s.os_releases = os_releases_;
  for (const auto* list : {&cached_, &in_use_}) {
    for (const Slab& slab : *list) s.unlocked_slabs += slab.locked ? 0 : 1;
  }
  return s;
}

PinnedSlabCache* SharedPinnedSlabs() {
  static PinnedSlabCache* const cache = [] {
    PinnedSlabCacheOptions o;
    o.name = "pinned host (mlock)";
    return new PinnedSlabCache(std::move(o));
  }();
  return cache;
}

}  // namespace memory
}  // namespace zerort
