#include "comm/internal/rendezvous_wire.h"

#include <arpa/inet.h>
#include <errno.h>
#include <sys/random.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/sha256.h"

namespace zerort {
namespace comm {
namespace internal {
namespace {

// The fields every MAC covers, after its role label. The label ends in a NUL and every
// variable-length field carries its length, so that no two different sessions encode alike.
std::string Transcript(absl::string_view label, const Session& s) {
  std::string t(label);
  t += '\0';
  Put32(&t, static_cast<uint32_t>(s.job_id.size()));
  t += s.job_id;
  Put32(&t, s.world_size);
  Put32(&t, s.rank);
  t += s.peer_nonce;
  t += s.rank0_nonce;
  return t;
}

}  // namespace

void Put32(std::string* out, uint32_t v) {
  v = htonl(v);
  out->append(reinterpret_cast<const char*>(&v), 4);
}

uint32_t Get32(const char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return ntohl(v);
}

absl::StatusOr<std::string> FreshNonce() {
  std::string nonce(kNonceBytes, '\0');
  size_t got = 0;
  while (got < nonce.size()) {
    const ssize_t k = getrandom(&nonce[got], nonce.size() - got, 0);
    if (k < 0) {
      if (errno == EINTR) continue;
      return absl::UnavailableError(
          absl::StrCat("rendezvous: getrandom failed: ", std::strerror(errno)));
    }
    got += static_cast<size_t>(k);
  }
  return nonce;
}

std::string Rank0Proof(absl::string_view secret, const Session& s) {
  return DigestBytes(HmacSha256(secret, Transcript("zerort rendezvous v2: rank 0 proof", s)));
}

std::string PeerProof(absl::string_view secret, const Session& s) {
  return DigestBytes(HmacSha256(secret, Transcript("zerort rendezvous v2: peer proof", s)));
}

std::string PayloadMac(absl::string_view secret, const Session& s, absl::string_view payload) {
  std::string t = Transcript("zerort rendezvous v2: payload", s);
  Put32(&t, static_cast<uint32_t>(payload.size()));
  t.append(payload.data(), payload.size());
  return DigestBytes(HmacSha256(secret, t));
}

std::string HelloMessage(const Session& s, bool has_secret) {
  std::string h;
  Put32(&h, kHelloMagic);
  Put32(&h, s.rank);
  Put32(&h, s.world_size);
  Put32(&h, has_secret ? kHelloHasSecret : 0);
  Put32(&h, static_cast<uint32_t>(s.job_id.size()));
  h += s.peer_nonce;
  h += s.job_id;
  return h;
}

}  // namespace internal
}  // namespace comm
}  // namespace zerort
