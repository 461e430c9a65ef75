// The GPT's forward and backward on one GPU: the same model and pass structure as the CPU
// backend (model.cc), with matrix products through cuBLAS (compute-dtype inputs, fp32
// accumulation) and the rest in gpt_kernels.cu. Activations are fp32; what feeds a matrix
// product is kept in the compute dtype too.
//
// Parameters and gradients are device buffers reached through DeviceParamAccess: the engine's
// own (param(i), grad(i), no copies; each gradient handed over with GradReady as soon as
// backward has written it, in reverse registration order, so its unit's reduction overlaps the
// rest of backward; stage 3 gathers each block before use and releases it after), or flat
// buffers for the tests.
//
// Thread safety: a CudaPass belongs to one thread; several passes (ranks) may share a GPU, each
// on its own stream.
#ifndef ZERORT_EXAMPLES_GPT_INTERNAL_CUDA_MODEL_H_
#define ZERORT_EXAMPLES_GPT_INTERNAL_CUDA_MODEL_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/dtype.h"
#include "examples/gpt/gpt.h"
#include "memory/plan.h"
#include "zero/engine.h"

namespace zerort {
namespace examples {
namespace gpt {
namespace internal {

// Where a CUDA pass finds its parameters and puts its gradients (device memory, compute dtype).
class DeviceParamAccess {
 public:
  virtual ~DeviceParamAccess() = default;
  virtual DType dtype() const = 0;
  // Makes exactly `params` (in the order the pass uses them) readable through Get until the
  // next Fetch; an empty list ends the pass's use of parameters. Collective in stage 3.
  virtual absl::Status Fetch(const std::vector<int>& params) = 0;
  virtual const void* Get(int i) = 0;
  // The buffer for parameter i's gradient (numel elements, overwritten by the pass on its
  // stream), asked for right before it is written.
  virtual absl::StatusOr<void*> Grad(int i) = 0;
  // Parameter i's gradient is enqueued in full. Called once per parameter, in reverse
  // registration order.
  virtual absl::Status Ready(int i) = 0;
};

// The engine's buffers: Fetch gathers the units of `params` (stage 3; keeps units still in use,
// releases the others), Grad is engine.grad(i), Ready is engine.GradReady(i).
std::unique_ptr<DeviceParamAccess> EngineDeviceAccess(Engine& engine);

// Flat device buffers for tests: every parameter (registration order) in `dtype`, uploaded
// from `params`; gradients land in device buffers read back by Gradients().
class FlatDeviceParams : public DeviceParamAccess {
 public:
  static absl::StatusOr<std::unique_ptr<FlatDeviceParams>> Create(
      const std::vector<memory::ParamSpec>& specs, const std::vector<float>& params,
      DType dtype);
  ~FlatDeviceParams() override;
  DType dtype() const override { return dtype_; }
  absl::Status Fetch(const std::vector<int>&) override { return absl::OkStatus(); }
  const void* Get(int i) override;
  absl::StatusOr<void*> Grad(int i) override;
  absl::Status Ready(int) override { return absl::OkStatus(); }
  // Every gradient, registration order, as fp32 (synchronizes the device).
  absl::StatusOr<std::vector<float>> Gradients() const;

 private:
  FlatDeviceParams() = default;
  DType dtype_ = DType::kF32;
  std::vector<int64_t> offsets_;
  int64_t total_ = 0;
  void* params_ = nullptr;
  void* grads_ = nullptr;
};

// One rank's forward/backward machinery: a non-blocking stream, a cuBLAS handle bound to it,
// and the activation buffers, allocated at the first pass and grown when a larger batch comes.
class CudaPass {
 public:
  // FailedPrecondition when the GPU cannot be used (the runtime's reason).
  static absl::StatusOr<std::unique_ptr<CudaPass>> Create(const GptShape& shape,
                                                          int device_ordinal);
  ~CudaPass();

  void* stream() const { return stream_; }
  int64_t activation_bytes() const { return capacity_; }

  // The activation buffers a training pass of `batch` sequences of `seq` tokens in `dtype`
  // allocates (Run's one cudaMalloc, byte for byte, 256-byte alignment included): the blocks'
  // saved tensors, and the rest (tokens, the head, the logits and their gradient, the backward
  // working set, the embedding's gradient). Computed without a GPU.
  struct ActivationLayout {
    int64_t blocks_bytes = 0;  // every block's saved tensors together
    int64_t other_bytes = 0;
    int64_t total_bytes() const { return blocks_bytes + other_bytes; }
  };
  static ActivationLayout TrainingLayout(const GptShape& shape, int batch, int seq, DType dtype);

  // The pass of model.cc's RunPass: the mean cross-entropy of each sequence; with grad_scale
  // != 0, backward too (every gradient of grad_scale * sum of token losses, each Ready as it
  // is enqueued). Synchronizes the stream once, at the end, to read the losses.
  // REQUIRES: the batch is valid for the shape (Gpt's ValidateBatch).
  absl::StatusOr<std::vector<float>> Run(DeviceParamAccess& access, const TokenBatch& batch,
                                         float grad_scale);

  struct Buffers;  // the activation buffers' layout (cuda_model.cc)

 private:
  CudaPass(const GptShape& shape, int device_ordinal);
  absl::Status Reserve(const TokenBatch& batch, DType dtype, bool backward);

  const GptShape shape_;
  const int device_;
  void* stream_ = nullptr;
  void* cublas_ = nullptr;  // cublasHandle_t
  void* memory_ = nullptr;  // one cudaMalloc, carved into Buffers
  int64_t capacity_ = 0;
  std::unique_ptr<Buffers> buffers_;
};

}  // namespace internal
}  // namespace gpt
}  // namespace examples
}  // namespace zerort

#endif  // ZERORT_EXAMPLES_GPT_INTERNAL_CUDA_MODEL_H_
