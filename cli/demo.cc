#include "cli/demo.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/bytes.h"
#include "base/status.h"
#include "cli/flags.h"
#include "examples/gpt/backend.h"
#include "examples/gpt/gpt.h"
#include "examples/gpt/gpt_cuda.h"
#include "examples/mlp/mlp.h"
#include "memory/plan.h"
#include "zero/config.h"
#include "zero/model_spec.h"
#include "zero/planner.h"

namespace zerort {
namespace {

// The GPT's config leaves the unit sizes to the engine, which derives them from the model's
// hidden size (docs/config.md); lr 3e-3 without weight decay trains the 0.83M-parameter model
// visibly in 150 steps.
constexpr char kGptConfig[] = R"({
  "zero_optimization": {"stage": 2},
  "bf16": {"enabled": true},
  "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.0}},
  "gradient_clipping": 1.0,
  "comm_timeout_ms": 60000
})";

// The GPU default: GPT-2 124M's shapes, so a higher-capacity model with GPT-2's usual lr 6e-4
// and weight decay 0.1.
constexpr char kGptCudaConfig[] = R"({
  "zero_optimization": {"stage": 2},
  "bf16": {"enabled": true},
  "optimizer": {"type": "AdamW", "params": {"lr": 0.0006, "weight_decay": 0.1}},
  "gradient_clipping": 1.0,
  "comm_timeout_ms": 600000
})";

// Small units and no persistent units, so that a 5-thousand-parameter model still shows
// several buckets and real stage-3 gathers.
constexpr char kMlpConfig[] = R"({
  "zero_optimization": {
    "stage": 2,
    "reduce_bucket_size": 2048,
    "stage3_param_persistence_threshold": 0
  },
  "bf16": {"enabled": true},
  "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
  "gradient_clipping": 1.0,
  "comm_timeout_ms": 60000
})";

std::string StageName(const Config& config) {
  return config.zero.stage_auto ? std::string("auto") : absl::StrCat(config.zero.stage);
}

// --config or the model's default, then --stage and --precision over it.
absl::StatusOr<Config> DemoConfig(const Flags& flags, bool gpt, bool cuda = false) {
  Config config;
  if (flags.Has("config")) {
    ASSIGN_OR_RETURN(config, LoadConfigFile(flags.Get("config")));
  } else {
    ASSIGN_OR_RETURN(config, ParseConfig(!gpt ? kMlpConfig : cuda ? kGptCudaConfig : kGptConfig,
                                         "<demo default config>"));
  }
  if (flags.Has("stage")) {
    ASSIGN_OR_RETURN(int64_t stage, flags.GetInt("stage", 0, 0, 3));
    config.zero.stage_auto = false;
    config.zero.stage = stage;
    if (stage != 3) config.zero.offload_param.device = OffloadDevice::kNone;
  }
  ASSIGN_OR_RETURN(config.compute_dtype,
                   flags.GetComputeDType("precision", config.compute_dtype));
  RETURN_IF_ERROR(ValidateConfig(config));
  return config;
}

// Every rank's planned and allocated bytes per memory kind, and whether they agree.
void PrintMemoryTable(const std::vector<MemoryReport>& memory, std::ostream& out) {
  // The nvme column (swap files, the last kind) only when some rank has them.
  const int nvme = static_cast<int>(memory::MemoryKind::kNvme);
  bool any_nvme = false;
  for (const MemoryReport& m : memory) any_nvme = any_nvme || m.planned[nvme] > 0;
  const int kinds = any_nvme ? memory::kNumMemoryKinds : nvme;
  out << "\nmemory per rank in bytes, planned / allocated:\n" << absl::StrFormat("%6s", "rank");
  for (int k = 0; k < kinds; ++k) {
    out << absl::StrFormat(" %27s", memory::MemoryKindName(static_cast<memory::MemoryKind>(k)));
  }
  out << "\n";
  bool all_match = true;
  for (size_t r = 0; r < memory.size(); ++r) {
    const MemoryReport& m = memory[r];
    out << absl::StrFormat("%6d", r);
    for (int k = 0; k < kinds; ++k) {
      out << absl::StrFormat(" %13s / %11s", GroupedBytes(m.planned[k]),
                             GroupedBytes(m.allocated[k]));
      all_match = all_match && m.planned[k] == m.allocated[k];
    }
    out << "\n";
  }
  out << (all_match ? "every rank allocated exactly its plan\n"
                    : "WARNING: allocation differs from the plan\n");
}

