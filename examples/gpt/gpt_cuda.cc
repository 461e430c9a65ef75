#include "examples/gpt/gpt_cuda.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/cuda_status.h"
#include "base/status.h"
#include "comm/inprocess.h"
#include "comm/nccl.h"
#include "device/cuda_device.h"
#include "examples/gpt/internal/cuda_model.h"
#include "examples/gpt/internal/model.h"

namespace zerort {
namespace examples {
namespace gpt {
namespace {

// Largest in-process group the GPU reduction takes (cuda_internal::kMaxReduceSources).
constexpr int kMaxInProcessRanks = 16;

// Dense (no sparsity) peaks from NVIDIA's datasheets, matched on cudaDeviceProp::name.
void SetPeak(GpuInfo& info) {
  const std::string& n = info.name;
  struct Row {
    const char* match;
    const char* exclude;
    double bf16, fp32;
    const char* source;
  };
  static const Row kRows[] = {
      {"H100 PCIe", nullptr, 756e12, 51e12, "NVIDIA H100 datasheet, PCIe: bf16 dense 756 TFLOPS"},
      {"H100 NVL", nullptr, 835e12, 60e12, "NVIDIA H100 datasheet, NVL: bf16 dense 835 TFLOPS"},
      {"H100", nullptr, 989e12, 67e12,
       "NVIDIA H100 datasheet, SXM: bf16 dense 989 TFLOPS, fp32 67 TFLOPS"},
      {"H200", "NVL", 989e12, 67e12,
       "NVIDIA H200 datasheet, SXM: bf16 dense 989 TFLOPS, fp32 67 TFLOPS"},
      {"H200 NVL", nullptr, 835e12, 60e12, "NVIDIA H200 datasheet, NVL: bf16 dense 835 TFLOPS"},
      {"A100", nullptr, 312e12, 19.5e12,
       "NVIDIA A100 datasheet: bf16 dense 312 TFLOPS, fp32 19.5 TFLOPS"},
  };
  for (const Row& row : kRows) {
    if (!absl::StrContains(n, row.match)) continue;
    if (row.exclude != nullptr && absl::StrContains(n, row.exclude)) continue;
    info.peak_bf16_flops = row.bf16;
    info.peak_fp32_flops = row.fp32;
    info.peak_source = row.source;
    return;
  }
  info.peak_source = absl::StrCat("no datasheet peak on record for '", n, "': MFU not reported");
}

class CudaTrainer : public RankTrainer {
 public:
  CudaTrainer(GptShape shape, std::unique_ptr<internal::CudaPass> pass)
      : shape_(std::move(shape)), pass_(std::move(pass)) {}

  Device::Stream stream() const override { return pass_->stream(); }

  absl::StatusOr<float> ForwardBackward(Engine& engine, const TokenBatch& batch) override {
    RETURN_IF_ERROR(ValidateBatch(shape_, batch));
    std::unique_ptr<internal::DeviceParamAccess> access = internal::EngineDeviceAccess(engine);
    // Gradient of the mean token loss, times the loss scale so small fp16 gradients survive.
    const float scale = static_cast<float>(engine.loss_scale()) /
                        (static_cast<float>(batch.batch) * static_cast<float>(batch.seq));
    ASSIGN_OR_RETURN(std::vector<float> losses, pass_->Run(*access, batch, scale));
    double sum = 0;
    for (float l : losses) sum += l;
    return static_cast<float>(sum / static_cast<double>(losses.size()));
  }

  absl::StatusOr<std::vector<float>> SequenceLosses(Engine& engine,
                                                    const TokenBatch& batch) override {
    RETURN_IF_ERROR(ValidateBatch(shape_, batch));
    std::unique_ptr<internal::DeviceParamAccess> access = internal::EngineDeviceAccess(engine);
    return pass_->Run(*access, batch, 0);
  }

  int64_t activation_bytes() const override { return pass_->activation_bytes(); }

