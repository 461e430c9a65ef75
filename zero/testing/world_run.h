// The harness of the engine tests that train the synthetic model on several in-process ranks
// and compare runs bit for bit: one thread a rank over a shared CPU device, each rank's
// TrainResult or error kept in rank order, and the engine-level comparisons those tests share.
//
//   WorldOptions o;
//   o.async_streams = o.rank_streams = true;  // every copy races what follows it
//   const WorldRun run = TrainWorld(config, SmallModel(), /*world=*/4, /*steps=*/6, o);
//   RequireOk(run);
//   CHECK(BitEqual(run.ranks[1].master, run.ranks[0].master));
//
// Thread safety: RunWorld's body runs on `world` threads at once.
#ifndef ZERORT_ZERO_TESTING_WORLD_RUN_H_
#define ZERORT_ZERO_TESTING_WORLD_RUN_H_

#include <atomic>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/testing/checks.h"
#include "comm/communicator.h"
#include "device/device.h"
#include "memory/plan.h"
#include "zero/config.h"
#include "zero/engine.h"
#include "zero/testing/synthetic_trainer.h"

namespace zerort {
namespace testing {

struct WorldRun {
  std::vector<TrainResult> ranks;    // per rank; default-constructed where the rank failed
  std::vector<absl::Status> errors;  // per rank
};

// How the ranks of a RunWorld share a device and a group.
struct WorldOptions {
  // The group's CommOptions::timeout_ms.
  int64_t timeout_ms = 20000;
  // The shared one-thread CPU device runs its streams on threads, each operation 200 us late
  // (longer than any of the synthetic model's host AdamW calls), as a GPU would.
  bool async_streams = false;
  // Each rank's body gets a stream of its own (else nullptr, the default compute stream).
  bool rank_streams = false;
  // The stream-ordered test group (comm/testing/stream_ordered.h: the engine's NCCL-shaped
  // path) instead of the in-process group.
  bool stream_ordered = false;
};

// async_streams, rank_streams and stream_ordered: the engine's NCCL-shaped path with every
// stream running late, so that a missing event wait gives a wrong result, not a rare one.
WorldOptions StreamOrderedWorld();

// What one rank runs: its rank, its communicator, the shared device and its stream.
using RankBody = std::function<absl::StatusOr<TrainResult>(int rank, comm::Communicator* comm,
                                                           Device* device, Device::Stream stream)>;

// Runs `body` on `world` ranks, one thread each. A group that cannot be created is every
// rank's error.
WorldRun RunWorld(int world, const WorldOptions& options, const RankBody& body);

// TrainRank (InitValue parameters, `steps` optimizer steps, the overflow injection) on every
// rank; options.timeout_ms is config.comm_timeout_ms.
WorldRun TrainWorld(const Config& config, const std::vector<memory::ParamSpec>& specs, int world,
                    int steps, WorldOptions options = {}, int inject_step = -1,
                    int inject_rank = -1);

// Every rank succeeded (Catch2 REQUIRE, naming a failed rank and its error).
void RequireOk(const WorldRun& run);
// Every status is OK (Catch2 CHECK per rank, naming the rank).
void CheckAllOk(const std::vector<absl::Status>& errors);


// An engine on SmallModel() with InitValue parameters, trained `steps` optimizer steps.
absl::StatusOr<std::unique_ptr<Engine>> TrainedEngine(const Config& config,
                                                      comm::Communicator* comm, Device* device,
                                                      int steps);

// This rank's owned master, m, v through BeginSnapshot (the checkpoint's layout).
absl::Status SnapshotOf(Engine& e, std::vector<float> out[3]);

// Internal errors naming `what` (and the array: 0 master, 1 m, 2 v) where the two engines'
// owned snapshots, or their gathered fp32 masters, differ in any bit.
absl::Status SameSnapshots(Engine& a, Engine& b, const char* what);
absl::Status SameMasters(Engine& a, Engine& b, const char* what);

// For as long as it lives, NVMe writes of the two ranks of a world-2 run can be made to fail
// (nvme::SetIoFaultForTesting; rank 1's are those on its "-rank1/" files): after Arm(rank, n),
// that rank's n-th write from then on completes with EIO. Construct it before the engines.
// Thread-safe.
class NvmeWriteFault {
 public:
  NvmeWriteFault();
  ~NvmeWriteFault();
  NvmeWriteFault(const NvmeWriteFault&) = delete;
  NvmeWriteFault& operator=(const NvmeWriteFault&) = delete;

  // REQUIRES: rank is 0 or 1, writes >= 0 (0 disarms).
  void Arm(int rank, int writes) { armed_[rank] = writes; }

 private:
  std::atomic<int> armed_[2] = {{0}, {0}};  // writes left before the failing one, + 1
};

// One rank's check that a failed NVMe write undoes its step (world 2): engines `a` (config
// `reference`) and `b` (`faulty`, state in NVMe swap files) train 2 steps; b's third step then
// fails at its second state write. OK when the failure is an EIO naming the swap file and
// offset, b's step count, owned state (BeginSnapshot) and masters are those before the step,
// `also(a, b)` holds (when given), and after the retried step and one more b's masters equal
// a's; else an Internal error saying which check failed.
absl::Status CheckWriteFaultUndone(
    const Config& reference, const Config& faulty, comm::Communicator* comm, Device* device,
    NvmeWriteFault* fault, const std::function<absl::Status(Engine& a, Engine& b)>& also = {});

}  // namespace testing
}  // namespace zerort

#endif  // ZERORT_ZERO_TESTING_WORLD_RUN_H_
