/* test_tool_parse.c - cmocka tests for models/template/tool_parse: the tool-call formats
 * (hermes, llama3_json, mistral, json) on hand-written model replies, well-formed and not; the
 * stream parser fed every reply split at every byte position, byte by byte and at random, which
 * must give exactly the whole-text parse; random replies built from the formats' pieces (no crash,
 * stream == whole, content a subsequence of the reply, no calls = the reply unchanged); format
 * detection from template sources (inline, and the real Qwen3 / Mistral Nemo / Llama 3 /
 * DeepSeek V3 templates when $KILN_TOKENIZER_CACHE has them); kiln_template_uses_variable.
 *
 * KILN_TEST_SEED sets the random tests' seed (default: the time; printed to reproduce). */
#define _POSIX_C_SOURCE 200809L
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/json.h"
#include "base/strbuf.h"
#include "models/template/template.h"
#include "models/template/tool_parse.h"

typedef kiln_tool_format_t fmt_t;
#define HERMES KILN_TOOL_FORMAT_HERMES
#define LLAMA KILN_TOOL_FORMAT_LLAMA3_JSON
#define MISTRAL KILN_TOOL_FORMAT_MISTRAL
#define JSONF KILN_TOOL_FORMAT_JSON

/* The parse of a whole reply. */
typedef struct result {
  kiln_strbuf_t content;
  kiln_tool_calls_t calls;
} result_t;

static void result_free(result_t *r) {
  kiln_strbuf_free(&r->content);
  kiln_tool_calls_free(&r->calls);
}

static result_t parse_whole(fmt_t f, const char *text, size_t len) {
  result_t r = {KILN_STRBUF_INIT, {0}};
  kiln_status_t st = kiln_tool_parse(f, text, len, &r.content, &r.calls);
  if (st) fail_msg("kiln_tool_parse: %s", kiln_status_message(st));
  return r;
}

/* Feeds the reply in pieces ending at cuts[0..ncuts) (increasing), then the rest. */
static result_t parse_pieces(fmt_t f, const char *text, size_t len, const size_t *cuts,
                             size_t ncuts) {
  result_t r = {KILN_STRBUF_INIT, {0}};
  kiln_tool_stream_t *s = NULL;
  assert_null(kiln_tool_stream_create(f, &s));
  size_t at = 0;
  for (size_t i = 0; i <= ncuts; i++) {
    size_t end = i < ncuts ? cuts[i] : len;
    assert_null(kiln_tool_stream_push(s, text + at, end - at, &r.content, &r.calls));
    at = end;
  }
  assert_null(kiln_tool_stream_finish(s, &r.content, &r.calls));
  assert_int_equal(kiln_tool_stream_num_calls(s), r.calls.n);
  kiln_tool_stream_free(s);
  return r;
}

static bool same(const result_t *a, const result_t *b) {
  if (a->content.len != b->content.len ||
      memcmp(kiln_strbuf_cstr(&a->content), kiln_strbuf_cstr(&b->content), a->content.len) ||
      a->calls.n != b->calls.n)
    return false;
  for (int32_t i = 0; i < a->calls.n; i++)
    if (strcmp(a->calls.v[i].name, b->calls.v[i].name) ||
        strcmp(a->calls.v[i].arguments, b->calls.v[i].arguments))
      return false;
  return true;
}

static void show(const char *what, const result_t *r) {
  print_message("  %s: content \"%s\", %d calls\n", what, kiln_strbuf_cstr(&r->content),
                r->calls.n);
  for (int32_t i = 0; i < r->calls.n; i++)
    print_message("    %s(%s)\n", r->calls.v[i].name, r->calls.v[i].arguments);
}

/* The stream, split at every position, byte by byte and at a few random cuts, gives the whole
 * parse. */
