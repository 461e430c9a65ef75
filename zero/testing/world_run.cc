#include "zero/testing/world_run.h"

#include <catch2/catch.hpp>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "comm/inprocess.h"
#include "comm/testing/stream_ordered.h"
#include "device/cpu_device.h"

namespace zerort {
namespace testing {

WorldOptions StreamOrderedWorld() {
  WorldOptions o;
  o.async_streams = o.rank_streams = o.stream_ordered = true;
  return o;
}

WorldRun RunWorld(int world, const WorldOptions& options, const RankBody& body) {
  CpuDeviceOptions device_options;
  device_options.threads = 1;
  device_options.async_streams = options.async_streams;
  device_options.stream_delay_us = options.async_streams ? 200 : 0;
  std::unique_ptr<Device> device = CreateCpuDevice(device_options);
  comm::CommOptions co;
  co.timeout_ms = options.timeout_ms;
  absl::StatusOr<std::vector<std::unique_ptr<comm::Communicator>>> comms =
      options.stream_ordered ? comm::testing::CreateStreamOrderedGroup(world, device.get(), co)
                             : comm::CreateInProcessGroup(world, co);
  WorldRun run;
  run.ranks.resize(world);
  run.errors.assign(world, comms.status());
  if (!comms.ok()) return run;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      Device::Stream stream = nullptr;
      if (options.rank_streams) {
        absl::StatusOr<Device::Stream> s = device->CreateStream();
        if (!s.ok()) {
          run.errors[r] = s.status();
          return;
        }
        stream = *s;
      }
      absl::StatusOr<TrainResult> result = body(r, (*comms)[r].get(), device.get(), stream);
      if (stream != nullptr) device->DestroyStream(stream);
      if (!result.ok()) {
        run.errors[r] = result.status();
      } else {
        run.ranks[r] = *std::move(result);
      }
    });
  }
  for (auto& t : threads) t.join();
  return run;
}

WorldRun TrainWorld(const Config& config, const std::vector<memory::ParamSpec>& specs, int world,
                    int steps, WorldOptions options, int inject_step, int inject_rank) {
  options.timeout_ms = config.comm_timeout_ms;
  return RunWorld(
      world, options, [&](int, comm::Communicator* comm, Device* device, Device::Stream stream) {
        return TrainRank(config, specs, comm, device, steps, inject_step, inject_rank, stream);
      });
}

void RequireOk(const WorldRun& run) {
  for (size_t r = 0; r < run.errors.size(); ++r) {
    INFO("rank " << r << ": " << run.errors[r].ToString());
    REQUIRE(run.errors[r].ok());
  }
}

void CheckAllOk(const std::vector<absl::Status>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) {
    INFO("rank " << r << ": " << errors[r].ToString());
    CHECK(errors[r].ok());
  }
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace testing
}  // namespace zerort
