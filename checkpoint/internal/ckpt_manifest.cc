#include "checkpoint/internal/ckpt_manifest.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status.h"
#include "nlohmann/json.hpp"
#include "base/crc32c.h"

namespace zerort {
namespace ckpt_internal {
namespace {

using Json = nlohmann::ordered_json;

constexpr char kMagic[8] = {'Z', 'R', 'T', 'S', 'H', 'A', 'R', 'D'};
constexpr char kFormatName[] = "zerort-checkpoint";

absl::Status Bad(absl::string_view field, absl::string_view why) {
  return absl::DataLossError(absl::StrCat("manifest: ", field, ": ", why));
}

// Typed field readers: every access checks presence, type and range, so that no input can make
// nlohmann throw or a later computation overflow.
class Reader {
 public:
  Reader(const Json& obj, std::string path) : obj_(obj), path_(std::move(path)) {}

  absl::StatusOr<const Json*> Field(absl::string_view key) const {
    if (!obj_.is_object()) return Bad(path_, "not an object");
    auto it = obj_.find(std::string(key));
    if (it == obj_.end()) return Bad(Name(key), "missing");
    return &*it;
  }
  absl::StatusOr<int64_t> Int(absl::string_view key, int64_t lo, int64_t hi) const {
    ASSIGN_OR_RETURN(const Json* j, Field(key));
    if (!j->is_number_integer()) return Bad(Name(key), "not an integer");
    int64_t v;
    if (j->is_number_unsigned()) {
      const uint64_t u = j->get<uint64_t>();
      if (u > static_cast<uint64_t>(hi)) return Bad(Name(key), absl::StrCat(u, " above ", hi));
      v = static_cast<int64_t>(u);
    } else {
      v = j->get<int64_t>();
    }
    if (v < lo || v > hi) return Bad(Name(key), absl::StrCat(v, " outside ", lo, "..", hi));
    return v;
  }
  absl::StatusOr<double> Double(absl::string_view key) const {
    ASSIGN_OR_RETURN(const Json* j, Field(key));
    if (!j->is_number()) return Bad(Name(key), "not a number");
    return j->get<double>();
  }
  absl::StatusOr<std::string> String(absl::string_view key, size_t max_len = 4096) const {
    ASSIGN_OR_RETURN(const Json* j, Field(key));
    if (!j->is_string()) return Bad(Name(key), "not a string");
    const std::string& s = j->get_ref<const std::string&>();
    if (s.size() > max_len) return Bad(Name(key), "too long");
    return s;
  }
  absl::StatusOr<bool> Bool(absl::string_view key) const {
    ASSIGN_OR_RETURN(const Json* j, Field(key));
    if (!j->is_boolean()) return Bad(Name(key), "not a boolean");
    return j->get<bool>();
  }
  absl::StatusOr<const Json*> Array(absl::string_view key, size_t max_size) const {
    ASSIGN_OR_RETURN(const Json* j, Field(key));
    if (!j->is_array()) return Bad(Name(key), "not an array");
    if (j->size() > max_size) return Bad(Name(key), absl::StrCat("more than ", max_size, " entries"));
    return j;
  }
  std::string Name(absl::string_view key) const {
    return path_.empty() ? std::string(key) : absl::StrCat(path_, ".", key);
  }

