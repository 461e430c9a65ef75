// CUDA device throughput against the limits measured in the same run.
//
//   adamw      Device::AdamW of the CUDA device (the engine's GPU optimizer step), as bytes/s of
//              its own traffic (bf16 grads and params: 28 bytes per parameter; fp32 grads, no
//              param copy: 28 as well), against
//   d2d_copy   cudaMemcpyAsync device-to-device moving the same number of bytes (read + write):
//              the memory-bandwidth floor any streaming kernel is held to. Goal: adamw >= 0.8 of
//              it (an elementwise kernel with 5 streams rarely beats 0.9 of a copy).
//   transfers  host<->device with Device::Copy from pinned and from pageable host memory,
//              against the best of several raw cudaMemcpyAsync between pinned memory and the
//              device (the PCIe / C2C limit). Pinned should reach ~1.0 of it; pageable is what
//              an engine without a pinned pool would get.
//
// Prints one JSON document. Without a GPU it prints {"benchmark": ..., "skipped": "<reason>"}
// and exits 0, so that scripts can run it anywhere.
//
// Usage: cuda_bench [--quick]   (--quick: smaller arrays, fewer repetitions)
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "benchmarks/bench_util.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/dtype.h"
#include "memory/arena.h"
#include "nlohmann/json.hpp"
#include "offload/cpu_adamw.h"
#include "device/cuda_device.h"
#include "device/device.h"

namespace zerort {
namespace {

using nlohmann::json;

struct Options {
  bool quick = false;
};

// A buffer of one memory kind, freed on scope exit. Aborts the benchmark on failure: this is a
// tool, not library code.
memory::Allocation Alloc(Device* dev, memory::MemoryKind kind, size_t bytes) {
  auto a = memory::Allocation::Create(dev->allocator(kind), bytes);
  if (!a.ok()) {
    std::fprintf(stderr, "cuda_bench: %s\n", std::string(a.status().message()).c_str());
    std::exit(1);
  }
  return std::move(*a);
}

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "cuda_bench: %s: %s\n", what, std::string(s.message()).c_str());
    std::exit(1);
  }
}

void CheckCuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "cuda_bench: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// Wall-clock seconds of each repetition of fn() followed by a device synchronization; the first
// call is a warm-up.
std::vector<double> Time(Device* dev, int reps, const std::function<void()>& fn) {
  fn();
  Check(dev->Synchronize(nullptr), "warm-up");
  std::vector<double> s;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    Check(dev->Synchronize(nullptr), "synchronize");
    s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(s.begin(), s.end());
  return s;
}

using bench::Median;

json BenchAdamW(Device* dev, size_t n, DType grad_dtype, bool param_out, int reps,
                double d2d_gbps) {
  memory::Allocation master = Alloc(dev, memory::MemoryKind::kDevice, 4 * n);
  memory::Allocation m = Alloc(dev, memory::MemoryKind::kDevice, 4 * n);
  memory::Allocation v = Alloc(dev, memory::MemoryKind::kDevice, 4 * n);
  memory::Allocation grad =
      Alloc(dev, memory::MemoryKind::kDevice, n * DTypeSize(grad_dtype));
  memory::Allocation param = Alloc(dev, memory::MemoryKind::kDevice, 2 * n);
  // Zeros are finite and keep the arithmetic on the ordinary path (no NaN/Inf slow cases).
  for (memory::Allocation* b : {&master, &m, &v}) Check(dev->Zero(b->get(), 4 * n, nullptr), "zero");
  Check(dev->Zero(grad.get(), n * DTypeSize(grad_dtype), nullptr), "zero");
  auto params = offload::MakeAdamWStepParams(1e-3, 0.9, 0.95, 1e-8, 0.1, 10);
  Check(params.status(), "params");
  const offload::AdamWArrays a{master.as<float>(), m.as<float>(), v.as<float>(), grad.get(),
                               grad_dtype, param_out ? param.get() : nullptr, DType::kBF16, n};
  const std::vector<double> t =
      Time(dev, reps, [&] { Check(dev->AdamW(a, *params, 1.0f, nullptr), "AdamW"); });
  const double bytes_per_param = 24.0 + DTypeSize(grad_dtype) + (param_out ? 2.0 : 0.0);
  const double gbps = bytes_per_param * n / Median(t) / 1e9;
  return {{"params", n},
          {"grad_dtype", std::string(DTypeName(grad_dtype))},
          {"param_out", param_out ? "bf16" : "none"},
          {"bytes_per_param", bytes_per_param},
          {"median_ms", Median(t) * 1e3},
          {"best_ms", t.front() * 1e3},
          {"gb_per_s", gbps},
          {"params_per_s", n / Median(t)},
          {"fraction_of_d2d_copy", gbps / d2d_gbps}};
}

