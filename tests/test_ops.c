/* test_ops.c - the op conformance suite: every op of the plugin ABI on every usable backend,
 * against the fp64 reference in ops_ref.c, on fresh random inputs.
 *
 * Environment:
 *   KILN_BACKEND_PATH   where the loader finds plugins (CTest points it at build/lib/kiln)
 *   KILN_TEST_BACKENDS  comma-separated backend names to test (default: every usable one)
 *   KILN_TEST_SEED      the random seed (default: the time; printed at start to reproduce)
 *   KILN_TEST_ONLY      a cmocka name pattern (`*` and `?` wildcards, e.g. "test_ops_attention*")
 *                       restricting the tests run; a setup failure still fails the run
 * The suite fails when no backend is usable: a run that tested nothing must not pass. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include <cmocka.h>

#include "ops_cases.h"
#include "ops_harness.h"

static const char *g_setup_why;

static void test_ops_backends(void **state) {
  (void)state;
  if (g_setup_why) fail_msg("%s", g_setup_why);
  assert_true(oh_num_backends > 0);
}

int main(void) {
  const char *s = getenv("KILN_TEST_SEED");
  oh_seed = (s && *s) ? strtoull(s, NULL, 0) : (uint64_t)time(NULL);
  printf("test_ops: seed %llu (set KILN_TEST_SEED=%llu to reproduce)\n",
         (unsigned long long)oh_seed, (unsigned long long)oh_seed);
  oh_setup(&g_setup_why);
  if (g_setup_why) printf("test_ops: %s\n", g_setup_why);
  fflush(stdout);

  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_ops_backends),
      cmocka_unit_test(test_ops_gemm),
      cmocka_unit_test(test_ops_gemm_quant),
      cmocka_unit_test(test_ops_embedding),
      cmocka_unit_test(test_ops_rmsnorm),
      cmocka_unit_test(test_ops_rope),
      cmocka_unit_test(test_ops_silu_mul),
      cmocka_unit_test(test_ops_add),
      cmocka_unit_test(test_ops_copy),
      cmocka_unit_test(test_ops_kv_write),
      cmocka_unit_test(test_ops_kv_write_fp8),
      cmocka_unit_test(test_ops_attention),
      cmocka_unit_test(test_ops_attention_fp8),
      cmocka_unit_test(test_ops_attention_vision),
      cmocka_unit_test(test_ops_argmax),
      cmocka_unit_test(test_ops_topk),
      cmocka_unit_test(test_ops_penalize),
      cmocka_unit_test(test_ops_mask_logits),
      cmocka_unit_test(test_ops_sample),
      cmocka_unit_test(test_ops_graphs),
      cmocka_unit_test(test_ops_bad_args),
      cmocka_unit_test(test_ops_layernorm),
      cmocka_unit_test(test_ops_activation),
      cmocka_unit_test(test_ops_vision_bad_args),
      cmocka_unit_test(test_ops_vision_graphs),
  };
  const char *only = getenv("KILN_TEST_ONLY");
  if (only && *only) {
    if (g_setup_why) return 1; /* test_ops_backends may be filtered out: fail here instead */
    cmocka_set_test_filter(only);
  }
  int failed = cmocka_run_group_tests_name("ops", tests, NULL, NULL);
  oh_teardown();
  if (failed)
    printf("test_ops: %d test(s) failed with seed %llu\n", failed, (unsigned long long)oh_seed);
  return failed ? 1 : 0;
}
