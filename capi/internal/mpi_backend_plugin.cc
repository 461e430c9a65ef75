#include <dlfcn.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "capi/internal/mpi_backend.h"

namespace zerort {
namespace capi {
namespace {

struct Loaded {
  const MpiBackend* backend = nullptr;
  std::string error;  // when backend == nullptr
};

// libzerort_mpi.so.0 from the folder of the library holding this code (dladdr), so that a moved
// or copied install tree finds its own plugin, never one on the loader's paths.
Loaded Load() {
  Loaded l;
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&GetMpiBackend), &info) == 0 || info.dli_fname == nullptr) {
    l.error = "zr_mpi_*: cannot tell which file libzerort was loaded from (dladdr failed)";
    return l;
  }
  std::string dir = info.dli_fname;
  const size_t slash = dir.rfind('/');
  dir = slash == std::string::npos ? "." : dir.substr(0, slash);
  const std::string path = absl::StrCat(dir, "/", kMpiPluginFile);
  // RTLD_LOCAL: the plugin's own copy of zerort's code stays private to it.
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    const char* e = dlerror();
    l.error = absl::StrCat("zr_mpi_*: MPI support is in ", path,
                           " (it needs OpenMPI's libmpi.so.40), which did not load: ",
                           e != nullptr ? e : "dlopen failed");
    return l;
  }
  using Fn = const MpiBackend* (*)();
  auto fn = reinterpret_cast<Fn>(dlsym(h, kMpiPluginSymbol));
  if (fn == nullptr) {
    l.error = absl::StrCat("zr_mpi_*: ", path, " has no ", kMpiPluginSymbol,
                           " (a plugin from another zerort build?)");
    return l;
  }
  l.backend = fn();
  return l;
}

}  // namespace

absl::StatusOr<const MpiBackend*> GetMpiBackend() {
  static const Loaded* loaded = new Loaded(Load());
  if (loaded->backend == nullptr) return absl::FailedPreconditionError(loaded->error);
  return loaded->backend;
}

}  // namespace capi
}  // namespace zerort
