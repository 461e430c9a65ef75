#include "zero/internal/engine_memory.h"

#include <algorithm>
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
                                                                      Device::Stream stream) {
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
    mem->Assign(plan.options, b, static_cast<char*>(p));
  }
  // The zero-fills are enqueued on `stream`, but the host writes host and pinned buffers
  // directly from here on, with no stream between (the NVMe state slots and parameter buffers
  // in UnitStore::Create and InitParams, the offload staging chunks): a fill still in flight
  // would land on what the host wrote (the first units' initial master read back as zeros).
  // They land before any buffer is handed out.
  RETURN_IF_ERROR(device->Synchronize(stream));
  for (int k = 0; k < kNumArenas; ++k) {
    mem->bytes_.allocated[k] = static_cast<int64_t>(mem->arenas_[k]->requested());
  }
  return mem;
}

void EngineMemory::Assign(const memory::PlanOptions& o, const memory::Buffer& b, char* p) {
  SlottedBuffer slotted{p, static_cast<int>(b.count), b.elements / b.count, b.slot_elements};
  if (!b.slot_elements.empty()) {
    slotted.elements = *std::max_element(b.slot_elements.begin(), b.slot_elements.end());
    slotted.Index();
  }
  // With offload_optimizer, optimizer state in device memory is the part that
  // offload_optimizer.ratio < 1 keeps there (the plan's "<name>_device" buffers, or the plain
  // ones when every unit is kept); stage 1's full gradients are no optimizer state.
  if (o.offload_optimizer && b.kind == MemoryKind::kDevice) {
    ModelStateBuffers::Kept& kept = model_state_.kept;
    switch (b.cls) {
      case BufferClass::kGrads:
        if (o.stage <= 1) break;
        kept.grads = p;
        return;
      case BufferClass::kMaster:
        // A compact master's bf16 copy (memory::OptimizerStateForm), else the fp32 master.
        if (b.dtype == DType::kF32) {
          kept.master = reinterpret_cast<float*>(p);
        } else {
          kept.master_bf16 = reinterpret_cast<uint16_t*>(p);
        }
        return;
      case BufferClass::kMasterRemainder: kept.remainder = reinterpret_cast<uint16_t*>(p); return;
      case BufferClass::kExpAvg: kept.m = p; return;
      case BufferClass::kExpAvgSq: kept.v = p; return;
      case BufferClass::kGradAccumulator: kept.accum = p; return;
      default: break;
    }
  }
  switch (b.cls) {
    case BufferClass::kParams: model_state_.params = p; break;
    case BufferClass::kGrads: model_state_.grads = p; break;
    case BufferClass::kMaster:
      // A compact master's bf16 copy (memory::OptimizerStateForm), else the fp32 master.
      if (b.dtype == DType::kF32) {
        model_state_.master = reinterpret_cast<float*>(p);
      } else {
        model_state_.master_bf16 = reinterpret_cast<uint16_t*>(p);
      }
      break;
    case BufferClass::kMasterRemainder:
      model_state_.remainder = reinterpret_cast<uint16_t*>(p);
      break;
    case BufferClass::kExpAvg: model_state_.m = p; break;
    case BufferClass::kExpAvgSq: model_state_.v = p; break;
    case BufferClass::kGradAccumulator: model_state_.accum = p; break;
    case BufferClass::kGradBucket: grad_buckets_ = slotted; break;
    case BufferClass::kGradWire: grad_wire_ = reinterpret_cast<float*>(p); break;
    case BufferClass::kGradLocal: grad_local_ = p; break;
    case BufferClass::kGatherBuffer: gather_slots_ = slotted; break;
    case BufferClass::kPersistentParams: persistent_ = p; break;
    case BufferClass::kOffloadStaging: staging_ = slotted; break;
    case BufferClass::kNormTable: norm_table_ = reinterpret_cast<float*>(p); break;
    case BufferClass::kNvmeStaging: nvme_staging_ = slotted; break;
    case BufferClass::kNvmeSecondCopy: break;  // a file region
    case BufferClass::kNvmeParamPadding: break;  // a file region
    case BufferClass::kNvmeParamBuffers: nvme_param_buffers_ = slotted; break;
    case BufferClass::kGradAccumStage: grad_accum_stage_ = p; break;
    case BufferClass::kNormPartials: norm_partials_ = reinterpret_cast<float*>(p); break;
    case BufferClass::kHpzSecondary: hpz_secondary_ = p; break;
    case BufferClass::kGatherStage: gather_stage_ = p; break;
  }
}

}  // namespace zero_internal
}  // namespace zerort
