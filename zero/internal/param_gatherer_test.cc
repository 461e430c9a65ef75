#include "zero/internal/param_gatherer.h"

#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "base/status.h"
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

absl::Status Run(int r, comm::Communicator* comm, Device* dev) {
  memory::PlanOptions o;
  o.stage = 3;
  o.world_size = comm->size();
  o.rank = r;
  o.compute_dtype = DType::kF32;
  o.unit_target_elements = 300;
  o.shard_alignment = 8;
  o.persistence_threshold = 0;
  o.prefetch_elements = 0;  // one gather slot: 1 + ceil(0 / largest unit)
  const memory::Plan plan = memory::MakePlan(testing::SmallModel(), o).value();
  ASSIGN_OR_RETURN(auto mem, EngineMemory::Allocate(plan, dev, nullptr));
  ASSIGN_OR_RETURN(auto streams, StreamOrder::Create(dev, nullptr, comm, 0, 1));
  StepTimer timer(comm->size(), 4);
  float* shard = reinterpret_cast<float*>(mem->model_state().params);
  auto write_shards = [&](float gen) {
    for (const memory::Unit& u : plan.units) {
      for (int64_t e = 0; e < u.shard; ++e) {
        shard[u.shard_offset + e] = Full(&u - plan.units.data(), r * u.shard + e, gen);
      }
    }
  };
  write_shards(1);
  const ShardLayout layout(plan, mem->model_state());
  ASSIGN_OR_RETURN(auto store, UnitStore::Create(plan, layout, *mem, {}, dev, nullptr, nullptr));
  ParamGatherer g(UnitContext(plan, comm, dev, streams.get(), &timer), mem->model_state().params,
                  mem->gather_slots(), mem->persistent(), store.get());
  if (mem->gather_slots().count != 1) return absl::InternalError("expected one slot");
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
  write_shards(2);
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

}  // namespace
}  // namespace zero_internal
}  // namespace zerort
