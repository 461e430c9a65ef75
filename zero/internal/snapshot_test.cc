#include "zero/internal/snapshot.h"

#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "device/testing/one_thread.h"
#include "zero/internal/engine_memory.h"
#include "zero/internal/test_util.h"

namespace zerort {
namespace zero_internal {
namespace {

// Element x of unit u of owned array `a` (0 master, 1 m, 2 v, 3 parameters) in generation
// `gen` (1 or 2): distinct for neighbouring elements, units and arrays, and the parameters'
// exact in bf16 (integers below 256).
float Value(int a, int u, int64_t x, int gen) {
  if (a == 3) return static_cast<float>((gen == 1 ? 1 : -1) * ((x + 37 * u) % 251 + 1));
  return static_cast<float>(gen * 4096 + a * 1024 + u * 128 + (x % 128)) * 0.5f;
}

// One rank's owned state, its snapshot buffers and an OwnedSnapshot over them, on a device
// whose streams run on threads and start every operation 2 ms late: a copy that is not waited
// for has not landed.
struct Fixture {
  Fixture(int stage, int world, int rank, Device* device)
      : plan(SmallPlan(stage, world, rank, 1, DType::kBF16)), dev(device) {
    compute = dev->CreateStream().value();
    mem = EngineMemory::Allocate(plan, dev, nullptr).value();
    layout = std::make_unique<ShardLayout>(plan, mem->model_state());
    snapshot = std::make_unique<OwnedSnapshot>(plan, *layout, dev, compute);
    const size_t s = static_cast<size_t>(plan.shard_elements);
    for (std::vector<float>* a : {&master, &m, &v}) a->assign(s, -1.0f);
    param.assign(s * 2, '\x7f');
    Fill(1);
  }
  ~Fixture() {
    snapshot.reset();
    dev->Synchronize(compute).IgnoreError();
    dev->DestroyStream(compute);
  }

  float* Array(const Region& reg, int a) const {
    return a == 0 ? reg.master : reinterpret_cast<float*>(a == 1 ? reg.m : reg.v);
  }
  // Generation `gen` of every region, written by the host.
  void Fill(int gen) {
    for (int u = 0; u < layout->num_units(); ++u) {
      const Region& reg = layout->region(u);
      for (int64_t e = 0; e < reg.n; ++e) {
        for (int a = 0; a < 3; ++a) Array(reg, a)[e] = Value(a, u, reg.unit_begin + e, gen);
        StoreAs(DType::kBF16, reg.param, e, Value(3, u, reg.unit_begin + e, gen));
      }
    }
  }
  // Generation `gen` of every region, copied in on the compute stream (not waited for).
  void EnqueueFill(int gen) {
    for (int u = 0; u < layout->num_units(); ++u) {
      const Region& reg = layout->region(u);
      staged.emplace_back(4 * reg.n);
      std::vector<float>& host = staged.back();
      for (int a = 0; a < 3; ++a) {
        for (int64_t e = 0; e < reg.n; ++e) host[a * reg.n + e] = Value(a, u, reg.unit_begin + e, gen);
        REQUIRE(dev->Copy(Array(reg, a), &host[a * reg.n], reg.n * 4, compute).ok());
      }
      char* p = reinterpret_cast<char*>(&host[3 * reg.n]);
      for (int64_t e = 0; e < reg.n; ++e) {
        StoreAs(DType::kBF16, p, e, Value(3, u, reg.unit_begin + e, gen));
      }
      REQUIRE(dev->Copy(reg.param, p, reg.n * 2, compute).ok());
    }
  }

  // The snapshot holds generation `gen` of this rank's shard of every unit; the parameters
  // only when `with_param` (else their buffer is untouched).
  void RequireSnapshot(int gen, bool with_param) const {
    const int rank = plan.options.rank;
    int64_t covered = 0;
    for (int u = 0; u < layout->num_units(); ++u) {
      const memory::Unit& unit = plan.units[u];
      covered += unit.shard;
      for (int64_t k = 0; k < unit.shard; ++k) {
        const int64_t at = unit.shard_offset + k, x = rank * unit.shard + k;
        INFO("unit " << u << " shard element " << k << " (unit element " << x << ")");
        REQUIRE(master[at] == Value(0, u, x, gen));
        REQUIRE(m[at] == Value(1, u, x, gen));
        REQUIRE(v[at] == Value(2, u, x, gen));
        if (with_param) {
          REQUIRE(LoadAs(DType::kBF16, param.data(), at) == Value(3, u, x, gen));
        } else {
          REQUIRE(param[2 * at] == '\x7f');
          REQUIRE(param[2 * at + 1] == '\x7f');
        }
      }
    }
    REQUIRE(covered == plan.shard_elements);
  }

  absl::Status Begin(bool with_param) {
    return snapshot->Begin(master.data(), m.data(), v.data(),
                           with_param ? param.data() : nullptr);
  }

