// The per-thread work of the CUDA device's elementwise kernels (Cast, Accumulate, AdamW, the
// compact-state AdamW, AllFinite and the in-process rank-order reduction), written once for nvcc's device pass and
// for the host compiler, like cuda_math.h.
//
// Why: a kernel that moves one 2- or 4-byte element per thread per iteration leaves the memory
// system idle between dependent loads (measured on an H200 against a device-to-device copy of
// the same bytes: AdamW 0.78, casts 0.62-0.65, accumulate 0.48, the finite check 0.32). Each
// thread here handles kChunk = 8 elements per step: with 16-byte vector loads and stores where
// every operand allows them, else 8 independent scalar loads issued before any arithmetic (ILP).
// Compiled for the host, the same split, schedule and chunk functions are replayed over a
// simulated grid by cuda_device_test and compared with the CPU device bit for bit, for every
// misalignment, without a GPU.
//
// Alignment. Kernels receive element offsets into arenas, so pointers are only element-aligned.
// SplitForVectors looks for the first element index `head` (< kChunk) at which EVERY operand's
// address is a multiple of 16 bytes:
//   - found: elements [0, head) and the tail past the last whole chunk go through scalar loads
//     (one thread each), [head, head + body) through 16-byte vector loads (ld.global.v4);
//   - none (operands misaligned differently, e.g. grad at an odd bf16 offset and master at an
//     even fp32 one): every element through the strided ILP path, which needs no alignment.
// Operands placed at the same element offset into 16-byte-aligned arenas always share a head.
//
// Exactness: the arithmetic of element j is the same call into cuda_math.h / base/dtype.h as
// before (AdamWElement, LoadAs, StoreAs, Add, Div), applied to the element's bits held in
// registers instead of in memory, so results are bitwise those of the one-element kernels.
//
// Thread safety: pure functions.
#ifndef ZERORT_DEVICE_INTERNAL_CUDA_ELEMENTWISE_H_
#define ZERORT_DEVICE_INTERNAL_CUDA_ELEMENTWISE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "base/dtype.h"
#include "device/internal/cuda_math.h"

#if defined(__CUDACC__)
#define ZERORT_UNROLL _Pragma("unroll")
#else
#define ZERORT_UNROLL
#endif

