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

// Where unit `unit`'s region of the full gradients (stages 0-1) is in `back`.
const char* back_grads(Backing& back, const memory::Unit& unit, const Region& r, size_t cs) {
  return back.grads.data() + (unit.flat_offset + r.unit_begin) * static_cast<int64_t>(cs);
}

// Elements of `plan`'s buffer of class `cls` in device memory (`device`) or elsewhere.
size_t PartElements(const memory::Plan& plan, memory::BufferClass cls, bool device) {
  for (const memory::Buffer& b : plan.buffers) {
    if (b.cls == cls && (b.kind == memory::MemoryKind::kDevice) == device) {
      return static_cast<size_t>(b.elements);
    }
  }
  return 0;
}

TEST_CASE("ShardLayout: with offload_optimizer.ratio each part's state tiles its own buffers",
          "[zero]") {
  for (int stage = 1; stage <= 3; ++stage) {
    for (int world : {1, 3}) {
      for (int gas : {1, 2}) {
        for (double ratio : {0.0, 0.4, 0.7, 1.0}) {
          DYNAMIC_SECTION("stage " << stage << " world " << world << " gas " << gas << " ratio "
                                   << ratio) {
            memory::PlanOptions o = SmallPlan(stage, world, world - 1, gas).options;
            o.offload_optimizer = true;
            o.offload_optimizer_ratio = ratio;
            const absl::StatusOr<memory::Plan> made = memory::MakePlan(testing::SmallModel(), o);
            REQUIRE(made.ok());
            const memory::Plan& plan = *made;
            // One backing array per part and class, sized from the plan.
            const size_t cs = DTypeSize(plan.options.compute_dtype);
            Backing off, dev;
            ModelStateBuffers b = off.Buffers(plan);  // full gradients, params: as listed
            using C = memory::BufferClass;
            for (Backing* part : {&off, &dev}) {
              const bool device = part == &dev;
              part->master.assign(PartElements(plan, C::kMaster, device), 0.0f);
              part->m.assign(PartElements(plan, C::kExpAvg, device), 0.0f);
              part->v.assign(PartElements(plan, C::kExpAvgSq, device), 0.0f);
              part->accum.assign(PartElements(plan, C::kGradAccumulator, device) * cs, 0);
            }
            std::vector<char> dev_grads(stage >= 2 ? PartElements(plan, C::kGrads, true) * cs : 0);
            std::vector<char> off_grads(stage >= 2 ? PartElements(plan, C::kGrads, false) * cs : 0);
            auto ptr = [](auto& v) { return v.empty() ? nullptr : v.data(); };
            b.master = ptr(off.master);
            auto bytes = [&](std::vector<float>& v) { return reinterpret_cast<char*>(ptr(v)); };
            b.m = bytes(off.m);
            b.v = bytes(off.v);
            b.accum = ptr(off.accum);
            if (stage >= 2) b.grads = ptr(off_grads);
            b.kept.master = ptr(dev.master);
            b.kept.m = bytes(dev.m);
            b.kept.v = bytes(dev.v);
            b.kept.accum = ptr(dev.accum);
            b.kept.grads = ptr(dev_grads);
            const ShardLayout layout(plan, b);
            std::vector<int> cover_off(off.m.size(), 0), cover_dev(dev.m.size(), 0);
            for (int u = 0; u < layout.num_units(); ++u) {
              const Region& r = layout.region(u);
              const memory::Unit& unit = plan.units[u];
              REQUIRE(r.offloaded == unit.offloaded);
              Backing& part = r.offloaded ? off : dev;
              std::vector<int>& cover = r.offloaded ? cover_off : cover_dev;
              // m and v are fp32 here (bytes): their element offsets in the part.
              const int64_t m_at = reinterpret_cast<const float*>(r.m) - part.m.data();
              const int64_t v_at = reinterpret_cast<const float*>(r.v) - part.v.data();
              for (int64_t e = 0; e < r.n; ++e) ++cover[m_at + e];
              REQUIRE(v_at == m_at);
              REQUIRE(r.master - part.master.data() == m_at);
              // The reduced gradient lies in the part's gradient shard or accumulator, at the
              // same offset as its state; stage 1 without accumulation reads the full
              // gradients in place on the device.
              const std::vector<char>& grads = r.offloaded ? off_grads : dev_grads;
              const int64_t at = m_at * static_cast<int64_t>(cs);
              if (stage >= 2) {
                REQUIRE(r.grad == grads.data() + at);
              } else if (r.offloaded || gas > 1) {
                REQUIRE(r.grad == part.accum.data() + at);
              } else {
                REQUIRE(r.grad == back_grads(off, unit, r, cs));
              }
            }
            for (int c : cover_off) REQUIRE(c == 1);
            for (int c : cover_dev) REQUIRE(c == 1);
            CHECK(static_cast<int64_t>(off.m.size()) == plan.offloaded_state_elements);
            CHECK(static_cast<int64_t>(dev.m.size()) == plan.device_state_elements);
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace zero_internal
}  // namespace zerort
