#include "offload/nvme_io.h"

#include <dirent.h>
#include <fcntl.h>
#include <liburing.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <map>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "memory/pinned_pool.h"

namespace zerort {
namespace offload {
namespace {

constexpr long kTmpfsMagic = 0x01021994;  // linux/magic.h TMPFS_MAGIC

std::string ErrnoText(int err) { return std::strerror(err); }

// One block_size piece of a request.
struct Piece {
  IoOp op;
  const SwapFile* file;
  int64_t offset;
  char* buffer;
  int64_t bytes;
};

const char* OpName(IoOp op) { return op == IoOp::kRead ? "read" : "write"; }

// The status of a piece that completed with `res` (bytes, or -errno).
absl::Status PieceStatus(const Piece& p, int res) {
  if (res == p.bytes) return absl::OkStatus();
  const std::string where = absl::StrCat("nvme ", OpName(p.op), " of ", p.file->path(),
                                         " at offset ", p.offset, " (", p.bytes, " bytes)");
  if (res >= 0) {
    return absl::DataLossError(absl::StrCat("short ", where, ": ", res, " bytes transferred"));
  }
  if (-res == ENOSPC) return absl::ResourceExhaustedError(absl::StrCat(where, ": ", ErrnoText(-res)));
  return absl::InternalError(absl::StrCat(where, ": ", ErrnoText(-res)));
}

// Everything submitted under one ticket.
struct Job {
  absl::Mutex mu;
  int pending ABSL_GUARDED_BY(mu) = 0;  // tasks not finished
  absl::Status status ABSL_GUARDED_BY(mu);

  void Finish(const absl::Status& s) {
    absl::MutexLock lock(&mu);
    if (status.ok()) status = s;
    --pending;
  }
};

// A contiguous share of a job's pieces, for one I/O thread.
struct Task {
  std::shared_ptr<Job> job;
  std::vector<Piece> pieces;
};

void Prep(io_uring_sqe* sqe, const Piece& p, uint64_t index) {
  if (p.op == IoOp::kRead) {
    io_uring_prep_read(sqe, p.file->fd(), p.buffer, static_cast<unsigned>(p.bytes), p.offset);
  } else {
    io_uring_prep_write(sqe, p.file->fd(), p.buffer, static_cast<unsigned>(p.bytes), p.offset);
  }
  io_uring_sqe_set_data64(sqe, index);
}

}  // namespace

// One I/O thread with its own ring and queue of tasks.
class IoThread {
 public:
  // Sets *rc to io_uring_queue_init's result; the thread runs only if it is 0.
  IoThread(const AioOptions& o, int* rc) : o_(o) {
    *rc = io_uring_queue_init(static_cast<unsigned>(o.queue_depth), &ring_, 0);
    if (*rc == 0) thread_ = std::thread([this] { Loop(); });
  }
  ~IoThread() {
    if (!thread_.joinable()) return;  // the ring never initialised
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
    io_uring_queue_exit(&ring_);
  }
  void Push(Task t) {
    absl::MutexLock lock(&mu_);
    tasks_.push_back(std::move(t));
  }

 private:
  void Loop() {
    for (;;) {
      Task t;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](IoThread* self) { return self->stop_ || !self->tasks_.empty(); }, this));
        if (tasks_.empty()) return;  // stop_ and nothing left
        t = std::move(tasks_.front());
        tasks_.pop_front();
      }
      t.job->Finish(Run(t.pieces));
    }
  }
  absl::Status Run(const std::vector<Piece>& pieces);
  // Reaps at least `wait` completions (and whatever else has arrived).
  void Reap(const std::vector<Piece>& pieces, unsigned wait, int* inflight, absl::Status* err);

  const AioOptions& o_;
  io_uring ring_;
  absl::Mutex mu_;
  std::deque<Task> tasks_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// Keeps up to queue_depth pieces in flight; after the first error submits nothing more and
// drains what is in flight (the buffers must not be touched after return).
absl::Status IoThread::Run(const std::vector<Piece>& pieces) {
  absl::Status err;
  size_t next = 0;
  int inflight = 0;
  while ((err.ok() && next < pieces.size()) || inflight > 0) {
    int queued = 0;
    while (err.ok() && next < pieces.size() && inflight < o_.queue_depth) {
      const Piece& p = pieces[next];
      std::optional<int> fault;
      if (o_.fault) fault = o_.fault(p.op, p.file->path(), p.offset, p.bytes);
      if (fault.has_value()) {
        err.Update(PieceStatus(p, *fault));
        ++next;
        continue;
      }
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);  // never null: inflight < ring entries
      Prep(sqe, p, next++);
      ++inflight;
      ++queued;
      if (o_.single_submit) io_uring_submit(&ring_);
    }
    if (queued > 0 && !o_.single_submit) io_uring_submit(&ring_);
    if (inflight == 0) continue;
    Reap(pieces, o_.overlap_events ? 1u : static_cast<unsigned>(inflight), &inflight, &err);
  }
  return err;
}

