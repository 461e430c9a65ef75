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
// --model gpt: the same for the example GPT (examples/gpt, the demo's 0.83M-parameter model, 2
// sequences of 64 bytes per rank, default unit sizes). `forward_backward_ms` = iteration_ms -
// step_ms: the trainer's forward and backward, including the stage-3 Gathers and the gradient
// reductions that overlap backward (reduce_ms and gather_ms count those too).
//
// --link-bytes: no timings; the bytes rank 0 sends per step by link class (comm/link_bytes.h)
// at world 8 in-process ranks with 2 and 4 ranks per node, for flat stages 1-3, HSDP, MiCS's
// hierarchical gather and hpZ, against the plan's comm_bytes_intra/inter_node_per_step: engines
// for the --quick GPT's parameters driven in the standard order the plan assumes
// (zero/testing/link_bytes_check.h: TrainStandardOrder, the comparison the engine's
// //zero:engine_link_bytes_test makes too), counted over the measured steps after warm-up. The
// limit: measured == planned in each class, difference 0 (the control exchange and the stage-3
// gathers the slots make are in the plan). The GPT trainer itself holds units in its own order
// (the tied embedding twice in forward) and adds its loss all-reduce, so its bytes differ.
//
// Usage: step_bench [--quick] [--model mlp|gpt] [--repeat N] [--mpi] [--link-bytes]
//   --quick: a small model and a few steps, a few seconds for CI.
//   --repeat N: every stage N times in alternating order; `ratio_min`/`ratio_max` are the spread
//     of the ratio over the repetitions.
//   --mpi: under `mpirun -np W`, one rank per process over the MPI communicator, world W only
//     (the GPT only); rank 0 prints the report.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "benchmarks/bench_util.h"
#include "base/status.h"
#include "comm/inprocess.h"
#include "comm/link_bytes.h"
#include "comm/mpi.h"
#include "device/cpu_device.h"
#include "examples/gpt/gpt.h"
#include "examples/mlp/mlp.h"
#include "nlohmann/json.hpp"
#include "zero/config.h"
#include "zero/testing/link_bytes_check.h"

namespace zerort {
namespace {

using bench::Median;

// One (world, stage) run's per-step timings (after warm-up) and what the report prints beside.
struct CaseResult {
  std::vector<double> iter, step, reduce, gather, opt;
  int64_t params = 0, units = 0, allocated = 0, comm = 0;
  double final_loss = 0;
};

template <typename Result>
void Collect(const Result& run, int warmup, CaseResult* out) {
  for (size_t s = warmup; s < run.steps.size(); ++s) {
    out->iter.push_back(run.steps[s].ms);
    out->step.push_back(run.steps[s].stats.total_ms);
    out->reduce.push_back(run.steps[s].stats.reduce_ms);
    out->gather.push_back(run.steps[s].stats.gather_ms);
    out->opt.push_back(run.steps[s].stats.optimizer_ms);
  }
  out->allocated = 0;
  for (int k = 0; k < memory::kNumMemoryKinds; ++k) out->allocated += run.memory[0].allocated[k];
  out->units = static_cast<int64_t>(run.plan.units.size());
  out->comm = run.plan.comm_bytes_per_step;
  out->final_loss = run.steps.back().loss;
}

struct Setup {
  bool gpt = false;
  bool quick = false;
  int warmup = 3, measured = 12;
  examples::RunOptions mlp;
  examples::gpt::RunOptions gpt_options;
};

Setup MakeSetup(bool gpt, bool quick) {
  Setup s;
  s.gpt = gpt;
  s.quick = quick;
  s.warmup = quick ? 2 : 3;
  s.measured = quick ? (gpt ? 3 : 10) : (gpt ? 8 : 12);
  s.mlp.shape.dims = quick ? std::vector<int>{32, 128, 128, 32} : std::vector<int>{128, 512, 512, 128};
  s.mlp.batch = quick ? 8 : 16;
  s.mlp.steps = s.warmup + s.measured;
  s.mlp.device_threads = 1;
  // The demo's GPT (0.83M parameters), 2 sequences of 64 bytes per rank; --quick: 2 layers of 32.
  examples::gpt::RunOptions& g = s.gpt_options;
  if (quick) {
    g.shape.layers = 2;
    g.shape.d_model = 32;
    g.shape.context = 16;
  }
  g.batch = 2;
  g.steps = s.warmup + s.measured;
  g.eval_every = 0;
  g.eval_windows = 1;
  g.device_threads = 1;
  return s;
}

Config BenchConfig(const Setup& s, int stage) {
  const int64_t bucket = s.quick ? 4096 : 65536;
  // The MLP keeps its explicit small units (several buckets for a 5k-parameter model); the GPT
  // uses the defaults ("auto": units of its largest module, docs/config.md).
  const std::string sizes =
      s.gpt ? "" : absl::StrCat(R"(, "reduce_bucket_size": )", bucket,
                                R"(, "stage3_param_persistence_threshold": 0)");
  const std::string json = absl::StrCat(
      R"({"zero_optimization": {"stage": )", stage, sizes, R"(}, "bf16": {"enabled": true},)",
      R"( "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}})");
  return ParseConfig(json, "step_bench").value();  // a constant text: parses
}