static void check_splits(fmt_t f, const char *text, size_t len, const result_t *want) {
  for (size_t cut = 0; cut <= len; cut++) {
    result_t r = parse_pieces(f, text, len, &cut, 1);
    if (!same(&r, want)) {
      show("whole", want);
      show("split", &r);
      fail_msg("%s: split at byte %zu of \"%s\" differs", kiln_tool_format_name(f), cut, text);
    }
    result_free(&r);
  }
  size_t *cuts = malloc((len + 1) * sizeof(*cuts));
  assert_non_null(cuts);
  for (size_t i = 0; i < len; i++) cuts[i] = i + 1;
  result_t r = parse_pieces(f, text, len, cuts, len);
  if (!same(&r, want)) {
    show("whole", want);
    show("bytewise", &r);
    fail_msg("%s: byte by byte, \"%s\" differs", kiln_tool_format_name(f), text);
  }
  result_free(&r);
  for (int trial = 0; trial < 8 && len > 2; trial++) {
    size_t n = 0;
    for (size_t i = 1; i < len; i++)
      if (rand() % 4 == 0) cuts[n++] = i;
    r = parse_pieces(f, text, len, cuts, n);
    if (!same(&r, want))
      fail_msg("%s: random split of \"%s\" differs", kiln_tool_format_name(f), text);
    result_free(&r);
  }
  free(cuts);
}

/* One case: the expected content and calls ("name", "arguments" pairs, NULL-terminated). */
static void expect(fmt_t f, const char *text, const char *content, ...) {
  result_t r = parse_whole(f, text, strlen(text));
  va_list ap;
  va_start(ap, content);
  int32_t n = 0;
  bool ok = !strcmp(kiln_strbuf_cstr(&r.content), content);
  for (const char *name; (name = va_arg(ap, const char *)) != NULL; n++) {
    const char *args = va_arg(ap, const char *);
    if (n >= r.calls.n || strcmp(r.calls.v[n].name, name) || strcmp(r.calls.v[n].arguments, args))
      ok = false;
  }
  va_end(ap);
  if (n != r.calls.n) ok = false;
  if (!ok) {
    show("got", &r);
    fail_msg("%s: \"%s\": want content \"%s\" and %d calls", kiln_tool_format_name(f), text,
             content, n);
  }
  check_splits(f, text, strlen(text), &r);
  result_free(&r);
}

