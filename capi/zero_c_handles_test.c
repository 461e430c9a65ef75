/* The C ABI under misuse, as C trainers get it wrong: handles used after destroy, destroyed
 * twice, never created, or destroyed in the wrong order (a communicator or device before its
 * engine); messages holding a NUL; NULL parameters; a dtype outside the enum. Each must be a
 * status naming the call and the culprit, never a crash (run under ASan too, where a use after
 * free would stop the test). Plain C: a failed check prints its line and the test exits
 * non-zero. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "capi/testing/check.h"
#include "zerort/zero_c.h"


#define CONFIG "{\"zero_optimization\": {\"stage\": 2}}"
#define N 8

static void Init(void* user, int index, const char* name, int ndim, const int64_t* shape,
                 int64_t numel, float* values) {
  (void)user, (void)index, (void)name, (void)ndim, (void)shape;
  for (int64_t k = 0; k < numel; ++k) values[k] = 0.25f * (float)k;
}

static zr_engine* MakeEngine(zr_comm* comm, zr_device* device) {
  static const int64_t shape[1] = {N};
  const zr_param_spec params[1] = {{sizeof(zr_param_spec), "w", 1, shape, "m"}};
  zr_engine* e = NULL;
  zr_status st = zr_engine_create(CONFIG, params, 1, comm, device, NULL, &e);
  CHECK(st == ZR_OK, "create: %s", zr_last_error());
  if (st == ZR_OK) {
    st = zr_engine_init_params(e, Init, NULL, 0);
    CHECK(st == ZR_OK, "init: %s", zr_last_error());
  }
  return e;
}

/* One optimizer step with gradient 1 everywhere (fp32 by default): AdamW's first step moves
 * every weight by -lr (m/sqrt(v) = 1), whatever its value. */
static void StepOnce(zr_engine* e) {
  void* g = NULL;
  CHECK(zr_engine_grad(e, 0, &g) == ZR_OK, "grad: %s", zr_last_error());
  if (g == NULL) return;
  for (int k = 0; k < N; ++k) ((float*)g)[k] = 1.0f;
  CHECK(zr_engine_grad_ready(e, 0) == ZR_OK, "grad_ready: %s", zr_last_error());
  CHECK(zr_engine_step(e, NULL) == ZR_OK, "step: %s", zr_last_error());
}

static void UseAfterDestroy(void) {
  zr_comm* comm = NULL;
  zr_device* device = NULL;
  CHECK(zr_comm_group_create(1, 0, &comm) == ZR_OK, "%s", zr_last_error());
  CHECK(zr_cpu_device_create(1, &device) == ZR_OK, "%s", zr_last_error());
  zr_engine* e = MakeEngine(comm, device);
  /* A reduce op outside the enum is refused by value (UBSan stopped its load before). */
  double scalar = 1.0;
  CHECK(zr_engine_allreduce_scalars(e, &scalar, 1, (zr_reduce_op)7) == ZR_INVALID_ARGUMENT &&
            strstr(zr_last_error(), "op=7") != NULL && scalar == 1.0,
        "allreduce_scalars with op 7: %s", zr_last_error());
  zr_engine_destroy(e);
  zr_status st = zr_engine_step(e, NULL);
  CHECK(st == ZR_INVALID_ARGUMENT && strstr(zr_last_error(), "zr_engine_step") != NULL &&
            strstr(zr_last_error(), "not a live zr_engine") != NULL,
        "step after destroy: %s: %s", zr_status_name(st), zr_last_error());
  void* p = NULL;
  CHECK(zr_engine_param(e, 0, &p) == ZR_INVALID_ARGUMENT && p == NULL, "param after destroy");
  CHECK(zr_engine_step_count(e) == -1, "step count of a dead engine");
  /* The calls added with frozen parameters and safetensors check the handle as well. */
  int frozen = -1;
  CHECK(zr_engine_is_frozen(e, 0, &frozen) == ZR_INVALID_ARGUMENT && frozen == -1,
        "is_frozen after destroy: %s", zr_last_error());
  CHECK(zr_engine_set_gradient_sync(e, 1) == ZR_INVALID_ARGUMENT, "set_gradient_sync after destroy");
  CHECK(zr_engine_park(e) == ZR_INVALID_ARGUMENT, "park after destroy");
  CHECK(zr_engine_unpark(e) == ZR_INVALID_ARGUMENT, "unpark after destroy");
  CHECK(zr_engine_parked(e) == 0 && strstr(zr_last_error(), "zr_engine_parked") != NULL,
        "parked after destroy: '%s'", zr_last_error());
  int64_t parked_bytes = -1;
  CHECK(zr_engine_parked_bytes(e, &parked_bytes, NULL) == ZR_INVALID_ARGUMENT &&
            parked_bytes == -1,
        "parked_bytes after destroy");
  zr_param_group_info info = {sizeof(info)};
  CHECK(zr_engine_param_group(e, 0, &info) == ZR_INVALID_ARGUMENT, "param_group after destroy");
  CHECK(zr_engine_import_weights(e, "/nonexistent", 0, NULL, 0, NULL) == ZR_INVALID_ARGUMENT &&
            strstr(zr_last_error(), "not a live zr_engine") != NULL,
        "import_weights after destroy: %s", zr_last_error());
  CHECK(zr_engine_reduced_units(e) == 0, "reduced units of a dead engine");
  zr_engine_destroy(e); /* double destroy: reported, not freed twice */
  CHECK(strstr(zr_last_error(), "zr_engine_destroy") != NULL, "double destroy: '%s'",
        zr_last_error());
  zr_comm_destroy(comm);
  CHECK(zr_comm_rank(comm) == -1 && zr_comm_size(comm) == -1, "rank of a dead comm");
  zr_comm_destroy(comm);
  CHECK(strstr(zr_last_error(), "not a live zr_comm") != NULL, "comm double destroy: '%s'",
        zr_last_error());
  zr_device_destroy(device);
  int64_t resident = -1;
  CHECK(zr_device_memory(device, &resident, NULL) == ZR_INVALID_ARGUMENT && resident == -1,
        "device memory after destroy");
  zr_device_destroy(device);
  CHECK(strstr(zr_last_error(), "not a live zr_device") != NULL, "device double destroy: '%s'",
        zr_last_error());
  zr_checkpointer* ck = NULL;
  CHECK(zr_checkpointer_create(&ck) == ZR_OK, "%s", zr_last_error());
  zr_checkpointer_destroy(ck);
  st = zr_checkpointer_finish(ck, NULL);
  CHECK(st == ZR_INVALID_ARGUMENT && strstr(zr_last_error(), "zr_checkpointer") != NULL,
        "finish on a dead checkpointer: %s: %s", zr_status_name(st), zr_last_error());
  zr_checkpointer_destroy(ck);
}

