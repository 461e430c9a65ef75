/* llm.c's CPU GPT-2 shape (L = 4 layers, C = 128 channels, 4 heads, a padded vocabulary of
 * V = 50304, 64 positions) trained on the installed C ABI the way a port of llm.c would: plain
 * C99, fp32, its 16 parameter tensors in llm.c's order (the per-layer ones stacked [L, ...]),
 * and one gradient allocation, `grads_memory`, holding the 16 gradients packed in that order,
 * which the trainer zeroes, accumulates into in backward and hands over to the engine
 * (zr_engine_set_grad_buffer). Built by Bazel (//tests:consumers:llmc_trainer) and against an
 * installed tree (tests/consumers/run.sh, Makefile).
 *
 * It trains the same steps twice per rank, from the same initial weights and data:
 *   "after create": the buffer handed over only after zr_engine_create, as a trainer did before
 *                   the plan could be told: the plan keeps gradient memory of the engine's;
 *   "declared":     zr_param_spec.grad_buffer = "grads" (packed) declares it before the plan,
 *                   which then reduces each unit it can straight from grads_memory and plans no
 *                   gradient memory for it.
 * and prints, for each, the tensors reduced in place and the engine's gradient memory
 * (zr_memory_report), and every tensor the declared plan still copies with its reason. It exits
 * non-zero unless the two runs' fp32 masters are bitwise equal, the declared run reduces the
 * embedding (89% of the elements) in place and holds less gradient memory than the other, and
 * the loss falls.
 *
 * Usage: llmc_trainer [--stage 0|1|2] [--layout tensors|layers] [--steps N]
 *   tensors (default): each of the 16 tensors a module (a unit) of its own;
 *   layers: the stacked tensors declared per layer (52 tensors; module h[l] holds layer l's 12
 *           slices), as docs/embedding.md suggests for overlap: a layer's slices are not
 *           consecutive in grads_memory, so those units are copied, and the plan says so.
 * Ranks: under mpirun (zr_launch_info_from_env reports "openmpi") one per MPI process; otherwise
 * 2 in-process ranks, one thread each. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zerort/zero_c.h>

#define L 4
#define C 128
#define NH 4
#define V 50304
#define MAXT 64
#define B 2
#define T 16
#define WORLD 2
#define NT 16 /* tensors */

static const char* const kNames[NT] = {"wte",  "wpe",      "ln1w",     "ln1b", "qkvw", "qkvb",
                                       "attprojw", "attprojb", "ln2w", "ln2b", "fcw",  "fcb",
                                       "fcprojw",  "fcprojb",  "lnfw", "lnfb"};
enum { WTE, WPE, LN1W, LN1B, QKVW, QKVB, ATTPROJW, ATTPROJB, LN2W, LN2B, FCW, FCB, FCPROJW,
       FCPROJB, LNFW, LNFB };

/* Elements of tensor t, and its per-layer slice (the whole tensor for the unstacked ones). */
static int64_t Slice(int t) {
  switch (t) {
    case WTE: return (int64_t)V * C;
    case WPE: return (int64_t)MAXT * C;
    case QKVW: return 3 * C * C;
    case QKVB: return 3 * C;
    case ATTPROJW: return C * C;
    case FCW: case FCPROJW: return 4 * C * C;
    case FCB: return 4 * C;
    default: return C;
  }
}
static int Stacked(int t) { return t != WTE && t != WPE && t != LNFW && t != LNFB; }
static int64_t Numel(int t) { return Slice(t) * (Stacked(t) ? L : 1); }

static int stage = 2, per_layer = 0, steps = 4;

typedef struct {
  zr_comm* comm;
  zr_device* device;
  int ok;
} Rank;

/* ---- The model: one layer's tensors, as pointers into the parameters or the gradients ---- */

typedef struct {
  float *ln1w, *ln1b, *qkvw, *qkvb, *attprojw, *attprojb, *ln2w, *ln2b, *fcw, *fcb, *fcprojw,
      *fcprojb;
} Layer;

typedef struct {
  float *wte, *wpe, *lnfw, *lnfb;
  Layer h[L];
} Model;

