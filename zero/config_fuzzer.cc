// libFuzzer entry point for the config parser (tools/fuzz.sh runs it; tests/fuzz/config/ seeds
// it and config_fuzzer_corpus_test replays that folder in every build). Beyond not crashing: an
// accepted config reads back unchanged from its resolved dump, and plans a small model with no
// negative or wrapped size (ChoosePlan may refuse, e.g. when nothing fits the budget), and its
// "auto" values resolve to a valid config.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "absl/strings/string_view.h"
#include "memory/plan.h"
#include "zero/auto_fill.h"
#include "zero/config.h"
#include "zero/planner.h"

namespace {

bool NonNegative(const zerort::memory::Plan& p) {
  for (const zerort::memory::Buffer& b : p.buffers) {
    if (b.elements < 0 || b.bytes < 0 || b.count < 1) return false;
  }
  return p.device_bytes() >= 0 && p.pinned_host_bytes() >= 0 && p.host_bytes() >= 0 &&
         p.comm_bytes_per_step >= 0 && p.host_transfer_bytes_per_step >= 0 &&
         p.model_state_bytes >= 0 && p.gather_slots >= 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace zerort;
  absl::StatusOr<Config> config =
      ParseConfig(absl::string_view(reinterpret_cast<const char*>(data), size), "<fuzz>");
  if (!config.ok()) return 0;
  absl::StatusOr<Config> again = ParseConfig(ResolvedConfigJson(*config), "<resolved>");
  if (!again.ok() || *again != *config || !ValidateConfig(*config).ok()) std::abort();
  const std::vector<memory::ParamSpec> specs = {
      {"embed.w", {1000, 64}, "embed"}, {"h.w", {64, 64}, "h"}, {"h.b", {64}, "h"},
      {"head.w", {64, 1000}, "head"}};
  absl::StatusOr<PlanChoice> choice = ChoosePlan(specs, *config, /*world_size=*/4, /*rank=*/3);
  if (choice.ok() && !NonNegative(choice->plan)) std::abort();
  // "auto" values: once resolved, none is left and the result is still a valid config.
  AutoFill fill;
  fill.world_size = 4;
  fill.hidden_size = 64;
  fill.total_num_steps = 100;
  fill.compute_dtype = DType::kBF16;
  if (ResolveAuto(fill, specs, &*config).ok() &&
      (!config->auto_keys.empty() || !ValidateConfig(*config).ok())) {
    std::abort();
  }
  return 0;
}
