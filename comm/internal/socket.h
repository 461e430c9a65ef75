// The TCP plumbing that the rendezvous (comm/rendezvous.cc) and its torchrun store client
// (comm/internal/torch_store.h) share: name resolution, a connect that retries until a
// deadline, and exact sends and receives bounded by the same deadline. Every failure is a
// Status whose message starts with "rendezvous", naming the peer.
//
// Thread safety: free functions on the caller's own sockets; errno is read on the calling
// thread.
#ifndef ZERORT_COMM_INTERNAL_SOCKET_H_
#define ZERORT_COMM_INTERNAL_SOCKET_H_

#include <netinet/in.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace zerort {
namespace comm {
namespace internal {

// Milliseconds until `deadline`, clamped to [0, 2^30] for poll().
int RemainingMs(absl::Time deadline);

// Unavailable: "rendezvous <what> <where>: <strerror(errno)>".
absl::Status Errno(absl::string_view what, const std::string& where);

// Resolves an IPv4 address or host name. InvalidArgument for a port outside [0, 65535] or a
// name that does not resolve.
absl::StatusOr<sockaddr_in> Resolve(const std::string& addr, int port);

// Sends (`send`) or receives exactly n bytes of `buf` before the deadline: DeadlineExceeded at
// the deadline, Unavailable when `peer` closes the connection or the socket fails.
absl::Status Transfer(int fd, char* buf, size_t n, bool send, absl::Time deadline,
                      const std::string& peer);

// Connects to `sa` before `deadline`, retrying refused and unreachable attempts (rank 0 may not
// be listening yet) every 20 ms. Returns the connected, non-blocking socket; DeadlineExceeded
// names `rank`, `where` and `timeout_ms` (the timeout the deadline came from).
absl::StatusOr<int> ConnectBefore(const sockaddr_in& sa, absl::Time deadline, int rank,
                                  const std::string& where, int64_t timeout_ms);

}  // namespace internal
}  // namespace comm
}  // namespace zerort

#endif  // ZERORT_COMM_INTERNAL_SOCKET_H_
