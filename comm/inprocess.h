// In-process communicator group: N ranks as N threads of one process, sharing one group state.
// The embedded default (a single-process trainer) and the workhorse of the engine's tests.
//
//   ASSIGN_OR_RETURN(std::vector<std::unique_ptr<comm::Communicator>> comms,
//                    comm::CreateInProcessGroup(4));
//   std::vector<std::thread> threads;
//   for (int r = 0; r < 4; ++r) threads.emplace_back([&, r] { Train(*comms[r]); });
//
// Ranks read their peers' buffers directly: all-gather is one memcpy per peer block,
// reduce-scatter reduces the caller's own block straight from every peer's send buffer (see
// comm/communicator.h for the determinism contract), all-reduce is a reduce-scatter over a
// 1/N slice followed by an all-gather, with no intermediate copy unless it runs in place.
//
// Thread safety: each rank's object is used by one thread at a time; different ranks' objects
// are used concurrently (that is the point). Operations are complete when they return.
// Failures: a rank that does not arrive within options.timeout_ms makes the waiting ranks
// return DeadlineExceeded naming the op, sequence, count, dtype, rank and the missing ranks; a
// rank whose communicator is destroyed while others wait for it makes them return Unavailable.
// Either poisons the group: later calls on any rank return FailedPrecondition at once.
// The group state lives until the last of its communicators is destroyed.
// Split (comm/communicator.h) gives each color a fresh group of its own (same options and
// buffer ops), made once and handed to its members through the parent's group; sub-groups
// share no state with each other or with the parent after the split returns.
#ifndef ZERORT_COMM_INPROCESS_H_
#define ZERORT_COMM_INPROCESS_H_

#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/communicator.h"

namespace zerort {
namespace comm {

// How the ranks' buffers are copied and reduced. The default (empty functions) moves host
// memory with the host's loads and stores; device/cuda_device.h supplies GPU versions so that
// threads sharing one GPU run a group over device memory. Both must be complete when they
// return and `reduce` must keep ReduceBlocks's contract (rank order, one rounding, canonical
// NaN; dst may alias a source at the same offsets).
struct InProcessBufferOps {
  std::function<absl::Status(void* dst, const void* src, size_t bytes)> copy;
  std::function<absl::Status(const void* const* srcs, int n, void* dst, size_t count,
                             DType dtype, ReduceOp op)>
      reduce;
  bool device_memory = false;  // what Communicator::device_memory() reports
};

// REQUIRES: world_size >= 1, options.timeout_ms > 0 (else InvalidArgument), and `ops` either
// empty or with both functions set.
absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateInProcessGroup(
    int world_size, CommOptions options = {}, InProcessBufferOps ops = {});

}  // namespace comm
}  // namespace zerort

#endif  // ZERORT_COMM_INPROCESS_H_
