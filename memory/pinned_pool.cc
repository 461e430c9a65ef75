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

// One warning per process, however many caches fall back.
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