/* A pointer that never was a handle (a trainer passing the wrong variable). */
static void NeverAHandle(void) {
  double not_a_handle[8] = {0};
  zr_status st = zr_engine_step((zr_engine*)not_a_handle, NULL);
  CHECK(st == ZR_INVALID_ARGUMENT && strstr(zr_last_error(), "not a live zr_engine") != NULL,
        "foreign pointer: %s: %s", zr_status_name(st), zr_last_error());
  zr_engine_destroy((zr_engine*)not_a_handle);
  CHECK(not_a_handle[0] == 0.0, "destroy wrote into a foreign pointer");
}

/* The communicator and device die before the engine: the engine keeps them alive and still
 * steps correctly; new engines cannot be made on the dead handles. */
static void WrongTeardownOrder(void) {
  zr_comm* comm = NULL;
  zr_device* device = NULL;
  CHECK(zr_comm_group_create(1, 0, &comm) == ZR_OK, "%s", zr_last_error());
  CHECK(zr_cpu_device_create(1, &device) == ZR_OK, "%s", zr_last_error());
  zr_engine* e = MakeEngine(comm, device);
  zr_comm_destroy(comm);
  zr_device_destroy(device);
  StepOnce(e);
  float master[N];
  CHECK(zr_engine_gather_master_weights(e, master, N) == ZR_OK, "%s", zr_last_error());
  zr_adamw_scalars h = {sizeof h};
  CHECK(zr_engine_hyperparams(e, &h) == ZR_OK, "%s", zr_last_error());
  for (int k = 0; k < N; ++k) {
    /* AdamW's first step, closed form: m_hat = v_hat = 1, decoupled weight decay. */
    const double w0 = 0.25 * k;
    const double want = w0 - h.lr * (1.0 / (1.0 + h.eps) + h.weight_decay * w0);
    const double err = master[k] - want;
    CHECK(err < 1e-6 && err > -1e-6, "w[%d] = %.9g, want %.9g (lr %g, wd %g)", k, master[k],
          want, h.lr, h.weight_decay);
  }
  zr_engine* second = NULL;
  static const int64_t shape[1] = {N};
  const zr_param_spec params[1] = {{sizeof(zr_param_spec), "w", 1, shape, "m"}};
  zr_status st = zr_engine_create(CONFIG, params, 1, comm, device, NULL, &second);
  CHECK(st == ZR_INVALID_ARGUMENT && second == NULL &&
            strstr(zr_last_error(), "comm") != NULL,
        "engine on a dead comm: %s: %s", zr_status_name(st), zr_last_error());
  zr_engine_destroy(e); /* releases the communicator and device too (ASan: no leak, no UAF) */
}

