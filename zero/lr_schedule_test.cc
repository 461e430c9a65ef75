#include "zero/lr_schedule.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <functional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "zero/config.h"

namespace zerort {
namespace {

// The expected rates below are each schedule's closed form, written out here from DeepSpeed's
// documented shapes (and in another form where one exists), not calls into lr_schedule.cc.
// Step s is the optimizer step counted from 0; DeepSpeed's scheduler is then at iteration s - 1.

SchedulerConfig Parsed(const std::string& scheduler_json) {
  absl::StatusOr<Config> c = ParseConfig(absl::StrCat(R"({"scheduler": )", scheduler_json, "}"));
  INFO(c.status().ToString());
  REQUIRE(c.ok());
  return c->scheduler;
}

void CheckAgainst(const LrSchedule& schedule, int64_t last_step,
                  const std::function<double(int64_t)>& expected) {
  for (int64_t s = 0; s <= last_step; ++s) {
    INFO("step " << s);
    CHECK(schedule.LrAt(s) == Approx(expected(s)).epsilon(1e-12).margin(1e-15));
  }
}

// No jump between consecutive steps larger than `bound`: the phases meet.
void CheckContinuous(const LrSchedule& schedule, int64_t from, int64_t to, double bound) {
  for (int64_t s = from; s < to; ++s) {
    INFO("step " << s);
    CHECK(std::abs(schedule.LrAt(s + 1) - schedule.LrAt(s)) <= bound);
  }
}

TEST_CASE("LrSchedule: no scheduler is the optimizer's constant rate", "[zero]") {
  LrSchedule schedule(SchedulerConfig{}, 3e-4);
  CHECK(schedule.LrAt(0) == 3e-4);
  CHECK(schedule.LrAt(123456) == 3e-4);
}

TEST_CASE("LrSchedule: WarmupLR warms up logarithmically or linearly, then holds", "[zero]") {
  LrSchedule log_warmup(Parsed(R"({"type": "WarmupLR", "params": {"warmup_min_lr": 0.01,
      "warmup_max_lr": 0.1, "warmup_num_steps": 100}})"),
                        1.0);
  // log(s) / log(100) = log10(s) / 2.
  CheckAgainst(log_warmup, 300, [](int64_t s) {
    if (s == 0) return 0.01;
    return s <= 100 ? 0.01 + 0.09 * std::log10(static_cast<double>(s)) / 2.0 : 0.1;
  });
  CHECK(log_warmup.LrAt(100) == Approx(0.1));  // the warmup's last step reaches the maximum
  CheckContinuous(log_warmup, 50, 150, 0.09 * std::log10(51.0 / 50.0) / 2.0 + 1e-12);

  LrSchedule linear(Parsed(R"({"type": "WarmupLR", "params": {"warmup_min_lr": 0,
      "warmup_max_lr": 0.5, "warmup_num_steps": 50, "warmup_type": "linear"}})"),
                    1.0);
  CheckAgainst(linear, 200, [](int64_t s) {
    return s == 0 ? 0.0 : s <= 50 ? 0.5 * static_cast<double>(s - 1) / 50.0 : 0.5;
  });
  CheckContinuous(linear, 0, 200, 0.5 / 50 + 1e-12);
}

TEST_CASE("LrSchedule: WarmupDecayLR decays linearly to 0 at total_num_steps", "[zero]") {
  LrSchedule schedule(Parsed(R"({"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0,
      "warmup_max_lr": 1.0, "warmup_num_steps": 10, "total_num_steps": 110,
      "warmup_type": "linear"}})"),
                      1.0);
  CheckAgainst(schedule, 300, [](int64_t s) {
    if (s == 0) return 0.0;
    if (s <= 10) return static_cast<double>(s - 1) / 10.0;
    return std::max(0.0, static_cast<double>(111 - s) / 100.0);
  });
  CHECK(schedule.LrAt(11) == 1.0);
  CHECK(schedule.LrAt(111) == 0.0);
  CheckContinuous(schedule, 0, 300, 0.1 + 1e-12);  // warmup steps are the largest
  CheckContinuous(schedule, 11, 300, 0.01 + 1e-12);
}

