// libFuzzer entry point for the manifest parser (clang -fsanitize=fuzzer builds link it alone;
// ckpt_manifest_fuzz_test drives it from Catch2 in CI). Checks, beyond not crashing, that an
// accepted manifest is self-consistent: whatever a loader computes from it stays in range.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "absl/strings/string_view.h"
#include "checkpoint/internal/ckpt_manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace zerort::ckpt_internal;
  absl::StatusOr<Manifest> m =
      ParseManifest(absl::string_view(reinterpret_cast<const char*>(data), size));
  if (!m.ok()) return 0;
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
  return 0;
}
