#include "zero/internal/step_control.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/crc32c.h"
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

void CollectiveDigest::Add(Op op, int unit) {
  unsigned char bytes[5] = {op};
  std::memcpy(bytes + 1, &unit, sizeof(int));
  crc_ = Crc32c(crc_, bytes, sizeof bytes);
  ++count_;
}

namespace {

uint64_t Bits(double x) {
  uint64_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

double FromBits(uint64_t b) {
  double x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

// Words of one rank's agreement, in the order AgreeBeforeUpdate compares them.
enum Word { kEngine, kCount, kCrc, kLr, kDecay, kOthers, kWords };

// What rank r's words say that rank 0's do not, for the first word that differs.
std::string Difference(const uint64_t* zero, const uint64_t* r, int rank) {
  const std::string who = absl::StrCat("rank ", rank);
  if (r[kEngine] != zero[kEngine]) {
    return absl::StrCat("rank 0 is stepping engine ", zero[kEngine], " and ", who, " engine ",
                        r[kEngine], ": two engines share this communicator and their calls "
                        "crossed, so their collectives mixed each other's data");
  }
  if (r[kCount] != zero[kCount] || r[kCrc] != zero[kCrc]) {
    return absl::StrCat("since the last step rank 0 issued ", zero[kCount], " collectives (digest ",
                        zero[kCrc], ") and ", who, " ", r[kCount], " (digest ", r[kCrc],
                        "): the ranks reduced or gathered different units or in a different "
                        "order, so the collectives mixed unrelated data");
  }
  if (r[kLr] != zero[kLr]) {
    return absl::StrCat("rank 0 has lr=", FromBits(zero[kLr]), " and ", who, " lr=",
                        FromBits(r[kLr]), " (config, schedule or SetLearningRate)");
  }
  if (r[kDecay] != zero[kDecay]) {
    return absl::StrCat("rank 0 has weight_decay=", FromBits(zero[kDecay]), " and ", who,
                        " weight_decay=", FromBits(r[kDecay]));
  }
  return absl::StrCat("rank 0 and ", who, " have different betas or eps");
}

}  // namespace

absl::Status AgreeBeforeUpdate(comm::HostExchange& exchange, const StepAgreement& mine) {
  if (exchange.size() == 1) return absl::OkStatus();
  const AdamWScalars& s = mine.scalars;
  const double others[3] = {s.beta1, s.beta2, s.eps};
  const uint64_t words[kWords] = {mine.engine_id, mine.digest->count(), mine.digest->crc(),
                                  Bits(s.lr), Bits(s.weight_decay),
                                  Crc32c(0, others, sizeof others)};
  ASSIGN_OR_RETURN(const std::vector<uint64_t> all,
                   comm::AllGatherU64(exchange, absl::MakeConstSpan(words, kWords)));
  for (int r = 1; r < exchange.size(); ++r) {
    if (std::equal(all.begin() + r * kWords, all.begin() + (r + 1) * kWords, all.begin())) {
      continue;
    }
    return absl::FailedPreconditionError(
        absl::StrCat("ranks disagree before the update of step ", mine.step, ": ",
                     Difference(all.data(), all.data() + r * kWords, r),
                     "; the update is not applied on any rank (the window stays pending)"));
  }
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

absl::StatusOr<std::vector<double>> AllGatherDoubles(comm::HostExchange& exchange,
                                                     absl::Span<const double> mine,
                                                     absl::string_view caller) {
  const int world = exchange.size();
  // The counts first: a mismatch fails every rank instead of corrupting the exchange.
  ASSIGN_OR_RETURN(const std::vector<uint64_t> counts,
                   comm::AllGatherU64(exchange, {static_cast<uint64_t>(mine.size())}));
  for (int r = 0; r < world; ++r) {
    if (counts[r] != counts[0]) {
      return absl::InvalidArgumentError(absl::StrCat(
          caller, ": rank 0 passed ", counts[0], " values and rank ", r, " ", counts[r],
          ": every rank must pass the same count"));
    }
  }
  std::vector<uint64_t> bits(mine.size());
  std::memcpy(bits.data(), mine.data(), mine.size() * sizeof(double));
  ASSIGN_OR_RETURN(const std::vector<uint64_t> all, comm::AllGatherU64(exchange, bits));
  std::vector<double> out(all.size());
  std::memcpy(out.data(), all.data(), all.size() * sizeof(double));
  return out;
}

absl::Status AllReduceDoubles(comm::HostExchange& exchange, absl::Span<double> values,
                              comm::ReduceOp op) {
  const int world = exchange.size();
  ASSIGN_OR_RETURN(const std::vector<double> all,
                   AllGatherDoubles(exchange, values, "AllReduceScalars"));
  for (size_t k = 0; k < values.size(); ++k) {
    double acc = 0;
    for (int r = 0; r < world; ++r) {  // rank order: the same bits on every rank
      const double x = all[r * values.size() + k];
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
