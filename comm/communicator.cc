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

}  // namespace comm
}  // namespace zerort
