#include "zero/planner.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "base/bytes.h"
#include "base/saturating.h"
#include "base/status.h"
#include "zero/hyperparams.h"

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
  o.offload_optimizer_ratio = c.zero.offload_optimizer.ratio;
  // DeepSpeed accepts 0 for the counts and sizes below (ge=0): the least that runs, one buffer,
  // one element, one unit per parameter, one gather slot, is what 0 asks for here.
  o.nvme_piece_elements = std::max<int64_t>(1, c.zero.offload_param.buffer_size);
  o.offload_param = c.zero.offload_param.device != OffloadDevice::kNone;
  o.offload_param_nvme = c.zero.offload_param.device == OffloadDevice::kNvme;
  o.offload_param_buffer_count = std::max(1, c.zero.offload_param.buffer_count);
  o.pin_memory = o.offload_param ? c.zero.offload_param.pin_memory
                                 : c.zero.offload_optimizer.pin_memory;
  o.offload_buffer_count = std::max(1, c.zero.offload_optimizer.buffer_count);
  o.gradient_accumulation_steps = c.gradient_accumulation_steps;
  // fp32 accumulation / reduction only change anything in mixed precision.
  const bool mixed = c.compute_dtype != DType::kF32;
  o.fp32_grad_accum = mixed && c.grad_accum_dtype == DType::kF32;
  o.fp32_grad_comm = mixed && c.communication_dtype == DType::kF32;
  o.local_grad_accumulation = c.local_grad_accumulation;
  o.master_form = c.store_param_remainders          ? memory::MasterForm::kBf16Remainder
                  : c.bf16_master_weights_and_grads ? memory::MasterForm::kBf16Stochastic
                                                    : memory::MasterForm::kF32;
  o.moment_dtype = c.bf16_optimizer_states ? DType::kBF16 : DType::kF32;
  const UnitSizes sizes = ResolveUnitSizes(specs, c);
  o.unit_target_elements = std::max<int64_t>(1, sizes.reduce_bucket_size);
  o.unit_per_module = sizes.per_module;
  o.persistence_threshold = sizes.persistence_threshold;
  o.prefetch_elements = sizes.prefetch_bucket_size;
  o.max_live_elements = std::max<int64_t>(1, c.zero.stage3_max_live_parameters);
  o.shard_group_size = std::max(0, c.zero.mics_shard_size);  // -1 and 0: flat
  o.hpz_partition_size = c.zero.zero_hpz_partition_size;
  o.hierarchical_gather = c.zero.mics_hierarchical_params_gather;
  o.ranks_per_node = c.ranks_per_node;
  return o;
}

// Pinned plus pageable host bytes, saturating: MakePlan bounds each total by 2^63-1, not their sum.
int64_t HostBytes(const memory::Plan& plan) {
  return SatAdd(plan.pinned_host_bytes(), plan.host_bytes());
}

// A plan with its device budget: what every decision below compares.
struct Evaluated {
  memory::Plan plan;
  DeviceBudget budget;
};

bool HostFits(const memory::Plan& plan, const MemoryBudget& budget) {
  return budget.host_bytes == 0 || HostBytes(plan) <= budget.host_bytes;
}

bool DeviceFits(const DeviceBudget& d, const MemoryBudget& budget) {
  return budget.device_bytes == 0 || d.total_bytes <= budget.device_bytes;
}

bool Fits(const Evaluated& e, const MemoryBudget& budget) {
  return DeviceFits(e.budget, budget) && HostFits(e.plan, budget);
}

