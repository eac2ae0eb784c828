/* test_strbuf.c - cmocka tests for base/strbuf: growth, NUL termination, printf, UTF-8, the
 * failure flag, reset and detach. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "base/strbuf.h"

static void test_empty_is_valid(void **state) {
  (void)state;
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  assert_null(b.data);
  assert_string_equal(kiln_strbuf_cstr(&b), "");
  assert_true(kiln_strbuf_ok(&b));
  kiln_strbuf_reset(&b); /* on a never-used buffer */
  assert_int_equal(b.len, 0);
  kiln_strbuf_free(&b);
  kiln_strbuf_free(&b); /* twice is fine: free leaves it empty */
}

static void test_append_and_growth(void **state) {
  (void)state;
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  assert_true(kiln_strbuf_append_str(&b, "abc"));
  assert_true(kiln_strbuf_append(&b, "defgh", 2));
  assert_true(kiln_strbuf_append_char(&b, 'x'));
  assert_true(kiln_strbuf_append(&b, NULL, 0));
  assert_string_equal(kiln_strbuf_cstr(&b), "abcdex");
  assert_int_equal(b.len, 6);
  /* Many appends: content intact, always terminated, capacity grows geometrically. */
  size_t reallocs = 0, last_cap = b.cap;
  for (int i = 0; i < 100000; i++) {
    assert_true(kiln_strbuf_append_char(&b, (char)('a' + i % 26)));
    if (b.cap != last_cap) reallocs++, last_cap = b.cap;
    assert_int_equal(b.data[b.len], '\0');
  }
  assert_int_equal(b.len, 100006);
  assert_true(reallocs < 20);
  for (int i = 0; i < 100000; i++) assert_int_equal(b.data[6 + i], 'a' + i % 26);
  assert_true(b.cap > b.len);
  kiln_strbuf_free(&b);
}

static void test_embedded_nul(void **state) {
  (void)state;
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  assert_true(kiln_strbuf_append(&b, "a\0b", 3));
  assert_int_equal(b.len, 3);
  assert_memory_equal(b.data, "a\0b\0", 4);
  kiln_strbuf_free(&b);
}

static void test_printf(void **state) {
  (void)state;
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  assert_true(kiln_strbuf_printf(&b, "%d-%s", 42, "x"));
  assert_string_equal(b.data, "42-x");
  /* One that does not fit the current capacity: formats twice, result intact. */
  char big[3000];
  memset(big, 'z', sizeof(big) - 1);
  big[sizeof(big) - 1] = '\0';
  assert_true(kiln_strbuf_printf(&b, "[%s]", big));
  assert_int_equal(b.len, 4 + 2 + sizeof(big) - 1);
  assert_int_equal(b.data[4], '[');
  assert_int_equal(b.data[b.len - 1], ']');
  assert_int_equal(b.data[b.len], '\0');
  /* One that fits the spare room exactly. */
  kiln_strbuf_reset(&b);
  size_t room = b.cap - 1;
  assert_true(kiln_strbuf_printf(&b, "%0*d", (int)room, 7));
  assert_int_equal(b.len, room);
  assert_int_equal(b.data[room - 1], '7');
  assert_true(kiln_strbuf_printf(&b, "%s", ""));
  assert_int_equal(b.len, room);
  kiln_strbuf_free(&b);
}

static void test_utf8(void **state) {
  (void)state;
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  assert_true(kiln_strbuf_append_utf8(&b, 0x41));
  assert_true(kiln_strbuf_append_utf8(&b, 0xE9));
  assert_true(kiln_strbuf_append_utf8(&b, 0x20AC));
  assert_true(kiln_strbuf_append_utf8(&b, 0x1F600));
  assert_true(kiln_strbuf_append_utf8(&b, 0x10FFFF));
  assert_true(kiln_strbuf_append_utf8(&b, 0x7F));
  assert_true(kiln_strbuf_append_utf8(&b, 0x80));
  assert_true(kiln_strbuf_append_utf8(&b, 0x7FF));
  assert_true(kiln_strbuf_append_utf8(&b, 0x800));
  assert_true(kiln_strbuf_append_utf8(&b, 0xFFFF));
  assert_true(kiln_strbuf_append_utf8(&b, 0x10000));
  assert_string_equal(b.data,
                      "A\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80\xF4\x8F\xBF\xBF\x7F\xC2\x80\xDF\xBF"
                      "\xE0\xA0\x80\xEF\xBF\xBF\xF0\x90\x80\x80");
  /* Out-of-contract code points become U+FFFD rather than invalid UTF-8. */
  kiln_strbuf_reset(&b);
  assert_true(kiln_strbuf_append_utf8(&b, 0xD800));
  assert_true(kiln_strbuf_append_utf8(&b, 0x110000));
  assert_string_equal(b.data, "\xEF\xBF\xBD\xEF\xBF\xBD");
  assert_true(kiln_strbuf_append_utf8(&b, 0));
  assert_int_equal(b.len, 7);
  kiln_strbuf_free(&b);
}