static void test_hermes(void **state) {
  (void)state;
  const char *call =
      "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
      "\"Paris\"}}\n</tool_call>";
  expect(HERMES, "The weather is fine.", "The weather is fine.", NULL);
  expect(HERMES, "", "", NULL);
  expect(HERMES, "  \n", "  \n", NULL);
  expect(HERMES, call, "", "get_weather", "{\"city\": \"Paris\"}", NULL);
  /* whitespace next to calls is dropped, text around them kept */
  char buf[1024];
  snprintf(buf, sizeof buf, "\n\nLet me check.\n%s\n", call);
  expect(HERMES, buf, "\n\nLet me check.", "get_weather", "{\"city\": \"Paris\"}", NULL);
  snprintf(buf, sizeof buf, "%s\n\n%s", call, call);
  expect(HERMES, buf, "", "get_weather", "{\"city\": \"Paris\"}", "get_weather",
         "{\"city\": \"Paris\"}", NULL);
  snprintf(buf, sizeof buf, "A %s B\n%s C ", call, call);
  expect(HERMES, buf, "ABC ", "get_weather", "{\"city\": \"Paris\"}", "get_weather",
         "{\"city\": \"Paris\"}", NULL);
  /* the arguments: re-serialised; a string holding an object; "parameters"; absent; null */
  expect(HERMES,
         "<tool_call>{\"name\":\"f\",\"arguments\":{\"a\":[1,2.50,{\"b\":null}],\"c\":\"\\u00e9\"}}"
         "</tool_call>",
         "", "f", "{\"a\": [1, 2.5, {\"b\": null}], \"c\": \"\xc3\xa9\"}", NULL);
  expect(HERMES, "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>", "",
         "f", "{\"a\": 1}", NULL);
  expect(HERMES, "<tool_call>{\"name\": \"f\", \"parameters\": {\"a\": 1}}</tool_call>", "", "f",
         "{\"a\": 1}", NULL);
  expect(HERMES, "<tool_call>{\"name\": \"now\"}</tool_call>", "", "now", "{}", NULL);
  expect(HERMES, "<tool_call>{\"name\": \"now\", \"arguments\": null}</tool_call>", "", "now", "{}",
         NULL);
  /* braces and tags inside strings */
  expect(
      HERMES,
      "<tool_call>{\"name\": \"echo\", \"arguments\": {\"s\": \"}{\\\"<tool_call>\"}}</tool_call>",
      "", "echo", "{\"s\": \"}{\\\"<tool_call>\"}", NULL);
  /* cut short before </tool_call>: a complete object still is a call, a partial one is text */
  expect(HERMES, "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n", "", "f", "{}", NULL);
  expect(HERMES, "Hi <tool_call>\n{\"name\": \"f\", \"argu",
         "Hi <tool_call>\n{\"name\": \"f\", \"argu", NULL);
  /* malformed calls stay content, byte for byte */
  const char *bad[] = {
      "<tool_call>{\"name\": \"f\", \"arguments\": {}</tool_call>",         /* bad JSON */
      "<tool_call>{\"arguments\": {}}</tool_call>",                         /* no name */
      "<tool_call>{\"name\": \"\", \"arguments\": {}}</tool_call>",         /* empty name */
      "<tool_call>{\"name\": 3, \"arguments\": {}}</tool_call>",            /* name not a string */
      "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>",       /* not an object */
      "<tool_call>{\"name\": \"f\", \"arguments\": \"{oops\"}</tool_call>", /* bad string */
      "<tool_call>{\"name\": \"f\\u0000\", \"arguments\": {}}</tool_call>", /* NUL in the name */
      "<tool_call>[{\"name\": \"f\"}]</tool_call>",                         /* a list */
      "<tool_call></tool_call>",
      "<tool_call>",
      "Use the <tool_call> tag, then </tool_call>.",
      "a <tool_ca",
      "a <toolbox> b",
      "</tool_call> x",
  };
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) expect(HERMES, bad[i], bad[i], NULL);
  /* a malformed call then a good one */
  snprintf(buf, sizeof buf, "<tool_call>{bad}</tool_call>\n%s", call);
  expect(HERMES, buf, "<tool_call>{bad}</tool_call>", "get_weather", "{\"city\": \"Paris\"}", NULL);
  /* non-ASCII content around a call */
  snprintf(buf, sizeof buf, "\xe4\xbd\xa0\xe5\xa5\xbd %s \xf0\x9f\x98\x80", call);
  expect(HERMES, buf, "\xe4\xbd\xa0\xe5\xa5\xbd\xf0\x9f\x98\x80", "get_weather",
         "{\"city\": \"Paris\"}", NULL);
}

static void test_llama3(void **state) {
  (void)state;
  expect(LLAMA, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}", "",
         "get_weather", "{\"city\": \"Paris\"}", NULL);
  expect(LLAMA, "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"x\": 1}}<|eom_id|>",
         "<|eom_id|>", "f", "{\"x\": 1}", NULL);
  expect(LLAMA, " \n<|python_tag|> {\"name\": \"f\", \"arguments\": {}}", "", "f", "{}", NULL);
  expect(LLAMA,
         "{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"y\": 2}}", "",
         "a", "{}", "b", "{\"y\": 2}", NULL);
  expect(LLAMA, "{\"name\": \"a\", \"parameters\": {}}\n{\"name\": \"b\", \"parameters\": {}};", "",
         "a", "{}", "b", "{}", NULL);
  expect(LLAMA, "{\"name\": \"f\", \"parameters\": {\"s\": \"}\\\"{\"}} and then some",
         "and then some", "f", "{\"s\": \"}\\\"{\"}", NULL);
  /* not a call: JSON that is no call, text first, a broken object, python code */
  const char *plain[] = {
      "{\"answer\": 42}",
      "Sure: {\"name\": \"f\", \"parameters\": {}}",
      "{\"name\": \"f\", \"parameters\": {\"x\"",
      "{\"name\": \"f\", \"parameters\": 5}",
      "<|python_tag|>brave_search.call(query=\"x\")",
      "<|python_ta",
      "[{\"name\": \"f\", \"parameters\": {}}]",
      "  plain text",
      "",
      "\n\n",
  };
  for (size_t i = 0; i < sizeof plain / sizeof *plain; i++) expect(LLAMA, plain[i], plain[i], NULL);
  /* a good call, then a bad one: the call and the rest as text */
  expect(LLAMA, "{\"name\": \"a\", \"parameters\": {}}; {\"name\": 1}", "{\"name\": 1}", "a", "{}",
         NULL);
}

