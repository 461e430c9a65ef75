// Rank 0's side of the rendezvous (comm/rendezvous.h): RendezvousServer::Serve. Connections
// are handled together with poll(), each with its own handshake deadline, so that silent,
// slow or unauthenticated clients cannot take the real peers' places or time.
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "base/sha256.h"
#include "base/status.h"
#include "comm/internal/rendezvous_wire.h"
#include "comm/internal/socket.h"
#include "comm/rendezvous.h"

namespace zerort {
namespace comm {
namespace {

using internal::Get32;
using internal::Put32;
using internal::Session;

// A connection that has not authenticated yet.
struct Pending {
  int fd = -1;
  std::string addr;  // the client's "ip:port", for messages
  absl::Time deadline;
  bool awaiting_proof = false;  // false: reading the hello; true: its answer to our challenge
  std::string in;               // bytes of the current message so far
  size_t want = internal::kHelloHeaderBytes;
  Session session;
};

// An authenticated peer, waiting for the payload.
struct Joined {
  int fd = -1;
  std::string addr;
  Session session;
};

// Connections dropped before they authenticated, by reason, for the timeout's message.
struct DropLog {
  int silent = 0, slow = 0, evicted = 0, malformed = 0, closed = 0, refused = 0;
  std::vector<std::string> auth_failures;  // "rank 2 from 127.0.0.1:41000 (why)"
  int total() const {
    return silent + slow + evicted + malformed + closed + refused +
           static_cast<int>(auth_failures.size());
  }
};

std::string PeerAddress(const sockaddr_in& sa) {
  char ip[INET_ADDRSTRLEN] = "?";
  inet_ntop(AF_INET, &sa.sin_addr, ip, sizeof ip);
  return absl::StrCat(ip, ":", ntohs(sa.sin_port));
}

std::string DropSummary(const DropLog& d, const RendezvousOptions& o) {
  if (d.total() == 0) return "no other connection arrived";
  std::vector<std::string> parts;
  auto add = [&](int n, absl::string_view what) {
    if (n > 0) parts.push_back(absl::StrCat(n, " ", what));
  };
  add(d.silent, absl::StrCat("silent past the ", o.handshake_timeout_ms, " ms handshake deadline"));
  add(d.slow, "with a handshake unfinished at that deadline");
  add(d.evicted, absl::StrCat("evicted to make room (", o.max_pending_connections,
                              " connections were pending)"));
  add(d.malformed, "not speaking this protocol");
  add(d.closed, "closed by the client mid-handshake");
  add(d.refused, "refused for a wrong world size, rank or job id");
  if (!d.auth_failures.empty()) {
    parts.push_back(absl::StrCat(d.auth_failures.size(), " failed authentication: ",
                                 absl::StrJoin(d.auth_failures, "; ")));
  }
  return absl::StrCat("dropped ", d.total(), " connections before they authenticated: ",
                      absl::StrJoin(parts, ", "));
}

// Serve()'s state: the pending handshakes and the peers admitted so far. Owns their sockets.
class ServeLoop {
 public:
  ServeLoop(int world_size, const RendezvousOptions& o, int port)
      : world_(world_size), o_(o), port_(port) {}
  ~ServeLoop() {
    for (auto& p : pending_) close(p.fd);
    for (auto& kv : joined_) close(kv.second.fd);
  }

  // Until every peer has authenticated (OK) or `deadline` (DeadlineExceeded naming the ranks
  // that never authenticated and what was dropped).
  absl::Status Run(int listen_fd, absl::Time deadline);
  // Sends each admitted peer the payload with its session's MAC, and closes it.
  absl::Status SendPayload(absl::string_view payload, absl::Time deadline);

 private:
  bool Complete() const { return static_cast<int>(joined_.size()) >= world_ - 1; }
  int NextWakeMs(absl::Time deadline) const;
  void ExpireHandshakes(absl::Time now);
  void AcceptAll(int listen_fd);
  void EvictOne();
  void OnReadable(Pending& p);
  void OnHello(Pending& p);
  void OnAnswer(Pending& p);
  uint32_t Judge(const Pending& p, uint32_t flags) const;
  void Refuse(Pending& p, uint32_t reason);
  void Drop(Pending& p, int* counter);
  absl::Status TimeoutError() const;

