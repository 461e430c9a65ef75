// Mount tricks for tests, without privileges and without touching the machine: a body runs in
// a forked child with its own user and mount namespaces (root inside them), where it may mount
// a ramfs (a file system without O_DIRECT) or bind-mount a directory (a second path to the same
// files). The mounts vanish with the child.
//
//   const int rc = testing::InPrivateMountNamespace([&] {
//     if (!testing::BindMount(dir, alias)) return 2;
//     return Exercise(alias) ? 0 : 1;
//   });
//   if (rc == testing::kNoNamespace) { WARN("..."); return; }
//   CHECK(rc == 0);
//
// The body runs after fork(): call it before the test starts threads of its own.
#ifndef ZERORT_TESTS_TESTING_PRIVATE_MOUNT_H_
#define ZERORT_TESTS_TESTING_PRIVATE_MOUNT_H_

#include <functional>
#include <string>

namespace zerort {
namespace testing {

// The child's exit code when the kernel or the sandbox refuses the namespaces.
inline constexpr int kNoNamespace = 77;

// Runs `body` in the child; returns its return value (its exit code), kNoNamespace, or 128 +
// the signal that killed it.
int InPrivateMountNamespace(const std::function<int()>& body);

// Inside InPrivateMountNamespace: mounts a ramfs on `dir` / binds `from` onto `to` (both
// existing directories). False on failure (errno set).
bool MountRamfs(const std::string& dir);
bool BindMount(const std::string& from, const std::string& to);

}  // namespace testing
}  // namespace zerort

#endif  // ZERORT_TESTS_TESTING_PRIVATE_MOUNT_H_
