// The GPT's stage equivalence across processes: runs under mpirun (gpt_mpi_test.sh). Every rank
// trains the example GPT with stages 0-3 (with and without optimizer offload) over the MPI
// communicator, one process per rank as a real job runs, and checks that each run ends with the
// same held-out loss and the same fp32 master weights, bit for bit, as stage 0 trained on an
// in-process group of the same world size inside this process (threads).
#include <cstdio>
#include <string>
#include <vector>

#include "comm/testing/mpi_main.h"
#include "examples/gpt/gpt.h"
#include "zero/config.h"

namespace zerort {
namespace examples {
namespace gpt {
namespace {

// Several heads, layers and units, small enough to run 14 trainings per rank in seconds.
RunOptions Options(int world) {
  RunOptions o;
  o.world_size = world;
  o.steps = 6;
  o.batch = 2;
  o.shape.context = 16;
  o.shape.layers = 2;
  o.shape.heads = 2;
  o.shape.d_model = 32;
  o.threads = 1;
  o.device_threads = 1;
  o.eval_every = 3;
  o.eval_windows = 8;
  o.gather_master = true;
  return o;
}

Config TrainConfig(int stage, bool offload, DType precision) {
  Config c;
  c.zero.stage = stage;
  c.compute_dtype = precision;
  c.zero.reduce_bucket_size = 3000;  // several units: blocks split, small modules merged
  c.zero.stage3_param_persistence_threshold = 100;
  c.zero.stage3_prefetch_bucket_size = 60000;
  if (offload) c.zero.offload_optimizer.device = OffloadDevice::kCpu;
  c.optimizer.lr = 3e-3;
  c.gradient_clipping = 1.0;
  c.comm_timeout_ms = 120000;
  c.cpu_threads = 1;
  return c;
}

int Main(comm::Communicator* mpi) {
  const int rank = mpi->rank(), world = mpi->size();
  const RunOptions options = Options(world);
  int failures = 0, checks = 0;
  for (DType precision : {DType::kBF16, DType::kF32}) {
    absl::StatusOr<RunResult> ref = RunInProcess(TrainConfig(0, false, precision), options);
    if (!ref.ok()) {
      std::fprintf(stderr, "rank %d: in-process reference: %s\n", rank,
                   ref.status().ToString().c_str());
      return 1;
    }
    for (int stage = 0; stage <= 3; ++stage) {
      for (bool offload : {false, true}) {
        if (stage == 0 && offload) continue;
        absl::StatusOr<RunResult> run =
            RunOnCommunicator(TrainConfig(stage, offload, precision), options, mpi);
        ++checks;
        std::string why;
        if (!run.ok()) {
          why = run.status().ToString();
        } else if (run->master[0] != ref->master[0]) {
          why = "master weights differ from the in-process stage-0 reference";
        } else if (run->final_val_loss != ref->final_val_loss) {
          why = "held-out loss differs from the in-process stage-0 reference";
        } else if (run->steps.back().loss != ref->steps.back().loss) {
          why = "training loss differs from the in-process stage-0 reference";
        }
        if (!why.empty()) {
          ++failures;
          std::fprintf(stderr, "rank %d: FAILED %s stage %d offload %d: %s\n", rank,
                       std::string(DTypeName(precision)).c_str(), stage, offload, why.c_str());
        }
      }
    }
    if (rank == 0) {
      std::printf("%s: held-out loss %.6f -> %.6f\n", std::string(DTypeName(precision)).c_str(),
                  ref->initial_val_loss, ref->final_val_loss);
    }
  }
  std::printf("rank %d of %d: %d of %d GPT stage/offload/precision runs bit-identical\n", rank,
              world, checks - failures, checks);
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace gpt
}  // namespace examples
}  // namespace zerort

int main(int argc, char** argv) {
  return zerort::comm::testing::MpiTestMain(argc, argv, zerort::examples::gpt::Main);
}
