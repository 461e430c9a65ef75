// Pieces every backend shares: operation descriptors, the ring of recent operations printed with
// timeout errors, buffer validation, and the text of error messages.
// Not thread-safe: each Communicator owns its OpHistory and uses it from its own thread.
#ifndef ZERORT_COMM_INTERNAL_COMMON_H_
#define ZERORT_COMM_INTERNAL_COMMON_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "base/dtype.h"
#include "comm/communicator.h"

namespace zerort {
namespace comm {
namespace internal {

enum class OpKind : int32_t {
  kAllGather,
  kReduceScatter,
  kAllReduce,
  kBroadcast,
  kBarrier,
  kSplit,
  // Communicator::ReduceScatterInGroups; OpDesc::root carries its group_size.
  kReduceScatterInGroups,
};

// "all_gather", "reduce_scatter", "all_reduce", "broadcast", "barrier", "split",
// "reduce_scatter_in_groups".
absl::string_view OpKindName(OpKind kind);

// What one rank asked for; ranks must agree on everything here. Plain data so that the MPI
// backend can exchange it as bytes.
struct OpDesc {
  int64_t seq = 0;  // per-communicator sequence number, from 1
  OpKind kind = OpKind::kBarrier;
  int32_t dtype = 0;  // DType as int
  int32_t reduce_op = 0;  // ReduceOp as int
  int32_t root = 0;  // Broadcast's root; ReduceScatterInGroups's group_size
  uint64_t count = 0;
};

inline OpDesc MakeOpDesc(int64_t seq, OpKind kind, size_t count, DType dtype, ReduceOp op,
                         int root) {
  OpDesc d;
  d.seq = seq;
  d.kind = kind;
  d.count = count;
  d.dtype = static_cast<int32_t>(dtype);
  d.reduce_op = static_cast<int32_t>(op);
  d.root = root;
  return d;
}

// First element of rank r's slice when `count` elements are split over `world` ranks as evenly
// as possible (the first count % world slices one longer). SliceBegin(count, world, world) ==
// count.
inline size_t SliceBegin(size_t count, int world, int r) {
  const size_t n = static_cast<size_t>(world);
  const size_t base = count / n, rem = count % n;
  const size_t rr = static_cast<size_t>(r);
  return rr * base + (rr < rem ? rr : rem);
}

// Reductions: ReduceScatter, AllReduce, ReduceScatterInGroups.
inline bool IsReduction(OpKind k) {
  return k == OpKind::kReduceScatter || k == OpKind::kAllReduce ||
         k == OpKind::kReduceScatterInGroups;
}

// "all_reduce #7 (count=1000, dtype=bf16, op=sum)".
std::string DescribeOp(const OpDesc& d);

// Empty when `a` and `b` agree (only kind and seq when !full); else names both ranks' arguments.
std::string CompareOps(const OpDesc& a, int rank_a, const OpDesc& b, int rank_b, bool full);

// Null pointers with count > 0, and overlaps other than the documented in-place layouts.
absl::Status ValidateBuffers(const OpDesc& d, const void* send, const void* recv, int rank,
                             int size);

// Ring of the last `capacity` operations: sequence, op, bytes, start, end.
class OpHistory {
 public:
  explicit OpHistory(size_t capacity) : entries_(capacity) {}
  void Begin(const OpDesc& d, size_t bytes);
  void End();
  // One line per operation, oldest first; an unfinished one says "(in flight)".
  std::string Format() const;

 private:
  struct Entry {
    int64_t seq = 0;
    OpKind kind = OpKind::kBarrier;
    size_t bytes = 0;
    absl::Time start;
    absl::Time end;
    bool done = false;
  };
  std::vector<Entry> entries_;
  size_t next_ = 0;
  size_t used_ = 0;
};

}  // namespace internal
}  // namespace comm
}  // namespace zerort

#endif  // ZERORT_COMM_INTERNAL_COMMON_H_
