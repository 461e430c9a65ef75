#include "examples/gpt/internal/cuda_model.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <glob.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/cuda_status.h"
#include "base/status.h"
#include "examples/gpt/internal/gpt_kernels.h"
#include "examples/gpt/internal/gpt_math.h"
#include "examples/gpt/internal/model.h"

namespace zerort {
namespace examples {
namespace gpt {
namespace internal {
namespace {

namespace k = kernels;

absl::Status LaunchError(int error, const char* call) {
  const cudaError_t e = static_cast<cudaError_t>(error);
  return absl::Status(CudaErrorCode(e),
                      absl::StrCat("GPT CUDA kernel launch ", call, ": ", cudaGetErrorString(e)));
}

// Every launcher returns the cudaGetLastError() seen right after its launch.
#define RETURN_IF_LAUNCH_ERROR(call)                      \
  do {                                                    \
    const int zerort_launch_err_ = (call);                \
    if (zerort_launch_err_ != 0) return LaunchError(zerort_launch_err_, #call); \
  } while (false)

// cuBLAS is loaded at run time rather than linked: its libraries (libcublas 54 MB, libcublasLt
// 540 MB) could not travel in the GPU bundle (tools/gpu_bundle.sh, at most 32 MiB), and a
// machine with a GPU has them already (the CUDA toolkit, or PyTorch's nvidia-cublas wheel).
// Searched in order: $ZERORT_CUBLAS_DIR, the loader's paths, /usr/local/cuda/lib64, then the
// wheels of /opt/torch/.venv and /usr/local/lib/python3*.
struct CublasApi {
  decltype(&cublasCreate_v2) create;
  decltype(&cublasDestroy_v2) destroy;
  decltype(&cublasSetStream_v2) set_stream;
  // The int-sized overloads (the headers add 64-bit ones in C++).
  cublasStatus_t (*gemm)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                         const void*, const void*, cudaDataType, int, const void*, cudaDataType,
                         int, const void*, void*, cudaDataType, int, cublasComputeType_t,
                         cublasGemmAlgo_t);
  cublasStatus_t (*gemm_batched)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int,
                                 int, const void*, const void*, cudaDataType, int, long long,
                                 const void*, cudaDataType, int, long long, const void*, void*,
                                 cudaDataType, int, long long, int, cublasComputeType_t,
                                 cublasGemmAlgo_t);
  decltype(&cublasGetStatusString) status_string;
};

constexpr char kCublasSo[] = "libcublas.so.13";

absl::StatusOr<const CublasApi*> LoadCublas() {
  static const absl::StatusOr<CublasApi>* const api = [] {
    std::vector<std::string> tries;
    if (const char* dir = std::getenv("ZERORT_CUBLAS_DIR")) {
      tries.push_back(absl::StrCat(dir, "/", kCublasSo));
    }
    tries.push_back(kCublasSo);
    tries.push_back(absl::StrCat("/usr/local/cuda/lib64/", kCublasSo));
    for (const char* pattern :
         {"/opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib/libcublas.so.13",
          "/opt/torch/.venv/lib/python3*/site-packages/nvidia/cublas/lib/libcublas.so.13",
          "/usr/local/lib/python3*/dist-packages/nvidia/cu13/lib/libcublas.so.13",
          "/usr/local/lib/python3*/dist-packages/nvidia/cublas/lib/libcublas.so.13"}) {
      glob_t g;
      if (glob(pattern, 0, nullptr, &g) == 0) {
        for (size_t k = 0; k < g.gl_pathc; ++k) tries.push_back(g.gl_pathv[k]);
      }
      globfree(&g);
    }
    void* lib = nullptr;
    std::string errors;
    for (const std::string& path : tries) {
      lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (lib != nullptr) break;
      const char* e = dlerror();
      absl::StrAppend(&errors, "; ", e != nullptr ? e : path);
    }
    if (lib == nullptr) {
      return new absl::StatusOr<CublasApi>(absl::FailedPreconditionError(absl::StrCat(
          "cuBLAS (", kCublasSo, ") not found; set ZERORT_CUBLAS_DIR", errors)));
    }
    CublasApi a;
    bool ok = true;
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      ok = ok && fn != nullptr;
    };
    sym(a.create, "cublasCreate_v2");
    sym(a.destroy, "cublasDestroy_v2");
    sym(a.set_stream, "cublasSetStream_v2");
    sym(a.gemm, "cublasGemmEx");
    sym(a.gemm_batched, "cublasGemmStridedBatchedEx");
    sym(a.status_string, "cublasGetStatusString");
    if (!ok) {
      return new absl::StatusOr<CublasApi>(absl::FailedPreconditionError(
          absl::StrCat(kCublasSo, " lacks a function the GPT needs (cuBLAS 13 expected)")));
    }
    return new absl::StatusOr<CublasApi>(a);
  }();
  if (!api->ok()) return api->status();
  return &api->value();
}

absl::Status CublasError(cublasStatus_t s, const char* what, int m, int n, int k, int batch) {
  absl::StatusCode code = absl::StatusCode::kInternal;
  if (s == CUBLAS_STATUS_ALLOC_FAILED) code = absl::StatusCode::kResourceExhausted;
  if (s == CUBLAS_STATUS_NOT_INITIALIZED) code = absl::StatusCode::kFailedPrecondition;
  if (s == CUBLAS_STATUS_INVALID_VALUE || s == CUBLAS_STATUS_NOT_SUPPORTED) {
    code = absl::StatusCode::kInvalidArgument;
  }
  const absl::StatusOr<const CublasApi*> api = LoadCublas();
  return absl::Status(code, absl::StrCat("cuBLAS ", what, " (m ", m, ", n ", n, ", k ", k,
                                          ", batch ", batch, "): ",
                                          api.ok() ? (*api)->status_string(s) : "", " (", s, ")"));
}

cudaDataType CudaType(DType d) {
  switch (d) {
    case DType::kF32:
      return CUDA_R_32F;
    case DType::kBF16:
      return CUDA_R_16BF;
    case DType::kF16:
      return CUDA_R_16F;
  }
  return CUDA_R_32F;
}

cublasOperation_t Op(bool transpose) { return transpose ? CUBLAS_OP_T : CUBLAS_OP_N; }

// cuBLAS is column-major: a row-major (r, c) matrix is its (c, r) transpose to cuBLAS. Each
// helper below states the row-major product it computes. Inputs in `ab`, the output in `c`,
// fp32 accumulation (CUBLAS_COMPUTE_32F: no TF32 in the fp32 path).
struct Blas {
  const CublasApi& api;
  cublasHandle_t handle;
  DType ab;  // the compute dtype

