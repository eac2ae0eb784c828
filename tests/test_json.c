/* test_json.c - cmocka tests for base/json: every error class with its position, UTF-8 and
 * escape handling, nesting limits, duplicate and big objects, numbers, the Python-compatible
 * writers, round trips, and the real tokenizer.json when $KILN_TOKENIZER_CACHE points at one. */
#define _POSIX_C_SOURCE 200809L
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <locale.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "base/json.h"

/* ---- helpers ------------------------------------------------------------------------------ */

static kiln_json_doc_t *parse_n(const char *text, size_t len) {
  kiln_json_doc_t *doc = NULL;
  kiln_status_t st = kiln_json_parse(text, len, "t.json", &doc);
  if (st) fail_msg("unexpected error: %s", kiln_status_message(st));
  assert_non_null(doc);
  return doc;
}

static kiln_json_doc_t *parse(const char *text) { return parse_n(text, strlen(text)); }

/* Expects parsing text[0..len) to fail with "t.json: line L, column C: <what...>". */
static void expect_error_n(const char *text, size_t len, int line, int col, const char *what) {
  kiln_json_doc_t *doc = (kiln_json_doc_t *)(uintptr_t)1;
  kiln_status_t st = kiln_json_parse(text, len, "t.json", &doc);
  assert_null(doc);
  if (!st) fail_msg("parsed but should not have: %.*s", (int)(len > 60 ? 60 : len), text);
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  char prefix[64];
  snprintf(prefix, sizeof(prefix), "t.json: line %d, column %d: ", line, col);
  const char *msg = kiln_status_message(st);
  if (strncmp(msg, prefix, strlen(prefix)) != 0 || !strstr(msg + strlen(prefix), what))
    fail_msg("input %.*s\n  got:  %s\n  want: %s...%s", (int)(len > 60 ? 60 : len), text, msg,
             prefix, what);
  kiln_status_free(st);
}

static void expect_error(const char *text, int line, int col, const char *what) {
  expect_error_n(text, strlen(text), line, col, what);
}

/* The decoded string of a document that is one JSON string. */
static void expect_decoded_n(const char *json, const char *want, size_t want_len) {
  kiln_json_doc_t *doc = parse(json);
  size_t n = 99;
  const char *s = kiln_json_string(kiln_json_root(doc), &n);
  assert_non_null(s);
  assert_int_equal(n, want_len);
  assert_memory_equal(s, want, want_len);
  assert_int_equal(s[n], '\0');
  kiln_json_doc_free(doc);
}

static void expect_decoded(const char *json, const char *want) {
  expect_decoded_n(json, want, strlen(want));
}

static double parse_number(const char *json) {
  kiln_json_doc_t *doc = parse(json);
  assert_int_equal(kiln_json_type(kiln_json_root(doc)), KILN_JSON_NUMBER);
  double d = kiln_json_number(kiln_json_root(doc));
  kiln_json_doc_free(doc);
  return d;
}

/* Whether json (a number) has an exact int64 value, and which. */
static bool parse_int64(const char *json, int64_t *out) {
  kiln_json_doc_t *doc = parse(json);
  bool ok = kiln_json_int64(kiln_json_root(doc), out);
  kiln_json_doc_free(doc);
  return ok;
}

static void expect_written(const char *what, kiln_strbuf_t *b, const char *want) {
  assert_true(kiln_strbuf_ok(b));
  if (strcmp(kiln_strbuf_cstr(b), want) != 0)
    fail_msg("%s: got %s, want %s", what, kiln_strbuf_cstr(b), want);
  kiln_strbuf_reset(b);
}

/* Writes the document parsed from json with the given options. */
static void expect_rewrite(const char *json, bool ensure_ascii, bool pretty, const char *want) {
  kiln_json_doc_t *doc = parse(json);
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  assert_true(kiln_json_write(&b, kiln_json_root(doc), ensure_ascii, pretty));
  expect_written(json, &b, want);
  kiln_strbuf_free(&b);
  kiln_json_doc_free(doc);
}

/* ---- errors ------------------------------------------------------------------------------- */

static void test_syntax_errors(void **state) {
  (void)state;
  expect_error("", 1, 1, "unexpected end of input, expected a value");
  expect_error("   \n  ", 2, 3, "unexpected end of input");
  expect_error("[1,]", 1, 4, "trailing comma before ']'");
  expect_error("{\"a\":1,}", 1, 8, "trailing comma before '}'");
  expect_error("[1,\n  ]", 2, 3, "trailing comma before ']'");
  expect_error("[1 2]", 1, 4, "expected ',' or ']' after an array element, got '2'");
  expect_error("{\"a\":1 \"b\":2}", 1, 8, "expected ',' or '}' after an object member");
  expect_error("{\"a\" 1}", 1, 6, "expected ':' after an object key, got '1'");
  expect_error("{1:2}", 1, 2, "expected a string key in an object, got '1'");
  expect_error("{'a':2}", 1, 2, "expected a string key");
  expect_error("{\"a\":1,,}", 1, 8, "expected a string key");
  expect_error("[,1]", 1, 2, "unexpected ',', expected a value");
  expect_error("[1] x", 1, 5, "unexpected 'x' after the document");
  expect_error("{\"a\":1}}", 1, 8, "unexpected '}' after the document");
  expect_error("1 2", 1, 3, "after the document");
  expect_error("[1]\n// c", 2, 1, "unexpected '/' after the document");
  expect_error("/* c */ 1", 1, 1, "unexpected '/', expected a value");
  expect_error("[1,2", 1, 5, "expected ',' or ']' after an array element, got end of input");
  expect_error("{\"a\":", 1, 6, "unexpected end of input, expected a value");
  expect_error("{\"a\"", 1, 5, "expected ':' after an object key, got end of input");
  expect_error("{", 1, 2, "expected a string key in an object, got end of input");
  expect_error("[", 1, 2, "unexpected end of input");
  expect_error("]", 1, 1, "unexpected ']', expected a value");
  expect_error("\xC3\xA9", 1, 1, "unexpected byte 0xC3, expected a value");
  expect_error_n("[\0]", 3, 1, 2, "unexpected byte 0x00");
  expect_error("{\n  \"a\": [1,\n    2,,]\n}", 3, 7, "unexpected ',', expected a value");
  expect_error("\r\n\r\n  x", 3, 3, "unexpected 'x'");
}

