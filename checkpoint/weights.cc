// Weights in and out as safetensors (checkpoint/weights.h): the export layout (one file, or
// shards and an index), and the import that reads each rank's owned elements only.
#include "checkpoint/weights.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/json.h"
#include "base/status.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/internal/ckpt_fs.h"
#include "checkpoint/safetensors.h"
#include "comm/agree.h"

namespace zerort {
namespace {

using ckpt_internal::JoinPath;
using safetensors::Exists;
using safetensors::FileHeader;
using safetensors::IsDir;
using safetensors::OutTensor;
using safetensors::TensorInfo;

// Tensor indices in name order, cut into shards of at most `max_bytes` of data each (0: one).
std::vector<std::vector<int>> PlanShards(const std::vector<memory::ParamLayout>& specs,
                                         int64_t elem_bytes, int64_t max_bytes) {
  std::vector<int> order(specs.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int a, int b) { return specs[a].name < specs[b].name; });
  std::vector<std::vector<int>> shards(1);
  int64_t bytes = 0;
  for (int i : order) {
    const int64_t b = specs[i].numel * elem_bytes;
    if (max_bytes > 0 && !shards.back().empty() && bytes + b > max_bytes) {
      shards.emplace_back();
      bytes = 0;
    }
    shards.back().push_back(i);
    bytes += b;
  }
  return shards;
}

std::string ShardName(size_t k, size_t n) {
  return absl::StrFormat("model-%05d-of-%05d.safetensors", k + 1, n);
}

absl::Status MakeDir(const std::string& dir) {
  if (IsDir(dir)) return absl::OkStatus();
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
    return absl::InternalError(
        absl::StrCat("cannot create directory '", dir, "': ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

std::string IndexJson(const std::vector<memory::ParamLayout>& specs,
                      const std::vector<std::vector<int>>& shards, int64_t elem_bytes) {
  int64_t total = 0;
  std::map<std::string, std::string> weight_map;  // sorted by name, as Hugging Face writes it
  for (size_t k = 0; k < shards.size(); ++k) {
    for (int i : shards[k]) {
      weight_map[specs[i].name] = ShardName(k, shards.size());
      total += specs[i].numel * elem_bytes;
    }
  }
  Json index = Json::object();
  index["metadata"] = {{"total_size", total}};
  index["weight_map"] = Json::object();
  for (const auto& [name, file] : weight_map) index["weight_map"][name] = file;
  return index.dump(2) + "\n";
}

absl::Status CheckExportOptions(const WeightsExportOptions& options) {
  if (options.dtype != DType::kF32 && options.dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weights export dtype ", DTypeName(options.dtype), ": use fp32 or bf16"));
  }
  if (options.max_shard_bytes < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weights export max_shard_bytes ", options.max_shard_bytes, ": must be >= 0"));
  }
  return absl::OkStatus();
}

// The parameters under the names they are written as (options.names): two parameters under
// one name are refused naming both and their rules.
absl::StatusOr<std::vector<memory::ParamLayout>> Renamed(
    std::vector<memory::ParamLayout> specs, const WeightsExportOptions& options) {
  const WeightsNameMap& names = options.names;
  if (!names.ignore().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weights export: the name map ignores '", names.ignore()[0],
        "': ignore patterns apply to import only (every parameter is written)"));
  }
  if (names.rules().empty()) return specs;
  std::map<std::string, std::pair<std::string, int>> by_name;  // written -> (parameter, rule)
  for (memory::ParamLayout& p : specs) {
    ASSIGN_OR_RETURN(const WeightsNameMap::Mapped m, names.Map(p.name));
    auto [it, fresh] = by_name.emplace(m.name, std::make_pair(p.name, m.rule));
    if (!fresh) {
      const auto how = [&](int rule) {
        return rule >= 0 ? absl::StrCat(" by ", names.DescribeRule(rule)) : " as it is";
      };
      return absl::InvalidArgumentError(absl::StrCat(
          "weights export: parameters '", it->second.first, "'", how(it->second.second),
          " and '", p.name, "'", how(m.rule), " would both be written as '", m.name, "'"));
    }
    p.name = m.name;
  }
  return specs;
}

// Where each shard goes: `out` itself, or files in the directory `out` (the index last).
struct OutputLayout {
  bool one_file = false;
  std::vector<std::vector<int>> shards;  // parameter indices per file, in name order
  std::vector<std::string> paths;        // per shard, then the index when sharded
};

absl::StatusOr<OutputLayout> LayoutOf(const std::vector<memory::ParamLayout>& specs,
                                      const std::string& out,
                                      const WeightsExportOptions& options) {
  OutputLayout l;
  const int64_t es = static_cast<int64_t>(DTypeSize(options.dtype));
  l.shards = PlanShards(specs, es, options.max_shard_bytes);
  l.one_file = absl::EndsWith(out, ".safetensors") && !IsDir(out);
  if (l.one_file && l.shards.size() > 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", out, "' names one file, but the weights need ", l.shards.size(),
        " shards of at most ", options.max_shard_bytes, " bytes: give a directory"));
  }
  const size_t n = l.shards.size();
  for (size_t k = 0; k < n; ++k) {
    l.paths.push_back(l.one_file ? out : JoinPath(out, n == 1 ? kWeightsFileName : ShardName(k, n)));
  }
  if (n > 1) l.paths.push_back(JoinPath(out, kWeightsIndexName));
  return l;
}