  absl::Status Gemm(const char* what, bool ta, bool tb, int m, int n, int kk, const void* a,
                    int lda, const void* b, int ldb, void* c, DType c_type, int ldc) const {
    const float alpha = 1.0f, beta = 0.0f;
    const cublasStatus_t s =
        api.gemm(handle, Op(ta), Op(tb), m, n, kk, &alpha, a, CudaType(ab), lda, b,
                     CudaType(ab), ldb, &beta, c, CudaType(c_type), ldc, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS) return CublasError(s, what, m, n, kk, 1);
    return absl::OkStatus();
  }

  absl::Status Batched(const char* what, bool ta, bool tb, int m, int n, int kk, const void* a,
                       int lda, int64_t stride_a, const void* b, int ldb, int64_t stride_b,
                       float* c, int ldc, int64_t stride_c, int batch) const {
    const float alpha = 1.0f, beta = 0.0f;
    const cublasStatus_t s = api.gemm_batched(
        handle, Op(ta), Op(tb), m, n, kk, &alpha, a, CudaType(ab), lda, stride_a, b,
        CudaType(ab), ldb, stride_b, &beta, c, CUDA_R_32F, ldc, stride_c, batch,
        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS) return CublasError(s, what, m, n, kk, batch);
    return absl::OkStatus();
  }

  // y (n, out) fp32 = x (n, in) * w (in, out).
  absl::Status Linear(const void* x, const void* w, int64_t n, int in, int out, float* y) const {
    return Gemm("linear forward", false, false, out, static_cast<int>(n), in, w, out, x, in, y,
                DType::kF32, out);
  }
  // dx (n, in) fp32 = dy (n, out) * w^T.
  absl::Status LinearDx(const void* dy, const void* w, int64_t n, int in, int out,
                        float* dx) const {
    return Gemm("linear backward (input)", true, false, in, static_cast<int>(n), out, w, out, dy,
                out, dx, DType::kF32, in);
  }
  // dw (in, out) in the compute dtype = x^T (in, n) * dy (n, out).
  absl::Status LinearDw(const void* x, const void* dy, int64_t n, int in, int out,
                        void* dw) const {
    return Gemm("linear backward (weight)", false, true, out, in, static_cast<int>(n), dy, out, x,
                in, dw, ab, out);
  }
};

// Carves one allocation into 256-byte aligned buffers; with a null base it only counts.
class Carver {
 public:
  Carver(char* base, size_t elem) : base_(base), elem_(elem) {}
  float* F32(int64_t n) { return static_cast<float*>(Take(n * 4)); }
  int32_t* I32(int64_t n) { return static_cast<int32_t*>(Take(n * 4)); }
  void* T(int64_t n) { return Take(n * static_cast<int64_t>(elem_)); }
  int64_t bytes() const { return offset_; }

 private:
  void* Take(int64_t bytes) {
    offset_ = (offset_ + 255) / 256 * 256;
    void* p = base_ == nullptr ? nullptr : base_ + offset_;
    offset_ += std::max<int64_t>(bytes, 1);
    return p;
  }
  char* base_;
  size_t elem_;
  int64_t offset_ = 0;
};

// What backward needs of one block's forward (N = batch * seq rows, T = compute dtype).
struct LayerActs {
  float* x;                      // (N, d) the block's input
  void* ln1;                     // (N, d) T
  float *mean1, *rstd1;          // (N)
  void *q, *k, *v;               // (batch, heads, seq, hs) T each, bias included
  float* att;                    // (batch * heads, seq, seq) probabilities
  void* att_t;                   // the same in T (unused in fp32: att is the operand)
  void* atty;                    // (N, d) T attention output, heads concatenated
  float* x2;                     // (N, d) residual after attention
  void* ln2;                     // (N, d) T
  float *mean2, *rstd2;          // (N)
  float* fc;                     // (N, 4d) before the GELU, bias included
  void* gelu;                    // (N, 4d) T
};

}  // namespace

struct CudaPass::Buffers {
  // The layout's key: a pass of another key re-carves.
  int batch = 0, seq = 0;
  DType dtype = DType::kF32;
  bool backward = false;