static void test_mistral(void **state) {
  (void)state;
  expect(MISTRAL,
         "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]", "",
         "get_weather", "{\"city\": \"Paris\"}", NULL);
  expect(MISTRAL,
         "Checking.[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}}, {\"name\": \"g\", "
         "\"arguments\": {\"b\": \"x]\"}}]",
         "Checking.", "f", "{}", "g", "{\"b\": \"x]\"}", NULL);
  expect(MISTRAL, "[TOOL_CALLS]{\"name\": \"f\", \"arguments\": {\"a\": 1}}", "", "f", "{\"a\": 1}",
         NULL);
  /* the newer name[ARGS]{...} form, one marker per call */
  expect(MISTRAL, "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}", "", "get_weather",
         "{\"city\": \"Paris\"}", NULL);
  expect(MISTRAL, "[TOOL_CALLS]a.b-c_1[ARGS] {\"x\":1}[TOOL_CALLS]b[ARGS]{} done", "done",
         "a.b-c_1", "{\"x\": 1}", "b", "{}", NULL);
  const char *bad[] = {
      "[TOOL_CALLS] nonsense here",
      "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}}, 3]", /* all or nothing */
      "[TOOL_CALLS][]",
      "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}}",
      "[TOOL_CALLS]f[ARG",
      "[TOOL_CALLS]f[ARGS]",
      "[TOOL_CALLS]f[ARGS][1]",
      "[TOOL_CALLS]f(x)",
      "[TOOL_CALLS]",
      "[TOOL_CALL",
      "[TOOL_CALLS]f[ARGS]{\"a\": }",
  };
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) expect(MISTRAL, bad[i], bad[i], NULL);
  expect(MISTRAL, "<tool_call>{\"name\": \"f\"}</tool_call>",
         "<tool_call>{\"name\": \"f\"}</tool_call>", NULL);
}

static void test_json(void **state) {
  (void)state;
  expect(JSONF, "[{\"name\": \"f\", \"parameters\": {\"a\": 1}}]", "", "f", "{\"a\": 1}", NULL);
  expect(JSONF,
         " [{\"name\":\"f\",\"parameters\":{}} , {\"name\":\"g\",\"parameters\":{\"x\":[1,2]}}] \n",
         "", "f", "{}", "g", "{\"x\": [1, 2]}", NULL);
  expect(JSONF, "{\"name\": \"f\", \"parameters\": {}}", "", "f", "{}", NULL);
  expect(JSONF, "not json", "not json", NULL);
  expect(JSONF, "[{\"name\": \"f\", \"parameters\": {\"a\": ",
         "[{\"name\": \"f\", \"parameters\": {\"a\": ", NULL);
}

/* Content goes out as soon as it is known: only a possible marker and the whitespace before it
 * are held. */
