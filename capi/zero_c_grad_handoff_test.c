/* The C ABI's gradient hand-off declared before the plan: zr_param_spec.grad_buffer and
 * grad_buffer_offset in; zr_engine_set_grad_buffer's direct flag, zr_engine_grad_copy_reason
 * and zr_memory_report's trainer and engine gradient bytes out. One rank, stage 2, bf16: an
 * embedding whose padding lies over the next gradients is reduced in place; the tail is
 * copied, each with its reason; the masters equal those of the same steps through
 * zr_engine_grad. Also the older callers: a zr_param_spec of the previous size declares
 * nothing, and a zr_memory_report of the previous size is not written past. Plain C. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "capi/testing/check.h"
#include "zerort/zero_c.h"

static const char kConfig[] =
    "{\"zero_optimization\": {\"stage\": 2}, \"bf16\": {\"enabled\": true},"
    " \"gradient_clipping\": 0.1}";

/* emb.w: 320 elements, padded to 384 at world 1; its 64 padding elements lie over pos.w (48)
 * and out.b (16), packed after it. pos.w's and out.b's padding would run past the buffer. */
enum { kParams = 3, kTotal = 320 + 48 + 16, kSteps = 3 };
static const int64_t kShapes[kParams][2] = {{40, 8}, {6, 8}, {16, 1}};
static const int kNdim[kParams] = {2, 2, 1};
static const char* const kNames[kParams] = {"emb.w", "pos.w", "out.b"};
static const int64_t kOffset[kParams] = {0, 320, 368};

static void Fill(zr_param_spec* p, const char* buffer) {
  memset(p, 0, kParams * sizeof *p);
  for (int i = 0; i < kParams; ++i) {
    p[i].struct_size = sizeof *p;
    p[i].name = kNames[i];
    p[i].ndim = kNdim[i];
    p[i].shape = kShapes[i];
    p[i].module = kNames[i];
    p[i].grad_buffer = buffer;
    p[i].grad_buffer_offset = ZR_GRAD_BUFFER_PACKED;
  }
}

static void Init(void* user, int index, const char* name, int ndim, const int64_t* shape,
                 int64_t numel, float* values) {
  (void)user, (void)name, (void)ndim, (void)shape;
  for (int64_t k = 0; k < numel; ++k) values[k] = 0.01f * (float)((index * 37 + k * 11) % 23 - 11);
}

static float Grad(int step, int64_t k) { return 0.02f * (float)((step * 7 + k * 13) % 29 - 14); }

static char g_error[1024];

typedef struct {
  float master[kTotal];
  zr_memory_report report;
  int direct[kParams];
  char reason[kParams][512];
} Run;

/* kSteps steps at world 1: gradients through the trainer's packed buffer (`declared`) or
 * zr_engine_grad. */
static zr_status Train(int declared, Run* out) {
  zr_param_spec params[kParams];
  Fill(params, declared ? "grads" : NULL);
  zr_comm* comm = NULL;
  zr_device* device = NULL;
  zr_engine* e = NULL;
  uint16_t grads[kTotal], other[kTotal]; /* bf16: the trainer's buffer, and another one */
  zr_status st = zr_comm_group_create(1, 0, &comm);
  if (st == ZR_OK) st = zr_cpu_device_create(1, &device);
  if (st == ZR_OK) st = zr_engine_create(kConfig, params, kParams, comm, device, NULL, &e);
  if (st == ZR_OK) st = zr_engine_init_params(e, Init, NULL, 1);
  for (int i = 0; st == ZR_OK && declared && i < kParams; ++i) {
    st = zr_engine_set_grad_buffer(e, i, grads + kOffset[i], &out->direct[i]);
    const char* why = NULL;
    if (st == ZR_OK) st = zr_engine_grad_copy_reason(e, i, &why);
    if (st == ZR_OK) snprintf(out->reason[i], sizeof out->reason[i], "%s", why);
  }
  if (st == ZR_OK && declared) {
    /* From another allocation: refused, naming the buffer. */
    const zr_status moved = zr_engine_set_grad_buffer(e, 1, other + kOffset[1], NULL);
    CHECK(moved == ZR_FAILED_PRECONDITION && strstr(zr_last_error(), "'grads'") != NULL,
          "%s: %s", zr_status_name(moved), zr_last_error());
    void* p = NULL;
    const zr_status no_slot = zr_engine_grad(e, 0, &p);
    CHECK(no_slot == ZR_FAILED_PRECONDITION, "zr_engine_grad of a parameter reduced in place");
  }
  for (int step = 0; st == ZR_OK && step < kSteps; ++step) {
    for (int i = kParams - 1; st == ZR_OK && i >= 0; --i) {
      const int64_t n = kShapes[i][0] * kShapes[i][1];
      float g[320];
      for (int64_t k = 0; k < n; ++k) g[k] = Grad(step, kOffset[i] + k);
      void* dst = grads + kOffset[i];
      if (!declared) st = zr_engine_grad(e, i, &dst);
      if (st == ZR_OK) zr_convert(g, ZR_F32, dst, ZR_BF16, n);
      if (st == ZR_OK) st = zr_engine_grad_ready(e, i);
    }
    zr_step_stats stats = {.struct_size = sizeof stats};
    if (st == ZR_OK) st = zr_engine_step(e, &stats);
  }
  if (st == ZR_OK) st = zr_engine_gather_master_weights(e, out->master, kTotal);
  out->report.struct_size = sizeof out->report;
  if (st == ZR_OK) st = zr_engine_memory_report(e, &out->report);
  snprintf(g_error, sizeof g_error, "%s", zr_last_error());
  zr_engine_destroy(e);
  zr_device_destroy(device);
  zr_comm_destroy(comm);
  return st;
}

