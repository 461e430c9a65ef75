// memory::Plan: the exact byte layout of one rank's parameters, gradients and optimizer state.
//
// The plan is a pure function of (parameter specs, options): no allocation, no I/O. The engine
// allocates exactly the buffers the plan lists (a test asserts allocated == planned per memory
// kind), and `zerort plan` prints the same plan for any model and world size, so what a user
// reads before renting hardware is what the runtime will really use.
//
// Layout (docs/architecture.md, "One partition scheme for every stage"):
//  - Parameters are grouped into units: flat, contiguous groups following the trainer's modules
//    in reverse registration order (the order backward produces gradients). Consecutive modules
//    are merged while the unit stays within `unit_target_elements`; a module larger than that is
//    split at parameter boundaries. With `unit_per_module` each module is one unit instead.
//    A parameter never spans two units, so param(i) is contiguous.
//  - Each parameter starts at a multiple of `param_alignment` elements inside its unit; each unit
//    is padded to a multiple of world_size * shard_alignment and split into world_size equal
//    shards; rank r owns shard r of every unit. A parameter may straddle shards.
//  - The same units are the gradient buckets (stages 0-2) and the gather units (stage 3) for
//    every stage, so every stage reduces each element in the same order: stages are bit-identical.
//  - The stage 2-3 gradient buckets and stage-3 gather slots come in at most two size classes
//    (Buffer::slot_elements): when a few units are much larger than the rest (GPT-2's tied
//    embedding is 31% of the model), they get slots of their own and the others slots of the
//    largest remaining unit, so one large unit does not size every slot. A unit uses only
//    slots of its class (SlotClassElements), so each class keeps the full slot count for its
//    units: what fit before still fits.
//
//  - Gradients the trainer keeps in its own buffers (ParamSpec::grad_buffer, declared before the
//    plan) are reduced straight from there where the layout allows (Unit::grad_source): such a
//    unit gets no gradient storage of the engine's. The layout itself never depends on it.
//
//   std::vector<ParamSpec> specs = {{"fc1.w", {1024, 512}, "fc1"}, ...};
//   PlanOptions o; o.stage = 2; o.world_size = 8;
//   absl::StatusOr<Plan> plan = MakePlan(specs, o);
//
// Thread safety: MakePlan is a pure function; a Plan is an immutable value.
#ifndef ZERORT_MEMORY_PLAN_H_
#define ZERORT_MEMORY_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "base/dtype.h"
#include "memory/gather_slots.h"

namespace zerort {
namespace memory {

// One named parameter tensor as the trainer registers it.
struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;  // every dimension >= 1; a scalar is {1}
  std::string module;          // the layer it belongs to; parameters of one module stay together
  // >= 0: bytes of activations the trainer's module keeps from forward for backward, per sample
  // of a micro-batch (the planner multiplies by the micro-batch: activations are linear in it,
  // as every term of Korthikanti et al. 2022's count is). Declare it on one parameter of the
  // module, or spread it: the plan sums it over each unit. 0: not declared. Not a buffer the
  // engine allocates: the trainer's own allocator holds activations; the planner counts them
  // against the device budget (zero/planner.h DeviceBudget).
  int64_t activation_bytes_per_sample = 0;
  // A frozen parameter is trained by no one: it has no gradient, no optimizer state (master, m,
  // v) and is never reduced; it is still sharded, gathered and offloaded as any other. Frozen
  // parameters are placed in units of their own, after every trainable unit (see Plan).
  bool frozen = false;
  // Gradient hand-off declared before the plan (Engine::SetGradBuffer): the trainer keeps this
  // parameter's gradient in a device buffer of its own, in the compute dtype, and hands it over
  // every micro-step. `grad_buffer` names that buffer (any name; the parameters that share one
  // allocation give the same one) and `grad_buffer_offset` is the element at which this
  // gradient starts in it, or kGradBufferPacked: right after the previous parameter declared
  // in the same buffer (0 for the first), a buffer packed in registration order as llm.c's
  // grads_memory is. The plan reduces a unit straight from the trainer's buffer where the
  // layout allows (Unit::grad_source) and then allocates no gradient storage of the engine's
  // for it; where it must copy, Unit::grad_copy_reason says why. Empty: the engine's grad(i).
  // Declared ranges of one buffer must not overlap; a frozen parameter declares none.
  std::string grad_buffer;
  int64_t grad_buffer_offset = -1;  // kGradBufferPacked

