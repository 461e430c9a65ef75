#include "cli/cli.h"

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/status/status.h"
#include "base/testing/temp_dir.h"
#include "nlohmann/json.hpp"

namespace zerort {
namespace {

TEST_CASE("CLI: zerort plan prints the plan as JSON with the documented fields", "[zero]") {
  std::ostringstream out;
  auto status = RunPlanCommand(
      {"--model", "llama2-7b", "--world", "8", "--stage", "3", "--offload", "optimizer", "--json"},
      out);
  REQUIRE(status.ok());
  auto j = nlohmann::json::parse(out.str());
  CHECK(j["params"] == 6738415616LL);
  CHECK(j["world_size"] == 8);
  CHECK(j["stage"] == 3);
  CHECK(j["per_rank"]["pinned_host_bytes"].get<int64_t>() > 0);
  CHECK(j["per_rank"]["model_state_bytes"].get<int64_t>() > 0);
  CHECK(j["comm_bytes_per_step"].get<int64_t>() > 0);
  CHECK(j["buffers"].size() >= 5);

  std::ostringstream err;
  auto unknown = RunPlanCommand({"--model", "gpt2-124m", "--wrld", "8"}, err);
  REQUIRE_FALSE(unknown.ok());
  CHECK_THAT(std::string(unknown.message()), Catch::Contains("--wrld"));
  auto bad_stage = RunPlanCommand({"--params", "1000", "--stage", "5"}, err);
  REQUIRE_FALSE(bad_stage.ok());
  CHECK_THAT(std::string(bad_stage.message()), Catch::Contains("--stage '5'"));
}

TEST_CASE("CLI: zerort plan --offload-ratio splits the optimizer state and says how", "[zero]") {
  auto plan = [](const std::string& ratio) {
    std::ostringstream out;
    const absl::Status s =
        RunPlanCommand({"--model", "llama2-7b", "--world", "8", "--stage", "2", "--offload",
                        "optimizer", "--offload-ratio", ratio, "--json"},
                       out);
    REQUIRE(s.ok());
    return nlohmann::json::parse(out.str());
  };
  const nlohmann::json full = plan("1"), half = plan("0.5"), none = plan("0");
  const int64_t full_device = full["per_rank"]["device_bytes"].get<int64_t>();
  const int64_t half_device = half["per_rank"]["device_bytes"].get<int64_t>();
  const int64_t none_device = none["per_rank"]["device_bytes"].get<int64_t>();
  CHECK(full_device < half_device);
  CHECK(half_device < none_device);
  const nlohmann::json& split = half["optimizer_offload"];
  CHECK(split["ratio"] == 0.5);
  CHECK(split["ratio_achieved"].get<double>() >= 0.5);
  CHECK(split["device_units"].get<int>() > 0);
  CHECK(split["offloaded_units"].get<int>() > 0);
  // What the device holds more than at full offload is the kept part (bf16: master, m, v and
  // the 2-byte gradient shard, 14 bytes an element) less gradient offload's working buffers.
  const int64_t kept = split["device_elements"].get<int64_t>();
  CHECK(split["device_bytes"].get<int64_t>() == 14 * kept);
  CHECK(split["offloaded_bytes"].get<int64_t>() == 14 * split["offloaded_elements"].get<int64_t>());
  CHECK(half_device - full_device == 14 * kept);
  CHECK(full["optimizer_offload"]["device_elements"] == 0);
  CHECK(none["optimizer_offload"]["offloaded_elements"] == 0);
  // The table says it too.
  std::ostringstream text;
  REQUIRE(RunPlanCommand({"--model", "llama2-7b", "--world", "8", "--stage", "2", "--offload",
                          "optimizer", "--offload-ratio", "0.5"},
                         text)
              .ok());
  CHECK_THAT(text.str(), Catch::Contains("optimizer state: "));
  CHECK_THAT(text.str(), Catch::Contains("% offloaded (offload_optimizer.ratio 0.5)"));
  CHECK_THAT(text.str(), Catch::Contains("exp_avg_device"));
  // Refused, naming the flag and the value.
  std::ostringstream err;
  for (const char* bad : {"1.5", "-0.1", "half", "nan"}) {
    auto refused = RunPlanCommand({"--model", "gpt2-124m", "--stage", "2", "--offload",
                                   "optimizer", "--offload-ratio", bad},
                                  err);
    REQUIRE_FALSE(refused.ok());
    CHECK_THAT(std::string(refused.message()),
               Catch::Contains(std::string("--offload-ratio '") + bad + "'"));
  }
  auto without = RunPlanCommand({"--model", "gpt2-124m", "--stage", "2", "--offload-ratio", "0.5"},
                                err);
  REQUIRE_FALSE(without.ok());
  CHECK_THAT(std::string(without.message()), Catch::Contains("--offload optimizer"));
}

TEST_CASE("CLI: zerort plan --offload nvme and nvme-all plan files without a path", "[zero]") {
  // Planning creates no files, so the flags need no nvme_path; the JSON names the nvme bytes.
  auto plan = [](const std::string& stage, const std::string& offload) {
    std::ostringstream out;
    const absl::Status s = RunPlanCommand({"--model", "gpt2-124m", "--world", "4", "--stage",
                                           stage, "--offload", offload, "--json"},
                                          out);
    REQUIRE(s.ok());
    return nlohmann::json::parse(out.str());
  };
  auto nvme_sum = [](const nlohmann::json& j, const std::string& name) {
    int64_t sum = 0;
    for (const auto& b : j["buffers"]) {
      if (b["kind"] == "nvme" && (name.empty() || b["name"] == name)) {
        sum += b["bytes"].get<int64_t>();
      }
    }
    return sum;
  };
  const nlohmann::json state = plan("3", "nvme"), all = plan("3", "nvme-all");
  const int64_t s = state["per_rank"]["shard_elements"].get<int64_t>();
  const int64_t units = state["units"].get<int64_t>();
  const int64_t state_bytes = state["per_rank"]["nvme_bytes"].get<int64_t>();
  // Two copies of master, m and v (fp32), each array padded to 4 KiB per unit.
  CHECK(state_bytes == nvme_sum(state, ""));
  CHECK(state_bytes >= 2 * 12 * s);
  CHECK(state_bytes < 2 * 12 * s + 2 * 3 * 4096 * units);
  CHECK(nvme_sum(state, "param_shard") == 0);
  // nvme-all adds the bf16 parameter shard (and its padding) and nothing else on disk.
  const int64_t all_bytes = all["per_rank"]["nvme_bytes"].get<int64_t>();
  CHECK(nvme_sum(all, "param_shard") == 2 * s);
  CHECK(all_bytes ==
        state_bytes + nvme_sum(all, "param_shard") + nvme_sum(all, "nvme_param_padding"));
  CHECK(plan("2", "optimizer")["per_rank"]["nvme_bytes"] == 0);

  std::ostringstream err;
  auto stage2 =
      RunPlanCommand({"--model", "gpt2-124m", "--stage", "2", "--offload", "nvme-all"}, err);
  REQUIRE_FALSE(stage2.ok());
  CHECK_THAT(std::string(stage2.message()), Catch::Contains("offload_param"));
  CHECK_THAT(std::string(stage2.message()), Catch::Contains("stage 3"));
  auto bogus = RunPlanCommand({"--model", "gpt2-124m", "--offload", "disk"}, err);
  REQUIRE_FALSE(bogus.ok());
  CHECK_THAT(std::string(bogus.message()), Catch::Contains("--offload 'disk'"));
  CHECK_THAT(std::string(bogus.message()), Catch::Contains("nvme-all"));
}

TEST_CASE("CLI: zerort plan prints the config's notes, as text and as a JSON array", "[zero]") {
  const std::string path = testing::TestTmpDir() + "/notes.json";
  std::ofstream(path) << R"({"zero_optimization": {"stage": 2, "overlap_comm": false,
      "allgather_bucket_size": 2e8}, "train_batch_size": 32})";

  std::ostringstream text;
  REQUIRE(RunPlanCommand({"--model", "gpt2-124m", "--world", "2", "--config", path}, text).ok());
  CHECK_THAT(text.str(), Catch::Contains("note: zero_optimization.overlap_comm: false has no "
                                         "effect, overlap cannot be turned off: "));
  CHECK_THAT(text.str(), Catch::Contains("note: zero_optimization.allgather_bucket_size: "
                                         "accepted, no effect: "));
  CHECK_THAT(text.str(), Catch::Contains("note: train_batch_size: "));

  std::ostringstream json;
  REQUIRE(RunPlanCommand({"--model", "gpt2-124m", "--world", "2", "--config", path, "--json"},
                         json)
              .ok());
  auto j = nlohmann::json::parse(json.str());
  // The three keys', the optimizer the config does not name, and the clipping default.
  REQUIRE(j["notes"].size() == 5);
  CHECK_THAT(j["notes"][0].get<std::string>(),
             Catch::StartsWith("zero_optimization.overlap_comm: false has no effect"));
  CHECK_THAT(j["notes"][2].get<std::string>(), Catch::StartsWith("optimizer: absent; "));

  // Without a config there is nothing to note; the array is still there.
  std::ostringstream plain;
  REQUIRE(RunPlanCommand({"--params", "1000", "--json"}, plain).ok());
  CHECK(nlohmann::json::parse(plain.str())["notes"] == nlohmann::json::array());
}

