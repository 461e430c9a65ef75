#include "zero/internal/stream_order.h"

#include <cstring>
#include <vector>

#include <catch2/catch.hpp>

#include "comm/communicator.h"
#include "device/testing/one_thread.h"

namespace zerort {
namespace zero_internal {
namespace {

// One rank whose collectives are host copies made when called (complete on return), or that
// only claims to be stream-ordered (never called then).
class OneRank final : public comm::Communicator {
 public:
  explicit OneRank(bool stream_ordered) : stream_ordered_(stream_ordered) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  absl::string_view backend() const override { return "one-rank test"; }
  bool stream_ordered() const override { return stream_ordered_; }
  absl::Status AllGather(const void* send, void* recv, size_t count, DType dtype,
                         comm::Stream) override {
    std::memmove(recv, send, count * DTypeSize(dtype));
    return absl::OkStatus();
  }
  absl::Status ReduceScatter(const void* send, void* recv, size_t count, DType dtype,
                             comm::ReduceOp, comm::Stream) override {
    return AllGather(send, recv, count, dtype, nullptr);
  }
  absl::Status AllReduce(const void* send, void* recv, size_t count, DType dtype,
                         comm::ReduceOp, comm::Stream) override {
    return AllGather(send, recv, count, dtype, nullptr);
  }
  absl::Status Broadcast(void*, size_t, DType, int, comm::Stream) override {
    return absl::OkStatus();
  }
  absl::Status Barrier() override { return absl::OkStatus(); }
  absl::Status Synchronize(comm::Stream) override { return absl::OkStatus(); }

 private:
  const bool stream_ordered_;
};

// Asynchronous CPU streams whose every operation starts 2 ms late: a missing wait shows up as
// a wrong value.
std::unique_ptr<Device> SlowStreams() { return testing::AsyncOneThreadCpuDevice(2000); }

TEST_CASE("StreamOrder: compute's writes reach the comm stream and come back in order",
          "[zero]") {
  auto dev = SlowStreams();
  Device::Stream compute = dev->CreateStream().value();
  {
    OneRank comm(/*stream_ordered=*/true);
    auto order = StreamOrder::Create(dev.get(), compute, &comm, 1, 1).value();
    REQUIRE(order->stream_ordered());
    REQUIRE(order->side() != compute);
    const float one = 1.0f;
    float a = 0, b = 0, c = 0;
    REQUIRE(dev->Copy(&a, &one, 4, compute).ok());   // the trainer writes
    REQUIRE(order->BeforeComm().ok());
    REQUIRE(dev->Copy(&b, &a, 4, order->side()).ok());  // a collective reads it
    REQUIRE(order->JoinComm().ok());
    REQUIRE(dev->Copy(&c, &b, 4, compute).ok());     // the trainer reads the result
    REQUIRE(dev->Synchronize(compute).ok());
    REQUIRE(c == one);

    // A bucket is rewritten by compute only after the comm stream has read it.
    float bucket = 5, read = 0;
    const float next = 7;
    REQUIRE(dev->Copy(&read, &bucket, 4, order->side()).ok());
    REQUIRE(order->BucketReduced(0).ok());
    REQUIRE(order->BeforeBucketReuse(0).ok());
    REQUIRE(dev->Copy(&bucket, &next, 4, compute).ok());
    REQUIRE(dev->Synchronize(compute).ok());
    REQUIRE(read == 5);

    // A slot is refilled by the comm stream only after compute released it, and read by
    // compute only after it was refilled.
    float slot = 1, used = 0, refill = 9, seen = 0;
    REQUIRE(dev->Copy(&used, &slot, 4, compute).ok());
    REQUIRE(order->SlotReleased(0).ok());
    REQUIRE(order->BeforeSlotGather(0).ok());
    REQUIRE(dev->Copy(&slot, &refill, 4, order->side()).ok());
    REQUIRE(order->SlotGathered(0).ok());
    REQUIRE(order->BeforeSlotUse(0).ok());
    REQUIRE(dev->Copy(&seen, &slot, 4, compute).ok());
    REQUIRE(dev->Synchronize(compute).ok());
    REQUIRE(used == 1);
    REQUIRE(seen == 9);
  }
  dev->DestroyStream(compute);
}

TEST_CASE("StreamOrder: with a communicator complete on return, the host waits for compute",
          "[zero]") {
  auto dev = SlowStreams();
  Device::Stream compute = dev->CreateStream().value();
  {
    OneRank comm(/*stream_ordered=*/false);
    auto order = StreamOrder::Create(dev.get(), compute, &comm, 2, 2).value();
    REQUIRE(!order->stream_ordered());
    REQUIRE(order->side() == compute);
    const float one = 1.0f;
    float a = 0;
    REQUIRE(dev->Copy(&a, &one, 4, compute).ok());
    REQUIRE(order->BeforeComm().ok());
    REQUIRE(a == one);  // a CPU collective reads it now, on the host
    REQUIRE(order->JoinComm().ok());
    REQUIRE(order->BucketReduced(1).ok());
    REQUIRE(order->BeforeSlotUse(1).ok());
  }
  dev->DestroyStream(compute);
}

TEST_CASE("StreamOrder: work enqueued after BeforeComm lands before a complete-on-return "
          "collective reads it",
          "[zero]") {
  // The two races of the first GPU run: a host shard uploaded, or gradients cast into the fp32
  // wire, on side() after BeforeComm, then handed to a collective that reads at once.
  auto dev = SlowStreams();
  Device::Stream compute = dev->CreateStream().value();
  {
    OneRank comm(/*stream_ordered=*/false);
    auto order = StreamOrder::Create(dev.get(), compute, &comm, 1, 1).value();
    const float host_shard[2] = {3.0f, 4.0f};
    float staged[2] = {0, 0}, gathered[2] = {0, 0};
    REQUIRE(order->BeforeComm().ok());
    REQUIRE(dev->Copy(staged, host_shard, sizeof staged, order->side()).ok());
    REQUIRE(order->AllGather(staged, gathered, 2, DType::kF32).ok());
    CHECK(gathered[0] == 3.0f);
    CHECK(gathered[1] == 4.0f);
    float wire[2] = {0, 0}, reduced[2] = {0, 0};
    REQUIRE(dev->Copy(wire, host_shard, sizeof wire, order->side()).ok());
    REQUIRE(order->ReduceScatter(wire, reduced, 2, DType::kF32, comm::ReduceOp::kAvg).ok());
    CHECK(reduced[1] == 4.0f);
    float all[2] = {0, 0};
    REQUIRE(dev->Copy(wire, staged, sizeof wire, order->side()).ok());
    REQUIRE(order->AllReduce(wire, all, 2, DType::kF32, comm::ReduceOp::kAvg).ok());
    CHECK(all[0] == 3.0f);
  }
  dev->DestroyStream(compute);
}

}  // namespace
}  // namespace zero_internal
}  // namespace zerort
