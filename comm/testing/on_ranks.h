// OnRanks runs a multi-rank test body on every rank of a new in-process group, one thread a
// rank, and returns each rank's status in rank order: the harness that engine, checkpoint and
// command tests otherwise write out around each body.
//
//   auto device = CreateCpuDevice();
//   std::vector<absl::Status> st = comm::testing::OnRanks(2, {20000},
//       [&](int rank, comm::Communicator* comm) { return Train(comm, device.get()); });
//
// Thread safety: `fn` runs on `world` threads at once.
// REQUIRES: world >= 1 and `options` valid for CreateInProcessGroup.
#ifndef ZERORT_COMM_TESTING_ON_RANKS_H_
#define ZERORT_COMM_TESTING_ON_RANKS_H_

#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "comm/communicator.h"

namespace zerort {
namespace comm {
namespace testing {

std::vector<absl::Status> OnRanks(int world, const CommOptions& options,
                                  const std::function<absl::Status(int rank, Communicator*)>& fn);

}  // namespace testing
}  // namespace comm
}  // namespace zerort

#endif  // ZERORT_COMM_TESTING_ON_RANKS_H_
