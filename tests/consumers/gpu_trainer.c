/* A smoke test of an installed tree on a GPU machine (tests/consumers/gpu_smoke.sh), installed
 * as PREFIX/bin/zerort_c_smoke: plain C99 against <zerort/zero_c.h>, needing no CUDA headers
 * and no compiler on that machine. One rank (world 1), ZeRO stage 2, a few AdamW steps on a
 * fixed gradient sequence, run twice: on the CPU device over an in-process group, then on
 * zr_cuda_device_create(0) over zr_nccl_comm_create_from_env (torchrun variables for one rank
 * are set when absent). Gradients reach device memory through the CUDA driver API
 * (libcuda.so.1, dlopen-ed). Prints the largest difference between the two runs' fp32 masters.
 *
 * Exit status: 0 when both ran and the masters agree within 1e-5; 1 on a failure or a larger
 * difference; 77 when no GPU is usable (the CPU run passed), printing "SKIPPED: " and why. */
#define _POSIX_C_SOURCE 200112L
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zerort/zero_c.h>

#define OUT 64
#define IN 32
#define STEPS 5
#define NUMEL (OUT * IN + OUT)

static const char kConfig[] =
    "{\"zero_optimization\": {\"stage\": 2}, \"bf16\": {\"enabled\": true},"
    " \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 0.01, \"weight_decay\": 0.01}},"
    " \"comm_timeout_ms\": 60000}";

/* The CUDA driver API calls used, through dlopen: no CUDA header or library at build time. */
typedef int (*CuInit)(unsigned);
typedef int (*CuDeviceGet)(int*, int);
typedef int (*CuPrimaryCtxRetain)(void**, int);
typedef int (*CuCtxSetCurrent)(void*);
typedef int (*CuMemcpyHtoD)(unsigned long long, const void*, size_t);
typedef int (*CuCtxSynchronize)(void);
static struct {
  CuMemcpyHtoD memcpy_htod;
  CuCtxSynchronize synchronize;
} cu;

/* Binds device 0's primary context (the one the engine's CUDA runtime uses) to this thread. */
static int LoadDriver(char* why, size_t n) {
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (h == NULL) {
    snprintf(why, n, "libcuda.so.1: %s", dlerror());
    return 0;
  }
  CuInit init = (CuInit)dlsym(h, "cuInit");
  CuDeviceGet device_get = (CuDeviceGet)dlsym(h, "cuDeviceGet");
  CuPrimaryCtxRetain retain = (CuPrimaryCtxRetain)dlsym(h, "cuDevicePrimaryCtxRetain");
  CuCtxSetCurrent set_current = (CuCtxSetCurrent)dlsym(h, "cuCtxSetCurrent");
  cu.memcpy_htod = (CuMemcpyHtoD)dlsym(h, "cuMemcpyHtoD_v2");
  cu.synchronize = (CuCtxSynchronize)dlsym(h, "cuCtxSynchronize");
  if (!init || !device_get || !retain || !set_current || !cu.memcpy_htod || !cu.synchronize) {
    snprintf(why, n, "libcuda.so.1 lacks a driver API function");
    return 0;
  }
  int dev = 0, r;
  void* ctx = NULL;
  if ((r = init(0)) != 0 || (r = device_get(&dev, 0)) != 0 || (r = retain(&ctx, dev)) != 0 ||
      (r = set_current(ctx)) != 0) {
    snprintf(why, n, "CUDA driver API error %d", r);
    return 0;
  }
  return 1;
}

static float Grad(int k, int step) { return 0.1f * sinf(0.37f * (float)k + 1.3f * (float)step); }

static void Init(void* user, int index, const char* name, int ndim, const int64_t* shape,
                 int64_t numel, float* values) {
  (void)user, (void)name, (void)ndim, (void)shape;
  for (int64_t k = 0; k < numel; ++k) values[k] = 0.05f * cosf((float)(k + 1000 * index));
}