  int32_t *tokens, *targets;     // (N) inputs and targets
  int32_t *uniq, *starts, *rows; // the token -> rows table: (N), (N + 1), (N)
  std::vector<LayerActs> layers; // `layers` of them with backward, else one reused
  float* xout;                   // (N, d) the last block's output (backward only)
  void* lnf;                     // (N, d) T final LayerNorm
  float *meanf, *rstdf;          // (N)
  float* logits;                 // (N, vocab)
  void* dlogits;                 // (N, vocab) T
  float* losses;                 // (N) per token
  float* g4;                     // (N, 4d) matrix-product outputs (qkv, projections, dgelu, dqkv)
  float* preatt;                 // (batch * heads, seq, seq) scores; in backward d(att)
  float* yacc;                   // (batch * heads, seq, hs) att * v; in backward dq
  // backward only
  float* dres;                   // (N, d) gradient of the residual stream
  void* dres_t;                  // its copy in T (not in fp32)
  float* dwte;                   // (vocab, d) both uses of the tied embedding
  float* g4b;                    // (N, 4d) dfc
  void* g4_t;                    // (N, 4d) T copy of dfc or dqkv (not in fp32)
  float* dln;                    // (N, d) LayerNorm input gradients; d(atty)
  void* dpre;                    // (batch * heads, seq, seq) T pre-softmax gradient
  void* heads_t;                 // (batch * heads, seq, hs) T d(att * v)
  float *dk, *dv;                // (batch * heads, seq, hs)
  float *partials_w, *partials_b;  // (ColumnChunks(N), 4d) column-sum partials
};

namespace {

// `blocks_bytes`, when not null, receives the bytes the blocks' LayerActs span.
void LayoutBuffers(const GptShape& s, Carver& c, int batch, int seq, bool fp32, bool backward,
                   CudaPass::Buffers& b, int64_t* blocks_bytes = nullptr);

}  // namespace

CudaPass::ActivationLayout CudaPass::TrainingLayout(const GptShape& shape, int batch, int seq,
                                                    DType dtype) {
  Buffers b;
  Carver count(nullptr, DTypeSize(dtype));
  ActivationLayout layout;
  LayoutBuffers(shape, count, batch, seq, dtype == DType::kF32, /*backward=*/true, b,
                &layout.blocks_bytes);
  layout.other_bytes = count.bytes() - layout.blocks_bytes;
  return layout;
}

CudaPass::CudaPass(const GptShape& shape, int device_ordinal)
    : shape_(shape), device_(device_ordinal) {}

absl::StatusOr<std::unique_ptr<CudaPass>> CudaPass::Create(const GptShape& shape,
                                                           int device_ordinal) {
  std::unique_ptr<CudaPass> pass(new CudaPass(shape, device_ordinal));
  RETURN_IF_CUDA_ERROR(cudaSetDevice(device_ordinal), "(GPT CUDA pass on device ",
                       device_ordinal, ")");
  cudaStream_t stream = nullptr;
  RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  pass->stream_ = stream;
  ASSIGN_OR_RETURN(const CublasApi* api, LoadCublas());
  cublasHandle_t handle = nullptr;
  const cublasStatus_t s = api->create(&handle);
  if (s != CUBLAS_STATUS_SUCCESS) return CublasError(s, "cublasCreate", 0, 0, 0, 0);
  pass->cublas_ = handle;
  const cublasStatus_t set = api->set_stream(handle, stream);
  if (set != CUBLAS_STATUS_SUCCESS) return CublasError(set, "cublasSetStream", 0, 0, 0, 0);
  pass->buffers_ = std::make_unique<Buffers>();
  return pass;
}

CudaPass::~CudaPass() {
  cudaSetDevice(device_);
  if (stream_ != nullptr) cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
  if (cublas_ != nullptr) {
    const absl::StatusOr<const CublasApi*> api = LoadCublas();  // loaded: cublas_ exists
    if (api.ok()) (*api)->destroy(static_cast<cublasHandle_t>(cublas_));
  }
  if (memory_ != nullptr) cudaFree(memory_);
  if (stream_ != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

absl::Status CudaPass::Reserve(const TokenBatch& batch, DType dtype, bool backward) {
  Buffers& b = *buffers_;
  if (memory_ != nullptr && b.batch == batch.batch && b.seq == batch.seq && b.dtype == dtype &&
      b.backward == backward) {
    return absl::OkStatus();
  }
  const bool fp32 = dtype == DType::kF32;
  b.batch = 0;  // no valid layout until the carve below succeeds
  Carver count(nullptr, DTypeSize(dtype));
  LayoutBuffers(shape_, count, batch.batch, batch.seq, fp32, backward, b);
  if (count.bytes() > capacity_) {
    // Earlier passes on this stream may still read the old buffers.
    RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)));
    if (memory_ != nullptr) RETURN_IF_CUDA_ERROR(cudaFree(memory_));
    memory_ = nullptr;
    capacity_ = 0;
    RETURN_IF_CUDA_ERROR(cudaMalloc(&memory_, count.bytes()), "(GPT activations of ",
                         count.bytes(), " bytes for ", batch.batch, " sequences of ", batch.seq,
                         " tokens)");
    capacity_ = count.bytes();
  }
  Carver carve(static_cast<char*>(memory_), DTypeSize(dtype));
  LayoutBuffers(shape_, carve, batch.batch, batch.seq, fp32, backward, b);
  b.batch = batch.batch;
  b.seq = batch.seq;
  b.dtype = dtype;
  b.backward = backward;
  return absl::OkStatus();
}

namespace {

void LayoutBuffers(const GptShape& s, Carver& c, int batch, int seq, bool fp32, bool backward,
                   CudaPass::Buffers& b, int64_t* blocks_bytes) {
  const int64_t n = static_cast<int64_t>(batch) * seq, d = s.d_model, vocab = s.vocab;
  const int64_t scores = static_cast<int64_t>(batch) * s.heads * seq * seq;
  // A T copy that fp32 mode does without (its fp32 twin is the operand there).
  auto t_copy = [&](int64_t count) { return fp32 ? nullptr : c.T(count); };
  b.tokens = c.I32(n);
  b.targets = c.I32(n);
  b.uniq = c.I32(n);
  b.starts = c.I32(n + 1);
  b.rows = c.I32(n);
  b.layers.assign(backward ? s.layers : 1, LayerActs{});
  const int64_t blocks_start = c.bytes();
  for (LayerActs& a : b.layers) {
    a.x = c.F32(n * d);
    a.ln1 = c.T(n * d);
    a.mean1 = c.F32(n);
    a.rstd1 = c.F32(n);
    a.q = c.T(n * d);
    a.k = c.T(n * d);
    a.v = c.T(n * d);
    a.att = c.F32(scores);
    a.att_t = t_copy(scores);
    a.atty = c.T(n * d);
    a.x2 = c.F32(n * d);
    a.ln2 = c.T(n * d);
    a.mean2 = c.F32(n);
    a.rstd2 = c.F32(n);
    a.fc = c.F32(n * 4 * d);
    a.gelu = c.T(n * 4 * d);
  }
  if (blocks_bytes != nullptr) *blocks_bytes = c.bytes() - blocks_start;
  b.xout = backward ? c.F32(n * d) : nullptr;
  b.lnf = c.T(n * d);
  b.meanf = c.F32(n);
  b.rstdf = c.F32(n);
  b.logits = c.F32(n * vocab);
  b.dlogits = backward ? c.T(n * vocab) : nullptr;
  b.losses = c.F32(n);
  b.g4 = c.F32(n * 4 * d);
  b.preatt = c.F32(scores);
  b.yacc = c.F32(n * d);
  if (!backward) {
    b.dres = b.g4b = b.dln = b.dk = b.dv = b.partials_w = b.partials_b = b.dwte = nullptr;
    b.dres_t = b.g4_t = b.dpre = b.heads_t = nullptr;
    return;
  }
  b.dres = c.F32(n * d);
  b.dres_t = t_copy(n * d);
  b.dwte = c.F32(vocab * d);
  b.g4b = c.F32(n * 4 * d);
  b.g4_t = t_copy(n * 4 * d);
  b.dln = c.F32(n * d);
  b.dpre = c.T(scores);
  b.heads_t = c.T(n * d);
  b.dk = c.F32(n * d);
  b.dv = c.F32(n * d);
  b.partials_w = c.F32(k::ColumnChunks(n) * 4 * d);
  b.partials_b = c.F32(k::ColumnChunks(n) * 4 * d);
}

// One pass over one batch: model.cc's Pass, on the GPU.
class Pass {
 public:
  Pass(const GptShape& shape, DeviceParamAccess& access, const TokenBatch& batch,
       CudaPass::Buffers& b, const CublasApi& api, cublasHandle_t handle, cudaStream_t stream)
      : s_(shape), access_(access), batch_(batch), b_(b), dt_(access.dtype()),
        fp32_(dt_ == DType::kF32), blas_{api, handle, dt_}, stream_(stream),
        n_(static_cast<int64_t>(batch.batch) * batch.seq), d_(shape.d_model),
        hs_(shape.d_model / shape.heads), bh_(batch.batch * shape.heads),
        scale_(math::AttentionScale(shape.d_model / shape.heads)) {}

