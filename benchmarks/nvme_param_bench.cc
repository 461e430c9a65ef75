// nvme_param_bench: the stage-3 forward pass with the parameter shards on NVMe
// (offload_param "nvme", read ahead into offload_param.buffer_count pinned buffers) against the
// same pass with them in host memory (offload_param "cpu"), and the two things it cannot beat:
// the compute plus the gather overhead (the host-parameter pass) and the pure read of every
// shard. Limit: NVMe forward / max(host-parameter forward, pure read) = 1 when the reads hide
// completely behind the compute (or the compute behind the reads).
//
//   nvme_param_bench [--quick] [--dir=/tmp] [--units=32] [--min_params=1048576]
//                    [--max_params=4194304] [--compute_passes=4] [--reps=5]
//                    [--buffer_elements=100000000]
//
// The model: `units` layers of one bf16 parameter each, layer k of min + (max - min) * (k % 4)
// / 3 elements, each its own unit (stage 3, world 1, in-process communicator, CPU device, one
// thread, optimizer offload "cpu", no persistent units, stage3_prefetch_bucket_size 0: the
// only gathers are the ones the pass asks for, one slot). A forward pass: for each layer in
// order AcquireParams, `compute_passes` sweeps of multiply-adds over its gathered parameters
// (the layer's compute), ReleaseParams. Rows, medians of `reps` repetitions taken in turn
// (each NVMe engine and the pure read's file created afresh in every repetition, with one
// untimed pass first):
// host-parameter forward; NVMe forward at buffer_count 1, 2 and 5 (the hit rate is the share
// of pieces a gather found read ahead, complete or still in flight); compute only (the same
// sweeps over a host buffer); pure read (NvmeParams reads of every shard in the same order with
// read-ahead through 5 buffers one unit ahead and as deep as they allow, no compute, no copy;
// the bound takes the faster).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "benchmarks/bench_util.h"
#include "comm/inprocess.h"
#include "device/cpu_device.h"
#include "nlohmann/json.hpp"
#include "nvme/io.h"
#include "nvme/params.h"
#include "zero/engine.h"

namespace zerort {
namespace {

struct Flags {
  bool quick = false;
  std::string dir = "/tmp";
  int units = 32;
  int64_t min_params = int64_t{1} << 20;
  int64_t max_params = int64_t{4} << 20;
  int compute_passes = 4;
  int reps = 5;
  int64_t buffer_elements = 100000000;  // offload_param.buffer_size (DeepSpeed's default)
};

bool ParseFlags(int argc, char** argv, Flags* f) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* name, auto* out) {
      const std::string prefix = absl::StrCat("--", name, "=");
      return a.rfind(prefix, 0) == 0 && absl::SimpleAtoi(a.substr(prefix.size()), out);
    };
    if (a == "--quick") {
      f->quick = true;
    } else if (a.rfind("--dir=", 0) == 0) {
      f->dir = a.substr(6);
    } else if (!(value("units", &f->units) || value("min_params", &f->min_params) ||
                 value("max_params", &f->max_params) ||
                 value("compute_passes", &f->compute_passes) || value("reps", &f->reps) ||
                 value("buffer_elements", &f->buffer_elements))) {
      std::fprintf(stderr,
                   "usage: nvme_param_bench [--quick] [--dir=D] [--units=N] [--min_params=N] "
                   "[--max_params=N] [--compute_passes=N] [--reps=N] [--buffer_elements=N]\n");
      return false;
    }
  }
  if (f->quick) {
    if (const char* t = std::getenv("TEST_TMPDIR")) f->dir = t;
    f->units = 6;
    f->min_params = 16384;
    f->max_params = 65536;
    f->reps = 2;
  }
  if (f->units < 1 || f->min_params < 1 || f->max_params < f->min_params || f->reps < 1 ||
      f->compute_passes < 0) {
    std::fprintf(stderr, "nvme_param_bench: need units, reps >= 1, 1 <= min_params <= "
                         "max_params, compute_passes >= 0\n");
    return false;
  }
  return true;
}

double MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

std::vector<memory::ParamSpec> Model(const Flags& f) {
  std::vector<memory::ParamSpec> specs;
  for (int k = 0; k < f.units; ++k) {
    const int64_t n = f.min_params + (f.max_params - f.min_params) * (k % 4) / 3;
    specs.push_back({absl::StrCat("layer", k, ".w"), {n}, absl::StrCat("layer", k)});
  }
  return specs;
}

