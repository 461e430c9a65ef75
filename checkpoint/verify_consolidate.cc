// VerifyCheckpoint, StreamCheckpointMasters and ConsolidateCheckpoint: offline reads of a
// whole checkpoint, without an engine, that stream every shard once through one read buffer
// (`zerort ckpt verify`, `zerort ckpt export` and `zerort ckpt consolidate`), so memory stays
// bounded whatever the checkpoint's size.
#include "checkpoint/checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "checkpoint/internal/ckpt_common.h"
#include "checkpoint/internal/ckpt_fs.h"
#include "checkpoint/internal/ckpt_manifest.h"
#include "nlohmann/json.hpp"

namespace zerort {

using ckpt_internal::AddParamRange;
using ckpt_internal::CheckShardSizes;
using ckpt_internal::FileSystem;
using ckpt_internal::Fs;
using ckpt_internal::InfoOf;
using ckpt_internal::JoinPath;
using ckpt_internal::kLatestName;
using ckpt_internal::Manifest;
using ckpt_internal::Piece;
using ckpt_internal::PieceSink;
using ckpt_internal::ReadManifest;
using ckpt_internal::ReadShard;
using ckpt_internal::ResolveDir;

namespace {

// Streams every shard once (bounded memory), handing each parameter's pieces to `sink`.
absl::Status StreamShards(FileSystem* fs, const std::string& dir, const Manifest& man,
                          const PieceSink& sink) {
  RETURN_IF_ERROR(CheckShardSizes(fs, dir, man));
  std::vector<std::vector<Piece>> per_file(man.world_size);
  float* const none[3] = {nullptr, nullptr, nullptr};
  for (size_t i = 0; i < man.params.size(); ++i) {
    AddParamRange(man, static_cast<int>(i), 0, man.params[i].numel, none, &per_file);
  }
  for (int q = 0; q < man.world_size; ++q) {
    RETURN_IF_ERROR(ReadShard(fs, dir, man, q, std::move(per_file[q]), sink));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CheckpointSummary> VerifyCheckpoint(const std::string& path, FileSystem* fs) {
  fs = Fs(fs);
  ASSIGN_OR_RETURN(std::string dir, ResolveDir(fs, path));
  ASSIGN_OR_RETURN(Manifest man, ReadManifest(fs, dir));
  CheckpointSummary out;
  out.info = InfoOf(man, dir);
  std::vector<double> sum_sq(man.params.size(), 0.0);
  // Pieces of one parameter arrive in element order (shards in rank order, each sorted by
  // offset), so the sum is the one a loop over the parameter's elements would give.
  RETURN_IF_ERROR(StreamShards(fs, dir, man, [&](const Piece& p, int64_t, const char* data,
                                                 int64_t n) {
    if (p.section != 0) return absl::OkStatus();
    for (int64_t k = 0; k < n; k += 4) {
      float x;
      std::memcpy(&x, data + k, 4);
      sum_sq[p.param] += static_cast<double>(x) * x;
    }
    return absl::OkStatus();
  }));
  for (double s2 : sum_sq) out.master_norm.push_back(std::sqrt(s2));
  return out;
}

absl::Status StreamCheckpointMasters(const std::string& path,
                                     const std::function<absl::Status(const CheckpointInfo&)>& begin,
                                     const MasterSink& sink, FileSystem* fs) {
  fs = Fs(fs);
  ASSIGN_OR_RETURN(std::string dir, ResolveDir(fs, path));
  ASSIGN_OR_RETURN(Manifest man, ReadManifest(fs, dir));
  RETURN_IF_ERROR(CheckShardSizes(fs, dir, man));
  RETURN_IF_ERROR(begin(InfoOf(man, dir)));
  return StreamShards(fs, dir, man, [&](const Piece& p, int64_t skip, const char* data,
                                        int64_t n) {
    if (p.section != 0) return absl::OkStatus();
    // Pieces start at 4-byte multiples of the file and of the read buffer (a malloc'd block
    // read in 8 MiB chunks), so the bytes are floats in place.
    assert(skip % 4 == 0 && n % 4 == 0 && reinterpret_cast<uintptr_t>(data) % alignof(float) == 0);
    return sink(p.param, p.elem + skip / 4,
                absl::Span<const float>(reinterpret_cast<const float*>(data),
                                        static_cast<size_t>(n / 4)));
  });
}

namespace {

// A file or directory by identity rather than by name: a checkpoint reached through a second
// path (a bind mount, a symlink, a hard link) is still the same device and inode.
struct FileId {
  dev_t dev;
  ino_t ino;
  bool operator==(const FileId& o) const { return dev == o.dev && ino == o.ino; }
};

FileId IdOf(const struct stat& st) { return FileId{st.st_dev, st.st_ino}; }

std::optional<FileId> StatId(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return std::nullopt;
  return IdOf(st);
}

// `out`'s parent directory and every directory above it, walking ".." from an open descriptor
// (so symlinks and bind mounts are seen as what they lead to). NotFound when the parent cannot
// be opened.
absl::StatusOr<std::vector<FileId>> AncestorIds(const std::string& out) {
  const std::string parent = ckpt_internal::Dirname(out);
  int fd = ::open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat("output directory '", parent, "': ",
                                            std::strerror(errno)));
  }
  std::vector<FileId> ids;
  for (int depth = 0; depth < 4096; ++depth) {  // bounded: a loop would be a kernel bug
    struct stat st;
    if (::fstat(fd, &st) != 0) break;
    if (!ids.empty() && ids.back() == IdOf(st)) break;  // "/": its ".." is itself
    ids.push_back(IdOf(st));
    const int up = ::openat(fd, "..", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    ::close(fd);
    fd = up;
    if (fd < 0) break;
  }
  if (fd >= 0) ::close(fd);
  return ids;
}

// The files of step directory `dir` and its root's `latest`: what `out` must not be.
std::vector<FileId> CheckpointFileIds(const std::string& dir) {
  std::vector<FileId> ids;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const struct dirent* e = ::readdir(d)) {
      struct stat st;
      if (::fstatat(::dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode)) {
        ids.push_back(IdOf(st));
      }
    }
    ::closedir(d);
  }
  const std::string root = ckpt_internal::Dirname(dir);
  for (const char* name : {kLatestName, ckpt_internal::DirLock::kFileName}) {
    struct stat st;
    if (::lstat(JoinPath(root, name).c_str(), &st) == 0) ids.push_back(IdOf(st));
  }
  return ids;
}

std::string BaseName(absl::string_view path) {
  while (path.size() > 1 && path.back() == '/') path.remove_suffix(1);
  const size_t slash = path.rfind('/');
  return std::string(slash == absl::string_view::npos ? path : path.substr(slash + 1));
}

// Consolidate never writes into the checkpoint it reads: not inside the directory given, nor
// inside the step directory it resolved to, nor over the root's own `latest`, lock or steps,
// nor over any file of the checkpoint under another name. Compared by device and inode, so a
// second path to the checkpoint (bind mount, symlink) is recognised.
absl::Status CheckOutsideCheckpoint(const std::string& path, const std::string& dir,
                                    const std::string& out) {
  ASSIGN_OR_RETURN(const std::vector<FileId> above, AncestorIds(out));
  auto refuse = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "refusing to write '", out, "' ", why, " (the checkpoint being read): write the "
        "consolidated file elsewhere"));
  };
  for (const std::string& d : {path, dir}) {
    const std::optional<FileId> id = StatId(d);
    if (id && std::find(above.begin(), above.end(), *id) != above.end()) {
      return refuse(absl::StrCat("inside '", d, "'"));
    }
  }
  const std::string root = ckpt_internal::Dirname(dir);
  const std::optional<FileId> root_id = StatId(root);
  const std::string name = BaseName(out);
  if (root_id && !above.empty() && above.front() == *root_id &&
      (absl::StartsWith(name, kLatestName) || absl::StartsWith(name, "step_") ||
       name == ckpt_internal::DirLock::kFileName)) {
    return refuse(absl::StrCat("over a file of '", root, "'"));
  }
  struct stat st;
  if (::lstat(out.c_str(), &st) == 0) {
    const std::vector<FileId> files = CheckpointFileIds(dir);
    if (std::find(files.begin(), files.end(), IdOf(st)) != files.end()) {
      return refuse("over a file of the checkpoint under another name");
    }
  }
  return absl::OkStatus();
}

