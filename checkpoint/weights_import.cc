// ImportWeights (checkpoint/weights.h): resolve the files, map their tensor names
// (WeightsNameMap), check every header and every parameter against them on every rank, then
// read this rank's owned elements only and hand them to the engine's restore path.
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/json.h"
#include "base/status.h"
#include "checkpoint/internal/ckpt_fs.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/weights.h"
#include "comm/agree.h"

namespace zerort {
namespace {

using ckpt_internal::JoinPath;
using safetensors::Exists;
using safetensors::FileHeader;
using safetensors::IsDir;
using safetensors::TensorInfo;

std::string DirOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

// The files of a sharded set: the index's weight_map, each file a plain name beside the index.
absl::StatusOr<std::map<std::string, std::string>> ReadIndex(const std::string& index) {
  ASSIGN_OR_RETURN(Json doc, LoadJsonFile(index, "safetensors index"));
  if (!doc.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat("index '", index, "': not a JSON object"));
  }
  constexpr absl::string_view kKeys[] = {"metadata", "weight_map"};
  RETURN_IF_ERROR(Annotate(CheckJsonKeys(doc, "", kKeys), absl::StrCat("index '", index, "'")));
  JsonFields root(doc, "");
  absl::StatusOr<const Json*> map = root.Object("weight_map");
  if (!map.ok()) return Annotate(map.status(), absl::StrCat("index '", index, "'"));
  std::map<std::string, std::string> out;
  for (auto it = (*map)->begin(); it != (*map)->end(); ++it) {
    const Json& file = it.value();
    if (!file.is_string() || file.get<std::string>().empty() ||
        file.get<std::string>().find('/') != std::string::npos ||
        file.get<std::string>() == "." || file.get<std::string>() == "..") {
      return absl::InvalidArgumentError(absl::StrCat(
          "index '", index, "': weight_map.", it.key(), ": expected a file name beside the "
          "index, got ", DescribeJson(file)));
    }
    out[it.key()] = JoinPath(DirOf(index), file.get<std::string>());
  }
  return out;
}

// The headers of the files `path` names, and for an index, its tensor -> file map.
struct Sources {
  std::vector<FileHeader> files;
  std::map<std::string, std::string> weight_map;  // empty for a single file
};

absl::StatusOr<Sources> OpenSources(const std::string& path, safetensors::FileReader* reader) {
  std::string target = path;
  if (IsDir(path)) {
    target = JoinPath(path, kWeightsIndexName);
    if (!Exists(target)) target = JoinPath(path, kWeightsFileName);
    if (!Exists(target)) {
      return absl::NotFoundError(absl::StrCat("directory '", path, "' holds neither ",
                                              kWeightsIndexName, " nor ", kWeightsFileName));
    }
  }
  Sources s;
  std::vector<std::string> names = {target};
  if (absl::EndsWith(target, ".json")) {
    ASSIGN_OR_RETURN(s.weight_map, ReadIndex(target));
    names.clear();
    for (const auto& [tensor, file] : s.weight_map) names.push_back(file);
    std::sort(names.begin(), names.end());
    names.erase(std::unique(names.begin(), names.end()), names.end());
  }
  for (const std::string& f : names) {
    ASSIGN_OR_RETURN(FileHeader h, safetensors::ReadHeader(f, reader));
    s.files.push_back(std::move(h));
  }
  return s;
}

// Where each tensor is, checked against the index: a tensor in two files, or in a file the
// index does not send it to, is refused.
absl::StatusOr<std::map<std::string, const TensorInfo*>> TensorsOf(
    const Sources& s, std::map<std::string, const FileHeader*>* file_of) {
  std::map<std::string, const TensorInfo*> out;
  for (const FileHeader& h : s.files) {
    for (const TensorInfo& t : h.tensors) {
      if (!out.emplace(t.name, &t).second) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor '", t.name, "' appears in '", (*file_of)[t.name]->path, "' and in '",
            h.path, "'"));
      }
      (*file_of)[t.name] = &h;
      if (s.weight_map.empty()) continue;
      auto it = s.weight_map.find(t.name);
      if (it == s.weight_map.end() || it->second != h.path) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor '", t.name, "' is in '", h.path, "' but the index ",
            it == s.weight_map.end() ? "does not list it" : "places it in '" + it->second + "'"));
      }
    }
  }
  for (const auto& [name, file] : s.weight_map) {
    if (out.count(name) == 0) {
      return absl::InvalidArgumentError(absl::StrCat("the index places tensor '", name,
                                                     "' in '", file, "', whose header lacks it"));
    }
  }
  return out;
}

bool SameShape(const std::vector<int64_t>& engine, const std::vector<int64_t>& file) {
  // A scalar is [1] to the engine and [] to PyTorch.
  return engine == file || (file.empty() && engine == std::vector<int64_t>{1});
}

