#include "checkpoint/weights.h"

#include <dirent.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/dtype.h"
#include "base/status.h"
#include "base/testing/checks.h"
#include "base/testing/temp_dir.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"
#include "comm/testing/on_ranks.h"
#include "device/testing/one_thread.h"
#include "zero/testing/synthetic_trainer.h"

namespace zerort {
namespace {

using testing::BitEqual;
using testing::RequireAllOk;
using testing::RequireError;
using testing::SmallModel;

std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

void WriteAll(const std::string& path, const std::string& data) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(data.data(), static_cast<std::streamsize>(data.size()));
}

// What an import must produce from a file of `dtype` written from `master`: the values
// rounded to the file's dtype once (the scalar conversion of base/half.h is the reference).
std::vector<float> RoundTo(DType dtype, const std::vector<float>& master) {
  std::vector<float> out(master);
  if (dtype == DType::kBF16) {
    for (float& f : out) f = Bf16ToFloat(FloatToBf16(f));
  }
  return out;
}

// Trains SmallModel for two steps on `world` ranks and exports it to `out`; returns the masters.
std::vector<float> TrainAndExport(int stage, int world, const std::string& out,
                                  const WeightsExportOptions& options) {
  auto device = testing::OneThreadCpuDevice();
  std::vector<float> master;
  RequireAllOk(comm::testing::OnRanks(world, {20000}, [&](int rank, comm::Communicator* comm) {
    const Config config = testing::TestConfig(stage, DType::kBF16, 1, 0, false);
    ASSIGN_OR_RETURN(auto engine, Engine::Create(config, SmallModel(), comm, device.get()));
    RETURN_IF_ERROR(testing::SetInitValues(*engine));
    RETURN_IF_ERROR(testing::TrainSteps(*engine, 0, 2));
    ASSIGN_OR_RETURN(std::vector<std::string> files, ExportWeights(*engine, out, options));
    if (files.empty()) return absl::InternalError("no file written");
    ASSIGN_OR_RETURN(std::vector<float> m, engine->GatherMasterWeights());
    if (rank == 0) master = m;
    return absl::OkStatus();
  }));
  return master;
}

// Imports `path` into a fresh engine (initialised to other values) on `world` ranks, then
// exports it to `out` (when not empty); returns the imported masters.
std::vector<float> ImportAndExport(int stage, int world, const std::string& path,
                                   const std::string& out, const WeightsExportOptions& options) {
  auto device = testing::OneThreadCpuDevice();
  std::vector<float> master;
  RequireAllOk(comm::testing::OnRanks(world, {20000}, [&](int rank, comm::Communicator* comm) {
    const Config config = testing::TestConfig(stage, DType::kF32, 1, 0, false);
    ASSIGN_OR_RETURN(auto engine, Engine::Create(config, SmallModel(), comm, device.get()));
    RETURN_IF_ERROR(testing::SetInitValues(*engine, 0.5f));
    ASSIGN_OR_RETURN(WeightsImportReport report, ImportWeights(*engine, path));
    if (!report.ignored.empty()) return absl::InternalError("ignored tensors");
    if (!out.empty()) RETURN_IF_ERROR(ExportWeights(*engine, out, options).status());
    ASSIGN_OR_RETURN(std::vector<float> m, engine->GatherMasterWeights());
    if (rank == 0) master = m;
    return absl::OkStatus();
  }));
  return master;
}

std::vector<std::string> Files(const std::string& dir, int shards) {
  if (shards == 1) return {dir + "/model.safetensors"};
  std::vector<std::string> out;
  for (int k = 1; k <= shards; ++k) {
    char name[64];
    std::snprintf(name, sizeof name, "/model-%05d-of-%05d.safetensors", k, shards);
    out.push_back(dir + name);
  }
  out.push_back(dir + "/model.safetensors.index.json");
  return out;
}

// REQUIREs each file of SmallModel's export to `a` (one file with `max_shard` 0, else 5 shards
// in fp32 and 3 in 16 bits) to be non-empty and the same bytes in each of `copies`.
void RequireSameExports(const std::string& a, const std::vector<std::string>& copies,
                        DType dtype, int64_t max_shard) {
  const int shards = max_shard == 0 ? 1 : (dtype == DType::kF32 ? 5 : 3);
  for (const std::string& f : Files(a, shards)) {
    INFO(f);
    const std::string there = ReadAll(f);
    REQUIRE(!there.empty());
    for (const std::string& copy : copies) REQUIRE(there == ReadAll(copy + f.substr(a.size())));
  }
}

TEST_CASE("Weights: export -> import -> export gives identical files", "[weights]") {
  const DType dtype = GENERATE(DType::kF32, DType::kBF16);
  const int stage = GENERATE(0, 1, 2, 3);
  const int world = GENERATE(1, 2);
  // 1000 bytes: SmallModel (1061 elements) becomes several shards, l1.w alone in one.
  const int64_t max_shard = GENERATE(int64_t{0}, int64_t{1000});
  INFO("dtype " << DTypeName(dtype) << " stage " << stage << " world " << world << " shard "
                << max_shard);
  WeightsExportOptions options;
  options.dtype = dtype;
  options.max_shard_bytes = max_shard;
  const std::string a = testing::TempDir("weights_a_"), b = testing::TempDir("weights_b_");
  const std::vector<float> trained = TrainAndExport(stage, world, a, options);
  // Import into the other world size too: the masters must not depend on who reads them.
  const std::vector<float> imported = ImportAndExport(stage, 3 - world, a, b, options);
  REQUIRE(BitEqual(imported, RoundTo(dtype, trained)));
  RequireSameExports(a, {b}, dtype, max_shard);
}

// The bytes of the exported file, read by hand: the layout Hugging Face's loaders expect.
TEST_CASE("Weights: an exported file has the safetensors layout", "[weights]") {
  const std::string dir = testing::TempDir("weights_layout_");
  const std::string path = dir + "/w.safetensors";
  WeightsExportOptions options;
  const std::vector<float> master = TrainAndExport(1, 2, path, options);
  const std::string bytes = ReadAll(path);
  REQUIRE(bytes.size() > 8);
  uint64_t n = 0;
  for (int k = 7; k >= 0; --k) n = (n << 8) | static_cast<unsigned char>(bytes[k]);
  REQUIRE(n % 8 == 0);
  REQUIRE(bytes.size() == 8 + n + master.size() * 4);
  const std::string header = bytes.substr(8, n);
  REQUIRE(absl::StartsWith(header, "{\"__metadata__\":{\"format\":\"pt\"},\"embed.w\":"));
  REQUIRE(header.find_last_not_of(' ') + 1 == header.rfind('}') + 1);
  // Name order: embed.w [37, 5] first, then head.w [101] at 185 * 4 bytes.
  REQUIRE(absl::StrContains(header, "\"head.w\":{\"dtype\":\"F32\",\"shape\":[101],"
                                    "\"data_offsets\":[740,1144]}"));
  const int64_t head_start = 185 + 143 + 13 + 576 + 1 + 42;  // registration order
  REQUIRE(std::memcmp(bytes.data() + 8 + n + 740, master.data() + head_start, 101 * 4) == 0);
  REQUIRE(std::memcmp(bytes.data() + 8 + n, master.data(), 185 * 4) == 0);
}

// A valid two-tensor file: "a" F32 [2] then "b" F32 [1], built by hand.
std::string FileOf(const std::string& json, int64_t data_bytes = 12) {
  std::string out(8, '\0');
  for (int k = 0; k < 8; ++k) out[k] = static_cast<char>((json.size() >> (8 * k)) & 0xff);
  return out + json + std::string(static_cast<size_t>(data_bytes), '\0');
}

TEST_CASE("Weights: every malformed header gives its named error", "[weights]") {
  const std::string good =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})";
  struct Case {
    const char* name;
    std::string bytes;
    const char* error;
  };
  std::string huge(8, '\0');
  huge[4] = 0x10;  // 2^36 bytes of header
  std::string past = FileOf(good);
  for (int k = 0; k < 8; ++k) {  // claims 64 more header bytes than exist
    past[k] = static_cast<char>(((good.size() + 12 + 64) >> (8 * k)) & 0xff);
  }
  auto edit = [&](const std::string& from, const std::string& to, int64_t data = 12) {
    std::string j = good;
    j.replace(j.find(from), from.size(), to);
    return FileOf(j, data);
  };
  const std::vector<Case> cases = {
      {"short", "abc", "too short for a header length"},
      {"huge", huge, "exceeds the limit"},
      {"past end", past, "runs past the end of the file"},
      {"not json", FileOf("{\"a\":"), "not valid JSON"},
      {"not an object", FileOf("[1,2]"), "not a JSON object"},
      {"duplicate", edit("\"b\":", "\"a\":"), "duplicate key"},
      {"unknown key", edit("\"shape\":[1]", "\"shape\":[1],\"strides\":[1]"), "unknown key"},
      {"unknown dtype", edit("\"dtype\":\"F32\",\"shape\":[1]", "\"dtype\":\"Q4\",\"shape\":[1]"),
       "tensor 'b': unknown dtype 'Q4'"},
      {"negative dim", edit("[2]", "[-2]"), "expected"},
      {"size mismatch", edit("[2]", "[3]"), "tensor 'a': data_offsets [0, 8) hold 8 bytes"},
      {"offsets arity", edit("[8,12]", "[8,12,16]"), "data_offsets must be [begin, end]"},
      {"overlap", edit("[8,12]", "[4,8]"), "overlap"},
      {"gap", edit("[8,12]", "[12,16]", 16), "gap of 4 bytes before tensor 'b'"},
      {"past data", edit("[8,12]", "[8,12]", 10), "run past the end of the data"},
      {"trailing", FileOf(good, 16), "4 bytes after the last tensor"},
      {"metadata", edit("\"pt\"", "1"), "__metadata__.format: expected a string"},
  };
  const std::string dir = testing::TempDir("weights_bad_");
  for (const Case& c : cases) {
    INFO(c.name);
    const std::string path = absl::StrCat(dir, "/", c.name, ".safetensors");
    WriteAll(path, c.bytes);
    absl::StatusOr<safetensors::FileHeader> h = safetensors::ReadHeader(path);
    REQUIRE(!h.ok());
    RequireError(h.status(), absl::StatusCode::kInvalidArgument, c.error);
    REQUIRE(absl::StrContains(h.status().message(), path));
  }
  WriteAll(dir + "/good.safetensors", FileOf(good));
  REQUIRE(safetensors::ReadHeader(dir + "/good.safetensors").ok());
}

