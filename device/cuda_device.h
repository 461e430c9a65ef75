// The CUDA device: the engine's buffers in GPU memory and its kernels on one GPU.
//
// It implements device/device.h with the same math as the CPU device, bit for bit on finite
// inputs (see docs/cuda.md for the rules that make this true and the one exception: the payload
// of a NaN produced by AdamW's arithmetic). Memory kinds:
//   kDevice        cudaMalloc on this GPU
//   kPinnedHost    the process-wide cache of cudaHostRegister-ed host slabs (portable, mapped:
//                  device-accessible under UVA), shared by every CUDA device, engine and
//                  checkpointer of the process; see memory/pinned_pool.h
//   kPageableHost  memory::HostAllocator() (ordinary host pages)
// All allocations are 4096-byte aligned, as memory::RawAllocator requires.
//
//   ASSIGN_OR_RETURN(std::unique_ptr<Device> gpu, CreateCudaDevice(/*device_ordinal=*/0));
//   RETURN_IF_ERROR(gpu->AdamW(arrays, step, 1.0f / loss_scale, stream));
//   RETURN_IF_ERROR(gpu->SquaredNorm(grad, DType::kBF16, n, &partial, stream));
//   RETURN_IF_ERROR(gpu->Synchronize(stream));  // `partial` is valid from here
//
// Streams: every call takes a cudaStream_t cast to void*; nullptr is the legacy default stream.
// Calls are stream-ordered and only enqueued: their effects, and the host values written by
// SquaredNorm and AllFinite, are valid after Synchronize(stream). Two exceptions complete before
// returning: Zero on host memory (it synchronizes the stream, then memsets on the host), and
// any copy the CUDA runtime performs synchronously (e.g. to pageable host memory).
//
// REQUIRES: the pointers given to Cast, Accumulate, SquaredNorm (x), AllFinite (x) and AdamW
// are device-accessible: memory of this GPU or pinned host memory (pageable host memory only on
// GPUs with pageable memory access, e.g. with HMM); otherwise InvalidArgument naming the
// operation and the pointer. Copy and Zero accept any memory.
//
// Thread-safe: calls from any threads, on any streams, on disjoint buffers. Each call makes the
// device current on the calling thread (cudaSetDevice) first.
#ifndef ZERORT_DEVICE_CUDA_DEVICE_H_
#define ZERORT_DEVICE_CUDA_DEVICE_H_

#include <memory>

#include "absl/status/statusor.h"
#include "comm/inprocess.h"
#include "device/device.h"

namespace zerort {

// The device for GPU `device_ordinal` (as numbered by CUDA_VISIBLE_DEVICES).
// Errors: InvalidArgument for a negative ordinal or one past the visible devices;
// FailedPrecondition when no GPU or driver is usable (the message says why: it is what a
// GPU test prints when it skips) or when the GPU predates compute capability 8.0.
absl::StatusOr<std::unique_ptr<Device>> CreateCudaDevice(int device_ordinal = 0);

// Buffer operations for comm::CreateInProcessGroup so that threads sharing GPU `device_ordinal`
// run an in-process group over its memory (multi-rank logic on one GPU): copies are cudaMemcpy
// (any pair of memory kinds), reductions a kernel with the CPU backends' rank order and
// rounding, bit for bit; both complete before returning (per-thread default stream).
// At most cuda_internal::kMaxReduceSources (16) ranks reduce; more is InvalidArgument.
comm::InProcessBufferOps CudaInProcessBufferOps(int device_ordinal = 0);

}  // namespace zerort

#endif  // ZERORT_DEVICE_CUDA_DEVICE_H_
