// A stream-ordered in-process group for tests: N ranks as N threads, like comm/inprocess.h's
// group, except that every operation is only ENQUEUED on the stream it is given (a stream of
// the CPU device, device/cpu_device.h, or of one GPU that every rank shares) and completes in
// stream order, as NCCL's do (NCCL refuses two ranks on one GPU; this group is how the engine's
// NCCL-shaped path runs with world > 1 on one GPU). Code that treats a communicator as NCCL does (no host wait before a collective,
// results read only after the stream is synchronized or joined through an event) is thereby
// exercised without a GPU; with AsyncOneThreadCpuDevice's delayed streams, a missing event
// wait or a host read before the stream sync gives a wrong result, not a rare one.
//
//   auto device = testing::AsyncOneThreadCpuDevice(2000);
//   ASSIGN_OR_RETURN(auto comms, comm::testing::CreateStreamOrderedGroup(2, device.get()));
//   // on rank r's thread, `s` a stream of `device`:
//   RETURN_IF_ERROR(comms[r]->AllGather(send, recv, n, DType::kF32, s));  // enqueued
//   RETURN_IF_ERROR(comms[r]->Synchronize(s));                          // now recv holds it
//
// stream_ordered() is true and device_memory() is the device's, so that Engine::Create pairs
// them; comm::DirectHostExchange refuses it as it refuses NCCL.
//
// How (the Device API has no host callback, so nothing but device operations and events can
// run on a stream): at the call, each rank records an event `ready` on its stream and the
// ranks exchange their buffer pointers through an inner in-process group (a host rendezvous of
// the calls, with CommOptions::timeout_ms; no rank waits for any stream there). Each rank's
// stream then waits for every peer's `ready` and moves the data with Device::Copy (and, for
// reductions, Device::Cast, Accumulate and AdamWRanges, below) reading the peers' buffers
// directly; finally it records `done`, the ranks meet again on the host, and every stream waits
// for every peer's `done`, so no rank's stream writes a buffer a peer may still read. An
// all-reduce meets once more between its reads and its writes (it may run in place). The
// operations of one communicator run in issue order, whatever streams they are given.
//
// Reductions follow communicator.h's order exactly: element i is float(x_0[i]), then
// + float(x_r[i]) for r = 1..N-1 in fp32 (Device::Cast to fp32, Device::Accumulate on fp32),
// then one rounding to the dtype (Device::Cast). kAvg multiplies by 1/N through
// Device::AdamWRanges's `grad_scale` with beta1 = 0 (so m = fma(0, -0, 1 * (g * 1/N)) =
// g * 1/N exactly): equal to the contract's division by N only when N is a power of two, so
// kAvg on other world sizes is InvalidArgument. kMax has no device kernel: Unimplemented.
// Unlike the CPU backends, a NaN result keeps whatever payload the additions produced (not
// the canonical quiet NaN).
//
// Split splits the inner group and gives each new group events of its own: a host-side
// collective (like ncclCommSplit) that waits for no stream.
//
// Thread safety: as comm/inprocess.h (one thread per rank). REQUIRES: every stream given to an
// operation is a stream of `device` (or nullptr: the calling thread); every stream that an
// operation was enqueued on is synchronized before the last communicator of the group is
// destroyed (the events live with the group), as NCCL requires before ncclCommDestroy.
// A rank whose stream never reaches its collective leaves its peers' streams waiting, as NCCL
// does; only the host rendezvous has a deadline.
#ifndef ZERORT_COMM_TESTING_STREAM_ORDERED_H_
#define ZERORT_COMM_TESTING_STREAM_ORDERED_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "comm/communicator.h"
#include "device/device.h"

namespace zerort {
namespace comm {
namespace testing {

// `device` must outlive the group; every rank's buffers must be that device's memory (on a GPU:
// one GPU for all ranks, whose streams read each other's buffers directly). InvalidArgument for a
// null device, world_size < 1 or an invalid `options`.
absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateStreamOrderedGroup(
    int world_size, Device* device, CommOptions options = {});

}  // namespace testing
}  // namespace comm
}  // namespace zerort

#endif  // ZERORT_COMM_TESTING_STREAM_ORDERED_H_
