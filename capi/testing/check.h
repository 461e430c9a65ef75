/* CHECK for the C ABI's tests, which are plain C (no test framework): a failed condition prints
 * its file, line and a printf-style message, is counted, and the test goes on; main() ends with
 * `return CheckFailures();`. Thread-safe, for tests that run ranks on pthreads. Each including
 * file gets its own counter (static). */
#ifndef ZERORT_CAPI_TESTING_CHECK_H_
#define ZERORT_CAPI_TESTING_CHECK_H_

#include <pthread.h>
#include <stdio.h>

static int g_failures = 0;
static pthread_mutex_t g_check_mu = PTHREAD_MUTEX_INITIALIZER;

#define CHECK(cond, ...)                                                        \
  do {                                                                          \
    if (!(cond)) {                                                              \
      pthread_mutex_lock(&g_check_mu);                                          \
      fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond);  \
      fprintf(stderr, __VA_ARGS__);                                             \
      fprintf(stderr, "\n");                                                    \
      ++g_failures;                                                             \
      pthread_mutex_unlock(&g_check_mu);                                        \
    }                                                                           \
  } while (0)

#endif /* ZERORT_CAPI_TESTING_CHECK_H_ */
