#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "checkpoint/internal/ckpt_manifest.h"

namespace zerort {
namespace ckpt_internal {
namespace {

Manifest Sample() {
  Manifest m;
  m.step = 42;
  m.checkpoint_id = 0x0123456789abcdefull;
  m.world_size = 2;
  m.stage = 3;
  m.compute_dtype = DType::kBF16;
  m.config_hash = "fnv1a64:00";
  m.scaler.loss_scale = 32768;
  m.scaler.scaler_hysteresis_left = 1;
  m.scaler.scaler_iter = 40;
  m.scaler.scaler_last_overflow = 3;
  m.has_param_section = true;
  m.units = {{"b", 256, 128, 0}, {"a", 512, 256, 128}};
  m.shard_elements = 384;
  m.params = {{"a.w", {10, 20}, 200, 1, 0}, {"a.b", {10}, 10, 1, 200}, {"b.w", {3, 3, 3}, 27, 0, 0}};
  for (int r = 0; r < 2; ++r) m.files.push_back({ShardFileName(r), r, m.ShardFileBytes(), 7u + r});
  return m;
}

TEST_CASE("Manifest: what ManifestToJson writes, ParseManifest reads back field for field",
          "[ckpt]") {
  const Manifest m = Sample();
  auto p = ParseManifest(ManifestToJson(m));
  REQUIRE(p.ok());
  REQUIRE(p->step == m.step);
  REQUIRE(p->checkpoint_id == m.checkpoint_id);
  REQUIRE(p->world_size == 2);
  REQUIRE(p->stage == 3);
  REQUIRE(p->compute_dtype == DType::kBF16);
  REQUIRE(p->scaler.loss_scale == 32768);
  REQUIRE(p->scaler.scaler_hysteresis_left == 1);
  REQUIRE(p->scaler.scaler_iter == 40);
  REQUIRE(p->scaler.scaler_last_overflow == 3);
  REQUIRE(p->has_param_section);
  REQUIRE(p->units.size() == 2);
  REQUIRE(p->units[1].shard_offset == 128);
  REQUIRE(p->params.size() == 3);
  REQUIRE(p->params[2].shape == std::vector<int64_t>{3, 3, 3});
  REQUIRE(p->params[2].numel == 27);
  REQUIRE(p->files[1].crc32c == 8u);
  // 64 header bytes + 3 fp32 sections + one bf16 section of 384 elements.
  REQUIRE(p->ShardFileBytes() == 64 + 3 * 384 * 4 + 384 * 2);
}

// Manifests that earlier saves wrote (the fuzz corpus, tests/fuzz/ckpt_manifest, kept as the
// saver wrote them): the scaler's state reads back as the file holds it, read here with a plain
// JSON parser, and writing the parsed manifest reproduces the file byte for byte.
TEST_CASE("Manifest: manifests in the existing format read, and write back byte-identical",
          "[ckpt]") {
  for (const char* name : {"w1_stage0", "w2_stage3", "w4_stage2", "w8_stage3"}) {
    INFO(name);
    std::ifstream in(absl::StrCat("tests/fuzz/ckpt_manifest/", name, ".json"), std::ios::binary);
    REQUIRE(in.good());
    std::stringstream text;
    text << in.rdbuf();
    const nlohmann::json ref = nlohmann::json::parse(text.str())["loss_scaler"];
    auto p = ParseManifest(text.str());
    REQUIRE(p.ok());
    REQUIRE(p->scaler.loss_scale == ref["scale"].get<double>());
    REQUIRE(p->scaler.scaler_hysteresis_left == ref["hysteresis_left"].get<int>());
    REQUIRE(p->scaler.scaler_iter == ref["iter"].get<int64_t>());
    REQUIRE(p->scaler.scaler_last_overflow == ref["last_overflow_iter"].get<int64_t>());
    REQUIRE(ManifestToJson(*p) == text.str());
  }
}

TEST_CASE("Manifest: inconsistent layouts are refused with the field named", "[ckpt]") {
  struct Case {
    const char* what;
    void (*edit)(Manifest*);
    const char* field;
  };
  const Case cases[] = {
      {"padded != shard x world", [](Manifest* m) { m->units[0].padded = 300; }, "units[0].padded"},
      {"a gap between units", [](Manifest* m) { m->units[1].shard_offset = 130; },
       "units[1].shard_offset"},
      {"a parameter past its unit", [](Manifest* m) { m->params[1].offset_in_unit = 510; },
       "params[1].offset_in_unit"},
      {"overlapping parameters", [](Manifest* m) { m->params[1].offset_in_unit = 150; }, "overlap"},
      {"a duplicate name", [](Manifest* m) { m->params[1].name = "a.w"; }, "'a.w' twice"},
      {"a wrong file size", [](Manifest* m) { m->files[1].bytes += 1; }, "files[1].bytes"},
      {"a path in a file name", [](Manifest* m) { m->files[0].name = "../x"; }, "files[0].name"},
      {"a unit index out of range", [](Manifest* m) { m->params[0].unit = 2; }, "params[0].unit"},
  };
  for (const Case& c : cases) {
    INFO(c.what);
    Manifest m = Sample();
    c.edit(&m);
    auto p = ParseManifest(ManifestToJson(m));
    REQUIRE(p.status().code() == absl::StatusCode::kDataLoss);
    REQUIRE(p.status().message().find(c.field) != absl::string_view::npos);
  }
}

TEST_CASE("Manifest: base/json's strictness applies, reported as DataLoss", "[ckpt]") {
  const std::string good = ManifestToJson(Sample());
  REQUIRE(ParseManifest(good).ok());
  struct Case {
    const char* what;
    std::string text;
    const char* expect;
  };
  std::string duplicate = good;
  duplicate.insert(duplicate.find("\"step\""), "\"step\": 1, ");
  const Case cases[] = {
      {"a duplicate key", duplicate, "manifest: json: step: duplicate key"},
      {"trailing bytes", good + "{}", "manifest: json:"},
      {"a NUL byte", good + std::string(1, '\0'), "NUL byte"},
      {"deep nesting", "{\"a\": " + std::string(40, '[') + std::string(40, ']') + "}",
       "nested deeper than 16 levels"},
  };
  for (const Case& c : cases) {
    INFO(c.what);
    absl::Status s = ParseManifest(c.text).status();
    INFO(s.ToString());
    CHECK(s.code() == absl::StatusCode::kDataLoss);
    CHECK(std::string(s.message()).find(c.expect) != std::string::npos);
  }
}

TEST_CASE("Manifest: a shape whose element count overflows int64 is refused, not wrapped",
          "[ckpt]") {
  // 74696998 x 987817158259 wraps int64 to a small positive count: it once passed the check.
  const std::vector<int64_t> wraps = {74696998, 987817158259};
  REQUIRE(ShapeElements(wraps).status().code() == absl::StatusCode::kInvalidArgument);
  // The boundaries: exactly kMaxElements is accepted, one more element or a product past
  // 2^63 is refused.
  REQUIRE(ShapeElements({kMaxElements}).value() == kMaxElements);
  REQUIRE(ShapeElements({int64_t{1} << 20, int64_t{1} << 20}).value() == kMaxElements);
  REQUIRE(!ShapeElements({kMaxElements + 1}).ok());
  REQUIRE(!ShapeElements({(int64_t{1} << 20) + 1, int64_t{1} << 20}).ok());
  REQUIRE(!ShapeElements({int64_t{1} << 32, int64_t{1} << 32}).ok());
  REQUIRE(!ShapeElements({3037000500, 3037000500}).ok());  // just past sqrt(2^63)
  REQUIRE(!ShapeElements({0}).ok());
  // Through the parser: the manifest names the field.
  Manifest m = Sample();
  m.params[2].shape = wraps;
  auto p = ParseManifest(ManifestToJson(m));
  REQUIRE(p.status().code() == absl::StatusCode::kDataLoss);
  REQUIRE(p.status().message().find("params[2].shape: too many elements") !=
          absl::string_view::npos);
}

TEST_CASE("Manifest: names must be UTF-8 without control characters, at save and at load",
          "[ckpt]") {
  REQUIRE(CheckName("n", "layer.0.w").ok());
  REQUIRE(CheckName("n", "\xc3\xa9t\xc3\xa9").ok());         // "ete" with accents
  REQUIRE(CheckName("n", "\xf0\x9f\x98\x80").ok());          // U+1F600
  for (const char* bad : {"dir\xff", "\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80", "\xe2\x82",
                          "a\x1b[2Jb", "tab\there", "del\x7f"}) {
    INFO(bad);
    const absl::Status s = CheckName("params[0].name", bad);
    REQUIRE(s.code() == absl::StatusCode::kInvalidArgument);
    REQUIRE(s.message().find("params[0].name") != absl::string_view::npos);
    // The message never carries the raw bytes.
    REQUIRE(s.message().find('\x1b') == absl::string_view::npos);
    REQUIRE(s.message().find('\xff') == absl::string_view::npos);
  }
  REQUIRE(!CheckName("n", "").ok());
  REQUIRE(!CheckName("n", std::string(kMaxNameBytes + 1, 'a')).ok());
  REQUIRE(CheckName("n", std::string(kMaxNameBytes, 'a')).ok());
  Manifest m = Sample();
  REQUIRE(CheckManifestStrings(m).ok());
  m.params[1].name = "w\xff";
  REQUIRE(CheckManifestStrings(m).message().find("parameter 1 name") != absl::string_view::npos);
  // An escape sequence is valid JSON (\u001b): the parser refuses it as a name.
  m.params[1].name = "a\x1b[31mred";
  auto p = ParseManifest(ManifestToJson(m));
  REQUIRE(p.status().code() == absl::StatusCode::kDataLoss);
  REQUIRE(p.status().message().find("params[1].name: control character") !=
          absl::string_view::npos);
}

TEST_CASE("ShardHeader: accepted for its own rank and checkpoint only", "[ckpt]") {
  const Manifest m = Sample();
  const std::string h = EncodeShardHeader(m, 1);
  REQUIRE(h.size() == kHeaderBytes);
  REQUIRE(CheckShardHeader(h, m, 1, "f").ok());
  REQUIRE(CheckShardHeader(h, m, 0, "f").message().find("holds rank 1's shard") !=
          absl::string_view::npos);
  Manifest other = m;
  other.checkpoint_id ^= 1;
  REQUIRE(CheckShardHeader(h, other, 1, "f").message().find("another checkpoint") !=
          absl::string_view::npos);
  REQUIRE(CheckShardHeader(h.substr(0, 10), m, 1, "f").code() == absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace ckpt_internal
}  // namespace zerort
