#include "comm/internal/common.h"

#include "absl/strings/str_cat.h"

namespace zerort {
namespace comm {

namespace internal {

absl::string_view OpKindName(OpKind kind) {
  switch (kind) {
    case OpKind::kAllGather:
      return "all_gather";
    case OpKind::kReduceScatter:
      return "reduce_scatter";
    case OpKind::kAllReduce:
      return "all_reduce";
    case OpKind::kBroadcast:
      return "broadcast";
    case OpKind::kBarrier:
      return "barrier";
    case OpKind::kSplit:
      return "split";
    case OpKind::kReduceScatterInGroups:
      return "reduce_scatter_in_groups";
  }
  return "unknown";
}

namespace {
std::string Args(const OpDesc& d) {
  std::string s = absl::StrCat(OpKindName(d.kind), " #", d.seq);
  if (d.kind == OpKind::kBarrier || d.kind == OpKind::kSplit) return s;
  absl::StrAppend(&s, " (count=", d.count, ", dtype=", DTypeName(static_cast<DType>(d.dtype)));
  if (IsReduction(d.kind)) {
    absl::StrAppend(&s, ", op=", ReduceOpName(static_cast<ReduceOp>(d.reduce_op)));
  }
  if (d.kind == OpKind::kBroadcast) absl::StrAppend(&s, ", root=", d.root);
  if (d.kind == OpKind::kReduceScatterInGroups) absl::StrAppend(&s, ", group_size=", d.root);
  return s + ")";
}
}  // namespace

std::string DescribeOp(const OpDesc& d) { return Args(d); }

std::string CompareOps(const OpDesc& a, int rank_a, const OpDesc& b, int rank_b, bool full) {
  bool same = a.kind == b.kind && a.seq == b.seq;
  if (full && same) {
    same = a.count == b.count && a.dtype == b.dtype &&
           (!IsReduction(a.kind) || a.reduce_op == b.reduce_op) &&
           ((a.kind != OpKind::kBroadcast && a.kind != OpKind::kReduceScatterInGroups) ||
            a.root == b.root);
  }
  if (same) return "";
  return absl::StrCat("collective argument mismatch: rank ", rank_a, " called ", Args(a),
                      " but rank ", rank_b, " called ", Args(b));
}

absl::Status ValidateBuffers(const OpDesc& d, const void* send, const void* recv, int rank,
                             int size) {
  if (d.kind == OpKind::kBarrier || d.kind == OpKind::kSplit || d.count == 0) {
    return absl::OkStatus();
  }
  const size_t es = DTypeSize(static_cast<DType>(d.dtype));
  const size_t n = static_cast<size_t>(d.count);
  if (d.kind == OpKind::kBroadcast) {
    if (send == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("rank ", rank, ": ", Args(d), ": buffer is null"));
    }
    return absl::OkStatus();
  }
  if (send == nullptr || recv == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, ": ", Args(d), ": ",
                                                   send == nullptr ? "send" : "recv",
                                                   " buffer is null"));
  }
  const uintptr_t s = reinterpret_cast<uintptr_t>(send);
  const uintptr_t r = reinterpret_cast<uintptr_t>(recv);
  const size_t block = n * es;
  size_t send_bytes = block, recv_bytes = block;
  bool in_place = s == r;
  if (d.kind == OpKind::kAllGather) {
    recv_bytes *= size;
    in_place = s == r + static_cast<size_t>(rank) * block;
  } else if (d.kind == OpKind::kReduceScatter) {
    send_bytes *= size;
    in_place = r == s + static_cast<size_t>(rank) * block;
  } else if (d.kind == OpKind::kReduceScatterInGroups) {
    const int g = d.root;
    if (g < 1 || size % g != 0) {
      return absl::InvalidArgumentError(absl::StrCat("rank ", rank, ": ", Args(d),
                                                     ": group_size must be >= 1 and divide ",
                                                     "the communicator's size ", size));
    }
    send_bytes *= g;
    in_place = r == s + static_cast<size_t>(rank % g) * block;
  }
  const bool overlap = s < r + recv_bytes && r < s + send_bytes;
  if (overlap && !in_place) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", rank, ": ", Args(d),
        ": send and recv overlap but are not the in-place layout (send=", absl::Hex(s),
        ", recv=", absl::Hex(r), ")"));
  }
  return absl::OkStatus();
}

void OpHistory::Begin(const OpDesc& d, size_t bytes) {
  if (entries_.empty()) return;
  Entry& e = entries_[next_];
  e.seq = d.seq;
  e.kind = d.kind;
  e.bytes = bytes;
  e.start = absl::Now();
  e.done = false;
  next_ = (next_ + 1) % entries_.size();
  if (used_ < entries_.size()) ++used_;
}

void OpHistory::End() {
  if (used_ == 0) return;
  Entry& e = entries_[(next_ + entries_.size() - 1) % entries_.size()];
  e.end = absl::Now();
  e.done = true;
}

std::string OpHistory::Format() const {
  std::string out = absl::StrCat("recent operations (oldest first, ", used_, "):");
  for (size_t i = 0; i < used_; ++i) {
    const Entry& e = entries_[(next_ + entries_.size() - used_ + i) % entries_.size()];
    absl::StrAppend(&out, "\n  #", e.seq, " ", OpKindName(e.kind), " ", e.bytes, " B start=",
                    absl::FormatTime("%H:%M:%E6S", e.start, absl::UTCTimeZone()));
    if (e.done) {
      absl::StrAppend(&out, " took ", absl::FormatDuration(e.end - e.start));
    } else {
      absl::StrAppend(&out, " (in flight)");
    }
  }
  return out;
}

}  // namespace internal
}  // namespace comm
}  // namespace zerort
