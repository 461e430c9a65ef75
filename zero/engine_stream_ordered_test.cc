// The engine over a stream-ordered communicator (comm/testing/stream_ordered.h: NCCL's
// completion model on the CPU device's delayed asynchronous streams) trains bit for bit as over
// the in-process group: every collective input is ordered before its collective and every
// result read after it, through the engine's events alone.
#include <memory>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "comm/agree.h"
#include "comm/testing/stream_ordered.h"
#include "device/testing/one_thread.h"
#include "zero/engine.h"
#include "zero/testing/synthetic_trainer.h"

namespace zerort {
namespace {

// TrainRank on every rank of a stream-ordered group over `device`, each rank on a compute
// stream of its own (or the calling thread's, nullptr, when !own_stream).
absl::StatusOr<std::vector<testing::TrainResult>> TrainStreamOrdered(const Config& config,
                                                                     int world, Device* device,
                                                                     int steps,
                                                                     bool own_stream) {
  ASSIGN_OR_RETURN(auto comms, comm::testing::CreateStreamOrderedGroup(
                                   world, device, {config.comm_timeout_ms}));
  std::vector<absl::StatusOr<testing::TrainResult>> runs(world, absl::UnknownError(""));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      Device::Stream s = nullptr;
      if (own_stream) s = device->CreateStream().value();
      runs[r] = testing::TrainRank(config, testing::SmallModel(), comms[r].get(), device, steps,
                                   -1, -1, s);
      if (s != nullptr) {
        (void)device->Synchronize(s);
        device->DestroyStream(s);
      }
    });
  }
  for (auto& t : threads) t.join();
  std::vector<testing::TrainResult> out;
  for (int r = 0; r < world; ++r) {
    if (!runs[r].ok()) {
      return absl::Status(runs[r].status().code(),
                          absl::StrCat("rank ", r, ": ", runs[r].status().message()));
    }
    out.push_back(*std::move(runs[r]));
  }
  return out;
}

TEST_CASE("Engine: over a stream-ordered communicator on delayed streams, stages 0-3 train "
          "bit-identically to the in-process group",
          "[engine][stream_ordered]") {
  auto inline_dev = testing::OneThreadCpuDevice();
  auto async_dev = testing::AsyncOneThreadCpuDevice(200);
  for (int stage = 0; stage <= 3; ++stage) {
    for (DType precision : {DType::kBF16, DType::kF32}) {
      const int gas = precision == DType::kBF16 ? 2 : 1;
      const Config config = testing::TestConfig(stage, precision, gas, 1.0, false);
      INFO("stage " << stage << " " << DTypeName(precision) << " gas " << gas);
      auto want = testing::TrainRanks(config, testing::SmallModel(), 2, inline_dev.get(), 4);
      REQUIRE(want.ok());
      for (bool own_stream : {true, false}) {
        INFO("compute stream: " << (own_stream ? "asynchronous" : "the calling thread"));
        auto got = TrainStreamOrdered(config, 2, async_dev.get(), 4, own_stream);
        INFO(got.status().ToString());
        REQUIRE(got.ok());
        for (int r = 0; r < 2; ++r) {
          REQUIRE((*got)[r].master == (*want)[r].master);
          REQUIRE((*got)[r].params == (*want)[r].params);
        }
      }
    }
  }
}

TEST_CASE("Engine: gradient offload over a stream-ordered communicator matches the device "
          "optimizer over the in-process group bit for bit",
          "[engine][stream_ordered][offload]") {
  // The copies of the reduced shards to host memory run on the comm stream, NCCL's place: the
  // step's reads of them (norm, host AdamW) and the bucket reuse wait for them through events.
  auto inline_dev = testing::OneThreadCpuDevice();
  auto async_dev = testing::AsyncOneThreadCpuDevice(200);
  for (int stage = 1; stage <= 3; ++stage) {
    for (DType precision : {DType::kBF16, DType::kF32}) {
      for (int gas : {1, 2}) {
        INFO("stage " << stage << " " << DTypeName(precision) << " gas " << gas);
        Config config = testing::TestConfig(stage, precision, gas, 1.0, false);
        auto want = testing::TrainRanks(config, testing::SmallModel(), 2, inline_dev.get(), 4);
        REQUIRE(want.ok());
        config.zero.offload_optimizer.device = OffloadDevice::kCpu;
        auto got = TrainStreamOrdered(config, 2, async_dev.get(), 4, /*own_stream=*/true);
        INFO(got.status().ToString());
        REQUIRE(got.ok());
        for (int r = 0; r < 2; ++r) {
          REQUIRE((*got)[r].master == (*want)[r].master);
          REQUIRE((*got)[r].params == (*want)[r].params);
        }
      }
    }
  }
}

