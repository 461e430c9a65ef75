#include "zero/planner.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <utility>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "comm/launch_env.h"
#include "zero/auto_fill.h"
#include "zero/model_spec.h"

namespace zerort {
namespace {

int64_t Count(const std::vector<memory::ParamSpec>& specs) {
  int64_t n = 0;
  for (const auto& s : specs) {
    const int64_t e = s.numel();
    n += e;
  }
  return n;
}

TEST_CASE("Models: presets match the published parameter counts", "[zero]") {
  // Counts as reported by the models' reference implementations (Hugging Face
  // num_parameters()), independent of how the presets are written.
  const std::vector<std::pair<std::string, int64_t>> expected = {
      {"gpt2-124m", 124439808},        {"gpt2-1.5b", 1557611200},
      {"llama2-7b", 6738415616},       {"llama2-13b", 13015864320},
      {"llama2-70b", 68976648192}};
  for (const auto& [name, count] : expected) {
    auto specs = ModelPreset(name);
    REQUIRE(specs.ok());
    CHECK(Count(*specs) == count);
  }
  auto unknown = ModelPreset("gpt5");
  REQUIRE_FALSE(unknown.ok());
  CHECK_THAT(std::string(unknown.status().message()), Catch::Contains("llama2-70b"));
}

TEST_CASE("Models: JSON model files are parsed and errors name the path", "[zero]") {
  auto ok = ParseModelJson(
      R"({"modules": [{"name": "l0", "params": [{"name": "w", "shape": [3, 4]}]}]})", "m.json");
  REQUIRE(ok.ok());
  REQUIRE(ok->size() == 1);
  CHECK((*ok)[0].name == "l0.w");
  CHECK((*ok)[0].module == "l0");
  auto bad = ParseModelJson(
      R"({"modules": [{"name": "l0", "params": [{"name": "w", "shape": [3, 0]}]}]})", "m.json");
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(std::string(bad.status().message()),
             Catch::Contains("m.json: modules[0].params[0].shape[1]"));
  auto broken = ParseModelJson("{", "m.json");
  REQUIRE_FALSE(broken.ok());
  CHECK_THAT(std::string(broken.status().message()), Catch::Contains("m.json"));
  // base/json's strictness: a duplicate key, an unknown key and a non-regular file are refused.
  auto duplicate = ParseModelJson(
      R"({"modules": [{"name": "l0", "name": "l1", "params": [{"name": "w", "shape": [3]}]}]})",
      "m.json");
  CHECK_THAT(std::string(duplicate.status().message()),
             Catch::Contains("m.json: modules[0].name: duplicate key"));
  auto unknown = ParseModelJson(
      R"({"modules": [{"name": "l0", "dtype": "bf16", "params": [{"name": "w", "shape": [3]}]}]})",
      "m.json");
  CHECK_THAT(std::string(unknown.status().message()),
             Catch::Contains("m.json: modules[0].dtype: unknown key"));
  // Unknown keys at every level: the nearest valid key when one is close, else the list.
  for (auto [text, message] : std::vector<std::pair<const char*, const char*>>{
           {R"({"modules": [], "extra": 1})", "m.json: extra: unknown key (expected modules)"},
           {R"({"modulez": []})", "m.json: modulez: unknown key; did you mean \"modules\"?"},
           {R"({"modules": [{"name": "l", "params": [{"name": "w", "shape": [3], "dtype": 1}]}]})",
            "m.json: modules[0].params[0].dtype: unknown key (expected name, shape, "
            "grad_buffer, grad_buffer_offset)"},
           {R"({"modules": [{"name": "l", "params": [{"name": "w", "shap": [3]}]}]})",
            "m.json: modules[0].params[0].shap: unknown key; did you mean \"shape\"?"},
           {R"({"modules": [{"name": "l", "parms": []}]})",
            "m.json: modules[0].parms: unknown key; did you mean \"params\"?"}}) {
    auto refused = ParseModelJson(text, "m.json");
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(refused.status().message()) == message);
  }
  // A declared gradient buffer (memory::ParamSpec::grad_buffer), packed or at an offset.
  auto declared = ParseModelJson(
      R"({"modules": [{"name": "l", "params": [{"name": "w", "shape": [3], "grad_buffer": "g"},)"
      R"( {"name": "b", "shape": [3], "grad_buffer": "g", "grad_buffer_offset": 8}]}]})",
      "m.json");
  REQUIRE(declared.ok());
  CHECK((*declared)[0].grad_buffer == "g");
  CHECK((*declared)[0].grad_buffer_offset == memory::kGradBufferPacked);
  CHECK((*declared)[1].grad_buffer_offset == 8);
  auto offset_alone = ParseModelJson(
      R"({"modules": [{"name": "l", "params": [{"name": "w", "shape": [3],)"
      R"( "grad_buffer_offset": 0}]}]})",
      "m.json");
  CHECK_THAT(std::string(offset_alone.status().message()),
             Catch::Contains("modules[0].params[0].grad_buffer_offset: needs grad_buffer"));
  auto device = LoadModelFile("/dev/zero");
  CHECK(device.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(device.status().message()), Catch::Contains("not a regular file"));
  CHECK(LoadModelFile("no/such/model.json").status().code() == absl::StatusCode::kNotFound);
}

// A config of `stage auto` with a device budget.
Config AutoConfig(int64_t device_bytes, int64_t host_bytes = 0) {
  Config c;
  c.compute_dtype = DType::kBF16;
  c.zero.stage_auto = true;
  c.zero.memory_budget.device_bytes = device_bytes;
  c.zero.memory_budget.host_bytes = host_bytes;
  c.zero.stage3_param_persistence_threshold = 0;
  c.zero.reduce_bucket_size = 1000000;  // one unit per layer
  c.zero.stage3_prefetch_bucket_size = 1000000;
  return c;
}

// AutoConfig's settings with an explicit `stage`.
Config StageConfig(int stage) {
  Config c = AutoConfig(0);
  c.zero.stage_auto = false;
  c.zero.stage = stage;
  return c;
}

TEST_CASE("Planner: auto picks the lowest stage that fits, at the byte boundary", "[zero]") {
  auto specs = SyntheticModel(10000000, 10);
  REQUIRE(specs.ok());
  const int world = 8;
  // The device bytes each explicit stage needs, computed through the explicit path.
  int64_t need[4];
  for (int stage = 0; stage < 4; ++stage) {
    Config c = StageConfig(stage);
    auto choice = ChoosePlan(*specs, c, world, 0);
    REQUIRE(choice.ok());
    need[stage] = choice->plan.device_bytes();
  }
  REQUIRE(need[0] > need[1]);
  REQUIRE(need[1] > need[2]);
  REQUIRE(need[2] > need[3]);
  for (int stage = 0; stage < 4; ++stage) {
    auto exact = ChoosePlan(*specs, AutoConfig(need[stage]), world, 0);
    REQUIRE(exact.ok());
    CHECK(exact->plan.options.stage == stage);
    CHECK_FALSE(exact->plan.options.offload_optimizer);
    CHECK_THAT(exact->reason, Catch::Contains("auto chose stage " + std::to_string(stage)));
    if (stage < 3) {
      auto under = ChoosePlan(*specs, AutoConfig(need[stage] - 1), world, 0);
      REQUIRE(under.ok());
      CHECK(under->plan.options.stage == stage + 1);
    }
  }
  // One byte under stage 3 without offload: offload is next, and needs host memory.
  auto offload = ChoosePlan(*specs, AutoConfig(need[3] - 1), world, 0);
  REQUIRE(offload.ok());
  CHECK(offload->plan.options.offload_optimizer);
  CHECK(offload->plan.device_bytes() <= need[3] - 1);
}

TEST_CASE("Planner: over several nodes auto also chooses the shard group, smallest first, at "
          "the byte boundary",
          "[zero]") {
  auto specs = SyntheticModel(10000000, 10);
  REQUIRE(specs.ok());
  const int world = 16, per_node = 4;
  // The device bytes of each explicit (stage, mics_shard_size), through the explicit path.
  auto need = [&](int stage, int group) {
    Config c = StageConfig(stage);
    c.zero.mics_shard_size = group;
    c.ranks_per_node = per_node;
    auto choice = ChoosePlan(*specs, c, world, 0);
    REQUIRE(choice.ok());
    return choice->plan.device_bytes();
  };
  // The documented order: every stage in groups of 4, then 8, then flat (0); stage 0 never.
  std::vector<std::pair<int, int>> order;
  for (int group : {4, 8, 0}) {
    for (int stage = 1; stage <= 3; ++stage) order.push_back({stage, group});
  }
  std::vector<int64_t> needs;
  for (const auto& [stage, group] : order) needs.push_back(need(stage, group));
  // A group holds more per rank than a larger one at the same stage: the choice is not trivial.
  REQUIRE(needs[0] > needs[3]);
  REQUIRE(needs[2] > needs[8]);
  for (size_t i = 0; i < order.size(); ++i) {
    for (int64_t budget : {needs[i], needs[i] - 1}) {
      CAPTURE(order[i].first, order[i].second, budget);
      size_t expected = 0;
      while (expected < order.size() && needs[expected] > budget) ++expected;
      Config c = AutoConfig(budget);
      c.ranks_per_node = per_node;
      auto chosen = ChoosePlan(*specs, c, world, 0);
      REQUIRE(chosen.ok());
      if (expected == order.size()) {  // nothing fits without offload
        CHECK(chosen->plan.options.offload_optimizer);
        continue;
      }
      CHECK_FALSE(chosen->plan.options.offload_optimizer);
      CHECK(chosen->plan.options.stage == order[expected].first);
      CHECK(chosen->plan.options.shard_group_size == order[expected].second);
      CHECK(chosen->plan.device_bytes() == needs[expected]);
      // Each rank chooses alone (Engine::Create), so every rank must reach the same choice,
      // at the boundary too; a rank-dependent need would split the world between two plans.
      for (int rank = 1; rank < world; ++rank) {
        CAPTURE(rank);
        auto other = ChoosePlan(*specs, c, world, rank);
        REQUIRE(other.ok());
        CHECK(other->plan.options.stage == chosen->plan.options.stage);
        CHECK(other->plan.options.shard_group_size == chosen->plan.options.shard_group_size);
        CHECK(other->plan.device_bytes() == chosen->plan.device_bytes());
      }
      CHECK_THAT(chosen->reason, Catch::Contains("from zerort.ranks_per_node 4"));
      if (order[expected].second > 0) {
        CHECK_THAT(chosen->reason,
                   Catch::Contains(absl::StrCat("auto chose stage ", order[expected].first,
                                                " in shard groups of ", order[expected].second,
                                                " (HSDP)")));
      }
    }
  }
  // Room for stage 0 still gives HSDP's stage 1 in node-sized groups: less memory, and only the
  // all-reduce of a quarter of the gradients between nodes.
  const int64_t stage0 = need(0, 0);
  REQUIRE(stage0 > needs[0]);
  Config roomy = AutoConfig(stage0);
  roomy.ranks_per_node = per_node;
  auto hsdp = ChoosePlan(*specs, roomy, world, 0);
  REQUIRE(hsdp.ok());
  CHECK(hsdp->plan.options.stage == 1);
  CHECK(hsdp->plan.options.shard_group_size == 4);
  // A layout in the config, one node, or an unknown node size: the stages alone, as before.
  Config fixed = roomy;
  fixed.zero.mics_shard_size = world;
  Config one_node = roomy;
  one_node.ranks_per_node = world;
  Config unknown = roomy;
  unknown.ranks_per_node = 0;
  for (const Config& c : {fixed, one_node, unknown}) {
    auto plain = ChoosePlan(*specs, c, world, 0);
    REQUIRE(plain.ok());
    CHECK(plain->plan.options.stage == 0);
    CHECK_THAT(plain->reason, !Catch::Contains("shard groups"));
  }
}

TEST_CASE("Planner: auto keeps as much optimizer state on the device as the budget allows",
          "[zero]") {
  auto specs = SyntheticModel(10000000, 10);
  REQUIRE(specs.ok());
  const int world = 8;
  // What stage 3 needs without offload (auto's last candidate before offload) and with all of
  // the optimizer state offloaded: budgets in between make auto offload, with room to spare.
  auto no_offload = ChoosePlan(*specs, StageConfig(3), world, 0);
  REQUIRE(no_offload.ok());
  const int64_t hi = no_offload->plan.device_bytes();
  // One byte under it auto offloads, at the lowest stage s whose full offload fits; from what
  // that needs up, auto keeps stage s.
  auto under = ChoosePlan(*specs, AutoConfig(hi - 1), world, 0);
  REQUIRE(under.ok());
  const int s = under->plan.options.stage;
  Config full_offload = StageConfig(s);
  full_offload.zero.offload_optimizer.device = OffloadDevice::kCpu;
  auto full = ChoosePlan(*specs, full_offload, world, 0);
  REQUIRE(full.ok());
  const int64_t lo = full->plan.device_bytes();
  REQUIRE(lo < hi - 1);
  for (int64_t budget : {lo, lo + (hi - lo) / 4, lo + (hi - lo) / 2, hi - 1}) {
    INFO("device budget " << budget);
    auto chosen = ChoosePlan(*specs, AutoConfig(budget), world, 0);
    REQUIRE(chosen.ok());
    const memory::PlanOptions& o = chosen->plan.options;
    REQUIRE(o.offload_optimizer);
    CHECK(o.stage == s);
    CHECK(chosen->plan.device_bytes() <= budget);
    // The ratio is the smallest multiple of 0.001 whose plan fits, found here by scanning them
    // all (auto bisects).
    int64_t smallest = -1;
    memory::PlanOptions scan = o;
    for (int64_t k = 0; k <= 1000 && smallest < 0; ++k) {
      scan.offload_optimizer_ratio = k / 1000.0;
      auto plan = memory::MakePlan(*specs, scan);
      REQUIRE(plan.ok());
      if (plan->device_bytes() <= budget) smallest = k;
    }
    REQUIRE(smallest >= 0);
    auto at_smallest = memory::MakePlan(*specs, [&] {
      memory::PlanOptions p = o;
      p.offload_optimizer_ratio = smallest / 1000.0;
      return p;
    }());
    REQUIRE(at_smallest.ok());
    CHECK(chosen->plan.device_state_elements == at_smallest->device_state_elements);
    if (budget == hi - 1) CHECK(at_smallest->device_state_elements > 0);
    if (at_smallest->device_state_elements == 0) {
      // No room for one more unit: everything stays offloaded, and the reason says nothing of
      // a ratio.
      CHECK(o.offload_optimizer_ratio == 1.0);
      CHECK(chosen->plan.offloaded_state_elements == chosen->plan.trainable_shard_elements);
      CHECK_THAT(chosen->reason, !Catch::Contains("offload_optimizer.ratio"));
    } else {
      CHECK(o.offload_optimizer_ratio == smallest / 1000.0);
      CHECK(chosen->plan.device_state_elements > 0);
      CHECK(chosen->plan.offload_ratio_achieved() < 1);
      CHECK(chosen->plan.offload_ratio_achieved() >= o.offload_optimizer_ratio);
      CHECK_THAT(chosen->reason, Catch::Contains("offload_optimizer.ratio"));
      CHECK_THAT(chosen->reason, Catch::Contains("(auto; the config's 1)"));
      CHECK_THAT(chosen->reason, Catch::Contains("kept on the device"));
      // Planning the reported ratio again gives the same plan (it is one a config can write).
      Config again = StageConfig(s);
      again.zero.offload_optimizer.device = OffloadDevice::kCpu;
      again.zero.offload_optimizer.ratio = o.offload_optimizer_ratio;
      auto replanned = ChoosePlan(*specs, again, world, 0);
      REQUIRE(replanned.ok());
      CHECK(replanned->plan.device_bytes() == chosen->plan.device_bytes());
      CHECK(replanned->plan.device_state_elements == chosen->plan.device_state_elements);
    }
  }
  // The config's ratio is the most auto offloads: at 0.5 auto starts from half on the device.
  Config half = AutoConfig(hi - 1);
  half.zero.offload_optimizer.ratio = 0.5;
  auto from_half = ChoosePlan(*specs, half, world, 0);
  REQUIRE(from_half.ok());
  CHECK(from_half->plan.options.offload_optimizer_ratio <= 0.5);
  // Counted activations count too: the same budget keeps less on the device when the
  // activations of a micro-batch must fit beside the state.
  // (Reserves set to zero: this model is far smaller than a CUDA context.)
  auto declared = *specs;
  for (memory::ParamSpec& p : declared) p.activation_bytes_per_sample = 1000;
  const int64_t budget = hi - 1;
  Config counted = AutoConfig(budget);
  counted.reserves.cuda_context_bytes = 0;
  counted.reserves.nccl_communicator_bytes = 0;
  counted.reserves.nccl_buffsize = 0;
  counted.reserves.cublas_workspace_bytes = 0;
  counted.reserves.fragmentation_fraction = 0;
  auto with_acts = ChoosePlan(declared, counted, world, 0);
  auto without = ChoosePlan(*specs, AutoConfig(budget), world, 0);
  REQUIRE(with_acts.ok());
  REQUIRE(without.ok());
  REQUIRE(with_acts->budget.counted);
  CHECK(with_acts->budget.total_bytes <= budget);
  CHECK(with_acts->plan.device_bytes() + with_acts->budget.activation_bytes <= budget);
  CHECK(with_acts->plan.device_state_elements <= without->plan.device_state_elements);
}

TEST_CASE("Planner: when nothing fits the error names the smallest need and a world that fits",
          "[zero]") {
  auto specs = SyntheticModel(10000000, 10);
  REQUIRE(specs.ok());
  auto none = ChoosePlan(*specs, AutoConfig(1000, 1000), 8, 0);
  REQUIRE_FALSE(none.ok());
  CHECK(none.status().code() == absl::StatusCode::kResourceExhausted);
  const std::string msg(none.status().message());
  CHECK_THAT(msg, Catch::Contains("smallest requirement found"));
  CHECK_THAT(msg, Catch::Contains("no world size up to 65536 fits"));
  // Gradient offload leaves the device only per-unit buffers, which no world size shrinks: the
  // host budget is what a bigger world meets (its share of the offloaded state is smaller).
  auto bigger_world = ChoosePlan(*specs, AutoConfig(12 << 20, 40 << 20), 2, 0);
  REQUIRE_FALSE(bigger_world.ok());
  CHECK_THAT(std::string(bigger_world.status().message()), Catch::Contains("it would fit on"));
}

TEST_CASE("Planner: fp32 gradient accumulation with offload keeps 4-byte gradients on the host",
          "[zero]") {
  auto specs = SyntheticModel(10000000, 10);
  REQUIRE(specs.ok());
  for (bool fp32 : {false, true}) {
    CAPTURE(fp32);
    Config c = StageConfig(2);
    c.zero.offload_optimizer.device = OffloadDevice::kCpu;
    if (fp32) c.grad_accum_dtype = DType::kF32;
    auto choice = ChoosePlan(*specs, c, 8, 0);
    REQUIRE(choice.ok());
    const memory::Buffer* staging = choice->plan.Find(memory::BufferClass::kOffloadStaging);
    REQUIRE(staging != nullptr);
    // Each chunk holds a unit's bf16 parameter shard (2 bytes an element); the gradient shard
    // (4 or 2 bytes an element) is in host memory whole (gradient offload).
    const int64_t shard = choice->plan.max_unit_elements / 8;
    CHECK(staging->bytes == staging->count * shard * 2);
    const memory::Buffer* grads = choice->plan.Find(memory::BufferClass::kGrads);
    REQUIRE(grads != nullptr);
    CHECK(grads->kind == memory::MemoryKind::kPinnedHost);
    CHECK(grads->bytes == choice->plan.shard_elements * (fp32 ? 4 : 2));
  }
  // "auto" may pick offload with fp32 accumulation too: a device budget that only stage 3
  // with the optimizer state on the host fits.
  Config s3 = StageConfig(3);
  s3.zero.offload_optimizer.device = OffloadDevice::kCpu;
  s3.grad_accum_dtype = DType::kF32;
  auto s3_plan = ChoosePlan(*specs, s3, 8, 0);
  REQUIRE(s3_plan.ok());
  Config c = AutoConfig(s3_plan->plan.device_bytes(), 1LL << 40);
  c.grad_accum_dtype = DType::kF32;
  auto offload = ChoosePlan(*specs, c, 8, 0);
  REQUIRE(offload.ok());
  CHECK(offload->plan.options.offload_optimizer);
  CHECK(offload->plan.options.fp32_grad_accum);
}

TEST_CASE("Planner: offload_param \"nvme\" without optimizer offload plans the shard in a file",
          "[zero]") {
  auto specs = SyntheticModel(1000000, 10);
  REQUIRE(specs.ok());
  Config c = StageConfig(3);
  c.zero.offload_param.device = OffloadDevice::kNvme;
  c.zero.offload_param.nvme_path = "/nvme";
  auto nvme = ChoosePlan(*specs, c, 4, 0);
  REQUIRE(nvme.ok());
  c.zero.offload_param.device = OffloadDevice::kCpu;
  auto cpu = ChoosePlan(*specs, c, 4, 0);
  REQUIRE(cpu.ok());
  CHECK(nvme->plan.options.offload_param);
  CHECK(nvme->plan.options.offload_param_nvme);
  CHECK_FALSE(nvme->plan.options.offload_optimizer);
  const memory::Buffer* shard = nvme->plan.Find(memory::BufferClass::kParams);
  REQUIRE(shard != nullptr);
  CHECK(shard->kind == memory::MemoryKind::kNvme);
  CHECK(nvme->plan.nvme_bytes() >= shard->bytes);
  // Host memory: only the pinned buffers the shards move through.
  const memory::Buffer* buffers = nvme->plan.Find(memory::BufferClass::kNvmeParamBuffers);
  REQUIRE(buffers != nullptr);
  CHECK(nvme->plan.host_bytes() == 0);
  CHECK(nvme->plan.pinned_host_bytes() == buffers->bytes);
  CHECK(nvme->plan.device_bytes() == cpu->plan.device_bytes());
  CHECK(cpu->plan.pinned_host_bytes() + cpu->plan.host_bytes() >= shard->bytes);
}

TEST_CASE("Planner: auto puts the optimizer state on NVMe when host memory is too small",
          "[zero]") {
  auto specs = SyntheticModel(10000000, 10);
  REQUIRE(specs.ok());
  // Explicit plans: stage 3 with the optimizer state in host memory, and on NVMe.
  Config explicit_cpu = StageConfig(3);
  explicit_cpu.zero.offload_optimizer.device = OffloadDevice::kCpu;
  auto cpu = ChoosePlan(*specs, explicit_cpu, 8, 0);
  REQUIRE(cpu.ok());
  Config explicit_nvme = explicit_cpu;
  explicit_nvme.zero.offload_optimizer.device = OffloadDevice::kNvme;
  explicit_nvme.zero.offload_optimizer.nvme_path = "/nvme";
  auto nvme = ChoosePlan(*specs, explicit_nvme, 8, 0);
  REQUIRE(nvme.ok());
  const int64_t nvme_host = nvme->plan.host_bytes() + nvme->plan.pinned_host_bytes();
  REQUIRE(nvme_host < cpu->plan.host_bytes() + cpu->plan.pinned_host_bytes());
  REQUIRE(nvme->plan.nvme_bytes() > 0);
  // Device memory only for stage 3 with offload, host memory only for the NVMe plan's.
  Config c = AutoConfig(cpu->plan.device_bytes(), nvme_host);
  auto without_path = ChoosePlan(*specs, c, 8, 0);
  REQUIRE_FALSE(without_path.ok());  // no nvme_path: NVMe is never a candidate
  CHECK(without_path.status().code() == absl::StatusCode::kResourceExhausted);
  c.zero.offload_optimizer.nvme_path = "/nvme";
  auto chosen = ChoosePlan(*specs, c, 8, 0);
  REQUIRE(chosen.ok());
  CHECK(chosen->plan.options.stage == 3);
  CHECK(chosen->plan.options.offload_optimizer);
  CHECK_FALSE(chosen->plan.options.offload_param);
  CHECK(chosen->plan.options.offload_optimizer_nvme);
  CHECK(chosen->plan.nvme_bytes() == nvme->plan.nvme_bytes());
  CHECK_THAT(chosen->reason, Catch::Contains("optimizer offload (optimizer state on NVMe)"));
  CHECK_THAT(chosen->reason, Catch::Contains("rejected: stage 0"));
  // A host budget that CPU offload fits keeps the state in host memory.
  c.zero.memory_budget.host_bytes = 0;
  auto unlimited = ChoosePlan(*specs, c, 8, 0);
  REQUIRE(unlimited.ok());
  CHECK(unlimited->plan.options.offload_optimizer);
  CHECK_FALSE(unlimited->plan.options.offload_optimizer_nvme);
  // An explicit NVMe config with stage "auto" plans no NVMe for the candidates without offload.
  c.zero.offload_optimizer.device = OffloadDevice::kNvme;
  c.zero.memory_budget.device_bytes = 1LL << 40;
  auto big = ChoosePlan(*specs, c, 8, 0);
  REQUIRE(big.ok());
  CHECK(big->plan.options.stage == 0);
  CHECK(big->plan.nvme_bytes() == 0);
}

// Device bytes per rank of `specs` in fp32 at `world` for stages 0-3, with the default config.
std::vector<int64_t> Fp32DeviceBytes(const std::vector<memory::ParamSpec>& specs, int world) {
  std::vector<int64_t> out;
  for (int stage = 0; stage <= 3; ++stage) {
    Config c;
    c.compute_dtype = DType::kF32;
    c.zero.stage = stage;
    absl::StatusOr<PlanChoice> choice = ChoosePlan(specs, c, world, 0);
    REQUIRE(choice.ok());
    out.push_back(choice->plan.device_bytes());
  }
  return out;
}

TEST_CASE("Planner: with default sizes one large unit does not erase stage 2-3 savings",
          "[zero]") {
  // GPT-2 124M in fp32 at world 2: stages 2 and 3 used to plan above stage 1 (1487 and 1550
  // MiB against 1424), every bucket and slot the size of the tied embedding's 39.4M-element
  // unit. One unit per block and a slot class of its own for the embedding put them below.
  auto gpt2 = ModelPreset("gpt2-124m");
  REQUIRE(gpt2.ok());
  const std::vector<int64_t> b = Fp32DeviceBytes(*gpt2, 2);
  CHECK(b[3] < b[2]);
  CHECK(b[2] < b[1]);
  CHECK(b[1] < b[0]);
  // Stage 2 exactly: the parameters, the shards of gradients and Adam's moments, and three
  // buckets (two of a block, one of the embeddings) instead of two of the embeddings.
  const int64_t P = 124439808, block = 12 * 768 * 768 + 13 * 768, embed = (50257 + 1024) * 768;
  CHECK(b[2] == 4 * P + 3 * 4 * (P / 2) + 4 * (2 * block + embed) + 4 * 2 * 15);

  // llm.c's CPU GPT-2 (L = 4, C = 128, vocabulary 50304, 64 positions), one module per layer:
  // 82.9 / 118.2 / 153.5 MiB for stages 1-3 before, now the embedding's gradient bucket is the
  // only slot of its size in stage 2 and adds one gather slot of its size in stage 3.
  const int64_t C = 128;
  absl::StatusOr<std::vector<memory::ParamSpec>> llmc =
      LoadModelFile("zero/testdata/llmc_gpt2_l4_c128.json");
  REQUIRE(llmc.ok());
  REQUIRE(llmc->size() == 2 + 4 * 12 + 2);
  const std::vector<int64_t> l = Fp32DeviceBytes(*llmc, 2);
  CHECK(l[2] < int64_t{96} << 20);   // 95.13 MiB (118.18 before)
  CHECK(l[3] < int64_t{108} << 20);  // 107.40 MiB (153.49 before)
  // The embedding's gradient alone is 24.6 MiB: at world 2, stage 2 cannot save that much.
  CHECK(l[2] - l[1] < 50304 * C * 4);

  // The same model as llm.c's trainer holds it: 16 tensors (stacked per layer), each a module,
  // their gradients declared in its one buffer. Stage 0-1 lose the full gradients, stages 2-3
  // the buckets (docs/embedding.md: 82.87 / 55.24 / 69.05 / 81.82 MiB, from 110.48 / 82.86 /
  // 95.62 / 108.38).
  absl::StatusOr<std::vector<memory::ParamSpec>> tensors =
      LoadModelFile("zero/testdata/llmc_gpt2_l4_c128_tensors.json");
  REQUIRE(tensors.ok());
  REQUIRE(tensors->size() == 16);
  std::vector<memory::ParamSpec> undeclared = *tensors;
  for (memory::ParamSpec& s : undeclared) s.grad_buffer.clear();
  const std::vector<int64_t> with = Fp32DeviceBytes(*tensors, 2);
  const std::vector<int64_t> without = Fp32DeviceBytes(undeclared, 2);
  const int64_t elements = 7240448;
  CHECK(without[0] - with[0] == (elements + 256 - 512) * 4);  // all but lnfw's and lnfb's units
  CHECK(without[1] - with[1] == (elements + 256 - 256 - 128) * 4);  // lnfb's unit, lnfw's shard
  CHECK(without[2] - with[2] == (6438912 + 2 * 262144 - 256) * 4);  // one bucket of lnfb's
  CHECK(without[3] - with[3] == without[2] - with[2]);
}

TEST_CASE("Planner: \"auto\" unit sizes follow the hidden size; explicit ones are kept", "[zero]") {
  // h is read off the largest parameter: GPT-2 1.5B's wte is (50257, 1600), Llama 2 7B's
  // embedding (32000, 4096), a lone vector of 10,000 elements has h = 100.
  const std::vector<std::pair<std::string, int64_t>> hidden = {
      {"gpt2-124m", 768}, {"gpt2-1.5b", 1600}, {"llama2-7b", 4096}, {"llama2-70b", 8192}};
  for (const auto& [name, h] : hidden) {
    INFO(name);
    auto specs = ModelPreset(name);
    REQUIRE(specs.ok());
    const UnitSizes sizes = ResolveUnitSizes(*specs, Config{});
    CHECK(sizes.hidden == h);
    CHECK(sizes.per_module);
    CHECK(sizes.reduce_bucket_size == sizes.largest_module);
    CHECK(sizes.prefetch_bucket_size == h * h * 9 / 10);
    CHECK(sizes.persistence_threshold == 10 * h);
    CHECK_THAT(sizes.reason, Catch::Contains("reduce_bucket_size = one unit per module (the "
                                             "largest " +
                                             std::to_string(sizes.largest_module) + " elements)"));
  }
  const std::vector<memory::ParamSpec> vector_only = {{"v", {10000}, "m"}};
  CHECK(ResolveUnitSizes(vector_only, Config{}).hidden == 100);
  // Units never split a module: h = 4, but module m1 holds 20 elements, wherever they were
  // registered.
  const std::vector<memory::ParamSpec> small = {
      {"a", {4, 4}, "m1"}, {"c", {2, 2}, "m2"}, {"b", {4}, "m1"}};
  CHECK(ResolveUnitSizes(small, Config{}).hidden == 4);
  CHECK(ResolveUnitSizes(small, Config{}).largest_module == 20);
  CHECK(ResolveUnitSizes(small, Config{}).reduce_bucket_size == 20);
  // GPT-2 1.5B's largest module is the embeddings (wte and wpe): (50257 + 1024) * 1600.
  auto xl = ModelPreset("gpt2-1.5b");
  REQUIRE(xl.ok());
  CHECK(ResolveUnitSizes(*xl, Config{}).reduce_bucket_size == (50257 + 1024) * 1600);

  Config c;
  c.zero.reduce_bucket_size = 123;
  c.zero.stage3_prefetch_bucket_size = 0;
  c.zero.stage3_param_persistence_threshold = 7;
  auto specs = ModelPreset("gpt2-1.5b");
  REQUIRE(specs.ok());
  const UnitSizes kept = ResolveUnitSizes(*specs, c);
  CHECK(kept.reduce_bucket_size == 123);
  CHECK(!kept.per_module);
  CHECK(kept.prefetch_bucket_size == 0);
  CHECK(kept.persistence_threshold == 7);
  CHECK(kept.reason.empty());
  // The plan uses the resolved sizes, and says so.
  c = Config{};
  c.zero.stage = 3;
  auto choice = ChoosePlan(*specs, c, 8, 0);
  REQUIRE(choice.ok());
  CHECK(choice->plan.options.unit_per_module);
  CHECK(choice->plan.units.size() == 48 + 2);  // one unit per block, ln_f, the embeddings
  CHECK(choice->plan.options.prefetch_elements == 2304000);
  CHECK(choice->plan.options.persistence_threshold == 16000);
  CHECK_THAT(choice->reason, Catch::Contains("hidden size h = 1600"));
}

TEST_CASE("Planner: with default sizes stage-3 bytes per rank fall with the world size", "[zero]") {
  // The ZeRO paper's Table 1: stage 3 divides all model states by the world size, so per-rank
  // bytes keep falling and end far below stage 2's, whose parameters stay whole. With the old
  // fixed 5e8-element units, GPT-2 1.5B on 64 ranks planned 4.0 GiB per rank at stage 3.
  auto specs = ModelPreset("gpt2-1.5b");
  REQUIRE(specs.ok());
  Config c;
  c.compute_dtype = DType::kBF16;
  int64_t previous = INT64_MAX;
  for (int world = 1; world <= 1024; world *= 2) {
    INFO("world " << world);
    c.zero.stage = 3;
    auto s3 = ChoosePlan(*specs, c, world, 0);
    c.zero.stage = 2;
    auto s2 = ChoosePlan(*specs, c, world, 0);
    REQUIRE(s3.ok());
    REQUIRE(s2.ok());
    const int64_t bytes = s3->plan.device_bytes();
    // Up to 512 ranks; at 1024 (planned: 734 MB against 725 MB at 512) the padding of every
    // unit to a multiple of world * 128 elements outweighs what one more halving still saves.
    if (world <= 512) CHECK(bytes < previous);
    previous = bytes;
    if (world >= 4) CHECK(bytes < s2->plan.device_bytes());
    // 1,557,611,200 parameters at 18 bytes (bf16 param + grad, fp32 master, m, v, per rank
    // share of each) plus at most a few units of buffers: under 1 GiB from 64 ranks on.
    if (world >= 64) CHECK(bytes < (int64_t{1} << 30));
  }
}

// A config in the style Hugging Face's Trainer writes: every value it knows at run time "auto".
constexpr char kHfAutoConfig[] = R"({
  "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
  "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                            "weight_decay": "auto"}},
  "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto",
      "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"}},
  "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
      "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"},
  "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
  "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"
})";

