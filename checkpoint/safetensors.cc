#include "checkpoint/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/json.h"
#include "base/status.h"

namespace zerort {
namespace safetensors {
namespace {

constexpr int64_t kMaxInt = std::numeric_limits<int64_t>::max();

absl::Status Bad(const std::string& path, absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("safetensors file '", path, "': ", what));
}

absl::Status IoError(absl::string_view op, const std::string& path, int err) {
  const std::string msg = absl::StrCat(op, " '", path, "': ", std::strerror(err));
  if (err == ENOENT) return absl::NotFoundError(msg);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
  if (err == ENOSPC || err == EDQUOT) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

// One tensor's entry: exactly dtype, shape and data_offsets, each well typed. Offsets stay
// relative here; the caller places them.
absl::StatusOr<TensorInfo> ParseTensor(const std::string& name, const Json& v,
                                       const std::string& path) {
  const std::string where = absl::StrCat("tensor '", name, "'");
  if (!v.is_object()) return Bad(path, absl::StrCat(where, ": expected an object"));
  constexpr absl::string_view kKeys[] = {"dtype", "shape", "data_offsets"};
  absl::Status keys = CheckJsonKeys(v, name, kKeys);
  if (!keys.ok()) return Bad(path, keys.message());
  JsonFields f(v, name);
  TensorInfo t;
  t.name = name;
  absl::StatusOr<std::string> dtype = f.String("dtype", 16);
  if (!dtype.ok()) return Bad(path, dtype.status().message());
  t.dtype = *dtype;
  const int64_t es = DTypeBytes(t.dtype);
  if (es == 0) return Bad(path, absl::StrCat(where, ": unknown dtype '", t.dtype, "'"));
  absl::StatusOr<const Json*> shape = f.Array("shape", 64);
  if (!shape.ok()) return Bad(path, shape.status().message());
  t.numel = 1;
  for (size_t d = 0; d < (*shape)->size(); ++d) {
    absl::StatusOr<int64_t> n = JsonToInt((**shape)[d], JsonPath(f.Path("shape"), d), 0, kMaxInt);
    if (!n.ok()) return Bad(path, n.status().message());
    t.shape.push_back(*n);
    if (*n != 0 && t.numel > kMaxInt / es / *n) {
      return Bad(path, absl::StrCat(where, ": shape [", absl::StrJoin(t.shape, ", "),
                                    "...] holds more bytes than a file can"));
    }
    t.numel *= *n;
  }
  absl::StatusOr<const Json*> off = f.Array("data_offsets", 2);
  if (!off.ok() || (*off)->size() != 2) {
    return Bad(path, absl::StrCat(where, ": data_offsets must be [begin, end]"));
  }
  for (int k = 0; k < 2; ++k) {
    absl::StatusOr<int64_t> o = JsonToInt((**off)[k], JsonPath(f.Path("data_offsets"), k), 0,
                                          kMaxInt);
    if (!o.ok()) return Bad(path, o.status().message());
    (k == 0 ? t.begin : t.end) = *o;
  }
  if (t.end < t.begin || t.end - t.begin != t.numel * es) {
    return Bad(path, absl::StrCat(where, ": data_offsets [", t.begin, ", ", t.end, ") hold ",
                                  t.end - t.begin, " bytes; ", t.dtype, " [",
                                  absl::StrJoin(t.shape, ", "), "] needs ", t.numel * es));
  }
  return t;
}

absl::Status ParseMetadata(const Json& v, const std::string& path, FileHeader* h) {
  if (!v.is_object()) return Bad(path, "__metadata__ must be an object of strings");
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (!it.value().is_string()) {
      return Bad(path, absl::StrCat("__metadata__.", it.key(), ": expected a string, got ",
                                    DescribeJson(it.value())));
    }
    h->metadata.emplace_back(it.key(), it.value().get<std::string>());
  }
  return absl::OkStatus();
}

// The data section must be tiled exactly: sorted by offset, each tensor starts where the one
// before ends, the first at 0 and the last at the end of the file.
absl::Status CheckTiling(FileHeader* h) {
  std::stable_sort(h->tensors.begin(), h->tensors.end(),
                   [](const TensorInfo& a, const TensorInfo& b) {
                     return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
                   });
  const int64_t data_bytes = h->file_bytes - h->data_start;
  int64_t at = 0;
  const TensorInfo* prev = nullptr;
  for (TensorInfo& t : h->tensors) {
    if (t.begin < at) {
      return Bad(h->path, absl::StrCat("tensor '", t.name, "' data_offsets [", t.begin, ", ",
                                       t.end, ") overlap tensor '", prev->name, "' [",
                                       prev->begin, ", ", prev->end, ")"));
    }
    if (t.begin > at) {
      return Bad(h->path, absl::StrCat("a gap of ", t.begin - at, " bytes before tensor '",
                                       t.name, "' (data_offsets [", t.begin, ", ", t.end,
                                       "), previous end ", at, ")"));
    }
    if (t.end > data_bytes) {
      return Bad(h->path, absl::StrCat("tensor '", t.name, "' data_offsets [", t.begin, ", ",
                                       t.end, ") run past the end of the data (", data_bytes,
                                       " bytes)"));
    }
    at = t.end;
    prev = &t;
    t.begin += h->data_start;  // absolute from here on
    t.end += h->data_start;
  }
  if (at != data_bytes) {
    return Bad(h->path, absl::StrCat(data_bytes - at, " bytes after the last tensor (the data "
                                     "section holds ", data_bytes, " bytes, the tensors ", at,
                                     ")"));
  }
  return absl::OkStatus();
}

}  // namespace

const TensorInfo* FileHeader::Find(absl::string_view name) const {
  for (const TensorInfo& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

int64_t DTypeBytes(absl::string_view dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "BOOL" || dtype == "U8" || dtype == "I8" || dtype == "F8_E4M3" ||
      dtype == "F8_E5M2") {
    return 1;
  }
  return 0;
}

absl::StatusOr<FileHeader> ParseHeader(absl::string_view json, int64_t file_bytes,
                                       const std::string& path) {
  FileHeader h;
  h.path = path;
  h.file_bytes = file_bytes;
  h.data_start = 8 + static_cast<int64_t>(json.size());
  absl::StatusOr<Json> doc = ParseJson(json, absl::StrCat("safetensors header of '", path, "'"));
  if (!doc.ok()) return doc.status();
  if (!doc->is_object()) return Bad(path, "the header is not a JSON object");
  for (auto it = doc->begin(); it != doc->end(); ++it) {
    if (it.key() == "__metadata__") {
      RETURN_IF_ERROR(ParseMetadata(it.value(), path, &h));
      continue;
    }
    ASSIGN_OR_RETURN(TensorInfo t, ParseTensor(it.key(), it.value(), path));
    h.tensors.push_back(std::move(t));
  }
  RETURN_IF_ERROR(CheckTiling(&h));
  return h;
}

namespace {

class PosixFileReader : public FileReader {
 public:
  ~PosixFileReader() override {
    for (const auto& [path, fd] : fds_) ::close(fd);
  }

  absl::StatusOr<int64_t> Size(const std::string& path) override {
    ASSIGN_OR_RETURN(const int fd, Fd(path));
    struct stat st;
    if (::fstat(fd, &st) != 0) return IoError("cannot stat", path, errno);
    if (!S_ISREG(st.st_mode)) return Bad(path, "not a regular file");
    return static_cast<int64_t>(st.st_size);
  }

  absl::Status ReadAt(const std::string& path, int64_t offset, int64_t n, char* dst) override {
    ASSIGN_OR_RETURN(const int fd, Fd(path));
    for (int64_t got = 0; got < n;) {
      const ssize_t r = ::pread(fd, dst + got, static_cast<size_t>(n - got), offset + got);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        const std::string what =
            absl::StrCat("bytes [", offset, ", ", offset + n, ") of '", path, "': ");
        if (r == 0) {
          return absl::DataLossError(
              absl::StrCat(what, "the file ends at byte ", offset + got));
        }
        return absl::InternalError(absl::StrCat("cannot read ", what, std::strerror(errno)));
      }
      got += r;
    }
    return absl::OkStatus();
  }

 private:
  absl::StatusOr<int> Fd(const std::string& path) {
    auto it = fds_.find(path);
    if (it != fds_.end()) return it->second;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return IoError("cannot open safetensors file", path, errno);
    fds_.emplace(path, fd);
    return fd;
  }

  std::map<std::string, int> fds_;
};

}  // namespace

std::unique_ptr<FileReader> NewPosixFileReader() { return std::make_unique<PosixFileReader>(); }

absl::StatusOr<FileHeader> ReadHeader(const std::string& path, FileReader* reader) {
  std::unique_ptr<FileReader> own;
  if (reader == nullptr) {
    own = NewPosixFileReader();
    reader = own.get();
  }
  ASSIGN_OR_RETURN(const int64_t size, reader->Size(path));
  unsigned char len[8];
  if (size < 8 || !reader->ReadAt(path, 0, 8, reinterpret_cast<char*>(len)).ok()) {
    return Bad(path, absl::StrCat("too short for a header length (", size, " bytes)"));
  }
  uint64_t n = 0;
  for (int b = 7; b >= 0; --b) n = (n << 8) | len[b];
  if (n > static_cast<uint64_t>(kMaxHeaderBytes)) {
    return Bad(path, absl::StrCat("header length ", n, " exceeds the limit of ",
                                  kMaxHeaderBytes, " bytes"));
  }
  if (static_cast<int64_t>(n) > size - 8) {
    return Bad(path, absl::StrCat("header length ", n, " runs past the end of the file (", size,
                                  " bytes)"));
  }
  std::string json(n, '\0');
  RETURN_IF_ERROR(reader->ReadAt(path, 8, static_cast<int64_t>(n), json.data()));
  return ParseHeader(json, size, path);
}

absl::Status CheckFloatDType(absl::string_view dtype, absl::string_view what) {
  if (dtype == "F32" || dtype == "BF16" || dtype == "F16" || dtype == "F64") {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      what, " has dtype ", dtype, ": only F64, F32, F16 and BF16 load into fp32 weights"));
}

