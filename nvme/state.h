// NvmeState: the fp32 master, m and v of every owned unit in a swap file (NVMe offload), moved
// through three pinned slots while the offload pipeline's AdamW runs. Units are split into
// pieces (memory::NvmePieces: at most `piece_elements` each, so the slots stay bounded); at
// piece k, the read of piece k+1 and the write of piece k-1 are in flight.
//
//   slot (k+1)%3: read  k+1   (after the write of k-2 from that slot has completed)
//   slot  k%3   : AdamW k     (its read waited for)
//   slot (k-1)%3: write k-1
//
// File layout: two copies of the state; in each, every piece's master|m|v, each array padded
// to memory::kNvmeAlignment bytes (memory::NvmeUnitStride), pieces in plan order. A compact
// optimizer-state form (memory::OptimizerStateForm) keeps its own arrays instead, given to
// Create as their element sizes (2-byte bf16 moments, the master's bf16 part, its remainder),
// each padded the same way (memory::NvmeArrayStride). A step reads the
// current copy and writes every unit into the other one; only when every write has completed
// does the other copy become current (Finish). A step that fails (EIO, ENOSPC, a short
// transfer) leaves the current copy untouched: the next step, or a checkpoint save, reads the
// state as it was before the failed step. Slots hold the same layout as a unit in the file.
//
//   ASSIGN_OR_RETURN(auto state, NvmeState::Create(io, file, unit_elements, 0, slots, bytes));
//   RETURN_IF_ERROR(state->Store(u, master, m, v));        // initial values, per unit
//   RETURN_IF_ERROR(state->Begin());
//   for (k in pieces) { ASSIGN_OR_RETURN(auto a, state->Acquire(k)); AdamW(a...);
//                       RETURN_IF_ERROR(state->Release(k)); }
//   RETURN_IF_ERROR(state->Finish());                      // on any error: state->Abandon()
//
// Thread safety: not thread-safe; one per engine. The AioEngine, file and slots must outlive it.
#ifndef ZERORT_NVME_STATE_H_
#define ZERORT_NVME_STATE_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nvme/io.h"

namespace zerort {
namespace nvme {

class NvmeState {
 public:
  static constexpr int kSlots = 3;
  static constexpr int kMaxArrays = 4;
  // Bytes per element of each array of a piece: the fp32 master, m and v.
  static std::vector<int> Fp32Arrays() { return {4, 4, 4}; }
  // Where an acquired piece's state sits in its pinned slot, for AdamW to update in place.
  struct Arrays {
    float* master = nullptr;  // (n) fp32, pinned slot: array[0..2] of the fp32 layout
    float* m = nullptr;
    float* v = nullptr;
    char* array[kMaxArrays] = {};  // every array of the layout, in order
  };

  // A piece: elements [begin, begin + n) of a unit's shard.
  struct Piece {
    int unit = 0;
    int64_t begin = 0;
    int64_t n = 0;
  };

  // `unit_elements[u]`: unit u's shard elements; `piece_elements` as memory::NvmePieces.
  // `slots`: kSlots x `slot_bytes`, aligned to kIoAlignment. `element_bytes`: the arrays of a
  // piece (1 to kMaxArrays, each 2 or 4 bytes per element). Errors: InvalidArgument if a piece
  // does not fit a slot, the file is too small or the arrays are not as above.
  static absl::StatusOr<std::unique_ptr<NvmeState>> Create(
      AioEngine* io, const SwapFile* file, std::vector<int64_t> unit_elements,
      int64_t piece_elements, char* slots, int64_t slot_bytes,
      std::vector<int> element_bytes = Fp32Arrays());
  ~NvmeState();  // waits for I/O in flight (its buffers are the caller's)

  // The file bytes the layout needs (two copies), and the largest piece's arrays.
  static int64_t FileBytes(const std::vector<int64_t>& unit_elements, int64_t piece_elements,
                           const std::vector<int>& element_bytes = Fp32Arrays());
  static int64_t SlotBytes(const std::vector<int64_t>& unit_elements, int64_t piece_elements,
                           const std::vector<int>& element_bytes = Fp32Arrays());

  const std::vector<Piece>& pieces() const { return pieces_; }  // in file (and unit) order
  int first_piece(int unit) const { return first_[unit]; }      // unit's: [first, first(u+1))

  // One step over the pieces in order 0..n-1 (see above). Errors name file and offset.
  absl::Status Begin();
  absl::StatusOr<Arrays> Acquire(int piece);
  absl::Status Release(int piece);
  absl::Status Finish();  // Drain(), then Commit() if it succeeded
  // Waits for every request of the step (first error, naming file and offset); Commit then
  // makes the copy just written the current one. Split so that ranks can agree on the
  // verdict in between: either every rank switches copies or none does.
  absl::Status Drain();
  void Commit();
  // After an error between Begin and Finish: waits for every request in flight (errors
  // ignored: the first was reported) and keeps the current copy.
  void Abandon();

  // Outside a step: unit u's arrays (whole shard) of the current copy, synchronously through
  // slot 0, piece by piece.
  // null arrays are skipped on Store (zero-filled in the file) and on Load.
  absl::Status Load(int unit, float* master, float* m, float* v);
  absl::Status Store(int unit, const float* master, const float* m, const float* v);
  // The same for any layout: out[a] / in[a] for each array a of `element_bytes` (null: skipped).
  absl::Status LoadArrays(int unit, void* const* out);
  absl::Status StoreArrays(int unit, const void* const* in);
  const std::vector<int>& element_bytes() const { return element_bytes_; }

  int current_copy() const { return current_; }

 private:
  NvmeState(AioEngine* io, const SwapFile* file, std::vector<Piece> pieces,
            std::vector<int> first, char* slots, int64_t slot_bytes,
            std::vector<int> element_bytes);
  static int64_t PieceStride(int64_t n, const std::vector<int>& element_bytes);
  int64_t ArrayOffset(int piece, int array) const;  // within the piece's bytes
  static std::vector<Piece> PiecesOf(const std::vector<int64_t>& unit_elements,
                                     int64_t piece_elements, std::vector<int>* first);
  int64_t Offset(int copy, int piece) const;  // of the piece's master|m|v in the file
  int64_t PieceBytes(int piece) const;
  char* Slot(int piece) const { return slots_ + (piece % kSlots) * slot_bytes_; }
  void Start(IoOp op, int copy, int piece);
  absl::Status WaitSlot(int slot);

  AioEngine* const io_;
  const SwapFile* const file_;
  const std::vector<Piece> pieces_;
  const std::vector<int> first_;  // per unit, and one past the last
  const std::vector<int> element_bytes_;  // per array of a piece
  std::vector<int64_t> offset_;   // of each piece within a copy
  int64_t copy_bytes_ = 0;
  char* const slots_;
  const int64_t slot_bytes_;
  int current_ = 0;                                  // the copy steps read
  AioEngine::Ticket pending_[kSlots] = {0, 0, 0};    // per slot: its request in flight
};

}  // namespace nvme
}  // namespace zerort

#endif  // ZERORT_NVME_STATE_H_
