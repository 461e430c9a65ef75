// MPI after MPI_Finalize: run under mpirun by mpi_init_test.sh. MpiSession::Init, destroy it
// (MPI_Finalize), then Init again, as zr_mpi_init after zr_mpi_finalize does. MPI_Initialized
// stays true after finalize, and OpenMPI ends the process on any later call, so the second
// Init must return FailedPrecondition saying MPI was finalized; prints REINIT_OK for the script.
#include <cstdio>
#include <string>

#include "absl/strings/match.h"
#include "comm/mpi.h"

int main(int argc, char** argv) {
  auto first = zerort::comm::MpiSession::Init(&argc, &argv);
  if (!first.ok()) {
    std::printf("REINIT_FAIL: first Init: %s\n", first.status().ToString().c_str());
    return 1;
  }
  first->reset();  // MPI_Finalize
  auto again = zerort::comm::MpiSession::Init(&argc, &argv);
  const std::string msg = again.status().ToString();
  const bool ok = again.status().code() == absl::StatusCode::kFailedPrecondition &&
                  absl::StrContains(msg, "finalized");
  std::printf("second Init: %s\n%s\n", msg.c_str(), ok ? "REINIT_OK" : "REINIT_FAIL");
  return ok ? 0 : 1;
}
