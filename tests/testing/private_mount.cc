#include "tests/testing/private_mount.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

namespace zerort {
namespace testing {
namespace {

bool WriteFile(const char* path, const std::string& text) {
  const int fd = ::open(path, O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ::close(fd);
  return ok;
}

// In the child: new namespaces, our uid and gid mapped to root inside, and mounts made private
// so that nothing propagates back to the parent's namespace.
bool EnterNamespaces() {
  const uid_t uid = ::getuid();
  const gid_t gid = ::getgid();
  if (::unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0) return false;
  WriteFile("/proc/self/setgroups", "deny");  // absent on old kernels: then not needed
  if (!WriteFile("/proc/self/uid_map", "0 " + std::to_string(uid) + " 1\n") ||
      !WriteFile("/proc/self/gid_map", "0 " + std::to_string(gid) + " 1\n")) {
    return false;
  }
  return ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) == 0;
}

}  // namespace

int InPrivateMountNamespace(const std::function<int()>& body) {
  std::fflush(nullptr);  // the child must not flush the parent's buffered output again
  const pid_t pid = ::fork();
  if (pid < 0) return kNoNamespace;
  if (pid == 0) {
    if (!EnterNamespaces()) {
      std::fprintf(stderr, "private mount namespace refused: %s\n", std::strerror(errno));
      std::_Exit(kNoNamespace);
    }
    const int rc = body();
    std::fflush(nullptr);
    std::_Exit(rc);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return WEXITSTATUS(status);
}

bool MountRamfs(const std::string& dir) {
  return ::mount("zerort-test", dir.c_str(), "ramfs", 0, nullptr) == 0;
}

bool BindMount(const std::string& from, const std::string& to) {
  return ::mount(from.c_str(), to.c_str(), nullptr, MS_BIND, nullptr) == 0;
}

}  // namespace testing
}  // namespace zerort
