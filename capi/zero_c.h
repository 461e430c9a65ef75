/* zero_c.h: the C ABI of the zerort engine, for trainers written in C or bound from other
 * languages (ctypes, cgo, Rust FFI). The same calls as zero/engine.h over opaque handles.
 * Installed as <zerort/zero_c.h> with libzerort (tools/install.sh, docs/embedding.md); plain
 * C99, no header but <stddef.h> and <stdint.h> (MPI, NCCL and CUDA handles travel as void*).
 *
 *   zr_comm* comms[2];
 *   zr_device* device;
 *   zr_comm_group_create(2, 0, comms);      // in-process ranks: one thread per rank
 *   zr_cpu_device_create(1, &device);        // may be shared by every in-process rank
 *   // on rank r's thread:
 *   zr_param_spec params[1] = {{sizeof(zr_param_spec), "fc.w", 2, shape, "fc"}};
 *   zr_engine* e;
 *   if (zr_engine_create(json, params, 1, comms[r], device, NULL, &e) != ZR_OK)
 *     fprintf(stderr, "%s\n", zr_last_error());
 *   zr_engine_init_params(e, my_init, my_data, 1);
 *   for (...) {
 *     forward reading zr_engine_param(); backward writing zr_engine_grad() then
 *     zr_engine_grad_ready() per parameter (zr_engine_gather / zr_engine_release per unit in
 *     stage 3); zr_step_stats st = {.struct_size = sizeof st}; zr_engine_step(e, &st);
 *   }
 *   zr_engine_destroy(e);                    // before its communicator and device
 *
 * Errors: every call that can fail returns a zr_status (ZR_OK = 0; the other values mirror
 * absl::StatusCode) and sets a thread-local message, read with zr_last_error(), that names the
 * offending key, value, parameter or rank. No call aborts or throws across this boundary.
 *
 * Versioned structs: every struct passed by pointer starts with `size_t struct_size`, which the
 * caller sets to sizeof(the struct) as its header declares it
 * (`zr_step_stats s = {.struct_size = sizeof s};`).
 * Fields are only ever appended, so a newer library reads or writes just the first struct_size
 * bytes of an older caller's struct (fields the caller does not know take their defaults); a
 * struct_size below the first published size, or above what the loaded library knows (a caller
 * built against a newer header), is ZR_INVALID_ARGUMENT naming the struct.
 *
 * Buffers: as in zero/engine.h. zr_engine_param() pointers are stable for the engine's lifetime
 * in stages 0-2 and valid between gather and release of their unit in stage 3;
 * zr_engine_grad() pointers are zero-filled when handed out and valid until grad_ready of the
 * last parameter of their unit. On the CUDA device both are device memory, written and read on
 * the engine's compute stream. Values are in the compute dtype (zr_engine_compute_dtype():
 * bf16 / fp16 as raw uint16_t bits, or float); zr_convert() converts host buffers. Strings the
 * library returns (const char*) are owned by it; each call says how long they stay valid.
 * Strings and arrays the caller passes are copied before the call returns unless stated.
 *
 * Handles (zr_comm, zr_device, zr_engine, zr_checkpointer) are checked at every call: one that
 * was destroyed, destroyed twice, or never created by zerort is ZR_INVALID_ARGUMENT naming the
 * call and the handle (calls that return no status return their documented "NULL" value and
 * set zr_last_error()), never a crash. A destroyed handle keeps a few dozen bytes until the
 * process exits, so that its address is never reused by a later handle. Teardown order is
 * forgiving: a communicator or device destroyed while engines still use it is only released;
 * it lives on, by reference count, until the last of those engines is destroyed (destroy
 * engines first all the same: an in-process peer then fails fast instead of waiting). The
 * checks cannot make a handle safe to destroy while another thread is inside a call on it.
 *
 * Thread safety: an engine and a communicator are used by one thread at a time (their rank's);
 * a device may be shared. zr_last_error() is per thread. Collective calls (create,
 * init_params, gather, grad_ready, step, gather_master_weights, the checkpoint calls, the
 * MPI and NCCL communicator creation) must be made by every rank of the group in the same
 * order.
 */
#ifndef ZERORT_CAPI_ZERO_C_H_
#define ZERORT_CAPI_ZERO_C_H_

#include <stddef.h>
#include <stdint.h>

/* The version of this header. The library's soname carries the major version
 * (libzerort.so.0); within a major version the ABI only grows (new calls, appended fields). */
#define ZR_VERSION_MAJOR 0
#define ZR_VERSION_MINOR 2
#define ZR_VERSION_PATCH 0
#define ZR_VERSION (ZR_VERSION_MAJOR * 10000 + ZR_VERSION_MINOR * 100 + ZR_VERSION_PATCH)

