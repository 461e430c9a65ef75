// hpZ (zero_optimization.zero_hpz_partition_size, ZeRO++) and MiCS's hierarchical gather
// (mics_hierarchical_params_gather) move parameters only: every gather copies bytes, so the
// fp32 masters, the parameters and every step's norm equal flat stage 3 bit for bit, with
// clipping, optimizer offload, fp32 accumulation and gradient accumulation. What changes is
// which ranks each all-gather runs over, which a counting communicator records here.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "base/status.h"
#include "comm/forwarding.h"
#include "zero/engine.h"
#include "zero/planner.h"
#include "zero/testing/synthetic_trainer.h"
#include "zero/testing/world_run.h"

namespace zerort {
namespace {

using testing::BitEqual;
using testing::RequireOk;
using testing::SmallModel;

// Forwards every call to `inner` and counts this rank's all-gathers by the size of the group
// they ran over (a Split's communicators count into the same log).
class CountingComm final : public comm::ForwardingCommunicator {
 public:
  // all-gathers by group size: calls and elements received
  struct Log {
    std::map<int, int64_t> calls;
    std::map<int, int64_t> elements;
  };
  CountingComm(std::unique_ptr<comm::Communicator> owned, Log* log)
      : ForwardingCommunicator(std::move(owned)), log_(log) {}
  CountingComm(comm::Communicator* inner, Log* log) : ForwardingCommunicator(inner), log_(log) {}

  absl::Status AllGather(const void* send, void* recv, size_t count, DType dtype,
                         comm::Stream s) override {
    if (count > 0) {
      log_->calls[size()] += 1;
      log_->elements[size()] += static_cast<int64_t>(count) * size();
    }
    return ForwardingCommunicator::AllGather(send, recv, count, dtype, s);
  }

 protected:
  absl::StatusOr<std::unique_ptr<comm::Communicator>> WrapSplit(
      int color, std::unique_ptr<comm::Communicator> sub) override {
    return std::unique_ptr<comm::Communicator>(new CountingComm(std::move(sub), log_));
  }

