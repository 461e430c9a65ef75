#include "comm/inprocess.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/status.h"
#include "comm/internal/common.h"
#include "comm/internal/reduce.h"

namespace zerort {
namespace comm {
namespace {

using internal::OpDesc;
using internal::OpKind;

// What one rank publishes for the operation in progress.
struct Slot {
  OpDesc desc;
  std::string error;           // local validation failure, reported to every rank
  const void* send = nullptr;  // Broadcast: the buffer
  void* recv = nullptr;
  const void* result = nullptr;  // AllReduce: where this rank's reduced slice lives
  int color = 0;                 // Split
  int key = 0;
};

// State shared by the N communicators of a group.
//
// Every rank counts its barrier arrivals; barrier k is passed when every rank has arrived at
// least k times. Each operation opens with Arrive (publishes the rank's Slot, waits with the
// operation's deadline, checks that all ranks called the same thing) and, when it moves data,
// ends with Wait (no deadline). Slots are read by peers without the lock between those two:
// a rank rewrites its slot only at its next Arrive, after the closing Wait, so the barriers
// order every access. Wait needs no deadline: every rank that passed Arrive of an operation is
// running local copies and will reach the operation's later barriers.
class Group {
 public:
  Group(int world, const CommOptions& options)
      : world_(world), options_(options), slots_(world), arrivals_(world, 0), gone_(world, false) {}

  int world() const { return world_; }
  const Slot& slot(int r) const { return slots_[r]; }

  absl::Status Arrive(int rank, int64_t k, Slot slot, absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    if (!poison_.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", rank, ": ", internal::DescribeOp(slot.desc),
                       ": the in-process group failed earlier: ", poison_.message()));
    }
    const OpDesc desc = slot.desc;
    slots_[rank] = std::move(slot);
    arrivals_[rank] = k;
    if (AllArrivedLocked(k)) verdict_ = CheckArgsLocked();
    auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return AllArrivedLocked(k) || !poison_.ok() || !GoneMissingLocked(k).empty();
    };
    mu_.AwaitWithDeadline(absl::Condition(&done), deadline);
    if (AllArrivedLocked(k)) {
      if (!verdict_.empty()) return absl::InvalidArgumentError(verdict_);
      return absl::OkStatus();
    }
    if (!poison_.ok()) {
      // Another rank detected the failure while this one waited in the same operation.
      return absl::Status(poison_.code(),
                          absl::StrCat("rank ", rank, ": ", internal::DescribeOp(desc),
                                       " aborted: ", poison_.message()));
    }
    std::vector<int> missing, gone = GoneMissingLocked(k);
    for (int r = 0; r < world_; ++r) {
      if (arrivals_[r] < k) missing.push_back(r);
    }
    if (!gone.empty()) {
      poison_ = absl::UnavailableError(absl::StrCat(
          internal::DescribeOp(desc), " on rank ", rank, " of ", world_, ": rank(s) [",
          absl::StrJoin(gone, ","), "] left the group (communicator destroyed) without calling it"));
    } else {
      poison_ = absl::DeadlineExceededError(absl::StrCat(
          internal::DescribeOp(desc), " on rank ", rank, " of ", world_, " timed out after ",
          options_.timeout_ms, " ms; missing ranks [", absl::StrJoin(missing, ","), "]"));
    }
    return poison_;
  }