namespace zerort {
namespace cuda_internal {

// Elements one thread handles per step.
inline constexpr int kChunk = 8;
// Bytes of one vector load or store (ld.global.v4.u32).
inline constexpr size_t kVectorBytes = 16;

// ------------------------------------------------------------------ split

// One array a kernel reads or writes: its address and element size in bytes.
struct VectorOperand {
  uintptr_t address;
  size_t elem_size;
};

// How n elements divide between scalar and vector accesses.
//   aligned: [0, head) scalar, [head, head + body) in chunks of kChunk with 16-byte vector
//            accesses of every operand, [head + body, n) scalar. head < kChunk, body % kChunk == 0,
//            n - head - body < kChunk.
//   !aligned: head == body == 0; every element through the strided path (no alignment needed).
struct ElementSplit {
  bool aligned;
  size_t head;
  size_t body;
};

// The split for n elements of `count` operands. Vector accesses need, at one element index, every
// operand on a 16-byte boundary and kChunk elements of every operand a whole number of 16-byte
// vectors; the first such index below kChunk is the head.
ZERORT_HD ElementSplit SplitForVectors(const VectorOperand* ops, int count, size_t n) {
  for (int k = 0; k < count; ++k) {
    const size_t size = ops[k].elem_size;
    if (size == 0 || (kChunk * size) % kVectorBytes != 0 || ops[k].address % size != 0) {
      return {false, 0, 0};
    }
  }
  for (size_t h = 0; h < static_cast<size_t>(kChunk); ++h) {
    bool all = true;
    for (int k = 0; k < count; ++k) {
      all = all && (ops[k].address + h * ops[k].elem_size) % kVectorBytes == 0;
    }
    if (!all) continue;
    const size_t head = h < n ? h : n;
    return {true, head, (n - head) / kChunk * kChunk};
  }
  return {false, 0, 0};
}

// ------------------------------------------------------------------ schedule

// Elements i, i + 1, ..., i + kChunk - 1, 16-byte aligned in every operand.
struct AlignedChunk {
  size_t i;
  static constexpr bool Has(int) { return true; }
  ZERORT_HD size_t At(int j) const { return i + static_cast<size_t>(j); }
};

// Elements i + j * stride for 0 <= j < count (1 <= count <= kChunk); no alignment needed.
struct StridedChunk {
  size_t i;
  size_t stride;
  int count;
  ZERORT_HD bool Has(int j) const { return j < count; }
  ZERORT_HD size_t At(int j) const { return i + static_cast<size_t>(j) * stride; }
};

// Calls f(chunk) for each chunk thread t of `threads` (a grid-stride loop over gridDim.x *
// blockDim.x) owns. Over t = 0 .. threads - 1 the chunks cover [0, n) exactly once.
//   aligned: thread 0 takes the head and the tail (StridedChunk, stride 1, < kChunk elements
//            each); chunk c of the body goes to thread c % threads, so a warp's vector accesses
//            are contiguous.
//   !aligned: tiles of kChunk * threads elements; thread t takes t, t + threads, ... of each, so
//            every one of its 8 scalar loads is coalesced across the warp.
// Units of work for sizing the grid: ChunkCount.
template <class F>
ZERORT_HD void ForEachChunk(const ElementSplit& s, size_t n, size_t t, size_t threads, F&& f) {
  if (s.aligned) {
    if (t == 0 && s.head > 0) f(StridedChunk{0, 1, static_cast<int>(s.head)});
    const size_t chunks = s.body / kChunk;
    for (size_t c = t; c < chunks; c += threads) f(AlignedChunk{s.head + c * kChunk});
    const size_t tail = n - s.head - s.body;
    if (t == 0 && tail > 0) f(StridedChunk{s.head + s.body, 1, static_cast<int>(tail)});
    return;
  }
  for (size_t i = t; i < n; i += kChunk * threads) {
    const size_t left = (n - 1 - i) / threads + 1;  // i, i + threads, ... below n
    f(StridedChunk{i, threads, left < kChunk ? static_cast<int>(left) : kChunk});
  }
}

// Threads worth launching for ForEachChunk: one per body chunk (at least one), or one per kChunk
// elements on the strided path. More only idle.
ZERORT_HD size_t ChunkThreads(const ElementSplit& s, size_t n) {
  const size_t units = s.aligned ? s.body / kChunk : (n + kChunk - 1) / kChunk;
  return units > 0 ? units : 1;
}

// ------------------------------------------------------------------ registers

// kChunk elements of one operand of dtype D, as the dtype's bits, held in registers. LoadAs /
// StoreAs / IsNonFinite address them like the array in memory (element j of e). Every access to
// an fp32 chunk is through float and to a 16-bit chunk through uint16_t (no type punning on
// locals, which the host compiler's aliasing rules would break); vectors move in by memcpy.
template <DType D>
struct Regs {
  using Bits = std::conditional_t<D == DType::kF32, float, uint16_t>;
  static_assert(sizeof(Bits) * kChunk % kVectorBytes == 0, "a chunk is whole vectors");
  alignas(16) Bits e[kChunk];
};

// One 16-byte vector: a single ld.global.v4.u32 / st.global.v4.u32 on the device (the memcpy
// between registers compiles to moves); memcpy on the host.
ZERORT_HD void Load16(void* regs, const void* src) {
#if defined(__CUDA_ARCH__)
  const uint4 bits = *static_cast<const uint4*>(src);
  memcpy(regs, &bits, sizeof(bits));
#else
  std::memcpy(regs, src, kVectorBytes);
#endif
}

ZERORT_HD void Store16(void* dst, const void* regs) {
#if defined(__CUDA_ARCH__)
  uint4 bits;
  memcpy(&bits, regs, sizeof(bits));
  *static_cast<uint4*>(dst) = bits;
#else
  std::memcpy(dst, regs, kVectorBytes);
#endif
}

template <DType D>
ZERORT_HD void Load(const AlignedChunk& c, Regs<D>& r, const void* base) {
  using B = typename Regs<D>::Bits;
  constexpr int kPerVector = static_cast<int>(kVectorBytes / sizeof(B));
  const B* p = static_cast<const B*>(base) + c.i;
  ZERORT_UNROLL
  for (int q = 0; q < kChunk; q += kPerVector) Load16(&r.e[q], p + q);
}

template <DType D>
ZERORT_HD void Store(const AlignedChunk& c, const Regs<D>& r, void* base) {
  using B = typename Regs<D>::Bits;
  constexpr int kPerVector = static_cast<int>(kVectorBytes / sizeof(B));
  B* p = static_cast<B*>(base) + c.i;
  ZERORT_UNROLL
  for (int q = 0; q < kChunk; q += kPerVector) Store16(p + q, &r.e[q]);
}

template <DType D>
ZERORT_HD void Load(const StridedChunk& c, Regs<D>& r, const void* base) {
  using B = typename Regs<D>::Bits;
  ZERORT_UNROLL
  for (int j = 0; j < kChunk; ++j) {
    if (c.Has(j)) r.e[j] = static_cast<const B*>(base)[c.At(j)];
  }
}

template <DType D>
ZERORT_HD void Store(const StridedChunk& c, const Regs<D>& r, void* base) {
  using B = typename Regs<D>::Bits;
  ZERORT_UNROLL
  for (int j = 0; j < kChunk; ++j) {
    if (c.Has(j)) static_cast<B*>(base)[c.At(j)] = r.e[j];
  }
}

// ------------------------------------------------------------------ chunk operations
//
// Each op loads every input of its chunk into registers, then runs the one-element arithmetic
// for each element, then stores: all loads of a chunk are in flight together, and an output that
// aliases an input at the same offsets (AdamW's fp32 param_out = master, an in-place reduction)
// is read before it is written.

// dst[i] = round_to_D(float(src[i])).
template <DType S, DType D>
struct CastOp {
  const void* src;
  void* dst;

