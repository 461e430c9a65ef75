// Accumulation without communication (zerort.local_grad_accumulation, SetGradientSync): the
// micro-steps of a window sum their gradients locally and the last one reduces once.
//
// Where the arithmetic is the same the results are the same bit for bit: on one rank (the
// average over one rank is exact, and the micro-step sums are the same additions in the same
// order) and with every micro-step synced. On several ranks the sum order changes: the
// reducing mode computes sum_m (sum_r g[r][m]) / W, the local mode (sum_r (sum_m g[r][m])) / W.
// Each is the exact value with (W - 1) + (G - 1) + 1 fp32 roundings of partial sums, so each
// differs from it by at most gamma(W + G) * sum |g| / W, gamma(n) = n u / (1 - n u), u = 2^-24
// (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., section 4.2), and the two
// by twice that per element. The tests check the step's gradient norms against that bound
// (plus each norm's own rounding, gamma(N + 1) times the norm over N elements) and the final
// weights against a serial double-precision AdamW, as the engine's fp32 tests do (1e-6).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "base/status.h"
#include "base/testing/checks.h"
#include "comm/inprocess.h"
#include "comm/testing/on_ranks.h"
#include "device/cpu_device.h"
#include "memory/plan.h"
#include "zero/engine.h"
#include "zero/testing/synthetic_trainer.h"

