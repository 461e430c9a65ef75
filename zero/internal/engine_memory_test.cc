#include "zero/internal/engine_memory.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include "device/cpu_device.h"
#include "device/testing/one_thread.h"
#include "zero/internal/test_util.h"

namespace zerort {
namespace zero_internal {
namespace {

using memory::BufferClass;
using memory::MemoryKind;

// Hands out the inner allocator's memory filled with 0xA5 and remembers every block, so that
// the test sees whether each buffer was zero-filled and which kind's arena it came from.
class DirtyAllocator final : public memory::RawAllocator {
 public:
  explicit DirtyAllocator(memory::RawAllocator* inner) : inner_(inner) {}
  absl::StatusOr<void*> Allocate(size_t bytes) override {
    absl::StatusOr<void*> p = inner_->Allocate(bytes);
    if (p.ok() && *p != nullptr && bytes > 0) {
      std::memset(*p, 0xA5, bytes);
      blocks.push_back({static_cast<char*>(*p), bytes});
    }
    return p;
  }
  void Free(void* p, size_t bytes) override { inner_->Free(p, bytes); }
  absl::string_view name() const override { return inner_->name(); }

  bool Holds(const char* p, size_t bytes) const {
    for (const auto& [base, size] : blocks) {
      if (p >= base && p + bytes <= base + size) return true;
    }
    return false;
  }
  std::vector<std::pair<char*, size_t>> blocks;

 private:
  memory::RawAllocator* const inner_;
};

class DirtyDevice final : public ForwardingDevice {
 public:
  explicit DirtyDevice(Device* inner) : ForwardingDevice(inner) {
    for (int k = 0; k < memory::kNumMemoryKinds; ++k) {
      allocators_.emplace_back(inner->allocator(static_cast<MemoryKind>(k)));
    }
  }
  memory::RawAllocator* allocator(MemoryKind kind) override {
    return &allocators_[static_cast<int>(kind)];
  }
  const DirtyAllocator& of(MemoryKind kind) const { return allocators_[static_cast<int>(kind)]; }