  void Wait(int rank, int64_t k) {
    absl::MutexLock lock(&mu_);
    arrivals_[rank] = k;
    auto all = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return AllArrivedLocked(k); };
    mu_.Await(absl::Condition(&all));
  }

  void Leave(int rank) {
    absl::MutexLock lock(&mu_);
    gone_[rank] = true;
  }

  // The group of split `seq`'s members with `color` (`world` of them): made by the first member
  // to ask, handed to the others, and forgotten here once all `world` have it. Every member
  // asks exactly once, between the split's two barriers, so no entry outlives its split.
  std::shared_ptr<Group> SubGroup(int64_t seq, int color, int world) {
    absl::MutexLock lock(&mu_);
    SplitEntry& e = splits_[{seq, color}];
    if (e.group == nullptr) e.group = std::make_shared<Group>(world, options_);
    std::shared_ptr<Group> out = e.group;
    if (++e.taken == world) splits_.erase({seq, color});
    return out;
  }

 private:
  bool AllArrivedLocked(int64_t k) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (int64_t a : arrivals_) {
      if (a < k) return false;
    }
    return true;
  }

  std::vector<int> GoneMissingLocked(int64_t k) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<int> out;
    for (int r = 0; r < world_; ++r) {
      if (gone_[r] && arrivals_[r] < k) out.push_back(r);
    }
    return out;
  }

  // Run by the last rank to arrive, so every rank sees the same verdict.
  std::string CheckArgsLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (int r = 0; r < world_; ++r) {
      if (!slots_[r].error.empty()) return slots_[r].error;
    }
    for (int r = 1; r < world_; ++r) {
      std::string diff =
          internal::CompareOps(slots_[0].desc, 0, slots_[r].desc, r, options_.check_args);
      if (!diff.empty()) return diff;
    }
    return "";
  }

  const int world_;
  const CommOptions options_;
  // Written by its rank under mu_ at Arrive; read by peers without mu_ until the closing barrier.
  std::vector<Slot> slots_;

  absl::Mutex mu_;
  std::vector<int64_t> arrivals_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> gone_ ABSL_GUARDED_BY(mu_);
  absl::Status poison_ ABSL_GUARDED_BY(mu_);
  // Argument check of the barrier all ranks passed last; read right after that barrier.
  std::string verdict_ ABSL_GUARDED_BY(mu_);
  // Sub-groups of splits in progress, by (split sequence number, color).
  struct SplitEntry {
    std::shared_ptr<Group> group;
    int taken = 0;  // members that have it
  };
  std::map<std::pair<int64_t, int>, SplitEntry> splits_ ABSL_GUARDED_BY(mu_);
};

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<Group> group, int rank, const CommOptions& options,
                        InProcessBufferOps ops)
      : group_(std::move(group)),
        rank_(rank),
        options_(options),
        history_(options.history),
        ops_(std::move(ops)) {
    srcs_.reserve(group_->world());
  }
  ~InProcessCommunicator() override { group_->Leave(rank_); }

  int rank() const override { return rank_; }
  int size() const override { return group_->world(); }
  absl::string_view backend() const override { return "inprocess"; }
  bool device_memory() const override { return ops_.device_memory; }

  absl::Status AllGather(const void* send, void* recv, size_t count, DType dtype,
                         Stream) override {
    Slot slot;
    slot.send = send;
    slot.recv = recv;
    RETURN_IF_ERROR(Start(OpKind::kAllGather, count, dtype, ReduceOp::kSum, 0, slot));
    const size_t block = count * DTypeSize(dtype);
    const int n = size();
    for (int i = 0; i < n && block > 0; ++i) {
      const int q = (rank_ + i) % n;  // start at different peers to spread the reads
      char* dst = static_cast<char*>(recv) + static_cast<size_t>(q) * block;
      const void* src = q == rank_ ? send : group_->slot(q).send;
      if (src != dst) Copy(dst, src, block);
    }
    return Finish();
  }

  absl::Status ReduceScatter(const void* send, void* recv, size_t count, DType dtype,
                             ReduceOp op, Stream) override {
    Slot slot;
    slot.send = send;
    slot.recv = recv;
    RETURN_IF_ERROR(Start(OpKind::kReduceScatter, count, dtype, op, 0, slot));
    if (count > 0) {
      const size_t offset = static_cast<size_t>(rank_) * count * DTypeSize(dtype);
      srcs_.clear();
      for (int q = 0; q < size(); ++q) {
        srcs_.push_back(static_cast<const char*>(group_->slot(q).send) + offset);
      }
      Reduce(srcs_.data(), size(), recv, count, dtype, op);
    }
    return Finish();
  }

  absl::Status AllReduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                         Stream) override {
    // Rank r reduces slice r of the array, then every rank copies every slice. Reduction is
    // elementwise, so slicing does not change any bit of the result. The result goes straight
    // into recv, in place too: slice r of rank r's send is read only by rank r itself (peers read
    // their own slices of it), and the kernel allows dst to alias a source at the same offsets.
    const size_t es = DTypeSize(dtype);
    const int n = size();
    const size_t begin = SliceBegin(count, rank_), end = SliceBegin(count, rank_ + 1);
    Slot slot;
    slot.send = send;
    slot.recv = recv;
    slot.result = static_cast<char*>(recv) + begin * es;
    void* my_result = const_cast<void*>(slot.result);
    RETURN_IF_ERROR(Start(OpKind::kAllReduce, count, dtype, op, 0, slot));
    if (end > begin) {
      srcs_.clear();
      for (int q = 0; q < n; ++q) {
        srcs_.push_back(static_cast<const char*>(group_->slot(q).send) + begin * es);
      }
      Reduce(srcs_.data(), n, my_result, end - begin, dtype, op);
    }
    // Every slice is reduced and nobody reads a send buffer any more.
    group_->Wait(rank_, ++arrivals_);
    for (int i = 0; i < n; ++i) {
      const int q = (rank_ + i) % n;
      const size_t b = SliceBegin(count, q), e = SliceBegin(count, q + 1);
      if (e == b || q == rank_) continue;
      Copy(static_cast<char*>(recv) + b * es, group_->slot(q).result, (e - b) * es);
    }
    return Finish();
  }

  absl::Status ReduceScatterInGroups(const void* send, void* recv, size_t count, DType dtype,
                                     ReduceOp op, int group_size, Stream) override {
    // Like AllReduce over the replicas of one position: the R = size / group_size ranks that
    // receive block b = rank % group_size split it into R slices; replica j reduces slice j
    // of block b from every rank's send, in rank order 0..size-1 (the contract's order), into
    // its own recv, then copies its replicas' slices. Each element is read and reduced once.
    // In place, recv is block b of this rank's send: its slice j is read only by this rank
    // (replica j of b), and the other slices are overwritten only after the Wait below, when
    // every replica has finished reading them.
    const size_t es = DTypeSize(dtype);
    const int n = size();
    const int g = group_size >= 1 && n % group_size == 0 ? group_size : n;  // bad: Start fails
    const int replicas = n / g, pos = rank_ % g, j = rank_ / g;
    const size_t begin = internal::SliceBegin(count, replicas, j);
    const size_t end = internal::SliceBegin(count, replicas, j + 1);
    Slot slot;
    slot.send = send;
    slot.recv = recv;
    slot.result = static_cast<char*>(recv) + begin * es;
    RETURN_IF_ERROR(Start(OpKind::kReduceScatterInGroups, count, dtype, op, group_size, slot));
    if (end > begin) {
      const size_t offset = (static_cast<size_t>(pos) * count + begin) * es;
      srcs_.clear();
      for (int q = 0; q < n; ++q) {
        srcs_.push_back(static_cast<const char*>(group_->slot(q).send) + offset);
      }
      Reduce(srcs_.data(), n, static_cast<char*>(recv) + begin * es, end - begin, dtype, op);
    }
    // Every slice is reduced and nobody reads a send buffer any more.
    group_->Wait(rank_, ++arrivals_);
    for (int i = 1; i < replicas; ++i) {
      const int k = (j + i) % replicas;  // replica k of this position: rank k * g + pos
      const size_t b = internal::SliceBegin(count, replicas, k);
      const size_t e = internal::SliceBegin(count, replicas, k + 1);
      if (e > b) {
        Copy(static_cast<char*>(recv) + b * es, group_->slot(k * g + pos).result, (e - b) * es);
      }
    }
    return Finish();
  }

  absl::Status Broadcast(void* buf, size_t count, DType dtype, int root, Stream) override {
    Slot slot;
    slot.send = buf;
    if (root < 0 || root >= size()) {
      // Reported through the slot so that every rank fails, not just this one.
      slot.error = absl::StrCat("rank ", rank_, ": broadcast root ", root,
                                " is outside the group of ", size());
    }
    RETURN_IF_ERROR(Start(OpKind::kBroadcast, count, dtype, ReduceOp::kSum, root, slot));
    if (rank_ != root && count > 0) {
      Copy(buf, group_->slot(root).send, count * DTypeSize(dtype));
    }
    return Finish();
  }

  absl::Status Barrier() override {
    RETURN_IF_ERROR(Start(OpKind::kBarrier, 0, DType::kF32, ReduceOp::kSum, 0, Slot()));
    history_.End();
    return absl::OkStatus();
  }

  absl::Status Synchronize(Stream) override { return absl::OkStatus(); }

  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override {
    Slot slot;
    slot.color = color;
    slot.key = key;
    RETURN_IF_ERROR(Start(OpKind::kSplit, 0, DType::kF32, ReduceOp::kSum, 0, std::move(slot)));
    // Every rank's color and key stay readable until Finish's barrier.
    std::unique_ptr<Communicator> sub;
    if (color >= 0) {
      std::vector<int> members;  // ranks here of this color, in their new rank order
      for (int q = 0; q < size(); ++q) {
        if (group_->slot(q).color == color) members.push_back(q);
      }
      // Stable: equal keys keep the order of the ranks here.
      std::stable_sort(members.begin(), members.end(), [&](int a, int b) {
        return group_->slot(a).key < group_->slot(b).key;
      });
      const int new_rank = static_cast<int>(
          std::find(members.begin(), members.end(), rank_) - members.begin());
      const int world = static_cast<int>(members.size());
      sub = std::make_unique<InProcessCommunicator>(group_->SubGroup(seq_, color, world),
                                                    new_rank, options_, ops_);
    }
    RETURN_IF_ERROR(Finish());
    return sub;
  }

 private:
  // Balanced split of [0, count) into size() slices.
  size_t SliceBegin(size_t count, int r) const { return internal::SliceBegin(count, size(), r); }

  absl::Status Start(OpKind kind, size_t count, DType dtype, ReduceOp op, int root, Slot slot) {
    OpDesc& d = slot.desc;
    d = internal::MakeOpDesc(++seq_, kind, count, dtype, op, root);
    absl::Status valid = internal::ValidateBuffers(d, slot.send, slot.recv, rank_, size());
    if (!valid.ok() && slot.error.empty()) slot.error = std::string(valid.message());
    history_.Begin(d, count * DTypeSize(dtype));
    const absl::Time deadline = absl::Now() + absl::Milliseconds(options_.timeout_ms);
    absl::Status s = group_->Arrive(rank_, ++arrivals_, std::move(slot), deadline);
    if (!s.ok()) {
      if (s.code() == absl::StatusCode::kDeadlineExceeded ||
          s.code() == absl::StatusCode::kUnavailable) {
        s = absl::Status(s.code(), absl::StrCat(s.message(), "\nrank ", rank_, " ",
                                                history_.Format()));
      }
      history_.End();
    }
    return s;
  }

  absl::Status Finish() {
    group_->Wait(rank_, ++arrivals_);
    history_.End();
    absl::Status failed = std::move(data_error_);
    data_error_ = absl::OkStatus();
    return failed;
  }

  const std::shared_ptr<Group> group_;
  const int rank_;
  const CommOptions options_;
  internal::OpHistory history_;
  // Data movement through ops_ when set. A failure is kept and returned by Finish(), after the
  // closing barrier, so that peers are never left waiting.
  void Copy(void* dst, const void* src, size_t bytes) {
    if (!ops_.copy) {
      std::memcpy(dst, src, bytes);
    } else if (absl::Status s = ops_.copy(dst, src, bytes); !s.ok() && data_error_.ok()) {
      data_error_ = s;
    }
  }
  void Reduce(const void* const* srcs, int n, void* dst, size_t count, DType dtype, ReduceOp op) {
    if (!ops_.reduce) {
      internal::ReduceBlocks(srcs, n, dst, count, dtype, op);
    } else if (absl::Status s = ops_.reduce(srcs, n, dst, count, dtype, op);
               !s.ok() && data_error_.ok()) {
      data_error_ = s;
    }
  }

  const InProcessBufferOps ops_;
  absl::Status data_error_;
  int64_t seq_ = 0;       // operations started
  int64_t arrivals_ = 0;  // barriers entered
  std::vector<const void*> srcs_;
};

}  // namespace

absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateInProcessGroup(
    int world_size, CommOptions options, InProcessBufferOps ops) {
  if (world_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("in-process group world_size must be >= 1, got ", world_size));
  }
  if (options.timeout_ms <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("comm_timeout_ms must be > 0, got ", options.timeout_ms));
  }
  if (static_cast<bool>(ops.copy) != static_cast<bool>(ops.reduce)) {
    return absl::InvalidArgumentError(
        "in-process buffer ops: set both copy and reduce, or neither");
  }
  auto group = std::make_shared<Group>(world_size, options);
  std::vector<std::unique_ptr<Communicator>> comms;
  comms.reserve(world_size);
  for (int r = 0; r < world_size; ++r) {
    comms.push_back(std::make_unique<InProcessCommunicator>(group, r, options, ops));
  }
  return comms;
}

}  // namespace comm
}  // namespace zerort
