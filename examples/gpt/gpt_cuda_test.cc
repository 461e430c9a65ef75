// The GPT's CUDA backend against its CPU backend, on a GPU. Without one every case but the
// host-only layout check prints "SKIPPED: no CUDA device: <reason>" and passes (the kernels'
// per-element arithmetic is tested on every machine by gpt_math_test).
//
// What a GPU run checks:
//  - one pass (forward, backward) on flat fp32 parameters equals the CPU backend's loss within
//    1e-5 (relative) and every gradient tensor within 1e-3 of that tensor's largest magnitude
//    (cuBLAS and the kernels sum in other orders than ops.cc; GPU tanhf/expf are within 2 ulp);
//    in bf16 (matrix-product inputs rounded to 8 bits of mantissa) the loss within 2e-2 and each
//    gradient tensor's direction within a cosine of 0.99;
//  - training through the engine with 2 in-process ranks sharing the GPU gives bit-identical
//    fp32 master weights in stages 0-3 (a pass is deterministic, and the engine's stages are),
//    and world 1 over NCCL trains (the held-out loss falls).
#include "examples/gpt/gpt_cuda.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "catch2/catch.hpp"
#include "device/testing/gpu_or_skip.h"
#include "examples/gpt/gpt.h"
#include "examples/gpt/internal/cuda_model.h"
#include "examples/gpt/internal/random.h"
#include "examples/gpt/testing/stage_runs.h"
#include "zero/config.h"

