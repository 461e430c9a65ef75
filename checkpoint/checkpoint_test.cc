#include "checkpoint/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "base/dtype.h"
#include "base/status.h"
#include "base/testing/checks.h"
#include "base/testing/temp_dir.h"
#include "tests/testing/private_mount.h"
#include "comm/testing/on_ranks.h"
#include "comm/testing/stream_ordered.h"
#include "device/cpu_device.h"
#include "device/testing/one_thread.h"
#include "checkpoint/internal/ckpt_fs.h"
#include "checkpoint/internal/ckpt_manifest.h"
#include "checkpoint/testing/posix_forwarding_fs.h"
#include "zero/testing/synthetic_trainer.h"

namespace zerort {
namespace {

using testing::BitEqual;
using testing::RequireAllOk;
using testing::RequireError;
using memory::ParamSpec;
using testing::SmallModel;

// --- helpers ---------------------------------------------------------------------------------

std::string TempDir(const std::string& tag) {
  return testing::TempDir(absl::StrCat("ckpt_", tag, "_"));
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

void WriteFile(const std::string& path, const std::string& data) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(data.data(), static_cast<std::streamsize>(data.size()));
}

// Runs fn(rank, comm) on `world` in-process ranks, one thread each; returns each rank's status.
std::vector<absl::Status> OnRanks(int world,
                                  const std::function<absl::Status(int, comm::Communicator*)>& fn) {
  return comm::testing::OnRanks(world, {20000}, fn);
}

absl::StatusOr<std::unique_ptr<Engine>> NewEngine(const Config& config, comm::Communicator* comm,
                                                  Device* device, float init_offset = 0) {
  ASSIGN_OR_RETURN(std::unique_ptr<Engine> e, Engine::Create(config, SmallModel(), comm, device));
  RETURN_IF_ERROR(testing::SetInitValues(*e, init_offset));
  return e;
}

void RequireSameState(const CheckpointState& a, const CheckpointState& b) {
  REQUIRE(a.master.size() == b.master.size());
  for (size_t i = 0; i < a.master.size(); ++i) {
    INFO("parameter " << a.info.params[i].name);
    REQUIRE(BitEqual(a.master[i], b.master[i]));
    REQUIRE(BitEqual(a.exp_avg[i], b.exp_avg[i]));
    REQUIRE(BitEqual(a.exp_avg_sq[i], b.exp_avg_sq[i]));
  }
}

bool SameState(const CheckpointState& a, const CheckpointState& b) {
  if (a.master.size() != b.master.size()) return false;
  for (size_t i = 0; i < a.master.size(); ++i) {
    if (!BitEqual(a.master[i], b.master[i]) || !BitEqual(a.exp_avg[i], b.exp_avg[i]) ||
        !BitEqual(a.exp_avg_sq[i], b.exp_avg_sq[i])) {
      return false;
    }
  }
  return true;
}

std::vector<float> Flatten(const std::vector<std::vector<float>>& per_param) {
  std::vector<float> out;
  for (const auto& p : per_param) out.insert(out.end(), p.begin(), p.end());
  return out;
}

// --- resume ----------------------------------------------------------------------------------

TEST_CASE("Checkpoint: save at step k, load, run to k+m equals an uninterrupted run, bitwise",
          "[zero][ckpt]") {
  const int k = 3, m = 3;
  struct Case {
    int stage;
    DType precision;
    int world;
    int gas;
    bool offload;
  };
  std::vector<Case> cases;
  for (int stage = 0; stage <= 3; ++stage) {
    cases.push_back({stage, DType::kBF16, 2, 1, false});
    cases.push_back({stage, DType::kF16, 3, 2, false});
    cases.push_back({stage, DType::kF32, 1, 1, false});
    if (stage > 0) cases.push_back({stage, DType::kBF16, 2, 1, true});
  }
  for (const Case& c : cases) {
    DYNAMIC_SECTION("stage " << c.stage << " " << DTypeName(c.precision) << " world "
                             << c.world << " gas " << c.gas << (c.offload ? " offload" : "")) {
      Config config = testing::TestConfig(c.stage, c.precision, c.gas, 1.0, c.offload);
      config.fp16.initial_scale_power = 8;
      // Overflows before and after the checkpoint: the resumed run matches only if the loss
      // scaler's hysteresis and step counters were restored.
      const std::vector<int> inject =
          c.precision == DType::kF16 ? std::vector<int>{1, k + 1} : std::vector<int>{};
      const std::string dir = TempDir("resume");
      const std::string ref_dir = TempDir("resume_ref");
      auto device = testing::OneThreadCpuDevice();
      std::vector<std::vector<float>> ref(c.world), resumed(c.world);
      std::vector<EngineState> ref_state(c.world), resumed_state(c.world);
      std::vector<int64_t> saved_step(c.world);  // below k when an overflow skipped a step
      RequireAllOk(OnRanks(c.world, [&](int r, comm::Communicator* comm) -> absl::Status {
        ASSIGN_OR_RETURN(auto e, NewEngine(config, comm, device.get()));
        RETURN_IF_ERROR(testing::TrainSteps(*e, 0, k + m, inject));
        ASSIGN_OR_RETURN(ref[r], e->GatherMasterWeights());
        ref_state[r] = e->state();
        return SaveCheckpoint(*e, ref_dir).status();
      }));
      RequireAllOk(OnRanks(c.world, [&](int r, comm::Communicator* comm) -> absl::Status {
        ASSIGN_OR_RETURN(auto e, NewEngine(config, comm, device.get()));
        RETURN_IF_ERROR(testing::TrainSteps(*e, 0, k, inject));
        saved_step[r] = e->step();
        return SaveCheckpoint(*e, dir).status();
      }));
      RequireAllOk(OnRanks(c.world, [&](int r, comm::Communicator* comm) -> absl::Status {
        // Different initial values: everything must come from the checkpoint.
        ASSIGN_OR_RETURN(auto e, NewEngine(config, comm, device.get(), 0.25f));
        RETURN_IF_ERROR(LoadCheckpoint(*e, dir));
        if (e->step() != saved_step[r]) {
          return absl::InternalError(absl::StrCat("step ", e->step(), " after loading step ",
                                                  saved_step[r]));
        }
        RETURN_IF_ERROR(testing::TrainSteps(*e, k, m, inject));
        ASSIGN_OR_RETURN(resumed[r], e->GatherMasterWeights());
        resumed_state[r] = e->state();
        return SaveCheckpoint(*e, dir).status();
      }));
      for (int r = 0; r < c.world; ++r) {
        REQUIRE(BitEqual(ref[r], resumed[r]));
        REQUIRE(ref_state[r].step == resumed_state[r].step);
        REQUIRE(ref_state[r].loss_scale == resumed_state[r].loss_scale);
        REQUIRE(ref_state[r].scaler_hysteresis_left == resumed_state[r].scaler_hysteresis_left);
      }
      if (c.precision == DType::kF16) REQUIRE(ref_state[0].loss_scale == 128.0);
      // m and v as well, through the checkpoints both runs wrote at the end.
      auto a = ReadCheckpoint(ref_dir);
      auto b = ReadCheckpoint(dir);
      REQUIRE(a.ok());
      REQUIRE(b.ok());
      REQUIRE(a->info.step == ref_state[0].step);
      REQUIRE(b->info.step == ref_state[0].step);
      RequireSameState(*a, *b);
      // The checkpoint's masters are the engine's, through an independent path.
      REQUIRE(BitEqual(Flatten(a->master), ref[0]));
    }
  }
}

// --- reshard ---------------------------------------------------------------------------------

// Checks this rank's owned master, m and v against the full state `want`, element by element,
// locating each element from the engine's plan alone (padding must be zero).
absl::Status CheckOwnedState(Engine& e, const CheckpointState& want) {
  const memory::Plan& plan = e.plan();
  const int rank = plan.options.rank;
  const size_t n = static_cast<size_t>(plan.shard_elements);
  std::vector<float> owned[3] = {std::vector<float>(n), std::vector<float>(n),
                                 std::vector<float>(n)};
  RETURN_IF_ERROR(e.BeginSnapshot(owned[0].data(), owned[1].data(), owned[2].data(), nullptr));
  RETURN_IF_ERROR(e.WaitSnapshot());
  for (int u = 0; u < e.num_units(); ++u) {
    const memory::Unit& unit = plan.units[u];
    const float* got[3] = {owned[0].data() + unit.shard_offset,
                           owned[1].data() + unit.shard_offset,
                           owned[2].data() + unit.shard_offset};
    for (int64_t k = 0; k < unit.shard; ++k) {
      const int64_t pos = rank * unit.shard + k;
      float expect[3] = {0, 0, 0};
      for (int i : unit.params) {
        const memory::ParamLayout& p = plan.params[i];
        if (pos >= p.offset_in_unit && pos < p.offset_in_unit + p.numel) {
          const int64_t el = pos - p.offset_in_unit;
          expect[0] = want.master[i][el];
          expect[1] = want.exp_avg[i][el];
          expect[2] = want.exp_avg_sq[i][el];
        }
      }
      for (int s = 0; s < 3; ++s) {
        if (std::memcmp(&got[s][k], &expect[s], 4) != 0) {
          return absl::InternalError(absl::StrCat("rank ", rank, " unit ", u, " element ", pos,
                                                  " section ", s, ": ", got[s][k], " != ",
                                                  expect[s]));
        }
      }
    }
  }
  return absl::OkStatus();
}

TEST_CASE("Checkpoint: saved at world N loads at world M (1..8) with the same master, m and v",
          "[zero][ckpt][reshard]") {
  auto device = testing::OneThreadCpuDevice();
  for (DType precision : {DType::kBF16, DType::kF32}) {
    for (int stage = 0; stage <= 3; ++stage) {
      const Config config = testing::TestConfig(stage, precision, 1, 0, false);
      for (int n = 1; n <= 8; ++n) {
        INFO("stage " << stage << " " << DTypeName(precision) << " saved at " << n);
        const std::string dir = TempDir("reshard");
        std::vector<float> saved_master;
        RequireAllOk(OnRanks(n, [&](int r, comm::Communicator* comm) -> absl::Status {
          ASSIGN_OR_RETURN(auto e, NewEngine(config, comm, device.get()));
          RETURN_IF_ERROR(testing::TrainSteps(*e, 0, 2));
          ASSIGN_OR_RETURN(std::vector<float> w, e->GatherMasterWeights());
          if (r == 0) saved_master = std::move(w);
          return SaveCheckpoint(*e, dir).status();
        }));
        auto saved = ReadCheckpoint(dir);
        REQUIRE(saved.ok());
        REQUIRE(BitEqual(Flatten(saved->master), saved_master));
        // m and v are live (not trivially equal because both are zero).
        REQUIRE(Flatten(saved->exp_avg_sq)[0] > 0);
        for (int m = 1; m <= 8; ++m) {
          INFO("loaded at " << m);
          std::vector<float> loaded_master;
          // One round trip per N through a save at M (not every M: saves fsync).
          const std::string out = m == 9 - n ? TempDir("reshard_out") : "";
          RequireAllOk(OnRanks(m, [&](int r, comm::Communicator* comm) -> absl::Status {
            ASSIGN_OR_RETURN(auto e, NewEngine(config, comm, device.get(), 0.5f));
            LoadOptions lo;
            lo.allow_reshard = true;
            RETURN_IF_ERROR(LoadCheckpoint(*e, dir, lo));
            RETURN_IF_ERROR(CheckOwnedState(*e, *saved));
            ASSIGN_OR_RETURN(std::vector<float> w, e->GatherMasterWeights());
            if (r == 0) loaded_master = std::move(w);
            if (!out.empty()) {
              RETURN_IF_ERROR(SaveCheckpoint(*e, out).status());
              ASSIGN_OR_RETURN(CheckpointState resaved, ReadCheckpoint(out));
              if (!SameState(*saved, resaved)) return absl::InternalError("resaved differs");
            }
            return absl::OkStatus();
          }));
          REQUIRE(BitEqual(loaded_master, saved_master));
        }
      }
    }
  }
}

TEST_CASE("Checkpoint: a checkpoint loads into another stage and another world, and the "
          "compute-dtype parameters follow the masters", "[zero][ckpt]") {
  auto device = testing::OneThreadCpuDevice();
  const std::string dir = TempDir("cross");
  RequireAllOk(OnRanks(2, [&](int r, comm::Communicator* comm) -> absl::Status {
    ASSIGN_OR_RETURN(auto e, NewEngine(testing::TestConfig(1, DType::kBF16, 1, 0, false),
                                       comm, device.get()));
    RETURN_IF_ERROR(testing::TrainSteps(*e, 0, 2));
    return SaveCheckpoint(*e, dir).status();
  }));
  auto saved = ReadCheckpoint(dir);
  REQUIRE(saved.ok());
  RequireAllOk(OnRanks(3, [&](int r, comm::Communicator* comm) -> absl::Status {
    ASSIGN_OR_RETURN(auto e, NewEngine(testing::TestConfig(3, DType::kBF16, 1, 0, false),
                                       comm, device.get(), 0.5f));
    LoadOptions lo;
    lo.allow_reshard = true;
    RETURN_IF_ERROR(LoadCheckpoint(*e, dir, lo));
    // Every gathered compute parameter is the bf16 rounding of the checkpoint's master.
    for (int u = 0; u < e->num_units(); ++u) {
      RETURN_IF_ERROR(e->Gather(u));
      for (int i : e->plan().units[u].params) {
        ASSIGN_OR_RETURN(void* p, e->param(i));
        const auto* bits = static_cast<const uint16_t*>(p);
        for (size_t k = 0; k < saved->master[i].size(); ++k) {
          if (bits[k] != FloatToBf16(saved->master[i][k])) {
            return absl::InternalError(absl::StrCat("param ", i, " element ", k));
          }
        }
      }
      RETURN_IF_ERROR(e->Release(u));
    }
    return absl::OkStatus();
  }));
}

// --- corruption ------------------------------------------------------------------------------

struct Corruption {
  std::string name;
  std::function<void(const std::string& dir, const std::string& other)> apply;
  absl::StatusCode code;
  std::string expect;  // a substring of the error on every rank
};

TEST_CASE("Checkpoint: each corruption is a clear error on every rank and leaves the engine "
          "unchanged", "[zero][ckpt]") {
  const Config config = testing::TestConfig(2, DType::kBF16, 1, 0, false);
  auto device = testing::OneThreadCpuDevice();
  const std::string root = TempDir("corrupt");
  // Two checkpoints (steps 1 and 2) to mix shards from.
  RequireAllOk(OnRanks(2, [&](int r, comm::Communicator* comm) -> absl::Status {
    ASSIGN_OR_RETURN(auto e, NewEngine(config, comm, device.get()));
    RETURN_IF_ERROR(testing::TrainSteps(*e, 0, 1));
    RETURN_IF_ERROR(SaveCheckpoint(*e, root).status());
    RETURN_IF_ERROR(testing::TrainSteps(*e, 1, 1));
    return SaveCheckpoint(*e, root).status();
  }));
  const std::string good = root + "/step_2";
  const std::string older = root + "/step_1";
  auto flip = [](const std::string& path, int64_t at) {
    std::string d = ReadFile(path);
    const size_t i = at >= 0 ? static_cast<size_t>(at) : d.size() + at;
    d[i] = static_cast<char>(d[i] ^ 0x10);
    WriteFile(path, d);
  };
  std::vector<Corruption> cases = {
      {"flipped byte in a tensor", [&](const std::string& d, const std::string&) {
         flip(d + "/rank_00001.bin", -5);
       }, absl::StatusCode::kDataLoss, "rank_00001.bin' is corrupted: CRC32C"},
      {"flipped byte in a header", [&](const std::string& d, const std::string&) {
         flip(d + "/rank_00000.bin", 2);
       }, absl::StatusCode::kDataLoss, "rank_00000.bin': not a zerort shard file"},
      {"flipped byte in the manifest", [&](const std::string& d, const std::string&) {
         std::string t = ReadFile(d + "/manifest.json");
         const size_t at = t.find("\"shard\": ") + 9;
         t[at] = t[at] == '9' ? '8' : static_cast<char>(t[at] + 1);
         WriteFile(d + "/manifest.json", t);
       }, absl::StatusCode::kDataLoss, "manifest.json: manifest: "},
      {"truncated shard", [&](const std::string& d, const std::string&) {
         std::string t = ReadFile(d + "/rank_00001.bin");
         WriteFile(d + "/rank_00001.bin", t.substr(0, t.size() - 100));
       }, absl::StatusCode::kDataLoss, "rank_00001.bin' is truncated"},
      {"zero-byte shard", [&](const std::string& d, const std::string&) {
         WriteFile(d + "/rank_00000.bin", "");
       }, absl::StatusCode::kDataLoss, "rank_00000.bin' is truncated"},
      {"truncated manifest", [&](const std::string& d, const std::string&) {
         std::string t = ReadFile(d + "/manifest.json");
         WriteFile(d + "/manifest.json", t.substr(0, t.size() / 2));
       }, absl::StatusCode::kDataLoss, "manifest.json: manifest: json"},
      {"missing shard", [&](const std::string& d, const std::string&) {
         std::remove((d + "/rank_00001.bin").c_str());
       }, absl::StatusCode::kNotFound, "rank_00001.bin' is missing"},
      {"shards from two steps", [&](const std::string& d, const std::string& o) {
         WriteFile(d + "/rank_00001.bin", ReadFile(o + "/rank_00001.bin"));
       }, absl::StatusCode::kDataLoss, "belongs to another checkpoint (step 1"},
      {"shards of two ranks swapped", [&](const std::string& d, const std::string&) {
         const std::string a = ReadFile(d + "/rank_00000.bin");
         WriteFile(d + "/rank_00000.bin", ReadFile(d + "/rank_00001.bin"));
         WriteFile(d + "/rank_00001.bin", a);
       }, absl::StatusCode::kDataLoss, "holds rank 1's shard, expected rank 0"},
      {"newer format version", [&](const std::string& d, const std::string&) {
         std::string t = ReadFile(d + "/manifest.json");
         const size_t at = t.find("\"format_version\": 1");
         t.replace(at, 19, "\"format_version\": 2");
         WriteFile(d + "/manifest.json", t);
       }, absl::StatusCode::kFailedPrecondition, "format_version 2 is newer"},
  };
  for (const Corruption& c : cases) {
    DYNAMIC_SECTION(c.name) {
      const std::string dir = TempDir("bad");
      for (const char* f : {"manifest.json", "rank_00000.bin", "rank_00001.bin"}) {
        WriteFile(dir + "/" + f, ReadFile(good + "/" + f));
      }
      c.apply(dir, older);
      std::vector<absl::Status> errors(2);
      RequireAllOk(OnRanks(2, [&](int r, comm::Communicator* comm) -> absl::Status {
        ASSIGN_OR_RETURN(auto e, NewEngine(config, comm, device.get()));
        RETURN_IF_ERROR(testing::TrainSteps(*e, 0, 1));
        ASSIGN_OR_RETURN(std::vector<float> before, e->GatherMasterWeights());
        const EngineState st = e->state();
        errors[r] = LoadCheckpoint(*e, dir);
        ASSIGN_OR_RETURN(std::vector<float> after, e->GatherMasterWeights());
        if (!BitEqual(before, after) || e->state().step != st.step) {
          return absl::InternalError("the failed load changed the engine");
        }
        // Still usable: the ranks are in step.
        return testing::TrainSteps(*e, 1, 1);
      }));
      for (int r = 0; r < 2; ++r) {
        INFO("rank " << r);
        RequireError(errors[r], c.code, c.expect);
      }
    }
  }
}

TEST_CASE("Checkpoint: another world size without allow_reshard, or another model, is refused",
          "[zero][ckpt]") {
  auto device = testing::OneThreadCpuDevice();
  const Config config = testing::TestConfig(1, DType::kBF16, 1, 0, false);
  const std::string dir = TempDir("refuse");
  RequireAllOk(OnRanks(2, [&](int r, comm::Communicator* comm) -> absl::Status {
    ASSIGN_OR_RETURN(auto e, NewEngine(config, comm, device.get()));
    RETURN_IF_ERROR(testing::TrainSteps(*e, 0, 1));
    return SaveCheckpoint(*e, dir).status();
  }));
  std::vector<absl::Status> errors(3);
  RequireAllOk(OnRanks(3, [&](int r, comm::Communicator* comm) -> absl::Status {
    ASSIGN_OR_RETURN(auto e, NewEngine(config, comm, device.get()));
    errors[r] = LoadCheckpoint(*e, dir);
    return absl::OkStatus();
  }));
  for (const absl::Status& s : errors) {
    RequireError(s, absl::StatusCode::kFailedPrecondition, "saved by 2 ranks; this engine has 3");
  }
  std::vector<ParamSpec> other = SmallModel();
  other[3].shape = {64, 10};
  RequireAllOk(OnRanks(1, [&](int, comm::Communicator* comm) -> absl::Status {
    ASSIGN_OR_RETURN(auto e, Engine::Create(config, other, comm, device.get()));
    LoadOptions lo;
    lo.allow_reshard = true;
    const absl::Status s = LoadCheckpoint(*e, dir, lo);
    if (s.code() != absl::StatusCode::kFailedPrecondition ||
        !absl::StrContains(s.message(), "parameter 3 is 'l1.w' [64, 9], the engine's is 'l1.w' [64, 10]")) {
      return absl::InternalError(s.ToString());
    }
    const absl::Status none = LoadCheckpoint(*e, dir + "/nowhere", lo);
    if (!absl::IsNotFound(none)) return absl::InternalError(none.ToString());
    return absl::OkStatus();
  }));
}

// --- file-system failures and crashes ------------------------------------------------------

// POSIX, except that mutating operation number `fail_at` (1-based, counted across ranks) fails,
// or with `kill` set, kills the process there (a write first writes half its data).
class FaultyFs : public testing::PosixForwardingFs {
 public:
  FaultyFs(int fail_at, bool kill) : fail_at_(fail_at), kill_(kill) {}
  int ops() const { return ops_.load(); }
  std::string failed_op() {
    std::lock_guard<std::mutex> l(mu_);
    return failed_;
  }

