// For gpu-tagged Catch2 cases, which run on every machine: the GPU where there is one, and
// where there is none a skip that says why (the driver's or runtime's words), so that a run
// on a lent GPU machine cannot pass by skipping silently.
#ifndef ZERORT_DEVICE_TESTING_GPU_OR_SKIP_H_
#define ZERORT_DEVICE_TESTING_GPU_OR_SKIP_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include <catch2/catch.hpp>
#include "device/cuda_device.h"
#include "device/device.h"

namespace zerort {
namespace testing {

// Prints "SKIPPED: no CUDA device: <why>" for a probe that failed with `status`.
inline void WarnNoGpu(const absl::Status& status) {
  std::string reason(status.message());
  constexpr absl::string_view kPrefix = "no CUDA device: ";
  if (absl::StartsWith(reason, kPrefix)) reason.erase(0, kPrefix.size());
  WARN("SKIPPED: no CUDA device: " << reason);
}

// CUDA device 0, created once per process and never destroyed (cases share it), or nullptr
// after WarnNoGpu.
inline Device* GpuOrSkip() {
  static absl::StatusOr<std::unique_ptr<Device>>* const gpu =
      new absl::StatusOr<std::unique_ptr<Device>>(CreateCudaDevice(0));
  if (gpu->ok()) return gpu->value().get();
  WarnNoGpu(gpu->status());
  return nullptr;
}

}  // namespace testing
}  // namespace zerort

#endif  // ZERORT_DEVICE_TESTING_GPU_OR_SKIP_H_