// --- import against the engine: names, shapes, dtypes --------------------------------------

struct RawTensor {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::string data;  // little-endian bytes
};

// Hand-assembled file (the writer under test is not used): tensors in the order given.
std::string Assemble(const std::vector<RawTensor>& ts) {
  std::string json = "{";
  int64_t off = 0;
  std::string data;
  for (const RawTensor& t : ts) {
    std::string shape;
    for (size_t d = 0; d < t.shape.size(); ++d) absl::StrAppend(&shape, d ? "," : "", t.shape[d]);
    absl::StrAppend(&json, json.size() > 1 ? "," : "", "\"", t.name, "\":{\"dtype\":\"",
                    t.dtype, "\",\"shape\":[", shape, "],\"data_offsets\":[", off, ",",
                    off + static_cast<int64_t>(t.data.size()), "]}");
    off += static_cast<int64_t>(t.data.size());
    data += t.data;
  }
  json += "}";
  return FileOf(json, 0) + data;
}

template <typename T>
std::string Bytes(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

// SmallModel's tensors as F32, each element k of parameter i = i + k / 1024 (exact in fp32).
std::vector<RawTensor> SmallModelTensors() {
  std::vector<RawTensor> out;
  const auto specs = SmallModel();
  for (size_t i = 0; i < specs.size(); ++i) {
    std::vector<float> v(static_cast<size_t>(specs[i].numel()));
    for (size_t k = 0; k < v.size(); ++k) v[k] = static_cast<float>(i) + k / 1024.0f;
    out.push_back({specs[i].name, "F32", specs[i].shape, Bytes(v)});
  }
  return out;
}

absl::StatusOr<WeightsImportReport> ImportOn(int world, const std::string& path,
                                             const WeightsImportOptions& options,
                                             std::vector<float>* master = nullptr) {
  auto device = testing::OneThreadCpuDevice();
  std::vector<absl::StatusOr<WeightsImportReport>> reports(world, absl::UnknownError("unset"));
  std::vector<absl::Status> st =
      comm::testing::OnRanks(world, {20000}, [&](int rank, comm::Communicator* comm) {
        const Config config = testing::TestConfig(3, DType::kBF16, 1, 0, false);
        ASSIGN_OR_RETURN(auto engine, Engine::Create(config, SmallModel(), comm, device.get()));
        RETURN_IF_ERROR(testing::SetInitValues(*engine));
        reports[rank] = ImportWeights(*engine, path, options);
        if (reports[rank].ok() && master != nullptr) {  // collective: every rank gathers
          ASSIGN_OR_RETURN(std::vector<float> m, engine->GatherMasterWeights());
          if (rank == 0) *master = std::move(m);
        }
        return reports[rank].status();
      });
  for (int r = 1; r < world; ++r) REQUIRE(st[r].code() == st[0].code());  // one verdict
  return reports[0];
}

TEST_CASE("Weights: F64, F16 and BF16 tensors convert to fp32 masters", "[weights]") {
  std::vector<RawTensor> ts = SmallModelTensors();
  ts[4] = {"l1.b", "F16", {1}, Bytes(std::vector<uint16_t>{0x3555})};  // 0.333251953125
  ts[2].dtype = "BF16";  // l0.b [13]: 1.0, -2.0, then 0.5 (0x3f00)
  std::vector<uint16_t> bf(13, 0x3f00);
  bf[0] = 0x3f80;
  bf[1] = 0xc000;
  ts[2].data = Bytes(bf);
  std::vector<double> f64(101, 0.1);  // head.w: 0.1 rounds to 0x3dcccccd in fp32
  ts[6] = {"head.w", "F64", {101}, Bytes(f64)};
  const std::string dir = testing::TempDir("weights_dtypes_");
  WriteAll(dir + "/m.safetensors", Assemble(ts));
  const int world = GENERATE(1, 2);
  std::vector<float> master;
  REQUIRE(ImportOn(world, dir + "/m.safetensors", {}, &master).ok());
  REQUIRE(master.size() == 1061);
  REQUIRE(master[185] == 1.0f);  // l0.w [13, 11]: 1 + k / 1024
  REQUIRE(master[185 + 142] == 1.0f + 142 / 1024.0f);
  REQUIRE(master[328] == 1.0f);  // l0.b
  REQUIRE(master[329] == -2.0f);
  REQUIRE(master[340] == 0.5f);
  REQUIRE(master[341 + 576] == 0.333251953125f);  // l1.b
  uint32_t bits;
  std::memcpy(&bits, &master[1061 - 101], 4);
  REQUIRE(bits == 0x3dcccccdu);
}

TEST_CASE("Weights: missing, extra, misshapen and unloadable tensors are named", "[weights]") {
  const std::string dir = testing::TempDir("weights_names_");
  std::vector<RawTensor> ts = SmallModelTensors();
  SECTION("missing") {
    ts.erase(ts.begin() + 3);
    WriteAll(dir + "/m.safetensors", Assemble(ts));
    RequireError(ImportOn(2, dir + "/m.safetensors", {}).status(), absl::StatusCode::kNotFound,
                 "have no tensor in the files (1 file(s) from '" + dir + "/m.safetensors'): l1.w");
  }
  SECTION("extra, refused or ignored and listed") {
    ts.push_back({"attn.mask", "BOOL", {3}, std::string(3, '\1')});
    WriteAll(dir + "/m.safetensors", Assemble(ts));
    RequireError(ImportOn(2, dir + "/m.safetensors", {}).status(),
                 absl::StatusCode::kInvalidArgument, "1 tensor(s) name no parameter");
    WeightsImportOptions allow;
    allow.allow_extra = true;
    absl::StatusOr<WeightsImportReport> r = ImportOn(2, dir + "/m.safetensors", allow);
    REQUIRE(r.ok());
    REQUIRE(r->ignored == std::vector<std::string>{"attn.mask"});
  }
  SECTION("misshapen") {
    ts[1].shape = {11, 13};
    WriteAll(dir + "/m.safetensors", Assemble(ts));
    RequireError(ImportOn(2, dir + "/m.safetensors", {}).status(),
                 absl::StatusCode::kInvalidArgument,
                 "' (bytes [");
    RequireError(ImportOn(1, dir + "/m.safetensors", {}).status(),
                 absl::StatusCode::kInvalidArgument,
                 "has shape [11, 13]; parameter 'l0.w' has [13, 11]");
  }
  SECTION("a dtype that is not a float") {
    ts[4] = {"l1.b", "I32", {1}, std::string(4, '\0')};
    WriteAll(dir + "/m.safetensors", Assemble(ts));
    RequireError(ImportOn(2, dir + "/m.safetensors", {}).status(),
                 absl::StatusCode::kInvalidArgument, "tensor 'l1.b' in '");
    RequireError(ImportOn(1, dir + "/m.safetensors", {}).status(),
                 absl::StatusCode::kInvalidArgument, "has dtype I32");
  }
}

TEST_CASE("Weights: a sharded set is read through its index, which must agree", "[weights]") {
  const std::string dir = testing::TempDir("weights_index_");
  std::vector<RawTensor> ts = SmallModelTensors();
  WriteAll(dir + "/one.safetensors",
           Assemble(std::vector<RawTensor>(ts.begin(), ts.begin() + 3)));
  WriteAll(dir + "/two.safetensors", Assemble(std::vector<RawTensor>(ts.begin() + 3, ts.end())));
  std::string map;
  for (size_t i = 0; i < ts.size(); ++i) {
    absl::StrAppend(&map, i ? "," : "", "\"", ts[i].name, "\":\"", i < 3 ? "one" : "two",
                    ".safetensors\"");
  }
  const std::string index = dir + "/model.safetensors.index.json";
  SECTION("the directory, through its index") {
    WriteAll(index, "{\"metadata\":{\"total_size\":4244},\"weight_map\":{" + map + "}}");
    std::vector<float> master;
    absl::StatusOr<WeightsImportReport> r = ImportOn(2, dir, {}, &master);
    REQUIRE(r.ok());
    REQUIRE(r->files.size() == 2);
    for (size_t k = 0; k < 185; ++k) REQUIRE(master[k] == k / 1024.0f);
    REQUIRE(master[1060] == 6 + 100 / 1024.0f);
  }
  SECTION("a tensor the index places elsewhere") {
    std::string bad = map;
    bad.replace(bad.find("\"l0.b\":\"one"), 11, "\"l0.b\":\"two");
    WriteAll(index, "{\"weight_map\":{" + bad + "}}");
    RequireError(ImportOn(1, index, {}).status(), absl::StatusCode::kInvalidArgument,
                 "tensor 'l0.b' is in '" + dir + "/one.safetensors' but the index places it in '" +
                     dir + "/two.safetensors'");
  }
  SECTION("a file name outside the index's directory") {
    std::string bad = map;
    bad.replace(bad.find("\"one.safetensors"), 16, "\"../one.safetensors");
    WriteAll(index, "{\"weight_map\":{" + bad + "}}");
    RequireError(ImportOn(1, index, {}).status(), absl::StatusCode::kInvalidArgument,
                 "expected a file name beside the index");
  }
}

// Records every read a rank makes (path, [begin, end)) and forwards it to the POSIX reader.
class CountingReader : public safetensors::FileReader {
 public:
  struct Range {
    std::string path;
    int64_t begin, end;
  };
  absl::StatusOr<int64_t> Size(const std::string& path) override { return posix_->Size(path); }
  absl::Status ReadAt(const std::string& path, int64_t offset, int64_t n, char* dst) override {
    ranges.push_back({path, offset, offset + n});
    return posix_->ReadAt(path, offset, n, dst);
  }
  std::vector<Range> ranges;

 private:
  std::unique_ptr<safetensors::FileReader> posix_ = safetensors::NewPosixFileReader();
};

TEST_CASE("Weights: each rank reads only its own shards' bytes, plus the headers", "[weights]") {
  const int world = GENERATE(2, 4);
  const int stage = GENERATE(1, 3);
  const DType dtype = GENERATE(DType::kF32, DType::kBF16);
  const bool sharded = GENERATE(false, true);
  INFO("world " << world << " stage " << stage << " " << DTypeName(dtype)
                << (sharded ? " sharded set" : " one file with an extra tensor"));
  const std::string dir = testing::TempDir("weights_reads_");
  // SmallModel's values, as a sharded set (WriteWeights, 1000-byte shards) or as one file
  // holding one more tensor that names no parameter: it must never be read.
  std::vector<memory::ParamLayout> specs;
  std::vector<float> values;
  for (const memory::ParamSpec& p : SmallModel()) {
    memory::ParamLayout l;
    l.name = p.name;
    l.shape = p.shape;
    l.numel = p.numel();
    specs.push_back(l);
    for (int64_t k = 0; k < p.numel(); ++k) values.push_back(specs.size() + k / 1024.0f);
  }
  const std::vector<float> extra(300, 9.0f);
  std::string path = dir;
  if (sharded) {
    REQUIRE(WriteWeights(specs, values, dir, {dtype, 1000}).ok());
  } else {
    std::vector<safetensors::OutTensor> ts = {{"rotary.inv_freq", {300}, extra}};
    int64_t at = 0;
    for (const auto& l : specs) {
      ts.push_back({l.name, l.shape, absl::MakeConstSpan(values).subspan(at, l.numel)});
      at += l.numel;
    }
    path = dir + "/m.safetensors";
    REQUIRE(safetensors::WriteFile(path, ts, dtype, {}).ok());
  }
  std::vector<CountingReader> readers(world);
  std::vector<int64_t> owned(world, 0);  // elements of parameters in each rank's shard
  std::vector<float> master;
  auto device = testing::OneThreadCpuDevice();
  RequireAllOk(comm::testing::OnRanks(world, {20000}, [&](int rank, comm::Communicator* comm) {
    const Config config = testing::TestConfig(stage, DType::kBF16, 1, 0, false);
    ASSIGN_OR_RETURN(auto engine, Engine::Create(config, SmallModel(), comm, device.get()));
    WeightsImportOptions options;
    options.allow_extra = true;
    options.reader = &readers[rank];
    RETURN_IF_ERROR(ImportWeights(*engine, path, options).status());
    owned[rank] = engine->plan().shard_elements;
    ASSIGN_OR_RETURN(std::vector<float> m, engine->GatherMasterWeights());
    if (rank == 0) master = m;
    return absl::OkStatus();
  }));
  REQUIRE(BitEqual(master, RoundTo(dtype, values)));

  // The files' layout, read here without the reader under test.
  std::vector<safetensors::FileHeader> headers;
  if (sharded) {
    for (int k = 1; k <= (dtype == DType::kF32 ? 5 : 3); ++k) {
      char name[64];
      std::snprintf(name, sizeof name, "/model-%05d-of-%05d.safetensors", k,
                    dtype == DType::kF32 ? 5 : 3);
      headers.push_back(safetensors::ReadHeader(dir + name).value());
    }
  } else {
    headers.push_back(safetensors::ReadHeader(path).value());
  }
  const int64_t es = static_cast<int64_t>(DTypeSize(dtype));
  for (const safetensors::FileHeader& h : headers) {
    INFO(h.path);
    std::vector<std::pair<int64_t, int64_t>> data;  // every rank's reads of tensor bytes
    for (int r = 0; r < world; ++r) {
      int header_reads = 0;
      for (const CountingReader::Range& x : readers[r].ranges) {
        if (x.path != h.path) continue;
        if (x.begin < h.data_start) {  // the length, then the JSON: once each
          REQUIRE(((x.begin == 0 && x.end == 8) || (x.begin == 8 && x.end == h.data_start)));
          ++header_reads;
        } else {
          data.emplace_back(x.begin, x.end);
        }
      }
      REQUIRE(header_reads == 2);
    }
    // Disjoint across ranks, and together exactly the parameters' tensors (the extra tensor
    // never read).
    std::sort(data.begin(), data.end());
    int64_t sum = 0;
    for (size_t k = 0; k < data.size(); ++k) {
      if (k > 0) REQUIRE(data[k].first >= data[k - 1].second);
      sum += data[k].second - data[k].first;
    }
    int64_t params_bytes = 0;
    for (const safetensors::TensorInfo& t : h.tensors) {
      if (t.name == "rotary.inv_freq") {
        for (const auto& [b, e] : data) REQUIRE((e <= t.begin || b >= t.end));
      } else {
        params_bytes += t.end - t.begin;
      }
    }
    REQUIRE(sum == params_bytes);
  }
  // Each rank's tensor bytes, over every file, fit its shard; together they are the model.
  int64_t total = 0;
  for (int r = 0; r < world; ++r) {
    int64_t bytes = 0;
    for (const CountingReader::Range& x : readers[r].ranges) {
      for (const safetensors::FileHeader& h : headers) {
        if (x.path == h.path && x.begin >= h.data_start) bytes += x.end - x.begin;
      }
    }
    INFO("rank " << r << " read " << bytes << " bytes of tensors; owns " << owned[r]
                 << " elements");
    REQUIRE(bytes <= owned[r] * es);
    REQUIRE(bytes < static_cast<int64_t>(values.size()) * es);
    total += bytes;
  }
  REQUIRE(total == static_cast<int64_t>(values.size()) * es);
}

TEST_CASE("Weights: the export of a saved checkpoint equals the live engine's", "[weights]") {
  const std::string root = testing::TempDir("weights_ckpt_");
  auto device = testing::OneThreadCpuDevice();
  WeightsExportOptions options;
  options.dtype = DType::kBF16;
  RequireAllOk(comm::testing::OnRanks(2, {20000}, [&](int, comm::Communicator* comm) {
    const Config config = testing::TestConfig(2, DType::kBF16, 1, 0, false);
    ASSIGN_OR_RETURN(auto engine, Engine::Create(config, SmallModel(), comm, device.get()));
    RETURN_IF_ERROR(testing::SetInitValues(*engine));
    RETURN_IF_ERROR(testing::TrainSteps(*engine, 0, 3));
    RETURN_IF_ERROR(SaveCheckpoint(*engine, root + "/ckpt").status());
    return ExportWeights(*engine, root + "/live.safetensors", options).status();
  }));
  absl::StatusOr<std::vector<std::string>> files =
      ExportCheckpointWeights(root + "/ckpt", root + "/offline.safetensors", options);
  REQUIRE(files.ok());
  REQUIRE(*files == std::vector<std::string>{root + "/offline.safetensors"});
  REQUIRE(ReadAll(root + "/live.safetensors") == ReadAll(root + "/offline.safetensors"));
  RequireError(ExportCheckpointWeights(root + "/ckpt", root + "/x.safetensors",
                                        {DType::kF16, 0}).status(),
               absl::StatusCode::kInvalidArgument, "use fp32 or bf16");
}

}  // namespace
}  // namespace zerort

