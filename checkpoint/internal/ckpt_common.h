// What the save, load and offline-read paths of checkpoint/checkpoint.h share: the names in a
// checkpoint root (manifest.json, latest), resolving a path to its step directory, the
// manifest, the shard files streamed once with every check (header, size, CRC32C), and the
// one collective verdict of a save or load. Private to //checkpoint (save.cc, load.cc,
// verify_consolidate.cc).
//
// Thread safety: free functions; the file system must be usable from the calling thread.
#ifndef ZERORT_CHECKPOINT_INTERNAL_CKPT_COMMON_H_
#define ZERORT_CHECKPOINT_INTERNAL_CKPT_COMMON_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/internal/ckpt_fs.h"
#include "checkpoint/internal/ckpt_manifest.h"
#include "comm/agree.h"

namespace zerort {
namespace ckpt_internal {

inline constexpr char kManifestName[] = "manifest.json";
inline constexpr char kLatestName[] = "latest";
inline constexpr size_t kIoChunk = size_t{8} << 20;  // bytes per read/write call

// `fs`, or the POSIX file system when null (the options' default).
FileSystem* Fs(FileSystem* fs);

// Every rank returns the same verdict (comm::AgreeOnStatus): one rank's bad file fails the load
// everywhere, before any engine is touched, instead of leaving the others to hang in the next
// collective. `exchange` is the engine's (Engine::NewHostExchange): it stages through device
// memory where the communicator is stream-ordered (NCCL).
absl::Status Agree(comm::HostExchange& exchange, const absl::Status& local);

// `latest`'s content under `root`, or "" when there is none. What it holds is quoted escaped
// and bounded in errors: it is not ours until it has been checked.
absl::StatusOr<std::string> ReadLatest(FileSystem* fs, const std::string& root);

// The step directory `path` names: itself when it holds a manifest, else the one its `latest`
// names. NotFound when neither exists.
absl::StatusOr<std::string> ResolveDir(FileSystem* fs, const std::string& path);

absl::StatusOr<Manifest> ReadManifest(FileSystem* fs, const std::string& dir);

// --- reading ranges out of shard files -----------------------------------------------------

// `bytes` bytes at `offset` of a shard file: elements [elem, elem + bytes / 4) of section
// `section` (0 master, 1 m, 2 v) of manifest parameter `param`; they go to `dst` when not null,
// else to the reader's sink.
struct Piece {
  int64_t offset;
  int64_t bytes;
  char* dst;
  int param;
  int section;
  int64_t elem;
};

// Receives `n` bytes of piece `p`, starting `skip` bytes into it.
using PieceSink = std::function<absl::Status(const Piece& p, int64_t skip, const char* data,
                                             int64_t n)>;

// Adds the pieces that carry elements [e0, e0 + count) of manifest parameter `i` into the three
// fp32 destinations (master, m, v; null: to the sink), split where the parameter crosses a
// saving rank's shard.
void AddParamRange(const Manifest& m, int i, int64_t e0, int64_t count, float* const dst[3],
                   std::vector<std::vector<Piece>>* per_file);

// The size check of one shard file, before anything is read or allocated for it.
absl::Status CheckShardSize(FileSystem* fs, const std::string& dir, const Manifest& m, int q);

// Every shard's size, so that a small manifest claiming a huge state fails before anything is
// allocated for it.
absl::Status CheckShardSizes(FileSystem* fs, const std::string& dir, const Manifest& m);

// Streams one shard file once through a buffer of at most kIoChunk bytes: checks its header,
// size and CRC32C, and hands the pieces to `dst` or, where that is null, to `sink`.
absl::Status ReadShard(FileSystem* fs, const std::string& dir, const Manifest& m, int q,
                       std::vector<Piece> pieces, const PieceSink& sink = nullptr);

// The manifest as CheckpointInfo reports it.
CheckpointInfo InfoOf(const Manifest& m, const std::string& dir);

}  // namespace ckpt_internal
}  // namespace zerort

#endif  // ZERORT_CHECKPOINT_INTERNAL_CKPT_COMMON_H_
