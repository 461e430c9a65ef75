// The gradient hand-off declared before the plan on one GPU: the trainer's buffer in device
// memory, reduced in place by the CUDA device's kernels with NCCL (world 1), with 2 in-process
// ranks sharing the GPU (CudaInProcessBufferOps), and with 2 stream-ordered ranks on it (the
// padding's zero-fill on the comm stream), each rank on a compute stream of its own: fp32
// masters bit for bit those of the CPU device through grad(i). Without a GPU it prints
// "SKIPPED: no CUDA device: <reason>" and passes.
#include <memory>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "comm/inprocess.h"
#include "comm/testing/one_rank_nccl.h"
#include "comm/testing/stream_ordered.h"
#include "device/cuda_device.h"
#include "device/testing/gpu_or_skip.h"
#include "device/testing/one_thread.h"
#include "zero/testing/handoff_trainer.h"
#include "zero/testing/synthetic_trainer.h"

namespace zerort {
namespace {

using testing::GpuOrSkip;
using testing::HandoffRun;
using testing::TrainHandoffRank;

// Every rank of `comms` on a thread and a compute stream of its own.
std::vector<HandoffRun> Train(const Config& c, bool declared, bool forward_order, Device* dev,
                              const std::vector<std::unique_ptr<comm::Communicator>>& comms) {
  const int world = static_cast<int>(comms.size());
  std::vector<absl::StatusOr<HandoffRun>> runs(world, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      Device::Stream s = dev->CreateStream().value();
      runs[r] = TrainHandoffRank(c, declared, forward_order, comms[r].get(), dev, 3, s);
      (void)dev->Synchronize(s);
      dev->DestroyStream(s);
    });
  }
  for (auto& t : threads) t.join();
  std::vector<HandoffRun> out;
  for (int r = 0; r < world; ++r) {
    INFO("rank " << r << ": " << runs[r].status().message());
    REQUIRE(runs[r].ok());
    out.push_back(*std::move(runs[r]));
  }
  return out;
}

TEST_CASE("EngineGpu: trainer gradients reduced in place in device memory equal the CPU "
          "device's, stages 0-3",
          "[zero][gpu]") {
  Device* const gpu = GpuOrSkip();
  if (gpu == nullptr) return;
  std::vector<std::unique_ptr<comm::Communicator>> one;
  one.push_back(comm::testing::OneRankNccl());
  for (int stage = 0; stage <= 3; ++stage) {
    for (int gas : {1, 2}) {
      Config c = testing::TestConfig(stage, DType::kBF16, gas, /*clip=*/0.05, false);
      c.zero.reduce_bucket_size = kAutoSize;
      auto cpu = testing::OneThreadCpuDevice();
      for (int world : {1, 2}) {
        for (int kind = 0; kind < 2; ++kind) {  // in-process buffer ops, stream-ordered group
          if (world == 1 && kind == 1) continue;
          CAPTURE(stage, gas, world, kind);
          const std::vector<HandoffRun> want = Train(
              c, false, false, cpu.get(),
              comm::CreateInProcessGroup(world, {c.comm_timeout_ms}).value());
          std::vector<std::unique_ptr<comm::Communicator>> group;
          if (world == 1) {
            group = std::move(one);
          } else if (kind == 0) {
            group = comm::CreateInProcessGroup(world, {c.comm_timeout_ms},
                                               CudaInProcessBufferOps(0))
                        .value();
          } else {
            group = comm::testing::CreateStreamOrderedGroup(world, gpu, {c.comm_timeout_ms})
                        .value();
          }
          for (bool forward : {false, true}) {
            const std::vector<HandoffRun> got = Train(c, true, forward, gpu, group);
            for (int r = 0; r < world; ++r) {
              CHECK(got[r].master == want[r].master);
              CHECK(got[r].in_place > 0);
              for (int k = 0; k < memory::kNumMemoryKinds; ++k) {
                CHECK(got[r].report.allocated[k] == got[r].report.planned[k]);
              }
            }
          }
          if (world == 1) one = std::move(group);
        }
      }
    }
  }
}

}  // namespace
}  // namespace zerort
