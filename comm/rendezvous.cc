#include "comm/rendezvous.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/sha256.h"
#include "base/status.h"
#include "comm/internal/rendezvous_wire.h"
#include "comm/internal/socket.h"
#include "comm/internal/torch_store.h"

namespace zerort {
namespace comm {
namespace {

using internal::ConnectBefore;
using internal::Errno;
using internal::Get32;
using internal::Put32;
using internal::RemainingMs;
using internal::Resolve;
using internal::Session;
using internal::TorchStore;
using internal::Transfer;

// Splits "a.b.c.d:port" as rank 0 published it.
absl::Status ParseHostPort(const std::string& text, const std::string& key, std::string* host,
                           int* port) {
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(text.substr(colon + 1), port) || *port < 1 || *port > 65535) {
    return absl::DataLossError(
        absl::StrCat("rendezvous: key '", key, "' in torchrun's store holds '", text,
                     "', not host:port (another program wrote it?)"));
  }
  *host = text.substr(0, colon);
  return absl::OkStatus();
}

// What a peer reports when rank 0 refused it with `reason`.
absl::Status RejectedError(uint32_t reason, const std::string& where, int rank) {
  const std::string head = absl::StrCat("rendezvous: ", where, " rejected rank ", rank, ": ");
  switch (reason) {
    case internal::kRejectSecret:
      return absl::PermissionDeniedError(absl::StrCat(
          head, "the shared secret does not match; set the same ", kSecretEnvVar,
          " (RendezvousOptions::secret) on every rank, or on none"));
    case internal::kRejectWorld:
      return absl::UnavailableError(
          absl::StrCat(head, "its world size differs from rank 0's"));
    case internal::kRejectRank:
      return absl::UnavailableError(absl::StrCat(head, "rank is outside rank 0's world"));
    case internal::kRejectDuplicate:
      return absl::UnavailableError(absl::StrCat(head, "another peer already joined as rank ",
                                                 rank));
    case internal::kRejectJob:
      return absl::UnavailableError(absl::StrCat(
          head, "its job id differs from rank 0's (a rank 0 of another job on this port?)"));
    default:
      return absl::DataLossError(absl::StrCat(head, "unknown reason ", reason));
  }
}

struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) close(fd);
  }
};

// One connection's try at fetching the payload. `retry`: rank 0 closed the connection before
// admitting us (it drops slow handshakes and evicts when crowded): connect again.
struct Attempt {
  absl::StatusOr<std::string> result;
  bool retry = false;
};

Attempt Retry(absl::Status why) { return Attempt{std::move(why), true}; }

// Reads a 4-byte tag, and the reason when it is a refusal {kRejectTag, reason}.
absl::Status ReadTag(int fd, absl::Time deadline, const std::string& where, uint32_t* tag,
                     uint32_t* reason) {
  char b[4];
  RETURN_IF_ERROR(Transfer(fd, b, 4, /*send=*/false, deadline, where));
  *tag = Get32(b);
  if (*tag != internal::kRejectTag) return absl::OkStatus();
  RETURN_IF_ERROR(Transfer(fd, b, 4, /*send=*/false, deadline, where));
  *reason = Get32(b);
  return absl::OkStatus();
}

// Waits for rank 0's next message, which must be `want`. Unavailable (closed) before admission
// means rank 0 dropped this connection: retry.
Attempt Expect(int fd, uint32_t want, absl::Time deadline, const std::string& where, int rank) {
  uint32_t tag = 0, reason = 0;
  absl::Status s = ReadTag(fd, deadline, where, &tag, &reason);
  if (absl::IsUnavailable(s)) return Retry(s);
  if (!s.ok()) return Attempt{s};
  if (tag == internal::kRejectTag) return Attempt{RejectedError(reason, where, rank)};
  if (tag != want) {
    return Attempt{
        absl::DataLossError(absl::StrCat("rendezvous: ", where, " sent a malformed reply"))};
  }
  return Attempt{std::string()};
}

