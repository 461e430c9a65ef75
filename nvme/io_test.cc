#include "nvme/io.h"

#include <dirent.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "base/testing/temp_dir.h"
#include "tests/testing/private_mount.h"

namespace zerort {
namespace nvme {
namespace {

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

void Fill(char* p, int64_t n, int seed) {
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<char>((i * 131 + seed * 7 + (i >> 12)) & 0xff);
}

TEST_CASE("AioEngine: what is written reads back, for every aio option", "[nvme]") {
  auto dir = SwapDir::Create(testing::TestTmpDir(), "io", 0);
  REQUIRE(dir.ok());
  constexpr int64_t kBytes = 5 * 65536 + 3 * 4096;  // not a multiple of the block size
  auto file = (*dir)->CreateFile("state", 2 * kBytes);
  REQUIRE(file.ok());
  struct Case { int64_t block; int depth; bool single; bool overlap; int threads; };
  const std::vector<Case> cases = {{65536, 8, false, true, 1}, {8192, 1, true, true, 1},
                                   {16384, 4, false, false, 3}, {4096, 3, true, false, 2}};
  int seed = 0;
  for (const Case& c : cases) {
    AioOptions o;
    o.block_size = c.block;
    o.queue_depth = c.depth;
    o.single_submit = c.single;
    o.overlap_events = c.overlap;
    o.thread_count = c.threads;
    auto io = AioEngine::Create(o);
    REQUIRE(io.ok());
    auto a = IoBuffer::Allocate(kBytes), b = IoBuffer::Allocate(kBytes);
    auto back = IoBuffer::Allocate(2 * kBytes);
    REQUIRE((a.ok() && b.ok() && back.ok()));
    Fill(a->data(), kBytes, ++seed);
    Fill(b->data(), kBytes, ++seed);
    // Two tickets in flight at once, to the two halves of the file.
    auto t1 = (*io)->Submit({{IoOp::kWrite, file->get(), 0, a->data(), kBytes}});
    auto t2 = (*io)->Submit({{IoOp::kWrite, file->get(), kBytes, b->data(), kBytes}});
    REQUIRE((*io)->Wait(t2).ok());
    REQUIRE((*io)->Wait(t1).ok());
    std::memset(back->data(), 0, 2 * kBytes);
    REQUIRE((*io)->Run({{IoOp::kRead, file->get(), kBytes, back->data() + kBytes, kBytes},
                        {IoOp::kRead, file->get(), 0, back->data(), kBytes}}).ok());
    CHECK(std::memcmp(back->data(), a->data(), kBytes) == 0);
    CHECK(std::memcmp(back->data() + kBytes, b->data(), kBytes) == 0);
  }
}

TEST_CASE("AioEngine: one-block tickets from several threads while others are in flight",
          "[nvme]") {
  // Each thread keeps two one-block tickets in flight, so new pieces keep arriving while the
  // I/O thread waits for completions with free slots: they must start (the eventfd wake) and
  // land where they belong; the engine is destroyed with its wake read armed.
  auto dir = SwapDir::Create(testing::TestTmpDir(), "tickets", 0);
  REQUIRE(dir.ok());
  constexpr int kThreads = 4, kBlocks = 64;
  constexpr int64_t kBlock = 4096;
  auto file = (*dir)->CreateFile("state", kThreads * kBlocks * kBlock);
  REQUIRE(file.ok());
  AioOptions o;
  o.block_size = kBlock;
  o.queue_depth = 3;
  auto io = AioEngine::Create(o);
  REQUIRE(io.ok());
  auto out = IoBuffer::Allocate(kThreads * kBlocks * kBlock);
  auto back = IoBuffer::Allocate(kThreads * kBlocks * kBlock);
  REQUIRE(out.ok());
  REQUIRE(back.ok());
  Fill(out->data(), out->bytes(), 5);
  std::memset(back->data(), 0, back->bytes());
  std::vector<std::thread> threads;
  std::vector<absl::Status> status(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (IoOp op : {IoOp::kWrite, IoOp::kRead}) {
        char* base = op == IoOp::kWrite ? out->data() : back->data();
        AioEngine::Ticket pending[2] = {0, 0};
        for (int b = 0; b < kBlocks; ++b) {
          const int64_t at = (int64_t{t} * kBlocks + b) * kBlock;
          if (pending[b % 2] != 0) status[t].Update((*io)->Wait(pending[b % 2]));
          pending[b % 2] = (*io)->Submit({{op, file->get(), at, base + at, kBlock}});
        }
        for (AioEngine::Ticket p : pending) status[t].Update((*io)->Wait(p));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : status) CHECK(s.ok());
  CHECK(std::memcmp(out->data(), back->data(), out->bytes()) == 0);
  io->reset();
}

TEST_CASE("AioEngine: faults name the file and the offset", "[nvme]") {
  auto dir = SwapDir::Create(testing::TestTmpDir(), "faults", 0);
  REQUIRE(dir.ok());
  auto file = (*dir)->CreateFile("state", 1 << 20);
  REQUIRE(file.ok());
  auto buf = IoBuffer::Allocate(1 << 20);
  REQUIRE(buf.ok());
  struct Case { IoOp op; int result; absl::StatusCode code; const char* text; };
  const std::vector<Case> cases = {
      {IoOp::kWrite, -EIO, absl::StatusCode::kInternal, "Input/output error"},
      {IoOp::kWrite, -ENOSPC, absl::StatusCode::kResourceExhausted, "No space left"},
      {IoOp::kWrite, 4096, absl::StatusCode::kDataLoss, "short nvme write"},
      {IoOp::kRead, 100, absl::StatusCode::kDataLoss, "short nvme read"},
      {IoOp::kRead, -EIO, absl::StatusCode::kInternal, "nvme read"}};
  for (const Case& c : cases) {
    AioOptions o;
    o.block_size = 65536;
    o.thread_count = 2;
    const int64_t bad_offset = 7 * 65536;
    o.fault = [&](IoOp op, const std::string&, int64_t offset, int64_t) -> std::optional<int> {
      if (op == c.op && offset == bad_offset) return c.result;
      return std::nullopt;
    };
    auto io = AioEngine::Create(o);
    REQUIRE(io.ok());
    const absl::Status s = (*io)->Run({{c.op, file->get(), 0, buf->data(), 1 << 20}});
    INFO(s.ToString());
    CHECK(s.code() == c.code);
    CHECK(s.message().find((*file)->path()) != absl::string_view::npos);
    CHECK(s.message().find("offset 458752") != absl::string_view::npos);
    CHECK(s.message().find(c.text) != absl::string_view::npos);
  }
}

TEST_CASE("SwapDir: owned, exclusive, removed on shutdown, leftovers reported", "[nvme]") {
  const std::string base = testing::TestTmpDir();
  const std::string path = base + "/zerort-own-rank3";
  {
    auto dir = SwapDir::Create(base, "own", 3);
    REQUIRE(dir.ok());
    CHECK((*dir)->path() == path);
    auto f = (*dir)->CreateFile("master", 10000);
    REQUIRE(f.ok());
    CHECK((*f)->bytes() == 12288);
    CHECK(Exists(path + "/master"));
    // O_EXCL: the same name twice is refused.
    auto again = (*dir)->CreateFile("master", 4096);
    CHECK(again.status().code() == absl::StatusCode::kInvalidArgument);
    // Another engine with the same job and rank does not share the directory.
    auto other = SwapDir::Create(base, "own", 3);
    CHECK(other.status().code() == absl::StatusCode::kFailedPrecondition);
  }
  CHECK_FALSE(Exists(path));  // clean shutdown removes files and directory
  // A process that dies without shutting down leaves its files: they are reported, not reused,
  // by the next run under the same name, and by any run of the same rank once the pid is gone.
  const pid_t pid = fork();
  if (pid == 0) {
    auto dir = SwapDir::Create(base, std::to_string(getpid()) + "-0", 0);
    if (!dir.ok()) _exit(1);
    auto f = (*dir)->CreateFile("exp_avg", 4096);
    _exit(f.ok() ? 0 : 2);  // no destructors run
  }
  int status = 0;
  REQUIRE(waitpid(pid, &status, 0) == pid);
  REQUIRE(WEXITSTATUS(status) == 0);
  const std::string left = base + "/zerort-" + std::to_string(pid) + "-0-rank0";
  auto again = SwapDir::Create(base, std::to_string(pid) + "-0", 0);
  CHECK(again.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(again.status().message().find(left) != absl::string_view::npos);
  auto other = SwapDir::Create(base, "next-run", 0);
  CHECK(other.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(other.status().message().find(left) != absl::string_view::npos);
  CHECK(SwapDir::Create(base, "rank1-unaffected", 1).ok());  // another rank's leftovers only
  unlink((left + "/exp_avg").c_str());
  rmdir(left.c_str());
  CHECK(SwapDir::Create(base, "after-cleanup", 0).ok());
}

TEST_CASE("SwapDir: tmpfs and missing directories are refused by name", "[nvme]") {
  auto missing = SwapDir::Create("/nonexistent/nvme", "j", 0);
  CHECK(missing.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(missing.status().message().find("/nonexistent/nvme") != absl::string_view::npos);
  struct statfs fs;
  if (statfs("/dev/shm", &fs) != 0 || fs.f_type != 0x01021994) {
    WARN("no tmpfs at /dev/shm: tmpfs refusal not checked");
    return;
  }
  auto shm = SwapDir::Create("/dev/shm", "j", 0);
  CHECK(shm.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(shm.status().message().find("\"/dev/shm\" is on tmpfs") != absl::string_view::npos);
  CHECK_FALSE(Exists("/dev/shm/zerort-j-rank0"));  // refused before anything was created
}

// Entries of `dir` other than "." and "..".
int CountEntries(const std::string& dir) {
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return -1;
  int n = 0;
  while (dirent* e = readdir(d)) {
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) ++n;
  }
  closedir(d);
  return n;
}

// One run on a file system that refuses O_DIRECT (after creating the file, as Linux does):
// refused by name, then shut down normally. Exit code 0 when it behaved so.
int RefusedRun(const std::string& dir) {
  const pid_t pid = fork();
  if (pid == 0) {
    int rc = 0;
    {
      auto swap = SwapDir::Create(dir, std::to_string(getpid()) + "-0", 0);
      if (!swap.ok()) _exit(10);
      auto f = (*swap)->CreateFile("optimizer_state", 8192);
      if (f.status().code() != absl::StatusCode::kInvalidArgument ||
          f.status().message().find("O_DIRECT") == absl::string_view::npos) {
        rc = 11;
      }
    }
    _exit(rc);
  }
  int status = 0;
  if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return 12;
  return WEXITSTATUS(status);
}

TEST_CASE("SwapDir: a file system without O_DIRECT leaves nothing behind", "[nvme]") {
  const std::string dir = testing::TestTmpDir() + "/ramfs";
  REQUIRE(mkdir(dir.c_str(), 0755) == 0);
  const int rc = testing::InPrivateMountNamespace([&] {
    if (!testing::MountRamfs(dir)) return static_cast<int>(testing::kNoNamespace);
    if (const int refused = RefusedRun(dir); refused != 0) return refused;
    if (CountEntries(dir) != 0) return 20;  // the swap directory and its file must be gone
    // The next run is not refused as if the first had crashed.
    auto next = SwapDir::Create(dir, std::to_string(getpid()) + "-1", 0);
    return next.ok() ? 0 : 21;
  });
  if (rc == testing::kNoNamespace) {
    WARN("no private mount namespace here (sandbox or kernel): the ramfs case is not checked");
    return;
  }
  INFO("child exit code " << rc << " (11: not refused by name, 20: leftovers, 21: next run "
       "refused)");
  CHECK(rc == 0);
}

TEST_CASE("AioEngine: options are checked", "[nvme]") {
  AioOptions o;
  o.block_size = 1000;
  CHECK(AioEngine::Create(o).status().code() == absl::StatusCode::kInvalidArgument);
  o = AioOptions();
  o.queue_depth = 0;
  CHECK(AioEngine::Create(o).status().code() == absl::StatusCode::kInvalidArgument);
  o = AioOptions();
  o.thread_count = 0;
  CHECK(AioEngine::Create(o).status().message().find("thread_count") != absl::string_view::npos);
}

}  // namespace
}  // namespace nvme
}  // namespace zerort
