#include "device/cpu_device.h"
#include "device/testing/one_thread.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <vector>

#include <catch2/catch.hpp>

namespace zerort {
namespace {

TEST_CASE("CpuDevice streams: work runs in order and events order streams and the host",
          "[zero][streams]") {
  // A large delay per operation: without the event, the host would read before the copy lands.
  auto dev = testing::AsyncOneThreadCpuDevice(2000);
  Device::Stream a = dev->CreateStream().value();
  Device::Stream b = dev->CreateStream().value();
  Device::Event e = dev->CreateEvent().value();
  std::vector<float> src(1000), mid(1000, 0.0f), dst(1000, 0.0f);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<float>(i) + 0.5f;

  REQUIRE(dev->Copy(mid.data(), src.data(), 4000, a).ok());
  REQUIRE(dev->Record(e, a).ok());
  // b waits for a's copy before copying on: an unordered b would copy zeros.
  REQUIRE(dev->Wait(b, e).ok());
  REQUIRE(dev->Copy(dst.data(), mid.data(), 4000, b).ok());
  CHECK(dst[999] == 0.0f);  // only enqueued
  REQUIRE(dev->Record(e, b).ok());
  REQUIRE(dev->WaitHost(e).ok());
  CHECK(std::memcmp(dst.data(), src.data(), 4000) == 0);

  // In-order: a norm enqueued after a zero-fill sees zeros.
  float norm = -1;
  REQUIRE(dev->Zero(mid.data(), 4000, a).ok());
  REQUIRE(dev->SquaredNorm(mid.data(), DType::kF32, 1000, &norm, a).ok());
  REQUIRE(dev->Synchronize(a).ok());
  CHECK(norm == 0.0f);

  dev->DestroyEvent(e);
  dev->DestroyStream(a);
  dev->DestroyStream(b);
}

// As cudaEventDestroy allows: an event may be destroyed while a Record of it or a Wait on it is
// still queued on a stream; the queued work still runs, and touches no freed memory. (The
// engine's destructor used to free its events under a Record still queued on the trainer's
// stream: "Mutex corrupt" under load in //zero:engine_stream_ordered_test.)
TEST_CASE("CpuDevice streams: an event destroyed while queued work still records or waits on "
          "it", "[zero][streams]") {
  // Each queued operation starts 20 ms late, so the records and waits below are still queued
  // when their events are destroyed.
  auto dev = testing::AsyncOneThreadCpuDevice(20000);
  Device::Stream a = dev->CreateStream().value();
  Device::Stream b = dev->CreateStream().value();
  std::vector<float> src(256, 3.0f), mid(256, 0.0f), dst(256, 0.0f);
  for (int round = 0; round < 8; ++round) {
    Device::Event e = dev->CreateEvent().value();
    REQUIRE(dev->Copy(mid.data(), src.data(), 1024, a).ok());
    REQUIRE(dev->Record(e, a).ok());
    REQUIRE(dev->Wait(b, e).ok());
    REQUIRE(dev->Copy(dst.data(), mid.data(), 1024, b).ok());
    dev->DestroyEvent(e);  // a's record and b's wait are still queued
    REQUIRE(dev->Synchronize(b).ok());
    REQUIRE(dev->Synchronize(a).ok());
    CHECK(dst[255] == 3.0f);  // b still waited for a's copy
    std::fill(mid.begin(), mid.end(), 0.0f);
    std::fill(dst.begin(), dst.end(), 0.0f);
  }
  dev->DestroyStream(a);
  dev->DestroyStream(b);
}

TEST_CASE("CpuDevice streams: waiting on an event never recorded returns at once",
          "[zero][streams]") {
  auto dev = testing::AsyncOneThreadCpuDevice();
  Device::Event e = dev->CreateEvent().value();
  Device::Stream s = dev->CreateStream().value();
  CHECK(dev->WaitHost(e).ok());
  CHECK(dev->Wait(s, e).ok());
  CHECK(dev->Synchronize(s).ok());
  // The nullptr stream is the caller: a record on it is complete at once.
  CHECK(dev->Record(e, nullptr).ok());
  CHECK(dev->WaitHost(e).ok());
  dev->DestroyStream(s);
  dev->DestroyEvent(e);
}

TEST_CASE("CpuDevice streams: a failure is reported by Synchronize and by dependent events, "
          "and later work on the stream is skipped", "[zero][streams]") {
  auto dev = testing::AsyncOneThreadCpuDevice();
  Device::Stream s = dev->CreateStream().value();
  Device::Event e = dev->CreateEvent().value();
  std::vector<float> w(16, 1.0f), m(16, 0.0f), v(16, 0.0f);
  std::vector<float> g(16, 1.0f);
  // No master array: the kernel rejects it when it runs, not when it is enqueued.
  offload::AdamWArrays bad{nullptr, m.data(), v.data(), g.data(), DType::kF32, nullptr,
                           DType::kF32, 16};
  const offload::AdamWStepParams params =
      offload::MakeAdamWStepParams(1e-3, 0.9, 0.999, 1e-8, 0.0, 1).value();
  auto status = dev->AdamW(bad, params, 1.0f, s);
  REQUIRE(status.ok());  // only enqueued
  std::vector<float> later(16, 0.0f);
  REQUIRE(dev->Copy(later.data(), w.data(), 64, s).ok());  // w holds ones
  REQUIRE(dev->Record(e, s).ok());
  const absl::Status waited = dev->WaitHost(e);
  const absl::Status synced = dev->Synchronize(s);
  CHECK_FALSE(waited.ok());
  CHECK_FALSE(synced.ok());
  CHECK(later[0] == 0.0f);  // skipped after the failure
  dev->DestroyEvent(e);
  dev->DestroyStream(s);
}

TEST_CASE("CpuDevice without async streams runs everything inline", "[zero][streams]") {
  auto dev = testing::OneThreadCpuDevice();
  Device::Stream s = dev->CreateStream().value();
  std::vector<float> a(8, 2.0f), b(8, 0.0f);
  REQUIRE(dev->Copy(b.data(), a.data(), 32, s).ok());
  CHECK(b[7] == 2.0f);
  dev->DestroyStream(s);
}

// The modelled link is a lower bound on a copy's duration, inline or on a stream's thread, and
// the bytes still arrive; copies on the caller's (nullptr) stream are not DMA and not modelled.
TEST_CASE("CpuDevice copy link model: a copy on a created stream lasts bytes / link",
          "[zero][streams]") {
  const bool async = GENERATE(false, true);
  CpuDeviceOptions dev_options;
  dev_options.threads = 1;
  dev_options.async_streams = async;
  dev_options.copy_link_gbps = 0.5;
  auto dev = CreateCpuDevice(dev_options);
  Device::Stream s = dev->CreateStream().value();
  std::vector<char> a(size_t{1} << 20, 'x'), b(a.size(), 0);  // 1 MiB at 0.5 GB/s: 2.1 ms
  const auto t0 = std::chrono::steady_clock::now();
  REQUIRE(dev->Copy(b.data(), a.data(), a.size(), s).ok());
  REQUIRE(dev->Synchronize(s).ok());
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  CHECK(ms >= a.size() / 0.5e9 * 1e3);
  CHECK(b == a);
  std::vector<char> c(a.size(), 0);
  REQUIRE(dev->Copy(c.data(), a.data(), a.size(), nullptr).ok());
  CHECK(c == a);
  dev->DestroyStream(s);
}


TEST_CASE("CpuDevice memory: kDevice is an allocator of the device's own, counted and "
          "decommittable", "[zero][park]") {
  auto a = testing::OneThreadCpuDevice();
  auto b = testing::OneThreadCpuDevice();
  memory::RawAllocator* da = a->allocator(memory::MemoryKind::kDevice);
  memory::RawAllocator* db = b->allocator(memory::MemoryKind::kDevice);
  CHECK(da != db);
  CHECK(da != memory::HostAllocator());
  CHECK(a->allocator(memory::MemoryKind::kPageableHost) == memory::HostAllocator());
  REQUIRE(da->usage().has_value());
  CHECK(da->usage()->resident_bytes == 0);

  constexpr size_t kBytes = 3 << 20;
  auto buffer = memory::Allocation::Create(da, kBytes);
  REQUIRE(buffer.ok());
  std::vector<char> pattern(kBytes);
  for (size_t i = 0; i < kBytes; ++i) pattern[i] = static_cast<char>(i * 7 + 3);
  REQUIRE(a->Copy(buffer->get(), pattern.data(), kBytes, nullptr).ok());
  CHECK(da->usage()->resident_bytes == kBytes);
  CHECK(db->usage()->resident_bytes == 0);  // the other device counts nothing of it

  // What Engine::Park does with a device buffer: out to the host, decommit, recommit, back.
  std::vector<char> saved(kBytes);
  REQUIRE(a->Copy(saved.data(), buffer->get(), kBytes, nullptr).ok());
  REQUIRE(da->Decommit(buffer->get(), kBytes).ok());
  CHECK(da->usage()->resident_bytes == 0);
  CHECK(da->usage()->reserved_bytes == kBytes);
  REQUIRE(da->Recommit(buffer->get(), kBytes).ok());
  REQUIRE(a->Copy(buffer->get(), saved.data(), kBytes, nullptr).ok());
  CHECK(std::memcmp(buffer->get(), pattern.data(), kBytes) == 0);
  CHECK(da->usage()->resident_bytes == kBytes);
  *buffer = memory::Allocation();
  CHECK(da->usage()->allocations == 0);
  CHECK(a->ReleaseCachedMemory().ok());  // nothing cached on the CPU device
}

}  // namespace
}  // namespace zerort
