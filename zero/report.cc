#include "zero/report.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace zerort {

std::string HumanBytes(int64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (std::fabs(v) >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  if (u == 0) return absl::StrCat(bytes, " B");
  return absl::StrFormat("%.2f %s", v, kUnits[u]);
}

absl::StatusOr<int64_t> ParseBytes(absl::string_view text) {
  std::string s(absl::StripAsciiWhitespace(text));
  size_t split = 0;
  while (split < s.size() && (std::isdigit(static_cast<unsigned char>(s[split])) ||
                              s[split] == '.' || s[split] == 'e' || s[split] == 'E' ||
                              s[split] == '+')) {
    ++split;
  }
  double number = 0;
  const std::string unit(absl::StripAsciiWhitespace(absl::string_view(s).substr(split)));
  if (split == 0 || !absl::SimpleAtod(s.substr(0, split), &number) || number < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read a byte size from '", text, "': expected e.g. 80GiB, 16GB, 8e10"));
  }
  static const struct {
    const char* name;
    double scale;
  } kUnits[] = {{"", 1},          {"b", 1},          {"kb", 1e3},           {"mb", 1e6},
                {"gb", 1e9},      {"tb", 1e12},      {"kib", 1024.0},       {"mib", 1048576.0},
                {"gib", 1073741824.0}, {"tib", 1099511627776.0}, {"k", 1024.0}, {"m", 1048576.0},
                {"g", 1073741824.0},   {"t", 1099511627776.0}};
  const std::string lower = absl::AsciiStrToLower(unit);
  for (const auto& u : kUnits) {
    if (lower == u.name) {
      const double bytes = number * u.scale;
      if (bytes > 9.0e18) {
        return absl::InvalidArgumentError(absl::StrCat("byte size '", text, "' is too large"));
      }
      return static_cast<int64_t>(std::llround(bytes));
    }
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown unit '", unit, "' in byte size '", text,
                                                 "': use B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"));
}

std::string PlanTable(const memory::Plan& plan) {
  const memory::PlanOptions& o = plan.options;
  std::string out = absl::StrFormat(
      "%d parameters (%s with padding) in %d units, world size %d, stage %d, %s%s%s\n",
      plan.num_params, absl::StrCat(plan.padded_elements), plan.units.size(), o.world_size,
      o.stage, DTypeName(o.compute_dtype), o.offload_optimizer ? ", optimizer offload" : "",
      o.offload_param ? ", parameter offload" : "");
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
    }
  }
  absl::StrAppendFormat(&out, "\nmodel state per rank (params + grads + master + m + v): %s\n",
                        HumanBytes(plan.model_state_bytes));
  absl::StrAppendFormat(&out, "sent per rank per step: %s", HumanBytes(plan.comm_bytes_per_step));
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
  j["params"] = plan.num_params;
  j["padded_params"] = plan.padded_elements;
  j["world_size"] = o.world_size;
  j["rank"] = o.rank;
  j["stage"] = o.stage;
  j["compute_dtype"] = std::string(DTypeName(o.compute_dtype));
  j["offload_optimizer"] = o.offload_optimizer;
  j["offload_param"] = o.offload_param;
  j["units"] = plan.units.size();
  j["max_unit_elements"] = plan.max_unit_elements;
  j["per_rank"] = nlohmann::ordered_json{{"model_state_bytes", plan.model_state_bytes},
                   {"device_bytes", plan.device_bytes()},
                   {"pinned_host_bytes", plan.pinned_host_bytes()},
                   {"host_bytes", plan.host_bytes()},
                   {"shard_elements", plan.shard_elements}};
  j["comm_bytes_per_step"] = plan.comm_bytes_per_step;
  j["host_transfer_bytes_per_step"] = plan.host_transfer_bytes_per_step;
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
  }
  j["buffers"] = std::move(buffers);
  return j;
}

}  // namespace zerort
