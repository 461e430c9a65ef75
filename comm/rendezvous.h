// A minimal TCP rendezvous for bootstrapping: rank 0 hands a small payload (e.g. NCCL's
// ncclUniqueId) to every other rank, using the address and port the launcher exports.
//
//   ASSIGN_OR_RETURN(LaunchInfo info, LaunchInfoFromEnv());
//   std::string id = info.rank == 0 ? MakeId() : "";
//   ASSIGN_OR_RETURN(std::string shared, Rendezvous(info, id, RendezvousOptions()));
//
// Protocol (network byte order; comm/internal/rendezvous_wire.h, docs/comm.md): a peer
// connects and sends a hello {"ZRV2", rank, world_size, flags, job id, a fresh random nonce};
// rank 0 answers with its own nonce and an HMAC-SHA256 proof that it knows the shared secret;
// the peer checks it and only then sends its own proof; rank 0 admits the peer ("ZROK"). Once
// all world_size-1 peers are admitted, rank 0 sends each {"ZRPL", length, payload, MAC}, the MAC
// binding the payload to the job id, world size, rank and both nonces, and closes. The secret
// never crosses the wire. A refused hello is answered {"ZRXJ", reason} (wrong secret, world
// size, rank, job id, or a duplicate rank), so that the peer can say why.
//
// Rank 0 handles connections concurrently (poll): each unauthenticated one has
// handshake_timeout_ms to finish its handshake and at most max_pending_connections wait at
// once (a full table evicts the oldest silent one), so idle or slow clients cannot take the
// real peers' places or time; peers reconnect when dropped before they were admitted. Both
// sides give up with DeadlineExceeded at timeout_ms, connect() included (non-blocking and
// polled); rank 0's error names the ranks that never authenticated and the connections it
// dropped, and why. Peers refuse payloads above max_payload_bytes.
//
// Authentication: optional. With RendezvousOptions::secret (or, for Rendezvous(), the
// environment variable ZERORT_RENDEZVOUS_SECRET) set, each side proves knowledge of the secret
// to the other: a peer refuses a rank 0 that cannot (an impostor holding the port; the peer's
// error names the address) and any payload whose MAC fails (forged, altered, or replayed from
// another session), and rank 0 admits only peers that prove it. Without a secret the same
// handshake runs with an empty key: it still refuses stale or crossed sessions, but anyone
// who can reach the port can pose as rank 0 or take a rank. The payload is authenticated, not
// encrypted: an eavesdropper sees it. A low-entropy secret can be guessed offline from a
// recorded handshake: use a random one (e.g. 32 random bytes, hex-encoded).
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
  // Shared secret both sides prove they know; empty: none (and a peer that has one is
  // refused). At most 256 bytes.
  std::string secret;
  // Names the job; peers and rank 0 must agree, and every MAC covers it, so that a peer of
  // another job on the same port (Slurm's derived port, the same secret) is refused. Empty is
  // a valid id. At most 256 bytes. Rendezvous() fills it when empty (see there).
  std::string job_id;

  // Rank 0: how long an accepted connection may take to authenticate before it is dropped
  // (never past timeout_ms). Must be > 0. A real peer needs one round trip; a dropped one
  // reconnects.
  int64_t handshake_timeout_ms = 3000;
  // Rank 0: connections allowed to be mid-handshake at once; more evict the oldest silent one
  // (else the oldest). Must be >= 1.
  size_t max_pending_connections = 64;
};

// InvalidArgument naming the field when an option is out of range (the secret is named by
// ZERORT_RENDEZVOUS_SECRET, its value never printed).
absl::Status ValidateRendezvousOptions(const RendezvousOptions& options);

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

  // Waits for ranks 1..world_size-1 to authenticate, then sends each `payload`. Stops
  // listening when it returns. DeadlineExceeded names the ranks that never authenticated and
  // counts the connections dropped, by reason (naming the address and claimed rank of each that
  // failed authentication).
  // REQUIRES: world_size >= 1, payload.size() <= options.max_payload_bytes.
  absl::Status Serve(int world_size, absl::string_view payload, const RendezvousOptions& options);

 private:
  RendezvousServer(int fd, int port) : fd_(fd), port_(port) {}
  int fd_;
  int port_;
};

// A peer's side: connects to addr:port (retrying while refused, or dropped before admission,
// until the timeout), authenticates, returns the payload. PermissionDenied when rank 0 refused
// our secret, when the server at addr:port could not prove it knows the secret, or when the
// payload's MAC fails (each message names addr:port).
absl::StatusOr<std::string> RendezvousFetch(const std::string& addr, int port, int rank,
                                            int world_size, const RendezvousOptions& options);

// Rank 0 listens on info.master_addr:info.master_port and serves `payload`; other ranks fetch
// it. Returns the payload on every rank. InvalidArgument when master_addr/port are unset.
// When options.secret is empty, ZERORT_RENDEZVOUS_SECRET (if set) is used as the secret. When
// options.job_id is empty it becomes info.store_key (torchrun), else "slurm:" SLURM_JOB_ID when
// that is set, else stays empty.
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
