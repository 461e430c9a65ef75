// How one ParseConfig reads its JSON: the collector of every problem, note and "auto" key of
// the parse (Reader), the key check of one object, and typed value readers whose errors read
// "<path>: expected <what>, got <value>". Shared by the table-driven reader (zero/config.cc) and
// the hand-written scheduler block (config_scheduler.cc); private to zero:config.
//
//   Reader r(&config);
//   r.Check(ReadBool(obj, "zerort", "strict", &config.strict));
//   RETURN_IF_ERROR(r.Finish("ds.json", /*strict=*/false));
//
// Thread safety: a Reader belongs to one parse; the functions are pure.
#ifndef ZERORT_ZERO_INTERNAL_CONFIG_READER_H_
#define ZERORT_ZERO_INTERNAL_CONFIG_READER_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "base/json.h"
#include "zero/config.h"
#include "zero/internal/config_keys.h"

namespace zerort {
namespace config_internal {

// Everything one parse collects: every problem (not only the first: a user fixing a pasted
// config should see them all at once), the notes, and the keys written as "auto".
class Reader {
 public:
  explicit Reader(Config* config) : config_(config) {}

  void Check(const absl::Status& s) {
    if (!s.ok()) errors_.push_back(s);
  }
  void Error(std::string message) { errors_.push_back(absl::InvalidArgumentError(message)); }
  void Note(std::string note) { config_->notes.push_back(std::move(note)); }
  // A key that has no effect here: a note, or an error in strict mode.
  void Ignored(std::string note) {
    ignored_.push_back(config_->notes.size());
    Note(std::move(note));
  }
  void Auto(std::string path) { config_->auto_keys.push_back(std::move(path)); }
  // The problems `other` found, each unless one with the same message is already reported.
  void AbsorbErrors(const Reader& other);
  // Whether a problem was reported at `path` or below it: rules across keys skip keys that
  // did not parse, rather than report a second, misleading problem about them.
  bool Failed(absl::string_view path) const {
    for (const absl::Status& s : errors_) {
      absl::string_view m = s.message();
      // "path" itself or a key below it, not a sibling that merely starts the same
      // ("zero_optimization.stage" is not "zero_optimization.stage3_...").
      if (absl::ConsumePrefix(&m, path) &&
          (m.empty() || m[0] == ':' || m[0] == '.' || m[0] == '[' || m[0] == ' ')) {
        return true;
      }
    }
    return false;
  }
  absl::Status Finish(absl::string_view source, bool strict);

 private:
  Config* config_;
  std::vector<absl::Status> errors_;
  std::vector<size_t> ignored_;  // indices into config_->notes
};

bool IsAuto(const Json& v);

// obj[key] is "auto": recorded under `path` (the canonical spelling), nothing else read.
bool TakeAuto(Reader* r, const Json& obj, const char* key, const std::string& path);

// Checks every key of `obj` (at `path`) against the settings valid there and the DeepSpeed keys
// without effect (`foreign`: noted, or refused unless at their default), in document order. An
// unknown key is an error with a did-you-mean, except at the top level, where a key that is
// neither a setting nor a DeepSpeed key nor close to one is ignored with a note, as DeepSpeed
// ignores foreign top-level keys.
void CheckKeys(Reader* r, const Json& obj, const std::string& path,
               const std::vector<absl::string_view>& settings, const std::vector<KeyDef>& foreign);

// DeepSpeed spells several settings two ways; one of them, or an error naming both. Returns the
// spelling present (or `canonical` when neither is).
const char* Spelling(Reader* r, const Json& obj, const std::string& path, const char* canonical,
                     const char* alias);

// An integer in [lo, hi]. DeepSpeed configs write sizes as 5e8, so integral floats count.
absl::Status ToInt64(const Json& v, const std::string& path, int64_t lo, int64_t hi,
                     absl::string_view what, int64_t* out);
// "an integer >= lo", "an integer in lo..hi", ...
std::string IntRange(int64_t lo, int64_t hi);
absl::Status ToDouble(const Json& v, const std::string& path, const DoubleRange& r, double* out);
absl::Status ToBool(const Json& v, const std::string& path, bool* out);

// obj[key], when present, read into *out; absent keeps the default already there.
absl::Status ReadInt64(const Json& obj, const std::string& path, const char* key, int64_t lo,
                       int64_t* out);
absl::Status ReadDouble(const Json& obj, const std::string& path, const char* key,
                        const DoubleRange& r, double* out);
absl::Status ReadBool(const Json& obj, const std::string& path, const char* key, bool* out);
// The same, where "auto" is also accepted: recorded, default kept.
absl::Status ReadDoubleOrAuto(Reader* r, const Json& obj, const std::string& path, const char* key,
                              const DoubleRange& range, double* out);
absl::Status ReadInt64OrAuto(Reader* r, const Json& obj, const std::string& path, const char* key,
                             int64_t lo, int64_t* out);
// obj[key] as an object; null when absent, or when not an object (reported).
const Json* Object(Reader* r, const Json& obj, const std::string& path, const char* key);

}  // namespace config_internal
}  // namespace zerort

#endif  // ZERORT_ZERO_INTERNAL_CONFIG_READER_H_
