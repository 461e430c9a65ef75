// A small persistent pool of worker threads for the host kernels (AdamW, casts, norms).
//
// The kernels run every step on large arrays; spawning threads per call would cost tens of
// microseconds per thread and cold stacks. Workers sleep on a condition variable between calls.
//
//   ThreadPool* pool = DefaultThreadPool();
//   pool->ParallelFor(tasks, [&](int task) { Process(ranges[task]); });
//
// Thread-safe: concurrent ParallelFor calls are serialised.
// REQUIRES: fn does not call ParallelFor on the same pool (it would deadlock).
#ifndef ZERORT_OFFLOAD_THREAD_POOL_H_
#define ZERORT_OFFLOAD_THREAD_POOL_H_

#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace zerort {
namespace offload {

class ThreadPool {
 public:
  // `num_threads` >= 1 counts the caller: the pool starts num_threads - 1 workers.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs fn(0) .. fn(tasks - 1), each exactly once, on the caller and the workers; returns when
  // all have finished. Which thread runs which task is unspecified.
  void ParallelFor(int tasks, const std::function<void(int)>& fn);

 private:
  void WorkerLoop();
  // Claims and runs tasks of job `generation` until none is left.
  void RunTasks(uint64_t generation);

  std::vector<std::thread> workers_;

  absl::Mutex call_mu_;  // serialises ParallelFor callers
  absl::Mutex mu_ ABSL_ACQUIRED_AFTER(call_mu_);
  absl::CondVar work_cv_;
  absl::CondVar done_cv_;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  const std::function<void(int)>* fn_ ABSL_GUARDED_BY(mu_) = nullptr;
  int tasks_ ABSL_GUARDED_BY(mu_) = 0;
  int next_task_ ABSL_GUARDED_BY(mu_) = 0;
  int finished_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
};

// Hardware threads of this process (std::thread::hardware_concurrency, at least 1).
int HardwareThreads();

// A process-wide pool with HardwareThreads() threads, created on first use, never destroyed.
ThreadPool* DefaultThreadPool();

}  // namespace offload
}  // namespace zerort

#endif  // ZERORT_OFFLOAD_THREAD_POOL_H_
