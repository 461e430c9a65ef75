#include "zero/testing/handoff_trainer.h"

#include <algorithm>
#include <memory>
#include <numeric>
#include <string>
#include <utility>

#include "base/dtype.h"
#include "base/status.h"
#include "memory/testing/llmc_tensors.h"
#include "zero/testing/synthetic_trainer.h"

namespace zerort {
namespace testing {

std::vector<memory::ParamSpec> MiniLlmc(bool declared) {
  return memory::testing::LlmcTensors(/*L=*/2, /*C=*/8, /*V=*/40, /*T=*/6,
                                      declared ? "grads" : "");
}

namespace {

// The trainer's gradient buffer, from the device's allocator (device memory on a GPU).
class DeviceBuffer {
 public:
  static absl::StatusOr<DeviceBuffer> Allocate(Device* device, size_t bytes) {
    memory::RawAllocator* a = device->allocator(memory::MemoryKind::kDevice);
    ASSIGN_OR_RETURN(void* p, a->Allocate(bytes));
    return DeviceBuffer(a, static_cast<char*>(p), bytes);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : a_(o.a_), p_(std::exchange(o.p_, nullptr)), bytes_(o.bytes_) {}
  ~DeviceBuffer() {
    if (p_ != nullptr) a_->Free(p_, bytes_);
  }
  char* data() const { return p_; }

 private:
  DeviceBuffer(memory::RawAllocator* a, char* p, size_t bytes) : a_(a), p_(p), bytes_(bytes) {}
  memory::RawAllocator* a_;
  char* p_;
  size_t bytes_;
};

}  // namespace

absl::StatusOr<HandoffRun> TrainHandoffRank(const Config& config, bool declared,
                                            bool forward_order, comm::Communicator* comm,
                                            Device* device, int steps, Device::Stream compute) {
  const std::vector<memory::ParamSpec> specs = MiniLlmc(declared);
  const int n = static_cast<int>(specs.size());
  const size_t cs = DTypeSize(config.compute_dtype);
  std::vector<int64_t> offset(n + 1, 0);  // llm.c's packing, in elements
  for (int i = 0; i < n; ++i) offset[i + 1] = offset[i] + specs[i].numel();
  // The trainer's buffer outlives the engine, which may still read it until its destructor.
  ASSIGN_OR_RETURN(DeviceBuffer grads, DeviceBuffer::Allocate(device, offset[n] * cs));
  EngineOptions options;
  options.compute_stream = compute;
  ASSIGN_OR_RETURN(std::unique_ptr<Engine> e,
                   Engine::Create(config, specs, comm, device, options));
  RETURN_IF_ERROR(SetInitValues(*e));
  const int r = comm->rank();
  const DType dtype = e->plan().options.compute_dtype;
  HandoffRun run;
  if (declared) {
    for (int i = 0; i < n; ++i) {
      ASSIGN_OR_RETURN(const bool direct, e->SetGradBuffer(i, grads.data() + offset[i] * cs));
      const bool planned =
          e->plan().units[e->unit_of(i)].grad_source == memory::GradSource::kInPlace;
      if (direct != planned) return absl::InternalError("SetGradBuffer disagrees with the plan");
      run.in_place += direct;
      if (i == 0) run.wte_in_place = direct;
    }
  }
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  if (!forward_order) std::reverse(order.begin(), order.end());
  std::vector<std::vector<char>> host;  // this micro-step's gradients until copied
  for (int step = 0; step < steps; ++step) {
    for (int micro = 0; micro < config.gradient_accumulation_steps; ++micro) {
      auto write = [&](int i) -> absl::Status {
        const int64_t numel = specs[i].numel();
        host.emplace_back(numel * cs);
        for (int64_t k = 0; k < numel; ++k) {
          StoreAs(dtype, host.back().data(), k, GradValue(r, step, micro, i, k));
        }
        void* dst = grads.data() + offset[i] * cs;
        if (!declared) {
          ASSIGN_OR_RETURN(dst, e->grad(i));
        }
        return e->device()->Copy(dst, host.back().data(), numel * cs, e->compute_stream());
      };
      if (forward_order) {
        for (int i : order) RETURN_IF_ERROR(write(i));
      }
      for (int i : order) {
        if (!forward_order) RETURN_IF_ERROR(write(i));
        RETURN_IF_ERROR(e->GradReady(i));
        if (step == 0 && micro == 0) run.reduced.push_back(e->reduced_units());
      }
      RETURN_IF_ERROR(e->Step().status());
      RETURN_IF_ERROR(e->device()->Synchronize(e->compute_stream()));
      host.clear();
    }
  }
  ASSIGN_OR_RETURN(run.master, e->GatherMasterWeights());
  run.report = e->memory_report();
  return run;
}

}  // namespace testing
}  // namespace zerort