std::string TempPath(const std::string& name) {
  return testing::TestTmpDir() + "/" + name;
}

// RunPlanCommand's refusal; the test fails if the command succeeds or the message lacks `needle`.
std::string Refusal(const std::vector<std::string>& args, const std::string& needle) {
  std::ostringstream out;
  absl::Status status = RunPlanCommand(args, out);
  INFO(out.str());
  REQUIRE_FALSE(status.ok());
  CHECK(status.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(status.message()), Catch::Contains(needle));
  return std::string(status.message());
}

TEST_CASE("CLI: zerort plan fills \"auto\" values and shows each; --strict refuses ignored keys",
          "[zero]") {
  const std::string path = TempPath("auto.json");
  std::ofstream(path) << R"({"bf16": {"enabled": "auto"}, "gradient_accumulation_steps": "auto",
      "train_batch_size": 64, "train_micro_batch_size_per_gpu": 4,
      "optimizer": {"params": {"lr": "auto"}}, "wall_clock_breakdown": false,
      "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
      "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}})";
  std::ostringstream text;
  REQUIRE(RunPlanCommand({"--model", "gpt2-124m", "--world", "4", "--config", path, "--fill",
                          R"({"lr": 6e-4, "total_num_steps": 5000, "hidden_size": 1024})"},
                         text)
              .ok());
  for (const char* line :
       {"note: optimizer.params.lr: auto -> 0.0006 (from the trainer)",
        "note: bf16.enabled: auto -> true (the trainer computes in bf16)",
        "note: gradient_accumulation_steps: auto -> 4 (train_batch_size / "
        "(train_micro_batch_size_per_gpu * world size))",
        "note: scheduler.params.total_num_steps: auto -> 5000 (from the trainer)",
        "note: zero_optimization.reduce_bucket_size: auto -> one unit per module (the largest "
        "39383808 elements)"}) {
    CHECK_THAT(text.str(), Catch::Contains(line));
  }
  CHECK_THAT(text.str(), Catch::Contains(", bf16"));  // the plan computes in bf16

  std::ostringstream json;
  REQUIRE(RunPlanCommand({"--model", "gpt2-124m", "--world", "4", "--config", path, "--json",
                          "--fill", R"({"total_num_steps": 10})"},
                         json)
              .ok());
  auto j = nlohmann::json::parse(json.str());
  CHECK(j["auto_resolved"].size() == 4);  // bf16, lr, gradient_accumulation_steps, total_num_steps

  // Without total_num_steps nothing fills it, but the plan does not depend on it: noted, and the
  // plan is made. A batch size that cannot match the world size changes the plan: refused.
  std::ostringstream unfilled;
  absl::Status planned = RunPlanCommand({"--model", "gpt2-124m", "--world", "4", "--config", path},
                                        unfilled);
  INFO(planned.ToString());
  REQUIRE(planned.ok());
  CHECK_THAT(unfilled.str(),
             Catch::Contains("note: scheduler.params.total_num_steps: \"auto\", but the trainer "
                             "gave no total_num_steps; a decaying schedule needs it (not needed "
                             "for a plan; Engine creation refuses it)"));
  CHECK_THAT(unfilled.str(), Catch::Contains(", bf16"));  // the plan table follows
  Refusal({"--model", "gpt2-124m", "--world", "3", "--config", path, "--fill",
           R"({"total_num_steps": 10})"},
          "train_batch_size 64 != train_micro_batch_size_per_gpu 4 * gradient_accumulation_steps 1 "
          "* world size 3 = 12");
  Refusal({"--model", "gpt2-124m", "--config", path, "--strict", "--fill",
           R"({"total_num_steps": 10})"},
          "wall_clock_breakdown: DeepSpeed key accepted, no effect");
  Refusal({"--model", "gpt2-124m", "--fill", R"({"hidden": 4})"}, "hidden");
}

