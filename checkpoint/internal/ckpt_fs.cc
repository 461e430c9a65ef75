#include "checkpoint/internal/ckpt_fs.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/file.h>
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

absl::Status SyncDirectory(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "open directory", path);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return ErrnoStatus(err, "fsync directory", path);
  return absl::OkStatus();
}

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

absl::Status NotRegular(const std::string& path, const struct stat& st) {
  return absl::FailedPreconditionError(absl::StrCat(
      "'", path, "' is ", S_ISLNK(st.st_mode) ? "a symlink" : "not a regular file",
      ": checkpoint files are plain files inside the checkpoint"));
}

class Posix : public FileSystem {
 public:
  absl::StatusOr<std::unique_ptr<WritableFile>> NewWritableFile(const std::string& path) override {
    const int fd =
        ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) return ErrnoStatus(errno, "create", path);
    return std::unique_ptr<WritableFile>(new PosixWritable(fd, path));
  }
  absl::StatusOr<std::unique_ptr<ReadableFile>> NewReadableFile(const std::string& path) override {
    // O_NONBLOCK: a FIFO in a shard's place must not block the open; it is refused below.
    const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
      if (errno == ELOOP) return absl::FailedPreconditionError(absl::StrCat(
          "'", path, "' is a symlink: checkpoint files are plain files inside the checkpoint"));
      return ErrnoStatus(errno, "open", path);
    }
    struct stat st;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      const absl::Status s = NotRegular(path, st);
      ::close(fd);
      return s;
    }
    ::fcntl(fd, F_SETFL, 0);  // back to blocking reads
    return std::unique_ptr<ReadableFile>(new PosixReadable(fd, path));
  }
  absl::StatusOr<int64_t> FileSize(const std::string& path) override {
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0) return ErrnoStatus(errno, "stat", path);
    if (!S_ISREG(st.st_mode)) return NotRegular(path, st);
    return static_cast<int64_t>(st.st_size);
  }
  bool Exists(const std::string& path) override {
    struct stat st;
    return ::lstat(path.c_str(), &st) == 0;
  }
  bool IsDirectory(const std::string& path) override {
    struct stat st;
    return ::lstat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
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
  absl::Status SyncDir(const std::string& path) override { return SyncDirectory(path); }
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
  // Debris of an interrupted write, or a planted symlink: removed, never written through.
  RETURN_IF_ERROR(fs->RemoveAll(tmp));
  ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> f, fs->NewWritableFile(tmp));
  absl::Status s = [&]() -> absl::Status {
    RETURN_IF_ERROR(f->Append(data));
    RETURN_IF_ERROR(f->Sync());
    RETURN_IF_ERROR(f->Close());
    return fs->Rename(tmp, path);
  }();
  if (!s.ok()) {
    f.reset();
    (void)fs->RemoveAll(tmp);  // best effort: the error that matters is `s`
    return s;
  }
  return fs->SyncDir(Dirname(path));
}

// --- DirLock ---------------------------------------------------------------------------------

constexpr char DirLock::kFileName[];

absl::StatusOr<std::unique_ptr<DirLock>> DirLock::Acquire(const std::string& dir) {
  const std::string path = JoinPath(dir, kFileName);
  auto busy = [&] {
    return absl::FailedPreconditionError(absl::StrCat(
        "another writer is saving into '", dir, "' (it holds ", path,
        "): save into another directory, or wait for it to finish"));
  };
  // The holder removes the file before it releases the lock, so a lock taken on a file that no
  // longer has the name (opened just before the holder removed it) is stale: open it again.
  for (int attempt = 0; attempt < 8; ++attempt) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) return ErrnoStatus(errno, "open lock file", path);
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      ::close(fd);
      if (err == EWOULDBLOCK) return busy();
      return ErrnoStatus(err, "flock", path);
    }
    struct stat held, named;
    if (::fstat(fd, &held) == 0 && ::lstat(path.c_str(), &named) == 0 &&
        held.st_ino == named.st_ino && held.st_dev == named.st_dev) {
      return std::unique_ptr<DirLock>(new DirLock(fd, path));
    }
    ::close(fd);
  }
  return busy();  // the name kept changing under us: other writers come and go
}