  // Returns true when this operation is the chosen one (and, when killing, does not return).
  bool Hit(const std::string& op, const std::function<void()>& half = nullptr) {
    if (++ops_ != fail_at_) return false;
    if (kill_) {
      if (half) half();
      raise(SIGKILL);
    }
    std::lock_guard<std::mutex> l(mu_);
    failed_ = op;
    return true;
  }
  absl::Status Injected(const std::string& op, const std::string& path) {
    return absl::UnavailableError(absl::StrCat("injected failure: ", op, " '", path, "'"));
  }

  class File : public ckpt_internal::WritableFile {
   public:
    File(FaultyFs* fs, std::unique_ptr<ckpt_internal::WritableFile> f, std::string path)
        : fs_(fs), f_(std::move(f)), path_(std::move(path)) {}
    absl::Status Append(absl::string_view d) override {
      if (fs_->Hit("write", [&] { (void)f_->Append(d.substr(0, d.size() / 2)); })) {
        return fs_->Injected("write", path_);
      }
      return f_->Append(d);
    }
    absl::Status Sync() override {
      if (fs_->Hit("fsync")) return fs_->Injected("fsync", path_);
      return f_->Sync();
    }
    absl::Status Close() override {
      if (fs_->Hit("close")) return fs_->Injected("close", path_);
      return f_->Close();
    }

