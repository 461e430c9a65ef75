#include "examples/gpt/internal/ops.h"

#include <algorithm>
#include <cmath>
#include <thread>
#include <vector>

namespace zerort {
namespace examples {
namespace gpt {
namespace ops {
namespace {

// Eight independent partial sums in a fixed order: the compiler keeps them in one vector
// register (a plain serial sum would not vectorise without -ffast-math), and the order does not
// depend on the thread count.
float Dot(const float* a, const float* b, int n) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int k = 0;
  for (; k + 8 <= n; k += 8) {
    for (int j = 0; j < 8; ++j) s[j] += a[k + j] * b[k + j];
  }
  float tail = 0;
  for (; k < n; ++k) tail += a[k] * b[k];
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])) + tail;
}

// y[0, n) += a * x[0, n).
void Axpy(float a, const float* x, int n, float* y) {
  for (int k = 0; k < n; ++k) y[k] += a * x[k];
}

}  // namespace

void ParallelFor(int64_t n, int threads, const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(threads, n));
  if (parts == 1) {
    if (n > 0) fn(0, n);
    return;
  }
  std::vector<std::thread> pool;
  for (int64_t p = 1; p < parts; ++p) {
    pool.emplace_back([&fn, n, parts, p] { fn(n * p / parts, n * (p + 1) / parts); });
  }
  fn(0, n / parts);
  for (std::thread& t : pool) t.join();
}

void LinearForward(const float* x, const float* w, const float* b, int64_t n, int in, int out,
                   float* y, int threads) {
  ParallelFor(n, threads, [=](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* yr = y + r * out;
      std::copy(b, b + out, yr);
      const float* xr = x + r * in;
      for (int i = 0; i < in; ++i) Axpy(xr[i], w + static_cast<int64_t>(i) * out, out, yr);
    }
  });
}

void LinearBackward(const float* dy, const float* x, const float* w, int64_t n, int in, int out,
                    float* dx, float* dw, float* db, int threads) {
  ParallelFor(n, threads, [=](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int i = 0; i < in; ++i) {
        dx[r * in + i] = Dot(dy + r * out, w + static_cast<int64_t>(i) * out, out);
      }
    }
  });
  // Each row of dw sums over every sample in sample order, whichever thread owns it.
  ParallelFor(in, threads, [=](int64_t begin, int64_t end) {
    std::fill(dw + begin * out, dw + end * out, 0.0f);
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t i = begin; i < end; ++i) Axpy(x[r * in + i], dy + r * out, out, dw + i * out);
    }
  });
  std::fill(db, db + out, 0.0f);
  for (int64_t r = 0; r < n; ++r) Axpy(1.0f, dy + r * out, out, db);
}

void LayerNormForward(const float* x, const float* w, const float* b, int64_t n, int d, float* y,
                      float* mean, float* rstd) {
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = x + r * d;
    float m = 0;
    for (int i = 0; i < d; ++i) m += xr[i];
    m /= d;
    float v = 0;
    for (int i = 0; i < d; ++i) v += (xr[i] - m) * (xr[i] - m);
    const float s = 1.0f / std::sqrt(v / d + 1e-5f);
    for (int i = 0; i < d; ++i) y[r * d + i] = (xr[i] - m) * s * w[i] + b[i];
    mean[r] = m;
    rstd[r] = s;
  }
}

void LayerNormBackward(const float* dy, const float* x, const float* w, const float* mean,
                       const float* rstd, int64_t n, int d, float* dx, float* dw, float* db) {
  std::fill(dw, dw + d, 0.0f);
  std::fill(db, db + d, 0.0f);
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = x + r * d;
    const float* g = dy + r * d;
    // dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = dy * w.
    float sum = 0, dot = 0;
    for (int i = 0; i < d; ++i) {
      const float xhat = (xr[i] - mean[r]) * rstd[r];
      sum += g[i] * w[i];
      dot += g[i] * w[i] * xhat;
      dw[i] += g[i] * xhat;
      db[i] += g[i];
    }
    sum /= d;
    dot /= d;
    for (int i = 0; i < d; ++i) {
      const float xhat = (xr[i] - mean[r]) * rstd[r];
      dx[r * d + i] = rstd[r] * (g[i] * w[i] - sum - xhat * dot);
    }
  }
}

namespace {
constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi)
}  // namespace

void GeluForward(const float* x, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    y[i] = 0.5f * v * (1.0f + std::tanh(kGeluC * (v + 0.044715f * v * v * v)));
  }
}

void GeluBackward(const float* dy, const float* x, int64_t n, float* dx) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float t = std::tanh(kGeluC * (v + 0.044715f * v * v * v));
    const float dinner = kGeluC * (1.0f + 3.0f * 0.044715f * v * v);
    dx[i] = dy[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * dinner);
  }
}

