// Checkpoints of engines with frozen parameters: a frozen parameter has no master, m or v, so
// the checkpoint stores its weights as the master (its parameters widened to fp32, exact) with
// m = v = 0. Resuming gives what an uninterrupted run gives, and loading into an engine that
// trains the formerly frozen parameters (unfreezing by re-creation) starts from those weights.
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "base/status.h"
#include "base/testing/checks.h"
#include "base/testing/temp_dir.h"
#include "checkpoint/checkpoint.h"
#include "comm/testing/on_ranks.h"
#include "device/cpu_device.h"
#include "zero/engine.h"
#include "zero/testing/synthetic_trainer.h"

namespace zerort {
namespace {

using memory::ParamSpec;
using testing::BitEqual;

std::vector<ParamSpec> LoraModel(bool frozen) {
  std::vector<ParamSpec> s = {{"embed.w", {37, 5}, "embed"}, {"l0.w", {13, 11}, "l0"},
                              {"l0.lora_a", {2, 11}, "l0"},  {"l0.lora_b", {13, 2}, "l0"},
                              {"l1.w", {64, 9}, "l1"},       {"l1.b", {9}, "l1"}};
  for (ParamSpec& p : s) p.frozen = frozen && (p.name == "embed.w" || absl::EndsWith(p.name, ".w"));
  return s;
}

// On 2 ranks: 3 steps, a save, 3 more steps (the uninterrupted run); then a fresh engine
// (frozen as `resume_frozen`) loads the save and trains the same 3 steps. Returns rank 0's
// masters after the save and at the end of both runs.
struct Runs {
  std::vector<float> saved, uninterrupted, resumed;
};

absl::StatusOr<Runs> SaveAndResume(int stage, bool resume_frozen, int resume_stage) {
  const std::string root = testing::TempDir("frozen_ckpt");
  auto device = CreateCpuDevice();
  std::vector<Runs> runs(2);
  const std::vector<absl::Status> st = comm::testing::OnRanks(
      2, {20000}, [&](int r, comm::Communicator* comm) -> absl::Status {
        Config c = testing::TestConfig(stage, DType::kBF16, 2, 0.05, false);
        ASSIGN_OR_RETURN(auto engine, Engine::Create(c, LoraModel(true), comm, device.get()));
        RETURN_IF_ERROR(testing::SetInitValues(*engine));
        RETURN_IF_ERROR(testing::TrainSteps(*engine, 0, 3));
        RETURN_IF_ERROR(SaveCheckpoint(*engine, root).status());
        ASSIGN_OR_RETURN(runs[r].saved, engine->GatherMasterWeights());
        RETURN_IF_ERROR(testing::TrainSteps(*engine, 3, 3));
        ASSIGN_OR_RETURN(runs[r].uninterrupted, engine->GatherMasterWeights());
        engine.reset();
        Config c2 = testing::TestConfig(resume_stage, DType::kBF16, 2, 0.05, false);
        ASSIGN_OR_RETURN(auto fresh,
                         Engine::Create(c2, LoraModel(resume_frozen), comm, device.get()));
        RETURN_IF_ERROR(testing::SetInitValues(*fresh, 0.25f));  // overwritten by the load
        RETURN_IF_ERROR(LoadCheckpoint(*fresh, root));
        std::vector<float> loaded;
        ASSIGN_OR_RETURN(loaded, fresh->GatherMasterWeights());
        if (!BitEqual(loaded, runs[r].saved)) {
          return absl::InternalError("the loaded masters differ from the saved ones");
        }
        RETURN_IF_ERROR(testing::TrainSteps(*fresh, 3, 3));
        ASSIGN_OR_RETURN(runs[r].resumed, fresh->GatherMasterWeights());
        return absl::OkStatus();
      });
  for (const absl::Status& s : st) RETURN_IF_ERROR(s);
  return runs[0];
}

TEST_CASE("Checkpoint: frozen parameters save, load and resume bitwise", "[checkpoint]") {
  for (int stage = 0; stage <= 3; ++stage) {
    INFO("stage " << stage);
    absl::StatusOr<Runs> runs = SaveAndResume(stage, /*resume_frozen=*/true, stage);
    INFO(runs.status().ToString());
    REQUIRE(runs.ok());
    CHECK(BitEqual(runs->resumed, runs->uninterrupted));
  }
}

TEST_CASE("Checkpoint: loading into an engine without the frozen set unfreezes from the saved "
          "weights", "[checkpoint]") {
  absl::StatusOr<Runs> runs = SaveAndResume(2, /*resume_frozen=*/false, 3);
  INFO(runs.status().ToString());
  REQUIRE(runs.ok());
  // Trained from the same weights, the formerly frozen parameters now move.
  const std::vector<ParamSpec> specs = LoraModel(true);
  size_t j = 0;
  bool moved = false, kept = true;
  for (const ParamSpec& p : specs) {
    for (int64_t k = 0; k < p.numel(); ++k, ++j) {
      if (!p.frozen) continue;
      moved = moved || runs->resumed[j] != runs->saved[j];
      kept = kept && runs->uninterrupted[j] == runs->saved[j];
    }
  }
  CHECK(moved);
  CHECK(kept);
}

}  // namespace
}  // namespace zerort