bool HasNote(const Config& c, const std::string& text) {
  return std::any_of(c.notes.begin(), c.notes.end(),
                     [&](const std::string& n) { return n.rfind(text, 0) == 0; });
}

TEST_CASE("ResolveAuto: the trainer's fill replaces every auto, each with a note", "[zero]") {
  absl::StatusOr<Config> parsed = ParseConfig(kHfAutoConfig);
  REQUIRE(parsed.ok());
  Config c = *parsed;
  // Not listed: batch sizes (not settings) and unit sizes (kAutoSize, the planner's default).
  CHECK(c.auto_keys.size() == 12);
  absl::StatusOr<AutoFill> fill = ParseAutoFill(R"({"hidden_size": 1024, "world_size": 8,
      "compute_dtype": "bf16", "lr": 3e-5, "beta1": 0.9, "beta2": 0.95, "eps": 1e-6,
      "weight_decay": 0.1, "gradient_clipping": 1.0, "warmup_num_steps": 100,
      "total_num_steps": 5000, "train_batch_size": 256, "train_micro_batch_size_per_gpu": 4})");
  REQUIRE(fill.ok());
  REQUIRE(ResolveAuto(*fill, {}, &c).ok());
  CHECK(c.auto_keys.empty());
  CHECK(c.compute_dtype == DType::kBF16);
  CHECK(c.optimizer.lr == 3e-5);
  CHECK(c.optimizer.beta2 == 0.95);
  CHECK(c.optimizer.eps == 1e-6);
  CHECK(c.optimizer.weight_decay == 0.1);
  CHECK(c.gradient_clipping == 1.0);
  CHECK(c.scheduler.warmup_min_lr == 0);
  CHECK(c.scheduler.warmup_max_lr == 3e-5);  // the optimizer's lr
  CHECK(c.scheduler.warmup_num_steps == 100);
  CHECK(c.scheduler.total_num_steps == 5000);
  CHECK(c.gradient_accumulation_steps == 8);  // 256 / (4 * 8)
  // Hugging Face's rule for the sizes that follow h = 1024; the units follow the modules.
  CHECK(c.zero.reduce_bucket_size == kAutoSize);
  CHECK(c.zero.stage3_prefetch_bucket_size == 943718);  // floor(0.9 * 1048576)
  CHECK(c.zero.stage3_param_persistence_threshold == 10240);
  CHECK(HasNote(c, "zero_optimization.reduce_bucket_size: auto -> one unit per module (the "
                   "largest 0 elements)"));
  CHECK(HasNote(c, "bf16.enabled: auto -> true (the trainer computes in bf16)"));
  CHECK(HasNote(c, "fp16.enabled: auto -> false (the trainer computes in bf16)"));
  CHECK(HasNote(c, "scheduler.params.warmup_max_lr: auto -> 3e-05 (optimizer.params.lr)"));
  CHECK(HasNote(c, "gradient_accumulation_steps: auto -> 8 (train_batch_size / "));
  CHECK(ValidateConfig(c).ok());
}