  // The product of the dimensions, saturating at INT64_MAX instead of overflowing, so that code
  // running before MakePlan (which refuses such shapes, naming them) never has undefined
  // behaviour on a hostile shape.
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) {
      if (__builtin_mul_overflow(n, d, &n)) return INT64_MAX;
    }
    return n;
  }
};

// ParamSpec::grad_buffer_offset: packed after the previous parameter of the same buffer.
constexpr int64_t kGradBufferPacked = -1;

// Where a buffer lives. On the CPU device, kDevice is ordinary host memory owned by the engine.
// kNvme: a swap file under nvme_path (NVMe offload, nvme/io.h), not memory at all.
enum class MemoryKind { kDevice = 0, kPinnedHost = 1, kPageableHost = 2, kNvme = 3 };
constexpr int kNumMemoryKinds = 4;
const char* MemoryKindName(MemoryKind kind);  // "device", "pinned_host", "host", "nvme"

// What a buffer holds. Model state is params + grads + master + m + v (what the ZeRO paper
// counts); the other classes are the working buffers that estimators usually forget.
enum class BufferClass {
  kParams,           // compute-dtype parameters (full, or the owned shard in stage 3)
  kGrads,            // compute-dtype gradients (full, or the owned shard in stages 2-3; the
                     // shard in host memory with offload_optimizer: gradient offload)
  kMaster,           // fp32 master weights of the owned shard (mixed precision only); with a
                     // compact master form (MasterForm) and a host optimizer beside device
                     // parameters, the master's bf16 part (the host's copy of the shard)
  kExpAvg,           // Adam m of the owned shard, fp32 (bf16 with PlanOptions::moment_dtype)
  kExpAvgSq,         // Adam v of the owned shard, fp32 (bf16 with PlanOptions::moment_dtype)
  kMasterRemainder,  // MasterForm::kBf16Remainder: the low 16 bits of each owned master (the
                     // 2-byte dtype column says bf16; the elements are raw uint16_t)
  kGradAccumulator,  // reduced-gradient accumulator (gradient_accumulation_steps > 1, or fp32;
                     // stage 1 with offload_optimizer: always, in host memory); stage 1
                     // without either, "grad_reduced": the reduced shards of units reduced in
                     // place in the trainer's buffer with padding (Unit::grad_shard_offset)
  kGradWire,         // fp32 scratch of one unit: fp32 reduction on the wire / fp32 accumulation
  kGradLocal,        // full gradients summed locally over a window's micro-steps (stages 0-1)
  kGradBucket,       // full-unit gradient buffers that backward writes into (stages 2-3)
  kGatherBuffer,     // full-unit parameter buffers for gathered units (stage 3)
  kPersistentParams, // whole small units kept gathered on every rank (stage 3)
  kOffloadStaging,   // pinned chunks that gradients and new parameters pass through (offload)
  kNormTable,        // (world, units + 1) fp32: per-shard norm partials and finite flags
  kNvmeStaging,      // pinned: master|m|v of one unit per slot, read ahead / written behind
  kNvmeSecondCopy,   // nvme: the copy of master|m|v a step writes into, and 4 KiB padding
  kNvmeParamPadding, // nvme: the 4 KiB padding of each unit's parameter shard in the file
  kNvmeParamBuffers, // pinned: offload_param.buffer_count pieces of parameter shards in flight
  kGradAccumStage,   // gradient offload with accumulation: one unit's reduced shard on the
                     // device, where a micro-step adds into the host-resident sum
  kNormPartials,     // gradient offload, pinned: (units) fp32 squared-norm partials, then one
                     // finiteness byte per unit, written by the device as each shard leaves
  kHpzSecondary,     // hpZ (stage 3): this rank's 1/K of every gathered unit, kept from its
                     // first all-gather after an update for the gathers that stay in the node
  kGatherStage,      // MiCS hierarchical gather: the across-node step's output of the largest
                     // unit (padded / ranks_per_node), before it moves to its place in the unit
};
const char* BufferClassName(BufferClass c);
bool IsModelState(BufferClass c);

// One allocation the engine will make.
struct Buffer {
  std::string name;  // stable identifier, e.g. "params", "grad_bucket"
  BufferClass cls;
  MemoryKind kind;
  DType dtype;
  int64_t elements = 0;  // total elements over all `count` copies
  int64_t count = 1;     // number of slots (buckets, gather slots, staging chunks)
  int64_t bytes = 0;
  // Slots of two size classes (grad_bucket, gather_buffer): the elements of each of the
  // `count` slots, laid out one after the other, smaller class first. Empty when the slots are
  // equal (elements / count each).
  std::vector<int64_t> slot_elements;
};

