// The element encodings of the compact optimizer-state forms (docs/compact_state.md), written
// once for the host compiler and for nvcc like base/half.h, so that the host AdamW's SIMD paths,
// its scalar reference and a CUDA kernel cannot disagree on a bit.
//
// Lossless master: the fp32 master as its bf16 parameter plus a 16-bit remainder.
//   uint16_t param, rem;
//   SplitMaster(master, &param, &rem);      // param = master rounded to nearest, ties away
//   assert(FloatBits(JoinMaster(param, rem)) == FloatBits(master));  // for every non-sNaN
//
// Stochastic rounding of a bf16 master: the random bits of one element are a pure function of
// (seed, step, global element index), so results do not depend on threads, SIMD path, shard
// boundaries or world size.
//   const uint32_t key = StochasticKey(seed, step, IndexHigh(index));
//   uint16_t p = Bf16Stochastic(x, StochasticBits(key, IndexLow(index)));
//
// Thread safety: pure functions.
#ifndef ZERORT_OFFLOAD_COMPACT_STATE_H_
#define ZERORT_OFFLOAD_COMPACT_STATE_H_

#include <cstdint>

#include "base/dtype.h"  // base/half.h: FloatBits, BitsToFloat, ZERORT_HOST_DEVICE

namespace zerort {
namespace offload {

// ---------------------------------------------------------------- lossless master

// Why the parameter is rounded ties-away and not to nearest even: with an RNE parameter, the
// masters that round to an even bf16 value p are the 65537 bit patterns from p - 0x8000 to
// p + 0x8000 (both ties go to the even p), and 16 bits cannot tell 65537 apart. Ties-away
// moves one of them (p + 0x8000) to the odd neighbour, leaving exactly 65536 masters per
// parameter: the parameter is then the high half plus the remainder's top bit, and the
// remainder is the master's low half. The parameter differs from RNE only on an exact tie
// whose lower neighbour is even (compact_state_test counts them). NaN masters are not
// rounded: their parameter is FloatToBf16's (quiet bit set), and a quiet NaN comes back whole.
// REQUIRES: param, remainder not null.
ZERORT_HOST_DEVICE inline void SplitMaster(float master, uint16_t* param, uint16_t* remainder) {
  const uint32_t u = FloatBits(master);
  *remainder = static_cast<uint16_t>(u & 0xffffu);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    *param = static_cast<uint16_t>((u >> 16) | 0x0040u);
  } else {
    // No overflow: the largest non-NaN high half that carries is 0x7f7f (or 0xff7f), which
    // becomes infinity, as nearest-even rounding makes it.
    *param = static_cast<uint16_t>((u + 0x8000u) >> 16);
  }
}

// The master that SplitMaster split into (param, remainder). Exact for every non-NaN master
// and every quiet NaN; a signaling NaN comes back quiet (AdamW's arithmetic never produces one).
ZERORT_HOST_DEVICE inline float JoinMaster(uint16_t param, uint16_t remainder) {
  const bool nan = (param & 0x7fffu) > 0x7f80u;
  // A remainder with its top bit set was a carry into the parameter: take it back.
  const uint32_t high = nan ? param : static_cast<uint32_t>(param) - (remainder >> 15);
  return BitsToFloat((high << 16) | remainder);
}

// -------------------------------------------------------- stochastic rounding bits

ZERORT_HOST_DEVICE inline uint32_t IndexLow(uint64_t index) {
  return static_cast<uint32_t>(index);
}
ZERORT_HOST_DEVICE inline uint32_t IndexHigh(uint64_t index) {
  return static_cast<uint32_t>(index >> 32);
}

// A bijective 32-bit mixer: xor-shift / odd multiply rounds, the finalizer structure of
// MurmurHash3 (Appleby) with its published constants. Each output bit depends on every input
// bit, which is what unbiased rounding needs from consecutive indices.
ZERORT_HOST_DEVICE inline uint32_t Mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85ebca6bu;
  x ^= x >> 13;
  x *= 0xc2b2ae35u;
  x ^= x >> 16;
  return x;
}

// The per-call key: (seed, step, high word of the global index) folded into 32 bits, computed
// once per call (or once per 2^32 elements), so the per-element work is one Mix32.
ZERORT_HOST_DEVICE inline uint32_t StochasticKey(uint64_t seed, uint64_t step,
                                                 uint32_t index_high) {
  uint32_t k = Mix32(static_cast<uint32_t>(seed) ^ 0x9e3779b9u);
  k = Mix32(k ^ static_cast<uint32_t>(seed >> 32));
  k = Mix32(k ^ static_cast<uint32_t>(step));
  k = Mix32(k ^ static_cast<uint32_t>(step >> 32));
  return Mix32(k ^ index_high);
}

// 32 random bits for the element whose global index has low word `index_low`: distinct
// elements of one call get distinct inputs, hence distinct outputs. One round, not two: the
// second cost 15% of the stochastic form's arithmetic (adamw_bench's compute ceiling, AVX2)
// and compact_state_test finds every bit fair and the rounding unbiased with one.
ZERORT_HOST_DEVICE inline uint32_t StochasticBits(uint32_t key, uint32_t index_low) {
  return Mix32(index_low ^ key);
}

// x rounded to bf16 up or down, up with probability (distance to the lower neighbour) / ulp:
// the top 16 random bits are added below the bf16's last place and the sum truncated, so the
// expected result is x exactly (uniform bits; sign-magnitude makes "up" away from zero, which
// is unbiased for negative x too). Exact bf16 values, infinities and zeros are unchanged; a
// finite x above the largest bf16 may round to infinity; NaN as FloatToBf16.
ZERORT_HOST_DEVICE inline uint16_t Bf16Stochastic(float x, uint32_t bits) {
  const uint32_t u = FloatBits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + (bits >> 16)) >> 16);
}

}  // namespace offload
}  // namespace zerort

#endif  // ZERORT_OFFLOAD_COMPACT_STATE_H_