namespace zerort {
namespace {

// --- tensor-name mapping ---------------------------------------------------------------------

// SmallModel's parameters under Hugging Face-style names, and the rules both ways.
constexpr char kImportMap[] = R"(# file -> parameter
exact  model.embed_tokens.weight   embed.w
regex  model\.layers\.(\d+)\.weight   l$1.w
glob   model.layers.*.bias   l*.b
prefix model.   # strips it
ignore lm_head.weight	#tied
ignore *.inv_freq
)";
constexpr char kExportMap[] = R"(# parameter -> file
exact embed.w   model.embed_tokens.weight
regex l(\d+)\.w   model.layers.$1.weight
glob  l*.b   model.layers.*.bias
prefix head.   model.head.
)";

std::string HfName(const std::string& name) {
  if (name == "embed.w") return "model.embed_tokens.weight";
  if (name == "head.w") return "model.head.w";
  const std::string n = name.substr(1, name.find('.') - 1);
  return "model.layers." + n + (name.back() == 'w' ? ".weight" : ".bias");
}

WeightsNameMap MapOf(const char* text) {
  absl::StatusOr<WeightsNameMap> m = WeightsNameMap::Parse(text, "test.map");
  INFO(m.status().ToString());
  REQUIRE(m.ok());
  return *m;
}