   private:
    FaultyFs* fs_;
    std::unique_ptr<ckpt_internal::WritableFile> f_;
    std::string path_;
  };

  absl::StatusOr<std::unique_ptr<ckpt_internal::WritableFile>> NewWritableFile(
      const std::string& path) override {
    if (Hit("create")) return Injected("create", path);
    ASSIGN_OR_RETURN(auto f, posix()->NewWritableFile(path));
    return std::unique_ptr<ckpt_internal::WritableFile>(new File(this, std::move(f), path));
  }
  absl::Status MakeDir(const std::string& path) override {
    if (Hit("mkdir")) return Injected("mkdir", path);
    return posix()->MakeDir(path);
  }
  absl::Status SyncDir(const std::string& path) override {
    if (Hit("fsync dir")) return Injected("fsync dir", path);
    return posix()->SyncDir(path);
  }
  absl::Status Rename(const std::string& from, const std::string& to) override {
    if (Hit("rename")) return Injected("rename", from);
    return posix()->Rename(from, to);
  }
  absl::Status RemoveAll(const std::string& path) override {
    if (Hit("remove")) return Injected("remove", path);
    return posix()->RemoveAll(path);
  }

 private:
  const int fail_at_;
  const bool kill_;
  std::atomic<int> ops_{0};
  std::mutex mu_;
  std::string failed_;
};

std::string Latest(const std::string& root) { return ReadFile(root + "/latest"); }

bool PathExists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

TEST_CASE("Checkpoint: a failed write, fsync, rename or mkdir returns an error and keeps the "
          "previous checkpoint", "[zero][ckpt]") {
  const Config config = testing::TestConfig(3, DType::kBF16, 1, 0, false);
  auto device = testing::OneThreadCpuDevice();
  std::vector<std::string> failed_ops;
  for (int at = 1;; ++at) {
    INFO("failing operation " << at);
    const std::string root = TempDir("fail");
    FaultyFs fs(at, /*kill=*/false);
    std::vector<absl::Status> saves(2);
    std::vector<float> step1;
    RequireAllOk(OnRanks(2, [&](int r, comm::Communicator* comm) -> absl::Status {
      ASSIGN_OR_RETURN(auto e, NewEngine(config, comm, device.get()));
      RETURN_IF_ERROR(testing::TrainSteps(*e, 0, 1));
      RETURN_IF_ERROR(SaveCheckpoint(*e, root).status());
      ASSIGN_OR_RETURN(std::vector<float> w, e->GatherMasterWeights());
      if (r == 0) step1 = w;
      RETURN_IF_ERROR(testing::TrainSteps(*e, 1, 1));
      SaveOptions so;
      so.fs = &fs;
      saves[r] = SaveCheckpoint(*e, root, so).status();
      return absl::OkStatus();
    }));
    if (fs.ops() < at) {  // no injection happened: every operation has been tried
      REQUIRE(saves[0].ok());
      REQUIRE(Latest(root) == "step_2\n");
      break;
    }
    failed_ops.push_back(fs.failed_op());
    INFO("failed " << fs.failed_op() << ": " << saves[0].ToString());
    for (int r = 0; r < 2; ++r) {
      RequireError(saves[r], absl::StatusCode::kUnavailable, "injected failure");
    }
    // A failed save leaves nothing behind: no step_2.tmp/, no lock file.
    REQUIRE_FALSE(PathExists(root + "/step_2.tmp"));
    REQUIRE_FALSE(PathExists(root + "/.zerort.lock"));
    // `latest` still names step 1, which loads. Only a failed fsync of the directory after
    // `latest` was renamed may leave the new name (complete, but its durability unknown).
    const std::string latest = Latest(root);
    const bool moved = latest == "step_2\n";
    REQUIRE((latest == "step_1\n" || (moved && fs.failed_op() == "fsync dir")));
    RequireAllOk(OnRanks(2, [&](int, comm::Communicator* comm) -> absl::Status {
      ASSIGN_OR_RETURN(auto e, NewEngine(config, comm, device.get(), 0.5f));
      RETURN_IF_ERROR(LoadCheckpoint(*e, root));
      ASSIGN_OR_RETURN(std::vector<float> w, e->GatherMasterWeights());
      if (e->step() != (moved ? 2 : 1) || (!moved && !BitEqual(w, step1))) {
        return absl::InternalError("not the checkpoint `latest` names");
      }
      return absl::OkStatus();
    }));
  }
  for (const char* op : {"write", "fsync", "rename", "fsync dir", "mkdir", "create", "close"}) {
    INFO(op);
    REQUIRE(std::find(failed_ops.begin(), failed_ops.end(), op) != failed_ops.end());
  }
}

TEST_CASE("Checkpoint: a save killed with SIGKILL at any point leaves `latest` naming a "
          "complete checkpoint that loads", "[zero][ckpt]") {
  const Config config = testing::TestConfig(2, DType::kBF16, 1, 0, false);
  auto device = testing::OneThreadCpuDevice();
  // References: the masters after 1 and 2 steps.
  std::vector<float> after[3];
  const std::string root0 = TempDir("kill_ref");
  RequireAllOk(OnRanks(2, [&](int r, comm::Communicator* comm) -> absl::Status {
    ASSIGN_OR_RETURN(auto e, NewEngine(config, comm, device.get()));
    for (int s = 1; s <= 2; ++s) {
      RETURN_IF_ERROR(testing::TrainSteps(*e, s - 1, 1));
      ASSIGN_OR_RETURN(std::vector<float> w, e->GatherMasterWeights());
      if (r == 0) after[s] = w;
    }
    return absl::OkStatus();
  }));
  int kills = 0;
  bool completed = false;
  for (int at = 1; at < 200 && !completed; ++at) {
    INFO("killed at operation " << at);
    const std::string root = TempDir("kill");
    const pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      // Child: a fresh process image of our own; threads are created only here.
      FaultyFs fs(at, /*kill=*/true);
      SaveOptions so;
      so.fs = &fs;
      auto dev = testing::OneThreadCpuDevice();
      const auto st = OnRanks(2, [&](int r, comm::Communicator* comm) -> absl::Status {
        ASSIGN_OR_RETURN(auto e, NewEngine(config, comm, dev.get()));
        RETURN_IF_ERROR(testing::TrainSteps(*e, 0, 1));
        RETURN_IF_ERROR(SaveCheckpoint(*e, root, so).status());
        RETURN_IF_ERROR(testing::TrainSteps(*e, 1, 1));
        return SaveCheckpoint(*e, root, so).status();
      });
      _exit(st[0].ok() && st[1].ok() ? 0 : 3);
    }
    int wstatus = 0;
    REQUIRE(waitpid(pid, &wstatus, 0) == pid);
    if (WIFEXITED(wstatus)) {
      REQUIRE(WEXITSTATUS(wstatus) == 0);
      completed = true;
    } else {
      REQUIRE(WIFSIGNALED(wstatus));
      REQUIRE(WTERMSIG(wstatus) == SIGKILL);
      ++kills;
    }
    const std::string latest = Latest(root);
    if (latest.empty()) continue;  // killed before the first checkpoint was published
    INFO("latest: " << latest);
    RequireAllOk(OnRanks(2, [&](int, comm::Communicator* comm) -> absl::Status {
      ASSIGN_OR_RETURN(auto e, NewEngine(config, comm, device.get(), 0.5f));
      RETURN_IF_ERROR(LoadCheckpoint(*e, root));
      ASSIGN_OR_RETURN(std::vector<float> w, e->GatherMasterWeights());
      if (e->step() < 1 || e->step() > 2 || !BitEqual(w, after[e->step()]) ||
          latest != absl::StrCat("step_", e->step(), "\n")) {
        return absl::InternalError(absl::StrCat("wrong state for ", latest));
      }
      return absl::OkStatus();
    }));
    // A later save in the same directory succeeds despite the debris.
    RequireAllOk(OnRanks(2, [&](int r, comm::Communicator* comm) -> absl::Status {
      ASSIGN_OR_RETURN(auto e, NewEngine(config, comm, device.get()));
      RETURN_IF_ERROR(testing::TrainSteps(*e, 0, 3));
      return SaveCheckpoint(*e, root).status();
    }));
    REQUIRE(Latest(root) == "step_3\n");
  }
  REQUIRE(completed);
  REQUIRE(kills >= 20);
}

TEST_CASE("Checkpoint: an async save failing at Start or Finish leaves nothing behind, and "
          "Finish after a failed Start reports the cause", "[zero][ckpt]") {
  const Config config = testing::TestConfig(2, DType::kBF16, 1, 0, false);
  auto device = testing::OneThreadCpuDevice();
  bool start_failed = false, finish_failed = false;
  for (int at = 1;; ++at) {
    INFO("failing operation " << at);
    const std::string root = TempDir("async_fail");
    FaultyFs fs(at, /*kill=*/false);
    std::vector<absl::Status> start(2), finish(2);
    RequireAllOk(OnRanks(2, [&](int r, comm::Communicator* comm) -> absl::Status {
      ASSIGN_OR_RETURN(auto e, NewEngine(config, comm, device.get()));
      RETURN_IF_ERROR(testing::TrainSteps(*e, 0, 1));
      RETURN_IF_ERROR(SaveCheckpoint(*e, root).status());
      RETURN_IF_ERROR(testing::TrainSteps(*e, 1, 1));
      SaveOptions so;
      so.fs = &fs;
      AsyncCheckpointer ck(so);
      start[r] = ck.Start(*e, root);
      finish[r] = ck.Finish().status();
      return absl::OkStatus();
    }));
    if (fs.ops() < at) {
      RequireAllOk(start);
      RequireAllOk(finish);
      break;
    }
    INFO("failed " << fs.failed_op() << ": start " << start[0].ToString() << ", finish "
                   << finish[0].ToString());
    for (int r = 0; r < 2; ++r) {
      if (!start[r].ok()) {
        start_failed = true;
        RequireError(start[r], absl::StatusCode::kUnavailable, "injected failure");
        // Not "without a save in flight": the cause, with its code.
        RequireError(finish[r], absl::StatusCode::kUnavailable, "failed at Start");
        RequireError(finish[r], absl::StatusCode::kUnavailable, "injected failure");
      } else {
        finish_failed = true;
        RequireError(finish[r], absl::StatusCode::kUnavailable, "injected failure");
      }
    }
    REQUIRE(start[0].ok() == start[1].ok());
    REQUIRE_FALSE(PathExists(root + "/step_2.tmp"));
    REQUIRE_FALSE(PathExists(root + "/.zerort.lock"));
    const std::string latest = Latest(root);
    REQUIRE((latest == "step_1\n" || (latest == "step_2\n" && fs.failed_op() == "fsync dir")));
  }
  REQUIRE(start_failed);
  REQUIRE(finish_failed);
}

// --- stream-ordered communicators (NCCL's completion model) --------------------------------

// Runs fn(rank, comm, stream) on every rank of a stream-ordered group over `device`
// (comm/testing/stream_ordered.h), each rank on a compute stream of its own.
std::vector<absl::Status> OnStreamOrderedRanks(
    int world, Device* device,
    const std::function<absl::Status(int, comm::Communicator*, Device::Stream)>& fn) {
  auto comms = comm::testing::CreateStreamOrderedGroup(world, device, {20000});
  REQUIRE(comms.ok());
  std::vector<absl::Status> st(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      Device::Stream s = device->CreateStream().value();
      st[r] = fn(r, (*comms)[r].get(), s);
      const absl::Status synced = device->Synchronize(s);
      if (st[r].ok()) st[r] = synced;
      device->DestroyStream(s);
    });
  }
  for (auto& t : threads) t.join();
  return st;
}

