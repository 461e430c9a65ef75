#include "zero/config.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <thread>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "nlohmann/json.hpp"
#include "base/testing/temp_dir.h"
#include "zero/internal/config_keys.h"

namespace zerort {
namespace {

using Json = nlohmann::json;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  REQUIRE(in.good());
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

Config MustParse(const std::string& text) {
  absl::StatusOr<Config> config = ParseConfig(text);
  INFO(text);
  INFO(config.status().ToString());
  REQUIRE(config.ok());
  return *config;
}

absl::Status ParseError(const std::string& text) {
  absl::StatusOr<Config> config = ParseConfig(text);
  INFO(text);
  REQUIRE(!config.ok());
  return config.status();
}

// Collects leaf paths ("a.b.c") of a JSON object; arrays are leaves.
void Flatten(const Json& j, const std::string& prefix, std::map<std::string, Json>* out) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    std::string path = prefix.empty() ? it.key() : prefix + "." + it.key();
    if (it->is_object()) {
      Flatten(*it, path, out);
    } else {
      (*out)[path] = *it;
    }
  }
}

// The "## Settings" table of docs/config.md: key -> documented default.
std::map<std::string, Json> DocumentedDefaults() {
  std::string doc = ReadFile("docs/config.md");
  size_t begin = doc.find("\n## Settings");
  REQUIRE(begin != std::string::npos);
  size_t end = doc.find("\n## ", begin + 1);
  std::map<std::string, Json> defaults;
  for (absl::string_view line :
       absl::StrSplit(absl::string_view(doc).substr(begin, end - begin), '\n')) {
    if (!absl::StartsWith(line, "| `")) continue;
    std::vector<std::string> cells = absl::StrSplit(line, '|');
    REQUIRE(cells.size() >= 4);
    absl::string_view key = absl::StripAsciiWhitespace(cells[1]);
    absl::string_view value = absl::StripAsciiWhitespace(cells[2]);
    REQUIRE(absl::ConsumePrefix(&key, "`"));
    REQUIRE(absl::ConsumeSuffix(&key, "`"));
    REQUIRE(absl::ConsumePrefix(&value, "`"));
    REQUIRE(absl::ConsumeSuffix(&value, "`"));
    defaults[std::string(key)] = Json::parse(value);
  }
  return defaults;
}

TEST_CASE("Config: an empty object gives the defaults documented in docs/config.md", "[zero]") {
  Config parsed = MustParse("{}");
  // The two notes: which optimizer runs when the config names none, and the clipping default.
  REQUIRE(parsed.notes.size() == 2);
  CHECK(absl::StartsWith(parsed.notes[0], "optimizer: absent; using AdamW lr=0.001, "
                                          "betas=[0.9, 0.999], eps=1e-08, weight_decay=0.01"));
  CHECK(absl::StartsWith(parsed.notes[1], "gradient_clipping: absent, so 1.0"));
  CHECK(parsed == Config{});

  std::map<std::string, Json> resolved;
  Flatten(Json::parse(ResolvedConfigJson(parsed)), "", &resolved);
  std::map<std::string, Json> documented = DocumentedDefaults();
  // 31 rows until overlap_comm, contiguous_gradients and allgather_bucket_size moved to the
  // table of keys with no effect (checked in the test of those keys).
  REQUIRE(documented.size() >= 28);
  for (const auto& [key, value] : resolved) {
    INFO(key);
    REQUIRE(documented.count(key) == 1);
    CHECK(documented[key] == value);
  }
  for (const auto& [key, value] : documented) {
    INFO(key);
    CHECK(resolved.count(key) == 1);
  }
  // The documented precision rule: no bf16/fp16 block means fp32.
  CHECK(parsed.compute_dtype == DType::kF32);
}

TEST_CASE("Config: the example in docs/config.md parses to what the text says", "[zero]") {
  std::string doc = ReadFile("docs/config.md");
  size_t begin = doc.find("```json\n");
  REQUIRE(begin != std::string::npos);
  begin += 8;
  size_t end = doc.find("```", begin);
  REQUIRE(end != std::string::npos);
  Config c = MustParse(doc.substr(begin, end - begin));
  CHECK(c.compute_dtype == DType::kBF16);
  CHECK(c.zero.stage_auto);
  CHECK(c.zero.memory_budget.device_bytes == static_cast<int64_t>(80e9));
  CHECK(c.zero.offload_optimizer.device == OffloadDevice::kCpu);
  CHECK(c.zero.offload_optimizer.pin_memory);
  REQUIRE(c.notes.size() == 1);
  CHECK(absl::StartsWith(c.notes[0], "train_micro_batch_size_per_gpu:"));
}

TEST_CASE("Config: a full DeepSpeed-style config parses to the expected struct", "[zero]") {
  absl::StatusOr<Config> loaded = LoadConfigFile("zero/testdata/deepspeed_full.json");
  INFO(loaded.status().ToString());
  REQUIRE(loaded.ok());

  Config expected;
  expected.gradient_accumulation_steps = 16;
  expected.gradient_clipping = 1.0;
  expected.optimizer.lr = 3e-4;
  expected.optimizer.beta1 = 0.9;
  expected.optimizer.beta2 = 0.95;
  expected.optimizer.eps = 1e-6;
  expected.optimizer.weight_decay = 0.1;
  expected.compute_dtype = DType::kF16;
  expected.fp16.loss_scale = 0;
  expected.fp16.initial_scale_power = 12;
  expected.fp16.loss_scale_window = 500;
  expected.fp16.hysteresis = 3;
  expected.fp16.min_loss_scale = 0.5;
  ZeroConfig& z = expected.zero;
  z.stage = 3;
  z.allgather_bucket_size = 200000000;
  z.overlap_comm = false;
  z.reduce_bucket_size = 500000000;
  z.contiguous_gradients = false;
  z.offload_optimizer = {OffloadDevice::kCpu, /*pin_memory=*/false, /*buffer_count=*/8};
  z.offload_param = {OffloadDevice::kCpu, /*pin_memory=*/true};
  z.stage3_prefetch_bucket_size = 50000000;
  z.stage3_param_persistence_threshold = 100000;
  z.stage3_max_live_parameters = 3000000000;
  CHECK(*loaded == expected);

  // One note per accepted-but-ignored key, each naming it.
  const std::vector<std::string> ignored = {
      "train_batch_size",
      "train_micro_batch_size_per_gpu",
      "steps_per_print",
      "wall_clock_breakdown",
      "zero_allow_untested_optimizer",
      "zero_optimization.allgather_partitions",
      "zero_optimization.reduce_scatter",
      "zero_optimization.round_robin_gradients",
      "zero_optimization.sub_group_size",
      "zero_optimization.stage3_max_reuse_distance",
      "zero_optimization.stage3_gather_16bit_weights_on_model_save",
      "zero_optimization.allgather_bucket_size",
      "zero_optimization.overlap_comm",
      "zero_optimization.contiguous_gradients"};
  CHECK(loaded->notes.size() == ignored.size());
  for (const std::string& key : ignored) {
    INFO(key);
    int hits = 0;
    for (const std::string& note : loaded->notes) hits += absl::StartsWith(note, key + ":");
    CHECK(hits == 1);
  }
}

TEST_CASE("Config: overlap_comm, contiguous_gradients, allgather_bucket_size: no effect, noted",
          "[zero]") {
  Config on = MustParse(R"({"optimizer": {}, "gradient_clipping": 1.0, "zero_optimization": {"overlap_comm": true,
      "contiguous_gradients": true, "allgather_bucket_size": 2e8}})");
  CHECK(on == Config{});
  REQUIRE(on.notes.size() == 3);
  CHECK(absl::StartsWith(on.notes[0], "zero_optimization.overlap_comm: accepted, no effect: "
                                      "zerort always overlaps gradient reduction with backward"));
  CHECK(absl::StartsWith(on.notes[1],
                         "zero_optimization.contiguous_gradients: accepted, no effect: zerort "
                         "always keeps gradients in contiguous buffers"));
  CHECK(absl::StartsWith(on.notes[2],
                         "zero_optimization.allgather_bucket_size: accepted, no effect: zerort "
                         "all-gathers parameters one unit at a time"));

  // false asks for what zerort has no mode for: the note says it cannot be turned off, and why.
  Config off = MustParse(
      R"({"optimizer": {}, "gradient_clipping": 1.0, "zero_optimization": {"overlap_comm": false,
          "contiguous_gradients": false}})");
  CHECK(off == Config{});
  REQUIRE(off.notes.size() == 2);
  CHECK(absl::StartsWith(off.notes[0], "zero_optimization.overlap_comm: false has no effect, "
                                       "overlap cannot be turned off: zerort always overlaps"));
  CHECK(absl::StrContains(off.notes[0], "GradReady"));
  CHECK(absl::StartsWith(off.notes[1],
                         "zero_optimization.contiguous_gradients: false has no effect, contiguous "
                         "gradients cannot be turned off: "));

  // Still type-checked, and not settings: the resolved config leaves them out.
  CHECK(ParseError(R"({"zero_optimization": {"overlap_comm": "no"}})").code() ==
        absl::StatusCode::kInvalidArgument);
  const std::string resolved = ResolvedConfigJson(on);
  for (const char* key : {"overlap_comm", "contiguous_gradients", "allgather_bucket_size"}) {
    CHECK_FALSE(absl::StrContains(resolved, key));
  }
  CHECK(MustParse(R"({"optimizer": {}, "gradient_clipping": 1.0})").notes.empty());

  // docs/config.md documents each of them, outside the Settings table, with what zerort does.
  const std::string doc = ReadFile("docs/config.md");
  for (const char* key : {"overlap_comm", "contiguous_gradients", "allgather_bucket_size"}) {
    INFO(key);
    CHECK(absl::StrContains(doc, absl::StrCat("| `zero_optimization.", key, "` | ")));
    CHECK(DocumentedDefaults().count(absl::StrCat("zero_optimization.", key)) == 0);
  }
}

