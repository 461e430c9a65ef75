// MPI backend of Communicator: ranks are MPI processes (one node or many), buffers are host
// memory. Also the MPI start-up helpers for programs, MpiSession and StartMpiJob
// (comm/mpi_session.cc).
//
//   ASSIGN_OR_RETURN(auto mpi, comm::MpiSession::Init(&argc, &argv));
//   ASSIGN_OR_RETURN(auto comm, comm::CreateMpiCommunicator(MPI_COMM_WORLD));
//
// MPI only moves bytes here (Isend/Irecv, Iallgather(v), Ibcast, Ibarrier); every reduction is
// done locally in rank order (comm/communicator.h's determinism contract), never by
// MPI_Allreduce, whose summation order is unspecified. Each communicator works on its own
// MPI_Comm_dup of the given communicator with MPI_ERRORS_RETURN, so MPI errors come back as
// Status naming the call and rank, and our traffic never matches the caller's.
//
// Arguments are always checked (CommOptions::check_args is not needed): before each operation
// every rank sends its (op, sequence, count, dtype, reduce op, root) to every other rank point
// to point, so a mismatch is InvalidArgument on every rank naming both ranks' calls, and every
// received data message must have exactly the expected size (InvalidArgument naming the
// sender otherwise).
//
// Timeouts: every operation is non-blocking and polled against options.timeout_ms, so a peer
// that never calls yields DeadlineExceeded, naming the ranks whose messages never came,
// instead of a hang. In a collective's own phase (every rank's argument record arrived) the
// requests cannot say who is late: the ranks that time out there notify each other, and the
// error, up to min(timeout_ms, 5 s) later, names the ranks never heard from and those that
// finished. CreateMpiCommunicator is bounded by options.setup_timeout_ms, MpiSession::Init by
// its timeout_ms. The timed-out request cannot be cancelled (MPI has no cancel for
// collectives): the communicator is then poisoned, keeps its scratch buffers alive, and is
// never freed. A peer killed by a signal is usually noticed by OpenMPI's runtime first, which
// terminates the whole job (see docs/comm.md).
//
// Split: the argument check above (polled, so a rank that never calls is DeadlineExceeded
// naming it), then MPI_Comm_split, which blocks but is entered only once every rank has been
// seen entering the same split. The sub-communicator owns the new MPI_Comm and frees it.
//
// Thread safety: one thread at a time per communicator. MPI must be initialized with at least
// MPI_THREAD_SERIALIZED if several threads use communicators (MpiSession does this).
#ifndef ZERORT_COMM_MPI_H_
#define ZERORT_COMM_MPI_H_

// The C API only: OpenMPI's deprecated C++ bindings are not installed with the headers we use.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "comm/communicator.h"

namespace zerort {
namespace comm {

// Owns MPI's lifetime for a program: MPI_Init_thread(MPI_THREAD_SERIALIZED) on Init unless MPI
// is already initialized, MPI_Finalize on destruction if Init initialized it.
// Init is bounded by `timeout_ms`: MPI_Init_thread waits for every process of the job, so a
// peer that never starts is DeadlineExceeded naming MPI_Init_thread instead of a hang. MPI is
// then unusable in this process (the init is still blocked, on a detached thread, and a later
// Init is FailedPrecondition): report the error and exit. Init after MPI_Finalize (MPI cannot
// be initialized twice) is FailedPrecondition too.
// Not thread-safe; create once from main(). REQUIRES: timeout_ms > 0 (else InvalidArgument).
class MpiSession {
 public:
  static absl::StatusOr<std::unique_ptr<MpiSession>> Init(int* argc, char*** argv,
                                                          int64_t timeout_ms = 120000);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

  int world_rank() const { return rank_; }
  int world_size() const { return size_; }

 private:
  MpiSession(bool owns, int rank, int size) : owns_(owns), rank_(rank), size_(size) {}
  bool owns_;
  int rank_;
  int size_;
};

// Converts an MPI return code into a Status: "<call> failed on rank <r>: <MPI error string>".
// MPI_SUCCESS gives OK. Argument-class errors map to InvalidArgument, the rest to Unavailable
// (in practice a lost peer or transport).
absl::Status MpiStatus(int code, absl::string_view call, int rank);

// REQUIRES: MPI initialized; `comm` valid; every rank of `comm` calls this (MPI_Comm_idup is
// collective: DeadlineExceeded after options.setup_timeout_ms if one does not);
// options.timeout_ms > 0 and options.setup_timeout_ms > 0.
absl::StatusOr<std::unique_ptr<Communicator>> CreateMpiCommunicator(MPI_Comm comm = MPI_COMM_WORLD,
                                                                    CommOptions options = {});

// What a program's main() holds under mpirun: the session and a communicator over
// MPI_COMM_WORLD (destroyed first, as members go in reverse order).
struct MpiJob {
  std::unique_ptr<MpiSession> session;
  std::unique_ptr<Communicator> comm;
};

// MpiSession::Init, then CreateMpiCommunicator(MPI_COMM_WORLD, options); the first error.
absl::StatusOr<MpiJob> StartMpiJob(int* argc, char*** argv, CommOptions options = {});

}  // namespace comm
}  // namespace zerort

#endif  // ZERORT_COMM_MPI_H_
