#include "comm/internal/torch_store.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "comm/internal/socket.h"

namespace zerort {
namespace comm {
namespace internal {
namespace {

enum TorchQuery : uint8_t { kTorchValidate = 0, kTorchSet = 1, kTorchGet = 3, kTorchCheck = 5 };
constexpr uint32_t kTorchValidateMagic = 0x3C85F7CE;
constexpr uint8_t kTorchReady = 0;  // CheckResponseType::READY

template <typename T>
void AppendRaw(std::string& msg, T v) {
  msg.append(reinterpret_cast<const char*>(&v), sizeof v);
}
void AppendStoreString(std::string& msg, absl::string_view s) {
  AppendRaw<uint64_t>(msg, s.size());
  msg.append(s.data(), s.size());
}

}  // namespace

absl::StatusOr<std::unique_ptr<TorchStore>> TorchStore::Connect(const std::string& addr,
                                                                 int port, int rank,
                                                                 absl::Time deadline,
                                                                 int64_t timeout_ms) {
  ASSIGN_OR_RETURN(sockaddr_in sa, Resolve(addr, port));
  const std::string where = absl::StrCat("torchrun's store at ", addr, ":", port);
  ASSIGN_OR_RETURN(int fd, ConnectBefore(sa, deadline, rank, where, timeout_ms));
  std::unique_ptr<TorchStore> store(new TorchStore(fd, where, deadline));
  std::string msg(1, static_cast<char>(kTorchValidate));
  AppendRaw<uint32_t>(msg, kTorchValidateMagic);
  RETURN_IF_ERROR(store->Send(msg));
  return store;
}

TorchStore::~TorchStore() { close(fd_); }

absl::StatusOr<std::string> TorchStore::LocalAddress() const {
  sockaddr_in sa{};
  socklen_t len = sizeof sa;
  char text[INET_ADDRSTRLEN] = {};
  if (getsockname(fd_, reinterpret_cast<sockaddr*>(&sa), &len) != 0 ||
      inet_ntop(AF_INET, &sa.sin_addr, text, sizeof text) == nullptr) {
    return Errno("getsockname on the connection to", where_);
  }
  return std::string(text);
}

absl::Status TorchStore::Set(absl::string_view key, absl::string_view value) {
  std::string msg(1, static_cast<char>(kTorchSet));
  AppendStoreString(msg, key);
  AppendStoreString(msg, value);
  return Send(msg);
}

absl::StatusOr<bool> TorchStore::Check(absl::string_view key) {
  std::string msg(1, static_cast<char>(kTorchCheck));
  AppendRaw<uint64_t>(msg, 1);
  AppendStoreString(msg, key);
  RETURN_IF_ERROR(Send(msg));
  char reply = 0;
  RETURN_IF_ERROR(Transfer(fd_, &reply, 1, /*send=*/false, deadline_, where_));
  return static_cast<uint8_t>(reply) == kTorchReady;
}

absl::StatusOr<std::string> TorchStore::Get(absl::string_view key, size_t max_bytes) {
  std::string msg(1, static_cast<char>(kTorchGet));
  AppendStoreString(msg, key);
  RETURN_IF_ERROR(Send(msg));
  uint64_t n = 0;
  RETURN_IF_ERROR(Transfer(fd_, reinterpret_cast<char*>(&n), sizeof n, false, deadline_, where_));
  if (n > max_bytes) {
    return absl::DataLossError(absl::StrCat("rendezvous: ", where_, " returned ", n,
                                            " bytes for key '", key, "', expected at most ",
                                            max_bytes));
  }
  std::string value(n, '\0');
  if (n > 0) RETURN_IF_ERROR(Transfer(fd_, &value[0], n, false, deadline_, where_));
  return value;
}

absl::Status TorchStore::Send(std::string& msg) {
  return Transfer(fd_, &msg[0], msg.size(), /*send=*/true, deadline_, where_);
}

}  // namespace internal
}  // namespace comm
}  // namespace zerort