TEST_CASE("WeightsNameMap: the first matching rule rewrites, others leave names alone",
          "[weights]") {
  const WeightsNameMap in = MapOf(kImportMap);
  const auto map = [&](const char* name) { return in.Map(name).value(); };
  CHECK(map("model.embed_tokens.weight").name == "embed.w");
  CHECK(map("model.embed_tokens.weight").rule == 0);
  CHECK(map("model.layers.12.weight").name == "l12.w");
  CHECK(map("model.layers.3.bias").name == "l3.b");
  CHECK(map("model.layers.3.bias").rule == 2);  // not the later prefix rule
  CHECK(map("model.norm.g").name == "norm.g");
  CHECK(map("model.norm.g").rule == 3);
  CHECK(map("other.w").name == "other.w");
  CHECK(map("other.w").rule == -1);
  CHECK(in.IgnoredBy("h.0.rotary_emb.inv_freq") != nullptr);
  CHECK(in.IgnoredBy("lm_head.weight") != nullptr);
  CHECK(in.IgnoredBy("lm_head.bias") == nullptr);
  CHECK(in.DescribeRule(1) ==
        "rule 2 (regex 'model\\.layers\\.(\\d+)\\.weight' -> 'l$1.w', line 3 of test.map)");
  // A glob whose target drops the captures, and a regex with $&.
  const WeightsNameMap m = WeightsNameMap::Create({{WeightsNameRule::Kind::kGlob, "a.*.w", "w"},
                                                    {WeightsNameRule::Kind::kRegex, "b(.)", "$&$1"}})
                               .value();
  CHECK(m.Map("a.7.w")->name == "w");
  CHECK(m.Map("bx")->name == "bxx");
  CHECK(m.DescribeRule(1) == "rule 2 (regex 'b(.)' -> '$&$1')");
}