  absl::StatusOr<std::vector<float>> Run(float grad_scale);

 private:
  // The T view of a tensor that has an fp32 twin: the twin itself in fp32 mode.
  const void* AsT(const float* f32, const void* t) const { return fp32_ ? f32 : t; }
  void* CopyT(void* t) const { return fp32_ ? nullptr : t; }
  const void* W(int layer, int p) { return access_.Get(BlockParamIndex(layer, p)); }
  std::vector<int> BlockParams(int layer, bool forward) const;
  absl::Status Upload(const std::vector<int32_t>& host, int32_t* device);
  absl::Status Embed();
  absl::Status BlockForward(int layer, LayerActs& a, float* out);
  absl::Status HeadForward(float grad_scale, const float* x);
  absl::Status HeadBackward(const float* x);
  absl::Status BlockBackward(int layer, const LayerActs& a);
  absl::Status EmbedBackward();
  // Column sums of a (n_, cols) into parameter i's gradient, then Ready(i).
  absl::Status BiasGrad(int i, const float* a, int cols);
  // LayerNorm's weight and bias gradients (bias first: reverse registration order).
  absl::Status LayerNormParamGrads(int w_index, const float* dy, const float* x,
                                   const float* mean, const float* rstd);
  absl::Status WeightGrad(int i, const void* x, const void* dy, int in, int out);
  void* stream() const { return stream_; }

