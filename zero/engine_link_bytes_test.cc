// The plan's bytes per link class (memory/plan.h: comm_bytes_intra_node_per_step and
// comm_bytes_inter_node_per_step) against what the engine sends, measured at world 8 on the
// in-process group through comm::CountLinkBytes, for every layout that splits traffic by node: flat
// stages 1-3, HSDP, MiCS's hierarchical gather and hpZ, with 2 and 4 ranks per node.
#include <algorithm>
#include <catch2/catch.hpp>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "comm/inprocess.h"
#include "comm/link_bytes.h"
#include "device/cpu_device.h"
#include "zero/engine.h"
#include "zero/testing/synthetic_trainer.h"

namespace zerort {
namespace {

constexpr int kWorld = 8;

struct RankBytes {
  absl::Status status;
  comm::LinkBytes measured;  // over the measured steps
  comm::LinkBytes planned;   // per step
  int64_t planned_total = 0;
  int units = 0;
  int64_t gather_slots = 0;
  int gathered_units = 0;       // stage 3: units gathered by Gather (not persistent)
  int64_t gathered_padded = 0;  // their padded size, when all equal; -1 if they differ
  std::string log;
};

// Trains `warm` steps, then counts what each rank sends during `steps` more.
std::vector<RankBytes> Measure(const Config& config, int per_node, int warm, int steps) {
  CpuDeviceOptions o;
  o.threads = 1;  // eight ranks already share two cores
  std::unique_ptr<Device> device = CreateCpuDevice(o);
  auto comms = comm::CreateInProcessGroup(kWorld);
  REQUIRE(comms.ok());
  std::vector<RankBytes> out(kWorld);
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      RankBytes& mine = out[r];
      mine.status = [&]() -> absl::Status {
        comm::LinkByteLog log;
        ASSIGN_OR_RETURN(std::unique_ptr<comm::Communicator> counted,
                         comm::CountLinkBytes((*comms)[r].get(), per_node, &log));
        ASSIGN_OR_RETURN(std::unique_ptr<Engine> e, Engine::Create(config, testing::SmallModel(),
                                                                   counted.get(), device.get()));
        RETURN_IF_ERROR(testing::SetInitValues(*e));
        RETURN_IF_ERROR(testing::TrainSteps(*e, 0, warm));
        log.Clear();
        RETURN_IF_ERROR(testing::TrainSteps(*e, warm, steps));
        mine.measured = log.Total();
        mine.log = log.ToString();
        const memory::Plan& p = e->plan();
        mine.planned = {p.comm_bytes_intra_node_per_step, p.comm_bytes_inter_node_per_step};
        mine.planned_total = p.comm_bytes_per_step;
        mine.units = static_cast<int>(p.units.size());
        for (const memory::Unit& u : p.units) {
          absl::StrAppend(&mine.log, "\nunit ", u.name, " padded ", u.padded, " shard ", u.shard,
                          u.persistent ? " persistent" : "", u.frozen ? " frozen" : "");
        }
        absl::StrAppend(&mine.log, "\nslots ", p.gather_slots);
        mine.gather_slots = p.gather_slots;
        for (const memory::Unit& u : p.units) {
          if (u.persistent) continue;
          if (mine.gathered_units++ == 0) mine.gathered_padded = u.padded;
          if (u.padded != mine.gathered_padded) mine.gathered_padded = -1;
        }
        return absl::OkStatus();
      }();
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

struct Layout {
  const char* name;
  int stage;
  int mics;  // mics_shard_size; -1 flat
  bool hierarchical;
  int hpz;
};

// What the engine sends each step that the plan leaves out, as a small fixed exchange over the
// world (zero/internal/grad_norm.cc, zero/internal/step_control.cc): the norm table, every rank's
// units + 1 fp32 partials (stages 1-3; stage 0 reduces whole gradients and needs none), and
// AgreeBeforeUpdate's six 64-bit words.
int64_t ControlBytes(int stage, int units) {
  const int64_t norm_table = stage >= 1 ? (kWorld - 1) * (units + 1) * 4 : 0;
  const int64_t agree_before_update = (kWorld - 1) * 6 * 8;
  return norm_table + agree_before_update;
}

// Bytes this rank sends, per link class, for one stage-3 re-gather of a unit of `padded` elements
// in bf16, as the plan counts a collective ((n - 1) / n of the unit over the n ranks of the group;
// all of it inter-node when the group spans nodes): over the shard group, or (hpZ) the K ranks of
// the node, or (MiCS hierarchical) 1/G of it to each other node of the group and then G/L blocks
// within the node. Written out here from the layouts' definitions, not taken from memory/plan.cc.
comm::LinkBytes RegatherBytes(const Layout& l, int per_node, int rank, int64_t padded) {
  const int64_t e = 2;  // bf16
  comm::LinkBytes b;
  const int group = l.hpz > 1 ? l.hpz : (l.mics > 0 ? l.mics : kWorld);
  if (l.hierarchical) {
    const int64_t c = padded / group, nodes = group / per_node;
    b.inter_node = c * (nodes - 1) * e;
    b.intra_node = c * nodes * (per_node - 1) * e;
    return b;
  }
  const int first = rank - rank % group, last = first + group - 1;
  const int64_t bytes = padded / group * (group - 1) * e;
  (first / per_node == last / per_node ? b.intra_node : b.inter_node) = bytes;
  return b;
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
        const std::vector<RankBytes> ranks = Measure(c, per_node, warm, steps);
        for (int r = 0; r < kWorld; ++r) {
          const RankBytes& b = ranks[r];
          INFO("rank " << r << ": " << b.status.ToString() << "\nmeasured " << b.log);
          REQUIRE(b.status.ok());
          REQUIRE(b.planned.total() == b.planned_total);
          REQUIRE(b.planned_total > 0);
          // Stage 3: the plan counts a gather of every unit at every Gather (2 x gas per step), but
          // a unit still in its slot is not gathered again (zero/internal/param_gatherer.h: slots
          // are reused least recently used first). At each of the window's 2 x gas - 1 turns of
          // direction (forward to backward and back; the update empties the slots before the next
          // window) the first units of the new pass are the last of the one before, still held by
          // the slots: min(slots, units) re-gathers skipped per turn.
          comm::LinkBytes skipped;
          if (l.stage == 3) {
            REQUIRE(b.gathered_padded > 0);  // one size class: every slot holds any unit
            const int64_t turns = 2 * gas - 1;
            const int64_t hits = turns * std::min<int64_t>(b.gather_slots, b.gathered_units);
            const comm::LinkBytes one = RegatherBytes(l, per_node, r, b.gathered_padded);
            skipped = {hits * one.intra_node, hits * one.inter_node};
          }
          // Per step: the plan's figure less the skipped re-gathers, plus the control exchange,
          // which runs over the world and so crosses nodes whatever the node size.
          CHECK(b.measured.intra_node == steps * (b.planned.intra_node - skipped.intra_node));
          CHECK(b.measured.inter_node == steps * (b.planned.inter_node - skipped.inter_node +
                                                  ControlBytes(l.stage, b.units)));
        }
      }
    }
  }
}

}  // namespace
}  // namespace zerort
