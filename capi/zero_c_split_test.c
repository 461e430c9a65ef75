/* zr_comm_split from C: world 4 on in-process ranks (pthreads) split as 2 x 2, shard groups
 * {0,1} {2,3} and replica groups {0,2} {1,3}, each checked by its size, its ranks and a sum of
 * (world rank + 1) over an engine on it, which must add its own two members and no others
 * (closed form). A reversed key reverses the new ranks; a negative color gives NULL; a dead
 * handle and a NULL out are refused by name. Plain C: a failed check prints its line and the test
 * exits non-zero. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "capi/testing/check.h"
#include "zerort/zero_c.h"

#define WORLD 4


static zr_comm* g_world[WORLD];
static zr_device* g_device;

static void Init(void* user, int index, const char* name, int ndim, const int64_t* shape,
                 int64_t numel, float* values) {
  (void)user, (void)index, (void)name, (void)ndim, (void)shape;
  for (int64_t k = 0; k < numel; ++k) values[k] = 0.0f;
}

/* Creates an engine on `comm`, sums (world rank + 1) over it and returns the sum (-1 on error). */
static double SumOver(zr_comm* comm, int world_rank) {
  static const int64_t shape[1] = {4};
  const zr_param_spec params[1] = {{sizeof(zr_param_spec), "w", 1, shape, "m"}};
  zr_engine* e = NULL;
  zr_status st = zr_engine_create("{\"zero_optimization\": {\"stage\": 1}}", params, 1, comm,
                                  g_device, NULL, &e);
  CHECK(st == ZR_OK, "engine on a split: %s", zr_last_error());
  if (st != ZR_OK) return -1;
  CHECK(zr_engine_init_params(e, Init, NULL, 0) == ZR_OK, "init: %s", zr_last_error());
  double x = world_rank + 1;
  st = zr_engine_allreduce_scalars(e, &x, 1, ZR_REDUCE_SUM);
  CHECK(st == ZR_OK, "allreduce on a split: %s", zr_last_error());
  zr_engine_destroy(e);
  return st == ZR_OK ? x : -1;
}

