#include "offload/thread_pool.h"

#include <algorithm>
#include <cassert>

namespace zerort {
namespace offload {

ThreadPool::ThreadPool(int num_threads) {
  assert(num_threads >= 1);
  for (int i = 1; i < num_threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    work_cv_.SignalAll();
  }
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::RunTasks(uint64_t generation) {
  // Tasks are few (one per thread or a small multiple) and long: taking the mutex per task
  // costs nothing measurable.
  for (;;) {
    int task;
    const std::function<void(int)>* fn;
    {
      absl::MutexLock lock(&mu_);
      // A worker that wakes late must not claim tasks of a later job.
      if (generation_ != generation || fn_ == nullptr || next_task_ >= tasks_) return;
      task = next_task_++;
      fn = fn_;
    }
    (*fn)(task);
    absl::MutexLock lock(&mu_);
    if (++finished_ == tasks_) done_cv_.SignalAll();
  }
}

void ThreadPool::WorkerLoop() {
  uint64_t seen = 0;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      while (!stop_ && generation_ == seen) work_cv_.Wait(&mu_);
      if (stop_) return;
      seen = generation_;
    }
    RunTasks(seen);
  }
}

void ThreadPool::ParallelFor(int tasks, const std::function<void(int)>& fn) {
  if (tasks <= 0) return;
  if (tasks == 1 || workers_.empty()) {
    for (int i = 0; i < tasks; ++i) fn(i);
    return;
  }
  absl::MutexLock call_lock(&call_mu_);
  {
    absl::MutexLock lock(&mu_);
    fn_ = &fn;
    tasks_ = tasks;
    next_task_ = 0;
    finished_ = 0;
    ++generation_;
    work_cv_.SignalAll();
  }
  uint64_t generation;
  {
    absl::MutexLock lock(&mu_);
    generation = generation_;
  }
  RunTasks(generation);
  absl::MutexLock lock(&mu_);
  while (finished_ < tasks_) done_cv_.Wait(&mu_);
  fn_ = nullptr;
}

int HardwareThreads() { return std::max(1u, std::thread::hardware_concurrency()); }

ThreadPool* DefaultThreadPool() {
  static ThreadPool* const pool = new ThreadPool(HardwareThreads());
  return pool;
}

}  // namespace offload
}  // namespace zerort
