// Engine::Park / Unpark (RL colocation): the engine's device memory goes to pinned host memory
// and comes back bit for bit at the same addresses. The references are independent of the
// parking code: the device's own allocator count (and, on the CPU device, the kernel's mincore)
// for the memory given back, an engine that never parked for the training that follows, and
// the pinned slab cache's counters for the OS allocations.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "comm/inprocess.h"
#include "comm/testing/on_ranks.h"
#include "device/testing/one_thread.h"
#include "memory/pinned_pool.h"
#include "zero/engine.h"
#include "zero/testing/synthetic_trainer.h"
#include "zero/testing/visible_state.h"

namespace zerort {
namespace {

using memory::MemoryKind;

absl::Status Expect(bool ok, const std::string& what) {
  return ok ? absl::OkStatus() : absl::InternalError(what);
}

size_t DeviceResident(Device* dev) {
  return dev->allocator(MemoryKind::kDevice)->usage()->resident_bytes;
}

size_t PageRounded(size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}

// Whether the page holding `p` is resident, by mincore: the kernel's answer.
bool Resident(const void* p) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* start = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(p) & ~(page - 1));
  unsigned char v = 0;
  return mincore(start, page, &v) == 0 && (v & 1) != 0;
}

struct Case {
  const char* name;
  int stage;
  DType dtype;
  int gas;
  double clip;
  bool offload;
  // The CPU device's streams on threads, each operation 200 us late: Park must order its
  // copies after the step's work on every stream of the engine.
  bool async = false;
};

constexpr Case kCases[] = {
    {"stage 0 bf16", 0, DType::kBF16, 1, 0, false},
    {"stage 1 fp32, accumulation 2, clipping", 1, DType::kF32, 2, 0.5, false},
    {"stage 2 bf16", 2, DType::kBF16, 1, 0, false},
    {"stage 3 bf16", 3, DType::kBF16, 1, 0, false},
    {"stage 2 bf16, optimizer offload", 2, DType::kBF16, 1, 0, true},
    {"stage 3 bf16, accumulation 2, optimizer offload", 3, DType::kBF16, 2, 0, true},
    {"stage 2 bf16, optimizer offload, asynchronous streams", 2, DType::kBF16, 1, 0, true, true},
    {"stage 3 fp32, asynchronous streams", 3, DType::kF32, 1, 0, false, true},
};

