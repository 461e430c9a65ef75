// Every kernel the CUDA device runs for the engine, and its host transfers, against the limits
// measured in the same run on the same GPU.
//
//   d2d_copy   cudaMemcpyAsync device-to-device of 4n bytes (n elements of fp32), as bytes read
//              + written per second: the memory-bandwidth limit any streaming kernel is held to.
//   kernels    each kernel of device/internal/cuda_kernels.h through the Device interface (what
//              the engine calls), on n elements, as its own bytes read + written per second and
//              `fraction_of_d2d_copy` = that / d2d_copy. Goal: at least 0.8 for the elementwise
//              kernels (an elementwise kernel with several streams rarely beats 0.9 of a copy):
//                adamw       every grad dtype x param copy (none, fp32, bf16, fp16); 24 bytes of
//                            master/m/v per element + grad + param copy
//                cast        every ordered pair of distinct dtypes
//                accumulate  each dtype (acc read + written, x read)
//                squared_norm, all_finite  each dtype (x read once)
//                adamw_compact  each compact optimizer-state form (offload/cpu_adamw_compact.h:
//                            fp32 master + bf16 param copy, bf16 + remainder, stochastic bf16)
//                            x fp32 / bf16 moments, bf16 grads, counted as
//                            CompactAdamWBytesPerElement counts them (14 to 28 bytes)
//                rows with "offset": bf16 AdamW, bf16->fp32 cast, bf16 accumulate and the bf16
//                            finite check on ranges starting one element into the arrays,
//                            "offset1" (every array moved: vector path after a scalar head) and
//                            "mixed" (only the 2-byte arrays moved: the unaligned path)
//                reduce_rank_order  the in-process group's reduction on one GPU
//                            (CudaInProcessBufferOps: comm/inprocess.h), sum over 2 and 4 ranks,
//                            fp32 and bf16 (every source read, dst written; includes its
//                            cudaStreamSynchronize, as the engine pays it)
//   transfers  host<->device of one buffer with Device::Copy from pinned and from pageable host
//              memory, against a bare cudaMemcpyAsync between the same pinned buffer and the GPU
//              (the PCIe / C2C limit): `pinned_fraction_of_raw` should be about 1.
//   host_calls  the host's cost of each call the engine makes per unit (issue #23's goal: 10 us
//              of host work per unit per step), in microseconds per call on the host's clock:
//              bursts of 200 calls on one stream, the loop alone timed (the stream drains
//              between bursts, so a full launch queue never blocks the host). The driver's
//              calls bare (cudaPointerGetAttributes, cudaEventRecord, cudaStreamWaitEvent, a
//              256-byte cudaMemsetAsync as a launch) and through the Device (Record, Wait,
//              Zero and Scale of 256 bytes: what the engine calls, argument checks and pointer
//              queries included). Measured with the transfers.
//
// Times are CUDA events around each call on the legacy default stream (median and best of the
// repetitions after one warm-up). Sizes that do not fit in free GPU memory (five arrays of 4n
// bytes) are reported as skipped.
//
// Prints one JSON document. Without a GPU it prints {"benchmark": "cuda_bench", "skipped":
// "<reason>"} and exits 0, so that scripts can run it anywhere.
//
// Usage: cuda_bench [--quick] [--elements N]... [--no-transfers]
//   default: n = 1e8 and 1e9 elements, 256 MiB transfers; --quick: n = 2^22, 16 MiB, 3 reps.
//   --elements N (e.g. 1e8, repeatable) replaces the sizes; --no-transfers leaves them out
//   (tools/gpu_bundle/run.sh runs each size as its own process so a cut-short run keeps the
//   first).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/dtype.h"
#include "benchmarks/bench_util.h"
#include "benchmarks/cuda_timing.h"
#include "comm/inprocess.h"
#include "device/cuda_device.h"
#include "device/device.h"
#include "memory/arena.h"
#include "nlohmann/json.hpp"
#include "offload/cpu_adamw.h"
#include "offload/cpu_adamw_compact.h"

