// PosixForwardingFs: a checkpoint FileSystem that passes every call to PosixFileSystem(), the
// base of the tests' fault injectors, which override only the calls they fail.
//
//   class FailCreate : public testing::PosixForwardingFs {
//    public:
//     absl::StatusOr<std::unique_ptr<ckpt_internal::WritableFile>> NewWritableFile(
//         const std::string& path) override {
//       if (absl::EndsWith(path, "/manifest.json")) return absl::UnavailableError("injected");
//       return posix()->NewWritableFile(path);
//     }
//   };
//
// Thread-safe, as PosixFileSystem() is; a subclass's own state is its own to guard.
#ifndef ZERORT_CHECKPOINT_TESTING_POSIX_FORWARDING_FS_H_
#define ZERORT_CHECKPOINT_TESTING_POSIX_FORWARDING_FS_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/internal/ckpt_fs.h"

namespace zerort {
namespace testing {

class PosixForwardingFs : public ckpt_internal::FileSystem {
 public:
  absl::StatusOr<std::unique_ptr<ckpt_internal::WritableFile>> NewWritableFile(
      const std::string& path) override {
    return posix()->NewWritableFile(path);
  }
  absl::StatusOr<std::unique_ptr<ckpt_internal::ReadableFile>> NewReadableFile(
      const std::string& path) override {
    return posix()->NewReadableFile(path);
  }
  absl::StatusOr<int64_t> FileSize(const std::string& path) override {
    return posix()->FileSize(path);
  }
  bool Exists(const std::string& path) override { return posix()->Exists(path); }
  bool IsDirectory(const std::string& path) override { return posix()->IsDirectory(path); }
  absl::Status MakeDir(const std::string& path) override { return posix()->MakeDir(path); }
  absl::Status SyncDir(const std::string& path) override { return posix()->SyncDir(path); }
  absl::Status Rename(const std::string& from, const std::string& to) override {
    return posix()->Rename(from, to);
  }
  absl::Status RemoveAll(const std::string& path) override { return posix()->RemoveAll(path); }

 protected:
  // The real file system, for an override's call through.
  static ckpt_internal::FileSystem* posix() { return ckpt_internal::PosixFileSystem(); }
};

}  // namespace testing
}  // namespace zerort

#endif  // ZERORT_CHECKPOINT_TESTING_POSIX_FORWARDING_FS_H_
