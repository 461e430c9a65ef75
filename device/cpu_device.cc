#include "device/cpu_device.h"

#include <cassert>
#include <chrono>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/status.h"
#include "memory/pinned_pool.h"
#include "offload/cpu_adamw_compact.h"
#include "offload/cpu_kernels.h"

namespace zerort {
namespace {

// A recorded point of some stream. `recorded` counts Record calls; `completed` is the highest
// record number whose work has finished. Waits capture `recorded` when they are made.
// Shared (EventRef): a Record or Wait queued on a stream holds the event as the handle does.
struct CpuEvent {
  absl::Mutex mu;
  uint64_t recorded ABSL_GUARDED_BY(mu) = 0;
  uint64_t completed ABSL_GUARDED_BY(mu) = 0;
  absl::Status status ABSL_GUARDED_BY(mu);  // the first failure of the stream it recorded
  // When record `completed` completed: the stream's worker reached it (asynchronous streams), or
  // the Record call itself (work on a null stream is done when its call returns).
  std::chrono::steady_clock::time_point completed_at ABSL_GUARDED_BY(mu);

  void Complete(uint64_t n, const absl::Status& s) {
    const auto now = std::chrono::steady_clock::now();
    absl::MutexLock lock(&mu);
    if (n > completed) {
      completed = n;
      completed_at = now;
    }
    if (status.ok() && !s.ok()) status = s;
  }
  // Blocks until record `n` has completed.
  absl::Status Await(uint64_t n) {
    Target target{this, n};
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(&Reached, &target));
    return status;
  }

 private:
  struct Target {
    CpuEvent* event;
    uint64_t n;
  };
  // Called by Mutex::Await with `mu` held.
  static bool Reached(Target* t) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return t->event->completed >= t->n;
  }
};

// A worker thread that runs closures in enqueue order. After a failure, later closures are
// skipped (their events still complete, carrying the failure) so that no waiter hangs.
class CpuStream {
 public:
  CpuStream() : thread_([this] { Loop(); }) {}
  ~CpuStream() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }

  void Enqueue(std::function<absl::Status()> fn) {
    absl::MutexLock lock(&mu_);
    queue_.push_back(std::move(fn));
  }

  absl::Status Synchronize() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &CpuStream::IdleLocked));
    return status_;
  }

  absl::Status status() {
    absl::MutexLock lock(&mu_);
    return status_;
  }

 private:
  bool IdleLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return queue_.empty() && !busy_; }
  bool HasWorkLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !queue_.empty() || stop_;
  }

  void Loop() {
    for (;;) {
      std::function<absl::Status()> fn;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(this, &CpuStream::HasWorkLocked));
        if (queue_.empty()) return;  // stop_ with nothing left
        fn = std::move(queue_.front());
        queue_.pop_front();
        busy_ = true;
      }
      // A failed stream still runs its closures: event completions must happen (carrying the
      // failure), while CpuDevice::Run skips kernels.
      absl::Status s = fn();
      absl::MutexLock lock(&mu_);
      if (status_.ok() && !s.ok()) status_ = s;
      busy_ = false;
    }
  }

  absl::Mutex mu_;
  std::deque<std::function<absl::Status()>> queue_ ABSL_GUARDED_BY(mu_);
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;  // last: starts after the members it uses
};

// What an Event handle points to. DestroyEvent deletes the handle only: the closures that Record
// and Wait queue on a stream hold references of their own, so an event destroyed with a record
// or wait still queued lives until that work has run, as cudaEventDestroy allows. (Deleting the
// CpuEvent at once let a stream's worker lock the mutex of freed memory: "Mutex corrupt".)
using EventRef = std::shared_ptr<CpuEvent>;

EventRef& Ref(Device::Event event) { return *static_cast<EventRef*>(event); }

class CpuDevice final : public Device {
 public:
  explicit CpuDevice(const CpuDeviceOptions& o)
      : threads_(o.threads),
        async_(o.async_streams),
        delay_us_(o.stream_delay_us),
        link_gbps_(o.copy_link_gbps) {}

  absl::string_view name() const override { return "cpu"; }
  bool device_memory() const override { return false; }

  memory::RawAllocator* allocator(memory::MemoryKind kind) override {
    if (kind == memory::MemoryKind::kPinnedHost) return memory::SharedPinnedSlabs();
    if (kind == memory::MemoryKind::kDevice) return device_alloc_.get();
    return memory::HostAllocator();
  }

