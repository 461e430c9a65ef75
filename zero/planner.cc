#include "zero/planner.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/bytes.h"
#include "base/status.h"

namespace zerort {
namespace {

// h: the smaller of the largest parameter's two largest dimensions, which is the hidden size
// of the usual transformer weights ((vocab, h) embeddings, (h, 4h) MLP, (h, h) projections).
int64_t HiddenSize(absl::Span<const memory::ParamSpec> specs) {
  const memory::ParamSpec* largest = nullptr;
  int64_t largest_numel = 0;
  for (const memory::ParamSpec& p : specs) {
    int64_t n = 1;
    for (int64_t d : p.shape) n *= d;
    if (n > largest_numel) largest = &p, largest_numel = n;
  }
  if (largest == nullptr) return 1;
  std::vector<int64_t> dims = largest->shape;
  std::sort(dims.rbegin(), dims.rend());
  if (dims.size() >= 2) return dims[1];
  return std::max<int64_t>(1, static_cast<int64_t>(std::sqrt(static_cast<double>(dims[0]))));
}

// The elements of the largest module (consecutive parameters with one module name).
int64_t LargestModule(absl::Span<const memory::ParamSpec> specs) {
  int64_t largest = 0, current = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (i > 0 && specs[i].module != specs[i - 1].module) current = 0;
    int64_t n = 1;
    for (int64_t d : specs[i].shape) n *= d;
    current += n;
    largest = std::max(largest, current);
  }
  return largest;
}

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
  o.offload_param = c.zero.offload_param.device == OffloadDevice::kCpu;
  o.pin_memory = o.offload_param ? c.zero.offload_param.pin_memory
                                 : c.zero.offload_optimizer.pin_memory;
  o.offload_buffer_count = c.zero.offload_optimizer.buffer_count;
  o.gradient_accumulation_steps = c.gradient_accumulation_steps;
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

UnitSizes ResolveUnitSizes(absl::Span<const memory::ParamSpec> specs, const Config& config) {
  const ZeroConfig& z = config.zero;
  UnitSizes out;
  out.hidden = HiddenSize(specs);
  const int64_t h = out.hidden;
  // h * h overflows int64 only for h > 3e9, far beyond any dimension a model has.
  std::vector<std::string> derived;
  auto resolve = [&](int64_t written, int64_t from_h, const char* key, const char* rule) {
    if (written != kAutoSize) return written;
    derived.push_back(absl::StrCat(key, " = ", rule, " = ", from_h));
    return from_h;
  };
  // A unit is also the stage-3 gather unit and trainers gather a module at a time: a unit
  // smaller than a module would split it, and its Fetch would need several gather slots at once
  // (the example GPT's 8h*h MLP module across 4 h*h units). So units never go below the largest
  // module; in GPT-2 and Llama that is the embedding or an MLP, which sizes the largest unit
  // (hence buckets and gather slots) anyway.
  out.largest_module = LargestModule(specs);
  out.reduce_bucket_size =
      resolve(z.reduce_bucket_size, std::max<int64_t>({1, h * h, out.largest_module}),
              "reduce_bucket_size", "max(h*h, largest module)");
  out.prefetch_bucket_size = resolve(z.stage3_prefetch_bucket_size,
                                     static_cast<int64_t>(0.9 * static_cast<double>(h * h)),
                                     "stage3_prefetch_bucket_size", "0.9*h*h");
  out.persistence_threshold = resolve(z.stage3_param_persistence_threshold, 10 * h,
                                      "stage3_param_persistence_threshold", "10*h");
  if (!derived.empty()) {
    out.reason = absl::StrCat("\"auto\" unit sizes from the hidden size h = ", h,
                              " (the largest parameter's smaller dimension): ",
                              absl::StrJoin(derived, ", "), " elements");
  }
  return out;
}

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
