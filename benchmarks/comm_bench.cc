// Collective bandwidth of the CPU backends, printed as JSON.
//
//   bazel run //benchmarks:comm_bench -- [--quick]            # in-process, 2 and 4 ranks
//   mpirun -np 4 bazel-bin/benchmarks/comm_bench [--quick]    # MPI backend (rank 0 prints)
//
// Definitions follow nccl-tests: `bytes` is the all-reduce buffer, the all-gather output, or the
// reduce-scatter input; algbw = bytes / time; busbw = algbw * (n-1)/n for all-gather and
// reduce-scatter, * 2(n-1)/n for all-reduce. The limit we measure against is a single-thread
// memcpy of a 256 MiB buffer timed in the same run (copy GB/s = bytes copied / time); for
// messages >= 16 MiB each result carries busbw / memcpy (goal >= 0.5).
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

// Per-rank buffers for one message size: `bytes` as nccl-tests defines it.
struct Buffers {
  std::vector<char> send, recv;
  Buffers(Op op, size_t bytes, int n) {
    if (op == Op::kAllGather) {
      send.assign(bytes / n, 1);
      recv.assign(bytes, 0);
    } else if (op == Op::kReduceScatter) {
      send.assign(bytes, 1);
      recv.assign(bytes / n, 0);
    } else {
      send.assign(bytes, 1);
      recv.assign(bytes, 0);
    }
    // Small integers in every dtype: sums stay finite.
    std::memset(send.data(), 0x3c, send.size());
  }
};