// A file tensor under its mapped name.
struct Source {
  const TensorInfo* t = nullptr;
  int rule = -1;  // the rule that produced the name; -1: the file's own name
};

// "tensor 'transformer.h.0.w' in 'a.safetensors' (bytes [8, 72)), renamed 'h0.w' by rule 2
// (...)": everything a message about a file tensor needs.
std::string Where(const Source& s, const std::string& target,
                  const std::map<std::string, const FileHeader*>& file_of,
                  const WeightsNameMap& names) {
  const TensorInfo& t = *s.t;
  std::string out = absl::StrCat("tensor '", t.name, "' in '", file_of.at(t.name)->path,
                                 "' (bytes [", t.begin, ", ", t.end, "))");
  if (s.rule >= 0) absl::StrAppend(&out, ", renamed '", target, "' by ", names.DescribeRule(s.rule));
  return out;
}

template <typename T>
std::string FirstFew(const std::vector<T>& v) {
  return absl::StrCat(absl::StrJoin(v.begin(), v.begin() + std::min<size_t>(v.size(), 8), "; "),
                      v.size() > 8 ? "; ..." : "");
}

// Maps every file tensor (but the ignored) to its name for the model: two tensors under one
// name are refused naming both.
absl::StatusOr<std::map<std::string, Source>> MapNames(
    const std::map<std::string, const TensorInfo*>& tensors,
    const std::map<std::string, const FileHeader*>& file_of, const WeightsNameMap& names,
    WeightsImportReport* report) {
  std::map<std::string, Source> out;
  for (const auto& [name, t] : tensors) {
    if (names.IgnoredBy(name) != nullptr) {
      report->ignored.push_back(name);
      continue;
    }
    ASSIGN_OR_RETURN(const WeightsNameMap::Mapped m, names.Map(name));
    const Source src{t, m.rule};
    auto [it, fresh] = out.emplace(m.name, src);
    if (!fresh) {
      const auto how = [&](const Source& s) {
        return s.rule >= 0 ? absl::StrCat(" by ", names.DescribeRule(s.rule)) : " as it is";
      };
      return absl::InvalidArgumentError(absl::StrCat(
          "two file tensors map to '", m.name, "': '", it->second.t->name, "' in '",
          file_of.at(it->second.t->name)->path, "'", how(it->second), ", and '", name, "' in '",
          file_of.at(name)->path, "'", how(src), "; a parameter takes one tensor"));
    }
    if (m.rule >= 0) report->renamed.emplace_back(name, m.name);
  }
  return out;
}

// Every parameter has a tensor of its shape and a loadable dtype; the others are extra.
absl::StatusOr<std::vector<const TensorInfo*>> MatchParams(
    const memory::Plan& plan, const std::map<std::string, const TensorInfo*>& tensors,
    const std::map<std::string, const FileHeader*>& file_of, const WeightsImportOptions& options,
    WeightsImportReport* report) {
  const WeightsNameMap& names = options.names;
  ASSIGN_OR_RETURN(const auto mapped, MapNames(tensors, file_of, names, report));
  std::vector<const TensorInfo*> of_param;
  std::vector<std::string> missing;
  std::map<std::string, bool> used;
  for (const memory::ParamLayout& p : plan.params) {
    auto it = mapped.find(p.name);
    if (it == mapped.end()) {
      // Say where a file tensor of that very name went, if one exists.
      std::string note;
      if (tensors.count(p.name) != 0) {
        if (const std::string* g = names.IgnoredBy(p.name)) {
          note = absl::StrCat(" (the file's tensor '", p.name, "' is ignored by '", *g, "')");
        } else if (absl::StatusOr<WeightsNameMap::Mapped> m = names.Map(p.name); m.ok()) {
          note = absl::StrCat(" (the file's tensor '", p.name, "' is renamed '", m->name,
                              "' by ", names.DescribeRule(m->rule), ")");
        }
      }
      missing.push_back(p.name + note);
      of_param.push_back(nullptr);
      continue;
    }
    const TensorInfo& t = *it->second.t;
    const std::string where = Where(it->second, p.name, file_of, names);
    if (!SameShape(p.shape, t.shape)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, " has shape [", absl::StrJoin(t.shape, ", "), "]; parameter '", p.name,
          "' has [", absl::StrJoin(p.shape, ", "), "]"));
    }
    RETURN_IF_ERROR(safetensors::CheckFloatDType(t.dtype, where));
    used[p.name] = true;
    of_param.push_back(&t);
  }
  if (!missing.empty()) {
    return absl::NotFoundError(absl::StrCat(
        missing.size(), " parameter(s) have no tensor in the files (", report->files.size(),
        " file(s) from '", report->files.empty() ? "" : report->files[0], "'",
        names.rules().empty() ? "" : absl::StrCat(", names mapped by ", names.rules().size(),
                                                  " rule(s)"),
        "): ", FirstFew(missing)));
  }
  std::vector<std::string> extra;
  for (const auto& [name, src] : mapped) {
    if (used.count(name)) continue;
    report->ignored.push_back(src.t->name);
    extra.push_back(src.rule < 0 ? name
                                 : absl::StrCat(src.t->name, " (renamed '", name, "' by ",
                                                names.DescribeRule(src.rule), ")"));
  }
  std::sort(report->ignored.begin(), report->ignored.end());
  if (!extra.empty() && !options.allow_extra) {
    return absl::InvalidArgumentError(absl::StrCat(
        extra.size(), " tensor(s) name no parameter (allow extra tensors, or ignore them by "
        "name, to load without them): ", FirstFew(extra)));
  }
  return of_param;
}

