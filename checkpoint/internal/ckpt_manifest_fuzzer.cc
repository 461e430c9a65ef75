// libFuzzer entry point for the manifest parser (clang -fsanitize=fuzzer builds link it alone;
// ckpt_manifest_fuzz_test drives it from Catch2 in CI). Checks, beyond not crashing, that an
// accepted manifest is self-consistent: whatever a loader computes from it stays in range.
// Each input is parsed as it is, then again with its checksum recomputed: a mutation almost
// never matches the CRC, and without the second pass the fuzzer would stop there.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include <string>

#include "absl/strings/string_view.h"
#include "base/crc32c.h"
#include "checkpoint/internal/ckpt_manifest.h"
#include "nlohmann/json.hpp"

namespace {

using namespace zerort::ckpt_internal;

void CheckAccepted(absl::string_view text) {
  absl::StatusOr<Manifest> m = ParseManifest(text);
  if (!m.ok()) return;
  int64_t offset = 0;
  for (const ManifestUnit& u : m->units) {
    if (u.shard_offset != offset || u.padded != u.shard * m->world_size) std::abort();
    offset += u.shard;
  }
  if (offset != m->shard_elements) std::abort();
  for (const ManifestParam& p : m->params) {
    if (p.unit < 0 || p.unit >= static_cast<int>(m->units.size())) std::abort();
    if (p.numel < 1 || p.offset_in_unit < 0 ||
        p.offset_in_unit + p.numel > m->units[p.unit].padded) {
      std::abort();
    }
  }
  if (static_cast<int>(m->files.size()) != m->world_size) std::abort();
  for (const ManifestFile& f : m->files) {
    if (f.bytes != m->ShardFileBytes() || f.name != ShardFileName(f.rank)) std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  CheckAccepted(text);
  // The checksum covers the compact dump of the object without it, in its key order.
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(text.begin(), text.end(), nullptr,
                                                           /*allow_exceptions=*/false);
  if (!j.is_object()) return 0;
  j.erase("manifest_crc32c");
  const std::string body = j.dump();
  j["manifest_crc32c"] = zerort::Crc32c(0, body.data(), body.size());
  CheckAccepted(j.dump());
  return 0;
}
