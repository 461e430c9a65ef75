#include "zero/planner.h"

#include <sstream>
#include <utility>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "zero/model_spec.h"

namespace zerort {
namespace {

int64_t Count(const std::vector<memory::ParamSpec>& specs) {
  int64_t n = 0;
  for (const auto& s : specs) {
    int64_t e = 1;
    for (int64_t d : s.shape) e *= d;
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
            "m.json: modules[0].params[0].dtype: unknown key (expected name, shape)"},
           {R"({"modules": [{"name": "l", "params": [{"name": "w", "shap": [3]}]}]})",
            "m.json: modules[0].params[0].shap: unknown key; did you mean \"shape\"?"},
           {R"({"modules": [{"name": "l", "parms": []}]})",
            "m.json: modules[0].parms: unknown key; did you mean \"params\"?"}}) {
    auto refused = ParseModelJson(text, "m.json");
    REQUIRE_FALSE(refused.ok());
    CHECK(refused.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(refused.status().message()) == message);
  }
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

TEST_CASE("Planner: auto picks the lowest stage that fits, at the byte boundary", "[zero]") {
  auto specs = SyntheticModel(10000000, 10);
  REQUIRE(specs.ok());
  const int world = 8;
  // The device bytes each explicit stage needs, computed through the explicit path.
  int64_t need[4];
  for (int stage = 0; stage < 4; ++stage) {
    Config c = AutoConfig(0);
    c.zero.stage_auto = false;
    c.zero.stage = stage;
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
  auto bigger_world = ChoosePlan(*specs, AutoConfig(12 << 20), 2, 0);
  REQUIRE_FALSE(bigger_world.ok());
  CHECK_THAT(std::string(bigger_world.status().message()), Catch::Contains("it would fit on"));
}

}  // namespace
}  // namespace zerort