TEST_CASE("CLI: sizes past int64 are refused naming the quantity, never printed negative",
          "[zero]") {
  // Used to print "-2173.15 PiB", and --stage auto then called it a fit for 1 GiB.
  Refusal({"--params", "1e18", "--layers", "1000"}, "the plan's ");
  Refusal({"--params", "1e18", "--layers", "1000", "--stage", "auto", "--budget", "1GiB"},
          "exceeds 2^63-1");
  // Used to abort with std::bad_alloc building two billion layers.
  Refusal({"--params", "2e9", "--layers", "2e9"},
          "flag '--layers' value '2e9' must be an integer in 1..4096");
  // Used to be truncated to 32 bits: world 4294967297 planned as world 1.
  Refusal({"--params", "1000", "--world", "4294967297"},
          "flag '--world' value '4294967297' must be an integer in 1..2147483647");
  Refusal({"--params", "1000", "--world", "2", "--rank", "4294967296"}, "flag '--rank'");
  // 2^63 and beyond: refused as a value, not cast (undefined behaviour).
  for (const char* v : {"9223372036854775808", "9.3e18", "1e300", "nan", "inf", "-1", "1.5"}) {
    Refusal({"--params", v}, std::string("flag '--params' value '") + v + "'");
  }
  // 2^63-1 parameters is a valid count but a tensor of more than 2^50 elements is not.
  Refusal({"--params", "9223372036854775807", "--layers", "1"}, "more than 2^50 elements");
  std::ostringstream out;
  REQUIRE(RunPlanCommand({"--params", "1125899906842624", "--layers", "1", "--json"}, out).ok());
  CHECK(nlohmann::json::parse(out.str())["params"] == 1125899906842624LL);  // 2^50
}

