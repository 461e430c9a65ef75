// ParkedArenas: the contents of device arenas moved to pinned host memory and the arenas'
// device memory given back (Engine::Park), then restored at the same addresses, bit for bit
// (Engine::Unpark). For RL colocation: the trainer's engine steps aside between training
// phases so that generation (vLLM, SGLang) can use the GPU, as DeepSpeed's offload_states /
// reload_states let verl and OpenRLHF do.
//
// Why the addresses stay: every part of the engine holds raw pointers into its arenas (regions,
// buckets, gather slots, the trainer's param(i) and SetGradBuffer views), so freeing and
// re-allocating would mean rebuilding every part and invalidating the trainer's pointers. An
// arena is decommitted instead (memory::Arena::Decommit): its physical memory goes back to the
// OS or the driver while its address range stays reserved, and Recommit maps new memory there.
//
// The host copies are slabs of the device's kPinnedHost allocator: the process-wide
// memory::PinnedSlabCache. Unpark returns them to it, so a second Park reuses them without an
// OS call (no mmap, no mlock or cudaHostRegister), and pinned memory makes the copies DMA
// transfers on a GPU.
//
//   ASSIGN_OR_RETURN(std::unique_ptr<ParkedArenas> parked,
//                    ParkedArenas::Park({device_arena}, device, stream));
//   ... the device memory is free for others ...
//   RETURN_IF_ERROR(parked->Unpark());  // contents back, same addresses
//   parked.reset();                       // slabs back to the cache
//
// Thread safety: not thread-safe (the engine's thread). Nothing may touch the arenas while
// they are parked: on both devices an access faults.
#ifndef ZERORT_ZERO_INTERNAL_PARKING_H_
#define ZERORT_ZERO_INTERNAL_PARKING_H_

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "device/device.h"
#include "memory/arena.h"

namespace zerort {
namespace zero_internal {

class ParkedArenas {
 public:
  // Copies the carved bytes (Arena::used()) of each arena into a pinned slab on `stream`,
  // waits for the copies, then decommits the arena. All or nothing: on failure every arena is
  // committed again with its contents and every slab returned. Errors: the pinned allocator's
  // (ResourceExhausted), the device's, the arena's (Unimplemented for an allocator that cannot
  // decommit; FailedPrecondition for an arena already decommitted).
  // REQUIRES: every arena outlives the result; the work that writes them has been ordered
  // before the end of `stream` (or completed).
  static absl::StatusOr<std::unique_ptr<ParkedArenas>> Park(std::vector<memory::Arena*> arenas,
                                                            Device* device,
                                                            Device::Stream stream);

  // Recommits every arena and copies its bytes back on `stream`, then waits. All or nothing:
  // on failure (ResourceExhausted while another process holds the device memory) every arena
  // is decommitted again and the host copies are kept, so the call may be retried. After
  // success this object only holds the slabs: destroy it to return them.
  // FailedPrecondition when already unparked.
  absl::Status Unpark();

  // Returns the slabs to the pinned allocator. Arenas still parked stay decommitted (their
  // owner frees them decommitted).
  ~ParkedArenas();
  ParkedArenas(const ParkedArenas&) = delete;
  ParkedArenas& operator=(const ParkedArenas&) = delete;

  bool parked() const { return parked_; }
  // Bytes held in pinned host memory (the sum of the arenas' used()).
  size_t host_bytes() const;

 private:
  struct Saved {
    memory::Arena* arena;
    void* slab;    // pinned, `bytes` long (null when 0)
    size_t bytes;  // arena->used() when parked
  };
  ParkedArenas(Device* device, Device::Stream stream);
  // Recommits saved_[0, n) and copies their bytes back, waiting for the copies. On failure,
  // the arenas of [0, n) recommitted by this call are decommitted again.
  absl::Status RestoreFirst(size_t n);

  Device* const device_;
  const Device::Stream stream_;
  memory::RawAllocator* const pinned_;
  std::vector<Saved> saved_;
  bool parked_ = false;
};

}  // namespace zero_internal
}  // namespace zerort

#endif  // ZERORT_ZERO_INTERNAL_PARKING_H_
