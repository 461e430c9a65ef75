// CountLinkBytes on the in-process group at world 8: every collective's bytes, written out by
// hand from the convention in comm/link_bytes.h, land in the right link class, on split groups
// too, while the data still arrives.
#include "comm/link_bytes.h"

#include <catch2/catch.hpp>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "comm/testing/on_ranks.h"

namespace zerort {
namespace comm {
namespace {

struct Seen {
  LinkBytes total;
  std::map<std::string, LinkByteLog::Entry> entries;
  std::vector<float> pair_gather;  // the pair split's all-gather
};

// One fixed sequence of collectives on world 8, `per_node` ranks per node.
std::vector<Seen> RunSequence(int per_node) {
  std::vector<Seen> seen(8);
  std::vector<absl::Status> st = testing::OnRanks(8, {}, [&](int r, Communicator* world) {
    LinkByteLog log;
    ASSIGN_OR_RETURN(std::unique_ptr<Communicator> c, CountLinkBytes(world, per_node, &log));
    std::vector<uint16_t> h(80, 0);
    std::vector<float> f(80, static_cast<float>(r));
    RETURN_IF_ERROR(c->AllGather(h.data(), h.data() + 40, 5, DType::kBF16));  // 7*5*2
    RETURN_IF_ERROR(c->Broadcast(h.data(), 10, DType::kBF16, 0));             // 10*2
    RETURN_IF_ERROR(c->AllGather(h.data(), h.data() + 40, 0, DType::kBF16));  // nothing
    // Pairs {1,0}, {3,2}, ...: key -rank reverses the order within the pair.
    ASSIGN_OR_RETURN(std::unique_ptr<Communicator> pair, c->Split(r / 2, -r));
    std::vector<float> mine(3, static_cast<float>(r)), both(6);
    RETURN_IF_ERROR(pair->AllGather(mine.data(), both.data(), 3, DType::kF32));  // 1*3*4
    RETURN_IF_ERROR(pair->AllReduce(f.data(), f.data(), 8, DType::kF32, ReduceOp::kSum));
    // 2*1*8*4/2 = 32
    // Same position in the pair: {0,2,4,6} and {1,3,5,7}.
    ASSIGN_OR_RETURN(std::unique_ptr<Communicator> strided, c->Split(r % 2, r));
    RETURN_IF_ERROR(strided->ReduceScatter(h.data(), h.data() + 60, 6, DType::kBF16,
                                           ReduceOp::kSum));  // 3*6*2
    // Groups of 4: a reduce-scatter in {0..3} or {4..7} (3*2*4) and an all-reduce across the
    // two groups' same-position ranks (2*1*2*4/2).
    RETURN_IF_ERROR(
        c->ReduceScatterInGroups(f.data(), f.data() + 40, 2, DType::kF32, ReduceOp::kSum, 4));
    seen[r].total = log.Total();
    seen[r].entries = log.Entries();
    seen[r].pair_gather = both;
    return absl::OkStatus();
  });
  for (int r = 0; r < 8; ++r) {
    INFO("rank " << r << ": " << st[r].ToString());
    REQUIRE(st[r].ok());
  }
  return seen;
}

TEST_CASE("CountLinkBytes: bytes sent per collective, by link class, on split groups", "[comm]") {
  const int64_t world_gather = 70, broadcast = 20, pair_gather = 12, pair_reduce = 32,
                strided_scatter = 36, group_scatter = 24, across_reduce = 8;
  SECTION("2 ranks per node: pairs within the node, groups of 4 across two nodes") {
    for (const Seen& s : RunSequence(2)) {
      CHECK(s.total.intra_node == pair_gather + pair_reduce);
      CHECK(s.total.inter_node ==
            world_gather + broadcast + strided_scatter + group_scatter + across_reduce);
    }
  }
  SECTION("4 ranks per node: groups of 4 within the node") {
    const std::vector<Seen> seen = RunSequence(4);
    for (const Seen& s : seen) {
      CHECK(s.total.intra_node == pair_gather + pair_reduce + group_scatter);
      CHECK(s.total.inter_node == world_gather + broadcast + strided_scatter + across_reduce);
    }
    // Membership as the backend built it: the pair in key order, the strided group, the
    // grouped reduction's two halves.
    const auto& e5 = seen[5].entries;
    CHECK(e5.at("all_gather over ranks 5,4").bytes == pair_gather);
    CHECK(!e5.at("all_gather over ranks 5,4").inter_node);
    CHECK(e5.at("reduce_scatter over ranks 1,3,5,7").inter_node);
    CHECK(e5.at("reduce_scatter (in groups) over ranks 4,5,6,7").bytes == group_scatter);
    CHECK(e5.at("all_reduce (across groups) over ranks 1,5").bytes == across_reduce);
    CHECK(e5.at("all_gather over ranks 0,1,2,3,4,5,6,7").calls == 1);  // count 0 not counted
    // Forwarded: rank 5's pair gather holds rank 5's block, then rank 4's.
    CHECK(seen[5].pair_gather == std::vector<float>{5, 5, 5, 4, 4, 4});
  }
}

TEST_CASE("CountLinkBytes: ranks_per_node must divide the world", "[comm]") {
  std::vector<absl::Status> st = testing::OnRanks(4, {}, [&](int, Communicator* world) {
    LinkByteLog log;
    return CountLinkBytes(world, 3, &log).status();
  });
  CHECK(st[0].code() == absl::StatusCode::kInvalidArgument);
  CHECK(st[0].message().find("ranks_per_node 3") != absl::string_view::npos);
}

}  // namespace
}  // namespace comm
}  // namespace zerort
