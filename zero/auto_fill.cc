#include "zero/auto_fill.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/json.h"
#include "base/status.h"

namespace zerort {
namespace {

// h: the smaller of the largest parameter's two largest dimensions, which is the hidden size
// of the usual transformer weights ((vocab, h) embeddings, (h, 4h) MLP, (h, h) projections).
int64_t HiddenSize(absl::Span<const memory::ParamSpec> specs) {
  const memory::ParamSpec* largest = nullptr;
  int64_t largest_numel = 0;
  for (const memory::ParamSpec& p : specs) {
    const int64_t n = p.numel();
    if (n > largest_numel) largest = &p, largest_numel = n;
  }
  if (largest == nullptr) return 1;
  std::vector<int64_t> dims = largest->shape;
  std::sort(dims.rbegin(), dims.rend());
  if (dims.size() >= 2) return dims[1];
  return std::max<int64_t>(1, static_cast<int64_t>(std::sqrt(static_cast<double>(dims[0]))));
}

// The elements of the largest module (every parameter with its module name: the plan keeps
// them together wherever they were registered).
int64_t LargestModule(absl::Span<const memory::ParamSpec> specs) {
  absl::flat_hash_map<absl::string_view, int64_t> modules;
  int64_t largest = 0;
  for (const memory::ParamSpec& p : specs) {
    int64_t& m = modules[p.module];
    // Saturating: MakePlan refuses a model this large, naming it.
    if (__builtin_add_overflow(m, p.numel(), &m)) m = std::numeric_limits<int64_t>::max();
    largest = std::max(largest, m);
  }
  return largest;
}

std::string PerModuleWhy(const UnitSizes& sizes) {
  return absl::StrCat("the largest ", sizes.largest_module, " elements");
}

}  // namespace

UnitSizes ResolveUnitSizes(absl::Span<const memory::ParamSpec> specs, const Config& config,
                           int64_t hidden) {
  const ZeroConfig& z = config.zero;
  UnitSizes out;
  out.hidden = hidden > 0 ? hidden : HiddenSize(specs);
  const int64_t h = out.hidden;
  // h * h overflows int64 only for h > 3e9, far beyond any dimension a model has.
  std::vector<std::string> derived;
  auto resolve = [&](int64_t written, int64_t from_h, const char* key, const char* rule) {
    if (written != kAutoSize) return written;
    derived.push_back(absl::StrCat(key, " = ", rule, " = ", from_h));
    return from_h;
  };
  // A unit is also the stage-3 gather unit and trainers gather a module at a time: a unit
  // smaller than a module would split it, and its Fetch would need several gather slots at once
  // (the example GPT's 8h*h MLP module across 4 h*h units); a unit of several modules makes
  // every bucket and slot of its class that much larger (GPT-2 124M: five blocks, 35M elements,
  // where one is 7.1M). So "auto" is the trainer's own grouping: one unit per module.
  out.largest_module = LargestModule(specs);
  out.per_module = z.reduce_bucket_size == kAutoSize;
  out.reduce_bucket_size =
      out.per_module ? std::max<int64_t>(1, out.largest_module) : z.reduce_bucket_size;
  out.prefetch_bucket_size = resolve(z.stage3_prefetch_bucket_size,
                                     static_cast<int64_t>(0.9 * static_cast<double>(h * h)),
                                     "stage3_prefetch_bucket_size", "0.9*h*h");
  out.persistence_threshold = resolve(z.stage3_param_persistence_threshold, 10 * h,
                                      "stage3_param_persistence_threshold", "10*h");
  std::vector<std::string> parts;
  if (out.per_module) {
    parts.push_back(absl::StrCat("reduce_bucket_size = one unit per module (", PerModuleWhy(out),
                                 ")"));
  }
  if (!derived.empty()) {
    parts.push_back(absl::StrCat("from the hidden size h = ", h,
                                 hidden > 0 ? " (given by the trainer): "
                                            : " (the largest parameter's smaller dimension): ",
                                 absl::StrJoin(derived, ", "), " elements"));
  }
  if (!parts.empty()) {
    out.reason = absl::StrCat("\"auto\" unit sizes: ", absl::StrJoin(parts, "; "));
  }
  return out;
}

namespace {

// One ResolveAuto pass: takes keys off config->auto_keys, notes each resolution, collects the
// problems so that all of them are reported at once.
class AutoResolver {
 public:
  AutoResolver(const AutoFill& fill, Config* config, AutoPurpose purpose)
      : fill_(fill), c_(config), purpose_(purpose) {}

