// The engine's host work per unit per step (issue #23's goal: at most 10 us), and the device
// calls behind it, measured without a GPU: the CPU device with asynchronous streams runs every
// kernel, copy and collective's arithmetic on worker threads, so the trainer's thread does what
// it would do on a GPU (plan the step, enqueue, record and wait on events) and sleeps while it
// waits. The CUDA driver's own cost per call is not in these figures: multiply the calls per unit
// by a launch's or an event's host cost on the target machine (`gpu_step_bench`'s "host" figures
// measure the whole on a GPU).
//
// Shapes: GPT-2 124M's parameter list (examples/gpt, Gpt::ParamSpecs of GptShape::Gpt2Small()),
// bf16 compute, default unit sizes, world 1, stages 0-3 without offload, over the stream-ordered
// test communicator (comm/testing/stream_ordered.h: collectives enqueued on streams and joined
// by events, NCCL's completion model, so the engine makes the GPU path's calls; the in-process
// communicator completes on return and moves the data on the calling thread, which is not host
// overhead); --quick: the demo's GPT (examples/gpt's default GptShape, 0.83M parameters), for CI.
//
// Per stage, after 2 warm-up steps (--quick: 1), medians over 5 steps (--quick: 3) of one
// optimizer step in the standard order (zero/testing/link_bytes_check.h TrainStandardOrder:
// Gather and Release every unit forward and backward, GradReady of every parameter, Step()):
//   cpu_us_per_unit   the calling thread's CPU time (CLOCK_THREAD_CPUTIME_ID) for the step over
//                     its units; the limit it is held to is the goal's 10 us, which on a GPU must
//                     also pay the driver's per-call cost
//   wall_ms           the same step's wall time (the arithmetic on the worker threads included)
//   calls_per_step    the Device calls the engine made, by kind (a CountingDevice between the
//                     engine and the CPU device): kernels (copy, zero, cast, accumulate, scale,
//                     norm and finite check, AdamW), norm_ranges (ranges of the batched norm),
//                     event records, stream waits, host waits (WaitHost, Synchronize)
//   calls_per_unit    calls_per_step's total over the units
// The communicator's own device calls (the stream-ordered group's copies and events) are not
// counted: on a GPU they are NCCL's, one launch per collective.
//
// Prints one JSON document on stdout and a line per stage on stderr; exits 1 when a stage failed.
//
// Usage: host_work_bench [--quick]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "benchmarks/bench_util.h"
#include "comm/testing/stream_ordered.h"
#include "device/cpu_device.h"
#include "device/testing/forwarding_device.h"
#include "examples/gpt/gpt.h"
#include "nlohmann/json.hpp"
#include "zero/config.h"
#include "zero/engine.h"
#include "zero/testing/link_bytes_check.h"

namespace zerort {
namespace {

using json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;
using bench::SecondsSince;
using bench::ThreadCpuMs;

// Counts the calls that cost a GPU's host a driver call. Atomic: the offload and NVMe paths
// call the device from their own threads.
class CountingDevice : public testing::ForwardingDevice {
 public:
  enum Kind { kKernel, kNormRange, kRecord, kWait, kHostWait, kKinds };
  static constexpr const char* kNames[kKinds] = {"kernels", "norm_ranges", "event_records",
                                                 "stream_waits", "host_waits"};

  using ForwardingDevice::ForwardingDevice;

  void Reset() {
    for (auto& c : counts_) c = 0;
  }
  int64_t count(Kind k) const { return counts_[k]; }

