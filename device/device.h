// Device: where the engine's buffers live and the few kernels it runs on them.
//
// The engine (zero/engine.h) is written once against this interface and comm::Communicator and
// never mentions CUDA, NCCL or MPI. The CPU device (device/cpu_device.h) runs everything on the
// host; the CUDA device runs the same math in kernels. Every call takes a stream handle that the
// CPU device ignores; on a stream-ordered device a call is only enqueued, and values written to
// host pointers (SquaredNorm, AllFinite) are valid after Synchronize(stream).
//
// Exactness: every implementation must give bitwise identical results for the same inputs
// (the kernels follow the op sequences documented in offload/cpu_adamw.h and offload/cpu_kernels.h),
// which is what lets stages, devices and offload be compared bit for bit.
//
// Thread safety: a Device may be shared by the ranks of an in-process group; implementations
// must allow concurrent calls on disjoint buffers.
#ifndef ZERORT_DEVICE_DEVICE_H_
#define ZERORT_DEVICE_DEVICE_H_

#include <cstddef>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/dtype.h"
#include "memory/arena.h"
#include "memory/plan.h"
#include "offload/cpu_adamw.h"
#include "offload/cpu_adamw_compact.h"

namespace zerort {

class Device {
 public:
  using Stream = void*;
  using Event = void*;
  virtual ~Device() = default;

  virtual absl::string_view name() const = 0;
  // True when kDevice buffers are accelerator memory that host loads and stores cannot reach
  // (so communicators must move it themselves); false for the CPU device.
  virtual bool device_memory() const = 0;

  // Backing memory for arenas of each kind. The returned allocator outlives the device's users.
  // The kDevice allocator of both devices can decommit (memory::RawAllocator::Decommit) and
  // counts what it holds (usage()): Engine::Park releases device memory through it.
  virtual memory::RawAllocator* allocator(memory::MemoryKind kind) = 0;
  // Returns memory the device keeps cached for itself and is not using (the CUDA device's
  // stream-ordered pool behind SquaredNorm's scratch) to the driver: Engine::Park calls it so
  // that a parked engine leaves the GPU to its neighbour. Default: nothing cached, OK.
  virtual absl::Status ReleaseCachedMemory() { return absl::OkStatus(); }