absl::StatusOr<std::unique_ptr<Engine>> NewEngineOn(const Config& config, comm::Communicator* comm,
                                                    Device* device, Device::Stream stream,
                                                    float init_offset = 0) {
  EngineOptions options;
  options.compute_stream = stream;
  ASSIGN_OR_RETURN(std::unique_ptr<Engine> e,
                   Engine::Create(config, SmallModel(), comm, device, options));
  RETURN_IF_ERROR(testing::SetInitValues(*e, init_offset));
  return e;
}

TEST_CASE("Checkpoint: over a stream-ordered communicator, saves (sync and async), loads, "
          "reshards and verifies, and the resumed run equals an uninterrupted one, bitwise",
          "[zero][ckpt][stream_ordered]") {
  const int k = 2, m = 2;
  const int stage = GENERATE(0, 1, 2, 3);
  INFO("stage " << stage);
  const Config config = testing::TestConfig(stage, DType::kBF16, 1, 1.0, false);
  // Delayed streams: a value read before its stream is synchronized is a wrong value.
  auto device = testing::AsyncOneThreadCpuDevice(200);
  const std::string dir = TempDir("so_resume");
  const std::string ref_dir = TempDir("so_resume_ref");
  std::vector<std::vector<float>> ref(2), resumed(2);
  RequireAllOk(OnStreamOrderedRanks(2, device.get(), [&](int r, comm::Communicator* comm,
                                                         Device::Stream s) -> absl::Status {
    ASSIGN_OR_RETURN(auto e, NewEngineOn(config, comm, device.get(), s));
    RETURN_IF_ERROR(testing::TrainSteps(*e, 0, k + m));
    ASSIGN_OR_RETURN(ref[r], e->GatherMasterWeights());
    return SaveCheckpoint(*e, ref_dir).status();
  }));
  RequireAllOk(OnStreamOrderedRanks(2, device.get(), [&](int, comm::Communicator* comm,
                                                         Device::Stream s) -> absl::Status {
    ASSIGN_OR_RETURN(auto e, NewEngineOn(config, comm, device.get(), s));
    RETURN_IF_ERROR(testing::TrainSteps(*e, 0, k));
    return SaveCheckpoint(*e, dir).status();
  }));
  REQUIRE(VerifyCheckpoint(dir).ok());
  RequireAllOk(OnStreamOrderedRanks(2, device.get(), [&](int r, comm::Communicator* comm,
                                                         Device::Stream s) -> absl::Status {
    ASSIGN_OR_RETURN(auto e, NewEngineOn(config, comm, device.get(), s, 0.25f));
    RETURN_IF_ERROR(LoadCheckpoint(*e, dir));
    if (e->step() != k) return absl::InternalError(absl::StrCat("step ", e->step()));
    RETURN_IF_ERROR(testing::TrainSteps(*e, k, m));
    ASSIGN_OR_RETURN(resumed[r], e->GatherMasterWeights());
    AsyncCheckpointer ck;
    RETURN_IF_ERROR(ck.Start(*e, dir));
    return ck.Finish().status();
  }));
  for (int r = 0; r < 2; ++r) REQUIRE(BitEqual(ref[r], resumed[r]));
  auto a = ReadCheckpoint(ref_dir);
  auto b = ReadCheckpoint(dir);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  REQUIRE(b->info.step == k + m);
  RequireSameState(*a, *b);
  REQUIRE(VerifyCheckpoint(dir).ok());
  // Reshard onto 1 and 4 ranks of the same kind of communicator (averages need a power of two).
  for (int world : {1, 4}) {
    INFO("loaded at world " << world);
    RequireAllOk(OnStreamOrderedRanks(world, device.get(), [&](int, comm::Communicator* comm,
                                                               Device::Stream s) -> absl::Status {
      ASSIGN_OR_RETURN(auto e, NewEngineOn(config, comm, device.get(), s, 0.5f));
      LoadOptions lo;
      lo.allow_reshard = true;
      RETURN_IF_ERROR(LoadCheckpoint(*e, dir, lo));
      return CheckOwnedState(*e, *b);
    }));
  }
  // Destroying the engine with an async save in flight: Finish still agrees (the exchange
  // outlives the engine) and commits.
  const std::string late = TempDir("so_late");
  RequireAllOk(OnStreamOrderedRanks(2, device.get(), [&](int, comm::Communicator* comm,
                                                         Device::Stream s) -> absl::Status {
    AsyncCheckpointer ck;
    ASSIGN_OR_RETURN(auto e, NewEngineOn(config, comm, device.get(), s));
    RETURN_IF_ERROR(testing::TrainSteps(*e, 0, k));
    RETURN_IF_ERROR(ck.Start(*e, late));
    e.reset();
    return ck.Finish().status();
  }));
  REQUIRE(VerifyCheckpoint(late).ok());
}

