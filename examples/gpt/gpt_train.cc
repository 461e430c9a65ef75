// gpt_train: trains the example GPT on in-process ranks and prints the loss, the held-out loss,
// tokens/s, each rank's memory and a generated sample.
//
//   bazel run //examples/gpt:gpt_train -- --ranks 2 --stage 3 --steps 300
//   bazel run //examples/gpt:gpt_train -- --preset gpt2 --stage 3 --offload
//     --bucket 10000000   (GPT-2 124M shapes for the memory footprint: 2 steps of 64 tokens,
//     no sample; units of at most 10M elements, so stage 3 gathers a few layers at a time)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "examples/gpt/gpt.h"
#include "zero/config.h"

namespace {

using zerort::examples::gpt::RunOptions;

constexpr char kUsage[] =
    "usage: gpt_train [--ranks N] [--stage 0-3] [--offload] [--precision fp32|bf16|fp16]\n"
    "  [--bucket ELEMENTS (reduce_bucket_size: the unit size)]\n"
    "  [--steps N] [--batch N] [--seq N] [--lr X] [--clip X] [--eval_every N] [--eval_windows N]\n"
    "  [--preset default|gpt2] [--layers N] [--heads N] [--d_model N] [--context N] [--vocab N]\n"
    "  [--threads N] [--print_every N] [--sample_tokens N] [--prompt TEXT] [--temperature X]\n"
    "  [--corpus PATH] [--seed N] [--init-from FILE (safetensors weights to start from)]\n"
    "  [--init-map FILE (their tensor names -> the GPT's, checkpoint/weights.h)]\n"
    "  [--freeze GLOB[,GLOB...] (zerort.frozen_params)]\n";

struct Args {
  RunOptions run;
  zerort::Config config;
  int print_every = 10;
  bool gpt2 = false;         // --preset gpt2
  int sample_tokens = -1;    // -1: 160, or 0 with --preset gpt2 (generation would take hours)
  int eval_windows = -1;     // -1: all, or 2 with --preset gpt2
  // -1: RunOptions' defaults (200 steps of 4 full-context sequences), or with --preset gpt2 2
  // steps of 1 sequence of 64 tokens (about 50 GFLOP per rank and step).
  int steps = -1, batch = -1, seq = -1;
};

[[noreturn]] void Fail(const std::string& message) {
  std::fprintf(stderr, "gpt_train: %s\n%s", message.c_str(), kUsage);
  std::exit(2);
}

int ToInt(const std::string& flag, const char* value) {
  char* end = nullptr;
  const long v = std::strtol(value, &end, 10);
  if (*value == '\0' || *end != '\0') Fail("--" + flag + " wants an integer, got '" + value + "'");
  return static_cast<int>(v);
}

double ToDouble(const std::string& flag, const char* value) {
  char* end = nullptr;
  const double v = std::strtod(value, &end);
  if (*value == '\0' || *end != '\0') Fail("--" + flag + " wants a number, got '" + value + "'");
  return v;
}

// Applies one --flag (value = next argument, or nullptr for a switch); false if unknown.
bool Apply(Args& a, const std::string& flag, const char* value) {
  RunOptions& r = a.run;
  zerort::examples::gpt::GptShape& s = r.shape;
  if (flag == "offload") {
    a.config.zero.offload_optimizer.device = zerort::OffloadDevice::kCpu;
    return true;
  }
  if (value == nullptr) Fail("--" + flag + " needs a value");
  const std::string v = value;
  if (flag == "preset") {
    if (v != "gpt2" && v != "default") Fail("--preset must be default or gpt2, got " + v);
    a.gpt2 = v == "gpt2";
    s = a.gpt2 ? zerort::examples::gpt::GptShape::Gpt2Small() : zerort::examples::gpt::GptShape{};
  } else if (flag == "precision") {
    if (v != "fp32" && v != "bf16" && v != "fp16") Fail("--precision must be fp32, bf16 or fp16");
    a.config.compute_dtype = v == "bf16"   ? zerort::DType::kBF16
                         : v == "fp16" ? zerort::DType::kF16
                                       : zerort::DType::kF32;
  } else if (flag == "ranks") { r.world_size = ToInt(flag, value);
  } else if (flag == "stage") { a.config.zero.stage = ToInt(flag, value);
  } else if (flag == "steps") { a.steps = ToInt(flag, value);
  } else if (flag == "batch") { a.batch = ToInt(flag, value);
  } else if (flag == "seq") { a.seq = ToInt(flag, value);
  } else if (flag == "lr") { a.config.optimizer.lr = ToDouble(flag, value);
  } else if (flag == "bucket") { a.config.zero.reduce_bucket_size = ToInt(flag, value);
  } else if (flag == "clip") { a.config.gradient_clipping = ToDouble(flag, value);
  } else if (flag == "eval_every") { r.eval_every = ToInt(flag, value);
  } else if (flag == "eval_windows") { a.eval_windows = ToInt(flag, value);
  } else if (flag == "layers") { s.layers = ToInt(flag, value);
  } else if (flag == "heads") { s.heads = ToInt(flag, value);
  } else if (flag == "d_model") { s.d_model = ToInt(flag, value);
  } else if (flag == "context") { s.context = ToInt(flag, value);
  } else if (flag == "vocab") { s.vocab = ToInt(flag, value);
  } else if (flag == "threads") { r.threads = ToInt(flag, value);
  } else if (flag == "print_every") { a.print_every = ToInt(flag, value);
  } else if (flag == "sample_tokens") { a.sample_tokens = ToInt(flag, value);
  } else if (flag == "prompt") { r.sample_prompt = v;
  } else if (flag == "temperature") { r.sample_temperature = static_cast<float>(ToDouble(flag, value));
  } else if (flag == "corpus") { r.corpus_path = v;
  } else if (flag == "init-from") { r.init_from = v;
  } else if (flag == "init-map") { r.init_map = v;
  } else if (flag == "freeze") { a.config.frozen_params = v;
  } else if (flag == "seed") { r.data_seed = s.seed = ToInt(flag, value);
  } else {
    return false;
  }
  return true;
}

Args Parse(int argc, char** argv) {
  Args a;
  a.config.optimizer.lr = 3e-3;
  a.config.optimizer.weight_decay = 0.0;
  a.config.gradient_clipping = 1.0;
  a.run.sample_temperature = 0.8f;  // greedy decoding of a small model repeats "the the the"
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (flag.rfind("--", 0) != 0) Fail("unexpected argument " + flag);
    flag = flag.substr(2);
    const char* value = nullptr;
    if (flag != "offload") value = i + 1 < argc ? argv[++i] : nullptr;
    if (!Apply(a, flag, value)) Fail("unknown flag --" + flag);
  }
  a.run.sample_tokens = a.sample_tokens >= 0 ? a.sample_tokens : a.gpt2 ? 0 : 160;
  a.run.eval_windows = a.eval_windows >= 0 ? a.eval_windows : a.gpt2 ? 2 : 0;
  if (a.steps >= 0 || a.gpt2) a.run.steps = a.steps >= 0 ? a.steps : 2;
  if (a.batch >= 0 || a.gpt2) a.run.batch = a.batch >= 0 ? a.batch : 1;
  if (a.seq >= 0 || a.gpt2) a.run.seq = a.seq >= 0 ? a.seq : 64;
  return a;
}