TEST_CASE("Engine::Park: device memory given back and restored bit for bit; training goes on "
          "as if never parked; the second park makes no new OS allocation",
          "[zero][park]") {
  constexpr int kWorld = 2, kBefore = 3, kAfter = 3;
  memory::PinnedSlabCache* slabs = memory::SharedPinnedSlabs();
  for (const Case& k : kCases) {
    SECTION(k.name) {
      Config config = testing::TestConfig(k.stage, k.dtype, k.gas, k.clip, k.offload);
      if (k.offload) config.zero.offload_optimizer.pin_memory = true;
      // The engine that never parks.
      auto ref_device = testing::OneThreadCpuDevice();
      auto ref = testing::TrainRanks(config, testing::SmallModel(), kWorld, ref_device.get(),
                                     kBefore + kAfter);
      REQUIRE(ref.ok());

      // One device per rank, so that each rank's allocator count is its engine's alone.
      std::vector<std::unique_ptr<Device>> devices;
      for (int r = 0; r < kWorld; ++r) {
        devices.push_back(k.async ? testing::AsyncOneThreadCpuDevice(200)
                                  : testing::OneThreadCpuDevice());
      }
      std::vector<std::vector<char>> finals(kWorld);
      std::vector<memory::PinnedSlabCacheStats> after_first_park(kWorld), after_second(kWorld);
      const std::vector<absl::Status> st = comm::testing::OnRanks(
          kWorld, {config.comm_timeout_ms}, [&](int r, comm::Communicator* comm) -> absl::Status {
            Device* dev = devices[r].get();
            ASSIGN_OR_RETURN(auto engine,
                             Engine::Create(config, testing::SmallModel(), comm, dev));
            RETURN_IF_ERROR(testing::SetInitValues(*engine));
            RETURN_IF_ERROR(testing::TrainSteps(*engine, 0, kBefore));
            ASSIGN_OR_RETURN(const std::vector<char> before, testing::VisibleState(*engine));
            const size_t resident = DeviceResident(dev);
            const int64_t device_bytes =
                engine->memory_report().allocated[static_cast<int>(MemoryKind::kDevice)];
            RETURN_IF_ERROR(Expect(device_bytes > 0 && resident >= device_bytes,
                                   "the engine holds device memory"));

            for (int cycle = 0; cycle < 2; ++cycle) {
              RETURN_IF_ERROR(engine->Barrier());  // both ranks' slabs counted together
              RETURN_IF_ERROR(engine->Park());
              RETURN_IF_ERROR(engine->Barrier());
              if (cycle == 0) after_first_park[r] = slabs->stats();
              if (cycle == 1) after_second[r] = slabs->stats();
              RETURN_IF_ERROR(Expect(engine->parked(), "parked()"));
              // The device holds nothing now: its count dropped by all the engine had.
              RETURN_IF_ERROR(Expect(DeviceResident(dev) == 0,
                                     absl::StrCat("device resident while parked: ",
                                                  DeviceResident(dev))));
              RETURN_IF_ERROR(Expect(
                  PageRounded(engine->parked_device_bytes()) == resident &&
                      engine->parked_device_bytes() >= device_bytes,
                  absl::StrCat("parked_device_bytes ", engine->parked_device_bytes(),
                               " vs resident before ", resident)));
              RETURN_IF_ERROR(Expect(engine->parked_host_bytes() >= device_bytes,
                                     "parked_host_bytes holds every buffer"));
              RETURN_IF_ERROR(engine->Barrier());  // collectives still work while parked
              RETURN_IF_ERROR(engine->Unpark());
              RETURN_IF_ERROR(Expect(!engine->parked() && DeviceResident(dev) == resident,
                                     "unparked: the device memory is back"));
              ASSIGN_OR_RETURN(const std::vector<char> after, testing::VisibleState(*engine));
              RETURN_IF_ERROR(Expect(after == before, "state after Unpark == before Park"));
            }
            RETURN_IF_ERROR(testing::TrainSteps(*engine, kBefore, kAfter));
            ASSIGN_OR_RETURN(finals[r], testing::VisibleState(*engine));
            return absl::OkStatus();
          });
      for (int r = 0; r < kWorld; ++r) {
        INFO("rank " << r);
        REQUIRE(st[r].ok());
      }
      // Bit for bit what the engine that never parked holds after the same steps.
      for (int r = 0; r < kWorld; ++r) CHECK(finals[r] == testing::VisibleState((*ref)[r]));
      // The second cycle's slabs came from the cache: no mmap, no mlock.
      CHECK(after_second[0].os_allocations == after_first_park[0].os_allocations);
      CHECK(after_second[0].reuses >= after_first_park[0].reuses + kWorld);
      CHECK(after_second[0].in_use_slabs == after_first_park[0].in_use_slabs);
    }
  }
}

TEST_CASE("Engine::Park: pointers stay valid, the pages really go, and the engine can be "
          "destroyed parked", "[zero][park]") {
  auto dev = testing::OneThreadCpuDevice();
  auto comms = comm::CreateInProcessGroup(1).value();
  memory::PinnedSlabCache* slabs = memory::SharedPinnedSlabs();
  const size_t in_use = slabs->stats().in_use_slabs;
  {
    auto engine = Engine::Create(testing::TestConfig(0, DType::kBF16, 1, 0, false),
                                 testing::SmallModel(), comms[0].get(), dev.get());
    REQUIRE(engine.ok());
    REQUIRE(testing::SetInitValues(**engine).ok());
    REQUIRE(testing::TrainSteps(**engine, 0, 2).ok());
    void* p0 = (*engine)->param(0).value();
    void* g0 = (*engine)->grad(0).value();
    CHECK(Resident(p0));
    REQUIRE((*engine)->Park().ok());
    CHECK(!Resident(p0));  // the kernel has the page back
    CHECK(slabs->stats().in_use_slabs == in_use + 1);
    REQUIRE((*engine)->Unpark().ok());
    CHECK((*engine)->param(0).value() == p0);
    CHECK((*engine)->grad(0).value() == g0);
    CHECK(Resident(p0));
    REQUIRE(testing::TrainSteps(**engine, 2, 1).ok());
    REQUIRE((*engine)->Park().ok());
  }
  // Destroyed while parked: the slab went back to the cache, the device memory was freed.
  CHECK(slabs->stats().in_use_slabs == in_use);
  CHECK(dev->allocator(MemoryKind::kDevice)->usage()->allocations == 0);
}

