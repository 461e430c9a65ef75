// The rendezvous's wire format (comm/rendezvous.h) and the HMAC-SHA256 values that authenticate
// it. Shared by rank 0's server and the peers' client; the protocol is described in
// docs/comm.md ("Rendezvous: protocol").
//
// Every MAC is HMAC-SHA256(secret, label || job id || world size || rank || peer nonce ||
// rank 0 nonce [|| payload]), each field length-prefixed or fixed-size, with a different label
// per role, so that a value made for one role, session, rank or job is worthless in another.
// With no secret the key is empty: the same checks then catch stale or crossed sessions, not an
// attacker.
//
// Thread safety: pure functions, except FreshNonce, which reads the kernel's random source.
#ifndef ZERORT_COMM_INTERNAL_RENDEZVOUS_WIRE_H_
#define ZERORT_COMM_INTERNAL_RENDEZVOUS_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace zerort {
namespace comm {
namespace internal {

// Message tags, big-endian on the wire.
constexpr uint32_t kHelloMagic = 0x5a525632;      // "ZRV2": peer's hello
constexpr uint32_t kChallengeTag = 0x5a524348;    // "ZRCH": rank 0's nonce and proof
constexpr uint32_t kProofTag = 0x5a525046;        // "ZRPF": the peer's proof
constexpr uint32_t kAcceptTag = 0x5a524f4b;       // "ZROK": rank 0 admitted the peer
constexpr uint32_t kPayloadTag = 0x5a52504c;      // "ZRPL": length, payload, MAC
constexpr uint32_t kRejectTag = 0x5a52584a;       // "ZRXJ": a refusal and its reason

constexpr size_t kNonceBytes = 32;
constexpr size_t kMacBytes = 32;
// Hello: magic, rank, world_size, flags, job id length, the peer's nonce; then the job id.
constexpr size_t kHelloHeaderBytes = 20 + kNonceBytes;
constexpr size_t kChallengeBytes = 4 + kNonceBytes + kMacBytes;
// The peer's answer to a challenge: kProofTag and its MAC, or kRejectTag, a reason, zeros.
constexpr size_t kAnswerBytes = 4 + kMacBytes;
constexpr uint32_t kHelloHasSecret = 1;  // flags bit: the peer holds a secret
constexpr size_t kMaxSecretBytes = 256;
constexpr size_t kMaxJobIdBytes = 256;

// Why one side refused the other; sent as {kRejectTag, reason}.
enum Reject : uint32_t {
  kRejectSecret = 1,     // one side has a secret and the other none, or the peer's proof failed
  kRejectWorld = 2,      // the peer's world_size differs from rank 0's
  kRejectRank = 3,       // rank outside [1, world_size)
  kRejectDuplicate = 4,  // another authenticated peer already joined with this rank
  kRejectJob = 5,        // the job id differs
  kRejectRank0Proof = 6  // (peer to rank 0) rank 0's proof failed: the secrets differ
};

void Put32(std::string* out, uint32_t v);
uint32_t Get32(const char* p);

// kNonceBytes from getrandom(2). Unavailable when the kernel's source fails.
absl::StatusOr<std::string> FreshNonce();

// What both sides' MACs cover: who, in which job, in which session.
struct Session {
  std::string job_id;
  uint32_t world_size = 0;
  uint32_t rank = 0;
  std::string peer_nonce;   // kNonceBytes
  std::string rank0_nonce;  // kNonceBytes
};

// Rank 0's proof that it knows `secret`, sent in the challenge.
std::string Rank0Proof(absl::string_view secret, const Session& s);
// The peer's proof, sent only after rank 0's proof checked out.
std::string PeerProof(absl::string_view secret, const Session& s);
// Binds `payload` to this session: a payload from another session, job or rank fails it.
std::string PayloadMac(absl::string_view secret, const Session& s, absl::string_view payload);

// The peer's hello.
std::string HelloMessage(const Session& s, bool has_secret);

}  // namespace internal
}  // namespace comm
}  // namespace zerort

#endif  // ZERORT_COMM_INTERNAL_RENDEZVOUS_WIRE_H_