json BenchD2D(Device* dev, size_t bytes, int reps, double* gbps_out) {
  memory::Allocation a = Alloc(dev, memory::MemoryKind::kDevice, bytes);
  memory::Allocation b = Alloc(dev, memory::MemoryKind::kDevice, bytes);
  Check(dev->Zero(a.get(), bytes, nullptr), "zero");
  const std::vector<double> t = Time(dev, reps, [&] {
    CheckCuda(cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice, nullptr),
              "cudaMemcpyAsync d2d");
  });
  *gbps_out = 2.0 * bytes / Median(t) / 1e9;  // read + write
  return {{"bytes", bytes}, {"median_ms", Median(t) * 1e3}, {"gb_per_s", *gbps_out}};
}

json BenchTransfers(Device* dev, size_t bytes, int reps) {
  memory::Allocation dbuf = Alloc(dev, memory::MemoryKind::kDevice, bytes);
  memory::Allocation pinned = Alloc(dev, memory::MemoryKind::kPinnedHost, bytes);
  memory::Allocation pageable = Alloc(dev, memory::MemoryKind::kPageableHost, bytes);
  // Touch every page first: the benchmark measures copies, not first-touch page faults.
  std::memset(pinned.get(), 1, bytes);
  std::memset(pageable.get(), 1, bytes);
  json out = json::array();
  for (bool h2d : {true, false}) {
    auto copy = [&](void* host) {
      void* dst = h2d ? dbuf.get() : host;
      const void* src = h2d ? host : dbuf.get();
      return [=] { Check(dev->Copy(dst, src, bytes, nullptr), "Copy"); };
    };
    const std::vector<double> pin = Time(dev, reps, copy(pinned.get()));
    const std::vector<double> page = Time(dev, reps, copy(pageable.get()));
    const std::vector<double> raw = Time(dev, reps, [&] {
      CheckCuda(h2d ? cudaMemcpyAsync(dbuf.get(), pinned.get(), bytes, cudaMemcpyHostToDevice,
                                      nullptr)
                    : cudaMemcpyAsync(pinned.get(), dbuf.get(), bytes, cudaMemcpyDeviceToHost,
                                      nullptr),
                "cudaMemcpyAsync");
    });
    const double best = bytes / raw.front() / 1e9;
    const double pin_gbps = bytes / Median(pin) / 1e9;
    const double page_gbps = bytes / Median(page) / 1e9;
    out.push_back({{"direction", h2d ? "h2d" : "d2h"},
                   {"bytes", bytes},
                   {"pinned_copy_gb_per_s", pin_gbps},
                   {"pageable_copy_gb_per_s", page_gbps},
                   {"best_cudamemcpy_gb_per_s", best},
                   {"pinned_fraction_of_best", pin_gbps / best},
                   {"pageable_fraction_of_best", page_gbps / best}});
  }
  return out;
}

int Main(int argc, char** argv) {
  Options opt;
  if (!bench::ParseQuick(argc, argv, "cuda_bench", &opt.quick)) return 2;
  json doc = {{"benchmark", "cuda_bench"}};
  auto gpu = CreateCudaDevice(0);
  if (!gpu.ok()) {
    doc["skipped"] = std::string(gpu.status().message());
    std::printf("%s\n", doc.dump(2).c_str());
    return 0;
  }
  Device* dev = gpu->get();
  cudaDeviceProp props;
  CheckCuda(cudaGetDeviceProperties(&props, 0), "cudaGetDeviceProperties");
  doc["device"] = props.name;
  doc["quick"] = opt.quick;
  const int reps = opt.quick ? 5 : 20;
  const size_t n = opt.quick ? (size_t{1} << 22) : (size_t{1} << 27);
  double d2d_gbps = 0;
  // The same traffic as one AdamW step on n parameters at 28 bytes each.
  doc["d2d_copy"] = BenchD2D(dev, 14 * n, reps, &d2d_gbps);
  doc["adamw"] = json::array({BenchAdamW(dev, n, DType::kBF16, true, reps, d2d_gbps),
                              BenchAdamW(dev, n, DType::kF32, false, reps, d2d_gbps)});
  doc["transfers"] = BenchTransfers(dev, opt.quick ? (size_t{1} << 24) : (size_t{1} << 28), reps);
  std::printf("%s\n", doc.dump(2).c_str());
  return 0;
}

}  // namespace
}  // namespace zerort

int main(int argc, char** argv) { return zerort::Main(argc, argv); }
