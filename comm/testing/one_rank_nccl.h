// OneRankNccl: an NCCL communicator of world 1 on CUDA device 0, for the gpu-tagged Catch2
// cases that run the engine on one GPU. Call it after GpuOrSkip() found a GPU: it REQUIREs
// that NCCL gives a unique id and the communicator.
//
//   Device* const gpu = testing::GpuOrSkip();
//   if (gpu == nullptr) return;
//   const std::unique_ptr<comm::Communicator> nccl = comm::testing::OneRankNccl();
//
// Each call creates a communicator of its own.
#ifndef ZERORT_COMM_TESTING_ONE_RANK_NCCL_H_
#define ZERORT_COMM_TESTING_ONE_RANK_NCCL_H_

#include <nccl.h>

#include <memory>
#include <utility>

#include <catch2/catch.hpp>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "comm/nccl.h"

namespace zerort {
namespace comm {
namespace testing {

inline std::unique_ptr<Communicator> OneRankNccl() {
  ncclUniqueId id;
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  absl::StatusOr<std::unique_ptr<Communicator>> nccl =
      CreateNcclCommunicator(id, /*rank=*/0, /*world_size=*/1, /*device=*/0);
  INFO(nccl.status().ToString());
  REQUIRE(nccl.ok());
  return *std::move(nccl);
}

}  // namespace testing
}  // namespace comm
}  // namespace zerort

#endif  // ZERORT_COMM_TESTING_ONE_RANK_NCCL_H_
