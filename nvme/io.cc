#include "nvme/io.h"

#include <dirent.h>
#include <fcntl.h>
#include <liburing.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "memory/pinned_pool.h"

namespace zerort {
namespace nvme {
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
  int64_t pending ABSL_GUARDED_BY(mu) = 0;  // pieces not completed
  absl::Status status ABSL_GUARDED_BY(mu);   // the first error
  std::atomic<bool> failed{false};           // later pieces are skipped, not submitted

  void Complete(const absl::Status& s) {
    absl::MutexLock lock(&mu);
    if (!s.ok() && status.ok()) {
      status = s;
      failed = true;
    }
    --pending;
  }
};

// A piece queued on an I/O thread, with the job it completes.
struct Queued {
  Piece piece;
  std::shared_ptr<Job> job;
};

void Prep(io_uring_sqe* sqe, const Piece& p, uint64_t slot) {
  if (p.op == IoOp::kRead) {
    io_uring_prep_read(sqe, p.file->fd(), p.buffer, static_cast<unsigned>(p.bytes), p.offset);
  } else {
    io_uring_prep_write(sqe, p.file->fd(), p.buffer, static_cast<unsigned>(p.bytes), p.offset);
  }
  io_uring_sqe_set_data64(sqe, slot);
}

}  // namespace

// One I/O thread with its own ring. Pieces of every ticket share one queue, so the ring stays
// queue_depth deep across ticket boundaries (a read of chunk k+1 fills the slots the write of
// chunk k-1 frees): the step pattern measured 0.82 of fio's bandwidth with one ticket at a time.
class IoThread {
 public:
  // Sets *rc to the ring's set-up result; the thread keeps running only if it is 0.
  IoThread(const AioOptions& o, int* rc) : o_(o), slots_(static_cast<size_t>(o.queue_depth)) {
    for (int i = o.queue_depth - 1; i >= 0; --i) free_.push_back(i);
    std::promise<int> ready;
    std::future<int> result = ready.get_future();
    thread_ = std::thread([this, &ready] {
      const int init = InitRing();
      ready.set_value(init);
      if (init != 0) return;
      Loop();
      Close();
    });
    *rc = result.get();
    if (*rc != 0) thread_.join();
  }
  ~IoThread() {
    if (!thread_.joinable()) return;  // the ring never initialised
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }
  void Push(std::vector<Queued> pieces) {
    bool wake;
    {
      absl::MutexLock lock(&mu_);
      for (Queued& q : pieces) queue_.push_back(std::move(q));
      wake = std::exchange(waiting_, false);
    }
    if (wake) eventfd_write(wake_fd_, 1);
  }

 private:
  // Called on the I/O thread, which alone submits and reaps: the ring is its single issuer, so
  // completions need no interrupt of it (COOP_TASKRUN) and their task work runs when it waits
  // (DEFER_TASKRUN), as fio sets its rings up. Kernels before 6.1 lack these: plain ring.
  int InitRing();
  void Close();  // the wake read completed, the ring and the eventfd closed
  void Loop();
  // Keeps a read of the eventfd in flight, so that Push can end the thread's wait for
  // completions when new pieces arrive and slots are free. Without it a piece queued while
  // the ring waits starts only at the next completion: with one-piece requests (parameter
  // pieces, a fio-like loop) the ring ran one short of queue_depth most of the time.
  void ArmWake();
  // Takes queued pieces into free slots; returns false when stopping with nothing left.
  bool Fill(std::vector<Queued>* taken);
  void Submit(std::vector<Queued>* taken);
  // Reaps at least `wait` completions (and whatever else has arrived).
  void Reap(unsigned wait);

  static constexpr uint64_t kWakeTag = ~uint64_t{0};  // user_data of the eventfd read

  const AioOptions& o_;
  io_uring ring_;
  int wake_fd_ = -1;         // -1: no eventfd, no wake (a piece waits for a completion)
  uint64_t wake_value_ = 0;  // the eventfd read's target
  bool wake_armed_ = false;  // I/O thread only
  std::vector<Queued> slots_;  // in flight, by slot (user_data); I/O thread only
  std::vector<int> free_;      // free slots; I/O thread only
  absl::Mutex mu_;
  std::deque<Queued> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool waiting_ ABSL_GUARDED_BY(mu_) = false;  // waiting for completions with free slots
  std::thread thread_;
};

