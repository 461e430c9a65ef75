// The run-time NCCL loader, linked without -lnccl: the search finds the library through
// $ZERORT_NCCL_DIR, and the ncclXxx functions forward to it. (The search runs once per process:
// one case.)
#include "comm/nccl_dlopen.h"

#include <nccl.h>
#include <stdlib.h>

#include <catch2/catch.hpp>
#include <string>

namespace zerort {
namespace comm {
namespace {

TEST_CASE("NcclDlopen: ZERORT_NCCL_DIR's libnccl.so.2 is loaded and calls forward to it",
          "[comm]") {
  REQUIRE(setenv("ZERORT_NCCL_DIR", "/usr/local/cuda/lib64", 1) == 0);
  absl::StatusOr<std::string> path = LoadNccl();
  REQUIRE(path.ok());
  CHECK(*path == "/usr/local/cuda/lib64/libnccl.so.2");
  int version = 0;
  REQUIRE(ncclGetVersion(&version) == ncclSuccess);
  CHECK(version >= 21800);  // 2.18: ncclCommSplit, which comm/nccl.cc needs
  // NCCL's own text, not the loader's "not found" message.
  CHECK(std::string(ncclGetErrorString(ncclInvalidArgument)).find("not found") ==
        std::string::npos);
  ncclUniqueId id;
  CHECK(ncclGetUniqueId(&id) == ncclSuccess);  // works without a GPU (bootstrap only)
}

}  // namespace
}  // namespace comm
}  // namespace zerort
