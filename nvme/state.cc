#include "nvme/state.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "memory/plan.h"

namespace zerort {
namespace nvme {

// The plan pads the file's arrays (memory::NvmeUnitStride) to what direct I/O needs.
static_assert(memory::kNvmeAlignment == kIoAlignment, "plan and I/O alignments differ");

NvmeState::NvmeState(AioEngine* io, const SwapFile* file, std::vector<Piece> pieces,
                     std::vector<int> first, char* slots, int64_t slot_bytes,
                     std::vector<int> element_bytes)
    : io_(io),
      file_(file),
      pieces_(std::move(pieces)),
      first_(std::move(first)),
      element_bytes_(std::move(element_bytes)),
      slots_(slots),
      slot_bytes_(slot_bytes) {
  for (const Piece& p : pieces_) {
    offset_.push_back(copy_bytes_);
    copy_bytes_ += PieceStride(p.n, element_bytes_);
  }
}

// A piece's arrays one after the other, each padded to 4 KiB (3 x NvmeUnitStride for fp32).
int64_t NvmeState::PieceStride(int64_t n, const std::vector<int>& element_bytes) {
  int64_t bytes = 0;
  for (int b : element_bytes) bytes += memory::NvmeArrayStride(n, b);
  return bytes;
}

int64_t NvmeState::ArrayOffset(int piece, int array) const {
  int64_t at = 0;
  for (int a = 0; a < array; ++a) at += memory::NvmeArrayStride(pieces_[piece].n, element_bytes_[a]);
  return at;
}

NvmeState::~NvmeState() { Abandon(); }

std::vector<NvmeState::Piece> NvmeState::PiecesOf(const std::vector<int64_t>& unit_elements,
                                                  int64_t piece_elements,
                                                  std::vector<int>* first) {
  std::vector<Piece> pieces;
  for (size_t u = 0; u < unit_elements.size(); ++u) {
    if (first != nullptr) first->push_back(static_cast<int>(pieces.size()));
    int64_t begin = 0;
    for (int64_t n : memory::NvmePieces(unit_elements[u], piece_elements)) {
      pieces.push_back({static_cast<int>(u), begin, n});
      begin += n;
    }
  }
  if (first != nullptr) first->push_back(static_cast<int>(pieces.size()));
  return pieces;
}

int64_t NvmeState::FileBytes(const std::vector<int64_t>& unit_elements, int64_t piece_elements,
                             const std::vector<int>& element_bytes) {
  int64_t copy = 0;
  for (const Piece& p : PiecesOf(unit_elements, piece_elements, nullptr)) {
    copy += PieceStride(p.n, element_bytes);
  }
  return 2 * copy;
}

int64_t NvmeState::SlotBytes(const std::vector<int64_t>& unit_elements, int64_t piece_elements,
                             const std::vector<int>& element_bytes) {
  int64_t largest = 0;
  for (const Piece& p : PiecesOf(unit_elements, piece_elements, nullptr)) {
    largest = std::max(largest, PieceStride(p.n, element_bytes));
  }
  return largest;
}

absl::StatusOr<std::unique_ptr<NvmeState>> NvmeState::Create(AioEngine* io, const SwapFile* file,
                                                             std::vector<int64_t> unit_elements,
                                                             int64_t piece_elements, char* slots,
                                                             int64_t slot_bytes,
                                                             std::vector<int> element_bytes) {
  if (reinterpret_cast<uintptr_t>(slots) % kIoAlignment != 0 || slot_bytes % kIoAlignment != 0) {
    return absl::InvalidArgumentError("NvmeState: slots must be aligned to 4096 bytes");
  }
  const bool sizes_ok =
      std::all_of(element_bytes.begin(), element_bytes.end(), [](int b) { return b == 2 || b == 4; });
  if (element_bytes.empty() || element_bytes.size() > kMaxArrays || !sizes_ok) {
    return absl::InvalidArgumentError(absl::StrCat(
        "NvmeState: a piece holds 1 to ", kMaxArrays, " arrays of 2- or 4-byte elements; got ",
        element_bytes.size()));
  }
  const int64_t slot_need = SlotBytes(unit_elements, piece_elements, element_bytes);
  if (slot_need > slot_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "NvmeState: the largest piece's state (", slot_need, " bytes) exceeds a staging slot (",
        slot_bytes, " bytes)"));
  }
  const int64_t file_need = FileBytes(unit_elements, piece_elements, element_bytes);
  if (file_need > file->bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("NvmeState: ", file->path(), " holds ",
                                                   file->bytes(), " bytes, the state needs ",
                                                   file_need));
  }
  std::vector<int> first;
  std::vector<Piece> pieces = PiecesOf(unit_elements, piece_elements, &first);
  return std::unique_ptr<NvmeState>(new NvmeState(io, file, std::move(pieces), std::move(first),
                                                  slots, slot_bytes, std::move(element_bytes)));
}

