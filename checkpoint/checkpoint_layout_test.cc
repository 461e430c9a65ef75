// Checkpoints across sharding layouts: a checkpoint saved by an HSDP engine
// (zero_optimization.mics_shard_size) is the flat checkpoint of its world, element for element,
// and loads into flat engines and other shard groups at any world size and stage 1-3, and back.
//
// The references are flat runs: HSDP equals flat bitwise (//zero:engine_hsdp_test), and flat
// saves and reshards are tested against uninterrupted runs in //checkpoint:checkpoint_test. So
// every HSDP path here is compared with the same path taken by flat engines: the checkpoint's
// tensors with a flat save of the same step, the masters right after a load with those at the
// save, and the masters after more steps with a flat engine of the target's world loading the
// flat checkpoint (and, where the world does not change, with the run that never stopped).
#include <algorithm>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "base/testing/checks.h"
#include "base/testing/temp_dir.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/internal/ckpt_fs.h"
#include "checkpoint/testing/posix_forwarding_fs.h"
#include "comm/testing/on_ranks.h"
#include "device/cpu_device.h"
#include "zero/engine.h"
#include "zero/testing/synthetic_trainer.h"

namespace zerort {
namespace {

using testing::BitEqual;
using testing::SmallModel;

struct Layout {
  int world;
  int mics;  // mics_shard_size; -1: flat
  int stage;
};

// "HSDP GxR": shard groups of G ranks, R of them (engine_hsdp_test's naming).
std::string Name(const Layout& l) {
  return l.mics > 0 ? absl::StrCat("HSDP ", l.mics, "x", l.world / l.mics, " stage ", l.stage)
                    : absl::StrCat("flat ", l.world, " stage ", l.stage);
}

struct Variant {
  const char* name;
  DType dtype;
  bool offload;
  bool async;                      // save through AsyncCheckpointer, training while it writes
  std::vector<int> overflow_steps; // fp16: an Inf on rank 1 at these steps (scaler state moves)
};

Config Make(const Layout& l, const Variant& v) {
  Config c = testing::TestConfig(l.stage, v.dtype, /*gas=*/1, /*clip=*/0.05, v.offload);
  c.zero.mics_shard_size = l.mics;
  return c;
}

// What rank 0 saw (GatherMasterWeights is the same on every rank; each rank checks that).
struct Seen {
  std::vector<float> start;  // after the first steps, or right after the load
  std::vector<float> end;    // after `more` steps
  EngineState state;         // at `start`
  EngineState end_state;
};

struct Job {
  Layout layout;
  std::string load;  // a checkpoint to load (else InitValue and `first` steps)
  int first = 3;     // the steps before `start`; with a load, the step index it resumes at
                     // (the trainer's count: an overflow skips a step AdamW's t does not count)
  std::string save;  // a root to save into at `start`, or with `save_at_end` at the end
  int more = 3;
  bool save_at_end = false;
};

// Runs `job` on its world of in-process ranks: an engine of its layout starts from InitValue
// and `first` steps, or from InitValue + 0.25 (so a load that misses an element shows) and the
// checkpoint; saves at that point if asked (asynchronously with `v.async`, finishing after the
// `more` steps that follow); trains `more` steps (and then saves, with `save_at_end`).
Seen Run(const Job& job, const Variant& v) {
  auto device = CreateCpuDevice();
  std::vector<Seen> seen(job.layout.world);
  const std::vector<absl::Status> st = comm::testing::OnRanks(
      job.layout.world, {20000}, [&](int r, comm::Communicator* comm) -> absl::Status {
        ASSIGN_OR_RETURN(auto e, Engine::Create(Make(job.layout, v), SmallModel(), comm,
                                                device.get()));
        if (job.load.empty()) {
          RETURN_IF_ERROR(testing::SetInitValues(*e));
          RETURN_IF_ERROR(testing::TrainSteps(*e, 0, job.first, v.overflow_steps, 1));
        } else {
          RETURN_IF_ERROR(testing::SetInitValues(*e, 0.25f));
          LoadOptions lo;
          lo.allow_reshard = true;
          RETURN_IF_ERROR(LoadCheckpoint(*e, job.load, lo));
        }
        ASSIGN_OR_RETURN(seen[r].start, e->GatherMasterWeights());
        seen[r].state = e->state();
        AsyncCheckpointer async;
        const bool save_now = !job.save.empty() && !job.save_at_end;
        if (save_now && v.async) RETURN_IF_ERROR(async.Start(*e, job.save));
        if (save_now && !v.async) RETURN_IF_ERROR(SaveCheckpoint(*e, job.save).status());
        RETURN_IF_ERROR(testing::TrainSteps(*e, job.first, job.more, v.overflow_steps, 1));
        if (save_now && v.async) RETURN_IF_ERROR(async.Finish().status());
        if (job.save_at_end && !job.save.empty()) {
          RETURN_IF_ERROR(SaveCheckpoint(*e, job.save).status());
        }
        ASSIGN_OR_RETURN(seen[r].end, e->GatherMasterWeights());
        seen[r].end_state = e->state();
        return absl::OkStatus();
      });
  for (int r = 0; r < job.layout.world; ++r) {
    INFO(Name(job.layout) << ", rank " << r << ": " << st[r].ToString());
    REQUIRE(st[r].ok());
    REQUIRE(BitEqual(seen[r].end, seen[0].end));
  }
  return seen[0];
}

void RequireSameState(const EngineState& a, const EngineState& b) {
  CHECK(a.step == b.step);
  CHECK(a.loss_scale == b.loss_scale);
  CHECK(a.scaler_hysteresis_left == b.scaler_hysteresis_left);
  CHECK(a.scaler_iter == b.scaler_iter);
  CHECK(a.scaler_last_overflow == b.scaler_last_overflow);
}

// The two checkpoints hold the same tensors, bit for bit, at the same step and world.
void RequireSameCheckpoint(const std::string& a, const std::string& b) {
  auto ca = ReadCheckpoint(a), cb = ReadCheckpoint(b);
  INFO(a << ": " << ca.status().ToString() << "; " << b << ": " << cb.status().ToString());
  REQUIRE(ca.ok());
  REQUIRE(cb.ok());
  CHECK(ca->info.step == cb->info.step);
  CHECK(ca->info.world_size == cb->info.world_size);
  CHECK(ca->info.loss_scale == cb->info.loss_scale);
  REQUIRE(ca->master.size() == cb->master.size());
  for (size_t i = 0; i < ca->master.size(); ++i) {
    CAPTURE(i);
    CHECK(BitEqual(ca->master[i], cb->master[i]));
    CHECK(BitEqual(ca->exp_avg[i], cb->exp_avg[i]));
    CHECK(BitEqual(ca->exp_avg_sq[i], cb->exp_avg_sq[i]));
  }
}

Layout Flat(const Layout& l) { return {l.world, -1, l.stage}; }

void SaveHsdpLoadEverywhere(int stage, const Variant& v) {
  const std::string root = testing::TempDir("layout_ckpt_");
  const Layout h22{4, 2, stage};
  // The source: HSDP 2x2 saves at step 3 and goes on; flat 4 does the same (they are equal).
  const Seen h = Run({h22, "", 3, root + "/h22", 3}, v);
  const Seen f = Run({Flat(h22), "", 3, root + "/f4", 3}, v);
  REQUIRE(BitEqual(h.end, f.end));
  // The HSDP checkpoint is the flat one: same tensors in the same files' layout.
  RequireSameCheckpoint(root + "/h22", root + "/f4");
  auto info = ReadCheckpointInfo(root + "/h22");
  REQUIRE(info.ok());
  CHECK(info->world_size == 4);
  CHECK(info->files.size() == 4);

  // Targets: the same layout, flat at the same world, flat at another world and stage, and
  // shard groups of 4 on 8 ranks (stage changed where the source's is 1).
  const Layout targets[] = {h22, {4, -1, stage}, {2, -1, stage % 3 + 1},
                            {8, 4, stage == 1 ? 3 : stage}};
  EngineState h42_state;  // HSDP 4x2's at its save
  for (const Layout& t : targets) {
    INFO("HSDP 2x2 stage " << stage << " -> " << Name(t) << ", " << v.name);
    const bool hsdp8 = t.world == 8;
    // HSDP 4x2 saves at the end, for the way back below.
    const Seen x = Run({t, root + "/h22", 3, hsdp8 ? root + "/h42" : "", 3, true}, v);
    const Seen y = Run({Flat(t), root + "/f4", 3, hsdp8 ? root + "/f8" : "", 3, true}, v);
    CHECK(BitEqual(x.start, h.start));  // the loaded masters are the saved ones
    RequireSameState(x.state, h.state);
    CHECK(BitEqual(x.end, y.end));
    if (t.world == 4) CHECK(BitEqual(x.end, h.end));  // as if the save had not happened
    if (hsdp8) h42_state = x.end_state;
  }

  // And back: HSDP 4x2's checkpoint at step 6 (world 8) equals flat 8's, and loads into
  // HSDP 2x2 and flat 4 as flat 8's does into flat 4.
  RequireSameCheckpoint(root + "/h42", root + "/f8");
  const Seen ref = Run({{4, -1, stage}, root + "/f8", 6, "", 3}, v);
  for (const Layout& t : {h22, Layout{4, -1, stage % 3 + 1}, Layout{8, 2, stage}}) {
    INFO("HSDP 4x2 -> " << Name(t) << ", " << v.name);
    const Seen x = Run({t, root + "/h42", 6, "", 3}, v);
    RequireSameState(x.state, h42_state);
    if (t.world == 4) {
      CHECK(BitEqual(x.end, ref.end));
    } else {
      CHECK(BitEqual(x.end, Run({Flat(t), root + "/f8", 6, "", 3}, v).end));
    }
  }
}

TEST_CASE("Checkpoint layouts: HSDP 2x2 saves the flat checkpoint and loads into flat 4, "
          "flat 2, HSDP 4x2 and back, bitwise", "[checkpoint][hsdp]") {
  const Variant plain{"bf16", DType::kBF16, false, false, {}};
  const Variant offload{"bf16, optimizer offload, async save", DType::kBF16, true, true, {}};
  for (int stage = 1; stage <= 3; ++stage) {
    SaveHsdpLoadEverywhere(stage, plain);
    SaveHsdpLoadEverywhere(stage, offload);
  }
  // fp16's dynamic loss scaler, with an overflow before the save and one after.
  SaveHsdpLoadEverywhere(3, {"fp16, overflows at steps 1 and 4", DType::kF16, false, true,
                             {1, 4}});
}

// POSIX, except that creating the file named `fail_name` fails: one rank's shard (not rank 0's)
// of an HSDP save.
class FailCreate : public testing::PosixForwardingFs {
 public:
  explicit FailCreate(std::string fail_name) : fail_name_(std::move(fail_name)) {}
  absl::StatusOr<std::unique_ptr<ckpt_internal::WritableFile>> NewWritableFile(
      const std::string& path) override {
    if (absl::EndsWith(path, "/" + fail_name_)) {
      return absl::UnavailableError(absl::StrCat("injected failure: create '", path, "'"));
    }
    return posix()->NewWritableFile(path);
  }

