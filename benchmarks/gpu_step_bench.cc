// The engine's optimizer step on one GPU (the CUDA device, NCCL at world 1), with no model
// compute, against the bandwidth floor of the bytes that step must move, measured in the same run.
//
// Shapes: the parameter lists of examples/gpt (Gpt::ParamSpecs, tied embedding) for GPT-2 124M
// (12 layers, d_model 768, vocab 50257, context 1024) and a 1.3B GPT (24 layers, d_model 2048,
// vocab 50257, context 2048); --quick: a tiny GPT (2 layers, d_model 64, vocab 256, context 64).
// Configs per shape: bf16 compute, stages 0-3, each without offload and with
// zero_optimization.offload_optimizer.device = "cpu"; every other key at its default. The engine
// refuses stage 0 with offload (the offloaded state is the sharded one): that row says so in
// "not_run".
//
// Gradients: one device buffer per parameter, filled once (a device cast of a host fp32 pattern
// to bf16) and handed to the engine with SetGradBuffer, so each step only marks every parameter
// ready (GradReady) and calls Step(). Where a parameter does not fill its unit alone, GradReady
// copies the buffer into the engine's gradient slot (`grad_buffers_direct` counts the others):
// that copy is the engine's work and counts in the step time. (engine.grad(i) cannot be written
// once: the engine zero-fills it for every window.)
// --grads engine: no hand-off; each step writes every gradient into engine.grad(i) as a
// trainer's backward does (a device copy from the same buffers, unit by unit, just before that
// unit's GradReady), so the step has no hand-off copies and the engine's zero-fill shows. The
// trainer's copies are inside the timed step; `trainer_fill_ms` (the same copies alone, timed by
// events on the stream before the steps) is reported so that step_ms_median - trainer_fill_ms is
// the engine's share.
//
// Per config: 3 warm-up steps, then 10 timed steps (--quick: 1 and 5):
//   step_ms_median, step_ms_min  host clock around GradReady of every parameter + Step() +
//                                cudaDeviceSynchronize
//   event_ms_median, event_ms_min  CUDA events recorded on the engine's compute stream (the
//                                EngineOptions::compute_stream this benchmark creates) before the
//                                first GradReady and after Step() returns
//   stats                        medians of the engine's StepStats host timings (reduce, optimizer,
//                                gather, offload_wait, total), and its comm_bytes, grad_norm
//   device_times                 medians of Engine::DeviceTimes (EngineOptions::device_timing:
//                                timing events on the engine's streams): norm_ms, update_ms,
//                                gather_ms, total_ms of the optimizer step on the GPU's clock
//   create_s, init_s             Engine::Create and InitParams (all parameters zero: cheap)
//   host                         the calling thread's work on the step's path: cpu_ms_median,
//                                its CPU time (CLOCK_THREAD_CPUTIME_ID) from the first GradReady
//                                to Step()'s return; return_ms_median, the wall time of the same
//                                span; cpu_us_per_unit = cpu_ms_median / units (the goal: 10 us).
//                                CUDA's default sync spins, so a host wait inside the step
//                                (the norm's result, an offload pipeline) counts as CPU time:
//                                --blocking-sync (cudaDeviceScheduleBlockingSync, set before the
//                                device is created) makes the waits sleep and leaves the work.
//
// The floor: bytes the step's kernels must read + write, over the bandwidth they are limited by.
// E = plan().trainable_padded_elements (at world 1 this rank owns all of it in every stage).
//   without offload (every kernel on the GPU; bf16 gradients and parameters, fp32 master, m, v):
//     finite check reads the gradients        2 B/elem
//     norm reads the gradients                2 B/elem
//     AdamW reads the gradient                2 B/elem
//           reads + writes master, m, v      24 B/elem
//           writes the bf16 parameter         2 B/elem
//     floor_ms = 32 E / d2d_copy_GBps   (d2d_copy_GBps counts a copy's bytes read + written,
//                                        as cuda_bench does)
//     At world 1 the reduce-scatter, all-reduce and all-gather move nothing between GPUs; what
//     NCCL or the engine still copies (gradient copies into slots, zero-filling the gradients
//     for the next window, in-place collectives that are not free) is above the floor.
//   with optimizer offload to the CPU:
//     floor_ms = 2 E / d2h_GBps (bf16 gradients down) + 2 E / h2d_GBps (bf16 parameters up),
//     from a bare pinned cudaMemcpyAsync each way. The host AdamW is on the CPU, not a GPU
//     floor: host_adamw_floor_ms = 28 E / host_copy_GBps (gradient 2, master/m/v 24, parameter
//     2 B/elem) from a multi-threaded memcpy of pageable memory, reported apart;
//     bound_ms = max(floor_ms, host_adamw_floor_ms) (the pipeline overlaps transfers and host
//     AdamW), ratio_to_bound = step_ms_median / bound_ms.
//   ratio_to_floor = step_ms_median / floor_ms in both cases.
//
// Time: the default run must end within the bundle's 120 s. Each config's cost is predicted from
// the seconds per element of the last finished config with the same offload setting; a config
// that would end past --budget-s (default 85 s from start) is not run and is listed with
// "not_run": "<reason>" (never the key "skipped", which tools/gpu_bundle/run.sh reads as "no
// GPU"). A config whose steps pass the budget by 15 s stops and is listed the same way.
//
// Prints one JSON document on stdout and a line per config on stderr. Without a GPU it prints
// {"benchmark": "gpu_step_bench", "skipped": "<reason>"} and exits 0. Exits 1 after the JSON
// when a config failed (its row has "error").
//
// Usage: gpu_step_bench [--quick] [--shape small|1.3b|all] [--budget-s S]
//                       [--grads handoff|engine] [--offload none|cpu|both] [--blocking-sync]
//   default: --shape all (124M, then 1.3B while the budget lasts), --budget-s 85,
//   --grads handoff, --offload both, CUDA's default (spinning) host sync.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/dtype.h"
#include "base/status.h"
#include "benchmarks/bench_util.h"
#include "benchmarks/cuda_timing.h"
#include "comm/nccl.h"
#include "device/cuda_device.h"
#include "device/device.h"
#include "examples/gpt/gpt.h"
#include "memory/arena.h"
#include "nlohmann/json.hpp"
#include "zero/config.h"
#include "zero/engine.h"

