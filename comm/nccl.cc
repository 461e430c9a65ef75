#include "comm/nccl.h"

#include <cuda_runtime.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/cuda_status.h"
#include "base/status.h"
#include "comm/internal/common.h"

namespace zerort {
namespace comm {
namespace {

using internal::OpDesc;
using internal::OpKind;

ncclDataType_t NcclType(DType t) {
  switch (t) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kF16:
      return ncclFloat16;
  }
  return ncclFloat32;
}

ncclRedOp_t NcclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kAvg:
      return ncclAvg;
    case ReduceOp::kMax:
      return ncclMax;
  }
  return ncclSum;
}

absl::Status NcclError(ncclResult_t r, absl::string_view what, int rank) {
  return absl::Status(NcclErrorCode(r), absl::StrCat(what, " failed on rank ", rank, ": ",
                                                     ncclGetErrorString(r), " (",
                                                     ncclGetLastError(nullptr), ")"));
}

// Polls a non-blocking communicator until its pending call (init or enqueue) settles.
absl::Status AwaitComm(ncclComm_t comm, absl::Time deadline, absl::string_view what, int rank) {
  for (int spin = 0;; ++spin) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &state);
    if (r != ncclSuccess) return NcclError(r, "ncclCommGetAsyncError", rank);
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) return NcclError(state, what, rank);
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(what, " on rank ", rank, " did not complete before the deadline"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(spin < 1000 ? 10 : 500));
  }
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, bool owned, int rank, int size, int device,
                   const CommOptions& options)
      : comm_(comm),
        owned_(owned),
        rank_(rank),
        size_(size),
        device_(device),
        options_(options),
        history_(options.history) {}

  ~NcclCommunicator() override {
    if (barrier_buf_ != nullptr) cudaFree(barrier_buf_);
    if (barrier_stream_ != nullptr) cudaStreamDestroy(barrier_stream_);
    if (!owned_ || aborted_) return;
    if (!poison_.ok()) {
      ncclCommAbort(comm_);
    } else {
      ncclCommDestroy(comm_);
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::string_view backend() const override { return "nccl"; }
  bool device_memory() const override { return true; }
  bool stream_ordered() const override { return true; }

  absl::Status AllGather(const void* send, void* recv, size_t count, DType dtype,
                         Stream stream) override {
    OpDesc d = Desc(OpKind::kAllGather, count, dtype, ReduceOp::kSum, 0);
    RETURN_IF_ERROR(Start(d, send, recv));
    return Enqueue(d, "ncclAllGather",
                   ncclAllGather(send, recv, count, NcclType(dtype), comm_, AsStream(stream)));
  }

  absl::Status ReduceScatter(const void* send, void* recv, size_t count, DType dtype,
                             ReduceOp op, Stream stream) override {
    OpDesc d = Desc(OpKind::kReduceScatter, count, dtype, op, 0);
    RETURN_IF_ERROR(Start(d, send, recv));
    return Enqueue(d, "ncclReduceScatter",
                   ncclReduceScatter(send, recv, count, NcclType(dtype), NcclOp(op), comm_,
                                     AsStream(stream)));
  }

  absl::Status AllReduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                         Stream stream) override {
    OpDesc d = Desc(OpKind::kAllReduce, count, dtype, op, 0);
    RETURN_IF_ERROR(Start(d, send, recv));
    return Enqueue(d, "ncclAllReduce",
                   ncclAllReduce(send, recv, count, NcclType(dtype), NcclOp(op), comm_,
                                 AsStream(stream)));
  }

  // A reduce-scatter within the group, then an all-reduce of the result across the groups'
  // same-position ranks, both enqueued on `stream`, on two sub-communicators split off at the
  // first call with this group size (a collective every rank makes at the same point of its
  // sequence, since every rank calls this operation alike). NCCL rounds each partial to the
  // dtype and picks its own summation order, so unlike the CPU backends this is not bitwise
  // equal to the flat reduction (communicator.h); kAvg divides by the group size, then by the
  // number of groups. A failure of either sub-communicator surfaces in its own calls here.
  absl::Status ReduceScatterInGroups(const void* send, void* recv, size_t count, DType dtype,
                                     ReduceOp op, int group_size, Stream stream) override {
    OpDesc d = Desc(OpKind::kReduceScatterInGroups, count, dtype, op, group_size);
    RETURN_IF_ERROR(Start(d, send, recv));  // validates group_size
    history_.End();
    if (group_size == size_) return ReduceScatter(send, recv, count, dtype, op, stream);
    if (grouped_size_ != group_size) {
      group_comm_.reset();
      replica_comm_.reset();
      grouped_size_ = 0;
      // Key = rank: a group's ranks keep this communicator's order, so the group rank is the
      // position rank % group_size and the in-place layout carries over.
      ASSIGN_OR_RETURN(group_comm_, Split(rank_ / group_size, rank_));
      ASSIGN_OR_RETURN(replica_comm_, Split(rank_ % group_size, rank_));
      grouped_size_ = group_size;
    }
    RETURN_IF_ERROR(group_comm_->ReduceScatter(send, recv, count, dtype, op, stream));
    return replica_comm_->AllReduce(recv, recv, count, dtype, op, stream);
  }

  absl::Status Broadcast(void* buf, size_t count, DType dtype, int root, Stream stream) override {
    OpDesc d = Desc(OpKind::kBroadcast, count, dtype, ReduceOp::kSum, root);
    if (root < 0 || root >= size_) {
      return absl::InvalidArgumentError(absl::StrCat("rank ", rank_, ": broadcast root ", root,
                                                     " is outside the group of ", size_));
    }
    RETURN_IF_ERROR(Start(d, buf, nullptr));
    return Enqueue(d, "ncclBroadcast",
                   ncclBroadcast(buf, buf, count, NcclType(dtype), root, comm_, AsStream(stream)));
  }

  absl::Status Barrier() override {
    // NCCL has no barrier: a one-element all-reduce on a private stream, waited for.
    if (barrier_stream_ == nullptr) {
      RETURN_IF_CUDA_ERROR(cudaSetDevice(device_), "for the barrier on rank ", rank_);
      RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&barrier_stream_, cudaStreamNonBlocking),
                           "barrier stream on rank ", rank_);
      RETURN_IF_CUDA_ERROR(cudaMalloc(&barrier_buf_, sizeof(float)), "barrier buffer on rank ",
                           rank_);
    }
    OpDesc d = Desc(OpKind::kBarrier, 0, DType::kF32, ReduceOp::kSum, 0);
    RETURN_IF_ERROR(Start(d, nullptr, nullptr));
    RETURN_IF_ERROR(Enqueue(d, "ncclAllReduce(barrier)",
                            ncclAllReduce(barrier_buf_, barrier_buf_, 1, ncclFloat32, ncclSum,
                                          comm_, barrier_stream_)));
    return Synchronize(barrier_stream_);
  }

  absl::Status Synchronize(Stream stream) override {
    if (!poison_.ok()) return Poisoned("synchronize");
    const absl::Time deadline = absl::Now() + absl::Milliseconds(options_.timeout_ms);
    for (int spin = 0;; ++spin) {
      const cudaError_t q = cudaStreamQuery(AsStream(stream));
      ncclResult_t async = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(comm_, &async);
      if (r != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
        return Fail(NcclError(r != ncclSuccess ? r : async, "NCCL (asynchronous error)", rank_));
      }
      if (q == cudaSuccess) return absl::OkStatus();
      if (q != cudaErrorNotReady) {
        return Fail(absl::Status(CudaErrorCode(q),
                                 absl::StrCat("cudaStreamQuery on rank ", rank_, ": ",
                                              cudaGetErrorString(q))));
      }
      if (absl::Now() > deadline) {
        return Fail(absl::DeadlineExceededError(absl::StrCat(
            "NCCL rank ", rank_, " of ", size_, ": stream did not drain within ",
            options_.timeout_ms, " ms (a peer is missing, dead or calling a different "
            "operation)\nrank ", rank_, " ", history_.Format())));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(spin < 1000 ? 5 : 200));
    }
  }

  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override {
    OpDesc d = Desc(OpKind::kSplit, 0, DType::kF32, ReduceOp::kSum, 0);
    RETURN_IF_ERROR(Start(d, nullptr, nullptr));
    history_.End();
    ASSIGN_OR_RETURN(ncclComm_t sub, SplitComm(color, key));
    if (sub == nullptr) return std::unique_ptr<Communicator>();  // NCCL_SPLIT_NOCOLOR
    int rank = 0, size = 0;
    ncclResult_t r = ncclCommUserRank(sub, &rank);
    if (r == ncclSuccess) r = ncclCommCount(sub, &size);
    if (r != ncclSuccess) {
      ncclCommAbort(sub);
      return NcclError(r, "ncclCommUserRank/ncclCommCount(split)", rank_);
    }
    return std::unique_ptr<Communicator>(
        new NcclCommunicator(sub, /*owned=*/true, rank, size, device_, options_));
  }

 private:
  // ncclCommSplit, non-blocking and polled (parent and child) against the timeout: a rank that
  // never calls leaves the others DeadlineExceeded, not hung. A wrapped external communicator
  // made blocking by its owner makes the call block instead. Null for a negative color.
  absl::StatusOr<ncclComm_t> SplitComm(int color, int key) {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
    int version = 0;
    RETURN_IF_NCCL_ERROR(ncclGetVersion(&version), "on rank ", rank_);
    if (version < NCCL_VERSION(2, 18, 0)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "Split on NCCL rank ", rank_, ": ncclCommSplit needs NCCL >= 2.18.0; the loaded NCCL "
          "is version code ", version));
    }
    RETURN_IF_CUDA_ERROR(cudaSetDevice(device_), "for ncclCommSplit on rank ", rank_);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t sub = nullptr;
    const std::string what = absl::StrCat("ncclCommSplit(color=", color, ", key=", key, ")");
    const ncclResult_t r =
        ncclCommSplit(comm_, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &sub, &config);
    absl::Status s = r == ncclSuccess || r == ncclInProgress ? absl::OkStatus()
                                                             : NcclError(r, what, rank_);
    const absl::Time deadline = absl::Now() + absl::Milliseconds(options_.timeout_ms);
    if (s.ok()) s = AwaitComm(comm_, deadline, what, rank_);
    if (s.ok() && sub != nullptr) s = AwaitComm(sub, deadline, what, rank_);
    if (!s.ok()) {
      if (sub != nullptr) ncclCommAbort(sub);
      return Fail(s);
    }
    return sub;
