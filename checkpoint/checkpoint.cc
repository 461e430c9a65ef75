#include "checkpoint/checkpoint.h"

#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <new>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "comm/agree.h"
#include "memory/arena.h"
#include "nlohmann/json.hpp"
#include "zero/config.h"
#include "base/crc32c.h"
#include "checkpoint/internal/ckpt_fs.h"
#include "checkpoint/internal/ckpt_manifest.h"

namespace zerort {

using ckpt_internal::FileSystem;
using ckpt_internal::JoinPath;
using ckpt_internal::Manifest;

namespace {

constexpr char kManifestName[] = "manifest.json";
constexpr char kLatestName[] = "latest";
constexpr size_t kIoChunk = size_t{8} << 20;  // bytes per read/write call

FileSystem* Fs(FileSystem* fs) { return fs != nullptr ? fs : ckpt_internal::PosixFileSystem(); }

std::string StepDirName(int64_t step) { return absl::StrCat("step_", step); }

// --- collectives on small values --------------------------------------------------------------
// Through comm/agree.h, which moves integers and bytes as such.

std::vector<uint64_t> AllGatherU64(comm::Communicator* comm, const std::vector<uint64_t>& mine,
                                   absl::Status* status) {
  comm::DirectHostExchange exchange(comm);
  absl::StatusOr<std::vector<uint64_t>> all = comm::AllGatherU64(exchange, mine);
  *status = all.status();
  return all.ok() ? *std::move(all) : std::vector<uint64_t>(mine.size() * comm->size(), 0);
}

// Every rank returns the same verdict (comm::AgreeOnStatus): one rank's bad file fails the load
// everywhere, before any engine is touched, instead of leaving the others to hang in the next
// collective.
absl::Status Agree(comm::Communicator* comm, const absl::Status& local) {
  comm::DirectHostExchange exchange(comm);
  return comm::AgreeOnStatus(exchange, local);
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

// The manifest keeps the loss scaler's state (zero/loss_scaler.h ScalerState) under the same
// names, in its "loss_scaler" object on disk.
void SetScalerState(const ScalerState& s, Manifest* m) {
  m->loss_scale = s.loss_scale;
  m->scaler_hysteresis_left = s.scaler_hysteresis_left;
  m->scaler_iter = s.scaler_iter;
  m->scaler_last_overflow = s.scaler_last_overflow;
}

ScalerState ScalerStateOf(const Manifest& m) {
  ScalerState s;
  s.loss_scale = m.loss_scale;
  s.scaler_hysteresis_left = m.scaler_hysteresis_left;
  s.scaler_iter = m.scaler_iter;
  s.scaler_last_overflow = m.scaler_last_overflow;
  return s;
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
  SetScalerState(st, &m);
  m.hyperparams_set = st.hyperparams_set;
  m.lr = st.hyperparams.lr;
  m.beta1 = st.hyperparams.beta1;
  m.beta2 = st.hyperparams.beta2;
  m.eps = st.hyperparams.eps;
  m.weight_decay = st.hyperparams.weight_decay;
  m.shard_elements = plan.shard_elements;
  m.has_param_section = plan.options.stage == 3;
  for (const memory::Unit& u : plan.units) {
    m.units.push_back({u.name, u.padded, u.shard, u.shard_offset});
  }
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

// `latest` holds "step_<N>\n": a few bytes, in a plain file (a symlink or a device in its place
// is refused: its target is never read, let alone printed).
constexpr int64_t kMaxLatestBytes = 32;

// `latest`'s content, or "" when there is none. What it holds is quoted escaped and bounded in
// errors: it is not ours until it has been checked.
absl::StatusOr<std::string> ReadLatest(FileSystem* fs, const std::string& root) {
  const std::string path = JoinPath(root, kLatestName);
  if (!fs->Exists(path)) return std::string();
  absl::StatusOr<std::string> text = ckpt_internal::ReadSmallFile(fs, path, kMaxLatestBytes);
  if (!text.ok()) {
    return absl::DataLossError(absl::StrCat("'", path, "' is not a checkpoint pointer: ",
                                            text.status().message()));
  }
  absl::string_view name = *text;
  if (absl::EndsWith(name, "\n")) name.remove_suffix(1);
  int64_t step;
  if (!absl::StartsWith(name, "step_") || name.size() == 5 ||
      name.find_first_not_of("0123456789", 5) != absl::string_view::npos ||
      !absl::SimpleAtoi(name.substr(5), &step)) {
    return absl::DataLossError(absl::StrCat("'", path, "' holds \"", absl::CHexEscape(name),
                                            "\", not the name of a checkpoint (step_<N>)"));
  }
  return std::string(name);
}

absl::StatusOr<std::string> ResolveDir(FileSystem* fs, const std::string& path) {
  if (fs->Exists(JoinPath(path, kManifestName))) return path;
  ASSIGN_OR_RETURN(std::string latest, ReadLatest(fs, path));
  if (latest.empty()) {
    return absl::NotFoundError(absl::StrCat("no checkpoint at '", path, "': neither ",
                                            kManifestName, " nor ", kLatestName, " exists"));
  }
  const std::string dir = JoinPath(path, latest);
  if (!fs->IsDirectory(dir)) {
    return absl::DataLossError(absl::StrCat(
        "'", JoinPath(path, kLatestName), "' names ", latest, ", which is ",
        fs->Exists(dir) ? "not a directory (a symlink is refused)" : "missing"));
  }
  return dir;
}

absl::StatusOr<Manifest> ReadManifest(FileSystem* fs, const std::string& dir) {
  const std::string path = JoinPath(dir, kManifestName);
  absl::StatusOr<std::string> text =
      ckpt_internal::ReadSmallFile(fs, path, ckpt_internal::kMaxManifestBytes);
  if (!text.ok()) return Annotate(text.status(), "reading the checkpoint manifest");
  absl::StatusOr<Manifest> m = ckpt_internal::ParseManifest(*text);
  if (!m.ok()) return Annotate(m.status(), path);
  return m;
}

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
                   std::vector<std::vector<Piece>>* per_file) {
  const ckpt_internal::ManifestParam& p = m.params[i];
  const ckpt_internal::ManifestUnit& u = m.units[p.unit];
  int64_t pos = p.offset_in_unit + e0;  // element inside the saved unit
  int64_t done = 0;
  while (done < count) {
    const int q = static_cast<int>(pos / u.shard);
    const int64_t within = pos % u.shard;
    const int64_t take = std::min(count - done, u.shard - within);
    for (int k = 0; k < 3; ++k) {
      char* to = dst[k] != nullptr ? reinterpret_cast<char*>(dst[k] + done) : nullptr;
      (*per_file)[q].push_back({m.SectionOffset(k) + (u.shard_offset + within) * 4, take * 4, to,
                                i, k, e0 + done});
    }
    done += take;
    pos += take;
  }
}

// The size check of one shard file, before anything is read or allocated for it.
absl::Status CheckShardSize(FileSystem* fs, const std::string& dir, const Manifest& m, int q) {
  const ckpt_internal::ManifestFile& f = m.files[q];
  const std::string path = JoinPath(dir, f.name);
  absl::StatusOr<int64_t> size = fs->FileSize(path);
  if (absl::IsNotFound(size.status())) {
    return absl::NotFoundError(absl::StrCat("checkpoint shard '", path, "' is missing"));
  }
  RETURN_IF_ERROR(size.status());
  if (*size != f.bytes) {
    return absl::DataLossError(absl::StrCat(
        "checkpoint shard '", path, "' ", *size < f.bytes ? "is truncated: " : "has ", *size,
        " bytes, the manifest says ", f.bytes));
  }
  return absl::OkStatus();
}

// Every shard's size, so that a small manifest claiming a huge state fails before anything is
// allocated for it.
absl::Status CheckShardSizes(FileSystem* fs, const std::string& dir, const Manifest& m) {
  for (int q = 0; q < m.world_size; ++q) RETURN_IF_ERROR(CheckShardSize(fs, dir, m, q));
  return absl::OkStatus();
}

// Streams one shard file once through a buffer of at most kIoChunk bytes: checks its header,
// size and CRC32C, and hands the pieces to `dst` or, where that is null, to `sink`.
absl::Status ReadShard(FileSystem* fs, const std::string& dir, const Manifest& m, int q,
                       std::vector<Piece> pieces, const PieceSink& sink = nullptr) {
  const ckpt_internal::ManifestFile& f = m.files[q];
  const std::string path = JoinPath(dir, f.name);
  RETURN_IF_ERROR(CheckShardSize(fs, dir, m, q));
  std::sort(pieces.begin(), pieces.end(),
            [](const Piece& a, const Piece& b) { return a.offset < b.offset; });
  ASSIGN_OR_RETURN(std::unique_ptr<ckpt_internal::ReadableFile> file, fs->NewReadableFile(path));
  std::vector<char> buf(static_cast<size_t>(std::min<int64_t>(f.bytes, kIoChunk)));
  uint32_t crc = 0;
  int64_t pos = 0;
  size_t next = 0;  // first piece not yet fully copied
  bool header_checked = false;
  while (pos < f.bytes) {
    const size_t want = static_cast<size_t>(std::min<int64_t>(buf.size(), f.bytes - pos));
    size_t got = 0;
    while (got < want) {
      ASSIGN_OR_RETURN(size_t n, file->Read(buf.data() + got, want - got));
      if (n == 0) {
        return absl::DataLossError(absl::StrCat("checkpoint shard '", path,
                                                "' ended early while reading (at byte ",
                                                pos + got, " of ", f.bytes, ")"));
      }
      got += n;
    }
    if (!header_checked) {
      // The header is the first bytes of the first chunk (chunks are far above 64 bytes).
      RETURN_IF_ERROR(CheckShardHeader(absl::string_view(buf.data(), want), m, q, path));
      header_checked = true;
    }
    crc = Crc32c(crc, buf.data(), want);
    const int64_t end = pos + static_cast<int64_t>(want);
    for (size_t k = next; k < pieces.size() && pieces[k].offset < end; ++k) {
      const Piece& p = pieces[k];
      const int64_t a = std::max(p.offset, pos);
      const int64_t b = std::min(p.offset + p.bytes, end);
      if (a < b && p.dst != nullptr) {
        std::memcpy(p.dst + (a - p.offset), buf.data() + (a - pos), b - a);
      } else if (a < b) {
        RETURN_IF_ERROR(sink(p, a - p.offset, buf.data() + (a - pos), b - a));
      }
      if (p.offset + p.bytes <= end && k == next) ++next;
    }
    pos = end;
  }
  if (crc != f.crc32c) {
    return absl::DataLossError(absl::StrFormat(
        "checkpoint shard '%s' is corrupted: CRC32C %08x, the manifest says %08x", path, crc,
        f.crc32c));
  }
  return absl::OkStatus();
}

CheckpointInfo InfoOf(const Manifest& m, const std::string& dir) {
  CheckpointInfo info;
  info.dir = dir;
  info.format_version = m.format_version;
  info.step = m.step;
  info.world_size = m.world_size;
  info.stage = m.stage;
  info.compute_dtype = std::string(DTypeName(m.compute_dtype));
  info.config_hash = m.config_hash;
  info.loss_scale = m.loss_scale;
  info.num_units = static_cast<int>(m.units.size());
  for (const auto& p : m.params) info.params.push_back({p.name, p.shape, p.numel});
  for (const auto& f : m.files) info.files.push_back({f.name, f.bytes, f.crc32c});
  return info;
}

// The local part of a load: everything that can fail, before the engine is touched.
absl::Status ReadOwned(Engine& engine, const std::string& path, const LoadOptions& options,
                       std::vector<float>* master, std::vector<float>* m, std::vector<float>* v,
                       EngineState* state) {
  FileSystem* fs = Fs(options.fs);
  if (!engine.at_step_boundary()) {
    return absl::FailedPreconditionError(
        "LoadCheckpoint inside an accumulation window: load between optimizer steps");
  }
  ASSIGN_OR_RETURN(std::string dir, ResolveDir(fs, path));
  ASSIGN_OR_RETURN(Manifest man, ReadManifest(fs, dir));
  const memory::Plan& plan = engine.plan();
  const int world = plan.options.world_size;
  const int rank = plan.options.rank;
  if (man.world_size != world && !options.allow_reshard) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint '", dir, "' was saved by ", man.world_size, " ranks; this engine has ", world,
        ": set LoadOptions::allow_reshard to reshard it"));
  }
  if (man.params.size() != plan.params.size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint '", dir, "' holds ", man.params.size(), " parameters; the engine has ",
        plan.params.size()));
  }
  for (size_t i = 0; i < plan.params.size(); ++i) {
    const auto& a = man.params[i];
    const auto& b = plan.params[i];
    if (a.name != b.name || a.shape != b.shape) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint '", dir, "': parameter ", i, " is '", a.name, "' [",
          absl::StrJoin(a.shape, ", "), "], the engine's is '", b.name, "' [",
          absl::StrJoin(b.shape, ", "), "]"));
    }
  }
  const int64_t n = plan.shard_elements;
  master->assign(n, 0.0f);  // padding stays zero, as the engine keeps it
  m->assign(n, 0.0f);
  v->assign(n, 0.0f);
  std::vector<std::vector<Piece>> per_file(man.world_size);
  for (const memory::Unit& u : plan.units) {
    const int64_t own0 = rank * u.shard, own1 = own0 + u.shard;
    for (int i : u.params) {
      const memory::ParamLayout& p = plan.params[i];
      const int64_t a = std::max(own0, p.offset_in_unit);
      const int64_t b = std::min(own1, p.offset_in_unit + p.numel);
      if (a >= b) continue;
      const int64_t at = u.shard_offset + (a - own0);
      float* const dst[3] = {master->data() + at, m->data() + at, v->data() + at};
      AddParamRange(man, i, a - p.offset_in_unit, b - a, dst, &per_file);
    }
  }
  for (int q = 0; q < man.world_size; ++q) {
    // Every file is verified by at least one rank, even one that only holds padding.
    if (per_file[q].empty() && q % world != rank) continue;
    RETURN_IF_ERROR(ReadShard(fs, dir, man, q, std::move(per_file[q])));
  }
  state->step = man.step;
  static_cast<ScalerState&>(*state) = ScalerStateOf(man);
  state->hyperparams_set = man.hyperparams_set;
  state->hyperparams = {man.lr, man.beta1, man.beta2, man.eps, man.weight_decay};
  return absl::OkStatus();
}