// The layer's compute: `passes` sweeps of multiply-adds over n bf16 values (8 independent
// sums, so the sweep runs at the core's speed rather than one add's latency).
float Compute(const uint16_t* x, int64_t n, int passes) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int p = 0; p < passes; ++p) {
    const float w = 1.0f + 1e-3f * static_cast<float>(p);
    for (int64_t i = 0; i + 8 <= n; i += 8) {
      for (int j = 0; j < 8; ++j) {
        uint32_t bits = static_cast<uint32_t>(x[i + j]) << 16;
        float v;
        std::memcpy(&v, &bits, 4);
        acc[j] += v * w;
      }
    }
  }
  float s = 0;
  for (float a : acc) s += a;
  return s;
}

volatile float g_sink = 0;  // keeps the compute from being optimised away

struct EngineRun {
  std::unique_ptr<comm::Communicator> comm;
  std::unique_ptr<Engine> engine;
  int64_t pieces_per_pass = 0;  // NVMe: parameter pieces one pass reads
};

Config BenchConfig(const Flags& f, OffloadDevice param_device, int buffer_count) {
  Config c;
  c.zero.stage = 3;
  c.compute_dtype = DType::kBF16;
  c.zero.reduce_bucket_size = f.min_params;  // every layer a unit of its own
  c.zero.stage3_param_persistence_threshold = 0;
  c.zero.stage3_prefetch_bucket_size = 0;
  c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.zero.offload_param.device = param_device;
  c.zero.offload_param.nvme_path = f.dir;
  c.zero.offload_param.buffer_count = buffer_count;
  c.zero.offload_param.buffer_size = f.buffer_elements;
  c.cpu_threads = 1;
  return c;
}

absl::StatusOr<EngineRun> MakeEngine(const Flags& f, Device* dev, OffloadDevice param_device,
                                     int buffer_count) {
  EngineRun r;
  ASSIGN_OR_RETURN(auto comms, comm::CreateInProcessGroup(1));
  r.comm = std::move(comms[0]);
  ASSIGN_OR_RETURN(r.engine, Engine::Create(BenchConfig(f, param_device, buffer_count), Model(f),
                                            r.comm.get(), dev));
  const memory::Plan& plan = r.engine->plan();
  if (static_cast<int>(plan.units.size()) != f.units) {
    return absl::InternalError(absl::StrCat("the plan made ", plan.units.size(), " units of ",
                                            f.units, " layers"));
  }
  for (const memory::Buffer& b : plan.buffers) {
    if (b.cls != memory::BufferClass::kNvmeParamBuffers) continue;
    const int64_t piece = b.elements / b.count * 2 / nvme::kIoAlignment * nvme::kIoAlignment;
    for (const memory::Unit& u : plan.units) r.pieces_per_pass += (u.shard * 2 + piece - 1) / piece;
  }
  RETURN_IF_ERROR(r.engine->InitParams([](int index, const memory::ParamSpec& spec, float* v) {
    for (int64_t k = 0; k < spec.numel(); ++k) v[k] = 0.001f * static_cast<float>((k + index) % 97);
  }));
  return r;
}

absl::StatusOr<double> Forward(Engine* e, int passes) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < e->num_params(); ++i) {
    const int ids[1] = {i};
    RETURN_IF_ERROR(e->AcquireParams(ids));
    ASSIGN_OR_RETURN(void* p, e->param(i));
    g_sink = g_sink + Compute(static_cast<const uint16_t*>(p), e->plan().params[i].numel, passes);
    RETURN_IF_ERROR(e->ReleaseParams(ids));
  }
  return MsSince(t0);
}

double ComputeOnly(const Flags& f, const std::vector<uint16_t>& host) {
  const auto t0 = std::chrono::steady_clock::now();
  for (const memory::ParamSpec& s : Model(f)) {
    g_sink = g_sink + Compute(host.data(), s.numel(), f.compute_passes);
  }
  return MsSince(t0);
}

