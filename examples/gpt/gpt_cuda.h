// The GPT example on a GPU: a Backend (backend.h) whose ranks run forward and backward as CUDA
// kernels and cuBLAS matrix products (examples/gpt/internal/cuda_model.h) over the engine's
// device buffers, on the CUDA device (device/cuda_device.h).
//
//   ASSIGN_OR_RETURN(GpuInfo gpu, ProbeGpu());  // FailedPrecondition, with the reason, if none
//   ASSIGN_OR_RETURN(std::unique_ptr<Backend> cuda, CreateCudaBackend());
//   RunOptions options;
//   options.shape = GptShape::Gpt2Small();
//   options.shape.vocab = 256;  // the byte vocabulary of the default corpus
//   options.world_size = 1;     // NCCL at world 1; 2-16: in-process ranks sharing the GPU
//   options.backend = cuda.get();
//   ASSIGN_OR_RETURN(RunResult result, RunInProcess(config, options));
//
// Each rank owns a non-blocking stream (the engine's compute stream), a cuBLAS handle bound to
// it and its activations (RunResult::activation_bytes). Matrix products take the engine's
// compute dtype (bf16, fp16 or fp32) with fp32 accumulation; everything else is fp32.
// A pass is deterministic (no atomics; cuBLAS is bitwise reproducible on one GPU model), so
// stages 0-3 give the same masters bit for bit over an in-process group.
//
// Thread safety: the backend may be shared by the ranks' threads.
#ifndef ZERORT_EXAMPLES_GPT_GPT_CUDA_H_
#define ZERORT_EXAMPLES_GPT_GPT_CUDA_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "examples/gpt/backend.h"
#include "examples/gpt/gpt.h"

namespace zerort {
namespace examples {
namespace gpt {

struct GpuInfo {
  int ordinal = 0;
  std::string name;              // cudaDeviceProp::name, e.g. "NVIDIA H100 80GB HBM3"
  int64_t memory_bytes = 0;      // total device memory
  int compute_major = 0, compute_minor = 0;
  // Peak dense throughput from the vendor's datasheet (0 when the GPU is not in our table):
  // tensor-core bf16/fp16 without sparsity, and plain fp32 (what the fp32 path, which runs
  // without TF32, is held against).
  double peak_bf16_flops = 0;
  double peak_fp32_flops = 0;
  std::string peak_source;       // the datasheet, or why there is no figure
};

// The GPU the CUDA backend would use. FailedPrecondition when none is usable, with the
// runtime's reason (no driver, no device, compute capability below 8.0).
absl::StatusOr<GpuInfo> ProbeGpu(int device_ordinal = 0);

// Bytes in use on GPU `device_ordinal` by the driver's count (cudaMemGetInfo: total - free):
// every allocation of every process on that GPU, the CUDA context, NCCL's and cuBLAS's buffers
// and allocator caches included. What a plan's device budget must hold, measured.
absl::StatusOr<int64_t> DeviceMemoryInUse(int device_ordinal = 0);

// The backend on GPU `device_ordinal`: CUDA device; world 1 over NCCL, 2 to 16 in-process ranks
// sharing the GPU (comm::CreateInProcessGroup with CudaInProcessBufferOps; NCCL refuses two
// ranks on one GPU). FailedPrecondition as ProbeGpu.
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(int device_ordinal = 0);

// Model FLOPs of training on one token (forward and backward) with sequences of `seq` tokens:
// 6 * parameters + 6 * layers * d_model * seq (the attention products, causal: half of the
// 12 L d T that a full attention costs), as llm.c counts for its MFU.
double TrainingFlopsPerToken(const GptShape& shape, int seq);

}  // namespace gpt
}  // namespace examples
}  // namespace zerort

#endif  // ZERORT_EXAMPLES_GPT_GPT_CUDA_H_