#ifdef __cplusplus
extern "C" {
#endif

/* The version of the loaded library, as ZR_VERSION computes it; compare with ZR_VERSION to
 * detect a library older than the header a program was built with. */
int zr_version(void);
/* "0.2.0": the same version as a string. Static storage, never NULL. */
const char* zr_version_string(void);

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
  /* The kinds in the planned_bytes / allocated_bytes arrays, as published in 0.1. */
  ZR_NUM_MEMORY_KINDS = 3,
  /* 0.2: swap files of NVMe offload, reported in the *_nvme_bytes fields appended to the
   * structs (the arrays keep their 0.1 size, so 0.1 callers read the same layout). */
  ZR_MEMORY_NVME = 3
} zr_memory_kind;

typedef struct zr_comm zr_comm;     /* one rank's communicator */
typedef struct zr_device zr_device; /* where the engine's buffers live */
typedef struct zr_engine zr_engine; /* one rank's engine */

/* The message of the last call on this thread that returned an error, "" after a call that
 * succeeded. Valid until the next zr_ call on this thread. Never NULL. */
const char* zr_last_error(void);

/* "OK", "INVALID_ARGUMENT", ...: the name of a status code. Never NULL. */
const char* zr_status_name(zr_status status);

/* ---- Communicators ----
 * Every creation call writes its result only on success. timeout_ms: how long a collective (and
 * the creation itself, where it waits for peers) waits before failing with
 * ZR_DEADLINE_EXCEEDED; 0 = the default, 600000. Destroy a communicator after every engine using
 * it (destroyed before, it lives on until the last of them is destroyed: see "Handles"). */

/* Creates an in-process group of `world_size` communicators, one per rank, written to
 * comms[0..world_size-1]; each is then used by its rank's thread. Destroying one rank's
 * communicator while its peers wait makes them fail with ZR_UNAVAILABLE instead of hanging.
 * REQUIRES: world_size >= 1, comms holds world_size pointers. */
zr_status zr_comm_group_create(int world_size, int64_t timeout_ms, zr_comm** comms);
void zr_comm_destroy(zr_comm* comm); /* NULL is a no-op; a dead handle sets zr_last_error */
int zr_comm_rank(const zr_comm* comm); /* -1 for NULL or a dead handle */
int zr_comm_size(const zr_comm* comm); /* -1 for NULL or a dead handle */

/* Splits `comm`'s ranks into disjoint sub-groups, as MPI_Comm_split does
 * (zerort::comm::Communicator::Split): the ranks that pass the same color >= 0 form one new
 * communicator, ranked by (key, rank in comm); a rank passing a negative color joins none and
 * gets ZR_OK with *out = NULL. For HSDP-style layouts, e.g. world 4 as 2 x 2:
 *   zr_comm_split(c, rank / 2, rank, &shard);    // {0,1} {2,3}
 *   zr_comm_split(c, rank % 2, rank, &replica);  // {0,2} {1,3}
 * Collective over `comm`, in its operation order, with its timeout: a rank that never calls it
 * makes the others fail with ZR_DEADLINE_EXCEEDED naming the split and the missing ranks. The
 * new communicator has comm's backend and timeout and is independent of it (destroy each with
 * zr_comm_destroy, in any order). ZR_UNIMPLEMENTED for a backend that cannot split. */
zr_status zr_comm_split(zr_comm* comm, int color, int key, zr_comm** out);

/* Initializes MPI with MPI_THREAD_SERIALIZED unless it already is (then it checks the thread
 * level), for programs that do not call MPI_Init_thread themselves. Not collective by itself,
 * but MPI_Init is: every process of the job calls it. Idempotent. After MPI was finalized
 * (zr_mpi_finalize, or the trainer's MPI_Finalize): ZR_FAILED_PRECONDITION, as MPI allows one
 * initialization per process. */
zr_status zr_mpi_init(void);
/* Finalizes MPI if zr_mpi_init initialized it; otherwise a no-op (the trainer owns MPI). Call
 * after destroying every MPI communicator. */
zr_status zr_mpi_finalize(void);
/* An MPI communicator over `mpi_comm`: the address of the trainer's MPI_Comm (passed by address
 * so this header needs no mpi.h; the library dups it, so the trainer may free its own after
 * this returns), or NULL for MPI_COMM_WORLD. Ranks are MPI processes; buffers are host memory
 * (the CPU device). Collective over mpi_comm. ZR_FAILED_PRECONDITION when MPI is not
 * initialized (call zr_mpi_init or MPI_Init_thread first). */
zr_status zr_mpi_comm_create(const void* mpi_comm, int64_t timeout_ms, zr_comm** comm);

