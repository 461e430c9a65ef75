// Runs under mpirun (see mpi_test.sh): every rank runs every test case, in the same order.
// Each rank can generate every peer's input (a hash of rank, case and index), so each checks its
// own results against a serial reference computed locally, and against the in-process backend
// run on the same data in this process (bitwise: the determinism contract spans backends).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "comm/internal/common.h"
#include "comm/inprocess.h"
#include "comm/testing/typed_buffer.h"
#include "comm/mpi.h"

namespace zerort {
namespace comm {
namespace {

int g_rank = 0, g_size = 1;

float Value(int rank, int test, size_t i) {
  uint64_t x = (static_cast<uint64_t>(rank) << 48) ^ (static_cast<uint64_t>(test) << 32) ^ i;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<float>(static_cast<int64_t>(x % 16001) - 8000) / 1000.0f;
}

// memcmp for possibly empty (null) ranges.
bool SameBytes(const void* a, const void* b, size_t n) {
  return n == 0 || std::memcmp(a, b, n) == 0;
}
void CopyBytes(void* d, const void* s, size_t n) {
  if (n > 0) std::memcpy(d, s, n);
}

using testing::Buf;

Buf Input(DType t, int rank, int test, size_t count) {
  Buf b(t, count);
  for (size_t i = 0; i < count; ++i) b.set(i, Value(rank, test, i));
  return b;
}

// Serial reference over every rank's input: fp32, rank order, one rounding.
Buf Reference(DType t, int test, size_t offset, size_t count, ReduceOp op) {
  std::vector<Buf> in;
  for (int r = 0; r < g_size; ++r) in.push_back(Input(t, r, test, offset + count));
  Buf out(t, count);
  for (size_t i = 0; i < count; ++i) {
    float acc = in[0].get(offset + i);
    for (int r = 1; r < g_size; ++r) {
      const float x = in[r].get(offset + i);
      acc = op == ReduceOp::kMax ? (x >= acc ? x : acc) : acc + x;
    }
    if (op == ReduceOp::kAvg) acc /= static_cast<float>(g_size);
    out.set(i, acc);
  }
  return out;
}

std::unique_ptr<Communicator> MakeComm(CommOptions options = {}) {
  auto c = CreateMpiCommunicator(MPI_COMM_WORLD, options);
  REQUIRE(c.ok());
  return std::move(c).value();
}

const DType kDTypes[] = {DType::kF32, DType::kBF16, DType::kF16};
const ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax};

TEST_CASE("Mpi: reduce-scatter, all-reduce, all-gather match the serial reference", "[comm]") {
  auto comm = MakeComm();
  REQUIRE(comm->size() == g_size);
  REQUIRE(comm->backend() == "mpi");
  int test = 0;
  for (DType t : kDTypes) {
    for (ReduceOp op : kOps) {
      for (size_t count : {size_t{0}, size_t{1}, size_t{13}, static_cast<size_t>(5 * g_size + 3),
                           size_t{2053}}) {
        ++test;
        INFO("rank " << g_rank << " dtype " << DTypeName(t) << " op " << ReduceOpName(op)
                     << " count " << count);
        const size_t total = g_size * count;
        Buf send = Input(t, g_rank, test, total);
        Buf rs(t, count), ar(t, total), ag(t, total);
        Buf inplace_rs = send, inplace_ar = send;
        REQUIRE(comm->ReduceScatter(send.at(0), rs.at(0), count, t, op).ok());
        REQUIRE(comm->ReduceScatter(inplace_rs.at(0), inplace_rs.at(g_rank * count), count, t, op)
                    .ok());
        REQUIRE(comm->AllReduce(send.at(0), ar.at(0), total, t, op).ok());
        REQUIRE(comm->AllReduce(inplace_ar.at(0), inplace_ar.at(0), total, t, op).ok());
        REQUIRE(comm->AllGather(rs.at(0), ag.at(0), count, t).ok());
        const Buf expect = Reference(t, test, 0, total, op);
        CHECK(SameBytes(rs.at(0), expect.bytes.data() + g_rank * rs.bytes.size(),
                          rs.bytes.size()));
        CHECK(SameBytes(inplace_rs.at(g_rank * count),
                          expect.bytes.data() + g_rank * rs.bytes.size(), rs.bytes.size()));
        CHECK(ar.bytes == expect.bytes);
        CHECK(inplace_ar.bytes == expect.bytes);
        CHECK(ag.bytes == ar.bytes);  // all-reduce == reduce-scatter + all-gather, bitwise
        // In-place all-gather of each rank's own block.
        Buf ip(t, total);
        CopyBytes(ip.at(g_rank * count), rs.at(0), rs.bytes.size());
        REQUIRE(comm->AllGather(ip.at(g_rank * count), ip.at(0), count, t).ok());
        CHECK(ip.bytes == ag.bytes);
      }
    }
  }
}

TEST_CASE("Mpi: ReduceScatterInGroups matches the serial reference over every rank",
          "[comm][hsdp]") {
  auto comm = MakeComm();
  int test = 500;
  for (int g = 1; g <= g_size; ++g) {
    if (g_size % g != 0) continue;
    for (DType t : kDTypes) {
      for (ReduceOp op : kOps) {
        // 2053 elements span several exchange steps of small chunks; 13 is uneven per replica.
        for (size_t count : {size_t{0}, size_t{13}, size_t{2053}}) {
          ++test;
          INFO("rank " << g_rank << " group " << g << " dtype " << DTypeName(t) << " op "
                       << ReduceOpName(op) << " count " << count);
          const size_t pos = static_cast<size_t>(g_rank % g);
          Buf send = Input(t, g_rank, test, g * count);
          Buf out(t, count), inplace = send;
          REQUIRE(comm->ReduceScatterInGroups(send.at(0), out.at(0), count, t, op, g).ok());
          REQUIRE(comm->ReduceScatterInGroups(inplace.at(0), inplace.at(pos * count), count, t,
                                              op, g)
                      .ok());
          const Buf expect = Reference(t, test, pos * count, count, op);
          CHECK(out.bytes == expect.bytes);
          CHECK(SameBytes(inplace.at(pos * count), expect.bytes.data(), expect.bytes.size()));
        }
      }
    }
  }
  // A group size that does not divide the world fails on every rank, naming it.
  if (g_size > 1) {
    std::vector<float> send(4 * (g_size + 1)), recv(4);
    const absl::Status s = comm->ReduceScatterInGroups(send.data(), recv.data(), 4, DType::kF32,
                                                       ReduceOp::kSum, g_size + 1);
    CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(s.message(), "group_size"));
  }
}

TEST_CASE("Mpi: results equal the in-process backend's bit for bit", "[comm]") {
  auto comm = MakeComm();
  const size_t total = 3 * 1024 * g_size + 5;  // not divisible by the world
  for (DType t : kDTypes) {
    std::vector<Buf> in;
    for (int r = 0; r < g_size; ++r) in.push_back(Input(t, r, 1000, total));
    Buf mpi_out(t, total);
    REQUIRE(comm->AllReduce(in[g_rank].at(0), mpi_out.at(0), total, t, ReduceOp::kAvg).ok());
    auto group = CreateInProcessGroup(g_size);
    REQUIRE(group.ok());
    std::vector<Buf> out(g_size, Buf(t, total));
    std::vector<absl::Status> st(g_size);
    std::vector<std::thread> threads;
    for (int r = 0; r < g_size; ++r) {
      threads.emplace_back([&, r] {
        st[r] = (*group)[r]->AllReduce(in[r].at(0), out[r].at(0), total, t, ReduceOp::kAvg);
      });
    }
    for (auto& th : threads) th.join();
    for (int r = 0; r < g_size; ++r) REQUIRE(st[r].ok());
    CHECK(out[g_rank].bytes == mpi_out.bytes);
  }
}

TEST_CASE("Mpi: large all-reduce (64 MiB in total) matches the reference", "[comm]") {
  auto comm = MakeComm();
  const size_t count = (size_t{64} << 20) / 4 / g_size;  // fp32, 64 MiB across all ranks
  Buf send = Input(DType::kF32, g_rank, 2000, count);
  Buf out(DType::kF32, count);
  REQUIRE(comm->AllReduce(send.at(0), out.at(0), count, DType::kF32, ReduceOp::kSum).ok());
  CHECK(out.bytes == Reference(DType::kF32, 2000, 0, count, ReduceOp::kSum).bytes);
}

TEST_CASE("Mpi: reductions spanning several exchange chunks, uneven slices, match the reference",
          "[comm]") {
  // The exchange moves 1 MiB per peer and step: 2.5 steps per block here, and an all-reduce
  // whose slices differ in length (so peers send different numbers of chunks).
  auto comm = MakeComm();
  const DType t = DType::kBF16;
  const size_t count = (size_t{5} << 20) / 2 / 2 + 3;  // elements per block
  const size_t total = g_size * count;
  Buf send = Input(t, g_rank, 4000, total);
  Buf rs(t, count), ar(t, total);
  Buf inplace_rs = send, inplace_ar = send;
  REQUIRE(comm->ReduceScatter(send.at(0), rs.at(0), count, t, ReduceOp::kSum).ok());
  REQUIRE(comm->ReduceScatter(inplace_rs.at(0), inplace_rs.at(g_rank * count), count, t,
                              ReduceOp::kSum)
              .ok());
  REQUIRE(comm->AllReduce(send.at(0), ar.at(0), total - 1, t, ReduceOp::kSum).ok());
  REQUIRE(comm->AllReduce(inplace_ar.at(0), inplace_ar.at(0), total - 1, t, ReduceOp::kSum).ok());
  const Buf expect = Reference(t, 4000, 0, total, ReduceOp::kSum);
  INFO("rank " << g_rank);
  CHECK(SameBytes(rs.at(0), expect.at(g_rank * count), rs.bytes.size()));
  CHECK(SameBytes(inplace_rs.at(g_rank * count), expect.at(g_rank * count), rs.bytes.size()));
  CHECK(SameBytes(ar.at(0), expect.at(0), (total - 1) * 2));
  CHECK(SameBytes(inplace_ar.at(0), expect.at(0), (total - 1) * 2));
  // The element past the all-reduce's count is untouched.
  CHECK(SameBytes(ar.at(total - 1), "\0\0", 2));
  CHECK(SameBytes(inplace_ar.at(total - 1), send.at(total - 1), 2));
}

TEST_CASE("Mpi: broadcast from every root", "[comm]") {
  auto comm = MakeComm();
  for (int root = 0; root < g_size; ++root) {
    Buf b = Input(DType::kF16, g_rank, 3000 + root, 777);
    REQUIRE(comm->Broadcast(b.at(0), 777, DType::kF16, root).ok());
    CHECK(b.bytes == Input(DType::kF16, root, 3000 + root, 777).bytes);
  }
  REQUIRE(comm->Barrier().ok());
}

TEST_CASE("Mpi: mismatched arguments fail on every rank naming both", "[comm]") {
  CommOptions options;
  options.check_args = true;
  options.timeout_ms = 20000;
  auto comm = MakeComm(options);
  std::vector<float> send(g_size * 20, 1.0f), recv(g_size * 20);
  const size_t count = g_rank == g_size - 1 ? 19 : 20;
  absl::Status s = comm->ReduceScatter(send.data(), recv.data(), count, DType::kF32,
                                       ReduceOp::kSum);
  INFO(s.ToString());
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(s.message(), "count=19"));
  CHECK(absl::StrContains(s.message(), "count=20"));
  // The communicator is still usable.
  REQUIRE(comm->AllReduce(send.data(), recv.data(), 20, DType::kF32, ReduceOp::kSum).ok());
  CHECK(recv[0] == static_cast<float>(g_size));
}