// --- async ---------------------------------------------------------------------------------

TEST_CASE("Checkpoint: an async save lets training go on, moves `latest` only at Finish, and "
          "equals a synchronous save", "[zero][ckpt]") {
  const Config config = testing::TestConfig(3, DType::kBF16, 1, 0, false);
  auto device = testing::OneThreadCpuDevice();
  const std::string sync_root = TempDir("sync");
  const std::string async_root = TempDir("async");
  std::vector<std::string> latest_during(2);
  RequireAllOk(OnRanks(2, [&](int r, comm::Communicator* comm) -> absl::Status {
    ASSIGN_OR_RETURN(auto e, NewEngine(config, comm, device.get()));
    RETURN_IF_ERROR(testing::TrainSteps(*e, 0, 1));
    RETURN_IF_ERROR(SaveCheckpoint(*e, async_root).status());
    RETURN_IF_ERROR(testing::TrainSteps(*e, 1, 2));
    RETURN_IF_ERROR(SaveCheckpoint(*e, sync_root).status());
    AsyncCheckpointer ck;
    RETURN_IF_ERROR(ck.Start(*e, async_root));
    if (ck.Start(*e, async_root).code() != absl::StatusCode::kFailedPrecondition) {
      return absl::InternalError("a second Start was accepted");
    }
    RETURN_IF_ERROR(testing::TrainSteps(*e, 3, 2));  // the snapshot is of step 3
    latest_during[r] = Latest(async_root);
    ASSIGN_OR_RETURN(std::string path, ck.Finish());
    if (path != async_root + "/step_3") return absl::InternalError(path);
    return absl::OkStatus();
  }));
  // Before Finish `latest` may only name the earlier checkpoint.
  REQUIRE(latest_during[0] == "step_1\n");
  REQUIRE(Latest(async_root) == "step_3\n");
  auto a = ReadCheckpoint(async_root);
  auto b = ReadCheckpoint(sync_root);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  REQUIRE(a->info.step == 3);
  RequireSameState(*a, *b);
}

// The snapshot's copies run on a stream of their own, 2 ms late per copy on this device: the
// next steps' updates would overwrite master, m and v under them unless the engine fences its
// update on the snapshot. Stages 0-3, with and without optimizer offload (host-side updates).
TEST_CASE("Checkpoint: an async save's snapshot copies overlap the next steps and hold the "
          "state at Start", "[zero][ckpt]") {
  const int stage = GENERATE(0, 1, 2, 3);
  const bool offload = GENERATE(false, true);
  if (offload && stage == 0) return;  // offload needs a partitioned optimizer state
  CAPTURE(stage, offload);
  const Config config = testing::TestConfig(stage, DType::kBF16, 1, 0, offload);
  auto device = testing::AsyncOneThreadCpuDevice(2000);
  const std::string sync_root = TempDir("snap_sync");
  const std::string async_root = TempDir("snap_async");
  RequireAllOk(OnRanks(2, [&](int r, comm::Communicator* comm) -> absl::Status {
    ASSIGN_OR_RETURN(auto e, NewEngine(config, comm, device.get()));
    RETURN_IF_ERROR(testing::TrainSteps(*e, 0, 2));
    RETURN_IF_ERROR(SaveCheckpoint(*e, sync_root).status());
    AsyncCheckpointer ck;
    RETURN_IF_ERROR(ck.Start(*e, async_root));
    RETURN_IF_ERROR(testing::TrainSteps(*e, 2, 2));
    RETURN_IF_ERROR(ck.Finish().status());
    // The checkpointer's pinned buffer is reused by a second save.
    RETURN_IF_ERROR(ck.Start(*e, async_root));
    RETURN_IF_ERROR(testing::TrainSteps(*e, 4, 1));
    return ck.Finish().status();
  }));
  auto a = ReadCheckpoint(async_root + "/step_2");
  auto b = ReadCheckpoint(sync_root);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  REQUIRE(a->info.step == 2);
  RequireSameState(*a, *b);
  auto later = ReadCheckpoint(async_root);
  REQUIRE(later.ok());
  REQUIRE(later->info.step == 4);
}

TEST_CASE("Checkpoint: consolidate writes one safetensors file of the full fp32 state",
          "[zero][ckpt]") {
  const Config config = testing::TestConfig(2, DType::kBF16, 1, 0, false);
  auto device = testing::OneThreadCpuDevice();
  const std::string root = TempDir("consolidate");
  std::vector<float> master;
  RequireAllOk(OnRanks(3, [&](int r, comm::Communicator* comm) -> absl::Status {
    ASSIGN_OR_RETURN(auto e, NewEngine(config, comm, device.get()));
    RETURN_IF_ERROR(testing::TrainSteps(*e, 0, 2));
    ASSIGN_OR_RETURN(std::vector<float> w, e->GatherMasterWeights());
    if (r == 0) master = w;
    return SaveCheckpoint(*e, root).status();
  }));
  // Outside the checkpoint: consolidate refuses to write into the checkpoint it reads.
  const std::string out = TempDir("consolidated") + "/full.safetensors";
  REQUIRE(ConsolidateCheckpoint(root, out).ok());
  const std::string f = ReadFile(out);
  REQUIRE(f.size() > 8);
  uint64_t n = 0;
  for (int b = 0; b < 8; ++b) n |= static_cast<uint64_t>(static_cast<uint8_t>(f[b])) << (8 * b);
  REQUIRE(n % 8 == 0);
  const std::string header = f.substr(8, n);
  const char* data = f.data() + 8 + n;
  // Parse the header independently of the writer: find each parameter's offsets.
  auto state = ReadCheckpoint(root);
  REQUIRE(state.ok());
  int64_t flat = 0;
  for (size_t i = 0; i < state->info.params.size(); ++i) {
    const std::string& name = state->info.params[i].name;
    const size_t at = header.find("\"" + name + "\":");
    REQUIRE(at != std::string::npos);
    const size_t off = header.find("\"data_offsets\":[", at) + 16;
    const int64_t begin = std::stoll(header.substr(off));
    const int64_t numel = state->info.params[i].numel;
    std::vector<float> got(numel);
    std::memcpy(got.data(), data + begin, numel * 4);
    REQUIRE(BitEqual(got, std::vector<float>(master.begin() + flat, master.begin() + flat + numel)));
    flat += numel;
    REQUIRE(header.find("\"exp_avg." + name + "\":") != std::string::npos);
  }
  REQUIRE(8 + n + 3 * flat * 4 == f.size());
}

// --- hardening: hostile or careless inputs (docs/reliability.md) -----------------

