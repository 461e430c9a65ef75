#include "zero/internal/adamw_groups.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"

namespace zerort {
namespace zero_internal {
namespace {

// "base[l]" -> (base, l); nullopt unless the name ends in a bracketed decimal index.
std::optional<std::pair<std::string, int64_t>> SplitIndex(absl::string_view name) {
  if (name.size() < 4 || name.back() != ']') return std::nullopt;
  const size_t open = name.rfind('[');
  if (open == absl::string_view::npos || open == 0 || open + 2 > name.size() - 1) {
    return std::nullopt;
  }
  int64_t l = 0;
  for (size_t k = open + 1; k + 1 < name.size(); ++k) {
    if (name[k] < '0' || name[k] > '9' || l > (int64_t{1} << 40)) return std::nullopt;
    l = l * 10 + (name[k] - '0');
  }
  return std::make_pair(std::string(name.substr(0, open)), l);
}

}  // namespace

std::vector<int64_t> StackedLayers(const std::vector<memory::ParamSpec>& specs) {
  std::vector<int64_t> layers(specs.size(), 0);
  for (size_t i = 0; i < specs.size();) {
    const auto first = SplitIndex(specs[i].name);
    const auto first_module = SplitIndex(specs[i].module);
    size_t j = i;
    // A run is what StackedSlices returns: base[0], base[1], ... in modules mod[0], mod[1], ...,
    // one slice shape.
    while (first && first->second == 0 && first_module && j < specs.size()) {
      const auto n = SplitIndex(specs[j].name);
      const auto m = SplitIndex(specs[j].module);
      const int64_t l = static_cast<int64_t>(j - i);
      if (!n || !m || n->first != first->first || m->first != first_module->first ||
          n->second != l || m->second != l || specs[j].shape != specs[i].shape) {
        break;
      }
      ++j;
    }
    if (j == i) {
      ++i;
      continue;
    }
    for (size_t k = i; k < j; ++k) layers[k] = static_cast<int64_t>(j - i);
    i = j;
  }
  return layers;
}

namespace {

// no_decay_1d decides on the tensor the trainer holds per layer: a StackedSlices slice's own
// shape (so llm.c's [L, C] biases and gains, declared as slices, are vectors), else the
// registered shape. Where that reading may not be what the trainer means, a note says so.
bool NoDecay1d(const memory::ParamSpec& spec, int64_t layers, const std::vector<int64_t>& runs,
               std::vector<std::string>* notes) {
  const bool vector = spec.shape.size() == 1;
  if (notes == nullptr || vector) return vector;
  const std::string shape = absl::StrCat("[", absl::StrJoin(spec.shape, ", "), "]");
  if (layers == 0 && SplitIndex(spec.name) && SplitIndex(spec.module)) {
    notes->push_back(absl::StrCat(
        "no_decay_1d: parameter '", spec.name, "' ", shape, " is named like a StackedSlices "
        "slice but is not part of a complete run base[0..L-1] of one shape: decided (decayed) "
        "on its own shape"));
  } else if (layers == 0 && std::count(runs.begin(), runs.end(), spec.shape[0]) > 0) {
    notes->push_back(absl::StrCat(
        "no_decay_1d: parameter '", spec.name, "' ", shape, " is decayed as a matrix, but its "
        "leading dimension is the layer count of the model's stacked slices: if it stacks "
        "per-layer biases or gains (llm.c's layout), declare it with StackedSlices so that "
        "each [", absl::StrJoin(spec.shape.begin() + 1, spec.shape.end(), ", "),
        "] slice is a vector, or give it a group"));
  } else if (std::count(spec.shape.begin(), spec.shape.end(), 1) > 0) {
    notes->push_back(absl::StrCat(
        "no_decay_1d: parameter '", spec.name, "' ", shape, " has a dimension of 1: decayed "
        "as a matrix; give it a group if it is a vector"));
  }
  return false;
}

}  // namespace

absl::StatusOr<GroupChoice> ResolveParamGroups(
    const std::vector<memory::ParamSpec>& specs, const std::vector<ParamGroupConfig>& patterns,
    const std::vector<std::optional<ParamGroup>>& explicit_groups, bool no_decay_1d,
    std::vector<std::string>* notes) {
  if (!explicit_groups.empty() && explicit_groups.size() != specs.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "EngineOptions::param_groups has ", explicit_groups.size(), " entries for ",
        specs.size(), " parameters: give one per parameter, or none"));
  }
  GroupChoice c;
  // Groups [0, patterns) are the config's; later ones are explicit or no-decay groups.
  for (size_t k = 0; k < patterns.size(); ++k) {
    const ParamGroupConfig& p = patterns[k];
    RETURN_IF_ERROR(ValidateGroup({p.weight_decay, p.lr_scale},
                                  absl::StrCat("zerort.param_groups[", k, "] ('", p.pattern,
                                               "')")));
    c.groups.push_back({p.weight_decay, p.lr_scale});
  }
  std::vector<bool> used(patterns.size(), false);
  int no_decay = -1;
  const std::vector<int64_t> layers = StackedLayers(specs);
  std::vector<int64_t> runs;  // the layer counts of the stacked runs
  for (int64_t l : layers) {
    if (l > 0 && std::find(runs.begin(), runs.end(), l) == runs.end()) runs.push_back(l);
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    int g = -1;
    if (!explicit_groups.empty() && explicit_groups[i].has_value()) {
      RETURN_IF_ERROR(ValidateGroup(*explicit_groups[i],
                                    absl::StrCat("parameter '", specs[i].name, "' group")));
      g = static_cast<int>(c.groups.size());
      c.groups.push_back(*explicit_groups[i]);
    }
    for (size_t k = 0; g < 0 && k < patterns.size(); ++k) {
      if (GlobMatch(patterns[k].pattern, specs[i].name)) {
        g = static_cast<int>(k);
        used[k] = true;
      }
    }
    if (g < 0 && no_decay_1d && NoDecay1d(specs[i], layers[i], runs, notes)) {
      if (no_decay < 0) {
        no_decay = static_cast<int>(c.groups.size());
        c.groups.push_back({0.0, 1.0});
      }
      g = no_decay;
    }
    c.of_param.push_back(g);
  }
  for (size_t k = 0; k < patterns.size(); ++k) {
    if (used[k] || notes == nullptr) continue;
    notes->push_back(absl::StrCat("zerort.param_groups[", k, "]: pattern '",
                                  patterns[k].pattern,
                                  "' matches no parameter (or only ones an earlier group or "
                                  "EngineOptions::param_groups took)"));
  }
  return c;
}

