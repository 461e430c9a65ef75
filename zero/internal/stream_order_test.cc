#include "zero/internal/stream_order.h"

#include <vector>

#include <catch2/catch.hpp>

#include "device/testing/one_thread.h"

namespace zerort {
namespace zero_internal {
namespace {

// Asynchronous CPU streams whose every operation starts 2 ms late: a missing wait shows up as
// a wrong value.
std::unique_ptr<Device> SlowStreams() { return testing::AsyncOneThreadCpuDevice(2000); }

TEST_CASE("StreamOrder: compute's writes reach the comm stream and come back in order",
          "[zero]") {
  auto dev = SlowStreams();
  Device::Stream compute = dev->CreateStream().value();
  {
    auto order = StreamOrder::Create(dev.get(), compute, /*stream_ordered=*/true, 1, 1).value();
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
    auto order = StreamOrder::Create(dev.get(), compute, /*stream_ordered=*/false, 2, 2).value();
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

}  // namespace
}  // namespace zero_internal
}  // namespace zerort
