// The CPU device: every buffer in host memory and every kernel from offload/ (SIMD, threaded).
//
// It is the embedded default and the reference the CUDA device is tested against. Memory kinds:
//   kDevice                 an allocator of this device's own (memory::NewHostAllocator):
//                           ordinary host pages, counted apart from the process's other host
//                           memory (usage()) and decommittable, so that Engine::Park's release
//                           of "device" memory is measured here as on a GPU. Allocations from
//                           it must be freed before the device is destroyed.
//   kPageableHost           memory::HostAllocator() (ordinary host pages)
//   kPinnedHost             memory::SharedPinnedSlabs(): the process-wide cache of mlock-ed
//                           slabs (memory/pinned_pool.h), shared with every other engine and
//                           checkpointer of the process, so that re-creating an engine reuses
//                           its locked slabs. No DMA engine needs the locking here; it keeps the
//                           offloaded optimizer state out of swap, and where RLIMIT_MEMLOCK
//                           refuses, the memory stays unlocked after one warning.
//
//   CpuDeviceOptions options;
//   options.threads = 4;
//   std::unique_ptr<Device> cpu = CreateCpuDevice(options);
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

struct CpuDeviceOptions {
  // --- Kernels
  // Threads for AdamW, the norm, the finite check and casts. Default 0: all cores. >= 0.
  int threads = 0;

  // --- Streams
  // Run each stream from CreateStream on a worker thread of its own. Default false: created
  // streams run their work inline, on the calling thread.
  bool async_streams = false;
  // (Tests) Every operation on an asynchronous stream starts this many microseconds late, so
  // that a missing event wait shows up as a wrong result instead of a rare one. Default 0.
  // >= 0; only with async_streams.
  int stream_delay_us = 0;
  // (Benchmarks) A Copy on a created stream (inline or asynchronous) lasts at least
  // bytes / copy_link_gbps, the rest spent sleeping, as if a DMA engine moved the bytes over a
  // link of that speed while the issuing thread waited: the offload schedule can then be
  // measured against a modelled PCIe link on a machine without one (offload_bench
  // --link_gbps). Default 0: copies take what memcpy takes. >= 0.
  double copy_link_gbps = 0;
};

// REQUIRES: every field within its constraints.
std::unique_ptr<Device> CreateCpuDevice(const CpuDeviceOptions& options = {});

}  // namespace zerort

#endif  // ZERORT_DEVICE_CPU_DEVICE_H_