  const GptShape& s_;
  DeviceParamAccess& access_;
  const TokenBatch& batch_;
  CudaPass::Buffers& b_;
  const DType dt_;
  const bool fp32_;
  const Blas blas_;
  cudaStream_t stream_;
  const int64_t n_;
  const int d_, hs_, bh_;
  const float scale_;
  int num_tokens_ = 0;  // distinct input tokens (rows of the CSR table)
};

std::vector<int> Pass::BlockParams(int layer, bool forward) const {
  std::vector<int> params;
  for (int p = 0; p < kParamsPerBlock; ++p) params.push_back(BlockParamIndex(layer, p));
  if (!forward) std::reverse(params.begin(), params.end());
  return params;
}

absl::Status Pass::Upload(const std::vector<int32_t>& host, int32_t* device) {
  // From pageable memory: the call returns once `host` has been staged, so it may go away.
  RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(device, host.data(), host.size() * sizeof(int32_t),
                                       cudaMemcpyHostToDevice, stream_));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> Pass::Run(float grad_scale) {
  const bool backward = grad_scale != 0;
  const int seq = batch_.seq;
  std::vector<int32_t> inputs(n_), targets(n_);
  for (int64_t r = 0; r < n_; ++r) {
    const int64_t base = r / seq * (seq + 1) + r % seq;
    inputs[r] = batch_.tokens[base];
    targets[r] = batch_.tokens[base + 1];
  }
  RETURN_IF_ERROR(Upload(inputs, b_.tokens));
  RETURN_IF_ERROR(Upload(targets, b_.targets));
  if (backward) {
    // Rows of each distinct token in ascending order (a counting sort), so that the tied
    // embedding's input-side gradient sums each token's rows in row order without atomics.
    std::vector<int32_t> first(s_.vocab + 1, 0);
    for (int32_t t : inputs) ++first[t + 1];
    for (int v = 0; v < s_.vocab; ++v) first[v + 1] += first[v];
    std::vector<int32_t> rows(n_), uniq, starts;
    std::vector<int32_t> next(first.begin(), first.end() - 1);
    for (int64_t r = 0; r < n_; ++r) rows[next[inputs[r]]++] = static_cast<int32_t>(r);
    for (int v = 0; v < s_.vocab; ++v) {
      if (first[v + 1] == first[v]) continue;
      uniq.push_back(v);
      starts.push_back(first[v]);
    }
    starts.push_back(static_cast<int32_t>(n_));
    num_tokens_ = static_cast<int>(uniq.size());
    RETURN_IF_ERROR(Upload(rows, b_.rows));
    RETURN_IF_ERROR(Upload(uniq, b_.uniq));
    RETURN_IF_ERROR(Upload(starts, b_.starts));
  }

  RETURN_IF_ERROR(Embed());
  for (int l = 0; l < s_.layers; ++l) {
    LayerActs& a = b_.layers[backward ? l : 0];
    // Forward only: one set of buffers, the block's output over its input.
    float* out = !backward ? a.x : l + 1 < s_.layers ? b_.layers[l + 1].x : b_.xout;
    RETURN_IF_ERROR(BlockForward(l, a, out));
  }
  const float* x = backward ? b_.xout : b_.layers[0].x;
  RETURN_IF_ERROR(HeadForward(grad_scale, x));
  if (!backward) {
    RETURN_IF_ERROR(access_.Fetch({}));
  } else {
    RETURN_IF_ERROR(HeadBackward(x));
    for (int l = s_.layers - 1; l >= 0; --l) RETURN_IF_ERROR(BlockBackward(l, b_.layers[l]));
    RETURN_IF_ERROR(EmbedBackward());
  }
  std::vector<float> token_loss(n_);
  RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(token_loss.data(), b_.losses, n_ * sizeof(float),
                                       cudaMemcpyDeviceToHost, stream_));
  RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_), "(GPT pass)");
  std::vector<float> losses(batch_.batch);
  for (int bi = 0; bi < batch_.batch; ++bi) {
    double sum = 0;
    for (int t = 0; t < seq; ++t) sum += token_loss[static_cast<int64_t>(bi) * seq + t];
    losses[bi] = static_cast<float>(sum / seq);
  }
  return losses;
}

absl::Status Pass::Embed() {
  RETURN_IF_ERROR(access_.Fetch({kWte, kWpe}));
  RETURN_IF_LAUNCH_ERROR(k::LaunchEmbedForward(b_.tokens, access_.Get(kWte), access_.Get(kWpe),
                                               dt_, n_, batch_.seq, d_, b_.layers[0].x,
                                               stream()));
  return absl::OkStatus();
}

absl::Status Pass::BlockForward(int layer, LayerActs& a, float* out) {
  RETURN_IF_ERROR(access_.Fetch(BlockParams(layer, /*forward=*/true)));
  const int d = d_, seq = batch_.seq;
  const int64_t head = static_cast<int64_t>(seq) * hs_, scores = static_cast<int64_t>(seq) * seq;
  RETURN_IF_LAUNCH_ERROR(k::LaunchLayerNormForward(a.x, W(layer, kLn1W), W(layer, kLn1B), dt_,
                                                   n_, d, a.ln1, a.mean1, a.rstd1, stream()));
  RETURN_IF_ERROR(blas_.Linear(a.ln1, W(layer, kQkvW), n_, d, 3 * d, b_.g4));
  RETURN_IF_LAUNCH_ERROR(k::LaunchQkvToHeads(b_.g4, W(layer, kQkvB), dt_, batch_.batch, seq, d,
                                             s_.heads, a.q, a.k, a.v, stream()));
  // preatt (seq_q, seq_k) = q k^T per (batch, head).
  RETURN_IF_ERROR(blas_.Batched("attention q k^T", true, false, seq, seq, hs_, a.k, hs_, head,
                                a.q, hs_, head, b_.preatt, seq, scores, bh_));
  RETURN_IF_LAUNCH_ERROR(k::LaunchCausalSoftmax(b_.preatt, bh_, seq, scale_, a.att,
                                                CopyT(a.att_t), dt_, stream()));
  // y (seq, hs) = att v.
  RETURN_IF_ERROR(blas_.Batched("attention att v", false, false, hs_, seq, seq, a.v, hs_, head,
                                AsT(a.att, a.att_t), seq, scores, b_.yacc, hs_, head, bh_));
  RETURN_IF_LAUNCH_ERROR(
      k::LaunchHeadsToRows(b_.yacc, batch_.batch, seq, d, s_.heads, a.atty, dt_, stream()));
  RETURN_IF_ERROR(blas_.Linear(a.atty, W(layer, kAttnProjW), n_, d, d, b_.g4));
  RETURN_IF_LAUNCH_ERROR(k::LaunchBiasResidual(b_.g4, W(layer, kAttnProjB), dt_, a.x, n_, d,
                                               a.x2, stream()));
  RETURN_IF_LAUNCH_ERROR(k::LaunchLayerNormForward(a.x2, W(layer, kLn2W), W(layer, kLn2B), dt_,
                                                   n_, d, a.ln2, a.mean2, a.rstd2, stream()));
  RETURN_IF_ERROR(blas_.Linear(a.ln2, W(layer, kFcW), n_, d, 4 * d, a.fc));
  RETURN_IF_LAUNCH_ERROR(
      k::LaunchBiasGelu(a.fc, W(layer, kFcB), dt_, n_, 4 * d, a.gelu, stream()));
  RETURN_IF_ERROR(blas_.Linear(a.gelu, W(layer, kMlpProjW), n_, 4 * d, d, b_.g4));
  RETURN_IF_LAUNCH_ERROR(k::LaunchBiasResidual(b_.g4, W(layer, kMlpProjB), dt_, a.x2, n_, d,
                                               out, stream()));
  return absl::OkStatus();
}

