// NVMe offload I/O (ZeRO-Infinity): swap files under `nvme_path`, opened with O_DIRECT, read and
// written through io_uring from page-aligned pinned buffers.
//
//   ASSIGN_OR_RETURN(auto dir, SwapDir::Create("/mnt/nvme", "job42", rank));
//   ASSIGN_OR_RETURN(auto file, dir->CreateFile("optimizer_state", bytes));
//   ASSIGN_OR_RETURN(auto io, AioEngine::Create(aio_options));
//   AioEngine::Ticket t = io->Submit({{IoOp::kRead, file.get(), offset, buffer, bytes}});
//   ... compute ...
//   RETURN_IF_ERROR(io->Wait(t));
//
// The aio options mean what DeepSpeed's `aio` keys mean: every request is split into
// `block_size` pieces; each of `thread_count` I/O threads owns one io_uring and a contiguous
// share of a request's pieces, and keeps up to `queue_depth` of them in flight; with
// `single_submit` each piece is submitted by its own system call, otherwise a batch at a time;
// with `overlap_events` a thread submits new pieces as soon as any completes, otherwise it waits
// for the whole batch before submitting the next.
//
// Swap files are created with O_EXCL in a directory of their own,
// <nvme_path>/zerort-<job>-rank<r>/, which is removed (with its files) when the SwapDir is
// destroyed. A directory left by a process that did not shut down cleanly is never reused:
// Create fails naming it and its files if the job name repeats, and, for job names that start
// with a pid ("<pid>-..." as the engine's do), names every zerort-<pid>-...-rank<r> directory
// whose process is gone (a recycled pid hides a leftover; processes in another pid namespace
// sharing nvme_path look gone). A file system that refuses O_DIRECT, or tmpfs (which
// would keep the "offloaded" state in RAM), is refused with an error naming the path: there is
// no buffered fallback.
//
// Errors name the file, the offset and the size of the failing piece: EIO, ENOSPC, and a short
// read or write (reported as DataLoss: O_DIRECT files are preallocated, so a short transfer
// means the device failed). Faults can be injected through AioOptions::fault (tests only).
//
// Thread safety: AioEngine is thread-safe; Submit/Wait may be called from any thread. SwapDir
// and SwapFile are immutable after creation. REQUIRES: buffers, offsets and sizes are multiples
// of kIoAlignment; a buffer stays untouched until its request's Wait returns.
#ifndef ZERORT_NVME_IO_H_
#define ZERORT_NVME_IO_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace zerort {
namespace nvme {

// O_DIRECT needs buffers, offsets and sizes aligned to the device's logical block (512 B or
// 4 KiB); 4 KiB satisfies both, and pinned slabs are page-aligned.
inline constexpr int64_t kIoAlignment = 4096;
inline int64_t RoundUpToIo(int64_t bytes) {
  return (bytes + kIoAlignment - 1) / kIoAlignment * kIoAlignment;
}

// The direction of a request (and of a fault the test seam injects).
enum class IoOp { kRead, kWrite };

// Test seam: called for every piece before it is submitted. A value replaces the piece's
// completion without any I/O: -errno (e.g. -EIO, -ENOSPC) or a byte count < `bytes` (short).
using IoFaultHook = std::function<std::optional<int>(IoOp op, const std::string& path,
                                                     int64_t offset, int64_t bytes)>;

// Tests only: the hook every AioEngine created from now on uses when its options name none
// (reaches engines built by code under test, e.g. the zerort Engine). Null clears it.
void SetIoFaultForTesting(IoFaultHook hook);

// DeepSpeed's `aio` block (zero/config.h AioConfig) and the fault seam.
struct AioOptions {
  int64_t block_size = 1048576;  // > 0, a multiple of kIoAlignment: bytes per request piece
  int queue_depth = 8;           // >= 1: pieces in flight per thread
  bool single_submit = false;    // one io_uring_submit per piece
  bool overlap_events = true;    // refill as pieces complete instead of per batch
  int thread_count = 1;          // >= 1: I/O threads, each with its own ring
  IoFaultHook fault;             // tests only; null in production
};

// One O_DIRECT file, preallocated to its size; closed and unlinked when destroyed.
class SwapFile {
 public:
  ~SwapFile();
  SwapFile(const SwapFile&) = delete;
  SwapFile& operator=(const SwapFile&) = delete;

  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  int64_t bytes() const { return bytes_; }

