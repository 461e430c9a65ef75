#include "memory/plan.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>

#include "absl/base/internal/raw_logging.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/saturating.h"

namespace zerort {
namespace memory {
namespace {

// Every size of a plan is computed through Checked: an overflow saturates at INT64_MAX (so that
// the divisions and comparisons after it stay defined) and records the first quantity that
// overflowed, which MakePlan returns instead of the plan. A plan never reports a wrapped,
// negative size, and "--stage auto" never takes one for a fit.
class Checked {
 public:
  int64_t Add(int64_t a, int64_t b, absl::string_view what) {
    int64_t r;
    return __builtin_add_overflow(a, b, &r) ? Fail(what) : r;
  }
  int64_t Mul(int64_t a, int64_t b, absl::string_view what) {
    int64_t r;
    return __builtin_mul_overflow(a, b, &r) ? Fail(what) : r;
  }
  // x rounded up to a multiple of m. REQUIRES: x >= 0, m >= 1.
  int64_t RoundUp(int64_t x, int64_t m, absl::string_view what) {
    return Mul(CeilDiv(x, m), m, what);
  }
  static int64_t CeilDiv(int64_t x, int64_t m) { return x / m + (x % m != 0 ? 1 : 0); }
  const absl::Status& status() const { return status_; }

 private:
  int64_t Fail(absl::string_view what) {
    if (status_.ok()) {
      status_ = absl::InvalidArgumentError(absl::StrCat(
          "the plan's ", what, " exceeds 2^63-1: the model, world size or options are too large "
          "to plan"));
    }
    return std::numeric_limits<int64_t>::max();
  }
  absl::Status status_;
};

// The config key that selects each compact choice, for the errors below.
const char* MasterFormKey(MasterForm form) {
  return form == MasterForm::kBf16Remainder ? "zerort.store_param_remainders"
                                            : "bf16.bf16_master_weights_and_grads";
}

// Compact optimizer state (docs/compact_state.md) keeps bf16 values beside bf16 parameters.
absl::Status ValidateStateForm(const PlanOptions& o) {
  const int form = static_cast<int>(o.master_form);
  if (form < 0 || form > 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan option master_form = ", form, " is not a MasterForm (0..2)"));
  }
  if (o.moment_dtype != DType::kF32 && o.moment_dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bf16.bf16_optimizer_states: moments in ", DTypeName(o.moment_dtype),
        " are not supported (fp32 or bf16)"));
  }
  const bool compact_master = o.master_form != MasterForm::kF32;
  if (o.compute_dtype != DType::kBF16 && (compact_master || o.moment_dtype != DType::kF32)) {
    const char* key = compact_master ? MasterFormKey(o.master_form) : "bf16.bf16_optimizer_states";
    return absl::InvalidArgumentError(absl::StrCat(
        key, " requires bf16 parameters (bf16.enabled), but the compute dtype is ",
        DTypeName(o.compute_dtype), ": the compact optimizer state keeps bf16 values"));
  }
  if (compact_master && o.offload_param_nvme) {
    return absl::InvalidArgumentError(absl::StrCat(
        MasterFormKey(o.master_form), " is not supported with zero_optimization.offload_param "
        "device \"nvme\" yet: the master would live in the parameter file; use offload_param "
        "\"cpu\" (or bf16.bf16_optimizer_states alone)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateOptions(const PlanOptions& o) {
  auto bad = [](absl::string_view what, auto value, absl::string_view range) {
    return absl::InvalidArgumentError(
        absl::StrCat("plan option ", what, " = ", value, " is out of range: expected ", range));
  };
  if (o.stage < 0 || o.stage > 3) return bad("stage", o.stage, "0..3");
  if (o.world_size < 1) return bad("world_size", o.world_size, ">= 1");
  if (o.rank < 0 || o.rank >= o.world_size) {
    return bad("rank", o.rank, absl::StrCat("0..", o.world_size - 1, " (world_size - 1)"));
  }
  if (o.offload_param && o.stage != 3) {
    return absl::InvalidArgumentError(absl::StrCat(
        "offload_param requires stage 3 (zero_optimization.stage is ", o.stage,
        "): parameters are only sharded in stage 3"));
  }
  if (o.offload_optimizer && o.stage == 0) {
    return absl::InvalidArgumentError(
        "offload_optimizer requires stage 1, 2 or 3 (zero_optimization.stage is 0): offload "
        "moves the sharded optimizer state");
  }
  if (o.offload_param_nvme && !o.offload_param) {
    return absl::InvalidArgumentError(
        "offload_param_nvme requires offload_param (the shard on NVMe is an offloaded shard)");
  }
  if (o.offload_param_nvme && o.offload_param_buffer_count < 1) {
    return bad("offload_param_buffer_count", o.offload_param_buffer_count, ">= 1");
  }
  // Written so that a NaN fails too.
  if (!(o.offload_optimizer_ratio >= 0 && o.offload_optimizer_ratio <= 1)) {
    return bad("offload_optimizer_ratio (offload_optimizer.ratio)", o.offload_optimizer_ratio,
               "[0, 1]");
  }
  if (o.offload_optimizer_nvme && !o.offload_optimizer) {
    return absl::InvalidArgumentError(
        "offload_optimizer_nvme requires offload_optimizer (the NVMe state is offloaded state)");
  }
  if (o.local_grad_accumulation && o.stage >= 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "zerort.local_grad_accumulation requires stage 0 or 1 (zero_optimization.stage is ",
        o.stage, "): stages 2-3 keep only a gradient shard, so every micro-step must reduce"));
  }
  if (o.offload_buffer_count < 1) return bad("offload_buffer_count", o.offload_buffer_count, ">= 1");
  if (o.gradient_accumulation_steps < 1) {
    return bad("gradient_accumulation_steps", o.gradient_accumulation_steps, ">= 1");
  }
  if (o.unit_target_elements < 1) return bad("unit_target_elements", o.unit_target_elements, ">= 1");
  if (o.shard_alignment < 1) return bad("shard_alignment", o.shard_alignment, ">= 1");
  if (o.shard_group_size < 0 || o.shard_group_size > o.world_size ||
      (o.shard_group_size > 0 && o.world_size % o.shard_group_size != 0)) {
    return bad("shard_group_size (mics_shard_size)", o.shard_group_size,
               absl::StrCat("a divisor of world_size ", o.world_size, " (or -1: flat)"));
  }
  if (Hierarchical(o) && o.stage == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "mics_shard_size ", o.shard_group_size, " requires stage 1, 2 or 3 (zero_optimization."
        "stage is 0): stage 0 shards nothing, so there is no group to shard within"));
  }
  if (o.ranks_per_node < 0 || (o.ranks_per_node > 0 && o.world_size % o.ranks_per_node != 0)) {
    return bad("ranks_per_node (zerort.ranks_per_node)", o.ranks_per_node,
               absl::StrCat("0 (not known) or a divisor of world_size ", o.world_size));
  }
  if (o.hpz_partition_size < 1 || o.world_size % o.hpz_partition_size != 0) {
    return bad("hpz_partition_size (zero_hpz_partition_size)", o.hpz_partition_size,
               absl::StrCat("a divisor of world_size ", o.world_size, " (1: off)"));
  }
  if (o.hpz_partition_size > 1) {
    const std::string k = absl::StrCat("zero_hpz_partition_size ", o.hpz_partition_size);
    if (o.stage != 3) {
      return absl::InvalidArgumentError(absl::StrCat(
          k, " requires stage 3 (zero_optimization.stage is ", o.stage,
          "): hpZ keeps a secondary partition of the stage-3 parameters"));
    }
    if (o.shard_group_size > 0 && o.shard_group_size < o.world_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          k, " with mics_shard_size ", o.shard_group_size, ": hpZ's primary partition is "
          "flat over the world; use one of the two"));
    }
    if (o.hierarchical_gather) {
      return absl::InvalidArgumentError(absl::StrCat(
          k, " with mics_hierarchical_params_gather: use one of the two"));
    }
    if (o.offload_param) {
      return absl::InvalidArgumentError(absl::StrCat(
          k, " with offload_param: not supported (the secondary partition would keep 1/",
          o.hpz_partition_size, " of the parameters on the device that offload_param moves "
          "off it); set zero_hpz_partition_size 1 or offload_param.device none"));
    }
  }
  if (o.hierarchical_gather) {
    const int G = o.shard_group_size, L = o.ranks_per_node;
    if (G <= 0 || o.stage == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "mics_hierarchical_params_gather requires mics_shard_size and stage 1, 2 or 3 "
          "(mics_shard_size is ", G, ", zero_optimization.stage ", o.stage, "): it splits the "
          "parameter all-gather within a MiCS shard group"));
    }
    if (L <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "mics_hierarchical_params_gather needs the ranks per node: set zerort.ranks_per_node "
          "(torchrun: $LOCAL_WORLD_SIZE; mpirun: $OMPI_COMM_WORLD_LOCAL_SIZE) with "
          "mics_shard_size ", G));
    }
    if (G <= L || G % L != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "mics_hierarchical_params_gather with mics_shard_size ", G, " and zerort.ranks_per_node ",
          L, ": the shard group must span whole nodes (a multiple of ranks_per_node larger "
          "than it); a group within one node has no across-node step"));
    }
  }
  if (absl::Status s = ValidateStateForm(o); !s.ok()) return s;
  if (o.param_alignment < 1) return bad("param_alignment", o.param_alignment, ">= 1");
  if (o.grad_bucket_count < 1) return bad("grad_bucket_count", o.grad_bucket_count, ">= 1");
  if (o.persistence_threshold < 0) return bad("persistence_threshold", o.persistence_threshold, ">= 0");
  if (o.prefetch_elements < 0) return bad("prefetch_elements", o.prefetch_elements, ">= 0");
  if (o.max_live_elements < 1) return bad("max_live_elements", o.max_live_elements, ">= 1");
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Numel(const ParamSpec& spec) {
  if (spec.shape.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter '", spec.name, "' has an empty shape: a scalar is {1}"));
  }
  int64_t n = 1;
  for (size_t d = 0; d < spec.shape.size(); ++d) {
    const int64_t dim = spec.shape[d];
    if (dim < 1) {
      return absl::InvalidArgumentError(absl::StrCat("parameter '", spec.name, "' dimension ", d,
                                                     " is ", dim, ": every dimension must be >= 1"));
    }
    if (n > (int64_t{1} << 50) / dim) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter '", spec.name, "' has more than 2^50 elements"));
    }
    n *= dim;
  }
  return n;
}

