// `zerort ckpt`: inspect, consolidate and export checkpoints (checkpoint/checkpoint.h) without an engine.
//
//   zerort ckpt inspect DIR [--json]   summary of the checkpoint DIR (or the one DIR/latest
//                                      names), after verifying every file's size and CRC32C
//   zerort ckpt consolidate DIR OUT [--force]
//                                      the full fp32 state (masters and Adam moments) as one
//                                      safetensors file OUT; an existing OUT only with --force,
//                                      never one inside the checkpoint
//   zerort ckpt export DIR --format safetensors [--dtype bf16|fp32] [--max-shard-size SIZE]
//                      [--name-map FILE] OUT
//                                      the fp32 masters as weights-only safetensors (fp32 by
//                                      default): OUT a .safetensors file, or a directory that
//                                      gets model.safetensors, or shards of at most SIZE
//                                      ("5GB") and model.safetensors.index.json; FILE's rules
//                                      (checkpoint/weights.h, WeightsNameMap) rename the
//                                      parameters as written
//
// inspect, consolidate and export stream the checkpoint: memory stays at one 8 MiB read buffer
// whatever its size. Names, paths and file contents are printed escaped (bytes outside printable ASCII as \xNN) and bounded; --json replaces bytes that are
// not UTF-8 with U+FFFD. Output goes to `out`; errors come back as a Status (main prints
// them). Thread-safe.
#ifndef ZERORT_CLI_CKPT_COMMAND_H_
#define ZERORT_CLI_CKPT_COMMAND_H_

#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace zerort {

absl::Status RunCkptCommand(const std::vector<std::string>& args, std::ostream& out);

}  // namespace zerort

#endif  // ZERORT_CLI_CKPT_COMMAND_H_
