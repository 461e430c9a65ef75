// MpiSession: MPI's lifetime in a program (MPI_Init_thread, bounded by a timeout, and the
// MPI_Finalize it then owes), and StartMpiJob, which also opens the communicator a program's
// main() uses. Apart from the communicator (comm/mpi.cc) because a session is process-wide
// state with its own failure modes: an init that never completes, a second init.
#include "comm/mpi.h"

#include <atomic>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/status.h"

namespace zerort {
namespace comm {
namespace {

// Set once an MPI_Init_thread has been started by MpiSession::Init: MPI may be initialized
// only once, and a timed-out init is still running.
std::atomic<bool> g_init_started{false};

// The outcome of MPI_Init_thread, shared with the thread that runs it: on a timeout that
// thread outlives Init, so it owns its own reference.
struct InitCall {
  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  int rc ABSL_GUARDED_BY(mu) = MPI_SUCCESS;
  int provided ABSL_GUARDED_BY(mu) = 0;
};

// MPI_Init_thread has no timeout of its own: it waits (OpenMPI: in the PMIx fence of its
// modex) until every process of the job has started it, so a peer that never starts would
// hang us forever. It runs on a helper thread, and the wait for it is bounded; on a timeout
// that thread stays blocked in MPI (an init cannot be abandoned) and is detached.
absl::Status InitThreadWithin(int* argc, char*** argv, int64_t timeout_ms, int* provided) {
  auto call = std::make_shared<InitCall>();
  std::thread t([call, argc, argv] {
    int got = 0;
    const int rc = MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &got);
    absl::MutexLock lock(&call->mu);
    call->done = true;
    call->rc = rc;
    call->provided = got;
  });
  call->mu.Lock();
  const bool done = call->mu.AwaitWithTimeout(absl::Condition(&call->done),
                                              absl::Milliseconds(timeout_ms));
  const int rc = call->rc;
  *provided = call->provided;
  call->mu.Unlock();
  if (!done) {
    t.detach();
    return absl::DeadlineExceededError(absl::StrCat(
        "MPI_Init_thread did not complete within ", timeout_ms, " ms (MpiSession::Init "
        "timeout_ms): a process of the MPI job has not started or is stuck before MPI_Init; "
        "MPI is unusable in this process"));
  }
  t.join();
  return MpiStatus(rc, "MPI_Init_thread", -1);
}

}  // namespace

absl::StatusOr<std::unique_ptr<MpiSession>> MpiSession::Init(int* argc, char*** argv,
                                                             int64_t timeout_ms) {
  if (timeout_ms <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("MpiSession::Init: timeout_ms must be > 0, got ", timeout_ms));
  }
  // MPI_Initialized stays true after MPI_Finalize, and any other MPI call then ends the
  // process inside MPI: check for a finalized MPI first.
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) {
    return absl::FailedPreconditionError(
        "MpiSession::Init: MPI was already finalized in this process (MPI_Finalize ran, e.g. "
        "through zr_mpi_finalize); MPI cannot be initialized again");
  }
  int initialized = 0;
  MPI_Initialized(&initialized);
  bool owns = false;
  if (!initialized) {
    if (g_init_started.exchange(true)) {
      return absl::FailedPreconditionError(
          "MpiSession::Init: an earlier MPI_Init_thread of this process failed or is still "
          "waiting for its peers; MPI can be initialized only once");
    }
    int provided = 0;
    RETURN_IF_ERROR(InitThreadWithin(argc, argv, timeout_ms, &provided));
    owns = true;
    if (provided < MPI_THREAD_SERIALIZED) {
      MPI_Finalize();
      return absl::FailedPreconditionError(absl::StrCat(
          "MPI_Init_thread provided thread level ", provided, ", need MPI_THREAD_SERIALIZED"));
    }
  }
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return std::unique_ptr<MpiSession>(new MpiSession(owns, rank, size));
}

MpiSession::~MpiSession() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (owns_ && !finalized) MPI_Finalize();
}

absl::StatusOr<MpiJob> StartMpiJob(int* argc, char*** argv, CommOptions options) {
  MpiJob job;
  ASSIGN_OR_RETURN(job.session, MpiSession::Init(argc, argv));
  ASSIGN_OR_RETURN(job.comm, CreateMpiCommunicator(MPI_COMM_WORLD, options));
  return job;
}

}  // namespace comm
}  // namespace zerort