static void Messages(void) {
  zr_comm* comm = NULL;
  zr_device* device = NULL;
  CHECK(zr_comm_group_create(1, 0, &comm) == ZR_OK, "%s", zr_last_error());
  CHECK(zr_cpu_device_create(1, &device) == ZR_OK, "%s", zr_last_error());
  static const int64_t shape[1] = {N};
  const zr_param_spec params[1] = {{sizeof(zr_param_spec), "w", 1, shape, "m"}};
  zr_engine* e = NULL;
  /* A NUL inside a key: the message must not stop there. */
  zr_status st = zr_engine_create("{\"zero_optimization\": {\"st\\u0000age_typo\": 2}}", params,
                                  1, comm, device, NULL, &e);
  CHECK(st == ZR_INVALID_ARGUMENT && strstr(zr_last_error(), "st\\x00age_typo") != NULL,
        "NUL in a key: %s: '%s'", zr_status_name(st), zr_last_error());
  st = zr_engine_create(CONFIG, NULL, 1, comm, device, NULL, &e);
  CHECK(st == ZR_INVALID_ARGUMENT && strstr(zr_last_error(), "params is NULL") != NULL,
        "NULL params: %s: '%s'", zr_status_name(st), zr_last_error());
  st = zr_engine_create(CONFIG, params, 0, comm, device, NULL, &e);
  CHECK(st == ZR_INVALID_ARGUMENT && strstr(zr_last_error(), "at least one parameter") != NULL,
        "no parameters: %s: '%s'", zr_status_name(st), zr_last_error());
  zr_comm_destroy(comm);
  zr_device_destroy(device);
}

static void Convert(void) {
  const float src[2] = {1.0f, -2.5f};
  uint16_t dst[2] = {0x1234, 0x5678};
  zr_status st = zr_convert(src, ZR_F32, dst, (zr_dtype)7, 2);
  CHECK(st == ZR_INVALID_ARGUMENT && strstr(zr_last_error(), "dst_dtype 7") != NULL &&
            dst[0] == 0x1234 && dst[1] == 0x5678,
        "dtype 7: %s: '%s', dst %x %x", zr_status_name(st), zr_last_error(), dst[0], dst[1]);
  st = zr_convert(dst, (zr_dtype)-1, (void*)src, ZR_F32, 2);
  CHECK(st == ZR_INVALID_ARGUMENT && strstr(zr_last_error(), "src_dtype -1") != NULL &&
            src[0] == 1.0f,
        "dtype -1: %s: '%s'", zr_status_name(st), zr_last_error());
  /* bf16 of 1.0 and -2.5 are exact: 0x3F80 and 0xC020 (sign, exponent, top mantissa bits). */
  st = zr_convert(src, ZR_F32, dst, ZR_BF16, 2);
  CHECK(st == ZR_OK && dst[0] == 0x3F80 && dst[1] == 0xC020, "bf16: %s %x %x",
        zr_status_name(st), dst[0], dst[1]);
}

/* zr_engine_device_times: refused without the option (naming it) and before a step; after a
 * step, the step it is of and phases that add up (the CPU device's clock). */
static void DeviceTimes(void) {
  zr_comm* comm = NULL;
  zr_device* device = NULL;
  CHECK(zr_comm_group_create(1, 0, &comm) == ZR_OK, "%s", zr_last_error());
  CHECK(zr_cpu_device_create(1, &device) == ZR_OK, "%s", zr_last_error());
  zr_engine* plain = MakeEngine(comm, device);
  StepOnce(plain);
  zr_device_times t = {sizeof t};
  zr_status st = zr_engine_device_times(plain, &t);
  CHECK(st == ZR_FAILED_PRECONDITION && strstr(zr_last_error(), "device_timing") != NULL,
        "device_times without the option: %s: %s", zr_status_name(st), zr_last_error());
  zr_engine_destroy(plain);

  static const int64_t shape[1] = {N};
  const zr_param_spec params[1] = {{sizeof(zr_param_spec), "w", 1, shape, "m"}};
  zr_engine_options options;
  memset(&options, 0, sizeof options);
  options.struct_size = sizeof options;
  options.device_timing = 1;
  zr_engine* e = NULL;
  CHECK(zr_engine_create(CONFIG, params, 1, comm, device, &options, &e) == ZR_OK, "create: %s",
        zr_last_error());
  if (e != NULL) {
    CHECK(zr_engine_init_params(e, Init, NULL, 0) == ZR_OK, "init: %s", zr_last_error());
    st = zr_engine_device_times(e, &t);
    CHECK(st == ZR_FAILED_PRECONDITION, "device_times before a step: %s", zr_status_name(st));
    StepOnce(e);
    StepOnce(e);
    CHECK(zr_engine_device_times(e, NULL) == ZR_INVALID_ARGUMENT, "NULL out");
    st = zr_engine_device_times(e, &t);
    CHECK(st == ZR_OK, "device_times: %s", zr_last_error());
    CHECK(t.struct_size == sizeof t && t.step == 2 && t.step == zr_engine_step_count(e) &&
              t.norm_ms >= 0 && t.update_ms >= 0 && t.gather_ms >= 0 &&
              t.total_ms >= t.norm_ms + t.update_ms - 1e-6,
          "step %lld: norm %g update %g gather %g total %g", (long long)t.step, t.norm_ms,
          t.update_ms, t.gather_ms, t.total_ms);
    zr_engine_destroy(e);
  }
  zr_device_destroy(device);
  zr_comm_destroy(comm);
}

int main(void) {
  DeviceTimes();
  UseAfterDestroy();
  NeverAHandle();
  WrongTeardownOrder();
  Messages();
  Convert();
  if (g_failures != 0) {
    fprintf(stderr, "%d check(s) failed\n", g_failures);
    return 1;
  }
  printf("all handle and message checks passed\n");
  return 0;
}
