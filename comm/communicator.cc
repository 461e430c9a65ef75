#include "comm/communicator.h"

#include "absl/strings/str_cat.h"

namespace zerort {
namespace comm {

absl::string_view ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMax:
      return "max";
  }
  return "unknown";
}

absl::StatusOr<std::unique_ptr<Communicator>> Communicator::Split(int color, int key) {
  return absl::UnimplementedError(absl::StrCat("Split(color=", color, ", key=", key,
                                               ") on rank ", rank(), ": the \"", backend(),
                                               "\" communicator cannot split into groups"));
}

absl::Status Communicator::ReduceScatterInGroups(const void* send, void* recv, size_t count,
                                                 DType dtype, ReduceOp op, int group_size,
                                                 Stream stream) {
  if (group_size < 1 || size() % group_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ReduceScatterInGroups on rank ", rank(), ": group_size ", group_size,
        " must be >= 1 and divide the communicator's size ", size()));
  }
  if (group_size == size()) return ReduceScatter(send, recv, count, dtype, op, stream);
  return absl::UnimplementedError(absl::StrCat(
      "ReduceScatterInGroups(group_size=", group_size, ") on rank ", rank(), ": the \"",
      backend(), "\" communicator has no grouped reduce-scatter"));
}

}  // namespace comm
}  // namespace zerort
