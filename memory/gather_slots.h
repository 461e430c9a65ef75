// memory::GatherSlots: the stage-3 gather slot policy, one piece of code for the engine and the
// plan.
//
// Stage 3 all-gathers a unit into one of the plan's gather slots (memory::Plan's
// gather_buffer) of its size class (SlotClassElements) and leaves it there after its release
// until the slot is needed again. This class decides, and only decides: which unit is in which
// slot, which slots are held, the use clock, the slot a gather takes, the units a gather
// prefetches and where, and what an update invalidates. It does no I/O.
//
//  - A gather of a unit not in a slot takes the empty slot of its class with the lowest index,
//    else the least recently used unheld one (its unit is evicted), else none: every slot of
//    the class is held.
//  - A hold makes the unit's slot held and used now; the pass direction of the next hold is
//    forward (+1) when its unit is after the last held one, else backward (-1).
//  - After a hold of `from`, the prefetch walks the units after `from` in the pass direction:
//    persistent units are skipped, every other unit is charged to the budget
//    (stage3_prefetch_bucket_size elements; the walk stops when it is spent), a unit already in
//    a slot is skipped, and one that is not takes the empty slot of its class with the lowest
//    index, else the least recently used unheld slot of a unit already passed (before `from` in
//    the direction); when there is none the walk stops. So a prefetch never evicts a unit the
//    pass is about to need.
//  - Invalidate (after an update or a restore) empties every unheld slot.
//
// Two drivers: zero/internal/param_gatherer.cc performs each decision (the all-gather, its
// stream ordering), and memory/plan.cc (SimulateStage3Gathers) replays the standard order to
// count the plan's gathers per step, which //zero:engine_link_bytes_test measures against the
// engine's bytes.
//
//   GatherSlots slots(slot_elements, unit_padded, persistent, prefetch_elements);
//   const int direction = slots.Direction(u);  // before the hold
//   if (slots.slot_of(u) < 0) {
//     const GatherSlots::Decision d = slots.Take(u);  // d.slot < 0: every slot is held
//     ... all-gather u into d.slot ...;  slots.Filled(u, d.slot);
//   }
//   slots.Hold(u);
//   GatherSlots::Walk walk = slots.StartPrefetch(u, direction);
//   for (auto d = slots.NextPrefetch(&walk); d.unit >= 0; d = slots.NextPrefetch(&walk)) {
//     ... all-gather d.unit into d.slot ...;  slots.Filled(d.unit, d.slot);
//   }
//   ... the trainer uses u ...;  slots.Release(u);
//
// Cost: each unit's class and each class's slots are indexed once, so a decision looks only at
// the slots of one class (no per-query scan of every slot's size).
//
// Thread safety: not thread-safe; a value owned by one driver.
#ifndef ZERORT_MEMORY_GATHER_SLOTS_H_
#define ZERORT_MEMORY_GATHER_SLOTS_H_

#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace zerort {
namespace memory {

// The slot size a unit of `padded` elements uses in a buffer of size classes: the smallest
// slot of `slot_elements` that holds it (0 when none does). A unit never takes a slot of a
// larger class, so the small units cannot starve the large ones of their slots.
int64_t SlotClassElements(absl::Span<const int64_t> slot_elements, int64_t padded);

class GatherSlots {
 public:
  // `slot_elements`: each slot's elements, in slot order. `unit_padded`, `persistent`: per
  // unit, its padded elements and whether it stays whole outside the slots (never gathered,
  // skipped by the prefetch). `prefetch_elements`: stage3_prefetch_bucket_size.
  // REQUIRES: unit_padded.size() == persistent.size().
  GatherSlots(std::vector<int64_t> slot_elements, std::vector<int64_t> unit_padded,
              std::vector<bool> persistent, int64_t prefetch_elements);