TEST_CASE("Config: ResolvedConfigJson round-trips and is a fixed point", "[zero]") {
  std::vector<Config> configs;
  configs.push_back(MustParse("{}"));
  configs.push_back(*LoadConfigFile("zero/testdata/deepspeed_full.json"));
  configs.push_back(MustParse(R"({"bf16": {"enabled": true}, "zero_optimization": {"stage": "auto",
      "memory_budget": {"device_bytes": 8e10, "host_bytes": 1}}, "cpu_threads": 7})"));
  configs.push_back(MustParse(R"({"fp16": {"enabled": true, "loss_scale": 1024.5}})"));

  // Random valid configs, with doubles that need all 17 digits to round-trip.
  std::mt19937_64 rng(12345);
  auto pick = [&rng](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  auto unit = [&rng]() { return std::uniform_real_distribution<double>(0.0, 1.0)(rng); };
  for (int i = 0; i < 200; ++i) {
    Config c;
    c.zero.stage_auto = pick(0, 3) == 0;
    c.zero.stage = c.zero.stage_auto ? 0 : static_cast<int>(pick(0, 3));
    c.zero.reduce_bucket_size = pick(1, INT64_MAX);
    c.zero.allgather_bucket_size = pick(1, 1 << 30);
    c.zero.overlap_comm = pick(0, 1);
    c.zero.contiguous_gradients = pick(0, 1);
    c.zero.offload_optimizer = {pick(0, 1) ? OffloadDevice::kCpu : OffloadDevice::kNone,
                                pick(0, 1) == 1, static_cast<int>(pick(1, 64))};
    bool stage3 = !c.zero.stage_auto && c.zero.stage == 3;
    c.zero.offload_param = {stage3 && pick(0, 1) ? OffloadDevice::kCpu : OffloadDevice::kNone,
                            pick(0, 1) == 1};
    c.zero.stage3_prefetch_bucket_size = pick(0, INT64_MAX);
    c.zero.stage3_param_persistence_threshold = pick(0, 1 << 20);
    c.zero.stage3_max_live_parameters = pick(1, INT64_MAX);
    c.zero.memory_budget = {pick(c.zero.stage_auto ? 1 : 0, INT64_MAX), pick(0, INT64_MAX)};
    c.compute_dtype = static_cast<DType>(pick(0, 2));
    c.fp16.loss_scale = pick(0, 1) ? 0.0 : unit() * 65536;
    c.fp16.initial_scale_power = static_cast<int>(pick(0, 127));
    c.fp16.loss_scale_window = static_cast<int>(pick(1, 5000));
    c.fp16.hysteresis = static_cast<int>(pick(1, 10));
    c.fp16.min_loss_scale = unit() + 1e-300;
    c.optimizer.lr = unit() / 3;
    c.optimizer.beta1 = unit() * 0.999;
    c.optimizer.beta2 = unit() * 0.999;
    c.optimizer.eps = unit() * 1e-6 + 1e-300;
    c.optimizer.weight_decay = unit();
    c.gradient_clipping = pick(0, 1) ? 0.0 : unit() * 10;
    c.gradient_accumulation_steps = static_cast<int>(pick(1, 1 << 20));
    c.comm_timeout_ms = pick(1, INT64_MAX);
    c.cpu_threads = static_cast<int>(pick(0, 256));
    configs.push_back(c);
  }

  for (const Config& c : configs) {
    std::string dump = ResolvedConfigJson(c);
    INFO(dump);
    absl::StatusOr<Config> again = ParseConfig(dump);
    INFO(again.status().ToString());
    REQUIRE(again.ok());
    CHECK(*again == c);
    CHECK(again->notes.empty());
    CHECK(ResolvedConfigJson(*again) == dump);
    CHECK(ValidateConfig(c).ok());
  }
}

TEST_CASE("Config: unknown keys at every level name the path and suggest the nearest key",
          "[zero]") {
  struct Case {
    const char* json;
    const char* path;
    const char* suggestion;
  };
  const Case cases[] = {
      {R"({"zero_optimization": {"reduce_bucket_sise": 5}})",
       "zero_optimization.reduce_bucket_sise", "reduce_bucket_size"},
      {R"({"gradient_cliping": 1})", "gradient_cliping", "gradient_clipping"},
      {R"({"zero_optimization": {"offload_optimizer": {"devise": "cpu"}}})",
       "zero_optimization.offload_optimizer.devise", "device"},
      {R"({"zero_optimization": {"offload_param": {"pin_memroy": true}}})",
       "zero_optimization.offload_param.pin_memroy", "pin_memory"},
      {R"({"zero_optimization": {"memory_budget": {"device_byte": 1}}})",
       "zero_optimization.memory_budget.device_byte", "device_bytes"},
      {R"({"bf16": {"enable": true}})", "bf16.enable", "enabled"},
      {R"({"fp16": {"hysterisis": 2}})", "fp16.hysterisis", "hysteresis"},
      {R"({"optimizer": {"typ": "AdamW"}})", "optimizer.typ", "type"},
      {R"({"optimizer": {"params": {"weight_deacy": 0}}})", "optimizer.params.weight_deacy",
       "weight_decay"},
      // Valid at another level: the full path is suggested.
      {R"({"Stage": 1})", "Stage", "zero_optimization.stage"},
      {R"({"optimizer": {"lr": 0.1}})", "optimizer.lr", "optimizer.params.lr"},
      {R"({"zero_optimization": {"enabled": true}})", "zero_optimization.enabled", "bf16.enabled"},
      {R"({"offload_optimizer": {"device": "cpu"}})", "offload_optimizer",
       "zero_optimization.offload_optimizer"},
      {R"({"zero_optimization": {"gradient_clipping": 1}})", "zero_optimization.gradient_clipping",
       "gradient_clipping"},
  };
  for (const Case& c : cases) {
    absl::Status s = ParseError(c.json);
    INFO(s.ToString());
    CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(s.message(), absl::StrCat(c.path, ": unknown key")));
    CHECK(absl::StrContains(s.message(), absl::StrCat("did you mean \"", c.suggestion, "\"")));
  }
  // Nothing close inside a block: the message lists what is valid there instead.
  absl::Status s = ParseError(R"({"zero_optimization": {"overlapping": true}})");
  CHECK(absl::StrContains(s.message(), "zero_optimization.overlapping: unknown key; the settings "
                                       "here are: stage, reduce_bucket_size"));
  // Nothing close at the top level: DeepSpeed ignores foreign top-level keys, and so does
  // zerort, with a note (an error in strict mode).
  Config foreign = MustParse(R"({"optimizer": {}, "gradient_clipping": 1.0, "overlap": true, "cuda_visible_devices": "0"})");
  REQUIRE(foreign.notes.size() == 2);
  CHECK(absl::StartsWith(foreign.notes[0], "overlap: not a zerort or DeepSpeed setting; ignored"));
  CHECK(absl::StartsWith(foreign.notes[1], "cuda_visible_devices: not a zerort or DeepSpeed"));
}

