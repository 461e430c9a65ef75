// Link-byte counting: a Communicator that forwards every call to another and records the bytes
// this rank sends through it, split by link class, so that a run's traffic can be compared with
// the memory plan's comm_bytes_intra_node_per_step / comm_bytes_inter_node_per_step
// (memory/plan.h) by measurement rather than by formula.
//
//   comm::LinkByteLog log;
//   ASSIGN_OR_RETURN(auto counted, comm::CountLinkBytes(world_comm, /*ranks_per_node=*/4, &log));
//   ... train on counted.get() (its Splits are counted too) ...
//   comm::LinkBytes sent = log.Total();
//
// Bytes sent follow the plan's convention (nccl-tests' bus bytes), per call on a group of n ranks
// with e-byte elements:
//   AllGather, ReduceScatter (count per block):  (n - 1) * count * e
//   AllReduce (count):                           2 * (n - 1) * count * e / n  (rounded down)
//   Broadcast (count):                           count * e
//   ReduceScatterInGroups (group g, R = n / g):  as NCCL runs it (comm/nccl.h): a ReduceScatter
//     over this rank's g consecutive ranks, then an AllReduce of the count-element block over
//     the R ranks of its position, each counted and classified as a collective of its own.
// A collective on one rank, one with count 0 and Barrier count nothing.
//
// Link class: world ranks r and q share a node when r / ranks_per_node == q / ranks_per_node. A
// collective is intra-node when every rank of its group shares this rank's node; otherwise all
// its bytes count as inter-node (the slowest link it uses sets its time), as the plan counts.
//
// Split groups: the wrapper learns the world ranks of a Split's members by all-gathering them
// over the new group (one uncounted exchange per Split), so membership is what the backend
// built, not a re-derivation of Split's rule.
//
// REQUIRES: a communicator that reads host buffers when called (stream_ordered() false: the
// in-process and MPI backends); Split fails with FailedPrecondition on a stream-ordered one.
// Thread safety: a LinkByteLog may be shared by one rank's communicators and read from any
// thread; each communicator is used as its inner one is (one thread at a time).
#ifndef ZERORT_COMM_LINK_BYTES_H_
#define ZERORT_COMM_LINK_BYTES_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "comm/communicator.h"

namespace zerort {
namespace comm {

struct LinkBytes {
  int64_t intra_node = 0;
  int64_t inter_node = 0;
  int64_t total() const { return intra_node + inter_node; }
};

// One rank's counts, shared by its counting communicators.
class LinkByteLog {
 public:
  // Calls and bytes of one kind of collective on one group.
  struct Entry {
    int64_t calls = 0;
    int64_t bytes = 0;
    bool inter_node = false;
  };

  void Add(const std::string& what, int64_t bytes, bool inter_node);
  LinkBytes Total() const;
  // Keyed "<op> over ranks a,b,c" (world ranks): for messages when a count differs.
  std::map<std::string, Entry> Entries() const;
  std::string ToString() const;
  void Clear();

 private:
  mutable absl::Mutex mu_;
  LinkBytes total_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
};

// Wraps `world` (not owned; must outlive the result and its Splits), whose rank r is world rank r.
// REQUIRES: ranks_per_node >= 1 divides world->size() (else InvalidArgument naming it); `log`
// outlives the result.
absl::StatusOr<std::unique_ptr<Communicator>> CountLinkBytes(Communicator* world,
                                                             int ranks_per_node, LinkByteLog* log);

}  // namespace comm
}  // namespace zerort

#endif  // ZERORT_COMM_LINK_BYTES_H_