// Which term put an over-budget total over: "model state" when it is over alone; else the term
// without which it would have fit ("activations" or "reserves"), "activations and reserves" when
// either or only both would have to go. Counterfactual rather than cumulative, so that the answer
// does not depend on the order the terms are added in. "" when the total fits.
std::string DecidingTerm(const DeviceBudget& d, const MemoryBudget& budget) {
  const int64_t limit = budget.device_bytes;
  if (limit == 0 || d.total_bytes <= limit) return "";
  if (d.model_state_bytes > limit) return "model state";
  const bool fits_without_activations = SatAdd(d.model_state_bytes, d.reserve_bytes) <= limit;
  const bool fits_without_reserves = SatAdd(d.model_state_bytes, d.activation_bytes) <= limit;
  if (fits_without_activations != fits_without_reserves) {
    return fits_without_activations ? "activations" : "reserves";
  }
  return "activations and reserves";
}

std::string Describe(const memory::PlanOptions& o) {
  std::string s = absl::StrCat("stage ", o.stage);
  const char* where = o.offload_optimizer_nvme ? " (optimizer state on NVMe)" : "";
  if (o.offload_optimizer && o.offload_param) {
    absl::StrAppend(&s, " + optimizer and parameter offload", where);
  } else if (o.offload_optimizer) {
    absl::StrAppend(&s, " + optimizer offload", where);
  }
  if (o.offload_optimizer && o.offload_optimizer_ratio < 1) {
    absl::StrAppend(&s, " (offload_optimizer.ratio ", o.offload_optimizer_ratio, ")");
  }
  // A compact optimizer-state form (docs/compact_state.md) is named with its bytes.
  // HSDP (mics_shard_size without the hierarchical gather); hpZ and MiCS are the config's.
  if (memory::Hierarchical(o) && !o.hierarchical_gather) {
    absl::StrAppend(&s, " in shard groups of ", o.shard_group_size, " (HSDP)");
  }
  if (memory::StateFormOf(o).compact()) {
    absl::StrAppend(&s, " (", memory::StateFormDescription(o), ")");
  }
  return s;
}

// "43.8% of the optimizer state offloaded, 56.2% (12 of 32 units, 1.02 GiB) kept on the device".
std::string SplitText(const memory::Plan& plan) {
  int kept = 0, trainable = 0;
  for (const memory::Unit& u : plan.units) {
    if (u.frozen) continue;
    ++trainable;
    if (!u.offloaded) ++kept;
  }
  const double achieved = plan.offload_ratio_achieved();
  return absl::StrFormat(
      "%.1f%% of the optimizer state offloaded, %.1f%% (%d of %d units, %s) kept on the device",
      100 * achieved, 100 * (1 - achieved), kept, trainable, HumanBytes(plan.device_state_bytes));
}

// Without counted activations, the wording of model-state-only planning, unchanged.
std::string Needs(const Evaluated& e) {
  const DeviceBudget& d = e.budget;
  std::string device = HumanBytes(d.total_bytes);
  if (d.counted) {
    device = absl::StrCat(HumanBytes(d.model_state_bytes), " model state + ",
                          HumanBytes(d.activation_bytes), " activations + ",
                          HumanBytes(d.reserve_bytes), " reserves = ", device);
  }
  return absl::StrCat(device, " device + ", HumanBytes(HostBytes(e.plan)), " host per rank");
}

std::string BudgetText(const MemoryBudget& b) {
  return absl::StrCat(b.device_bytes ? HumanBytes(b.device_bytes) : "unlimited", " device, ",
                      b.host_bytes ? HumanBytes(b.host_bytes) : "unlimited", " host");
}

// The shard groups auto chooses between, smallest first; {0} (the config's layout) when it
// chooses none. Over several nodes (zerort.ranks_per_node L known, 1 < L < world) and with no
// layout in the config (mics_shard_size, zero_hpz_partition_size and the hierarchical gather
// unset), the candidates are the multiples of L that divide the world, then the world itself
// (0: flat). A smaller group sends fewer bytes between nodes at every stage (HSDP in node-sized
// groups crosses nodes only with the all-reduce of its 1/L shard: docs/architecture.md, section
// 4) and holds more state per rank, which the budget decides.
std::vector<int> ShardGroups(const memory::PlanOptions& base) {
  const int L = base.ranks_per_node, N = base.world_size;
  if (L <= 1 || L >= N || base.shard_group_size > 0 || base.hpz_partition_size > 1 ||
      base.hierarchical_gather) {
    return {base.shard_group_size};
  }
  std::vector<int> groups;
  for (int g = L; g < N; g += L) {
    if (N % g == 0) groups.push_back(g);
  }
  groups.push_back(0);
  return groups;
}

