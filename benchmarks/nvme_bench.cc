// nvme_bench: NVMe offload I/O (nvme/io.h) on the optimizer step's access pattern,
// against fio run by the benchmark on the same file with the same block size, queue depth,
// thread count and O_DIRECT; then the optimizer step over NVMe-resident state against the same
// step over host-resident state and against the pure I/O time of the state.
//
// A virtual disk's bandwidth drifts by tens of percent from one second to the next, so each
// round measures every contender back to back (rotating which goes first) on the very same file
// (same extents, same host-cache history); a ratio is the median of the per-round ratios, with
// their range. Contenders: ours from the engine's pinned slabs (huge pages, memory/arena.cc);
// ours from 4 KiB pages (the control that shows what the huge pages are worth); fio with its
// default buffers (4 KiB pages); fio with hugetlb buffers (--mem=shmhuge) where reserved huge
// pages exist (`sysctl vm.nr_hugepages=32`), else null.
//
// Patterns, each in fio's layout (queue_depth x threads buffers of one block, one request per
// block, all in flight), which is also fio's buffer footprint: on a virtual disk the host copies
// each block into guest memory, and that copy is measurably faster into a few MiB that stay in
// cache than into tens of MiB (docs/offload.md), so a larger footprint is a different pattern.
//   write: blocks written in order                                      fio rw=write
//   read:  blocks read in order                                         fio rw=read
//   step:  reads and writes alternating, each sequential                fio rw=rw, rwmixread=50
// and the read in the step's own layout (three slots of chunk_mib, as NvmeState reads a unit's
// master|m|v into), against the same fio read. Goal: ours >= 0.9 of fio's for each pattern.
//
//   nvme_bench [--quick] [--dir=/tmp] [--mib=1024] [--chunk_mib=12] [--block_kib=1024]
//              [--queue_depth=8] [--threads=1] [--steps=9] [--params=33554432]
//              [--piece_elements=0] [--reps=7]
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status.h"
#include "benchmarks/bench_util.h"
#include "nlohmann/json.hpp"
#include "device/cpu_device.h"
#include "memory/arena.h"
#include "nvme/io.h"
#include "nvme/state.h"
#include "offload/pipeline.h"

namespace zerort {
namespace {

using nvme::AioEngine;
using nvme::IoBuffer;
using nvme::IoOp;
using nvme::SwapFile;

struct Flags {
  bool quick = false;
  std::string dir = "/tmp";
  int64_t mib = 1024;
  int64_t chunk_mib = 12;
  int64_t block_kib = 1024;
  int queue_depth = 8;
  int threads = 1;
  int steps = 9;
  int64_t params = int64_t{1} << 25;  // the step's model: this many parameters in 16 units
  int64_t piece_elements = 0;         // NVMe pieces (memory::NvmePieces); 0: whole units
  int reps = 7;                       // (ours, fio) pairs per pattern
};

bool ParseFlags(int argc, char** argv, Flags* f) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* name, auto* out) {
      const std::string prefix = absl::StrCat("--", name, "=");
      if (a.rfind(prefix, 0) != 0) return false;
      return absl::SimpleAtoi(a.substr(prefix.size()), out);
    };
    if (a == "--quick") {
      f->quick = true;
    } else if (a.rfind("--dir=", 0) == 0) {
      f->dir = a.substr(6);
    } else if (!(value("mib", &f->mib) || value("chunk_mib", &f->chunk_mib) ||
                 value("block_kib", &f->block_kib) || value("queue_depth", &f->queue_depth) ||
                 value("threads", &f->threads) || value("steps", &f->steps) ||
                 value("params", &f->params) || value("piece_elements", &f->piece_elements) ||
                 value("reps", &f->reps))) {
      std::fprintf(stderr,
                   "usage: nvme_bench [--quick] [--dir=D] [--mib=N] [--chunk_mib=N] "
                   "[--block_kib=N] [--queue_depth=N] [--threads=N] [--steps=N] [--params=N] [--piece_elements=N] [--reps=N]\n");
      return false;
    }
  }
  if (f->quick) {
    if (const char* t = std::getenv("TEST_TMPDIR")) f->dir = t;
    f->mib = 32;
    f->chunk_mib = 4;
    f->steps = 2;
    f->params = int64_t{1} << 18;
    f->reps = 1;
  }
  if (f->reps < 1 || f->steps < 1) {
    std::fprintf(stderr, "nvme_bench: --reps and --steps must be >= 1\n");
    return false;
  }
  return true;
}