  template <class C>
  ZERORT_HD void operator()(const C& c) const {
    Regs<S> in;
    Regs<D> out;
    Load(c, in, src);
    ZERORT_UNROLL
    for (int j = 0; j < kChunk; ++j) {
      if (c.Has(j)) StoreAs<D>(out.e, j, LoadAs<S>(in.e, j));
    }
    Store(c, out, dst);
  }
};

// acc[i] = round(float(acc[i]) + float(x[i])).
template <DType D>
struct AccumulateOp {
  void* acc;
  const void* x;

  template <class C>
  ZERORT_HD void operator()(const C& c) const {
    Regs<D> a, b;
    Load(c, a, acc);
    Load(c, b, x);
    ZERORT_UNROLL
    for (int j = 0; j < kChunk; ++j) {
      if (c.Has(j)) StoreAs<D>(a.e, j, Add(LoadAs<D>(a.e, j), LoadAs<D>(b.e, j)));
    }
    Store(c, a, acc);
  }
};

// x[i] = round(float(x[i]) * factor): gradient prescaling, one rounding as on the CPU device.
template <DType D>
struct ScaleOp {
  void* x;
  float factor;

  template <class C>
  ZERORT_HD void operator()(const C& c) const {
    Regs<D> a;
    Load(c, a, x);
    ZERORT_UNROLL
    for (int j = 0; j < kChunk; ++j) {
      if (c.Has(j)) StoreAs<D>(a.e, j, Mul(LoadAs<D>(a.e, j), factor));
    }
    Store(c, a, x);
  }
};

// AdamWElement over a chunk. param_out may alias master when P is fp32 (both get p).
template <DType G, DType P, bool kOut>
struct AdamWOp {
  AdamWConstants c;
  float* master;
  float* m;
  float* v;
  const void* grad;
  void* param_out;

  template <class C>
  ZERORT_HD void operator()(const C& ch) const {
    Regs<DType::kF32> rmaster, rm, rv;
    Regs<G> rgrad;
    Regs<P> rout;
    Load(ch, rmaster, master);
    Load(ch, rm, m);
    Load(ch, rv, v);
    Load(ch, rgrad, grad);
    ZERORT_UNROLL
    for (int j = 0; j < kChunk; ++j) {
      if (ch.Has(j)) {
        AdamWElement<G, P, kOut>(c, rmaster.e, rm.e, rv.e, rgrad.e, rout.e,
                                 static_cast<size_t>(j));
      }
    }
    Store(ch, rm, m);
    Store(ch, rv, v);
    Store(ch, rmaster, master);
    if constexpr (kOut) Store(ch, rout, param_out);
  }
};

// CompactAdamWElement over a chunk (the arrays' roles: cuda_math.h). Every input of the chunk is
// loaded before any store, so an fp32 param aliasing master (kF32 form) is read first.
template <DType G, CompactForm F, DType M, DType P, bool kOut>
struct CompactAdamWOp {
  AdamWConstants c;
  StochasticLaunch rounding;
  float* master;
  void* param;
  uint16_t* remainder;
  void* m;
  void* v;
  const void* grad;

