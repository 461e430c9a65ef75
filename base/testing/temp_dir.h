// TempDir makes a new, empty directory for one test: under TestTmpDir(), named
// <prefix>XXXXXX with a unique suffix. A failure to create it is a broken test environment:
// the process stops with the path and errno.
//
//   const std::string dir = testing::TempDir("ckpt_async_");
//
// Thread-safe.
#ifndef ZERORT_BASE_TESTING_TEMP_DIR_H_
#define ZERORT_BASE_TESTING_TEMP_DIR_H_

#include <string>

#include "absl/strings/string_view.h"

namespace zerort {
namespace testing {

// $TEST_TMPDIR (Bazel's per-test directory on the machine's disk, removed after the test),
// else /tmp.
std::string TestTmpDir();

std::string TempDir(absl::string_view prefix);

}  // namespace testing
}  // namespace zerort

#endif  // ZERORT_BASE_TESTING_TEMP_DIR_H_