TEST_CASE("ResolveAuto: without a fill the documented rules apply, and gaps are all reported",
          "[zero]") {
  Config c = *ParseConfig(kHfAutoConfig);
  absl::Status s = ResolveAuto(AutoFill{}, {}, &c);
  INFO(s.ToString());
  // Only total_num_steps has no rule; every other auto took its documented fallback.
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(s.message() ==
        "scheduler.params.total_num_steps: \"auto\", but the trainer gave no total_num_steps; a "
        "decaying schedule needs it");
  CHECK(c.compute_dtype == DType::kF32);
  CHECK(c.optimizer.lr == 1e-3);
  CHECK(c.gradient_accumulation_steps == 1);
  CHECK(HasNote(c, "optimizer.params.lr: auto -> 0.001 (zerort's default"));
  CHECK(HasNote(c, "bf16.enabled: auto -> false (the trainer gave no compute dtype)"));
  // Without h or parameters the unit sizes stay for the planner.
  CHECK(c.zero.reduce_bucket_size == kAutoSize);

  // Batch sizes that disagree, and several problems in one error.
  Config d = *ParseConfig(R"({"train_batch_size": 100, "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 2, "scheduler": {"type": "WarmupCosineLR",
      "params": {"total_num_steps": "auto", "cos_min_ratio": "auto"}}})");
  auto gpt2 = ModelPreset("gpt2-124m");
  REQUIRE(gpt2.ok());
  AutoFill fill;
  fill.world_size = 8;
  s = ResolveAuto(fill, *gpt2, &d);
  INFO(s.ToString());
  CHECK(absl::StrContains(s.message(), "3 problems:\n"));
  CHECK(absl::StrContains(s.message(), "train_batch_size 100 != train_micro_batch_size_per_gpu 4 "
                                       "* gradient_accumulation_steps 2 * world size 8 = 64"));
  CHECK(absl::StrContains(s.message(), "scheduler.params.total_num_steps"));
  CHECK(absl::StrContains(s.message(), "scheduler.params.cos_min_ratio: \"auto\", and neither"));
  // Without the trainer's h the unit sizes stay for the planner, which reads h off the
  // parameters and says so in its reason.
  CHECK(d.zero.stage3_param_persistence_threshold == kAutoSize);

  // Sizes whose product passes 2^63 are compared exactly, never wrapped.
  Config big = *ParseConfig(R"({"train_batch_size": 9223372036854775807,
      "train_micro_batch_size_per_gpu": 4611686018427387904, "gradient_accumulation_steps": "auto"})");
  fill.hidden_size = int64_t{1} << 40;
  s = ResolveAuto(fill, {}, &big);
  CHECK(absl::StrContains(s.message(), "* world size 8 (more than 2^63-1)"));
  CHECK(absl::StrContains(s.message(), "hidden_size 1099511627776 from the trainer: expected"));
  CHECK(big.gradient_accumulation_steps == 1);

  CHECK(!ParseAutoFill(R"({"hiden_size": 4})").ok());
  CHECK(!ParseAutoFill(R"({"compute_dtype": "fp64"})").ok());
  CHECK(!ParseAutoFill(R"({"lr": "high"})").ok());
}