  absl::Status Copy(void* dst, const void* src, size_t bytes, Stream stream) override {
    const bool modeled = link_gbps_ > 0 && stream != nullptr;
    return Run(stream, [=] {
      const auto t0 = std::chrono::steady_clock::now();
      if (bytes > 0 && dst != src) std::memcpy(dst, src, bytes);
      // A DMA engine moves the bytes while this thread (a stream's, or the caller's for an
      // inline stream) only waits, as a host thread waits for cudaMemcpyAsync.
      if (modeled) {
        std::this_thread::sleep_until(
            t0 + std::chrono::duration<double>(static_cast<double>(bytes) / (link_gbps_ * 1e9)));
      }
      return absl::OkStatus();
    });
  }

  absl::Status Zero(void* dst, size_t bytes, Stream stream) override {
    return Run(stream, [=] {
      if (bytes > 0) std::memset(dst, 0, bytes);
      return absl::OkStatus();
    });
  }

  absl::Status Cast(const void* src, DType src_dtype, void* dst, DType dst_dtype, size_t n,
                    Stream stream) override {
    const int threads = threads_;
    return Run(stream, [=] {
      offload::Cast(src, src_dtype, dst, dst_dtype, n, threads);
      return absl::OkStatus();
    });
  }

  absl::Status Accumulate(void* acc, const void* x, DType dtype, size_t n,
                          Stream stream) override {
    return Run(stream, [=] {
      AccumulateNow(acc, x, dtype, n);
      return absl::OkStatus();
    });
  }

  absl::Status Scale(void* x, DType dtype, size_t n, float factor, Stream stream) override {
    return Run(stream, [=] {
      ScaleNow(x, dtype, n, factor);
      return absl::OkStatus();
    });
  }

  absl::Status SquaredNorm(const void* x, DType dtype, size_t n, float* out,
                           Stream stream) override {
    const int threads = threads_;
    return Run(stream, [=] {
      *out = offload::SquaredNormF32(x, dtype, n, threads);
      return absl::OkStatus();
    });
  }

  absl::Status AllFinite(const void* x, DType dtype, size_t n, bool* out,
                         Stream stream) override {
    const int threads = threads_;
    return Run(stream, [=] {
      *out = offload::AllFinite(x, dtype, n, threads);
      return absl::OkStatus();
    });
  }

  absl::Status AdamWRanges(const offload::AdamWArrays& arrays,
                           absl::Span<const offload::AdamWRange> ranges, float grad_scale,
                           Stream stream) override {
    const int threads = threads_;
    // Copied: the call may run after the caller's ranges are gone.
    std::vector<offload::AdamWRange> copy(ranges.begin(), ranges.end());
    return Run(stream, [=, copy = std::move(copy)] {
      return offload::CpuAdamW(arrays, copy, grad_scale, threads);
    });
  }

  absl::Status CompactAdamWRanges(const offload::CompactAdamWArrays& arrays,
                                  absl::Span<const offload::AdamWRange> ranges,
                                  float grad_scale, Stream stream) override {
    const int threads = threads_;
    std::vector<offload::AdamWRange> copy(ranges.begin(), ranges.end());
    return Run(stream, [=, copy = std::move(copy)] {
      return offload::CpuAdamWCompact(arrays, copy, grad_scale, threads);
    });
  }

  absl::Status Synchronize(Stream stream) override {
    if (stream == nullptr || !async_) return absl::OkStatus();
    return static_cast<CpuStream*>(stream)->Synchronize();
  }

  absl::StatusOr<Stream> CreateStream() override {
    if (!async_) return static_cast<Stream>(&inline_stream_tag_);
    return static_cast<Stream>(new CpuStream());
  }

  void DestroyStream(Stream stream) override {
    if (async_ && stream != nullptr) delete static_cast<CpuStream*>(stream);
  }

  absl::StatusOr<Event> CreateEvent() override {
    return static_cast<Event>(new EventRef(std::make_shared<CpuEvent>()));
  }

  // The event itself goes when the last queued record of it or wait on it has run.
  void DestroyEvent(Event event) override { delete static_cast<EventRef*>(event); }

  // Every CPU event keeps its completion time; a timing event is an event.
  absl::StatusOr<Event> CreateTimingEvent() override { return CreateEvent(); }

  absl::StatusOr<double> ElapsedMs(Event start, Event end) override {
    ASSIGN_OR_RETURN(const auto t0, CompletedAt(start, "start"));
    ASSIGN_OR_RETURN(const auto t1, CompletedAt(end, "end"));
    return std::chrono::duration<double, std::milli>(t1 - t0).count();
  }

