#include "comm/mpi.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "base/status.h"
#include "comm/internal/common.h"
#include "comm/internal/reduce.h"

namespace zerort {
namespace comm {

absl::Status MpiStatus(int code, absl::string_view call, int rank) {
  if (code == MPI_SUCCESS) return absl::OkStatus();
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) len = 0;
  int cls = MPI_ERR_UNKNOWN;
  MPI_Error_class(code, &cls);
  const std::string msg =
      absl::StrCat(call, " failed on rank ", rank, ": ", absl::string_view(text, len));
  switch (cls) {
    case MPI_ERR_ARG:
    case MPI_ERR_COUNT:
    case MPI_ERR_TYPE:
    case MPI_ERR_ROOT:
    case MPI_ERR_BUFFER:
    case MPI_ERR_COMM:
    case MPI_ERR_OP:
      return absl::InvalidArgumentError(msg);
    default:
      return absl::UnavailableError(msg);
  }
}

namespace {

using internal::OpDesc;
using internal::OpKind;

// What each rank contributes to the argument check.
struct CheckRecord {
  OpDesc desc;
  int32_t invalid = 0;  // local buffer validation failed on this rank
  int32_t pad = 0;
};

// Per-peer message size of the reduce-scatter exchange. Small enough that a step's received
// chunks ((size-1) of them) are still in cache when the kernel reads them, large enough that
// the per-message rendezvous cost stays small. With it, reduce-scatter at 2 ranks went from
// 0.22-0.24 to 0.37-0.44 of a single-thread memcpy (docs/comm.md); other sizes were not tried.
constexpr size_t kExchangeChunkBytes = size_t{1} << 20;

// Tag of the argument-check messages; the data messages use the OpKind (0..4).
constexpr int kCheckTag = 100;
// Tag of the notice a rank sends every peer when a collective's data phase times out on it.
constexpr int kStuckTag = 101;
// Tag of ReduceScatterInGroups's second phase (replicas swap their reduced slices), apart from
// its first phase's data tag so that the two can never match each other's messages.
constexpr int kReplicaTag = 102;
// The longest a timed-out rank waits to learn where its peers are (Survey).
constexpr int64_t kSurveyMaxMs = 5000;

MPI_Datatype MpiType(DType t) { return t == DType::kF32 ? MPI_FLOAT : MPI_UINT16_T; }

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, int rank, int size, const CommOptions& options)
      : comm_(comm), rank_(rank), size_(size), options_(options), history_(options.history) {}

