// Engine::memory_report's activation fields: the activations the trainer declared on its
// ParamSpecs, times the micro-batch, and the plan's whole device budget, against a closed form
// written out here from docs/memory_budget.md (not from the planner's code): model-state
// buffers (the report's own planned device bytes) + activations + CUDA context + NCCL
// communicator and buffers (world > 1) + cuBLAS workspace + ceil(fraction * (buffers +
// activations)).
#include <cmath>
#include <memory>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "comm/testing/on_ranks.h"
#include "device/cpu_device.h"
#include "zero/engine.h"

namespace zerort {
namespace {

// Two modules, the declarations spread over three parameters (the plan sums them wherever
// they sit) and none on the bias of the first.
std::vector<memory::ParamSpec> Model(int64_t a, int64_t b, int64_t c) {
  std::vector<memory::ParamSpec> specs = {{"fc1.w", {64, 32}, "fc1"},
                                          {"fc1.b", {64}, "fc1"},
                                          {"fc2.w", {16, 64}, "fc2"},
                                          {"fc2.b", {16}, "fc2"}};
  specs[0].activation_bytes_per_sample = a;
  specs[2].activation_bytes_per_sample = b;
  specs[3].activation_bytes_per_sample = c;
  return specs;
}

// Reserves small and distinct, so that each term shows in the total.
Config TestConfig(int stage, int64_t micro_batch) {
  Config c;
  c.zero.stage = stage;
  c.compute_dtype = DType::kBF16;
  c.train_micro_batch_size_per_gpu = micro_batch;
  c.reserves.cuda_context_bytes = 1000;
  c.reserves.nccl_communicator_bytes = 20000;
  c.reserves.nccl_buffsize = 300;
  c.reserves.nccl_channels = 7;
  c.reserves.cublas_workspace_bytes = 50;
  c.reserves.fragmentation_fraction = 0.25;
  return c;
}

// `nccl`: whether the engine's communicator is NCCL; only then do its communicator and buffers
// count (these engines run on the in-process group: never).
int64_t ExpectedBudget(const MemoryReport& r, int64_t activations, int world, bool nccl,
                       const ReservesConfig& res) {
  const int64_t buffers = r.planned[static_cast<int>(memory::MemoryKind::kDevice)];
  const int64_t peers = world - 1 < 2 ? world - 1 : 2;
  int64_t total = buffers + activations + res.cuda_context_bytes + res.cublas_workspace_bytes +
                  static_cast<int64_t>(std::ceil(res.fragmentation_fraction *
                                                 static_cast<double>(buffers + activations)));
  if (nccl) total += res.nccl_communicator_bytes + res.nccl_channels * peers * res.nccl_buffsize;
  return total;
}

// Every rank's report, in rank order.
std::vector<MemoryReport> Reports(const Config& config,
                                  const std::vector<memory::ParamSpec>& specs, int world) {
  std::unique_ptr<Device> device = CreateCpuDevice();
  std::vector<MemoryReport> reports(world);
  const std::vector<absl::Status> st =
      comm::testing::OnRanks(world, {20000}, [&](int rank, comm::Communicator* comm) {
        absl::StatusOr<std::unique_ptr<Engine>> e =
            Engine::Create(config, specs, comm, device.get());
        if (!e.ok()) return e.status();
        reports[rank] = (*e)->memory_report();
        return absl::OkStatus();
      });
  for (int r = 0; r < world; ++r) {
    INFO("rank " << r << ": " << st[r].message());
    REQUIRE(st[r].ok());
  }
  return reports;
}

TEST_CASE("EngineActivations: the report holds the declared bytes times the micro-batch, per "
          "rank, and the plan's whole device budget",
          "[zero]") {
  const int64_t a = 12345, b = 678, c = 9;
  for (int world : {1, 2}) {
    for (int stage : {0, 3}) {
      for (int64_t micro : {0, 1, 5}) {
        INFO("world " << world << ", stage " << stage << ", micro-batch " << micro);
        const Config config = TestConfig(stage, micro);
        const int64_t batch = micro > 0 ? micro : 1;  // unset: one sequence
        for (const MemoryReport& r : Reports(config, Model(a, b, c), world)) {
          CHECK(r.activation_bytes_per_sample == a + b + c);
          CHECK(r.micro_batch == batch);
          CHECK(r.activation_bytes == (a + b + c) * batch);
          CHECK(r.device_budget_bytes ==
                ExpectedBudget(r, (a + b + c) * batch, world, /*nccl=*/false, config.reserves));
        }
      }
    }
  }
}

TEST_CASE("EngineActivations: without declarations nothing is counted beyond the buffers",
          "[zero]") {
  for (const MemoryReport& r : Reports(TestConfig(2, 4), Model(0, 0, 0), 2)) {
    CHECK(r.activation_bytes_per_sample == 0);
    CHECK(r.micro_batch == 0);
    CHECK(r.activation_bytes == 0);
    CHECK(r.device_budget_bytes == r.planned[static_cast<int>(memory::MemoryKind::kDevice)]);
  }
}

TEST_CASE("EngineActivations: a negative declaration is InvalidArgument naming the parameter",
          "[zero]") {
  std::unique_ptr<Device> device = CreateCpuDevice();
  const std::vector<absl::Status> st =
      comm::testing::OnRanks(1, {20000}, [&](int, comm::Communicator* comm) {
        return Engine::Create(TestConfig(1, 2), Model(10, -3, 0), comm, device.get()).status();
      });
  INFO(st[0].message());
  CHECK(st[0].code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(st[0].message(), "fc2.w"));
  CHECK(absl::StrContains(st[0].message(), "activation_bytes_per_sample"));
}

TEST_CASE("EngineActivations: declared activations count against the device budget at Create",
          "[zero]") {
  // Fits with 1 sequence, not with 100: the planner's budget includes the declaration.
  Config config = TestConfig(2, 1);
  const std::vector<MemoryReport> fits = Reports(config, Model(1000, 0, 0), 1);
  config.zero.memory_budget.device_bytes = fits[0].device_budget_bytes;
  (void)Reports(config, Model(1000, 0, 0), 1);
  config.train_micro_batch_size_per_gpu = 100;
  std::unique_ptr<Device> device = CreateCpuDevice();
  const std::vector<absl::Status> st =
      comm::testing::OnRanks(1, {20000}, [&](int, comm::Communicator* comm) {
        return Engine::Create(config, Model(1000, 0, 0), comm, device.get()).status();
      });
  INFO(st[0].message());
  CHECK(st[0].code() == absl::StatusCode::kResourceExhausted);
}

}  // namespace
}  // namespace zerort
