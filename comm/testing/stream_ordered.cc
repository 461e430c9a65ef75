#include "comm/testing/stream_ordered.h"

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "comm/inprocess.h"
#include "comm/internal/common.h"
#include "memory/arena.h"

namespace zerort {
namespace comm {
namespace testing {
namespace {

using internal::OpDesc;
using internal::OpKind;

// The events every rank's stream waits on, one of each kind per rank, shared by the group and
// destroyed with its last communicator. Reusing one event per rank and kind is exact: a peer's
// wait on rank r's event of some kind is enqueued before that peer joins the host meeting that
// rank r must pass before recording that event again (see Begin, Meet).
struct Group {
  Device* device = nullptr;
  std::vector<Device::Event> ready;  // rank r's stream reached its collective: inputs written
  std::vector<Device::Event> mid;    // rank r's stream has read its peers' buffers (all-reduce)
  std::vector<Device::Event> done;   // rank r's stream finished its part of the collective
  ~Group() {
    for (auto* v : {&ready, &mid, &done}) {
      for (Device::Event e : *v) device->DestroyEvent(e);
    }
  }
};

// A group's events for `world` ranks of `device`.
absl::StatusOr<std::shared_ptr<Group>> MakeGroup(Device* device, int world) {
  auto group = std::make_shared<Group>();
  group->device = device;
  for (auto* v : {&group->ready, &group->mid, &group->done}) {
    for (int r = 0; r < world; ++r) {
      ASSIGN_OR_RETURN(Device::Event e, device->CreateEvent());
      v->push_back(e);
    }
  }
  return group;
}

// What each rank publishes at a call, as 64-bit words.
enum Word { kSeq, kKind, kDType, kOp, kRoot, kCount, kSend, kRecv, kValid, kWords };
constexpr int kBitsWords = 4;  // 16-bit words per 64-bit word

class StreamOrderedComm final : public Communicator {
 public:
  StreamOrderedComm(std::unique_ptr<Communicator> host, std::shared_ptr<Group> group)
      : host_(std::move(host)), group_(std::move(group)), dev_(group_->device) {}

  int rank() const override { return host_->rank(); }
  int size() const override { return host_->size(); }
  absl::string_view backend() const override { return "stream-ordered-test"; }
  bool device_memory() const override { return dev_->device_memory(); }
  bool stream_ordered() const override { return true; }

  absl::Status AllGather(const void* send, void* recv, size_t count, DType dtype,
                         Stream stream) override {
    const size_t block = count * DTypeSize(dtype);
    ASSIGN_OR_RETURN(std::vector<Peer> peers,
                     Begin(OpKind::kAllGather, send, recv, count, dtype, ReduceOp::kSum, 0,
                           stream));
    char* out = static_cast<char*>(recv);
    for (int q = 0; q < size(); ++q) {
      // In place, this rank's block is already where it belongs.
      if (peers[q].send == out + q * block) continue;
      RETURN_IF_ERROR(dev_->Copy(out + q * block, peers[q].send, block, stream));
    }
    return End(stream);
  }

  absl::Status ReduceScatter(const void* send, void* recv, size_t count, DType dtype,
                             ReduceOp op, Stream stream) override {
    const size_t block = count * DTypeSize(dtype);
    ASSIGN_OR_RETURN(std::vector<Peer> peers,
                     Begin(OpKind::kReduceScatter, send, recv, count, dtype, op, 0, stream));
    // Rank q reads block q of every rank's send, so block r of this rank's send (recv, in
    // place) is read by this rank alone, before the sum is stored: no peer races the write.
    std::vector<const char*> srcs;
    for (const Peer& p : peers) srcs.push_back(p.send + rank() * block);
    RETURN_IF_ERROR(Reduce(srcs, count, dtype, op, stream));
    RETURN_IF_ERROR(Store(recv, count, dtype, stream));
    return End(stream);
  }

  absl::Status ReduceScatterInGroups(const void* send, void* recv, size_t count, DType dtype,
                                     ReduceOp op, int group_size, Stream stream) override {
    const size_t block = count * DTypeSize(dtype);
    ASSIGN_OR_RETURN(std::vector<Peer> peers,
                     Begin(OpKind::kReduceScatterInGroups, send, recv, count, dtype, op,
                           group_size, stream));
    // Every rank of this position reduces block (rank % group_size) of every rank's send in
    // rank order, as the contract says. In place, recv is that block of this rank's send,
    // which the other replicas of the position read too: write only once they all have.
    const size_t pos = static_cast<size_t>(rank() % group_size);
    std::vector<const char*> srcs;
    for (const Peer& p : peers) srcs.push_back(p.send + pos * block);
    RETURN_IF_ERROR(Reduce(srcs, count, dtype, op, stream));
    RETURN_IF_ERROR(Meet(group_->mid, stream));
    RETURN_IF_ERROR(Store(recv, count, dtype, stream));
    return End(stream);
  }

