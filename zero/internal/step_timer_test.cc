#include "zero/internal/step_timer.h"

#include <catch2/catch.hpp>

namespace zerort {
namespace zero_internal {
namespace {

TEST_CASE("StepTimer: counts (n-1)/n of each pass's buffer and restarts on Reset", "[zero]") {
  const int world = 4;
  StepTimer timer(world, 2);
  timer.Sent(100, 1);  // a reduce-scatter of 4 blocks of 100 bf16: sends 3 of them
  timer.Sent(10, 2);   // an all-reduce of 4 x 10: two passes
  const int64_t buffer_bytes[] = {world * 100 * 2, world * 10 * 2};
  const int64_t expected = buffer_bytes[0] * (world - 1) / world +
                           2 * buffer_bytes[1] * (world - 1) / world;
  REQUIRE(timer.window().comm_bytes == expected);
  timer.AddReduceMs(1.5);
  timer.AddReduceMs(2.0);
  timer.AddGatherMs(0.25);
  REQUIRE(timer.window().reduce_ms == 3.5);
  REQUIRE(timer.window().gather_ms == 0.25);
  timer.Reset();
  REQUIRE(timer.window().comm_bytes == 0);
  REQUIRE(timer.window().reduce_ms == 0);
  REQUIRE(timer.window().gather_ms == 0);
  StepTimer alone(1, 4);
  alone.Sent(1000, 2);
  REQUIRE(alone.window().comm_bytes == 0);  // one rank sends nothing
}

TEST_CASE("Stopwatch: measures at least the time slept", "[zero]") {
  const Stopwatch t;
  const auto start = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - start < std::chrono::milliseconds(2)) {
  }
  REQUIRE(t.ElapsedMs() >= 2.0);
}

}  // namespace
}  // namespace zero_internal
}  // namespace zerort
