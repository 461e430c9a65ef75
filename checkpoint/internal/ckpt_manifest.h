// The checkpoint manifest (manifest.json) and the header of each shard file: the format of
// docs/checkpoints.md, written and read here and nowhere else.
//
// A checkpoint directory holds manifest.json and one shard file per saving rank,
// rank_<r>.bin: a 64-byte header, then `sections` arrays of shard_elements elements each
// (fp32 master, m, v; in stage 3 also the compute-dtype parameters), raw little-endian.
// Rank r's arrays hold elements [r * shard, (r + 1) * shard) of every padded unit, unit u at
// units[u].shard_offset. The manifest records the unit layout and where every parameter lies
// inside its unit, which is all a loader at another world size needs.
//
// ParseManifest is the only reader (the text through base/json's strict parser: duplicate keys,
// NUL and trailing bytes refused) and is fuzzed: every accepted manifest is internally
// consistent (every parameter inside its unit, units contiguous, file sizes matching the
// layout, file names of the fixed form), so nothing computed from it can index out of range.
//
// Thread safety: plain values and pure functions.
#ifndef ZERORT_CHECKPOINT_INTERNAL_CKPT_MANIFEST_H_
#define ZERORT_CHECKPOINT_INTERNAL_CKPT_MANIFEST_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/dtype.h"
#include "zero/loss_scaler.h"

namespace zerort {
namespace ckpt_internal {

constexpr int kFormatVersion = 1;
constexpr int64_t kHeaderBytes = 64;
// Bounds that keep every derived byte count far from int64 overflow.
constexpr int64_t kMaxElements = int64_t{1} << 40;
constexpr int kMaxWorld = 1 << 16;
constexpr int64_t kMaxManifestBytes = int64_t{256} << 20;
constexpr int64_t kMaxNameBytes = 4096;

struct ManifestUnit {
  std::string name;
  int64_t padded = 0;        // shard * world_size
  int64_t shard = 0;
  int64_t shard_offset = 0;  // sum of earlier units' shards
};

struct ManifestParam {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;  // derived: product of shape
  int unit = 0;
  int64_t offset_in_unit = 0;
};

struct ManifestFile {
  std::string name;  // ShardFileName(rank)
  int rank = 0;
  int64_t bytes = 0;
  uint32_t crc32c = 0;  // of the whole file, header included
};

struct Manifest {
  int format_version = kFormatVersion;
  int64_t step = 0;
  uint64_t checkpoint_id = 0;  // random per save; in every shard header (catches mixed shards)
  int world_size = 1;
  int stage = 0;
  DType compute_dtype = DType::kF32;
  std::string config_hash;
  // The loss scaler's state, as the engine reports it (EngineState extends ScalerState); on
  // disk the "loss_scaler" object: scale, hysteresis_left, iter, last_overflow_iter.
  ScalerState scaler;
  // The trainer's AdamW scalars ("optimizer" on disk, only when it set them).
  bool hyperparams_set = false;
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;

  int64_t shard_elements = 0;
  bool has_param_section = false;  // stage 3: the compute-dtype parameter shard follows v
  std::vector<ManifestUnit> units;
  std::vector<ManifestParam> params;
  std::vector<ManifestFile> files;  // files[r] is rank r's

  int num_sections() const { return has_param_section ? 4 : 3; }
  // Byte offset of section k (0 master, 1 m, 2 v, 3 param) inside a shard file.
  int64_t SectionOffset(int k) const { return kHeaderBytes + k * shard_elements * 4; }
  int64_t ShardFileBytes() const;
};

std::string ShardFileName(int rank);  // "rank_00003.bin"

// A parameter or unit name a checkpoint can hold: 1..kMaxNameBytes bytes of valid UTF-8
// without control characters (JSON cannot carry other bytes, and names are printed).
// InvalidArgument naming `field` and the offending byte (the name hex-escaped).
absl::Status CheckName(absl::string_view field, absl::string_view name);
// Every string ManifestToJson would write passes CheckName (what a save checks on every rank
// before it writes anything, so that no rank fails alone while encoding the manifest).
absl::Status CheckManifestStrings(const Manifest& m);
// The product of `shape`, overflow-checked: InvalidArgument for a dimension < 1 or more than
// kMaxElements elements.
absl::StatusOr<int64_t> ShapeElements(const std::vector<int64_t>& shape);

// Pretty JSON with a trailing "manifest_crc32c" over the compact dump of everything else.
std::string ManifestToJson(const Manifest& m);

// Parses and validates. DataLoss naming the field for anything malformed, inconsistent or
// failing its checksum; FailedPrecondition for a format_version newer than kFormatVersion.
absl::StatusOr<Manifest> ParseManifest(absl::string_view text);

// The 64-byte shard header: magic "ZRTSHARD", format version, rank, world size, step,
// checkpoint id, payload bytes.
std::string EncodeShardHeader(const Manifest& m, int rank);
// Checks a header read from `file` against what the manifest says rank `rank` wrote. DataLoss
// naming the file and the mismatch (another checkpoint's shard, another rank's, not a shard).
absl::Status CheckShardHeader(absl::string_view header, const Manifest& m, int rank,
                              const std::string& file);

}  // namespace ckpt_internal
}  // namespace zerort

#endif  // ZERORT_CHECKPOINT_INTERNAL_CKPT_MANIFEST_H_
