#include "zero/engine.h"

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "base/testing/temp_dir.h"
#include "comm/inprocess.h"
#include "comm/testing/on_ranks.h"
#include "device/cpu_device.h"
#include "device/testing/one_thread.h"
#include "nvme/io.h"
#include "zero/planner.h"
#include "zero/testing/synthetic_trainer.h"
#include "zero/testing/world_run.h"

namespace zerort {
namespace {

using memory::ParamSpec;

using testing::BitEqual;
using testing::CheckAllOk;
using testing::GradValue;
using testing::RequireOk;
using testing::SameMasters;
using testing::SameSnapshots;
using testing::SmallModel;
using testing::SnapshotOf;
using testing::TrainedEngine;
using testing::WorldRun;

Config MakeConfig(int stage, DType precision, int gas, double clip, bool offload) {
  return testing::TestConfig(stage, precision, gas, clip, offload);
}

// Trains `steps` optimizer steps on `world` in-process ranks (one thread each).
// `async_streams`: the CPU device runs its streams on threads, as a GPU would; with
// `on_compute_stream`, each rank's engine and trainer work on a stream of their own.
WorldRun Train(const Config& config, int world, int steps, int inject_step = -1,
               int inject_rank = -1, const std::vector<ParamSpec>& specs = SmallModel(),
               bool async_streams = false, bool on_compute_stream = false) {
  testing::WorldOptions o;
  o.async_streams = async_streams;
  o.rank_streams = on_compute_stream;
  return testing::TrainWorld(config, specs, world, steps, o, inject_step, inject_rank);
}

TEST_CASE("Engine: stages 0-3, with and without offload, give bit-identical fp32 masters",
          "[zero]") {
  const int steps = 50;
  for (DType precision : {DType::kF32, DType::kBF16}) {
    for (int world : {1, 2, 3, 4}) {
      for (int gas : {1, 3}) {
        for (double clip : {0.0, 0.05}) {
          WorldRun reference = Train(MakeConfig(0, precision, gas, clip, false), world, steps);
          RequireOk(reference);
          for (int stage = 0; stage <= 3; ++stage) {
            for (bool offload : {false, true}) {
              if (stage == 0 && offload) continue;
              if (stage == 0 && !offload) continue;  // that is the reference
              INFO("precision=" << static_cast<int>(precision) << " world=" << world
                                << " gas=" << gas << " clip=" << clip << " stage=" << stage
                                << " offload=" << offload);
              WorldRun run = Train(MakeConfig(stage, precision, gas, clip, offload), world, steps);
              RequireOk(run);
              for (int r = 0; r < world; ++r) {
                CHECK(BitEqual(run.ranks[r].master, reference.ranks[0].master));
                CHECK(run.ranks[r].params == reference.ranks[0].params);
              }
              if (clip > 0) {
                // Clipping really engaged at least once (the test would be vacuous otherwise).
                bool clipped = false;
                for (const StepStats& s : run.ranks[0].stats) clipped = clipped || s.clip_coef < 1;
                CHECK(clipped);
              }
            }
          }
          for (int r = 1; r < world; ++r)
            CHECK(BitEqual(reference.ranks[r].master, reference.ranks[0].master));
        }
      }
    }
  }
}

TEST_CASE("Engine: the offload pipeline on asynchronous streams matches stage 0 bit for bit",
          "[zero][offload]") {
  // Streams on threads make every copy race the host AdamW and the all-gathers unless the
  // pipeline's events order them; one chunk forces every reuse hazard, more chunks overlap.
  const int steps = 12;
  for (int world : {1, 3}) {
    WorldRun reference = Train(MakeConfig(0, DType::kBF16, 1, 0.05, false), world, steps);
    RequireOk(reference);
    for (int stage = 1; stage <= 3; ++stage) {
      for (int chunks : {1, 2, 4}) {
        for (bool offload_param : {false, true}) {
          if (offload_param && stage != 3) continue;
          Config c = MakeConfig(stage, DType::kBF16, 1, 0.05, true);
          c.zero.offload_optimizer.buffer_count = chunks;
          if (offload_param) c.zero.offload_param.device = OffloadDevice::kCpu;
          INFO("world=" << world << " stage=" << stage << " chunks=" << chunks
                        << " offload_param=" << offload_param);
          WorldRun run = Train(c, world, steps, -1, -1, SmallModel(), /*async_streams=*/true);
          RequireOk(run);
          for (int r = 0; r < world; ++r) {
            CHECK(BitEqual(run.ranks[r].master, reference.ranks[0].master));
            // The uploads and all-gathers of the new parameters are ordered too.
            CHECK(run.ranks[r].params == reference.ranks[0].params);
          }
          if (offload_param)
            CHECK(run.ranks[0].report.planned[static_cast<int>(memory::MemoryKind::kPinnedHost)] >
                  0);
        }
      }
    }
  }
}

// Device bytes of the reduced gradients in `plan`: the stage 2-3 shard, a stage-1 accumulator.
int64_t ReducedGradDeviceBytes(const memory::Plan& plan) {
  int64_t bytes = 0;
  for (const memory::Buffer& b : plan.buffers) {
    const bool reduced = (b.cls == memory::BufferClass::kGrads && plan.options.stage >= 2) ||
                         b.cls == memory::BufferClass::kGradAccumulator;
    if (reduced && b.kind == memory::MemoryKind::kDevice) bytes += b.bytes;
  }
  return bytes;
}

TEST_CASE("Engine: gradient offload gives bit-identical masters, on asynchronous streams",
          "[zero][offload]") {
  // With optimizer offload every reduced shard is copied to host memory as its reduction
  // completes (accumulating on the device through one unit's stage) and measured for the norm
  // on the device before it leaves. Streams on threads with a 200 us delay (the engine and the
  // trainer on a stream of their own: the null stream runs inline) make every copy race the
  // next reduction, the bucket's reuse, the accumulation and the host AdamW unless the stream
  // order holds. The reference is stage 0 on the device, run synchronously.
  const int steps = 6;
  const double clip = 0.05;
  for (DType precision : {DType::kF32, DType::kBF16}) {
    for (int world : {1, 2, 3, 4}) {
      for (int gas : {1, 2}) {
        WorldRun reference = Train(MakeConfig(0, precision, gas, clip, false), world, steps);
        RequireOk(reference);
        for (int stage = 1; stage <= 3; ++stage) {
          INFO("precision=" << DTypeName(precision) << " world=" << world << " gas=" << gas
                            << " stage=" << stage);
          const Config c = MakeConfig(stage, precision, gas, clip, true);
          WorldRun run = Train(c, world, steps, -1, -1, SmallModel(), /*async_streams=*/true,
                               /*on_compute_stream=*/true);
          RequireOk(run);
          for (int r = 0; r < world; ++r) {
            CHECK(BitEqual(run.ranks[r].master, reference.ranks[0].master));
            CHECK(run.ranks[r].params == reference.ranks[0].params);
          }
          bool clipped = false;
          for (const StepStats& st : run.ranks[0].stats) clipped = clipped || st.clip_coef < 1;
          CHECK(clipped);
          for (int k = 0; k < memory::kNumMemoryKinds; ++k) {
            CHECK(run.ranks[0].report.allocated[k] == run.ranks[0].report.planned[k]);
          }
          // The plan says where the shard went: no reduced gradient in device memory.
          auto offloaded = ChoosePlan(SmallModel(), c, world, 0);
          auto on_device =
              ChoosePlan(SmallModel(), MakeConfig(stage, precision, gas, clip, false), world, 0);
          REQUIRE(offloaded.ok());
          REQUIRE(on_device.ok());
          CHECK(ReducedGradDeviceBytes(offloaded->plan) == 0);
          CHECK(offloaded->plan.device_bytes() < on_device->plan.device_bytes());
        }
      }
    }
  }
}

TEST_CASE(
    "Engine: gradient offload with fp32 accumulation, an fp32 wire or local accumulation "
    "matches the device optimizer bit for bit",
    "[zero][offload]") {
  const int steps = 6;
  for (int world : {1, 3}) {
    for (int gas : {1, 2}) {
      for (int variant = 0; variant < 4; ++variant) {
        for (int stage = 1; stage <= 3; ++stage) {
          if (variant == 3 && (stage != 1 || gas == 1)) continue;  // stages 0-1, GAS > 1
          INFO("world=" << world << " gas=" << gas << " stage=" << stage << " variant=" << variant);
          Config c = MakeConfig(stage, DType::kBF16, gas, 0.05, false);
          if (variant == 0 || variant == 2) c.grad_accum_dtype = DType::kF32;
          if (variant == 1 || variant == 2) c.communication_dtype = DType::kF32;
          if (variant == 3) c.local_grad_accumulation = true;
          WorldRun reference = Train(c, world, steps);
          RequireOk(reference);
          c.zero.offload_optimizer.device = OffloadDevice::kCpu;
          WorldRun run = Train(c, world, steps, -1, -1, SmallModel(), /*async_streams=*/true,
                               /*on_compute_stream=*/true);
          RequireOk(run);
          for (int r = 0; r < world; ++r) {
            CHECK(BitEqual(run.ranks[r].master, reference.ranks[r].master));
            CHECK(run.ranks[r].params == reference.ranks[r].params);
          }
          for (int k = 0; k < memory::kNumMemoryKinds; ++k) {
            CHECK(run.ranks[0].report.allocated[k] == run.ranks[0].report.planned[k]);
          }
        }
      }
    }
  }
}

// NVMe offload on the test's temporary directory (the machine's disk); null when the config
// layer does not accept "nvme" yet.
bool NvmeConfig(Config* c, int chunks) {
  c->zero.offload_optimizer.device = OffloadDevice::kNvme;
  c->zero.offload_optimizer.nvme_path = testing::TestTmpDir();
  c->zero.offload_optimizer.buffer_count = chunks;
  c->aio.block_size = 8192;  // several requests per unit, queue depth 2: every slot rotates
  c->aio.queue_depth = 2;
  c->aio.thread_count = 2;
  const absl::Status valid = ValidateConfig(*c);
  if (valid.code() == absl::StatusCode::kUnimplemented) {
    WARN("NVMe offload not checked: the config layer refuses it: " << valid.ToString());
    return false;
  }
  REQUIRE(valid.ok());
  return true;
}

TEST_CASE("Engine: NVMe offload matches stage 0 and CPU offload bit for bit", "[zero][nvme]") {
  const int steps = 8;
  for (int world : {1, 3}) {
    WorldRun reference = Train(MakeConfig(0, DType::kBF16, 1, 0.05, false), world, steps);
    RequireOk(reference);
    for (int stage = 1; stage <= 3; ++stage) {
      for (int chunks : {1, 3}) {
        Config c = MakeConfig(stage, DType::kBF16, 1, 0.05, true);
        if (!NvmeConfig(&c, chunks)) return;
        INFO("world=" << world << " stage=" << stage << " chunks=" << chunks);
        WorldRun run = Train(c, world, steps, -1, -1, SmallModel(), /*async_streams=*/true);
        RequireOk(run);
        for (int r = 0; r < world; ++r) {
          CHECK(BitEqual(run.ranks[r].master, reference.ranks[0].master));
          CHECK(run.ranks[r].params == reference.ranks[0].params);
        }
        const int nvme = static_cast<int>(memory::MemoryKind::kNvme);
        CHECK(run.ranks[0].report.planned[nvme] > 0);
        CHECK(run.ranks[0].report.allocated[nvme] == run.ranks[0].report.planned[nvme]);
      }
    }
  }
}

// The compute-dtype parameters (stages 0-2: every rank holds all of them), byte for byte.
absl::Status SameParams(Engine& a, Engine& b, const char* what) {
  for (int i = 0; i < a.num_params(); ++i) {
    const size_t bytes = a.plan().params[i].numel * DTypeSize(a.config().compute_dtype);
    ASSIGN_OR_RETURN(void* pa, a.param(i));
    ASSIGN_OR_RETURN(void* pb, b.param(i));
    if (std::memcmp(pa, pb, bytes) != 0) {
      return absl::InternalError(absl::StrCat(what, ": parameter ", i));
    }
  }
  return absl::OkStatus();
}

// One rank's check: NVMe-resident state is saved (BeginSnapshot) and restored
// (RestoreOwnedState) like host state, and training resumes bit-identically.
absl::Status SnapshotAndResume(const Config& cpu, const Config& nvme, comm::Communicator* comm,
                               Device* dev) {
  ASSIGN_OR_RETURN(auto a, TrainedEngine(cpu, comm, dev, 3));
  ASSIGN_OR_RETURN(auto b, TrainedEngine(nvme, comm, dev, 3));
  RETURN_IF_ERROR(SameSnapshots(*a, *b, "snapshot"));
  // A fresh NVMe engine restored from the CPU engine's snapshot continues as that engine does.
  std::vector<float> sa[3];
  RETURN_IF_ERROR(SnapshotOf(*a, sa));
  ASSIGN_OR_RETURN(auto c, TrainedEngine(nvme, comm, dev, 0));
  RETURN_IF_ERROR(c->RestoreOwnedState(sa[0], sa[1], sa[2], a->state()));
  b.reset();
  RETURN_IF_ERROR(testing::TrainSteps(*a, 3, 3));
  RETURN_IF_ERROR(testing::TrainSteps(*c, 3, 3));
  RETURN_IF_ERROR(SameMasters(*a, *c, "masters differ after resume"));
  if (c->step() != 6) return absl::InternalError("step count not restored");
  return absl::OkStatus();
}

TEST_CASE("Engine: NVMe-resident state is snapshotted and restored like host state",
          "[zero][nvme]") {
  const int world = 2;
  Config cpu = MakeConfig(2, DType::kBF16, 1, 0.05, true);
  Config nvme = cpu;
  if (!NvmeConfig(&nvme, 2)) return;
  auto device = testing::OneThreadCpuDevice();
  CheckAllOk(comm::testing::OnRanks(world, {cpu.comm_timeout_ms}, [&](int, comm::Communicator* c) {
    return SnapshotAndResume(cpu, nvme, c, device.get());
  }));
}

TEST_CASE("Engine: an NVMe write error mid-step names the file and leaves the previous state",
          "[zero][nvme]") {
  const int world = 2;
  Config cpu = MakeConfig(2, DType::kBF16, 1, 0.05, true);
  Config nvme = cpu;
  if (!NvmeConfig(&nvme, 2)) return;
  testing::NvmeWriteFault fault;  // installed until the end of the case
  auto device = CreateCpuDevice(CpuDeviceOptions());
  const std::vector<absl::Status> errors =
      comm::testing::OnRanks(world, {cpu.comm_timeout_ms}, [&](int, comm::Communicator* c) {
        // The parameters the next forward reads are re-derived after the failure.
        auto same_params = [](Engine& a, Engine& b) {
          return SameParams(a, b, "parameters half-updated");
        };
        return testing::CheckWriteFaultUndone(cpu, nvme, c, device.get(), &fault, same_params);
      });
  CheckAllOk(errors);
}

// Runs `body` on `world` in-process ranks (one thread each, one CPU device) and checks that
// every rank returned OK.
void CheckOnRanks(int world,
                  const std::function<absl::Status(comm::Communicator*, Device*)>& body) {
  auto device = CreateCpuDevice(CpuDeviceOptions());
  CheckAllOk(comm::testing::OnRanks(
      world, {20000}, [&](int, comm::Communicator* c) { return body(c, device.get()); }));
}

// Stage 3 with the parameter shard on NVMe (the test's temporary directory), optimizer state
// in host memory (`optimizer_nvme` false) or on NVMe too.
Config NvmeParamConfig(bool optimizer_nvme, int buffers) {
  Config c = MakeConfig(3, DType::kBF16, 1, 0.05, true);
  if (optimizer_nvme) REQUIRE(NvmeConfig(&c, 2));
  c.zero.offload_param.device = OffloadDevice::kNvme;
  c.zero.offload_param.nvme_path = testing::TestTmpDir();
  c.zero.offload_param.buffer_count = buffers;
  c.aio.block_size = 8192;
  c.aio.queue_depth = 2;
  REQUIRE(ValidateConfig(c).ok());
  return c;
}

TEST_CASE("Engine: NVMe parameter offload matches stage 0 and CPU parameter offload bit for bit",
          "[zero][nvme]") {
  const int steps = 8;
  for (int world : {1, 3}) {
    WorldRun reference = Train(MakeConfig(0, DType::kBF16, 1, 0.05, false), world, steps);
    RequireOk(reference);
    Config cpu_param = MakeConfig(3, DType::kBF16, 1, 0.05, true);
    cpu_param.zero.offload_param.device = OffloadDevice::kCpu;
    WorldRun host = Train(cpu_param, world, steps, -1, -1, SmallModel(), true);
    RequireOk(host);
    for (bool optimizer_nvme : {false, true}) {
      for (int buffers : {1, 3}) {
        INFO("world=" << world << " optimizer_nvme=" << optimizer_nvme << " buffers=" << buffers);
        const Config c = NvmeParamConfig(optimizer_nvme, buffers);
        WorldRun run = Train(c, world, steps, -1, -1, SmallModel(), /*async_streams=*/true);
        RequireOk(run);
        for (int r = 0; r < world; ++r) {
          CHECK(BitEqual(run.ranks[r].master, reference.ranks[0].master));
          CHECK(run.ranks[r].params == reference.ranks[0].params);
          CHECK(BitEqual(run.ranks[r].master, host.ranks[r].master));
          CHECK(run.ranks[r].params == host.ranks[r].params);
        }
        // The shards are planned and allocated as nvme bytes, not host bytes.
        const int nvme = static_cast<int>(memory::MemoryKind::kNvme);
        const int pinned = static_cast<int>(memory::MemoryKind::kPinnedHost);
        CHECK(run.ranks[0].report.planned[nvme] > 0);
        CHECK(run.ranks[0].report.allocated[nvme] == run.ranks[0].report.planned[nvme]);
        CHECK(run.ranks[0].report.allocated[pinned] == run.ranks[0].report.planned[pinned]);
        auto plan = ChoosePlan(SmallModel(), c, world, 0);
        REQUIRE(plan.ok());
        const memory::Buffer* shard = plan->plan.Find(memory::BufferClass::kParams);
        REQUIRE(shard != nullptr);
        CHECK(shard->kind == memory::MemoryKind::kNvme);
        const memory::Buffer* pieces = plan->plan.Find(memory::BufferClass::kNvmeParamBuffers);
        REQUIRE(pieces != nullptr);
        CHECK(pieces->kind == memory::MemoryKind::kPinnedHost);
        CHECK(pieces->count == buffers);
        CHECK(pieces->bytes == buffers * 4096);  // every shard of this model fits one page
      }
    }
  }
}

// Rank 0's parameter reads fail with EIO while armed (every one: a read started before arming
// may still serve the next gather, but not the ones after it).
absl::Status ParamReadFault(const Config& config, comm::Communicator* comm, Device* dev,
                            std::atomic<bool>* armed) {
  ASSIGN_OR_RETURN(auto e, TrainedEngine(config, comm, dev, 1));
  if (comm->rank() == 0) *armed = true;
  const absl::Status failed = testing::TrainSteps(*e, 1, 1);
  if (comm->rank() == 0) *armed = false;
  if (failed.ok() ||
      failed.message().find("-rank0/param_shard at offset ") == absl::string_view::npos ||
      failed.message().find("Input/output error") == absl::string_view::npos) {
    return absl::InternalError(
        absl::StrCat("expected rank 0's EIO naming file and offset, got ", failed.ToString()));
  }
  return absl::OkStatus();
}

TEST_CASE("Engine: an NVMe parameter read error fails the gather on every rank alike",
          "[zero][nvme]") {
  const int world = 2;
  const Config config = NvmeParamConfig(/*optimizer_nvme=*/false, 2);
  std::atomic<bool> armed{false};
  nvme::SetIoFaultForTesting(
      [&](nvme::IoOp op, const std::string& path, int64_t, int64_t) -> std::optional<int> {
        const bool rank0 = path.find("-rank0/param_shard") != std::string::npos;
        if (op == nvme::IoOp::kRead && rank0 && armed) return -EIO;
        return std::nullopt;
      });
  CheckOnRanks(world, [&](comm::Communicator* comm, Device* dev) {
    return ParamReadFault(config, comm, dev, &armed);
  });
  nvme::SetIoFaultForTesting(nullptr);
}

// This rank's owned master, m, v and compute-dtype parameter shard through BeginSnapshot.
absl::Status SnapshotWithParams(Engine& e, std::vector<float> out[3], std::vector<char>* param) {
  const size_t n = static_cast<size_t>(e.plan().shard_elements);
  for (int k = 0; k < 3; ++k) out[k].assign(n, -1.0f);
  param->assign(n * DTypeSize(e.config().compute_dtype), 0x5a);
  RETURN_IF_ERROR(e.BeginSnapshot(out[0].data(), out[1].data(), out[2].data(), param->data()));
  return e.WaitSnapshot();
}

// Rank 1's second parameter write of step 3 fails: both ranks fail the step naming the file;
// the host state's update stands and the parameters are re-derived from it.
absl::Status ParamWriteFault(const Config& cpu, const Config& nvme, comm::Communicator* comm,
                             Device* dev, std::atomic<int>* armed) {
  ASSIGN_OR_RETURN(auto a, TrainedEngine(cpu, comm, dev, 2));
  ASSIGN_OR_RETURN(auto b, TrainedEngine(nvme, comm, dev, 2));
  if (comm->rank() == 1) *armed = 2;
  const absl::Status failed = testing::TrainSteps(*b, 2, 1);
  if (comm->rank() == 1) *armed = 0;
  if (failed.ok() ||
      failed.message().find("-rank1/param_shard at offset ") == absl::string_view::npos ||
      failed.message().find("re-derived from it") == absl::string_view::npos) {
    return absl::InternalError(absl::StrCat("expected rank 1's EIO, got ", failed.ToString()));
  }
  RETURN_IF_ERROR(testing::TrainSteps(*a, 2, 1));
  if (b->step() != 3) return absl::InternalError(absl::StrCat("step count ", b->step()));
  std::vector<float> sa[3], sb[3];
  std::vector<char> pa, pb;
  RETURN_IF_ERROR(SnapshotWithParams(*a, sa, &pa));
  RETURN_IF_ERROR(SnapshotWithParams(*b, sb, &pb));
  for (int k = 0; k < 3; ++k) {
    if (!BitEqual(sa[k], sb[k])) return absl::InternalError(absl::StrCat("state array ", k));
  }
  if (pa != pb) return absl::InternalError("parameter shards differ");
  RETURN_IF_ERROR(testing::TrainSteps(*a, 3, 2));
  RETURN_IF_ERROR(testing::TrainSteps(*b, 3, 2));
  return SameMasters(*a, *b, "masters differ after the failed write");
}

TEST_CASE("Engine: an NVMe parameter write error re-derives the parameters on every rank",
          "[zero][nvme]") {
  const int world = 2;
  Config cpu = MakeConfig(3, DType::kBF16, 1, 0.05, true);
  cpu.zero.offload_param.device = OffloadDevice::kCpu;
  const Config nvme = NvmeParamConfig(/*optimizer_nvme=*/false, 2);
  std::atomic<int> armed{0};
  nvme::SetIoFaultForTesting(
      [&](nvme::IoOp op, const std::string& path, int64_t, int64_t) -> std::optional<int> {
        const bool rank1 = path.find("-rank1/param_shard") != std::string::npos;
        if (op != nvme::IoOp::kWrite || !rank1 || armed == 0) return std::nullopt;
        if (--armed == 0) return -EIO;
        return std::nullopt;
      });
  CheckOnRanks(world, [&](comm::Communicator* comm, Device* dev) {
    return ParamWriteFault(cpu, nvme, comm, dev, &armed);
  });
  nvme::SetIoFaultForTesting(nullptr);
}

TEST_CASE("Engine: on an asynchronous compute stream every stage matches stage 0 bit for bit",
          "[zero][streams]") {
  // The trainer's gradient copies are only enqueued when GradReady is called: the engine must
  // wait for them before reducing, and its own device work must follow them on the stream.
  const int steps = 6;
  for (int world : {1, 2}) {
    WorldRun reference = Train(MakeConfig(0, DType::kBF16, 2, 0.05, false), world, steps);
    RequireOk(reference);
    for (int stage = 0; stage <= 3; ++stage) {
      for (bool offload : {false, true}) {
        if (stage == 0 && offload) continue;
        INFO("world=" << world << " stage=" << stage << " offload=" << offload);
        WorldRun run = Train(MakeConfig(stage, DType::kBF16, 2, 0.05, offload), world, steps, -1,
                             -1, SmallModel(), /*async_streams=*/true,
                             /*on_compute_stream=*/true);
        RequireOk(run);
        for (int r = 0; r < world; ++r) {
          CHECK(BitEqual(run.ranks[r].master, reference.ranks[0].master));
          CHECK(run.ranks[r].params == reference.ranks[0].params);
        }
      }
    }
  }
}

TEST_CASE("Engine: on asynchronous streams every storage mode matches its synchronous run",
          "[zero][streams]") {
  // Every device operation that feeds a collective of a complete-on-return communicator (an
  // upload of a host parameter shard, a cast into the fp32 wire, an NVMe shard read) must have
  // landed before the collective reads it. The delayed streams make a missing wait a wrong
  // result on every run, not a rare one.
  const int steps = 4;
  struct Mode {
    const char* name;
    std::function<void(Config*)> set;
  };
  const std::vector<Mode> modes = {
      {"offload_param cpu", [](Config* c) { c->zero.offload_param.device = OffloadDevice::kCpu; }},
      {"fp32 wire", [](Config* c) { c->communication_dtype = DType::kF32; }},
      {"fp32 accumulation", [](Config* c) { c->grad_accum_dtype = DType::kF32; }},
      {"fp32 wire and accumulation",
       [](Config* c) {
         c->communication_dtype = DType::kF32;
         c->grad_accum_dtype = DType::kF32;
       }},
      {"nvme state and parameters",
       [](Config* c) { *c = NvmeParamConfig(/*optimizer_nvme=*/true, /*buffers=*/2); }},
  };
  for (int world : {1, 2}) {
    for (const Mode& mode : modes) {
      for (int stage = 0; stage <= 3; ++stage) {
        Config c = MakeConfig(stage, DType::kBF16, 2, 0.05, /*offload=*/stage > 0);
        mode.set(&c);
        if (c.zero.stage != stage || !ValidateConfig(c).ok()) continue;
        INFO("world=" << world << " stage=" << stage << " mode=" << mode.name);
        WorldRun reference = Train(c, world, steps);
        RequireOk(reference);
        WorldRun run = Train(c, world, steps, -1, -1, SmallModel(), /*async_streams=*/true,
                             /*on_compute_stream=*/true);
        RequireOk(run);
        for (int r = 0; r < world; ++r) {
          CHECK(BitEqual(run.ranks[r].master, reference.ranks[r].master));
          CHECK(run.ranks[r].params == reference.ranks[r].params);
        }
      }
    }
  }
}

TEST_CASE("Engine: an overflow skips the step cleanly while gradient copies are in flight",
          "[zero][offload]") {
  // The gradient shards go to host memory during backward (gradient offload); the skipped step
  // must neither apply them nor let the next window's gradients race them. The engine and the
  // trainer run on an asynchronous stream so that the copies are really in flight.
  const int steps = 8, inject_step = 3;
  WorldRun reference = Train(MakeConfig(0, DType::kBF16, 1, 0, false), 2, steps, inject_step, 1);
  RequireOk(reference);
  for (int stage : {1, 2, 3}) {
    Config c = MakeConfig(stage, DType::kBF16, 1, 0, true);
    c.zero.offload_optimizer.buffer_count = 2;
    INFO("stage=" << stage);
    WorldRun run = Train(c, 2, steps, inject_step, 1, SmallModel(), /*async_streams=*/true,
                         /*on_compute_stream=*/true);
    RequireOk(run);
    REQUIRE(run.ranks[0].stats.size() == reference.ranks[0].stats.size());
    CHECK(run.ranks[0].stats[inject_step].skipped);
    for (int r = 0; r < 2; ++r) {
      CHECK(BitEqual(run.ranks[r].master, reference.ranks[0].master));
      CHECK(run.ranks[r].params == reference.ranks[0].params);
    }
  }
}

// A communicator that claims to move GPU memory; no collective is ever reached.
class DeviceMemoryComm final : public comm::Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  absl::string_view backend() const override { return "nccl"; }
  bool device_memory() const override { return true; }
  bool stream_ordered() const override { return true; }
  absl::Status AllGather(const void*, void*, size_t, DType, comm::Stream) override {
    return Unreached();
  }
  absl::Status ReduceScatter(const void*, void*, size_t, DType, comm::ReduceOp,
                             comm::Stream) override {
    return Unreached();
  }
  absl::Status AllReduce(const void*, void*, size_t, DType, comm::ReduceOp, comm::Stream) override {
    return Unreached();
  }
  absl::Status Broadcast(void*, size_t, DType, int, comm::Stream) override { return Unreached(); }
  absl::Status Barrier() override { return Unreached(); }
  absl::Status Synchronize(comm::Stream) override { return Unreached(); }