// Groups parameter indices by module in order of first appearance, then reverses the module
// order: backward produces the last module's gradients first.
std::vector<std::vector<int>> ModulesInBackwardOrder(absl::Span<const ParamSpec> specs) {
  std::vector<std::vector<int>> modules;
  absl::flat_hash_map<std::string, size_t> index;
  for (int i = 0; i < static_cast<int>(specs.size()); ++i) {
    auto [it, inserted] = index.emplace(specs[i].module, modules.size());
    if (inserted) modules.emplace_back();
    modules[it->second].push_back(i);
  }
  std::reverse(modules.begin(), modules.end());
  return modules;
}


// Elements of every parameter, in spec order; adds them up in plan->num_elements. Refuses a bad
// shape or a name registered twice.
absl::StatusOr<std::vector<int64_t>> CountElements(absl::Span<const ParamSpec> specs, Plan* plan,
                                                   Checked* math) {
  std::vector<int64_t> numel(specs.size());
  absl::flat_hash_set<absl::string_view> names;
  names.reserve(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    auto n = Numel(specs[i]);
    if (!n.ok()) return n.status();
    numel[i] = *n;
    plan->num_elements = math->Add(plan->num_elements, *n, "parameter count");
    if (specs[i].activation_bytes_per_sample < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter '", specs[i].name, "': activation_bytes_per_sample = ",
          specs[i].activation_bytes_per_sample, " is negative: expected >= 0 bytes"));
    }
    plan->activation_bytes_per_sample =
        math->Add(plan->activation_bytes_per_sample, specs[i].activation_bytes_per_sample,
                  "activation bytes per sample");
    if (!names.insert(specs[i].name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter name '", specs[i].name, "' is registered twice"));
    }
  }
  return numel;
}

// Fills plan->units and plan->params (all but flat_offset) one parameter at a time: whole modules
// are merged up to the target and an oversized module is split at parameter bounds, or, with
// unit_per_module, each module is a unit.
class UnitBuilder {
 public:
  UnitBuilder(absl::Span<const ParamSpec> specs, const std::vector<int64_t>& numel, Plan* plan,
              Checked* math)
      : specs_(specs), numel_(numel), plan_(plan), o_(plan->options), math_(*math) {}

  void AddModule(const std::vector<int>& module) {
    const std::string& module_name = specs_[module.front()].module;
    const bool whole = o_.unit_per_module;
    int64_t size = 0;
    for (int i : module) size = math_.Add(Aligned(size), numel_[i], "unit size");
    if (whole || WouldOverflow(size)) Close();
    for (int i : module) {
      if (!whole && WouldOverflow(numel_[i])) Close();
      if (current_.params.empty()) first_module_ = module_name;
      last_module_ = module_name;
      AddParam(i);
    }
    if (whole) Close();
  }

  // Ends the unit being filled, if any.
  void Close() {
    if (current_.params.empty()) return;
    const int64_t world = o_.world_size;
    current_.name = first_module_ == last_module_
                        ? first_module_
                        : absl::StrCat(first_module_, "..", last_module_);
    current_.padded = math_.RoundUp(
        current_.numel, math_.Mul(world, o_.shard_alignment, "shard alignment"), "padded unit");
    // HSDP: padded for the whole world all the same (see PlanOptions::shard_group_size).
    current_.shard = current_.padded / ShardGroupSize(o_);
    current_.flat_offset = plan_->padded_elements;
    current_.shard_offset = plan_->shard_elements;
    current_.index_offset = index_elements_;
    index_elements_ = math_.Add(index_elements_, current_.numel, "unit size");
    plan_->padded_elements =
        math_.Add(plan_->padded_elements, current_.padded, "padded element count");
    plan_->shard_elements = math_.Add(plan_->shard_elements, current_.shard, "shard size");
    plan_->units.push_back(std::move(current_));
    current_ = Unit();
  }

 private:
  // Whether `elements` more (aligned) would push a non-empty unit past the target.
  bool WouldOverflow(int64_t elements) {
    return !current_.params.empty() &&
           math_.Add(Aligned(current_.numel), elements, "unit size") > o_.unit_target_elements;
  }

  int64_t Aligned(int64_t elements) {
    return math_.RoundUp(elements, o_.param_alignment, "parameter offset");
  }

  void AddParam(int i) {
    const int64_t offset = Aligned(current_.numel);
    ParamLayout& p = plan_->params[i];
    p.name = specs_[i].name;
    p.shape = specs_[i].shape;
    p.numel = numel_[i];
    p.unit = static_cast<int>(plan_->units.size());
    p.offset_in_unit = offset;
    current_.numel = math_.Add(offset, numel_[i], "unit size");
    // Cannot overflow: the plan's total, checked in CountElements, bounds every unit's sum.
    current_.activation_bytes_per_sample += specs_[i].activation_bytes_per_sample;
    current_.params.push_back(i);
  }

  absl::Span<const ParamSpec> specs_;
  const std::vector<int64_t>& numel_;
  Plan* plan_;
  const PlanOptions& o_;
  Checked& math_;
  Unit current_;
  std::string first_module_, last_module_;
  int64_t index_elements_ = 0;  // sum of closed units' numel: the next Unit::index_offset
};

// Trainable units first, then frozen ones (each kind grouped by module as above), so that
// gradients and optimizer state cover a prefix of the layout and a unit is never half frozen.
void BuildUnits(absl::Span<const ParamSpec> specs, const std::vector<int64_t>& numel, Plan* plan,
                Checked* math) {
  plan->params.resize(specs.size());
  UnitBuilder builder(specs, numel, plan, math);
  for (const bool frozen : {false, true}) {
    for (const std::vector<int>& module : ModulesInBackwardOrder(specs)) {
      std::vector<int> part;
      for (int i : module) {
        if (specs[i].frozen == frozen) part.push_back(i);
      }
      if (!part.empty()) builder.AddModule(part);
    }
    builder.Close();
    if (frozen) continue;
    plan->trainable_units = static_cast<int>(plan->units.size());
    plan->trainable_padded_elements = plan->padded_elements;
    plan->trainable_shard_elements = plan->shard_elements;
  }
  for (size_t u = plan->trainable_units; u < plan->units.size(); ++u) plan->units[u].frozen = true;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].frozen) plan->frozen_elements += numel[i];  // bounded by num_elements
  }
}

// Refuses what frozen parameters cannot do: a model with nothing to train, and NVMe offload,
// whose files lay out every unit's optimizer state (and derive shards from a master).
absl::Status CheckFrozen(absl::Span<const ParamSpec> specs, const PlanOptions& o) {
  const auto frozen = std::find_if(specs.begin(), specs.end(),
                                   [](const ParamSpec& s) { return s.frozen; });
  if (frozen == specs.end()) return absl::OkStatus();
  if (std::all_of(specs.begin(), specs.end(), [](const ParamSpec& s) { return s.frozen; })) {
    return absl::InvalidArgumentError(
        "every parameter is frozen: nothing is left to train (unfreeze at least one)");
  }
  if (o.offload_optimizer_nvme || o.offload_param_nvme) {
    return absl::InvalidArgumentError(absl::StrCat(
        "parameter '", frozen->name, "' is frozen, and frozen parameters are not supported "
        "with NVMe offload (offload_optimizer or offload_param device \"nvme\"): use \"cpu\""));
  }
  return absl::OkStatus();
}

// One declared gradient range of a trainer's buffer: [begin, end) elements, of `param`.
struct GradRange {
  int64_t begin, end;
  int param;
  bool operator<(const GradRange& r) const { return begin < r.begin; }
};