void PrintPlanLine(const memory::Plan& plan, std::ostream& out) {
  out << "stage " << plan.options.stage << ", " << plan.units.size() << " units, "
      << plan.comm_bytes_per_step << " bytes sent per rank per step (planned)\n";
}

absl::Status RunMlpDemo(const Flags& flags, std::ostream& out) {
  ASSIGN_OR_RETURN(const Config config, DemoConfig(flags, /*gpt=*/false));
  examples::RunOptions options;
  ASSIGN_OR_RETURN(options.world_size, flags.GetInt("ranks", 4, 1, 256));
  ASSIGN_OR_RETURN(options.steps, flags.GetInt("steps", 30, 1, 1000000));
  options.batch = 32;
  options.device_threads = 1;

  const examples::Mlp mlp(options.shape);
  for (const std::string& note : config.notes) out << "note: " << note << "\n";
  out << "zerort demo: MLP " << absl::StrJoin(options.shape.dims, "-") << " ("
      << mlp.num_elements() << " parameters) on " << options.world_size
      << " in-process ranks, stage " << StageName(config) << ", "
      << DTypeName(config.compute_dtype) << ", batch " << options.batch << " per rank\n";
  out << absl::StrFormat("%6s %12s %12s %11s %9s %9s\n", "step", "loss", "grad_norm",
                         "loss_scale", "ms", "step_ms");
  options.on_step = [&out](const examples::StepReport& r) {
    out << absl::StrFormat("%6d %12.6f %12.6f %11g %9.3f %9.3f", r.step + 1, r.loss,
                           r.stats.grad_norm, r.stats.loss_scale, r.ms, r.stats.total_ms);
    if (r.stats.skipped) out << "  skipped (overflow)";
    if (!r.stats.boundary) out << "  (accumulating)";
    out << "\n";
  };
  ASSIGN_OR_RETURN(examples::RunResult result, examples::RunInProcess(config, options));
  out << "\nloss " << absl::StrFormat("%.6f", result.steps.front().loss) << " -> "
      << absl::StrFormat("%.6f", result.steps.back().loss) << " over " << options.steps
      << " steps; ";
  PrintPlanLine(result.plan, out);
  PrintMemoryTable(result.memory, out);
  return absl::OkStatus();
}

// Generated bytes for a terminal: printable ASCII and newlines as they are, anything else
// (control bytes, bytes >= 0x80 that need not form UTF-8) as a middle dot.
std::string Printable(const std::string& bytes) {
  std::string out;
  for (unsigned char c : bytes) {
    if (c == '\n' || (c >= 0x20 && c < 0x7f)) {
      out += static_cast<char>(c);
    } else {
      out += "\u00b7";
    }
  }
  return out;
}

// The GPT's run options from the flags. CPU: 4 ranks of 2 sequences of 64 bytes, 150 steps
// (about a minute on two cores), a validation loss every 25 steps and a 200-byte sample.
// CUDA: GPT-2 124M's shapes (12 layers, 12 heads, d_model 768, context 1024) with the byte
// vocabulary of the corpus (256 rows, not GPT-2's 50257 BPE tokens, which need a tokenizer),
// 1 rank of 8 sequences of 1024 bytes, 50 steps; no sample (generation runs on the CPU).
absl::StatusOr<examples::gpt::RunOptions> GptOptions(const Flags& flags, bool cuda) {
  examples::gpt::RunOptions o;
  if (cuda) {
    o.shape = examples::gpt::GptShape::Gpt2Small();
    o.shape.vocab = 256;
  }
  ASSIGN_OR_RETURN(o.world_size, flags.GetInt("ranks", cuda ? 1 : 4, 1, cuda ? 16 : 256));
  ASSIGN_OR_RETURN(o.steps, flags.GetInt("steps", cuda ? 50 : 150, 1, 1000000));
  ASSIGN_OR_RETURN(o.batch, flags.GetInt("batch", cuda ? 8 : 2, 1, 4096));
  ASSIGN_OR_RETURN(o.eval_every, flags.GetInt("eval_every", 25, 0, 1000000));
  ASSIGN_OR_RETURN(o.sample_tokens, flags.GetInt("sample_tokens", cuda ? 0 : 200, 0, 100000));
  ASSIGN_OR_RETURN(o.checkpoint_every, flags.GetInt("checkpoint_every", 50, 1, 1000000));
  ASSIGN_OR_RETURN(o.shape.layers, flags.GetInt("layers", o.shape.layers, 1, 96));
  // Multiples of the heads (4 on the CPU, 12 on the GPU).
  ASSIGN_OR_RETURN(const int64_t d_model,
                   flags.GetInt("d_model", o.shape.d_model, o.shape.heads, 4096));
  if (d_model % o.shape.heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--d_model ", d_model, " must be a multiple of ", o.shape.heads));
  }
  o.shape.d_model = static_cast<int>(d_model);
  o.checkpoint_dir = flags.Get("checkpoint");
  o.resume_from = flags.Get("resume");
  o.init_from = flags.Get("init-from");
  o.init_map = flags.Get("init-map");
  o.corpus_path = flags.Get("corpus");  // "": DefaultCorpusPath()
  o.sample_temperature = 0.8f;  // greedy decoding of a small model repeats "the the the"
  o.device_threads = 1;
  return o;
}

