#include "cli/flags.h"

#include <algorithm>
#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace zerort {

absl::StatusOr<Flags> Flags::Parse(const std::vector<std::string>& args,
                                   const std::vector<std::string>& valued,
                                   const std::vector<std::string>& booleans) {
  Flags f;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (!absl::StartsWith(a, "--")) {
      return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", a, "'"));
    }
    std::string name = a.substr(2), value;
    const size_t eq = name.find('=');
    const bool has_eq = eq != std::string::npos;
    if (has_eq) {
      value = name.substr(eq + 1);
      name.resize(eq);
    }
    const bool is_valued = std::find(valued.begin(), valued.end(), name) != valued.end();
    const bool is_bool = std::find(booleans.begin(), booleans.end(), name) != booleans.end();
    if (!is_valued && !is_bool) {
      std::vector<std::string> known;
      for (const auto& v : valued) known.push_back("--" + v);
      for (const auto& b : booleans) known.push_back("--" + b);
      return absl::InvalidArgumentError(absl::StrCat("unknown flag '--", name,
                                                     "': known flags are ",
                                                     absl::StrJoin(known, ", ")));
    }
    if (is_valued && !has_eq) {
      if (i + 1 >= args.size()) {
        return absl::InvalidArgumentError(absl::StrCat("flag '--", name, "' needs a value"));
      }
      value = args[++i];
    }
    if (is_bool) {
      if (!has_eq) value = "true";
      if (value != "true" && value != "false") {
        return absl::InvalidArgumentError(
            absl::StrCat("flag '--", name, "' value '", value, "' must be true or false"));
      }
      if (value == "false") continue;
    }
    if (!f.values_.emplace(name, value).second) {
      return absl::InvalidArgumentError(absl::StrCat("flag '--", name, "' is given twice"));
    }
  }
  return f;
}

std::string Flags::Get(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second;
}

absl::StatusOr<int64_t> Flags::GetInt(const std::string& name, int64_t fallback, int64_t min,
                                      int64_t max) const {
  if (!Has(name)) return fallback;
  const std::string text = Get(name);
  int64_t v = 0;
  // Digits are read exactly; a double (1e6) is accepted only when it is integral and inside
  // int64's range, checked before the cast: casting 2^63 or NaN to int64 is undefined.
  bool ok = absl::SimpleAtoi(text, &v);
  if (!ok) {
    double d = 0;
    ok = absl::SimpleAtod(text, &d) && std::isfinite(d) && d == std::trunc(d) &&
         d >= -9223372036854775808.0 && d < 9223372036854775808.0;
    if (ok) v = static_cast<int64_t>(d);
  }
  if (!ok || v < min || v > max) {
    return absl::InvalidArgumentError(absl::StrCat(
        "flag '--", name, "' value '", text, "' must be an integer ",
        max == std::numeric_limits<int64_t>::max() ? absl::StrCat(">= ", min)
                                                   : absl::StrCat("in ", min, "..", max)));
  }
  return v;
}

absl::StatusOr<DType> Flags::GetComputeDType(const std::string& name, DType fallback) const {
  if (!Has(name)) return fallback;
  const std::string p = Get(name);
  if (p == "bf16") return DType::kBF16;
  if (p == "fp16") return DType::kF16;
  if (p == "fp32") return DType::kF32;
  return absl::InvalidArgumentError(
      absl::StrCat("flag '--", name, "' value '", p, "' must be bf16, fp16 or fp32"));
}

}  // namespace zerort
