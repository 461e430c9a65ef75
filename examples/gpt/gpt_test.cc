#include "examples/gpt/gpt.h"

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/testing/bit_equal.h"
#include "catch2/catch.hpp"
#include "checkpoint/weights.h"
#include "examples/gpt/testing/stage_runs.h"
#include "zero/config.h"

namespace zerort {
namespace examples {
namespace gpt {
namespace {

// Small enough for ASan, big enough to have several heads, layers and positions.
GptShape TinyShape() {
  GptShape shape;
  shape.context = 8;
  shape.layers = 2;
  shape.heads = 2;
  shape.d_model = 8;
  return shape;
}

const char kText[] =
    "Everyone is permitted to copy and distribute verbatim copies of this license document, "
    "but changing it is not allowed. The licenses for most software and other practical works "
    "are designed to take away your freedom to share and change the works.";

Corpus TextCorpus() {
  absl::StatusOr<Corpus> corpus = Corpus::FromText(kText);
  REQUIRE(corpus.ok());
  return *corpus;
}

int64_t Numel(const memory::ParamSpec& spec) {
  int64_t n = 1;
  for (int64_t d : spec.shape) n *= d;
  return n;
}

// Offsets of each parameter in the flat vector.
std::vector<int64_t> Offsets(const Gpt& gpt) {
  std::vector<int64_t> offsets;
  int64_t offset = 0;
  for (const memory::ParamSpec& spec : gpt.ParamSpecs()) {
    offsets.push_back(offset);
    offset += Numel(spec);
  }
  return offsets;
}

// Central difference of f around params[k].
template <typename F>
double CentralDifference(std::vector<float>& params, int64_t k, float h, F f) {
  const float x = params[k];
  params[k] = x + h;
  const double up = f(params);
  params[k] = x - h;
  const double down = f(params);
  params[k] = x;
  return (up - down) / (2.0 * h);
}

TEST_CASE("Gpt: backward matches central differences for every parameter tensor", "[gpt]") {
  GptShape shape = TinyShape();
  shape.init_std = 0.3f;  // larger than GPT-2's 0.02, so every path carries a visible gradient
  const Gpt gpt(shape);
  const TokenBatch batch = TextCorpus().Sample(0, 0, 2, shape.context, 7);
  std::vector<float> params = gpt.InitialParams();
  const std::vector<float> grads = gpt.Gradients(params, batch);
  const std::vector<memory::ParamSpec> specs = gpt.ParamSpecs();
  const std::vector<int64_t> offsets = Offsets(gpt);
  auto loss = [&](const std::vector<float>& p) { return gpt.Loss(p, batch); };
  // fp32 differences with h = 1e-2: rounding of the loss (~1e-6) gives ~1e-4 of noise and the
  // h^2 term up to ~0.3% of the largest gradients (0.35 here, measured off by 1.1e-3). The bound
  // below is 4x the worst error seen; a wrong sign, index or factor misses it by far.
  for (size_t i = 0; i < specs.size(); ++i) {
    const int64_t numel = Numel(specs[i]);
    // wte: rows of tokens the batch reads (both uses) and one it does not (output use only).
    std::vector<int64_t> elements;
    if (i == 0) {
      for (int64_t c : {0, 3}) elements.push_back(batch.tokens[0] * shape.d_model + c);
      elements.push_back(batch.tokens[5] * shape.d_model + 1);
      elements.push_back(255 * shape.d_model + 2);
    }
    for (int64_t k = 0; k < 5; ++k) elements.push_back((k * 7919 + 13) % numel);
    for (int64_t e : elements) {
      const int64_t k = offsets[i] + e;
      const double fd = CentralDifference(params, k, 1e-2f, loss);
      const double err = std::fabs(fd - grads[k]);
      INFO(specs[i].name << "[" << e << "]: backward " << grads[k] << ", differences " << fd);
      CHECK(err <= 5e-4 + 1e-2 * std::fabs(fd));
    }
  }
}

TEST_CASE("Gpt: the tied embedding's gradient is the sum of its two uses", "[gpt]") {
  GptShape shape = TinyShape();
  shape.init_std = 0.3f;
  const Gpt gpt(shape);
  const TokenBatch batch = TextCorpus().Sample(1, 2, 2, shape.context, 7);
  std::vector<float> params = gpt.InitialParams();
  const std::vector<float> grads = gpt.Gradients(params, batch);
  const int d = shape.d_model;
  // Untied copies: perturbing `head` moves only the output projection, perturbing wte inside
  // `params` (with head fixed) only the input embedding.
  std::vector<float> head(params.begin(), params.begin() + static_cast<int64_t>(shape.vocab) * d);
  auto head_loss = [&](const std::vector<float>& h) { return gpt.Loss(params, batch, h.data()); };
  auto input_loss = [&](const std::vector<float>& p) { return gpt.Loss(p, batch, head.data()); };
  int both = 0;
  for (int b = 0; b < 6; ++b) {
    const int64_t k = static_cast<int64_t>(batch.tokens[b]) * d + b % d;  // a row the batch reads
    const double from_head = CentralDifference(head, k, 1e-2f, head_loss);
    const double from_input = CentralDifference(params, k, 1e-2f, input_loss);
    INFO("wte[" << k << "]: tied " << grads[k] << ", output use " << from_head << ", input use "
                << from_input);
    CHECK(std::fabs(grads[k] - (from_head + from_input)) <=
          5e-4 + 1e-2 * (std::fabs(from_head) + std::fabs(from_input)));
    if (std::fabs(from_head) > 1e-3 && std::fabs(from_input) > 1e-3) ++both;
  }
  CHECK(both >= 3);  // both uses really contribute, so dropping either would fail above
}

Config TestConfig(int stage, bool offload, DType precision, double lr = 1e-2) {
  Config c;
  c.zero.stage = stage;
  c.compute_dtype = precision;
  c.zero.reduce_bucket_size = 400;  // several units: blocks split, small modules merged
  c.zero.stage3_param_persistence_threshold = 100;
  c.zero.stage3_prefetch_bucket_size = 3000;
  if (offload) c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.optimizer.lr = lr;
  c.optimizer.weight_decay = 0.0;
  c.gradient_clipping = 1.0;
  c.comm_timeout_ms = 60000;
  c.cpu_threads = 1;
  return c;
}

RunOptions TinyRun(int steps) {
  RunOptions options;
  options.world_size = 2;
  options.steps = steps;
  options.batch = 2;
  options.shape = TinyShape();
  options.threads = 1;
  options.eval_every = 0;
  options.eval_windows = 8;
  options.gather_master = true;
  return options;
}

TEST_CASE("Gpt: the engine receives the flat reference's gradients, tied embedding included",
          "[gpt]") {
  // AdamW's first step without clipping or decay is -lr * g / (|g| + eps): its sign is the sign
  // of the rank-averaged gradient, which the flat reference gives independently of the engine.
  const double lr = 1e-3;
  Config config = TestConfig(GENERATE(0, 3), false, DType::kF32, lr);
  config.gradient_clipping = 0;
  RunOptions options = TinyRun(1);
  options.shape.init_std = 0.3f;
  absl::StatusOr<RunResult> run = RunInProcess(config, options);
  REQUIRE(run.ok());
  absl::StatusOr<Corpus> corpus = Corpus::Load(run->corpus_path);
  REQUIRE(corpus.ok());
  const Gpt gpt(options.shape);
  const std::vector<float> before = gpt.InitialParams();
  std::vector<float> g0 = gpt.Gradients(before, corpus->Sample(0, 0, 2, 8, options.data_seed));
  const std::vector<float> g1 =
      gpt.Gradients(before, corpus->Sample(1, 0, 2, 8, options.data_seed));
  REQUIRE(run->master[0].size() == before.size());
  int checked = 0;
  for (size_t k = 0; k < before.size(); ++k) {
    const double g = 0.5 * (static_cast<double>(g0[k]) + g1[k]);
    if (std::fabs(g) < 1e-4) continue;  // eps and rounding could blur the sign
    INFO("element " << k << ": gradient " << g << ", moved by " << run->master[0][k] - before[k]);
    CHECK(run->master[0][k] - before[k] == Approx(g > 0 ? -lr : lr).epsilon(1e-2));
    ++checked;
  }
  CHECK(checked > static_cast<int>(before.size()) / 2);
}

TEST_CASE("Gpt: training lowers the held-out loss", "[gpt]") {
  RunOptions options = TinyRun(40);
  options.shape.d_model = 16;
  options.shape.context = 16;
  options.batch = 4;
  options.eval_every = 20;
  options.eval_windows = 0;  // all: the last 10% of GPL-3 starts with capitals, unlike the rest
  std::vector<double> val;
  options.on_step = [&](const StepReport& r) {
    if (r.evaluated) val.push_back(r.val_loss);
  };
  absl::StatusOr<RunResult> run = RunInProcess(TestConfig(2, false, DType::kBF16, 3e-3), options);
  REQUIRE(run.ok());
  INFO("held-out loss " << run->initial_val_loss << " -> " << val[0] << " -> "
                        << run->final_val_loss);
  REQUIRE(val.size() == 2u);
  // Uniform guessing over 256 bytes costs ln 256 = 5.55 nats, where training starts. 40 steps
  // learn the byte statistics of English text (measured: 5.52 -> 4.27 after 20 steps -> 3.67);
  // a 1.2-nat margin leaves room for rounding changes and fails if the model does not learn.
  CHECK(run->initial_val_loss == Approx(std::log(256.0)).epsilon(0.02));
  CHECK(run->final_val_loss < run->initial_val_loss - 1.2);
  CHECK(val[1] < val[0]);
  CHECK(run->master[0] == run->master[1]);
}

TEST_CASE("Gpt: stages 0-3, with and without offload, train to bit-identical results", "[gpt]") {
  const DType precision = GENERATE(DType::kBF16, DType::kF32);
  INFO(DTypeName(precision));
  testing::CheckStagesMatchStageZero(
      [&](int stage, bool offload) { return TestConfig(stage, offload, precision); }, TinyRun(3),
      {false, true});
}

TEST_CASE("Gpt: N steps, a checkpoint, a resume and N more steps equal 2N steps bit for bit",
          "[gpt]") {
  const int stage = GENERATE(2, 3);
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string root =
      absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/gpt_resume_stage", stage, "_", getpid());
  const Config config = TestConfig(stage, false, DType::kBF16);

  RunOptions whole = TinyRun(6);
  whole.checkpoint_dir = root + "/whole";
  whole.checkpoint_every = 3;
  absl::StatusOr<RunResult> a = RunInProcess(config, whole);
  REQUIRE(a.ok());
  CHECK(a->checkpoints ==
        std::vector<std::string>{root + "/whole/step_3", root + "/whole/step_6"});

  RunOptions first = TinyRun(3);
  first.checkpoint_dir = root + "/split";
  first.checkpoint_every = 3;
  absl::StatusOr<RunResult> b = RunInProcess(config, first);
  REQUIRE(b.ok());
  RunOptions second = TinyRun(6);
  second.resume_from = root + "/split";
  absl::StatusOr<RunResult> c = RunInProcess(config, second);
  INFO(c.status());
  REQUIRE(c.ok());

  CHECK(c->first_step == 3);
  REQUIRE(c->steps.size() == 3u);
  for (int k = 0; k < 3; ++k) CHECK(c->steps[k].loss == a->steps[3 + k].loss);
  CHECK(c->initial_val_loss == b->final_val_loss);  // the loaded state is the saved one
  CHECK(c->final_val_loss == a->final_val_loss);
  for (int r = 0; r < 2; ++r) {
    REQUIRE(c->master[r].size() == a->master[r].size());
    CHECK(zerort::testing::BitEqual(c->master[r], a->master[r]));
    // The resumed run trained: its weights moved away from those it loaded.
    CHECK_FALSE(zerort::testing::BitEqual(c->master[r], b->master[r]));
  }

  // A checkpoint at or past the last step leaves nothing to train.
  RunOptions done = TinyRun(3);
  done.resume_from = root + "/split";
  absl::StatusOr<RunResult> d = RunInProcess(config, done);
  CHECK(absl::IsInvalidArgument(d.status()));
  CHECK(d.status().message().find("step 3") != absl::string_view::npos);
}

TEST_CASE("Gpt: init_from starts from exported weights", "[gpt]") {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string root = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/gpt_init_", getpid());
  const Config config = TestConfig(3, false, DType::kBF16);
  RunOptions first = TinyRun(3);
  first.checkpoint_dir = root + "/ckpt";
  first.checkpoint_every = 3;
  absl::StatusOr<RunResult> a = RunInProcess(config, first);
  REQUIRE(a.ok());
  REQUIRE(ExportCheckpointWeights(root + "/ckpt", root + "/w.safetensors").ok());
  RunOptions second = TinyRun(3);
  second.init_from = root + "/w.safetensors";
  absl::StatusOr<RunResult> b = RunInProcess(config, second);
  INFO(b.status());
  REQUIRE(b.ok());
  CHECK(b->first_step == 0);  // weights only: a fresh run
  CHECK(b->initial_val_loss == a->final_val_loss);  // it starts where the first one ended
  // Weights another tool named ("model." before every name, as Hugging Face's checkpoints of a
  // bare model do) start the same run through a name map.
  absl::StatusOr<WeightsNameMap> out_names = WeightsNameMap::Parse("regex (.*) model.$1\n");
  REQUIRE(out_names.ok());
  WeightsExportOptions renamed;
  renamed.names = *out_names;
  REQUIRE(ExportCheckpointWeights(root + "/ckpt", root + "/hf.safetensors", renamed).ok());
  {
    std::ofstream map(root + "/hf.map");
    map << "prefix model.   # the bare model's prefix\n";
  }
  RunOptions mapped = TinyRun(3);
  mapped.init_from = root + "/hf.safetensors";
  absl::StatusOr<RunResult> m = RunInProcess(config, mapped);
  CHECK(!m.ok());  // without the map no name matches
  mapped.init_map = root + "/hf.map";
  m = RunInProcess(config, mapped);
  INFO(m.status());
  REQUIRE(m.ok());
  CHECK(m->initial_val_loss == a->final_val_loss);
  for (int r = 0; r < 2; ++r) {
    REQUIRE(m->master[r].size() == b->master[r].size());
    CHECK(zerort::testing::BitEqual(m->master[r], b->master[r]));
  }
  mapped.init_map = root + "/missing.map";
  m = RunInProcess(config, mapped);
  CHECK(absl::IsNotFound(m.status()));
  CHECK(m.status().message().find("--init-map") != absl::string_view::npos);

  second.init_from = root + "/missing.safetensors";
  absl::StatusOr<RunResult> c = RunInProcess(config, second);
  CHECK(absl::IsNotFound(c.status()));
  CHECK(c.status().message().find("--init-from " + root + "/missing.safetensors") !=
        absl::string_view::npos);
}

TEST_CASE("Gpt: a later token does not change earlier logits", "[gpt]") {
  GptShape shape = TinyShape();
  shape.init_std = 0.3f;
  const Gpt gpt(shape);
  const std::vector<float> params = gpt.InitialParams();
  TokenBatch batch = TextCorpus().Sample(0, 3, 2, shape.context, 7);
  const std::vector<float> before = gpt.Logits(params, batch);
  const int changed = 5;  // position in the second sequence
  batch.tokens[(shape.context + 1) + changed] ^= 0x41;
  const std::vector<float> after = gpt.Logits(params, batch);
  const int64_t row = shape.vocab;
  for (int t = 0; t < shape.context; ++t) {
    const int64_t r = shape.context + t;  // the second sequence's row t
    const std::vector<float> a(before.begin() + r * row, before.begin() + (r + 1) * row);
    const std::vector<float> b(after.begin() + r * row, after.begin() + (r + 1) * row);
    INFO("position " << t);
    if (t < changed) CHECK(a == b);
    if (t == changed) CHECK(a != b);  // the change is visible where it happens
  }
  // The other sequence is untouched.
  CHECK(std::vector<float>(before.begin(), before.begin() + shape.context * row) ==
        std::vector<float>(after.begin(), after.begin() + shape.context * row));
}

TEST_CASE("Gpt: ranks sample different windows, deterministically", "[gpt]") {
  const Corpus corpus = TextCorpus();
  CHECK(corpus.Sample(0, 4, 3, 8, 1).tokens == corpus.Sample(0, 4, 3, 8, 1).tokens);
  CHECK(corpus.Sample(0, 4, 3, 8, 1).tokens != corpus.Sample(1, 4, 3, 8, 1).tokens);
  CHECK(corpus.Sample(0, 4, 3, 8, 1).tokens != corpus.Sample(0, 5, 3, 8, 1).tokens);
  // Held-out windows come from the last 10% only.
  const std::string text = kText;
  const TokenBatch val = corpus.ValWindows(0, 1, 8);
  CHECK(std::string(val.tokens.begin(), val.tokens.end()) ==
        text.substr(corpus.train_tokens(), 9));
}

TEST_CASE("Gpt: run options and shapes are checked and name the field", "[gpt]") {
  RunOptions options = TinyRun(1);
  options.seq = 9;  // beyond the context of 8
  absl::StatusOr<RunResult> run = RunInProcess(TestConfig(0, false, DType::kF32), options);
  REQUIRE(absl::IsInvalidArgument(run.status()));
  CHECK(run.status().message().find("RunOptions.seq") != absl::string_view::npos);
  options = TinyRun(1);
  options.shape.heads = 3;
  run = RunInProcess(TestConfig(0, false, DType::kF32), options);
  REQUIRE(absl::IsInvalidArgument(run.status()));
  CHECK(run.status().message().find("d_model") != absl::string_view::npos);
  options = TinyRun(1);
  options.corpus_path = "/nonexistent/corpus.txt";
  run = RunInProcess(TestConfig(0, false, DType::kF32), options);
  REQUIRE(absl::IsNotFound(run.status()));
  CHECK(run.status().message().find("/nonexistent/corpus.txt") != absl::string_view::npos);
}

TEST_CASE("Gpt: generation continues the prompt, greedy or sampled, reproducibly", "[gpt]") {
  const Gpt gpt(TinyShape());
  const std::vector<float> params = gpt.InitialParams();
  const std::string greedy = gpt.Generate(params, "The ", 12, 0, 1);
  REQUIRE(greedy.size() == 4u + 12u);  // longer than the context of 8: the window slides
  CHECK(greedy.substr(0, 4) == "The ");
  CHECK(greedy == gpt.Generate(params, "The ", 12, 0, 2));  // greedy ignores the seed
  const std::string sampled = gpt.Generate(params, "The ", 12, 1.0f, 1);
  CHECK(sampled == gpt.Generate(params, "The ", 12, 1.0f, 1));
  CHECK(sampled != greedy);  // near-uniform logits: sampling almost surely differs
}

}  // namespace
}  // namespace gpt
}  // namespace examples
}  // namespace zerort
