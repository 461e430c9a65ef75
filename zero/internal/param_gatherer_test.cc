#include "zero/internal/param_gatherer.h"

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "comm/forwarding.h"
#include "device/cpu_device.h"
#include "zero/internal/engine_memory.h"
#include "zero/internal/shard_layout.h"
#include "zero/internal/test_util.h"

namespace zerort {
namespace zero_internal {
namespace {

float Full(int unit, int64_t e, float gen) { return gen * 1000 + unit * 100 + 0.5f * e; }

// Checks that every parameter of `unit` reads Full(unit, offset in unit, gen).
absl::Status Expect(const memory::Plan& plan, const ParamGatherer& g, int unit, float gen) {
  for (int i : plan.units[unit].params) {
    const memory::ParamLayout& p = plan.params[i];
    ASSIGN_OR_RETURN(void* ptr, g.Param(p));
    for (int64_t k = 0; k < p.numel; ++k) {
      if (static_cast<float*>(ptr)[k] != Full(unit, p.offset_in_unit + k, gen)) {
        return absl::InternalError(absl::StrCat("unit ", unit, " param ", i, " element ", k));
      }
    }
  }
  return absl::OkStatus();
}

// Stage-3 plan options for rank r of `comm`, fp32, no persistent units.
memory::PlanOptions Stage3Options(int r, const comm::Communicator& comm) {
  memory::PlanOptions o;
  o.stage = 3;
  o.world_size = comm.size();
  o.rank = r;
  o.compute_dtype = DType::kF32;
  o.shard_alignment = 8;
  o.persistence_threshold = 0;
  return o;
}

// A ParamGatherer over rank r's memory for `plan`, with the parts it is built on.
struct Gathering {
  static absl::StatusOr<std::unique_ptr<Gathering>> Create(memory::Plan plan, int r,
                                                           comm::Communicator* comm, Device* dev) {
    std::unique_ptr<Gathering> g(new Gathering(std::move(plan), r, comm));
    ASSIGN_OR_RETURN(g->mem, EngineMemory::Allocate(g->plan, dev, nullptr));
    ASSIGN_OR_RETURN(g->streams,
                     StreamOrder::Create(dev, nullptr, comm, 0, g->mem->gather_slots().count));
    g->WriteShards(1);
    g->layout = std::make_unique<ShardLayout>(g->plan, g->mem->model_state());
    ASSIGN_OR_RETURN(g->store,
                     UnitStore::Create(g->plan, *g->layout, *g->mem, {}, dev, nullptr, nullptr));
    g->gatherer = std::make_unique<ParamGatherer>(
        UnitContext(g->plan, comm, dev, g->streams.get(), &g->timer), g->mem->model_state().params,
        g->mem->gather_slots(), g->mem->persistent(), g->store.get());
    return g;
  }

  // Every unit's shard of this rank: Full(unit, its elements, gen).
  void WriteShards(float gen) {
    float* shard = reinterpret_cast<float*>(mem->model_state().params);
    for (const memory::Unit& u : plan.units) {
      for (int64_t e = 0; e < u.shard; ++e) {
        shard[u.shard_offset + e] = Full(&u - plan.units.data(), rank * u.shard + e, gen);
      }
    }
  }

  const memory::Plan plan;
  const int rank;
  StepTimer timer;
  std::unique_ptr<EngineMemory> mem;
  std::unique_ptr<StreamOrder> streams;
  std::unique_ptr<ShardLayout> layout;
  std::unique_ptr<UnitStore> store;
  std::unique_ptr<ParamGatherer> gatherer;

