#include "cli/cli.h"

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

}  // namespace
}  // namespace zerort
