#include "base/crc32c.h"

#include <random>
#include <string>

#include <catch2/catch.hpp>

namespace zerort {
namespace {

// Bit at a time, straight from the definition: the reference for both fast paths.
uint32_t BitwiseCrc32c(const std::string& s) {
  uint32_t c = 0xffffffffu;
  for (unsigned char b : s) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
  }
  return ~c;
}

TEST_CASE("Crc32c: the standard check value, and both paths equal a bitwise reference at any "
          "length and split", "[base]") {
  REQUIRE(Crc32c(0, "123456789", 9) == 0xE3069283u);
  REQUIRE(Crc32cPortable(0, "123456789", 9) == 0xE3069283u);
  std::mt19937 rng(7);
  for (int len : {0, 1, 7, 8, 9, 63, 64, 65, 1000, 4099}) {
    std::string s(len, '\0');
    for (char& ch : s) ch = static_cast<char>(rng());
    const uint32_t want = BitwiseCrc32c(s);
    REQUIRE(Crc32c(0, s.data(), s.size()) == want);
    REQUIRE(Crc32cPortable(0, s.data(), s.size()) == want);
    const size_t cut = len == 0 ? 0 : rng() % len;
    REQUIRE(Crc32c(Crc32c(0, s.data(), cut), s.data() + cut, s.size() - cut) == want);
    REQUIRE(Crc32cPortable(Crc32cPortable(0, s.data(), cut), s.data() + cut, s.size() - cut) ==
            want);
  }
}

}  // namespace
}  // namespace zerort
