// StreamOrder: how the engine's device work, its collectives and the trainer's work are
// ordered, whatever the communicator.
//
// compute(): the trainer's stream; every device operation of the engine is ordered on it.
// With a stream-ordered communicator (NCCL), collectives and their follow-up run on a comm
// stream of their own (side()), which waits for compute() through events and is joined back
// where results are needed: at Step() (reduced gradients), when a gradient bucket is handed
// out again, when a gathered unit is handed to the trainer. The CPU communicators read memory
// when called: the host then waits for compute() before each collective, side() is compute()
// itself and every bucket and slot event is a no-op.
//
// The events, by what they order:
//   BeforeComm       compute -> comm: what the trainer wrote is complete before a collective
//   JoinComm         comm -> compute: collectives' results before the trainer's next work
//   BucketReduced    comm: bucket b's reduce-scatter has read it ...
//   BeforeBucketReuse  ... before compute zero-fills it for the next unit
//   SlotReleased     compute: the trainer is done with the unit in gather slot s ...
//   BeforeSlotGather   ... before the comm stream all-gathers another unit into it
//   SlotGathered     comm: slot s's all-gather has landed ...
//   BeforeSlotUse      ... before compute reads it
//
// Thread safety: not thread-safe; one per engine. The destructor waits for the comm stream.
#ifndef ZERORT_ZERO_INTERNAL_STREAM_ORDER_H_
#define ZERORT_ZERO_INTERNAL_STREAM_ORDER_H_

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/dtype.h"
#include "comm/communicator.h"
#include "device/device.h"

namespace zerort {
namespace zero_internal {

class StreamOrder {
 public:
  // `stream_ordered`: the communicator only enqueues its collectives (Communicator::
  // stream_ordered()). `buckets` and `slots`: how many gradient buckets and gather slots the
  // plan has.
  // `comm` must outlive this object; its stream_ordered() picks the ordering.
  static absl::StatusOr<std::unique_ptr<StreamOrder>> Create(Device* device,
                                                             Device::Stream compute,
                                                             comm::Communicator* comm,
                                                             int buckets, int slots);
  ~StreamOrder();
  StreamOrder(const StreamOrder&) = delete;
  StreamOrder& operator=(const StreamOrder&) = delete;

  Device::Stream compute() const { return compute_; }
  // Where collectives and their follow-up run: the comm stream, or compute().
  Device::Stream side() const { return side_; }
  bool stream_ordered() const { return comm_ != nullptr; }

  absl::Status BeforeComm();
  absl::Status JoinComm();
  absl::Status BucketReduced(int bucket);
  absl::Status BeforeBucketReuse(int bucket);
  absl::Status SlotReleased(int slot);
  absl::Status BeforeSlotGather(int slot);
  absl::Status SlotGathered(int slot);
  absl::Status BeforeSlotUse(int slot);
  // Orders `event` (recorded by some other stream) before the next collective: the comm stream
  // waits for it, or, for communicators that read memory when called, the host does.
  absl::Status BeforeCommAfter(Device::Event event);

  // HSDP (memory::Hierarchical): AllGather then runs on `shard_group`, this rank's group of
  // `group_size` consecutive ranks (parameters are gathered within the group only), and
  // ReduceScatter becomes the world communicator's ReduceScatterInGroups (every rank's
  // gradients, reduced in the flat order, scattered within the group). Call before the first
  // collective. `shard_group` must outlive this object and be stream-ordered when the world
  // communicator is (a Split of it is).
  void SetShardGroup(comm::Communicator* shard_group, int group_size) {
    gather_comm_ = shard_group;
    group_size_ = group_size;
  }

  // hpZ (memory::Hpz): `node` is this rank's group of zero_hpz_partition_size consecutive
  // ranks, over which AllGatherInNode runs. Call before the first collective; `node` must
  // outlive this object and be stream-ordered when the world communicator is.
  void SetNodeGroup(comm::Communicator* node) { node_comm_ = node; }
  // MiCS's hierarchical gather (PlanOptions::hierarchical_gather): AllGather then runs in two
  // steps, as DeepSpeed's MiCS does: over `across` (the shard group's ranks at this rank's
  // position in its node, one per node) into `stage`, whose blocks are copied to their places
  // in the unit, then over `within` (this node's ranks of the group), one all-gather per node
  // of the group, in place. `stage`: the plan's gather_stage (device memory, at least
  // across->size() blocks of the largest gather). Same lifetime rules as SetShardGroup.
  void SetHierarchicalGather(comm::Communicator* across, comm::Communicator* within,
                             char* stage) {
    across_comm_ = across;
    within_comm_ = within;
    stage_ = stage;
  }

  // The communicator's collectives on side(), with the buffer contracts of comm/
  // communicator.h; see above for what they wait for first. Collective.
  absl::Status AllGather(const void* send, void* recv, size_t count, DType dtype);
  // hpZ: AllGather over the node group of SetNodeGroup. REQUIRES: SetNodeGroup.
  absl::Status AllGatherInNode(const void* send, void* recv, size_t count, DType dtype);
  absl::Status ReduceScatter(const void* send, void* recv, size_t count, DType dtype,
                             comm::ReduceOp op);
  absl::Status AllReduce(const void* send, void* recv, size_t count, DType dtype,
                         comm::ReduceOp op);

 private:
  StreamOrder(Device* device, Device::Stream compute, comm::Communicator* comm)
      : dev_(device),
        comm_group_(comm),
        gather_comm_(comm),
        group_size_(comm->size()),
        compute_(compute),
        side_(compute) {}
  // Complete-on-return communicators: the device work on side() that feeds the next call.
  absl::Status BeforeCall();
  absl::Status HierarchicalAllGather(const void* send, void* recv, size_t count, DType dtype);

  Device* const dev_;
  comm::Communicator* const comm_group_;
  comm::Communicator* gather_comm_;  // comm_group_, or with HSDP the shard group
  int group_size_;                   // ranks per shard group: comm_group_'s size when flat
  comm::Communicator* node_comm_ = nullptr;    // hpZ only
  comm::Communicator* across_comm_ = nullptr;  // hierarchical gather only: one rank per node
  comm::Communicator* within_comm_ = nullptr;  // ... and the node's ranks of the shard group
  char* stage_ = nullptr;                      // ... and its across-node step's output
  const Device::Stream compute_;
  Device::Stream comm_ = nullptr;          // null unless the communicator is stream-ordered
  Device::Stream side_;
  Device::Event compute_mark_ = nullptr;   // compute -> comm
  Device::Event comm_mark_ = nullptr;      // comm -> compute
  std::vector<Device::Event> bucket_free_;  // per bucket: its reduce-scatter has read it
  std::vector<Device::Event> slot_ready_;   // per gather slot: its all-gather has landed
  std::vector<Device::Event> slot_free_;    // per gather slot: compute released its unit
};

}  // namespace zero_internal
}  // namespace zerort

#endif  // ZERORT_ZERO_INTERNAL_STREAM_ORDER_H_
