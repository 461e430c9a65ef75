// NCCL loaded at run time instead of linked: the installed libzerort.so.0 and bin/zerort
// (tools/install.sh) link this in place of -lnccl, so that they load on a machine without NCCL
// (a CPU-only trainer) and find NCCL where a GPU machine keeps it (often only in a Python
// environment's nvidia-nccl wheel). Bazel's own targets still link -lnccl.
//
// The library is searched for at the first NCCL call, in this order (the order of
// tools/gpu_bundle/run.sh):
//   1. an NCCL already in the process (dlopen RTLD_NOLOAD: the trainer's torch loaded one);
//   2. $ZERORT_NCCL_DIR/libnccl.so.2;
//   3. libnccl.so.2 through the system loader's paths (LD_LIBRARY_PATH, ld.so.cache);
//   4. /opt/torch/.venv/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2;
//   5. nvidia/nccl/lib/libnccl.so.2 under each site-packages folder `python3` reports.
// It is opened RTLD_NOW | RTLD_GLOBAL by absolute path. Every ncclXxx function zerort calls is
// defined here and forwards to it; when no NCCL is found, each returns ncclSystemError (a
// Status with code Unavailable) and ncclGetErrorString names the paths tried and dlerror().
// Thread-safe: the search runs once per process.
#ifndef ZERORT_COMM_NCCL_DLOPEN_H_
#define ZERORT_COMM_NCCL_DLOPEN_H_

#include <string>

#include "absl/status/statusor.h"

namespace zerort {
namespace comm {

// The absolute path of the NCCL library loaded, searching for it on the first call; or
// FailedPrecondition naming every place tried and the loader's error for each.
absl::StatusOr<std::string> LoadNccl();

}  // namespace comm
}  // namespace zerort

#endif  // ZERORT_COMM_NCCL_DLOPEN_H_
