// The file-system seam of checkpoints: the few operations a durable save needs (write, fsync,
// rename, directory fsync), behind an interface so that tests can inject failures and crashes at
// every one of them. PosixFileSystem() is the real thing.
//
// Durability contract the checkpoint code relies on: data written through a WritableFile is
// durable after Sync(); a new or renamed directory entry is durable after SyncDir(parent).
//
// Thread safety: implementations must be thread-safe (the ranks of an in-process group share
// one); a WritableFile / ReadableFile is used by one thread at a time.
#ifndef ZERORT_CHECKPOINT_INTERNAL_CKPT_FS_H_
#define ZERORT_CHECKPOINT_INTERNAL_CKPT_FS_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

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
  // Creates or truncates.
  virtual absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(
      const std::string& path) = 0;
  virtual absl::StatusOr<std::unique_ptr<ReadableFile>> NewReadableFile(
      const std::string& path) = 0;
  // NotFound when absent.
  virtual absl::StatusOr<int64_t> FileSize(const std::string& path) = 0;
  virtual bool Exists(const std::string& path) = 0;
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

// Writes `path` so that a crash leaves either the old content or the new one: write
// `path`.tmp, fsync, close, rename over `path`, fsync the parent directory.
absl::Status WriteFileAtomically(FileSystem* fs, const std::string& path, absl::string_view data);

}  // namespace ckpt_internal
}  // namespace zerort

#endif  // ZERORT_CHECKPOINT_INTERNAL_CKPT_FS_H_
