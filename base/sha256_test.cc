#include "base/sha256.h"

#include <random>
#include <string>

#include <catch2/catch.hpp>

namespace zerort {
namespace {

std::string Hex(const Sha256Digest& d) { return DigestHex(d); }

TEST_CASE("Sha256: the FIPS 180-4 example vectors (NIST CSRC)", "[base]") {
  CHECK(Hex(Sha256Of("")) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(Hex(Sha256Of("abc")) ==
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  // 448 bits: the padding needs a second block.
  CHECK(Hex(Sha256Of("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq")) ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  CHECK(Hex(Sha256Of("abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmno"
                     "ijklmnopjklmnopqklmnopqrlmnopqrsmnopqrstnopqrstu")) ==
        "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
  CHECK(Hex(Sha256Of(std::string(1000000, 'a'))) ==
        "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST_CASE("Sha256: any split of the input into Update calls gives the one-shot digest",
          "[base]") {
  std::mt19937 rng(3);
  for (size_t len : {0u, 1u, 55u, 56u, 63u, 64u, 65u, 119u, 120u, 128u, 1000u}) {
    std::string s(len, '\0');
    for (char& c : s) c = static_cast<char>(rng());
    const Sha256Digest want = Sha256Of(s);
    for (size_t cut = 0; cut <= len; cut += 1 + len / 17) {
      Sha256 h;
      h.Update(absl::string_view(s).substr(0, cut));
      h.Update(absl::string_view(s).substr(cut));
      INFO("len " << len << " cut " << cut);
      CHECK(h.Finish() == want);
    }
  }
}

TEST_CASE("HmacSha256: the RFC 4231 test cases", "[base]") {
  CHECK(Hex(HmacSha256(std::string(20, '\x0b'), "Hi There")) ==
        "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  CHECK(Hex(HmacSha256("Jefe", "what do ya want for nothing?")) ==
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  CHECK(Hex(HmacSha256(std::string(20, '\xaa'), std::string(50, '\xdd'))) ==
        "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe");
  std::string key4;
  for (int i = 1; i <= 25; ++i) key4 += static_cast<char>(i);
  CHECK(Hex(HmacSha256(key4, std::string(50, '\xcd'))) ==
        "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b");
  // Test case 5 is truncated to 128 bits.
  CHECK(Hex(HmacSha256(std::string(20, '\x0c'), "Test With Truncation")).substr(0, 32) ==
        "a3b6167473100ee06e0c796c2955552b");
  // Keys longer than a block are hashed first.
  const std::string big_key(131, '\xaa');
  CHECK(Hex(HmacSha256(big_key, "Test Using Larger Than Block-Size Key - Hash Key First")) ==
        "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  CHECK(Hex(HmacSha256(big_key,
                       "This is a test using a larger than block-size key and a larger than "
                       "block-size data. The key needs to be hashed before being used by the "
                       "HMAC algorithm.")) ==
        "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2");
}

TEST_CASE("ConstantTimeEqual: equal only for the same bytes and length", "[base]") {
  const std::string mac = DigestBytes(HmacSha256("k", "m"));
  CHECK(ConstantTimeEqual(mac, mac));
  CHECK(ConstantTimeEqual("", ""));
  for (size_t i = 0; i < mac.size(); ++i) {
    std::string flipped = mac;
    flipped[i] ^= 1;
    CHECK(!ConstantTimeEqual(mac, flipped));
  }
  CHECK(!ConstantTimeEqual(mac, mac.substr(0, 31)));
  CHECK(!ConstantTimeEqual("ab", std::string("ab\0", 3)));
}

}  // namespace
}  // namespace zerort
