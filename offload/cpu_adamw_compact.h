// The host AdamW over compact optimizer state: fewer bytes per parameter than CpuAdamW's fp32
// master, m and v, with the same op sequence (cpu_adamw.h) on fp32 values. Each form is one
// choice of how the master and the moments are stored (docs/compact_state.md):
//
//   master_form       master storage                      bytes/param  vs fp32 master
//   kF32              fp32 array (+ optional param copy)   4            the reference
//   kBf16Remainder    bf16 param + 16-bit remainder        2 beyond it  bitwise equal master
//   kBf16Stochastic   the bf16 param itself                0 beyond it  stochastic rounding
//
//   moment_dtype kF32 (4 + 4 bytes) or kBF16 (2 + 2 bytes, rounded to nearest even on store;
//   the update uses the fp32 values computed in the step, as DeepSpeed's bf16 states do).
//
// kF32 master with kF32 moments is CpuAdamW exactly (cpu_adamw_compact_test checks it bit for
// bit). kBf16Remainder's master equals the fp32 master path's bit for bit; its bf16 parameter
// is the master rounded to nearest with ties away from zero (it differs from CpuAdamW's
// nearest-even copy only on exact ties with an even lower neighbour: compact_state.h says why
// no 16-bit remainder can be lossless beside a nearest-even parameter).
//
//   CompactAdamWArrays a;
//   a.master_form = MasterForm::kBf16Remainder;
//   a.param = bf16_shard;  a.remainder = rem;  a.m = m;  a.v = v;  a.moment_dtype = DType::kBF16;
//   a.grad = grad;  a.grad_dtype = DType::kBF16;  a.n = n;
//   RETURN_IF_ERROR(CpuAdamWCompact(a, step, 1.0f / loss_scale, /*threads=*/0));
//
// Every SIMD path (offload/simd.h) and thread count gives bitwise identical results.
// Thread-safe as CpuAdamW: calls on disjoint arrays may run concurrently.
#ifndef ZERORT_OFFLOAD_CPU_ADAMW_COMPACT_H_
#define ZERORT_OFFLOAD_CPU_ADAMW_COMPACT_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "base/dtype.h"
#include "offload/cpu_adamw.h"

namespace zerort {
namespace offload {

// Where a shard's master weights live.
enum class MasterForm {
  kF32 = 0,             // `master`: (n) fp32; `param`: optional rounded copy (RNE)
  kBf16Remainder = 1,   // `param`: (n) bf16 high part, `remainder`: (n) low part; lossless
  kBf16Stochastic = 2,  // `param`: (n) bf16, the master itself, rounded stochastically
};

// "f32", "bf16_remainder", "bf16_stochastic".
const char* MasterFormName(MasterForm form);

// Seeds kBf16Stochastic: element i's random bits are a pure function of
// (seed, step, first_index + i), see compact_state.h.
struct StochasticRounding {
  uint64_t seed = 0;
  uint64_t step = 0;         // the optimizer step (any value; the engine passes t)
  uint64_t first_index = 0;  // global index of element 0: the shard's offset in the flat
                             // parameter order, so every stage and world size draws alike
};

// The arrays of one update, all of n elements, none overlapping (except param == master for
// kF32 with an fp32 param). Arrays a form does not use must be null.
struct CompactAdamWArrays {
  MasterForm master_form = MasterForm::kF32;
  float* master = nullptr;          // kF32: (n) fp32, updated in place
  uint16_t* remainder = nullptr;    // kBf16Remainder: (n), updated in place
  void* param = nullptr;            // (n) param_dtype. kF32: written if not null; others: bf16,
  DType param_dtype = DType::kBF16; //   read and written (REQUIRES param_dtype == kBF16)
  void* m = nullptr;                // (n) moment_dtype, updated in place
  void* v = nullptr;                // (n) moment_dtype, updated in place
  DType moment_dtype = DType::kF32; // kF32 or kBF16
  const void* grad = nullptr;       // (n) grad_dtype
  DType grad_dtype = DType::kF32;
  size_t n = 0;
  StochasticRounding rounding;      // kBf16Stochastic only
};

// One AdamW step. `ranges` tile [0, n) in order with per-range constants (as for CpuAdamW);
// `threads`: 0 = all hardware threads. InvalidArgument naming the field if a pointer the form
// needs is null, one it does not use is set, a dtype is not allowed, the ranges do not tile, or
// threads < 0. Non-finite inputs propagate as in CpuAdamW.
absl::Status CpuAdamWCompact(const CompactAdamWArrays& arrays,
                             absl::Span<const AdamWRange> ranges, float grad_scale, int threads);

// The same with one set of constants for all n elements.
absl::Status CpuAdamWCompact(const CompactAdamWArrays& arrays, const AdamWStepParams& params,
                             float grad_scale, int threads);

// The argument checks of CpuAdamWCompact (all but `threads`), for a device kernel to make the
// same ones with the same messages: InvalidArgument prefixed with `who` unless `ranges` tile
// [0, n) in order and every pointer and dtype is what the form asks for.
absl::Status CheckCompactAdamW(const CompactAdamWArrays& arrays,
                               absl::Span<const AdamWRange> ranges, const char* who);

// Whole-array conversions between an fp32 master and the lossless form, for loading and saving
// fp32 checkpoints from a kBf16Remainder run and for its first step from fp32 weights:
// element-wise SplitMaster / JoinMaster (compact_state.h), split over `threads` (0 = all).
// InvalidArgument if n > 0 and a pointer is null, or threads < 0.
absl::Status SplitMasters(const float* master, uint16_t* param, uint16_t* remainder, size_t n,
                          int threads);
absl::Status JoinMasters(const uint16_t* param, const uint16_t* remainder, float* master,
                         size_t n, int threads);

// Bytes read plus bytes written per element by one update of `arrays`' form and dtypes: what
// adamw_bench divides by, and what the plan can quote.
size_t CompactAdamWBytesPerElement(const CompactAdamWArrays& arrays);

}  // namespace offload
}  // namespace zerort

#endif  // ZERORT_OFFLOAD_CPU_ADAMW_COMPACT_H_