TEST_CASE("Config: wrong types and out-of-range values name the key, the value and the range",
          "[zero]") {
  struct Case {
    const char* json;
    const char* path;
    const char* value;  // as the message quotes it
    const char* range;
  };
  const Case cases[] = {
      {R"({"zero_optimization": {"stage": 4}})", "zero_optimization.stage", "4",
       "0..3 or \"auto\""},
      {R"({"zero_optimization": {"stage": -1}})", "zero_optimization.stage", "-1", "0..3"},
      {R"({"zero_optimization": {"stage": "three"}})", "zero_optimization.stage", "\"three\"",
       "\"auto\""},
      {R"({"zero_optimization": {"stage": true}})", "zero_optimization.stage", "true", "0..3"},
      // DeepSpeed's bound is ge=0: -1 is the first value below it.
      {R"({"zero_optimization": {"reduce_bucket_size": -1}})",
       "zero_optimization.reduce_bucket_size", "-1", ">= 0"},
      {R"({"zero_optimization": {"reduce_bucket_size": 1.5}})",
       "zero_optimization.reduce_bucket_size", "1.5", ">= 0"},
      {R"({"zero_optimization": {"reduce_bucket_size": "5e8"}})",
       "zero_optimization.reduce_bucket_size", "\"5e8\"", ">= 0"},
      {R"({"zero_optimization": {"reduce_bucket_size": 1e19}})",
       "zero_optimization.reduce_bucket_size", "1e+19", ">= 0"},
      {R"({"zero_optimization": {"allgather_bucket_size": 18446744073709551615}})",
       "zero_optimization.allgather_bucket_size", "18446744073709551615", ">= 0"},
      {R"({"zero_optimization": {"overlap_comm": "yes"}})", "zero_optimization.overlap_comm",
       "\"yes\"", "true or false"},
      {R"({"zero_optimization": {"offload_optimizer": {"buffer_count": -1}}})",
       "zero_optimization.offload_optimizer.buffer_count", "-1", ">= 0"},
      {R"({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}})",
       "zero_optimization.offload_optimizer.device", "\"gpu\"",
       "\"none\", \"cpu\" or \"nvme\""},
      // DeepSpeed's Field(1.0, ge=0.0, le=1.0).
      {R"({"zero_optimization": {"offload_optimizer": {"ratio": 1.5}}})",
       "zero_optimization.offload_optimizer.ratio", "1.5", "[0, 1]"},
      {R"({"zero_optimization": {"offload_optimizer": {"ratio": -0.25}}})",
       "zero_optimization.offload_optimizer.ratio", "-0.25", "[0, 1]"},
      {R"({"zero_optimization": {"offload_optimizer": {"ratio": "half"}}})",
       "zero_optimization.offload_optimizer.ratio", "\"half\"", "[0, 1]"},
      {R"({"zero_optimization": {"offload_param": {"device": 1}}})",
       "zero_optimization.offload_param.device", "1",
       "\"none\", \"cpu\" or \"nvme\""},
      {R"({"zero_optimization": {"memory_budget": {"host_bytes": -5}}})",
       "zero_optimization.memory_budget.host_bytes", "-5", ">= 0"},
      {R"({"zero_optimization": {"stage3_max_live_parameters": -1}})",
       "zero_optimization.stage3_max_live_parameters", "-1", ">= 0"},
      {R"({"zero_optimization": []})", "zero_optimization", "an array", "an object"},
      {R"({"optimizer": {"params": {"betas": [0.9, 1.0]}}})", "optimizer.params.betas[1]", "1.0",
       "[0, 1)"},
      {R"({"optimizer": {"params": {"betas": [-0.1, 0.9]}}})", "optimizer.params.betas[0]", "-0.1",
       "[0, 1)"},
      {R"({"optimizer": {"params": {"betas": [0.9]}}})", "optimizer.params.betas", "an array",
       "two numbers"},
      {R"({"optimizer": {"params": {"eps": 0}}})", "optimizer.params.eps", "0", "> 0"},
      {R"({"optimizer": {"params": {"lr": -0.1}}})", "optimizer.params.lr", "-0.1", ">= 0"},
      {R"({"optimizer": {"params": {"lr": "Auto"}}})", "optimizer.params.lr", "\"Auto\"", ">= 0"},
      {R"({"optimizer": {"params": {"weight_decay": -1}}})", "optimizer.params.weight_decay", "-1",
       ">= 0"},
      {R"({"optimizer": {"type": "Lamb"}})", "optimizer.type", "\"Lamb\"", "\"AdamW\""},
      {R"({"fp16": {"initial_scale_power": 128}})", "fp16.initial_scale_power", "128", "0..127"},
      {R"({"fp16": {"loss_scale_window": 0}})", "fp16.loss_scale_window", "0", ">= 1"},
      {R"({"fp16": {"hysteresis": 0}})", "fp16.hysteresis", "0", ">= 1"},
      {R"({"fp16": {"min_loss_scale": 0}})", "fp16.min_loss_scale", "0", "> 0"},
      {R"({"fp16": {"loss_scale": -1}})", "fp16.loss_scale", "-1", ">= 0"},
      {R"({"bf16": {"enabled": 1}})", "bf16.enabled", "1", "true or false"},
      {R"({"gradient_clipping": -1})", "gradient_clipping", "-1", ">= 0"},
      {R"({"gradient_accumulation_steps": 0})", "gradient_accumulation_steps", "0", ">= 1"},
      {R"({"gradient_accumulation_steps": 3000000000})", "gradient_accumulation_steps",
       "3000000000", "<= 2147483647"},
      {R"({"comm_timeout_ms": 0})", "comm_timeout_ms", "0", ">= 1"},
      {R"({"cpu_threads": -1})", "cpu_threads", "-1", ">= 0"},
      {R"([1, 2])", "<root>", "an array", "a JSON object"},
  };
  for (const Case& c : cases) {
    absl::Status s = ParseError(c.json);
    INFO(s.ToString());
    CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(s.message(), absl::StrCat(c.path, ": expected ")));
    CHECK(absl::StrContains(s.message(), absl::StrCat("got ", c.value)));
    CHECK(absl::StrContains(s.message(), c.range));
  }
}

TEST_CASE("Config: integers may be written as integral floats", "[zero]") {
  Config c = MustParse(R"({"zero_optimization": {"stage": 2.0, "reduce_bucket_size": 5e8,
      "allgather_bucket_size": 1.25e3, "memory_budget": {"device_bytes": 8.0e10}},
      "gradient_accumulation_steps": 4e0})");
  CHECK(c.zero.stage == 2);
  CHECK(c.zero.reduce_bucket_size == static_cast<int64_t>(5e8));
  CHECK(c.zero.allgather_bucket_size == static_cast<int64_t>(1.25e3));
  CHECK(c.zero.memory_budget.device_bytes == static_cast<int64_t>(8.0e10));
  CHECK(c.gradient_accumulation_steps == 4);
  // Largest int64 written as an integer, and a double just below 2^63.
  c = MustParse(R"({"zero_optimization": {"reduce_bucket_size": 9223372036854775807,
      "allgather_bucket_size": 9.2233720368547748e18}})");
  CHECK(c.zero.reduce_bucket_size == INT64_MAX);
  CHECK(c.zero.allgather_bucket_size == static_cast<int64_t>(9.2233720368547748e18));
  // 2^63 itself does not fit.
  CHECK(
      ParseError(R"({"zero_optimization": {"reduce_bucket_size": 9223372036854775808}})").code() ==
      absl::StatusCode::kInvalidArgument);
  CHECK(ParseError(R"({"zero_optimization": {"reduce_bucket_size": 9.223372036854775808e18}})")
            .code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("Config: duplicate keys are errors naming the path", "[zero]") {
  struct Case {
    const char* json;
    const char* path;
  };
  const Case cases[] = {
      {R"({"gradient_clipping": 1, "gradient_clipping": 2})", "gradient_clipping"},
      {R"({"zero_optimization": {"stage": 1, "overlap_comm": true, "stage": 2}})",
       "zero_optimization.stage"},
      {R"({"zero_optimization": {"offload_optimizer": {"device": "cpu", "device": "none"}}})",
       "zero_optimization.offload_optimizer.device"},
      // Even under a key that is otherwise ignored, and inside arrays.
      {R"({"wandb": [{"project": "a"}, {"project": "b", "project": "c"}]})", "wandb[1].project"},
  };
  for (const Case& c : cases) {
    absl::Status s = ParseError(c.json);
    INFO(s.ToString());
    CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(s.message(), absl::StrCat(c.path, ": duplicate key")));
  }
  // The same key in sibling objects is not a duplicate.
  MustParse(R"({"zero_optimization": {"offload_optimizer": {"device": "none"},
      "offload_param": {"device": "none"}}})");
}

// Line and column of byte `offset` in `text`, 1-based: the reference for the parser's report.
std::string Position(const std::string& text, size_t offset) {
  size_t line = 1 + std::count(text.begin(), text.begin() + offset, '\n');
  size_t line_start = text.rfind('\n', offset == 0 ? 0 : offset - 1);
  size_t column = line_start == std::string::npos || offset == 0 ? offset + 1 : offset - line_start;
  return absl::StrCat(line, ":", column);
}

TEST_CASE("Config: text that is not JSON reports line and column", "[zero]") {
  struct Case {
    std::string json;
    size_t offset;  // the offending byte
  };
  const std::string bad_key = "{\n  \"bf16\": {\"enabled\": true},\n  oops: 1\n}";
  const std::string bad_value = "{\"gradient_clipping\": 1.0.0}";
  const std::string truncated = "{\"bf16\": {";
  const std::string not_closed = "{\n\"fp16\": {}\n\n";
  const Case cases[] = {
      {bad_key, bad_key.find("oops")}, {bad_value, bad_value.find(".0}")},  // "1.0." is where the
                                                                            // number stops being
                                                                            // one
      {truncated, truncated.size()},   {not_closed, not_closed.size()},    {"", 0},
  };
  for (const Case& c : cases) {
    absl::StatusOr<Config> config = ParseConfig(c.json, "in.json");
    INFO(c.json);
    INFO(config.status().ToString());
    REQUIRE(!config.ok());
    CHECK(config.status().code() == absl::StatusCode::kInvalidArgument);
    // At end of input the parser points one past the last byte; clamp the reference the same way.
    std::string expected =
        Position(c.json, std::min(c.offset, c.json.empty() ? 0 : c.json.size() - 1));
    CHECK(absl::StartsWith(config.status().message(), absl::StrCat("in.json:", expected, ": ")));
    CHECK(absl::StrContains(config.status().message(), "not valid JSON"));
  }

  // From a file, the message names the file.
  const std::string path = "zero/testdata/trailing_comma.json";
  std::string text = ReadFile(path);
  absl::StatusOr<Config> loaded = LoadConfigFile(path);
  REQUIRE(!loaded.ok());
  INFO(loaded.status().ToString());
  CHECK(loaded.status().code() == absl::StatusCode::kInvalidArgument);
  size_t comma = text.find(",");
  size_t offending = text.find('}', comma);
  CHECK(absl::StartsWith(loaded.status().message(),
                         absl::StrCat(path, ":", Position(text, offending), ": not valid JSON")));
}

TEST_CASE("Config: unreadable files are errors naming the file", "[zero]") {
  absl::StatusOr<Config> missing = LoadConfigFile("zero/testdata/no_such_file.json");
  REQUIRE(!missing.ok());
  CHECK(missing.status().code() == absl::StatusCode::kNotFound);
  CHECK(absl::StrContains(missing.status().message(), "zero/testdata/no_such_file.json"));

  absl::StatusOr<Config> directory = LoadConfigFile("zero/testdata");
  REQUIRE(!directory.ok());
  CHECK(absl::StrContains(directory.status().message(), "zero/testdata"));

  // Not a regular file: refused rather than read without end.
  absl::StatusOr<Config> device = LoadConfigFile("/dev/zero");
  REQUIRE(!device.ok());
  CHECK(device.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(device.status().message(),
                          "cannot read config file \"/dev/zero\": not a regular file"));

  // Validation errors from a file carry its name too.
  absl::StatusOr<Config> config = ParseConfig(R"({"cpu_threads": -2})", "my.json");
  REQUIRE(!config.ok());
  CHECK(absl::StartsWith(config.status().message(), "my.json: cpu_threads: "));
}

