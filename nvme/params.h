// NvmeParams: stage-3 parameter shards (offload_param.device = "nvme") in a swap file, read
// ahead of their gather into a few pinned buffers and written back after the optimizer step.
//
// Each unit's shard (compute dtype, `shard_bytes[u]`; 0 for units that have none) occupies its
// own 4 KiB-aligned range of the file, starting at `base`; it moves in pieces of at most one
// buffer (`buffer_bytes`, rounded down to kIoAlignment). The buffers are the only host memory
// the shards use: `buffer_count` x `buffer_bytes`, bounded by the config's
// offload_param.buffer_count x buffer_size.
//
//   ASSIGN_OR_RETURN(auto p, NvmeParams::Create(io, file, 0, shard_bytes, buffers, 4, bytes));
//   RETURN_IF_ERROR(p->Write(u, host_shard));     // initial values, after every update
//   RETURN_IF_ERROR(p->Read(u, sink));            // sink(offset, data, bytes) per piece
//   p->ReadAhead(u + 1, +1);                      // reads u+1, u+2, ... into the buffers
//
// Read-ahead goes as deep as the buffers allow: ReadAhead(u, d) starts reads of u's pieces,
// then u+d's, u+2d's, ..., until the units run out or no buffer can be had. Pieces rank by
// how soon the gather order from u in direction d reaches them (units behind u rank last); a
// read-ahead takes a free buffer, else gives up the buffer of the piece that ranks last if it
// ranks after the piece being started, so it never evicts a piece nearer than its own. Read(u)
// moves the position to u and, as each piece is consumed, refills the freed buffer in the same
// order (u's later pieces first, then the units after u in the last direction).
//
// A read-ahead is dropped by Write(u) or WriteFrom(u) of its unit and by Invalidate(), so a read
// never returns bytes older than the last write. Errors (EIO, a short transfer) name the file
// and offset; after an error no request of the failing call is still in flight on the caller's
// bytes.
//
// Thread safety: not thread-safe; one per engine. The AioEngine, file and buffers must outlive
// it. REQUIRES: `buffers` aligned to kIoAlignment.
#ifndef ZERORT_NVME_PARAMS_H_
#define ZERORT_NVME_PARAMS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nvme/io.h"

namespace zerort {
namespace nvme {

class NvmeParams {
 public:
  // Receives one piece of a unit's shard: `bytes` bytes at byte `offset` of the shard.
  using Sink = std::function<absl::Status(int64_t offset, const char* data, int64_t bytes)>;

  // The file bytes the shards need (each padded to kIoAlignment).
  static int64_t FileBytes(const std::vector<int64_t>& shard_bytes);

  // Errors: InvalidArgument if buffer_count < 1, buffer_bytes < kIoAlignment, or the shards do
  // not fit the file after `base` (a multiple of kIoAlignment).
  static absl::StatusOr<std::unique_ptr<NvmeParams>> Create(AioEngine* io, const SwapFile* file,
                                                            int64_t base,
                                                            std::vector<int64_t> shard_bytes,
                                                            char* buffers, int buffer_count,
                                                            int64_t buffer_bytes);
  ~NvmeParams();  // waits for reads in flight (the buffers are the caller's)
  NvmeParams(const NvmeParams&) = delete;
  NvmeParams& operator=(const NvmeParams&) = delete;

  // Starts reads of unit's pieces, then, with direction +1 or -1, of the units after it in that
  // direction (0: this unit only), as the ranking above allows. Waits only for reads in flight
  // in the buffers it gives up.
  void ReadAhead(int unit, int direction = 0);
  // Hands unit u's shard to `sink` piece by piece, in order, from read-aheads where present.
  absl::Status Read(int unit, const Sink& sink);
  // Writes unit u's shard from `data` (shard_bytes[u] bytes, any host memory); returns when
  // every piece is on the file.
  absl::Status Write(int unit, const char* data);
  // Fills `buffer` (pinned, one piece) with the `bytes` bytes at byte `offset` of a unit's
  // shard; the bytes must be in place when it returns (synchronize any device copy).
  using Fill = std::function<absl::Status(int64_t offset, char* buffer, int64_t bytes)>;
  // Write with the pieces produced by `fill` straight into the pinned buffers: a shard that
  // lives elsewhere (device memory, or an fp32 master to round) reaches the file through at
  // most `buffer_count` pieces of host memory. A fill error stops the write (returned as is);
  // the pieces already submitted are waited for.
  absl::Status WriteFrom(int unit, const Fill& fill);
  // Drops every read-ahead (waits for those in flight).
  void Invalidate();

  int64_t piece_bytes() const { return piece_bytes_; }
  int64_t reads_ahead_used() const { return reads_ahead_used_; }  // pieces Read found ready
  // Pieces read ahead and dropped unread (by a Write of their unit, Invalidate, or eviction):
  // disk reads for nothing.
  int64_t reads_ahead_wasted() const { return reads_ahead_wasted_; }

 private:
  struct Buffer {
    char* data = nullptr;
    int unit = -1;  // -1: free
    int64_t piece = 0;
    AioEngine::Ticket ticket = 0;  // 0: nothing in flight
    uint64_t age = 0;
    bool unread = false;  // a read-ahead Read has not consumed
  };
  NvmeParams(AioEngine* io, const SwapFile* file, int64_t base, std::vector<int64_t> shard_bytes,
             char* buffers, int buffer_count, int64_t buffer_bytes);
  int64_t Pieces(int unit) const;
  int64_t PieceSize(int unit, int64_t piece) const;  // payload bytes
  AioEngine::Request Request(IoOp op, int unit, int64_t piece, char* data) const;
  // (units ahead of pos_ in dir_, piece); behind: (max, 0). Smaller is needed sooner.
  using Rank = std::pair<int64_t, int64_t>;
  Rank RankOf(int unit, int64_t piece) const;
  void ReadFrom(int unit, int64_t first);  // read-ahead from piece `first` of `unit` on
  int Find(int unit, int64_t piece) const;
  // A free buffer, else the one not of `keep_unit` ranking last (oldest first among equals)
  // if it ranks after `below`, else -1. Frees nothing.
  int Victim(Rank below, int keep_unit) const;
  int Take(int keep_unit);  // Victim of any rank, freed, or -1
  absl::Status Drop(int b);  // waits for its request and frees it

  AioEngine* const io_;
  const SwapFile* const file_;
  const std::vector<int64_t> shard_bytes_;
  std::vector<int64_t> offset_;  // per unit, in the file
  const int64_t piece_bytes_;
  std::vector<Buffer> buffers_;
  uint64_t clock_ = 0;
  int pos_ = -1;  // the unit read or read ahead from last
  int dir_ = 0;   // the last read-ahead's direction
  int64_t reads_ahead_used_ = 0;
  int64_t reads_ahead_wasted_ = 0;
};

}  // namespace nvme
}  // namespace zerort

#endif  // ZERORT_NVME_PARAMS_H_
