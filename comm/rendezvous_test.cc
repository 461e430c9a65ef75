#include "comm/rendezvous.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "comm/internal/rendezvous_wire.h"

namespace zerort {
namespace comm {
namespace {

RendezvousOptions Quick(int64_t timeout_ms = 5000) {
  RendezvousOptions o;
  o.timeout_ms = timeout_ms;
  return o;
}

// A raw client that sends `bytes` and returns what the server sent before closing ("" when it
// closed without a reply); "<no connection>" when it could not connect.
std::string SendRaw(int port, const std::string& bytes) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
    close(fd);
    return "<no connection>";
  }
  (void)!send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  std::string reply;
  char buf[64];
  ssize_t k;
  while ((k = recv(fd, buf, sizeof buf, 0)) > 0) reply.append(buf, k);  // until the server closes
  close(fd);
  return reply;
}

bool SendRawAndSeeClosed(int port, const std::string& bytes) { return SendRaw(port, bytes).empty(); }

// The server's refusal of a well-formed hello: {"ZRXJ", reason}.
std::string Refusal(uint32_t reason) {
  std::string r(8, '\0');
  const uint32_t v[2] = {htonl(0x5a52584a), htonl(reason)};
  std::memcpy(&r[0], v, 8);
  return r;
}

// A well-formed hello without a secret (an all-zero nonce: rank 0 refuses it before using it).
std::string Hello(uint32_t rank, uint32_t world) {
  internal::Session s;
  s.rank = rank;
  s.world_size = world;
  s.peer_nonce.assign(internal::kNonceBytes, '\0');
  return internal::HelloMessage(s, /*has_secret=*/false);
}

// A LaunchInfo for `world` ranks on 127.0.0.1 at a port that was free a moment ago, with no
// server on it yet.
LaunchInfo LocalLaunch(int world) {
  int port;
  {
    auto probe = RendezvousServer::Listen("127.0.0.1", 0);
    REQUIRE(probe.ok());
    port = (*probe)->port();
  }
  LaunchInfo info;
  info.world_size = world;
  info.master_addr = "127.0.0.1";
  info.master_port = port;
  return info;
}

// A listening socket on 127.0.0.1:`port` (0: any), as an impostor would bind MASTER_PORT.
int ListenAt(int port) {
  const int lfd = socket(AF_INET, SOCK_STREAM, 0);
  const int one = 1;
  setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  REQUIRE(bind(lfd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0);
  REQUIRE(listen(lfd, 16) == 0);
  return lfd;
}

int PortOf(int fd) {
  sockaddr_in sa{};
  socklen_t len = sizeof sa;
  getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  return ntohs(sa.sin_port);
}

// A blocking connection to 127.0.0.1:port; -1 when refused.
int ConnectTo(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

bool ReadExactly(int fd, std::string* out, size_t n) {
  std::string buf(n, '\0');
  size_t got = 0;
  while (got < n) {
    const ssize_t k = recv(fd, &buf[got], n - got, 0);
    if (k <= 0) return false;
    got += static_cast<size_t>(k);
  }
  out->append(buf);
  return true;
}

std::string PayloadHeader(uint32_t len) {
  std::string h;
  internal::Put32(&h, internal::kPayloadTag);
  internal::Put32(&h, len);
  return h;
}

// Rank 0's side of the handshake on an accepted connection, keyed with `key`: the real
// protocol in the hands of a process that may not know the secret. Records every byte the
// peer sends.
class FakeRank0 {
 public:
  FakeRank0(int fd, std::string key) : fd_(fd), key_(std::move(key)) {}
  // Hello in, challenge out, answer in; then admits the peer. False when the peer stopped.
  bool Handshake() {
    if (!ReadExactly(fd_, &received_, internal::kHelloHeaderBytes)) return false;
    session_.rank = internal::Get32(&received_[4]);
    session_.world_size = internal::Get32(&received_[8]);
    session_.peer_nonce = received_.substr(20, internal::kNonceBytes);
    if (!ReadExactly(fd_, &received_, internal::Get32(&received_[16]))) return false;
    session_.job_id = received_.substr(internal::kHelloHeaderBytes);
    session_.rank0_nonce.assign(internal::kNonceBytes, '\x5a');
    std::string challenge;
    internal::Put32(&challenge, internal::kChallengeTag);
    challenge += session_.rank0_nonce + internal::Rank0Proof(key_, session_);
    SendRaw(challenge);
    const size_t before = received_.size();
    if (!ReadExactly(fd_, &received_, internal::kAnswerBytes)) return false;
    answer_tag_ = internal::Get32(&received_[before]);
    std::string ok;
    internal::Put32(&ok, internal::kAcceptTag);
    SendRaw(ok);
    return true;
  }
  // A payload with a MAC under our key for this session.
  void SendPayload(const std::string& payload) {
    SendRaw(PayloadHeader(static_cast<uint32_t>(payload.size())) + payload +
            internal::PayloadMac(key_, session_, payload));
  }
  void SendRaw(const std::string& bytes) {
    (void)!send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  }
  const std::string& received() const { return received_; }
  uint32_t answer_tag() const { return answer_tag_; }

 private:
  int fd_;
  std::string key_;
  internal::Session session_;
  std::string received_;
  uint32_t answer_tag_ = 0;
};

// A stand-in for torchrun's TCPStore, written from torch's TCPStoreBackend.hpp: per connection,
// VALIDATE (query 0, uint32 magic) must come first; then SET (1: key, value), GET (3: key ->
// value) and CHECK (5: uint64 count, keys -> 0 ready / 1 not ready). Strings are a host-order
// uint64 length and the bytes. Records every key SET, in order.
class FakeTorchStore {
 public:
  FakeTorchStore() {
    auto probe = RendezvousServer::Listen("127.0.0.1", 0);  // only to find a free port
    REQUIRE(probe.ok());
    port_ = (*probe)->port();
    probe->reset();
    listen_fd_ = ListenAt(port_);
    acceptor_ = std::thread([this] {
      for (;;) {
        const int c = accept(listen_fd_, nullptr, nullptr);
        if (c < 0) return;  // shut down
        std::lock_guard<std::mutex> l(mu_);
        fds_.push_back(c);
        clients_.emplace_back([this, c] { Serve(c); });
      }
    });
  }
  ~FakeTorchStore() {
    shutdown(listen_fd_, SHUT_RDWR);
    acceptor_.join();
    close(listen_fd_);
    std::lock_guard<std::mutex> l(mu_);
    for (int fd : fds_) shutdown(fd, SHUT_RDWR);
    for (auto& t : clients_) t.join();
    for (int fd : fds_) close(fd);
  }
  int port() const { return port_; }
  std::vector<std::string> keys_set() {
    std::lock_guard<std::mutex> l(mu_);
    return keys_set_;
  }
  int bad_validations() {
    std::lock_guard<std::mutex> l(mu_);
    return bad_validations_;
  }

 private:
  static bool ReadAll(int fd, void* p, size_t n) {
    char* b = static_cast<char*>(p);
    while (n > 0) {
      const ssize_t k = recv(fd, b, n, 0);
      if (k <= 0) return false;
      b += k;
      n -= static_cast<size_t>(k);
    }
    return true;
  }
  static bool ReadString(int fd, std::string* s) {
    uint64_t n = 0;
    if (!ReadAll(fd, &n, sizeof n) || n > 4096) return false;
    s->assign(n, '\0');
    return n == 0 || ReadAll(fd, &(*s)[0], n);
  }
  void Serve(int fd) {
    uint8_t q = 0;
    uint32_t magic = 0;
    if (!ReadAll(fd, &q, 1) || !ReadAll(fd, &magic, 4) || q != 0 || magic != 0x3C85F7CE) {
      std::lock_guard<std::mutex> l(mu_);
      ++bad_validations_;
      return;
    }
    while (ReadAll(fd, &q, 1)) {
      std::string key, value;
      if (q == 1 && ReadString(fd, &key) && ReadString(fd, &value)) {
        std::lock_guard<std::mutex> l(mu_);
        data_[key] = value;
        keys_set_.push_back(key);
      } else if (q == 3 && ReadString(fd, &key)) {
        std::string reply;
        {
          std::lock_guard<std::mutex> l(mu_);
          value = data_[key];
        }
        const uint64_t n = value.size();
        reply.append(reinterpret_cast<const char*>(&n), sizeof n);
        reply += value;
        (void)!send(fd, reply.data(), reply.size(), MSG_NOSIGNAL);
      } else if (q == 5) {
        uint64_t count = 0;
        bool all = ReadAll(fd, &count, sizeof count);
        for (uint64_t i = 0; all && i < count; ++i) {
          all = ReadString(fd, &key);
          std::lock_guard<std::mutex> l(mu_);
          all = all && data_.count(key) > 0;
        }
        const uint8_t ready = all ? 0 : 1;
        (void)!send(fd, &ready, 1, MSG_NOSIGNAL);
      } else {
        return;
      }
    }
  }

  int port_ = 0;
  int listen_fd_ = -1;
  std::thread acceptor_;
  std::mutex mu_;
  std::vector<int> fds_;
  std::vector<std::thread> clients_;
  std::map<std::string, std::string> data_;
  std::vector<std::string> keys_set_;
  int bad_validations_ = 0;
};

LaunchInfo TorchLaunch(const FakeTorchStore& store, int world, int rank, const char* key) {
  LaunchInfo info;
  info.world_size = world;
  info.rank = rank;
  info.master_addr = "127.0.0.1";
  info.master_port = store.port();
  info.master_is_torch_store = true;
  info.store_key = key;
  return info;
}

TEST_CASE("Rendezvous: through torchrun's store, rank 0 publishes a free port", "[comm]") {
  FakeTorchStore store;
  // Two rendezvous in one attempt, then one after a restart (a new key prefix).
  for (const char* run : {"runA/0", "runA/0", "runA/1"}) {
    std::vector<absl::StatusOr<std::string>> got(3);
    std::vector<std::thread> peers;
    for (int r = 1; r < 3; ++r) {
      peers.emplace_back(
          [&, r] { got[r] = Rendezvous(TorchLaunch(store, 3, r, run), "", Quick()); });
    }
    got[0] = Rendezvous(TorchLaunch(store, 3, 0, run), "the-id", Quick());
    for (auto& t : peers) t.join();
    for (int r = 0; r < 3; ++r) {
      INFO("rank " << r << ": " << got[r].status());
      REQUIRE(got[r].ok());
      CHECK(*got[r] == "the-id");
    }
  }
  const std::vector<std::string> keys = store.keys_set();
  CHECK(keys == std::vector<std::string>{"runA/0/0", "runA/0/1", "runA/1/0"});
  CHECK(store.bad_validations() == 0);
}

TEST_CASE("Rendezvous: through torchrun's store, a missing rank 0 times out naming the key",
          "[comm]") {
  FakeTorchStore store;
  auto got = Rendezvous(TorchLaunch(store, 2, 1, "lonely/0"), "", Quick(300));
  REQUIRE(got.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(absl::StrContains(got.status().message(), "lonely/0/"));
  CHECK(absl::StrContains(got.status().message(), "torchrun's store at 127.0.0.1:"));
  // No store at all: the connect retries until the deadline.
  LaunchInfo none = TorchLaunch(store, 2, 1, "x/0");
  none.master_port = LocalLaunch(2).master_port;
  CHECK(Rendezvous(none, "", Quick(300)).status().code() == absl::StatusCode::kDeadlineExceeded);
}

TEST_CASE("Rendezvous: every peer receives rank 0's payload byte for byte", "[comm]") {
  const int world = 5;
  auto server = RendezvousServer::Listen("127.0.0.1", 0);
  REQUIRE(server.ok());
  const int port = (*server)->port();
  REQUIRE(port > 0);
  std::string payload(128, '\0');  // the size of an ncclUniqueId, zero bytes included
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<char>(i * 37);
  std::vector<absl::StatusOr<std::string>> got(world, std::string());
  std::vector<std::thread> peers;
  for (int r = 1; r < world; ++r) {
    peers.emplace_back([&, r] { got[r] = RendezvousFetch("127.0.0.1", port, r, world, Quick()); });
  }
  const absl::Status served = (*server)->Serve(world, payload, Quick());
  for (auto& t : peers) t.join();
  REQUIRE(served.ok());
  for (int r = 1; r < world; ++r) {
    REQUIRE(got[r].ok());
    CHECK(*got[r] == payload);
  }
}

TEST_CASE("Rendezvous: peers that connect before rank 0 listens are retried", "[comm]") {
  // A free port, released; then the peers start first.
  const LaunchInfo info = LocalLaunch(3);
  std::vector<absl::StatusOr<std::string>> got(3, std::string());
  std::vector<std::thread> threads;
  for (int r = 2; r >= 0; --r) {
    threads.emplace_back([&, r] {
      LaunchInfo mine = info;
      mine.rank = r;
      if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(200));
      got[r] = Rendezvous(mine, r == 0 ? "unique-id" : "", Quick());
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 3; ++r) {
    INFO(got[r].status().ToString());
    REQUIRE(got[r].ok());
    CHECK(*got[r] == "unique-id");
  }
}

TEST_CASE("Rendezvous: malformed, out-of-range and duplicate hellos are rejected", "[comm]") {
  const int world = 3;
  auto server = RendezvousServer::Listen("127.0.0.1", 0);
  REQUIRE(server.ok());
  const int port = (*server)->port();
  absl::Status served;
  RendezvousOptions o = Quick();
  o.handshake_timeout_ms = 300;  // the short request below is dropped at this deadline
  std::thread rank0([&] { served = (*server)->Serve(world, "payload", o); });
  CHECK(SendRawAndSeeClosed(port, "GET / HTTP/1.1\r\n\r\n"));          // not our protocol
  // Well-formed but refused: the peer is told why before the server closes.
  CHECK(SendRawAndSeeClosed(port, std::string(60, 'x')));             // a wrong magic
  CHECK(SendRaw(port, Hello(7, world)) == Refusal(3));                 // rank out of range
  CHECK(SendRaw(port, Hello(0, world)) == Refusal(3));                 // rank 0 is the server
  CHECK(SendRaw(port, Hello(1, world + 1)) == Refusal(2));             // wrong world size
  absl::StatusOr<std::string> one, dup, two;
  std::thread t1([&] { one = RendezvousFetch("127.0.0.1", port, 1, world, Quick()); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // rank 1's hello registered
  dup = RendezvousFetch("127.0.0.1", port, 1, world, Quick());  // a second "rank 1"
  CHECK(dup.status().code() == absl::StatusCode::kUnavailable);
  CHECK(absl::StrContains(dup.status().message(), "already joined as rank 1"));
  two = RendezvousFetch("127.0.0.1", port, 2, world, Quick());
  t1.join();
  rank0.join();
  REQUIRE(served.ok());
  REQUIRE(one.ok());
  REQUIRE(two.ok());
  CHECK(*one == "payload");
  CHECK(*two == "payload");
  // Served: the server stops listening, so a late extra peer cannot connect at all.
  auto late = RendezvousFetch("127.0.0.1", port, 2, world, Quick(200));
  CHECK(late.status().code() == absl::StatusCode::kDeadlineExceeded);
}

TEST_CASE("Rendezvous: a missing peer or a missing server times out", "[comm]") {
  auto server = RendezvousServer::Listen("127.0.0.1", 0);
  REQUIRE(server.ok());
  const int port = (*server)->port();
  absl::StatusOr<std::string> one;
  std::thread t1([&] { one = RendezvousFetch("127.0.0.1", port, 1, 3, Quick(3000)); });
  const absl::Status served = (*server)->Serve(3, "x", Quick(1000));
  t1.join();
  INFO(served.ToString());
  CHECK(served.code() == absl::StatusCode::kDeadlineExceeded);
  // Rank 2 never came (rank 1 did, unless the machine was too busy to let it in time).
  CHECK(absl::StrContains(served.message(), "2] of 3 never authenticated within 1000 ms"));
  // Rank 1 sees the server close without a payload (after admission, or its retries fail).
  CHECK(!one.ok());

  auto nobody = RendezvousFetch("127.0.0.1", port, 1, 2, Quick(300));
  CHECK(nobody.status().code() == absl::StatusCode::kDeadlineExceeded);
}

TEST_CASE("Rendezvous: oversized payloads are refused on both sides", "[comm]") {
  RendezvousOptions small = Quick();
  small.max_payload_bytes = 16;
  auto server = RendezvousServer::Listen("127.0.0.1", 0);
  REQUIRE(server.ok());
  CHECK((*server)->Serve(2, std::string(17, 'a'), small).code() ==
        absl::StatusCode::kInvalidArgument);

  // A rogue rank 0 announcing 1 GiB after a correct handshake (no secret): the peer must
  // refuse it without trying to read it.
  const int lfd = ListenAt(0);
  std::thread rogue([&] {
    const int c = accept(lfd, nullptr, nullptr);
    FakeRank0 fake(c, "");
    if (fake.Handshake()) fake.SendRaw(PayloadHeader(1u << 30));
    close(c);
  });
  auto got = RendezvousFetch("127.0.0.1", PortOf(lfd), 1, 2, small);
  rogue.join();
  close(lfd);
  INFO(got.status().ToString());
  CHECK(got.status().code() == absl::StatusCode::kDataLoss);
  CHECK(absl::StrContains(got.status().message(), "max_payload_bytes=16"));
}

TEST_CASE("Rendezvous: bad addresses and missing MASTER_ADDR are argument errors", "[comm]") {
  CHECK(RendezvousServer::Listen("no.such.host.invalid", 0).status().code() ==
        absl::StatusCode::kInvalidArgument);
  LaunchInfo info;
  info.rank = 1;
  info.world_size = 2;
  CHECK(Rendezvous(info, "", Quick()).status().code() == absl::StatusCode::kInvalidArgument);
  info.world_size = 1;
  info.rank = 0;
  auto solo = Rendezvous(info, "id", Quick());
  REQUIRE(solo.ok());
  CHECK(*solo == "id");
}

// The reported hang: a blocking connect() to an address whose SYNs go unanswered waited for the
// kernel's SYN retries (minutes), far past the 2 s timeout. A listener whose accept queue is
// full drops SYNs the same way.
TEST_CASE("Rendezvous: an address that accepts nothing times out at the deadline", "[comm]") {
  int lfd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  REQUIRE(bind(lfd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0);
  REQUIRE(listen(lfd, 0) == 0);  // never accepted: the queue fills at once
  socklen_t len = sizeof sa;
  getsockname(lfd, reinterpret_cast<sockaddr*>(&sa), &len);
  std::vector<int> fillers;
  for (int i = 0; i < 8; ++i) {
    fillers.push_back(socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0));
    (void)!connect(fillers.back(), reinterpret_cast<sockaddr*>(&sa), sizeof sa);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const auto t0 = std::chrono::steady_clock::now();
  auto got = RendezvousFetch("127.0.0.1", ntohs(sa.sin_port), 1, 2, Quick(1000));
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int fd : fillers) close(fd);
  close(lfd);
  INFO(got.status().ToString());
  // The connect itself must give up at the deadline. The bound is loose (a loaded machine), yet
  // far below the minutes a blocking connect takes.
  CHECK(got.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(absl::StrContains(got.status().message(), "could not reach"));
  CHECK(secs < 30.0);
}

TEST_CASE("Rendezvous: with a shared secret only peers that know it join", "[comm]") {
  const int world = 3;
  RendezvousOptions with = Quick(), wrong = Quick(), none = Quick();
  with.secret = "s3cret-token";
  wrong.secret = "s3cret-tokeX";
  auto server = RendezvousServer::Listen("127.0.0.1", 0);
  REQUIRE(server.ok());
  const int port = (*server)->port();
  absl::Status served;
  std::thread rank0([&] { served = (*server)->Serve(world, "payload", with); });
  for (const RendezvousOptions* o : {&wrong, &none}) {
    auto refused = RendezvousFetch("127.0.0.1", port, 1, world, *o);
    INFO(refused.status().ToString());
    CHECK(refused.status().code() == absl::StatusCode::kPermissionDenied);
    CHECK(absl::StrContains(refused.status().message(), "ZERORT_RENDEZVOUS_SECRET"));
    CHECK(!absl::StrContains(refused.status().message(), "s3cret"));
  }
  // The refused attempts took no rank: the real peers still join, all at once.
  std::vector<absl::StatusOr<std::string>> got(world, std::string());
  std::vector<std::thread> peers;
  for (int r = 1; r < world; ++r) {
    peers.emplace_back([&, r] { got[r] = RendezvousFetch("127.0.0.1", port, r, world, with); });
  }
  for (auto& t : peers) t.join();
  rank0.join();
  REQUIRE(served.ok());
  for (int r = 1; r < world; ++r) CHECK(got[r].value_or("") == "payload");

  // A peer with a secret is refused by a server without one, too.
  auto open_server = RendezvousServer::Listen("127.0.0.1", 0);
  REQUIRE(open_server.ok());
  const int open_port = (*open_server)->port();
  absl::Status open_served;
  std::thread open0([&] { open_served = (*open_server)->Serve(2, "p", Quick(1500)); });
  auto extra = RendezvousFetch("127.0.0.1", open_port, 1, 2, with);
  open0.join();
  CHECK(extra.status().code() == absl::StatusCode::kPermissionDenied);
  CHECK(open_served.code() == absl::StatusCode::kDeadlineExceeded);

  RendezvousOptions huge = Quick();
  huge.secret.assign(257, 'x');
  CHECK(RendezvousFetch("127.0.0.1", port, 1, 2, huge).status().code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("Rendezvous: Rendezvous() takes the secret from ZERORT_RENDEZVOUS_SECRET", "[comm]") {
  const LaunchInfo info = LocalLaunch(2);
  REQUIRE(setenv("ZERORT_RENDEZVOUS_SECRET", "from-env", 1) == 0);
  absl::StatusOr<std::string> peer;
  std::thread t([&] {
    // Explicit and wrong: the environment does not override it.
    RendezvousOptions o = Quick(2000);
    o.secret = "other";
    LaunchInfo mine = info;
    mine.rank = 1;
    peer = Rendezvous(mine, "", o);
  });
  LaunchInfo zero = info;
  auto served = Rendezvous(zero, "id", Quick(2000));  // secret from the environment
  t.join();
  unsetenv("ZERORT_RENDEZVOUS_SECRET");
  CHECK(peer.status().code() == absl::StatusCode::kPermissionDenied);
  CHECK(served.status().code() == absl::StatusCode::kDeadlineExceeded);
}


// The reported attack: a process bound MASTER_PORT before rank 0, received the secret in clear
// text from the peer and handed it a forged payload, which the peer accepted (exit 0).
TEST_CASE("Rendezvous: an impostor on MASTER_PORT learns nothing of the secret and its payload "
          "is refused", "[comm][security]") {
  const std::string secret = "job-secret-1234";
  LaunchInfo info = LocalLaunch(2);
  const int lfd = ListenAt(info.master_port);  // first on the port
  std::string seen;
  uint32_t answer = 0;
  std::thread impostor([&] {
    const int c = accept(lfd, nullptr, nullptr);
    FakeRank0 fake(c, "a-guess");
    if (fake.Handshake()) fake.SendPayload("forged-nccl-id");
    seen = fake.received();
    answer = fake.answer_tag();
    close(c);
  });
  RendezvousOptions o = Quick();
  o.secret = secret;
  info.rank = 1;
  auto got = Rendezvous(info, "", o);
  impostor.join();
  close(lfd);
  INFO("peer: " << (got.ok() ? "accepted '" + *got + "'" : got.status().ToString()));
  REQUIRE(!got.ok());
  CHECK(got.status().code() == absl::StatusCode::kPermissionDenied);
  CHECK(absl::StrContains(got.status().message(),
                          absl::StrCat("rank 0 at 127.0.0.1:", info.master_port)));
  CHECK(absl::StrContains(got.status().message(), "did not prove it knows the shared secret"));
  // What the impostor saw: the hello and a refusal, never the secret nor a proof of the peer's.
  CHECK(!seen.empty());
  CHECK(!absl::StrContains(seen, secret));
  CHECK(answer == internal::kRejectTag);

  // The same impostor against a peer with no secret: the handshake is all it needs, as the
  // header says (nothing is protected then).
  const int lfd2 = ListenAt(0);
  std::thread open_impostor([&] {
    const int c = accept(lfd2, nullptr, nullptr);
    FakeRank0 fake(c, "");
    if (fake.Handshake()) fake.SendPayload("forged-nccl-id");
    close(c);
  });
  auto open_got = RendezvousFetch("127.0.0.1", PortOf(lfd2), 1, 2, Quick());
  open_impostor.join();
  close(lfd2);
  CHECK(open_got.value_or("") == "forged-nccl-id");
}

// A relay in front of `upstream` (a real rank 0): forwards the handshake both ways, so that
// both proofs are genuine, then answers the peer with `replace(what rank 0 sent after the
// handshake)` instead. Returns what rank 0 sent after the handshake.
std::string RelayOnce(int lfd, int upstream,
                      const std::function<std::string(std::string)>& replace) {
  const int c = accept(lfd, nullptr, nullptr);
  const int u = ConnectTo(upstream);
  REQUIRE(u >= 0);
  // Relayed in lock step: hello, challenge, answer, admission.
  std::string hello, challenge, answer, ok, rest;
  REQUIRE(ReadExactly(c, &hello, internal::kHelloHeaderBytes));
  REQUIRE(ReadExactly(c, &hello, internal::Get32(&hello[16])));
  (void)!send(u, hello.data(), hello.size(), MSG_NOSIGNAL);
  REQUIRE(ReadExactly(u, &challenge, internal::kChallengeBytes));
  (void)!send(c, challenge.data(), challenge.size(), MSG_NOSIGNAL);
  REQUIRE(ReadExactly(c, &answer, internal::kAnswerBytes));
  (void)!send(u, answer.data(), answer.size(), MSG_NOSIGNAL);
  REQUIRE(ReadExactly(u, &ok, 4));
  (void)!send(c, ok.data(), ok.size(), MSG_NOSIGNAL);
  char buf[256];
  ssize_t k;
  while ((k = recv(u, buf, sizeof buf, 0)) > 0) rest.append(buf, k);  // until rank 0 closes
  const std::string sent = replace(rest);
  (void)!send(c, sent.data(), sent.size(), MSG_NOSIGNAL);
  close(u);
  close(c);
  return rest;
}

TEST_CASE("Rendezvous: a relay replaying an old session's payload, or altering one, is refused",
          "[comm][security]") {
  for (const std::string secret : {"relay-secret", ""}) {
    INFO("secret '" << secret << "'");
    RendezvousOptions o = Quick();
    o.secret = secret;
    const int lfd = ListenAt(0);
    const int relay_port = PortOf(lfd);
    // One rendezvous through the relay, which rank `1` fetches; the relay applies `replace`.
    auto session = [&](const std::string& payload,
                       const std::function<std::string(std::string)>& replace,
                       std::string* recorded) {
      auto server = RendezvousServer::Listen("127.0.0.1", 0);
      REQUIRE(server.ok());
      absl::Status served;
      std::thread rank0([&] { served = (*server)->Serve(2, payload, o); });
      std::thread relay([&] { *recorded = RelayOnce(lfd, (*server)->port(), replace); });
      auto got = RendezvousFetch("127.0.0.1", relay_port, 1, 2, o);
      relay.join();
      rank0.join();
      CHECK(served.ok());
      return got;
    };
    std::string old_session, unused;
    auto first = session("nccl-id-session-1", [](std::string b) { return b; }, &old_session);
    REQUIRE(first.value_or("") == "nccl-id-session-1");  // a faithful relay is harmless

    auto replayed = session("nccl-id-session-2", [&](std::string) { return old_session; },
                            &unused);
    INFO("replayed: " << (replayed.ok() ? *replayed : replayed.status().ToString()));
    CHECK(replayed.status().code() == absl::StatusCode::kPermissionDenied);
    CHECK(absl::StrContains(replayed.status().message(),
                            absl::StrCat("rank 0 at 127.0.0.1:", relay_port)));
    CHECK(absl::StrContains(replayed.status().message(), "replayed"));

    auto altered = session("nccl-id-session-3",
                           [](std::string b) {
                             b[10] ^= 1;  // one bit of the payload itself
                             return b;
                           },
                           &unused);
    CHECK(altered.status().code() == absl::StatusCode::kPermissionDenied);
    close(lfd);
  }
}

// The reported denial of service: the pending limit plus one idle connections made the real
// peers fail at once, and rank 0 then blamed them for not arriving.
TEST_CASE("Rendezvous: idle sockets and stalled handshakes do not stop a world-4 rendezvous",
          "[comm][security]") {
  const int world = 4;
  for (const std::string secret : {"dos-secret", ""}) {
    INFO("secret '" << secret << "'");
    LaunchInfo info = LocalLaunch(world);
    RendezvousOptions o = Quick(120000);  // only bounds a hang
    o.secret = secret;
    o.handshake_timeout_ms = 400;  // short, so that the attackers' connections turn over
    std::vector<absl::StatusOr<std::string>> got(world, std::string());
    std::thread rank0([&] { got[0] = Rendezvous(info, "the-real-id", o); });
    std::vector<int> attackers;
    auto attacker = [&]() {
      int fd = -1;
      while ((fd = ConnectTo(info.master_port)) < 0) {  // until rank 0 listens
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      attackers.push_back(fd);
      return fd;
    };
    for (size_t i = 0; i < o.max_pending_connections + 1; ++i) attacker();  // silent
    for (int i = 0; i < 4; ++i) {  // half a hello, then nothing
      const std::string h = Hello(1, world);
      (void)!send(attacker(), h.data(), h.size() / 2, MSG_NOSIGNAL);
    }
    // A whole hello claiming rank 1, then silence: its rank must stay free for the real one.
    const std::string claim = Hello(1, world);
    (void)!send(attacker(), claim.data(), claim.size(), MSG_NOSIGNAL);
    std::vector<std::thread> peers;
    for (int r = 1; r < world; ++r) {
      peers.emplace_back([&, r] {
        LaunchInfo mine = info;
        mine.rank = r;
        got[r] = Rendezvous(mine, "", o);
      });
    }
    for (auto& t : peers) t.join();
    rank0.join();
    for (int fd : attackers) close(fd);
    for (int r = 0; r < world; ++r) {
      INFO("rank " << r << ": " << got[r].status());
      CHECK(got[r].value_or("") == "the-real-id");
    }
  }
}

TEST_CASE("Rendezvous: a wrong secret on one peer is named on that peer and by rank 0",
          "[comm][security]") {
  const int world = 3;
  LaunchInfo info = LocalLaunch(world);
  RendezvousOptions good = Quick(4000), bad = Quick(60000);
  good.secret = "right-secret";
  good.handshake_timeout_ms = 500;
  bad.secret = "wrong-secret";
  std::vector<absl::StatusOr<std::string>> got(world, std::string());
  std::thread rank0([&] { got[0] = Rendezvous(info, "id", good); });
  int idle = -1;
  while ((idle = ConnectTo(info.master_port)) < 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::vector<std::thread> peers;
  for (int r = 1; r < world; ++r) {
    peers.emplace_back([&, r] {
      LaunchInfo mine = info;
      mine.rank = r;
      RendezvousOptions o = r == 2 ? bad : good;
      o.timeout_ms = 60000;
      got[r] = Rendezvous(mine, "", o);
    });
  }
  for (auto& t : peers) t.join();
  rank0.join();
  close(idle);
  INFO("rank 0: " << got[0].status() << "\nrank 2: " << got[2].status());
  CHECK(got[2].status().code() == absl::StatusCode::kPermissionDenied);
  CHECK(absl::StrContains(got[2].status().message(), "rank 2:"));
  CHECK(absl::StrContains(got[2].status().message(), "ZERORT_RENDEZVOUS_SECRET"));
  CHECK(!absl::StrContains(got[2].status().message(), "wrong-secret"));
  CHECK(got[0].status().code() == absl::StatusCode::kDeadlineExceeded);
  const std::string m(got[0].status().message());
  CHECK(absl::StrContains(m, "2] of 3 never authenticated"));
  CHECK(absl::StrContains(m, "1 failed authentication: rank 2 from 127.0.0.1:"));
  CHECK(absl::StrContains(m, "1 silent past the 500 ms handshake deadline"));
  CHECK(!absl::StrContains(m, "right-secret"));
  CHECK(!absl::StrContains(m, "wrong-secret"));
}

TEST_CASE("Rendezvous: peers and rank 0 of different jobs do not meet", "[comm][security]") {
  RendezvousOptions mine = Quick(1500), other = Quick(1500);
  mine.job_id = "slurm:41";
  other.job_id = "slurm:10041";  // the same derived port, modulo 10000
  auto server = RendezvousServer::Listen("127.0.0.1", 0);
  REQUIRE(server.ok());
  absl::Status served;
  std::thread rank0([&] { served = (*server)->Serve(2, "p", mine); });
  auto got = RendezvousFetch("127.0.0.1", (*server)->port(), 1, 2, other);
  rank0.join();
  CHECK(got.status().code() == absl::StatusCode::kUnavailable);
  CHECK(absl::StrContains(got.status().message(), "job id differs"));
  CHECK(absl::StrContains(served.message(), "1 refused for a wrong world size, rank or job id"));
}

TEST_CASE("Rendezvous: options out of range are argument errors naming the field", "[comm]") {
  RendezvousOptions o = Quick();
  o.handshake_timeout_ms = 0;
  CHECK(absl::StrContains(ValidateRendezvousOptions(o).message(), "handshake_timeout_ms=0"));
  o = Quick();
  o.max_pending_connections = 0;
  CHECK(absl::StrContains(ValidateRendezvousOptions(o).message(), "max_pending_connections"));
  o = Quick();
  o.job_id.assign(257, 'j');
  CHECK(absl::StrContains(ValidateRendezvousOptions(o).message(), "job_id"));
  o = Quick(0);
  CHECK(absl::StrContains(ValidateRendezvousOptions(o).message(), "timeout_ms=0"));
  CHECK(ValidateRendezvousOptions(Quick()).ok());
}

}  // namespace
}  // namespace comm
}  // namespace zerort