 private:
  Gathering(memory::Plan p, int r, comm::Communicator* comm)
      : plan(std::move(p)), rank(r), timer(comm->size(), 4) {}
};

absl::Status Run(int r, comm::Communicator* comm, Device* dev) {
  memory::PlanOptions o = Stage3Options(r, *comm);
  o.unit_target_elements = 300;
  o.prefetch_elements = 0;  // one gather slot: 1 + ceil(0 / largest unit)
  ASSIGN_OR_RETURN(
      auto fx, Gathering::Create(memory::MakePlan(testing::SmallModel(), o).value(), r, comm, dev));
  const memory::Plan& plan = fx->plan;
  ParamGatherer& g = *fx->gatherer;
  if (fx->mem->gather_slots().count != 1) return absl::InternalError("expected one slot");
  RETURN_IF_ERROR(g.Gather(0));
  RETURN_IF_ERROR(Expect(plan, g, 0, 1));
  const absl::Status held = g.Gather(1);
  if (!absl::IsFailedPrecondition(held) ||
      !absl::StrContains(held.message(), "stage3_prefetch_bucket_size")) {
    return absl::InternalError(absl::StrCat("all slots held: ", held.ToString()));
  }
  RETURN_IF_ERROR(g.Release(0));
  RETURN_IF_ERROR(g.Gather(1));  // evicts unit 0
  RETURN_IF_ERROR(Expect(plan, g, 1, 1));
  if (g.Param(plan.params[plan.units[0].params[0]]).ok()) {
    return absl::InternalError("unit 0 is still readable after its slot was reused");
  }
  // After an update the released copy is stale: Invalidate makes the next Gather fetch again.
  RETURN_IF_ERROR(g.Release(1));
  fx->WriteShards(2);
  g.Invalidate();
  RETURN_IF_ERROR(g.Gather(1));
  RETURN_IF_ERROR(Expect(plan, g, 1, 2));
  return g.Release(1);
}

TEST_CASE("ParamGatherer: gathered units equal the concatenated shards; slots are reused LRU",
          "[zero]") {
  auto dev = CreateCpuDevice();
  const auto statuses =
      OnRanks(2, [&](int r, comm::Communicator* comm) { return Run(r, comm, dev.get()); });
  for (const absl::Status& s : statuses) {
    INFO(s);
    REQUIRE(s.ok());
  }
}

// One large module and four small ones, one unit each: gather slots of two size classes, two
// of a small unit (1 + ceil(prefetch 1 / 104)) and one of the large one.
absl::Status RunClasses(int r, comm::Communicator* comm, Device* dev) {
  std::vector<memory::ParamSpec> specs = {{"big.w", {4000}, "big"}};
  for (int l = 0; l < 4; ++l) {
    specs.push_back({absl::StrCat("l", l, ".w"), {100}, absl::StrCat("l", l)});
  }
  memory::PlanOptions o = Stage3Options(r, *comm);
  o.unit_per_module = true;
  o.prefetch_elements = 1;
  const memory::Plan plan = memory::MakePlan(specs, o).value();
  // Backward order: l3, l2, l1, l0, big = units 0..4, padded to 112 and 4000 at world 2.
  const std::vector<int64_t> classes = {112, 112, 4000};
  if (plan.Find(memory::BufferClass::kGatherBuffer)->slot_elements != classes) {
    return absl::InternalError("expected gather slots of 112, 112 and 4000 elements");
  }
  ASSIGN_OR_RETURN(auto fx, Gathering::Create(plan, r, comm, dev));
  ParamGatherer& g = *fx->gatherer;
  RETURN_IF_ERROR(g.Gather(0));
  RETURN_IF_ERROR(g.Gather(1));
  // Both small slots are held: a third small unit waits although the large slot is free.
  const absl::Status held = g.Gather(2);
  if (!absl::IsFailedPrecondition(held) ||
      !absl::StrContains(held.message(), "all 2 gather slots for units of 112 elements")) {
    return absl::InternalError(absl::StrCat("small slots held: ", held.ToString()));
  }
  RETURN_IF_ERROR(g.Gather(4));
  for (int u : {0, 1, 4}) RETURN_IF_ERROR(Expect(plan, g, u, 1));
  for (int u : {0, 1, 4}) RETURN_IF_ERROR(g.Release(u));
  return absl::OkStatus();
}

TEST_CASE("ParamGatherer: units of each size class use slots of their class", "[zero]") {
  auto dev = CreateCpuDevice();
  const auto statuses = OnRanks(
      2, [&](int r, comm::Communicator* comm) { return RunClasses(r, comm, dev.get()); });
  for (const absl::Status& s : statuses) {
    INFO(s);
    CHECK(s.ok());
  }
}

// Counts this rank's all-gathers.
class GatherCounter final : public comm::ForwardingCommunicator {
 public:
  using ForwardingCommunicator::ForwardingCommunicator;
  absl::Status AllGather(const void* send, void* recv, size_t count, DType dtype,
                         comm::Stream s) override {
    ++gathers;
    return ForwardingCommunicator::AllGather(send, recv, count, dtype, s);
  }
  int gathers = 0;
};

// Four units of one size class, two slots and a prefetch of one unit: the prefetch follows the
// pass's direction, taken before the hold (a unit after the last held one: forward).
absl::Status RunDirection(int r, comm::Communicator* inner, Device* dev) {
  GatherCounter comm(inner);
  std::vector<memory::ParamSpec> specs;
  for (int l = 0; l < 4; ++l) {
    specs.push_back({absl::StrCat("l", l, ".w"), {100}, absl::StrCat("l", l)});
  }
  memory::PlanOptions o = Stage3Options(r, comm);
  o.unit_per_module = true;
  o.prefetch_elements = 112;  // one padded unit: 1 + ceil(112 / 112) = 2 slots
  const memory::Plan plan = memory::MakePlan(specs, o).value();
  if (plan.Find(memory::BufferClass::kGatherBuffer)->count != 2) {
    return absl::InternalError("expected two gather slots");
  }
  ASSIGN_OR_RETURN(auto fx, Gathering::Create(plan, r, &comm, dev));
  ParamGatherer& g = *fx->gatherer;
  auto expect_gathers = [&](int n, const char* after) -> absl::Status {
    if (comm.gathers == n) return absl::OkStatus();
    return absl::InternalError(
        absl::StrCat(comm.gathers, " all-gathers after ", after, ", expected ", n));
  };
  // The first hold has no direction yet (backward): nothing before unit 0 to prefetch.
  RETURN_IF_ERROR(g.Gather(0));
  RETURN_IF_ERROR(expect_gathers(1, "Gather(0)"));
  RETURN_IF_ERROR(g.Release(0));
  // Forward (1 after 0): unit 1 into the empty slot, then unit 2 prefetched into unit 0's slot
  // (a unit the pass has passed).
  RETURN_IF_ERROR(g.Gather(1));
  RETURN_IF_ERROR(expect_gathers(3, "Gather(1)"));
  RETURN_IF_ERROR(g.Release(1));
  // Unit 2 is there already; unit 3 is prefetched into unit 1's slot.
  RETURN_IF_ERROR(g.Gather(2));
  RETURN_IF_ERROR(expect_gathers(4, "Gather(2)"));
  RETURN_IF_ERROR(Expect(plan, g, 2, 1));
  RETURN_IF_ERROR(g.Release(2));
  // Backward (1 before 2): unit 1 again, into the least recently used slot (unit 2's), then
  // unit 0 prefetched into unit 3's slot, which the backward pass has passed.
  RETURN_IF_ERROR(g.Gather(1));
  RETURN_IF_ERROR(expect_gathers(6, "Gather(1) backward"));
  RETURN_IF_ERROR(Expect(plan, g, 1, 1));
  RETURN_IF_ERROR(g.Release(1));
  RETURN_IF_ERROR(g.Gather(0));  // prefetched
  RETURN_IF_ERROR(expect_gathers(6, "Gather(0) backward"));
  RETURN_IF_ERROR(Expect(plan, g, 0, 1));
  return g.Release(0);
}

TEST_CASE("ParamGatherer: the prefetch follows the pass's direction", "[zero]") {
  auto dev = CreateCpuDevice();
  const auto statuses = OnRanks(
      2, [&](int r, comm::Communicator* comm) { return RunDirection(r, comm, dev.get()); });
  for (const absl::Status& s : statuses) {
    INFO(s);
    CHECK(s.ok());
  }
}

}  // namespace
}  // namespace zero_internal
}  // namespace zerort
