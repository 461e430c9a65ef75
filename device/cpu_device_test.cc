#include "device/cpu_device.h"
#include "device/testing/one_thread.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

#include "base/dtype.h"
#include "offload/compact_state.h"
#include "offload/cpu_adamw.h"
#include "offload/cpu_adamw_compact.h"

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

// The state of one compact update, as the host reference and the device each get a copy of it.
struct CompactState {
  std::vector<float> master;
  std::vector<uint16_t> param, remainder;
  std::vector<char> m, v;
  std::vector<uint16_t> grad;  // bf16

  CompactState(offload::MasterForm form, DType moments, size_t n, uint32_t seed)
      : m(n * DTypeSize(moments)), v(n * DTypeSize(moments)), grad(n) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (size_t i = 0; i < n; ++i) {
      const float x = u(rng), mi = 1e-3f * u(rng), vi = 1e-6f * std::fabs(u(rng));
      if (form == offload::MasterForm::kF32) {
        master.push_back(x);
        param.push_back(0);  // the bf16 copy, written by the update
      } else {
        uint16_t p, r;
        offload::SplitMaster(x, &p, &r);
        param.push_back(p);
        if (form == offload::MasterForm::kBf16Remainder) remainder.push_back(r);
      }
      StoreAs(moments, m.data(), i, mi);
      StoreAs(moments, v.data(), i, vi);
      grad[i] = FloatToBf16(1e-2f * u(rng));
    }
  }

  offload::CompactAdamWArrays Arrays(offload::MasterForm form, DType moments,
                                     const offload::StochasticRounding& rounding) {
    offload::CompactAdamWArrays a;
    a.master_form = form;
    a.master = master.empty() ? nullptr : master.data();
    a.param = param.data();
    a.param_dtype = DType::kBF16;
    a.remainder = remainder.empty() ? nullptr : remainder.data();
    a.m = m.data();
    a.v = v.data();
    a.moment_dtype = moments;
    a.grad = grad.data();
    a.grad_dtype = DType::kBF16;
    a.n = grad.size();
    a.rounding = rounding;
    return a;
  }

  // Bit for bit (memcmp, not float ==); an empty master's data() may be null, which memcmp
  // must not see.
  bool operator==(const CompactState& o) const {
    return master.size() == o.master.size() &&
           (master.empty() ||
            std::memcmp(master.data(), o.master.data(), 4 * master.size()) == 0) &&
           param == o.param && remainder == o.remainder && m == o.m && v == o.v;
  }
};

// Device::CompactAdamWRanges on the CPU device is CpuAdamWCompact; what the device adds is the
// stream: the call is ordered after earlier work on its stream and keeps its own copy of the
// ranges.
TEST_CASE("CpuDevice: CompactAdamWRanges equals CpuAdamWCompact, on inline and asynchronous "
          "streams", "[zero][streams]") {
  const bool async = GENERATE(false, true);
  const size_t n = 5003;
  const offload::StochasticRounding rounding{11, 3, (uint64_t{1} << 32) - 2000};
  const std::vector<size_t> cuts = {0, 7, 7, 2500, n};
  for (offload::MasterForm form :
       {offload::MasterForm::kF32, offload::MasterForm::kBf16Remainder,
        offload::MasterForm::kBf16Stochastic}) {
    for (DType moments : {DType::kF32, DType::kBF16}) {
      INFO("async " << async << " master " << offload::MasterFormName(form) << " moments "
                    << DTypeName(moments));
      std::vector<offload::AdamWRange> ranges;
      for (size_t k = 0; k + 1 < cuts.size(); ++k) {
        ranges.push_back({cuts[k], cuts[k + 1],
                          offload::MakeAdamWStepParams(1e-3 * (k + 1), 0.9, 0.95, 1e-8,
                                                       0.1 * k, 3)
                              .value()});
      }
      CompactState want(form, moments, n, 5), got(form, moments, n, 5);
      REQUIRE(offload::CpuAdamWCompact(want.Arrays(form, moments, rounding), ranges, 0.5f, 1)
                  .ok());

      auto dev = async ? testing::AsyncOneThreadCpuDevice(2000) : testing::OneThreadCpuDevice();
      Device::Stream s = dev->CreateStream().value();
      // The gradient arrives by a copy queued first on the same stream: an update that ran
      // before it would read zeros.
      const std::vector<uint16_t> grad = got.grad;
      std::fill(got.grad.begin(), got.grad.end(), 0);
      REQUIRE(dev->Copy(got.grad.data(), grad.data(), 2 * n, s).ok());
      {
        std::vector<offload::AdamWRange> scoped = ranges;  // gone before the call runs
        REQUIRE(dev->CompactAdamWRanges(got.Arrays(form, moments, rounding), scoped, 0.5f, s)
                    .ok());
      }
      REQUIRE(dev->Synchronize(s).ok());
      CHECK(got == want);
      dev->DestroyStream(s);
    }
  }
}

TEST_CASE("CpuDevice: CompactAdamWRanges reports CpuAdamWCompact's refusal, when the call runs",
          "[zero][streams]") {
  const bool async = GENERATE(false, true);
  auto dev = async ? testing::AsyncOneThreadCpuDevice() : testing::OneThreadCpuDevice();
  Device::Stream s = dev->CreateStream().value();
  CompactState state(offload::MasterForm::kBf16Remainder, DType::kF32, 16, 1);
  offload::CompactAdamWArrays bad =
      state.Arrays(offload::MasterForm::kBf16Remainder, DType::kF32, {});
  bad.remainder = nullptr;
  const absl::Status enqueued = dev->CompactAdamWRanges(
      bad, {{0, 16, offload::MakeAdamWStepParams(1e-3, 0.9, 0.95, 1e-8, 0.0, 1).value()}}, 1.0f,
      s);
  const absl::Status synced = dev->Synchronize(s);
  // Inline, the call itself fails; on a stream, Synchronize reports it.
  const absl::Status& failure = async ? synced : enqueued;
  CHECK((async ? enqueued : synced).ok());
  CHECK(failure.code() == absl::StatusCode::kInvalidArgument);
  CHECK(failure.message() ==
        "CpuAdamWCompact: master_form=bf16_remainder with n=16 needs remainder (null)");
  dev->DestroyStream(s);
}

}  // namespace
}  // namespace zerort
