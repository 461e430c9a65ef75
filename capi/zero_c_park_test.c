/* zr_engine_park / zr_engine_unpark from C: an engine trained 3 steps, parked (its device's own
 * count drops to nothing), unparked and trained 3 more ends bit for bit where an engine that
 * never parked ends after 6; zr_engine_param pointers survive; parking twice, stepping while
 * parked and unparking an unparked engine are ZR_FAILED_PRECONDITION with a message. Plain C:
 * a failed check prints its line and the test exits non-zero. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "capi/testing/check.h"
#include "zerort/zero_c.h"

#define NUM_PARAMS 2
static const int64_t kShape0[2] = {33, 17};
static const int64_t kShape1[1] = {129};
static const int64_t kNumel[NUM_PARAMS] = {33 * 17, 129};
static const char* kConfig =
    "{\"zero_optimization\": {\"stage\": 2}, \"bf16\": {\"enabled\": true},"
    " \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 0.01, \"weight_decay\": 0.1}}}";

static void Init(void* user, int index, const char* name, int ndim, const int64_t* shape,
                 int64_t numel, float* values) {
  (void)user, (void)name, (void)ndim, (void)shape;
  for (int64_t k = 0; k < numel; ++k) values[k] = (float)((k * 37 + index * 11) % 101) / 101.0f;
}

static uint16_t Bf16(float x) { /* round to nearest even; the values here are finite */
  uint32_t u;
  memcpy(&u, &x, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* Optimizer steps [first, first + steps): gradients depend on the step index only. The CPU
 * device's memory is host memory, so the gradients are written in place. */
static void Train(zr_engine* e, int first, int steps) {
  for (int step = first; step < first + steps; ++step) {
    for (int i = NUM_PARAMS - 1; i >= 0; --i) {
      void* g = NULL;
      CHECK(zr_engine_grad(e, i, &g) == ZR_OK, "grad: %s", zr_last_error());
      if (g == NULL) return;
      uint16_t* b = (uint16_t*)g;
      for (int64_t k = 0; k < kNumel[i]; ++k) {
        b[k] = Bf16((float)((k * 13 + i * 7 + step * 5) % 29 - 14) / 16.0f);
      }
      CHECK(zr_engine_grad_ready(e, i) == ZR_OK, "grad_ready: %s", zr_last_error());
    }
    zr_step_stats st = {.struct_size = sizeof st};
    CHECK(zr_engine_step(e, &st) == ZR_OK, "step %d: %s", step, zr_last_error());
  }
}

static zr_engine* Create(zr_comm* comm, zr_device* device) {
  const zr_param_spec params[NUM_PARAMS] = {{sizeof(zr_param_spec), "fc.w", 2, kShape0, "fc"},
                                            {sizeof(zr_param_spec), "fc.b", 1, kShape1, "fc"}};
  zr_engine* e = NULL;
  CHECK(zr_engine_create(kConfig, params, NUM_PARAMS, comm, device, NULL, &e) == ZR_OK,
        "create: %s", zr_last_error());
  if (e != NULL) {
    CHECK(zr_engine_init_params(e, Init, NULL, 1) == ZR_OK, "init: %s", zr_last_error());
  }
  return e;
}

static int Says(zr_status got, zr_status want, const char* text) {
  return got == want && strstr(zr_last_error(), text) != NULL;
}

int main(void) {
  zr_comm* parked_comm[1];
  zr_comm* ref_comm[1];
  zr_device* parked_dev = NULL;
  zr_device* ref_dev = NULL;
  CHECK(zr_comm_group_create(1, 0, parked_comm) == ZR_OK, "%s", zr_last_error());
  CHECK(zr_comm_group_create(1, 0, ref_comm) == ZR_OK, "%s", zr_last_error());
  CHECK(zr_cpu_device_create(1, &parked_dev) == ZR_OK, "%s", zr_last_error());
  CHECK(zr_cpu_device_create(1, &ref_dev) == ZR_OK, "%s", zr_last_error());
  zr_engine* e = Create(parked_comm[0], parked_dev);
  zr_engine* ref = Create(ref_comm[0], ref_dev);
  if (e == NULL || ref == NULL) return 1;

  CHECK(Says(zr_engine_unpark(e), ZR_FAILED_PRECONDITION, "not parked"), "unpark unparked: %s",
        zr_last_error());
  Train(e, 0, 3);
  void* p0 = NULL;
  CHECK(zr_engine_param(e, 0, &p0) == ZR_OK, "%s", zr_last_error());
  int64_t resident = -1, reserved = -1;
  CHECK(zr_device_memory(parked_dev, &resident, &reserved) == ZR_OK, "%s", zr_last_error());
  CHECK(resident > 0 && resident == reserved, "resident %lld reserved %lld", (long long)resident,
        (long long)reserved);

  for (int cycle = 0; cycle < 2; ++cycle) {
    CHECK(zr_engine_park(e) == ZR_OK, "park: %s", zr_last_error());
    CHECK(zr_engine_parked(e) == 1, "parked");
    int64_t now = -1, device_bytes = -1, host_bytes = -1;
    CHECK(zr_device_memory(parked_dev, &now, NULL) == ZR_OK, "%s", zr_last_error());
    CHECK(now == 0, "the device still holds %lld bytes", (long long)now);
    CHECK(zr_engine_parked_bytes(e, &device_bytes, &host_bytes) == ZR_OK, "%s", zr_last_error());
    CHECK(device_bytes > 0 && device_bytes <= resident && host_bytes > 0,
          "parked bytes: device %lld host %lld", (long long)device_bytes, (long long)host_bytes);
    CHECK(Says(zr_engine_park(e), ZR_FAILED_PRECONDITION, "already parked"), "park twice: %s",
          zr_last_error());
    zr_step_stats st = {.struct_size = sizeof st};
    CHECK(Says(zr_engine_step(e, &st), ZR_FAILED_PRECONDITION, "parked"), "step: %s",
          zr_last_error());
    void* g = NULL;
    CHECK(Says(zr_engine_grad(e, 0, &g), ZR_FAILED_PRECONDITION, "parked"), "grad: %s",
          zr_last_error());
    CHECK(zr_engine_unpark(e) == ZR_OK, "unpark: %s", zr_last_error());
    CHECK(zr_engine_parked(e) == 0, "unparked");
    CHECK(zr_device_memory(parked_dev, &now, NULL) == ZR_OK && now == resident,
          "device memory back: %lld of %lld", (long long)now, (long long)resident);
    void* again = NULL;
    CHECK(zr_engine_param(e, 0, &again) == ZR_OK && again == p0, "param(0) moved");
  }
  CHECK(Says(zr_engine_unpark(e), ZR_FAILED_PRECONDITION, "not parked"), "%s", zr_last_error());
  CHECK(zr_engine_parked(NULL) == 0, "NULL engine");
  CHECK(zr_engine_park(NULL) == ZR_INVALID_ARGUMENT, "NULL engine");

  Train(e, 3, 3);
  Train(ref, 0, 6);
  const int64_t n = kNumel[0] + kNumel[1];
  float got[33 * 17 + 129], want[33 * 17 + 129];
  CHECK(zr_engine_gather_master_weights(e, got, n) == ZR_OK, "%s", zr_last_error());
  CHECK(zr_engine_gather_master_weights(ref, want, n) == ZR_OK, "%s", zr_last_error());
  CHECK(memcmp(got, want, sizeof got) == 0, "masters differ from the engine that never parked");
  for (int i = 0; i < NUM_PARAMS; ++i) {
    void* a = NULL;
    void* b = NULL;
    CHECK(zr_engine_param(e, i, &a) == ZR_OK && zr_engine_param(ref, i, &b) == ZR_OK, "%s",
          zr_last_error());
    if (a != NULL && b != NULL) {
      CHECK(memcmp(a, b, (size_t)kNumel[i] * 2) == 0, "param %d differs", i);
    }
  }

  /* Destroyed while parked: everything is returned. */
  CHECK(zr_engine_park(e) == ZR_OK, "%s", zr_last_error());
  zr_engine_destroy(e);
  zr_engine_destroy(ref);
  int64_t left = -1;
  CHECK(zr_device_memory(parked_dev, &left, &reserved) == ZR_OK && left == 0 && reserved == 0,
        "after destroy: resident %lld reserved %lld", (long long)left, (long long)reserved);
  zr_device_destroy(parked_dev);
  zr_device_destroy(ref_dev);
  zr_comm_destroy(parked_comm[0]);
  zr_comm_destroy(ref_comm[0]);
  if (g_failures > 0) {
    fprintf(stderr, "%d check(s) failed\n", g_failures);
    return 1;
  }
  printf("zr_engine_park: state bit for bit across two cycles, device memory released, errors "
         "checked\n");
  return 0;
}