/* Points `m` at tensor t's data: base[t] for whole tensors; per layer `slice(t, l)`. */
static void Bind(Model* m, float* (*at)(void* ctx, int t, int l), void* ctx) {
  m->wte = at(ctx, WTE, 0);
  m->wpe = at(ctx, WPE, 0);
  m->lnfw = at(ctx, LNFW, 0);
  m->lnfb = at(ctx, LNFB, 0);
  for (int l = 0; l < L; ++l) {
    Layer* y = &m->h[l];
    float** f[12] = {&y->ln1w, &y->ln1b, &y->qkvw,  &y->qkvb, &y->attprojw, &y->attprojb,
                     &y->ln2w, &y->ln2b, &y->fcw,   &y->fcb,  &y->fcprojw,  &y->fcprojb};
    for (int k = 0; k < 12; ++k) *f[k] = at(ctx, LN1W + k, l);
  }
}

/* Activations of one micro-batch (B x T tokens), kept for backward. */
typedef struct {
  float x0[B * T * C];                          /* embeddings */
  float ln1[L][B * T * C], mu1[L][B * T], rs1[L][B * T];
  float qkv[L][B * T * 3 * C], att[L][B * NH * T * T], attout[L][B * T * C];
  float res2[L][B * T * C];                     /* x + attention */
  float ln2[L][B * T * C], mu2[L][B * T], rs2[L][B * T];
  float fch[L][B * T * 4 * C], gel[L][B * T * 4 * C];
  float res3[L][B * T * C];                     /* layer output */
  float lnf[B * T * C], muf[B * T], rsf[B * T];
  float probs[B * T * V];
} Acts;

/* y (n x o) = x (n x i) W^T (+ b), W (o x i). */
static void Linear(float* y, const float* x, const float* w, const float* b, int n, int i, int o) {
  for (int r = 0; r < n; ++r) {
    for (int c = 0; c < o; ++c) {
      float s = b != NULL ? b[c] : 0.0f;
      const float* wr = w + (int64_t)c * i;
      for (int k = 0; k < i; ++k) s += x[(int64_t)r * i + k] * wr[k];
      y[(int64_t)r * o + c] = s;
    }
  }
}

/* dx += dy W; dW += dy^T x; db += sum(dy). */
static void LinearBack(float* dx, float* dw, float* db, const float* dy, const float* x,
                       const float* w, int n, int i, int o) {
  for (int r = 0; r < n; ++r) {
    for (int c = 0; c < o; ++c) {
      const float d = dy[(int64_t)r * o + c];
      const float* wr = w + (int64_t)c * i;
      float* dwr = dw + (int64_t)c * i;
      for (int k = 0; k < i; ++k) {
        dx[(int64_t)r * i + k] += d * wr[k];
        dwr[k] += d * x[(int64_t)r * i + k];
      }
      if (db != NULL) db[c] += d;
    }
  }
}

static void Norm(float* y, float* mu, float* rs, const float* x, const float* g, const float* b) {
  for (int r = 0; r < B * T; ++r) {
    const float* xr = x + r * C;
    float m = 0, v = 0;
    for (int k = 0; k < C; ++k) m += xr[k];
    m /= C;
    for (int k = 0; k < C; ++k) v += (xr[k] - m) * (xr[k] - m);
    const float s = 1.0f / sqrtf(v / C + 1e-5f);
    for (int k = 0; k < C; ++k) y[r * C + k] = (xr[k] - m) * s * g[k] + b[k];
    mu[r] = m;
    rs[r] = s;
  }
}

static void NormBack(float* dx, float* dg, float* db, const float* dy, const float* x,
                     const float* g, const float* mu, const float* rs) {
  for (int r = 0; r < B * T; ++r) {
    const float* xr = x + r * C;
    const float* dyr = dy + r * C;
    float mean_d = 0, mean_dn = 0;
    for (int k = 0; k < C; ++k) {
      const float n = (xr[k] - mu[r]) * rs[r], d = g[k] * dyr[k];
      mean_d += d;
      mean_dn += d * n;
    }
    mean_d /= C;
    mean_dn /= C;
    for (int k = 0; k < C; ++k) {
      const float n = (xr[k] - mu[r]) * rs[r], d = g[k] * dyr[k];
      db[k] += dyr[k];
      dg[k] += n * dyr[k];
      dx[r * C + k] += (d - mean_d - n * mean_dn) * rs[r];
    }
  }
}

