#include "zero/engine.h"

#include <cmath>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "comm/inprocess.h"
#include "zero/cpu_device.h"

namespace zerort {
namespace {

using memory::ParamSpec;

// A small model with awkward shapes: odd sizes, a tiny bias, one large matrix.
std::vector<ParamSpec> SmallModel() {
  return {{"embed.w", {37, 5}, "embed"},  {"l0.w", {13, 11}, "l0"}, {"l0.b", {13}, "l0"},
          {"l1.w", {64, 9}, "l1"},        {"l1.b", {1}, "l1"},      {"l2.w", {3, 7, 2}, "l2"},
          {"head.w", {101}, "head"}};
}

// Deterministic pseudo-random value for (a, b, c, d): the same on every stage and world size.
float Noise(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  uint64_t x = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull) * 0xBF58476D1CE4E5B9ull ^
               (c + 1) * 0x94D049BB133111EBull ^ (d + 7) * 0xD6E8FEB86659FD93ull;
  x ^= x >> 31;
  x *= 0x7FB5D329728EA185ull;
  x ^= x >> 27;
  return static_cast<float>(static_cast<double>(x >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

float InitValue(int param, int64_t e) { return Noise(999, param, e, 3); }

// The gradient rank r writes for element e of parameter i at (step, micro).
float GradValue(int rank, int step, int micro, int param, int64_t e) {
  return 0.5f * Noise(rank, step * 16 + micro, param, static_cast<uint64_t>(e));
}

struct RunResult {
  std::vector<std::vector<float>> master;  // per rank
  std::vector<StepStats> stats;            // rank 0, per boundary
  std::vector<absl::Status> errors;        // per rank
  MemoryReport report;
};

Config MakeConfig(int stage, Precision precision, int gas, double clip, bool offload) {
  Config c;
  c.zero.stage = stage;
  c.precision = precision;
  c.gradient_accumulation_steps = gas;
  c.gradient_clipping = clip;
  c.zero.reduce_bucket_size = 200;  // several units
  c.zero.stage3_param_persistence_threshold = 20;
  c.zero.stage3_prefetch_bucket_size = 300;
  c.optimizer.lr = 1e-2;
  c.optimizer.weight_decay = 0.1;
  c.comm_timeout_ms = 20000;
  if (offload) c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.cpu_threads = 1;
  return c;
}

void WriteGrad(Engine& e, DType dtype, int rank, int step, int micro, int i, int64_t n,
               double scale, int inject_rank = -1) {
  void* g = e.grad(i).value();
  for (int64_t k = 0; k < n; ++k) {
    float v = static_cast<float>(GradValue(rank, step, micro, i, k) * scale);
    if (rank == inject_rank && k == 0) v = INFINITY;
    if (dtype == DType::kF32) {
      static_cast<float*>(g)[k] = v;
    } else if (dtype == DType::kBF16) {
      static_cast<uint16_t*>(g)[k] = FloatToBf16(v);
    } else {
      static_cast<uint16_t*>(g)[k] = FloatToHalf(v);
    }
  }
}

// Trains `steps` optimizer steps on `world` in-process ranks, as a trainer would: stage-3
// Gather/Release around forward and backward, gradients written in backward (unit) order.
// `inject_step`: at that step rank `inject_rank` writes an Inf into its first gradient.
RunResult Train(const Config& config, int world, int steps, int inject_step = -1,
                int inject_rank = -1) {
  auto comms = comm::CreateInProcessGroup(world, {config.comm_timeout_ms}).value();
  auto device = CreateCpuDevice(1);
  RunResult result;
  result.master.resize(world);
  result.errors.resize(world);
  const auto specs = SmallModel();
  auto body = [&](int r) -> absl::Status {
    auto engine_or = Engine::Create(config, specs, comms[r].get(), device.get());
    if (!engine_or.ok()) return engine_or.status();
    Engine& e = **engine_or;
    const DType dtype = e.plan().options.compute_dtype;
    auto st = e.InitParams([](int i, const ParamSpec& spec, float* v) {
      int64_t n = 1;
      for (int64_t d : spec.shape) n *= d;
      for (int64_t k = 0; k < n; ++k) v[k] = InitValue(i, k);
    });
    if (!st.ok()) return st;
    if (r == 0) result.report = e.memory_report();
    for (int step = 0; step < steps; ++step) {
      for (int micro = 0; micro < config.gradient_accumulation_steps; ++micro) {
        // Forward: units in forward order (the plan lists them in backward order).
        for (int u = e.num_units() - 1; u >= 0; --u) {
          if (auto s = e.Gather(u); !s.ok()) return s;
          for (int i : e.plan().units[u].params) {
            if (auto p = e.param(i); !p.ok()) return p.status();
          }
          if (auto s = e.Release(u); !s.ok()) return s;
        }
        for (int u = 0; u < e.num_units(); ++u) {
          if (auto s = e.Gather(u); !s.ok()) return s;
          for (int i : e.plan().units[u].params) {
            const int inj = step == inject_step && micro == 0 ? inject_rank : -1;
            WriteGrad(e, dtype, r, step, micro, i, e.plan().params[i].numel, e.loss_scale(), inj);
            if (auto s = e.GradReady(i); !s.ok()) return s;
          }
          if (auto s = e.Release(u); !s.ok()) return s;
        }
        auto stats = e.Step();
        if (!stats.ok()) return stats.status();
        if (r == 0 && stats->boundary) result.stats.push_back(*stats);
      }
    }
    auto master = e.GatherMasterWeights();
    if (!master.ok()) return master.status();
    result.master[r] = std::move(*master);
    return absl::OkStatus();
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back([&, r] { result.errors[r] = body(r); });
  for (auto& t : threads) t.join();
  return result;
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void RequireOk(const RunResult& r) {
  for (size_t k = 0; k < r.errors.size(); ++k) {
    INFO("rank " << k << ": " << r.errors[k].ToString());
    REQUIRE(r.errors[k].ok());
  }
}

TEST_CASE("Engine: stages 0-3, with and without offload, give bit-identical fp32 masters",
          "[zero]") {
  const int steps = 50;
  for (Precision precision : {Precision::kFp32, Precision::kBf16}) {
    for (int world : {1, 2, 3, 4}) {
      for (int gas : {1, 3}) {
        for (double clip : {0.0, 0.05}) {
          RunResult reference = Train(MakeConfig(0, precision, gas, clip, false), world, steps);
          RequireOk(reference);
          for (int stage = 0; stage <= 3; ++stage) {
            for (bool offload : {false, true}) {
              if (stage == 0 && offload) continue;
              if (stage == 0 && !offload) continue;  // that is the reference
              INFO("precision=" << static_cast<int>(precision) << " world=" << world
                                << " gas=" << gas << " clip=" << clip << " stage=" << stage
                                << " offload=" << offload);
              RunResult run = Train(MakeConfig(stage, precision, gas, clip, offload), world, steps);
              RequireOk(run);
              for (int r = 0; r < world; ++r) {
                CHECK(BitEqual(run.master[r], reference.master[0]));
              }
              if (clip > 0) {
                // Clipping really engaged at least once (the test would be vacuous otherwise).
                bool clipped = false;
                for (const StepStats& s : run.stats) clipped = clipped || s.clip_coef < 1;
                CHECK(clipped);
              }
            }
          }
          for (int r = 1; r < world; ++r) CHECK(BitEqual(reference.master[r], reference.master[0]));
        }
      }
    }
  }
}

// An AdamW written from the paper's formulas, in double, with no sharding: the gradient is the
// mean over ranks of what each rank wrote (summed over micro-steps, divided by their count).
std::vector<double> SerialAdamW(int world, int steps, int gas, double clip, const Config& c) {
  const auto specs = SmallModel();
  std::vector<double> w, m, v;
  std::vector<std::pair<int, int64_t>> index;  // (param, element)
  for (int i = 0; i < static_cast<int>(specs.size()); ++i) {
    int64_t n = 1;
    for (int64_t d : specs[i].shape) n *= d;
    for (int64_t k = 0; k < n; ++k) {
      w.push_back(InitValue(i, k));
      index.push_back({i, k});
    }
  }
  m.assign(w.size(), 0);
  v.assign(w.size(), 0);
  const auto& o = c.optimizer;
  for (int t = 1; t <= steps; ++t) {
    std::vector<double> g(w.size(), 0);
    for (size_t j = 0; j < w.size(); ++j) {
      for (int micro = 0; micro < gas; ++micro) {
        for (int r = 0; r < world; ++r) {
          g[j] += GradValue(r, t - 1, micro, index[j].first, index[j].second);
        }
      }
      g[j] /= world * gas;
    }
    double norm = 0;
    for (double x : g) norm += x * x;
    norm = std::sqrt(norm);
    const double coef = clip > 0 && norm > clip ? clip / (norm + 1e-6) : 1.0;
    for (size_t j = 0; j < w.size(); ++j) {
      const double gj = g[j] * coef;
      m[j] = o.beta1 * m[j] + (1 - o.beta1) * gj;
      v[j] = o.beta2 * v[j] + (1 - o.beta2) * gj * gj;
      const double mhat = m[j] / (1 - std::pow(o.beta1, t));
      const double vhat = v[j] / (1 - std::pow(o.beta2, t));
      w[j] -= o.lr * o.weight_decay * w[j];
      w[j] -= o.lr * mhat / (std::sqrt(vhat) + o.eps);
    }
  }
  return w;
}

TEST_CASE("Engine: fp32 training matches a serial double-precision AdamW within 1e-6",
          "[zero]") {
  for (int world : {1, 3}) {
    for (int gas : {1, 3}) {
      for (double clip : {0.0, 0.05}) {
        const Config c = MakeConfig(2, Precision::kFp32, gas, clip, false);
        RunResult run = Train(c, world, 20);
        RequireOk(run);
        const std::vector<double> ref = SerialAdamW(world, 20, gas, clip, c);
        REQUIRE(run.master[0].size() == ref.size());
        double worst = 0;
        for (size_t j = 0; j < ref.size(); ++j) {
          worst = std::max(worst, std::fabs(run.master[0][j] - ref[j]) / std::max(std::fabs(ref[j]), 1.0));
        }
        INFO("world=" << world << " gas=" << gas << " clip=" << clip << " worst=" << worst);
        CHECK(worst <= 1e-6);
      }
    }
  }
}

TEST_CASE("Engine: allocated bytes equal planned bytes for every memory kind", "[zero]") {
  for (int stage = 0; stage <= 3; ++stage) {
    for (bool offload : {false, true}) {
      if (stage == 0 && offload) continue;
      RunResult run = Train(MakeConfig(stage, Precision::kBf16, 3, 0, offload), 2, 1);
      RequireOk(run);
      for (int k = 0; k < memory::kNumMemoryKinds; ++k) {
        CHECK(run.report.allocated[k] == run.report.planned[k]);
      }
      CHECK((run.report.planned[1] > 0) == offload);
    }
  }
}

TEST_CASE("Engine: an overflow on one rank skips the step on every rank", "[zero]") {
  Config c = MakeConfig(2, Precision::kFp16, 1, 0, false);
  c.fp16.initial_scale_power = 4;
  c.fp16.hysteresis = 1;
  c.fp16.loss_scale_window = 3;
  RunResult clean = Train(c, 3, 2);  // the state after steps 0 and 1
  RequireOk(clean);
  RunResult run = Train(c, 3, 7, /*inject_step=*/2, /*inject_rank=*/1);
  RequireOk(run);
  REQUIRE(run.stats.size() == 7);
  // DeepSpeed's rule with hysteresis 1 and window 3: halve on the overflow, double after three
  // clean steps since it.
  const double expected[] = {16, 16, 16, 8, 8, 8, 16};
  for (int k = 0; k < 7; ++k) {
    INFO("step " << k);
    CHECK(run.stats[k].loss_scale == expected[k]);
    CHECK(run.stats[k].skipped == (k == 2));
  }
  CHECK(run.stats[2].step == 2);  // the skipped step did not advance t
  CHECK(run.stats[6].step == 6);
  for (int r = 1; r < 3; ++r) CHECK(BitEqual(run.master[r], run.master[0]));
  // Stopping right after the skipped step leaves exactly the state of two clean steps.
  RunResult to_skip = Train(c, 3, 3, 2, 1);
  RequireOk(to_skip);
  CHECK(BitEqual(to_skip.master[0], clean.master[0]));
}

TEST_CASE("Engine: overflow at the minimum loss scale is an error, not endless skipping",
          "[zero]") {
  Config c = MakeConfig(1, Precision::kFp16, 1, 0, false);
  c.fp16.initial_scale_power = 0;  // already at min_loss_scale = 1
  c.fp16.hysteresis = 1;
  RunResult run = Train(c, 2, 1, 0, 0);
  for (const absl::Status& s : run.errors) {
    REQUIRE_FALSE(s.ok());
    CHECK(s.code() == absl::StatusCode::kFailedPrecondition);
    CHECK_THAT(std::string(s.message()), Catch::Contains("min_loss_scale"));
  }
}

TEST_CASE("Engine: misuse is an error naming the call", "[zero]") {
  auto comms = comm::CreateInProcessGroup(1).value();
  auto device = CreateCpuDevice(1);
  Config c = MakeConfig(3, Precision::kBf16, 1, 0, false);
  auto engine = Engine::Create(c, SmallModel(), comms[0].get(), device.get());
  REQUIRE(engine.ok());
  Engine& e = **engine;
  auto missing = e.Step();
  REQUIRE_FALSE(missing.ok());
  CHECK_THAT(std::string(missing.status().message()), Catch::Contains("GradReady('"));
  CHECK(e.Gather(e.num_units()).code() == absl::StatusCode::kOutOfRange);
  // A non-persistent unit's parameters need a Gather first.
  int big = -1;
  for (int u = 0; u < e.num_units(); ++u) {
    if (!e.plan().units[u].persistent) big = u;
  }
  REQUIRE(big >= 0);
  const int p = e.plan().units[big].params[0];
  CHECK(e.param(p).status().code() == absl::StatusCode::kFailedPrecondition);
  REQUIRE(e.Gather(big).ok());
  CHECK(e.param(p).ok());
  CHECK(e.Gather(big).code() == absl::StatusCode::kFailedPrecondition);
  REQUIRE(e.Release(big).ok());
  CHECK(e.Release(big).code() == absl::StatusCode::kFailedPrecondition);
  REQUIRE(e.GradReady(0).ok());
  auto twice = e.GradReady(0);
  CHECK(twice.code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(twice.message()), Catch::Contains("embed.w"));
}

TEST_CASE("Engine: ranks that registered different models are told so", "[zero]") {
  auto comms = comm::CreateInProcessGroup(2, {5000}).value();
  auto device = CreateCpuDevice(1);
  std::vector<absl::Status> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      auto specs = SmallModel();
      if (r == 1) specs[3].shape = {63, 9};
      errors[r] = Engine::Create(MakeConfig(0, Precision::kBf16, 1, 0, false), specs,
                                 comms[r].get(), device.get())
                      .status();
    });
  }
  for (auto& t : threads) t.join();
  for (const absl::Status& s : errors) {
    REQUIRE_FALSE(s.ok());
    CHECK_THAT(std::string(s.message()), Catch::Contains("disagree on the model"));
  }
}

}  // namespace
}  // namespace zerort
