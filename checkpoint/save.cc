// SaveCheckpoint and AsyncCheckpointer (checkpoint/checkpoint.h): a collective save of every
// rank's owned shards into step_<N>.tmp/, then rank 0's manifest, rename and `latest`.
#include "checkpoint/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/crc32c.h"
#include "base/dtype.h"
#include "base/status.h"
#include "checkpoint/internal/ckpt_common.h"
#include "checkpoint/internal/ckpt_fs.h"
#include "checkpoint/internal/ckpt_manifest.h"
#include "comm/agree.h"
#include "memory/arena.h"
#include "zero/config.h"

namespace zerort {

using ckpt_internal::Agree;
using ckpt_internal::FileSystem;
using ckpt_internal::Fs;
using ckpt_internal::JoinPath;
using ckpt_internal::kIoChunk;
using ckpt_internal::kLatestName;
using ckpt_internal::kManifestName;
using ckpt_internal::Manifest;
using ckpt_internal::ReadLatest;

struct AsyncCheckpointer::Pending {
  FileSystem* fs = nullptr;
  // The engine's exchange (Engine::NewHostExchange): valid after the engine, so Finish still
  // agrees through it, and staged through device memory on a stream-ordered communicator.
  std::unique_ptr<comm::HostExchange> exchange;
  const Engine* engine = nullptr;  // for saving(): compared, never dereferenced
  // Waits for the engine's snapshot copies; safe after the engine is gone
  // (Engine::SnapshotWaiter), so destroying the engine with a save in flight is not a
  // use-after-free.
  std::function<absl::Status()> wait_snapshot;
  std::unique_ptr<ckpt_internal::DirLock> lock;  // rank 0: the root's, until the commit
  std::string root, tmp_dir, final_dir;
  Manifest manifest;  // without files
  int file_rank = 0;              // the flat shard this rank writes (SavedShard)
  std::string header;            // this rank's shard file: header, then
  char* body = nullptr;          // the engine's owned state, filled by Engine::BeginSnapshot
                                 // (the staging buffer of BeginSave's caller), of which
  std::vector<std::pair<size_t, size_t>> pieces;  // (offset in body, bytes) in file order
  size_t body_bytes = 0;         // are written: the file's payload bytes
  uint32_t crc = 0;              // of header + body, computed by the writer
  absl::Status status;  // snapshot or write failure on this rank
  std::thread writer;
};

namespace {

std::string StepDirName(int64_t step) { return absl::StrCat("step_", step); }

// The flat shard (of world_size) whose file this rank writes. Flat: its own. HSDP
// (memory::Hierarchical): a group shard is R = world / G consecutive flat shards, held by the
// R replicas r % G + k * G (k = r / G); replica k writes the group shard's k-th flat shard, as
// GradNorm has it measure that piece. Every flat shard is written exactly once, each rank
// writes 1/world of the state, and the checkpoint is the one a flat engine of the same world
// writes: no new format, and nothing else reads it differently.
int SavedShard(const memory::PlanOptions& o) {
  const int g = memory::ShardGroupSize(o);
  return memory::ShardIndex(o) * (o.world_size / g) + o.rank / g;
}

// Through comm/agree.h, which moves integers as such.
std::vector<uint64_t> AllGatherU64(comm::HostExchange& exchange,
                                   const std::vector<uint64_t>& mine, absl::Status* status) {
  absl::StatusOr<std::vector<uint64_t>> all = comm::AllGatherU64(exchange, mine);
  *status = all.status();
  return all.ok() ? *std::move(all) : std::vector<uint64_t>(mine.size() * exchange.size(), 0);
}

// Rank 0, holding the root's lock, after a failed save: removes step_<N>.tmp/ (the rule below:
// .tmp debris, under the lock), then releases and removes the lock, so that a failed save leaves
// the root as it found it. Best effort: the error that matters is the save's.
void Abandon(FileSystem* fs, const std::string& tmp_dir,
             std::unique_ptr<ckpt_internal::DirLock>* lock) {
  if (*lock == nullptr) return;
  (void)fs->RemoveAll(tmp_dir);
  (void)fs->SyncDir(ckpt_internal::Dirname(tmp_dir));
  lock->reset();
}

uint64_t NewCheckpointId() {
  std::random_device rd;
  const uint64_t t = static_cast<uint64_t>(
      std::chrono::steady_clock::now().time_since_epoch().count());
  return (static_cast<uint64_t>(rd()) << 32 ^ rd()) ^ (t * 0x9E3779B97F4A7C15ull) ^
         static_cast<uint64_t>(::getpid());
}

std::string ConfigHash(const Config& config) {
  const std::string text = ResolvedConfigJson(config);
  uint64_t h = 1469598103934665603ull;  // FNV-1a 64
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  return absl::StrFormat("fnv1a64:%016x", h);
}

Manifest ManifestOf(const Engine& engine, uint64_t id) {
  const memory::Plan& plan = engine.plan();
  const EngineState st = engine.state();
  Manifest m;
  m.step = st.step;
  m.checkpoint_id = id;
  m.world_size = plan.options.world_size;
  m.stage = plan.options.stage;
  m.compute_dtype = plan.options.compute_dtype;
  m.config_hash = ConfigHash(engine.config());
  m.scaler = st;  // the ScalerState part of EngineState
  m.hyperparams_set = st.hyperparams_set;
  m.lr = st.hyperparams.lr;
  m.beta1 = st.hyperparams.beta1;
  m.beta2 = st.hyperparams.beta2;
  m.eps = st.hyperparams.eps;
  m.weight_decay = st.hyperparams.weight_decay;
  m.has_param_section = plan.options.stage == 3;
  // The flat layout of the whole world whatever the engine's (with HSDP, u.shard is a group
  // shard: world / G flat shards).
  int64_t offset = 0;
  for (const memory::Unit& u : plan.units) {
    const int64_t shard = u.padded / plan.options.world_size;
    m.units.push_back({u.name, u.padded, shard, offset});
    offset += shard;
  }
  m.shard_elements = offset;
  for (const memory::ParamLayout& p : plan.params) {
    ckpt_internal::ManifestParam mp;
    mp.name = p.name;
    mp.shape = p.shape;
    mp.numel = p.numel;
    mp.unit = p.unit;
    mp.offset_in_unit = p.offset_in_unit;
    m.params.push_back(std::move(mp));
  }
  return m;
}

absl::Status MakeDirs(FileSystem* fs, const std::string& path) {
  if (path.empty() || path == "." || path == "/" || fs->Exists(path)) {
    return fs->MakeDir(path.empty() ? "." : path);
  }
  RETURN_IF_ERROR(MakeDirs(fs, ckpt_internal::Dirname(path)));
  return fs->MakeDir(path);
}

absl::Status WriteAll(ckpt_internal::WritableFile* f, absl::string_view data) {
  while (!data.empty()) {
    const size_t n = std::min(data.size(), kIoChunk);
    RETURN_IF_ERROR(f->Append(data.substr(0, n)));
    data.remove_prefix(n);
  }
  return absl::OkStatus();
}


// Rank 0, holding the root's lock: makes `root`/step_<N>.tmp/ fresh. AlreadyExists when
// `latest` names step_<N>.
//
// The rule for what a save may remove: only step_<N>.tmp, which under the lock is the debris
// of an interrupted save (no other writer can be producing it). A step_<N> that `latest` does
// not name (a save interrupted after its rename, or another run's) may hold the only copy of
// something: it is moved aside to step_<N>.replaced-<id>, never deleted.
absl::Status PrepareDirs(FileSystem* fs, const std::string& root, int64_t step, uint64_t id) {
  ASSIGN_OR_RETURN(std::string latest, ReadLatest(fs, root));
  const std::string name = StepDirName(step);
  if (latest == name) {
    return absl::AlreadyExistsError(absl::StrCat(
        "checkpoint '", JoinPath(root, name), "' already exists and is the latest: save another "
        "step, or into another directory"));
  }
  const std::string dir = JoinPath(root, name);
  if (fs->Exists(dir)) {
    RETURN_IF_ERROR(
        fs->Rename(dir, JoinPath(root, absl::StrFormat("%s.replaced-%016x", name, id))));
  }
  RETURN_IF_ERROR(fs->RemoveAll(JoinPath(root, name + ".tmp")));
  RETURN_IF_ERROR(fs->MakeDir(JoinPath(root, name + ".tmp")));
  return fs->SyncDir(root);
}

// Rank 0: creates `root`, takes its lock (held in `*lock` until the save commits or fails) and
// prepares the step directory.
absl::Status LockAndPrepare(FileSystem* fs, const std::string& root, int64_t step, uint64_t id,
                            std::unique_ptr<ckpt_internal::DirLock>* lock) {
  RETURN_IF_ERROR(MakeDirs(fs, root));
  ASSIGN_OR_RETURN(*lock, ckpt_internal::DirLock::Acquire(root));
  absl::Status s = PrepareDirs(fs, root, step, id);
  if (!s.ok()) Abandon(fs, JoinPath(root, StepDirName(step) + ".tmp"), lock);
  return s;
}

// Collective: prepares the directory and starts the snapshot of this rank's state into
// `*staging` (grown to the shard's size from `allocator` when smaller): the copies overlap what
// the trainer does next, and WriteShard waits for them.
absl::StatusOr<std::unique_ptr<AsyncCheckpointer::Pending>> BeginSave(
    Engine& engine, const std::string& root, FileSystem* fs, memory::RawAllocator* allocator,
    memory::Allocation* staging) {
  if (!engine.at_step_boundary()) {
    return absl::FailedPreconditionError(
        "SaveCheckpoint inside an accumulation window: save between optimizer steps");
  }
  // Never comm::DirectHostExchange on the engine's communicator: on NCCL it fails.
  std::unique_ptr<comm::HostExchange> exchange = engine.NewHostExchange();
  const int64_t step = engine.step();
  Manifest manifest = ManifestOf(engine, 0);
  // Every rank has the same names, so every rank refuses here alone, before any collective,
  // with the same error (rather than rank 0 failing to encode the manifest at the commit).
  const absl::Status names = ckpt_internal::CheckManifestStrings(manifest);
  if (!names.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "SaveCheckpoint: ", names.message(), " (a checkpoint stores names as UTF-8 JSON)"));
  }
  absl::Status s;
  uint64_t id = 0;
  std::unique_ptr<ckpt_internal::DirLock> lock;
  const std::string tmp_dir = JoinPath(root, StepDirName(step) + ".tmp");
  if (exchange->rank() == 0) {
    id = NewCheckpointId();
    s = LockAndPrepare(fs, root, step, id, &lock);
  }
  s = Agree(*exchange, s);
  std::vector<uint64_t> ids;
  if (s.ok()) ids = AllGatherU64(*exchange, {id}, &s);
  if (!s.ok()) {
    Abandon(fs, tmp_dir, &lock);
    return s;
  }
  id = ids[0];  // rank 0's
  auto p = std::make_unique<AsyncCheckpointer::Pending>();
  p->fs = fs;
  p->exchange = std::move(exchange);
  p->engine = &engine;
  p->wait_snapshot = engine.SnapshotWaiter();
  p->lock = std::move(lock);
  p->root = root;
  p->tmp_dir = tmp_dir;
  p->final_dir = JoinPath(root, StepDirName(step));
  p->manifest = std::move(manifest);
  p->manifest.checkpoint_id = id;
  const Manifest& m = p->manifest;
  const memory::Plan& plan = engine.plan();
  p->file_rank = SavedShard(plan.options);
  p->header = ckpt_internal::EncodeShardHeader(m, p->file_rank);
  p->body_bytes = static_cast<size_t>(m.ShardFileBytes()) - p->header.size();
  // The snapshot holds the engine's owned state (plan.shard_elements per section: with HSDP
  // the group shard, world / G times the file's); the file takes flat shard file_rank's range
  // of every unit from it, adjacent ranges merged (flat: one piece per file).
  const size_t owned = static_cast<size_t>(plan.shard_elements);
  const int replica = plan.options.rank / memory::ShardGroupSize(plan.options);
  for (int k = 0; k < m.num_sections(); ++k) {
    const size_t es = k == 3 ? DTypeSize(m.compute_dtype) : 4;
    for (size_t u = 0; u < plan.units.size(); ++u) {
      const size_t at = k * owned * 4 +
                        (plan.units[u].shard_offset + replica * m.units[u].shard) * es;
      const size_t n = m.units[u].shard * es;
      if (n == 0) continue;
      if (!p->pieces.empty() && p->pieces.back().first + p->pieces.back().second == at) {
        p->pieces.back().second += n;
      } else {
        p->pieces.emplace_back(at, n);
      }
    }
  }
  const size_t staged_bytes =
      owned * (3 * 4 + (m.has_param_section ? DTypeSize(m.compute_dtype) : 0));
  // A failure here stays local (like a write failure): CommitSave agrees on it.
  if (staging->bytes() < staged_bytes) {
    *staging = memory::Allocation();
    absl::StatusOr<memory::Allocation> a = memory::Allocation::Create(allocator, staged_bytes);
    if (!a.ok()) {
      p->status = absl::Status(a.status().code(),
                               absl::StrCat("checkpoint snapshot buffer: ", a.status().message()));
      return p;
    }
    *staging = *std::move(a);
  }
  p->body = staging->as<char>();
  auto section = [&](int k) { return reinterpret_cast<float*>(p->body + k * owned * 4); };
  void* param = m.has_param_section ? static_cast<void*>(section(3)) : nullptr;
  p->status = engine.BeginSnapshot(section(0), section(1), section(2), param);
  return p;
}