absl::Status Pass::HeadForward(float grad_scale, const float* x) {
  const int lnf = LnFIndex(s_.layers);
  // In use order; backward needs the same parameters first, so they stay fetched across.
  RETURN_IF_ERROR(access_.Fetch({lnf, lnf + 1, kWte}));
  RETURN_IF_LAUNCH_ERROR(k::LaunchLayerNormForward(x, access_.Get(lnf), access_.Get(lnf + 1),
                                                   dt_, n_, d_, b_.lnf, b_.meanf, b_.rstdf,
                                                   stream()));
  // logits (n, vocab) = lnf (n, d) wte^T.
  RETURN_IF_ERROR(blas_.Gemm("logits", true, false, s_.vocab, static_cast<int>(n_), d_,
                             access_.Get(kWte), d_, b_.lnf, d_, b_.logits, DType::kF32,
                             s_.vocab));
  RETURN_IF_LAUNCH_ERROR(k::LaunchCrossEntropy(b_.logits, b_.targets, n_, s_.vocab, grad_scale,
                                               b_.losses, b_.dlogits, dt_, stream()));
  return absl::OkStatus();
}

absl::Status Pass::BiasGrad(int i, const float* a, int cols) {
  RETURN_IF_LAUNCH_ERROR(k::LaunchColumnPartials(a, n_, cols, b_.partials_b, stream()));
  ASSIGN_OR_RETURN(void* g, access_.Grad(i));
  RETURN_IF_LAUNCH_ERROR(
      k::LaunchColumnFinalize(b_.partials_b, k::ColumnChunks(n_), cols, g, dt_, stream()));
  return access_.Ready(i);
}

absl::Status Pass::LayerNormParamGrads(int w_index, const float* dy, const float* x,
                                       const float* mean, const float* rstd) {
  RETURN_IF_LAUNCH_ERROR(k::LaunchLayerNormParamPartials(dy, x, mean, rstd, n_, d_,
                                                         b_.partials_w, b_.partials_b,
                                                         stream()));
  const int64_t chunks = k::ColumnChunks(n_);
  ASSIGN_OR_RETURN(void* gb, access_.Grad(w_index + 1));
  RETURN_IF_LAUNCH_ERROR(k::LaunchColumnFinalize(b_.partials_b, chunks, d_, gb, dt_, stream()));
  RETURN_IF_ERROR(access_.Ready(w_index + 1));
  ASSIGN_OR_RETURN(void* gw, access_.Grad(w_index));
  RETURN_IF_LAUNCH_ERROR(k::LaunchColumnFinalize(b_.partials_w, chunks, d_, gw, dt_, stream()));
  return access_.Ready(w_index);
}

absl::Status Pass::WeightGrad(int i, const void* x, const void* dy, int in, int out) {
  ASSIGN_OR_RETURN(void* g, access_.Grad(i));
  RETURN_IF_ERROR(blas_.LinearDw(x, dy, n_, in, out, g));
  return access_.Ready(i);
}

absl::Status Pass::HeadBackward(const float* x) {
  const int lnf = LnFIndex(s_.layers);
  RETURN_IF_ERROR(access_.Fetch({kWte, lnf, lnf + 1}));
  // dlnf (n, d) = dlogits wte; dwte (vocab, d) = dlogits^T lnf, fp32 until the input use is
  // added in EmbedBackward.
  RETURN_IF_ERROR(blas_.Gemm("logits backward (input)", false, false, d_, static_cast<int>(n_),
                             s_.vocab, access_.Get(kWte), d_, b_.dlogits, s_.vocab, b_.dln,
                             DType::kF32, d_));
  RETURN_IF_ERROR(blas_.Gemm("logits backward (embedding)", false, true, d_, s_.vocab,
                             static_cast<int>(n_), b_.lnf, d_, b_.dlogits, s_.vocab, b_.dwte,
                             DType::kF32, d_));
  RETURN_IF_ERROR(LayerNormParamGrads(lnf, b_.dln, x, b_.meanf, b_.rstdf));
  RETURN_IF_LAUNCH_ERROR(k::LaunchLayerNormBackward(b_.dln, x, access_.Get(lnf), dt_, b_.meanf,
                                                    b_.rstdf, n_, d_, /*accumulate=*/false,
                                                    b_.dres, CopyT(b_.dres_t), stream()));
  return absl::OkStatus();
}

