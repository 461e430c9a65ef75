// Communicator::Split on the in-process group: sub-groups as MPI_Comm_split forms them, whose
// collectives reduce over exactly their members (checked against a serial reduction in the
// sub-group's rank order), running concurrently.
#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "comm/inprocess.h"
#include "comm/testing/typed_buffer.h"

namespace zerort {
namespace comm {
namespace {

using testing::Buf;
using Comms = std::vector<std::unique_ptr<Communicator>>;

Comms MakeGroup(int n, CommOptions options = {}) {
  auto comms = CreateInProcessGroup(n, options);
  REQUIRE(comms.ok());
  return std::move(comms).value();
}

// Runs fn(rank) on one thread per rank and joins them all.
template <typename Fn>
void RunRanks(int n, Fn fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back(fn, r);
  for (auto& t : threads) t.join();
}

// x rounded to t, as a buffer of t stores it.
float RoundTo(DType t, float x) {
  Buf b(t, 1);
  b.set(0, x);
  return b.get(0);
}

// Element i of world rank w's input: distinct per rank, so data from another group shows.
float Input(int w, size_t i) { return static_cast<float>((w + 1) * 1000) + 0.25f * (i % 97); }

// What one rank of a sub-group saw: its place, and the results of its collectives.
struct RankResult {
  absl::Status status;
  int sub_rank = -1;
  int sub_size = -1;
  std::vector<Buf> outs;  // all-reduce (G*count), reduce-scatter (count), all-gather (G*count)
};

// Split by color, then on the sub-group: AllReduce and ReduceScatter of the rank's input
// (G * count elements), AllGather of its first `count`.
absl::Status RunSubGroup(Communicator* parent, int color, int key, DType t, ReduceOp op,
                         size_t count, RankResult* out) {
  auto sub = parent->Split(color, key);
  if (!sub.ok()) return sub.status();
  Communicator& c = **sub;
  out->sub_rank = c.rank();
  out->sub_size = c.size();
  const size_t g = static_cast<size_t>(c.size());
  Buf in(t, g * count);
  for (size_t i = 0; i < in.count(); ++i) in.set(i, Input(parent->rank(), i));
  out->outs = {Buf(t, g * count), Buf(t, count), Buf(t, g * count)};
  if (absl::Status s = c.AllReduce(in.data(), out->outs[0].data(), g * count, t, op); !s.ok()) {
    return s;
  }
  if (absl::Status s = c.ReduceScatter(in.data(), out->outs[1].data(), count, t, op); !s.ok()) {
    return s;
  }
  return c.AllGather(in.data(), out->outs[2].data(), count, t);
}

// The serial reference over `members` (world ranks, in sub-group rank order): fp32 in that
// order, one rounding to t.
float Serial(const std::vector<int>& members, size_t i, DType t, ReduceOp op) {
  float acc = RoundTo(t, Input(members[0], i));
  for (size_t m = 1; m < members.size(); ++m) acc += RoundTo(t, Input(members[m], i));
  if (op == ReduceOp::kAvg) acc /= static_cast<float>(members.size());
  return RoundTo(t, acc);
}

// World `world` cut into groups of `g`, contiguous (color = rank / g, the shard groups of a
// 2-D mesh) or strided (color = rank % (world / g), its replica groups).
void CheckLayout(int world, int g, bool contiguous, DType t, ReduceOp op) {
  const int groups = world / g;
  const size_t count = 37;  // not a multiple of any group size: uneven all-reduce slices
  Comms comms = MakeGroup(world);
  std::vector<RankResult> results(world);
  RunRanks(world, [&](int w) {
    const int color = contiguous ? w / g : w % groups;
    results[w].status = RunSubGroup(comms[w].get(), color, w, t, op, count, &results[w]);
  });
  for (int w = 0; w < world; ++w) {
    INFO("world " << world << " groups of " << g << (contiguous ? " contiguous" : " strided")
                  << ", rank " << w << ", dtype " << DTypeName(t) << ", op " << ReduceOpName(op));
    const RankResult& r = results[w];
    REQUIRE(r.status.ok());
    // Members of w's group in new rank order: by key (= world rank), so ascending.
    std::vector<int> members;
    for (int q = 0; q < world; ++q) {
      if ((contiguous ? q / g : q % groups) == (contiguous ? w / g : w % groups)) {
        members.push_back(q);
      }
    }
    REQUIRE(r.sub_size == g);
    REQUIRE(r.sub_rank == (contiguous ? w % g : w / groups));
    for (size_t i = 0; i < g * count; ++i) {
      REQUIRE(r.outs[0].get(i) == Serial(members, i, t, op));
      // Block j of the all-gather is sub-rank j's first `count` inputs.
      REQUIRE(r.outs[2].get(i) == RoundTo(t, Input(members[i / count], i % count)));
    }
    for (size_t i = 0; i < count; ++i) {
      REQUIRE(r.outs[1].get(i) == Serial(members, r.sub_rank * count + i, t, op));
    }
  }
}

TEST_CASE("Split: world 4 as 2 x 2 both ways and world 8 as 4 x 2 and 2 x 4 reduce over "
          "exactly each group",
          "[comm]") {
  for (DType t : {DType::kF32, DType::kBF16}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
      for (bool contiguous : {true, false}) {
        CheckLayout(4, 2, contiguous, t, op);
        CheckLayout(8, 4, contiguous, t, op);
        CheckLayout(8, 2, contiguous, t, op);
      }
    }
  }
}

// The world ranks of a sub-group, in its rank order, through an all-gather of each one's.
std::vector<int> GatherRanks(Communicator& sub, int world_rank, absl::Status* status) {
  std::vector<float> all(sub.size());
  const float mine = static_cast<float>(world_rank);
  *status = sub.AllGather(&mine, all.data(), 1, DType::kF32);
  return std::vector<int>(all.begin(), all.end());
}

TEST_CASE("Split: keys order the new ranks, ties keep the old order, and the sub-group "
          "outlives its parent",
          "[comm]") {
  struct Case {
    const char* name;
    int (*key)(int rank);
    std::vector<int> order;  // world ranks by new rank
  };
  const Case cases[] = {
      {"reversed", [](int r) { return 3 - r; }, {3, 2, 1, 0}},
      {"ties", [](int r) { return r % 2; }, {0, 2, 1, 3}},
      {"equal", [](int) { return 7; }, {0, 1, 2, 3}},
  };
  for (const Case& c : cases) {
    INFO(c.name);
    Comms comms = MakeGroup(4);
    std::vector<absl::Status> st(4);
    std::vector<std::vector<int>> seen(4);
    std::vector<int> sub_rank(4, -1);
    RunRanks(4, [&](int w) {
      auto sub = comms[w]->Split(/*color=*/0, c.key(w));
      st[w] = sub.status();
      if (!sub.ok()) return;
      comms[w].reset();  // the parent goes first
      sub_rank[w] = (*sub)->rank();
      seen[w] = GatherRanks(**sub, w, &st[w]);
    });
    for (int w = 0; w < 4; ++w) {
      INFO("rank " << w << ": " << st[w]);
      REQUIRE(st[w].ok());
      CHECK(seen[w] == c.order);
      CHECK(c.order[sub_rank[w]] == w);
    }
  }
}

TEST_CASE("Split: a negative color joins no group; a sub-group splits again", "[comm]") {
  Comms comms = MakeGroup(8);
  std::vector<absl::Status> st(8);
  std::vector<bool> got(8, false);
  std::vector<std::vector<int>> seen(8);
  RunRanks(8, [&](int w) {
    // Ranks 1, 3, 5, 7 opt out (MPI_UNDEFINED's role); 0, 2, 4, 6 split again into pairs.
    auto sub = comms[w]->Split(w % 2 == 0 ? 5 : -32766, w);
    st[w] = sub.status();
    if (!sub.ok() || *sub == nullptr) return;
    got[w] = true;
    auto pair = (*sub)->Split((*sub)->rank() / 2, 0);
    st[w] = pair.status();
    if (!pair.ok()) return;
    seen[w] = GatherRanks(**pair, w, &st[w]);
  });
  for (int w = 0; w < 8; ++w) {
    INFO("rank " << w << ": " << st[w]);
    REQUIRE(st[w].ok());
    CHECK(got[w] == (w % 2 == 0));
    if (w % 2 == 0) CHECK(seen[w] == (w < 4 ? std::vector<int>{0, 2} : std::vector<int>{4, 6}));
  }
}

// The ranks listed after "missing ranks [" in an error message.
std::vector<std::string> MissingRanks(absl::string_view message) {
  const size_t begin = message.find("missing ranks [");
  if (begin == absl::string_view::npos) return {};
  const size_t from = begin + std::strlen("missing ranks [");
  const absl::string_view list = message.substr(from, message.find(']', from) - from);
  return absl::StrSplit(list, ',');
}

TEST_CASE("Split: a rank that never calls makes the others time out naming the split and it",
          "[comm]") {
  CommOptions options;
  options.timeout_ms = 500;  // only the bound of the wait; nothing is timed
  Comms comms = MakeGroup(4, options);
  std::vector<absl::Status> st(4);
  RunRanks(3, [&](int w) { st[w] = comms[w]->Split(w % 2, w).status(); });
  int timed_out = 0;
  for (int w = 0; w < 3; ++w) {
    INFO(st[w]);
    // A rank descheduled past the deadline arrives at a group already poisoned by the timeout.
    CHECK((st[w].code() == absl::StatusCode::kDeadlineExceeded ||
           st[w].code() == absl::StatusCode::kFailedPrecondition));
    timed_out += st[w].code() == absl::StatusCode::kDeadlineExceeded;
    CHECK(absl::StrContains(st[w].message(), "split #1"));
    const std::vector<std::string> missing = MissingRanks(st[w].message());
    CHECK(std::count(missing.begin(), missing.end(), "3") == 1);
  }
  CHECK(timed_out >= 1);
  // The group is poisoned: a later call fails at once instead of waiting again.
  CHECK(comms[0]->Barrier().code() == absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("Split: a rank calling another operation fails the split on every rank", "[comm]") {
  CommOptions options;
  options.timeout_ms = 60000;  // must fail long before this
  Comms comms = MakeGroup(2, options);
  std::vector<absl::Status> st(2);
  RunRanks(2, [&](int w) {
    st[w] = w == 0 ? comms[w]->Split(0, 0).status() : comms[w]->Barrier();
  });
  for (const absl::Status& s : st) {
    INFO(s);
    CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(s.message(), "rank 0 called split #1"));
    CHECK(absl::StrContains(s.message(), "rank 1 called barrier #1"));
  }
}

}  // namespace
}  // namespace comm
}  // namespace zerort
