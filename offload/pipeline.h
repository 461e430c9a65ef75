// OffloadPipeline: the offloaded optimizer step. AdamW runs on the host over every owned
// region, reading the reduced gradients where gradient offload left them (host memory, copied
// there during backward), while the new parameters stream back up through the plan's
// `buffer_count` pinned staging chunks:
//
//   host:        AdamW(0)  AdamW(1)  gather(0)  AdamW(2)  gather(1) ...
//   h2d stream:        param(0)  param(1)         param(2) ...
//
// Chunk k = u mod B carries unit u's new parameter shard. The host waits once for the
// gradients' stream (the copies into the host shards are enqueued there) before the first
// AdamW, and for unit u - B's upload before overwriting its chunk; unit u's all-gather (a hook
// of the caller's) runs once unit u + 1 has been updated, so it overlaps the next copies. With
// param_on_host (ZeRO-3 offload_param) the parameter shard lives on the host and AdamW writes
// it in place: no chunk is used.
//
// Compact optimizer state (options.master_form, moment_dtype: offload/cpu_adamw_compact.h,
// docs/compact_state.md) runs CpuAdamWCompact instead. A compact master is the bf16 parameter
// shard itself with param_on_host; otherwise the region's host bf16 copy, updated in place and
// uploaded from there (no chunk), or, with NVMe, the bf16 part in the file, copied into the
// chunk (or the host shard) after each piece.
//
// With options.nvme (NVMe offload) the regions' master, m and v are null: they live in a swap
// file, and AdamW runs piece by piece (a unit is one piece or several) on pinned slots that
// nvme::NvmeState filled while the previous piece was updated, while the piece before that is
// written back (nvme/state.h). A failed read
// or write fails Update with the file and offset; the file's current copy is then the state
// before the step, and an Update with the same gradients gives what a fault-free one would.
//
//   ASSIGN_OR_RETURN(auto pipeline, OffloadPipeline::Create(device, regions, options, stream));
//   // backward: each region's gradient copied into its host buffer on `stream`
//   ASSIGN_OR_RETURN(OffloadPipeline::Times t, pipeline->Update(params, grad_scale, hooks));
//   RETURN_IF_ERROR(pipeline->JoinUploads(compute_stream));
//
// Thread safety: not thread-safe; one per engine. The destructor waits for its streams.
#ifndef ZERORT_OFFLOAD_PIPELINE_H_
#define ZERORT_OFFLOAD_PIPELINE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/dtype.h"
#include "device/device.h"
#include "offload/cpu_adamw.h"
#include "offload/cpu_adamw_compact.h"
#include "nvme/params.h"
#include "nvme/state.h"

namespace zerort {
namespace offload {

// One unit's owned region.
struct PipelineRegion {
  const void* grad = nullptr;  // (n) grad dtype, host: the reduced gradient (gradient offload)
  float* master = nullptr;     // (n) fp32, host (null with PipelineOptions::nvme, or with a
                               // compact master)
  void* m = nullptr;           // (n) moment dtype, host (null with PipelineOptions::nvme)
  void* v = nullptr;           // (n) moment dtype, host (null with PipelineOptions::nvme)
  void* param = nullptr;       // (n) compute dtype: device, or host with param_on_host
  int64_t n = 0;
  // A compact master (PipelineOptions::master_form), host: its bf16 part (`param` itself with
  // param_on_host) and the kBf16Remainder remainder; null with PipelineOptions::nvme.
  uint16_t* master_bf16 = nullptr;
  uint16_t* remainder = nullptr;
  uint64_t first_index = 0;    // stochastic rounding: the global index of element 0
  // The caller's index of this region's unit, which Hooks::gather and nvme_params are given;
  // -1: its position in the region list (the caller's regions are every unit).
  int unit = -1;
};

struct PipelineOptions {
  DType dtype = DType::kBF16;    // of parameters, and of gradients unless grad_dtype is set
  std::optional<DType> grad_dtype;  // fp32 gradients (grad_accum_dtype) beside 2-byte params
  char* staging = nullptr;       // (chunks, chunk_elements) dtype, pinned host
  // >= 1; 0 (and staging null) only with param_on_host and no nvme_params: no chunk is used
  int chunks = 0;
  int64_t chunk_elements = 0;    // >= the largest region's n: one parameter shard
  bool param_on_host = false;
  int cpu_threads = 0;           // of the host AdamW (0: the machine's)
  nvme::NvmeState* nvme = nullptr;     // NVMe offload: master, m, v of every region; outlives us
  // NVMe parameter offload (with param_on_host; regions' param null): AdamW writes each new
  // shard into its chunk's parameter half, which is then written to the file (as
  // PipelineRegion::unit's shard). Outlives us.
  nvme::NvmeParams* nvme_params = nullptr;
  // Compact optimizer state (REQUIRES dtype kBF16 unless both are kF32). With nvme the file's
  // arrays are master (fp32, or the compact master's bf16 part), remainder (kBf16Remainder), m
  // and v: memory::OptimizerStateForm's order. A compact master needs no chunks unless nvme is
  // set (its host copy goes up itself) and is refused with nvme_params.
  MasterForm master_form = MasterForm::kF32;
  DType moment_dtype = DType::kF32;
  uint64_t rounding_seed = 0;    // kBf16Stochastic: StochasticRounding::seed
};

class OffloadPipeline {
 public:
  // `grads_stream`: where the copies into the regions' host gradients are enqueued (Update
  // waits for it before the first AdamW). `device` and the buffers must outlive the pipeline.
  static absl::StatusOr<std::unique_ptr<OffloadPipeline>> Create(
      Device* device, std::vector<PipelineRegion> regions, const PipelineOptions& options,
      Device::Stream grads_stream);
  ~OffloadPipeline();
  OffloadPipeline(const OffloadPipeline&) = delete;
  OffloadPipeline& operator=(const OffloadPipeline&) = delete;