// Saves the synthetic model (two steps, 2 ranks, stage 2) into `root`; `rename` edits the
// parameter names first.
std::vector<absl::Status> SaveModel(const std::string& root,
                                    const std::function<void(std::vector<ParamSpec>*)>& rename =
                                        nullptr) {
  const Config config = testing::TestConfig(2, DType::kBF16, 1, 0, false);
  auto device = testing::OneThreadCpuDevice();
  return OnRanks(2, [&](int, comm::Communicator* comm) -> absl::Status {
    std::vector<ParamSpec> specs = SmallModel();
    if (rename) rename(&specs);
    ASSIGN_OR_RETURN(auto e, Engine::Create(config, specs, comm, device.get()));
    RETURN_IF_ERROR(testing::SetInitValues(*e));
    RETURN_IF_ERROR(testing::TrainSteps(*e, 0, 2));
    return SaveCheckpoint(*e, root).status();
  });
}

std::vector<std::string> ListDir(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = opendir(dir.c_str())) {
    while (struct dirent* e = readdir(d)) {
      if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) {
        names.push_back(e->d_name);
      }
    }
    closedir(d);
  }
  std::sort(names.begin(), names.end());
  return names;
}

// A checksummed manifest claiming 2^36 elements per shard, beside 1 KiB shard files.
void WriteHugeManifest(const std::string& dir) {
  ckpt_internal::Manifest m;
  m.world_size = 2;
  m.stage = 2;
  m.config_hash = "fnv1a64:0";
  m.shard_elements = int64_t{1} << 36;
  m.units = {{"u", m.shard_elements * 2, m.shard_elements, 0}};
  m.params = {{"w", {int64_t{1} << 37}, int64_t{1} << 37, 0, 0}};
  for (int r = 0; r < 2; ++r) {
    m.files.push_back({ckpt_internal::ShardFileName(r), r, m.ShardFileBytes(), 0});
    WriteFile(dir + "/" + ckpt_internal::ShardFileName(r), std::string(1024, 'x'));
  }
  WriteFile(dir + "/manifest.json", ckpt_internal::ManifestToJson(m));
}

TEST_CASE("Hardening: a small manifest claiming 2^36 elements is refused before allocating",
          "[ckpt][hardening]") {
  const std::string dir = TempDir("huge");
  WriteHugeManifest(dir);
  const std::string out = TempDir("huge_out") + "/x.safetensors";
  const absl::Status read = ReadCheckpoint(dir).status();
  const absl::Status verify = VerifyCheckpoint(dir).status();
  const absl::Status cons = ConsolidateCheckpoint(dir, out);
  for (const absl::Status& s : {read, verify, cons}) {
    RequireError(s, absl::StatusCode::kDataLoss, "rank_00000.bin' is truncated: 1024 bytes");
  }
  REQUIRE(ListDir(ckpt_internal::Dirname(out)).empty());
}

TEST_CASE("Hardening: a shape whose product wraps int64 is refused by every reader",
          "[ckpt][hardening]") {
  const std::string dir = TempDir("wrap");
  ckpt_internal::Manifest m;
  m.config_hash = "fnv1a64:0";
  m.shard_elements = 18;
  m.units = {{"u", 18, 18, 0}};
  // 74696998 x 987817158259 wraps to 18 in int64 arithmetic... or to whatever it wraps to:
  // either way not a shape of 18 elements.
  m.params = {{"w", {74696998, 987817158259}, 18, 0, 0}};
  m.files.push_back({ckpt_internal::ShardFileName(0), 0, m.ShardFileBytes(), 0});
  WriteFile(dir + "/manifest.json", ckpt_internal::ManifestToJson(m));
  WriteFile(dir + "/rank_00000.bin", std::string(m.ShardFileBytes(), '\0'));
  const std::string out = TempDir("wrap_out") + "/x.safetensors";
  const absl::Status s = ConsolidateCheckpoint(dir, out);
  RequireError(s, absl::StatusCode::kDataLoss, "params[0].shape: too many elements");
  REQUIRE(ListDir(ckpt_internal::Dirname(out)).empty());
}

TEST_CASE("Hardening: a parameter name that is not UTF-8 fails the save on every rank at once",
          "[ckpt][hardening]") {
  const std::string root = TempDir("utf8");
  const auto st = SaveModel(root, [](std::vector<ParamSpec>* specs) { (*specs)[1].name = "w\xff"; });
  for (const absl::Status& s : st) {
    // Not rank 0's internal error with the others timing out in the next collective.
    RequireError(s, absl::StatusCode::kInvalidArgument,
                 "parameter 1 name: not valid UTF-8 at byte 1");
    REQUIRE(s.message() == st[0].message());
  }
  // Nothing was created: the check precedes the first write.
  REQUIRE(ListDir(root).empty());
}

TEST_CASE("Hardening: a parameter named __metadata__ is refused by consolidate",
          "[ckpt][hardening]") {
  const std::string root = TempDir("meta");
  RequireAllOk(SaveModel(root, [](std::vector<ParamSpec>* s) { (*s)[0].name = "__metadata__"; }));
  const std::string out = TempDir("meta_out") + "/x.safetensors";
  const absl::Status s = ConsolidateCheckpoint(root, out);
  RequireError(s, absl::StatusCode::kInvalidArgument, "'__metadata__'");
  REQUIRE(ListDir(ckpt_internal::Dirname(out)).empty());
}

TEST_CASE("Hardening: consolidate never overwrites without overwrite, never writes into the "
          "checkpoint, and leaves no temporary", "[ckpt][hardening]") {
  const std::string root = TempDir("cons_root");
  RequireAllOk(SaveModel(root));
  const std::string step = root + "/step_2";
  const std::vector<std::string> inside = {step + "/rank_00000.bin", step + "/manifest.json",
                                           root + "/latest", step + "/new.safetensors",
                                           root + "/new.safetensors", root + "/step_9",
                                           root + "/.zerort.lock"};
  const std::string shard = ReadFile(step + "/rank_00000.bin");
  const std::string manifest = ReadFile(step + "/manifest.json");
  for (const std::string& from : {root, step}) {
    for (const std::string& out : inside) {
      for (bool overwrite : {false, true}) {
        INFO(from << " -> " << out << " overwrite " << overwrite);
        ConsolidateOptions o;
        o.overwrite = overwrite;
        const absl::Status s = ConsolidateCheckpoint(from, out, o);
        INFO(s.ToString());
        if (from == step && out == root + "/new.safetensors") {
          REQUIRE(s.ok());  // beside the step directory read, not inside it
          REQUIRE(std::remove(out.c_str()) == 0);
          continue;
        }
        RequireError(s, absl::StatusCode::kInvalidArgument, "refusing to write");
      }
    }
  }
  REQUIRE(ReadFile(step + "/rank_00000.bin") == shard);
  REQUIRE(ReadFile(step + "/manifest.json") == manifest);
  REQUIRE(Latest(root) == "step_2\n");
  REQUIRE(ListDir(step) == std::vector<std::string>{"manifest.json", "rank_00000.bin",
                                                    "rank_00001.bin"});
  // An existing file: kept unless overwrite; a symlink at OUT is replaced, not followed.
  const std::string outdir = TempDir("cons_out");
  const std::string out = outdir + "/full.safetensors";
  WriteFile(out, "precious");
  REQUIRE(ConsolidateCheckpoint(root, out).code() == absl::StatusCode::kAlreadyExists);
  REQUIRE(ReadFile(out) == "precious");
  const std::string victim = outdir + "/victim";
  WriteFile(victim, "victim");
  REQUIRE(symlink(victim.c_str(), (outdir + "/link.safetensors").c_str()) == 0);
  REQUIRE(symlink(victim.c_str(), (out + ".tmp").c_str()) == 0);  // the old fixed temp name
  REQUIRE(ConsolidateCheckpoint(root, outdir + "/link.safetensors").code() ==
          absl::StatusCode::kAlreadyExists);
  ConsolidateOptions force;
  force.overwrite = true;
  REQUIRE(ConsolidateCheckpoint(root, out, force).ok());
  REQUIRE(ConsolidateCheckpoint(root, outdir + "/link.safetensors", force).ok());
  REQUIRE(ReadFile(victim) == "victim");
  REQUIRE(ReadFile(out) == ReadFile(outdir + "/link.safetensors"));
  REQUIRE(ReadFile(out).size() > 1000);
  // A directory, an empty name, a missing directory: refused, nothing left behind.
  REQUIRE(mkdir((outdir + "/adir").c_str(), 0755) == 0);
  for (bool named : {false, true}) {
    ConsolidateOptions o;
    o.named_temporary = named;
    REQUIRE(ConsolidateCheckpoint(root, outdir + "/adir", o).code() ==
            absl::StatusCode::kAlreadyExists);
    o.overwrite = true;
    REQUIRE(!ConsolidateCheckpoint(root, outdir + "/adir", o).ok());
    REQUIRE(!ConsolidateCheckpoint(root, "", o).ok());
    REQUIRE(!ConsolidateCheckpoint(root, outdir + "/", o).ok());
    REQUIRE(!ConsolidateCheckpoint(root, outdir + "/no/such/dir/x", o).ok());
  }
  REQUIRE(ListDir(outdir) == std::vector<std::string>{"adir", "full.safetensors",
                                                      "full.safetensors.tmp", "link.safetensors",
                                                      "victim"});
}

// Runs `fn` in a forked child and returns its wait status.
int InChild(const std::function<int()>& fn) {
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) _exit(fn());
  int wstatus = 0;
  REQUIRE(waitpid(pid, &wstatus, 0) == pid);
  return wstatus;
}