  // The pass's one activation allocation for this micro-batch, per sequence: the blocks' part
  // spread over the blocks, the rest (head, logits, working set, the (vocab, d) embedding
  // gradient) on wte. Each share is rounded up, so the plan counts at most (layers + 1) *
  // batch bytes more than the allocation. The evaluation passes use a smaller forward-only
  // layout as long as their batch is not larger than the training one.
  void DeclareActivations(int batch, int seq, DType dtype,
                          std::vector<memory::ParamSpec>* specs) const override {
    const internal::CudaPass::ActivationLayout layout =
        internal::CudaPass::TrainingLayout(shape_, batch, seq, dtype);
    auto per_sample = [batch](int64_t bytes, int64_t parts) {
      return (bytes + parts * batch - 1) / (parts * batch);
    };
    for (int l = 0; l < shape_.layers; ++l) {
      (*specs)[internal::BlockParamIndex(l, internal::kLn1W)].activation_bytes_per_sample =
          per_sample(layout.blocks_bytes, shape_.layers);
    }
    (*specs)[internal::kWte].activation_bytes_per_sample = per_sample(layout.other_bytes, 1);
  }

 private:
  const GptShape shape_;
  std::unique_ptr<internal::CudaPass> pass_;
};

class CudaBackend : public Backend {
 public:
  explicit CudaBackend(int ordinal) : ordinal_(ordinal) {}
  std::string name() const override { return "cuda"; }

  absl::StatusOr<std::unique_ptr<Device>> CreateDevice() const override {
    return CreateCudaDevice(ordinal_);
  }

  absl::StatusOr<std::vector<std::unique_ptr<comm::Communicator>>> CreateGroup(
      int world, const comm::CommOptions& options) const override {
    if (world > kMaxInProcessRanks) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the CUDA backend runs 1 to ", kMaxInProcessRanks, " ranks on one GPU, not ", world));
    }
    if (world > 1) {
      // NCCL refuses two ranks on one GPU: threads share it through an in-process group whose
      // copies are cudaMemcpy and whose reductions are a kernel.
      return comm::CreateInProcessGroup(world, options, CudaInProcessBufferOps(ordinal_));
    }
    ncclUniqueId id;
    RETURN_IF_NCCL_ERROR(ncclGetUniqueId(&id));
    ASSIGN_OR_RETURN(std::unique_ptr<comm::Communicator> nccl,
                     comm::CreateNcclCommunicator(id, /*rank=*/0, /*world_size=*/1, ordinal_,
                                                  options));
    std::vector<std::unique_ptr<comm::Communicator>> group;
    group.push_back(std::move(nccl));
    return group;
  }

  absl::StatusOr<std::unique_ptr<RankTrainer>> CreateTrainer(const GptShape& shape, int,
                                                             Device*) const override {
    ASSIGN_OR_RETURN(std::unique_ptr<internal::CudaPass> pass,
                     internal::CudaPass::Create(shape, ordinal_));
    return std::make_unique<CudaTrainer>(shape, std::move(pass));
  }

 private:
  const int ordinal_;
};

}  // namespace

absl::StatusOr<GpuInfo> ProbeGpu(int device_ordinal) {
  // CreateCudaDevice states why a GPU is unusable (driver, count, compute capability).
  ASSIGN_OR_RETURN(std::unique_ptr<Device> device, CreateCudaDevice(device_ordinal));
  cudaDeviceProp props;
  RETURN_IF_CUDA_ERROR(cudaGetDeviceProperties(&props, device_ordinal));
  GpuInfo info;
  info.ordinal = device_ordinal;
  info.name = props.name;
  info.memory_bytes = static_cast<int64_t>(props.totalGlobalMem);
  info.compute_major = props.major;
  info.compute_minor = props.minor;
  SetPeak(info);
  return info;
}

absl::StatusOr<int64_t> DeviceMemoryInUse(int device_ordinal) {
  int current = 0;
  RETURN_IF_CUDA_ERROR(cudaGetDevice(&current));
  RETURN_IF_CUDA_ERROR(cudaSetDevice(device_ordinal));
  size_t free_bytes = 0, total_bytes = 0;
  const cudaError_t e = cudaMemGetInfo(&free_bytes, &total_bytes);
  RETURN_IF_CUDA_ERROR(cudaSetDevice(current));
  RETURN_IF_CUDA_ERROR(e);
  return static_cast<int64_t>(total_bytes - free_bytes);
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device_ordinal) {
  ASSIGN_OR_RETURN(GpuInfo info, ProbeGpu(device_ordinal));
  (void)info;
  return std::make_unique<CudaBackend>(device_ordinal);
}

double TrainingFlopsPerToken(const GptShape& shape, int seq) {
  const double params = static_cast<double>(Gpt(shape).num_elements());
  return 6.0 * params + 6.0 * shape.layers * static_cast<double>(shape.d_model) * seq;
}

}  // namespace gpt
}  // namespace examples
}  // namespace zerort
