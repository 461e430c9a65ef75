// ShardLayout: where this rank's part of every unit lives, built once from the plan.
//
// For each unit the table holds the region the optimizer updates on this rank: the reduced
// gradient it reads, the fp32 master, m and v, and the compute-dtype parameters it writes,
// with their element count. Stage 0 holds every unit whole on every rank, so its region is the
// whole padded unit; stages 1-3 own shard `rank` of each unit (unit.shard elements); with HSDP
// (memory::Hierarchical) shard rank % shard_group_size, which its replicas own too. Where the
// reduced gradient sits depends on the stage and on gradient accumulation:
//
// (the accumulator, and with fp32_grad_accum also used without accumulation, is in
// memory::ReducedGradDType):
//
//   stage 0:  the full gradients, or the full accumulator when accumulating
//   stage 1:  this rank's block of the full gradients, or the shard accumulator (always with
//             offload_optimizer)
//   stage 2-3: the gradient shard (accumulated in place)
//
// With offload_optimizer (memory::GradOffload) the reduced gradient is in host memory: the
// reductions run in device buffers and GradBuckets copies each result there. With
// offload_optimizer.ratio < 1 that holds for the offloaded units (memory::Unit::offloaded,
// Region::offloaded) only: the units kept on the device have every array where they would have
// it without offload, in the plan's buffers of the kept part (ModelStateBuffers::kept), at
// memory::Unit::state_offset.
//
// Stages 0-1 hold full gradients only for units not reduced in place in the trainer's buffer
// (memory::Unit::grad_offset). Without accumulation the reduced gradient of a unit reduced in
// place that fills its padded size stays in the trainer's buffer (memory::
// ReducedInTrainerBuffer): its `grad` is null until the trainer hands the buffer over
// (SetGradInTrainerBuffer); stage 1 keeps that of one with padding in the plan's grad_reduced
// (memory::Unit::grad_shard_offset).
//
// Frozen units (plan.units[u].frozen, after every trainable unit) have parameters only.
//
// A compact optimizer-state form (memory::OptimizerStateForm, docs/compact_state.md) keeps m
// and v in bf16, and a compact master as the bf16 parameter shard itself (master_bf16 ==
// param) or as a bf16 copy beside the state (a host optimizer beside device parameters), with
// a remainder array for the lossless form; `master` is then null.
//
// Every engine path that touches owned state (InitParams, the optimizer, snapshots, restore,
// GatherMasterWeights, the offload pipeline) reads this table instead of redoing the arithmetic.
//
// Thread safety: immutable after construction but for SetGradInTrainerBuffer; not thread-safe.
#ifndef ZERORT_ZERO_INTERNAL_SHARD_LAYOUT_H_
#define ZERORT_ZERO_INTERNAL_SHARD_LAYOUT_H_

#include <cstdint>
#include <vector>

#include "base/dtype.h"
#include "memory/plan.h"

