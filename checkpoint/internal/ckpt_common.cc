#include "checkpoint/internal/ckpt_common.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/crc32c.h"
#include "base/dtype.h"
#include "base/status.h"
#include "comm/agree.h"

namespace zerort {
namespace ckpt_internal {
namespace {

// `latest` holds "step_<N>\n": a few bytes, in a plain file (a symlink or a device in its place
// is refused: its target is never read, let alone printed).
constexpr int64_t kMaxLatestBytes = 32;

}  // namespace

FileSystem* Fs(FileSystem* fs) { return fs != nullptr ? fs : PosixFileSystem(); }

absl::Status Agree(comm::HostExchange& exchange, const absl::Status& local) {
  return comm::AgreeOnStatus(exchange, local);
}

absl::StatusOr<std::string> ReadLatest(FileSystem* fs, const std::string& root) {
  const std::string path = JoinPath(root, kLatestName);
  if (!fs->Exists(path)) return std::string();
  absl::StatusOr<std::string> text = ReadSmallFile(fs, path, kMaxLatestBytes);
  if (!text.ok()) {
    return absl::DataLossError(absl::StrCat("'", path, "' is not a checkpoint pointer: ",
                                            text.status().message()));
  }
  absl::string_view name = *text;
  if (absl::EndsWith(name, "\n")) name.remove_suffix(1);
  int64_t step;
  if (!absl::StartsWith(name, "step_") || name.size() == 5 ||
      name.find_first_not_of("0123456789", 5) != absl::string_view::npos ||
      !absl::SimpleAtoi(name.substr(5), &step)) {
    return absl::DataLossError(absl::StrCat("'", path, "' holds \"", absl::CHexEscape(name),
                                            "\", not the name of a checkpoint (step_<N>)"));
  }
  return std::string(name);
}

absl::StatusOr<std::string> ResolveDir(FileSystem* fs, const std::string& path) {
  if (fs->Exists(JoinPath(path, kManifestName))) return path;
  ASSIGN_OR_RETURN(std::string latest, ReadLatest(fs, path));
  if (latest.empty()) {
    return absl::NotFoundError(absl::StrCat("no checkpoint at '", path, "': neither ",
                                            kManifestName, " nor ", kLatestName, " exists"));
  }
  const std::string dir = JoinPath(path, latest);
  if (!fs->IsDirectory(dir)) {
    return absl::DataLossError(absl::StrCat(
        "'", JoinPath(path, kLatestName), "' names ", latest, ", which is ",
        fs->Exists(dir) ? "not a directory (a symlink is refused)" : "missing"));
  }
  return dir;
}

absl::StatusOr<Manifest> ReadManifest(FileSystem* fs, const std::string& dir) {
  const std::string path = JoinPath(dir, kManifestName);
  absl::StatusOr<std::string> text = ReadSmallFile(fs, path, kMaxManifestBytes);
  if (!text.ok()) return Annotate(text.status(), "reading the checkpoint manifest");
  absl::StatusOr<Manifest> m = ParseManifest(*text);
  if (!m.ok()) return Annotate(m.status(), path);
  return m;
}

void AddParamRange(const Manifest& m, int i, int64_t e0, int64_t count, float* const dst[3],
                   std::vector<std::vector<Piece>>* per_file) {
  const ManifestParam& p = m.params[i];
  const ManifestUnit& u = m.units[p.unit];
  int64_t pos = p.offset_in_unit + e0;  // element inside the saved unit
  int64_t done = 0;
  while (done < count) {
    const int q = static_cast<int>(pos / u.shard);
    const int64_t within = pos % u.shard;
    const int64_t take = std::min(count - done, u.shard - within);
    for (int k = 0; k < 3; ++k) {
      char* to = dst[k] != nullptr ? reinterpret_cast<char*>(dst[k] + done) : nullptr;
      (*per_file)[q].push_back({m.SectionOffset(k) + (u.shard_offset + within) * 4, take * 4, to,
                                i, k, e0 + done});
    }
    done += take;
    pos += take;
  }
}

absl::Status CheckShardSize(FileSystem* fs, const std::string& dir, const Manifest& m, int q) {
  const ManifestFile& f = m.files[q];
  const std::string path = JoinPath(dir, f.name);
  absl::StatusOr<int64_t> size = fs->FileSize(path);
  if (absl::IsNotFound(size.status())) {
    return absl::NotFoundError(absl::StrCat("checkpoint shard '", path, "' is missing"));
  }
  RETURN_IF_ERROR(size.status());
  if (*size != f.bytes) {
    return absl::DataLossError(absl::StrCat(
        "checkpoint shard '", path, "' ", *size < f.bytes ? "is truncated: " : "has ", *size,
        " bytes, the manifest says ", f.bytes));
  }
  return absl::OkStatus();
}

absl::Status CheckShardSizes(FileSystem* fs, const std::string& dir, const Manifest& m) {
  for (int q = 0; q < m.world_size; ++q) RETURN_IF_ERROR(CheckShardSize(fs, dir, m, q));
  return absl::OkStatus();
}

absl::Status ReadShard(FileSystem* fs, const std::string& dir, const Manifest& m, int q,
                       std::vector<Piece> pieces, const PieceSink& sink) {
  const ManifestFile& f = m.files[q];
  const std::string path = JoinPath(dir, f.name);
  RETURN_IF_ERROR(CheckShardSize(fs, dir, m, q));
  std::sort(pieces.begin(), pieces.end(),
            [](const Piece& a, const Piece& b) { return a.offset < b.offset; });
  ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> file, fs->NewReadableFile(path));
  std::vector<char> buf(static_cast<size_t>(std::min<int64_t>(f.bytes, kIoChunk)));
  uint32_t crc = 0;
  int64_t pos = 0;
  size_t next = 0;  // first piece not yet fully copied
  bool header_checked = false;
  while (pos < f.bytes) {
    const size_t want = static_cast<size_t>(std::min<int64_t>(buf.size(), f.bytes - pos));
    size_t got = 0;
    while (got < want) {
      ASSIGN_OR_RETURN(size_t n, file->Read(buf.data() + got, want - got));
      if (n == 0) {
        return absl::DataLossError(absl::StrCat("checkpoint shard '", path,
                                                "' ended early while reading (at byte ",
                                                pos + got, " of ", f.bytes, ")"));
      }
      got += n;
    }
    if (!header_checked) {
      // The header is the first bytes of the first chunk (chunks are far above 64 bytes).
      RETURN_IF_ERROR(CheckShardHeader(absl::string_view(buf.data(), want), m, q, path));
      header_checked = true;
    }
    crc = Crc32c(crc, buf.data(), want);
    const int64_t end = pos + static_cast<int64_t>(want);
    for (size_t k = next; k < pieces.size() && pieces[k].offset < end; ++k) {
      const Piece& p = pieces[k];
      const int64_t a = std::max(p.offset, pos);
      const int64_t b = std::min(p.offset + p.bytes, end);
      if (a < b && p.dst != nullptr) {
        std::memcpy(p.dst + (a - p.offset), buf.data() + (a - pos), b - a);
      } else if (a < b) {
        RETURN_IF_ERROR(sink(p, a - p.offset, buf.data() + (a - pos), b - a));
      }
      if (p.offset + p.bytes <= end && k == next) ++next;
    }
    pos = end;
  }
  if (crc != f.crc32c) {
    return absl::DataLossError(absl::StrFormat(
        "checkpoint shard '%s' is corrupted: CRC32C %08x, the manifest says %08x", path, crc,
        f.crc32c));
  }
  return absl::OkStatus();
}

CheckpointInfo InfoOf(const Manifest& m, const std::string& dir) {
  CheckpointInfo info;
  info.dir = dir;
  info.format_version = m.format_version;
  info.step = m.step;
  info.world_size = m.world_size;
  info.stage = m.stage;
  info.compute_dtype = std::string(DTypeName(m.compute_dtype));
  info.config_hash = m.config_hash;
  info.loss_scale = m.scaler.loss_scale;
  info.num_units = static_cast<int>(m.units.size());
  for (const auto& p : m.params) info.params.push_back({p.name, p.shape, p.numel});
  for (const auto& f : m.files) info.files.push_back({f.name, f.bytes, f.crc32c});
  return info;
}

}  // namespace ckpt_internal
}  // namespace zerort
