// UnitContext: what every per-unit mechanism of the engine (gradient buckets, the parameter
// gatherer) needs to move a unit: the plan, the communicator, the device, the stream ordering
// and the step timer, plus the plan's constants they branch on.
//
// Thread safety: immutable; the pointed-to objects are the engine's (one thread per rank).
#ifndef ZERORT_ZERO_INTERNAL_UNIT_CONTEXT_H_
#define ZERORT_ZERO_INTERNAL_UNIT_CONTEXT_H_

#include <cstddef>

#include "base/dtype.h"
#include "comm/communicator.h"
#include "device/device.h"
#include "memory/plan.h"
#include "zero/internal/step_timer.h"
#include "zero/internal/stream_order.h"

namespace zerort {
namespace zero_internal {

struct UnitContext {
  // Every pointer must outlive the objects built on this context.
  UnitContext(const memory::Plan& plan, comm::Communicator* comm, Device* device,
              StreamOrder* streams, StepTimer* timer)
      : plan(plan),
        comm(comm),
        device(device),
        streams(streams),
        timer(timer),
        rank(memory::ShardIndex(plan.options)),
        stage(plan.options.stage),
        cdt(plan.options.compute_dtype),
        c(DTypeSize(cdt)) {}

  // Element `elems` of a compute-dtype buffer.
  char* At(char* base, int64_t elems) const { return base + elems * static_cast<int64_t>(c); }

  const memory::Plan& plan;
  comm::Communicator* const comm;
  Device* const device;
  StreamOrder* const streams;
  StepTimer* const timer;
  // rank: the shard of every unit this rank owns, its block in a unit-wide buffer: its rank,
  // or with HSDP its position in its shard group (memory::ShardIndex).
  const int rank, stage;
  const DType cdt;  // compute dtype
  const size_t c;   // its size in bytes
};

}  // namespace zero_internal
}  // namespace zerort

#endif  // ZERORT_ZERO_INTERNAL_UNIT_CONTEXT_H_
