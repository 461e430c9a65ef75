// UnitStore: the one owner of where this rank's owned state of every unit lives, the fp32
// master, m and v and the compute-dtype parameter shard: in device memory, in host memory
// (offload_optimizer / offload_param "cpu"), or in an NVMe swap file ("nvme"). With
// offload_optimizer.ratio < 1 the units kept on the device have their state there, as without
// offload, and only the offloaded units' state is in host memory or the file.
//
// Every engine path that reads or writes owned state goes through it: InitParams and restores
// (StoreState, StoreParams), snapshots (BeforeSnapshot), GatherMasterWeights (LoadState), the
// stage-3 gathers (ShardToSend), the optimizer step (AfterDeviceUpdate, PipelineStorage) and
// the one policy for a failed update (AfterFailedUpdate). The engine's files hold no branch on
// where state lives: a new place for it (or a compact form of it) is a change here.
//
// Arrays handed in and out are a unit's region (ShardLayout): region(u).n elements, the whole
// padded unit in stage 0 and this rank's shard otherwise. They are always fp32 master, m and v:
// a compact optimizer-state form (memory::OptimizerStateForm, docs/compact_state.md) is
// converted here, on the host: the master split into its bf16 part and remainder
// (offload::SplitMasters) or rounded to nearest (the stochastic form's bf16 master) on the way
// in, joined or widened on the way out; bf16 moments rounded to nearest even in, widened out. A frozen unit (parameters only) reads
// as master = its parameters in fp32 and m = v = 0; StoreState ignores it (StoreParams sets it).
//
//   ASSIGN_OR_RETURN(auto store, UnitStore::Create(plan, layout, memory, config, dev, compute,
//                                                  &exchange));
//   RETURN_IF_ERROR(store->StoreState(u, master, nullptr, nullptr));  // m, v start at zero
//   RETURN_IF_ERROR(store->StoreParams(u, round_of_master));
//
// Thread safety: not thread-safe; one per engine (BeforeSnapshot, like every call, on the
// engine's thread). The memory, layout, device and exchange must outlive it.
#ifndef ZERORT_ZERO_INTERNAL_UNIT_STORE_H_
#define ZERORT_ZERO_INTERNAL_UNIT_STORE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "comm/agree.h"
#include "device/device.h"
#include "memory/plan.h"
#include "nvme/io.h"
#include "nvme/params.h"
#include "nvme/state.h"
#include "offload/pipeline.h"
#include "zero/config.h"
#include "zero/internal/engine_memory.h"
#include "zero/internal/shard_layout.h"

namespace zerort {
namespace zero_internal {

class UnitStore {
 public:
  // With NVMe offload in the plan, creates the rank's swap directory and file over the plan's
  // NVMe buffers of `memory`: <nvme_path>/zerort-<pid>-<n>-rank<rank>/optimizer_state (or
  // param_shard when only the parameters are on NVMe, under offload_param.nvme_path), with the
  // config's aio block (errors of nvme/io.h: tmpfs, leftovers of a crashed run, a full disk).
  // m and v start at zero everywhere. Only the config's NVMe and aio keys are read.
  static absl::StatusOr<std::unique_ptr<UnitStore>> Create(
      const memory::Plan& plan, const ShardLayout& layout, const EngineMemory& memory,
      const Config& config, Device* device, Device::Stream compute,
      comm::HostExchange* exchange);
  ~UnitStore();  // waits for file I/O in flight; the file and its directory go

  // --- optimizer state ------------------------------------------------------------------------
  // Unit u's master, m and v from host fp32 arrays (null m or v: zeros). Enqueued on the compute
  // stream or written on return: keep the arrays until the compute stream is synchronized.
  absl::Status StoreState(int u, const float* master, const float* m, const float* v);
  // Unit u's master, m, v into host arrays (null ones are skipped), complete on return.
  absl::Status LoadState(int u, float* master, float* m, float* v);
  // Before a snapshot's copies (OwnedSnapshot::Begin, which copies what is in memory): what
  // lives in a file is read into the snapshot's arrays now (plan.shard_elements each, unit u at
  // units[u].shard_offset), and `*param` is set to null when the parameter shards were read.
  absl::Status BeforeSnapshot(float* master, float* m, float* v, void** param);

  // --- the parameter shard --------------------------------------------------------------------
  // Unit u's region of the compute-dtype parameters from host `values`; enqueued on the compute
  // stream or written on return (synchronize before `values` goes).
  absl::Status StoreParams(int u, const char* values);
  // Unit u's region of the compute-dtype parameters as round(master) of host fp32 `master`
  // (region(u).n elements), what the step and InitParams write; complete on return.
  absl::Status StoreParamsFromMaster(int u, const float* master);
  // round(master) into `out` (n compute-dtype elements): to nearest even, or, with the lossless
  // master form, ties away from zero (the bf16 part offload::SplitMaster stores), so that
  // parameters written from an fp32 master (InitParams, restores) are the master's own.
  void RoundToParams(const float* master, char* out, int64_t n) const;
  // Stage 3: the send buffer of unit u's all-gather, in device memory: the shard itself, or
  // `block` (this rank's block of the gather destination) when the shard lives on the host or
  // in a file and StageShard copies it there.
  const char* ShardToSend(int u, char* block) const;
  // Copies unit u's shard into `block` on `side` where ShardToSend names `block` (else does
  // nothing) and returns the read's status. On an error the all-gather must still run (on
  // stale bytes), so that every rank makes the same collectives; AgreeOnRead then fails them
  // all alike. `gathered(v)`: unit v is still in a gather slot (no read ahead needed).
  absl::Status StageShard(int u, char* block, Device::Stream side,
                          const std::function<bool(int)>& gathered);
  // After the all-gather of a staged shard: the group's verdict on the reads. Collective where
  // a read can fail (shards in a file); else `read` itself.
  absl::Status AgreeOnRead(const absl::Status& read);
  // Shards in a file: at either end of the units the read-ahead turns round unless `step_next`
  // says the optimizer step comes next (it rewrites every shard, dropping those reads unread).
  void set_step_next(std::function<bool()> step_next) { step_next_ = std::move(step_next); }

