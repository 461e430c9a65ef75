// Stage equivalence across processes: runs under mpirun (engine_mpi_test.sh). Every rank trains
// the synthetic model with stages 0-3 (and optimizer offload) over the MPI communicator, and
// checks that every stage ends with the same fp32 master weights, bit for bit, as stage 0 run
// on an in-process group of the same world size inside this process (threads): the same
// numbers whatever the stage and whatever the backend. Stages 1-3 also run as HSDP with shard
// groups of one rank (zero_optimization.mics_shard_size 1).
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "base/testing/bit_equal.h"
#include "comm/testing/mpi_main.h"
#include "device/testing/one_thread.h"
#include "zero/engine.h"
#include "zero/testing/synthetic_trainer.h"

namespace zerort {
namespace {

int Main(comm::Communicator* mpi) {
  const int rank = mpi->rank(), world = mpi->size();
  auto device = testing::OneThreadCpuDevice();
  const auto specs = testing::SmallModel();
  const int steps = 12;
  int failures = 0, checks = 0;
  for (DType precision : {DType::kF32, DType::kBF16}) {
    for (int gas : {1, 3}) {
      // The reference: stage 0 on `world` in-process ranks (threads of this process).
      const Config ref_config = testing::TestConfig(0, precision, gas, 0.05, false);
      auto ref_runs = testing::TrainRanks(ref_config, specs, world, device.get(), steps);
      const std::vector<float> ref =
          ref_runs.ok() ? std::move((*ref_runs)[0].master) : std::vector<float>();
      for (int stage = 0; stage <= 3; ++stage) {
        // Variant 2: HSDP with shard groups of one rank (worlds 2 and 3 have no other divisor):
        // every gradient is reduced across the groups by ReduceScatterInGroups over MPI.
        for (int variant = 0; variant < 3; ++variant) {
          const bool offload = variant == 1;
          const int mics = variant == 2 ? 1 : -1;
          if (stage == 0 && variant > 0) continue;
          Config config = testing::TestConfig(stage, precision, gas, 0.05, offload);
          config.zero.mics_shard_size = mics;
          auto run = testing::TrainRank(config, specs, mpi, device.get(), steps);
          ++checks;
          const bool same = run.ok() && !ref.empty() && testing::BitEqual(run->master, ref);
          if (!same) {
            ++failures;
            std::fprintf(stderr,
                         "rank %d: FAILED precision=%d gas=%d stage=%d offload=%d mics=%d: %s\n",
                         rank, static_cast<int>(precision), gas, stage, offload, mics,
                         run.ok() ? "masters differ from the in-process stage-0 reference"
                                  : run.status().ToString().c_str());
          }
        }
      }
    }
  }
  std::printf("rank %d of %d: %d of %d stage/precision/accumulation runs bit-identical\n", rank,
              world, checks - failures, checks);
  // zerort.ranks_per_node unset: the engine over MPI takes mpirun's ranks on this node (every
  // process of this test runs on one host, so all of them, in one consecutive block).
  {
    const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    const int want = local != nullptr ? std::atoi(local) : 0;
    auto e = Engine::Create(testing::TestConfig(3, DType::kBF16, 1, 0, false), specs, mpi,
                            device.get());
    const int got = e.ok() ? (*e)->plan().options.ranks_per_node : -1;
    if (got != want) {
      ++failures;
      std::fprintf(stderr, "rank %d: FAILED ranks_per_node %d from the launcher, want %d (%s)\n",
                   rank, got, want,
                   e.ok() ? "OMPI_COMM_WORLD_LOCAL_SIZE" : e.status().ToString().c_str());
    }
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace zerort

int main(int argc, char** argv) {
  return zerort::comm::testing::MpiTestMain(argc, argv, zerort::Main);
}