TEST_CASE("Config: rules across keys name every key involved", "[zero]") {
  struct Case {
    const char* json;
    absl::StatusCode code;
    std::vector<const char*> mentions;
  };
  const Case cases[] = {
      {R"({"bf16": {"enabled": true}, "fp16": {"enabled": true}})",
       absl::StatusCode::kInvalidArgument,
       {"bf16.enabled", "fp16.enabled"}},
      {R"({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})",
       absl::StatusCode::kInvalidArgument,
       {"zero_optimization.offload_param.device", "zero_optimization.stage", "2"}},
      {R"({"zero_optimization": {"stage": "auto", "memory_budget": {"device_bytes": 1},
           "offload_param": {"device": "cpu"}}})",
       absl::StatusCode::kInvalidArgument,
       {"zero_optimization.offload_param.device", "zero_optimization.stage", "\"auto\""}},
      {R"({"zero_optimization": {"stage": "auto"}})",
       absl::StatusCode::kInvalidArgument,
       {"zero_optimization.stage", "zero_optimization.memory_budget.device_bytes"}},
      {R"({"zero_optimization": {"stage": "auto", "memory_budget": {"host_bytes": 100}}})",
       absl::StatusCode::kInvalidArgument,
       {"zero_optimization.memory_budget.device_bytes"}},
      {R"({"fp16": {"enabled": true, "initial_scale_power": 3, "min_loss_scale": 16}})",
       absl::StatusCode::kInvalidArgument,
       {"fp16.initial_scale_power", "fp16.min_loss_scale"}},
      {R"({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}})",
       absl::StatusCode::kInvalidArgument,
       {"zero_optimization.offload_optimizer.device", "nvme",
        "zero_optimization.offload_optimizer.nvme_path"}},
      {R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}})",
       absl::StatusCode::kInvalidArgument,
       {"zero_optimization.offload_param.device", "nvme",
        "zero_optimization.offload_param.nvme_path"}},
  };
  for (const Case& c : cases) {
    absl::Status s = ParseError(c.json);
    INFO(s.ToString());
    CHECK(s.code() == c.code);
    for (const char* m : c.mentions) CHECK(absl::StrContains(s.message(), m));
  }
  // The valid counterparts parse.
  CHECK(MustParse(R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})")
            .zero.offload_param.device == OffloadDevice::kCpu);
  Config automatic = MustParse(
      R"({"zero_optimization": {"stage": "auto", "memory_budget": {"device_bytes": 1e9}}})");
  CHECK(automatic.zero.stage_auto);
  CHECK(automatic.zero.memory_budget.device_bytes == 1000000000);
  // A static loss scale makes the dynamic-scaling bound irrelevant.
  MustParse(R"({"fp16": {"enabled": true, "loss_scale": 128, "initial_scale_power": 3,
      "min_loss_scale": 16}})");
}

TEST_CASE("Config: precision follows the bf16 and fp16 blocks", "[zero]") {
  CHECK(MustParse(R"({"bf16": {"enabled": true}})").compute_dtype == DType::kBF16);
  CHECK(MustParse(R"({"fp16": {"enabled": true}})").compute_dtype == DType::kF16);
  CHECK(MustParse(R"({"bf16": {"enabled": false}, "fp16": {"enabled": false}})").compute_dtype ==
        DType::kF32);
  CHECK(MustParse(R"({"bf16": {}})").compute_dtype == DType::kF32);
  // An fp16 block that is not enabled is still validated and kept.
  Config c = MustParse(R"({"fp16": {"initial_scale_power": 20}})");
  CHECK(c.compute_dtype == DType::kF32);
  CHECK(c.fp16.initial_scale_power == 20);
  CHECK(ParseError(R"({"fp16": {"initial_scale_power": -1}})").code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("Config: optimizer type accepts AdamW and Adam, always meaning AdamW", "[zero]") {
  Config c = MustParse(R"({"optimizer": {"type": "adamw"}, "gradient_clipping": 1.0})");
  CHECK(c.optimizer.type == "AdamW");
  CHECK(c.notes.empty());
  c = MustParse(R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": true}},
      "gradient_clipping": 1.0})");
  CHECK(c.optimizer.type == "AdamW");
  CHECK(c.notes.size() == 2);  // the type, and the no-op adam_w_mode
  absl::Status coupled =
      ParseError(R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": false}}})");
  CHECK(coupled.code() == absl::StatusCode::kUnimplemented);
  CHECK(absl::StrContains(coupled.message(), "optimizer.params.adam_w_mode"));
}

TEST_CASE("Config: DeepSpeed keys without effect are accepted with one note each", "[zero]") {
  const std::vector<std::pair<std::string, std::string>> ignored = {
      {"train_batch_size", "1024"},
      {"train_micro_batch_size_per_gpu", "\"auto\""},
      {"steps_per_print", "10"},
      {"wall_clock_breakdown", "true"},
      {"zero_allow_untested_optimizer", "true"},
      {"tensorboard", R"({"enabled": true, "output_path": "x"})"},
      {"sparse_gradients", "false"},
  };
  // With gradient_accumulation_steps written, the batch sizes change nothing (without it they
  // would derive it, as in DeepSpeed: see ResolveAuto).
  std::string json = R"({"optimizer": {}, "gradient_clipping": 1.0, "scheduler": null, "gradient_accumulation_steps": 1,)";
  for (const auto& [key, value] : ignored) json += "\"" + key + "\": " + value + ",";
  json += R"("zero_optimization": {"round_robin_gradients": true, "sub_group_size": 1e9,
      "reduce_scatter": false, "allgather_partitions": false, "stage3_max_reuse_distance": 0,
      "stage3_gather_16bit_weights_on_model_save": true, "zero_quantized_weights": false,
      "offload_optimizer": {"pipeline_read": true}}})";
  Config c = MustParse(json);
  CHECK(c == Config{});  // no effect on any setting
  const std::vector<std::string> paths = {
      "zero_optimization.round_robin_gradients",
      "zero_optimization.sub_group_size",
      "zero_optimization.reduce_scatter",
      "zero_optimization.allgather_partitions",
      "zero_optimization.stage3_max_reuse_distance",
      "zero_optimization.stage3_gather_16bit_weights_on_model_save",
      "zero_optimization.zero_quantized_weights",
      "zero_optimization.offload_optimizer.pipeline_read"};
  CHECK(c.notes.size() == ignored.size() + paths.size());
  std::vector<std::string> all = paths;
  for (const auto& kv : ignored) all.push_back(kv.first);
  for (const std::string& path : all) {
    INFO(path);
    int hits = 0;
    for (const std::string& note : c.notes) hits += absl::StartsWith(note, path + ":");
    CHECK(hits == 1);
  }

  // A DeepSpeed feature we do not have, switched on, is Unimplemented rather than ignored.
  struct Case {
    const char* json;
    const char* path;
  };
  const Case unsupported[] = {
      {R"({"zero_optimization": {"legacy_stage1": true}})", "zero_optimization.legacy_stage1"},
      {R"({"gradient_allreduce_op": "sum"})", "gradient_allreduce_op"},
      {R"({"zero_optimization": {"zero_quantized_gradients": true}})",
       "zero_optimization.zero_quantized_gradients"},
      {R"({"amp": {"enabled": true}})", "amp"},
      {R"({"fp16": {"consecutive_hysteresis": true}})", "fp16.consecutive_hysteresis"},
  };
  for (const Case& u : unsupported) {
    absl::Status s = ParseError(u.json);
    INFO(s.ToString());
    CHECK(s.code() == absl::StatusCode::kUnimplemented);
    CHECK(absl::StrContains(s.message(), absl::StrCat(u.path, ": not supported")));
  }
}

TEST_CASE("Config: hostile input returns errors, never throws or crashes", "[zero]") {
  // Every proper prefix of a valid config is incomplete JSON.
  const std::string full = ReadFile("zero/testdata/deepspeed_full.json");
  const size_t last = full.find_last_of('}');
  for (size_t n = 0; n <= last; ++n) {
    absl::StatusOr<Config> c;
    REQUIRE_NOTHROW(c = ParseConfig(absl::string_view(full).substr(0, n)));
    CHECK(!c.ok());
  }
  // Single-byte corruptions: whatever the outcome, a Status comes back.
  std::mt19937 rng(7);
  const std::string alphabet = "{}[]\":,0123456789.eE+-truefalsn \x80\xff\\";
  for (int i = 0; i < 2000; ++i) {
    std::string mutated = full;
    mutated[rng() % mutated.size()] = alphabet[rng() % alphabet.size()];
    REQUIRE_NOTHROW(ParseConfig(mutated));
  }
  // Deep nesting is refused with the path, not recursed into.
  std::string deep = "{\"wandb\": " + std::string(100000, '[') + std::string(100000, ']') + "}";
  absl::Status s = ParseError(deep);
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(s.message(), "wandb[0]"));
  CHECK(absl::StrContains(s.message(), "nested deeper"));
}