// SlotClassElements (memory/gather_slots.h): the slot size a unit uses in a buffer of size
// classes.

// How the optimizer stores the master weight of an owned element (docs/compact_state.md; the
// same values as offload::MasterForm, which the kernels take). The compact forms need bf16
// parameters: their master is the owned bf16 parameter shard, plus a 16-bit remainder
// (kBf16Remainder: the fp32 master bit for bit; zerort.store_param_remainders) or alone
// (kBf16Stochastic: rounded stochastically; bf16.bf16_master_weights_and_grads).
enum class MasterForm { kF32 = 0, kBf16Remainder = 1, kBf16Stochastic = 2 };
// "fp32", "bf16 + remainder", "bf16 (stochastic rounding)".
const char* MasterFormName(MasterForm form);

// Everything that changes the layout. zero/planner fills it from the JSON config.
struct PlanOptions {
  int stage = 0;                  // 0..3
  int world_size = 1;             // >= 1
  int rank = 0;                   // 0..world_size-1
  DType compute_dtype = DType::kBF16;  // kF32: plain fp32 training, no master copy (unless
                                       // offloaded or offload_param_nvme)
  // Stages 1-3: master + m + v in host memory, and the reduced gradient shard too (gradient
  // offload, as DeepSpeed does): each unit's shard is copied to the host as its reduction
  // completes, so the device keeps only the reduction buckets (stage 1: its full gradients).
  // With gradient_accumulation_steps > 1 the sum lives on the host and each micro-step adds on
  // the device through grad_accum_stage (one unit's shard), so the arithmetic is unchanged.
  bool offload_optimizer = false;
  // offload_optimizer.ratio, DeepSpeed's meaning: the fraction of this rank's optimizer state
  // that is offloaded, in [0, 1] (1: all of it, 0: none). Below 1, whole trainable units keep
  // their master, m, v and reduced gradient shard on the device, as without offload
  // (Unit::offloaded false): in layout order, each unit that still fits, while the kept shards
  // sum to at most floor((1 - ratio) x the trainable shard). Every rank keeps the same units (their
  // shards are equal), and both parts run the same AdamW, so the bits do not depend on it.
  double offload_optimizer_ratio = 1.0;
  bool offload_param = false;          // stage 3: the parameter shard lives in host memory
  // With offload_param: the parameter shard lives in the swap file (MemoryKind::kNvme), each
  // unit's padded to kNvmeAlignment, after the optimizer state if that is on NVMe too; it moves
  // through offload_param_buffer_count pinned buffers of one piece each (nvme_piece_elements,
  // at most the largest padded shard). The optimizer step runs on the host (offload_optimizer)
  // or on the device; either way there is an fp32 master (also in fp32 training), from which
  // the new shard is written to the file.
  bool offload_param_nvme = false;
  int offload_param_buffer_count = 5;
  // With offload_optimizer: master, m and v live in a swap file (MemoryKind::kNvme), two copies
  // of each unit's master|m|v, each array padded to kNvmeAlignment bytes (NvmeUnitStride); with
  // a compact form, the arrays of OptimizerStateForm (NvmeArrayStride).
  bool offload_optimizer_nvme = false;
  // NVMe offload: unit shards are streamed in pieces of at most this many elements (rounded
  // down to a multiple of 1024, at least 1024; 0: whole shards), bounding the pinned slots.
  int64_t nvme_piece_elements = 0;
  bool pin_memory = true;              // offloaded state in pinned (true) or pageable host memory
  // Pinned staging chunks of the offload pipeline, one unit's new parameter shard each (none
  // when offload_param keeps the shard in host memory: AdamW writes it in place).
  int offload_buffer_count = 4;
  int gradient_accumulation_steps = 1;
  // data_types.grad_accum_dtype == fp32 (mixed precision only): the reduced gradients of the
  // owned shard are kept and accumulated across micro-steps in fp32; the optimizer reads them
  // in fp32 (with offload_optimizer, the pipeline's staging carries them as fp32).
  bool fp32_grad_accum = false;
  // communication_data_type == fp32 (mixed precision only): gradients are converted to fp32
  // before their reduction and reduced in fp32 (twice the bytes on the wire).
  bool fp32_grad_comm = false;
  // zerort.local_grad_accumulation (stages 0-1, gradient_accumulation_steps > 1): micro-steps
  // add their gradients into a full-size local buffer (grad_local, in ReducedGradDType) without
  // communicating, and the window's last micro-step reduces the sum once: one reduction per
  // window instead of one per micro-step. Stages 2-3 are refused (their gradients are shards).
  bool local_grad_accumulation = false;
  int64_t unit_target_elements = 500000000;  // reduce_bucket_size
  // Each module its own unit: modules are neither merged nor split, and unit_target_elements
  // is not read. zero/planner sets it when reduce_bucket_size is "auto" (docs/config.md).
  bool unit_per_module = false;
  int64_t shard_alignment = 128;  // elements; shard starts are multiples of this (256 B in bf16)
  int64_t param_alignment = 8;    // elements; parameter starts inside a unit
  int grad_bucket_count = 2;      // stages 2-3: full-unit gradient buffers in flight
  int64_t persistence_threshold = 100000;   // stage 3: units this small stay whole
  int64_t prefetch_elements = 50000000;     // stage 3: stage3_prefetch_bucket_size
  int64_t max_live_elements = 1000000000;   // stage 3: stage3_max_live_parameters
  // Compact optimizer state (docs/compact_state.md, OptimizerStateForm below): how each owned
  // master weight is stored, and the dtype of Adam's m and v (kF32, or kBF16:
  // bf16.bf16_optimizer_states). REQUIRES compute_dtype kBF16 unless both are kF32, and
  // master_form kF32 with offload_param_nvme (the errors name the config keys).
  MasterForm master_form = MasterForm::kF32;
  DType moment_dtype = DType::kF32;
  // HSDP / MiCS (zero_optimization.mics_shard_size): ranks are cut into groups of this many
  // consecutive ranks; stages 1-3 shard within a group and replicate across groups (rank r
  // owns shard r % shard_group_size of every unit; its replicas r +- k * shard_group_size own
  // the same). 0 or world_size: flat. Units stay padded to a multiple of world_size *
  // shard_alignment, so a group shard is exactly world_size / shard_group_size
  // consecutive flat shards, which keeps the gradient norm's partials those of
  // the flat layout (bitwise the same norm). REQUIRES: divides world_size; stages 1-3.
  int shard_group_size = 0;
  // hpZ (ZeRO++'s zero_hpz_partition_size K, stage 3): the primary partition stays flat over
  // the world; a unit's first all-gather after an update also keeps this rank's 1/K of it
  // (rank r: block r % K of K) in hpz_secondary, and every later gather of the unit before the
  // next update all-gathers those blocks within the K consecutive ranks r - r % K ... (a node).
  // 1: off. REQUIRES: divides world_size; stage 3; flat (shard_group_size 0 or world_size);
  // no offload_param.
  int hpz_partition_size = 1;
  // MiCS's mics_hierarchical_params_gather: each all-gather within a shard group runs in two
  // steps, across nodes among the group's ranks of one node position (into gather_stage), then
  // within the node. REQUIRES: shard_group_size > 0 and a multiple of ranks_per_node > 0
  // larger than it (the group spans nodes).
  bool hierarchical_gather = false;
  // Consecutive ranks per node (zerort.ranks_per_node), 0: not known. When known the plan
  // splits comm_bytes_per_step by link class (comm_bytes_intra/inter_node_per_step).
  // REQUIRES: 0 or a divisor of world_size.
  int ranks_per_node = 0;
};