TEST_CASE("ResolveAuto: configs in the styles of published DeepSpeed users parse and resolve",
          "[zero]") {
  // Written for these tests in the manner of each project's templates (not copies).
  struct Case {
    const char* file;
    int64_t world;
    DType dtype;  // what the config ends up computing in
  };
  const Case cases[] = {
      {"hf_trainer_zero3.json", 8, DType::kBF16},
      {"accelerate_zero2.json", 8, DType::kF16},
      {"llama_factory_zero3_offload.json", 8, DType::kBF16},
      {"axolotl_zero1.json", 8, DType::kBF16},
      {"deepspeedexamples_bert_zero1.json", 64, DType::kF16},  // 4096 = 64 * 1 * 64
      {"megatron_deepspeed_bf16.json", 256, DType::kBF16},     // 512 = 2 * 1 * 256
      {"infinity_nvme_cosine.json", 4, DType::kBF16},
      {"openrlhf_zero3.json", 8, DType::kBF16},  // 128 = 1 * 16 * 8 (auto accumulation)
      {"deepspeed_full.json", 8, DType::kF16},                 // 512 = 4 * 16 * 8
  };
  auto llama = ModelPreset("llama2-7b");
  REQUIRE(llama.ok());
  for (const Case& c : cases) {
    INFO(c.file);
    absl::StatusOr<Config> config = LoadConfigFile(std::string("zero/testdata/") + c.file);
    INFO(config.status().ToString());
    REQUIRE(config.ok());
    AutoFill fill;
    fill.world_size = c.world;
    fill.compute_dtype = DType::kBF16;
    fill.lr = 2e-5;
    fill.total_num_steps = 1000;
    fill.warmup_num_steps = 30;
    fill.hidden_size = 4096;
    absl::Status s = ResolveAuto(fill, *llama, &*config);
    INFO(s.ToString());
    REQUIRE(s.ok());
    CHECK(config->auto_keys.empty());
    CHECK(config->compute_dtype == c.dtype);
    CHECK(config->zero.stage3_prefetch_bucket_size != kAutoSize);
    CHECK(ValidateConfig(*config).ok());
    absl::StatusOr<PlanChoice> plan = ChoosePlan(*llama, *config, static_cast<int>(c.world), 0);
    INFO(plan.status().ToString());
    CHECK(plan.ok());
  }
}

}  // namespace
}  // namespace zerort