// One run of `stage` at `world`, appended to `out`. With `mpi`, this process is one rank of
// the job (the GPT over the MPI communicator); otherwise `world` in-process ranks.
absl::Status RunCase(const Setup& s, int world, int stage, comm::Communicator* mpi,
                     CaseResult* out) {
  const Config config = BenchConfig(s, stage);
  if (s.gpt) {
    examples::gpt::RunOptions options = s.gpt_options;
    options.world_size = world;
    ASSIGN_OR_RETURN(examples::gpt::RunResult run,
                     mpi != nullptr ? examples::gpt::RunOnCommunicator(config, options, mpi)
                                    : examples::gpt::RunInProcess(config, options));
    Collect(run, s.warmup, out);
    out->params = examples::gpt::Gpt(options.shape).num_elements();
  } else {
    examples::RunOptions options = s.mlp;
    options.world_size = world;
    ASSIGN_OR_RETURN(examples::RunResult run, examples::RunInProcess(config, options));
    Collect(run, s.warmup, out);
    out->params = examples::Mlp(options.shape).num_elements();
  }
  return absl::OkStatus();
}

std::string ModelName(const Setup& s) {
  if (s.gpt) {
    const examples::gpt::GptShape& g = s.gpt_options.shape;
    return absl::StrCat("gpt ", g.layers, " layers, d_model ", g.d_model, ", context ", g.context);
  }
  const std::vector<int>& d = s.mlp.shape.dims;
  return absl::StrCat("mlp ", d[0], "-", d[1], "-", d[2], "-", d[3]);
}

struct Flags {
  bool quick = false, gpt = false, mpi = false, link_bytes = false;
  int repeat = 1;
};

bool ParseFlags(int argc, char** argv, Flags* f) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const std::string next = i + 1 < argc ? argv[i + 1] : "";
    if (a == "--quick") {
      f->quick = true;
    } else if (a == "--mpi") {
      f->mpi = true;
    } else if (a == "--link-bytes") {
      f->link_bytes = true;
    } else if (a == "--model" && (next == "gpt" || next == "mlp")) {
      f->gpt = next == "gpt";
      ++i;
    } else if (a == "--repeat" && !next.empty() && next.size() < 4 &&
               next.find_first_not_of("0123456789") == std::string::npos && std::stoi(next) >= 1) {
      f->repeat = std::stoi(next);
      ++i;
    } else {
      return false;
    }
  }
  return !f->mpi || f->gpt;  // one rank per process: the GPT's RunOnCommunicator
}