// Where parameter i lives.
struct ParamLayout {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int unit = 0;
  int64_t offset_in_unit = 0;  // elements from the unit's start
  int64_t flat_offset = 0;     // elements from the start of the full (all-units) buffer
  // Gradient hand-off (ParamSpec::grad_buffer): the trainer's buffer, an index into
  // Plan::grad_buffers (-1: none declared), and the element where this gradient starts in it
  // (kGradBufferPacked resolved).
  int grad_buffer = -1;
  int64_t grad_buffer_offset = 0;
};

// Where a unit's gradients come from in backward (ParamSpec::grad_buffer).
enum class GradSource {
  kEngine,    // grad(i), the engine's buffers (or a SetGradBuffer the plan was not told of)
  kInPlace,   // reduced straight from the trainer's declared buffer: its parameters are
              // consecutive there, as the unit lays them out, and the engine holds no
              // gradient storage for it (no full gradients in stages 0-1, no bucket in 2-3)
  kCopied,    // declared, but copied into the engine's buffer at GradReady (grad_copy_reason)
};
const char* GradSourceName(GradSource s);  // "engine", "in_place", "copied"

// A flat group of parameters: a gradient bucket and a gather unit.
struct Unit {
  std::string name;              // "<first module>" or "<first>..<last>" when merged
  std::vector<int> params;       // indices into Plan::params, in layout order
  int64_t numel = 0;             // elements including gaps between parameters
  int64_t padded = 0;            // multiple of world_size * shard_alignment
  int64_t shard = 0;             // padded / ShardGroupSize (padded / world_size when flat)
  int64_t flat_offset = 0;       // start in the full buffer (sum of earlier units' padded)
  int64_t shard_offset = 0;      // start of this unit's shard in a rank's shard buffers
  // Start in the flat parameter order that no world size or stage changes: the sum of earlier
  // units' numel (not padded). Element j of the padded unit has global index index_offset + j:
  // stochastic rounding draws by it (offload::StochasticRounding::first_index), so every stage
  // and world size rounds each element alike. Padding elements share indices with the next
  // unit's first ones; they are zero and stay zero under any draw.
  int64_t index_offset = 0;
  bool persistent = false;       // stage 3 only: kept whole on every rank
  int64_t activation_bytes_per_sample = 0;  // sum of its parameters' declarations
  bool frozen = false;           // holds frozen parameters only (no gradient, no optimizer state)
  // Gradient hand-off (ParamSpec::grad_buffer). kInPlace with padding (padded > numel): the
  // padding lies over the trainer's buffer past the unit's last element, over the gradients
  // of `grad_room_params` (other units' parameters declared there): the engine zero-fills it
  // and reduces the unit only after theirs, in any order the trainer calls GradReady.
  GradSource grad_source = GradSource::kEngine;
  std::string grad_copy_reason;         // kCopied: why, naming the tensor and the rule
  std::vector<int> grad_room_params;    // kInPlace: parameters under its padding
  // Stages 0-1: where the unit's full gradients start in the `grads` buffer, which holds only
  // the units not reduced in place; -1 for none (kInPlace, frozen, stages 2-3).
  int64_t grad_offset = -1;
  // Stage 1 without accumulation, kInPlace with padding: where its reduced shard starts in the
  // `grad_reduced` buffer (the padding lies over gradients of other units, so the reduced
  // gradient cannot stay in the trainer's buffer); -1 otherwise.
  int64_t grad_shard_offset = -1;
  // offload_optimizer: this unit's master, m, v and reduced gradient shard live in host memory
  // or the NVMe file, updated by the host AdamW (true), or stay on the device (false: kept
  // there by offload_optimizer_ratio < 1). False without offload and for frozen units.
  bool offloaded = false;
  // Stages 1-3, trainable units: where this unit's master, m, v (and stage 2-3 gradient shard,
  // stage-1 accumulator) start in the buffers of its part, the offloaded one or the one kept on
  // the device; equal to shard_offset when one part holds every unit.
  int64_t state_offset = 0;
};

