// The engine's pinned memory comes from the process-wide pinned slab cache
// (memory/pinned_pool.h): re-creating an engine of the same plan, and a checkpointer's snapshot
// buffer, reuse the slabs already mapped and locked instead of calling mmap + mlock again.
// Passes whether or not RLIMIT_MEMLOCK lets the slabs be locked (the cache then falls back to
// unlocked memory, and reuses it just the same).
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "base/testing/temp_dir.h"
#include "checkpoint/checkpoint.h"
#include "comm/inprocess.h"
#include "device/testing/one_thread.h"
#include "memory/pinned_pool.h"
#include "zero/engine.h"
#include "zero/testing/synthetic_trainer.h"

namespace zerort {
namespace {

using memory::MemoryKind;
using memory::PinnedSlabCacheStats;

Config OffloadConfig() {
  Config config = testing::TestConfig(2, DType::kBF16, 1, 0, /*offload=*/true);
  config.zero.offload_optimizer.pin_memory = true;  // master, m, v and staging: pinned arena
  return config;
}

// Trains `steps` steps on `world` in-process ranks; returns rank 0's final fp32 masters.
std::vector<float> TrainWorld(const Config& config, Device* device, int world, int steps,
                              MemoryReport* report) {
  auto results = testing::TrainRanks(config, testing::SmallModel(), world, device, steps);
  REQUIRE(results.ok());
  *report = (*results)[0].report;
  return (*results)[0].master;
}

std::string TempDir(const std::string& tag) {
  return testing::TempDir(absl::StrCat("slabs_", tag, "_"));
}

TEST_CASE("Engine PinnedSlabCache: the second Create of the same plan makes no new locking "
          "allocation", "[zero][memory]") {
  auto device = testing::OneThreadCpuDevice();
  memory::PinnedSlabCache* slabs = memory::SharedPinnedSlabs();
  REQUIRE(device->allocator(MemoryKind::kPinnedHost) == slabs);
  const Config config = OffloadConfig();
  constexpr int kWorld = 2;

  MemoryReport report;
  const PinnedSlabCacheStats before = slabs->stats();
  const std::vector<float> first = TrainWorld(config, device.get(), kWorld, 2, &report);
  const PinnedSlabCacheStats after_first = slabs->stats();
  REQUIRE(report.planned[static_cast<int>(MemoryKind::kPinnedHost)] > 0);
  // One pinned arena per rank, each one slab; all back in the cache once the engines are gone.
  CHECK(after_first.os_allocations + after_first.reuses ==
        before.os_allocations + before.reuses + kWorld);
  CHECK(after_first.in_use_slabs == before.in_use_slabs);
  CHECK(after_first.cached_slabs >= kWorld);
  if (after_first.unlocked_slabs > 0) {
    WARN("RLIMIT_MEMLOCK refused the lock: the cache holds unlocked slabs (limit "
         << memory::MemlockLimitBytes() << " bytes); reuse is checked all the same");
  }

  const std::vector<float> second = TrainWorld(config, device.get(), kWorld, 2, &report);
  const PinnedSlabCacheStats after_second = slabs->stats();
  CHECK(after_second.os_allocations == after_first.os_allocations);  // no mmap, no mlock
  CHECK(after_second.reuses == after_first.reuses + kWorld);
  CHECK(after_second.os_releases == after_first.os_releases);
  // Reused slabs hold the previous engines' bytes; the engine zeroes what it carves, so the
  // run is the same bit for bit.
  CHECK(second == first);
}

TEST_CASE("Engine PinnedSlabCache: a checkpoint snapshot buffer comes from the slab cache too",
          "[zero][memory][checkpoint]") {
  auto device = testing::OneThreadCpuDevice();
  memory::PinnedSlabCache* slabs = memory::SharedPinnedSlabs();
  auto comms = comm::CreateInProcessGroup(1).value();
  auto engine = Engine::Create(OffloadConfig(), testing::SmallModel(), comms[0].get(),
                               device.get());
  REQUIRE(engine.ok());
  REQUIRE(testing::TrainSteps(**engine, 0, 1).ok());

  const PinnedSlabCacheStats before = slabs->stats();
  {
    AsyncCheckpointer checkpointer;
    REQUIRE(checkpointer.Start(**engine, TempDir("first")).ok());
    CHECK(checkpointer.saving() == engine->get());
    const PinnedSlabCacheStats started = slabs->stats();
    CHECK(started.in_use_slabs == before.in_use_slabs + 1);  // the snapshot buffer
    CHECK(started.in_use_bytes > before.in_use_bytes);
    CHECK(started.os_allocations + started.reuses == before.os_allocations + before.reuses + 1);
    REQUIRE(checkpointer.Finish().ok());
    CHECK(checkpointer.saving() == nullptr);
  }
  const PinnedSlabCacheStats released = slabs->stats();
  CHECK(released.in_use_slabs == before.in_use_slabs);  // back in the cache, still locked

  // A second checkpointer (another run's, after a reshard, ...) gets that slab back.
  AsyncCheckpointer again;
  REQUIRE(again.Start(**engine, TempDir("second")).ok());
  const PinnedSlabCacheStats restarted = slabs->stats();
  CHECK(restarted.os_allocations == released.os_allocations);
  CHECK(restarted.reuses == released.reuses + 1);
  REQUIRE(again.Finish().ok());
}

}  // namespace
}  // namespace zerort