absl::Status WriteAll(ckpt_internal::WritableFile* f, absl::string_view data) {
  while (!data.empty()) {
    const size_t n = std::min(data.size(), kIoChunk);
    RETURN_IF_ERROR(f->Append(data.substr(0, n)));
    data.remove_prefix(n);
  }
  return absl::OkStatus();
}

}  // namespace

// --- save ----------------------------------------------------------------------------------

struct AsyncCheckpointer::Pending {
  FileSystem* fs = nullptr;
  comm::Communicator* comm = nullptr;
  const Engine* engine = nullptr;  // for saving(): compared, never dereferenced
  // Waits for the engine's snapshot copies; safe after the engine is gone
  // (Engine::SnapshotWaiter), so destroying the engine with a save in flight is not a
  // use-after-free.
  std::function<absl::Status()> wait_snapshot;
  std::unique_ptr<ckpt_internal::DirLock> lock;  // rank 0: the root's, until the commit
  std::string root, tmp_dir, final_dir;
  Manifest manifest;  // without files
  std::string header;            // this rank's shard file: header, then
  char* body = nullptr;          // the sections, filled by Engine::BeginSnapshot (the
                                 // staging buffer of BeginSave's caller)
  size_t body_bytes = 0;
  uint32_t crc = 0;              // of header + body, computed by the writer
  absl::Status status;  // snapshot or write failure on this rank
  std::thread writer;
};

