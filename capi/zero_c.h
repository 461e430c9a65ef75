/* zero_c.h: the C ABI of the zerort engine, for trainers written in C or bound from other
 * languages (ctypes, cgo, Rust FFI). The same calls as zero/engine.h over opaque handles.
 *
 *   zr_comm* comms[2];
 *   zr_device* device;
 *   zr_comm_group_create(2, 0, comms);      // in-process ranks: one thread per rank
 *   zr_cpu_device_create(1, &device);        // may be shared by every in-process rank
 *   // on rank r's thread:
 *   zr_engine* e;
 *   if (zr_engine_create(json, params, n, comms[r], device, &e) != ZR_OK)
 *     fprintf(stderr, "%s\n", zr_last_error());
 *   zr_engine_init_params(e, my_init, my_data, 1);
 *   for (...) {
 *     forward reading zr_engine_param(); backward writing zr_engine_grad() then
 *     zr_engine_grad_ready() per parameter (zr_engine_gather / zr_engine_release per unit in
 *     stage 3); zr_engine_step(e, &stats);
 *   }
 *   zr_engine_destroy(e);                    // before its communicator and device
 *
 * Errors: every call that can fail returns a zr_status (ZR_OK = 0; the other values mirror
 * absl::StatusCode) and sets a thread-local message, read with zr_last_error(), that names the
 * offending key, value, parameter or rank. No call aborts or throws across this boundary.
 *
 * Buffers: as in zero/engine.h. zr_engine_param() pointers are stable for the engine's lifetime
 * in stages 0-2 and valid between gather and release of their unit in stage 3;
 * zr_engine_grad() pointers are zero-filled when handed out and valid until grad_ready of the
 * last parameter of their unit. Values are in the compute dtype (zr_engine_compute_dtype():
 * bf16 / fp16 as raw uint16_t bits, or float); zr_convert() converts.
 *
 * Thread safety: an engine and a communicator are used by one thread at a time (their rank's);
 * a device may be shared. zr_last_error() is per thread. Collective calls (create,
 * init_params, gather, grad_ready, step, gather_master_weights, the checkpoint calls) must be
 * made by every rank of the group in the same order.
 */
#ifndef ZERORT_CAPI_ZERO_C_H_
#define ZERORT_CAPI_ZERO_C_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Mirrors absl::StatusCode, value for value. */
typedef enum zr_status {
  ZR_OK = 0,
  ZR_CANCELLED = 1,
  ZR_UNKNOWN = 2,
  ZR_INVALID_ARGUMENT = 3,
  ZR_DEADLINE_EXCEEDED = 4,
  ZR_NOT_FOUND = 5,
  ZR_ALREADY_EXISTS = 6,
  ZR_PERMISSION_DENIED = 7,
  ZR_RESOURCE_EXHAUSTED = 8,
  ZR_FAILED_PRECONDITION = 9,
  ZR_ABORTED = 10,
  ZR_OUT_OF_RANGE = 11,
  ZR_UNIMPLEMENTED = 12,
  ZR_INTERNAL = 13,
  ZR_UNAVAILABLE = 14,
  ZR_DATA_LOSS = 15,
  ZR_UNAUTHENTICATED = 16
} zr_status;

/* Element types; values match zerort::DType. */
typedef enum zr_dtype { ZR_F32 = 0, ZR_BF16 = 1, ZR_F16 = 2 } zr_dtype;

/* Memory kinds of the plan; values match memory::MemoryKind. */
typedef enum zr_memory_kind {
  ZR_MEMORY_DEVICE = 0,
  ZR_MEMORY_PINNED_HOST = 1,
  ZR_MEMORY_HOST = 2,
  ZR_NUM_MEMORY_KINDS = 3
} zr_memory_kind;

typedef struct zr_comm zr_comm;     /* one rank's communicator */
typedef struct zr_device zr_device; /* where the engine's buffers live */
typedef struct zr_engine zr_engine; /* one rank's engine */

/* The message of the last call on this thread that returned an error, "" after a call that
 * succeeded. Valid until the next zr_ call on this thread. Never NULL. */
const char* zr_last_error(void);

/* "OK", "INVALID_ARGUMENT", ...: the name of a status code. Never NULL. */
const char* zr_status_name(zr_status status);

/* ---- Communicators and devices ---- */