  struct Hooks {
    // Orders unit's upload (recorded on `uploaded`; null with param_on_host) before the
    // all-gather that reads it.
    std::function<absl::Status(Device::Event uploaded)> before_gather;
    // All-gathers the unit's new parameters (PipelineRegion::unit).
    std::function<absl::Status(int unit)> gather;
    // NVMe offload: this rank's verdict on the step's I/O in, the group's out (every rank
    // calls it once per step, before the written copy becomes current). Null: the local one.
    std::function<absl::Status(const absl::Status& local)> agree;
  };
  struct Times {
    double wait_ms = 0;    // host time waiting for the gradients and for chunk reuse
    double gather_ms = 0;  // in hooks.gather
    double nvme_wait_ms = 0;  // NVMe offload: host time waiting for state reads and writes
  };
  // AdamW over every region (see above), then hooks.gather of every unit in order. `step`: the
  // optimizer step t, stochastic rounding's draw (StochasticRounding::step).
  absl::StatusOr<Times> Update(const AdamWStepParams& params, float grad_scale,
                               const Hooks& hooks, uint64_t step = 0);
  // The same with per-range constants (parameter groups): ranges[u] tiles region u's n
  // elements as CpuAdamW's ranges do.
  absl::StatusOr<Times> Update(const std::vector<std::vector<AdamWRange>>& ranges,
                               float grad_scale, const Hooks& hooks, uint64_t step = 0);
  // Orders the uploads before `stream`'s next work (no-op with param_on_host).
  absl::Status JoinUploads(Device::Stream stream);

 private:
  OffloadPipeline(Device* device, std::vector<PipelineRegion> regions,
                  const PipelineOptions& options, Device::Stream grads_stream);
  DType GradDType() const { return options_.grad_dtype.value_or(options_.dtype); }
  bool compact() const {
    return options_.master_form != MasterForm::kF32 || options_.moment_dtype != DType::kF32;
  }
  bool compact_master() const { return options_.master_form != MasterForm::kF32; }
  // A compact master's host copy goes up itself: no chunk carries the new shard.
  bool direct_upload() const {
    return compact_master() && !options_.param_on_host && options_.nvme == nullptr;
  }
  // AdamW over one region's (or NVMe piece's) arrays, compact or not. `param`: where the new
  // parameters go (kF32 master), or the compact master's bf16 part.
  absl::Status RunAdamW(const CompactAdamWArrays& arrays, absl::Span<const AdamWRange> ranges,
                        float grad_scale) const;
  const char* Grad(int u) const { return static_cast<const char*>(regions_[u].grad); }
  int Unit(int u) const { return regions_[u].unit >= 0 ? regions_[u].unit : u; }
  char* ParamChunk(int u) const;
  absl::Status UpdateAll(const std::vector<std::vector<AdamWRange>>& ranges, float grad_scale,
                         const Hooks& hooks, Times* times);
  absl::Status UpdateUnit(int u, absl::Span<const AdamWRange> ranges, float grad_scale,
                          Times* times);
  absl::Status UpdateNvmePieces(int u, void* out, absl::Span<const AdamWRange> ranges,
                                float grad_scale, Times* times);
  absl::Status Gather(int u, const Hooks& hooks, Times* times);

  Device* const dev_;
  const std::vector<PipelineRegion> regions_;
  const PipelineOptions options_;
  // The step's first NVMe I/O error (state or parameter write); with NVMe state the step goes
  // on without AdamW, and no later parameter shard is written.
  absl::Status nvme_error_;
  const size_t c_;   // bytes of a parameter element
  const size_t gc_;  // bytes of a gradient element
  const Device::Stream grads_stream_;
  Device::Stream h2d_ = nullptr;           // new parameter shards back up
  Device::Event grads_ready_ = nullptr;    // recorded on grads_stream_: the gradients landed
  std::vector<Device::Event> chunk_out_;   // per chunk (one without chunks): its parameters
                                           // have left
  uint64_t step_ = 0;                      // of the Update running
  // Kept across steps so that a step builds no range list. Per unit, the one range {0, n} that
  // Update(params) fills with the step's constants.
  std::vector<std::vector<AdamWRange>> whole_ranges_;
  // UpdateNvmePieces' ranges of the current piece; reaches its largest size in the first step.
  std::vector<AdamWRange> piece_ranges_;
};

}  // namespace offload
}  // namespace zerort

#endif  // ZERORT_OFFLOAD_PIPELINE_H_
