// Status plumbing shared by every zerort package.
//
// Abseil 20220623 (Debian bookworm) ships Status/StatusOr but no status macros, so these are ours.
// Fallible calls return absl::Status or absl::StatusOr<T>; these macros keep call sites to one
// line. Device-library codes (CUDA, NCCL) are converted in base/cuda_status.h, MPI codes in comm/.
//
//   absl::StatusOr<Plan> MakePlan(...) {
//     RETURN_IF_ERROR(Validate(options));
//     ASSIGN_OR_RETURN(std::vector<Unit> units, BuildUnits(specs, options));
//     ...
//   }
#ifndef ZERORT_BASE_STATUS_H_
#define ZERORT_BASE_STATUS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define ZERORT_STATUS_CONCAT_INNER_(a, b) a##b
#define ZERORT_STATUS_CONCAT_(a, b) ZERORT_STATUS_CONCAT_INNER_(a, b)

// Returns the status from the enclosing function if `expr` is not OK.
#define RETURN_IF_ERROR(expr)                                      \
  do {                                                             \
    ::absl::Status zerort_status_ = (expr);                        \
    if (!zerort_status_.ok()) return zerort_status_;               \
  } while (false)

// `ASSIGN_OR_RETURN(T x, StatusOr-expr)`: declares/assigns `x` or returns the error.
#define ASSIGN_OR_RETURN(lhs, expr) \
  ZERORT_ASSIGN_OR_RETURN_IMPL_(ZERORT_STATUS_CONCAT_(zerort_statusor_, __LINE__), lhs, expr)

#define ZERORT_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                  \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

namespace zerort {

// Prefixes `context` to a non-OK status's message, keeping its code: "loading x: <message>".
inline absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), std::string(context) + ": " + std::string(status.message()));
}

}  // namespace zerort

#endif  // ZERORT_BASE_STATUS_H_
