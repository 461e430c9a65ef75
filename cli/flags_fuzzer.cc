// libFuzzer entry point for the flag parser and `zerort plan` behind it (tools/fuzz.sh runs it;
// tests/fuzz/flags/ seeds it, one argument per line, and flags_fuzzer_corpus_test replays that
// folder in every build). Files are left out (an argument with '/' or ".json", or --config, ends
// the input): the config and model parsers have their own fuzzers. Beyond not crashing: every
// integer GetInt returns is in its range, and a successful plan prints no negative number.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "cli/cli.h"
#include "cli/flags.h"
#include "nlohmann/json.hpp"

namespace {

// Keys whose DeepSpeed spelling of "off" is -1 (written back as such by --resolved-config).
bool MinusOneMeansOff(const std::string& key, const nlohmann::json& v) {
  return key == "mics_shard_size" && v.is_number_integer() && v.get<int64_t>() == -1;
}

bool AnyNegative(const nlohmann::json& j) {
  if (j.is_number_integer()) return j.get<int64_t>() < 0;
  if (j.is_number_float()) return j.get<double>() < 0;
  if (j.is_object()) {
    for (const auto& [key, v] : j.items()) {
      if (MinusOneMeansOff(key, v)) continue;
      if ((v.is_structured() || v.is_number()) && AnyNegative(v)) return true;
    }
    return false;
  }
  for (const auto& v : j) {
    if ((v.is_structured() || v.is_number()) && AnyNegative(v)) return true;
  }
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace zerort;
  std::vector<std::string> args =
      absl::StrSplit(absl::string_view(reinterpret_cast<const char*>(data), size), '\n');
  for (const std::string& a : args) {
    if (absl::StrContains(a, '/') || absl::StrContains(a, ".json") || a == "--config" ||
        absl::StartsWith(a, "--config=")) {
      return 0;
    }
  }
  absl::StatusOr<Flags> flags =
      Flags::Parse(args, {"model", "params", "layers", "world", "rank", "stage", "offload",
                          "offload-ratio", "precision", "budget"},
                   {"json", "resolved-config"});
  if (!flags.ok()) return 0;
  for (const char* name : {"params", "layers", "world", "rank"}) {
    absl::StatusOr<int64_t> v = flags->GetInt(name, 7, -5, 1000000);
    if (v.ok() && (*v < -5 || *v > 1000000)) std::abort();
  }
  if (!flags->Has("json")) args.push_back("--json");
  std::ostringstream out;
  if (!RunPlanCommand(args, out).ok()) return 0;
  const nlohmann::json j = nlohmann::json::parse(out.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || AnyNegative(j)) std::abort();
  return 0;
}
