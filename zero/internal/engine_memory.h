// EngineMemory: exactly the buffers memory::Plan lists, carved from one arena per memory kind,
// zero-filled, with the count of every byte planned and allocated (ByteCounts).
//
// With offload_optimizer.ratio < 1 the optimizer state comes in two parts, each in buffers of its
// own: the offloaded units' (model_state()'s master, m, v, ...) and the kept units'
// (model_state().kept), each as the plan lists it.
//
// What lives in an NVMe swap file (plan.options.offload_optimizer_nvme: master, m and v;
// offload_param_nvme: the stage-3 parameter shards) has no buffer here; those model_state()
// pointers are then null, and UnitStore (unit_store.h) owns the file over the plan's NVMe
// staging buffers carved here.
//
// Thread safety: immutable after Allocate (the buffers' contents are the engine's to guard).
// The arenas are freed with this object: destroy it only after every copy into them is done.
#ifndef ZERORT_ZERO_INTERNAL_ENGINE_MEMORY_H_
#define ZERORT_ZERO_INTERNAL_ENGINE_MEMORY_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "device/device.h"
#include "memory/arena.h"
#include "memory/plan.h"
#include "zero/internal/shard_layout.h"

namespace zerort {
namespace zero_internal {

// Bytes per memory kind (memory::MemoryKind order).
struct ByteCounts {
  int64_t planned[memory::kNumMemoryKinds] = {0, 0, 0, 0};
  int64_t allocated[memory::kNumMemoryKinds] = {0, 0, 0, 0};
};

// A buffer split into `count` slots (buckets, gather slots, chunks): equal ones of `elements`
// each, or, for a plan buffer with memory::Buffer::slot_elements, slots of two size classes.
struct SlottedBuffer {
  char* base = nullptr;
  int count = 0;
  int64_t elements = 0;  // per slot; with size classes, of the largest slot
  std::vector<int64_t> sizes;  // with size classes: each slot's elements, in order; else empty

  // With size classes: each slot's offset, and the distinct slot sizes in ascending order,
  // derived from `sizes` by Index() (EngineMemory calls it). GradBuckets asks ForUnit of every
  // bucket at every acquire and the gatherer asks offset at every parameter access: scanning
  // the slots there would cost O(slots^2) host work per unit. (The gather slots' policy indexes
  // its size classes itself: memory::GatherSlots.)
  std::vector<int64_t> offsets;
  std::vector<int64_t> classes;

  void Index() {
    offsets.clear();
    int64_t off = 0;
    for (int64_t e : sizes) {
      offsets.push_back(off);
      off += e;
    }
    classes = sizes;
    std::sort(classes.begin(), classes.end());
    classes.erase(std::unique(classes.begin(), classes.end()), classes.end());
  }
  // Elements from `base` to slot s, and the elements it holds. REQUIRES: 0 <= s < count, and
  // Index() called after `sizes` was set.
  int64_t offset(int s) const { return sizes.empty() ? s * elements : offsets[s]; }
  int64_t size(int s) const { return sizes.empty() ? elements : sizes[s]; }
  // Whether a unit of `padded` elements uses slot s: the slot belongs to the unit's size class
  // (memory::SlotClassElements: the smallest slot size that holds the unit).
  bool ForUnit(int s, int64_t padded) const {
    if (sizes.empty()) return padded <= elements;
    const auto c = std::lower_bound(classes.begin(), classes.end(), padded);
    return c != classes.end() && sizes[s] == *c;
  }
};

class EngineMemory {
 public:
  // Allocates and zero-fills (on `stream`) every buffer of `plan` that lives in memory; the
  // fills have landed when it returns (the host writes host and pinned buffers directly).
  static absl::StatusOr<std::unique_ptr<EngineMemory>> Allocate(const memory::Plan& plan,
                                                                Device* device,
                                                                Device::Stream stream);

  const ModelStateBuffers& model_state() const { return model_state_; }
  const SlottedBuffer& grad_buckets() const { return grad_buckets_; }    // stages 2-3
  const SlottedBuffer& gather_slots() const { return gather_slots_; }    // stage 3
  const SlottedBuffer& staging() const { return staging_; }              // offload
  const SlottedBuffer& nvme_staging() const { return nvme_staging_; }    // NVMe state
  const SlottedBuffer& nvme_param_buffers() const { return nvme_param_buffers_; }  // NVMe params
  char* persistent() const { return persistent_; }    // (sum of persistent units) stage 3
  // hpZ: (sum of gathered units' padded / K) stage 3, or null.
  char* hpz_secondary() const { return hpz_secondary_; }
  // MiCS hierarchical gather: (largest padded unit / ranks_per_node), or null.
  char* gather_stage() const { return gather_stage_; }
  float* norm_table() const { return norm_table_; }   // (world, units + 1) fp32, or null
  float* grad_wire() const { return grad_wire_; }     // (max unit) fp32, or null
  // (trainable padded) reduced-gradient dtype: local accumulation's sums, or null.
  char* grad_local() const { return grad_local_; }
  // (max trainable unit / shard group size) reduced-gradient dtype: gradient offload's accumulation stage
  // (memory::BufferClass::kGradAccumStage), or null.
  char* grad_accum_stage() const { return grad_accum_stage_; }
  // (2 x units) fp32, pinned: gradient offload's norm partials and flags, or null.
  float* norm_partials() const { return norm_partials_; }
  const ByteCounts& bytes() const { return bytes_; }
  // The arena of one memory kind (Engine::Park decommits the kDevice one). REQUIRES: not kNvme.
  memory::Arena* arena(memory::MemoryKind kind) const {
    return arenas_[static_cast<int>(kind)].get();
  }

 private:
  EngineMemory() = default;
  void Assign(const memory::PlanOptions& o, const memory::Buffer& b, char* p);

  std::unique_ptr<memory::Arena> arenas_[memory::kNumMemoryKinds - 1];  // kNvme has none
  ModelStateBuffers model_state_;
  SlottedBuffer grad_buckets_, gather_slots_, staging_, nvme_staging_, nvme_param_buffers_;
  char* persistent_ = nullptr;
  char* hpz_secondary_ = nullptr;
  char* gather_stage_ = nullptr;
  float* norm_table_ = nullptr;
  float* grad_wire_ = nullptr;
  char* grad_local_ = nullptr;
  char* grad_accum_stage_ = nullptr;
  float* norm_partials_ = nullptr;
  ByteCounts bytes_;
};

}  // namespace zero_internal
}  // namespace zerort

#endif  // ZERORT_ZERO_INTERNAL_ENGINE_MEMORY_H_