// Local: waits for the snapshot, then writes and fsyncs this rank's shard file (on the writer
// thread when asynchronous).
absl::Status WriteShard(AsyncCheckpointer::Pending* p) {
  // Wait even after a failed start: copies already enqueued write into the staging buffer.
  const absl::Status copied = p->wait_snapshot();
  RETURN_IF_ERROR(p->status);
  RETURN_IF_ERROR(copied);
  p->crc = Crc32c(0, p->header.data(), p->header.size());
  for (const auto& [at, n] : p->pieces) p->crc = Crc32c(p->crc, p->body + at, n);
  const std::string path = JoinPath(p->tmp_dir, ckpt_internal::ShardFileName(p->file_rank));
  ASSIGN_OR_RETURN(std::unique_ptr<ckpt_internal::WritableFile> f, p->fs->NewWritableFile(path));
  RETURN_IF_ERROR(WriteAll(f.get(), p->header));
  for (const auto& [at, n] : p->pieces) {
    RETURN_IF_ERROR(WriteAll(f.get(), absl::string_view(p->body + at, n)));
  }
  RETURN_IF_ERROR(f->Sync());
  RETURN_IF_ERROR(f->Close());
  return p->fs->SyncDir(p->tmp_dir);
}

// Collective: once every shard is durable, rank 0 publishes the checkpoint.
absl::StatusOr<std::string> CommitSave(AsyncCheckpointer::Pending* p) {
  comm::HostExchange& exchange = *p->exchange;
  absl::Status agreed = Agree(exchange, p->status);
  std::vector<uint64_t> sizes;
  if (agreed.ok()) {
    sizes = AllGatherU64(
        exchange,
        {p->header.size() + p->body_bytes, p->crc, static_cast<uint64_t>(p->file_rank)},
        &agreed);
  }
  if (!agreed.ok()) {
    Abandon(p->fs, p->tmp_dir, &p->lock);
    return agreed;
  }
  absl::Status s;
  if (exchange.rank() == 0) {
    Manifest m = p->manifest;
    // Indexed by the shard each rank wrote (SavedShard: a permutation of the ranks).
    m.files.resize(exchange.size());
    for (int r = 0; r < exchange.size(); ++r) {
      const int q = static_cast<int>(sizes[3 * r + 2]);
      m.files[q] = {ckpt_internal::ShardFileName(q), q, static_cast<int64_t>(sizes[3 * r]),
                    static_cast<uint32_t>(sizes[3 * r + 1])};
    }
    FileSystem* fs = p->fs;
    s = [&]() -> absl::Status {
      RETURN_IF_ERROR(ckpt_internal::WriteFileAtomically(
          fs, JoinPath(p->tmp_dir, kManifestName), ckpt_internal::ManifestToJson(m)));
      RETURN_IF_ERROR(fs->Rename(p->tmp_dir, p->final_dir));
      RETURN_IF_ERROR(fs->SyncDir(p->root));
      // Only now, with the checkpoint complete and durable, does `latest` move.
      return ckpt_internal::WriteFileAtomically(
          fs, JoinPath(p->root, kLatestName),
          absl::StrCat(StepDirName(p->manifest.step), "\n"));
    }();
    // A failure before the rename leaves step_<N>.tmp/: not a checkpoint `latest` names.
    if (!s.ok()) Abandon(fs, p->tmp_dir, &p->lock);
    p->lock.reset();
  }
  RETURN_IF_ERROR(Agree(exchange, s));
  return p->final_dir;
}

}  // namespace