/* Causal self-attention over qkv (B, T, 3C) -> out (B, T, C); att keeps the softmax. */
static void Attention(float* out, float* att, const float* qkv) {
  const int hs = C / NH;
  const float scale = 1.0f / sqrtf((float)hs);
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < NH; ++h) {
      for (int t = 0; t < T; ++t) {
        const float* q = qkv + (b * T + t) * 3 * C + h * hs;
        float* a = att + ((b * NH + h) * T + t) * T;
        float mx = -1e30f, sum = 0;
        for (int u = 0; u <= t; ++u) {
          const float* k = qkv + (b * T + u) * 3 * C + C + h * hs;
          float s = 0;
          for (int i = 0; i < hs; ++i) s += q[i] * k[i];
          a[u] = s * scale;
          if (a[u] > mx) mx = a[u];
        }
        for (int u = 0; u <= t; ++u) sum += (a[u] = expf(a[u] - mx));
        for (int u = 0; u < T; ++u) a[u] = u <= t ? a[u] / sum : 0.0f;
        float* o = out + (b * T + t) * C + h * hs;
        for (int i = 0; i < hs; ++i) o[i] = 0;
        for (int u = 0; u <= t; ++u) {
          const float* v = qkv + (b * T + u) * 3 * C + 2 * C + h * hs;
          for (int i = 0; i < hs; ++i) o[i] += a[u] * v[i];
        }
      }
    }
  }
}

static void AttentionBack(float* dqkv, const float* dout, const float* qkv, const float* att) {
  const int hs = C / NH;
  const float scale = 1.0f / sqrtf((float)hs);
  float da[T], ds[T];
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < NH; ++h) {
      for (int t = 0; t < T; ++t) {
        const float* a = att + ((b * NH + h) * T + t) * T;
        const float* d = dout + (b * T + t) * C + h * hs;
        float dot = 0;
        for (int u = 0; u <= t; ++u) {
          const float* v = qkv + (b * T + u) * 3 * C + 2 * C + h * hs;
          float* dv = dqkv + (b * T + u) * 3 * C + 2 * C + h * hs;
          da[u] = 0;
          for (int i = 0; i < hs; ++i) {
            da[u] += d[i] * v[i];
            dv[i] += a[u] * d[i];
          }
          dot += da[u] * a[u];
        }
        for (int u = 0; u <= t; ++u) ds[u] = a[u] * (da[u] - dot) * scale;  /* softmax' */
        const float* q = qkv + (b * T + t) * 3 * C + h * hs;
        float* dq = dqkv + (b * T + t) * 3 * C + h * hs;
        for (int u = 0; u <= t; ++u) {
          const float* k = qkv + (b * T + u) * 3 * C + C + h * hs;
          float* dk = dqkv + (b * T + u) * 3 * C + C + h * hs;
          for (int i = 0; i < hs; ++i) {
            dq[i] += ds[u] * k[i];
            dk[i] += ds[u] * q[i];
          }
        }
      }
    }
  }
}

static const float kGelu = 0.7978845608f; /* sqrt(2 / pi) */
static void Gelu(float* y, const float* x, int n) {
  for (int i = 0; i < n; ++i) {
    y[i] = 0.5f * x[i] * (1.0f + tanhf(kGelu * (x[i] + 0.044715f * x[i] * x[i] * x[i])));
  }
}
static void GeluBack(float* dx, const float* dy, const float* x, int n) {
  for (int i = 0; i < n; ++i) {
    const float u = kGelu * (x[i] + 0.044715f * x[i] * x[i] * x[i]), th = tanhf(u);
    const float du = kGelu * (1.0f + 3 * 0.044715f * x[i] * x[i]);
    dx[i] += dy[i] * (0.5f * (1.0f + th) + 0.5f * x[i] * (1.0f - th * th) * du);
  }
}

