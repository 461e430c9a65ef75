// The dead-peer scenario under MPI: the last rank SIGKILLs itself after one successful
// collective; the survivors enter an all-reduce with a 2 s timeout and report what they get.
// mpi_kill_test.sh decides what counts as success (see docs/comm.md for OpenMPI's behaviour).
#include <csignal>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "comm/mpi.h"

int main(int argc, char** argv) {
  using zerort::DType;
  using namespace zerort::comm;
  auto session = MpiSession::Init(&argc, &argv);
  if (!session.ok()) {
    std::fprintf(stderr, "%s\n", session.status().ToString().c_str());
    return 2;
  }
  CommOptions options;
  options.timeout_ms = 2000;
  auto comm = CreateMpiCommunicator(MPI_COMM_WORLD, options);
  if (!comm.ok()) {
    std::fprintf(stderr, "%s\n", comm.status().ToString().c_str());
    return 2;
  }
  const int rank = (*comm)->rank(), size = (*comm)->size();
  std::vector<float> buf(1 << 16, 1.0f);
  absl::Status first =
      (*comm)->AllReduce(buf.data(), buf.data(), buf.size(), DType::kF32, ReduceOp::kSum);
  if (!first.ok() || buf[0] != static_cast<float>(size)) {
    std::fprintf(stderr, "rank %d: first all-reduce failed: %s\n", rank,
                 first.ToString().c_str());
    return 2;
  }
  if (rank == size - 1) {
    std::fprintf(stderr, "rank %d: raising SIGKILL\n", rank);
    std::fflush(stderr);
    std::raise(SIGKILL);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status s =
      (*comm)->AllReduce(buf.data(), buf.data(), buf.size(), DType::kF32, ReduceOp::kSum);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::fprintf(stderr, "SURVIVOR rank %d: after %.2f s: %s\n", rank, seconds,
               s.ToString().substr(0, 300).c_str());
  std::fflush(stderr);
  const bool ok = (s.code() == absl::StatusCode::kDeadlineExceeded ||
                   s.code() == absl::StatusCode::kUnavailable) &&
                  seconds < 2.0 + 5.0;
  // Skip MPI_Finalize: it would wait for the dead rank.
  std::_Exit(ok ? 0 : 1);
}