// Resolves the declared gradient buffers (ParamSpec::grad_buffer) into plan->grad_buffers and
// each parameter's grad_buffer / grad_buffer_offset; returns every buffer's ranges, sorted.
// Refuses a bad offset and overlapping ranges. A frozen parameter keeps its place, no range.
absl::StatusOr<std::vector<std::vector<GradRange>>> ResolveGradBuffers(
    absl::Span<const ParamSpec> specs, Plan* plan) {
  std::vector<std::vector<GradRange>> ranges;
  std::vector<int64_t> next;  // per buffer: where a packed parameter starts
  absl::flat_hash_map<std::string, int> index;
  for (int i = 0; i < static_cast<int>(specs.size()); ++i) {
    const ParamSpec& spec = specs[i];
    if (spec.grad_buffer.empty()) continue;
    if (spec.grad_buffer_offset < kGradBufferPacked) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter '", spec.name, "': grad_buffer_offset = ", spec.grad_buffer_offset,
          ": expected an element offset >= 0, or ", kGradBufferPacked,
          " (packed after the previous parameter of the buffer)"));
    }
    auto [it, inserted] = index.emplace(spec.grad_buffer, static_cast<int>(ranges.size()));
    if (inserted) {
      plan->grad_buffers.push_back(spec.grad_buffer);
      ranges.emplace_back();
      next.push_back(0);
    }
    const int b = it->second;
    const int64_t offset =
        spec.grad_buffer_offset == kGradBufferPacked ? next[b] : spec.grad_buffer_offset;
    if (offset > (int64_t{1} << 52)) {  // numel <= 2^50: the end cannot wrap
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter '", spec.name, "': grad_buffer_offset ", offset,
          " is larger than any buffer (2^52 elements)"));
    }
    ParamLayout& p = plan->params[i];
    next[b] = offset + p.numel;
    // A frozen parameter (zerort.frozen_params may freeze a declared one) has no gradient: it
    // keeps its place in the packing, so the others keep theirs, and declares nothing.
    if (spec.frozen) continue;
    p.grad_buffer = b;
    p.grad_buffer_offset = offset;
    ranges[b].push_back({offset, next[b], i});
  }
  for (size_t b = 0; b < ranges.size(); ++b) {
    std::vector<GradRange>& r = ranges[b];
    std::sort(r.begin(), r.end());
    for (size_t k = 1; k < r.size(); ++k) {
      if (r[k].begin >= r[k - 1].end) continue;
      return absl::InvalidArgumentError(absl::StrCat(
          "parameters '", specs[r[k - 1].param].name, "' (elements ", r[k - 1].begin, "..",
          r[k - 1].end - 1, ") and '", specs[r[k].param].name, "' (elements ", r[k].begin, "..",
          r[k].end - 1, ") overlap in gradient buffer '", plan->grad_buffers[b],
          "': give each its own range (grad_buffer_offset), or pack them (",
          kGradBufferPacked, ")"));
    }
  }
  return ranges;
}

std::string PaddingText(const PlanOptions& o, const Unit& unit) {
  return absl::StrCat("its ", unit.padded - unit.numel, " padding elements (a unit is padded to "
                      "a multiple of world_size x shard_alignment = ",
                      o.world_size * o.shard_alignment, ")");
}

// Why unit `u`'s declared gradients cannot be reduced straight from the trainer's buffer, or
// "" when they can; then `room` receives the parameters under its padding.
std::string GradCopyReason(const Plan& plan, const Unit& unit,
                           const std::vector<std::vector<GradRange>>& ranges,
                           std::vector<int>* room) {
  const PlanOptions& o = plan.options;
  const ParamLayout& first = plan.params[unit.params.front()];
  auto buffer = [&](const ParamLayout& p) {
    return absl::StrCat("'", plan.grad_buffers[p.grad_buffer], "'");
  };
  for (int i : unit.params) {
    const ParamLayout& p = plan.params[i];
    if (p.grad_buffer < 0) {
      return absl::StrCat("'", p.name, "' shares the unit and declares no gradient buffer: a "
                          "unit is reduced from one buffer, so its declared tensors are copied "
                          "into the engine's");
    }
    if (p.grad_buffer != first.grad_buffer) {
      return absl::StrCat("'", first.name, "' is in gradient buffer ", buffer(first), " and '",
                          p.name, "' in ", buffer(p), ": a unit is reduced from one buffer");
    }
  }
  for (size_t k = 1; k < unit.params.size(); ++k) {
    const ParamLayout& prev = plan.params[unit.params[k - 1]];
    const ParamLayout& p = plan.params[unit.params[k]];
    if (p.offset_in_unit != prev.offset_in_unit + prev.numel) {
      return absl::StrCat("the unit starts '", p.name, "' at element ", p.offset_in_unit,
                          ", not right after '", prev.name, "' (", prev.numel,
                          " elements): each parameter starts at a multiple of param_alignment (",
                          o.param_alignment, ")");
    }
    if (p.grad_buffer_offset != prev.grad_buffer_offset + prev.numel) {
      return absl::StrCat("'", p.name, "' starts at element ", p.grad_buffer_offset, " of ",
                          buffer(p), ", not right after '", prev.name, "' (elements ",
                          prev.grad_buffer_offset, "..", prev.grad_buffer_offset + prev.numel - 1,
                          "), where the unit lays it out: the unit's tensors are not consecutive "
                          "in the trainer's buffer");
    }
  }
  if (unit.padded == unit.numel) return "";
  // Padding: the reduction reads (and may write) `padded` elements from the unit's start, over
  // other declared gradients, which the trainer has handed over: once their units are reduced
  // the engine may use them as scratch until the step.
  const int64_t end = first.grad_buffer_offset + unit.numel;
  const int64_t room_end = first.grad_buffer_offset + unit.padded;
  const std::string padding = PaddingText(o, unit);
  const std::vector<GradRange>& r = ranges[first.grad_buffer];
  auto at = std::lower_bound(r.begin(), r.end(), GradRange{end, end, -1});
  int64_t pos = end;
  for (; pos < room_end && at != r.end(); ++at) {
    if (at->begin > pos) break;
    room->push_back(at->param);
    pos = at->end;
  }
  if (pos >= room_end) return "";
  room->clear();
  if (at == r.end()) {
    return absl::StrCat(padding, " would run past the last gradient declared in ",
                        buffer(first), " (element ", r.back().end - 1, ")");
  }
  return absl::StrCat(padding, " would lie over elements ", pos, "..",
                      std::min(at->begin, room_end) - 1, " of ",
                      buffer(first), ", which no parameter declares");
}

// Decides, for every trainable unit with declared gradients, whether it is reduced in place in
// the trainer's buffer or copied (and why), and counts plan->grad_handoff.
absl::Status PlanGradHandoff(absl::Span<const ParamSpec> specs, Plan* plan) {
  absl::StatusOr<std::vector<std::vector<GradRange>>> ranges = ResolveGradBuffers(specs, plan);
  if (!ranges.ok()) return ranges.status();
  if (plan->grad_buffers.empty()) return absl::OkStatus();
  const int64_t c = static_cast<int64_t>(DTypeSize(plan->options.compute_dtype));
  GradHandoff& h = plan->grad_handoff;
  for (int u = 0; u < plan->trainable_units; ++u) {
    Unit& unit = plan->units[u];
    const bool declared = std::any_of(unit.params.begin(), unit.params.end(),
                                      [&](int i) { return plan->params[i].grad_buffer >= 0; });
    if (!declared) continue;
    unit.grad_copy_reason = GradCopyReason(*plan, unit, *ranges, &unit.grad_room_params);
    unit.grad_source =
        unit.grad_copy_reason.empty() ? GradSource::kInPlace : GradSource::kCopied;
  }
  // Stages 0-1 without accumulation keep a reduced gradient where it is reduced: a unit that
  // fills its padded size keeps it in the trainer's buffer. A unit with padding is reduced over
  // the gradients after it, whose units then must not keep theirs there: stage 1 keeps its
  // reduced shard in the engine's memory instead (Unit::grad_shard_offset); stage 0 would keep
  // the whole unit there, as much as a copy, so it is copied. With offload_optimizer (stage 1)
  // an offloaded unit's reduced shard goes to host memory, and the rule holds for the units
  // that offload_optimizer.ratio < 1 keeps on the device (SplitOffload has run): an offloaded
  // unit is still reduced in place, but its padding must not lie over a kept unit's result.
  const PlanOptions& o = plan->options;
  for (int u = 0; u < plan->trainable_units; ++u) {
    Unit& unit = plan->units[u];
    if (unit.grad_source != GradSource::kInPlace || unit.padded == unit.numel) continue;
    const std::string where =
        absl::StrCat("'", plan->grad_buffers[plan->params[unit.params[0]].grad_buffer], "'");
    if (o.stage == 0 && GradResultsInTrainerBuffer(o, unit)) {
      unit.grad_copy_reason = absl::StrCat(
          PaddingText(o, unit), " would lie over the gradients after it in ", where,
          ", and stage 0 without gradient accumulation keeps the whole reduced unit where it "
          "was reduced until the step: only a unit that fills its padded size exactly is "
          "reduced in place here");
    }
    for (int q : unit.grad_room_params) {
      if (!unit.grad_copy_reason.empty()) break;
      if (!ReducedInTrainerBuffer(*plan, plan->units[plan->params[q].unit])) continue;
      unit.grad_copy_reason = absl::StrCat(
          PaddingText(o, unit), " would lie over '", plan->params[q].name, "''s gradient in ",
          where, ", which its unit keeps there as its reduced gradient until the step (stage ",
          o.stage, " without gradient accumulation",
          o.offload_optimizer ? ", its optimizer state kept on the device by "
                                "offload_optimizer.ratio < 1"
                              : "",
          ")");
    }
    if (unit.grad_copy_reason.empty()) continue;
    unit.grad_source = GradSource::kCopied;
    unit.grad_room_params.clear();
  }
  for (int u = 0; u < plan->trainable_units; ++u) {
    const Unit& unit = plan->units[u];
    for (int i : unit.params) {
      const ParamLayout& p = plan->params[i];
      if (p.grad_buffer < 0) continue;
      ++h.tensors;
      h.bytes += p.numel * c;  // numel <= 2^50: no overflow
      if (unit.grad_source == GradSource::kInPlace) {
        ++h.tensors_in_place;
        h.bytes_in_place += p.numel * c;
      }
    }
  }
  h.bytes_copied = h.bytes - h.bytes_in_place;
  return absl::OkStatus();
}