void IoThread::Reap(const std::vector<Piece>& pieces, unsigned wait, int* inflight,
                    absl::Status* err) {
  io_uring_cqe* cqe = nullptr;
  int rc;
  do {
    rc = io_uring_wait_cqe_nr(&ring_, &cqe, wait);
  } while (rc == -EINTR);
  if (rc < 0) {  // the ring itself failed: nothing more can be reaped
    err->Update(absl::InternalError(absl::StrCat("io_uring_wait_cqe: ", ErrnoText(-rc))));
    *inflight = 0;
    return;
  }
  unsigned head, count = 0;
  io_uring_for_each_cqe(&ring_, head, cqe) {
    err->Update(PieceStatus(pieces[io_uring_cqe_get_data64(cqe)], cqe->res));
    ++count;
  }
  io_uring_cq_advance(&ring_, count);
  *inflight -= static_cast<int>(count);
}

struct AioEngine::Impl {
  std::vector<std::unique_ptr<IoThread>> threads;
  absl::Mutex mu;
  Ticket next_ticket ABSL_GUARDED_BY(mu) = 1;
  std::map<Ticket, std::shared_ptr<Job>> jobs ABSL_GUARDED_BY(mu);
};

AioEngine::AioEngine(const AioOptions& options) : options_(options), impl_(new Impl) {}

AioEngine::~AioEngine() { impl_->threads.clear(); }  // each thread finishes its queue first

absl::StatusOr<std::unique_ptr<AioEngine>> AioEngine::Create(const AioOptions& options) {
  if (options.block_size <= 0 || options.block_size % kIoAlignment != 0 ||
      options.block_size > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "aio.block_size must be a positive multiple of 4096 up to 1 GiB, got ",
        options.block_size));
  }
  if (options.queue_depth < 1 || options.queue_depth > 4096) {
    return absl::InvalidArgumentError(
        absl::StrCat("aio.queue_depth must be 1..4096, got ", options.queue_depth));
  }
  if (options.thread_count < 1 || options.thread_count > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("aio.thread_count must be 1..64, got ", options.thread_count));
  }
  std::unique_ptr<AioEngine> e(new AioEngine(options));
  for (int t = 0; t < options.thread_count; ++t) {
    int rc = 0;
    auto thread = std::make_unique<IoThread>(e->options_, &rc);
    if (rc < 0) {
      return absl::InternalError(absl::StrCat("io_uring_queue_init(", options.queue_depth,
                                              "): ", ErrnoText(-rc)));
    }
    e->impl_->threads.push_back(std::move(thread));
  }
  return e;
}

AioEngine::Ticket AioEngine::Submit(std::vector<Request> requests) {
  std::vector<Piece> pieces;
  for (const Request& r : requests) {
    for (int64_t off = 0; off < r.bytes; off += options_.block_size) {
      pieces.push_back({r.op, r.file, r.offset + off, r.buffer + off,
                        std::min(options_.block_size, r.bytes - off)});
    }
  }
  auto job = std::make_shared<Job>();
  const size_t nt = std::min(impl_->threads.size(), pieces.size());
  std::vector<Task> tasks(nt);
  for (size_t t = 0; t < nt; ++t) {  // thread t: pieces [t*n/nt, (t+1)*n/nt)
    tasks[t].job = job;
    tasks[t].pieces.assign(pieces.begin() + t * pieces.size() / nt,
                           pieces.begin() + (t + 1) * pieces.size() / nt);
  }
  {
    absl::MutexLock lock(&job->mu);
    job->pending = static_cast<int>(nt);
  }
  Ticket ticket;
  {
    absl::MutexLock lock(&impl_->mu);
    ticket = impl_->next_ticket++;
    impl_->jobs[ticket] = job;
  }
  for (size_t t = 0; t < nt; ++t) impl_->threads[t]->Push(std::move(tasks[t]));
  return ticket;
}

