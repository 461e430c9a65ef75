// EngineMemory: exactly the buffers memory::Plan lists, carved from one arena per memory kind,
// zero-filled, with the count of every byte planned and allocated (ByteCounts).
//
// With NVMe offload (plan.options.offload_optimizer_nvme) master, m and v are not in memory:
// EngineMemory creates the rank's swap directory and file (nvme/io.h) of exactly the
// plan's nvme bytes, the AioEngine, and the NvmeState over the plan's nvme_staging slots, with
// the initial state zero; model_state().master/m/v are then null.
//
// Thread safety: immutable after Allocate (the buffers' contents are the engine's to guard).
// The arenas are freed with this object: destroy it only after every copy into them is done.
#ifndef ZERORT_ZERO_INTERNAL_ENGINE_MEMORY_H_
#define ZERORT_ZERO_INTERNAL_ENGINE_MEMORY_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "device/device.h"
#include "memory/arena.h"
#include "memory/plan.h"
#include "zero/config.h"
#include "nvme/io.h"
#include "nvme/params.h"
#include "nvme/state.h"
#include "zero/internal/shard_layout.h"

namespace zerort {
namespace zero_internal {

// Bytes per memory kind (memory::MemoryKind order).
struct ByteCounts {
  int64_t planned[memory::kNumMemoryKinds] = {0, 0, 0, 0};
  int64_t allocated[memory::kNumMemoryKinds] = {0, 0, 0, 0};
};

// A buffer split into `count` equal slots of `elements` each (buckets, gather slots, chunks).
struct SlottedBuffer {
  char* base = nullptr;
  int count = 0;
  int64_t elements = 0;  // per slot
};

// Where NVMe offload puts its files: <path>/zerort-<pid>-<n>-rank<rank>/optimizer_state (or
// param_shard when only the parameters are on NVMe).
struct NvmeSetup {
  std::string path;          // zero_optimization.offload_optimizer.nvme_path
  // zero_optimization.offload_param.nvme_path: used when only the parameters are on NVMe;
  // with both, the shards take a region of the optimizer state's file after the state.
  std::string param_path;
  nvme::AioOptions aio;   // the config's aio block
};

NvmeSetup NvmeSetupOf(const Config& config);

class EngineMemory {
 public:
  // Allocates and zero-fills (on `stream`) every buffer of `plan`; the swap file with NVMe
  // offload (errors of nvme/io.h: tmpfs, leftovers of a crashed run, a full disk).
  static absl::StatusOr<std::unique_ptr<EngineMemory>> Allocate(const memory::Plan& plan,
                                                                Device* device,
                                                                Device::Stream stream,
                                                                const NvmeSetup& nvme = {});
  ~EngineMemory();

  const ModelStateBuffers& model_state() const { return model_state_; }
  const SlottedBuffer& grad_buckets() const { return grad_buckets_; }    // stages 2-3
  const SlottedBuffer& gather_slots() const { return gather_slots_; }    // stage 3
  const SlottedBuffer& staging() const { return staging_; }              // offload
  const SlottedBuffer& nvme_staging() const { return nvme_staging_; }    // NVMe offload
  char* persistent() const { return persistent_; }    // (sum of persistent units) stage 3
  float* norm_table() const { return norm_table_; }   // (world, units + 1) fp32, or null
  float* grad_wire() const { return grad_wire_; }     // (max unit) fp32, or null
  const ByteCounts& bytes() const { return bytes_; }
  // NVMe offload: master|m|v of every owned unit shard; null otherwise.
  nvme::NvmeState* nvme_state() const { return nvme_state_.get(); }
  // NVMe parameter offload (plan.options.offload_param_nvme): the stage-3 parameter shards in
  // the swap file, read through the plan's nvme_param_buffers; null otherwise (and then
  // model_state().params holds the shards).
  nvme::NvmeParams* nvme_params() const { return nvme_params_.get(); }
  // NVMe offload: reads every unit's master, m, v (plan.shard_elements each, unit u at
  // units[u].shard_offset) from the file, synchronously; OK at once without NVMe offload.
  absl::Status LoadNvmeState(const memory::Plan& plan, float* master, float* m, float* v) const;

 private:
  EngineMemory() = default;
  void Assign(const memory::Buffer& b, char* p);
  absl::Status CreateNvme(const memory::Plan& plan, const NvmeSetup& setup);
  absl::Status CreateNvmeParams(const memory::Plan& plan, int64_t base);

  std::unique_ptr<memory::Arena> arenas_[memory::kNumMemoryKinds - 1];  // kNvme has none
  ModelStateBuffers model_state_;
  SlottedBuffer grad_buckets_, gather_slots_, staging_, nvme_staging_, nvme_param_buffers_;
  char* persistent_ = nullptr;
  float* norm_table_ = nullptr;
  float* grad_wire_ = nullptr;
  ByteCounts bytes_;
  // Destroyed first (by ~EngineMemory): the state waits for its I/O, then the file goes, then
  // the directory.
  std::unique_ptr<nvme::SwapDir> swap_dir_;
  std::unique_ptr<nvme::SwapFile> swap_file_;
  std::unique_ptr<nvme::AioEngine> aio_;
  std::unique_ptr<nvme::NvmeState> nvme_state_;
  std::unique_ptr<nvme::NvmeParams> nvme_params_;
};

}  // namespace zero_internal
}  // namespace zerort

#endif  // ZERORT_ZERO_INTERNAL_ENGINE_MEMORY_H_