// What the buffer sizes need to know about the units beyond the plan's own fields.
struct UnitTotals {
  int64_t persistent_elements = 0;  // padded elements of persistent units (stage 3)
  int64_t max_trainable_unit = 0;   // largest padded unit with gradients: wire, staging
  int64_t trainable_persistent_elements = 0;  // persistent units the optimizer step updates
  // padded, of every unit whose gradients backward writes into a bucket (stages 2-3): those
  // with gradients, less those reduced in place in the trainer's buffer
  std::vector<int64_t> bucket_sizes;
  std::vector<int64_t> gathered_sizes;   // padded, of every unit gathered into a slot (stage 3)
  int64_t full_grad_elements = 0;        // stages 0-1: the `grads` buffer (Unit::grad_offset)
  int64_t reduced_shard_elements = 0;    // stage 1: `grad_reduced` (Unit::grad_shard_offset)
  int64_t max_offloaded_unit = 0;  // largest padded unit whose optimizer state is offloaded
};

// Marks persistent units, sets every parameter's flat offset and the largest unit.
UnitTotals PlaceUnits(Plan* plan, Checked* math) {
  const PlanOptions& o = plan->options;
  UnitTotals totals;
  for (Unit& u : plan->units) {
    plan->max_unit_elements = std::max(plan->max_unit_elements, u.padded);
    u.persistent = o.stage == 3 && u.numel <= o.persistence_threshold;
    if (u.persistent) {
      totals.persistent_elements =
          math->Add(totals.persistent_elements, u.padded, "persistent element count");
      if (!u.frozen) totals.trainable_persistent_elements += u.padded;  // <= the line above
    } else {
      totals.gathered_sizes.push_back(u.padded);
    }
    if (!u.frozen) {
      totals.max_trainable_unit = std::max(totals.max_trainable_unit, u.padded);
      if (u.offloaded) totals.max_offloaded_unit = std::max(totals.max_offloaded_unit, u.padded);
      // A unit reduced in place has no gradient storage of the engine's: no bucket, and no
      // range of the full gradients.
      if (u.grad_source != GradSource::kInPlace) {
        totals.bucket_sizes.push_back(u.padded);
        if (o.stage <= 1) {
          u.grad_offset = totals.full_grad_elements;
          totals.full_grad_elements =
              math->Add(totals.full_grad_elements, u.padded, "gradient elements");
        }
      } else if (o.stage == 1 && GradResultsInTrainerBuffer(o, u) && u.padded > u.numel) {
        u.grad_shard_offset = totals.reduced_shard_elements;
        totals.reduced_shard_elements += u.shard;  // <= shard_elements
      }
    }
    for (int i : u.params) {
      plan->params[i].flat_offset =
          math->Add(u.flat_offset, plan->params[i].offset_in_unit, "parameter offset");
    }
  }
  return totals;
}

// The optimizer state's split (PlanOptions::offload_optimizer_ratio): sets every unit's
// `offloaded` and `state_offset` and the plan's state element counts. Trainable units in layout
// order stay on the device while their shards fit in floor((1 - ratio) x St), first fit (a unit
// too large for what is left is offloaded and the next ones are still tried); the rest are
// offloaded. Units are the same on every rank, so every rank keeps the same ones.
void SplitOffload(Plan* plan) {
  const PlanOptions& o = plan->options;
  const int64_t St = plan->trainable_shard_elements;
  if (!o.offload_optimizer) {
    for (Unit& u : plan->units) u.state_offset = u.shard_offset;
    plan->device_state_elements = o.stage == 0 ? plan->trainable_padded_elements : St;
    return;
  }
  // In double: (1 - ratio) x St is exact enough for any shard a machine holds, and every rank
  // computes the same value. Clamped so that ratio 0 keeps all of it despite rounding.
  const double keep = std::floor((1.0 - o.offload_optimizer_ratio) * static_cast<double>(St));
  const int64_t limit = keep >= static_cast<double>(St) ? St : static_cast<int64_t>(keep);
  int64_t kept = 0, offloaded = 0;
  for (Unit& u : plan->units) {
    if (u.frozen) continue;  // no optimizer state
    if (kept + u.shard <= limit) {  // cannot overflow: both are at most St
      u.state_offset = kept;
      kept += u.shard;
    } else {
      u.offloaded = true;
      u.state_offset = offloaded;
      offloaded += u.shard;
    }
  }
  plan->device_state_elements = kept;
  plan->offloaded_state_elements = offloaded;
}

// The slots of a buffer that holds one unit per slot, for units of `sizes` (padded elements,
// not empty): `slots(n, size)` slots of `size` elements for a class of n units whose largest
// has `size` elements. One class (every slot of the largest unit), or two: the k largest units
// in slots of the largest size, the others in slots of the (k+1)-th largest, for the k that
// needs the fewest elements. Two classes are taken only when they need strictly fewer elements
// than one. Returns the slot sizes, smaller class first.
template <typename SlotCount>
std::vector<int64_t> SlotClasses(std::vector<int64_t> sizes, const SlotCount& slots) {
  std::sort(sizes.rbegin(), sizes.rend());
  const int64_t n = static_cast<int64_t>(sizes.size());
  const int64_t largest = sizes[0];
  int64_t best = SatMul(slots(n, largest), largest);
  int64_t best_k = 0;  // 0: one class
  for (int64_t k = 1; k < n; ++k) {
    if (sizes[k] == sizes[k - 1]) continue;  // a class boundary falls between distinct sizes
    const int64_t total = SatAdd(SatMul(slots(k, largest), largest),
                                 SatMul(slots(n - k, sizes[k]), sizes[k]));
    if (total < best) best = total, best_k = k;
  }
  std::vector<int64_t> out;
  if (best_k > 0) out.assign(static_cast<size_t>(slots(n - best_k, sizes[best_k])), sizes[best_k]);
  const int64_t large = best_k > 0 ? slots(best_k, largest) : slots(n, largest);
  out.insert(out.end(), static_cast<size_t>(large), largest);
  return out;
}

// Appends a buffer of `elements` (none when that is 0).
void AddBuffer(Plan* plan, Checked* math, std::string name, BufferClass cls, MemoryKind kind,
               DType dtype, int64_t elements, int64_t count = 1) {
  if (elements <= 0) return;
  Buffer b;
  b.name = std::move(name);
  b.cls = cls;
  b.kind = kind;
  b.dtype = dtype;
  b.elements = elements;
  b.count = count;
  b.bytes = math->Mul(elements, static_cast<int64_t>(DTypeSize(dtype)),
                      absl::StrCat(b.name, " buffer size"));
  plan->buffers.push_back(std::move(b));
}

// A device buffer of `slot_elements` slots (SlotClasses), one per unit in flight.
void AddSlottedBuffer(Plan* plan, Checked* math, std::string name, BufferClass cls, DType dtype,
                      const std::vector<int64_t>& slot_elements) {
  int64_t elements = 0;
  for (int64_t e : slot_elements) elements = math->Add(elements, e, absl::StrCat(name, " size"));
  const int64_t count = static_cast<int64_t>(slot_elements.size());
  AddBuffer(plan, math, std::move(name), cls, MemoryKind::kDevice, dtype, elements, count);
  if (slot_elements.front() != slot_elements.back()) {
    plan->buffers.back().slot_elements = slot_elements;
  }
}

MemoryKind HostKind(const PlanOptions& o) {
  return o.pin_memory ? MemoryKind::kPinnedHost : MemoryKind::kPageableHost;
}

// The two parts of the optimizer state under offload_optimizer (SplitOffload): what is
// offloaded, and what offload_optimizer_ratio < 1 keeps on the device. A buffer of one part holds
// the state of that part's units only; each part's bytes are counted in the plan.
enum class Part { kOffloaded, kDevice };

// Appends a buffer of `part` (none when `elements` is 0) and counts its bytes for the part. With
// both parts in the plan, the device part's buffers are named "<name>_device"; with one part,
// every buffer keeps its plain name (the plan is then the one without offload, or full offload).
void AddPartBuffer(Plan* plan, Checked* math, Part part, const std::string& name,
                   BufferClass cls, MemoryKind kind, DType dtype, int64_t elements) {
  if (elements <= 0) return;
  const bool both = plan->offloaded_state_elements > 0 && plan->device_state_elements > 0;
  const bool device = part == Part::kDevice;
  AddBuffer(plan, math, both && device ? absl::StrCat(name, "_device") : name, cls, kind, dtype,
            elements);
  int64_t& bytes = device ? plan->device_state_bytes : plan->offloaded_state_bytes;
  bytes = math->Add(bytes, plan->buffers.back().bytes, "optimizer state bytes");
}

