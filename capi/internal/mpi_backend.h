// The MPI part of the C ABI (zr_mpi_init, zr_mpi_finalize, zr_mpi_comm_create) behind one seam,
// so that the installed libzerort.so.0 does not need OpenMPI: there it comes from the plugin
// libzerort_mpi.so.0 beside it, loaded at the first zr_mpi_* call (mpi_backend_plugin.cc);
// Bazel's targets and the static archive link it in (mpi_backend_linked.cc).
// Thread-safe.
#ifndef ZERORT_CAPI_INTERNAL_MPI_BACKEND_H_
#define ZERORT_CAPI_INTERNAL_MPI_BACKEND_H_

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "comm/communicator.h"

namespace zerort {
namespace capi {

// The plugin and the core are built from one tree in one build: this table is not a stable
// ABI, only a way across the dlopen boundary (both load the same Abseil .so files).
struct MpiBackend {
  // MPI_Init_thread unless MPI is initialized already; idempotent.
  absl::Status (*init)();
  // MPI_Finalize if init started MPI; idempotent.
  absl::Status (*finalize)();
  // A communicator over *static_cast<const MPI_Comm*>(mpi_comm), or MPI_COMM_WORLD when
  // nullptr; FailedPrecondition naming `zr_mpi_comm_create` when MPI is not initialized.
  absl::StatusOr<std::unique_ptr<comm::Communicator>> (*create)(const void* mpi_comm,
                                                                const comm::CommOptions& options);
};

// The backend this binary uses; FailedPrecondition naming the plugin and the loader's error when
// it cannot be loaded.
absl::StatusOr<const MpiBackend*> GetMpiBackend();

// The implementation over comm/mpi.h (mpi_backend_direct.cc).
const MpiBackend* DirectMpiBackend();

// The plugin's one exported symbol, returning DirectMpiBackend().
inline constexpr char kMpiPluginSymbol[] = "zerort_mpi_backend_v1";
inline constexpr char kMpiPluginFile[] = "libzerort_mpi.so.0";

}  // namespace capi
}  // namespace zerort

#endif  // ZERORT_CAPI_INTERNAL_MPI_BACKEND_H_
