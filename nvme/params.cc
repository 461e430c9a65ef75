#include "nvme/params.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace zerort {
namespace nvme {
namespace {

constexpr int64_t kBehind = std::numeric_limits<int64_t>::max();

}  // namespace

int64_t NvmeParams::FileBytes(const std::vector<int64_t>& shard_bytes) {
  int64_t total = 0;
  for (int64_t b : shard_bytes) total += RoundUpToIo(b);
  return total;
}

absl::StatusOr<std::unique_ptr<NvmeParams>> NvmeParams::Create(
    AioEngine* io, const SwapFile* file, int64_t base, std::vector<int64_t> shard_bytes,
    char* buffers, int buffer_count, int64_t buffer_bytes) {
  if (buffer_count < 1 || buffer_bytes < kIoAlignment) {
    return absl::InvalidArgumentError(
        absl::StrCat("NVMe parameter offload needs buffer_count >= 1 (got ", buffer_count,
                     ") and buffers of at least ", kIoAlignment, " bytes (got ", buffer_bytes,
                     ")"));
  }
  if (base % kIoAlignment != 0 || base + FileBytes(shard_bytes) > file->bytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("NVMe parameter shards (", FileBytes(shard_bytes), " bytes at offset ",
                     base, ") do not fit ", file->path(), " (", file->bytes(), " bytes)"));
  }
  return std::unique_ptr<NvmeParams>(new NvmeParams(io, file, base, std::move(shard_bytes),
                                                    buffers, buffer_count, buffer_bytes));
}

NvmeParams::NvmeParams(AioEngine* io, const SwapFile* file, int64_t base,
                       std::vector<int64_t> shard_bytes, char* buffers, int buffer_count,
                       int64_t buffer_bytes)
    : io_(io), file_(file), shard_bytes_(std::move(shard_bytes)),
      piece_bytes_(buffer_bytes / kIoAlignment * kIoAlignment), buffers_(buffer_count) {
  int64_t at = base;
  for (int64_t b : shard_bytes_) {
    offset_.push_back(at);
    at += RoundUpToIo(b);
  }
  for (int i = 0; i < buffer_count; ++i) buffers_[i].data = buffers + i * piece_bytes_;
}

NvmeParams::~NvmeParams() { Invalidate(); }

int64_t NvmeParams::Pieces(int unit) const {
  return (shard_bytes_[unit] + piece_bytes_ - 1) / piece_bytes_;
}

int64_t NvmeParams::PieceSize(int unit, int64_t piece) const {
  return std::min(piece_bytes_, shard_bytes_[unit] - piece * piece_bytes_);
}

AioEngine::Request NvmeParams::Request(IoOp op, int unit, int64_t piece, char* data) const {
  return {op, file_, offset_[unit] + piece * piece_bytes_, data, RoundUpToIo(PieceSize(unit, piece))};
}

int NvmeParams::Find(int unit, int64_t piece) const {
  for (int b = 0; b < static_cast<int>(buffers_.size()); ++b) {
    if (buffers_[b].unit == unit && buffers_[b].piece == piece) return b;
  }
  return -1;
}

// Units behind `pos_` (already passed in `dir_`), or any other than `pos_` without a direction,
// rank last: they are the first to give up their buffers.
NvmeParams::Rank NvmeParams::RankOf(int unit, int64_t piece) const {
  const int64_t ahead = static_cast<int64_t>(unit - pos_) * dir_;
  if (unit != pos_ && (dir_ == 0 || ahead < 0)) return {kBehind, 0};
  return {ahead, piece};
}

int NvmeParams::Victim(Rank below, int keep_unit) const {
  int v = -1;
  Rank worst;
  for (int b = 0; b < static_cast<int>(buffers_.size()); ++b) {
    const Buffer& buf = buffers_[b];
    if (buf.unit < 0) return b;
    if (buf.unit == keep_unit) continue;
    const Rank r = RankOf(buf.unit, buf.piece);
    if (!(below < r)) continue;  // as near as the piece that wants the buffer, or nearer
    if (v < 0 || worst < r || (r == worst && buf.age < buffers_[v].age)) {
      v = b;
      worst = r;
    }
  }
  return v;
}

int NvmeParams::Take(int keep_unit) {
  const int b = Victim({-1, -1}, keep_unit);
  // Another unit's read-ahead: its error, if any, shows again when that unit is read.
  if (b >= 0) Drop(b).IgnoreError();
  return b;
}

absl::Status NvmeParams::Drop(int b) {
  Buffer& buf = buffers_[b];
  absl::Status s;
  if (buf.ticket != 0) s = io_->Wait(buf.ticket);
  if (buf.unit >= 0 && buf.unread) ++reads_ahead_wasted_;
  buf.ticket = 0;
  buf.unit = -1;
  buf.unread = false;
  return s;
}