 private:
  const Json& obj_;
  const std::string path_;
};

void PutU32(char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
void PutU64(char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
uint32_t GetU32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}
uint64_t GetU64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}

Json Body(const Manifest& m) {
  Json j;
  j["format"] = kFormatName;
  j["format_version"] = m.format_version;
  j["step"] = m.step;
  j["checkpoint_id"] = absl::StrFormat("%016x", m.checkpoint_id);
  j["world_size"] = m.world_size;
  j["stage"] = m.stage;
  j["compute_dtype"] = std::string(DTypeName(m.compute_dtype));
  j["config_hash"] = m.config_hash;
  j["loss_scaler"] = {{"scale", m.loss_scale},
                      {"hysteresis_left", m.scaler_hysteresis_left},
                      {"iter", m.scaler_iter},
                      {"last_overflow_iter", m.scaler_last_overflow}};
  j["shard_elements"] = m.shard_elements;
  Json sections = Json::array({"master:fp32", "exp_avg:fp32", "exp_avg_sq:fp32"});
  if (m.has_param_section) sections.push_back(absl::StrCat("param:", DTypeName(m.compute_dtype)));
  j["sections"] = sections;
  Json units = Json::array();
  for (const ManifestUnit& u : m.units) {
    units.push_back({{"name", u.name},
                     {"padded", u.padded},
                     {"shard", u.shard},
                     {"shard_offset", u.shard_offset}});
  }
  j["units"] = std::move(units);
  Json params = Json::array();
  for (const ManifestParam& p : m.params) {
    params.push_back({{"name", p.name},
                      {"shape", p.shape},
                      {"unit", p.unit},
                      {"offset_in_unit", p.offset_in_unit}});
  }
  j["params"] = std::move(params);
  Json files = Json::array();
  for (const ManifestFile& f : m.files) {
    files.push_back(
        {{"name", f.name}, {"rank", f.rank}, {"bytes", f.bytes}, {"crc32c", f.crc32c}});
  }
  j["files"] = std::move(files);
  return j;
}

absl::StatusOr<Manifest> ParseChecked(const Json& j) {
  Reader r(j, "");
  Manifest m;
  ASSIGN_OR_RETURN(std::string format, r.String("format"));
  if (format != kFormatName) {
    return Bad("format", absl::StrCat("'", format, "' is not '", kFormatName, "'"));
  }
  ASSIGN_OR_RETURN(int64_t version, r.Int("format_version", 1, 1 << 30));
  if (version > kFormatVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "manifest: format_version ", version, " is newer than this build reads (",
        kFormatVersion, "): load it with a newer zerort"));
  }
  m.format_version = static_cast<int>(version);
  {
    auto it = j.find("manifest_crc32c");
    if (it == j.end() || !it->is_number_unsigned() || it->get<uint64_t>() > 0xffffffffu) {
      return Bad("manifest_crc32c", "missing or not a 32-bit unsigned integer");
    }
    const uint32_t want = static_cast<uint32_t>(it->get<uint64_t>());
    Json body = j;
    body.erase("manifest_crc32c");
    const std::string text = body.dump();
    const uint32_t got = Crc32c(0, text.data(), text.size());
    if (got != want) {
      return Bad("manifest_crc32c", absl::StrFormat("checksum mismatch (stored %08x, content "
                                                    "%08x): the manifest is corrupted", want, got));
    }
  }
  ASSIGN_OR_RETURN(m.step, r.Int("step", 0, kMaxElements));
  ASSIGN_OR_RETURN(std::string id, r.String("checkpoint_id", 16));
  if (id.size() != 16 || !absl::SimpleHexAtoi(id, &m.checkpoint_id)) {
    return Bad("checkpoint_id", "not 16 hex digits");
  }
  ASSIGN_OR_RETURN(int64_t world, r.Int("world_size", 1, kMaxWorld));
  m.world_size = static_cast<int>(world);
  ASSIGN_OR_RETURN(int64_t stage, r.Int("stage", 0, 3));
  m.stage = static_cast<int>(stage);
  ASSIGN_OR_RETURN(std::string dtype, r.String("compute_dtype"));
  if (dtype == "fp32") {
    m.compute_dtype = DType::kF32;
  } else if (dtype == "bf16") {
    m.compute_dtype = DType::kBF16;
  } else if (dtype == "fp16") {
    m.compute_dtype = DType::kF16;
  } else {
    return Bad("compute_dtype", absl::StrCat("'", dtype, "' is not fp32, bf16 or fp16"));
  }
  ASSIGN_OR_RETURN(m.config_hash, r.String("config_hash", 256));
  {
    ASSIGN_OR_RETURN(const Json* ls, r.Field("loss_scaler"));
    Reader s(*ls, "loss_scaler");
    ASSIGN_OR_RETURN(m.loss_scale, s.Double("scale"));
    if (!(m.loss_scale > 0) || m.loss_scale > 1e300) {
      return Bad("loss_scaler.scale", "not a positive finite number");
    }
    ASSIGN_OR_RETURN(int64_t h, s.Int("hysteresis_left", 0, 1 << 30));
    m.scaler_hysteresis_left = static_cast<int>(h);
    ASSIGN_OR_RETURN(m.scaler_iter, s.Int("iter", 0, kMaxElements));
    ASSIGN_OR_RETURN(m.scaler_last_overflow, s.Int("last_overflow_iter", -1, kMaxElements));
  }
  ASSIGN_OR_RETURN(m.shard_elements, r.Int("shard_elements", 0, kMaxElements));
  {
    ASSIGN_OR_RETURN(const Json* sections, r.Array("sections", 4));
    const std::string param_section = absl::StrCat("param:", DTypeName(m.compute_dtype));
    const std::vector<std::string> want3 = {"master:fp32", "exp_avg:fp32", "exp_avg_sq:fp32"};
    std::vector<std::string> got;
    for (const Json& s : *sections) {
      if (!s.is_string()) return Bad("sections", "not a list of strings");
      got.push_back(s.get<std::string>());
    }
    std::vector<std::string> want4 = want3;
    want4.push_back(param_section);
    if (got == want3) {
      m.has_param_section = false;
    } else if (got == want4) {
      m.has_param_section = true;
    } else {
      return Bad("sections", "expected master, exp_avg, exp_avg_sq (and param in stage 3)");
    }
  }
  {
    ASSIGN_OR_RETURN(const Json* units, r.Array("units", 1 << 24));
    int64_t offset = 0;
    for (size_t i = 0; i < units->size(); ++i) {
      Reader u((*units)[i], absl::StrCat("units[", i, "]"));
      ManifestUnit unit;
      ASSIGN_OR_RETURN(unit.name, u.String("name"));
      ASSIGN_OR_RETURN(unit.shard, u.Int("shard", 0, kMaxElements));
      ASSIGN_OR_RETURN(unit.padded, u.Int("padded", 0, kMaxElements));
      ASSIGN_OR_RETURN(unit.shard_offset, u.Int("shard_offset", 0, kMaxElements));
      if (unit.padded != unit.shard * m.world_size) {
        return Bad(u.Name("padded"), absl::StrCat(unit.padded, " is not shard ", unit.shard,
                                                  " x world_size ", m.world_size));
      }
      if (unit.shard_offset != offset) {
        return Bad(u.Name("shard_offset"),
                   absl::StrCat(unit.shard_offset, " but the earlier units end at ", offset));
      }
      offset += unit.shard;
      if (offset > kMaxElements) return Bad(u.Name("shard"), "units too large");
      m.units.push_back(std::move(unit));
    }
    if (offset != m.shard_elements) {
      return Bad("shard_elements", absl::StrCat(m.shard_elements, " but the units' shards sum to ",
                                                offset));
    }
  }
  {
    ASSIGN_OR_RETURN(const Json* params, r.Array("params", 1 << 24));
    for (size_t i = 0; i < params->size(); ++i) {
      Reader p((*params)[i], absl::StrCat("params[", i, "]"));
      ManifestParam param;
      ASSIGN_OR_RETURN(param.name, p.String("name"));
      if (param.name.empty()) return Bad(p.Name("name"), "empty");
      ASSIGN_OR_RETURN(const Json* shape, p.Array("shape", 64));
      param.numel = 1;
      for (const Json& d : *shape) {
        if (!d.is_number_integer()) return Bad(p.Name("shape"), "not a list of integers");
        const int64_t dim = d.is_number_unsigned() && d.get<uint64_t>() > uint64_t{1} << 62
                                ? -1
                                : d.get<int64_t>();
        if (dim < 1 || dim > kMaxElements) return Bad(p.Name("shape"), "a dimension below 1 or too large");
        param.numel *= dim;
        if (param.numel > kMaxElements) return Bad(p.Name("shape"), "too many elements");
        param.shape.push_back(dim);
      }
      if (param.shape.empty()) return Bad(p.Name("shape"), "empty (a scalar is [1])");
      ASSIGN_OR_RETURN(int64_t unit, p.Int("unit", 0, static_cast<int64_t>(m.units.size()) - 1));
      param.unit = static_cast<int>(unit);
      ASSIGN_OR_RETURN(param.offset_in_unit, p.Int("offset_in_unit", 0, kMaxElements));
      if (param.offset_in_unit + param.numel > m.units[param.unit].padded) {
        return Bad(p.Name("offset_in_unit"),
                   absl::StrCat("elements ", param.offset_in_unit, "..",
                                param.offset_in_unit + param.numel, " overrun unit ", param.unit,
                                " of ", m.units[param.unit].padded));
      }
      m.params.push_back(std::move(param));
    }
    // No two parameters may share an element (or a name).
    std::vector<int> order(m.params.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
    std::sort(order.begin(), order.end(), [&](int a, int b) {
      const ManifestParam& x = m.params[a];
      const ManifestParam& y = m.params[b];
      return x.unit != y.unit ? x.unit < y.unit : x.offset_in_unit < y.offset_in_unit;
    });
    for (size_t k = 1; k < order.size(); ++k) {
      const ManifestParam& a = m.params[order[k - 1]];
      const ManifestParam& b = m.params[order[k]];
      if (a.unit == b.unit && a.offset_in_unit + a.numel > b.offset_in_unit) {
        return Bad("params", absl::StrCat("'", a.name, "' and '", b.name, "' overlap"));
      }
    }
    std::vector<absl::string_view> names;
    for (const ManifestParam& p : m.params) names.push_back(p.name);
    std::sort(names.begin(), names.end());
    for (size_t k = 1; k < names.size(); ++k) {
      if (names[k] == names[k - 1]) return Bad("params", absl::StrCat("'", names[k], "' twice"));
    }
  }
  {
    ASSIGN_OR_RETURN(const Json* files, r.Array("files", kMaxWorld));
    if (static_cast<int64_t>(files->size()) != m.world_size) {
      return Bad("files", absl::StrCat(files->size(), " entries for world_size ", m.world_size));
    }
    const int64_t bytes = m.ShardFileBytes();
    for (size_t i = 0; i < files->size(); ++i) {
      Reader f((*files)[i], absl::StrCat("files[", i, "]"));
      ManifestFile file;
      ASSIGN_OR_RETURN(int64_t rank, f.Int("rank", 0, m.world_size - 1));
      file.rank = static_cast<int>(rank);
      if (file.rank != static_cast<int>(i)) {
        return Bad(f.Name("rank"), absl::StrCat(rank, " at position ", i));
      }
      ASSIGN_OR_RETURN(file.name, f.String("name"));
      if (file.name != ShardFileName(file.rank)) {
        return Bad(f.Name("name"), absl::StrCat("'", file.name, "' is not '",
                                                ShardFileName(file.rank), "'"));
      }
      ASSIGN_OR_RETURN(file.bytes, f.Int("bytes", 0, int64_t{1} << 62));
      if (file.bytes != bytes) {
        return Bad(f.Name("bytes"), absl::StrCat(file.bytes, " but the layout needs ", bytes));
      }
      ASSIGN_OR_RETURN(int64_t crc, f.Int("crc32c", 0, 0xffffffffll));
      file.crc32c = static_cast<uint32_t>(crc);
      m.files.push_back(std::move(file));
    }
  }
  return m;
}

}  // namespace

int64_t Manifest::ShardFileBytes() const {
  int64_t bytes = kHeaderBytes + 3 * shard_elements * 4;
  if (has_param_section) bytes += shard_elements * static_cast<int64_t>(DTypeSize(compute_dtype));
  return bytes;
}

std::string ShardFileName(int rank) { return absl::StrFormat("rank_%05d.bin", rank); }

std::string ManifestToJson(const Manifest& m) {
  Json j = Body(m);
  const std::string body = j.dump();
  j["manifest_crc32c"] = Crc32c(0, body.data(), body.size());
  return j.dump(1) + "\n";
}

absl::StatusOr<Manifest> ParseManifest(absl::string_view text) {
  if (static_cast<int64_t>(text.size()) > kMaxManifestBytes) {
    return Bad("size", absl::StrCat(text.size(), " bytes is more than a manifest can be"));
  }
  // Deep nesting would make the parser recurse without bound: no valid manifest nests beyond
  // four levels, so refuse anything deeper before parsing.
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > 16) return Bad("structure", "nested deeper than any manifest");
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  Json j;
  try {
    j = Json::parse(text.begin(), text.end());
  } catch (const std::exception& e) {
    return Bad("json", e.what());
  }
  if (!j.is_object()) return Bad("json", "the top level is not an object");
  try {
    return ParseChecked(j);
  } catch (const std::exception& e) {
    // Not expected: every access is checked first. A bug, reported instead of crashing a load.
    return absl::InternalError(absl::StrCat("manifest: ", e.what()));
  }
}