/* Forward to the mean cross-entropy of `targets`. */
static float Forward(Acts* a, const Model* p, const int* tokens, const int* targets) {
  const int n = B * T;
  for (int r = 0; r < n; ++r) {
    for (int k = 0; k < C; ++k) {
      a->x0[r * C + k] = p->wte[(int64_t)tokens[r] * C + k] + p->wpe[(r % T) * C + k];
    }
  }
  const float* x = a->x0;
  for (int l = 0; l < L; ++l) {
    const Layer* w = &p->h[l];
    Norm(a->ln1[l], a->mu1[l], a->rs1[l], x, w->ln1w, w->ln1b);
    Linear(a->qkv[l], a->ln1[l], w->qkvw, w->qkvb, n, C, 3 * C);
    Attention(a->attout[l], a->att[l], a->qkv[l]);
    Linear(a->res2[l], a->attout[l], w->attprojw, w->attprojb, n, C, C);
    for (int i = 0; i < n * C; ++i) a->res2[l][i] += x[i];
    Norm(a->ln2[l], a->mu2[l], a->rs2[l], a->res2[l], w->ln2w, w->ln2b);
    Linear(a->fch[l], a->ln2[l], w->fcw, w->fcb, n, C, 4 * C);
    Gelu(a->gel[l], a->fch[l], n * 4 * C);
    Linear(a->res3[l], a->gel[l], w->fcprojw, w->fcprojb, n, 4 * C, C);
    for (int i = 0; i < n * C; ++i) a->res3[l][i] += a->res2[l][i];
    x = a->res3[l];
  }
  Norm(a->lnf, a->muf, a->rsf, x, p->lnfw, p->lnfb);
  Linear(a->probs, a->lnf, p->wte, NULL, n, C, V);  /* the head is tied to wte */
  float loss = 0;
  for (int r = 0; r < n; ++r) {
    float* z = a->probs + (int64_t)r * V;
    float mx = z[0], sum = 0;
    for (int v = 1; v < V; ++v) mx = z[v] > mx ? z[v] : mx;
    for (int v = 0; v < V; ++v) sum += (z[v] = expf(z[v] - mx));
    for (int v = 0; v < V; ++v) z[v] /= sum;
    loss -= logf(z[targets[r]]) / n;
  }
  return loss;
}

/* Backward into `g`, which holds zeros (gradients accumulate, as the head and the embedding
 * share wte). */
static void Backward(const Model* g, const Acts* a, const Model* p, const int* tokens,
                     const int* targets, float* scratch) {
  const int n = B * T;
  float* dz = scratch;                        /* (n, V) */
  float* dx = dz + (int64_t)n * V;            /* (n, C): the residual stream */
  float* dy = dx + n * C;                     /* (n, C) */
  float* d4 = dy + n * C;                     /* (n, 4C) */
  float* d4b = d4 + n * 4 * C;                /* (n, 4C) */
  float* d3 = d4b + n * 4 * C;                /* (n, 3C) */
  for (int r = 0; r < n; ++r) {
    for (int v = 0; v < V; ++v) {
      dz[(int64_t)r * V + v] = (a->probs[(int64_t)r * V + v] - (v == targets[r])) / n;
    }
  }
  memset(dy, 0, sizeof(float) * n * C);
  LinearBack(dy, g->wte, NULL, dz, a->lnf, p->wte, n, C, V);
  memset(dx, 0, sizeof(float) * n * C);
  NormBack(dx, g->lnfw, g->lnfb, dy, a->res3[L - 1], p->lnfw, a->muf, a->rsf);
  for (int l = L - 1; l >= 0; --l) {
    const Layer* w = &p->h[l];
    const Layer* gw = &g->h[l];
    const float* x = l == 0 ? a->x0 : a->res3[l - 1];
    /* res3 = res2 + fcproj(gelu(fc(ln2(res2)))): dx flows on, and into the MLP. */
    memset(d4, 0, sizeof(float) * n * 4 * C);
    LinearBack(d4, gw->fcprojw, gw->fcprojb, dx, a->gel[l], w->fcprojw, n, 4 * C, C);
    memset(d4b, 0, sizeof(float) * n * 4 * C);
    GeluBack(d4b, d4, a->fch[l], n * 4 * C);
    memset(dy, 0, sizeof(float) * n * C);
    LinearBack(dy, gw->fcw, gw->fcb, d4b, a->ln2[l], w->fcw, n, C, 4 * C);
    NormBack(dx, gw->ln2w, gw->ln2b, dy, a->res2[l], w->ln2w, a->mu2[l], a->rs2[l]);
    /* res2 = x + attproj(attention(qkv(ln1(x)))). */
    memset(dy, 0, sizeof(float) * n * C);
    LinearBack(dy, gw->attprojw, gw->attprojb, dx, a->attout[l], w->attprojw, n, C, C);
    memset(d3, 0, sizeof(float) * n * 3 * C);
    AttentionBack(d3, dy, a->qkv[l], a->att[l]);
    memset(dy, 0, sizeof(float) * n * C);
    LinearBack(dy, gw->qkvw, gw->qkvb, d3, a->ln1[l], w->qkvw, n, C, 3 * C);
    NormBack(dx, gw->ln1w, gw->ln1b, dy, x, w->ln1w, a->mu1[l], a->rs1[l]);
  }
  for (int r = 0; r < n; ++r) {
    for (int k = 0; k < C; ++k) {
      g->wte[(int64_t)tokens[r] * C + k] += dx[r * C + k];
      g->wpe[(r % T) * C + k] += dx[r * C + k];
    }
  }
}

