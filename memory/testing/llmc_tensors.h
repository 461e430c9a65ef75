// llm.c's GPT-2 parameter tensors as its CPU trainer holds them, for tests of the gradient
// hand-off: 16 tensors (the per-layer ones stacked [L, ...]) packed in this order in one
// gradient buffer, each registered as a module of its own. The plan's tests use llm.c's own
// small shape; the engine's use a toy shape of the same layout.
#ifndef ZERORT_MEMORY_TESTING_LLMC_TENSORS_H_
#define ZERORT_MEMORY_TESTING_LLMC_TENSORS_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "memory/plan.h"

namespace zerort {
namespace memory {
namespace testing {

// L layers, C channels, a vocabulary of V and T positions; every tensor declared in gradient
// buffer `buffer` (none when empty).
inline std::vector<ParamSpec> LlmcTensors(int64_t L, int64_t C, int64_t V, int64_t T,
                                          const std::string& buffer) {
  const std::vector<std::pair<std::string, std::vector<int64_t>>> tensors = {
      {"wte", {V, C}},            {"wpe", {T, C}},         {"ln1w", {L, C}},
      {"ln1b", {L, C}},           {"qkvw", {L, 3 * C, C}}, {"qkvb", {L, 3 * C}},
      {"attprojw", {L, C, C}},    {"attprojb", {L, C}},    {"ln2w", {L, C}},
      {"ln2b", {L, C}},           {"fcw", {L, 4 * C, C}},  {"fcb", {L, 4 * C}},
      {"fcprojw", {L, C, 4 * C}}, {"fcprojb", {L, C}},     {"lnfw", {C}},
      {"lnfb", {C}}};
  std::vector<ParamSpec> specs;
  for (const auto& [name, shape] : tensors) {
    ParamSpec s{name, shape, name};
    s.grad_buffer = buffer;
    specs.push_back(s);
  }
  return specs;
}

}  // namespace testing
}  // namespace memory
}  // namespace zerort

#endif  // ZERORT_MEMORY_TESTING_LLMC_TENSORS_H_