// ---- The device budget: activations and reserves (docs/memory_budget.md).

namespace zerort {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;
constexpr int64_t kMiB = int64_t{1} << 20;

// Korthikanti et al. 2022, written here from the paper, not from the code under test: per layer
// sbh(34 + 5as/h) bytes with 16-bit activations (Table 2, "no recompute"), 34sbh with selective
// recompute, 2sbh with full recompute; section 4.3's embedding dropout mask sbh and output
// layer 4sbh + 4sbV (fp32 logits). What zerort adds to the paper, each stated in
// docs/memory_budget.md: the fp32 logits' gradient (4sbV), and the layer being recomputed in
// backward (its attention core 5as^2b for selective, the whole layer for full).
struct PaperCase {
  const char* preset;
  int64_t s, b, h, a, L, V;
};

int64_t PaperBytes(const PaperCase& c, Recompute r) {
  const int64_t s = c.s, b = c.b, h = c.h, a = c.a, L = c.L, V = c.V;
  const int64_t no_recompute_layer = s * b * h * 34 + 5 * a * s * s * b;  // sbh(34 + 5as/h)
  const int64_t embed_output = s * b * h + 4 * s * b * h + 4 * s * b * V;
  const int64_t logits_grad = 4 * s * b * V;
  switch (r) {
    case Recompute::kNone: return L * no_recompute_layer + embed_output + logits_grad;
    case Recompute::kSelective:
      return L * 34 * s * b * h + 5 * a * s * s * b + embed_output + logits_grad;
    case Recompute::kFull:
      return L * 2 * s * b * h + no_recompute_layer + embed_output + logits_grad;
  }
  return -1;
}

TEST_CASE("Activations: the formula is Korthikanti et al.'s closed form for GPT-2 and Llama 2",
          "[zero]") {
  const PaperCase cases[] = {
      {"gpt2-124m", 1024, 8, 768, 12, 12, 50257},
      {"gpt2-124m", 1024, 1, 768, 12, 12, 50257},
      {"llama2-7b", 4096, 1, 4096, 32, 32, 32000},
      {"llama2-7b", 2048, 4, 4096, 32, 32, 32000},
  };
  for (const PaperCase& c : cases) {
    auto shape = ModelPresetShape(c.preset);
    REQUIRE(shape.ok());
    CHECK(shape->layers == c.L);
    CHECK(shape->hidden == c.h);
    CHECK(shape->heads == c.a);
    CHECK(shape->vocab == c.V);
    for (Recompute r : {Recompute::kNone, Recompute::kSelective, Recompute::kFull}) {
      INFO(c.preset << " s=" << c.s << " b=" << c.b << " recompute " << RecomputeName(r));
      auto est = TransformerActivations(*shape, c.s, c.b, DType::kBF16, r);
      REQUIRE(est.ok());
      CHECK(est->bytes == PaperBytes(c, r));
      int64_t sum = 0;
      for (const ActivationLine& l : est->lines) sum += l.bytes;
      CHECK(sum == est->bytes);
    }
  }
  // One Llama 2 7B layer at s = 4096, b = 1 without recompute, by hand:
  // 4096 * 4096 * (34 + 5 * 32 * 4096 / 4096) = 16777216 * 194 = 3254779904 bytes (3.03 GiB).
  auto llama = ModelPresetShape("llama2-7b");
  REQUIRE(llama.ok());
  auto none = TransformerActivations(*llama, 4096, 1, DType::kBF16, Recompute::kNone);
  REQUIRE(none.ok());
  REQUIRE(none->lines[0].name == "layers");
  CHECK(none->lines[0].bytes == 32 * int64_t{3254779904});
  // Activations are linear in the micro-batch: every term has a factor b.
  auto four = TransformerActivations(*llama, 4096, 4, DType::kBF16, Recompute::kFull);
  auto one = TransformerActivations(*llama, 4096, 1, DType::kBF16, Recompute::kFull);
  REQUIRE(four.ok());
  REQUIRE(one.ok());
  CHECK(four->bytes == 4 * one->bytes);

  // Refusals name the field; long sequences are counted in 128 bits or refused, never wrapped.
  auto zero_seq = TransformerActivations(*llama, 0, 1, DType::kBF16, Recompute::kNone);
  CHECK(zero_seq.status().message() ==
        "activations: sequence length = 0 is out of range: expected 1..2^30");
  auto huge = TransformerActivations(*llama, int64_t{1} << 30, int64_t{1} << 30, DType::kBF16,
                                     Recompute::kNone);
  CHECK(huge.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(huge.status().message()), Catch::Contains("exceeds 2^63-1"));
  CHECK(ParseRecompute("partial").status().message() ==
        "recompute level 'partial': expected none, selective or full");
}

// The issue's example: llama2-7b on 8 ranks within 40 GiB per device.
Config LlamaExampleConfig() {
  Config c;
  c.compute_dtype = DType::kBF16;
  c.zero.stage_auto = true;
  c.zero.memory_budget.device_bytes = 40 * kGiB;
  return c;
}

Workload LlamaWorkload(Recompute r) {
  Workload w;
  w.seq = 4096;
  w.micro_batch = 1;
  w.shape = *ModelPresetShape("llama2-7b");
  w.recompute = r;
  return w;
}

TEST_CASE("Planner: counting activations moves llama2-7b at 40 GiB off stage 1, and says why",
          "[zero]") {
  auto specs = ModelPreset("llama2-7b");
  REQUIRE(specs.ok());
  const Config c = LlamaExampleConfig();
  // Model state alone: stage 1, as before, and the plan says what it did not count.
  auto old = ChoosePlan(*specs, c, 8, 0);
  REQUIRE(old.ok());
  CHECK(old->plan.options.stage == 1);
  CHECK_FALSE(old->budget.counted);
  CHECK(old->budget.total_bytes == old->plan.device_bytes());
  CHECK_THAT(old->budget.note, Catch::Contains("activations and runtime reserves were not counted"));
  CHECK_THAT(old->reason, !Catch::Contains("decided"));
  const int64_t stage1_model_state = old->plan.device_bytes();

  for (Recompute r : {Recompute::kFull, Recompute::kSelective}) {
    INFO("recompute " << RecomputeName(r));
    auto choice = ChoosePlan(*specs, c, 8, 0, LlamaWorkload(r));
    REQUIRE(choice.ok());
    const memory::PlanOptions& o = choice->plan.options;
    CHECK((o.stage > 1 || o.offload_optimizer));
    CHECK(choice->fits);
    // Selective: stage 1's model state and reserves fit, the activations do not. Full: stage 1
    // would fit without either its 5 GiB of activations or its 3 GiB of reserves.
    const std::string term = r == Recompute::kSelective ? "activations" : "activations and reserves";
    CHECK(choice->decided_by == term);
    CHECK_THAT(choice->reason, Catch::Contains("; " + term + " decided"));
    CHECK_THAT(choice->reason, Catch::Contains("stage 1 needs"));
    // Stage 1's model state fits alone; with selective recompute's 18 GiB of activations it does
    // not; with full recompute's 5 GiB it still would, until the reserves come on top.
    auto act = TransformerActivations(*LlamaWorkload(r).shape, 4096, 1, DType::kBF16, r);
    REQUIRE(act.ok());
    CHECK(stage1_model_state <= c.zero.memory_budget.device_bytes);
    CHECK((stage1_model_state + act->bytes > c.zero.memory_budget.device_bytes) ==
          (r == Recompute::kSelective));
    // The chosen plan's lines add up, and its total is within the budget.
    const DeviceBudget& d = choice->budget;
    REQUIRE(d.counted);
    CHECK(d.activation_bytes == act->bytes);
    CHECK(d.total_bytes == d.model_state_bytes + d.activation_bytes + d.reserve_bytes);
    CHECK(d.total_bytes <= c.zero.memory_budget.device_bytes);
  }
  // Without recomputation a layer alone is 3 GiB at this length: 32 of them fit nowhere.
  auto none = ChoosePlan(*specs, c, 8, 0, LlamaWorkload(Recompute::kNone));
  CHECK(none.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK_THAT(std::string(none.status().message()),
             Catch::Contains("activations and reserves do not shrink with the world size"));
}

TEST_CASE("Planner: reserves have their documented defaults, follow the config, refuse negatives",
          "[zero]") {
  auto specs = SyntheticModel(1000000, 4);
  REQUIRE(specs.ok());
  auto plan = memory::MakePlan(*specs, memory::PlanOptions{});
  REQUIRE(plan.ok());
  // Declared activations count without a transformer shape.
  std::vector<memory::ParamSpec> declared = *specs;
  declared[1].activation_bytes_per_sample = 3 * kMiB;
  declared[3].activation_bytes_per_sample = 5 * kMiB;
  memory::PlanOptions o;
  o.world_size = 8;
  auto plan8 = memory::MakePlan(declared, o);
  REQUIRE(plan8.ok());
  Config defaults;
  Workload w;
  w.micro_batch = 2;
  auto d = MakeDeviceBudget(*plan8, defaults, w);
  REQUIRE(d.ok());
  REQUIRE(d->counted);
  CHECK(d->activation_bytes == 2 * 8 * kMiB);
  auto line = [](const DeviceBudget& b, const std::string& name) {
    for (const BudgetLine& l : b.reserves) {
      if (l.name == name) return l.bytes;
    }
    FAIL("no reserve line " << name);
    return int64_t{-1};
  };
  // The measured defaults (docs/memory_budget.md): 527 MiB context, 580 + 32 MiB communicator,
  // 32 channels * 2 ring neighbours * 4 MiB, 32 MiB cuBLAS, 5% of the allocations.
  CHECK(line(*d, "cuda context") == 527 * kMiB);
  CHECK(line(*d, "nccl communicator") == 612 * kMiB);
  CHECK(line(*d, "nccl buffers") == 32 * 2 * 4 * kMiB);
  CHECK(line(*d, "cublas workspace") == 32 * kMiB);
  const int64_t allocated = plan8->device_bytes() + 16 * kMiB;
  CHECK(line(*d, "fragmentation") == (allocated + 19) / 20);  // ceil(5%)
  CHECK(d->total_bytes == allocated + d->reserve_bytes);
  // One rank: no communicator.
  auto plan1 = memory::MakePlan(declared, memory::PlanOptions{});
  REQUIRE(plan1.ok());
  auto d1 = MakeDeviceBudget(*plan1, defaults, w);
  REQUIRE(d1.ok());
  CHECK(line(*d1, "nccl communicator") == 0);
  CHECK(line(*d1, "nccl buffers") == 0);
  // One rank that made an NCCL communicator anyway (the engine says so): its bytes count, with
  // no peers to buffer for; and eight ranks told they have none count none.
  Workload one_nccl = w;
  one_nccl.nccl_communicator = true;
  auto d1n = MakeDeviceBudget(*plan1, defaults, one_nccl);
  REQUIRE(d1n.ok());
  CHECK(line(*d1n, "nccl communicator") == 612 * kMiB);
  CHECK(line(*d1n, "nccl buffers") == 0);
  CHECK(d1n->total_bytes == d1->total_bytes + 612 * kMiB);
  Workload eight_none = w;
  eight_none.nccl_communicator = false;
  auto d8n = MakeDeviceBudget(*plan8, defaults, eight_none);
  REQUIRE(d8n.ok());
  CHECK(line(*d8n, "nccl communicator") == 0);
  CHECK(line(*d8n, "nccl buffers") == 0);

  auto parsed = ParseConfig(R"({"zerort": {"reserves": {"cuda_context_bytes": 1000,
      "nccl_communicator_bytes": 2000, "nccl_buffsize": 10, "nccl_channels": 3,
      "cublas_workspace_bytes": 0, "fragmentation_fraction": 0}}})");
  REQUIRE(parsed.ok());
  auto custom = MakeDeviceBudget(*plan8, *parsed, w);
  REQUIRE(custom.ok());
  CHECK(line(*custom, "cuda context") == 1000);
  CHECK(line(*custom, "nccl communicator") == 2000);
  CHECK(line(*custom, "nccl buffers") == 3 * 2 * 10);
  CHECK(line(*custom, "cublas workspace") == 0);
  CHECK(line(*custom, "fragmentation") == 0);
  CHECK(custom->reserve_bytes == 1000 + 2000 + 60);

  for (const char* key : {"cuda_context_bytes", "nccl_communicator_bytes", "nccl_buffsize",
                          "nccl_channels", "cublas_workspace_bytes", "fragmentation_fraction"}) {
    INFO(key);
    auto bad = ParseConfig(absl::StrCat(R"({"zerort": {"reserves": {")", key, R"(": -1}}})"),
                           "cfg.json");
    REQUIRE(bad.status().code() == absl::StatusCode::kInvalidArgument);
    const std::string message(bad.status().message());
    CHECK_THAT(message, Catch::Contains(absl::StrCat("zerort.reserves.", key)));
    CHECK_THAT(message, Catch::Contains("-1"));
    CHECK_THAT(message, Catch::Contains(">= 0"));
  }

  // Declared activations and a shape for the formula together are refused.
  Workload both = w;
  both.seq = 128;
  both.shape = *ModelPresetShape("gpt2-124m");
  CHECK(MakeDeviceBudget(*plan8, defaults, both).status().code() ==
        absl::StatusCode::kInvalidArgument);
}