namespace zerort {
namespace zero_internal {

// The engine's model-state buffers (null when the plan has none). master is null in fp32 mode
// without offload: the parameters themselves are then the fp32 weights.
struct ModelStateBuffers {
  char* params = nullptr;   // compute dtype: full (stages 0-2) or the shard (stage 3)
  char* grads = nullptr;    // compute dtype: full (stages 0-1); the shard (stages 2-3) in
                            // the reduced-gradient dtype
  float* master = nullptr;  // fp32: full (stage 0) or the shard (stages 1-3)
  char* m = nullptr;        // moment dtype (fp32, or bf16)
  char* v = nullptr;
  char* accum = nullptr;    // reduced-gradient dtype (memory::ReducedGradDType): full
                            // (stage 0) or the shard (stage 1), with GAS > 1 or fp32;
                            // stage 1 without either, the plan's grad_reduced
  uint16_t* master_bf16 = nullptr;  // a compact master's bf16 copy, where the plan has one
  uint16_t* remainder = nullptr;    // MasterForm::kBf16Remainder
  // With offload_optimizer the buffers above that hold optimizer state (grads in stages 2-3,
  // master, m, v, accum, master_bf16, remainder) are the offloaded part's; the part that
  // offload_optimizer.ratio < 1 keeps on the device is here, laid out as without offload over
  // the kept units, in their own form (memory::StateFormOf(o, false): a compact master in the
  // parameter shard) (null when there is none, or without offload).
  struct Kept {
    char* grads = nullptr;    // stages 2-3: the kept units' gradient shards
    float* master = nullptr;  // null in fp32 training: the parameters are the weights
    char* m = nullptr;        // moment dtype
    char* v = nullptr;
    char* accum = nullptr;    // stage 1, with GAS > 1 or fp32; without either, the plan's
                              // grad_reduced (kept units reduced in place, with padding)
    uint16_t* master_bf16 = nullptr;  // a compact master's bf16 copy (none: it is the params)
    uint16_t* remainder = nullptr;    // MasterForm::kBf16Remainder
  };
  Kept kept;
};

// This rank's region of one unit.
struct Region {
  int64_t n = 0;             // elements: unit.padded in stage 0, unit.shard otherwise
  int64_t unit_begin = 0;    // where the region starts inside the padded unit
  int64_t owned_begin = 0;   // where this rank's shard starts inside the region
  bool whole_unit = false;   // the region is the whole unit (stage 0)
  // offload_optimizer: the unit's optimizer state and reduced gradient are offloaded (host
  // memory or a file; the host AdamW updates them). False for a unit that
  // offload_optimizer.ratio < 1 keeps on the device, and without offload.
  bool offloaded = false;
  char* grad = nullptr;        // (n) grad_dtype: the reduced gradient (the reduction writes it;
                               // host memory with gradient offload)
  DType grad_dtype = DType::kF32;  // the compute dtype, or fp32 with fp32_grad_accum
  float* master = nullptr;     // (n) fp32; master, m, v null when they live in a file, and
                               // master null with a compact master form
  char* m = nullptr;           // (n) moment_dtype
  char* v = nullptr;           // (n) moment_dtype
  char* param = nullptr;       // (n) compute dtype; null when the shards live in a file
  // Compact optimizer state (memory::OptimizerStateForm; null / fp32 / kF32 otherwise):
  memory::MasterForm master_form = memory::MasterForm::kF32;
  DType moment_dtype = DType::kF32;
  // (n) a compact master's bf16 part: `param` itself (form.master_in_params) or its copy;
  // null when it lives in a file.
  uint16_t* master_bf16 = nullptr;
  uint16_t* remainder = nullptr;  // (n) kBf16Remainder; null when it lives in a file
  // Global index of element 0 in the flat order of memory::Unit::index_offset, the same at
  // every stage and world size: where stochastic rounding draws for this region.
  int64_t first_index = 0;
  // fp32 training without a master copy: `master` is `param`, updated in place.
  bool params_are_master = false;
  // A unit of frozen parameters: only `param` is set (grad, master, m and v are null), and
  // UnitStore derives its fp32 weights from the parameters.
  bool frozen = false;

  // A compact form: the state is not the fp32 master, m and v.
  bool compact() const {
    return master_form != memory::MasterForm::kF32 || moment_dtype != DType::kF32;
  }
};

class ShardLayout {
 public:
  ShardLayout(const memory::Plan& plan, const ModelStateBuffers& buffers);

  const Region& region(int unit) const { return regions_[unit]; }
  int num_units() const { return static_cast<int>(regions_.size()); }

  // A unit reduced in place whose reduced gradient stays in the trainer's buffer (see above):
  // `unit_base` is where the unit's first element lies there (null: not handed over). Set
  // by GradBuckets when the trainer hands its buffer over; read by the step.
  // REQUIRES: memory::ReducedInTrainerBuffer(plan, its unit).
  void SetGradInTrainerBuffer(int unit, char* unit_base);

 private:
  std::vector<Region> regions_;
};

}  // namespace zero_internal
}  // namespace zerort

#endif  // ZERORT_ZERO_INTERNAL_SHARD_LAYOUT_H_