 private:
  std::vector<DirtyAllocator> allocators_;
};

// Where EngineMemory says buffer `b` of `plan` is, and its slots where it has them. With
// offload_optimizer, optimizer state in device memory is the kept part (ModelStateBuffers::kept).
const char* Pointer(const EngineMemory& mem, const memory::Plan& plan, const memory::Buffer& b,
                    const SlottedBuffer** slots) {
  const ModelStateBuffers& s = mem.model_state();
  *slots = nullptr;
  const BufferClass cls = b.cls;
  if (plan.options.offload_optimizer && b.kind == MemoryKind::kDevice) {
    switch (cls) {
      case BufferClass::kGrads:
        if (plan.options.stage >= 2) return s.kept.grads;
        break;
      case BufferClass::kMaster:  // fp32, or a compact master's bf16 copy
        return s.kept.master != nullptr ? reinterpret_cast<const char*>(s.kept.master)
                                        : reinterpret_cast<const char*>(s.kept.master_bf16);
      case BufferClass::kMasterRemainder: return reinterpret_cast<const char*>(s.kept.remainder);
      case BufferClass::kExpAvg: return s.kept.m;
      case BufferClass::kExpAvgSq: return s.kept.v;
      case BufferClass::kGradAccumulator: return s.kept.accum;
      default: break;
    }
  }
  switch (cls) {
    case BufferClass::kParams: return s.params;
    case BufferClass::kGrads: return s.grads;
    case BufferClass::kMaster:  // fp32, or a compact master's bf16 copy
      return s.master != nullptr ? reinterpret_cast<const char*>(s.master)
                                 : reinterpret_cast<const char*>(s.master_bf16);
    case BufferClass::kMasterRemainder: return reinterpret_cast<const char*>(s.remainder);
    case BufferClass::kExpAvg: return s.m;
    case BufferClass::kExpAvgSq: return s.v;
    case BufferClass::kGradAccumulator: return s.accum;
    case BufferClass::kGradWire: return reinterpret_cast<const char*>(mem.grad_wire());
    case BufferClass::kGradLocal: return mem.grad_local();
    case BufferClass::kGradAccumStage: return mem.grad_accum_stage();
    case BufferClass::kNormPartials: return reinterpret_cast<const char*>(mem.norm_partials());
    case BufferClass::kGradBucket: *slots = &mem.grad_buckets(); break;
    case BufferClass::kGatherBuffer: *slots = &mem.gather_slots(); break;
    case BufferClass::kPersistentParams: return mem.persistent();
    case BufferClass::kOffloadStaging: *slots = &mem.staging(); break;
    case BufferClass::kNormTable: return reinterpret_cast<const char*>(mem.norm_table());
    case BufferClass::kNvmeStaging: *slots = &mem.nvme_staging(); break;
    case BufferClass::kNvmeParamBuffers: *slots = &mem.nvme_param_buffers(); break;
    case BufferClass::kHpzSecondary: return mem.hpz_secondary();
    case BufferClass::kGatherStage: return mem.gather_stage();
    case BufferClass::kNvmeSecondCopy:
    case BufferClass::kNvmeParamPadding: return nullptr;  // file regions
  }
  return (*slots)->base;
}

bool HasClass(const memory::Plan& plan, BufferClass cls) {
  for (const memory::Buffer& b : plan.buffers) {
    if (b.cls == cls && b.bytes > 0) return true;
  }
  return false;
}

// `cpu` and `stream`: where Allocate zero-fills (default: inline, on the calling thread).
void CheckCarving(const memory::Plan& plan, Device* cpu = nullptr,
                  Device::Stream stream = nullptr) {
  std::unique_ptr<Device> own;
  if (cpu == nullptr) {
    own = testing::OneThreadCpuDevice();
    cpu = own.get();
  }
  DirtyDevice dev(cpu);
  absl::StatusOr<std::unique_ptr<EngineMemory>> allocated =
      EngineMemory::Allocate(plan, &dev, stream);
  REQUIRE(allocated.ok());
  const EngineMemory& mem = **allocated;

  // Planned and allocated bytes per kind, against the plan's own buffer list.
  int64_t listed[memory::kNumMemoryKinds] = {0, 0, 0, 0};
  for (const memory::Buffer& b : plan.buffers) listed[static_cast<int>(b.kind)] += b.bytes;
  for (int k = 0; k < memory::kNumMemoryKinds; ++k) {
    INFO("memory kind " << memory::MemoryKindName(static_cast<MemoryKind>(k)));
    CHECK(mem.bytes().planned[k] == listed[k]);
    CHECK(mem.bytes().planned[k] == plan.bytes_by_kind[k]);
    if (k != static_cast<int>(MemoryKind::kNvme)) CHECK(mem.bytes().allocated[k] == listed[k]);
  }
  // Nothing of a memory kind the plan does not use is allocated.
  for (int k = 0; k < memory::kNumMemoryKinds; ++k) {
    if (listed[k] == 0 || k == static_cast<int>(MemoryKind::kNvme)) {
      CHECK(dev.of(static_cast<MemoryKind>(k)).blocks.empty());
    }
  }

  std::map<std::pair<BufferClass, MemoryKind>, int> seen;
  std::vector<std::pair<const char*, const char*>> spans;  // [begin, end) of every buffer
  for (const memory::Buffer& b : plan.buffers) {
    INFO("buffer " << b.name << " (" << b.bytes << " bytes in "
                   << memory::MemoryKindName(b.kind) << ")");
    // One buffer per class and memory kind: the accessors are unambiguous (two of a class
    // only with partial offload: the offloaded part's and the part kept on the device).
    REQUIRE(++seen[{b.cls, b.kind}] == 1);
    const SlottedBuffer* slots = nullptr;
    const char* p = Pointer(mem, plan, b, &slots);
    if (b.kind == MemoryKind::kNvme) {
      CHECK(p == nullptr);  // in the swap file, not in memory
      continue;
    }
    if (slots != nullptr) {
      CHECK(slots->count == b.count);
      // Slots tile the buffer: each starts where the one before ends, and the last ends with
      // the buffer, whether they are equal or of two size classes.
      int64_t end = 0;
      for (int s = 0; s < slots->count; ++s) {
        CHECK(slots->offset(s) == end);
        CHECK(slots->size(s) == (b.slot_elements.empty() ? b.elements / b.count
                                                          : b.slot_elements[s]));
        end += slots->size(s);
      }
      CHECK(end == b.elements);
      CHECK(end * static_cast<int64_t>(DTypeSize(b.dtype)) == b.bytes);
    }
    if (b.bytes == 0) continue;
    REQUIRE(p != nullptr);
    const size_t bytes = static_cast<size_t>(b.bytes);
    CHECK(dev.of(b.kind).Holds(p, bytes));
    CHECK(std::all_of(p, p + bytes, [](char c) { return c == 0; }));
    spans.push_back({p, p + bytes});
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) CHECK(spans[i - 1].second <= spans[i].first);
}

struct Variant {
  const char* name;
  int min_stage;
  void (*apply)(memory::PlanOptions*);
};

TEST_CASE("EngineMemory: carves exactly the plan's buffers, zero-filled, in their kind's arena",
          "[zero]") {
  const Variant variants[] = {
      {"in device memory", 0, [](memory::PlanOptions*) {}},
      {"accumulating in fp32", 0,
       [](memory::PlanOptions* o) {
         o->gradient_accumulation_steps = 3;
         o->fp32_grad_accum = o->compute_dtype != DType::kF32;
         o->fp32_grad_comm = o->compute_dtype != DType::kF32;
       }},
      {"optimizer offloaded (pinned)", 1,
       [](memory::PlanOptions* o) { o->offload_optimizer = true; }},
      {"optimizer offloaded, accumulating in fp32 (gradient offload's stage)", 1,
       [](memory::PlanOptions* o) {
         o->offload_optimizer = true;
         o->gradient_accumulation_steps = 2;
         o->fp32_grad_accum = o->compute_dtype != DType::kF32;
       }},
      {"optimizer offloaded (pageable)", 1,
       [](memory::PlanOptions* o) {
         o->offload_optimizer = true;
         o->pin_memory = false;
       }},
      {"optimizer and parameters offloaded", 3,
       [](memory::PlanOptions* o) {
         o->offload_optimizer = true;
         o->offload_param = true;
       }},
      {"optimizer half offloaded (offload_optimizer.ratio 0.5)", 1,
       [](memory::PlanOptions* o) {
         o->offload_optimizer = true;
         o->offload_optimizer_ratio = 0.5;
         o->gradient_accumulation_steps = 2;
       }},
      {"optimizer offloaded at ratio 0: every unit kept on the device", 1,
       [](memory::PlanOptions* o) {
         o->offload_optimizer = true;
         o->offload_optimizer_ratio = 0;
       }},
      {"optimizer state partly on NVMe (ratio 0.5)", 1,
       [](memory::PlanOptions* o) {
         o->offload_optimizer = true;
         o->offload_optimizer_nvme = true;
         o->offload_optimizer_ratio = 0.5;
       }},
      {"optimizer state on NVMe", 1,
       [](memory::PlanOptions* o) {
         o->offload_optimizer = true;
         o->offload_optimizer_nvme = true;
       }},
      {"parameters on NVMe", 3,
       [](memory::PlanOptions* o) {
         o->offload_param = true;
         o->offload_param_nvme = true;
         o->offload_param_buffer_count = 3;
       }},
      {"optimizer state and parameters on NVMe", 3,
       [](memory::PlanOptions* o) {
         o->offload_optimizer = true;
         o->offload_optimizer_nvme = true;
         o->offload_param = true;
         o->offload_param_nvme = true;
       }},
  };
  // Compact optimizer state (bf16 only; docs/compact_state.md): each master form, with fp32 and
  // bf16 moments, and the moments alone.
  struct Form {
    memory::MasterForm master;
    DType moments;
  };
  const Form forms[] = {{memory::MasterForm::kF32, DType::kF32},
                        {memory::MasterForm::kF32, DType::kBF16},
                        {memory::MasterForm::kBf16Remainder, DType::kF32},
                        {memory::MasterForm::kBf16Remainder, DType::kBF16},
                        {memory::MasterForm::kBf16Stochastic, DType::kF32},
                        {memory::MasterForm::kBf16Stochastic, DType::kBF16}};
  for (const Variant& v : variants) {
    for (int stage = v.min_stage; stage <= 3; ++stage) {
      for (DType dtype : {DType::kBF16, DType::kF32}) {
        for (const Form& f : forms) {
          const bool compact = f.master != memory::MasterForm::kF32 || f.moments != DType::kF32;
          if (compact && dtype != DType::kBF16) continue;
          for (int world : {1, 3}) {
            INFO(v.name << ", stage " << stage << ", " << DTypeName(dtype) << ", master "
                        << memory::MasterFormName(f.master) << ", moments "
                        << DTypeName(f.moments) << ", rank " << world - 1 << " of " << world);
            memory::PlanOptions o = SmallPlan(stage, world, world - 1, 1, dtype).options;
            v.apply(&o);
            o.master_form = f.master;
            o.moment_dtype = f.moments;
            const absl::StatusOr<memory::Plan> plan =
                memory::MakePlan(testing::SmallModel(), o);
            // A compact master with the parameters on NVMe is refused, naming the key.
            if (f.master != memory::MasterForm::kF32 && o.offload_param_nvme) {
              REQUIRE(!plan.ok());
              CHECK(plan.status().message().find("nvme") != absl::string_view::npos);
              continue;
            }
            REQUIRE(plan.ok());
            CheckCarving(*plan);
          }
        }
      }
    }
  }
}

TEST_CASE("EngineMemory: carves hpZ's secondary blocks and the hierarchical gather's stage",
          "[zero]") {
  // World 4 on nodes of 2: hpZ over each node (stage 3), and shard groups of the whole world
  // gathered across nodes first (stages 1-3).
  for (int rank : {0, 3}) {
    memory::PlanOptions hpz = SmallPlan(3, 4, rank).options;
    hpz.hpz_partition_size = 2;
    hpz.ranks_per_node = 2;
    INFO("hpZ, rank " << rank);
    const absl::StatusOr<memory::Plan> plan = memory::MakePlan(testing::SmallModel(), hpz);
    REQUIRE(plan.ok());
    REQUIRE(HasClass(*plan, BufferClass::kHpzSecondary));
    CheckCarving(*plan);
    for (int stage = 1; stage <= 3; ++stage) {
      memory::PlanOptions mics = SmallPlan(stage, 4, rank).options;
      mics.shard_group_size = 4;
      mics.hierarchical_gather = true;
      mics.ranks_per_node = 2;
      INFO("hierarchical gather, stage " << stage << ", rank " << rank);
      const absl::StatusOr<memory::Plan> staged = memory::MakePlan(testing::SmallModel(), mics);
      REQUIRE(staged.ok());
      REQUIRE(HasClass(*staged, BufferClass::kGatherStage));
      CheckCarving(*staged);
    }
  }
}

TEST_CASE("EngineMemory: the zero-fills have landed when Allocate returns, on an asynchronous "
          "stream", "[zero][streams]") {
  // The host writes host and pinned buffers directly right after (NVMe state slots and
  // parameter buffers at creation and InitParams): a fill still in flight would overwrite what
  // it wrote. Every operation of the stream starts 2 ms late, so a fill that Allocate does not
  // wait for is still pending when the buffers are checked.
  CpuDeviceOptions options;
  options.threads = 1;
  options.async_streams = true;
  options.stream_delay_us = 2000;
  std::unique_ptr<Device> cpu = CreateCpuDevice(options);
  absl::StatusOr<Device::Stream> stream = cpu->CreateStream();
  REQUIRE(stream.ok());
  memory::PlanOptions o = SmallPlan(3, 1, 0, 1, DType::kBF16).options;
  o.offload_optimizer = true;
  o.offload_optimizer_nvme = true;
  o.offload_param = true;
  o.offload_param_nvme = true;
  const absl::StatusOr<memory::Plan> plan = memory::MakePlan(testing::SmallModel(), o);
  REQUIRE(plan.ok());
  CheckCarving(*plan, cpu.get(), *stream);
  cpu->DestroyStream(*stream);
}

TEST_CASE("SlottedBuffer: the indexed offsets and size classes answer as scans of the slots do",
          "[zero]") {
  // Size classes as the plan makes them: runs of equal slots, in any order of sizes.
  std::mt19937 rng(13);
  for (int trial = 0; trial < 200; ++trial) {
    SlottedBuffer b;
    const int classes = 1 + static_cast<int>(rng() % 5);
    for (int c = 0; c < classes; ++c) {
      const int64_t size = 128 * (1 + static_cast<int64_t>(rng() % 40));
      for (int k = 1 + static_cast<int>(rng() % 4); k > 0; --k) b.sizes.push_back(size);
    }
    b.count = static_cast<int>(b.sizes.size());
    b.elements = *std::max_element(b.sizes.begin(), b.sizes.end());
    SlottedBuffer indexed = b;
    indexed.Index();
    REQUIRE(indexed.offsets.size() == b.sizes.size());
    int64_t off = 0;
    for (int s = 0; s < b.count; ++s) {
      CAPTURE(trial, s);
      CHECK(indexed.offset(s) == off);  // the prefix sum, written here
      off += b.sizes[s];
      for (int64_t padded = 1; padded <= b.elements + 256; padded += 61) {
        // The smallest slot size that holds the unit, found here by a plain scan.
        int64_t want = 0;
        for (int64_t e : b.sizes) {
          if (e >= padded && (want == 0 || e < want)) want = e;
        }
        CHECK(indexed.ForUnit(s, padded) == (want != 0 && b.sizes[s] == want));
        CHECK(indexed.ForUnit(s, padded) ==
              (b.sizes[s] == memory::SlotClassElements(b.sizes, padded)));
      }
    }
  }
}

}  // namespace
}  // namespace zero_internal
}  // namespace zerort
