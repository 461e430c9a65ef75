#include "zero/internal/config_scheduler.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "zero/internal/config_keys.h"

namespace zerort {
namespace config_internal {
namespace {

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
  if (s->type == SchedulerType::kWarmupCosineLR) {
    r->Check(ReadDoubleOrAuto(r, p, path, "warmup_min_ratio", kNonNegative, &s->warmup_min_ratio));
    r->Check(ReadDoubleOrAuto(r, p, path, "cos_min_ratio", kNonNegative, &s->cos_min_ratio));
  } else {
    r->Check(ReadDoubleOrAuto(r, p, path, "warmup_min_lr", kNonNegative, &s->warmup_min_lr));
    r->Check(ReadDoubleOrAuto(r, p, path, "warmup_max_lr", kNonNegative, &s->warmup_max_lr));
  }
  r->Check(ReadInt64OrAuto(r, p, path, "warmup_num_steps", 0, &s->warmup_num_steps));
  ReadWarmupType(r, p, path, &s->warmup_type);
  if (s->type == SchedulerType::kWarmupLR) return;
  r->Check(ReadInt64OrAuto(r, p, path, "total_num_steps", 1, &s->total_num_steps));
}

void ReadOneCycleParams(Reader* r, const Json& p, const std::string& path, SchedulerConfig* s) {
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
  r->Check(
      ReadDoubleOrAuto(r, p, path, "lr_range_test_min_lr", kNonNegative, &s->lr_range_test_min_lr));
  r->Check(ReadInt64(p, path, "lr_range_test_step_size", 1, &s->lr_range_test_step_size));
  r->Check(
      ReadDouble(p, path, "lr_range_test_step_rate", kNonNegative, &s->lr_range_test_step_rate));
  r->Check(ReadBool(p, path, "lr_range_test_staircase", &s->lr_range_test_staircase));
}

// The keys of a schedule's params: its settings, and DeepSpeed's keys it accepts without effect.
struct ParamKeys {
  std::vector<absl::string_view> settings;
  std::vector<KeyDef> foreign;
};

ParamKeys KeysOf(SchedulerType t) {
  ParamKeys k{{}, {Foreign("last_batch_iteration", kResumeWhy)}};
  switch (t) {
    case SchedulerType::kNone:
      break;
    case SchedulerType::kWarmupLR:
      k.settings = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"};
      break;
    case SchedulerType::kWarmupDecayLR:
      k.settings = {"total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                    "warmup_type"};
      break;
    case SchedulerType::kWarmupCosineLR:
      k.settings = {"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio",
                    "warmup_type"};
      break;
    case SchedulerType::kOneCycle:
      k.settings = {"cycle_min_lr",          "cycle_max_lr",           "decay_lr_rate",
                    "cycle_first_step_size", "cycle_second_step_size", "decay_step_size"};
      for (const char* m : {"cycle_momentum", "cycle_min_mom", "cycle_max_mom", "decay_mom_rate"}) {
        k.foreign.push_back(Foreign(m, kMomentumWhy));
      }
      k.foreign.push_back(Foreign("cycle_first_stair_count", kStairWhy));
      k.foreign.push_back(Foreign("cycle_second_stair_count", kStairWhy));
      break;
    case SchedulerType::kLRRangeTest:
      k.settings = {"lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate",
                    "lr_range_test_staircase"};
      break;
  }
  return k;
}

// Every schedule's keys, each once, for params whose schedule is not known.
ParamKeys KeysOfAny() {
  ParamKeys any;
  for (const SchedulerKind& kind : kSchedulers) {
    ParamKeys k = KeysOf(kind.type);
    for (absl::string_view name : k.settings) {
      if (std::find(any.settings.begin(), any.settings.end(), name) == any.settings.end()) {
        any.settings.push_back(name);
      }
    }
    for (const KeyDef& f : k.foreign) {
      auto same = [&](const KeyDef& g) { return absl::string_view(g.path) == f.path; };
      if (std::none_of(any.foreign.begin(), any.foreign.end(), same)) any.foreign.push_back(f);
    }
  }
  return any;
}

// The values of the params of s->type (their keys are checked apart).
void ReadParamValues(Reader* r, const Json& p, const std::string& path, SchedulerConfig* s) {
  switch (s->type) {
    case SchedulerType::kNone:
      return;
    case SchedulerType::kWarmupLR:
    case SchedulerType::kWarmupDecayLR:
    case SchedulerType::kWarmupCosineLR:
      return ReadWarmupParams(r, p, path, s);
    case SchedulerType::kOneCycle:
      return ReadOneCycleParams(r, p, path, s);
    case SchedulerType::kLRRangeTest:
      return ReadRangeTestParams(r, p, path, s);
  }
}

// The params DeepSpeed requires of s->type.
void CheckRequired(Reader* r, const Json& p, const std::string& path, const SchedulerConfig& s) {
  if (s.type == SchedulerType::kWarmupDecayLR || s.type == SchedulerType::kWarmupCosineLR) {
    if (!p.contains("total_num_steps")) {
      r->Error(absl::StrCat(JsonPath(path, "total_num_steps"), ": missing; ",
                            SchedulerTypeName(s.type), " needs it (a number, or \"auto\")"));
    }
  }
  if (s.type != SchedulerType::kOneCycle) return;
  for (const char* key : {"cycle_min_lr", "cycle_max_lr"}) {
    if (!p.contains(key))
      r->Error(absl::StrCat(JsonPath(path, key), ": missing; OneCycle needs it"));
  }
}

// With no schedule named (or a wrong one), the params are still read, each key as every
// schedule that has it would read it, so that one parse reports their problems too.
void ReadParamsOfAnySchedule(Reader* r, const Json& p, const std::string& path) {
  const ParamKeys any = KeysOfAny();
  CheckKeys(r, p, path, any.settings, any.foreign);
  for (const SchedulerKind& kind : kSchedulers) {
    Config scratch;
    Reader values(&scratch);
    scratch.scheduler.type = kind.type;
    ReadParamValues(&values, p, path, &scratch.scheduler);
    r->AbsorbErrors(values);  // a key that two schedules share is reported once
  }
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

}  // namespace

void ReadScheduler(Reader* r, const Json& obj, const std::string& path, SchedulerConfig* s) {
  CheckKeys(r, obj, path, {"type", "params"}, {});
  ReadSchedulerType(r, obj, path, s);
  const Json empty = Json::object();
  const Json* params = Object(r, obj, path, "params");
  if (params == nullptr) params = &empty;
  const std::string params_path = JsonPath(path, "params");
  if (s->type == SchedulerType::kNone) return ReadParamsOfAnySchedule(r, *params, params_path);
  const ParamKeys keys = KeysOf(s->type);
  CheckKeys(r, *params, params_path, keys.settings, keys.foreign);
  ReadParamValues(r, *params, params_path, s);
  CheckRequired(r, *params, params_path, *s);
}

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

}  // namespace config_internal

bool operator==(const SchedulerConfig& a, const SchedulerConfig& b) {
  return a.type == b.type && a.warmup_min_lr == b.warmup_min_lr &&
         a.warmup_max_lr == b.warmup_max_lr && a.warmup_num_steps == b.warmup_num_steps &&
         a.warmup_type == b.warmup_type && a.total_num_steps == b.total_num_steps &&
         a.warmup_min_ratio == b.warmup_min_ratio && a.cos_min_ratio == b.cos_min_ratio &&
         a.cycle_min_lr == b.cycle_min_lr && a.cycle_max_lr == b.cycle_max_lr &&
         a.decay_lr_rate == b.decay_lr_rate && a.cycle_first_step_size == b.cycle_first_step_size &&
         a.cycle_second_step_size == b.cycle_second_step_size &&
         a.decay_step_size == b.decay_step_size &&
         a.lr_range_test_min_lr == b.lr_range_test_min_lr &&
         a.lr_range_test_step_size == b.lr_range_test_step_size &&
         a.lr_range_test_step_rate == b.lr_range_test_step_rate &&
         a.lr_range_test_staircase == b.lr_range_test_staircase;
}

absl::string_view SchedulerTypeName(SchedulerType t) {
  for (const config_internal::SchedulerKind& k : config_internal::kSchedulers) {
    if (k.type == t) return k.name;
  }
  return "";
}

}  // namespace zerort
