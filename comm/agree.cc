#include "comm/agree.h"

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace zerort {
namespace comm {
namespace {

// The 16-bit element type whose elements travel as raw words: MPI moves it as MPI_UINT16_T,
// NCCL and the in-process group as bytes. Only ever given to AllGather and Broadcast.
constexpr DType kWord = DType::kBF16;
constexpr int kWordsPerU64 = 4;

absl::Status NeedsStaging(const Communicator& comm) {
  return absl::FailedPreconditionError(absl::StrCat(
      "the '", comm.backend(), "' communicator moves device memory on a stream: exchange host "
      "values through a HostExchange that stages them in device memory"));
}

}  // namespace

absl::Status DirectHostExchange::AllGatherHost(const void* send, void* recv, size_t count,
                                               DType dtype) {
  if (comm_->stream_ordered()) return NeedsStaging(*comm_);
  return comm_->AllGather(send, recv, count, dtype);
}

absl::Status DirectHostExchange::BroadcastHost(void* buf, size_t count, DType dtype, int root) {
  if (comm_->stream_ordered()) return NeedsStaging(*comm_);
  return comm_->Broadcast(buf, count, dtype, root);
}

absl::StatusOr<std::vector<uint64_t>> AllGatherU64(HostExchange& exchange,
                                                   absl::Span<const uint64_t> mine) {
  const size_t k = mine.size();
  const int world = exchange.size();
  // (k, 4) 16-bit words, least significant first: independent of the host's byte order.
  std::vector<uint16_t> send(kWordsPerU64 * k);
  for (size_t i = 0; i < k; ++i) {
    for (int j = 0; j < kWordsPerU64; ++j) {
      send[kWordsPerU64 * i + j] = static_cast<uint16_t>(mine[i] >> (16 * j));
    }
  }
  std::vector<uint16_t> recv(send.size() * world);  // (world, k, 4) words
  RETURN_IF_ERROR(exchange.AllGatherHost(send.data(), recv.data(), send.size(), kWord));
  std::vector<uint64_t> out(k * world, 0);
  for (size_t i = 0; i < out.size(); ++i) {
    for (int j = 0; j < kWordsPerU64; ++j) {
      out[i] |= static_cast<uint64_t>(recv[kWordsPerU64 * i + j]) << (16 * j);
    }
  }
  return out;
}

absl::Status BroadcastBytes(HostExchange& exchange, std::string* bytes, int root) {
  if (root < 0 || root >= exchange.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("BroadcastBytes: root ", root, " of ", exchange.size(), " ranks"));
  }
  // The length first (as four words), so that every rank sizes its buffer alike.
  std::vector<uint16_t> length(kWordsPerU64);
  const uint64_t n = bytes->size();
  for (int j = 0; j < kWordsPerU64; ++j) length[j] = static_cast<uint16_t>(n >> (16 * j));
  RETURN_IF_ERROR(exchange.BroadcastHost(length.data(), length.size(), kWord, root));
  uint64_t root_n = 0;
  for (int j = 0; j < kWordsPerU64; ++j) root_n |= static_cast<uint64_t>(length[j]) << (16 * j);
  // The bytes in pairs, low byte first; an odd length carries one byte of padding.
  std::vector<uint16_t> words((root_n + 1) / 2, 0);
  if (exchange.rank() == root) {
    for (size_t i = 0; i < root_n; ++i) {
      words[i / 2] |= static_cast<uint16_t>(static_cast<uint8_t>((*bytes)[i]) << (8 * (i % 2)));
    }
  }
  RETURN_IF_ERROR(exchange.BroadcastHost(words.data(), words.size(), kWord, root));
  bytes->resize(root_n);
  for (size_t i = 0; i < root_n; ++i) {
    (*bytes)[i] = static_cast<char>(static_cast<uint8_t>(words[i / 2] >> (8 * (i % 2))));
  }
  return absl::OkStatus();
}

absl::Status AgreeOnStatus(HostExchange& exchange, const absl::Status& local) {
  if (exchange.size() == 1) return local;
  ASSIGN_OR_RETURN(const std::vector<uint64_t> codes,
                   AllGatherU64(exchange, {static_cast<uint64_t>(local.code())}));
  int q = -1;
  for (int r = 0; r < exchange.size() && q < 0; ++r) {
    if (codes[r] != 0) q = r;
  }
  if (q < 0) return absl::OkStatus();
  std::string message(exchange.rank() == q ? local.message() : "");
  RETURN_IF_ERROR(BroadcastBytes(exchange, &message, q));
  if (exchange.rank() == q) return local;
  return absl::Status(static_cast<absl::StatusCode>(codes[q]),
                      absl::StrCat("on rank ", q, ": ", message));
}

}  // namespace comm
}  // namespace zerort