  absl::Status AllReduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                         Stream stream) override {
    ASSIGN_OR_RETURN(std::vector<Peer> peers,
                     Begin(OpKind::kAllReduce, send, recv, count, dtype, op, 0, stream));
    std::vector<const char*> srcs;
    for (const Peer& p : peers) srcs.push_back(p.send);
    RETURN_IF_ERROR(Reduce(srcs, count, dtype, op, stream));
    // Peers read all of this rank's send, which recv may be: write only once they all have.
    RETURN_IF_ERROR(Meet(group_->mid, stream));
    RETURN_IF_ERROR(Store(recv, count, dtype, stream));
    return End(stream);
  }

  absl::Status Broadcast(void* buf, size_t count, DType dtype, int root,
                         Stream stream) override {
    ASSIGN_OR_RETURN(std::vector<Peer> peers,
                     Begin(OpKind::kBroadcast, buf, buf, count, dtype, ReduceOp::kSum, root,
                           stream));
    if (rank() != root) {
      RETURN_IF_ERROR(dev_->Copy(buf, peers[root].send, count * DTypeSize(dtype), stream));
    }
    return End(stream);
  }

  absl::Status Barrier() override { return host_->Barrier(); }

  absl::Status Synchronize(Stream stream) override { return dev_->Synchronize(stream); }

  // A host-side collective, like ncclCommSplit: it waits for no stream. The inner group splits;
  // the new group's rank 0 makes its events and hands them to the members as a pointer to a
  // shared_ptr, broadcast as bits (the group lives in this one process).
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override {
    ASSIGN_OR_RETURN(std::unique_ptr<Communicator> host, host_->Split(color, key));
    if (host == nullptr) return std::unique_ptr<Communicator>();
    std::unique_ptr<std::shared_ptr<Group>> made;
    absl::Status failed;
    if (host->rank() == 0) {
      absl::StatusOr<std::shared_ptr<Group>> g = MakeGroup(dev_, host->size());
      if (g.ok()) made = std::make_unique<std::shared_ptr<Group>>(*std::move(g));
      failed = g.status();
    }
    uint64_t addr = reinterpret_cast<uintptr_t>(made.get());  // 0: rank 0 failed
    RETURN_IF_ERROR(host->Broadcast(&addr, kBitsWords, DType::kBF16, 0));
    if (addr == 0) {
      return host->rank() == 0 ? failed
                               : absl::InternalError(absl::StrCat(
                                     "stream-ordered test group, rank ", rank(),
                                     ": the new group's rank 0 could not create its events"));
    }
    std::shared_ptr<Group> group = *reinterpret_cast<std::shared_ptr<Group>*>(addr);
    // Rank 0 frees its holder only once every member has copied it; after a failed barrier a
    // member may still read it, so it is kept.
    if (absl::Status s = host->Barrier(); !s.ok()) {
      made.release();
      return s;
    }
    return std::unique_ptr<Communicator>(
        new StreamOrderedComm(std::move(host), std::move(group)));
  }

 private:
  struct Peer {
    const char* send;
    char* recv;
  };