// What the trainer declared of its gradients (ParamSpec::grad_buffer), per rank.
struct GradHandoff {
  int tensors = 0;              // parameters with a declared gradient buffer
  int tensors_in_place = 0;     // of them, in units reduced straight from the trainer's buffer
  int64_t bytes = 0;            // their gradients, compute dtype: the trainer's memory
  int64_t bytes_in_place = 0;
  int64_t bytes_copied = 0;     // bytes - bytes_in_place: copied at GradReady
  // The engine's gradient storage (GradStorageBytes) of this plan, and of the same plan with
  // nothing declared: what the declaration saves.
  int64_t engine_grad_bytes = 0;
  int64_t engine_grad_bytes_undeclared = 0;
};

struct Plan {
  PlanOptions options;
  std::vector<ParamLayout> params;
  std::vector<Unit> units;
  std::vector<Buffer> buffers;

  int64_t num_elements = 0;      // elements the trainer registered (P); not a tensor count
  int64_t padded_elements = 0;   // sum of units' padded sizes (E >= P)
  int64_t shard_elements = 0;    // E / ShardGroupSize: elements this rank owns
  int64_t max_unit_elements = 0; // largest padded unit: the size of the largest bucket or slot
  int64_t gather_slots = 0;      // stage 3: all classes together
  // Frozen parameters (ParamSpec::frozen) sit in units [trainable_units, units.size()), after
  // every trainable unit, so that gradients and optimizer state cover a prefix of the flat and
  // shard layouts: the first trainable_padded_elements (trainable_shard_elements per rank).
  // Without frozen parameters these equal units.size(), padded_elements and shard_elements.
  int trainable_units = 0;
  int64_t trainable_padded_elements = 0;
  int64_t trainable_shard_elements = 0;
  int64_t frozen_elements = 0;          // registered elements of frozen parameters
  int64_t frozen_state_bytes_saved = 0; // grads + master + m + v this rank would hold for them