TEST_CASE("WeightsNameMap: bad rules are refused naming the line", "[weights]") {
  struct Case {
    const char* text;
    const char* error;
  };
  const std::vector<Case> cases = {
      {"\n rename a b", "test.map line 2: unknown rule 'rename'"},
      {"exact a", "test.map line 1: expected 'exact FROM TO'"},
      {"glob a.* b c d", "expected 'glob FROM TO'"},
      {"ignore", "expected 'ignore PATTERN'"},
      {"glob a.*.*.w x*", "rule 1 (glob 'a.*.*.w' -> 'x*', line 1 of test.map): the target has 1"},
      {"regex a(b x", "rule 1 (regex 'a(b' -> 'x', line 1 of test.map): not a valid regular"},
      {"# c\nregex a(b) x$2", "line 2 of test.map): the target refers to $2 but the expression has 1"},
  };
  for (const Case& c : cases) {
    INFO(c.text);
    RequireError(WeightsNameMap::Parse(c.text, "test.map").status(),
                 absl::StatusCode::kInvalidArgument, c.error);
  }
  RequireError(WeightsNameMap::Create({{WeightsNameRule::Kind::kExact, "a", ""}}).status(),
               absl::StatusCode::kInvalidArgument, "maps to an empty name");
  const WeightsNameMap strip = MapOf("prefix model.");
  RequireError(strip.Map("model.").status(), absl::StatusCode::kInvalidArgument,
               "rule 1 (prefix 'model.' -> '', line 1 of test.map) maps 'model.' to an empty name");
}

