#include "memory/plan.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace zerort {
namespace memory {
namespace {

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

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
  if (o.offload_buffer_count < 1) return bad("offload_buffer_count", o.offload_buffer_count, ">= 1");
  if (o.gradient_accumulation_steps < 1) {
    return bad("gradient_accumulation_steps", o.gradient_accumulation_steps, ">= 1");
  }
  if (o.unit_target_elements < 1) return bad("unit_target_elements", o.unit_target_elements, ">= 1");
  if (o.shard_alignment < 1) return bad("shard_alignment", o.shard_alignment, ">= 1");
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
absl::StatusOr<std::vector<int64_t>> CountElements(absl::Span<const ParamSpec> specs, Plan* plan) {
  std::vector<int64_t> numel(specs.size());
  absl::flat_hash_set<absl::string_view> names;
  names.reserve(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    auto n = Numel(specs[i]);
    if (!n.ok()) return n.status();
    numel[i] = *n;
    plan->num_elements += *n;
    if (!names.insert(specs[i].name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter name '", specs[i].name, "' is registered twice"));
    }
  }
  return numel;
}

// Fills plan->units and plan->params (all but flat_offset) one parameter at a time: whole modules
// are merged up to the target and an oversized module is split at parameter bounds.
class UnitBuilder {
 public:
  UnitBuilder(absl::Span<const ParamSpec> specs, const std::vector<int64_t>& numel, Plan* plan)
      : specs_(specs), numel_(numel), plan_(plan), o_(plan->options) {}

  void AddModule(const std::vector<int>& module) {
    const std::string& module_name = specs_[module.front()].module;
    int64_t size = 0;
    for (int i : module) size = RoundUp(size, o_.param_alignment) + numel_[i];
    if (WouldOverflow(size)) Close();
    for (int i : module) {
      if (WouldOverflow(numel_[i])) Close();
      if (current_.params.empty()) first_module_ = module_name;
      last_module_ = module_name;
      AddParam(i);
    }
  }

  // Ends the unit being filled, if any.
  void Close() {
    if (current_.params.empty()) return;
    const int64_t world = o_.world_size;
    current_.name = first_module_ == last_module_
                        ? first_module_
                        : absl::StrCat(first_module_, "..", last_module_);
    current_.padded = RoundUp(current_.numel, world * o_.shard_alignment);
    current_.shard = current_.padded / world;
    current_.flat_offset = plan_->padded_elements;
    current_.shard_offset = plan_->shard_elements;
    plan_->padded_elements += current_.padded;
    plan_->shard_elements += current_.shard;
    plan_->units.push_back(std::move(current_));
    current_ = Unit();
  }

 private:
  // Whether `elements` more (aligned) would push a non-empty unit past the target.
  bool WouldOverflow(int64_t elements) const {
    return !current_.params.empty() &&
           RoundUp(current_.numel, o_.param_alignment) + elements > o_.unit_target_elements;
  }

  void AddParam(int i) {
    const int64_t offset = RoundUp(current_.numel, o_.param_alignment);
    ParamLayout& p = plan_->params[i];
    p.name = specs_[i].name;
    p.shape = specs_[i].shape;
    p.numel = numel_[i];
    p.unit = static_cast<int>(plan_->units.size());
    p.offset_in_unit = offset;
    current_.numel = offset + numel_[i];
    current_.params.push_back(i);
  }

  absl::Span<const ParamSpec> specs_;
  const std::vector<int64_t>& numel_;
  Plan* plan_;
  const PlanOptions& o_;
  Unit current_;
  std::string first_module_, last_module_;
};

void BuildUnits(absl::Span<const ParamSpec> specs, const std::vector<int64_t>& numel, Plan* plan) {
  plan->params.resize(specs.size());
  UnitBuilder builder(specs, numel, plan);
  for (const std::vector<int>& module : ModulesInBackwardOrder(specs)) builder.AddModule(module);
  builder.Close();
}

// What the buffer sizes need to know about the units beyond the plan's own fields.
struct UnitTotals {
  int64_t persistent_elements = 0;  // padded elements of persistent units (stage 3)
  int64_t max_gathered_unit = 0;    // largest padded unit that is gathered (not persistent)
  int64_t gathered_units = 0;
};

// Marks persistent units, sets every parameter's flat offset and the largest unit.
UnitTotals PlaceUnits(Plan* plan) {
  const PlanOptions& o = plan->options;
  UnitTotals totals;
  for (Unit& u : plan->units) {
    plan->max_unit_elements = std::max(plan->max_unit_elements, u.padded);
    u.persistent = o.stage == 3 && u.numel <= o.persistence_threshold;
    if (u.persistent) totals.persistent_elements += u.padded;
    for (int i : u.params) {
      plan->params[i].flat_offset = u.flat_offset + plan->params[i].offset_in_unit;
    }
  }
  for (const Unit& u : plan->units) {
    if (!u.persistent) {
      totals.max_gathered_unit = std::max(totals.max_gathered_unit, u.padded);
      ++totals.gathered_units;
    }
  }
  return totals;
}

// Appends a buffer of `elements` (none when that is 0).
void AddBuffer(Plan* plan, std::string name, BufferClass cls, MemoryKind kind, DType dtype,
               int64_t elements, int64_t count = 1) {
  if (elements <= 0) return;
  Buffer b;
  b.name = std::move(name);
  b.cls = cls;
  b.kind = kind;
  b.dtype = dtype;
  b.elements = elements;
  b.count = count;
  b.bytes = elements * static_cast<int64_t>(DTypeSize(dtype));
  plan->buffers.push_back(std::move(b));
}

MemoryKind HostKind(const PlanOptions& o) {
  return o.pin_memory ? MemoryKind::kPinnedHost : MemoryKind::kPageableHost;
}

// params + grads + master + m + v. E: padded elements (all units), S: this rank's shard.
void AddModelState(Plan* plan) {
  const PlanOptions& o = plan->options;
  const int64_t E = plan->padded_elements;
  const int64_t S = plan->shard_elements;
  const DType c = o.compute_dtype;
  const bool mixed = c != DType::kF32;
  const MemoryKind optim_kind = o.offload_optimizer ? HostKind(o) : MemoryKind::kDevice;
  const bool sharded_optim = o.stage >= 1;
  const int64_t optim_elements = sharded_optim ? S : E;
  if (o.stage <= 2) {
    AddBuffer(plan, "params", BufferClass::kParams, MemoryKind::kDevice, c, E);
  } else {
    AddBuffer(plan, "param_shard", BufferClass::kParams,
              o.offload_param ? HostKind(o) : MemoryKind::kDevice, c, S);
  }
  if (o.stage <= 1) {
    AddBuffer(plan, "grads", BufferClass::kGrads, MemoryKind::kDevice, c, E);
  } else {
    AddBuffer(plan, "grad_shard", BufferClass::kGrads, MemoryKind::kDevice, c, S);
  }
  // fp32 training updates the parameters in place, unless they are offloaded: the host then
  // needs its own fp32 copy to run AdamW on.
  if (mixed || o.offload_optimizer) {
    AddBuffer(plan, "master", BufferClass::kMaster, optim_kind, DType::kF32, optim_elements);
  }
  AddBuffer(plan, "exp_avg", BufferClass::kExpAvg, optim_kind, DType::kF32, optim_elements);
  AddBuffer(plan, "exp_avg_sq", BufferClass::kExpAvgSq, optim_kind, DType::kF32, optim_elements);
}

// The working buffers: accumulator, buckets, gather slots, staging, the norm table.
void AddWorkingBuffers(const UnitTotals& totals, Plan* plan) {
  const PlanOptions& o = plan->options;
  const int64_t world = o.world_size;
  const DType c = o.compute_dtype;
  if (o.gradient_accumulation_steps > 1 && o.stage <= 1) {
    // Micro-step gradients are reduced as they arrive and accumulated after the reduction, so
    // that every stage sums in the same order; stages 2-3 accumulate into grad_shard itself.
    AddBuffer(plan, "grad_accumulator", BufferClass::kGradAccumulator, MemoryKind::kDevice, c,
              o.stage == 0 ? plan->padded_elements : plan->shard_elements);
  }
  if (o.stage >= 2) {
    const int64_t buckets = std::min<int64_t>(o.grad_bucket_count, plan->units.size());
    AddBuffer(plan, "grad_bucket", BufferClass::kGradBucket, MemoryKind::kDevice, c,
              buckets * plan->max_unit_elements, buckets);
  }
  if (o.stage == 3) {
    const int64_t unit = totals.max_gathered_unit;
    if (totals.gathered_units > 0) {
      const int64_t live_cap = std::max<int64_t>(1, o.max_live_elements / unit);
      const int64_t want = 1 + (o.prefetch_elements + unit - 1) / unit;
      plan->gather_slots =
          std::max<int64_t>(1, std::min({want, live_cap, totals.gathered_units}));
      AddBuffer(plan, "gather_buffer", BufferClass::kGatherBuffer, MemoryKind::kDevice, c,
                plan->gather_slots * unit, plan->gather_slots);
    }
    AddBuffer(plan, "persistent_params", BufferClass::kPersistentParams, MemoryKind::kDevice, c,
              totals.persistent_elements);
  }
  if (o.offload_optimizer) {
    // Each chunk carries one unit's gradient shard in and its new parameter shard out.
    const int64_t chunk = 2 * (plan->max_unit_elements / world);
    AddBuffer(plan, "offload_staging", BufferClass::kOffloadStaging, HostKind(o), c,
              o.offload_buffer_count * chunk, o.offload_buffer_count);
  }
  if (o.stage >= 1 && world > 1) {
    // Every rank's norm partials meet in one all-gather per step, in device memory because a
    // GPU communicator moves nothing else.
    AddBuffer(plan, "norm_table", BufferClass::kNormTable, MemoryKind::kDevice, DType::kF32,
              world * (static_cast<int64_t>(plan->units.size()) + 1));
  }
}

// Totals per memory kind and model state, then the bytes this rank moves per step.
void CountBytes(const UnitTotals& totals, Plan* plan) {
  for (const Buffer& b : plan->buffers) {
    plan->bytes_by_kind[static_cast<int>(b.kind)] += b.bytes;
    if (IsModelState(b.cls)) plan->model_state_bytes += b.bytes;
  }
  const PlanOptions& o = plan->options;
  const int64_t world = o.world_size;
  const int64_t E = plan->padded_elements;
  const int64_t S = plan->shard_elements;
  const int64_t persistent = totals.persistent_elements;
  // Communication: bytes sent by this rank, (n-1)/n of the full buffer per collective.
  const int64_t cb = static_cast<int64_t>(DTypeSize(o.compute_dtype));
  const int64_t gas = o.gradient_accumulation_steps;
  auto collective = [&](int64_t elements) { return elements / world * (world - 1) * cb; };
  switch (o.stage) {
    case 0:
      plan->comm_bytes_per_step = gas * 2 * collective(E);
      break;
    case 1:
    case 2:
      plan->comm_bytes_per_step = gas * collective(E) + collective(E);
      break;
    case 3:
      // Forward and backward gather every non-persistent unit; persistent units are gathered
      // once after the step.
      plan->comm_bytes_per_step = gas * (2 * collective(E - persistent) + collective(E)) +
                                  collective(persistent);
      break;
  }
  if (o.offload_optimizer) {
    plan->host_transfer_bytes_per_step = 2 * S * cb;  // gradient shard down, parameters up
  }
  if (o.offload_param) {
    plan->host_transfer_bytes_per_step += gas * 2 * S * cb;  // shard up for forward and backward
  }
}

}  // namespace

const char* MemoryKindName(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kDevice:
      return "device";
    case MemoryKind::kPinnedHost:
      return "pinned_host";
    case MemoryKind::kPageableHost:
      return "host";
  }
  return "unknown";
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
    case BufferClass::kGradAccumulator:
      return "grad_accumulator";
    case BufferClass::kGradBucket:
      return "grad_bucket";
    case BufferClass::kGatherBuffer:
      return "gather_buffer";
    case BufferClass::kPersistentParams:
      return "persistent_params";
    case BufferClass::kOffloadStaging:
      return "offload_staging";
    case BufferClass::kNormTable:
      return "norm_table";
  }
  return "unknown";
}

bool IsModelState(BufferClass c) {
  return c == BufferClass::kParams || c == BufferClass::kGrads || c == BufferClass::kMaster ||
         c == BufferClass::kExpAvg || c == BufferClass::kExpAvgSq;
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

  Plan plan;
  plan.options = o;
  absl::StatusOr<std::vector<int64_t>> numel = CountElements(specs, &plan);
  if (!numel.ok()) return numel.status();
  BuildUnits(specs, *numel, &plan);
  const UnitTotals totals = PlaceUnits(&plan);
  AddModelState(&plan);
  AddWorkingBuffers(totals, &plan);
  CountBytes(totals, &plan);
  return plan;
}

}  // namespace memory
}  // namespace zerort
