// LoadCheckpoint (collective: every rank reads what the new plan gives it, checks it, and only
// then restores), and ReadCheckpointInfo / ReadCheckpoint, which read a checkpoint without an
// engine.
#include "checkpoint/checkpoint.h"

#include <algorithm>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "checkpoint/internal/ckpt_common.h"
#include "checkpoint/internal/ckpt_fs.h"
#include "checkpoint/internal/ckpt_manifest.h"

namespace zerort {

using ckpt_internal::AddParamRange;
using ckpt_internal::Agree;
using ckpt_internal::CheckShardSizes;
using ckpt_internal::FileSystem;
using ckpt_internal::Fs;
using ckpt_internal::InfoOf;
using ckpt_internal::Manifest;
using ckpt_internal::Piece;
using ckpt_internal::ReadManifest;
using ckpt_internal::ReadShard;
using ckpt_internal::ResolveDir;

namespace {

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
  // The range of each unit this rank owns: its shard, or with HSDP its group's shard
  // (u.shard is then padded / G), which its replicas read too.
  const int64_t owned_shard = memory::ShardIndex(plan.options);
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
    const int64_t own0 = owned_shard * u.shard, own1 = own0 + u.shard;
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
  static_cast<ScalerState&>(*state) = man.scaler;
  state->hyperparams_set = man.hyperparams_set;
  state->hyperparams = {man.lr, man.beta1, man.beta2, man.eps, man.weight_decay};
  return absl::OkStatus();
}

}  // namespace

absl::Status LoadCheckpoint(Engine& engine, const std::string& path, const LoadOptions& options) {
  std::vector<float> master, m, v;
  EngineState state;
  const absl::Status local = ReadOwned(engine, path, options, &master, &m, &v, &state);
  // Through the engine's exchange: DirectHostExchange fails on a stream-ordered communicator.
  RETURN_IF_ERROR(Agree(*engine.NewHostExchange(), local));
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

}  // namespace zerort
