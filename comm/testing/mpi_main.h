// MpiTestMain is the main() of a test binary that mpirun starts once per rank: it starts the MPI
// job, runs `body` on the communicator over MPI_COMM_WORLD and returns body's exit code, or 1
// with the error on stderr when MPI does not start. The job (session and communicator) lives
// until body returns.
//
//   int main(int argc, char** argv) { return comm::testing::MpiTestMain(argc, argv, Body); }
//
// Thread safety: call once, from main().
#ifndef ZERORT_COMM_TESTING_MPI_MAIN_H_
#define ZERORT_COMM_TESTING_MPI_MAIN_H_

#include <functional>

#include "comm/communicator.h"

namespace zerort {
namespace comm {
namespace testing {

int MpiTestMain(int argc, char** argv, const std::function<int(Communicator* mpi)>& body);

}  // namespace testing
}  // namespace comm
}  // namespace zerort

#endif  // ZERORT_COMM_TESTING_MPI_MAIN_H_