// A mismatch refused: InvalidArgument whose message names both ranks' differing arguments.
void CheckRefused(const absl::Status& s, const std::string& one, const std::string& other) {
  INFO(s.ToString());
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(s.message(), one));
  CHECK(absl::StrContains(s.message(), other));
}

// Without check_args (the release default): the MPI backend checks anyway, so a mismatch is an
// error naming both ranks' calls instead of unreduced or diverging data.
TEST_CASE("Mpi: mismatched counts, roots and dtypes are refused even without check_args",
          "[comm]") {
  CommOptions options;
  options.check_args = false;
  options.timeout_ms = 20000;
  auto comm = MakeComm(options);
  const int last = g_size - 1;
  const bool odd = g_rank == last;
  std::vector<float> send(g_size * 20, 1.0f), recv(g_size * 20, 0.0f);

  CheckRefused(comm->AllReduce(send.data(), recv.data(), odd ? 19 : 20, DType::kF32,
                               ReduceOp::kSum),
               "count=19", "count=20");
  CHECK(recv[0] == 0.0f);  // nothing was reduced

  const std::vector<float> before = send;
  CheckRefused(comm->Broadcast(send.data(), 20, DType::kF32, odd ? last : 0), "root=0",
               absl::StrCat("root=", last));
  CHECK(send == before);

  // Same byte count, different dtype: 20 fp32 against 40 bf16.
  CheckRefused(comm->AllGather(send.data(), recv.data(), odd ? 40 : 20,
                               odd ? DType::kBF16 : DType::kF32),
               "dtype=bf16", "dtype=fp32");

  // The communicator is still usable.
  REQUIRE(comm->AllReduce(send.data(), recv.data(), 20, DType::kF32, ReduceOp::kSum).ok());
  CHECK(recv[0] == static_cast<float>(g_size));
}

