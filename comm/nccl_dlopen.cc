#include "comm/nccl_dlopen.h"

#include <dlfcn.h>
#include <glob.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace zerort {
namespace comm {
namespace {

constexpr char kSoname[] = "libnccl.so.2";

struct Loaded {
  void* handle = nullptr;
  std::string path;   // absolute, when handle != nullptr
  std::string error;  // every place tried, when handle == nullptr
};

// Tries one absolute path; appends why it failed to `tried`.
void* OpenPath(const std::string& path, std::string* tried) {
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (h == nullptr) {
    const char* e = dlerror();
    absl::StrAppend(tried, "; ", path, ": ", e != nullptr ? e : "dlopen failed");
  }
  return h;
}

// The absolute path of the object `h` holds (found through one of its symbols).
std::string PathOf(void* h, const std::string& fallback) {
  void* sym = dlsym(h, "ncclGetVersion");
  Dl_info info;
  if (sym != nullptr && dladdr(sym, &info) != 0 && info.dli_fname != nullptr) {
    return info.dli_fname;
  }
  return fallback;
}

// site-packages folders of `python3` on PATH (none when there is no python3).
std::vector<std::string> PythonSitePackages() {
  std::vector<std::string> out;
  FILE* p = popen(
      "python3 -c 'import site; print(\"\\n\".join(site.getsitepackages() + "
      "[site.getusersitepackages()]))' 2>/dev/null",
      "r");
  if (p == nullptr) return out;
  std::string text;
  char buf[512];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) text.append(buf, n);
  pclose(p);
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipWhitespace())) {
    out.emplace_back(line);
  }
  return out;
}

Loaded Search() {
  Loaded l;
  std::string tried;
  // 1. Already in the process.
  if (void* h = dlopen(kSoname, RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD)) {
    l.handle = h;
    l.path = PathOf(h, kSoname);
    return l;
  }
  // 2. $ZERORT_NCCL_DIR.
  if (const char* dir = getenv("ZERORT_NCCL_DIR"); dir != nullptr && *dir != '\0') {
    const std::string path = absl::StrCat(dir, "/", kSoname);
    if (void* h = OpenPath(path, &tried)) {
      l.handle = h;
      l.path = path;
      return l;
    }
  }
  // 3. The system loader's paths.
  if (void* h = dlopen(kSoname, RTLD_NOW | RTLD_GLOBAL)) {
    l.handle = h;
    l.path = PathOf(h, kSoname);
    return l;
  }
  const char* e = dlerror();
  absl::StrAppend(&tried, "; ", kSoname, " (system paths): ", e != nullptr ? e : "not found");
  // 4. The torch environment's wheel, then 5. python3's site-packages.
  std::vector<std::string> candidates;
  glob_t g;
  if (glob("/opt/torch/.venv/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2", 0,
           nullptr, &g) == 0) {
    for (size_t i = 0; i < g.gl_pathc; ++i) candidates.emplace_back(g.gl_pathv[i]);
  }
  globfree(&g);
  bool python_tried = false;
  for (size_t i = 0;; ++i) {
    if (i == candidates.size()) {
      if (python_tried) break;
      python_tried = true;
      for (const std::string& sp : PythonSitePackages()) {
        candidates.push_back(absl::StrCat(sp, "/nvidia/nccl/lib/", kSoname));
      }
      if (i == candidates.size()) break;
    }
    if (access(candidates[i].c_str(), F_OK) != 0) continue;
    if (void* h = OpenPath(candidates[i], &tried)) {
      l.handle = h;
      l.path = candidates[i];
      return l;
    }
  }
  l.error = absl::StrCat(
      "NCCL (", kSoname, ") not found: set ZERORT_NCCL_DIR to the folder holding it, or install "
      "the nvidia-nccl wheel; tried: already loaded: no",
      tried.empty() ? "" : tried,
      "; /opt/torch/.venv and python3's site-packages: no nvidia/nccl/lib/", kSoname);
  return l;
}

const Loaded& Library() {
  static const Loaded* loaded = new Loaded(Search());
  return *loaded;
}