#else
    return absl::UnimplementedError(absl::StrCat(
        "Split(color=", color, ", key=", key, ") on NCCL rank ", rank_,
        ": ncclCommSplit needs NCCL >= 2.18.0; this build's nccl.h is version code ",
        NCCL_VERSION_CODE));
#endif
  }

  static cudaStream_t AsStream(Stream s) { return static_cast<cudaStream_t>(s); }

  OpDesc Desc(OpKind kind, size_t count, DType dtype, ReduceOp op, int root) {
    return internal::MakeOpDesc(++seq_, kind, count, dtype, op, root);
  }

  absl::Status Poisoned(absl::string_view what) const {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank_, ": ", what, ": the NCCL communicator failed earlier: ",
        poison_.message()));
  }

  absl::Status Start(const OpDesc& d, const void* send, const void* recv) {
    if (!poison_.ok()) return Poisoned(internal::DescribeOp(d));
    RETURN_IF_ERROR(internal::ValidateBuffers(d, send, recv, rank_, size_));
    history_.Begin(d, d.count * DTypeSize(static_cast<DType>(d.dtype)));
    return absl::OkStatus();
  }

  // History records the enqueue, not the completion (which happens later on the stream).
  absl::Status Enqueue(const OpDesc& d, absl::string_view call, ncclResult_t r) {
    history_.End();
    if (r == ncclInProgress) {
      return Fail(AwaitComm(comm_, absl::Now() + absl::Milliseconds(options_.timeout_ms),
                            absl::StrCat(call, " for ", internal::DescribeOp(d)), rank_));
    }
    if (r != ncclSuccess) {
      return Fail(NcclError(r, absl::StrCat(call, " for ", internal::DescribeOp(d)), rank_));
    }
    return absl::OkStatus();
  }

  // Poisons, and aborts a communicator we own, on any failure: a failed or stuck NCCL
  // communicator cannot be trusted for the next collective.
  absl::Status Fail(absl::Status s) {
    if (s.ok()) return s;
    poison_ = s;
    if (owned_ && !aborted_) {
      ncclCommAbort(comm_);
      aborted_ = true;
    }
    return s;
  }

  ncclComm_t comm_;
  const bool owned_;
  const int rank_;
  const int size_;
  const int device_;
  const CommOptions options_;
  internal::OpHistory history_;
  absl::Status poison_;
  // ReduceScatterInGroups: its sub-communicators for groups of grouped_size_ (0: none yet).
  int grouped_size_ = 0;
  std::unique_ptr<Communicator> group_comm_, replica_comm_;
  bool aborted_ = false;
  int64_t seq_ = 0;
  cudaStream_t barrier_stream_ = nullptr;
  float* barrier_buf_ = nullptr;  // (1) fp32 on device_, contents irrelevant
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(ncclComm_t external,
                                                                     CommOptions options) {
  if (external == nullptr) {
    return absl::InvalidArgumentError("CreateNcclCommunicator: external ncclComm_t is null");
  }
  if (options.timeout_ms <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("comm_timeout_ms must be > 0, got ", options.timeout_ms));
  }
  int rank = 0, size = 0, device = 0;
  RETURN_IF_NCCL_ERROR(ncclCommUserRank(external, &rank));
  RETURN_IF_NCCL_ERROR(ncclCommCount(external, &size));
  RETURN_IF_NCCL_ERROR(ncclCommCuDevice(external, &device), "rank ", rank);
  return std::unique_ptr<Communicator>(
      new NcclCommunicator(external, /*owned=*/false, rank, size, device, options));
}

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicator(const ncclUniqueId& id,
                                                                     int rank, int world_size,
                                                                     int device,
                                                                     CommOptions options) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat("CreateNcclCommunicator: rank ", rank,
                                                   " outside world_size ", world_size));
  }
  if (options.timeout_ms <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("comm_timeout_ms must be > 0, got ", options.timeout_ms));
  }
  RETURN_IF_CUDA_ERROR(cudaSetDevice(device), "device ", device, " for NCCL rank ", rank);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // so that a peer that never joins cannot hang us in init
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&comm, world_size, id, rank, &config);
  if (r != ncclSuccess && r != ncclInProgress) {
    if (comm != nullptr) ncclCommAbort(comm);
    return NcclError(r, "ncclCommInitRankConfig", rank);
  }
  absl::Status s = AwaitComm(comm, absl::Now() + absl::Milliseconds(options.timeout_ms),
                             absl::StrCat("ncclCommInitRankConfig (world ", world_size, ")"), rank);
  if (!s.ok()) {
    ncclCommAbort(comm);
    return s;
  }
  return std::unique_ptr<Communicator>(
      new NcclCommunicator(comm, /*owned=*/true, rank, world_size, device, options));
}

absl::StatusOr<std::unique_ptr<Communicator>> CreateNcclCommunicatorFromLaunch(
    const LaunchInfo& info, CommOptions options, RendezvousOptions rendezvous) {
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  if (info.rank == 0) RETURN_IF_NCCL_ERROR(ncclGetUniqueId(&id), "on rank 0");
  const std::string mine(reinterpret_cast<const char*>(&id), sizeof id);
  ASSIGN_OR_RETURN(std::string shared, Rendezvous(info, mine, rendezvous));
  if (shared.size() != sizeof id) {
    return absl::DataLossError(absl::StrCat("rendezvous delivered ", shared.size(),
                                            " bytes, expected an ncclUniqueId of ", sizeof id));
  }
  std::memcpy(&id, shared.data(), sizeof id);
  return CreateNcclCommunicator(id, info.rank, info.world_size, info.device, options);
}

}  // namespace comm
}  // namespace zerort
