// Collective bandwidth of the CPU backends, printed as JSON.
//
//   bazel run //benchmarks:comm_bench -- [--quick]            # in-process, 2 and 4 ranks
//   mpirun -np 4 bazel-bin/benchmarks/comm_bench [--quick]    # MPI backend (rank 0 prints)
//   flags: --ranks=2,4 --dtypes=fp32,bf16,fp16 --placement=both|out|in --ops=all_gather,...
//          --min_bytes=N --max_bytes=N --no_kernel
//
// Definitions follow nccl-tests: `bytes` is the all-reduce buffer, the all-gather output, or the
// reduce-scatter input; algbw = bytes / time; busbw = algbw * (n-1)/n for all-gather and
// reduce-scatter, * 2(n-1)/n for all-reduce. Like nccl-tests, every op is timed out of place and
// in place (`in_place` in the JSON). The limit we measure against is a single-thread memcpy of a
// 256 MiB buffer (copy GB/s = bytes copied / time), timed again before every case; for messages
// >= 16 MiB each result carries that figure and busbw / memcpy (goal >= 0.5).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/inprocess.h"
#include "comm/internal/reduce.h"
#include "comm/mpi.h"
#include "nlohmann/json.hpp"

namespace zerort {
namespace comm {
namespace {

using Clock = std::chrono::steady_clock;

// Each size is timed this many times and the best kept: the machine is shared, and the best
// trial is the one least disturbed by other processes (memcpy is measured the same way).
constexpr int kTrials = 3;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double MemcpyGBps(size_t bytes, int reps) {
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  std::memcpy(dst.data(), src.data(), bytes);  // fault the pages in
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = Clock::now();
    std::memcpy(dst.data(), src.data(), bytes);
    best = std::min(best, Seconds(t0, Clock::now()));
  }
  return bytes / best / 1e9;
}

enum class Op { kAllGather, kReduceScatter, kAllReduce };
const char* OpName(Op op) {
  return op == Op::kAllGather ? "all_gather" : op == Op::kReduceScatter ? "reduce_scatter"
                                                                          : "all_reduce";
}

// Per-rank buffers for one message size: `bytes` as nccl-tests defines it. In place (as
// nccl-tests' second column) the send block is the rank's own block of recv (all-gather), recv
// is the rank's block of send (reduce-scatter), or send == recv (all-reduce).
struct Buffers {
  std::vector<char> send, recv;
  const void* send_ptr = nullptr;
  void* recv_ptr = nullptr;
  Buffers(Op op, size_t bytes, int n, int rank, bool in_place) {
    const size_t block = bytes / n;
    if (op == Op::kAllGather) {
      recv.assign(bytes, 0x3c);
      if (!in_place) send.assign(block, 0x3c);
      send_ptr = in_place ? recv.data() + rank * block : send.data();
      recv_ptr = recv.data();
    } else if (op == Op::kReduceScatter) {
      // Small numbers in every dtype: sums stay finite for a while and never go subnormal.
      send.assign(bytes, 0x3c);
      if (!in_place) recv.assign(block, 0);
      send_ptr = send.data();
      recv_ptr = in_place ? send.data() + rank * block : recv.data();
    } else {
      send.assign(bytes, 0x3c);
      if (!in_place) recv.assign(bytes, 0);
      send_ptr = send.data();
      recv_ptr = in_place ? send.data() : recv.data();
    }
  }
};

absl::Status RunOp(Communicator& c, Op op, Buffers& b, size_t bytes, DType t) {
  const size_t es = DTypeSize(t);
  const int n = c.size();
  switch (op) {
    case Op::kAllGather:
      return c.AllGather(b.send_ptr, b.recv_ptr, bytes / n / es, t);
    case Op::kReduceScatter:
      return c.ReduceScatter(b.send_ptr, b.recv_ptr, bytes / n / es, t, ReduceOp::kSum);
    case Op::kAllReduce:
      return c.AllReduce(b.send_ptr, b.recv_ptr, bytes / es, t, ReduceOp::kSum);
  }
  return absl::OkStatus();
}

// Times `iters` back-to-back operations on rank `r`, between two barriers.
// Returns seconds per operation (meaningful on every rank: the barriers align them).
double TimeOnRank(Communicator& c, Op op, Buffers& b, size_t bytes, DType t, int iters) {
  if (!c.Barrier().ok()) return -1;
  const auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) {
    if (!RunOp(c, op, b, bytes, t).ok()) return -1;
  }
  if (!c.Barrier().ok()) return -1;
  return Seconds(t0, Clock::now()) / iters;
}

double BusFactor(Op op, int n) {
  return op == Op::kAllReduce ? 2.0 * (n - 1) / n : static_cast<double>(n - 1) / n;
}

// What to measure; set from the command line.
struct Options {
  bool quick = false;
  std::vector<int> ranks = {2, 4};  // in-process group sizes
  std::vector<DType> dtypes = {DType::kF32, DType::kBF16};  // of the reductions
  std::vector<bool> placements = {false, true};             // out of place, in place
  std::vector<Op> ops = {Op::kAllGather, Op::kReduceScatter, Op::kAllReduce};
  size_t min_bytes = 0, max_bytes = ~size_t{0};
  bool kernel = true;  // the reduce_kernel section (in-process runs only)
};

// One measured configuration, as nccl-tests lists them: op, dtype, out of place or in place.
struct Case {
  Op op;
  DType t;
  bool in_place;
};

std::vector<Case> Cases(const Options& o) {
  std::vector<Case> out;
  for (Op op : o.ops) {
    for (DType t : o.dtypes) {
      // All-gather is pure data movement: one dtype tells all.
      if (op == Op::kAllGather && t != o.dtypes.front()) continue;
      for (bool in_place : o.placements) out.push_back({op, t, in_place});
    }
  }
  return out;
}

nlohmann::json Result(const Case& c, size_t bytes, int n, double sec, double memcpy_gbps) {
  const double algbw = bytes / sec / 1e9;
  const double busbw = algbw * BusFactor(c.op, n);
  nlohmann::json j = {{"op", OpName(c.op)},       {"dtype", std::string(DTypeName(c.t))},
                      {"in_place", c.in_place},   {"bytes", bytes},
                      {"ranks", n},               {"time_us", sec * 1e6},
                      {"algbw_GBps", algbw},      {"busbw_GBps", busbw}};
  if (bytes >= (size_t{16} << 20)) {
    j["memcpy_GBps"] = memcpy_gbps;
    j["busbw_over_memcpy"] = busbw / memcpy_gbps;
  }
  return j;
}

std::vector<size_t> Sizes(const Options& o) {
  // --quick keeps one size per decade and stops at 16 MiB, the smallest size compared with
  // memcpy, so CI still sees the ratio.
  std::vector<size_t> all;
  if (o.quick) {
    all = {size_t{1} << 10, size_t{64} << 10, size_t{1} << 20, size_t{16} << 20};
  } else {
    for (size_t s = 1024; s <= (size_t{256} << 20); s *= 4) all.push_back(s);
  }
  std::vector<size_t> out;
  for (size_t s : all) {
    if (s >= o.min_bytes && s <= o.max_bytes) out.push_back(s);
  }
  return out;
}

int Iters(size_t bytes, bool quick) {
  // Roughly constant time per size: many iterations for small messages, few for large ones.
  const double budget = quick ? 2e8 : 5e8;  // bytes moved per size
  return static_cast<int>(std::clamp(budget / static_cast<double>(bytes), 2.0, quick ? 200.0 : 2000.0));
}

// The reference: one thread copying alone. Under mpirun rank 0 measures while the other ranks
// wait (copies running on every rank at once would share the cores and the memory bandwidth and
// understate it), then tells them the figure. Taken again before every case, so that each ratio
// compares figures measured under the same load (the machine is shared).
double ReferenceGBps(const Options& o, bool mpi) {
  double gbps = 0;
  int rank = 0;
  if (mpi) {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Barrier(MPI_COMM_WORLD);
  }
  if (rank == 0) gbps = MemcpyGBps(o.quick ? (size_t{64} << 20) : (size_t{256} << 20), 5);
  if (mpi) MPI_Bcast(&gbps, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
  return gbps;
}

nlohmann::json BenchInProcess(int n, const Options& o) {
  nlohmann::json results = nlohmann::json::array();
  auto group = CreateInProcessGroup(n);
  if (!group.ok()) return {{"error", group.status().ToString()}};
  for (const Case& c : Cases(o)) {
    const double memcpy_gbps = ReferenceGBps(o, false);
    for (size_t bytes : Sizes(o)) {
      const size_t granule = static_cast<size_t>(n) * 4;
      bytes = bytes / granule * granule;
      std::vector<Buffers> bufs;
      for (int r = 0; r < n; ++r) bufs.emplace_back(c.op, bytes, n, r, c.in_place);
      const int iters = Iters(bytes, o.quick);
      // (trials, n) seconds per operation; the slowest rank defines a trial.
      std::vector<std::vector<double>> sec(kTrials, std::vector<double>(n));
      std::vector<std::thread> threads;
      for (int r = 0; r < n; ++r) {
        threads.emplace_back([&, r] {
          TimeOnRank(*(*group)[r], c.op, bufs[r], bytes, c.t, 1);  // warm-up: page faults
          for (int k = 0; k < kTrials; ++k) {
            sec[k][r] = TimeOnRank(*(*group)[r], c.op, bufs[r], bytes, c.t, iters);
          }
        });
      }
      for (auto& th : threads) th.join();
      double best = 1e30;
      for (auto& trial : sec) best = std::min(best, *std::max_element(trial.begin(), trial.end()));
      results.push_back(Result(c, bytes, n, best, memcpy_gbps));
    }
  }
  return results;
}

nlohmann::json BenchMpi(const Options& o, int* rank_out) {
  nlohmann::json results = nlohmann::json::array();
  auto comm = CreateMpiCommunicator(MPI_COMM_WORLD);
  if (!comm.ok()) return {{"error", comm.status().ToString()}};
  Communicator& c = **comm;
  *rank_out = c.rank();
  const int n = c.size();
  for (const Case& cs : Cases(o)) {
    const double memcpy_gbps = ReferenceGBps(o, true);
    for (size_t bytes : Sizes(o)) {
      const size_t granule = static_cast<size_t>(n) * 4;
      bytes = bytes / granule * granule;
      Buffers b(cs.op, bytes, n, c.rank(), cs.in_place);
      TimeOnRank(c, cs.op, b, bytes, cs.t, 1);
      double best = 1e30;
      for (int k = 0; k < kTrials; ++k) {
        // Every rank must take the same decision: agree on the slowest rank's time.
        double sec = TimeOnRank(c, cs.op, b, bytes, cs.t, Iters(bytes, o.quick));
        MPI_Allreduce(MPI_IN_PLACE, &sec, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        best = std::min(best, sec);
      }
      results.push_back(Result(cs, bytes, n, best, memcpy_gbps));
    }
  }
  return results;
}

// Single-thread throughput of the reduction kernel (each path the CPU has), in GB/s
// of bytes read + written, next to memcpy's (bytes copied): the reduction reads n blocks and
// writes one, so a memory-bound kernel reaches roughly memcpy's figure times (n+1)/2.
nlohmann::json BenchKernel(bool quick) {
  nlohmann::json out = nlohmann::json::array();
  const size_t bytes = quick ? (size_t{8} << 20) : (size_t{64} << 20);
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (int n : {2, 4}) {
      const size_t count = bytes / DTypeSize(t);
      std::vector<std::vector<char>> src(n, std::vector<char>(bytes, 0x3c));
      std::vector<char> dst(bytes);
      std::vector<const void*> ptrs;
      for (auto& s : src) ptrs.push_back(s.data());
      struct Variant {
        internal::ReducePath path;
        bool stream;
      };
      for (Variant v : {Variant{internal::ReducePath::kAvx512, true},
                        Variant{internal::ReducePath::kAvx512, false},
                        Variant{internal::ReducePath::kAvx2, false},
                        Variant{internal::ReducePath::kScalar, false}}) {
        if (!internal::ReducePathSupported(v.path)) continue;
        auto run = [&] {
          internal::ReduceBlocksWith(v.path, v.stream, ptrs.data(), n, dst.data(), count, t,
                                     ReduceOp::kSum);
        };
        run();
        double best = 1e30;
        for (int k = 0; k < 3; ++k) {
          const auto t0 = Clock::now();
          run();
          best = std::min(best, Seconds(t0, Clock::now()));
        }
        out.push_back({{"dtype", std::string(DTypeName(t))},
                       {"sources", n},
                       {"path", internal::ReducePathName(v.path)},
                       {"streaming_stores", v.stream},
                       {"bytes_per_source", bytes},
                       {"GBps_read_plus_written", (n + 1.0) * bytes / best / 1e9}});
      }
    }
  }
  return out;
}

// The machine is shared: the load at start tells how far the figures can be trusted.
std::string LoadAverage() {
  std::FILE* f = std::fopen("/proc/loadavg", "r");
  if (f == nullptr) return "";
  char buf[128] = {};
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  std::string s(buf, n);
  while (!s.empty() && s.back() == '\n') s.pop_back();
  return s;
}

}  // namespace
}  // namespace comm
}  // namespace zerort