int64_t NvmeState::Offset(int copy, int piece) const {
  return copy * copy_bytes_ + offset_[piece];
}
int64_t NvmeState::PieceBytes(int piece) const {
  return PieceStride(pieces_[piece].n, element_bytes_);
}

void NvmeState::Start(IoOp op, int copy, int piece) {
  pending_[piece % kSlots] =
      io_->Submit({{op, file_, Offset(copy, piece), Slot(piece), PieceBytes(piece)}});
}

absl::Status NvmeState::WaitSlot(int slot) {
  const AioEngine::Ticket t = std::exchange(pending_[slot], 0);
  return t == 0 ? absl::OkStatus() : io_->Wait(t);
}

absl::Status NvmeState::Begin() {
  if (!pieces_.empty()) Start(IoOp::kRead, current_, 0);
  return absl::OkStatus();
}

absl::StatusOr<NvmeState::Arrays> NvmeState::Acquire(int k) {
  if (k + 1 < static_cast<int>(pieces_.size())) {
    RETURN_IF_ERROR(WaitSlot((k + 1) % kSlots));  // piece k-2's write from that slot
    Start(IoOp::kRead, current_, k + 1);
  }
  RETURN_IF_ERROR(WaitSlot(k % kSlots));
  char* s = Slot(k);
  Arrays out;
  for (int a = 0; a < static_cast<int>(element_bytes_.size()); ++a) {
    out.array[a] = s + ArrayOffset(k, a);
  }
  if (element_bytes_ == Fp32Arrays()) {
    out.master = reinterpret_cast<float*>(out.array[0]);
    out.m = reinterpret_cast<float*>(out.array[1]);
    out.v = reinterpret_cast<float*>(out.array[2]);
  }
  return out;
}

absl::Status NvmeState::Release(int k) {
  Start(IoOp::kWrite, 1 - current_, k);
  return absl::OkStatus();
}

absl::Status NvmeState::Finish() {
  RETURN_IF_ERROR(Drain());
  Commit();
  return absl::OkStatus();
}

absl::Status NvmeState::Drain() {
  absl::Status s;
  for (int k = 0; k < kSlots; ++k) s.Update(WaitSlot(k));
  return s;
}

void NvmeState::Commit() { current_ = 1 - current_; }  // every unit of the other copy is written

void NvmeState::Abandon() {
  for (int k = 0; k < kSlots; ++k) WaitSlot(k).IgnoreError();
}

absl::Status NvmeState::Load(int u, float* master, float* m, float* v) {
  if (element_bytes_ != Fp32Arrays()) {
    return absl::FailedPreconditionError("NvmeState::Load: the file holds a compact layout");
  }
  void* const out[3] = {master, m, v};
  return LoadArrays(u, out);
}

absl::Status NvmeState::Store(int u, const float* master, const float* m, const float* v) {
  if (element_bytes_ != Fp32Arrays()) {
    return absl::FailedPreconditionError("NvmeState::Store: the file holds a compact layout");
  }
  const void* const in[3] = {master, m, v};
  return StoreArrays(u, in);
}

absl::Status NvmeState::LoadArrays(int u, void* const* out) {
  for (int k = first_[u]; k < first_[u + 1]; ++k) {
    const Piece& p = pieces_[k];
    RETURN_IF_ERROR(io_->Run({{IoOp::kRead, file_, Offset(current_, k), slots_, PieceBytes(k)}}));
    for (int a = 0; a < static_cast<int>(element_bytes_.size()); ++a) {
      if (out[a] == nullptr) continue;
      const int64_t eb = element_bytes_[a];
      std::memcpy(static_cast<char*>(out[a]) + p.begin * eb, slots_ + ArrayOffset(k, a),
                  static_cast<size_t>(p.n * eb));
    }
  }
  return absl::OkStatus();
}

absl::Status NvmeState::StoreArrays(int u, const void* const* in) {
  for (int k = first_[u]; k < first_[u + 1]; ++k) {
    const Piece& p = pieces_[k];
    std::memset(slots_, 0, PieceBytes(k));
    for (int a = 0; a < static_cast<int>(element_bytes_.size()); ++a) {
      if (in[a] == nullptr) continue;
      const int64_t eb = element_bytes_[a];
      std::memcpy(slots_ + ArrayOffset(k, a), static_cast<const char*>(in[a]) + p.begin * eb,
                  static_cast<size_t>(p.n * eb));
    }
    RETURN_IF_ERROR(io_->Run({{IoOp::kWrite, file_, Offset(current_, k), slots_, PieceBytes(k)}}));
  }
  return absl::OkStatus();
}

}  // namespace nvme
}  // namespace zerort