static void test_literal_errors(void **state) {
  (void)state;
  expect_error("tru", 1, 1, "invalid literal (expected true)");
  expect_error("[nulL]", 1, 2, "invalid literal (expected null)");
  expect_error("fals", 1, 1, "invalid literal (expected false)");
  expect_error("True", 1, 1, "unexpected 'T'");
  expect_error("truex", 1, 5, "unexpected 'x' after the document");
  expect_error("NaN", 1, 1, "NaN and Infinity are not valid JSON");
  expect_error("[Infinity]", 1, 2, "NaN and Infinity are not valid JSON");
  expect_error("[-Infinity]", 1, 3, "expected a digit after '-', got 'I'");
}

static void test_number_errors(void **state) {
  (void)state;
  expect_error("01", 1, 1, "leading zeros are not allowed");
  expect_error("[-01]", 1, 3, "leading zeros are not allowed");
  expect_error("00", 1, 1, "leading zeros");
  expect_error("1.", 1, 3, "expected a digit after the decimal point, got end of input");
  expect_error("1.e5", 1, 3, "expected a digit after the decimal point, got 'e'");
  expect_error("1e", 1, 3, "expected a digit in the exponent");
  expect_error("1e+", 1, 4, "expected a digit in the exponent");
  expect_error("-", 1, 2, "expected a digit after '-', got end of input");
  expect_error("- 1", 1, 2, "expected a digit after '-'");
  expect_error(".5", 1, 1, "unexpected '.'");
  expect_error("+1", 1, 1, "unexpected '+'");
  expect_error("0x10", 1, 2, "unexpected 'x' after the document");
  expect_error("1e400", 1, 1, "number out of range");
  expect_error("[0, -1e400]", 1, 5, "number out of range");
  expect_error(
      "1"
      "000000000000000000000000000000000000000000000000000000000000000000000000"
      "000000000000000000000000000000000000000000000000000000000000000000000000"
      "000000000000000000000000000000000000000000000000000000000000000000000000"
      "000000000000000000000000000000000000000000000000000000000000000000000000"
      "000000000000000000000000000000000000000000000000000000000000000000000000",
      1, 1, "number out of range");
}

static void test_string_errors(void **state) {
  (void)state;
  expect_error("\"abc", 1, 1, "unterminated string");
  expect_error("[1, \"abc\\\"]", 1, 5, "unterminated string");
  expect_error("\"\\", 1, 1, "unterminated string");
  expect_error("\"\\n", 1, 1, "unterminated string");
  expect_error("\"a\tb\"", 1, 3, "control character U+0009 must be escaped");
  expect_error("\"a\nb\"", 1, 3, "control character U+000A");
  expect_error_n("\"\0\"", 3, 1, 2, "control character U+0000");
  expect_error("\"\\n\x1f\"", 1, 4, "control character U+001F"); /* after an escape */
  expect_error("\"\\x\"", 1, 2, "invalid escape: '\\' followed by 'x'");
  expect_error("\"\\U0041\"", 1, 2, "invalid escape: '\\' followed by 'U'");
  expect_error("\"\\'\"", 1, 2, "invalid escape");
  expect_error("\"\\u12G4\"", 1, 2, "invalid \\u escape: expected 4 hex digits");
  expect_error("\"\\u12\"", 1, 2, "invalid \\u escape");
  expect_error("\"\\u", 1, 2, "invalid \\u escape");
  expect_error("\"\\uD800\"", 1, 2, "lone high surrogate \\uD800");
  expect_error("\"ab\\uDBFF\\n\"", 1, 4, "lone high surrogate \\uDBFF");
  expect_error("\"\\uD800\\u0041\"", 1, 2, "lone high surrogate");
  expect_error("\"\\uD800\\uD800\"", 1, 2, "lone high surrogate");
  expect_error("\"\\uD800\\", 1, 2, "lone high surrogate");
  expect_error("\"\\uDC00\"", 1, 2, "lone low surrogate \\uDC00");
  expect_error("\"\\uD83D\\uDE00\\uDE00\"", 1, 14, "lone low surrogate \\uDE00");
  expect_error("{\"k\\q\": 1}", 1, 4, "invalid escape"); /* in a key */
}

static void test_utf8_validation(void **state) {
  (void)state;
  static const struct {
    const char *text;
    int col;
    const char *what;
  } bad[] = {
      {"\"\x80\"", 2, "unexpected continuation byte"},
      {"\"a\xBF\"", 3, "unexpected continuation byte"},
      {"\"\xC0\xAF\"", 2, "overlong"},
      {"\"\xC1\xBF\"", 2, "overlong"},
      {"\"\xE0\x80\xAF\"", 2, "overlong"},
      {"\"\xE0\x9F\xBF\"", 2, "overlong"},
      {"\"\xF0\x80\x80\xAF\"", 2, "overlong"},
      {"\"\xF0\x8F\xBF\xBF\"", 2, "overlong"},
      {"\"\xED\xA0\x80\"", 2, "surrogate"},
      {"\"\xED\xBF\xBF\"", 2, "surrogate"},
      {"\"\xED\xA0\xBD\xED\xB8\x80\"", 2, "surrogate"}, /* CESU-8 of U+1F600 */
      {"\"\xC3\"", 2, "truncated"},
      {"\"\xC3x\"", 2, "truncated"},
      {"\"\xE2\x82\"", 2, "truncated"},
      {"\"\xF0\x9F\x98\"", 2, "truncated"},
      {"\"\xF0\x9F\x98", 2, "truncated"},
      {"\"\xE2", 2, "truncated"},
      {"\"\xF4\x90\x80\x80\"", 2, "above U+10FFFF"},
      {"\"\xF4\xBF\xBF\xBF\"", 2, "above U+10FFFF"},
      {"\"\xF5\x80\x80\x80\"", 2, "0xF5-0xFF"},
      {"\"\xF7\xBF\xBF\xBF\"", 2, "0xF5-0xFF"},
      {"\"\xFE\"", 2, "0xF5-0xFF"},
      {"\"\xFF\"", 2, "0xF5-0xFF"},
      {"\"\\n\xC0\xAF\"", 4, "overlong"}, /* on the escape (slow) path */
      {"\"\\n\xED\xA0\x80\"", 4, "surrogate"},
      {"\"\\n\xF4\x90\x80\x80\"", 4, "above U+10FFFF"},
      {"{\"\xFF\":1}", 3, "0xF5-0xFF"}, /* in a key */
  };
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
    expect_error(bad[i].text, 1, bad[i].col, bad[i].what);

  /* The boundaries that are valid. */
  expect_decoded("\"\xC2\x80\"", "\xC2\x80");                 /* U+0080 */
  expect_decoded("\"\xDF\xBF\"", "\xDF\xBF");                 /* U+07FF */
  expect_decoded("\"\xE0\xA0\x80\"", "\xE0\xA0\x80");         /* U+0800 */
  expect_decoded("\"\xED\x9F\xBF\"", "\xED\x9F\xBF");         /* U+D7FF */
  expect_decoded("\"\xEE\x80\x80\"", "\xEE\x80\x80");         /* U+E000 */
  expect_decoded("\"\xEF\xBF\xBF\"", "\xEF\xBF\xBF");         /* U+FFFF */
  expect_decoded("\"\xF0\x90\x80\x80\"", "\xF0\x90\x80\x80"); /* U+10000 */
  expect_decoded("\"\xF4\x8F\xBF\xBF\"", "\xF4\x8F\xBF\xBF"); /* U+10FFFF */
  expect_decoded("\"\xC4\xA0hello \xE4\xBD\xA0\xE5\xA5\xBD \xF0\x9F\x98\x80\"",
                 "\xC4\xA0hello \xE4\xBD\xA0\xE5\xA5\xBD \xF0\x9F\x98\x80");
  expect_decoded("\"\\n\xF4\x8F\xBF\xBF\"", "\n\xF4\x8F\xBF\xBF");
}

