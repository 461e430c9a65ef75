// Consolidate streams: the memory it allocates stays at one read buffer (8 MiB) whatever the
// checkpoint's size. Measured with a counter of live operator-new bytes (this binary replaces
// the global operator new/delete), against a 48 MiB checkpoint; ReadCheckpoint, which holds
// the whole state, is the control that shows the counter sees a checkpoint-sized allocation.
#include <malloc.h>
#include <stdlib.h>

#include <atomic>
#include <cstdint>
#include <new>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "base/testing/temp_dir.h"
#include "checkpoint/checkpoint.h"
#include "comm/inprocess.h"
#include "device/testing/one_thread.h"
#include "zero/engine.h"
#include "zero/testing/synthetic_trainer.h"

namespace {

std::atomic<int64_t> g_live{0};
std::atomic<int64_t> g_peak{0};

void* Counted(void* p) {
  if (p == nullptr) throw std::bad_alloc();
  const int64_t now = g_live.fetch_add(malloc_usable_size(p)) + malloc_usable_size(p);
  int64_t peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
  return p;
}

void Uncounted(void* p) {
  if (p == nullptr) return;
  g_live.fetch_sub(malloc_usable_size(p));
  free(p);
}

void* AlignedAlloc(size_t n, std::align_val_t a) {
  const size_t align = static_cast<size_t>(a);
  return aligned_alloc(align, (n + align - 1) / align * align);
}

}  // namespace

void* operator new(size_t n) { return Counted(malloc(n == 0 ? 1 : n)); }
void* operator new[](size_t n) { return Counted(malloc(n == 0 ? 1 : n)); }
void* operator new(size_t n, std::align_val_t a) { return Counted(AlignedAlloc(n, a)); }
void* operator new[](size_t n, std::align_val_t a) { return Counted(AlignedAlloc(n, a)); }
void* operator new(size_t n, const std::nothrow_t&) noexcept {
  void* p = malloc(n == 0 ? 1 : n);
  return p == nullptr ? nullptr : Counted(p);
}
void* operator new[](size_t n, const std::nothrow_t& t) noexcept { return operator new(n, t); }
void operator delete(void* p) noexcept { Uncounted(p); }
void operator delete[](void* p) noexcept { Uncounted(p); }
void operator delete(void* p, size_t) noexcept { Uncounted(p); }
void operator delete[](void* p, size_t) noexcept { Uncounted(p); }
void operator delete(void* p, std::align_val_t) noexcept { Uncounted(p); }
void operator delete[](void* p, std::align_val_t) noexcept { Uncounted(p); }
void operator delete(void* p, size_t, std::align_val_t) noexcept { Uncounted(p); }
void operator delete[](void* p, size_t, std::align_val_t) noexcept { Uncounted(p); }

namespace zerort {
namespace {

// The most operator-new memory live at once during fn(), above what was live before it.
template <typename Fn>
int64_t PeakDuring(Fn fn) {
  const int64_t before = g_live.load();
  g_peak.store(before);
  fn();
  return g_peak.load() - before;
}

std::string TempDir(const std::string& tag) {
  return testing::TempDir(absl::StrCat("cmem_", tag, "_"));
}

TEST_CASE("Consolidate's memory stays at one read buffer, not the checkpoint's size",
          "[ckpt][hardening]") {
  // 4 Mi fp32 elements on one rank: 48 MiB of shard (master weights and two moments).
  const std::vector<memory::ParamSpec> model = {{"a", {2048, 1024}, "l0"},
                                                {"b", {1024, 2047}, "l1"},
                                                {"c", {1024}, "l1"}};
  const int64_t elements = 2048 * 1024 + 1024 * 2047 + 1024;
  const std::string root = TempDir("root");
  {
    auto device = testing::OneThreadCpuDevice();
    auto comms = comm::CreateInProcessGroup(1).value();
    const Config config = testing::TestConfig(0, DType::kBF16, 1, 0, false);
    auto engine = Engine::Create(config, model, comms[0].get(), device.get());
    REQUIRE(engine.ok());
    REQUIRE((*engine)
                ->InitParams([](int i, const memory::ParamSpec&, float* v) {
                  // Not needed for the measurement; keeps the file's content defined.
                  v[0] = static_cast<float>(i);
                })
                .ok());
    REQUIRE(SaveCheckpoint(**engine, root).ok());
  }
  const int64_t checkpoint_bytes = elements * 12;
  const std::string out = TempDir("out") + "/model.safetensors";
  absl::Status s;
  const int64_t consolidate = PeakDuring([&] { s = ConsolidateCheckpoint(root, out); });
  REQUIRE(s.ok());
  absl::StatusOr<CheckpointState> state = absl::UnknownError("not run");
  const int64_t read = PeakDuring([&] { state = ReadCheckpoint(root); });
  REQUIRE(state.ok());
  INFO("consolidate peak " << consolidate << " B, ReadCheckpoint peak " << read
                           << " B, checkpoint " << checkpoint_bytes << " B");
  // The control: the counter sees a whole-state reader.
  REQUIRE(read >= checkpoint_bytes);
  // One 8 MiB read buffer plus the header and bookkeeping (well under 1 MiB here).
  REQUIRE(consolidate <= (int64_t{9} << 20));
  REQUIRE(consolidate * 5 < checkpoint_bytes);
}

}  // namespace
}  // namespace zerort
