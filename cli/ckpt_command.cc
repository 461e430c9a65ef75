#include "cli/ckpt_command.h"

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "nlohmann/json.hpp"
#include "base/bytes.h"
#include "base/dtype.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/weights.h"

namespace zerort {
namespace {

constexpr char kUsage[] =
    "usage: zerort ckpt inspect DIR [--json] | zerort ckpt consolidate DIR OUT [--force] | "
    "zerort ckpt export DIR --format safetensors [--dtype bf16|fp32] [--max-shard-size SIZE] "
    "[--name-map FILE] OUT";

// Names, paths and file contents come from the checkpoint or the command line, not from us:
// printed with every byte outside printable ASCII escaped (an escape sequence never reaches
// the terminal) and at most kMaxPrinted bytes of each.
constexpr size_t kMaxPrinted = 256;

std::string Printable(absl::string_view s) {
  std::string out = absl::CHexEscape(s.substr(0, kMaxPrinted));
  if (s.size() > kMaxPrinted) absl::StrAppend(&out, "...(", s.size(), " bytes)");
  return out;
}

// JSON output: strings that are not valid UTF-8 (a path is any bytes) get U+FFFD in place of
// the bad bytes instead of making the dump throw.
std::string Dump(const nlohmann::ordered_json& j) {
  return j.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

absl::Status Inspect(const std::string& dir, bool json, std::ostream& out) {
  ASSIGN_OR_RETURN(CheckpointSummary st, VerifyCheckpoint(dir));
  const CheckpointInfo& info = st.info;
  int64_t elements = 0, bytes = 0;
  for (const auto& p : info.params) elements += p.numel;
  for (const auto& f : info.files) bytes += f.bytes;
  if (json) {
    nlohmann::ordered_json j;
    j["dir"] = info.dir;
    j["format_version"] = info.format_version;
    j["step"] = info.step;
    j["world_size"] = info.world_size;
    j["stage"] = info.stage;
    j["compute_dtype"] = info.compute_dtype;
    j["loss_scale"] = info.loss_scale;
    j["config_hash"] = info.config_hash;
    j["units"] = info.num_units;
    j["parameters"] = info.params.size();
    j["elements"] = elements;
    j["bytes"] = bytes;
    j["verified"] = true;
    nlohmann::ordered_json params = nlohmann::ordered_json::array();
    for (size_t i = 0; i < info.params.size(); ++i) {
      params.push_back({{"name", info.params[i].name},
                        {"shape", info.params[i].shape},
                        {"master_norm", st.master_norm[i]}});
    }
    j["params"] = std::move(params);
    out << Dump(j) << "\n";
    return absl::OkStatus();
  }
  out << absl::StrFormat(
      "checkpoint %s\n  format version %d, step %d, saved by %d ranks at stage %d, %s compute\n"
      "  loss scale %g, config %s\n  %d parameters (%d elements) in %d units, %d files, %d bytes\n"
      "  verified: every file's size and CRC32C match the manifest\n",
      Printable(info.dir), info.format_version, info.step, info.world_size, info.stage, info.compute_dtype,
      info.loss_scale, Printable(info.config_hash), info.params.size(), elements, info.num_units,
      info.files.size(), bytes);
  for (const auto& f : info.files) {
    out << absl::StrFormat("  %s  %d bytes  crc32c %08x\n", f.name, f.bytes, f.crc32c);
  }
  for (size_t i = 0; i < info.params.size(); ++i) {
    out << absl::StrFormat("  %-32s [%s]  |master| %.6g\n", Printable(info.params[i].name),
                           absl::StrJoin(info.params[i].shape, ", "), st.master_norm[i]);
  }
  return absl::OkStatus();
}

// The value of flag args[*i] ("--flag VALUE" or "--flag=VALUE"), advancing *i past it.
absl::StatusOr<std::string> FlagValue(const std::vector<std::string>& args, size_t* i,
                                      absl::string_view flag) {
  const std::string& a = args[*i];
  if (absl::StartsWith(a, absl::StrCat(flag, "="))) return a.substr(flag.size() + 1);
  if (*i + 1 >= args.size()) {
    return absl::InvalidArgumentError(absl::StrCat("ckpt export: ", flag, " needs a value"));
  }
  return args[++*i];
}

// `zerort ckpt export DIR --format safetensors [--dtype bf16|fp32] [--max-shard-size SIZE]
// [--name-map FILE] OUT`.
absl::Status Export(const std::vector<std::string>& args, std::ostream& out) {
  WeightsExportOptions options;
  std::string format;
  std::vector<std::string> positional;
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto is = [&](absl::string_view f) { return a == f || absl::StartsWith(a, absl::StrCat(f, "=")); };
    if (is("--format")) {
      ASSIGN_OR_RETURN(format, FlagValue(args, &i, "--format"));
    } else if (is("--dtype")) {
      ASSIGN_OR_RETURN(std::string d, FlagValue(args, &i, "--dtype"));
      ASSIGN_OR_RETURN(options.dtype, ParseDType(d));
    } else if (is("--max-shard-size")) {
      ASSIGN_OR_RETURN(std::string size, FlagValue(args, &i, "--max-shard-size"));
      ASSIGN_OR_RETURN(options.max_shard_bytes, ParseBytes(size));
    } else if (is("--name-map")) {
      ASSIGN_OR_RETURN(std::string file, FlagValue(args, &i, "--name-map"));
      ASSIGN_OR_RETURN(options.names, WeightsNameMap::Load(file));
    } else if (!a.empty() && a[0] == '-') {
      return absl::InvalidArgumentError(
          absl::StrCat("ckpt export: unknown flag '", Printable(a), "'; ", kUsage));
    } else {
      positional.push_back(a);
    }
  }
  if (format != "safetensors") {
    return absl::InvalidArgumentError(absl::StrCat(
        "ckpt export: --format '", Printable(format), "': the one format is safetensors; ",
        kUsage));
  }
  if (positional.size() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("ckpt export needs DIR and OUT; ", kUsage));
  }
  ASSIGN_OR_RETURN(std::vector<std::string> files,
                   ExportCheckpointWeights(positional[0], positional[1], options));
  ASSIGN_OR_RETURN(CheckpointInfo info, ReadCheckpointInfo(positional[0]));
  out << "wrote " << files.size() << " file(s): step " << info.step << ", " << info.params.size()
      << " parameters (" << DTypeName(options.dtype) << " weights) as safetensors\n";
  for (const std::string& f : files) out << "  " << Printable(f) << "\n";
  return absl::OkStatus();
}

}  // namespace

