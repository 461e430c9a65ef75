#include "zero/internal/host_collectives.h"

#include <set>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "comm/agree.h"
#include "device/cpu_device.h"
#include "zero/internal/test_util.h"

namespace zerort {
namespace zero_internal {
namespace {

// An in-process communicator that reports itself stream-ordered (as NCCL does) and records
// the buffers it is given, so that the test sees whether host buffers were staged.
class StreamOrderedComm : public comm::Communicator {
 public:
  explicit StreamOrderedComm(comm::Communicator* inner) : inner_(inner) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  absl::string_view backend() const override { return "fake-nccl"; }
  bool stream_ordered() const override { return true; }
  absl::Status AllGather(const void* send, void* recv, size_t count, DType dtype,
                         comm::Stream s) override {
    seen.insert(recv);
    return inner_->AllGather(send, recv, count, dtype, s);
  }
  absl::Status ReduceScatter(const void*, void*, size_t, DType, comm::ReduceOp,
                             comm::Stream) override {
    return absl::UnimplementedError("unused");
  }
  absl::Status AllReduce(const void*, void*, size_t, DType, comm::ReduceOp,
                         comm::Stream) override {
    return absl::UnimplementedError("unused");
  }
  absl::Status Broadcast(void* buf, size_t count, DType dtype, int root, comm::Stream s) override {
    seen.insert(buf);
    return inner_->Broadcast(buf, count, dtype, root, s);
  }
  absl::Status Barrier() override { return inner_->Barrier(); }
  absl::Status Synchronize(comm::Stream s) override { return inner_->Synchronize(s); }
  std::set<const void*> seen;

 private:
  comm::Communicator* inner_;
};

float Value(int rank, int i) { return 0.5f * rank - 3.25f * i; }

absl::Status Exchange(int r, comm::Communicator* comm, bool staged, Device* dev) {
  StreamOrderedComm fake(comm);
  comm::Communicator* c = staged ? static_cast<comm::Communicator*>(&fake) : comm;
  HostCollectives host(c, dev, nullptr);
  const int world = comm->size(), n = 5;
  std::vector<float> mine(n), all(world * n);
  for (int i = 0; i < n; ++i) mine[i] = Value(r, i);
  RETURN_IF_ERROR(host.AllGatherHost(mine.data(), all.data(), n, DType::kF32));
  for (int q = 0; q < world; ++q) {
    for (int i = 0; i < n; ++i) {
      if (all[q * n + i] != Value(q, i)) return absl::InternalError("all-gather mismatch");
    }
  }
  std::vector<float> buf(n, r == 2 ? 1.0f : -1.0f);
  RETURN_IF_ERROR(host.BroadcastHost(buf.data(), n, DType::kF32, 2));
  for (float f : buf) {
    if (f != 1.0f) return absl::InternalError("broadcast mismatch");
  }
  // comm/agree.h over it: integers arrive exactly.
  ASSIGN_OR_RETURN(std::vector<uint64_t> ids,
                   comm::AllGatherU64(host, {~uint64_t{0} - static_cast<uint64_t>(r)}));
  for (int q = 0; q < world; ++q) {
    if (ids[q] != ~uint64_t{0} - static_cast<uint64_t>(q)) return absl::InternalError("ids");
  }
  if (staged && (fake.seen.count(all.data()) || fake.seen.count(buf.data()))) {
    return absl::InternalError("a stream-ordered communicator was given a host buffer");
  }
  return absl::OkStatus();
}

TEST_CASE("HostCollectives: host values arrive exactly, staged for stream-ordered comms",
          "[zero]") {
  auto dev = CreateCpuDevice();
  for (bool staged : {false, true}) {
    const auto statuses = OnRanks(3, [&](int r, comm::Communicator* comm) {
      return Exchange(r, comm, staged, dev.get());
    });
    for (const absl::Status& s : statuses) {
      INFO((staged ? "staged: " : "direct: ") << s);
      REQUIRE(s.ok());
    }
  }
}

}  // namespace
}  // namespace zero_internal
}  // namespace zerort
