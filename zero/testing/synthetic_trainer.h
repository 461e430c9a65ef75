// A synthetic trainer for engine tests: a fixed small model, deterministic initial values and
// per-(rank, step, micro-step) random gradients, driven through the engine exactly as a trainer
// would (stage-3 Gather/Release around forward and backward, gradients written in backward
// order). The values depend only on (rank, step, micro, parameter, element), never on the stage
// or the backend, so runs can be compared bit for bit.
#ifndef ZERORT_ZERO_TESTING_SYNTHETIC_TRAINER_H_
#define ZERORT_ZERO_TESTING_SYNTHETIC_TRAINER_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "memory/plan.h"
#include "zero/config.h"
#include "device/device.h"
#include "zero/engine.h"

namespace zerort {
namespace testing {

// Seven parameters with awkward shapes: odd sizes, a one-element bias, a 3-d tensor.
std::vector<memory::ParamSpec> SmallModel();

// Deterministic values in [-1, 1).
float InitValue(int param, int64_t element);
float GradValue(int rank, int step, int micro, int param, int64_t element);

// Sets every parameter element k of parameter i to InitValue(i, k) + offset.
absl::Status SetInitValues(Engine& engine, float offset = 0);

// SmallModel()'s initial values flattened in registration order, with each element's
// (parameter, element index): where the tests' serial AdamW references start.
struct FlatInit {
  std::vector<double> w;
  std::vector<std::pair<int, int64_t>> at;
};
FlatInit SmallModelFlatInit();

// The paper's AdamW in double with no sharding, the tests' independent reference: parameters
// of `specs` start at InitValue, the gradient is the mean over `world` ranks and `gas`
// micro-steps of GradValue, clipped to global norm `clip` (0: none) over the trainable
// parameters; frozen parameters keep their values. Flattened in registration order.
std::vector<double> SerialAdamW(const std::vector<memory::ParamSpec>& specs, int world,
                                int steps, int gas, double clip, const OptimizerConfig& o);

// A config for tests: several units (reduce_bucket_size 200), small persistent units, lr 1e-2,
// weight decay 0.1, one host thread.
Config TestConfig(int stage, DType precision, int gas, double clip, bool offload);

struct TrainResult {
  std::vector<float> master;      // GatherMasterWeights() at the end
  std::vector<char> params;       // compute-dtype parameters at the end, in unit order
  std::vector<StepStats> stats;   // one per optimizer-step boundary
  MemoryReport report;
};

// One micro-step's forward gathers and backward (gathering frozen units too, writing no
// gradient for frozen parameters): writes (rank, step, micro)'s gradients times
// `factor` (an Inf in the first element of each parameter with `overflow`) and marks them
// ready, without Step(). The copies read `host` (appended to) on the compute stream: keep it
// until the stream is synchronized.
absl::Status Backward(Engine& engine, int step, int micro, std::vector<std::vector<char>>* host,
                      float factor = 1, bool overflow = false);

// Optimizer steps [first, first + steps) on an engine whose parameters are set. Gradients depend
// on the global step index, so a resumed run sees exactly what an uninterrupted one does. At each
// step in `overflow_steps`, rank `overflow_rank` writes an Inf into its first gradient element.
// Boundary stats are appended to `stats` when it is not null.
absl::Status TrainSteps(Engine& engine, int first, int steps,
                        const std::vector<int>& overflow_steps = {}, int overflow_rank = 0,
                        std::vector<StepStats>* stats = nullptr);

// Creates an engine on `compute_stream`, sets InitValue parameters and runs `steps` optimizer
// steps on this rank. At step `inject_step`, rank `inject_rank` writes an Inf into its first
// gradient element (overflow tests).
absl::StatusOr<TrainResult> TrainRank(const Config& config,
                                      const std::vector<memory::ParamSpec>& specs,
                                      comm::Communicator* comm, Device* device, int steps,
                                      int inject_step = -1, int inject_rank = -1,
                                      Device::Stream compute_stream = nullptr);

// TrainRank (InitValue parameters, `steps` steps, the overflow injection) on `world`
// in-process ranks, one thread each, sharing `device` and the default compute stream: every
// rank's result in rank order, or the first failed rank's status.
absl::StatusOr<std::vector<TrainResult>> TrainRanks(const Config& config,
                                                    const std::vector<memory::ParamSpec>& specs,
                                                    int world, Device* device, int steps,
                                                    int inject_step = -1, int inject_rank = -1);

}  // namespace testing
}  // namespace zerort

#endif  // ZERORT_ZERO_TESTING_SYNTHETIC_TRAINER_H_
