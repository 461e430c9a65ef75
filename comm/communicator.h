// Communicator: the collective operations the engine needs, over equal-sized blocks of typed
// elements, independent of the transport (in-process threads, MPI processes, NCCL on GPUs).
//
//   ASSIGN_OR_RETURN(auto comms, comm::CreateInProcessGroup(4));
//   // on rank r's thread:
//   RETURN_IF_ERROR(comms[r]->ReduceScatter(grads, shard, shard_count, DType::kBF16,
//                                           comm::ReduceOp::kAvg));
//
// Buffers: `count` is always in elements of `dtype` (half types are raw uint16_t bits).
// AllGather's recv and ReduceScatter's send hold size()*count elements; block r is at offset
// r*count. Every rank must call the same operations in the same order with the same count,
// dtype, op and root (checked when CommOptions::check_args is set).
//
// Completion: on CPU backends ("inprocess", "mpi") an operation is complete when it returns and
// the stream argument is ignored (may be nullptr). On "nccl" the operation is only enqueued on
// the cudaStream_t passed as `stream`; buffers may be reused after Synchronize(stream) or after
// later work on that stream.
//
// Copies: AllGather and Broadcast move every element's bits unchanged on every backend (MPI
// sends the 16-bit types as MPI_UINT16_T; NCCL and the in-process group copy bytes), so raw
// 16-bit words, such as integers and byte strings, may travel as kBF16 elements (comm/agree.h
// does). Only the reductions interpret elements as numbers.
//
// Determinism (CPU backends): element i of every reduction is computed in fp32 in rank order,
//   acc = float(x_0[i]); for r in 1..N-1: acc = op(acc, float(x_r[i])); if kAvg: acc /= N;
// then rounded once to `dtype`. So AllReduce equals ReduceScatter + AllGather bit for bit, for any
// world size and count, run to run. kMax keeps acc when acc > x or acc is NaN, else takes x
// (so NaN propagates and ties take the later rank). Every NaN result is stored as the positive
// quiet NaN, so results never depend on which input's NaN payload an add propagated.
//
// Failure: an operation that does not complete within CommOptions::timeout_ms returns
// DeadlineExceeded naming the operation, its sequence number, count, dtype and rank (and, where
// the backend knows it, the missing ranks), followed by the communicator's recent operations.
// After a timeout or a lost peer the communicator is poisoned: later calls return
// FailedPrecondition naming the original failure instead of hanging.
//
// Thread safety: one Communicator object is used by one thread at a time (each rank of an
// in-process group has its own object and thread).
#ifndef ZERORT_COMM_COMMUNICATOR_H_
#define ZERORT_COMM_COMMUNICATOR_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/dtype.h"

namespace zerort {
namespace comm {

enum class ReduceOp { kSum, kAvg, kMax };

// "sum", "avg", "max".
absl::string_view ReduceOpName(ReduceOp op);

// Opaque stream handle: cudaStream_t for the NCCL backend, ignored (may be nullptr) on CPU
// backends, whose operations are complete when they return.
using Stream = void*;

struct CommOptions {
  // How long one collective may wait for its peers before failing with DeadlineExceeded.
  // Config key comm_timeout_ms. Must be > 0.
  int64_t timeout_ms = 600000;

  // How long creating a communicator may wait for every rank to join (MPI: the collective
  // MPI_Comm_idup in CreateMpiCommunicator) before failing with DeadlineExceeded naming the
  // rank and the call. Must be > 0. Default 2 minutes.
  int64_t setup_timeout_ms = 120000;

  // Verify that every rank called the same operation with the same count, dtype, op and root.
  // On by default in debug builds only. The MPI backend always verifies (one small exchange
  // per call), whatever this says: see comm/mpi.h.
#ifdef NDEBUG
  bool check_args = false;
#else
  bool check_args = true;
#endif

  // Number of recent operations kept per communicator and printed with timeout errors.
  size_t history = 16;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "inprocess", "mpi", "nccl".
  virtual absl::string_view backend() const = 0;
  // True when buffers must be device (GPU) memory: NCCL, or an in-process group built with GPU
  // buffer operations. The engine pairs such a communicator only with a GPU device.
  virtual bool device_memory() const { return false; }
  // True when operations are only enqueued on their stream (NCCL); false when they are
  // complete on return (in-process, MPI), whatever memory they move.
  virtual bool stream_ordered() const { return false; }