/* An impossible reservation fails, sets the flag, and leaves the content as it was; later
 * appends still work, and the flag stays until reset. */
static void test_failure_flag(void **state) {
  (void)state;
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  assert_true(kiln_strbuf_append_str(&b, "keep"));
  char *data = b.data;
  size_t cap = b.cap;
  assert_false(kiln_strbuf_reserve(&b, SIZE_MAX));
  assert_false(kiln_strbuf_ok(&b));
  assert_ptr_equal(b.data, data);
  assert_int_equal(b.cap, cap);
  assert_string_equal(kiln_strbuf_cstr(&b), "keep");
  assert_false(kiln_strbuf_reserve(&b, SIZE_MAX - 3));
  /* Bigger than any object may be (PTRDIFF_MAX), without overflowing size_t. */
  assert_false(kiln_strbuf_reserve(&b, SIZE_MAX / 2));
  assert_string_equal(kiln_strbuf_cstr(&b), "keep");
  assert_true(kiln_strbuf_append_str(&b, "!"));
  assert_string_equal(kiln_strbuf_cstr(&b), "keep!");
  assert_false(kiln_strbuf_ok(&b));
  kiln_strbuf_reset(&b);
  assert_true(kiln_strbuf_ok(&b));
  assert_string_equal(kiln_strbuf_cstr(&b), "");
  assert_ptr_equal(b.data, data); /* reset keeps the allocation */
  kiln_strbuf_free(&b);

  /* On a never-allocated buffer too. */
  kiln_strbuf_t e = KILN_STRBUF_INIT;
  assert_false(kiln_strbuf_append(&e, "x", SIZE_MAX));
  assert_false(kiln_strbuf_ok(&e));
  assert_null(e.data);
  assert_string_equal(kiln_strbuf_cstr(&e), "");
  kiln_strbuf_free(&e);
}

static void test_reset_keeps_allocation(void **state) {
  (void)state;
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  assert_true(kiln_strbuf_append_str(&b, "hello world"));
  char *data = b.data;
  size_t cap = b.cap;
  kiln_strbuf_reset(&b);
  assert_ptr_equal(b.data, data);
  assert_int_equal(b.cap, cap);
  assert_int_equal(b.len, 0);
  assert_string_equal(b.data, "");
  kiln_strbuf_free(&b);
}

static void test_detach(void **state) {
  (void)state;
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  size_t len = 99;
  char *s = kiln_strbuf_detach(&b, &len); /* empty: a malloc'ed "" */
  assert_non_null(s);
  assert_string_equal(s, "");
  assert_int_equal(len, 0);
  free(s);

  assert_true(kiln_strbuf_printf(&b, "v=%d", 5));
  s = kiln_strbuf_detach(&b, &len);
  assert_string_equal(s, "v=5");
  assert_int_equal(len, 3);
  assert_null(b.data);
  assert_int_equal(b.len, 0);
  assert_int_equal(b.cap, 0);
  assert_true(kiln_strbuf_ok(&b));
  free(s);

  assert_true(kiln_strbuf_append_str(&b, "again")); /* reusable after detach */
  s = kiln_strbuf_detach(&b, NULL);
  assert_string_equal(s, "again");
  free(s);
  kiln_strbuf_free(&b);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_empty_is_valid),
      cmocka_unit_test(test_append_and_growth),
      cmocka_unit_test(test_embedded_nul),
      cmocka_unit_test(test_printf),
      cmocka_unit_test(test_utf8),
      cmocka_unit_test(test_failure_flag),
      cmocka_unit_test(test_reset_keeps_allocation),
      cmocka_unit_test(test_detach),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