TEST_CASE("Weights: a Hugging Face-named file imports through a name map", "[weights]") {
  const std::string dir = testing::TempDir("weights_map_");
  std::vector<RawTensor> ts = SmallModelTensors();
  for (RawTensor& t : ts) t.name = HfName(t.name);
  ts.push_back({"lm_head.weight", "F32", {101}, std::string(404, '\0')});  // tied: ignored
  ts.push_back({"model.layers.0.rotary.inv_freq", "F32", {2}, std::string(8, '\0')});
  WeightsImportOptions options;
  options.names = MapOf(kImportMap);
  const std::string path = dir + "/m.safetensors";
  SECTION("every parameter found, the ignored listed") {
    WriteAll(path, Assemble(ts));
    std::vector<float> want;
    for (const RawTensor& t : SmallModelTensors()) {
      for (size_t k = 0; k < t.data.size() / 4; ++k) {
        float f;
        std::memcpy(&f, t.data.data() + 4 * k, 4);
        want.push_back(f);
      }
    }
    for (int world : {1, 2, 4}) {
      INFO("world " << world);
      std::vector<float> master;
      absl::StatusOr<WeightsImportReport> r = ImportOn(world, path, options, &master);
      INFO(r.status().ToString());
      REQUIRE(r.ok());
      REQUIRE(r->ignored ==
              std::vector<std::string>{"lm_head.weight", "model.layers.0.rotary.inv_freq"});
      REQUIRE(r->renamed.size() == 7);
      REQUIRE(r->renamed[0] == std::make_pair(std::string("model.embed_tokens.weight"),
                                              std::string("embed.w")));
      REQUIRE(BitEqual(master, want));
    }
  }
  SECTION("two file tensors mapped to one parameter") {
    ts.push_back({"head.w", "F32", {101}, std::string(404, '\0')});
    WriteAll(path, Assemble(ts));
    RequireError(ImportOn(2, path, options).status(), absl::StatusCode::kInvalidArgument,
                 "two file tensors map to 'head.w': 'head.w' in '" + path +
                     "' as it is, and 'model.head.w' in '" + path +
                     "' by rule 4 (prefix 'model.' -> '', line 5 of test.map)");
  }
  SECTION("a misshapen tensor names its file name and rule") {
    ts[1].shape = {11, 13};
    WriteAll(path, Assemble(ts));
    RequireError(ImportOn(1, path, options).status(), absl::StatusCode::kInvalidArgument,
                 "tensor 'model.layers.0.weight' in '" + path + "' (bytes [");
    RequireError(ImportOn(1, path, options).status(), absl::StatusCode::kInvalidArgument,
                 "renamed 'l0.w' by rule 2 (regex 'model\\.layers\\.(\\d+)\\.weight' -> 'l$1.w', "
                 "line 3 of test.map) has shape [11, 13]; parameter 'l0.w' has [13, 11]");
  }
  SECTION("a tensor renamed to no parameter, and the parameter it should have been") {
    ts[6].name = "model.layers.head.bias";  // glob rule 3 makes it 'lhead.b'
    WriteAll(path, Assemble(ts));
    RequireError(ImportOn(2, path, options).status(), absl::StatusCode::kNotFound,
                 "1 parameter(s) have no tensor in the files (1 file(s) from '" + path +
                     "', names mapped by 4 rule(s)): head.w");
    options.allow_extra = true;
    std::vector<RawTensor> more = ts;
    more[6].name = "model.head.w";
    more.push_back({"model.layers.x.bias", "F32", {1}, std::string(4, '\0')});
    WriteAll(path, Assemble(more));
    absl::StatusOr<WeightsImportReport> r = ImportOn(2, path, options);
    REQUIRE(r.ok());
    REQUIRE(std::find(r->ignored.begin(), r->ignored.end(), "model.layers.x.bias") !=
            r->ignored.end());
    options.allow_extra = false;
    RequireError(ImportOn(2, path, options).status(), absl::StatusCode::kInvalidArgument,
                 "1 tensor(s) name no parameter (allow extra tensors, or ignore them by name, to "
                 "load without them): model.layers.x.bias (renamed 'lx.b' by rule 3 (glob "
                 "'model.layers.*.bias' -> 'l*.b', line 4 of test.map))");
  }
  SECTION("a file tensor of the parameter's own name, ignored or renamed away") {
    ts[6].name = "head.w";
    WriteAll(path, Assemble(ts));
    options.names = MapOf("ignore head.*\nprefix model.");
    RequireError(ImportOn(1, path, options).status(), absl::StatusCode::kNotFound,
                 "head.w (the file's tensor 'head.w' is ignored by 'head.*')");
  }
}