  int64_t bytes_by_kind[kNumMemoryKinds] = {0, 0, 0, 0};
  int64_t model_state_bytes = 0;   // params + grads + master + m + v held by this rank
  // Bytes this rank sends per optimizer step (nccl-tests' convention: (n-1)/n of each
  // reduce-scatter/all-gather): the collectives on gradients and parameters, within and across
  // groups, plus the control exchange. Exact, byte for byte, for a trainer that calls Step()
  // once per micro-step and (stage 3) gathers in the standard order: in every micro-step,
  // forward holds units from the last to the first (the plan lists them in backward order),
  // backward from the first to the last, each gathered, used and released before the next
  // (Gather/Release or AcquireParams/ReleaseParams). A unit still in its gather slot is not
  // gathered again, so the count follows the engine's slots (stage3_gathers_per_step); a trainer
  // that holds units in another order, or several at once, sends other stage-3 gather bytes.
  int64_t comm_bytes_per_step = 0;
  // Stage 3: all-gathers of non-persistent units per step in the standard order (between
  // units x 1 and units x 2 x gradient_accumulation_steps: at each of a window's 2 x gas - 1
  // turns of direction the units the slots still hold are not gathered again, and the update
  // empties the slots). Persistent units' gathers after the update are not counted here.
  int64_t stage3_gathers_per_step = 0;
  // The control exchange, part of comm_bytes_per_step and of the link class the world's ranks
  // span (inter-node unless the world is one node), not of within/across groups: every rank's
  // row of the norm table ((units + 1) fp32, stages 1-3) and AgreeBeforeUpdate's six 64-bit
  // words, all-gathered over the world, (world - 1) copies sent; with NVMe offload one 64-bit
  // status agreement more after each stage-3 gather of a shard read from the file and after
  // each part of the update that writes it. 0 at world 1. For an applied step through Step():
  // a skipped step (fp16 overflow) sends no AgreeBeforeUpdate, and the split step
  // (ComputeGradNorm, then ApplyStep or SkipStep) two 64-bit words more.
  int64_t comm_control_bytes_per_step = 0;
  // comm_bytes_per_step less the control exchange, by link class: between ranks of one shard
  // group (all of it when flat) and between groups. HSDP counts its gradient reduction as NCCL
  // runs it: a reduce-scatter in the group, then an all-reduce of the shard across the groups'
  // same-position ranks.
  int64_t comm_bytes_within_group_per_step = 0;
  int64_t comm_bytes_across_groups_per_step = 0;
  // With options.ranks_per_node: comm_bytes_per_step again (the control exchange included), by
  // whether a collective's ranks all sit in one node (intra) or not (inter; its every byte
  // counted there, as the slowest link it uses sets its time). Both 0 when ranks_per_node is 0.
  // What comm::CountLinkBytes measures, class for class (zero/engine_link_bytes_test.cc).
  int64_t comm_bytes_intra_node_per_step = 0;
  int64_t comm_bytes_inter_node_per_step = 0;
  // Offload: device<->host copies per step: gradient shards down in every micro-step (and,
  // accumulating, the running sum up for each after the first), parameter shards up.
  int64_t host_transfer_bytes_per_step = 0;
  // The optimizer state's split (PlanOptions::offload_optimizer_ratio): elements of the trainable
  // shard (St; the trainable padded elements in stage 0) whose optimizer state is offloaded and
  // kept on the device (without offload_optimizer: 0 and all of it), and the bytes each part
  // holds for them: master, m and v, and the reduced gradient each keeps apart (the stage 2-3
  // gradient shard, the stage-1 accumulator). Every buffer counted here is in bytes_by_kind too.
  int64_t offloaded_state_elements = 0;
  int64_t device_state_elements = 0;
  int64_t offloaded_state_bytes = 0;
  int64_t device_state_bytes = 0;
  // The fraction of the optimizer state actually offloaded: offloaded / (offloaded + device)
  // elements, at least options.offload_optimizer_ratio (whole units; 0 without offload).
  double offload_ratio_achieved() const {
    const int64_t all = offloaded_state_elements + device_state_elements;
    return all == 0 ? 0.0 : static_cast<double>(offloaded_state_elements) / all;
  }
  // Sum of ParamSpec::activation_bytes_per_sample: 0 when the trainer declared none. Not part of
  // bytes_by_kind, which holds only what the engine allocates.
  int64_t activation_bytes_per_sample = 0;
  // The trainer's gradient buffers (ParamSpec::grad_buffer), in order of first declaration,
  // and what they hold.
  std::vector<std::string> grad_buffers;
  GradHandoff grad_handoff;