/* Where this process sits in the job, as its launcher (torchrun, mpirun, srun) describes it in
 * the environment (comm/launch_env.h: RANK/WORLD_SIZE/LOCAL_RANK, OMPI_COMM_WORLD_*,
 * MV2_COMM_WORLD_*, PMI_RANK/PMI_SIZE, PMIX_RANK, SLURM_*; MASTER_ADDR/MASTER_PORT). */
typedef struct zr_launch_info {
  size_t struct_size;  /* sizeof(zr_launch_info) */
  int rank;
  int world_size;
  int local_rank;      /* index among the ranks of this node */
  int master_port;     /* 0 when MASTER_PORT is unset */
  const char* source;  /* "torchrun", "openmpi", "mvapich", "mpich", "pmix" or "slurm"; static
                        * storage */
  int device;          /* CUDA ordinal for this rank: 0 when CUDA_VISIBLE_DEVICES lists one
                        * device, else local_rank */
} zr_launch_info;
/* ZR_NOT_FOUND when no launcher variables are set; ZR_INVALID_ARGUMENT naming the variable
 * when one is malformed. */
zr_status zr_launch_info_from_env(zr_launch_info* info);

/* NCCL communicators: buffers are device memory (the CUDA device), collectives are enqueued on
 * the engine's compute stream. A library built here always contains them; without a usable
 * GPU or driver they fail with the CUDA runtime's reason.
 *
 * Wraps the trainer's existing communicator (`nccl_comm` is its ncclComm_t) without taking
 * ownership: it must outlive the zr_comm, and the trainer still destroys it. Binds the CUDA
 * device current on the calling thread. ZR_INVALID_ARGUMENT for NULL. */
zr_status zr_nccl_comm_wrap(void* nccl_comm, int64_t timeout_ms, zr_comm** comm);
/* Creates and owns one, bootstrapped from the launcher's environment (zr_launch_info_from_env):
 * rank 0 makes the NCCL id and serves it over TCP at MASTER_ADDR:MASTER_PORT; the device is
 * LOCAL_RANK. Collective over the job. */
zr_status zr_nccl_comm_create_from_env(int64_t timeout_ms, zr_comm** comm);

/* ---- Devices ---- */

/* The CPU device; threads for its kernels (0 = all cores). */
zr_status zr_cpu_device_create(int threads, zr_device** device);
/* The CUDA device for GPU `ordinal` (as numbered under CUDA_VISIBLE_DEVICES). Without a usable
 * GPU: ZR_FAILED_PRECONDITION with the driver's reason ("no CUDA device: cudaGetDeviceCount
 * failed: ..."); ZR_INVALID_ARGUMENT for an ordinal outside the visible devices. */
zr_status zr_cuda_device_create(int ordinal, zr_device** device);
/* NULL is a no-op; a dead handle sets zr_last_error. Destroy it after every engine using it
 * (destroyed before, it lives on until the last of them is destroyed). */
void zr_device_destroy(zr_device* device);

/* ---- Engine ---- */

/* One parameter tensor. The strings and the shape are copied by zr_engine_create. */
typedef struct zr_param_spec {
  size_t struct_size;    /* sizeof(zr_param_spec); the same in every element of the array */
  const char* name;      /* unique */
  int ndim;              /* >= 1 */
  const int64_t* shape;  /* ndim entries, each >= 1 */
  const char* module;    /* the layer it belongs to: parameters of one module stay together */
  /* Appended in 0.2: when has_group != 0, the parameter's own AdamW group (weight decay, and a
   * multiplier of the step's learning rate), before the config's zerort.param_groups. */
  int has_group;
  double weight_decay;   /* >= 0 */
  double lr_scale;       /* >= 0 */
  /* Appended in 0.2: >= 0 bytes of activations the parameter's module keeps from forward for
   * backward, per sample of a micro-batch (zerort::memory::ParamSpec's field of the same name;
   * 0 = none declared). The plan sums them over the model and counts the sum times the
   * micro-batch in its device budget (docs/memory_budget.md); the engine allocates none of them.
   * A negative value is ZR_INVALID_ARGUMENT naming the parameter. */
  int64_t activation_bytes_per_sample;
  /* Appended in 0.2: gradient hand-off declared before the plan (zerort::memory::ParamSpec's
   * fields of the same names, docs/embedding.md "Gradients without a copy"). Non-NULL
   * grad_buffer names a device buffer of the trainer's that holds this parameter's gradient
   * (compute dtype) at element grad_buffer_offset, or, with ZR_GRAD_BUFFER_PACKED, right after
   * the previous parameter declared in the same buffer (a buffer packed in registration order,
   * as llm.c's grads_memory). The trainer hands it over with zr_engine_set_grad_buffer; the plan
   * reduces each unit straight from it where the layout allows and then allocates no gradient
   * memory of the engine's for it (zr_engine_grad_copy_reason says why another is copied).
   * Declared ranges of one buffer must not overlap (ZR_INVALID_ARGUMENT naming both). NULL:
   * the engine's zr_engine_grad(), grad_buffer_offset unread. */
  const char* grad_buffer;
  int64_t grad_buffer_offset;
} zr_param_spec;

