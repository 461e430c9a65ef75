// PinnedPool: acquire/release latency against a fresh locked allocation per request, OS
// allocations after warm-up (goal 0) and rounding loss (goal < 1% of reserved).
//
// The workload is the offload pipeline's: requests of the plan's chunk sizes (element counts
// times dtype sizes, not powers of two), a few held at once, random order.
//
// PinnedSlabCache ("recreate"): what re-creating an engine costs in pinned memory. The sizes of
// an offloading engine's pinned arena (fp32 master, m, v of a shard plus staging chunks) and
// of a checkpoint snapshot are allocated from the process-wide cache twice: first when it is
// empty (mmap + mlock, which faults in and zeroes every page: what a fresh engine paid before
// the cache), then again after freeing them (what the second engine pays: goal 0 OS calls).
//
// Usage: pool_bench [--quick]. Prints one JSON document.
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "benchmarks/bench_util.h"
#include "absl/time/time.h"
#include "memory/pinned_pool.h"
#include "nlohmann/json.hpp"

namespace zerort {
namespace {

using memory::PinnedBuffer;
using memory::PinnedPool;
using memory::PinnedPoolOptions;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double Seconds(const std::function<void()>& f) {
  const double t0 = Now();
  f();
  return Now() - t0;
}

// Allocates every size from `cache`, touches one byte of each, then frees them all; returns the
// seconds spent allocating. Exits on failure (a benchmark, not library code).
double AllocateAll(memory::PinnedSlabCache* cache, const std::vector<size_t>& sizes) {
  std::vector<void*> held;
  const double s = Seconds([&] {
    for (size_t bytes : sizes) {
      absl::StatusOr<void*> p = cache->Allocate(bytes);
      if (!p.ok()) {
        std::fprintf(stderr, "pool_bench: %s\n", std::string(p.status().message()).c_str());
        std::exit(1);
      }
      held.push_back(*p);
    }
  });
  for (size_t i = 0; i < held.size(); ++i) {
    static_cast<volatile char*>(held[i])[0] = 1;
    cache->Free(held[i], sizes[i]);
  }
  return s;
}

// First (empty cache: mmap + mlock) against second (reused) allocation of the same sizes.
nlohmann::json Recreate(bool quick) {
  // 4 M parameters per rank (quick: 1 M) offloaded: master, m, v in one arena with 4 bf16
  // staging chunks of 2 x 262147 elements, and a snapshot of master, m, v.
  const size_t params = quick ? 1000003 : 4000037;
  const std::vector<size_t> sizes = {3 * 4 * params + 4 * 2 * 2 * 262147, 3 * 4 * params};
  memory::PinnedSlabCache* cache = memory::SharedPinnedSlabs();
  const int rounds = quick ? 2 : 5;
  double first_s = 0, second_s = 0;
  uint64_t second_os = 0;
  size_t unlocked = 0;
  for (int r = 0; r < rounds; ++r) {
    cache->Trim();  // empty: the first engine of a process
    first_s += AllocateAll(cache, sizes);
    unlocked = std::max(unlocked, cache->stats().unlocked_slabs);
    const uint64_t os_before = cache->stats().os_allocations;
    second_s += AllocateAll(cache, sizes);
    second_os += cache->stats().os_allocations - os_before;
  }
  cache->Trim();
  size_t total = 0;
  for (size_t bytes : sizes) total += bytes;
  return {
      {"bytes_per_engine", total},
      {"rounds", rounds},
      {"first_allocation_ms", 1e3 * first_s / rounds},
      {"second_allocation_ms", 1e3 * second_s / rounds},
      {"speedup", first_s / std::max(second_s, 1e-9)},
      {"os_allocations_on_second", second_os},
      {"locked", unlocked == 0},
      {"memlock_limit_bytes", memory::MemlockLimitBytes()},
  };
}

int Main(int argc, char** argv) {
  bool quick = false;
  if (!bench::ParseQuick(argc, argv, "pool_bench", &quick)) return 2;
  // A plan's offload buffers: bf16 and fp32 chunks of 2,500,003 elements, and a small tail unit.
  PinnedPoolOptions options;
  options.classes = {{2 * 2500003, 4}, {4 * 2500003, 4}, {4 * 123457, 8}};
  options.slab_bytes = size_t{64} << 20;
  std::vector<size_t> request_sizes;
  for (const auto& c : options.classes) request_sizes.push_back(c.bytes);
  request_sizes.push_back(3 * 100001);  // a shorter last chunk served by the small class

  const double t_create = Now();
  auto pool_or = PinnedPool::Create(options);
  const double create_s = Now() - t_create;
  if (!pool_or.ok()) {
    std::fprintf(stderr, "pool_bench: %s\n", std::string(pool_or.status().message()).c_str());
    return 1;
  }
  PinnedPool& pool = **pool_or;

  // Warm-up: touch every buffer once (first touch is the OS's cost, paid once).
  {
    std::vector<PinnedBuffer> all;
    for (size_t s : request_sizes) {
      while (true) {
        auto b = pool.TryAcquire(s);
        if (!b.ok()) break;
        static_cast<char*>(b->data())[0] = 1;
        all.push_back(std::move(*b));
      }
    }
  }
  const size_t os_after_warmup = pool.stats().os_allocations;

  // 10,000 random cycles: acquire a random size while holding up to 6 buffers, release a random
  // held one otherwise.
  const int cycles = 10000;
  std::mt19937 rng(42);
  std::vector<PinnedBuffer> held;
  size_t acquires = 0, releases = 0, exhausted = 0;
  double acquire_s = 0, release_s = 0;
  for (int c = 0; c < cycles; ++c) {
    const bool acquire = held.empty() || (held.size() < 6 && rng() % 2 == 0);
    if (acquire) {
      const size_t s = request_sizes[rng() % request_sizes.size()];
      const double t0 = Now();
      auto b = pool.TryAcquire(s);
      acquire_s += Now() - t0;
      if (b.ok()) {
        held.push_back(std::move(*b));
        ++acquires;
      } else {
        ++exhausted;
      }
    } else {
      const size_t k = rng() % held.size();
      std::swap(held[k], held.back());
      PinnedBuffer b = std::move(held.back());
      held.pop_back();
      const double t0 = Now();
      b.Release();
      release_s += Now() - t0;
      ++releases;
    }
  }
  held.clear();
  const memory::PinnedPoolStats stats = pool.stats();

  // Baseline: a fresh page-locked allocation per request (mmap + mlock, munlock + munmap).
  const int fresh_requests = quick ? 20 : 200;
  double fresh_s = 0;
  for (int i = 0; i < fresh_requests; ++i) {
    const size_t s = request_sizes[rng() % request_sizes.size()];
    const double t0 = Now();
    void* p = mmap(nullptr, s, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return 1;
    const bool locked = mlock(p, s) == 0;
    static_cast<volatile char*>(p)[0] = 1;
    if (locked) munlock(p, s);
    munmap(p, s);
    fresh_s += Now() - t0;
  }

  nlohmann::json out;
  out["benchmark"] = "pool_bench";
  out["limit"] = "fresh mmap+mlock per request (what the pool avoids)";
  out["cycles"] = cycles;
  out["pool"] = {
      {"create_s", create_s},
      {"reserved_bytes", stats.reserved_bytes},
      {"buffers", stats.buffers},
      {"locked", stats.locked},
      {"rounding_loss_bytes", stats.rounding_loss_bytes},
      {"rounding_loss_fraction",
       static_cast<double>(stats.rounding_loss_bytes) / stats.reserved_bytes},
      {"os_allocations_total", stats.os_allocations},
      {"os_allocations_after_warmup", stats.os_allocations - os_after_warmup},
      {"high_water_bytes", stats.high_water_bytes},
      {"acquires", acquires},
      {"releases", releases},
      {"exhausted", exhausted},
      {"acquire_ns", 1e9 * acquire_s / std::max<size_t>(1, acquires + exhausted)},
      {"release_ns", 1e9 * release_s / std::max<size_t>(1, releases)},
  };
  out["fresh_allocation"] = {{"requests", fresh_requests},
                             {"alloc_lock_free_ns", 1e9 * fresh_s / fresh_requests}};
  out["recreate"] = Recreate(quick);
  std::printf("%s\n", out.dump(2).c_str());
  return 0;
}

}  // namespace
}  // namespace zerort

int main(int argc, char** argv) { return zerort::Main(argc, argv); }