// What the GPU run is measured against: the datasheet peak for the compute dtype (the fp32
// path runs without TF32, so plain fp32).
double PeakFlops(const examples::gpt::GpuInfo& gpu, const Config& config) {
  return config.compute_dtype == DType::kF32 ? gpu.peak_fp32_flops : gpu.peak_bf16_flops;
}

void PrintGptHeader(const Config& config, const examples::gpt::RunOptions& o,
                    const examples::gpt::GpuInfo* gpu, std::ostream& out) {
  const examples::gpt::GptShape& s = o.shape;
  const examples::gpt::Gpt gpt(s);
  for (const std::string& note : config.notes) out << "note: " << note << "\n";
  out << "zerort demo: GPT of " << s.layers << " layers, " << s.heads << " heads, d_model "
      << s.d_model << ", context " << s.context << " (" << GroupedBytes(gpt.num_elements())
      << " parameters) on " << o.world_size << " in-process ranks, stage " << StageName(config)
      << ", " << DTypeName(config.compute_dtype) << ", " << o.batch << " sequences of "
      << s.context << " bytes per rank\n";
  if (gpu != nullptr) {
    out << "device: GPU " << gpu->ordinal << ", " << gpu->name << " ("
        << absl::StrFormat("%.1f", gpu->memory_bytes / double(1 << 30)) << " GiB, compute "
        << gpu->compute_major << "." << gpu->compute_minor << "), "
        << (o.world_size == 1 ? "NCCL at world 1"
                              : "in-process ranks sharing the GPU (NCCL refuses two ranks on one)")
        << "\npeak: " << gpu->peak_source << "\nvocabulary: " << s.vocab
        << " byte tokens (GPT-2's shapes otherwise; its 50257 BPE tokens need a tokenizer)\n";
  }
  if (!o.init_from.empty()) out << "initial weights from " << o.init_from << "\n";
  if (!o.resume_from.empty()) out << "resuming from " << o.resume_from << "\n";
  if (!o.checkpoint_dir.empty()) {
    out << "saving a checkpoint every " << o.checkpoint_every << " steps into "
        << o.checkpoint_dir << " (asynchronously)\n";
  }
  out << absl::StrFormat("%6s %9s %9s %10s %9s %9s", "step", "loss", "val_loss", "grad_norm",
                         "tok/s", "ms");
  out << (gpu != nullptr ? absl::StrFormat(" %6s\n", "mfu") : "\n");
}

// --device: "cpu" (the default), "cuda" (FailedPrecondition naming the reason when no GPU is
// usable) or "auto" (the GPU when usable, else the CPU, saying why). Sets *gpu and *backend for
// the GPU.
absl::Status ChooseDevice(const Flags& flags, std::ostream& out,
                          std::optional<examples::gpt::GpuInfo>* gpu,
                          std::unique_ptr<examples::gpt::Backend>* backend) {
  const std::string device = flags.Get("device", "cpu");
  if (device != "cpu" && device != "cuda" && device != "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat("--device must be cpu, cuda or auto, got '", device, "'"));
  }
  if (device == "cpu") return absl::OkStatus();
  absl::StatusOr<examples::gpt::GpuInfo> probe = examples::gpt::ProbeGpu(0);
  if (probe.ok()) {
    absl::StatusOr<std::unique_ptr<examples::gpt::Backend>> cuda =
        examples::gpt::CreateCudaBackend(0);
    if (cuda.ok()) {
      *gpu = *probe;
      *backend = *std::move(cuda);
      return absl::OkStatus();
    }
    probe = cuda.status();
  }
  if (device == "cuda") {
    return absl::FailedPreconditionError(
        absl::StrCat("--device cuda: no usable GPU: ", probe.status().message()));
  }
  out << "--device auto: no usable GPU (" << probe.status().message()
      << "); training on the CPU\n";
  return absl::OkStatus();
}