absl::Status Pass::BlockBackward(int layer, const LayerActs& a) {
  RETURN_IF_ERROR(access_.Fetch(BlockParams(layer, /*forward=*/false)));
  auto id = [&](int p) { return BlockParamIndex(layer, p); };
  const int d = d_, seq = batch_.seq;
  const int64_t head = static_cast<int64_t>(seq) * hs_, scores = static_cast<int64_t>(seq) * seq;
  const void* dres_t = AsT(b_.dres, b_.dres_t);
  // Gradients are written and handed over in reverse registration order (b before w).
  // MLP projection: dres is dLoss/d(block output).
  RETURN_IF_ERROR(BiasGrad(id(kMlpProjB), b_.dres, d));
  RETURN_IF_ERROR(WeightGrad(id(kMlpProjW), a.gelu, dres_t, 4 * d, d));
  RETURN_IF_ERROR(blas_.LinearDx(dres_t, W(layer, kMlpProjW), n_, 4 * d, d, b_.g4));
  RETURN_IF_LAUNCH_ERROR(k::LaunchGeluBackward(b_.g4, a.fc, n_ * 4 * d, b_.g4b, CopyT(b_.g4_t),
                                               dt_, stream()));
  const void* dfc_t = AsT(b_.g4b, b_.g4_t);
  RETURN_IF_ERROR(BiasGrad(id(kFcB), b_.g4b, 4 * d));
  RETURN_IF_ERROR(WeightGrad(id(kFcW), a.ln2, dfc_t, d, 4 * d));
  RETURN_IF_ERROR(blas_.LinearDx(dfc_t, W(layer, kFcW), n_, d, 4 * d, b_.dln));
  RETURN_IF_ERROR(LayerNormParamGrads(id(kLn2W), b_.dln, a.x2, a.mean2, a.rstd2));
  RETURN_IF_LAUNCH_ERROR(k::LaunchLayerNormBackward(b_.dln, a.x2, W(layer, kLn2W), dt_, a.mean2,
                                                    a.rstd2, n_, d, /*accumulate=*/true,
                                                    b_.dres, CopyT(b_.dres_t), stream()));
  // dres is now dLoss/dx2. Attention projection.
  RETURN_IF_ERROR(BiasGrad(id(kAttnProjB), b_.dres, d));
  RETURN_IF_ERROR(WeightGrad(id(kAttnProjW), a.atty, dres_t, d, d));
  RETURN_IF_ERROR(blas_.LinearDx(dres_t, W(layer, kAttnProjW), n_, d, d, b_.dln));
  // Attention, per (batch, head): dy = d(att v) in heads layout.
  RETURN_IF_LAUNCH_ERROR(
      k::LaunchRowsToHeads(b_.dln, batch_.batch, seq, d, s_.heads, b_.heads_t, dt_, stream()));
  // datt (seq, seq) = dy v^T; dv (seq, hs) = att^T dy.
  RETURN_IF_ERROR(blas_.Batched("attention d(att)", true, false, seq, seq, hs_, a.v, hs_, head,
                                b_.heads_t, hs_, head, b_.preatt, seq, scores, bh_));
  RETURN_IF_ERROR(blas_.Batched("attention dv", false, true, hs_, seq, seq, b_.heads_t, hs_,
                                head, AsT(a.att, a.att_t), seq, scores, b_.dv, hs_, head, bh_));
  RETURN_IF_LAUNCH_ERROR(k::LaunchCausalSoftmaxBackward(a.att, b_.preatt, bh_, seq, scale_,
                                                        b_.dpre, dt_, stream()));
  // dq (seq, hs) = dpre k; dk (seq, hs) = dpre^T q.
  RETURN_IF_ERROR(blas_.Batched("attention dq", false, false, hs_, seq, seq, a.k, hs_, head,
                                b_.dpre, seq, scores, b_.yacc, hs_, head, bh_));
  RETURN_IF_ERROR(blas_.Batched("attention dk", false, true, hs_, seq, seq, a.q, hs_, head,
                                b_.dpre, seq, scores, b_.dk, hs_, head, bh_));
  RETURN_IF_LAUNCH_ERROR(k::LaunchHeadsToQkv(b_.yacc, b_.dk, b_.dv, batch_.batch, seq, d,
                                             s_.heads, b_.g4, CopyT(b_.g4_t), dt_, stream()));
  const void* dqkv_t = AsT(b_.g4, b_.g4_t);
  RETURN_IF_ERROR(BiasGrad(id(kQkvB), b_.g4, 3 * d));
  RETURN_IF_ERROR(WeightGrad(id(kQkvW), a.ln1, dqkv_t, d, 3 * d));
  RETURN_IF_ERROR(blas_.LinearDx(dqkv_t, W(layer, kQkvW), n_, d, 3 * d, b_.dln));
  RETURN_IF_ERROR(LayerNormParamGrads(id(kLn1W), b_.dln, a.x, a.mean1, a.rstd1));
  RETURN_IF_LAUNCH_ERROR(k::LaunchLayerNormBackward(b_.dln, a.x, W(layer, kLn1W), dt_, a.mean1,
                                                    a.rstd1, n_, d, /*accumulate=*/true,
                                                    b_.dres, CopyT(b_.dres_t), stream()));
  return absl::OkStatus();  // dres is now dLoss/d(block input)
}

