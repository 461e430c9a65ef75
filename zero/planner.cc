#include "zero/planner.h"

#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/bytes.h"
#include "base/status.h"

namespace zerort {
namespace {

memory::PlanOptions BaseOptions(const Config& c, int world_size, int rank) {
  memory::PlanOptions o;
  o.stage = c.zero.stage;
  o.world_size = world_size;
  o.rank = rank;
  o.compute_dtype = c.compute_dtype;
  o.offload_optimizer = c.zero.offload_optimizer.device == OffloadDevice::kCpu;
  o.offload_param = c.zero.offload_param.device == OffloadDevice::kCpu;
  o.pin_memory = o.offload_param ? c.zero.offload_param.pin_memory
                                 : c.zero.offload_optimizer.pin_memory;
  o.offload_buffer_count = c.zero.offload_optimizer.buffer_count;
  o.gradient_accumulation_steps = c.gradient_accumulation_steps;
  o.unit_target_elements = c.zero.reduce_bucket_size;
  o.persistence_threshold = c.zero.stage3_param_persistence_threshold;
  o.prefetch_elements = c.zero.stage3_prefetch_bucket_size;
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
  if (o.offload_optimizer && o.offload_param) {
    absl::StrAppend(&s, " + optimizer and parameter offload");
  } else if (o.offload_optimizer) {
    absl::StrAppend(&s, " + optimizer offload");
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

// Auto candidates in order of preference.
std::vector<memory::PlanOptions> Candidates(const memory::PlanOptions& base) {
  std::vector<memory::PlanOptions> out;
  for (int stage = 0; stage <= 3; ++stage) {
    memory::PlanOptions o = base;
    o.stage = stage;
    o.offload_optimizer = o.offload_param = false;
    out.push_back(o);
  }
  for (int stage = 1; stage <= 3; ++stage) {
    memory::PlanOptions o = base;
    o.stage = stage;
    o.offload_optimizer = true;
    o.offload_param = false;
    out.push_back(o);
  }
  memory::PlanOptions o = base;
  o.stage = 3;
  o.offload_optimizer = o.offload_param = true;
  out.push_back(o);
  return out;
}

}  // namespace

absl::StatusOr<memory::PlanOptions> PlanOptionsFromConfig(const Config& config, int world_size,
                                                          int rank) {
  if (config.zero.stage_auto) {
    return absl::InvalidArgumentError(
        "zero_optimization.stage is \"auto\": resolve it with ChoosePlan first");
  }
  return BaseOptions(config, world_size, rank);
}

absl::StatusOr<PlanChoice> ChoosePlan(absl::Span<const memory::ParamSpec> specs,
                                      const Config& config, int world_size, int rank) {
  const MemoryBudget& budget = config.zero.memory_budget;
  const memory::PlanOptions base = BaseOptions(config, world_size, rank);
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
  std::string rejected;
  memory::Plan smallest;  // the candidate needing the least device memory
  for (const memory::PlanOptions& o : Candidates(base)) {
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
    for (memory::PlanOptions o : Candidates(base)) {
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

}  // namespace zerort