absl::Status RunCkptCommand(const std::vector<std::string>& args, std::ostream& out) {
  if (args.empty()) return absl::InvalidArgumentError(kUsage);
  const std::string& sub = args[0];
  if (sub == "inspect") {
    bool json = false;
    std::vector<std::string> positional;
    for (size_t i = 1; i < args.size(); ++i) {
      if (args[i] == "--json") {
        json = true;
      } else if (!args[i].empty() && args[i][0] == '-') {
        return absl::InvalidArgumentError(absl::StrCat("ckpt inspect: unknown flag '", Printable(args[i]),
                                                       "'; ", kUsage));
      } else {
        positional.push_back(args[i]);
      }
    }
    if (positional.size() != 1) {
      return absl::InvalidArgumentError(absl::StrCat("ckpt inspect needs one DIR; ", kUsage));
    }
    return Inspect(positional[0], json, out);
  }
  if (sub == "consolidate") {
    ConsolidateOptions options;
    std::vector<std::string> positional;
    for (size_t i = 1; i < args.size(); ++i) {
      if (args[i] == "--force") {
        options.overwrite = true;
      } else if (!args[i].empty() && args[i][0] == '-') {
        return absl::InvalidArgumentError(absl::StrCat(
            "ckpt consolidate: unknown flag '", Printable(args[i]), "'; ", kUsage));
      } else {
        positional.push_back(args[i]);
      }
    }
    if (positional.size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat("ckpt consolidate needs DIR and OUT; ", kUsage));
    }
    RETURN_IF_ERROR(ConsolidateCheckpoint(positional[0], positional[1], options));
    ASSIGN_OR_RETURN(CheckpointInfo info, ReadCheckpointInfo(positional[0]));
    out << "wrote " << Printable(positional[1]) << ": step " << info.step << ", "
        << info.params.size() << " parameters (fp32 master, exp_avg, exp_avg_sq) as safetensors\n";
    return absl::OkStatus();
  }
  if (sub == "export") return Export(args, out);
  return absl::InvalidArgumentError(absl::StrCat("ckpt: unknown subcommand '", Printable(sub), "'; ", kUsage));
}

}  // namespace zerort
