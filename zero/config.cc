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
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/json.h"
#include "base/status.h"

namespace zerort {
namespace {

// Parsing (strict JSON, errors with line and column) is base/json's; base/json's Json keeps the
// document's key order, so the first offending key in the file is the one reported, and the
// resolved dump reads in the documented order.
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kIntMax = std::numeric_limits<int>::max();

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

// Checks every key of `obj` (at `path`) against what is valid there, in document order.
absl::Status CheckKeys(const Json& obj, const std::string& path,
                       std::initializer_list<const char*> settings,
                       std::initializer_list<ForeignKey> foreign, std::vector<std::string>* notes) {
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
      if (match->only_value == nullptr) {
        notes->push_back(
            absl::StrCat(key_path, ": DeepSpeed key accepted, no effect (", match->why, ")"));
        continue;
      }
      Json only = Json::parse(match->only_value);
      if (item.value() == only) {
        notes->push_back(absl::StrCat(key_path, ": DeepSpeed default ", match->only_value,
                                      " accepted, no effect"));
        continue;
      }
      return absl::UnimplementedError(absl::StrCat(key_path, ": not supported by zerort (",
                                                   match->why, "); only ", match->only_value,
                                                   ", DeepSpeed's default, is accepted"));
    }
    // Unknown: suggest the nearest valid key, if any is plausibly what was meant.
    std::vector<absl::string_view> valid;
    for (const char* s : settings) valid.push_back(s);
    for (const ForeignKey& f : foreign) valid.push_back(f.name);
    if (absl::string_view best = NearestKey(key, valid); !best.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(key_path, ": unknown key; did you mean \"", best, "\"?"));
    }
    if (absl::string_view elsewhere = SettingElsewhere(key, path); !elsewhere.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(key_path, ": unknown key ",
                                                     path.empty() ? "at the top level" : "here",
                                                     "; did you mean \"", elsewhere, "\"?"));
    }
    // The foreign keys are left out of the list: they are no help to someone looking for a setting.
    return absl::InvalidArgumentError(absl::StrCat(key_path, ": unknown key; the settings",
                                                   path.empty() ? " at the top level" : " here",
                                                   " are: ", absl::StrJoin(settings, ", ")));
  }
  return absl::OkStatus();
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