  absl::Status Copy(void* dst, const void* src, size_t bytes, Stream s) override {
    Count(kKernel);
    return inner_->Copy(dst, src, bytes, s);
  }
  absl::Status Zero(void* dst, size_t bytes, Stream s) override {
    Count(kKernel);
    return inner_->Zero(dst, bytes, s);
  }
  absl::Status Cast(const void* src, DType sd, void* dst, DType dd, size_t n, Stream s) override {
    Count(kKernel);
    return inner_->Cast(src, sd, dst, dd, n, s);
  }
  absl::Status Accumulate(void* acc, const void* x, DType d, size_t n, Stream s) override {
    Count(kKernel);
    return inner_->Accumulate(acc, x, d, n, s);
  }
  absl::Status Scale(void* x, DType d, size_t n, float factor, Stream s) override {
    Count(kKernel);
    return inner_->Scale(x, d, n, factor, s);
  }
  absl::Status SquaredNorm(const void* x, DType d, size_t n, float* out, Stream s) override {
    Count(kKernel);
    return inner_->SquaredNorm(x, d, n, out, s);
  }
  absl::Status AllFinite(const void* x, DType d, size_t n, bool* out, Stream s) override {
    Count(kKernel);
    return inner_->AllFinite(x, d, n, out, s);
  }
  // One call, as the CUDA device batches it (a launch per 64 ranges and tree level there).
  absl::Status SquaredNormsAndFinite(absl::Span<const NormRange> ranges, float* sumsq, bool* finite,
                                     Stream s) override {
    Count(kKernel);
    counts_[kNormRange] += static_cast<int64_t>(ranges.size());
    return inner_->SquaredNormsAndFinite(ranges, sumsq, finite, s);
  }
  absl::Status AdamWRanges(const offload::AdamWArrays& arrays,
                           absl::Span<const offload::AdamWRange> ranges, float grad_scale,
                           Stream s) override {
    Count(kKernel);
    return inner_->AdamWRanges(arrays, ranges, grad_scale, s);
  }
  absl::Status CompactAdamWRanges(const offload::CompactAdamWArrays& arrays,
                                  absl::Span<const offload::AdamWRange> ranges, float grad_scale,
                                  Stream s) override {
    Count(kKernel);
    return inner_->CompactAdamWRanges(arrays, ranges, grad_scale, s);
  }
  absl::Status Record(Event e, Stream s) override {
    Count(kRecord);
    return inner_->Record(e, s);
  }
  absl::Status Wait(Stream s, Event e) override {
    Count(kWait);
    return inner_->Wait(s, e);
  }
  absl::Status WaitHost(Event e) override {
    Count(kHostWait);
    return inner_->WaitHost(e);
  }
  absl::Status Synchronize(Stream s) override {
    Count(kHostWait);
    return inner_->Synchronize(s);
  }

 private:
  void Count(Kind k) { counts_[k].fetch_add(1, std::memory_order_relaxed); }