// The device budget each rank's engine fitted its plan to (MemoryReport::device_budget_bytes:
// model states, the activations the trainer declared for its micro-batch, reserves) beside what
// the driver counted in use at the highest, for all ranks together (they share the GPU); and, for
// comparison, what Korthikanti et al.'s formula would have counted for the GPT's shape.
absl::Status PrintDeviceBudgetCheck(const Config& config, const examples::gpt::RunOptions& options,
                                    const examples::gpt::RunResult& result, int64_t peak_in_use,
                                    const absl::Status& in_use_status, std::ostream& out) {
  if (result.memory.empty()) return absl::InternalError("the GPT run reported no rank's memory");
  auto gib = [](int64_t bytes) { return absl::StrFormat("%.2f GiB", bytes / 1073741824.0); };
  // Rank 0's lines; the ranks' plans differ only in their shards' padding.
  const MemoryReport& m = result.memory[0];
  const int64_t model_states = m.planned[static_cast<int>(memory::MemoryKind::kDevice)];
  out << "device budget planned per rank: " << gib(m.device_budget_bytes) << " = model states "
      << gib(model_states) << " + activations " << gib(m.activation_bytes) << " (declared: "
      << GroupedBytes(m.activation_bytes_per_sample) << " B per sequence x " << m.micro_batch
      << ") + reserves " << gib(m.device_budget_bytes - model_states - m.activation_bytes)
      << "\n";
  const int seq = options.seq > 0 ? options.seq : options.shape.context;
  const absl::StatusOr<ActivationEstimate> formula = TransformerActivations(
      TransformerShape{options.shape.layers, options.shape.d_model, options.shape.heads,
                       options.shape.vocab},
      seq, options.batch, config.compute_dtype, Recompute::kNone);
  if (formula.ok()) {
    out << "  (Korthikanti et al. 2022 would count " << gib(formula->bytes)
        << " of activations: this trainer keeps its non-matmul activations in fp32)\n";
  }
  if (!in_use_status.ok()) {
    out << "device memory in use: not measured (" << in_use_status.message() << ")\n";
    return absl::OkStatus();
  }
  int64_t planned = 0;
  for (const MemoryReport& rank : result.memory) planned += rank.device_budget_bytes;
  out << "device memory in use (the driver's count, cudaMemGetInfo), highest after a step: "
      << gib(peak_in_use) << " for " << result.memory.size() << " rank(s); planned "
      << gib(planned) << ": measured / planned = "
      << absl::StrFormat("%.3f",
                         static_cast<double>(peak_in_use) / static_cast<double>(planned))
      << "\n";
  return absl::OkStatus();
}