namespace zerort {
namespace {

using json = nlohmann::ordered_json;
using bench::CheckCuda;
using bench::EventTimes;
using bench::Median;
using bench::SecondsSince;
using bench::ThreadCpuMs;
using Clock = std::chrono::steady_clock;

constexpr double kDeviceBytesPerElement = 32;    // finite 2 + norm 2 + AdamW 28
constexpr double kTransferBytesEachWay = 2;      // bf16 gradients down, bf16 parameters up
constexpr double kHostAdamWBytesPerElement = 28;  // gradient 2 + master/m/v 24 + parameter 2
constexpr double kOverrunS = 15;                 // a running config stops this far past budget

struct Options {
  bool quick = false;
  std::vector<std::string> shapes = {"small", "1.3b"};
  double budget_s = 85;
  bool grads_into_engine = false;  // --grads engine
  int offload_from = 0, offload_to = 1;  // --offload: none [0, 0], cpu [1, 1], both [0, 1]
  bool blocking_sync = false;            // --blocking-sync
};

bool ParseArgs(int argc, char** argv, Options* opt) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const std::string next = i + 1 < argc ? argv[i + 1] : "";
    if (a == "--quick") {
      opt->quick = true;
    } else if (a == "--shape" && (next == "small" || next == "1.3b" || next == "all")) {
      opt->shapes = next == "all" ? std::vector<std::string>{"small", "1.3b"}
                                  : std::vector<std::string>{next};
      ++i;
    } else if (a == "--grads" && (next == "handoff" || next == "engine")) {
      opt->grads_into_engine = next == "engine";
      ++i;
    } else if (a == "--offload" && (next == "none" || next == "cpu" || next == "both")) {
      opt->offload_from = next == "cpu" ? 1 : 0;
      opt->offload_to = next == "none" ? 0 : 1;
      ++i;
    } else if (a == "--blocking-sync") {
      opt->blocking_sync = true;
    } else if (a == "--budget-s" && !next.empty()) {
      char* end = nullptr;
      opt->budget_s = std::strtod(next.c_str(), &end);
      if (*end != '\0' || !(opt->budget_s > 0)) return false;
      ++i;
    } else {
      return false;
    }
  }
  return true;
}



