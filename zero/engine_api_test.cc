// The trainer-facing optimizer API of the engine: per-step hyperparameters, the split step
// (ComputeGradNorm, then ApplyStep or SkipStep), parameter groups and the scalar helpers,
// each against an independent reference.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "base/testing/checks.h"
#include "base/testing/temp_dir.h"
#include "checkpoint/checkpoint.h"
#include "comm/inprocess.h"
#include "device/testing/one_thread.h"
#include "zero/engine.h"
#include "zero/lr_schedule.h"
#include "zero/internal/test_util.h"
#include "zero/testing/synthetic_trainer.h"

namespace zerort {
namespace {

using testing::BitEqual;
using testing::RequireAllOk;
using memory::ParamSpec;
using testing::GradValue;
using testing::SmallModel;
using zero_internal::OnRanks;

constexpr double kPi = 3.14159265358979323846;

// Warmup over 3 steps, then cosine decay to 10% over the rest of 12.
double WarmupCosine(int64_t t) {
  const double peak = 2e-2;
  if (t <= 3) return peak * t / 3.0;
  const double progress = (t - 3) / 9.0;
  return peak * (0.1 + 0.9 * 0.5 * (1 + std::cos(kPi * std::min(progress, 1.0))));
}

// One micro-step of the synthetic trainer (gradients times `factor`), not Step().
absl::Status Backward(Engine& e, int step, int micro, float factor = 1) {
  std::vector<std::vector<char>> host;
  RETURN_IF_ERROR(testing::Backward(e, step, micro, &host, factor));
  return e.device()->Synchronize(e.compute_stream());
}

absl::StatusOr<std::unique_ptr<Engine>> MakeEngine(const Config& c, comm::Communicator* comm,
                                                   Device* device,
                                                   const EngineOptions& options = {},
                                                   const std::vector<ParamSpec>& specs =
                                                       SmallModel()) {
  ASSIGN_OR_RETURN(std::unique_ptr<Engine> e, Engine::Create(c, specs, comm, device, options));
  RETURN_IF_ERROR(testing::SetInitValues(*e));
  return e;
}

// The textbook AdamW in double, unsharded, with a learning rate per step and a weight decay and
// lr multiplier per parameter; steps in `skip` leave everything (and t) unchanged.
struct Reference {
  int world = 1, gas = 1;
  double clip = 0;
  std::function<double(int64_t)> lr;
  std::function<double(int)> weight_decay;  // per parameter
  std::function<double(int)> lr_scale;      // per parameter
  std::set<int> skip;