#define PUSH(lit) kiln_tool_stream_push(s, lit, sizeof(lit) - 1, &c, &calls)
static void test_stream_holds_little(void **state) {
  (void)state;
  kiln_tool_stream_t *s = NULL;
  kiln_strbuf_t c = KILN_STRBUF_INIT;
  kiln_tool_calls_t calls = {0};
  assert_null(kiln_tool_stream_create(HERMES, &s));
  assert_null(PUSH("Hello wor"));
  assert_string_equal(kiln_strbuf_cstr(&c), "Hello wor");
  assert_null(PUSH("ld \n<to"));
  assert_string_equal(kiln_strbuf_cstr(&c), "Hello world");
  assert_null(PUSH("ol_call>{\"name\": \"f\"}"));
  assert_int_equal(calls.n, 0);
  assert_null(PUSH("</tool_call>"));
  assert_int_equal(calls.n, 1); /* out as soon as it closes */
  assert_string_equal(calls.v[0].name, "f");
  assert_null(PUSH("\n"));
  assert_null(kiln_tool_stream_finish(s, &c, &calls));
  assert_string_equal(kiln_strbuf_cstr(&c), "Hello world");
  /* finished: pushes are ignored */
  assert_null(PUSH("more"));
  assert_string_equal(kiln_strbuf_cstr(&c), "Hello world");
  kiln_tool_stream_free(s);
  kiln_strbuf_free(&c);
  kiln_tool_calls_free(&calls);
  /* llama3_json: text that cannot start a call goes out at once */
  assert_null(kiln_tool_stream_create(LLAMA, &s));
  assert_null(PUSH("Paris is"));
  assert_string_equal(kiln_strbuf_cstr(&c), "Paris is");
  kiln_tool_stream_free(s);
  kiln_strbuf_free(&c);
  kiln_status_t st = kiln_tool_stream_create(KILN_TOOL_FORMAT_NONE, &s);
  assert_non_null(st);
  assert_null(s);
  kiln_status_free(st);
}

/* Random replies from the formats' pieces: no crash, the stream equals the whole parse, content
 * is a subsequence of the reply, and without calls it is the reply itself. */
static void test_random(void **state) {
  (void)state;
  static const char *const pieces[] = {
      "<tool_call>",
      "</tool_call>",
      "[TOOL_CALLS]",
      "[ARGS]",
      "<|python_tag|>",
      "{",
      "}",
      "[",
      "]",
      "\"name\"",
      "\"arguments\"",
      "\"parameters\"",
      ":",
      ",",
      ";",
      "\"f\"",
      "\"x\"",
      "1",
      " ",
      "\n",
      "\\",
      "\"",
      "null",
      "ab",
      "\xc3\xa9",
      "<",
      "<tool",
      "[TOOL",
  };
  const size_t np = sizeof pieces / sizeof *pieces;
  const char *seed_env = getenv("KILN_TEST_SEED");
  unsigned seed = seed_env ? (unsigned)strtoul(seed_env, NULL, 10) : (unsigned)time(NULL);
  print_message("  random replies: KILN_TEST_SEED=%u\n", seed);
  srand(seed);
  /* and some well-formed ones, so that calls do occur */
  static const char *const calls[] = {
      "<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": 1}}</tool_call>",
      "{\"name\": \"f\", \"parameters\": {}}",
      "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}}]",
      "[TOOL_CALLS]f[ARGS]{\"x\": \"]\"}",
      "[{\"name\": \"f\", \"parameters\": {}}]",
  };
  int with_calls = 0;
  for (int trial = 0; trial < 1500; trial++) {
    kiln_strbuf_t t = KILN_STRBUF_INIT;
    int n = rand() % 14;
    for (int i = 0; i < n; i++) {
      if (rand() % 5 == 0)
        kiln_strbuf_append_str(&t, calls[rand() % (sizeof calls / sizeof *calls)]);
      else
        kiln_strbuf_append_str(&t, pieces[rand() % np]);
    }
    fmt_t f = (fmt_t)(1 + rand() % 4);
    result_t r = parse_whole(f, t.data ? t.data : "", t.len);
    with_calls += r.calls.n > 0;
    /* content is a subsequence of the reply */
    size_t j = 0;
    for (size_t i = 0; i < t.len && j < r.content.len; i++)
      if (t.data[i] == r.content.data[j]) j++;
    if (j != r.content.len)
      fail_msg("%s: content is not a subsequence of \"%s\"", kiln_tool_format_name(f), t.data);
    if (!r.calls.n && (r.content.len != t.len || (t.len && memcmp(r.content.data, t.data, t.len))))
      fail_msg("%s: no calls, but the content is not the reply: \"%s\"", kiln_tool_format_name(f),
               t.data);
    for (int32_t i = 0; i < r.calls.n; i++) { /* arguments are JSON objects */
      kiln_json_doc_t *doc = NULL;
      assert_null(
          kiln_json_parse(r.calls.v[i].arguments, strlen(r.calls.v[i].arguments), "a", &doc));
      assert_true(kiln_json_is(kiln_json_root(doc), KILN_JSON_OBJECT));
      kiln_json_doc_free(doc);
    }
    /* two random splits and byte by byte */
    size_t *cuts = malloc((t.len + 1) * sizeof(*cuts));
    assert_non_null(cuts);
    for (int k = 0; k < 2; k++) {
      size_t nc = 0;
      for (size_t i = 1; i < t.len; i++)
        if (rand() % 3 == 0) cuts[nc++] = i;
      result_t q = parse_pieces(f, t.data ? t.data : "", t.len, cuts, nc);
      if (!same(&q, &r)) {
        show("whole", &r);
        show("split", &q);
        fail_msg("%s: a split of \"%s\" differs (KILN_TEST_SEED=%u)", kiln_tool_format_name(f),
                 t.data, seed);
      }
      result_free(&q);
    }
    result_free(&r);
    free(cuts);
    kiln_strbuf_free(&t);
  }
  print_message("  %d of 1500 random replies had calls\n", with_calls);
  assert_true(with_calls > 100);
}