// Every stage at one world size, `repeat` times, in alternating order (0-3, then 3-0, ...) so
// that a slow spell of the machine does not fall on one stage only. Medians pool every
// repetition's steps; the ratio's spread is over the repetitions' own medians.
absl::Status MeasureWorld(const Setup& setup, int world, int repeat, comm::Communicator* mpi,
                          nlohmann::ordered_json* results) {
  CaseResult pooled[4];
  std::vector<double> rep_ms[4];
  for (int rep = 0; rep < repeat; ++rep) {
    for (int k = 0; k < 4; ++k) {
      const int stage = rep % 2 == 0 ? k : 3 - k;
      CaseResult r;
      RETURN_IF_ERROR(Annotate(RunCase(setup, world, stage, mpi, &r),
                               absl::StrCat("world ", world, " stage ", stage)));
      rep_ms[stage].push_back(Median(r.iter));
      CaseResult& p = pooled[stage];
      for (auto [from, to] : {std::pair{&r.iter, &p.iter}, {&r.step, &p.step},
                              {&r.reduce, &p.reduce}, {&r.gather, &p.gather}, {&r.opt, &p.opt}}) {
        to->insert(to->end(), from->begin(), from->end());
      }
      p.params = r.params, p.units = r.units, p.allocated = r.allocated, p.comm = r.comm;
      p.final_loss = r.final_loss;
    }
  }
  const double stage0_ms = Median(pooled[0].iter);
  for (int stage = 0; stage <= 3; ++stage) {
    const CaseResult& r = pooled[stage];
    std::vector<double> ratios;
    for (int rep = 0; rep < repeat; ++rep) ratios.push_back(rep_ms[stage][rep] / rep_ms[0][rep]);
    const double ms = Median(r.iter);
    results->push_back({
        {"world", world},
        {"stage", stage},
        {"params", r.params},
        {"units", r.units},
        {"iteration_ms", ms},
        {"forward_backward_ms", ms - Median(r.step)},
        {"step_ms", Median(r.step)},
        {"reduce_ms", Median(r.reduce)},
        {"gather_ms", Median(r.gather)},
        {"optimizer_ms", Median(r.opt)},
        {"ratio_to_stage0", stage0_ms > 0 ? ms / stage0_ms : 0.0},
        {"ratio_min", *std::min_element(ratios.begin(), ratios.end())},
        {"ratio_max", *std::max_element(ratios.begin(), ratios.end())},
        {"allocated_bytes", r.allocated},
        {"comm_bytes_per_step", r.comm},
        {"final_loss", r.final_loss},
    });
  }
  return absl::OkStatus();
}

// A layout measured by --link-bytes: its zero_optimization keys over the stage's config.
struct LinkLayout {
  const char* name;
  int stage;
  int mics;  // mics_shard_size; -1 flat
  bool hierarchical;
  int hpz;
};

// Rank 0's bytes per step and plan at world 8: engines for the quick GPT's parameters, driven
// in the standard order (zero/testing/link_bytes_check.h), `warmup` steps and then `measured`.
absl::StatusOr<std::pair<memory::Plan, testing::LinkBytesComparison>> CountSteps(
    const Setup& s, const Config& config, int per_node) {
  constexpr int kWorld = 8;
  CpuDeviceOptions d;
  d.threads = 1;
  const std::unique_ptr<Device> device = CreateCpuDevice(d);
  const examples::gpt::Gpt gpt(s.gpt_options.shape);
  ASSIGN_OR_RETURN(
      std::vector<testing::RankLinkBytes> ranks,
      testing::MeasureLinkBytes(
          kWorld, per_node,
          [&](comm::Communicator* comm, comm::LinkByteLog* log) -> absl::StatusOr<memory::Plan> {
            ASSIGN_OR_RETURN(std::unique_ptr<Engine> e,
                             Engine::Create(config, gpt.ParamSpecs(), comm, device.get()));
            RETURN_IF_ERROR(e->InitParams(gpt.Initializer()));
            RETURN_IF_ERROR(testing::TrainStandardOrder(*e, s.warmup));
            log->Clear();
            RETURN_IF_ERROR(testing::TrainStandardOrder(*e, s.measured));
            return e->plan();
          }));
  const testing::LinkBytesComparison cmp =
      testing::CompareWithPlan(ranks[0].plan, ranks[0].sent, s.measured);
  return std::make_pair(std::move(ranks[0].plan), cmp);
}

