// zerort: plan (and run) ZeRO-sharded training. See `zerort --help`.
#include <iostream>
#include <string>
#include <vector>

#include "cli/ckpt_command.h"
#include "cli/cli.h"
#include "cli/demo.h"

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    std::cout << zerort::Usage();
    return args.empty() ? 2 : 0;
  }
  const std::string command = args[0];
  args.erase(args.begin());
  if (!zerort::CommandUsage(command).empty() && zerort::WantsHelp(args)) {
    std::cout << zerort::CommandUsage(command);
    return 0;
  }
  absl::Status status;
  if (command == "plan") {
    status = zerort::RunPlanCommand(args, std::cout);
  } else if (command == "demo") {
    status = zerort::RunDemoCommand(args, std::cout);
  } else if (command == "ckpt") {
    status = zerort::RunCkptCommand(args, std::cout);
  } else {
    std::cerr << "zerort: unknown command '" << command << "'\n" << zerort::Usage();
    return 2;
  }
  if (!status.ok()) {
    std::cerr << "zerort " << command << ": " << status.message() << "\n";
    return status.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  return 0;
}