static void* Rank(void* arg) {
  const int r = (int)(intptr_t)arg;
  zr_comm* shard = NULL;
  zr_comm* replica = NULL;
  zr_comm* reversed = NULL;
  zr_comm* none = (zr_comm*)&none; /* must be overwritten with NULL */
  CHECK(zr_comm_split(g_world[r], r / 2, r, &shard) == ZR_OK, "shard split: %s", zr_last_error());
  CHECK(zr_comm_split(g_world[r], r % 2, r, &replica) == ZR_OK, "replica split: %s",
        zr_last_error());
  /* Everyone in one group, keyed in reverse: new rank = WORLD - 1 - r. */
  CHECK(zr_comm_split(g_world[r], 0, -r, &reversed) == ZR_OK, "reversed split: %s",
        zr_last_error());
  /* Rank 3 opts out; the others form one group of 3. */
  zr_comm* three = NULL;
  CHECK(zr_comm_split(g_world[r], r == 3 ? -1 : 7, r, r == 3 ? &none : &three) == ZR_OK,
        "opt-out split: %s", zr_last_error());
  if (shard != NULL && replica != NULL && reversed != NULL) {
    CHECK(zr_comm_size(shard) == 2 && zr_comm_rank(shard) == r % 2, "rank %d: shard %d of %d", r,
          zr_comm_rank(shard), zr_comm_size(shard));
    CHECK(zr_comm_size(replica) == 2 && zr_comm_rank(replica) == r / 2,
          "rank %d: replica %d of %d", r, zr_comm_rank(replica), zr_comm_size(replica));
    CHECK(zr_comm_size(reversed) == WORLD && zr_comm_rank(reversed) == WORLD - 1 - r,
          "rank %d: reversed %d of %d", r, zr_comm_rank(reversed), zr_comm_size(reversed));
    /* Shard {0,1}: 1 + 2; {2,3}: 3 + 4. Replica {0,2}: 1 + 3; {1,3}: 2 + 4. */
    const double shard_sum = SumOver(shard, r);
    const double want_shard = r < 2 ? 3.0 : 7.0;
    CHECK(shard_sum == want_shard, "rank %d: shard sum %g, want %g", r, shard_sum, want_shard);
    const double replica_sum = SumOver(replica, r);
    const double want_replica = r % 2 == 0 ? 4.0 : 6.0;
    CHECK(replica_sum == want_replica, "rank %d: replica sum %g, want %g", r, replica_sum,
          want_replica);
    /* Without an engine: sum, max and avg over the replica group (as a tensor-parallel trainer
     * combines its squared gradient norms), and a NaN wins a max. */
    double v[3] = {r + 1.0, r == 2 ? NAN : (double)r, 0.25 * r};
    CHECK(zr_comm_allreduce_scalars(replica, v, 1, ZR_REDUCE_SUM) == ZR_OK, "comm sum: %s",
          zr_last_error());
    CHECK(v[0] == want_replica, "rank %d: comm sum %g, want %g", r, v[0], want_replica);
    CHECK(zr_comm_allreduce_scalars(replica, v + 1, 1, ZR_REDUCE_MAX) == ZR_OK, "comm max: %s",
          zr_last_error());
    CHECK(r % 2 == 0 ? v[1] != v[1] : v[1] == 3.0, "rank %d: comm max %g", r, v[1]);
    CHECK(zr_comm_allreduce_scalars(replica, v + 2, 1, ZR_REDUCE_AVG) == ZR_OK, "comm avg: %s",
          zr_last_error());
    const double want_avg = r % 2 == 0 ? 0.25 : 0.5; /* (0 + 0.5) / 2, (0.25 + 0.75) / 2 */
    CHECK(v[2] == want_avg, "rank %d: comm avg %g, want %g", r, v[2], want_avg);
    /* Ranks passing different counts fail alike, naming them. */
    double w[2] = {1, 2};
    const zr_status st = zr_comm_allreduce_scalars(shard, w, r % 2 == 0 ? 1 : 2, ZR_REDUCE_SUM);
    CHECK(st == ZR_INVALID_ARGUMENT && strstr(zr_last_error(), "passed n=") != NULL,
          "rank %d: mismatched n gave %d: %s", r, (int)st, zr_last_error());
  }
  if (r == 3) {
    CHECK(none == NULL, "a negative color must give NULL");
  } else if (three != NULL) {
    CHECK(zr_comm_size(three) == 3 && zr_comm_rank(three) == r, "rank %d: %d of %d", r,
          zr_comm_rank(three), zr_comm_size(three));
    const double sum = SumOver(three, r);
    CHECK(sum == 6.0, "rank %d: sum over {0,1,2} %g, want 6", r, sum);
  }
  /* Independent of the parent: destroyed before it, in any order. */
  zr_comm_destroy(replica);
  zr_comm_destroy(shard);
  zr_comm_destroy(reversed);
  zr_comm_destroy(three);
  return NULL;
}

int main(void) {
  if (zr_comm_group_create(WORLD, 60000, g_world) != ZR_OK ||
      zr_cpu_device_create(1, &g_device) != ZR_OK) {
    fprintf(stderr, "setup: %s\n", zr_last_error());
    return 1;
  }
  pthread_t threads[WORLD];
  for (int r = 0; r < WORLD; ++r) {
    pthread_create(&threads[r], NULL, Rank, (void*)(intptr_t)r);
  }
  for (int r = 0; r < WORLD; ++r) pthread_join(threads[r], NULL);

  zr_comm* out = NULL;
  zr_status st = zr_comm_split(g_world[0], 0, 0, NULL);
  CHECK(st == ZR_INVALID_ARGUMENT && strstr(zr_last_error(), "zr_comm_split") != NULL,
        "NULL out: %s: %s", zr_status_name(st), zr_last_error());
  for (int r = 0; r < WORLD; ++r) zr_comm_destroy(g_world[r]);
  st = zr_comm_split(g_world[0], 0, 0, &out);
  CHECK(st == ZR_INVALID_ARGUMENT && out == NULL && strstr(zr_last_error(), "zr_comm_split"),
        "dead handle: %s: %s", zr_status_name(st), zr_last_error());
  zr_device_destroy(g_device);
  if (g_failures != 0) {
    fprintf(stderr, "%d check(s) failed\n", g_failures);
    return 1;
  }
  printf("zr_comm_split: 2 x 2 shard and replica groups, reversed keys and an opt-out checked\n");
  return 0;
}