// Split at half the world (2 x 2 at world 4; at world 2, groups of one and one group of two):
// contiguous (color = rank / g) and strided (color = rank % (world / g)) sub-groups, each
// reducing over exactly its members in their new rank order.
TEST_CASE("Mpi: split sub-groups reduce over exactly their members", "[comm]") {
  auto comm = MakeComm();
  const int g = g_size / 2 > 0 ? g_size / 2 : 1;
  const int groups = g_size / g;
  const size_t count = 29;
  int test = 2000;
  for (bool contiguous : {true, false}) {
    for (DType t : {DType::kF32, DType::kBF16}) {
      ++test;
      auto color = [&](int r) { return contiguous ? r / g : r % groups; };
      std::vector<int> members;  // world ranks of this rank's group, by key = rank
      for (int q = 0; q < g_size; ++q) {
        if (color(q) == color(g_rank)) members.push_back(q);
      }
      auto sub = comm->Split(color(g_rank), g_rank);
      INFO("rank " << g_rank << (contiguous ? " contiguous" : " strided") << " "
                   << DTypeName(t) << ": " << sub.status());
      REQUIRE(sub.ok());
      Communicator& c = **sub;
      REQUIRE(c.backend() == "mpi");
      REQUIRE(c.size() == static_cast<int>(members.size()));
      REQUIRE(members[c.rank()] == g_rank);
      const size_t total = members.size() * count;
      Buf send = Input(t, g_rank, test, total), ar(t, total), rs(t, count), ag(t, total);
      REQUIRE(c.AllReduce(send.at(0), ar.at(0), total, t, ReduceOp::kSum).ok());
      REQUIRE(c.ReduceScatter(send.at(0), rs.at(0), count, t, ReduceOp::kSum).ok());
      REQUIRE(c.AllGather(send.at(0), ag.at(0), count, t).ok());
      for (size_t i = 0; i < total; ++i) {
        float acc = Input(t, members[0], test, total).get(i);
        for (size_t m = 1; m < members.size(); ++m) acc += Input(t, members[m], test, total).get(i);
        Buf expect(t, 1);
        expect.set(0, acc);
        REQUIRE(ar.get(i) == expect.get(0));
        if (i / count == static_cast<size_t>(c.rank())) REQUIRE(rs.get(i % count) == expect.get(0));
        REQUIRE(ag.get(i) == Input(t, members[i / count], test, total).get(i % count));
      }
    }
  }
}