static void test_nesting_limit(void **state) {
  (void)state;
  int max = KILN_JSON_MAX_DEPTH;
  size_t cap = (size_t)max * 8 + 100000 + 16;
  char *text = malloc(cap);
  assert_non_null(text);

  /* Exactly at the limit: arrays. */
  size_t n = 0;
  for (int i = 0; i < max; i++) text[n++] = '[';
  for (int i = 0; i < max; i++) text[n++] = ']';
  kiln_json_doc_t *doc = parse_n(text, n);
  const kiln_json_t *v = kiln_json_root(doc);
  int depth = 0;
  while (kiln_json_is(v, KILN_JSON_ARRAY)) {
    depth++;
    v = kiln_json_at(v, 0);
  }
  assert_int_equal(depth, max);
  kiln_json_doc_free(doc);

  /* One beyond: the error points at the bracket that is one too many. */
  n = 0;
  for (int i = 0; i <= max; i++) text[n++] = '[';
  for (int i = 0; i <= max; i++) text[n++] = ']';
  expect_error_n(text, n, 1, max + 1, "nesting deeper than 512 levels");

  /* At the limit with objects: {"a":{"a":...{}...}}. */
  n = 0;
  for (int i = 0; i < max - 1; i++) {
    memcpy(text + n, "{\"a\":", 5);
    n += 5;
  }
  text[n++] = '{';
  for (int i = 0; i < max; i++) text[n++] = '}';
  doc = parse_n(text, n);
  v = kiln_json_root(doc);
  depth = 0;
  while (kiln_json_is(v, KILN_JSON_OBJECT)) {
    depth++;
    v = kiln_json_get(v, "a");
  }
  assert_int_equal(depth, max);
  kiln_json_doc_free(doc);
  n = 0; /* one more level: {"a": x 512, then the '{' that is too deep */
  for (int i = 0; i < max; i++) {
    memcpy(text + n, "{\"a\":", 5);
    n += 5;
  }
  text[n++] = '{';
  expect_error_n(text, n, 1, max * 5 + 1, "nesting deeper than 512 levels");

  /* Hostile depth: 100000 brackets fail quickly, without touching the C stack. */
  memset(text, '[', 100000);
  expect_error_n(text, 100000, 1, max + 1, "nesting deeper than");
  free(text);
}

/* ---- values ------------------------------------------------------------------------------- */