  int64_t device_bytes() const { return bytes_by_kind[0]; }
  int64_t pinned_host_bytes() const { return bytes_by_kind[1]; }
  int64_t host_bytes() const { return bytes_by_kind[2]; }
  int64_t nvme_bytes() const { return bytes_by_kind[3]; }
  // First buffer of this class, or nullptr.
  const Buffer* Find(BufferClass cls) const;
};

// Bytes of the engine's gradient storage in `plan`, every memory kind: full gradients, the
// reduced shard, accumulators, buckets, the fp32 wire, local sums, the offload stage.
int64_t GradStorageBytes(const Plan& plan);

// Stages 0-1 without accumulation keep a unit's reduced gradient where it was reduced, unless
// the unit is offloaded (Unit::offloaded: gradient offload copies it to host memory; a unit
// that offload_optimizer.ratio < 1 keeps on the device is as without offload): for a unit
// reduced in place that fills its padded size, in the trainer's buffer (ReducedInTrainerBuffer),
// which then stays the engine's until the step has read it. Elsewhere the trainer's buffer is
// only read (and used as scratch) by the reduction, offloaded units' included.
// REQUIRES: `unit` of a plan that MakePlan has split (Unit::offloaded set).
bool GradResultsInTrainerBuffer(const PlanOptions& o, const Unit& unit);
bool ReducedInTrainerBuffer(const Plan& plan, const Unit& unit);

// Where the optimizer keeps the state of one owned element under o's form (PlanOptions::
// master_form, moment_dtype) and offload: the arrays of its own storage (device or host memory,
// or the NVMe file), in the order the file and its slots keep them:
//   [master: fp32, or the master's bf16 part]  [remainder]  m  v
// The master's bf16 part is the owned bf16 parameter shard itself (no array of its own) where
// the layout keeps that shard beside the optimizer: AdamW on the device (the shard in device
// memory, or in host memory with offload_param "cpu"), or AdamW on the host with the shard in
// host memory (offload_optimizer and offload_param "cpu"). A host optimizer beside device
// parameters keeps its own bf16 copy (uploaded as the new parameters), and so does NVMe state,
// whose file must keep the previous step's master when a step fails.
struct OptimizerStateForm {
  MasterForm master = MasterForm::kF32;
  DType moment_dtype = DType::kF32;
  bool master_in_params = false;  // compact master whose bf16 part is the parameter shard

  bool compact() const { return master != MasterForm::kF32 || moment_dtype != DType::kF32; }
  bool master_array() const { return master == MasterForm::kF32 || !master_in_params; }
  DType master_dtype() const { return master == MasterForm::kF32 ? DType::kF32 : DType::kBF16; }
  bool remainder_array() const { return master == MasterForm::kBf16Remainder; }
  // Bytes per element of each array, in order ({4, 4, 4} for the fp32 form).
  std::vector<int> ElementBytes() const;
  // Their sum: the optimizer's bytes per owned element (12 for fp32; 4 for the stochastic bf16
  // master in the parameter shard with bf16 moments).
  int64_t BytesPerElement() const;
};
OptimizerStateForm StateFormOf(const PlanOptions& o);
// The form of one part of the state under offload_optimizer (Unit::offloaded): the offloaded
// units' (`offloaded`: StateFormOf(o)), or that of the units offload_optimizer_ratio < 1 keeps on
// the device, which is the form without offload (a compact master in the parameter shard, where
// the device AdamW updates it). Without offload_optimizer both are StateFormOf(o).
OptimizerStateForm StateFormOf(const PlanOptions& o, bool offloaded);
// One line naming the form and its bytes, e.g. "optimizer state: bf16 + remainder master in
// the parameter shard, bf16 moments: 6 bytes per parameter beside the 2-byte parameter".
std::string StateFormDescription(const PlanOptions& o);

