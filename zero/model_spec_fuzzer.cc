// libFuzzer entry point for the model-file parser (tools/fuzz.sh runs it; tests/fuzz/model_spec/
// seeds it and model_spec_fuzzer_corpus_test replays that folder in every build). An accepted
// model is planned at a stage and world taken from the input's first bytes; the plan must either
// be refused or lay every element out exactly once, with no negative or wrapped size.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "absl/strings/string_view.h"
#include "memory/plan.h"
#include "zero/model_spec.h"

namespace {

// The layout invariants memory/plan.h states.
bool Consistent(const zerort::memory::Plan& p) {
  const int64_t world = p.options.world_size;
  int64_t offset = 0;
  for (const zerort::memory::Unit& u : p.units) {
    if (u.flat_offset != offset || u.padded < u.numel || u.shard * world != u.padded) return false;
    offset += u.padded;
  }
  if (offset != p.padded_elements || p.shard_elements * world != p.padded_elements) return false;
  for (const zerort::memory::ParamLayout& l : p.params) {
    const zerort::memory::Unit& u = p.units[l.unit];
    if (l.offset_in_unit < 0 || l.offset_in_unit + l.numel > u.numel) return false;
  }
  for (const zerort::memory::Buffer& b : p.buffers) {
    if (b.elements < 0 || b.bytes < b.elements) return false;
  }
  return p.device_bytes() >= 0 && p.comm_bytes_per_step >= 0 && p.model_state_bytes >= 0 &&
         p.host_transfer_bytes_per_step >= 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace zerort;
  absl::StatusOr<std::vector<memory::ParamSpec>> specs =
      ParseModelJson(absl::string_view(reinterpret_cast<const char*>(data), size), "<fuzz>");
  if (!specs.ok()) return 0;
  memory::PlanOptions o;
  o.stage = size % 4;
  o.world_size = 1 + data[0] % 16;
  o.rank = o.world_size - 1;
  o.offload_optimizer = o.stage > 0 && size % 3 == 0;
  o.unit_target_elements = int64_t{1} << (size % 40);
  absl::StatusOr<memory::Plan> plan = memory::MakePlan(*specs, o);
  if (plan.ok() && !Consistent(*plan)) std::abort();
  return 0;
}