static void test_scalars_and_accessors(void **state) {
  (void)state;
  kiln_json_doc_t *doc = parse(
      " {\"t\": true, \"f\": false, \"n\": null, \"s\": \"x\", \"i\": 7,"
      " \"a\": [1, \"two\", [3]], \"o\": {\"k\": \"v\"}} ");
  const kiln_json_t *r = kiln_json_root(doc);
  assert_int_equal(kiln_json_type(r), KILN_JSON_OBJECT);
  assert_int_equal(kiln_json_len(r), 7);
  assert_true(kiln_json_bool(kiln_json_get(r, "t")));
  assert_true(kiln_json_is(kiln_json_get(r, "f"), KILN_JSON_BOOL));
  assert_false(kiln_json_bool(kiln_json_get(r, "f")));
  assert_true(kiln_json_is(kiln_json_get(r, "n"), KILN_JSON_NULL));
  assert_non_null(kiln_json_get(r, "n")); /* present null is not absent */
  assert_null(kiln_json_get(r, "missing"));
  assert_null(kiln_json_get(r, "T"));
  assert_null(kiln_json_getn(r, "tt", 2));
  assert_non_null(kiln_json_getn(r, "txyz", 1));
  assert_null(kiln_json_get(r, NULL));
  assert_string_equal(kiln_json_string(kiln_json_get(r, "s"), NULL), "x");
  assert_true(kiln_json_number(kiln_json_get(r, "i")) == 7.0);
  const kiln_json_t *a = kiln_json_get(r, "a");
  assert_int_equal(kiln_json_len(a), 3);
  assert_string_equal(kiln_json_string(kiln_json_at(a, 1), NULL), "two");
  assert_int_equal(kiln_json_len(kiln_json_at(a, 2)), 1);
  assert_null(kiln_json_at(a, 3));
  assert_string_equal(kiln_json_string(kiln_json_get(kiln_json_get(r, "o"), "k"), NULL), "v");

  /* Document order, with keys and values. */
  static const char *keys[] = {"t", "f", "n", "s", "i", "a", "o"};
  for (size_t i = 0; i < 7; i++) {
    size_t len = 0;
    assert_string_equal(kiln_json_key_at(r, i, &len), keys[i]);
    assert_int_equal(len, 1);
    assert_ptr_equal(kiln_json_value_at(r, i), kiln_json_get(r, keys[i]));
  }
  assert_null(kiln_json_key_at(r, 7, NULL));
  assert_null(kiln_json_value_at(r, 7));

  /* Wrong type and NULL read as zero values. */
  const kiln_json_t *s = kiln_json_get(r, "s");
  size_t len = 5;
  int64_t i64 = 5;
  assert_false(kiln_json_bool(s));
  assert_true(kiln_json_number(s) == 0.0);
  assert_false(kiln_json_int64(s, &i64));
  assert_false(kiln_json_number_is_int(s));
  assert_null(kiln_json_string(a, &len));
  assert_int_equal(len, 0);
  assert_int_equal(kiln_json_len(s), 0);
  assert_null(kiln_json_at(r, 0));
  assert_null(kiln_json_get(a, "x"));
  assert_null(kiln_json_key_at(a, 0, NULL));
  assert_null(kiln_json_value_at(a, 0));
  assert_int_equal(kiln_json_type(NULL), KILN_JSON_NULL);
  assert_true(kiln_json_is(NULL, KILN_JSON_NULL));
  assert_false(kiln_json_bool(NULL));
  assert_true(kiln_json_number(NULL) == 0.0);
  assert_false(kiln_json_int64(NULL, &i64));
  assert_null(kiln_json_string(NULL, NULL));
  assert_int_equal(kiln_json_len(NULL), 0);
  assert_null(kiln_json_at(NULL, 0));
  assert_null(kiln_json_get(NULL, "a"));
  assert_null(kiln_json_key_at(NULL, 0, &len));
  assert_null(kiln_json_value_at(NULL, 0));
  assert_null(kiln_json_root(NULL));
  int line = 9, col = 9;
  kiln_json_position(NULL, &line, &col);
  assert_int_equal(line, 0);
  assert_int_equal(col, 0);
  kiln_json_doc_free(NULL);

  assert_string_equal(kiln_json_type_name(KILN_JSON_NULL), "null");
  assert_string_equal(kiln_json_type_name(KILN_JSON_BOOL), "bool");
  assert_string_equal(kiln_json_type_name(KILN_JSON_NUMBER), "number");
  assert_string_equal(kiln_json_type_name(KILN_JSON_STRING), "string");
  assert_string_equal(kiln_json_type_name(KILN_JSON_ARRAY), "array");
  assert_string_equal(kiln_json_type_name(KILN_JSON_OBJECT), "object");
  kiln_json_doc_free(doc);

  /* Scalars at the top level, empty containers, surrounding whitespace, a BOM. */
  doc = parse(" \t\r\n\"top\" \n");
  assert_string_equal(kiln_json_string(kiln_json_root(doc), NULL), "top");
  kiln_json_doc_free(doc);
  doc = parse("\xEF\xBB\xBF[]");
  assert_true(kiln_json_is(kiln_json_root(doc), KILN_JSON_ARRAY));
  assert_int_equal(kiln_json_len(kiln_json_root(doc)), 0);
  kiln_json_doc_free(doc);
  doc = parse("{}");
  assert_int_equal(kiln_json_len(kiln_json_root(doc)), 0);
  assert_null(kiln_json_get(kiln_json_root(doc), ""));
  kiln_json_doc_free(doc);
  doc = parse("null");
  assert_true(kiln_json_is(kiln_json_root(doc), KILN_JSON_NULL));
  assert_non_null(kiln_json_root(doc));
  kiln_json_doc_free(doc);
  /* Not NUL-terminated: only len bytes are read. */
  doc = parse_n("[1,2]xyz", 5);
  assert_int_equal(kiln_json_len(kiln_json_root(doc)), 2);
  kiln_json_doc_free(doc);
}

static void test_positions(void **state) {
  (void)state;
  kiln_json_doc_t *doc = parse("{\n  \"a\": [10,\n    \"x\"],\n\t\"b\": {}\n}");
  const kiln_json_t *r = kiln_json_root(doc);
  int line, col;
  kiln_json_position(r, &line, &col);
  assert_int_equal(line, 1);
  assert_int_equal(col, 1);
  kiln_json_position(kiln_json_get(r, "a"), &line, &col);
  assert_int_equal(line, 2);
  assert_int_equal(col, 8);
  kiln_json_position(kiln_json_at(kiln_json_get(r, "a"), 0), &line, &col);
  assert_int_equal(line, 2);
  assert_int_equal(col, 9);
  kiln_json_position(kiln_json_at(kiln_json_get(r, "a"), 1), &line, &col);
  assert_int_equal(line, 3);
  assert_int_equal(col, 5);
  kiln_json_position(kiln_json_get(r, "b"), &line, &col);
  assert_int_equal(line, 4);
  assert_int_equal(col, 7);
  kiln_json_position(r, NULL, NULL);
  kiln_json_doc_free(doc);
}

static void test_escapes(void **state) {
  (void)state;
  expect_decoded("\"\\\"\\\\\\/\\b\\f\\n\\r\\t\"", "\"\\/\b\f\n\r\t");
  expect_decoded("\"\\u0041\\u00e9\\u00E9\\u20AC\\uffff\"",
                 "A\xC3\xA9\xC3\xA9\xE2\x82\xAC\xEF\xBF\xBF");
  expect_decoded("\"\\uD83D\\uDE00\"", "\xF0\x9F\x98\x80");
  expect_decoded("\"\\ud83d\\ude00x\"", "\xF0\x9F\x98\x80x");
  expect_decoded("\"\\uDBFF\\uDFFF\"", "\xF4\x8F\xBF\xBF"); /* U+10FFFF */
  expect_decoded("\"\\uD800\\uDC00\"", "\xF0\x90\x80\x80"); /* U+10000 */
  expect_decoded_n("\"\\u0000\"", "\0", 1);
  expect_decoded_n("\"a\\u0000b\"", "a\0b", 3);
  expect_decoded_n("\"\\u0000\\u0000\"", "\0\0", 2);
  expect_decoded("\"\"", "");
  expect_decoded("\"plain ascii, no escapes\"", "plain ascii, no escapes");
  expect_decoded("\"mixed \xC3\xA9 and \\n escape \xE2\x82\xAC end\"",
                 "mixed \xC3\xA9 and \n escape \xE2\x82\xAC end");
  expect_decoded("\"\x7f\"", "\x7f"); /* DEL needs no escape */

  /* Keys are decoded too, and looked up by their decoded bytes. */
  kiln_json_doc_t *doc = parse("{\"a\\u0000b\": 1, \"\\u00e9\": 2, \"\": 3}");
  const kiln_json_t *r = kiln_json_root(doc);
  assert_true(kiln_json_number(kiln_json_getn(r, "a\0b", 3)) == 1);
  assert_null(kiln_json_get(r, "a")); /* NUL-terminated lookup stops at the NUL */
  assert_true(kiln_json_number(kiln_json_get(r, "\xC3\xA9")) == 2);
  assert_true(kiln_json_number(kiln_json_get(r, "")) == 3);
  size_t len = 0;
  assert_memory_equal(kiln_json_key_at(r, 0, &len), "a\0b", 4);
  assert_int_equal(len, 3);
  kiln_json_doc_free(doc);
}

