#include "zero/config.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/json.h"
#include "base/status.h"

namespace zerort {
namespace {

// Parsing (strict JSON, errors with line and column) is base/json's; base/json's Json keeps the
// document's key order, so problems are listed in the file's order, and the resolved dump reads
// in the documented order.
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kIntMax = std::numeric_limits<int>::max();

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
    size_t dot = path.rfind('.');
    absl::string_view parent =
        dot == std::string::npos ? "" : absl::string_view(path).substr(0, dot);
    absl::string_view leaf =
        dot == std::string::npos ? path : absl::string_view(path).substr(dot + 1);
    if (parent != here && EditDistance(key, leaf) <= (key.size() > 4 ? 1 : 0)) return path;
  }
  return "";
}

// A DeepSpeed key that zerort does not act on.
struct ForeignKey {
  const char* name;
  // Null: accepted with any value (no effect here). Otherwise the DeepSpeed default, as JSON:
  // accepted only with that value (a no-op either way), Unimplemented with any other.
  const char* only_value;
  const char* why;
};

void CheckForeign(Reader* r, const ForeignKey& f, const Json& value, const std::string& key_path) {
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

// Checks every key of `obj` (at `path`) against what is valid there, in document order. At the
// top level, a key that is neither a setting nor a DeepSpeed key nor close to one is ignored
// with a note, as DeepSpeed ignores foreign top-level keys; everywhere else it is an error.
void CheckKeys(Reader* r, const Json& obj, const std::string& path,
               std::initializer_list<const char*> settings,
               std::initializer_list<ForeignKey> foreign) {
  for (const auto& item : obj.items()) {
    const std::string& key = item.key();
    std::string key_path = JsonPath(path, key);
    bool known = false;
    for (const char* s : settings) known = known || key == s;
    if (known) continue;
    const ForeignKey* match = nullptr;
    for (const ForeignKey& f : foreign) {
      if (key == f.name) match = &f;
    }
    if (match != nullptr) {
      CheckForeign(r, *match, item.value(), key_path);
      continue;
    }
    // Unknown: suggest the nearest valid key, if any is plausibly what was meant.
    std::vector<absl::string_view> valid;
    for (const char* s : settings) valid.push_back(s);
    for (const ForeignKey& f : foreign) valid.push_back(f.name);
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

// Reads obj[key] into *out if present. Absent keys keep the default already in *out.
absl::Status ReadInt64(const Json& obj, const std::string& path, const char* key, int64_t lo,
                       int64_t hi, int64_t* out) {
  auto it = obj.find(key);
  if (it == obj.end()) return absl::OkStatus();
  return ToInt64(*it, JsonPath(path, key), lo, hi, IntRange(lo, hi), out);
}

// A size that may also be "auto" (kAutoSize: the planner derives it from the model).
absl::Status ReadSizeOrAuto(const Json& obj, const std::string& path, const char* key, int64_t lo,
                            int64_t* out) {
  auto it = obj.find(key);
  if (it == obj.end()) return absl::OkStatus();
  if (it->is_string() && it->get_ref<const std::string&>() == "auto") {
    *out = kAutoSize;
    return absl::OkStatus();
  }
  return ToInt64(*it, JsonPath(path, key), lo, kInt64Max,
                 absl::StrCat(IntRange(lo, kInt64Max), " or \"auto\""), out);
}

absl::Status ReadInt(const Json& obj, const std::string& path, const char* key, int lo, int hi,
                     int* out) {
  int64_t x = *out;
  RETURN_IF_ERROR(ReadInt64(obj, path, key, lo, hi, &x));
  *out = static_cast<int>(x);
  return absl::OkStatus();
}

struct DoubleRange {
  double lo;
  bool lo_open;  // lo excluded
  double hi;     // +inf: no upper bound
  bool hi_open;
};

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

absl::Status ReadDouble(const Json& obj, const std::string& path, const char* key,
                        const DoubleRange& r, double* out) {
  auto it = obj.find(key);
  if (it == obj.end()) return absl::OkStatus();
  return ToDouble(*it, JsonPath(path, key), r, out);
}

absl::Status ReadBool(const Json& obj, const std::string& path, const char* key, bool* out) {
  auto it = obj.find(key);
  if (it == obj.end()) return absl::OkStatus();
  if (!it->is_boolean()) return JsonExpected(JsonPath(path, key), "true or false", *it);
  *out = it->get<bool>();
  return absl::OkStatus();
}

// obj[key] as an object, or null when absent.
absl::StatusOr<const Json*> ReadObject(const Json& obj, const std::string& path, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end()) return nullptr;
  if (!it->is_object()) return JsonExpected(JsonPath(path, key), "an object", *it);
  return &*it;
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

absl::Status ReadString(const Json& obj, const std::string& path, const char* key,
                        std::string* out) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_string()) return JsonExpected(JsonPath(path, key), "a string or null", *it);
  *out = it->get<std::string>();
  return absl::OkStatus();
}

// "fp32", "bf16" or "fp16" (also DeepSpeed's "bfp16" and base/dtype's long names); null = unset.
absl::Status ReadDType(const Json& obj, const std::string& path, const char* key,
                       std::optional<DType>* out) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return absl::OkStatus();
  constexpr absl::string_view kWhat = "\"fp32\", \"bf16\", \"fp16\" or null";
  if (!it->is_string()) return JsonExpected(JsonPath(path, key), kWhat, *it);
  std::string name = it->get<std::string>();
  if (name == "bfp16") name = "bf16";
  absl::StatusOr<DType> d = ParseDType(name);
  if (!d.ok()) return JsonExpected(JsonPath(path, key), kWhat, *it);
  *out = *d;
  return absl::OkStatus();
}

