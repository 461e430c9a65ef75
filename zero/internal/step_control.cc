#include "zero/internal/step_control.h"

#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace zerort {
namespace zero_internal {

absl::Status Hyperparams::Set(const AdamWScalars& scalars, const char* who) {
  RETURN_IF_ERROR(ValidateScalars(scalars, who));
  current_ = scalars;
  set_ = true;
  return absl::OkStatus();
}

absl::Status Hyperparams::SetLearningRate(double lr) {
  AdamWScalars s = current_;
  s.lr = lr;
  return Set(s, "SetLearningRate");
}

absl::StatusOr<AdamWScalars> Hyperparams::ForStep(int64_t step) const {
  AdamWScalars s = current_;
  if (!set_ && schedule_) {
    s.lr = schedule_(step);
    RETURN_IF_ERROR(ValidateScalars(s, absl::StrCat("EngineOptions::lr_schedule(", step, ")")));
  }
  return s;
}

absl::Status Hyperparams::Restore(bool set, const AdamWScalars& scalars) {
  if (set) return Set(scalars, "RestoreOwnedState: hyperparams");
  current_ = config_;
  set_ = false;
  return absl::OkStatus();
}

absl::Status AgreeOnDecision(comm::HostExchange& exchange, bool apply,
                             std::optional<double> clip) {
  if (exchange.size() == 1) return absl::OkStatus();
  uint64_t bits = 0;
  if (clip.has_value()) std::memcpy(&bits, &*clip, sizeof bits);
  const uint64_t kind = apply ? (clip.has_value() ? 2 : 1) : 0;
  ASSIGN_OR_RETURN(const std::vector<uint64_t> all, comm::AllGatherU64(exchange, {kind, bits}));
  auto name = [&](int r) {
    if (all[2 * r] == 0) return std::string("SkipStep()");
    if (all[2 * r] == 1) return std::string("ApplyStep()");
    double c;
    std::memcpy(&c, &all[2 * r + 1], sizeof c);
    return absl::StrCat("ApplyStep(clip_coef=", c, ")");
  };
  for (int r = 1; r < exchange.size(); ++r) {
    if (all[2 * r] == all[0] && all[2 * r + 1] == all[1]) continue;
    return absl::FailedPreconditionError(absl::StrCat(
        "rank 0 called ", name(0), " and rank ", r, " ", name(r),
        ": every rank must take the same decision after ComputeGradNorm() (the step is still "
        "pending)"));
  }
  return absl::OkStatus();
}

absl::Status AllReduceDoubles(comm::HostExchange& exchange, absl::Span<double> values,
                              comm::ReduceOp op) {
  const int world = exchange.size();
  // The counts first: a mismatch fails every rank instead of corrupting the exchange.
  ASSIGN_OR_RETURN(const std::vector<uint64_t> counts,
                   comm::AllGatherU64(exchange, {static_cast<uint64_t>(values.size())}));
  for (int r = 0; r < world; ++r) {
    if (counts[r] != counts[0]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "AllReduceScalars: rank 0 passed ", counts[0], " values and rank ", r, " ",
          counts[r], ": every rank must pass the same count"));
    }
  }
  std::vector<uint64_t> mine(values.size());
  std::memcpy(mine.data(), values.data(), values.size() * sizeof(double));
  ASSIGN_OR_RETURN(const std::vector<uint64_t> all, comm::AllGatherU64(exchange, mine));
  for (size_t k = 0; k < values.size(); ++k) {
    double acc = 0;
    for (int r = 0; r < world; ++r) {  // rank order: the same bits on every rank
      double x;
      std::memcpy(&x, &all[r * values.size() + k], sizeof x);
      if (r == 0) {
        acc = x;
      } else if (op == comm::ReduceOp::kMax) {
        if (std::isnan(x) || x > acc) acc = x;
      } else {
        acc += x;
      }
    }
    values[k] = op == comm::ReduceOp::kAvg ? acc / world : acc;
  }
  return absl::OkStatus();
}

}  // namespace zero_internal
}  // namespace zerort