  // A slot taken for a gather: `unit` goes into `slot`, whose previous unit `evicted` (or -1)
  // is no longer in a slot. slot -1: no slot (Take: every slot of the class is held);
  // unit -1: the prefetch walk stopped.
  struct Decision {
    int unit = -1;
    int slot = -1;
    int evicted = -1;
  };
  // The prefetch walk after one hold (StartPrefetch / NextPrefetch).
  struct Walk {
    int from = 0;
    int direction = -1;
    int next = 0;         // the next unit to look at
    int64_t budget = 0;   // prefetch elements left
  };

  int slot_count() const { return static_cast<int>(slots_.size()); }
  int unit_count() const { return static_cast<int>(unit_slot_.size()); }
  int64_t slot_elements(int s) const { return slots_[s].elements; }
  // The slot holding `unit`'s gathered parameters, or -1.
  int slot_of(int unit) const { return unit_slot_[unit]; }
  // The unit in slot s, or -1; whether it is held; the use clock's value at its last fill or
  // hold (kept when the slot is emptied).
  int unit_in(int s) const { return slots_[s].unit; }
  bool held(int s) const { return slots_[s].held; }
  uint64_t last_use(int s) const { return slots_[s].last_use; }
  // The unit of the last Hold, or -1.
  int last_held() const { return last_held_; }
  // The slots of `unit`'s size class, in slot order (none when no slot holds it).
  absl::Span<const int> ClassSlots(int unit) const;

  // The direction of a pass that holds `unit` next: +1 when it comes after the last held unit,
  // else -1 (also before the first hold).
  int Direction(int unit) const { return last_held_ >= 0 && unit > last_held_ ? 1 : -1; }

  // Takes a slot for a gather of `unit`: the empty slot of its class with the lowest index,
  // else the least recently used unheld one, whose unit is evicted now. {unit, -1, -1} and no
  // change when every slot of the class is held (or it has none). REQUIRES: slot_of(unit) < 0.
  Decision Take(int unit);
  // `unit`'s gather into slot s (taken for it) has landed: the unit is in s, used now.
  void Filled(int unit, int s);
  // Holds `unit`: its slot is held and used now, and it is the last held unit.
  // REQUIRES: slot_of(unit) >= 0.
  void Hold(int unit);
  // Releases `unit`'s slot (it stays there until the slot is taken). REQUIRES: slot_of(unit) >= 0.
  void Release(int unit);

  // The prefetch after a hold of `from` in `direction` (the Direction before that hold).
  Walk StartPrefetch(int from, int direction) const;
  // The walk's next prefetch: a unit and the slot taken for it (its unit evicted now), to be
  // gathered and then Filled; unit -1 when the walk stops. The caller fills each decision
  // before asking for the next.
  Decision NextPrefetch(Walk* walk);

  // Empties every slot whose unit is not held (their parameters are stale).
  void Invalidate();

 private:
  struct Slot {
    int64_t elements = 0;
    int unit = -1;
    bool held = false;
    uint64_t last_use = 0;
  };
  void Evict(int s);
  // The empty slot of `unit`'s class with the lowest index, else the least recently used unheld
  // one whose unit `evictable(unit)` allows, else -1.
  template <typename Evictable>
  int PickSlot(int unit, const Evictable& evictable) const;
  // `unit` takes slot s (evicting its unit); s < 0: no slot, nothing changes.
  Decision Claim(int unit, int s);

  std::vector<Slot> slots_;
  std::vector<int64_t> unit_padded_;
  std::vector<bool> persistent_;
  const int64_t prefetch_elements_;
  std::vector<int> unit_class_;               // per unit: index into class_slots_, or -1
  std::vector<std::vector<int>> class_slots_;  // per size class: its slots in order
  std::vector<int> unit_slot_;                // per unit, or -1
  uint64_t clock_ = 0;
  int last_held_ = -1;
};

}  // namespace memory
}  // namespace zerort

#endif  // ZERORT_MEMORY_GATHER_SLOTS_H_