// NvmeParams alone over a file of its own: the shards' bytes read in the forward order, with
// read-ahead through 5 buffers, one unit ahead or as deep as they allow, handed to a sink that
// does nothing. Both depths read the same file, so the file's place on the disk cancels out.
struct PureRead {
  static constexpr int kCount = 5;
  std::unique_ptr<nvme::SwapDir> dir;
  std::unique_ptr<nvme::SwapFile> file;
  std::unique_ptr<nvme::AioEngine> io;
  nvme::IoBuffer buffers;
  std::unique_ptr<nvme::NvmeParams> params;

  absl::Status Init(const Flags& f, const memory::Plan& plan) {
    std::vector<int64_t> bytes;
    int64_t largest = 0;
    units = static_cast<int>(plan.units.size());
    for (const memory::Unit& u : plan.units) {
      bytes.push_back(u.shard * 2);
      largest = std::max(largest, u.shard * 2);
    }
    const int64_t piece = std::min(largest, f.buffer_elements * 2) / nvme::kIoAlignment *
                          nvme::kIoAlignment;
    ASSIGN_OR_RETURN(dir, nvme::SwapDir::Create(f.dir, "pure_read", 0));
    ASSIGN_OR_RETURN(file, dir->CreateFile("param_shard", nvme::NvmeParams::FileBytes(bytes)));
    ASSIGN_OR_RETURN(io, nvme::AioEngine::Create(nvme::AioOptions()));
    ASSIGN_OR_RETURN(buffers, nvme::IoBuffer::Allocate(kCount * piece));
    ASSIGN_OR_RETURN(params, nvme::NvmeParams::Create(io.get(), file.get(), 0, bytes,
                                                         buffers.data(), kCount, piece));
    std::vector<char> data(largest, 1);
    for (int u = 0; u < static_cast<int>(bytes.size()); ++u) {
      RETURN_IF_ERROR(params->Write(u, data.data()));
    }
    params->Invalidate();
    return absl::OkStatus();
  }
  // Reads every shard in forward order (the last unit first), then drops what is left, so
  // each pass starts cold as a forward pass after a step does.
  absl::StatusOr<double> Pass(bool deep) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto none = [](int64_t, const char*, int64_t) { return absl::OkStatus(); };
    for (int u = units - 1; u >= 0; --u) {  // forward: the last unit first
      RETURN_IF_ERROR(params->Read(u, none));
      if (u > 0) params->ReadAhead(u - 1, deep ? -1 : 0);
    }
    const double ms = MsSince(t0);
    params->Invalidate();
    return ms;
  }
  int units = 0;
};

struct Samples {
  std::vector<double> ms;
  std::vector<double> hit_rate;
};

// The rows, in report order. Each repetition creates the NVMe engines and the pure read's file
// afresh: how fast a file reads depends on where it lands on this machine's disk (up to 2x
// between files of one run), and fresh files turn that from a per-row bias into noise the
// medians absorb.
constexpr int kNvmeBuffers[] = {1, 2, 5};
enum Row { kHost, kNvme1, kNvme2, kNvme5, kComputeOnly, kReadOneAhead, kReadDeep, kRows };
const char* const kRowNames[kRows] = {"host_params",  "nvme_buffers_1",      "nvme_buffers_2",
                                      "nvme_buffers_5", "compute_only", "pure_read_one_ahead",
                                      "pure_read_deep"};

struct Bench {
  const Flags& f;
  Device* dev;
  EngineRun host;
  std::vector<uint16_t> compute_input;  // compute only: a host buffer of the largest layer
  std::vector<Samples> samples = std::vector<Samples>(kRows);
};

absl::Status NvmeRow(Bench* b, Row row) {
  ASSIGN_OR_RETURN(EngineRun r,
                   MakeEngine(b->f, b->dev, OffloadDevice::kNvme, kNvmeBuffers[row - kNvme1]));
  // The first pass finds what InitParams' writes left in the buffers: not timed.
  RETURN_IF_ERROR(Forward(r.engine.get(), b->f.compute_passes).status());
  const int64_t hits = r.engine->nvme_param_reads_ahead_used();
  ASSIGN_OR_RETURN(double ms, Forward(r.engine.get(), b->f.compute_passes));
  b->samples[row].ms.push_back(ms);
  b->samples[row].hit_rate.push_back(
      static_cast<double>(r.engine->nvme_param_reads_ahead_used() - hits) /
      static_cast<double>(r.pieces_per_pass));
  return absl::OkStatus();
}

