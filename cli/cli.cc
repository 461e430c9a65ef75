#include "cli/cli.h"

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
#include "zero/config.h"
#include "cli/flags.h"
#include "zero/model_spec.h"
#include "zero/planner.h"
#include "zero/report.h"

namespace zerort {
namespace {

absl::Status ApplyBudget(const std::string& text, MemoryBudget* budget) {
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(part, '=');
    absl::string_view key = kv.second.empty() ? "device" : kv.first;
    absl::string_view value = kv.second.empty() ? kv.first : kv.second;
    absl::StatusOr<int64_t> bytes = ParseBytes(value);
    if (!bytes.ok()) return Annotate(bytes.status(), "--budget");
    if (key == "device") {
      budget->device_bytes = *bytes;
    } else if (key == "host") {
      budget->host_bytes = *bytes;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "--budget: unknown part '", key, "': expected SIZE or device=SIZE,host=SIZE"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::string Usage() {
  return R"(usage: zerort <command> [flags]

commands:
  plan   print the per-rank memory plan of a model without allocating anything
         --model NAME|FILE   preset (gpt2-124m, gpt2-1.5b, llama2-7b, llama2-13b, llama2-70b)
                             or a JSON model file
         --params N          a synthetic model of N parameters in --layers equal layers (48)
         --world N           data-parallel world size (1)        --rank R   rank to plan (0)
         --stage 0-3|auto    ZeRO stage (config's, else 0)
         --offload none|optimizer|all   CPU offload of optimizer state (and parameters)
         --precision bf16|fp16|fp32     compute dtype (config's, else bf16)
         --config FILE       a JSON config (DeepSpeed keys); flags above override it
         --budget SIZE | device=SIZE,host=SIZE   per-rank memory budget (for --stage auto)
         --json              machine-readable output
         --resolved-config   print the effective config (every default filled in) and exit
  demo   train an example MLP on in-process ranks: per-step loss, then memory planned/allocated
         [--config FILE] [--ranks N (4)] [--steps S (30)] [--stage 0-3] [--precision P (bf16)]
  ckpt   inspect DIR [--json] | consolidate DIR OUT   verify and summarise a checkpoint, or
         write its full fp32 state as one safetensors file (docs/checkpoints.md)
)";
}

absl::Status RunPlanCommand(const std::vector<std::string>& args, std::ostream& out) {
  ASSIGN_OR_RETURN(Flags flags,
                   Flags::Parse(args,
                                {"model", "params", "layers", "world", "rank", "stage", "offload",
                                 "precision", "config", "budget"},
                                {"json", "resolved-config"}));
  Config config;
  config.compute_dtype = DType::kBF16;  // the mixed-precision setting users plan for
  if (flags.Has("config")) {
    ASSIGN_OR_RETURN(config, LoadConfigFile(flags.Get("config")));
  }
  ASSIGN_OR_RETURN(config.compute_dtype,
                   flags.GetComputeDType("precision", config.compute_dtype));
  if (flags.Has("stage")) {
    const std::string s = flags.Get("stage");
    int stage = -1;
    if (s == "auto") {
      config.zero.stage_auto = true;
    } else if (absl::SimpleAtoi(s, &stage) && stage >= 0 && stage <= 3) {
      config.zero.stage_auto = false;
      config.zero.stage = stage;
    } else {
      return absl::InvalidArgumentError(absl::StrCat("--stage '", s, "': expected 0..3 or auto"));
    }
  }
  if (flags.Has("offload")) {
    const std::string o = flags.Get("offload");
    const bool optimizer = o == "optimizer" || o == "cpu" || o == "all";
    const bool param = o == "all";
    if (!optimizer && o != "none") {
      return absl::InvalidArgumentError(
          absl::StrCat("--offload '", o, "': expected none, optimizer or all"));
    }
    config.zero.offload_optimizer.device = optimizer ? OffloadDevice::kCpu : OffloadDevice::kNone;
    config.zero.offload_param.device = param ? OffloadDevice::kCpu : OffloadDevice::kNone;
  }
  if (flags.Has("budget")) RETURN_IF_ERROR(ApplyBudget(flags.Get("budget"), &config.zero.memory_budget));
  RETURN_IF_ERROR(ValidateConfig(config));
  if (flags.Has("resolved-config")) {
    out << ResolvedConfigJson(config) << "\n";
    return absl::OkStatus();
  }

  std::vector<memory::ParamSpec> specs;
  if (flags.Has("model") == flags.Has("params")) {
    return absl::InvalidArgumentError("plan needs exactly one of --model NAME|FILE or --params N");
  }
  if (flags.Has("model")) {
    const std::string m = flags.Get("model");
    if (absl::EndsWith(m, ".json")) {
      ASSIGN_OR_RETURN(specs, LoadModelFile(m));
    } else {
      ASSIGN_OR_RETURN(specs, ModelPreset(m));
    }
  } else {
    ASSIGN_OR_RETURN(int64_t params, flags.GetInt("params", 0, 1));
    ASSIGN_OR_RETURN(int64_t layers, flags.GetInt("layers", 48, 1));
    ASSIGN_OR_RETURN(specs, SyntheticModel(params, static_cast<int>(std::min(layers, params))));
  }
  ASSIGN_OR_RETURN(int64_t world, flags.GetInt("world", 1, 1));
  ASSIGN_OR_RETURN(int64_t rank, flags.GetInt("rank", 0, 0));
  if (rank >= world) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rank ", rank, " is outside the world of ", world, " ranks"));
  }
  ASSIGN_OR_RETURN(PlanChoice choice,
                   ChoosePlan(specs, config, static_cast<int>(world), static_cast<int>(rank)));
  if (flags.Has("json")) {
    nlohmann::ordered_json j = PlanJson(choice.plan);
    j["fits_budget"] = choice.fits;
    j["reason"] = choice.reason;
    out << j.dump(2) << "\n";
  } else {
    out << PlanTable(choice.plan) << choice.reason << "\n";
  }
  return absl::OkStatus();
}

}  // namespace zerort
