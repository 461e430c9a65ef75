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
  const int64_t world = o.world_size;
  const int64_t unit_multiple = world * o.shard_alignment;

  std::vector<int64_t> numel(specs.size());
  {
    absl::flat_hash_set<absl::string_view> names;
    names.reserve(specs.size());
    for (size_t i = 0; i < specs.size(); ++i) {
      auto n = Numel(specs[i]);
      if (!n.ok()) return n.status();
      numel[i] = *n;
      plan.num_params += *n;
      if (!names.insert(specs[i].name).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("parameter name '", specs[i].name, "' is registered twice"));
      }
    }
  }

  // Units: merge whole modules up to the target; split oversized modules at parameter bounds.
  plan.params.resize(specs.size());
  Unit current;
  std::string first_module, last_module;
  auto close_unit = [&]() {
    if (current.params.empty()) return;
    current.name = first_module == last_module ? first_module
                                                : absl::StrCat(first_module, "..", last_module);
    current.padded = RoundUp(current.numel, unit_multiple);
    current.shard = current.padded / world;
    current.flat_offset = plan.padded_elements;
    current.shard_offset = plan.shard_elements;
    plan.padded_elements += current.padded;
    plan.shard_elements += current.shard;
    plan.units.push_back(std::move(current));
    current = Unit();
  };
  auto add_param = [&](int i) {
    const int64_t offset = RoundUp(current.numel, o.param_alignment);
    ParamLayout& p = plan.params[i];
    p.name = specs[i].name;
    p.shape = specs[i].shape;
    p.numel = numel[i];
    p.unit = static_cast<int>(plan.units.size());
    p.offset_in_unit = offset;
    current.numel = offset + numel[i];
    current.params.push_back(i);
  };
  auto aligned_size = [&](const std::vector<int>& params) {
    int64_t size = 0;
    for (int i : params) size = RoundUp(size, o.param_alignment) + numel[i];
    return size;
  };
  for (const std::vector<int>& module : ModulesInBackwardOrder(specs)) {
    const std::string& module_name = specs[module.front()].module;
    const int64_t size = aligned_size(module);
    if (!current.params.empty() &&
        RoundUp(current.numel, o.param_alignment) + size > o.unit_target_elements) {
      close_unit();
    }
    for (int i : module) {
      if (!current.params.empty() &&
          RoundUp(current.numel, o.param_alignment) + numel[i] > o.unit_target_elements) {
        close_unit();
      }
      if (current.params.empty()) first_module = module_name;
      last_module = module_name;
      add_param(i);
    }
  }
  close_unit();

  int64_t persistent_elements = 0;  // padded elements of persistent units
  for (Unit& u : plan.units) {
    plan.max_unit_elements = std::max(plan.max_unit_elements, u.padded);
    u.persistent = o.stage == 3 && u.numel <= o.persistence_threshold;
    if (u.persistent) persistent_elements += u.padded;
    for (int i : u.params) plan.params[i].flat_offset = u.flat_offset + plan.params[i].offset_in_unit;
  }
  int64_t max_gathered_unit = 0;
  int64_t gathered_units = 0;
  for (const Unit& u : plan.units) {
    if (!u.persistent) {
      max_gathered_unit = std::max(max_gathered_unit, u.padded);
      ++gathered_units;
    }
  }

  // Buffers. E: padded elements (all units), S: this rank's shard of every unit.
  const int64_t E = plan.padded_elements;
  const int64_t S = plan.shard_elements;
  const DType c = o.compute_dtype;
  const bool mixed = c != DType::kF32;
  const MemoryKind host_kind = o.pin_memory ? MemoryKind::kPinnedHost : MemoryKind::kPageableHost;
  const MemoryKind optim_kind = o.offload_optimizer ? host_kind : MemoryKind::kDevice;
  auto add = [&](std::string name, BufferClass cls, MemoryKind kind, DType dtype,
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
    plan.buffers.push_back(std::move(b));
  };

  const bool sharded_optim = o.stage >= 1;
  const int64_t optim_elements = sharded_optim ? S : E;
  if (o.stage <= 2) {
    add("params", BufferClass::kParams, MemoryKind::kDevice, c, E);
  } else {
    add("param_shard", BufferClass::kParams,
        o.offload_param ? host_kind : MemoryKind::kDevice, c, S);
  }
  if (o.stage <= 1) {
    add("grads", BufferClass::kGrads, MemoryKind::kDevice, c, E);
  } else {
    add("grad_shard", BufferClass::kGrads, MemoryKind::kDevice, c, S);
  }
  // fp32 training updates the parameters in place, unless they are offloaded: the host then
  // needs its own fp32 copy to run AdamW on.
  if (mixed || o.offload_optimizer) {
    add("master", BufferClass::kMaster, optim_kind, DType::kF32, optim_elements);
  }
  add("exp_avg", BufferClass::kExpAvg, optim_kind, DType::kF32, optim_elements);
  add("exp_avg_sq", BufferClass::kExpAvgSq, optim_kind, DType::kF32, optim_elements);

  if (o.gradient_accumulation_steps > 1 && o.stage <= 1) {
    // Micro-step gradients are reduced as they arrive and accumulated after the reduction, so
    // that every stage sums in the same order; stages 2-3 accumulate into grad_shard itself.
    add("grad_accumulator", BufferClass::kGradAccumulator, MemoryKind::kDevice, c,
        o.stage == 0 ? E : S);
  }
  if (o.stage >= 2) {
    const int64_t buckets = std::min<int64_t>(o.grad_bucket_count, plan.units.size());
    add("grad_bucket", BufferClass::kGradBucket, MemoryKind::kDevice, c,
        buckets * plan.max_unit_elements, buckets);
  }
  if (o.stage == 3) {
    if (gathered_units > 0) {
      const int64_t live_cap = std::max<int64_t>(1, o.max_live_elements / max_gathered_unit);
      const int64_t want = 1 + (o.prefetch_elements + max_gathered_unit - 1) / max_gathered_unit;
      plan.gather_slots = std::max<int64_t>(1, std::min({want, live_cap, gathered_units}));
      add("gather_buffer", BufferClass::kGatherBuffer, MemoryKind::kDevice, c,
          plan.gather_slots * max_gathered_unit, plan.gather_slots);
    }
    add("persistent_params", BufferClass::kPersistentParams, MemoryKind::kDevice, c,
        persistent_elements);
  }
  if (o.offload_optimizer) {
    // Each chunk carries one unit's gradient shard in and its new parameter shard out.
    const int64_t chunk = 2 * (plan.max_unit_elements / world);
    add("offload_staging", BufferClass::kOffloadStaging, host_kind, c,
        o.offload_buffer_count * chunk, o.offload_buffer_count);
  }

  if (o.stage >= 1 && world > 1) {
    // Every rank's norm partials meet in one all-gather per step, in device memory because a
    // GPU communicator moves nothing else.
    add("norm_table", BufferClass::kNormTable, MemoryKind::kDevice, DType::kF32,
        world * (static_cast<int64_t>(plan.units.size()) + 1));
  }

  for (const Buffer& b : plan.buffers) {
    plan.bytes_by_kind[static_cast<int>(b.kind)] += b.bytes;
    if (IsModelState(b.cls)) plan.model_state_bytes += b.bytes;
  }

  // Communication: bytes sent by this rank, (n-1)/n of the full buffer per collective.
  const int64_t cb = static_cast<int64_t>(DTypeSize(c));
  const int64_t gas = o.gradient_accumulation_steps;
  auto collective = [&](int64_t elements) { return elements / world * (world - 1) * cb; };
  switch (o.stage) {
    case 0:
      plan.comm_bytes_per_step = gas * 2 * collective(E);
      break;
    case 1:
    case 2:
      plan.comm_bytes_per_step = gas * collective(E) + collective(E);
      break;
    case 3:
      // Forward and backward gather every non-persistent unit; persistent units are gathered
      // once after the step.
      plan.comm_bytes_per_step =
          gas * (2 * collective(E - persistent_elements) + collective(E)) +
          collective(persistent_elements);
      break;
  }
  if (o.offload_optimizer) {
    plan.host_transfer_bytes_per_step = 2 * S * cb;  // gradient shard down, parameters up
  }
  if (o.offload_param) {
    plan.host_transfer_bytes_per_step += gas * 2 * S * cb;  // shard up for forward and backward
  }
  return plan;
}

}  // namespace memory
}  // namespace zerort
