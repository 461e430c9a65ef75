#include "cli/cli.h"

#include <algorithm>
#include <limits>
#include <map>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/bytes.h"
#include "base/status.h"
#include "zero/auto_fill.h"
#include "zero/config.h"
#include "cli/flags.h"
#include "zero/model_spec.h"
#include "zero/planner.h"
#include "zero/report.h"

namespace zerort {
namespace {

// --budget SIZE | device=SIZE[,host=SIZE]: each key at most once, each part exactly KEY=SIZE.
absl::Status ApplyBudget(const std::string& text, MemoryBudget* budget) {
  constexpr absl::string_view kForm = "expected SIZE or device=SIZE,host=SIZE";
  const std::vector<absl::string_view> parts = absl::StrSplit(text, ',');
  bool seen_device = false, seen_host = false;
  for (absl::string_view part : parts) {
    std::vector<absl::string_view> kv = absl::StrSplit(part, '=');
    if (kv.size() == 1 && parts.size() == 1) kv.insert(kv.begin(), "device");
    if (kv.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("--budget: cannot read part '", part, "': ", kForm));
    }
    bool* seen = kv[0] == "device" ? &seen_device : kv[0] == "host" ? &seen_host : nullptr;
    if (seen == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("--budget: unknown part '", kv[0], "': ", kForm));
    }
    if (*seen) return absl::InvalidArgumentError(absl::StrCat("--budget: '", kv[0], "' is given twice"));
    *seen = true;
    absl::StatusOr<int64_t> bytes = ParseBytes(kv[1]);
    if (!bytes.ok()) return Annotate(bytes.status(), "--budget");
    (kv[0] == "device" ? budget->device_bytes : budget->host_bytes) = *bytes;
  }
  return absl::OkStatus();
}

// --stage 0-3|auto.
absl::Status ApplyStage(const std::string& s, ZeroConfig* zero) {
  int stage = -1;
  if (s == "auto") {
    zero->stage_auto = true;
  } else if (absl::SimpleAtoi(s, &stage) && stage >= 0 && stage <= 3) {
    zero->stage_auto = false;
    zero->stage = stage;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--stage '", s, "': expected 0..3 or auto"));
  }
  return absl::OkStatus();
}

// --offload none|optimizer|all|nvme|nvme-all ("cpu" = optimizer; nvme: the optimizer state in
// files; nvme-all: the stage-3 parameter shard too). Planning creates no files, so an NVMe
// offload the flag asks for needs no nvme_path; a config's own NVMe offload still does.
absl::Status ApplyOffload(const std::string& o, ZeroConfig* zero) {
  const bool nvme = o == "nvme" || o == "nvme-all";
  const bool optimizer = o == "optimizer" || o == "cpu" || o == "all" || nvme;
  const bool param = o == "all" || o == "nvme-all";
  if (!optimizer && o != "none") {
    return absl::InvalidArgumentError(
        absl::StrCat("--offload '", o, "': expected none, optimizer, all, nvme or nvme-all"));
  }
  const OffloadDevice host_or_nvme = nvme ? OffloadDevice::kNvme : OffloadDevice::kCpu;
  zero->offload_optimizer.device = optimizer ? host_or_nvme : OffloadDevice::kNone;
  zero->offload_param.device = param ? host_or_nvme : OffloadDevice::kNone;
  auto placeholder = [](OffloadDevice device, std::string* path) {
    if (device == OffloadDevice::kNvme && path->empty()) *path = "(not needed to plan)";
  };
  placeholder(zero->offload_optimizer.device, &zero->offload_optimizer.nvme_path);
  placeholder(zero->offload_param.device, &zero->offload_param.nvme_path);
  return absl::OkStatus();
}

// --offload-ratio R: offload_optimizer.ratio, the fraction of the optimizer state offloaded
// (DeepSpeed's meaning). It needs optimizer offload, from --offload or the config, unless
// --stage auto chooses the offload (the ratio is then the most auto offloads).
absl::Status ApplyOffloadRatio(const std::string& text, ZeroConfig* zero) {
  double ratio = 0;
  if (!absl::SimpleAtod(text, &ratio) || !(ratio >= 0 && ratio <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--offload-ratio '", text, "': expected a number in [0, 1] (the fraction of the "
        "optimizer state offloaded)"));
  }
  if (zero->offload_optimizer.device == OffloadDevice::kNone && !zero->stage_auto) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--offload-ratio ", text, " splits offloaded optimizer state: give --offload "
        "optimizer|all|nvme|nvme-all (or a config with zero_optimization.offload_optimizer), or "
        "--stage auto"));
  }
  zero->offload_optimizer.ratio = ratio;
  return absl::OkStatus();
}

