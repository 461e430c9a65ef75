#include "zero/internal/grad_buckets.h"

#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "device/cpu_device.h"
#include "zero/internal/engine_memory.h"
#include "zero/internal/shard_layout.h"
#include "zero/internal/test_util.h"

namespace zerort {
namespace zero_internal {
namespace {

float G(int rank, int unit, int64_t e) { return 0.25f * (rank + 1) * (unit + 1) - 0.125f * e; }

// Each rank writes G(rank, unit, element in unit) into every gradient; after the last
// GradReady of a unit its owned region must hold the rank-ordered average.
absl::Status Run(int stage, int r, comm::Communicator* comm, Device* dev) {
  const int world = comm->size();
  const memory::Plan plan = SmallPlan(stage, world, r, 1, DType::kF32);
  ASSIGN_OR_RETURN(auto mem, EngineMemory::Allocate(plan, dev, nullptr));
  ASSIGN_OR_RETURN(auto streams,
                   StreamOrder::Create(dev, nullptr, comm, mem->grad_buckets().count, 0));
  StepTimer timer(world, 4);
  const ShardLayout layout(plan, mem->model_state());
  GradBuckets grads(UnitContext(plan, comm, dev, streams.get(), &timer), layout,
                    mem->model_state(), mem->grad_buckets(), mem->grad_wire());
  for (int u = 0; u < static_cast<int>(plan.units.size()); ++u) {
    for (int i : plan.units[u].params) {
      const memory::ParamLayout& p = plan.params[i];
      ASSIGN_OR_RETURN(void* g, grads.Grad(i));
      for (int64_t k = 0; k < p.numel; ++k) {
        static_cast<float*>(g)[k] = G(r, u, p.offset_in_unit + k);
      }
      ASSIGN_OR_RETURN(const bool complete, grads.MarkReady(i));
      if (complete != (i == plan.units[u].params.back())) {
        return absl::InternalError("unit completion reported at the wrong parameter");
      }
      if (grads.Grad(i).ok() || grads.MarkReady(i).ok()) {
        return absl::InternalError("a ready gradient was handed out or marked again");
      }
    }
    RETURN_IF_ERROR(grads.Reduce(u, /*first_micro=*/true));
    const Region& reg = layout.region(u);
    const float* reduced = reinterpret_cast<const float*>(reg.grad);
    for (const int i : plan.units[u].params) {
      const memory::ParamLayout& p = plan.params[i];
      for (int64_t k = 0; k < p.numel; ++k) {
        const int64_t e = p.offset_in_unit + k - reg.unit_begin;  // in the region
        if (e < 0 || e >= reg.n) continue;
        float acc = G(0, u, p.offset_in_unit + k);
        for (int q = 1; q < world; ++q) acc += G(q, u, p.offset_in_unit + k);
        if (reduced[e] != acc / world) {
          return absl::InternalError(absl::StrCat("unit ", u, " element ", e));
        }
      }
    }
  }
  if (grads.FirstMissing() != -1 || !grads.any_ready()) return absl::InternalError("ready");
  grads.StartMicroStep();
  if (grads.FirstMissing() != 0 || grads.any_ready()) return absl::InternalError("reset");
  return absl::OkStatus();
}

TEST_CASE("GradBuckets: each unit's owned region receives the average of every rank's", "[zero]") {
  auto dev = CreateCpuDevice();
  for (int stage = 0; stage <= 3; ++stage) {
    const auto statuses = OnRanks(3, [&](int r, comm::Communicator* comm) {
      return Run(stage, r, comm, dev.get());
    });
    for (const absl::Status& s : statuses) {
      INFO("stage " << stage << ": " << s);
      REQUIRE(s.ok());
    }
  }
}

}  // namespace
}  // namespace zero_internal
}  // namespace zerort
