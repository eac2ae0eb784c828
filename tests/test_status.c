/* test_status.c - cmocka tests for base/status: making, annotating, freeing, code names. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <string.h>

#include "base/status.h"

static void test_make(void **state) {
  (void)state;
  kiln_status_t st = kiln_status_make(KILN_ERR_NOT_FOUND, "layer %d: tensor %s", 3, "w");
  assert_non_null(st);
  assert_int_equal(kiln_status_code(st), KILN_ERR_NOT_FOUND);
  assert_string_equal(kiln_status_message(st), "layer 3: tensor w");
  kiln_status_free(st);

  st = kiln_status_make(KILN_ERR_IO, "%s", "");
  assert_string_equal(kiln_status_message(st), "");
  kiln_status_free(st);
}

static kiln_status_t make_v(kiln_status_code_t code, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static kiln_status_t make_v(kiln_status_code_t code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  kiln_status_t st = kiln_status_makev(code, fmt, ap);
  va_end(ap);
  return st;
}

static void test_makev_and_long_messages(void **state) {
  (void)state;
  char big[5000];
  memset(big, 'x', sizeof(big) - 1);
  big[sizeof(big) - 1] = '\0';
  kiln_status_t st = make_v(KILN_ERR_DEVICE, "[%s]", big);
  assert_int_equal(kiln_status_code(st), KILN_ERR_DEVICE);
  assert_int_equal(strlen(kiln_status_message(st)), sizeof(big) + 1);
  assert_int_equal(kiln_status_message(st)[0], '[');
  assert_int_equal(kiln_status_message(st)[sizeof(big)], ']');
  kiln_status_free(st);
}

/* An error with code KILN_OK is a caller bug; it must still be an error, not success. */
static void test_make_with_ok_code_is_internal(void **state) {
  (void)state;
  kiln_status_t st = kiln_status_make(KILN_OK, "oops");
  assert_non_null(st);
  assert_int_equal(kiln_status_code(st), KILN_ERR_INTERNAL);
  assert_string_equal(kiln_status_message(st), "oops");
  kiln_status_free(st);
}

static void test_annotate_chains(void **state) {
  (void)state;
  kiln_status_t st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "bad value");
  kiln_status_t same = kiln_status_annotate(st, "key %s", "port");
  assert_ptr_equal(same, st);
  st = kiln_status_annotate(st, "file %s:%d", "k.ini", 12);
  assert_string_equal(kiln_status_message(st), "file k.ini:12: key port: bad value");
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  st = kiln_status_annotate(st, "%s", "");
  assert_string_equal(kiln_status_message(st), ": file k.ini:12: key port: bad value");
  kiln_status_free(st);
}

static void test_null_is_ok(void **state) {
  (void)state;
  assert_null(kiln_status_annotate(NULL, "context %d", 1));
  assert_int_equal(kiln_status_code(NULL), KILN_OK);
  assert_string_equal(kiln_status_message(NULL), "ok");
  kiln_status_free(NULL);
}

static void test_code_names(void **state) {
  (void)state;
  static const struct {
    kiln_status_code_t code;
    const char *name;
  } names[] = {
      {KILN_OK, "OK"},
      {KILN_ERR_INVALID_ARGUMENT, "INVALID_ARGUMENT"},
      {KILN_ERR_NOT_FOUND, "NOT_FOUND"},
      {KILN_ERR_OUT_OF_MEMORY, "OUT_OF_MEMORY"},
      {KILN_ERR_UNSUPPORTED, "UNSUPPORTED"},
      {KILN_ERR_IO, "IO"},
      {KILN_ERR_INCOMPATIBLE, "INCOMPATIBLE"},
      {KILN_ERR_DEVICE, "DEVICE"},
      {KILN_ERR_INTERNAL, "INTERNAL"},
  };
  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
    assert_string_equal(kiln_status_code_name(names[i].code), names[i].name);
  assert_string_equal(kiln_status_code_name((kiln_status_code_t)999), "UNKNOWN");
}

/* Each status is its own object: freeing one leaves another intact. */
static void test_independent(void **state) {
  (void)state;
  kiln_status_t a = kiln_status_make(KILN_ERR_IO, "a");
  kiln_status_t b = kiln_status_make(KILN_ERR_IO, "b");
  assert_ptr_not_equal(a, b);
  kiln_status_free(a);
  assert_string_equal(kiln_status_message(kiln_status_annotate(b, "x")), "x: b");
  kiln_status_free(b);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_make),
      cmocka_unit_test(test_makev_and_long_messages),
      cmocka_unit_test(test_make_with_ok_code_is_internal),
      cmocka_unit_test(test_annotate_chains),
      cmocka_unit_test(test_null_is_ok),
      cmocka_unit_test(test_code_names),
      cmocka_unit_test(test_independent),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