examples::gpt::GptShape ShapeOf(const std::string& name) {
  examples::gpt::GptShape s;
  if (name == "small") return examples::gpt::GptShape::Gpt2Small();
  if (name == "1.3b") {
    s.vocab = 50257;
    s.context = 2048;
    s.layers = 24;
    s.heads = 16;
    s.d_model = 2048;
    return s;
  }
  // "tiny" (--quick)
  s.vocab = 256;
  s.context = 64;
  s.layers = 2;
  s.heads = 2;
  s.d_model = 64;
  return s;
}


// The limits the floors are computed from, in GB/s (1e9 bytes).
struct Limits {
  double d2d = 0;   // device-to-device copy, bytes read + written
  double h2d = 0;   // pinned host to device, bytes moved
  double d2h = 0;   // device to pinned host, bytes moved
  double host = 0;  // host memcpy on every core, bytes read + written
};

double HostCopyGBps(size_t bytes) {
  std::vector<char> src(bytes, 1), dst(bytes, 0);  // touched: no page faults in the timing
  const int threads = std::max(1u, std::thread::hardware_concurrency());
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const Clock::time_point t0 = Clock::now();
    std::vector<std::thread> pool;
    const size_t per = bytes / threads;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        const size_t n = t + 1 == threads ? bytes - t * per : per;
        std::memcpy(dst.data() + t * per, src.data() + t * per, n);
      });
    }
    for (std::thread& th : pool) th.join();
    best = std::max(best, 2.0 * bytes / SecondsSince(t0) / 1e9);
  }
  return best;
}

Limits MeasureLimits(bool quick) {
  Limits l;
  const size_t d2d_bytes = quick ? (size_t{64} << 20) : (size_t{1} << 30);
  const size_t xfer_bytes = quick ? (size_t{16} << 20) : (size_t{256} << 20);
  void *a = nullptr, *b = nullptr, *host = nullptr;
  CheckCuda(cudaMalloc(&a, d2d_bytes), "cudaMalloc");
  CheckCuda(cudaMalloc(&b, d2d_bytes), "cudaMalloc");
  CheckCuda(cudaMemset(a, 0, d2d_bytes), "cudaMemset");
  l.d2d = 2.0 * d2d_bytes / Median(EventTimes(10, [&] {
            CheckCuda(cudaMemcpyAsync(b, a, d2d_bytes, cudaMemcpyDeviceToDevice, nullptr),
                      "cudaMemcpyAsync d2d");
          })) / 1e9;
  CheckCuda(cudaMallocHost(&host, xfer_bytes), "cudaMallocHost");
  std::memset(host, 0, xfer_bytes);
  l.h2d = xfer_bytes / Median(EventTimes(5, [&] {
            CheckCuda(cudaMemcpyAsync(a, host, xfer_bytes, cudaMemcpyHostToDevice, nullptr),
                      "cudaMemcpyAsync h2d");
          })) / 1e9;
  l.d2h = xfer_bytes / Median(EventTimes(5, [&] {
            CheckCuda(cudaMemcpyAsync(host, a, xfer_bytes, cudaMemcpyDeviceToHost, nullptr),
                      "cudaMemcpyAsync d2h");
          })) / 1e9;
  CheckCuda(cudaFreeHost(host), "cudaFreeHost");
  CheckCuda(cudaFree(a), "cudaFree");
  CheckCuda(cudaFree(b), "cudaFree");
  l.host = HostCopyGBps(quick ? (size_t{32} << 20) : (size_t{512} << 20));
  return l;
}

Config MakeConfig(int stage, bool offload) {
  const std::string json_text = absl::StrCat(
      R"({"zero_optimization": {"stage": )", stage,
      offload ? R"(, "offload_optimizer": {"device": "cpu"})" : "",
      R"(}, "bf16": {"enabled": true},)",
      R"( "optimizer": {"type": "AdamW", "params": {"lr": 0.0001, "weight_decay": 0.01}}})");
  return ParseConfig(json_text, "gpu_step_bench").value();  // a constant text: parses
}