TEST_CASE("CLI: a model file summing past 2^63 elements is refused", "[zero]") {
  // 8193 parameters of 2^50 elements: each is legal, their sum is not (it printed negative).
  nlohmann::json modules = nlohmann::json::array();
  for (int i = 0; i < 8193; ++i) {
    modules.push_back({{"name", "m" + std::to_string(i)},
                       {"params", {{{"name", "w"}, {"shape", {int64_t{1} << 50}}}}}});
  }
  const std::string path = TempPath("huge_model.json");
  std::ofstream(path) << nlohmann::json{{"modules", modules}}.dump();
  Refusal({"--model", path}, "the plan's parameter count exceeds 2^63-1");
}

TEST_CASE("CLI: zerort plan says which declared trainer gradients are reduced in place, which "
          "are copied and why",
          "[zero]") {
  // llm.c's 16 tensors, each a module, packed in one buffer of the trainer's (model-file keys).
  const std::vector<std::pair<std::string, std::vector<int64_t>>> tensors = {
      {"wte", {50304, 128}}, {"wpe", {64, 128}}, {"h", {4, 12 * 128 * 128 + 13 * 128}},
      {"lnfw", {128}},       {"lnfb", {128}}};
  nlohmann::json modules = nlohmann::json::array();
  for (const auto& [name, shape] : tensors) {
    modules.push_back({{"name", name},
                       {"params", {{{"name", "t"}, {"shape", shape}, {"grad_buffer", "grads"}}}}});
  }
  const std::string path = TempPath("llmc_declared.json");
  std::ofstream(path) << nlohmann::json{{"modules", modules}}.dump();
  std::ostringstream json;
  REQUIRE(RunPlanCommand({"--model", path, "--world", "2", "--stage", "2", "--precision", "fp32",
                          "--json"},
                         json)
              .ok());
  const auto h = nlohmann::json::parse(json.str())["grad_handoff"];
  CHECK(h["buffers"] == nlohmann::json::array({"grads"}));
  CHECK(h["tensors"] == 5);
  CHECK(h["tensors_in_place"] == 4);
  CHECK(h["bytes_copied"] == 128 * 4);
  REQUIRE(h["copied"].size() == 1);
  CHECK(h["copied"][0]["tensor"] == "lnfb.t");
  CHECK_THAT(h["copied"][0]["reason"].get<std::string>(),
             Catch::Contains("would run past the last gradient declared in 'grads'"));
  CHECK(h["engine_grad_bytes"].get<int64_t>() < h["engine_grad_bytes_undeclared"].get<int64_t>());
  // The text says the same; --grad-buffer declares a preset's parameters, packed.
  std::ostringstream text;
  REQUIRE(RunPlanCommand({"--model", path, "--world", "2", "--stage", "2"}, text).ok());
  CHECK_THAT(text.str(), Catch::Contains("gradients in the trainer's buffers (grad_buffer grads): "
                                         "5 tensors") &&
                             Catch::Contains("copied: 'lnfb.t' (unit 'lnfb'):"));
  std::ostringstream preset;
  REQUIRE(RunPlanCommand({"--model", "gpt2-124m", "--world", "8", "--stage", "1", "--json",
                          "--grad-buffer", "g"},
                         preset)
              .ok());
  const auto p = nlohmann::json::parse(preset.str())["grad_handoff"];
  CHECK(p["tensors"] == 148);
  CHECK(p["tensors_in_place"] == 146);
  std::ostringstream none;
  REQUIRE(RunPlanCommand({"--model", "gpt2-124m", "--json"}, none).ok());
  CHECK(nlohmann::json::parse(none.str())["grad_handoff"]["tensors"] == 0);
}

