#include "base/json.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace zerort {
namespace {

// 1-based line and column of the byte before `position` (nlohmann reports the count of bytes
// read, so the offending byte is the last one read).
std::pair<size_t, size_t> LineAndColumn(absl::string_view text, size_t position) {
  size_t end = std::min(position, text.size());
  if (end > 0) --end;  // index of the last byte read
  size_t line = 1, line_start = 0;
  for (size_t i = 0; i < end; ++i) {
    if (text[i] == '\n') {
      ++line;
      line_start = i + 1;
    }
  }
  return {line, end - line_start + 1};
}

absl::Status SyntaxError(absl::string_view text, absl::string_view what, size_t position,
                         absl::string_view reason) {
  auto [line, column] = LineAndColumn(text, position);
  return absl::InvalidArgumentError(
      absl::StrCat(what, ":", line, ":", column, ": not valid JSON: ", reason));
}

// nlohmann's what() reads "[json.exception.parse_error.101] parse error at line 2, column 3:
// syntax error while parsing ..."; we keep the part after the position, which we compute ourselves.
std::string ParseErrorReason(const char* what) {
  absl::string_view w(what);
  size_t column = w.find("column ");
  if (column != absl::string_view::npos) {
    size_t colon = w.find(": ", column);
    if (colon != absl::string_view::npos) return std::string(w.substr(colon + 2));
  }
  size_t bracket = w.find("] ");
  if (bracket != absl::string_view::npos) return std::string(w.substr(bracket + 2));
  return std::string(w);
}

// Builds the document from nlohmann's SAX events, refusing duplicate keys and deep nesting.
class StrictDomBuilder {
 public:
  StrictDomBuilder(absl::string_view text, absl::string_view what, size_t max_depth, Json* root)
      : text_(text), what_(what), max_depth_(max_depth), root_(root) {}

  const absl::Status& status() const { return status_; }

  // The nlohmann SAX interface.
  bool null() { return Add(Json(nullptr)); }
  bool boolean(bool v) { return Add(Json(v)); }
  bool number_integer(Json::number_integer_t v) { return Add(Json(v)); }
  bool number_unsigned(Json::number_unsigned_t v) { return Add(Json(v)); }
  bool number_float(Json::number_float_t v, const Json::string_t& /*raw*/) { return Add(Json(v)); }
  bool string(Json::string_t& v) { return Add(Json(std::move(v))); }
  bool binary(Json::binary_t& /*v*/) {
    assert(false && "JSON text has no binary values");
    return false;
  }
  bool start_object(std::size_t /*size*/) { return Open(Json::object()); }
  bool start_array(std::size_t /*size*/) { return Open(Json::array()); }
  bool end_object() { return Close(); }
  bool end_array() { return Close(); }
  bool key(Json::string_t& k) {
    Frame& top = stack_.back();
    assert(top.value->is_object());
    if (top.value->contains(k)) {
      status_ = absl::InvalidArgumentError(absl::StrCat(
          what_, ": ", JsonPath(top.path, k), ": duplicate key (JSON would keep only one)"));
      return false;
    }
    top.key = std::move(k);
    return true;
  }
  bool parse_error(std::size_t position, const std::string& /*last_token*/,
                   const nlohmann::detail::exception& ex) {
    status_ = SyntaxError(text_, what_, position, ParseErrorReason(ex.what()));
    return false;
  }

 private:
  struct Frame {
    Json* value;
    std::string path;  // "" for the root
    std::string key;   // objects: the key whose value comes next
  };

  // Where the next value goes and its path.
  std::pair<Json*, std::string> Slot(Json v) {
    if (stack_.empty()) {
      *root_ = std::move(v);
      return {root_, ""};
    }
    // Appending to the top container never moves its ancestors, so the Frame pointers stay valid.
    Frame& top = stack_.back();
    if (top.value->is_array()) {
      std::string path = JsonPath(top.path, top.value->size());
      top.value->push_back(std::move(v));
      return {&top.value->back(), std::move(path)};
    }
    Json& slot = (*top.value)[top.key];
    slot = std::move(v);
    return {&slot, JsonPath(top.path, top.key)};
  }

  bool Add(Json v) {
    Slot(std::move(v));
    return true;
  }

  bool Open(Json container) {
    auto [value, path] = Slot(std::move(container));
    if (stack_.size() >= max_depth_) {
      status_ = absl::InvalidArgumentError(absl::StrCat(what_, ": ", path.empty() ? "<root>" : path,
                                                        ": nested deeper than ", max_depth_,
                                                        " levels"));
      return false;
    }
    stack_.push_back(Frame{value, std::move(path), {}});
    return true;
  }

  bool Close() {
    assert(!stack_.empty());
    stack_.pop_back();
    return true;
  }