/* ---- The engine's side ---- */

/* The registered parameters: the 16 tensors, or (per_layer) 52 with each stacked tensor's
 * slices in modules h[l]; param_tensor/param_layer say which slice each is. */
typedef struct {
  int n;
  zr_param_spec spec[2 + 12 * L + 2];
  int64_t shape[2 + 12 * L + 2][3];
  char name[2 + 12 * L + 2][32], module[2 + 12 * L + 2][16];
  int tensor[2 + 12 * L + 2], layer[2 + 12 * L + 2];
} Params;

/* The shape of one slice of tensor t (the whole tensor for the unstacked ones). */
static int SliceShape(int t, int64_t* s) {
  switch (t) {
    case WTE: s[0] = V, s[1] = C; return 2;
    case WPE: s[0] = MAXT, s[1] = C; return 2;
    case QKVW: s[0] = 3 * C, s[1] = C; return 2;
    case ATTPROJW: s[0] = C, s[1] = C; return 2;
    case FCW: s[0] = 4 * C, s[1] = C; return 2;
    case FCPROJW: s[0] = C, s[1] = 4 * C; return 2;
    case QKVB: s[0] = 3 * C; return 1;
    case FCB: s[0] = 4 * C; return 1;
    default: s[0] = C; return 1;
  }
}

/* `declared`: every gradient in trainer buffer "grads", at its place in grads_memory. */
static void MakeParams(Params* ps, int declared) {
  memset(ps, 0, sizeof *ps);
  int64_t offset = 0; /* of tensor t in grads_memory */
  for (int t = 0; t < NT; ++t) {
    const int slices = per_layer && Stacked(t) ? L : 1;
    for (int l = 0; l < slices; ++l) {
      const int i = ps->n++;
      zr_param_spec* s = &ps->spec[i];
      int64_t* shape = ps->shape[i];
      if (slices == 1 && Stacked(t)) {  /* registered whole: [L, ...] */
        shape[0] = L;
        s->ndim = 1 + SliceShape(t, shape + 1);
      } else {
        s->ndim = SliceShape(t, shape);
      }
      if (slices > 1) {
        snprintf(ps->name[i], sizeof ps->name[i], "h.%s[%d]", kNames[t], l);
        snprintf(ps->module[i], sizeof ps->module[i], "h[%d]", l);
      } else {
        snprintf(ps->name[i], sizeof ps->name[i], "%s", kNames[t]);
        snprintf(ps->module[i], sizeof ps->module[i], "%s", kNames[t]);
      }
      s->struct_size = sizeof *s;
      s->name = ps->name[i];
      s->shape = shape;
      s->module = ps->module[i];
      if (declared) {
        s->grad_buffer = "grads";
        s->grad_buffer_offset = offset + l * Slice(t);
      }
      ps->tensor[i] = t;
      ps->layer[i] = l;
    }
    offset += Numel(t);
  }
}

