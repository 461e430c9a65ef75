#include "cli/cli.h"

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include <catch2/catch.hpp>

#include "nlohmann/json.hpp"

namespace zerort {
namespace {

TEST_CASE("CLI: zerort plan prints the plan as JSON with the documented fields", "[zero]") {
  std::ostringstream out;
  auto status = RunPlanCommand(
      {"--model", "llama2-7b", "--world", "8", "--stage", "3", "--offload", "optimizer", "--json"},
      out);
  REQUIRE(status.ok());
  auto j = nlohmann::json::parse(out.str());
  CHECK(j["params"] == 6738415616LL);
  CHECK(j["world_size"] == 8);
  CHECK(j["stage"] == 3);
  CHECK(j["per_rank"]["pinned_host_bytes"].get<int64_t>() > 0);
  CHECK(j["per_rank"]["model_state_bytes"].get<int64_t>() > 0);
  CHECK(j["comm_bytes_per_step"].get<int64_t>() > 0);
  CHECK(j["buffers"].size() >= 5);

  std::ostringstream err;
  auto unknown = RunPlanCommand({"--model", "gpt2-124m", "--wrld", "8"}, err);
  REQUIRE_FALSE(unknown.ok());
  CHECK_THAT(std::string(unknown.message()), Catch::Contains("--wrld"));
  auto bad_stage = RunPlanCommand({"--params", "1000", "--stage", "5"}, err);
  REQUIRE_FALSE(bad_stage.ok());
  CHECK_THAT(std::string(bad_stage.message()), Catch::Contains("--stage '5'"));
}

TEST_CASE("CLI: zerort plan prints the config's notes, as text and as a JSON array", "[zero]") {
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(dir != nullptr ? dir : "/tmp") + "/notes.json";
  std::ofstream(path) << R"({"zero_optimization": {"stage": 2, "overlap_comm": false,
      "allgather_bucket_size": 2e8}, "train_batch_size": 32})";

  std::ostringstream text;
  REQUIRE(RunPlanCommand({"--model", "gpt2-124m", "--world", "2", "--config", path}, text).ok());
  CHECK_THAT(text.str(), Catch::Contains("note: zero_optimization.overlap_comm: false has no "
                                         "effect, overlap cannot be turned off: "));
  CHECK_THAT(text.str(), Catch::Contains("note: zero_optimization.allgather_bucket_size: "
                                         "accepted, no effect: "));
  CHECK_THAT(text.str(), Catch::Contains("note: train_batch_size: "));

  std::ostringstream json;
  REQUIRE(RunPlanCommand({"--model", "gpt2-124m", "--world", "2", "--config", path, "--json"},
                         json)
              .ok());
  auto j = nlohmann::json::parse(json.str());
  REQUIRE(j["notes"].size() == 3);
  CHECK_THAT(j["notes"][1].get<std::string>(),
             Catch::StartsWith("zero_optimization.overlap_comm: false has no effect"));

  // Without a config there is nothing to note; the array is still there.
  std::ostringstream plain;
  REQUIRE(RunPlanCommand({"--params", "1000", "--json"}, plain).ok());
  CHECK(nlohmann::json::parse(plain.str())["notes"] == nlohmann::json::array());
}

}  // namespace
}  // namespace zerort
