#include "memory/gather_slots.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

namespace zerort {
namespace memory {
namespace {

// One gather: `unit` into `slot`, whose previous unit was `evicted` (or -1).
struct Gathered {
  int unit, slot, evicted;
};

std::string Describe(const std::vector<Gathered>& g) {
  std::string out;
  for (const Gathered& x : g) {
    out += "(" + std::to_string(x.unit) + "->" + std::to_string(x.slot) + " evicts " +
           std::to_string(x.evicted) + ")";
  }
  return out;
}

// The policy as param_gatherer.h and gather_slots.h state it, by brute force: no index, every
// question answered by scanning every slot.
struct Reference {
  std::vector<int64_t> sizes, padded;
  std::vector<bool> persistent;
  int64_t prefetch = 0;
  std::vector<int> unit;  // per slot, or -1
  std::vector<bool> held;
  std::vector<uint64_t> use;
  uint64_t clock = 0;
  int last_held = -1;

  Reference(std::vector<int64_t> s, std::vector<int64_t> p, std::vector<bool> pers, int64_t pf)
      : sizes(s), padded(p), persistent(pers), prefetch(pf), unit(s.size(), -1),
        held(s.size(), false), use(s.size(), 0) {}

  // Slot s is in u's class: its size is the smallest slot size that holds u.
  bool InClass(int s, int u) const {
    int64_t smallest = -1;
    for (int64_t e : sizes) {
      if (e >= padded[u] && (smallest < 0 || e < smallest)) smallest = e;
    }
    return smallest >= 0 && sizes[s] == smallest;
  }
  int Where(int u) const {
    for (size_t s = 0; s < unit.size(); ++s) {
      if (unit[s] == u) return static_cast<int>(s);
    }
    return -1;
  }
  // Among `candidates`: the empty one with the lowest index, else the least recently used.
  int Choose(const std::vector<int>& candidates) const {
    for (int s : candidates) {
      if (unit[s] < 0) return s;  // candidates are in index order
    }
    int best = -1;
    for (int s : candidates) {
      if (best < 0 || use[s] < use[best]) best = s;
    }
    return best;
  }
  void Fill(int u, int s, std::vector<Gathered>* out) {
    out->push_back({u, s, unit[s]});
    unit[s] = u;
    use[s] = ++clock;
  }
  // Holds u (gathering it if needed, then the prefetch); false when no slot is free.
  bool Hold(int u, std::vector<Gathered>* out) {
    const int direction = last_held >= 0 && u > last_held ? 1 : -1;
    if (Where(u) < 0) {
      std::vector<int> candidates;
      for (size_t s = 0; s < unit.size(); ++s) {
        if (InClass(static_cast<int>(s), u) && !held[s]) candidates.push_back(static_cast<int>(s));
      }
      if (candidates.empty()) return false;
      Fill(u, Choose(candidates), out);
    }
    const int mine = Where(u);
    held[mine] = true;
    use[mine] = ++clock;
    last_held = u;
    int64_t budget = prefetch;
    const int n = static_cast<int>(padded.size());
    for (int v = u + direction; v >= 0 && v < n; v += direction) {
      if (budget <= 0) break;
      if (persistent[v]) continue;
      budget -= padded[v];
      if (Where(v) >= 0) continue;
      std::vector<int> candidates;
      for (size_t s = 0; s < unit.size(); ++s) {
        if (!InClass(static_cast<int>(s), v) || held[s]) continue;
        const bool passed = unit[s] >= 0 && (direction > 0 ? unit[s] < u : unit[s] > u);
        if (unit[s] < 0 || passed) candidates.push_back(static_cast<int>(s));
      }
      if (candidates.empty()) break;
      Fill(v, Choose(candidates), out);
    }
    return true;
  }
  void Release(int u) { held[Where(u)] = false; }
  void Invalidate() {
    for (size_t s = 0; s < unit.size(); ++s) {
      if (!held[s]) unit[s] = -1;
    }
  }
};

// The class driven as the engine drives it: the decisions it returns, filled in order.
bool Hold(GatherSlots& slots, int u, std::vector<Gathered>* out) {
  const int direction = slots.Direction(u);
  if (slots.slot_of(u) < 0) {
    const GatherSlots::Decision d = slots.Take(u);
    if (d.slot < 0) return false;
    out->push_back({d.unit, d.slot, d.evicted});
    slots.Filled(d.unit, d.slot);
  }
  slots.Hold(u);
  GatherSlots::Walk walk = slots.StartPrefetch(u, direction);
  for (GatherSlots::Decision d = slots.NextPrefetch(&walk); d.unit >= 0;
       d = slots.NextPrefetch(&walk)) {
    out->push_back({d.unit, d.slot, d.evicted});
    slots.Filled(d.unit, d.slot);
  }
  return true;
}

// "" when every observable piece of state agrees, else the first difference.
std::string Differs(const GatherSlots& slots, const Reference& ref) {
  for (int s = 0; s < slots.slot_count(); ++s) {
    if (slots.unit_in(s) != ref.unit[s] || slots.held(s) != ref.held[s] ||
        slots.last_use(s) != ref.use[s]) {
      return "slot " + std::to_string(s) + ": unit " + std::to_string(slots.unit_in(s)) +
             " held " + std::to_string(slots.held(s)) + " use " +
             std::to_string(slots.last_use(s)) + ", reference unit " +
             std::to_string(ref.unit[s]) + " held " + std::to_string(ref.held[s]) + " use " +
             std::to_string(ref.use[s]);
    }
  }
  for (int u = 0; u < slots.unit_count(); ++u) {
    if (slots.slot_of(u) != ref.Where(u)) {
      return "unit " + std::to_string(u) + " in slot " + std::to_string(slots.slot_of(u)) +
             ", reference " + std::to_string(ref.Where(u));
    }
  }
  if (slots.last_held() != ref.last_held) return "last held unit";
  return "";
}

struct Layout {
  std::vector<int64_t> sizes, padded;
  std::vector<bool> persistent;
  int64_t prefetch = 0;
};

// Random units and slots of one or two size classes; some units may fit no slot (prefetch and
// Take must pass them by), some are persistent; budgets from none to unbounded.
Layout RandomLayout(std::mt19937& rng) {
  Layout l;
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const int units = pick(1, 14);
  const int64_t small = 8 * pick(1, 6), large = small + 8 * pick(1, 12);
  for (int u = 0; u < units; ++u) {
    const int kind = pick(0, 9);
    l.padded.push_back(kind < 6   ? 8 * pick(1, static_cast<int>(small / 8))
                       : kind < 9 ? 8 * pick(1, static_cast<int>(large / 8))
                                  : large + 8);  // fits no slot
    l.persistent.push_back(pick(0, 3) == 0);
  }
  const int small_slots = pick(pick(0, 1), 4), large_slots = pick(1, 3);
  for (int s = 0; s < small_slots; ++s) l.sizes.push_back(small);
  for (int s = 0; s < large_slots; ++s) l.sizes.push_back(large);
  if (pick(0, 1) == 1) std::shuffle(l.sizes.begin(), l.sizes.end(), rng);  // any slot order
  switch (pick(0, 3)) {
    case 0: l.prefetch = 0; break;
    case 1: l.prefetch = std::numeric_limits<int64_t>::max(); break;
    default: l.prefetch = 8 * pick(1, 40); break;
  }
  return l;
}

TEST_CASE("GatherSlots: size classes are the smallest slot size that holds the unit",
          "[memory]") {
  GatherSlots slots({64, 16, 16, 64, 32}, {8, 16, 17, 32, 33, 64, 65}, std::vector<bool>(7),
                    100);
  auto of = [&](int u) {
    absl::Span<const int> c = slots.ClassSlots(u);
    return std::vector<int>(c.begin(), c.end());
  };
  CHECK(of(0) == std::vector<int>{1, 2});
  CHECK(of(1) == std::vector<int>{1, 2});
  CHECK(of(2) == std::vector<int>{4});
  CHECK(of(3) == std::vector<int>{4});
  CHECK(of(4) == std::vector<int>{0, 3});
  CHECK(of(5) == std::vector<int>{0, 3});
  CHECK(of(6).empty());
  CHECK(SlotClassElements({64, 16, 16, 64, 32}, 17) == 32);
  CHECK(SlotClassElements({64, 16}, 65) == 0);
}

TEST_CASE("GatherSlots: a gather takes an empty slot first, else the least recently used "
          "unheld one; a held slot is never taken",
          "[memory]") {
  // Three units, two equal slots, no prefetch.
  GatherSlots slots({8, 8}, {8, 8, 8}, std::vector<bool>(3), 0);
  std::vector<Gathered> g;
  REQUIRE(Hold(slots, 0, &g));
  REQUIRE(Hold(slots, 1, &g));
  CHECK(Describe(g) == "(0->0 evicts -1)(1->1 evicts -1)");
  CHECK(slots.Take(2).slot == -1);  // both held: nothing changes
  CHECK(slots.slot_of(0) == 0);
  CHECK(slots.slot_of(1) == 1);
  slots.Release(1);
  slots.Release(0);  // 0 was used before 1
  g.clear();
  REQUIRE(Hold(slots, 2, &g));
  CHECK(Describe(g) == "(2->0 evicts 0)");
  CHECK(slots.slot_of(0) == -1);
  slots.Release(2);
  slots.Invalidate();
  for (int s = 0; s < 2; ++s) CHECK(slots.unit_in(s) == -1);
}

TEST_CASE("GatherSlots: the prefetch walks the pass's direction, skips persistent units, "
          "stops at its budget and never takes the slot of a unit ahead",
          "[memory]") {
  // Units 0..4, unit 2 persistent; 3 slots; budget 16 = two units of 8.
  GatherSlots slots({8, 8, 8}, {8, 8, 8, 8, 8}, {false, false, true, false, false}, 16);
  std::vector<Gathered> g;
  REQUIRE(Hold(slots, 4, &g));  // backward from 4: prefetches 3 and 1 (2 is persistent)
  CHECK(Describe(g) == "(4->0 evicts -1)(3->1 evicts -1)(1->2 evicts -1)");
  slots.Release(4);
  g.clear();
  REQUIRE(Hold(slots, 3, &g));  // 1 in a slot already; 0 may take 4's slot (passed)
  CHECK(Describe(g) == "(0->0 evicts 4)");
  slots.Release(3);
  g.clear();
  REQUIRE(Hold(slots, 1, &g));
  CHECK(Describe(g) == "");
  slots.Release(1);
  // 0 is before 1: backward again, and nothing lies before 0.
  g.clear();
  REQUIRE(Hold(slots, 0, &g));
  CHECK(Describe(g) == "");
  CHECK(slots.Direction(1) == 1);
  CHECK(slots.Direction(0) == -1);
}

TEST_CASE("GatherSlots: equals a brute-force reference of the policy over random layouts",
          "[memory]") {
  std::mt19937 rng(20261127);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  for (int trial = 0; trial < 3000; ++trial) {
    const Layout l = RandomLayout(rng);
    GatherSlots slots(l.sizes, l.padded, l.persistent, l.prefetch);
    Reference ref(l.sizes, l.padded, l.persistent, l.prefetch);
    const int n = static_cast<int>(l.padded.size());
    std::vector<int> held_units;
    std::string trace;
    auto step = [&](const std::string& what) {
      trace += what + "; ";
      INFO("trial " << trial << " prefetch " << l.prefetch << " ops: " << trace);
      REQUIRE(Differs(slots, ref) == "");
    };
    auto hold = [&](int u) {
      std::vector<Gathered> got, want;
      const bool ok = Hold(slots, u, &got);
      const bool want_ok = ref.Hold(u, &want);
      INFO("trial " << trial << " hold " << u << " ops: " << trace);
      REQUIRE(ok == want_ok);
      REQUIRE(Describe(got) == Describe(want));
      if (ok) held_units.push_back(u);
      step("hold " + std::to_string(u) + (ok ? "" : " (no slot)") + " " + Describe(got));
    };
    auto release = [&](int k) {
      const int u = held_units[k];
      held_units.erase(held_units.begin() + k);
      slots.Release(u);
      ref.Release(u);
      step("release " + std::to_string(u));
    };
    if (pick(0, 1) == 0) {
      // The standard order (the plan's replay): micro-steps of forward then backward, one unit
      // held at a time, an update (Invalidate) every few.
      const int micro_steps = pick(1, 4), window = pick(1, 3);
      for (int m = 0; m < micro_steps; ++m) {
        for (int pass = 0; pass < 2; ++pass) {
          for (int k = 0; k < n; ++k) {
            const int u = pass == 0 ? n - 1 - k : k;
            if (l.persistent[u]) continue;
            hold(u);
            if (!held_units.empty()) release(0);
          }
        }
        if ((m + 1) % window == 0) {
          slots.Invalidate();
          ref.Invalidate();
          step("invalidate");
        }
      }
    } else {
      // Any trainer: several units held at once, in any order, invalidated while held.
      for (int op = 0; op < 40; ++op) {
        const int kind = pick(0, 9);
        if (kind < 6) {
          const int u = pick(0, n - 1);
          if (l.persistent[u] ||
              std::find(held_units.begin(), held_units.end(), u) != held_units.end()) {
            continue;
          }
          hold(u);
        } else if (kind < 9) {
          if (!held_units.empty()) release(pick(0, static_cast<int>(held_units.size()) - 1));
        } else {
          slots.Invalidate();
          ref.Invalidate();
          step("invalidate");
        }
      }
    }
  }
}

}  // namespace
}  // namespace memory
}  // namespace zerort
