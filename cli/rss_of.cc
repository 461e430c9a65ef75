// rss_of CMD [ARGS...]: runs CMD as a child and prints "<exit code> <peak RSS in KiB>" of that
// child alone. A helper of ckpt_export_memory_test: the peak RSS the kernel reports for a
// process counts the address space it was started from (exec records the old one's high-water
// mark, and a vfork-ed child's old address space is its parent's), so the child is started from
// this small, freshly executed image rather than from the test's large one.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: rss_of CMD [ARGS...]\n");
    return 2;
  }
  const pid_t pid = fork();
  if (pid < 0) return 3;
  if (pid == 0) {
    execv(argv[1], argv + 1);
    _exit(127);
  }
  int status = 0;
  struct rusage ru {};
  while (wait4(pid, &status, 0, &ru) < 0) {
    if (errno != EINTR) return 3;
  }
  const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  std::printf("%d %ld\n", code, ru.ru_maxrss);
  return 0;
}