TEST_CASE("CLI: config values at the int limits plan exactly or are refused", "[zero]") {
  const std::string gas = TempPath("gas.json");
  std::ofstream(gas) << R"({"gradient_accumulation_steps": 2147483647})";
  // Used to print negative communication bytes.
  Refusal({"--params", "1e12", "--world", "8", "--config", gas},
          "the plan's communication bytes per step exceeds 2^63-1");
  std::ostringstream small;
  REQUIRE(RunPlanCommand({"--params", "1024", "--layers", "1", "--world", "2", "--config", gas,
                          "--json"},
                         small)
              .ok());
  // fp32 (the config has no bf16 block) all-reduce of 1024 elements: 2 passes of 512 elements
  // sent, 2147483647 micro-steps; once per step the control exchange, stage 0: AgreeBeforeUpdate's
  // six 64-bit words to the other rank.
  const nlohmann::json planned = nlohmann::json::parse(small.str());
  CHECK(planned["comm_control_bytes_per_step"] == 6 * 8);
  CHECK(planned["comm_bytes_per_step"] == int64_t{2147483647} * 2 * 512 * 4 + 6 * 8);

  const std::string prefetch = TempPath("prefetch.json");
  std::ofstream(prefetch) << R"({"zero_optimization": {"stage": 3,
      "stage3_prefetch_bucket_size": 9223372036854775807, "reduce_bucket_size": 1000,
      "stage3_param_persistence_threshold": 0}})";
  std::ostringstream out;
  REQUIRE(RunPlanCommand({"--params", "6000", "--layers", "6", "--world", "2", "--config",
                          prefetch, "--json"},
                         out)
              .ok());
  // Six 1000-element units, all within max_live_parameters: all six slots (it planned 1).
  auto j = nlohmann::json::parse(out.str());
  bool found = false;
  for (const auto& b : j["buffers"]) {
    if (b["name"] != "gather_buffer") continue;
    found = true;
    CHECK(b["slots"] == 6);
    CHECK(b["elements"] == 6 * 1024);  // each unit padded to 2 ranks * 128 * 4
  }
  CHECK(found);
}

TEST_CASE("CLI: --budget reads SIZE or device=SIZE,host=SIZE strictly", "[zero]") {
  std::ostringstream out;
  REQUIRE(RunPlanCommand({"--params", "1000", "--budget", "1e-3GiB", "--json"}, out).ok());
  CHECK_THAT(nlohmann::json::parse(out.str())["reason"].get<std::string>(),
             Catch::Contains("within the budget of 1.02 MiB device"));  // 1073742 bytes
  out.str("");
  REQUIRE(RunPlanCommand({"--params", "1000", "--budget", "host=2GiB,device=1GiB"}, out).ok());
  CHECK_THAT(out.str(), Catch::Contains("budget of 1.00 GiB device, 2.00 GiB host"));
  Refusal({"--params", "1000", "--budget", "device=1GiB=junk"},
          "--budget: cannot read part 'device=1GiB=junk'");
  Refusal({"--params", "1000", "--budget", "device=1GiB,device=2GiB"},
          "--budget: 'device' is given twice");
  Refusal({"--params", "1000", "--budget", "1GiB,host=1GiB"}, "--budget: cannot read part '1GiB'");
  Refusal({"--params", "1000", "--budget", "gpu=1GiB"}, "--budget: unknown part 'gpu'");
  Refusal({"--params", "1000", "--budget", "device="}, "--budget");
  Refusal({"--params", "1000", "--budget", "0.3"}, "rounds to 0 bytes");
}