// Fills the per-parameter gradient buffers (bf16, at `offsets` in `grads`) once: a host fp32
// pattern of small, varied, finite values, cast on the device.
absl::Status FillGradients(Device* dev, Device::Stream stream, char* grads, size_t elements) {
  constexpr size_t kChunk = size_t{1} << 20;
  std::vector<float> pattern(kChunk);
  for (size_t k = 0; k < kChunk; ++k) {
    pattern[k] = (static_cast<float>((k * 2654435761u) % 2001) - 1000.0f) * 1e-6f;
  }
  auto chunk = memory::Allocation::Create(dev->allocator(memory::MemoryKind::kDevice),
                                          kChunk * sizeof(float));
  if (!chunk.ok()) return chunk.status();
  RETURN_IF_ERROR(dev->Copy(chunk->get(), pattern.data(), kChunk * sizeof(float), stream));
  for (size_t off = 0; off < elements; off += kChunk) {
    const size_t n = std::min(kChunk, elements - off);
    RETURN_IF_ERROR(dev->Cast(chunk->get(), DType::kF32, grads + 2 * off, DType::kBF16, n, stream));
  }
  return dev->Synchronize(stream);  // `pattern` and `chunk` go out of scope
}

// What a config's steps measured.
struct Timings {
  std::vector<double> wall_ms, event_ms, reduce, optimizer, gather, offload_wait, total;
  // Engine::DeviceTimes: the step's phases on the GPU's clock.
  std::vector<double> dev_norm, dev_update, dev_gather, dev_total;
  // The calling thread from the first GradReady to Step()'s return: CPU time and wall time.
  std::vector<double> host_cpu, host_return;
  StepStats last;
  int overflow_steps = 0;  // steps the engine dropped for an Inf/NaN (none expected)
};

class ConfigRun {
 public:
  ConfigRun(Device* dev, comm::Communicator* comm, Device::Stream stream, const Limits& limits,
            bool grads_into_engine)
      : dev_(dev),
        comm_(comm),
        stream_(stream),
        limits_(limits),
        grads_into_engine_(grads_into_engine) {}