  const memory::Plan plan;
  Device* const dev;
  Device::Stream compute = nullptr;
  std::unique_ptr<EngineMemory> mem;
  std::unique_ptr<ShardLayout> layout;
  std::unique_ptr<OwnedSnapshot> snapshot;
  std::vector<float> master, m, v;
  std::vector<char> param;
  std::vector<std::vector<float>> staged;  // EnqueueFill's sources, kept until the end
};

std::unique_ptr<Device> SlowStreams() { return testing::AsyncOneThreadCpuDevice(2000); }

TEST_CASE("OwnedSnapshot: Begin and Wait copy exactly this rank's shard of the owned state",
          "[zero]") {
  auto dev = SlowStreams();
  for (int stage = 0; stage <= 3; ++stage) {
    for (int rank = 0; rank < 2; ++rank) {
      for (bool with_param : {true, false}) {
        INFO("stage " << stage << ", rank " << rank << " of 2"
                      << (with_param ? ", with parameters" : ""));
        Fixture f(stage, 2, rank, dev.get());
        REQUIRE(f.snapshot->Wait().ok());  // nothing begun: at once
        REQUIRE(f.Begin(with_param).ok());
        REQUIRE(f.snapshot->Wait().ok());
        f.RequireSnapshot(1, with_param);
      }
    }
  }
}

TEST_CASE("OwnedSnapshot: the copies follow the compute stream's earlier writes", "[zero]") {
  auto dev = SlowStreams();
  for (int stage : {0, 3}) {
    INFO("stage " << stage);
    Fixture f(stage, 2, 1, dev.get());
    f.EnqueueFill(2);  // still in flight on the compute stream
    REQUIRE(f.Begin(true).ok());
    REQUIRE(f.snapshot->Wait().ok());
    f.RequireSnapshot(2, true);
  }
}

TEST_CASE("OwnedSnapshot: Fence orders the next write of owned state after the copies",
          "[zero]") {
  auto dev = SlowStreams();
  for (int stage = 0; stage <= 3; ++stage) {
    for (bool host : {false, true}) {
      INFO("stage " << stage << (host ? ", host write" : ", compute-stream write"));
      Fixture f(stage, 2, 0, dev.get());
      REQUIRE(f.Begin(true).ok());
      REQUIRE(f.snapshot->Fence(host).ok());
      if (host) {
        f.Fill(2);
      } else {
        f.EnqueueFill(2);
      }
      REQUIRE(f.snapshot->Wait().ok());
      f.RequireSnapshot(1, true);
      // The write itself happened.
      REQUIRE(dev->Synchronize(f.compute).ok());
      const Region& reg = f.layout->region(0);
      REQUIRE(reg.master[0] == Value(0, 0, reg.unit_begin, 2));
      // A second Fence without a new Begin has nothing to wait for.
      REQUIRE(f.snapshot->Fence(host).ok());
    }
  }
}

// WaitHost fails once `fail` is set, as a device error surfacing at the wait would.
class FailingWaits final : public ForwardingDevice {
 public:
  using ForwardingDevice::ForwardingDevice;
  absl::Status WaitHost(Event e) override {
    absl::Status s = inner_->WaitHost(e);
    if (fail.load()) return absl::DataLossError("injected: the snapshot copy failed");
    return s;
  }
  std::atomic<bool> fail{false};
};

TEST_CASE("OwnedSnapshot: a Waiter outliving the object returns the copies' status", "[zero]") {
  auto slow = SlowStreams();
  SECTION("before any Begin") {
    Fixture f(2, 2, 1, slow.get());
    CHECK(f.snapshot->Waiter()().ok());
  }
  SECTION("from another thread while the object lives, then after Detach") {
    Fixture f(2, 2, 1, slow.get());
    const std::function<absl::Status()> waiter = f.snapshot->Waiter();
    REQUIRE(f.Begin(true).ok());
    absl::Status waited;
    std::thread other([&] { waited = waiter(); });
    other.join();
    REQUIRE(waited.ok());
    f.RequireSnapshot(1, true);  // the waiter waited for the copies
    f.snapshot->Detach();
    f.snapshot.reset();
    CHECK(waiter().ok());
  }
  SECTION("Detach waits for the copies and keeps their status") {
    FailingWaits dev(slow.get());
    std::function<absl::Status()> waiter;
    {
      Fixture f(1, 2, 0, &dev);
      waiter = f.snapshot->Waiter();
      REQUIRE(f.Begin(false).ok());
      dev.fail = true;
      f.snapshot->Detach();
      dev.fail = false;
      f.RequireSnapshot(1, false);  // landed before Detach returned
    }  // the snapshot, its streams and the owned state are gone
    const absl::Status s = waiter();
    CHECK(absl::IsDataLoss(s));
    CHECK(s.message() == "injected: the snapshot copy failed");
  }
}

}  // namespace
}  // namespace zero_internal
}  // namespace zerort