 private:
  static absl::Status Unreached() { return absl::InternalError("collective reached"); }
};

TEST_CASE("Engine: a CPU device with a GPU communicator is refused by name", "[zero]") {
  DeviceMemoryComm comm;
  auto device = testing::OneThreadCpuDevice();
  auto engine =
      Engine::Create(MakeConfig(2, DType::kBF16, 1, 0, false), SmallModel(), &comm, device.get());
  REQUIRE(engine.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(engine.status().message().find("'cpu'") != std::string::npos);
  CHECK(engine.status().message().find("'nccl'") != std::string::npos);
}

TEST_CASE("Engine: fp32 training matches a serial double-precision AdamW within 1e-6", "[zero]") {
  for (int world : {1, 3}) {
    for (int gas : {1, 3}) {
      for (double clip : {0.0, 0.05}) {
        const Config c = MakeConfig(2, DType::kF32, gas, clip, false);
        WorldRun run = Train(c, world, 20);
        RequireOk(run);
        const std::vector<double> ref =
            testing::SerialAdamW(SmallModel(), world, 20, gas, clip, c.optimizer);
        REQUIRE(run.ranks[0].master.size() == ref.size());
        double worst = 0;
        for (size_t j = 0; j < ref.size(); ++j) {
          worst = std::max(
              worst, std::fabs(run.ranks[0].master[j] - ref[j]) / std::max(std::fabs(ref[j]), 1.0));
        }
        INFO("world=" << world << " gas=" << gas << " clip=" << clip << " worst=" << worst);
        CHECK(worst <= 1e-6);
      }
    }
  }
}

TEST_CASE(
    "Engine: prescaled gradients match the serial reference, bit for bit at power-of-two "
    "worlds",
    "[zero]") {
  // Dividing by 2 or 4 before an fp32 sum in rank order is exact, so prescaling (and a
  // predivide factor of 2) must give exactly the averaged run; at 3 ranks each share is
  // rounded once more, and the result stays within the serial double reference's tolerance.
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (int stage : {0, 2, 3}) {
      for (int world : {2, 4}) {
        INFO("dtype=" << DTypeName(dtype) << " stage=" << stage << " world=" << world);
        const Config plain = MakeConfig(stage, dtype, 2, 0.05, false);
        WorldRun base = Train(plain, world, 6);
        RequireOk(base);
        Config pre = plain;
        pre.prescale_gradients = true;
        WorldRun prescaled = Train(pre, world, 6);
        RequireOk(prescaled);
        Config div = plain;
        div.gradient_predivide_factor = 2;
        WorldRun predivided = Train(div, world, 6);
        RequireOk(predivided);
        for (int r = 0; r < world; ++r) {
          CHECK(BitEqual(prescaled.ranks[r].master, base.ranks[r].master));
          CHECK(BitEqual(predivided.ranks[r].master, base.ranks[r].master));
        }
      }
    }
  }
  // The division really happens before the sum, in the wire dtype: by 3 it rounds in bf16, so
  // the masters move off the averaged run's bits (and stay finite and close).
  {
    const Config plain = MakeConfig(2, DType::kBF16, 1, 0, false);
    Config div = plain;
    div.gradient_predivide_factor = 3;
    WorldRun base = Train(plain, 2, 4), thirds = Train(div, 2, 4);
    RequireOk(base);
    RequireOk(thirds);
    CHECK_FALSE(BitEqual(thirds.ranks[0].master, base.ranks[0].master));
    double worst = 0;
    for (size_t j = 0; j < base.ranks[0].master.size(); ++j) {
      worst =
          std::max(worst, std::fabs(double(thirds.ranks[0].master[j]) - base.ranks[0].master[j]));
    }
    // An AdamW step moves a weight by about lr (1e-2) at most, so two runs of 4 steps cannot
    // be further apart than 2 * 4 * lr.
    CHECK(worst < 8e-2);
  }
  for (int world : {3, 4}) {
    Config c = MakeConfig(2, DType::kF32, 3, 0.05, false);
    c.prescale_gradients = true;
    WorldRun run = Train(c, world, 20);
    RequireOk(run);
    const std::vector<double> ref =
        testing::SerialAdamW(SmallModel(), world, 20, 3, 0.05, c.optimizer);
    REQUIRE(run.ranks[0].master.size() == ref.size());
    double worst = 0;
    for (size_t j = 0; j < ref.size(); ++j) {
      worst = std::max(
          worst, std::fabs(run.ranks[0].master[j] - ref[j]) / std::max(std::fabs(ref[j]), 1.0));
    }
    INFO("world=" << world << " worst=" << worst);
    CHECK(worst <= 1e-6);
  }
}

TEST_CASE("Engine: allocated bytes equal planned bytes for every memory kind", "[zero]") {
  for (int stage = 0; stage <= 3; ++stage) {
    for (bool offload : {false, true}) {
      if (stage == 0 && offload) continue;
      WorldRun run = Train(MakeConfig(stage, DType::kBF16, 3, 0, offload), 2, 1);
      RequireOk(run);
      for (int k = 0; k < memory::kNumMemoryKinds; ++k) {
        CHECK(run.ranks[0].report.allocated[k] == run.ranks[0].report.planned[k]);
      }
      CHECK((run.ranks[0].report.planned[1] > 0) == offload);
    }
  }
}

TEST_CASE("Engine: an overflow on one rank skips the step on every rank", "[zero]") {
  Config c = MakeConfig(2, DType::kF16, 1, 0, false);
  c.fp16.initial_scale_power = 4;
  c.fp16.hysteresis = 1;
  c.fp16.loss_scale_window = 3;
  WorldRun clean = Train(c, 3, 2);  // the state after steps 0 and 1
  RequireOk(clean);
  WorldRun run = Train(c, 3, 7, /*inject_step=*/2, /*inject_rank=*/1);
  RequireOk(run);
  REQUIRE(run.ranks[0].stats.size() == 7);
  // DeepSpeed's rule with hysteresis 1 and window 3: halve on the overflow, double after three
  // clean steps since it.
  const double expected[] = {16, 16, 16, 8, 8, 8, 16};
  for (int k = 0; k < 7; ++k) {
    INFO("step " << k);
    CHECK(run.ranks[0].stats[k].loss_scale == expected[k]);
    CHECK(run.ranks[0].stats[k].skipped == (k == 2));
  }
  CHECK(run.ranks[0].stats[2].step == 2);  // the skipped step did not advance t
  CHECK(run.ranks[0].stats[6].step == 6);
  for (int r = 1; r < 3; ++r) CHECK(BitEqual(run.ranks[r].master, run.ranks[0].master));
  // Stopping right after the skipped step leaves exactly the state of two clean steps.
  WorldRun to_skip = Train(c, 3, 3, 2, 1);
  RequireOk(to_skip);
  CHECK(BitEqual(to_skip.ranks[0].master, clean.ranks[0].master));
}

TEST_CASE(
    "Engine: a bf16 step with an infinite gradient is skipped on every rank, as DeepSpeed's "
    "check_grad_overflow does",
    "[zero]") {
  // The chosen behaviour (docs/config.md): skip, never write Inf or NaN into the fp32 masters.
  Config c = MakeConfig(2, DType::kBF16, 1, 1.0, false);
  WorldRun clean = Train(c, 2, 2);
  RequireOk(clean);
  WorldRun run = Train(c, 2, 3, /*inject_step=*/2, /*inject_rank=*/1);
  RequireOk(run);
  REQUIRE(run.ranks[0].stats.size() == 3);
  CHECK_FALSE(run.ranks[0].stats[1].skipped);
  CHECK(run.ranks[0].stats[2].skipped);
  CHECK(run.ranks[0].stats[2].loss_scale == 1);  // bf16 has no scaler to back off
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r);
    CHECK(BitEqual(run.ranks[r].master, clean.ranks[r].master));
    for (float x : run.ranks[r].master) REQUIRE(std::isfinite(x));
  }
}

