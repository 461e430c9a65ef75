#include "offload/compact_state.h"

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

#include "base/dtype.h"

namespace zerort {
namespace offload {
namespace {

bool IsNanBits(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }

// Round to nearest bf16, ties away from zero, derived in double from the two neighbours
// (independent of SplitMaster's integer trick). REQUIRES: x finite.
uint16_t NearestTiesAway(float x) {
  const uint32_t u = FloatBits(x);
  const uint16_t down = static_cast<uint16_t>(u >> 16);  // truncation: toward zero
  const int exponent = (down >> 7) & 0xff;
  // The bf16 spacing at `down`: 2^(e - 127 - 7), or 2^-133 among subnormals.
  const double ulp = std::ldexp(1.0, (exponent == 0 ? 1 : exponent) - 127 - 7);
  const double beyond = std::fabs(static_cast<double>(x)) -
                        std::fabs(static_cast<double>(Bf16ToFloat(down)));  // exact
  return beyond >= ulp / 2 ? static_cast<uint16_t>(down + 1) : down;
}

// High halves: both zeros, subnormal / normal boundary, around one, the largest finite, the
// infinities and NaNs (quiet and signaling), with both signs, plus every 251st value.
std::vector<uint32_t> HighHalves() {
  std::vector<uint32_t> h = {0x0000, 0x0001, 0x007f, 0x0080, 0x0081, 0x00ff, 0x3f7f, 0x3f80,
                             0x3f81, 0x4000, 0x7f7e, 0x7f7f, 0x7f80, 0x7f81, 0x7fbf, 0x7fc0,
                             0x7fc1, 0x7ffe, 0x7fff};
  const size_t specials = h.size();
  for (size_t k = 0; k < specials; ++k) h.push_back(h[k] | 0x8000u);
  for (uint32_t x = 3; x < 0x10000; x += 251) h.push_back(x);
  return h;
}

// What SplitMaster and JoinMaster must do with master bits u (and why not, if not): the round
// trip is exact (a signaling NaN comes back quiet), the parameter is the nearest bf16 with ties
// away from zero, which is nearest-even except on a tie above an even value. Counts the ties
// moved into *moved_ties.
const char* CheckSplit(uint32_t u, size_t* moved_ties) {
  const float x = BitsToFloat(u);
  uint16_t param, rem;
  SplitMaster(x, &param, &rem);
  const uint32_t back = FloatBits(JoinMaster(param, rem));
  if (IsNanBits(u)) {
    if (back != (u | 0x00400000u)) return "NaN round trip";
    return param == FloatToBf16(x) ? nullptr : "NaN parameter";
  }
  if (back != u) return "round trip";
  if ((u & 0x7fffffffu) == 0x7f800000u) return param == FloatToBf16(x) ? nullptr : "infinity";
  if (param != NearestTiesAway(x)) return "not nearest, ties away";
  if (param == FloatToBf16(x)) return nullptr;
  const bool tie_above_even = (u & 0xffffu) == 0x8000u && (u >> 16) % 2 == 0;
  if (!tie_above_even || param != static_cast<uint16_t>(FloatToBf16(x) + 1)) {
    return "differs from nearest-even off a tie above an even value";
  }
  ++*moved_ties;
  return nullptr;
}

TEST_CASE("SplitMaster: JoinMaster gives back every master over all 2^16 low halves",
          "[offload]") {
  size_t checked = 0, moved_ties = 0, even_finite_highs = 0;
  for (uint32_t high : HighHalves()) {
    const uint32_t magnitude = high & 0x7fffu;
    if (magnitude < 0x7f80u && high % 2 == 0) ++even_finite_highs;
    // One assertion per high half: Catch's per-assertion cost would dominate 2^16 of them.
    const char* first_failure = nullptr;
    uint32_t failed_u = 0;
    for (uint32_t low = 0; low < 0x10000; ++low) {
      const uint32_t u = (high << 16) | low;
      const char* failure = CheckSplit(u, &moved_ties);
      if (failure != nullptr && first_failure == nullptr) {
        first_failure = failure;
        failed_u = u;
      }
      ++checked;
    }
    INFO("first failure at master bits 0x" << std::hex << failed_u << ": "
                                           << (first_failure ? first_failure : ""));
    CHECK(first_failure == nullptr);
  }
  CHECK(checked == HighHalves().size() * 0x10000u);
  // Exactly one master per even finite high half takes the odd neighbour.
  CHECK(moved_ties == even_finite_highs);
}

TEST_CASE("SplitMaster: a nearest-even parameter has 65537 masters per even value", "[offload]") {
  // Why the remainder cannot sit beside a nearest-even parameter: count the fp32 bit patterns
  // that round to p. 65537 do not fit 16 bits, whatever the encoding.
  for (uint32_t p : {0x3f80u, 0x3f81u, 0x0102u, 0x0103u, 0xc2a4u, 0xc2a5u}) {
    size_t preimage = 0;
    for (uint32_t u = (p << 16) - 0x10000u; u <= (p << 16) + 0x10000u; ++u) {
      if (FloatToBf16(BitsToFloat(u)) == p) ++preimage;
    }
    INFO("p=0x" << std::hex << p);
    CHECK(preimage == (p % 2 == 0 ? 0x10001u : 0x0ffffu));
  }
}

// Closed-form bound for a count of successes in n draws of probability f: 6 standard deviations
// (plus one for the discreteness); a fixed seed makes the test deterministic.
bool WithinBinomial(size_t ups, size_t n, double f) {
  return std::fabs(static_cast<double>(ups) - n * f) <= 6 * std::sqrt(n * f * (1 - f)) + 1;
}

TEST_CASE("Bf16Stochastic: rounds to a neighbour, up with probability equal to the fraction",
          "[offload]") {
  const size_t n = size_t{1} << 18;
  const uint32_t lows[] = {0x0001, 0x1000, 0x4d2b, 0x8000, 0xc000, 0xffff};
  // Positive and negative, subnormal, just below a power of two (up crosses the exponent).
  const uint32_t highs[] = {0x3f80, 0xbf80, 0x0003, 0x807f, 0x407f, 0x7f7e};
  uint64_t step = 1;
  for (uint32_t high : highs) {
    for (uint32_t low : lows) {
      const uint32_t u = (high << 16) | low;
      const float x = BitsToFloat(u);
      const double f = low / 65536.0;
      size_t ups = 0, ups_over_steps = 0, neighbours = 0;
      const uint32_t key = StochasticKey(/*seed=*/42, ++step, /*index_high=*/0);
      for (size_t i = 0; i < n; ++i) {
        const uint16_t r = Bf16Stochastic(x, StochasticBits(key, static_cast<uint32_t>(i)));
        neighbours += r == high || r == high + 1;
        ups += r == high + 1;
        // One element (index 7) over many steps draws fresh bits too.
        const uint32_t key_t = StochasticKey(42, 1000 + i, 0);
        ups_over_steps += Bf16Stochastic(x, StochasticBits(key_t, 7)) == high + 1;
      }
      INFO("x bits 0x" << std::hex << u << std::dec << " ups " << ups << " of " << n);
      CHECK(neighbours == n);
      CHECK(WithinBinomial(ups, n, f));
      CHECK(WithinBinomial(ups_over_steps, n, f));
    }
  }
}

TEST_CASE("Bf16Stochastic: exact values, zeros, infinities and NaN are unchanged", "[offload]") {
  std::mt19937 rng(3);
  const uint32_t exact[] = {0x00000000, 0x80000000, 0x3f800000, 0xc0490000, 0x00010000,
                            0x7f7f0000, 0x7f800000, 0xff800000};
  for (uint32_t u : exact) {
    for (int k = 0; k < 1000; ++k) {
      CHECK(Bf16Stochastic(BitsToFloat(u), rng()) == (u >> 16));
    }
  }
  for (uint32_t nan : {0x7fc00000u, 0xffc00001u, 0x7f800001u, 0x7fffffffu}) {
    CHECK(Bf16Stochastic(BitsToFloat(nan), 0xffffffffu) == FloatToBf16(BitsToFloat(nan)));
  }
}

TEST_CASE("StochasticBits: every bit is fair and seed, step and index high word all matter",
          "[offload]") {
  const size_t n = size_t{1} << 16;
  const uint32_t key = StochasticKey(7, 3, 0);
  std::vector<size_t> ones(32, 0);
  for (size_t i = 0; i < n; ++i) {
    const uint32_t b = StochasticBits(key, static_cast<uint32_t>(i));
    for (int k = 0; k < 32; ++k) ones[k] += (b >> k) & 1u;
  }
  for (int k = 0; k < 32; ++k) {
    INFO("bit " << k);
    CHECK(WithinBinomial(ones[k], n, 0.5));
  }
  const uint32_t others[] = {StochasticKey(8, 3, 0), StochasticKey(7, 4, 0),
                             StochasticKey(7, 3, 1), StochasticKey(7 + (uint64_t{1} << 32), 3, 0),
                             StochasticKey(7, 3 + (uint64_t{1} << 32), 0)};
  for (uint32_t other : others) {
    size_t same = 0;
    for (uint32_t i = 0; i < 4096; ++i) {
      same += StochasticBits(key, i) >> 16 == StochasticBits(other, i) >> 16;
    }
    CHECK(same < 16);  // 4096 / 65536 expected by chance
  }
}

}  // namespace
}  // namespace offload
}  // namespace zerort