/* zr_param_spec.grad_buffer_offset: right after the previous parameter of the same buffer. */
#define ZR_GRAD_BUFFER_PACKED (-1)

/* How the engine meets the trainer's device work. */
typedef struct zr_engine_options {
  size_t struct_size;   /* sizeof(zr_engine_options) */
  /* The trainer's compute stream (a cudaStream_t on the CUDA device; NULL = the default
   * stream; ignored by the CPU device). The engine enqueues its device work there, so gradients
   * written on it before grad_ready and parameters read on it after gather are ordered without
   * host waits. Must outlive the engine. */
  void* compute_stream;
  /* Appended in 0.2: != 0 puts one-dimensional parameters that no group took (biases, norm
   * gains) into a group with weight decay 0. */
  int no_decay_1d;
  /* NULL, or a JSON object filling the config's "auto" values as the trainer knows them, e.g.
   * {"hidden_size": 4096, "lr": 3e-4, "total_num_steps": 10000, "compute_dtype": "bf16"}
   * (keys: zerort::AutoFill, docs/config.md). Every "auto" is resolved either way (from this,
   * else by the documented rule; the world size is the communicator's), and each resolution is
   * one line of zr_engine_config_notes. Appended in 0.2. */
  const char* auto_fill_json;
  /* Appended in 0.2: != 0 times every optimizer step's phases on the device's clock, for
   * zr_engine_device_times (timing events make each record and wait slightly dearer on CUDA). */
  int device_timing;
} zr_engine_options;

/* Parses `config_json` (DeepSpeed-style keys, docs/config.md), plans and allocates exactly the
 * plan. `comm` and `device` must outlive the engine; `options` may be NULL (the defaults). Every
 * rank calls it. Errors: ZR_INVALID_ARGUMENT for a bad config (the message names the key) or
 * parameter list; ZR_RESOURCE_EXHAUSTED when the plan does not fit. */
zr_status zr_engine_create(const char* config_json, const zr_param_spec* params,
                           int num_params, zr_comm* comm, zr_device* device,
                           const zr_engine_options* options, zr_engine** engine);
void zr_engine_destroy(zr_engine* engine); /* NULL is a no-op; a dead handle sets zr_last_error */

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
/* Gradient hand-off (zerort::Engine::SetGradBuffer): grad_ready(i) reads parameter i's
 * gradient from `buffer` (compute dtype, numel elements, the device's memory; NULL undoes it)
 * instead of zr_engine_grad(i), which then fails. *direct (may be NULL) is set to 1 when the
 * unit is reduced straight from `buffer`, 0 when grad_ready copies it. Declared in
 * zr_param_spec.grad_buffer: as the plan decided, and `buffer` must be the declared element of
 * a buffer whose other parameters were handed over from the same start (else
 * ZR_FAILED_PRECONDITION naming both). Not declared: direct when i alone fills its unit.
 * From grad_ready(i) until zr_engine_step returns the engine may read and overwrite the
 * buffer (declared: up to its unit's padding past it); write it in full for each
 * micro-step. ZR_FAILED_PRECONDITION part-way through the unit's gradients in a micro-step
 * (declared: after any grad_ready), and between compute_grad_norm and apply/skip. */
zr_status zr_engine_set_grad_buffer(zr_engine* engine, int i, void* buffer, int* direct);
/* Why parameter i's declared gradient (zr_param_spec.grad_buffer) is copied into the engine's
 * memory rather than reduced in place, naming the tensor and the rule, into *reason; "" when it
 * is reduced in place or not declared. Owned by the engine, valid until zr_engine_destroy. */
zr_status zr_engine_grad_copy_reason(const zr_engine* engine, int i, const char** reason);
/* Units whose reduction has been issued in this micro-step (0 for NULL or a dead engine). */
int zr_engine_reduced_units(const zr_engine* engine);
/* Stage 3: make `unit`'s parameters readable / let its buffer be reused. No-ops in stages 0-2.
 * Collective. */
zr_status zr_engine_gather(zr_engine* engine, int unit);
zr_status zr_engine_release(zr_engine* engine, int unit);
/* Reference-counted gathers by parameter (zerort::Engine::AcquireParams/ReleaseParams): hold /
 * drop one hold of every distinct unit of params[0..count-1]; a unit is gathered on its first
 * hold and released on its last, so a tied or shared parameter may be acquired by each of its
 * users. Counted in every stage. ZR_FAILED_PRECONDITION when the gather slots are all held (the
 * message names stage3_prefetch_bucket_size) or for a release of a parameter not held (the
 * message names it); a failed call changes no count. Collective in stage 3. */