  // Copies between any two buffers the engine holds (device or host).
  virtual absl::Status Copy(void* dst, const void* src, size_t bytes, Stream stream) = 0;
  virtual absl::Status Zero(void* dst, size_t bytes, Stream stream) = 0;
  // dst[i] = round_to_dst(float(src[i])).
  virtual absl::Status Cast(const void* src, DType src_dtype, void* dst, DType dst_dtype,
                            size_t n, Stream stream) = 0;
  // acc[i] = round(float(acc[i]) + float(x[i])): gradient accumulation across micro-steps.
  virtual absl::Status Accumulate(void* acc, const void* x, DType dtype, size_t n,
                                  Stream stream) = 0;
  // x[i] = round(float(x[i]) * factor): gradient prescaling before a reduction
  // (prescale_gradients, gradient_predivide_factor). A device without the kernel returns
  // Unimplemented naming itself (the engine asks with n = 0 when it is created).
  virtual absl::Status Scale(void* x, DType dtype, size_t n, float factor, Stream stream) {
    return absl::UnimplementedError(
        absl::StrCat("device '", name(), "' has no Scale kernel (gradient prescaling)"));
  }
  // *out = squared L2 norm with offload::SquaredNormF32's fixed reduction order.
  virtual absl::Status SquaredNorm(const void* x, DType dtype, size_t n, float* out,
                                   Stream stream) = 0;
  // *out = every element finite.
  virtual absl::Status AllFinite(const void* x, DType dtype, size_t n, bool* out,
                                 Stream stream) = 0;
  // One range of SquaredNormsAndFinite.
  struct NormRange {
    const void* x;
    DType dtype;
    size_t n;
  };
  // For every range i: sumsq[i] = its SquaredNorm and finite[i] = its AllFinite, bit for bit,
  // in one call: what the engine measures each step, every unit at once. The default calls the
  // two per range; the CUDA device batches all ranges into a few launches (each call of the two
  // costs host work that left the GPU idle between units). The ranges are copied: they need
  // not outlive an enqueued call. sumsq and finite: ranges.size() each.
  virtual absl::Status SquaredNormsAndFinite(absl::Span<const NormRange> ranges, float* sumsq,
                                             bool* finite, Stream stream) {
    for (size_t i = 0; i < ranges.size(); ++i) {
      const NormRange& r = ranges[i];
      absl::Status s = SquaredNorm(r.x, r.dtype, r.n, &sumsq[i], stream);
      if (s.ok()) s = AllFinite(r.x, r.dtype, r.n, &finite[i], stream);
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }
  // The fused AdamW of offload/cpu_adamw.h over arrays in this device's memory, each range
  // with its own constants (parameter groups). REQUIRES: `ranges` tile [0, arrays.n) in order
  // (offload::CheckAdamWRanges; InvalidArgument otherwise). The ranges are copied: they need
  // not outlive an enqueued call.
  virtual absl::Status AdamWRanges(const offload::AdamWArrays& arrays,
                                   absl::Span<const offload::AdamWRange> ranges,
                                   float grad_scale, Stream stream) = 0;
  // One set of constants for every element.
  absl::Status AdamW(const offload::AdamWArrays& arrays, const offload::AdamWStepParams& params,
                     float grad_scale, Stream stream) {
    const offload::AdamWRange all{0, arrays.n, params};
    return AdamWRanges(arrays, absl::MakeConstSpan(&all, 1), grad_scale, stream);
  }
  // AdamW over compact optimizer state (offload/cpu_adamw_compact.h: the bf16 + remainder
  // master, the stochastically rounded bf16 master, bf16 moments) in this device's memory,
  // bitwise equal to offload::CpuAdamWCompact for the same arrays, ranges and rounding seed.
  // Same contract as AdamWRanges. A device without the kernel returns Unimplemented naming
  // itself (the engine asks with n = 0 when a compact form is configured).
  virtual absl::Status CompactAdamWRanges(const offload::CompactAdamWArrays& arrays,
                                          absl::Span<const offload::AdamWRange> ranges,
                                          float grad_scale, Stream stream) {
    return absl::UnimplementedError(absl::StrCat(
        "device '", name(), "' has no compact-state AdamW kernel (",
        offload::MasterFormName(arrays.master_form), " master)"));
  }
  virtual absl::Status Synchronize(Stream stream) = 0;

  virtual absl::StatusOr<Stream> CreateStream() = 0;
  // REQUIRES: no work pending on `stream` (Synchronize it first).
  virtual void DestroyStream(Stream stream) = 0;
  virtual absl::StatusOr<Event> CreateEvent() = 0;
  // May be called while a Record of `event` or a Wait on it is still queued on a stream (as
  // cudaEventDestroy allows): that work still runs, and the event's resources go once it has.
  // REQUIRES: no host call (WaitHost, ElapsedMs) on `event` is running or follows.
  virtual void DestroyEvent(Event event) = 0;
  virtual absl::Status Record(Event event, Stream stream) = 0;
  virtual absl::Status Wait(Stream stream, Event event) = 0;
  virtual absl::Status WaitHost(Event event) = 0;

  // Device time, for statistics that measure the work rather than its enqueueing. A timing
  // event is a separate kind because on CUDA timing makes every Record and wait dearer
  // (cudaEventDisableTiming is the default of CreateEvent). Both Unimplemented on a device
  // without a clock.
  virtual absl::StatusOr<Event> CreateTimingEvent() {
    return absl::UnimplementedError(absl::StrCat(name(), ": no timing events"));
  }
  // Milliseconds between the completion of the last Record of `start` and of `end` (negative
  // when `end` completed first), both timing events. FailedPrecondition when either has never
  // been recorded or its last Record has not completed (WaitHost first).
  virtual absl::StatusOr<double> ElapsedMs(Event start, Event end) {
    (void)start;
    (void)end;
    return absl::UnimplementedError(absl::StrCat(name(), ": no timing events"));
  }
};

}  // namespace zerort

#endif  // ZERORT_DEVICE_DEVICE_H_