// After every tensor file: the index of a sharded set (written last, so that a set with an
// index is complete), or the removal of a stale one.
absl::Status FinishSet(const std::vector<memory::ParamLayout>& specs, const OutputLayout& layout,
                       const std::string& out, const WeightsExportOptions& options) {
  const std::string index = JoinPath(out, kWeightsIndexName);
  if (layout.shards.size() > 1) {
    const int64_t es = static_cast<int64_t>(DTypeSize(options.dtype));
    return safetensors::WriteFileAtomically(index, IndexJson(specs, layout.shards, es));
  }
  if (!layout.one_file && Exists(index)) {
    // A stale index from an earlier sharded export would be read before model.safetensors.
    if (::unlink(index.c_str()) != 0) {
      return absl::InternalError(absl::StrCat("cannot remove the stale index '", index,
                                              "': ", std::strerror(errno)));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<std::string>> WriteWeights(const std::vector<memory::ParamLayout>& given,
                                                      absl::Span<const float> values,
                                                      const std::string& out,
                                                      const WeightsExportOptions& options) {
  RETURN_IF_ERROR(CheckExportOptions(options));
  std::vector<int64_t> start(given.size() + 1, 0);  // each parameter's place in `values`
  for (size_t i = 0; i < given.size(); ++i) start[i + 1] = start[i] + given[i].numel;
  if (start.back() != static_cast<int64_t>(values.size())) {
    return absl::InvalidArgumentError(absl::StrCat("WriteWeights: ", values.size(),
                                                   " values for ", start.back(), " elements"));
  }
  ASSIGN_OR_RETURN(const std::vector<memory::ParamLayout> specs, Renamed(given, options));
  ASSIGN_OR_RETURN(const OutputLayout layout, LayoutOf(specs, out, options));
  if (!layout.one_file) RETURN_IF_ERROR(MakeDir(out));
  for (size_t k = 0; k < layout.shards.size(); ++k) {
    std::vector<OutTensor> tensors;
    for (int i : layout.shards[k]) {
      tensors.push_back({specs[i].name, specs[i].shape,
                         values.subspan(start[i], specs[i].numel)});
    }
    RETURN_IF_ERROR(
        safetensors::WriteFile(layout.paths[k], tensors, options.dtype, {{"format", "pt"}}));
  }
  RETURN_IF_ERROR(FinishSet(specs, layout, out, options));
  return layout.paths;
}

absl::StatusOr<std::vector<std::string>> ExportWeights(Engine& engine, const std::string& out,
                                                       const WeightsExportOptions& options) {
  ASSIGN_OR_RETURN(std::vector<float> masters, engine.GatherMasterWeights());
  absl::StatusOr<std::vector<std::string>> written = std::vector<std::string>();
  if (engine.plan().options.rank == 0) {
    written = WriteWeights(engine.plan().params, masters, out, options);
  }
  // Every rank returns rank 0's verdict; the file list is a pure function of the plan.
  RETURN_IF_ERROR(comm::AgreeOnStatus(*engine.NewHostExchange(), written.status()));
  if (engine.plan().options.rank == 0) return written;
  ASSIGN_OR_RETURN(const std::vector<memory::ParamLayout> specs,
                   Renamed(engine.plan().params, options));
  ASSIGN_OR_RETURN(const OutputLayout layout, LayoutOf(specs, out, options));
  return layout.paths;
}

absl::StatusOr<std::vector<std::string>> ExportCheckpointWeights(
    const std::string& checkpoint, const std::string& out, const WeightsExportOptions& options) {
  RETURN_IF_ERROR(CheckExportOptions(options));
  // Streamed: each piece of the masters goes from the checkpoint's read buffer into its place
  // in its output file, so memory stays at that buffer whatever the model's size (before, the
  // whole state was read first: 932 MB peak RSS for 64 Mi elements, cli/ckpt_export_memory_test).
  std::vector<memory::ParamLayout> specs;
  OutputLayout layout;
  std::vector<std::unique_ptr<safetensors::PieceWriter>> writers;  // one per output file
  std::vector<std::pair<int, int>> place;  // per parameter: (file, tensor in that file)
  RETURN_IF_ERROR(StreamCheckpointMasters(
      checkpoint,
      [&](const CheckpointInfo& info) -> absl::Status {
        for (const CheckpointInfo::Param& p : info.params) {
          memory::ParamLayout l;
          l.name = p.name;
          l.shape = p.shape;
          l.numel = p.numel;
          specs.push_back(std::move(l));
        }
        ASSIGN_OR_RETURN(specs, Renamed(std::move(specs), options));
        ASSIGN_OR_RETURN(layout, LayoutOf(specs, out, options));
        if (!layout.one_file) RETURN_IF_ERROR(MakeDir(out));
        place.resize(specs.size());
        for (size_t k = 0; k < layout.shards.size(); ++k) {
          std::vector<safetensors::TensorSpec> tensors;
          for (int i : layout.shards[k]) {
            place[i] = {static_cast<int>(k), static_cast<int>(tensors.size())};
            tensors.push_back({specs[i].name, specs[i].shape});
          }
          ASSIGN_OR_RETURN(std::unique_ptr<safetensors::PieceWriter> w,
                           safetensors::PieceWriter::Create(layout.paths[k], std::move(tensors),
                                                            options.dtype, {{"format", "pt"}}));
          writers.push_back(std::move(w));
        }
        return absl::OkStatus();
      },
      [&](int param, int64_t elem, absl::Span<const float> values) {
        return writers[place[param].first]->Write(place[param].second, elem, values);
      }));
  // Only now, every shard's checksum verified: publish the files, the index last.
  for (const auto& w : writers) RETURN_IF_ERROR(w->Commit());
  RETURN_IF_ERROR(FinishSet(specs, layout, out, options));
  return layout.paths;
}

}  // namespace zerort