namespace {

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
  if (!s.ok()) lock->reset();
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
  comm::Communicator* comm = engine.communicator();
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
  if (comm->rank() == 0) {
    id = NewCheckpointId();
    s = LockAndPrepare(fs, root, step, id, &lock);
  }
  RETURN_IF_ERROR(Agree(comm, s));
  {
    absl::Status cs;
    const std::vector<uint64_t> ids = AllGatherU64(comm, {id}, &cs);
    RETURN_IF_ERROR(cs);
    id = ids[0];  // rank 0's
  }
  auto p = std::make_unique<AsyncCheckpointer::Pending>();
  p->fs = fs;
  p->comm = comm;
  p->engine = &engine;
  p->wait_snapshot = engine.SnapshotWaiter();
  p->lock = std::move(lock);
  p->root = root;
  p->tmp_dir = JoinPath(root, StepDirName(step) + ".tmp");
  p->final_dir = JoinPath(root, StepDirName(step));
  p->manifest = std::move(manifest);
  p->manifest.checkpoint_id = id;
  const Manifest& m = p->manifest;
  p->header = ckpt_internal::EncodeShardHeader(m, comm->rank());
  p->body_bytes = static_cast<size_t>(m.ShardFileBytes()) - p->header.size();
  // A failure here stays local (like a write failure): CommitSave agrees on it.
  if (staging->bytes() < p->body_bytes) {
    *staging = memory::Allocation();
    absl::StatusOr<memory::Allocation> a = memory::Allocation::Create(allocator, p->body_bytes);
    if (!a.ok()) {
      p->status = absl::Status(a.status().code(),
                               absl::StrCat("checkpoint snapshot buffer: ", a.status().message()));
      return p;
    }
    *staging = *std::move(a);
  }
  p->body = staging->as<char>();
  auto section = [&](int k) {
    return reinterpret_cast<float*>(p->body + m.SectionOffset(k) - p->header.size());
  };
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
  p->crc = Crc32c(p->crc, p->body, p->body_bytes);
  const std::string path = JoinPath(p->tmp_dir, ckpt_internal::ShardFileName(p->comm->rank()));
  ASSIGN_OR_RETURN(std::unique_ptr<ckpt_internal::WritableFile> f, p->fs->NewWritableFile(path));
  RETURN_IF_ERROR(WriteAll(f.get(), p->header));
  RETURN_IF_ERROR(WriteAll(f.get(), absl::string_view(p->body, p->body_bytes)));
  RETURN_IF_ERROR(f->Sync());
  RETURN_IF_ERROR(f->Close());
  return p->fs->SyncDir(p->tmp_dir);
}

