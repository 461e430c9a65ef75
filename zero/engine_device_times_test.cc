// Engine::DeviceTimes (EngineOptions::device_timing): the optimizer step's phases on the
// device's clock. On the CPU device with asynchronous streams every operation starts
// stream_delay_us late, so each phase lasts at least (its operations) x that delay: lower bounds
// in closed form that hold however loaded the machine is (no upper bounds are asserted).
#include <memory>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "base/status.h"
#include "comm/inprocess.h"
#include "device/cpu_device.h"
#include "zero/engine.h"
#include "zero/testing/synthetic_trainer.h"

namespace zerort {
namespace {

constexpr int kDelayUs = 2000;
constexpr double kDelayMs = kDelayUs / 1000.0;

struct Rig {
  std::unique_ptr<Device> device;
  std::vector<std::unique_ptr<comm::Communicator>> comms;
  Device::Stream stream = nullptr;
  std::unique_ptr<Engine> engine;

  ~Rig() {
    engine.reset();
    if (stream != nullptr) device->DestroyStream(stream);
  }
};

// World 1 on an asynchronous CPU device, the engine on a created stream (so its work runs on the
// stream's thread, after the host has enqueued it, as on a GPU).
std::unique_ptr<Rig> MakeRig(const Config& config, bool device_timing) {
  auto rig = std::make_unique<Rig>();
  CpuDeviceOptions o;
  o.threads = 1;
  o.async_streams = true;
  o.stream_delay_us = kDelayUs;
  rig->device = CreateCpuDevice(o);
  rig->comms = comm::CreateInProcessGroup(1, {config.comm_timeout_ms}).value();
  rig->stream = rig->device->CreateStream().value();
  EngineOptions options;
  options.compute_stream = rig->stream;
  options.device_timing = device_timing;
  auto engine = Engine::Create(config, testing::SmallModel(), rig->comms[0].get(),
                               rig->device.get(), options);
  INFO(engine.status().message());
  REQUIRE(engine.ok());
  rig->engine = *std::move(engine);
  REQUIRE(testing::SetInitValues(*rig->engine).ok());
  return rig;
}

absl::StatusOr<StepStats> OneStep(Engine& e, int step) {
  std::vector<std::vector<char>> host;
  RETURN_IF_ERROR(testing::Backward(e, step, 0, &host));
  ASSIGN_OR_RETURN(StepStats stats, e.Step());
  RETURN_IF_ERROR(e.device()->Synchronize(e.compute_stream()));  // `host` is read until here
  return stats;
}

TEST_CASE("DeviceTimes: each phase lasts at least its operations' injected delays", "[zero]") {
  for (const bool offload : {false, true}) {
    for (const int stage : {0, 2, 3}) {
      if (offload && stage == 0) continue;
      INFO("stage " << stage << " offload " << offload);
      const Config config = testing::TestConfig(stage, DType::kBF16, 1, 0.0, offload);
      std::unique_ptr<Rig> rig = MakeRig(config, /*device_timing=*/true);
      Engine& e = *rig->engine;

      absl::StatusOr<DeviceStepTimes> none = e.DeviceTimes();
      CHECK(absl::IsFailedPrecondition(none.status()));
      CHECK(absl::StrContains(none.status().message(), "no optimizer step"));

      const int units = static_cast<int>(e.plan().units.size());
      REQUIRE(units >= 3);
      for (int step = 0; step < 2; ++step) {
        absl::StatusOr<StepStats> stats = OneStep(e, step);
        INFO(stats.status().message());
        REQUIRE(stats.ok());
        absl::StatusOr<DeviceStepTimes> t = e.DeviceTimes();
        INFO(t.status().message());
        REQUIRE(t.ok());
        INFO("norm " << t->norm_ms << " update " << t->update_ms << " gather " << t->gather_ms
                     << " total " << t->total_ms << " ms, " << units << " units");
        CHECK(t->step == stats->step);
        // Per unit at least a finite check and a squared norm, each one delayed operation.
        // With optimizer offload they ran in backward, on the comm side, before each shard left
        // for host memory (gradient offload): the step's norm phase has no device work left.
        if (!offload) CHECK(t->norm_ms >= 2 * units * kDelayMs);
        CHECK(t->norm_ms >= 0);
        // On the device, AdamW: one delayed call per unit, all on the compute stream between the
        // phase's events. Offloaded, the uploads run on the pipeline's own stream, which may
        // start them before the compute stream's thread records the phase's first event (a
        // busy machine delays that thread, not the other): only the compute stream's own
        // delayed operations after that event bound it, at least the closing record.
        CHECK(t->update_ms >= (offload ? 1 : units) * kDelayMs);
        CHECK(t->gather_ms >= 0);
        // The phases follow each other on the compute stream.
        CHECK(t->total_ms >= t->norm_ms + t->update_ms - 1e-6);
        CHECK(t->total_ms >= t->norm_ms + t->update_ms + t->gather_ms - 1e-6);
      }
    }
  }
}

TEST_CASE("DeviceTimes: a skipped step reports its norm and no update", "[zero]") {
  const Config config = testing::TestConfig(2, DType::kBF16, 1, 0.0, false);
  std::unique_ptr<Rig> rig = MakeRig(config, /*device_timing=*/true);
  Engine& e = *rig->engine;
  REQUIRE(OneStep(e, 0).ok());
  std::vector<std::vector<char>> host;
  REQUIRE(testing::Backward(e, 1, 0, &host).ok());
  REQUIRE(e.ComputeGradNorm().ok());
  absl::StatusOr<StepStats> skipped = e.SkipStep();
  REQUIRE(skipped.ok());
  REQUIRE(e.device()->Synchronize(e.compute_stream()).ok());
  absl::StatusOr<DeviceStepTimes> t = e.DeviceTimes();
  INFO(t.status().message());
  REQUIRE(t.ok());
  CHECK(skipped->skipped);
  CHECK(t->step == skipped->step);
  CHECK(t->step == 1);  // the skipped window did not advance AdamW's t
  CHECK(t->norm_ms >= 2 * static_cast<double>(e.plan().units.size()) * kDelayMs);
  CHECK(t->update_ms >= 0);
  CHECK(t->total_ms >= t->norm_ms - 1e-6);
}

TEST_CASE("DeviceTimes: without device_timing it is refused, naming the option", "[zero]") {
  const Config config = testing::TestConfig(1, DType::kBF16, 1, 0.0, false);
  std::unique_ptr<Rig> rig = MakeRig(config, /*device_timing=*/false);
  REQUIRE(OneStep(*rig->engine, 0).ok());
  absl::StatusOr<DeviceStepTimes> t = rig->engine->DeviceTimes();
  CHECK(absl::IsFailedPrecondition(t.status()));
  CHECK(absl::StrContains(t.status().message(), "device_timing"));
}

TEST_CASE("CpuDevice: ElapsedMs between timing events follows the stream's delays", "[zero]") {
  CpuDeviceOptions o;
  o.async_streams = true;
  o.stream_delay_us = kDelayUs;
  std::unique_ptr<Device> device = CreateCpuDevice(o);
  Device::Stream s = device->CreateStream().value();
  Device::Event a = device->CreateTimingEvent().value();
  Device::Event b = device->CreateTimingEvent().value();
  CHECK(absl::IsFailedPrecondition(device->ElapsedMs(a, b).status()));  // never recorded
  std::vector<float> x(16, 1.0f);
  REQUIRE(device->Record(a, s).ok());
  for (int i = 0; i < 3; ++i) REQUIRE(device->Zero(x.data(), x.size() * sizeof(float), s).ok());
  REQUIRE(device->Record(b, s).ok());
  REQUIRE(device->WaitHost(b).ok());
  absl::StatusOr<double> ms = device->ElapsedMs(a, b);
  REQUIRE(ms.ok());
  CHECK(*ms >= 3 * kDelayMs);
  absl::StatusOr<double> back = device->ElapsedMs(b, a);
  REQUIRE(back.ok());
  CHECK(*back == -*ms);
  device->DestroyEvent(a);
  device->DestroyEvent(b);
  device->DestroyStream(s);
}

}  // namespace
}  // namespace zerort
