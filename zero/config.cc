#include "zero/config.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/json.h"
#include "base/status.h"
#include "zero/internal/config_keys.h"

namespace zerort {
namespace {

// Every key is a row of zero/internal/config_keys.cc; this file holds what the rows drive (key
// checks, typed reads, the writer, operator==) and the rules no row can state. Parsing (strict
// JSON, errors with line and column) is base/json's; base/json's Json keeps the document's key
// order, so problems are listed in the file's order, and the resolved dump reads in the table's.
using config_internal::AutoRule;
using config_internal::ConfigKeys;
using config_internal::Custom;
using config_internal::DoubleRange;
using config_internal::Foreign;
using config_internal::KeyDef;
using config_internal::kInt64Max;
using config_internal::kIntMax;
using config_internal::kNonNegative;
using config_internal::LeafName;
using config_internal::Member;
using config_internal::Role;

// Everything one parse collects: every problem (not only the first: a user fixing a pasted
// config should see them all at once), the notes, and the keys written as "auto".
class Reader {
 public:
  explicit Reader(Config* config) : config_(config) {}

  void Check(const absl::Status& s) {
    if (!s.ok()) errors_.push_back(s);
  }
  void Error(std::string message) { errors_.push_back(absl::InvalidArgumentError(message)); }
  void Note(std::string note) { config_->notes.push_back(std::move(note)); }
  // A key that has no effect here: a note, or an error in strict mode.
  void Ignored(std::string note) {
    ignored_.push_back(config_->notes.size());
    Note(std::move(note));
  }
  void Auto(std::string path) { config_->auto_keys.push_back(std::move(path)); }
  // Whether a problem was reported at `path` or below it: rules across keys skip keys that
  // did not parse, rather than report a second, misleading problem about them.
  bool Failed(absl::string_view path) const {
    for (const absl::Status& s : errors_) {
      absl::string_view m = s.message();
      // "path" itself or a key below it, not a sibling that merely starts the same
      // ("zero_optimization.stage" is not "zero_optimization.stage3_...").
      if (absl::ConsumePrefix(&m, path) && (m.empty() || m[0] == ':' || m[0] == '.' ||
                                            m[0] == '[' || m[0] == ' ')) {
        return true;
      }
    }
    return false;
  }
  absl::Status Finish(absl::string_view source, bool strict);

 private:
  Config* config_;
  std::vector<absl::Status> errors_;
  std::vector<size_t> ignored_;  // indices into config_->notes
};

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

bool IsAuto(const Json& v) { return v.is_string() && v.get_ref<const std::string&>() == "auto"; }

// obj[key] is "auto": recorded under `path` (the canonical spelling), nothing else read.
bool TakeAuto(Reader* r, const Json& obj, const char* key, const std::string& path) {
  auto it = obj.find(key);
  if (it == obj.end() || !IsAuto(*it)) return false;
  r->Auto(path);
  return true;
}

// Whether `path` lies in `block` ("" holds everything), and what follows the block's name.
bool IsUnder(absl::string_view path, absl::string_view block) {
  return block.empty() || (absl::StartsWith(path, block) && path.size() > block.size() &&
                           path[block.size()] == '.');
}
absl::string_view Below(absl::string_view path, absl::string_view block) {
  return block.empty() ? path : path.substr(block.size() + 1);
}

// DeepSpeed's other name of a block ("bfloat16" for "bf16"), or null.
const char* BlockAliasOf(absl::string_view block) {
  for (const config_internal::BlockAlias& a : config_internal::ConfigBlockAliases()) {
    if (block == a.block) return a.alias;
  }
  return nullptr;
}

// ---------------------------------------------------------------------------------------------
// Key checking.

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
    r->Error(absl::StrCat(key_path, ": unknown key; the settings here are: ",
                          absl::StrJoin(settings, ", ")));
  }
}

// Checks every key of `obj` (at `path`) against what is valid there, in document order.
void CheckKeys(Reader* r, const Json& obj, const std::string& path,
               const std::vector<absl::string_view>& settings,
               const std::vector<KeyDef>& foreign) {
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

// The keys of the table's `block`, written at `spelled`: its rows (and their other spellings)
// and its inner blocks are settings, its foreign rows DeepSpeed keys without effect.
void CheckBlockKeys(Reader* r, const Json& obj, absl::string_view block,
                    const std::string& spelled) {
  std::vector<absl::string_view> settings;
  std::vector<KeyDef> foreign;
  for (const KeyDef& k : ConfigKeys()) {
    if (!IsUnder(k.path, block)) continue;
    const absl::string_view rest = Below(k.path, block);
    const absl::string_view name = rest.substr(0, rest.find('.'));
    if (k.role == Role::kForeign && name == rest) {
      foreign.push_back(k);
    } else if (std::find(settings.begin(), settings.end(), name) == settings.end()) {
      settings.push_back(name);
      if (k.alias != nullptr && name == rest) settings.push_back(k.alias);
      const char* block_alias = name == rest ? nullptr : BlockAliasOf(JsonPath(block, name));
      if (block_alias != nullptr) settings.push_back(block_alias);
    }
  }
  CheckKeys(r, obj, spelled, settings, foreign);
}

// DeepSpeed spells several settings two ways; one of them, or an error naming both. Returns the
// spelling present (or `canonical` when neither is).
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

// An integer in [lo, hi]. DeepSpeed configs write sizes as 5e8, so integral floats count.
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

std::string DescribeRange(const DoubleRange& r) {
  if (std::isinf(r.hi)) return absl::StrCat("a number ", r.lo_open ? ">" : ">=", " ", r.lo);
  return absl::StrCat("a number in ", r.lo_open ? "(" : "[", r.lo, ", ", r.hi,
                      r.hi_open ? ")" : "]");
}

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

// For the hand-written blocks: obj[key], when present, read into *out (absent keeps the default).
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

// obj[key] as an object, or null when absent.
absl::StatusOr<const Json*> ReadObject(const Json& obj, const std::string& path, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end()) return nullptr;
  if (!it->is_object()) return JsonExpected(JsonPath(path, key), "an object", *it);
  return &*it;
}