// Collective: once every shard is durable, rank 0 publishes the checkpoint.
absl::StatusOr<std::string> CommitSave(AsyncCheckpointer::Pending* p) {
  comm::Communicator* comm = p->comm;
  RETURN_IF_ERROR(Agree(comm, p->status));
  absl::Status cs;
  const std::vector<uint64_t> sizes =
      AllGatherU64(comm, {p->header.size() + p->body_bytes, p->crc}, &cs);
  RETURN_IF_ERROR(cs);
  absl::Status s;
  if (comm->rank() == 0) {
    Manifest m = p->manifest;
    for (int r = 0; r < comm->size(); ++r) {
      m.files.push_back({ckpt_internal::ShardFileName(r), r,
                         static_cast<int64_t>(sizes[2 * r]),
                         static_cast<uint32_t>(sizes[2 * r + 1])});
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
    p->lock.reset();
  }
  RETURN_IF_ERROR(Agree(comm, s));
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
  // The snapshot lands in pinned memory that lives as long as this checkpointer: one
  // page-locked slab of the process-wide cache for every save of the run, and copies a GPU
  // makes asynchronously.
  ASSIGN_OR_RETURN(pending_,
                   BeginSave(engine, root, Fs(options_.fs),
                             engine.device()->allocator(memory::MemoryKind::kPinnedHost),
                             &staging_));
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
  if (pending_ == nullptr) {
    return absl::FailedPreconditionError("AsyncCheckpointer::Finish without a save in flight");
  }
  std::unique_ptr<Pending> p = std::move(pending_);
  p->writer.join();
  return CommitSave(p.get());
}

// --- load ----------------------------------------------------------------------------------

absl::Status LoadCheckpoint(Engine& engine, const std::string& path, const LoadOptions& options) {
  std::vector<float> master, m, v;
  EngineState state;
  const absl::Status local = ReadOwned(engine, path, options, &master, &m, &v, &state);
  RETURN_IF_ERROR(Agree(engine.communicator(), local));
  return engine.RestoreOwnedState(master, m, v, state);
}

absl::StatusOr<CheckpointInfo> ReadCheckpointInfo(const std::string& path, FileSystem* fs) {
  fs = Fs(fs);
  ASSIGN_OR_RETURN(std::string dir, ResolveDir(fs, path));
  ASSIGN_OR_RETURN(Manifest m, ReadManifest(fs, dir));
  return InfoOf(m, dir);
}

absl::StatusOr<CheckpointState> ReadCheckpoint(const std::string& path, FileSystem* fs) {
  fs = Fs(fs);
  ASSIGN_OR_RETURN(std::string dir, ResolveDir(fs, path));
  ASSIGN_OR_RETURN(Manifest man, ReadManifest(fs, dir));
  // The files must really hold what the manifest claims before anything is allocated for it.
  RETURN_IF_ERROR(CheckShardSizes(fs, dir, man));
  CheckpointState out;
  out.info = InfoOf(man, dir);
  const size_t np = man.params.size();
  std::vector<std::vector<Piece>> per_file(man.world_size);
  try {
    out.master.resize(np);
    out.exp_avg.resize(np);
    out.exp_avg_sq.resize(np);
    for (size_t i = 0; i < np; ++i) {
      const int64_t n = man.params[i].numel;
      out.master[i].resize(n);
      out.exp_avg[i].resize(n);
      out.exp_avg_sq[i].resize(n);
      float* const dst[3] = {out.master[i].data(), out.exp_avg[i].data(),
                             out.exp_avg_sq[i].data()};
      AddParamRange(man, static_cast<int>(i), 0, n, dst, &per_file);
    }
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "reading checkpoint '", dir, "' into memory: out of memory (",
        man.world_size * man.ShardFileBytes(), " bytes of shards); VerifyCheckpoint and "
        "ConsolidateCheckpoint stream instead"));
  }
  for (int q = 0; q < man.world_size; ++q) {
    RETURN_IF_ERROR(ReadShard(fs, dir, man, q, std::move(per_file[q])));
  }
  return out;
}