zr_status zr_engine_acquire(zr_engine* engine, const int* params, int count);
zr_status zr_engine_release_params(zr_engine* engine, const int* params, int count);

/* What one zr_engine_step did (zerort::StepStats). */
typedef struct zr_step_stats {
  size_t struct_size;   /* sizeof(zr_step_stats) */
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
  double offload_wait_ms; /* offload: host time waiting for gradient/parameter copies */
  double total_ms;        /* wall time of this step call */
  /* Appended in 0.2. */
  double lr;              /* applied steps: the base learning rate (before a group's lr_scale) */
  double weight_decay;    /* applied steps: the weight decay of parameters in no group */
} zr_step_stats;

/* Ends a micro-step; applies AdamW on every gradient_accumulation_steps-th call. `stats` may be
 * NULL; else its struct_size must be set (checked before the step is taken). Collective.
 * ZR_FAILED_PRECONDITION names the first parameter whose grad_ready is missing. */
zr_status zr_engine_step(zr_engine* engine, zr_step_stats* stats);

/* The last optimizer step's phases on the device's clock (zerort::DeviceStepTimes). The
 * zr_step_stats times are the host's: on a GPU, zr_engine_step returns once its work is
 * enqueued, before AdamW runs. */
typedef struct zr_device_times {
  size_t struct_size;  /* sizeof(zr_device_times) */
  int64_t step;        /* the optimizer step these are of (zr_step_stats.step of that call) */
  double norm_ms;      /* the window's norm and finite checks */
  double update_ms;    /* AdamW on the device, or the offload pipeline (transfers, host AdamW) */
  double gather_ms;    /* from the end of the update to the end of the parameter gathers */
  double total_ms;     /* from the start of the norm to the end of the step's device work */
} zr_device_times;

/* Waits for the last optimizer step's device work and fills `out`. ZR_FAILED_PRECONDITION
 * without zr_engine_options.device_timing, or before the first optimizer step. Not collective. */
zr_status zr_engine_device_times(zr_engine* engine, zr_device_times* out);

/* ---- Optimizer: hyperparameters and the split step (zerort::Engine, zero/engine.h) ---- */

/* AdamW's scalars. lr >= 0, beta1 and beta2 in [0, 1), eps > 0, weight_decay >= 0 (that of the
 * parameters in no group), all finite. */
typedef struct zr_adamw_scalars {
  size_t struct_size; /* sizeof(zr_adamw_scalars) */
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
} zr_adamw_scalars;

/* The scalars of the next optimizer steps (the config's until set; allowed before the first
 * step). Not collective, but every rank must set the same values. ZR_INVALID_ARGUMENT names a
 * bad value and changes nothing. */
zr_status zr_engine_set_hyperparams(zr_engine* engine, const zr_adamw_scalars* scalars);
zr_status zr_engine_set_learning_rate(zr_engine* engine, double lr);
zr_status zr_engine_hyperparams(const zr_engine* engine, zr_adamw_scalars* out);

/* The verdict of zr_engine_compute_grad_norm, the same on every rank. */
typedef struct zr_grad_norm {
  size_t struct_size; /* sizeof(zr_grad_norm) */
  double norm;        /* global L2 norm of the unscaled averaged gradients (Inf on overflow) */
  int overflow;       /* an Inf/NaN on some rank: only zr_engine_skip_step is allowed */
  double clip_coef;   /* what gradient_clipping would apply (1 = none) */
  double loss_scale;
} zr_grad_norm;

/* Split step. On the last micro-step of a window (zr_engine_last_micro_step() != 0), instead of
 * zr_engine_step: compute_grad_norm ends the micro-step and measures (collective; `out` may be
 * NULL), then every rank calls apply_step or skip_step alike (checked: ZR_FAILED_PRECONDITION
 * on every rank when they differ, the step still pending). skip_step leaves parameters, moments,
 * the step count and (unless the window overflowed) the loss scaler unchanged. */
int zr_engine_last_micro_step(const zr_engine* engine); /* 0 for NULL or a dead engine */
zr_status zr_engine_compute_grad_norm(zr_engine* engine, zr_grad_norm* out);
/* Per-step overrides for zr_engine_apply_step (NULL: none). */
typedef struct zr_apply_options {
  size_t struct_size; /* sizeof(zr_apply_options) */
  int has_clip_coef;  /* != 0: clip_coef replaces the config's clipping for this step */
  double clip_coef;   /* finite, >= 0, the same on every rank */
} zr_apply_options;
zr_status zr_engine_apply_step(zr_engine* engine, const zr_apply_options* options,
                               zr_step_stats* stats); /* options, stats may be NULL */
zr_status zr_engine_skip_step(zr_engine* engine, zr_step_stats* stats);