TEST_CASE("CLI: config files that are not JSON text are refused by name", "[zero]") {
  // A device: refused before reading (it used to be read without bound).
  Refusal({"--model", "gpt2-124m", "--config", "/dev/zero"},
          "cannot read config file \"/dev/zero\": not a regular file");
  // Bytes after a NUL are not ignored: the NUL itself is the error, with its position.
  const std::string nul = TempPath("nul.json");
  std::ofstream(nul) << std::string("{\"bf16\": {\"enabled\": true}}\0{\"fp16\": 1}", 40);
  Refusal({"--params", "1000", "--config", nul}, nul + ":1:28: not valid JSON: a NUL byte");
}

TEST_CASE("CLI: --help after a command asks for that command's usage", "[zero]") {
  CHECK(WantsHelp({"--model", "x", "--help"}));
  CHECK(WantsHelp({"-h"}));
  CHECK_FALSE(WantsHelp({"--model", "help"}));
  CHECK_THAT(CommandUsage("plan"), Catch::StartsWith("usage: zerort plan [flags]"));
  CHECK_THAT(CommandUsage("plan"), Catch::Contains("--budget SIZE"));
  CHECK_THAT(CommandUsage("ckpt"), Catch::Contains("consolidate DIR OUT"));
  CHECK(CommandUsage("nope").empty());
  // Every section is in the full usage.
  for (const char* c : {"plan", "demo", "ckpt"}) {
    const std::string section = CommandUsage(c).substr(CommandUsage(c).find("\n\n") + 2);
    CHECK_THAT(Usage(), Catch::Contains(section));
  }
}

}  // namespace
}  // namespace zerort

