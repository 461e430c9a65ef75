// `zerort ckpt export` streams: the peak resident memory of the command, run as a child process
// of this test, stays at a fixed buffer above the binary's own baseline whatever the
// checkpoint's size. The count is the kernel's (wait4's ru_maxrss of the child, started through
// cli/rss_of so that this large process's footprint is not counted), independent of the code
// under test; the baseline is the same binary refusing a command line, so what is
// compared is what the export itself adds. The files it writes must equal the live engine's
// export (ExportWeights, another path: gathered masters through safetensors::WriteFile).
//
// Default size: 4 Mi fp32 elements on two ranks (16 MiB of masters, a 48 MiB checkpoint). A
// whole-state export holds at least the checkpoint's state (48 MiB) plus the masters again;
// a streaming one holds one 8 MiB read buffer and a small conversion buffer. To measure a
// bigger model: ZERORT_EXPORT_RSS_SCALE=16 (64 Mi elements, a 768 MiB checkpoint).
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "base/testing/temp_dir.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/weights.h"
#include "comm/testing/on_ranks.h"
#include "device/testing/one_thread.h"
#include "zero/engine.h"
#include "zero/testing/synthetic_trainer.h"

extern char** environ;

namespace zerort {
namespace {

std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// The names of the files of directory `path` ("/name", sorted), or {""} for a file.
std::vector<std::string> FilesIn(const std::string& path) {
  std::vector<std::string> out;
  DIR* d = ::opendir(path.c_str());
  if (d == nullptr) return {""};
  while (const struct dirent* e = ::readdir(d)) {
    if (e->d_name[0] != '.') out.push_back(absl::StrCat("/", e->d_name));
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}


std::string Runfile(const std::string& path) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* ws = std::getenv("TEST_WORKSPACE");
  return absl::StrCat(srcdir ? srcdir : ".", "/", ws ? ws : "zerort", "/", path);
}

struct ChildRun {
  int exit_code = -1;
  int64_t max_rss_bytes = 0;
  std::string stderr_text;
};

// Runs argv through cli/rss_of (stdout to a file, stderr kept) and returns the command's exit
// code and its own peak resident set size, as the kernel counts it (wait4's ru_maxrss).
ChildRun Spawn(const std::vector<std::string>& argv, const std::string& tmp) {
  std::vector<std::string> full = {Runfile("cli/rss_of")};
  full.insert(full.end(), argv.begin(), argv.end());
  std::vector<char*> args;
  for (const std::string& a : full) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const std::string out_path = tmp + "/rss_of.out", err_path = tmp + "/rss_of.err";
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&fa, 2, err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ChildRun run;
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, args[0], &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    run.stderr_text = absl::StrCat("posix_spawn '", full[0], "' failed: ", rc);
    return run;
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  run.stderr_text = ReadAll(err_path);
  // rss_of prints "<exit code> <KiB>" after the command's own output.
  const std::string out = ReadAll(out_path);
  const size_t line = out.rfind('\n', out.size() >= 2 ? out.size() - 2 : 0);
  long code = -1, kib = 0;
  if (std::sscanf(out.c_str() + (line == std::string::npos ? 0 : line + 1), "%ld %ld", &code,
                  &kib) == 2) {
    run.exit_code = static_cast<int>(code);
    run.max_rss_bytes = int64_t{kib} * 1024;
  }
  return run;
}

int64_t Scale() {
  const char* s = std::getenv("ZERORT_EXPORT_RSS_SCALE");
  return s != nullptr && std::atoi(s) > 0 ? std::atoi(s) : 1;
}

TEST_CASE("ckpt export: peak RSS stays at a fixed buffer, not the checkpoint's size",
          "[ckpt][hardening]") {
  const int64_t scale = Scale();
  // Registration order differs from name order (the file's), and every tensor spans both
  // saving ranks' shards and several 8 MiB read chunks.
  const std::vector<memory::ParamSpec> model = {{"z.big", {1024 * scale, 2048}, "l0"},
                                                {"a.mid", {2047, 1024 * scale}, "l1"},
                                                {"m.small", {1024}, "l1"}};
  int64_t elements = 0;
  for (const auto& p : model) elements += p.numel();
  const std::string root = testing::TempDir("export_rss_");
  const std::string ckpt = root + "/ckpt";
  WeightsExportOptions sharded;
  sharded.dtype = DType::kBF16;
  sharded.max_shard_bytes = int64_t{5} << 20;
  {
    auto device = testing::OneThreadCpuDevice();
    const Config config = testing::TestConfig(1, DType::kBF16, 1, 0, false);
    const std::vector<absl::Status> st =
        comm::testing::OnRanks(2, {60000}, [&](int, comm::Communicator* comm) -> absl::Status {
          ASSIGN_OR_RETURN(auto engine, Engine::Create(config, model, comm, device.get()));
          // Values over many binades, most not representable in bf16.
          RETURN_IF_ERROR(engine->InitParams([](int i, const memory::ParamSpec& p, float* v) {
            for (int64_t k = 0; k < p.numel(); ++k) {
              const uint32_t h = static_cast<uint32_t>(k) * 2654435761u + 97u * i;
              v[k] = std::ldexp(static_cast<float>(h % 100003) - 50001.0f, (h >> 20) % 9 - 20);
            }
          }));
          RETURN_IF_ERROR(SaveCheckpoint(*engine, ckpt).status());
          RETURN_IF_ERROR(ExportWeights(*engine, root + "/live.safetensors").status());
          return ExportWeights(*engine, root + "/live_sharded", sharded).status();
        });
    for (const absl::Status& s : st) {
      INFO(s.ToString());
      REQUIRE(s.ok());
    }
  }
  const std::string bin = Runfile("cli/zerort");
    // The binary's own footprint: the same command refusing its command line.
  const ChildRun base = Spawn({bin, "ckpt", "export"}, root);
  INFO(base.stderr_text);
  REQUIRE(base.exit_code == 2);

  struct Case {
    const char* name;
    std::vector<std::string> args;
    // (written, reference): files, or directories whose files must all be equal.
    std::vector<std::pair<std::string, std::string>> same;
  };
  const std::vector<Case> cases = {
      {"fp32, one file",
       {bin, "ckpt", "export", ckpt, "--format", "safetensors", root + "/cli.safetensors"},
       {{root + "/cli.safetensors", root + "/live.safetensors"}}},
      {"bf16, shards of 5 MiB",
       {bin, "ckpt", "export", ckpt, "--format", "safetensors", "--dtype", "bf16",
        "--max-shard-size", "5MiB", root + "/cli_sharded"},
       {{root + "/cli_sharded", root + "/live_sharded"}}},
  };
  const int64_t master_bytes = elements * 4, checkpoint_bytes = elements * 12;
  for (const Case& c : cases) {
    const ChildRun run = Spawn(c.args, root);
    const int64_t growth = run.max_rss_bytes - base.max_rss_bytes;
    std::printf("ckpt export (%s): %lld elements (%lld MiB of masters, %lld MiB checkpoint): "
                "peak RSS %lld KiB, baseline %lld KiB, growth %lld KiB\n",
                c.name, static_cast<long long>(elements),
                static_cast<long long>(master_bytes >> 20),
                static_cast<long long>(checkpoint_bytes >> 20),
                static_cast<long long>(run.max_rss_bytes >> 10),
                static_cast<long long>(base.max_rss_bytes >> 10),
                static_cast<long long>(growth >> 10));
    INFO(c.name << ": " << run.stderr_text << " growth " << growth << " B");
    REQUIRE(run.exit_code == 0);
    for (const auto& [written, reference] : c.same) {
      const std::vector<std::string> names = FilesIn(reference);
      REQUIRE(FilesIn(written) == names);
      for (const std::string& name : names) {
        INFO(written << name);
        const std::string w = ReadAll(written + name);
        REQUIRE(!w.empty());
        REQUIRE(w == ReadAll(reference + name));
      }
    }
    // One 8 MiB read buffer, a conversion buffer of at most 1 MiB, the manifest and headers:
    // 24 MiB leaves room for the allocator's arenas on a busy machine. A whole-state export
    // adds at least checkpoint_bytes (48 MiB at scale 1).
    CHECK(growth <= (int64_t{24} << 20));
    CHECK(growth * 2 < checkpoint_bytes);
  }
}

}  // namespace
}  // namespace zerort
