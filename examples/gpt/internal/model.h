// One forward (and optionally backward) pass of the GPT over a batch, independent of where the
// parameters live: the engine (compute-dtype buffers, gathered per block in stage 3) or a flat
// fp32 vector (the tests' reference). ParamAccess is that seam.
//
// Thread safety: a Pass and its ParamAccess belong to one thread.
#ifndef ZERORT_EXAMPLES_GPT_INTERNAL_MODEL_H_
#define ZERORT_EXAMPLES_GPT_INTERNAL_MODEL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "examples/gpt/gpt.h"

namespace zerort {
namespace examples {
namespace gpt {
namespace internal {

// Parameter indices in registration order (see Gpt::ParamSpecs).
constexpr int kWte = 0;
constexpr int kWpe = 1;
constexpr int kParamsPerBlock = 12;
enum BlockParam {
  kLn1W, kLn1B, kQkvW, kQkvB, kAttnProjW, kAttnProjB,
  kLn2W, kLn2B, kFcW, kFcB, kMlpProjW, kMlpProjB,
};
inline int BlockParamIndex(int layer, int p) { return 2 + kParamsPerBlock * layer + p; }
inline int LnFIndex(int layers) { return 2 + kParamsPerBlock * layers; }  // w; b is next
inline int NumParams(int layers) { return LnFIndex(layers) + 2; }

// Adds `delta` bytes (negative: freed) to the ActivationMeter active on this thread, if any.
void CountActivationBytes(int64_t delta);

// The allocator of every batch-sized buffer of a pass (activations and their gradients), so that
// an ActivationMeter (gpt.h) sees each at its allocated size. Parameter-sized buffers (gradients,
// fp32 copies of parameters) stay plain std::vector: they do not grow with the micro-batch.
template <typename T>
struct MeteredAllocator {
  using value_type = T;
  MeteredAllocator() = default;
  template <typename U>
  MeteredAllocator(const MeteredAllocator<U>&) {}
  T* allocate(size_t n) {
    T* p = std::allocator<T>().allocate(n);
    CountActivationBytes(static_cast<int64_t>(n * sizeof(T)));
    return p;
  }
  void deallocate(T* p, size_t n) {
    CountActivationBytes(-static_cast<int64_t>(n * sizeof(T)));
    std::allocator<T>().deallocate(p, n);
  }
  template <typename U>
  bool operator==(const MeteredAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const MeteredAllocator<U>&) const { return false; }
};
using Acts = std::vector<float, MeteredAllocator<float>>;

// Where a pass reads its fp32 parameters and sends its gradients.
class ParamAccess {
 public:
  virtual ~ParamAccess() = default;
  // Makes exactly `params` (listed in the order the pass uses them) readable through Get until
  // the next Fetch; an empty list ends the pass's use of parameters.
  virtual absl::Status Fetch(const std::vector<int>& params) = 0;
  // fp32 values of a fetched parameter, row-major in its registered shape.
  virtual const float* Get(int i) = 0;
  // The output projection's (vocab, d) matrix: the token embedding, unless a test unties it.
  virtual const float* OutputEmbedding() { return Get(kWte); }
  // The complete gradient of parameter i (n fp32 values, already times the gradient scale).
  // Called once per parameter, in reverse registration order.
  virtual absl::Status Put(int i, const std::vector<float>& grad) = 0;
};

// Runs the pass and returns the mean cross-entropy of each sequence. With grad_scale != 0 it
// also runs backward and Puts every parameter's gradient of grad_scale * sum of token losses.
// `logits`, when not null, receives the (batch * seq, vocab) logits.
// REQUIRES: batch.seq <= shape.context, tokens < shape.vocab.
absl::StatusOr<std::vector<float>> RunPass(const GptShape& shape, int threads,
                                           ParamAccess& access, const TokenBatch& batch,
                                           float grad_scale, std::vector<float>* logits);

}  // namespace internal
}  // namespace gpt
}  // namespace examples
}  // namespace zerort

#endif  // ZERORT_EXAMPLES_GPT_INTERNAL_MODEL_H_