namespace zerort {
namespace {

const std::vector<std::string> kLlamaExample = {"--model", "llama2-7b", "--world", "8",
                                                "--stage", "auto", "--budget", "device=40GiB"};

std::vector<std::string> With(std::vector<std::string> args, std::vector<std::string> more) {
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

TEST_CASE("CLI: zerort plan --seq counts activations and reserves and says which term decided",
          "[zero]") {
  // Without --seq: the old choice, and a note, not silence.
  std::ostringstream old;
  REQUIRE(RunPlanCommand(kLlamaExample, old).ok());
  CHECK_THAT(old.str(), Catch::Contains("auto chose stage 1"));
  CHECK_THAT(old.str(), Catch::Contains("note: activations and runtime reserves were not counted"));
  CHECK_THAT(old.str(), Catch::Contains("pass --seq and --micro-batch"));

  std::ostringstream text;
  REQUIRE(RunPlanCommand(With(kLlamaExample, {"--seq", "4096", "--micro-batch", "1",
                                              "--recompute", "selective"}),
                         text)
              .ok());
  INFO(text.str());
  for (const char* s : {"device budget per rank:", "model-state buffers", "logits gradient",
                        "cuda context", "nccl communicator", "fragmentation",
                        "Korthikanti et al. 2022 (sequence 4096, micro-batch 1, recompute selective",
                        "; activations decided", "stage 1 needs"}) {
    CHECK_THAT(text.str(), Catch::Contains(s));
  }
  CHECK_THAT(text.str(), !Catch::Contains("auto chose stage 1"));

  std::ostringstream json;
  REQUIRE(RunPlanCommand(With(kLlamaExample, {"--seq", "4096", "--recompute", "selective",
                                              "--json"}),
                         json)
              .ok());
  auto j = nlohmann::json::parse(json.str());
  CHECK(j["decided_by"] == "activations");
  CHECK(j["stage"].get<int>() >= 2);
  const auto& d = j["device_budget"];
  CHECK(d["counted"] == true);
  CHECK(d["micro_batch"] == 1);
  int64_t activations = 0, reserves = 0;
  for (const auto& [name, bytes] : d["activations"].items()) activations += bytes.get<int64_t>();
  for (const auto& [name, bytes] : d["reserves"].items()) reserves += bytes.get<int64_t>();
  CHECK(activations == d["activation_bytes"].get<int64_t>());
  CHECK(reserves == d["reserve_bytes"].get<int64_t>());
  CHECK(d["model_state_bytes"].get<int64_t>() == j["per_rank"]["device_bytes"].get<int64_t>());
  CHECK(d["total_bytes"].get<int64_t>() ==
        d["model_state_bytes"].get<int64_t>() + activations + reserves);
  CHECK(d["total_bytes"].get<int64_t>() <= 40LL << 30);
}

TEST_CASE("CLI: zerort plan --fit micro-batch prints the largest micro-batch per candidate",
          "[zero]") {
  std::ostringstream text;
  REQUIRE(RunPlanCommand(With(kLlamaExample, {"--seq", "4096", "--recompute", "selective",
                                              "--fit", "micro-batch"}),
                         text)
              .ok());
  INFO(text.str());
  CHECK_THAT(text.str(), Catch::Contains("largest micro-batch within 40.00 GiB"));
  CHECK_THAT(text.str(), Catch::Contains("  stage 0: none (model state decided: "));
  CHECK_THAT(text.str(), Catch::Contains("  stage 3 + optimizer and parameter offload: "));

  std::ostringstream json;
  REQUIRE(RunPlanCommand(With(kLlamaExample, {"--seq", "4096", "--recompute", "selective",
                                              "--fit", "micro-batch", "--json"}),
                         json)
              .ok());
  auto j = nlohmann::json::parse(json.str());
  REQUIRE(j.size() == 8);  // stages 0-3, optimizer offload at 1-3, both at 3
  CHECK(j[0]["micro_batch"] == 0);
  // Each positive answer fits and the next micro-batch does not: ask the plan itself.
  for (const auto& f : j) {
    const int64_t b = f["micro_batch"].get<int64_t>();
    if (b == 0) continue;
    std::vector<std::string> args = {"--model", "llama2-7b", "--world", "8", "--stage",
                                     std::to_string(f["stage"].get<int>()), "--budget",
                                     "device=40GiB", "--seq", "4096", "--recompute", "selective",
                                     "--json"};
    if (f["offload_optimizer"] == true) {
      args = With(args, {"--offload", f["offload_param"] == true ? "all" : "optimizer"});
    }
    for (int64_t mb : {b, b + 1}) {
      std::ostringstream one;
      REQUIRE(RunPlanCommand(With(args, {"--micro-batch", std::to_string(mb)}), one).ok());
      CHECK(nlohmann::json::parse(one.str())["fits_budget"] == (mb == b));
    }
  }
}

TEST_CASE("CLI: activation flags are refused where they cannot apply", "[zero]") {
  Refusal({"--params", "1000", "--seq", "128"}, "--seq needs a --model preset");
  Refusal({"--model", "gpt2-124m", "--recompute", "full"}, "--recompute applies");
  Refusal({"--model", "gpt2-124m", "--seq", "128", "--recompute", "partial"},
          "recompute level 'partial'");
  Refusal({"--model", "gpt2-124m", "--seq", "0"}, "--seq");
  Refusal({"--model", "gpt2-124m", "--seq", "128", "--fit", "batch", "--budget", "8GiB"},
          "--fit 'batch': expected micro-batch");
  Refusal({"--model", "gpt2-124m", "--seq", "128", "--fit", "micro-batch"}, "--budget");
  Refusal({"--model", "gpt2-124m", "--fit", "micro-batch", "--budget", "8GiB"},
          "needs activations");
}

}  // namespace
}  // namespace zerort

namespace zerort {
namespace {

TEST_CASE("CLI: --config - reads the config from standard input", "[zero]") {
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  const std::string config = R"({"zero_optimization": {"stage": 2}, "gradient_clipping": 0})";
  REQUIRE(::write(fds[1], config.data(), config.size()) == static_cast<ssize_t>(config.size()));
  ::close(fds[1]);
  const int saved = ::dup(STDIN_FILENO);
  REQUIRE(::dup2(fds[0], STDIN_FILENO) == STDIN_FILENO);
  ::close(fds[0]);
  std::ostringstream out;
  absl::Status s = RunPlanCommand({"--params", "1000", "--config", "-", "--resolved-config"}, out);
  REQUIRE(::dup2(saved, STDIN_FILENO) == STDIN_FILENO);
  ::close(saved);
  INFO(s.ToString());
  REQUIRE(s.ok());
  auto j = nlohmann::json::parse(out.str());
  CHECK(j["zero_optimization"]["stage"] == 2);
  CHECK(j["gradient_clipping"] == 0);
}

}  // namespace
}  // namespace zerort