namespace zerort {
namespace {

using json = nlohmann::ordered_json;
using bench::CheckCuda;
using bench::EventTimes;
using bench::Median;

constexpr DType kDTypes[] = {DType::kF32, DType::kBF16, DType::kF16};

struct Options {
  bool quick = false;
  bool transfers = true;
  std::vector<size_t> elements;  // empty: the defaults for quick / full
};

// Returns false after printing the usage line.
bool ParseArgs(int argc, char** argv, Options* opt) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      opt->quick = true;
    } else if (a == "--no-transfers") {
      opt->transfers = false;
    } else if (a == "--elements" && i + 1 < argc) {
      char* end = nullptr;
      const double v = std::strtod(argv[++i], &end);
      if (*end != '\0' || !(v >= 1) || v > 1e12) {
        std::fprintf(stderr, "cuda_bench: bad --elements %s\n", argv[i]);
        return false;
      }
      opt->elements.push_back(static_cast<size_t>(v));
    } else {
      std::fprintf(stderr, "usage: cuda_bench [--quick] [--elements N]... [--no-transfers]\n");
      return false;
    }
  }
  if (opt->elements.empty()) {
    if (opt->quick) {
      opt->elements = {size_t{1} << 22};
    } else {
      opt->elements = {100000000, 1000000000};
    }
  }
  return true;
}

// Aborts the benchmark on failure: this is a tool, not library code.
void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "cuda_bench: %s: %s\n", what, std::string(s.message()).c_str());
    std::exit(1);
  }
}


memory::Allocation Alloc(Device* dev, memory::MemoryKind kind, size_t bytes) {
  auto a = memory::Allocation::Create(dev->allocator(kind), bytes);
  Check(a.status(), "allocation");
  return std::move(*a);
}


std::string Name(DType d) { return std::string(DTypeName(d)); }

// Runs and reports the kernels on n elements: the arrays, the copy figure they are held to,
// and one JSON row per kernel.
class SizeBench {
 public:
  SizeBench(Device* dev, size_t n, int reps) : dev_(dev), n_(n), reps_(reps) {
    for (memory::Allocation& a : arrays_) {
      a = Alloc(dev, memory::MemoryKind::kDevice, 4 * n);
      // Zeros: finite, so AllFinite scans everything and AdamW stays on the ordinary path.
      Check(dev->Zero(a.get(), 4 * n, nullptr), "Zero");
    }
    host_result_ = Alloc(dev, memory::MemoryKind::kPinnedHost, 4096);
  }

  static size_t BytesNeeded(size_t n) { return kArrays * 4 * n + n / 256 + (size_t{64} << 20); }

  json Run() {
    json out = {{"elements", n_}, {"reps", reps_}};
    const std::vector<double> copy = EventTimes(reps_, [&] {
      CheckCuda(cudaMemcpyAsync(a(1), a(0), 4 * n_, cudaMemcpyDeviceToDevice, nullptr),
                "cudaMemcpyAsync d2d");
    });
    copy_gbps_ = 8.0 * n_ / Median(copy) / 1e9;
    out["d2d_copy"] = {{"bytes", 4 * n_},
                       {"median_ms", Median(copy) * 1e3},
                       {"best_ms", copy.front() * 1e3},
                       {"gb_per_s", copy_gbps_}};
    Progress("d2d_copy", "", copy);
    json rows = json::array();
    AdamW(&rows);
    CompactAdamW(&rows);
    for (DType s : kDTypes) {
      for (DType d : kDTypes) {
        if (s == d) continue;
        rows.push_back(Row("cast", {{"src", Name(s)}, {"dst", Name(d)}},
                           DTypeSize(s) + DTypeSize(d), [&] {
                             Check(dev_->Cast(a(0), s, a(1), d, n_, nullptr), "Cast");
                           }));
      }
    }
    for (DType d : kDTypes) {
      rows.push_back(Row("accumulate", {{"dtype", Name(d)}}, 3 * DTypeSize(d), [&] {
        Check(dev_->Accumulate(a(0), a(1), d, n_, nullptr), "Accumulate");
      }));
    }
    float* norm = host_result_.as<float>();
    for (DType d : kDTypes) {
      rows.push_back(Row("squared_norm", {{"dtype", Name(d)}}, DTypeSize(d), [&] {
        Check(dev_->SquaredNorm(a(0), d, n_, norm, nullptr), "SquaredNorm");
      }));
    }
    bool* finite = reinterpret_cast<bool*>(host_result_.as<char>() + 64);
    for (DType d : kDTypes) {
      rows.push_back(Row("all_finite", {{"dtype", Name(d)}}, DTypeSize(d), [&] {
        Check(dev_->AllFinite(a(0), d, n_, finite, nullptr), "AllFinite");
      }));
    }
    const comm::InProcessBufferOps ops = CudaInProcessBufferOps(0);
    for (DType d : {DType::kF32, DType::kBF16}) {
      for (int ranks : {2, 4}) {
        const void* srcs[4] = {a(0), a(1), a(2), a(3)};
        const json args = {{"dtype", Name(d)}, {"ranks", ranks}, {"op", "sum"}};
        rows.push_back(Row("reduce_rank_order", args, (ranks + 1) * DTypeSize(d), [&] {
          Check(ops.reduce(srcs, ranks, a(4), n_, d, comm::ReduceOp::kSum), "in-process reduce");
        }));
      }
    }
    Misaligned(&rows);
    out["kernels"] = std::move(rows);
    return out;
  }