TEST_CASE("LrSchedule: WarmupCosineLR scales the optimizer's rate by the ratios", "[zero]") {
  LrSchedule schedule(Parsed(R"({"type": "WarmupCosineLR", "params": {"total_num_steps": 110,
      "warmup_num_steps": 10, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01,
      "warmup_type": "linear"}})"),
                      0.5);
  // (1 + cos(pi x)) / 2 = cos^2(pi x / 2).
  CheckAgainst(schedule, 110, [](int64_t s) {
    if (s == 0) return 0.0;
    if (s <= 10) return 0.5 * (0.1 + 0.9 * static_cast<double>(s - 1) / 10.0);
    const double c = std::cos(M_PI * static_cast<double>(s - 10) / 200.0);
    return 0.5 * (0.01 + 0.99 * c * c);
  });
  CHECK(schedule.LrAt(110) == Approx(0.5 * 0.01));
  CheckContinuous(schedule, 1, 110, 0.5 * 0.09 + 1e-12);
}

TEST_CASE("LrSchedule: OneCycle rises, falls, then decays; LRRangeTest grows", "[zero]") {
  LrSchedule cycle(Parsed(R"({"type": "OneCycle", "params": {"cycle_min_lr": 0.1,
      "cycle_max_lr": 1.0, "cycle_first_step_size": 10, "cycle_second_step_size": 20,
      "decay_step_size": 5, "decay_lr_rate": 0.5, "cycle_momentum": true}})"),
                  1.0);
  CheckAgainst(cycle, 100, [](int64_t s) {
    const double x = static_cast<double>(s);
    if (s <= 10) return 0.1 + 0.9 * x / 10.0;
    if (s <= 30) return 1.0 - 0.9 * (x - 10.0) / 20.0;
    return 0.1 / (1.0 + 0.5 * (x - 30.0) / 5.0);
  });
  CHECK(cycle.LrAt(10) == Approx(1.0));
  CheckContinuous(cycle, 0, 100, 0.09 + 1e-12);
  // Without decay_step_size the rate stays at the minimum after the cycle.
  LrSchedule flat(Parsed(R"({"type": "OneCycle", "params": {"cycle_min_lr": 0.1,
      "cycle_max_lr": 1.0, "cycle_first_step_size": 4}})"),
                  1.0);
  CHECK(flat.LrAt(4) == Approx(1.0));
  CHECK(flat.LrAt(8) == Approx(0.1));
  CHECK(flat.LrAt(1000) == Approx(0.1));

  LrSchedule range(Parsed(R"({"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 1e-3,
      "lr_range_test_step_size": 100, "lr_range_test_step_rate": 2.0}})"),
                   1.0);
  CheckAgainst(range, 500, [](int64_t s) {
    return s == 0 ? 1e-3 : 1e-3 * (1.0 + 2.0 * static_cast<double>(s - 1) / 100.0);
  });
  LrSchedule stairs(Parsed(R"({"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 1e-3,
      "lr_range_test_step_size": 100, "lr_range_test_step_rate": 2.0,
      "lr_range_test_staircase": true}})"),
                    1.0);
  CheckAgainst(stairs, 500, [](int64_t s) {
    return s == 0 ? 1e-3 : 1e-3 * (1.0 + 2.0 * static_cast<double>((s - 1) / 100));
  });
}

TEST_CASE("LrSchedule: the scheduler block is checked like every other", "[zero]") {
  for (const char* json : {
           R"({"scheduler": {"type": "WarmupDecay"}})",                    // near miss
           R"({"scheduler": {"type": "CosineAnnealing"}})",                // not DeepSpeed's
           R"({"scheduler": {"params": {}}})",                             // no type
           R"({"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 5}}})",
           R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cubic"}}})",
           R"({"scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 5}}})",
           R"({"scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 1}}})",
           R"({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 2,
               "cycle_max_lr": 1}}})",
       }) {
    absl::StatusOr<Config> c = ParseConfig(json);
    INFO(json);
    INFO(c.status().ToString());
    CHECK(c.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(c.status().message(), "scheduler"));
  }
  absl::StatusOr<Config> near = ParseConfig(R"({"scheduler": {"type": "WarmupDecay"}})");
  CHECK(absl::StrContains(near.status().message(), "did you mean \"WarmupDecayLR\"?"));
}

}  // namespace
}  // namespace zerort