void NvmeParams::ReadAhead(int unit, int direction) {
  pos_ = unit;
  dir_ = direction;
  ReadFrom(unit, 0);
}

// Each piece takes a free buffer, else the one whose piece ranks last if that ranks after it;
// the walk stops at the first piece no buffer can be given to, since every later piece ranks
// after it too.
void NvmeParams::ReadFrom(int unit, int64_t first) {
  const int units = static_cast<int>(shard_bytes_.size());
  for (int u = unit; u >= 0 && u < units; u += dir_) {
    for (int64_t p = u == unit ? first : 0; p < Pieces(u); ++p) {
      if (Find(u, p) >= 0) continue;
      const int b = Victim(RankOf(u, p), -1);
      if (b < 0) return;
      Drop(b).IgnoreError();  // a read-ahead's error shows again when its unit is read
      Buffer& buf = buffers_[b];
      buf.unit = u;
      buf.piece = p;
      buf.age = ++clock_;
      buf.unread = true;
      buf.ticket = io_->Submit({Request(IoOp::kRead, u, p, buf.data)});
    }
    if (dir_ == 0) return;
  }
}

absl::Status NvmeParams::Read(int unit, const Sink& sink) {
  pos_ = unit;
  for (int64_t p = 0; p < Pieces(unit); ++p) {
    int b = Find(unit, p);
    if (b >= 0) {
      ++reads_ahead_used_;
    } else {
      // Every other buffer ranks after this piece (this unit's earlier pieces are consumed).
      b = Victim(RankOf(unit, p), -1);
      if (b < 0) return absl::InternalError("NvmeParams::Read: no buffer to give up");
      Drop(b).IgnoreError();
      buffers_[b].ticket = io_->Submit({Request(IoOp::kRead, unit, p, buffers_[b].data)});
    }
    const char* data = buffers_[b].data;
    buffers_[b].unread = false;
    RETURN_IF_ERROR(Drop(b));  // waits for the read: the bytes are valid until the next Submit
    RETURN_IF_ERROR(sink(p * piece_bytes_, data, PieceSize(unit, p)));
    ReadFrom(unit, p + 1);
  }
  return absl::OkStatus();
}

absl::Status NvmeParams::Write(int unit, const char* data) {
  return WriteFrom(unit, [data](int64_t offset, char* buffer, int64_t bytes) {
    std::memcpy(buffer, data + offset, static_cast<size_t>(bytes));
    return absl::OkStatus();
  });
}

absl::Status NvmeParams::WriteFrom(int unit, const Fill& fill) {
  for (int b = 0; b < static_cast<int>(buffers_.size()); ++b) {
    if (buffers_[b].unit == unit) Drop(b).IgnoreError();  // stale: older than this write
  }
  absl::Status s;
  for (int64_t p = 0; p < Pieces(unit) && s.ok(); ++p) {
    int b = Take(unit);
    if (b < 0) {  // every buffer carries a write of this unit: wait for the oldest
      b = 0;
      for (int i = 1; i < static_cast<int>(buffers_.size()); ++i) {
        if (buffers_[i].age < buffers_[b].age) b = i;
      }
      s = Drop(b);
      if (!s.ok()) break;
    }
    Buffer& buf = buffers_[b];
    const int64_t n = PieceSize(unit, p);
    s = fill(p * piece_bytes_, buf.data, n);
    if (!s.ok()) break;  // the buffer is still free (unit -1): nothing to wait for
    std::memset(buf.data + n, 0, RoundUpToIo(n) - n);
    buf.unit = unit;
    buf.piece = p;
    buf.age = ++clock_;
    buf.ticket = io_->Submit({Request(IoOp::kWrite, unit, p, buf.data)});
  }
  // Completed writes stay as read-aheads (the buffer holds what the file holds); a failed
  // write leaves none of this unit's.
  for (int b = 0; b < static_cast<int>(buffers_.size()); ++b) {
    Buffer& buf = buffers_[b];
    if (buf.unit != unit || buf.ticket == 0) continue;
    s.Update(io_->Wait(buf.ticket));
    buf.ticket = 0;
  }
  if (!s.ok()) {
    for (Buffer& buf : buffers_) {
      if (buf.unit == unit) buf.unit = -1;
    }
  }
  return s;
}

void NvmeParams::Invalidate() {
  for (int b = 0; b < static_cast<int>(buffers_.size()); ++b) Drop(b).IgnoreError();
}

}  // namespace nvme
}  // namespace zerort