/* llm.c's initialisation in spirit: N(0, 0.02) weights (residual projections scaled by
 * 1/sqrt(2L)), unit LayerNorm gains, zero biases; the same values for every layout. */
static float Gauss(uint64_t k) {
  uint64_t x = k * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
  x ^= x >> 31, x *= 0xBF58476D1CE4E5B9ull, x ^= x >> 29;
  const double u1 = ((x >> 11) + 1.0) / 9007199254740994.0;
  x *= 0x94D049BB133111EBull, x ^= x >> 32;
  const double u2 = (x >> 11) / 9007199254740992.0;
  return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

static void Init(void* user, int index, const char* name, int ndim, const int64_t* shape,
                 int64_t numel, float* values) {
  const Params* ps = (const Params*)user;
  const int t = ps->tensor[index];
  const int64_t first = (int64_t)ps->layer[index] * Slice(t); /* within the stacked tensor */
  (void)name, (void)ndim, (void)shape;
  for (int64_t k = 0; k < numel; ++k) {
    float v = 0;
    if (t == LN1W || t == LN2W || t == LNFW) v = 1;
    if (t == WTE || t == WPE || t == QKVW || t == FCW) {
      v = 0.02f * Gauss(((uint64_t)t << 40) + first + k);
    }
    if (t == ATTPROJW || t == FCPROJW) {
      v = 0.02f / sqrtf(2.0f * L) * Gauss(((uint64_t)t << 40) + first + k);
    }
    values[k] = v;
  }
}

typedef struct {
  Params* ps;
  float** param;  /* per registered parameter */
  float* base[NT];
} Where;

static float* ParamAt(void* ctx, int t, int l) {
  const Where* w = (const Where*)ctx;
  for (int i = 0; i < w->ps->n; ++i) {
    if (w->ps->tensor[i] != t) continue;
    if (w->ps->layer[i] == l) return w->param[i];
    if (w->ps->layer[i] == 0 && !per_layer) return w->param[i] + l * Slice(t);
  }
  return NULL;
}
static float* GradAt(void* ctx, int t, int l) { return ((Where*)ctx)->base[t] + l * Slice(t); }

/* Synthetic text, one fixed batch per rank: sequences that follow a rule, so the loss falls. */
static void Batch(int rank, int* tokens, int* targets) {
  for (int b = 0; b < B; ++b) {
    int tok = (97 * (rank * B + b)) % 512;
    for (int t = 0; t < T; ++t) {
      tokens[b * T + t] = tok;
      tok = (tok * 5 + 3) % 512;
      targets[b * T + t] = tok;
    }
  }
}

typedef struct {
  int in_place;               /* tensors whose unit is reduced straight from grads_memory */
  zr_memory_report report;
  float first_loss, last_loss;
  float* master;
} Result;

#define TRY(call)                                                                        \
  do {                                                                                   \
    zr_status s_ = (call);                                                               \
    if (s_ != ZR_OK) {                                                                   \
      fprintf(stderr, "%s: %s: %s\n", #call, zr_status_name(s_), zr_last_error());      \
      return 0;                                                                          \
    }                                                                                    \
  } while (0)

static int Train(Rank* r, int declared, Result* out, Acts* acts, float* scratch) {
  const int rank = zr_comm_rank(r->comm);
  char config[256];
  snprintf(config, sizeof config,
           "{\"zero_optimization\": {\"stage\": %d}, \"fp32\": {\"enabled\": true},"
           " \"optimizer\": {\"type\": \"AdamW\","
           " \"params\": {\"lr\": 0.001, \"weight_decay\": 0}},"
           " \"comm_timeout_ms\": 120000}", stage);
  Params* ps = (Params*)malloc(sizeof *ps);
  MakeParams(ps, declared);
  int64_t total = 0;
  for (int t = 0; t < NT; ++t) total += Numel(t);
  float* grads_memory = (float*)calloc((size_t)total, sizeof(float));
  float* param[2 + 12 * L + 2];
  Where where = {ps, param, {0}};
  where.base[0] = grads_memory;
  for (int t = 1; t < NT; ++t) where.base[t] = where.base[t - 1] + Numel(t - 1);
  zr_engine* e = NULL;
  TRY(zr_engine_create(config, ps->spec, ps->n, r->comm, r->device, NULL, &e));
  TRY(zr_engine_init_params(e, Init, ps, 1));
  /* Hand every gradient over: parameter i's place in grads_memory. */
  memset(out, 0, sizeof *out);
  for (int i = 0; i < ps->n; ++i) {
    int direct = 0;
    TRY(zr_engine_set_grad_buffer(e, i, GradAt(&where, ps->tensor[i], ps->layer[i]), &direct));
    out->in_place += direct;
  }
  Model p, g;
  Bind(&g, GradAt, &where);
  int tokens[B * T], targets[B * T];
  Batch(rank, tokens, targets);
  /* Backward order, as the plan lists units (the last registered first): each unit's
   * gradients complete together, so at most one unit is open at a time. */
  int order[2 + 12 * L + 2], n_order = 0, unit = 0;
  for (int u = 0; n_order < ps->n; ++u) {
    for (int i = ps->n - 1; i >= 0; --i) {
      TRY(zr_engine_unit_of(e, i, &unit));
      if (unit == u) order[n_order++] = i;
    }
  }
  for (int step = 0; step < steps; ++step) {
    for (int i = 0; i < ps->n; ++i) {
      void* q = NULL;
      TRY(zr_engine_param(e, i, &q));  /* stable in stages 0-2; read again all the same */
      param[i] = (float*)q;
    }
    Bind(&p, ParamAt, &where);
    const float loss = Forward(acts, &p, tokens, targets);
    memset(grads_memory, 0, (size_t)total * sizeof(float));  /* llm.c's zero_grad */
    Backward(&g, acts, &p, tokens, targets, scratch);
    for (int k = 0; k < ps->n; ++k) TRY(zr_engine_grad_ready(e, order[k]));
    zr_step_stats stats = {.struct_size = sizeof stats};
    TRY(zr_engine_step(e, &stats));
    double mean = loss;
    TRY(zr_engine_allreduce_scalars(e, &mean, 1, ZR_REDUCE_AVG));
    if (step == 0) out->first_loss = (float)mean;
    out->last_loss = (float)mean;
  }
  out->report.struct_size = sizeof out->report;
  TRY(zr_engine_memory_report(e, &out->report));
  out->master = (float*)malloc((size_t)total * sizeof(float));
  TRY(zr_engine_gather_master_weights(e, out->master, total));
  if (declared && rank == 0) {  /* what the plan copies, and why: once per unit */
    for (int i = 0; i < ps->n; ++i) {
      const char* why = NULL;
      int unit = 0, first = 1, count = 0;
      TRY(zr_engine_grad_copy_reason(e, i, &why));
      TRY(zr_engine_unit_of(e, i, &unit));
      for (int j = 0; j < ps->n; ++j) {
        int other = 0;
        TRY(zr_engine_unit_of(e, j, &other));
        if (other != unit) continue;
        first = first && j >= i;
        ++count;
      }
      if (why[0] != '\0' && first) {
        printf("    copied: the unit of %s (%d tensor%s): %s\n", ps->name[i], count,
               count > 1 ? "s" : "", why);
      }
    }
  }
  zr_engine_destroy(e);
  free(grads_memory);
  free(ps);
  return 1;
}

static void* RunRank(void* arg) {
  Rank* r = (Rank*)arg;
  const int rank = zr_comm_rank(r->comm);
  Acts* acts = (Acts*)malloc(sizeof(Acts));
  const int64_t n = B * T;
  /* Backward's scratch: dlogits (n, V), then (n, C) x 2, (n, 4C) x 2, (n, 3C). */
  float* scratch = (float*)malloc(sizeof(float) * (size_t)(n * V + 13 * n * C));
  Result run[2];
  int ok = Train(r, 0, &run[0], acts, scratch) && Train(r, 1, &run[1], acts, scratch);
  if (ok) {
    int64_t total = 0;
    for (int t = 0; t < NT; ++t) total += Numel(t);
    const int equal = memcmp(run[0].master, run[1].master, (size_t)total * sizeof(float)) == 0;
    const char* what[2] = {"handed over after create", "declared before the plan"};
    const int tensors = per_layer ? 2 + 12 * L + 2 : NT;
    for (int k = 0; k < 2; ++k) {
      const zr_memory_report* m = &run[k].report;
      printf("llmc rank %d, %s: %d of %d tensors reduced in place; the engine's gradient memory "
             "%lld bytes; declared %lld bytes, %lld in place, %lld copied; loss %.4f -> %.4f\n",
             rank, what[k], run[k].in_place, tensors, (long long)m->engine_grad_bytes,
             (long long)m->trainer_grad_bytes, (long long)m->trainer_grad_in_place_bytes,
             (long long)m->trainer_grad_copied_bytes, run[k].first_loss, run[k].last_loss);
    }
    printf("llmc rank %d: fp32 masters of the two runs %s\n", rank,
           equal ? "bitwise equal" : "DIFFER");
    ok = equal && run[1].in_place >= run[0].in_place &&
         run[1].report.engine_grad_bytes < run[0].report.engine_grad_bytes &&
         run[1].report.trainer_grad_bytes == total * 4 &&
         run[1].last_loss < run[1].first_loss;
    /* Whatever the layout and stage here, the embedding is reduced in place once declared. */
    ok = ok && run[1].report.trainer_grad_in_place_bytes >= (int64_t)V * C * 4;
    free(run[0].master);
    free(run[1].master);
  }
  free(scratch);
  free(acts);
  r->ok = ok;
  return NULL;
}

static int RunInProcess(void) {
  zr_comm* comms[WORLD];
  zr_device* device = NULL;
  if (zr_comm_group_create(WORLD, 0, comms) != ZR_OK ||
      zr_cpu_device_create(1, &device) != ZR_OK) {
    fprintf(stderr, "setup: %s\n", zr_last_error());
    return 0;
  }
  Rank ranks[WORLD];
  pthread_t threads[WORLD];
  for (int i = 0; i < WORLD; ++i) {
    memset(&ranks[i], 0, sizeof ranks[i]);
    ranks[i].comm = comms[i];
    ranks[i].device = device;
    pthread_create(&threads[i], NULL, RunRank, &ranks[i]);
  }
  int ok = 1;
  for (int i = 0; i < WORLD; ++i) {
    pthread_join(threads[i], NULL);
    ok = ok && ranks[i].ok;
    zr_comm_destroy(comms[i]);
  }
  zr_device_destroy(device);
  return ok;
}

static int RunMpi(void) {
  Rank rank;
  memset(&rank, 0, sizeof rank);
  if (zr_mpi_init() != ZR_OK || zr_mpi_comm_create(NULL, 0, &rank.comm) != ZR_OK ||
      zr_cpu_device_create(1, &rank.device) != ZR_OK) {
    fprintf(stderr, "MPI setup: %s\n", zr_last_error());
    return 0;
  }
  RunRank(&rank);
  zr_comm_destroy(rank.comm);
  zr_device_destroy(rank.device);
  zr_mpi_finalize();
  return rank.ok;
}

int main(int argc, char** argv) {
  for (int a = 1; a + 1 < argc; a += 2) {
    if (strcmp(argv[a], "--stage") == 0) {
      stage = atoi(argv[a + 1]);
    } else if (strcmp(argv[a], "--layout") == 0) {
      per_layer = strcmp(argv[a + 1], "layers") == 0;
    } else if (strcmp(argv[a], "--steps") == 0) {
      steps = atoi(argv[a + 1]);
    }
  }
  if (stage < 0 || stage > 2 || steps < 2) {
    fprintf(stderr,
            "usage: llmc_trainer [--stage 0|1|2] [--layout tensors|layers] [--steps N>=2]\n");
    return 2;
  }
  zr_launch_info launch = {.struct_size = sizeof launch};
  const int mpi = zr_launch_info_from_env(&launch) == ZR_OK &&
                  strcmp(launch.source, "openmpi") == 0;
  printf("llm.c GPT-2 (L=%d C=%d V=%d), stage %d, %s layout, %s\n", L, C, V, stage,
         per_layer ? "per-layer" : "per-tensor", mpi ? "mpirun" : "2 in-process ranks");
  const int ok = mpi ? RunMpi() : RunInProcess();
  printf("llmc_trainer: %s\n", ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}
