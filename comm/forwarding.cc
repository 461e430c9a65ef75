#include "comm/forwarding.h"

#include <utility>

namespace zerort {
namespace comm {

ForwardingCommunicator::ForwardingCommunicator(Communicator* inner) : inner_(inner) {}

ForwardingCommunicator::ForwardingCommunicator(std::unique_ptr<Communicator> owned)
    : owned_(std::move(owned)), inner_(owned_.get()) {}

int ForwardingCommunicator::rank() const { return inner_->rank(); }
int ForwardingCommunicator::size() const { return inner_->size(); }
absl::string_view ForwardingCommunicator::backend() const { return inner_->backend(); }
bool ForwardingCommunicator::device_memory() const { return inner_->device_memory(); }
bool ForwardingCommunicator::stream_ordered() const { return inner_->stream_ordered(); }

absl::Status ForwardingCommunicator::AllGather(const void* send, void* recv, size_t count,
                                               DType dtype, Stream stream) {
  return inner_->AllGather(send, recv, count, dtype, stream);
}

absl::Status ForwardingCommunicator::ReduceScatter(const void* send, void* recv, size_t count,
                                                   DType dtype, ReduceOp op, Stream stream) {
  return inner_->ReduceScatter(send, recv, count, dtype, op, stream);
}

absl::Status ForwardingCommunicator::AllReduce(const void* send, void* recv, size_t count,
                                               DType dtype, ReduceOp op, Stream stream) {
  return inner_->AllReduce(send, recv, count, dtype, op, stream);
}

absl::Status ForwardingCommunicator::Broadcast(void* buf, size_t count, DType dtype, int root,
                                               Stream stream) {
  return inner_->Broadcast(buf, count, dtype, root, stream);
}

absl::Status ForwardingCommunicator::ReduceScatterInGroups(const void* send, void* recv,
                                                           size_t count, DType dtype, ReduceOp op,
                                                           int group_size, Stream stream) {
  return inner_->ReduceScatterInGroups(send, recv, count, dtype, op, group_size, stream);
}

absl::Status ForwardingCommunicator::Barrier() { return inner_->Barrier(); }

absl::Status ForwardingCommunicator::Synchronize(Stream stream) {
  return inner_->Synchronize(stream);
}

absl::StatusOr<std::unique_ptr<Communicator>> ForwardingCommunicator::Split(int color, int key) {
  absl::StatusOr<std::unique_ptr<Communicator>> sub = inner_->Split(color, key);
  if (!sub.ok() || *sub == nullptr) return sub;
  return WrapSplit(color, *std::move(sub));
}

absl::StatusOr<std::unique_ptr<Communicator>> ForwardingCommunicator::WrapSplit(
    int color, std::unique_ptr<Communicator> sub) {
  return sub;
}

}  // namespace comm
}  // namespace zerort