static void InPlaceWhereTheLayoutAllows(void) {
  static Run engine, declared;
  memset(&engine, 0, sizeof engine);
  memset(&declared, 0, sizeof declared);
  CHECK(Train(0, &engine) == ZR_OK, "%s", g_error);
  CHECK(Train(1, &declared) == ZR_OK, "%s", g_error);
  CHECK(memcmp(engine.master, declared.master, sizeof engine.master) == 0,
        "the masters differ between the hand-off and zr_engine_grad");
  CHECK(declared.direct[0] == 1 && declared.direct[1] == 0 && declared.direct[2] == 0,
        "direct %d %d %d", declared.direct[0], declared.direct[1], declared.direct[2]);
  CHECK(declared.reason[0][0] == '\0', "emb.w copied: %s", declared.reason[0]);
  CHECK(strstr(declared.reason[2], "past the last gradient declared in 'grads'") != NULL,
        "out.b: %s", declared.reason[2]);
  const zr_memory_report* m = &declared.report;
  CHECK(m->trainer_grad_bytes == kTotal * 2 && m->trainer_grad_in_place_bytes == 320 * 2 &&
            m->trainer_grad_copied_bytes == 64 * 2,
        "declared %lld, in place %lld, copied %lld", (long long)m->trainer_grad_bytes,
        (long long)m->trainer_grad_in_place_bytes, (long long)m->trainer_grad_copied_bytes);
  /* Stage 2 without the embedding's bucket: less gradient memory; allocated == planned. */
  CHECK(m->engine_grad_bytes < engine.report.engine_grad_bytes, "engine gradient bytes %lld, "
        "%lld without the declaration", (long long)m->engine_grad_bytes,
        (long long)engine.report.engine_grad_bytes);
  CHECK(engine.report.trainer_grad_bytes == 0, "nothing declared");
  for (int k = 0; k < ZR_NUM_MEMORY_KINDS; ++k) {
    CHECK(m->allocated_bytes[k] == m->planned_bytes[k], "kind %d: allocated %lld, planned %lld",
          k, (long long)m->allocated_bytes[k], (long long)m->planned_bytes[k]);
  }
}

/* An overlap between declared ranges is refused at create, naming both. */
static void OverlapIsRefused(void) {
  zr_param_spec params[kParams];
  Fill(params, "grads");
  params[1].grad_buffer_offset = 300;
  zr_comm* comm = NULL;
  zr_device* device = NULL;
  zr_engine* e = NULL;
  zr_status st = zr_comm_group_create(1, 0, &comm);
  if (st == ZR_OK) st = zr_cpu_device_create(1, &device);
  if (st == ZR_OK) st = zr_engine_create(kConfig, params, kParams, comm, device, NULL, &e);
  CHECK(st == ZR_INVALID_ARGUMENT && strstr(zr_last_error(), "'emb.w'") != NULL &&
            strstr(zr_last_error(), "'pos.w'") != NULL,
        "%s: %s", zr_status_name(st), zr_last_error());
  zr_engine_destroy(e);
  zr_device_destroy(device);
  zr_comm_destroy(comm);
}

/* A caller built against the header before the fields: nothing is declared, and its report is
 * not written past. */
static void OlderCallers(void) {
  const size_t old_size = offsetof(zr_param_spec, grad_buffer);
  zr_param_spec full[kParams];
  Fill(full, NULL);
  unsigned char packed[kParams * sizeof(zr_param_spec)];
  memset(packed, 0x7f, sizeof packed); /* what follows each old element is no declaration */
  for (int i = 0; i < kParams; ++i) {
    full[i].struct_size = old_size;
    memcpy(packed + i * old_size, &full[i], old_size);
  }
  zr_comm* comm = NULL;
  zr_device* device = NULL;
  zr_engine* e = NULL;
  zr_status st = zr_comm_group_create(1, 0, &comm);
  if (st == ZR_OK) st = zr_cpu_device_create(1, &device);
  if (st == ZR_OK) {
    st = zr_engine_create(kConfig, (const zr_param_spec*)packed, kParams, comm, device, NULL, &e);
  }
  CHECK(st == ZR_OK, "%s", zr_last_error());
  zr_memory_report r;
  memset(&r, 0x5a, sizeof r);
  r.struct_size = offsetof(zr_memory_report, trainer_grad_bytes);
  if (st == ZR_OK) st = zr_engine_memory_report(e, &r);
  CHECK(st == ZR_OK, "%s", zr_last_error());
  int64_t untouched;
  memset(&untouched, 0x5a, sizeof untouched);
  CHECK(r.trainer_grad_bytes == untouched && r.engine_grad_bytes == untouched,
        "wrote past an older zr_memory_report");
  zr_memory_report now = {sizeof now};
  if (st == ZR_OK) st = zr_engine_memory_report(e, &now);
  CHECK(st == ZR_OK && now.trainer_grad_bytes == 0 && now.engine_grad_bytes > 0,
        "an older zr_param_spec declared %lld bytes", (long long)now.trainer_grad_bytes);
  zr_engine_destroy(e);
  zr_device_destroy(device);
  zr_comm_destroy(comm);
}

int main(void) {
  InPlaceWhereTheLayoutAllows();
  OverlapIsRefused();
  OlderCallers();
  if (g_failures != 0) {
    fprintf(stderr, "zero_c_grad_handoff_test: %d check(s) failed\n", g_failures);
    return 1;
  }
  printf("zero_c_grad_handoff_test: all checks passed\n");
  return 0;
}