  const AutoFill& fill() const { return fill_; }
  Config* config() { return c_; }

  // Whether `path` was "auto"; it no longer is afterwards.
  bool Take(absl::string_view path) {
    auto it = std::find(c_->auto_keys.begin(), c_->auto_keys.end(), path);
    if (it == c_->auto_keys.end()) return false;
    c_->auto_keys.erase(it);
    return true;
  }
  template <typename V>
  void Note(absl::string_view path, const V& value, absl::string_view why) {
    c_->notes.push_back(absl::StrCat(path, ": auto -> ", value, " (", why, ")"));
  }
  // An "auto" at `path`: the fill's value, else the one `field` already holds, said by `why`.
  template <typename T>
  void Fill(absl::string_view path, T* field, const std::optional<T>& from_fill,
            absl::string_view why) {
    if (!Take(path)) return;
    if (from_fill) *field = *from_fill;
    Note(path, *field, from_fill ? "from the trainer" : why);
  }
  void Error(std::string message) { errors_.push_back(std::move(message)); }
  // An error about `path`, which a plan alone may pass over when the plan cannot depend on it.
  void ErrorAbout(absl::string_view path, std::string message) {
    if (purpose_ == AutoPurpose::kPlan && !ChangesPlan(path)) {
      c_->notes.push_back(
          absl::StrCat(message, " (not needed for a plan; Engine creation refuses it)"));
    } else {
      Error(std::move(message));
    }
  }

  absl::Status Finish() {
    for (const std::string& path : c_->auto_keys) {
      if (path == "scheduler.params.total_num_steps") continue;  // said by its own rule
      ErrorAbout(path, absl::StrCat(path, ": \"auto\", and neither the trainer's fill nor a "
                                          "documented rule gives it a value here; write a value"));
    }
    if (errors_.empty()) return absl::OkStatus();
    if (errors_.size() == 1) return absl::InvalidArgumentError(errors_[0]);
    return absl::InvalidArgumentError(
        absl::StrCat(errors_.size(), " problems:\n", absl::StrJoin(errors_, "\n")));
  }

 private:
  // The learning rate, the optimizer's scalars and clipping are read by the step, never by the
  // plan (memory::PlanOptions has none of them).
  static bool ChangesPlan(absl::string_view path) {
    return !(absl::StartsWith(path, "scheduler.") || absl::StartsWith(path, "optimizer.") ||
             path == "gradient_clipping");
  }