  std::atomic<int64_t> counts_[kKinds] = {};
};

Config StageConfig(int stage) {
  const std::string text = absl::StrCat(
      R"({"zero_optimization": {"stage": )", stage, R"(}, "bf16": {"enabled": true},)",
      R"( "optimizer": {"type": "AdamW", "params": {"lr": 0.0001, "weight_decay": 0.01}}})");
  return ParseConfig(text, "host_work_bench").value();  // a constant text: parses
}

// One stage's steps into `row`.
// The communicator works on `inner` (the CPU device under `dev`): only the engine's calls count.
absl::Status RunStage(const std::vector<memory::ParamSpec>& specs, int stage, int warmup,
                      int measured, Device* inner, CountingDevice* dev, json* row) {
  ASSIGN_OR_RETURN(auto comms, comm::testing::CreateStreamOrderedGroup(1, inner));
  ASSIGN_OR_RETURN(Device::Stream stream, dev->CreateStream());
  EngineOptions options;
  options.compute_stream = stream;  // asynchronous: the arithmetic leaves the trainer's thread
  absl::Status status;
  {
    ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                     Engine::Create(StageConfig(stage), specs, comms[0].get(), dev, options));
    RETURN_IF_ERROR(engine->InitParams([](int, const memory::ParamSpec&, float*) {},
                                       /*from_rank0=*/true));
    const int units = engine->num_units();
    std::vector<double> cpu_ms, wall_ms;
    std::vector<std::vector<double>> calls(CountingDevice::kKinds);
    for (int s = 0; s < warmup + measured && status.ok(); ++s) {
      status = dev->Synchronize(stream);  // the previous step's tail is not this step's
      if (!status.ok()) break;
      dev->Reset();
      const double c0 = ThreadCpuMs();
      const Clock::time_point t0 = Clock::now();
      status = testing::TrainStandardOrder(*engine, 1);
      const double cpu = ThreadCpuMs() - c0;
      const double wall = SecondsSince(t0) * 1e3;
      if (!status.ok() || s < warmup) continue;
      cpu_ms.push_back(cpu);
      wall_ms.push_back(wall);
      for (int k = 0; k < CountingDevice::kKinds; ++k) {
        calls[k].push_back(static_cast<double>(dev->count(static_cast<CountingDevice::Kind>(k))));
      }
    }
    if (status.ok()) status = dev->Synchronize(stream);
    if (status.ok()) {
      json per_step, per_unit;
      double total = 0;
      for (int k = 0; k < CountingDevice::kKinds; ++k) {
        const double median = bench::Median(calls[k]);
        per_step[CountingDevice::kNames[k]] = median;
        if (k != CountingDevice::kNormRange) total += median;  // ranges ride on one call
      }
      per_step["total"] = total;
      (*row)["units"] = units;
      (*row)["measured_steps"] = cpu_ms.size();
      (*row)["cpu_ms_median"] = bench::Median(cpu_ms);
      (*row)["cpu_us_per_unit"] = bench::Median(cpu_ms) * 1e3 / std::max(units, 1);
      (*row)["wall_ms_median"] = bench::Median(wall_ms);
      (*row)["calls_per_step"] = per_step;
      (*row)["calls_per_unit"] = total / std::max(units, 1);
    }
  }
  dev->DestroyStream(stream);
  return status;
}

int Main(int argc, char** argv) {
  bool quick = false;
  if (!bench::ParseQuick(argc, argv, "host_work_bench", &quick)) return 2;
  const examples::gpt::Gpt gpt(quick ? examples::gpt::GptShape()
                                     : examples::gpt::GptShape::Gpt2Small());
  CpuDeviceOptions device_options;
  device_options.async_streams = true;
  std::unique_ptr<Device> cpu = CreateCpuDevice(device_options);
  CountingDevice dev(cpu.get());
  const int warmup = quick ? 1 : 2, measured = quick ? 3 : 5;
  json stages = json::array();
  bool failed = false;
  for (int stage = 0; stage <= 3; ++stage) {
    json row = {{"stage", stage}};
    const absl::Status st =
        RunStage(gpt.ParamSpecs(), stage, warmup, measured, cpu.get(), &dev, &row);
    if (!st.ok()) {
      failed = true;
      row["error"] = st.ToString();
      std::fprintf(stderr, "stage %d: error: %s\n", stage, st.ToString().c_str());
    } else {
      std::fprintf(stderr,
                   "stage %d: %d units, host %.1f us/unit (%.2f ms CPU, %.1f ms wall), %.1f "
                   "device calls/unit\n",
                   stage, row["units"].get<int>(), row["cpu_us_per_unit"].get<double>(),
                   row["cpu_ms_median"].get<double>(), row["wall_ms_median"].get<double>(),
                   row["calls_per_unit"].get<double>());
    }
    stages.push_back(std::move(row));
  }
  const json doc = {
      {"benchmark", "host_work_bench"},
      {"model", quick ? "the demo's gpt (4 layers, d_model 128)" : "gpt2-124m shapes"},
      {"params", gpt.num_elements()},
      {"device", "cpu, asynchronous streams (arithmetic on worker threads)"},
      {"communicator", "stream-ordered in-process group (NCCL's completion model)"},
      {"world", 1},
      {"precision", "bf16"},
      {"warmup_steps", warmup},
      {"measured_steps", measured},
      {"limit", "cpu_us_per_unit <= 10 (issue #23), before the driver's per-call cost"},
      {"stages", stages},
  };
  std::printf("%s\n", doc.dump(2).c_str());
  return failed ? 1 : 0;
}

}  // namespace
}  // namespace zerort

int main(int argc, char** argv) { return zerort::Main(argc, argv); }
