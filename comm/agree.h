// Agree: exact exchange of small host values (integers, byte strings, statuses) between ranks,
// for the checks that keep ranks from diverging: the same model on every rank, the same
// checkpoint id, one verdict on a load or a save.
//
//   comm::DirectHostExchange exchange(comm);  // in-process or MPI
//   ASSIGN_OR_RETURN(std::vector<uint64_t> ids, comm::AllGatherU64(exchange, {id}));
//   RETURN_IF_ERROR(comm::AgreeOnStatus(exchange, local_status));
//
// Values travel as their bits: a uint64_t as four 16-bit words, a byte string as its bytes in
// pairs, moved by the copy-only collectives (AllGather, Broadcast) on 16-bit elements, which
// every backend copies unchanged (communicator.h, "Copies"). No value is converted to a float
// and none goes through a reduction.
//
// Memory: communicators that read host memory when called (in-process, MPI) take the host
// buffers as they are (DirectHostExchange). A stream-ordered communicator (NCCL) moves device
// memory only, so its HostExchange stages through device memory (the engine's does:
// zero/internal/host_collectives.h).
//
// Thread safety: as the communicator (one thread per rank). Every function here is collective:
// every rank calls it in the same order with the same lengths.
#ifndef ZERORT_COMM_AGREE_H_
#define ZERORT_COMM_AGREE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/dtype.h"
#include "comm/communicator.h"

namespace zerort {
namespace comm {

// The two copy-only collectives over host buffers, complete on return.
class HostExchange {
 public:
  virtual ~HostExchange() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // As Communicator::AllGather, on host buffers: recv holds size() * count elements.
  virtual absl::Status AllGatherHost(const void* send, void* recv, size_t count,
                                     DType dtype) = 0;
  // As Communicator::Broadcast, on a host buffer.
  virtual absl::Status BroadcastHost(void* buf, size_t count, DType dtype, int root) = 0;
};

// Hands host buffers straight to a communicator that reads them when called. With a
// stream-ordered communicator every call fails with FailedPrecondition (it needs staging).
class DirectHostExchange final : public HostExchange {
 public:
  // `comm` must outlive this object.
  explicit DirectHostExchange(Communicator* comm) : comm_(comm) {}
  int rank() const override { return comm_->rank(); }
  int size() const override { return comm_->size(); }
  absl::Status AllGatherHost(const void* send, void* recv, size_t count, DType dtype) override;
  absl::Status BroadcastHost(void* buf, size_t count, DType dtype, int root) override;

 private:
  Communicator* const comm_;
};

// Every rank's `mine`, rank r's values at [r * mine.size(), (r + 1) * mine.size()).
// REQUIRES: the same mine.size() on every rank.
absl::StatusOr<std::vector<uint64_t>> AllGatherU64(HostExchange& exchange,
                                                   absl::Span<const uint64_t> mine);

// Replaces *bytes on every rank with root's *bytes (any length; the others' are ignored).
// REQUIRES: 0 <= root < size().
absl::Status BroadcastBytes(HostExchange& exchange, std::string* bytes, int root);

// One verdict on every rank: OK when every rank's `local` is OK, else the status of the lowest
// failing rank q (its code and message; on the other ranks the message is prefixed
// "on rank q: "). One rank's failure thus fails the operation everywhere instead of leaving
// the others to hang in their next collective.
absl::Status AgreeOnStatus(HostExchange& exchange, const absl::Status& local);

}  // namespace comm
}  // namespace zerort

#endif  // ZERORT_COMM_AGREE_H_
