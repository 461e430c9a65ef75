// libzerort_mpi.so.0: the MPI part of the C ABI for the installed libzerort.so.0, which loads it
// at the first zr_mpi_* call (capi/internal/mpi_backend.h). Exports one symbol.
#include "capi/internal/mpi_backend.h"

extern "C" __attribute__((visibility("default"))) const zerort::capi::MpiBackend*
zerort_mpi_backend_v1() {
  return zerort::capi::DirectMpiBackend();
}
