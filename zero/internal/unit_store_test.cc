#include "zero/internal/unit_store.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "base/testing/temp_dir.h"
#include "device/testing/one_thread.h"
#include "zero/config.h"
#include "zero/internal/engine_memory.h"
#include "zero/internal/host_collectives.h"
#include "zero/internal/shard_layout.h"
#include "zero/internal/test_util.h"
#include "zero/planner.h"

namespace zerort {
namespace zero_internal {
namespace {

// Element e of unit u's region of array `a` (0 master, 1 m, 2 v, 3 parameters) on rank r:
// distinct per rank, unit, array and neighbouring element; the parameters exact in bf16.
float Value(int a, int r, int u, int64_t e) {
  if (a == 3) return static_cast<float>((r == 0 ? 1 : -1) * ((e + 41 * u) % 251 + 1));
  return static_cast<float>(r * 16384 + a * 4096 + u * 256 + (e % 256)) * 0.25f;
}

// Where owned state lives, as a config says it.
struct Where {
  std::string name;
  Config config;
  bool state_in_file = false;
  bool params_in_file = false;
  bool params_on_host = false;  // staged into the gather block by ShardToSend
};

// NVMe settings as the engine tests use them: several requests per unit, queue depth 2.
void Aio(Config* c) {
  c->aio.block_size = 8192;
  c->aio.queue_depth = 2;
  c->aio.thread_count = 1;
}

std::vector<Where> Places() {
  std::vector<Where> out;
  for (int stage = 0; stage <= 3; ++stage) {
    out.push_back({absl::StrCat("device, stage ", stage),
                   testing::TestConfig(stage, DType::kBF16, 1, 0, false)});
  }
  for (int stage = 1; stage <= 3; ++stage) {
    out.push_back({absl::StrCat("host optimizer state, stage ", stage),
                   testing::TestConfig(stage, DType::kBF16, 1, 0, true)});
  }
  {
    Where w{"host optimizer state and parameters, stage 3",
            testing::TestConfig(3, DType::kBF16, 1, 0, true)};
    w.config.zero.offload_param.device = OffloadDevice::kCpu;
    w.params_on_host = true;
    out.push_back(w);
  }
  for (int stage = 1; stage <= 3; ++stage) {
    Where w{absl::StrCat("NVMe optimizer state, stage ", stage),
            testing::TestConfig(stage, DType::kBF16, 1, 0, true)};
    w.config.zero.offload_optimizer.device = OffloadDevice::kNvme;
    w.config.zero.offload_optimizer.nvme_path = testing::TestTmpDir();
    w.config.zero.offload_optimizer.buffer_count = 2;
    Aio(&w.config);
    w.state_in_file = true;
    out.push_back(w);
  }
  for (bool state_nvme : {false, true}) {
    Where w{state_nvme ? "NVMe optimizer state and parameters, stage 3"
                       : "NVMe parameters, host optimizer state, stage 3",
            testing::TestConfig(3, DType::kBF16, 1, 0, true)};
    if (state_nvme) {
      w.config.zero.offload_optimizer.device = OffloadDevice::kNvme;
      w.config.zero.offload_optimizer.nvme_path = testing::TestTmpDir();
    }
    w.config.zero.offload_param.device = OffloadDevice::kNvme;
    w.config.zero.offload_param.nvme_path = testing::TestTmpDir();
    w.config.zero.offload_param.buffer_count = 2;
    Aio(&w.config);
    w.state_in_file = state_nvme;
    w.params_in_file = true;
    w.params_on_host = true;
    out.push_back(w);
  }
  return out;
}

#define EXPECT_OR_RETURN(cond, ...)                                                         \
  do {                                                                                      \
    if (!(cond)) return absl::InternalError(absl::StrCat(#cond, ": ", __VA_ARGS__));        \
  } while (0)

// Unit u's region of array a on rank r, as fp32 values.
std::vector<float> RegionValues(int a, int r, int u, int64_t n) {
  std::vector<float> out(n);
  for (int64_t e = 0; e < n; ++e) out[e] = Value(a, r, u, e);
  return out;
}

absl::Status CheckEqual(const float* got, const std::vector<float>& want, const char* what,
                        int u) {
  for (size_t e = 0; e < want.size(); ++e) {
    EXPECT_OR_RETURN(got[e] == want[e], what, " of unit ", u, " element ", e, ": ", got[e],
                     " != ", want[e]);
  }
  return absl::OkStatus();
}

absl::Status OneRank(const Where& where, int r, comm::Communicator* comm, Device* dev,
                     int64_t* file_bytes, int64_t* planned_nvme) {
  ASSIGN_OR_RETURN(const PlanChoice choice,
                   ChoosePlan(testing::SmallModel(), where.config, comm->size(), r));
  const memory::Plan& plan = choice.plan;
  EXPECT_OR_RETURN(plan.options.offload_optimizer_nvme == where.state_in_file, "plan");
  EXPECT_OR_RETURN(plan.options.offload_param_nvme == where.params_in_file, "plan");
  ASSIGN_OR_RETURN(auto mem, EngineMemory::Allocate(plan, dev, nullptr));
  const ShardLayout layout(plan, mem->model_state());
  HostCollectives host(comm, dev, nullptr);
  ASSIGN_OR_RETURN(auto store,
                   UnitStore::Create(plan, layout, *mem, where.config, dev, nullptr, &host));
  *file_bytes = store->file_bytes();
  *planned_nvme = plan.nvme_bytes();
  const int nu = layout.num_units();
  const DType cdt = plan.options.compute_dtype;
  const size_t c = DTypeSize(cdt);
  const float nan = std::numeric_limits<float>::quiet_NaN();

  // --- StoreState, then LoadState of every unit ---
  std::vector<std::vector<float>> kept;  // sources, kept until the compute stream is synced
  for (int u = 0; u < nu; ++u) {
    const int64_t n = layout.region(u).n;
    for (int a = 0; a < 3; ++a) kept.push_back(RegionValues(a, r, u, n));
    RETURN_IF_ERROR(store->StoreState(u, kept[3 * u].data(), kept[3 * u + 1].data(),
                                      kept[3 * u + 2].data()));
  }
  RETURN_IF_ERROR(dev->Synchronize(nullptr));
  for (int u = 0; u < nu; ++u) {
    const Region& reg = layout.region(u);
    std::vector<float> got[3] = {std::vector<float>(reg.n, nan), std::vector<float>(reg.n, nan),
                                 std::vector<float>(reg.n, nan)};
    RETURN_IF_ERROR(store->LoadState(u, got[0].data(), got[1].data(), got[2].data()));
    const char* names[3] = {"loaded master", "loaded m", "loaded v"};
    for (int a = 0; a < 3; ++a) RETURN_IF_ERROR(CheckEqual(got[a].data(), kept[3 * u + a], names[a], u));
    // In memory, the state is where ShardLayout says it is.
    EXPECT_OR_RETURN((reg.m == nullptr) == where.state_in_file, "unit ", u);
    if (reg.m != nullptr) {
      RETURN_IF_ERROR(CheckEqual(reg.master, kept[3 * u], "region master", u));
      RETURN_IF_ERROR(
          CheckEqual(reinterpret_cast<const float*>(reg.m), kept[3 * u + 1], "region m", u));
      RETURN_IF_ERROR(
          CheckEqual(reinterpret_cast<const float*>(reg.v), kept[3 * u + 2], "region v", u));
    }
  }

  // --- StoreParams, then ShardToSend of every unit, forward and back ---
  std::vector<std::vector<char>> params;
  for (int u = 0; u < nu; ++u) {
    const int64_t n = layout.region(u).n;
    params.emplace_back(n * c);
    for (int64_t e = 0; e < n; ++e) StoreAs(cdt, params.back().data(), e, Value(3, r, u, e));
    RETURN_IF_ERROR(store->StoreParams(u, params.back().data()));
  }
  RETURN_IF_ERROR(dev->Synchronize(nullptr));
  std::vector<int> order;
  for (int u = 0; u < nu; ++u) order.push_back(u);
  for (int u = nu - 1; u >= 0; --u) order.push_back(u);
  for (int u : order) {
    const Region& reg = layout.region(u);
    EXPECT_OR_RETURN((reg.param == nullptr) == where.params_in_file, "unit ", u);
    std::vector<char> block(reg.n * c, '\xee');  // this rank's block of a gather destination
    const absl::Status read =
        store->StageShard(u, block.data(), nullptr, [](int) { return false; });
    const char* sent = store->ShardToSend(u, block.data());
    RETURN_IF_ERROR(dev->Synchronize(nullptr));
    RETURN_IF_ERROR(store->AgreeOnRead(read));
    EXPECT_OR_RETURN(sent == (where.params_on_host ? block.data() : reg.param), "unit ", u);
    EXPECT_OR_RETURN(std::memcmp(sent, params[u].data(), reg.n * c) == 0,
                     "the shard sent for unit ", u, " is not the one stored");
  }

  // --- BeforeSnapshot: what lives in a file is read into the snapshot's arrays ---
  const int64_t s = plan.shard_elements;
  std::vector<float> snap[3] = {std::vector<float>(s, -7.0f), std::vector<float>(s, -7.0f),
                                std::vector<float>(s, -7.0f)};
  std::vector<char> snap_param(s * c, '\x7f');
  void* param_arg = snap_param.data();
  RETURN_IF_ERROR(store->BeforeSnapshot(snap[0].data(), snap[1].data(), snap[2].data(),
                                        &param_arg));
  EXPECT_OR_RETURN((param_arg == nullptr) == where.params_in_file, "BeforeSnapshot's param");
  for (int u = 0; u < nu; ++u) {
    const memory::Unit& unit = plan.units[u];
    const Region& reg = layout.region(u);
    for (int a = 0; a < 3; ++a) {
      const float* at = snap[a].data() + unit.shard_offset;
      if (where.state_in_file) {
        // The file holds the shard: the region is the shard in stages 1-3.
        EXPECT_OR_RETURN(reg.n == unit.shard, "unit ", u);
        RETURN_IF_ERROR(CheckEqual(at, kept[3 * u + a], "snapshot state", u));
      } else {
        for (int64_t k = 0; k < unit.shard; ++k) {
          EXPECT_OR_RETURN(at[k] == -7.0f, "BeforeSnapshot wrote state held in memory");
        }
      }
    }
    const char* p = snap_param.data() + unit.shard_offset * c;
    if (where.params_in_file) {
      EXPECT_OR_RETURN(std::memcmp(p, params[u].data(), unit.shard * c) == 0,
                       "snapshot parameters of unit ", u);
    } else {
      for (int64_t k = 0; k < unit.shard * static_cast<int64_t>(c); ++k) {
        EXPECT_OR_RETURN(p[k] == '\x7f', "BeforeSnapshot wrote parameters held in memory");
      }
    }
  }

  // --- StoreState with null m and v: zeros ---
  for (int u = 0; u < nu; ++u) {
    kept[3 * u] = RegionValues(0, 1 - r, u, layout.region(u).n);  // a new master
    RETURN_IF_ERROR(store->StoreState(u, kept[3 * u].data(), nullptr, nullptr));
  }
  RETURN_IF_ERROR(dev->Synchronize(nullptr));
  for (int u = 0; u < nu; ++u) {
    const int64_t n = layout.region(u).n;
    const std::vector<float> zeros(n, 0.0f);
    std::vector<float> master(n, nan), m(n, nan), v(n, nan);
    RETURN_IF_ERROR(store->LoadState(u, master.data(), m.data(), v.data()));
    RETURN_IF_ERROR(CheckEqual(master.data(), kept[3 * u], "new master", u));
    RETURN_IF_ERROR(CheckEqual(m.data(), zeros, "m after a null store", u));
    RETURN_IF_ERROR(CheckEqual(v.data(), zeros, "v after a null store", u));
    // Null arrays are skipped on a load.
    std::vector<float> only_v(n, nan);
    RETURN_IF_ERROR(store->LoadState(u, nullptr, nullptr, only_v.data()));
    RETURN_IF_ERROR(CheckEqual(only_v.data(), zeros, "v alone", u));
  }
  return absl::OkStatus();
}

TEST_CASE("UnitStore: state and parameter shards round-trip wherever they live", "[zero]") {
  auto dev = testing::OneThreadCpuDevice();
  for (const Where& where : Places()) {
    INFO(where.name);
    REQUIRE(ValidateConfig(where.config).ok());
    const int world = 2;
    std::vector<int64_t> file_bytes(world, -1), planned(world, -1);
    const std::vector<absl::Status> st = OnRanks(world, [&](int r, comm::Communicator* comm) {
      return OneRank(where, r, comm, dev.get(), &file_bytes[r], &planned[r]);
    });
    for (int r = 0; r < world; ++r) {
      INFO("rank " << r << ": " << st[r]);
      REQUIRE(st[r].ok());
      // The swap file is exactly the plan's NVMe bytes; without NVMe there is none.
      CHECK(file_bytes[r] == planned[r]);
      CHECK((planned[r] > 0) == (where.state_in_file || where.params_in_file));
    }
  }
}

}  // namespace
}  // namespace zero_internal
}  // namespace zerort
