// Test helpers for the engine's parts: plans of a small model and in-process ranks.
#ifndef ZERORT_ZERO_INTERNAL_TEST_UTIL_H_
#define ZERORT_ZERO_INTERNAL_TEST_UTIL_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "comm/communicator.h"
#include "comm/testing/on_ranks.h"
#include "device/device.h"
#include "device/testing/forwarding_device.h"
#include "memory/plan.h"
#include "zero/testing/synthetic_trainer.h"

namespace zerort {
namespace zero_internal {

inline memory::Plan SmallPlan(int stage, int world, int rank, int gas = 1,
                              DType dtype = DType::kBF16, bool offload = false) {
  memory::PlanOptions o;
  o.stage = stage;
  o.world_size = world;
  o.rank = rank;
  o.compute_dtype = dtype;
  o.gradient_accumulation_steps = gas;
  o.offload_optimizer = offload;
  o.unit_target_elements = 300;  // several units
  o.shard_alignment = 8;
  o.persistence_threshold = 0;
  return memory::MakePlan(testing::SmallModel(), o).value();
}

// Runs fn(rank, comm) on `world` in-process ranks (default options), one thread each; returns
// each rank's status (checked on the caller's thread: Catch2 assertions are not thread-safe).
inline std::vector<absl::Status> OnRanks(
    int world, const std::function<absl::Status(int, comm::Communicator*)>& fn) {
  return comm::testing::OnRanks(world, {}, fn);
}

using ForwardingDevice = testing::ForwardingDevice;  // device/testing/forwarding_device.h

}  // namespace zero_internal
}  // namespace zerort

#endif  // ZERORT_ZERO_INTERNAL_TEST_UTIL_H_
