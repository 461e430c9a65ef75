#include "comm/rendezvous.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"

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

std::string Hello(uint32_t magic, uint32_t rank, uint32_t world) {
  std::string h(16, '\0');
  const uint32_t v[4] = {htonl(magic), htonl(rank), htonl(world), 0};
  std::memcpy(&h[0], v, 16);
  return h;
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
    listen_fd_ = socket(AF_INET, SOCK_STREAM, 0);
    const int one = 1;
    setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(static_cast<uint16_t>(port_));
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    REQUIRE(bind(listen_fd_, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0);
    REQUIRE(listen(listen_fd_, 16) == 0);
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
  std::thread rank0([&] { served = (*server)->Serve(world, "payload", Quick()); });
  CHECK(SendRawAndSeeClosed(port, "GET / HTTP/1.1\r\n\r\n"));          // not our protocol
  // Well-formed but refused: the peer is told why before the server closes.
  CHECK(SendRaw(port, Hello(0x5a525631, 7, world)) == Refusal(3));      // rank out of range
  CHECK(SendRaw(port, Hello(0x5a525631, 0, world)) == Refusal(3));      // rank 0 is the server
  CHECK(SendRaw(port, Hello(0x5a525631, 1, world + 1)) == Refusal(2));  // wrong world size
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
  const auto t0 = std::chrono::steady_clock::now();
  const absl::Status served = (*server)->Serve(3, "x", Quick(300));
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  t1.join();
  INFO(served.ToString());
  CHECK(served.code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(absl::StrContains(served.message(), "ranks [2] of 3"));
  CHECK(secs < 2.0);
  // Rank 1 sees the server close without a reply.
  CHECK(one.status().code() == absl::StatusCode::kUnavailable);

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

  // A rogue "server" announcing 1 GiB: the peer must refuse it without trying to read it.
  int lfd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
  REQUIRE(bind(lfd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0);
  REQUIRE(listen(lfd, 4) == 0);
  socklen_t len = sizeof sa;
  getsockname(lfd, reinterpret_cast<sockaddr*>(&sa), &len);
  std::thread rogue([&] {
    int c = accept(lfd, nullptr, nullptr);
    char hello[16];
    (void)!recv(c, hello, sizeof hello, MSG_WAITALL);
    const uint32_t header[2] = {htonl(0x5a525631), htonl(1u << 30)};
    (void)!send(c, header, sizeof header, MSG_NOSIGNAL);
    close(c);
  });
  auto got = RendezvousFetch("127.0.0.1", ntohs(sa.sin_port), 1, 2, small);
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

}  // namespace
}  // namespace comm
}  // namespace zerort
