// The CPU device: every buffer in host memory and every kernel from offload/ (SIMD, threaded).
//
// It is the embedded default and the reference the CUDA device is tested against. "Pinned"
// arenas are ordinary page-aligned host memory here: with no DMA engine there is nothing to pin
// for. Stream arguments are ignored: every call has completed when it returns.
//
// Thread-safe: the in-process ranks of one process may share a single CpuDevice.
#ifndef ZERORT_ZERO_CPU_DEVICE_H_
#define ZERORT_ZERO_CPU_DEVICE_H_

#include <memory>

#include "zero/device.h"

namespace zerort {

// `threads`: threads for AdamW and the norm (0 = all cores).
std::unique_ptr<Device> CreateCpuDevice(int threads = 0);

}  // namespace zerort

#endif  // ZERORT_ZERO_CPU_DEVICE_H_
