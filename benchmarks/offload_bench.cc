// The offload pipeline's overlap: Step() time of an optimizer-offloaded stage-2 engine with its
// copies run inline (the serial pipeline: download, update, upload, all-gather, one unit after
// the other) against the same engine with the device's streams on threads and buffer_count
// staging chunks in flight, measured side by side in one process.
//
// Two kinds of copies:
//   memcpy  the CPU device's copies as they are: host memory to host memory, competing with
//           the host AdamW for the same memory bandwidth, so little can be gained;
//   link    every copy on a stream also lasts bytes / --link_gbps (default 4 GB/s), the issuing
//           thread sleeping as it would while a GPU's DMA engine moved the bytes over PCIe
//           (CreateCpuDevice's copy_link_gbps). 4 GB/s against this machine's one-thread
//           AdamW (~7e8 params/s, 4 bytes copied per parameter) makes the copies ~0.7 of the
//           AdamW time; a server's AdamW (~200 GB/s of host bandwidth, 28 bytes per parameter)
//           against PCIe 5 (~50 GB/s) gives ~0.55. Here the schedule's overlap shows:
//           hidden_fraction = (inline step - step) / modelled copy time per step.
//
// Per case: medians over the measured steps of Step() (`step_ms`), of its optimizer part
// (`optimizer_ms`: downloads, AdamW, uploads) and of the host's time blocked on copies
// (`wait_ms`); `ratio_to_inline` = step_ms / the first inline case's step_ms at the same world
// and copy kind. The inline case runs again last: its ratio shows how far the machine drifted.
//
// Usage: offload_bench [--quick] [--link_gbps=G]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "benchmarks/bench_util.h"
#include "base/dtype.h"
#include "base/status.h"
#include "comm/inprocess.h"
#include "nlohmann/json.hpp"
#include "zero/config.h"
#include "device/cpu_device.h"
#include "zero/engine.h"
#include "zero/model_spec.h"