// The largest micro-batch by walking up from 1: the reference FitMicroBatch's search must equal.
int64_t BruteForceMicroBatch(const memory::Plan& plan, const Config& c, Workload w) {
  int64_t b = 0;
  for (;;) {
    w.micro_batch = b + 1;
    auto d = MakeDeviceBudget(plan, c, w);
    REQUIRE(d.ok());
    if (d->total_bytes > c.zero.memory_budget.device_bytes) return b;
    ++b;
  }
}

TEST_CASE("Planner: --fit's micro-batch equals a brute-force search and grows with the budget",
          "[zero]") {
  struct Case {
    const char* preset;
    int64_t seq;
    int world;
    Recompute r;
  };
  for (const Case& k : {Case{"gpt2-124m", 1024, 4, Recompute::kNone},
                        Case{"llama2-7b", 4096, 8, Recompute::kFull}}) {
    INFO(k.preset);
    auto specs = ModelPreset(k.preset);
    REQUIRE(specs.ok());
    Workload w;
    w.seq = k.seq;
    w.shape = *ModelPresetShape(k.preset);
    w.recompute = k.r;
    std::vector<int64_t> previous;
    for (int64_t budget_gib : {24, 40, 80}) {
      INFO("budget " << budget_gib << " GiB");
      Config c = LlamaExampleConfig();
      c.zero.memory_budget.device_bytes = budget_gib * kGiB;
      auto fits = FitMicroBatch(*specs, c, k.world, 0, w);
      REQUIRE(fits.ok());
      REQUIRE(fits->size() == 8);  // stages 0-3, optimizer offload at 1-3, both offloads at 3
      bool any = false;
      for (size_t i = 0; i < fits->size(); ++i) {
        const MicroBatchFit& f = (*fits)[i];
        INFO(f.description);
        auto plan = memory::MakePlan(*specs, f.options);
        REQUIRE(plan.ok());
        CHECK(f.micro_batch == BruteForceMicroBatch(*plan, c, w));
        CHECK((f.micro_batch == 0) == !f.why_none.empty());
        if (f.micro_batch > 0) {
          any = true;
          CHECK(f.budget.micro_batch == f.micro_batch);
          CHECK(f.budget.total_bytes <= c.zero.memory_budget.device_bytes);
        }
        if (!previous.empty()) CHECK(f.micro_batch >= previous[i]);  // more budget, never less
      }
      CHECK(any);
      previous.clear();
      for (const MicroBatchFit& f : *fits) previous.push_back(f.micro_batch);
    }
  }
  // Without activations there is nothing to fit.
  auto specs = ModelPreset("gpt2-124m");
  REQUIRE(specs.ok());
  auto none = FitMicroBatch(*specs, LlamaExampleConfig(), 1, 0, Workload{});
  CHECK(none.status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("Models: a model file's activation_bytes_per_sample reaches the plan", "[zero]") {
  auto specs = ParseModelJson(R"({"modules": [
      {"name": "a", "activation_bytes_per_sample": 1000,
       "params": [{"name": "w", "shape": [4, 4]}, {"name": "b", "shape": [4]}]},
      {"name": "c", "params": [{"name": "w", "shape": [8]}]}]})",
                              "m.json");
  REQUIRE(specs.ok());
  auto plan = memory::MakePlan(*specs, memory::PlanOptions{});
  REQUIRE(plan.ok());
  CHECK(plan->activation_bytes_per_sample == 1000);
  auto bad = ParseModelJson(R"({"modules": [{"name": "a", "activation_bytes_per_sample": -5,
      "params": [{"name": "w", "shape": [4]}]}]})",
                            "m.json");
  REQUIRE(bad.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(bad.status().message()),
             Catch::Contains("modules[0].activation_bytes_per_sample"));
}

}  // namespace
}  // namespace zerort

