#include "checkpoint/internal/ckpt_fs.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace zerort {
namespace ckpt_internal {
namespace {

absl::Status ErrnoStatus(int err, absl::string_view op, absl::string_view path) {
  const std::string msg = absl::StrCat(op, " '", path, "': ", std::strerror(err));
  switch (err) {
    case ENOENT: case ENOTDIR: return absl::NotFoundError(msg);
    case EACCES: case EPERM: case EROFS: return absl::PermissionDeniedError(msg);
    case ENOSPC: case EDQUOT: case ENOMEM: return absl::ResourceExhaustedError(msg);
    case EEXIST: case ENOTEMPTY: return absl::AlreadyExistsError(msg);
    case EINVAL: case ENAMETOOLONG: case EISDIR: return absl::InvalidArgumentError(msg);
    default: return absl::UnavailableError(msg);
  }
}

class PosixWritable : public WritableFile {
 public:
  PosixWritable(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  ~PosixWritable() override {
    if (fd_ >= 0) ::close(fd_);
  }
  absl::Status Append(absl::string_view data) override {
    while (!data.empty()) {
      const ssize_t n = ::write(fd_, data.data(), data.size());
      if (n < 0) {
        if (errno == EINTR) continue;
        return ErrnoStatus(errno, "write", path_);
      }
      data.remove_prefix(static_cast<size_t>(n));
    }
    return absl::OkStatus();
  }
  absl::Status Sync() override {
    if (::fsync(fd_) != 0) return ErrnoStatus(errno, "fsync", path_);
    return absl::OkStatus();
  }
  absl::Status Close() override {
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) return ErrnoStatus(errno, "close", path_);
    return absl::OkStatus();
  }

 private:
  int fd_;
  const std::string path_;
};

class PosixReadable : public ReadableFile {
 public:
  PosixReadable(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  ~PosixReadable() override { ::close(fd_); }
  absl::StatusOr<size_t> Read(char* buf, size_t n) override {
    while (true) {
      const ssize_t r = ::read(fd_, buf, n);
      if (r >= 0) return static_cast<size_t>(r);
      if (errno != EINTR) return ErrnoStatus(errno, "read", path_);
    }
  }

 private:
  const int fd_;
  const std::string path_;
};

absl::Status RemoveTree(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return ErrnoStatus(errno, "stat", path);
  }
  if (S_ISDIR(st.st_mode)) {
    DIR* d = ::opendir(path.c_str());
    if (d == nullptr) return ErrnoStatus(errno, "opendir", path);
    absl::Status status;
    while (struct dirent* e = ::readdir(d)) {
      if (std::strcmp(e->d_name, ".") == 0 || std::strcmp(e->d_name, "..") == 0) continue;
      status.Update(RemoveTree(JoinPath(path, e->d_name)));
    }
    ::closedir(d);
    RETURN_IF_ERROR(status);
    if (::rmdir(path.c_str()) != 0) return ErrnoStatus(errno, "rmdir", path);
    return absl::OkStatus();
  }
  if (::unlink(path.c_str()) != 0) return ErrnoStatus(errno, "unlink", path);
  return absl::OkStatus();
}

class Posix : public FileSystem {
 public:
  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path) override {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return ErrnoStatus(errno, "create", path);
    return std::unique_ptr<WritableFile>(new PosixWritable(fd, path));
  }
  absl::StatusOr<std::unique_ptr<ReadableFile>> NewReadableFile(const std::string& path) override {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus(errno, "open", path);
    return std::unique_ptr<ReadableFile>(new PosixReadable(fd, path));
  }
  absl::StatusOr<int64_t> FileSize(const std::string& path) override {
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) return ErrnoStatus(errno, "stat", path);
    if (!S_ISREG(st.st_mode)) {
      return absl::FailedPreconditionError(absl::StrCat("'", path, "' is not a regular file"));
    }
    return static_cast<int64_t>(st.st_size);
  }
  bool Exists(const std::string& path) override {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0;
  }
  absl::Status MakeDir(const std::string& path) override {
    if (::mkdir(path.c_str(), 0755) == 0) return absl::OkStatus();
    const int err = errno;
    struct stat st;
    if (err == EEXIST && ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
      return absl::OkStatus();
    }
    return ErrnoStatus(err, "mkdir", path);
  }
  absl::Status SyncDir(const std::string& path) override {
    const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus(errno, "open directory", path);
    const int rc = ::fsync(fd);
    const int err = errno;
    ::close(fd);
    if (rc != 0) return ErrnoStatus(err, "fsync directory", path);
    return absl::OkStatus();
  }
  absl::Status Rename(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0) {
      return ErrnoStatus(errno, absl::StrCat("rename to '", to, "' of"), from);
    }
    return absl::OkStatus();
  }
  absl::Status RemoveAll(const std::string& path) override { return RemoveTree(path); }
};

}  // namespace

FileSystem* PosixFileSystem() {
  static Posix* fs = new Posix();
  return fs;
}

std::string JoinPath(absl::string_view dir, absl::string_view name) {
  if (dir.empty()) return std::string(name);
  if (dir.back() == '/') return absl::StrCat(dir, name);
  return absl::StrCat(dir, "/", name);
}

std::string Dirname(absl::string_view path) {
  while (path.size() > 1 && path.back() == '/') path.remove_suffix(1);
  const size_t slash = path.rfind('/');
  if (slash == absl::string_view::npos) return ".";
  if (slash == 0) return "/";
  return std::string(path.substr(0, slash));
}

absl::StatusOr<std::string> ReadSmallFile(FileSystem* fs, const std::string& path,
                                          int64_t max_bytes) {
  ASSIGN_OR_RETURN(int64_t size, fs->FileSize(path));
  if (size > max_bytes) {
    return absl::FailedPreconditionError(
        absl::StrCat("'", path, "' holds ", size, " bytes, more than the ", max_bytes,
                     " expected at most"));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<ReadableFile> f, fs->NewReadableFile(path));
  std::string out(static_cast<size_t>(size), '\0');
  size_t got = 0;
  while (got < out.size()) {
    ASSIGN_OR_RETURN(size_t n, f->Read(&out[got], out.size() - got));
    if (n == 0) break;
    got += n;
  }
  out.resize(got);
  return out;
}

absl::Status WriteFileAtomically(FileSystem* fs, const std::string& path,
                                 absl::string_view data) {
  const std::string tmp = path + ".tmp";
  {
    ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> f, fs->NewWritableFile(tmp));
    RETURN_IF_ERROR(f->Append(data));
    RETURN_IF_ERROR(f->Sync());
    RETURN_IF_ERROR(f->Close());
  }
  RETURN_IF_ERROR(fs->Rename(tmp, path));
  return fs->SyncDir(Dirname(path));
}

}  // namespace ckpt_internal
}  // namespace zerort
