// StepTimer: accumulates what one accumulation window costs (bytes sent, time in reductions
// and gathers), which Step() reports in StepStats at the window's boundary.
//
//   Stopwatch t;
//   RETURN_IF_ERROR(comm->ReduceScatter(...));
//   timer.Sent(unit.shard, /*passes=*/1);
//   timer.AddReduceMs(t.ElapsedMs());
//   ...
//   stats.comm_bytes = timer.window().comm_bytes;   // at the boundary
//   timer.Reset();
//
// Thread safety: not thread-safe; one per engine.
#ifndef ZERORT_ZERO_INTERNAL_STEP_TIMER_H_
#define ZERORT_ZERO_INTERNAL_STEP_TIMER_H_

#include <chrono>
#include <cstddef>
#include <cstdint>


namespace zerort {
namespace zero_internal {

// Wall time since construction, in milliseconds.
class Stopwatch {
 public:
  Stopwatch() : start_(std::chrono::steady_clock::now()) {}
  double ElapsedMs() const {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_)
        .count();
  }

 private:
  std::chrono::steady_clock::time_point start_;
};

class StepTimer {
 public:
  struct Window {
    int64_t comm_bytes = 0;  // bytes this rank sent
    double reduce_ms = 0;    // in gradient reductions
    double gather_ms = 0;    // in parameter all-gathers outside Step() (stage-3 Gather)
  };

  // `element_bytes`: the compute dtype's size, in which every counted collective moves.
  // `world`: the ranks of the counted collectives; with HSDP the shard group, and `replicas`
  // the number of groups (1 when flat).
  StepTimer(int world, size_t element_bytes, int replicas = 1)
      : world_(world), element_bytes_(element_bytes), replicas_(replicas) {}

  // Counts one collective of `passes` passes over blocks of `block` elements per rank, in
  // nccl-tests' convention: a rank sends (n-1)/n of the buffer per pass (an all-reduce is two).
  void Sent(int64_t block, int passes) { Sent(block, passes, element_bytes_); }
  // A collective in another dtype (fp32 gradient reductions).
  void Sent(int64_t block, int passes, size_t element_bytes) {
    window_.comm_bytes += passes * block * (world_ - 1) * static_cast<int64_t>(element_bytes);
  }
  // HSDP: the across-group part of a gradient reduction that gave this rank `block` elements,
  // counted as memory::Plan counts it (an all-reduce of the block over the replicas: two
  // passes of (R-1)/R). Nothing when flat.
  void SentAcrossGroups(int64_t block, size_t element_bytes) {
    window_.comm_bytes += 2 * (block / replicas_) * (replicas_ - 1) *
                          static_cast<int64_t>(element_bytes);
  }
  // A collective over `ranks` ranks (hpZ's node gathers) of blocks of `block` elements.
  void SentOver(int64_t block, int ranks) {
    window_.comm_bytes += block * (ranks - 1) * static_cast<int64_t>(element_bytes_);
  }
  void AddReduceMs(double ms) { window_.reduce_ms += ms; }
  void AddGatherMs(double ms) { window_.gather_ms += ms; }

  // What the window has accumulated so far.
  const Window& window() const { return window_; }
  // Starts a new window.
  void Reset() { window_ = Window(); }

 private:
  const int world_;
  const size_t element_bytes_;
  const int replicas_;
  Window window_;
};

}  // namespace zero_internal
}  // namespace zerort

#endif  // ZERORT_ZERO_INTERNAL_STEP_TIMER_H_