absl::Status ReadOffloadDevice(const Json& obj, const std::string& path, OffloadDevice* out) {
  auto it = obj.find("device");
  if (it == obj.end()) return absl::OkStatus();
  std::string device_path = JsonPath(path, "device");
  constexpr absl::string_view kWhat = "\"none\" or \"cpu\"";
  if (!it->is_string()) return JsonExpected(device_path, kWhat, *it);
  const std::string& s = it->get_ref<const std::string&>();
  if (s == "none") {
    *out = OffloadDevice::kNone;
  } else if (s == "cpu") {
    *out = OffloadDevice::kCpu;
  } else if (s == "nvme") {
    return absl::UnimplementedError(absl::StrCat(
        device_path, ": \"nvme\" offload is not implemented; use \"cpu\" or \"none\""));
  } else {
    return JsonExpected(device_path, kWhat, *it);
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------------
// The config, level by level.

constexpr char kNvmeOnly[] = "used only by nvme offload, which zerort does not have";
constexpr char kMonitoring[] = "monitoring belongs to the trainer";
constexpr char kCheckpointing[] = "checkpointing belongs to the trainer";

absl::Status ReadOffloadOptimizer(const Json& obj, const std::string& path,
                                  OffloadOptimizerConfig* out, std::vector<std::string>* notes) {
  RETURN_IF_ERROR(CheckKeys(obj, path, {"device", "pin_memory", "buffer_count"},
                            {{"nvme_path", nullptr, kNvmeOnly},
                             {"pipeline_read", nullptr, kNvmeOnly},
                             {"pipeline_write", nullptr, kNvmeOnly},
                             {"fast_init", nullptr, kNvmeOnly},
                             {"ratio", "1.0", "partial optimizer offload"}},
                            notes));
  RETURN_IF_ERROR(ReadOffloadDevice(obj, path, &out->device));
  RETURN_IF_ERROR(ReadBool(obj, path, "pin_memory", &out->pin_memory));
  RETURN_IF_ERROR(ReadInt(obj, path, "buffer_count", 1, kIntMax, &out->buffer_count));
  return absl::OkStatus();
}

absl::Status ReadOffloadParam(const Json& obj, const std::string& path, OffloadParamConfig* out,
                              std::vector<std::string>* notes) {
  RETURN_IF_ERROR(CheckKeys(obj, path, {"device", "pin_memory"},
                            {{"nvme_path", nullptr, kNvmeOnly},
                             {"buffer_count", nullptr, kNvmeOnly},
                             {"buffer_size", nullptr, kNvmeOnly},
                             {"max_in_cpu", nullptr, kNvmeOnly}},
                            notes));
  RETURN_IF_ERROR(ReadOffloadDevice(obj, path, &out->device));
  RETURN_IF_ERROR(ReadBool(obj, path, "pin_memory", &out->pin_memory));
  return absl::OkStatus();
}

absl::Status ReadMemoryBudget(const Json& obj, const std::string& path, MemoryBudget* out,
                              std::vector<std::string>* notes) {
  RETURN_IF_ERROR(CheckKeys(obj, path, {"device_bytes", "host_bytes"}, {}, notes));
  RETURN_IF_ERROR(ReadInt64(obj, path, "device_bytes", 0, kInt64Max, &out->device_bytes));
  RETURN_IF_ERROR(ReadInt64(obj, path, "host_bytes", 0, kInt64Max, &out->host_bytes));
  return absl::OkStatus();
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
void NoteFixedBehaviour(const Json& obj, const std::string& path, const ZeroConfig& z,
                        std::vector<std::string>* notes) {
  // `what` names the behaviour a `false` asks to turn off.
  auto note = [&](const char* key, bool turned_off, const char* what, const char* why) {
    if (!obj.contains(key)) return;
    notes->push_back(turned_off ? absl::StrCat(JsonPath(path, key), ": false has no effect, ",
                                               what, " cannot be turned off: ", why)
                                : absl::StrCat(JsonPath(path, key), ": accepted, no effect: ", why));
  };
  note("overlap_comm", !z.overlap_comm, "overlap", kOverlapWhy);
  note("contiguous_gradients", !z.contiguous_gradients, "contiguous gradients", kContiguousWhy);
  note("allgather_bucket_size", false, "", kAllgatherWhy);
}

absl::Status ReadZero(const Json& obj, const std::string& path, ZeroConfig* out,
                      std::vector<std::string>* notes) {
  RETURN_IF_ERROR(CheckKeys(
      obj, path,
      {"stage", "reduce_bucket_size", "allgather_bucket_size", "overlap_comm",
       "contiguous_gradients", "offload_optimizer", "offload_param", "stage3_prefetch_bucket_size",
       "stage3_param_persistence_threshold", "stage3_max_live_parameters", "memory_budget"},
      {{"allgather_partitions", nullptr, "parameters are always all-gathered per unit"},
       {"reduce_scatter", nullptr, "the reduction collective follows from the stage"},
       {"round_robin_gradients", nullptr, "host gradient copies follow unit order"},
       {"sub_group_size", nullptr, "the host optimizer already steps one unit shard at a time"},
       {"stage3_max_reuse_distance", nullptr,
        "stage-3 release is driven by the trainer's Release calls"},
       {"stage3_gather_16bit_weights_on_model_save", nullptr, kCheckpointing},
       {"stage3_gather_fp16_weights_on_model_save", nullptr, kCheckpointing},
       {"elastic_checkpoint", nullptr, kCheckpointing},
       {"load_from_fp32_weights", nullptr, kCheckpointing},
       {"cpu_offload", "false", "deprecated; use offload_optimizer.device \"cpu\""},
       {"zero_quantized_weights", "false", "quantized communication"},
       {"zero_quantized_gradients", "false", "quantized communication"},
       {"zero_hpz_partition_size", "1", "hierarchical partitioning"},
       {"mics_shard_size", "-1", "MiCS sharding"}},
      notes));

  if (auto it = obj.find("stage"); it != obj.end()) {
    std::string stage_path = JsonPath(path, "stage");
    constexpr absl::string_view kWhat = "an integer in 0..3 or \"auto\"";
    if (it->is_string()) {
      if (it->get_ref<const std::string&>() != "auto") return JsonExpected(stage_path, kWhat, *it);
      out->stage_auto = true;
    } else {
      int64_t stage = 0;
      RETURN_IF_ERROR(ToInt64(*it, stage_path, 0, 3, kWhat, &stage));
      out->stage_auto = false;
      out->stage = static_cast<int>(stage);
    }
  }
  RETURN_IF_ERROR(ReadSizeOrAuto(obj, path, "reduce_bucket_size", 1, &out->reduce_bucket_size));
  RETURN_IF_ERROR(
      ReadInt64(obj, path, "allgather_bucket_size", 1, kInt64Max, &out->allgather_bucket_size));
  RETURN_IF_ERROR(ReadBool(obj, path, "overlap_comm", &out->overlap_comm));
  RETURN_IF_ERROR(ReadBool(obj, path, "contiguous_gradients", &out->contiguous_gradients));
  NoteFixedBehaviour(obj, path, *out, notes);
  ASSIGN_OR_RETURN(const Json* offload_optimizer, ReadObject(obj, path, "offload_optimizer"));
  if (offload_optimizer != nullptr) {
    RETURN_IF_ERROR(ReadOffloadOptimizer(*offload_optimizer, JsonPath(path, "offload_optimizer"),
                                         &out->offload_optimizer, notes));
  }
  ASSIGN_OR_RETURN(const Json* offload_param, ReadObject(obj, path, "offload_param"));
  if (offload_param != nullptr) {
    RETURN_IF_ERROR(ReadOffloadParam(*offload_param, JsonPath(path, "offload_param"),
                                     &out->offload_param, notes));
  }
  RETURN_IF_ERROR(ReadSizeOrAuto(obj, path, "stage3_prefetch_bucket_size", 0,
                                 &out->stage3_prefetch_bucket_size));
  RETURN_IF_ERROR(ReadSizeOrAuto(obj, path, "stage3_param_persistence_threshold", 0,
                                 &out->stage3_param_persistence_threshold));
  RETURN_IF_ERROR(ReadInt64(obj, path, "stage3_max_live_parameters", 1, kInt64Max,
                            &out->stage3_max_live_parameters));
  ASSIGN_OR_RETURN(const Json* budget, ReadObject(obj, path, "memory_budget"));
  if (budget != nullptr) {
    RETURN_IF_ERROR(
        ReadMemoryBudget(*budget, JsonPath(path, "memory_budget"), &out->memory_budget, notes));
  }
  return absl::OkStatus();
}

absl::Status ReadFp16(const Json& obj, const std::string& path, bool* enabled, Fp16Config* out,
                      std::vector<std::string>* notes) {
  RETURN_IF_ERROR(
      CheckKeys(obj, path,
                {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                 "min_loss_scale"},
                {{"consecutive_hysteresis", "false", "hysteresis refill"},
                 {"auto_cast", "false", "input casting belongs to the trainer"},
                 {"fp16_master_weights_and_grads", "false", "master weights are always fp32"}},
                notes));
  RETURN_IF_ERROR(ReadBool(obj, path, "enabled", enabled));
  RETURN_IF_ERROR(
      ReadDouble(obj, path, "loss_scale", {0, false, INFINITY, false}, &out->loss_scale));
  // 2^127 is the largest power of two a float holds.
  RETURN_IF_ERROR(ReadInt(obj, path, "initial_scale_power", 0, 127, &out->initial_scale_power));
  RETURN_IF_ERROR(ReadInt(obj, path, "loss_scale_window", 1, kIntMax, &out->loss_scale_window));
  RETURN_IF_ERROR(ReadInt(obj, path, "hysteresis", 1, kIntMax, &out->hysteresis));
  RETURN_IF_ERROR(
      ReadDouble(obj, path, "min_loss_scale", {0, true, INFINITY, false}, &out->min_loss_scale));
  return absl::OkStatus();
}

absl::Status ReadOptimizer(const Json& obj, const std::string& path, OptimizerConfig* out,
                           std::vector<std::string>* notes) {
  RETURN_IF_ERROR(CheckKeys(obj, path, {"type", "params"}, {}, notes));
  if (auto it = obj.find("type"); it != obj.end()) {
    std::string type_path = JsonPath(path, "type");
    constexpr absl::string_view kWhat = "\"AdamW\" or \"Adam\"";
    if (!it->is_string()) return JsonExpected(type_path, kWhat, *it);
    // DeepSpeed matches optimizer names case-insensitively.
    std::string type = absl::AsciiStrToLower(it->get_ref<const std::string&>());
    if (type == "adam") {
      notes->push_back(
          absl::StrCat(type_path,
                       ": \"Adam\" runs as AdamW (decoupled weight decay), as DeepSpeed's Adam "
                       "does with its default adam_w_mode=true"));
    } else if (type != "adamw") {
      return JsonExpected(type_path, kWhat, *it);
    }
    out->type = "AdamW";
  }
  ASSIGN_OR_RETURN(const Json* params, ReadObject(obj, path, "params"));
  if (params == nullptr) return absl::OkStatus();
  std::string params_path = JsonPath(path, "params");
  RETURN_IF_ERROR(
      CheckKeys(*params, params_path, {"lr", "betas", "eps", "weight_decay"},
                {{"adam_w_mode", "true", "Adam with coupled L2 weight decay"},
                 {"bias_correction", "true", "Adam without bias correction"},
                 {"amsgrad", "false", "AMSGrad"},
                 {"torch_adam", nullptr, "zerort has one AdamW implementation per device"}},
                notes));
  RETURN_IF_ERROR(ReadDouble(*params, params_path, "lr", {0, false, INFINITY, false}, &out->lr));
  if (auto it = params->find("betas"); it != params->end()) {
    std::string betas_path = JsonPath(params_path, "betas");
    if (!it->is_array() || it->size() != 2) {
      return JsonExpected(betas_path, "an array of two numbers [beta1, beta2]", *it);
    }
    const DoubleRange kBeta{0, false, 1, true};
    RETURN_IF_ERROR(ToDouble((*it)[0], betas_path + "[0]", kBeta, &out->beta1));
    RETURN_IF_ERROR(ToDouble((*it)[1], betas_path + "[1]", kBeta, &out->beta2));
  }
  RETURN_IF_ERROR(ReadDouble(*params, params_path, "eps", {0, true, INFINITY, false}, &out->eps));
  RETURN_IF_ERROR(ReadDouble(*params, params_path, "weight_decay", {0, false, INFINITY, false},
                             &out->weight_decay));
  return absl::OkStatus();
}

absl::Status ReadConfig(const Json& root, Config* config) {
  std::vector<std::string>* notes = &config->notes;
  if (!root.is_object()) return JsonExpected("<root>", "a JSON object", root);
  const std::string top;
  RETURN_IF_ERROR(CheckKeys(
      root, top,
      {"zero_optimization", "bf16", "fp16", "optimizer", "gradient_clipping",
       "gradient_accumulation_steps", "comm_timeout_ms", "cpu_threads"},
      {{"train_batch_size", nullptr, "the trainer owns batch sizes"},
       {"train_micro_batch_size_per_gpu", nullptr, "the trainer owns batch sizes"},
       {"steps_per_print", nullptr, kMonitoring},
       {"wall_clock_breakdown", nullptr, kMonitoring},
       {"zero_allow_untested_optimizer", nullptr, "the optimizer is always zerort's AdamW"},
       {"tensorboard", nullptr, kMonitoring},
       {"wandb", nullptr, kMonitoring},
       {"csv_monitor", nullptr, kMonitoring},
       {"comms_logger", nullptr, kMonitoring},
       {"flops_profiler", nullptr, kMonitoring},
       {"activation_checkpointing", nullptr, "activation checkpointing belongs to the trainer"},
       {"prescale_gradients", "false", "gradient prescaling"},
       {"gradient_predivide_factor", "1.0", "gradient predivision"},
       {"sparse_gradients", "false", "sparse gradients"},
       {"communication_data_type", "null", "gradients are reduced in the compute dtype"},
       {"amp", "{\"enabled\": false}", "Apex AMP"},
       {"scheduler", "null", "the trainer sets the learning rate"}},
      notes));

  ASSIGN_OR_RETURN(const Json* zero, ReadObject(root, top, "zero_optimization"));
  if (zero != nullptr) RETURN_IF_ERROR(ReadZero(*zero, "zero_optimization", &config->zero, notes));

  bool bf16 = false, fp16 = false;
  ASSIGN_OR_RETURN(const Json* bf16_block, ReadObject(root, top, "bf16"));
  if (bf16_block != nullptr) {
    RETURN_IF_ERROR(CheckKeys(*bf16_block, "bf16", {"enabled"}, {}, notes));
    RETURN_IF_ERROR(ReadBool(*bf16_block, "bf16", "enabled", &bf16));
  }
  ASSIGN_OR_RETURN(const Json* fp16_block, ReadObject(root, top, "fp16"));
  if (fp16_block != nullptr) {
    RETURN_IF_ERROR(ReadFp16(*fp16_block, "fp16", &fp16, &config->fp16, notes));
  }
  if (bf16 && fp16) {
    return absl::InvalidArgumentError(
        "bf16.enabled and fp16.enabled are both true; enable at most one");
  }
  config->compute_dtype = bf16 ? DType::kBF16 : fp16 ? DType::kF16 : DType::kF32;

  ASSIGN_OR_RETURN(const Json* optimizer, ReadObject(root, top, "optimizer"));
  if (optimizer != nullptr) {
    RETURN_IF_ERROR(ReadOptimizer(*optimizer, "optimizer", &config->optimizer, notes));
  }
  RETURN_IF_ERROR(ReadDouble(root, top, "gradient_clipping", {0, false, INFINITY, false},
                             &config->gradient_clipping));
  RETURN_IF_ERROR(ReadInt(root, top, "gradient_accumulation_steps", 1, kIntMax,
                          &config->gradient_accumulation_steps));
  RETURN_IF_ERROR(ReadInt64(root, top, "comm_timeout_ms", 1, kInt64Max, &config->comm_timeout_ms));
  RETURN_IF_ERROR(ReadInt(root, top, "cpu_threads", 0, kIntMax, &config->cpu_threads));

  // Rules across keys.
  const ZeroConfig& z = config->zero;
  if (z.offload_param.device != OffloadDevice::kNone && (z.stage_auto || z.stage != 3)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "zero_optimization.offload_param.device is \"", OffloadDeviceName(z.offload_param.device),
        "\" but zero_optimization.stage is ",
        z.stage_auto ? std::string("\"auto\"") : absl::StrCat(z.stage),
        "; parameter offload requires stage 3 (set it explicitly)"));
  }
  if (z.stage_auto && z.memory_budget.device_bytes == 0) {
    return absl::InvalidArgumentError(
        "zero_optimization.stage is \"auto\" but zero_optimization.memory_budget.device_bytes is "
        "not set; \"auto\" picks the lowest stage that fits that budget");
  }
  const Fp16Config& f = config->fp16;
  if (f.loss_scale == 0 && std::ldexp(1.0, f.initial_scale_power) < f.min_loss_scale) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fp16.initial_scale_power ", f.initial_scale_power, " starts dynamic loss scaling at 2^",
        f.initial_scale_power, ", below fp16.min_loss_scale ", f.min_loss_scale));
  }
  return absl::OkStatus();
}

}  // namespace

