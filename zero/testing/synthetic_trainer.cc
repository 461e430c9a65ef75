#include "zero/testing/synthetic_trainer.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/dtype.h"
#include "base/status.h"
#include "comm/testing/on_ranks.h"

namespace zerort {
namespace testing {
namespace {

float Noise(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  uint64_t x = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull) * 0xBF58476D1CE4E5B9ull ^
               (c + 1) * 0x94D049BB133111EBull ^ (d + 7) * 0xD6E8FEB86659FD93ull;
  x ^= x >> 31;
  x *= 0x7FB5D329728EA185ull;
  x ^= x >> 27;
  return static_cast<float>(static_cast<double>(x >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

}  // namespace

std::vector<memory::ParamSpec> SmallModel() {
  return {{"embed.w", {37, 5}, "embed"},  {"l0.w", {13, 11}, "l0"}, {"l0.b", {13}, "l0"},
          {"l1.w", {64, 9}, "l1"},        {"l1.b", {1}, "l1"},      {"l2.w", {3, 7, 2}, "l2"},
          {"head.w", {101}, "head"}};
}

float InitValue(int param, int64_t e) { return Noise(999, param, e, 3); }

FlatInit SmallModelFlatInit() {
  FlatInit out;
  const std::vector<memory::ParamSpec> specs = SmallModel();
  for (int i = 0; i < static_cast<int>(specs.size()); ++i) {
    const int64_t n = specs[i].numel();
    for (int64_t k = 0; k < n; ++k) {
      out.w.push_back(InitValue(i, k));
      out.at.push_back({i, k});
    }
  }
  return out;
}

std::vector<double> SerialAdamW(const std::vector<memory::ParamSpec>& specs, int world,
                                int steps, int gas, double clip, const OptimizerConfig& o) {
  std::vector<double> w;
  std::vector<std::pair<int, int64_t>> at;
  for (int i = 0; i < static_cast<int>(specs.size()); ++i) {
    for (int64_t k = 0; k < specs[i].numel(); ++k) {
      w.push_back(InitValue(i, k));
      at.push_back({i, k});
    }
  }
  std::vector<double> m(w.size(), 0), v(w.size(), 0);
  for (int t = 1; t <= steps; ++t) {
    std::vector<double> g(w.size(), 0);
    double norm = 0;
    for (size_t j = 0; j < w.size(); ++j) {
      if (specs[at[j].first].frozen) continue;
      for (int micro = 0; micro < gas; ++micro) {
        for (int r = 0; r < world; ++r) {
          g[j] += GradValue(r, t - 1, micro, at[j].first, at[j].second);
        }
      }
      g[j] /= world * gas;
      norm += g[j] * g[j];
    }
    norm = std::sqrt(norm);
    const double coef = clip > 0 && norm > clip ? clip / (norm + 1e-6) : 1.0;
    for (size_t j = 0; j < w.size(); ++j) {
      if (specs[at[j].first].frozen) continue;
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

float GradValue(int rank, int step, int micro, int param, int64_t e) {
  return 0.5f * Noise(rank, step * 16 + micro, param, static_cast<uint64_t>(e));
}

Config TestConfig(int stage, DType precision, int gas, double clip, bool offload) {
  Config c;
  c.zero.stage = stage;
  c.compute_dtype = precision;
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

absl::Status Backward(Engine& e, int step, int micro, std::vector<std::vector<char>>* host,
                      float factor, bool overflow) {
  const int r = e.communicator()->rank();
  const DType dtype = e.plan().options.compute_dtype;
  // Forward visits units in forward order (the plan lists them in backward order).
  for (int u = e.num_units() - 1; u >= 0; --u) {
    RETURN_IF_ERROR(e.Gather(u));
    for (int i : e.plan().units[u].params) RETURN_IF_ERROR(e.param(i).status());
    RETURN_IF_ERROR(e.Release(u));
  }
  for (int u = 0; u < e.num_units(); ++u) {
    RETURN_IF_ERROR(e.Gather(u));
    for (int i : e.plan().units[u].params) {
      if (e.frozen(i)) continue;  // no gradient: backward only reads it
      ASSIGN_OR_RETURN(void* g, e.grad(i));
      const int64_t n = e.plan().params[i].numel;
      // Built on the host and copied in on the compute stream, without waiting, as a
      // trainer's backward writes device memory: the engine must order what follows.
      host->emplace_back(n * DTypeSize(dtype));
      for (int64_t k = 0; k < n; ++k) {
        float v = static_cast<float>(GradValue(r, step, micro, i, k) * factor * e.loss_scale());
        if (overflow && k == 0) v = INFINITY;
        StoreAs(dtype, host->back().data(), k, v);
      }
      RETURN_IF_ERROR(
          e.device()->Copy(g, host->back().data(), host->back().size(), e.compute_stream()));
      RETURN_IF_ERROR(e.GradReady(i));
    }
    RETURN_IF_ERROR(e.Release(u));
  }
  return absl::OkStatus();
}

absl::Status TrainSteps(Engine& e, int first, int steps, const std::vector<int>& overflow_steps,
                        int overflow_rank, std::vector<StepStats>* stats) {
  const int r = e.communicator()->rank();
  std::vector<std::vector<char>> host;  // this micro-step's gradients, until copied
  for (int step = first; step < first + steps; ++step) {
    const bool overflow =
        r == overflow_rank &&
        std::find(overflow_steps.begin(), overflow_steps.end(), step) != overflow_steps.end();
    for (int micro = 0; micro < e.config().gradient_accumulation_steps; ++micro) {
      RETURN_IF_ERROR(Backward(e, step, micro, &host, 1.0f, overflow && micro == 0));
      ASSIGN_OR_RETURN(StepStats s, e.Step());
      RETURN_IF_ERROR(e.device()->Synchronize(e.compute_stream()));  // `host` is reused
      host.clear();
      if (stats != nullptr && s.boundary) stats->push_back(s);
    }
  }
  return absl::OkStatus();
}

absl::Status SetInitValues(Engine& engine, float offset) {
  return engine.InitParams([offset](int i, const memory::ParamSpec& spec, float* v) {
    const int64_t n = spec.numel();
    for (int64_t k = 0; k < n; ++k) v[k] = InitValue(i, k) + offset;
  });
}

absl::StatusOr<TrainResult> TrainRank(const Config& config,
                                      const std::vector<memory::ParamSpec>& specs,
                                      comm::Communicator* comm, Device* device, int steps,
                                      int inject_step, int inject_rank,
                                      Device::Stream compute_stream) {
  EngineOptions options;
  options.compute_stream = compute_stream;
  ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                   Engine::Create(config, specs, comm, device, options));
  RETURN_IF_ERROR(SetInitValues(*engine));
  TrainResult result;
  result.report = engine->memory_report();
  std::vector<int> overflow_steps;
  if (inject_step >= 0) overflow_steps.push_back(inject_step);
  RETURN_IF_ERROR(TrainSteps(*engine, 0, steps, overflow_steps, inject_rank, &result.stats));
  ASSIGN_OR_RETURN(result.master, engine->GatherMasterWeights());
  // What forward would read next, through the trainer's API (stage 3 gathers each unit).
  const size_t c = DTypeSize(engine->plan().options.compute_dtype);
  for (int u = 0; u < engine->num_units(); ++u) {
    RETURN_IF_ERROR(engine->Gather(u));
    for (int i : engine->plan().units[u].params) {
      ASSIGN_OR_RETURN(void* p, engine->param(i));
      const size_t bytes = static_cast<size_t>(engine->plan().params[i].numel) * c;
      const size_t at = result.params.size();
      result.params.resize(at + bytes);
      RETURN_IF_ERROR(engine->device()->Copy(result.params.data() + at, p, bytes,
                                             engine->compute_stream()));
      RETURN_IF_ERROR(engine->device()->Synchronize(engine->compute_stream()));
    }
    RETURN_IF_ERROR(engine->Release(u));
  }
  return result;
}

absl::StatusOr<std::vector<TrainResult>> TrainRanks(const Config& config,
                                                    const std::vector<memory::ParamSpec>& specs,
                                                    int world, Device* device, int steps,
                                                    int inject_step, int inject_rank) {
  std::vector<TrainResult> runs(world);
  const std::vector<absl::Status> st = comm::testing::OnRanks(
      world, {config.comm_timeout_ms}, [&](int r, comm::Communicator* comm) -> absl::Status {
        ASSIGN_OR_RETURN(runs[r], TrainRank(config, specs, comm, device, steps, inject_step,
                                            inject_rank));
        return absl::OkStatus();
      });
  for (int r = 0; r < world; ++r) {
    if (!st[r].ok()) return Annotate(st[r], absl::StrCat("rank ", r));
  }
  return runs;
}

}  // namespace testing
}  // namespace zerort