  // Runs one config into `row`; `deadline_s` (seconds since `start`) stops the timed steps.
  absl::Status Run(const std::vector<memory::ParamSpec>& specs, int stage, bool offload,
                   int warmup, int measured, Clock::time_point start, double deadline_s,
                   json* row) {
    // One bf16 buffer per parameter, 256-byte aligned, filled once. Allocated before the engine
    // so that the engine, which reads them, is destroyed first.
    std::vector<size_t> offsets;
    size_t elements = 0;
    for (const memory::ParamSpec& s : specs) {
      offsets.push_back(elements);
      elements += (static_cast<size_t>(s.numel()) + 127) / 128 * 128;
    }
    ASSIGN_OR_RETURN(memory::Allocation grads,
                     memory::Allocation::Create(dev_->allocator(memory::MemoryKind::kDevice),
                                                2 * elements));
    char* const g = grads.as<char>();
    RETURN_IF_ERROR(FillGradients(dev_, stream_, g, elements));

    Clock::time_point t = Clock::now();
    EngineOptions options;
    options.compute_stream = stream_;
    options.device_timing = true;
    absl::StatusOr<std::unique_ptr<Engine>> created =
        Engine::Create(MakeConfig(stage, offload), specs, comm_, dev_, options);
    if (absl::IsInvalidArgument(created.status())) {
      // A config the engine refuses (stage 0 with optimizer offload: "offload_optimizer
      // requires stage 1, 2 or 3") is listed, not a failure of the run.
      (*row)["not_run"] = absl::StrCat("Engine::Create refuses it: ", created.status().message());
      return absl::OkStatus();
    }
    if (!created.ok()) return created.status();
    std::unique_ptr<Engine> engine = *std::move(created);
    (*row)["create_s"] = SecondsSince(t);
    t = Clock::now();
    RETURN_IF_ERROR(engine->InitParams(
        // The engine hands out zero-filled values: zeros are cheap and finite.
        [](int, const memory::ParamSpec&, float*) {},
        /*from_rank0=*/true));
    (*row)["init_s"] = SecondsSince(t);

    int direct = 0;
    if (!grads_into_engine_) {
      for (int i = 0; i < engine->num_params(); ++i) {
        ASSIGN_OR_RETURN(bool d, engine->SetGradBuffer(i, g + 2 * offsets[i]));
        direct += d;
      }
    }
    // Writes parameter i's gradient where the engine wants it (--grads engine) and marks it.
    auto grad_ready = [&](int i) -> absl::Status {
      if (grads_into_engine_) {
        ASSIGN_OR_RETURN(void* dst, engine->grad(i));
        RETURN_IF_ERROR(dev_->Copy(dst, g + 2 * offsets[i], 2 * specs[i].numel(), stream_));
      }
      return engine->GradReady(i);
    };

    const int64_t e = engine->plan().trainable_padded_elements;
    (*row)["padded_elements"] = e;
    (*row)["units"] = engine->num_units();
    (*row)["grad_buffers_direct"] = direct;

    cudaEvent_t ev_start, ev_stop;
    CheckCuda(cudaEventCreate(&ev_start), "cudaEventCreate");
    CheckCuda(cudaEventCreate(&ev_stop), "cudaEventCreate");
    if (grads_into_engine_) {
      // The trainer's share of a step: the same copies, into one scratch buffer.
      int64_t largest = 0;
      for (const memory::ParamSpec& sp : specs) largest = std::max(largest, sp.numel());
      ASSIGN_OR_RETURN(memory::Allocation scratch,
                       memory::Allocation::Create(dev_->allocator(memory::MemoryKind::kDevice),
                                                  2 * largest));
      const cudaStream_t cs = static_cast<cudaStream_t>(stream_);
      std::vector<double> fill_ms;
      for (int rep = 0; rep < 3; ++rep) {
        CheckCuda(cudaEventRecord(ev_start, cs), "cudaEventRecord");
        for (size_t i = 0; i < specs.size(); ++i) {
          RETURN_IF_ERROR(
              dev_->Copy(scratch.get(), g + 2 * offsets[i], 2 * specs[i].numel(), stream_));
        }
        CheckCuda(cudaEventRecord(ev_stop, cs), "cudaEventRecord");
        CheckCuda(cudaEventSynchronize(ev_stop), "cudaEventSynchronize");
        float ms = 0;
        CheckCuda(cudaEventElapsedTime(&ms, ev_start, ev_stop), "cudaEventElapsedTime");
        fill_ms.push_back(ms);
      }
      (*row)["trainer_fill_ms"] = Median(fill_ms);
    }
    (*row)["grads"] = grads_into_engine_ ? "engine" : "handoff";
    Timings tm;
    absl::Status status;
    bool cut = false;
    for (int s = 0; s < warmup + measured && status.ok(); ++s) {
      if (SecondsSince(start) > deadline_s) {
        cut = true;
        break;
      }
      const cudaStream_t cs = static_cast<cudaStream_t>(stream_);
      const Clock::time_point t0 = Clock::now();
      CheckCuda(cudaEventRecord(ev_start, cs), "cudaEventRecord");
      const double cpu0 = ThreadCpuMs();
      const Clock::time_point h0 = Clock::now();
      // In backward order (plan().units), as a trainer's backward marks them.
      for (const memory::Unit& unit : engine->plan().units) {
        for (int i : unit.params) {
          if (status.ok()) status = grad_ready(i);
        }
      }
      if (!status.ok()) break;
      absl::StatusOr<StepStats> stats = engine->Step();
      const double host_cpu_ms = ThreadCpuMs() - cpu0;
      const double host_return_ms = SecondsSince(h0) * 1e3;
      if (!stats.ok()) {
        status = stats.status();
        break;
      }
      CheckCuda(cudaEventRecord(ev_stop, cs), "cudaEventRecord");
      CheckCuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize after Step");
      const double wall_ms = SecondsSince(t0) * 1e3;
      float event_ms = 0;
      CheckCuda(cudaEventElapsedTime(&event_ms, ev_start, ev_stop), "cudaEventElapsedTime");
      if (s < warmup) continue;
      absl::StatusOr<DeviceStepTimes> dt = engine->DeviceTimes();
      if (!dt.ok()) {
        status = dt.status();
        break;
      }
      tm.dev_norm.push_back(dt->norm_ms);
      tm.dev_update.push_back(dt->update_ms);
      tm.dev_gather.push_back(dt->gather_ms);
      tm.dev_total.push_back(dt->total_ms);
      tm.wall_ms.push_back(wall_ms);
      tm.event_ms.push_back(event_ms);
      tm.host_cpu.push_back(host_cpu_ms);
      tm.host_return.push_back(host_return_ms);
      tm.reduce.push_back(stats->reduce_ms);
      tm.optimizer.push_back(stats->optimizer_ms);
      tm.gather.push_back(stats->gather_ms);
      tm.offload_wait.push_back(stats->offload_wait_ms);
      tm.total.push_back(stats->total_ms);
      tm.overflow_steps += stats->skipped;
      tm.last = *stats;
    }
    cudaEventDestroy(ev_start);
    cudaEventDestroy(ev_stop);
    RETURN_IF_ERROR(status);
    if (cut || tm.wall_ms.empty()) {
      (*row)["not_run"] = absl::StrCat("stopped after ", tm.wall_ms.size(),
                                       " timed steps: past the time budget");
      return absl::OkStatus();
    }
    Report(tm, e, offload, engine->num_units(), row);
    return absl::OkStatus();
  }