absl::Status AioEngine::Wait(Ticket ticket) {
  std::shared_ptr<Job> job;
  {
    absl::MutexLock lock(&impl_->mu);
    auto it = impl_->jobs.find(ticket);
    if (it == impl_->jobs.end()) {
      return absl::InvalidArgumentError(absl::StrCat("AioEngine: unknown ticket ", ticket));
    }
    job = it->second;
    impl_->jobs.erase(it);
  }
  absl::MutexLock lock(&job->mu);
  job->mu.Await(absl::Condition(+[](int* p) { return *p == 0; }, &job->pending));
  return job->status;
}

// ---- swap files ----

absl::StatusOr<std::unique_ptr<SwapDir>> SwapDir::Create(const std::string& nvme_path,
                                                         const std::string& job, int rank) {
  struct stat st;
  if (nvme_path.empty() || stat(nvme_path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("nvme_path \"", nvme_path, "\" is not an existing directory"));
  }
  struct statfs fs;
  if (statfs(nvme_path.c_str(), &fs) == 0 && static_cast<long>(fs.f_type) == kTmpfsMagic) {
    return absl::InvalidArgumentError(absl::StrCat(
        "nvme_path \"", nvme_path, "\" is on tmpfs: the offloaded state would stay in RAM; "
        "name a directory on a local disk"));
  }
  const std::string dir = absl::StrCat(nvme_path, "/zerort-", job, "-rank", rank);
  if (mkdir(dir.c_str(), 0700) != 0) {
    const int err = errno;
    if (err != EEXIST) {
      return absl::InvalidArgumentError(absl::StrCat("mkdir ", dir, ": ", ErrnoText(err)));
    }
    std::vector<std::string> names;
    if (DIR* d = opendir(dir.c_str())) {
      while (dirent* e = readdir(d)) {
        if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) {
          names.push_back(e->d_name);
        }
      }
      closedir(d);
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "swap directory ", dir, " already exists (left by a run that did not shut down "
        "cleanly, or in use by another process) with files [", absl::StrJoin(names, ", "),
        "]; it is never reused: remove it once no process uses it"));
  }
  return std::unique_ptr<SwapDir>(new SwapDir(dir));
}

SwapDir::~SwapDir() { rmdir(path_.c_str()); }

absl::StatusOr<std::unique_ptr<SwapFile>> SwapDir::CreateFile(const std::string& name,
                                                              int64_t bytes) {
  const std::string path = absl::StrCat(path_, "/", name);
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_DIRECT | O_CLOEXEC, 0600);
  if (fd < 0) {
    const int err = errno;
    if (err == EINVAL) {
      return absl::InvalidArgumentError(absl::StrCat(
          "open ", path, " with O_DIRECT: the file system does not support direct I/O; "
          "name a directory on a local disk as nvme_path"));
    }
    return absl::InvalidArgumentError(absl::StrCat("open ", path, ": ", ErrnoText(err)));
  }
  const int64_t size = (bytes + kIoAlignment - 1) / kIoAlignment * kIoAlignment;
  // Preallocated, so that a full disk fails here rather than halfway through a step.
  if (size > 0 && fallocate(fd, 0, 0, size) != 0) {
    const int err = errno;
    close(fd);
    unlink(path.c_str());
    const std::string msg = absl::StrCat("fallocate ", path, " to ", size, " bytes: ", ErrnoText(err));
    if (err == ENOSPC) return absl::ResourceExhaustedError(msg);
    return absl::InternalError(msg);
  }
  return std::unique_ptr<SwapFile>(new SwapFile(fd, path, size));
}

SwapFile::~SwapFile() {
  close(fd_);
  unlink(path_.c_str());
}

// ---- buffers ----

absl::StatusOr<IoBuffer> IoBuffer::Allocate(int64_t bytes) {
  const int64_t size = (bytes + kIoAlignment - 1) / kIoAlignment * kIoAlignment;
  IoBuffer b;
  if (size == 0) return b;
  auto p = memory::SharedPinnedSlabs()->Allocate(static_cast<size_t>(size));
  if (!p.ok()) return p.status();
  b.data_ = static_cast<char*>(*p);
  b.bytes_ = size;
  return b;
}

IoBuffer& IoBuffer::operator=(IoBuffer&& o) noexcept {
  if (this != &o) {
    this->~IoBuffer();
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

IoBuffer::~IoBuffer() {
  if (data_ != nullptr) memory::SharedPinnedSlabs()->Free(data_, static_cast<size_t>(bytes_));
  data_ = nullptr;
}

}  // namespace offload
}  // namespace zerort