  absl::string_view text_;
  absl::string_view what_;
  size_t max_depth_;
  Json* root_;
  std::vector<Frame> stack_;
  absl::Status status_;
};

absl::Status FileError(absl::string_view what, const std::string& path, int err) {
  char buffer[256];
  // GNU strerror_r: thread-safe, returns the message (possibly not in `buffer`).
  std::string message = absl::StrCat("cannot read ", what, " file \"", path,
                                     "\": ", strerror_r(err, buffer, sizeof buffer));
  switch (err) {
    case ENOENT:
    case ENOTDIR:
      return absl::NotFoundError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    case EISDIR:
      return absl::InvalidArgumentError(message);
    default:
      return absl::UnknownError(message);
  }
}

absl::Status TooLarge(absl::string_view what, const std::string& path, int64_t max_bytes) {
  return absl::InvalidArgumentError(absl::StrCat("cannot read ", what, " file \"", path,
                                                 "\": larger than the limit of ", max_bytes,
                                                 " bytes for a ", what, " file"));
}

// Reads at most max_bytes + 1 bytes: a file that grows after fstat is still caught.
absl::StatusOr<std::string> ReadOpenFile(int fd, absl::string_view what, const std::string& path,
                                         int64_t max_bytes) {
  std::string text;
  char chunk[1 << 16];
  while (static_cast<int64_t>(text.size()) <= max_bytes) {
    ssize_t n = ::read(fd, chunk, sizeof chunk);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return FileError(what, path, errno);
    if (n == 0) return text;
    text.append(chunk, static_cast<size_t>(n));
  }
  return TooLarge(what, path, max_bytes);
}

}  // namespace

absl::StatusOr<Json> ParseJson(absl::string_view text, absl::string_view what,
                               const JsonLimits& limits) {
  // nlohmann would stop at a NUL as at any bad byte; naming it tells the user they opened a
  // binary file (or one truncated by a crash that zero-filled its tail).
  if (size_t nul = text.find('\0'); nul != absl::string_view::npos) {
    return SyntaxError(text, what, nul + 1, "a NUL byte (binary data, not JSON text)");
  }
  Json root;
  StrictDomBuilder builder(text, what, std::max<size_t>(1, limits.max_depth), &root);
  bool ok = false;
  try {
    // strict = true: bytes after the document are a syntax error.
    ok = Json::sax_parse(text.begin(), text.end(), &builder, Json::input_format_t::json,
                         /*strict=*/true);
  } catch (const std::exception& e) {
    // sax_parse reports syntax errors through parse_error(); anything thrown is unexpected, but
    // it must not escape a Status API.
    return absl::InternalError(absl::StrCat(what, ": JSON parser failed: ", e.what()));
  }
  if (!ok) {
    assert(!builder.status().ok());
    return builder.status();
  }
  return root;
}

absl::StatusOr<std::string> ReadBoundedFile(const std::string& path, absl::string_view what,
                                            int64_t max_bytes) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below as not regular.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return FileError(what, path, errno);
  struct stat st;
  absl::StatusOr<std::string> text;
  if (::fstat(fd, &st) != 0) {
    text = FileError(what, path, errno);
  } else if (S_ISDIR(st.st_mode)) {
    text = FileError(what, path, EISDIR);
  } else if (!S_ISREG(st.st_mode)) {
    text = absl::InvalidArgumentError(absl::StrCat("cannot read ", what, " file \"", path,
                                                   "\": not a regular file (a device, FIFO "
                                                   "or socket)"));
  } else if (st.st_size > max_bytes) {
    text = TooLarge(what, path, max_bytes);
  } else {
    text = ReadOpenFile(fd, what, path, max_bytes);
  }
  ::close(fd);
  return text;
}

absl::StatusOr<Json> LoadJsonFile(const std::string& path, absl::string_view what,
                                  int64_t max_bytes, const JsonLimits& limits) {
  absl::StatusOr<std::string> text = ReadBoundedFile(path, what, max_bytes);
  if (!text.ok()) return text.status();
  return ParseJson(*text, path, limits);
}

std::string JsonPath(absl::string_view parent, absl::string_view key) {
  if (parent.empty()) return std::string(key);
  return absl::StrCat(parent, ".", key);
}

std::string JsonPath(absl::string_view parent, size_t index) {
  return absl::StrCat(parent, "[", index, "]");
}

std::string DescribeJson(const Json& v) {
  switch (v.type()) {
    case Json::value_t::array:
      return "an array";
    case Json::value_t::object:
      return "an object";
    case Json::value_t::string: {
      std::string s = v.dump(-1, ' ', false, Json::error_handler_t::replace);
      if (s.size() > 48) s = s.substr(0, 44) + "...\"";
      return s;
    }
    default:
      return v.dump(-1, ' ', false, Json::error_handler_t::replace);
  }
}

absl::Status JsonExpected(absl::string_view path, absl::string_view what, const Json& got) {
  return absl::InvalidArgumentError(
      absl::StrCat(path, ": expected ", what, ", got ", DescribeJson(got)));
}

