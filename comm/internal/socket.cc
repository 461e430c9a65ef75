#include "comm/internal/socket.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace zerort {
namespace comm {
namespace internal {
namespace {

// True for connect() failures that a later attempt may not see: nobody listening yet, or a
// network path that is still coming up.
bool Retryable(int err) {
  return err == ECONNREFUSED || err == ECONNRESET || err == ETIMEDOUT || err == EINTR ||
         err == ENETUNREACH || err == EHOSTUNREACH || err == ECONNABORTED;
}

// One non-blocking connect, waited for with poll until `deadline`: a peer that never answers
// (SYNs dropped) cannot hold us past it, as a blocking connect() would for minutes. Returns the
// connected (non-blocking) socket, or -1 with *err set; err == ETIMEDOUT at the deadline.
int ConnectOnce(const sockaddr_in& sa, absl::Time deadline, int* err) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    *err = errno;
    return -1;
  }
  int rc = connect(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof sa);
  *err = rc == 0 ? 0 : errno;
  while (*err == EINPROGRESS || *err == EINTR) {
    pollfd p{fd, POLLOUT, 0};
    rc = poll(&p, 1, RemainingMs(deadline));
    if (rc == 0) {
      *err = ETIMEDOUT;
    } else if (rc < 0) {
      *err = errno;
    } else {
      socklen_t len = sizeof *err;
      if (getsockopt(fd, SOL_SOCKET, SO_ERROR, err, &len) != 0) *err = errno;
    }
  }
  if (*err == 0) return fd;
  close(fd);
  return -1;
}

}  // namespace

int RemainingMs(absl::Time deadline) {
  const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
  return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(ms, 1 << 30)));
}

absl::Status Errno(absl::string_view what, const std::string& where) {
  return absl::UnavailableError(absl::StrCat("rendezvous ", what, " ", where, ": ",
                                             std::strerror(errno)));
}

absl::StatusOr<sockaddr_in> Resolve(const std::string& addr, int port) {
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("rendezvous port ", port, " out of range"));
  }
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(addr.c_str(), nullptr, &hints, &res);
  if (rc != 0 || res == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("rendezvous address '", addr, "' does not resolve: ", gai_strerror(rc)));
  }
  sockaddr_in sa;
  std::memcpy(&sa, res->ai_addr, sizeof sa);
  freeaddrinfo(res);
  sa.sin_port = htons(static_cast<uint16_t>(port));
  return sa;
}

absl::Status Transfer(int fd, char* buf, size_t n, bool send, absl::Time deadline,
                      const std::string& peer) {
  size_t done = 0;
  while (done < n) {
    pollfd p{fd, static_cast<short>(send ? POLLOUT : POLLIN), 0};
    const int ready = poll(&p, 1, RemainingMs(deadline));
    if (ready == 0) {
      return absl::DeadlineExceededError(
          absl::StrCat("rendezvous with ", peer, " timed out ", send ? "sending" : "receiving"));
    }
    if (ready < 0) {
      if (errno == EINTR) continue;
      return Errno("poll", peer);
    }
    const ssize_t k = send ? ::send(fd, buf + done, n - done, MSG_NOSIGNAL)
                           : ::recv(fd, buf + done, n - done, 0);
    if (k == 0) {
      return absl::UnavailableError(absl::StrCat(
          "rendezvous: ", peer, " closed the connection (hello rejected, or it failed)"));
    }
    if (k < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return Errno(send ? "send to" : "recv from", peer);
    }
    done += static_cast<size_t>(k);
  }
  return absl::OkStatus();
}

absl::StatusOr<int> ConnectBefore(const sockaddr_in& sa, absl::Time deadline, int rank,
                                  const std::string& where, int64_t timeout_ms) {
  for (;;) {
    int err = 0;
    const int fd = ConnectOnce(sa, deadline, &err);
    if (fd >= 0) return fd;
    if (!Retryable(err)) {
      errno = err;
      return Errno("connect to", where);
    }
    const int left = RemainingMs(deadline);
    if (left == 0) {
      return absl::DeadlineExceededError(absl::StrCat("rendezvous: rank ", rank, " could not reach ",
                                                      where, " within ", timeout_ms, " ms (",
                                                      std::strerror(err), ")"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(20, left)));
  }
}

}  // namespace internal
}  // namespace comm
}  // namespace zerort