 private:
  friend class SwapDir;
  SwapFile(int fd, std::string path, int64_t bytes) : fd_(fd), path_(std::move(path)),
                                                       bytes_(bytes) {}
  const int fd_;
  const std::string path_;
  const int64_t bytes_;
};

// The directory a rank owns under nvme_path. Destroy it after its files.
class SwapDir {
 public:
  // Errors: InvalidArgument (nvme_path missing, not a directory, on tmpfs, or refusing
  // O_DIRECT); FailedPrecondition (the directory exists: leftovers of an unclean shutdown,
  // listed in the message; remove them by hand once nothing uses them).
  static absl::StatusOr<std::unique_ptr<SwapDir>> Create(const std::string& nvme_path,
                                                         const std::string& job, int rank);
  ~SwapDir();  // removes the directory (its files must be gone: SwapFile unlinks itself)
  SwapDir(const SwapDir&) = delete;
  SwapDir& operator=(const SwapDir&) = delete;

  // Creates <dir>/<name> with O_EXCL | O_DIRECT, preallocated (fallocate) to `bytes` (rounded
  // up to kIoAlignment). Errors name the file: ResourceExhausted on ENOSPC.
  absl::StatusOr<std::unique_ptr<SwapFile>> CreateFile(const std::string& name, int64_t bytes);
  const std::string& path() const { return path_; }

 private:
  explicit SwapDir(std::string path) : path_(std::move(path)) {}
  const std::string path_;
};

// Asynchronous O_DIRECT reads and writes on io_uring threads.
class AioEngine {
 public:
  struct Request {
    IoOp op = IoOp::kRead;
    const SwapFile* file = nullptr;
    int64_t offset = 0;   // multiple of kIoAlignment
    char* buffer = nullptr;  // aligned to kIoAlignment
    int64_t bytes = 0;    // multiple of kIoAlignment
  };
  using Ticket = uint64_t;

  // Errors: InvalidArgument naming a bad option; the error of io_uring_queue_init.
  static absl::StatusOr<std::unique_ptr<AioEngine>> Create(const AioOptions& options);
  ~AioEngine();  // waits for everything submitted
  AioEngine(const AioEngine&) = delete;
  AioEngine& operator=(const AioEngine&) = delete;

  // Starts the requests (in any order, concurrently) and returns at once.
  Ticket Submit(std::vector<Request> requests);
  // Waits for every piece of the ticket's requests; the first error (file, offset, size).
  // Each ticket is waited for exactly once.
  absl::Status Wait(Ticket ticket);
  // Submit + Wait.
  absl::Status Run(std::vector<Request> requests) { return Wait(Submit(std::move(requests))); }

  const AioOptions& options() const { return options_; }

 private:
  struct Impl;
  explicit AioEngine(const AioOptions& options);
  const AioOptions options_;
  std::unique_ptr<Impl> impl_;
};

// Page-aligned pinned buffer from the process-wide slab cache (memory::SharedPinnedSlabs()),
// returned to it when destroyed.
class IoBuffer {
 public:
  static absl::StatusOr<IoBuffer> Allocate(int64_t bytes);  // rounded up to kIoAlignment
  IoBuffer() = default;
  IoBuffer(IoBuffer&& o) noexcept { *this = std::move(o); }
  IoBuffer& operator=(IoBuffer&& o) noexcept;
  ~IoBuffer();
  char* data() const { return data_; }
  int64_t bytes() const { return bytes_; }

 private:
  char* data_ = nullptr;
  int64_t bytes_ = 0;
};

}  // namespace nvme
}  // namespace zerort

#endif  // ZERORT_NVME_IO_H_
