#include "offload/thread_pool.h"

#include <atomic>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

namespace zerort {
namespace offload {
namespace {

TEST_CASE("ThreadPool: every task runs exactly once, call after call", "[offload]") {
  ThreadPool pool(4);
  CHECK(pool.num_threads() == 4);
  for (int round = 0; round < 200; ++round) {
    const int tasks = 1 + round % 13;
    std::vector<std::atomic<int>> runs(tasks);
    pool.ParallelFor(tasks, [&](int t) { runs[t].fetch_add(1); });
    for (int t = 0; t < tasks; ++t) REQUIRE(runs[t].load() == 1);
  }
  pool.ParallelFor(0, [](int) { FAIL("no task expected"); });
}

TEST_CASE("ThreadPool: work is spread over more than one thread", "[offload]") {
  ThreadPool pool(3);
  std::atomic<int> arrived{0};
  std::set<std::thread::id> ids;
  std::mutex mu;
  // Each task waits until all three have started: only possible if three threads run them.
  pool.ParallelFor(3, [&](int) {
    arrived.fetch_add(1);
    while (arrived.load() < 3) std::this_thread::yield();
    std::lock_guard<std::mutex> lock(mu);
    ids.insert(std::this_thread::get_id());
  });
  CHECK(ids.size() == 3);
}

TEST_CASE("ThreadPool: concurrent callers are serialised, none loses a task", "[offload]") {
  ThreadPool pool(3);
  std::atomic<long> sum{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&] {
      for (int i = 0; i < 100; ++i) pool.ParallelFor(5, [&](int t) { sum.fetch_add(t + 1); });
    });
  }
  for (auto& t : callers) t.join();
  CHECK(sum.load() == 4L * 100 * 15);
}

}  // namespace
}  // namespace offload
}  // namespace zerort
