// Where a run's ranks compute. RunInProcess and RunOnCommunicator (gpt.h) train on the CPU
// backend (Gpt's fp32 kernels on one shared CPU device, an in-process group) unless
// RunOptions::backend names another, such as the CUDA backend of gpt_cuda.h:
//
//   ASSIGN_OR_RETURN(std::unique_ptr<Backend> gpu, CreateCudaBackend(/*device_ordinal=*/0));
//   RunOptions options;
//   options.backend = gpu.get();
//   ASSIGN_OR_RETURN(RunResult result, RunInProcess(config, options));
//
// A backend makes the device the ranks share, the group of in-process communicators over that
// device's memory, and one RankTrainer per rank (forward and backward through the engine, on
// the trainer's own stream, which becomes the engine's compute stream).
//
// Thread safety: a Backend's methods may be called from the ranks' threads at once. A
// RankTrainer belongs to one rank's thread.
#ifndef ZERORT_EXAMPLES_GPT_BACKEND_H_
#define ZERORT_EXAMPLES_GPT_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "base/dtype.h"
#include "comm/communicator.h"
#include "device/device.h"
#include "examples/gpt/gpt.h"
#include "memory/plan.h"
#include "zero/engine.h"

namespace zerort {
namespace examples {
namespace gpt {

// One rank's forward and backward: the contract of Gpt::ForwardBackward and
// Gpt::SequenceLosses, on some device.
class RankTrainer {
 public:
  virtual ~RankTrainer() = default;
  // The stream the trainer's device work is enqueued on: EngineOptions::compute_stream of the
  // rank's engine (nullptr on the CPU).
  virtual Device::Stream stream() const = 0;
  // One micro-step: forward, backward with every gradient written and GradReady as it is
  // produced; the unscaled mean cross-entropy. Does not call Step().
  virtual absl::StatusOr<float> ForwardBackward(Engine& engine, const TokenBatch& batch) = 0;
  // Forward only (collective in stage 3): the mean loss of each sequence.
  virtual absl::StatusOr<std::vector<float>> SequenceLosses(Engine& engine,
                                                            const TokenBatch& batch) = 0;
  // Device bytes the trainer holds beyond the engine's plan (activations, scratch), as of now.
  virtual int64_t activation_bytes() const { return 0; }
  // Declares on `specs` (Gpt::ParamSpecs()'s list, in its order) the bytes this trainer keeps
  // for backward per sequence (memory::ParamSpec::activation_bytes_per_sample) when it trains
  // on micro-batches of `batch` sequences of `seq` tokens in `dtype`, so that the engine's plan
  // counts the trainer's own activations. The default declares nothing.
  virtual void DeclareActivations(int batch, int seq, DType dtype,
                                  std::vector<memory::ParamSpec>* specs) const {}
};

class Backend {
 public:
  virtual ~Backend() = default;
  // "cpu", "cuda".
  virtual std::string name() const = 0;
  // The device every in-process rank of a run shares.
  virtual absl::StatusOr<std::unique_ptr<Device>> CreateDevice() const = 0;
  // `world` in-process ranks' communicators over that device's memory.
  virtual absl::StatusOr<std::vector<std::unique_ptr<comm::Communicator>>> CreateGroup(
      int world, const comm::CommOptions& options) const = 0;
  // One rank's trainer for `shape` (`threads` kernel threads where the backend uses host
  // threads), called on the rank's thread before its engine exists.
  virtual absl::StatusOr<std::unique_ptr<RankTrainer>> CreateTrainer(const GptShape& shape,
                                                                     int threads,
                                                                     Device* device) const = 0;
};

}  // namespace gpt
}  // namespace examples
}  // namespace zerort

#endif  // ZERORT_EXAMPLES_GPT_BACKEND_H_