bool operator==(const OffloadOptimizerConfig& a, const OffloadOptimizerConfig& b) {
  return a.device == b.device && a.pin_memory == b.pin_memory && a.buffer_count == b.buffer_count;
}

bool operator==(const OffloadParamConfig& a, const OffloadParamConfig& b) {
  return a.device == b.device && a.pin_memory == b.pin_memory;
}

bool operator==(const MemoryBudget& a, const MemoryBudget& b) {
  return a.device_bytes == b.device_bytes && a.host_bytes == b.host_bytes;
}

bool operator==(const ZeroConfig& a, const ZeroConfig& b) {
  return a.stage_auto == b.stage_auto && (a.stage_auto || a.stage == b.stage) &&
         a.reduce_bucket_size == b.reduce_bucket_size && a.offload_optimizer == b.offload_optimizer && a.offload_param == b.offload_param &&
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

bool operator==(const Config& a, const Config& b) {
  return a.zero == b.zero && a.compute_dtype == b.compute_dtype && a.fp16 == b.fp16 &&
         a.optimizer == b.optimizer && a.gradient_clipping == b.gradient_clipping &&
         a.gradient_accumulation_steps == b.gradient_accumulation_steps &&
         a.comm_timeout_ms == b.comm_timeout_ms && a.cpu_threads == b.cpu_threads;
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

absl::StatusOr<Config> ParseConfig(absl::string_view json_text, absl::string_view source) {
  ASSIGN_OR_RETURN(Json root, ParseJson(json_text, source));
  Config config;
  try {
    RETURN_IF_ERROR(Annotate(ReadConfig(root, &config), source));
  } catch (const std::exception& e) {
    // The readers check types before every access; a throw here is a bug, reported not raised.
    return absl::InternalError(absl::StrCat(source, ": reading config: ", e.what()));
  }
  return config;
}

absl::StatusOr<Config> LoadConfigFile(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadBoundedFile(path, "config"));
  return ParseConfig(text, path);
}

std::string ResolvedConfigJson(const Config& c) {
  const ZeroConfig& z = c.zero;
  auto size = [](int64_t v) { return v == kAutoSize ? Json("auto") : Json(v); };
  Json zero;
  zero["stage"] = z.stage_auto ? Json("auto") : Json(z.stage);
  zero["reduce_bucket_size"] = size(z.reduce_bucket_size);
  zero["offload_optimizer"] = {
      {"device", std::string(OffloadDeviceName(z.offload_optimizer.device))},
      {"pin_memory", z.offload_optimizer.pin_memory},
      {"buffer_count", z.offload_optimizer.buffer_count}};
  zero["offload_param"] = {{"device", std::string(OffloadDeviceName(z.offload_param.device))},
                           {"pin_memory", z.offload_param.pin_memory}};
  zero["stage3_prefetch_bucket_size"] = size(z.stage3_prefetch_bucket_size);
  zero["stage3_param_persistence_threshold"] = size(z.stage3_param_persistence_threshold);
  zero["stage3_max_live_parameters"] = z.stage3_max_live_parameters;
  zero["memory_budget"] = {{"device_bytes", z.memory_budget.device_bytes},
                           {"host_bytes", z.memory_budget.host_bytes}};

  Json root;
  root["zero_optimization"] = std::move(zero);
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
  root["gradient_clipping"] = c.gradient_clipping;
  root["gradient_accumulation_steps"] = c.gradient_accumulation_steps;
  root["comm_timeout_ms"] = c.comm_timeout_ms;
  root["cpu_threads"] = c.cpu_threads;
  // `replace` keeps a hand-built Config with invalid UTF-8 in optimizer.type from throwing.
  return root.dump(2, ' ', false, Json::error_handler_t::replace);
}

absl::Status ValidateConfig(const Config& config) {
  // The dump writes every setting as written in a file, so parsing it applies exactly the rules
  // and messages of ParseConfig (a non-finite double dumps as null and fails as "got null").
  return ParseConfig(ResolvedConfigJson(config), "<Config>").status();
}

}  // namespace zerort
