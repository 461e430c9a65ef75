/* A trainer as a user outside this tree writes it: plain C99 against the installed
 * <zerort/zero_c.h>, built by tests/consumers/cmake (find_package), tests/consumers/Makefile
 * (pkg-config) and Bazel (//tests/consumers:trainer). It fits a linear regression
 * y = W x + b to a fixed teacher with ZeRO stage 2 in bf16 on 2 ranks and exits non-zero unless
 * the loss falls to a tenth on every rank.
 *
 * Ranks: under mpirun (zr_launch_info_from_env reports "openmpi") one per MPI process, over
 * zr_mpi_comm_create; otherwise 2 in-process ranks, one thread each. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <zerort/zero_c.h>

#define IN 8
#define OUT 2
#define BATCH 32
#define STEPS 40
#define WORLD 2

static const char kConfig[] =
    "{\"zero_optimization\": {\"stage\": 2}, \"bf16\": {\"enabled\": true},"
    " \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 0.05, \"weight_decay\": 0}},"
    " \"comm_timeout_ms\": 60000}";

typedef struct {
  zr_comm* comm;
  zr_device* device;
  float first_loss;
  float last_loss;
  int ok;
} Rank;

static float Teacher(int o, int i) { return i < IN ? sinf((float)(1 + o * IN + i)) : 0.3f * o; }

/* Deterministic inputs in [-1, 1), different per rank and step. */
static float Rand(uint64_t* state) {
  *state = *state * 6364136223846793005ull + 1442695040888963407ull;
  return (float)((*state >> 40) & 0xffffff) / 8388608.0f - 1.0f;
}

static void Init(void* user, int index, const char* name, int ndim, const int64_t* shape,
                 int64_t numel, float* values) {
  (void)user, (void)index, (void)name, (void)ndim, (void)shape;
  for (int64_t k = 0; k < numel; ++k) values[k] = 0;
}

#define TRY(call)                                                                        \
  do {                                                                                   \
    zr_status s_ = (call);                                                               \
    if (s_ != ZR_OK) {                                                                   \
      fprintf(stderr, "%s: %s: %s\n", #call, zr_status_name(s_), zr_last_error());      \
      return NULL;                                                                       \
    }                                                                                    \
  } while (0)

/* One training step: forward from the parameters, backward into the gradients, step. */
static void* Train(void* arg) {
  Rank* r = (Rank*)arg;
  const int rank = zr_comm_rank(r->comm);
  const int64_t w_shape[2] = {OUT, IN}, b_shape[1] = {OUT};
  const zr_param_spec params[2] = {{sizeof(zr_param_spec), "fc.w", 2, w_shape, "fc"},
                                   {sizeof(zr_param_spec), "fc.b", 1, b_shape, "fc"}};
  zr_engine* e = NULL;
  TRY(zr_engine_create(kConfig, params, 2, r->comm, r->device, NULL, &e));
  TRY(zr_engine_init_params(e, Init, NULL, 1));
  const zr_dtype dtype = zr_engine_compute_dtype(e);
  float x[BATCH][IN], y[BATCH][OUT], d[BATCH][OUT], w[OUT * IN], b[OUT], gw[OUT * IN], gb[OUT];
  for (int step = 0; step < STEPS; ++step) {
    uint64_t state = 7919ull * (uint64_t)(rank + 1) + (uint64_t)step;
    void* p = NULL;
    TRY(zr_engine_param(e, 0, &p));
    zr_convert(p, dtype, w, ZR_F32, OUT * IN);
    TRY(zr_engine_param(e, 1, &p));
    zr_convert(p, dtype, b, ZR_F32, OUT);
    float loss = 0;
    memset(gw, 0, sizeof gw);
    memset(gb, 0, sizeof gb);
    for (int s = 0; s < BATCH; ++s) {
      for (int i = 0; i < IN; ++i) x[s][i] = Rand(&state);
      for (int o = 0; o < OUT; ++o) {
        float pred = b[o];
        y[s][o] = Teacher(o, IN);
        for (int i = 0; i < IN; ++i) {
          pred += w[o * IN + i] * x[s][i];
          y[s][o] += Teacher(o, i) * x[s][i];
        }
        d[s][o] = pred - y[s][o];
        loss += d[s][o] * d[s][o] / (BATCH * OUT);
        gb[o] += 2 * d[s][o] / (BATCH * OUT);
        for (int i = 0; i < IN; ++i) gw[o * IN + i] += 2 * d[s][o] * x[s][i] / (BATCH * OUT);
      }
    }
    if (step == 0) r->first_loss = loss;
    r->last_loss = loss;
    TRY(zr_engine_grad(e, 1, &p));
    zr_convert(gb, ZR_F32, p, dtype, OUT);
    TRY(zr_engine_grad_ready(e, 1));
    TRY(zr_engine_grad(e, 0, &p));
    zr_convert(gw, ZR_F32, p, dtype, OUT * IN);
    TRY(zr_engine_grad_ready(e, 0));
    zr_step_stats stats = {.struct_size = sizeof stats};
    TRY(zr_engine_step(e, &stats));
  }
  zr_engine_destroy(e);
  printf("trainer rank %d: loss %.5f -> %.5f\n", rank, r->first_loss, r->last_loss);
  r->ok = r->last_loss < 0.1f * r->first_loss;
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
    pthread_create(&threads[i], NULL, Train, &ranks[i]);
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
  Train(&rank);
  zr_comm_destroy(rank.comm);
  zr_device_destroy(rank.device);
  zr_mpi_finalize();
  return rank.ok;
}

int main(void) {
  if (zr_version() != ZR_VERSION) {
    fprintf(stderr, "library %s, header %d\n", zr_version_string(), ZR_VERSION);
    return 1;
  }
  zr_launch_info launch = {.struct_size = sizeof launch};
  const int mpi = zr_launch_info_from_env(&launch) == ZR_OK &&
                  strcmp(launch.source, "openmpi") == 0;
  const int ok = mpi ? RunMpi() : RunInProcess();
  printf("trainer (%s, zerort %s): %s\n", mpi ? "mpirun" : "2 in-process ranks",
         zr_version_string(), ok ? "loss fell" : "FAILED");
  return ok ? 0 : 1;
}