 private:
  static constexpr int kArrays = 5;

  void* a(int i) { return arrays_[i].get(); }

  void AdamW(json* rows) {
    auto step = offload::MakeAdamWStepParams(1e-3, 0.9, 0.95, 1e-8, 0.1, 10);
    Check(step.status(), "MakeAdamWStepParams");
    for (DType g : kDTypes) {
      for (int p = -1; p < 3; ++p) {  // -1: no parameter copy
        const bool out = p >= 0;
        const DType pd = out ? kDTypes[p] : DType::kBF16;
        const offload::AdamWArrays arrays{arrays_[0].as<float>(), arrays_[1].as<float>(),
                                          arrays_[2].as<float>(), a(3), g,
                                          out ? a(4) : nullptr, pd, n_};
        rows->push_back(Row("adamw", {{"grad", Name(g)}, {"param_out", out ? Name(pd) : "none"}},
                            24 + DTypeSize(g) + (out ? DTypeSize(pd) : 0), [&] {
                              Check(dev_->AdamW(arrays, *step, 1.0f, nullptr), "AdamW");
                            }));
      }
    }
  }

  // Each compact form with bf16 gradients, as the engine runs it: master, param and remainder
  // in arrays 0 and 4, m, v and grad in 1, 2, 3 (every array from a 16-byte boundary).
  void CompactAdamW(json* rows) {
    auto step = offload::MakeAdamWStepParams(1e-3, 0.9, 0.95, 1e-8, 0.1, 10);
    Check(step.status(), "MakeAdamWStepParams");
    const offload::AdamWRange all{0, n_, *step};
    for (offload::MasterForm form :
         {offload::MasterForm::kF32, offload::MasterForm::kBf16Remainder,
          offload::MasterForm::kBf16Stochastic}) {
      for (DType moments : {DType::kF32, DType::kBF16}) {
        offload::CompactAdamWArrays c;
        c.master_form = form;
        const bool f32 = form == offload::MasterForm::kF32;
        c.master = f32 ? arrays_[0].as<float>() : nullptr;
        c.param = f32 ? a(4) : a(0);
        c.param_dtype = DType::kBF16;
        c.remainder =
            form == offload::MasterForm::kBf16Remainder ? arrays_[4].as<uint16_t>() : nullptr;
        c.m = a(1);
        c.v = a(2);
        c.moment_dtype = moments;
        c.grad = a(3);
        c.grad_dtype = DType::kBF16;
        c.n = n_;
        c.rounding = {1234, 10, 0};
        const json args = {{"master", offload::MasterFormName(form)},
                           {"moments", Name(moments)},
                           {"grad", "bf16"}};
        rows->push_back(Row("adamw_compact", args, offload::CompactAdamWBytesPerElement(c), [&] {
          Check(dev_->CompactAdamWRanges(c, absl::MakeConstSpan(&all, 1), 1.0f, nullptr),
                "CompactAdamWRanges");
        }));
      }
    }
  }

  // Ranges that start at element offsets into the arenas (what the engine passes), on n - 8
  // elements: "offset" 1 moves every array one element on, so all still meet a 16-byte boundary
  // at the same element (vector path after a scalar head); "mixed" moves only the 2-byte arrays,
  // so no element aligns them all (the unaligned, 8-loads-per-thread path).
  void Misaligned(json* rows) {
    auto step = offload::MakeAdamWStepParams(1e-3, 0.9, 0.95, 1e-8, 0.1, 10);
    Check(step.status(), "MakeAdamWStepParams");
    const size_t n = n_ - 8;
    auto at = [&](int i, size_t elems, DType d) {
      return static_cast<char*>(a(i)) + elems * DTypeSize(d);
    };
    for (const char* mode : {"offset1", "mixed"}) {
      const size_t f32_off = std::string(mode) == "offset1" ? 1 : 0;
      const offload::AdamWArrays arrays{
          reinterpret_cast<float*>(at(0, f32_off, DType::kF32)),
          reinterpret_cast<float*>(at(1, f32_off, DType::kF32)),
          reinterpret_cast<float*>(at(2, f32_off, DType::kF32)),
          at(3, 1, DType::kBF16), DType::kBF16, at(4, 1, DType::kBF16), DType::kBF16, n};
      rows->push_back(Row("adamw", {{"grad", "bf16"}, {"param_out", "bf16"}, {"offset", mode}},
                          24 + 2 + 2, [&] {
                            Check(dev_->AdamW(arrays, *step, 1.0f, nullptr), "AdamW");
                          }));
      rows->push_back(Row("cast", {{"src", "bf16"}, {"dst", "fp32"}, {"offset", mode}}, 2 + 4, [&] {
        Check(dev_->Cast(at(0, 1, DType::kBF16), DType::kBF16, at(1, f32_off, DType::kF32),
                         DType::kF32, n, nullptr),
              "Cast");
      }));
      rows->push_back(Row("accumulate", {{"dtype", "bf16"}, {"offset", mode}}, 3 * 2, [&] {
        Check(dev_->Accumulate(at(0, f32_off, DType::kBF16), at(1, 1, DType::kBF16),
                               DType::kBF16, n, nullptr),
              "Accumulate");
      }));
    }
    bool* finite = reinterpret_cast<bool*>(host_result_.as<char>() + 64);
    rows->push_back(Row("all_finite", {{"dtype", "bf16"}, {"offset", "offset1"}}, 2, [&] {
      Check(dev_->AllFinite(at(0, 1, DType::kBF16), DType::kBF16, n, finite, nullptr),
            "AllFinite");
    }));
  }