// After the challenge: checks rank 0's proof, then sends ours (or our refusal of its proof).
absl::Status AnswerChallenge(int fd, const std::string& secret, Session& s, absl::Time deadline,
                             const std::string& where) {
  char ch[internal::kChallengeBytes - 4];
  RETURN_IF_ERROR(Transfer(fd, ch, sizeof ch, /*send=*/false, deadline, where));
  s.rank0_nonce.assign(ch, internal::kNonceBytes);
  const absl::string_view proof(ch + internal::kNonceBytes, internal::kMacBytes);
  std::string answer;
  if (!ConstantTimeEqual(proof, internal::Rank0Proof(secret, s))) {
    // Tell rank 0 (if it is rank 0) so that its error names this rank; nothing secret in it.
    Put32(&answer, internal::kRejectTag);
    Put32(&answer, internal::kRejectRank0Proof);
    answer.resize(internal::kAnswerBytes, '\0');
    (void)Transfer(fd, &answer[0], answer.size(), /*send=*/true, deadline, where);
    return absl::PermissionDeniedError(absl::StrCat(
        "rendezvous: rank ", s.rank, ": ", where, " did not prove it knows the shared secret (",
        kSecretEnvVar, "): rank 0's secret differs from this rank's, or another process holds "
        "the port; no proof of this rank's was sent to it"));
  }
  Put32(&answer, internal::kProofTag);
  answer += internal::PeerProof(secret, s);
  return Transfer(fd, &answer[0], answer.size(), /*send=*/true, deadline, where);
}

// After admission: the payload, refused unless its MAC is this session's.
absl::StatusOr<std::string> ReadPayload(int fd, const RendezvousOptions& o, const Session& s,
                                        absl::Time deadline, const std::string& where) {
  char header[8];
  RETURN_IF_ERROR(Transfer(fd, header, sizeof header, /*send=*/false, deadline, where));
  if (Get32(header) != internal::kPayloadTag) {
    return absl::DataLossError(absl::StrCat("rendezvous: ", where, " sent a malformed reply"));
  }
  const uint32_t len = Get32(header + 4);
  if (len > o.max_payload_bytes) {
    return absl::DataLossError(absl::StrCat("rendezvous: ", where, " announced a payload of ",
                                            len, " bytes, above max_payload_bytes=",
                                            o.max_payload_bytes));
  }
  std::string body(len + internal::kMacBytes, '\0');
  RETURN_IF_ERROR(Transfer(fd, &body[0], body.size(), /*send=*/false, deadline, where));
  const absl::string_view payload = absl::string_view(body).substr(0, len);
  if (!ConstantTimeEqual(absl::string_view(body).substr(len),
                         internal::PayloadMac(o.secret, s, payload))) {
    return absl::PermissionDeniedError(absl::StrCat(
        "rendezvous: rank ", s.rank, ": the payload from ", where,
        " fails its authentication code for this session (forged, altered, or replayed from "
        "another session); refused"));
  }
  return std::string(payload);
}

// Hello, challenge, proofs, admission, payload over one connected socket.
Attempt FetchOnce(int fd, Session s, const RendezvousOptions& o, absl::Time deadline,
                  const std::string& where) {
  absl::StatusOr<std::string> nonce = internal::FreshNonce();
  if (!nonce.ok()) return Attempt{nonce.status()};
  s.peer_nonce = *nonce;
  const int rank = static_cast<int>(s.rank);
  std::string hello = internal::HelloMessage(s, !o.secret.empty());
  absl::Status sent = Transfer(fd, &hello[0], hello.size(), /*send=*/true, deadline, where);
  if (absl::IsUnavailable(sent)) return Retry(sent);
  if (!sent.ok()) return Attempt{sent};
  Attempt step = Expect(fd, internal::kChallengeTag, deadline, where, rank);
  if (!step.result.ok()) return step;
  absl::Status answered = AnswerChallenge(fd, o.secret, s, deadline, where);
  if (absl::IsUnavailable(answered)) return Retry(answered);
  if (!answered.ok()) return Attempt{answered};
  step = Expect(fd, internal::kAcceptTag, deadline, where, rank);
  if (!step.result.ok()) return step;
  // Admitted: from here a closed connection is rank 0 failing, not a reason to retry.
  return Attempt{ReadPayload(fd, o, s, deadline, where)};
}

}  // namespace