// The config file (its notes included), then the flags that override it.
absl::StatusOr<Config> PlanConfig(const Flags& flags) {
  Config config;
  config.compute_dtype = DType::kBF16;  // the mixed-precision setting users plan for
  if (flags.Has("config")) {
    ASSIGN_OR_RETURN(config, LoadConfigFile(flags.Get("config"), ParseOptions{flags.Has("strict")}));
  }
  ASSIGN_OR_RETURN(config.compute_dtype,
                   flags.GetComputeDType("precision", config.compute_dtype));
  if (flags.Has("stage")) RETURN_IF_ERROR(ApplyStage(flags.Get("stage"), &config.zero));
  if (flags.Has("offload")) RETURN_IF_ERROR(ApplyOffload(flags.Get("offload"), &config.zero));
  if (flags.Has("offload-ratio")) {
    RETURN_IF_ERROR(ApplyOffloadRatio(flags.Get("offload-ratio"), &config.zero));
  }
  if (flags.Has("budget")) {
    RETURN_IF_ERROR(ApplyBudget(flags.Get("budget"), &config.zero.memory_budget));
  }
  RETURN_IF_ERROR(ValidateConfig(config));
  return config;
}

// --model NAME|FILE.json or --params N [--layers L].
absl::StatusOr<std::vector<memory::ParamSpec>> PlanModel(const Flags& flags) {
  if (flags.Has("model") == flags.Has("params")) {
    return absl::InvalidArgumentError("plan needs exactly one of --model NAME|FILE or --params N");
  }
  if (flags.Has("model")) {
    const std::string m = flags.Get("model");
    // A path (a slash, or the .json suffix) is a model file; anything else names a preset.
    if (absl::EndsWith(m, ".json") || absl::StrContains(m, '/')) return LoadModelFile(m);
    return ModelPreset(m);
  }
  ASSIGN_OR_RETURN(int64_t params, flags.GetInt("params", 0, 1));
  ASSIGN_OR_RETURN(int64_t layers, flags.GetInt("layers", 48, 1, kMaxSyntheticLayers));
  return SyntheticModel(params, std::min(layers, params));
}

// --fill JSON (ParseAutoFill's keys), with --world and the compute dtype as defaults: what
// `plan` knows in place of a trainer.
absl::StatusOr<AutoFill> PlanFill(const Flags& flags, int64_t world) {
  AutoFill fill;
  if (flags.Has("fill")) {
    ASSIGN_OR_RETURN(fill, ParseAutoFill(flags.Get("fill")));
  }
  if (!fill.world_size) fill.world_size = world;
  if (!fill.compute_dtype) {
    // --precision, else bf16: the mixed-precision setting users plan for.
    ASSIGN_OR_RETURN(fill.compute_dtype, flags.GetComputeDType("precision", DType::kBF16));
  }
  return fill;
}

// --seq N --micro-batch B --recompute LEVEL: the activation workload. The formula needs the
// transformer's shape, which only the presets carry; a model file declares its own bytes.
absl::StatusOr<Workload> PlanWorkload(const Flags& flags) {
  Workload w;
  ASSIGN_OR_RETURN(w.micro_batch, flags.GetInt("micro-batch", 0, 1, int64_t{1} << 30));
  ASSIGN_OR_RETURN(w.seq, flags.GetInt("seq", 0, 1, int64_t{1} << 30));
  if (flags.Has("recompute")) {
    if (!flags.Has("seq")) {
      return absl::InvalidArgumentError(
          "--recompute applies to the activation formula: give --seq too");
    }
    ASSIGN_OR_RETURN(w.recompute, ParseRecompute(flags.Get("recompute")));
  }
  if (!flags.Has("seq")) return w;
  const std::string m = flags.Get("model");
  const bool preset = flags.Has("model") && !absl::EndsWith(m, ".json") && !absl::StrContains(m, '/');
  if (!preset) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--seq needs a --model preset (", absl::StrJoin(ModelPresetNames(), ", "),
        ") for the activation formula; a model file declares its modules' "
        "activation_bytes_per_sample instead"));
  }
  ASSIGN_OR_RETURN(w.shape, ModelPresetShape(m));
  return w;
}

// What a plan without activations says after the library's note: how to count them.
constexpr char kHowToCount[] =
    " (pass --seq and --micro-batch with a --model preset, or declare activation_bytes_per_sample "
    "in the model file)";

