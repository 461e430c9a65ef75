// Test helpers for the engine's parts: plans of a small model and in-process ranks.
#ifndef ZERORT_ZERO_INTERNAL_TEST_UTIL_H_
#define ZERORT_ZERO_INTERNAL_TEST_UTIL_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "comm/communicator.h"
#include "comm/testing/on_ranks.h"
#include "device/device.h"
#include "memory/plan.h"
#include "zero/testing/synthetic_trainer.h"

namespace zerort {
namespace zero_internal {

inline memory::Plan SmallPlan(int stage, int world, int rank, int gas = 1,
                              DType dtype = DType::kBF16, bool offload = false) {
  memory::PlanOptions o;
  o.stage = stage;
  o.world_size = world;
  o.rank = rank;
  o.compute_dtype = dtype;
  o.gradient_accumulation_steps = gas;
  o.offload_optimizer = offload;
  o.unit_target_elements = 300;  // several units
  o.shard_alignment = 8;
  o.persistence_threshold = 0;
  return memory::MakePlan(testing::SmallModel(), o).value();
}

// Runs fn(rank, comm) on `world` in-process ranks (default options), one thread each; returns
// each rank's status (checked on the caller's thread: Catch2 assertions are not thread-safe).
inline std::vector<absl::Status> OnRanks(
    int world, const std::function<absl::Status(int, comm::Communicator*)>& fn) {
  return comm::testing::OnRanks(world, {}, fn);
}

// A Device that forwards every call to `inner`: tests override the calls they watch or break
// (an allocator that hands out dirty memory, a WaitHost that fails). `inner` must outlive it.
class ForwardingDevice : public Device {
 public:
  explicit ForwardingDevice(Device* inner) : inner_(inner) {}
  absl::string_view name() const override { return inner_->name(); }
  bool device_memory() const override { return inner_->device_memory(); }
  memory::RawAllocator* allocator(memory::MemoryKind kind) override {
    return inner_->allocator(kind);
  }
  absl::Status Copy(void* dst, const void* src, size_t bytes, Stream s) override {
    return inner_->Copy(dst, src, bytes, s);
  }
  absl::Status Zero(void* dst, size_t bytes, Stream s) override {
    return inner_->Zero(dst, bytes, s);
  }
  absl::Status Cast(const void* src, DType sd, void* dst, DType dd, size_t n,
                    Stream s) override {
    return inner_->Cast(src, sd, dst, dd, n, s);
  }
  absl::Status Accumulate(void* acc, const void* x, DType d, size_t n, Stream s) override {
    return inner_->Accumulate(acc, x, d, n, s);
  }
  absl::Status SquaredNorm(const void* x, DType d, size_t n, float* out, Stream s) override {
    return inner_->SquaredNorm(x, d, n, out, s);
  }
  absl::Status Scale(void* x, DType d, size_t n, float factor, Stream s) override {
    return inner_->Scale(x, d, n, factor, s);
  }
  absl::Status AllFinite(const void* x, DType d, size_t n, bool* out, Stream s) override {
    return inner_->AllFinite(x, d, n, out, s);
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

}  // namespace zero_internal
}  // namespace zerort

#endif  // ZERORT_ZERO_INTERNAL_TEST_UTIL_H_
