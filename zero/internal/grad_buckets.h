// GradBuckets: the gradient buffers the trainer writes, and the reduction of each unit as soon
// as every parameter of it is ready.
//
// Stages 0-1: grad(i) points into the full gradients. Stages 2-3: a unit's gradients are
// written into one of the plan's full-unit buckets, handed out zero-filled on the unit's first
// grad(i) and free again once its reduce-scatter has read it. When the last GradReady of a
// unit arrives the unit is reduced at once (Reduce), overlapping the rest of backward:
//
//   stage 0:   all-reduce (avg) of the full unit
//   stage 1:   reduce-scatter of the full unit into this rank's block
//   stage 2-3: reduce-scatter of the bucket into the gradient shard
//
// With gradient accumulation the reduced gradients of each micro-step are added after the
// reduction (stages 0-1 into the accumulator, stages 2-3 into the shard itself), so that every
// stage sums every element in the same order.
//
// Local accumulation (stages 0-1, the plan's grad_local): in a micro-step without sync (see
// set_sync) a complete unit is added into grad_local instead of reduced; the next synced
// micro-step adds its own gradients there too, writes the sum back into the unit and reduces
// it once. The sum order over micro-steps changes (rank-local first, then across ranks).
//
// Gradient offload (memory::GradOffload, with offload_optimizer): the reduced gradient lives in
// host memory (ShardLayout's Region::grad). Each unit is reduced in place in its device buffer
// (bucket, or stage 1's full gradients) and its block copied down on the comm side right after,
// so the bucket's reuse waits for the copy too. A later micro-step of the window adds on the
// device, through the plan's grad_accum_stage: the host sum up, Accumulate, the sum down, so the
// arithmetic is device accumulation's, bit for bit. On the window's last micro-step the final
// shard is measured (GradNorm::MeasureUnit) on the device before it leaves. With
// offload_optimizer.ratio < 1 only the offloaded units (Region::offloaded) go this way; the units
// kept on the device are reduced into their device shard as without offload.
//
// Frozen parameters (memory::ParamSpec::frozen) have no gradient: grad, GradReady and
// SetSource fail naming them, and Step never waits for them.
//
// Thread safety: not thread-safe; one per engine.
#ifndef ZERORT_ZERO_INTERNAL_GRAD_BUCKETS_H_
#define ZERORT_ZERO_INTERNAL_GRAD_BUCKETS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "device/device.h"
#include "memory/plan.h"
#include "zero/internal/engine_memory.h"
#include "zero/internal/grad_norm.h"
#include "zero/internal/shard_layout.h"
#include "zero/internal/step_timer.h"
#include "zero/internal/stream_order.h"
#include "zero/internal/unit_context.h"

namespace zerort {
namespace zero_internal {

class GradBuckets {
 public:
  // Every pointer, and `layout`, must outlive this object. The reduced gradients go where
  // `layout` says (Region::grad); `wire`: the plan's fp32 grad_wire scratch (null when neither
  // fp32 option is set).
  GradBuckets(const UnitContext& ctx, const ShardLayout& layout, const ModelStateBuffers& state,
              const SlottedBuffer& buckets, float* wire, char* local = nullptr);

  // The compute-dtype gradient buffer of parameter i for this micro-step (zero-filled).
  // FailedPrecondition after its GradReady, or when every bucket holds an unfinished unit.
  absl::StatusOr<void*> Grad(int i);
  // Marks parameter i ready; returns true when that completes its unit (reduce it next).
  // FailedPrecondition when it already is.
  absl::StatusOr<bool> MarkReady(int i);
  // Reduces `unit` (see above); `first_micro`: no earlier micro-step of its accumulation
  // window reduced it (the reduced result is stored, not added); `last_micro`: this is the
  // window's last micro-step (gradient offload measures the final shard). Collective when
  // synced.
  absl::Status Reduce(int unit, bool first_micro, bool last_micro = true);
  // Gradient offload: where the final shards are measured, and the plan's grad_accum_stage
  // (device; null without accumulation). REQUIRES: called before any Reduce when
  // memory::GradOffload(plan.options); `norm` outlives this object.
  void SetGradOffload(GradNorm* norm, char* accum_stage) {
    norm_ = norm;
    accum_stage_ = accum_stage;
  }
  // Whether this micro-step's units are reduced (true) or added into grad_local (false).
  // REQUIRES: a grad_local buffer for false; the same value for every unit of a micro-step.
  void set_sync(bool sync) { sync_ = sync; }
  bool sync() const { return sync_; }

