#include "zero/internal/host_collectives.h"

#include <cstring>

#include "base/status.h"
#include "memory/arena.h"

namespace zerort {
namespace zero_internal {

absl::Status HostCollectives::AllGatherHost(const void* send, void* recv, size_t count,
                                            DType dtype, void* device_scratch) {
  const size_t block = count * DTypeSize(dtype);
  const int world = size();
  if (world == 1) {
    std::memmove(recv, send, block);
    return absl::OkStatus();
  }
  if (!comm_->stream_ordered()) return comm_->AllGather(send, recv, count, dtype);
  memory::Allocation transient;
  if (device_scratch == nullptr) {
    ASSIGN_OR_RETURN(transient, memory::Allocation::Create(
                                    dev_->allocator(memory::MemoryKind::kDevice), world * block));
    device_scratch = transient.get();
  }
  char* mine = static_cast<char*>(device_scratch) + rank() * block;
  RETURN_IF_ERROR(dev_->Copy(mine, send, block, compute_));
  RETURN_IF_ERROR(comm_->AllGather(mine, device_scratch, count, dtype, compute_));
  RETURN_IF_ERROR(dev_->Copy(recv, device_scratch, world * block, compute_));
  return dev_->Synchronize(compute_);
}

absl::Status HostCollectives::BroadcastHost(void* buf, size_t count, DType dtype, int root) {
  if (size() == 1) return absl::OkStatus();
  if (!comm_->stream_ordered()) return comm_->Broadcast(buf, count, dtype, root);
  const size_t bytes = count * DTypeSize(dtype);
  ASSIGN_OR_RETURN(memory::Allocation scratch,
                   memory::Allocation::Create(dev_->allocator(memory::MemoryKind::kDevice),
                                              bytes));
  RETURN_IF_ERROR(dev_->Copy(scratch.get(), buf, bytes, compute_));
  RETURN_IF_ERROR(comm_->Broadcast(scratch.get(), count, dtype, root, compute_));
  RETURN_IF_ERROR(dev_->Copy(buf, scratch.get(), bytes, compute_));
  return dev_->Synchronize(compute_);
}

}  // namespace zero_internal
}  // namespace zerort
