// The gradient paths of the engine: fp32 accumulation and reduction (grad_accum_dtype,
// communication_dtype), reference-counted gathers, and gradient hand-off without a copy.
#include <algorithm>
#include <cmath>
#include <limits>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "base/half.h"
#include "comm/inprocess.h"
#include "device/cpu_device.h"
#include "offload/cpu_adamw.h"
#include "zero/engine.h"
#include "zero/testing/synthetic_trainer.h"

namespace zerort {
namespace {

using testing::GradValue;
using testing::InitValue;
using testing::SmallModel;

// Runs testing::TrainRank on `world` in-process ranks; returns rank 0's master weights.
std::vector<float> TrainMasters(const Config& config, int world, int steps) {
  auto comms = comm::CreateInProcessGroup(world, {config.comm_timeout_ms}).value();
  auto device = CreateCpuDevice(CpuDeviceOptions{});
  std::vector<absl::StatusOr<testing::TrainResult>> runs(world, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      runs[r] = testing::TrainRank(config, SmallModel(), comms[r].get(), device.get(), steps);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < world; ++r) REQUIRE(runs[r].status().ok());
  return runs[0]->master;
}

// The masters after `steps` AdamW steps on the same bf16 gradients, averaged over ranks and
// summed over micro-steps in double and rounded to fp32 once: fp32 accumulation without any
// intermediate rounding.
std::vector<float> ReferenceMasters(const Config& config, int world, int steps) {
  std::vector<float> master, m, v;
  std::vector<int64_t> sizes;
  for (const memory::ParamSpec& s : SmallModel()) {
    int64_t n = 1;
    for (int64_t d : s.shape) n *= d;
    sizes.push_back(n);
    for (int64_t k = 0; k < n; ++k) master.push_back(InitValue(static_cast<int>(sizes.size()) - 1, k));
  }
  m.assign(master.size(), 0.0f);
  v.assign(master.size(), 0.0f);
  const int gas = config.gradient_accumulation_steps;
  const OptimizerConfig& oc = config.optimizer;
  for (int step = 0; step < steps; ++step) {
    std::vector<float> g;
    for (size_t i = 0; i < sizes.size(); ++i) {
      for (int64_t k = 0; k < sizes[i]; ++k) {
        double sum = 0;
        for (int micro = 0; micro < gas; ++micro) {
          for (int r = 0; r < world; ++r) {
            sum += Bf16ToFloat(FloatToBf16(GradValue(r, step, micro, static_cast<int>(i), k)));
          }
        }
        g.push_back(static_cast<float>(sum / world));
      }
    }
    auto params = offload::MakeAdamWStepParams(oc.lr, oc.beta1, oc.beta2, oc.eps,
                                               oc.weight_decay, step + 1).value();
    offload::AdamWArrays a{master.data(), m.data(), v.data(), g.data(), DType::kF32,
                           nullptr, DType::kF32, master.size()};
    REQUIRE(offload::CpuAdamW(a, params, static_cast<float>(1.0 / gas), 1).ok());
  }
  return master;
}

double MaxGap(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double gap = 0;
  for (size_t k = 0; k < a.size(); ++k) gap = std::max(gap, std::fabs(double(a[k]) - b[k]));
  return gap;
}

// The reference sums exactly; fp32 accumulation of world * gas terms rounds each partial sum
// at most once (relative error <= (world * gas) * FLT_EPSILON of the gradient), and AdamW's
// update m / sqrt(v) moves each weight by at most lr per step, so the masters may differ by at
// most that relative error times lr per step. bf16 rounds each partial sum to 8 bits instead.
double Fp32Bound(const Config& c, int world, int steps) {
  return steps * c.optimizer.lr * world * c.gradient_accumulation_steps *
         std::numeric_limits<float>::epsilon();
}

TEST_CASE("Engine: fp32 accumulation and reduction close the gap to fp32 rounding", "[engine]") {
  constexpr int kWorld = 2, kSteps = 4;
  for (int stage : {0, 1, 2, 3}) {
    for (int gas : {1, 3}) {
      CAPTURE(stage, gas);
      Config c = testing::TestConfig(stage, DType::kBF16, gas, 0.0, false);
      const std::vector<float> ref = ReferenceMasters(c, kWorld, kSteps);
      const double bound = Fp32Bound(c, kWorld, kSteps);
      const double bf16_gap = MaxGap(TrainMasters(c, kWorld, kSteps), ref);
      c.grad_accum_dtype = DType::kF32;
      c.communication_dtype = DType::kF32;
      const double fp32_gap = MaxGap(TrainMasters(c, kWorld, kSteps), ref);
      CAPTURE(bf16_gap, fp32_gap, bound);
      CHECK(bf16_gap > 10 * bound);  // the default (2-byte) path really rounds
      CHECK(fp32_gap <= bound);
    }
  }
}

TEST_CASE("Engine: fp32 accumulation alone is exact where nothing is reduced", "[engine]") {
  for (int stage : {0, 2}) {
    CAPTURE(stage);
    Config c = testing::TestConfig(stage, DType::kBF16, /*gas=*/3, 0.0, false);
    c.grad_accum_dtype = DType::kF32;  // bf16 on the wire: one rank rounds nothing there
    const std::vector<float> ref = ReferenceMasters(c, 1, 4);
    CHECK(MaxGap(TrainMasters(c, 1, 4), ref) <= Fp32Bound(c, 1, 4));
  }
}

}  // namespace
}  // namespace zerort
