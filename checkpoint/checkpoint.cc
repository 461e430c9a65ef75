#include "checkpoint/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
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

// `latest`'s content, or "" when there is none.
absl::StatusOr<std::string> ReadLatest(FileSystem* fs, const std::string& root) {
  const std::string path = JoinPath(root, kLatestName);
  if (!fs->Exists(path)) return std::string();
  ASSIGN_OR_RETURN(std::string text, ckpt_internal::ReadSmallFile(fs, path, 4096));
  const std::string name(absl::StripAsciiWhitespace(text));
  int64_t step;
  if (!absl::StartsWith(name, "step_") || !absl::SimpleAtoi(name.substr(5), &step) || step < 0) {
    return absl::DataLossError(absl::StrCat("'", path, "' holds '", name,
                                            "', not the name of a checkpoint (step_<N>)"));
  }
  return name;
}

absl::StatusOr<std::string> ResolveDir(FileSystem* fs, const std::string& path) {
  if (fs->Exists(JoinPath(path, kManifestName))) return path;
  ASSIGN_OR_RETURN(std::string latest, ReadLatest(fs, path));
  if (latest.empty()) {
    return absl::NotFoundError(absl::StrCat("no checkpoint at '", path, "': neither ",
                                            kManifestName, " nor ", kLatestName, " exists"));
  }
  return JoinPath(path, latest);
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

// `bytes` bytes at `offset` of a shard file go to `dst`.
struct Piece {
  int64_t offset;
  int64_t bytes;
  char* dst;
};

// Adds the pieces that carry elements [e0, e0 + count) of manifest parameter `i` into the three
// fp32 destinations (master, m, v), split where the parameter crosses a saving rank's shard.
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
      (*per_file)[q].push_back({m.SectionOffset(k) + (u.shard_offset + within) * 4, take * 4,
                                reinterpret_cast<char*>(dst[k] + done)});
    }
    done += take;
    pos += take;
  }
}

// Streams one shard file once: checks its header, size and CRC32C, and copies the pieces.
absl::Status ReadShard(FileSystem* fs, const std::string& dir, const Manifest& m, int q,
                       std::vector<Piece> pieces) {
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
      if (a < b) std::memcpy(p.dst + (a - p.offset), buf.data() + (a - pos), b - a);
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
  Engine* engine = nullptr;  // the writer waits for its snapshot copies
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

// Rank 0: makes `root`/step_<N>.tmp/ fresh. AlreadyExists when `latest` names step_<N>.
absl::Status PrepareDirs(FileSystem* fs, const std::string& root, int64_t step) {
  RETURN_IF_ERROR(MakeDirs(fs, root));
  ASSIGN_OR_RETURN(std::string latest, ReadLatest(fs, root));
  const std::string name = StepDirName(step);
  if (latest == name) {
    return absl::AlreadyExistsError(absl::StrCat(
        "checkpoint '", JoinPath(root, name), "' already exists and is the latest: save another "
        "step, or into another directory"));
  }
  // A step_<N> that `latest` does not name is left over from an interrupted save or an earlier
  // run: it is replaced. A step_<N>.tmp is always the debris of an interrupted save.
  RETURN_IF_ERROR(fs->RemoveAll(JoinPath(root, name)));
  RETURN_IF_ERROR(fs->RemoveAll(JoinPath(root, name + ".tmp")));
  RETURN_IF_ERROR(fs->MakeDir(JoinPath(root, name + ".tmp")));
  return fs->SyncDir(root);
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
  absl::Status s;
  uint64_t id = 0;
  if (comm->rank() == 0) {
    s = PrepareDirs(fs, root, step);
    id = NewCheckpointId();
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
  p->root = root;
  p->tmp_dir = JoinPath(root, StepDirName(step) + ".tmp");
  p->final_dir = JoinPath(root, StepDirName(step));
  p->manifest = ManifestOf(engine, id);
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
  const absl::Status copied = p->engine->WaitSnapshot();
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
  CheckpointState out;
  out.info = InfoOf(man, dir);
  const size_t np = man.params.size();
  out.master.resize(np);
  out.exp_avg.resize(np);
  out.exp_avg_sq.resize(np);
  std::vector<std::vector<Piece>> per_file(man.world_size);
  for (size_t i = 0; i < np; ++i) {
    const int64_t n = man.params[i].numel;
    out.master[i].resize(n);
    out.exp_avg[i].resize(n);
    out.exp_avg_sq[i].resize(n);
    float* const dst[3] = {out.master[i].data(), out.exp_avg[i].data(), out.exp_avg_sq[i].data()};
    AddParamRange(man, static_cast<int>(i), 0, n, dst, &per_file);
  }
  for (int q = 0; q < man.world_size; ++q) {
    RETURN_IF_ERROR(ReadShard(fs, dir, man, q, std::move(per_file[q])));
  }
  return out;
}

absl::Status ConsolidateCheckpoint(const std::string& path, const std::string& out,
                                   FileSystem* fs) {
  fs = Fs(fs);
  ASSIGN_OR_RETURN(CheckpointState st, ReadCheckpoint(path, fs));
  const CheckpointInfo& info = st.info;
  std::vector<std::string> names;
  for (const auto& p : info.params) names.push_back(p.name);
  std::vector<std::string> all = names;
  for (const auto& n : names) {
    all.push_back("exp_avg." + n);
    all.push_back("exp_avg_sq." + n);
  }
  std::vector<std::string> sorted = all;
  std::sort(sorted.begin(), sorted.end());
  for (size_t k = 1; k < sorted.size(); ++k) {
    if (sorted[k] == sorted[k - 1]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cannot consolidate: tensor name '", sorted[k], "' would appear twice (a parameter "
          "is named like another's Adam moment)"));
    }
  }
  // safetensors: u64 little-endian header length, JSON header, then the tensors back to back.
  nlohmann::ordered_json header;
  header["__metadata__"] = {{"format", "pt"},
                            {"producer", "zerort ckpt consolidate"},
                            {"source", info.dir},
                            {"step", absl::StrCat(info.step)},
                            {"loss_scale", absl::StrCat(info.loss_scale)},
                            {"config_hash", info.config_hash}};
  int64_t offset = 0;
  const std::vector<std::vector<float>>* arrays[3] = {&st.master, &st.exp_avg, &st.exp_avg_sq};
  const char* prefixes[3] = {"", "exp_avg.", "exp_avg_sq."};
  for (int k = 0; k < 3; ++k) {
    for (size_t i = 0; i < names.size(); ++i) {
      const int64_t bytes = static_cast<int64_t>((*arrays[k])[i].size()) * 4;
      header[absl::StrCat(prefixes[k], names[i])] = {
          {"dtype", "F32"}, {"shape", info.params[i].shape}, {"data_offsets", {offset, offset + bytes}}};
      offset += bytes;
    }
  }
  std::string h = header.dump();
  h.resize((h.size() + 7) / 8 * 8, ' ');  // tensors start 8-byte aligned
  std::string file(8, '\0');
  for (int b = 0; b < 8; ++b) file[b] = static_cast<char>((static_cast<uint64_t>(h.size()) >> (8 * b)) & 0xff);
  file += h;
  file.reserve(file.size() + offset);
  for (int k = 0; k < 3; ++k) {
    for (const std::vector<float>& a : *arrays[k]) {
      file.append(reinterpret_cast<const char*>(a.data()), a.size() * 4);
    }
  }
  return ckpt_internal::WriteFileAtomically(fs, out, file);
}

}  // namespace zerort