TEST_CASE("Mpi: split keys reorder ranks, a negative color gets no communicator", "[comm]") {
  auto comm = MakeComm();
  // Even ranks in one group ranked in reverse; odd ranks opt out.
  auto sub = comm->Split(g_rank % 2 == 0 ? 0 : -1, -g_rank);
  INFO("rank " << g_rank << ": " << sub.status());
  REQUIRE(sub.ok());
  if (g_rank % 2 == 1) {
    CHECK(*sub == nullptr);
    return;
  }
  REQUIRE(*sub != nullptr);
  std::vector<int> evens;
  for (int q = g_size - 1; q >= 0; --q) {
    if (q % 2 == 0) evens.push_back(q);  // descending: by key = -rank
  }
  std::vector<float> seen(evens.size());
  const float mine = static_cast<float>(g_rank);
  REQUIRE((*sub)->AllGather(&mine, seen.data(), 1, DType::kF32).ok());
  CHECK(std::vector<int>(seen.begin(), seen.end()) == evens);
}

TEST_CASE("Mpi: a rank that never calls split makes the others time out naming it", "[comm]") {
  CommOptions options;
  options.timeout_ms = 300;
  auto comm = MakeComm(options);
  if (g_rank == g_size - 1) {
    // Late by far more than the timeout, and with another operation: its argument check
    // receives the others' split records (they abandoned theirs) and refuses the mismatch, so
    // nobody waits in MPI_Comm_split.
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    absl::Status late = comm->Barrier();
    INFO(late.ToString());
    CHECK(late.code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(late.message(), "split #1"));
    return;
  }
  auto sub = comm->Split(0, g_rank);
  INFO(sub.status().ToString());
  CHECK(sub.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(absl::StrContains(sub.status().message(), "split #1"));
  CHECK(absl::StrContains(sub.status().message(),
                          absl::StrCat("no message arrived from ranks [", g_size - 1, "]")));
  CHECK(comm->Barrier().code() == absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("Mpi: a rank that does not call makes the others time out", "[comm]") {
  CommOptions options;
  options.timeout_ms = 300;
  options.check_args = false;
  auto comm = MakeComm(options);
  if (g_rank == g_size - 1) {
    // Late by far more than the timeout; then completes the argument-check messages the
    // others abandoned, so their pending requests finish. The others never reach the barrier
    // itself, so this rank times out there in turn, with every peer's message received.
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    absl::Status late = comm->Barrier();
    INFO(late.ToString());
    CHECK(late.code() == absl::StatusCode::kDeadlineExceeded);
    CHECK(absl::StrContains(late.message(), "MPI_Ibarrier"));
    CHECK(!absl::StrContains(late.message(), "no message arrived"));
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status s = comm->Barrier();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(s.ToString());
  CHECK(s.code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(absl::StrContains(s.message(), "barrier #1"));
  CHECK(absl::StrContains(s.message(), "recent operations"));
  // Only the last rank is missing: it is named, and no other rank is.
  CHECK(absl::StrContains(s.message(), absl::StrCat("no message arrived from ranks [", g_size - 1,
                                                    "]")));
  CHECK(seconds >= 0.25);
  CHECK(seconds < 5.3);
  absl::Status again = comm->Barrier();
  CHECK(again.code() == absl::StatusCode::kFailedPrecondition);
}

// The last rank plays a peer that passes the argument check and then misbehaves, which the
// public API cannot do. It speaks comm/mpi.cc's wire format, copied here: a change there must
// change this copy (these tests fail otherwise).
struct WireRecord {
  internal::OpDesc desc;
  int32_t invalid = 0;
  int32_t pad = 0;
};
constexpr int kWireCheckTag = 100;
constexpr int kWireStuckTag = 101;

// The last rank's side of CreateMpiCommunicator: the same MPI_Comm_idup, with no communicator
// around it. Never freed, like the others' poisoned communicators.
MPI_Comm RogueDup() {
  MPI_Comm dup;
  MPI_Request req;
  REQUIRE(MPI_Comm_idup(MPI_COMM_WORLD, &dup, &req) == MPI_SUCCESS);
  REQUIRE(MPI_Wait(&req, MPI_STATUS_IGNORE) == MPI_SUCCESS);
  return dup;
}

// Exchanges argument-check records with every other rank as the MPI backend does, claiming
// `d`, and checks that the peers called the same operation.
void RogueCheck(MPI_Comm c, const internal::OpDesc& d) {
  WireRecord mine;
  mine.desc = d;
  std::vector<WireRecord> theirs(g_size);
  std::vector<MPI_Request> reqs(2 * g_size, MPI_REQUEST_NULL);
  for (int q = 0; q < g_size; ++q) {
    if (q == g_rank) continue;
    MPI_Irecv(&theirs[q], sizeof(WireRecord), MPI_BYTE, q, kWireCheckTag, c, &reqs[2 * q]);
    MPI_Isend(&mine, sizeof(WireRecord), MPI_BYTE, q, kWireCheckTag, c, &reqs[2 * q + 1]);
  }
  REQUIRE(MPI_Waitall(2 * g_size, reqs.data(), MPI_STATUSES_IGNORE) == MPI_SUCCESS);
  for (int q = 0; q < g_size; ++q) {
    if (q == g_rank) continue;
    CHECK(theirs[q].desc.seq == d.seq);
    CHECK(theirs[q].desc.kind == d.kind);
  }
}

// The received-size check behind the argument check: a peer whose data message is shorter or
// longer than the block it owes (a peer built with a different protocol, or memory corrupted)
// is an error naming it, and nothing is reduced.
TEST_CASE("Mpi: a peer sending a block of the wrong size is refused and nothing is reduced",
          "[comm]") {
  const int last = g_size - 1;
  const size_t count = 20;  // fp32: a block of 80 bytes
  for (int extra : {-4, 4}) {
    if (g_rank == last) {
      MPI_Comm c = RogueDup();
      RogueCheck(c, internal::MakeOpDesc(1, internal::OpKind::kReduceScatter, count,
                                         DType::kF32, ReduceOp::kSum, 0));
      // Receive every peer's block for us; send every peer a block `extra` bytes off.
      std::vector<float> in(g_size * count), out(count + 1, 1.0f);
      std::vector<MPI_Request> reqs(2 * g_size, MPI_REQUEST_NULL);
      const int tag = static_cast<int>(internal::OpKind::kReduceScatter);
      for (int q = 0; q < last; ++q) {
        MPI_Irecv(&in[q * count], count * 4, MPI_BYTE, q, tag, c, &reqs[2 * q]);
        MPI_Isend(out.data(), count * 4 + extra, MPI_BYTE, q, tag, c, &reqs[2 * q + 1]);
      }
      REQUIRE(MPI_Waitall(2 * g_size, reqs.data(), MPI_STATUSES_IGNORE) == MPI_SUCCESS);
      continue;
    }
    CommOptions options;
    options.timeout_ms = 20000;
    auto comm = MakeComm(options);
    std::vector<float> send(g_size * count, 1.0f), recv(count, -7.0f);
    absl::Status s =
        comm->ReduceScatter(send.data(), recv.data(), count, DType::kF32, ReduceOp::kSum);
    INFO(s.ToString());
    CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(s.message(), absl::StrCat("rank ", last, " sent ",
                                                      extra < 0 ? "76" : "more than 80",
                                                      " bytes where 80 were expected")));
    CHECK(absl::StrContains(s.message(), "reduce_scatter #1"));
    CHECK(recv == std::vector<float>(count, -7.0f));
    CHECK(comm->Barrier().code() == absl::StatusCode::kFailedPrecondition);
  }
}

// A rank that passed the argument check but never enters the collective itself (stopped,
// or stuck in other code): the collective's requests cannot say who is late, so the ranks
// that time out tell each other, and the one that never does is named.
TEST_CASE("Mpi: a collective's timeout names the rank that never entered it", "[comm]") {
  const int last = g_size - 1;
  if (g_rank == last) {
    MPI_Comm c = RogueDup();
    RogueCheck(c, internal::MakeOpDesc(1, internal::OpKind::kBarrier, 0, DType::kF32,
                                       ReduceOp::kSum, 0));
    // Every other rank times out in the barrier and says so.
    for (int q = 0; q < last; ++q) {
      int64_t seq = 0;
      REQUIRE(MPI_Recv(&seq, 1, MPI_INT64_T, q, kWireStuckTag, c, MPI_STATUS_IGNORE) ==
              MPI_SUCCESS);
      CHECK(seq == 1);
    }
    // Completes the barrier the others left pending (they progress it in later MPI calls).
    MPI_Request req;
    REQUIRE(MPI_Ibarrier(c, &req) == MPI_SUCCESS);
    REQUIRE(MPI_Wait(&req, MPI_STATUS_IGNORE) == MPI_SUCCESS);
    // The others are still waiting for this rank's word; the next test must start together.
    MPI_Barrier(MPI_COMM_WORLD);
    return;
  }
  CommOptions options;
  // Also how long a rank waits for the others' notices: ample for their deadlines' skew.
  options.timeout_ms = 1500;
  auto comm = MakeComm(options);
  absl::Status s = comm->Barrier();
  INFO(s.ToString());
  CHECK(s.code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(absl::StrContains(s.message(), "barrier #1"));
  CHECK(absl::StrContains(s.message(), "MPI_Ibarrier"));
  CHECK(absl::StrContains(s.message(), absl::StrCat("waiting for ranks [", last, "]")));
  std::vector<std::string> others;
  for (int q = 0; q < last; ++q) others.push_back(std::to_string(q));
  CHECK(absl::StrContains(s.message(),
                          absl::StrCat("ranks [", absl::StrJoin(others, ","), "] timed out")));
  CHECK(comm->Barrier().code() == absl::StatusCode::kFailedPrecondition);
  MPI_Barrier(MPI_COMM_WORLD);
}

// Last: the ranks that time out leave their MPI_Comm_idup pending, and it completes only when
// the late rank joins.
TEST_CASE("Mpi: creating a communicator times out when a rank does not join", "[comm]") {
  CommOptions options;
  options.setup_timeout_ms = 300;
  if (g_rank == g_size - 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    options.setup_timeout_ms = 60000;
    auto late = CreateMpiCommunicator(MPI_COMM_WORLD, options);
    CHECK(late.ok());
    return;
  }
  auto c = CreateMpiCommunicator(MPI_COMM_WORLD, options);
  INFO(c.status().ToString());
  CHECK(c.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(absl::StrContains(c.status().message(), absl::StrCat("world rank ", g_rank)));
  CHECK(absl::StrContains(c.status().message(), "MPI_Comm_idup"));
  CHECK(absl::StrContains(c.status().message(), "setup_timeout_ms=300"));
}

}  // namespace
}  // namespace comm
}  // namespace zerort

int main(int argc, char** argv) {
  auto session = zerort::comm::MpiSession::Init(&argc, &argv);
  if (!session.ok()) {
    std::fprintf(stderr, "%s\n", session.status().ToString().c_str());
    return 1;
  }
  zerort::comm::g_rank = (*session)->world_rank();
  zerort::comm::g_size = (*session)->world_size();
  const int failed = Catch::Session().run(argc, argv);
  // Let every rank finish its checks before MPI_Finalize.
  MPI_Barrier(MPI_COMM_WORLD);
  return failed == 0 ? 0 : 1;
}
