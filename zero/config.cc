#include "zero/config.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <cstring>
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
#include "zero/internal/config_reader.h"
#include "zero/internal/config_scheduler.h"

namespace zerort {
namespace config_internal {
namespace {

// Every key is a row of zero/internal/config_keys.cc; this file holds what the rows drive (key
// checks, typed reads, the writer, operator==) and the rules no row can state. The problem
// collector and typed value readers are internal/config_reader's, the scheduler block
// internal/config_scheduler's, JSON parsing base/json's (which keeps the document's key order, so
// problems are listed in the file's order; the resolved dump reads in the table's).

// Whether `path` lies in `block` ("" holds everything), and what follows the block's name.
bool IsUnder(absl::string_view path, absl::string_view block) {
  return block.empty() ||
         (absl::StartsWith(path, block) && path.size() > block.size() && path[block.size()] == '.');
}
absl::string_view Below(absl::string_view path, absl::string_view block) {
  return block.empty() ? path : path.substr(block.size() + 1);
}

// DeepSpeed's other name of a block ("bfloat16" for "bf16"), or null.
const char* BlockAliasOf(absl::string_view block) {
  for (const BlockAlias& a : ConfigBlockAliases()) {
    if (block == a.block) return a.alias;
  }
  return nullptr;
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

absl::Status ToMember(const Json& v, const std::string& path, const KeyDef&, Member<std::string> m,
                      Config* c) {
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

void ReadDeprecatedPinMemory(Reader* r, const Json& obj, const std::string& path, const char* key,
                             ZeroConfig* z) {
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
  r->Note(absl::StrCat(k.path,
                       ": the trainer owns batch sizes; checked only for consistency "
                       "(train = micro * gradient_accumulation_steps * world size)"));
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
    if (pattern == g.end() || !pattern->is_string() ||
        pattern->get_ref<const std::string&>().empty()) {
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
    r->Error(absl::StrCat("zero_optimization.offload_param.device is \"",
                          OffloadDeviceName(z.offload_param.device),
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

// Compact optimizer state (docs/compact_state.md) keeps bf16 values beside bf16 parameters,
// and one master form at a time. A compute dtype written "auto" is checked when the planner
// has it (memory::MakePlan names the key too).
void CheckCompactState(Reader* r, const Config& c) {
  const bool masters_ok = !r->Failed("bf16.bf16_master_weights_and_grads") &&
                          !r->Failed("zerort.store_param_remainders");
  if (masters_ok && c.bf16_master_weights_and_grads && c.store_param_remainders) {
    r->Error(
        "bf16.bf16_master_weights_and_grads and zerort.store_param_remainders are both true: "
        "the master is either the bf16 parameter rounded stochastically or the bf16 parameter "
        "plus its remainder (lossless); set one");
  }
  const bool dtype_auto =
      std::find(c.auto_keys.begin(), c.auto_keys.end(), "bf16.enabled") != c.auto_keys.end() ||
      std::find(c.auto_keys.begin(), c.auto_keys.end(), "fp16.enabled") != c.auto_keys.end();
  if (dtype_auto || c.compute_dtype == DType::kBF16 || r->Failed("bf16") || r->Failed("fp16")) {
    return;
  }
  const std::pair<const char*, bool> keys[] = {
      {"bf16.bf16_optimizer_states", c.bf16_optimizer_states},
      {"bf16.bf16_master_weights_and_grads", c.bf16_master_weights_and_grads},
      {"zerort.store_param_remainders", c.store_param_remainders},
  };
  for (const auto& [key, on] : keys) {
    if (!on || r->Failed(key)) continue;
    r->Error(absl::StrCat(key, " is true but the parameters are ", DTypeName(c.compute_dtype),
                          ": compact optimizer state needs bf16 parameters (bf16.enabled)"));
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
  CheckCompactState(r, c);
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
  // The one default that changed under existing configs: said where it applies.
  if (!root.contains("gradient_clipping")) {
    r->Note("gradient_clipping: absent, so 1.0 (DeepSpeed's default since v0.19.3; zerort before "
            "used 0, no clipping): gradients are clipped to a global L2 norm of 1; write 0 to "
            "turn clipping off");
  }
  CheckAcrossKeys(r, *config);
}

// ---------------------------------------------------------------------------------------------
// Writing and comparing, driven by the table.

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
}  // namespace config_internal

using config_internal::BlockEqual;
using config_internal::ConfigKeys;
using config_internal::KeyDef;
using config_internal::Reader;
using config_internal::Role;

bool operator==(const OffloadOptimizerConfig& a, const OffloadOptimizerConfig& b) {
  return BlockEqual("zero_optimization.offload_optimizer",
                    ZERORT_CONFIG_MEMBER(zero.offload_optimizer), a, b);
}

bool operator==(const OffloadParamConfig& a, const OffloadParamConfig& b) {
  return BlockEqual("zero_optimization.offload_param", ZERORT_CONFIG_MEMBER(zero.offload_param), a,
                    b);
}

bool operator==(const MemoryBudget& a, const MemoryBudget& b) {
  return BlockEqual("zero_optimization.memory_budget", ZERORT_CONFIG_MEMBER(zero.memory_budget), a,
                    b);
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

// The param groups are a structured block, compared by hand.
bool operator==(const ParamGroupConfig& a, const ParamGroupConfig& b) {
  return a.pattern == b.pattern && a.weight_decay == b.weight_decay && a.lr_scale == b.lr_scale;
}

bool operator==(const Config& a, const Config& b) {
  return config_internal::SettingsEqual(a, b, "") &&
         config_internal::Sorted(a.auto_keys) == config_internal::Sorted(b.auto_keys);
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

absl::StatusOr<Config> ParseConfig(absl::string_view json_text, absl::string_view source,
                                   const ParseOptions& options) {
  ASSIGN_OR_RETURN(Json root, ParseJson(json_text, source));
  Config config;
  Reader reader(&config);
  try {
    config_internal::ReadConfig(&reader, root, &config);
  } catch (const std::exception& e) {
    // The readers check types before every access; a throw here is a bug, reported not raised.
    return absl::InternalError(absl::StrCat(source, ": reading config: ", e.what()));
  }
  RETURN_IF_ERROR(reader.Finish(source, options.strict || config.strict));
  return config;
}

namespace {

// How long a config stream may stay silent: a FIFO nobody writes (or an idle pipe) is refused
// instead of waited on forever. Generous for a generator's start-up, short of a job's patience.
constexpr int kStreamIdleMs = 10000;

// Reads `fd` to its end, refusing more than `max_bytes` (a pipe has no size to check first,
// so the cap is applied while reading) and `kStreamIdleMs` without data.
absl::StatusOr<std::string> ReadStream(int fd, const std::string& name, int64_t max_bytes) {
  std::string text;
  char buffer[1 << 16];
  for (;;) {
    struct pollfd p = {fd, POLLIN, 0};
    const int ready = ::poll(&p, 1, kStreamIdleMs);
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0) {
      return absl::DeadlineExceededError(absl::StrCat(
          "cannot read config from ", name, ": no data for ", kStreamIdleMs / 1000,
          " s (a FIFO nobody writes, or a generator that stalled)"));
    }
    const ssize_t n = ready < 0 ? -1 : ::read(fd, buffer, sizeof buffer);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n < 0) {
      return absl::InternalError(
          absl::StrCat("cannot read config from ", name, ": ", std::strerror(errno)));
    }
    if (n == 0) return text;
    if (static_cast<int64_t>(text.size()) + n > max_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("cannot read config from ", name,
                                                     ": larger than the limit of ", max_bytes,
                                                     " bytes for a config file"));
    }
    text.append(buffer, static_cast<size_t>(n));
  }
}

// "-" is standard input; a FIFO (a shell's pipe, /dev/stdin, <(...)) is read as a stream; any
// other path must be a regular file (ReadBoundedFile refuses devices and sockets).
absl::StatusOr<std::string> ReadConfigText(const std::string& path) {
  if (path == "-") return ReadStream(STDIN_FILENO, "standard input", kMaxJsonFileBytes);
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISFIFO(st.st_mode)) {
    return ReadBoundedFile(path, "config");
  }
  // O_NONBLOCK: the open does not wait for a writer; ReadStream's poll waits, within its limit.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return ReadBoundedFile(path, "config");  // its error names the file and errno
  absl::StatusOr<std::string> text;
  // Checked again on the open descriptor: the path may have been replaced since the stat.
  if (::fstat(fd, &st) == 0 && S_ISFIFO(st.st_mode)) {
    text = ReadStream(fd, absl::StrCat("\"", path, "\""), kMaxJsonFileBytes);
  } else {
    text = ReadBoundedFile(path, "config");
  }
  ::close(fd);
  return text;
}

}  // namespace

absl::StatusOr<Config> LoadConfigFile(const std::string& path, const ParseOptions& options) {
  ASSIGN_OR_RETURN(std::string text, ReadConfigText(path));
  return ParseConfig(text, path == "-" ? "<stdin>" : path, options);
}

std::string ResolvedConfigJson(const Config& c) {
  Json root = Json::object();
  for (const KeyDef& k : ConfigKeys()) {
    if (k.role == Role::kSetting)
      *config_internal::At(&root, k.path) = config_internal::ValueJson(k, c);
  }
  for (const std::string& path : c.auto_keys) {
    // A hand-built Config may list a path through a value; such a path names no setting.
    if (Json* at = config_internal::At(&root, path)) *at = "auto";
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
