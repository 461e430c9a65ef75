#include "memory/pinned_pool.h"

#include <atomic>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

namespace zerort {
namespace memory {
namespace {

// Refuses every lock, as mlock does past RLIMIT_MEMLOCK for an unprivileged user.
class RefusingLocker final : public Locker {
 public:
  absl::Status Lock(void*, size_t) override {
    ++attempts;
    return absl::ResourceExhaustedError("refused (RLIMIT_MEMLOCK is 8388608 bytes)");
  }
  void Unlock(void*, size_t) override { ++unlocks; }
  absl::string_view name() const override { return "refusing"; }
  int attempts = 0, unlocks = 0;
};

// Records what was locked so the test can check the cache unlocks exactly that.
class RecordingLocker final : public Locker {
 public:
  absl::Status Lock(void*, size_t bytes) override {
    locked_bytes += bytes;
    return absl::OkStatus();
  }
  void Unlock(void*, size_t bytes) override { unlocked_bytes += bytes; }
  absl::string_view name() const override { return "recording"; }
  size_t locked_bytes = 0, unlocked_bytes = 0;
};

// VmLck from /proc/self/status, in bytes (the kernel's own count of locked memory).
size_t LockedBytesOfProcess() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmLck:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kAsan = true;  // ASan intercepts mlock and makes it a no-op
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kAsan = true;
#else
constexpr bool kAsan = false;
#endif
#else
constexpr bool kAsan = false;
#endif

TEST_CASE("PinnedSlabCache: mlock really locks the slabs (kernel VmLck) when permitted",
          "[memory]") {
  if (kAsan) {
    WARN("AddressSanitizer makes mlock a no-op: VmLck cannot be checked in this build");
    return;
  }
  PinnedSlabCache cache;  // HostAllocator, MlockLocker, kPrefer: what SharedPinnedSlabs uses
  const size_t bytes = 20 * 100003;  // ~2 MB: within the default 8 MiB RLIMIT_MEMLOCK
  const size_t before = LockedBytesOfProcess();
  auto p = cache.Allocate(bytes);
  REQUIRE(p.ok());
  const PinnedSlabCacheStats s = cache.stats();
  if (s.unlocked_slabs == 0) {
    CHECK(LockedBytesOfProcess() >= before + s.in_use_bytes);
  } else {
    // Only an unprivileged user with a tiny limit gets here; then the limit must be the reason.
    CHECK(MemlockLimitBytes() < s.in_use_bytes + before);
  }
  cache.Free(*p, bytes);
  cache.Trim();
  CHECK(LockedBytesOfProcess() == before);
}

// Counts the backing allocator's calls: the OS work the cache exists to avoid.
class CountingAllocator final : public RawAllocator {
 public:
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    ++allocations;
    return HostAllocator()->Allocate(bytes);
  }
  void Free(void* p, size_t bytes) override {
    ++frees;
    HostAllocator()->Free(p, bytes);
  }
  absl::string_view name() const override { return "counting"; }
  int allocations = 0, frees = 0;
};

PinnedSlabCacheOptions CacheOptions(RawAllocator* allocator, Locker* locker,
                                    Locking locking = Locking::kPrefer) {
  PinnedSlabCacheOptions o;
  o.allocator = allocator;
  o.locker = locker;
  o.locking = locking;
  return o;
}

TEST_CASE("PinnedSlabCache: a freed slab is reused for the same size without an OS call",
          "[memory]") {
  CountingAllocator alloc;
  RecordingLocker locker;
  {
    PinnedSlabCache cache(CacheOptions(&alloc, &locker));
    auto a = cache.Allocate(3 * 4096 + 5);
    REQUIRE(a.ok());
    CHECK(reinterpret_cast<uintptr_t>(*a) % 4096 == 0);
    std::memset(*a, 7, 3 * 4096 + 5);
    cache.Free(*a, 3 * 4096 + 5);
    PinnedSlabCacheStats s = cache.stats();
    CHECK(s.cached_slabs == 1);
    CHECK(s.cached_bytes == 4 * 4096);
    CHECK(s.in_use_bytes == 0);
    CHECK(locker.unlocked_bytes == 0);  // kept locked

    auto b = cache.Allocate(3 * 4096 + 5);
    REQUIRE(b.ok());
    CHECK(*b == *a);
    s = cache.stats();
    CHECK(s.os_allocations == 1);
    CHECK(s.reuses == 1);
    CHECK(s.unlocked_slabs == 0);
    CHECK(alloc.allocations == 1);
    CHECK(locker.locked_bytes == 4 * 4096);
    cache.Free(*b, 0);
    CHECK(cache.Allocate(0).value() == nullptr);
    cache.Trim();
    CHECK(cache.stats().cached_bytes == 0);
    CHECK(cache.stats().os_releases == 1);
  }
  CHECK(alloc.frees == alloc.allocations);
  CHECK(locker.unlocked_bytes == locker.locked_bytes);
}

TEST_CASE("PinnedSlabCache: best fit within 1/8, never a split, retention within the peak",
          "[memory]") {
  CountingAllocator alloc;
  PinnedSlabCache cache(CacheOptions(&alloc, nullptr, Locking::kNone));
  const size_t page = 4096;
  void* big = cache.Allocate(16 * page).value();
  void* mid = cache.Allocate(9 * page).value();
  void* small = cache.Allocate(8 * page).value();
  CHECK(cache.stats().high_water_bytes == 33 * page);
  cache.Free(big, 16 * page);
  cache.Free(mid, 9 * page);
  cache.Free(small, 8 * page);
  // 8 pages: the 8-page slab fits exactly (the 9-page one would also do; best fit wins).
  void* a = cache.Allocate(8 * page).value();
  CHECK(a == small);
  // 8 pages again: the 9-page slab is within 1/8 of 8 pages.
  void* b = cache.Allocate(8 * page).value();
  CHECK(b == mid);
  // 4 pages: the 16-page slab would idle 3/4 of itself, and is never split: a new slab. In use
  // 21 pages + 16 cached would pass the 33-page peak, so the least recently freed slab (the
  // 16-page one) goes back to the OS first.
  void* c = cache.Allocate(4 * page).value();
  PinnedSlabCacheStats s = cache.stats();
  CHECK(s.reuses == 2);
  CHECK(s.os_allocations == 4);
  CHECK(s.cached_slabs == 0);
  CHECK(s.os_releases == 1);
  for (void* p : {a, b, c}) cache.Free(p, 0);
  CHECK(cache.stats().cached_bytes == 21 * page);
  // 20 pages fit no cached slab; 20 in use + 21 cached > 33: the oldest freed (8 pages) goes.
  void* d = cache.Allocate(20 * page).value();
  s = cache.stats();
  CHECK(s.cached_slabs == 2);
  CHECK(s.cached_bytes == 13 * page);
  CHECK(s.os_releases == 2);
  CHECK(s.in_use_bytes + s.cached_bytes <= s.high_water_bytes);
  cache.Free(d, 0);
}

TEST_CASE("PinnedSlabCache: max_cached_bytes bounds what is kept", "[memory]") {
  CountingAllocator alloc;
  PinnedSlabCacheOptions o = CacheOptions(&alloc, nullptr, Locking::kNone);
  o.max_cached_bytes = 0;
  PinnedSlabCache cache(o);
  void* p = cache.Allocate(100).value();
  cache.Free(p, 100);
  CHECK(alloc.frees == 1);
  CHECK(cache.stats().cached_slabs == 0);
}

TEST_CASE("PinnedSlabCache: a refused lock releases the cached slabs, then falls back or fails",
          "[memory]") {
  RefusingLocker refusing;
  CountingAllocator alloc;
  const PinnedSlabCacheOptions o = CacheOptions(&alloc, &refusing);
  PinnedSlabCache cache(o);
  const size_t page = 4096;
  void* p1 = cache.Allocate(8 * page).value();  // kPrefer: unlocked
  void* p2 = cache.Allocate(8 * page).value();
  void* p3 = cache.Allocate(4 * page).value();
  CHECK(cache.stats().unlocked_slabs == 3);
  std::memset(p1, 1, 8 * page);
  cache.Free(p1, 0);
  cache.Free(p2, 0);
  // No fit; the peak (20 pages) lets one 8-page slab stay cached, until the lock is refused.
  void* q = cache.Allocate(4 * page).value();
  CHECK(refusing.attempts == 5);  // three slabs, then this one twice
  const PinnedSlabCacheStats s = cache.stats();
  CHECK(s.cached_slabs == 0);
  CHECK(s.os_releases == 2);
  CHECK(alloc.frees == 2);
  cache.Free(q, 0);
  cache.Free(p3, 0);
  CHECK(refusing.unlocks == 0);

  PinnedSlabCacheOptions required = o;
  required.locking = Locking::kRequire;
  PinnedSlabCache strict(required);
  auto r = strict.Allocate(4096);
  REQUIRE(r.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(std::string(r.status().message()).find("RLIMIT_MEMLOCK") != std::string::npos);
  CHECK(strict.stats().in_use_bytes == 0);
}

TEST_CASE("PinnedSlabCache: concurrent allocate/free never shares a slab", "[memory]") {
  PinnedSlabCacheOptions o;
  o.locking = Locking::kNone;
  PinnedSlabCache cache(o);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int i = 0; i < 200; ++i) {
        const size_t bytes = 4096 * (1 + rng() % 4);
        auto p = cache.Allocate(bytes);
        if (!p.ok()) {
          ++failures;
          continue;
        }
        auto* w = static_cast<uint32_t*>(*p);
        const uint32_t tag = static_cast<uint32_t>(t * 100000 + i);
        for (size_t k = 0; k < bytes / 4; k += 101) w[k] = tag;
        std::this_thread::yield();
        for (size_t k = 0; k < bytes / 4; k += 101) failures += w[k] != tag;
        cache.Free(*p, bytes);
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(failures == 0);
  const PinnedSlabCacheStats s = cache.stats();
  CHECK(s.in_use_slabs == 0);
  CHECK(s.reuses + s.os_allocations == 800);
  CHECK(s.cached_bytes <= s.high_water_bytes);
}

}  // namespace
}  // namespace memory
}  // namespace zerort
