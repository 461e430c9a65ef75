#include "memory/arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "memory/testing/resident_pages.h"

namespace zerort {
namespace memory {
namespace {

// Counts calls so tests can see the arena went through its allocator.
class CountingAllocator final : public RawAllocator {
 public:
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    if (fail) return absl::ResourceExhaustedError("fake device is full");
    ++allocations;
    allocated_bytes += bytes;
    return HostAllocator()->Allocate(bytes);
  }
  void Free(void* p, size_t bytes) override {
    ++frees;
    freed_bytes += bytes;
    HostAllocator()->Free(p, bytes);
  }
  absl::string_view name() const override { return "counting"; }

  bool fail = false;
  int allocations = 0, frees = 0;
  size_t allocated_bytes = 0, freed_bytes = 0;
};

TEST_CASE("Allocation: frees exactly once, through moves, with the size it allocated",
          "[memory]") {
  CountingAllocator alloc;
  {
    auto a = Allocation::Create(&alloc, 12345);
    REQUIRE(a.ok());
    REQUIRE(a->bytes() == 12345);
    std::memset(a->get(), 7, a->bytes());  // usable
    Allocation moved = std::move(*a);
    Allocation assigned;
    assigned = std::move(moved);
    CHECK(assigned.as<char>()[12344] == 7);
    CHECK(alloc.frees == 0);
  }
  CHECK(alloc.allocations == 1);
  CHECK(alloc.frees == 1);
  CHECK(alloc.freed_bytes == 12345);
  alloc.fail = true;
  CHECK(Allocation::Create(&alloc, 1).status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(alloc.frees == 1);
}

TEST_CASE("Arena: buffers are aligned, disjoint and every byte is counted", "[memory]") {
  std::mt19937 rng(7);
  std::uniform_int_distribution<size_t> size_dist(0, 5000);
  std::vector<size_t> sizes(200);
  size_t padded_total = 0, requested_total = 0;
  for (size_t& s : sizes) {
    s = size_dist(rng);
    padded_total += (s + 255) / 256 * 256;
    requested_total += s;
  }
  auto arena = Arena::Create("test", padded_total, HostAllocator());
  REQUIRE(arena.ok());
  std::vector<uint8_t*> ptrs;
  for (size_t i = 0; i < sizes.size(); ++i) {
    auto p = (*arena)->Allocate("buf" + std::to_string(i), sizes[i]);
    REQUIRE(p.ok());
    REQUIRE(reinterpret_cast<uintptr_t>(*p) % Arena::kAlignment == 0);
    ptrs.push_back(static_cast<uint8_t*>(*p));
    std::memset(*p, static_cast<int>(i & 0xff), sizes[i]);
  }
  // Every buffer still holds its own fill: no two overlap.
  for (size_t i = 0; i < sizes.size(); ++i) {
    for (size_t b = 0; b < sizes[i]; ++b) REQUIRE(ptrs[i][b] == (i & 0xff));
    REQUIRE(ptrs[i] >= reinterpret_cast<uint8_t*>((*arena)->base()));
    REQUIRE(ptrs[i] + sizes[i] <= reinterpret_cast<uint8_t*>((*arena)->base()) + padded_total);
  }
  CHECK((*arena)->used() == padded_total);
  CHECK((*arena)->remaining() == 0);
  CHECK((*arena)->requested() == requested_total);
  const auto buffers = (*arena)->Buffers();
  REQUIRE(buffers.size() == sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    CHECK(buffers.at("buf" + std::to_string(i)) == sizes[i]);
    CHECK(*(*arena)->BufferBytes("buf" + std::to_string(i)) == sizes[i]);
  }
  CHECK((*arena)->BufferBytes("nope").status().code() == absl::StatusCode::kNotFound);
}

TEST_CASE("Arena: running out is ResourceExhausted naming buffer, request and remainder",
          "[memory]") {
  auto arena = Arena::Create("host_state", 1000, HostAllocator());
  REQUIRE(arena.ok());
  REQUIRE((*arena)->Allocate("master", 700).ok());  // uses 768
  auto p = (*arena)->Allocate("momentum", 300);
  REQUIRE(p.status().code() == absl::StatusCode::kResourceExhausted);
  const std::string msg(p.status().message());
  CHECK(msg.find("momentum") != std::string::npos);
  CHECK(msg.find("300") != std::string::npos);
  CHECK(msg.find("232") != std::string::npos);  // 1000 - 768
  CHECK(msg.find("host_state") != std::string::npos);
  // The failed request consumed nothing, a huge one cannot wrap around, and the last buffer
  // may end inside the final alignment unit.
  CHECK((*arena)->used() == 768);
  CHECK((*arena)->Allocate("huge", SIZE_MAX - 10).status().code() ==
        absl::StatusCode::kResourceExhausted);
  CHECK((*arena)->Allocate("fits", 232).ok());
}

TEST_CASE("Arena: a name is allocated once until Reset, which reuses the memory", "[memory]") {
  auto arena = Arena::Create("a", 4096, HostAllocator());
  REQUIRE(arena.ok());
  auto first = (*arena)->Allocate("x", 100);
  REQUIRE(first.ok());
  CHECK((*arena)->Allocate("x", 100).status().code() == absl::StatusCode::kAlreadyExists);
  (*arena)->Reset();
  CHECK((*arena)->used() == 0);
  CHECK((*arena)->requested() == 0);
  auto again = (*arena)->Allocate("x", 100);
  REQUIRE(again.ok());
  CHECK(*again == *first);
}

TEST_CASE("Arena: backing memory comes from and returns to the RawAllocator", "[memory]") {
  CountingAllocator counting;
  {
    auto arena = Arena::Create("dev", 12345, &counting);
    REQUIRE(arena.ok());
    CHECK(counting.allocations == 1);
    CHECK(counting.allocated_bytes == 12345);
    CHECK(reinterpret_cast<uintptr_t>((*arena)->base()) % 4096 == 0);
  }
  CHECK(counting.frees == 1);
  CHECK(counting.freed_bytes == 12345);

  counting.fail = true;
  auto failed = Arena::Create("dev", 10, &counting);
  REQUIRE(failed.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(std::string(failed.status().message()).find("dev") != std::string::npos);
  CHECK(Arena::Create("x", 10, nullptr).status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("Arena: empty arena and zero-byte buffers give aligned non-null pointers", "[memory]") {
  auto arena = Arena::Create("empty", 0, HostAllocator());
  REQUIRE(arena.ok());
  auto p = (*arena)->Allocate("nothing", 0);
  REQUIRE(p.ok());
  CHECK(*p != nullptr);
  CHECK(reinterpret_cast<uintptr_t>(*p) % Arena::kAlignment == 0);
  CHECK((*arena)->Allocate("one", 1).status().code() == absl::StatusCode::kResourceExhausted);
}

}  // namespace
TEST_CASE("Arena: staggered buffers start at the requested offset modulo 4 KiB", "[memory]") {
  // Five 64 KiB buffers (a multiple of 4 KiB: unstaggered they would all share one residue).
  const size_t bytes = 64 << 10;
  auto arena = Arena::Create("optim", 5 * (bytes + Arena::kStaggerSlack), HostAllocator());
  REQUIRE(arena.ok());
  std::vector<uintptr_t> residues;
  for (int j = 0; j < 5; ++j) {
    const size_t want = (j * 1280) % 4096;
    auto p = (*arena)->AllocateStaggered("b" + std::to_string(j), bytes, want);
    REQUIRE(p.ok());
    const uintptr_t addr = reinterpret_cast<uintptr_t>(*p);
    CHECK(addr % 4096 == want);
    CHECK(addr % Arena::kAlignment == 0);
    residues.push_back(addr % 4096);
    std::memset(*p, 0xab, bytes);  // the whole buffer is inside the arena (ASan checks)
  }
  std::sort(residues.begin(), residues.end());
  CHECK(std::unique(residues.begin(), residues.end()) == residues.end());
  CHECK((*arena)->requested() == 5 * bytes);  // the skipped bytes are not requested bytes
  CHECK((*arena)->used() > 5 * bytes);
  // No slack left for another staggered buffer that needs a skip.
  auto full = (*arena)->AllocateStaggered("extra", (*arena)->remaining(), 2048);
  CHECK_FALSE(full.ok());
}

namespace {

// The VmSize line of /proc/self/status in KiB: the process's mapped address space.
int64_t MappedKib() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmSize:", 0) == 0) return std::stoll(line.substr(7));
  }
  return -1;
}

// The THPeligible flag of the mapping holding `p` in /proc/self/smaps, or -1.
int ThpEligible(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    unsigned long lo = 0, hi = 0;  // NOLINT: sscanf's %lx
    if (line.find(':') > 8 && std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2) {
      inside = lo <= addr && addr < hi;
    } else if (inside && line.rfind("THPeligible:", 0) == 0) {
      return std::stoi(line.substr(12));
    }
  }
  return -1;
}

}  // namespace

TEST_CASE("HostAllocator: buffers of 2 MiB or more sit on huge-page boundaries, slack returned",
          "[memory]") {
  const size_t kHuge = size_t{2} << 20;
  std::ifstream thp_file("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string thp;
  std::getline(thp_file, thp);
  const bool thp_offered = !thp.empty() && thp.find("[never]") == std::string::npos;
  for (size_t bytes : {kHuge, kHuge + 4096 + 17, 12 * kHuge + 4096}) {
    auto p = HostAllocator()->Allocate(bytes);
    REQUIRE(p.ok());
    CHECK(reinterpret_cast<uintptr_t>(*p) % kHuge == 0);
    std::memset(*p, 0x5a, bytes);  // every byte is mapped and writable
    if (thp_offered) CHECK(ThpEligible(*p) == 1);
    HostAllocator()->Free(*p, bytes);
  }
  // Below a huge page nothing is rounded or aligned beyond the page.
  auto small = HostAllocator()->Allocate(kHuge - 4096);
  REQUIRE(small.ok());
  CHECK(reinterpret_cast<uintptr_t>(*small) % 4096 == 0);
  HostAllocator()->Free(*small, kHuge - 4096);
  // Sizes whose slack or page round-up would wrap are refused, not mapped small.
  for (size_t absurd : {SIZE_MAX, SIZE_MAX - kHuge + 1, SIZE_MAX / 2 + 1}) {
    CHECK(HostAllocator()->Allocate(absurd).status().code() ==
          absl::StatusCode::kResourceExhausted);
  }
  // The alignment slack is unmapped: 64 rounds of 6 MiB + 1 byte do not grow the address space
  // by the 2 MiB a round a leak would cost.
  const int64_t before = MappedKib();
  REQUIRE(before > 0);
  for (int i = 0; i < 64; ++i) {
    auto q = HostAllocator()->Allocate(3 * kHuge + 1);
    REQUIRE(q.ok());
    HostAllocator()->Free(*q, 3 * kHuge + 1);
  }
  CHECK(MappedKib() - before < 16 * 1024);
}

using testing::ResidentPages;

TEST_CASE("NewHostAllocator: Decommit returns the pages and keeps the addresses; Recommit "
          "backs them again", "[memory][park]") {
  std::unique_ptr<RawAllocator> alloc = NewHostAllocator("test device");
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  // One huge-page-backed size and one small one (the two paths of Allocate).
  for (size_t bytes : {size_t{5} << 20, 3 * page + 17}) {
    CAPTURE(bytes);
    const size_t rounded = (bytes + page - 1) / page * page;
    REQUIRE(alloc->usage()->resident_bytes == 0);
    const uint64_t decommits = alloc->usage()->decommits;
    auto p = alloc->Allocate(bytes);
    REQUIRE(p.ok());
    char* c = static_cast<char*>(*p);
    std::memset(c, 0x6b, bytes);
    CHECK(ResidentPages(c, bytes) == rounded / page);
    AllocatorUsage u = *alloc->usage();
    CHECK(u.allocations == 1);
    CHECK(u.reserved_bytes == rounded);
    CHECK(u.resident_bytes == rounded);

    REQUIRE(alloc->Decommit(c, bytes).ok());
    CHECK(ResidentPages(c, bytes) == 0);  // the kernel took the pages back
    u = *alloc->usage();
    CHECK(u.reserved_bytes == rounded);
    CHECK(u.resident_bytes == 0);
    CHECK(u.decommits == decommits + 1);
    CHECK(alloc->Decommit(c, bytes).code() == absl::StatusCode::kFailedPrecondition);
    CHECK(alloc->Decommit(c + page, bytes).code() == absl::StatusCode::kFailedPrecondition);

    REQUIRE(alloc->Recommit(c, bytes).ok());
    CHECK(alloc->Recommit(c, bytes).code() == absl::StatusCode::kFailedPrecondition);
    CHECK(alloc->usage()->resident_bytes == rounded);
    // Fresh pages at the same addresses: zero-filled and writable.
    CHECK(std::all_of(c, c + bytes, [](char x) { return x == 0; }));
    std::memset(c, 0x2c, bytes);

    // Free works in either state and forgets the allocation.
    REQUIRE(alloc->Decommit(c, bytes).ok());
    alloc->Free(c, bytes);
    u = *alloc->usage();
    CHECK(u.allocations == 0);
    CHECK(u.reserved_bytes == 0);
    CHECK(u.resident_bytes == 0);
  }
  // Counts are per allocator: the process-wide one counts on its own.
  CHECK(HostAllocator()->usage().has_value());
}

TEST_CASE("Arena: Decommit and Recommit keep every buffer's address, and refuse a repeat",
          "[memory][park]") {
  std::unique_ptr<RawAllocator> alloc = NewHostAllocator("test device");
  auto arena = Arena::Create("device", 1 << 20, alloc.get());
  REQUIRE(arena.ok());
  auto a = (*arena)->Allocate("a", 1000);
  auto b = (*arena)->Allocate("b", 300000);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK((*arena)->committed());
  REQUIRE((*arena)->Decommit().ok());
  CHECK(!(*arena)->committed());
  CHECK(alloc->usage()->resident_bytes == 0);
  const absl::Status again = (*arena)->Decommit();
  CHECK(again.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(std::string(again.message()).find("'device'") != std::string::npos);
  REQUIRE((*arena)->Recommit().ok());
  CHECK((*arena)->Recommit().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(alloc->usage()->resident_bytes == alloc->usage()->reserved_bytes);
  // The bump pointer and the buffers are untouched: the next buffer follows b.
  CHECK((*arena)->BufferBytes("b").value() == 300000);
  auto c = (*arena)->Allocate("c", 10);
  REQUIRE(c.ok());
  CHECK(static_cast<char*>(*c) == static_cast<char*>(*b) + AlignUp(300000, Arena::kAlignment));
  std::memset(*a, 1, 1000);
  std::memset(*b, 2, 300000);

  // An allocator without the calls: Unimplemented, naming the arena and the allocator, and the
  // arena stays committed.
  CountingAllocator plain;
  auto other = Arena::Create("other", 8192, &plain);
  REQUIRE(other.ok());
  const absl::Status s = (*other)->Decommit();
  CHECK(s.code() == absl::StatusCode::kUnimplemented);
  CHECK(std::string(s.message()).find("'other'") != std::string::npos);
  CHECK(std::string(s.message()).find("counting") != std::string::npos);
  CHECK((*other)->committed());
  // An empty arena parks without its allocator.
  auto empty = Arena::Create("empty", 0, &plain);
  REQUIRE(empty.ok());
  CHECK((*empty)->Decommit().ok());
  CHECK((*empty)->Recommit().ok());
}

}  // namespace memory
}  // namespace zerort
