#include "zero/internal/grad_buckets.h"

#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
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
  ShardLayout layout(plan, mem->model_state());
  GradBuckets grads(UnitContext(plan, comm, dev, streams.get(), &timer), layout,
                    mem->model_state(), mem->grad_buckets(), mem->grad_wire());
  for (int u = 0; u < static_cast<int>(plan.units.size()); ++u) {
    for (int i : plan.units[u].params) {
      const memory::ParamLayout& p = plan.params[i];
      ASSIGN_OR_RETURN(void* g, grads.Grad(i));
      for (int64_t k = 0; k < p.numel; ++k) {
        static_cast<float*>(g)[k] = G(r, u, p.offset_in_unit + k);
      }
      ASSIGN_OR_RETURN(const std::vector<int> complete, grads.MarkReady(i));
      if (complete != (i == plan.units[u].params.back() ? std::vector<int>{u}
                                                        : std::vector<int>{})) {
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

// One large module and four small ones, one unit each: buckets of two size classes.
absl::Status RunClasses(comm::Communicator* comm, Device* dev) {
  std::vector<memory::ParamSpec> specs = {{"big.w", {4000}, "big"}};
  for (int l = 0; l < 4; ++l) {
    specs.push_back({absl::StrCat("l", l, ".w"), {100}, absl::StrCat("l", l)});
  }
  memory::PlanOptions o;
  o.stage = 2;
  o.compute_dtype = DType::kF32;
  o.unit_per_module = true;
  o.shard_alignment = 8;
  ASSIGN_OR_RETURN(const memory::Plan plan, memory::MakePlan(specs, o));
  // Backward order: l3, l2, l1, l0, big = units 0..4; params 4, 3, 2, 1, 0.
  const std::vector<int64_t> classes = {104, 104, 4000};
  if (plan.Find(memory::BufferClass::kGradBucket)->slot_elements != classes) {
    return absl::InternalError("expected buckets of 104, 104 and 4000 elements");
  }
  ASSIGN_OR_RETURN(auto mem, EngineMemory::Allocate(plan, dev, nullptr));
  ASSIGN_OR_RETURN(auto streams,
                   StreamOrder::Create(dev, nullptr, comm, mem->grad_buckets().count, 0));
  StepTimer timer(1, 4);
  ShardLayout layout(plan, mem->model_state());
  GradBuckets grads(UnitContext(plan, comm, dev, streams.get(), &timer), layout,
                    mem->model_state(), mem->grad_buckets(), mem->grad_wire());
  const SlottedBuffer& b = mem->grad_buckets();
  auto at = [&](int slot) { return static_cast<void*>(b.base + b.offset(slot) * 4); };
  ASSIGN_OR_RETURN(void* l3, grads.Grad(4));
  ASSIGN_OR_RETURN(void* l2, grads.Grad(3));
  if (l3 != at(0) || l2 != at(1)) return absl::InternalError("small units in the small buckets");
  // Both small buckets are busy: the third small unit waits although the large bucket is free.
  absl::StatusOr<void*> l1 = grads.Grad(2);
  if (l1.ok() || !absl::StrContains(l1.status().message(), "all 2 gradient buckets for units "
                                                             "of 104 elements")) {
    return absl::InternalError(absl::StrCat("a third small unit: ", l1.status().ToString()));
  }
  ASSIGN_OR_RETURN(void* big, grads.Grad(0));
  if (big != at(2)) return absl::InternalError("the large unit in the large bucket");
  // Reducing l3 frees its bucket for l1.
  ASSIGN_OR_RETURN(const std::vector<int> complete, grads.MarkReady(4));
  if (complete != std::vector<int>{0}) return absl::InternalError("l3 is one parameter");
  RETURN_IF_ERROR(grads.Reduce(0, /*first_micro=*/true));
  ASSIGN_OR_RETURN(void* again, grads.Grad(2));
  if (again != at(0)) return absl::InternalError("l1 in the bucket l3 freed");
  return dev->Synchronize(nullptr);
}

TEST_CASE("GradBuckets: a small unit never takes the large unit's bucket", "[zero]") {
  auto dev = CreateCpuDevice();
  const auto statuses = OnRanks(1, [&](int, comm::Communicator* comm) {
    return RunClasses(comm, dev.get());
  });
  INFO(statuses[0].ToString());
  CHECK(statuses[0].ok());
}

}  // namespace
}  // namespace zero_internal
}  // namespace zerort
