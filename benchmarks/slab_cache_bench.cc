// PinnedSlabCache: what re-creating an engine costs in pinned memory. The sizes of an
// offloading engine's pinned arena (fp32 master, m, v of a shard plus staging chunks) and of a
// checkpoint snapshot are allocated from the process-wide cache twice: first when it is empty
// (mmap + mlock, which faults in and zeroes every page: what a fresh engine paid before the
// cache, and the limit this is measured against), then again after freeing them (what the
// second engine pays: goal 0 OS calls).
//
// Usage: slab_cache_bench [--quick]. Prints one JSON document.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "benchmarks/bench_util.h"
#include "memory/pinned_pool.h"
#include "nlohmann/json.hpp"

namespace zerort {
namespace {

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
        std::fprintf(stderr, "slab_cache_bench: %s\n",
                     std::string(p.status().message()).c_str());
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
  if (!bench::ParseQuick(argc, argv, "slab_cache_bench", &quick)) return 2;
  nlohmann::json out;
  out["benchmark"] = "slab_cache_bench";
  out["limit"] = "first allocation from an empty cache (mmap + mlock: what the cache avoids)";
  out["recreate"] = Recreate(quick);
  std::printf("%s\n", out.dump(2).c_str());
  return 0;
}

}  // namespace
}  // namespace zerort

int main(int argc, char** argv) { return zerort::Main(argc, argv); }
