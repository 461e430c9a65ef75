// Checkpoints: save an engine's training state durably, load it back bit-exactly, at the same
// or another world size, and read it without an engine (inspect, consolidate, export).
//
//   // Every rank, between optimizer steps:
//   ASSIGN_OR_RETURN(std::string path, SaveCheckpoint(*engine, "/ckpt"));  // /ckpt/step_<N>
//   ...
//   // After a restart, possibly on another number of ranks:
//   LoadOptions lo;
//   lo.allow_reshard = true;
//   RETURN_IF_ERROR(LoadCheckpoint(*engine, "/ckpt", lo));  // follows /ckpt/latest
//
// Format (docs/checkpoints.md): `<root>/step_<N>/` holds manifest.json (JSON: format version,
// world size, unit layout, parameter names and shapes, per-file size and CRC32C, engine state,
// and its own checksum) and rank_<r>.bin per saving rank (a 64-byte header, then raw
// little-endian fp32 master, m, v of the rank's owned range of every unit; in stage 3 also the
// compute-dtype parameters). `<root>/latest` names the newest complete checkpoint. Nothing in a
// checkpoint is executable.
//
// Guarantees:
//  - Save: every rank first checks the names (UTF-8, no control characters; InvalidArgument
//    everywhere at once). Rank 0 holds an flock on <root>/.zerort.lock for the whole save
//    (FailedPrecondition for a second writer); a save removes only step_<N>.tmp debris and
//    moves an unnamed complete step_<N>/ aside (step_<N>.replaced-<id>/), never deleting one.
//    Shards are written into step_<N>.tmp/ and fsynced; after every rank has finished,
//    rank 0 writes the manifest atomically, renames the directory to step_<N>/, and only then
//    replaces `latest` atomically. A crash or an I/O error at any point leaves `latest` naming
//    the previous complete checkpoint (or absent, before the first save).
//  - Load: verifies the manifest, every shard's header, size and CRC32C before touching the
//    engine; any failure (on any rank) fails every rank with an error naming the file and the
//    reason and leaves every engine unchanged.
//  - A checkpoint saved at world size N with any stage loads at world size M with any stage
//    (allow_reshard when N != M), giving the same fp32 master, m and v element for element.
//  - Layouts: an HSDP engine (zero_optimization.mics_shard_size) writes the flat checkpoint of
//    its world (each of a group shard's replicas writes one of its flat shards: file q once,
//    by one rank), and any engine loads its own owned range (its group shard with HSDP); so a
//    checkpoint saved flat or in shard groups of any size loads into any other layout. State
//    an engine derives from the owned shards (gathered or secondary parameter copies) is not
//    saved: the load's all-gather rebuilds it.
//
// Collective: SaveCheckpoint, LoadCheckpoint and AsyncCheckpointer's Start/Finish must be called
// by every rank of the engine's communicator, in the same order. The directory must be shared
// by all ranks (one file system). Not thread-safe against the engine: do not call Step() during
// SaveCheckpoint / LoadCheckpoint on the same rank (AsyncCheckpointer lets training go on).
#ifndef ZERORT_CHECKPOINT_CHECKPOINT_H_
#define ZERORT_CHECKPOINT_CHECKPOINT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "memory/arena.h"
#include "zero/engine.h"

