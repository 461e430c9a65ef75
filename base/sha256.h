// SHA-256 (FIPS 180-4) and HMAC-SHA256 (RFC 2104): what the rendezvous (comm/rendezvous.cc)
// uses to prove knowledge of a shared secret without sending it, and to bind each payload to
// its session. Written here because the project links no crypto library; the test checks the
// NIST and RFC 4231 vectors.
//
//   Sha256Digest d = HmacSha256(secret, message);
//   if (!ConstantTimeEqual(DigestBytes(d), received)) { ... refuse ... }
//
// Not for bulk data: 126-165 MB/s, one HMAC of 200 bytes in about 3 us (measured on a busy
// 2-core machine); a rendezvous computes three per peer.
// Thread safety: a Sha256 object is used by one thread; the free functions are pure.
#ifndef ZERORT_BASE_SHA256_H_
#define ZERORT_BASE_SHA256_H_

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace zerort {

using Sha256Digest = std::array<uint8_t, 32>;

// Incremental SHA-256: Update any number of times, then Finish once.
class Sha256 {
 public:
  Sha256();
  void Update(absl::string_view data);
  // The digest of everything passed to Update. The object must not be used afterwards.
  Sha256Digest Finish();

  static constexpr size_t kBlockBytes = 64;

 private:
  void Compress(const uint8_t* block);

  uint32_t h_[8];
  uint8_t buf_[kBlockBytes];
  size_t buffered_ = 0;
  uint64_t total_bytes_ = 0;
};

Sha256Digest Sha256Of(absl::string_view data);

// HMAC-SHA256(key, message); keys longer than the block size are hashed first (RFC 2104).
Sha256Digest HmacSha256(absl::string_view key, absl::string_view message);

// The digest as a 32-byte string, for comparisons and the wire.
std::string DigestBytes(const Sha256Digest& d);

// Lower-case hex of the digest (for tests and messages).
std::string DigestHex(const Sha256Digest& d);

// True when a and b are equal; for equal lengths the time taken does not depend on where they
// differ, so a peer cannot find a valid MAC a byte at a time by timing refusals.
bool ConstantTimeEqual(absl::string_view a, absl::string_view b);

}  // namespace zerort

#endif  // ZERORT_BASE_SHA256_H_