// Our bandwidth (bytes moved / s) for `pattern` over the whole file: requests of `request`
// bytes, request k into buffer k mod N of the N `bufs`, all N in flight (a buffer is reused once
// its request has completed). "step" alternates reads and writes, each direction sequential
// from the start of the file, as fio's rw=rw with rwmixread=50 does, moving the file's size.
absl::StatusOr<double> OurBandwidth(AioEngine* io, const SwapFile* file, int64_t request,
                                    const std::string& pattern, const std::vector<char*>& bufs) {
  const int64_t n = file->bytes() / request;
  std::vector<AioEngine::Ticket> pending(bufs.size(), 0);
  int64_t next[2] = {0, 0};  // the next offset of reads, of writes
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t k = 0; k < n; ++k) {
    const size_t slot = static_cast<size_t>(k) % bufs.size();
    if (pending[slot] != 0) RETURN_IF_ERROR(io->Wait(pending[slot]));
    const IoOp op = pattern == "read"    ? IoOp::kRead
                    : pattern == "write" ? IoOp::kWrite
                                         : (k % 2 == 0 ? IoOp::kRead : IoOp::kWrite);
    int64_t& offset = next[op == IoOp::kWrite ? 1 : 0];
    pending[slot] = io->Submit({{op, file, offset, bufs[slot], request}});
    offset += request;
  }
  for (AioEngine::Ticket t : pending) {
    if (t != 0) RETURN_IF_ERROR(io->Wait(t));
  }
  return static_cast<double>(n * request) / bench::SecondsSince(t0);
}