absl::Status MeasureLinkBytes(const Setup& s, nlohmann::ordered_json* results) {
  const LinkLayout layouts[] = {
      {"flat", 1, -1, false, 1},
      {"flat", 2, -1, false, 1},
      {"flat", 3, -1, false, 1},
      {"HSDP mics_shard_size 4", 3, 4, false, 1},
      {"HSDP mics_shard_size 2", 3, 2, false, 1},
      {"MiCS 4, hierarchical gather", 3, 4, true, 1},
      {"MiCS 8, hierarchical gather", 3, 8, true, 1},
      {"hpZ 2", 3, -1, false, 2},
      {"hpZ 4", 3, -1, false, 4},
  };
  for (int per_node : {2, 4}) {
    for (const LinkLayout& l : layouts) {
      if (l.hierarchical && l.mics <= per_node) continue;  // needs groups spanning nodes
      Config c = BenchConfig(s, l.stage);
      c.zero.mics_shard_size = l.mics;
      c.zero.mics_hierarchical_params_gather = l.hierarchical;
      c.zero.zero_hpz_partition_size = l.hpz;
      c.ranks_per_node = per_node;
      const std::string what =
          absl::StrCat(l.name, ", stage ", l.stage, ", ", per_node, " ranks per node");
      const absl::StatusOr<std::pair<memory::Plan, testing::LinkBytesComparison>> counted =
          CountSteps(s, c, per_node);
      if (!counted.ok()) return Annotate(counted.status(), what);
      const auto& [plan, cmp] = *counted;
      results->push_back({
          {"layout", l.name},
          {"stage", l.stage},
          {"ranks_per_node", per_node},
          {"units", plan.units.size()},
          {"gather_slots", plan.gather_slots},
          {"stage3_gathers_per_step", plan.stage3_gathers_per_step},
          {"measured_intra_node_bytes", cmp.measured.intra_node},
          {"planned_intra_node_bytes", cmp.planned.intra_node},
          {"measured_inter_node_bytes", cmp.measured.inter_node},
          {"planned_inter_node_bytes", cmp.planned.inter_node},
          {"planned_control_bytes", cmp.planned_control},
          {"difference_intra_node_bytes", cmp.measured.intra_node - cmp.planned.intra_node},
          {"difference_inter_node_bytes", cmp.measured.inter_node - cmp.planned.inter_node},
          {"equal", cmp.equal()},
      });
    }
  }
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  Flags flags;
  if (!ParseFlags(argc, argv, &flags)) {
    std::fprintf(stderr,
                 "usage: step_bench [--quick] [--model mlp|gpt] [--repeat N] [--mpi]"
                 " [--link-bytes]\n"
                 "  --mpi (under mpirun, one rank per process) needs --model gpt\n");
    return 2;
  }
  if (flags.link_bytes) {
    // Bytes do not depend on the model's speed: the quick GPT, whatever --quick says.
    const Setup setup = MakeSetup(/*gpt=*/true, /*quick=*/true);
    nlohmann::ordered_json results = nlohmann::ordered_json::array();
    const absl::Status st = MeasureLinkBytes(setup, &results);
    if (!st.ok()) {
      std::fprintf(stderr, "step_bench --link-bytes: %s\n", st.ToString().c_str());
      return 1;
    }
    const nlohmann::ordered_json head = {
        {"benchmark", "step_bench --link-bytes"},
        {"model", ModelName(setup)},
        {"precision", "bf16"},
        {"world", 8},
        {"ranks", "in-process threads, rank 0 counted"},
        {"bytes", "sent per optimizer step, the plan's convention (comm/link_bytes.h)"},
        {"limit", "measured == planned per class (difference 0; the plan counts the control "
                  "exchange and the slots' stage-3 gathers in the standard order)"},
        {"warmup_steps", setup.warmup},
        {"measured_steps", setup.measured},
        {"results", results},
    };
    std::printf("%s\n", head.dump(2).c_str());
    return 0;
  }
  comm::MpiJob job;
  std::vector<int> worlds = {1, 2, 4};
  if (flags.mpi) {
    absl::StatusOr<comm::MpiJob> started = comm::StartMpiJob(&argc, &argv);
    if (!started.ok()) {
      std::fprintf(stderr, "step_bench --mpi: %s\n", started.status().ToString().c_str());
      return 1;
    }
    job = std::move(*started);
    worlds = {job.comm->size()};
  }
  comm::Communicator* const mpi = job.comm.get();
  const Setup setup = MakeSetup(flags.gpt, flags.quick);
  nlohmann::ordered_json results = nlohmann::ordered_json::array();
  for (int world : worlds) {
    const absl::Status st = MeasureWorld(setup, world, flags.repeat, mpi, &results);
    if (!st.ok()) {
      std::fprintf(stderr, "step_bench: %s\n", st.ToString().c_str());
      return 1;
    }
  }
  if (mpi != nullptr && mpi->rank() != 0) return 0;
  bench::PrintStepReport(
      {
          {"benchmark", "step_bench"},
          {"model", ModelName(setup)},
          {"precision", "bf16"},
          {"ranks", flags.mpi ? "processes under mpirun (MPI communicator)" : "in-process threads"},
          {"repetitions", flags.repeat},
          {"batch_per_rank", flags.gpt ? setup.gpt_options.batch : setup.mlp.batch},
      },
      setup.warmup, setup.measured, "stage 0 at the same world size (ratio_to_stage0)", results);
  return 0;
}

}  // namespace
}  // namespace zerort

int main(int argc, char** argv) { return zerort::Main(argc, argv); }