TEST_CASE("Engine: a written warmup_max_lr is the rate after warmup, not optimizer.params.lr",
          "[zero]") {
  for (SchedulerType type : {SchedulerType::kWarmupLR, SchedulerType::kWarmupDecayLR}) {
    Config c = MakeConfig(1, DType::kF32, 1, 0, false);
    c.optimizer.lr = 0.001;
    c.scheduler.type = type;
    c.scheduler.warmup_min_lr = 0;
    c.scheduler.warmup_max_lr = 0.02;
    c.scheduler.warmup_num_steps = 2;
    c.scheduler.total_num_steps = 1000;
    WorldRun run = Train(c, 2, 4);
    RequireOk(run);
    REQUIRE(run.ranks[0].stats.size() == 4);
    // DeepSpeed's WarmupLR holds warmup_max_lr once the warmup is over (step 3, iteration 2);
    // WarmupDecayLR has decayed by (1000 - 2) / (1000 - 2) = 1 there, i.e. not yet.
    INFO(SchedulerTypeName(type));
    CHECK(run.ranks[0].stats[3].lr == 0.02);
    CHECK(run.ranks[0].stats[0].lr == 0);  // warmup_min_lr, the rate set when the schedule is built
  }
}

TEST_CASE("Engine: overflow at the minimum loss scale is an error, not endless skipping",
          "[zero]") {
  Config c = MakeConfig(1, DType::kF16, 1, 0, false);
  c.fp16.initial_scale_power = 0;  // already at min_loss_scale = 1
  c.fp16.hysteresis = 1;
  WorldRun run = Train(c, 2, 1, 0, 0);
  for (const absl::Status& s : run.errors) {
    REQUIRE_FALSE(s.ok());
    CHECK(s.code() == absl::StatusCode::kFailedPrecondition);
    CHECK_THAT(std::string(s.message()), Catch::Contains("min_loss_scale"));
  }
}