TEST_CASE("Config: ValidateConfig applies the parser's rules to a Config built in code", "[zero]") {
  Config c;
  CHECK(ValidateConfig(c).ok());
  c.zero.stage = 5;
  absl::Status s = ValidateConfig(c);
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(s.message(), "zero_optimization.stage"));

  c = Config{};
  c.optimizer.lr = std::nan("");
  s = ValidateConfig(c);
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(s.message(), "optimizer.params.lr"));

  c = Config{};
  c.zero.offload_param.device = OffloadDevice::kCpu;  // stage 0
  CHECK(ValidateConfig(c).code() == absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace zerort

namespace zerort {
namespace {

TEST_CASE("Config: every problem of a config is reported in one error, one line each", "[zero]") {
  // Eight distinct mistakes: a typo, a misplaced key, a wrong type, three out-of-range values,
  // a conflict and a missing scheduler parameter.
  absl::Status s = ParseError(R"({
    "zero_optimization": {"stage": 3, "reduce_bucket_sise": 5e8,
                          "stage3_max_live_parameters": -1, "max_live_parameters": 1e9},
    "optimizer": {"lr": 0.1, "params": {"betas": [0.9, 1.5]}},
    "bf16": {"enabled": "yes"},
    "gradient_clipping": -1,
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}
  })");
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  std::vector<std::string> lines = absl::StrSplit(s.message(), '\n');
  INFO(s.message());
  REQUIRE(lines.size() == 9);
  CHECK(lines[0] == "<config>: 8 problems:");
  const char* expected[] = {
      "<config>: zero_optimization.reduce_bucket_sise: unknown key; did you mean "
      "\"reduce_bucket_size\"?",
      "<config>: zero_optimization.stage3_max_live_parameters and "
      "zero_optimization.max_live_parameters are two spellings of one DeepSpeed setting",
      "<config>: zero_optimization.stage3_max_live_parameters: expected an integer >= 0, got -1",
      "<config>: optimizer.lr: unknown key here; did you mean \"optimizer.params.lr\"?",
      "<config>: optimizer.params.betas[1]: expected a number in [0, 1), got 1.5",
      "<config>: bf16.enabled: expected true or false, got \"yes\"",
      "<config>: scheduler.params.total_num_steps: missing; WarmupDecayLR needs it",
  };
  // And gradient_clipping's; the order follows the readers.
  for (const char* e : expected) {
    INFO(e);
    CHECK(std::count_if(lines.begin(), lines.end(), [&](const std::string& l) {
            return absl::StartsWith(l, e);
          }) == 1);
  }
  CHECK(absl::StrContains(s.message(), "<config>: gradient_clipping: expected a number >= 0"));
  // Only problems: a key that failed to parse raises no second, derived complaint.
  CHECK_FALSE(absl::StrContains(s.message(), "offload"));

  // A rule across keys is skipped when a key it reads did not parse, and only then.
  CHECK(ParseError(R"({"zero_optimization": {"stage": 5, "offload_param": {"device": "cpu"}}})")
            .message() ==
        "<config>: zero_optimization.stage: expected an integer in 0..3 or \"auto\", got 5");
  absl::Status both = ParseError(R"({"zero_optimization": {"stage": 2,
      "stage3_max_live_parameters": -1, "offload_param": {"device": "cpu"}}})");
  CHECK(absl::StartsWith(both.message(), "<config>: 2 problems:\n"));
  CHECK(absl::StrContains(both.message(), "parameter offload requires stage 3"));

  // All of one kind keep their code; one problem keeps the single-line form.
  absl::Status unimplemented =
      ParseError(R"({"sparse_gradients": true, "amp": {"enabled": true}})");
  CHECK(unimplemented.code() == absl::StatusCode::kUnimplemented);
  CHECK(absl::StartsWith(unimplemented.message(), "<config>: 2 problems:\n"));
  CHECK(ParseError(R"({"cpu_threads": -1})").message() ==
        "<config>: cpu_threads: expected an integer >= 0 and <= 2147483647, got -1");
}

TEST_CASE("Config: DeepSpeed's other spellings are read as the setting they name", "[zero]") {
  Config c = MustParse(R"({"optimizer": {}, "gradient_clipping": 1.0, "zero_optimization": {"stage": 3,
      "prefetch_bucket_size": 123, "param_persistence_threshold": 456,
      "max_live_parameters": 789, "max_reuse_distance": 1e9,
      "gather_16bit_weights_on_model_save": true, "model_persistence_threshold": 1e9},
      "bfloat16": {"enabled": true}})");
  CHECK(c.zero.stage3_prefetch_bucket_size == 123);
  CHECK(c.zero.stage3_param_persistence_threshold == 456);
  CHECK(c.zero.stage3_max_live_parameters == 789);
  CHECK(c.compute_dtype == DType::kBF16);
  CHECK(c.notes.size() == 4);  // three keys without effect, and bfloat16's note
  CHECK(absl::StartsWith(c.notes.back(), "bfloat16: DeepSpeed's older name of the bf16 block"));

  // Both spellings at once: one error naming both.
  for (const char* json :
       {R"({"zero_optimization": {"stage3_prefetch_bucket_size": 1, "prefetch_bucket_size": 1}})",
        R"({"bf16": {"enabled": true}, "bfloat16": {"enabled": true}})",
        R"({"aio": {"thread_count": 1, "intra_op_parallelism": 2}})"}) {
    absl::Status s = ParseError(json);
    INFO(s.ToString());
    CHECK(absl::StrContains(s.message(), "are two spellings of one DeepSpeed setting"));
  }

  // The deprecated cpu_offload still means optimizer offload, as in DeepSpeed, with a note.
  c = MustParse(R"({"zero_optimization": {"stage": 2, "cpu_offload": true}})");
  CHECK(c.zero.offload_optimizer.device == OffloadDevice::kCpu);
  CHECK(absl::StrContains(absl::StrJoin(c.notes, "\n"),
                          "zero_optimization.cpu_offload: deprecated DeepSpeed spelling, read as "
                          "zero_optimization.offload_optimizer.device \"cpu\""));
  c = MustParse(R"({"zero_optimization": {"stage": 3, "cpu_offload_param": true,
      "cpu_offload_use_pin_memory": false}})");
  CHECK(c.zero.offload_param.device == OffloadDevice::kCpu);
  CHECK_FALSE(c.zero.offload_param.pin_memory);
  CHECK(absl::StrContains(
      ParseError(R"({"zero_optimization": {"cpu_offload": true, "offload_optimizer": {}}})")
          .message(),
      "zero_optimization.cpu_offload (deprecated) and zero_optimization.offload_optimizer"));

  // Keys DeepSpeed accepts that do nothing here, each with a note.
  c = MustParse(R"({"optimizer": {}, "gradient_clipping": 1.0, "zero_force_ds_cpu_optimizer": false,
      "fp16": {"enabled": true, "auto_cast": true}, "comms_logger": {"enabled": false}})");
  CHECK(c.compute_dtype == DType::kF16);
  CHECK(c.notes.size() == 3);
}

TEST_CASE("Config: nvme offload, aio, data types and param groups parse into their fields",
          "[zero]") {
  Config c = MustParse(R"({"zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pipeline_read": true},
      "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "buffer_count": 6,
                        "buffer_size": 1e8, "max_in_cpu": 1e9}},
      "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 2, "single_submit": true,
              "overlap_events": false},
      "data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "bfp16",
      "zerort": {"param_groups": [{"pattern": "*.bias", "weight_decay": 0},
                                  {"pattern": "emb*", "weight_decay": 0.1, "lr_scale": 0.5}]}})");
  CHECK(c.zero.offload_optimizer.device == OffloadDevice::kNvme);
  CHECK(c.zero.offload_optimizer.nvme_path == "/local_nvme");
  CHECK(c.zero.offload_param.device == OffloadDevice::kNvme);
  // Parameters on NVMe, with or without optimizer offload: no fallback, so no note about one.
  auto offload_param_noted = [](const Config& config) {
    bool noted = false;
    for (const std::string& n : config.notes) {
      noted |= n.find("offload_param.device") != std::string::npos ||
               n.find("host memory instead") != std::string::npos;
    }
    return noted;
  };
  CHECK_FALSE(offload_param_noted(c));
  const Config params_only = MustParse(R"({"zero_optimization": {"stage": 3,
      "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}}})");
  CHECK(params_only.zero.offload_param.device == OffloadDevice::kNvme);
  CHECK(params_only.zero.offload_optimizer.device == OffloadDevice::kNone);
  CHECK_FALSE(offload_param_noted(params_only));
  CHECK(c.zero.offload_param.buffer_count == 6);
  CHECK(c.zero.offload_param.buffer_size == 100000000);
  CHECK(c.aio.block_size == 262144);
  CHECK(c.aio.queue_depth == 32);
  CHECK(c.aio.thread_count == 2);
  CHECK(c.aio.single_submit);
  CHECK_FALSE(c.aio.overlap_events);
  CHECK(c.grad_accum_dtype == DType::kF32);
  CHECK(c.communication_dtype == DType::kBF16);
  REQUIRE(c.param_groups.size() == 2);
  CHECK(c.param_groups[1].pattern == "emb*");
  CHECK(c.param_groups[1].weight_decay == 0.1);
  CHECK(c.param_groups[1].lr_scale == 0.5);
  CHECK(c.param_groups[0].lr_scale == 1);
  // They round-trip through the resolved dump.
  absl::StatusOr<Config> again = ParseConfig(ResolvedConfigJson(c));
  REQUIRE(again.ok());
  CHECK(*again == c);

  for (const char* json : {R"({"aio": {"block_size": 5000}})",
                           R"({"data_types": {"grad_accum_dtype": "fp64"}})",
                           R"({"zerort": {"param_groups": [{"weight_decay": 0}]}})",
                           R"({"zerort": {"param_groups": [{"pattern": "x", "lr_scale": -1}]}})"}) {
    INFO(json);
    CHECK(ParseError(json).code() == absl::StatusCode::kInvalidArgument);
  }
}