// Auto candidates in order of preference: no offload, optimizer offload to host memory, then
// (with `nvme`: offload_optimizer.nvme_path names a directory) the optimizer state on NVMe,
// which needs only its pinned slots of host memory. Where auto chooses the shard group
// (ShardGroups), the candidates without offload and with optimizer offload are each tried at
// every group, smallest first, and stage 0 is left out: HSDP's stage 1 in the smallest group
// holds less than stage 0 and sends less between nodes, so stage 0 could never be preferred.
// Parameter offload and NVMe stay flat.
std::vector<memory::PlanOptions> Candidates(const memory::PlanOptions& base, bool nvme) {
  std::vector<memory::PlanOptions> out;
  const std::vector<int> groups = ShardGroups(base);
  const bool choose_group = groups.size() > 1;
  auto add = [&](int stage, bool optimizer, bool param, bool on_nvme, int group) {
    // Local accumulation needs the full gradients of stages 0-1.
    if (base.local_grad_accumulation && stage >= 2) return;
    memory::PlanOptions o = base;
    o.shard_group_size = group;
    // HSDP shards within groups, which stage 0 does not do.
    if (memory::Hierarchical(o) && stage == 0) return;
    o.stage = stage;
    o.offload_optimizer = optimizer;
    o.offload_param = param;
    o.offload_optimizer_nvme = on_nvme;
    o.offload_param_nvme = false;
    out.push_back(o);
  };
  const int flat = choose_group ? 0 : base.shard_group_size;
  for (int g : groups) {
    for (int stage = choose_group ? 1 : 0; stage <= 3; ++stage) add(stage, false, false, false, g);
  }
  for (int g : groups) {
    for (int stage = 1; stage <= 3; ++stage) add(stage, true, false, false, g);
  }
  add(3, true, true, false, flat);
  if (nvme) {
    for (int stage = 1; stage <= 3; ++stage) add(stage, true, false, true, flat);
    add(3, true, true, true, flat);
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

absl::StatusOr<DeviceBudget> MakeDeviceBudget(const memory::Plan& plan, const Config& config,
                                              const Workload& workload) {
  DeviceBudget d;
  d.model_state_bytes = plan.device_bytes();
  d.total_bytes = d.model_state_bytes;
  const bool declared = plan.activation_bytes_per_sample > 0;
  const bool formula = workload.shape.has_value() && workload.seq > 0;
  if (declared && workload.shape.has_value()) {
    return absl::InvalidArgumentError(
        "activations: the model declares activation_bytes_per_sample and a transformer shape was "
        "given for the formula too: give one");
  }
  if (workload.micro_batch < 0 || workload.seq < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "activations: micro-batch ", workload.micro_batch, " and sequence length ", workload.seq,
        " must be >= 0"));
  }
  if (!declared && !formula) {
    d.note = "activations and runtime reserves were not counted: the device figure is the "
             "model-state buffers alone";
    return d;
  }
  d.counted = true;
  d.micro_batch = workload.micro_batch > 0                     ? workload.micro_batch
                  : config.train_micro_batch_size_per_gpu > 0 ? config.train_micro_batch_size_per_gpu
                                                               : 1;
  if (formula) {
    ASSIGN_OR_RETURN(ActivationEstimate a,
                     TransformerActivations(*workload.shape, workload.seq, d.micro_batch,
                                            plan.options.compute_dtype, workload.recompute));
    d.activation_source = absl::StrCat(
        "Korthikanti et al. 2022 (sequence ", workload.seq, ", micro-batch ", d.micro_batch,
        ", recompute ", RecomputeName(workload.recompute), ", ",
        DTypeName(plan.options.compute_dtype), ")");
    for (const ActivationLine& line : a.lines) d.activations.push_back({line.name, line.bytes});
    d.activation_bytes = a.bytes;
  } else {
    d.activation_source = absl::StrCat("declared by the model: ", plan.activation_bytes_per_sample,
                                       " bytes per sample x micro-batch ", d.micro_batch);
    d.activation_bytes = SatMul(plan.activation_bytes_per_sample, d.micro_batch);
    d.activations.push_back({"declared", d.activation_bytes});
  }
  const ReservesConfig& r = config.reserves;
  const int64_t world = plan.options.world_size;
  // A single rank needs no communicator unless the trainer made one (Workload).
  const bool nccl = workload.nccl_communicator.value_or(world > 1);
  // NCCL's buffers are per peer connection (one ring neighbour each way at most).
  const int64_t peers = nccl ? std::min<int64_t>(world - 1, 2) : 0;
  const int64_t allocated = SatAdd(d.model_state_bytes, d.activation_bytes);
  // Rounded up; a double's rounding error is far below a byte's worth of margin at these sizes,
  // and ceil of a product of non-negative values is monotone in `allocated`, as --fit needs.
  const double fragmentation = std::ceil(r.fragmentation_fraction * static_cast<double>(allocated));
  d.reserves = {
      {"cuda context", r.cuda_context_bytes},
      {"nccl communicator", nccl ? r.nccl_communicator_bytes : 0},
      {"nccl buffers", SatMul(SatMul(r.nccl_channels, peers), r.nccl_buffsize)},
      {"cublas workspace", r.cublas_workspace_bytes},
      {"fragmentation", fragmentation >= 9.2e18 ? std::numeric_limits<int64_t>::max()
                                                : static_cast<int64_t>(fragmentation)},
  };
  for (const BudgetLine& line : d.reserves) d.reserve_bytes = SatAdd(d.reserve_bytes, line.bytes);
  d.total_bytes = SatAdd(allocated, d.reserve_bytes);
  return d;
}