TEST_CASE("Engine: misuse is an error naming the call", "[zero]") {
  auto comms = comm::CreateInProcessGroup(1).value();
  auto device = testing::OneThreadCpuDevice();
  Config c = MakeConfig(3, DType::kBF16, 1, 0, false);
  auto engine = Engine::Create(c, SmallModel(), comms[0].get(), device.get());
  REQUIRE(engine.ok());
  Engine& e = **engine;
  auto missing = e.Step();
  REQUIRE_FALSE(missing.ok());
  CHECK_THAT(std::string(missing.status().message()), Catch::Contains("GradReady('"));
  CHECK(e.Gather(e.num_units()).code() == absl::StatusCode::kOutOfRange);
  // A non-persistent unit's parameters need a Gather first.
  int big = -1;
  for (int u = 0; u < e.num_units(); ++u) {
    if (!e.plan().units[u].persistent) big = u;
  }
  REQUIRE(big >= 0);
  const int p = e.plan().units[big].params[0];
  CHECK(e.param(p).status().code() == absl::StatusCode::kFailedPrecondition);
  REQUIRE(e.Gather(big).ok());
  CHECK(e.param(p).ok());
  CHECK(e.Gather(big).code() == absl::StatusCode::kFailedPrecondition);
  REQUIRE(e.Release(big).ok());
  CHECK(e.Release(big).code() == absl::StatusCode::kFailedPrecondition);
  REQUIRE(e.GradReady(0).ok());
  auto twice = e.GradReady(0);
  CHECK(twice.code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(twice.message()), Catch::Contains("embed.w"));
}