/* Reductions of a few scalars through the engine's communicator, e.g. the loss. */
typedef enum zr_reduce_op { ZR_REDUCE_SUM = 0, ZR_REDUCE_AVG = 1, ZR_REDUCE_MAX = 2 } zr_reduce_op;
/* values[0..n-1] = op over ranks, reduced in rank order in double: the same bits on every rank.
 * Collective; ZR_INVALID_ARGUMENT on every rank when the ranks pass different n. */
zr_status zr_engine_allreduce_scalars(zr_engine* engine, double* values, int n, zr_reduce_op op);
/* Every rank's values[0..n-1] for per-rank logging: out[r * n + k] = rank r's values[k], bit for
 * bit, the same on every rank. out holds capacity doubles, at least n * world size
 * (ZR_OUT_OF_RANGE otherwise, on every rank alike when all pass the same capacity). Collective;
 * ZR_INVALID_ARGUMENT on every rank when the ranks pass different n. Added in 0.2. */
zr_status zr_engine_allgather_scalars(zr_engine* engine, const double* values, int n, double* out,
                                      int64_t capacity);
/* Returns once every rank has called it. Collective. */
zr_status zr_engine_barrier(zr_engine* engine);
/* zr_engine_allreduce_scalars over any communicator, with or without an engine on it: what a
 * trainer needs over the groups the engine does not see, e.g. its tensor-parallel group, to
 * combine each tensor-parallel rank's gradient norm (zr_engine_compute_grad_norm) into the
 * whole model's before zr_engine_apply_step with its clip coefficient (docs/embedding.md,
 * section 11). The same rank-order reduction in double: the same bits on every rank. Host
 * values only: ZR_FAILED_PRECONDITION on a stream-ordered communicator (NCCL; use the
 * trainer's own group there). Collective; ZR_INVALID_ARGUMENT on every rank when the ranks
 * pass different n. Added in 0.2. */
zr_status zr_comm_allreduce_scalars(zr_comm* comm, double* values, int n, zr_reduce_op op);

/* The full fp32 master weights, concatenated in registration order, into out[0..capacity-1].
 * Collective. ZR_OUT_OF_RANGE when capacity < zr_plan_summary.num_elements. */
zr_status zr_engine_gather_master_weights(zr_engine* engine, float* out, int64_t capacity);

/* ---- Plan and state ---- */

typedef struct zr_plan_summary {
  size_t struct_size;         /* sizeof(zr_plan_summary) */
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
  /* Appended in 0.2: ZR_MEMORY_NVME. */
  int64_t planned_nvme_bytes;
  int64_t allocated_nvme_bytes;
} zr_plan_summary;

zr_status zr_engine_plan_summary(const zr_engine* engine, zr_plan_summary* out);

/* Bytes the engine allocated for each memory kind, beside what the plan listed. */
typedef struct zr_memory_report {
  size_t struct_size;                            /* sizeof(zr_memory_report) */
  int64_t planned_bytes[ZR_NUM_MEMORY_KINDS];    /* per zr_memory_kind */
  int64_t allocated_bytes[ZR_NUM_MEMORY_KINDS];
  /* Appended in 0.2: ZR_MEMORY_NVME. */
  int64_t planned_nvme_bytes;
  int64_t allocated_nvme_bytes;
  /* Appended in 0.2: what the plan counted on this rank's device besides the engine's buffers,
   * for a trainer that measures its own peak (zerort::MemoryReport). The activations the
   * parameters declared (zr_param_spec.activation_bytes_per_sample, summed), the micro-batch
   * (train_micro_batch_size_per_gpu, else 1) and their product, per rank: the trainer's own
   * memory, never the engine's. All three are 0 when nothing was declared. */
  int64_t activation_bytes_per_sample;
  int64_t micro_batch;
  int64_t activation_bytes;
  /* The plan's whole device budget per rank: model-state buffers + declared activations + the
   * zerort.reserves lines (CUDA context, NCCL, cuBLAS, fragmentation); the model-state buffers
   * alone when nothing was declared. */
  int64_t device_budget_bytes;
  /* Appended in 0.2: the gradients declared in the trainer's buffers
   * (zr_param_spec.grad_buffer), in bytes of the compute dtype: all of them, those reduced
   * straight from there, those copied into the engine's memory at grad_ready; and the engine's
   * own gradient memory (full gradients, reduced shard, accumulators, buckets), as planned and
   * allocated. */
  int64_t trainer_grad_bytes;
  int64_t trainer_grad_in_place_bytes;
  int64_t trainer_grad_copied_bytes;
  int64_t engine_grad_bytes;
} zr_memory_report;
zr_status zr_engine_memory_report(const zr_engine* engine, zr_memory_report* out);