// With --force only a regular file (or a symlink, replaced itself) may be replaced: a FIFO,
// a device node, a socket or a directory at `out` is someone else's, never ours to swap out.
absl::Status CheckReplaceable(const std::string& out) {
  struct stat st;
  if (::lstat(out.c_str(), &st) != 0 || S_ISREG(st.st_mode) || S_ISLNK(st.st_mode)) {
    return absl::OkStatus();
  }
  const char* kind = S_ISDIR(st.st_mode)    ? "a directory"
                     : S_ISFIFO(st.st_mode) ? "a FIFO"
                     : S_ISCHR(st.st_mode)  ? "a character device"
                     : S_ISBLK(st.st_mode)  ? "a block device"
                     : S_ISSOCK(st.st_mode) ? "a socket"
                                            : "not a regular file";
  return absl::InvalidArgumentError(absl::StrCat(
      "refusing to replace '", out, "': it is ", kind, ", not a regular file"));
}

// The tensor names consolidate writes, each unique, none the safetensors metadata key.
absl::Status CheckTensorNames(const CheckpointInfo& info) {
  std::vector<std::string> all;
  for (const auto& p : info.params) {
    if (p.name == "__metadata__") {
      return absl::InvalidArgumentError(
          "cannot consolidate: a parameter is named '__metadata__', the key safetensors "
          "reserves for its metadata");
    }
    for (const char* prefix : {"", "exp_avg.", "exp_avg_sq."}) all.push_back(prefix + p.name);
  }
  std::sort(all.begin(), all.end());
  for (size_t k = 1; k < all.size(); ++k) {
    if (all[k] == all[k - 1]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cannot consolidate: tensor name '", all[k], "' would appear twice (a parameter "
          "is named like another's Adam moment)"));
    }
  }
  return absl::OkStatus();
}