  json Row(const char* kernel, json args, size_t bytes_per_element,
           const std::function<void()>& fn) {
    const std::vector<double> t = EventTimes(reps_, fn);
    const double gbps = static_cast<double>(bytes_per_element) * n_ / Median(t) / 1e9;
    json row = {{"kernel", kernel}};
    for (auto it = args.begin(); it != args.end(); ++it) row[it.key()] = it.value();
    row["bytes_per_element"] = bytes_per_element;
    row["median_ms"] = Median(t) * 1e3;
    row["best_ms"] = t.front() * 1e3;
    row["gb_per_s"] = gbps;
    row["elements_per_s"] = n_ / Median(t);
    row["fraction_of_d2d_copy"] = gbps / copy_gbps_;
    Progress(kernel, args.dump(), t, gbps / copy_gbps_);
    return row;
  }

  void Progress(const char* what, const std::string& args, const std::vector<double>& t,
                double fraction = 1.0) {
    std::fprintf(stderr, "cuda_bench: n=%zu %s %s: median %.3f ms, %.2f of d2d copy\n", n_, what,
                 args.c_str(), Median(t) * 1e3, fraction);
  }

  Device* dev_;
  size_t n_;
  int reps_;
  memory::Allocation arrays_[kArrays];  // each (n) fp32 bytes, any dtype viewed in place
  memory::Allocation host_result_;      // pinned: the norm and finite flag, kept asynchronous
  double copy_gbps_ = 0;
};

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
    const std::vector<double> pin = EventTimes(reps, copy(pinned.get()));
    const std::vector<double> page = EventTimes(reps, copy(pageable.get()));
    const std::vector<double> raw = EventTimes(reps, [&] {
      CheckCuda(h2d ? cudaMemcpyAsync(dbuf.get(), pinned.get(), bytes, cudaMemcpyHostToDevice,
                                      nullptr)
                    : cudaMemcpyAsync(pinned.get(), dbuf.get(), bytes, cudaMemcpyDeviceToHost,
                                      nullptr),
                "cudaMemcpyAsync");
    });
    const double raw_gbps = bytes / Median(raw) / 1e9;
    const double pin_gbps = bytes / Median(pin) / 1e9;
    const double page_gbps = bytes / Median(page) / 1e9;
    std::fprintf(stderr, "cuda_bench: %s %zu bytes: pinned %.1f GB/s, raw %.1f GB/s\n",
                 h2d ? "h2d" : "d2h", bytes, pin_gbps, raw_gbps);
    out.push_back({{"direction", h2d ? "h2d" : "d2h"},
                   {"bytes", bytes},
                   {"pinned_copy_gb_per_s", pin_gbps},
                   {"pageable_copy_gb_per_s", page_gbps},
                   {"raw_cudamemcpy_gb_per_s", raw_gbps},
                   {"best_raw_cudamemcpy_gb_per_s", bytes / raw.front() / 1e9},
                   {"pinned_fraction_of_raw", pin_gbps / raw_gbps},
                   {"pageable_fraction_of_raw", page_gbps / raw_gbps}});
  }
  return out;
}