// The engine records events on the trainer's stream (a stage-3 Release records its slot's
// event there), and may be destroyed before that stream gets to them: the records still run
// afterwards, on no freed event. Before the CPU device kept a destroyed event alive for its
// queued records, this crashed ("Mutex corrupt", a segfault or a hang) on every run, and the
// training test above crashed under load.
TEST_CASE("Engine: destroyed while the trainer's stream has not yet reached the records of "
          "its stage-3 Releases",
          "[engine][stream_ordered]") {
  // Every operation on a stream starts 20 ms late: the records are still queued at the reset.
  auto device = testing::AsyncOneThreadCpuDevice(20000);
  auto comms = comm::testing::CreateStreamOrderedGroup(2, device.get());
  REQUIRE(comms.ok());
  const Config config = testing::TestConfig(3, DType::kBF16, 1, 0, false);
  std::vector<absl::Status> status(2);
  std::vector<int> gathered(2, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Device::Stream s = device->CreateStream().value();
      status[r] = [&]() -> absl::Status {
        EngineOptions options;
        options.compute_stream = s;
        ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                         Engine::Create(config, testing::SmallModel(), (*comms)[r].get(),
                                        device.get(), options));
        float from = 1, to = 0;  // the trainer's own work, on its stream, in its own memory
        for (int u = 0; u < engine->num_units(); ++u) {
          if (!engine->plan().units[u].persistent) ++gathered[r];
          RETURN_IF_ERROR(engine->Gather(u));
          RETURN_IF_ERROR(device->Copy(&to, &from, sizeof(float), s));
          RETURN_IF_ERROR(engine->Release(u));  // its record waits behind the copy
        }
        engine.reset();
        return device->Synchronize(s);  // runs the records of the destroyed engine's events
      }();
      (void)device->Synchronize(s);
      device->DestroyStream(s);
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    INFO(status[r].ToString());
    CHECK(status[r].ok());
    CHECK(gathered[r] > 0);
  }
}

TEST_CASE("Engine: its host exchange stages through device memory where DirectHostExchange "
          "fails, and outlives the engine",
          "[engine][stream_ordered]") {
  auto device = testing::AsyncOneThreadCpuDevice(200);
  auto comms = comm::testing::CreateStreamOrderedGroup(2, device.get());
  REQUIRE(comms.ok());
  const Config config = testing::TestConfig(2, DType::kBF16, 1, 0, false);
  std::vector<absl::Status> direct(2), staged(2);
  std::vector<std::vector<uint64_t>> got(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      auto e = Engine::Create(config, testing::SmallModel(), (*comms)[r].get(), device.get());
      if (!e.ok()) {
        staged[r] = e.status();
        return;
      }
      comm::DirectHostExchange direct_ex((*comms)[r].get());
      direct[r] = comm::AllGatherU64(direct_ex, {uint64_t{1}}).status();
      std::unique_ptr<comm::HostExchange> ex = (*e)->NewHostExchange();
      e->reset();
      auto all = comm::AllGatherU64(*ex, {uint64_t{100} + r, ~uint64_t{0} - r});
      staged[r] = all.status();
      if (all.ok()) got[r] = *all;
    });
  }
  for (auto& t : threads) t.join();
  const std::vector<uint64_t> want = {100, ~uint64_t{0}, 101, ~uint64_t{0} - 1};
  for (int r = 0; r < 2; ++r) {
    INFO(staged[r].ToString());
    REQUIRE(staged[r].ok());
    REQUIRE(direct[r].code() == absl::StatusCode::kFailedPrecondition);
    REQUIRE(got[r] == want);
  }
}

}  // namespace
}  // namespace zerort