absl::Status RunOp(Communicator& c, Op op, Buffers& b, size_t bytes, DType t) {
  const size_t es = DTypeSize(t);
  const int n = c.size();
  switch (op) {
    case Op::kAllGather:
      return c.AllGather(b.send.data(), b.recv.data(), bytes / n / es, t);
    case Op::kReduceScatter:
      return c.ReduceScatter(b.send.data(), b.recv.data(), bytes / n / es, t, ReduceOp::kSum);
    case Op::kAllReduce:
      return c.AllReduce(b.send.data(), b.recv.data(), bytes / es, t, ReduceOp::kSum);
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

nlohmann::json Result(Op op, DType t, size_t bytes, int n, double sec, double memcpy_gbps) {
  const double algbw = bytes / sec / 1e9;
  const double busbw = algbw * BusFactor(op, n);
  nlohmann::json j = {{"op", OpName(op)},         {"dtype", std::string(DTypeName(t))},
                      {"bytes", bytes},           {"ranks", n},
                      {"time_us", sec * 1e6},     {"algbw_GBps", algbw},
                      {"busbw_GBps", busbw}};
  if (bytes >= (size_t{16} << 20)) j["busbw_over_memcpy"] = busbw / memcpy_gbps;
  return j;
}

std::vector<size_t> Sizes(bool quick) {
  // --quick keeps one size per decade and stops at 16 MiB, the smallest size compared with
  // memcpy, so CI still sees the ratio.
  if (quick) return {size_t{1} << 10, size_t{64} << 10, size_t{1} << 20, size_t{16} << 20};
  std::vector<size_t> out;
  for (size_t s = 1024; s <= (size_t{256} << 20); s *= 4) out.push_back(s);
  return out;
}

int Iters(size_t bytes, bool quick) {
  // Roughly constant time per size: many iterations for small messages, few for large ones.
  const double budget = quick ? 2e8 : 5e8;  // bytes moved per size
  return static_cast<int>(std::clamp(budget / static_cast<double>(bytes), 2.0, quick ? 200.0 : 2000.0));
}

nlohmann::json BenchInProcess(int n, bool quick, double memcpy_gbps) {
  nlohmann::json results = nlohmann::json::array();
  auto group = CreateInProcessGroup(n);
  if (!group.ok()) return {{"error", group.status().ToString()}};
  for (Op op : {Op::kAllGather, Op::kReduceScatter, Op::kAllReduce}) {
    for (DType t : {DType::kF32, DType::kBF16}) {
      if (op == Op::kAllGather && t == DType::kBF16) continue;  // pure data movement
      for (size_t bytes : Sizes(quick)) {
        const size_t granule = static_cast<size_t>(n) * 4;
        bytes = bytes / granule * granule;
        std::vector<Buffers> bufs;
        for (int r = 0; r < n; ++r) bufs.emplace_back(op, bytes, n);
        const int iters = Iters(bytes, quick);
        // (trials, n) seconds per operation; the slowest rank defines a trial.
        std::vector<std::vector<double>> sec(kTrials, std::vector<double>(n));
        std::vector<std::thread> threads;
        for (int r = 0; r < n; ++r) {
          threads.emplace_back([&, r] {
            TimeOnRank(*(*group)[r], op, bufs[r], bytes, t, 1);  // warm-up: page faults
            for (int k = 0; k < kTrials; ++k) {
              sec[k][r] = TimeOnRank(*(*group)[r], op, bufs[r], bytes, t, iters);
            }
          });
        }
        for (auto& th : threads) th.join();
        double best = 1e30;
        for (auto& trial : sec) best = std::min(best, *std::max_element(trial.begin(), trial.end()));
        results.push_back(Result(op, t, bytes, n, best, memcpy_gbps));
      }
    }
  }
  return results;
}

nlohmann::json BenchMpi(bool quick, double memcpy_gbps, int* rank_out) {
  nlohmann::json results = nlohmann::json::array();
  auto comm = CreateMpiCommunicator(MPI_COMM_WORLD);
  if (!comm.ok()) return {{"error", comm.status().ToString()}};
  Communicator& c = **comm;
  *rank_out = c.rank();
  const int n = c.size();
  for (Op op : {Op::kAllGather, Op::kReduceScatter, Op::kAllReduce}) {
    for (DType t : {DType::kF32, DType::kBF16}) {
      if (op == Op::kAllGather && t == DType::kBF16) continue;
      for (size_t bytes : Sizes(quick)) {
        const size_t granule = static_cast<size_t>(n) * 4;
        bytes = bytes / granule * granule;
        Buffers b(op, bytes, n);
        TimeOnRank(c, op, b, bytes, t, 1);
        double best = 1e30;
        for (int k = 0; k < kTrials; ++k) {
          // Every rank must take the same decision: agree on the slowest rank's time.
          double sec = TimeOnRank(c, op, b, bytes, t, Iters(bytes, quick));
          MPI_Allreduce(MPI_IN_PLACE, &sec, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
          best = std::min(best, sec);
        }
        results.push_back(Result(op, t, bytes, n, best, memcpy_gbps));
      }
    }
  }
  return results;
}

// Single-thread throughput of the reduction kernel (SIMD dispatch and the scalar path), in GB/s
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
      for (bool simd : {true, false}) {
        if (simd && !internal::ReduceUsesSimd()) continue;
        auto run = [&] {
          if (simd) {
            internal::ReduceBlocks(ptrs.data(), n, dst.data(), count, t, ReduceOp::kSum);
          } else {
            internal::ReduceBlocksScalar(ptrs.data(), n, dst.data(), count, t, ReduceOp::kSum);
          }
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
                       {"path", simd ? "avx2" : "scalar"},
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

int main(int argc, char** argv) {
  using namespace zerort::comm;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--quick") {
      quick = true;
    } else if (std::string(argv[i]) != "--") {
      std::fprintf(stderr, "usage: comm_bench [--quick]\n");
      return 2;
    }
  }
  const bool under_mpirun = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr;
  const double memcpy_gbps = MemcpyGBps(quick ? (size_t{64} << 20) : (size_t{256} << 20), 5);
  nlohmann::json out = {{"benchmark", "comm_bench"},
                        {"quick", quick},
                        {"limit", "single-thread memcpy bandwidth measured in this run"},
                        {"memcpy_GBps", memcpy_gbps},
                        {"busbw_over_memcpy_goal", 0.5},
                        {"hardware_threads", std::thread::hardware_concurrency()},
                        {"loadavg_at_start", LoadAverage()}};
  int rank = 0;
  if (under_mpirun) {
    auto session = MpiSession::Init(&argc, &argv);
    if (!session.ok()) {
      std::fprintf(stderr, "%s\n", session.status().ToString().c_str());
      return 1;
    }
    out["backends"]["mpi"] = BenchMpi(quick, memcpy_gbps, &rank);
  } else {
    out["reduce_kernel"] = BenchKernel(quick);
    for (int n : {2, 4}) {
      out["backends"]["inprocess_" + std::to_string(n)] = BenchInProcess(n, quick, memcpy_gbps);
    }
  }
  if (rank == 0) std::printf("%s\n", out.dump(2).c_str());
  return 0;
}