// The NCCL function `name` of the loaded library, or nullptr.
void* Symbol(const char* name) {
  const Loaded& l = Library();
  return l.handle == nullptr ? nullptr : dlsym(l.handle, name);
}

}  // namespace

absl::StatusOr<std::string> LoadNccl() {
  const Loaded& l = Library();
  if (l.handle == nullptr) return absl::FailedPreconditionError(l.error);
  return l.path;
}

}  // namespace comm
}  // namespace zerort

// Each forwarder looks its function up once; without NCCL it returns ncclSystemError.
#define ZERORT_NCCL_FORWARD(name, params, args)                                        \
  extern "C" ncclResult_t name params {                                                \
    using Fn = ncclResult_t(*) params;                                                 \
    static Fn fn = reinterpret_cast<Fn>(::zerort::comm::Symbol(#name));                \
    return fn == nullptr ? ncclSystemError : fn args;                                  \
  }

ZERORT_NCCL_FORWARD(ncclGetVersion, (int* version), (version))
ZERORT_NCCL_FORWARD(ncclGetUniqueId, (ncclUniqueId * id), (id))
ZERORT_NCCL_FORWARD(ncclCommInitRankConfig,
                    (ncclComm_t * comm, int nranks, ncclUniqueId id, int rank,
                     ncclConfig_t* config),
                    (comm, nranks, id, rank, config))
ZERORT_NCCL_FORWARD(ncclCommInitAll, (ncclComm_t * comm, int ndev, const int* devlist),
                    (comm, ndev, devlist))
ZERORT_NCCL_FORWARD(ncclCommDestroy, (ncclComm_t comm), (comm))
ZERORT_NCCL_FORWARD(ncclCommAbort, (ncclComm_t comm), (comm))
ZERORT_NCCL_FORWARD(ncclCommSplit,
                    (ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                     ncclConfig_t* config),
                    (comm, color, key, newcomm, config))
ZERORT_NCCL_FORWARD(ncclCommGetAsyncError, (ncclComm_t comm, ncclResult_t * async_error),
                    (comm, async_error))
ZERORT_NCCL_FORWARD(ncclCommCount, (const ncclComm_t comm, int* count), (comm, count))
ZERORT_NCCL_FORWARD(ncclCommCuDevice, (const ncclComm_t comm, int* device), (comm, device))
ZERORT_NCCL_FORWARD(ncclCommUserRank, (const ncclComm_t comm, int* rank), (comm, rank))
ZERORT_NCCL_FORWARD(ncclBroadcast,
                    (const void* send, void* recv, size_t count, ncclDataType_t dtype, int root,
                     ncclComm_t comm, cudaStream_t stream),
                    (send, recv, count, dtype, root, comm, stream))
ZERORT_NCCL_FORWARD(ncclAllReduce,
                    (const void* send, void* recv, size_t count, ncclDataType_t dtype,
                     ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream),
                    (send, recv, count, dtype, op, comm, stream))
ZERORT_NCCL_FORWARD(ncclReduceScatter,
                    (const void* send, void* recv, size_t recvcount, ncclDataType_t dtype,
                     ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream),
                    (send, recv, recvcount, dtype, op, comm, stream))
ZERORT_NCCL_FORWARD(ncclAllGather,
                    (const void* send, void* recv, size_t sendcount, ncclDataType_t dtype,
                     ncclComm_t comm, cudaStream_t stream),
                    (send, recv, sendcount, dtype, comm, stream))

// Without NCCL, every failure above is ours: say why NCCL is missing.
extern "C" const char* ncclGetErrorString(ncclResult_t result) {
  using Fn = const char* (*)(ncclResult_t);
  static Fn fn = reinterpret_cast<Fn>(::zerort::comm::Symbol("ncclGetErrorString"));
  if (fn != nullptr) return fn(result);
  return ::zerort::comm::Library().error.c_str();
}

extern "C" const char* ncclGetLastError(ncclComm_t comm) {
  using Fn = const char* (*)(ncclComm_t);
  static Fn fn = reinterpret_cast<Fn>(::zerort::comm::Symbol("ncclGetLastError"));
  return fn != nullptr ? fn(comm) : "NCCL not loaded";
}