absl::StatusOr<std::string> SaveCheckpoint(Engine& engine, const std::string& root,
                                           const SaveOptions& options) {
  // Pageable memory: pinning a buffer for one synchronous save costs more than it saves.
  memory::Allocation body;
  ASSIGN_OR_RETURN(std::unique_ptr<AsyncCheckpointer::Pending> p,
                   BeginSave(engine, root, Fs(options.fs), memory::HostAllocator(), &body));
  p->status = WriteShard(p.get());
  return CommitSave(p.get());
}

AsyncCheckpointer::AsyncCheckpointer(SaveOptions options) : options_(options) {}

AsyncCheckpointer::~AsyncCheckpointer() {
  if (pending_ != nullptr && pending_->writer.joinable()) pending_->writer.join();
}

absl::Status AsyncCheckpointer::Start(Engine& engine, const std::string& root) {
  if (pending_ != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "AsyncCheckpointer::Start while the save of '", pending_->final_dir,
        "' is in flight: call Finish first"));
  }
  start_status_ = absl::OkStatus();
  // The snapshot lands in pinned memory that lives as long as this checkpointer: one
  // page-locked slab of the process-wide cache for every save of the run, and copies a GPU
  // makes asynchronously.
  absl::StatusOr<std::unique_ptr<Pending>> p_or =
      BeginSave(engine, root, Fs(options_.fs),
                engine.device()->allocator(memory::MemoryKind::kPinnedHost), &staging_);
  if (!p_or.ok()) {
    start_status_ = p_or.status();  // what Finish reports, instead of "no save in flight"
    return p_or.status();
  }
  pending_ = *std::move(p_or);
  Pending* p = pending_.get();
  // The writer touches only `p` (its snapshot and the file system) and Engine::WaitSnapshot,
  // never the communicator, so training goes on; join() in Finish publishes its status.
  p->writer = std::thread([p] { p->status = WriteShard(p); });
  return absl::OkStatus();
}

const Engine* AsyncCheckpointer::saving() const {
  return pending_ == nullptr ? nullptr : pending_->engine;
}

absl::StatusOr<std::string> AsyncCheckpointer::Finish() {
  if (pending_ == nullptr && !start_status_.ok()) {
    // The save failed at Start (on every rank alike: Start agrees): its cause, once.
    const absl::Status s = std::exchange(start_status_, absl::OkStatus());
    return absl::Status(s.code(), absl::StrCat("AsyncCheckpointer::Finish: the save failed at "
                                               "Start: ", s.message()));
  }
  if (pending_ == nullptr) {
    return absl::FailedPreconditionError("AsyncCheckpointer::Finish without a save in flight");
  }
  std::unique_ptr<Pending> p = std::move(pending_);
  p->writer.join();
  return CommitSave(p.get());
}

}  // namespace zerort
