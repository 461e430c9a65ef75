// Run by a real launcher (torchrun, srun, mpirun) with two or more ranks: reads the launch
// environment, runs two rendezvous in a row (rank 0 hands out a payload it made from its pid
// and the call's number, so the second exchange proves a fresh key or port per call), and prints
// one line per rank that tests/launch/*.sh compare:
//   launch_check rank=R world=W local_rank=L local_world=LW device=D source=S store=0|1
//       payload=P1,P2
// Exits 1 with the error on stderr when a step fails. Options: --timeout_ms=N (default 60000).
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "comm/launch_env.h"
#include "comm/rendezvous.h"

int main(int argc, char** argv) {
  zerort::comm::RendezvousOptions options;
  options.timeout_ms = 60000;
  for (int i = 1; i < argc; ++i) {
    const char* prefix = "--timeout_ms=";
    if (std::strncmp(argv[i], prefix, std::strlen(prefix)) != 0 ||
        !absl::SimpleAtoi(argv[i] + std::strlen(prefix), &options.timeout_ms)) {
      std::fprintf(stderr, "usage: launch_check [--timeout_ms=N]\n");
      return 2;
    }
  }
  auto info = zerort::comm::LaunchInfoFromEnv();
  if (!info.ok()) {
    std::fprintf(stderr, "launch_check: %s\n", info.status().ToString().c_str());
    return 1;
  }
  std::string payloads;
  for (int call = 0; call < 2; ++call) {
    const std::string mine =
        info->rank == 0 ? absl::StrCat("pid", getpid(), "-call", call) : std::string();
    auto shared = zerort::comm::Rendezvous(*info, mine, options);
    if (!shared.ok()) {
      std::fprintf(stderr, "launch_check: rank %d, rendezvous %d: %s\n", info->rank, call,
                   shared.status().ToString().c_str());
      return 1;
    }
    absl::StrAppend(&payloads, call == 0 ? "" : ",", *shared);
  }
  std::printf(
      "launch_check rank=%d world=%d local_rank=%d local_world=%d device=%d source=%s store=%d "
      "payload=%s\n",
      info->rank, info->world_size, info->local_rank, info->local_world_size, info->device,
      info->source.c_str(), info->master_is_torch_store ? 1 : 0, payloads.c_str());
  std::fflush(stdout);
  return 0;
}