// params + grads + master + m + v. E: padded elements (all units), S: this rank's shard; Et and
// St the trainable prefix of them: frozen units have parameters only. With offload_optimizer the
// optimizer state (and the stage 2-3 gradient shard) comes in two parts: Sh offloaded elements
// in host memory or the NVMe file, Sd kept on the device, laid out as without offload.
void AddModelState(const UnitTotals& totals, Plan* plan, Checked* math) {
  const PlanOptions& o = plan->options;
  const int64_t E = plan->padded_elements, Et = plan->trainable_padded_elements;
  const int64_t S = plan->shard_elements, St = plan->trainable_shard_elements;
  const int64_t Sh = plan->offloaded_state_elements, Sd = plan->device_state_elements;
  const DType c = o.compute_dtype;
  const bool mixed = c != DType::kF32;
  const MemoryKind optim_kind = o.offload_optimizer_nvme ? MemoryKind::kNvme : HostKind(o);
  const bool sharded_optim = o.stage >= 1;
  if (o.stage <= 2) {
    AddBuffer(plan, math, "params", BufferClass::kParams, MemoryKind::kDevice, c, E);
  } else {
    AddBuffer(plan, math, "param_shard", BufferClass::kParams,
              o.offload_param_nvme ? MemoryKind::kNvme
              : o.offload_param    ? HostKind(o)
                                   : MemoryKind::kDevice,
              c, S);
  }
  const bool full_grads = o.stage <= 1;
  // The reduced shard is the accumulator in stages 2-3: fp32 with fp32_grad_accum. Gradient
  // offload keeps the offloaded units' part in host memory; the device holds only the buckets
  // they are reduced in, and the kept units' part.
  const DType grad_dtype = full_grads ? c : ReducedGradDType(o);
  if (full_grads) {
    // Stages 0-1: the full gradients of the units not reduced in place in the trainer's buffer.
    AddBuffer(plan, math, "grads", BufferClass::kGrads, MemoryKind::kDevice, grad_dtype,
              totals.full_grad_elements);
  } else {
    AddPartBuffer(plan, math, Part::kDevice, "grad_shard", BufferClass::kGrads,
                  MemoryKind::kDevice, grad_dtype, Sd);
    AddPartBuffer(plan, math, Part::kOffloaded, "grad_shard", BufferClass::kGrads, HostKind(o),
                  grad_dtype, Sh);
  }
  // fp32 training updates the parameters in place, unless the optimizer state is offloaded
  // (the host then needs its own fp32 copy to run AdamW on) or the parameters are in a file
  // (AdamW then runs on the master and the new shard is written to the file after it). The
  // part kept on the device is as without offload.
  // A compact master (bf16 only) is the parameter shard itself, or a bf16 copy of it where the
  // shard is elsewhere (OptimizerStateForm, each part's own), and its remainder.
  const OptimizerStateForm form = StateFormOf(o);
  const bool device_master = mixed || o.offload_param_nvme;
  const bool master = device_master || o.offload_optimizer;
  for (const Part part : {Part::kDevice, Part::kOffloaded}) {
    const bool device = part == Part::kDevice;
    const OptimizerStateForm part_form = StateFormOf(o, /*offloaded=*/!device);
    const MemoryKind kind = device ? MemoryKind::kDevice : optim_kind;
    const int64_t n = device ? Sd : Sh;
    if ((device ? device_master : true) && part_form.master_array()) {
      AddPartBuffer(plan, math, part, "master", BufferClass::kMaster, kind,
                    part_form.master_dtype(), n);
    }
    if (part_form.remainder_array()) {
      AddPartBuffer(plan, math, part, "master_remainder", BufferClass::kMasterRemainder, kind,
                    DType::kBF16, n);
    }
    AddPartBuffer(plan, math, part, "exp_avg", BufferClass::kExpAvg, kind, o.moment_dtype, n);
    AddPartBuffer(plan, math, part, "exp_avg_sq", BufferClass::kExpAvgSq, kind, o.moment_dtype,
                  n);
  }
  // What the same buffers would hold for the frozen units (bounded by the sizes above).
  const int64_t frozen_grads = full_grads ? E - Et : S - St;
  const int64_t frozen_optim = sharded_optim ? S - St : E - Et;
  const int64_t state_bytes =
      master || !form.master_array() ? form.BytesPerElement() : 2 * DTypeSize(o.moment_dtype);
  plan->frozen_state_bytes_saved =
      math->Add(math->Mul(frozen_grads, static_cast<int64_t>(DTypeSize(grad_dtype)), "saved"),
                math->Mul(frozen_optim, state_bytes, "saved"), "frozen bytes saved");
}

// NVMe offload: the swap file holds two copies of every unit's master|m|v (a step reads one
// and writes the other, so a failed step leaves the first intact), each array padded to 4 KiB;
// master, exp_avg and exp_avg_sq count Sh elements each, nvme_second_copy the rest of the file.
// Units are streamed in pieces (NvmePieces), each array of a piece padded to 4 KiB. Three
// pinned slots of the largest piece's master|m|v: read ahead, update, write behind. Only the
// offloaded units are in the file (all of them but with offload_optimizer_ratio < 1).
// A compact form (OptimizerStateForm) keeps its own arrays the same way, each padded to 4 KiB;
// the counted buffers then hold its bytes and nvme_second_copy (in 2-byte elements) the rest.
void AddNvmeBuffers(Plan* plan, Checked* math) {
  constexpr absl::string_view kWhat = "nvme bytes";
  const OptimizerStateForm form = StateFormOf(plan->options);
  const std::vector<int> arrays = form.ElementBytes();
  int64_t copy = 0, largest = 0;
  for (const Unit& u : plan->units) {
    if (!u.offloaded) continue;
    for (int64_t piece : NvmePieces(u.shard, plan->options.nvme_piece_elements)) {
      int64_t stride = 0;
      for (int bytes : arrays) stride = math->Add(stride, NvmeArrayStride(piece, bytes), kWhat);
      copy = math->Add(copy, stride, kWhat);
      largest = std::max(largest, stride);
    }
  }
  const int64_t rest =
      math->Add(math->Mul(2, copy, kWhat),
                -math->Mul(form.BytesPerElement(), plan->offloaded_state_elements, kWhat), kWhat);
  // The fp32 form in 4-byte elements as before; a compact form's rest may be 2 bytes short of it.
  const DType rest_dtype = form.compact() ? DType::kBF16 : DType::kF32;
  AddBuffer(plan, math, "nvme_second_copy", BufferClass::kNvmeSecondCopy, MemoryKind::kNvme,
            rest_dtype, rest / static_cast<int64_t>(DTypeSize(rest_dtype)));
  AddBuffer(plan, math, "nvme_staging", BufferClass::kNvmeStaging, MemoryKind::kPinnedHost,
            DType::kF32, math->Mul(3, largest / 4, kWhat), 3);
}

// NVMe parameter offload: param_shard counts the shards' bytes, nvme_param_padding the rest of
// their region (each unit's shard padded to 4 KiB), nvme_param_buffers the pinned pieces.
void AddNvmeParamBuffers(Plan* plan, Checked* math) {
  constexpr absl::string_view kWhat = "nvme parameter bytes";
  const DType c = plan->options.compute_dtype;
  const int64_t cb = static_cast<int64_t>(DTypeSize(c));
  int64_t padded = 0, largest = 0;
  for (const Unit& u : plan->units) {
    const int64_t bytes = NvmeParamBytes(math->Mul(u.shard, cb, kWhat));
    padded = math->Add(padded, bytes, kWhat);
    largest = std::max(largest, bytes);
  }
  const int64_t piece = NvmeParamPieceBytes(plan->options, largest);
  AddBuffer(plan, math, "nvme_param_padding", BufferClass::kNvmeParamPadding, MemoryKind::kNvme,
            c, (padded - math->Mul(plan->shard_elements, cb, kWhat)) / cb);
  const int64_t count = plan->options.offload_param_buffer_count;
  AddBuffer(plan, math, "nvme_param_buffers", BufferClass::kNvmeParamBuffers,
            MemoryKind::kPinnedHost, c, math->Mul(count, piece / cb, kWhat), count);
}