static void test_names(void **state) {
  (void)state;
  kiln_tool_format_t f;
  for (int i = KILN_TOOL_FORMAT_NONE; i <= KILN_TOOL_FORMAT_JSON; i++) {
    assert_true(kiln_tool_format_from_name(kiln_tool_format_name((fmt_t)i), &f));
    assert_int_equal(f, i);
  }
  assert_false(kiln_tool_format_from_name("hermes2", &f));
  assert_false(kiln_tool_format_from_name(NULL, &f));
  assert_true(kiln_tool_format_marker_is_special(MISTRAL));
  assert_false(kiln_tool_format_marker_is_special(HERMES));
  /* the helpers the server uses */
  kiln_tool_calls_t calls = {0};
  bool oom = false;
  assert_true(kiln_tool_call_from_json("{\"name\": \"f\", \"arguments\": \"{}\"}",
                                       strlen("{\"name\": \"f\", \"arguments\": \"{}\"}"), &calls,
                                       &oom));
  assert_false(
      kiln_tool_call_from_json("{\"name\": \"f\"", sizeof("{\"name\": \"f\"") - 1, &calls, &oom));
  assert_int_equal(calls.n, 1);
  kiln_tool_calls_free(&calls);
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  assert_true(kiln_tool_arguments_normalize("{\"a\":1 ,\"b\":[ ]}", strlen("{\"a\":1 ,\"b\":[ ]}"),
                                            &b, &oom));
  assert_string_equal(kiln_strbuf_cstr(&b), "{\"a\": 1, \"b\": []}");
  assert_false(kiln_tool_arguments_normalize("[1]", sizeof("[1]") - 1, &b, &oom));
  assert_false(kiln_tool_arguments_normalize("{\"a\":", sizeof("{\"a\":") - 1, &b, &oom));
  assert_false(oom);
  kiln_strbuf_free(&b);
}

static fmt_t detect(const char *src) { return kiln_tool_format_detect(src, strlen(src)); }

