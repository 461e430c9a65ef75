// Converts CUDA runtime and NCCL result codes into absl::Status at the library boundary.
//
// Only CUDA-side translation units include this header (it pulls in cuda_runtime.h and nccl.h).
// Messages name the failing call, its source line and whatever context the caller adds, e.g.
//   RETURN_IF_CUDA_ERROR(cudaMalloc(&p, bytes), "arena of ", bytes, " bytes on rank ", rank);
// Out-of-memory maps to ResourceExhausted; a missing driver or device to FailedPrecondition;
// NCCL remote/system errors to Unavailable; everything else to Internal.
#ifndef ZERORT_BASE_CUDA_STATUS_H_
#define ZERORT_BASE_CUDA_STATUS_H_

#include <cuda_runtime.h>
#include <nccl.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace zerort {

inline absl::StatusCode CudaErrorCode(cudaError_t e) {
  switch (e) {
    case cudaErrorMemoryAllocation:
      return absl::StatusCode::kResourceExhausted;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
      return absl::StatusCode::kFailedPrecondition;
    case cudaErrorInvalidValue:
      return absl::StatusCode::kInvalidArgument;
    default:
      return absl::StatusCode::kInternal;
  }
}

inline absl::StatusCode NcclErrorCode(ncclResult_t r) {
  switch (r) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return absl::StatusCode::kInvalidArgument;
    case ncclRemoteError:
    case ncclSystemError:
      return absl::StatusCode::kUnavailable;
    default:
      return absl::StatusCode::kInternal;
  }
}

}  // namespace zerort

#define RETURN_IF_CUDA_ERROR(call, ...)                                                     \
  do {                                                                                      \
    const cudaError_t zerort_cuda_err_ = (call);                                            \
    if (zerort_cuda_err_ != cudaSuccess) {                                                  \
      return ::absl::Status(::zerort::CudaErrorCode(zerort_cuda_err_),                      \
                            ::absl::StrCat(#call, " failed at " __FILE__ ":", __LINE__,     \
                                           ": ", cudaGetErrorString(zerort_cuda_err_),      \
                                           " " __VA_ARGS__));                               \
    }                                                                                       \
  } while (false)

#define RETURN_IF_NCCL_ERROR(call, ...)                                                     \
  do {                                                                                      \
    const ncclResult_t zerort_nccl_res_ = (call);                                           \
    if (zerort_nccl_res_ != ncclSuccess) {                                                  \
      return ::absl::Status(::zerort::NcclErrorCode(zerort_nccl_res_),                      \
                            ::absl::StrCat(#call, " failed at " __FILE__ ":", __LINE__,     \
                                           ": ", ncclGetErrorString(zerort_nccl_res_),      \
                                           " " __VA_ARGS__));                               \
    }                                                                                       \
  } while (false)

#endif  // ZERORT_BASE_CUDA_STATUS_H_