std::string EncodeShardHeader(const Manifest& m, int rank) {
  std::string h(kHeaderBytes, '\0');
  std::memcpy(&h[0], kMagic, 8);
  PutU32(&h[8], static_cast<uint32_t>(m.format_version));
  PutU32(&h[12], static_cast<uint32_t>(rank));
  PutU32(&h[16], static_cast<uint32_t>(m.world_size));
  PutU32(&h[20], static_cast<uint32_t>(m.num_sections()));
  PutU64(&h[24], static_cast<uint64_t>(m.step));
  PutU64(&h[32], m.checkpoint_id);
  PutU64(&h[40], static_cast<uint64_t>(m.ShardFileBytes() - kHeaderBytes));
  return h;
}

absl::Status CheckShardHeader(absl::string_view header, const Manifest& m, int rank,
                              const std::string& file) {
  auto bad = [&](absl::string_view why) {
    return absl::DataLossError(absl::StrCat("checkpoint shard '", file, "': ", why));
  };
  if (static_cast<int64_t>(header.size()) < kHeaderBytes) return bad("shorter than its header");
  const char* h = header.data();
  if (std::memcmp(h, kMagic, 8) != 0) return bad("not a zerort shard file (bad magic)");
  const uint64_t id = GetU64(h + 32);
  const int64_t step = static_cast<int64_t>(GetU64(h + 24));
  if (id != m.checkpoint_id) {
    return bad(absl::StrFormat(
        "belongs to another checkpoint (step %d, id %016x; the manifest is step %d, id %016x): "
        "shards from two saves are mixed",
        step, id, m.step, m.checkpoint_id));
  }
  if (GetU32(h + 12) != static_cast<uint32_t>(rank)) {
    return bad(absl::StrCat("holds rank ", GetU32(h + 12), "'s shard, expected rank ", rank));
  }
  if (GetU32(h + 8) != static_cast<uint32_t>(m.format_version) ||
      GetU32(h + 16) != static_cast<uint32_t>(m.world_size) ||
      GetU32(h + 20) != static_cast<uint32_t>(m.num_sections()) || step != m.step ||
      GetU64(h + 40) != static_cast<uint64_t>(m.ShardFileBytes() - kHeaderBytes)) {
    return bad("header disagrees with the manifest (version, world size, sections, step or size)");
  }
  return absl::OkStatus();
}

}  // namespace ckpt_internal
}  // namespace zerort