TEST_CASE("Hardening: a consolidate failing on a full disk or killed by SIGTERM leaves no "
          "temporary", "[ckpt][hardening]") {
  const std::string root = TempDir("full_root");
  RequireAllOk(SaveModel(root));
  for (bool named : {false, true}) {
    INFO("named temporary " << named);
    const std::string outdir = TempDir("full_out");
    // A file-size limit below the output's size: write() fails with EFBIG, as on a full disk.
    const int st = InChild([&] {
      signal(SIGXFSZ, SIG_IGN);
      struct rlimit lim = {4096, 4096};
      setrlimit(RLIMIT_FSIZE, &lim);
      ConsolidateOptions o;
      o.named_temporary = named;
      const absl::Status s = ConsolidateCheckpoint(root, outdir + "/x.safetensors", o);
      return s.ok() ? 0 : absl::IsInvalidArgument(s) || absl::IsUnavailable(s) ? 3 : 4;
    });
    REQUIRE(WIFEXITED(st));
    REQUIRE(WEXITSTATUS(st) != 0);
    REQUIRE(ListDir(outdir).empty());
  }
  // SIGTERM while the shards stream into the unnamed output: nothing appears.
  const std::string outdir = TempDir("term_out");
  struct TermFs : ckpt_internal::FileSystem {
    ckpt_internal::FileSystem* p = ckpt_internal::PosixFileSystem();
    absl::StatusOr<std::unique_ptr<ckpt_internal::WritableFile>> NewWritableFile(
        const std::string& path) override { return p->NewWritableFile(path); }
    absl::StatusOr<std::unique_ptr<ckpt_internal::ReadableFile>> NewReadableFile(
        const std::string& path) override {
      // The output exists by the time shards are opened (the manifest is read before it).
      if (absl::EndsWith(path, ".bin")) raise(SIGTERM);
      return p->NewReadableFile(path);
    }
    absl::StatusOr<int64_t> FileSize(const std::string& path) override { return p->FileSize(path); }
    bool Exists(const std::string& path) override { return p->Exists(path); }
    bool IsDirectory(const std::string& path) override { return p->IsDirectory(path); }
    absl::Status MakeDir(const std::string& path) override { return p->MakeDir(path); }
    absl::Status SyncDir(const std::string& path) override { return p->SyncDir(path); }
    absl::Status Rename(const std::string& a, const std::string& b) override {
      return p->Rename(a, b);
    }
    absl::Status RemoveAll(const std::string& path) override { return p->RemoveAll(path); }
  };
  const int st = InChild([&] {
    signal(SIGTERM, SIG_DFL);  // Catch2's handler would report instead of dying
    TermFs fs;
    ConsolidateOptions o;
    o.fs = &fs;
    return ConsolidateCheckpoint(root, outdir + "/x.safetensors", o).ok() ? 0 : 3;
  });
  REQUIRE(WIFSIGNALED(st));
  REQUIRE(WTERMSIG(st) == SIGTERM);
  REQUIRE(ListDir(outdir).empty());

  // Without O_TMPFILE the killed writer's named temporary stays, and so does every file that
  // merely looks like a temporary (a user's, a live writer's): consolidate removes only what
  // it created itself.
  const int named_st = InChild([&] {
    signal(SIGTERM, SIG_DFL);
    TermFs fs;
    ConsolidateOptions o;
    o.fs = &fs;
    o.named_temporary = true;
    return ConsolidateCheckpoint(root, outdir + "/x.safetensors", o).ok() ? 0 : 3;
  });
  REQUIRE(WIFSIGNALED(named_st));
  const std::vector<std::string> left = ListDir(outdir);
  REQUIRE(left.size() == 1);
  REQUIRE(absl::StartsWith(left[0], ".x.safetensors.zerort-tmp."));
  auto plant = [&](const std::string& name, mode_t mode) {
    const int fd = ::open((outdir + "/" + name).c_str(), O_CREAT | O_EXCL | O_RDWR, mode);
    REQUIRE(fd >= 0);
    REQUIRE(::fchmod(fd, mode) == 0);
    return fd;
  };
  ::close(plant(".x.safetensors.AAAAAA", 0600));
  ::close(plant(".x.safetensors.backup", 0644));  // the user's, named like an old temporary
  ::close(plant(".y.safetensors.CCCCCC", 0644));
  for (bool named : {true, false}) {
    ConsolidateOptions o;
    o.named_temporary = named;
    o.overwrite = true;
    REQUIRE(ConsolidateCheckpoint(root, outdir + "/x.safetensors", o).ok());
    REQUIRE(ListDir(outdir) == std::vector<std::string>{".x.safetensors.AAAAAA",
                                                        ".x.safetensors.backup",
                                                        left[0],
                                                        ".y.safetensors.CCCCCC",
                                                        "x.safetensors"});
  }
}

// The checkpoint's files, byte for byte, and whether it still verifies.
struct CheckpointBytes {
  std::string shard0, shard1, manifest, latest;
  bool operator==(const CheckpointBytes& o) const {
    return shard0 == o.shard0 && shard1 == o.shard1 && manifest == o.manifest &&
           latest == o.latest;
  }
};
CheckpointBytes BytesOf(const std::string& root) {
  const std::string step = root + "/step_2";
  return {ReadFile(step + "/rank_00000.bin"), ReadFile(step + "/rank_00001.bin"),
          ReadFile(step + "/manifest.json"), ReadFile(root + "/latest")};
}

// Consolidates from `from` to each of `outs` with and without overwrite; the number of calls
// that wrote (0 when every one was refused; a symlinked root may already be refused as a
// source, which is as safe).
int NotRefused(const std::string& from, const std::vector<std::string>& outs) {
  int bad = 0;
  for (const std::string& out : outs) {
    for (bool overwrite : {false, true}) {
      ConsolidateOptions o;
      o.overwrite = overwrite;
      const absl::Status s = ConsolidateCheckpoint(from, out, o);
      if (s.ok()) {
        std::fprintf(stderr, "%s -> %s overwrite %d: %s\n", from.c_str(), out.c_str(),
                     overwrite, s.ToString().c_str());
        ++bad;
      }
    }
  }
  return bad;
}

std::vector<std::string> FilesUnder(const std::string& alias) {
  return {alias + "/step_2/rank_00000.bin", alias + "/step_2/manifest.json",
          alias + "/latest", alias + "/step_2/new.safetensors", alias + "/.zerort.lock"};
}

TEST_CASE("Hardening: consolidate recognises the checkpoint through a second path (symlink, "
          "bind mount, hard link)", "[ckpt][hardening]") {
  const std::string root = TempDir("alias_root");
  RequireAllOk(SaveModel(root));
  const CheckpointBytes before = BytesOf(root);
  const std::string base = TempDir("alias");
  // A symlink to the root, and one to the step directory.
  REQUIRE(symlink(root.c_str(), (base + "/link").c_str()) == 0);
  CHECK(NotRefused(root, FilesUnder(base + "/link")) == 0);
  CHECK(NotRefused(base + "/link", FilesUnder(root)) == 0);
  // A hard link to a shard outside the checkpoint: still one of its files.
  const std::string hard = base + "/shard_copy.safetensors";
  REQUIRE(link((root + "/step_2/rank_00000.bin").c_str(), hard.c_str()) == 0);
  CHECK(NotRefused(root, {hard}) == 0);
  // A bind mount of the root: the same directories under another path, which realpath does
  // not see through.
  const std::string mnt = base + "/mnt";
  REQUIRE(mkdir(mnt.c_str(), 0755) == 0);
  const int rc = testing::InPrivateMountNamespace([&] {
    if (!testing::BindMount(root, mnt)) return static_cast<int>(testing::kNoNamespace);
    return NotRefused(root, FilesUnder(mnt)) + NotRefused(mnt + "/step_2", FilesUnder(root));
  });
  if (rc == testing::kNoNamespace) {
    WARN("no private mount namespace here (sandbox or kernel): the bind mount is not checked");
  } else {
    INFO("consolidations through the bind mount that were not refused: " << rc);
    CHECK(rc == 0);
  }
  CHECK(BytesOf(root) == before);
  CHECK(ListDir(root + "/step_2") == std::vector<std::string>{"manifest.json", "rank_00000.bin",
                                                              "rank_00001.bin"});
  CHECK(VerifyCheckpoint(root).ok());
}