// safetensors: u64 little-endian header length, JSON header, then the tensors back to back.
// `offsets[k][i]` receives where tensor (section k, parameter i) starts in the file.
std::string SafetensorsHeader(const CheckpointInfo& info,
                              std::vector<std::vector<int64_t>>* offsets) {
  nlohmann::ordered_json header;
  header["__metadata__"] = {{"format", "pt"},
                            {"producer", "zerort ckpt consolidate"},
                            {"source", info.dir},
                            {"step", absl::StrCat(info.step)},
                            {"loss_scale", absl::StrCat(info.loss_scale)},
                            {"config_hash", info.config_hash}};
  // Bounded by ParseManifest: fewer than 2^57 elements in all, so no sum here overflows.
  int64_t offset = 0;
  const char* prefixes[3] = {"", "exp_avg.", "exp_avg_sq."};
  offsets->assign(3, std::vector<int64_t>(info.params.size()));
  for (int k = 0; k < 3; ++k) {
    for (size_t i = 0; i < info.params.size(); ++i) {
      const int64_t bytes = info.params[i].numel * 4;
      header[absl::StrCat(prefixes[k], info.params[i].name)] = {
          {"dtype", "F32"},
          {"shape", info.params[i].shape},
          {"data_offsets", {offset, offset + bytes}}};
      (*offsets)[k][i] = offset;
      offset += bytes;
    }
  }
  // A source path that is not UTF-8 is written with U+FFFD in its place (JSON cannot hold it).
  std::string h = header.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  h.resize((h.size() + 7) / 8 * 8, ' ');  // tensors start 8-byte aligned
  std::string file(8, '\0');
  for (int b = 0; b < 8; ++b) {
    file[b] = static_cast<char>((static_cast<uint64_t>(h.size()) >> (8 * b)) & 0xff);
  }
  const int64_t data_start = static_cast<int64_t>(file.size() + h.size());
  for (auto& section : *offsets) {
    for (int64_t& o : section) o += data_start;
  }
  return file + h;
}

}  // namespace

absl::Status ConsolidateCheckpoint(const std::string& path, const std::string& out,
                                   const ConsolidateOptions& options) {
  FileSystem* fs = Fs(options.fs);
  ASSIGN_OR_RETURN(std::string dir, ResolveDir(fs, path));
  ASSIGN_OR_RETURN(Manifest man, ReadManifest(fs, dir));
  const CheckpointInfo info = InfoOf(man, dir);
  RETURN_IF_ERROR(CheckTensorNames(info));
  RETURN_IF_ERROR(CheckOutsideCheckpoint(path, dir, out));
  if (!options.overwrite && fs->Exists(out)) {
    return absl::AlreadyExistsError(
        absl::StrCat("'", out, "' exists: refusing to overwrite it (--force replaces it)"));
  }
  RETURN_IF_ERROR(CheckReplaceable(out));
  RETURN_IF_ERROR(CheckShardSizes(fs, dir, man));
  std::vector<std::vector<int64_t>> offsets;
  const std::string header = SafetensorsHeader(info, &offsets);
  // The tensors go straight from each shard's read buffer to their place in the output: memory
  // stays at one read buffer whatever the checkpoint's size.
  ASSIGN_OR_RETURN(std::unique_ptr<ckpt_internal::PublishedFile> file,
                   ckpt_internal::PublishedFile::Create(out, !options.named_temporary));
  RETURN_IF_ERROR(file->WriteAt(0, header));
  RETURN_IF_ERROR(StreamShards(fs, dir, man, [&](const Piece& p, int64_t skip, const char* data,
                                                 int64_t n) {
    return file->WriteAt(offsets[p.section][p.param] + p.elem * 4 + skip,
                         absl::string_view(data, static_cast<size_t>(n)));
  }));
  return file->Commit(options.overwrite);
}

}  // namespace zerort