namespace zerort {
namespace examples {
namespace gpt {
namespace {

// The GPU's description, or false after printing why the case is skipped.
bool GpuOrSkip() {
  static const absl::StatusOr<GpuInfo>* const gpu = new absl::StatusOr<GpuInfo>(ProbeGpu(0));
  if (gpu->ok()) {
    WARN("GPU: " << (*gpu)->name << "; " << (*gpu)->peak_source);
    return true;
  }
  zerort::testing::WarnNoGpu(gpu->status());
  return false;
}

// Awkward sizes: hs = 10, a sequence shorter than the context, 3 sequences.
GptShape SmallShape() {
  GptShape shape;
  shape.context = 16;
  shape.layers = 2;
  shape.heads = 4;
  shape.d_model = 40;
  shape.init_std = 0.2f;  // larger than GPT-2's, so every path carries a visible gradient
  return shape;
}

TokenBatch RandomBatch(const GptShape& shape, int batch, int seq, uint64_t seed) {
  internal::Rng rng({seed});
  TokenBatch b;
  b.batch = batch;
  b.seq = seq;
  for (int k = 0; k < batch * (seq + 1); ++k) {
    b.tokens.push_back(static_cast<int32_t>(rng.Uniform() * 200) % 200 + 32);
  }
  return b;
}

// Initial weights with every bias and LayerNorm parameter moved off 0 and 1, so that a bias
// or gain bug shows.
std::vector<float> PerturbedParams(const Gpt& gpt) {
  std::vector<float> p = gpt.InitialParams();
  internal::Rng rng({99});
  for (float& x : p) x += 0.05f * static_cast<float>(rng.Normal());
  return p;
}

void CompareOnePass(DType dtype) {
  const GptShape shape = SmallShape();
  const Gpt gpt(shape);
  const TokenBatch batch = RandomBatch(shape, 3, 13, 5);
  const std::vector<float> params = PerturbedParams(gpt);
  const float want_loss = gpt.Loss(params, batch);
  const std::vector<float> want = gpt.Gradients(params, batch);

  auto flat = internal::FlatDeviceParams::Create(gpt.ParamSpecs(), params, dtype);
  REQUIRE(flat.ok());
  auto pass = internal::CudaPass::Create(shape, 0);
  REQUIRE(pass.ok());
  const float scale = 1.0f / (batch.batch * batch.seq);
  auto losses = (*pass)->Run(**flat, batch, scale);
  INFO(losses.status().message());
  REQUIRE(losses.ok());
  double sum = 0;
  for (float l : *losses) sum += l;
  const double got_loss = sum / losses->size();
  auto got = (*flat)->Gradients();
  REQUIRE(got.ok());

  const bool fp32 = dtype == DType::kF32;
  CHECK(got_loss == Approx(want_loss).epsilon(fp32 ? 1e-5 : 2e-2));
  int64_t offset = 0;
  for (const memory::ParamSpec& spec : gpt.ParamSpecs()) {
    const int64_t n = spec.numel();
    double max_ref = 0, max_diff = 0, dot = 0, gg = 0, ww = 0;
    for (int64_t k = offset; k < offset + n; ++k) {
      max_ref = std::max(max_ref, std::fabs(static_cast<double>(want[k])));
      max_diff = std::max(max_diff, std::fabs(static_cast<double>((*got)[k]) - want[k]));
      dot += static_cast<double>((*got)[k]) * want[k];
      gg += static_cast<double>((*got)[k]) * (*got)[k];
      ww += static_cast<double>(want[k]) * want[k];
    }
    INFO(spec.name << ": largest reference " << max_ref << ", largest difference " << max_diff);
    if (fp32) {
      CHECK(max_diff <= 1e-3 * max_ref);
    } else if (ww > 0) {
      CHECK(dot / std::sqrt(gg * ww) >= 0.99);
    }
    offset += n;
  }
}

TEST_CASE("GptCuda: one fp32 pass equals the CPU backend (loss 1e-5, gradients 1e-3)",
          "[gpt][gpu]") {
  if (!GpuOrSkip()) return;
  CompareOnePass(DType::kF32);
}

TEST_CASE("GptCuda: one bf16 pass follows the CPU backend (loss 2e-2, gradient cosine 0.99)",
          "[gpt][gpu]") {
  if (!GpuOrSkip()) return;
  CompareOnePass(DType::kBF16);
}

Config TestConfig(int stage, DType precision) {
  Config c;
  c.zero.stage = stage;
  c.compute_dtype = precision;
  c.zero.reduce_bucket_size = 2000;  // several units: blocks split, small modules merged
  c.zero.stage3_param_persistence_threshold = 100;
  // The CUDA pass gathers a whole block at once (its 12 parameters span 6 units at this shape),
  // unlike the CPU pass, which fetches one operation's parameters: at 12000 elements the plan
  // made 3 gather slots and stage 3 refused the block's Acquire (seen on an H200). 65536 makes
  // 1 + ceil(65536 / 10240) = 8.
  c.zero.stage3_prefetch_bucket_size = 65536;
  c.optimizer.lr = 1e-2;
  c.optimizer.weight_decay = 0.0;
  c.gradient_clipping = 1.0;
  c.comm_timeout_ms = 60000;
  return c;
}

RunOptions SmallRun(const Backend* backend, int world, int steps) {
  RunOptions options;
  options.backend = backend;
  options.world_size = world;
  options.steps = steps;
  options.batch = 2;
  options.shape = SmallShape();
  options.shape.init_std = 0.02f;
  options.eval_every = 0;
  options.eval_windows = 8;
  options.gather_master = true;
  return options;
}

TEST_CASE("GptCuda: 2 in-process ranks on one GPU, stages 0-3 give bit-identical masters",
          "[gpt][gpu][sanitizer_slow]") {
  if (!GpuOrSkip()) return;
  auto backend = CreateCudaBackend(0);
  REQUIRE(backend.ok());
  for (DType precision : {DType::kBF16, DType::kF32}) {
    INFO(DTypeName(precision));
    testing::CheckStagesMatchStageZero(
        [&](int stage, bool) { return TestConfig(stage, precision); },
        SmallRun(backend->get(), 2, 4), {false});
  }
}

TEST_CASE("GptCuda: world 1 over NCCL trains (held-out loss falls), planned == allocated",
          "[gpt][gpu][sanitizer_slow]") {
  if (!GpuOrSkip()) return;
  auto backend = CreateCudaBackend(0);
  REQUIRE(backend.ok());
  RunOptions options = SmallRun(backend->get(), 1, 40);
  options.batch = 8;
  options.eval_windows = 0;
  auto run = RunInProcess(TestConfig(2, DType::kBF16), options);
  INFO(run.status().message());
  REQUIRE(run.ok());
  INFO("held-out loss " << run->initial_val_loss << " -> " << run->final_val_loss);
  CHECK(run->final_val_loss < run->initial_val_loss - 1.0);
  REQUIRE(run->memory.size() == 1u);
  for (int k = 0; k < memory::kNumMemoryKinds; ++k) {
    CHECK(run->memory[0].planned[k] == run->memory[0].allocated[k]);
  }
  CHECK(run->activation_bytes[0] > 0);
}

// Host arithmetic, no GPU needed: the layout the trainer declares reproduces the allocation the
// H200 run measured for the demo (docs/gpt_cuda.md: 11.63 GB, 10.83 GiB, for GPT-2 124M's shapes
// with the byte vocabulary, 8 x 1024 tokens, bf16), to the printed rounding.
TEST_CASE("GptCuda: the declared training layout is the demo's measured allocation", "[gpt]") {
  GptShape shape = GptShape::Gpt2Small();
  shape.vocab = 256;
  const internal::CudaPass::ActivationLayout layout =
      internal::CudaPass::TrainingLayout(shape, 8, 1024, DType::kBF16);
  WARN("training layout " << layout.total_bytes() << " bytes (blocks " << layout.blocks_bytes
                          << ")");
  CHECK(std::fabs(layout.total_bytes() / 1e9 - 11.63) <= 0.005);
  CHECK(layout.blocks_bytes > 0);
  CHECK(layout.other_bytes > 0);
}

// The demo's GPU run (docs/gpt_cuda.md, docs/memory_budget.md): GPT-2 124M's shapes with the byte
// vocabulary, 8 x 1024 tokens, bf16, stage 2, world 1 over NCCL. The trainer declares its
// activation buffers on its ParamSpecs, so the plan's budget is model states + the trainer's own
// bytes + reserves; the driver's count of memory in use, at its highest after a step, must be that
// within 5%, without the fragmentation line (see below). Measured before the declaration existed
// (H200, 2026-11-26): 13.31 GiB in use against 10.37 GiB planned with the formula's activations
// (8.06 GiB; the trainer held 10.83 GiB). Memory in use before the run beyond a CUDA context (other
// processes, or what an earlier case left cached) is not this run's and is taken off the peak.
// [no_sanitizer]: a sanitizer's own device allocations would count as in use.
TEST_CASE("GptCuda: the driver's peak memory in use is the plan's whole device budget within 5%",
          "[gpt][gpu][no_sanitizer]") {
  if (!GpuOrSkip()) return;
  auto backend = CreateCudaBackend(0);
  REQUIRE(backend.ok());
  RunOptions options;
  options.backend = backend->get();
  options.world_size = 1;
  options.steps = 3;
  options.batch = 8;
  options.shape = GptShape::Gpt2Small();
  options.shape.vocab = 256;
  options.eval_every = 0;
  // Evaluation batches no larger than the training one keep the forward-only layout inside
  // the training pass's allocation, which is what the trainer declares.
  options.eval_windows = options.batch;
  const absl::StatusOr<int64_t> before = DeviceMemoryInUse(0);
  REQUIRE(before.ok());
  int64_t peak = 0;
  absl::Status in_use_status;
  options.on_step = [&](const StepReport&) {
    absl::StatusOr<int64_t> in_use = DeviceMemoryInUse(0);
    if (in_use.ok()) {
      peak = std::max(peak, *in_use);
    } else {
      in_use_status = in_use.status();
    }
  };
  Config config = TestConfig(2, DType::kBF16);
  // No fragmentation line: it is headroom for a caching allocator (the trainer's), which this
  // run does not have (the CUDA device maps exact sizes), so the driver cannot show it. With it
  // (5% of model states and activations) the H100 run of 2026-11-26 measured 0.943 of the
  // budget; the other lines are each measured ones.
  config.reserves.fragmentation_fraction = 0;
  // The demo's unit sizes: "auto", which the engine derives from the hidden size.
  config.zero.reduce_bucket_size = kAutoSize;
  config.zero.stage3_param_persistence_threshold = kAutoSize;
  config.zero.stage3_prefetch_bucket_size = kAutoSize;
  config.optimizer.lr = 6e-4;
  auto run = RunInProcess(config, options);
  INFO(run.status().message());
  REQUIRE(run.ok());
  INFO(in_use_status.message());
  REQUIRE(in_use_status.ok());
  const MemoryReport& m = run->memory[0];
  const int64_t held = run->activation_bytes[0];
  // Each per-sample share is rounded up: at most (layers + 1) * batch bytes over the allocation.
  CHECK(m.activation_bytes >= held);
  CHECK(m.activation_bytes - held <= (options.shape.layers + 1) * options.batch);
  const int64_t leftover = std::max<int64_t>(0, *before - config.reserves.cuda_context_bytes);
  const double gib = 1073741824.0;
  const double ratio =
      static_cast<double>(peak - leftover) / static_cast<double>(m.device_budget_bytes);
  WARN("in use before the run " << *before / gib << " GiB (" << leftover / gib
                                << " beyond a context, taken off); at the highest "
                                << peak / gib << " GiB; planned " << m.device_budget_bytes / gib
                                << " GiB (model states "
                                << m.planned[static_cast<int>(memory::MemoryKind::kDevice)] / gib
                                << ", activations " << m.activation_bytes / gib
                                << ", the trainer holds " << held / gib << "): in use / planned "
                                << ratio);
  CHECK(ratio >= 0.95);
  CHECK(ratio <= 1.05);
}

}  // namespace
}  // namespace gpt
}  // namespace examples
}  // namespace zerort
