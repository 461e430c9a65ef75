// With a GPU: a one-rank MPI job (singleton init) bootstraps NCCL over MPI and all-reduces.
// Without one: reports SKIPPED and passes, after proving the target links.
#include "comm/nccl_mpi.h"

#include <cuda_runtime.h>

#include <string>
#include <vector>

#include <catch2/catch.hpp>

namespace zerort {
namespace comm {
namespace {

TEST_CASE("NcclMpi: bootstrap over MPI and all-reduce on one GPU", "[comm][gpu]") {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    WARN("SKIPPED: no CUDA device: " << (e != cudaSuccess ? cudaGetErrorString(e) : "0 devices"));
    return;
  }
  auto session = MpiSession::Init(nullptr, nullptr);
  REQUIRE(session.ok());
  auto comm = CreateNcclCommunicatorOverMpi(MPI_COMM_WORLD, 0);
  INFO(comm.status().ToString());
  REQUIRE(comm.ok());
  float* d = nullptr;
  REQUIRE(cudaMalloc(&d, 4 * sizeof(float)) == cudaSuccess);
  const std::vector<float> host = {1.5f, -2.0f, 3.25f, 0.0f};
  REQUIRE(cudaMemcpy(d, host.data(), 16, cudaMemcpyHostToDevice) == cudaSuccess);
  REQUIRE((*comm)->AllReduce(d, d, 4, DType::kF32, ReduceOp::kSum, nullptr).ok());
  REQUIRE((*comm)->Synchronize(nullptr).ok());
  std::vector<float> out(4);
  REQUIRE(cudaMemcpy(out.data(), d, 16, cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(out == host);  // one rank: the sum is the input
  cudaFree(d);
}

}  // namespace
}  // namespace comm
}  // namespace zerort