 private:
  void Report(const Timings& tm, int64_t e, bool offload, int units, json* row) const {
    const double step_ms = Median(tm.wall_ms);
    double floor_ms;
    if (offload) {
      floor_ms = kTransferBytesEachWay * e / (limits_.d2h * 1e9) * 1e3 +
                 kTransferBytesEachWay * e / (limits_.h2d * 1e9) * 1e3;
    } else {
      floor_ms = kDeviceBytesPerElement * e / (limits_.d2d * 1e9) * 1e3;
    }
    (*row)["measured_steps"] = tm.wall_ms.size();
    (*row)["step_ms_median"] = step_ms;
    (*row)["step_ms_min"] = *std::min_element(tm.wall_ms.begin(), tm.wall_ms.end());
    (*row)["event_ms_median"] = Median(tm.event_ms);
    (*row)["event_ms_min"] = *std::min_element(tm.event_ms.begin(), tm.event_ms.end());
    (*row)["floor_ms"] = floor_ms;
    (*row)["ratio_to_floor"] = step_ms / floor_ms;
    if (offload) {
      const double host_ms = kHostAdamWBytesPerElement * e / (limits_.host * 1e9) * 1e3;
      (*row)["host_adamw_floor_ms"] = host_ms;
      (*row)["bound_ms"] = std::max(floor_ms, host_ms);
      (*row)["ratio_to_bound"] = step_ms / std::max(floor_ms, host_ms);
    }
    (*row)["stats"] = {
        {"reduce_ms", Median(tm.reduce)},
        {"optimizer_ms", Median(tm.optimizer)},
        {"gather_ms", Median(tm.gather)},
        {"offload_wait_ms", Median(tm.offload_wait)},
        {"total_ms", Median(tm.total)},
        {"comm_bytes", tm.last.comm_bytes},
        {"grad_norm", tm.last.grad_norm},
        {"optimizer_steps", tm.last.step},
        {"overflow_steps", tm.overflow_steps},
    };
    (*row)["device_times"] = {
        {"norm_ms", Median(tm.dev_norm)},
        {"update_ms", Median(tm.dev_update)},
        {"gather_ms", Median(tm.dev_gather)},
        {"total_ms", Median(tm.dev_total)},
    };
    (*row)["host"] = {
        {"cpu_ms_median", Median(tm.host_cpu)},
        {"return_ms_median", Median(tm.host_return)},
        {"cpu_us_per_unit", Median(tm.host_cpu) * 1e3 / std::max(units, 1)},
    };
  }

  Device* const dev_;
  comm::Communicator* const comm_;
  const Device::Stream stream_;
  const Limits limits_;
  const bool grads_into_engine_;
};