static void test_duplicate_keys(void **state) {
  (void)state;
  /* Small object (linear scan) */
  kiln_json_doc_t *doc = parse("{\"a\": 1, \"b\": 2, \"a\": 3}");
  const kiln_json_t *r = kiln_json_root(doc);
  assert_int_equal(kiln_json_len(r), 3);
  assert_true(kiln_json_number(kiln_json_get(r, "a")) == 3);
  assert_string_equal(kiln_json_key_at(r, 0, NULL), "a");
  assert_true(kiln_json_number(kiln_json_value_at(r, 0)) == 1);
  assert_string_equal(kiln_json_key_at(r, 2, NULL), "a");
  assert_true(kiln_json_number(kiln_json_value_at(r, 2)) == 3);
  kiln_json_doc_free(doc);

  /* Big object (hash index): the last of three wins, every other key unaffected. */
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  kiln_strbuf_append_char(&b, '{');
  for (int i = 0; i < 100; i++) kiln_strbuf_printf(&b, "\"k%d\": %d, ", i, i);
  kiln_strbuf_append_str(&b, "\"k5\": 1005, \"k50\": 1050, \"k5\": 2005}");
  assert_true(kiln_strbuf_ok(&b));
  doc = parse(b.data);
  r = kiln_json_root(doc);
  assert_int_equal(kiln_json_len(r), 103);
  assert_true(kiln_json_number(kiln_json_get(r, "k5")) == 2005);
  assert_true(kiln_json_number(kiln_json_get(r, "k50")) == 1050);
  assert_true(kiln_json_number(kiln_json_get(r, "k6")) == 6);
  assert_true(kiln_json_number(kiln_json_value_at(r, 5)) == 5);
  kiln_json_doc_free(doc);
  kiln_strbuf_free(&b);
}

static void test_big_object(void **state) {
  (void)state;
  enum { N = 100000 };
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  kiln_strbuf_append_char(&b, '{');
  for (int i = 0; i < N; i++) kiln_strbuf_printf(&b, "%s\"key%d\":%d", i ? "," : "", i, i);
  kiln_strbuf_append_str(&b, "}");
  assert_true(kiln_strbuf_ok(&b));
  kiln_json_doc_t *doc = parse(b.data);
  const kiln_json_t *r = kiln_json_root(doc);
  assert_int_equal(kiln_json_len(r), N);
  char key[32];
  for (int i = 0; i < N; i++) {
    snprintf(key, sizeof(key), "key%d", i);
    int64_t v = -1;
    assert_true(kiln_json_int64(kiln_json_get(r, key), &v));
    assert_int_equal(v, i);
    assert_string_equal(kiln_json_key_at(r, (size_t)i, NULL), key);
  }
  for (int i = N; i < N + 1000; i++) {
    snprintf(key, sizeof(key), "key%d", i);
    assert_null(kiln_json_get(r, key));
  }
  assert_null(kiln_json_get(r, "key"));
  assert_null(kiln_json_get(r, ""));
  assert_null(kiln_json_getn(r, "key1", 3));
  kiln_json_doc_free(doc);

  /* Objects at and around the index threshold. */
  for (int n = 1; n <= 20; n++) {
    kiln_strbuf_reset(&b);
    kiln_strbuf_append_char(&b, '{');
    for (int i = 0; i < n; i++) kiln_strbuf_printf(&b, "%s\"%c\":%d", i ? "," : "", 'a' + i, i);
    kiln_strbuf_append_char(&b, '}');
    doc = parse(b.data);
    for (int i = 0; i < n; i++) {
      char k[2] = {(char)('a' + i), 0};
      assert_true(kiln_json_number(kiln_json_get(kiln_json_root(doc), k)) == i);
    }
    assert_null(kiln_json_get(kiln_json_root(doc), "z"));
    kiln_json_doc_free(doc);
  }
  kiln_strbuf_free(&b);
}

static void test_big_array(void **state) {
  (void)state;
  enum { N = 150000 };
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  kiln_strbuf_append_char(&b, '[');
  for (int i = 0; i < N; i++) kiln_strbuf_printf(&b, "%s\"t%d u%d\"", i ? "," : "", i, i + 1);
  kiln_strbuf_append_char(&b, ']');
  kiln_json_doc_t *doc = parse(b.data);
  const kiln_json_t *r = kiln_json_root(doc);
  assert_int_equal(kiln_json_len(r), N);
  char want[48];
  for (int i = 0; i < N; i += 997) {
    snprintf(want, sizeof(want), "t%d u%d", i, i + 1);
    assert_string_equal(kiln_json_string(kiln_json_at(r, (size_t)i), NULL), want);
  }
  kiln_json_doc_free(doc);
  kiln_strbuf_free(&b);
}

