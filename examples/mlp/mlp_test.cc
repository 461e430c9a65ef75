#include "examples/mlp/mlp.h"

#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "catch2/catch.hpp"
#include "zero/config.h"

namespace zerort {
namespace examples {
namespace {

// A small model (fast under ASan too), small units (several per model, the 32x32 weight split
// from its bias) and no persistent units, so that stage 3 really gathers and releases per layer.
MlpShape TestShape() {
  MlpShape shape;
  shape.dims = {8, 32, 32, 4};
  return shape;
}

// Two in-process ranks training TestShape() on batches of 16, their master weights gathered.
RunOptions TwoRanksOfTestShape(int steps) {
  RunOptions options;
  options.world_size = 2;
  options.steps = steps;
  options.batch = 16;
  options.shape = TestShape();
  options.gather_master = true;
  return options;
}

Config MakeConfig(int stage, const std::string& precision, double lr = 0.01,
                  double weight_decay = 0.0, double clipping = 0.0) {
  std::string precision_block;
  if (precision == "bf16") precision_block = R"("bf16": {"enabled": true},)";
  if (precision == "fp16") precision_block = R"("fp16": {"enabled": true, "initial_scale_power": 12},)";
  const std::string json = absl::StrCat(
      R"({"zero_optimization": {"stage": )", stage,
      R"(, "reduce_bucket_size": 600, "stage3_param_persistence_threshold": 0},)",
      precision_block, R"("optimizer": {"type": "AdamW", "params": {"lr": )", lr,
      R"(, "weight_decay": )", weight_decay, R"(}}, "gradient_clipping": )", clipping,
      R"(, "comm_timeout_ms": 20000})");
  absl::StatusOr<Config> config = ParseConfig(json, "mlp_test");
  REQUIRE(config.ok());
  return *config;
}

// Loss of the fp32 reference forward on held-out batches (a rank and steps training never saw).
float HeldOutLoss(const Mlp& mlp, const Teacher& teacher, const std::vector<float>& params) {
  float sum = 0;
  for (int i = 0; i < 4; ++i) sum += mlp.Loss(params, teacher.Sample(99, i, 64));
  return sum / 4;
}

std::vector<float> InitialParams(const Mlp& mlp) {
  std::vector<float> flat;
  const auto specs = mlp.ParamSpecs();
  for (int i = 0; i < static_cast<int>(specs.size()); ++i) {
    int64_t numel = 1;
    for (int64_t d : specs[i].shape) numel *= d;
    std::vector<float> v(numel);
    mlp.Initializer()(i, specs[i], v.data());
    flat.insert(flat.end(), v.begin(), v.end());
  }
  return flat;
}

TEST_CASE("Mlp: the first AdamW step moves every weight against its finite-difference gradient",
          "[examples]") {
  // AdamW's first step is -lr * g / (|g| + eps) (bias-corrected m and v are g and g^2), so its
  // sign is the sign of the rank-averaged gradient, which central differences of the fp32
  // reference loss give independently of our backward pass.
  RunOptions options;
  options.world_size = 2;
  options.steps = 1;
  options.shape.dims = {5, 7, 3};
  options.batch = 8;
  options.gather_master = true;
  const float lr = 1e-3f;
  const Config config = MakeConfig(GENERATE(0, 3), "fp32", lr);
  absl::StatusOr<RunResult> run = RunInProcess(config, options);
  REQUIRE(run.ok());

  const Mlp mlp(options.shape);
  const Teacher teacher(options.shape);
  const Batch b0 = teacher.Sample(0, 0, options.batch), b1 = teacher.Sample(1, 0, options.batch);
  std::vector<float> p = InitialParams(mlp);
  const std::vector<float>& after = run->master[0];
  REQUIRE(after.size() == p.size());
  int checked = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    const float h = 1e-2f, x = p[i];
    p[i] = x + h;
    const double up = 0.5 * (mlp.Loss(p, b0) + mlp.Loss(p, b1));
    p[i] = x - h;
    const double down = 0.5 * (mlp.Loss(p, b0) + mlp.Loss(p, b1));
    p[i] = x;
    const double g = (up - down) / (2 * h);
    if (std::fabs(g) < 1e-3) continue;  // too small for fp32 differences to give its sign
    INFO("element " << i << ": gradient " << g << ", moved by " << after[i] - x);
    CHECK(after[i] - x == Approx(g > 0 ? -lr : lr).epsilon(0.02));
    ++checked;
  }
  CHECK(checked > static_cast<int>(p.size()) / 2);
}

TEST_CASE("Mlp: the loss falls well below its start under every stage and precision",
          "[examples]") {
  const int stage = GENERATE(0, 1, 2, 3);
  const std::string precision = GENERATE(std::string("bf16"), std::string("fp16"),
                                         std::string("fp32"));
  RunOptions options = TwoRanksOfTestShape(/*steps=*/40);
  std::vector<double> losses;
  options.on_step = [&](const StepReport& r) { losses.push_back(r.loss); };
  absl::StatusOr<RunResult> run = RunInProcess(MakeConfig(stage, precision), options);
  INFO("stage " << stage << " " << precision);
  REQUIRE(run.ok());
  REQUIRE(losses.size() == 40u);

  const Mlp mlp(options.shape);
  const Teacher teacher(options.shape);
  const float before = HeldOutLoss(mlp, teacher, InitialParams(mlp));
  const float after = HeldOutLoss(mlp, teacher, run->master[0]);
  INFO("held-out loss " << before << " -> " << after << "; training loss " << losses.front()
                        << " -> " << losses.back());
  CHECK(run->plan.units.size() >= 3u);  // stage 3 gathers per unit, not the whole model
  CHECK(after < 0.4f * before);
  CHECK(losses.back() < 0.5 * losses.front());
  // Data parallelism: every rank applied the same update.
  CHECK(run->master[0] == run->master[1]);
}

TEST_CASE("Mlp: stages 0-3 train to bit-identical master weights", "[examples]") {
  const std::string precision = GENERATE(std::string("bf16"), std::string("fp32"));
  RunOptions options = TwoRanksOfTestShape(/*steps=*/6);
  std::vector<std::vector<float>> master;
  for (int stage = 0; stage <= 3; ++stage) {
    absl::StatusOr<RunResult> run =
        RunInProcess(MakeConfig(stage, precision, 0.01, 0.01, 1.0), options);
    REQUIRE(run.ok());
    master.push_back(run->master[1]);
  }
  INFO(precision);
  for (int stage = 1; stage <= 3; ++stage) {
    INFO("stage " << stage << " against stage 0");
    CHECK(master[stage] == master[0]);
  }
}

TEST_CASE("Mlp: run options are checked and name the field", "[examples]") {
  RunOptions options;
  options.world_size = 0;
  absl::StatusOr<RunResult> run = RunInProcess(MakeConfig(0, "fp32"), options);
  REQUIRE(absl::IsInvalidArgument(run.status()));
  CHECK(run.status().message().find("world_size") != absl::string_view::npos);
}

}  // namespace
}  // namespace examples
}  // namespace zerort
