#include "zero/internal/parking.h"

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "device/testing/one_thread.h"
#include "memory/arena.h"
#include "memory/pinned_pool.h"
#include "memory/testing/resident_pages.h"

namespace zerort {
namespace zero_internal {
namespace {

using memory::MemoryKind;

using memory::testing::ResidentPages;

// An allocator that cannot decommit (the RawAllocator defaults).
class PlainAllocator final : public memory::RawAllocator {
 public:
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    return memory::HostAllocator()->Allocate(bytes);
  }
  void Free(void* p, size_t bytes) override { memory::HostAllocator()->Free(p, bytes); }
  absl::string_view name() const override { return "plain"; }
};

// Fills every carved byte of `arena` with a pattern of `seed`.
std::vector<char> Fill(memory::Arena& arena, int seed) {
  std::vector<char> bytes(arena.used());
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 131 + seed);
  std::memcpy(arena.base(), bytes.data(), bytes.size());
  return bytes;
}

TEST_CASE("ParkedArenas: device memory returned and restored bit for bit at the same "
          "addresses; the second park reuses the pinned slabs", "[zero][park]") {
  auto dev = testing::OneThreadCpuDevice();
  memory::RawAllocator* device_mem = dev->allocator(MemoryKind::kDevice);
  auto* slabs = static_cast<memory::PinnedSlabCache*>(dev->allocator(MemoryKind::kPinnedHost));
  REQUIRE(slabs == memory::SharedPinnedSlabs());
  auto a = memory::Arena::Create("device", (3 << 20) + 4096, device_mem).value();
  auto b = memory::Arena::Create("second", 70000, device_mem).value();
  void* buf = a->Allocate("weights", (3 << 20) + 100).value();
  REQUIRE(b->Allocate("small", 65000).ok());
  const std::vector<char> want_a = Fill(*a, 1), want_b = Fill(*b, 2);
  const size_t resident = device_mem->usage()->resident_bytes;
  REQUIRE(resident >= a->capacity() + b->capacity());

  uint64_t os_allocations_first = 0;
  for (int round = 0; round < 3; ++round) {
    CAPTURE(round);
    const memory::PinnedSlabCacheStats before = slabs->stats();
    auto parked = ParkedArenas::Park({a.get(), b.get()}, dev.get(), nullptr);
    REQUIRE(parked.ok());
    CHECK((*parked)->parked());
    CHECK((*parked)->host_bytes() == a->used() + b->used());
    CHECK(!a->committed());
    CHECK(!b->committed());
    // The device holds nothing of them: its own count, and the kernel's.
    CHECK(device_mem->usage()->resident_bytes == 0);
    CHECK(ResidentPages(a->base(), a->capacity()) == 0);
    const memory::PinnedSlabCacheStats during = slabs->stats();
    CHECK(during.in_use_slabs == before.in_use_slabs + 2);
    if (round == 0) os_allocations_first = during.os_allocations;
    // From the second park on, the slabs come from the cache: no OS allocation.
    if (round > 0) {
      CHECK(during.os_allocations == os_allocations_first);
      CHECK(during.reuses == before.reuses + 2);
    }

    REQUIRE((*parked)->Unpark().ok());
    CHECK(!(*parked)->parked());
    CHECK((*parked)->Unpark().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(a->committed());
    CHECK(device_mem->usage()->resident_bytes == resident);
    CHECK(a->Buffers().at("weights") == (3u << 20) + 100);
    CHECK(std::memcmp(a->base(), want_a.data(), want_a.size()) == 0);
    CHECK(std::memcmp(b->base(), want_b.data(), want_b.size()) == 0);
    CHECK(static_cast<char*>(buf) == a->base());  // the same addresses
    parked->reset();
    CHECK(slabs->stats().in_use_slabs == before.in_use_slabs);
  }
}

TEST_CASE("ParkedArenas: a failed park leaves every arena committed with its bytes, and "
          "returns the slabs", "[zero][park]") {
  auto dev = testing::OneThreadCpuDevice();
  PlainAllocator plain;
  auto good = memory::Arena::Create("device", 40000, dev->allocator(MemoryKind::kDevice)).value();
  auto bad = memory::Arena::Create("undecommittable", 40000, &plain).value();
  REQUIRE(good->Allocate("x", 30000).ok());
  REQUIRE(bad->Allocate("y", 30000).ok());
  const std::vector<char> want_good = Fill(*good, 3), want_bad = Fill(*bad, 4);
  const size_t in_use = memory::SharedPinnedSlabs()->stats().in_use_slabs;

  auto parked = ParkedArenas::Park({good.get(), bad.get()}, dev.get(), nullptr);
  REQUIRE(!parked.ok());
  CHECK(parked.status().code() == absl::StatusCode::kUnimplemented);
  CHECK(std::string(parked.status().message()).find("'undecommittable'") != std::string::npos);
  CHECK(good->committed());
  CHECK(bad->committed());
  CHECK(std::memcmp(good->base(), want_good.data(), want_good.size()) == 0);
  CHECK(std::memcmp(bad->base(), want_bad.data(), want_bad.size()) == 0);
  CHECK(memory::SharedPinnedSlabs()->stats().in_use_slabs == in_use);

  // An arena parked elsewhere already is refused before anything moves.
  REQUIRE(good->Decommit().ok());
  auto twice = ParkedArenas::Park({good.get()}, dev.get(), nullptr);
  CHECK(twice.status().code() == absl::StatusCode::kFailedPrecondition);
  REQUIRE(good->Recommit().ok());
}

}  // namespace
}  // namespace zero_internal
}  // namespace zerort