TEST_CASE("Config: strict mode turns every ignored key into an error", "[zero]") {
  const std::string json = R"({"optimizer": {}, "gradient_clipping": 1.0, "wall_clock_breakdown": false,
      "cuda_visible_devices": "0,1", "zero_optimization": {"round_robin_gradients": true}})";
  Config lenient = MustParse(json);
  CHECK(lenient.notes.size() == 3);
  absl::StatusOr<Config> strict = ParseConfig(json, "ds.json", ParseOptions{true});
  REQUIRE(!strict.ok());
  INFO(strict.status().message());
  CHECK(absl::StartsWith(strict.status().message(), "ds.json: 3 problems:\n"));
  for (const char* path :
       {"wall_clock_breakdown", "cuda_visible_devices", "zero_optimization.round_robin_gradients"}) {
    CHECK(absl::StrContains(strict.status().message(), absl::StrCat("ds.json: ", path, ": ")));
  }
  CHECK(absl::StrContains(strict.status().message(), "[refused: strict mode]"));
  // The same from the config itself; notes that are not about ignored keys stay notes.
  absl::StatusOr<Config> in_file = ParseConfig(
      R"({"zerort": {"strict": true}, "wall_clock_breakdown": false})");
  CHECK(!in_file.ok());
  Config clean = MustParse(
      R"({"zerort": {"strict": true}, "optimizer": {"type": "Adam"}, "gradient_clipping": 0})");
  CHECK(clean.strict);
  CHECK(clean.notes.size() == 1);
}

}  // namespace
}  // namespace zerort

namespace zerort {
namespace {

TEST_CASE("Config: \"auto\" is accepted where Hugging Face writes it and recorded by path",
          "[zero]") {
  Config c = MustParse(R"({"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
      "optimizer": {"params": {"lr": "auto", "betas": "auto", "eps": "auto",
                               "weight_decay": "auto"}},
      "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                    "warmup_max_lr": "auto", "warmup_num_steps": "auto"}},
      "zero_optimization": {"reduce_bucket_size": "auto", "prefetch_bucket_size": "auto"},
      "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
      "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"})");
  const std::vector<std::string> expected = {
      "bf16.enabled", "fp16.enabled", "optimizer.params.lr", "optimizer.params.betas",
      "optimizer.params.eps", "optimizer.params.weight_decay",
      "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr",
      "scheduler.params.warmup_num_steps", "gradient_clipping", "gradient_accumulation_steps"};
  CHECK(c.auto_keys == expected);
  // Until filled, each value is its default.
  CHECK(c.compute_dtype == DType::kF32);
  CHECK(c.optimizer.lr == 1e-3);
  CHECK(c.zero.stage3_prefetch_bucket_size == kAutoSize);
  CHECK(c.train_batch_size == 0);
  // The dump writes "auto" back, and parses to the same Config.
  const std::string dump = ResolvedConfigJson(c);
  const Json j = Json::parse(dump);
  CHECK(j["optimizer"]["params"]["betas"] == "auto");
  CHECK(j["bf16"]["enabled"] == "auto");
  CHECK(j["scheduler"]["params"]["warmup_num_steps"] == "auto");
  absl::StatusOr<Config> again = ParseConfig(dump);
  REQUIRE(again.ok());
  CHECK(*again == c);
  // A hand-built list naming no setting is written nowhere (and never throws).
  Config odd;
  odd.auto_keys = {"gradient_clipping.x", "cpu_threads"};
  CHECK(Json::parse(ResolvedConfigJson(odd))["gradient_clipping"] == 1.0);
  CHECK(ValidateConfig(odd).code() == absl::StatusCode::kInvalidArgument);  // cpu_threads: "auto"
  // "auto" only where it is meaningful.
  for (const char* json : {R"({"cpu_threads": "auto"})",
                           R"({"zero_optimization": {"stage3_max_live_parameters": "many"}})",
                           R"({"fp16": {"loss_scale": "auto"}})"}) {
    INFO(json);
    CHECK(ParseError(json).code() == absl::StatusCode::kInvalidArgument);
  }
}

TEST_CASE("Config: the test configs in each user's style all parse", "[zero]") {
  for (const char* file :
       {"hf_trainer_zero3.json", "accelerate_zero2.json", "llama_factory_zero3_offload.json",
        "axolotl_zero1.json", "deepspeedexamples_bert_zero1.json", "megatron_deepspeed_bf16.json",
        "infinity_nvme_cosine.json", "openrlhf_zero3.json"}) {
    absl::StatusOr<Config> c = LoadConfigFile(std::string("zero/testdata/") + file);
    INFO(file);
    INFO(c.status().ToString());
    CHECK(c.ok());
  }
}

}  // namespace
}  // namespace zerort

