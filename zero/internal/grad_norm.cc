#include "zero/internal/grad_norm.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "absl/base/internal/raw_logging.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace zerort {
namespace zero_internal {

GradNorm::GradNorm(const memory::Plan& plan, const ShardLayout& layout, Device* device,
                   Device::Stream compute, HostCollectives* host, float* device_table,
                   float* partials)
    : plan_(plan),
      layout_(layout),
      dev_(device),
      compute_(compute),
      host_(host),
      device_table_(device_table),
      table_(static_cast<size_t>(plan.options.world_size) * (plan.units.size() + 1), 0.0f),
      unit_finite_(plan.units.size(), 1),
      pinned_(device->device_memory() ? device->allocator(memory::MemoryKind::kPinnedHost)
                                      : nullptr),
      early_(memory::GradOffload(plan.options) && plan.offloaded_state_elements > 0),
      early_sumsq_(partials),
      early_finite_(partials == nullptr ? nullptr
                                        : reinterpret_cast<bool*>(partials + plan.units.size())),
      early_measured_(plan.units.size(), 0) {
  ABSL_RAW_CHECK(!early_ || partials != nullptr, "gradient offload needs norm_partials");
  ranges_.reserve(MaxRanges());
  slots_.reserve(MaxRanges());
}

GradNorm::~GradNorm() {
  if (pinned_ != nullptr && readback_ != nullptr) pinned_->Free(readback_, ReadbackBytes());
}

size_t GradNorm::MaxRanges() const {
  // Stage 0: every shard of every unit, and the whole region where the shards do not cover it.
  return (static_cast<size_t>(plan_.options.world_size) + 1) * plan_.units.size();
}

size_t GradNorm::ReadbackBytes() const { return MaxRanges() * (sizeof(float) + sizeof(bool)); }

absl::StatusOr<char*> GradNorm::Readback() {
  if (readback_ != nullptr) return readback_;
  if (pinned_ == nullptr) {
    readback_heap_.resize(ReadbackBytes());
    readback_ = readback_heap_.data();
  } else {
    absl::StatusOr<void*> p = pinned_->Allocate(ReadbackBytes());
    if (!p.ok()) {
      return absl::Status(p.status().code(),
                          absl::StrCat("gradient norm: ", ReadbackBytes(),
                                       " bytes of pinned host memory for the partials: ",
                                       p.status().message()));
    }
    readback_ = static_cast<char*>(*p);
  }
  return readback_;
}

absl::Status GradNorm::MeasureUnit(int u, const void* grad, Device::Stream stream) {
  const Region& reg = layout_.region(u);
  ABSL_RAW_CHECK(early_ && reg.offloaded, "GradNorm::MeasureUnit of a unit not offloaded");
  // Offload needs stage >= 1: the region is this rank's (group) shard, of which this rank
  // measures exactly what Measure would (OwnSlice: with HSDP only its replica's flat slice).
  early_measured_[u] = 1;
  const Slice s = OwnSlice(u, static_cast<const char*>(grad));
  RETURN_IF_ERROR(dev_->AllFinite(s.data, reg.grad_dtype, s.n, &early_finite_[u], stream));
  return dev_->SquaredNorm(s.data, reg.grad_dtype, s.n, &early_sumsq_[u], stream);
}

// HSDP: a region is a group shard, R consecutive flat shards (the plan pads units for the whole
// world), held alike by the R replicas of its position s. Replica j measures the j-th of them,
// flat shard s*R + j, so that each element is counted once. Flat: R = 1, the whole region.
GradNorm::Slice GradNorm::OwnSlice(int u, const char* shard) const {
  const memory::Unit& unit = plan_.units[u];
  const int world = plan_.options.world_size;
  const int replica = plan_.options.rank / memory::ShardGroupSize(plan_.options);
  const int64_t flat_shard = unit.padded / world;  // region(u).n when flat
  const int64_t c = static_cast<int64_t>(DTypeSize(layout_.region(u).grad_dtype));
  return Slice{shard + replica * flat_shard * c, flat_shard};
}

absl::StatusOr<GradNorm::Result> GradNorm::Measure(double scale, Device::Event device_done) {
  const int nu = layout_.num_units();
  const int world = plan_.options.world_size, rank = plan_.options.rank;
  // HSDP: replica j of group position s measures flat shard s*R + j of each unit (OwnSlice):
  // each element is counted once, and the table holds exactly the flat layout's partials,
  // summed below in the flat order, so the norm is the flat one bit for bit. row_of(q): the
  // table row (rank) that measured flat shard q. Flat: R = 1, row q.
  // (A double sum of float partials is exact in practice, so the order seldom shows; it is
  // kept anyway, so that equality with the flat norm does not rest on that.)
  const int group = memory::ShardGroupSize(plan_.options), replicas = world / group;
  auto row_of = [&](int q) { return (q % replicas) * group + q / replicas; };
  // Every unit this rank measures now, as ranges of one device call: each range's squared
  // norm goes to a cell of the (world, units + 1) table, its verdict to its unit's flag.
  ranges_.clear();
  slots_.clear();
  for (int u = 0; u < nu; ++u) {
    const memory::Unit& unit = plan_.units[u];
    const Region& reg = layout_.region(u);
    if (reg.frozen) continue;  // no gradient: its partials stay zero
    if (reg.offloaded) {
      // Measured on the device before the shard left it; read after the Synchronize below.
      ABSL_RAW_CHECK(early_measured_[u], "gradient offload: a unit's shard was never measured");
      early_measured_[u] = 0;
      continue;
    }
    const DType cdt = reg.grad_dtype;
    const size_t c = DTypeSize(cdt);
    if (reg.whole_unit) {
      for (int q = 0; q < world; ++q) {
        ranges_.push_back({reg.grad + q * unit.shard * c, cdt, static_cast<size_t>(unit.shard)});
        slots_.push_back({q * (nu + 1) + u, u});
      }
      // The shards' flags are the region's when they cover it; else the region is checked too.
      if (reg.n != static_cast<int64_t>(world) * unit.shard) {
        ranges_.push_back({reg.grad, cdt, static_cast<size_t>(reg.n)});
        slots_.push_back({-1, u});
      }
    } else {
      const Slice mine = OwnSlice(u, reg.grad);
      ranges_.push_back({mine.data, cdt, static_cast<size_t>(mine.n)});
      slots_.push_back({rank * (nu + 1) + u, u});
    }
  }
  // Written by the device when its stream gets there, valid after the Synchronize below.
  ASSIGN_OR_RETURN(char* readback, Readback());
  float* const norms = reinterpret_cast<float*>(readback);
  bool* const range_finite = reinterpret_cast<bool*>(norms + MaxRanges());
  ABSL_RAW_CHECK(ranges_.size() <= MaxRanges(), "gradient norm: more ranges than the readback");
  RETURN_IF_ERROR(dev_->SquaredNormsAndFinite(ranges_, norms, range_finite, compute_));
  if (device_done != nullptr) RETURN_IF_ERROR(dev_->Record(device_done, compute_));
  RETURN_IF_ERROR(dev_->Synchronize(compute_));  // the step's one wait for device results
  std::vector<float>& table = table_;
  std::vector<uint8_t>& unit_finite = unit_finite_;
  std::fill(table.begin(), table.end(), 0.0f);
  std::fill(unit_finite.begin(), unit_finite.end(), 1);
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].cell >= 0) table[slots_[i].cell] = norms[i];
    if (!range_finite[i]) unit_finite[slots_[i].unit] = 0;
  }
  if (early_) {
    for (int u = 0; u < nu; ++u) {
      if (!layout_.region(u).offloaded) continue;  // measured above, or frozen
      unit_finite[u] = early_finite_[u] ? 1 : 0;
      table[rank * (nu + 1) + u] = early_sumsq_[u];
    }
  }
  const bool finite =
      std::all_of(unit_finite.begin(), unit_finite.end(), [](uint8_t f) { return f != 0; });
  if (plan_.options.stage == 0) {
    for (int q = 0; q < world; ++q) table[q * (nu + 1) + nu] = finite ? 1.0f : 0.0f;
  } else {
    table[rank * (nu + 1) + nu] = finite ? 1.0f : 0.0f;
    if (world > 1) {  // in place: this rank's row is already in the table
      RETURN_IF_ERROR(host_->AllGatherHost(&table[rank * (nu + 1)], table.data(), nu + 1,
                                           DType::kF32, device_table_));
    }
  }
  double sumsq = 0;
  bool all_finite = true;
  for (int q = 0; q < world; ++q) all_finite = all_finite && table[q * (nu + 1) + nu] == 1.0f;
  for (int u = 0; u < nu; ++u) {
    for (int q = 0; q < world; ++q) sumsq += table[row_of(q) * (nu + 1) + u];
  }
  Result r;
  r.norm = std::sqrt(sumsq) / scale;
  r.overflow = !all_finite || !std::isfinite(r.norm);
  return r;
}

}  // namespace zero_internal
}  // namespace zerort