absl::Status ValidateRendezvousOptions(const RendezvousOptions& o) {
  if (o.secret.size() > internal::kMaxSecretBytes) {
    return absl::InvalidArgumentError(absl::StrCat("rendezvous secret (", kSecretEnvVar, ") is ",
                                                   o.secret.size(), " bytes, above the limit of ",
                                                   internal::kMaxSecretBytes));
  }
  if (o.job_id.size() > internal::kMaxJobIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("rendezvous job_id is ", o.job_id.size(),
                                                   " bytes, above the limit of ",
                                                   internal::kMaxJobIdBytes));
  }
  if (o.timeout_ms <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rendezvous timeout_ms=", o.timeout_ms, " must be > 0"));
  }
  if (o.handshake_timeout_ms <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("rendezvous handshake_timeout_ms=",
                                                   o.handshake_timeout_ms, " must be > 0"));
  }
  if (o.max_pending_connections < 1) {
    return absl::InvalidArgumentError("rendezvous max_pending_connections=0 must be >= 1");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<RendezvousServer>> RendezvousServer::Listen(
    const std::string& addr, int port) {
  ASSIGN_OR_RETURN(sockaddr_in sa, Resolve(addr, port));
  const std::string where = absl::StrCat(addr, ":", port);
  // Non-blocking: Serve accepts until the queue is empty without ever blocking.
  Fd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (fd.fd < 0) return Errno("socket", where);
  const int one = 1;
  setsockopt(fd.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (bind(fd.fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) return Errno("bind", where);
  if (listen(fd.fd, 128) != 0) return Errno("listen", where);
  socklen_t len = sizeof sa;
  if (getsockname(fd.fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
    return Errno("getsockname", where);
  }
  const int bound = ntohs(sa.sin_port);
  const int raw = fd.fd;
  fd.fd = -1;
  return std::unique_ptr<RendezvousServer>(new RendezvousServer(raw, bound));
}

RendezvousServer::~RendezvousServer() {
  if (fd_ >= 0) close(fd_);
}

absl::StatusOr<std::string> RendezvousFetch(const std::string& addr, int port, int rank,
                                            int world_size, const RendezvousOptions& options) {
  if (world_size < 2 || rank < 1 || rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rendezvous fetch: rank ", rank,
                                                   " must be in [1, world_size=", world_size, ")"));
  }
  RETURN_IF_ERROR(ValidateRendezvousOptions(options));
  ASSIGN_OR_RETURN(sockaddr_in sa, Resolve(addr, port));
  const std::string where = absl::StrCat("rank 0 at ", addr, ":", port);
  const absl::Time deadline = absl::Now() + absl::Milliseconds(options.timeout_ms);
  Session session;
  session.job_id = options.job_id;
  session.world_size = static_cast<uint32_t>(world_size);
  session.rank = static_cast<uint32_t>(rank);
  for (int dropped = 0;; ++dropped) {
    ASSIGN_OR_RETURN(int fd, ConnectBefore(sa, deadline, rank, where, options.timeout_ms));
    Fd guard(fd);
    const int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    Attempt a = FetchOnce(fd, session, options, deadline, where);
    if (!a.retry) return std::move(a.result);
    const int left = RemainingMs(deadline);
    if (left == 0) {
      return absl::DeadlineExceededError(absl::StrCat(
          "rendezvous: rank ", rank, ": ", where, " closed ", dropped + 1,
          " connections before admitting this rank, until the ", options.timeout_ms,
          " ms timeout; last: ", a.result.status().message()));
    }
    // Rank 0 drops slow handshakes and evicts when crowded: a moment, then again.
    const int pause_ms = 20 + 10 * std::min(dropped, 8);
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(pause_ms, left)));
  }
}