  // --- the optimizer step ---------------------------------------------------------------------
  // Where the host AdamW (offload pipeline) finds state and shards that live in a file.
  void PipelineStorage(offload::PipelineOptions* options) const;
  // After AdamW on the device: shard copies kept outside the region (a file) are written from
  // the new master. Collective (the ranks agree on the writes).
  absl::Status AfterDeviceUpdate();
  // The one policy for a failed update (every rank failed alike: the update agreed) of one part
  // of the units: the offloaded ones (`offloaded`, the host step) or the ones on the device
  // (every unit without offload_optimizer; with offload_optimizer.ratio < 1 the kept ones,
  // updated after the host step succeeded). State in a file (host step only): the file keeps
  // the previous step's state, so the step is undone (--*step) and the parameters re-derived
  // from it. Shards alone in a file: the update stands and the part's shards are rewritten from
  // the new master. Otherwise the error stands. `regather(u)` all-gathers unit u's parameters
  // after its shard was rewritten. Returns `failed`, annotated. Collective.
  absl::Status AfterFailedUpdate(const absl::Status& failed, bool offloaded, int64_t* step,
                                 const std::function<absl::Status(int)>& regather);

  int64_t file_bytes() const;  // of the swap file, or 0
  int64_t reads_ahead_used() const;
  int64_t reads_ahead_wasted() const;

 private:
  UnitStore(const memory::Plan& plan, const ShardLayout& layout, Device* device,
            Device::Stream compute, comm::HostExchange* exchange, int threads);
  absl::Status CreateFiles(const EngineMemory& memory, const Config& config);
  // A compact form's StoreState, and its LoadState of elements [begin, begin + n) of unit u's
  // region into host fp32 arrays (null ones skipped).
  absl::Status StoreCompact(int u, const float* master, const float* m, const float* v);
  absl::Status LoadCompact(int u, int64_t begin, int64_t n, float* master, float* m, float* v);
  absl::Status WriteShardFromMaster(int u);
  // Frozen unit u: elements [begin, begin + n) of its region as master, m, v (see .cc).
  absl::Status LoadFrozen(int u, int64_t begin, int64_t n, float* master, float* m, float* v);
  absl::Status ReadAhead(int u, const std::function<bool(int)>& gathered);
  absl::Status RecoverFromFile(const std::function<absl::Status(int)>& regather);
  absl::Status RederiveShards(bool offloaded, const std::function<absl::Status(int)>& regather);
  // Whether the optimizer state lives in the NVMe file: offload_optimizer "nvme" with some unit
  // offloaded; and whether unit u's does.
  static bool StateInFile(const memory::Plan& plan) {
    return plan.options.offload_optimizer_nvme && plan.offloaded_state_elements > 0;
  }
  bool InFile(int u) const { return state_file_ != nullptr && file_index_[u] >= 0; }

  const memory::Plan& plan_;
  const ShardLayout& layout_;
  Device* const dev_;
  const Device::Stream compute_;
  comm::HostExchange* const exchange_;
  const size_t c_;              // bytes of a compute-dtype element
  const bool params_on_host_;   // offload_param: shards in host memory (or the file)
  // The offloaded part's form (with offload_optimizer; the form without it otherwise). Its
  // master, remainder and moment dtypes are the kept part's too; only master_in_params (and so
  // the file's arrays) differ, which the regions already reflect.
  const memory::OptimizerStateForm form_;
  const int threads_;           // of the host conversions (cpu_threads; 0: all)
  // Per unit, its index in the state file (the offloaded units in order), or -1.
  std::vector<int> file_index_;
  int last_read_ = -1;          // shards in a file: the unit read last (read-ahead direction)
  std::function<bool()> step_next_;
  // Destroyed first (by ~UnitStore): the state waits for its I/O, then the file goes, then the
  // directory.
  std::unique_ptr<nvme::SwapDir> swap_dir_;
  std::unique_ptr<nvme::SwapFile> swap_file_;
  std::unique_ptr<nvme::AioEngine> aio_;
  std::unique_ptr<nvme::NvmeState> state_file_;   // master|m|v of every unit (the form's
                                                  // arrays), or null
  std::unique_ptr<nvme::NvmeParams> param_file_;  // stage-3 shards, or null
};

}  // namespace zero_internal
}  // namespace zerort

#endif  // ZERORT_ZERO_INTERNAL_UNIT_STORE_H_
