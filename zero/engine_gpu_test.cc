// The engine on one GPU: the CUDA device with the NCCL communicator (world 1), and with 2 or 4
// in-process ranks sharing the GPU (CudaInProcessBufferOps), must give the same fp32 master
// weights and compute-dtype parameters, bit for bit, as the CPU device with the in-process
// communicator, for stages 0-3, with and without optimizer offload (through the stream
// pipeline) and with parameter offload. Without a GPU it prints
// "SKIPPED: no CUDA device: <reason>" and passes.
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "base/testing/temp_dir.h"
#include "checkpoint/checkpoint.h"
#include "comm/inprocess.h"
#include "comm/testing/one_rank_nccl.h"
#include "comm/testing/stream_ordered.h"
#include "device/testing/one_thread.h"
#include "device/cuda_device.h"
#include "device/testing/gpu_or_skip.h"
#include "zero/engine.h"
#include "zero/testing/synthetic_trainer.h"

namespace zerort {
namespace {

using testing::SmallModel;
using testing::TestConfig;
using testing::TrainRank;
using testing::TrainResult;

using testing::GpuOrSkip;

TrainResult CpuReference(const Config& c, int steps) {
  auto comms = comm::CreateInProcessGroup(1).value();
  auto cpu = testing::OneThreadCpuDevice();
  auto run = TrainRank(c, SmallModel(), comms[0].get(), cpu.get(), steps);
  REQUIRE(run.ok());
  return *std::move(run);
}

// TrainRank on every rank of `comms`, one thread each, each rank on a compute stream of its own
// on `dev`, as trainers sharing a GPU would be: every rank's result.
std::vector<absl::StatusOr<TrainResult>> TrainOnStreams(
    const Config& c, Device* dev, const std::vector<std::unique_ptr<comm::Communicator>>& comms,
    int steps) {
  const int world = static_cast<int>(comms.size());
  std::vector<absl::StatusOr<TrainResult>> out(world, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      auto stream = dev->CreateStream();
      if (!stream.ok()) {
        out[r] = stream.status();
        return;
      }
      out[r] = TrainRank(c, SmallModel(), comms[r].get(), dev, steps, -1, -1, *stream);
      (void)dev->Synchronize(*stream);
      dev->DestroyStream(*stream);
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

// Every rank's masters and parameters, bit for bit.
void CheckRanksEqual(const std::vector<absl::StatusOr<TrainResult>>& want,
                     const std::vector<absl::StatusOr<TrainResult>>& got) {
  REQUIRE(got.size() == want.size());
  for (size_t r = 0; r < want.size(); ++r) {
    INFO("rank " << r << ": " << got[r].status().message());
    REQUIRE(want[r].ok());
    REQUIRE(got[r].ok());
    CHECK(got[r]->master == want[r]->master);
    CHECK(got[r]->params == want[r]->params);
  }
}

TEST_CASE("EngineGpu: CUDA device + NCCL equals CPU device + in-process, stages 0-3",
          "[zero][gpu]") {
  Device* const gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  const std::unique_ptr<comm::Communicator> nccl = comm::testing::OneRankNccl();
  const int steps = 6;
  for (DType precision : {DType::kF32, DType::kBF16}) {
    for (int stage = 0; stage <= 3; ++stage) {
      for (int offload = 0; offload <= 2; ++offload) {  // none, optimizer, optimizer + params
        if ((stage == 0 && offload > 0) || (offload == 2 && stage != 3)) continue;
        Config c = TestConfig(stage, precision, /*gas=*/2, /*clip=*/0.05, offload > 0);
        if (offload == 2) c.zero.offload_param.device = OffloadDevice::kCpu;
        INFO("precision=" << static_cast<int>(precision) << " stage=" << stage
                          << " offload=" << offload);
        const TrainResult want = CpuReference(c, steps);
        auto got = TrainRank(c, SmallModel(), nccl.get(), gpu, steps);
        INFO((got.ok() ? std::string("ok") : std::string(got.status().message())));
        REQUIRE(got.ok());
        CHECK(got->master == want.master);
        CHECK(got->params == want.params);
      }
    }
  }
}

TEST_CASE("EngineGpu: two and four in-process ranks sharing one GPU equal the CPU device",
          "[zero][gpu]") {
  Device* const gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  const int steps = 5;
  for (int world : {2, 4}) {
    for (int stage = 0; stage <= 3; ++stage) {
      for (bool offload : {false, true}) {
        if (stage == 0 && offload) continue;
        const Config c = TestConfig(stage, DType::kBF16, /*gas=*/2, /*clip=*/0.05, offload);
        INFO("world=" << world << " stage=" << stage << " offload=" << offload);
        auto cpu = testing::OneThreadCpuDevice();
        auto want = TrainOnStreams(
            c, cpu.get(), comm::CreateInProcessGroup(world, {c.comm_timeout_ms}).value(), steps);
        auto got = TrainOnStreams(
            c, gpu,
            comm::CreateInProcessGroup(world, {c.comm_timeout_ms}, CudaInProcessBufferOps(0))
                .value(),
            steps);
        CheckRanksEqual(want, got);
      }
    }
  }
}

// The engine's NCCL-shaped path (collectives only enqueued, comm stream, events) with world 2
// on one GPU: the stream-ordered test group over the CUDA device, each rank on a stream of its
// own, against the CPU device with the in-process group, bit for bit.
TEST_CASE("EngineGpu: two stream-ordered ranks sharing one GPU equal the CPU device",
          "[zero][gpu]") {
  Device* const gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  const int world = 2, steps = 5;
  for (int stage = 0; stage <= 3; ++stage) {
    for (bool offload : {false, true}) {
      if (stage == 0 && offload) continue;
      const Config c = TestConfig(stage, DType::kBF16, /*gas=*/2, /*clip=*/0.05, offload);
      INFO("stage=" << stage << " offload=" << offload);
      auto cpu = testing::OneThreadCpuDevice();
      auto want = TrainOnStreams(
          c, cpu.get(), comm::CreateInProcessGroup(world, {c.comm_timeout_ms}).value(), steps);
      auto group = comm::testing::CreateStreamOrderedGroup(world, gpu, {c.comm_timeout_ms});
      INFO(group.status().message());
      REQUIRE(group.ok());
      CheckRanksEqual(want, TrainOnStreams(c, gpu, *group, steps));
    }
  }
}

// A fresh engine with the test's initial values, on `comm` and `device`.
std::unique_ptr<Engine> NewEngine(const Config& c, comm::Communicator* comm, Device* device) {
  auto e = Engine::Create(c, SmallModel(), comm, device);
  INFO(e.status().message());
  REQUIRE(e.ok());
  REQUIRE(testing::SetInitValues(**e).ok());
  return *std::move(e);
}

std::vector<float> Masters(Engine& e) {
  auto m = e.GatherMasterWeights();
  INFO(m.status().message());
  REQUIRE(m.ok());
  return *std::move(m);
}

// Checkpoints of an NCCL engine (the first GPU run found every save failing there): saved
// synchronously and asynchronously at step 3, loaded into a fresh GPU engine and into the CPU
// device, each resumed to step 6 and compared bit for bit with the uninterrupted GPU run (which
// equals the CPU device's, first case).
TEST_CASE("EngineGpu: checkpoints of an NCCL engine save, load on GPU and CPU, and resume "
          "bitwise", "[zero][gpu]") {
  Device* const gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  const std::unique_ptr<comm::Communicator> nccl = comm::testing::OneRankNccl();
  auto cpu_comms = comm::CreateInProcessGroup(1).value();
  auto cpu = testing::OneThreadCpuDevice();
  for (int stage : {2, 3}) {
    for (bool offload : {false, true}) {
      INFO("stage=" << stage << " offload=" << offload);
      const Config c = TestConfig(stage, DType::kBF16, /*gas=*/1, /*clip=*/0.05, offload);
      const std::string sync_root = testing::TempDir("gpu_ckpt_sync_");
      const std::string async_root = testing::TempDir("gpu_ckpt_async_");

      std::unique_ptr<Engine> a = NewEngine(c, nccl.get(), gpu);
      REQUIRE(testing::TrainSteps(*a, 0, 3).ok());
      absl::StatusOr<std::string> saved = SaveCheckpoint(*a, sync_root);
      INFO(saved.status().message());
      REQUIRE(saved.ok());
      AsyncCheckpointer async;
      absl::Status started = async.Start(*a, async_root);
      INFO(started.message());
      REQUIRE(started.ok());
      REQUIRE(testing::TrainSteps(*a, 3, 3).ok());  // training goes on during the save
      absl::StatusOr<std::string> finished = async.Finish();
      INFO(finished.status().message());
      REQUIRE(finished.ok());
      const std::vector<float> want = Masters(*a);
      a.reset();

      for (const std::string& root : {sync_root, async_root}) {
        INFO("loading " << root);
        std::unique_ptr<Engine> g = NewEngine(c, nccl.get(), gpu);
        absl::Status loaded = LoadCheckpoint(*g, root);
        INFO(loaded.message());
        REQUIRE(loaded.ok());
        CHECK(g->step() == 3);
        REQUIRE(testing::TrainSteps(*g, 3, 3).ok());
        CHECK(Masters(*g) == want);
      }
      std::unique_ptr<Engine> h = NewEngine(c, cpu_comms[0].get(), cpu.get());
      absl::Status loaded = LoadCheckpoint(*h, sync_root);
      INFO(loaded.message());
      REQUIRE(loaded.ok());
      REQUIRE(testing::TrainSteps(*h, 3, 3).ok());
      CHECK(Masters(*h) == want);
    }
  }
}

}  // namespace
}  // namespace zerort