static void test_numbers(void **state) {
  (void)state;
  assert_true(parse_number("0") == 0.0 && !signbit(parse_number("0")));
  assert_true(parse_number("-0") == 0.0 && signbit(parse_number("-0")));
  assert_true(signbit(parse_number("-0.0")));
  assert_true(parse_number("123") == 123.0);
  assert_true(parse_number("-123") == -123.0);
  assert_true(parse_number("1.5") == 1.5);
  assert_true(parse_number("0.1") == 0.1);
  assert_true(parse_number("1e3") == 1000.0);
  assert_true(parse_number("1E+2") == 100.0);
  assert_true(parse_number("1e-2") == 0.01);
  assert_true(parse_number("2.5E-3") == 2.5e-3);
  assert_true(parse_number("-1.25e2") == -125.0);
  assert_true(parse_number("1.7976931348623157e308") == 1.7976931348623157e308);
  assert_true(parse_number("4.9e-324") == 4.9e-324);
  assert_true(parse_number("1e-400") == 0.0); /* underflow reads as 0 */
  assert_true(parse_number("123456789012345678901234567890") == 1.2345678901234568e29);
  assert_true(parse_number("9007199254740993") == 9007199254740992.0); /* nearest double */
  assert_true(parse_number("18446744073709551615") == 18446744073709551615.0);
  assert_true(parse_number("0.30000000000000004") == 0.1 + 0.2);

  int64_t v = 0;
  assert_true(parse_int64("0", &v) && v == 0);
  assert_true(parse_int64("-0", &v) && v == 0);
  assert_true(parse_int64("42", &v) && v == 42);
  assert_true(parse_int64("1e3", &v) && v == 1000);
  assert_true(parse_int64("1.0", &v) && v == 1);
  assert_true(parse_int64("-2.5e1", &v) && v == -25);
  assert_false(parse_int64("1.5", &v));
  assert_false(parse_int64("1e-1", &v));
  assert_true(parse_int64("9007199254740993", &v) && v == 9007199254740993LL); /* exact */
  assert_true(parse_int64("9223372036854775807", &v) && v == INT64_MAX);
  assert_true(parse_int64("-9223372036854775808", &v) && v == INT64_MIN);
  assert_false(parse_int64("9223372036854775808", &v));  /* 2^63 */
  assert_false(parse_int64("-9223372036854775809", &v)); /* its double is -2^63 exactly */
  assert_false(parse_int64("18446744073709551616", &v));
  assert_false(parse_int64("1e19", &v));
  assert_false(parse_int64("9.223372036854775807e18", &v)); /* the double is 2^63 */
  assert_true(parse_int64("-9.223372036854775808e18", &v) && v == INT64_MIN);
  assert_true(parse_int64("9.2233720368547748e18", &v) && v == 9223372036854774784LL);

  kiln_json_doc_t *doc = parse("[1, -0, 1.0, 1e3, 99999999999999999999, 9223372036854775807]");
  const kiln_json_t *r = kiln_json_root(doc);
  assert_true(kiln_json_number_is_int(kiln_json_at(r, 0)));
  assert_true(kiln_json_number_is_int(kiln_json_at(r, 1)));
  assert_false(kiln_json_number_is_int(kiln_json_at(r, 2)));
  assert_false(kiln_json_number_is_int(kiln_json_at(r, 3)));
  assert_false(kiln_json_number_is_int(kiln_json_at(r, 4)));
  assert_true(kiln_json_number_is_int(kiln_json_at(r, 5)));
  kiln_json_doc_free(doc);
}

/* Numbers read the same whatever LC_NUMERIC says (when a comma-decimal locale is installed). */
static void test_numbers_locale_independent(void **state) {
  (void)state;
  static const char *locales[] = {"de_DE.UTF-8", "de_DE.utf8",  "fr_FR.UTF-8",
                                  "fr_FR.utf8",  "ru_RU.UTF-8", NULL};
  const char *got = NULL;
  for (int i = 0; locales[i] && !got; i++) got = setlocale(LC_NUMERIC, locales[i]);
  if (!got || strcmp(localeconv()->decimal_point, ".") == 0) {
    setlocale(LC_NUMERIC, "C");
    skip();
  }
  assert_true(parse_number("1.5") == 1.5);
  assert_true(parse_number("-2.25e-3") == -2.25e-3);
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  kiln_json_write_double(&b, 0.1);
  expect_written("0.1 under a comma locale", &b, "0.1");
  kiln_json_write_double(&b, 1e-7);
  expect_written("1e-7 under a comma locale", &b, "1e-07");
  kiln_strbuf_free(&b);
  setlocale(LC_NUMERIC, "C");
}

/* ---- writers ------------------------------------------------------------------------------ */

static void test_write_string(void **state) {
  (void)state;
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  /* The same string as Python's json.dumps(s) and json.dumps(s, ensure_ascii=False). */
  const char *s = "a\"b\\c\n\r\t\b\f\x01\x1f\x7f/\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80";
  assert_true(kiln_json_write_string(&b, s, strlen(s), true));
  expect_written("ascii", &b,
                 "\"a\\\"b\\\\c\\n\\r\\t\\b\\f\\u0001\\u001f\\u007f/\\u00e9\\u20ac"
                 "\\ud83d\\ude00\"");
  assert_true(kiln_json_write_string(&b, s, strlen(s), false));
  expect_written("utf8", &b,
                 "\"a\\\"b\\\\c\\n\\r\\t\\b\\f\\u0001\\u001f\x7f/\xC3\xA9\xE2\x82\xAC"
                 "\xF0\x9F\x98\x80\"");
  /* Embedded NUL, empty string, U+10FFFF. */
  assert_true(kiln_json_write_string(&b, "a\0b", 3, true));
  expect_written("nul", &b, "\"a\\u0000b\"");
  assert_true(kiln_json_write_string(&b, "", 0, true));
  expect_written("empty", &b, "\"\"");
  assert_true(kiln_json_write_string(&b, "\xF4\x8F\xBF\xBF", 4, true));
  expect_written("max", &b, "\"\\udbff\\udfff\"");
  /* Invalid UTF-8 becomes U+FFFD, one per bad byte. */
  assert_true(kiln_json_write_string(&b, "x\xFFy\xC3", 4, true));
  expect_written("invalid ascii", &b, "\"x\\ufffdy\\ufffd\"");
  assert_true(kiln_json_write_string(&b, "x\xED\xA0\x80y", 5, false));
  expect_written("invalid utf8", &b, "\"x\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBDy\"");
  kiln_strbuf_free(&b);
}

