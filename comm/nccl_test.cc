// NCCL backend tests. Where no CUDA device exists they report "SKIPPED: no CUDA device" and
// pass; with one GPU they run world-size-1 communicators (NCCL refuses two ranks on one GPU),
// created three ways, against a host reference.
#include "comm/nccl.h"

#include <cuda_runtime.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "comm/testing/one_rank_nccl.h"

namespace zerort {
namespace comm {
namespace {

// Empty when a device is usable; otherwise why not.
std::string NoDeviceReason() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  if (n == 0) return "cudaGetDeviceCount returned 0";
  return "";
}

#define SKIP_WITHOUT_GPU()                                     \
  do {                                                         \
    const std::string reason = NoDeviceReason();               \
    if (!reason.empty()) {                                     \
      WARN("SKIPPED: no CUDA device: " << reason);             \
      return;                                                  \
    }                                                          \
  } while (false)

TEST_CASE("Nccl: argument errors need no device", "[comm][gpu]") {
  CHECK(CreateNcclCommunicator(static_cast<ncclComm_t>(nullptr)).status().code() ==
        absl::StatusCode::kInvalidArgument);
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  CHECK(CreateNcclCommunicator(id, 2, 2, 0).status().code() == absl::StatusCode::kInvalidArgument);
  int version = 0;
  CHECK(ncclGetVersion(&version) == ncclSuccess);  // the library links and loads
  CHECK(version >= 21000);
}

// Runs every collective on a world-1 communicator and checks it against the host copy.
void CheckWorldOne(Communicator& comm) {
  REQUIRE(comm.size() == 1);
  REQUIRE(comm.rank() == 0);
  REQUIRE(comm.backend() == "nccl");
  const size_t n = 1031;
  std::vector<float> host(n);
  for (size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i) * 0.5f - 100.0f;
  float *a = nullptr, *b = nullptr;
  REQUIRE(cudaMalloc(&a, n * sizeof(float)) == cudaSuccess);
  REQUIRE(cudaMalloc(&b, n * sizeof(float)) == cudaSuccess);
  cudaStream_t stream;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  REQUIRE(cudaMemcpy(a, host.data(), n * sizeof(float), cudaMemcpyHostToDevice) == cudaSuccess);
  std::vector<float> out(n);
  // With one rank sum, avg and max of x are x itself, exactly.
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
    REQUIRE(cudaMemset(b, 0, n * sizeof(float)) == cudaSuccess);
    REQUIRE(comm.AllReduce(a, b, n, DType::kF32, op, stream).ok());
    REQUIRE(comm.Synchronize(stream).ok());
    REQUIRE(cudaMemcpy(out.data(), b, n * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(out == host);
    REQUIRE(cudaMemset(b, 0, n * sizeof(float)) == cudaSuccess);
    REQUIRE(comm.ReduceScatter(a, b, n, DType::kF32, op, stream).ok());
    REQUIRE(comm.Synchronize(stream).ok());
    REQUIRE(cudaMemcpy(out.data(), b, n * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
    CHECK(out == host);
  }
  REQUIRE(cudaMemset(b, 0, n * sizeof(float)) == cudaSuccess);
  REQUIRE(comm.AllGather(a, b, n, DType::kF32, stream).ok());
  REQUIRE(comm.Broadcast(b, n, DType::kF32, 0, stream).ok());
  REQUIRE(comm.Synchronize(stream).ok());
  REQUIRE(cudaMemcpy(out.data(), b, n * sizeof(float), cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(out == host);
  CHECK(comm.Barrier().ok());
  cudaStreamDestroy(stream);
  cudaFree(a);
  cudaFree(b);
}

TEST_CASE("Nccl: a communicator created from a unique id runs every collective", "[comm][gpu]") {
  SKIP_WITHOUT_GPU();
  CheckWorldOne(*testing::OneRankNccl());
}

TEST_CASE("Nccl: an external communicator is wrapped, not destroyed", "[comm][gpu]") {
  SKIP_WITHOUT_GPU();
  ncclComm_t raw;
  int dev = 0;
  REQUIRE(ncclCommInitAll(&raw, 1, &dev) == ncclSuccess);
  {
    auto comm = CreateNcclCommunicator(raw);
    REQUIRE(comm.ok());
    CheckWorldOne(**comm);
  }
  int count = 0;
  CHECK(ncclCommCount(raw, &count) == ncclSuccess);  // still alive after the wrapper is gone
  CHECK(count == 1);
  ncclCommDestroy(raw);
}

TEST_CASE("Nccl: split of a world-1 communicator runs every collective; no color, no group",
          "[comm][gpu]") {
  SKIP_WITHOUT_GPU();
  std::unique_ptr<Communicator> comm = testing::OneRankNccl();
  auto sub = comm->Split(3, 0);
  INFO(sub.status().ToString());
  REQUIRE(sub.ok());
  REQUIRE(*sub != nullptr);
  comm.reset();  // the child owns its own ncclComm_t
  CheckWorldOne(**sub);
  auto none = (*sub)->Split(-1, 0);
  INFO(none.status().ToString());
  REQUIRE(none.ok());
  CHECK(*none == nullptr);
}

TEST_CASE("Nccl: bootstrap from launcher info through the rendezvous", "[comm][gpu]") {
  SKIP_WITHOUT_GPU();
  LaunchInfo info;  // world 1: no network needed, exercises the id plumbing
  auto comm = CreateNcclCommunicatorFromLaunch(info);
  INFO(comm.status().ToString());
  REQUIRE(comm.ok());
  CheckWorldOne(**comm);
}

}  // namespace
}  // namespace comm
}  // namespace zerort