const char kUsage[] =
    "usage: comm_bench [--quick] [--ranks=2,4] [--dtypes=fp32,bf16,fp16] [--placement=both|out|in]\n"
    "                  [--ops=all_gather,reduce_scatter,all_reduce] [--min_bytes=N]\n"
    "                  [--max_bytes=N] [--no_kernel]\n";

bool ParseList(const std::string& v, std::vector<std::string>* out) {
  out->clear();
  size_t start = 0;
  while (start <= v.size()) {
    const size_t comma = v.find(',', start);
    const size_t end = comma == std::string::npos ? v.size() : comma;
    if (end == start) return false;
    out->push_back(v.substr(start, end - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return !out->empty();
}

// Parses the flags into `o`; false on anything unknown or malformed.
bool ParseFlags(int argc, char** argv, zerort::comm::Options* o) {
  using zerort::DType;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const size_t eq = a.find('=');
    const std::string key = a.substr(0, eq), val = eq == std::string::npos ? "" : a.substr(eq + 1);
    std::vector<std::string> items;
    if (a == "--") continue;
    if (a == "--quick") {
      o->quick = true;
    } else if (a == "--no_kernel") {
      o->kernel = false;
    } else if (key == "--ranks" && ParseList(val, &items)) {
      o->ranks.clear();
      for (auto& it : items) {
        const int n = std::atoi(it.c_str());
        if (n < 1) return false;
        o->ranks.push_back(n);
      }
    } else if (key == "--dtypes" && ParseList(val, &items)) {
      o->dtypes.clear();
      for (auto& it : items) {
        if (it == "fp32") o->dtypes.push_back(DType::kF32);
        else if (it == "bf16") o->dtypes.push_back(DType::kBF16);
        else if (it == "fp16") o->dtypes.push_back(DType::kF16);
        else return false;
      }
    } else if (key == "--ops" && ParseList(val, &items)) {
      o->ops.clear();
      for (auto& it : items) {
        if (it == "all_gather") o->ops.push_back(zerort::comm::Op::kAllGather);
        else if (it == "reduce_scatter") o->ops.push_back(zerort::comm::Op::kReduceScatter);
        else if (it == "all_reduce") o->ops.push_back(zerort::comm::Op::kAllReduce);
        else return false;
      }
    } else if (key == "--placement" && (val == "both" || val == "out" || val == "in")) {
      o->placements = val == "both" ? std::vector<bool>{false, true}
                                    : std::vector<bool>{val == "in"};
    } else if (key == "--min_bytes" && !val.empty()) {
      o->min_bytes = std::strtoull(val.c_str(), nullptr, 10);
    } else if (key == "--max_bytes" && !val.empty()) {
      o->max_bytes = std::strtoull(val.c_str(), nullptr, 10);
    } else {
      return false;
    }
  }
  return true;
}

int main(int argc, char** argv) {
  using namespace zerort::comm;
  Options o;
  if (!ParseFlags(argc, argv, &o)) {
    std::fprintf(stderr, "%s", kUsage);
    return 2;
  }
  const bool under_mpirun = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr;
  std::unique_ptr<MpiSession> session;
  if (under_mpirun) {
    auto s = MpiSession::Init(&argc, &argv);
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", s.status().ToString().c_str());
      return 1;
    }
    session = std::move(s).value();
  }
  const double memcpy_gbps = ReferenceGBps(o, under_mpirun);
  nlohmann::json out = {{"benchmark", "comm_bench"},
                        {"quick", o.quick},
                        {"limit", "single-thread memcpy bandwidth measured in this run"},
                        {"memcpy_GBps", memcpy_gbps},
                        {"busbw_over_memcpy_goal", 0.5},
                        {"hardware_threads", std::thread::hardware_concurrency()},
                        {"loadavg_at_start", LoadAverage()}};
  int rank = 0;
  if (under_mpirun) {
    out["backends"]["mpi"] = BenchMpi(o, &rank);
  } else {
    if (o.kernel) out["reduce_kernel"] = BenchKernel(o.quick);
    for (int n : o.ranks) {
      out["backends"]["inprocess_" + std::to_string(n)] = BenchInProcess(n, o);
    }
  }
  out["loadavg_at_end"] = LoadAverage();
  if (rank == 0) std::printf("%s\n", out.dump(2).c_str());
  return 0;
}
