// Corpus: byte-level tokens of a text file, split into training and held-out parts.
#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "examples/gpt/gpt.h"
#include "examples/gpt/internal/random.h"

namespace zerort {
namespace examples {
namespace gpt {
namespace {

constexpr char kLicenses[] = "/usr/share/common-licenses";

bool IsRegularFile(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

}  // namespace

absl::StatusOr<std::string> DefaultCorpusPath() {
  const std::string preferred = absl::StrCat(kLicenses, "/GPL-3");
  if (IsRegularFile(preferred)) return preferred;
  // Any other licence text will do; take the largest, for the most data.
  std::string best;
  off_t best_size = -1;
  if (DIR* dir = opendir(kLicenses)) {
    while (const dirent* entry = readdir(dir)) {
      const std::string path = absl::StrCat(kLicenses, "/", entry->d_name);
      struct stat st;
      if (stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_size <= best_size) continue;
      best = path;
      best_size = st.st_size;
    }
    closedir(dir);
  }
  if (best.empty()) {
    return absl::NotFoundError(absl::StrCat("no training text: ", preferred, " is missing and ",
                                            kLicenses, " holds no other file; pass a corpus path"));
  }
  return best;
}

absl::StatusOr<Corpus> Corpus::Load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read corpus file ", path));
  std::ostringstream text;
  text << in.rdbuf();
  absl::StatusOr<Corpus> corpus = FromText(text.str());
  if (!corpus.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", corpus.status().message()));
  }
  return corpus;
}

absl::StatusOr<Corpus> Corpus::FromText(const std::string& text) {
  const int64_t n = static_cast<int64_t>(text.size());
  const int64_t split = n - n / 10;
  if (n / 10 < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("corpus of ", n, " bytes is too short to hold out 10% (need >= 20 bytes)"));
  }
  return Corpus(text, split);
}

TokenBatch Corpus::Sample(int rank, int64_t step, int batch, int seq, uint64_t seed) const {
  TokenBatch out;
  out.batch = batch;
  out.seq = seq;
  internal::Rng rng({seed, static_cast<uint64_t>(rank), static_cast<uint64_t>(step)});
  const int64_t starts = split_ - seq;  // windows of seq + 1 tokens inside [0, split_)
  for (int b = 0; b < batch; ++b) {
    const int64_t start = rng.Below(std::max<int64_t>(starts, 1));
    for (int t = 0; t <= seq; ++t) out.tokens.push_back(static_cast<unsigned char>(bytes_[start + t]));
  }
  return out;
}

int Corpus::NumValWindows(int seq) const {
  return static_cast<int>(std::max<int64_t>(0, (val_tokens() - 1) / seq));
}

TokenBatch Corpus::ValWindows(int first, int count, int seq) const {
  TokenBatch out;
  out.batch = count;
  out.seq = seq;
  const int last = std::max(0, NumValWindows(seq) - 1);
  for (int w = first; w < first + count; ++w) {
    const int64_t start = split_ + static_cast<int64_t>(std::min(w, last)) * seq;
    for (int t = 0; t <= seq; ++t) out.tokens.push_back(static_cast<unsigned char>(bytes_[start + t]));
  }
  return out;
}

}  // namespace gpt
}  // namespace examples
}  // namespace zerort