  const int world_;
  const RendezvousOptions& o_;
  const int port_;
  std::vector<Pending> pending_;    // in order of arrival; fd -1: closed, removed after a pass
  std::map<int, Joined> joined_;    // rank -> authenticated peer
  DropLog drops_;
  absl::Status fatal_;              // a failure of ours (no randomness), ends Run
};

int ServeLoop::NextWakeMs(absl::Time deadline) const {
  absl::Time wake = deadline;
  for (const auto& p : pending_) wake = std::min(wake, p.deadline);
  return internal::RemainingMs(wake);
}

void ServeLoop::Drop(Pending& p, int* counter) {
  if (counter != nullptr) ++*counter;
  close(p.fd);
  p.fd = -1;
}

void ServeLoop::ExpireHandshakes(absl::Time now) {
  for (auto& p : pending_) {
    if (p.fd < 0 || now < p.deadline) continue;
    Drop(p, p.in.empty() && !p.awaiting_proof ? &drops_.silent : &drops_.slow);
  }
}

// A full table makes room by closing the oldest connection that never spoke (a real peer
// sends its hello as soon as it connects), else the oldest of all. A dropped real peer
// reconnects, so a flood of connections delays the rendezvous but cannot end it.
void ServeLoop::EvictOne() {
  auto victim = std::find_if(pending_.begin(), pending_.end(), [](const Pending& p) {
    return p.fd >= 0 && p.in.empty() && !p.awaiting_proof;
  });
  if (victim == pending_.end()) {
    victim = std::find_if(pending_.begin(), pending_.end(),
                          [](const Pending& p) { return p.fd >= 0; });
  }
  if (victim == pending_.end()) return;
  Drop(*victim, &drops_.evicted);
  pending_.erase(victim);
}

void ServeLoop::AcceptAll(int listen_fd) {
  // Bounded, so that a flood cannot starve the handshakes already under way.
  for (int i = 0; i < 64; ++i) {
    sockaddr_in sa{};
    socklen_t len = sizeof sa;
    const int c = accept4(listen_fd, reinterpret_cast<sockaddr*>(&sa), &len,
                          SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (c < 0) return;  // EAGAIN: none left; anything else: retried on the next pass
    if (pending_.size() >= o_.max_pending_connections) EvictOne();
    Pending p;
    p.fd = c;
    p.addr = PeerAddress(sa);
    p.deadline = absl::Now() + absl::Milliseconds(o_.handshake_timeout_ms);
    pending_.push_back(std::move(p));
  }
}

void ServeLoop::OnReadable(Pending& p) {
  char buf[internal::kHelloHeaderBytes + internal::kMaxJobIdBytes];
  const ssize_t k = recv(p.fd, buf, p.want - p.in.size(), 0);
  if (k < 0 && (errno == EAGAIN || errno == EINTR)) return;
  if (k <= 0) return Drop(p, &drops_.closed);
  p.in.append(buf, static_cast<size_t>(k));
  if (p.awaiting_proof) {
    if (p.in.size() == p.want) OnAnswer(p);
    return;
  }
  if (p.in.size() == internal::kHelloHeaderBytes && p.want == internal::kHelloHeaderBytes) {
    const uint32_t job_len = Get32(&p.in[16]);
    if (Get32(&p.in[0]) != internal::kHelloMagic || job_len > internal::kMaxJobIdBytes) {
      return Drop(p, &drops_.malformed);  // not our protocol: no word back
    }
    p.want += job_len;
  }
  if (p.in.size() == p.want) OnHello(p);
}

uint32_t ServeLoop::Judge(const Pending& p, uint32_t flags) const {
  // Secret first: a client without it learns nothing about the job.
  if (((flags & internal::kHelloHasSecret) != 0) != !o_.secret.empty()) {
    return internal::kRejectSecret;
  }
  if (p.session.job_id != o_.job_id) return internal::kRejectJob;
  if (p.session.world_size != static_cast<uint32_t>(world_)) return internal::kRejectWorld;
  if (p.session.rank < 1 || p.session.rank >= p.session.world_size) return internal::kRejectRank;
  return 0;
}

void ServeLoop::Refuse(Pending& p, uint32_t reason) {
  std::string reply;
  Put32(&reply, internal::kRejectTag);
  Put32(&reply, reason);
  (void)!send(p.fd, reply.data(), reply.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  Drop(p, nullptr);
}

// A whole hello: judge it, then challenge the client with our nonce and our proof.
void ServeLoop::OnHello(Pending& p) {
  const char* h = p.in.data();
  p.session.rank = Get32(h + 4);
  p.session.world_size = Get32(h + 8);
  p.session.peer_nonce.assign(h + 20, internal::kNonceBytes);
  p.session.job_id = p.in.substr(internal::kHelloHeaderBytes);
  const uint32_t verdict = Judge(p, Get32(h + 12));
  if (verdict == internal::kRejectSecret) {
    drops_.auth_failures.push_back(absl::StrCat("rank ", p.session.rank, " from ", p.addr,
                                                " (one side has a secret, the other none)"));
  } else if (verdict != 0) {
    ++drops_.refused;
  }
  if (verdict != 0) return Refuse(p, verdict);
  absl::StatusOr<std::string> nonce = internal::FreshNonce();
  if (!nonce.ok()) {
    fatal_ = nonce.status();
    return Drop(p, nullptr);
  }
  p.session.rank0_nonce = *nonce;
  std::string msg;
  Put32(&msg, internal::kChallengeTag);
  msg += p.session.rank0_nonce;
  msg += internal::Rank0Proof(o_.secret, p.session);
  // A new socket's send buffer is empty, so the whole challenge fits; anything else is a
  // broken connection.
  if (send(p.fd, msg.data(), msg.size(), MSG_NOSIGNAL | MSG_DONTWAIT) !=
      static_cast<ssize_t>(msg.size())) {
    return Drop(p, &drops_.closed);
  }
  p.awaiting_proof = true;
  p.in.clear();
  p.want = internal::kAnswerBytes;
}

// The client's answer to our challenge: its proof, or its refusal of ours.
void ServeLoop::OnAnswer(Pending& p) {
  const uint32_t tag = Get32(p.in.data());
  const std::string who = absl::StrCat("rank ", p.session.rank, " from ", p.addr);
  if (tag == internal::kRejectTag) {
    drops_.auth_failures.push_back(
        absl::StrCat(who, " (rank 0's proof failed there: the secrets differ)"));
    return Drop(p, nullptr);
  }
  if (tag != internal::kProofTag) return Drop(p, &drops_.malformed);
  if (!ConstantTimeEqual(absl::string_view(p.in).substr(4),
                         internal::PeerProof(o_.secret, p.session))) {
    drops_.auth_failures.push_back(
        absl::StrCat(who, " (its proof of the shared secret was wrong)"));
    return Refuse(p, internal::kRejectSecret);
  }
  const int rank = static_cast<int>(p.session.rank);
  if (joined_.count(rank)) {
    ++drops_.refused;
    return Refuse(p, internal::kRejectDuplicate);
  }
  std::string ok;
  Put32(&ok, internal::kAcceptTag);
  if (send(p.fd, ok.data(), ok.size(), MSG_NOSIGNAL | MSG_DONTWAIT) != 4) {
    return Drop(p, &drops_.closed);
  }
  joined_[rank] = Joined{p.fd, p.addr, p.session};
  p.fd = -1;  // now owned by joined_
}

absl::Status ServeLoop::TimeoutError() const {
  std::vector<int> missing;
  for (int r = 1; r < world_; ++r) {
    if (!joined_.count(r)) missing.push_back(r);
  }
  return absl::DeadlineExceededError(absl::StrCat(
      "rendezvous on port ", port_, ": ranks [", absl::StrJoin(missing, ","), "] of ", world_,
      " never authenticated within ", o_.timeout_ms, " ms; ", DropSummary(drops_, o_)));
}

absl::Status ServeLoop::Run(int listen_fd, absl::Time deadline) {
  while (!Complete()) {
    ExpireHandshakes(absl::Now());
    pending_.erase(std::remove_if(pending_.begin(), pending_.end(),
                                  [](const Pending& p) { return p.fd < 0; }),
                   pending_.end());
    std::vector<pollfd> fds;
    fds.push_back({listen_fd, POLLIN, 0});
    for (const auto& p : pending_) fds.push_back({p.fd, POLLIN, 0});
    const int ready = poll(fds.data(), fds.size(), NextWakeMs(deadline));
    if (ready < 0 && errno != EINTR) return internal::Errno("poll", "server");
    for (size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents != 0 && pending_[i - 1].fd >= 0) OnReadable(pending_[i - 1]);
    }
    if (!fatal_.ok()) return fatal_;
    if (Complete()) break;
    if (internal::RemainingMs(deadline) == 0) return TimeoutError();
    if (fds[0].revents & POLLIN) AcceptAll(listen_fd);
  }
  return absl::OkStatus();
}

absl::Status ServeLoop::SendPayload(absl::string_view payload, absl::Time deadline) {
  absl::Status result;
  for (auto& kv : joined_) {
    Joined& j = kv.second;
    std::string msg;
    Put32(&msg, internal::kPayloadTag);
    Put32(&msg, static_cast<uint32_t>(payload.size()));
    msg.append(payload.data(), payload.size());
    msg += internal::PayloadMac(o_.secret, j.session, payload);
    absl::Status s = internal::Transfer(j.fd, &msg[0], msg.size(), /*send=*/true, deadline,
                                        absl::StrCat("rank ", kv.first, " at ", j.addr));
    if (result.ok() && !s.ok()) result = s;
    close(j.fd);
  }
  joined_.clear();
  return result;
}

}  // namespace

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
  RETURN_IF_ERROR(ValidateRendezvousOptions(options));
  if (fd_ < 0) return absl::FailedPreconditionError("rendezvous server already served");
  const absl::Time deadline = absl::Now() + absl::Milliseconds(options.timeout_ms);
  ServeLoop loop(world_size, options, port_);
  absl::Status s = loop.Run(fd_, deadline);
  // Done or given up: stop listening, so that no further connection is accepted.
  close(fd_);
  fd_ = -1;
  if (!s.ok()) return s;
  return loop.SendPayload(payload, deadline);
}

}  // namespace comm
}  // namespace zerort
