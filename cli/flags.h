// Command-line flags for `zerort` subcommands: "--name value", "--name=value" and boolean
// "--name". Every flag must be declared by the command; an unknown, repeated or malformed flag
// is an InvalidArgument naming it, so a typo never silently falls back to a default.
//
//   ASSIGN_OR_RETURN(Flags flags, Flags::Parse(args, {"world", "stage"}, {"json"}));
//   ASSIGN_OR_RETURN(int64_t world, flags.GetInt("world", /*fallback=*/1, /*min=*/1));
//
// Thread safety: a plain value.
#ifndef ZERORT_CLI_FLAGS_H_
#define ZERORT_CLI_FLAGS_H_

#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "base/dtype.h"

namespace zerort {

class Flags {
 public:
  // `valued` flags take a value; `booleans` take none (or "=true"/"=false").
  static absl::StatusOr<Flags> Parse(const std::vector<std::string>& args,
                                     const std::vector<std::string>& valued,
                                     const std::vector<std::string>& booleans = {});

  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  std::string Get(const std::string& name, const std::string& fallback = "") const;
  // An integer (1e6 and 1000000 both accepted) in [min, max], or `fallback` when absent.
  absl::StatusOr<int64_t> GetInt(const std::string& name, int64_t fallback, int64_t min,
                                 int64_t max = std::numeric_limits<int64_t>::max()) const;
  // --precision: bf16, fp16 or fp32 (DTypeName's spellings), or `fallback` when absent.
  absl::StatusOr<DType> GetComputeDType(const std::string& name, DType fallback) const;

 private:
  std::map<std::string, std::string> values_;
};

}  // namespace zerort

#endif  // ZERORT_CLI_FLAGS_H_