int IoThread::InitRing() {
  const unsigned depth = static_cast<unsigned>(o_.queue_depth) + 1;  // + the wake read
  unsigned flags = IORING_SETUP_COOP_TASKRUN | IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN;
  int rc;
  for (;;) {
    io_uring_params p;
    std::memset(&p, 0, sizeof p);
    p.flags = flags;
    rc = io_uring_queue_init_params(depth, &ring_, &p);
    if (rc != -EINVAL || flags == 0) break;
    flags = (flags & IORING_SETUP_DEFER_TASKRUN) ? IORING_SETUP_COOP_TASKRUN : 0;
  }
  if (rc == 0 && o_.overlap_events) wake_fd_ = eventfd(0, EFD_CLOEXEC);
  return rc;
}

void IoThread::ArmWake() {
  if (wake_fd_ < 0 || wake_armed_) return;
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);  // the ring has one entry beyond the slots
  io_uring_prep_read(sqe, wake_fd_, &wake_value_, sizeof wake_value_, 0);
  io_uring_sqe_set_data64(sqe, kWakeTag);
  io_uring_submit(&ring_);
  wake_armed_ = true;
}

void IoThread::Close() {
  if (wake_armed_) {  // complete the read rather than leave the kernel a target to write
    eventfd_write(wake_fd_, 1);
    while (wake_armed_) Reap(1);
  }
  io_uring_queue_exit(&ring_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

void IoThread::Loop() {
  std::vector<Queued> taken;
  while (Fill(&taken)) {
    Submit(&taken);
    const int inflight = o_.queue_depth - static_cast<int>(free_.size());
    if (inflight > 0 && o_.overlap_events) {
      ArmWake();
      Reap(1);
    } else if (inflight > 0) {
      Reap(static_cast<unsigned>(inflight));
    }
  }
}

bool IoThread::Fill(std::vector<Queued>* taken) {
  taken->clear();
  absl::MutexLock lock(&mu_);
  if (free_.size() == slots_.size()) {  // idle: sleep until work or stop
    mu_.Await(absl::Condition(
        +[](IoThread* t) { return t->stop_ || !t->queue_.empty(); }, this));
    if (queue_.empty()) return false;
  }
  // Without overlap_events, a batch is submitted only once the previous one has completed.
  if (!o_.overlap_events && free_.size() != slots_.size()) return true;
  while (!queue_.empty() && taken->size() < free_.size()) {
    taken->push_back(std::move(queue_.front()));
    queue_.pop_front();
  }
  // The thread is about to wait for completions; a Push before then must wake it.
  waiting_ = taken->size() < free_.size();
  return true;
}

// Submits the taken pieces; a piece of a failed job, or one the fault seam fails, completes at
// once without I/O.
void IoThread::Submit(std::vector<Queued>* taken) {
  int queued = 0;
  for (Queued& q : *taken) {
    const Piece& p = q.piece;
    std::optional<int> fault;
    if (q.job->failed) fault = static_cast<int>(p.bytes);  // skipped: the job already failed
    if (!fault && o_.fault) fault = o_.fault(p.op, p.file->path(), p.offset, p.bytes);
    if (fault.has_value()) {
      q.job->Complete(PieceStatus(p, *fault));
      continue;
    }
    const int slot = free_.back();
    free_.pop_back();
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);  // never null: one sqe per free slot
    Prep(sqe, p, static_cast<uint64_t>(slot));
    slots_[slot] = std::move(q);
    ++queued;
    if (o_.single_submit) io_uring_submit(&ring_);
  }
  if (queued > 0 && !o_.single_submit) io_uring_submit(&ring_);
}

void IoThread::Reap(unsigned wait) {
  io_uring_cqe* cqe = nullptr;
  int rc;
  do {
    rc = io_uring_wait_cqe_nr(&ring_, &cqe, wait);
  } while (rc == -EINTR);
  if (rc < 0) {  // the ring itself failed: fail every piece in flight
    const absl::Status s = absl::InternalError(absl::StrCat("io_uring_wait_cqe: ", ErrnoText(-rc)));
    for (size_t i = 0; i < slots_.size(); ++i) {
      if (slots_[i].job == nullptr) continue;
      slots_[i].job->Complete(s);
      slots_[i] = Queued();
      free_.push_back(static_cast<int>(i));
    }
    wake_armed_ = false;  // so Close does not wait on a broken ring; queue exit cancels the read
    return;
  }
  unsigned head, count = 0;
  io_uring_for_each_cqe(&ring_, head, cqe) {
    ++count;
    if (io_uring_cqe_get_data64(cqe) == kWakeTag) {  // Push woke the thread: re-armed on waiting
      wake_armed_ = false;
      continue;
    }
    const int slot = static_cast<int>(io_uring_cqe_get_data64(cqe));
    Queued done = std::move(slots_[slot]);
    slots_[slot] = Queued();
    free_.push_back(slot);
    done.job->Complete(PieceStatus(done.piece, cqe->res));
  }
  io_uring_cq_advance(&ring_, count);
}

struct AioEngine::Impl {
  std::vector<std::unique_ptr<IoThread>> threads;
  absl::Mutex mu;
  Ticket next_ticket ABSL_GUARDED_BY(mu) = 1;
  std::map<Ticket, std::shared_ptr<Job>> jobs ABSL_GUARDED_BY(mu);
};

namespace {

absl::Mutex fault_mu(absl::kConstInit);
IoFaultHook* global_fault ABSL_GUARDED_BY(fault_mu) = nullptr;

AioOptions WithGlobalFault(AioOptions o) {
  absl::MutexLock lock(&fault_mu);
  if (!o.fault && global_fault != nullptr) o.fault = *global_fault;
  return o;
}

}  // namespace

void SetIoFaultForTesting(IoFaultHook hook) {
  absl::MutexLock lock(&fault_mu);
  delete global_fault;
  global_fault = hook ? new IoFaultHook(std::move(hook)) : nullptr;
}

AioEngine::AioEngine(const AioOptions& options)
    : options_(WithGlobalFault(options)), impl_(new Impl) {}

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
  {
    absl::MutexLock lock(&job->mu);
    job->pending = static_cast<int64_t>(pieces.size());
  }
  Ticket ticket;
  {
    absl::MutexLock lock(&impl_->mu);
    ticket = impl_->next_ticket++;
    impl_->jobs[ticket] = job;
  }
  // Thread t takes the contiguous pieces [t*n/nt, (t+1)*n/nt): each thread streams its range.
  const size_t n = pieces.size(), nt = impl_->threads.size();
  for (size_t t = 0; t < nt; ++t) {
    std::vector<Queued> share;
    for (size_t i = t * n / nt; i < (t + 1) * n / nt; ++i) share.push_back({pieces[i], job});
    if (!share.empty()) impl_->threads[t]->Push(std::move(share));
  }
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
  job->mu.Await(absl::Condition(+[](int64_t* p) { return *p == 0; }, &job->pending));
  return job->status;
}

