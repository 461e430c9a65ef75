#include "comm/testing/stream_ordered.h"

#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "base/status.h"
#include "comm/agree.h"
#include "comm/inprocess.h"
#include "comm/testing/typed_buffer.h"
#include "device/cpu_device.h"

namespace zerort {
namespace comm {
namespace {

using Comms = std::vector<std::unique_ptr<Communicator>>;
using testing::Buf;

// One kernel thread, streams on threads of their own, every operation on them 2 ms late: work
// that a collective reads or writes outside stream order then shows up as a wrong value.
std::unique_ptr<Device> DelayedDevice() {
  CpuDeviceOptions o;
  o.threads = 1;
  o.async_streams = true;
  o.stream_delay_us = 2000;
  return CreateCpuDevice(o);
}

void RunRanks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

Buf Random(DType t, size_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-8.0f, 8.0f);
  Buf b(t, count);
  for (size_t i = 0; i < count; ++i) b.set(i, d(rng));
  return b;
}

enum class Op { kAllGather, kReduceScatter, kAllReduce, kBroadcast };

struct Case {
  Op op;
  DType dtype;
  ReduceOp reduce;
  bool in_place;
};

// Runs `c` on every rank of `comms`. Rank r's input is Random(seed r); it is written into the
// operation's buffer by a Copy enqueued on `stream` just before the call, and the result read
// back by a Copy enqueued just after it, then the stream is synchronized: the collective must
// see the first copy and finish before the second (stream order), with no host wait between.
// On a CPU backend the stream is ignored (inline copies). Returns every rank's result bytes.
std::vector<std::vector<char>> RunCase(const Comms& comms, Device* dev, const Case& c,
                                       size_t count, bool streams) {
  const int n = static_cast<int>(comms.size());
  const size_t es = DTypeSize(c.dtype);
  std::vector<std::vector<char>> out(n);
  RunRanks(n, [&](int r) {
    Device::Stream s = nullptr;
    if (streams) s = dev->CreateStream().value();
    const size_t in_count = c.op == Op::kReduceScatter ? n * count : count;
    const size_t out_count = c.op == Op::kAllGather ? n * count : count;
    const Buf in = Random(c.dtype, in_count, 1000 + r);
    // (max(in, out) count) dtype: the buffer the collective works on, stale values first.
    std::vector<char> buf(std::max(in_count, out_count) * es, 0x55);
    std::vector<char> recv(out_count * es, 0x66);
    std::vector<char> result(out_count * es);
    char* send = buf.data();
    char* dst = recv.data();
    if (c.in_place) {
      if (c.op == Op::kAllGather) send = buf.data() + r * count * es, dst = buf.data();
      if (c.op == Op::kReduceScatter) dst = buf.data() + r * count * es;
      if (c.op == Op::kAllReduce || c.op == Op::kBroadcast) dst = buf.data();
    }
    REQUIRE(dev->Copy(send, in.bytes.data(), in.bytes.size(), s).ok());
    absl::Status st;
    switch (c.op) {
      case Op::kAllGather:
        st = comms[r]->AllGather(send, dst, count, c.dtype, s);
        break;
      case Op::kReduceScatter:
        st = comms[r]->ReduceScatter(send, dst, count, c.dtype, c.reduce, s);
        break;
      case Op::kAllReduce:
        st = comms[r]->AllReduce(send, dst, count, c.dtype, c.reduce, s);
        break;
      case Op::kBroadcast:
        dst = send;
        st = comms[r]->Broadcast(send, count, c.dtype, n - 1, s);
        break;
    }
    REQUIRE(st.ok());
    REQUIRE(dev->Copy(result.data(), dst, result.size(), s).ok());
    REQUIRE(comms[r]->Synchronize(s).ok());
    REQUIRE(dev->Synchronize(s).ok());
    if (streams) dev->DestroyStream(s);
    out[r] = std::move(result);
  });
  return out;
}

TEST_CASE("StreamOrdered: every collective equals the in-process group's bit for bit, in "
          "stream order on delayed streams",
          "[comm][stream_ordered]") {
  auto dev = DelayedDevice();
  for (int n : {1, 2, 4}) {
    auto so = testing::CreateStreamOrderedGroup(n, dev.get());
    auto ip = CreateInProcessGroup(n);
    REQUIRE(so.ok());
    REQUIRE(ip.ok());
    REQUIRE((*so)[0]->stream_ordered());
    REQUIRE_FALSE((*so)[0]->device_memory());
    for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (bool in_place : {false, true}) {
        std::vector<Case> cases = {{Op::kAllGather, t, ReduceOp::kSum, in_place},
                                   {Op::kBroadcast, t, ReduceOp::kSum, in_place}};
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
          cases.push_back({Op::kReduceScatter, t, op, in_place});
          cases.push_back({Op::kAllReduce, t, op, in_place});
        }
        for (const Case& c : cases) {
          for (size_t count : {size_t{0}, size_t{1}, size_t{257}}) {
            INFO("world " << n << " op " << static_cast<int>(c.op) << " dtype "
                          << DTypeName(t) << " reduce " << ReduceOpName(c.reduce)
                          << " in_place " << in_place << " count " << count);
            const auto want = RunCase(*ip, dev.get(), c, count, /*streams=*/false);
            const auto got = RunCase(*so, dev.get(), c, count, /*streams=*/true);
            REQUIRE(got == want);
          }
        }
      }
    }
  }
}

