// zerort demo when its rank threads cannot be created (RLIMIT_NPROC reached): a status, not
// the abort of an uncaught std::system_error with joinable threads left behind.
#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <sstream>

#include "absl/strings/match.h"
#include "catch2/catch.hpp"
#include "cli/demo.h"

namespace zerort {
namespace {

// In a forked child whose real uid is an unprivileged one and whose effective capabilities
// lack the two that lift RLIMIT_NPROC, limits the process to `threads` more threads (root is
// exempt from RLIMIT_NPROC otherwise). The effective uid stays 0, so files read as before.
// False when the sandbox does not allow it.
bool LimitThreads(int threads) {
  if (setresuid(65534, 0, 0) != 0) return false;
  __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct caps[2] = {};
  if (syscall(SYS_capget, &header, caps) != 0) return false;
  for (int cap : {CAP_SYS_ADMIN, CAP_SYS_RESOURCE}) caps[cap / 32].effective &= ~(1u << (cap % 32));
  if (syscall(SYS_capset, &header, caps) != 0) return false;
  // This process counts as one task of uid 65534 (as may others of that uid on the machine).
  struct rlimit lim;
  lim.rlim_cur = lim.rlim_max = static_cast<rlim_t>(1 + threads);
  return setrlimit(RLIMIT_NPROC, &lim) == 0;
}

TEST_CASE("Demo: rank threads that cannot be created are an error, not an abort", "[zero]") {
  for (const char* model : {"gpt", "mlp"}) {
    INFO(model);
    const pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      if (!LimitThreads(1)) _exit(77);
      std::ostringstream out;
      const absl::Status s =
          RunDemoCommand({"--model", model, "--ranks", "4", "--steps", "2"}, out);
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      _exit(absl::IsResourceExhausted(s) &&
                    absl::StrContains(s.message(), "cannot start the thread of rank")
                ? 0
                : 1);
    }
    int st = 0;
    REQUIRE(waitpid(pid, &st, 0) == pid);
    if (WIFEXITED(st) && WEXITSTATUS(st) == 77) {
      WARN("cannot drop RLIMIT_NPROC's exemption here: thread-creation failure not checked");
      continue;
    }
    INFO("wait status " << st << (WIFSIGNALED(st) ? " (killed by a signal: an abort)" : ""));
    CHECK(WIFEXITED(st));
    CHECK(WEXITSTATUS(st) == 0);
  }
}

}  // namespace
}  // namespace zerort