  absl::Status Record(Event event, Stream stream) override {
    EventRef e = Ref(event);  // the queued completion keeps it alive
    uint64_t n;
    {
      absl::MutexLock lock(&e->mu);
      n = ++e->recorded;
    }
    if (!Async(stream)) {
      e->Complete(n, absl::OkStatus());
      return absl::OkStatus();
    }
    CpuStream* s = static_cast<CpuStream*>(stream);
    s->Enqueue([e = std::move(e), n, s] {
      e->Complete(n, s->status());
      return absl::OkStatus();
    });
    return absl::OkStatus();
  }

  absl::Status Wait(Stream stream, Event event) override {
    if (!Async(stream)) return WaitHost(event);
    EventRef e = Ref(event);  // the queued wait keeps it alive
    uint64_t n;
    {
      absl::MutexLock lock(&e->mu);
      n = e->recorded;
    }
    static_cast<CpuStream*>(stream)->Enqueue([e = std::move(e), n] { return e->Await(n); });
    return absl::OkStatus();
  }

  absl::Status WaitHost(Event event) override {
    CpuEvent* e = Ref(event).get();
    uint64_t n;
    {
      absl::MutexLock lock(&e->mu);
      n = e->recorded;
    }
    return e->Await(n);
  }

 private:
  bool Async(Stream stream) const { return async_ && stream != nullptr; }

  static absl::StatusOr<std::chrono::steady_clock::time_point> CompletedAt(Event event,
                                                                           const char* which) {
    CpuEvent* e = Ref(event).get();
    absl::MutexLock lock(&e->mu);
    if (e->recorded == 0 || e->completed < e->recorded) {
      return absl::FailedPreconditionError(absl::StrCat(
          "ElapsedMs: the ", which, " event ",
          e->recorded == 0 ? "was never recorded" : "has not completed (WaitHost first)"));
    }
    return e->completed_at;
  }

  // Runs `fn` now (nullptr stream, or streams without threads) or enqueues it on its stream.
  // Enqueued work is skipped once its stream has failed: a CUDA stream stops likewise.
  absl::Status Run(Stream stream, std::function<absl::Status()> fn) {
    if (!Async(stream)) return fn();
    CpuStream* s = static_cast<CpuStream*>(stream);
    s->Enqueue([s, fn = std::move(fn), delay = delay_us_] {
      if (!s->status().ok()) return absl::OkStatus();
      if (delay > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay));
      return fn();
    });
    return absl::OkStatus();
  }

  static void ScaleNow(void* x, DType dtype, size_t n, float factor) {
    switch (dtype) {
      case DType::kF32: {
        float* a = static_cast<float*>(x);
        for (size_t i = 0; i < n; ++i) a[i] *= factor;
        break;
      }
      case DType::kBF16: {
        uint16_t* a = static_cast<uint16_t*>(x);
        for (size_t i = 0; i < n; ++i) a[i] = FloatToBf16(Bf16ToFloat(a[i]) * factor);
        break;
      }
      case DType::kF16: {
        uint16_t* a = static_cast<uint16_t*>(x);
        for (size_t i = 0; i < n; ++i) a[i] = FloatToHalf(HalfToFloat(a[i]) * factor);
        break;
      }
    }
  }

  static void AccumulateNow(void* acc, const void* x, DType dtype, size_t n) {
    switch (dtype) {
      case DType::kF32: {
        float* a = static_cast<float*>(acc);
        const float* b = static_cast<const float*>(x);
        for (size_t i = 0; i < n; ++i) a[i] += b[i];
        break;
      }
      case DType::kBF16: {
        uint16_t* a = static_cast<uint16_t*>(acc);
        const uint16_t* b = static_cast<const uint16_t*>(x);
        for (size_t i = 0; i < n; ++i) a[i] = FloatToBf16(Bf16ToFloat(a[i]) + Bf16ToFloat(b[i]));
        break;
      }
      case DType::kF16: {
        uint16_t* a = static_cast<uint16_t*>(acc);
        const uint16_t* b = static_cast<const uint16_t*>(x);
        for (size_t i = 0; i < n; ++i) a[i] = FloatToHalf(HalfToFloat(a[i]) + HalfToFloat(b[i]));
        break;
      }
    }
  }

  const int threads_;
  const bool async_;
  const int delay_us_;
  const double link_gbps_;
  char inline_stream_tag_ = 0;  // the handle of every stream when !async_
  // kDevice memory, counted on its own (Engine::Park's tests read the counts).
  const std::unique_ptr<memory::RawAllocator> device_alloc_ =
      memory::NewHostAllocator("cpu device");
};

}  // namespace

std::unique_ptr<Device> CreateCpuDevice(const CpuDeviceOptions& options) {
  assert(options.threads >= 0 && options.stream_delay_us >= 0 && options.copy_link_gbps >= 0);
  return std::make_unique<CpuDevice>(options);
}

}  // namespace zerort
