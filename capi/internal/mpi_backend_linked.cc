#include "capi/internal/mpi_backend.h"

namespace zerort {
namespace capi {

absl::StatusOr<const MpiBackend*> GetMpiBackend() { return DirectMpiBackend(); }

}  // namespace capi
}  // namespace zerort
