/* The C ABI from C: a linear regression trained on 2 in-process ranks (pthreads) under every
 * stage, checked against the teacher weights that generated the data, with an asynchronous
 * checkpoint taken mid-run and a synchronous one at the end, both reloaded into fresh engines;
 * plus the error paths, the versioned structs, the plan JSON, config notes, the launcher
 * environment and the GPU calls on a machine without a GPU. MPI runs under mpirun in
 * //tests/consumers:trainer_mpi_test. Plain C (no Catch2): a failed check prints its line and
 * the test exits non-zero. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp, setenv */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "capi/testing/check.h"
#include "zerort/zero_c.h"

#define IN 6
#define OUT 3
#define BATCH 16
#define STEPS 60
#define WORLD 2
#define NUM_ELEMENTS (OUT * IN + OUT)
#define CKPT_STEP 10 /* the async checkpoint starts after this step and finishes 2 steps later */


/* A call that must succeed; on failure records it and leaves the enclosing function. */
#define MUST(call)                                                                       \
  do {                                                                                   \
    zr_status s_ = (call);                                                               \
    if (s_ != ZR_OK) {                                                                   \
      CHECK(s_ == ZR_OK, "%s -> %s: %s", #call, zr_status_name(s_), zr_last_error());    \
      return NULL;                                                                       \
    }                                                                                    \
  } while (0)

/* Deterministic data: a small LCG in [-1, 1). */
static float Rand(uint64_t* state) {
  *state = *state * 6364136223846793005ull + 1442695040888963407ull;
  return (float)((*state >> 40) & 0xffffff) / 8388608.0f - 1.0f;
}

/* The teacher: y = W* x + b*, with W*[o][i] = sin(1 + o*IN + i) and b*[o] = 0.5*cos(o). */
static float TeacherW(int o, int i) { return sinf((float)(1 + o * IN + i)); }
static float TeacherB(int o) { return 0.5f * cosf((float)o); }

static void InitParams(void* user, int index, const char* name, int ndim, const int64_t* shape,
                       int64_t numel, float* values) {
  (void)user;
  (void)name;
  (void)ndim;
  (void)shape;
  for (int64_t k = 0; k < numel; ++k) values[k] = index == 0 ? 0.1f * cosf((float)k) : 0.0f;
}

/* Squared distance of flat (W, b) from the teacher. */
static double TeacherDistance(const float* flat) {
  double d = 0;
  for (int o = 0; o < OUT; ++o) {
    for (int i = 0; i < IN; ++i) d += pow(flat[o * IN + i] - TeacherW(o, i), 2);
    d += pow(flat[OUT * IN + o] - TeacherB(o), 2);
  }
  return d;
}

typedef struct {
  zr_comm* comm;
  zr_device* device;
  const char* config;
  int per_unit; /* grad_ready_unit instead of grad_ready per parameter */
  float first_loss;
  float last_loss;
  float master[NUM_ELEMENTS];
  int64_t steps_applied;
  zr_plan_summary plan;
  const char* ckpt_root;
  int64_t saved_step;                 /* steps applied when the async checkpoint started */
  float saved_master[NUM_ELEMENTS];   /* the master weights then */
  int64_t loaded_step;                /* a fresh engine after loading that checkpoint */
  float loaded_master[NUM_ELEMENTS];
  float reloaded_master[NUM_ELEMENTS]; /* a fresh engine after loading the final one */
} RankJob;

static void* RunRank(void* arg) {
  RankJob* job = (RankJob*)arg;
  const int rank = zr_comm_rank(job->comm);
  const int64_t w_shape[2] = {OUT, IN}, b_shape[1] = {OUT};
  const zr_param_spec params[2] = {
      {sizeof(zr_param_spec), "fc.w", 2, w_shape, "fc"},
      {sizeof(zr_param_spec), "fc.b", 1, b_shape, "fc"}};
  zr_engine* engine = NULL;
  const zr_engine_options options = {sizeof(zr_engine_options), NULL};
  MUST(zr_engine_create(job->config, params, 2, job->comm, job->device, &options, &engine));
  MUST(zr_engine_init_params(engine, InitParams, NULL, 1));
  CHECK(strcmp(zr_last_error(), "") == 0, "after success: '%s'", zr_last_error());
  const zr_dtype dtype = zr_engine_compute_dtype(engine);
  int unit_w = -1, unit_b = -1;
  MUST(zr_engine_unit_of(engine, 0, &unit_w));
  MUST(zr_engine_unit_of(engine, 1, &unit_b));

  zr_checkpointer* ck = NULL;
  MUST(zr_checkpointer_create(&ck));

  float x[BATCH][IN], y[BATCH][OUT], pred[BATCH][OUT], w[OUT * IN], b[OUT];
  float gw[OUT * IN], gb[OUT];
  /* Without per-unit calls, the bias gradient comes from a buffer of the trainer's (the CPU
   * device's memory is host memory); too small to fill a unit, it is copied at grad_ready. */
  float gb_own[OUT]; /* room for OUT elements of any compute dtype */
  if (!job->per_unit) {
    int direct = -1;
    MUST(zr_engine_set_grad_buffer(engine, 1, gb_own, &direct));
    CHECK(direct == 0, "fc.b is padded: direct %d", direct);
  }
  for (int step = 0; step < STEPS; ++step) {
    uint64_t state = 1000003ull * (uint64_t)(rank + 1) + (uint64_t)step;
    for (int s = 0; s < BATCH; ++s) {
      for (int i = 0; i < IN; ++i) x[s][i] = Rand(&state);
      for (int o = 0; o < OUT; ++o) {
        y[s][o] = TeacherB(o);
        for (int i = 0; i < IN; ++i) y[s][o] += TeacherW(o, i) * x[s][i];
      }
    }
    /* Forward: the parameters are readable between gather and release (stage 3). */
    void* p = NULL;
    const int both[2] = {0, 1}, weight[1] = {0};
    if (job->per_unit) {
      MUST(zr_engine_gather(engine, unit_w));
      if (unit_b != unit_w) MUST(zr_engine_gather(engine, unit_b));
    } else {  /* by parameter, with a nested second hold of fc.w (as a tied weight would) */
      MUST(zr_engine_acquire(engine, both, 2));
      MUST(zr_engine_acquire(engine, weight, 1));
    }
    MUST(zr_engine_param(engine, 0, &p));
    zr_convert(p, dtype, w, ZR_F32, OUT * IN);
    MUST(zr_engine_param(engine, 1, &p));
    zr_convert(p, dtype, b, ZR_F32, OUT);
    if (job->per_unit) {
      if (unit_b != unit_w) MUST(zr_engine_release(engine, unit_b));
      MUST(zr_engine_release(engine, unit_w));
    } else {
      MUST(zr_engine_release_params(engine, weight, 1));
      MUST(zr_engine_release_params(engine, both, 2));
    }
    float loss = 0;
    for (int s = 0; s < BATCH; ++s) {
      for (int o = 0; o < OUT; ++o) {
        pred[s][o] = b[o];
        for (int i = 0; i < IN; ++i) pred[s][o] += w[o * IN + i] * x[s][i];
        loss += (pred[s][o] - y[s][o]) * (pred[s][o] - y[s][o]);
      }
    }
    loss /= BATCH * OUT;
    if (step == 0) job->first_loss = loss;
    job->last_loss = loss;

    /* Backward: bias (registered last) first, each gradient scaled by the loss scale. */
    const float k = 2.0f * (float)zr_engine_loss_scale(engine) / (BATCH * OUT);
    memset(gw, 0, sizeof gw);
    memset(gb, 0, sizeof gb);
    for (int s = 0; s < BATCH; ++s) {
      for (int o = 0; o < OUT; ++o) {
        const float d = k * (pred[s][o] - y[s][o]);
        gb[o] += d;
        for (int i = 0; i < IN; ++i) gw[o * IN + i] += d * x[s][i];
      }
    }
    if (job->per_unit) {
      /* Both gradients written first, then each unit marked ready as a whole. */
      MUST(zr_engine_grad(engine, 1, &p));
      zr_convert(gb, ZR_F32, p, dtype, OUT);
      MUST(zr_engine_grad(engine, 0, &p));
      zr_convert(gw, ZR_F32, p, dtype, OUT * IN);
      MUST(zr_engine_grad_ready_unit(engine, unit_b));
      if (unit_w != unit_b) MUST(zr_engine_grad_ready_unit(engine, unit_w));
    } else {
      CHECK(zr_engine_grad(engine, 1, &p) == ZR_FAILED_PRECONDITION, "grad of a handed-off "
            "parameter: %s", zr_last_error());
      zr_convert(gb, ZR_F32, gb_own, dtype, OUT);
      MUST(zr_engine_grad_ready(engine, 1));
      /* Its unit is reduced at once unless it waits for fc.w. */
      CHECK(zr_engine_reduced_units(engine) == (unit_b != unit_w), "after fc.b: %d",
            zr_engine_reduced_units(engine));
      MUST(zr_engine_grad(engine, 0, &p));
      zr_convert(gw, ZR_F32, p, dtype, OUT * IN);
      MUST(zr_engine_grad_ready(engine, 0));
      CHECK(zr_engine_reduced_units(engine) == 1 + (unit_b != unit_w), "after fc.w: %d",
            zr_engine_reduced_units(engine));
    }
    zr_step_stats stats = {sizeof stats};
    MUST(zr_engine_step(engine, &stats));
    CHECK(stats.struct_size == sizeof stats && stats.boundary == 1 &&
              stats.step == zr_engine_step_count(engine) && stats.offload_wait_ms >= 0 &&
              stats.total_ms >= stats.optimizer_ms,
          "step %d: boundary %d, step %lld", step, stats.boundary, (long long)stats.step);
    if (step == CKPT_STEP) {
      job->saved_step = zr_engine_step_count(engine);
      MUST(zr_engine_gather_master_weights(engine, job->saved_master, NUM_ELEMENTS));
      MUST(zr_checkpointer_start(ck, engine, job->ckpt_root));
    }
    if (step == CKPT_STEP + 2) MUST(zr_checkpointer_finish(ck, engine));
  }
  zr_checkpointer_destroy(ck);
  job->steps_applied = zr_engine_step_count(engine);
  job->plan.struct_size = sizeof job->plan;
  MUST(zr_engine_plan_summary(engine, &job->plan));
  MUST(zr_engine_gather_master_weights(engine, job->master, NUM_ELEMENTS));
  MUST(zr_engine_save_checkpoint(engine, job->ckpt_root));
  zr_engine_destroy(engine);

  /* Fresh engines: the mid-run checkpoint by its directory, the final one through `latest`. */
  char path[512];
  snprintf(path, sizeof path, "%s/step_%lld", job->ckpt_root, (long long)job->saved_step);
  MUST(zr_engine_create(job->config, params, 2, job->comm, job->device, NULL, &engine));
  MUST(zr_engine_init_params(engine, InitParams, NULL, 1));
  MUST(zr_engine_load_checkpoint(engine, path, 0));
  job->loaded_step = zr_engine_step_count(engine);
  MUST(zr_engine_gather_master_weights(engine, job->loaded_master, NUM_ELEMENTS));
  MUST(zr_engine_load_checkpoint(engine, job->ckpt_root, 0));
  MUST(zr_engine_gather_master_weights(engine, job->reloaded_master, NUM_ELEMENTS));
  snprintf(path, sizeof path, "%s/step_999", job->ckpt_root);
  const zr_status st = zr_engine_load_checkpoint(engine, path, 0);
  CHECK(st == ZR_NOT_FOUND && strstr(zr_last_error(), "step_999") != NULL,
        "missing checkpoint: %s: %s", zr_status_name(st), zr_last_error());
  zr_engine_destroy(engine);
  return NULL;
}

static void TrainOnTwoRanks(const char* precision, int stage, int per_unit) {
  char config[512];
  snprintf(config, sizeof config,
           "{\"zero_optimization\": {\"stage\": %d, \"stage3_param_persistence_threshold\": 0},"
           " \"%s\": {\"enabled\": true},"
           " \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 0.05, \"weight_decay\": 0}},"
           " \"comm_timeout_ms\": 20000}",
           stage, precision);
  zr_comm* comms[WORLD];
  zr_device* device = NULL;
  if (zr_comm_group_create(WORLD, 0, comms) != ZR_OK ||
      zr_cpu_device_create(1, &device) != ZR_OK) {
    CHECK(0, "setup: %s", zr_last_error());
    return;
  }
  const char* tmp = getenv("TEST_TMPDIR");
  char root[256];
  snprintf(root, sizeof root, "%s/zero_c_ckpt_XXXXXX", tmp != NULL ? tmp : "/tmp");
  if (mkdtemp(root) == NULL) {
    CHECK(0, "mkdtemp(%s) failed", root);
    return;
  }
  RankJob jobs[WORLD];
  pthread_t threads[WORLD];
  memset(jobs, 0, sizeof jobs);
  for (int r = 0; r < WORLD; ++r) {
    jobs[r].ckpt_root = root;
    jobs[r].comm = comms[r];
    jobs[r].device = device;
    jobs[r].config = config;
    jobs[r].per_unit = per_unit;
    pthread_create(&threads[r], NULL, RunRank, &jobs[r]);
  }
  for (int r = 0; r < WORLD; ++r) pthread_join(threads[r], NULL);

  float initial[NUM_ELEMENTS];
  int64_t w_shape[2] = {OUT, IN}, b_shape[1] = {OUT};
  InitParams(NULL, 0, "fc.w", 2, w_shape, OUT * IN, initial);
  InitParams(NULL, 1, "fc.b", 1, b_shape, OUT, initial + OUT * IN);
  for (int r = 0; r < WORLD; ++r) {
    CHECK(jobs[r].last_loss < 0.2f * jobs[r].first_loss, "%s stage %d rank %d: loss %g -> %g",
          precision, stage, r, jobs[r].first_loss, jobs[r].last_loss);
    CHECK(TeacherDistance(jobs[r].master) < 0.2 * TeacherDistance(initial),
          "%s stage %d rank %d: distance to the teacher %g -> %g", precision, stage, r,
          TeacherDistance(initial), TeacherDistance(jobs[r].master));
    CHECK(jobs[r].steps_applied == STEPS, "%s stage %d: %lld steps", precision, stage,
          (long long)jobs[r].steps_applied);
    CHECK(jobs[r].plan.stage == stage && jobs[r].plan.world_size == WORLD &&
              jobs[r].plan.rank == r && jobs[r].plan.num_elements == NUM_ELEMENTS,
          "%s stage %d rank %d: plan summary", precision, stage, r);
    for (int k = 0; k < ZR_NUM_MEMORY_KINDS; ++k) {
      CHECK(jobs[r].plan.planned_bytes[k] == jobs[r].plan.allocated_bytes[k],
            "kind %d: planned %lld, allocated %lld", k, (long long)jobs[r].plan.planned_bytes[k],
            (long long)jobs[r].plan.allocated_bytes[k]);
    }
  }
  CHECK(memcmp(jobs[0].master, jobs[1].master, sizeof jobs[0].master) == 0,
        "%s stage %d: ranks disagree on the master weights", precision, stage);
  /* Bit for bit: the checkpoint taken while training went on holds the state at its start. */
  for (int r = 0; r < WORLD; ++r) {
    CHECK(jobs[r].saved_step > 0 && jobs[r].loaded_step == jobs[r].saved_step,
          "%s stage %d: saved at step %lld, loaded step %lld", precision, stage,
          (long long)jobs[r].saved_step, (long long)jobs[r].loaded_step);
    CHECK(memcmp(jobs[r].loaded_master, jobs[r].saved_master, sizeof jobs[r].master) == 0,
          "%s stage %d rank %d: async checkpoint differs from the state at start", precision,
          stage, r);
    CHECK(memcmp(jobs[r].reloaded_master, jobs[r].master, sizeof jobs[r].master) == 0,
          "%s stage %d rank %d: final checkpoint differs from the final state", precision,
          stage, r);
  }
  for (int r = 0; r < WORLD; ++r) zr_comm_destroy(comms[r]);
  zr_device_destroy(device);
}

/* One-rank engine for the error paths. */
typedef struct {
  zr_comm* comm;
  zr_device* device;
  zr_engine* engine;
} Single;

static int MakeSingle(const char* config, Single* out) {
  const int64_t w_shape[2] = {OUT, IN}, b_shape[1] = {OUT};
  const zr_param_spec params[2] = {
      {sizeof(zr_param_spec), "fc.w", 2, w_shape, "fc"},
      {sizeof(zr_param_spec), "fc.b", 1, b_shape, "fc"}};
  memset(out, 0, sizeof *out);
  if (zr_comm_group_create(1, 0, &out->comm) != ZR_OK) return 0;
  if (zr_cpu_device_create(1, &out->device) != ZR_OK) return 0;
  return zr_engine_create(config, params, 2, out->comm, out->device, NULL, &out->engine) ==
             ZR_OK &&
         zr_engine_init_params(out->engine, InitParams, NULL, 0) == ZR_OK;
}

static void FreeSingle(Single* s) {
  zr_engine_destroy(s->engine);
  zr_comm_destroy(s->comm);
  zr_device_destroy(s->device);
}

static void* ReadLastError(void* out) {
  *(const char**)out = zr_last_error();
  return NULL;
}

static void ErrorPaths(void) {
  Single s;
  /* A misspelt key is InvalidArgument naming the key. */
  CHECK(!MakeSingle("{\"zero_optimization\": {\"stage\": 2, \"reduce_bucket_sise\": 100}}", &s),
        "misspelt key accepted");
  CHECK(strstr(zr_last_error(), "reduce_bucket_sise") != NULL, "message: '%s'", zr_last_error());
  FreeSingle(&s);
  /* Malformed JSON. */
  const int64_t shape[1] = {4};
  const zr_param_spec one = {sizeof(zr_param_spec), "p", 1, shape, "m"};
  zr_engine* e = NULL;
  zr_comm* comm = NULL;
  zr_device* device = NULL;
  CHECK(zr_comm_group_create(1, 0, &comm) == ZR_OK, "%s", zr_last_error());
  CHECK(zr_cpu_device_create(1, &device) == ZR_OK, "%s", zr_last_error());
  zr_status st =
      zr_engine_create("{\"bf16\": {\"enabled\": tru}}", &one, 1, comm, device, NULL, &e);
  CHECK(st == ZR_INVALID_ARGUMENT && e == NULL, "malformed JSON: %s", zr_status_name(st));
  /* The error message is per thread: a fresh thread sees none. */
  const char* other = NULL;
  pthread_t t;
  pthread_create(&t, NULL, ReadLastError, &other);
  pthread_join(t, NULL);
  CHECK(other != NULL && other[0] == '\0' && zr_last_error()[0] != '\0',
        "thread-local error: '%s'", other ? other : "(null)");
  /* NULL arguments and bad shapes are InvalidArgument naming the argument or parameter. */
  st = zr_engine_create("{}", &one, 1, comm, device, NULL, NULL);
  CHECK(st == ZR_INVALID_ARGUMENT && strstr(zr_last_error(), "engine") != NULL, "%s",
        zr_last_error());
  const int64_t bad_shape[2] = {4, 0};
  const zr_param_spec bad = {sizeof(zr_param_spec), "bad.w", 2, bad_shape, "m"};
  st = zr_engine_create("{}", &bad, 1, comm, device, NULL, &e);
  CHECK(st == ZR_INVALID_ARGUMENT && strstr(zr_last_error(), "bad.w") != NULL, "%s: %s",
        zr_status_name(st), zr_last_error());
  st = zr_comm_group_create(0, 0, &comm);
  CHECK(st == ZR_INVALID_ARGUMENT && strstr(zr_last_error(), "world_size") != NULL, "%s",
        zr_last_error());
  zr_comm_destroy(comm);
  zr_device_destroy(device);

  /* GradReady twice in one micro-step is an error; so is Step with a gradient missing. */
  const int stages[2] = {0, 2};
  for (int k = 0; k < 2; ++k) {
    char config[128];
    snprintf(config, sizeof config, "{\"zero_optimization\": {\"stage\": %d}}", stages[k]);
    CHECK(MakeSingle(config, &s), "stage %d: %s", stages[k], zr_last_error());
    if (s.engine == NULL) {
      FreeSingle(&s);
      continue;
    }
    void* g = NULL;
    CHECK(zr_engine_grad(s.engine, 1, &g) == ZR_OK, "%s", zr_last_error());
    CHECK(zr_engine_grad_ready(s.engine, 1) == ZR_OK, "%s", zr_last_error());
    st = zr_engine_grad_ready(s.engine, 1);
    CHECK(st == ZR_FAILED_PRECONDITION && strstr(zr_last_error(), "fc.b") != NULL,
          "stage %d: second grad_ready: %s: %s", stages[k], zr_status_name(st), zr_last_error());
    st = zr_engine_step(s.engine, NULL);
    CHECK(st == ZR_FAILED_PRECONDITION && strstr(zr_last_error(), "fc.w") != NULL,
          "stage %d: step without fc.w: %s: %s", stages[k], zr_status_name(st), zr_last_error());
    /* Out-of-range indices and a short master buffer. */
    st = zr_engine_grad_ready(s.engine, 7);
    CHECK(st == ZR_OUT_OF_RANGE && strstr(zr_last_error(), "7") != NULL, "index 7: %s: %s",
          zr_status_name(st), zr_last_error());
    /* A release without its acquire names the parameter; a bad index list is refused. */
    const int bias[1] = {1};
    st = zr_engine_release_params(s.engine, bias, 1);
    CHECK(st == ZR_FAILED_PRECONDITION && strstr(zr_last_error(), "fc.b") != NULL,
          "unbalanced release: %s: %s", zr_status_name(st), zr_last_error());
    st = zr_engine_acquire(s.engine, NULL, 1);
    CHECK(st == ZR_INVALID_ARGUMENT, "NULL params: %s", zr_status_name(st));
    float small[4];
    st = zr_engine_gather_master_weights(s.engine, small, 4);
    CHECK(st == ZR_OUT_OF_RANGE, "short buffer: %s", zr_status_name(st));
    FreeSingle(&s);
  }
}

/* The version, the struct_size checks, the plan JSON, config notes and the memory report. */
static void VersionAndIntrospection(void) {
  char expected[32];
  snprintf(expected, sizeof expected, "%d.%d.%d", ZR_VERSION_MAJOR, ZR_VERSION_MINOR,
           ZR_VERSION_PATCH);
  CHECK(zr_version() == ZR_VERSION && strcmp(zr_version_string(), expected) == 0,
        "version %d '%s', header %d", zr_version(), zr_version_string(), ZR_VERSION);
  Single s;
  CHECK(MakeSingle("{\"zero_optimization\": {\"stage\": 2, \"round_robin_gradients\": true}}",
                   &s),
        "%s", zr_last_error());
  if (s.engine == NULL) {
    FreeSingle(&s);
    return;
  }
  const char* notes = NULL;
  CHECK(zr_engine_config_notes(s.engine, &notes) == ZR_OK && notes != NULL &&
            strstr(notes, "zero_optimization.round_robin_gradients") != NULL &&
            notes[strlen(notes) - 1] == '\n',
        "notes: '%s'", notes ? notes : "(null)");
  const char* json = NULL;
  CHECK(zr_engine_plan_json(s.engine, &json) == ZR_OK && json != NULL && json[0] == '{' &&
            strstr(json, "\"stage\": 2") != NULL && strstr(json, "\"buffers\"") != NULL,
        "plan json: %.200s", json ? json : "(null)");
  zr_plan_summary plan = {sizeof plan};
  zr_memory_report report = {sizeof report};
  CHECK(zr_engine_plan_summary(s.engine, &plan) == ZR_OK &&
            zr_engine_memory_report(s.engine, &report) == ZR_OK,
        "%s", zr_last_error());
  for (int k = 0; k < ZR_NUM_MEMORY_KINDS; ++k) {
    CHECK(report.planned_bytes[k] == plan.planned_bytes[k] &&
              report.allocated_bytes[k] == plan.allocated_bytes[k],
          "kind %d: report %lld/%lld, summary %lld/%lld", k, (long long)report.planned_bytes[k],
          (long long)report.allocated_bytes[k], (long long)plan.planned_bytes[k],
          (long long)plan.allocated_bytes[k]);
  }
  CHECK(report.planned_bytes[ZR_MEMORY_DEVICE] > 0, "no device bytes planned");
  CHECK(report.planned_nvme_bytes == 0 && plan.allocated_nvme_bytes == 0, "nvme bytes without nvme");
  /* A 0.1 caller's smaller structs (no nvme fields): the same arrays at the same offsets, and
   * nothing written past its struct_size. */
  zr_memory_report old_report;
  memset(&old_report, 0x5a, sizeof old_report);
  old_report.struct_size = offsetof(zr_memory_report, planned_nvme_bytes);
  CHECK(zr_engine_memory_report(s.engine, &old_report) == ZR_OK, "%s", zr_last_error());
  CHECK(memcmp(old_report.planned_bytes, report.planned_bytes, sizeof report.planned_bytes) == 0 &&
            memcmp(old_report.allocated_bytes, report.allocated_bytes,
                   sizeof report.allocated_bytes) == 0,
        "0.1-sized zr_memory_report differs");
  int64_t untouched;
  memset(&untouched, 0x5a, sizeof untouched);
  CHECK(old_report.planned_nvme_bytes == untouched, "wrote past a 0.1 struct_size");
  /* struct_size unset (0) or larger than this library knows: rejected, naming the struct, and
   * the step is not taken. */
  zr_step_stats stats;
  memset(&stats, 0, sizeof stats);
  zr_status st = zr_engine_step(s.engine, &stats);
  CHECK(st == ZR_INVALID_ARGUMENT && strstr(zr_last_error(), "zr_step_stats.struct_size") != NULL,
        "struct_size 0: %s: %s", zr_status_name(st), zr_last_error());
  stats.struct_size = sizeof stats + 8;
  st = zr_engine_step(s.engine, &stats);
  CHECK(st == ZR_INVALID_ARGUMENT && strstr(zr_last_error(), "newer") != NULL, "%s: %s",
        zr_status_name(st), zr_last_error());
  CHECK(zr_engine_step_count(s.engine) == 0, "a rejected step was applied");
  plan.struct_size = 4;
  st = zr_engine_plan_summary(s.engine, &plan);
  CHECK(st == ZR_INVALID_ARGUMENT && strstr(zr_last_error(), "zr_plan_summary") != NULL, "%s",
        zr_last_error());
  const zr_engine_options bad_options = {3, NULL};
  const int64_t shape[1] = {4};
  zr_param_spec specs[2] = {{sizeof(zr_param_spec), "a", 1, shape, "m"},
                            {sizeof(zr_param_spec), "b", 1, shape, "m"}};
  zr_engine* e = NULL;
  st = zr_engine_create("{}", specs, 2, s.comm, s.device, &bad_options, &e);
  CHECK(st == ZR_INVALID_ARGUMENT && e == NULL && strstr(zr_last_error(), "zr_engine_options"),
        "%s", zr_last_error());
  specs[1].struct_size = 0;
  st = zr_engine_create("{}", specs, 2, s.comm, s.device, NULL, &e);
  CHECK(st == ZR_INVALID_ARGUMENT && e == NULL && strstr(zr_last_error(), "parameter 1"), "%s",
        zr_last_error());
  FreeSingle(&s);
}

/* "auto" config values filled through zr_engine_options.auto_fill_json, each reported in the
 * notes; the 0.1.0 options struct (without the field) is still accepted. */
static void AutoFill(void) {
  const int64_t w_shape[2] = {OUT, IN}, b_shape[1] = {OUT};
  const zr_param_spec params[2] = {{sizeof(zr_param_spec), "fc.w", 2, w_shape, "fc"},
                                   {sizeof(zr_param_spec), "fc.b", 1, b_shape, "fc"}};
  zr_comm* comm = NULL;
  zr_device* device = NULL;
  /* MUST leaves a thread function with NULL: this one returns nothing. */
  if (zr_comm_group_create(1, 0, &comm) != ZR_OK || zr_cpu_device_create(1, &device) != ZR_OK) {
    CHECK(0, "setup: %s", zr_last_error());
    zr_comm_destroy(comm);
    return;
  }
  const char* config = "{\"optimizer\": {\"params\": {\"lr\": \"auto\"}}, "
                       "\"bf16\": {\"enabled\": \"auto\"}}";
  zr_engine_options options = {.struct_size = sizeof options,
                               .auto_fill_json = "{\"lr\": 0.25, \"compute_dtype\": \"bf16\"}"};
  zr_engine* engine = NULL;
  zr_status st = zr_engine_create(config, params, 2, comm, device, &options, &engine);
  CHECK(st == ZR_OK, "%s", zr_last_error());
  if (engine != NULL) {
    const char* notes = NULL;
    CHECK(zr_engine_config_notes(engine, &notes) == ZR_OK &&
              strstr(notes, "optimizer.params.lr: auto -> 0.25 (from the trainer)\n") != NULL &&
              strstr(notes, "bf16.enabled: auto -> true") != NULL,
          "notes: '%s'", notes ? notes : "(null)");
    CHECK(zr_engine_compute_dtype(engine) == ZR_BF16, "auto bf16 not applied");
    zr_engine_destroy(engine);
    engine = NULL;
  }
  /* A caller built against 0.1.0 passes the smaller struct: no fill, the documented rules. */
  options.struct_size = offsetof(zr_engine_options, no_decay_1d);
  st = zr_engine_create(config, params, 2, comm, device, &options, &engine);
  CHECK(st == ZR_OK, "0.1.0 options: %s", zr_last_error());
  zr_engine_destroy(engine);
  engine = NULL;
  options.struct_size = sizeof options;
  options.auto_fill_json = "{\"learning_rate\": 1}";
  st = zr_engine_create(config, params, 2, comm, device, &options, &engine);
  CHECK(st == ZR_INVALID_ARGUMENT && engine == NULL && strstr(zr_last_error(), "learning_rate"),
        "%s", zr_last_error());
  zr_comm_destroy(comm);
  zr_device_destroy(device);
}

/* The launcher environment, MPI before initialization, and the GPU calls: here, without a GPU,
 * they must fail with the driver's reason rather than crash or pretend. */
static void LaunchMpiAndGpu(void) {
  zr_launch_info info = {sizeof info};
  zr_status st = zr_launch_info_from_env(&info);
  CHECK(st == ZR_NOT_FOUND, "no launcher variables: %s: %s", zr_status_name(st), zr_last_error());
  setenv("RANK", "1", 1);
  setenv("WORLD_SIZE", "4", 1);
  setenv("LOCAL_RANK", "1", 1);
  st = zr_launch_info_from_env(&info);
  CHECK(st == ZR_OK && info.rank == 1 && info.world_size == 4 && info.local_rank == 1 &&
            strcmp(info.source, "torchrun") == 0,
        "torchrun variables: %s: %s", zr_status_name(st), zr_last_error());
  setenv("WORLD_SIZE", "x", 1);
  st = zr_launch_info_from_env(&info);
  CHECK(st == ZR_INVALID_ARGUMENT && strstr(zr_last_error(), "WORLD_SIZE") != NULL, "%s",
        zr_last_error());
  unsetenv("RANK");
  unsetenv("WORLD_SIZE");
  unsetenv("LOCAL_RANK");

  zr_comm* comm = NULL;
  st = zr_mpi_comm_create(NULL, 0, &comm);
  CHECK(st == ZR_FAILED_PRECONDITION && comm == NULL && strstr(zr_last_error(), "zr_mpi_init"),
        "MPI not initialized: %s: %s", zr_status_name(st), zr_last_error());
  st = zr_nccl_comm_wrap(NULL, 0, &comm);
  CHECK(st == ZR_INVALID_ARGUMENT && strstr(zr_last_error(), "nccl_comm") != NULL, "%s",
        zr_last_error());
  st = zr_nccl_comm_create_from_env(0, &comm);
  CHECK(st == ZR_NOT_FOUND && comm == NULL, "NCCL without launcher variables: %s: %s",
        zr_status_name(st), zr_last_error());

  zr_device* device = NULL;
  st = zr_cuda_device_create(0, &device);
  if (st == ZR_OK) {
    printf("zero_c_test: a CUDA device exists; created and destroyed it\n");
    zr_device_destroy(device);
  } else {
    CHECK(st == ZR_FAILED_PRECONDITION && device == NULL &&
              strstr(zr_last_error(), "CUDA") != NULL,
          "no GPU: %s: %s", zr_status_name(st), zr_last_error());
    printf("zero_c_test: zr_cuda_device_create: %s: %s\n", zr_status_name(st), zr_last_error());
  }
  st = zr_cuda_device_create(-1, &device);
  CHECK(st != ZR_OK && device == NULL, "ordinal -1 accepted");
}

static void Conversions(void) {
  /* Round to nearest, ties to even. bf16 keeps 7 fraction bits, fp16 10:
   * 1 + 2^-8 is a bf16 tie (1 | 1 + 2^-7) -> 1, exact in fp16;
   * 1 + 3*2^-8 is a bf16 tie (1 + 2^-7 | 1 + 2^-6) -> 1 + 2^-6, exact in fp16;
   * 1 + 3*2^-11 is an fp16 tie (1 + 2^-10 | 1 + 2^-9) -> 1 + 2^-9, below half a bf16 step. */
  const float in[3] = {1.0f + 0x1p-8f, 1.0f + 0x3p-8f, 1.0f + 0x3p-11f};
  uint16_t h[3];
  float back[3];
  zr_convert(in, ZR_F32, h, ZR_BF16, 3);
  zr_convert(h, ZR_BF16, back, ZR_F32, 3);
  CHECK(back[0] == 1.0f && back[1] == 1.0f + 0x1p-6f && back[2] == 1.0f, "bf16: %.9g %.9g %.9g",
        back[0], back[1], back[2]);
  zr_convert(in, ZR_F32, h, ZR_F16, 3);
  zr_convert(h, ZR_F16, back, ZR_F32, 3);
  CHECK(back[0] == in[0] && back[1] == in[1] && back[2] == 1.0f + 0x1p-9f,
        "fp16: %.9g %.9g %.9g", back[0], back[1], back[2]);
}

/* The optimizer API on 3 in-process ranks: hyperparameters, parameter groups (fc.w its own,
 * fc.b by no_decay_1d), the split step, and the scalar reductions. */
#define OPT_RANKS 3
typedef struct {
  zr_comm* comm;
  zr_device* device;
  int rank;
} OptJob;

static int WriteGrads(zr_engine* e, float g) {
  for (int i = 0; i < 2; ++i) {
    void* p = NULL;
    if (zr_engine_grad(e, i, &p) != ZR_OK) return 0;
    const int n = i == 0 ? OUT * IN : OUT;
    for (int k = 0; k < n; ++k) ((float*)p)[k] = g;
    if (zr_engine_grad_ready(e, i) != ZR_OK) return 0;
  }
  return 1;
}

static void* OptimizerRank(void* arg) {
  OptJob* job = (OptJob*)arg;
  const int64_t w_shape[2] = {OUT, IN}, b_shape[1] = {OUT};
  zr_param_spec params[2] = {{sizeof(zr_param_spec), "fc.w", 2, w_shape, "fc"},
                             {sizeof(zr_param_spec), "fc.b", 1, b_shape, "fc"}};
  params[0].has_group = 1;
  params[0].weight_decay = 0.5;
  params[0].lr_scale = 2;
  zr_engine_options options = {sizeof options, NULL};
  options.no_decay_1d = 1;
  zr_engine* e = NULL;
  MUST(zr_engine_create("{\"zero_optimization\": {\"stage\": 2}}", params, 2, job->comm,
                        job->device, &options, &e));
  MUST(zr_engine_init_params(e, InitParams, NULL, 0));
  zr_status st = zr_engine_set_learning_rate(e, -1);
  CHECK(st == ZR_INVALID_ARGUMENT && strstr(zr_last_error(), "lr=-1") != NULL, "%s",
        zr_last_error());
  const zr_adamw_scalars set = {sizeof set, 0.05, 0.9, 0.999, 1e-8, 0.1};
  MUST(zr_engine_set_hyperparams(e, &set));
  zr_adamw_scalars got = {sizeof got};
  MUST(zr_engine_hyperparams(e, &got));
  CHECK(got.lr == 0.05 && got.weight_decay == 0.1, "hyperparams %g %g", got.lr, got.weight_decay);
  float before[NUM_ELEMENTS], after[NUM_ELEMENTS];
  MUST(zr_engine_gather_master_weights(e, before, NUM_ELEMENTS));
  /* An outlier window, skipped on every rank: nothing changes. */
  CHECK(WriteGrads(e, 100.0f), "grads: %s", zr_last_error());
  CHECK(zr_engine_last_micro_step(e) == 1, "not the last micro-step");
  zr_grad_norm norm = {sizeof norm};
  MUST(zr_engine_compute_grad_norm(e, &norm));
  CHECK(norm.overflow == 0 && fabs(norm.norm - 100.0 * sqrt(NUM_ELEMENTS)) < 1e-3, "norm %g",
        norm.norm);
  zr_step_stats stats = {sizeof stats};
  MUST(zr_engine_skip_step(e, &stats));
  CHECK(stats.skipped == 1 && zr_engine_step_count(e) == 0, "skip: %d", stats.skipped);
  MUST(zr_engine_gather_master_weights(e, after, NUM_ELEMENTS));
  CHECK(memcmp(before, after, sizeof before) == 0, "a skipped step changed the weights");
  /* A normal window, applied: Adam's first step moves each weight by lr_eff * sign(g), after
   * the group's decoupled decay. */
  CHECK(WriteGrads(e, 0.25f), "grads: %s", zr_last_error());
  MUST(zr_engine_compute_grad_norm(e, NULL));
  MUST(zr_engine_apply_step(e, NULL, &stats));
  CHECK(stats.step == 1 && stats.lr == 0.05 && stats.weight_decay == 0.1, "apply: %lld %g %g",
        (long long)stats.step, stats.lr, stats.weight_decay);
  MUST(zr_engine_gather_master_weights(e, after, NUM_ELEMENTS));
  for (int k = 0; k < NUM_ELEMENTS; ++k) {
    const int is_w = k < OUT * IN;
    const double lr = is_w ? 0.1 : 0.05, wd = is_w ? 0.5 : 0.0;
    const double want = before[k] * (1 - lr * wd) - lr;
    CHECK(fabs(after[k] - want) < 1e-5, "element %d: %g, want %g", k, after[k], want);
  }
  /* Scalars: sum, mean and max of per-rank values, the same on every rank. */
  double v[2] = {job->rank, 2.0 * job->rank + 0.5};
  MUST(zr_engine_allreduce_scalars(e, v, 2, ZR_REDUCE_SUM));
  CHECK(v[0] == 3 && v[1] == 7.5, "sum %g %g", v[0], v[1]);
  v[0] = job->rank;
  v[1] = -job->rank;
  MUST(zr_engine_allreduce_scalars(e, v, 2, ZR_REDUCE_MAX));
  CHECK(v[0] == 2 && v[1] == 0, "max %g %g", v[0], v[1]);
  v[0] = job->rank;
  MUST(zr_engine_allreduce_scalars(e, v, 1, ZR_REDUCE_AVG));
  CHECK(v[0] == 1, "avg %g", v[0]);
  /* Per-rank values gathered in rank order; too small an output fails before the collective. */
  const double mine[2] = {job->rank + 0.25, -10.0 * job->rank};
  double all[2 * OPT_RANKS];
  MUST(zr_engine_allgather_scalars(e, mine, 2, all, 2 * OPT_RANKS));
  for (int q = 0; q < OPT_RANKS; ++q) {
    CHECK(all[2 * q] == q + 0.25 && all[2 * q + 1] == -10.0 * q, "gathered from rank %d: %g %g",
          q, all[2 * q], all[2 * q + 1]);
  }
  CHECK(zr_engine_allgather_scalars(e, mine, 2, all, 2 * OPT_RANKS - 1) == ZR_OUT_OF_RANGE,
        "a short output must be refused");
  MUST(zr_engine_barrier(e));
  zr_engine_destroy(e);
  return NULL;
}

static void OptimizerApi(void) {
  zr_comm* comms[OPT_RANKS];
  zr_device* device = NULL;
  if (zr_comm_group_create(OPT_RANKS, 0, comms) != ZR_OK ||
      zr_cpu_device_create(1, &device) != ZR_OK) {
    CHECK(0, "setup: %s", zr_last_error());
    return;
  }
  pthread_t threads[OPT_RANKS];
  OptJob jobs[OPT_RANKS];
  for (int r = 0; r < OPT_RANKS; ++r) {
    jobs[r] = (OptJob){comms[r], device, r};
    pthread_create(&threads[r], NULL, OptimizerRank, &jobs[r]);
  }
  for (int r = 0; r < OPT_RANKS; ++r) pthread_join(threads[r], NULL);
  for (int r = 0; r < OPT_RANKS; ++r) zr_comm_destroy(comms[r]);
  zr_device_destroy(device);
}

int main(void) {
  AutoFill();
  const char* precisions[2] = {"bf16", "fp16"};
  for (int p = 0; p < 2; ++p) {
    for (int stage = 0; stage <= 3; ++stage) TrainOnTwoRanks(precisions[p], stage, stage == 1);
  }
  ErrorPaths();
  VersionAndIntrospection();
  LaunchMpiAndGpu();
  Conversions();
  OptimizerApi();
  if (g_failures != 0) {
    fprintf(stderr, "zero_c_test: %d check(s) failed\n", g_failures);
    return 1;
  }
  printf("zero_c_test: all checks passed\n");
  return 0;
}