// The working buffers: accumulator, buckets, gather slots, staging, the norm table.
void AddWorkingBuffers(const UnitTotals& totals, Plan* plan, Checked* math) {
  const PlanOptions& o = plan->options;
  const int64_t world = o.world_size;
  const DType c = o.compute_dtype;
  const DType reduced = ReducedGradDType(o);
  if (o.stage <= 1) {
    // Micro-step gradients are reduced as they arrive and accumulated after the reduction, so
    // that every stage sums in the same order; stages 2-3 accumulate into grad_shard itself.
    // An fp32 accumulator is needed even without accumulation: it holds the fp32 result. With
    // gradient offload it is where stage 1's reduced shard of the offloaded units lives, in
    // host memory, always; the units kept on the device have one as without offload.
    if (o.gradient_accumulation_steps > 1 || reduced != c) {
      AddPartBuffer(plan, math, Part::kDevice, "grad_accumulator",
                    BufferClass::kGradAccumulator, MemoryKind::kDevice, reduced,
                    plan->device_state_elements);
    }
    AddPartBuffer(plan, math, Part::kOffloaded, "grad_accumulator", BufferClass::kGradAccumulator,
                  HostKind(o), reduced, plan->offloaded_state_elements);
  }
  if (totals.reduced_shard_elements > 0) {
    // Stage 1 without accumulation: the reduced shards of units reduced in place whose padding
    // lies over other gradients of the trainer's buffer (Unit::grad_shard_offset).
    AddBuffer(plan, math, "grad_reduced", BufferClass::kGradAccumulator, MemoryKind::kDevice,
              reduced, totals.reduced_shard_elements);
  }
  if (GradOffload(o) && o.gradient_accumulation_steps > 1) {
    // A micro-step after the first adds its reduced shard to the host-resident sum on the
    // device, one unit at a time: sum up, Accumulate (the kernel of device accumulation, so the
    // bits are the same), sum down, all on the comm stream. Offloaded units only.
    AddBuffer(plan, math, "grad_accum_stage", BufferClass::kGradAccumStage, MemoryKind::kDevice,
              reduced, totals.max_offloaded_unit / ShardGroupSize(o));
  }
  if (reduced != c || GradWireDType(o) != c) {
    // A whole unit converted for an fp32 reduction, or (fp32 accumulation alone) one reduced
    // block converted before it is added; stage 0 reduces whole units.
    // Local accumulation converts whole units too.
    const bool whole = GradWireDType(o) != c || o.stage == 0 || LocalAccumulation(o);
    AddBuffer(plan, math, "grad_wire", BufferClass::kGradWire, MemoryKind::kDevice, DType::kF32,
              whole ? totals.max_trainable_unit
                    : totals.max_trainable_unit / ShardGroupSize(o));
  }
  if (LocalAccumulation(o)) {
    AddBuffer(plan, math, "grad_local", BufferClass::kGradLocal, MemoryKind::kDevice, reduced,
              plan->trainable_padded_elements);
  }
  if (o.stage >= 2 && !totals.bucket_sizes.empty()) {
    // Any grad_bucket_count units of one class may be open at once, as with equal buckets.
    const std::vector<int64_t> slots = SlotClasses(
        totals.bucket_sizes, [&](int64_t units, int64_t) {
          return std::min<int64_t>(o.grad_bucket_count, units);
        });
    AddSlottedBuffer(plan, math, "grad_bucket", BufferClass::kGradBucket, c, slots);
  }
  if (o.stage == 3) {
    if (!totals.gathered_sizes.empty()) {
      // Frozen parameters split a module into a trainable and a frozen unit, which a trainer
      // holds together: one more slot.
      const int64_t frozen_extra =
          plan->trainable_units < static_cast<int>(plan->units.size()) ? 1 : 0;
      // Per class: 1 + ceil(prefetch / unit), at most max_live / unit and the class's units;
      // written so that a prefetch near INT64_MAX cannot wrap.
      const std::vector<int64_t> slots = SlotClasses(
          totals.gathered_sizes, [&](int64_t units, int64_t unit) {
            const int64_t live_cap = std::max<int64_t>(1, o.max_live_elements / unit);
            const int64_t want =
                SatAdd(SatAdd(1, Checked::CeilDiv(o.prefetch_elements, unit)), frozen_extra);
            return std::max<int64_t>(1, std::min({want, live_cap, units}));
          });
      plan->gather_slots = static_cast<int64_t>(slots.size());
      AddSlottedBuffer(plan, math, "gather_buffer", BufferClass::kGatherBuffer, c, slots);
    }
    AddBuffer(plan, math, "persistent_params", BufferClass::kPersistentParams, MemoryKind::kDevice, c,
              totals.persistent_elements);
    if (Hpz(o)) {
      // Every gathered unit's secondary block stays until the next update: 1/K of each.
      int64_t secondary = 0;
      for (int64_t padded : totals.gathered_sizes) {
        secondary = math->Add(secondary, padded / o.hpz_partition_size, "hpz_secondary size");
      }
      AddBuffer(plan, math, "hpz_secondary", BufferClass::kHpzSecondary, MemoryKind::kDevice, c,
                secondary);
    }
  }
  if (o.hierarchical_gather && o.stage >= 1) {
    // Every all-gather goes through it, the largest unit's included (stage 1-2 updates).
    AddBuffer(plan, math, "gather_stage", BufferClass::kGatherStage, MemoryKind::kDevice, c,
              plan->max_unit_elements / o.ranks_per_node);
  }
  // A compact master's host copy (OptimizerStateForm) is itself the new shard that goes up.
  const OptimizerStateForm form = StateFormOf(o);
  const bool upload_master_copy =
      form.master != MasterForm::kF32 && !form.master_in_params && !o.offload_optimizer_nvme;
  if (o.offload_optimizer && (!o.offload_param || o.offload_param_nvme) && !upload_master_copy) {
    // Each chunk carries one unit's new parameter shard up to the device (or into the NVMe
    // file); the gradients are in host memory already (gradient offload). A parameter shard in
    // host memory is updated in place and needs none.
    // Offloaded units only: the kept ones are updated in device memory.
    AddBuffer(plan, math, "offload_staging", BufferClass::kOffloadStaging, HostKind(o), c,
              math->Mul(o.offload_buffer_count, totals.max_offloaded_unit / ShardGroupSize(o),
                        "offload_staging size"),
              o.offload_buffer_count);
  }
  if (o.offload_optimizer_nvme && plan->offloaded_state_elements > 0) AddNvmeBuffers(plan, math);
  if (o.offload_param_nvme) AddNvmeParamBuffers(plan, math);
  if (GradOffload(o) && plan->offloaded_state_elements > 0) {
    // The device writes each unit's norm partial and finiteness flag as the shard leaves, in
    // backward: into pinned memory, so that the copy is asynchronous (a copy into pageable
    // memory would make the trainer's thread wait for the reduction). Pinned whatever
    // pin_memory says: it is a few bytes per unit. Flags take a byte each: 2 x units elements.
    AddBuffer(plan, math, "norm_partials", BufferClass::kNormPartials, MemoryKind::kPinnedHost,
              DType::kF32, math->Mul(2, static_cast<int64_t>(plan->units.size()),
                                     "norm_partials size"));
  }
  if (o.stage >= 1 && world > 1) {
    // Every rank's norm partials meet in one all-gather per step, in device memory because a
    // GPU communicator moves nothing else.
    AddBuffer(plan, math, "norm_table", BufferClass::kNormTable, MemoryKind::kDevice, DType::kF32,
              math->Mul(world, static_cast<int64_t>(plan->units.size()) + 1, "norm_table size"));
  }
}

// Stage 3: how many times the engine all-gathers each unit in one optimizer step when the trainer
// holds units in the standard order (plan.h, Plan::stage3_gathers_per_step): per micro-step,
// forward from the last unit to the first, then backward from the first to the last, each unit
// gathered, used and released before the next. This drives the engine's own slot policy
// (memory::GatherSlots, which zero/internal/param_gatherer.cc performs) on the plan's slots: a
// unit still in a slot of its class is not gathered again; a gather takes an empty slot of the
// unit's class, else the least recently used unheld one; then the next units in the pass's
// direction (up to prefetch_elements of them) are prefetched into empty slots or slots of units
// already passed. The update empties every slot (Invalidate), so every step is the same.
// Micro-steps repeat once the slots start one as they started the one before, so the replay
// stops there: a huge gradient_accumulation_steps costs nothing.
// Returns per unit the gathers of one step (0 for persistent units).
std::vector<int64_t> SimulateStage3Gathers(const Plan& plan, Checked* math) {
  const PlanOptions& o = plan.options;
  const int n = static_cast<int>(plan.units.size());
  std::vector<int64_t> per_step(n, 0);
  const Buffer* buffer = plan.Find(BufferClass::kGatherBuffer);
  if (buffer == nullptr) return per_step;
  std::vector<int64_t> sizes = buffer->slot_elements;
  if (sizes.empty())
    sizes.assign(static_cast<size_t>(buffer->count), buffer->elements / buffer->count);
  std::vector<int64_t> padded(n);
  std::vector<bool> persistent(n);
  for (int u = 0; u < n; ++u) {
    padded[u] = plan.units[u].padded;
    persistent[u] = plan.units[u].persistent;
  }
  GatherSlots slots(std::move(sizes), std::move(padded), std::move(persistent),
                    o.prefetch_elements);
  std::vector<int64_t> micro(n, 0);  // gathers of the current micro-step
  auto gather = [&](const GatherSlots::Decision& d) {
    ++micro[d.unit];
    slots.Filled(d.unit, d.slot);
  };
  auto hold_and_release = [&](int u) {
    if (plan.units[u].persistent) return;
    const int direction = slots.Direction(u);
    if (slots.slot_of(u) < 0) {
      const GatherSlots::Decision d = slots.Take(u);
      // One unit held at a time and at least one slot per class: a slot is always free.
      ABSL_RAW_CHECK(d.slot >= 0, "stage-3 gather replay: no free slot");
      gather(d);
    }
    slots.Hold(u);  // a prefetch never takes the slot of the unit in use
    GatherSlots::Walk walk = slots.StartPrefetch(u, direction);
    for (GatherSlots::Decision d = slots.NextPrefetch(&walk); d.unit >= 0;
         d = slots.NextPrefetch(&walk)) {
      gather(d);
    }
    slots.Release(u);  // released before the next unit is gathered
  };
  // What the next micro-step's gathers depend on: each slot's unit and the slots' LRU order.
  auto signature = [&]() {
    std::vector<std::pair<uint64_t, int>> by_use;
    for (int s = 0; s < slots.slot_count(); ++s) {
      by_use.push_back({slots.last_use(s), slots.unit_in(s)});
    }
    std::sort(by_use.begin(), by_use.end());
    std::vector<int> sig;
    for (const auto& [use, unit] : by_use) sig.push_back(unit);
    for (int s = 0; s < slots.slot_count(); ++s) sig.push_back(slots.unit_in(s));
    sig.push_back(slots.last_held());
    return sig;
  };
  const int64_t gas = o.gradient_accumulation_steps;
  std::vector<int> before = signature();
  for (int64_t m = 0; m < gas; ++m) {
    micro.assign(n, 0);
    for (int u = n - 1; u >= 0; --u) hold_and_release(u);
    for (int u = 0; u < n; ++u) hold_and_release(u);
    std::vector<int> after = signature();
    const bool repeats = m > 0 && after == before;
    // From here on every micro-step repeats this one: count the rest at once.
    const int64_t times = repeats ? gas - m : 1;
    for (int u = 0; u < n; ++u) {
      per_step[u] =
          math->Add(per_step[u], math->Mul(times, micro[u], "stage-3 gathers"), "stage-3 gathers");
    }
    if (repeats) break;
    before = std::move(after);
  }
  return per_step;
}