namespace {

// How many store rendezvous this rank made before in this process: the key's last part. Counted
// per key and rank, so that ranks run as threads of one process (tests) count alike.
ABSL_CONST_INIT absl::Mutex store_calls_mu(absl::kConstInit);

uint64_t NextStoreCall(const LaunchInfo& info) {
  static auto* calls ABSL_GUARDED_BY(store_calls_mu) =
      new std::map<std::pair<std::string, int>, uint64_t>();
  absl::MutexLock lock(&store_calls_mu);
  return (*calls)[{info.store_key, info.rank}]++;
}

// Rendezvous() under torchrun's agent store (see the header).
absl::StatusOr<std::string> RendezvousThroughTorchStore(const LaunchInfo& info,
                                                        absl::string_view payload,
                                                        const RendezvousOptions& options) {
  const std::string key = absl::StrCat(info.store_key, "/", NextStoreCall(info));
  const absl::Time deadline = absl::Now() + absl::Milliseconds(options.timeout_ms);
  ASSIGN_OR_RETURN(std::unique_ptr<TorchStore> store,
                   TorchStore::Connect(info.master_addr, info.master_port, info.rank, deadline,
                                       options.timeout_ms));
  if (info.rank == 0) {
    ASSIGN_OR_RETURN(std::string host, store->LocalAddress());
    ASSIGN_OR_RETURN(auto server, RendezvousServer::Listen(host, 0));
    RETURN_IF_ERROR(store->Set(key, absl::StrCat(host, ":", server->port())));
    // A reply to a later request on the same connection: the store has applied the SET.
    ASSIGN_OR_RETURN(bool stored, store->Check(key));
    if (!stored) {
      return absl::UnavailableError(
          absl::StrCat("rendezvous: ", store->where(), " did not keep key '", key, "'"));
    }
    store.reset();
    RETURN_IF_ERROR(server->Serve(info.world_size, payload, options));
    return std::string(payload);
  }
  for (;;) {
    absl::StatusOr<bool> ready = store->Check(key);
    if (ready.ok() && *ready) break;
    const int left = RemainingMs(deadline);
    if (!ready.ok() && (left > 0 || !absl::IsDeadlineExceeded(ready.status()))) {
      return ready.status();
    }
    if (left == 0) {
      return absl::DeadlineExceededError(absl::StrCat(
          "rendezvous: rank ", info.rank, " found no key '", key, "' in ", store->where(),
          " within ", options.timeout_ms, " ms: rank 0 never published its address"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(20, left)));
  }
  ASSIGN_OR_RETURN(std::string published, store->Get(key, 256));
  store.reset();
  std::string host;
  int port = 0;
  RETURN_IF_ERROR(ParseHostPort(published, key, &host, &port));
  RendezvousOptions rest = options;
  rest.timeout_ms = std::max<int64_t>(1, RemainingMs(deadline));
  return RendezvousFetch(host, port, info.rank, info.world_size, rest);
}

// Names the job for RendezvousOptions::job_id: torchrun's run and restart, else Slurm's job.
std::string DefaultJobId(const LaunchInfo& info) {
  if (!info.store_key.empty()) return info.store_key;
  if (const char* job = std::getenv("SLURM_JOB_ID")) return absl::StrCat("slurm:", job);
  return "";
}

}  // namespace

absl::StatusOr<std::string> Rendezvous(const LaunchInfo& info, absl::string_view payload,
                                       RendezvousOptions options) {
  if (info.world_size == 1) return std::string(payload);
  if (options.secret.empty()) {
    if (const char* s = std::getenv(kSecretEnvVar)) options.secret = s;
  }
  if (options.job_id.empty()) options.job_id = DefaultJobId(info);
  if (info.master_addr.empty() || info.master_port <= 0) {
    return absl::InvalidArgumentError(
        "rendezvous needs MASTER_ADDR and MASTER_PORT (rank 0's address and a free port)");
  }
  if (info.master_is_torch_store) return RendezvousThroughTorchStore(info, payload, options);
  if (info.rank == 0) {
    ASSIGN_OR_RETURN(auto server, RendezvousServer::Listen(info.master_addr, info.master_port));
    RETURN_IF_ERROR(server->Serve(info.world_size, payload, options));
    return std::string(payload);
  }
  return RendezvousFetch(info.master_addr, info.master_port, info.rank, info.world_size, options);
}

}  // namespace comm
}  // namespace zerort
