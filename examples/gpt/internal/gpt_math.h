// Per-element arithmetic of the GPT example's CUDA kernels (examples/gpt/internal/gpt_kernels.cu),
// written once for nvcc's device pass and for the host compiler.
//
// Why both: the kernels only map rows and elements to threads and reduce in their own order;
// what each element computes (the GELU and its derivative, a LayerNorm output and its input
// gradient, a softmax probability and its backward, a cross-entropy gradient) is here, and
// //examples/gpt:gpt_math_test runs these functions on the host against the CPU backend's
// reference ops (examples/gpt/internal/ops.cc) on every machine, GPU or not.
//
// Each function states the ops.cc expression it mirrors. The host side evaluates the same
// expressions in the same order as ops.cc (the test checks that); the device side uses CUDA's
// tanhf/expf/logf/sqrtf (within 2 ulp of the correctly rounded result, no --use_fast_math) and
// nvcc may contract a * b + c into an fma, so the GPU differs from the CPU by rounding: the
// comparison tolerances are stated in gpt_math_test.cc and gpt_cuda_test.cc.
//
// Thread safety: pure functions.
#ifndef ZERORT_EXAMPLES_GPT_INTERNAL_GPT_MATH_H_
#define ZERORT_EXAMPLES_GPT_INTERNAL_GPT_MATH_H_

#if defined(__CUDACC__)
#define GPT_HD __host__ __device__ __forceinline__
#else
#define GPT_HD inline
#endif

#include <cmath>

namespace zerort {
namespace examples {
namespace gpt {
namespace math {

inline constexpr float kLayerNormEps = 1e-5f;
inline constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi)
inline constexpr float kGeluA = 0.044715f;

GPT_HD float Tanh(float x) {
#if defined(__CUDA_ARCH__)
  return tanhf(x);
#else
  return std::tanh(x);
#endif
}

GPT_HD float Exp(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  return std::exp(x);
#endif
}

GPT_HD float Log(float x) {
#if defined(__CUDA_ARCH__)
  return logf(x);
#else
  return std::log(x);
#endif
}

GPT_HD float Sqrt(float x) {
#if defined(__CUDA_ARCH__)
  return sqrtf(x);
#else
  return std::sqrt(x);
#endif
}

// ------------------------------------------------------------------ embedding

// x[r][i] = wte[token][i] + wpe[pos][i] (model.cc, Pass::Embed).
GPT_HD float Embed(float token_row, float position_row) { return token_row + position_row; }

// ------------------------------------------------------------------ LayerNorm (eps 1e-5)

// rstd from the row's sum of squared deviations from its mean (ops::LayerNormForward:
// 1 / sqrt(v / d + eps)).
GPT_HD float LayerNormRstd(float sum_sq_dev, int d) {
  return 1.0f / Sqrt(sum_sq_dev / static_cast<float>(d) + kLayerNormEps);
}

// The normalized input, (x - mean) * rstd.
GPT_HD float LayerNormXhat(float x, float mean, float rstd) { return (x - mean) * rstd; }

// One output: (x - mean) * rstd * w + b.
GPT_HD float LayerNormOut(float x, float mean, float rstd, float w, float b) {
  return LayerNormXhat(x, mean, rstd) * w + b;
}

// One input gradient: rstd * (dy * w - mean(dy * w) - xhat * mean(dy * w * xhat)), with the two
// row means given (ops::LayerNormBackward's sum / d and dot / d).
GPT_HD float LayerNormDx(float dy, float w, float xhat, float mean_gw, float mean_gwx,
                         float rstd) {
  return rstd * (dy * w - mean_gw - xhat * mean_gwx);
}

// ------------------------------------------------------------------ GELU (tanh approximation)

GPT_HD float GeluForward(float x) {
  return 0.5f * x * (1.0f + Tanh(kGeluC * (x + kGeluA * x * x * x)));
}

GPT_HD float GeluBackward(float dy, float x) {
  const float t = Tanh(kGeluC * (x + kGeluA * x * x * x));
  const float dinner = kGeluC * (1.0f + 3.0f * kGeluA * x * x);
  return dy * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * dinner);
}

// ------------------------------------------------------------------ causal attention

// The softmax temperature of a head of hs dimensions: 1 / sqrt(hs).
GPT_HD float AttentionScale(int head_size) {
  return 1.0f / Sqrt(static_cast<float>(head_size));
}

// Query t attends to key u only when u <= t.
GPT_HD bool Visible(int t, int u) { return u <= t; }

// A probability, exp(z - max) / sum with z = scale * (q . k): ops::AttentionForward stores
// exp(p - max) first and divides by the row's sum after.
GPT_HD float SoftmaxNumerator(float z, float row_max) { return Exp(z - row_max); }
GPT_HD float SoftmaxProb(float numerator, float row_sum) { return numerator / row_sum; }

// The gradient of a pre-softmax logit (before the 1/sqrt(hs) scale): scale * p * (dp - sum p dp)
// (ops::AttentionBackward's ds).
GPT_HD float SoftmaxBackward(float p, float dp, float row_pdp, float scale) {
  return scale * p * (dp - row_pdp);
}

// ------------------------------------------------------------------ cross-entropy

// log(sum exp(z)) from the row's max and sum of exp(z - max).
GPT_HD float LogSumExp(float row_max, float row_sum) { return row_max + Log(row_sum); }

// Loss of a row: lse - z[target].
GPT_HD float CrossEntropyLoss(float lse, float target_logit) { return lse - target_logit; }

// d(scale * loss)/dz[v] = scale * (softmax(z)[v] - [v == target]) (ops::CrossEntropy: scale *
// exp(z - lse), then scale subtracted at the target).
GPT_HD float CrossEntropyGrad(float z, float lse, bool is_target, float scale) {
  const float g = scale * Exp(z - lse);
  return is_target ? g - scale : g;
}

}  // namespace math
}  // namespace gpt
}  // namespace examples
}  // namespace zerort

#endif  // ZERORT_EXAMPLES_GPT_INTERNAL_GPT_MATH_H_