static void test_write_double_matches_python_repr(void **state) {
  (void)state;
  /* Each row is Python's repr(x) (== json.dumps(x)). */
  static const struct {
    double x;
    const char *repr;
  } rows[] = {
      {0.0, "0.0"},
      {-0.0, "-0.0"},
      {1.0, "1.0"},
      {-1.5, "-1.5"},
      {0.1, "0.1"},
      {0.5, "0.5"},
      {1.0 / 3, "0.3333333333333333"},
      {2.0 / 3, "0.6666666666666666"},
      {0.1 + 0.2, "0.30000000000000004"},
      {100.0, "100.0"},
      {1e15, "1000000000000000.0"},
      {1e16, "1e+16"},
      {1e17, "1e+17"},
      {1e21, "1e+21"},
      {1e22, "1e+22"},
      {1e100, "1e+100"},
      {0.0001, "0.0001"},
      {0.00001, "1e-05"},
      {1e-7, "1e-07"},
      {2.5e-5, "2.5e-05"},
      {0.00012345, "0.00012345"},
      {123456789012345680.0, "1.2345678901234568e+17"},
      {1.5e300, "1.5e+300"},
      {5e-324, "5e-324"}, /* subnormals: fewer digits than DBL_DIG */
      {2.2250738585072014e-308, "2.2250738585072014e-308"},
      {2.225073858507201e-308, "2.225073858507201e-308"},
      {1e-310, "1e-310"},
      {1.23e-320, "1.23e-320"},
      {1.7976931348623157e308, "1.7976931348623157e+308"},
      {9007199254740993.0, "9007199254740992.0"},
      {9999999999999998.0, "9999999999999998.0"},
      {1234.5678, "1234.5678"},
      {123456789.0, "123456789.0"},
      {3.14159, "3.14159"},
      {9223372036854775808.0, "9.223372036854776e+18"},
      {-1e-300, "-1e-300"},
  };
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
    assert_true(kiln_json_write_double(&b, rows[i].x));
    expect_written(rows[i].repr, &b, rows[i].repr);
  }
  assert_true(kiln_json_write_double(&b, INFINITY));
  expect_written("inf", &b, "Infinity");
  assert_true(kiln_json_write_double(&b, -INFINITY));
  expect_written("-inf", &b, "-Infinity");
  assert_true(kiln_json_write_double(&b, NAN));
  expect_written("nan", &b, "NaN");
  kiln_strbuf_free(&b);
}

static void test_write_number(void **state) {
  (void)state;
  static const struct {
    double x;
    const char *text;
  } rows[] = {
      {0.0, "0"},
      {-0.0, "-0"},
      {1.0, "1"},
      {-42.0, "-42"},
      {1e15, "1000000000000000"},
      {9007199254740991.0, "9007199254740991"},
      {-9007199254740991.0, "-9007199254740991"},
      {9007199254740992.0, "9007199254740992.0"}, /* 2^53: no longer printed as an int */
      {1e16, "1e+16"},
      {0.5, "0.5"},
      {1e-7, "1e-07"},
      {1.5e300, "1.5e+300"},
  };
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
    assert_true(kiln_json_write_number(&b, rows[i].x));
    expect_written(rows[i].text, &b, rows[i].text);
  }
  assert_true(kiln_json_write_number(&b, NAN));
  expect_written("nan", &b, "NaN");
  assert_true(kiln_json_write_number(&b, -INFINITY));
  expect_written("-inf", &b, "-Infinity");
  kiln_strbuf_free(&b);
}

static void test_write_tree(void **state) {
  (void)state;
  const char *doc = "{\"a\":1,\"b\":[1,2.0,{}],\"a\":3,\"c\":[]}";
  /* Python: json.dumps(json.loads(doc)) and json.dumps(json.loads(doc), indent=2). */
  expect_rewrite(doc, true, false, "{\"a\": 3, \"b\": [1, 2.0, {}], \"c\": []}");
  expect_rewrite(doc, true, true,
                 "{\n  \"a\": 3,\n  \"b\": [\n    1,\n    2.0,\n    {}\n  ],\n  \"c\": []\n}");
  expect_rewrite(
      "[true,false,null,\"x\",-0,1e3,1E-7,9223372036854775807,-9223372036854775808,"
      "99999999999999999999,0.5]",
      true, false,
      "[true, false, null, \"x\", 0, 1000.0, 1e-07, 9223372036854775807, "
      "-9223372036854775808, 1e+20, 0.5]");
  expect_rewrite("\"\xC3\xA9\\u00e9\"", true, false, "\"\\u00e9\\u00e9\"");
  expect_rewrite("\"\xC3\xA9\\u00e9\"", false, false, "\"\xC3\xA9\xC3\xA9\"");
  expect_rewrite("{}", false, true, "{}");
  expect_rewrite("[]", false, true, "[]");
  expect_rewrite("[[]]", false, true, "[\n  []\n]");
  expect_rewrite("7", false, true, "7");
  /* Duplicates in an indexed object: first position, last value, written once. */
  expect_rewrite(
      "{\"k\":0,\"a\":1,\"b\":2,\"c\":3,\"d\":4,\"e\":5,\"f\":6,\"g\":7,\"h\":8,\"k\":9,"
      "\"k\":10}",
      false, false,
      "{\"k\": 10, \"a\": 1, \"b\": 2, \"c\": 3, \"d\": 4, \"e\": 5, \"f\": 6, "
      "\"g\": 7, \"h\": 8}");
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  assert_true(kiln_json_write(&b, NULL, false, false));
  expect_written("NULL", &b, "null");
  kiln_strbuf_free(&b);
}

/* parse -> write -> parse -> write gives the same text, in every writer mode. */
static void test_round_trip(void **state) {
  (void)state;
  const char *docs[] = {
      "{\"model\": {\"vocab\": {\"a\": 0, \"\\u0120b\": 1, \"\\\"\": 2}, \"merges\": [\"a b\", "
      "[\"c\", \"d\"]]}, \"f\": [0.1, 1e-07, 1.5e+300, -0.0, 123.0], \"n\": null, \"t\": true}",
      "[\"\\u0000\\u001f\\u007f\\ud83d\\ude00\\\\\\/\", \"\xF4\x8F\xBF\xBF\", "
      "18446744073709551615]",
      "[[[[[]]]], {}, {\"\": {\"\": []}}]",
  };
  for (size_t d = 0; d < sizeof(docs) / sizeof(docs[0]); d++) {
    for (int mode = 0; mode < 4; mode++) {
      bool ascii = mode & 1, pretty = mode & 2;
      kiln_strbuf_t a = KILN_STRBUF_INIT, b = KILN_STRBUF_INIT;
      kiln_json_doc_t *d1 = parse(docs[d]);
      assert_true(kiln_json_write(&a, kiln_json_root(d1), ascii, pretty));
      kiln_json_doc_t *d2 = parse_n(a.data, a.len);
      assert_true(kiln_json_write(&b, kiln_json_root(d2), ascii, pretty));
      assert_int_equal(a.len, b.len);
      assert_memory_equal(a.data, b.data, a.len);
      kiln_json_doc_free(d1);
      kiln_json_doc_free(d2);
      kiln_strbuf_free(&a);
      kiln_strbuf_free(&b);
    }
  }
}