absl::Status ToFloat(absl::string_view dtype, const char* src, int64_t n, float* dst,
                     absl::string_view what) {
  static_assert(sizeof(float) == 4 && sizeof(double) == 8, "IEEE types expected");
  RETURN_IF_ERROR(CheckFloatDType(dtype, what));
  if (n == 0) return absl::OkStatus();
  if (dtype == "F32") {
    std::memcpy(dst, src, static_cast<size_t>(n) * 4);
  } else if (dtype == "BF16" || dtype == "F16") {
    const bool bf = dtype == "BF16";
    for (int64_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, src + 2 * i, 2);
      dst[i] = bf ? Bf16ToFloat(h) : HalfToFloat(h);
    }
  } else {  // F64
    for (int64_t i = 0; i < n; ++i) {
      double d;
      std::memcpy(&d, src + 8 * i, 8);
      dst[i] = static_cast<float>(d);
    }
  }
  return absl::OkStatus();
}

absl::string_view SafetensorsDTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "F32";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
  }
  return "F32";
}

std::string EncodeHeader(absl::Span<const TensorSpec> tensors, DType dtype,
                         const std::vector<std::pair<std::string, std::string>>& metadata) {
  Json header = Json::object();
  Json meta = Json::object();
  for (const auto& [k, v] : metadata) meta[k] = v;
  header["__metadata__"] = meta;
  int64_t offset = 0;
  const int64_t es = static_cast<int64_t>(DTypeSize(dtype));
  for (const TensorSpec& t : tensors) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    const int64_t bytes = numel * es;
    header[t.name] = {{"dtype", SafetensorsDTypeName(dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string h = header.dump(-1, ' ', false, Json::error_handler_t::replace);
  h.resize((h.size() + 7) / 8 * 8, ' ');  // tensors start 8-byte aligned
  std::string out(8, '\0');
  for (int b = 0; b < 8; ++b) {
    out[b] = static_cast<char>((static_cast<uint64_t>(h.size()) >> (8 * b)) & 0xff);
  }
  return out + h;
}

std::string EncodeHeader(absl::Span<const OutTensor> tensors, DType dtype,
                         const std::vector<std::pair<std::string, std::string>>& metadata) {
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const OutTensor& t : tensors) specs.push_back({t.name, t.shape});
  return EncodeHeader(specs, dtype, metadata);
}

namespace {

// A temporary beside `path`, renamed over it by Commit; removed if never committed.
class AtomicFile {
 public:
  ~AtomicFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!tmp_.empty()) ::unlink(tmp_.c_str());
  }
  absl::Status Open(const std::string& path) {
    path_ = path;
    const size_t slash = path.rfind('/');
    const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
    const std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
    std::string tmpl = absl::StrCat(slash == std::string::npos ? "" : dir, ".", base,
                                    ".tmp-XXXXXX");
    fd_ = ::mkstemp(tmpl.data());
    if (fd_ < 0) return IoError("cannot create a temporary for", path, errno);
    tmp_ = tmpl;
    return absl::OkStatus();
  }
  absl::Status Write(const char* p, size_t n) {
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, n);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) return IoError("cannot write", tmp_, w < 0 ? errno : EIO);
      p += w;
      n -= static_cast<size_t>(w);
    }
    return absl::OkStatus();
  }
  absl::Status WriteAt(int64_t offset, const char* p, size_t n) {
    while (n > 0) {
      const ssize_t w = ::pwrite(fd_, p, n, offset);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) return IoError("cannot write", tmp_, w < 0 ? errno : EIO);
      p += w;
      offset += w;
      n -= static_cast<size_t>(w);
    }
    return absl::OkStatus();
  }
  absl::Status Commit() {
    if (::fchmod(fd_, 0644) != 0 || ::fsync(fd_) != 0) return IoError("cannot sync", tmp_, errno);
    if (::close(fd_) != 0) {
      fd_ = -1;
      return IoError("cannot close", tmp_, errno);
    }
    fd_ = -1;
    if (::rename(tmp_.c_str(), path_.c_str()) != 0) return IoError("cannot rename to", path_, errno);
    tmp_.clear();
    return absl::OkStatus();
  }

 private:
  int fd_ = -1;
  std::string path_, tmp_;
};