std::string DeviceName() {
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "unknown";
  int driver = 0;
  cudaDriverGetVersion(&driver);
  return absl::StrCat(prop.name, " (sm_", prop.major, prop.minor, ", ",
                      prop.totalGlobalMem >> 30, " GiB, driver CUDA ", driver / 1000, ".",
                      driver % 1000 / 10, ")");
}

int Main(int argc, char** argv) {
  const Clock::time_point start = Clock::now();
  Options opt;
  if (!ParseArgs(argc, argv, &opt)) {
    std::fprintf(stderr,
                 "usage: gpu_step_bench [--quick] [--shape small|1.3b|all] [--budget-s S] "
                 "[--grads handoff|engine] [--offload none|cpu|both] [--blocking-sync]\n");
    return 2;
  }
  // Before anything creates the context: the flag applies to a context made after it.
  if (opt.blocking_sync) {
    const cudaError_t e = cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync);
    if (e != cudaSuccess && e != cudaErrorNoDevice && e != cudaErrorInsufficientDriver) {
      std::fprintf(stderr, "gpu_step_bench: cudaSetDeviceFlags: %s\n", cudaGetErrorString(e));
      return 1;
    }
  }
  absl::StatusOr<std::unique_ptr<Device>> gpu = CreateCudaDevice(0);
  if (!gpu.ok()) {
    const std::string reason(gpu.status().message());
    // Indented, one key a line: tools/gpu_bundle/run.sh reads the reason off the "skipped" line.
    std::printf("%s\n",
                json({{"benchmark", "gpu_step_bench"}, {"skipped", reason}}).dump(2).c_str());
    return 0;
  }
  Device* const dev = gpu->get();
  ncclUniqueId id;
  if (ncclGetUniqueId(&id) != ncclSuccess) {
    std::fprintf(stderr, "gpu_step_bench: ncclGetUniqueId failed\n");
    return 1;
  }
  absl::StatusOr<std::unique_ptr<comm::Communicator>> nccl =
      comm::CreateNcclCommunicator(id, /*rank=*/0, /*world_size=*/1, /*device=*/0);
  if (!nccl.ok()) {
    std::fprintf(stderr, "gpu_step_bench: NCCL: %s\n", nccl.status().ToString().c_str());
    return 1;
  }
  absl::StatusOr<Device::Stream> stream = dev->CreateStream();
  if (!stream.ok()) {
    std::fprintf(stderr, "gpu_step_bench: CreateStream: %s\n", stream.status().ToString().c_str());
    return 1;
  }

  const Limits limits = MeasureLimits(opt.quick);
  std::fprintf(stderr,
               "gpu_step_bench: d2d copy %.0f GB/s (read + written), pinned h2d %.1f GB/s, d2h "
               "%.1f GB/s, host memcpy %.1f GB/s; limits measured at %.1f s\n",
               limits.d2d, limits.h2d, limits.d2h, limits.host, SecondsSince(start));
  const int warmup = opt.quick ? 1 : 3;
  const int measured = opt.quick ? 5 : 10;
  const std::vector<std::string> shapes =
      opt.quick ? std::vector<std::string>{"tiny"} : opt.shapes;

  ConfigRun runner(dev, nccl->get(), *stream, limits, opt.grads_into_engine);
  json configs = json::array();
  double seconds_per_element[2] = {0, 0};  // [offload]: of the last finished config
  bool failed = false;
  for (const std::string& shape_name : shapes) {
    const examples::gpt::GptShape shape = ShapeOf(shape_name);
    const examples::gpt::Gpt gpt(shape);
    const std::vector<memory::ParamSpec> specs = gpt.ParamSpecs();
    const int64_t params = gpt.num_elements();
    for (int offload = opt.offload_from; offload <= opt.offload_to; ++offload) {
      for (int stage = 0; stage <= 3; ++stage) {
        json row = {{"shape", shape_name}, {"params", params}, {"stage", stage},
                    {"offload", offload ? "cpu" : "none"}};
        double rate = seconds_per_element[offload];
        if (rate == 0 && seconds_per_element[0] > 0) rate = 4 * seconds_per_element[0];
        const double predicted_s = rate * params;
        const double elapsed = SecondsSince(start);
        if (elapsed + predicted_s > opt.budget_s) {
          row["not_run"] = absl::StrCat("time budget: ", static_cast<int>(elapsed), " s elapsed, ~",
                                        static_cast<int>(predicted_s + 0.5), " s predicted, ",
                                        static_cast<int>(opt.budget_s), " s budget");
          std::fprintf(stderr, "%-5s stage %d offload %-4s: not run (%s)\n", shape_name.c_str(),
                       stage, offload ? "cpu" : "none", row["not_run"].get<std::string>().c_str());
          configs.push_back(std::move(row));
          continue;
        }
        const Clock::time_point t0 = Clock::now();
        const absl::Status st = runner.Run(specs, stage, offload, warmup, measured, start,
                                           opt.budget_s + kOverrunS, &row);
        // Only a config that ran predicts the next (a refused one returns at once).
        if (row.contains("step_ms_median")) seconds_per_element[offload] = SecondsSince(t0) / params;
        if (!st.ok()) {
          failed = true;
          row["error"] = st.ToString();
          std::fprintf(stderr, "%-5s stage %d offload %-4s: error: %s\n", shape_name.c_str(),
                       stage, offload ? "cpu" : "none", st.ToString().c_str());
          // Whatever the engine left on the stream must not run into the next config.
          (void)dev->Synchronize(*stream);
        } else if (row.contains("step_ms_median")) {
          std::fprintf(stderr,
                       "%-5s stage %d offload %-4s: step %8.2f ms (min %8.2f, events %8.2f), "
                       "floor %8.2f ms, ratio %6.2f; device: norm %.2f update %.2f gather "
                       "%.2f ms; host %.1f us/unit; create %.1f s, init %.1f s\n",
                       shape_name.c_str(), stage, offload ? "cpu" : "none",
                       row["step_ms_median"].get<double>(), row["step_ms_min"].get<double>(),
                       row["event_ms_median"].get<double>(), row["floor_ms"].get<double>(),
                       row["ratio_to_floor"].get<double>(),
                       row["device_times"]["norm_ms"].get<double>(),
                       row["device_times"]["update_ms"].get<double>(),
                       row["device_times"]["gather_ms"].get<double>(),
                       row["host"]["cpu_us_per_unit"].get<double>(), row["create_s"].get<double>(),
                       row["init_s"].get<double>());
        } else {
          std::fprintf(stderr, "%-5s stage %d offload %-4s: %s\n", shape_name.c_str(), stage,
                       offload ? "cpu" : "none", row["not_run"].get<std::string>().c_str());
        }
        configs.push_back(std::move(row));
      }
    }
  }
  (void)dev->Synchronize(*stream);
  dev->DestroyStream(*stream);

  json doc = {
      {"benchmark", "gpu_step_bench"},
      {"device", DeviceName()},
      {"world", 1},
      {"precision", "bf16"},
      {"grads", opt.grads_into_engine ? "engine" : "handoff"},
      {"host_sync", opt.blocking_sync ? "blocking" : "spin (CUDA's default)"},
      {"warmup_steps", warmup},
      {"measured_steps", measured},
      {"d2d_copy_GBps", limits.d2d},
      {"h2d_GBps", limits.h2d},
      {"d2h_GBps", limits.d2h},
      {"host_copy_GBps", limits.host},
      {"bytes_per_element",
       {{"device_step", kDeviceBytesPerElement},
        {"offload_each_way", kTransferBytesEachWay},
        {"host_adamw", kHostAdamWBytesPerElement}}},
      {"baseline",
       "floor_ms: 32 B/elem at d2d_copy_GBps without offload; 2 B/elem down at d2h_GBps + 2 B/elem "
       "up at h2d_GBps with CPU offload (host AdamW apart: host_adamw_floor_ms)"},
      {"elapsed_s", SecondsSince(start)},
      {"configs", configs},
  };
  std::printf("%s\n", doc.dump(2).c_str());
  return failed ? 1 : 0;
}

}  // namespace
}  // namespace zerort

int main(int argc, char** argv) { return zerort::Main(argc, argv); }
