// The trainer's side of the optimizer step: the AdamW scalars in force (the config's, a
// schedule's learning rate, or what the trainer set), the check that every rank took the same
// decision after a split step's ComputeGradNorm, and reductions of a few doubles.
//
// Thread safety: not thread-safe; one per engine (the free functions are collective).
#ifndef ZERORT_ZERO_INTERNAL_STEP_CONTROL_H_
#define ZERORT_ZERO_INTERNAL_STEP_CONTROL_H_

#include <cstdint>
#include <functional>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "comm/agree.h"
#include "comm/communicator.h"
#include "zero/hyperparams.h"

namespace zerort {
namespace zero_internal {

class Hyperparams {
 public:
  // `config`: the scalars before the trainer sets any; `schedule` (may be null): the learning
  // rate of step t until then.
  Hyperparams(const AdamWScalars& config, std::function<double(int64_t)> schedule)
      : config_(config), current_(config), schedule_(std::move(schedule)) {}

  // InvalidArgument naming `who` and the value; nothing changes then.
  absl::Status Set(const AdamWScalars& scalars, const char* who);
  absl::Status SetLearningRate(double lr);
  // The scalars of optimizer step `step` (1-based); a scheduled rate is validated here.
  absl::StatusOr<AdamWScalars> ForStep(int64_t step) const;
  // Back to a saved state: the trainer's scalars when `set`, else the config's rule.
  absl::Status Restore(bool set, const AdamWScalars& scalars);

  const AdamWScalars& current() const { return current_; }
  bool set() const { return set_; }

 private:
  const AdamWScalars config_;
  AdamWScalars current_;
  bool set_ = false;  // the trainer called Set or SetLearningRate
  const std::function<double(int64_t)> schedule_;
};

// A running digest of the collectives an engine issued since its last optimizer step, one
// (operation, unit) at a time, so that ranks can check before an update that they took part
// in the same collectives of the same engine: a stage-3 rank that gathered another unit of
// equal size, or two engines on one communicator whose calls crossed, return OK from the
// collective itself with mixed data. Adding is a CRC32C of 5 bytes (no allocation).
class CollectiveDigest {
 public:
  enum Op : uint8_t { kReduce = 1, kGather = 2 };
  void Add(Op op, int unit);
  void Reset() { crc_ = 0, count_ = 0; }
  uint32_t crc() const { return crc_; }
  uint64_t count() const { return count_; }

 private:
  uint32_t crc_ = 0;
  uint64_t count_ = 0;
};

// What every rank must agree on before it applies an update: the engine stepped (its id,
// the same on every rank), the collectives issued since the last step, and the step's AdamW
// scalars.
struct StepAgreement {
  uint64_t engine_id = 0;
  const CollectiveDigest* digest = nullptr;
  AdamWScalars scalars;
  int64_t step = 0;  // the step about to be applied (1-based), for the message
};

// FailedPrecondition on every rank unless every rank's `mine` matches rank 0's, naming the first
// differing rank and what differed (engine, collectives, lr, weight decay, or betas/eps), in
// that order: a crossed collective explains any other difference. One all-gather of 6 words.
// Collective.
absl::Status AgreeBeforeUpdate(comm::HostExchange& exchange, const StepAgreement& mine);

// FailedPrecondition on every rank, naming rank 0's and the first differing rank's call, unless
// all ranks chose the same (apply, clip). Collective.
absl::Status AgreeOnDecision(comm::HostExchange& exchange, bool apply,
                             std::optional<double> clip);

// values[k] = op over ranks, in rank order in double (the same bits everywhere).
// InvalidArgument on every rank when the ranks pass different counts. Collective.
absl::Status AllReduceDoubles(comm::HostExchange& exchange, absl::Span<double> values,
                              comm::ReduceOp op);

// Every rank's `mine`, rank r's at [r * mine.size(), (r + 1) * mine.size()), bit for bit.
// InvalidArgument on every rank when the ranks pass different counts. Collective.
absl::StatusOr<std::vector<double>> AllGatherDoubles(comm::HostExchange& exchange,
                                                     absl::Span<const double> mine,
                                                     absl::string_view caller);

}  // namespace zero_internal
}  // namespace zerort

#endif  // ZERORT_ZERO_INTERNAL_STEP_CONTROL_H_