// Totals per memory kind and model state, then the bytes this rank moves per step.
void CountBytes(const UnitTotals& totals, Plan* plan, Checked* math) {
  for (const Buffer& b : plan->buffers) {
    int64_t& kind = plan->bytes_by_kind[static_cast<int>(b.kind)];
    kind = math->Add(kind, b.bytes, absl::StrCat(MemoryKindName(b.kind), " bytes"));
    if (IsModelState(b.cls)) {
      plan->model_state_bytes = math->Add(plan->model_state_bytes, b.bytes, "model state bytes");
    }
  }
  const PlanOptions& o = plan->options;
  const int64_t world = o.world_size;
  const int64_t S = plan->shard_elements;
  // Only trainable units are reduced, and re-gathered after the step.
  const int64_t Et = plan->trainable_padded_elements;
  // Communication: bytes sent by this rank, (n-1)/n of the full buffer per collective.
  const int64_t cb = static_cast<int64_t>(DTypeSize(o.compute_dtype));
  const int64_t gas = o.gradient_accumulation_steps;
  // Gradient reductions per window: one with local accumulation.
  const int64_t reductions = LocalAccumulation(o) ? 1 : gas;
  constexpr absl::string_view kComm = "communication bytes per step";
  auto add = [&](int64_t x, int64_t y) { return math->Add(x, y, kComm); };
  auto mul = [&](int64_t x, int64_t y) { return math->Mul(x, y, kComm); };
  // HSDP: G ranks per shard group, R groups. Parameter all-gathers stay within the group; a
  // gradient reduction is a reduce-scatter within the group plus an all-reduce, across the R
  // groups, of the 1/G shard (2(R-1)/R of it). Flat: G = world, R = 1, nothing crosses.
  const int64_t G = ShardGroupSize(o), R = world / G;
  auto collective = [&](int64_t elements) { return mul(mul(elements / G, G - 1), cb); };
  // Gradient reductions move the wire dtype (fp32 with fp32_grad_comm).
  const int64_t wb = static_cast<int64_t>(DTypeSize(GradWireDType(o)));
  auto reduction = [&](int64_t elements) { return mul(mul(elements / G, G - 1), wb); };
  auto across = [&](int64_t elements) { return mul(2, mul(mul(elements / G / R, R - 1), wb)); };
  // Link classes (ranks_per_node L known): a collective is intra-node when every rank of this
  // rank's group for it sits in this rank's node.
  const int64_t L = o.ranks_per_node, r = o.rank;
  auto spans = [&](int64_t first, int64_t stride, int64_t n) {
    return L > 0 && first / L != (first + stride * (n - 1)) / L;
  };
  auto consecutive_spans = [&](int64_t n) { return spans(r - r % n, 1, n); };
  int64_t within = 0, crossing = 0, intra = 0, inter = 0;
  auto place = [&](int64_t bytes, bool spanning) {
    if (spanning) {
      inter = add(inter, bytes);
    } else {
      intra = add(intra, bytes);
    }
  };
  // `times` reductions of `elements`: in the group, then (HSDP) across the groups.
  auto reduce = [&](int64_t times, int64_t elements, int passes) {
    const int64_t in_group = mul(times, mul(passes, reduction(elements)));
    within = add(within, in_group);
    place(in_group, consecutive_spans(G));
    if (R == 1) return;
    const int64_t across_groups = mul(times, across(elements));
    crossing = add(crossing, across_groups);
    place(across_groups, spans(r % G, G, R));
  };
  // `times` all-gathers of `elements` within the shard group; MiCS's hierarchical gather sends
  // 1/G of them to each of the G/L - 1 other nodes, then G/L blocks within the node.
  auto gather = [&](int64_t times, int64_t elements) {
    if (o.hierarchical_gather) {
      const int64_t c = elements / G, nodes = G / L;
      const int64_t across_nodes = mul(times, mul(mul(c, nodes - 1), cb));
      const int64_t in_node = mul(times, mul(mul(mul(c, nodes), L - 1), cb));
      within = add(within, add(across_nodes, in_node));
      inter = add(inter, across_nodes);
      intra = add(intra, in_node);
      return;
    }
    const int64_t bytes = mul(times, collective(elements));
    within = add(within, bytes);
    place(bytes, consecutive_spans(G));
  };
  switch (o.stage) {
    case 0:
      reduce(reductions, Et, 2);
      break;
    case 1:
    case 2:
      reduce(reductions, Et, 1);
      gather(1, Et);
      break;
    case 3: {
      // Persistent trainable units are gathered once after the step, the others as often as
      // the standard order makes the engine gather them (SimulateStage3Gathers). hpZ: a unit's
      // first gather after the update runs over the world, its later ones over its K ranks
      // (K - 1 blocks of 1/K each).
      reduce(gas, Et, 1);
      gather(1, totals.trainable_persistent_elements);
      const std::vector<int64_t> times = SimulateStage3Gathers(*plan, math);
      int64_t first = 0, again = 0;  // elements: each unit's first gather, and the others
      for (size_t u = 0; u < times.size(); ++u) {
        if (times[u] == 0) continue;
        const int64_t padded = plan->units[u].padded;
        plan->stage3_gathers_per_step = add(plan->stage3_gathers_per_step, times[u]);
        first = add(first, padded);
        again = add(again, mul(times[u] - 1, padded));
      }
      if (!Hpz(o)) {
        gather(1, add(first, again));
        break;
      }
      gather(1, first);
      const int64_t K = o.hpz_partition_size;
      const int64_t node = mul(mul(again / K, K - 1), cb);
      within = add(within, node);
      place(node, consecutive_spans(K));
      break;
    }
  }
  // The control exchange (Plan::comm_control_bytes_per_step): small host values all-gathered
  // over the world as their bits, (world - 1) copies of this rank's words sent.
  int64_t control = 0;
  if (world > 1) {
    const int64_t others = world - 1;
    // zero/internal/grad_norm.cc: the norm table's row, units + 1 fp32 (stages 1-3).
    if (o.stage >= 1) {
      control = mul(mul(others, static_cast<int64_t>(plan->units.size()) + 1), 4);
    }
    // zero/internal/step_control.cc: AgreeBeforeUpdate's six 64-bit words.
    control = add(control, mul(others, 6 * 8));
    // comm::AgreeOnStatus (one 64-bit code) where a file's I/O may fail: after every stage-3
    // gather of a shard read from the NVMe file (persistent units' after the update too), and
    // after each part of the update that writes the file (the host pipeline, the device part).
    int64_t agreements = 0;
    if (o.offload_param_nvme) {
      int64_t persistent_trainable = 0;
      for (const Unit& u : plan->units) persistent_trainable += u.persistent && !u.frozen;
      agreements = add(plan->stage3_gathers_per_step, persistent_trainable);
      if (plan->device_state_elements > 0) agreements = add(agreements, 1);
    }
    if (plan->offloaded_state_elements > 0 && (o.offload_optimizer_nvme || o.offload_param_nvme)) {
      agreements = add(agreements, 1);
    }
    control = add(control, mul(agreements, mul(others, 8)));
  }
  plan->comm_control_bytes_per_step = control;
  place(control, spans(0, 1, world));
  plan->comm_bytes_within_group_per_step = within;
  plan->comm_bytes_across_groups_per_step = crossing;
  plan->comm_bytes_per_step = add(add(within, crossing), control);
  if (L > 0) {
    plan->comm_bytes_intra_node_per_step = intra;
    plan->comm_bytes_inter_node_per_step = inter;
  }
  constexpr absl::string_view kHost = "host transfer bytes per step";
  const int64_t shard_both_ways = math->Mul(math->Mul(2, S, kHost), cb, kHost);
  if (o.offload_optimizer) {
    // The offloaded units' gradient shard down after every reduction, the running sum up before
    // each reduction's addition after the first (gradient offload), its parameters up once. Local
    // accumulation reduces once per window: one copy down. The units kept on the device move
    // nothing.
    const int64_t Sh = plan->offloaded_state_elements;
    const int64_t gb = static_cast<int64_t>(DTypeSize(ReducedGradDType(o)));
    const int64_t grad_moves = math->Add(math->Mul(2, reductions, kHost), -1, kHost);
    plan->host_transfer_bytes_per_step = math->Add(
        math->Mul(math->Mul(grad_moves, Sh, kHost), gb, kHost), math->Mul(Sh, cb, kHost), kHost);
  }
  if (o.offload_param) {
    // The shard goes up for forward and for backward in every micro-step.
    plan->host_transfer_bytes_per_step = math->Add(
        plan->host_transfer_bytes_per_step, math->Mul(gas, shard_both_ways, kHost), kHost);
  }
}

}  // namespace

