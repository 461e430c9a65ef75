// A trainer that keeps its gradients in one buffer of its own, as llm.c does, for the tests of
// the gradient hand-off declared before the plan (memory::ParamSpec::grad_buffer): llm.c's 16
// tensors in miniature, packed in that buffer in registration order, trained through the
// engine's grad(i) or handed over with SetGradBuffer. Gradients and initial values are
// zero/testing/synthetic_trainer.h's, so runs compare bit for bit across devices and paths.
#ifndef ZERORT_ZERO_TESTING_HANDOFF_TRAINER_H_
#define ZERORT_ZERO_TESTING_HANDOFF_TRAINER_H_

#include <vector>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "device/device.h"
#include "memory/plan.h"
#include "zero/config.h"
#include "zero/engine.h"

namespace zerort {
namespace testing {

// llm.c's 16 tensors (L = 2, C = 8, V = 40, 6 positions: 2128 elements), each a module of its
// own; `declared`: every gradient in the trainer's buffer "grads", packed in this order. At
// world 1-3 most tensors need padding, which lies over the gradients after them; the last
// ones' would run past the buffer.
std::vector<memory::ParamSpec> MiniLlmc(bool declared);

struct HandoffRun {
  std::vector<float> master;  // GatherMasterWeights() at the end
  MemoryReport report;
  int in_place = 0;           // parameters for which SetGradBuffer returned true
  bool wte_in_place = false;  // the embedding's
  std::vector<int> reduced;   // reduced_units() after each GradReady of the first micro-step
};

// `steps` optimizer steps of MiniLlmc on this rank, on `compute` (nullptr: the calling
// thread). Gradients (GradValue) are written on the compute stream from host copies, into the
// engine's grad(i), or, `declared`, into the trainer's buffer (allocated from the device's
// kDevice allocator, so GPU memory on a GPU) handed over once: each just before its GradReady
// in backward order, or, `forward_order`, as llm.c does: the whole backward first, then
// GradReady in registration order, so that a unit's padding lies over gradients written and
// not yet reduced.
absl::StatusOr<HandoffRun> TrainHandoffRank(const Config& config, bool declared,
                                            bool forward_order, comm::Communicator* comm,
                                            Device* device, int steps, Device::Stream compute);

}  // namespace testing
}  // namespace zerort

#endif  // ZERORT_ZERO_TESTING_HANDOFF_TRAINER_H_
