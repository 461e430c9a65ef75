// The `zerort` command line: `zerort plan ...` (cli.cc), and the usage text of every command
// (`demo`: cli/demo.h, `ckpt`: cli/ckpt_command.h).
//
// Each command parses its own flags ("--name value" or "--name=value"); an unknown flag or a bad
// value is an InvalidArgument naming it. Output goes to `out`; main() prints errors and sets the
// exit status, so these functions are testable in-process.
#ifndef ZERORT_CLI_CLI_H_
#define ZERORT_CLI_CLI_H_

#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace zerort {

// `zerort plan --model NAME|FILE | --params N [--layers L] [--world N] [--rank R]
//   [--stage 0-3|auto] [--offload none|optimizer|all] [--offload-ratio R]
//   [--precision bf16|fp16|fp32] [--config FILE] [--budget SIZE | device=SIZE,host=SIZE]
//   [--json] [--resolved-config]`
// The config's notes (keys accepted with no effect) come first as "note: ..." lines, or as the
// "notes" array of --json (empty without a config).
absl::Status RunPlanCommand(const std::vector<std::string>& args, std::ostream& out);

// Usage text for every command.
std::string Usage();

// Usage text for one command ("plan", "demo", "ckpt"), or "" for an unknown one.
std::string CommandUsage(absl::string_view command);

// Whether a command's arguments ask for its usage: "--help" or "-h" anywhere among them, so
// `zerort plan --model x --help` prints help rather than an unknown-flag error.
bool WantsHelp(const std::vector<std::string>& args);

}  // namespace zerort

#endif  // ZERORT_CLI_CLI_H_
