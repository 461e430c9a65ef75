#include "comm/testing/mpi_main.h"

#include <cstdio>

#include "absl/status/statusor.h"
#include "comm/mpi.h"

namespace zerort {
namespace comm {
namespace testing {

int MpiTestMain(int argc, char** argv, const std::function<int(Communicator* mpi)>& body) {
  absl::StatusOr<MpiJob> job = StartMpiJob(&argc, &argv);
  if (!job.ok()) {
    std::fprintf(stderr, "MPI: %s\n", job.status().ToString().c_str());
    return 1;
  }
  return body(job->comm.get());
}

}  // namespace testing
}  // namespace comm
}  // namespace zerort
