#include "comm/inprocess.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "comm/testing/typed_buffer.h"

namespace zerort {
namespace comm {
namespace {

using Comms = std::vector<std::unique_ptr<Communicator>>;

Comms MakeGroup(int n, CommOptions options = {}) {
  auto comms = CreateInProcessGroup(n, options);
  REQUIRE(comms.ok());
  return std::move(comms).value();
}

// Runs fn(rank) on one thread per rank and joins them all.
void RunRanks(int n, const std::function<void(int)>& fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

// Typed storage for test data: values are kept as raw bits of the dtype.
// memcmp for possibly empty (null) ranges.
bool SameBytes(const void* a, const void* b, size_t n) {
  return n == 0 || std::memcmp(a, b, n) == 0;
}
void CopyBytes(void* d, const void* s, size_t n) {
  if (n > 0) std::memcpy(d, s, n);
}

using testing::Buf;

Buf Random(DType t, size_t count, std::mt19937& rng) {
  std::uniform_real_distribution<float> d(-8.0f, 8.0f);
  Buf b(t, count);
  for (size_t i = 0; i < count; ++i) b.set(i, d(rng));
  return b;
}

// The serial reference: fp32 accumulation in rank order, one final rounding.
Buf SerialReduce(const std::vector<Buf>& in, size_t offset, size_t count, ReduceOp op) {
  Buf out(in[0].t, count);
  for (size_t i = 0; i < count; ++i) {
    float acc = in[0].get(offset + i);
    for (size_t r = 1; r < in.size(); ++r) {
      const float x = in[r].get(offset + i);
      acc = op == ReduceOp::kMax ? (x >= acc ? x : acc) : acc + x;
    }
    if (op == ReduceOp::kAvg) acc /= static_cast<float>(in.size());
    out.set(i, acc);
  }
  return out;
}

const DType kDTypes[] = {DType::kF32, DType::kBF16, DType::kF16};
const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax};

std::vector<size_t> Counts(int n) {
  // Zero, one, a prime, a count not divisible by the world, and one over a SIMD chunk.
  return {0, 1, 13, static_cast<size_t>(7 * n + 1), 2053};
}

TEST_CASE("InProcess: reduce-scatter equals the serial reference for every world, dtype, op",
          "[comm]") {
  std::mt19937 rng(1);
  for (int n = 1; n <= 8; ++n) {
    Comms comms = MakeGroup(n);
    for (DType t : kDTypes) {
      for (ReduceOp op : kOps) {
        for (size_t count : Counts(n)) {
          for (bool in_place : {false, true}) {
            std::vector<Buf> send;
            for (int r = 0; r < n; ++r) send.push_back(Random(t, n * count, rng));
            const std::vector<Buf> original = send;
            std::vector<Buf> recv(n, Buf(t, count));
            std::vector<absl::Status> st(n);
            RunRanks(n, [&](int r) {
              void* out = in_place ? send[r].at(r * count) : recv[r].data();
              st[r] = comms[r]->ReduceScatter(send[r].data(), out, count, t, op);
            });
            INFO("world " << n << " dtype " << DTypeName(t) << " op " << ReduceOpName(op)
                          << " count " << count << " in_place " << in_place);
            for (int r = 0; r < n; ++r) {
              REQUIRE(st[r].ok());
              const Buf expect = SerialReduce(original, r * count, count, op);
              const char* got = in_place ? send[r].at(r * count) : recv[r].at(0);
              CHECK(SameBytes(got, expect.bytes.data(), expect.bytes.size()));
            }
          }
        }
      }
    }
  }
}

TEST_CASE("InProcess: all-reduce is bitwise reduce-scatter followed by all-gather", "[comm]") {
  std::mt19937 rng(2);
  for (int n = 1; n <= 8; ++n) {
    Comms comms = MakeGroup(n);
    for (DType t : kDTypes) {
      for (ReduceOp op : kOps) {
        for (size_t count : Counts(n)) {
          // The same data as n blocks of `count`: all-reduce over n*count elements must equal
          // reduce-scatter + all-gather of the same array.
          const size_t total = n * count;
          std::vector<Buf> send;
          for (int r = 0; r < n; ++r) send.push_back(Random(t, total, rng));
          std::vector<Buf> ar(n, Buf(t, total)), shard(n, Buf(t, count)), rsag(n, Buf(t, total));
          std::vector<Buf> inplace = send;
          std::vector<absl::Status> st(n * 4);
          RunRanks(n, [&](int r) {
            st[4 * r] = comms[r]->AllReduce(send[r].data(), ar[r].data(), total, t, op);
            st[4 * r + 1] = comms[r]->AllReduce(inplace[r].data(), inplace[r].data(), total, t, op);
            st[4 * r + 2] = comms[r]->ReduceScatter(send[r].data(), shard[r].data(), count, t, op);
            st[4 * r + 3] = comms[r]->AllGather(shard[r].data(), rsag[r].data(), count, t);
          });
          INFO("world " << n << " dtype " << DTypeName(t) << " op " << ReduceOpName(op)
                        << " count " << count);
          const Buf expect = SerialReduce(send, 0, total, op);
          for (int r = 0; r < n; ++r) {
            for (int k = 0; k < 4; ++k) REQUIRE(st[4 * r + k].ok());
            CHECK(ar[r].bytes == expect.bytes);
            CHECK(inplace[r].bytes == expect.bytes);
            CHECK(rsag[r].bytes == ar[r].bytes);
          }
        }
      }
    }
  }
}

TEST_CASE("InProcess: all-gather places block r at r*count, in place and out of place",
          "[comm]") {
  std::mt19937 rng(3);
  for (int n = 1; n <= 8; ++n) {
    Comms comms = MakeGroup(n);
    for (DType t : kDTypes) {
      for (size_t count : Counts(n)) {
        std::vector<Buf> send;
        for (int r = 0; r < n; ++r) send.push_back(Random(t, count, rng));
        std::vector<Buf> out(n, Buf(t, n * count)), inplace(n, Buf(t, n * count));
        for (int r = 0; r < n; ++r) {
          CopyBytes(inplace[r].at(r * count), send[r].data(), send[r].bytes.size());
        }
        std::vector<absl::Status> st(2 * n);
        RunRanks(n, [&](int r) {
          st[2 * r] = comms[r]->AllGather(send[r].data(), out[r].data(), count, t);
          st[2 * r + 1] =
              comms[r]->AllGather(inplace[r].at(r * count), inplace[r].data(), count, t);
        });
        Buf expect(t, n * count);
        for (int q = 0; q < n; ++q) {
          CopyBytes(expect.at(q * count), send[q].data(), send[q].bytes.size());
        }
        INFO("world " << n << " dtype " << DTypeName(t) << " count " << count);
        for (int r = 0; r < n; ++r) {
          REQUIRE(st[2 * r].ok());
          REQUIRE(st[2 * r + 1].ok());
          CHECK(out[r].bytes == expect.bytes);
          CHECK(inplace[r].bytes == expect.bytes);
        }
      }
    }
  }
}

TEST_CASE("InProcess: broadcast copies the root's buffer to every rank", "[comm]") {
  std::mt19937 rng(4);
  for (int n : {1, 2, 3, 8}) {
    Comms comms = MakeGroup(n);
    for (int root = 0; root < n; ++root) {
      std::vector<Buf> buf;
      for (int r = 0; r < n; ++r) buf.push_back(Random(DType::kBF16, 101, rng));
      const Buf expect = buf[root];
      std::vector<absl::Status> st(n);
      RunRanks(n, [&](int r) { st[r] = comms[r]->Broadcast(buf[r].data(), 101, DType::kBF16, root); });
      for (int r = 0; r < n; ++r) {
        REQUIRE(st[r].ok());
        CHECK(buf[r].bytes == expect.bytes);
      }
    }
  }
}

TEST_CASE("InProcess: 64 MiB all-reduce and reduce-scatter match the serial reference",
          "[comm]") {
  // 4 ranks x 16 MiB of bf16: the large-message path, one case to keep the suite fast.
  const int n = 4;
  const size_t total = (size_t{16} << 20) / 2;
  std::mt19937 rng(5);
  Comms comms = MakeGroup(n);
  std::vector<Buf> send;
  for (int r = 0; r < n; ++r) send.push_back(Random(DType::kBF16, total, rng));
  std::vector<Buf> ar(n, Buf(DType::kBF16, total)), rs(n, Buf(DType::kBF16, total / n));
  // In place too: slices of 4 MiB take the kernel's streaming-store branch.
  std::vector<Buf> ar_inplace = send, rs_inplace = send;
  std::vector<absl::Status> st(4 * n);
  RunRanks(n, [&](int r) {
    st[4 * r] = comms[r]->AllReduce(send[r].data(), ar[r].data(), total, DType::kBF16,
                                    ReduceOp::kAvg);
    st[4 * r + 1] = comms[r]->ReduceScatter(send[r].data(), rs[r].data(), total / n,
                                            DType::kBF16, ReduceOp::kAvg);
    st[4 * r + 2] = comms[r]->AllReduce(ar_inplace[r].data(), ar_inplace[r].data(), total,
                                        DType::kBF16, ReduceOp::kAvg);
    st[4 * r + 3] = comms[r]->ReduceScatter(rs_inplace[r].data(),
                                            rs_inplace[r].at(r * (total / n)), total / n,
                                            DType::kBF16, ReduceOp::kAvg);
  });
  const Buf expect = SerialReduce(send, 0, total, ReduceOp::kAvg);
  const size_t shard_bytes = rs[0].bytes.size();
  for (int r = 0; r < n; ++r) {
    for (int k = 0; k < 4; ++k) REQUIRE(st[4 * r + k].ok());
    CHECK(ar[r].bytes == expect.bytes);
    CHECK(SameBytes(rs[r].data(), expect.at(r * (total / n)), shard_bytes));
    CHECK(ar_inplace[r].bytes == expect.bytes);
    CHECK(SameBytes(rs_inplace[r].at(r * (total / n)), expect.at(r * (total / n)), shard_bytes));
  }
}

TEST_CASE("InProcess: results are identical run to run", "[comm]") {
  std::mt19937 rng(6);
  const int n = 5;
  Comms comms = MakeGroup(n);
  std::vector<Buf> send;
  for (int r = 0; r < n; ++r) send.push_back(Random(DType::kF32, 4099, rng));
  std::vector<std::vector<Buf>> runs(3, std::vector<Buf>(n, Buf(DType::kF32, 4099)));
  std::vector<absl::Status> st(n);
  for (auto& out : runs) {
    // Catch2 assertions are not thread-safe: threads only record, the test thread checks.
    RunRanks(n, [&](int r) {
      st[r] = comms[r]->AllReduce(send[r].data(), out[r].data(), 4099, DType::kF32,
                                  ReduceOp::kSum);
    });
    for (int r = 0; r < n; ++r) REQUIRE(st[r].ok());
  }
  for (int r = 0; r < n; ++r) {
    CHECK(runs[1][r].bytes == runs[0][r].bytes);
    CHECK(runs[2][r].bytes == runs[0][r].bytes);
  }
}

TEST_CASE("InProcess: a rank that never calls makes the others time out, then fail fast",
          "[comm]") {
  CommOptions options;
  options.timeout_ms = 200;
  std::vector<float> buf(3 * 10, 1.0f);
  std::vector<absl::Status> again(3);
  std::vector<double> seconds(3);
  Comms fresh = MakeGroup(3, options);
  std::vector<absl::Status> first(3);
  RunRanks(3, [&](int r) {
    if (r == 2) return;
    const auto t0 = std::chrono::steady_clock::now();
    first[r] = fresh[r]->ReduceScatter(buf.data(), buf.data() + 10 * r, 10, DType::kBF16,
                                       ReduceOp::kSum);
    seconds[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    again[r] = fresh[r]->Barrier();
  });
  for (int r = 0; r < 2; ++r) {
    INFO(first[r].ToString());
    CHECK(first[r].code() == absl::StatusCode::kDeadlineExceeded);
    CHECK(absl::StrContains(first[r].message(), "reduce_scatter #1"));
    CHECK(absl::StrContains(first[r].message(), "count=10"));
    CHECK(absl::StrContains(first[r].message(), "dtype=bf16"));
    CHECK(absl::StrContains(first[r].message(), "missing ranks [2]"));
    CHECK(absl::StrContains(first[r].message(), "recent operations"));
    CHECK(seconds[r] >= 0.15);
    CHECK(seconds[r] < 5.0);
    INFO(again[r].ToString());
    CHECK(again[r].code() == absl::StatusCode::kFailedPrecondition);
    CHECK(absl::StrContains(again[r].message(), "missing ranks [2]"));
  }
}

TEST_CASE("InProcess: a rank that leaves early makes waiting peers fail with Unavailable",
          "[comm]") {
  CommOptions options;
  options.timeout_ms = 60000;  // must fail long before this
  Comms comms = MakeGroup(4, options);
  std::vector<float> send(4 * 8, 1.0f), recv(8);
  std::vector<absl::Status> st(4);
  std::vector<double> seconds(4);
  RunRanks(4, [&](int r) {
    if (r == 3) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      comms[3].reset();  // the rank returns early and its communicator goes away
      return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<float> mine(send), out(8);
    st[r] = comms[r]->ReduceScatter(mine.data(), out.data(), 8, DType::kF32, ReduceOp::kSum);
    seconds[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  });
  for (int r = 0; r < 3; ++r) {
    INFO(st[r].ToString());
    CHECK(st[r].code() == absl::StatusCode::kUnavailable);
    CHECK(absl::StrContains(st[r].message(), "[3]"));
    CHECK(seconds[r] < 5.0);
  }
}

TEST_CASE("InProcess: mismatched arguments fail on every rank naming both, group survives",
          "[comm]") {
  CommOptions options;
  options.check_args = true;
  options.timeout_ms = 10000;
  Comms comms = MakeGroup(3, options);
  std::vector<std::vector<float>> send(3, std::vector<float>(3 * 20, 2.0f)),
      recv(3, std::vector<float>(3 * 20));
  std::vector<absl::Status> count_st(3), kind_st(3), root_st(3), ok_st(3), overlap_st(3);
  RunRanks(3, [&](int r) {
    const size_t count = r == 1 ? 19 : 20;
    count_st[r] = comms[r]->AllGather(send[r].data(), recv[r].data(), count, DType::kF32);
    kind_st[r] = r == 2 ? comms[r]->Barrier()
                        : comms[r]->AllReduce(send[r].data(), recv[r].data(), 20, DType::kF32,
                                              ReduceOp::kSum);
    root_st[r] = comms[r]->Broadcast(send[r].data(), 20, DType::kF32, r == 0 ? 1 : 0);
    // Overlapping but not in-place: rank 1's recv starts one element into its send.
    overlap_st[r] = comms[r]->AllReduce(send[r].data(), r == 1 ? send[r].data() + 1 : recv[r].data(),
                                        20, DType::kF32, ReduceOp::kSum);
    ok_st[r] = comms[r]->AllReduce(send[r].data(), recv[r].data(), 20, DType::kF32,
                                   ReduceOp::kSum);
  });
  for (int r = 0; r < 3; ++r) {
    INFO(count_st[r].ToString() << "\n" << kind_st[r].ToString() << "\n" << root_st[r].ToString()
                                << "\n" << overlap_st[r].ToString());
    CHECK(count_st[r].code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(count_st[r].message(), "rank 0 called all_gather #1 (count=20"));
    CHECK(absl::StrContains(count_st[r].message(), "rank 1 called all_gather #1 (count=19"));
    CHECK(kind_st[r].code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(kind_st[r].message(), "rank 2 called barrier #2"));
    CHECK(root_st[r].code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(root_st[r].message(), "root=1"));
    CHECK(absl::StrContains(root_st[r].message(), "root=0"));
    CHECK(overlap_st[r].code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(overlap_st[r].message(), "rank 1"));
    CHECK(absl::StrContains(overlap_st[r].message(), "overlap"));
    REQUIRE(ok_st[r].ok());
    CHECK(recv[r][0] == 6.0f);  // 3 ranks x 2.0, the group still works
  }
}

TEST_CASE("InProcess: bad construction arguments are rejected", "[comm]") {
  CHECK(CreateInProcessGroup(0).status().code() == absl::StatusCode::kInvalidArgument);
  CommOptions options;
  options.timeout_ms = 0;
  CHECK(CreateInProcessGroup(2, options).status().code() == absl::StatusCode::kInvalidArgument);
  Comms comms = MakeGroup(2);
  CHECK(comms[1]->rank() == 1);
  CHECK(comms[1]->size() == 2);
  CHECK(comms[1]->backend() == "inprocess");
  // A bad root on one rank fails every rank (through the shared argument check).
  float x[2] = {0, 0};
  std::vector<absl::Status> st(2);
  RunRanks(2, [&](int r) { st[r] = comms[r]->Broadcast(&x[r], 1, DType::kF32, r == 0 ? 2 : 0); });
  for (int r = 0; r < 2; ++r) {
    INFO(st[r].ToString());
    CHECK(st[r].code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(st[r].message(), "root 2 is outside the group of 2"));
  }
}

}  // namespace
}  // namespace comm
}  // namespace zerort

namespace zerort {
namespace comm {
namespace {

TEST_CASE("InProcess: buffer ops carry every copy and reduction, and their failures reach the "
          "caller after the peers are released", "[comm]") {
  // Ops that move host memory themselves (a byte loop and the serial reference), counting calls:
  // what a GPU's ops do with device memory.
  std::atomic<int> copies{0}, reductions{0};
  InProcessBufferOps ops;
  ops.copy = [&](void* dst, const void* src, size_t bytes) {
    ++copies;
    for (size_t i = 0; i < bytes; ++i) {
      static_cast<char*>(dst)[i] = static_cast<const char*>(src)[i];
    }
    return absl::OkStatus();
  };
  ops.reduce = [&](const void* const* srcs, int n, void* dst, size_t count, DType dtype,
                   ReduceOp op) -> absl::Status {
    ++reductions;
    std::vector<Buf> in;
    for (int k = 0; k < n; ++k) {
      in.emplace_back(dtype, count);
      CopyBytes(in.back().data(), srcs[k], count * DTypeSize(dtype));
    }
    Buf out = SerialReduce(in, 0, count, op);
    CopyBytes(dst, out.data(), count * DTypeSize(dtype));
    return absl::OkStatus();
  };
  ops.device_memory = true;
  const int n = 3;
  const size_t count = 1001;
  auto made = CreateInProcessGroup(n, {}, ops);
  REQUIRE(made.ok());
  Comms comms = std::move(made).value();
  CHECK(comms[0]->device_memory());
  CHECK_FALSE(MakeGroup(1)[0]->device_memory());

  std::mt19937 rng(5);
  std::vector<Buf> send;
  for (int r = 0; r < n; ++r) send.push_back(Random(DType::kBF16, n * count, rng));
  std::vector<Buf> rs(n, Buf(DType::kBF16, count)), ag(n, Buf(DType::kBF16, n * count));
  std::vector<absl::Status> st(n);
  RunRanks(n, [&](int r) {
    st[r] = comms[r]->ReduceScatter(send[r].data(), rs[r].data(), count, DType::kBF16,
                                    ReduceOp::kSum);
    if (st[r].ok()) {
      st[r] = comms[r]->AllGather(rs[r].data(), ag[r].data(), count, DType::kBF16);
    }
  });
  for (int r = 0; r < n; ++r) {
    REQUIRE(st[r].ok());
    const Buf want = SerialReduce(send, r * count, count, ReduceOp::kSum);
    CHECK(SameBytes(rs[r].at(0), want.at(0), count * 2));
    CHECK(SameBytes(ag[0].at(r * count), want.at(0), count * 2));
  }
  CHECK(reductions == n);
  CHECK(copies >= n * (n - 1));

  // A failing copy on rank 1: rank 1 gets the error, its peers complete, the group lives on.
  ops.copy = [](void*, const void*, size_t) -> absl::Status {
    return absl::DataLossError("injected copy failure");
  };
  auto failing = CreateInProcessGroup(2, {}, ops);
  REQUIRE(failing.ok());
  std::vector<char> a(64), b(128);
  RunRanks(2, [&](int r) {
    st[r] = (*failing)[r]->AllGather(a.data(), b.data(), 32, DType::kBF16);
  });
  CHECK(st[0].code() == absl::StatusCode::kDataLoss);
  CHECK(st[1].code() == absl::StatusCode::kDataLoss);
  RunRanks(2, [&](int r) { st[r] = (*failing)[r]->Barrier(); });
  CHECK(st[0].ok());
  CHECK(st[1].ok());

  InProcessBufferOps half;
  half.copy = ops.copy;
  CHECK(CreateInProcessGroup(2, {}, half).status().code() == absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace comm
}  // namespace zerort
