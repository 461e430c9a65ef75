#include "zero/internal/param_gatherer.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"

namespace zerort {
namespace zero_internal {
namespace {

// The slot policy over the plan's gather slots (`slots`: none outside stage 3).
memory::GatherSlots SlotPolicy(const UnitContext& ctx, const SlottedBuffer& slots) {
  std::vector<int64_t> sizes = slots.sizes;
  if (sizes.empty()) sizes.assign(static_cast<size_t>(slots.count), slots.elements);
  const size_t nu = ctx.plan.units.size();
  std::vector<int64_t> padded(nu);
  std::vector<bool> persistent(nu);
  for (size_t u = 0; u < nu; ++u) {
    padded[u] = ctx.plan.units[u].padded;
    persistent[u] = ctx.plan.units[u].persistent;
  }
  return memory::GatherSlots(std::move(sizes), std::move(padded), std::move(persistent),
                             ctx.plan.options.prefetch_elements);
}

}  // namespace

ParamGatherer::ParamGatherer(const UnitContext& ctx, char* params, const SlottedBuffer& slots,
                             char* persistent, UnitStore* store, char* secondary)
    : ctx_(ctx),
      params_(params),
      gather_(slots),
      persistent_(persistent),
      store_(store),
      secondary_(secondary),
      hpz_(memory::Hpz(ctx.plan.options) ? ctx.plan.options.hpz_partition_size : 1),
      slots_(SlotPolicy(ctx, slots)) {
  const size_t nu = ctx.plan.units.size();
  refs_.assign(nu, 0);
  persistent_offset_.assign(nu, -1);
  secondary_offset_.assign(nu, -1);
  secondary_valid_.assign(nu, false);
  int64_t off = 0, secondary_off = 0;
  for (size_t u = 0; u < nu; ++u) {
    if (ctx.plan.units[u].persistent) {
      persistent_offset_[u] = off;
      off += ctx.plan.units[u].padded;
    } else if (hpz_ > 1) {
      secondary_offset_[u] = secondary_off;  // memory/plan.cc: the gathered units in order
      secondary_off += ctx.plan.units[u].padded / hpz_;
    }
  }
}

char* ParamGatherer::persistent_copy(int unit) const {
  return persistent_offset_[unit] < 0 ? nullptr : ctx_.At(persistent_, persistent_offset_[unit]);
}

absl::StatusOr<void*> ParamGatherer::Param(const memory::ParamLayout& p) const {
  if (ctx_.stage <= 2) return static_cast<void*>(ctx_.At(params_, p.flat_offset));
  if (ctx_.plan.units[p.unit].persistent) {
    return static_cast<void*>(ctx_.At(persistent_copy(p.unit), p.offset_in_unit));
  }
  const int s = slots_.slot_of(p.unit);
  if (s < 0 || !slots_.held(s)) {
    return absl::FailedPreconditionError(absl::StrCat("parameter '", p.name, "' (unit ", p.unit,
                                                      ") is not gathered: Acquire it (or Gather(",
                                                      p.unit, ")) first"));
  }
  return static_cast<void*>(ctx_.At(gather_.base, gather_.offset(s) + p.offset_in_unit));
}

absl::Status ParamGatherer::Gather(int unit) {
  if (!gathers(unit)) return absl::OkStatus();
  if (refs_[unit] > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Gather(", unit, "): the unit is already gathered (held ", refs_[unit],
        " time(s)); Release it first, or use Acquire/Release by parameter, which count"));
  }
  return Hold(unit);
}

absl::Status ParamGatherer::Release(int unit) {
  if (!gathers(unit)) return absl::OkStatus();
  if (refs_[unit] == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("Release(", unit, "): the unit is not gathered"));
  }
  return Drop(unit);
}

