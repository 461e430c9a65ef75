#include "comm/link_bytes.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "comm/agree.h"
#include "comm/forwarding.h"

namespace zerort {
namespace comm {

void LinkByteLog::Add(const std::string& what, int64_t bytes, bool inter_node) {
  absl::MutexLock lock(&mu_);
  (inter_node ? total_.inter_node : total_.intra_node) += bytes;
  Entry& e = entries_[what];
  e.calls += 1;
  e.bytes += bytes;
  e.inter_node = inter_node;
}

LinkBytes LinkByteLog::Total() const {
  absl::MutexLock lock(&mu_);
  return total_;
}

std::map<std::string, LinkByteLog::Entry> LinkByteLog::Entries() const {
  absl::MutexLock lock(&mu_);
  return entries_;
}

std::string LinkByteLog::ToString() const {
  absl::MutexLock lock(&mu_);
  std::string out =
      absl::StrCat("intra-node ", total_.intra_node, " B, inter-node ", total_.inter_node, " B");
  for (const auto& [what, e] : entries_) {
    absl::StrAppend(&out, "\n  ", what, ": ", e.calls, " calls, ", e.bytes, " B ",
                    e.inter_node ? "inter" : "intra");
  }
  return out;
}

void LinkByteLog::Clear() {
  absl::MutexLock lock(&mu_);
  total_ = {};
  entries_.clear();
}

namespace {

class LinkCountingCommunicator final : public ForwardingCommunicator {
 public:
  // `inner`: the communicator counted, a Communicator* (not owned) or a
  // std::unique_ptr<Communicator> (a Split's, owned). members[i]: world rank of its rank i.
  template <typename Inner>
  LinkCountingCommunicator(Inner inner, std::vector<int> members, int ranks_per_node,
                           LinkByteLog* log)
      : ForwardingCommunicator(std::move(inner)),
        members_(std::move(members)),
        ranks_per_node_(ranks_per_node),
        log_(log) {}

  absl::Status AllGather(const void* send, void* recv, size_t count, DType dtype,
                         Stream stream) override {
    Count("all_gather", AllOf(), (size() - 1) * Bytes(count, dtype));
    return inner()->AllGather(send, recv, count, dtype, stream);
  }
  absl::Status ReduceScatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                             Stream stream) override {
    Count("reduce_scatter", AllOf(), (size() - 1) * Bytes(count, dtype));
    return inner()->ReduceScatter(send, recv, count, dtype, op, stream);
  }
  absl::Status AllReduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                         Stream stream) override {
    Count("all_reduce", AllOf(), 2 * (size() - 1) * Bytes(count, dtype) / size());
    return inner()->AllReduce(send, recv, count, dtype, op, stream);
  }
  absl::Status Broadcast(void* buf, size_t count, DType dtype, int root, Stream stream) override {
    Count("broadcast", AllOf(), Bytes(count, dtype));
    return inner()->Broadcast(buf, count, dtype, root, stream);
  }
  absl::Status ReduceScatterInGroups(const void* send, void* recv, size_t count, DType dtype,
                                     ReduceOp op, int group_size, Stream stream) override {
    const int n = size(), g = group_size;
    // An invalid group size is the inner communicator's to refuse; nothing moves then.
    if (g >= 1 && n % g == 0) {
      const int r = rank(), groups = n / g;
      std::vector<int> group, position;
      for (int k = 0; k < g; ++k) group.push_back(r - r % g + k);
      for (int k = 0; k < groups; ++k) position.push_back(r % g + k * g);
      Count("reduce_scatter (in groups)", group, (g - 1) * Bytes(count, dtype));
      Count("all_reduce (across groups)", position,
            2 * (groups - 1) * Bytes(count, dtype) / groups);
    }
    return inner()->ReduceScatterInGroups(send, recv, count, dtype, op, group_size, stream);
  }

 protected:
  absl::StatusOr<std::unique_ptr<Communicator>> WrapSplit(
      int color, std::unique_ptr<Communicator> sub) override {
    if (sub->stream_ordered()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "CountLinkBytes: Split(color=", color, ") on rank ", rank(), " gave a stream-ordered ",
          sub->backend(), " communicator; counting needs one that reads host buffers"));
    }
    // The members' world ranks, in the new group's rank order.
    DirectHostExchange exchange(sub.get());
    ASSIGN_OR_RETURN(const std::vector<uint64_t> world,
                     AllGatherU64(exchange, {static_cast<uint64_t>(members_[rank()])}));
    std::vector<int> members(world.begin(), world.end());
    return std::unique_ptr<Communicator>(
        new LinkCountingCommunicator(std::move(sub), std::move(members), ranks_per_node_, log_));
  }

 private:
  static int64_t Bytes(size_t count, DType dtype) {
    return static_cast<int64_t>(count) * static_cast<int64_t>(DTypeSize(dtype));
  }
  std::vector<int> AllOf() const {
    std::vector<int> all;
    for (int k = 0; k < size(); ++k) all.push_back(k);
    return all;
  }
  // `group`: ranks of this communicator.
  void Count(absl::string_view op, const std::vector<int>& group, int64_t bytes) {
    if (group.size() < 2 || bytes == 0) return;
    const int node = members_[rank()] / ranks_per_node_;
    bool inter = false;
    std::vector<int> world;
    for (int k : group) {
      world.push_back(members_[k]);
      inter = inter || members_[k] / ranks_per_node_ != node;
    }
    log_->Add(absl::StrCat(op, " over ranks ", absl::StrJoin(world, ",")), bytes, inter);
  }

  const std::vector<int> members_;
  const int ranks_per_node_;
  LinkByteLog* const log_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CountLinkBytes(Communicator* world,
                                                             int ranks_per_node, LinkByteLog* log) {
  if (ranks_per_node < 1 || world->size() % ranks_per_node != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("CountLinkBytes: ranks_per_node ", ranks_per_node,
                     " must be >= 1 and divide the world size ", world->size()));
  }
  std::vector<int> members;
  for (int k = 0; k < world->size(); ++k) members.push_back(k);
  return std::unique_ptr<Communicator>(
      new LinkCountingCommunicator(world, std::move(members), ranks_per_node, log));
}

}  // namespace comm
}  // namespace zerort