absl::Status ReadRows(Bench* b, int rep) {
  PureRead read;
  RETURN_IF_ERROR(read.Init(b->f, b->host.engine->plan()));
  RETURN_IF_ERROR(read.Pass(true).status());  // untimed, as the engines' first pass
  for (int k = 0; k < 2; ++k) {
    const bool deep = (k + rep) % 2 == 1;
    ASSIGN_OR_RETURN(double ms, read.Pass(deep));
    b->samples[deep ? kReadDeep : kReadOneAhead].ms.push_back(ms);
  }
  return absl::OkStatus();
}

// One repetition of every row, starting at a different one each time so that no row always
// runs right after the same neighbour.
absl::Status Repetition(Bench* b, int rep) {
  const int groups = 6;  // host, the three NVMe engines, compute only, the two pure reads
  for (int k = 0; k < groups; ++k) {
    const int g = (rep + k) % groups;
    if (g == 0) {
      ASSIGN_OR_RETURN(double ms, Forward(b->host.engine.get(), b->f.compute_passes));
      b->samples[kHost].ms.push_back(ms);
    } else if (g <= 3) {
      RETURN_IF_ERROR(NvmeRow(b, static_cast<Row>(kNvme1 + g - 1)));
    } else if (g == 4) {
      b->samples[kComputeOnly].ms.push_back(ComputeOnly(b->f, b->compute_input));
    } else {
      RETURN_IF_ERROR(ReadRows(b, rep));
    }
  }
  return absl::OkStatus();
}

nlohmann::ordered_json Report(const Bench& b) {
  auto median = [&](Row r) { return bench::Median(b.samples[r].ms); };
  const double read_ms = std::min(median(kReadOneAhead), median(kReadDeep));
  const double bound = std::max(median(kHost), read_ms);
  nlohmann::ordered_json results = nlohmann::ordered_json::array();
  for (int i = 0; i < kRows; ++i) {
    nlohmann::ordered_json row = {{"name", kRowNames[i]}, {"ms", median(static_cast<Row>(i))}};
    if (!b.samples[i].hit_rate.empty()) {
      row["read_ahead_hit_rate"] = bench::Median(b.samples[i].hit_rate);
      row["ratio_to_bound"] = median(static_cast<Row>(i)) / bound;
    }
    row["samples_ms"] = b.samples[i].ms;
    results.push_back(row);
  }
  int64_t params = 0;
  for (const memory::ParamSpec& s : Model(b.f)) params += s.numel();
  double load[1] = {0};
  getloadavg(load, 1);
  return nlohmann::ordered_json{
      {"benchmark", "nvme_param_bench"}, {"dir", b.f.dir}, {"units", b.f.units},
      {"params", params}, {"compute_dtype", "bf16"}, {"compute_passes", b.f.compute_passes},
      {"buffer_elements", b.f.buffer_elements}, {"reps", b.f.reps},
      {"gather_overhead_ms", median(kHost) - median(kComputeOnly)}, {"pure_read_ms", read_ms},
      {"bound_ms", bound},
      {"bound", "max(host_params = compute + gather overhead, faster pure_read)"},
      {"load_average_1m", load[0]}, {"results", results}};
}

absl::StatusOr<nlohmann::ordered_json> Run(const Flags& f) {
  CpuDeviceOptions o;
  o.threads = 1;
  std::unique_ptr<Device> dev = CreateCpuDevice(o);
  Bench b{f, dev.get()};
  ASSIGN_OR_RETURN(b.host, MakeEngine(f, dev.get(), OffloadDevice::kCpu, 1));
  b.compute_input.assign(f.max_params, 0x3f80);  // bf16 1.0
  RETURN_IF_ERROR(Forward(b.host.engine.get(), f.compute_passes).status());  // warm-up
  for (int rep = 0; rep < f.reps; ++rep) RETURN_IF_ERROR(Repetition(&b, rep));
  return Report(b);
}

}  // namespace
}  // namespace zerort

int main(int argc, char** argv) {
  zerort::Flags f;
  if (!zerort::ParseFlags(argc, argv, &f)) return 2;
  absl::StatusOr<nlohmann::ordered_json> out = zerort::Run(f);
  if (!out.ok()) {
    std::fprintf(stderr, "nvme_param_bench: %s\n", out.status().ToString().c_str());
    return 1;
  }
  std::printf("%s\n", out->dump(2).c_str());
  return 0;
}
