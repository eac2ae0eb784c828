/* test_model_util.h - what the model-level suites (test_fp8, test_kv_fp8, test_qlinear) share:
 * status checks that fail the running cmocka test, and opening the backend they run on
 * (test_backend.h's choice). Include after <cmocka.h>. */
#ifndef KILN_TESTS_TEST_MODEL_UTIL_H
#define KILN_TESTS_TEST_MODEL_UTIL_H

#include <stdio.h>
#include <string.h>

#include "base/status.h"
#include "hal/loader.h"
#include "test_backend.h"

/* Fails the test with st's message unless st is NULL. */
static inline void check_st(kiln_status_t st) {
  if (st) fail_msg("%s", kiln_status_message(st));
}

/* Fails unless st is an error whose message holds frag1 (and frag2 when not NULL); frees it. */
static inline void expect_err(kiln_status_t st, const char *frag1, const char *frag2) {
  if (!st) fail_msg("no error (wanted one mentioning %s)", frag1);
  const char *msg = kiln_status_message(st);
  if (!strstr(msg, frag1) || (frag2 && !strstr(msg, frag2)))
    fail_msg("got: %s\n  want: ...%s...%s", msg, frag1, frag2 ? frag2 : "");
  kiln_status_free(st);
}

/* A registry, the suite's backend plugin, its device 0 and a stream: 0, or -1 with the reason
 * on stderr (a cmocka setup's return). */
static inline int test_open_backend(kiln_hal_registry_t **reg, const kiln_hal_plugin_t **plugin,
                                    kiln_hal_device_t **dev, kiln_hal_stream_t **stream) {
  kiln_hal_registry_options_t o = {0};
  kiln_status_t st = kiln_hal_registry_create(&o, reg);
  if (!st) st = kiln_hal_registry_open(*reg, test_backend_name(), plugin);
  if (st) {
    fprintf(stderr, "%s\n", kiln_status_message(st));
    kiln_status_free(st);
    return -1;
  }
  const kiln_hal_backend_t *be = &(*plugin)->table;
  if (be->device_open(0, dev) || be->stream_create(*dev, stream)) {
    fprintf(stderr, "%s: cannot open device 0 and a stream\n", test_backend_name());
    return -1;
  }
  return 0;
}

#endif /* KILN_TESTS_TEST_MODEL_UTIL_H */