absl::StatusOr<int64_t> JsonToInt(const Json& v, absl::string_view path, int64_t lo, int64_t hi,
                                  IntegralFloats floats, absl::string_view what) {
  const std::string range = what.empty() ? absl::StrCat("an integer in ", lo, "..", hi) : "";
  if (what.empty()) what = range;
  constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
  int64_t x = 0;
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(kInt64Max)) return JsonExpected(path, what, v);
    x = static_cast<int64_t>(u);
  } else if (v.is_number_integer()) {
    x = v.get<int64_t>();
  } else if (v.is_number_float() && floats == IntegralFloats::kAccept) {
    double d = v.get<double>();
    // 2^63 is exactly representable; every double below it converts without overflow.
    if (!std::isfinite(d) || d != std::trunc(d) || d < -9223372036854775808.0 ||
        d >= 9223372036854775808.0) {
      return JsonExpected(path, what, v);
    }
    x = static_cast<int64_t>(d);
  } else {
    return JsonExpected(path, what, v);
  }
  if (x < lo || x > hi) return JsonExpected(path, what, v);
  return x;
}

size_t EditDistance(absl::string_view a, absl::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t substitute =
          diagonal + (absl::ascii_tolower(a[i - 1]) == absl::ascii_tolower(b[j - 1]) ? 0 : 1);
      diagonal = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, substitute});
    }
  }
  return row[b.size()];
}

absl::string_view NearestKey(absl::string_view key,
                             absl::Span<const absl::string_view> candidates) {
  absl::string_view best;
  size_t best_distance = std::numeric_limits<size_t>::max();
  for (absl::string_view c : candidates) {
    const size_t d = EditDistance(key, c);
    if (d < best_distance) {
      best_distance = d;
      best = c;
    }
  }
  const size_t limit = std::min<size_t>(3, std::max<size_t>(1, key.size() / 3));
  return best_distance <= limit ? best : absl::string_view();
}

absl::Status CheckJsonKeys(const Json& obj, absl::string_view path,
                           absl::Span<const absl::string_view> allowed) {
  if (!obj.is_object()) return absl::OkStatus();  // the type is the getters' to report
  for (const auto& item : obj.items()) {
    const std::string& key = item.key();
    if (std::find(allowed.begin(), allowed.end(), key) != allowed.end()) continue;
    const std::string key_path = JsonPath(path, key);
    if (absl::string_view near = NearestKey(key, allowed); !near.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(key_path, ": unknown key; did you mean \"", near, "\"?"));
    }
    return absl::InvalidArgumentError(absl::StrCat(key_path, ": unknown key (expected ",
                                                   absl::StrJoin(allowed, ", "), ")"));
  }
  return absl::OkStatus();
}

const Json* JsonFields::Find(absl::string_view key) const {
  if (!obj_.is_object()) return nullptr;
  auto it = obj_.find(std::string(key));
  return it == obj_.end() ? nullptr : &*it;
}

absl::StatusOr<const Json*> JsonFields::Get(absl::string_view key) const {
  if (!obj_.is_object()) return JsonExpected(path_.empty() ? "<root>" : path_, "an object", obj_);
  const Json* v = Find(key);
  if (v == nullptr) return absl::InvalidArgumentError(absl::StrCat(Path(key), ": missing"));
  return v;
}

absl::StatusOr<int64_t> JsonFields::Int(absl::string_view key, int64_t lo, int64_t hi) const {
  absl::StatusOr<const Json*> v = Get(key);
  if (!v.ok()) return v.status();
  return JsonToInt(**v, Path(key), lo, hi);
}

absl::StatusOr<double> JsonFields::Number(absl::string_view key) const {
  absl::StatusOr<const Json*> v = Get(key);
  if (!v.ok()) return v.status();
  if (!(*v)->is_number()) return JsonExpected(Path(key), "a number", **v);
  return (*v)->get<double>();
}

absl::StatusOr<bool> JsonFields::Bool(absl::string_view key) const {
  absl::StatusOr<const Json*> v = Get(key);
  if (!v.ok()) return v.status();
  if (!(*v)->is_boolean()) return JsonExpected(Path(key), "true or false", **v);
  return (*v)->get<bool>();
}

absl::StatusOr<std::string> JsonFields::String(absl::string_view key, size_t max_length) const {
  absl::StatusOr<const Json*> v = Get(key);
  if (!v.ok()) return v.status();
  if (!(*v)->is_string()) return JsonExpected(Path(key), "a string", **v);
  const std::string& s = (*v)->get_ref<const std::string&>();
  if (s.size() > max_length) {
    return JsonExpected(Path(key), absl::StrCat("a string of at most ", max_length, " bytes"),
                        **v);
  }
  return s;
}

absl::StatusOr<const Json*> JsonFields::Array(absl::string_view key, size_t max_size) const {
  absl::StatusOr<const Json*> v = Get(key);
  if (!v.ok()) return v.status();
  if (!(*v)->is_array() || (*v)->size() > max_size) {
    return JsonExpected(Path(key), absl::StrCat("an array of at most ", max_size, " entries"),
                        **v);
  }
  return *v;
}

absl::StatusOr<const Json*> JsonFields::Object(absl::string_view key) const {
  absl::StatusOr<const Json*> v = Get(key);
  if (!v.ok()) return v.status();
  if (!(*v)->is_object()) return JsonExpected(Path(key), "an object", **v);
  return *v;
}

}  // namespace zerort
