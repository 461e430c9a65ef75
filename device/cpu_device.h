// The CPU device: every buffer in host memory and every kernel from offload/ (SIMD, threaded).
//
// It is the embedded default and the reference the CUDA device is tested against. "Pinned"
// arenas are ordinary page-aligned host memory here: with no DMA engine there is nothing to pin
// for.
//
// Streams: the nullptr stream is the calling thread (work on it has completed on return). With
// async_streams, each stream from CreateStream is a worker thread that runs its work in order,
// concurrently with the caller, exactly as a CUDA stream would: the engine's offload pipeline
// then really overlaps its copies with the host AdamW, and its event ordering is tested on
// machines without a GPU. Without async_streams, created streams run work inline too.
//
// Thread-safe: the in-process ranks of one process may share a single CpuDevice.
#ifndef ZERORT_DEVICE_CPU_DEVICE_H_
#define ZERORT_DEVICE_CPU_DEVICE_H_

#include <memory>

#include "device/device.h"

namespace zerort {

// `threads`: threads for AdamW and the norm (0 = all cores). `stream_delay_us` (tests): every
// operation on an asynchronous stream starts that much later, so that a missing event wait
// shows up as a wrong result instead of a rare one. `copy_link_gbps` (benchmarks): a Copy on
// a created stream (inline or asynchronous) lasts at least bytes / copy_link_gbps, the rest
// spent sleeping, as if a DMA engine moved the bytes over a link of that speed while the
// issuing thread waited: the offload schedule can then be measured against a modelled PCIe
// link on a machine without one (offload_bench --link_gbps).
std::unique_ptr<Device> CreateCpuDevice(int threads = 0, bool async_streams = false,
                                        int stream_delay_us = 0, double copy_link_gbps = 0);

}  // namespace zerort

#endif  // ZERORT_DEVICE_CPU_DEVICE_H_