const Json* Object(Reader* r, const Json& obj, const std::string& path, const char* key) {
  absl::StatusOr<const Json*> o = ReadObject(obj, path, key);
  r->Check(o.status());
  return o.ok() ? *o : nullptr;
}

// A typed value that may also be "auto" (recorded, default kept).
absl::Status ReadDoubleOrAuto(Reader* r, const Json& obj, const std::string& path,
                              const char* key, const DoubleRange& range, double* out) {
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

// ---------------------------------------------------------------------------------------------
// A row's value into its member, by the member's type.

absl::Status ToMember(const Json&, const std::string&, const KeyDef&, std::monostate, Config*) {
  assert(false && "a row without a member is read by hand");
  return absl::OkStatus();
}

absl::Status ToMember(const Json& v, const std::string& path, const KeyDef&, Member<bool> m,
                      Config* c) {
  return ToBool(v, path, &m.at(*c));
}

// Where the range names "auto" it is read with int64's bound and narrowed after, so that the
// message for a value below the range keeps naming "auto".
template <typename T>
absl::Status ToMember(const Json& v, const std::string& path, const KeyDef& k, Member<T> m,
                      Config* c) {
  static_assert(std::is_same_v<T, int> || std::is_same_v<T, int64_t>);
  const bool named = k.auto_rule == AutoRule::kRecordedNamed || k.auto_rule == AutoRule::kUnitSize;
  int64_t x = 0;
  RETURN_IF_ERROR(ToInt64(v, path, k.int_lo, named ? kInt64Max : k.int_hi,
                          named ? absl::StrCat(IntRange(k.int_lo, kInt64Max), " or \"auto\"")
                                : IntRange(k.int_lo, k.int_hi),
                          &x));
  if (x > k.int_hi) return JsonExpected(path, IntRange(k.int_lo, k.int_hi), Json(x));
  m.at(*c) = static_cast<T>(x);
  return absl::OkStatus();
}

absl::Status ToMember(const Json& v, const std::string& path, const KeyDef& k, Member<double> m,
                      Config* c) {
  return ToDouble(v, path, k.real, &m.at(*c));
}

absl::Status ToMember(const Json& v, const std::string& path, const KeyDef&,
                      Member<std::string> m, Config* c) {
  if (v.is_null()) return absl::OkStatus();
  if (!v.is_string()) return JsonExpected(path, "a string or null", v);
  m.at(*c) = v.get<std::string>();
  return absl::OkStatus();
}

// "fp32", "bf16" or "fp16" (also DeepSpeed's "bfp16" and base/dtype's long names); null = unset.
absl::Status ToMember(const Json& v, const std::string& path, const KeyDef&,
                      Member<std::optional<DType>> m, Config* c) {
  if (v.is_null()) return absl::OkStatus();
  constexpr absl::string_view kWhat = "\"fp32\", \"bf16\", \"fp16\" or null";
  if (!v.is_string()) return JsonExpected(path, kWhat, v);
  std::string name = v.get<std::string>();
  if (name == "bfp16") name = "bf16";
  absl::StatusOr<DType> d = ParseDType(name);
  if (!d.ok()) return JsonExpected(path, kWhat, v);
  m.at(*c) = *d;
  return absl::OkStatus();
}

absl::Status ToMember(const Json& v, const std::string& path, const KeyDef&,
                      Member<OffloadDevice> m, Config* c) {
  for (OffloadDevice d : {OffloadDevice::kNone, OffloadDevice::kCpu, OffloadDevice::kNvme}) {
    if (v.is_string() && v.get_ref<const std::string&>() == OffloadDeviceName(d)) {
      m.at(*c) = d;
      return absl::OkStatus();
    }
  }
  return JsonExpected(path, "\"none\", \"cpu\" or \"nvme\"", v);
}

// One spelling of row `k`, written at `path`: "auto" by the row's rule, else its typed value.
absl::Status ReadValue(Reader* r, const Json& v, const std::string& path, const KeyDef& k,
                       Config* c) {
  if (k.auto_rule != AutoRule::kNone && IsAuto(v)) {
    if (k.auto_rule == AutoRule::kUnitSize) {
      std::get<Member<int64_t>>(k.member).at(*c) = kAutoSize;
    } else {
      r->Auto(k.path);
    }
    return absl::OkStatus();
  }
  return std::visit([&](auto m) { return ToMember(v, path, k, m, c); }, k.member);
}

// A DeepSpeed switch for what zerort always does, parsed: what zerort does instead.
void NoteNoEffect(Reader* r, const Json& v, const std::string& path, const KeyDef& k) {
  r->Ignored(k.turned_off != nullptr && v == false
                 ? absl::StrCat(path, ": false has no effect, ", k.turned_off,
                                " cannot be turned off: ", k.why)
                 : absl::StrCat(path, ": accepted, no effect: ", k.why));
}

// ---------------------------------------------------------------------------------------------
// The rules no row can state.

void ReadStage(Reader* r, const Json& obj, const std::string& path, ZeroConfig* out) {
  auto it = obj.find("stage");
  if (it == obj.end()) return;
  std::string stage_path = JsonPath(path, "stage");
  constexpr absl::string_view kWhat = "an integer in 0..3 or \"auto\"";
  if (it->is_string()) {
    if (!IsAuto(*it)) return r->Check(JsonExpected(stage_path, kWhat, *it));
    out->stage_auto = true;
    return;
  }
  int64_t stage = 0;
  r->Check(ToInt64(*it, stage_path, 0, 3, kWhat, &stage));
  out->stage_auto = false;
  out->stage = static_cast<int>(stage);
}

// DeepSpeed's deprecated booleans for what offload_optimizer / offload_param now say. DeepSpeed
// still honours them, so zerort does too, with a note; given with the new block, an error.
void ReadDeprecatedFlag(Reader* r, const Json& obj, const std::string& path, const char* key,
                        const char* block, OffloadDevice* device) {
  bool on = false;
  absl::Status s = ReadBool(obj, path, key, &on);
  r->Check(s);
  if (!obj.contains(key) || !s.ok()) return;
  if (obj.contains(block)) {
    r->Error(absl::StrCat(JsonPath(path, key), " (deprecated) and ", JsonPath(path, block),
                          " are both given; keep only ", JsonPath(path, block)));
    return;
  }
  if (on) *device = OffloadDevice::kCpu;
  r->Note(absl::StrCat(JsonPath(path, key), ": deprecated DeepSpeed spelling, read as ",
                       JsonPath(path, block), ".device \"", on ? "cpu" : "none", "\""));
}

void ReadDeprecatedPinMemory(Reader* r, const Json& obj, const std::string& path,
                             const char* key, ZeroConfig* z) {
  bool pin = true;
  absl::Status s = ReadBool(obj, path, key, &pin);
  r->Check(s);
  if (!obj.contains(key) || !s.ok()) return;
  z->offload_optimizer.pin_memory = z->offload_param.pin_memory = pin;
  r->Note(absl::StrCat(JsonPath(path, key),
                       ": deprecated DeepSpeed spelling, read as pin_memory of both offloads"));
}

// "enabled": true, false or "auto" (the trainer's compute dtype decides; ResolveAuto).
void ReadEnabled(Reader* r, const Json& obj, const std::string& path, bool* enabled) {
  if (TakeAuto(r, obj, "enabled", JsonPath(path, "enabled"))) return;
  r->Check(ReadBool(obj, path, "enabled", enabled));
}

// bf16.enabled selects bf16, fp16.enabled fp16; neither (also when both blocks are absent) fp32.
void ReadPrecision(Reader* r, const Json& obj, const std::string& path, DType dtype, Config* c) {
  bool enabled = false;
  ReadEnabled(r, obj, path, &enabled);
  if (!enabled) return;
  if (c->compute_dtype != DType::kF32) {
    r->Error("bf16.enabled and fp16.enabled are both true; enable at most one");
    return;
  }
  c->compute_dtype = dtype;
}

void ReadOptimizerType(Reader* r, const Json& obj, const std::string& path, OptimizerConfig* out) {
  auto it = obj.find("type");
  if (it == obj.end()) return;
  std::string type_path = JsonPath(path, "type");
  constexpr absl::string_view kWhat = "\"AdamW\" or \"Adam\"";
  if (!it->is_string()) return r->Check(JsonExpected(type_path, kWhat, *it));
  // DeepSpeed matches optimizer names case-insensitively.
  std::string type = absl::AsciiStrToLower(it->get_ref<const std::string&>());
  if (type == "adam") {
    r->Note(absl::StrCat(type_path,
                         ": \"Adam\" runs as AdamW (decoupled weight decay), as DeepSpeed's Adam "
                         "does with its default adam_w_mode=true"));
  } else if (type != "adamw") {
    return r->Check(JsonExpected(type_path, kWhat, *it));
  }
  out->type = "AdamW";
}

void ReadBetas(Reader* r, const Json& obj, const std::string& path, OptimizerConfig* out) {
  const std::string betas_path = JsonPath(path, "betas");
  auto it = obj.find("betas");
  if (it == obj.end() || TakeAuto(r, obj, "betas", betas_path)) return;
  if (!it->is_array() || it->size() != 2) {
    return r->Check(
        JsonExpected(betas_path, "an array of two numbers [beta1, beta2] or \"auto\"", *it));
  }
  const DoubleRange kBeta{0, false, 1, true};
  r->Check(ToDouble((*it)[0], betas_path + "[0]", kBeta, &out->beta1));
  r->Check(ToDouble((*it)[1], betas_path + "[1]", kBeta, &out->beta2));
}

// Batch sizes are not settings: "auto" is simply 0 (ResolveAuto takes them from its fill).
void ReadBatchSize(Reader* r, const Json& obj, const KeyDef& k, Config* c) {
  auto it = obj.find(std::string(LeafName(k.path)));
  if (it == obj.end()) return;
  if (!IsAuto(*it)) {
    r->Check(ToInt64(*it, k.path, 1, kInt64Max, "an integer >= 1 or \"auto\"",
                     &std::get<Member<int64_t>>(k.member).at(*c)));
  }
  r->Note(absl::StrCat(k.path, ": the trainer owns batch sizes; checked only for consistency "
                               "(train = micro * gradient_accumulation_steps * world size)"));
}

// ---- scheduler

struct SchedulerKind {
  SchedulerType type;
  const char* name;
};
constexpr SchedulerKind kSchedulers[] = {
    {SchedulerType::kWarmupLR, "WarmupLR"},
    {SchedulerType::kWarmupDecayLR, "WarmupDecayLR"},
    {SchedulerType::kWarmupCosineLR, "WarmupCosineLR"},
    {SchedulerType::kOneCycle, "OneCycle"},
    {SchedulerType::kLRRangeTest, "LRRangeTest"},
};

constexpr char kResumeWhy[] = "on resume the schedule continues from the checkpoint's step count";
constexpr char kMomentumWhy[] =
    "zerort's OneCycle cycles the learning rate only; betas stay optimizer.params.betas";
constexpr char kStairWhy[] = "DeepSpeed's OneCycle does not use it either";

void ReadWarmupType(Reader* r, const Json& obj, const std::string& path, WarmupType* out) {
  auto it = obj.find("warmup_type");
  if (it == obj.end()) return;
  if (it->is_string() && it->get_ref<const std::string&>() == "log") {
    *out = WarmupType::kLog;
  } else if (it->is_string() && it->get_ref<const std::string&>() == "linear") {
    *out = WarmupType::kLinear;
  } else {
    r->Check(JsonExpected(JsonPath(path, "warmup_type"), "\"log\" or \"linear\"", *it));
  }
}

void ReadWarmupParams(Reader* r, const Json& p, const std::string& path, SchedulerConfig* s) {
  const bool cosine = s->type == SchedulerType::kWarmupCosineLR;
  if (cosine) {
    CheckKeys(r, p, path,
              {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio",
               "warmup_type"},
              {Foreign("last_batch_iteration", kResumeWhy)});
    r->Check(ReadDoubleOrAuto(r, p, path, "warmup_min_ratio", kNonNegative, &s->warmup_min_ratio));
    r->Check(ReadDoubleOrAuto(r, p, path, "cos_min_ratio", kNonNegative, &s->cos_min_ratio));
  } else {
    if (s->type == SchedulerType::kWarmupDecayLR) {
      CheckKeys(r, p, path,
                {"total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                 "warmup_type"},
                {Foreign("last_batch_iteration", kResumeWhy)});
    } else {
      CheckKeys(r, p, path, {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"},
                {Foreign("last_batch_iteration", kResumeWhy)});
    }
    r->Check(ReadDoubleOrAuto(r, p, path, "warmup_min_lr", kNonNegative, &s->warmup_min_lr));
    r->Check(ReadDoubleOrAuto(r, p, path, "warmup_max_lr", kNonNegative, &s->warmup_max_lr));
  }
  r->Check(ReadInt64OrAuto(r, p, path, "warmup_num_steps", 0, &s->warmup_num_steps));
  ReadWarmupType(r, p, path, &s->warmup_type);
  if (s->type == SchedulerType::kWarmupLR) return;
  // DeepSpeed makes total_num_steps a required argument of the decaying schedules.
  if (!p.contains("total_num_steps")) {
    r->Error(absl::StrCat(JsonPath(path, "total_num_steps"), ": missing; ",
                          SchedulerTypeName(s->type), " needs it (a number, or \"auto\")"));
  }
  r->Check(ReadInt64OrAuto(r, p, path, "total_num_steps", 1, &s->total_num_steps));
}

void ReadOneCycleParams(Reader* r, const Json& p, const std::string& path, SchedulerConfig* s) {
  CheckKeys(r, p, path,
            {"cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size",
             "cycle_second_step_size", "decay_step_size"},
            {Foreign("last_batch_iteration", kResumeWhy),
             Foreign("cycle_momentum", kMomentumWhy),
             Foreign("cycle_min_mom", kMomentumWhy),
             Foreign("cycle_max_mom", kMomentumWhy),
             Foreign("decay_mom_rate", kMomentumWhy),
             Foreign("cycle_first_stair_count", kStairWhy),
             Foreign("cycle_second_stair_count", kStairWhy)});
  for (const char* key : {"cycle_min_lr", "cycle_max_lr"}) {
    if (!p.contains(key)) {
      r->Error(absl::StrCat(JsonPath(path, key), ": missing; OneCycle needs it"));
    }
  }
  r->Check(ReadDoubleOrAuto(r, p, path, "cycle_min_lr", kNonNegative, &s->cycle_min_lr));
  r->Check(ReadDoubleOrAuto(r, p, path, "cycle_max_lr", kNonNegative, &s->cycle_max_lr));
  r->Check(ReadDoubleOrAuto(r, p, path, "decay_lr_rate", kNonNegative, &s->decay_lr_rate));
  r->Check(ReadInt64(p, path, "cycle_first_step_size", 1, &s->cycle_first_step_size));
  if (auto it = p.find("cycle_second_step_size"); it != p.end() && !it->is_null()) {
    r->Check(ToInt64(*it, JsonPath(path, "cycle_second_step_size"), 1, kInt64Max,
                     "an integer >= 1 or null", &s->cycle_second_step_size));
  }
  r->Check(ReadInt64(p, path, "decay_step_size", 0, &s->decay_step_size));
}

void ReadRangeTestParams(Reader* r, const Json& p, const std::string& path, SchedulerConfig* s) {
  CheckKeys(r, p, path,
            {"lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate",
             "lr_range_test_staircase"},
            {Foreign("last_batch_iteration", kResumeWhy)});
  r->Check(ReadDoubleOrAuto(r, p, path, "lr_range_test_min_lr", kNonNegative,
                            &s->lr_range_test_min_lr));
  r->Check(
      ReadInt64(p, path, "lr_range_test_step_size", 1, &s->lr_range_test_step_size));
  r->Check(ReadDouble(p, path, "lr_range_test_step_rate", kNonNegative,
                      &s->lr_range_test_step_rate));
  r->Check(ReadBool(p, path, "lr_range_test_staircase", &s->lr_range_test_staircase));
}

void ReadSchedulerType(Reader* r, const Json& obj, const std::string& path, SchedulerConfig* s) {
  auto it = obj.find("type");
  std::string type_path = JsonPath(path, "type");
  std::vector<absl::string_view> names;
  for (const SchedulerKind& k : kSchedulers) names.push_back(k.name);
  const std::string what = absl::StrCat("one of ", absl::StrJoin(names, ", "));
  if (it == obj.end()) return r->Error(absl::StrCat(type_path, ": missing; expected ", what));
  if (it->is_string()) {
    for (const SchedulerKind& k : kSchedulers) {
      if (it->get_ref<const std::string&>() == k.name) {
        s->type = k.type;
        return;
      }
    }
    // DeepSpeed compares names exactly; a near miss gets the right spelling.
    absl::string_view best = NearestKey(it->get_ref<const std::string&>(), names);
    if (!best.empty()) {
      return r->Error(absl::StrCat(type_path, ": unknown scheduler ", DescribeJson(*it),
                                   "; did you mean \"", best, "\"?"));
    }
  }
  r->Check(JsonExpected(type_path, what, *it));
}

void ReadScheduler(Reader* r, const Json& obj, const std::string& path, SchedulerConfig* s) {
  CheckKeys(r, obj, path, {"type", "params"}, {});
  ReadSchedulerType(r, obj, path, s);
  const Json empty = Json::object();
  const Json* params = Object(r, obj, path, "params");
  if (params == nullptr) params = &empty;
  const std::string params_path = JsonPath(path, "params");
  switch (s->type) {
    case SchedulerType::kNone:
      return;
    case SchedulerType::kWarmupLR:
    case SchedulerType::kWarmupDecayLR:
    case SchedulerType::kWarmupCosineLR:
      return ReadWarmupParams(r, *params, params_path, s);
    case SchedulerType::kOneCycle:
      return ReadOneCycleParams(r, *params, params_path, s);
    case SchedulerType::kLRRangeTest:
      return ReadRangeTestParams(r, *params, params_path, s);
  }
}

void ReadParamGroups(Reader* r, const Json& obj, const std::string& path,
                     std::vector<ParamGroupConfig>* out) {
  auto it = obj.find("param_groups");
  if (it == obj.end()) return;
  const std::string groups_path = JsonPath(path, "param_groups");
  if (!it->is_array()) return r->Check(JsonExpected(groups_path, "an array of objects", *it));
  for (size_t i = 0; i < it->size(); ++i) {
    const Json& g = (*it)[i];
    const std::string g_path = JsonPath(groups_path, i);
    if (!g.is_object()) {
      r->Check(JsonExpected(g_path, "an object {pattern, weight_decay, lr_scale}", g));
      continue;
    }
    CheckKeys(r, g, g_path, {"pattern", "weight_decay", "lr_scale"}, {});
    ParamGroupConfig group;
    auto pattern = g.find("pattern");
    if (pattern == g.end() || !pattern->is_string() || pattern->get_ref<const std::string&>().empty()) {
      r->Check(JsonExpected(JsonPath(g_path, "pattern"), "a non-empty glob string",
                            pattern == g.end() ? Json() : *pattern));
    } else {
      group.pattern = pattern->get<std::string>();
    }
    r->Check(ReadDouble(g, g_path, "weight_decay", kNonNegative, &group.weight_decay));
    r->Check(ReadDouble(g, g_path, "lr_scale", kNonNegative, &group.lr_scale));
    out->push_back(std::move(group));
  }
}

// ---------------------------------------------------------------------------------------------
// Reading, driven by the table.

void ReadCustom(Reader* r, const Json& obj, const std::string& path, const KeyDef& k, Config* c) {
  const std::string key(LeafName(k.path));
  switch (k.custom) {
    case Custom::kNone:
      break;
    case Custom::kStage:
      return ReadStage(r, obj, path, &c->zero);
    case Custom::kBf16Enabled:
      return ReadPrecision(r, obj, path, DType::kBF16, c);
    case Custom::kFp16Enabled:
      return ReadPrecision(r, obj, path, DType::kF16, c);
    case Custom::kOptimizerType:
      return ReadOptimizerType(r, obj, path, &c->optimizer);
    case Custom::kBetas:
      return ReadBetas(r, obj, path, &c->optimizer);
    case Custom::kScheduler:
      // "scheduler": null is DeepSpeed's default: no schedule.
      if (auto it = obj.find(key); it != obj.end() && !it->is_null()) {
        if (const Json* s = Object(r, obj, path, key.c_str())) {
          ReadScheduler(r, *s, k.path, &c->scheduler);
        }
      }
      return;
    case Custom::kParamGroups:
      return ReadParamGroups(r, obj, path, &c->param_groups);
    case Custom::kBatchSize:
      return ReadBatchSize(r, obj, k, c);
    case Custom::kCpuOffload:
      return ReadDeprecatedFlag(r, obj, path, key.c_str(), "offload_optimizer",
                                &c->zero.offload_optimizer.device);
    case Custom::kCpuOffloadParam:
      return ReadDeprecatedFlag(r, obj, path, key.c_str(), "offload_param",
                                &c->zero.offload_param.device);
    case Custom::kCpuOffloadPinned:
      return ReadDeprecatedPinMemory(r, obj, path, key.c_str(), &c->zero);
  }
  assert(false && "a custom row without a reader");
}

// Row `k` from `obj`, the object of its block (`path`), under each spelling present.
void ReadRow(Reader* r, const Json& obj, const std::string& path, const KeyDef& k, Config* c) {
  const std::string key(LeafName(k.path));
  if (k.alias != nullptr) Spelling(r, obj, path, key.c_str(), k.alias);
  // Foreign keys were noted by the key check.
  if (k.role == Role::kForeign) return;
  if (k.custom != Custom::kNone) return ReadCustom(r, obj, path, k, c);
  // Both spellings are read: when both are given, Spelling has reported it.
  for (const char* spelt : {key.c_str(), k.alias}) {
    auto it = spelt == nullptr ? obj.end() : obj.find(spelt);
    if (it == obj.end()) continue;
    const std::string spelt_path = JsonPath(path, spelt);
    absl::Status s = ReadValue(r, *it, spelt_path, k, c);
    r->Check(s);
    if (s.ok() && k.role == Role::kNoEffect) NoteNoEffect(r, *it, spelt_path, k);
  }
}

void ReadBlock(Reader* r, const Json& obj, const std::string& block, const std::string& spelled,
               Config* c);

// The inner block `name` of `obj` (the object of `block`, written at `spelled`), under either
// of its spellings.
void ReadInnerBlock(Reader* r, const Json& obj, const std::string& block,
                    const std::string& spelled, const std::string& name, Config* c) {
  const std::string inner = JsonPath(block, name);
  const char* alias = BlockAliasOf(inner);
  const char* key =
      alias == nullptr ? name.c_str() : Spelling(r, obj, spelled, name.c_str(), alias);
  const Json* o = Object(r, obj, spelled, key);
  if (o == nullptr) {
    // The one absent block that is worth a word: which optimizer runs.
    if (!obj.contains(key) && inner == "optimizer") {
      r->Note(absl::StrCat("optimizer: absent; using AdamW lr=", c->optimizer.lr, ", betas=[",
                           c->optimizer.beta1, ", ", c->optimizer.beta2, "], eps=",
                           c->optimizer.eps, ", weight_decay=", c->optimizer.weight_decay,
                           " (zerort's defaults; DeepSpeed would leave the optimizer to the "
                           "trainer)"));
    }
    return;
  }
  ReadBlock(r, *o, inner, JsonPath(spelled, key), c);
  if (key != name) {
    r->Note(absl::StrCat(JsonPath(spelled, key), ": DeepSpeed's older name of the ", inner,
                         " block, read as ", inner));
  }
}

// Every row of `block` (a canonical path, "" for the whole config) from `obj`, the object
// written at `spelled`, in table order: an inner block is read where its first row stands.
void ReadBlock(Reader* r, const Json& obj, const std::string& block, const std::string& spelled,
               Config* c) {
  CheckBlockKeys(r, obj, block, spelled);
  absl::string_view last_inner;
  for (const KeyDef& k : ConfigKeys()) {
    if (!IsUnder(k.path, block)) continue;
    const absl::string_view rest = Below(k.path, block);
    const size_t dot = rest.find('.');
    if (dot == absl::string_view::npos) {
      ReadRow(r, obj, block, k, c);
    } else if (rest.substr(0, dot) != last_inner) {
      last_inner = rest.substr(0, dot);
      ReadInnerBlock(r, obj, block, spelled, std::string(last_inner), c);
    }
  }
}

void RequireNvmePath(Reader* r, const std::string& path, OffloadDevice device,
                     const std::string& nvme_path) {
  if (device == OffloadDevice::kNvme && nvme_path.empty() && !r->Failed(path)) {
    r->Error(absl::StrCat(path, ".device is \"nvme\" but ", path,
                          ".nvme_path is not set; name a directory on a local NVMe disk"));
  }
}

void CheckZeroAcrossKeys(Reader* r, const ZeroConfig& z) {
  RequireNvmePath(r, "zero_optimization.offload_optimizer", z.offload_optimizer.device,
                  z.offload_optimizer.nvme_path);
  RequireNvmePath(r, "zero_optimization.offload_param", z.offload_param.device,
                  z.offload_param.nvme_path);
  const bool stage_ok = !r->Failed("zero_optimization.stage");
  if (stage_ok && !r->Failed("zero_optimization.offload_param") &&
      z.offload_param.device != OffloadDevice::kNone && (z.stage_auto || z.stage != 3)) {
    r->Error(absl::StrCat(
        "zero_optimization.offload_param.device is \"", OffloadDeviceName(z.offload_param.device),
        "\" but zero_optimization.stage is ",
        z.stage_auto ? std::string("\"auto\"") : absl::StrCat(z.stage),
        "; parameter offload requires stage 3 (set it explicitly)"));
  }
  if (stage_ok && !r->Failed("zero_optimization.memory_budget") && z.stage_auto &&
      z.memory_budget.device_bytes == 0) {
    r->Error(
        "zero_optimization.stage is \"auto\" but zero_optimization.memory_budget.device_bytes is "
        "not set; \"auto\" picks the lowest stage that fits that budget");
  }
}

// Rules across keys (and the one rule on a single key beyond its range), each checked only when
// the keys involved parsed.
void CheckAcrossKeys(Reader* r, const Config& c) {
  CheckZeroAcrossKeys(r, c.zero);
  const Fp16Config& f = c.fp16;
  if (!r->Failed("fp16") && f.loss_scale == 0 &&
      std::ldexp(1.0, f.initial_scale_power) < f.min_loss_scale) {
    r->Error(absl::StrCat("fp16.initial_scale_power ", f.initial_scale_power,
                          " starts dynamic loss scaling at 2^", f.initial_scale_power,
                          ", below fp16.min_loss_scale ", f.min_loss_scale));
  }
  const SchedulerConfig& s = c.scheduler;
  if (s.type == SchedulerType::kOneCycle && !r->Failed("scheduler") &&
      s.cycle_max_lr < s.cycle_min_lr) {
    r->Error(absl::StrCat("scheduler.params.cycle_max_lr ", s.cycle_max_lr,
                          " is below scheduler.params.cycle_min_lr ", s.cycle_min_lr));
  }
  if (c.aio.block_size % 4096 != 0 && !r->Failed("aio.block_size")) {
    r->Error(absl::StrCat("aio.block_size: expected a multiple of 4096, got ", c.aio.block_size));
  }
}

void ReadConfig(Reader* r, const Json& root, Config* config) {
  if (!root.is_object()) return r->Check(JsonExpected("<root>", "a JSON object", root));
  ReadBlock(r, root, "", "", config);
  // DeepSpeed derives the accumulation from the two batch sizes when it is not written: so does
  // ResolveAuto, once it knows the world size.
  if (!root.contains("gradient_accumulation_steps") && root.contains("train_batch_size") &&
      root.contains("train_micro_batch_size_per_gpu")) {
    r->Auto("gradient_accumulation_steps");
  }
  CheckAcrossKeys(r, *config);
}

// ---------------------------------------------------------------------------------------------
// Writing and comparing, driven by the table.

Json SchedulerJson(const SchedulerConfig& s) {
  if (s.type == SchedulerType::kNone) return nullptr;
  const char* warmup_type = s.warmup_type == WarmupType::kLog ? "log" : "linear";
  Json p;
  switch (s.type) {
    case SchedulerType::kNone:
      break;
    case SchedulerType::kWarmupLR:
    case SchedulerType::kWarmupDecayLR:
      p = {{"warmup_min_lr", s.warmup_min_lr},
           {"warmup_max_lr", s.warmup_max_lr},
           {"warmup_num_steps", s.warmup_num_steps},
           {"warmup_type", warmup_type}};
      if (s.type == SchedulerType::kWarmupDecayLR) p["total_num_steps"] = s.total_num_steps;
      break;
    case SchedulerType::kWarmupCosineLR:
      p = {{"total_num_steps", s.total_num_steps},
           {"warmup_min_ratio", s.warmup_min_ratio},
           {"warmup_num_steps", s.warmup_num_steps},
           {"cos_min_ratio", s.cos_min_ratio},
           {"warmup_type", warmup_type}};
      break;
    case SchedulerType::kOneCycle:
      p = {{"cycle_min_lr", s.cycle_min_lr},
           {"cycle_max_lr", s.cycle_max_lr},
           {"decay_lr_rate", s.decay_lr_rate},
           {"cycle_first_step_size", s.cycle_first_step_size},
           {"cycle_second_step_size",
            s.cycle_second_step_size < 0 ? Json() : Json(s.cycle_second_step_size)},
           {"decay_step_size", s.decay_step_size}};
      break;
    case SchedulerType::kLRRangeTest:
      p = {{"lr_range_test_min_lr", s.lr_range_test_min_lr},
           {"lr_range_test_step_size", s.lr_range_test_step_size},
           {"lr_range_test_step_rate", s.lr_range_test_step_rate},
           {"lr_range_test_staircase", s.lr_range_test_staircase}};
      break;
  }
  return {{"type", std::string(SchedulerTypeName(s.type))}, {"params", std::move(p)}};
}

Json CustomJson(const KeyDef& k, const Config& c) {
  switch (k.custom) {
    case Custom::kStage:
      return c.zero.stage_auto ? Json("auto") : Json(c.zero.stage);
    case Custom::kBf16Enabled:
      return c.compute_dtype == DType::kBF16;
    case Custom::kFp16Enabled:
      return c.compute_dtype == DType::kF16;
    case Custom::kOptimizerType:
      return c.optimizer.type;
    case Custom::kBetas:
      return Json::array({c.optimizer.beta1, c.optimizer.beta2});
    case Custom::kScheduler:
      return SchedulerJson(c.scheduler);
    case Custom::kParamGroups: {
      Json groups = Json::array();
      for (const ParamGroupConfig& g : c.param_groups) {
        groups.push_back(
            {{"pattern", g.pattern}, {"weight_decay", g.weight_decay}, {"lr_scale", g.lr_scale}});
      }
      return groups;
    }
    case Custom::kNone:
    case Custom::kBatchSize:
    case Custom::kCpuOffload:
    case Custom::kCpuOffloadParam:
    case Custom::kCpuOffloadPinned:
      break;
  }
  assert(false && "not a setting");
  return Json();
}

// A setting's value as the resolved config writes it.
Json ValueJson(const KeyDef& k, const Config& c) {
  return std::visit(
      [&](auto m) -> Json {
        using M = decltype(m);
        if constexpr (std::is_same_v<M, std::monostate>) {
          return CustomJson(k, c);
        } else if constexpr (std::is_same_v<M, Member<std::string>>) {
          return m.get(c).empty() ? Json() : Json(m.get(c));
        } else if constexpr (std::is_same_v<M, Member<std::optional<DType>>>) {
          return m.get(c) ? Json(std::string(DTypeName(*m.get(c)))) : Json();
        } else if constexpr (std::is_same_v<M, Member<OffloadDevice>>) {
          return std::string(OffloadDeviceName(m.get(c)));
        } else if constexpr (std::is_same_v<M, Member<int64_t>>) {
          const bool is_auto = k.auto_rule == AutoRule::kUnitSize && m.get(c) == kAutoSize;
          return is_auto ? Json("auto") : Json(m.get(c));
        } else {
          return m.get(c);
        }
      },
      k.member);
}

// Two configs hold the same setting when the resolved config writes the same value for it, so
// that operator== and ResolvedConfigJson cannot disagree; the scheduler is the exception: its
// dump leaves out the parameters of other schedule types, which operator== still compares.
bool SettingEqual(const KeyDef& k, const Config& a, const Config& b) {
  if (k.custom == Custom::kScheduler) return a.scheduler == b.scheduler;
  return ValueJson(k, a) == ValueJson(k, b);
}

// Every setting of `block` ("" for all) equal in a and b.
bool SettingsEqual(const Config& a, const Config& b, absl::string_view block) {
  for (const KeyDef& k : ConfigKeys()) {
    if (k.role == Role::kSetting && IsUnder(k.path, block) && !SettingEqual(k, a, b)) {
      return false;
    }
  }
  return true;
}

// Two values of one of Config's blocks, compared by the block's rows: each is placed in an
// otherwise default Config, since rows name their member from the Config.
template <typename S>
bool BlockEqual(absl::string_view block, Member<S> place, const S& a, const S& b) {
  Config x, y;
  place.at(x) = a;
  place.at(y) = b;
  return SettingsEqual(x, y, block);
}

// The `json` member at a dotted path of `root`, objects created on the way; null when the path
// runs through a value.
Json* At(Json* root, absl::string_view path) {
  Json* at = root;
  for (absl::string_view part : absl::StrSplit(path, '.')) {
    if (!at->is_object() && !at->is_null()) return nullptr;
    at = &(*at)[std::string(part)];
  }
  return at;
}

std::vector<std::string> Sorted(std::vector<std::string> v) {
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

bool operator==(const OffloadOptimizerConfig& a, const OffloadOptimizerConfig& b) {
  return BlockEqual("zero_optimization.offload_optimizer",
                    ZERORT_CONFIG_MEMBER(zero.offload_optimizer), a, b);
}

bool operator==(const OffloadParamConfig& a, const OffloadParamConfig& b) {
  return BlockEqual("zero_optimization.offload_param", ZERORT_CONFIG_MEMBER(zero.offload_param),
                    a, b);
}

bool operator==(const MemoryBudget& a, const MemoryBudget& b) {
  return BlockEqual("zero_optimization.memory_budget", ZERORT_CONFIG_MEMBER(zero.memory_budget),
                    a, b);
}

bool operator==(const ZeroConfig& a, const ZeroConfig& b) {
  return BlockEqual("zero_optimization", ZERORT_CONFIG_MEMBER(zero), a, b);
}

bool operator==(const Fp16Config& a, const Fp16Config& b) {
  return BlockEqual("fp16", ZERORT_CONFIG_MEMBER(fp16), a, b);
}

bool operator==(const OptimizerConfig& a, const OptimizerConfig& b) {
  return BlockEqual("optimizer", ZERORT_CONFIG_MEMBER(optimizer), a, b);
}

bool operator==(const AioConfig& a, const AioConfig& b) {
  return BlockEqual("aio", ZERORT_CONFIG_MEMBER(aio), a, b);
}

// The scheduler's parameters and the param groups are structured blocks, compared by hand.
bool operator==(const SchedulerConfig& a, const SchedulerConfig& b) {
  return a.type == b.type && a.warmup_min_lr == b.warmup_min_lr &&
         a.warmup_max_lr == b.warmup_max_lr && a.warmup_num_steps == b.warmup_num_steps &&
         a.warmup_type == b.warmup_type && a.total_num_steps == b.total_num_steps &&
         a.warmup_min_ratio == b.warmup_min_ratio && a.cos_min_ratio == b.cos_min_ratio &&
         a.cycle_min_lr == b.cycle_min_lr && a.cycle_max_lr == b.cycle_max_lr &&
         a.decay_lr_rate == b.decay_lr_rate && a.cycle_first_step_size == b.cycle_first_step_size &&
         a.cycle_second_step_size == b.cycle_second_step_size &&
         a.decay_step_size == b.decay_step_size && a.lr_range_test_min_lr == b.lr_range_test_min_lr &&
         a.lr_range_test_step_size == b.lr_range_test_step_size &&
         a.lr_range_test_step_rate == b.lr_range_test_step_rate &&
         a.lr_range_test_staircase == b.lr_range_test_staircase;
}

bool operator==(const ParamGroupConfig& a, const ParamGroupConfig& b) {
  return a.pattern == b.pattern && a.weight_decay == b.weight_decay && a.lr_scale == b.lr_scale;
}

bool operator==(const Config& a, const Config& b) {
  return SettingsEqual(a, b, "") && Sorted(a.auto_keys) == Sorted(b.auto_keys);
}

absl::string_view OffloadDeviceName(OffloadDevice d) {
  switch (d) {
    case OffloadDevice::kNone:
      return "none";
    case OffloadDevice::kCpu:
      return "cpu";
    case OffloadDevice::kNvme:
      return "nvme";
  }
  assert(false && "unknown OffloadDevice");
  return "?";
}

absl::string_view SchedulerTypeName(SchedulerType t) {
  for (const SchedulerKind& k : kSchedulers) {
    if (k.type == t) return k.name;
  }
  return "";
}

absl::StatusOr<Config> ParseConfig(absl::string_view json_text, absl::string_view source,
                                   const ParseOptions& options) {
  ASSIGN_OR_RETURN(Json root, ParseJson(json_text, source));
  Config config;
  Reader reader(&config);
  try {
    ReadConfig(&reader, root, &config);
  } catch (const std::exception& e) {
    // The readers check types before every access; a throw here is a bug, reported not raised.
    return absl::InternalError(absl::StrCat(source, ": reading config: ", e.what()));
  }
  RETURN_IF_ERROR(reader.Finish(source, options.strict || config.strict));
  return config;
}

absl::StatusOr<Config> LoadConfigFile(const std::string& path, const ParseOptions& options) {
  ASSIGN_OR_RETURN(std::string text, ReadBoundedFile(path, "config"));
  return ParseConfig(text, path, options);
}

std::string ResolvedConfigJson(const Config& c) {
  Json root = Json::object();
  for (const KeyDef& k : ConfigKeys()) {
    if (k.role == Role::kSetting) *At(&root, k.path) = ValueJson(k, c);
  }
  for (const std::string& path : c.auto_keys) {
    // A hand-built Config may list a path through a value; such a path names no setting.
    if (Json* at = At(&root, path)) *at = "auto";
  }
  // `replace` keeps a hand-built Config with invalid UTF-8 in a string from throwing.
  return root.dump(2, ' ', false, Json::error_handler_t::replace);
}

absl::Status ValidateConfig(const Config& config) {
  // The dump writes every setting as written in a file, so parsing it applies exactly the rules
  // and messages of ParseConfig (a non-finite double dumps as null and fails as "got null").
  return ParseConfig(ResolvedConfigJson(config), "<Config>").status();
}

}  // namespace zerort