  const AutoFill& fill_;
  Config* c_;
  const AutoPurpose purpose_;
  std::vector<std::string> errors_;
};

void ResolveUnitSizeAutos(AutoResolver* r, absl::Span<const memory::ParamSpec> specs) {
  ZeroConfig& z = r->config()->zero;
  const bool any = z.reduce_bucket_size == kAutoSize || z.stage3_prefetch_bucket_size == kAutoSize ||
                   z.stage3_param_persistence_threshold == kAutoSize;
  // Without the trainer's h they stay kAutoSize: the planner derives them from the parameters
  // when it plans, and its PlanChoice::reason says so.
  if (!any || !r->fill().hidden_size) return;
  // h*h must fit an int64 (h up to 3e9, far beyond any model's hidden size).
  if (*r->fill().hidden_size < 1 || *r->fill().hidden_size > 3000000000) {
    return r->Error(absl::StrCat("hidden_size ", *r->fill().hidden_size,
                                 " from the trainer: expected 1..3000000000"));
  }
  const UnitSizes sizes = ResolveUnitSizes(specs, *r->config(), *r->fill().hidden_size);
  const std::string h = absl::StrCat("h = ", sizes.hidden, " from the trainer");
  auto set = [&](const char* key, int64_t* field, int64_t value, const char* rule) {
    if (*field != kAutoSize) return;
    *field = value;
    r->Take(absl::StrCat("zero_optimization.", key));
    r->Note(absl::StrCat("zero_optimization.", key), value, absl::StrCat(rule, ", ", h));
  };
  // Not a number: "auto" stays, and the planner makes one unit per module (ResolveUnitSizes).
  if (sizes.per_module) {
    r->Note("zero_optimization.reduce_bucket_size", "one unit per module", PerModuleWhy(sizes));
  }
  set("stage3_prefetch_bucket_size", &z.stage3_prefetch_bucket_size, sizes.prefetch_bucket_size,
      "0.9*h*h");
  set("stage3_param_persistence_threshold", &z.stage3_param_persistence_threshold,
      sizes.persistence_threshold, "10*h");
}

void ResolvePrecisionAutos(AutoResolver* r) {
  Config* c = r->config();
  const std::optional<DType>& d = r->fill().compute_dtype;
  auto resolve = [&](const char* path, DType block) {
    if (!r->Take(path)) return;
    const bool on = d && *d == block;
    if (on && c->compute_dtype != DType::kF32 && c->compute_dtype != block) {
      r->Error(absl::StrCat(path, " is \"auto\" and the trainer computes in ", DTypeName(block),
                            ", but the config already enables ", DTypeName(c->compute_dtype)));
      return;
    }
    if (on) c->compute_dtype = block;
    r->Note(path, on ? "true" : "false",
            d ? absl::StrCat("the trainer computes in ", DTypeName(*d))
              : std::string("the trainer gave no compute dtype"));
  };
  resolve("bf16.enabled", DType::kBF16);
  resolve("fp16.enabled", DType::kF16);
}

void ResolveOptimizerAutos(AutoResolver* r) {
  OptimizerConfig& o = r->config()->optimizer;
  const AutoFill& f = r->fill();
  constexpr char kDefault[] = "zerort's default, docs/config.md";
  r->Fill("optimizer.params.lr", &o.lr, f.lr, kDefault);
  if (r->Take("optimizer.params.betas")) {
    if (f.beta1) o.beta1 = *f.beta1;
    if (f.beta2) o.beta2 = *f.beta2;
    r->Note("optimizer.params.betas", absl::StrCat("[", o.beta1, ", ", o.beta2, "]"),
            f.beta1 || f.beta2 ? "from the trainer" : kDefault);
  }
  r->Fill("optimizer.params.eps", &o.eps, f.eps, kDefault);
  r->Fill("optimizer.params.weight_decay", &o.weight_decay, f.weight_decay, kDefault);
  r->Fill("gradient_clipping", &r->config()->gradient_clipping, f.gradient_clipping, kDefault);
}

void ResolveZeroAutos(AutoResolver* r) {
  ZeroConfig& z = r->config()->zero;
  if (r->Take("zero_optimization.stage3_max_live_parameters")) {
    z.stage3_max_live_parameters = ZeroConfig{}.stage3_max_live_parameters;
    r->Note("zero_optimization.stage3_max_live_parameters", z.stage3_max_live_parameters,
            "DeepSpeed's default");
  }
}

void ResolveSchedulerAutos(AutoResolver* r) {
  SchedulerConfig& s = r->config()->scheduler;
  const AutoFill& f = r->fill();
  r->Fill("scheduler.params.warmup_min_lr", &s.warmup_min_lr, f.warmup_min_lr,
          "DeepSpeed's default");
  // Only an "auto" takes the optimizer's rate: a written warmup_max_lr is the schedule's peak.
  if (r->Take("scheduler.params.warmup_max_lr")) {
    s.warmup_max_lr = f.warmup_max_lr.value_or(r->config()->optimizer.lr);
    r->Note("scheduler.params.warmup_max_lr", s.warmup_max_lr,
            f.warmup_max_lr ? "from the trainer" : "optimizer.params.lr");
  }
  r->Fill("scheduler.params.warmup_num_steps", &s.warmup_num_steps, f.warmup_num_steps,
          "DeepSpeed's default");
  constexpr char kTotal[] = "scheduler.params.total_num_steps";
  const bool is_auto = std::find(r->config()->auto_keys.begin(), r->config()->auto_keys.end(),
                                 kTotal) != r->config()->auto_keys.end();
  if (is_auto && f.total_num_steps) {
    r->Take(kTotal);
    s.total_num_steps = *f.total_num_steps;
    r->Note(kTotal, s.total_num_steps, "from the trainer");
  } else if (is_auto) {
    // Left in auto_keys: a plan notes it and goes on, and --resolved-config still says "auto".
    r->ErrorAbout(kTotal, "scheduler.params.total_num_steps: \"auto\", but the trainer gave no "
                          "total_num_steps; a decaying schedule needs it");
  }
}

// gradient_accumulation_steps "auto", then train = micro * gas * world when all are known.
void ResolveBatchAutos(AutoResolver* r) {
  Config* c = r->config();
  const AutoFill& f = r->fill();
  const int64_t train = c->train_batch_size > 0 ? c->train_batch_size
                                                : f.train_batch_size.value_or(0);
  const int64_t micro = c->train_micro_batch_size_per_gpu > 0 ? c->train_micro_batch_size_per_gpu
                                                             : f.train_micro_batch_size_per_gpu.value_or(0);
  const int64_t world = f.world_size.value_or(0);
  // Products of trainer-given sizes can overflow: __int128 holds any product of two int64s.
  const __int128 per_step = static_cast<__int128>(micro) * world;
  if (r->Take("gradient_accumulation_steps")) {
    std::string why = "zerort's default";
    constexpr int64_t kIntMax = std::numeric_limits<int>::max();
    if (f.gradient_accumulation_steps) {
      if (*f.gradient_accumulation_steps < 1 || *f.gradient_accumulation_steps > kIntMax) {
        return r->Error(absl::StrCat("gradient_accumulation_steps ",
                                     *f.gradient_accumulation_steps,
                                     " from the trainer: expected 1..", kIntMax));
      }
      c->gradient_accumulation_steps = static_cast<int>(*f.gradient_accumulation_steps);
      why = "from the trainer";
    } else if (train > 0 && micro > 0 && world > 0 && train % per_step == 0 &&
               train / per_step <= kIntMax) {
      c->gradient_accumulation_steps = static_cast<int>(train / per_step);
      why = "train_batch_size / (train_micro_batch_size_per_gpu * world size)";
    }
    r->Note("gradient_accumulation_steps", c->gradient_accumulation_steps, why);
  }
  const __int128 expected = per_step * c->gradient_accumulation_steps;
  if (train > 0 && micro > 0 && world > 0 && expected != train) {
    r->Error(absl::StrCat("train_batch_size ", train, " != train_micro_batch_size_per_gpu ", micro,
                          " * gradient_accumulation_steps ", c->gradient_accumulation_steps,
                          " * world size ", world,
                          expected <= std::numeric_limits<int64_t>::max()
                              ? absl::StrCat(" = ", static_cast<int64_t>(expected))
                              : std::string(" (more than 2^63-1)")));
  }
}

}  // namespace

absl::Status ResolveAuto(const AutoFill& fill, absl::Span<const memory::ParamSpec> specs,
                         Config* config, AutoPurpose purpose) {
  AutoResolver r(fill, config, purpose);
  ResolveUnitSizeAutos(&r, specs);
  ResolveZeroAutos(&r);
  ResolvePrecisionAutos(&r);
  ResolveOptimizerAutos(&r);
  ResolveSchedulerAutos(&r);
  ResolveBatchAutos(&r);
  return r.Finish();
}

absl::StatusOr<AutoFill> ParseAutoFill(absl::string_view json_text) {
  ASSIGN_OR_RETURN(Json root, ParseJson(json_text, "auto fill"));
  if (!root.is_object()) return JsonExpected("<auto fill>", "a JSON object", root);
  AutoFill f;
  const std::pair<const char*, std::optional<int64_t>*> ints[] = {
      {"hidden_size", &f.hidden_size},
      {"world_size", &f.world_size},
      {"train_batch_size", &f.train_batch_size},
      {"train_micro_batch_size_per_gpu", &f.train_micro_batch_size_per_gpu},
      {"gradient_accumulation_steps", &f.gradient_accumulation_steps},
      {"total_num_steps", &f.total_num_steps},
      {"warmup_num_steps", &f.warmup_num_steps}};
  const std::pair<const char*, std::optional<double>*> doubles[] = {
      {"lr", &f.lr},   {"beta1", &f.beta1}, {"beta2", &f.beta2},
      {"eps", &f.eps}, {"weight_decay", &f.weight_decay},
      {"gradient_clipping", &f.gradient_clipping},
      {"warmup_min_lr", &f.warmup_min_lr}, {"warmup_max_lr", &f.warmup_max_lr}};
  std::vector<absl::string_view> keys = {"compute_dtype"};
  for (const auto& [key, out] : ints) keys.push_back(key);
  for (const auto& [key, out] : doubles) keys.push_back(key);
  RETURN_IF_ERROR(CheckJsonKeys(root, "", keys));
  JsonFields fields(root, "");
  for (const auto& [key, out] : ints) {
    if (fields.Find(key) != nullptr) {
      ASSIGN_OR_RETURN(*out, fields.Int(key, 0, int64_t{1} << 62));
    }
  }
  for (const auto& [key, out] : doubles) {
    if (fields.Find(key) != nullptr) {
      ASSIGN_OR_RETURN(*out, fields.Number(key));
    }
  }
  if (fields.Find("compute_dtype") != nullptr) {
    ASSIGN_OR_RETURN(std::string name, fields.String("compute_dtype"));
    absl::StatusOr<DType> d = ParseDType(name);
    if (!d.ok()) return Annotate(d.status(), "compute_dtype");
    f.compute_dtype = *d;
  }
  return f;
}

void FillRanksPerNode(const absl::StatusOr<comm::LaunchInfo>& launch, int world_size, int rank,
                      Config* config) {
  if (config->ranks_per_node != 0) return;
  if (absl::IsNotFound(launch.status())) return;  // no launcher: nothing to infer
  constexpr absl::string_view kKey = "zerort.ranks_per_node";
  if (!launch.ok()) {
    config->notes.push_back(absl::StrCat(kKey, ": left unknown, the launcher's variables do not "
                                               "parse (", launch.status().message(), ")"));
    return;
  }
  const comm::LaunchInfo& l = *launch;
  const int per_node = l.local_world_size;
  std::string why;
  if (l.world_size != world_size || l.rank != rank) {
    why = absl::StrCat(l.source, " describes rank ", l.rank, " of ", l.world_size,
                       ", this engine is rank ", rank, " of ", world_size);
  } else if (per_node <= 0) {
    why = absl::StrCat(l.source, " does not say how many ranks share this node");
  } else if (world_size % per_node != 0) {
    why = absl::StrCat(l.source, "'s ", per_node, " ranks on this node do not divide the world "
                       "size ", world_size);
  } else if (l.local_rank != rank % per_node) {
    why = absl::StrCat(l.source, " places rank ", rank, " at local rank ", l.local_rank, " of ",
                       per_node, ", not in consecutive blocks per node");
  }
  if (!why.empty()) {
    config->notes.push_back(absl::StrCat(kKey, ": left unknown (", why, ")"));
    return;
  }
  config->ranks_per_node = per_node;
  config->notes.push_back(
      absl::StrCat(kKey, ": 0 -> ", per_node, " (", l.source, ": ranks on this node)"));
}

}  // namespace zerort
