// Engine::Park / Unpark on a GPU: the engine's device memory goes back to the driver (the
// device allocator's count drops by the engine's device bytes, and cudaMemGetInfo sees them
// free), then returns bit for bit at the same addresses; training goes on exactly as on an
// engine that never parked, for stages 0-3 and with optimizer offload; the second park reuses
// the pinned slabs (no cudaHostRegister). Under ZERORT_CUDA_VMM=0 (device memory from
// cudaMalloc, which cannot keep addresses without memory) Park is refused naming that setting,
// and the engine trains on unharmed. Without a GPU it prints
// "SKIPPED: no CUDA device: <reason>" and passes.
#include <cuda_runtime.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "comm/inprocess.h"
#include "device/cuda_device.h"
#include "device/testing/gpu_or_skip.h"
#include "memory/pinned_pool.h"
#include "zero/engine.h"
#include "zero/testing/synthetic_trainer.h"
#include "zero/testing/visible_state.h"

namespace zerort {
namespace {

using memory::MemoryKind;

using testing::GpuOrSkip;

size_t Resident(Device* gpu) {
  return gpu->allocator(MemoryKind::kDevice)->usage()->resident_bytes;
}

bool VmmOff() {
  const char* v = std::getenv("ZERORT_CUDA_VMM");
  return v != nullptr && std::string(v) == "0";
}

size_t DriverFree() {
  size_t free = 0, total = 0;
  REQUIRE(cudaMemGetInfo(&free, &total) == cudaSuccess);
  return free;
}

struct Case {
  const char* name;
  int stage;
  int gas;
  bool offload;
};

constexpr Case kCases[] = {
    {"stage 0", 0, 1, false},       {"stage 1", 1, 2, false},
    {"stage 2", 2, 1, false},       {"stage 3", 3, 1, false},
    {"stage 2, offload", 2, 1, true}, {"stage 3, offload", 3, 2, true},
};

TEST_CASE("Engine::Park on a GPU: memory to the driver and back bit for bit; training goes on "
          "as if never parked", "[zero][gpu][park]") {
  Device* gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  auto* slabs = static_cast<memory::PinnedSlabCache*>(gpu->allocator(MemoryKind::kPinnedHost));
  constexpr int kBefore = 3, kAfter = 3;
  for (const Case& k : kCases) {
    SECTION(k.name) {
      Config config = testing::TestConfig(k.stage, DType::kBF16, k.gas, 0, k.offload);
      if (k.offload) config.zero.offload_optimizer.pin_memory = true;
      std::vector<char> want;
      {
        auto comms = comm::CreateInProcessGroup(1, {config.comm_timeout_ms},
                                                CudaInProcessBufferOps(0)).value();
        auto ref = testing::TrainRank(config, testing::SmallModel(), comms[0].get(), gpu,
                                      kBefore + kAfter);
        REQUIRE(ref.ok());
        want = testing::VisibleState(*ref);
      }
      auto comms = comm::CreateInProcessGroup(1, {config.comm_timeout_ms},
                                              CudaInProcessBufferOps(0)).value();
      auto created = Engine::Create(config, testing::SmallModel(), comms[0].get(), gpu);
      REQUIRE(created.ok());
      Engine& e = **created;
      REQUIRE(testing::SetInitValues(e).ok());
      REQUIRE(testing::TrainSteps(e, 0, kBefore).ok());
      const std::vector<char> before = testing::VisibleState(e).value();
      const int64_t device_bytes =
          e.memory_report().allocated[static_cast<int>(MemoryKind::kDevice)];
      // Stages 0-2 hold every parameter: its pointer must survive the cycle.
      void* p0 = k.stage < 3 ? e.param(0).value() : nullptr;

      uint64_t os_allocations = 0;
      if (VmmOff()) {
        const absl::Status s = e.Park();
        CHECK(s.code() == absl::StatusCode::kUnimplemented);
        CHECK_THAT(std::string(s.message()), Catch::Contains("ZERORT_CUDA_VMM=0"));
        CHECK_FALSE(e.parked());
        CHECK(testing::VisibleState(e).value() == before);
      }
      for (int cycle = 0; cycle < (VmmOff() ? 0 : 2); ++cycle) {
        CAPTURE(cycle);
        REQUIRE(gpu->Synchronize(e.compute_stream()).ok());
        const size_t resident = Resident(gpu);
        const size_t free0 = DriverFree();
        REQUIRE(e.Park().ok());
        const size_t released = resident - Resident(gpu);
        CHECK(released >= static_cast<size_t>(e.parked_device_bytes()));
        CHECK(e.parked_device_bytes() >= device_bytes);
        // The driver has it back. Checked from the second cycle on, where Park allocates
        // nothing (the slab is reused): the first registers a pinned slab, which may cost the
        // driver some device memory of its own.
        if (cycle == 1) CHECK(DriverFree() >= free0 + released);
        if (cycle == 0) os_allocations = slabs->stats().os_allocations;
        if (cycle == 1) CHECK(slabs->stats().os_allocations == os_allocations);
        CHECK(e.Step().status().code() == absl::StatusCode::kFailedPrecondition);
        REQUIRE(e.Unpark().ok());
        CHECK(Resident(gpu) == resident);
        if (p0 != nullptr) CHECK(e.param(0).value() == p0);
        CHECK(testing::VisibleState(e).value() == before);
      }
      REQUIRE(testing::TrainSteps(e, kBefore, kAfter).ok());
      CHECK(testing::VisibleState(e).value() == want);
    }
  }
}

}  // namespace
}  // namespace zerort