namespace zerort {
namespace {

TEST_CASE("ResolveAuto: a plan notes the scheduler's unfillable autos and goes on; an engine "
          "refuses them with the same words",
          "[zero]") {
  const std::string message =
      "scheduler.params.total_num_steps: \"auto\", but the trainer gave no total_num_steps; a "
      "decaying schedule needs it";
  Config for_engine = *ParseConfig(kHfAutoConfig);
  absl::Status refused = ResolveAuto(AutoFill{}, {}, &for_engine);
  CHECK(refused.message() == message);

  Config for_plan = *ParseConfig(kHfAutoConfig);
  auto gpt2 = ModelPreset("gpt2-124m");
  REQUIRE(gpt2.ok());
  absl::Status planned = ResolveAuto(AutoFill{}, *gpt2, &for_plan, AutoPurpose::kPlan);
  INFO(planned.ToString());
  REQUIRE(planned.ok());
  CHECK(HasNote(for_plan, message + " (not needed for a plan; Engine creation refuses it)"));
  // Still "auto" in what the plan shows, and the plan itself is made.
  CHECK(std::count(for_plan.auto_keys.begin(), for_plan.auto_keys.end(),
                   "scheduler.params.total_num_steps") == 1);
  CHECK_THAT(ResolvedConfigJson(for_plan), Catch::Contains("\"total_num_steps\": \"auto\""));
  absl::StatusOr<PlanChoice> choice = ChoosePlan(*gpt2, for_plan, 8, 0);
  REQUIRE(choice.ok());
  // What changes the plan is still an error for a plan: batch sizes that disagree.
  Config bad = *ParseConfig(R"({"train_batch_size": 100, "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 2})");
  AutoFill world;
  world.world_size = 8;
  CHECK_FALSE(ResolveAuto(world, *gpt2, &bad, AutoPurpose::kPlan).ok());
}

TEST_CASE("ResolveAuto: a written warmup_max_lr is the schedule's peak, not the optimizer's lr",
          "[zero]") {
  for (const char* type : {"WarmupLR", "WarmupDecayLR"}) {
    INFO(type);
    Config c = *ParseConfig(absl::StrCat(
        R"({"optimizer": {"params": {"lr": 0.001}}, "scheduler": {"type": ")", type,
        R"(", "params": {"warmup_max_lr": 0.02)",
        absl::string_view(type) == "WarmupDecayLR" ? R"(, "total_num_steps": 100)" : "",
        "}}}"));
    REQUIRE(ResolveAuto(AutoFill{}, {}, &c).ok());
    CHECK(c.scheduler.warmup_max_lr == 0.02);
    CHECK_THAT(ResolvedConfigJson(c), Catch::Contains("\"warmup_max_lr\": 0.02"));
  }
}

