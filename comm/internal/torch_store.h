// A client of torchrun's agent store (torch's TCPStore), just enough of it for the rendezvous:
// under torchrun, MASTER_PORT belongs to the store, so rank 0 publishes its own address there
// and the other ranks read it back (comm/rendezvous.h, Rendezvous()).
//
//   ASSIGN_OR_RETURN(auto store, TorchStore::Connect(addr, port, rank, deadline, timeout_ms));
//   RETURN_IF_ERROR(store->Set("zerort/0", "10.0.0.1:41234"));
//   ASSIGN_OR_RETURN(bool there, store->Check("zerort/0"));
//
// Wire format (torch/csrc/distributed/c10d/TCPStoreBackend.hpp, the same for its classic and
// libuv servers): a request is a one-byte query type and its arguments; a string is a uint64
// length and its bytes, in the host's byte order (torch sends its integers raw). The connection
// opens with VALIDATE and the magic number.
//
// Every call sends one request and reads its reply, bounded by the deadline given to Connect.
// Thread safety: one thread at a time per TorchStore.
#ifndef ZERORT_COMM_INTERNAL_TORCH_STORE_H_
#define ZERORT_COMM_INTERNAL_TORCH_STORE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace zerort {
namespace comm {
namespace internal {

class TorchStore {
 public:
  // Connects (retrying until `deadline`, as ConnectBefore does) and sends VALIDATE. `rank` and
  // `timeout_ms` only name the caller and its timeout in errors.
  static absl::StatusOr<std::unique_ptr<TorchStore>> Connect(const std::string& addr, int port,
                                                             int rank, absl::Time deadline,
                                                             int64_t timeout_ms);
  ~TorchStore();
  TorchStore(const TorchStore&) = delete;
  TorchStore& operator=(const TorchStore&) = delete;

  // "torchrun's store at <addr>:<port>", for messages.
  const std::string& where() const { return where_; }

  // This end's IPv4 address: the interface through which the store's host reaches us.
  absl::StatusOr<std::string> LocalAddress() const;

  absl::Status Set(absl::string_view key, absl::string_view value);

  // Whether `key` is in the store (torch's CHECK of one key).
  absl::StatusOr<bool> Check(absl::string_view key);

  // `key`'s value; DataLoss when it is longer than `max_bytes`.
  // REQUIRES: Check(key) returned true.
  absl::StatusOr<std::string> Get(absl::string_view key, size_t max_bytes);

 private:
  TorchStore(int fd, std::string where, absl::Time deadline)
      : fd_(fd), where_(std::move(where)), deadline_(deadline) {}
  absl::Status Send(std::string& msg);

  int fd_;
  std::string where_;
  absl::Time deadline_;
};

}  // namespace internal
}  // namespace comm
}  // namespace zerort

#endif  // ZERORT_COMM_INTERNAL_TORCH_STORE_H_
