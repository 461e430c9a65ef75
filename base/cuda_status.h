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

// Shared body of the two macros below: `text` is the call as written, `ok` the library's success
// value, `code` and `message` map a failure to a StatusCode and the library's own description.
#define ZERORT_RETURN_IF_LIB_ERROR_(type, call, text, ok, code, message, ...)                \
  do {                                                                                       \
    const type zerort_lib_err_ = (call);                                                     \
    if (zerort_lib_err_ != ok) {                                                             \
      return ::absl::Status(code(zerort_lib_err_),                                           \
                            ::absl::StrCat(text, " failed at " __FILE__ ":", __LINE__, ": ", \
                                           message(zerort_lib_err_), " " __VA_ARGS__));      \
    }                                                                                        \
  } while (false)

#define RETURN_IF_CUDA_ERROR(call, ...)                                                       \
  ZERORT_RETURN_IF_LIB_ERROR_(cudaError_t, call, #call, cudaSuccess, ::zerort::CudaErrorCode, \
                              cudaGetErrorString, __VA_ARGS__)

#define RETURN_IF_NCCL_ERROR(call, ...)                                                        \
  ZERORT_RETURN_IF_LIB_ERROR_(ncclResult_t, call, #call, ncclSuccess, ::zerort::NcclErrorCode, \
                              ncclGetErrorString, __VA_ARGS__)

#endif  // ZERORT_BASE_CUDA_STATUS_H_