TEST_CASE("Engine: uneven shapes keep stages bit-identical", "[zero]") {
  std::vector<ParamSpec> huge_and_tiny = {{"big.w", {71, 73}, "big"}};  // one unit of its own
  for (int i = 0; i < 40; ++i) {
    const std::string m = "tiny" + std::to_string(i);
    huge_and_tiny.push_back({m + ".w", {1 + i % 3}, m});
  }
  const std::vector<ParamSpec> fewer_than_ranks = {
      {"a", {2}, "a"}, {"b", {1, 1}, "b"}, {"c", {2}, "a"}};
  struct Case {
    std::vector<ParamSpec> specs;
    int world;
  };
  for (const Case& c :
       {Case{huge_and_tiny, 3}, Case{huge_and_tiny, 4}, Case{fewer_than_ranks, 8}}) {
    WorldRun reference =
        Train(MakeConfig(0, DType::kBF16, 2, 0.05, false), c.world, 6, -1, -1, c.specs);
    RequireOk(reference);
    for (int stage = 1; stage <= 3; ++stage) {
      INFO("world=" << c.world << " stage=" << stage << " params=" << c.specs.size());
      WorldRun run =
          Train(MakeConfig(stage, DType::kBF16, 2, 0.05, stage == 2), c.world, 6, -1, -1, c.specs);
      RequireOk(run);
      for (int r = 0; r < c.world; ++r)
        CHECK(BitEqual(run.ranks[r].master, reference.ranks[0].master));
    }
  }
}