namespace {

absl::StatusOr<Evaluated> Evaluate(absl::Span<const memory::ParamSpec> specs,
                                   const memory::PlanOptions& o, const Config& config,
                                   const Workload& workload) {
  Evaluated e;
  ASSIGN_OR_RETURN(e.plan, memory::MakePlan(specs, o));
  ASSIGN_OR_RETURN(e.budget, MakeDeviceBudget(e.plan, config, workload));
  return e;
}

// The grid "stage": "auto" chooses offload_optimizer.ratio on: multiples of 1/kRatioSteps, so
// that the ratio it reports is one a config can write and plan again to the same plan.
constexpr int kRatioSteps = 1000;

// Auto chose `chosen`, which offloads the optimizer state at the config's ratio (1, all of it,
// by default): lowers the ratio to the smallest multiple of 1/kRatioSteps whose plan still fits
// the budget, so that as much optimizer state as fits stays on the device (its update then
// needs no host AdamW and no copies). The device bytes only grow as the ratio falls (the
// units kept on the device are a first fit under a growing limit), so a bisection finds it.
// Returns what it did, for the reason, or "" when nothing more fits on the device.
absl::StatusOr<std::string> KeepOnDevice(absl::Span<const memory::ParamSpec> specs,
                                         const Config& config, const Workload& workload,
                                         Evaluated* chosen) {
  const MemoryBudget& budget = config.zero.memory_budget;
  memory::PlanOptions o = chosen->plan.options;
  const double asked = o.offload_optimizer_ratio;
  auto at = [&](int64_t k) -> absl::StatusOr<Evaluated> {
    o.offload_optimizer_ratio = static_cast<double>(k) / kRatioSteps;
    return Evaluate(specs, o, config, workload);
  };
  int64_t hi = static_cast<int64_t>(std::floor(asked * kRatioSteps));  // a grid point <= asked
  ASSIGN_OR_RETURN(Evaluated top, at(hi));
  if (!Fits(top, budget)) return std::string();
  Evaluated best = std::move(top);
  int64_t lo = 0;
  while (lo < hi) {  // the smallest k in [lo, hi] that fits; hi fits
    const int64_t mid = lo + (hi - lo) / 2;
    ASSIGN_OR_RETURN(Evaluated e, at(mid));
    if (Fits(e, budget)) {
      hi = mid;
      best = std::move(e);
    } else {
      lo = mid + 1;
    }
  }
  if (best.plan.device_state_elements == chosen->plan.device_state_elements) {
    return std::string();  // not one more unit fits on the device
  }
  const int64_t full = chosen->budget.total_bytes;
  std::string what = absl::StrCat(
      "offload_optimizer.ratio ", best.plan.options.offload_optimizer_ratio,
      " (auto; the config's ", asked, "): ", SplitText(best.plan), ", the most that fits: ",
      "it needs ", HumanBytes(best.budget.total_bytes), " device where offloading ", 
      asked == 1 ? "all of it" : "at the config's ratio", " needs ", HumanBytes(full));
  if (hi > 0) {
    ASSIGN_OR_RETURN(Evaluated next, at(hi - 1));
    if (next.plan.device_state_elements > best.plan.device_state_elements) {
      absl::StrAppend(&what, "; keeping the next unit (ratio ",
                      next.plan.options.offload_optimizer_ratio, ") needs ",
                      HumanBytes(next.budget.total_bytes), " device + ",
                      HumanBytes(HostBytes(next.plan)), " host, over the budget");
    }
  }
  *chosen = std::move(best);
  return what;
}

// " (activations decided)" when a device term put `e` over, else "".
std::string DecidedText(const std::string& term) {
  return term.empty() ? "" : absl::StrCat(" (", term, " decided)");
}

// The explicit stage's plan, or auto's choice, from options with the unit sizes resolved.
absl::StatusOr<PlanChoice> ChooseStage(absl::Span<const memory::ParamSpec> specs,
                                       const Config& config, const memory::PlanOptions& base,
                                       int world_size, const Workload& workload) {
  const MemoryBudget& budget = config.zero.memory_budget;
  if (!config.zero.stage_auto) {
    ASSIGN_OR_RETURN(Evaluated e, Evaluate(specs, base, config, workload));
    PlanChoice choice;
    choice.fits = Fits(e, budget);
    choice.decided_by = DecidingTerm(e.budget, budget);
    choice.reason = absl::StrCat(Describe(base), " from the config: ", Needs(e));
    if (budget.device_bytes || budget.host_bytes) {
      absl::StrAppend(&choice.reason, choice.fits ? ", within" : ", OVER", " the budget of ",
                      BudgetText(budget),
                      e.budget.counted ? DecidedText(choice.decided_by) : "");
    }
    choice.plan = std::move(e.plan);
    choice.budget = std::move(e.budget);
    return choice;
  }
  if (budget.device_bytes == 0) {
    return absl::InvalidArgumentError(
        "zero_optimization.stage is \"auto\" but zero_optimization.memory_budget.device_bytes is "
        "not set: auto needs a device budget to choose against");
  }
  const bool nvme = !config.zero.offload_optimizer.nvme_path.empty();
  std::string rejected;
  std::string last_term;  // the term that put the last rejected candidate over
  Evaluated smallest;     // the candidate needing the least device memory
  for (const memory::PlanOptions& o : Candidates(base, nvme)) {
    ASSIGN_OR_RETURN(Evaluated e, Evaluate(specs, o, config, workload));
    if (Fits(e, budget)) {
      // Offloading fits: keep as much of the optimizer state on the device as still fits.
      std::string kept;
      if (o.offload_optimizer) {
        ASSIGN_OR_RETURN(kept, KeepOnDevice(specs, config, workload, &e));
      }
      PlanChoice choice;
      choice.reason = absl::StrCat("auto chose ", Describe(e.plan.options), ": it needs ",
                                   Needs(e), ", within the budget of ", BudgetText(budget));
      if (!kept.empty()) absl::StrAppend(&choice.reason, "; ", kept);
      if (ShardGroups(base).size() > 1) {
        absl::StrAppend(&choice.reason, "; shard groups tried smallest first, from "
                        "zerort.ranks_per_node ", base.ranks_per_node, " (a smaller group sends "
                        "fewer bytes between nodes; set zero_optimization.mics_shard_size to "
                        "fix the layout)");
      }
      choice.decided_by = last_term;
      if (e.budget.counted && !last_term.empty()) {
        absl::StrAppend(&choice.reason, "; ", last_term, " decided");
      }
      if (!rejected.empty()) absl::StrAppend(&choice.reason, "; rejected: ", rejected);
      choice.plan = std::move(e.plan);
      choice.budget = std::move(e.budget);
      return choice;
    }
    last_term = DecidingTerm(e.budget, budget);
    absl::StrAppend(&rejected, rejected.empty() ? "" : "; ", Describe(o), " needs ", Needs(e),
                    e.budget.counted ? DecidedText(last_term) : "");
    if (smallest.plan.buffers.empty() || e.budget.total_bytes < smallest.budget.total_bytes) {
      smallest = std::move(e);
    }
  }
  // Nothing fits: say what the smallest configuration needs and at what world size one would.
  std::string would_fit;
  // int64: world_size * 2 overflows an int for worlds from 2^30 up.
  for (int64_t world = int64_t{world_size} * 2; world <= 65536 && would_fit.empty(); world *= 2) {
    for (memory::PlanOptions o : Candidates(base, nvme)) {
      o.world_size = static_cast<int>(world);
      o.rank = 0;
      ASSIGN_OR_RETURN(Evaluated e, Evaluate(specs, o, config, workload));
      if (Fits(e, budget)) {
        would_fit = absl::StrCat("it would fit on ", world, " ranks with ", Describe(o), " (",
                                 Needs(e), ")");
        break;
      }
    }
  }
  if (would_fit.empty()) {
    would_fit = smallest.budget.counted
                    ? absl::StrCat("no world size up to 65536 fits either: activations and "
                                   "reserves do not shrink with the world size (lower the "
                                   "micro-batch or sequence length, or recompute more), and a "
                                   "single unit of ", smallest.plan.max_unit_elements,
                                   " elements must fit whole on the device")
                    : absl::StrCat(
                          "no world size up to 65536 fits either: a single unit of ",
                          smallest.plan.max_unit_elements,
                          " elements must fit whole on the device (lower "
                          "zero_optimization.reduce_bucket_size to split units)");
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "no stage fits the memory budget of ", BudgetText(budget), " on ", world_size,
      " ranks: the smallest requirement found is ", Needs(smallest), " (",
      Describe(smallest.plan.options), "); ", would_fit, ". Considered: ", rejected));
}

}  // namespace