// fio's bandwidth (bytes / s, read + write) for the same pattern on `file`, or a negative value.
// With `huge`, fio's buffers are hugetlb pages (--mem=shmhuge), which exist only where the
// administrator reserved them (vm.nr_hugepages).
double FioBandwidth(const Flags& f, const std::string& pattern, const std::string& file,
                    int64_t bytes, bool huge) {
  const std::string rw = absl::StrCat(pattern == "step" ? "rw --rwmixread=50" : pattern,
                                      huge ? " --mem=shmhuge" : "");
  const int64_t per_job = bytes / f.threads / 4096 * 4096;
  const std::string cmd = absl::StrFormat(
      "fio --name=nvme_bench --filename=%s --ioengine=io_uring --direct=1 --rw=%s --bs=%dk "
      "--iodepth=%d --numjobs=%d --size=%d --offset_increment=%d --group_reporting "
      "--output-format=json 2>/dev/null",
      file, rw, f.block_kib, f.queue_depth, f.threads, per_job, per_job);
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return -1;
  std::string out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  pclose(p);
  const size_t brace = out.find('{');
  if (brace == std::string::npos) return -1;
  auto j = nlohmann::json::parse(out.substr(brace), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return -1;
  const auto& job = j["jobs"][0];
  return job["read"]["bw_bytes"].get<double>() + job["write"]["bw_bytes"].get<double>();
}

// The optimizer step of OffloadPipeline over `f.params` bf16 parameters in 16 equal units on
// the CPU device, with master/m/v in host memory (CPU offload) and in a swap file (NVMe
// offload), and the pure I/O of the NVMe step: NvmeState's reads and writes of the same units
// through the same slots with no AdamW between them. Median milliseconds per step.
absl::StatusOr<nlohmann::ordered_json> StepRows(const Flags& f, const nvme::AioOptions& aio) {
  constexpr int kUnits = 16;
  const int64_t n = f.params / kUnits / 1024 * 1024;
  auto dev = CreateCpuDevice(CpuDeviceOptions());
  ASSIGN_OR_RETURN(Device::Stream stream, dev->CreateStream());
  std::vector<uint16_t> grads(n * kUnits, 0x3c00), params(n * kUnits);  // bf16
  std::vector<float> host(3 * n * kUnits, 0.0f);                         // master | m | v
  std::vector<int64_t> sizes(kUnits, n);
  std::vector<uint16_t> staging(2 * 2 * n);
  ASSIGN_OR_RETURN(auto io, AioEngine::Create(aio));
  ASSIGN_OR_RETURN(auto dir, nvme::SwapDir::Create(f.dir, absl::StrCat(getpid(), "-step"), 0));
  ASSIGN_OR_RETURN(auto file, dir->CreateFile("optimizer_state",
                                              nvme::NvmeState::FileBytes(sizes, f.piece_elements)));
  const int64_t slot = nvme::NvmeState::SlotBytes(sizes, f.piece_elements);
  ASSIGN_OR_RETURN(IoBuffer slots, IoBuffer::Allocate(nvme::NvmeState::kSlots * slot));
  ASSIGN_OR_RETURN(auto nvme, nvme::NvmeState::Create(io.get(), file.get(), sizes,
                                                         f.piece_elements, slots.data(), slot));
  for (int u = 0; u < kUnits; ++u) RETURN_IF_ERROR(nvme->Store(u, nullptr, nullptr, nullptr));
  std::unique_ptr<offload::OffloadPipeline> pipes[2];
  for (int on_disk = 0; on_disk < 2; ++on_disk) {
    std::vector<offload::PipelineRegion> regions;
    for (int u = 0; u < kUnits; ++u) {
      float* h = host.data() + 3 * n * u;
      regions.push_back({grads.data() + n * u, on_disk ? nullptr : h, on_disk ? nullptr : h + n,
                         on_disk ? nullptr : h + 2 * n, params.data() + n * u, n});
    }
    offload::PipelineOptions o;
    o.staging = reinterpret_cast<char*>(staging.data());
    o.chunks = 2;
    o.chunk_elements = 2 * n;
    o.cpu_threads = 1;
    o.nvme = on_disk ? nvme.get() : nullptr;
    ASSIGN_OR_RETURN(pipes[on_disk], offload::OffloadPipeline::Create(dev.get(), regions, o,
                                                                       stream));
  }
  offload::OffloadPipeline::Hooks hooks;
  hooks.before_gather = [&](Device::Event e) { return dev->WaitHost(e); };
  hooks.gather = [](int) { return absl::OkStatus(); };
  std::vector<double> ms[3];  // cpu offload, nvme offload, pure I/O
  for (int t = 1; t <= f.steps + 1; ++t) {  // interleaved; the first round is a warm-up
    ASSIGN_OR_RETURN(offload::AdamWStepParams p,
                     offload::MakeAdamWStepParams(1e-3, 0.9, 0.95, 1e-8, 0.1, t));
    for (int turn = 0; turn < 3; ++turn) {  // NVMe and pure I/O alternate which goes first
      const int k = turn == 0 ? 0 : (t % 2 == 0 ? turn : 3 - turn);
      const auto t0 = std::chrono::steady_clock::now();
      if (k < 2) {
        RETURN_IF_ERROR(pipes[k]->Update(p, 1.0f, hooks).status());
        RETURN_IF_ERROR(pipes[k]->JoinUploads(stream));
        RETURN_IF_ERROR(dev->Synchronize(stream));
      } else {
        RETURN_IF_ERROR(nvme->Begin());
        for (int i = 0; i < static_cast<int>(nvme->pieces().size()); ++i) {
          RETURN_IF_ERROR(nvme->Acquire(i).status());
          RETURN_IF_ERROR(nvme->Release(i));
        }
        RETURN_IF_ERROR(nvme->Finish());
      }
      if (t > 1) ms[k].push_back(1e3 * bench::SecondsSince(t0));
    }
  }
  for (auto& p : pipes) p.reset();
  dev->DestroyStream(stream);
  const double cpu = bench::Median(ms[0]), disk = bench::Median(ms[1]), pure = bench::Median(ms[2]);
  const double state_bytes = nvme::NvmeState::FileBytes(sizes, f.piece_elements);  // read + write
  std::vector<double> over_pure;  // per round: the three ran back to back
  for (size_t i = 0; i < ms[1].size(); ++i) over_pure.push_back(ms[1][i] / ms[2][i]);
  return nlohmann::ordered_json{
      {"params", n * kUnits}, {"units", kUnits}, {"pieces", nvme->pieces().size()},
      {"state_bytes_moved", state_bytes},
      {"cpu_offload_ms", cpu}, {"nvme_offload_ms", disk}, {"pure_io_ms", pure},
      {"nvme_over_pure_io", bench::Median(over_pure)},
      {"nvme_over_pure_io_range",
       {*std::min_element(over_pure.begin(), over_pure.end()),
        *std::max_element(over_pure.begin(), over_pure.end())}},
      {"nvme_over_cpu", disk / cpu}, {"pure_io_mb_s", state_bytes / pure / 1e3}};
}

// The control's buffers: 4 KiB pages, as fio's malloc gives them (MADV_NOHUGEPAGE before the
// first touch overrides HostAllocator's huge pages), locked like the pinned slabs where
// RLIMIT_MEMLOCK allows. Shows what the huge pages of our slabs are worth (memory/arena.cc).
absl::StatusOr<memory::Allocation> SmallPages(int64_t bytes, bool* locked) {
  ASSIGN_OR_RETURN(memory::Allocation a,
                   memory::Allocation::Create(memory::HostAllocator(), static_cast<size_t>(bytes)));
  madvise(a.get(), static_cast<size_t>(bytes), MADV_NOHUGEPAGE);
  *locked = mlock(a.get(), static_cast<size_t>(bytes)) == 0;
  std::memset(a.get(), 7, static_cast<size_t>(bytes));
  return a;
}

// The first line of a sysfs file, or null.
nlohmann::ordered_json SysfsLine(const std::string& path) {
  FILE* fp = std::fopen(path.c_str(), "r");
  if (fp == nullptr) return nullptr;
  char line[256] = {0};
  const bool ok = std::fgets(line, sizeof line, fp) != nullptr;
  std::fclose(fp);
  if (!ok) return nullptr;
  std::string text = line;
  while (!text.empty() && text.back() == '\n') text.pop_back();
  return text;
}

// What decides whether a request is split (max_segments of 4 KiB pages, max_sectors_kb) for the
// block device under `dir`, and whether huge pages are available: the context of the ratios.
nlohmann::ordered_json DiskFacts(const std::string& dir) {
  struct stat st;
  nlohmann::ordered_json facts = {{"transparent_hugepage",
                                   SysfsLine("/sys/kernel/mm/transparent_hugepage/enabled")}};
  if (stat(dir.c_str(), &st) != 0) return facts;
  const std::string dev = absl::StrCat("/sys/dev/block/", major(st.st_dev), ":", minor(st.st_dev));
  for (const char* key : {"max_segments", "max_sectors_kb"}) {
    nlohmann::ordered_json v = SysfsLine(dev + "/queue/" + key);
    if (v.is_null()) v = SysfsLine(dev + "/../queue/" + key);  // a partition: its disk's queue
    facts[key] = v;
  }
  return facts;
}

// Whether fio can get hugetlb buffers for `f`'s queue: enough free reserved huge pages.
bool HugetlbFree(const Flags& f) {
  std::ifstream meminfo("/proc/meminfo");
  int64_t free_pages = 0, page_kib = 0;
  for (std::string line; std::getline(meminfo, line);) {
    std::sscanf(line.c_str(), "HugePages_Free: %ld", &free_pages);
    std::sscanf(line.c_str(), "Hugepagesize: %ld kB", &page_kib);
  }
  return free_pages * page_kib >= (f.block_kib * f.queue_depth + 2048) * f.threads;
}

// Where our requests land: `ours` (slabs of the pinned cache) and, for the control, `small`
// (4 KiB pages; empty: no control), `request` bytes each.
struct Layout {
  std::string name;
  int64_t request = 0;
  std::vector<char*> ours, small;
};

// Side by side on one file, `f.reps` rounds rotating which goes first: ours, ours from 4 KiB
// pages, fio (its default malloc buffers) and, where hugetlb pages are reserved, fio with
// huge-page buffers. Ratios are per round.
absl::StatusOr<nlohmann::ordered_json> PatternRow(const Flags& f, const std::string& pattern,
                                                  AioEngine* io, const SwapFile* file,
                                                  const Layout& l) {
  constexpr int kOurs = 0, kSmall = 1, kFio = 2, kFioHuge = 3;
  std::vector<int> order = {kOurs, kFio};
  if (!l.small.empty()) order.push_back(kSmall);
  if (HugetlbFree(f)) order.push_back(kFioHuge);
  std::vector<double> mb_s[4], ratios[3];  // ours/fio, small/fio, ours/fio_huge
  for (int rep = 0; rep < f.reps; ++rep) {
    double bw[4] = {-1, -1, -1, -1};
    for (size_t turn = 0; turn < order.size(); ++turn) {
      const int k = order[(turn + rep) % order.size()];
      if (k >= kFio) {
        bw[k] = FioBandwidth(f, pattern, file->path(), file->bytes(), k == kFioHuge);
      } else {
        ASSIGN_OR_RETURN(bw[k], OurBandwidth(io, file, l.request, pattern,
                                             k == kOurs ? l.ours : l.small));
      }
    }
    for (int k = 0; k < 4; ++k) {
      if (bw[k] > 0) mb_s[k].push_back(bw[k] / 1e6);
    }
    if (bw[kFio] > 0) ratios[0].push_back(bw[kOurs] / bw[kFio]);
    if (bw[kFio] > 0 && bw[kSmall] > 0) ratios[1].push_back(bw[kSmall] / bw[kFio]);
    if (bw[kFioHuge] > 0) ratios[2].push_back(bw[kOurs] / bw[kFioHuge]);
  }
  auto median_or_null = [](const std::vector<double>& v) {
    return v.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(bench::Median(v));
  };
  auto range_or_null = [](const std::vector<double>& v) {
    if (v.empty()) return nlohmann::ordered_json(nullptr);
    return nlohmann::ordered_json{*std::min_element(v.begin(), v.end()),
                                  *std::max_element(v.begin(), v.end())};
  };
  return nlohmann::ordered_json{
      {"pattern", pattern}, {"buffers", l.name}, {"ours_mb_s", median_or_null(mb_s[kOurs])},
      {"fio_mb_s", median_or_null(mb_s[kFio])}, {"ratio", median_or_null(ratios[0])},
      {"ratio_range", range_or_null(ratios[0])},
      {"small_pages_mb_s", median_or_null(mb_s[kSmall])},
      {"small_pages_ratio", median_or_null(ratios[1])},
      {"small_pages_ratio_range", range_or_null(ratios[1])},
      {"fio_hugetlb_mb_s", median_or_null(mb_s[kFioHuge])},
      {"hugetlb_ratio", median_or_null(ratios[2])},
      {"hugetlb_ratio_range", range_or_null(ratios[2])}, {"rounds", f.reps}};
}

absl::Status Run(const Flags& f) {
  const int64_t chunk = f.chunk_mib << 20;
  const int64_t block = f.block_kib * 1024;
  const int64_t bytes = (f.mib << 20) / chunk * chunk;
  nvme::AioOptions o;
  o.block_size = block;
  o.queue_depth = f.queue_depth;
  o.thread_count = f.threads;
  ASSIGN_OR_RETURN(auto io, AioEngine::Create(o));
  ASSIGN_OR_RETURN(auto dir, nvme::SwapDir::Create(f.dir, absl::StrCat("bench", getpid()), 0));
  ASSIGN_OR_RETURN(auto file, dir->CreateFile("state", bytes));
  // fio's layout: queue_depth x threads buffers of one block, one request each. The step's
  // layout: three unit-sized slots (NvmeState's), one request of `chunk` bytes each.
  const int fio_buffers = f.queue_depth * f.threads;
  ASSIGN_OR_RETURN(IoBuffer fio_like, IoBuffer::Allocate(fio_buffers * block));
  ASSIGN_OR_RETURN(IoBuffer slots, IoBuffer::Allocate(3 * chunk));
  bool small_locked = false;
  ASSIGN_OR_RETURN(memory::Allocation small_pages, SmallPages(fio_buffers * block, &small_locked));
  std::memset(fio_like.data(), 1, fio_like.bytes());
  std::memset(slots.data(), 2, slots.bytes());
  Layout fio_layout{"fio's: queue_depth x threads blocks", block, {}, {}};
  for (int i = 0; i < fio_buffers; ++i) {
    fio_layout.ours.push_back(fio_like.data() + i * block);
    fio_layout.small.push_back(small_pages.as<char>() + i * block);
  }
  Layout slot_layout{"three unit slots of chunk_bytes", chunk, {}, {}};
  for (int i = 0; i < 3; ++i) slot_layout.ours.push_back(slots.data() + i * chunk);
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  // Writes first: reads of never-written (fallocated) extents return zeros without touching
  // the device.
  for (const char* pattern : {"write", "read", "step"}) {
    ASSIGN_OR_RETURN(nlohmann::ordered_json row,
                     PatternRow(f, pattern, io.get(), file.get(), fio_layout));
    rows.push_back(std::move(row));
  }
  ASSIGN_OR_RETURN(nlohmann::ordered_json slot_row,
                   PatternRow(f, "read", io.get(), file.get(), slot_layout));
  rows.push_back(std::move(slot_row));
  nlohmann::ordered_json head = {
      {"benchmark", "nvme_bench"}, {"dir", f.dir}, {"bytes", bytes}, {"chunk_bytes", chunk},
      {"block_size", o.block_size}, {"queue_depth", f.queue_depth}, {"threads", f.threads},
      {"goal", "ours >= 0.9 of fio per pattern; step time <= 1.1 x pure I/O time"},
      {"disk", DiskFacts(f.dir)}, {"small_pages_locked", small_locked}, {"io", rows}};
  ASSIGN_OR_RETURN(head["step"], StepRows(f, o));
  std::printf("%s\n", head.dump(2).c_str());
  return absl::OkStatus();
}

}  // namespace
}  // namespace zerort

int main(int argc, char** argv) {
  zerort::Flags f;
  if (!zerort::ParseFlags(argc, argv, &f)) return 2;
  const absl::Status s = zerort::Run(f);
  if (!s.ok()) {
    std::fprintf(stderr, "nvme_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