// --fit micro-batch: one line (or JSON object) per auto candidate.
absl::Status PrintFit(const std::vector<memory::ParamSpec>& specs, const Config& config,
                      int world, int rank, const Workload& workload, bool json, std::ostream& out) {
  ASSIGN_OR_RETURN(std::vector<MicroBatchFit> fits,
                   FitMicroBatch(specs, config, world, rank, workload));
  if (json) {
    nlohmann::ordered_json j = nlohmann::ordered_json::array();
    for (const MicroBatchFit& f : fits) {
      j.push_back(nlohmann::ordered_json{{"candidate", f.description},
                                         {"stage", f.options.stage},
                                         {"offload_optimizer", f.options.offload_optimizer},
                                         {"offload_param", f.options.offload_param},
                                         {"micro_batch", f.micro_batch},
                                         {"why_none", f.why_none},
                                         {"device_budget", DeviceBudgetJson(f.budget)}});
    }
    out << j.dump(2) << "\n";
    return absl::OkStatus();
  }
  out << "largest micro-batch within " << HumanBytes(config.zero.memory_budget.device_bytes)
      << " device per rank (activations: " << (fits.empty() ? "" : fits[0].budget.activation_source)
      << "):\n";
  for (const MicroBatchFit& f : fits) {
    if (f.micro_batch == 0) {
      out << "  " << f.description << ": none (" << f.why_none << ")\n";
    } else {
      out << "  " << f.description << ": " << f.micro_batch << " ("
          << HumanBytes(f.budget.model_state_bytes) << " model state + "
          << HumanBytes(f.budget.activation_bytes) << " activations + "
          << HumanBytes(f.budget.reserve_bytes) << " reserves = "
          << HumanBytes(f.budget.total_bytes) << ")\n";
    }
  }
  return absl::OkStatus();
}

}  // namespace

