#include "zero/report.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/bytes.h"

namespace zerort {

namespace {

// "    size classes: 2 x 7087872 + 1 x 39383808 elements" (memory/plan.h): runs of equal slots.
std::string SlotClassesLine(const memory::Buffer& b) {
  std::vector<std::string> runs;
  const std::vector<int64_t>& s = b.slot_elements;
  for (size_t i = 0; i < s.size();) {
    size_t j = i;
    while (j < s.size() && s[j] == s[i]) ++j;
    runs.push_back(absl::StrCat(j - i, " x ", s[i]));
    i = j;
  }
  return absl::StrCat("    size classes: ", absl::StrJoin(runs, " + "), " elements\n");
}

// The declared parameters of each unit whose trainer gradients are copied, with the reason.
std::vector<std::pair<std::string, const memory::Unit*>> CopiedTensors(const memory::Plan& plan) {
  std::vector<std::pair<std::string, const memory::Unit*>> out;
  for (const memory::Unit& u : plan.units) {
    if (u.grad_source != memory::GradSource::kCopied) continue;
    std::vector<std::string> names;
    for (int i : u.params) {
      if (plan.params[i].grad_buffer < 0) continue;
      names.push_back(absl::StrCat("'", plan.params[i].name, "'"));
    }
    out.push_back({absl::StrJoin(names, ", "), &u});
  }
  return out;
}

int TrainableUnits(const memory::Plan& plan, bool offloaded) {
  int n = 0;
  for (const memory::Unit& u : plan.units) n += !u.frozen && u.offloaded == offloaded;
  return n;
}

// "optimizer state: 43.8% offloaded (offload_optimizer.ratio 0.437): 20 of 32 units ..."
std::string OffloadSplitLine(const memory::Plan& plan) {
  const int offloaded = TrainableUnits(plan, true), kept = TrainableUnits(plan, false);
  return absl::StrFormat(
      "optimizer state: %.2f%% offloaded (offload_optimizer.ratio %s): %d of %d units, %s "
      "(master, m, v, reduced gradient) in %s; %d units, %s on the device\n",
      100 * plan.offload_ratio_achieved(), absl::StrCat(plan.options.offload_optimizer_ratio),
      offloaded, offloaded + kept, HumanBytes(plan.offloaded_state_bytes),
      plan.options.offload_optimizer_nvme ? "nvme" : "host memory", kept,
      HumanBytes(plan.device_state_bytes));
}

}  // namespace

std::string PlanTable(const memory::Plan& plan) {
  const memory::PlanOptions& o = plan.options;
  std::string out = absl::StrFormat(
      "%d parameters (%s with padding) in %d units, world size %d, stage %d, %s%s%s\n",
      plan.num_elements, absl::StrCat(plan.padded_elements), plan.units.size(), o.world_size,
      o.stage, DTypeName(o.compute_dtype), o.offload_optimizer ? ", optimizer offload" : "",
      o.offload_param ? ", parameter offload" : "");
  if (memory::StateFormOf(o).compact()) {
    absl::StrAppend(&out, memory::StateFormDescription(o), "\n");
  }
  if (memory::Hierarchical(o)) {
    absl::StrAppendFormat(&out,
                          "HSDP: shard groups of %d consecutive ranks, %d replicas of each shard "
                          "(per-rank figures below are at the group size)\n",
                          memory::ShardGroupSize(o), o.world_size / memory::ShardGroupSize(o));
  }
  if (o.offload_optimizer) out += OffloadSplitLine(plan);
  if (o.hierarchical_gather) {
    absl::StrAppendFormat(&out,
                          "MiCS hierarchical gather: across %d nodes of the group, then within "
                          "%d ranks per node\n",
                          memory::ShardGroupSize(o) / o.ranks_per_node, o.ranks_per_node);
  }
  if (memory::Hpz(o)) {
    absl::StrAppendFormat(&out,
                          "hpZ: secondary partition over %d consecutive ranks (hpz_secondary); "
                          "a unit's gathers after its first since the update stay within them\n",
                          o.hpz_partition_size);
  }
  for (int k = 0; k < memory::kNumMemoryKinds; ++k) {
    if (plan.bytes_by_kind[k] == 0) continue;
    absl::StrAppendFormat(&out, "\n%s memory per rank: %s\n",
                          memory::MemoryKindName(static_cast<memory::MemoryKind>(k)),
                          HumanBytes(plan.bytes_by_kind[k]));
    absl::StrAppendFormat(&out, "  %-18s %-6s %6s %16s %12s\n", "buffer", "dtype", "slots",
                          "elements", "bytes");
    for (const memory::Buffer& b : plan.buffers) {
      if (static_cast<int>(b.kind) != k) continue;
      absl::StrAppendFormat(&out, "  %-18s %-6s %6d %16d %12s\n", b.name, DTypeName(b.dtype),
                            b.count, b.elements, HumanBytes(b.bytes));
      if (!b.slot_elements.empty()) out += SlotClassesLine(b);
    }
  }
  absl::StrAppendFormat(&out, "\nmodel state per rank (params + grads + master + m + v): %s\n",
                        HumanBytes(plan.model_state_bytes));
  if (plan.frozen_elements > 0) {
    absl::StrAppendFormat(&out,
                          "frozen: %d parameters in %d units, no gradients or optimizer state: "
                          "%s saved per rank\n",
                          plan.frozen_elements, plan.units.size() - plan.trainable_units,
                          HumanBytes(plan.frozen_state_bytes_saved));
  }
  const memory::GradHandoff& h = plan.grad_handoff;
  if (h.tensors > 0) {
    absl::StrAppendFormat(
        &out,
        "gradients in the trainer's buffers (grad_buffer %s): %d tensors, %s: %d reduced in "
        "place (%s), %d copied (%s); the engine's gradient storage %s (%s without the "
        "declaration)\n",
        absl::StrJoin(plan.grad_buffers, ", "), h.tensors, HumanBytes(h.bytes),
        h.tensors_in_place, HumanBytes(h.bytes_in_place), h.tensors - h.tensors_in_place,
        HumanBytes(h.bytes_copied), HumanBytes(h.engine_grad_bytes),
        HumanBytes(h.engine_grad_bytes_undeclared));
    for (const auto& [names, unit] : CopiedTensors(plan)) {
      absl::StrAppend(&out, "  copied: ", names, " (unit '", unit->name, "'): ",
                      unit->grad_copy_reason, "\n");
    }
  }
  absl::StrAppendFormat(&out, "sent per rank per step: %s", HumanBytes(plan.comm_bytes_per_step));
  if (memory::Hierarchical(o)) {
    absl::StrAppendFormat(&out, " (within the shard group %s, across groups %s)",
                          HumanBytes(plan.comm_bytes_within_group_per_step),
                          HumanBytes(plan.comm_bytes_across_groups_per_step));
  }
  if (o.ranks_per_node > 0) {
    absl::StrAppendFormat(&out, " (%d ranks per node: intra-node %s, inter-node %s)",
                          o.ranks_per_node, HumanBytes(plan.comm_bytes_intra_node_per_step),
                          HumanBytes(plan.comm_bytes_inter_node_per_step));
  }
  if (plan.comm_control_bytes_per_step > 0) {
    absl::StrAppendFormat(&out, "; of which control exchange (norm table, step agreement) over "
                          "the world: %s", HumanBytes(plan.comm_control_bytes_per_step));
  }
  if (o.stage == 3 && plan.stage3_gathers_per_step > 0) {
    absl::StrAppendFormat(&out, "; %d unit gathers per step for a trainer that holds one unit "
                          "at a time, forward from the last unit to the first and backward "
                          "back (units still in their slots are not gathered again)",
                          plan.stage3_gathers_per_step);
  }
  if (plan.host_transfer_bytes_per_step > 0) {
    absl::StrAppendFormat(&out, "; device<->host copies per step: %s",
                          HumanBytes(plan.host_transfer_bytes_per_step));
  }
  out += "\n";
  return out;
}

nlohmann::ordered_json PlanJson(const memory::Plan& plan) {
  const memory::PlanOptions& o = plan.options;
  nlohmann::ordered_json j;
  j["params"] = plan.num_elements;
  j["padded_params"] = plan.padded_elements;
  j["world_size"] = o.world_size;
  j["rank"] = o.rank;
  j["stage"] = o.stage;
  j["compute_dtype"] = std::string(DTypeName(o.compute_dtype));
  j["offload_optimizer"] = o.offload_optimizer;
  j["offload_param"] = o.offload_param;
  // The optimizer state's form (docs/compact_state.md) and its bytes per owned element.
  const memory::OptimizerStateForm form = memory::StateFormOf(o);
  j["master_form"] = memory::MasterFormName(form.master);
  j["master_in_params"] = form.master_in_params;
  j["moment_dtype"] = std::string(DTypeName(form.moment_dtype));
  j["optimizer_state_bytes_per_element"] = form.BytesPerElement();
  j["units"] = plan.units.size();
  j["max_unit_elements"] = plan.max_unit_elements;
  j["per_rank"] = nlohmann::ordered_json{{"model_state_bytes", plan.model_state_bytes},
                   {"device_bytes", plan.device_bytes()},
                   {"pinned_host_bytes", plan.pinned_host_bytes()},
                   {"host_bytes", plan.host_bytes()},
                   {"nvme_bytes", plan.nvme_bytes()},
                   {"shard_elements", plan.shard_elements},
                   {"frozen_params", plan.frozen_elements},
                   {"frozen_state_bytes_saved", plan.frozen_state_bytes_saved}};
  j["comm_bytes_per_step"] = plan.comm_bytes_per_step;
  // Part of comm_bytes_per_step (and of its link class): the norm table and step agreement.
  j["comm_control_bytes_per_step"] = plan.comm_control_bytes_per_step;
  j["stage3_gathers_per_step"] = plan.stage3_gathers_per_step;
  // HSDP: the same bytes by link class (flat: all within the one group of every rank).
  j["shard_group_size"] = memory::ShardGroupSize(o);
  j["comm_bytes_within_group_per_step"] = plan.comm_bytes_within_group_per_step;
  j["comm_bytes_across_groups_per_step"] = plan.comm_bytes_across_groups_per_step;
  // With zerort.ranks_per_node: by whether a collective stays within one node.
  j["hpz_partition_size"] = o.hpz_partition_size;
  j["hierarchical_gather"] = o.hierarchical_gather;
  j["ranks_per_node"] = o.ranks_per_node;
  j["comm_bytes_intra_node_per_step"] = plan.comm_bytes_intra_node_per_step;
  j["comm_bytes_inter_node_per_step"] = plan.comm_bytes_inter_node_per_step;
  j["host_transfer_bytes_per_step"] = plan.host_transfer_bytes_per_step;
  if (o.offload_optimizer) {
    // The split of the optimizer state (offload_optimizer.ratio): what was asked, what whole
    // units achieve, and each part's elements and bytes (master, m, v, reduced gradient).
    j["optimizer_offload"] = nlohmann::ordered_json{
        {"ratio", o.offload_optimizer_ratio},
        {"ratio_achieved", plan.offload_ratio_achieved()},
        {"offloaded_units", TrainableUnits(plan, true)},
        {"device_units", TrainableUnits(plan, false)},
        {"offloaded_elements", plan.offloaded_state_elements},
        {"device_elements", plan.device_state_elements},
        {"offloaded_bytes", plan.offloaded_state_bytes},
        {"device_bytes", plan.device_state_bytes}};
  }
  nlohmann::ordered_json buffers = nlohmann::ordered_json::array();
  for (const memory::Buffer& b : plan.buffers) {
    buffers.push_back(nlohmann::ordered_json{{"name", b.name},
                       {"class", memory::BufferClassName(b.cls)},
                       {"kind", memory::MemoryKindName(b.kind)},
                       {"dtype", std::string(DTypeName(b.dtype))},
                       {"slots", b.count},
                       {"elements", b.elements},
                       {"bytes", b.bytes},
                       {"model_state", memory::IsModelState(b.cls)}});
    if (!b.slot_elements.empty()) buffers.back()["slot_elements"] = b.slot_elements;
  }
  j["buffers"] = std::move(buffers);
  // Gradients the trainer declared in its own buffers (memory::ParamSpec::grad_buffer).
  const memory::GradHandoff& h = plan.grad_handoff;
  nlohmann::ordered_json copied = nlohmann::ordered_json::array();
  for (const memory::Unit& u : plan.units) {
    if (u.grad_source != memory::GradSource::kCopied) continue;
    for (int i : u.params) {
      if (plan.params[i].grad_buffer < 0) continue;
      copied.push_back(nlohmann::ordered_json{
          {"tensor", plan.params[i].name}, {"unit", u.name}, {"reason", u.grad_copy_reason}});
    }
  }
  j["grad_handoff"] = nlohmann::ordered_json{
      {"buffers", plan.grad_buffers},
      {"tensors", h.tensors},
      {"tensors_in_place", h.tensors_in_place},
      {"bytes", h.bytes},
      {"bytes_in_place", h.bytes_in_place},
      {"bytes_copied", h.bytes_copied},
      {"engine_grad_bytes", h.engine_grad_bytes},
      {"engine_grad_bytes_undeclared", h.engine_grad_bytes_undeclared},
      {"copied", std::move(copied)}};
  return j;
}

std::string DeviceBudgetTable(const DeviceBudget& d, int64_t budget_bytes) {
  if (!d.counted) return absl::StrCat("note: ", d.note, "\n");
  std::string out = "\ndevice budget per rank:\n";
  auto row = [&out](int indent, absl::string_view name, int64_t bytes) {
    absl::StrAppendFormat(&out, "  %*s%-*s %12s\n", indent, "", 30 - indent, name,
                          HumanBytes(bytes));
  };
  row(0, "model-state buffers", d.model_state_bytes);
  row(0, "activations", d.activation_bytes);
  for (const BudgetLine& l : d.activations) row(2, l.name, l.bytes);
  row(0, "reserves", d.reserve_bytes);
  for (const BudgetLine& l : d.reserves) row(2, l.name, l.bytes);
  row(0, "total", d.total_bytes);
  absl::StrAppend(&out, "  activations: ", d.activation_source, "\n");
  if (budget_bytes > 0) {
    absl::StrAppend(&out, "  budget ", HumanBytes(budget_bytes), ": ",
                    d.total_bytes <= budget_bytes
                        ? absl::StrCat(HumanBytes(budget_bytes - d.total_bytes), " left")
                        : absl::StrCat(HumanBytes(d.total_bytes - budget_bytes), " OVER"),
                    "\n");
  }
  return out;
}

nlohmann::ordered_json DeviceBudgetJson(const DeviceBudget& d) {
  nlohmann::ordered_json j;
  j["counted"] = d.counted;
  j["note"] = d.note;
  j["micro_batch"] = d.micro_batch;
  j["activation_source"] = d.activation_source;
  j["model_state_bytes"] = d.model_state_bytes;
  nlohmann::ordered_json acts = nlohmann::ordered_json::object();
  for (const BudgetLine& l : d.activations) acts[l.name] = l.bytes;
  j["activations"] = std::move(acts);
  j["activation_bytes"] = d.activation_bytes;
  nlohmann::ordered_json reserves = nlohmann::ordered_json::object();
  for (const BudgetLine& l : d.reserves) reserves[l.name] = l.bytes;
  j["reserves"] = std::move(reserves);
  j["reserve_bytes"] = d.reserve_bytes;
  j["total_bytes"] = d.total_bytes;
  return j;
}

}  // namespace zerort