namespace {

// Streams every shard once (bounded memory), handing each parameter's pieces to `sink`.
absl::Status StreamShards(FileSystem* fs, const std::string& dir, const Manifest& man,
                          const PieceSink& sink) {
  RETURN_IF_ERROR(CheckShardSizes(fs, dir, man));
  std::vector<std::vector<Piece>> per_file(man.world_size);
  float* const none[3] = {nullptr, nullptr, nullptr};
  for (size_t i = 0; i < man.params.size(); ++i) {
    AddParamRange(man, static_cast<int>(i), 0, man.params[i].numel, none, &per_file);
  }
  for (int q = 0; q < man.world_size; ++q) {
    RETURN_IF_ERROR(ReadShard(fs, dir, man, q, std::move(per_file[q]), sink));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CheckpointSummary> VerifyCheckpoint(const std::string& path, FileSystem* fs) {
  fs = Fs(fs);
  ASSIGN_OR_RETURN(std::string dir, ResolveDir(fs, path));
  ASSIGN_OR_RETURN(Manifest man, ReadManifest(fs, dir));
  CheckpointSummary out;
  out.info = InfoOf(man, dir);
  std::vector<double> sum_sq(man.params.size(), 0.0);
  // Pieces of one parameter arrive in element order (shards in rank order, each sorted by
  // offset), so the sum is the one a loop over the parameter's elements would give.
  RETURN_IF_ERROR(StreamShards(fs, dir, man, [&](const Piece& p, int64_t, const char* data,
                                                 int64_t n) {
    if (p.section != 0) return absl::OkStatus();
    for (int64_t k = 0; k < n; k += 4) {
      float x;
      std::memcpy(&x, data + k, 4);
      sum_sq[p.param] += static_cast<double>(x) * x;
    }
    return absl::OkStatus();
  }));
  for (double s2 : sum_sq) out.master_norm.push_back(std::sqrt(s2));
  return out;
}

namespace {

// The real path of `path` (which may not exist yet): its parent's, joined with its name.
absl::StatusOr<std::string> RealPath(const std::string& path) {
  const std::string parent = ckpt_internal::Dirname(path);
  char* real = ::realpath(parent.c_str(), nullptr);
  if (real == nullptr) {
    return absl::NotFoundError(absl::StrCat("output directory '", parent, "': ",
                                            std::strerror(errno)));
  }
  std::string out = real;
  std::free(real);
  absl::string_view base = path;
  while (base.size() > 1 && base.back() == '/') base.remove_suffix(1);
  const size_t slash = base.rfind('/');
  if (slash != absl::string_view::npos) base.remove_prefix(slash + 1);
  return JoinPath(out, base);
}

// Consolidate never writes into the checkpoint it reads: not inside the directory given, nor
// inside the step directory it resolved to, nor over the root's own `latest`, lock or steps.
absl::Status CheckOutsideCheckpoint(const std::string& path, const std::string& dir,
                                    const std::string& out) {
  ASSIGN_OR_RETURN(const std::string real_out, RealPath(out));
  auto refuse = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "refusing to write '", out, "' ", why, " (the checkpoint being read): write the "
        "consolidated file elsewhere"));
  };
  for (const std::string& d : {path, dir}) {
    char* real = ::realpath(d.c_str(), nullptr);
    if (real == nullptr) continue;
    const std::string r = real;
    std::free(real);
    if (absl::StartsWith(real_out, JoinPath(r, ""))) return refuse(absl::StrCat("inside '", d, "'"));
    const std::string root = ckpt_internal::Dirname(r);
    const std::string name = real_out.substr(real_out.rfind('/') + 1);
    if (ckpt_internal::Dirname(real_out) == root &&
        (absl::StartsWith(name, kLatestName) || absl::StartsWith(name, "step_") ||
         name == ckpt_internal::DirLock::kFileName)) {
      return refuse(absl::StrCat("over a file of '", root, "'"));
    }
  }
  return absl::OkStatus();
}

// The tensor names consolidate writes, each unique, none the safetensors metadata key.
absl::Status CheckTensorNames(const CheckpointInfo& info) {
  std::vector<std::string> all;
  for (const auto& p : info.params) {
    if (p.name == "__metadata__") {
      return absl::InvalidArgumentError(
          "cannot consolidate: a parameter is named '__metadata__', the key safetensors "
          "reserves for its metadata");
    }
    for (const char* prefix : {"", "exp_avg.", "exp_avg_sq."}) all.push_back(prefix + p.name);
  }
  std::sort(all.begin(), all.end());
  for (size_t k = 1; k < all.size(); ++k) {
    if (all[k] == all[k - 1]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cannot consolidate: tensor name '", all[k], "' would appear twice (a parameter "
          "is named like another's Adam moment)"));
    }
  }
  return absl::OkStatus();
}