/* The plan as JSON (what `zerort plan --json` prints: per-rank bytes, units, buffers), into
 * *json. The string is owned by the engine and valid until zr_engine_destroy. */
zr_status zr_engine_plan_json(const zr_engine* engine, const char** json);
/* The config's notes: one line per key that was accepted but has no effect here, and per "auto"
 * value resolved (Config::notes),
 * each ending in '\n'; "" when there are none. Owned by the engine, valid until
 * zr_engine_destroy. */
zr_status zr_engine_config_notes(const zr_engine* engine, const char** notes);
/* The unit (gradient bucket and stage-3 gather unit) parameter i belongs to. */
zr_status zr_engine_unit_of(const zr_engine* engine, int i, int* unit);
/* These cannot return a status: for NULL or a dead engine they return ZR_F32, 0.0 and -1 and
 * set zr_last_error(). */
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
 * ZR_INVALID_ARGUMENT naming the value for a dtype outside zr_dtype (nothing is written), and
 * for n < 0 or a NULL buffer with n > 0. (Returned void before 0.2; callers that ignore the
 * status keep working.)
 * REQUIRES: src and dst do not overlap, or are equal with equal element sizes. */
zr_status zr_convert(const void* src, zr_dtype src_dtype, void* dst, zr_dtype dst_dtype,
                     int64_t n);

/* ---- Weights as safetensors, and parameter groups (docs/checkpoints.md, docs/embedding.md) ---- */

/* Writes the fp32 masters as weights-only safetensors, in the layout Hugging Face's loaders
 * read: `out` ending in ".safetensors" is one file; any other `out` is a directory (created if
 * missing) that gets model.safetensors, or, when max_shard_bytes > 0 and the weights exceed it,
 * model-0000k-of-0000n.safetensors and model.safetensors.index.json. dtype: ZR_F32 or ZR_BF16
 * (ZR_INVALID_ARGUMENT otherwise). Tensors are named as the parameters, in name order, so the
 * same weights always give the same bytes; each file appears complete or not at all. Rank 0
 * writes; every rank returns its verdict. Collective. */
zr_status zr_engine_export_weights(zr_engine* engine, const char* out, zr_dtype dtype,
                                   int64_t max_shard_bytes);
/* The same from a saved checkpoint (a step directory, or a root whose `latest` names one),
 * without an engine: what `zerort ckpt export` does. Not collective. */
zr_status zr_checkpoint_export_weights(const char* checkpoint, const char* out, zr_dtype dtype,
                                       int64_t max_shard_bytes);
/* Loads safetensors weights (a file, a model.safetensors.index.json, or a directory holding
 * either) into the masters by parameter name, converting F64/F32/F16/BF16 to fp32; as
 * zr_engine_init_params, the compute-dtype parameters follow and Adam's moments are zeroed,
 * the step count and loss scale stay. Each rank reads only the bytes of the elements it owns.
 * Tensors that name no parameter fail the load (ZR_INVALID_ARGUMENT naming them) unless
 * allow_extra != 0; then, when `ignored` is not NULL, it receives their names, each followed by
 * '\n', NUL-terminated and cut to `capacity` bytes, and *ignored_count (when not NULL) their
 * number. Errors, the same on every rank and with the engine unchanged: ZR_NOT_FOUND for a
 * missing tensor or file, ZR_INVALID_ARGUMENT for a malformed header or index (naming the file,
 * tensor and byte range), a misshapen tensor, another dtype. Collective. */
zr_status zr_engine_import_weights(zr_engine* engine, const char* path, int allow_extra,
                                   char* ignored, int64_t capacity, int64_t* ignored_count);
/* The same three calls with a tensor-name map, for checkpoints whose names differ from the
 * parameters' (Hugging Face's "transformer.h.0.attn.c_attn.weight" for "h0.attn.qkv.w"):
 * `name_map` is the text of the rules (docs/checkpoints.md, "Name maps"; NULL or "": names as
 * they are), one per line, the first matching rule rewriting a name:
 *   "prefix transformer.\n"                       strips the prefix
 *   "glob h.*.attn.c_attn.weight h*.attn.qkv.w\n"  '*' captured, '?' any one character
 *   "regex h\\.(\\d+)\\.ln_1\\.(weight|bias) h$1.ln1.$2\n"   whole-name ECMAScript regex
 *   "exact lm_head.weight head.w\n"
 *   "ignore *.rotary_emb.inv_freq\n"               import only: never read, listed in `ignored`
 * On import the rules map file tensor names to parameter names, on export parameter names to
 * the names written. ZR_INVALID_ARGUMENT naming the line for a bad rule; naming both tensors
 * (or parameters) and the rule that produced each name when two map to one name; and every
 * error about a tensor names it as the file does and the rule that renamed it. Collective
 * (the checkpoint export is not). */