/* Creates an in-process group of `world_size` communicators, one per rank, written to
 * comms[0..world_size-1]; each is then used by its rank's thread. timeout_ms: how long a
 * collective waits for its peers (0 = the default, 600000). Destroying one rank's communicator
 * while its peers wait makes them fail with ZR_UNAVAILABLE instead of hanging.
 * REQUIRES: world_size >= 1, comms holds world_size pointers. */
zr_status zr_comm_group_create(int world_size, int64_t timeout_ms, zr_comm** comms);
void zr_comm_destroy(zr_comm* comm); /* NULL is a no-op */
int zr_comm_rank(const zr_comm* comm); /* -1 for NULL */
int zr_comm_size(const zr_comm* comm); /* -1 for NULL */

/* The CPU device; threads for its kernels (0 = all cores). */
zr_status zr_cpu_device_create(int threads, zr_device** device);
void zr_device_destroy(zr_device* device); /* NULL is a no-op; after every engine using it */

/* ---- Engine ---- */

/* One parameter tensor. The strings and the shape are copied by zr_engine_create. */
typedef struct zr_param_spec {
  const char* name;      /* unique */
  int ndim;              /* >= 1 */
  const int64_t* shape;  /* ndim entries, each >= 1 */
  const char* module;    /* the layer it belongs to: parameters of one module stay together */
} zr_param_spec;

/* Parses `config_json` (DeepSpeed-style keys, docs/config.md), plans and allocates exactly the
 * plan. `comm` and `device` must outlive the engine. Every rank calls it. Errors: ZR_INVALID_ARGUMENT
 * for a bad config (the message names the key) or parameter list; ZR_RESOURCE_EXHAUSTED when
 * the plan does not fit. */
zr_status zr_engine_create(const char* config_json, const zr_param_spec* params,
                           int num_params, zr_comm* comm, zr_device* device, zr_engine** engine);
void zr_engine_destroy(zr_engine* engine); /* NULL is a no-op */

/* Fills values[0..numel-1] (row-major) with the initial value of parameter `index`. */
typedef void (*zr_init_fn)(void* user, int index, const char* name, int ndim,
                           const int64_t* shape, int64_t numel, float* values);

/* Sets every parameter (master, compute copy, m = v = 0). from_rank0 != 0: only rank 0 calls
 * `init` and its values are broadcast; otherwise every rank calls it and must produce the same
 * values. Collective. */
zr_status zr_engine_init_params(zr_engine* engine, zr_init_fn init, void* user, int from_rank0);

/* Compute-dtype parameter and gradient buffers of parameter i (see "Buffers" above). */
zr_status zr_engine_param(zr_engine* engine, int i, void** out);
zr_status zr_engine_grad(zr_engine* engine, int i, void** out);
/* The gradient of parameter i (or of every parameter of `unit`) is written. A unit whose
 * parameters are all ready is reduced at once. Marking a parameter twice in one micro-step is
 * ZR_FAILED_PRECONDITION; an index outside the model ZR_OUT_OF_RANGE. */
zr_status zr_engine_grad_ready(zr_engine* engine, int i);
zr_status zr_engine_grad_ready_unit(zr_engine* engine, int unit);
/* Stage 3: make `unit`'s parameters readable / let its buffer be reused. No-ops in stages 0-2.
 * Collective. */
zr_status zr_engine_gather(zr_engine* engine, int unit);
zr_status zr_engine_release(zr_engine* engine, int unit);

/* What one zr_engine_step did (zerort::StepStats). */
typedef struct zr_step_stats {
  int boundary;         /* 0: a micro-step inside an accumulation window, nothing applied */
  int skipped;          /* fp16 overflow: the update was skipped on every rank */
  int64_t step;         /* optimizer steps applied so far */
  double loss_scale;    /* scale of this window's gradients (1 unless fp16) */
  double grad_norm;     /* global L2 norm of the unscaled averaged gradients, before clipping */
  double clip_coef;     /* factor applied by gradient clipping (1 = none) */
  int64_t comm_bytes;   /* bytes this rank sent since the previous boundary */
  double reduce_ms;
  double optimizer_ms;
  double gather_ms;
  double total_ms;
} zr_step_stats;

/* Ends a micro-step; applies AdamW on every gradient_accumulation_steps-th call. `stats` may be
 * NULL. Collective. ZR_FAILED_PRECONDITION names the first parameter whose grad_ready is
 * missing. */
