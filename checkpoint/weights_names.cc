// WeightsNameMap (checkpoint/weights.h): the rename rules between a file's tensor names and the
// model's parameter names, parsed from text, compiled once, applied first match first.
#include <algorithm>
#include <fstream>
#include <iterator>
#include <memory>
#include <regex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/status.h"
#include "checkpoint/weights.h"
#include "zero/hyperparams.h"

namespace zerort {

struct WeightsNameMap::Impl {
  std::vector<WeightsNameRule> rules;
  std::vector<std::string> ignore;
  std::string source;             // where the rules came from, for messages ("" in code)
  std::vector<std::regex> regex;  // per rule: the compiled glob or regex (unused otherwise)
};

namespace {

using Kind = WeightsNameRule::Kind;

absl::string_view KindName(Kind k) {
  switch (k) {
    case Kind::kExact: return "exact";
    case Kind::kPrefix: return "prefix";
    case Kind::kGlob: return "glob";
    case Kind::kRegex: return "regex";
  }
  return "?";
}

// A glob as a regex: each '*' a capture of any run, '?' any one character, the rest literal.
std::string GlobToRegex(absl::string_view glob) {
  std::string re;
  for (char c : glob) {
    if (c == '*') {
      re += "(.*)";
    } else if (c == '?') {
      re += ".";
    } else {
      if (std::string("\\^$.|+()[]{}").find(c) != std::string::npos) re += '\\';
      re += c;
    }
  }
  return re;
}

// The highest $N (N a digit) that `to` refers to, ignoring "$$" (a literal '$').
int HighestGroup(absl::string_view to) {
  int high = 0;
  for (size_t i = 0; i + 1 < to.size(); ++i) {
    if (to[i] != '$') continue;
    if (to[i + 1] == '$') {
      ++i;
    } else if (to[i + 1] >= '0' && to[i + 1] <= '9') {
      high = std::max(high, to[i + 1] - '0');
    }
  }
  return high;
}

}  // namespace

WeightsNameMap::WeightsNameMap() : impl_(std::make_shared<const Impl>()) {}

absl::StatusOr<WeightsNameMap> WeightsNameMap::Create(std::vector<WeightsNameRule> rules,
                                                      std::vector<std::string> ignore,
                                                      std::string source) {
  auto impl = std::make_shared<Impl>();
  impl->source = std::move(source);
  impl->rules = std::move(rules);
  impl->ignore = std::move(ignore);
  WeightsNameMap map;
  map.impl_ = impl;  // DescribeRule reads it while the rules are checked
  for (size_t r = 0; r < impl->rules.size(); ++r) {
    const WeightsNameRule& rule = impl->rules[r];
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(
          absl::StrCat("name map: ", map.DescribeRule(static_cast<int>(r)), ": ", why));
    };
    if (rule.from.empty() && rule.kind != Kind::kPrefix) return bad("matches no name (empty)");
    if (rule.to.empty() && rule.kind != Kind::kPrefix) {
      return bad("maps to an empty name (only a prefix rule may map to \"\": it strips)");
    }
    std::regex re;
    if (rule.kind == Kind::kGlob) {
      const auto stars = [](absl::string_view s) { return std::count(s.begin(), s.end(), '*'); };
      if (stars(rule.to) != 0 && stars(rule.to) != stars(rule.from)) {
        return bad(absl::StrCat("the target has ", stars(rule.to), " '*' for the pattern's ",
                                stars(rule.from), " (each '*' of the target is the capture of "
                                                  "the same rank; none is also allowed)"));
      }
      re = std::regex(GlobToRegex(rule.from));
    } else if (rule.kind == Kind::kRegex) {
      try {
        re = std::regex(rule.from, std::regex::ECMAScript);
      } catch (const std::regex_error& e) {
        return bad(absl::StrCat("not a valid regular expression: ", e.what()));
      }
      if (HighestGroup(rule.to) > static_cast<int>(re.mark_count())) {
        return bad(absl::StrCat("the target refers to $", HighestGroup(rule.to),
                                " but the expression has ", re.mark_count(), " group(s)"));
      }
    }
    impl->regex.push_back(std::move(re));
  }
  for (const std::string& g : impl->ignore) {
    if (g.empty()) return absl::InvalidArgumentError("name map: an empty ignore pattern");
  }
  return map;
}