bool Says(const absl::Status& s, absl::StatusCode code, const std::string& text) {
  return s.code() == code && std::string(s.message()).find(text) != std::string::npos;
}

TEST_CASE("Engine::Park: refused while something is in flight, and every device call "
          "refused while parked", "[zero][park]") {
  auto dev = testing::OneThreadCpuDevice();
  auto comms = comm::CreateInProcessGroup(1).value();
  // Stage 3 with two micro-steps a window: every refusal has its case.
  auto created = Engine::Create(testing::TestConfig(3, DType::kBF16, 2, 0, false),
                                testing::SmallModel(), comms[0].get(), dev.get());
  REQUIRE(created.ok());
  Engine& e = **created;
  REQUIRE(testing::SetInitValues(e).ok());
  constexpr auto kFailed = absl::StatusCode::kFailedPrecondition;

  CHECK(Says(e.Unpark(), kFailed, "not parked"));

  // A held unit.
  REQUIRE(e.Gather(1).ok());
  CHECK(Says(e.Park(), kFailed, "held"));
  REQUIRE(e.Release(1).ok());

  // A micro-step in progress, then inside the accumulation window.
  std::vector<std::vector<char>> host;
  REQUIRE(testing::Backward(e, 0, 0, &host).ok());
  CHECK(Says(e.Park(), kFailed, "micro-step is in progress"));
  REQUIRE(e.Step().ok());
  CHECK(Says(e.Park(), kFailed, "accumulation window"));
  // A measured window awaiting its decision.
  REQUIRE(testing::Backward(e, 0, 1, &host).ok());
  REQUIRE(e.ComputeGradNorm().ok());
  CHECK(Says(e.Park(), kFailed, "ApplyStep"));
  REQUIRE(e.ApplyStep().ok());
  CHECK(!e.parked());

  // An asynchronous snapshot in flight: Park waits for its copies, which hold the state.
  const int64_t n = e.plan().shard_elements;
  std::vector<float> master(n), m(n), v(n);
  REQUIRE(e.BeginSnapshot(master.data(), m.data(), v.data(), nullptr).ok());
  REQUIRE(e.Park().ok());
  REQUIRE(e.WaitSnapshot().ok());
  CHECK(Says(e.Park(), kFailed, "already parked"));

  // Parked: every call that reaches device memory says so.
  CHECK(Says(e.Step().status(), kFailed, "parked"));
  CHECK(Says(e.param(0).status(), kFailed, "param: the engine is parked"));
  CHECK(Says(e.grad(0).status(), kFailed, "parked"));
  CHECK(Says(e.GradReady(0), kFailed, "parked"));
  CHECK(Says(e.Gather(0), kFailed, "parked"));
  CHECK(Says(e.AcquireParams({0}), kFailed, "parked"));
  CHECK(Says(e.GatherMasterWeights().status(), kFailed, "parked"));
  CHECK(Says(e.InitParams([](int, const memory::ParamSpec&, float*) {}), kFailed, "parked"));
  CHECK(Says(e.BeginSnapshot(master.data(), m.data(), v.data(), nullptr), kFailed, "parked"));
  CHECK(Says(e.RestoreOwnedState(master, m, v, e.state()), kFailed, "parked"));
  // Out of range is still out of range.
  CHECK(e.param(-1).status().code() == absl::StatusCode::kOutOfRange);
  // Scalars and collectives that hold no device memory still work.
  CHECK(e.SetLearningRate(1e-3).ok());
  CHECK(e.Barrier().ok());

  REQUIRE(e.Unpark().ok());
  CHECK(Says(e.Unpark(), kFailed, "not parked"));
  // The snapshot taken before parking is the state the engine still has.
  std::vector<float> master2(n), m2(n), v2(n);
  REQUIRE(e.BeginSnapshot(master2.data(), m2.data(), v2.data(), nullptr).ok());
  REQUIRE(e.WaitSnapshot().ok());
  CHECK(master2 == master);
  CHECK(m2 == m);
  CHECK(v2 == v);
  REQUIRE(testing::TrainSteps(e, 1, 1).ok());
}

}  // namespace
}  // namespace zerort
