// Human and JSON renderings of a memory::Plan, shared by `zerort plan` and `zerort demo`.
//
// Thread safety: pure functions.
#ifndef ZERORT_ZERO_REPORT_H_
#define ZERORT_ZERO_REPORT_H_

#include <cstdint>
#include <string>

#include "memory/plan.h"
#include "nlohmann/json.hpp"
#include "zero/planner.h"

namespace zerort {

// A table per memory kind with a row per buffer, then totals, the gradients the trainer declared
// in its own buffers (each copied tensor with the reason), and communication per step.
std::string PlanTable(const memory::Plan& plan);

// params, world_size, stage, per_rank.{model_state_bytes, device_bytes, pinned_host_bytes,
// host_bytes, nvme_bytes}, comm_bytes_per_step (comm_control_bytes_per_step of it),
// stage3_gathers_per_step, host_transfer_bytes_per_step, units, buffers[],
// grad_handoff.{buffers, tensors, tensors_in_place, bytes, bytes_in_place, bytes_copied,
// engine_grad_bytes, engine_grad_bytes_undeclared, copied[{tensor, unit, reason}]}.
nlohmann::ordered_json PlanJson(const memory::Plan& plan);

// The device budget beside the plan: model-state buffers, each activation and reserve line, the
// total and, when `budget_bytes` > 0, the budget; or, when nothing beyond model state was counted,
// its note.
std::string DeviceBudgetTable(const DeviceBudget& d, int64_t budget_bytes);

// counted, note, micro_batch, activation_source, model_state_bytes, activations{name: bytes},
// activation_bytes, reserves{name: bytes}, reserve_bytes, total_bytes.
nlohmann::ordered_json DeviceBudgetJson(const DeviceBudget& d);

}  // namespace zerort

#endif  // ZERORT_ZERO_REPORT_H_
