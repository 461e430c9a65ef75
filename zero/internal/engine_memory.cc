#include "zero/internal/engine_memory.h"

#include <unistd.h>

#include <atomic>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace zerort {
namespace zero_internal {

using memory::BufferClass;
using memory::MemoryKind;

// Memory kinds with an arena: all but kNvme (the last).
constexpr int kNumArenas = memory::kNumMemoryKinds - 1;

absl::StatusOr<std::unique_ptr<EngineMemory>> EngineMemory::Allocate(const memory::Plan& plan,
                                                                      Device* device,
                                                                      Device::Stream stream,
                                                                      const NvmeSetup& nvme) {
  std::unique_ptr<EngineMemory> mem(new EngineMemory());
  int64_t need[memory::kNumMemoryKinds] = {0, 0, 0, 0};
  for (const memory::Buffer& b : plan.buffers) {
    // Each buffer may skip up to kStaggerSlack bytes so that no two start at the same offset
    // modulo 4 KiB (see memory/arena.h: 4 KiB aliasing halves the host AdamW's bandwidth).
    need[static_cast<int>(b.kind)] +=
        static_cast<int64_t>(memory::AlignUp(b.bytes, memory::Arena::kAlignment) +
                             memory::Arena::kStaggerSlack);
    mem->bytes_.planned[static_cast<int>(b.kind)] += b.bytes;
  }
  static const char* kArenaNames[] = {"device", "pinned_host", "host"};
  for (int k = 0; k < kNumArenas; ++k) {
    ASSIGN_OR_RETURN(mem->arenas_[k],
                     memory::Arena::Create(kArenaNames[k], need[k],
                                           device->allocator(static_cast<MemoryKind>(k))));
  }
  size_t index = 0;
  for (const memory::Buffer& b : plan.buffers) {
    if (b.kind == MemoryKind::kNvme) continue;  // in the swap file, not in memory
    memory::Arena& arena = *mem->arenas_[static_cast<int>(b.kind)];
    // 1280 = 5 x 256: coprime with 16, so up to 16 buffers get distinct 256-byte residues.
    // The NVMe slots take residue 0: direct I/O needs them aligned to 4 KiB.
    size_t residue = (index++ * 1280) % memory::Arena::kStaggerSlack;
    if (b.cls == BufferClass::kNvmeStaging || b.cls == BufferClass::kNvmeParamBuffers) {
      residue = 0;
    }
    ASSIGN_OR_RETURN(void* p, arena.AllocateStaggered(b.name, b.bytes, residue));
    RETURN_IF_ERROR(device->Zero(p, b.bytes, stream));
    mem->Assign(b, static_cast<char*>(p));
  }
  for (int k = 0; k < kNumArenas; ++k) {
    mem->bytes_.allocated[k] = static_cast<int64_t>(mem->arenas_[k]->requested());
  }
  if (plan.options.offload_optimizer_nvme || plan.options.offload_param_nvme) {
    RETURN_IF_ERROR(mem->CreateNvme(plan, nvme));
  }
  return mem;
}

NvmeSetup NvmeSetupOf(const Config& c) {
  NvmeSetup s;
  s.path = c.zero.offload_optimizer.nvme_path;
  s.param_path = c.zero.offload_param.nvme_path;
  s.aio = {c.aio.block_size, c.aio.queue_depth, c.aio.single_submit, c.aio.overlap_events,
           c.aio.thread_count, nullptr};
  return s;
}

absl::Status EngineMemory::LoadNvmeState(const memory::Plan& plan, float* master, float* m,
                                         float* v) const {
  if (nvme_state_ == nullptr) return absl::OkStatus();
  for (int u = 0; u < static_cast<int>(plan.units.size()); ++u) {
    const int64_t off = plan.units[u].shard_offset;
    RETURN_IF_ERROR(nvme_state_->Load(u, master + off, m + off, v + off));
  }
  return absl::OkStatus();
}

EngineMemory::~EngineMemory() {
  nvme_params_.reset();
  nvme_state_.reset();
  aio_.reset();
  swap_file_.reset();
  swap_dir_.reset();
}

absl::Status EngineMemory::CreateNvme(const memory::Plan& plan, const NvmeSetup& setup) {
  // pid and a per-process count: two engines of one process (a reshard, an evaluation copy)
  // never share a directory, and a dead pid marks a crashed run's leftovers.
  static std::atomic<int> engines{0};
  const std::string job = absl::StrCat(getpid(), "-", engines++);
  const bool state = plan.options.offload_optimizer_nvme;
  ASSIGN_OR_RETURN(swap_dir_, nvme::SwapDir::Create(state ? setup.path : setup.param_path,
                                                       job, plan.options.rank));
  ASSIGN_OR_RETURN(swap_file_, swap_dir_->CreateFile(state ? "optimizer_state" : "param_shard",
                                                     plan.nvme_bytes()));
  bytes_.allocated[static_cast<int>(MemoryKind::kNvme)] = swap_file_->bytes();
  ASSIGN_OR_RETURN(aio_, nvme::AioEngine::Create(setup.aio));
  std::vector<int64_t> shards;
  for (const memory::Unit& u : plan.units) shards.push_back(u.shard);
  int64_t params_base = 0;
  if (state) {
    const int64_t slot_bytes = nvme_staging_.elements * 4;
    ASSIGN_OR_RETURN(nvme_state_, nvme::NvmeState::Create(
                                      aio_.get(), swap_file_.get(), shards,
                                      plan.options.nvme_piece_elements, nvme_staging_.base,
                                      slot_bytes));
    // m and v start at zero, the master at whatever InitParams stores.
    for (int u = 0; u < static_cast<int>(shards.size()); ++u) {
      RETURN_IF_ERROR(nvme_state_->Store(u, nullptr, nullptr, nullptr));
    }
    params_base = nvme::NvmeState::FileBytes(shards, plan.options.nvme_piece_elements);
  }
  if (plan.options.offload_param_nvme) RETURN_IF_ERROR(CreateNvmeParams(plan, params_base));
  return absl::OkStatus();
}

// The shards start zero-filled (the file is preallocated); InitParams writes them.
absl::Status EngineMemory::CreateNvmeParams(const memory::Plan& plan, int64_t base) {
  const int64_t c = static_cast<int64_t>(DTypeSize(plan.options.compute_dtype));
  std::vector<int64_t> bytes;
  for (const memory::Unit& u : plan.units) bytes.push_back(u.shard * c);
  ASSIGN_OR_RETURN(nvme_params_,
                   nvme::NvmeParams::Create(aio_.get(), swap_file_.get(), base,
                                               std::move(bytes), nvme_param_buffers_.base,
                                               nvme_param_buffers_.count,
                                               nvme_param_buffers_.elements * c));
  return absl::OkStatus();
}

void EngineMemory::Assign(const memory::Buffer& b, char* p) {
  const SlottedBuffer slotted{p, static_cast<int>(b.count), b.elements / b.count};
  switch (b.cls) {
    case BufferClass::kParams: model_state_.params = p; break;
    case BufferClass::kGrads: model_state_.grads = p; break;
    case BufferClass::kMaster: model_state_.master = reinterpret_cast<float*>(p); break;
    case BufferClass::kExpAvg: model_state_.m = reinterpret_cast<float*>(p); break;
    case BufferClass::kExpAvgSq: model_state_.v = reinterpret_cast<float*>(p); break;
    case BufferClass::kGradAccumulator: model_state_.accum = p; break;
    case BufferClass::kGradBucket: grad_buckets_ = slotted; break;
    case BufferClass::kGradWire: grad_wire_ = reinterpret_cast<float*>(p); break;
    case BufferClass::kGatherBuffer: gather_slots_ = slotted; break;
    case BufferClass::kPersistentParams: persistent_ = p; break;
    case BufferClass::kOffloadStaging: staging_ = slotted; break;
    case BufferClass::kNormTable: norm_table_ = reinterpret_cast<float*>(p); break;
    case BufferClass::kNvmeStaging: nvme_staging_ = slotted; break;
    case BufferClass::kNvmeSecondCopy: break;  // a file region
    case BufferClass::kNvmeParamPadding: break;  // a file region
    case BufferClass::kNvmeParamBuffers: nvme_param_buffers_ = slotted; break;
  }
}

}  // namespace zero_internal
}  // namespace zerort