// The table of keys (zero/internal/config_keys.h) drives every check, read, write and comparison:
// these tests go through its rows, so a new row is covered without a new test.
namespace zerort {
namespace {

using config_internal::AutoRule;
using config_internal::ConfigKeys;
using config_internal::Custom;
using config_internal::KeyDef;
using config_internal::Member;
using config_internal::Role;

// {"a": {"b": value}} for "a.b".
Json Nest(const std::string& path, const Json& value) {
  Json root = Json::object();
  Json* at = &root;
  for (absl::string_view part : absl::StrSplit(path, '.')) at = &(*at)[std::string(part)];
  *at = value;
  return root;
}

// The row's path with its last element spelt `leaf`.
std::string Respelt(const KeyDef& k, absl::string_view leaf) {
  const absl::string_view parent = config_internal::ParentPath(k.path);
  return parent.empty() ? std::string(leaf) : absl::StrCat(parent, ".", leaf);
}

// What a Config starts from in these tests: stage 3 admits every offload setting.
Config Stage3() {
  Config c;
  c.zero.stage = 3;
  return c;
}

// Values of a row's type that its range refuses, each with how the message quotes it.
std::vector<std::pair<Json, std::string>> OutOfRange(const KeyDef& k) {
  std::vector<std::pair<Json, std::string>> out = {{Json::array({Json::array()}), "an array"}};
  std::visit(
      [&](auto m) {
        using M = decltype(m);
        if constexpr (std::is_same_v<M, Member<int>> || std::is_same_v<M, Member<int64_t>>) {
          out.push_back({k.int_lo - 1, absl::StrCat(k.int_lo - 1)});
          if (k.int_hi < INT64_MAX) out.push_back({k.int_hi + 1, absl::StrCat(k.int_hi + 1)});
          out.push_back({1.5, "1.5"});
        } else if constexpr (std::is_same_v<M, Member<double>>) {
          const double below = k.real.lo_open ? k.real.lo : k.real.lo - 1;
          out.push_back({below, Json(below).dump()});
        } else if constexpr (std::is_same_v<M, Member<std::string>>) {
          out.push_back({5, "5"});
        } else if constexpr (!std::is_same_v<M, std::monostate>) {
          out.push_back({"bogus", "\"bogus\""});
        }
      },
      k.member);
  // "auto" where the row does not take it; a string may be "auto" (a directory of that name).
  if (k.auto_rule == AutoRule::kNone && k.custom == Custom::kNone &&
      !std::holds_alternative<Member<std::string>>(k.member)) {
    out.push_back({"auto", "\"auto\""});
  }
  return out;
}

TEST_CASE("Config table: every key refuses a value out of its type or range, naming the key",
          "[zero]") {
  for (const KeyDef& k : ConfigKeys()) {
    if (k.role == Role::kForeign) continue;
    std::vector<std::string> spellings = {k.path};
    if (k.alias != nullptr) spellings.push_back(Respelt(k, k.alias));
    for (const std::string& path : spellings) {
      for (const auto& [value, quoted] : OutOfRange(k)) {
        const std::string json = Nest(path, value).dump();
        INFO(json);
        absl::StatusOr<Config> c = ParseConfig(json);
        REQUIRE(!c.ok());
        INFO(c.status().message());
        CHECK(c.status().code() == absl::StatusCode::kInvalidArgument);
        CHECK(absl::StrContains(c.status().message(), absl::StrCat("<config>: ", path)));
        // A wrong type or range reads "expected ..., got <value>"; the hand-written blocks may
        // report a value inside the one given (param_groups[0]).
        if (k.custom == Custom::kNone) {
          CHECK(absl::StrContains(c.status().message(), absl::StrCat(": expected ")));
          CHECK(absl::StrContains(c.status().message(), absl::StrCat("got ", quoted)));
        }
      }
    }
  }
}

TEST_CASE("Config table: \"auto\" is taken by each key's rule and refused elsewhere", "[zero]") {
  for (const KeyDef& k : ConfigKeys()) {
    if (k.auto_rule == AutoRule::kNone || k.role != Role::kSetting) continue;
    INFO(k.path);
    Config c = MustParse(Nest(k.path, "auto").dump());
    const std::vector<std::string> expected = {k.path};
    if (k.auto_rule == AutoRule::kUnitSize) {
      CHECK(c.auto_keys.empty());
      CHECK(std::get<Member<int64_t>>(k.member).get(c) == kAutoSize);
    } else {
      CHECK(c.auto_keys == expected);
    }
    CHECK(ResolvedConfigJson(c) == ResolvedConfigJson(*ParseConfig(ResolvedConfigJson(c))));
  }
}

// A valid value of the row's type other than the default in `c`.
void ChangeSetting(const KeyDef& k, Config* c) {
  std::visit(
      [&](auto m) {
        using M = decltype(m);
        if constexpr (std::is_same_v<M, Member<bool>>) {
          m.at(*c) = !m.get(*c);
        } else if constexpr (std::is_same_v<M, Member<int>> || std::is_same_v<M, Member<int64_t>>) {
          // Twice the default keeps aio.block_size a multiple of 4096.
          const int64_t d = m.get(*c);
          const bool twice = d > 0 && d <= k.int_hi / 2;
          m.at(*c) = static_cast<std::decay_t<decltype(m.get(*c))>>(twice ? 2 * d : k.int_lo + 1);
        } else if constexpr (std::is_same_v<M, Member<double>>) {
          // Within a bounded range (offload_optimizer.ratio's [0, 1]): halfway down to its low end.
          const double d = m.get(*c);
          m.at(*c) = std::isfinite(k.real.hi) && d * 2 + 1 > k.real.hi ? (k.real.lo + d) / 2
                                                                      : d * 2 + 1;
        } else if constexpr (std::is_same_v<M, Member<std::string>>) {
          m.at(*c) = "/local_nvme";
        } else if constexpr (std::is_same_v<M, Member<std::optional<DType>>>) {
          m.at(*c) = DType::kF32;
        } else if constexpr (std::is_same_v<M, Member<OffloadDevice>>) {
          m.at(*c) = OffloadDevice::kCpu;
        }
      },
      k.member);
  switch (k.custom) {
    case Custom::kStage:
      c->zero.stage_auto = true;
      c->zero.memory_budget.device_bytes = 1;
      break;
    case Custom::kBf16Enabled:
      c->compute_dtype = DType::kBF16;
      break;
    case Custom::kFp16Enabled:
      c->compute_dtype = DType::kF16;
      break;
    case Custom::kBetas:
      c->optimizer.beta1 = 0.5;
      break;
    case Custom::kScheduler:
      c->scheduler.type = SchedulerType::kWarmupLR;
      break;
    case Custom::kParamGroups:
      c->param_groups.push_back({"*.bias", 0, 1});
      break;
    default:
      break;
  }
}

TEST_CASE("Config table: every setting is written, read back and compared; no-effect keys not",
          "[zero]") {
  const Config base = Stage3();
  const std::string base_dump = ResolvedConfigJson(base);
  for (const KeyDef& k : ConfigKeys()) {
    // "AdamW" is the one value optimizer.type has after parsing.
    if (k.role == Role::kForeign || k.role == Role::kInput || k.custom == Custom::kOptimizerType) {
      continue;
    }
    INFO(k.path);
    Config c = base;
    // The compact optimizer-state keys are valid with bf16 parameters only.
    const std::string path = k.path;
    if (path == "bf16.bf16_master_weights_and_grads" || path == "bf16.bf16_optimizer_states" ||
        path == "zerort.store_param_remainders") {
      c.compute_dtype = DType::kBF16;
    }
    ChangeSetting(k, &c);
    const std::string dump = ResolvedConfigJson(c);
    INFO(dump);
    if (k.role == Role::kNoEffect) {
      CHECK(c == base);
      CHECK(dump == base_dump);
      continue;
    }
    CHECK(c != base);
    CHECK(dump != base_dump);
    absl::StatusOr<Config> again = ParseConfig(dump);
    INFO(again.status().ToString());
    REQUIRE(again.ok());
    CHECK(*again == c);
    CHECK(ValidateConfig(c).ok());
  }
}

TEST_CASE("Config table: each block's operator== sees each of its rows", "[zero]") {
  const Config base = Stage3();
  for (const KeyDef& k : ConfigKeys()) {
    if (k.role != Role::kSetting || std::holds_alternative<std::monostate>(k.member)) continue;
    INFO(k.path);
    Config c = base;
    ChangeSetting(k, &c);
    const absl::string_view path = k.path;
    if (absl::StartsWith(path, "zero_optimization.")) CHECK_FALSE(c.zero == base.zero);
    if (absl::StartsWith(path, "zero_optimization.offload_optimizer.")) {
      CHECK_FALSE(c.zero.offload_optimizer == base.zero.offload_optimizer);
    }
    if (absl::StartsWith(path, "zero_optimization.offload_param.")) {
      CHECK_FALSE(c.zero.offload_param == base.zero.offload_param);
    }
    if (absl::StartsWith(path, "zero_optimization.memory_budget.")) {
      CHECK_FALSE(c.zero.memory_budget == base.zero.memory_budget);
    }
    if (absl::StartsWith(path, "fp16.")) CHECK_FALSE(c.fp16 == base.fp16);
    if (absl::StartsWith(path, "optimizer.")) CHECK_FALSE(c.optimizer == base.optimizer);
    if (absl::StartsWith(path, "aio.")) CHECK_FALSE(c.aio == base.aio);
  }
}

// The text of the docs/config.md section that starts with `heading`.
std::string DocSection(const std::string& heading) {
  const std::string doc = ReadFile("docs/config.md");
  size_t begin = doc.find("\n" + heading + "\n");
  REQUIRE(begin != std::string::npos);
  size_t end = doc.find("\n## ", begin + 1);
  return doc.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
}

// Whether `text` names `word` as a whole key (not as part of a longer one).
bool NamesKey(const std::string& text, absl::string_view key) {
  const std::string word(key);
  auto is_key_char = [](char ch) { return absl::ascii_isalnum(ch) || ch == '_'; };
  for (size_t at = text.find(word); at != std::string::npos; at = text.find(word, at + 1)) {
    const size_t end = at + word.size();
    const bool starts = at == 0 || !is_key_char(text[at - 1]);
    if (starts && (end == text.size() || !is_key_char(text[end]))) return true;
  }
  return false;
}

TEST_CASE("Config table: docs/config.md documents every row, settings in table order", "[zero]") {
  // The Settings table: exactly the settings, in the table's order, with the defaults they have.
  std::vector<std::string> documented_order;
  const std::string settings = DocSection("## Settings");
  for (absl::string_view line : absl::StrSplit(settings, '\n')) {
    if (!absl::ConsumePrefix(&line, "| `")) continue;
    documented_order.emplace_back(line.substr(0, line.find('`')));
  }
  std::vector<std::string> table_order;
  for (const KeyDef& k : ConfigKeys()) {
    if (k.role == Role::kSetting) table_order.push_back(k.path);
  }
  CHECK(documented_order == table_order);
  std::map<std::string, Json> resolved;
  Flatten(Json::parse(ResolvedConfigJson(Config{})), "", &resolved);
  std::map<std::string, Json> documented = DocumentedDefaults();
  for (const std::string& path : table_order) {
    INFO(path);
    CHECK(documented[path] == resolved[path]);
  }

  // Every other key, and every other spelling, in the section on DeepSpeed's keys.
  const std::string deepspeed = DocSection("## Every DeepSpeed key");
  for (const KeyDef& k : ConfigKeys()) {
    INFO(k.path);
    if (k.alias != nullptr) CHECK(NamesKey(ReadFile("docs/config.md"), k.alias));
    if (k.role == Role::kNoEffect) {
      CHECK(absl::StrContains(deepspeed, absl::StrCat("| `", k.path, "` | ")));
    } else if (k.role != Role::kSetting) {
      CHECK(NamesKey(deepspeed, config_internal::LeafName(k.path)));
    }
  }
  for (const config_internal::BlockAlias& a : config_internal::ConfigBlockAliases()) {
    CHECK(NamesKey(settings, a.alias));
  }
}

TEST_CASE("Config table: rows are unique and each block's rows are contiguous", "[zero]") {
  std::set<std::string> paths;
  std::set<std::string> left;   // blocks whose rows have ended
  std::set<std::string> inside;  // blocks the previous row lies in
  for (const KeyDef& k : ConfigKeys()) {
    INFO(k.path);
    CHECK(paths.insert(k.path).second);
    if (k.alias != nullptr) CHECK(paths.insert(Respelt(k, k.alias)).second);
    const bool has_member = !std::holds_alternative<std::monostate>(k.member);
    CHECK((has_member || k.custom != Custom::kNone || k.role == Role::kForeign));
    if (k.role == Role::kForeign || k.role == Role::kNoEffect) CHECK(k.why != nullptr);
    std::set<std::string> blocks;
    for (absl::string_view b = config_internal::ParentPath(k.path); !b.empty();
         b = config_internal::ParentPath(b)) {
      blocks.emplace(b);
      CHECK(left.count(std::string(b)) == 0);
    }
    for (const std::string& b : inside) {
      if (blocks.count(b) == 0) left.insert(b);
    }
    inside = blocks;
  }
}

}  // namespace
}  // namespace zerort

namespace zerort {
namespace {

TEST_CASE("Config: a scheduler with no valid type still has its params checked, in one error",
          "[zero]") {
  // An unknown key ("typ") and bad values under it: every one reported, each once, although
  // warmup_num_steps belongs to three schedules.
  absl::StatusOr<Config> c = ParseConfig(R"({"scheduler": {"typ": "WarmupLR", "params":
      {"warmup_num_steps": -1, "cos_min_ratio": -2, "warmup_num_stepz": 3,
       "last_batch_iteration": 5}}})",
                                         "ds.json");
  REQUIRE(!c.ok());
  INFO(c.status().message());
  std::vector<std::string> lines = absl::StrSplit(c.status().message(), '\n');
  CHECK(lines[0] == "ds.json: 5 problems:");
  for (const char* e : {
           "ds.json: scheduler.typ: unknown key; did you mean \"type\"?",
           "ds.json: scheduler.type: missing; expected one of WarmupLR",
           "ds.json: scheduler.params.warmup_num_stepz: unknown key; did you mean "
           "\"warmup_num_steps\"?",
           "ds.json: scheduler.params.warmup_num_steps: expected an integer >= 0 or \"auto\", "
           "got -1",
           "ds.json: scheduler.params.cos_min_ratio: expected a number >= 0, got -2",
       }) {
    INFO(e);
    CHECK(std::count_if(lines.begin(), lines.end(), [&](const std::string& l) {
            return absl::StartsWith(l, e);
          }) == 1);
  }
  // A misspelt schedule name, and a name that is not a string, the same.
  for (const char* type : {"\"WarmupLr\"", "5"}) {
    absl::Status s = ParseError(absl::StrCat(R"({"scheduler": {"type": )", type,
                                             R"(, "params": {"cycle_first_step_size": 0}}})"));
    INFO(s.message());
    CHECK(absl::StartsWith(s.message(), "<config>: 2 problems:\n<config>: scheduler.type: "));
    CHECK(absl::StrContains(s.message(), "scheduler.params.cycle_first_step_size: expected an "
                                         "integer >= 1, got 0"));
  }
  // Keys of no schedule at all are still unknown keys.
  CHECK(absl::StrContains(
      ParseError(R"({"scheduler": {"type": "x", "params": {"warmup_min": 0}}})").message(),
      "scheduler.params.warmup_min: unknown key; did you mean \"warmup_min_lr\"?"));
}

}  // namespace
}  // namespace zerort