namespace zerort {
namespace {

using bench::Median;

struct Case {
  bool threads;      // the device's streams on threads (else inline)
  int buffer_count;  // staging chunks
};

struct Measured {
  double step_ms = 0, optimizer_ms = 0, wait_ms = 0, gather_ms = 0;
};

absl::StatusOr<Measured> Run(const std::vector<memory::ParamSpec>& specs, int world,
                             const Case& c, double link_gbps, int warmup, int measured,
                             int64_t unit_elements) {
  const std::string json = absl::StrCat(
      R"({"zero_optimization": {"stage": 2, "reduce_bucket_size": )", unit_elements,
      R"(, "offload_optimizer": {"device": "cpu", "buffer_count": )", c.buffer_count,
      R"(}}, "bf16": {"enabled": true}, "cpu_threads": 1,)",
      R"( "optimizer": {"type": "AdamW", "params": {"lr": 0.001}}})");
  ASSIGN_OR_RETURN(Config config, ParseConfig(json, "offload_bench"));
  ASSIGN_OR_RETURN(auto comms, comm::CreateInProcessGroup(world));
  CpuDeviceOptions device_options;
  device_options.threads = 1;
  device_options.async_streams = c.threads;
  device_options.copy_link_gbps = link_gbps;
  std::unique_ptr<Device> device = CreateCpuDevice(device_options);
  std::vector<absl::Status> errors(world);
  std::vector<std::vector<StepStats>> stats(world);
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.emplace_back([&, r] {
      errors[r] = [&]() -> absl::Status {
        ASSIGN_OR_RETURN(std::unique_ptr<Engine> e,
                         Engine::Create(config, specs, comms[r].get(), device.get()));
        RETURN_IF_ERROR(e->InitParams(
            [](int i, const memory::ParamSpec&, float* v) { v[0] = 0.01f * (i + 1); }, true));
        const uint16_t g = FloatToBf16(1e-3f * (r + 1));
        for (int step = 0; step < warmup + measured; ++step) {
          for (const memory::Unit& unit : e->plan().units) {
            for (int i : unit.params) {
              ASSIGN_OR_RETURN(void* p, e->grad(i));
              uint16_t* gp = static_cast<uint16_t*>(p);
              std::fill(gp, gp + e->plan().params[i].numel, g);
              RETURN_IF_ERROR(e->GradReady(i));
            }
          }
          ASSIGN_OR_RETURN(StepStats s, e->Step());
          if (step >= warmup) stats[r].push_back(s);
        }
        return absl::OkStatus();
      }();
    });
  }
  for (std::thread& t : ranks) t.join();
  for (int r = 0; r < world; ++r) {
    if (!errors[r].ok()) return errors[r];
  }
  std::vector<double> step, opt, wait, gather;
  for (const StepStats& s : stats[0]) {
    step.push_back(s.total_ms);
    opt.push_back(s.optimizer_ms);
    wait.push_back(s.offload_wait_ms);
    gather.push_back(s.gather_ms);
  }
  return Measured{Median(step), Median(opt), Median(wait), Median(gather)};
}

int Main(int argc, char** argv) {
  bool quick = false;
  double link_gbps = 4;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--quick") {
      quick = true;
    } else if (arg.rfind("--link_gbps=", 0) == 0 && std::atof(arg.c_str() + 12) > 0) {
      link_gbps = std::atof(arg.c_str() + 12);
    } else {
      std::fprintf(stderr, "usage: offload_bench [--quick] [--link_gbps=G]  (G > 0)\n");
      return 2;
    }
  }
  const int64_t params = quick ? (int64_t{1} << 20) : (int64_t{1} << 24);
  const int layers = quick ? 8 : 16;
  const int warmup = 2;
  const int measured = quick ? 3 : 7;
  absl::StatusOr<std::vector<memory::ParamSpec>> specs = SyntheticModel(params, layers);
  if (!specs.ok()) {
    std::fprintf(stderr, "offload_bench: %s\n", std::string(specs.status().message()).c_str());
    return 1;
  }
  const int64_t unit_elements = params / layers;
  const Case cases[] = {{false, 4}, {true, 1}, {true, 2}, {true, 4}, {false, 4}};
  nlohmann::ordered_json results = nlohmann::ordered_json::array();
  for (double link : {0.0, link_gbps}) {
    for (int world : {1, 2}) {
      // Per step each rank downloads its bf16 gradient shard and uploads its bf16 parameters.
      const double copy_ms = link > 0 ? 2.0 * 2 * (params / world) / (link * 1e9) * 1e3 : 0;
      double inline_ms = 0;
      for (const Case& c : cases) {
        absl::StatusOr<Measured> m =
            Run(*specs, world, c, link, warmup, measured, unit_elements);
        if (!m.ok()) {
          std::fprintf(stderr, "offload_bench: world %d: %s\n", world,
                       std::string(m.status().message()).c_str());
          return 1;
        }
        if (!c.threads && inline_ms == 0) inline_ms = m->step_ms;
        nlohmann::ordered_json r = {
            {"copies", link > 0 ? "link" : "memcpy"},
            {"world", world},
            {"streams", c.threads ? "threads" : "inline"},
            {"buffer_count", c.buffer_count},
            {"step_ms", m->step_ms},
            {"optimizer_ms", m->optimizer_ms},
            {"gather_ms", m->gather_ms},
            {"wait_ms", m->wait_ms},
            {"ratio_to_inline", inline_ms > 0 ? m->step_ms / inline_ms : 0.0},
        };
        if (link > 0) {
          r["link_gbps"] = link;
          r["modelled_copy_ms"] = copy_ms;
          r["hidden_fraction"] = (inline_ms - m->step_ms) / copy_ms;
        }
        results.push_back(r);
      }
    }
  }
  bench::PrintStepReport(
      {
          {"benchmark", "offload_bench"},
          {"model", absl::StrCat("synthetic ", params, " params, ", layers, " layers")},
          {"stage", 2},
          {"precision", "bf16"},
          {"cpu_threads", 1},
      },
      warmup, measured, "inline copies (serial pipeline) at the same world (ratio_to_inline)",
      results);
  return 0;
}

}  // namespace
}  // namespace zerort

int main(int argc, char** argv) { return zerort::Main(argc, argv); }
