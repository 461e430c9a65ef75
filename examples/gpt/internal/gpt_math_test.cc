// The per-element arithmetic of the GPT CUDA kernels (gpt_math.h), run on the host against the
// CPU backend's reference ops (ops.cc), on every machine.
//
// Each case composes gpt_math's functions the way the kernel does (which element a thread
// computes, and in what order a reduction runs: lane-strided warp sums with a butterfly, column
// sums in chunks of kColumnChunkRows rows) and compares with the reference:
//  - element functions on the reference's own order (GELU, LayerNorm with serial sums,
//    embedding): bit for bit, since the host evaluates the same expressions;
//  - the kernels' reduction orders: |got - want| <= tol * (1 + |want|), tol stated per case,
//    from reassociating fp32 sums of at most a few hundred terms of similar magnitude.
// On the GPU, CUDA's tanhf/expf/logf and fma contraction add a few ulp; gpt_cuda_test compares
// the kernels themselves with the CPU backend.
#include "examples/gpt/internal/gpt_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "catch2/catch.hpp"
#include "examples/gpt/internal/gpt_kernels.h"
#include "examples/gpt/internal/ops.h"

namespace zerort {
namespace examples {
namespace gpt {
namespace {

std::vector<float> Random(size_t n, float scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// A warp's sum as the kernels form it: lane l adds elements l, l + 32, ... in order, then a
// butterfly with partners 16, 8, 4, 2, 1 (every lane ends with lane 0's value).
float WarpOrderSum(const std::vector<float>& v) {
  float lanes[32] = {};
  for (size_t i = 0; i < v.size(); ++i) lanes[i % 32] += v[i];
  for (int offset = 16; offset > 0; offset /= 2) {
    float next[32];
    for (int l = 0; l < 32; ++l) next[l] = lanes[l] + lanes[l ^ offset];
    std::copy(next, next + 32, lanes);
  }
  return lanes[0];
}

float WarpOrderMax(const std::vector<float>& v) {
  float m = -INFINITY;
  for (float x : v) m = std::max(m, x);
  return m;  // max is exact whatever the order
}

// Column sums in the kernels' order: chunks of kColumnChunkRows rows, then chunk partials.
std::vector<float> ChunkedColumnSums(const std::vector<float>& a, int64_t rows, int cols) {
  const int64_t chunks = kernels::ColumnChunks(rows);
  std::vector<float> partial(chunks * cols, 0.0f), out(cols, 0.0f);
  for (int64_t c = 0; c < chunks; ++c) {
    for (int64_t r = c * kernels::kColumnChunkRows;
         r < std::min(rows, (c + 1) * kernels::kColumnChunkRows); ++r) {
      for (int j = 0; j < cols; ++j) partial[c * cols + j] += a[r * cols + j];
    }
  }
  for (int64_t c = 0; c < chunks; ++c) {
    for (int j = 0; j < cols; ++j) out[j] += partial[c * cols + j];
  }
  return out;
}

void RequireClose(const std::vector<float>& got, const std::vector<float>& want, float tol) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("element " << i << ": got " << got[i] << ", want " << want[i]);
    REQUIRE(std::fabs(got[i] - want[i]) <= tol * (1.0f + std::fabs(want[i])));
  }
}

TEST_CASE("GptMath: GELU forward and backward equal ops' on the host, bit for bit", "[gpt]") {
  std::vector<float> x = Random(20000, 3.0f, 1);
  for (float special : {0.0f, -0.0f, 1e-30f, -1e-30f, 10.0f, -10.0f, 40.0f, -40.0f}) {
    x.push_back(special);
  }
  const std::vector<float> dy = Random(x.size(), 1.0f, 2);
  std::vector<float> y(x.size()), dx(x.size());
  ops::GeluForward(x.data(), x.size(), y.data());
  ops::GeluBackward(dy.data(), x.data(), x.size(), dx.data());
  for (size_t i = 0; i < x.size(); ++i) {
    INFO("x = " << x[i]);
    CHECK(math::GeluForward(x[i]) == y[i]);
    CHECK(math::GeluBackward(dy[i], x[i]) == dx[i]);
  }
}

TEST_CASE("GptMath: embedding rows add as the CPU pass adds them", "[gpt]") {
  const std::vector<float> a = Random(1000, 0.02f, 3), b = Random(1000, 0.02f, 4);
  for (size_t i = 0; i < a.size(); ++i) CHECK(math::Embed(a[i], b[i]) == a[i] + b[i]);
}

TEST_CASE("GptMath: LayerNorm forward equals ops' (serial sums: exactly; warp order: 1e-5)",
          "[gpt]") {
  const int rows = 37;
  for (int d : {1, 31, 64, 96, 768}) {
    INFO("d = " << d);
    std::vector<float> x = Random(static_cast<size_t>(rows) * d, 1.5f, 5);
    for (int i = 0; i < d; ++i) x[i] += 100.0f;  // a row far from zero mean
    const std::vector<float> w = Random(d, 1.0f, 6), b = Random(d, 0.5f, 7);
    std::vector<float> y(x.size()), mean(rows), rstd(rows);
    ops::LayerNormForward(x.data(), w.data(), b.data(), rows, d, y.data(), mean.data(),
                          rstd.data());
    std::vector<float> serial(x.size()), warp(x.size()), warp_rstd(rows);
    for (int r = 0; r < rows; ++r) {
      const float* xr = x.data() + static_cast<size_t>(r) * d;
      // Serial, ops' order.
      float m = 0;
      for (int i = 0; i < d; ++i) m += xr[i];
      m /= d;
      float v = 0;
      for (int i = 0; i < d; ++i) v += (xr[i] - m) * (xr[i] - m);
      const float s = math::LayerNormRstd(v, d);
      CHECK(m == mean[r]);
      CHECK(s == rstd[r]);
      for (int i = 0; i < d; ++i) serial[r * d + i] = math::LayerNormOut(xr[i], m, s, w[i], b[i]);
      // The kernel's warp order.
      const float wm = WarpOrderSum(std::vector<float>(xr, xr + d)) / static_cast<float>(d);
      std::vector<float> sq(d);
      for (int i = 0; i < d; ++i) sq[i] = (xr[i] - wm) * (xr[i] - wm);
      const float ws = math::LayerNormRstd(WarpOrderSum(sq), d);
      warp_rstd[r] = ws;
      for (int i = 0; i < d; ++i) warp[r * d + i] = math::LayerNormOut(xr[i], wm, ws, w[i], b[i]);
    }
    CHECK(serial == y);
    // Row 0 sits at mean ~100: its xhat = (x - mean) * rstd inherits the mean's rounding
    // (ulp(100) = 7.6e-6, times rstd), so it gets 1e-4; the zero-mean rows 1e-5.
    const std::vector<float> y0(y.begin(), y.begin() + d), y_rest(y.begin() + d, y.end());
    RequireClose(std::vector<float>(warp.begin(), warp.begin() + d), y0, 1e-4f);
    RequireClose(std::vector<float>(warp.begin() + d, warp.end()), y_rest, 1e-5f);
    RequireClose(warp_rstd, rstd, 1e-5f);
  }
}

TEST_CASE("GptMath: LayerNorm backward (dx; dw, db in column chunks) within 1e-5 of ops'",
          "[gpt]") {
  const int rows = 150;  // three column chunks, the last partial
  for (int d : {8, 96, 768}) {
    INFO("d = " << d);
    const std::vector<float> x = Random(static_cast<size_t>(rows) * d, 1.0f, 8);
    const std::vector<float> dy = Random(x.size(), 0.1f, 9);
    const std::vector<float> w = Random(d, 1.0f, 10), b = Random(d, 0.1f, 11);
    std::vector<float> y(x.size()), mean(rows), rstd(rows);
    ops::LayerNormForward(x.data(), w.data(), b.data(), rows, d, y.data(), mean.data(),
                          rstd.data());
    std::vector<float> dx(x.size()), dw(d), db(d);
    ops::LayerNormBackward(dy.data(), x.data(), w.data(), mean.data(), rstd.data(), rows, d,
                           dx.data(), dw.data(), db.data());
    std::vector<float> got_dx(x.size()), gxhat(x.size());
    for (int r = 0; r < rows; ++r) {
      std::vector<float> gw(d), gwx(d);
      for (int i = 0; i < d; ++i) {
        const float xhat = math::LayerNormXhat(x[r * d + i], mean[r], rstd[r]);
        gw[i] = dy[r * d + i] * w[i];
        gwx[i] = gw[i] * xhat;
        gxhat[r * d + i] = dy[r * d + i] * xhat;
      }
      const float mean_gw = WarpOrderSum(gw) / static_cast<float>(d);
      const float mean_gwx = WarpOrderSum(gwx) / static_cast<float>(d);
      for (int i = 0; i < d; ++i) {
        got_dx[r * d + i] =
            math::LayerNormDx(dy[r * d + i], w[i], math::LayerNormXhat(x[r * d + i], mean[r],
                                                                        rstd[r]),
                              mean_gw, mean_gwx, rstd[r]);
      }
    }
    RequireClose(got_dx, dx, 1e-5f);
    RequireClose(ChunkedColumnSums(gxhat, rows, d), dw, 1e-5f);
    RequireClose(ChunkedColumnSums(dy, rows, d), db, 1e-5f);
  }
}

TEST_CASE("GptMath: bias gradients in column chunks within 1e-5 of ops::LinearBackward's db",
          "[gpt]") {
  const int64_t n = 200;
  const int in = 3, out = 50;
  const std::vector<float> x = Random(n * in, 1.0f, 12), w = Random(in * out, 1.0f, 13);
  const std::vector<float> dy = Random(n * out, 0.5f, 14);
  std::vector<float> dx(n * in), dw(in * out), db(out);
  ops::LinearBackward(dy.data(), x.data(), w.data(), n, in, out, dx.data(), dw.data(), db.data(),
                      1);
  RequireClose(ChunkedColumnSums(dy, n, out), db, 1e-5f);
}

TEST_CASE("GptMath: causal attention (softmax forward and backward) within 1e-5 of ops'",
          "[gpt]") {
  const int batch = 2, seq = 40, d = 24, heads = 3, hs = d / heads;
  const int64_t n = batch * seq;
  const std::vector<float> qkv = Random(n * 3 * d, 1.0f, 15);
  const std::vector<float> dy = Random(n * d, 0.3f, 16);
  std::vector<float> att(static_cast<size_t>(batch) * heads * seq * seq), y(n * d);
  ops::AttentionForward(qkv.data(), batch, seq, d, heads, att.data(), y.data(), 1);
  std::vector<float> dqkv(n * 3 * d);
  ops::AttentionBackward(dy.data(), qkv.data(), att.data(), batch, seq, d, heads, dqkv.data(), 1);

  const float scale = math::AttentionScale(hs);
  CHECK(scale == 1.0f / std::sqrt(static_cast<float>(hs)));
  auto q = [&](int b, int h, int t, int j) { return qkv[(b * seq + t) * 3 * d + h * hs + j]; };
  auto k = [&](int b, int h, int t, int j) { return qkv[(b * seq + t) * 3 * d + d + h * hs + j]; };
  auto v = [&](int b, int h, int t, int j) {
    return qkv[(b * seq + t) * 3 * d + 2 * d + h * hs + j];
  };
  std::vector<float> got_att(att.size()), got_y(y.size(), 0.0f), got_dqkv(dqkv.size(), 0.0f);
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < heads; ++h) {
      for (int t = 0; t < seq; ++t) {
        // Scores as cuBLAS forms them (plain fp32 dots), softmax as the warp kernel does.
        std::vector<float> z(seq, 0.0f);
        std::vector<float> visible;
        for (int u = 0; u < seq; ++u) {
          float dot = 0;
          for (int j = 0; j < hs; ++j) dot += q(b, h, t, j) * k(b, h, u, j);
          z[u] = scale * dot;
          if (math::Visible(t, u)) visible.push_back(z[u]);
        }
        const float mx = WarpOrderMax(visible);
        std::vector<float> nums;
        for (int u = 0; u <= t; ++u) nums.push_back(math::SoftmaxNumerator(z[u], mx));
        const float sum = WarpOrderSum(nums);
        float* p = got_att.data() + ((static_cast<size_t>(b) * heads + h) * seq + t) * seq;
        for (int u = 0; u < seq; ++u) {
          p[u] = math::Visible(t, u) ? math::SoftmaxProb(nums[u], sum) : 0.0f;
        }
        for (int j = 0; j < hs; ++j) {
          float acc = 0;
          for (int u = 0; u < seq; ++u) acc += p[u] * v(b, h, u, j);
          got_y[(b * seq + t) * d + h * hs + j] = acc;
        }
        // Backward of this row: dp = dy . v, then SoftmaxBackward, then dq, dk, dv.
        const float* g = dy.data() + (b * seq + t) * d + h * hs;
        std::vector<float> dp(seq), pdp_terms;
        for (int u = 0; u < seq; ++u) {
          float acc = 0;
          for (int j = 0; j < hs; ++j) acc += g[j] * v(b, h, u, j);
          dp[u] = acc;
          if (math::Visible(t, u)) pdp_terms.push_back(p[u] * dp[u]);
        }
        const float pdp = WarpOrderSum(pdp_terms);
        for (int u = 0; u < seq; ++u) {
          const float ds = math::Visible(t, u) ? math::SoftmaxBackward(p[u], dp[u], pdp, scale)
                                               : 0.0f;
          for (int j = 0; j < hs; ++j) {
            got_dqkv[(b * seq + t) * 3 * d + h * hs + j] += ds * k(b, h, u, j);
            got_dqkv[(b * seq + u) * 3 * d + d + h * hs + j] += ds * q(b, h, t, j);
            got_dqkv[(b * seq + u) * 3 * d + 2 * d + h * hs + j] += p[u] * g[j];
          }
        }
      }
    }
  }
  RequireClose(got_att, att, 1e-5f);
  RequireClose(got_y, y, 1e-5f);
  RequireClose(got_dqkv, dqkv, 1e-5f);
}

TEST_CASE("GptMath: cross-entropy loss and gradient (fp32 sums) within 1e-5 of ops' (double)",
          "[gpt]") {
  for (int vocab : {256, 50304}) {
    INFO("vocab = " << vocab);
    const int64_t n = 6;
    std::vector<float> logits = Random(n * vocab, 2.0f, 17);
    logits[3] = 30.0f;  // a confident row
    std::vector<int32_t> target(n);
    for (int64_t r = 0; r < n; ++r) target[r] = static_cast<int32_t>((r * 7919) % vocab);
    const float scale = 1.0f / 48;
    std::vector<float> want = logits, want_loss(n);
    ops::CrossEntropy(want.data(), target.data(), n, vocab, scale, want_loss.data());
    std::vector<float> got(logits.size()), got_loss(n);
    for (int64_t r = 0; r < n; ++r) {
      const std::vector<float> z(logits.begin() + r * vocab, logits.begin() + (r + 1) * vocab);
      const float mx = WarpOrderMax(z);
      std::vector<float> nums(vocab);
      for (int v = 0; v < vocab; ++v) nums[v] = math::SoftmaxNumerator(z[v], mx);
      // The block reduction: 256 threads, each strided, then warps, then 8 warp results.
      std::vector<float> threads(256, 0.0f);
      for (int v = 0; v < vocab; ++v) threads[v % 256] += nums[v];
      float sum = 0;
      for (int w = 0; w < 8; ++w) {
        sum += WarpOrderSum(std::vector<float>(threads.begin() + 32 * w,
                                               threads.begin() + 32 * (w + 1)));
      }
      const float lse = math::LogSumExp(mx, sum);
      got_loss[r] = math::CrossEntropyLoss(lse, z[target[r]]);
      for (int v = 0; v < vocab; ++v) {
        got[r * vocab + v] = math::CrossEntropyGrad(z[v], lse, v == target[r], scale);
      }
    }
    RequireClose(got_loss, want_loss, 1e-5f);
    RequireClose(got, want, 1e-5f);
  }
}

}  // namespace
}  // namespace gpt
}  // namespace examples
}  // namespace zerort