// Gathers `unit` into a slot unless it already is in one, and counts one hold.
absl::Status ParamGatherer::Hold(int unit) {
  const bool first = refs_[unit]++ == 0;
  if (!first || !gathers(unit)) return absl::OkStatus();
  int s = slots_.slot_of(unit);
  const int direction = slots_.Direction(unit);
  if (s < 0) {
    absl::StatusOr<int> acquired = AcquireSlot(unit);
    if (acquired.ok()) {
      s = *acquired;
      absl::Status st = GatherIntoSlot(unit, s);
      if (!st.ok()) acquired = st;
    }
    if (!acquired.ok()) {
      refs_[unit] = 0;
      return acquired.status();
    }
  }
  slots_.Hold(unit);
  RETURN_IF_ERROR(ctx_.streams->BeforeSlotUse(s));
  return Prefetch(unit, direction);
}

// Drops one hold of `unit`; the last lets its slot be reused.
absl::Status ParamGatherer::Drop(int unit) {
  if (--refs_[unit] > 0 || !gathers(unit)) return absl::OkStatus();
  const int s = slots_.slot_of(unit);
  slots_.Release(unit);
  // The next all-gather into this slot waits for the trainer's work on this unit.
  return ctx_.streams->SlotReleased(s);
}

std::vector<int> ParamGatherer::UnitsOf(absl::Span<const int> params) const {
  std::vector<int> units;
  for (int i : params) {
    const int u = ctx_.plan.params[i].unit;
    if (std::find(units.begin(), units.end(), u) == units.end()) units.push_back(u);
  }
  return units;
}

absl::Status ParamGatherer::Acquire(absl::Span<const int> params) {
  const std::vector<int> units = UnitsOf(params);
  for (size_t k = 0; k < units.size(); ++k) {
    absl::Status st = Hold(units[k]);
    if (st.ok()) continue;
    // Leave the counts as they were before this call, so the trainer may retry or release.
    for (size_t j = 0; j < k; ++j) RETURN_IF_ERROR(Drop(units[j]));
    return absl::Status(st.code(),
                        absl::StrCat("Acquire of ", params.size(), " parameter(s) over ",
                                     units.size(), " unit(s): ", st.message()));
  }
  return absl::OkStatus();
}

absl::Status ParamGatherer::ReleaseParams(absl::Span<const int> params) {
  const std::vector<int> units = UnitsOf(params);
  // Check every unit first: an unbalanced call changes nothing.
  for (int u : units) {
    if (refs_[u] > 0) continue;
    const int i = *std::find_if(params.begin(), params.end(),
                                [&](int p) { return ctx_.plan.params[p].unit == u; });
    return absl::FailedPreconditionError(absl::StrCat(
        "Release of parameter '", ctx_.plan.params[i].name, "' (unit ", u, "): it is not "
        "acquired; every Release must match an earlier Acquire of the same unit"));
  }
  for (int u : units) RETURN_IF_ERROR(Drop(u));
  return absl::OkStatus();
}

absl::Status ParamGatherer::AllGatherUpdated(int u) {
  const memory::Unit& unit = ctx_.plan.units[u];
  if (ctx_.stage == 1 || ctx_.stage == 2) {
    char* full = ctx_.At(params_, unit.flat_offset);
    RETURN_IF_ERROR(
        ctx_.streams->AllGather(ctx_.At(full, ctx_.rank * unit.shard), full, unit.shard, ctx_.cdt));
    ctx_.timer->Sent(unit.shard, 1);
  } else if (ctx_.stage == 3 && unit.persistent) {
    RETURN_IF_ERROR(GatherShard(u, persistent_copy(u)));
  }
  return absl::OkStatus();
}

absl::Status ParamGatherer::StoreWhole(int u, const char* values) {
  const memory::Unit& unit = ctx_.plan.units[u];
  char* whole = ctx_.stage <= 2 ? ctx_.At(params_, unit.flat_offset) : persistent_copy(u);
  if (whole == nullptr) return absl::OkStatus();
  return ctx_.device->Copy(whole, values, unit.padded * ctx_.c, ctx_.streams->compute());
}

void ParamGatherer::Invalidate() {
  slots_.Invalidate();
  secondary_valid_.assign(secondary_valid_.size(), false);
}

