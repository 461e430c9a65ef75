// VisibleState: everything a trainer can read of an engine's state, as bytes: each parameter's
// compute-dtype values as forward reads them (stage 3 gathers each unit), then the fp32 master
// weights. Two engines with equal VisibleState hold the same model bit for bit; the parking
// tests compare it before Park and after Unpark, and against an engine that never parked.
// Collective (GatherMasterWeights, stage-3 gathers).
#ifndef ZERORT_ZERO_TESTING_VISIBLE_STATE_H_
#define ZERORT_ZERO_TESTING_VISIBLE_STATE_H_

#include <cstring>
#include <vector>

#include "absl/status/statusor.h"
#include "base/status.h"
#include "zero/engine.h"
#include "zero/testing/synthetic_trainer.h"

namespace zerort {
namespace testing {

inline absl::StatusOr<std::vector<char>> VisibleState(Engine& e) {
  std::vector<char> out;
  const size_t c = DTypeSize(e.plan().options.compute_dtype);
  for (int u = 0; u < e.num_units(); ++u) {
    RETURN_IF_ERROR(e.Gather(u));
    for (int i : e.plan().units[u].params) {
      ASSIGN_OR_RETURN(void* p, e.param(i));
      const size_t bytes = static_cast<size_t>(e.plan().params[i].numel) * c;
      const size_t at = out.size();
      out.resize(at + bytes);
      RETURN_IF_ERROR(e.device()->Copy(out.data() + at, p, bytes, e.compute_stream()));
      RETURN_IF_ERROR(e.device()->Synchronize(e.compute_stream()));
    }
    RETURN_IF_ERROR(e.Release(u));
  }
  ASSIGN_OR_RETURN(std::vector<float> master, e.GatherMasterWeights());
  const size_t at = out.size();
  out.resize(at + master.size() * 4);
  std::memcpy(out.data() + at, master.data(), master.size() * 4);
  return out;
}

// The same bytes from TrainRank's result (its params are gathered the same way).
inline std::vector<char> VisibleState(const TrainResult& r) {
  std::vector<char> out = r.params;
  const size_t at = out.size();
  out.resize(at + r.master.size() * 4);
  std::memcpy(out.data() + at, r.master.data(), r.master.size() * 4);
  return out;
}

}  // namespace testing
}  // namespace zerort

#endif  // ZERORT_ZERO_TESTING_VISIBLE_STATE_H_
