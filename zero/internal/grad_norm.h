// GradNorm: the global L2 norm of the reduced gradients and one overflow verdict, the same on
// every rank, from per-(shard, unit) partials.
//
// Each rank computes the squared norm of its shard of every unit and a finiteness flag; the
// (world, units + 1) table is exchanged in one all-gather (stages 1-3; stage 0 holds every
// reduced gradient and computes all partials itself). Every rank then sums the same table in
// the same order, so every stage gets the same norm bit for bit. With HSDP the R replicas of a
// group shard split it into its R flat shards and measure one each: every element is counted
// once and the table holds the flat layout's partials (see Measure).
//
// Gradient offload (memory::GradOffload): the reduced gradients end in host memory, so each
// unit's partials are computed on the device before its final shard leaves (MeasureUnit, on the
// window's last micro-step, by GradBuckets), with the same kernels on the same bytes: the same
// bits, and no pass of the host over the shard. Measure then only exchanges them. With
// offload_optimizer.ratio < 1 that is so for the offloaded units (Region::offloaded); Measure
// measures the units kept on the device itself, as without offload.
//
// Every unit is measured in one device call (Device::SquaredNormsAndFinite), which the CUDA
// device runs as a few launches for all units instead of several per unit. Where the device
// writes the partials: on a device with its own memory, into a pinned host
// buffer taken once from the device's pinned allocator (the readback), because a copy of a
// device result into pageable memory returns only when the copy is done: the host then waits
// for every unit's kernels in turn, two waits per unit, and cannot enqueue ahead (measured on
// an H100: 7.0 ms of device time for the norms of a 1.3B-parameter step whose kernels take
// under 2). The host device writes into plain heap memory: its writes never stall.
//
// Thread safety: not thread-safe; one per engine.
#ifndef ZERORT_ZERO_INTERNAL_GRAD_NORM_H_
#define ZERORT_ZERO_INTERNAL_GRAD_NORM_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "memory/arena.h"
#include "device/device.h"
#include "memory/plan.h"
#include "zero/internal/host_collectives.h"
#include "zero/internal/shard_layout.h"

namespace zerort {
namespace zero_internal {

class GradNorm {
 public:
  // Every argument must outlive this object. `device_table`: (world, units + 1) fp32 device
  // memory to stage the exchange through (the plan's norm table; may be null). `partials`:
  // the plan's norm_partials, (2 x units) fp32 pinned host memory; REQUIRES: non-null with
  // gradient offload (memory::GradOffload), where MeasureUnit writes there.
  GradNorm(const memory::Plan& plan, const ShardLayout& layout, Device* device,
           Device::Stream compute, HostCollectives* host, float* device_table,
           float* partials = nullptr);
  ~GradNorm();
  GradNorm(const GradNorm&) = delete;
  GradNorm& operator=(const GradNorm&) = delete;

  // Gradient offload: unit u's final reduced gradient for this window, a device copy of its
  // region (region(u).n elements of region(u).grad_dtype at `grad`), is measured on `stream`
  // exactly as Measure measures the region, so with HSDP only this replica's flat slice of it
  // (enqueued; the results land in this object when the stream gets there). REQUIRES: memory::GradOffload; called once per trainable unit in a
  // window's last micro-step, and that stream joined into `compute` (StreamOrder::JoinComm)
  // before Measure.
  absl::Status MeasureUnit(int u, const void* grad, Device::Stream stream);

  struct Result {
    double norm = 0;        // sqrt(sum of squares) / scale
    bool overflow = false;  // an Inf/NaN on some rank, or an infinite norm
  };
  // `scale`: what the gradients are multiplied by (loss scale x accumulation steps).
  // Collective; synchronizes the compute stream. `device_done`, if not null, is recorded on the
  // compute stream after the device work, before the host waits for it (DeviceStepTimer).
  absl::StatusOr<Result> Measure(double scale, Device::Event device_done = nullptr);

 private:
  const memory::Plan& plan_;
  const ShardLayout& layout_;
  Device* const dev_;
  const Device::Stream compute_;
  HostCollectives* const host_;
  float* const device_table_;
  struct Slice {
    const char* data;
    int64_t n;
  };
  // The part of unit u's reduced shard at `shard` (region(u).n elements of its grad dtype)
  // that this rank measures: all of it when flat, its replica's flat slice with HSDP.
  // REQUIRES: stage >= 1.
  Slice OwnSlice(int u, const char* shard) const;
  // The readback, allocated on first use: MaxRanges() fp32 squared norms, then as many
  // finiteness bytes, one each per range of Measure's device call.
  absl::StatusOr<char*> Readback();
  size_t MaxRanges() const;
  size_t ReadbackBytes() const;
  // Measure's ranges and, per range, its table cell (-1: checked for finiteness only) and unit;
  // reserved for MaxRanges() once, so that no step allocates.
  struct RangeSlot {
    int cell;
    int unit;
  };
  std::vector<Device::NormRange> ranges_;
  std::vector<RangeSlot> slots_;
  // Measure's (world, units + 1) table of partials, last column the finiteness flags, and
  // per unit whether every range of it was finite: sized once, refilled every step.
  std::vector<float> table_;
  std::vector<uint8_t> unit_finite_;
  memory::RawAllocator* const pinned_;  // null: the host device (readback_heap_)
  char* readback_ = nullptr;
  std::vector<char> readback_heap_;

  // Gradient offload of some unit: the offloaded units' partials come from MeasureUnit.
  const bool early_ = false;
  // Per unit, MeasureUnit's results (written by the device into the plan's norm_partials)
  // and whether it ran this window.
  float* const early_sumsq_;   // (units) fp32
  bool* const early_finite_;   // (units) one byte each, after early_sumsq_
  std::vector<uint8_t> early_measured_;
};

}  // namespace zero_internal
}  // namespace zerort

#endif  // ZERORT_ZERO_INTERNAL_GRAD_NORM_H_
