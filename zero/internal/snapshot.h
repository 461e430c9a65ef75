// OwnedSnapshot: copies this rank's shard of the fp32 master, m and v (and optionally the
// compute-dtype parameters) of every unit into host buffers on a stream of its own, so that a
// checkpoint overlaps the next forward and backward passes.
//
// A compact optimizer-state form (docs/compact_state.md) is not fp32: UnitStore::BeforeSnapshot
// converts it into the caller's arrays before Begin, which then copies only the parameters.
//
// The copies start after the work enqueued so far on the compute stream. Until they have
// landed, the owned state must not be written: every writer calls Fence first (on the compute
// stream for device-side updates, on the host for host-side ones).
//
// Thread safety: Begin and Fence on the engine's thread; Wait may be called from another
// thread once Begin has returned.
#ifndef ZERORT_ZERO_INTERNAL_SNAPSHOT_H_
#define ZERORT_ZERO_INTERNAL_SNAPSHOT_H_

#include <functional>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "device/device.h"
#include "memory/plan.h"
#include "zero/internal/shard_layout.h"

namespace zerort {
namespace zero_internal {

class OwnedSnapshot {
 public:
  // Every argument must outlive this object.
  OwnedSnapshot(const memory::Plan& plan, const ShardLayout& layout, Device* device,
                Device::Stream compute)
      : plan_(plan), layout_(layout), dev_(device), compute_(compute) {}
  ~OwnedSnapshot();
  OwnedSnapshot(const OwnedSnapshot&) = delete;
  OwnedSnapshot& operator=(const OwnedSnapshot&) = delete;

  // master, m, v: plan.shard_elements floats each, unit u's shard at units[u].shard_offset;
  // param (or null): the same in the compute dtype. Returns once the copies are enqueued.
  absl::Status Begin(float* master, float* m, float* v, void* param);
  // Blocks until the last Begin's copies have landed (OK at once without one).
  absl::Status Wait();
  // Orders the pending copies before the next write to the owned state: the host waits
  // (`host`), or the compute stream does.
  absl::Status Fence(bool host);

  // A Wait that may outlive this object (a checkpoint writer's thread holds it): while the
  // object lives it waits for the copies; after Detach it returns their final status.
  std::function<absl::Status()> Waiter() const;
  // Waits for the copies and cuts every Waiter loose. The engine calls it before it frees the
  // owned state, so a late writer never touches freed memory.
  void Detach();

 private:
  const memory::Plan& plan_;
  const ShardLayout& layout_;
  Device* const dev_;
  const Device::Stream compute_;
  // Created on first use.
  Device::Stream stream_ = nullptr;
  Device::Event start_ = nullptr;  // compute -> stream_
  Device::Event done_ = nullptr;   // the copies have landed
  bool pending_ = false;           // a writer must wait for done_ first

  // What Waiter's closures share with this object.
  struct Link {
    absl::Mutex mu;
    OwnedSnapshot* snapshot ABSL_GUARDED_BY(mu) = nullptr;  // null once detached
    absl::Status copies ABSL_GUARDED_BY(mu);                 // the copies' status after Detach
  };
  const std::shared_ptr<Link> link_ = MakeLink(this);
  static std::shared_ptr<Link> MakeLink(OwnedSnapshot* self);
};

}  // namespace zero_internal
}  // namespace zerort

#endif  // ZERORT_ZERO_INTERNAL_SNAPSHOT_H_