const Json* Object(Reader* r, const Json& obj, const std::string& path, const char* key) {
  absl::StatusOr<const Json*> o = ReadObject(obj, path, key);
  r->Check(o.status());
  return o.ok() ? *o : nullptr;
}

absl::Status ReadOffloadDevice(const Json& obj, const std::string& path, OffloadDevice* out) {
  auto it = obj.find("device");
  if (it == obj.end()) return absl::OkStatus();
  std::string device_path = JsonPath(path, "device");
  constexpr absl::string_view kWhat = "\"none\", \"cpu\" or \"nvme\"";
  if (!it->is_string()) return JsonExpected(device_path, kWhat, *it);
  const std::string& s = it->get_ref<const std::string&>();
  if (s == "none") {
    *out = OffloadDevice::kNone;
  } else if (s == "cpu") {
    *out = OffloadDevice::kCpu;
  } else if (s == "nvme") {
    *out = OffloadDevice::kNvme;
  } else {
    return JsonExpected(device_path, kWhat, *it);
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// The config, level by level.

constexpr char kNvmeTuning[] =
    "a tuning switch of DeepSpeed's NVMe swapper, which zerort's nvme offload does not have";
constexpr char kMonitoring[] = "monitoring belongs to the trainer";
constexpr char kCheckpointing[] = "checkpointing belongs to the trainer";
constexpr char kTrainerFeature[] = "a DeepSpeed feature of the training loop or model, not of "
                                   "the optimizer runtime; the trainer implements it or not";

void RequireNvmePath(Reader* r, const std::string& path, OffloadDevice device,
                     const std::string& nvme_path) {
  if (device == OffloadDevice::kNvme && nvme_path.empty() && !r->Failed(path)) {
    r->Error(absl::StrCat(path, ".device is \"nvme\" but ", path,
                          ".nvme_path is not set; name a directory on a local NVMe disk"));
  }
}

void ReadOffloadOptimizer(Reader* r, const Json& obj, const std::string& path,
                          OffloadOptimizerConfig* out) {
  CheckKeys(r, obj, path, {"device", "pin_memory", "buffer_count", "nvme_path"},
            {{"pipeline_read", nullptr, kNvmeTuning},
             {"pipeline_write", nullptr, kNvmeTuning},
             {"fast_init", nullptr, kNvmeTuning},
             {"ratio", "1.0", "partial optimizer offload"}});
  r->Check(ReadOffloadDevice(obj, path, &out->device));
  r->Check(ReadBool(obj, path, "pin_memory", &out->pin_memory));
  r->Check(ReadInt(obj, path, "buffer_count", 1, kIntMax, &out->buffer_count));
  r->Check(ReadString(obj, path, "nvme_path", &out->nvme_path));
  RequireNvmePath(r, path, out->device, out->nvme_path);
}

void ReadOffloadParam(Reader* r, const Json& obj, const std::string& path,
                      OffloadParamConfig* out) {
  CheckKeys(r, obj, path, {"device", "pin_memory", "nvme_path", "buffer_count", "buffer_size"},
            {{"max_in_cpu", nullptr, kNvmeTuning}});
  r->Check(ReadOffloadDevice(obj, path, &out->device));
  r->Check(ReadBool(obj, path, "pin_memory", &out->pin_memory));
  r->Check(ReadString(obj, path, "nvme_path", &out->nvme_path));
  r->Check(ReadInt(obj, path, "buffer_count", 1, kIntMax, &out->buffer_count));
  r->Check(ReadInt64(obj, path, "buffer_size", 1, kInt64Max, &out->buffer_size));
  RequireNvmePath(r, path, out->device, out->nvme_path);
}

void ReadMemoryBudget(Reader* r, const Json& obj, const std::string& path, MemoryBudget* out) {
  CheckKeys(r, obj, path, {"device_bytes", "host_bytes"}, {});
  r->Check(ReadInt64(obj, path, "device_bytes", 0, kInt64Max, &out->device_bytes));
  r->Check(ReadInt64(obj, path, "host_bytes", 0, kInt64Max, &out->host_bytes));
}

// What zerort always does in place of three DeepSpeed switches (docs/config.md says the same).
constexpr char kOverlapWhy[] =
    "zerort always overlaps gradient reduction with backward: each unit is reduced as soon as "
    "GradReady has been called for all its parameters, while backward goes on";
constexpr char kContiguousWhy[] =
    "zerort always keeps gradients in contiguous buffers: one flat buffer for the whole model in "
    "stages 0-1, one flat bucket per unit in stages 2-3, which every reduction reads in place";
constexpr char kAllgatherWhy[] =
    "zerort all-gathers parameters one unit at a time, and units are sized by "
    "zero_optimization.reduce_bucket_size";

// Keys DeepSpeed users set that zerort parses (their types and ranges are checked) but that
// change nothing: each present one adds a note saying what zerort does instead.
void NoteFixedBehaviour(Reader* r, const Json& obj, const std::string& path, const ZeroConfig& z) {
  // `what` names the behaviour a `false` asks to turn off.
  auto note = [&](const char* key, bool turned_off, const char* what, const char* why) {
    if (!obj.contains(key) || r->Failed(JsonPath(path, key))) return;
    r->Ignored(turned_off ? absl::StrCat(JsonPath(path, key), ": false has no effect, ", what,
                                         " cannot be turned off: ", why)
                          : absl::StrCat(JsonPath(path, key), ": accepted, no effect: ", why));
  };
  note("overlap_comm", !z.overlap_comm, "overlap", kOverlapWhy);
  note("contiguous_gradients", !z.contiguous_gradients, "contiguous gradients", kContiguousWhy);
  note("allgather_bucket_size", false, "", kAllgatherWhy);
}

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
void ReadDeprecatedOffload(Reader* r, const Json& obj, const std::string& path, ZeroConfig* out) {
  auto flag = [&](const char* key, const char* block, OffloadDevice* device) {
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
  };
  flag("cpu_offload", "offload_optimizer", &out->offload_optimizer.device);
  flag("cpu_offload_param", "offload_param", &out->offload_param.device);
  bool pin = true;
  absl::Status s = ReadBool(obj, path, "cpu_offload_use_pin_memory", &pin);
  r->Check(s);
  if (obj.contains("cpu_offload_use_pin_memory") && s.ok()) {
    out->offload_optimizer.pin_memory = out->offload_param.pin_memory = pin;
    r->Note(absl::StrCat(JsonPath(path, "cpu_offload_use_pin_memory"),
                         ": deprecated DeepSpeed spelling, read as pin_memory of both offloads"));
  }
}

// The stage3_ settings DeepSpeed also accepts without the prefix (its pydantic aliases).
struct Alias {
  const char* canonical;
  const char* alias;
};
constexpr Alias kZeroAliases[] = {
    {"stage3_prefetch_bucket_size", "prefetch_bucket_size"},
    {"stage3_param_persistence_threshold", "param_persistence_threshold"},
    {"stage3_max_live_parameters", "max_live_parameters"},
    {"stage3_max_reuse_distance", "max_reuse_distance"},
    {"stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save"},
    {"stage3_model_persistence_threshold", "model_persistence_threshold"},
    {"stage3_module_granularity_threshold", "module_granularity_threshold"},
    {"stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params"},
};

void CheckZeroKeys(Reader* r, const Json& obj, const std::string& path) {
  CheckKeys(
      r, obj, path,
      {"stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm",
       "contiguous_gradients", "offload_optimizer", "offload_param", "stage3_prefetch_bucket_size",
       "prefetch_bucket_size", "stage3_param_persistence_threshold", "param_persistence_threshold",
       "stage3_max_live_parameters", "max_live_parameters", "memory_budget", "cpu_offload",
       "cpu_offload_param", "cpu_offload_use_pin_memory"},
      {{"allgather_partitions", nullptr, "parameters are always all-gathered per unit"},
       {"reduce_scatter", nullptr, "the reduction collective follows from the stage"},
       {"use_multi_rank_bucket_allreduce", nullptr,
        "the reduction collective follows from the stage"},
       {"round_robin_gradients", nullptr, "host gradient copies follow unit order"},
       {"ignore_unused_parameters", nullptr,
        "every parameter needs GradReady each micro-step (Step names a missing one); hand an "
        "unused parameter's gradient over as zeros"},
       {"sub_group_size", nullptr, "the host optimizer already steps one unit shard at a time"},
       {"stage3_max_reuse_distance", nullptr,
        "stage-3 release is driven by the trainer's Release calls"},
       {"max_reuse_distance", nullptr, "stage-3 release is driven by the trainer's Release calls"},
       {"stage3_model_persistence_threshold", nullptr,
        "persistence follows stage3_param_persistence_threshold alone"},
       {"model_persistence_threshold", nullptr,
        "persistence follows stage3_param_persistence_threshold alone"},
       {"stage3_module_granularity_threshold", nullptr, "the trainer gathers whole units"},
       {"module_granularity_threshold", nullptr, "the trainer gathers whole units"},
       {"stage3_use_all_reduce_for_fetch_params", nullptr, "units are gathered with all-gather"},
       {"use_all_reduce_for_fetch_params", nullptr, "units are gathered with all-gather"},
       {"stage3_gather_16bit_weights_on_model_save", nullptr, kCheckpointing},
       {"gather_16bit_weights_on_model_save", nullptr, kCheckpointing},
       {"stage3_gather_fp16_weights_on_model_save", nullptr, kCheckpointing},
       {"elastic_checkpoint", nullptr, kCheckpointing},
       {"load_from_fp32_weights", nullptr, kCheckpointing},
       {"pipeline_loading_checkpoint", nullptr, kCheckpointing},
       {"memory_efficient_linear", nullptr, kTrainerFeature},
       {"override_module_apply", nullptr, kTrainerFeature},
       {"legacy_stage1", "false", "the old stage-1 implementation"},
       {"zero_quantized_weights", "false", "quantized communication"},
       {"zero_quantized_nontrainable_weights", "false", "quantized weights"},
       {"zero_quantized_gradients", "false", "quantized communication"},
       {"zeropp_loco_param", "null", "quantized communication"},
       {"zero_hpz_partition_size", "1", "hierarchical partitioning"},
       {"mics_shard_size", "-1", "MiCS sharding"},
       {"mics_hierarchical_params_gather", "false", "MiCS sharding"}});
}

void ReadZero(Reader* r, const Json& obj, const std::string& path, ZeroConfig* out) {
  CheckZeroKeys(r, obj, path);
  for (const Alias& a : kZeroAliases) Spelling(r, obj, path, a.canonical, a.alias);
  ReadStage(r, obj, path, out);
  r->Check(ReadSizeOrAuto(obj, path, "reduce_bucket_size", 1, &out->reduce_bucket_size));
  r->Check(
      ReadInt64(obj, path, "allgather_bucket_size", 1, kInt64Max, &out->allgather_bucket_size));
  r->Check(ReadBool(obj, path, "overlap_comm", &out->overlap_comm));
  r->Check(ReadBool(obj, path, "contiguous_gradients", &out->contiguous_gradients));
  NoteFixedBehaviour(r, obj, path, *out);
  if (const Json* o = Object(r, obj, path, "offload_optimizer")) {
    ReadOffloadOptimizer(r, *o, JsonPath(path, "offload_optimizer"), &out->offload_optimizer);
  }
  if (const Json* o = Object(r, obj, path, "offload_param")) {
    ReadOffloadParam(r, *o, JsonPath(path, "offload_param"), &out->offload_param);
  }
  ReadDeprecatedOffload(r, obj, path, out);
  // Both spellings are read: when both are given, Spelling has reported it.
  r->Check(
      ReadSizeOrAuto(obj, path, "stage3_prefetch_bucket_size", 0, &out->stage3_prefetch_bucket_size));
  r->Check(ReadSizeOrAuto(obj, path, "prefetch_bucket_size", 0, &out->stage3_prefetch_bucket_size));
  r->Check(ReadSizeOrAuto(obj, path, "stage3_param_persistence_threshold", 0,
                          &out->stage3_param_persistence_threshold));
  r->Check(ReadSizeOrAuto(obj, path, "param_persistence_threshold", 0,
                          &out->stage3_param_persistence_threshold));
  // OpenRLHF-style configs write "auto" here too; ResolveAuto gives DeepSpeed's default.
  const std::string live_path = JsonPath(path, "stage3_max_live_parameters");
  for (const char* key : {"stage3_max_live_parameters", "max_live_parameters"}) {
    if (TakeAuto(r, obj, key, live_path)) continue;
    r->Check(ReadInt64(obj, path, key, 1, kInt64Max, &out->stage3_max_live_parameters));
  }
  if (const Json* budget = Object(r, obj, path, "memory_budget")) {
    ReadMemoryBudget(r, *budget, JsonPath(path, "memory_budget"), &out->memory_budget);
  }
}

// "enabled": true, false or "auto" (the trainer's compute dtype decides; ResolveAuto).
void ReadEnabled(Reader* r, const Json& obj, const std::string& path, bool* enabled) {
  if (TakeAuto(r, obj, "enabled", JsonPath(path, "enabled"))) return;
  r->Check(ReadBool(obj, path, "enabled", enabled));
}

void ReadFp16(Reader* r, const Json& obj, const std::string& path, bool* enabled,
              Fp16Config* out) {
  CheckKeys(r, obj, path,
            {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "min_loss_scale"},
            {{"consecutive_hysteresis", "false", "hysteresis refill"},
             {"auto_cast", nullptr, "casting the model's inputs belongs to the trainer"},
             {"fp16_master_weights_and_grads", "false", "master weights are always fp32"}});
  ReadEnabled(r, obj, path, enabled);
  r->Check(ReadDouble(obj, path, "loss_scale", {0, false, INFINITY, false}, &out->loss_scale));
  // 2^127 is the largest power of two a float holds.
  r->Check(ReadInt(obj, path, "initial_scale_power", 0, 127, &out->initial_scale_power));
  r->Check(ReadInt(obj, path, "loss_scale_window", 1, kIntMax, &out->loss_scale_window));
  r->Check(ReadInt(obj, path, "hysteresis", 1, kIntMax, &out->hysteresis));
  r->Check(
      ReadDouble(obj, path, "min_loss_scale", {0, true, INFINITY, false}, &out->min_loss_scale));
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

void ReadOptimizer(Reader* r, const Json& obj, const std::string& path, OptimizerConfig* out) {
  CheckKeys(r, obj, path, {"type", "params"}, {});
  ReadOptimizerType(r, obj, path, out);
  const Json* params = Object(r, obj, path, "params");
  if (params == nullptr) return;
  std::string params_path = JsonPath(path, "params");
  CheckKeys(r, *params, params_path, {"lr", "betas", "eps", "weight_decay"},
            {{"adam_w_mode", "true", "Adam with coupled L2 weight decay"},
             {"bias_correction", "true", "Adam without bias correction"},
             {"amsgrad", "false", "AMSGrad"},
             {"torch_adam", nullptr, "zerort has one AdamW implementation per device"},
             {"fused", nullptr, "zerort has one AdamW implementation per device"}});
  const DoubleRange kNonNegative{0, false, INFINITY, false};
  r->Check(ReadDoubleOrAuto(r, *params, params_path, "lr", kNonNegative, &out->lr));
  std::string betas_path = JsonPath(params_path, "betas");
  if (auto it = params->find("betas");
      it != params->end() && !TakeAuto(r, *params, "betas", betas_path)) {
    if (!it->is_array() || it->size() != 2) {
      r->Check(JsonExpected(betas_path, "an array of two numbers [beta1, beta2] or \"auto\"", *it));
    } else {
      const DoubleRange kBeta{0, false, 1, true};
      r->Check(ToDouble((*it)[0], betas_path + "[0]", kBeta, &out->beta1));
      r->Check(ToDouble((*it)[1], betas_path + "[1]", kBeta, &out->beta2));
    }
  }
  r->Check(
      ReadDoubleOrAuto(r, *params, params_path, "eps", {0, true, INFINITY, false}, &out->eps));
  r->Check(ReadDoubleOrAuto(r, *params, params_path, "weight_decay", kNonNegative,
                            &out->weight_decay));
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
  const DoubleRange kNonNegative{0, false, INFINITY, false};
  const bool cosine = s->type == SchedulerType::kWarmupCosineLR;
  if (cosine) {
    CheckKeys(r, p, path,
              {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio",
               "warmup_type"},
              {{"last_batch_iteration", nullptr, kResumeWhy}});
    r->Check(ReadDoubleOrAuto(r, p, path, "warmup_min_ratio", kNonNegative, &s->warmup_min_ratio));
    r->Check(ReadDoubleOrAuto(r, p, path, "cos_min_ratio", kNonNegative, &s->cos_min_ratio));
  } else {
    if (s->type == SchedulerType::kWarmupDecayLR) {
      CheckKeys(r, p, path,
                {"total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                 "warmup_type"},
                {{"last_batch_iteration", nullptr, kResumeWhy}});
    } else {
      CheckKeys(r, p, path, {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"},
                {{"last_batch_iteration", nullptr, kResumeWhy}});
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
            {{"last_batch_iteration", nullptr, kResumeWhy},
             {"cycle_momentum", nullptr, kMomentumWhy},
             {"cycle_min_mom", nullptr, kMomentumWhy},
             {"cycle_max_mom", nullptr, kMomentumWhy},
             {"decay_mom_rate", nullptr, kMomentumWhy},
             {"cycle_first_stair_count", nullptr, kStairWhy},
             {"cycle_second_stair_count", nullptr, kStairWhy}});
  const DoubleRange kNonNegative{0, false, INFINITY, false};
  for (const char* key : {"cycle_min_lr", "cycle_max_lr"}) {
    if (!p.contains(key)) {
      r->Error(absl::StrCat(JsonPath(path, key), ": missing; OneCycle needs it"));
    }
  }
  r->Check(ReadDoubleOrAuto(r, p, path, "cycle_min_lr", kNonNegative, &s->cycle_min_lr));
  r->Check(ReadDoubleOrAuto(r, p, path, "cycle_max_lr", kNonNegative, &s->cycle_max_lr));
  r->Check(ReadDoubleOrAuto(r, p, path, "decay_lr_rate", kNonNegative, &s->decay_lr_rate));
  r->Check(ReadInt64(p, path, "cycle_first_step_size", 1, kInt64Max, &s->cycle_first_step_size));
  if (auto it = p.find("cycle_second_step_size"); it != p.end() && !it->is_null()) {
    r->Check(ToInt64(*it, JsonPath(path, "cycle_second_step_size"), 1, kInt64Max,
                     "an integer >= 1 or null", &s->cycle_second_step_size));
  }
  r->Check(ReadInt64(p, path, "decay_step_size", 0, kInt64Max, &s->decay_step_size));
}

void ReadRangeTestParams(Reader* r, const Json& p, const std::string& path, SchedulerConfig* s) {
  CheckKeys(r, p, path,
            {"lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate",
             "lr_range_test_staircase"},
            {{"last_batch_iteration", nullptr, kResumeWhy}});
  const DoubleRange kNonNegative{0, false, INFINITY, false};
  r->Check(ReadDoubleOrAuto(r, p, path, "lr_range_test_min_lr", kNonNegative,
                            &s->lr_range_test_min_lr));
  r->Check(
      ReadInt64(p, path, "lr_range_test_step_size", 1, kInt64Max, &s->lr_range_test_step_size));
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

// ---- aio, data_types, zerort

void ReadAio(Reader* r, const Json& obj, const std::string& path, AioConfig* out) {
  CheckKeys(r, obj, path,
            {"block_size", "queue_depth", "single_submit", "overlap_events", "thread_count",
             "intra_op_parallelism"},
            {{"use_gds", "false", "GPUDirect Storage"}});
  r->Check(ReadInt64(obj, path, "block_size", 4096, kInt64Max, &out->block_size));
  if (out->block_size % 4096 != 0 && !r->Failed(JsonPath(path, "block_size"))) {
    r->Error(absl::StrCat(JsonPath(path, "block_size"), ": expected a multiple of 4096, got ",
                          out->block_size));
  }
  r->Check(ReadInt(obj, path, "queue_depth", 1, kIntMax, &out->queue_depth));
  r->Check(ReadBool(obj, path, "single_submit", &out->single_submit));
  r->Check(ReadBool(obj, path, "overlap_events", &out->overlap_events));
  // DeepSpeed renamed thread_count to intra_op_parallelism.
  r->Check(ReadInt(obj, path, Spelling(r, obj, path, "thread_count", "intra_op_parallelism"), 1,
                   kIntMax, &out->thread_count));
}

void ReadParamGroups(Reader* r, const Json& obj, const std::string& path,
                     std::vector<ParamGroupConfig>* out) {
  auto it = obj.find("param_groups");
  if (it == obj.end()) return;
  const std::string groups_path = JsonPath(path, "param_groups");
  if (!it->is_array()) return r->Check(JsonExpected(groups_path, "an array of objects", *it));
  const DoubleRange kNonNegative{0, false, INFINITY, false};
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

void ReadZerort(Reader* r, const Json& obj, const std::string& path, Config* config) {
  CheckKeys(r, obj, path, {"strict", "param_groups"}, {});
  r->Check(ReadBool(obj, path, "strict", &config->strict));
  ReadParamGroups(r, obj, path, &config->param_groups);
}

void ReadDataTypes(Reader* r, const Json& obj, const std::string& path, Config* config) {
  CheckKeys(r, obj, path, {"grad_accum_dtype"}, {});
  r->Check(ReadDType(obj, path, "grad_accum_dtype", &config->grad_accum_dtype));
}

// ---- the top level

void CheckTopKeys(Reader* r, const Json& root) {
  CheckKeys(
      r, root, "",
      {"zero_optimization", "bf16", "bfloat16", "fp16", "optimizer", "scheduler",
       "gradient_clipping", "gradient_accumulation_steps", "train_batch_size",
       "train_micro_batch_size_per_gpu", "communication_data_type", "data_types", "aio",
       "comm_timeout_ms", "cpu_threads", "zerort"},
      {{"steps_per_print", nullptr, kMonitoring},
       {"wall_clock_breakdown", nullptr, kMonitoring},
       {"memory_breakdown", nullptr, kMonitoring},
       {"dump_state", nullptr, kMonitoring},
       {"tensorboard", nullptr, kMonitoring},
       {"wandb", nullptr, kMonitoring},
       {"csv_monitor", nullptr, kMonitoring},
       {"comet", nullptr, kMonitoring},
       {"comms_logger", nullptr, kMonitoring},
       {"flops_profiler", nullptr, kMonitoring},
       {"timers", nullptr, kMonitoring},
       {"zero_allow_untested_optimizer", nullptr, "the optimizer is always zerort's AdamW"},
       {"zero_force_ds_cpu_optimizer", nullptr, "offloaded steps always run zerort's host AdamW"},
       {"activation_checkpointing", nullptr, "activation checkpointing belongs to the trainer"},
       {"checkpoint", nullptr, kCheckpointing},
       {"load_universal_checkpoint", nullptr, kCheckpointing},
       {"dataloader_drop_last", nullptr, "data loading belongs to the trainer"},
       {"data_efficiency", nullptr, kTrainerFeature},
       {"curriculum_learning", nullptr, kTrainerFeature},
       {"progressive_layer_drop", nullptr, kTrainerFeature},
       {"sparse_attention", nullptr, kTrainerFeature},
       {"pipeline", nullptr, kTrainerFeature},
       {"compression_training", nullptr, kTrainerFeature},
       {"quantize_training", nullptr, kTrainerFeature},
       {"eigenvalue", nullptr, kTrainerFeature},
       {"elasticity", nullptr, kTrainerFeature},
       {"autotuning", nullptr, kTrainerFeature},
       {"nebula", nullptr, kCheckpointing},
       {"compile", nullptr, kTrainerFeature},
       {"torch_autocast", nullptr, "casting the model's inputs belongs to the trainer"},
       {"seq_parallel_communication_data_type", nullptr, "zerort has no sequence parallelism"},
       {"prescale_gradients", "false", "gradient prescaling"},
       {"gradient_predivide_factor", "1.0", "gradient predivision"},
       {"sparse_gradients", "false", "sparse gradients"},
       {"disable_allgather", "false", "broadcast instead of all-gather"},
       {"amp", "{\"enabled\": false}", "Apex AMP"},
       {"hybrid_engine", "{\"enabled\": false}", "the RLHF hybrid engine"}});
}

// bf16 / bfloat16 (DeepSpeed's older name for the same block) / fp16.
void ReadPrecision(Reader* r, const Json& root, Config* config) {
  bool bf16 = false, fp16 = false;
  const char* bf16_key = Spelling(r, root, "", "bf16", "bfloat16");
  if (const Json* b = Object(r, root, "", bf16_key)) {
    CheckKeys(r, *b, bf16_key, {"enabled"},
              {{"immediate_grad_update", nullptr, "gradients are accumulated in the unit buckets"},
               {"check_grad_overflow", nullptr, "bf16 steps never skip on overflow"}});
    ReadEnabled(r, *b, "bf16", &bf16);
    if (std::string(bf16_key) == "bfloat16") {
      r->Note("bfloat16: DeepSpeed's older name of the bf16 block, read as bf16");
    }
  }
  if (const Json* f = Object(r, root, "", "fp16")) ReadFp16(r, *f, "fp16", &fp16, &config->fp16);
  if (bf16 && fp16) r->Error("bf16.enabled and fp16.enabled are both true; enable at most one");
  config->compute_dtype = bf16 ? DType::kBF16 : fp16 ? DType::kF16 : DType::kF32;
}

void ReadTopScalars(Reader* r, const Json& root, Config* config) {
  const std::string top;
  r->Check(ReadDoubleOrAuto(r, root, top, "gradient_clipping", {0, false, INFINITY, false},
                            &config->gradient_clipping));
  int64_t gas = config->gradient_accumulation_steps;
  r->Check(ReadInt64OrAuto(r, root, top, "gradient_accumulation_steps", 1, &gas));
  if (gas > kIntMax) {
    r->Error(absl::StrCat("gradient_accumulation_steps: expected an integer >= 1 and <= ", kIntMax,
                          ", got ", gas));
  } else {
    config->gradient_accumulation_steps = static_cast<int>(gas);
  }
  // Batch sizes are not settings: "auto" is simply 0 (ResolveAuto takes them from its fill).
  for (auto [key, out] : {std::pair<const char*, int64_t*>{"train_batch_size",
                                                           &config->train_batch_size},
                          {"train_micro_batch_size_per_gpu",
                           &config->train_micro_batch_size_per_gpu}}) {
    auto it = root.find(key);
    if (it == root.end()) continue;
    if (!IsAuto(*it)) {
      r->Check(ToInt64(*it, key, 1, kInt64Max, "an integer >= 1 or \"auto\"", out));
    }
    r->Note(absl::StrCat(key, ": the trainer owns batch sizes; checked only for consistency "
                              "(train = micro * gradient_accumulation_steps * world size)"));
  }
  // DeepSpeed derives the accumulation from the two batch sizes when it is not written: so does
  // ResolveAuto, once it knows the world size.
  if (!root.contains("gradient_accumulation_steps") && root.contains("train_batch_size") &&
      root.contains("train_micro_batch_size_per_gpu")) {
    r->Auto("gradient_accumulation_steps");
  }
  r->Check(ReadDType(root, top, "communication_data_type", &config->communication_dtype));
  r->Check(ReadInt64(root, top, "comm_timeout_ms", 1, kInt64Max, &config->comm_timeout_ms));
  r->Check(ReadInt(root, top, "cpu_threads", 0, kIntMax, &config->cpu_threads));
}

// Rules across keys, each checked only when the keys involved parsed.
void CheckAcrossKeys(Reader* r, const Config& c) {
  const ZeroConfig& z = c.zero;
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
}

// The defaults zerort uses when a config has no optimizer block, said once.
std::string OptimizerDefaultsNote(const OptimizerConfig& o) {
  return absl::StrCat("optimizer: absent; using AdamW lr=", o.lr, ", betas=[", o.beta1, ", ",
                      o.beta2, "], eps=", o.eps, ", weight_decay=", o.weight_decay,
                      " (zerort's defaults; DeepSpeed would leave the optimizer to the trainer)");
}

void ReadConfig(Reader* r, const Json& root, Config* config) {
  if (!root.is_object()) return r->Check(JsonExpected("<root>", "a JSON object", root));
  const std::string top;
  CheckTopKeys(r, root);
  if (const Json* zero = Object(r, root, top, "zero_optimization")) {
    ReadZero(r, *zero, "zero_optimization", &config->zero);
  }
  ReadPrecision(r, root, config);
  if (const Json* optimizer = Object(r, root, top, "optimizer")) {
    ReadOptimizer(r, *optimizer, "optimizer", &config->optimizer);
  } else if (!root.contains("optimizer")) {
    r->Note(OptimizerDefaultsNote(config->optimizer));
  }
  // "scheduler": null is DeepSpeed's default: no schedule.
  if (auto it = root.find("scheduler"); it != root.end() && !it->is_null()) {
    if (const Json* s = Object(r, root, top, "scheduler")) {
      ReadScheduler(r, *s, "scheduler", &config->scheduler);
    }
  }
  ReadTopScalars(r, root, config);
  if (const Json* d = Object(r, root, top, "data_types")) {
    ReadDataTypes(r, *d, "data_types", config);
  }
  if (const Json* aio = Object(r, root, top, "aio")) ReadAio(r, *aio, "aio", &config->aio);
  if (const Json* z = Object(r, root, top, "zerort")) ReadZerort(r, *z, "zerort", config);
  CheckAcrossKeys(r, *config);
}

// Writes "auto" at a dotted path of the dump, creating objects on the way.
void SetAuto(Json* root, const std::string& path) {
  Json* at = root;
  for (absl::string_view part : absl::StrSplit(path, '.')) {
    // A hand-built Config may list a path through a value; such a path names no setting.
    if (!at->is_object() && !at->is_null()) return;
    at = &(*at)[std::string(part)];
  }
  *at = "auto";
}

std::vector<std::string> Sorted(std::vector<std::string> v) {
  std::sort(v.begin(), v.end());
  return v;
}

}  // namespace

bool operator==(const OffloadOptimizerConfig& a, const OffloadOptimizerConfig& b) {
  return a.device == b.device && a.pin_memory == b.pin_memory &&
         a.buffer_count == b.buffer_count && a.nvme_path == b.nvme_path;
}

bool operator==(const OffloadParamConfig& a, const OffloadParamConfig& b) {
  return a.device == b.device && a.pin_memory == b.pin_memory && a.nvme_path == b.nvme_path &&
         a.buffer_count == b.buffer_count && a.buffer_size == b.buffer_size;
}

bool operator==(const MemoryBudget& a, const MemoryBudget& b) {
  return a.device_bytes == b.device_bytes && a.host_bytes == b.host_bytes;
}

bool operator==(const ZeroConfig& a, const ZeroConfig& b) {
  return a.stage_auto == b.stage_auto && (a.stage_auto || a.stage == b.stage) &&
         a.reduce_bucket_size == b.reduce_bucket_size &&
         a.offload_optimizer == b.offload_optimizer && a.offload_param == b.offload_param &&
         a.stage3_prefetch_bucket_size == b.stage3_prefetch_bucket_size &&
         a.stage3_param_persistence_threshold == b.stage3_param_persistence_threshold &&
         a.stage3_max_live_parameters == b.stage3_max_live_parameters &&
         a.memory_budget == b.memory_budget;
}

bool operator==(const Fp16Config& a, const Fp16Config& b) {
  return a.loss_scale == b.loss_scale && a.initial_scale_power == b.initial_scale_power &&
         a.loss_scale_window == b.loss_scale_window && a.hysteresis == b.hysteresis &&
         a.min_loss_scale == b.min_loss_scale;
}

bool operator==(const OptimizerConfig& a, const OptimizerConfig& b) {
  return a.type == b.type && a.lr == b.lr && a.beta1 == b.beta1 && a.beta2 == b.beta2 &&
         a.eps == b.eps && a.weight_decay == b.weight_decay;
}

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

bool operator==(const AioConfig& a, const AioConfig& b) {
  return a.block_size == b.block_size && a.queue_depth == b.queue_depth &&
         a.single_submit == b.single_submit && a.overlap_events == b.overlap_events &&
         a.thread_count == b.thread_count;
}

bool operator==(const ParamGroupConfig& a, const ParamGroupConfig& b) {
  return a.pattern == b.pattern && a.weight_decay == b.weight_decay && a.lr_scale == b.lr_scale;
}

bool operator==(const Config& a, const Config& b) {
  return a.zero == b.zero && a.compute_dtype == b.compute_dtype && a.fp16 == b.fp16 &&
         a.optimizer == b.optimizer && a.gradient_clipping == b.gradient_clipping &&
         a.gradient_accumulation_steps == b.gradient_accumulation_steps &&
         a.comm_timeout_ms == b.comm_timeout_ms && a.cpu_threads == b.cpu_threads &&
         a.grad_accum_dtype == b.grad_accum_dtype &&
         a.communication_dtype == b.communication_dtype && a.aio == b.aio &&
         a.param_groups == b.param_groups && a.scheduler == b.scheduler && a.strict == b.strict &&
         Sorted(a.auto_keys) == Sorted(b.auto_keys);
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

namespace {

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

Json ZeroJson(const ZeroConfig& z) {
  auto size = [](int64_t v) { return v == kAutoSize ? Json("auto") : Json(v); };
  auto path = [](const std::string& p) { return p.empty() ? Json() : Json(p); };
  Json zero;
  zero["stage"] = z.stage_auto ? Json("auto") : Json(z.stage);
  zero["reduce_bucket_size"] = size(z.reduce_bucket_size);
  zero["offload_optimizer"] = {
      {"device", std::string(OffloadDeviceName(z.offload_optimizer.device))},
      {"pin_memory", z.offload_optimizer.pin_memory},
      {"buffer_count", z.offload_optimizer.buffer_count},
      {"nvme_path", path(z.offload_optimizer.nvme_path)}};
  zero["offload_param"] = {{"device", std::string(OffloadDeviceName(z.offload_param.device))},
                           {"pin_memory", z.offload_param.pin_memory},
                           {"nvme_path", path(z.offload_param.nvme_path)},
                           {"buffer_count", z.offload_param.buffer_count},
                           {"buffer_size", z.offload_param.buffer_size}};
  zero["stage3_prefetch_bucket_size"] = size(z.stage3_prefetch_bucket_size);
  zero["stage3_param_persistence_threshold"] = size(z.stage3_param_persistence_threshold);
  zero["stage3_max_live_parameters"] = z.stage3_max_live_parameters;
  zero["memory_budget"] = {{"device_bytes", z.memory_budget.device_bytes},
                           {"host_bytes", z.memory_budget.host_bytes}};
  return zero;
}

}  // namespace

std::string ResolvedConfigJson(const Config& c) {
  auto dtype = [](const std::optional<DType>& d) {
    return d ? Json(std::string(DTypeName(*d))) : Json();
  };
  Json root;
  root["zero_optimization"] = ZeroJson(c.zero);
  root["bf16"] = {{"enabled", c.compute_dtype == DType::kBF16}};
  root["fp16"] = {{"enabled", c.compute_dtype == DType::kF16},
                  {"loss_scale", c.fp16.loss_scale},
                  {"initial_scale_power", c.fp16.initial_scale_power},
                  {"loss_scale_window", c.fp16.loss_scale_window},
                  {"hysteresis", c.fp16.hysteresis},
                  {"min_loss_scale", c.fp16.min_loss_scale}};
  root["optimizer"] = {{"type", c.optimizer.type},
                       {"params",
                        {{"lr", c.optimizer.lr},
                         {"betas", {c.optimizer.beta1, c.optimizer.beta2}},
                         {"eps", c.optimizer.eps},
                         {"weight_decay", c.optimizer.weight_decay}}}};
  root["scheduler"] = SchedulerJson(c.scheduler);
  root["gradient_clipping"] = c.gradient_clipping;
  root["gradient_accumulation_steps"] = c.gradient_accumulation_steps;
  root["communication_data_type"] = dtype(c.communication_dtype);
  root["data_types"] = {{"grad_accum_dtype", dtype(c.grad_accum_dtype)}};
  root["aio"] = {{"block_size", c.aio.block_size},       {"queue_depth", c.aio.queue_depth},
                 {"single_submit", c.aio.single_submit}, {"overlap_events", c.aio.overlap_events},
                 {"thread_count", c.aio.thread_count}};
  root["comm_timeout_ms"] = c.comm_timeout_ms;
  root["cpu_threads"] = c.cpu_threads;
  Json groups = Json::array();
  for (const ParamGroupConfig& g : c.param_groups) {
    groups.push_back(
        {{"pattern", g.pattern}, {"weight_decay", g.weight_decay}, {"lr_scale", g.lr_scale}});
  }
  root["zerort"] = {{"strict", c.strict}, {"param_groups", std::move(groups)}};
  for (const std::string& path : c.auto_keys) SetAuto(&root, path);
  // `replace` keeps a hand-built Config with invalid UTF-8 in a string from throwing.
  return root.dump(2, ' ', false, Json::error_handler_t::replace);
}

absl::Status ValidateConfig(const Config& config) {
  // The dump writes every setting as written in a file, so parsing it applies exactly the rules
  // and messages of ParseConfig (a non-finite double dumps as null and fails as "got null").
  return ParseConfig(ResolvedConfigJson(config), "<Config>").status();
}

}  // namespace zerort
