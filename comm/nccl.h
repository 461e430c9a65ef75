// NCCL backend of Communicator: device buffers, operations enqueued on a cudaStream_t.
//
//   // Trainer already has an NCCL communicator: wrap it (we never destroy or abort it).
//   ASSIGN_OR_RETURN(auto comm, comm::CreateNcclCommunicator(trainer_comm));
//   // Or let zerort create one, bootstrapped from the launcher's environment:
//   ASSIGN_OR_RETURN(comm::LaunchInfo info, comm::LaunchInfoFromEnv());
//   ASSIGN_OR_RETURN(auto comm, comm::CreateNcclCommunicatorFromLaunch(info));
//   RETURN_IF_ERROR(comm->ReduceScatter(grads, shard, n, DType::kBF16, ReduceOp::kAvg, stream));
//   RETURN_IF_ERROR(comm->Synchronize(stream));
//
// Semantics: every collective is only enqueued on `stream` (nullptr is the legacy default
// stream); buffers are device memory; the in-place rules are NCCL's, which equal ours. The
// determinism contract of comm/communicator.h does not hold here (NCCL picks the reduction
// order). The timeout applies where we wait: Synchronize, Barrier and creation poll
// cudaStreamQuery / ncclCommGetAsyncError against options.timeout_ms. On an NCCL error or a
// timeout, a communicator we created is aborted with ncclCommAbort (never a blocking destroy)
// and poisoned; a wrapped external communicator is only poisoned, its owner decides.
// Split is ncclCommSplit (NCCL >= 2.18; FailedPrecondition naming the loaded version below
// that), non-blocking and polled like creation; the sub-communicator is owned (destroyed with
// it), on the same device. NCCL cannot say which peer is missing: the timeout names the split
// and this rank.
// ReduceScatterInGroups is ncclReduceScatter within the group then ncclAllReduce across the
// groups, on two sub-communicators split off at its first call: two roundings to the dtype,
// not bitwise equal to the flat reduction (HSDP on NCCL differs from flat sharding in the last
// bits, as any two NCCL algorithms do). Not run yet: NCCL refuses two ranks on one GPU.
// Each Communicator binds the CUDA device current (external) or given (created) at creation.
// Thread safety: one thread at a time.
#ifndef ZERORT_COMM_NCCL_H_
#define ZERORT_COMM_NCCL_H_

#include <nccl.h>

#include <memory>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "comm/rendezvous.h"

namespace zerort {
namespace comm {

// Wraps `external` without taking ownership. REQUIRES: external != nullptr (else
// InvalidArgument), and it outlives the returned communicator.
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(ncclComm_t external,
                                                                     CommOptions options = {});

// Creates and owns a communicator for `rank` of `world_size` on CUDA device `device`, from the
// ncclUniqueId that rank 0 made with ncclGetUniqueId. Initialisation is non-blocking and polled:
// peers that never join give DeadlineExceeded after options.timeout_ms (and an aborted comm).
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(const ncclUniqueId& id,
                                                                     int rank, int world_size,
                                                                     int device,
                                                                     CommOptions options = {});

// Rank 0 makes the unique id and hands it to the others through the TCP rendezvous at
// info.master_addr:master_port (or through torchrun's store); the device is info.device
// (comm/launch_env.h).
absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicatorFromLaunch(
    const LaunchInfo& info, CommOptions options = {},
    RendezvousOptions rendezvous = RendezvousOptions());

}  // namespace comm
}  // namespace zerort

#endif  // ZERORT_COMM_NCCL_H_