absl::Status Pass::EmbedBackward() {
  // The embeddings' backward reads no parameter: everything may be released.
  RETURN_IF_ERROR(access_.Fetch({}));
  ASSIGN_OR_RETURN(void* gwpe, access_.Grad(kWpe));
  RETURN_IF_LAUNCH_ERROR(k::LaunchPositionGrad(b_.dres, batch_.batch, batch_.seq, s_.context, d_,
                                               gwpe, dt_, stream()));
  RETURN_IF_ERROR(access_.Ready(kWpe));
  RETURN_IF_LAUNCH_ERROR(k::LaunchTokenGradAdd(b_.dres, b_.uniq, b_.starts, b_.rows, num_tokens_,
                                               d_, b_.dwte, stream()));
  ASSIGN_OR_RETURN(void* gwte, access_.Grad(kWte));
  RETURN_IF_LAUNCH_ERROR(k::LaunchCastFromF32(b_.dwte, gwte, dt_,
                                              static_cast<int64_t>(s_.vocab) * d_, stream()));
  return access_.Ready(kWte);
}

// Stage 3 keeps exactly the units of the parameters in use gathered, as gpt.cc's EngineAccess
// does; parameters are read in place (no copies).
class EngineAccess : public DeviceParamAccess {
 public:
  explicit EngineAccess(Engine& engine)
      : engine_(engine), dtype_(engine.plan().options.compute_dtype),
        ptrs_(engine.num_params(), nullptr) {}

  DType dtype() const override { return dtype_; }

  absl::Status Fetch(const std::vector<int>& params) override {
    // The previous set's holds go first, so no more slots are held than one set needs; a unit
    // in both sets keeps its slot unless the new set's gathers need that slot.
    RETURN_IF_ERROR(engine_.ReleaseParams(held_));
    held_.clear();
    RETURN_IF_ERROR(engine_.AcquireParams(params));
    held_ = params;
    std::fill(ptrs_.begin(), ptrs_.end(), nullptr);
    for (int i : params) {
      ASSIGN_OR_RETURN(ptrs_[i], engine_.param(i));
    }
    return absl::OkStatus();
  }

  const void* Get(int i) override { return ptrs_[i]; }
  absl::StatusOr<void*> Grad(int i) override { return engine_.grad(i); }
  absl::Status Ready(int i) override { return engine_.GradReady(i); }

 private:
  Engine& engine_;
  const DType dtype_;
  std::vector<void*> ptrs_;  // per parameter, while fetched
  std::vector<int> held_;    // the parameters of the last Fetch, acquired
};

}  // namespace

absl::StatusOr<std::vector<float>> CudaPass::Run(DeviceParamAccess& access,
                                                 const TokenBatch& batch, float grad_scale) {
  RETURN_IF_CUDA_ERROR(cudaSetDevice(device_));
  RETURN_IF_ERROR(Reserve(batch, access.dtype(), grad_scale != 0));
  ASSIGN_OR_RETURN(const CublasApi* api, LoadCublas());
  Pass pass(shape_, access, batch, *buffers_, *api, static_cast<cublasHandle_t>(cublas_),
            static_cast<cudaStream_t>(stream_));
  return pass.Run(grad_scale);
}

std::unique_ptr<DeviceParamAccess> EngineDeviceAccess(Engine& engine) {
  return std::make_unique<EngineAccess>(engine);
}

// ---------------------------------------------------------------- FlatDeviceParams

absl::StatusOr<std::unique_ptr<FlatDeviceParams>> FlatDeviceParams::Create(
    const std::vector<memory::ParamSpec>& specs, const std::vector<float>& params,
    DType dtype) {
  std::unique_ptr<FlatDeviceParams> flat(new FlatDeviceParams());
  flat->dtype_ = dtype;
  for (const memory::ParamSpec& spec : specs) {
    flat->offsets_.push_back(flat->total_);
    flat->total_ += spec.numel();
  }
  if (static_cast<int64_t>(params.size()) != flat->total_) {
    return absl::InvalidArgumentError(absl::StrCat("FlatDeviceParams: ", params.size(),
                                                   " values for ", flat->total_, " elements"));
  }
  const size_t bytes = flat->total_ * DTypeSize(dtype);
  RETURN_IF_CUDA_ERROR(cudaMalloc(&flat->params_, bytes));
  RETURN_IF_CUDA_ERROR(cudaMalloc(&flat->grads_, bytes));
  RETURN_IF_CUDA_ERROR(cudaMemset(flat->grads_, 0, bytes));
  std::vector<char> host(bytes);
  for (int64_t k = 0; k < flat->total_; ++k) StoreAs(dtype, host.data(), k, params[k]);
  RETURN_IF_CUDA_ERROR(cudaMemcpy(flat->params_, host.data(), bytes, cudaMemcpyHostToDevice));
  return flat;
}

FlatDeviceParams::~FlatDeviceParams() {
  cudaDeviceSynchronize();
  if (params_ != nullptr) cudaFree(params_);
  if (grads_ != nullptr) cudaFree(grads_);
}

const void* FlatDeviceParams::Get(int i) {
  return static_cast<const char*>(params_) + offsets_[i] * DTypeSize(dtype_);
}

absl::StatusOr<void*> FlatDeviceParams::Grad(int i) {
  return static_cast<void*>(static_cast<char*>(grads_) + offsets_[i] * DTypeSize(dtype_));
}

absl::StatusOr<std::vector<float>> FlatDeviceParams::Gradients() const {
  RETURN_IF_CUDA_ERROR(cudaDeviceSynchronize());
  std::vector<char> host(total_ * DTypeSize(dtype_));
  RETURN_IF_CUDA_ERROR(cudaMemcpy(host.data(), grads_, host.size(), cudaMemcpyDeviceToHost));
  std::vector<float> out(total_);
  for (int64_t k = 0; k < total_; ++k) out[k] = LoadAs(dtype_, host.data(), k);
  return out;
}

}  // namespace internal
}  // namespace gpt
}  // namespace examples
}  // namespace zerort
