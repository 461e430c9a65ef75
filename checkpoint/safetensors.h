// Safetensors files as Hugging Face's loaders read and write them: the format layer under
// checkpoint/weights.h, with no engine in it.
//
// A file is an 8-byte little-endian header length N, N bytes of JSON (padded with spaces to a
// multiple of 8), then the tensors' bytes back to back. The JSON maps each tensor name to
// {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]} (offsets relative to the end of
// the header) and may hold "__metadata__", an object of strings.
//
//   ASSIGN_OR_RETURN(safetensors::FileHeader h, safetensors::ReadHeader(path));
//   const safetensors::TensorInfo* t = h.Find("wte");   // t->begin, t->end: absolute bytes
//
// Reading is strict, because a file may come from anywhere: the header length is capped
// (kMaxHeaderBytes), the JSON goes through base/json.h (no duplicate keys), every tensor must
// hold exactly dtype, shape and data_offsets, and the byte ranges must tile the data section
// exactly (no overlap, no gap, nothing past the end or after the last tensor), as the
// safetensors library itself requires. Every error names the file, and the tensor and its
// byte range where there is one.
//
// Writing produces what `safetensors.torch.save_file` would for the same tensors in the same
// order: tensors are written in the order given, 8-byte aligned data. Files appear complete or
// not at all (a temporary in the same directory, fsynced, then renamed).
//
// Thread safety: free functions; no shared state.
#ifndef ZERORT_CHECKPOINT_SAFETENSORS_H_
#define ZERORT_CHECKPOINT_SAFETENSORS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/dtype.h"

namespace zerort {
namespace safetensors {

// The safetensors library refuses headers over 100 MB; so do we, before allocating one.
inline constexpr int64_t kMaxHeaderBytes = int64_t{100} << 20;

struct TensorInfo {
  std::string name;
  std::string dtype;           // as the file names it: "F32", "BF16", "I64", ...
  std::vector<int64_t> shape;  // [] is a scalar
  int64_t numel = 0;
  int64_t begin = 0;           // absolute byte range in the file: [begin, end)
  int64_t end = 0;
};

struct FileHeader {
  std::string path;
  int64_t file_bytes = 0;
  int64_t data_start = 0;  // 8 + header length: where data_offsets count from
  std::vector<std::pair<std::string, std::string>> metadata;
  std::vector<TensorInfo> tensors;  // in the order of their bytes in the file