// Microseconds per call of `call` (median and best of `reps` bursts of `calls` on `stream`).
json HostCallRow(const char* name, cudaStream_t stream, int reps, int calls,
                 const std::function<void()>& call) {
  std::vector<double> us;
  for (int r = 0; r < reps + 1; ++r) {
    CheckCuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    const auto t0 = std::chrono::steady_clock::now();
    for (int k = 0; k < calls; ++k) call();
    const auto t1 = std::chrono::steady_clock::now();
    if (r > 0) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / calls);
  }
  CheckCuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  std::sort(us.begin(), us.end());
  std::fprintf(stderr, "cuda_bench: host call %s: %.2f us (best %.2f)\n", name, Median(us),
               us.front());
  return {{"call", name}, {"us_per_call_median", Median(us)}, {"us_per_call_best", us.front()}};
}

json BenchHostCalls(Device* dev, int reps) {
  const int calls = 200;
  absl::StatusOr<Device::Stream> created = dev->CreateStream();
  Check(created.status(), "CreateStream");
  const Device::Stream s = *created;
  const cudaStream_t cs = static_cast<cudaStream_t>(s);
  absl::StatusOr<Device::Event> event = dev->CreateEvent();
  Check(event.status(), "CreateEvent");
  const cudaEvent_t ev = static_cast<cudaEvent_t>(*event);
  memory::Allocation buf = Alloc(dev, memory::MemoryKind::kDevice, 256);
  void* const p = buf.get();
  json out = json::array();
  out.push_back(HostCallRow("cudaPointerGetAttributes", cs, reps, calls, [&] {
    cudaPointerAttributes attr;
    CheckCuda(cudaPointerGetAttributes(&attr, p), "cudaPointerGetAttributes");
  }));
  out.push_back(HostCallRow("cudaEventRecord", cs, reps, calls,
                            [&] { CheckCuda(cudaEventRecord(ev, cs), "cudaEventRecord"); }));
  out.push_back(HostCallRow("cudaStreamWaitEvent", cs, reps, calls, [&] {
    CheckCuda(cudaStreamWaitEvent(cs, ev, 0), "cudaStreamWaitEvent");
  }));
  out.push_back(HostCallRow("cudaMemsetAsync 256 B", cs, reps, calls, [&] {
    CheckCuda(cudaMemsetAsync(p, 0, 256, cs), "cudaMemsetAsync");
  }));
  out.push_back(HostCallRow("Device::Record", cs, reps, calls,
                            [&] { Check(dev->Record(*event, s), "Record"); }));
  out.push_back(HostCallRow("Device::Wait", cs, reps, calls,
                            [&] { Check(dev->Wait(s, *event), "Wait"); }));
  out.push_back(HostCallRow("Device::Zero 256 B", cs, reps, calls,
                            [&] { Check(dev->Zero(p, 256, s), "Zero"); }));
  out.push_back(HostCallRow("Device::Scale 64 fp32", cs, reps, calls,
                            [&] { Check(dev->Scale(p, DType::kF32, 64, 1.0f, s), "Scale"); }));
  dev->DestroyEvent(*event);
  dev->DestroyStream(s);
  return out;
}

int Main(int argc, char** argv) {
  Options opt;
  if (!ParseArgs(argc, argv, &opt)) return 2;
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
  doc["limit"] =
      "kernels: fraction_of_d2d_copy = the kernel's bytes read + written per second / a "
      "device-to-device cudaMemcpyAsync's of 4n bytes in the same run (goal >= 0.8); "
      "transfers: pinned_fraction_of_raw = Device::Copy / bare cudaMemcpyAsync (goal ~1)";
  json sizes = json::array();
  for (size_t n : opt.elements) {
    size_t free_bytes = 0, total_bytes = 0;
    CheckCuda(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
    if (SizeBench::BytesNeeded(n) > free_bytes) {
      sizes.push_back({{"elements", n},
                       {"skipped", absl::StrCat("needs ", SizeBench::BytesNeeded(n) >> 20,
                                                " MiB of GPU memory, ", free_bytes >> 20,
                                                " MiB free")}});
      continue;
    }
    const int reps = opt.quick ? 3 : (n >= 500000000 ? 5 : 10);
    SizeBench b(dev, n, reps);
    sizes.push_back(b.Run());
  }
  doc["sizes"] = std::move(sizes);
  if (opt.transfers) {
    doc["transfers"] = BenchTransfers(dev, opt.quick ? (size_t{1} << 24) : (size_t{1} << 28),
                                      opt.quick ? 3 : 10);
    doc["host_calls"] = BenchHostCalls(dev, opt.quick ? 3 : 10);
  }
  std::printf("%s\n", doc.dump(2).c_str());
  return 0;
}

}  // namespace
}  // namespace zerort

int main(int argc, char** argv) { return zerort::Main(argc, argv); }