 private:
  Log* const log_;
};

struct Run : testing::WorldRun {
  std::vector<CountingComm::Log> logs;
  // Per rank: every parameter byte the trainer read after a Gather, in order (read_gathers).
  std::vector<std::vector<char>> seen;
};

// Gathers `u`, appends its parameters' bytes to `seen`, releases it.
absl::Status ReadUnit(Engine& e, int u, std::vector<char>* seen) {
  RETURN_IF_ERROR(e.Gather(u));
  const size_t c = DTypeSize(e.plan().options.compute_dtype);
  for (int i : e.plan().units[u].params) {
    ASSIGN_OR_RETURN(void* p, e.param(i));
    const size_t bytes = static_cast<size_t>(e.plan().params[i].numel) * c;
    const size_t at = seen->size();
    seen->resize(at + bytes);
    RETURN_IF_ERROR(e.device()->Copy(seen->data() + at, p, bytes, e.compute_stream()));
    RETURN_IF_ERROR(e.device()->Synchronize(e.compute_stream()));
  }
  return e.Release(u);
}

// The synthetic trainer's gradients do not depend on the parameters, so a wrong re-gather
// would not show in the masters: this loop reads what every gather hands the trainer. Each
// micro-step reads every unit in forward order, again in backward order (re-gathers: with hpZ
// from the node's secondary blocks), then runs the synthetic forward and backward and steps.
absl::Status TrainReading(const Config& config, comm::Communicator* comm, Device* device, int steps,
                          Device::Stream stream, std::vector<char>* seen) {
  EngineOptions options;
  options.compute_stream = stream;
  ASSIGN_OR_RETURN(std::unique_ptr<Engine> e,
                   Engine::Create(config, SmallModel(), comm, device, options));
  RETURN_IF_ERROR(testing::SetInitValues(*e));
  std::vector<std::vector<char>> host;
  for (int step = 0; step < steps; ++step) {
    for (int micro = 0; micro < config.gradient_accumulation_steps; ++micro) {
      for (int u = e->num_units() - 1; u >= 0; --u) RETURN_IF_ERROR(ReadUnit(*e, u, seen));
      for (int u = 0; u < e->num_units(); ++u) RETURN_IF_ERROR(ReadUnit(*e, u, seen));
      RETURN_IF_ERROR(testing::Backward(*e, step, micro, &host));
      RETURN_IF_ERROR(e->Step().status());
      RETURN_IF_ERROR(e->device()->Synchronize(e->compute_stream()));
      host.clear();
    }
  }
  return absl::OkStatus();
}

// `steps` optimizer steps of the synthetic trainer on `world` ranks (one thread each), on the
// in-process group, or with `stream_ordered` on the stream-ordered test group over a CPU device
// whose streams run late on threads of their own (the secondary blocks are then written and
// read by delayed stream work). Every rank's all-gathers are counted in its log.
Run Train(const Config& config, int world, int steps, bool stream_ordered = false,
          bool read_gathers = false) {
  testing::WorldOptions o =
      stream_ordered ? testing::StreamOrderedWorld() : testing::WorldOptions();
  o.timeout_ms = config.comm_timeout_ms;
  Run run;
  run.logs.resize(world);
  run.seen.resize(world);
  static_cast<testing::WorldRun&>(run) = testing::RunWorld(
      world, o,
      [&](int r, comm::Communicator* comm, Device* device,
          Device::Stream stream) -> absl::StatusOr<testing::TrainResult> {
        CountingComm counted(comm, &run.logs[r]);
        if (read_gathers) {
          RETURN_IF_ERROR(TrainReading(config, &counted, device, steps, stream, &run.seen[r]));
          return testing::TrainResult();
        }
        return testing::TrainRank(config, SmallModel(), &counted, device, steps, -1, -1, stream);
      });
  return run;
}

struct Variant {
  const char* name;
  bool offload;
  bool fp32_accum;
  int gas;
};

const Variant kVariants[] = {
    {"plain", false, false, 1},
    {"offload", true, false, 1},
    {"fp32 accumulation, 3 micro-steps", false, true, 3},
    {"offload, fp32 accumulation, 2 micro-steps", true, true, 2},
};

Config Make(int stage, const Variant& v) {
  Config c = testing::TestConfig(stage, DType::kBF16, v.gas, /*clip=*/0.05, v.offload);
  if (v.fp32_accum) c.grad_accum_dtype = DType::kF32;
  return c;
}

// Same masters, parameters and norms on every rank as the flat run's rank 0.
void RequireSameAsFlat(const Run& run, const Run& flat) {
  for (size_t r = 0; r < run.ranks.size(); ++r) {
    CAPTURE(r);
    CHECK(BitEqual(run.ranks[r].master, flat.ranks[0].master));
    CHECK(run.ranks[r].params == flat.ranks[0].params);
    REQUIRE(run.ranks[r].stats.size() == flat.ranks[0].stats.size());
    for (size_t k = 0; k < run.ranks[r].stats.size(); ++k) {
      CHECK(run.ranks[r].stats[k].grad_norm == flat.ranks[0].stats[k].grad_norm);
    }
  }
}

TEST_CASE(
    "hpZ: stage 3 with node-local re-gathers equals flat stage 3 bit for bit (2x2, 4x2, "
    "2x4)",
    "[zero][hpz]") {
  const int steps = 8;
  struct Shape {
    int world, k;  // k ranks per node: world / k nodes
  };
  for (Shape sh : {Shape{4, 2}, Shape{8, 2}, Shape{8, 4}}) {
    for (const Variant& v : kVariants) {
      INFO("world " << sh.world << " = " << sh.world / sh.k << " nodes of " << sh.k << ", "
                    << v.name);
      const Run flat = Train(Make(3, v), sh.world, steps);
      RequireOk(flat);
      bool clipped = false;
      for (const StepStats& s : flat.ranks[0].stats) clipped = clipped || s.clip_coef < 1;
      REQUIRE(clipped);  // the norm decides the update: a wrong norm changes the masters
      Config c = Make(3, v);
      c.zero.zero_hpz_partition_size = sh.k;
      const Run hpz = Train(c, sh.world, steps);
      RequireOk(hpz);
      RequireSameAsFlat(hpz, flat);
      for (int r = 0; r < sh.world; ++r) {
        CAPTURE(r);
        // The trainer's gathers are the same; those after a unit's first since the update ran
        // within the node, of 1/K of the unit each: every world-wide gather that hpZ did not
        // make is one node gather instead.
        const CountingComm::Log& h = hpz.logs[r];
        const CountingComm::Log& f = flat.logs[r];
        REQUIRE(h.calls.count(sh.k) == 1);
        CHECK(h.calls.at(sh.k) > 0);
        CHECK(h.calls.at(sh.world) + h.calls.at(sh.k) == f.calls.at(sh.world));
        CHECK(h.calls.size() == 2);  // no group but the world and the node
        // A node gather receives the whole unit: its elements are those of the flat gathers
        // it replaces.
        CHECK(h.elements.at(sh.world) + h.elements.at(sh.k) == f.elements.at(sh.world));
        // The engine's own count of bytes sent falls by (W-1)/W - (K-1)/K of each.
        CHECK(hpz.ranks[r].stats.back().comm_bytes < flat.ranks[r].stats.back().comm_bytes);
        // Allocated exactly as planned, hpz_secondary included.
        for (int k = 0; k < memory::kNumMemoryKinds; ++k) {
          const MemoryReport& m = hpz.ranks[r].report;
          CHECK(m.allocated[k] >= m.planned[k]);
          CHECK(m.allocated[k] - m.planned[k] <= 4352 * 64);  // alignment slack (arena.h)
        }
      }
    }
  }
}

TEST_CASE("hpZ: on the stream-ordered group with delayed streams stage 3 equals flat",
          "[zero][hpz]") {
  // The secondary block is copied out of the gather slot on the comm stream and read by the
  // node gathers there, while the trainer's compute stream runs late: a missing order would
  // gather a stale or half-written block.
  const int steps = 5;
  for (const Variant& v : {kVariants[0], kVariants[2]}) {
    INFO(v.name);
    const Run flat = Train(Make(3, v), 4, steps, /*stream_ordered=*/true);
    RequireOk(flat);
    Config c = Make(3, v);
    c.zero.zero_hpz_partition_size = 2;
    const Run hpz = Train(c, 4, steps, /*stream_ordered=*/true);
    RequireOk(hpz);
    RequireSameAsFlat(hpz, flat);
    CHECK(hpz.logs[0].calls.at(2) > 0);
  }
}

TEST_CASE("MiCS hierarchical gather: shard groups spanning nodes equal flat stage 3 bit for bit",
          "[zero][hpz][hsdp]") {
  const int steps = 6;
  struct Shape {
    int world, group, per_node;
  };
  // 8 ranks: groups of 4 over 2 nodes of 2; one group of 8 over 4 nodes of 2 and 2 nodes of 4.
  for (Shape sh : {Shape{8, 4, 2}, Shape{8, 8, 2}, Shape{8, 8, 4}, Shape{4, 4, 2}}) {
    for (const Variant& v : {kVariants[0], kVariants[1], kVariants[3]}) {
      const Run flat = Train(Make(3, v), sh.world, steps);
      RequireOk(flat);
      for (int stage : {1, 3}) {
        INFO("world " << sh.world << ", groups of " << sh.group << ", " << sh.per_node
                      << " ranks per node, stage " << stage << ", " << v.name);
        Config c = Make(stage, v);
        c.zero.mics_shard_size = sh.group;
        c.zero.mics_hierarchical_params_gather = true;
        c.ranks_per_node = sh.per_node;
        const Run mics = Train(c, sh.world, steps);
        RequireOk(mics);
        for (int r = 0; r < sh.world; ++r) {
          CAPTURE(r);
          CHECK(BitEqual(mics.ranks[r].master, flat.ranks[0].master));
          CHECK(mics.ranks[r].params == flat.ranks[0].params);
          // Each parameter gather: one across the group's nodes, then one per node of the
          // group within the node.
          const CountingComm::Log& log = mics.logs[r];
          const int nodes = sh.group / sh.per_node;
          REQUIRE(log.calls.count(nodes) == 1);
          REQUIRE(log.calls.count(sh.per_node) == 1);
          // (Told apart by group size only where the two steps' groups differ in size.)
          if (nodes != sh.per_node) CHECK(log.calls.at(sh.per_node) == nodes * log.calls.at(nodes));
        }
      }
    }
  }
}

TEST_CASE("MiCS hierarchical gather on the stream-ordered group with delayed streams",
          "[zero][hpz][hsdp]") {
  const Variant v = kVariants[0];
  const Run flat = Train(Make(3, v), 4, 5, /*stream_ordered=*/true);
  RequireOk(flat);
  for (int stage : {2, 3}) {
    INFO("stage " << stage);
    Config c = Make(stage, v);
    c.zero.mics_shard_size = 4;
    c.zero.mics_hierarchical_params_gather = true;
    c.ranks_per_node = 2;
    const Run mics = Train(c, 4, 5, /*stream_ordered=*/true);
    RequireOk(mics);
    for (int r = 0; r < 4; ++r) {
      CAPTURE(r);
      CHECK(BitEqual(mics.ranks[r].master, flat.ranks[0].master));
      CHECK(mics.ranks[r].params == flat.ranks[0].params);
    }
  }
}

TEST_CASE(
    "hpZ and the hierarchical gather: every gather hands the trainer flat stage 3's "
    "parameters",
    "[zero][hpz]") {
  // Re-gathers within a step (hpZ's node gathers) and every two-step gather are compared, byte
  // for byte, with what flat stage 3 hands the trainer at the same point; on the in-process
  // group and on the stream-ordered one with delayed streams.
  for (bool stream_ordered : {false, true}) {
    for (int gas : {1, 2}) {
      const Variant v{"", false, false, gas};
      INFO((stream_ordered ? "stream-ordered" : "in-process") << ", " << gas << " micro-steps");
      const Run flat = Train(Make(3, v), 8, 3, stream_ordered, /*read_gathers=*/true);
      RequireOk(flat);
      REQUIRE(!flat.seen[0].empty());
      struct Layout {
        const char* name;
        int hpz, mics, per_node;
      };
      for (Layout l : {Layout{"hpZ 4", 4, -1, 0}, Layout{"hpZ 2", 2, -1, 0},
                       Layout{"MiCS 8, hierarchical over 2 per node", 1, 8, 2},
                       Layout{"MiCS 4, hierarchical over 2 per node", 1, 4, 2}}) {
        INFO(l.name);
        Config c = Make(3, v);
        c.zero.zero_hpz_partition_size = l.hpz;
        c.zero.mics_shard_size = l.mics;
        c.zero.mics_hierarchical_params_gather = l.mics > 0;
        c.ranks_per_node = l.per_node;
        const Run run = Train(c, 8, 3, stream_ordered, /*read_gathers=*/true);
        RequireOk(run);
        for (int r = 0; r < 8; ++r) {
          CAPTURE(r);
          CHECK(run.seen[r] == flat.seen[0]);
        }
        if (l.hpz > 1) CHECK(run.logs[0].calls.at(l.hpz) > 0);
      }
    }
  }
}

TEST_CASE("hpZ and the hierarchical gather: what is not supported is refused by name",
          "[zero][hpz]") {
  const Variant v = kVariants[0];
  struct Bad {
    const char* why;
    Config config;
    int world;
    const char* names;
  };
  std::vector<Bad> bad;
  auto hpz = [&](int stage, int k) {
    Config c = Make(stage, v);
    c.zero.zero_hpz_partition_size = k;
    return c;
  };
  bad.push_back({"not a divisor", hpz(3, 3), 4, "zero_hpz_partition_size"});
  bad.push_back({"stage 2", hpz(2, 2), 4, "requires stage 3"});
  Config with_mics = hpz(3, 2);
  with_mics.zero.mics_shard_size = 2;
  bad.push_back({"with MiCS", with_mics, 4, "mics_shard_size 2"});
  Config with_param = hpz(3, 2);
  with_param.zero.offload_param.device = OffloadDevice::kCpu;
  bad.push_back({"with offload_param", with_param, 4, "offload_param"});
  Config no_node = Make(3, v);
  no_node.zero.mics_shard_size = 4;
  no_node.zero.mics_hierarchical_params_gather = true;
  bad.push_back({"no ranks per node", no_node, 8, "zerort.ranks_per_node"});
  Config in_node = no_node;
  in_node.ranks_per_node = 4;
  bad.push_back({"group within a node", in_node, 8, "span whole nodes"});
  Config no_mics = Make(3, v);
  no_mics.zero.mics_hierarchical_params_gather = true;
  no_mics.ranks_per_node = 2;
  bad.push_back({"without mics_shard_size", no_mics, 8, "requires mics_shard_size"});
  Config odd_node = Make(3, v);
  odd_node.ranks_per_node = 3;
  bad.push_back({"ranks_per_node not a divisor", odd_node, 8, "zerort.ranks_per_node"});
  for (const Bad& b : bad) {
    INFO(b.why);
    auto choice = ChoosePlan(SmallModel(), b.config, b.world, 0);
    REQUIRE(!choice.ok());
    CHECK(choice.status().code() == absl::StatusCode::kInvalidArgument);
    INFO(choice.status().message());
    CHECK(absl::StrContains(choice.status().message(), b.names));
  }
}

TEST_CASE(
    "hpZ: the plan holds 1/K of every gathered unit as secondary blocks and counts the "
    "node gathers",
    "[zero][hpz]") {
  const Variant v{"4 micro-steps", false, false, 4};
  Config c = Make(3, v);
  auto flat = ChoosePlan(SmallModel(), c, 8, 5);
  c.zero.zero_hpz_partition_size = 4;
  auto hpz = ChoosePlan(SmallModel(), c, 8, 5);
  REQUIRE(flat.ok());
  REQUIRE(hpz.ok());
  const memory::Plan& p = hpz->plan;
  int64_t gathered = 0, padded = 0, units = 0;  // padded: of every gathered unit, all equal
  for (const memory::Unit& u : p.units) {
    if (u.persistent) continue;
    gathered += u.padded;
    REQUIRE((padded == 0 || u.padded == padded));
    padded = u.padded;
    ++units;
  }
  REQUIRE(gathered > 0);
  const memory::Buffer* secondary = p.Find(memory::BufferClass::kHpzSecondary);
  REQUIRE(secondary != nullptr);
  CHECK(secondary->kind == memory::MemoryKind::kDevice);
  CHECK(secondary->elements == gathered / 4);
  CHECK(p.device_bytes() == flat->plan.device_bytes() + secondary->bytes);
  // The same gathers in both (the slots are the same): each unit's first of the step over 8
  // ranks (7/8 of it), the others over 4 ranks (3/4 of it) instead of 8, in bf16. The slots keep
  // some units across each turn of direction, so fewer than 2 x 4 per unit are gathered.
  CHECK(p.stage3_gathers_per_step == flat->plan.stage3_gathers_per_step);
  CHECK(p.stage3_gathers_per_step < 2 * 4 * units);
  const int64_t again = p.stage3_gathers_per_step - units;
  CHECK(flat->plan.comm_bytes_per_step - p.comm_bytes_per_step ==
        again * (padded / 8 * 7 - padded / 4 * 3) * 2);
  CHECK(flat->plan.Find(memory::BufferClass::kHpzSecondary) == nullptr);
}

}  // namespace
}  // namespace zerort