  // The tensor named `name`, or nullptr.
  const TensorInfo* Find(absl::string_view name) const;
};

// Bytes per element of a safetensors dtype name ("F32" 4, "BF16" 2, "BOOL" 1, ...); 0 for a
// name the format does not define.
int64_t DTypeBytes(absl::string_view dtype);

// Parses the JSON header of a file of `file_bytes` bytes whose header is `json` (so the data
// section starts at 8 + json.size()). InvalidArgument naming `path` (and the tensor) for
// anything the format does not allow.
absl::StatusOr<FileHeader> ParseHeader(absl::string_view json, int64_t file_bytes,
                                       const std::string& path);

// Where the bytes of weight files come from: the seam every read of ReadHeader and of
// ImportWeights goes through (POSIX by default), so that a test can count the bytes and ranges
// each rank reads.
class FileReader {
 public:
  virtual ~FileReader() = default;
  // The size in bytes of the regular file at `path`: NotFound / PermissionDenied naming it,
  // InvalidArgument when it is not a regular file.
  virtual absl::StatusOr<int64_t> Size(const std::string& path) = 0;
  // Exactly `n` bytes at `offset` into `dst`: DataLoss naming the path and the byte range when
  // the file ends first, the I/O error naming them otherwise.
  virtual absl::Status ReadAt(const std::string& path, int64_t offset, int64_t n, char* dst) = 0;
};

// Positioned reads (pread), each file opened once and kept open until the reader is destroyed.
// Not thread-safe: one per thread.
std::unique_ptr<FileReader> NewPosixFileReader();

// Reads and parses the header of the file at `path` (only the header's bytes are read: its 8
// length bytes, then the JSON), through `reader` (nullptr: a POSIX reader of its own).
// NotFound / PermissionDenied naming the path; InvalidArgument as ParseHeader, or for a file
// too short for its header or a header over kMaxHeaderBytes.
absl::StatusOr<FileHeader> ReadHeader(const std::string& path, FileReader* reader = nullptr);

// OK for the dtypes ToFloat converts (F64, F32, F16, BF16); InvalidArgument naming `what` and
// the dtype for any other.
absl::Status CheckFloatDType(absl::string_view dtype, absl::string_view what);

// Converts `n` little-endian elements of safetensors dtype `dtype` (F64, F32, F16, BF16) at
// `src` to fp32 (F64 rounds to nearest). InvalidArgument naming `what` and the dtype for any
// other dtype.
absl::Status ToFloat(absl::string_view dtype, const char* src, int64_t n, float* dst,
                     absl::string_view what);

// One tensor to write: fp32 values, converted to the file's dtype on the way out.
struct OutTensor {
  std::string name;
  std::vector<int64_t> shape;
  absl::Span<const float> values;  // numel elements, row-major
};

// "F32" for kF32, "BF16" for kBF16, "F16" for kF16.
absl::string_view SafetensorsDTypeName(DType dtype);

// The header of a file holding `tensors` in this order as `dtype`: the 8-byte length, then the
// JSON ("__metadata__" first) padded with spaces to a multiple of 8 bytes.
std::string EncodeHeader(absl::Span<const OutTensor> tensors, DType dtype,
                         const std::vector<std::pair<std::string, std::string>>& metadata);

// A tensor's name and shape without its values: what a header is made of.
struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;  // [] is a scalar
};

// The same header from names and shapes alone (each tensor holds the product of its shape).
std::string EncodeHeader(absl::Span<const TensorSpec> tensors, DType dtype,
                         const std::vector<std::pair<std::string, std::string>>& metadata);

// Writes `tensors` in this order as one file at `path`, replacing any file there. The file
// appears complete or not at all. InvalidArgument for a duplicate or reserved name or values
// whose size is not the shape's; the I/O error naming the path otherwise.
absl::Status WriteFile(const std::string& path, absl::Span<const OutTensor> tensors, DType dtype,
                       const std::vector<std::pair<std::string, std::string>>& metadata);

// A file of the same bytes as WriteFile's, whose values arrive in pieces, in any order: the
// header is fixed up front from the names and shapes, and each piece is converted into its
// place (positioned writes; bf16/f16 through a buffer of at most 128 KiB per call, fp32 with
// no copy). For sources that produce tensors out of order, such as a checkpoint's shard files,
// without holding a tensor in memory:
//
//   ASSIGN_OR_RETURN(auto w, PieceWriter::Create(path, {{"wte", {50257, 768}}}, DType::kBF16, {}));
//   RETURN_IF_ERROR(w->Write(0, 1024, values));  // elements [1024, 1024 + values.size())
//   RETURN_IF_ERROR(w->Commit());                // every element written, else Internal
//
// The file appears complete (Commit) or not at all (a temporary beside `path`, fsynced then
// renamed over it; removed if the writer is destroyed uncommitted). Not thread-safe.
class PieceWriter {
 public:
  // InvalidArgument for a duplicate or reserved name; the I/O error naming the path otherwise.
  static absl::StatusOr<std::unique_ptr<PieceWriter>> Create(
      const std::string& path, std::vector<TensorSpec> tensors, DType dtype,
      const std::vector<std::pair<std::string, std::string>>& metadata);
  ~PieceWriter();
  PieceWriter(const PieceWriter&) = delete;
  PieceWriter& operator=(const PieceWriter&) = delete;

  // Elements [elem, elem + values.size()) of tensor `tensor` (an index into Create's list).
  // InvalidArgument for a range outside the tensor.
  absl::Status Write(int tensor, int64_t elem, absl::Span<const float> values);
  // Internal naming the first tensor whose elements were not all written (nothing is
  // published then); the I/O error naming the path otherwise.
  absl::Status Commit();

  const std::string& path() const;

 private:
  struct State;
  explicit PieceWriter(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// Writes `bytes` to `path` the same way (a temporary, fsync, rename): what the index of a
// sharded set goes through.
absl::Status WriteFileAtomically(const std::string& path, absl::string_view bytes);

// Path tests for weight files and directories. Unlike the checkpoint's FileSystem they follow
// symlinks: Hugging Face's cache links every file of a snapshot to its blob.
bool IsDir(const std::string& path);
bool Exists(const std::string& path);

}  // namespace safetensors
}  // namespace zerort

#endif  // ZERORT_CHECKPOINT_SAFETENSORS_H_