namespace zerort {

namespace ckpt_internal {
class FileSystem;  // checkpoint/internal/ckpt_fs.h
}  // namespace ckpt_internal

struct SaveOptions {
  // File-system seam; nullptr = POSIX. Tests inject failures and crashes through it.
  ckpt_internal::FileSystem* fs = nullptr;
};

struct LoadOptions {
  // Accept a checkpoint saved at a different world size (each rank then reads its new ranges
  // from whichever shard files hold them). false: a different world size is FailedPrecondition.
  bool allow_reshard = false;
  ckpt_internal::FileSystem* fs = nullptr;
};

// Saves the engine's state into `root`/step_<engine.step()>/ and points `root`/latest at it.
// Returns that directory. Errors (the same on every rank): FailedPrecondition inside an
// accumulation window; AlreadyExists when `latest` already names step_<N>; the I/O error of
// the failing operation (naming the path) otherwise, after which `latest` is unchanged.
// Collective.
absl::StatusOr<std::string> SaveCheckpoint(Engine& engine, const std::string& root,
                                           const SaveOptions& options = {});

// Loads `path`: a checkpoint directory (holding manifest.json) or a root whose `latest` names
// one. The engine's parameters must match the checkpoint's (names and shapes, in order); stage,
// precision and config may differ (the compute-dtype parameters are re-derived from the fp32
// masters). Errors (the same on every rank, the engine unchanged): NotFound (no checkpoint, a
// missing shard), DataLoss (a corrupted, truncated or mixed-up file, naming it),
// FailedPrecondition (another model, another world size without allow_reshard, a newer format
// version, inside an accumulation window). Collective.
absl::Status LoadCheckpoint(Engine& engine, const std::string& path,
                            const LoadOptions& options = {});

// Saves without stopping training: Start() enqueues copies of this rank's state into a pinned
// host buffer (Engine::BeginSnapshot) and returns; the copies overlap the next forward and
// backward, and the next optimizer update waits for them, so the checkpoint holds exactly the
// state at Start. A background thread waits for the copies, then writes and fsyncs the shard
// while the trainer keeps stepping; Finish() waits for it and commits (manifest, rename,
// `latest`), so `latest` moves only once the checkpoint is durable. Start and Finish are
// collective; call Finish before the next Start.
//
// The snapshot buffer comes from the device's kPinnedHost allocator, which is the process-wide
// pinned slab cache (memory/pinned_pool.h): it is kept for the checkpointer's life, reused by
// every save, and returned to the cache (still locked, for the next engine or checkpointer)
// when the checkpointer goes; it does not depend on the device's lifetime.
//
// Lifetime: after Start the checkpointer never dereferences the engine: the writer waits
// through Engine::SnapshotWaiter, which stays valid after the engine is destroyed (its
// destructor waits for the copies). So destroying the engine with a save in flight is safe,
// and Finish still commits the snapshot taken at Start. Destroying the checkpointer waits for
// the writer but never commits.
//
// Thread safety: one AsyncCheckpointer per rank, used by that rank's training thread.
class AsyncCheckpointer {
 public:
  explicit AsyncCheckpointer(SaveOptions options = {});
  ~AsyncCheckpointer();
  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;

  // REQUIRES: no save in flight (else FailedPrecondition).
  absl::Status Start(Engine& engine, const std::string& root);
  bool in_flight() const { return pending_ != nullptr; }
  // The engine the save in flight was started on (an identity to compare, possibly destroyed
  // since); nullptr when none is.
  const Engine* saving() const;
  // Waits for the writer and commits; returns the committed directory. It needs no engine:
  // the snapshot was taken at Start, and the commit agrees through the engine's host exchange
  // (Engine::NewHostExchange), which needs only the engine's communicator, device and compute
  // stream to live. After a failed Start it returns that failure (its code, the message
  // prefixed), once. REQUIRES: a save in flight or a failed Start (else FailedPrecondition).
  absl::StatusOr<std::string> Finish();

  struct Pending;  // checkpoint/save.cc

