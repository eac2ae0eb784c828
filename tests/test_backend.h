/* test_backend.h - which backend a model-level suite runs on (test_fp8, test_gguf,
 * test_qlinear): $KILN_TEST_BACKEND, else the first GPU backend (cuda, rocm) that
 * $KILN_TEST_BACKENDS names (the op suite's variable, which tools/dev/gpu_run.sh sets), else
 * cpu. */
#ifndef KILN_TESTS_TEST_BACKEND_H
#define KILN_TESTS_TEST_BACKEND_H

#include <stdlib.h>
#include <string.h>

static inline const char *test_backend_name(void) {
  const char *one = getenv("KILN_TEST_BACKEND");
  if (one && *one) return one;
  const char *list = getenv("KILN_TEST_BACKENDS");
  static const char *const gpus[] = {"cuda", "rocm"};
  for (const char *p = list; p && *p;) {
    size_t len = strcspn(p, ", ");
    for (size_t i = 0; i < sizeof(gpus) / sizeof(gpus[0]); i++)
      if (len == strlen(gpus[i]) && strncmp(p, gpus[i], len) == 0) return gpus[i];
    p += len;
    p += strspn(p, ", ");
  }
  return "cpu";
}

#endif