TEST_CASE(
    "Engine: buckets and gather slots in two size classes keep stages 2-3 bit-identical "
    "to stage 1",
    "[zero]") {
  // An embedding far larger than the blocks, as GPT-2's: it gets a bucket and a gather slot of
  // its own, the blocks buckets and slots of a block (memory/plan.h, size classes).
  std::vector<ParamSpec> specs = {{"embed.w", {61, 47}, "embed"}};
  for (int l = 0; l < 6; ++l) {
    const std::string m = "block" + std::to_string(l);
    specs.push_back({m + ".w", {11, 13}, m});
    specs.push_back({m + ".b", {13}, m});
  }
  for (DType precision : {DType::kF32, DType::kBF16}) {
    for (int world : {2, 3}) {
      for (int gas : {1, 2}) {
        INFO("precision=" << DTypeName(precision) << " world=" << world << " gas=" << gas);
        WorldRun reference =
            Train(MakeConfig(1, precision, gas, 0.05, false), world, 8, -1, -1, specs);
        RequireOk(reference);
        for (int stage = 2; stage <= 3; ++stage) {
          INFO("stage=" << stage);
          const Config config = MakeConfig(stage, precision, gas, 0.05, false);
          absl::StatusOr<PlanChoice> choice = ChoosePlan(specs, config, world, 0);
          REQUIRE(choice.ok());
          const memory::Plan& plan = choice->plan;
          // The classes are in force: the embedding's unit alone sizes the last slot.
          int64_t largest = 0, block = 0;
          for (const memory::Unit& u : plan.units) {
            if (u.params.size() == 1 && u.params[0] == 0) largest = u.padded;
            if (u.name == "block0") block = u.padded;
          }
          REQUIRE(largest > block);
          const std::vector<int64_t> buckets = {block, block, largest};
          CHECK(plan.Find(memory::BufferClass::kGradBucket)->slot_elements == buckets);
          if (stage == 3) {
            const std::vector<int64_t>& slots =
                plan.Find(memory::BufferClass::kGatherBuffer)->slot_elements;
            REQUIRE(slots.size() >= 2);
            CHECK(slots.back() == largest);
            CHECK(slots[slots.size() - 2] == block);
          }
          WorldRun run = Train(config, world, 8, -1, -1, specs);
          RequireOk(run);
          for (int k = 0; k < memory::kNumMemoryKinds; ++k) {
            CHECK(run.ranks[0].report.allocated[k] == run.ranks[0].report.planned[k]);
          }
          for (int r = 0; r < world; ++r) {
            CHECK(BitEqual(run.ranks[r].master, reference.ranks[0].master));
            CHECK(run.ranks[r].params == reference.ranks[0].params);
          }
        }
      }
    }
  }
}

TEST_CASE("Engine: ranks that registered different models are told so", "[zero]") {
  auto device = testing::OneThreadCpuDevice();
  const std::vector<absl::Status> errors =
      comm::testing::OnRanks(2, {5000}, [&](int r, comm::Communicator* c) {
        auto specs = SmallModel();
        if (r == 1) specs[3].shape = {63, 9};
        return Engine::Create(MakeConfig(0, DType::kBF16, 1, 0, false), specs, c, device.get())
            .status();
      });
  for (const absl::Status& s : errors) {
    REQUIRE_FALSE(s.ok());
    CHECK_THAT(std::string(s.message()), Catch::Contains("disagree on the model"));
  }
  // The node size, which each rank may take from its own launcher: named, with the way out.
  const std::vector<absl::Status> per_node =
      comm::testing::OnRanks(2, {5000}, [&](int r, comm::Communicator* c) {
        Config config = MakeConfig(0, DType::kBF16, 1, 0, false);
        config.ranks_per_node = r == 0 ? 2 : 0;
        return Engine::Create(config, SmallModel(), c, device.get()).status();
      });
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    REQUIRE_FALSE(per_node[r].ok());
    CHECK_THAT(std::string(per_node[r].message()),
               Catch::Contains(absl::StrCat("disagree on zerort.ranks_per_node (", r == 0 ? 2 : 0,
                                            " here, ", r == 0 ? 0 : 2, " there")) &&
                   Catch::Contains("set zerort.ranks_per_node in the config"));
  }
}

// --- NVMe parameter offload with the optimizer step on the device (no optimizer offload) ---

// Stage 3, bf16, the parameter shard on NVMe, master, m and v in device memory.
Config DeviceStepNvmeParamConfig(int buffers) {
  Config c = NvmeParamConfig(/*optimizer_nvme=*/false, buffers);
  c.zero.offload_optimizer.device = OffloadDevice::kNone;
  REQUIRE(ValidateConfig(c).ok());
  for (const std::string& note : c.notes) CHECK(note.find("offload_param") == std::string::npos);
  return c;
}

// The same without NVMe: the shard in host memory, the step on the device.
Config DeviceStepHostParamConfig() {
  Config c = MakeConfig(3, DType::kBF16, 1, 0.05, false);
  c.zero.offload_param.device = OffloadDevice::kCpu;
  return c;
}

// Every parameter as the trainer reads it (stage 3: acquired one at a time), in parameter order.
absl::StatusOr<std::vector<char>> ReadParams(Engine& e) {
  std::vector<char> out;
  const size_t c = DTypeSize(e.config().compute_dtype);
  for (int i = 0; i < e.num_params(); ++i) {
    const int one[1] = {i};
    RETURN_IF_ERROR(e.AcquireParams(one));
    ASSIGN_OR_RETURN(void* v, e.param(i));
    const size_t at = out.size();
    out.resize(at + static_cast<size_t>(e.plan().params[i].numel) * c);
    RETURN_IF_ERROR(e.device()->Copy(out.data() + at, v, out.size() - at, e.compute_stream()));
    RETURN_IF_ERROR(e.device()->Synchronize(e.compute_stream()));
    RETURN_IF_ERROR(e.ReleaseParams(one));
  }
  return out;
}

absl::Status SameReadParams(Engine& a, Engine& b, const std::string& what) {
  ASSIGN_OR_RETURN(std::vector<char> pa, ReadParams(a));
  ASSIGN_OR_RETURN(std::vector<char> pb, ReadParams(b));
  return pa == pb ? absl::OkStatus() : absl::InternalError(what + ": parameters differ");
}