zr_status zr_engine_step(zr_engine* engine, zr_step_stats* stats);

/* The full fp32 master weights, concatenated in registration order, into out[0..capacity-1].
 * Collective. ZR_OUT_OF_RANGE when capacity < zr_plan_summary.num_elements. */
zr_status zr_engine_gather_master_weights(zr_engine* engine, float* out, int64_t capacity);

/* ---- Plan and state ---- */

typedef struct zr_plan_summary {
  int stage;                  /* the stage in effect ("auto" resolved) */
  int world_size;
  int rank;
  zr_dtype compute_dtype;
  int num_params;
  int num_units;
  int64_t num_elements;       /* registered elements */
  int64_t padded_elements;    /* over all units, with padding */
  int64_t shard_elements;     /* elements this rank owns */
  int64_t model_state_bytes;  /* params + grads + master + m + v on this rank */
  int64_t comm_bytes_per_step;
  int64_t planned_bytes[ZR_NUM_MEMORY_KINDS];    /* per zr_memory_kind */
  int64_t allocated_bytes[ZR_NUM_MEMORY_KINDS];  /* what the engine really allocated */
} zr_plan_summary;

zr_status zr_engine_plan_summary(const zr_engine* engine, zr_plan_summary* out);
/* The unit (gradient bucket and stage-3 gather unit) parameter i belongs to. */
zr_status zr_engine_unit_of(const zr_engine* engine, int i, int* unit);
/* REQUIRES: engine != NULL (these cannot report an error). */
zr_dtype zr_engine_compute_dtype(const zr_engine* engine);
double zr_engine_loss_scale(const zr_engine* engine); /* 1 unless fp16 */
int64_t zr_engine_step_count(const zr_engine* engine); /* optimizer steps applied */

/* ---- Checkpoints (docs/checkpoints.md) ---- */

/* Saves into root/step_<N>/ (N = zr_engine_step_count) and then points root/latest at it, so
 * `latest` always names a complete checkpoint. Between optimizer steps only
 * (ZR_FAILED_PRECONDITION inside an accumulation window); ZR_ALREADY_EXISTS when `latest`
 * already names step_<N>; an I/O error names the path. Collective. */
zr_status zr_engine_save_checkpoint(zr_engine* engine, const char* root);
/* Loads a checkpoint directory, or a root whose `latest` names one. Stage, precision and
 * config may differ from the saving run's; the world size may differ when allow_reshard != 0.
 * On any error (ZR_NOT_FOUND, ZR_DATA_LOSS naming the damaged file, ZR_FAILED_PRECONDITION for
 * another model or world size) every rank fails alike and the engine is unchanged.
 * Collective. */
zr_status zr_engine_load_checkpoint(zr_engine* engine, const char* path, int allow_reshard);

/* Saves without stopping training. start copies the state into a pinned buffer the
 * checkpointer keeps (asynchronously: the next optimizer update waits for the copies) and
 * returns; a background thread writes the files; finish waits for it and only then moves
 * `latest`. start and finish are collective; call finish before the next start.
 * zr_engine_destroy with a save in flight is safe (it waits for the copies; the save still
 * commits at finish). finish's engine must be the one start was given (ZR_INVALID_ARGUMENT
 * otherwise), or NULL (e.g. once that engine is destroyed). One checkpointer per rank. */
typedef struct zr_checkpointer zr_checkpointer;
zr_status zr_checkpointer_create(zr_checkpointer** out);
/* Waits for a write in flight but never commits it. NULL is a no-op. */
void zr_checkpointer_destroy(zr_checkpointer* checkpointer);
zr_status zr_checkpointer_start(zr_checkpointer* checkpointer, zr_engine* engine,
                                const char* root);
zr_status zr_checkpointer_finish(zr_checkpointer* checkpointer, zr_engine* engine);

/* ---- Helpers ---- */

/* dst[i] = src[i] converted from src_dtype to dst_dtype (round to nearest even, as the engine).
 * REQUIRES: src and dst do not overlap, or are equal with equal element sizes. */
void zr_convert(const void* src, zr_dtype src_dtype, void* dst, zr_dtype dst_dtype, int64_t n);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ZERORT_CAPI_ZERO_C_H_ */
