// Measured bytes per link class against the plan's, for tests and benchmarks: runs a trainer on
// in-process ranks, each over its communicator wrapped in comm::CountLinkBytes, and compares
// what each rank sent per optimizer step with its plan's comm_bytes_intra_node_per_step and
// comm_bytes_inter_node_per_step (memory/plan.h). The plan is exact for a trainer that gathers in
// the standard order (plan.h, comm_bytes_per_step), so the expected difference is zero, class
// for class; //zero:engine_link_bytes_test and `step_bench --link-bytes` both use it.
//
//   ASSIGN_OR_RETURN(std::vector<RankLinkBytes> ranks, MeasureLinkBytes(8, 4,
//       [&](comm::Communicator* comm, comm::LinkByteLog* log) -> absl::StatusOr<memory::Plan> {
//         ... train warm-up steps ...; log->Clear(); ... train `steps` more ...; return plan; }));
//   const LinkBytesComparison c = CompareWithPlan(ranks[0].plan, ranks[0].sent, steps);
//
// Thread safety: MeasureLinkBytes calls `run` on one thread per rank, concurrently.
#ifndef ZERORT_ZERO_TESTING_LINK_BYTES_CHECK_H_
#define ZERORT_ZERO_TESTING_LINK_BYTES_CHECK_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "comm/link_bytes.h"
#include "memory/plan.h"
#include "zero/engine.h"

namespace zerort {
namespace testing {

// One rank's run: trains over `comm` (the counted communicator), clears `log` where the measured
// part starts, and returns the rank's plan.
using LinkBytesRun =
    std::function<absl::StatusOr<memory::Plan>(comm::Communicator* comm, comm::LinkByteLog* log)>;

// What one rank sent in the measured part (log->Total() at the end) and its plan.
struct RankLinkBytes {
  comm::LinkBytes sent;
  memory::Plan plan;
  std::string log;  // the counted collectives (comm::LinkByteLog::ToString), for failure messages
};

// Runs `run` on `world` in-process ranks with `ranks_per_node` consecutive ranks per node.
// Errors: the first failing rank's status, naming the rank.
absl::StatusOr<std::vector<RankLinkBytes>> MeasureLinkBytes(int world, int ranks_per_node,
                                                            const LinkBytesRun& run);

// Runs `steps` optimizer steps on `engine` in the standard order that the plan's stage-3 gather
// bytes assume (memory/plan.h, Plan::comm_bytes_per_step): per micro-step, Gather and Release
// each unit from the last to the first (forward), then from the first to the last (backward),
// marking each trainable parameter's gradient ready there; Step() after each micro-step. The
// gradients are left as the engine holds them (bytes do not depend on values).
absl::Status TrainStandardOrder(Engine& engine, int steps);

// Per optimizer step: measured (sent / steps) against planned, per link class.
struct LinkBytesComparison {
  comm::LinkBytes measured;     // per step
  comm::LinkBytes planned;      // the plan's intra/inter-node bytes per step
  int64_t planned_control = 0;  // of planned: the control exchange (Plan::comm_control_bytes...)
  bool divisible = true;        // sent was a whole multiple of `steps` in each class
  bool equal() const {
    return divisible && measured.intra_node == planned.intra_node &&
           measured.inter_node == planned.inter_node;
  }
  std::string ToString() const;  // "intra-node measured A planned B, inter-node measured C ..."
};
// REQUIRES: steps >= 1.
// Per step over `steps` steps of `sent` (over a whole number of steps: a rank's RankLinkBytes,
// or the difference of two runs' totals) against `plan`. REQUIRES: steps >= 1.
LinkBytesComparison CompareWithPlan(const memory::Plan& plan, const comm::LinkBytes& sent,
                                    int steps);

}  // namespace testing
}  // namespace zerort

#endif  // ZERORT_ZERO_TESTING_LINK_BYTES_CHECK_H_
