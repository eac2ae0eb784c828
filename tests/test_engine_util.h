/* test_engine_util.h - the configuration overrides every engine test starts from (test_engine,
 * test_tp_engine), so that KILN_TEST_BACKEND means the same in each. Header-only. */
#ifndef KILN_TESTS_TEST_ENGINE_UTIL_H
#define KILN_TESTS_TEST_ENGINE_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

typedef struct test_engine_base {
  char path[1200], backend[64], threads[32];
} test_engine_base_t;

/* Fills ov[0..3] with model.path=PATH, backend.name=$KILN_TEST_BACKEND (cpu when unset or
 * empty; cuda on the GPU machine), backend.threads=THREADS and model.dtype=float32, the
 * strings kept in b (which must outlive the engine's creation). Returns 4. */
static inline int32_t test_engine_base(test_engine_base_t *b, const char *path, int32_t threads,
                                       const char **ov) {
  const char *want = getenv("KILN_TEST_BACKEND");
  snprintf(b->path, sizeof(b->path), "model.path=%s", path);
  snprintf(b->backend, sizeof(b->backend), "backend.name=%s", want && want[0] ? want : "cpu");
  snprintf(b->threads, sizeof(b->threads), "backend.threads=%d", (int)threads);
  ov[0] = b->path;
  ov[1] = b->backend;
  ov[2] = b->threads;
  ov[3] = "model.dtype=float32";
  return 4;
}

#endif