// safetensors: u64 little-endian header length, JSON header, then the tensors back to back.
// `offsets[k][i]` receives where tensor (section k, parameter i) starts in the file.
std::string SafetensorsHeader(const CheckpointInfo& info,
                              std::vector<std::vector<int64_t>>* offsets) {
  nlohmann::ordered_json header;
  header["__metadata__"] = {{"format", "pt"},
                            {"producer", "zerort ckpt consolidate"},
                            {"source", info.dir},
                            {"step", absl::StrCat(info.step)},
                            {"loss_scale", absl::StrCat(info.loss_scale)},
                            {"config_hash", info.config_hash}};
  // Bounded by ParseManifest: fewer than 2^57 elements in all, so no sum here overflows.
  int64_t offset = 0;
  const char* prefixes[3] = {"", "exp_avg.", "exp_avg_sq."};
  offsets->assign(3, std::vector<int64_t>(info.params.size()));
  for (int k = 0; k < 3; ++k) {
    for (size_t i = 0; i < info.params.size(); ++i) {
      const int64_t bytes = info.params[i].numel * 4;
      header[absl::StrCat(prefixes[k], info.params[i].name)] = {
          {"dtype", "F32"},
          {"shape", info.params[i].shape},
          {"data_offsets", {offset, offset + bytes}}};
      (*offsets)[k][i] = offset;
      offset += bytes;
    }
  }
  // A source path that is not UTF-8 is written with U+FFFD in its place (JSON cannot hold it).
  std::string h = header.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  h.resize((h.size() + 7) / 8 * 8, ' ');  // tensors start 8-byte aligned
  std::string file(8, '\0');
  for (int b = 0; b < 8; ++b) {
    file[b] = static_cast<char>((static_cast<uint64_t>(h.size()) >> (8 * b)) & 0xff);
  }
  const int64_t data_start = static_cast<int64_t>(file.size() + h.size());
  for (auto& section : *offsets) {
    for (int64_t& o : section) o += data_start;
  }
  return file + h;
}

}  // namespace

