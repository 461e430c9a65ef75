/* The C ABI's activation declarations: zr_param_spec.activation_bytes_per_sample in, and
 * zr_memory_report's activation fields and device budget out, against the closed form of
 * docs/memory_budget.md at world 1 (no NCCL lines): buffers + activations + CUDA context +
 * cuBLAS workspace + ceil(fraction * (buffers + activations)). Also the older callers: a
 * parameter array of the previous zr_param_spec size declares nothing, and a report of the
 * previous zr_memory_report size is not written past. Plain C. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "capi/testing/check.h"
#include "zerort/zero_c.h"

static const char kConfig[] =
    "{\"zero_optimization\": {\"stage\": 2}, \"bf16\": {\"enabled\": true},"
    " \"train_micro_batch_size_per_gpu\": 3,"
    " \"zerort\": {\"reserves\": {\"cuda_context_bytes\": 1000, \"nccl_communicator_bytes\": 7,"
    " \"nccl_buffsize\": 5, \"nccl_channels\": 2, \"cublas_workspace_bytes\": 60,"
    " \"fragmentation_fraction\": 0.5}}}";

static const int64_t kShapeW[2] = {32, 16}, kShapeB[1] = {32};

static void Fill(zr_param_spec* p, int64_t w_bytes, int64_t b_bytes) {
  memset(p, 0, 2 * sizeof *p);
  p[0].struct_size = sizeof *p;
  p[0].name = "fc.w";
  p[0].ndim = 2;
  p[0].shape = kShapeW;
  p[0].module = "fc";
  p[0].activation_bytes_per_sample = w_bytes;
  p[1] = p[0];
  p[1].name = "fc.b";
  p[1].ndim = 1;
  p[1].shape = kShapeB;
  p[1].activation_bytes_per_sample = b_bytes;
}

static char g_error[1024]; /* the failing call's message: teardown calls come after it */

/* Creates a one-rank engine over `params` (stride params[0].struct_size) and fills `report`. */
static zr_status Report(const void* params, zr_memory_report* report) {
  zr_comm* comm = NULL;
  zr_device* device = NULL;
  zr_engine* engine = NULL;
  zr_status st = zr_comm_group_create(1, 0, &comm);
  if (st == ZR_OK) st = zr_cpu_device_create(1, &device);
  if (st == ZR_OK) {
    st = zr_engine_create(kConfig, (const zr_param_spec*)params, 2, comm, device, NULL, &engine);
  }
  if (st == ZR_OK) st = zr_engine_memory_report(engine, report);
  snprintf(g_error, sizeof g_error, "%s", zr_last_error());
  zr_engine_destroy(engine);
  zr_device_destroy(device);
  zr_comm_destroy(comm);
  return st;
}

static void DeclaredBytesComeBack(void) {
  zr_param_spec params[2];
  Fill(params, 4096, 100);
  zr_memory_report r = {sizeof r};
  CHECK(Report(params, &r) == ZR_OK, "%s", g_error);
  const int64_t per_sample = 4096 + 100, micro = 3;
  CHECK(r.activation_bytes_per_sample == per_sample, "per sample %lld",
        (long long)r.activation_bytes_per_sample);
  CHECK(r.micro_batch == micro, "micro-batch %lld", (long long)r.micro_batch);
  CHECK(r.activation_bytes == per_sample * micro, "activations %lld",
        (long long)r.activation_bytes);
  const int64_t buffers = r.planned_bytes[ZR_MEMORY_DEVICE];
  CHECK(buffers > 0, "no device buffers planned");
  const int64_t want = buffers + per_sample * micro + 1000 + 60 +
                       (int64_t)ceil(0.5 * (double)(buffers + per_sample * micro));
  CHECK(r.device_budget_bytes == want, "budget %lld, want %lld", (long long)r.device_budget_bytes,
        (long long)want);
}

static void NothingDeclared(void) {
  zr_param_spec params[2];
  Fill(params, 0, 0);
  zr_memory_report r = {sizeof r};
  CHECK(Report(params, &r) == ZR_OK, "%s", g_error);
  CHECK(r.activation_bytes_per_sample == 0 && r.micro_batch == 0 && r.activation_bytes == 0,
        "declared nothing, got %lld x %lld = %lld", (long long)r.activation_bytes_per_sample,
        (long long)r.micro_batch, (long long)r.activation_bytes);
  CHECK(r.device_budget_bytes == r.planned_bytes[ZR_MEMORY_DEVICE], "budget %lld, buffers %lld",
        (long long)r.device_budget_bytes, (long long)r.planned_bytes[ZR_MEMORY_DEVICE]);
}

/* A caller built against the header before the field: its array's stride is the older size,
 * and the library reads nothing past it. The report's older size is not written past. */
static void OlderCallers(void) {
  const size_t old_size = offsetof(zr_param_spec, activation_bytes_per_sample);
  zr_param_spec full[2];
  Fill(full, 0, 0);
  unsigned char packed[2 * sizeof(zr_param_spec)];
  memset(packed, 0x7f, sizeof packed); /* what follows each old element is not a declaration */
  for (int i = 0; i < 2; ++i) {
    full[i].struct_size = old_size;
    memcpy(packed + i * old_size, &full[i], old_size);
  }
  zr_memory_report r;
  memset(&r, 0x5a, sizeof r);
  r.struct_size = offsetof(zr_memory_report, activation_bytes_per_sample);
  CHECK(Report(packed, &r) == ZR_OK, "%s", g_error);
  int64_t untouched;
  memset(&untouched, 0x5a, sizeof untouched);
  CHECK(r.activation_bytes_per_sample == untouched && r.device_budget_bytes == untouched,
        "wrote past an older zr_memory_report");
  zr_memory_report now = {sizeof now};
  CHECK(Report(packed, &now) == ZR_OK, "%s", g_error);
  CHECK(now.activation_bytes == 0 && now.device_budget_bytes == now.planned_bytes[ZR_MEMORY_DEVICE],
        "an older zr_param_spec declared %lld bytes", (long long)now.activation_bytes);
}

static void NegativeIsRefused(void) {
  zr_param_spec params[2];
  Fill(params, 10, -1);
  zr_memory_report r = {sizeof r};
  const zr_status st = Report(params, &r);
  CHECK(st == ZR_INVALID_ARGUMENT && strstr(g_error, "fc.b") != NULL &&
            strstr(g_error, "activation_bytes_per_sample") != NULL,
        "%s: %s", zr_status_name(st), g_error);
}

int main(void) {
  DeclaredBytesComeBack();
  NothingDeclared();
  OlderCallers();
  NegativeIsRefused();
  if (g_failures != 0) {
    fprintf(stderr, "zero_c_activations_test: %d check(s) failed\n", g_failures);
    return 1;
  }
  printf("zero_c_activations_test: all checks passed\n");
  return 0;
}
