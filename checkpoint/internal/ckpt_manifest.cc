#include "checkpoint/internal/ckpt_manifest.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/crc32c.h"
#include "base/json.h"
#include "base/status.h"

namespace zerort {
namespace ckpt_internal {
namespace {

constexpr char kMagic[8] = {'Z', 'R', 'T', 'S', 'H', 'A', 'R', 'D'};
constexpr char kFormatName[] = "zerort-checkpoint";

absl::Status Bad(absl::string_view field, absl::string_view why) {
  return absl::DataLossError(absl::StrCat("manifest: ", field, ": ", why));
}

// The length of the UTF-8 sequence starting at s[i] (1..4), or 0 when it is not one: overlong
// forms, surrogates and code points past U+10FFFF are refused, as JSON writers do.
size_t Utf8Length(absl::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  if (c < 0x80) return 1;
  size_t n;
  uint32_t cp;
  if ((c & 0xe0) == 0xc0) { n = 2; cp = c & 0x1f; }
  else if ((c & 0xf0) == 0xe0) { n = 3; cp = c & 0x0f; }
  else if ((c & 0xf8) == 0xf0) { n = 4; cp = c & 0x07; }
  else return 0;
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((b(i + k) & 0xc0) != 0x80) return 0;
    cp = cp << 6 | (b(i + k) & 0x3f);
  }
  static constexpr uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < kMin[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
  return n;
}


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
  j["loss_scaler"] = {{"scale", m.scaler.loss_scale},
                      {"hysteresis_left", m.scaler.scaler_hysteresis_left},
                      {"iter", m.scaler.scaler_iter},
                      {"last_overflow_iter", m.scaler.scaler_last_overflow}};
  if (m.hyperparams_set) {
    j["optimizer"] = {{"lr", m.lr}, {"beta1", m.beta1}, {"beta2", m.beta2}, {"eps", m.eps},
                      {"weight_decay", m.weight_decay}};
  }
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

// The checksum covers the compact dump of everything but itself, in the writer's key order.
absl::Status CheckChecksum(const Json& j) {
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
  return absl::OkStatus();
}

// format, format_version and the checksum: whether this is a manifest this build can read.
absl::Status ReadFormat(const Json& j, Manifest* m) {
  JsonFields r(j, "");
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
  m->format_version = static_cast<int>(version);
  return CheckChecksum(j);
}

// The scalars: step, id, world, stage, dtype, config hash, loss scaler.
absl::Status ReadScalars(const JsonFields& r, Manifest* m) {
  ASSIGN_OR_RETURN(m->step, r.Int("step", 0, kMaxElements));
  ASSIGN_OR_RETURN(std::string id, r.String("checkpoint_id", 16));
  if (id.size() != 16 || !absl::SimpleHexAtoi(id, &m->checkpoint_id)) {
    return Bad("checkpoint_id", "not 16 hex digits");
  }
  ASSIGN_OR_RETURN(int64_t world, r.Int("world_size", 1, kMaxWorld));
  m->world_size = static_cast<int>(world);
  ASSIGN_OR_RETURN(int64_t stage, r.Int("stage", 0, 3));
  m->stage = static_cast<int>(stage);
  ASSIGN_OR_RETURN(std::string dtype, r.String("compute_dtype"));
  absl::StatusOr<DType> parsed = ParseDType(dtype);
  if (!parsed.ok() || DTypeName(*parsed) != dtype) {
    return Bad("compute_dtype", absl::StrCat("'", dtype, "' is not fp32, bf16 or fp16"));
  }
  m->compute_dtype = *parsed;
  ASSIGN_OR_RETURN(m->config_hash, r.String("config_hash", 256));
  ASSIGN_OR_RETURN(const Json* ls, r.Object("loss_scaler"));
  JsonFields s(*ls, r.Path("loss_scaler"));
  ScalerState& scaler = m->scaler;
  ASSIGN_OR_RETURN(scaler.loss_scale, s.Number("scale"));
  if (!(scaler.loss_scale > 0) || scaler.loss_scale > 1e300) {
    return Bad("loss_scaler.scale", "not a positive finite number");
  }
  ASSIGN_OR_RETURN(int64_t h, s.Int("hysteresis_left", 0, 1 << 30));
  scaler.scaler_hysteresis_left = static_cast<int>(h);
  ASSIGN_OR_RETURN(scaler.scaler_iter, s.Int("iter", 0, kMaxElements));
  ASSIGN_OR_RETURN(scaler.scaler_last_overflow, s.Int("last_overflow_iter", -1, kMaxElements));
  if (r.Find("optimizer") == nullptr) return absl::OkStatus();  // the config's scalars
  ASSIGN_OR_RETURN(const Json* opt, r.Object("optimizer"));
  JsonFields o(*opt, r.Path("optimizer"));
  for (auto [key, dst] : {std::pair<const char*, double*>{"lr", &m->lr}, {"beta1", &m->beta1},
                          {"beta2", &m->beta2}, {"eps", &m->eps},
                          {"weight_decay", &m->weight_decay}}) {
    ASSIGN_OR_RETURN(*dst, o.Number(key));
    if (!std::isfinite(*dst)) return Bad(absl::StrCat("optimizer.", key), "not finite");
  }
  m->hyperparams_set = true;
  return absl::OkStatus();
}

absl::Status ReadSections(const JsonFields& r, Manifest* m) {
  ASSIGN_OR_RETURN(const Json* sections, r.Array("sections", 4));
  const std::vector<std::string> want3 = {"master:fp32", "exp_avg:fp32", "exp_avg_sq:fp32"};
  std::vector<std::string> got;
  for (const Json& s : *sections) {
    if (!s.is_string()) return Bad("sections", "not a list of strings");
    got.push_back(s.get<std::string>());
  }
  std::vector<std::string> want4 = want3;
  want4.push_back(absl::StrCat("param:", DTypeName(m->compute_dtype)));
  if (got == want3) {
    m->has_param_section = false;
  } else if (got == want4) {
    m->has_param_section = true;
  } else {
    return Bad("sections", "expected master, exp_avg, exp_avg_sq (and param in stage 3)");
  }
  return absl::OkStatus();
}

// Units must tile the shard buffers: contiguous, each padded = shard x world.
absl::Status ReadUnits(const JsonFields& r, Manifest* m) {
  ASSIGN_OR_RETURN(const Json* units, r.Array("units", 1 << 24));
  int64_t offset = 0;
  for (size_t i = 0; i < units->size(); ++i) {
    JsonFields u((*units)[i], JsonPath("units", i));
    ManifestUnit unit;
    ASSIGN_OR_RETURN(unit.name, u.String("name", kMaxNameBytes));
    RETURN_IF_ERROR(CheckName(u.Path("name"), unit.name));
    ASSIGN_OR_RETURN(unit.shard, u.Int("shard", 0, kMaxElements));
    ASSIGN_OR_RETURN(unit.padded, u.Int("padded", 0, kMaxElements));
    ASSIGN_OR_RETURN(unit.shard_offset, u.Int("shard_offset", 0, kMaxElements));
    if (unit.padded != unit.shard * m->world_size) {
      return Bad(u.Path("padded"), absl::StrCat(unit.padded, " is not shard ", unit.shard,
                                                " x world_size ", m->world_size));
    }
    if (unit.shard_offset != offset) {
      return Bad(u.Path("shard_offset"),
                 absl::StrCat(unit.shard_offset, " but the earlier units end at ", offset));
    }
    offset += unit.shard;
    if (offset > kMaxElements) return Bad(u.Path("shard"), "units too large");
    m->units.push_back(std::move(unit));
  }
  if (offset != m->shard_elements) {
    return Bad("shard_elements",
               absl::StrCat(m->shard_elements, " but the units' shards sum to ", offset));
  }
  return absl::OkStatus();
}

// One parameter, inside its unit. REQUIRES: m->units read.
absl::StatusOr<ManifestParam> ReadParam(const JsonFields& p, const Manifest& m) {
  ManifestParam param;
  ASSIGN_OR_RETURN(param.name, p.String("name", kMaxNameBytes));
  RETURN_IF_ERROR(CheckName(p.Path("name"), param.name));
  ASSIGN_OR_RETURN(const Json* shape, p.Array("shape", 64));
  if (shape->empty()) return Bad(p.Path("shape"), "empty (a scalar is [1])");
  param.numel = 1;
  for (size_t d = 0; d < shape->size(); ++d) {
    ASSIGN_OR_RETURN(int64_t dim, JsonToInt((*shape)[d], JsonPath(p.Path("shape"), d), 1,
                                            kMaxElements));
    param.shape.push_back(dim);
  }
  absl::StatusOr<int64_t> numel = ShapeElements(param.shape);
  if (!numel.ok()) return Bad(p.Path("shape"), numel.status().message());
  param.numel = *numel;
  ASSIGN_OR_RETURN(int64_t unit, p.Int("unit", 0, static_cast<int64_t>(m.units.size()) - 1));
  param.unit = static_cast<int>(unit);
  ASSIGN_OR_RETURN(param.offset_in_unit, p.Int("offset_in_unit", 0, kMaxElements));
  if (param.offset_in_unit + param.numel > m.units[param.unit].padded) {
    return Bad(p.Path("offset_in_unit"),
               absl::StrCat("elements ", param.offset_in_unit, "..",
                            param.offset_in_unit + param.numel, " overrun unit ", param.unit,
                            " of ", m.units[param.unit].padded));
  }
  return param;
}

// No two parameters may share an element (or a name).
absl::Status CheckParamsDisjoint(const Manifest& m) {
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
  return absl::OkStatus();
}

absl::Status ReadParams(const JsonFields& r, Manifest* m) {
  ASSIGN_OR_RETURN(const Json* params, r.Array("params", 1 << 24));
  for (size_t i = 0; i < params->size(); ++i) {
    ASSIGN_OR_RETURN(ManifestParam param,
                     ReadParam(JsonFields((*params)[i], JsonPath("params", i)), *m));
    m->params.push_back(std::move(param));
  }
  return CheckParamsDisjoint(*m);
}

// One file per rank, in rank order, of the fixed name and the size the layout implies.
absl::Status ReadFiles(const JsonFields& r, Manifest* m) {
  ASSIGN_OR_RETURN(const Json* files, r.Array("files", kMaxWorld));
  if (static_cast<int64_t>(files->size()) != m->world_size) {
    return Bad("files", absl::StrCat(files->size(), " entries for world_size ", m->world_size));
  }
  const int64_t bytes = m->ShardFileBytes();
  for (size_t i = 0; i < files->size(); ++i) {
    JsonFields f((*files)[i], JsonPath("files", i));
    ManifestFile file;
    ASSIGN_OR_RETURN(int64_t rank, f.Int("rank", 0, m->world_size - 1));
    file.rank = static_cast<int>(rank);
    if (file.rank != static_cast<int>(i)) {
      return Bad(f.Path("rank"), absl::StrCat(rank, " at position ", i));
    }
    ASSIGN_OR_RETURN(file.name, f.String("name"));
    if (file.name != ShardFileName(file.rank)) {
      return Bad(f.Path("name"),
                 absl::StrCat("'", file.name, "' is not '", ShardFileName(file.rank), "'"));
    }
    ASSIGN_OR_RETURN(file.bytes, f.Int("bytes", 0, int64_t{1} << 62));
    if (file.bytes != bytes) {
      return Bad(f.Path("bytes"), absl::StrCat(file.bytes, " but the layout needs ", bytes));
    }
    ASSIGN_OR_RETURN(int64_t crc, f.Int("crc32c", 0, 0xffffffffll));
    file.crc32c = static_cast<uint32_t>(crc);
    m->files.push_back(std::move(file));
  }
  return absl::OkStatus();
}

// Every field, in the order each check needs the ones before it.
absl::StatusOr<Manifest> ParseChecked(const Json& j) {
  Manifest m;
  RETURN_IF_ERROR(ReadFormat(j, &m));
  const JsonFields r(j, "");
  RETURN_IF_ERROR(ReadScalars(r, &m));
  ASSIGN_OR_RETURN(m.shard_elements, r.Int("shard_elements", 0, kMaxElements));
  RETURN_IF_ERROR(ReadSections(r, &m));
  RETURN_IF_ERROR(ReadUnits(r, &m));
  RETURN_IF_ERROR(ReadParams(r, &m));
  RETURN_IF_ERROR(ReadFiles(r, &m));
  return m;
}

// base/json reports a malformed document or field as InvalidArgument; in a manifest that we
// wrote ourselves, malformed means corrupted.
absl::Status AsDataLoss(const absl::Status& s) {
  if (s.code() != absl::StatusCode::kInvalidArgument) return s;
  return absl::DataLossError(absl::StrCat("manifest: ", s.message()));
}

}  // namespace

absl::Status CheckName(absl::string_view field, absl::string_view name) {
  if (name.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": empty"));
  if (name.size() > static_cast<size_t>(kMaxNameBytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", name.size(), " bytes, more than ", kMaxNameBytes));
  }
  for (size_t i = 0; i < name.size();) {
    const size_t n = Utf8Length(name, i);
    if (n == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": not valid UTF-8 at byte ", i, " of '", absl::CHexEscape(name.substr(0, 64)),
          "'"));
    }
    const unsigned char c = static_cast<unsigned char>(name[i]);
    if (n == 1 && (c < 0x20 || c == 0x7f)) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": control character at byte ", i, " of '",
          absl::CHexEscape(name.substr(0, 64)), "'"));
    }
    i += n;
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> ShapeElements(const std::vector<int64_t>& shape) {
  int64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 1) return absl::InvalidArgumentError(absl::StrCat("dimension ", d, " < 1"));
    // The product is checked at every step: [74696998, 987817158259] wraps int64 to a small
    // positive count if multiplied blindly.
    if (__builtin_mul_overflow(numel, d, &numel) || numel > kMaxElements) {
      return absl::InvalidArgumentError(
          absl::StrCat("too many elements (more than ", kMaxElements, ")"));
    }
  }
  return numel;
}

absl::Status CheckManifestStrings(const Manifest& m) {
  for (size_t u = 0; u < m.units.size(); ++u) {
    RETURN_IF_ERROR(CheckName(absl::StrCat("unit ", u, " name"), m.units[u].name));
  }
  for (size_t i = 0; i < m.params.size(); ++i) {
    RETURN_IF_ERROR(CheckName(absl::StrCat("parameter ", i, " name"), m.params[i].name));
  }
  return CheckName("config_hash", m.config_hash);
}

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
  // No valid manifest nests beyond four levels.
  JsonLimits limits;
  limits.max_depth = 16;
  // "json" names the text: errors read "manifest: json:LINE:COL: not valid JSON: ...".
  absl::StatusOr<Json> j = ParseJson(text, "json", limits);
  if (!j.ok()) return AsDataLoss(j.status());
  if (!j->is_object()) return Bad("json", "the top level is not an object");
  absl::StatusOr<Manifest> m;
  try {
    m = ParseChecked(*j);
  } catch (const std::exception& e) {
    // Not expected: every access is checked first. A bug, reported instead of crashing a load.
    return absl::InternalError(absl::StrCat("manifest: ", e.what()));
  }
  if (!m.ok()) return AsDataLoss(m.status());
  return m;
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