absl::Status ConsolidateCheckpoint(const std::string& path, const std::string& out,
                                   const ConsolidateOptions& options) {
  FileSystem* fs = Fs(options.fs);
  ASSIGN_OR_RETURN(std::string dir, ResolveDir(fs, path));
  ASSIGN_OR_RETURN(Manifest man, ReadManifest(fs, dir));
  const CheckpointInfo info = InfoOf(man, dir);
  RETURN_IF_ERROR(CheckTensorNames(info));
  RETURN_IF_ERROR(CheckOutsideCheckpoint(path, dir, out));
  if (!options.overwrite && fs->Exists(out)) {
    return absl::AlreadyExistsError(
        absl::StrCat("'", out, "' exists: refusing to overwrite it (--force replaces it)"));
  }
  RETURN_IF_ERROR(CheckShardSizes(fs, dir, man));
  std::vector<std::vector<int64_t>> offsets;
  const std::string header = SafetensorsHeader(info, &offsets);
  // The tensors go straight from each shard's read buffer to their place in the output: memory
  // stays at one read buffer whatever the checkpoint's size.
  ASSIGN_OR_RETURN(std::unique_ptr<ckpt_internal::PublishedFile> file,
                   ckpt_internal::PublishedFile::Create(out, !options.named_temporary));
  RETURN_IF_ERROR(file->WriteAt(0, header));
  RETURN_IF_ERROR(StreamShards(fs, dir, man, [&](const Piece& p, int64_t skip, const char* data,
                                                 int64_t n) {
    return file->WriteAt(offsets[p.section][p.param] + p.elem * 4 + skip,
                         absl::string_view(data, static_cast<size_t>(n)));
  }));
  return file->Commit(options.overwrite);
}

}  // namespace zerort