// One rank: stage 0, the host-shard engine and the NVMe-shard engine take the same steps; the
// parameters every forward reads are equal after each step, and so are the masters at the end.
absl::Status DeviceStepMatches(const Config& nvme, int steps, comm::Communicator* comm,
                               Device* dev) {
  ASSIGN_OR_RETURN(auto stage0,
                   TrainedEngine(MakeConfig(0, DType::kBF16, 1, 0.05, false), comm, dev, 0));
  ASSIGN_OR_RETURN(auto host, TrainedEngine(DeviceStepHostParamConfig(), comm, dev, 0));
  ASSIGN_OR_RETURN(auto file, TrainedEngine(nvme, comm, dev, 0));
  for (int step = 0; step < steps; ++step) {
    for (Engine* e : {stage0.get(), host.get(), file.get()}) {
      RETURN_IF_ERROR(testing::TrainSteps(*e, step, 1));
    }
    RETURN_IF_ERROR(SameReadParams(*stage0, *file, absl::StrCat("stage 0, step ", step)));
    RETURN_IF_ERROR(SameReadParams(*host, *file, absl::StrCat("host shard, step ", step)));
  }
  RETURN_IF_ERROR(SameMasters(*stage0, *file, "masters differ from stage 0's"));
  const MemoryReport report = file->memory_report();
  for (memory::MemoryKind k : {memory::MemoryKind::kNvme, memory::MemoryKind::kPinnedHost}) {
    const int i = static_cast<int>(k);
    if (report.planned[i] <= 0 || report.allocated[i] != report.planned[i]) {
      return absl::InternalError(absl::StrCat(memory::MemoryKindName(k), ": planned ",
                                              report.planned[i], ", allocated ",
                                              report.allocated[i]));
    }
  }
  const memory::Buffer* shard = file->plan().Find(memory::BufferClass::kParams);
  if (shard == nullptr || shard->kind != memory::MemoryKind::kNvme) {
    return absl::InternalError("the plan does not put param_shard in nvme");
  }
  return absl::OkStatus();
}

TEST_CASE(
    "Engine: NVMe parameter offload with the optimizer on the device matches stage 0 "
    "and host parameter offload bit for bit",
    "[zero][nvme]") {
  for (int world : {1, 3}) {
    for (int buffers : {1, 3}) {
      INFO("world=" << world << " buffers=" << buffers);
      const Config c = DeviceStepNvmeParamConfig(buffers);
      CheckOnRanks(world, [&](comm::Communicator* comm, Device* dev) {
        return DeviceStepMatches(c, 4, comm, dev);
      });
    }
    // Asynchronous streams: the device's rounding into the pinned buffers is ordered after
    // the AdamW, and the write after the rounding. fp32 (a device master only in this mode)
    // and gradient accumulation too.
    for (DType dtype : {DType::kBF16, DType::kF32}) {
      for (int gas : {1, 2}) {
        INFO("world=" << world << " dtype=" << DTypeName(dtype) << " gas=" << gas);
        WorldRun reference = Train(MakeConfig(0, dtype, gas, 0.05, false), world, 4);
        RequireOk(reference);
        Config c = DeviceStepNvmeParamConfig(2);
        c.compute_dtype = dtype;
        c.gradient_accumulation_steps = gas;
        WorldRun run = Train(c, world, 4, -1, -1, SmallModel(), /*async_streams=*/true,
                             /*on_compute_stream=*/true);
        RequireOk(run);
        for (int r = 0; r < world; ++r) {
          CHECK(BitEqual(run.ranks[r].master, reference.ranks[0].master));
          CHECK(run.ranks[r].params == reference.ranks[0].params);
        }
      }
    }
  }
}

// Rank 1's parameter writes: `once` counts down to one EIO (the second write after arming);
// `always` fails every one while set.
struct ParamWriteFaults {
  std::atomic<int> once{0};
  std::atomic<bool> always{false};
};

absl::Status ExpectParamWriteError(const absl::Status& failed, const char* outcome) {
  if (failed.ok() ||
      failed.message().find("-rank1/param_shard at offset ") == absl::string_view::npos ||
      failed.message().find("Input/output error") == absl::string_view::npos ||
      failed.message().find(outcome) == absl::string_view::npos) {
    return absl::InternalError(absl::StrCat("expected rank 1's EIO naming the file and offset, ",
                                            "and \"", outcome, "\"; got ", failed.ToString()));
  }
  return absl::OkStatus();
}

// One rank. `want` never faults and takes the same steps. A single failed write in step 2:
// the update stands, the shards are re-derived, and training goes on as if nothing had failed.
// Then a persistent fault in step 5 (re-deriving fails too); with the fault cleared, a restore
// from the snapshot taken before step 5 trains on as `want` does.
absl::Status DeviceStepWriteFaults(const Config& nvme, comm::Communicator* comm, Device* dev,
                                   ParamWriteFaults* faults) {
  const bool rank1 = comm->rank() == 1;
  ASSIGN_OR_RETURN(auto want, TrainedEngine(DeviceStepHostParamConfig(), comm, dev, 2));
  ASSIGN_OR_RETURN(auto e, TrainedEngine(nvme, comm, dev, 2));
  if (rank1) faults->once = 2;
  RETURN_IF_ERROR(ExpectParamWriteError(testing::TrainSteps(*e, 2, 1), "re-derived from it"));
  if (rank1) faults->once = 0;
  if (e->step() != 3) return absl::InternalError(absl::StrCat("step count ", e->step()));
  RETURN_IF_ERROR(testing::TrainSteps(*want, 2, 1));
  std::vector<float> sw[3], se[3];
  std::vector<char> pw, pe;
  RETURN_IF_ERROR(SnapshotWithParams(*want, sw, &pw));
  RETURN_IF_ERROR(SnapshotWithParams(*e, se, &pe));  // the shard read back from the file
  for (int k = 0; k < 3; ++k) {
    if (!BitEqual(sw[k], se[k])) return absl::InternalError(absl::StrCat("state array ", k));
  }
  if (pw != pe) return absl::InternalError("parameter shards differ after the failed write");
  RETURN_IF_ERROR(testing::TrainSteps(*want, 3, 2));
  RETURN_IF_ERROR(testing::TrainSteps(*e, 3, 2));
  RETURN_IF_ERROR(SameReadParams(*want, *e, "after the failed write and two more steps"));
  // The snapshot before step 5, then a step whose writes (and re-derivation) all fail.
  const EngineState before = e->state();
  RETURN_IF_ERROR(SnapshotOf(*e, se));
  if (rank1) faults->always = true;
  const absl::Status failed = testing::TrainSteps(*e, 5, 1);
  if (rank1) faults->always = false;
  RETURN_IF_ERROR(ExpectParamWriteError(failed, "could not be re-derived"));
  RETURN_IF_ERROR(e->RestoreOwnedState(se[0], se[1], se[2], before));
  RETURN_IF_ERROR(testing::TrainSteps(*want, 5, 2));
  RETURN_IF_ERROR(testing::TrainSteps(*e, 5, 2));
  if (e->step() != 7) return absl::InternalError(absl::StrCat("step count ", e->step()));
  RETURN_IF_ERROR(SameMasters(*want, *e, "masters differ after the restore"));
  return SameReadParams(*want, *e, "after the restore and two steps");
}

TEST_CASE(
    "Engine: after a device optimizer step the first units' new shards wait in the "
    "NVMe buffers for the next forward",
    "[zero][nvme]") {
  // The write-back runs from the last unit to the first, and completed writes stay in the
  // buffers as read-aheads: the next forward's first gathers read nothing from the file.
  CheckOnRanks(1, [&](comm::Communicator* comm, Device* dev) -> absl::Status {
    ASSIGN_OR_RETURN(auto e, TrainedEngine(DeviceStepNvmeParamConfig(2), comm, dev, 0));
    if (e->plan().units.size() < 4) return absl::InternalError("the test needs 4 or more units");
    RETURN_IF_ERROR(testing::TrainSteps(*e, 0, 1));
    for (int i = 0; i < e->num_params(); ++i) {  // the forward's first parameter in unit 0
      if (e->plan().params[i].unit != 0 || e->plan().units[0].persistent) continue;
      const int64_t before = e->nvme_param_reads_ahead_used();
      const int one[1] = {i};
      RETURN_IF_ERROR(e->AcquireParams(one));
      RETURN_IF_ERROR(e->ReleaseParams(one));
      if (e->nvme_param_reads_ahead_used() <= before) {
        return absl::InternalError("unit 0 was read from the file after the step");
      }
      return absl::OkStatus();
    }
    return absl::InternalError("no parameter in a non-persistent unit 0");
  });
}

