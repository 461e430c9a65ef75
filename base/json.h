// The project's one JSON reader: the config (zero/config), model files (zero/model_spec) and the
// checkpoint manifest (checkpoint/internal/ckpt_manifest) all parse through here, so all three
// refuse the same things the same way.
//
// Strict where nlohmann-json is lenient: a duplicate key is an error (nlohmann keeps the last
// one silently), as are a NUL byte, bytes after the document, and nesting beyond a limit (deep
// documents cost stack when destroyed). Every error names the text (`what`: a file name,
// "manifest", "<config>") and, for syntax errors, the line and column. Files are read with a
// size bound and must be regular files, so a mistyped /dev/zero or a FIFO cannot hang or
// exhaust memory.
//
//   ASSIGN_OR_RETURN(Json doc, LoadJsonFile(path, "config"));
//   JsonFields root(doc, "");
//   ASSIGN_OR_RETURN(int64_t steps, root.Int("steps", 0, 1000));  // "steps: expected ..."
//
// The documents are nlohmann::ordered_json: the key order of the text is kept, so the first
// offending key in a file is the one reported and a dump reads in the writer's order.
//
// Thread safety: pure functions; JsonFields is a read-only view.
#ifndef ZERORT_BASE_JSON_H_
#define ZERORT_BASE_JSON_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "nlohmann/json.hpp"

namespace zerort {

using Json = nlohmann::ordered_json;

// Config and model files are a few kilobytes; 16 MiB is far beyond any real one.
constexpr int64_t kMaxJsonFileBytes = int64_t{16} << 20;

struct JsonLimits {
  size_t max_depth = 32;  // >= 1: containers nested deeper are refused, naming the path
};

// Parses `text` as one JSON document. InvalidArgument:
//   "<what>:LINE:COL: not valid JSON: <reason>"   (syntax, trailing bytes, a NUL byte)
//   "<what>: <path>: duplicate key (JSON would keep only one)"
//   "<what>: <path>: nested deeper than <max_depth> levels"
absl::StatusOr<Json> ParseJson(absl::string_view text, absl::string_view what,
                               const JsonLimits& limits = {});

// The bytes of a regular file of at most `max_bytes`. Errors read
// "cannot read <what> file \"<path>\": <reason>": NotFound, PermissionDenied, InvalidArgument
// for a directory, a device or FIFO, or a file over the limit (the message names the limit).
absl::StatusOr<std::string> ReadBoundedFile(const std::string& path, absl::string_view what,
                                            int64_t max_bytes = kMaxJsonFileBytes);

// ReadBoundedFile, then ParseJson with the path as `what`.
absl::StatusOr<Json> LoadJsonFile(const std::string& path, absl::string_view what,
                                  int64_t max_bytes = kMaxJsonFileBytes,
                                  const JsonLimits& limits = {});

// ---- Reading typed values. Errors are InvalidArgument "<path>: expected <what>, got <value>".

// "parent.key" ("key" at the root, parent ""); "parent[i]".
std::string JsonPath(absl::string_view parent, absl::string_view key);
std::string JsonPath(absl::string_view parent, size_t index);

// How an error shows a value: "an object", "an array", "null", "12", "\"text\"" (long strings
// cut to 48 characters).
std::string DescribeJson(const Json& v);

absl::Status JsonExpected(absl::string_view path, absl::string_view what, const Json& got);

// Whether 5e8 or 3.0 count as integers (DeepSpeed configs write sizes so; a checkpoint
// manifest, written by us, never does).
enum class IntegralFloats { kRefuse, kAccept };

// `v` as an integer in [lo, hi]; `what` describes the expectation in the error (default
// "an integer in lo..hi").
absl::StatusOr<int64_t> JsonToInt(const Json& v, absl::string_view path, int64_t lo, int64_t hi,
                                  IntegralFloats floats = IntegralFloats::kRefuse,
                                  absl::string_view what = {});

// ---- Key checking: a misspelt key is refused, never ignored.

// Levenshtein distance, ignoring ASCII case.
size_t EditDistance(absl::string_view a, absl::string_view b);

// The candidate nearest to `key` when it is plausibly what was meant (distance at most
// min(3, max(1, key.size() / 3))), else "".
absl::string_view NearestKey(absl::string_view key,
                             absl::Span<const absl::string_view> candidates);

// OK when every member of `obj` (an object at `path`) is in `allowed`; else InvalidArgument
// "<path>.<key>: unknown key; did you mean \"<nearest>\"?" or, with nothing near,
// "<path>.<key>: unknown key (expected <allowed, comma-separated>)".
absl::Status CheckJsonKeys(const Json& obj, absl::string_view path,
                           absl::Span<const absl::string_view> allowed);

// The members of one JSON object, each read with its type checked and its path in the error.
// The getters are for required members ("<path>: missing" when absent); Find serves optional
// ones. REQUIRES: `obj` outlives the JsonFields.
class JsonFields {
 public:
  JsonFields(const Json& obj, std::string path) : obj_(obj), path_(std::move(path)) {}

  const std::string& path() const { return path_; }
  std::string Path(absl::string_view key) const { return JsonPath(path_, key); }
  // The member, or nullptr when it is absent (or the value is not an object).
  const Json* Find(absl::string_view key) const;

  absl::StatusOr<const Json*> Get(absl::string_view key) const;
  absl::StatusOr<int64_t> Int(absl::string_view key, int64_t lo, int64_t hi) const;
  absl::StatusOr<double> Number(absl::string_view key) const;
  absl::StatusOr<bool> Bool(absl::string_view key) const;
  absl::StatusOr<std::string> String(absl::string_view key, size_t max_length = 4096) const;
  absl::StatusOr<const Json*> Array(absl::string_view key, size_t max_size) const;
  absl::StatusOr<const Json*> Object(absl::string_view key) const;

 private:
  const Json& obj_;
  const std::string path_;
};

}  // namespace zerort

#endif  // ZERORT_BASE_JSON_H_
