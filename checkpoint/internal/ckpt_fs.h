// The file-system seam of checkpoints: the few operations a durable save needs (write, fsync,
// rename, directory fsync), behind an interface so that tests can inject failures and crashes at
// every one of them. PosixFileSystem() is the real thing.
//
// Durability contract the checkpoint code relies on: data written through a WritableFile is
// durable after Sync(); a new or renamed directory entry is durable after SyncDir(parent).
//
// Symlinks: no operation follows a symlink in the last component of its path. A checkpoint's
// manifest, shards, `latest` and step directories are plain files and directories; a symlink
// in their place (one pointing outside the checkpoint, or a pre-made `latest.tmp` aimed at a
// file to overwrite) is refused, never followed.
//
// Thread safety: implementations must be thread-safe (the ranks of an in-process group share
// one); a WritableFile / ReadableFile is used by one thread at a time.
#ifndef ZERORT_CHECKPOINT_INTERNAL_CKPT_FS_H_
#define ZERORT_CHECKPOINT_INTERNAL_CKPT_FS_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace zerort {
namespace ckpt_internal {

class WritableFile {
 public:
  virtual ~WritableFile() = default;
  virtual absl::Status Append(absl::string_view data) = 0;
  virtual absl::Status Sync() = 0;   // fsync
  virtual absl::Status Close() = 0;  // REQUIRES: called once; the destructor closes otherwise
};

class ReadableFile {
 public:
  virtual ~ReadableFile() = default;
  // Reads up to `n` bytes sequentially; 0 at the end of the file.
  virtual absl::StatusOr<size_t> Read(char* buf, size_t n) = 0;
};

class FileSystem {
 public:
  virtual ~FileSystem() = default;
  // Creates a new file: AlreadyExists when anything (a symlink included) is at `path`.
  virtual absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(
      const std::string& path) = 0;
  // FailedPrecondition when `path` is a symlink or not a regular file.
  virtual absl::StatusOr<std::unique_ptr<ReadableFile>> NewReadableFile(
      const std::string& path) = 0;
  // NotFound when absent; FailedPrecondition when a symlink or not a regular file.
  virtual absl::StatusOr<int64_t> FileSize(const std::string& path) = 0;
  // Whether anything (a dangling symlink included) is at `path`.
  virtual bool Exists(const std::string& path) = 0;
  // Whether `path` is a directory itself (not a symlink to one).
  virtual bool IsDirectory(const std::string& path) = 0;
  // Creates one directory; OK when it already exists.
  virtual absl::Status MakeDir(const std::string& path) = 0;
  virtual absl::Status SyncDir(const std::string& path) = 0;
  // Atomic replace (POSIX rename).
  virtual absl::Status Rename(const std::string& from, const std::string& to) = 0;
  // Removes a file or a directory tree; OK when absent.
  virtual absl::Status RemoveAll(const std::string& path) = 0;
};

FileSystem* PosixFileSystem();

// "a/b" from ("a", "b"); the parent directory of a path ("." for a bare name).
std::string JoinPath(absl::string_view dir, absl::string_view name);
std::string Dirname(absl::string_view path);

// Reads a whole file of at most `max_bytes` (larger: FailedPrecondition naming the file).
absl::StatusOr<std::string> ReadSmallFile(FileSystem* fs, const std::string& path,
                                          int64_t max_bytes);

// Writes `path` so that a crash leaves either the old content or the new one: remove a
// leftover `path`.tmp (a symlink there is removed, its target untouched), create `path`.tmp
// exclusively, write, fsync, close, rename over `path`, fsync the parent directory. On failure
// `path`.tmp is removed. REQUIRES: no other writer of `path` (checkpoint saves hold the root's
// DirLock).
absl::Status WriteFileAtomically(FileSystem* fs, const std::string& path, absl::string_view data);

// An exclusive advisory lock (flock) on `dir`/.zerort.lock, held until destroyed, so that two
// savers never work in one checkpoint root at once. Released by the kernel when the process
// dies, so a crashed writer never leaves it held. FailedPrecondition when another process or
// another lock object in this one holds it; the lock file is created if absent and never
// followed if it is a symlink. Destruction removes the file, then releases the lock (a live
// save leaves none behind; a killed one leaves an unheld file, which the next save takes);
// Acquire takes a lock only on the file that still has the name.
class DirLock {
 public:
  static constexpr char kFileName[] = ".zerort.lock";
  static absl::StatusOr<std::unique_ptr<DirLock>> Acquire(const std::string& dir);
  ~DirLock();
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;

 private:
  DirLock(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  const int fd_;
  const std::string path_;
};

// A new file that appears at `path` complete or not at all, written at any offset (POSIX
// only: consolidate's output). Create makes an unnamed file (O_TMPFILE) in path's directory,
// or, where the file system lacks O_TMPFILE (or `unnamed` is false), a mkstemp-named
// "<dir>/.<name>.zerort-tmp.XXXXXX" there. Commit fsyncs it and publishes it at `path`: without
// `overwrite`, anything already at `path` (a symlink included) is AlreadyExists, so of two
// writers racing for one path exactly one wins and the other fails cleanly; with `overwrite`
// the entry is replaced by rename (a symlink at `path` is replaced, its target untouched).
// Every failure, and destruction without a Commit, removes the temporary; a process killed
// before Commit leaves nothing with O_TMPFILE, the named temporary otherwise, which stays for
// the user to remove: only what this writer created is ever removed (a file that merely looks
// like a temporary may be anyone's).
// Thread safety: one thread at a time.
class PublishedFile {
 public:
  static absl::StatusOr<std::unique_ptr<PublishedFile>> Create(const std::string& path,
                                                               bool unnamed = true);
  ~PublishedFile();
  PublishedFile(const PublishedFile&) = delete;
  PublishedFile& operator=(const PublishedFile&) = delete;

  absl::Status WriteAt(int64_t offset, absl::string_view data);
  absl::Status Commit(bool overwrite);
  bool unnamed() const { return tmp_.empty(); }

 private:
  PublishedFile(int fd, std::string path, std::string tmp)
      : fd_(fd), path_(std::move(path)), tmp_(std::move(tmp)) {}
  absl::Status LinkUnnamed(const std::string& to);
  int fd_;
  const std::string path_;
  std::string tmp_;  // the named temporary; empty for O_TMPFILE or once published
};

}  // namespace ckpt_internal
}  // namespace zerort

#endif  // ZERORT_CHECKPOINT_INTERNAL_CKPT_FS_H_