#define TRY(call)                                                                        \
  do {                                                                                   \
    zr_status s_ = (call);                                                               \
    if (s_ != ZR_OK) {                                                                   \
      fprintf(stderr, "%s: %s: %s\n", #call, zr_status_name(s_), zr_last_error());      \
      return 0;                                                                          \
    }                                                                                    \
  } while (0)

/* STEPS steps on (comm, device); the masters into masters[NUMEL]. on_gpu: gradients go to
 * device memory with cuMemcpyHtoD. */
static int Train(zr_comm* comm, zr_device* device, int on_gpu, float* masters) {
  const int64_t w_shape[2] = {OUT, IN}, b_shape[1] = {OUT};
  const zr_param_spec params[2] = {{sizeof(zr_param_spec), "fc.w", 2, w_shape, "fc"},
                                   {sizeof(zr_param_spec), "fc.b", 1, b_shape, "fc"}};
  const int64_t numel[2] = {OUT * IN, OUT};
  zr_engine* e = NULL;
  TRY(zr_engine_create(kConfig, params, 2, comm, device, NULL, &e));
  TRY(zr_engine_init_params(e, Init, NULL, 1));
  const zr_dtype dtype = zr_engine_compute_dtype(e);
  const size_t elem = dtype == ZR_F32 ? 4 : 2;
  static float g[OUT * IN];
  static unsigned char converted[OUT * IN * 4];
  for (int step = 0; step < STEPS; ++step) {
    for (int i = 1; i >= 0; --i) {  /* backward order: the bias was registered last */
      void* p = NULL;
      TRY(zr_engine_grad(e, i, &p));
      for (int64_t k = 0; k < numel[i]; ++k) g[k] = Grad((int)k + 5000 * i, step);
      if (on_gpu) {
        TRY(zr_convert(g, ZR_F32, converted, dtype, numel[i]));
        if (cu.memcpy_htod((unsigned long long)(uintptr_t)p, converted, numel[i] * elem) != 0) {
          fprintf(stderr, "cuMemcpyHtoD failed\n");
          return 0;
        }
      } else {
        TRY(zr_convert(g, ZR_F32, p, dtype, numel[i]));
      }
      TRY(zr_engine_grad_ready(e, i));
    }
    zr_step_stats stats = {.struct_size = sizeof stats};
    TRY(zr_engine_step(e, &stats));
  }
  TRY(zr_engine_gather_master_weights(e, masters, NUMEL));
  if (on_gpu && cu.synchronize() != 0) return 0;
  zr_engine_destroy(e);
  return 1;
}

int main(void) {
  static float cpu[NUMEL], gpu[NUMEL];
  printf("zerort_c_smoke: zerort %s\n", zr_version_string());
  zr_comm* comm = NULL;
  zr_device* device = NULL;
  if (zr_comm_group_create(1, 0, &comm) != ZR_OK || zr_cpu_device_create(1, &device) != ZR_OK ||
      !Train(comm, device, 0, cpu)) {
    fprintf(stderr, "CPU run: %s\nFAILED\n", zr_last_error());
    return 1;
  }
  zr_device_destroy(device);
  zr_comm_destroy(comm);
  printf("cpu device, in-process group: %d steps\n", STEPS);

  char why[256];
  if (zr_cuda_device_create(0, &device) != ZR_OK) {
    printf("SKIPPED: zr_cuda_device_create: %s\n", zr_last_error());
    return 77;
  }
  if (!LoadDriver(why, sizeof why)) {
    printf("SKIPPED: %s\n", why);
    return 77;
  }
  /* One torchrun rank, unless a launcher set them. */
  setenv("RANK", "0", 0);
  setenv("WORLD_SIZE", "1", 0);
  setenv("LOCAL_RANK", "0", 0);
  setenv("LOCAL_WORLD_SIZE", "1", 0);
  setenv("MASTER_ADDR", "127.0.0.1", 0);
  setenv("MASTER_PORT", "29517", 0);
  if (zr_nccl_comm_create_from_env(60000, &comm) != ZR_OK) {
    fprintf(stderr, "zr_nccl_comm_create_from_env: %s\nFAILED\n", zr_last_error());
    return 1;
  }
  if (!Train(comm, device, 1, gpu)) {
    fprintf(stderr, "GPU run: %s\nFAILED\n", zr_last_error());
    return 1;
  }
  zr_comm_destroy(comm);
  zr_device_destroy(device);
  double max_diff = 0;
  for (int k = 0; k < NUMEL; ++k) {
    const double d = fabs((double)cpu[k] - (double)gpu[k]);
    if (d > max_diff || d != d) max_diff = d;
  }
  const int ok = max_diff <= 1e-5;
  printf("cuda device, NCCL: %d steps; masters: max |cpu - cuda| = %.3g over %d elements: %s\n",
         STEPS, max_diff, NUMEL, ok ? "match (<= 1e-5)" : "DIFFER");
  printf("%s\n", ok ? "PASSED" : "FAILED");
  return ok ? 0 : 1;
}