TEST_CASE("Weights: export -> import -> export through a name map gives identical files",
          "[weights]") {
  const DType dtype = GENERATE(DType::kF32, DType::kBF16);
  const int64_t max_shard = GENERATE(int64_t{0}, int64_t{1000});
  INFO(DTypeName(dtype) << " shard " << max_shard);
  WeightsExportOptions out;
  out.dtype = dtype;
  out.max_shard_bytes = max_shard;
  out.names = MapOf(kExportMap);
  const std::string a = testing::TempDir("weights_map_a_"), b = testing::TempDir("weights_map_b_");
  const std::string root = testing::TempDir("weights_map_ckpt_");
  // Trained on 2 ranks, exported with Hugging Face names, and saved as a checkpoint.
  std::vector<float> trained;
  auto device = testing::OneThreadCpuDevice();
  RequireAllOk(comm::testing::OnRanks(2, {20000}, [&](int rank, comm::Communicator* comm) {
    const Config config = testing::TestConfig(3, DType::kBF16, 1, 0, false);
    ASSIGN_OR_RETURN(auto engine, Engine::Create(config, SmallModel(), comm, device.get()));
    RETURN_IF_ERROR(testing::SetInitValues(*engine));
    RETURN_IF_ERROR(testing::TrainSteps(*engine, 0, 2));
    RETURN_IF_ERROR(SaveCheckpoint(*engine, root).status());
    ASSIGN_OR_RETURN(std::vector<std::string> files, ExportWeights(*engine, a, out));
    ASSIGN_OR_RETURN(std::vector<float> m, engine->GatherMasterWeights());
    if (rank == 0) trained = m;
    return absl::OkStatus();
  }));
  // The file holds the mapped names and nothing else.
  const std::string first = max_shard == 0 ? a + "/model.safetensors"
                                           : a + "/model-00001-of-0000" +
                                                 (dtype == DType::kF32 ? "5" : "3") + ".safetensors";
  const safetensors::FileHeader h = safetensors::ReadHeader(first).value();
  REQUIRE(h.tensors[0].name == "model.embed_tokens.weight");
  // Imported on 3 ranks through the inverse map, exported again with the same map.
  WeightsImportOptions in;
  in.names = MapOf(kImportMap);
  std::vector<float> imported;
  RequireAllOk(comm::testing::OnRanks(3, {20000}, [&](int rank, comm::Communicator* comm) {
    const Config config = testing::TestConfig(1, DType::kF32, 1, 0, false);
    ASSIGN_OR_RETURN(auto engine, Engine::Create(config, SmallModel(), comm, device.get()));
    RETURN_IF_ERROR(testing::SetInitValues(*engine, 0.5f));
    ASSIGN_OR_RETURN(WeightsImportReport report, ImportWeights(*engine, a, in));
    if (report.renamed.size() != 7) return absl::InternalError("not every tensor renamed");
    RETURN_IF_ERROR(ExportWeights(*engine, b, out).status());
    ASSIGN_OR_RETURN(std::vector<float> m, engine->GatherMasterWeights());
    if (rank == 0) imported = m;
    return absl::OkStatus();
  }));
  REQUIRE(BitEqual(imported, RoundTo(dtype, trained)));
  // The checkpoint's streamed export through the same map: a third writer, the same bytes.
  const std::string c = testing::TempDir("weights_map_c_");
  REQUIRE(ExportCheckpointWeights(root, c, out).ok());
  RequireSameExports(a, {b, c}, dtype, max_shard);
}