namespace zerort {
namespace {

using testing::BitEqual;
using memory::ParamSpec;

struct Run {
  std::vector<std::vector<float>> master;  // per rank
  std::vector<StepStats> stats;            // rank 0, per boundary
  MemoryReport report;
};

// `sync(micro)`: the SetGradientSync call before micro-step `micro` of each window, if any.
using SyncPattern = std::function<std::optional<bool>(int micro)>;

Run Train(const Config& c, int world, int steps, const SyncPattern& sync = nullptr) {
  auto device = CreateCpuDevice();
  Run run;
  run.master.resize(world);
  const std::vector<absl::Status> st = comm::testing::OnRanks(
      world, {c.comm_timeout_ms}, [&](int r, comm::Communicator* comm) -> absl::Status {
        ASSIGN_OR_RETURN(auto e, Engine::Create(c, testing::SmallModel(), comm, device.get()));
        RETURN_IF_ERROR(testing::SetInitValues(*e));
        if (r == 0) run.report = e->memory_report();
        std::vector<std::vector<char>> host;
        for (int step = 0; step < steps; ++step) {
          for (int micro = 0; micro < c.gradient_accumulation_steps; ++micro) {
            if (sync) {
              if (std::optional<bool> s = sync(micro)) RETURN_IF_ERROR(e->SetGradientSync(*s));
            }
            RETURN_IF_ERROR(testing::Backward(*e, step, micro, &host));
            ASSIGN_OR_RETURN(StepStats s, e->Step());
            RETURN_IF_ERROR(e->device()->Synchronize(e->compute_stream()));
            host.clear();
            if (r == 0 && s.boundary) run.stats.push_back(s);
          }
        }
        ASSIGN_OR_RETURN(run.master[r], e->GatherMasterWeights());
        return absl::OkStatus();
      });
  for (const absl::Status& s : st) {
    INFO(s.ToString());
    REQUIRE(s.ok());
  }
  return run;
}

Config LocalConfig(int stage, DType precision, int gas, double clip, bool local) {
  Config c = testing::TestConfig(stage, precision, gas, clip, /*offload=*/false);
  c.local_grad_accumulation = local;
  return c;
}

TEST_CASE("Local accumulation: one rank gives the reducing mode's results bit for bit",
          "[zero]") {
  for (DType precision : {DType::kF32, DType::kBF16}) {
    for (int stage : {0, 1}) {
      for (double clip : {0.0, 0.05}) {
        INFO(DTypeName(precision) << " stage " << stage << " clip " << clip);
        const Run reducing = Train(LocalConfig(stage, precision, 3, clip, false), 1, 6);
        const Run local = Train(LocalConfig(stage, precision, 3, clip, true), 1, 6);
        CHECK(BitEqual(local.master[0], reducing.master[0]));
        // No communication at all inside a window: one rank sends nothing in either mode, so
        // the bytes are checked on the plan (below); here, every micro-step but the last
        // issued no reduction, which the stats cannot see but the results would.
        for (int k = 0; k < memory::kNumMemoryKinds; ++k) {
          CHECK(local.report.allocated[k] == local.report.planned[k]);
        }
      }
    }
  }
}

TEST_CASE("Local accumulation: syncing every micro-step is the reducing mode, bit for bit",
          "[zero]") {
  for (int stage : {0, 1}) {
    const Run reducing = Train(LocalConfig(stage, DType::kBF16, 3, 0.05, false), 3, 4);
    const Run synced = Train(LocalConfig(stage, DType::kBF16, 3, 0.05, true), 3, 4,
                             [](int micro) -> std::optional<bool> {
                               if (micro == 0) return true;
                               return std::nullopt;
                             });
    for (int r = 0; r < 3; ++r) CHECK(BitEqual(synced.master[r], reducing.master[0]));
  }
}

double Gamma(double n) {
  const double u = std::ldexp(1.0, -24);
  return n * u / (1 - n * u);
}

TEST_CASE("Local accumulation: several ranks stay within the derived bound of the reducing mode",
          "[zero]") {
  const int gas = 4, steps = 5;
  const testing::FlatInit flat = testing::SmallModelFlatInit();
  const double n_elements = static_cast<double>(flat.w.size());
  for (int world : {2, 3}) {
    for (int stage : {0, 1}) {
      INFO("world " << world << " stage " << stage);
      const Config reducing_config = LocalConfig(stage, DType::kF32, gas, 0, false);
      const Run reducing = Train(reducing_config, world, steps);
      // Local sums, and a mix: the first micro-step reduces, the middle ones sum locally.
      const Run local = Train(LocalConfig(stage, DType::kF32, gas, 0, true), world, steps);
      const Run mixed = Train(LocalConfig(stage, DType::kF32, gas, 0, true), world, steps,
                              [](int micro) -> std::optional<bool> { return micro == 0; });
      REQUIRE(local.stats.size() == static_cast<size_t>(steps));
      for (int t = 0; t < steps; ++t) {
        // ||A||: the norm of sum |g| / (W G), and the norm of the mean gradient.
        double a2 = 0, g2 = 0;
        for (const auto& [param, k] : flat.at) {
          double a = 0, g = 0;
          for (int micro = 0; micro < gas; ++micro) {
            for (int r = 0; r < world; ++r) {
              const double x = testing::GradValue(r, t, micro, param, k);
              a += std::fabs(x);
              g += x;
            }
          }
          a2 += (a / (world * gas)) * (a / (world * gas));
          g2 += (g / (world * gas)) * (g / (world * gas));
        }
        const double bound = 2 * Gamma(world + gas) * std::sqrt(a2) +
                             2 * Gamma(n_elements + 1) * std::sqrt(g2);
        INFO("step " << t << " bound " << bound);
        CHECK(std::fabs(local.stats[t].grad_norm - reducing.stats[t].grad_norm) <= bound);
        CHECK(std::fabs(mixed.stats[t].grad_norm - reducing.stats[t].grad_norm) <= bound);
        // Bytes sent in the window: the reducing mode reduces G times, the mixed run twice and
        // the local run once (the all-gathers after the step are alike).
        const int64_t one_reduction = mixed.stats[t].comm_bytes - local.stats[t].comm_bytes;
        CHECK(one_reduction > 0);
        CHECK(reducing.stats[t].comm_bytes - local.stats[t].comm_bytes ==
              (gas - 1) * one_reduction);
      }
      const std::vector<double> ref = testing::SerialAdamW(testing::SmallModel(), world, steps, gas,
                                                           0.0, reducing_config.optimizer);
      for (const Run* run : {&reducing, &local, &mixed}) {
        double worst = 0;
        for (size_t j = 0; j < ref.size(); ++j) {
          worst = std::max(worst, std::fabs(run->master[0][j] - ref[j]) /
                                      std::max(std::fabs(ref[j]), 1.0));
        }
        INFO("worst " << worst);
        CHECK(worst <= 1e-6);
      }
    }
  }
}

TEST_CASE("Local accumulation: the plan reduces once per window and holds grad_local",
          "[memory]") {
  const std::vector<ParamSpec> specs = testing::SmallModel();
  for (int stage : {0, 1}) {
    for (DType precision : {DType::kF32, DType::kBF16}) {
      memory::PlanOptions o;
      o.stage = stage;
      o.world_size = 4;
      o.compute_dtype = precision;
      o.unit_target_elements = 200;
      o.gradient_accumulation_steps = 1;
      const memory::Plan one = memory::MakePlan(specs, o).value();
      o.gradient_accumulation_steps = 5;
      const memory::Plan reducing = memory::MakePlan(specs, o).value();
      o.local_grad_accumulation = true;
      const memory::Plan local = memory::MakePlan(specs, o).value();
      // One window of 5 micro-steps sends what one micro-step of the reducing mode sends.
      CHECK(local.comm_bytes_per_step == one.comm_bytes_per_step);
      CHECK(reducing.comm_bytes_per_step > local.comm_bytes_per_step);
      const memory::Buffer* buffer = local.Find(memory::BufferClass::kGradLocal);
      REQUIRE(buffer != nullptr);
      CHECK(buffer->bytes ==
            local.padded_elements * static_cast<int64_t>(DTypeSize(precision)));
      CHECK(reducing.Find(memory::BufferClass::kGradLocal) == nullptr);
    }
  }
}

TEST_CASE("Local accumulation: refused at stages 2-3 and where no local buffer is planned",
          "[zero]") {
  auto device = CreateCpuDevice();
  auto comms = comm::CreateInProcessGroup(1, {20000}).value();
  for (int stage : {2, 3}) {
    auto e = Engine::Create(LocalConfig(stage, DType::kF32, 2, 0, true), testing::SmallModel(),
                            comms[0].get(), device.get());
    REQUIRE(e.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(e.status().message().find("zerort.local_grad_accumulation") != std::string::npos);
  }
  auto e = Engine::Create(LocalConfig(1, DType::kF32, 2, 0, false), testing::SmallModel(),
                          comms[0].get(), device.get());
  REQUIRE(e.ok());
  CHECK((*e)->SetGradientSync(true).ok());
  const absl::Status off = (*e)->SetGradientSync(false);
  CHECK(off.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(off.message().find("zerort.local_grad_accumulation") != std::string::npos);

  auto local = Engine::Create(LocalConfig(1, DType::kF32, 2, 0, true), testing::SmallModel(),
                              comms[0].get(), device.get());
  REQUIRE(local.ok());
  REQUIRE(testing::SetInitValues(**local).ok());
  REQUIRE((*local)->GradReadyUnit(0).ok());
  CHECK((*local)->SetGradientSync(true).code() == absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace zerort