absl::StatusOr<int> ParamGatherer::AcquireSlot(int unit) {
  const memory::GatherSlots::Decision taken = slots_.Take(unit);
  if (taken.slot < 0) {
    const int64_t padded = ctx_.plan.units[unit].padded;
    std::vector<int> held;
    int64_t slot_elements = 0;
    for (int s : slots_.ClassSlots(unit)) {
      held.push_back(slots_.unit_in(s));
      slot_elements = slots_.slot_elements(s);
    }
    // memory/plan.cc: per size class, slots = max(1, min(1 + ceil(prefetch / its largest
    // unit), max_live / its largest unit, its gathered units)).
    return absl::FailedPreconditionError(absl::StrCat(
        "stage 3: all ", held.size(), " gather slots for units of ", padded,
        " elements are held (units ", absl::StrJoin(held, ", "), "); Release units after use, "
        "or raise zero_optimization.stage3_prefetch_bucket_size: the plan makes 1 + ceil("
        "stage3_prefetch_bucket_size / ", slot_elements, ") such slots (the largest padded "
        "unit of their size class), at most stage3_max_live_parameters / ", slot_elements));
  }
  return taken.slot;
}

absl::Status ParamGatherer::GatherIntoSlot(int u, int s) {
  const Stopwatch t;
  RETURN_IF_ERROR(ctx_.streams->BeforeComm());
  RETURN_IF_ERROR(ctx_.streams->BeforeSlotGather(s));
  char* full = ctx_.At(gather_.base, gather_.offset(s));
  RETURN_IF_ERROR(hpz_ > 1 ? GatherHpz(u, full) : GatherShard(u, full));
  RETURN_IF_ERROR(ctx_.streams->SlotGathered(s));
  slots_.Filled(u, s);
  ctx_.timer->AddGatherMs(t.ElapsedMs());
  return absl::OkStatus();
}

// The store stages a shard that lives in host memory or a file into this rank's block of `full`
// (collectives only ever see device buffers); a failed read still takes part in the
// all-gather, then every rank fails alike.
absl::Status ParamGatherer::GatherShard(int u, char* full) {
  const memory::Unit& unit = ctx_.plan.units[u];
  char* block = ctx_.At(full, ctx_.rank * unit.shard);
  const absl::Status read = store_->StageShard(u, block, ctx_.streams->side(),
                                               [this](int v) { return slots_.slot_of(v) >= 0; });
  RETURN_IF_ERROR(
      ctx_.streams->AllGather(store_->ShardToSend(u, block), full, unit.shard, ctx_.cdt));
  ctx_.timer->Sent(unit.shard, 1);
  return store_->AgreeOnRead(read);
}

absl::Status ParamGatherer::GatherHpz(int u, char* full) {
  const int64_t block = ctx_.plan.units[u].padded / hpz_;
  char* mine = ctx_.At(secondary_, secondary_offset_[u]);
  if (secondary_valid_[u]) {
    RETURN_IF_ERROR(ctx_.streams->AllGatherInNode(mine, full, block, ctx_.cdt));
    ctx_.timer->SentOver(block, hpz_);
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(GatherShard(u, full));
  // On the stream the gather ran on, so the next gather into this slot (same stream) cannot
  // overwrite the unit before the block is kept, and the node gathers that read it follow it.
  RETURN_IF_ERROR(ctx_.device->Copy(mine, ctx_.At(full, (ctx_.rank % hpz_) * block),
                                    block * ctx_.c, ctx_.streams->side()));
  secondary_valid_[u] = true;
  return absl::OkStatus();
}

// Gathers the units after `from` in `direction` into free slots, up to the prefetch budget
// (memory::GatherSlots::NextPrefetch decides which and where). Only empty slots and slots
// holding units already passed in this direction are reused, so a prefetch never evicts a unit
// that is about to be needed. Every rank runs the same Gather/Release sequence, so every rank
// prefetches the same units in the same order.
absl::Status ParamGatherer::Prefetch(int from, int direction) {
  memory::GatherSlots::Walk walk = slots_.StartPrefetch(from, direction);
  for (memory::GatherSlots::Decision d = slots_.NextPrefetch(&walk); d.unit >= 0;
       d = slots_.NextPrefetch(&walk)) {
    RETURN_IF_ERROR(GatherIntoSlot(d.unit, d.slot));
  }
  return absl::OkStatus();
}

}  // namespace zero_internal
}  // namespace zerort
