// SatAdd and SatMul against the closed form min(exact, 2^63 - 1), the exact value computed in
// 128-bit integers, on every pair of a set of counts around the overflow boundaries.
#include "base/saturating.h"

#include <catch2/catch.hpp>
#include <cstdint>
#include <limits>
#include <vector>

namespace zerort {
namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();

int64_t Clamp(__int128 exact) { return exact > kMax ? kMax : static_cast<int64_t>(exact); }

const std::vector<int64_t>& Counts() {
  // 3037000499^2 < 2^63 - 1 < 3037000500^2: the largest square that fits and the first that
  // does not; 2^62 doubled is 2^63, one past the maximum.
  static const std::vector<int64_t> counts = {0,
                                              1,
                                              2,
                                              3,
                                              255,
                                              int64_t{1} << 31,
                                              int64_t{1} << 32,
                                              3037000499,
                                              3037000500,
                                              int64_t{1} << 62,
                                              kMax / 2,
                                              kMax / 2 + 1,
                                              kMax / 3,
                                              kMax - 1,
                                              kMax};
  return counts;
}

TEST_CASE("SatAdd: the exact sum, or INT64_MAX when it does not fit", "[base]") {
  for (int64_t a : Counts()) {
    for (int64_t b : Counts()) {
      INFO(a << " + " << b);
      CHECK(SatAdd(a, b) == Clamp(static_cast<__int128>(a) + b));
    }
  }
  CHECK(SatAdd(kMax / 2, kMax / 2 + 1) == kMax);      // exactly the maximum, no saturation
  CHECK(SatAdd(kMax / 2 + 1, kMax / 2 + 1) == kMax);  // one past it
}

TEST_CASE("SatMul: the exact product, or INT64_MAX when it does not fit", "[base]") {
  for (int64_t a : Counts()) {
    for (int64_t b : Counts()) {
      INFO(a << " * " << b);
      CHECK(SatMul(a, b) == Clamp(static_cast<__int128>(a) * b));
    }
  }
  CHECK(SatMul(3037000499, 3037000499) == int64_t{9223372030926249001});
  CHECK(SatMul(3037000500, 3037000500) == kMax);
  CHECK(SatMul(int64_t{1} << 62, 2) == kMax);
}

}  // namespace
}  // namespace zerort