// ---- swap files ----

// Directories zerort-<pid>-...-rank<rank> under `nvme_path` whose process no longer exists:
// the swap files of a run that crashed.
std::vector<std::string> DeadRunDirs(const std::string& nvme_path, int rank) {
  std::vector<std::string> dead;
  DIR* d = opendir(nvme_path.c_str());
  if (d == nullptr) return dead;
  const std::string suffix = absl::StrCat("-rank", rank);
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name.rfind("zerort-", 0) != 0 || name.size() < suffix.size() ||
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
      continue;
    }
    const std::string pid_text = name.substr(7, name.find('-', 7) - 7);
    int pid = 0;
    if (!absl::SimpleAtoi(pid_text, &pid) || pid <= 0) continue;
    if (kill(pid, 0) != 0 && errno == ESRCH) dead.push_back(nvme_path + "/" + name);
  }
  closedir(d);
  return dead;
}

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
  if (std::vector<std::string> dead = DeadRunDirs(nvme_path, rank); !dead.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "swap directories of a run that did not shut down cleanly (its process is gone): ",
        absl::StrJoin(dead, ", "), "; they are never reused: remove them"));
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
      // Linux creates the file before it refuses O_DIRECT (ramfs, some FUSE and network file
      // systems): remove it, or the directory outlives us and the next run is refused as the
      // leftover of an unclean shutdown. It is ours: O_EXCL, in our own 0700 directory.
      unlink(path.c_str());
      return absl::InvalidArgumentError(absl::StrCat(
          "open ", path, " with O_DIRECT: the file system does not support direct I/O; "
          "name a directory on a local disk as nvme_path"));
    }
    return absl::InvalidArgumentError(absl::StrCat("open ", path, ": ", ErrnoText(err)));
  }
  const int64_t size = RoundUpToIo(bytes);
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
  const int64_t size = RoundUpToIo(bytes);
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

}  // namespace nvme
}  // namespace zerort