  ~MpiCommunicator() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!poison_.ok()) {
      // A timed-out request may still write into (or read from) the scratch buffer and the
      // argument-check records: keep both forever.
      new std::vector<char>(std::move(scratch_));
      new std::vector<CheckRecord>(std::move(records_));
      return;
    }
    if (!finalized) MPI_Comm_free(&comm_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::string_view backend() const override { return "mpi"; }

  absl::Status AllGather(const void* send, void* recv, size_t count, DType dtype,
                         Stream) override {
    OpDesc d = Desc(OpKind::kAllGather, count, dtype, ReduceOp::kSum, 0);
    RETURN_IF_ERROR(Start(d, send, recv));
    const bool in_place =
        send == static_cast<char*>(recv) + static_cast<size_t>(rank_) * count * DTypeSize(dtype);
    // OpenMPI's own algorithm (chosen by size and world); point-to-point messages straight
    // into recv measured no better at 2 and 4 ranks on one node.
    MPI_Request req;
    const int n = static_cast<int>(count);
    const int rc = in_place ? MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv, n,
                                             MpiType(dtype), comm_, &req)
                            : MPI_Iallgather(send, n, MpiType(dtype), recv, n, MpiType(dtype),
                                             comm_, &req);
    RETURN_IF_ERROR(Check(rc, "MPI_Iallgather", d));
    RETURN_IF_ERROR(Wait(&req, "MPI_Iallgather", d));
    return Done();
  }

  absl::Status ReduceScatter(const void* send, void* recv, size_t count, DType dtype,
                             ReduceOp op, Stream) override {
    OpDesc d = Desc(OpKind::kReduceScatter, count, dtype, op, 0);
    RETURN_IF_ERROR(Start(d, send, recv));
    bounds_.resize(size_ + 1);
    for (int q = 0; q <= size_; ++q) bounds_[q] = static_cast<size_t>(q) * count;
    RangesFromBounds();
    RETURN_IF_ERROR(ExchangeReduce(send, recv, dtype, op, d));
    return Done();
  }

  absl::Status AllReduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                         Stream) override {
    // Reduce-scatter over balanced slices, then all-gather: elementwise the same reduction as
    // ReduceScatter, with each rank moving ~2x its data instead of N x.
    OpDesc d = Desc(OpKind::kAllReduce, count, dtype, op, 0);
    RETURN_IF_ERROR(Start(d, send, recv));
    const size_t es = DTypeSize(dtype);
    counts_.resize(size_);
    displs_.resize(size_);
    bounds_.resize(size_ + 1);
    for (int q = 0; q <= size_; ++q) bounds_[q] = SliceBegin(count, q);
    RangesFromBounds();
    for (int q = 0; q < size_; ++q) {
      counts_[q] = static_cast<int>(bounds_[q + 1] - bounds_[q]);
      displs_[q] = static_cast<int>(bounds_[q]);
    }
    // Slice `rank` of every rank's send, reduced into the same slice of recv. Peers only read
    // their own slice of our send, so this is safe when recv aliases send.
    RETURN_IF_ERROR(ExchangeReduce(send, static_cast<char*>(recv) + bounds_[rank_] * es, dtype,
                                   op, d));
    MPI_Request req;
    RETURN_IF_ERROR(Check(MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv,
                                          counts_.data(), displs_.data(), MpiType(dtype), comm_,
                                          &req),
                          "MPI_Iallgatherv", d));
    RETURN_IF_ERROR(Wait(&req, "MPI_Iallgatherv", d));
    return Done();
  }

  // Like AllReduce over the replicas of one position: the R = size / group_size ranks that
  // receive block b = rank % group_size split it into R slices, replica j receiving slice j of
  // block b from every rank and reducing it in rank order (ExchangeReduce, as ReduceScatter
  // does: the contract's order and one rounding), then the replicas swap their slices point to
  // point. Every rank sends each element of its send once, to the one rank that reduces it,
  // plus (R-1)/R of its result; in place, a slice is overwritten only after this rank has sent
  // it (ExchangeReduce waits for its sends) and is read by no one else.
  absl::Status ReduceScatterInGroups(const void* send, void* recv, size_t count, DType dtype,
                                     ReduceOp op, int group_size, Stream) override {
    OpDesc d = Desc(OpKind::kReduceScatterInGroups, count, dtype, op, group_size);
    RETURN_IF_ERROR(Start(d, send, recv));  // validates group_size on every rank
    const int g = group_size, replicas = size_ / g, pos = rank_ % g, j = rank_ / g;
    const size_t es = DTypeSize(dtype);
    auto slice = [&](int k) { return internal::SliceBegin(count, replicas, k); };
    begin_.resize(size_);
    end_.resize(size_);
    for (int q = 0; q < size_; ++q) {
      const size_t block = static_cast<size_t>(q % g) * count;
      begin_[q] = block + slice(q / g);
      end_[q] = block + slice(q / g + 1);
    }
    char* out = static_cast<char*>(recv);
    RETURN_IF_ERROR(ExchangeReduce(send, out + slice(j) * es, dtype, op, d));
    ClearRequests();
    for (int i = 1; i < replicas; ++i) {
      const int k = (j + i) % replicas, peer = k * g + pos;
      const size_t theirs = slice(k + 1) - slice(k), mine = slice(j + 1) - slice(j);
      if (theirs > 0) {
        const int bytes = static_cast<int>(theirs * es);
        RETURN_IF_ERROR(Check(MPI_Irecv(out + slice(k) * es, bytes, MPI_BYTE, peer, kReplicaTag,
                                        comm_, AddRequest(peer, bytes)),
                              "MPI_Irecv(replica slice)", d));
      }
      if (mine > 0) {
        RETURN_IF_ERROR(Check(MPI_Isend(out + slice(j) * es, static_cast<int>(mine * es),
                                        MPI_BYTE, peer, kReplicaTag, comm_, AddRequest(peer, -1)),
                              "MPI_Isend(replica slice)", d));
      }
    }
    RETURN_IF_ERROR(WaitAll("MPI_Isend/MPI_Irecv(replica slices)", d));
    return Done();
  }

  absl::Status Broadcast(void* buf, size_t count, DType dtype, int root, Stream) override {
    OpDesc d = Desc(OpKind::kBroadcast, count, dtype, ReduceOp::kSum, root);
    RETURN_IF_ERROR(Start(d, buf, nullptr));
    MPI_Request req;
    RETURN_IF_ERROR(Check(MPI_Ibcast(buf, static_cast<int>(count), MpiType(dtype), root, comm_,
                                     &req),
                          "MPI_Ibcast", d));
    RETURN_IF_ERROR(Wait(&req, "MPI_Ibcast", d));
    return Done();
  }

  absl::Status Barrier() override {
    OpDesc d = Desc(OpKind::kBarrier, 0, DType::kF32, ReduceOp::kSum, 0);
    RETURN_IF_ERROR(Start(d, nullptr, nullptr));
    MPI_Request req;
    RETURN_IF_ERROR(Check(MPI_Ibarrier(comm_, &req), "MPI_Ibarrier", d));
    RETURN_IF_ERROR(Wait(&req, "MPI_Ibarrier", d));
    return Done();
  }

  absl::Status Synchronize(Stream) override { return absl::OkStatus(); }

  // The argument check first: it is polled against the timeout and names the ranks that never
  // called. MPI_Comm_split itself blocks (MPI has no non-blocking split), but only after every
  // rank has been seen entering this same split, so it waits for nobody who is not coming.
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override {
    OpDesc d = Desc(OpKind::kSplit, 0, DType::kF32, ReduceOp::kSum, 0);
    RETURN_IF_ERROR(Start(d, nullptr, nullptr));
    MPI_Comm sub = MPI_COMM_NULL;
    RETURN_IF_ERROR(Check(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &sub),
                          absl::StrCat("MPI_Comm_split(color=", color, ", key=", key, ")"), d));
    RETURN_IF_ERROR(Done());
    if (sub == MPI_COMM_NULL) return std::unique_ptr<Communicator>();
    int rank = 0, size = 0;
    absl::Status s = MpiStatus(MPI_Comm_set_errhandler(sub, MPI_ERRORS_RETURN),
                               "MPI_Comm_set_errhandler(split)", rank_);
    if (s.ok()) s = MpiStatus(MPI_Comm_rank(sub, &rank), "MPI_Comm_rank(split)", rank_);
    if (s.ok()) s = MpiStatus(MPI_Comm_size(sub, &size), "MPI_Comm_size(split)", rank_);
    if (!s.ok()) {
      MPI_Comm_free(&sub);
      return s;
    }
    // The new communicator owns `sub` and frees it.
    return std::unique_ptr<Communicator>(new MpiCommunicator(sub, rank, size, options_));
  }

 private:
  size_t SliceBegin(size_t count, int r) const { return internal::SliceBegin(count, size_, r); }

  OpDesc Desc(OpKind kind, size_t count, DType dtype, ReduceOp op, int root) {
    return internal::MakeOpDesc(++seq_, kind, count, dtype, op, root);
  }

  // Rank q's range is bounds_[q]..bounds_[q+1]: consecutive blocks.
  void RangesFromBounds() {
    begin_.assign(bounds_.begin(), bounds_.end() - 1);
    end_.assign(bounds_.begin() + 1, bounds_.end());
  }

  // The reduce-scatter step shared by ReduceScatter, AllReduce and ReduceScatterInGroups.
  // [begin_[q], end_[q]) (element offsets) is rank q's range of every rank's send; rank q
  // receives the reduction of that range of every rank's send into dst. Our own block is read in place (no self copy); the peers'
  // blocks come by point-to-point messages in chunks of kExchangeChunkBytes, each reduced as
  // soon as it has arrived, so the received copy is read back from cache rather than memory.
  absl::Status ExchangeReduce(const void* send, void* dst, DType dtype, ReduceOp op,
                              const OpDesc& d) {
    const size_t es = DTypeSize(dtype);
    const size_t chunk = std::max<size_t>(1, kExchangeChunkBytes / es);
    auto chunks = [&](int q) { return (end_[q] - begin_[q] + chunk - 1) / chunk; };
    // Every rank computes the same number of steps, so every message is matched in its step.
    size_t steps = 0;
    for (int q = 0; q < size_; ++q) steps = std::max(steps, chunks(q));
    const size_t mine = end_[rank_] - begin_[rank_];
    const char* my_send = static_cast<const char*>(send);
    // (size, chunk) dtype: this step's chunk of our block from each peer (our own row unused).
    scratch_.resize(static_cast<size_t>(size_) * std::min(chunk, mine) * es);
    const int tag = static_cast<int>(d.kind);
    for (size_t j = 0; j < steps; ++j) {
      ClearRequests();
      const size_t begin = j * chunk;
      const size_t len = begin < mine ? std::min(chunk, mine - begin) : 0;
      for (int i = 1; i < size_; ++i) {
        const int q = (rank_ + i) % size_;
        if (len > 0) {
          const int bytes = static_cast<int>(len * es);
          RETURN_IF_ERROR(Check(MPI_Irecv(scratch_.data() + q * len * es, bytes, MPI_BYTE, q,
                                          tag, comm_, AddRequest(q, bytes)),
                                "MPI_Irecv", d));
        }
        const size_t qlen = end_[q] - begin_[q];
        if (begin < qlen) {
          RETURN_IF_ERROR(Check(
              MPI_Isend(my_send + (begin_[q] + begin) * es,
                        static_cast<int>(std::min(chunk, qlen - begin) * es), MPI_BYTE, q, tag,
                        comm_, AddRequest(q, -1)),
              "MPI_Isend", d));
        }
      }
      RETURN_IF_ERROR(WaitAll("MPI_Isend/MPI_Irecv", d));
      if (len == 0) continue;
      ptrs_.clear();
      for (int q = 0; q < size_; ++q) {
        ptrs_.push_back(q == rank_ ? my_send + (begin_[rank_] + begin) * es
                                   : scratch_.data() + q * len * es);
      }
      // Streaming stores as ReduceBlocks would choose them for the whole block, not the chunk.
      internal::ReduceBlocksWith(internal::ReduceBestPath(),
                                 mine * es >= internal::kStreamMinBytes, ptrs_.data(), size_,
                                 static_cast<char*>(dst) + begin * es, len, dtype, op);
    }
    return absl::OkStatus();
  }

  absl::Status Start(const OpDesc& d, const void* send, const void* recv) {
    if (!poison_.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", rank_, ": ", internal::DescribeOp(d),
                       ": the MPI communicator failed earlier: ", poison_.message()));
    }
    absl::Status valid = internal::ValidateBuffers(d, send, recv, rank_, size_);
    if (valid.ok() && d.kind == OpKind::kBroadcast && (d.root < 0 || d.root >= size_)) {
      valid = absl::InvalidArgumentError(absl::StrCat("rank ", rank_, ": ", internal::DescribeOp(d),
                                                      ": root is outside the group of ", size_));
    }
    if (valid.ok() && d.count > static_cast<uint64_t>(INT_MAX)) {
      valid = absl::InvalidArgumentError(
          absl::StrCat("rank ", rank_, ": ", internal::DescribeOp(d),
                       ": count exceeds INT_MAX elements, the MPI backend's limit"));
    }
    history_.Begin(d, d.count * DTypeSize(static_cast<DType>(d.dtype)));
    // One deadline for the whole operation, however many requests it takes.
    deadline_ = absl::Now() + absl::Milliseconds(options_.timeout_ms);
    // Always, whatever options_.check_args says: a mismatch on MPI would otherwise corrupt
    // data or diverge silently (a collective's received sizes cannot be checked), and the
    // exchange is what lets a timeout name the ranks that never arrived.
    RETURN_IF_ERROR(ExchangeRecords(d, valid.ok()));
    if (!valid.ok()) {
      history_.End();
      return valid;
    }
    for (int q = 0; q < size_; ++q) {
      if (records_[q].invalid) {
        history_.End();
        return absl::InvalidArgumentError(absl::StrCat(
            "rank ", rank_, ": ", internal::DescribeOp(d), ": rank ", q,
            " passed invalid buffers (see its own error)"));
      }
    }
    for (int q = 1; q < size_; ++q) {
      std::string diff = internal::CompareOps(records_[0].desc, 0, records_[q].desc, q, true);
      if (!diff.empty()) {
        history_.End();
        return absl::InvalidArgumentError(diff);
      }
    }
    return absl::OkStatus();
  }

  // Every rank sends its CheckRecord to every other rank, point to point (not an allgather),
  // so that when a rank never calls, the timeout can say which ranks' records are missing.
  absl::Status ExchangeRecords(const OpDesc& d, bool valid) {
    records_.assign(size_, CheckRecord());
    records_[rank_].desc = d;
    records_[rank_].invalid = valid ? 0 : 1;
    ClearRequests();
    for (int i = 1; i < size_; ++i) {
      const int q = (rank_ + i) % size_;
      RETURN_IF_ERROR(Check(MPI_Irecv(&records_[q], sizeof(CheckRecord), MPI_BYTE, q, kCheckTag,
                                      comm_, AddRequest(q, sizeof(CheckRecord))),
                            "MPI_Irecv(argument check)", d));
      RETURN_IF_ERROR(Check(MPI_Isend(&records_[rank_], sizeof(CheckRecord), MPI_BYTE, q,
                                      kCheckTag, comm_, AddRequest(q, -1)),
                            "MPI_Isend(argument check)", d));
    }
    return WaitAll("argument check", d);
  }

  absl::Status Done() {
    history_.End();
    return absl::OkStatus();
  }

  absl::Status Check(int rc, absl::string_view call, const OpDesc& d) {
    if (rc == MPI_SUCCESS) return absl::OkStatus();
    absl::Status s = MpiStatus(rc, call, rank_);
    s = absl::Status(s.code(), absl::StrCat(internal::DescribeOp(d), ": ", s.message()));
    poison_ = s;
    history_.End();
    return s;
  }

  // The point-to-point requests of one step, with who is at the other end and, for a
  // receive, how many bytes must arrive (-1 for a send).
  void ClearRequests() {
    reqs_.clear();
    peers_.clear();
    expect_.clear();
  }
  MPI_Request* AddRequest(int peer, int expect_bytes) {
    reqs_.emplace_back();
    peers_.push_back(peer);
    expect_.push_back(expect_bytes);
    return &reqs_.back();
  }

  absl::Status Wait(MPI_Request* req, absl::string_view call, const OpDesc& d) {
    return Poll(1, req, call, d, /*p2p=*/false);
  }

  // Waits for reqs_ and checks that every receive got exactly the bytes it expected: a peer
  // that sent a different size (other count or dtype) is an InvalidArgument naming it, never a
  // silently short or truncated block.
  absl::Status WaitAll(absl::string_view call, const OpDesc& d) {
    if (reqs_.empty()) return absl::OkStatus();
    statuses_.resize(reqs_.size());
    RETURN_IF_ERROR(Poll(static_cast<int>(reqs_.size()), reqs_.data(), call, d, /*p2p=*/true));
    for (size_t i = 0; i < reqs_.size(); ++i) {
      if (expect_[i] < 0) continue;
      int got = -1;
      MPI_Get_count(&statuses_[i], MPI_BYTE, &got);
      if (got != expect_[i]) return SizeMismatch(call, d, peers_[i], got, expect_[i]);
    }
    return absl::OkStatus();
  }

  absl::Status SizeMismatch(absl::string_view call, const OpDesc& d, int peer, int got,
                            int expected) {
    poison_ = absl::InvalidArgumentError(absl::StrCat(
        "rank ", rank_, ": ", internal::DescribeOp(d), ": ", call, ": rank ", peer, " sent ",
        got < 0 ? std::string("more than ") + std::to_string(expected) : std::to_string(got),
        " bytes where ", expected, " were expected (the ranks called with different counts or "
        "dtypes)"));
    history_.End();
    return poison_;
  }

  // Polls `reqs` until all complete or the operation's deadline passes. Yields first (latency
  // of small messages; and a peer that shares our core, under mpirun --oversubscribe, gets to
  // run), then backs off to short sleeps so that a long wait does not burn a core. The deadline
  // is checked on every round: under load even the yields can take longer than the timeout.
  // `p2p`: reqs_ (with peers_ and expect_) are being polled, and statuses_ receives their
  // statuses.
  absl::Status Poll(int n, MPI_Request* reqs, absl::string_view call, const OpDesc& d, bool p2p) {
    const absl::Time limit = deadline_;
    for (int spin = 0;; ++spin) {
      int done = 0;
      const int rc = MPI_Testall(n, reqs, &done, p2p ? statuses_.data() : MPI_STATUSES_IGNORE);
      if (rc == MPI_ERR_IN_STATUS && p2p) {
        for (int i = 0; i < n; ++i) {
          if (statuses_[i].MPI_ERROR == MPI_ERR_TRUNCATE) {
            return SizeMismatch(call, d, peers_[i], -1, expect_[i]);
          }
        }
      }
      if (rc != MPI_SUCCESS) return Check(rc, call, d);
      if (done) return absl::OkStatus();
      if (absl::Now() > limit) return TimedOut(n, reqs, call, d, p2p);
      if (spin < 2000) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(spin < 20000 ? 10 : 200));
      }
    }
  }

  // The ranks at the other end of the requests that have not completed.
  std::string MissingPeers(int n, MPI_Request* reqs) {
    std::vector<int> missing;
    for (int i = 0; i < n; ++i) {
      int flag = 0;
      MPI_Request_get_status(reqs[i], &flag, MPI_STATUS_IGNORE);
      if (!flag && expect_[i] >= 0 &&
          std::find(missing.begin(), missing.end(), peers_[i]) == missing.end()) {
        missing.push_back(peers_[i]);
      }
    }
    if (missing.empty()) return "";
    std::sort(missing.begin(), missing.end());
    return absl::StrCat("; no message arrived from ranks [", absl::StrJoin(missing, ","), "]");
  }

  // Where the peers are when a collective (whose requests do not say which peer is late)
  // timed out. Every rank that passed the argument check is in this operation's data phase
  // or past it. A rank that times out in it sends every peer a notice (kStuckTag); a peer
  // that finished it sends its next argument-check record (kCheckTag: messages of one
  // sender and tag arrive in order, and this operation's record was already received). For
  // up to min(timeout_ms, 5 s) (a peer that started later times out later, by at most
  // timeout_ms: it passed the same argument check), each peer is probed for either; the peers
  // with neither are the ones the collective waits for.
  std::string Survey(const OpDesc& d) {
    // The notices are never waited for (a missing peer never receives them): their buffer is
    // leaked on purpose, one per poisoned communicator, and the requests freed.
    const int64_t* notice = new int64_t(d.seq);
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      MPI_Request req;
      if (MPI_Isend(notice, 1, MPI_INT64_T, q, kStuckTag, comm_, &req) == MPI_SUCCESS) {
        MPI_Request_free(&req);
      }
    }
    enum Where { kUnknown, kWaiting, kPast };
    std::vector<Where> where(size_, kUnknown);
    where[rank_] = kWaiting;
    const absl::Time limit =
        absl::Now() + absl::Milliseconds(std::min(options_.timeout_ms, kSurveyMaxMs));
    for (bool all = false; !all && absl::Now() < limit;) {
      all = true;
      for (int q = 0; q < size_; ++q) {
        int flag = 0;
        if (where[q] == kUnknown &&
            MPI_Iprobe(q, kStuckTag, comm_, &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && flag) {
          where[q] = kWaiting;
        }
        if (where[q] == kUnknown &&
            MPI_Iprobe(q, kCheckTag, comm_, &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && flag) {
          where[q] = kPast;
        }
        all = all && where[q] != kUnknown;
      }
      if (!all) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::vector<int> ranks[3];
    for (int q = 0; q < size_; ++q) ranks[where[q]].push_back(q);
    std::string out;
    if (!ranks[kUnknown].empty()) {
      absl::StrAppend(&out, "; waiting for ranks [", absl::StrJoin(ranks[kUnknown], ","),
                      "] (no word from them: missing, dead or stuck outside this operation)");
    }
    absl::StrAppend(&out, "; ranks [", absl::StrJoin(ranks[kWaiting], ","),
                    "] timed out in it");
    if (!ranks[kPast].empty()) {
      absl::StrAppend(&out, "; ranks [", absl::StrJoin(ranks[kPast], ","), "] finished it");
    }
    return out;
  }

  absl::Status TimedOut(int n, MPI_Request* reqs, absl::string_view call, const OpDesc& d,
                        bool p2p) {
    poison_ = absl::DeadlineExceededError(absl::StrCat(
        internal::DescribeOp(d), " on MPI rank ", rank_, " of ", size_, ": ", call,
        " did not complete within ", options_.timeout_ms, " ms",
        p2p ? MissingPeers(n, reqs) : Survey(d),
        " (a peer is missing, dead or calling a different operation)"));
    absl::Status s = absl::DeadlineExceededError(
        absl::StrCat(poison_.message(), "\nrank ", rank_, " ", history_.Format()));
    history_.End();
    return s;
  }

  MPI_Comm comm_;
  const int rank_;
  const int size_;
  const CommOptions options_;
  internal::OpHistory history_;
  absl::Status poison_;
  absl::Time deadline_;  // of the operation in progress
  int64_t seq_ = 0;
  std::vector<char> scratch_;
  std::vector<const void*> ptrs_;
  std::vector<int> counts_, displs_;
  std::vector<size_t> bounds_;  // consecutive blocks, size_+1 element offsets
  std::vector<size_t> begin_, end_;  // ExchangeReduce's range of each rank
  // The point-to-point requests in flight, the rank at the other end of each, and the bytes
  // each receive expects (-1 for sends); statuses_ gets their statuses.
  std::vector<MPI_Request> reqs_;
  std::vector<int> peers_;
  std::vector<int> expect_;
  std::vector<MPI_Status> statuses_;
  std::vector<CheckRecord> records_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> CreateMpiCommunicator(MPI_Comm comm,
                                                                    CommOptions options) {
  if (options.timeout_ms <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("comm_timeout_ms must be > 0, got ", options.timeout_ms));
  }
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    return absl::FailedPreconditionError("CreateMpiCommunicator: MPI is not initialized");
  }
  if (options.setup_timeout_ms <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("setup_timeout_ms must be > 0, got ", options.setup_timeout_ms));
  }
  int world_rank = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  // MPI_Comm_idup, polled, rather than the blocking MPI_Comm_dup: a rank that never gets here
  // must not hang the others forever.
  MPI_Comm dup;
  MPI_Request req;
  RETURN_IF_ERROR(MpiStatus(MPI_Comm_idup(comm, &dup, &req), "MPI_Comm_idup", world_rank));
  const absl::Time deadline = absl::Now() + absl::Milliseconds(options.setup_timeout_ms);
  for (int spin = 0;; ++spin) {
    int done = 0;
    RETURN_IF_ERROR(MpiStatus(MPI_Test(&req, &done, MPI_STATUS_IGNORE),
                              "MPI_Test(MPI_Comm_idup)", world_rank));
    if (done) break;
    if (absl::Now() > deadline) {
      // The request stays pending: MPI cannot cancel it, so it and `dup` are leaked.
      return absl::DeadlineExceededError(absl::StrCat(
          "CreateMpiCommunicator on MPI world rank ", world_rank,
          ": MPI_Comm_idup did not complete within setup_timeout_ms=", options.setup_timeout_ms,
          " ms (a rank of the communicator has not called CreateMpiCommunicator, or is stuck "
          "before it)"));
    }
    if (spin < 100) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  // The duplicate inherits the caller's handler (MPI_COMM_WORLD's aborts the job): errors,
  // a truncated message among them, must come back as a Status.
  RETURN_IF_ERROR(MpiStatus(MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN),
                            "MPI_Comm_set_errhandler", world_rank));
  int rank = 0, size = 0;
  RETURN_IF_ERROR(MpiStatus(MPI_Comm_rank(dup, &rank), "MPI_Comm_rank", world_rank));
  RETURN_IF_ERROR(MpiStatus(MPI_Comm_size(dup, &size), "MPI_Comm_size", world_rank));
  return std::unique_ptr<Communicator>(new MpiCommunicator(dup, rank, size, options));
}

}  // namespace comm
}  // namespace zerort
