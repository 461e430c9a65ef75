#include "comm/nccl_mpi.h"

#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/cuda_status.h"
#include "base/status.h"

namespace zerort {
namespace comm {

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicatorOverMpi(
    MPI_Comm comm, int device, CommOptions options) {
  int rank = 0, size = 0;
  RETURN_IF_ERROR(MpiStatus(MPI_Comm_rank(comm, &rank), "MPI_Comm_rank", -1));
  RETURN_IF_ERROR(MpiStatus(MPI_Comm_size(comm, &size), "MPI_Comm_size", rank));
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  if (rank == 0) RETURN_IF_NCCL_ERROR(ncclGetUniqueId(&id), "on MPI rank 0");
  // Polled, so that a rank that never gets here cannot hang the others past the timeout.
  MPI_Request req;
  RETURN_IF_ERROR(MpiStatus(MPI_Ibcast(&id, sizeof id, MPI_BYTE, 0, comm, &req),
                            "MPI_Ibcast(ncclUniqueId)", rank));
  const absl::Time deadline = absl::Now() + absl::Milliseconds(options.timeout_ms);
  for (;;) {
    int done = 0;
    RETURN_IF_ERROR(MpiStatus(MPI_Test(&req, &done, MPI_STATUS_IGNORE),
                              "MPI_Test(ncclUniqueId broadcast)", rank));
    if (done) break;
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "broadcast of the ncclUniqueId did not complete on MPI rank ", rank, " of ", size,
          " within ", options.timeout_ms, " ms"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return CreateNcclCommunicator(id, rank, size, device, options);
}

}  // namespace comm
}  // namespace zerort