DirLock::~DirLock() {
  // Removed while still held (see Acquire), so a failed or finished save leaves no lock file.
  ::unlink(path_.c_str());
  ::close(fd_);  // releases the flock
}

// --- PublishedFile ---------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<PublishedFile>> PublishedFile::Create(const std::string& path,
                                                                     bool unnamed) {
  absl::string_view base = path;
  const size_t slash = base.rfind('/');
  if (slash != absl::string_view::npos) base.remove_prefix(slash + 1);
  if (base.empty() || base == "." || base == "..") {
    return absl::InvalidArgumentError(
        absl::StrCat("output path '", path, "' does not name a file"));
  }
  const std::string dir = Dirname(path);
  if (unnamed && ::access("/proc/self/fd", X_OK) == 0) {
    const int fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0644);
    if (fd >= 0) return std::unique_ptr<PublishedFile>(new PublishedFile(fd, path, ""));
    if (errno != EOPNOTSUPP && errno != EISDIR && errno != EINVAL) {
      return ErrnoStatus(errno, "create a temporary file in", dir);
    }
  }
  // mkostemp creates the name exclusively (O_EXCL): the file is ours, and only ours is ever
  // removed. Another file that merely looks like a temporary is never touched.
  std::string tmp = JoinPath(dir, absl::StrCat(".", base, ".zerort-tmp.XXXXXX"));
  const int fd = ::mkostemp(&tmp[0], O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(errno, "create a temporary file in", dir);
  ::fchmod(fd, 0644);  // the published file's mode (mkstemp makes 0600)
  return std::unique_ptr<PublishedFile>(new PublishedFile(fd, path, std::move(tmp)));
}

PublishedFile::~PublishedFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!tmp_.empty()) ::unlink(tmp_.c_str());
}

absl::Status PublishedFile::WriteAt(int64_t offset, absl::string_view data) {
  while (!data.empty()) {
    const ssize_t n = ::pwrite(fd_, data.data(), data.size(), offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, "write", path_);
    }
    data.remove_prefix(static_cast<size_t>(n));
    offset += n;
  }
  return absl::OkStatus();
}

absl::Status PublishedFile::LinkUnnamed(const std::string& to) {
  const std::string proc = absl::StrCat("/proc/self/fd/", fd_);
  if (::linkat(AT_FDCWD, proc.c_str(), AT_FDCWD, to.c_str(), AT_SYMLINK_FOLLOW) != 0) {
    return ErrnoStatus(errno, "create", to);
  }
  return absl::OkStatus();
}

absl::Status PublishedFile::Commit(bool overwrite) {
  if (::fsync(fd_) != 0) return ErrnoStatus(errno, "fsync", path_);
  if (!overwrite) {
    // link() never replaces: of two racing writers exactly one creates `path_`.
    if (unnamed()) {
      RETURN_IF_ERROR(LinkUnnamed(path_));
    } else {
      if (::link(tmp_.c_str(), path_.c_str()) != 0) return ErrnoStatus(errno, "create", path_);
      ::unlink(tmp_.c_str());
      tmp_.clear();
    }
  } else {
    if (unnamed()) {
      // rename() needs a name: give the file a fresh one next to `path_` first.
      std::string name;
      absl::Status linked;
      for (int attempt = 0; attempt < 16; ++attempt) {
        name = absl::StrCat(path_, ".", ::getpid(), "-", attempt, "-", fd_, ".tmp");
        linked = LinkUnnamed(name);
        if (!absl::IsAlreadyExists(linked)) break;
      }
      RETURN_IF_ERROR(linked);
      tmp_ = name;
    }
    if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
      return ErrnoStatus(errno, absl::StrCat("rename to '", path_, "' of"), tmp_);
    }
    tmp_.clear();
  }
  const int fd = fd_;
  fd_ = -1;
  ::close(fd);
  return SyncDirectory(Dirname(path_));
}

}  // namespace ckpt_internal
}  // namespace zerort
