#include "zero/internal/stream_order.h"

#include "base/status.h"

namespace zerort {
namespace zero_internal {
namespace {

absl::Status CreateEvents(Device* dev, int n, std::vector<Device::Event>* out) {
  for (int k = 0; k < n; ++k) {
    ASSIGN_OR_RETURN(Device::Event e, dev->CreateEvent());
    out->push_back(e);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<StreamOrder>> StreamOrder::Create(Device* device,
                                                                 Device::Stream compute,
                                                                 comm::Communicator* comm,
                                                                 int buckets, int slots) {
  std::unique_ptr<StreamOrder> o(new StreamOrder(device, compute, comm));
  if (!comm->stream_ordered()) return o;
  ASSIGN_OR_RETURN(o->comm_, device->CreateStream());
  o->side_ = o->comm_;
  ASSIGN_OR_RETURN(o->compute_mark_, device->CreateEvent());
  ASSIGN_OR_RETURN(o->comm_mark_, device->CreateEvent());
  RETURN_IF_ERROR(CreateEvents(device, buckets, &o->bucket_free_));
  RETURN_IF_ERROR(CreateEvents(device, slots, &o->slot_ready_));
  RETURN_IF_ERROR(CreateEvents(device, slots, &o->slot_free_));
  return o;
}

StreamOrder::~StreamOrder() {
  if (comm_ != nullptr) {
    dev_->Synchronize(comm_).IgnoreError();  // a failure was reported by the step that caused it
    dev_->DestroyStream(comm_);
  }
  for (Device::Event e : {compute_mark_, comm_mark_}) {
    if (e != nullptr) dev_->DestroyEvent(e);
  }
  for (auto* list : {&bucket_free_, &slot_ready_, &slot_free_}) {
    for (Device::Event e : *list) dev_->DestroyEvent(e);
  }
}

absl::Status StreamOrder::BeforeComm() {
  if (comm_ == nullptr) return dev_->Synchronize(compute_);
  RETURN_IF_ERROR(dev_->Record(compute_mark_, compute_));
  return dev_->Wait(comm_, compute_mark_);
}

absl::Status StreamOrder::JoinComm() {
  if (comm_ == nullptr) return absl::OkStatus();
  RETURN_IF_ERROR(dev_->Record(comm_mark_, comm_));
  return dev_->Wait(compute_, comm_mark_);
}

absl::Status StreamOrder::BucketReduced(int bucket) {
  return comm_ == nullptr ? absl::OkStatus() : dev_->Record(bucket_free_[bucket], comm_);
}

absl::Status StreamOrder::BeforeBucketReuse(int bucket) {
  return comm_ == nullptr ? absl::OkStatus() : dev_->Wait(compute_, bucket_free_[bucket]);
}

absl::Status StreamOrder::SlotReleased(int slot) {
  return comm_ == nullptr ? absl::OkStatus() : dev_->Record(slot_free_[slot], compute_);
}

absl::Status StreamOrder::BeforeSlotGather(int slot) {
  return comm_ == nullptr ? absl::OkStatus() : dev_->Wait(comm_, slot_free_[slot]);
}

absl::Status StreamOrder::SlotGathered(int slot) {
  return comm_ == nullptr ? absl::OkStatus() : dev_->Record(slot_ready_[slot], comm_);
}

absl::Status StreamOrder::BeforeSlotUse(int slot) {
  return comm_ == nullptr ? absl::OkStatus() : dev_->Wait(compute_, slot_ready_[slot]);
}

absl::Status StreamOrder::BeforeCommAfter(Device::Event event) {
  return comm_ == nullptr ? dev_->WaitHost(event) : dev_->Wait(comm_, event);
}

absl::Status StreamOrder::BeforeCall() {
  return comm_ == nullptr ? dev_->Synchronize(side_) : absl::OkStatus();
}

absl::Status StreamOrder::AllGather(const void* send, void* recv, size_t count, DType dtype) {
  if (across_comm_ != nullptr) return HierarchicalAllGather(send, recv, count, dtype);
  RETURN_IF_ERROR(BeforeCall());
  return gather_comm_->AllGather(send, recv, count, dtype, side_);
}

absl::Status StreamOrder::AllGatherInNode(const void* send, void* recv, size_t count,
                                          DType dtype) {
  RETURN_IF_ERROR(BeforeCall());
  return node_comm_->AllGather(send, recv, count, dtype, side_);
}

// Group position p = node n * L + local l. The across-node step brings this rank the blocks
// of (n', l) for every node n' of the group, contiguous in stage_; each goes to its place
// n' * L + l, and the node's L ranks then fill block n' of L positions in place. Only the
// first step crosses nodes, 1/G of the unit to each other node, where a flat ring over the
// group would cross with all of it.
absl::Status StreamOrder::HierarchicalAllGather(const void* send, void* recv, size_t count,
                                                DType dtype) {
  const int nodes = across_comm_->size(), L = within_comm_->size();
  const int l = within_comm_->rank();
  const size_t block = count * DTypeSize(dtype);
  char* const full = static_cast<char*>(recv);
  RETURN_IF_ERROR(BeforeCall());
  RETURN_IF_ERROR(across_comm_->AllGather(send, stage_, count, dtype, side_));
  for (int n = 0; n < nodes; ++n) {
    RETURN_IF_ERROR(dev_->Copy(full + (static_cast<size_t>(n) * L + l) * block,
                               stage_ + static_cast<size_t>(n) * block, block, side_));
  }
  for (int n = 0; n < nodes; ++n) {
    // The copies above feed these gathers (a no-op wait for stream-ordered communicators).
    RETURN_IF_ERROR(BeforeCall());
    char* node_block = full + static_cast<size_t>(n) * L * block;
    RETURN_IF_ERROR(
        within_comm_->AllGather(node_block + l * block, node_block, count, dtype, side_));
  }
  return absl::OkStatus();
}

absl::Status StreamOrder::ReduceScatter(const void* send, void* recv, size_t count, DType dtype,
                                        comm::ReduceOp op) {
  RETURN_IF_ERROR(BeforeCall());
  if (group_size_ < comm_group_->size()) {
    return comm_group_->ReduceScatterInGroups(send, recv, count, dtype, op, group_size_, side_);
  }
  return comm_group_->ReduceScatter(send, recv, count, dtype, op, side_);
}

absl::Status StreamOrder::AllReduce(const void* send, void* recv, size_t count, DType dtype,
                                    comm::ReduceOp op) {
  RETURN_IF_ERROR(BeforeCall());
  return comm_group_->AllReduce(send, recv, count, dtype, op, side_);
}

}  // namespace zero_internal
}  // namespace zerort
