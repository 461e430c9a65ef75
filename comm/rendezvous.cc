#include "comm/rendezvous.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/status.h"
#include "comm/internal/socket.h"
#include "comm/internal/torch_store.h"

namespace zerort {
namespace comm {
namespace {

using internal::ConnectBefore;
using internal::Errno;
using internal::RemainingMs;
using internal::Resolve;
using internal::TorchStore;
using internal::Transfer;

constexpr uint32_t kMagic = 0x5a525631;  // "ZRV1"
constexpr size_t kHelloBytes = 16;
constexpr uint32_t kRejectMagic = 0x5a52584a;  // "ZRXJ": rank 0 refused the hello
constexpr size_t kHeaderBytes = 8;
constexpr size_t kMaxSecretBytes = 256;

void Put32(char* p, uint32_t v) {
  v = htonl(v);
  std::memcpy(p, &v, 4);
}
uint32_t Get32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return ntohl(v);
}

// Why the server refused a well-formed hello; sent back as {kRejectMagic, reason} so that the
// peer can say why instead of seeing a bare close.
enum Reject : uint32_t {
  kAccepted = 0,
  kRejectSecret = 1,     // the shared secret differs
  kRejectWorld = 2,      // its world_size differs from rank 0's
  kRejectRank = 3,       // rank outside [1, world_size)
  kRejectDuplicate = 4,  // another peer already joined with this rank
};

// Equal length and bytes, in time that depends only on the lengths, so that a peer cannot
// learn the secret a byte at a time from how fast it is refused.
bool SameSecret(absl::string_view a, absl::string_view b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

// A connection accepted by the server that has not yet sent its whole hello (the 16-byte
// header, then secret_len bytes of secret).
struct PendingHello {
  int fd;
  char hello[kHelloBytes + kMaxSecretBytes];
  size_t got;
};

// Bytes of `p`'s hello still expected, or SIZE_MAX when its header is malformed.
size_t HelloBytesWanted(const PendingHello& p) {
  if (p.got < kHelloBytes) return kHelloBytes - p.got;
  if (Get32(p.hello) != kMagic) return SIZE_MAX;
  const uint32_t secret_len = Get32(p.hello + 12);
  if (secret_len > kMaxSecretBytes) return SIZE_MAX;
  return kHelloBytes + secret_len - p.got;
}

Reject JudgeHello(const PendingHello& p, int world_size, absl::string_view secret,
                  const std::map<int, int>& peers) {
  const uint32_t rank = Get32(p.hello + 4), world = Get32(p.hello + 8);
  // The secret first: a peer without it learns nothing about the job.
  if (!SameSecret(absl::string_view(p.hello + kHelloBytes, p.got - kHelloBytes), secret)) {
    return kRejectSecret;
  }
  if (world != static_cast<uint32_t>(world_size)) return kRejectWorld;
  if (rank < 1 || rank >= world) return kRejectRank;
  if (peers.count(static_cast<int>(rank))) return kRejectDuplicate;
  return kAccepted;
}

// Reads from every pending connection that `fds` (the server's poll set: the listening socket,
// then `pending` in order) reports readable. A complete hello joins `peers` (rank -> fd) if
// JudgeHello accepts it; else the peer is told why (best effort, never blocking) and its
// connection closed. Malformed hellos and failed connections are closed without a word. All of
// these leave `pending`.
void ReadHellos(const std::vector<pollfd>& fds, int world_size, absl::string_view secret,
                std::vector<PendingHello>& pending, std::map<int, int>& peers) {
  for (size_t i = 1; i < fds.size(); ++i) {
    if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    PendingHello& p = pending[i - 1];
    const ssize_t k = recv(p.fd, p.hello + p.got, HelloBytesWanted(p), 0);
    if (k <= 0) {
      if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      close(p.fd);
      p.fd = -1;
      continue;
    }
    p.got += static_cast<size_t>(k);
    const size_t wanted = HelloBytesWanted(p);
    if (wanted == SIZE_MAX) {
      close(p.fd);  // not our protocol
      p.fd = -1;
      continue;
    }
    if (wanted > 0) continue;
    const Reject verdict = JudgeHello(p, world_size, secret, peers);
    if (verdict == kAccepted) {
      peers[static_cast<int>(Get32(p.hello + 4))] = p.fd;
    } else {
      char reply[kHeaderBytes];
      Put32(reply, kRejectMagic);
      Put32(reply + 4, verdict);
      (void)!send(p.fd, reply, sizeof reply, MSG_NOSIGNAL | MSG_DONTWAIT);
      close(p.fd);
    }
    p.fd = -1;
  }
  pending.erase(std::remove_if(pending.begin(), pending.end(),
                               [](const PendingHello& p) { return p.fd < 0; }),
                pending.end());
}

// Accepts one connection on `listen_fd`; closes it at once if `max_pending` already wait.
void AcceptPending(int listen_fd, size_t max_pending, std::vector<PendingHello>& pending) {
  const int c = accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
  if (c < 0) return;
  if (pending.size() >= max_pending) {
    close(c);
  } else {
    pending.push_back(PendingHello{c, {}, 0});
  }
}

absl::Status MissingRanksError(int port, int world_size, const std::map<int, int>& peers,
                               int64_t timeout_ms) {
  std::vector<int> missing;
  for (int r = 1; r < world_size; ++r) {
    if (!peers.count(r)) missing.push_back(r);
  }
  return absl::DeadlineExceededError(
      absl::StrCat("rendezvous on port ", port, ": ranks [", absl::StrJoin(missing, ","), "] of ",
                   world_size, " did not arrive within ", timeout_ms, " ms"));
}

// Sends {magic, length} and the payload to every peer (rank -> fd) and closes it. The first
// failure, after trying every peer.
absl::Status SendPayload(const std::map<int, int>& peers, absl::string_view payload,
                         absl::Time deadline) {
  std::string msg(kHeaderBytes, '\0');
  Put32(&msg[0], kMagic);
  Put32(&msg[4], static_cast<uint32_t>(payload.size()));
  msg.append(payload.data(), payload.size());
  absl::Status result;
  for (auto& kv : peers) {
    absl::Status s = Transfer(kv.second, &msg[0], msg.size(), /*send=*/true, deadline,
                              absl::StrCat("rank ", kv.first));
    if (result.ok() && !s.ok()) result = s;
    close(kv.second);
  }
  return result;
}

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

absl::Status CheckSecret(const RendezvousOptions& options) {
  if (options.secret.size() > kMaxSecretBytes) {
    return absl::InvalidArgumentError(absl::StrCat("rendezvous secret (", kSecretEnvVar,
                                                   ") is ", options.secret.size(),
                                                   " bytes, above the limit of ", kMaxSecretBytes));
  }
  return absl::OkStatus();
}

// What a peer reports when rank 0 refused its hello with `reason`.
absl::Status RejectedError(uint32_t reason, const std::string& where, int rank) {
  const std::string head = absl::StrCat("rendezvous: ", where, " rejected rank ", rank, ": ");
  switch (reason) {
    case kRejectSecret:
      return absl::PermissionDeniedError(absl::StrCat(
          head, "the shared secret does not match; set the same ", kSecretEnvVar,
          " (RendezvousOptions::secret) on every rank, or on none"));
    case kRejectWorld:
      return absl::UnavailableError(
          absl::StrCat(head, "its world size differs from rank 0's"));
    case kRejectRank:
      return absl::UnavailableError(absl::StrCat(head, "rank is outside rank 0's world"));
    case kRejectDuplicate:
      return absl::UnavailableError(absl::StrCat(head, "another peer already joined as rank ",
                                                 rank));
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

}  // namespace

absl::StatusOr<std::unique_ptr<RendezvousServer>> RendezvousServer::Listen(
    const std::string& addr, int port) {
  ASSIGN_OR_RETURN(sockaddr_in sa, Resolve(addr, port));
  const std::string where = absl::StrCat(addr, ":", port);
  Fd fd(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
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

absl::Status RendezvousServer::Serve(int world_size, absl::string_view payload,
                                     const RendezvousOptions& options) {
  if (world_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("rendezvous world_size ", world_size, " < 1"));
  }
  if (payload.size() > options.max_payload_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("rendezvous payload of ", payload.size(),
                                                   " bytes exceeds max_payload_bytes=",
                                                   options.max_payload_bytes));
  }
  RETURN_IF_ERROR(CheckSecret(options));
  if (fd_ < 0) return absl::FailedPreconditionError("rendezvous server already served");
  const absl::Time deadline = absl::Now() + absl::Milliseconds(options.timeout_ms);
  std::vector<PendingHello> pending;
  std::map<int, int> peers;  // rank -> fd, valid hellos
  // Bounds the connections a misbehaving client can hold open while we wait for real peers.
  const size_t max_pending = 2 * static_cast<size_t>(world_size) + 16;
  auto close_all = [&] {
    for (auto& p : pending) close(p.fd);
    for (auto& kv : peers) close(kv.second);
    close(fd_);
    fd_ = -1;
  };
  while (static_cast<int>(peers.size()) < world_size - 1) {
    std::vector<pollfd> fds;
    fds.push_back({fd_, POLLIN, 0});
    for (auto& p : pending) fds.push_back({p.fd, POLLIN, 0});
    const int ready = poll(fds.data(), fds.size(), RemainingMs(deadline));
    if (ready < 0 && errno != EINTR) {
      absl::Status s = Errno("poll", "server");
      close_all();
      return s;
    }
    if (ready == 0) {
      absl::Status s = MissingRanksError(port_, world_size, peers, options.timeout_ms);
      close_all();
      return s;
    }
    // Hellos first, so that a full set is recognised before accepting more.
    ReadHellos(fds, world_size, options.secret, pending, peers);
    if (static_cast<int>(peers.size()) >= world_size - 1) break;
    if (fds[0].revents & POLLIN) AcceptPending(fd_, max_pending, pending);
  }
  // Every peer is here: stop listening, so no further connection is accepted.
  for (auto& p : pending) close(p.fd);
  pending.clear();
  close(fd_);
  fd_ = -1;
  return SendPayload(peers, payload, deadline);
}

absl::StatusOr<std::string> RendezvousFetch(const std::string& addr, int port, int rank,
                                            int world_size, const RendezvousOptions& options) {
  if (world_size < 2 || rank < 1 || rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rendezvous fetch: rank ", rank,
                                                   " must be in [1, world_size=", world_size, ")"));
  }
  RETURN_IF_ERROR(CheckSecret(options));
  ASSIGN_OR_RETURN(sockaddr_in sa, Resolve(addr, port));
  const std::string where = absl::StrCat("rank 0 at ", addr, ":", port);
  const absl::Time deadline = absl::Now() + absl::Milliseconds(options.timeout_ms);
  ASSIGN_OR_RETURN(int fd, ConnectBefore(sa, deadline, rank, where, options.timeout_ms));
  Fd guard(fd);
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  std::string hello(kHelloBytes, '\0');
  Put32(&hello[0], kMagic);
  Put32(&hello[4], static_cast<uint32_t>(rank));
  Put32(&hello[8], static_cast<uint32_t>(world_size));
  Put32(&hello[12], static_cast<uint32_t>(options.secret.size()));
  hello += options.secret;
  RETURN_IF_ERROR(Transfer(fd, &hello[0], hello.size(), /*send=*/true, deadline, where));
  char header[kHeaderBytes];
  RETURN_IF_ERROR(Transfer(fd, header, sizeof header, /*send=*/false, deadline, where));
  if (Get32(header) == kRejectMagic) return RejectedError(Get32(header + 4), where, rank);
  if (Get32(header) != kMagic) {
    return absl::DataLossError(absl::StrCat("rendezvous: ", where, " sent a malformed reply"));
  }
  const uint32_t len = Get32(header + 4);
  if (len > options.max_payload_bytes) {
    return absl::DataLossError(absl::StrCat("rendezvous: ", where, " announced a payload of ",
                                            len, " bytes, above max_payload_bytes=",
                                            options.max_payload_bytes));
  }
  std::string payload(len, '\0');
  if (len > 0) {
    RETURN_IF_ERROR(Transfer(fd, &payload[0], len, /*send=*/false, deadline, where));
  }
  return payload;
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

}  // namespace

absl::StatusOr<std::string> Rendezvous(const LaunchInfo& info, absl::string_view payload,
                                       RendezvousOptions options) {
  if (info.world_size == 1) return std::string(payload);
  if (options.secret.empty()) {
    if (const char* s = std::getenv(kSecretEnvVar)) options.secret = s;
  }
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