TEST_CASE("Engine: the parameter read-ahead does not turn round into the optimizer step",
          "[zero][nvme]") {
  // A backward pass that reaches the first unit before the step stops reading ahead: the step
  // rewrites every shard, so reads of the next forward's units would be dropped unread. Inside
  // an accumulation window the next forward does read them, so the turn stays.
  for (bool device_step : {false, true}) {
    INFO("optimizer on the device: " << device_step);
    CheckOnRanks(1, [&](comm::Communicator* comm, Device* dev) -> absl::Status {
      const Config c = device_step ? DeviceStepNvmeParamConfig(3) : NvmeParamConfig(false, 3);
      ASSIGN_OR_RETURN(auto e, TrainedEngine(c, comm, dev, 0));
      RETURN_IF_ERROR(testing::TrainSteps(*e, 0, 3));
      if (e->nvme_param_reads_ahead_used() == 0) return absl::InternalError("no read-ahead used");
      if (e->nvme_param_reads_ahead_wasted() != 0) {
        return absl::InternalError(absl::StrCat(e->nvme_param_reads_ahead_wasted(),
                                                " pieces read ahead and dropped unread"));
      }
      return absl::OkStatus();
    });
  }
}

TEST_CASE(
    "Engine: an NVMe parameter write error in a device optimizer step names the file; "
    "training goes on, or restores, bit-identically",
    "[zero][nvme]") {
  const Config nvme = DeviceStepNvmeParamConfig(2);
  ParamWriteFaults faults;
  nvme::SetIoFaultForTesting(
      [&](nvme::IoOp op, const std::string& path, int64_t, int64_t) -> std::optional<int> {
        if (op != nvme::IoOp::kWrite || path.find("-rank1/param_shard") == std::string::npos) {
          return std::nullopt;
        }
        if (faults.always) return -EIO;
        if (faults.once > 0 && --faults.once == 0) return -EIO;
        return std::nullopt;
      });
  CheckOnRanks(2, [&](comm::Communicator* comm, Device* dev) {
    return DeviceStepWriteFaults(nvme, comm, dev, &faults);
  });
  nvme::SetIoFaultForTesting(nullptr);
}

}  // namespace
}  // namespace zerort

namespace zerort {
namespace {

// Each rank's status must be FailedPrecondition and name every part of `needles`.
void RequireRefusedEverywhere(const std::vector<absl::Status>& st,
                              const std::vector<std::string>& needles) {
  for (size_t r = 0; r < st.size(); ++r) {
    INFO("rank " << r << ": " << st[r].ToString());
    REQUIRE(st[r].code() == absl::StatusCode::kFailedPrecondition);
    for (const std::string& n : needles)
      CHECK_THAT(std::string(st[r].message()), Catch::Contains(n));
  }
}

// One step on a fresh engine per rank after `before(rank, engine)`; the masters must be the
// initial values afterwards (the update was not applied anywhere).
std::vector<absl::Status> StepAfter(const std::vector<Config>& configs,
                                    const std::function<absl::Status(int, Engine&)>& before) {
  auto device = CreateCpuDevice({});
  const std::vector<ParamSpec> specs = SmallModel();
  return comm::testing::OnRanks(
      static_cast<int>(configs.size()), {20000}, [&](int r, comm::Communicator* comm) {
        ASSIGN_OR_RETURN(auto engine, Engine::Create(configs[r], specs, comm, device.get()));
        RETURN_IF_ERROR(testing::SetInitValues(*engine));
        ASSIGN_OR_RETURN(const std::vector<float> initial, engine->GatherMasterWeights());
        RETURN_IF_ERROR(before(r, *engine));
        std::vector<std::vector<char>> host;
        RETURN_IF_ERROR(testing::Backward(*engine, 0, 0, &host, 1.0f, false));
        absl::StatusOr<StepStats> step = engine->Step();
        ASSIGN_OR_RETURN(const std::vector<float> after, engine->GatherMasterWeights());
        if (!BitEqual(after, initial)) return absl::InternalError("an update was applied");
        return step.status();
      });
}

TEST_CASE("Engine: ranks with different lr or weight decay are refused before the update",
          "[zero]") {
  // From the configs.
  Config a = MakeConfig(2, DType::kF32, 1, 0, false), b = a;
  b.optimizer.lr = 2 * a.optimizer.lr;
  RequireRefusedEverywhere(StepAfter({a, b}, [](int, Engine&) { return absl::OkStatus(); }),
                           {"before the update of step 1", "rank 1 lr=0.02", "rank 0 has lr=0.01"});
  // From SetLearningRate and SetHyperparams on one rank only.
  RequireRefusedEverywhere(StepAfter({a, a, a},
                                     [](int r, Engine& e) {
                                       return r == 2 ? e.SetLearningRate(5e-3) : absl::OkStatus();
                                     }),
                           {"rank 2 lr=0.005"});
  RequireRefusedEverywhere(StepAfter({a, a},
                                     [](int r, Engine& e) {
                                       AdamWScalars s = e.hyperparams();
                                       if (r == 1) s.weight_decay = 0.5;
                                       return e.SetHyperparams(s);
                                     }),
                           {"rank 1 weight_decay=0.5"});
  // The same values everywhere step as before.
  for (const absl::Status& s :
       StepAfter({a, a}, [](int, Engine& e) { return e.SetLearningRate(0.0); })) {
    CHECK(s.ok());  // lr 0 leaves the masters unchanged, so the check above holds too
  }
}

TEST_CASE("Engine: stage-3 ranks that gathered different units fail the step on every rank",
          "[zero]") {
  // One gather slot and no prefetch: after the stray gathers every later Gather misses on
  // both ranks alike, so the collectives keep pairing (as NCCL would pair them) and nothing
  // but the digest can tell.
  Config c = MakeConfig(3, DType::kF32, 1, 0, false);
  c.zero.stage3_prefetch_bucket_size = 0;
  c.zero.stage3_max_live_parameters = 1;
  c.zero.stage3_param_persistence_threshold = 0;
  // Two units of equal padded size (their gathers pair up without an error), neither the
  // first that forward gathers (num_units - 1).
  auto device = CreateCpuDevice({});
  memory::Plan plan = ChoosePlan(SmallModel(), c, 2, 0).value().plan;
  const int units = static_cast<int>(plan.units.size());
  REQUIRE(plan.gather_slots == 1);
  int u1 = -1, u2 = -1;
  for (int i = 0; i + 1 < units && u2 < 0; ++i) {
    for (int j = i + 1; j + 1 < units && u2 < 0; ++j) {
      if (plan.units[i].padded == plan.units[j].padded) u1 = i, u2 = j;
    }
  }
  REQUIRE(u2 >= 0);
  RequireRefusedEverywhere(StepAfter({c, c},
                                     [&](int r, Engine& e) {
                                       RETURN_IF_ERROR(e.Gather(r == 0 ? u1 : u2));
                                       return e.Release(r == 0 ? u1 : u2);
                                     }),
                           {"collectives", "different units"});
}

TEST_CASE("Engine: two engines on one communicator stepping in crossed order both fail", "[zero]") {
  const Config c = MakeConfig(2, DType::kF32, 1, 0, false);
  auto device = CreateCpuDevice({});
  std::vector<absl::Status> st =
      comm::testing::OnRanks(2, {20000}, [&](int r, comm::Communicator* comm) -> absl::Status {
        ASSIGN_OR_RETURN(auto first, Engine::Create(c, SmallModel(), comm, device.get()));
        ASSIGN_OR_RETURN(auto second, Engine::Create(c, SmallModel(), comm, device.get()));
        RETURN_IF_ERROR(testing::SetInitValues(*first));
        RETURN_IF_ERROR(testing::SetInitValues(*second));
        // Rank 0 steps the first engine, then the second; rank 1 the other way round: every
        // collective pairs with the other engine's.
        Engine& one = r == 0 ? *first : *second;
        std::vector<std::vector<char>> host;
        RETURN_IF_ERROR(testing::Backward(one, 0, 0, &host, 1.0f, false));
        return one.Step().status();
      });
  RequireRefusedEverywhere(st, {"two engines share this communicator"});
}

}  // namespace
}  // namespace zerort
