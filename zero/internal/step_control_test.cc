#include "zero/internal/step_control.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "device/testing/one_thread.h"
#include "zero/internal/host_collectives.h"
#include "zero/internal/test_util.h"

namespace zerort {
namespace zero_internal {
namespace {

AdamWScalars Config() {
  AdamWScalars s;
  s.lr = 0.01;
  s.beta1 = 0.9;
  s.beta2 = 0.95;
  s.eps = 1e-8;
  s.weight_decay = 0.1;
  return s;
}

void RequireScalars(const AdamWScalars& got, const AdamWScalars& want) {
  CHECK(got.lr == want.lr);
  CHECK(got.beta1 == want.beta1);
  CHECK(got.beta2 == want.beta2);
  CHECK(got.eps == want.eps);
  CHECK(got.weight_decay == want.weight_decay);
}

TEST_CASE("Hyperparams: Set validates, names the caller and the value, and changes nothing on "
          "error",
          "[zero]") {
  Hyperparams h(Config(), nullptr);
  RequireScalars(h.ForStep(3).value(), Config());
  CHECK_FALSE(h.set());

  AdamWScalars bad = Config();
  bad.lr = -1;
  absl::Status s = h.Set(bad, "SetHyperparams");
  REQUIRE(absl::IsInvalidArgument(s));
  CHECK(absl::StrContains(s.message(), "SetHyperparams"));
  CHECK(absl::StrContains(s.message(), "lr=-1"));
  bad = Config();
  bad.beta2 = 1;
  s = h.Set(bad, "SetHyperparams");
  REQUIRE(absl::IsInvalidArgument(s));
  CHECK(absl::StrContains(s.message(), "beta2=1"));
  s = h.SetLearningRate(std::numeric_limits<double>::quiet_NaN());
  REQUIRE(absl::IsInvalidArgument(s));
  CHECK(absl::StrContains(s.message(), "SetLearningRate"));
  RequireScalars(h.current(), Config());
  CHECK_FALSE(h.set());

  AdamWScalars mine = Config();
  mine.lr = 0.002;
  mine.beta1 = 0.8;
  mine.weight_decay = 0;
  REQUIRE(h.Set(mine, "SetHyperparams").ok());
  CHECK(h.set());
  RequireScalars(h.current(), mine);
  RequireScalars(h.ForStep(9).value(), mine);
  // SetLearningRate changes the rate alone.
  REQUIRE(h.SetLearningRate(0.5).ok());
  mine.lr = 0.5;
  RequireScalars(h.ForStep(1).value(), mine);
}

TEST_CASE("Hyperparams: the schedule gives the rate until the trainer sets one; Restore",
          "[zero]") {
  auto schedule = [](int64_t t) { return t == 4 ? -1.0 : 0.02 / static_cast<double>(t); };
  Hyperparams h(Config(), schedule);
  for (int64_t t : {1, 2, 3, 7}) {
    INFO("step " << t);
    AdamWScalars want = Config();
    want.lr = schedule(t);
    RequireScalars(h.ForStep(t).value(), want);
  }
  // A scheduled rate is validated at its step.
  const absl::StatusOr<AdamWScalars> at4 = h.ForStep(4);
  REQUIRE(absl::IsInvalidArgument(at4.status()));
  CHECK(absl::StrContains(at4.status().message(), "lr_schedule(4)"));

  // The trainer's rate takes precedence, at every step.
  REQUIRE(h.SetLearningRate(0.003).ok());
  for (int64_t t : {1, 4, 7}) {
    INFO("step " << t);
    REQUIRE(h.ForStep(t).ok());
    CHECK(h.ForStep(t)->lr == 0.003);
  }

  // Restore without the trainer's scalars: the config's rule again.
  REQUIRE(h.Restore(false, AdamWScalars()).ok());
  CHECK_FALSE(h.set());
  RequireScalars(h.current(), Config());
  CHECK(h.ForStep(2)->lr == schedule(2));
  // Restore with them: they hold at every step.
  AdamWScalars saved = Config();
  saved.lr = 0.004;
  saved.eps = 1e-6;
  REQUIRE(h.Restore(true, saved).ok());
  CHECK(h.set());
  RequireScalars(h.ForStep(4).value(), saved);
  // A bad saved state is refused and changes nothing.
  AdamWScalars bad = saved;
  bad.eps = 0;
  REQUIRE(absl::IsInvalidArgument(h.Restore(true, bad)));
  RequireScalars(h.current(), saved);
  CHECK(h.set());
}

// Runs fn(rank, exchange) on `world` in-process ranks over HostCollectives.
std::vector<absl::Status> OnExchange(
    int world, const std::function<absl::Status(int, comm::HostExchange&)>& fn) {
  auto dev = testing::OneThreadCpuDevice();
  return OnRanks(world, [&](int r, comm::Communicator* comm) {
    HostCollectives host(comm, dev.get(), nullptr);
    return fn(r, host);
  });
}

struct Decision {
  bool apply;
  std::optional<double> clip;
};

std::vector<absl::Status> Agree(const std::vector<Decision>& by_rank) {
  return OnExchange(static_cast<int>(by_rank.size()), [&](int r, comm::HostExchange& x) {
    return AgreeOnDecision(x, by_rank[r].apply, by_rank[r].clip);
  });
}

TEST_CASE("AgreeOnDecision: the same decision everywhere passes; else every rank fails naming "
          "both calls",
          "[zero]") {
  for (const std::vector<Decision>& same :
       {std::vector<Decision>{{true, 0.5}, {true, 0.5}, {true, 0.5}},
        std::vector<Decision>{{true, {}}, {true, {}}, {true, {}}},
        std::vector<Decision>{{false, {}}, {false, {}}, {false, {}}},
        std::vector<Decision>{{false, {}}}}) {
    for (const absl::Status& s : Agree(same)) CHECK(s.ok());
  }
  struct Mismatch {
    std::vector<Decision> by_rank;
    std::string rank0, other;
  };
  const Mismatch cases[] = {
      {{{true, {}}, {true, {}}, {false, {}}}, "rank 0 called ApplyStep()", "rank 2 SkipStep()"},
      {{{true, 0.5}, {true, 0.25}, {true, 0.5}},
       "rank 0 called ApplyStep(clip_coef=0.5)",
       "rank 1 ApplyStep(clip_coef=0.25)"},
      {{{false, {}}, {true, 0.5}, {true, {}}}, "rank 0 called SkipStep()",
       "rank 1 ApplyStep(clip_coef=0.5)"},
      {{{true, 0.5}, {true, {}}}, "rank 0 called ApplyStep(clip_coef=0.5)", "rank 1 ApplyStep()"},
  };
  for (const Mismatch& m : cases) {
    const std::vector<absl::Status> st = Agree(m.by_rank);
    for (size_t r = 0; r < st.size(); ++r) {
      INFO("rank " << r << ": " << st[r]);
      CHECK(absl::IsFailedPrecondition(st[r]));
      CHECK(absl::StrContains(st[r].message(), m.rank0));
      CHECK(absl::StrContains(st[r].message(), m.other));
    }
  }
}

uint64_t Bits(double d) {
  uint64_t b;
  std::memcpy(&b, &d, sizeof b);
  return b;
}

// The serial reference: op over ranks in rank order, NaN winning a max.
double Serial(const std::vector<std::vector<double>>& by_rank, size_t k, comm::ReduceOp op) {
  double acc = by_rank[0][k];
  for (size_t r = 1; r < by_rank.size(); ++r) {
    const double x = by_rank[r][k];
    if (op == comm::ReduceOp::kMax) {
      acc = std::isnan(acc) || std::isnan(x) ? std::numeric_limits<double>::quiet_NaN()
                                             : std::max(acc, x);
    } else {
      acc = acc + x;
    }
  }
  return op == comm::ReduceOp::kAvg ? acc / static_cast<double>(by_rank.size()) : acc;
}

TEST_CASE("AllReduceDoubles: sum, max and avg in rank order, the same bits on every rank",
          "[zero]") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  // Column 0 depends on the order of the sum: (1e17 + 1) - 1e17 is 0 in rank order.
  const std::vector<std::vector<double>> values = {
      {1e17, 0.1, -3.5, nan, 1.0, 6.0},
      {1.0, 0.2, 7.25, 2.0, 5.0, -1.5},
      {-1e17, 0.3, -1e-300, 4.0, nan, -2.0},
  };
  for (comm::ReduceOp op : {comm::ReduceOp::kSum, comm::ReduceOp::kMax, comm::ReduceOp::kAvg}) {
    for (int world = 1; world <= 3; ++world) {
      INFO(comm::ReduceOpName(op) << " over " << world << " ranks");
      const std::vector<std::vector<double>> mine(values.begin(), values.begin() + world);
      std::vector<std::vector<double>> got = mine;
      const std::vector<absl::Status> st = OnExchange(world, [&](int r, comm::HostExchange& x) {
        return AllReduceDoubles(x, absl::MakeSpan(got[r]), op);
      });
      for (int r = 0; r < world; ++r) {
        INFO("rank " << r << ": " << st[r]);
        REQUIRE(st[r].ok());
        for (size_t k = 0; k < values[0].size(); ++k) {
          INFO("value " << k << ": " << got[r][k] << " want " << Serial(mine, k, op));
          const double want = Serial(mine, k, op);
          if (std::isnan(want)) {
            CHECK(std::isnan(got[r][k]));
          } else {
            CHECK(Bits(got[r][k]) == Bits(want));
          }
          CHECK(Bits(got[r][k]) == Bits(got[0][k]));
        }
      }
    }
  }
}

TEST_CASE("AllReduceDoubles: different counts fail every rank, naming them", "[zero]") {
  const std::vector<absl::Status> st = OnExchange(3, [](int r, comm::HostExchange& x) {
    std::vector<double> v(r == 2 ? 2 : 3, 1.0);
    return AllReduceDoubles(x, absl::MakeSpan(v), comm::ReduceOp::kSum);
  });
  for (size_t r = 0; r < st.size(); ++r) {
    INFO("rank " << r << ": " << st[r]);
    CHECK(absl::IsInvalidArgument(st[r]));
    CHECK(absl::StrContains(st[r].message(), "rank 0 passed 3"));
    CHECK(absl::StrContains(st[r].message(), "rank 2 2"));
  }
}

}  // namespace
}  // namespace zero_internal
}  // namespace zerort
