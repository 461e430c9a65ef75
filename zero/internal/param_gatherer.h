// ParamGatherer: turns parameter shards into the full parameters the trainer reads.
//
// Stages 1-2 keep every parameter whole: after an optimizer update each unit is all-gathered in
// place (AllGatherUpdated). Stage 3 keeps only this rank's shard; a unit is all-gathered into one
// of the plan's gather slots of its size class (memory/plan.h) by Gather(unit) and stays there
// after Release(unit) until its slot is needed again (least recently used first). Gather also
// prefetches the next units in the same direction (forward or backward) into free slots of their
// class, up to stage3_prefetch_bucket_size elements. Persistent units (under
// stage3_param_persistence_threshold) stay whole on every rank in their own buffer and are
// refreshed by AllGatherUpdated. After an update or a restore the gathered copies are stale:
// Invalidate() drops every unheld one.
//
// hpZ (memory::Hpz, ZeRO++'s zero_hpz_partition_size K): a unit's first all-gather since the
// last Invalidate runs over every rank and also keeps this rank's block (rank % K of K) of the
// gathered unit in `secondary`; its later gathers (backward, the window's next micro-steps)
// all-gather those blocks within the K consecutive ranks of this rank's node. The blocks are
// copies of the gathered bytes, so the parameters are bitwise the same either way.
//
// The slot policy itself (which slot a gather takes: LRU per size class; the prefetch; the
// direction; what Invalidate drops) is memory::GatherSlots (memory/gather_slots.h); this class
// performs its decisions. memory/plan.cc (SimulateStage3Gathers) drives the same class in the
// standard order to count the plan's stage-3 gather bytes exactly, which
// //zero:engine_link_bytes_test measures against what the engine sends.
//
// Ordering: collectives run on StreamOrder::side() after BeforeComm; a slot is refilled only
// after the trainer's work on its previous unit (SlotReleased), and handed to the trainer only
// after its all-gather (BeforeSlotUse).
//
// Thread safety: not thread-safe; one per engine.
#ifndef ZERORT_ZERO_INTERNAL_PARAM_GATHERER_H_
#define ZERORT_ZERO_INTERNAL_PARAM_GATHERER_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "comm/communicator.h"
#include "device/device.h"
#include "memory/gather_slots.h"
#include "memory/plan.h"
#include "zero/internal/engine_memory.h"
#include "zero/internal/step_timer.h"
#include "zero/internal/stream_order.h"
#include "zero/internal/unit_context.h"
#include "zero/internal/unit_store.h"

namespace zerort {
namespace zero_internal {

class ParamGatherer {
 public:
  // Every pointer must outlive this object. `params`: the full compute-dtype parameters
  // (stages 0-2). Stage 3 gathers this rank's shard from `store`, wherever it lives; a failed
  // read (a shard in a file) fails the gather on every rank after the same collectives.
  // `secondary`: hpZ's memory::Plan hpz_secondary buffer, null without hpZ.
  ParamGatherer(const UnitContext& ctx, char* params, const SlottedBuffer& slots,
                char* persistent, UnitStore* store, char* secondary = nullptr);

  // The compute-dtype parameter `p` (memory::Plan::params): stable in stages 0-2 and for
  // persistent units; in stage 3 FailedPrecondition unless its unit is gathered.
  absl::StatusOr<void*> Param(const memory::ParamLayout& p) const;
  // Stage 3 (no-ops otherwise and for persistent units). Collective.
  absl::Status Gather(int unit);
  absl::Status Release(int unit);
  // Reference-counted holds by parameter: each distinct unit of `params` is held once more
  // (gathered on its first hold) / once less (released on its last). Gather/Release(unit) are
  // a hold that must be the unit's only one. Counted in every stage, so an unbalanced Release
  // fails in stage 0 as it would in stage 3; an Acquire that fails (no free slot) or a Release
  // of a unit not held changes no count. Collective in stage 3.
  absl::Status Acquire(absl::Span<const int> params);
  absl::Status ReleaseParams(absl::Span<const int> params);
  // Holds of `unit` (Acquire and Gather) not yet released.
  int holds(int unit) const { return refs_[unit]; }
  // After an update of this rank's shard of `unit`: all-gathers it into the full parameters
  // (stages 1-2) or its persistent copy (stage 3). REQUIRES: StreamOrder::BeforeComm since the
  // shard was written. Collective.
  absl::Status AllGatherUpdated(int unit);
  // Unit `unit`'s whole compute-dtype parameters from host `values` (padded elements) where a
  // whole copy is kept: stages 0-2's parameters, a stage-3 persistent copy; enqueued on the
  // compute stream (synchronize before `values` goes).
  absl::Status StoreWhole(int unit, const char* values);
  // Forgets every gathered copy that the trainer does not hold (they hold old parameters), and
  // every hpZ secondary block.
  void Invalidate();
  // hpZ: whether `unit`'s secondary block holds its current parameters (tests).
  bool has_secondary(int unit) const { return secondary_valid_[unit]; }

 private:
  // Stage 3: the whole-unit buffer of a persistent unit (padded elements), else null.
  char* persistent_copy(int unit) const;
  // Stage 3 and not persistent: the unit lives in a gather slot.
  bool gathers(int unit) const {
    return ctx_.stage == 3 && !ctx_.plan.units[unit].persistent;
  }
  absl::Status Hold(int unit);
  absl::Status Drop(int unit);
  std::vector<int> UnitsOf(absl::Span<const int> params) const;
  // A slot of `unit`'s size class (memory::GatherSlots::Take: an empty one, else the least
  // recently used unheld one, its unit evicted), or FailedPrecondition naming the held units.
  absl::StatusOr<int> AcquireSlot(int unit);
  absl::Status GatherIntoSlot(int unit, int slot);
  absl::Status GatherShard(int unit, char* full);
  // hpZ: the all-gather of `unit` from the node's secondary blocks, or, when they are stale,
  // over every rank, keeping this rank's block.
  absl::Status GatherHpz(int unit, char* full);
  absl::Status Prefetch(int from, int direction);

  const UnitContext ctx_;
  char* const params_;
  const SlottedBuffer gather_;
  char* const persistent_;
  UnitStore* const store_;
  std::vector<int64_t> persistent_offset_;  // per unit, elements into persistent_, or -1
  char* const secondary_;                    // hpZ only: (sum of gathered padded / K)
  const int hpz_;                            // K; 1 without hpZ
  std::vector<int64_t> secondary_offset_;    // per gathered unit, elements into secondary_
  std::vector<bool> secondary_valid_;        // per unit: its block is current
  memory::GatherSlots slots_;  // which unit is in which gather slot, held, the LRU clock
  std::vector<int> refs_;      // per unit: holds (Acquire, Gather) not yet released
};

}  // namespace zero_internal
}  // namespace zerort

#endif  // ZERORT_ZERO_INTERNAL_PARAM_GATHERER_H_
