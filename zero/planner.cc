#include "zero/planner.h"

#include <limits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/bytes.h"
#include "base/status.h"

namespace zerort {
namespace {

memory::PlanOptions BaseOptions(absl::Span<const memory::ParamSpec> specs, const Config& c,
                                int world_size, int rank) {
  memory::PlanOptions o;
  o.stage = c.zero.stage;
  o.world_size = world_size;
  o.rank = rank;
  o.compute_dtype = c.compute_dtype;
  o.offload_optimizer = c.zero.offload_optimizer.device != OffloadDevice::kNone;
  o.offload_optimizer_nvme = c.zero.offload_optimizer.device == OffloadDevice::kNvme;
  o.nvme_piece_elements = c.zero.offload_param.buffer_size;  // the pinned buffers' size
  o.offload_param = c.zero.offload_param.device != OffloadDevice::kNone;
  o.offload_param_nvme = c.zero.offload_param.device == OffloadDevice::kNvme;
  o.offload_param_buffer_count = c.zero.offload_param.buffer_count;
  o.pin_memory = o.offload_param ? c.zero.offload_param.pin_memory
                                 : c.zero.offload_optimizer.pin_memory;
  o.offload_buffer_count = c.zero.offload_optimizer.buffer_count;
  o.gradient_accumulation_steps = c.gradient_accumulation_steps;
  // fp32 accumulation / reduction only change anything in mixed precision.
  const bool mixed = c.compute_dtype != DType::kF32;
  o.fp32_grad_accum = mixed && c.grad_accum_dtype == DType::kF32;
  o.fp32_grad_comm = mixed && c.communication_dtype == DType::kF32;
  const UnitSizes sizes = ResolveUnitSizes(specs, c);
  o.unit_target_elements = sizes.reduce_bucket_size;
  o.persistence_threshold = sizes.persistence_threshold;
  o.prefetch_elements = sizes.prefetch_bucket_size;
  o.max_live_elements = c.zero.stage3_max_live_parameters;
  return o;
}

// Pinned plus pageable host bytes, saturating: MakePlan bounds each total by 2^63-1, not their sum.
int64_t HostBytes(const memory::Plan& plan) {
  int64_t host;
  return __builtin_add_overflow(plan.pinned_host_bytes(), plan.host_bytes(), &host)
             ? std::numeric_limits<int64_t>::max()
             : host;
}

bool Fits(const memory::Plan& plan, const MemoryBudget& budget) {
  const int64_t host = HostBytes(plan);
  return (budget.device_bytes == 0 || plan.device_bytes() <= budget.device_bytes) &&
         (budget.host_bytes == 0 || host <= budget.host_bytes);
}

std::string Describe(const memory::PlanOptions& o) {
  std::string s = absl::StrCat("stage ", o.stage);
  const char* where = o.offload_optimizer_nvme ? " (optimizer state on NVMe)" : "";
  if (o.offload_optimizer && o.offload_param) {
    absl::StrAppend(&s, " + optimizer and parameter offload", where);
  } else if (o.offload_optimizer) {
    absl::StrAppend(&s, " + optimizer offload", where);
  }
  return s;
}

std::string Needs(const memory::Plan& plan) {
  return absl::StrCat(HumanBytes(plan.device_bytes()), " device + ", HumanBytes(HostBytes(plan)),
                      " host per rank");
}

std::string BudgetText(const MemoryBudget& b) {
  return absl::StrCat(b.device_bytes ? HumanBytes(b.device_bytes) : "unlimited", " device, ",
                      b.host_bytes ? HumanBytes(b.host_bytes) : "unlimited", " host");
}

// Auto candidates in order of preference: no offload, optimizer offload to host memory, then
// (with `nvme`: offload_optimizer.nvme_path names a directory) the optimizer state on NVMe,
// which needs only its pinned slots of host memory.
std::vector<memory::PlanOptions> Candidates(const memory::PlanOptions& base, bool nvme) {
  std::vector<memory::PlanOptions> out;
  auto add = [&](int stage, bool optimizer, bool param, bool on_nvme) {
    memory::PlanOptions o = base;
    o.stage = stage;
    o.offload_optimizer = optimizer;
    o.offload_param = param;
    o.offload_optimizer_nvme = on_nvme;
    o.offload_param_nvme = false;
    out.push_back(o);
  };
  for (int stage = 0; stage <= 3; ++stage) add(stage, false, false, false);
  for (int stage = 1; stage <= 3; ++stage) add(stage, true, false, false);
  add(3, true, true, false);
  if (nvme) {
    for (int stage = 1; stage <= 3; ++stage) add(stage, true, false, true);
    add(3, true, true, true);
  }
  return out;
}

}  // namespace

absl::StatusOr<memory::PlanOptions> PlanOptionsFromConfig(absl::Span<const memory::ParamSpec> specs,
                                                          const Config& config, int world_size,
                                                          int rank) {
  if (config.zero.stage_auto) {
    return absl::InvalidArgumentError(
        "zero_optimization.stage is \"auto\": resolve it with ChoosePlan first");
  }
  return BaseOptions(specs, config, world_size, rank);
}

namespace {

// The explicit stage's plan, or auto's choice, from options with the unit sizes resolved.
absl::StatusOr<PlanChoice> ChooseStage(absl::Span<const memory::ParamSpec> specs,
                                       const Config& config, const memory::PlanOptions& base,
                                       int world_size) {
  const MemoryBudget& budget = config.zero.memory_budget;
  if (!config.zero.stage_auto) {
    PlanChoice choice;
    ASSIGN_OR_RETURN(choice.plan, memory::MakePlan(specs, base));
    choice.fits = Fits(choice.plan, budget);
    choice.reason = absl::StrCat(Describe(base), " from the config: ", Needs(choice.plan));
    if (budget.device_bytes || budget.host_bytes) {
      absl::StrAppend(&choice.reason, choice.fits ? ", within" : ", OVER", " the budget of ",
                      BudgetText(budget));
    }
    return choice;
  }
  if (budget.device_bytes == 0) {
    return absl::InvalidArgumentError(
        "zero_optimization.stage is \"auto\" but zero_optimization.memory_budget.device_bytes is "
        "not set: auto needs a device budget to choose against");
  }
  const bool nvme = !config.zero.offload_optimizer.nvme_path.empty();
  std::string rejected;
  memory::Plan smallest;  // the candidate needing the least device memory
  for (const memory::PlanOptions& o : Candidates(base, nvme)) {
    ASSIGN_OR_RETURN(memory::Plan plan, memory::MakePlan(specs, o));
    if (Fits(plan, budget)) {
      PlanChoice choice;
      choice.reason = absl::StrCat("auto chose ", Describe(o), ": it needs ", Needs(plan),
                                   ", within the budget of ", BudgetText(budget));
      if (!rejected.empty()) absl::StrAppend(&choice.reason, "; rejected: ", rejected);
      choice.plan = std::move(plan);
      return choice;
    }
    absl::StrAppend(&rejected, rejected.empty() ? "" : "; ", Describe(o), " needs ", Needs(plan));
    if (smallest.buffers.empty() || plan.device_bytes() < smallest.device_bytes()) {
      smallest = std::move(plan);
    }
  }
  // Nothing fits: say what the smallest configuration needs and at what world size one would.
  std::string would_fit;
  // int64: world_size * 2 overflows an int for worlds from 2^30 up.
  for (int64_t world = int64_t{world_size} * 2; world <= 65536 && would_fit.empty(); world *= 2) {
    for (memory::PlanOptions o : Candidates(base, nvme)) {
      o.world_size = static_cast<int>(world);
      o.rank = 0;
      ASSIGN_OR_RETURN(memory::Plan plan, memory::MakePlan(specs, o));
      if (Fits(plan, budget)) {
        would_fit = absl::StrCat("it would fit on ", world, " ranks with ", Describe(o), " (",
                                 Needs(plan), ")");
        break;
      }
    }
  }
  if (would_fit.empty()) {
    would_fit = absl::StrCat(
        "no world size up to 65536 fits either: a single unit of ", smallest.max_unit_elements,
        " elements must fit whole on the device (lower zero_optimization.reduce_bucket_size to "
        "split units)");
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "no stage fits the memory budget of ", BudgetText(budget), " on ", world_size,
      " ranks: the smallest requirement found is ", Needs(smallest), " (",
      Describe(smallest.options), "); ", would_fit, ". Considered: ", rejected));
}

}  // namespace

absl::StatusOr<PlanChoice> ChoosePlan(absl::Span<const memory::ParamSpec> specs,
                                      const Config& config, int world_size, int rank) {
  const memory::PlanOptions base = BaseOptions(specs, config, world_size, rank);
  ASSIGN_OR_RETURN(PlanChoice choice, ChooseStage(specs, config, base, world_size));
  const std::string sizes = ResolveUnitSizes(specs, config).reason;
  if (!sizes.empty()) absl::StrAppend(&choice.reason, "; ", sizes);
  return choice;
}

}  // namespace zerort
