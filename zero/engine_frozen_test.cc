// Frozen parameters: a LoRA-shaped model (frozen base matrices, small trainable adapters and
// biases) trains bitwise alike on every stage and world size, matches a serial AdamW that never
// touches the frozen ones, and its plan holds no gradient or optimizer state for them.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "base/status.h"
#include "base/testing/checks.h"
#include "comm/inprocess.h"
#include "comm/testing/on_ranks.h"
#include "device/cpu_device.h"
#include "memory/plan.h"
#include "zero/engine.h"
#include "zero/planner.h"
#include "zero/testing/synthetic_trainer.h"

namespace zerort {
namespace {

using testing::BitEqual;
using memory::ParamSpec;

// Base weights frozen, rank-2 adapters beside them, biases trainable, an embedding frozen.
std::vector<ParamSpec> LoraModel() {
  std::vector<ParamSpec> s = {
      {"embed.w", {37, 5}, "embed"},   {"l0.w", {13, 11}, "l0"},    {"l0.lora_a", {2, 11}, "l0"},
      {"l0.lora_b", {13, 2}, "l0"},    {"l0.b", {13}, "l0"},        {"l1.w", {64, 9}, "l1"},
      {"l1.lora_a", {2, 9}, "l1"},     {"l1.lora_b", {64, 2}, "l1"}, {"l1.b", {1}, "l1"},
      {"head.w", {101}, "head"}};
  for (ParamSpec& p : s) {
    p.frozen = p.name == "embed.w" || p.name == "l0.w" || p.name == "l1.w";
  }
  return s;
}

Config LoraConfig(int stage, DType precision, int gas, double clip) {
  Config c = testing::TestConfig(stage, precision, gas, clip, /*offload=*/false);
  c.zero.reduce_bucket_size = 150;  // several trainable and several frozen units
  return c;
}

std::vector<testing::TrainResult> Train(const Config& c, int world, int steps,
                                        const std::vector<ParamSpec>& specs = LoraModel()) {
  auto device = CreateCpuDevice();
  absl::StatusOr<std::vector<testing::TrainResult>> runs =
      testing::TrainRanks(c, specs, world, device.get(), steps);
  INFO(runs.status().ToString());
  REQUIRE(runs.ok());
  return *runs;
}

TEST_CASE("Frozen: a LoRA-shaped model trains bitwise alike on stages 0-3 and 1, 2, 4 ranks",
          "[zero]") {
  for (DType precision : {DType::kF32, DType::kBF16}) {
    for (int gas : {1, 2}) {
      for (int world : {1, 2, 4}) {
        // The ranks write different gradients: each world size has its own reference.
        const std::vector<testing::TrainResult> ref =
            Train(LoraConfig(0, precision, gas, 0.05), world, 6);
        for (int r = 1; r < world; ++r) CHECK(BitEqual(ref[r].master, ref[0].master));
        // Stages 1-3, then offloaded: the optimizer (1-3), and the parameters too (3).
        for (int variant = 1; variant <= 7; ++variant) {
          const int stage = variant <= 3 ? variant : std::min(variant - 3, 3);
          Config c = LoraConfig(stage, precision, gas, 0.05);
          if (variant > 3) c.zero.offload_optimizer.device = OffloadDevice::kCpu;
          if (variant == 7) c.zero.offload_param.device = OffloadDevice::kCpu;
          INFO("precision=" << DTypeName(precision) << " gas=" << gas << " stage=" << stage
                            << " world=" << world << " variant=" << variant);
          const std::vector<testing::TrainResult> runs = Train(c, world, 6);
          for (int r = 0; r < world; ++r) {
            CHECK(BitEqual(runs[r].master, ref[0].master));
            CHECK(runs[r].params == ref[0].params);
            for (int k = 0; k < memory::kNumMemoryKinds; ++k) {
              CHECK(runs[r].report.allocated[k] == runs[r].report.planned[k]);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("Frozen: fp32 training matches a serial AdamW that never touches frozen parameters",
          "[zero]") {
  const std::vector<ParamSpec> specs = LoraModel();
  for (int world : {1, 2}) {
    for (double clip : {0.0, 0.05}) {
      const Config c = LoraConfig(2, DType::kF32, 2, clip);
      const std::vector<testing::TrainResult> runs = Train(c, world, 8);
      const std::vector<double> ref =
          testing::SerialAdamW(LoraModel(), world, 8, 2, clip, c.optimizer);
      REQUIRE(runs[0].master.size() == ref.size());
      double worst = 0;
      size_t j = 0;
      for (int i = 0; i < static_cast<int>(specs.size()); ++i) {
        for (int64_t k = 0; k < specs[i].numel(); ++k, ++j) {
          if (specs[i].frozen) {
            // Never touched: the initial value, bit for bit.
            CHECK(runs[0].master[j] == testing::InitValue(i, k));
            continue;
          }
          worst = std::max(worst,
                           std::fabs(runs[0].master[j] - ref[j]) / std::max(std::fabs(ref[j]), 1.0));
        }
      }
      INFO("world=" << world << " clip=" << clip << " worst=" << worst);
      CHECK(worst <= 1e-6);
    }
  }
}

TEST_CASE("Frozen: the config's glob freezes what ParamSpec::frozen does", "[zero]") {
  std::vector<ParamSpec> unflagged = LoraModel();
  for (ParamSpec& p : unflagged) p.frozen = false;
  Config by_glob = LoraConfig(3, DType::kBF16, 1, 0);
  by_glob.frozen_params = "embed.*, l?.w";
  const std::vector<testing::TrainResult> a = Train(by_glob, 2, 3, unflagged);
  const std::vector<testing::TrainResult> b = Train(LoraConfig(3, DType::kBF16, 1, 0), 2, 3);
  CHECK(BitEqual(a[0].master, b[0].master));

  by_glob.frozen_params = "nothing.*";
  absl::StatusOr<PlanChoice> choice = ChoosePlan(unflagged, by_glob, 1, 0);
  REQUIRE(choice.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(choice.status().message().find("'nothing.*'") != std::string::npos);
}

TEST_CASE("Frozen: the plan holds no gradient or optimizer state for frozen parameters",
          "[memory]") {
  std::vector<ParamSpec> trainable_only;
  for (const ParamSpec& p : LoraModel()) {
    if (!p.frozen) trainable_only.push_back(p);
  }
  for (int stage = 0; stage <= 3; ++stage) {
    for (DType precision : {DType::kF32, DType::kBF16}) {
      memory::PlanOptions o;
      o.stage = stage;
      o.world_size = 4;
      o.rank = 1;
      o.compute_dtype = precision;
      o.unit_target_elements = 150;
      o.gradient_accumulation_steps = 2;
      o.offload_optimizer = stage == 2;
      o.offload_param = stage == 3;
      const memory::Plan lora = memory::MakePlan(LoraModel(), o).value();
      const memory::Plan alone = memory::MakePlan(trainable_only, o).value();
      INFO("stage=" << stage << " precision=" << DTypeName(precision));
      // Gradients, master, m, v, the accumulator, buckets and staging: exactly the plan of the
      // trainable parameters alone.
      for (memory::BufferClass cls :
           {memory::BufferClass::kGrads, memory::BufferClass::kMaster,
            memory::BufferClass::kExpAvg, memory::BufferClass::kExpAvgSq,
            memory::BufferClass::kGradAccumulator, memory::BufferClass::kGradBucket,
            memory::BufferClass::kOffloadStaging}) {
        const memory::Buffer* x = lora.Find(cls);
        const memory::Buffer* y = alone.Find(cls);
        REQUIRE((x == nullptr) == (y == nullptr));
        if (x != nullptr) CHECK(x->bytes == y->bytes);
      }
      // The frozen units come last and hold the frozen parameters, only them.
      for (size_t u = 0; u < lora.units.size(); ++u) {
        CHECK(lora.units[u].frozen == (static_cast<int>(u) >= lora.trainable_units));
        for (int i : lora.units[u].params) CHECK(LoraModel()[i].frozen == lora.units[u].frozen);
      }
      CHECK(lora.trainable_padded_elements == alone.padded_elements);
      CHECK(lora.frozen_elements == 37 * 5 + 13 * 11 + 64 * 9);
      // The frozen units are built as a model of the frozen parameters alone would be: what
      // such a model, trained, would hold in gradients and optimizer state is what is saved.
      std::vector<ParamSpec> frozen_alone;
      for (ParamSpec p : LoraModel()) {
        if (!p.frozen) continue;
        p.frozen = false;
        frozen_alone.push_back(p);
      }
      const memory::Plan other = memory::MakePlan(frozen_alone, o).value();
      int64_t state = 0;
      for (memory::BufferClass cls : {memory::BufferClass::kGrads, memory::BufferClass::kMaster,
                                      memory::BufferClass::kExpAvg, memory::BufferClass::kExpAvgSq}) {
        if (const memory::Buffer* b = other.Find(cls)) state += b->bytes;
      }
      CHECK(lora.frozen_state_bytes_saved == state);
      CHECK(lora.padded_elements == alone.padded_elements + other.padded_elements);
      CHECK(lora.Find(memory::BufferClass::kParams)->bytes ==
            alone.Find(memory::BufferClass::kParams)->bytes +
                other.Find(memory::BufferClass::kParams)->bytes);
      std::vector<ParamSpec> none_frozen = LoraModel();
      for (ParamSpec& p : none_frozen) p.frozen = false;
      const memory::Plan full = memory::MakePlan(none_frozen, o).value();
      CHECK(lora.comm_bytes_per_step < full.comm_bytes_per_step);
    }
  }
}

TEST_CASE("Frozen: gradient calls on a frozen parameter fail naming it", "[zero]") {
  auto device = CreateCpuDevice();
  auto comms = comm::CreateInProcessGroup(1, {20000}).value();
  const std::vector<ParamSpec> specs = LoraModel();
  auto engine =
      Engine::Create(LoraConfig(1, DType::kBF16, 1, 0), specs, comms[0].get(), device.get());
  REQUIRE(engine.ok());
  Engine& e = **engine;
  REQUIRE(testing::SetInitValues(e).ok());
  CHECK(e.frozen(1));
  CHECK_FALSE(e.frozen(2));
  const absl::Status ready = e.GradReady(1);
  CHECK(ready.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(ready.message().find("'l0.w'") != std::string::npos);
  CHECK(e.grad(5).status().message().find("'l1.w'") != std::string::npos);
  CHECK(e.GradReadyUnit(e.unit_of(0)).code() == absl::StatusCode::kFailedPrecondition);
  // Step waits for every trainable gradient and for no frozen one.
  std::vector<std::vector<char>> host;
  REQUIRE(testing::Backward(e, 0, 0, &host).ok());
  absl::StatusOr<StepStats> step = e.Step();
  INFO(step.status().ToString());
  REQUIRE(step.ok());
  CHECK(step->boundary);
  // The frozen set is fixed for the engine's life; asking for what is already so is fine.
  CHECK(e.SetFrozen(1, true).ok());
  const absl::Status unfreeze = e.SetFrozen(1, false);
  CHECK(unfreeze.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(unfreeze.message().find("create a new engine") != std::string::npos);
}

TEST_CASE("Frozen: NVMe offload and an all-frozen model are refused, naming why", "[memory]") {
  std::vector<ParamSpec> specs = LoraModel();
  memory::PlanOptions o;
  o.stage = 2;
  o.offload_optimizer = o.offload_optimizer_nvme = true;
  absl::StatusOr<memory::Plan> nvme = memory::MakePlan(specs, o);
  REQUIRE(nvme.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(nvme.status().message().find("'embed.w'") != std::string::npos);
  for (ParamSpec& p : specs) p.frozen = true;
  CHECK(memory::MakePlan(specs, memory::PlanOptions()).status().message().find("nothing") !=
        std::string::npos);
}

}  // namespace
}  // namespace zerort
