#include "base/bytes.h"

#include <cctype>
#include <cmath>
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

std::string GroupedBytes(int64_t bytes) {
  std::string digits = absl::StrCat(bytes), grouped;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) grouped += ',';
    grouped += digits[i];
  }
  return grouped;
}

absl::StatusOr<int64_t> ParseBytes(absl::string_view text) {
  std::string s(absl::StripAsciiWhitespace(text));
  size_t split = 0;
  // A sign only right after the exponent's e: "1e-3GiB" is a number, "-1" is not.
  auto exponent_sign = [&](size_t i) {
    return (s[i] == '-' || s[i] == '+') && i > 0 && (s[i - 1] == 'e' || s[i - 1] == 'E');
  };
  while (split < s.size() && (std::isdigit(static_cast<unsigned char>(s[split])) ||
                              s[split] == '.' || s[split] == 'e' || s[split] == 'E' ||
                              exponent_sign(split))) {
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
      const int64_t rounded = static_cast<int64_t>(std::llround(bytes));
      // 0 reads as "no limit" in a budget: a tiny fraction must not turn into that.
      if (rounded == 0 && bytes > 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("byte size '", text, "' rounds to 0 bytes"));
      }
      return rounded;
    }
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown unit '", unit, "' in byte size '", text,
                                                 "': use B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"));
}

}  // namespace zerort