  std::vector<double> Run(const Config& c, int steps) const {
    auto [w, at] = testing::SmallModelFlatInit();
    std::vector<double> m, v;
    m.assign(w.size(), 0);
    v.assign(w.size(), 0);
    const double b1 = c.optimizer.beta1, b2 = c.optimizer.beta2, eps = c.optimizer.eps;
    int t = 0;
    for (int step = 0; step < steps; ++step) {
      if (skip.count(step)) continue;
      ++t;
      std::vector<double> g(w.size(), 0);
      double norm = 0;
      for (size_t j = 0; j < w.size(); ++j) {
        for (int micro = 0; micro < gas; ++micro) {
          for (int r = 0; r < world; ++r) g[j] += GradValue(r, step, micro, at[j].first, at[j].second);
        }
        g[j] /= world * gas;
        norm += g[j] * g[j];
      }
      norm = std::sqrt(norm);
      const double coef = clip > 0 && norm > clip ? clip / (norm + 1e-6) : 1.0;
      for (size_t j = 0; j < w.size(); ++j) {
        const double a = lr(t) * lr_scale(at[j].first);
        const double gj = g[j] * coef;
        m[j] = b1 * m[j] + (1 - b1) * gj;
        v[j] = b2 * v[j] + (1 - b2) * gj * gj;
        const double mhat = m[j] / (1 - std::pow(b1, t)), vhat = v[j] / (1 - std::pow(b2, t));
        w[j] = w[j] * (1 - a * weight_decay(at[j].first)) - a * mhat / (std::sqrt(vhat) + eps);
      }
    }
    return w;
  }
};

double WorstRelative(const std::vector<float>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  double worst = 0;
  for (size_t j = 0; j < want.size(); ++j) {
    worst = std::max(worst, std::fabs(got[j] - want[j]) / std::max(std::fabs(want[j]), 1.0));
  }
  return worst;
}

struct Variant {
  int stage;
  bool offload;
};
const Variant kVariants[] = {{0, false}, {1, false}, {1, true}, {2, false},
                             {2, true},  {3, false}, {3, true}};

// Trains `steps` steps with one Step() per micro-step; `before(engine, t)` runs before each
// optimizer step's first micro-step (t = the step about to be applied, 1-based). Returns rank
// 0's masters and boundary stats.
struct Trained {
  std::vector<std::vector<float>> master;  // per rank
  std::vector<StepStats> stats;            // rank 0
};
Trained Train(const Config& c, int world, int steps, const EngineOptions& options,
              const std::function<absl::Status(Engine&, int64_t)>& before) {
  auto device = testing::OneThreadCpuDevice();
  Trained out;
  out.master.resize(world);
  RequireAllOk(OnRanks(world, [&](int r, comm::Communicator* comm) -> absl::Status {
    ASSIGN_OR_RETURN(auto e, MakeEngine(c, comm, device.get(), options));
    for (int step = 0; step < steps; ++step) {
      if (before) RETURN_IF_ERROR(before(*e, e->step() + 1));
      for (int micro = 0; micro < c.gradient_accumulation_steps; ++micro) {
        RETURN_IF_ERROR(Backward(*e, step, micro));
        ASSIGN_OR_RETURN(StepStats s, e->Step());
        if (r == 0 && s.boundary) out.stats.push_back(s);
      }
    }
    ASSIGN_OR_RETURN(out.master[r], e->GatherMasterWeights());
    return absl::OkStatus();
  }));
  return out;
}

TEST_CASE("EngineApi: a warmup+cosine schedule through SetLearningRate matches a serial AdamW, "
          "bitwise across stages 0-3",
          "[zero]") {
  const int world = 2, steps = 12, gas = 2;
  auto set_lr = [](Engine& e, int64_t t) { return e.SetLearningRate(WarmupCosine(t)); };
  std::vector<float> first;
  for (const Variant& v : kVariants) {
    INFO("stage=" << v.stage << " offload=" << v.offload);
    const Config c = testing::TestConfig(v.stage, DType::kF32, gas, 0.05, v.offload);
    Trained run = Train(c, world, steps, {}, set_lr);
    REQUIRE(run.stats.size() == steps);
    for (int k = 0; k < steps; ++k) CHECK(run.stats[k].lr == WarmupCosine(k + 1));
    CHECK(run.stats[0].weight_decay == c.optimizer.weight_decay);
    CHECK(BitEqual(run.master[1], run.master[0]));
    if (first.empty()) {
      first = run.master[0];
      Reference ref{world, gas, 0.05, WarmupCosine, [&](int) { return c.optimizer.weight_decay; },
                    [](int) { return 1.0; }};
      CHECK(WorstRelative(run.master[0], ref.Run(c, steps)) <= 1e-6);
      // The schedule mattered: the config's constant rate ends elsewhere.
      Reference constant = ref;
      constant.lr = [&](int64_t) { return c.optimizer.lr; };
      CHECK(WorstRelative(run.master[0], constant.Run(c, steps)) > 1e-4);
    } else {
      CHECK(BitEqual(run.master[0], first));
    }
  }
  // EngineOptions::lr_schedule is the same schedule from the engine's side: the same bits.
  EngineOptions scheduled;
  scheduled.lr_schedule = WarmupCosine;
  Trained run = Train(testing::TestConfig(2, DType::kF32, gas, 0.05, true), world, steps,
                      scheduled, nullptr);
  CHECK(BitEqual(run.master[0], first));
  CHECK(run.stats[4].lr == WarmupCosine(5));
}

TEST_CASE("EngineApi: bad hyperparameters are InvalidArgument naming the value", "[zero]") {
  auto comms = comm::CreateInProcessGroup(1).value();
  auto device = testing::OneThreadCpuDevice();
  const Config c = testing::TestConfig(1, DType::kF32, 1, 0, false);
  EngineOptions o;
  o.lr_schedule = [](int64_t t) { return t == 2 ? -0.5 : 1e-3; };
  auto e = MakeEngine(c, comms[0].get(), device.get(), o).value();
  const AdamWScalars before = e->hyperparams();
  auto lr = e->SetLearningRate(-1);
  CHECK(lr.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(lr.message()), Catch::Contains("SetLearningRate") &&
                                            Catch::Contains("lr=-1"));
  CHECK(e->SetLearningRate(NAN).code() == absl::StatusCode::kInvalidArgument);
  AdamWScalars s = before;
  s.beta1 = 1;
  auto beta = e->SetHyperparams(s);
  CHECK_THAT(std::string(beta.message()), Catch::Contains("beta1=1"));
  s = before;
  s.eps = 0;
  CHECK_THAT(std::string(e->SetHyperparams(s).message()), Catch::Contains("eps=0"));
  CHECK(e->hyperparams().lr == before.lr);
  CHECK(e->hyperparams().beta1 == before.beta1);
  // A scheduled value is checked when its step applies; the step fails before changing t.
  REQUIRE(Backward(*e, 0, 0).ok());
  REQUIRE(e->Step().ok());
  REQUIRE(Backward(*e, 1, 0).ok());
  auto bad = e->Step();
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(std::string(bad.status().message()), Catch::Contains("lr_schedule(2)") &&
                                                      Catch::Contains("lr=-0.5"));
  CHECK(e->step() == 1);
  // The trainer's rate replaces the schedule; the pending step then applies.
  REQUIRE(e->SetLearningRate(1e-3).ok());
  auto applied = e->ApplyStep();
  REQUIRE(applied.ok());
  CHECK(applied->step == 2);
  CHECK(applied->lr == 1e-3);
}

TEST_CASE("EngineApi: a restored state brings back the trainer's scalars, bit for bit",
          "[zero]") {
  const int world = 2;
  for (const Variant& v : {Variant{1, false}, Variant{3, true}}) {
    INFO("stage=" << v.stage << " offload=" << v.offload);
    const Config c = testing::TestConfig(v.stage, DType::kBF16, 1, 0, v.offload);
    AdamWScalars custom{3e-3, 0.8, 0.99, 1e-6, 0.2};
    auto device = testing::OneThreadCpuDevice();
    RequireAllOk(OnRanks(world, [&](int, comm::Communicator* comm) -> absl::Status {
      ASSIGN_OR_RETURN(auto a, MakeEngine(c, comm, device.get()));
      RETURN_IF_ERROR(a->SetHyperparams(custom));
      for (int step = 0; step < 3; ++step) {
        RETURN_IF_ERROR(Backward(*a, step, 0));
        RETURN_IF_ERROR(a->Step().status());
      }
      const int64_t n = a->plan().shard_elements;
      std::vector<float> master(n), m(n), vv(n);
      RETURN_IF_ERROR(a->BeginSnapshot(master.data(), m.data(), vv.data(), nullptr));
      RETURN_IF_ERROR(a->WaitSnapshot());
      const EngineState state = a->state();
      if (!state.hyperparams_set || state.hyperparams.beta1 != 0.8) {
        return absl::InternalError("state() lost the trainer's scalars");
      }
      // The resumed engine never calls SetHyperparams: the state carries them.
      ASSIGN_OR_RETURN(auto b, MakeEngine(c, comm, device.get()));
      RETURN_IF_ERROR(b->RestoreOwnedState(master, m, vv, state));
      for (int step = 3; step < 6; ++step) {
        for (Engine* e : {a.get(), b.get()}) {
          RETURN_IF_ERROR(Backward(*e, step, 0));
          RETURN_IF_ERROR(e->Step().status());
        }
      }
      ASSIGN_OR_RETURN(std::vector<float> wa, a->GatherMasterWeights());
      ASSIGN_OR_RETURN(std::vector<float> wb, b->GatherMasterWeights());
      if (!BitEqual(wa, wb)) return absl::InternalError("the resumed run differs");
      // A state without trainer scalars puts the config's back.
      EngineState plain = b->state();
      plain.hyperparams_set = false;
      RETURN_IF_ERROR(b->BeginSnapshot(master.data(), m.data(), vv.data(), nullptr));
      RETURN_IF_ERROR(b->WaitSnapshot());
      RETURN_IF_ERROR(b->RestoreOwnedState(master, m, vv, plain));
      if (b->hyperparams().beta1 != c.optimizer.beta1) {
        return absl::InternalError("the config's scalars did not come back");
      }
      return absl::OkStatus();
    }));
  }
}

TEST_CASE("EngineApi: a checkpoint keeps the trainer's scalars; a resumed run is bit-identical",
          "[zero]") {
  const int world = 2;
  const Config c = testing::TestConfig(2, DType::kBF16, 1, 0, false);
  const std::string root = testing::TempDir("zerort_api_ckpt_");
  auto device = testing::OneThreadCpuDevice();
  RequireAllOk(OnRanks(world, [&](int, comm::Communicator* comm) -> absl::Status {
    ASSIGN_OR_RETURN(auto a, MakeEngine(c, comm, device.get()));
    for (int step = 0; step < 4; ++step) {
      RETURN_IF_ERROR(a->SetLearningRate(WarmupCosine(step + 1)));
      RETURN_IF_ERROR(Backward(*a, step, 0));
      RETURN_IF_ERROR(a->Step().status());
      if (step == 1) RETURN_IF_ERROR(SaveCheckpoint(*a, root).status());
    }
    // Resumed after step 2; its first step takes the saved lr (WarmupCosine(2)), not the
    // config's, until the trainer sets the next.
    ASSIGN_OR_RETURN(auto b, MakeEngine(c, comm, device.get()));
    RETURN_IF_ERROR(LoadCheckpoint(*b, root));
    if (b->hyperparams().lr != WarmupCosine(2)) {
      return absl::InternalError(absl::StrCat("resumed lr ", b->hyperparams().lr));
    }
    for (int step = 2; step < 4; ++step) {
      RETURN_IF_ERROR(b->SetLearningRate(WarmupCosine(step + 1)));
      RETURN_IF_ERROR(Backward(*b, step, 0));
      RETURN_IF_ERROR(b->Step().status());
    }
    ASSIGN_OR_RETURN(std::vector<float> wa, a->GatherMasterWeights());
    ASSIGN_OR_RETURN(std::vector<float> wb, b->GatherMasterWeights());
    if (!BitEqual(wa, wb)) return absl::InternalError("the resumed run differs");
    return absl::OkStatus();
  }));
  std::filesystem::remove_all(root);
}

// The config's scheduler block drives the step's learning rate: StepStats.lr is LrSchedule's
// value (written independently in zero/lr_schedule_test), the masters equal the same schedule
// given through EngineOptions::lr_schedule, and a checkpoint resumed mid-warmup continues the
// schedule bit for bit (its state is the step count).
TEST_CASE("EngineApi: the config's scheduler sets each step's lr and survives a resume",
          "[zero]") {
  const int world = 2, steps = 8;
  Config c = testing::TestConfig(2, DType::kBF16, 1, 0.05, false);
  c.scheduler.type = SchedulerType::kWarmupCosineLR;
  c.scheduler.warmup_num_steps = 4;
  c.scheduler.total_num_steps = steps;
  c.scheduler.warmup_min_ratio = 0.1;
  const LrSchedule schedule(c.scheduler, c.optimizer.lr);
  Trained from_config = Train(c, world, steps, {}, nullptr);
  REQUIRE(from_config.stats.size() == steps);
  for (int k = 0; k < steps; ++k) CHECK(from_config.stats[k].lr == schedule.LrAt(k));
  CHECK(from_config.stats[1].lr != from_config.stats[2].lr);
  Config plain = c;
  plain.scheduler = SchedulerConfig{};
  EngineOptions hook;
  hook.lr_schedule = [&](int64_t t) { return schedule.LrAt(t - 1); };
  Trained from_hook = Train(plain, world, steps, hook, nullptr);
  CHECK(BitEqual(from_config.master[0], from_hook.master[0]));

  const std::string root = testing::TempDir("zerort_sched_ckpt_");
  auto device = testing::OneThreadCpuDevice();
  std::vector<std::vector<float>> resumed(world);
  RequireAllOk(OnRanks(world, [&](int r, comm::Communicator* comm) -> absl::Status {
    ASSIGN_OR_RETURN(auto a, MakeEngine(c, comm, device.get()));
    for (int step = 0; step < 3; ++step) {
      RETURN_IF_ERROR(Backward(*a, step, 0));
      RETURN_IF_ERROR(a->Step().status());
    }
    RETURN_IF_ERROR(SaveCheckpoint(*a, root).status());
    ASSIGN_OR_RETURN(auto b, MakeEngine(c, comm, device.get()));
    RETURN_IF_ERROR(LoadCheckpoint(*b, root));
    for (int step = 3; step < steps; ++step) {
      RETURN_IF_ERROR(Backward(*b, step, 0));
      ASSIGN_OR_RETURN(StepStats st, b->Step());
      if (st.lr != schedule.LrAt(step)) {
        return absl::InternalError(absl::StrCat("resumed step ", step, " lr ", st.lr));
      }
    }
    ASSIGN_OR_RETURN(resumed[r], b->GatherMasterWeights());
    return absl::OkStatus();
  }));
  std::filesystem::remove_all(root);
  CHECK(BitEqual(resumed[0], from_config.master[0]));
}

// This rank's owned master, m and v, through a snapshot (at a step boundary).
absl::StatusOr<std::vector<float>> OwnedState(Engine& e) {
  const int64_t n = e.plan().shard_elements;
  std::vector<float> all(3 * n);
  RETURN_IF_ERROR(e.BeginSnapshot(all.data(), all.data() + n, all.data() + 2 * n, nullptr));
  RETURN_IF_ERROR(e.WaitSnapshot());
  return all;
}

bool SameScalars(const EngineState& a, const EngineState& b) {
  return a.step == b.step && a.loss_scale == b.loss_scale &&
         a.scaler_hysteresis_left == b.scaler_hysteresis_left && a.scaler_iter == b.scaler_iter &&
         a.scaler_last_overflow == b.scaler_last_overflow;
}

absl::Status Expect(bool ok, const std::string& what) {
  return ok ? absl::OkStatus() : absl::InternalError(what);
}

TEST_CASE("EngineApi: a trainer skips an outlier step on every rank; SkipStep changes nothing",
          "[zero]") {
  const int steps = 6, outlier = 3, gas = 2;
  for (int world : {2, 4}) {
    for (const Variant& v : {Variant{1, false}, Variant{3, true}}) {
      INFO("world=" << world << " stage=" << v.stage << " offload=" << v.offload);
      const Config c = testing::TestConfig(v.stage, DType::kF32, gas, 0, v.offload);
      auto device = testing::OneThreadCpuDevice();
      std::vector<std::vector<float>> master(world);
      std::vector<std::vector<bool>> skipped(world);
      RequireAllOk(OnRanks(world, [&](int r, comm::Communicator* comm) -> absl::Status {
        ASSIGN_OR_RETURN(auto e, MakeEngine(c, comm, device.get()));
        double first_norm = 0;
        for (int step = 0; step < steps; ++step) {
          ASSIGN_OR_RETURN(const std::vector<float> before, OwnedState(*e));
          const EngineState state_before = e->state();
          RETURN_IF_ERROR(Backward(*e, step, 0));
          RETURN_IF_ERROR(Expect(!e->last_micro_step(), "micro-step 1 of 2 is not the last"));
          auto early = e->ComputeGradNorm();
          RETURN_IF_ERROR(Expect(early.status().code() == absl::StatusCode::kFailedPrecondition,
                                 "ComputeGradNorm on micro-step 1 of 2"));
          ASSIGN_OR_RETURN(StepStats micro, e->Step());
          RETURN_IF_ERROR(Expect(!micro.boundary, "the first micro-step applied"));
          // The outlier: one rank's gradients of one micro-step blow up.
          const float factor = step == outlier && r == world - 1 ? 60.0f : 1.0f;
          RETURN_IF_ERROR(Backward(*e, step, 1, factor));
          ASSIGN_OR_RETURN(const GradNormInfo info, e->ComputeGradNorm());
          ASSIGN_OR_RETURN(const GradNormInfo again, e->ComputeGradNorm());
          RETURN_IF_ERROR(Expect(again.norm == info.norm, "a second ComputeGradNorm differs"));
          RETURN_IF_ERROR(Expect(e->Step().status().code() ==
                                     absl::StatusCode::kFailedPrecondition,
                                 "Step() while a split step is pending"));
          if (step == 0) first_norm = info.norm;
          const bool skip = info.norm > 3 * first_norm;  // the trainer's rule
          skipped[r].push_back(skip);
          ASSIGN_OR_RETURN(StepStats s, skip ? e->SkipStep() : e->ApplyStep());
          RETURN_IF_ERROR(Expect(s.skipped == skip && s.grad_norm == info.norm, "stats"));
          if (skip) {
            ASSIGN_OR_RETURN(const std::vector<float> after, OwnedState(*e));
            RETURN_IF_ERROR(Expect(BitEqual(before, after), "SkipStep changed master, m or v"));
            RETURN_IF_ERROR(Expect(SameScalars(state_before, e->state()),
                                   "SkipStep changed the step or the scaler"));
          }
        }
        ASSIGN_OR_RETURN(master[r], e->GatherMasterWeights());
        return absl::OkStatus();
      }));
      for (int r = 0; r < world; ++r) {
        std::vector<bool> want(steps, false);
        want[outlier] = true;
        CHECK(skipped[r] == want);
        CHECK(BitEqual(master[r], master[0]));
      }
      Reference ref{world, gas, 0, [&](int64_t) { return c.optimizer.lr; },
                    [&](int) { return c.optimizer.weight_decay; }, [](int) { return 1.0; },
                    {outlier}};
      CHECK(WorstRelative(master[0], ref.Run(c, steps)) <= 1e-6);
    }
  }
}

TEST_CASE("EngineApi: the split step with fp16 overflow, a trainer's skip, and disagreement",
          "[zero]") {
  Config c = testing::TestConfig(2, DType::kF16, 1, 0.05, false);
  c.fp16.initial_scale_power = 4;
  c.fp16.hysteresis = 1;
  c.fp16.loss_scale_window = 2;
  auto device = testing::OneThreadCpuDevice();
  RequireAllOk(OnRanks(2, [&](int r, comm::Communicator* comm) -> absl::Status {
    ASSIGN_OR_RETURN(auto e, MakeEngine(c, comm, device.get()));
    RETURN_IF_ERROR(Expect(e->ApplyStep().status().code() ==
                               absl::StatusCode::kFailedPrecondition,
                           "ApplyStep without ComputeGradNorm"));
    // A trainer's skip of finite gradients leaves the scaler alone (no clean step counted).
    RETURN_IF_ERROR(Backward(*e, 0, 0));
    const EngineState s0 = e->state();
    ASSIGN_OR_RETURN(GradNormInfo info, e->ComputeGradNorm());
    RETURN_IF_ERROR(Expect(!info.overflow && info.loss_scale == 16, "fp16 window"));
    RETURN_IF_ERROR(e->SkipStep().status());
    RETURN_IF_ERROR(Expect(SameScalars(s0, e->state()), "a trainer's skip moved the scaler"));
    // The ranks disagree: both fail alike and the step stays pending; then they agree.
    RETURN_IF_ERROR(Backward(*e, 1, 0));
    RETURN_IF_ERROR(e->ComputeGradNorm().status());
    absl::Status split = r == 0 ? e->ApplyStep().status() : e->SkipStep().status();
    RETURN_IF_ERROR(Expect(split.code() == absl::StatusCode::kFailedPrecondition &&
                               split.message().find("rank 0 called ApplyStep() and rank 1 "
                                                    "SkipStep()") != std::string::npos,
                           std::string(split.message())));
    ApplyOptions clip;
    clip.clip_coef = r == 0 ? 0.5 : 0.25;
    split = e->ApplyStep(clip).status();
    RETURN_IF_ERROR(Expect(split.code() == absl::StatusCode::kFailedPrecondition,
                           "different clip_coef accepted"));
    clip.clip_coef = -1;
    RETURN_IF_ERROR(Expect(e->ApplyStep(clip).status().code() ==
                               absl::StatusCode::kInvalidArgument,
                           "clip_coef=-1 accepted"));
    clip.clip_coef = 0.5;
    ASSIGN_OR_RETURN(StepStats applied, e->ApplyStep(clip));
    RETURN_IF_ERROR(Expect(applied.step == 1 && applied.clip_coef == 0.5, "applied"));
    // An overflow on one rank: ApplyStep is refused everywhere; SkipStep halves the scale.
    RETURN_IF_ERROR(Backward(*e, 2, 0, r == 1 ? INFINITY : 1.0f));
    ASSIGN_OR_RETURN(info, e->ComputeGradNorm());
    RETURN_IF_ERROR(Expect(info.overflow && std::isinf(info.norm), "overflow verdict"));
    RETURN_IF_ERROR(Expect(e->ApplyStep().status().code() ==
                               absl::StatusCode::kFailedPrecondition,
                           "ApplyStep on overflow"));
    ASSIGN_OR_RETURN(StepStats skipped, e->SkipStep());
    RETURN_IF_ERROR(Expect(skipped.skipped && e->loss_scale() == 8 && e->step() == 1,
                           "overflow skip"));
    return absl::OkStatus();
  }));
}

TEST_CASE("EngineApi: ApplyStep with the measured clip factor is Step(), bit for bit", "[zero]") {
  const Config c = testing::TestConfig(3, DType::kBF16, 1, 0.05, false);
  Trained plain = Train(c, 2, 5, {}, nullptr);
  auto device = testing::OneThreadCpuDevice();
  std::vector<std::vector<float>> master(2);
  RequireAllOk(OnRanks(2, [&](int r, comm::Communicator* comm) -> absl::Status {
    ASSIGN_OR_RETURN(auto e, MakeEngine(c, comm, device.get()));
    for (int step = 0; step < 5; ++step) {
      RETURN_IF_ERROR(Backward(*e, step, 0));
      ASSIGN_OR_RETURN(const GradNormInfo info, e->ComputeGradNorm());
      ApplyOptions o;
      o.clip_coef = info.clip_coef;
      ASSIGN_OR_RETURN(StepStats s, e->ApplyStep(o));
      RETURN_IF_ERROR(Expect(s.grad_norm == plain.stats[step].grad_norm &&
                                 s.clip_coef == plain.stats[step].clip_coef,
                             "norm or clip differs from Step()'s"));
    }
    ASSIGN_OR_RETURN(master[r], e->GatherMasterWeights());
    return absl::OkStatus();
  }));
  bool clipped = false;
  for (const StepStats& s : plain.stats) clipped = clipped || s.clip_coef < 1;
  CHECK(clipped);
  CHECK(BitEqual(master[0], plain.master[0]));
  CHECK(BitEqual(master[1], plain.master[0]));
}

TEST_CASE("EngineApi: parameter groups match a per-parameter AdamW reference, bitwise across "
          "stages 0-3 with and without offload",
          "[zero]") {
  const int world = 3, steps = 8;
  // SmallModel: 0 embed.w [37,5], 1 l0.w [13,11], 2 l0.b [13], 3 l1.w [64,9], 4 l1.b [1],
  // 5 l2.w [3,7,2], 6 head.w [101].
  const double kWd[] = {0.0, 0.1, 0.0, 0.05, 0.0, 0.3, 0.0};
  const double kScale[] = {0.5, 1.0, 1.0, 1.5, 1.0, 2.0, 1.0};
  EngineOptions o;
  o.param_groups.assign(7, std::nullopt);
  o.param_groups[3] = ParamGroup{0.05, 1.5};  // explicit: wins over patterns
  o.no_decay_1d = true;                       // l0.b, l1.b, head.w
  std::vector<float> first;
  for (const Variant& v : kVariants) {
    INFO("stage=" << v.stage << " offload=" << v.offload);
    Config c = testing::TestConfig(v.stage, DType::kF32, 1, 0, v.offload);
    c.param_groups = {{"embed.*", 0.0, 0.5}, {"l?.w", 0.3, 2.0}, {"nothing.*", 0.2, 1.0}};
    // l0.w's own pattern comes first (the config's decay, spelled out), so "l?.w" takes l2.w
    // only; l1.w is explicit. The pattern that matches nothing is [3] after the insertion.
    c.param_groups.insert(c.param_groups.begin() + 1, {"l0.w", c.optimizer.weight_decay, 1.0});
    auto device = testing::OneThreadCpuDevice();
    std::vector<std::vector<float>> master(world);
    RequireAllOk(OnRanks(world, [&](int r, comm::Communicator* comm) -> absl::Status {
      ASSIGN_OR_RETURN(auto e, MakeEngine(c, comm, device.get(), o));
      for (int i = 0; i < 7; ++i) {
        const std::optional<ParamGroup> g = e->param_group(i);
        RETURN_IF_ERROR(Expect(g.has_value() && g->weight_decay == kWd[i] &&
                                   g->lr_scale == kScale[i],
                               absl::StrCat("group of parameter ", i)));
      }
      bool noted = false;
      for (const std::string& n : e->config().notes) {
        noted = noted || n.find("zerort.param_groups[3]: pattern 'nothing.*' matches no") == 0;
      }
      RETURN_IF_ERROR(Expect(noted, "no note for the pattern that matches nothing"));
      for (int step = 0; step < steps; ++step) {
        RETURN_IF_ERROR(Backward(*e, step, 0));
        RETURN_IF_ERROR(e->Step().status());
      }
      ASSIGN_OR_RETURN(master[r], e->GatherMasterWeights());
      return absl::OkStatus();
    }));
    for (int r = 1; r < world; ++r) CHECK(BitEqual(master[r], master[0]));
    if (first.empty()) {
      first = master[0];
      Reference ref{world, 1, 0, [&](int64_t) { return c.optimizer.lr; },
                    [&](int i) { return kWd[i]; }, [&](int i) { return kScale[i]; }};
      CHECK(WorstRelative(master[0], ref.Run(c, steps)) <= 1e-6);
      Reference flat = ref;  // the groups mattered
      flat.weight_decay = [&](int) { return c.optimizer.weight_decay; };
      flat.lr_scale = [](int) { return 1.0; };
      CHECK(WorstRelative(master[0], flat.Run(c, steps)) > 1e-4);
    } else {
      CHECK(BitEqual(master[0], first));
    }
  }
}

TEST_CASE("EngineApi: bad groups are InvalidArgument naming the pattern or parameter", "[zero]") {
  auto comms = comm::CreateInProcessGroup(1).value();
  auto device = testing::OneThreadCpuDevice();
  Config c = testing::TestConfig(2, DType::kF32, 1, 0, false);
  c.param_groups = {{"l*", -0.1, 1.0}};
  auto bad = Engine::Create(c, SmallModel(), comms[0].get(), device.get());
  REQUIRE_FALSE(bad.ok());
  // Engine::Create validates the config first: the message names the key and the value.
  CHECK_THAT(std::string(bad.status().message()),
             Catch::Contains("zerort.param_groups[0].weight_decay") && Catch::Contains("-0.1"));
  c.param_groups.clear();
  EngineOptions o;
  o.param_groups.assign(7, std::nullopt);
  o.param_groups[2] = ParamGroup{0, NAN};
  auto nan = Engine::Create(c, SmallModel(), comms[0].get(), device.get(), o);
  CHECK_THAT(std::string(nan.status().message()), Catch::Contains("'l0.b'") &&
                                                      Catch::Contains("lr_scale=nan"));
  o.param_groups.resize(3);
  auto count = Engine::Create(c, SmallModel(), comms[0].get(), device.get(), o);
  CHECK_THAT(std::string(count.status().message()), Catch::Contains("3 entries for 7"));
}

TEST_CASE("EngineApi: ranks with different parameter groups are refused at Create", "[zero]") {
  const Config c = testing::TestConfig(2, DType::kF32, 1, 0, false);
  auto device = testing::OneThreadCpuDevice();
  const std::vector<absl::Status> s = OnRanks(2, [&](int r, comm::Communicator* comm) {
    EngineOptions o;
    o.no_decay_1d = r == 1;
    return Engine::Create(c, SmallModel(), comm, device.get(), o).status();
  });
  for (const absl::Status& st : s) {
    CHECK(st.code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(st.message()), Catch::Contains("parameter groups"));
  }
}

TEST_CASE("GlobMatch: '*' and '?' against names", "[zero]") {
  CHECK(GlobMatch("*", ""));
  CHECK(GlobMatch("h.*.bias", "h.11.bias"));
  CHECK(GlobMatch("*ln*", "h.0.ln_1.weight"));
  CHECK(GlobMatch("l?.w", "l2.w"));
  CHECK_FALSE(GlobMatch("l?.w", "l12.w"));
  CHECK_FALSE(GlobMatch("h.*.bias", "h.0.weight"));
  CHECK(GlobMatch("a*b*c", "aXbYbZc"));
  CHECK_FALSE(GlobMatch("a*b*c", "aXbYbZ"));
}

TEST_CASE("EngineApi: scalar all-reduce, all-gather and barrier through the engine's communicator, world 3",
          "[zero]") {
  const Config c = testing::TestConfig(1, DType::kF32, 1, 0, false);
  auto device = testing::OneThreadCpuDevice();
  RequireAllOk(OnRanks(3, [&](int r, comm::Communicator* comm) -> absl::Status {
    ASSIGN_OR_RETURN(auto e, MakeEngine(c, comm, device.get()));
    // Values whose double sum depends on the order: rank order gives exactly this.
    const double mine[] = {1e16, 1.0, -1e16};
    std::vector<double> v = {mine[r], 0.1 * (r + 1), -static_cast<double>(r)};
    RETURN_IF_ERROR(e->AllReduceScalars(absl::MakeSpan(v), comm::ReduceOp::kSum));
    const double sum0 = (1e16 + 1.0) + -1e16;
    RETURN_IF_ERROR(Expect(v[0] == sum0 && v[1] == (0.1 + 0.2) + 0.30000000000000004 &&
                               v[2] == -3,
                           absl::StrCat("sum ", v[0], " ", v[1], " ", v[2])));
    v = {static_cast<double>(r), r == 1 ? NAN : 0.0};
    RETURN_IF_ERROR(e->AllReduceScalars(absl::MakeSpan(v), comm::ReduceOp::kMax));
    RETURN_IF_ERROR(Expect(v[0] == 2 && std::isnan(v[1]), "max (NaN propagates)"));
    v = {3.0 * r};
    RETURN_IF_ERROR(e->AllReduceScalars(absl::MakeSpan(v), comm::ReduceOp::kAvg));
    RETURN_IF_ERROR(Expect(v[0] == 3, absl::StrCat("avg ", v[0])));
    // Different counts fail every rank alike, naming them.
    v.assign(r == 2 ? 2 : 1, 1.0);
    absl::Status bad = e->AllReduceScalars(absl::MakeSpan(v), comm::ReduceOp::kSum);
    RETURN_IF_ERROR(Expect(bad.code() == absl::StatusCode::kInvalidArgument &&
                               bad.message().find("rank 2 2") != std::string::npos,
                           std::string(bad.message())));
    // Per-rank values gathered in rank order, bits unchanged (a NaN payload and -0 included).
    double nan_payload;
    const uint64_t nan_bits = 0x7ff8000000000abcull;
    std::memcpy(&nan_payload, &nan_bits, sizeof nan_payload);
    const std::vector<double> rank_vals = {0.1 * r, r == 1 ? nan_payload : -0.0};
    ASSIGN_OR_RETURN(std::vector<double> gathered, e->AllGatherScalars(rank_vals));
    RETURN_IF_ERROR(Expect(gathered.size() == 6, "gathered size"));
    for (int q = 0; q < 3; ++q) {
      const double want0 = 0.1 * q;
      const double want1 = q == 1 ? nan_payload : -0.0;
      RETURN_IF_ERROR(Expect(std::memcmp(&gathered[2 * q], &want0, 8) == 0 &&
                                 std::memcmp(&gathered[2 * q + 1], &want1, 8) == 0,
                             absl::StrCat("gathered from rank ", q)));
    }
    absl::StatusOr<std::vector<double>> bad_gather =
        e->AllGatherScalars(std::vector<double>(r == 1 ? 3 : 2, 0.0));
    RETURN_IF_ERROR(Expect(absl::IsInvalidArgument(bad_gather.status()) &&
                               bad_gather.status().message().find("rank 1 3") != std::string::npos,
                           std::string(bad_gather.status().message())));
    RETURN_IF_ERROR(e->Barrier());
    // The engine still trains after the side traffic.
    RETURN_IF_ERROR(Backward(*e, 0, 0));
    return e->Step().status();
  }));
}

}  // namespace
}  // namespace zerort