AdamWGroups::AdamWGroups(const memory::Plan& plan, const ShardLayout& layout,
                         GroupChoice choice)
    : choice_(std::move(choice)), by_group_(choice_.groups.size() + 1) {
  // Frozen units, after the trainable ones, have no optimizer state: no ranges.
  for (size_t u = 0; u < static_cast<size_t>(plan.trainable_units); ++u) {
    const Region& reg = layout.region(static_cast<int>(u));
    const int64_t lo = reg.unit_begin, hi = reg.unit_begin + reg.n;
    std::vector<int> params = plan.units[u].params;
    std::sort(params.begin(), params.end(), [&](int a, int b) {
      return plan.params[a].offset_in_unit < plan.params[b].offset_in_unit;
    });
    std::vector<offload::AdamWRange> ranges;
    std::vector<int> groups;
    for (int i : params) {
      const memory::ParamLayout& p = plan.params[i];
      if (p.offset_in_unit + p.numel <= lo || p.offset_in_unit >= hi) continue;
      const int g = choice_.of_param[i];
      if (!groups.empty() && groups.back() == g) continue;  // extends the previous range
      // The first range starts at the region's start: a parameter straddling into it.
      const size_t begin = ranges.empty() ? 0 : static_cast<size_t>(p.offset_in_unit - lo);
      if (!ranges.empty()) ranges.back().end = begin;
      ranges.push_back({begin, 0, {}});
      groups.push_back(g);
    }
    if (ranges.empty()) {  // only padding
      ranges.push_back({0, 0, {}});
      groups.push_back(-1);
    }
    ranges.back().end = static_cast<size_t>(reg.n);
    ranges_.push_back(std::move(ranges));
    range_group_.push_back(std::move(groups));
  }
}

absl::StatusOr<const std::vector<std::vector<offload::AdamWRange>>*> AdamWGroups::Prepare(
    const AdamWScalars& s, int64_t step) {
  for (size_t g = 0; g < by_group_.size(); ++g) {
    double lr = s.lr, wd = s.weight_decay;
    if (g > 0) {
      lr *= choice_.groups[g - 1].lr_scale;
      wd = choice_.groups[g - 1].weight_decay;
    }
    ASSIGN_OR_RETURN(by_group_[g],
                     offload::MakeAdamWStepParams(lr, s.beta1, s.beta2, s.eps, wd, step));
  }
  for (size_t u = 0; u < ranges_.size(); ++u) {
    for (size_t k = 0; k < ranges_[u].size(); ++k) {
      ranges_[u][k].params = by_group_[range_group_[u][k] + 1];
    }
  }
  return &ranges_;
}

}  // namespace zero_internal
}  // namespace zerort