namespace {

// One section per command: `zerort --help` prints them all, `zerort CMD --help` its own.
constexpr const char* kPlanUsage =
    R"(  plan   print the per-rank memory plan of a model without allocating anything
         --model NAME|FILE   preset (gpt2-124m, gpt2-1.5b, llama2-7b, llama2-13b, llama2-70b)
                             or a JSON model file
         --params N          a synthetic model of N parameters in --layers equal layers (48,
                             at most 4096)
         --world N           data-parallel world size (1)        --rank R   rank to plan (0)
         --stage 0-3|auto    ZeRO stage (config's, else 0)
         --offload none|optimizer|all   CPU offload of optimizer state (and parameters)
         --offload nvme|nvme-all        optimizer state (nvme-all: and the stage-3 parameter
                                        shard) in files: NVMe offload
         --offload-ratio R   the fraction of the optimizer state offloaded, 0..1 (1); the rest
                             stays on the device, whole units (offload_optimizer.ratio)
         --precision bf16|fp16|fp32     compute dtype (config's, else bf16)
         --config FILE       a JSON config (DeepSpeed keys); flags above override it
         --budget SIZE | device=SIZE,host=SIZE   per-rank memory budget (for --stage auto);
                             SIZE as 80GiB, 16GB, 8e10 or 1.5e-3TiB, rounded to the nearest byte
         --fill JSON         values for the config's "auto" keys, as a trainer fills them:
                             {"hidden_size": 4096, "lr": 3e-4, "total_num_steps": 1000, ...}
                             (docs/config.md); --world and --precision fill their own
         --strict            every config key that would be ignored is an error
         --seq N             tokens per sequence: count activations by Korthikanti et al.
                             2022 (presets), and the runtime's reserves (docs/memory_budget.md)
         --micro-batch B     sequences per micro-batch (config's, else 1)
         --recompute none|selective|full   activation recomputation (none)
         --fit micro-batch   the largest micro-batch that fits --budget, per stage and offload
         --json              machine-readable output
         --resolved-config   print the effective config (every default filled in) and exit
)";
constexpr const char* kDemoUsage =
    R"(  demo   train the example GPT (or --model mlp) on in-process ranks: loss, sample, memory
         [--model gpt|mlp] [--ranks N (4)] [--steps S (gpt 150, mlp 30)] [--stage 0-3] [--config FILE]
         [--precision P (bf16)] [--checkpoint DIR [--checkpoint_every N (50)]] [--resume DIR]
         [--init-from FILE (safetensors weights to start from)] [--init-map FILE (their names -> the GPT's: checkpoint/weights.h)] [--corpus FILE (text to train on)]
         [--device cpu|cuda|auto (cpu)] [--batch B] [--layers L] [--d_model D] [--eval_every N]
)";
constexpr const char* kCkptUsage =
    R"(  ckpt   inspect DIR [--json] | consolidate DIR OUT   verify and summarise a checkpoint, or
         write its full fp32 state as one safetensors file (docs/checkpoints.md)
         export DIR --format safetensors [--dtype bf16|fp32] [--max-shard-size 5GB]
                [--name-map FILE] OUT
                             weights only, as Hugging Face loads them: OUT a .safetensors
                             file, or a directory (shards + model.safetensors.index.json);
                             FILE's rules rename the tensors ("prefix h. transformer.h.")
)";

}  // namespace

std::string Usage() {
  return absl::StrCat("usage: zerort <command> [flags]\n\ncommands:\n", kPlanUsage, kDemoUsage,
                      kCkptUsage);
}

std::string CommandUsage(absl::string_view command) {
  const char* section = command == "plan"   ? kPlanUsage
                        : command == "demo" ? kDemoUsage
                        : command == "ckpt" ? kCkptUsage
                                            : nullptr;
  if (section == nullptr) return "";
  return absl::StrCat("usage: zerort ", command, " [flags]\n\n", section);
}

bool WantsHelp(const std::vector<std::string>& args) {
  return std::any_of(args.begin(), args.end(),
                     [](const std::string& a) { return a == "--help" || a == "-h"; });
}

absl::Status RunPlanCommand(const std::vector<std::string>& args, std::ostream& out) {
  ASSIGN_OR_RETURN(Flags flags,
                   Flags::Parse(args,
                                {"model", "params", "layers", "world", "rank", "stage", "offload",
                                 "offload-ratio", "precision", "config", "budget", "fill", "seq",
                                 "micro-batch", "recompute", "fit"},
                                {"json", "resolved-config", "strict"}));
  ASSIGN_OR_RETURN(Config config, PlanConfig(flags));
  if (flags.Has("resolved-config")) {
    out << ResolvedConfigJson(config) << "\n";
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(std::vector<memory::ParamSpec> specs, PlanModel(flags));
  // Plan options hold int ranks: a larger value is refused, never truncated.
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  ASSIGN_OR_RETURN(int64_t world, flags.GetInt("world", 1, 1, kIntMax));
  ASSIGN_OR_RETURN(int64_t rank, flags.GetInt("rank", 0, 0, kIntMax));
  if (rank >= world) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rank ", rank, " is outside the world of ", world, " ranks"));
  }
  ASSIGN_OR_RETURN(AutoFill fill, PlanFill(flags, world));
  // A plan needs only what changes it: the schedule's "auto" values are noted, not required.
  RETURN_IF_ERROR(
      Annotate(ResolveAuto(fill, specs, &config, AutoPurpose::kPlan), "\"auto\" values"));
  ASSIGN_OR_RETURN(Workload workload, PlanWorkload(flags));
  if (flags.Has("fit")) {
    if (flags.Get("fit") != "micro-batch") {
      return absl::InvalidArgumentError(
          absl::StrCat("--fit '", flags.Get("fit"), "': expected micro-batch"));
    }
    if (flags.Has("micro-batch")) {
      return absl::InvalidArgumentError("--fit micro-batch searches the micro-batch: drop --micro-batch");
    }
    return PrintFit(specs, config, static_cast<int>(world), static_cast<int>(rank), workload,
                    flags.Has("json"), out);
  }
  ASSIGN_OR_RETURN(PlanChoice choice, ChoosePlan(specs, config, static_cast<int>(world),
                                                 static_cast<int>(rank), workload));
  if (!choice.budget.counted) choice.budget.note += kHowToCount;
  if (flags.Has("json")) {
    nlohmann::ordered_json j = PlanJson(choice.plan);
    j["fits_budget"] = choice.fits;
    j["reason"] = choice.reason;
    j["decided_by"] = choice.decided_by;
    j["device_budget"] = DeviceBudgetJson(choice.budget);
    j["notes"] = config.notes;
    // The "auto" resolutions again on their own: "<path>: auto -> <value> (<why>)".
    std::vector<std::string> resolved;
    for (const std::string& note : config.notes) {
      if (absl::StrContains(note, ": auto -> ")) resolved.push_back(note);
    }
    j["auto_resolved"] = resolved;
    out << j.dump(2) << "\n";
  } else {
    for (const std::string& note : config.notes) out << "note: " << note << "\n";
    out << PlanTable(choice.plan)
        << DeviceBudgetTable(choice.budget, config.zero.memory_budget.device_bytes)
        << choice.reason << "\n";
  }
  return absl::OkStatus();
}

}  // namespace zerort
