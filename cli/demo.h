// `zerort demo`: trains the example MLP (examples/mlp) on N in-process ranks and shows what the
// engine does per step and how much memory each rank holds, planned beside allocated.
//
//   zerort demo [--config FILE] [--ranks N] [--steps S] [--stage 0-3] [--precision P]
//
// Without --config: bf16, stage 2, AdamW lr 1e-2, gradient clipping 1, units of at most 2048
// elements (so that several buckets exist) and no persistent stage-3 units (so that stage 3
// really gathers). --stage and --precision override the config. Defaults: 4 ranks, 30 steps.
//
// Thread safety: RunDemoCommand may be called from any thread; it starts its own rank threads.
#ifndef ZERORT_CLI_DEMO_H_
#define ZERORT_CLI_DEMO_H_

#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace zerort {

// Output goes to `out`. Errors: InvalidArgument naming the flag for an unknown flag or a bad
// value; the config's errors (naming the file and key); a failing rank's error.
absl::Status RunDemoCommand(const std::vector<std::string>& args, std::ostream& out);

}  // namespace zerort

#endif  // ZERORT_CLI_DEMO_H_
