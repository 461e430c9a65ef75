#include "zero/internal/config_reader.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "base/status.h"

namespace zerort {
namespace config_internal {

absl::Status Reader::Finish(absl::string_view source, bool strict) {
  if (strict && !ignored_.empty()) {
    std::vector<std::string> kept;
    size_t next = 0;
    for (size_t i = 0; i < config_->notes.size(); ++i) {
      if (next < ignored_.size() && ignored_[next] == i) {
        ++next;
        Error(absl::StrCat(config_->notes[i], " [refused: strict mode]"));
      } else {
        kept.push_back(config_->notes[i]);
      }
    }
    config_->notes = std::move(kept);
  }
  if (errors_.empty()) return absl::OkStatus();
  if (errors_.size() == 1) return Annotate(errors_[0], source);
  absl::StatusCode code = errors_[0].code();
  std::string message = absl::StrCat(source, ": ", errors_.size(), " problems:");
  for (const absl::Status& s : errors_) {
    if (s.code() != code) code = absl::StatusCode::kInvalidArgument;
    absl::StrAppend(&message, "\n", source, ": ", s.message());
  }
  return absl::Status(code, message);
}

void Reader::AbsorbErrors(const Reader& other) {
  for (const absl::Status& s : other.errors_) {
    auto same = [&](const absl::Status& t) { return t.message() == s.message(); };
    if (std::none_of(errors_.begin(), errors_.end(), same)) errors_.push_back(s);
  }
}

bool IsAuto(const Json& v) { return v.is_string() && v.get_ref<const std::string&>() == "auto"; }

bool TakeAuto(Reader* r, const Json& obj, const char* key, const std::string& path) {
  auto it = obj.find(key);
  if (it == obj.end() || !IsAuto(*it)) return false;
  r->Auto(path);
  return true;
}

// ---------------------------------------------------------------------------------------------
// Key checking.

namespace {

void CollectPaths(const Json& obj, const std::string& prefix, std::vector<std::string>* out) {
  for (const auto& item : obj.items()) {
    std::string path = JsonPath(prefix, item.key());
    out->push_back(path);
    if (item.value().is_object()) CollectPaths(item.value(), path, out);
  }
}

// Every setting's path, objects included ("zero_optimization.offload_optimizer"), read off the
// resolved defaults so that it can never disagree with the parser.
const std::vector<std::string>& AllSettingPaths() {
  static const std::vector<std::string>* paths = [] {
    auto* out = new std::vector<std::string>;
    CollectPaths(Json::parse(ResolvedConfigJson(Config{})), "", out);
    return out;
  }();
  return *paths;
}

// For a key that is valid elsewhere (a misplaced "stage" or "lr"): the full path it belongs at.
absl::string_view SettingElsewhere(absl::string_view key, const std::string& here) {
  for (const std::string& path : AllSettingPaths()) {
    if (config_internal::ParentPath(path) != here &&
        EditDistance(key, LeafName(path)) <= (key.size() > 4 ? 1 : 0)) {
      return path;
    }
  }
  return "";
}

void CheckForeign(Reader* r, const KeyDef& f, const Json& value, const std::string& key_path) {
  if (f.only_value == nullptr) {
    r->Ignored(absl::StrCat(key_path, ": DeepSpeed key accepted, no effect (", f.why, ")"));
    return;
  }
  if (value == Json::parse(f.only_value)) {
    r->Ignored(
        absl::StrCat(key_path, ": DeepSpeed default ", f.only_value, " accepted, no effect"));
    return;
  }
  r->Check(absl::UnimplementedError(absl::StrCat(key_path, ": not supported by zerort (", f.why,
                                                 "); only ", f.only_value,
                                                 ", DeepSpeed's default, is accepted")));
}

bool Names(const KeyDef& f, absl::string_view key) {
  return key == LeafName(f.path) || (f.alias != nullptr && key == f.alias);
}

// An unknown key: suggest the nearest valid key, if any is plausibly what was meant. At the top
// level, a key that is neither a setting nor a DeepSpeed key nor close to one is ignored with a
// note, as DeepSpeed ignores foreign top-level keys; everywhere else it is an error.
void UnknownKey(Reader* r, absl::string_view key, const std::string& path,
                const std::vector<absl::string_view>& settings,
                const std::vector<KeyDef>& foreign) {
  const std::string key_path = JsonPath(path, key);
  std::vector<absl::string_view> valid = settings;
  for (const KeyDef& f : foreign) {
    valid.push_back(LeafName(f.path));
    if (f.alias != nullptr) valid.push_back(f.alias);
  }
  if (absl::string_view best = NearestKey(key, valid); !best.empty()) {
    r->Error(absl::StrCat(key_path, ": unknown key; did you mean \"", best, "\"?"));
  } else if (absl::string_view elsewhere = SettingElsewhere(key, path); !elsewhere.empty()) {
    r->Error(absl::StrCat(key_path, ": unknown key ", path.empty() ? "at the top level" : "here",
                          "; did you mean \"", elsewhere, "\"?"));
  } else if (path.empty()) {
    r->Ignored(absl::StrCat(key_path,
                            ": not a zerort or DeepSpeed setting; ignored (as DeepSpeed ignores "
                            "unknown top-level keys)"));
  } else {
    // The foreign keys are left out of the list: no help to someone looking for a setting.
    r->Error(absl::StrCat(key_path,
                          ": unknown key; the settings here are: ", absl::StrJoin(settings, ", ")));
  }
}

}  // namespace

void CheckKeys(Reader* r, const Json& obj, const std::string& path,
               const std::vector<absl::string_view>& settings, const std::vector<KeyDef>& foreign) {
  for (const auto& item : obj.items()) {
    const std::string& key = item.key();
    if (std::find(settings.begin(), settings.end(), key) != settings.end()) continue;
    auto f = std::find_if(foreign.begin(), foreign.end(),
                          [&](const KeyDef& k) { return Names(k, key); });
    if (f != foreign.end()) {
      CheckForeign(r, *f, item.value(), JsonPath(path, key));
    } else {
      UnknownKey(r, key, path, settings, foreign);
    }
  }
}

const char* Spelling(Reader* r, const Json& obj, const std::string& path, const char* canonical,
                     const char* alias) {
  const bool has_canonical = obj.contains(canonical), has_alias = obj.contains(alias);
  if (has_canonical && has_alias) {
    r->Error(absl::StrCat(JsonPath(path, canonical), " and ", JsonPath(path, alias),
                          " are two spellings of one DeepSpeed setting; give only one"));
  }
  return has_alias && !has_canonical ? alias : canonical;
}

// ---------------------------------------------------------------------------------------------
// Typed values. Every error reads "<path>: expected <what>, got <value>".

absl::Status ToInt64(const Json& v, const std::string& path, int64_t lo, int64_t hi,
                     absl::string_view what, int64_t* out) {
  ASSIGN_OR_RETURN(*out, JsonToInt(v, path, lo, hi, IntegralFloats::kAccept, what));
  return absl::OkStatus();
}

std::string IntRange(int64_t lo, int64_t hi) {
  if (hi == kInt64Max) return absl::StrCat("an integer >= ", lo);
  if (hi == kIntMax) return absl::StrCat("an integer >= ", lo, " and <= ", hi);
  return absl::StrCat("an integer in ", lo, "..", hi);
}

namespace {

std::string DescribeRange(const DoubleRange& r) {
  if (std::isinf(r.hi)) return absl::StrCat("a number ", r.lo_open ? ">" : ">=", " ", r.lo);
  return absl::StrCat("a number in ", r.lo_open ? "(" : "[", r.lo, ", ", r.hi,
                      r.hi_open ? ")" : "]");
}

}  // namespace

absl::Status ToDouble(const Json& v, const std::string& path, const DoubleRange& r, double* out) {
  if (!v.is_number()) return JsonExpected(path, DescribeRange(r), v);
  double d = v.get<double>();
  bool above = r.lo_open ? d > r.lo : d >= r.lo;
  bool below = std::isinf(r.hi) || (r.hi_open ? d < r.hi : d <= r.hi);
  if (!std::isfinite(d) || !above || !below) return JsonExpected(path, DescribeRange(r), v);
  *out = d;
  return absl::OkStatus();
}

absl::Status ToBool(const Json& v, const std::string& path, bool* out) {
  if (!v.is_boolean()) return JsonExpected(path, "true or false", v);
  *out = v.get<bool>();
  return absl::OkStatus();
}

absl::Status ReadInt64(const Json& obj, const std::string& path, const char* key, int64_t lo,
                       int64_t* out) {
  auto it = obj.find(key);
  if (it == obj.end()) return absl::OkStatus();
  return ToInt64(*it, JsonPath(path, key), lo, kInt64Max, IntRange(lo, kInt64Max), out);
}

absl::Status ReadDouble(const Json& obj, const std::string& path, const char* key,
                        const DoubleRange& r, double* out) {
  auto it = obj.find(key);
  if (it == obj.end()) return absl::OkStatus();
  return ToDouble(*it, JsonPath(path, key), r, out);
}

absl::Status ReadBool(const Json& obj, const std::string& path, const char* key, bool* out) {
  auto it = obj.find(key);
  if (it == obj.end()) return absl::OkStatus();
  return ToBool(*it, JsonPath(path, key), out);
}

namespace {

absl::StatusOr<const Json*> ReadObject(const Json& obj, const std::string& path, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end()) return nullptr;
  if (!it->is_object()) return JsonExpected(JsonPath(path, key), "an object", *it);
  return &*it;
}

}  // namespace

const Json* Object(Reader* r, const Json& obj, const std::string& path, const char* key) {
  absl::StatusOr<const Json*> o = ReadObject(obj, path, key);
  r->Check(o.status());
  return o.ok() ? *o : nullptr;
}

absl::Status ReadDoubleOrAuto(Reader* r, const Json& obj, const std::string& path, const char* key,
                              const DoubleRange& range, double* out) {
  if (TakeAuto(r, obj, key, JsonPath(path, key))) return absl::OkStatus();
  return ReadDouble(obj, path, key, range, out);
}

absl::Status ReadInt64OrAuto(Reader* r, const Json& obj, const std::string& path, const char* key,
                             int64_t lo, int64_t* out) {
  if (TakeAuto(r, obj, key, JsonPath(path, key))) return absl::OkStatus();
  auto it = obj.find(key);
  if (it == obj.end()) return absl::OkStatus();
  return ToInt64(*it, JsonPath(path, key), lo, kInt64Max,
                 absl::StrCat(IntRange(lo, kInt64Max), " or \"auto\""), out);
}

}  // namespace config_internal
}  // namespace zerort
