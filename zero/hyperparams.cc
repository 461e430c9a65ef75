#include "zero/hyperparams.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "offload/cpu_adamw.h"

namespace zerort {

AdamWScalars ScalarsOf(const OptimizerConfig& o) {
  return {o.lr, o.beta1, o.beta2, o.eps, o.weight_decay};
}

absl::Status ValidateScalars(const AdamWScalars& s, absl::string_view who) {
  // The step constants' own checks name the value ("AdamW lr=-1 must be >= 0").
  const absl::Status st = offload::MakeAdamWStepParams(s.lr, s.beta1, s.beta2, s.eps,
                                                       s.weight_decay, 1)
                              .status();
  if (st.ok()) return st;
  return absl::InvalidArgumentError(absl::StrCat(who, ": ", st.message()));
}

absl::Status ValidateGroup(const ParamGroup& g, absl::string_view who) {
  if (!std::isfinite(g.weight_decay) || g.weight_decay < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": weight_decay=", g.weight_decay, " must be finite and >= 0"));
  }
  if (!std::isfinite(g.lr_scale) || g.lr_scale < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": lr_scale=", g.lr_scale, " must be finite and >= 0"));
  }
  return absl::OkStatus();
}

bool GlobMatch(absl::string_view pattern, absl::string_view name) {
  // Iterative matcher with one backtrack point: the last '*' and where it resumed.
  size_t p = 0, n = 0, star = absl::string_view::npos, resume = 0;
  while (n < name.size()) {
    if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == name[n])) {
      ++p;
      ++n;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      resume = n;
    } else if (star != absl::string_view::npos) {
      p = star + 1;
      n = ++resume;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

}  // namespace zerort
