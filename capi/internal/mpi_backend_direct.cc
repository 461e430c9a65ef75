#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "base/status.h"
#include "capi/internal/mpi_backend.h"
#include "comm/mpi.h"

namespace zerort {
namespace capi {
namespace {

// The session init opened, until finalize. Never destroyed at exit: MPI_Finalize from a static
// destructor could run after MPI's own teardown.
ABSL_CONST_INIT absl::Mutex g_mpi_mu(absl::kConstInit);
std::unique_ptr<comm::MpiSession>& MpiSessionSlot() ABSL_EXCLUSIVE_LOCKS_REQUIRED(g_mpi_mu) {
  static auto* slot = new std::unique_ptr<comm::MpiSession>();
  return *slot;
}

absl::Status Init() {
  absl::MutexLock lock(&g_mpi_mu);
  if (MpiSessionSlot() != nullptr) return absl::OkStatus();
  ASSIGN_OR_RETURN(MpiSessionSlot(), comm::MpiSession::Init(nullptr, nullptr));
  return absl::OkStatus();
}

absl::Status Finalize() {
  absl::MutexLock lock(&g_mpi_mu);
  MpiSessionSlot().reset();
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<comm::Communicator>> Create(const void* mpi_comm,
                                                           const comm::CommOptions& options) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) {
    return absl::FailedPreconditionError(
        "zr_mpi_comm_create: MPI is not initialized (call zr_mpi_init or MPI_Init_thread "
        "first)");
  }
  const MPI_Comm base =
      mpi_comm == nullptr ? MPI_COMM_WORLD : *static_cast<const MPI_Comm*>(mpi_comm);
  return comm::CreateMpiCommunicator(base, options);
}

}  // namespace

const MpiBackend* DirectMpiBackend() {
  static const MpiBackend backend{&Init, &Finalize, &Create};
  return &backend;
}

}  // namespace capi
}  // namespace zerort
