// HSDP with real shard groups across processes: runs under mpirun at world 4
// (engine_hsdp_mpi_test.sh). Every rank trains the synthetic model as HSDP 2x2 (shard groups
// {0,1} {2,3}, split off the MPI communicator; gradients reduced over all four processes by
// ReduceScatterInGroups) at stages 1-3, with and without optimizer offload, and checks that the
// fp32 masters equal, bit for bit, flat stage 3 run on an in-process group of 4 inside this
// process: the same numbers whatever the layout and the backend. Then an HSDP checkpoint
// written by the four processes (each replica its flat shard) resumes to the same masters.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "base/status.h"
#include "base/testing/bit_equal.h"
#include "checkpoint/checkpoint.h"
#include "comm/testing/mpi_main.h"
#include "device/testing/one_thread.h"
#include "zero/engine.h"
#include "zero/testing/synthetic_trainer.h"

namespace zerort {
namespace {

constexpr int kSteps = 12;

// `b` (a reference) was computed, and `a` has its bits.
bool Same(const std::vector<float>& a, const std::vector<float>& b) {
  return !b.empty() && testing::BitEqual(a, b);
}

// Saves at step kSteps / 2 and goes on; a fresh engine loads the save and does the same steps.
// Returns both ends' masters.
absl::Status SaveAndResume(const Config& config, comm::Communicator* mpi, Device* device,
                           const std::string& root, std::vector<float>* uninterrupted,
                           std::vector<float>* resumed) {
  const auto specs = testing::SmallModel();
  ASSIGN_OR_RETURN(auto e, Engine::Create(config, specs, mpi, device));
  RETURN_IF_ERROR(testing::SetInitValues(*e));
  RETURN_IF_ERROR(testing::TrainSteps(*e, 0, kSteps / 2));
  RETURN_IF_ERROR(SaveCheckpoint(*e, root).status());
  RETURN_IF_ERROR(testing::TrainSteps(*e, kSteps / 2, kSteps - kSteps / 2));
  ASSIGN_OR_RETURN(*uninterrupted, e->GatherMasterWeights());
  e.reset();
  ASSIGN_OR_RETURN(auto fresh, Engine::Create(config, specs, mpi, device));
  RETURN_IF_ERROR(testing::SetInitValues(*fresh, 0.25f));  // overwritten by the load
  RETURN_IF_ERROR(LoadCheckpoint(*fresh, root));
  RETURN_IF_ERROR(testing::TrainSteps(*fresh, kSteps / 2, kSteps - kSteps / 2));
  ASSIGN_OR_RETURN(*resumed, fresh->GatherMasterWeights());
  return absl::OkStatus();
}

int Main(comm::Communicator* mpi) {
  const int rank = mpi->rank(), world = mpi->size();
  if (world != 4) {
    std::fprintf(stderr, "rank %d: run at world 4 (2 shard groups of 2), not %d\n", rank, world);
    return 1;
  }
  auto device = testing::OneThreadCpuDevice();
  const auto specs = testing::SmallModel();
  int failures = 0, checks = 0;
  auto check = [&](bool ok, const std::string& what, const absl::Status& s) {
    ++checks;
    if (ok) return;
    ++failures;
    std::fprintf(stderr, "rank %d: FAILED %s: %s\n", rank, what.c_str(),
                 s.ok() ? "masters differ from the in-process flat reference"
                        : s.ToString().c_str());
  };
  for (bool offload : {false, true}) {
    // The reference: flat stage 3 on 4 in-process ranks (threads of this process).
    const Config ref_config = testing::TestConfig(3, DType::kBF16, 1, 0.05, offload);
    auto ref_runs = testing::TrainRanks(ref_config, specs, world, device.get(), kSteps);
    const std::vector<float> ref =
        ref_runs.ok() ? std::move((*ref_runs)[0].master) : std::vector<float>();
    for (int stage = 1; stage <= 3; ++stage) {
      Config config = testing::TestConfig(stage, DType::kBF16, 1, 0.05, offload);
      config.zero.mics_shard_size = 2;
      auto run = testing::TrainRank(config, specs, mpi, device.get(), kSteps);
      const std::string what = "HSDP 2x2 stage " + std::to_string(stage) +
                               (offload ? ", offload" : "");
      check(run.ok() && Same(run->master, ref), what, run.status());
      if (stage != 3) continue;
      // Every process sees the same directory: the test's TEST_TMPDIR, which mpirun passes on.
      const char* tmp = std::getenv("TEST_TMPDIR");
      if (tmp == nullptr) {
        check(false, "checkpoint", absl::FailedPreconditionError("TEST_TMPDIR is not set"));
        continue;
      }
      std::vector<float> uninterrupted, resumed;
      const absl::Status s =
          SaveAndResume(config, mpi, device.get(),
                        std::string(tmp) + "/hsdp_mpi_ckpt" + (offload ? "_offload" : ""),
                        &uninterrupted, &resumed);
      check(s.ok() && Same(uninterrupted, ref), what + ", saved mid-run", s);
      check(s.ok() && Same(resumed, ref), what + ", resumed from the checkpoint", s);
    }
  }
  std::printf("rank %d of %d: %d of %d HSDP runs bit-identical to flat\n", rank, world,
              checks - failures, checks);
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace zerort

int main(int argc, char** argv) {
  return zerort::comm::testing::MpiTestMain(argc, argv, zerort::Main);
}
