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
                     std::vector<int> first, char* slots, int64_t slot_bytes)
    : io_(io),
      file_(file),
      pieces_(std::move(pieces)),
      first_(std::move(first)),
      slots_(slots),
      slot_bytes_(slot_bytes) {
  for (const Piece& p : pieces_) {
    offset_.push_back(copy_bytes_);
    copy_bytes_ += 3 * memory::NvmeUnitStride(p.n);
  }
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

int64_t NvmeState::FileBytes(const std::vector<int64_t>& unit_elements, int64_t piece_elements) {
  int64_t copy = 0;
  for (const Piece& p : PiecesOf(unit_elements, piece_elements, nullptr)) {
    copy += 3 * memory::NvmeUnitStride(p.n);
  }
  return 2 * copy;
}

int64_t NvmeState::SlotBytes(const std::vector<int64_t>& unit_elements, int64_t piece_elements) {
  int64_t largest = 0;
  for (const Piece& p : PiecesOf(unit_elements, piece_elements, nullptr)) {
    largest = std::max(largest, 3 * memory::NvmeUnitStride(p.n));
  }
  return largest;
}

absl::StatusOr<std::unique_ptr<NvmeState>> NvmeState::Create(AioEngine* io, const SwapFile* file,
                                                             std::vector<int64_t> unit_elements,
                                                             int64_t piece_elements, char* slots,
                                                             int64_t slot_bytes) {
  if (reinterpret_cast<uintptr_t>(slots) % kIoAlignment != 0 || slot_bytes % kIoAlignment != 0) {
    return absl::InvalidArgumentError("NvmeState: slots must be aligned to 4096 bytes");
  }
  if (SlotBytes(unit_elements, piece_elements) > slot_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "NvmeState: the largest piece's master|m|v (", SlotBytes(unit_elements, piece_elements),
        " bytes) exceeds a staging slot (", slot_bytes, " bytes)"));
  }
  if (FileBytes(unit_elements, piece_elements) > file->bytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("NvmeState: ", file->path(), " holds ", file->bytes(),
                     " bytes, the state needs ", FileBytes(unit_elements, piece_elements)));
  }
  std::vector<int> first;
  std::vector<Piece> pieces = PiecesOf(unit_elements, piece_elements, &first);
  return std::unique_ptr<NvmeState>(
      new NvmeState(io, file, std::move(pieces), std::move(first), slots, slot_bytes));
}

int64_t NvmeState::Offset(int copy, int piece) const {
  return copy * copy_bytes_ + offset_[piece];
}
int64_t NvmeState::PieceBytes(int piece) const {
  return 3 * memory::NvmeUnitStride(pieces_[piece].n);
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
  const int64_t stride = memory::NvmeUnitStride(pieces_[k].n);
  char* s = Slot(k);
  return Arrays{reinterpret_cast<float*>(s), reinterpret_cast<float*>(s + stride),
                reinterpret_cast<float*>(s + 2 * stride)};
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
  float* out[3] = {master, m, v};
  for (int k = first_[u]; k < first_[u + 1]; ++k) {
    const Piece& p = pieces_[k];
    const int64_t stride = memory::NvmeUnitStride(p.n);
    RETURN_IF_ERROR(io_->Run({{IoOp::kRead, file_, Offset(current_, k), slots_, PieceBytes(k)}}));
    for (int a = 0; a < 3; ++a) {
      if (out[a] != nullptr) {
        std::memcpy(out[a] + p.begin, slots_ + a * stride, p.n * sizeof(float));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status NvmeState::Store(int u, const float* master, const float* m, const float* v) {
  const float* in[3] = {master, m, v};
  for (int k = first_[u]; k < first_[u + 1]; ++k) {
    const Piece& p = pieces_[k];
    const int64_t stride = memory::NvmeUnitStride(p.n);
    std::memset(slots_, 0, PieceBytes(k));
    for (int a = 0; a < 3; ++a) {
      if (in[a] != nullptr) std::memcpy(slots_ + a * stride, in[a] + p.begin, p.n * sizeof(float));
    }
    RETURN_IF_ERROR(io_->Run({{IoOp::kWrite, file_, Offset(current_, k), slots_, PieceBytes(k)}}));
  }
  return absl::OkStatus();
}

}  // namespace nvme
}  // namespace zerort
