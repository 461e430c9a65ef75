#include "examples/gpt/testing/stage_runs.h"

#include <string>

#include "catch2/catch.hpp"

namespace zerort {
namespace examples {
namespace gpt {
namespace testing {

void CheckStagesMatchStageZero(const StageConfig& config_of, const RunOptions& options,
                               const std::vector<bool>& offloads) {
  REQUIRE(options.world_size >= 2);
  REQUIRE(options.gather_master);
  absl::StatusOr<RunResult> reference = RunInProcess(config_of(0, false), options);
  INFO(reference.status().message());
  REQUIRE(reference.ok());
  std::string units;
  for (const memory::Unit& u : reference->plan.units) units += u.name + " ";
  INFO("units " << units);
  CHECK(reference->plan.units.size() >= 6u);
  for (size_t r = 1; r < reference->master.size(); ++r) {
    CHECK(reference->master[r] == reference->master[0]);
  }
  for (int stage = 1; stage <= 3; ++stage) {
    for (bool offload : offloads) {
      INFO("stage " << stage << " offload " << offload);
      absl::StatusOr<RunResult> run = RunInProcess(config_of(stage, offload), options);
      INFO(run.status().message());
      REQUIRE(run.ok());
      CHECK(run->final_val_loss == reference->final_val_loss);
      for (const std::vector<float>& master : run->master) {
        CHECK(master == reference->master[0]);
      }
    }
  }
}

}  // namespace testing
}  // namespace gpt
}  // namespace examples
}  // namespace zerort