  // Parameter i's gradient is read from `buffer` (compute dtype, its numel elements; null
  // undoes it) at MarkReady instead of the engine's slot. Returns true when its unit is reduced
  // straight from it (the parameter alone fills its padded unit), false when MarkReady copies
  // it into the slot. FailedPrecondition while its unit is being written in this micro-step.
  absl::StatusOr<bool> SetSource(int i, void* buffer);
  // DeepSpeed's prescale_gradients / gradient_predivide_factor: every unit is multiplied by
  // `factor` (in the wire dtype, on the comm side, in place) before a reduction that sums
  // (`average` false) or averages. Default: factor 1, average. Set once, before any Reduce.
  void SetPrescale(float factor, bool average) {
    prescale_ = factor;
    op_ = average ? comm::ReduceOp::kAvg : comm::ReduceOp::kSum;
  }
  // Units whose reduction has been issued in this micro-step.
  int reduced_units() const { return reduced_; }

  bool ready(int i) const { return ready_[i] != 0; }
  bool any_ready() const;
  // The first parameter not yet ready in this micro-step, or -1.
  int FirstMissing() const;
  // Starts the next micro-step: no parameter is ready.
  void StartMicroStep();
  // After an optimizer step: zero-fills the full gradients (stages 0-1) for the next window.
  absl::Status ClearFullGradients();

 private:
  // A reduced block: n elements of dtype at data.
  struct Reduced {
    char* data;
    DType dtype;
    int64_t n;
  };
  absl::Status CheckTrainable(int i, const char* call) const;
  absl::StatusOr<int> AcquireBucket(int unit, const memory::ParamLayout& p);
  absl::StatusOr<void*> Slot(int i);  // the engine's buffer for parameter i
  bool direct(int unit) const;        // reduced straight from a SetSource buffer
  absl::StatusOr<Reduced> Collective(char* full, const memory::Unit& unit, char* out);
  absl::Status Deposit(char* dst, const Reduced& r, bool first, char* spare);
  absl::Status DepositToHost(int u, char* dst, const Reduced& r, bool first, char* spare);
  char* Spare(char* full, const memory::Unit& unit) const;
  absl::Status ReduceFull(const memory::Unit& unit, int u, bool first_micro);  // stages 0-1
  absl::Status AddLocal(const memory::Unit& unit, const char* full, bool first);
  absl::Status MergeLocal(const memory::Unit& unit, char* full);
  absl::Status ReduceBucket(int u, bool first_micro);                      // stages 2-3

  const UnitContext ctx_;
  const ShardLayout& layout_;
  const int gas_;
  const DType grad_dtype_;  // of the reduced gradients (accumulator, stage 2-3 shard)
  const DType wire_dtype_;  // gradients are reduced in
  float* const wire_;
  char* const local_;  // grad_local, or null
  char* const grads_;
  const SlottedBuffer buckets_;
  std::vector<uint8_t> ready_;      // per param
  std::vector<char*> source_;       // per param: SetSource buffer, or null
  int reduced_ = 0;                 // units reduced in this micro-step
  bool sync_ = true;                // this micro-step reduces
  int local_micros_ = 0;            // micro-steps of this window summed into grad_local
  std::vector<int> pending_;        // per unit: params not yet ready
  std::vector<int> unit_bucket_;    // per unit: bucket index, or -1
  std::vector<uint8_t> bucket_busy_;  // per bucket
  GradNorm* norm_ = nullptr;          // SetGradOffload
  char* accum_stage_ = nullptr;       // SetGradOffload: (max shard) grad dtype, device
  bool last_micro_ = true;            // of the Reduce running
  float prescale_ = 1.0f;             // SetPrescale
  comm::ReduceOp op_ = comm::ReduceOp::kAvg;
};

}  // namespace zero_internal
}  // namespace zerort

#endif  // ZERORT_ZERO_INTERNAL_GRAD_BUCKETS_H_
