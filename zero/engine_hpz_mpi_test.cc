// hpZ and MiCS's hierarchical gather across processes: runs under mpirun -np 4
// (engine_hpz_mpi_test.sh). Every rank trains the synthetic model over the MPI communicator
// with zero_hpz_partition_size 2 (2 "nodes" of 2 ranks), and with mics_shard_size 4 gathered
// hierarchically over zerort.ranks_per_node 2, and checks that the fp32 masters equal, bit for
// bit, flat stage 3 run on an in-process group of the same world size inside this process.
#include <cstdio>
#include <string>
#include <vector>

#include "base/testing/bit_equal.h"
#include "comm/testing/mpi_main.h"
#include "device/testing/one_thread.h"
#include "zero/testing/synthetic_trainer.h"

namespace zerort {
namespace {

int Main(comm::Communicator* mpi) {
  const int rank = mpi->rank(), world = mpi->size();
  if (world % 4 != 0) {
    std::fprintf(stderr, "rank %d: needs a world of 4 (got %d)\n", rank, world);
    return 1;
  }
  auto device = testing::OneThreadCpuDevice();
  const auto specs = testing::SmallModel();
  const int steps = 8;
  int failures = 0, checks = 0;
  for (bool offload : {false, true}) {
    for (int gas : {1, 2}) {
      const Config flat = testing::TestConfig(3, DType::kBF16, gas, 0.05, offload);
      auto ref_runs = testing::TrainRanks(flat, specs, world, device.get(), steps);
      const std::vector<float> ref =
          ref_runs.ok() ? std::move((*ref_runs)[0].master) : std::vector<float>();
      for (const char* variant : {"hpz 2", "mics 4 hierarchical over 2 per node"}) {
        Config config = flat;
        if (variant[0] == 'h') {
          config.zero.zero_hpz_partition_size = 2;
        } else {
          config.zero.mics_shard_size = 4;
          config.zero.mics_hierarchical_params_gather = true;
          config.ranks_per_node = 2;
        }
        auto run = testing::TrainRank(config, specs, mpi, device.get(), steps);
        ++checks;
        const bool same = run.ok() && !ref.empty() && testing::BitEqual(run->master, ref);
        if (!same) {
          ++failures;
          std::fprintf(stderr, "rank %d: FAILED %s offload=%d gas=%d: %s\n", rank, variant,
                       offload, gas,
                       run.ok() ? "masters differ from in-process flat stage 3"
                                : run.status().ToString().c_str());
        }
      }
    }
  }
  std::printf("rank %d of %d: %d of %d hpZ / hierarchical-gather runs bit-identical to flat\n",
              rank, world, checks - failures, checks);
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace zerort

int main(int argc, char** argv) {
  return zerort::comm::testing::MpiTestMain(argc, argv, zerort::Main);
}
