// Drives LLVMFuzzerTestOneInput with a fixed seed for a bounded number of inputs, so that CI
// runs it briefly (about a second) on every build: byte-level mutations of valid manifests
// (the entry point retries each with its checksum recomputed, so they reach the field checks
// too) and value-level mutations with the checksum recomputed.
#include <chrono>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "nlohmann/json.hpp"
#include "base/crc32c.h"
#include "checkpoint/internal/ckpt_manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace zerort {
namespace ckpt_internal {
namespace {

using Json = nlohmann::ordered_json;

std::string Seed(int world, int stage) {
  Manifest m;
  m.step = 9;
  m.checkpoint_id = 0xfeedfacecafebeefull;
  m.world_size = world;
  m.stage = stage;
  m.compute_dtype = DType::kBF16;
  m.config_hash = "fnv1a64:1234";
  m.has_param_section = stage == 3;
  int64_t off = 0;
  for (int u = 0; u < 3; ++u) {
    const int64_t shard = 128 * (u + 1);
    m.units.push_back({"u" + std::to_string(u), shard * world, shard, off});
    off += shard;
  }
  m.shard_elements = off;
  m.params = {{"x", {5, 7}, 35, 0, 0}, {"y", {3}, 3, 0, 40}, {"z", {100}, 100, 2, 8}};
  for (int r = 0; r < world; ++r) m.files.push_back({ShardFileName(r), r, m.ShardFileBytes(), 1});
  return ManifestToJson(m);
}

int Run(const std::string& s) {
  return LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

// A random JSON value of the kinds that break parsers: extremes, wrong types, nesting.
Json RandomValue(std::mt19937_64& rng) {
  switch (rng() % 10) {
    case 0: return static_cast<int64_t>(rng());
    case 1: return -static_cast<int64_t>(rng() % 1000);
    case 2: return static_cast<uint64_t>(rng());
    case 3: return static_cast<int64_t>(rng() % 5);
    case 4: return 1e308 * (rng() % 3);
    case 5: return "rank_00000.bin";
    case 6: return Json::array({static_cast<int64_t>(rng() % 4), -1});
    case 7: return Json::object();
    case 8: return nullptr;
    default: return static_cast<int64_t>(int64_t{1} << (rng() % 63));
  }
}

// Replaces one random leaf (or container) of `j` with a random value.
void MutateValue(Json& j, std::mt19937_64& rng) {
  Json* node = &j;
  for (int depth = 0; depth < 4; ++depth) {
    if (node->is_object() && !node->empty()) {
      auto it = node->begin();
      std::advance(it, rng() % node->size());
      if (it.key() == "manifest_crc32c") return;
      node = &it.value();
    } else if (node->is_array() && !node->empty()) {
      node = &(*node)[rng() % node->size()];
    } else {
      break;
    }
    if (rng() % 3 == 0) break;
  }
  if (rng() % 8 == 0 && node->is_array()) {
    node->push_back(RandomValue(rng));
  } else {
    *node = RandomValue(rng);
  }
}

std::string WithChecksum(Json j) {
  j.erase("manifest_crc32c");
  const std::string body = j.dump();
  j["manifest_crc32c"] = Crc32c(0, body.data(), body.size());
  return j.dump();
}

TEST_CASE("ManifestFuzz: mutated manifests never crash and accepted ones are consistent",
          "[ckpt][fuzz]") {
  std::mt19937_64 rng(20240607);
  std::vector<std::string> seeds;
  for (int world : {1, 2, 5}) {
    for (int stage : {0, 3}) seeds.push_back(Seed(world, stage));
  }
  for (const std::string& s : seeds) REQUIRE(Run(s) == 0);
  int accepted = 0, rejected = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  for (int iter = 0; iter < 20000 && std::chrono::steady_clock::now() < deadline; ++iter) {
    std::string s = seeds[rng() % seeds.size()];
    if (iter % 2 == 0) {
      Json j = Json::parse(s);
      const int edits = 1 + static_cast<int>(rng() % 3);
      for (int e = 0; e < edits; ++e) MutateValue(j, rng);
      s = WithChecksum(j);
    } else {
      const int edits = 1 + static_cast<int>(rng() % 4);
      for (int e = 0; e < edits && !s.empty(); ++e) {
        const size_t at = rng() % s.size();
        switch (rng() % 4) {
          case 0: s[at] = static_cast<char>(rng()); break;
          case 1: s.erase(at, 1 + rng() % 8); break;
          case 2: s.insert(at, std::string(1 + rng() % 40, "[{\"9-e,:"[rng() % 8])); break;
          default: s.resize(at); break;
        }
      }
    }
    Run(s);  // aborts on an inconsistent acceptance
    const bool ok = ParseManifest(s).ok();
    (ok ? accepted : rejected)++;
  }
  // The value mutations must reach past the checksum: some inputs are accepted (a mutation of
  // an unchecked value such as config_hash), most rejected by a field check.
  INFO("accepted " << accepted << ", rejected " << rejected);
  REQUIRE(accepted > 0);
  REQUIRE(rejected > accepted);
  // Deep nesting is refused, not recursed into.
  REQUIRE(Run(std::string(100000, '[')) == 0);
  REQUIRE(!ParseManifest(std::string(100000, '[')).ok());
}

}  // namespace
}  // namespace ckpt_internal
}  // namespace zerort
