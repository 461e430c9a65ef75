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
// Thread safety: not thread-safe; one per engine.
#ifndef ZERORT_ZERO_INTERNAL_GRAD_NORM_H_
#define ZERORT_ZERO_INTERNAL_GRAD_NORM_H_

#include "absl/status/statusor.h"
#include "device/device.h"
#include "memory/plan.h"
#include "zero/internal/host_collectives.h"
#include "zero/internal/shard_layout.h"

namespace zerort {
namespace zero_internal {

class GradNorm {
 public:
  // Every argument must outlive this object. `device_table`: (world, units + 1) fp32 device
  // memory to stage the exchange through (the plan's norm table; may be null).
  GradNorm(const memory::Plan& plan, const ShardLayout& layout, Device* device,
           Device::Stream compute, HostCollectives* host, float* device_table)
      : plan_(plan), layout_(layout), dev_(device), compute_(compute), host_(host),
        device_table_(device_table) {}

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
};

}  // namespace zero_internal
}  // namespace zerort

#endif  // ZERORT_ZERO_INTERNAL_GRAD_NORM_H_