  // recv holds size()*count elements; rank r's send lands at recv + r*count.
  // In-place when send == recv + rank()*count.
  virtual absl::Status AllGather(const void* send, void* recv, size_t count, DType dtype,
                                 Stream stream = nullptr) = 0;

  // send holds size()*count elements, recv count: rank r receives the reduction of block r.
  // In-place when recv == send + rank()*count.
  virtual absl::Status ReduceScatter(const void* send, void* recv, size_t count, DType dtype,
                                     ReduceOp op, Stream stream = nullptr) = 0;

  // send and recv hold count elements; every rank receives the reduction. In-place when
  // send == recv.
  virtual absl::Status AllReduce(const void* send, void* recv, size_t count, DType dtype,
                                 ReduceOp op, Stream stream = nullptr) = 0;

  // root's buf (count elements) is copied into every other rank's buf.
  // REQUIRES: 0 <= root < size().
  virtual absl::Status Broadcast(void* buf, size_t count, DType dtype, int root,
                                 Stream stream = nullptr) = 0;

  // The gradient reduction of a hierarchical (HSDP / MiCS) layout. The ranks form groups of
  // `group_size` consecutive ranks (rank r sits at position r % group_size of group
  // r / group_size); send holds group_size*count elements, and every rank receives in recv
  // (count elements) the reduction over ALL size() ranks of block (rank % group_size) of their
  // sends. That is a reduce-scatter within each group followed by an all-reduce across the
  // groups' same-position ranks, except for the order: on the CPU backends element i is summed
  // in fp32 in global rank order and rounded once, exactly as ReduceScatter says above, so the
  // result equals block (rank % group_size) of a flat AllReduce of the whole send bit for bit
  // (a reduce-scatter in the group, rounded, then an all-reduce across groups would add in a
  // different order and round twice). The ranks of one position receive identical results.
  // On "nccl" it is ncclReduceScatter within the group then ncclAllReduce across groups: two
  // roundings, not bitwise equal to the flat reduction (see comm/nccl.h).
  // group_size == size() is ReduceScatter. In-place when recv == send + (rank % group_size)*count.
  // REQUIRES: group_size >= 1 divides size() (else InvalidArgument on every rank).
  // The default implementation serves group_size == size() only; others return Unimplemented
  // naming the backend.
  virtual absl::Status ReduceScatterInGroups(const void* send, void* recv, size_t count,
                                             DType dtype, ReduceOp op, int group_size,
                                             Stream stream = nullptr);

  // Returns once every rank has entered Barrier (on NCCL: once every rank's barrier completed).
  virtual absl::Status Barrier() = 0;

  // Waits until every operation enqueued on `stream` has completed (no-op on CPU backends).
  virtual absl::Status Synchronize(Stream stream) = 0;

  // Splits the ranks into disjoint sub-groups, as MPI_Comm_split does: the ranks that pass the
  // same color >= 0 form one new communicator, ranked by (key, rank here). A rank passing a
  // negative color (like MPI_UNDEFINED) joins none and gets OK with a null pointer.
  //
  //   // world 4 as 2 x 2: shard groups {0,1} {2,3}, replica groups {0,2} {1,3}.
  //   ASSIGN_OR_RETURN(auto shard, comm->Split(comm->rank() / 2, comm->rank()));
  //   ASSIGN_OR_RETURN(auto replica, comm->Split(comm->rank() % 2, comm->rank()));
  //
  // Collective over this communicator, in its operation order, with its timeout: a rank that
  // never calls Split makes the others fail with DeadlineExceeded naming the split and the
  // missing ranks. The new communicator has this one's backend and CommOptions, is
  // independent of it (either may be destroyed first; both may be used, one after the other,
  // from the rank's thread) and never exchanges data with other sub-groups.
  // Backends that cannot split return Unimplemented naming themselves.
  virtual absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key);
};

}  // namespace comm
}  // namespace zerort

#endif  // ZERORT_COMM_COMMUNICATOR_H_
