#include "zero/internal/grad_norm.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "base/status.h"

namespace zerort {
namespace zero_internal {

absl::StatusOr<GradNorm::Result> GradNorm::Measure(double scale, Device::Event device_done) {
  const int nu = layout_.num_units();
  const int world = plan_.options.world_size, rank = plan_.options.rank;
  // HSDP: a region is a group shard, R consecutive flat shards (the plan pads units for the
  // whole world), held alike by the R replicas of its position s. Replica j measures the j-th
  // of them, flat shard s*R + j: each element is counted once, and the table holds exactly the
  // flat layout's partials, summed below in the flat order, so the norm is the flat one bit for
  // bit. row_of(q): the table row (rank) that measured flat shard q. Flat: R = 1, row q.
  // (A double sum of float partials is exact in practice, so the order seldom shows; it is
  // kept anyway, so that equality with the flat norm does not rest on that.)
  const int group = memory::ShardGroupSize(plan_.options), replicas = world / group;
  const int replica = rank / group;
  auto row_of = [&](int q) { return (q % replicas) * group + q / replicas; };
  // (world, units + 1) fp32
  std::vector<float> table(static_cast<size_t>(world) * (nu + 1), 0.0f);
  // Written by the device when its stream gets there: valid after the Synchronize below.
  std::unique_ptr<bool[]> unit_finite(new bool[nu]);
  for (int u = 0; u < nu; ++u) {
    const memory::Unit& unit = plan_.units[u];
    const Region& reg = layout_.region(u);
    unit_finite[u] = true;
    if (reg.frozen) continue;  // no gradient: its partials stay zero
    const DType cdt = reg.grad_dtype;
    const size_t c = DTypeSize(cdt);
    if (reg.whole_unit) {
      RETURN_IF_ERROR(dev_->AllFinite(reg.grad, cdt, reg.n, &unit_finite[u], compute_));
      for (int q = 0; q < world; ++q) {
        RETURN_IF_ERROR(dev_->SquaredNorm(reg.grad + q * unit.shard * c, cdt, unit.shard,
                                          &table[q * (nu + 1) + u], compute_));
      }
    } else {
      const int64_t flat_shard = unit.padded / world;  // reg.n when flat
      const char* mine = reg.grad + replica * flat_shard * static_cast<int64_t>(c);
      RETURN_IF_ERROR(dev_->AllFinite(mine, cdt, flat_shard, &unit_finite[u], compute_));
      RETURN_IF_ERROR(
          dev_->SquaredNorm(mine, cdt, flat_shard, &table[rank * (nu + 1) + u], compute_));
    }
  }
  if (device_done != nullptr) RETURN_IF_ERROR(dev_->Record(device_done, compute_));
  RETURN_IF_ERROR(dev_->Synchronize(compute_));  // the step's one wait for device results
  const bool finite =
      std::all_of(unit_finite.get(), unit_finite.get() + nu, [](bool f) { return f; });
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