  template <class C>
  ZERORT_HD void operator()(const C& ch) const {
    constexpr bool kMaster = F == CompactForm::kF32;  // else the param is the master's storage
    constexpr bool kRemainder = F == CompactForm::kBf16Remainder;
    Regs<DType::kF32> rmaster;
    Regs<P> rparam;
    Regs<DType::kBF16> rrem;  // uint16_t, as the remainder
    Regs<M> rm, rv;
    Regs<G> rgrad;
    if constexpr (kMaster) {
      Load(ch, rmaster, master);
    } else {
      Load(ch, rparam, param);
    }
    if constexpr (kRemainder) Load(ch, rrem, remainder);
    Load(ch, rm, m);
    Load(ch, rv, v);
    Load(ch, rgrad, grad);
    ZERORT_UNROLL
    for (int j = 0; j < kChunk; ++j) {
      if (ch.Has(j)) {
        CompactAdamWElement<G, F, M, P, kOut>(c, rounding, rmaster.e, rparam.e, rrem.e, rm.e,
                                              rv.e, rgrad.e, static_cast<size_t>(j), ch.At(j));
      }
    }
    Store(ch, rm, m);
    Store(ch, rv, v);
    if constexpr (kMaster) Store(ch, rmaster, master);
    if constexpr (kOut) Store(ch, rparam, param);
    if constexpr (kRemainder) Store(ch, rrem, remainder);
  }
};

// The arrays of one compact AdamW launch: offload::CompactAdamWArrays from some element on
// (cuda_compact_plan.h makes them), n elements each; arrays the form does not use are null.
struct CompactAdamWArgs {
  CompactForm form;
  float* master;              // kF32: (n) fp32
  void* param;                // kF32: (n) param_dtype or null; else (n) bf16, the master
  DType param_dtype;
  uint16_t* remainder;        // kBf16Remainder: (n)
  void* m;                    // (n) moment_dtype (kF32 or kBF16)
  void* v;
  DType moment_dtype;
  const void* grad;           // (n) grad_dtype
  DType grad_dtype;
  size_t n;
  StochasticLaunch rounding;  // kBf16Stochastic
};

// Most arrays one compact launch touches.
inline constexpr int kMaxCompactOperands = 6;

// Fills ops with the arrays `a` touches (for SplitForVectors) and returns their count.
ZERORT_HD int CompactOperands(const CompactAdamWArgs& a, VectorOperand* ops) {
  int k = 0;
  auto add = [&](const void* p, size_t size) {
    if (p != nullptr) ops[k++] = {reinterpret_cast<uintptr_t>(p), size};
  };
  add(a.master, 4);
  add(a.param, DTypeSize(a.param_dtype));
  add(a.remainder, 2);
  add(a.m, DTypeSize(a.moment_dtype));
  add(a.v, DTypeSize(a.moment_dtype));
  add(a.grad, DTypeSize(a.grad_dtype));
  return k;
}

// Calls f(std::integral_constant<DType, D>{}) for the run-time dtype d = D: the one switch
// from a launcher's dtype argument to the kernel instance (decltype(tag)::value).
template <typename F>
void WithDType(DType d, F&& f) {
  switch (d) {
    case DType::kF32:
      f(std::integral_constant<DType, DType::kF32>{});
      break;
    case DType::kBF16:
      f(std::integral_constant<DType, DType::kBF16>{});
      break;
    case DType::kF16:
      f(std::integral_constant<DType, DType::kF16>{});
      break;
  }
}

// Calls f(op) with the chunk op for `a`'s form and dtypes (offload::CpuAdamWCompact's dispatch):
// the one dispatch of the kernel's launcher and of the host tests that replay it. The kF32 form
// with fp32 moments is CpuAdamW bit for bit (cpu_adamw_compact_test), so it runs AdamWOp: the
// same kernels as Device::AdamW, and 12 fewer instances of device code (about 1.4 MB).
// REQUIRES: the dtypes CheckCompactAdamW accepts (moments kF32 or kBF16; bf16 param unless kF32).
template <typename F>
void WithCompactAdamWOp(const AdamWConstants& c, const CompactAdamWArgs& a, F&& f) {
  using Tag32 = std::integral_constant<DType, DType::kF32>;
  using Tag16 = std::integral_constant<DType, DType::kBF16>;
  WithDType(a.grad_dtype, [&](auto g) {
    constexpr DType G = decltype(g)::value;
    auto with_moments = [&](auto mtag) {
      constexpr DType M = decltype(mtag)::value;
      switch (a.form) {
        case CompactForm::kF32:
          if constexpr (M == DType::kF32) {
            if (a.param == nullptr) {
              f(AdamWOp<G, DType::kF32, false>{c, a.master, static_cast<float*>(a.m),
                                               static_cast<float*>(a.v), a.grad, nullptr});
              return;
            }
            WithDType(a.param_dtype, [&](auto p) {
              f(AdamWOp<G, decltype(p)::value, true>{c, a.master, static_cast<float*>(a.m),
                                                     static_cast<float*>(a.v), a.grad, a.param});
            });
          } else {
            if (a.param == nullptr) {
              f(CompactAdamWOp<G, CompactForm::kF32, M, DType::kF32, false>{
                  c, a.rounding, a.master, nullptr, nullptr, a.m, a.v, a.grad});
              return;
            }
            WithDType(a.param_dtype, [&](auto p) {
              f(CompactAdamWOp<G, CompactForm::kF32, M, decltype(p)::value, true>{
                  c, a.rounding, a.master, a.param, nullptr, a.m, a.v, a.grad});
            });
          }
          return;
        case CompactForm::kBf16Remainder:
          f(CompactAdamWOp<G, CompactForm::kBf16Remainder, M, DType::kBF16, true>{
              c, a.rounding, nullptr, a.param, a.remainder, a.m, a.v, a.grad});
          return;
        case CompactForm::kBf16Stochastic:
          f(CompactAdamWOp<G, CompactForm::kBf16Stochastic, M, DType::kBF16, true>{
              c, a.rounding, nullptr, a.param, nullptr, a.m, a.v, a.grad});
          return;
      }
    };
    if (a.moment_dtype == DType::kBF16) {
      with_moments(Tag16{});
    } else {
      with_moments(Tag32{});
    }
  });
}

// Read-only: ORs 1 into *bad for an Inf or NaN element (a thread-local flag; the kernel reduces
// it over the block).
template <DType D>
struct NonFiniteOp {
  const void* x;
  int* bad;

