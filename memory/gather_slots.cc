#include "memory/gather_slots.h"

#include <algorithm>
#include <utility>

namespace zerort {
namespace memory {

int64_t SlotClassElements(absl::Span<const int64_t> slot_elements, int64_t padded) {
  int64_t best = 0;
  for (int64_t e : slot_elements) {
    if (e >= padded && (best == 0 || e < best)) best = e;
  }
  return best;
}

GatherSlots::GatherSlots(std::vector<int64_t> slot_elements, std::vector<int64_t> unit_padded,
                         std::vector<bool> persistent, int64_t prefetch_elements)
    : slots_(slot_elements.size()),
      unit_padded_(std::move(unit_padded)),
      persistent_(std::move(persistent)),
      prefetch_elements_(prefetch_elements),
      unit_slot_(unit_padded_.size(), -1) {
  // The distinct slot sizes, ascending; each class's slots in slot order.
  std::vector<int64_t> classes = slot_elements;
  std::sort(classes.begin(), classes.end());
  classes.erase(std::unique(classes.begin(), classes.end()), classes.end());
  class_slots_.resize(classes.size());
  for (size_t s = 0; s < slot_elements.size(); ++s) {
    slots_[s].elements = slot_elements[s];
    const size_t c =
        std::lower_bound(classes.begin(), classes.end(), slot_elements[s]) - classes.begin();
    class_slots_[c].push_back(static_cast<int>(s));
  }
  unit_class_.assign(unit_padded_.size(), -1);
  for (size_t u = 0; u < unit_padded_.size(); ++u) {
    const int64_t e = SlotClassElements(classes, unit_padded_[u]);
    if (e == 0) continue;
    unit_class_[u] =
        static_cast<int>(std::lower_bound(classes.begin(), classes.end(), e) - classes.begin());
  }
}

absl::Span<const int> GatherSlots::ClassSlots(int unit) const {
  const int c = unit_class_[unit];
  if (c < 0) return {};
  return class_slots_[c];
}

void GatherSlots::Evict(int s) {
  unit_slot_[slots_[s].unit] = -1;
  slots_[s].unit = -1;
}

template <typename Evictable>
int GatherSlots::PickSlot(int unit, const Evictable& evictable) const {
  int best = -1;
  for (int s : ClassSlots(unit)) {
    const Slot& slot = slots_[s];
    if (slot.held) continue;
    if (slot.unit < 0) return s;
    if (evictable(slot.unit) && (best < 0 || slot.last_use < slots_[best].last_use)) best = s;
  }
  return best;
}

GatherSlots::Decision GatherSlots::Claim(int unit, int s) {
  Decision d;
  d.unit = unit;
  d.slot = s;
  if (s < 0) return d;
  d.evicted = slots_[s].unit;
  if (d.evicted >= 0) Evict(s);
  return d;
}

GatherSlots::Decision GatherSlots::Take(int unit) {
  return Claim(unit, PickSlot(unit, [](int) { return true; }));
}

void GatherSlots::Filled(int unit, int s) {
  slots_[s].unit = unit;
  slots_[s].last_use = ++clock_;
  unit_slot_[unit] = s;
}

void GatherSlots::Hold(int unit) {
  Slot& slot = slots_[unit_slot_[unit]];
  slot.held = true;
  slot.last_use = ++clock_;
  last_held_ = unit;
}

void GatherSlots::Release(int unit) { slots_[unit_slot_[unit]].held = false; }

GatherSlots::Walk GatherSlots::StartPrefetch(int from, int direction) const {
  Walk w;
  w.from = from;
  w.direction = direction;
  w.next = from + direction;
  w.budget = prefetch_elements_;
  return w;
}

GatherSlots::Decision GatherSlots::NextPrefetch(Walk* w) {
  const int n = unit_count();
  for (; w->next >= 0 && w->next < n && w->budget > 0; w->next += w->direction) {
    const int u = w->next;
    if (persistent_[u]) continue;
    w->budget -= unit_padded_[u];
    if (unit_slot_[u] >= 0) continue;
    // Only a unit the pass has passed may be evicted: never one it is about to need.
    const int pick =
        PickSlot(u, [&](int resident) { return (resident - w->from) * w->direction < 0; });
    if (pick < 0) break;
    w->next += w->direction;
    return Claim(u, pick);
  }
  // Stopped: a later call stops too.
  w->next = w->direction > 0 ? n : -1;
  return Decision();
}

void GatherSlots::Invalidate() {
  for (int s = 0; s < slot_count(); ++s) {
    if (slots_[s].unit >= 0 && !slots_[s].held) Evict(s);
  }
}

}  // namespace memory
}  // namespace zerort
