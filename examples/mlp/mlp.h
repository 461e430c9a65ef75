// A multi-layer perceptron trained through the engine, written the way a user embeds zerort: the
// trainer owns forward and backward (fp32 math on the CPU, reading the engine's compute-dtype
// parameters), the engine owns parameter, gradient and optimizer memory and the step.
//
// The task is regression onto a fixed random teacher network of the same shape; every rank
// draws different samples of the same input distribution, so data parallelism has something to
// average. The loss is the mean squared error.
//
//   Mlp mlp(MlpShape{});
//   ASSIGN_OR_RETURN(auto engine, Engine::Create(config, mlp.ParamSpecs(), comm, device));
//   RETURN_IF_ERROR(engine->InitParams(mlp.Initializer()));
//   Teacher teacher(mlp.shape());
//   for (int step = 0; step < steps; ++step) {
//     ASSIGN_OR_RETURN(float loss, mlp.ForwardBackward(*engine, teacher.Sample(rank, step, 32)));
//     ASSIGN_OR_RETURN(StepStats stats, engine->Step());
//   }
//
// RunInProcess does exactly that on N threads over an in-process communicator group; it is
// what `zerort demo`, the step benchmark and the tests run.
//
// Thread safety: Mlp and Teacher are immutable after construction and may be shared by the
// ranks' threads; ForwardBackward keeps its scratch on the stack of the call.
#ifndef ZERORT_EXAMPLES_MLP_MLP_H_
#define ZERORT_EXAMPLES_MLP_MLP_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "memory/plan.h"
#include "zero/config.h"
#include "zero/engine.h"

namespace zerort {
namespace examples {

// Layer widths: dims[0] inputs, dims.back() outputs, tanh between layers, a linear last layer.
struct MlpShape {
  std::vector<int> dims = {16, 64, 64, 8};  // REQUIRES: size() >= 2, every entry >= 1
  uint64_t seed = 1;                        // the student's initial weights
  int num_layers() const { return static_cast<int>(dims.size()) - 1; }
};

// One mini-batch: x is (n, dims[0]) and y is (n, dims.back()), row-major fp32.
struct Batch {
  int n = 0;
  std::vector<float> x;
  std::vector<float> y;
};

// The fixed random network that defines the regression targets.
class Teacher {
 public:
  explicit Teacher(const MlpShape& shape, uint64_t seed = 12345);
  // Samples of the same distribution for every rank, different samples per (rank, step).
  Batch Sample(int rank, int64_t step, int n) const;

 private:
  MlpShape shape_;
  uint64_t seed_;
  std::vector<std::vector<float>> w_, b_;  // per layer: (out, in) and (out)
};

class Mlp {
 public:
  explicit Mlp(MlpShape shape);

  const MlpShape& shape() const { return shape_; }
  // Registration order: fc0.w (out, in), fc0.b (out), fc1.w, ... one module "fcL" per layer.
  std::vector<memory::ParamSpec> ParamSpecs() const;
  int64_t num_elements() const;
  // Uniform(-1/sqrt(in), 1/sqrt(in)) weights from shape.seed, zero biases; the same on every
  // rank, so it works with InitParams(init, /*from_rank0=*/false) too.
  Engine::Initializer Initializer() const;

  // One micro-step: forward and backward of `batch` through `engine`'s parameters, writing
  // every gradient (times engine.loss_scale()) and calling GradReady in backward order, with
  // Gather/Release around each layer (no-ops below stage 3). Returns the unscaled MSE loss.
  // Does not call Step().
  absl::StatusOr<float> ForwardBackward(Engine& engine, const Batch& batch) const;

  // Plain fp32 loss of `batch` under the given full parameter vector (registration order, as
  // Engine::GatherMasterWeights returns it): the reference the tests check training against.
  float Loss(const std::vector<float>& flat_params, const Batch& batch) const;

 private:
  MlpShape shape_;
};

// What happened at one step, over all ranks.
struct StepReport {
  int step = 0;            // 0-based
  double loss = 0;         // mean over ranks of each rank's batch loss (before this update)
  double ms = 0;           // rank 0's wall time of forward + backward + Step()
  StepStats stats;         // rank 0's (grad norm and loss scale are the same on every rank)
};

struct RunOptions {
  int world_size = 2;   // in-process ranks, one thread each; >= 1
  int steps = 20;       // micro-steps (Step() calls); >= 1
  int batch = 32;       // samples per rank per micro-step; >= 1
  MlpShape shape;
  int device_threads = 1;      // threads of the shared CPU device; >= 0 (0 = all cores)
  bool from_rank0 = true;      // InitParams broadcasts rank 0's values
  bool gather_master = false;  // fill RunResult::master after the last step
  // Called once per step after every rank has finished it, in step order, on the thread of the
  // last rank to finish. Must not call into the engines.
  std::function<void(const StepReport&)> on_step;
};

struct RunResult {
  std::vector<StepReport> steps;
  std::vector<MemoryReport> memory;          // per rank, after the last step
  std::vector<std::vector<float>> master;    // per rank, if gather_master
  memory::Plan plan;                          // rank 0's
};

// Trains the MLP on options.world_size in-process ranks sharing one CPU device. Errors:
// InvalidArgument for bad options (naming the field); otherwise the first failing rank's error
// (a failing rank destroys its communicator, so its peers fail fast instead of timing out).
absl::StatusOr<RunResult> RunInProcess(const Config& config, const RunOptions& options);

}  // namespace examples
}  // namespace zerort

#endif  // ZERORT_EXAMPLES_MLP_MLP_H_
