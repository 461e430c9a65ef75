#include "zero/internal/shard_layout.h"

namespace zerort {
namespace zero_internal {
namespace {

Region RegionOf(const memory::Plan& plan, const memory::Unit& unit, const ModelStateBuffers& b) {
  const memory::PlanOptions& o = plan.options;
  const size_t c = DTypeSize(o.compute_dtype);
  auto at = [c](char* base, int64_t elems) { return base + elems * static_cast<int64_t>(c); };
  const DType gdt = memory::ReducedGradDType(o);
  const int64_t gs = static_cast<int64_t>(DTypeSize(gdt));
  auto at_grad = [gs](char* base, int64_t elems) { return base + elems * gs; };
  const bool accumulate = o.gradient_accumulation_steps > 1 || gdt != o.compute_dtype;
  // Gradient offload: stage 1's reduced shard lives in the (host) accumulator even without
  // accumulation; stages 2-3 keep it in grad_shard, which is then in host memory. A unit kept
  // on the device under offload_optimizer.ratio < 1 has its arrays in the kept part's buffers.
  const bool stage1_accum = accumulate || unit.offloaded;
  const bool kept = o.offload_optimizer && !unit.offloaded;
  char* const grads = kept ? b.kept.grads : b.grads;
  char* const accum = kept ? b.kept.accum : b.accum;
  float* const master = kept ? b.kept.master : b.master;
  char* const m = kept ? b.kept.m : b.m;
  char* const v = kept ? b.kept.v : b.v;
  uint16_t* const master_bf16 = kept ? b.kept.master_bf16 : b.master_bf16;
  uint16_t* const remainder = kept ? b.kept.remainder : b.remainder;
  Region r;
  r.offloaded = unit.offloaded;
  r.grad_dtype = gdt;
  r.whole_unit = o.stage == 0;
  r.n = r.whole_unit ? unit.padded : unit.shard;
  // HSDP: the shard of this rank's position in its group, the same as its replicas'.
  const int64_t shard_index = memory::ShardIndex(o);
  r.unit_begin = r.whole_unit ? 0 : shard_index * unit.shard;
  r.owned_begin = r.whole_unit ? shard_index * unit.shard : 0;
  r.frozen = unit.frozen;
  r.first_index = unit.index_offset + r.unit_begin;
  if (b.params != nullptr) {
    r.param = o.stage == 3 ? at(b.params, unit.shard_offset)
                           : at(b.params, unit.flat_offset + r.unit_begin);
  }
  if (r.frozen) return r;  // parameters only
  // The full gradients hold only the units not reduced in place (grad_offset < 0): without
  // accumulation those keep their result in the trainer's buffer (SetGradInTrainerBuffer).
  auto full = [&](int64_t within) {
    return unit.grad_offset < 0 ? nullptr : at(b.grads, unit.grad_offset + within);
  };
  switch (o.stage) {
    case 0:
      r.grad = accumulate ? at_grad(b.accum, unit.flat_offset) : full(0);
      break;
    case 1:
      // grad_reduced (Unit::grad_shard_offset) is the plan's device accumulator buffer where
      // there is no accumulator: `accum`, or the kept part's under offload_optimizer.
      r.grad = stage1_accum                 ? at_grad(accum, unit.state_offset)
               : unit.grad_shard_offset >= 0 ? at_grad(accum, unit.grad_shard_offset)
                                             : full(r.unit_begin);
      break;
    default:
      r.grad = at_grad(grads, unit.state_offset);
      break;
  }
  // Optimizer state is the concatenation of the owned regions (of each part), in the part's
  // form: a unit kept on the device has the form without offload.
  const int64_t optim = r.whole_unit ? unit.flat_offset : unit.state_offset;
  const memory::OptimizerStateForm form = memory::StateFormOf(o, /*offloaded=*/!kept);
  r.master_form = form.master;
  r.moment_dtype = form.moment_dtype;
  if (form.master_in_params) r.master_bf16 = reinterpret_cast<uint16_t*>(r.param);
  if (m == nullptr) return r;  // NVMe offload: the optimizer state is in a file
  const int64_t mb = static_cast<int64_t>(DTypeSize(form.moment_dtype));
  r.m = m + optim * mb;
  r.v = v + optim * mb;
  if (form.master != memory::MasterForm::kF32) {
    if (!form.master_in_params) r.master_bf16 = master_bf16 + optim;
    if (remainder != nullptr) r.remainder = remainder + optim;
    return r;
  }
  r.params_are_master = master == nullptr;
  r.master = r.params_are_master ? reinterpret_cast<float*>(r.param) : master + optim;
  return r;
}

}  // namespace

void ShardLayout::SetGradInTrainerBuffer(int unit, char* unit_base) {
  Region& r = regions_[unit];
  // Stage 0 reduces the whole unit there; stage 1 this rank's block of it.
  const int64_t es = static_cast<int64_t>(DTypeSize(r.grad_dtype));
  r.grad = unit_base == nullptr ? nullptr : unit_base + r.unit_begin * es;
}

ShardLayout::ShardLayout(const memory::Plan& plan, const ModelStateBuffers& buffers) {
  regions_.reserve(plan.units.size());
  for (const memory::Unit& unit : plan.units) regions_.push_back(RegionOf(plan, unit, buffers));
}

}  // namespace zero_internal
}  // namespace zerort