absl::StatusOr<PlanChoice> ChoosePlan(absl::Span<const memory::ParamSpec> specs,
                                      const Config& config, int world_size, int rank) {
  return ChoosePlan(specs, config, world_size, rank, Workload{});
}

absl::Status MarkFrozen(const Config& config, std::vector<memory::ParamSpec>* specs) {
  for (absl::string_view glob : absl::StrSplit(config.frozen_params, ',', absl::SkipEmpty())) {
    glob = absl::StripAsciiWhitespace(glob);
    bool matched = false;
    for (memory::ParamSpec& s : *specs) {
      if (!GlobMatch(glob, s.name)) continue;
      s.frozen = true;
      matched = true;
    }
    if (!matched && !glob.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "zerort.frozen_params: glob '", glob, "' matches no parameter name"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<PlanChoice> ChoosePlan(absl::Span<const memory::ParamSpec> specs,
                                      const Config& config, int world_size, int rank,
                                      const Workload& workload) {
  if (!config.frozen_params.empty()) {
    std::vector<memory::ParamSpec> marked(specs.begin(), specs.end());
    RETURN_IF_ERROR(MarkFrozen(config, &marked));
    Config rest = config;
    rest.frozen_params.clear();
    return ChoosePlan(marked, rest, world_size, rank, workload);
  }
  const memory::PlanOptions base = BaseOptions(specs, config, world_size, rank);
  ASSIGN_OR_RETURN(PlanChoice choice, ChooseStage(specs, config, base, world_size, workload));
  const std::string sizes = ResolveUnitSizes(specs, config).reason;
  if (!sizes.empty()) absl::StrAppend(&choice.reason, "; ", sizes);
  return choice;
}

absl::StatusOr<std::vector<MicroBatchFit>> FitMicroBatch(absl::Span<const memory::ParamSpec> specs,
                                                         const Config& config, int world_size,
                                                         int rank, const Workload& workload) {
  if (!config.frozen_params.empty()) {
    std::vector<memory::ParamSpec> marked(specs.begin(), specs.end());
    RETURN_IF_ERROR(MarkFrozen(config, &marked));
    Config rest = config;
    rest.frozen_params.clear();
    return FitMicroBatch(marked, rest, world_size, rank, workload);
  }
  const MemoryBudget& budget = config.zero.memory_budget;
  if (budget.device_bytes == 0) {
    return absl::InvalidArgumentError(
        "fitting the micro-batch needs zero_optimization.memory_budget.device_bytes (--budget)");
  }
  const memory::PlanOptions base = BaseOptions(specs, config, world_size, rank);
  const bool nvme = !config.zero.offload_optimizer.nvme_path.empty();
  std::vector<MicroBatchFit> out;
  for (const memory::PlanOptions& o : Candidates(base, nvme)) {
    MicroBatchFit fit;
    fit.options = o;
    fit.description = Describe(o);
    ASSIGN_OR_RETURN(memory::Plan plan, memory::MakePlan(specs, o));
    Workload w = workload;
    w.micro_batch = 1;
    ASSIGN_OR_RETURN(fit.budget, MakeDeviceBudget(plan, config, w));
    if (!fit.budget.counted) {
      return absl::InvalidArgumentError(
          "fitting the micro-batch needs activations: a sequence length with a transformer "
          "shape, or activation_bytes_per_sample declared by the model");
    }
    if (!HostFits(plan, budget)) {
      fit.why_none = absl::StrCat("host: ", HumanBytes(HostBytes(plan)), " over ",
                                  HumanBytes(budget.host_bytes));
    } else if (!DeviceFits(fit.budget, budget)) {
      fit.why_none = absl::StrCat(DecidingTerm(fit.budget, budget), " decided: ",
                                  HumanBytes(fit.budget.total_bytes), " at micro-batch 1");
    } else {
      // The total only grows with the micro-batch (activations are linear in it, the
      // fragmentation margin a rounded-up fraction of them): binary search for the last fit.
      // Activations at b are b times those at 1 (> 0 when counted), so no b above
      // budget / activations(1) fits; that bound also keeps every probe's count within int64.
      const int64_t per_sample = std::max<int64_t>(fit.budget.activation_bytes, 1);
      int64_t lo = 1;  // fits
      int64_t hi = std::min<int64_t>(int64_t{1} << 30, budget.device_bytes / per_sample);
      DeviceBudget at_lo = fit.budget;
      while (lo < hi) {
        const int64_t mid = lo + (hi - lo + 1) / 2;
        w.micro_batch = mid;
        ASSIGN_OR_RETURN(DeviceBudget d, MakeDeviceBudget(plan, config, w));
        if (DeviceFits(d, budget)) {
          lo = mid;
          at_lo = std::move(d);
        } else {
          hi = mid - 1;
        }
      }
      fit.micro_batch = lo;
      fit.budget = std::move(at_lo);
    }
    out.push_back(std::move(fit));
  }
  return out;
}

}  // namespace zerort
