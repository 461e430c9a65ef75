// The plan's bytes per link class (memory/plan.h: comm_bytes_intra_node_per_step and
// comm_bytes_inter_node_per_step) against what the engine sends, measured at world 8 on the
// in-process group through comm::CountLinkBytes, for every layout that splits traffic by node: flat
// stages 1-3, HSDP, MiCS's hierarchical gather and hpZ, with 2 and 4 ranks per node; and for NVMe
// offload, whose I/O agreements are part of the plan's control exchange.
#include <catch2/catch.hpp>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "base/testing/temp_dir.h"
#include "comm/link_bytes.h"
#include "device/cpu_device.h"
#include "zero/engine.h"
#include "zero/testing/link_bytes_check.h"
#include "zero/testing/synthetic_trainer.h"

namespace zerort {
namespace {

constexpr int kWorld = 8;

// Trains `warm` steps, then counts what each rank sends during `steps` more.
std::vector<testing::RankLinkBytes> Measure(
    const Config& config, int per_node, int warm, int steps,
    const std::vector<memory::ParamSpec>& specs = testing::SmallModel()) {
  CpuDeviceOptions o;
  o.threads = 1;  // eight ranks already share two cores
  std::unique_ptr<Device> device = CreateCpuDevice(o);
  absl::StatusOr<std::vector<testing::RankLinkBytes>> ranks = testing::MeasureLinkBytes(
      kWorld, per_node,
      [&](comm::Communicator* comm, comm::LinkByteLog* log) -> absl::StatusOr<memory::Plan> {
        ASSIGN_OR_RETURN(std::unique_ptr<Engine> e,
                         Engine::Create(config, specs, comm, device.get()));
        RETURN_IF_ERROR(testing::SetInitValues(*e));
        RETURN_IF_ERROR(testing::TrainSteps(*e, 0, warm));
        log->Clear();
        RETURN_IF_ERROR(testing::TrainSteps(*e, warm, steps));
        return e->plan();
      });
  INFO(ranks.status().ToString());
  REQUIRE(ranks.ok());
  return *std::move(ranks);
}

struct Layout {
  const char* name;
  int stage;
  int mics;  // mics_shard_size; -1 flat
  bool hierarchical;
  int hpz;
};

// The control exchange, written out from the code that sends it over the world
// (zero/internal/grad_norm.cc, zero/internal/step_control.cc), not taken from memory/plan.cc:
// the norm table, every rank's units + 1 fp32 partials (stages 1-3; stage 0 reduces whole
// gradients and needs none), and AgreeBeforeUpdate's six 64-bit words.
int64_t ControlBytes(int stage, int units) {
  const int64_t norm_table = stage >= 1 ? (kWorld - 1) * (units + 1) * 4 : 0;
  const int64_t agree_before_update = (kWorld - 1) * 6 * 8;
  return norm_table + agree_before_update;
}

// What rank r sent per step equals its plan, byte for byte and class for class.
void CheckSentEqualsPlan(int r, const testing::RankLinkBytes& b, int steps) {
  const testing::LinkBytesComparison cmp = testing::CompareWithPlan(b.plan, b.sent, steps);
  INFO("rank " << r << ": " << cmp.ToString() << "\nmeasured " << b.log);
  CHECK(cmp.divisible);
  CHECK(cmp.measured.intra_node == cmp.planned.intra_node);
  CHECK(cmp.measured.inter_node == cmp.planned.inter_node);
}

TEST_CASE(
    "Link bytes: the engine sends, per link class, the bytes the plan "
    "counts (world 8)",
    "[zero][hsdp][hpz]") {
  const int warm = 2, steps = 2;
  const Layout layouts[] = {
      {"flat stage 1", 1, -1, false, 1},
      {"flat stage 2", 2, -1, false, 1},
      {"flat stage 3", 3, -1, false, 1},
      {"HSDP 2 groups of 4, stage 3", 3, 4, false, 1},
      {"HSDP 4 groups of 2, stage 3", 3, 2, false, 1},
      {"HSDP 2 groups of 4, stage 2", 2, 4, false, 1},
      {"MiCS 2 groups of 4, hierarchical gather, stage 3", 3, 4, true, 1},
      {"MiCS one group of 8, hierarchical gather, stage 3", 3, 8, true, 1},
      {"MiCS 2 groups of 4, hierarchical gather, stage 1", 1, 4, true, 1},
      {"hpZ 2, stage 3", 3, -1, false, 2},
      {"hpZ 4, stage 3", 3, -1, false, 4},
  };
  // One to three micro-steps: hpZ's node gathers are 2 x gas - 1 of each unit's 2 x gas per
  // step, and so are the turns of direction at which stage 3 re-uses its slots.
  for (int gas : {1, 2, 3}) {
    for (int per_node : {2, 4}) {
      for (const Layout& l : layouts) {
        // The hierarchical gather needs groups spanning more than one node.
        if (l.hierarchical && l.mics <= per_node) continue;
        INFO(l.name << ", " << per_node << " ranks per node, " << gas << " micro-steps");
        Config c = testing::TestConfig(l.stage, DType::kBF16, gas, /*clip=*/0.05,
                                       /*offload=*/false);
        c.zero.mics_shard_size = l.mics;
        c.zero.mics_hierarchical_params_gather = l.hierarchical;
        c.zero.zero_hpz_partition_size = l.hpz;
        c.ranks_per_node = per_node;
        const std::vector<testing::RankLinkBytes> ranks = Measure(c, per_node, warm, steps);
        for (int r = 0; r < kWorld; ++r) {
          const testing::RankLinkBytes& b = ranks[r];
          const testing::LinkBytesComparison cmp = testing::CompareWithPlan(b.plan, b.sent, steps);
          INFO("rank " << r << ": " << cmp.ToString() << "\nmeasured " << b.log);
          REQUIRE(cmp.planned.total() == b.plan.comm_bytes_per_step);
          REQUIRE(cmp.planned.total() > 0);
          // The control exchange is the plan's own named part, counted in the class it travels:
          // over the world, which spans nodes at every node size here.
          CHECK(b.plan.comm_control_bytes_per_step ==
                ControlBytes(l.stage, static_cast<int>(b.plan.units.size())));
          // Everything the engine sends equals the plan: stage 3's gathers as the slots make
          // them (a unit still held is not gathered again), the control exchange included.
          CheckSentEqualsPlan(r, b, steps);
        }
      }
    }
  }
}

// Units of two slot size classes and a frozen unit: the plan's replay of the slots must follow
// the engine's per class (the large unit alone in its slot, five small units in three slots;
// the frozen unit gathered in both passes like the others, and one slot more for it).
TEST_CASE("Link bytes: stage-3 gathers of two size classes and a frozen unit equal the plan's",
          "[zero][hpz]") {
  std::vector<memory::ParamSpec> specs = {{"big.w", {3000}, "big"}, {"a.w", {150}, "a"},
                                          {"b.w", {150}, "b"},      {"c.w", {150}, "c"},
                                          {"d.w", {150}, "d"},      {"e.w", {150}, "e"}};
  specs[4].frozen = true;
  const Layout layouts[] = {
      {"flat stage 3", 3, -1, false, 1},
      {"MiCS 2 groups of 4, hierarchical gather, stage 3", 3, 4, true, 1},
      {"hpZ 2, stage 3", 3, -1, false, 2},
  };
  const int per_node = 2, warm = 1, steps = 2;
  for (int gas : {1, 3}) {
    for (const Layout& l : layouts) {
      INFO(l.name << ", " << gas << " micro-steps");
      Config c = testing::TestConfig(l.stage, DType::kBF16, gas, /*clip=*/0.05,
                                     /*offload=*/false);
      c.zero.mics_shard_size = l.mics;
      c.zero.mics_hierarchical_params_gather = l.hierarchical;
      c.zero.zero_hpz_partition_size = l.hpz;
      c.ranks_per_node = per_node;
      const std::vector<testing::RankLinkBytes> ranks = Measure(c, per_node, warm, steps, specs);
      const memory::Plan& plan = ranks[0].plan;
      // The case is about what it says: six gathered units, one frozen, two slot classes with
      // fewer small slots than small units.
      REQUIRE(plan.units.size() == 6);
      REQUIRE(plan.trainable_units == 5);
      const memory::Buffer* slots = plan.Find(memory::BufferClass::kGatherBuffer);
      REQUIRE(slots != nullptr);
      REQUIRE(slots->slot_elements.size() == 4);
      REQUIRE(slots->slot_elements.front() < slots->slot_elements.back());
      for (int r = 0; r < kWorld; ++r) CheckSentEqualsPlan(r, ranks[r], steps);
    }
  }
}

// NVMe offload adds agreements to the control exchange (comm::AgreeOnStatus, one 64-bit code
// per rank wherever a file's I/O may fail): after each stage-3 gather of a shard read from the
// parameter file, after each persistent unit's refresh, and after each part of the update that
// writes a file. The plan counts them; the engine's sends must match, class for class.
TEST_CASE("Link bytes: NVMe offload's agreements are in the plan's control bytes", "[zero]") {
  struct NvmeLayout {
    const char* name;
    int stage;
    bool optimizer_nvme;
    double ratio;  // offload_optimizer.ratio
    bool param_nvme;
  };
  const NvmeLayout layouts[] = {
      {"stage 1, optimizer on NVMe", 1, true, 1.0, false},
      {"stage 2, half the optimizer on NVMe", 2, true, 0.5, false},
      {"stage 3, optimizer on NVMe", 3, true, 1.0, false},
      {"stage 3, parameters on NVMe", 3, false, 1.0, true},
      {"stage 3, parameters and optimizer on NVMe", 3, true, 1.0, true},
      {"stage 3, parameters and half the optimizer on NVMe", 3, true, 0.5, true},
  };
  const int per_node = 4, warm = 1, steps = 2;
  for (int gas : {1, 2}) {
    for (const NvmeLayout& l : layouts) {
      INFO(l.name << ", " << gas << " micro-steps");
      Config c = testing::TestConfig(l.stage, DType::kBF16, gas, /*clip=*/0.05,
                                     /*offload=*/false);
      const std::string dir = testing::TempDir("link_bytes_nvme_");
      if (l.optimizer_nvme) {
        c.zero.offload_optimizer.device = OffloadDevice::kNvme;
        c.zero.offload_optimizer.nvme_path = dir;
        c.zero.offload_optimizer.ratio = l.ratio;
      }
      if (l.param_nvme) {
        c.zero.offload_param.device = OffloadDevice::kNvme;
        c.zero.offload_param.nvme_path = dir;
        c.zero.offload_param.buffer_size = 1024;
        // Some of SmallModel's units (those of at most 160 elements) stay whole on every rank.
        c.zero.stage3_param_persistence_threshold = 160;
      }
      c.aio.block_size = 8192;
      c.aio.queue_depth = 2;
      c.ranks_per_node = per_node;
      const std::vector<testing::RankLinkBytes> ranks = Measure(c, per_node, warm, steps);
      for (int r = 0; r < kWorld; ++r) {
        const testing::RankLinkBytes& b = ranks[r];
        INFO("rank " << r);
        // The case is about what it says: agreements beyond the norm table and the pre-update
        // agreement (and, with parameters on NVMe, persistent units among the gathered ones).
        REQUIRE(b.plan.comm_control_bytes_per_step >
                ControlBytes(l.stage, static_cast<int>(b.plan.units.size())));
        if (l.param_nvme) {
          int persistent = 0;
          for (const memory::Unit& u : b.plan.units) persistent += u.persistent;
          REQUIRE(persistent > 0);
          REQUIRE(persistent < static_cast<int>(b.plan.units.size()));
        }
        CheckSentEqualsPlan(r, b, steps);
      }
    }
  }
}

}  // namespace
}  // namespace zerort