 private:
  SaveOptions options_;
  memory::Allocation staging_;  // pinned; the snapshot of the save in flight
  std::unique_ptr<Pending> pending_;
  absl::Status start_status_;  // the last Start's failure, until Finish reports it
};

// What a checkpoint holds, read without an engine.
struct CheckpointInfo {
  std::string dir;             // the checkpoint directory (after following `latest`)
  int format_version = 0;
  int64_t step = 0;
  int world_size = 0;
  int stage = 0;
  std::string compute_dtype;   // "fp32", "bf16", "fp16"
  std::string config_hash;
  double loss_scale = 1;
  int num_units = 0;
  struct Param {
    std::string name;
    std::vector<int64_t> shape;
    int64_t numel = 0;
  };
  std::vector<Param> params;
  struct File {
    std::string name;
    int64_t bytes = 0;
    uint32_t crc32c = 0;
  };
  std::vector<File> files;
};

// The full (unsharded) fp32 state, per parameter in registration order.
struct CheckpointState {
  CheckpointInfo info;
  std::vector<std::vector<float>> master, exp_avg, exp_avg_sq;
};

// Reads and verifies the manifest only (path as for LoadCheckpoint).
absl::StatusOr<CheckpointInfo> ReadCheckpointInfo(const std::string& path,
                                                  ckpt_internal::FileSystem* fs = nullptr);
// Reads and verifies everything (every file's header, size and checksum) into memory. The
// shard files' sizes are checked against the manifest before anything is allocated; running
// out of memory is ResourceExhausted. Paths that are symlinks (`latest`, a step directory, the
// manifest, a shard) are refused, never followed (DataLoss / FailedPrecondition naming them).
absl::StatusOr<CheckpointState> ReadCheckpoint(const std::string& path,
                                               ckpt_internal::FileSystem* fs = nullptr);

// What VerifyCheckpoint finds: the info and the L2 norm of each parameter's fp32 master.
struct CheckpointSummary {
  CheckpointInfo info;
  std::vector<double> master_norm;  // per parameter, in registration order
};
// Verifies everything as ReadCheckpoint does, streaming: memory stays at one read buffer
// (8 MiB) whatever the checkpoint's size.
absl::StatusOr<CheckpointSummary> VerifyCheckpoint(const std::string& path,
                                                   ckpt_internal::FileSystem* fs = nullptr);

// Receives `values`: consecutive fp32 masters of parameter `param` (registration order)
// starting at element `elem`. The pieces of all parameters together tile every parameter
// exactly once, in the order of the shard files, not of the parameters.
using MasterSink =
    std::function<absl::Status(int param, int64_t elem, absl::Span<const float> values)>;

// Streams the fp32 masters of the checkpoint at `path` (as for ReadCheckpointInfo) to `sink`
// without holding them: `begin` gets the verified manifest first (before any data), then every
// shard is read once through one 8 MiB buffer, so memory stays bounded whatever the
// checkpoint's size (what `zerort ckpt export` streams through). Each shard's CRC32C is
// checked after its pieces were handed out: on any error (theirs, or a sink's, which stops
// the stream) the caller must discard what it received. Errors: those of VerifyCheckpoint.
absl::Status StreamCheckpointMasters(const std::string& path,
                                     const std::function<absl::Status(const CheckpointInfo&)>& begin,
                                     const MasterSink& sink,
                                     ckpt_internal::FileSystem* fs = nullptr);

struct ConsolidateOptions {
  // false: an existing `out` (a symlink or a directory included) is AlreadyExists. true: it is
  // replaced atomically (a symlink itself, never its target).
  bool overwrite = false;
  // Tests: use a named temporary (mkstemp) even where O_TMPFILE works.
  bool named_temporary = false;
  ckpt_internal::FileSystem* fs = nullptr;  // for reading the checkpoint; nullptr = POSIX
};

// Writes the full fp32 state as one safetensors file at `out`: tensor `<name>` holds the
// master weights, `exp_avg.<name>` and `exp_avg_sq.<name>` Adam's moments; the metadata holds
// step, loss scale and the source checkpoint (a source path that is not UTF-8 is written with
// U+FFFD). Streams: memory stays at one read buffer whatever the checkpoint's size.
//
// `out` appears complete or not at all (ckpt_internal::PublishedFile): no temporary is left
// behind on any error, and none at all with O_TMPFILE even when the process is killed (without
// O_TMPFILE, a killed one leaves `.<out>.zerort-tmp.XXXXXX`, which is never removed for it:
// only what this run created is); of two consolidations racing for one `out` exactly one
// succeeds without overwrite, the other failing with AlreadyExists. Errors: InvalidArgument
// when `out` lies inside the checkpoint read (the path given or the step directory, compared
// by device and inode, so a bind mount or symlink is no way in), names one of its root's
// files (`latest`, step_*, the lock), is one of its files under another name (a hard link),
// does not name a file, is with overwrite anything but a regular file or a symlink (a FIFO, a
// device node, a directory), or when a parameter is named `__metadata__` or like another's
// moment; AlreadyExists for an existing `out` without overwrite; those of ReadCheckpoint; the
// I/O error of the output naming it.
absl::Status ConsolidateCheckpoint(const std::string& path, const std::string& out,
                                   const ConsolidateOptions& options = {});

}  // namespace zerort

#endif  // ZERORT_CHECKPOINT_CHECKPOINT_H_
