// Human and JSON renderings of a memory::Plan, shared by `zerort plan` and `zerort demo`.
//
// Thread safety: pure functions.
#ifndef ZERORT_ZERO_REPORT_H_
#define ZERORT_ZERO_REPORT_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "memory/plan.h"
#include "nlohmann/json.hpp"

namespace zerort {

// 1536 -> "1.50 KiB"; binary units up to PiB.
std::string HumanBytes(int64_t bytes);

// "80GiB", "80 GB", "1.5TiB", "8e10", "123" (bytes). Decimal (kB, MB, GB, TB) and binary (KiB,
// MiB, GiB, TiB) suffixes. InvalidArgument names the text.
absl::StatusOr<int64_t> ParseBytes(absl::string_view text);

// A table per memory kind with a row per buffer, then totals and communication per step.
std::string PlanTable(const memory::Plan& plan);

// params, world_size, stage, per_rank.{model_state_bytes, device_bytes, pinned_host_bytes,
// host_bytes}, comm_bytes_per_step, host_transfer_bytes_per_step, units, buffers[].
nlohmann::ordered_json PlanJson(const memory::Plan& plan);

}  // namespace zerort

#endif  // ZERORT_ZERO_REPORT_H_