zr_status zr_engine_import_weights_mapped(zr_engine* engine, const char* path,
                                          const char* name_map, int allow_extra, char* ignored,
                                          int64_t capacity, int64_t* ignored_count);
zr_status zr_engine_export_weights_mapped(zr_engine* engine, const char* out, zr_dtype dtype,
                                          int64_t max_shard_bytes, const char* name_map);
zr_status zr_checkpoint_export_weights_mapped(const char* checkpoint, const char* out,
                                              zr_dtype dtype, int64_t max_shard_bytes,
                                              const char* name_map);

/* Parameter i's optimizer group as the next step will apply it. */
typedef struct zr_param_group_info {
  size_t struct_size;
  int has_group;       /* 0: in no group (the step's weight decay, lr_scale 1) */
  double weight_decay; /* the decay this parameter gets: its group's, else the step's */
  double lr_scale;     /* its multiplier of the step's learning rate (1 without a group) */
  double lr;           /* the current learning rate (zr_engine_hyperparams) times lr_scale */
} zr_param_group_info;
zr_status zr_engine_param_group(const zr_engine* engine, int i, zr_param_group_info* out);

/* ---- Fine-tuning: frozen parameters and accumulation without communication ---- */

/* Frozen parameters are named in the config (zerort.frozen_params: comma-separated globs on
 * parameter names): they have no gradient and no optimizer state, are never reduced and are
 * still sharded and gathered. zr_engine_grad, zr_engine_grad_ready and
 * zr_engine_set_grad_buffer fail on them naming the parameter. *frozen receives 1 or 0.
 * ZR_OUT_OF_RANGE for an index outside the model. */
zr_status zr_engine_is_frozen(const zr_engine* engine, int i, int* frozen);
/* The frozen set is fixed for the engine's life: asking for what already holds is ZR_OK;
 * anything else fails (ZR_FAILED_PRECONDITION) with a message saying how to change it (save a
 * checkpoint, create an engine with the new set, load it there). */
zr_status zr_engine_set_frozen(zr_engine* engine, int i, int frozen);
/* With zerort.local_grad_accumulation (stages 0-1): sync = 0 lets the following micro-steps
 * sum their gradients locally (the default), sync = 1 makes each reduce; the last micro-step
 * of a window always reduces. Call between micro-steps, the same on every rank. Without the
 * key, sync = 0 is ZR_FAILED_PRECONDITION naming it. */
zr_status zr_engine_set_gradient_sync(zr_engine* engine, int sync);

/* ---- Parking: the device memory given back between RL phases ----
 *
 * For RL trainers that share a GPU between training and generation (verl, OpenRLHF call
 * DeepSpeed's offload_states / reload_states there). zr_engine_park copies every device buffer
 * of this rank's engine into pinned host memory and returns the device memory (on CUDA, to the
 * driver: another process may use it); zr_engine_unpark brings it back bit for bit at the same
 * addresses, so zr_engine_param and zr_engine_grad pointers are valid again after it and
 * training goes on as if it never parked. The pinned memory is cached: a second park makes no
 * new OS allocation. Not collective (each rank parks its own memory).
 *
 * Park between optimizer steps only: ZR_FAILED_PRECONDITION, naming it, while a micro-step is
 * in progress, inside an accumulation window, after compute_grad_norm without apply/skip,
 * while a unit is held (gather / acquire not released), or when already parked. While parked,
 * every call that touches device memory (param, grad, grad_ready, gather, acquire, step,
 * compute_grad_norm, init_params, gather_master_weights, checkpoints) is ZR_FAILED_PRECONDITION
 * saying so; the trainer must not touch the engine's device pointers either.
 * zr_engine_unpark: ZR_FAILED_PRECONDITION when not parked; ZR_RESOURCE_EXHAUSTED when the
 * device memory is not available (the engine stays parked: free memory and call it again). */
zr_status zr_engine_park(zr_engine* engine);
zr_status zr_engine_unpark(zr_engine* engine);
/* 1 while parked, 0 otherwise (and for NULL or a dead engine, setting zr_last_error). */
int zr_engine_parked(const zr_engine* engine);
/* While parked: *device_bytes = the device memory park released, *host_bytes = the pinned host
 * memory holding it; both 0 when not parked. Either pointer may be NULL. */
zr_status zr_engine_parked_bytes(const zr_engine* engine, int64_t* device_bytes,
                                 int64_t* host_bytes);
/* The device's own count of its device memory: *resident_bytes backed by memory now,
 * *reserved_bytes of address space (the two differ by what parked engines released). Either
 * pointer may be NULL. ZR_UNIMPLEMENTED for a device whose allocator does not count. */
zr_status zr_device_memory(const zr_device* device, int64_t* resident_bytes,
                           int64_t* reserved_bytes);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ZERORT_CAPI_ZERO_C_H_ */
