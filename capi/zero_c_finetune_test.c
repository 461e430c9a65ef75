/* The C ABI's fine-tuning section: frozen parameters named in the config, the refusal to
 * change the frozen set of a live engine, and the per-micro-step gradient sync switch. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "capi/testing/check.h"
#include "zerort/zero_c.h"

/* The library's last message with every failed expectation. */
#define EXPECT(cond) CHECK(cond, "%s", zr_last_error())

static zr_engine* Create(const char* config, zr_comm* comm, zr_device* device) {
  static const int64_t base_shape[2] = {16, 8}, lora_shape[2] = {2, 8}, bias_shape[1] = {16};
  zr_param_spec specs[3];
  memset(specs, 0, sizeof(specs));
  const char* names[3] = {"l0.w", "l0.lora_a", "l0.b"};
  const int64_t* shapes[3] = {base_shape, lora_shape, bias_shape};
  const int ndims[3] = {2, 2, 1};
  for (int i = 0; i < 3; ++i) {
    specs[i].struct_size = sizeof(zr_param_spec);
    specs[i].name = names[i];
    specs[i].ndim = ndims[i];
    specs[i].shape = shapes[i];
    specs[i].module = "l0";
  }
  zr_engine* engine = NULL;
  EXPECT(zr_engine_create(config, specs, 3, comm, device, NULL, &engine) == ZR_OK);
  return engine;
}

int main(void) {
  zr_comm* comm = NULL;
  zr_device* device = NULL;
  if (zr_comm_group_create(1, 20000, &comm) != ZR_OK || zr_cpu_device_create(1, &device) != ZR_OK) {
    fprintf(stderr, "setup: %s\n", zr_last_error());
    return 1;
  }
  zr_engine* e = Create(
      "{\"zero_optimization\": {\"stage\": 1}, \"gradient_accumulation_steps\": 2,"
      " \"zerort\": {\"frozen_params\": \"*.w\", \"local_grad_accumulation\": true}}",
      comm, device);
  if (e == NULL) return 1;
  int frozen = -1;
  EXPECT(zr_engine_is_frozen(e, 0, &frozen) == ZR_OK && frozen == 1);
  EXPECT(zr_engine_is_frozen(e, 1, &frozen) == ZR_OK && frozen == 0);
  EXPECT(zr_engine_is_frozen(e, 3, &frozen) == ZR_OUT_OF_RANGE);
  EXPECT(zr_engine_grad_ready(e, 0) == ZR_FAILED_PRECONDITION);
  EXPECT(strstr(zr_last_error(), "'l0.w'") != NULL);
  EXPECT(zr_engine_set_frozen(e, 0, 1) == ZR_OK);
  EXPECT(zr_engine_set_frozen(e, 0, 0) == ZR_FAILED_PRECONDITION);
  EXPECT(zr_engine_set_gradient_sync(e, 0) == ZR_OK);
  EXPECT(zr_engine_set_gradient_sync(e, 1) == ZR_OK);
  zr_engine_destroy(e);

  zr_engine* reducing = Create("{\"zero_optimization\": {\"stage\": 1}}", comm, device);
  if (reducing == NULL) return 1;
  EXPECT(zr_engine_set_gradient_sync(reducing, 0) == ZR_FAILED_PRECONDITION);
  EXPECT(strstr(zr_last_error(), "zerort.local_grad_accumulation") != NULL);
  zr_engine_destroy(reducing);
  zr_device_destroy(device);
  zr_comm_destroy(comm);
  if (g_failures == 0) printf("all passed\n");
  return g_failures == 0 ? 0 : 1;
}