// Elements [e0, e0 + n) of tensor `t` of file `path`, as fp32, into dst: positioned reads in
// bounded chunks.
absl::Status ReadElements(safetensors::FileReader& reader, const std::string& path,
                          const TensorInfo& t, int64_t e0, int64_t n, float* dst) {
  const int64_t es = safetensors::DTypeBytes(t.dtype);
  constexpr int64_t kChunk = int64_t{1} << 20;  // elements per read
  std::vector<char> buf(static_cast<size_t>(std::min(n, kChunk) * es));
  for (int64_t done = 0; done < n;) {
    const int64_t k = std::min(kChunk, n - done);
    RETURN_IF_ERROR(Annotate(reader.ReadAt(path, t.begin + (e0 + done) * es, k * es, buf.data()),
                             absl::StrCat("reading tensor '", t.name, "'")));
    RETURN_IF_ERROR(safetensors::ToFloat(t.dtype, buf.data(), k, dst + done, t.name));
    done += k;
  }
  return absl::OkStatus();
}

// This rank's owned elements of every unit (the layout RestoreOwnedState takes), as load.cc
// reads a checkpoint: only the parameter ranges that fall in the rank's shard.
absl::Status ReadOwned(const memory::Plan& plan, const std::vector<const TensorInfo*>& of_param,
                       const std::map<std::string, const FileHeader*>& file_of,
                       safetensors::FileReader& reader, std::vector<float>* master) {
  master->assign(plan.shard_elements, 0.0f);  // padding stays zero
  for (const memory::Unit& u : plan.units) {
    // HSDP: the shard of this rank's position in its group, as its replicas read it too.
    const int64_t own0 = memory::ShardIndex(plan.options) * u.shard, own1 = own0 + u.shard;
    for (int i : u.params) {
      const memory::ParamLayout& p = plan.params[i];
      const int64_t a = std::max(own0, p.offset_in_unit);
      const int64_t b = std::min(own1, p.offset_in_unit + p.numel);
      if (a >= b) continue;
      const std::string& path = file_of.at(of_param[i]->name)->path;
      RETURN_IF_ERROR(ReadElements(reader, path, *of_param[i], a - p.offset_in_unit, b - a,
                                   master->data() + u.shard_offset + (a - own0)));
    }
  }
  return absl::OkStatus();
}

absl::Status ReadLocal(Engine& engine, const std::string& path,
                       const WeightsImportOptions& options, WeightsImportReport* report,
                       std::vector<float>* master) {
  if (!engine.at_step_boundary()) {
    return absl::FailedPreconditionError(
        "ImportWeights inside an accumulation window: load weights between optimizer steps");
  }
  std::unique_ptr<safetensors::FileReader> own;
  safetensors::FileReader* reader = options.reader;
  if (reader == nullptr) {
    own = safetensors::NewPosixFileReader();
    reader = own.get();
  }
  ASSIGN_OR_RETURN(Sources sources, OpenSources(path, reader));
  for (const FileHeader& h : sources.files) report->files.push_back(h.path);
  std::map<std::string, const FileHeader*> file_of;
  ASSIGN_OR_RETURN(auto tensors, TensorsOf(sources, &file_of));
  ASSIGN_OR_RETURN(std::vector<const TensorInfo*> of_param,
                   MatchParams(engine.plan(), tensors, file_of, options, report));
  return ReadOwned(engine.plan(), of_param, file_of, *reader, master);
}

}  // namespace

absl::StatusOr<WeightsImportReport> ImportWeights(Engine& engine, const std::string& path,
                                                  const WeightsImportOptions& options) {
  WeightsImportReport report;
  std::vector<float> master;
  const absl::Status local = ReadLocal(engine, path, options, &report, &master);
  // One rank's bad read fails every rank before any engine is touched.
  RETURN_IF_ERROR(comm::AgreeOnStatus(*engine.NewHostExchange(), local));
  // An initialisation, as InitParams: m and v at zero, the scalar state as it is.
  const std::vector<float> zeros(master.size(), 0.0f);
  RETURN_IF_ERROR(engine.RestoreOwnedState(master, zeros, zeros, engine.state()));
  return report;
}

}  // namespace zerort