absl::StatusOr<WeightsNameMap> WeightsNameMap::Parse(absl::string_view text,
                                                     absl::string_view source) {
  std::vector<WeightsNameRule> rules;
  std::vector<std::string> ignore;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    std::vector<absl::string_view> tok =
        absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty());
    // A field that starts with '#' starts a comment, to the end of the line.
    for (size_t k = 0; k < tok.size(); ++k) {
      if (absl::StartsWith(tok[k], "#")) {
        tok.resize(k);
        break;
      }
    }
    if (tok.empty()) continue;
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat(source, " line ", line_no, ": ", why));
    };
    if (tok[0] == "ignore") {
      if (tok.size() != 2) return bad("expected 'ignore PATTERN'");
      ignore.emplace_back(tok[1]);
      continue;
    }
    WeightsNameRule rule;
    if (tok[0] == "exact") {
      rule.kind = Kind::kExact;
    } else if (tok[0] == "prefix") {
      rule.kind = Kind::kPrefix;
    } else if (tok[0] == "glob") {
      rule.kind = Kind::kGlob;
    } else if (tok[0] == "regex") {
      rule.kind = Kind::kRegex;
    } else {
      return bad(absl::StrCat("unknown rule '", tok[0],
                              "': expected exact, prefix, glob, regex or ignore"));
    }
    const bool strip = rule.kind == Kind::kPrefix && tok.size() == 2;
    if (tok.size() != 3 && !strip) {
      return bad(absl::StrCat("expected '", tok[0], " FROM TO'",
                              rule.kind == Kind::kPrefix ? " or 'prefix FROM' (strips it)" : ""));
    }
    rule.from = std::string(tok[1]);
    rule.to = strip ? "" : std::string(tok[2]);
    rule.line = line_no;
    rules.push_back(std::move(rule));
  }
  return Create(std::move(rules), std::move(ignore), std::string(source));
}

absl::StatusOr<WeightsNameMap> WeightsNameMap::Load(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot read name map '", path, "'"));
  std::ostringstream text;
  text << f.rdbuf();
  return Parse(text.str(), path);
}

absl::StatusOr<WeightsNameMap::Mapped> WeightsNameMap::Map(absl::string_view name) const {
  const Impl& m = *impl_;
  for (size_t r = 0; r < m.rules.size(); ++r) {
    const WeightsNameRule& rule = m.rules[r];
    Mapped out;
    out.rule = static_cast<int>(r);
    bool hit = false;
    try {
      switch (rule.kind) {
        case Kind::kExact:
          hit = name == rule.from;
          out.name = rule.to;
          break;
        case Kind::kPrefix:
          hit = absl::StartsWith(name, rule.from);
          if (hit) out.name = absl::StrCat(rule.to, name.substr(rule.from.size()));
          break;
        case Kind::kGlob:
        case Kind::kRegex: {
          std::match_results<absl::string_view::const_iterator> match;
          hit = std::regex_match(name.begin(), name.end(), match, m.regex[r]);
          if (!hit) break;
          if (rule.kind == Kind::kRegex) {
            out.name = match.format(rule.to);
            break;
          }
          size_t group = 0;
          for (char c : rule.to) {
            if (c == '*') {
              out.name += match[++group].str();
            } else {
              out.name += c;
            }
          }
          break;
        }
      }
    } catch (const std::regex_error& e) {  // std::regex gives up on some inputs
      return absl::InvalidArgumentError(absl::StrCat(
          "name map: ", DescribeRule(out.rule), " on '", name, "': ", e.what()));
    }
    if (!hit) continue;
    if (out.name.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "name map: ", DescribeRule(out.rule), " maps '", name, "' to an empty name"));
    }
    return out;
  }
  return Mapped{std::string(name), -1};
}

const std::string* WeightsNameMap::IgnoredBy(absl::string_view name) const {
  for (const std::string& g : impl_->ignore) {
    if (GlobMatch(g, name)) return &g;
  }
  return nullptr;
}

std::string WeightsNameMap::DescribeRule(int rule) const {
  const Impl& m = *impl_;
  if (rule < 0 || rule >= static_cast<int>(m.rules.size())) return "no rule (the name as it is)";
  const WeightsNameRule& r = m.rules[rule];
  std::string where;
  if (r.line > 0) {
    where = absl::StrCat(", line ", r.line, m.source.empty() ? "" : absl::StrCat(" of ", m.source));
  } else if (!m.source.empty()) {
    where = absl::StrCat(", ", m.source);
  }
  return absl::StrCat("rule ", rule + 1, " (", KindName(r.kind), " '", r.from, "' -> '", r.to,
                      "'", where, ")");
}

const std::vector<WeightsNameRule>& WeightsNameMap::rules() const { return impl_->rules; }
const std::vector<std::string>& WeightsNameMap::ignore() const { return impl_->ignore; }
bool WeightsNameMap::empty() const { return impl_->rules.empty() && impl_->ignore.empty(); }

}  // namespace zerort
