// ForwardingDevice: a Device that forwards every call to another, for tests and benchmarks that
// watch or break some calls of a real device (an allocator that hands out dirty memory, a
// WaitHost that fails, a count of the calls the engine makes per step) and leave the rest alone.
// Derive from it and override the calls of interest. `inner` must outlive it.
#ifndef ZERORT_DEVICE_TESTING_FORWARDING_DEVICE_H_
#define ZERORT_DEVICE_TESTING_FORWARDING_DEVICE_H_

#include <cstddef>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/dtype.h"
#include "device/device.h"

namespace zerort {
namespace testing {

class ForwardingDevice : public Device {
 public:
  explicit ForwardingDevice(Device* inner) : inner_(inner) {}
  absl::string_view name() const override { return inner_->name(); }
  bool device_memory() const override { return inner_->device_memory(); }
  memory::RawAllocator* allocator(memory::MemoryKind kind) override {
    return inner_->allocator(kind);
  }
  absl::Status ReleaseCachedMemory() override { return inner_->ReleaseCachedMemory(); }
  absl::Status Copy(void* dst, const void* src, size_t bytes, Stream s) override {
    return inner_->Copy(dst, src, bytes, s);
  }
  absl::Status Zero(void* dst, size_t bytes, Stream s) override {
    return inner_->Zero(dst, bytes, s);
  }
  absl::Status Cast(const void* src, DType sd, void* dst, DType dd, size_t n, Stream s) override {
    return inner_->Cast(src, sd, dst, dd, n, s);
  }
  absl::Status Accumulate(void* acc, const void* x, DType d, size_t n, Stream s) override {
    return inner_->Accumulate(acc, x, d, n, s);
  }
  absl::Status Scale(void* x, DType d, size_t n, float factor, Stream s) override {
    return inner_->Scale(x, d, n, factor, s);
  }
  absl::Status SquaredNorm(const void* x, DType d, size_t n, float* out, Stream s) override {
    return inner_->SquaredNorm(x, d, n, out, s);
  }
  absl::Status AllFinite(const void* x, DType d, size_t n, bool* out, Stream s) override {
    return inner_->AllFinite(x, d, n, out, s);
  }
  // Forwarded whole: a device that batches the ranges (CUDA) keeps batching them.
  absl::Status SquaredNormsAndFinite(absl::Span<const NormRange> ranges, float* sumsq, bool* finite,
                                     Stream s) override {
    return inner_->SquaredNormsAndFinite(ranges, sumsq, finite, s);
  }
  absl::Status AdamWRanges(const offload::AdamWArrays& arrays,
                           absl::Span<const offload::AdamWRange> ranges, float grad_scale,
                           Stream s) override {
    return inner_->AdamWRanges(arrays, ranges, grad_scale, s);
  }
  absl::Status CompactAdamWRanges(const offload::CompactAdamWArrays& arrays,
                                  absl::Span<const offload::AdamWRange> ranges, float grad_scale,
                                  Stream s) override {
    return inner_->CompactAdamWRanges(arrays, ranges, grad_scale, s);
  }
  absl::Status Synchronize(Stream s) override { return inner_->Synchronize(s); }
  absl::StatusOr<Stream> CreateStream() override { return inner_->CreateStream(); }
  void DestroyStream(Stream s) override { inner_->DestroyStream(s); }
  absl::StatusOr<Event> CreateEvent() override { return inner_->CreateEvent(); }
  void DestroyEvent(Event e) override { inner_->DestroyEvent(e); }
  absl::Status Record(Event e, Stream s) override { return inner_->Record(e, s); }
  absl::Status Wait(Stream s, Event e) override { return inner_->Wait(s, e); }
  absl::Status WaitHost(Event e) override { return inner_->WaitHost(e); }
  absl::StatusOr<Event> CreateTimingEvent() override { return inner_->CreateTimingEvent(); }
  absl::StatusOr<double> ElapsedMs(Event a, Event b) override { return inner_->ElapsedMs(a, b); }

 protected:
  Device* const inner_;
};

}  // namespace testing
}  // namespace zerort

#endif  // ZERORT_DEVICE_TESTING_FORWARDING_DEVICE_H_
