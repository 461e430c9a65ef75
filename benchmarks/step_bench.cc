// Step time of the example MLP (examples/mlp) per ZeRO stage at world 1, 2 and 4 in-process
// ranks, with stage 0 (plain data parallelism: full state on every rank, one all-reduce per
// unit) as the baseline each stage is measured against. The limit a sharded stage is held to:
// its iteration time within a small factor of stage 0's while holding 1/world of the optimizer
// state (stages 1-2) or of everything (stage 3); `allocated_bytes` (rank 0, every memory kind) shows that side of the trade.
//
// Per (world, stage): medians over the measured steps (after warm-up) of rank 0's wall time of
// forward + backward + Step() (`iteration_ms`), of Step() alone (`step_ms`) and of its reduce,
// gather and optimizer parts, plus `ratio_to_stage0` = iteration_ms / stage 0's iteration_ms.
// The in-process ranks share the machine's cores, so absolute times at world > cores measure
// contention as much as the engine; compare stages at the same world.
//
// Usage: step_bench [--quick]   (--quick: a small model and a few steps, a few seconds for CI)
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "benchmarks/bench_util.h"
#include "examples/mlp/mlp.h"
#include "nlohmann/json.hpp"
#include "zero/config.h"

namespace zerort {
namespace {

using bench::Median;

int Main(int argc, char** argv) {
  bool quick = false;
  if (!bench::ParseQuick(argc, argv, "step_bench", &quick)) return 2;
  examples::RunOptions base;
  base.shape.dims = quick ? std::vector<int>{32, 128, 128, 32} : std::vector<int>{128, 512, 512, 128};
  base.batch = quick ? 8 : 16;
  const int warmup = quick ? 2 : 3;
  const int measured = quick ? 10 : 12;
  base.steps = warmup + measured;
  base.device_threads = 1;
  const int64_t bucket = quick ? 4096 : 65536;

  nlohmann::ordered_json results = nlohmann::ordered_json::array();
  for (int world : {1, 2, 4}) {
    double stage0_ms = 0;
    for (int stage = 0; stage <= 3; ++stage) {
      const std::string json = absl::StrCat(
          R"({"zero_optimization": {"stage": )", stage, R"(, "reduce_bucket_size": )", bucket,
          R"(, "stage3_param_persistence_threshold": 0}, "bf16": {"enabled": true},)",
          R"( "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}})");
      absl::StatusOr<Config> config = ParseConfig(json, "step_bench");
      if (!config.ok()) {
        std::fprintf(stderr, "step_bench: %s\n", std::string(config.status().message()).c_str());
        return 1;
      }
      examples::RunOptions options = base;
      options.world_size = world;
      absl::StatusOr<examples::RunResult> run = examples::RunInProcess(*config, options);
      if (!run.ok()) {
        std::fprintf(stderr, "step_bench: world %d stage %d: %s\n", world, stage,
                     std::string(run.status().message()).c_str());
        return 1;
      }
      std::vector<double> iter, step, reduce, gather, opt;
      for (int s = warmup; s < base.steps; ++s) {
        const examples::StepReport& r = run->steps[s];
        iter.push_back(r.ms);
        step.push_back(r.stats.total_ms);
        reduce.push_back(r.stats.reduce_ms);
        gather.push_back(r.stats.gather_ms);
        opt.push_back(r.stats.optimizer_ms);
      }
      const double ms = Median(iter);
      if (stage == 0) stage0_ms = ms;
      int64_t state_bytes = 0;
      for (int k = 0; k < memory::kNumMemoryKinds; ++k) state_bytes += run->memory[0].allocated[k];
      results.push_back({
          {"world", world},
          {"stage", stage},
          {"params", examples::Mlp(base.shape).num_elements()},
          {"units", run->plan.units.size()},
          {"iteration_ms", ms},
          {"step_ms", Median(step)},
          {"reduce_ms", Median(reduce)},
          {"gather_ms", Median(gather)},
          {"optimizer_ms", Median(opt)},
          {"ratio_to_stage0", stage0_ms > 0 ? ms / stage0_ms : 0.0},
          {"allocated_bytes", state_bytes},
          {"comm_bytes_per_step", run->plan.comm_bytes_per_step},
          {"final_loss", run->steps.back().loss},
      });
    }
  }
  bench::PrintStepReport(
      {
          {"benchmark", "step_bench"},
          {"model", absl::StrCat("mlp ", base.shape.dims[0], "-", base.shape.dims[1], "-",
                                 base.shape.dims[2], "-", base.shape.dims[3])},
          {"precision", "bf16"},
          {"batch_per_rank", base.batch},
      },
      warmup, measured, "stage 0 at the same world size (ratio_to_stage0)", results);
  return 0;
}

}  // namespace
}  // namespace zerort

int main(int argc, char** argv) { return zerort::Main(argc, argv); }
