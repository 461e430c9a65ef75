// The CPU GPT's declared activations (Gpt::ParamSpecs(seq)) against what its passes allocate,
// measured by an ActivationMeter (the allocator of every batch-sized buffer of a pass): equal to
// the byte for several shapes, sequence lengths and micro-batches, and equal through the engine,
// whose memory report multiplies the declaration by the run's micro-batch. Each case prints its
// figures (bazel-testlogs/examples/gpt/gpt_activations_test/test.log).
#include <cstdint>
#include <cstdio>
#include <vector>

#include "catch2/catch.hpp"
#include "examples/gpt/gpt.h"
#include "zero/config.h"

namespace zerort {
namespace examples {
namespace gpt {
namespace {

int64_t DeclaredPerSample(const Gpt& gpt, int seq) {
  int64_t sum = 0;
  for (const memory::ParamSpec& spec : gpt.ParamSpecs(seq)) sum += spec.activation_bytes_per_sample;
  return sum;
}

// gpt.h's count written out whole: fp32 throughout, per sequence of s tokens,
// L (16 s d + 4 s + heads s^2) for the blocks, s d + 2 s for the final LayerNorm, s d + s V + 1
// for the residual stream, the logits and the loss, 14 s d for one block's backward.
int64_t ClosedForm(const GptShape& g, int64_t s) {
  const int64_t d = g.d_model, L = g.layers, H = g.heads, V = g.vocab;
  return 4 * (L * (16 * s * d + 4 * s + H * s * s) + (s * d + 2 * s) + (s * d + s * V + 1) +
              14 * s * d);
}

TokenBatch Batch(const GptShape& shape, int batch, int seq) {
  TokenBatch b;
  b.batch = batch;
  b.seq = seq;
  for (int k = 0; k < batch * (seq + 1); ++k) b.tokens.push_back((7 * k + 3) % shape.vocab);
  return b;
}

struct Case {
  GptShape shape;
  int seq;
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  GptShape tiny;  // 1 layer, 1 head, the smallest vocabulary
  tiny.context = 4;
  tiny.layers = 1;
  tiny.heads = 1;
  tiny.d_model = 4;
  cases.push_back({tiny, 4});
  GptShape odd;  // head size 10, a vocabulary above the bytes, a sequence shorter than the context
  odd.vocab = 300;
  odd.context = 16;
  odd.layers = 2;
  odd.heads = 4;
  odd.d_model = 40;
  cases.push_back({odd, 13});
  cases.push_back({GptShape{}, 64});  // the demo's model at its context
  cases.push_back({GptShape{}, 17});
  return cases;
}

TEST_CASE("GptActivations: a training pass allocates exactly the declared bytes times the "
          "micro-batch at its peak",
          "[gpt]") {
  for (const Case& c : Cases()) {
    const Gpt gpt(c.shape);
    const std::vector<float> params = gpt.InitialParams();
    const int64_t per_sample = DeclaredPerSample(gpt, c.seq);
    CHECK(per_sample == ClosedForm(c.shape, c.seq));
    for (int batch : {1, 2, 5}) {
      INFO("layers " << c.shape.layers << ", d " << c.shape.d_model << ", heads "
                     << c.shape.heads << ", vocab " << c.shape.vocab << ", seq " << c.seq
                     << ", batch " << batch);
      int64_t peak = 0, live_after = 0;
      {
        const ActivationMeter meter;
        (void)gpt.Gradients(params, Batch(c.shape, batch, c.seq));
        peak = meter.peak_bytes();
        live_after = meter.live_bytes();
      }
      std::printf("cpu gpt L=%d d=%d heads=%d vocab=%d seq=%d batch=%d: measured peak %lld "
                  "bytes, planned %lld x %d = %lld bytes\n",
                  c.shape.layers, c.shape.d_model, c.shape.heads, c.shape.vocab, c.seq, batch,
                  static_cast<long long>(peak), static_cast<long long>(per_sample), batch,
                  static_cast<long long>(per_sample * batch));
      CHECK(peak == per_sample * batch);
      CHECK(live_after == 0);  // every buffer went back when the pass returned
    }
  }
}

TEST_CASE("GptActivations: a forward-only pass stays below the training declaration", "[gpt]") {
  // Evaluation keeps one block's tensors at a time and no gradients: at the same batch it must
  // fit inside what the plan counted for training.
  const GptShape shape;
  const Gpt gpt(shape);
  const std::vector<float> params = gpt.InitialParams();
  const ActivationMeter meter;
  (void)gpt.Loss(params, Batch(shape, 3, 64));
  CHECK(meter.peak_bytes() > 0);
  CHECK(meter.peak_bytes() < DeclaredPerSample(gpt, 64) * 3);
}

Config TestConfig(int stage) {
  Config c;
  c.zero.stage = stage;
  c.compute_dtype = DType::kBF16;
  c.zero.reduce_bucket_size = 4000;
  c.zero.stage3_param_persistence_threshold = 100;
  c.zero.stage3_prefetch_bucket_size = 1000000;  // slots for a whole block at once
  c.optimizer.lr = 1e-3;
  c.comm_timeout_ms = 60000;
  c.cpu_threads = 1;
  return c;
}

TEST_CASE("GptActivations: through the engine, each rank's measured peak is its reported plan",
          "[gpt]") {
  for (int stage : {1, 3}) {
    RunOptions options;
    options.world_size = 2;
    options.steps = 2;
    options.batch = 3;
    options.seq = 24;
    options.shape.context = 32;
    options.shape.layers = 2;
    options.threads = 1;
    options.eval_every = 0;
    options.eval_windows = 2;
    absl::StatusOr<RunResult> run = RunInProcess(TestConfig(stage), options);
    INFO("stage " << stage << ": " << run.status().message());
    REQUIRE(run.ok());
    const int64_t per_sample = DeclaredPerSample(Gpt(options.shape), options.seq);
    for (int r = 0; r < options.world_size; ++r) {
      const MemoryReport& m = run->memory[r];
      std::printf("cpu gpt through the engine, stage %d rank %d: measured %lld bytes, engine "
                  "reports %lld x micro-batch %lld = %lld bytes, device budget %lld bytes\n",
                  stage, r, static_cast<long long>(run->activation_bytes[r]),
                  static_cast<long long>(m.activation_bytes_per_sample),
                  static_cast<long long>(m.micro_batch),
                  static_cast<long long>(m.activation_bytes),
                  static_cast<long long>(m.device_budget_bytes));
      CHECK(m.activation_bytes_per_sample == per_sample);
      CHECK(m.micro_batch == options.batch);
      CHECK(run->activation_bytes[r] == m.activation_bytes);
    }
  }
}

TEST_CASE("GptActivations: a config naming another micro-batch is refused, naming both",
          "[gpt]") {
  RunOptions options;
  options.world_size = 1;
  options.steps = 1;
  options.batch = 2;
  options.shape.context = 8;
  options.shape.layers = 1;
  Config config = TestConfig(0);
  config.train_micro_batch_size_per_gpu = 4;
  absl::StatusOr<RunResult> run = RunInProcess(config, options);
  REQUIRE(absl::IsInvalidArgument(run.status()));
  CHECK(run.status().message().find("RunOptions.batch 2") != absl::string_view::npos);
  CHECK(run.status().message().find("train_micro_batch_size_per_gpu 4") != absl::string_view::npos);
}

}  // namespace
}  // namespace gpt
}  // namespace examples
}  // namespace zerort
