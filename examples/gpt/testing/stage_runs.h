// The GPT's stage-equivalence check, shared by the CPU backend's test (gpt_test) and the CUDA
// backend's (gpt_cuda_test): training at stages 1-3 must end exactly where stage 0 does.
//
//   CheckStagesMatchStageZero(
//       [](int stage, bool offload) { return TestConfig(stage, offload, DType::kBF16); },
//       TinyRun(3), {false, true});
//
// Call it inside a Catch2 test case: it reports through CHECK/REQUIRE.
#ifndef ZERORT_EXAMPLES_GPT_TESTING_STAGE_RUNS_H_
#define ZERORT_EXAMPLES_GPT_TESTING_STAGE_RUNS_H_

#include <functional>
#include <vector>

#include "examples/gpt/gpt.h"
#include "zero/config.h"

namespace zerort {
namespace examples {
namespace gpt {
namespace testing {

// The config of one run: `stage` 0-3, with the optimizer offloaded or not.
using StageConfig = std::function<Config(int stage, bool offload)>;

// Trains `options` (world_size >= 2, gather_master set) with config_of(0, false) as the
// reference, then with config_of(stage, offload) for stages 1-3 and each value in `offloads`.
// Checks that the reference splits the model into at least 6 units (so stage 3 really gathers
// per block) and ends with the same masters on every rank, and that every other run ends with
// the reference's held-out loss and the reference's fp32 masters on every rank, bit for bit.
void CheckStagesMatchStageZero(const StageConfig& config_of, const RunOptions& options,
                               const std::vector<bool>& offloads);

}  // namespace testing
}  // namespace gpt
}  // namespace examples
}  // namespace zerort

#endif  // ZERORT_EXAMPLES_GPT_TESTING_STAGE_RUNS_H_