void AttentionForward(const float* qkv, int batch, int seq, int d, int heads, float* att,
                      float* y, int threads) {
  const int hs = d / heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const int64_t row = 3 * static_cast<int64_t>(d);
  ParallelFor(static_cast<int64_t>(batch) * heads, threads, [=](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / heads, h = bh % heads;
      const float* base = qkv + b * seq * row + h * hs;  // q of (b, t=0, h)
      for (int t = 0; t < seq; ++t) {
        float* p = att + (bh * seq + t) * seq;
        const float* q = base + t * row;
        float maxv = -INFINITY;
        for (int u = 0; u <= t; ++u) {
          p[u] = scale * Dot(q, base + u * row + d, hs);
          maxv = std::max(maxv, p[u]);
        }
        float sum = 0;
        for (int u = 0; u <= t; ++u) sum += (p[u] = std::exp(p[u] - maxv));
        for (int u = 0; u <= t; ++u) p[u] /= sum;
        std::fill(p + t + 1, p + seq, 0.0f);
        float* yr = y + (b * seq + t) * d + h * hs;
        std::fill(yr, yr + hs, 0.0f);
        for (int u = 0; u <= t; ++u) Axpy(p[u], base + u * row + 2 * d, hs, yr);
      }
    }
  });
}

void AttentionBackward(const float* dy, const float* qkv, const float* att, int batch, int seq,
                       int d, int heads, float* dqkv, int threads) {
  const int hs = d / heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  const int64_t row = 3 * static_cast<int64_t>(d);
  ParallelFor(static_cast<int64_t>(batch) * heads, threads, [=](int64_t begin, int64_t end) {
    std::vector<float> dpre(seq);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / heads, h = bh % heads;
      const float* base = qkv + b * seq * row + h * hs;
      float* dbase = dqkv + b * seq * row + h * hs;
      for (int t = 0; t < seq; ++t) {
        std::fill(dbase + t * row, dbase + t * row + hs, 0.0f);
        std::fill(dbase + t * row + d, dbase + t * row + d + hs, 0.0f);
        std::fill(dbase + t * row + 2 * d, dbase + t * row + 2 * d + hs, 0.0f);
      }
      for (int t = 0; t < seq; ++t) {
        const float* p = att + (bh * seq + t) * seq;
        const float* g = dy + (b * seq + t) * d + h * hs;
        // dp[u] = g . v_u; softmax backward: dpre[u] = p[u] * (dp[u] - sum_u' p[u'] dp[u']).
        float pdp = 0;
        for (int u = 0; u <= t; ++u) {
          dpre[u] = Dot(g, base + u * row + 2 * d, hs);
          pdp += p[u] * dpre[u];
          Axpy(p[u], g, hs, dbase + u * row + 2 * d);  // dv_u += p[u] * g
        }
        for (int u = 0; u <= t; ++u) {
          const float ds = scale * p[u] * (dpre[u] - pdp);
          Axpy(ds, base + u * row + d, hs, dbase + t * row);  // dq_t += ds * k_u
          Axpy(ds, base + t * row, hs, dbase + u * row + d);  // dk_u += ds * q_t
        }
      }
    }
  });
}

void HeadForward(const float* x, const float* e, int64_t n, int d, int vocab, float* logits,
                 int threads) {
  ParallelFor(n, threads, [=](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int v = 0; v < vocab; ++v) {
        logits[r * vocab + v] = Dot(x + r * d, e + static_cast<int64_t>(v) * d, d);
      }
    }
  });
}

void HeadBackward(const float* dlogits, const float* x, const float* e, int64_t n, int d,
                  int vocab, float* dx, float* de, int threads) {
  ParallelFor(n, threads, [=](int64_t begin, int64_t end) {
    std::fill(dx + begin * d, dx + end * d, 0.0f);
    for (int64_t r = begin; r < end; ++r) {
      for (int v = 0; v < vocab; ++v) {
        Axpy(dlogits[r * vocab + v], e + static_cast<int64_t>(v) * d, d, dx + r * d);
      }
    }
  });
  ParallelFor(vocab, threads, [=](int64_t begin, int64_t end) {
    std::fill(de + begin * d, de + end * d, 0.0f);
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t v = begin; v < end; ++v) Axpy(dlogits[r * vocab + v], x + r * d, d, de + v * d);
    }
  });
}

void CrossEntropy(float* logits, const int32_t* target, int64_t n, int vocab, float scale,
                  float* loss) {
  for (int64_t r = 0; r < n; ++r) {
    float* z = logits + r * vocab;
    const float maxv = *std::max_element(z, z + vocab);
    double sum = 0;
    for (int v = 0; v < vocab; ++v) sum += std::exp(static_cast<double>(z[v] - maxv));
    const double lse = maxv + std::log(sum);
    loss[r] = static_cast<float>(lse - z[target[r]]);
    if (scale == 0) continue;
    for (int v = 0; v < vocab; ++v) z[v] = scale * static_cast<float>(std::exp(z[v] - lse));
    z[target[r]] -= scale;
  }
}

}  // namespace ops
}  // namespace gpt
}  // namespace examples
}  // namespace zerort
