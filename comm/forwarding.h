// ForwardingCommunicator passes every call to an inner communicator, so that a wrapper which
// observes collectives (counting bytes per link class, counting gathers per group) overrides
// only the calls it looks at and cannot forget to forward one.
//
//   class GatherCounter final : public comm::ForwardingCommunicator {
//    public:
//     using ForwardingCommunicator::ForwardingCommunicator;
//     absl::Status AllGather(const void* send, void* recv, size_t count, DType dtype,
//                            comm::Stream s) override {
//       ++gathers;
//       return ForwardingCommunicator::AllGather(send, recv, count, dtype, s);
//     }
//     int gathers = 0;
//   };
//
// Split forwards to the inner communicator and hands each new communicator to WrapSplit, which
// by default returns it unwrapped; a wrapper that must also see the sub-groups' calls wraps it
// there. Thread safety: as the inner communicator's (one thread at a time per rank).
#ifndef ZERORT_COMM_FORWARDING_H_
#define ZERORT_COMM_FORWARDING_H_

#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "comm/communicator.h"

namespace zerort {
namespace comm {

class ForwardingCommunicator : public Communicator {
 public:
  // Forwards to `inner`, not owned: it must outlive this communicator.
  explicit ForwardingCommunicator(Communicator* inner);
  // Forwards to `owned` and destroys it with this communicator (a Split's result).
  // REQUIRES: owned != nullptr.
  explicit ForwardingCommunicator(std::unique_ptr<Communicator> owned);

  // Streams default to nullptr as Communicator's do, so a wrapper is called as its inner one is.
  int rank() const override;
  int size() const override;
  absl::string_view backend() const override;
  bool device_memory() const override;
  bool stream_ordered() const override;
  absl::Status AllGather(const void* send, void* recv, size_t count, DType dtype,
                         Stream stream = nullptr) override;
  absl::Status ReduceScatter(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                             Stream stream = nullptr) override;
  absl::Status AllReduce(const void* send, void* recv, size_t count, DType dtype, ReduceOp op,
                         Stream stream = nullptr) override;
  absl::Status Broadcast(void* buf, size_t count, DType dtype, int root,
                         Stream stream = nullptr) override;
  absl::Status ReduceScatterInGroups(const void* send, void* recv, size_t count, DType dtype,
                                     ReduceOp op, int group_size, Stream stream = nullptr) override;
  absl::Status Barrier() override;
  absl::Status Synchronize(Stream stream) override;
  // The inner Split; a new communicator (not null) goes through WrapSplit.
  absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key) override;

 protected:
  Communicator* inner() const { return inner_; }

  // What Split returns for `sub`, the inner Split's new communicator (never null) for `color`.
  // The default returns `sub` itself.
  virtual absl::StatusOr<std::unique_ptr<Communicator>> WrapSplit(
      int color, std::unique_ptr<Communicator> sub);

 private:
  const std::unique_ptr<Communicator> owned_;
  Communicator* const inner_;
};

}  // namespace comm
}  // namespace zerort

#endif  // ZERORT_COMM_FORWARDING_H_
