#include "base/dtype.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/half.h"  // the conversions dtype.h offers, defined once for host and device

namespace zerort {

absl::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "fp32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "fp16";
  }
  return "unknown";
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  if (name == "fp32" || name == "float32") return DType::kF32;
  if (name == "bf16" || name == "bfloat16") return DType::kBF16;
  if (name == "fp16" || name == "float16") return DType::kF16;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", name, "': expected one of fp32, bf16, fp16"));
}

}  // namespace zerort