  template <class C>
  ZERORT_HD void operator()(const C& c) const {
    Regs<D> r;
    Load(c, r, x);
    int b = 0;
    ZERORT_UNROLL
    for (int j = 0; j < kChunk; ++j) {
      if (c.Has(j)) b |= IsNonFinite<D>(r.e, static_cast<size_t>(j)) ? 1 : 0;
    }
    *bad |= b;
  }
};

// Most blocks one rank-order reduction reads: the kernel takes their pointers by value.
inline constexpr int kMaxReduceSources = 16;

// Element j of a reduction result, stored with a NaN as one fixed pattern (whichever input's
// payload an add carried), as comm/internal/reduce.h does.
template <DType D>
ZERORT_HD void StoreCanonical(void* dst, size_t i, float acc) {
  if (acc != acc) {
    if constexpr (D == DType::kF32) {
      static_cast<float*>(dst)[i] = BitsToFloat(0x7fc00000u);  // stored as a float: see Regs
    } else {
      static_cast<uint16_t*>(dst)[i] = D == DType::kBF16 ? 0x7fc0u : 0x7e00u;
    }
  } else {
    StoreAs<D>(dst, i, acc);
  }
}

// dst[i] = the CPU communicators' reduction of srcs[0..n)[i] in rank order. kOp: 0 sum, 1 avg,
// 2 max. dst may alias a source at the same offsets.
template <DType D, int kOp>
struct ReduceRankOrderOp {
  const void* srcs[kMaxReduceSources];
  int n;
  void* dst;

  template <class C>
  ZERORT_HD void operator()(const C& c) const {
    Regs<D> x;
    float acc[kChunk];
    Load(c, x, srcs[0]);
    ZERORT_UNROLL
    for (int j = 0; j < kChunk; ++j) {
      if (c.Has(j)) acc[j] = LoadAs<D>(x.e, j);
    }
    // Unrolled over the fixed bound so that srcs[k] is a constant offset into the kernel's
    // parameters (a run-time index would copy them to local memory).
    ZERORT_UNROLL
    for (int k = 1; k < kMaxReduceSources; ++k) {
      if (k >= n) break;
      Load(c, x, srcs[k]);
      ZERORT_UNROLL
      for (int j = 0; j < kChunk; ++j) {
        if (!c.Has(j)) continue;
        const float xj = LoadAs<D>(x.e, j);
        if constexpr (kOp == 2) {
          acc[j] = (acc[j] > xj || acc[j] != acc[j]) ? acc[j] : xj;
        } else {
          acc[j] = Add(acc[j], xj);
        }
      }
    }
    Regs<D> out;
    ZERORT_UNROLL
    for (int j = 0; j < kChunk; ++j) {
      if (!c.Has(j)) continue;
      if constexpr (kOp == 1) acc[j] = Div(acc[j], static_cast<float>(n));
      StoreCanonical<D>(out.e, static_cast<size_t>(j), acc[j]);
    }
    Store(c, out, dst);
  }
};

}  // namespace cuda_internal
}  // namespace zerort

#endif  // ZERORT_DEVICE_INTERNAL_CUDA_ELEMENTWISE_H_
