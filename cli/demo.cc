#include "cli/demo.h"

#include <map>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/bytes.h"
#include "base/status.h"
#include "examples/mlp/mlp.h"
#include "memory/plan.h"
#include "zero/config.h"
#include "cli/flags.h"

namespace zerort {
namespace {

// Small units and no persistent units, so that a 5-thousand-parameter model still shows
// several buckets and real stage-3 gathers.
constexpr char kDefaultConfig[] = R"({
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

}  // namespace

absl::Status RunDemoCommand(const std::vector<std::string>& args, std::ostream& out) {
  ASSIGN_OR_RETURN(Flags flags,
                   Flags::Parse(args, {"config", "ranks", "steps", "stage", "precision"}));
  Config config;
  if (flags.Has("config")) {
    ASSIGN_OR_RETURN(config, LoadConfigFile(flags.Get("config")));
  } else {
    ASSIGN_OR_RETURN(config, ParseConfig(kDefaultConfig, "<demo default config>"));
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
  examples::RunOptions options;
  ASSIGN_OR_RETURN(options.world_size, flags.GetInt("ranks", 4, 1, 256));
  ASSIGN_OR_RETURN(options.steps, flags.GetInt("steps", 30, 1, 1000000));
  options.batch = 32;
  options.device_threads = 1;

  const examples::Mlp mlp(options.shape);
  for (const std::string& note : config.notes) out << "note: " << note << "\n";
  out << "zerort demo: MLP " << absl::StrJoin(options.shape.dims, "-") << " ("
      << mlp.num_elements() << " parameters) on " << options.world_size
      << " in-process ranks, stage "
      << (config.zero.stage_auto ? std::string("auto") : absl::StrCat(config.zero.stage)) << ", "
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

  const memory::Plan& plan = result.plan;
  out << "\nloss " << absl::StrFormat("%.6f", result.steps.front().loss) << " -> "
      << absl::StrFormat("%.6f", result.steps.back().loss) << " over " << options.steps
      << " steps; stage " << plan.options.stage << ", " << plan.units.size()
      << " units, " << plan.comm_bytes_per_step << " bytes sent per rank per step (planned)\n";
  out << "\nmemory per rank in bytes, planned / allocated:\n" << absl::StrFormat("%6s", "rank");
  for (int k = 0; k < memory::kNumMemoryKinds; ++k) {
    out << absl::StrFormat(" %27s", memory::MemoryKindName(static_cast<memory::MemoryKind>(k)));
  }
  out << "\n";
  bool all_match = true;
  for (int r = 0; r < options.world_size; ++r) {
    const MemoryReport& m = result.memory[r];
    out << absl::StrFormat("%6d", r);
    for (int k = 0; k < memory::kNumMemoryKinds; ++k) {
      out << absl::StrFormat(" %13s / %11s", GroupedBytes(m.planned[k]), GroupedBytes(m.allocated[k]));
      all_match = all_match && m.planned[k] == m.allocated[k];
    }
    out << "\n";
  }
  out << (all_match ? "every rank allocated exactly its plan\n"
                    : "WARNING: allocation differs from the plan\n");
  return absl::OkStatus();
}

}  // namespace zerort
