#include "base/testing/temp_dir.h"

#include <stdlib.h>

#include <cerrno>
#include <cstring>

#include "absl/base/internal/raw_logging.h"
#include "absl/strings/str_cat.h"

namespace zerort {
namespace testing {

std::string TestTmpDir() {
  const char* base = std::getenv("TEST_TMPDIR");
  return base != nullptr ? base : "/tmp";
}

std::string TempDir(absl::string_view prefix) {
  std::string path = absl::StrCat(TestTmpDir(), "/", prefix, "XXXXXX");
  if (mkdtemp(&path[0]) == nullptr) {
    ABSL_RAW_LOG(FATAL, "TempDir: mkdtemp(%s): %s", path.c_str(), std::strerror(errno));
  }
  return path;
}

}  // namespace testing
}  // namespace zerort