TEST_CASE("StreamOrdered: a split's groups run different collectives concurrently, each "
          "equal to an in-process group of its size",
          "[comm][stream_ordered]") {
  auto dev = DelayedDevice();
  auto so = testing::CreateStreamOrderedGroup(4, dev.get());
  REQUIRE(so.ok());
  std::vector<std::unique_ptr<Communicator>> subs(4);
  std::vector<absl::Status> st(4);
  RunRanks(4, [&](int r) {
    auto sub = (*so)[r]->Split(r % 2, r);  // {0, 2} and {1, 3}
    st[r] = sub.status();
    if (sub.ok()) subs[r] = std::move(sub).value();
  });
  Comms groups[2];
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r << ": " << st[r]);
    REQUIRE(st[r].ok());
    REQUIRE(subs[r]->size() == 2);
    REQUIRE(subs[r]->rank() == r / 2);
    REQUIRE(subs[r]->stream_ordered());
  }
  for (int r = 0; r < 4; ++r) groups[r % 2].push_back(std::move(subs[r]));
  const Case cases[2] = {{Op::kAllReduce, DType::kBF16, ReduceOp::kSum, false},
                         {Op::kReduceScatter, DType::kF32, ReduceOp::kAvg, true}};
  const size_t count = 257;
  std::vector<std::vector<char>> got[2];
  std::thread other([&] { got[1] = RunCase(groups[1], dev.get(), cases[1], count, true); });
  got[0] = RunCase(groups[0], dev.get(), cases[0], count, true);
  other.join();
  auto ip = CreateInProcessGroup(2);
  REQUIRE(ip.ok());
  for (int g = 0; g < 2; ++g) {
    INFO("group " << g);
    CHECK(got[g] == RunCase(*ip, dev.get(), cases[g], count, false));
  }
}

TEST_CASE("StreamOrdered: the calling thread's stream (nullptr) works too",
          "[comm][stream_ordered]") {
  auto dev = DelayedDevice();
  auto so = testing::CreateStreamOrderedGroup(2, dev.get());
  auto ip = CreateInProcessGroup(2);
  REQUIRE(so.ok());
  REQUIRE(ip.ok());
  const Case c{Op::kAllReduce, DType::kBF16, ReduceOp::kAvg, true};
  REQUIRE(RunCase(*so, dev.get(), c, 300, false) == RunCase(*ip, dev.get(), c, 300, false));
}

