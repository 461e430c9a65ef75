// The main() that a fuzz target links outside --config=fuzz: it feeds every file named on the
// command line (or found directly inside a named directory) to LLVMFuzzerTestOneInput, so the
// corpus in tests/fuzz/<target>/, crash inputs kept there included, is replayed by
// `bazel test //...` in the default and ASan configurations. A crash is the test's failure.
#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

// `path` itself, or the regular files directly inside it, sorted.
std::vector<std::string> Inputs(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return {};
  if (!S_ISDIR(st.st_mode)) return {path};
  std::vector<std::string> files;
  if (DIR* dir = ::opendir(path.c_str())) {
    while (const dirent* e = ::readdir(dir)) {
      const std::string file = path + "/" + e->d_name;
      if (e->d_name[0] != '.' && ::stat(file.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
        files.push_back(file);
      }
    }
    ::closedir(dir);
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

int main(int argc, char** argv) {
  size_t replayed = 0;
  for (int i = 1; i < argc; ++i) {
    const std::vector<std::string> inputs = Inputs(argv[i]);
    if (inputs.empty()) {
      std::fprintf(stderr, "replay: no input at '%s'\n", argv[i]);
      return 1;
    }
    for (const std::string& file : inputs) {
      std::ifstream in(file, std::ios::binary);
      const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
      ++replayed;
    }
  }
  std::printf("replayed %zu inputs\n", replayed);
  return replayed > 0 ? 0 : 1;
}