namespace zerort {
namespace {

TEST_CASE("Config: keys of DeepSpeed's current release zerort has no use for are noted, not unknown",
          "[zero]") {
  Config c = MustParse(R"({"optimizer": {}, "gradient_clipping": 1.0, "zero_optimization": {"stage": 3,
      "zenflow": {"topk_ratio": 0.1}, "stage3_allgather_sequential": true,
      "leaf_module": {"classes": ["MoE"]}, "log_trace_cache_warnings": true,
      "enable_sanity_checks": true,
      "offload_optimizer": {"device": "cpu", "super_offload": true, "cpuadam_cores_perc": 0.8}}})");
  Config expected;
  expected.zero.stage = 3;
  expected.zero.offload_optimizer.device = OffloadDevice::kCpu;
  CHECK(c == expected);
  const std::vector<std::string> keys = {
      "zero_optimization.zenflow", "zero_optimization.stage3_allgather_sequential",
      "zero_optimization.leaf_module", "zero_optimization.log_trace_cache_warnings",
      "zero_optimization.enable_sanity_checks", "zero_optimization.offload_optimizer.super_offload",
      "zero_optimization.offload_optimizer.cpuadam_cores_perc"};
  REQUIRE(c.notes.size() == keys.size());
  for (const std::string& key : keys) {
    INFO(key);
    CHECK(std::count_if(c.notes.begin(), c.notes.end(), [&](const std::string& note) {
            return absl::StartsWith(note, key + ": DeepSpeed key accepted, no effect (");
          }) == 1);
  }
  // As with every key without effect, strict mode refuses them.
  CHECK(ParseError(R"({"zerort": {"strict": true}, "zero_optimization": {"zenflow": {}}})")
            .message()
            .find("zero_optimization.zenflow: DeepSpeed key accepted, no effect") !=
        std::string::npos);
}

}  // namespace
}  // namespace zerort

namespace zerort {
namespace {

TEST_CASE("Config: tensor_parallel and managed_gradient_accumulation are noted as DeepSpeed keys",
          "[zero]") {
  Config c = MustParse(R"({"optimizer": {}, "gradient_clipping": 1.0, "tensor_parallel": {"autotp_size": 2},
      "managed_gradient_accumulation": true})");
  CHECK(c == Config{});
  REQUIRE(c.notes.size() == 2);
  CHECK(absl::StartsWith(c.notes[0], "tensor_parallel: DeepSpeed key accepted, no effect (zerort "
                                     "has no tensor parallelism"));
  CHECK(absl::StartsWith(c.notes[1], "managed_gradient_accumulation: DeepSpeed key accepted, no "
                                     "effect (zerort manages accumulation itself"));
  for (const std::string& note : c.notes) {
    CHECK_FALSE(absl::StrContains(note, "not a zerort or DeepSpeed setting"));
  }
}

}  // namespace
}  // namespace zerort

namespace zerort {
namespace {

TEST_CASE("Config: DeepSpeed's current defaults: clipping at 1.0, pinned memory, with a note",
          "[zero]") {
  // DeepSpeed v0.19.3 moved gradient_clipping's default from 0 to 1.0; pin_memory is true in
  // both offload models (deepspeed/runtime/constants.py, zero/offload_config.py).
  Config c = MustParse(R"({"optimizer": {}, "zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}})");
  CHECK(c.gradient_clipping == 1.0);
  CHECK(c.zero.offload_optimizer.pin_memory);
  CHECK(c.zero.offload_param.pin_memory);
  REQUIRE(c.notes.size() == 1);
  CHECK(absl::StartsWith(c.notes[0], "gradient_clipping: absent, so 1.0 (DeepSpeed's default "
                                     "since v0.19.3; zerort before used 0, no clipping)"));
  // Written, the value is the user's and there is nothing to say.
  Config off = MustParse(R"({"optimizer": {}, "gradient_clipping": 0})");
  CHECK(off.gradient_clipping == 0);
  CHECK(off.notes.empty());
  // The note is a remark, not an ignored key: strict mode accepts it.
  CHECK(ParseConfig(R"({"optimizer": {}})", "<config>", ParseOptions{true}).ok());
}

TEST_CASE("Config: every value DeepSpeed's models accept with ge=0 is accepted", "[zero]") {
  // deepspeed/runtime/zero/config.py and offload_config.py: Field(..., ge=0) on each of these.
  Config c = MustParse(R"({"optimizer": {}, "gradient_clipping": 1.0, "zero_optimization": {
      "stage": 3, "reduce_bucket_size": 0, "allgather_bucket_size": 0,
      "stage3_max_live_parameters": 0,
      "offload_optimizer": {"device": "cpu", "buffer_count": 0},
      "offload_param": {"device": "cpu", "buffer_count": 0, "buffer_size": 0}}})");
  CHECK(c.zero.reduce_bucket_size == 0);
  CHECK(c.zero.stage3_max_live_parameters == 0);
  CHECK(c.zero.offload_optimizer.buffer_count == 0);
  CHECK(c.zero.offload_param.buffer_count == 0);
  CHECK(c.zero.offload_param.buffer_size == 0);
  // Below DeepSpeed's bound is still refused, naming the key and the bound.
  absl::Status s = ParseError(R"({"zero_optimization": {"reduce_bucket_size": -1}})");
  CHECK(absl::StrContains(s.message(),
                          "zero_optimization.reduce_bucket_size: expected an integer >= 0"));
}

TEST_CASE("Config: bf16.check_grad_overflow is noted as always on, with the reason", "[zero]") {
  for (const char* value : {"true", "false"}) {
    INFO(value);
    Config c = MustParse(absl::StrCat(R"({"optimizer": {}, "gradient_clipping": 1.0,
        "bf16": {"enabled": true, "check_grad_overflow": )",
                                      value, "}}"));
    REQUIRE(c.notes.size() == 1);
    CHECK(absl::StartsWith(c.notes[0], "bf16.check_grad_overflow: DeepSpeed key accepted, no "
                                       "effect (a step with a non-finite gradient is always "
                                       "skipped, in every dtype"));
  }
}

// Writes `text` into the write end of a pipe from another thread (a pipe holds only 64 KiB).
std::thread WriteAll(int fd, std::string text) {
  return std::thread([fd, text = std::move(text)] {
    size_t done = 0;
    while (done < text.size()) {
      const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
      if (n <= 0) break;  // the reader stopped (EPIPE): over the cap
      done += static_cast<size_t>(n);
    }
    ::close(fd);
  });
}

TEST_CASE("Config: \"-\" reads standard input and a FIFO is read to its end, within 16 MiB",
          "[zero]") {
  std::signal(SIGPIPE, SIG_IGN);  // a refused oversized write must fail, not kill the test
  const std::string config = R"({"optimizer": {}, "gradient_clipping": 0.5})";
  // Standard input.
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  const int saved = ::dup(STDIN_FILENO);
  REQUIRE(::dup2(fds[0], STDIN_FILENO) == STDIN_FILENO);
  ::close(fds[0]);
  std::thread writer = WriteAll(fds[1], config);
  absl::StatusOr<Config> from_stdin = LoadConfigFile("-");
  writer.join();
  REQUIRE(::dup2(saved, STDIN_FILENO) == STDIN_FILENO);
  ::close(saved);
  INFO(from_stdin.status().ToString());
  REQUIRE(from_stdin.ok());
  CHECK(from_stdin->gradient_clipping == 0.5);

  // A FIFO, as a shell's process substitution gives one; errors name it.
  const std::string fifo = testing::TempDir("config_fifo_") + "/config.fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  std::thread fifo_writer([&] { WriteAll(::open(fifo.c_str(), O_WRONLY), config).join(); });
  absl::StatusOr<Config> from_fifo = LoadConfigFile(fifo);
  fifo_writer.join();
  REQUIRE(from_fifo.ok());
  CHECK(from_fifo->gradient_clipping == 0.5);

  // A FIFO nobody writes is refused after the idle limit, not waited on forever.
  absl::StatusOr<Config> unwritten = LoadConfigFile(fifo);
  REQUIRE_FALSE(unwritten.ok());
  CHECK(unwritten.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(absl::StrContains(unwritten.status().message(), "config.fifo\": no data for 10 s"));

  // One byte over the cap is refused without reading the rest.
  std::thread big([&] {
    WriteAll(::open(fifo.c_str(), O_WRONLY), std::string((16 << 20) + 1, ' ')).join();
  });
  absl::StatusOr<Config> too_big = LoadConfigFile(fifo);
  big.join();
  REQUIRE_FALSE(too_big.ok());
  CHECK(too_big.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(too_big.status().message(), "config.fifo\": larger than the limit of "
                                                      "16777216 bytes"));
}

}  // namespace
}  // namespace zerort

namespace zerort {
namespace {

TEST_CASE("Config: prescale_gradients and gradient_predivide_factor are settings, as in DeepSpeed",
          "[zero]") {
  Config c = MustParse(R"({"optimizer": {}, "gradient_clipping": 1.0,
      "prescale_gradients": true, "gradient_predivide_factor": 4})");
  CHECK(c.prescale_gradients);
  CHECK(c.gradient_predivide_factor == 4);
  CHECK(c.notes.empty());
  CHECK(c != Config{});
  // A factor of 0 would divide by zero.
  CHECK(absl::StrContains(ParseError(R"({"gradient_predivide_factor": 0})").message(),
                          "gradient_predivide_factor: expected a number > 0, got 0"));
}

}  // namespace
}  // namespace zerort