/* ---- files -------------------------------------------------------------------------------- */

static void test_parse_file(void **state) {
  (void)state;
  kiln_json_doc_t *doc = (kiln_json_doc_t *)(uintptr_t)1;
  kiln_status_t st = kiln_json_parse_file("/nonexistent/dir/tokenizer.json", &doc);
  assert_null(doc);
  assert_int_equal(kiln_status_code(st), KILN_ERR_NOT_FOUND);
  assert_non_null(strstr(kiln_status_message(st), "/nonexistent/dir/tokenizer.json: "));
  kiln_status_free(st);

  st = kiln_json_parse_file("/", &doc); /* a directory: fopen may work, reading does not */
  assert_null(doc);
  assert_int_not_equal(kiln_status_code(st), KILN_OK);
  kiln_status_free(st);

  char path[] = "/tmp/kiln_test_json_XXXXXX";
  int fd = mkstemp(path);
  assert_true(fd >= 0);
  FILE *f = fdopen(fd, "w");
  assert_non_null(f);
  fputs("{\"a\": [1,\n 2,]}", f);
  fclose(f);
  st = kiln_json_parse_file(path, &doc);
  assert_null(doc);
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  char want[128];
  snprintf(want, sizeof(want), "%s: line 2, column 4: trailing comma before ']'", path);
  assert_string_equal(kiln_status_message(st), want);
  kiln_status_free(st);

  f = fopen(path, "w");
  assert_non_null(f);
  fputs("{\"a\": [1, 2]}", f);
  fclose(f);
  assert_null(kiln_json_parse_file(path, &doc));
  assert_int_equal(kiln_json_len(kiln_json_get(kiln_json_root(doc), "a")), 2);
  kiln_json_doc_free(doc);
  remove(path);
}

/* Finds tokenizer.json files: $KILN_TOKENIZER_CACHE may name one, or a directory holding them
 * (searched a few levels deep). */
static void find_tokenizers(const char *path, int depth, char (*found)[1024], int *n, int max) {
  struct stat sb;
  if (*n >= max || stat(path, &sb) != 0) return;
  if (S_ISREG(sb.st_mode)) {
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    if (depth == 0 || strcmp(base, "tokenizer.json") == 0)
      snprintf(found[(*n)++], 1024, "%s", path);
    return;
  }
  if (!S_ISDIR(sb.st_mode) || depth > 4) return;
  DIR *dir = opendir(path);
  if (!dir) return;
  struct dirent *e;
  while ((e = readdir(dir)) && *n < max) {
    if (e->d_name[0] == '.') continue;
    char sub[1024];
    if (snprintf(sub, sizeof(sub), "%s/%s", path, e->d_name) >= (int)sizeof(sub)) continue;
    find_tokenizers(sub, depth + 1, found, n, max);
  }
  closedir(dir);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void test_real_tokenizer(void **state) {
  (void)state;
  const char *cache = getenv("KILN_TOKENIZER_CACHE");
  static char found[8][1024];
  int n = 0;
  if (cache && *cache) find_tokenizers(cache, 0, found, &n, 8);
  if (n == 0) skip();
  for (int t = 0; t < n; t++) {
    kiln_json_doc_t *doc = NULL;
    double t0 = now_s();
    kiln_status_t st = kiln_json_parse_file(found[t], &doc);
    double secs = now_s() - t0;
    if (st) fail_msg("%s", kiln_status_message(st));
    const kiln_json_t *model = kiln_json_get(kiln_json_root(doc), "model");
    const kiln_json_t *vocab = kiln_json_get(model, "vocab");
    const kiln_json_t *merges = kiln_json_get(model, "merges");
    size_t nv = kiln_json_len(vocab);
    print_message("%s: %zu vocab, %zu merges, parsed in %.1f ms\n", found[t], nv,
                  kiln_json_len(merges), secs * 1e3);
    if (kiln_json_is(vocab, KILN_JSON_OBJECT)) {
      assert_true(nv > 1000);
      /* Every vocabulary entry is found by its key and has an integer id. */
      for (size_t i = 0; i < nv; i++) {
        size_t klen;
        const char *k = kiln_json_key_at(vocab, i, &klen);
        int64_t id;
        assert_ptr_equal(kiln_json_getn(vocab, k, klen), kiln_json_value_at(vocab, i));
        assert_true(kiln_json_int64(kiln_json_value_at(vocab, i), &id));
      }
    }
    for (size_t i = 0; i < kiln_json_len(merges); i++) {
      const kiln_json_t *m = kiln_json_at(merges, i);
      assert_true(kiln_json_is(m, KILN_JSON_STRING) ||
                  (kiln_json_is(m, KILN_JSON_ARRAY) && kiln_json_len(m) == 2));
    }
    /* The whole file survives write -> parse -> write unchanged. */
    kiln_strbuf_t a = KILN_STRBUF_INIT, b = KILN_STRBUF_INIT;
    assert_true(kiln_json_write(&a, kiln_json_root(doc), false, false));
    kiln_json_doc_t *again = parse_n(a.data, a.len);
    assert_true(kiln_json_write(&b, kiln_json_root(again), false, false));
    assert_int_equal(a.len, b.len);
    assert_memory_equal(a.data, b.data, a.len);
    kiln_json_doc_free(again);
    kiln_json_doc_free(doc);
    kiln_strbuf_free(&a);
    kiln_strbuf_free(&b);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_syntax_errors),
      cmocka_unit_test(test_literal_errors),
      cmocka_unit_test(test_number_errors),
      cmocka_unit_test(test_string_errors),
      cmocka_unit_test(test_utf8_validation),
      cmocka_unit_test(test_nesting_limit),
      cmocka_unit_test(test_scalars_and_accessors),
      cmocka_unit_test(test_positions),
      cmocka_unit_test(test_escapes),
      cmocka_unit_test(test_duplicate_keys),
      cmocka_unit_test(test_big_object),
      cmocka_unit_test(test_big_array),
      cmocka_unit_test(test_numbers),
      cmocka_unit_test(test_numbers_locale_independent),
      cmocka_unit_test(test_write_string),
      cmocka_unit_test(test_write_double_matches_python_repr),
      cmocka_unit_test(test_write_number),
      cmocka_unit_test(test_write_tree),
      cmocka_unit_test(test_round_trip),
      cmocka_unit_test(test_parse_file),
      cmocka_unit_test(test_real_tokenizer),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