absl::Status CheckNames(absl::Span<const TensorSpec> tensors, const std::string& path) {
  std::set<absl::string_view> seen;
  for (const TensorSpec& t : tensors) {
    if (t.name == "__metadata__" || !seen.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cannot write '", path, "': tensor name '", t.name, "' is ",
          t.name == "__metadata__" ? "reserved for the metadata" : "used twice"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckOutTensors(absl::Span<const OutTensor> tensors, const std::string& path) {
  std::vector<TensorSpec> specs;
  for (const OutTensor& t : tensors) specs.push_back({t.name, t.shape});
  RETURN_IF_ERROR(CheckNames(specs, path));
  for (const OutTensor& t : tensors) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    if (numel != static_cast<int64_t>(t.values.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cannot write '", path, "': tensor '", t.name, "' of shape [",
          absl::StrJoin(t.shape, ", "), "] given ", t.values.size(), " values"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteFile(const std::string& path, absl::Span<const OutTensor> tensors, DType dtype,
                       const std::vector<std::pair<std::string, std::string>>& metadata) {
  RETURN_IF_ERROR(CheckOutTensors(tensors, path));
  AtomicFile file;
  RETURN_IF_ERROR(file.Open(path));
  const std::string header = EncodeHeader(tensors, dtype, metadata);
  RETURN_IF_ERROR(file.Write(header.data(), header.size()));
  // Converted through a bounded buffer: memory stays small whatever the tensors' size.
  constexpr size_t kChunk = size_t{1} << 18;  // elements
  const size_t es = DTypeSize(dtype);
  std::vector<char> buf(kChunk * es);
  for (const OutTensor& t : tensors) {
    for (size_t i = 0; i < t.values.size(); i += kChunk) {
      const size_t n = std::min(kChunk, t.values.size() - i);
      if (dtype == DType::kF32) {
        std::memcpy(buf.data(), t.values.data() + i, n * 4);
      } else {
        for (size_t k = 0; k < n; ++k) StoreAs(dtype, buf.data(), k, t.values[i + k]);
      }
      RETURN_IF_ERROR(file.Write(buf.data(), n * es));
    }
  }
  return file.Commit();
}

struct PieceWriter::State {
  AtomicFile file;
  std::string path;
  DType dtype = DType::kF32;
  std::vector<TensorSpec> tensors;
  std::vector<int64_t> numel, begin, written;  // per tensor; begin: absolute byte offset
};

PieceWriter::PieceWriter(std::unique_ptr<State> state) : state_(std::move(state)) {}
PieceWriter::~PieceWriter() = default;
const std::string& PieceWriter::path() const { return state_->path; }

absl::StatusOr<std::unique_ptr<PieceWriter>> PieceWriter::Create(
    const std::string& path, std::vector<TensorSpec> tensors, DType dtype,
    const std::vector<std::pair<std::string, std::string>>& metadata) {
  RETURN_IF_ERROR(CheckNames(tensors, path));
  auto st = std::make_unique<State>();
  st->path = path;
  st->dtype = dtype;
  const std::string header = EncodeHeader(tensors, dtype, metadata);
  const int64_t es = static_cast<int64_t>(DTypeSize(dtype));
  int64_t at = static_cast<int64_t>(header.size());
  for (const TensorSpec& t : tensors) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    st->numel.push_back(numel);
    st->begin.push_back(at);
    at += numel * es;
  }
  st->written.assign(tensors.size(), 0);
  st->tensors = std::move(tensors);
  RETURN_IF_ERROR(st->file.Open(path));
  RETURN_IF_ERROR(st->file.WriteAt(0, header.data(), header.size()));
  return std::unique_ptr<PieceWriter>(new PieceWriter(std::move(st)));
}

absl::Status PieceWriter::Write(int tensor, int64_t elem, absl::Span<const float> values) {
  State& st = *state_;
  const int64_t n = static_cast<int64_t>(values.size());
  if (tensor < 0 || tensor >= static_cast<int>(st.tensors.size()) || elem < 0 ||
      elem > st.numel[tensor] - n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot write '", st.path, "': elements [", elem, ", ", elem + n, ") of tensor ",
        tensor, tensor >= 0 && tensor < static_cast<int>(st.tensors.size())
                    ? absl::StrCat(" '", st.tensors[tensor].name, "' of ", st.numel[tensor])
                    : std::string(" (no such tensor)")));
  }
  const int64_t es = static_cast<int64_t>(DTypeSize(st.dtype));
  const int64_t at = st.begin[tensor] + elem * es;
  st.written[tensor] += n;
  if (st.dtype == DType::kF32) {  // little-endian fp32 already: straight from the caller
    return st.file.WriteAt(at, reinterpret_cast<const char*>(values.data()),
                           static_cast<size_t>(n) * 4);
  }
  // Converted through a bounded buffer, freed on return: many writers may be open at once.
  constexpr int64_t kChunk = int64_t{1} << 16;  // elements
  std::vector<char> buf(static_cast<size_t>(std::min(n, kChunk) * es));
  for (int64_t i = 0; i < n; i += kChunk) {
    const int64_t k = std::min(kChunk, n - i);
    for (int64_t j = 0; j < k; ++j) StoreAs(st.dtype, buf.data(), j, values[i + j]);
    RETURN_IF_ERROR(st.file.WriteAt(at + i * es, buf.data(), static_cast<size_t>(k * es)));
  }
  return absl::OkStatus();
}

absl::Status PieceWriter::Commit() {
  State& st = *state_;
  for (size_t i = 0; i < st.tensors.size(); ++i) {
    if (st.written[i] != st.numel[i]) {
      return absl::InternalError(absl::StrCat(
          "cannot publish '", st.path, "': tensor '", st.tensors[i].name, "' got ",
          st.written[i], " of its ", st.numel[i], " elements"));
    }
  }
  return st.file.Commit();
}

absl::Status WriteFileAtomically(const std::string& path, absl::string_view bytes) {
  AtomicFile file;
  RETURN_IF_ERROR(file.Open(path));
  RETURN_IF_ERROR(file.Write(bytes.data(), bytes.size()));
  return file.Commit();
}

bool IsDir(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

}  // namespace safetensors
}  // namespace zerort