 private:
  const std::string fail_name_;
};

std::vector<std::string> Listing(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    out.push_back(e.path().filename().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST_CASE("Checkpoint layouts: an HSDP save failing on one replica leaves nothing behind",
          "[checkpoint][hsdp]") {
  // In 2 groups of 2, rank 2 (group shard 0's second replica) writes flat shard 1.
  for (bool async : {false, true}) {
    INFO((async ? "async" : "sync"));
    const std::string root = testing::TempDir("layout_fail_");
    FailCreate fs("rank_00001.bin");
    auto device = CreateCpuDevice();
    std::vector<std::string> before, after;
    std::vector<absl::Status> failed(4);
    std::vector<int64_t> loaded_step(4);
    const std::vector<absl::Status> st = comm::testing::OnRanks(
        4, {20000}, [&](int r, comm::Communicator* comm) -> absl::Status {
          const Variant v{"bf16", DType::kBF16, false, async, {}};
          ASSIGN_OR_RETURN(auto e,
                           Engine::Create(Make({4, 2, 3}, v), SmallModel(), comm, device.get()));
          RETURN_IF_ERROR(testing::SetInitValues(*e));
          RETURN_IF_ERROR(testing::TrainSteps(*e, 0, 2));
          RETURN_IF_ERROR(SaveCheckpoint(*e, root).status());
          RETURN_IF_ERROR(e->Barrier());
          if (r == 0) before = Listing(root);
          RETURN_IF_ERROR(e->Barrier());
          RETURN_IF_ERROR(testing::TrainSteps(*e, 2, 1));
          SaveOptions so;
          so.fs = &fs;
          if (async) {
            AsyncCheckpointer ck(so);
            absl::Status s = ck.Start(*e, root);
            if (s.ok()) s = testing::TrainSteps(*e, 3, 1);
            failed[r] = s.ok() ? ck.Finish().status() : s;
          } else {
            failed[r] = SaveCheckpoint(*e, root, so).status();
          }
          RETURN_IF_ERROR(e->Barrier());
          if (r == 0) after = Listing(root);
          RETURN_IF_ERROR(e->Barrier());
          RETURN_IF_ERROR(LoadCheckpoint(*e, root));  // latest: still step 2
          loaded_step[r] = e->step();
          // The root takes the next save.
          RETURN_IF_ERROR(testing::TrainSteps(*e, 2, 1));
          return SaveCheckpoint(*e, root).status();
        });
    for (int r = 0; r < 4; ++r) {
      CAPTURE(r);
      INFO(st[r].ToString());
      REQUIRE(st[r].ok());
      CHECK(failed[r].code() == absl::StatusCode::kUnavailable);
      CHECK(absl::StrContains(failed[r].message(), "rank_00001.bin"));
      CHECK(loaded_step[r] == 2);
    }
    CHECK(after == before);  // no step_3.tmp, no lock file, `latest` unmoved
    CHECK(std::find(before.begin(), before.end(), "latest") != before.end());
    auto info = ReadCheckpointInfo(root);
    REQUIRE(info.ok());
    CHECK(info->step == 3);
  }
}

}  // namespace
}  // namespace zerort
