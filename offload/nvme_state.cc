#include "offload/nvme_state.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "memory/plan.h"

namespace zerort {
namespace offload {

NvmeState::NvmeState(AioEngine* io, const SwapFile* file, std::vector<int64_t> unit_elements,
                     char* slots, int64_t slot_bytes)
    : io_(io), file_(file), n_(std::move(unit_elements)), slots_(slots), slot_bytes_(slot_bytes) {
  for (int64_t n : n_) {
    offset_.push_back(copy_bytes_);
    copy_bytes_ += 3 * memory::NvmeUnitStride(n);
  }
}

NvmeState::~NvmeState() { Abandon(); }

int64_t NvmeState::FileBytes(const std::vector<int64_t>& unit_elements) {
  int64_t copy = 0;
  for (int64_t n : unit_elements) copy += 3 * memory::NvmeUnitStride(n);
  return 2 * copy;
}

absl::StatusOr<std::unique_ptr<NvmeState>> NvmeState::Create(AioEngine* io, const SwapFile* file,
                                                             std::vector<int64_t> unit_elements,
                                                             char* slots, int64_t slot_bytes) {
  if (reinterpret_cast<uintptr_t>(slots) % kIoAlignment != 0 || slot_bytes % kIoAlignment != 0) {
    return absl::InvalidArgumentError("NvmeState: slots must be aligned to 4096 bytes");
  }
  for (size_t u = 0; u < unit_elements.size(); ++u) {
    if (3 * memory::NvmeUnitStride(unit_elements[u]) > slot_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "NvmeState: unit ", u, "'s master|m|v (", 3 * memory::NvmeUnitStride(unit_elements[u]),
          " bytes) exceeds a staging slot (", slot_bytes, " bytes)"));
    }
  }
  if (FileBytes(unit_elements) > file->bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("NvmeState: ", file->path(), " holds ",
                                                   file->bytes(), " bytes, the state needs ",
                                                   FileBytes(unit_elements)));
  }
  return std::unique_ptr<NvmeState>(
      new NvmeState(io, file, std::move(unit_elements), slots, slot_bytes));
}

int64_t NvmeState::Offset(int copy, int unit) const { return copy * copy_bytes_ + offset_[unit]; }
int64_t NvmeState::UnitBytes(int unit) const { return 3 * memory::NvmeUnitStride(n_[unit]); }

void NvmeState::Start(IoOp op, int copy, int unit) {
  pending_[unit % kSlots] =
      io_->Submit({{op, file_, Offset(copy, unit), Slot(unit), UnitBytes(unit)}});
}

absl::Status NvmeState::WaitSlot(int slot) {
  const AioEngine::Ticket t = std::exchange(pending_[slot], 0);
  return t == 0 ? absl::OkStatus() : io_->Wait(t);
}

absl::Status NvmeState::Begin() {
  if (!n_.empty()) Start(IoOp::kRead, current_, 0);
  return absl::OkStatus();
}

absl::StatusOr<NvmeState::Arrays> NvmeState::Acquire(int u) {
  if (u + 1 < static_cast<int>(n_.size())) {
    RETURN_IF_ERROR(WaitSlot((u + 1) % kSlots));  // unit u-2's write from that slot
    Start(IoOp::kRead, current_, u + 1);
  }
  RETURN_IF_ERROR(WaitSlot(u % kSlots));
  const int64_t stride = memory::NvmeUnitStride(n_[u]);
  char* s = Slot(u);
  return Arrays{reinterpret_cast<float*>(s), reinterpret_cast<float*>(s + stride),
                reinterpret_cast<float*>(s + 2 * stride)};
}

absl::Status NvmeState::Release(int u) {
  Start(IoOp::kWrite, 1 - current_, u);
  return absl::OkStatus();
}

absl::Status NvmeState::Finish() {
  absl::Status s;
  for (int k = 0; k < kSlots; ++k) s.Update(WaitSlot(k));
  if (s.ok()) current_ = 1 - current_;  // every unit of the other copy is written
  return s;
}

void NvmeState::Abandon() {
  for (int k = 0; k < kSlots; ++k) WaitSlot(k).IgnoreError();
}

absl::Status NvmeState::Load(int u, float* master, float* m, float* v) {
  const int64_t stride = memory::NvmeUnitStride(n_[u]);
  RETURN_IF_ERROR(io_->Run({{IoOp::kRead, file_, Offset(current_, u), slots_, UnitBytes(u)}}));
  float* out[3] = {master, m, v};
  for (int a = 0; a < 3; ++a) {
    if (out[a] != nullptr) std::memcpy(out[a], slots_ + a * stride, n_[u] * sizeof(float));
  }
  return absl::OkStatus();
}

absl::Status NvmeState::Store(int u, const float* master, const float* m, const float* v) {
  const int64_t stride = memory::NvmeUnitStride(n_[u]);
  std::memset(slots_, 0, UnitBytes(u));
  const float* in[3] = {master, m, v};
  for (int a = 0; a < 3; ++a) {
    if (in[a] != nullptr) std::memcpy(slots_ + a * stride, in[a], n_[u] * sizeof(float));
  }
  return io_->Run({{IoOp::kWrite, file_, Offset(current_, u), slots_, UnitBytes(u)}});
}

}  // namespace offload
}  // namespace zerort
