// ForwardingCommunicator on the in-process group: each collective through a wrapper that
// overrides nothing gives what the inner communicator gives (values written out by hand), a
// Split's communicators are unwrapped by default and wrapped where WrapSplit says so, and the
// one that owns its inner communicator destroys it.
#include "comm/forwarding.h"

#include <catch2/catch.hpp>
#include <memory>
#include <vector>

#include "base/status.h"
#include "comm/testing/on_ranks.h"

namespace zerort {
namespace comm {
namespace {

// Counts Barrier calls into `barriers`, on its Splits too.
class BarrierCounter final : public ForwardingCommunicator {
 public:
  BarrierCounter(Communicator* inner, int* barriers)
      : ForwardingCommunicator(inner), barriers_(barriers) {}
  BarrierCounter(std::unique_ptr<Communicator> owned, int* barriers)
      : ForwardingCommunicator(std::move(owned)), barriers_(barriers) {}
  absl::Status Barrier() override {
    ++*barriers_;
    return ForwardingCommunicator::Barrier();
  }

 protected:
  absl::StatusOr<std::unique_ptr<Communicator>> WrapSplit(
      int color, std::unique_ptr<Communicator> sub) override {
    return std::unique_ptr<Communicator>(new BarrierCounter(std::move(sub), barriers_));
  }

 private:
  int* const barriers_;
};

TEST_CASE("ForwardingCommunicator: every call reaches the inner communicator", "[comm]") {
  std::vector<absl::Status> st = testing::OnRanks(4, {}, [&](int r, Communicator* world) {
    ForwardingCommunicator c(world);
    if (c.rank() != r || c.size() != 4 || c.backend() != world->backend() ||
        c.device_memory() != world->device_memory() ||
        c.stream_ordered() != world->stream_ordered()) {
      return absl::InternalError("identity not forwarded");
    }
    std::vector<float> all(4);
    const float mine = 10.0f * r;
    RETURN_IF_ERROR(c.AllGather(&mine, all.data(), 1, DType::kF32));
    if (all != std::vector<float>{0, 10, 20, 30}) return absl::InternalError("all-gather");
    // Block k of rank r's send is r + k: block r reduces to 4r + 6.
    std::vector<float> send = {r + 0.0f, r + 1.0f, r + 2.0f, r + 3.0f};
    float got = -1;
    RETURN_IF_ERROR(c.ReduceScatter(send.data(), &got, 1, DType::kF32, ReduceOp::kSum));
    if (got != 4.0f * r + 6) return absl::InternalError("reduce-scatter");
    float sum = r + 1.0f;
    RETURN_IF_ERROR(c.AllReduce(&sum, &sum, 1, DType::kF32, ReduceOp::kSum));
    if (sum != 10) return absl::InternalError("all-reduce");
    float b = r == 2 ? 7.0f : 0.0f;
    RETURN_IF_ERROR(c.Broadcast(&b, 1, DType::kF32, 2));
    if (b != 7) return absl::InternalError("broadcast");
    // Groups {0,1} {2,3}: position p sums block p over all four ranks: 4p + 6.
    RETURN_IF_ERROR(c.ReduceScatterInGroups(send.data(), &got, 1, DType::kF32, ReduceOp::kSum, 2));
    if (got != 4.0f * (r % 2) + 6) return absl::InternalError("grouped reduce-scatter");
    RETURN_IF_ERROR(c.Barrier());
    RETURN_IF_ERROR(c.Synchronize(nullptr));
    // Unwrapped by default: the pair's communicator is the inner Split's own.
    ASSIGN_OR_RETURN(std::unique_ptr<Communicator> pair, c.Split(r / 2, r));
    if (pair == nullptr || pair->size() != 2 || pair->rank() != r % 2 ||
        dynamic_cast<ForwardingCommunicator*>(pair.get()) != nullptr) {
      return absl::InternalError("default Split");
    }
    // A negative color joins no group: null, not wrapped.
    ASSIGN_OR_RETURN(std::unique_ptr<Communicator> none, c.Split(r == 0 ? -1 : 0, r));
    if ((r == 0) != (none == nullptr)) return absl::InternalError("Split without a group");
    return absl::OkStatus();
  });
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r << ": " << st[r].ToString());
    CHECK(st[r].ok());
  }
}

TEST_CASE("ForwardingCommunicator: WrapSplit sees every new group", "[comm]") {
  std::vector<int> barriers(4, 0);
  std::vector<absl::Status> st = testing::OnRanks(4, {}, [&](int r, Communicator* world) {
    BarrierCounter c(world, &barriers[r]);
    RETURN_IF_ERROR(c.Barrier());
    ASSIGN_OR_RETURN(std::unique_ptr<Communicator> pair, c.Split(r % 2, r));
    RETURN_IF_ERROR(pair->Barrier());
    // A Split of a Split: wrapped again, and destroyed with its owner.
    ASSIGN_OR_RETURN(std::unique_ptr<Communicator> one, pair->Split(pair->rank(), 0));
    if (one->size() != 1) return absl::InternalError("size of the one-rank split");
    RETURN_IF_ERROR(one->Barrier());
    return absl::OkStatus();
  });
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r << ": " << st[r].ToString());
    CHECK(st[r].ok());
    CHECK(barriers[r] == 3);
  }
}

}  // namespace
}  // namespace comm
}  // namespace zerort