absl::Status RunGptDemo(const Flags& flags, std::ostream& out) {
  std::optional<examples::gpt::GpuInfo> gpu;
  std::unique_ptr<examples::gpt::Backend> backend;
  RETURN_IF_ERROR(ChooseDevice(flags, out, &gpu, &backend));
  const bool cuda = backend != nullptr;
  ASSIGN_OR_RETURN(const Config config, DemoConfig(flags, /*gpt=*/true, cuda));
  ASSIGN_OR_RETURN(examples::gpt::RunOptions options, GptOptions(flags, cuda));
  options.backend = backend.get();
  PrintGptHeader(config, options, gpu ? &*gpu : nullptr, out);
  // Model FLOPs utilisation against the datasheet peak (0: none on record, not printed).
  const double flops_per_token =
      examples::gpt::TrainingFlopsPerToken(options.shape, options.shape.context);
  const double peak = gpu ? PeakFlops(*gpu, config) : 0;
  auto mfu = [&](double tokens_per_s) {
    return peak > 0 ? absl::StrFormat("%5.1f%%", 100 * tokens_per_s * flops_per_token / peak)
                    : std::string("-");
  };
  // The driver's count of device memory in use, at its highest after any step: what the plan's
  // device budget (model states + activations + reserves) claims to hold.
  int64_t peak_in_use = 0;
  absl::Status in_use_status;
  options.on_step = [&out, &gpu, &mfu, &peak_in_use,
                     &in_use_status](const examples::gpt::StepReport& r) {
    if (gpu && in_use_status.ok()) {
      absl::StatusOr<int64_t> in_use = examples::gpt::DeviceMemoryInUse(gpu->ordinal);
      if (in_use.ok()) {
        peak_in_use = std::max(peak_in_use, *in_use);
      } else {
        in_use_status = in_use.status();
      }
    }
    if (!r.evaluated && (r.step + 1) % 10 != 0 && r.step != 0) return;
    out << absl::StrFormat("%6d %9.4f %9s %10.4f %9.0f %9.1f", r.step + 1, r.loss,
                           r.evaluated ? absl::StrFormat("%.4f", r.val_loss) : "", r.stats.grad_norm,
                           r.tokens_per_s, r.ms);
    out << (gpu ? absl::StrFormat(" %6s\n", mfu(r.tokens_per_s)) : "\n");
    out.flush();
  };
  ASSIGN_OR_RETURN(examples::gpt::RunResult result,
                   examples::gpt::RunInProcess(config, options));
  out << "\ncorpus " << result.corpus_path << "\nval loss "
      << absl::StrFormat("%.6f", result.initial_val_loss) << " -> "
      << absl::StrFormat("%.6f", result.final_val_loss) << " nats per byte ("
      << absl::StrFormat("%.2f", result.initial_val_loss / std::log(2.0)) << " -> "
      << absl::StrFormat("%.2f", result.final_val_loss / std::log(2.0))
      << " bits; a uniform guess over 256 bytes is 8) over steps "
      << result.first_step + 1 << "-" << options.steps << "; "
      << absl::StrFormat("%.0f", result.tokens_per_s) << " tokens/s; ";
  PrintPlanLine(result.plan, out);
  if (gpu) {
    out << "model FLOPs per token " << absl::StrFormat("%.3g", flops_per_token)
        << " (6 N + 6 L d T); MFU " << mfu(result.tokens_per_s) << " of "
        << absl::StrFormat("%.0f", peak / 1e12) << " TFLOPS (" << DTypeName(config.compute_dtype)
        << ", " << gpu->name << ")\n";
  }
  for (const std::string& dir : result.checkpoints) out << "checkpoint " << dir << "\n";
  if (!result.sample.empty()) {
    // The untrained model's continuation of the same prompt with the same seed: the contrast
    // shows what the steps learned.
    const examples::gpt::Gpt gpt(options.shape);
    const std::string untrained =
        gpt.Generate(gpt.InitialParams(), options.sample_prompt, options.sample_tokens,
                     options.sample_temperature, options.data_seed);
    out << "\nsamples (temperature " << options.sample_temperature
        << "; \u00b7 = a byte that is not printable ASCII)\nbefore training:\n"
        << Printable(untrained) << "\nafter training:\n" << Printable(result.sample) << "\n";
  }
  PrintMemoryTable(result.memory, out);
  // The trainer's activations as it measured them beside what it declared to the plan.
  out << (gpu ? "activations and scratch of each rank's trainer (GPU memory outside the plan):"
              : "activations of each rank's trainer (measured by its allocator):");
  for (int64_t bytes : result.activation_bytes) out << " " << GroupedBytes(bytes);
  out << "; planned (declared per sequence x micro-batch):";
  for (const MemoryReport& m : result.memory) out << " " << GroupedBytes(m.activation_bytes);
  out << "\n";
  if (gpu) {
    RETURN_IF_ERROR(PrintDeviceBudgetCheck(config, options, result, peak_in_use, in_use_status,
                                           out));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RunDemoCommand(const std::vector<std::string>& args, std::ostream& out) {
  ASSIGN_OR_RETURN(Flags flags,
                   Flags::Parse(args, {"model", "config", "ranks", "steps", "stage", "precision",
                                       "batch", "eval_every", "sample_tokens", "checkpoint",
                                       "checkpoint_every", "resume", "layers", "d_model",
                                       "device", "init-from", "init-map", "corpus"}));
  const std::string model = flags.Get("model", "gpt");
  if (model == "mlp") {
    if (flags.Has("device") && flags.Get("device") != "cpu") {
      return absl::InvalidArgumentError("--device applies to --model gpt only");
    }
    for (const char* gpt_only : {"batch", "eval_every", "sample_tokens", "checkpoint",
                                 "checkpoint_every", "resume", "layers", "d_model",
                                 "init-from", "init-map", "corpus"}) {
      if (flags.Has(gpt_only)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", gpt_only, " applies to --model gpt only"));
      }
    }
    return RunMlpDemo(flags, out);
  }
  if (model != "gpt") {
    return absl::InvalidArgumentError(
        absl::StrCat("--model must be gpt or mlp, got '", model, "'"));
  }
  return RunGptDemo(flags, out);
}

}  // namespace zerort