int64_t GradStorageBytes(const Plan& plan) {
  int64_t bytes = 0;
  for (const Buffer& b : plan.buffers) {
    switch (b.cls) {
      case BufferClass::kGrads:
      case BufferClass::kGradAccumulator:
      case BufferClass::kGradWire:
      case BufferClass::kGradLocal:
      case BufferClass::kGradBucket:
      case BufferClass::kGradAccumStage:
        bytes = SatAdd(bytes, b.bytes);
        break;
      default:
        break;
    }
  }
  return bytes;
}

bool GradResultsInTrainerBuffer(const PlanOptions& o, const Unit& unit) {
  return o.stage <= 1 && o.gradient_accumulation_steps == 1 &&
         ReducedGradDType(o) == o.compute_dtype && !unit.offloaded;
}

bool ReducedInTrainerBuffer(const Plan& plan, const Unit& unit) {
  return GradResultsInTrainerBuffer(plan.options, unit) &&
         unit.grad_source == GradSource::kInPlace && unit.padded == unit.numel;
}

const char* GradSourceName(GradSource s) {
  switch (s) {
    case GradSource::kEngine:
      return "engine";
    case GradSource::kInPlace:
      return "in_place";
    case GradSource::kCopied:
      return "copied";
  }
  return "unknown";
}

bool LocalAccumulation(const PlanOptions& o) {
  return o.local_grad_accumulation && o.gradient_accumulation_steps > 1 && o.stage <= 1;
}

DType ReducedGradDType(const PlanOptions& o) {
  return o.fp32_grad_accum ? DType::kF32 : o.compute_dtype;
}

DType GradWireDType(const PlanOptions& o) {
  return o.fp32_grad_comm ? DType::kF32 : o.compute_dtype;
}

int64_t NvmeParamPieceBytes(const PlanOptions& o, int64_t largest_padded_shard) {
  int64_t piece = std::max<int64_t>(largest_padded_shard, kNvmeAlignment);
  if (o.nvme_piece_elements > 0) {
    const int64_t cb = static_cast<int64_t>(DTypeSize(o.compute_dtype));
    const int64_t limit = o.nvme_piece_elements > INT64_MAX / cb
                              ? INT64_MAX
                              : o.nvme_piece_elements * cb / kNvmeAlignment * kNvmeAlignment;
    piece = std::min(piece, std::max(limit, kNvmeAlignment));
  }
  return piece;
}

std::vector<int64_t> NvmePieces(int64_t shard, int64_t piece_elements) {
  const int64_t piece =
      piece_elements <= 0 ? shard : std::max<int64_t>(1024, piece_elements / 1024 * 1024);
  std::vector<int64_t> out;
  for (int64_t begin = 0; begin < shard; begin += piece) out.push_back(std::min(piece, shard - begin));
  return out;
}

const char* MemoryKindName(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kDevice:
      return "device";
    case MemoryKind::kPinnedHost:
      return "pinned_host";
    case MemoryKind::kNvme:
      return "nvme";
    case MemoryKind::kPageableHost:
      return "host";
  }
  return "unknown";
}

const char* MasterFormName(MasterForm form) {
  switch (form) {
    case MasterForm::kF32:
      return "fp32";
    case MasterForm::kBf16Remainder:
      return "bf16 + remainder";
    case MasterForm::kBf16Stochastic:
      return "bf16 (stochastic rounding)";
  }
  return "unknown";
}

OptimizerStateForm StateFormOf(const PlanOptions& o, bool offloaded) {
  OptimizerStateForm f;
  f.master = o.master_form;
  f.moment_dtype = o.moment_dtype;
  // The part kept on the device (offloaded false) is as without offload_optimizer.
  const bool host = offloaded && o.offload_optimizer;
  f.master_in_params = o.master_form != MasterForm::kF32 && !(host && o.offload_optimizer_nvme) &&
                       !o.offload_param_nvme && (!host || o.offload_param);
  return f;
}

OptimizerStateForm StateFormOf(const PlanOptions& o) {
  return StateFormOf(o, o.offload_optimizer);
}

std::vector<int> OptimizerStateForm::ElementBytes() const {
  std::vector<int> out;
  if (master_array()) out.push_back(static_cast<int>(DTypeSize(master_dtype())));
  if (remainder_array()) out.push_back(2);
  const int moment = static_cast<int>(DTypeSize(moment_dtype));
  out.push_back(moment);
  out.push_back(moment);
  return out;
}

int64_t OptimizerStateForm::BytesPerElement() const {
  int64_t sum = 0;
  for (int b : ElementBytes()) sum += b;
  return sum;
}

std::string StateFormDescription(const PlanOptions& o) {
  const OptimizerStateForm f = StateFormOf(o);
  std::string master = absl::StrCat(MasterFormName(f.master), " master");
  if (f.master != MasterForm::kF32) {
    absl::StrAppend(&master, f.master_in_params ? " in the parameter shard"
                                                : " (a bf16 copy of the shard beside the state)");
  }
  std::string out = absl::StrCat("optimizer state: ", master, ", ", DTypeName(f.moment_dtype),
                                 " moments: ", f.BytesPerElement(), " bytes per owned parameter");
  // offload_optimizer.ratio < 1: the units kept on the device hold the form without offload.
  const OptimizerStateForm kept = StateFormOf(o, /*offloaded=*/false);
  if (o.offload_optimizer && o.offload_optimizer_ratio < 1 &&
      kept.master_in_params != f.master_in_params) {
    absl::StrAppend(&out, " offloaded; ", MasterFormName(kept.master), " master ",
                    kept.master_in_params ? "in the parameter shard" : "beside the state", ": ",
                    kept.BytesPerElement(), " bytes per parameter kept on the device");
  }
  return out;
}

const char* BufferClassName(BufferClass c) {
  switch (c) {
    case BufferClass::kParams:
      return "params";
    case BufferClass::kGrads:
      return "grads";
    case BufferClass::kMaster:
      return "master";
    case BufferClass::kExpAvg:
      return "exp_avg";
    case BufferClass::kExpAvgSq:
      return "exp_avg_sq";
    case BufferClass::kMasterRemainder:
      return "master_remainder";
    case BufferClass::kGradAccumulator:
      return "grad_accumulator";
    case BufferClass::kGradBucket:
      return "grad_bucket";
    case BufferClass::kGradWire:
      return "grad_wire";
    case BufferClass::kGradLocal:
      return "grad_local";
    case BufferClass::kGatherBuffer:
      return "gather_buffer";
    case BufferClass::kPersistentParams:
      return "persistent_params";
    case BufferClass::kOffloadStaging:
      return "offload_staging";
    case BufferClass::kNvmeStaging:
      return "nvme_staging";
    case BufferClass::kNvmeSecondCopy:
      return "nvme_second_copy";
    case BufferClass::kNvmeParamPadding:
      return "nvme_param_padding";
    case BufferClass::kNvmeParamBuffers:
      return "nvme_param_buffers";
    case BufferClass::kNormTable:
      return "norm_table";
    case BufferClass::kGradAccumStage:
      return "grad_accum_stage";
    case BufferClass::kNormPartials:
      return "norm_partials";
    case BufferClass::kHpzSecondary:
      return "hpz_secondary";
    case BufferClass::kGatherStage:
      return "gather_stage";
  }
  return "unknown";
}

bool IsModelState(BufferClass c) {
  return c == BufferClass::kParams || c == BufferClass::kGrads || c == BufferClass::kMaster ||
         c == BufferClass::kExpAvg || c == BufferClass::kExpAvgSq ||
         c == BufferClass::kMasterRemainder;
}

const Buffer* Plan::Find(BufferClass cls) const {
  for (const Buffer& b : buffers) {
    if (b.cls == cls) return &b;
  }
  return nullptr;
}

absl::StatusOr<Plan> MakePlan(absl::Span<const ParamSpec> specs, const PlanOptions& o) {
  if (absl::Status s = ValidateOptions(o); !s.ok()) return s;
  if (specs.empty()) return absl::InvalidArgumentError("the model has no parameters");
  if (absl::Status s = CheckFrozen(specs, o); !s.ok()) return s;

  Plan plan;
  plan.options = o;
  Checked math;
  absl::StatusOr<std::vector<int64_t>> numel = CountElements(specs, &plan, &math);
  if (!numel.ok()) return numel.status();
  if (!math.status().ok()) return math.status();
  BuildUnits(specs, *numel, &plan, &math);
  SplitOffload(&plan);
  if (absl::Status s = PlanGradHandoff(specs, &plan); !s.ok()) return s;
  const UnitTotals totals = PlaceUnits(&plan, &math);
  AddModelState(totals, &plan, &math);
  AddWorkingBuffers(totals, &plan, &math);
  CountBytes(totals, &plan, &math);
  if (!math.status().ok()) return math.status();
  GradHandoff& h = plan.grad_handoff;
  h.engine_grad_bytes = GradStorageBytes(plan);
  h.engine_grad_bytes_undeclared = h.engine_grad_bytes;
  if (h.tensors > 0) {
    // The same model with nothing declared: what the engine would hold without the hand-off.
    std::vector<ParamSpec> undeclared(specs.begin(), specs.end());
    for (ParamSpec& spec : undeclared) spec.grad_buffer.clear();
    absl::StatusOr<Plan> without = MakePlan(undeclared, o);
    if (!without.ok()) return without.status();
    h.engine_grad_bytes_undeclared = GradStorageBytes(*without);
  }
  return plan;
}

}  // namespace memory
}  // namespace zerort
