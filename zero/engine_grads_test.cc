// The gradient paths of the engine: fp32 accumulation and reduction (grad_accum_dtype,
// communication_dtype), reference-counted gathers, and gradient hand-off without a copy.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <limits>
#include <memory>
#include <vector>

#include <catch2/catch.hpp>

#include "base/half.h"
#include "base/status.h"
#include "comm/testing/on_ranks.h"
#include "device/cpu_device.h"
#include "offload/cpu_adamw.h"
#include "zero/engine.h"
#include "zero/testing/synthetic_trainer.h"

namespace zerort {
namespace {

using testing::GradValue;
using testing::InitValue;
using testing::SmallModel;

// testing::TrainRanks of the small model, REQUIREd to succeed.
std::vector<testing::TrainResult> TrainRanks(const Config& config, int world, int steps,
                                             int inject_step = -1, int inject_rank = -1) {
  auto device = CreateCpuDevice(CpuDeviceOptions{});
  auto runs = testing::TrainRanks(config, SmallModel(), world, device.get(), steps, inject_step,
                                  inject_rank);
  REQUIRE(runs.status().ToString() == "OK");
  return *std::move(runs);
}

// Rank 0's master weights after TrainRanks.
std::vector<float> TrainMasters(const Config& config, int world, int steps) {
  return TrainRanks(config, world, steps)[0].master;
}

// The masters after `steps` AdamW steps on the same bf16 gradients, averaged over ranks and
// summed over micro-steps in double and rounded to fp32 once: fp32 accumulation without any
// intermediate rounding.
// `bf16_accum`: instead, each micro-step's fp32 average is rounded to bf16 and added into a
// bf16 accumulator (fp32 on the wire, 2-byte accumulation).
std::vector<float> ReferenceMasters(const Config& config, int world, int steps,
                                    bool bf16_accum = false) {
  std::vector<float> master, m, v;
  std::vector<int64_t> sizes;
  for (const memory::ParamSpec& s : SmallModel()) {
    const int64_t n = s.numel();
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
        float acc = 0;  // bf16_accum: a bf16 value
        for (int micro = 0; micro < gas; ++micro) {
          double micro_sum = 0;
          for (int r = 0; r < world; ++r) {
            micro_sum +=
                Bf16ToFloat(FloatToBf16(GradValue(r, step, micro, static_cast<int>(i), k)));
          }
          sum += micro_sum;
          const float x = Bf16ToFloat(FloatToBf16(static_cast<float>(micro_sum / world)));
          acc = micro == 0 ? x : Bf16ToFloat(FloatToBf16(acc + x));
        }
        g.push_back(bf16_accum ? acc : static_cast<float>(sum / world));
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

// Optimizer offload moves the fp32 gradients to the host AdamW as they are: the masters equal
// the on-device fp32 path's bit for bit (DeepSpeed configs pair grad_accum_dtype fp32 with
// offload_optimizer).
TEST_CASE("Engine: fp32 gradients through optimizer offload equal the on-device path",
          "[engine]") {
  for (int stage : {1, 2, 3}) {
    for (int gas : {1, 3}) {
      CAPTURE(stage, gas);
      Config c = testing::TestConfig(stage, DType::kBF16, gas, 0.0, false);
      c.grad_accum_dtype = c.communication_dtype = DType::kF32;
      const std::vector<float> on_device = TrainMasters(c, 2, 4);
      c.zero.offload_optimizer.device = OffloadDevice::kCpu;
      const std::vector<float> offloaded = TrainMasters(c, 2, 4);
      REQUIRE(offloaded.size() == on_device.size());
      CHECK(std::memcmp(offloaded.data(), on_device.data(), on_device.size() * 4) == 0);
    }
  }
}

TEST_CASE("Engine: an fp16 overflow is still seen through fp32 gradients", "[engine]") {
  for (int stage : {0, 2}) {
    CAPTURE(stage);
    Config c = testing::TestConfig(stage, DType::kF16, /*gas=*/2, 0.0, false);
    c.grad_accum_dtype = c.communication_dtype = DType::kF32;
    const std::vector<StepStats> stats =
        TrainRanks(c, 2, 3, /*inject_step=*/1, /*inject_rank=*/1)[0].stats;
    REQUIRE(stats.size() == 3);
    CHECK_FALSE(stats[0].skipped);
    CHECK(stats[1].skipped);
    CHECK_FALSE(stats[2].skipped);
    CHECK(stats[2].step == 2);
  }
}

// With one rank nothing is reduced, so the fp32 accumulator alone keeps the exact sum. (At
// world 2 it does not: each micro-step's average arrives rounded to bf16 from a bf16 wire,
// and the masters stay about 2e-2 from the reference; both options are needed there.)
TEST_CASE("Engine: fp32 accumulation alone is exact where nothing is reduced", "[engine]") {
  for (int stage : {0, 2}) {
    CAPTURE(stage);
    Config c = testing::TestConfig(stage, DType::kBF16, /*gas=*/3, 0.0, false);
    c.grad_accum_dtype = DType::kF32;
    const std::vector<float> ref = ReferenceMasters(c, 1, 4);
    CHECK(MaxGap(TrainMasters(c, 1, 4), ref) <= Fp32Bound(c, 1, 4));
    const std::vector<float> ref2 = ReferenceMasters(c, 2, 4);
    CHECK(MaxGap(TrainMasters(c, 2, 4), ref2) > 10 * Fp32Bound(c, 2, 4));
  }
}

// The conversion path: fp32 on the wire, the result rounded back to bf16 and added in bf16.
TEST_CASE("Engine: an fp32 wire alone rounds each micro-step's average to bf16 once",
          "[engine]") {
  for (int stage : {0, 1, 2, 3}) {
    CAPTURE(stage);
    Config c = testing::TestConfig(stage, DType::kBF16, /*gas=*/3, 0.0, false);
    c.communication_dtype = DType::kF32;
    const std::vector<float> ref = ReferenceMasters(c, 2, 4, /*bf16_accum=*/true);
    CHECK(MaxGap(TrainMasters(c, 2, 4), ref) <= Fp32Bound(c, 2, 4));
  }
}

// Runs fn(engine) on `world` in-process ranks, each with its own engine over `config` and the
// small model with InitValue parameters; returns each rank's status.
std::vector<absl::Status> OnEngines(const Config& config, int world,
                                    const std::function<absl::Status(Engine&)>& fn) {
  auto device = CreateCpuDevice(CpuDeviceOptions{});
  return comm::testing::OnRanks(
      world, {config.comm_timeout_ms}, [&](int, comm::Communicator* comm) -> absl::Status {
        ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                         Engine::Create(config, SmallModel(), comm, device.get()));
        RETURN_IF_ERROR(testing::SetInitValues(*engine));
        return fn(*engine);
      });
}

absl::Status Expect(bool cond, const std::string& what) {
  return cond ? absl::OkStatus() : absl::InternalError("expected: " + what);
}

absl::Status ExpectError(const absl::Status& st, absl::StatusCode code, const std::string& has) {
  return Expect(st.code() == code && std::string(st.message()).find(has) != std::string::npos,
                "an error containing '" + has + "', got: " + st.ToString());
}

// Parameter i is readable and holds bf16(InitValue).
absl::Status ExpectReadable(Engine& e, int i) {
  void* p = nullptr;
  ASSIGN_OR_RETURN(p, e.param(i));
  std::vector<uint16_t> host(3);
  RETURN_IF_ERROR(e.device()->Copy(host.data(), p, 6, e.compute_stream()));
  RETURN_IF_ERROR(e.device()->Synchronize(e.compute_stream()));
  for (int k = 0; k < 3; ++k) {
    RETURN_IF_ERROR(Expect(host[k] == FloatToBf16(InitValue(i, k)), "gathered values"));
  }
  return absl::OkStatus();
}

TEST_CASE("Engine: Acquire/Release count holds per unit (tied parameter, nesting)", "[engine]") {
  // SmallModel: 0 embed.w, 1-2 l0, 3-4 l1, 5 l2, 6 head.w; the head reuses embed.w (tied).
  const std::vector<int> embed = {0}, layer0 = {1, 2}, head = {6, 0};
  const auto code = absl::StatusCode::kFailedPrecondition;
  const Config c = testing::TestConfig(3, DType::kBF16, 1, 0.0, false);
  const std::vector<absl::Status> st = OnEngines(c, 2, [&](Engine& e) -> absl::Status {
    RETURN_IF_ERROR(Expect(!e.plan().units[e.unit_of(0)].persistent, "embed.w is gathered"));
    RETURN_IF_ERROR(Expect(e.unit_of(0) != e.unit_of(6), "head and embed in different units"));
    RETURN_IF_ERROR(e.AcquireParams(embed));  // forward: the embedding
    RETURN_IF_ERROR(ExpectReadable(e, 0));
    RETURN_IF_ERROR(e.AcquireParams(layer0));
    RETURN_IF_ERROR(ExpectReadable(e, 1));
    RETURN_IF_ERROR(e.ReleaseParams(layer0));
    RETURN_IF_ERROR(e.AcquireParams(head));  // the head needs embed.w again while it is still held
    RETURN_IF_ERROR(e.ReleaseParams(embed));
    RETURN_IF_ERROR(ExpectReadable(e, 0));  // the head's hold keeps it
    RETURN_IF_ERROR(ExpectReadable(e, 6));
    // The unit call refuses a unit held by parameter: Gather/Release(unit) do not count.
    RETURN_IF_ERROR(ExpectError(e.Gather(e.unit_of(0)), code, "already gathered"));
    RETURN_IF_ERROR(e.ReleaseParams(head));
    RETURN_IF_ERROR(ExpectError(e.param(0).status(), code, "is not gathered"));
    RETURN_IF_ERROR(ExpectError(e.ReleaseParams(embed), code, "parameter 'embed.w'"));
    RETURN_IF_ERROR(ExpectError(e.AcquireParams(std::vector<int>{7}), absl::StatusCode::kOutOfRange,
                                "Acquire(7)"));
    RETURN_IF_ERROR(e.Gather(e.unit_of(0)));  // the unit calls still work
    RETURN_IF_ERROR(ExpectReadable(e, 0));
    return e.Release(e.unit_of(0));
  });
  for (const absl::Status& s : st) CHECK(s.ToString() == "OK");
}

TEST_CASE("Engine: too few gather slots name the setting; a failed Acquire holds nothing",
          "[engine]") {
  Config c = testing::TestConfig(3, DType::kBF16, 1, 0.0, false);
  c.zero.stage3_prefetch_bucket_size = 0;  // one gather slot
  const std::vector<absl::Status> st = OnEngines(c, 2, [&](Engine& e) -> absl::Status {
    RETURN_IF_ERROR(Expect(e.plan().gather_slots == 1, "one slot"));
    RETURN_IF_ERROR(ExpectError(e.AcquireParams(std::vector<int>{0, 1}),
                                absl::StatusCode::kFailedPrecondition,
                                "zero_optimization.stage3_prefetch_bucket_size"));
    RETURN_IF_ERROR(ExpectError(e.ReleaseParams(std::vector<int>{0}),
                                absl::StatusCode::kFailedPrecondition, "'embed.w'"));
    RETURN_IF_ERROR(e.AcquireParams(std::vector<int>{1}));
    RETURN_IF_ERROR(ExpectReadable(e, 1));
    return e.ReleaseParams(std::vector<int>{1});
  });
  for (const absl::Status& s : st) CHECK(s.ToString() == "OK");
}

TEST_CASE("Engine: holds are counted in stage 0 too", "[engine]") {
  const Config c = testing::TestConfig(0, DType::kBF16, 1, 0.0, false);
  const std::vector<absl::Status> st = OnEngines(c, 1, [&](Engine& e) -> absl::Status {
    RETURN_IF_ERROR(e.AcquireParams(std::vector<int>{6, 0}));
    RETURN_IF_ERROR(e.AcquireParams(std::vector<int>{0}));
    RETURN_IF_ERROR(e.ReleaseParams(std::vector<int>{0}));
    RETURN_IF_ERROR(e.ReleaseParams(std::vector<int>{6, 0}));
    return ExpectError(e.ReleaseParams(std::vector<int>{6}), absl::StatusCode::kFailedPrecondition,
                       "parameter 'head.w'");
  });
  CHECK(st[0].ToString() == "OK");
}

// One embedding and a stacked [4, 16, 16] weight declared as four slices of 256 elements:
// each slice is a unit of its own (reduce_bucket_size 200) that fills it without padding at
// world 2 (2 x 128 elements); the embedding's 40 elements do not.
std::vector<memory::ParamSpec> StackedModel() {
  std::vector<memory::ParamSpec> specs = {{"emb.w", {40}, "emb"}};
  for (const memory::ParamSpec& s : StackedSlices({"blocks.w", {4, 16, 16}, "blocks"})) {
    specs.push_back(s);
  }
  return specs;
}

struct StackedRun {
  std::vector<float> master;
  std::vector<int> reduced;  // reduced_units() after each GradReady, first micro-step
};

// Trains on this rank, writing each gradient either into grad(i) (copy path) or into the
// trainer's own buffers handed over with SetGradBuffer: one stacked [4, 256] tensor and one
// for the embedding. The CPU device's memory is host memory, so plain stores write it.
absl::StatusOr<StackedRun> TrainStacked(Engine& e, bool handoff, int steps) {
  constexpr int kSlice = 256;
  const int r = e.communicator()->rank();
  std::vector<uint16_t> stacked(4 * kSlice), emb(40);
  auto buffer = [&](int i) { return i == 0 ? emb.data() : stacked.data() + (i - 1) * kSlice; };
  if (handoff) {
    for (int i = 0; i < 5; ++i) {
      ASSIGN_OR_RETURN(const bool direct, e.SetGradBuffer(i, buffer(i)));
      RETURN_IF_ERROR(Expect(direct == (i != 0), "slices are reduced in place, emb.w copied"));
    }
  }
  StackedRun run;
  for (int step = 0; step < steps; ++step) {
    for (int micro = 0; micro < e.config().gradient_accumulation_steps; ++micro) {
      for (int i = 4; i >= 0; --i) {  // backward: the last slice first
        const int64_t n = i == 0 ? 40 : kSlice;
        uint16_t* g = buffer(i);
        if (!handoff) {
          void* slot = nullptr;
          ASSIGN_OR_RETURN(slot, e.grad(i));
          g = static_cast<uint16_t*>(slot);
        }
        for (int64_t k = 0; k < n; ++k) g[k] = FloatToBf16(GradValue(r, step, micro, i, k));
        RETURN_IF_ERROR(e.GradReady(i));
        if (step == 0 && micro == 0) run.reduced.push_back(e.reduced_units());
      }
      RETURN_IF_ERROR(e.Step().status());
    }
  }
  ASSIGN_OR_RETURN(run.master, e.GatherMasterWeights());
  return run;
}

TEST_CASE("Engine: gradients handed over in the trainer's buffers, stacked slices overlap",
          "[engine]") {
  for (int stage : {0, 1, 2, 3}) {
    for (int gas : {1, 2}) {
      for (bool fp32 : {false, true}) {
        CAPTURE(stage, gas, fp32);
        Config c = testing::TestConfig(stage, DType::kBF16, gas, 0.0, false);
        if (fp32) c.grad_accum_dtype = c.communication_dtype = DType::kF32;
        std::vector<StackedRun> runs[2];
        for (bool handoff : {false, true}) {
          auto device = CreateCpuDevice(CpuDeviceOptions{});
          std::vector<StackedRun> out(2);
          const std::vector<absl::Status> st = comm::testing::OnRanks(
              2, {c.comm_timeout_ms}, [&](int r, comm::Communicator* comm) -> absl::Status {
                ASSIGN_OR_RETURN(std::unique_ptr<Engine> e,
                                 Engine::Create(c, StackedModel(), comm, device.get()));
                RETURN_IF_ERROR(e->InitParams([](int i, const memory::ParamSpec&, float* v) {
                  for (int64_t k = 0; k < (i == 0 ? 40 : 256); ++k) v[k] = InitValue(i, k);
                }));
                ASSIGN_OR_RETURN(out[r], TrainStacked(*e, handoff, 3));
                return absl::OkStatus();
              });
          for (int r = 0; r < 2; ++r) {
            REQUIRE(st[r].ToString() == "OK");
            runs[handoff].push_back(out[r]);
          }
        }
        for (int r = 0; r < 2; ++r) {
          CHECK(runs[1][r].master == runs[0][r].master);  // bitwise: no NaN here
          // Each slice's unit is reduced at its own GradReady: the first slice's reduction is
          // issued while three slices are still to come.
          CHECK(runs[1][r].reduced == std::vector<int>{1, 2, 3, 4, 5});
          CHECK(runs[0][r].reduced == std::vector<int>{1, 2, 3, 4, 5});
        }
      }
    }
  }
}

TEST_CASE("Engine: grad(i) is refused for a parameter with a buffer of the trainer's",
          "[engine]") {
  const Config c = testing::TestConfig(2, DType::kBF16, 1, 0.0, false);
  const std::vector<absl::Status> st = OnEngines(c, 1, [&](Engine& e) -> absl::Status {
    std::vector<uint16_t> buf(200);
    RETURN_IF_ERROR(e.SetGradBuffer(0, buf.data()).status());
    RETURN_IF_ERROR(ExpectError(e.grad(0).status(), absl::StatusCode::kFailedPrecondition,
                                "SetGradBuffer"));
    RETURN_IF_ERROR(e.SetGradBuffer(0, nullptr).status());
    RETURN_IF_ERROR(e.grad(0).status());
    // Part-way through the unit's gradients, the source cannot change.
    const int other = e.plan().units[e.unit_of(1)].params[0];
    RETURN_IF_ERROR(e.grad(other).status());
    return ExpectError(e.SetGradBuffer(other, buf.data()).status(),
                       absl::StatusCode::kFailedPrecondition, "register buffers between");
  });
  CHECK(st[0].ToString() == "OK");
}

}  // namespace
}  // namespace zerort