TEST_CASE("Hardening: consolidate --force replaces only a regular file, and removes only its "
          "own temporary", "[ckpt][hardening]") {
  const std::string root = TempDir("special_root");
  RequireAllOk(SaveModel(root));
  const std::string outdir = TempDir("special_out");
  ConsolidateOptions force;
  force.overwrite = true;
  const std::string fifo = outdir + "/fifo.safetensors";
  REQUIRE(mkfifo(fifo.c_str(), 0644) == 0);
  RequireError(ConsolidateCheckpoint(root, fifo, force), absl::StatusCode::kInvalidArgument,
               "a FIFO, not a regular file");
  struct stat st;
  REQUIRE(lstat(fifo.c_str(), &st) == 0);
  CHECK(S_ISFIFO(st.st_mode));
  const std::string node = outdir + "/null.safetensors";
  if (mknod(node.c_str(), S_IFCHR | 0644, makedev(1, 3)) == 0) {
    RequireError(ConsolidateCheckpoint(root, node, force), absl::StatusCode::kInvalidArgument,
                 "a character device");
    REQUIRE(lstat(node.c_str(), &st) == 0);
    CHECK(S_ISCHR(st.st_mode));
  } else {
    WARN("mknod not permitted here: the device-node case is not checked");
  }
  // Files named like temporaries, one even exactly like ours: never ours to remove.
  for (const char* name : {".x.safetensors.backup", ".x.safetensors.zerort-tmp.ABCDEF"}) {
    WriteFile(outdir + "/" + name, "someone's");
  }
  for (bool named : {false, true}) {
    ConsolidateOptions o = force;
    o.named_temporary = named;
    REQUIRE(ConsolidateCheckpoint(root, outdir + "/x.safetensors", o).ok());
  }
  CHECK(ReadFile(outdir + "/.x.safetensors.backup") == "someone's");
  CHECK(ReadFile(outdir + "/.x.safetensors.zerort-tmp.ABCDEF") == "someone's");
  const std::vector<std::string> names = ListDir(outdir);
  CHECK(std::count_if(names.begin(), names.end(), [](const std::string& n) {
          return absl::StartsWith(n, ".x.safetensors");
        }) == 2);
}

TEST_CASE("Hardening: two consolidates racing for one OUT: one wins, the other fails cleanly, "
          "the file is complete", "[ckpt][hardening]") {
  const std::string root = TempDir("race_root");
  RequireAllOk(SaveModel(root));
  const std::string ref = TempDir("race_ref") + "/ref.safetensors";
  REQUIRE(ConsolidateCheckpoint(root, ref).ok());
  for (int round = 0; round < 8; ++round) {
    const bool overwrite = round % 2 == 1;
    INFO("round " << round << " overwrite " << overwrite);
    const std::string outdir = TempDir("race");
    const std::string out = outdir + "/x.safetensors";
    absl::Status s[2];
    std::thread a([&] { ConsolidateOptions o; o.overwrite = overwrite; s[0] = ConsolidateCheckpoint(root, out, o); });
    std::thread b([&] { ConsolidateOptions o; o.overwrite = overwrite; s[1] = ConsolidateCheckpoint(root, out, o); });
    a.join();
    b.join();
    if (overwrite) {
      REQUIRE(s[0].ok());
      REQUIRE(s[1].ok());
    } else {
      REQUIRE(s[0].ok() != s[1].ok());
      REQUIRE((s[0].ok() ? s[1] : s[0]).code() == absl::StatusCode::kAlreadyExists);
    }
    REQUIRE(ReadFile(out) == ReadFile(ref));
    REQUIRE(ListDir(outdir) == std::vector<std::string>{"x.safetensors"});
  }
}

TEST_CASE("Hardening: symlinks and odd `latest` files are refused, quoted escaped and bounded",
          "[ckpt][hardening]") {
  const std::string root = TempDir("links");
  RequireAllOk(SaveModel(root));
  const std::string elsewhere = TempDir("links_victim");
  const std::string secret = elsewhere + "/passwd";
  WriteFile(secret, "root:x:0:0:SECRET\n");
  auto refused = [&](const std::string& path) {
    const absl::Status s = ReadCheckpoint(path).status();
    INFO(s.ToString());
    REQUIRE(!s.ok());
    REQUIRE(!absl::StrContains(s.message(), "SECRET"));
    REQUIRE(s.message().find('\x1b') == absl::string_view::npos);
    return std::string(s.message());
  };
  // `latest` a symlink to a file outside (its content is never read, let alone printed).
  REQUIRE(std::rename((root + "/latest").c_str(), (root + "/latest.real").c_str()) == 0);
  REQUIRE(symlink(secret.c_str(), (root + "/latest").c_str()) == 0);
  REQUIRE(absl::StrContains(refused(root), "is a symlink"));
  REQUIRE(std::remove((root + "/latest").c_str()) == 0);
  // Escape codes, a long file, a number that is not one.
  for (const std::string& text : {std::string("\x1b[2J\x1b]0;pwned\x07"), std::string(5000, 'A'),
                                  std::string("step_-1\n"), std::string("step_2/../../x\n")}) {
    WriteFile(root + "/latest", text);
    const std::string msg = refused(root);
    REQUIRE(!absl::StrContains(msg, std::string(65, 'A')));  // bounded
    if (text[0] == '\x1b') REQUIRE(absl::StrContains(msg, "\\x1b[2J"));
  }
  WriteFile(root + "/latest", "step_2\n");
  REQUIRE(ReadCheckpoint(root).ok());
  // A step directory that is a symlink to a checkpoint elsewhere.
  const std::string other = TempDir("links_other");
  RequireAllOk(SaveModel(other));
  REQUIRE(symlink((other + "/step_2").c_str(), (root + "/step_7").c_str()) == 0);
  WriteFile(root + "/latest", "step_7\n");
  REQUIRE(absl::StrContains(refused(root), "not a directory (a symlink is refused)"));
  WriteFile(root + "/latest", "step_2\n");
  // A shard, or the manifest, that is a symlink (even to a valid file of the same size).
  const std::string shard = root + "/step_2/rank_00001.bin";
  REQUIRE(std::rename(shard.c_str(), (elsewhere + "/shard").c_str()) == 0);
  REQUIRE(symlink((elsewhere + "/shard").c_str(), shard.c_str()) == 0);
  REQUIRE(absl::StrContains(refused(root), "rank_00001.bin' is a symlink"));
  REQUIRE(absl::StrContains(std::string(VerifyCheckpoint(root).status().message()), "symlink"));
  const std::string manifest = root + "/step_2/manifest.json";
  REQUIRE(std::rename(manifest.c_str(), (elsewhere + "/manifest").c_str()) == 0);
  REQUIRE(symlink((elsewhere + "/manifest").c_str(), manifest.c_str()) == 0);
  REQUIRE(absl::StrContains(refused(root), "manifest.json' is a symlink"));
}

TEST_CASE("Hardening: a save never writes through a planted `latest.tmp` symlink",
          "[ckpt][hardening]") {
  const std::string root = TempDir("plant");
  const std::string victim = TempDir("plant_victim") + "/victim";
  WriteFile(victim, "victim");
  REQUIRE(symlink(victim.c_str(), (root + "/latest.tmp").c_str()) == 0);
  RequireAllOk(SaveModel(root));
  REQUIRE(ReadFile(victim) == "victim");
  REQUIRE(Latest(root) == "step_2\n");
  REQUIRE(ReadCheckpoint(root).ok());
}

TEST_CASE("Hardening: a second writer is refused by the root's lock, and a save never deletes "
          "a complete checkpoint", "[ckpt][hardening]") {
  const std::string root = TempDir("lock");
  // Another writer, mid-save: it holds the lock and is producing step_2.tmp.
  {
    auto lock = ckpt_internal::DirLock::Acquire(root);
    REQUIRE(lock.ok());
    REQUIRE(mkdir((root + "/step_2.tmp").c_str(), 0755) == 0);
    WriteFile(root + "/step_2.tmp/rank_00000.bin", "in progress");
    const auto st = SaveModel(root);
    for (const absl::Status& s : st) {
      RequireError(s, absl::StatusCode::kFailedPrecondition, "another writer is saving into");
    }
    REQUIRE(ReadFile(root + "/step_2.tmp/rank_00000.bin") == "in progress");
  }
  // Its lock released (it died): step_2.tmp is debris and goes; the save succeeds.
  RequireAllOk(SaveModel(root));
  REQUIRE(Latest(root) == "step_2\n");
  // A complete step_2 that `latest` does not name is moved aside, not deleted.
  WriteFile(root + "/step_2/marker", "keep me");
  WriteFile(root + "/latest", "step_1\n");
  REQUIRE(mkdir((root + "/step_1").c_str(), 0755) == 0);
  RequireAllOk(SaveModel(root));
  REQUIRE(Latest(root) == "step_2\n");
  std::string aside;
  for (const std::string& n : ListDir(root)) {
    if (absl::StartsWith(n, "step_2.replaced-")) aside = n;
  }
  REQUIRE(!aside.empty());
  REQUIRE(ReadFile(root + "/" + aside + "/marker") == "keep me");
  REQUIRE(ReadCheckpoint(root + "/" + aside).ok());
}

TEST_CASE("Hardening: destroying the engine with an async save in flight is safe, and the save "
          "still commits", "[ckpt][hardening]") {
  const Config config = testing::TestConfig(2, DType::kBF16, 1, 0, false);
  // Delayed streams: the copies are still running when the engine goes.
  auto device = testing::AsyncOneThreadCpuDevice(2000);
  const std::string root = TempDir("lifetime");
  const std::string ref = TempDir("lifetime_ref");
  RequireAllOk(OnRanks(2, [&](int, comm::Communicator* comm) -> absl::Status {
    AsyncCheckpointer ck;  // declared before the engine: destroyed after it
    ASSIGN_OR_RETURN(auto e, NewEngine(config, comm, device.get()));
    RETURN_IF_ERROR(testing::TrainSteps(*e, 0, 2));
    RETURN_IF_ERROR(SaveCheckpoint(*e, ref).status());
    RETURN_IF_ERROR(ck.Start(*e, root));
    e.reset();  // with the writer thread possibly still waiting for the snapshot
    return ck.Finish().status();
  }));
  auto a = ReadCheckpoint(root);
  auto b = ReadCheckpoint(ref);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  RequireSameState(*a, *b);
}

}  // namespace
}  // namespace zerort
