#include "zero/internal/shard_layout.h"

#include <vector>

#include <catch2/catch.hpp>

#include "zero/internal/test_util.h"

namespace zerort {
namespace zero_internal {
namespace {

// Buffers sized from the plan itself, so every region pointer can be located in them.
struct Backing {
  std::vector<char> params, grads, accum;
  std::vector<float> master, m, v;
  ModelStateBuffers Buffers(const memory::Plan& plan) {
    auto size = [&](memory::BufferClass c) {
      const memory::Buffer* b = plan.Find(c);
      return b == nullptr ? 0 : static_cast<size_t>(b->elements);
    };
    const size_t cs = DTypeSize(plan.options.compute_dtype);
    params.resize(size(memory::BufferClass::kParams) * cs);
    grads.resize(size(memory::BufferClass::kGrads) * cs);
    accum.resize(size(memory::BufferClass::kGradAccumulator) * cs);
    master.resize(size(memory::BufferClass::kMaster));
    m.resize(size(memory::BufferClass::kExpAvg));
    v.resize(size(memory::BufferClass::kExpAvgSq));
    return {params.data(), grads.data(), master.empty() ? nullptr : master.data(),
            reinterpret_cast<char*>(m.data()), reinterpret_cast<char*>(v.data()),
            accum.empty() ? nullptr : accum.data()};
  }
};

TEST_CASE("ShardLayout: every element has one owner and optimizer state tiles the shard",
          "[zero]") {
  for (int stage = 0; stage <= 3; ++stage) {
    for (int world : {1, 3}) {
      for (int gas : {1, 2}) {
        DYNAMIC_SECTION("stage " << stage << " world " << world << " gas " << gas) {
          // owners[u][e]: how many ranks own element e of unit u.
          std::vector<std::vector<int>> owners;
          for (int rank = 0; rank < world; ++rank) {
            const memory::Plan plan = SmallPlan(stage, world, rank, gas);
            if (owners.empty()) {
              for (const memory::Unit& u : plan.units) owners.emplace_back(u.padded, 0);
            }
            Backing back;
            const ModelStateBuffers b = back.Buffers(plan);
            const ShardLayout layout(plan, b);
            REQUIRE(layout.num_units() == static_cast<int>(plan.units.size()));
            const size_t cs = DTypeSize(plan.options.compute_dtype);
            std::vector<int> m_cover(back.m.size(), 0);
            for (int u = 0; u < layout.num_units(); ++u) {
              const memory::Unit& unit = plan.units[u];
              const Region& r = layout.region(u);
              REQUIRE(r.unit_begin + r.n <= unit.padded);
              for (int64_t e = 0; e < r.n; ++e) ++owners[u][r.unit_begin + e];
              const int64_t m_at = (r.m - reinterpret_cast<char*>(back.m.data())) / 4;
              for (int64_t e = 0; e < r.n; ++e) ++m_cover[m_at + e];
              REQUIRE(r.v - reinterpret_cast<char*>(back.v.data()) == m_at * 4);
              // This rank's checkpoint range is shard `rank` of the unit, inside the region.
              REQUIRE(r.unit_begin + r.owned_begin == rank * unit.shard);
              REQUIRE(r.owned_begin + unit.shard <= r.n);
              // The parameters the region updates are the ones it owns in the unit's layout.
              if (stage <= 2) {
                REQUIRE(r.param == back.params.data() + (unit.flat_offset + r.unit_begin) * cs);
              }
              // The reduced gradient lies inside the gradient or accumulator buffer.
              const bool in_grads = r.grad >= back.grads.data() &&
                                    r.grad + r.n * cs <= back.grads.data() + back.grads.size();
              const bool in_accum = !back.accum.empty() && r.grad >= back.accum.data() &&
                                    r.grad + r.n * cs <= back.accum.data() + back.accum.size();
              REQUIRE((in_grads || in_accum));
              REQUIRE(in_accum == (gas > 1 && stage <= 1));
            }
            for (int c : m_cover) REQUIRE(c == 1);  // m (and v) tile the rank's state exactly
          }
          for (const std::vector<int>& unit : owners) {
            for (int c : unit) REQUIRE(c == (stage == 0 ? world : 1));
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace zero_internal
}  // namespace zerort