TEST_CASE("Planner: zeros DeepSpeed accepts plan the least that runs", "[zero]") {
  // Four parameters in two modules; reduce_bucket_size 0 asks DeepSpeed to reduce each
  // gradient on its own: one unit per parameter here.
  const std::vector<memory::ParamSpec> specs = {
      {"a", {64, 64}, "m1"}, {"b", {64}, "m1"}, {"c", {64, 64}, "m2"}, {"d", {64}, "m2"}};
  Config c = *ParseConfig(R"({"zero_optimization": {"stage": 3, "reduce_bucket_size": 0,
      "stage3_max_live_parameters": 0, "stage3_prefetch_bucket_size": 0,
      "offload_optimizer": {"device": "cpu", "buffer_count": 0}}})");
  absl::StatusOr<memory::PlanOptions> options = PlanOptionsFromConfig(specs, c, 2, 0);
  REQUIRE(options.ok());
  CHECK(options->offload_buffer_count == 1);
  CHECK(options->max_live_elements == 1);
  absl::StatusOr<PlanChoice> choice = ChoosePlan(specs, c, 2, 0);
  INFO(choice.status().ToString());
  REQUIRE(choice.ok());
  CHECK(choice->plan.units.size() == specs.size());
  CHECK(choice->plan.gather_slots == 1);
}

TEST_CASE("FillRanksPerNode: the launcher's ranks per node when they form consecutive blocks",
          "[zero]") {
  using Env = std::map<std::string, std::string>;
  // Parsed by comm/launch_env.h from a fake environment, as the engine reads the real one.
  auto fill = [](const Env& env, int world, int rank, int written = 0) {
    Config c;
    c.ranks_per_node = written;
    FillRanksPerNode(comm::LaunchInfoFromEnv([&](const char* name) -> const char* {
                       auto it = env.find(name);
                       return it == env.end() ? nullptr : it->second.c_str();
                     }),
                     world, rank, &c);
    return c;
  };
  const Env torchrun = {{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"},
                        {"LOCAL_WORLD_SIZE", "4"}, {"MASTER_ADDR", "n0"}, {"MASTER_PORT", "1"}};
  Config c = fill(torchrun, 8, 5);
  CHECK(c.ranks_per_node == 4);
  REQUIRE(c.notes.size() == 1);
  CHECK(c.notes[0] == "zerort.ranks_per_node: 0 -> 4 (torchrun: ranks on this node)");
  const Env openmpi = {{"OMPI_COMM_WORLD_RANK", "6"}, {"OMPI_COMM_WORLD_SIZE", "8"},
                       {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}};
  CHECK(fill(openmpi, 8, 6).ranks_per_node == 2);
  const Env srun = {{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "3"},
                    {"SLURM_NODEID", "0"}, {"SLURM_NTASKS_PER_NODE", "4"}};
  CHECK(fill(srun, 8, 3).ranks_per_node == 4);
  // Written in the config: kept, whatever the launcher says.
  c = fill(torchrun, 8, 5, /*written=*/2);
  CHECK(c.ranks_per_node == 2);
  CHECK(c.notes.empty());
  // No launcher: not known, silently (a single process).
  c = fill({}, 8, 5);
  CHECK(c.ranks_per_node == 0);
  CHECK(c.notes.empty());
  struct Refused {
    const char* why;
    Env env;
    int world, rank;
    const char* says;
  };
  Env round_robin = openmpi;  // mpirun --map-by node: rank 6 is local rank 3 of 4
  round_robin["OMPI_COMM_WORLD_LOCAL_RANK"] = "3";
  round_robin["OMPI_COMM_WORLD_LOCAL_SIZE"] = "4";
  Env uneven = torchrun;
  uneven["LOCAL_WORLD_SIZE"] = "3";
  Env no_size = torchrun;
  no_size.erase("LOCAL_WORLD_SIZE");
  const Refused refused[] = {
      {"in-process ranks under one launcher process", torchrun, 8, 2, "this engine is rank 2"},
      {"another world", torchrun, 4, 5, "rank 5 of 8"},
      {"round-robin placement", round_robin, 8, 6, "not in consecutive blocks"},
      {"a local size that does not divide the world", uneven, 8, 5, "do not divide"},
      {"no local size", no_size, 8, 5, "does not say"},
      {"a malformed variable", {{"RANK", "x"}, {"WORLD_SIZE", "8"}}, 8, 5, "do not parse"},
  };
  for (const Refused& r : refused) {
    INFO(r.why);
    c = fill(r.env, r.world, r.rank);
    CHECK(c.ranks_per_node == 0);
    REQUIRE(c.notes.size() == 1);
    INFO(c.notes[0]);
    CHECK(absl::StrContains(c.notes[0], "zerort.ranks_per_node: left unknown"));
    CHECK(absl::StrContains(c.notes[0], r.says));
  }
}

}  // namespace
}  // namespace zerort
