// A minimal TCP rendezvous for bootstrapping: rank 0 hands a small payload (e.g. NCCL's
// ncclUniqueId) to every other rank, using the address and port the launcher exports.
//
//   ASSIGN_OR_RETURN(LaunchInfo info, LaunchInfoFromEnv());
//   std::string id = info.rank == 0 ? MakeId() : "";
//   ASSIGN_OR_RETURN(std::string shared, Rendezvous(info, id, RendezvousOptions()));
//
// Protocol (network byte order): a peer connects and sends a hello {magic "ZRV1", rank,
// world_size, secret_len} followed by secret_len bytes of shared secret; once all world_size-1
// peers have said hello, rank 0 sends each {magic, length} and `length` payload bytes, and
// closes. The server binds only the given address, closes malformed hellos without a word,
// answers a hello with the wrong secret, an out-of-range, duplicate or wrong-world rank with
// {"ZRXJ", reason} (the peer's error says why: PermissionDenied naming ZERORT_RENDEZVOUS_SECRET
// for the secret, Unavailable for the others), accepts at most world_size-1 peers and then stops
// listening. Both sides give up with DeadlineExceeded at the timeout, connect() included (it is
// non-blocking and polled, so an address that drops SYNs cannot hold a peer past it); peers
// refuse payloads above max_payload_bytes.
//
// Authentication: optional. When RendezvousOptions::secret (or, for Rendezvous(), the
// environment variable ZERORT_RENDEZVOUS_SECRET) is set, rank 0 accepts only peers that send
// the same bytes, compared in constant time; the secret never appears in an error message. It
// travels in clear text: it keeps stray and unauthorised processes out, not an eavesdropper on
// the network, and peers do not authenticate rank 0. Use a private network, as for torchrun's
// own store.
//
// LaunchInfo and LaunchInfoFromEnv() (the launcher's environment) are in comm/launch_env.h.
//
// Thread safety: a RendezvousServer is used by one thread; the free functions are thread-safe.
#ifndef ZERORT_COMM_RENDEZVOUS_H_
#define ZERORT_COMM_RENDEZVOUS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "comm/launch_env.h"

namespace zerort {
namespace comm {

// The environment variable Rendezvous() reads the shared secret from.
inline constexpr char kSecretEnvVar[] = "ZERORT_RENDEZVOUS_SECRET";

struct RendezvousOptions {
  // Both sides give up after this long (connect retries included). Must be > 0.
  int64_t timeout_ms = 60000;
  // Largest payload either side will send or accept.
  size_t max_payload_bytes = 4096;
  // Shared secret every peer must present; empty: none (and a peer that presents one is
  // refused). At most 256 bytes.
  std::string secret;
};

// Rank 0's side. Listen binds and listens at once, so that the port is known (port 0 picks a
// free one) before peers connect; peers that connect early are retried by RendezvousFetch.
class RendezvousServer {
 public:
  // `addr`: an IPv4 address or host name; only that address is bound.
  static absl::StatusOr<std::unique_ptr<RendezvousServer>> Listen(const std::string& addr,
                                                                  int port);
  ~RendezvousServer();
  RendezvousServer(const RendezvousServer&) = delete;
  RendezvousServer& operator=(const RendezvousServer&) = delete;

  int port() const { return port_; }

  // Waits for ranks 1..world_size-1 to say hello, then sends each `payload`. Stops listening
  // when it returns. DeadlineExceeded names the ranks that never arrived.
  // REQUIRES: world_size >= 1, payload.size() <= options.max_payload_bytes.
  absl::Status Serve(int world_size, absl::string_view payload, const RendezvousOptions& options);

 private:
  RendezvousServer(int fd, int port) : fd_(fd), port_(port) {}
  int fd_;
  int port_;
};

// A peer's side: connects to addr:port (retrying while refused, until the timeout), says hello,
// returns the payload. PermissionDenied when rank 0 refused our secret.
absl::StatusOr<std::string> RendezvousFetch(const std::string& addr, int port, int rank,
                                            int world_size, const RendezvousOptions& options);

// Rank 0 listens on info.master_addr:info.master_port and serves `payload`; other ranks fetch
// it. Returns the payload on every rank. InvalidArgument when master_addr/port are unset.
// When options.secret is empty, ZERORT_RENDEZVOUS_SECRET (if set) is used as the secret.
//
// Under torchrun's agent store (info.master_is_torch_store) MASTER_PORT is taken: rank 0 then
// binds a free port on the address through which it reaches the store, and publishes
// "address:port" in that store (torch's TCPStore protocol: VALIDATE, SET, CHECK, GET) under
// info.store_key + "/" + the number of this rank's earlier such calls; the other ranks poll
// the store for the key, then fetch from that address. So every rank must make its
// Rendezvous() calls in the same order, as collectives require anyway. The deadline covers the
// store too: a key that never appears is DeadlineExceeded naming the key and the store.
absl::StatusOr<std::string> Rendezvous(const LaunchInfo& info, absl::string_view payload,
                                       RendezvousOptions options);

}  // namespace comm
}  // namespace zerort

#endif  // ZERORT_COMM_RENDEZVOUS_H_
