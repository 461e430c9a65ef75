// A peer that never starts MPI: run under mpirun by mpi_init_test.sh. Every rank but the last
// calls MpiSession::Init with a short timeout; the last rank sleeps far longer before its own
// Init (as a process stuck before MPI_Init would). The others must get DeadlineExceeded naming
// MPI_Init_thread within the timeout (plus slack), and print INIT_TIMEOUT_OK for the script.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "comm/mpi.h"

int main(int argc, char** argv) {
  const char* r = std::getenv("OMPI_COMM_WORLD_RANK");
  const char* n = std::getenv("OMPI_COMM_WORLD_SIZE");
  if (r == nullptr || n == nullptr) {
    std::fprintf(stderr, "run under mpirun\n");
    return 2;
  }
  const int rank = std::atoi(r), size = std::atoi(n);
  if (rank == size - 1) {
    // Killed by mpirun when the others exit; never reaches Init in a passing run.
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto session = zerort::comm::MpiSession::Init(&argc, &argv, /*timeout_ms=*/1500);
  const double s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string msg = session.status().ToString();
  std::printf("rank %d: Init returned after %.2f s: %s\n", rank, s, msg.c_str());
  const bool ok = session.status().code() == absl::StatusCode::kDeadlineExceeded &&
                  absl::StrContains(msg, "MPI_Init_thread did not complete within 1500 ms") &&
                  s >= 1.4;
  // A second Init must not try MPI again.
  auto again = zerort::comm::MpiSession::Init(&argc, &argv, 1500);
  const bool refused = again.status().code() == absl::StatusCode::kFailedPrecondition;
  std::printf("rank %d: %s\n", rank, ok && refused ? "INIT_TIMEOUT_OK" : "INIT_TIMEOUT_FAIL");
  std::fflush(stdout);
  // The init thread is still blocked inside MPI: leave without running exit handlers.
  std::_Exit(ok && refused ? 0 : 1);
}
