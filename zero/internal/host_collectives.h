// HostCollectives: AllGather and Broadcast of host buffers over any communicator (setup,
// norm partials, exports, restores, peer checks).
//
// Communicators that are complete on return read host memory when called (the GPU in-process
// ops copy with cudaMemcpyDefault) and get the host buffers as they are. A stream-ordered one
// (NCCL) moves device memory only: the values are staged through device memory on the compute
// stream, which is synchronized before returning.
//
// Implements comm::HostExchange, so comm/agree.h's exact integer and byte exchanges work over
// every communicator through it.
//
// Thread safety: as the communicator (one thread per rank).
#ifndef ZERORT_ZERO_INTERNAL_HOST_COLLECTIVES_H_
#define ZERORT_ZERO_INTERNAL_HOST_COLLECTIVES_H_

#include <cstddef>

#include "absl/status/status.h"
#include "comm/agree.h"
#include "comm/communicator.h"
#include "device/device.h"

namespace zerort {
namespace zero_internal {

class HostCollectives final : public comm::HostExchange {
 public:
  // Every argument must outlive this object. `compute`: the stream staging copies run on.
  HostCollectives(comm::Communicator* comm, Device* device, Device::Stream compute)
      : comm_(comm), dev_(device), compute_(compute) {}

  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }
  absl::Status AllGatherHost(const void* send, void* recv, size_t count, DType dtype) override {
    return AllGatherHost(send, recv, count, dtype, nullptr);
  }
  // `device_scratch`, when not null, holds size() * count elements of device memory to stage
  // through instead of a transient allocation (the norm table, gathered every step).
  absl::Status AllGatherHost(const void* send, void* recv, size_t count, DType dtype,
                             void* device_scratch);
  absl::Status BroadcastHost(void* buf, size_t count, DType dtype, int root) override;

 private:
  comm::Communicator* const comm_;
  Device* const dev_;
  const Device::Stream compute_;
};

}  // namespace zero_internal
}  // namespace zerort

#endif  // ZERORT_ZERO_INTERNAL_HOST_COLLECTIVES_H_
