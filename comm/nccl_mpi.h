// Bootstraps an NCCL communicator over MPI: rank 0 of `comm` makes the ncclUniqueId and
// broadcasts it with MPI; every rank then joins on `device`. For jobs launched with mpirun
// that already use MPI; without MPI use CreateNcclCommunicatorFromLaunch (comm/nccl.h).
// A separate target so that the NCCL backend does not drag MPI into every program.
//
// REQUIRES: MPI initialized (see MpiSession in comm/mpi.h); every rank of `comm` calls this.
// The broadcast is polled against options.timeout_ms (DeadlineExceeded), as is NCCL's init.
#ifndef ZERORT_COMM_NCCL_MPI_H_
#define ZERORT_COMM_NCCL_MPI_H_

#include <memory>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "comm/mpi.h"
#include "comm/nccl.h"

namespace zerort {
namespace comm {

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicatorOverMpi(
    MPI_Comm comm, int device, CommOptions options = {});

}  // namespace comm
}  // namespace zerort

#endif  // ZERORT_COMM_NCCL_MPI_H_
