// The example's random numbers: splitmix64, so data and initial weights are the same on every
// machine and rank, and a hash of several integers for per-(rank, step) streams.
//
// Thread safety: Rng is a value; use one per thread.
#ifndef ZERORT_EXAMPLES_GPT_INTERNAL_RANDOM_H_
#define ZERORT_EXAMPLES_GPT_INTERNAL_RANDOM_H_

#include <cmath>
#include <cstdint>
#include <initializer_list>

namespace zerort {
namespace examples {
namespace gpt {
namespace internal {

class Rng {
 public:
  // A stream determined by every key, in order.
  explicit Rng(std::initializer_list<uint64_t> keys) {
    for (uint64_t k : keys) state_ = Next() ^ (k * 0xd1342543de82ef95ull);
  }

  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // In [0, 1), 53 random bits.
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1p-53; }
  // In [0, n). REQUIRES: n >= 1.
  int64_t Below(int64_t n) { return static_cast<int64_t>(Uniform() * static_cast<double>(n)); }
  // Standard normal (Box-Muller).
  double Normal() {
    const double u1 = 1.0 - Uniform();  // (0, 1]: log is finite
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * Uniform());
  }

 private:
  uint64_t state_ = 0x243f6a8885a308d3ull;
};

}  // namespace internal
}  // namespace gpt
}  // namespace examples
}  // namespace zerort

#endif  // ZERORT_EXAMPLES_GPT_INTERNAL_RANDOM_H_
