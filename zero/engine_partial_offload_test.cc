// Partial optimizer offload (zero_optimization.offload_optimizer.ratio): whole units keep their
// optimizer state and reduced gradient on the device, the rest is offloaded, and both parts are
// updated in the same step by AdamWs that are bitwise equal. So every ratio must give the bits
// of no offload and of full offload, with exactly the bytes the plan lists.
#include <atomic>
#include <cerrno>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "base/testing/temp_dir.h"
#include "checkpoint/checkpoint.h"
#include "comm/inprocess.h"
#include "comm/testing/on_ranks.h"
#include "device/cpu_device.h"
#include "nvme/io.h"
#include "zero/engine.h"
#include "zero/planner.h"
#include "zero/testing/synthetic_trainer.h"
#include "zero/testing/world_run.h"

namespace zerort {
namespace {

using testing::BitEqual;
using testing::CheckAllOk;
using testing::RequireOk;
using testing::SameMasters;
using testing::SameSnapshots;
using testing::SmallModel;
using testing::SnapshotOf;
using testing::TrainedEngine;
using testing::WorldRun;

// `steps` optimizer steps on `world` in-process ranks. `async_streams`: the CPU device runs its
// streams on threads with a 200 us delay per operation and each rank's engine and trainer work
// on a stream of their own, so every copy races what follows it unless the stream order holds.
WorldRun Train(const Config& config, int world, int steps, bool async_streams = false) {
  testing::WorldOptions o;
  o.async_streams = o.rank_streams = async_streams;
  return testing::TrainWorld(config, SmallModel(), world, steps, o);
}

void CheckSame(const WorldRun& run, const WorldRun& want) {
  for (size_t r = 0; r < run.ranks.size(); ++r) {
    INFO("rank " << r);
    CHECK(BitEqual(run.ranks[r].master, want.ranks[r].master));
    CHECK(run.ranks[r].params == want.ranks[r].params);
  }
}

// Optimizer offload to "cpu" or to NVMe files in the test's temporary directory, at `ratio`.
Config Offloaded(Config c, bool nvme, double ratio) {
  c.zero.offload_optimizer.device = nvme ? OffloadDevice::kNvme : OffloadDevice::kCpu;
  c.zero.offload_optimizer.ratio = ratio;
  if (nvme) {
    c.zero.offload_optimizer.nvme_path = testing::TestTmpDir();
    c.aio.block_size = 8192;  // several requests per unit, queue depth 2: every slot rotates
    c.aio.queue_depth = 2;
  }
  REQUIRE(ValidateConfig(c).ok());
  return c;
}

// The plan of rank 0 for `c` at `world`.
memory::Plan PlanOf(const Config& c, int world) {
  absl::StatusOr<PlanChoice> choice = ChoosePlan(SmallModel(), c, world, 0);
  REQUIRE(choice.ok());
  return choice->plan;
}

TEST_CASE(
    "Partial offload: every ratio gives the fp32 masters of no offload and of full "
    "offload, bit for bit, with the bytes the plan lists",
    "[zero][offload][nvme]") {
  const int steps = 4;
  for (DType precision : {DType::kF32, DType::kBF16}) {
    for (int world : {1, 2, 3}) {
      // World 2 on asynchronous streams; world 3 accumulates over two micro-steps (gradient
      // offload's device stage for the offloaded units, accumulation in place for the others).
      const bool async = world == 2;
      const int gas = world == 3 ? 2 : 1;
      for (int stage = 1; stage <= 3; ++stage) {
        const Config plain = testing::TestConfig(stage, precision, gas, 0.05, false);
        const WorldRun none = Train(plain, world, steps);
        RequireOk(none);
        for (bool nvme : {false, true}) {
          const WorldRun full = Train(Offloaded(plain, nvme, 1.0), world, steps, async);
          RequireOk(full);
          for (double ratio : {0.0, 0.3, 0.5, 1.0}) {
            INFO(DTypeName(precision)
                 << " world " << world << " gas " << gas << " stage " << stage
                 << (nvme ? " nvme" : " cpu") << " ratio " << ratio << (async ? " async" : ""));
            const Config c = Offloaded(plain, nvme, ratio);
            const memory::Plan plan = PlanOf(c, world);
            // 0.3 and 0.5 really split this model: both parts hold units.
            if (ratio > 0 && ratio < 1) {
              REQUIRE(plan.device_state_elements > 0);
              REQUIRE(plan.offloaded_state_elements > 0);
            }
            CHECK(plan.offload_ratio_achieved() >= ratio);
            CHECK(plan.offloaded_state_elements + plan.device_state_elements ==
                  plan.trainable_shard_elements);
            const WorldRun run = ratio == 1.0 ? full : Train(c, world, steps, async);
            RequireOk(run);
            CheckSame(run, none);
            CheckSame(run, full);
            for (int k = 0; k < memory::kNumMemoryKinds; ++k) {
              INFO("memory kind " << memory::MemoryKindName(static_cast<memory::MemoryKind>(k)));
              CHECK(run.ranks[0].report.allocated[k] == run.ranks[0].report.planned[k]);
              CHECK(run.ranks[0].report.planned[k] == plan.bytes_by_kind[k]);
            }
            const int nvme_kind = static_cast<int>(memory::MemoryKind::kNvme);
            CHECK((run.ranks[0].report.planned[nvme_kind] > 0) == (nvme && ratio > 0));
          }
        }
      }
    }
  }
}

TEST_CASE(
    "Partial offload: fp32 accumulation, an fp32 wire and parameter offload match the "
    "device optimizer bit for bit",
    "[zero][offload][nvme]") {
  const int steps = 4;
  for (int world : {1, 3}) {
    for (int variant = 0; variant < 4; ++variant) {
      for (int stage = 1; stage <= 3; ++stage) {
        // 0: fp32 accumulation over 2 micro-steps; 1: fp32 wire and accumulation; 2, 3:
        // parameter offload "cpu" / "nvme" (stage 3).
        if (variant >= 2 && stage != 3) continue;
        Config c = testing::TestConfig(stage, DType::kBF16, variant <= 1 ? 2 : 1, 0.05, false);
        if (variant <= 1) c.grad_accum_dtype = DType::kF32;
        if (variant == 1) c.communication_dtype = DType::kF32;
        const WorldRun reference = Train(c, world, steps);
        RequireOk(reference);
        if (variant == 2) c.zero.offload_param.device = OffloadDevice::kCpu;
        if (variant == 3) {
          c.zero.offload_param.device = OffloadDevice::kNvme;
          c.zero.offload_param.nvme_path = testing::TestTmpDir();
          c.zero.offload_param.buffer_count = 2;
        }
        for (bool nvme : {false, true}) {
          INFO("world " << world << " variant " << variant << " stage " << stage
                        << (nvme ? " nvme" : " cpu"));
          const WorldRun run = Train(Offloaded(c, nvme, 0.5), world, steps, /*async=*/true);
          RequireOk(run);
          CheckSame(run, reference);
          for (int k = 0; k < memory::kNumMemoryKinds; ++k) {
            CHECK(run.ranks[0].report.allocated[k] == run.ranks[0].report.planned[k]);
          }
        }
      }
    }
  }
}

TEST_CASE("Partial offload: HSDP groups split their shards the same way on every replica",
          "[zero][offload]") {
  // mics_shard_size 2 of world 4: a unit's group shard is kept or offloaded alike on all four
  // ranks (its size is the same everywhere), and the result is flat stage 3's without offload.
  const int steps = 4, world = 4;
  const WorldRun flat = Train(testing::TestConfig(3, DType::kBF16, 1, 0.05, false), world, steps);
  RequireOk(flat);
  for (int stage = 1; stage <= 3; ++stage) {
    for (double ratio : {0.3, 0.6}) {
      INFO("stage " << stage << " ratio " << ratio);
      Config c = testing::TestConfig(stage, DType::kBF16, 1, 0.05, false);
      c.zero.mics_shard_size = 2;
      c = Offloaded(c, /*nvme=*/false, ratio);
      const memory::Plan plan = PlanOf(c, world);
      REQUIRE(plan.device_state_elements > 0);
      REQUIRE(plan.offloaded_state_elements > 0);
      const WorldRun run = Train(c, world, steps);
      RequireOk(run);
      CheckSame(run, flat);
    }
  }
}

TEST_CASE(
    "Partial offload: snapshots do not depend on the ratio; state restored at another "
    "ratio trains on bit-identically",
    "[zero][offload][nvme]") {
  const int world = 2;
  for (int stage = 1; stage <= 3; ++stage) {
    for (bool nvme : {false, true}) {
      INFO("stage " << stage << (nvme ? " nvme" : " cpu"));
      const Config plain = testing::TestConfig(stage, DType::kBF16, 1, 0.05, false);
      const Config half = Offloaded(plain, nvme, 0.5);
      // Restored at ratio 1 (every unit offloaded) and at ratio 0 (every unit kept).
      const Config targets[] = {Offloaded(plain, nvme, 1.0), Offloaded(plain, nvme, 0.0)};
      auto device = CreateCpuDevice(CpuDeviceOptions());
      CheckAllOk(comm::testing::OnRanks(
          world, {20000}, [&](int, comm::Communicator* comm) -> absl::Status {
            ASSIGN_OR_RETURN(auto a, TrainedEngine(half, comm, device.get(), 3));
            {
              ASSIGN_OR_RETURN(auto b, TrainedEngine(plain, comm, device.get(), 3));
              RETURN_IF_ERROR(SameSnapshots(*a, *b, "snapshot at ratio 0.5 vs no offload"));
            }
            // Restored at another ratio, then trained on beside an engine that never stopped.
            std::vector<float> sa[3];
            RETURN_IF_ERROR(SnapshotOf(*a, sa));
            for (const Config& target : targets) {
              ASSIGN_OR_RETURN(auto b, TrainedEngine(plain, comm, device.get(), 3));
              ASSIGN_OR_RETURN(auto c, TrainedEngine(target, comm, device.get(), 0));
              RETURN_IF_ERROR(c->RestoreOwnedState(sa[0], sa[1], sa[2], a->state()));
              RETURN_IF_ERROR(testing::TrainSteps(*b, 3, 3));
              RETURN_IF_ERROR(testing::TrainSteps(*c, 3, 3));
              RETURN_IF_ERROR(SameMasters(*b, *c, "masters differ after restoring"));
              RETURN_IF_ERROR(SameSnapshots(*b, *c, "state differs after restoring"));
            }
            return absl::OkStatus();
          }));
    }
  }
}

TEST_CASE("Partial offload: a checkpoint saved at one ratio resumes at another bit for bit",
          "[zero][offload][ckpt]") {
  // Saved at ratio 0.5 after 3 steps, resumed at 1 (and the other ways round), 3 steps more:
  // the same masters as an uninterrupted run at ratio 0.5, and as one with no offload.
  const int world = 2, k = 3, m = 3;
  struct Case {
    int stage;
    bool nvme;
    double saved, resumed;
  };
  const Case cases[] = {{1, false, 0.5, 1.0}, {2, false, 0.5, 1.0}, {3, false, 0.5, 1.0},
                        {2, true, 0.5, 1.0},  {3, true, 0.3, 0.0},  {1, false, 1.0, 0.5},
                        {2, false, 0.0, 0.3}};
  for (const Case& c : cases) {
    DYNAMIC_SECTION("stage " << c.stage << (c.nvme ? " nvme" : " cpu") << " saved at " << c.saved
                             << ", resumed at " << c.resumed) {
      const Config plain = testing::TestConfig(c.stage, DType::kBF16, 1, 0.05, false);
      const Config saved = Offloaded(plain, c.nvme, c.saved);
      const Config resumed = Offloaded(plain, c.nvme, c.resumed);
      const std::string dir = testing::TestTmpDir() + "/partial_" + std::to_string(c.stage) +
                              (c.nvme ? "nvme" : "cpu") + std::to_string(c.saved) + "_" +
                              std::to_string(c.resumed);
      auto device = CreateCpuDevice(CpuDeviceOptions());
      std::vector<std::vector<float>> ref(world), plain_ref(world), got(world);
      CheckAllOk(comm::testing::OnRanks(
          world, {20000}, [&](int r, comm::Communicator* comm) -> absl::Status {
            ASSIGN_OR_RETURN(auto a, TrainedEngine(saved, comm, device.get(), k + m));
            ASSIGN_OR_RETURN(ref[r], a->GatherMasterWeights());
            ASSIGN_OR_RETURN(auto p, TrainedEngine(plain, comm, device.get(), k + m));
            ASSIGN_OR_RETURN(plain_ref[r], p->GatherMasterWeights());
            ASSIGN_OR_RETURN(auto b, TrainedEngine(saved, comm, device.get(), k));
            RETURN_IF_ERROR(SaveCheckpoint(*b, dir).status());
            // Other initial values: everything comes from the checkpoint.
            ASSIGN_OR_RETURN(auto e, Engine::Create(resumed, SmallModel(), comm, device.get()));
            RETURN_IF_ERROR(testing::SetInitValues(*e, 0.25f));
            RETURN_IF_ERROR(LoadCheckpoint(*e, dir));
            RETURN_IF_ERROR(testing::TrainSteps(*e, k, m));
            ASSIGN_OR_RETURN(got[r], e->GatherMasterWeights());
            return absl::OkStatus();
          }));
      for (int r = 0; r < world; ++r) {
        CHECK(BitEqual(got[r], ref[r]));
        CHECK(BitEqual(got[r], plain_ref[r]));
      }
    }
  }
}

TEST_CASE(
    "Partial offload: an NVMe write error undoes the whole step, the units on the device "
    "included; the retry matches",
    "[zero][nvme]") {
  const int world = 2;
  const Config plain = testing::TestConfig(2, DType::kBF16, 1, 0.05, false);
  const Config half = Offloaded(plain, /*nvme=*/true, 0.5);
  testing::NvmeWriteFault fault;  // installed until the end of the case
  auto device = CreateCpuDevice(CpuDeviceOptions());
  const std::vector<absl::Status> errors =
      comm::testing::OnRanks(world, {20000}, [&](int, comm::Communicator* comm) {
        // Neither part moves: the offloaded state is the file's previous copy, and the units on
        // the device are updated only after the host step succeeds.
        return testing::CheckWriteFaultUndone(plain, half, comm, device.get(), &fault);
      });
  CheckAllOk(errors);
}

}  // namespace
}  // namespace zerort
