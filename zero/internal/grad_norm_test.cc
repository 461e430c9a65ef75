#include "zero/internal/grad_norm.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "device/testing/one_thread.h"
#include "zero/internal/engine_memory.h"
#include "zero/internal/host_collectives.h"
#include "zero/internal/shard_layout.h"
#include "zero/internal/test_util.h"

namespace zerort {
namespace zero_internal {
namespace {

// The reduced gradient of element x of unit u (padding holds zeros, as after a reduction).
float Grad(const memory::Plan& plan, int u, int64_t x) {
  for (int i : plan.units[u].params) {
    const memory::ParamLayout& p = plan.params[i];
    if (x >= p.offset_in_unit && x < p.offset_in_unit + p.numel) {
      return 3 * testing::GradValue(0, 7, 0, i, x - p.offset_in_unit);
    }
  }
  return 0;
}

// The serial reference: every unit's whole gradient in `dtype`, summed in double.
double ReferenceNorm(const memory::Plan& plan, DType dtype, double scale) {
  double sumsq = 0;
  std::vector<char> one(DTypeSize(dtype));
  for (int u = 0; u < static_cast<int>(plan.units.size()); ++u) {
    for (int64_t x = 0; x < plan.units[u].padded; ++x) {
      StoreAs(dtype, one.data(), 0, Grad(plan, u, x));
      const double g = LoadAs(dtype, one.data(), 0);
      sumsq += g * g;
    }
  }
  return std::sqrt(sumsq) / scale;
}

struct Case {
  int stage = 0;
  DType dtype = DType::kF32;
  double scale = 1;
  // Ranks that hold a non-finite value in their region, and which.
  std::vector<int> bad_ranks;
  float bad = std::numeric_limits<float>::infinity();
};

// One rank: writes its region of every unit's reduced gradient and measures.
absl::Status Measure(const Case& c, int r, comm::Communicator* comm, Device* dev,
                     GradNorm::Result* out) {
  const memory::Plan plan = SmallPlan(c.stage, comm->size(), r, 1, c.dtype);
  ASSIGN_OR_RETURN(auto mem, EngineMemory::Allocate(plan, dev, nullptr));
  const ShardLayout layout(plan, mem->model_state());
  HostCollectives host(comm, dev, nullptr);
  GradNorm norm(plan, layout, dev, nullptr, &host, mem->norm_table());
  const int nu = layout.num_units();
  for (int u = 0; u < nu; ++u) {
    const Region& reg = layout.region(u);
    char* grad = const_cast<char*>(reg.grad);
    for (int64_t e = 0; e < reg.n; ++e) {
      StoreAs(reg.grad_dtype, grad, e, Grad(plan, u, reg.unit_begin + e));
    }
  }
  for (int bad : c.bad_ranks) {
    if (bad != r) continue;
    const Region& reg = layout.region(nu / 2);
    StoreAs(reg.grad_dtype, const_cast<char*>(reg.grad), reg.n / 2, c.bad);
  }
  ASSIGN_OR_RETURN(*out, norm.Measure(c.scale));
  return absl::OkStatus();
}

std::vector<GradNorm::Result> MeasureOnRanks(const Case& c, int world) {
  auto dev = testing::OneThreadCpuDevice();
  std::vector<GradNorm::Result> results(world);
  const std::vector<absl::Status> st = OnRanks(world, [&](int r, comm::Communicator* comm) {
    return Measure(c, r, comm, dev.get(), &results[r]);
  });
  for (const absl::Status& s : st) {
    INFO(s);
    REQUIRE(s.ok());
  }
  return results;
}

uint64_t Bits(double d) {
  uint64_t b;
  std::memcpy(&b, &d, sizeof b);
  return b;
}

TEST_CASE("GradNorm: the global norm equals a serial double-precision norm, bit-equal on every "
          "rank and stage",
          "[zero]") {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (int world = 1; world <= 3; ++world) {
      for (double scale : {1.0, 8.0}) {
        INFO(DTypeName(dtype) << ", " << world << " ranks, scale " << scale);
        const double want = ReferenceNorm(SmallPlan(0, world, 0, 1, dtype), dtype, scale);
        REQUIRE(want > 0);
        uint64_t stage0_bits = 0;
        for (int stage = 0; stage <= 3; ++stage) {
          INFO("stage " << stage);
          Case c;
          c.stage = stage;
          c.dtype = dtype;
          c.scale = scale;
          const std::vector<GradNorm::Result> got = MeasureOnRanks(c, world);
          for (int r = 0; r < world; ++r) {
            INFO("rank " << r);
            CHECK_FALSE(got[r].overflow);
            CHECK(got[r].norm == Approx(want).epsilon(1e-5));
            CHECK(Bits(got[r].norm) == Bits(got[0].norm));
          }
          // Every stage sums the same (unit, shard) partials in the same order.
          if (stage == 0) stage0_bits = Bits(got[0].norm);
          CHECK(Bits(got[0].norm) == stage0_bits);
        }
      }
    }
  }
}

TEST_CASE("GradNorm: an Inf or NaN on any rank is an overflow on every rank", "[zero]") {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int world = 1; world <= 3; ++world) {
    for (int stage = 0; stage <= 3; ++stage) {
      for (float bad : {inf, -inf, nan}) {
        for (int bad_rank = 0; bad_rank < world; ++bad_rank) {
          INFO(world << " ranks, stage " << stage << ", " << bad << " on rank " << bad_rank);
          Case c;
          c.stage = stage;
          c.bad = bad;
          if (stage == 0) {
            // Stage 0 reduces whole units with an all-reduce: every rank holds the same
            // gradients, the bad value included.
            for (int r = 0; r < world; ++r) c.bad_ranks.push_back(r);
          } else {
            c.bad_ranks = {bad_rank};
          }
          const std::vector<GradNorm::Result> got = MeasureOnRanks(c, world);
          for (int r = 0; r < world; ++r) {
            INFO("rank " << r);
            CHECK(got[r].overflow);
          }
          if (stage == 0) break;  // one placement covers every rank
        }
      }
    }
  }
}

}  // namespace
}  // namespace zero_internal
}  // namespace zerort