void PrintMemory(const zerort::examples::gpt::RunResult& result) {
  static const char* kKinds[] = {"device", "pinned host", "host"};
  for (size_t r = 0; r < result.memory.size(); ++r) {
    std::printf("rank %zu memory:", r);
    for (int k = 0; k < 3; ++k) {
      std::printf("  %s %.1f MiB (planned %.1f)", kKinds[k], result.memory[r].allocated[k] / 1048576.0,
                  result.memory[r].planned[k] / 1048576.0);
    }
    std::printf("\n");
  }
}

}  // namespace

int main(int argc, char** argv) {
  Args a = Parse(argc, argv);
  const zerort::examples::gpt::Gpt gpt(a.run.shape);
  std::printf("GPT: %d layers, %d heads, d_model %d, context %d, vocab %d: %lld parameters; %d ranks, "
              "stage %d%s, %s\n",
              a.run.shape.layers, a.run.shape.heads, a.run.shape.d_model, a.run.shape.context,
              a.run.shape.vocab, static_cast<long long>(gpt.num_elements()), a.run.world_size,
              a.config.zero.stage,
              a.config.zero.offload_optimizer.device == zerort::OffloadDevice::kCpu ? " + offload" : "",
              std::string(zerort::DTypeName(a.config.compute_dtype)).c_str());
  std::fflush(stdout);
  const int print_every = a.print_every;
  a.run.on_step = [print_every](const zerort::examples::gpt::StepReport& r) {
    if (!r.evaluated && (print_every <= 0 || r.step % print_every != 0)) return;
    std::printf("step %4d  loss %.4f", r.step, r.loss);
    if (r.evaluated) std::printf("  val %.4f", r.val_loss);
    std::printf("  %.0f tok/s  %.1f ms  grad norm %.3f\n", r.tokens_per_s, r.ms, r.stats.grad_norm);
    std::fflush(stdout);
  };
  absl::StatusOr<zerort::examples::gpt::RunResult> result =
      zerort::examples::gpt::RunInProcess(a.config, a.run);
  if (!result.ok()) {
    std::fprintf(stderr, "gpt_train: %s\n", result.status().ToString().c_str());
    return 1;
  }
  std::printf("corpus %s\nval loss %.4f -> %.4f; %.0f tokens/s over training\n",
              result->corpus_path.c_str(), result->initial_val_loss, result->final_val_loss,
              result->tokens_per_s);
  PrintMemory(*result);
  if (!result->sample.empty()) std::printf("sample:\n%s\n", result->sample.c_str());
  return 0;
}
