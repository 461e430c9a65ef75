#include "zero/testing/world_run.h"

#include <cerrno>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "comm/inprocess.h"
#include "comm/testing/stream_ordered.h"
#include "device/cpu_device.h"
#include "nvme/io.h"

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

absl::StatusOr<std::unique_ptr<Engine>> TrainedEngine(const Config& config,
                                                      comm::Communicator* comm, Device* device,
                                                      int steps) {
  ASSIGN_OR_RETURN(std::unique_ptr<Engine> e, Engine::Create(config, SmallModel(), comm, device));
  RETURN_IF_ERROR(SetInitValues(*e));
  RETURN_IF_ERROR(TrainSteps(*e, 0, steps));
  return e;
}

absl::Status SnapshotOf(Engine& e, std::vector<float> out[3]) {
  const size_t n = static_cast<size_t>(e.plan().shard_elements);
  for (int k = 0; k < 3; ++k) out[k].assign(n, -1.0f);
  RETURN_IF_ERROR(e.BeginSnapshot(out[0].data(), out[1].data(), out[2].data(), nullptr));
  return e.WaitSnapshot();
}

absl::Status SameSnapshots(Engine& a, Engine& b, const char* what) {
  std::vector<float> sa[3], sb[3];
  RETURN_IF_ERROR(SnapshotOf(a, sa));
  RETURN_IF_ERROR(SnapshotOf(b, sb));
  for (int k = 0; k < 3; ++k) {
    if (!BitEqual(sa[k], sb[k])) return absl::InternalError(absl::StrCat(what, ": array ", k));
  }
  return absl::OkStatus();
}

absl::Status SameMasters(Engine& a, Engine& b, const char* what) {
  ASSIGN_OR_RETURN(std::vector<float> ma, a.GatherMasterWeights());
  ASSIGN_OR_RETURN(std::vector<float> mb, b.GatherMasterWeights());
  return BitEqual(ma, mb) ? absl::OkStatus() : absl::InternalError(what);
}

NvmeWriteFault::NvmeWriteFault() {
  nvme::SetIoFaultForTesting(
      [this](nvme::IoOp op, const std::string& path, int64_t, int64_t) -> std::optional<int> {
        const int r = path.find("-rank1/") != std::string::npos ? 1 : 0;
        if (op != nvme::IoOp::kWrite || armed_[r] == 0) return std::nullopt;
        if (--armed_[r] == 0) return -EIO;
        return std::nullopt;
      });
}

NvmeWriteFault::~NvmeWriteFault() { nvme::SetIoFaultForTesting(nullptr); }

absl::Status CheckWriteFaultUndone(const Config& reference, const Config& faulty,
                                   comm::Communicator* comm, Device* device, NvmeWriteFault* fault,
                                   const std::function<absl::Status(Engine& a, Engine& b)>& also) {
  ASSIGN_OR_RETURN(std::unique_ptr<Engine> a, TrainedEngine(reference, comm, device, 2));
  ASSIGN_OR_RETURN(std::unique_ptr<Engine> b, TrainedEngine(faulty, comm, device, 2));
  const int r = comm->rank();
  fault->Arm(r, 2);
  const absl::Status failed = TrainSteps(*b, 2, 1);
  fault->Arm(r, 0);
  if (failed.ok() ||
      failed.message().find("/optimizer_state at offset ") == absl::string_view::npos ||
      failed.message().find("Input/output error") == absl::string_view::npos) {
    return absl::InternalError(
        absl::StrCat("expected an EIO naming file and offset, got ", failed.ToString()));
  }
  if (b->step() != 2) return absl::InternalError(absl::StrCat("step count ", b->step()));
  // Nothing moved: the swap file holds the state before the step, and whatever the device holds
  // is updated only after the host step succeeds.
  RETURN_IF_ERROR(SameSnapshots(*a, *b, "state after the failed step"));
  RETURN_IF_ERROR(SameMasters(*a, *b, "masters after the failed step"));
  if (also) RETURN_IF_ERROR(also(*a, *b));
  // The next attempt (the same micro-step again) continues as if nothing had failed.
  RETURN_IF_ERROR(TrainSteps(*a, 2, 2));
  RETURN_IF_ERROR(TrainSteps(*b, 2, 2));
  return SameMasters(*a, *b, "masters differ after the retried step");
}

}  // namespace testing
}  // namespace zerort