TEST_CASE("StreamOrdered: operations of one communicator on two streams run in issue order",
          "[comm][stream_ordered]") {
  auto dev = DelayedDevice();
  auto so = testing::CreateStreamOrderedGroup(2, dev.get());
  REQUIRE(so.ok());
  RunRanks(2, [&](int r) {
    Device::Stream a = dev->CreateStream().value();
    Device::Stream b = dev->CreateStream().value();
    std::vector<float> x(64, static_cast<float>(r + 1)), y(128, -1), z(128, -1);
    // y = gather(x) on a; z = gather(y[0..64)) on b: b's gather must see a's result.
    REQUIRE((*so)[r]->AllGather(x.data(), y.data(), 64, DType::kF32, a).ok());
    REQUIRE((*so)[r]->AllGather(y.data() + 64 * r, z.data(), 64, DType::kF32, b).ok());
    REQUIRE(dev->Synchronize(b).ok());
    REQUIRE(dev->Synchronize(a).ok());
    for (int i = 0; i < 64; ++i) {
      // Rank q's block of z is y[64q, 64q + 64) of rank q: all rank q + 1's value.
      REQUIRE(z[i] == 1.0f);
      REQUIRE(z[64 + i] == 2.0f);
    }
    dev->DestroyStream(a);
    dev->DestroyStream(b);
  });
}

TEST_CASE("StreamOrdered: DirectHostExchange refuses it as it refuses NCCL; what it cannot "
          "reduce exactly is refused on every rank",
          "[comm][stream_ordered]") {
  auto dev = DelayedDevice();
  auto so = testing::CreateStreamOrderedGroup(3, dev.get());
  REQUIRE(so.ok());
  std::vector<absl::Status> direct(3), avg(3), max(3);
  RunRanks(3, [&](int r) {
    DirectHostExchange ex((*so)[r].get());
    direct[r] = AllGatherU64(ex, {uint64_t{7}}).status();
    std::vector<float> v(8, 1.0f);
    avg[r] = (*so)[r]->AllReduce(v.data(), v.data(), 8, DType::kF32, ReduceOp::kAvg, nullptr);
    max[r] = (*so)[r]->AllReduce(v.data(), v.data(), 8, DType::kF32, ReduceOp::kMax, nullptr);
  });
  for (int r = 0; r < 3; ++r) {
    REQUIRE(direct[r].code() == absl::StatusCode::kFailedPrecondition);
    REQUIRE(absl::StrContains(direct[r].message(), "stream-ordered-test"));
    REQUIRE(absl::StrContains(direct[r].message(), "stages them in device memory"));
    REQUIRE(avg[r].code() == absl::StatusCode::kInvalidArgument);
    REQUIRE(absl::StrContains(avg[r].message(), "power-of-two"));
    REQUIRE(max[r].code() == absl::StatusCode::kUnimplemented);
  }
}

TEST_CASE("StreamOrdered: mismatched arguments fail every rank, naming both",
          "[comm][stream_ordered]") {
  auto dev = DelayedDevice();
  auto so = testing::CreateStreamOrderedGroup(2, dev.get());
  REQUIRE(so.ok());
  std::vector<absl::Status> st(2);
  RunRanks(2, [&](int r) {
    std::vector<float> v(16, 1.0f), out(32);
    st[r] = (*so)[r]->AllGather(v.data(), out.data(), r == 0 ? 8 : 16, DType::kF32, nullptr);
  });
  for (int r = 0; r < 2; ++r) {
    INFO(st[r].ToString());
    REQUIRE(st[r].code() == absl::StatusCode::kInvalidArgument);
    REQUIRE(absl::StrContains(st[r].message(), "count"));
  }
}

TEST_CASE("StreamOrdered: refuses a device whose memory the host cannot reach",
          "[comm][stream_ordered]") {
  REQUIRE(testing::CreateStreamOrderedGroup(2, nullptr).status().code() ==
          absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace comm
}  // namespace zerort
