#include "comm/agree.h"

#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "comm/inprocess.h"

namespace zerort {
namespace comm {
namespace {

// Runs fn(rank, exchange) on `world` in-process ranks, one thread each; returns per-rank results.
template <typename T, typename Fn>
std::vector<T> OnRanks(int world, Fn fn) {
  auto comms = CreateInProcessGroup(world).value();
  std::vector<T> out(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      DirectHostExchange exchange(comms[r].get());
      out[r] = fn(r, exchange);
    });
  }
  for (std::thread& t : threads) t.join();
  return out;
}

// Values whose 16-bit words are NaN, infinity and subnormal bit patterns as bf16: a float
// conversion anywhere on the way would change them.
uint64_t Value(int rank, int i) {
  const uint64_t patterns[] = {0xFFFFFFFFFFFFFFFFull, 0x7FC17F817F80FF80ull, 0x0001000000018000ull,
                               0x123456789ABCDEF0ull};
  return patterns[(rank + i) % 4] ^ (static_cast<uint64_t>(rank) << 40) ^ static_cast<uint64_t>(i);
}

TEST_CASE("Agree: AllGatherU64 delivers every rank's integers bit for bit", "[comm]") {
  for (int world : {1, 2, 3, 5}) {
    const int k = 3;
    auto got = OnRanks<std::vector<uint64_t>>(world, [&](int r, HostExchange& ex) {
      std::vector<uint64_t> mine;
      for (int i = 0; i < k; ++i) mine.push_back(Value(r, i));
      return AllGatherU64(ex, mine).value_or(std::vector<uint64_t>());
    });
    for (int r = 0; r < world; ++r) {
      REQUIRE(got[r].size() == static_cast<size_t>(k * world));
      for (int q = 0; q < world; ++q) {
        for (int i = 0; i < k; ++i) REQUIRE(got[r][q * k + i] == Value(q, i));
      }
    }
  }
}

TEST_CASE("Agree: BroadcastBytes carries root's bytes, NULs, high bytes and odd lengths",
          "[comm]") {
  const int world = 3;
  for (size_t n : {size_t{0}, size_t{1}, size_t{2}, size_t{7}, size_t{3000}}) {
    std::string expected;
    for (size_t i = 0; i < n; ++i) expected.push_back(static_cast<char>((i * 37 + n) % 256));
    for (int root = 0; root < world; ++root) {
      auto got = OnRanks<std::string>(world, [&](int r, HostExchange& ex) {
        // The others start with text of another length, which must be replaced.
        std::string bytes = r == root ? expected : std::string(r + 5, 'x');
        const absl::Status s = BroadcastBytes(ex, &bytes, root);  // checked on the main thread
        return s.ok() ? bytes : s.ToString();
      });
      for (int r = 0; r < world; ++r) REQUIRE(got[r] == expected);
    }
  }
}

TEST_CASE("Agree: AgreeOnStatus returns the lowest failing rank's status on every rank",
          "[comm]") {
  const int world = 4;
  auto local = [](int r) {
    if (r == 1) return absl::NotFoundError("shard 1 is missing");
    if (r == 3) return absl::DataLossError("shard 3 is corrupt");
    return absl::OkStatus();
  };
  auto got = OnRanks<absl::Status>(
      world, [&](int r, HostExchange& ex) { return AgreeOnStatus(ex, local(r)); });
  for (int r = 0; r < world; ++r) {
    INFO("rank " << r << ": " << got[r]);
    REQUIRE(got[r].code() == local(1).code());
    const std::string expected =
        r == 1 ? std::string(local(1).message()) : absl::StrCat("on rank 1: ", local(1).message());
    REQUIRE(std::string(got[r].message()) == expected);
  }
  auto ok = OnRanks<absl::Status>(
      world, [](int, HostExchange& ex) { return AgreeOnStatus(ex, absl::OkStatus()); });
  for (const absl::Status& s : ok) REQUIRE(s.ok());
}

}  // namespace
}  // namespace comm
}  // namespace zerort