TEST_CASE("Weights: an export map that writes two parameters under one name is refused",
          "[weights]") {
  std::vector<memory::ParamLayout> specs(2);
  specs[0].name = "a.w";
  specs[1].name = "b.w";
  specs[0].shape = specs[1].shape = {1};
  specs[0].numel = specs[1].numel = 1;
  const std::vector<float> v = {1, 2};
  const std::string dir = testing::TempDir("weights_map_dup_");
  WeightsExportOptions out;
  out.names = MapOf("glob *.w w");
  RequireError(WriteWeights(specs, v, dir + "/x.safetensors", out).status(),
               absl::StatusCode::kInvalidArgument,
               "parameters 'a.w' by rule 1 (glob '*.w' -> 'w', line 1 of test.map) and 'b.w' by "
               "rule 1 (glob '*.w' -> 'w', line 1 of test.map) would both be written as 'w'");
  out.names = MapOf("ignore x");
  RequireError(WriteWeights(specs, v, dir + "/x.safetensors", out).status(),
               absl::StatusCode::kInvalidArgument, "ignore patterns apply to import only");
}

TEST_CASE("Weights: a corrupted checkpoint exports nothing", "[weights]") {
  const std::string root = testing::TempDir("weights_corrupt_");
  auto device = testing::OneThreadCpuDevice();
  std::string dir;
  RequireAllOk(comm::testing::OnRanks(2, {20000}, [&](int rank, comm::Communicator* comm) {
    const Config config = testing::TestConfig(2, DType::kBF16, 1, 0, false);
    ASSIGN_OR_RETURN(auto engine, Engine::Create(config, SmallModel(), comm, device.get()));
    RETURN_IF_ERROR(testing::SetInitValues(*engine));
    ASSIGN_OR_RETURN(std::string d, SaveCheckpoint(*engine, root));
    if (rank == 0) dir = d;
    return absl::OkStatus();
  }));
  // One master byte of the last shard flipped: its CRC fails after the pieces were streamed.
  std::string shard = ReadAll(dir + "/rank_00001.bin");
  shard[100] ^= 0x40;
  WriteAll(dir + "/rank_00001.bin", shard);
  const std::string out = testing::TempDir("weights_corrupt_out_");
  RequireError(ExportCheckpointWeights(root, out + "/w.safetensors").status(),
               absl::StatusCode::kDataLoss, "rank_00001.bin' is corrupted");
  RequireError(ExportCheckpointWeights(root, out, {DType::kBF16, 1000}).status(),
               absl::StatusCode::kDataLoss, "is corrupted");
  DIR* d = opendir(out.c_str());
  REQUIRE(d != nullptr);
  int entries = 0;
  while (const struct dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    entries += name != "." && name != "..";
  }
  closedir(d);
  REQUIRE(entries == 0);  // no file published, no temporary left
}

}  // namespace
}  // namespace zerort