// HSDP: the ranks that shard a unit between them (world_size when flat), and this rank's shard
// (its position in its group: rank % ShardGroupSize).
inline int ShardGroupSize(const PlanOptions& o) {
  return o.shard_group_size > 0 ? o.shard_group_size : o.world_size;
}
inline int ShardIndex(const PlanOptions& o) { return o.rank % ShardGroupSize(o); }
// More than one shard group: stages 1-3 replicate the group's shards across groups.
inline bool Hierarchical(const PlanOptions& o) { return ShardGroupSize(o) < o.world_size; }
// hpZ: stage-3 gathers after a unit's first one since an update stay within K ranks.
inline bool Hpz(const PlanOptions& o) { return o.hpz_partition_size > 1 && o.stage == 3; }

// The dtype of the reduced gradients the optimizer reads (fp32 with fp32_grad_accum in mixed
// precision, else the compute dtype), and the dtype gradients are reduced in on the wire.
DType ReducedGradDType(const PlanOptions& o);
// Whether the plan holds grad_local: local_grad_accumulation with more than one micro-step.
bool LocalAccumulation(const PlanOptions& o);
// Whether the reduced gradient shard lives in host memory (gradient offload): with
// offload_optimizer, always, as in DeepSpeed; there is no key to keep it on the device.
// With offload_optimizer_ratio < 1 only the offloaded units' shards (Unit::offloaded) go there;
// the units kept on the device keep theirs as without offload.
inline bool GradOffload(const PlanOptions& o) { return o.offload_optimizer && o.stage >= 1; }
DType GradWireDType(const PlanOptions& o);

// NVMe offload: direct I/O needs offsets and sizes in multiples of 4 KiB.
constexpr int64_t kNvmeAlignment = 4096;
// Bytes of one fp32 array of an `shard_elements` unit shard in the swap file: rounded up to
// kNvmeAlignment. A unit's master|m|v take 3 strides; a copy of the state the sum over units.
inline int64_t NvmeUnitStride(int64_t shard_elements) {
  return (shard_elements * 4 + kNvmeAlignment - 1) / kNvmeAlignment * kNvmeAlignment;
}
// The same for an array of `elements` of `element_bytes` each (a compact form's 2-byte arrays).
inline int64_t NvmeArrayStride(int64_t elements, int64_t element_bytes) {
  return (elements * element_bytes + kNvmeAlignment - 1) / kNvmeAlignment * kNvmeAlignment;
}

// NVMe parameter offload: a shard of `bytes` in the file, padded to kNvmeAlignment; and the
// bytes of one pinned buffer: nvme_piece_elements in the compute dtype rounded down to
// kNvmeAlignment (at least that), at most the largest padded shard.
inline int64_t NvmeParamBytes(int64_t bytes) {
  return (bytes + kNvmeAlignment - 1) / kNvmeAlignment * kNvmeAlignment;
}
int64_t NvmeParamPieceBytes(const PlanOptions& o, int64_t largest_padded_shard);

// The piece sizes a shard of `shard_elements` is streamed in (see nvme_piece_elements).
std::vector<int64_t> NvmePieces(int64_t shard_elements, int64_t piece_elements);

// Builds the plan. Errors (InvalidArgument) name the offending option or parameter:
// an empty spec list, a zero or negative dimension, a negative activation_bytes_per_sample, a
// duplicate parameter name, a stage outside
// 0..3, rank outside the world, offload_param below stage 3, offload_optimizer_nvme without
// offload_optimizer, offload_param_nvme without offload_param, an offload_optimizer_ratio outside
// [0, 1], a non-positive alignment, and a model in which every parameter is frozen, frozen
// parameters with NVMe offload, a grad_buffer_offset below kGradBufferPacked, declared gradients
// that overlap in one trainer buffer (naming both), and a model or options so large that a size
// would exceed 2^63-1 ("the plan's <quantity> exceeds 2^63-1: ..."); every size is computed with
// overflow checks, so none is ever wrapped.
absl::StatusOr<Plan> MakePlan(absl::Span<const ParamSpec> specs, const PlanOptions& options);

}  // namespace memory
}  // namespace zerort

#endif  // ZERORT_MEMORY_PLAN_H_