static bool uses_tools(const char *src) {
  kiln_template_t *t = NULL;
  kiln_status_t st = kiln_template_compile(src, strlen(src), "t", &t);
  if (st) fail_msg("%s", kiln_status_message(st));
  bool r = kiln_template_uses_variable(t, "tools");
  size_t n = 0;
  assert_string_equal(kiln_template_source(t, &n), src);
  assert_int_equal(n, strlen(src));
  kiln_template_free(t);
  return r;
}

static void test_detect(void **state) {
  (void)state;
  assert_int_equal(detect("{{ '[TOOL_CALLS][' }}"), MISTRAL);
  assert_int_equal(detect("{{- '<tool_call>\\n{\"name\": \"' }}"), HERMES);
  assert_int_equal(detect("{{- '<|python_tag|>' + tool_call.name }}"), LLAMA);
  assert_int_equal(detect("<|start_header_id|>{{ '\"parameters\": ' }}"), LLAMA);
  assert_int_equal(detect("{{ '\"parameters\": ' }}"), KILN_TOOL_FORMAT_NONE);
  assert_int_equal(detect("{% for m in messages %}{{ m.content }}{% endfor %}"),
                   KILN_TOOL_FORMAT_NONE);
  assert_int_equal(kiln_tool_format_detect(NULL, 0), KILN_TOOL_FORMAT_NONE);
  /* uses_variable: code only, anywhere (macros, tests, sets), not template text */
  assert_true(uses_tools("{% if tools %}x{% endif %}"));
  assert_true(uses_tools("{% if not tools is defined %}{% set tools = none %}{% endif %}"));
  assert_true(uses_tools("{% macro m() %}{{ tools | tojson }}{% endmacro %}{{ m() }}"));
  assert_true(uses_tools("{% for t in tools or [] %}{{ t.function.name }}{% endfor %}"));
  assert_false(uses_tools("# Tools: use tools wisely {{ messages | length }}"));
  assert_false(uses_tools("{{ 'tools' }}{{ tool }}{{ x.tools }}"));
  /* the real templates, when the tokenizer files are cached */
  const char *cache = getenv("KILN_TOKENIZER_CACHE");
  if (!cache || !*cache) {
    print_message("  (real templates skipped: KILN_TOKENIZER_CACHE is not set)\n");
    return;
  }
  static const struct {
    const char *name;
    fmt_t want;
    bool tools;
  } real[] = {
      {"qwen3", HERMES, true},
      {"mistral_nemo", MISTRAL, true},
      {"llama3", KILN_TOOL_FORMAT_NONE, false},
      {"deepseek_v3", KILN_TOOL_FORMAT_NONE, false},
      {"gemma3", KILN_TOOL_FORMAT_NONE, false},
  };
  for (size_t i = 0; i < sizeof real / sizeof *real; i++) {
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/%s", cache, real[i].name);
    kiln_chat_template_t *ct = NULL;
    kiln_status_t st = kiln_chat_template_load(dir, &ct);
    if (st) fail_msg("%s: %s", real[i].name, kiln_status_message(st));
    const kiln_template_t *t = kiln_chat_template_select(ct, true);
    assert_non_null(t);
    size_t n = 0;
    const char *src = kiln_template_source(t, &n);
    if (kiln_tool_format_detect(src, n) != real[i].want ||
        kiln_template_uses_variable(t, "tools") != real[i].tools)
      fail_msg("%s: detected %s (tools %d), want %s (tools %d)", real[i].name,
               kiln_tool_format_name(kiln_tool_format_detect(src, n)),
               kiln_template_uses_variable(t, "tools"), kiln_tool_format_name(real[i].want),
               real[i].tools);
    kiln_chat_template_free(ct);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_hermes),
      cmocka_unit_test(test_llama3),
      cmocka_unit_test(test_mistral),
      cmocka_unit_test(test_json),
      cmocka_unit_test(test_stream_holds_little),
      cmocka_unit_test(test_random),
      cmocka_unit_test(test_names),
      cmocka_unit_test(test_detect),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