  // Host side of a call: orders it after this communicator's previous operation, records
  // `ready`, exchanges every rank's arguments and buffers (every rank fails alike on a
  // mismatch or an invalid buffer), then makes the stream wait for every peer's `ready`.
  absl::StatusOr<std::vector<Peer>> Begin(OpKind kind, const void* send, const void* recv,
                                          size_t count, DType dtype, ReduceOp op, int root,
                                          Stream stream) {
    const OpDesc d = internal::MakeOpDesc(++seq_, kind, count, dtype, op, root);
    const int me = rank(), world = size();
    const absl::Status valid = internal::ValidateBuffers(d, send, recv, me, world);
    // The scratch of the previous operation (maybe on another stream) is free once it is done.
    RETURN_IF_ERROR(dev_->Wait(stream, group_->done[me]));
    RETURN_IF_ERROR(dev_->Record(group_->ready[me], stream));
    uint64_t mine[kWords] = {};
    mine[kSeq] = static_cast<uint64_t>(d.seq);
    mine[kKind] = static_cast<uint64_t>(d.kind);
    mine[kDType] = static_cast<uint64_t>(d.dtype);
    mine[kOp] = static_cast<uint64_t>(d.reduce_op);
    mine[kRoot] = static_cast<uint64_t>(d.root);
    mine[kCount] = d.count;
    mine[kSend] = reinterpret_cast<uintptr_t>(send);
    mine[kRecv] = reinterpret_cast<uintptr_t>(recv);
    mine[kValid] = valid.ok() ? 1 : 0;
    std::vector<uint64_t> all(static_cast<size_t>(world) * kWords);
    // 64-bit words as four 16-bit elements: AllGather copies bits unchanged (communicator.h).
    RETURN_IF_ERROR(host_->AllGather(mine, all.data(), kWords * kBitsWords, DType::kBF16));
    std::vector<Peer> peers(world);
    for (int q = 0; q < world; ++q) {
      const uint64_t* w = &all[static_cast<size_t>(q) * kWords];
      OpDesc dq;
      dq.seq = static_cast<int64_t>(w[kSeq]);
      dq.kind = static_cast<OpKind>(w[kKind]);
      dq.dtype = static_cast<int32_t>(w[kDType]);
      dq.reduce_op = static_cast<int32_t>(w[kOp]);
      dq.root = static_cast<int32_t>(w[kRoot]);
      dq.count = w[kCount];
      const std::string diff = internal::CompareOps(d, me, dq, q, /*full=*/true);
      if (!diff.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "stream-ordered test group, rank ", me, ": ", diff));
      }
      if (w[kValid] == 0) {
        return q == me ? valid
                       : absl::InvalidArgumentError(absl::StrCat(
                             "stream-ordered test group, rank ", me, ": ",
                             internal::DescribeOp(d), " has invalid buffers on rank ", q));
      }
      peers[q] = {reinterpret_cast<const char*>(static_cast<uintptr_t>(w[kSend])),
                  reinterpret_cast<char*>(static_cast<uintptr_t>(w[kRecv]))};
    }
    if ((op == ReduceOp::kAvg && (world & (world - 1)) != 0) &&
        internal::IsReduction(kind)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stream-ordered test group, rank ", me, ": ", internal::DescribeOp(d), " on ", world,
          " ranks: kAvg is exact here only on a power-of-two world size (the CPU Device has no "
          "division kernel)"));
    }
    if (op == ReduceOp::kMax &&
        internal::IsReduction(kind)) {
      return absl::UnimplementedError(absl::StrCat(
          "stream-ordered test group, rank ", me, ": ", internal::DescribeOp(d),
          ": the CPU Device has no max kernel to run it in stream order"));
    }
    for (int q = 0; q < world; ++q) {
      if (q != me) RETURN_IF_ERROR(dev_->Wait(stream, group_->ready[q]));
    }
    return peers;
  }

  // Records this rank's `events` entry, meets every rank on the host (so that every peer's
  // entry is recorded), then makes the stream wait for every peer's.
  absl::Status Meet(const std::vector<Device::Event>& events, Stream stream) {
    RETURN_IF_ERROR(dev_->Record(events[rank()], stream));
    RETURN_IF_ERROR(host_->Barrier());
    for (int q = 0; q < size(); ++q) {
      if (q != rank()) RETURN_IF_ERROR(dev_->Wait(stream, events[q]));
    }
    return absl::OkStatus();
  }

  // No rank's stream goes on (to write a buffer a peer reads) before every peer is done.
  absl::Status End(Stream stream) { return Meet(group_->done, stream); }

  // Grows the scratch to `count` floats per array, after this rank's previous operation has
  // finished with it.
  absl::Status Reserve(size_t count) {
    if (count <= cap_) return absl::OkStatus();
    RETURN_IF_ERROR(dev_->WaitHost(group_->done[rank()]));
    cap_ = 0;
    // The device's own memory (host memory on the CPU device, GPU memory on a GPU), where the
    // kernels below may read and write it.
    memory::RawAllocator* const alloc = dev_->allocator(memory::MemoryKind::kDevice);
    for (auto* a : {&acc_, &tmp_, &v_, &master_, &neg_zero_}) {
      ASSIGN_OR_RETURN(*a, memory::Allocation::Create(alloc, count * sizeof(float)));
      RETURN_IF_ERROR(dev_->Zero(a->get(), count * sizeof(float), nullptr));
    }
    const std::vector<float> neg_zero(count, -0.0f);
    RETURN_IF_ERROR(dev_->Copy(neg_zero_.get(), neg_zero.data(), count * sizeof(float), nullptr));
    RETURN_IF_ERROR(dev_->Synchronize(nullptr));  // `neg_zero` goes out of scope
    cap_ = count;
    return absl::OkStatus();
  }

  // acc_ = the rank-order fp32 reduction of srcs (count elements of dtype each), enqueued.
  absl::Status Reduce(const std::vector<const char*>& srcs, size_t count, DType dtype,
                      ReduceOp op, Stream stream) {
    RETURN_IF_ERROR(Reserve(count));
    float* acc = acc_.as<float>();
    float* tmp = tmp_.as<float>();
    for (size_t q = 0; q < srcs.size(); ++q) {
      if (dtype == DType::kF32) {
        if (q == 0) {
          RETURN_IF_ERROR(dev_->Copy(acc, srcs[q], count * sizeof(float), stream));
        } else {
          RETURN_IF_ERROR(dev_->Accumulate(acc, srcs[q], DType::kF32, count, stream));
        }
      } else if (q == 0) {
        RETURN_IF_ERROR(dev_->Cast(srcs[q], dtype, acc, DType::kF32, count, stream));
      } else {
        RETURN_IF_ERROR(dev_->Cast(srcs[q], dtype, tmp, DType::kF32, count, stream));
        RETURN_IF_ERROR(dev_->Accumulate(acc, tmp, DType::kF32, count, stream));
      }
    }
    if (op != ReduceOp::kAvg || srcs.size() == 1) return absl::OkStatus();
    // acc *= 1/N through AdamW (the only kernel that scales): g = acc * (1/N), and with
    // beta1 = 0, one_minus_beta1 = 1 and m = -0: m = fma(0, -0, 1 * g) = g, bit for bit
    // (-0 keeps a zero sum's sign). master and v are scratch. 1/N is exact for N a power of
    // two (Begin refuses others), so g is the correctly rounded acc / N of the contract.
    RETURN_IF_ERROR(dev_->Copy(tmp, neg_zero_.as<float>(), count * sizeof(float), stream));
    offload::AdamWArrays arrays;
    arrays.master = master_.as<float>();
    arrays.m = tmp;
    arrays.v = v_.as<float>();
    arrays.grad = acc;
    arrays.grad_dtype = DType::kF32;
    arrays.param_out = nullptr;
    arrays.n = count;
    offload::AdamWStepParams p;
    p.beta1 = 0;
    p.one_minus_beta1 = 1;
    p.beta2 = 0;
    p.one_minus_beta2 = 0;
    p.eps = 1;
    p.step_size = 0;
    p.inv_sqrt_bias2 = 0;
    p.decay = 1;
    const float inv_n = 1.0f / static_cast<float>(srcs.size());
    RETURN_IF_ERROR(dev_->AdamW(arrays, p, inv_n, stream));
    return dev_->Copy(acc, tmp, count * sizeof(float), stream);
  }

  // dst = acc_ rounded once to dtype, enqueued.
  absl::Status Store(void* dst, size_t count, DType dtype, Stream stream) {
    if (dtype == DType::kF32) return dev_->Copy(dst, acc_.as<float>(), count * sizeof(float), stream);
    return dev_->Cast(acc_.as<float>(), DType::kF32, dst, dtype, count, stream);
  }

  const std::unique_ptr<Communicator> host_;  // the inner group: host rendezvous only
  const std::shared_ptr<Group> group_;
  Device* const dev_;
  int64_t seq_ = 0;
  // (cap_) fp32 each, the device's memory, touched only by this rank's stream work: the
  // accumulator, a converted source, AdamW's scratch, a -0 fill.
  size_t cap_ = 0;
  memory::Allocation acc_, tmp_, v_, master_, neg_zero_;
};

}  // namespace

absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateStreamOrderedGroup(
    int world_size, Device* device, CommOptions options) {
  if (device == nullptr) {
    return absl::InvalidArgumentError("CreateStreamOrderedGroup: device is null");
  }
  ASSIGN_OR_RETURN(std::vector<std::unique_ptr<Communicator>> hosts,
                   CreateInProcessGroup(world_size, options));
  ASSIGN_OR_RETURN(std::shared_ptr<Group> group, MakeGroup(device, world_size));
  std::vector<std::unique_ptr<Communicator>> out;
  for (auto& h : hosts) out.push_back(std::make_unique<StreamOrderedComm>(std::move(h), group));
  return out;
}

}  // namespace testing
}  // namespace comm
}  // namespace zerort
