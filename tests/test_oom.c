/* test_oom.c - out-of-memory tests: fail the Nth heap allocation of an operation, for N = 0, 1,
 * 2, ... until the operation no longer reaches an Nth allocation, and check every step.
 *
 * The modules under test are compiled into this executable (not taken from libkiln) and linked
 * with -Wl,--wrap=malloc,... so that their allocations go through tests/oom_alloc.c. Each walk
 * runs twice: "one-shot" fails only the Nth allocation (later ones succeed, so error paths
 * build their full messages), "sticky" fails the Nth and every later one (error paths run out
 * of memory themselves). At every step the operation must either succeed with exactly the
 * result of an unhindered run (a failure it absorbed must not change what it produced) or
 * return KILN_ERR_OUT_OF_MEMORY with a non-empty message, leaving the state its API promises
 * (the config is untouched, an output pointer is NULL, an id array keeps its length); it must
 * never crash, return another code, or leak (this binary runs under ASan/LSan and valgrind).
 *
 * Not covered: allocations inside shared libraries, which --wrap cannot reach: libc's own
 * (fopen, realpath, opendir, newlocale, open_memstream), inih's line buffer, PCRE2's pattern
 * compilation, JIT and match data (it takes a general context with custom malloc; not worth
 * it here), utf8proc's normalization buffers, libpng's, libjpeg's and libwebp's own working
 * memory (the image walks fail Kiln's buffers around them), dlopen's, and the backend plugins' (the
 * model walk runs on the cpu plugin, a dlopen'ed .so: its buffers, streams and error values are
 * allocated there and never fail; a plugin's own out-of-memory comes back as a kiln_hal_error_t
 * with KILN_HAL_ERR_OUT_OF_MEMORY, which kiln_hal_status_from_error maps to
 * KILN_ERR_OUT_OF_MEMORY).
 */
#define _GNU_SOURCE /* open_memstream, mkdtemp, symlink */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base/config.h"
#include "core/engine/engine_internal.h"
#include "base/json.h"
#include "base/status.h"
#include "core/sched/scheduler.h"
#include "base/strbuf.h"
#include "hal/loader.h"
#include "models/loader/gguf.h"
#include "models/loader/weights.h"
#include "models/model.h"
#include "models/model_config.h"
#include "models/template/template.h"
#include "models/tokenizer/tokenizer.h"
#include "models/vision/image.h"
#include "models/vision/preproc.h"
#include "oom_alloc.h"

/* ---- the walk ------------------------------------------------------------------------------- */

/* Most steps one walk may take before the operation is declared never to finish. */
#define OOM_MAX_STEPS 20000

/* The broken promises of the running test, the first of each walk. A walk that finds one still
 * cleans up its step and stops; the test's other walks go on, then the test frees what it holds
 * and fails (oom_assert_clean), so that failures are reported without leak reports piling on
 * top of them. */
static char oom_violation_msg[16384];
static size_t oom_violation_len;
static bool oom_violated; /* in the current walk */
static bool oom_test_violated;
static char oom_where[256]; /* "<operation> (<mode>), allocation <n> failed" for messages */

static void oom_violation(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void oom_violation(const char *fmt, ...) {
  if (oom_violated) return;
  oom_violated = oom_test_violated = true;
  size_t room = sizeof(oom_violation_msg) - oom_violation_len;
  int n = snprintf(oom_violation_msg + oom_violation_len, room, "%s: ", oom_where);
  if (n > 0) oom_violation_len += (size_t)n < room ? (size_t)n : room - 1;
  room = sizeof(oom_violation_msg) - oom_violation_len;
  va_list ap;
  va_start(ap, fmt);
  n = vsnprintf(oom_violation_msg + oom_violation_len, room, fmt, ap);
  va_end(ap);
  if (n > 0) oom_violation_len += (size_t)n < room ? (size_t)n : room - 1;
  if (oom_violation_len + 1 < sizeof(oom_violation_msg)) {
    oom_violation_msg[oom_violation_len++] = '\n';
    oom_violation_msg[oom_violation_len] = '\0';
  }
}

#define OOM_CHECK(cond, ...)                 \
  do {                                       \
    if (!(cond)) oom_violation(__VA_ARGS__); \
  } while (0)

static void oom_assert_clean(void) {
  bool failed = oom_test_violated;
  oom_violated = oom_test_violated = false;
  oom_violation_len = 0;
  if (failed) fail_msg("%s", oom_violation_msg);
}

/* One operation under test. Only run() is armed; the other callbacks run with a normal heap. */
typedef struct oom_op {
  const char *name;
  void *ctx;
  void (*setup)(void *ctx); /* fresh inputs for one step (optional) */
  kiln_status_t (*run)(void *ctx);
  /* The observable state, as a malloc'ed string, after setup and again after run (ok says
   * whether run succeeded). It checks (OOM_CHECK) what the API promises on failure. */
  char *(*snapshot)(void *ctx, bool ok);
  void (*teardown)(void *ctx); /* frees what setup and run made (optional) */
  /* On error the snapshot must equal the one taken before run(). */
  bool transactional;
} oom_op_t;

typedef struct oom_stats {
  long allocs;   /* allocations of an unhindered run: the failure points */
  long errors;   /* one-shot steps that returned KILN_ERR_OUT_OF_MEMORY */
  long absorbed; /* one-shot steps that succeeded although an allocation failed */
} oom_stats_t;

/* One step: fail allocation n (n < 0: none) and check the outcome against want (the result of
 * the unhindered run; NULL while computing it, which *out_result then receives). Returns true
 * when allocation n was reached, i.e. the walk must go on. */
static bool oom_step(const oom_op_t *op, long n, bool sticky, const char *want, oom_stats_t *stats,
                     char **out_result) {
  if (n < 0)
    snprintf(oom_where, sizeof(oom_where), "%s (reference run)", op->name);
  else
    snprintf(oom_where, sizeof(oom_where), "%s (%s), allocation %ld failed", op->name,
             sticky ? "sticky" : "one-shot", n);
  if (op->setup) op->setup(op->ctx);
  char *before = op->snapshot(op->ctx, false);
  oom_alloc_arm(n, sticky);
  kiln_status_t st = op->run(op->ctx);
  long count = oom_alloc_disarm();
  bool fired = oom_alloc_failures() > 0;
  char *after = op->snapshot(op->ctx, st == NULL);
  if (!fired) {
    /* Allocation n was never reached: the unhindered run. */
    snprintf(oom_where, sizeof(oom_where), "%s (%s), no failure at step %ld", op->name,
             n < 0    ? "reference run"
             : sticky ? "sticky"
                      : "one-shot",
             n);
    OOM_CHECK(!st, "the operation fails: %s", kiln_status_message(st));
    if (!want) {
      stats->allocs = count;
      *out_result = after;
      after = NULL;
    } else {
      OOM_CHECK(strcmp(after, want) == 0,
                "the result differs from the reference run:\n--- want\n%s\n--- got\n%s", want,
                after);
      OOM_CHECK(count == stats->allocs, "%ld allocations, %ld in the reference run", count,
                stats->allocs);
    }
  } else if (st) {
    const char *msg = kiln_status_message(st);
    OOM_CHECK(kiln_status_code(st) == KILN_ERR_OUT_OF_MEMORY, "the operation returned %s: %s",
              kiln_status_code_name(kiln_status_code(st)), msg);
    OOM_CHECK(msg && msg[0], "empty OUT_OF_MEMORY message");
    OOM_CHECK(!op->transactional || strcmp(after, before) == 0,
              "the operation failed and changed the state:\n--- before\n%s\n--- after\n%s", before,
              after);
    if (!sticky) stats->errors++;
  } else {
    OOM_CHECK(strcmp(after, want) == 0,
              "the operation reported success, and its result differs from the reference run:\n"
              "--- want\n%s\n--- got\n%s",
              want, after);
    if (!sticky) stats->absorbed++;
  }
  kiln_status_free(st);
  free(before);
  free(after);
  if (op->teardown) op->teardown(op->ctx);
  return fired;
}

/* Walks op in both modes and prints how many failure points it exercised. Returns false (with
 * the violation recorded for oom_assert_clean) when a step broke a promise. */
static bool oom_walk(const oom_op_t *op) {
  oom_violated = false;
  oom_stats_t stats = {0};
  char *want = NULL;
  oom_step(op, -1, false, NULL, &stats, &want);
  for (int sticky = 0; sticky < 2 && want && !oom_violated; sticky++) {
    long n = 0;
    while (!oom_violated && oom_step(op, n, sticky, want, &stats, NULL))
      if (++n > OOM_MAX_STEPS) oom_violation("still reaching allocation %ld", n);
  }
  free(want);
  snprintf(oom_where, sizeof(oom_where), "%s", op->name);
  OOM_CHECK(oom_violated || stats.allocs > 0, "allocates nothing, so the walk tested nothing");
  if (oom_violated) return false;
  print_message("[   OOM    ] %-28s %5ld failure points: %ld OUT_OF_MEMORY, %ld absorbed\n",
                op->name, stats.allocs, stats.errors, stats.absorbed);
  return true;
}

/* ---- helpers -------------------------------------------------------------------------------- */

static char *xstrdup(const char *s) {
  char *c = strdup(s);
  assert_non_null(c);
  return c;
}

static char *config_text(const kiln_config_t *cfg) {
  if (!cfg) return xstrdup("(no config)");
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  assert_non_null(f);
  kiln_config_write(cfg, f);
  assert_int_equal(fclose(f), 0);
  return text;
}

/* A strbuf's content, checking its invariants: NUL-terminated at len, len < cap. */
static char *strbuf_text(const kiln_strbuf_t *b) {
  bool ok = b->cap ? b->len < b->cap && b->data[b->len] == '\0' : b->len == 0;
  OOM_CHECK(ok, "a strbuf is broken: len %zu, cap %zu", b->len, b->cap);
  return xstrdup(ok ? kiln_strbuf_cstr(b) : "(broken strbuf)");
}

/* ---- config --------------------------------------------------------------------------------- */

/* A realistic file: most sections, an int list, an inline comment, two plugin sections. */
static const char k_ini[] =
    "; a deployment\n"
    "[model]\n"
    "path = /models/qwen3-0.6b\n"
    "dtype = bfloat16\n"
    "max_model_len = 8192\n"
    "\n"
    "[engine]\n"
    "max_num_seqs = 64\n"
    "seed = 1234\n"
    "\n"
    "[cache]\n"
    "block_size = 32\n"
    "gpu_memory_utilization = 0.85\n"
    "enable_prefix_caching = off\n"
    "\n"
    "[backend]\n"
    "name = cuda\n"
    "path = /opt/kiln/plugins:/usr/lib/kiln\n"
    "\n"
    "[server]\n"
    "host = 0.0.0.0\n"
    "port = 8080\n"
    "api_key = s3cret ; inline comment\n"
    "\n"
    "[graph]\n"
    "capture_sizes = 1, 2, 4, 8, 16, 32\n"
    "\n"
    "[log]\n"
    "level = info\n"
    "format = json\n"
    "\n"
    "[plugin.trace]\n"
    "level = 2\n"
    "output = /tmp/trace.json\n"
    "sample-rate = 0.5\n"
    "\n"
    "[plugin.cuda.graphs]\n"
    "pool = 1\n"
    "streams = 4\n"
    "priority = high\n"
    "arena_mb = 512\n"
    "warmup = yes\n";

/* Loaded before the walks of load and set, so that "unchanged" is not just "the defaults". */
static const char k_ini_before[] =
    "[engine]\n"
    "max_num_batched_tokens = 4096\n"
    "[graph]\n"
    "capture_sizes = 3,5\n"
    "[plugin.trace]\n"
    "level = 1\n";

typedef struct config_ctx {
  kiln_config_t *cfg;
  const char *arg; /* the INI text or the --set assignment */
  const char *path;
} config_ctx_t;

static void config_setup_empty(void *p) { ((config_ctx_t *)p)->cfg = NULL; }

static void config_setup_loaded(void *p) {
  config_ctx_t *c = p;
  assert_null(kiln_config_create(&c->cfg));
  assert_null(kiln_config_load_string(c->cfg, k_ini_before, "before.ini"));
}

static void config_setup_full(void *p) {
  config_ctx_t *c = p;
  config_setup_loaded(c);
  assert_null(kiln_config_load_string(c->cfg, k_ini, "kiln.ini"));
}

static void config_teardown(void *p) {
  config_ctx_t *c = p;
  kiln_config_free(c->cfg);
  c->cfg = NULL;
}

static char *config_snapshot(void *p, bool ok) {
  (void)ok;
  return config_text(((config_ctx_t *)p)->cfg);
}

static kiln_status_t config_run_create(void *p) {
  return kiln_config_create(&((config_ctx_t *)p)->cfg);
}

static kiln_status_t config_run_load(void *p) {
  config_ctx_t *c = p;
  return kiln_config_load_string(c->cfg, c->arg, "kiln.ini");
}

static kiln_status_t config_run_load_file(void *p) {
  config_ctx_t *c = p;
  return kiln_config_load_file(c->cfg, c->path);
}

static kiln_status_t config_run_set(void *p) {
  config_ctx_t *c = p;
  return kiln_config_set(c->cfg, c->arg);
}

static void test_config_create(void **state) {
  (void)state;
  config_ctx_t c = {0};
  oom_op_t op = {.name = "config_create",
                 .ctx = &c,
                 .setup = config_setup_empty,
                 .run = config_run_create,
                 .snapshot = config_snapshot,
                 .teardown = config_teardown,
                 .transactional = true};
  oom_walk(&op);
  oom_assert_clean();
}

static void test_config_load(void **state) {
  (void)state;
  config_ctx_t c = {.arg = k_ini};
  oom_op_t op = {.name = "config_load_string",
                 .ctx = &c,
                 .setup = config_setup_loaded,
                 .run = config_run_load,
                 .snapshot = config_snapshot,
                 .teardown = config_teardown,
                 .transactional = true};
  oom_walk(&op);

  /* The same from a file (kiln_config_load_file reads it into a growing buffer first). */
  char path[] = "/tmp/kiln-oom-XXXXXX";
  int fd = mkstemp(path);
  assert_true(fd >= 0);
  FILE *f = fdopen(fd, "w");
  assert_non_null(f);
  assert_int_equal(fputs(k_ini, f) >= 0, 1);
  assert_int_equal(fclose(f), 0);
  c.path = path;
  oom_op_t op_file = {.name = "config_load_file",
                      .ctx = &c,
                      .setup = config_setup_loaded,
                      .run = config_run_load_file,
                      .snapshot = config_snapshot,
                      .teardown = config_teardown,
                      .transactional = true};
  oom_walk(&op_file);
  unlink(path);
  oom_assert_clean();
}

static void test_config_set(void **state) {
  (void)state;
  static const char *const assignments[] = {
      "server.port=9000",                       /* a table key */
      "graph.capture_sizes = 1,2,4,8,16,32,64", /* an int list */
      "plugin.trace.level=3",                   /* an existing plugin key */
      "plugin.cuda.graphs.fresh=1",             /* a new key: the plugin key array grows */
      "plugin.newplugin.key=value",             /* a new plugin section */
  };
  for (size_t i = 0; i < sizeof(assignments) / sizeof(assignments[0]); i++) {
    config_ctx_t c = {.arg = assignments[i]};
    char name[64];
    snprintf(name, sizeof(name), "config_set[%zu]", i);
    oom_op_t op = {.name = name,
                   .ctx = &c,
                   .setup = config_setup_full,
                   .run = config_run_set,
                   .snapshot = config_snapshot,
                   .teardown = config_teardown,
                   .transactional = true};
    oom_walk(&op);
  }
  oom_assert_clean();
}

/* ---- JSON ----------------------------------------------------------------------------------- */

/* About 2 KB: nesting, every escape, a surrogate pair, numbers of every shape, and a 20-member
 * object (objects over 8 members get a hash index). */
static const char k_json[] =
    "{\n"
    "  \"model\": \"kiln-test\",\n"
    "  \"messages\": [\n"
    "    {\"role\": \"system\", \"content\": \"You are \\\"helpful\\\".\\nBe brief.\\t\\u00e9\"},\n"
    "    {\"role\": \"user\", \"content\": \"caf\\u00e9 \\ud83d\\ude00 \\\\ back\\/slash "
    "\\b\\f\\r\"},\n"
    "    {\"role\": \"assistant\", \"content\": null, \"tool_calls\": [\n"
    "      {\"id\": \"call_1\", \"type\": \"function\",\n"
    "       \"function\": {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", "
    "\"days\": 3}}}\n"
    "    ]},\n"
    "    {\"role\": \"tool\", \"content\": [{\"type\": \"text\", \"text\": \"18C, \\u2600\"}]}\n"
    "  ],\n"
    "  \"params\": {\n"
    "    \"k01\": 1, \"k02\": -2, \"k03\": 3.5, \"k04\": -4.25e-3, \"k05\": 5E+2,\n"
    "    \"k06\": true, \"k07\": false, \"k08\": null, \"k09\": \"nine\", \"k10\": [10, 10.0],\n"
    "    \"k11\": {\"eleven\": 11}, \"k12\": [], \"k13\": {}, \"k14\": 9223372036854775807,\n"
    "    \"k15\": -9223372036854775808, \"k16\": 1e-310, \"k17\": 0.1, \"k18\": \"\",\n"
    "    \"k19\": [[[[\"deep\"]]]], \"k20\": \"\\u0000nul\", \"k05\": \"duplicate\"\n"
    "  },\n"
    "  \"tools\": [\n"
    "    {\"type\": \"function\", \"function\": {\"name\": \"get_weather\",\n"
    "      \"description\": \"Get the weather for a city over some days\",\n"
    "      \"parameters\": {\"type\": \"object\", \"properties\": {\n"
    "        \"city\": {\"type\": \"string\", \"description\": \"City name\"},\n"
    "        \"days\": {\"type\": \"integer\", \"minimum\": 1, \"maximum\": 14}},\n"
    "        \"required\": [\"city\"]}}},\n"
    "    {\"type\": \"function\", \"function\": {\"name\": \"search\",\n"
    "      \"description\": \"Search the web\",\n"
    "      \"parameters\": {\"type\": \"object\", \"properties\": {\n"
    "        \"query\": {\"type\": \"string\"}, \"limit\": {\"type\": \"integer\", \"default\": "
    "5}},\n"
    "        \"required\": [\"query\"]}}}\n"
    "  ],\n"
    "  \"matrix\": [[1, 2, 3], [4, 5, 6], [7, 8, 9], [1.5, -2.5, 3.25e10]],\n"
    "  \"unicode\": \"\\u65e5\\u672c\\u8a9e \\u0420\\u0443\\u0441\\u0441\\u043a\\u0438\\u0439 "
    "\xce\xb1\xce\xb2\xce\xb3 \xf0\x9f\x8e\x89\",\n"
    "  \"flags\": {\"stream\": true, \"logprobs\": false, \"n\": 1, \"temperature\": 0.7,\n"
    "    \"top_p\": 0.95, \"stop\": [\"</s>\", \"\\n\\n\"], \"seed\": null},\n"
    "  \"long\": \"Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor "
    "incididunt ut labore et dolore magna aliqua. Ut enim ad minim veniam, quis nostrud "
    "exercitation ullamco laboris nisi ut aliquip ex ea commodo consequat.\"\n"
    "}\n";

/* The document as Python would write it, pretty and ASCII-only: a fingerprint of the tree. */
static char *json_dump(const kiln_json_doc_t *doc) {
  if (!doc) return xstrdup("(no document)");
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  assert_true(kiln_json_write(&b, kiln_json_root(doc), true, true));
  /* Lookups through the hash index, and the duplicate key (the last one wins). */
  const kiln_json_t *params = kiln_json_get(kiln_json_root(doc), "params");
  int64_t v = 0;
  const char *dup = kiln_json_string(kiln_json_get(params, "k05"), NULL);
  OOM_CHECK(kiln_json_int64(kiln_json_get(params, "k01"), &v) && v == 1,
            "doc.json: params.k01 is not 1");
  OOM_CHECK(dup && strcmp(dup, "duplicate") == 0, "doc.json: params.k05 is not \"duplicate\"");
  char *s = kiln_strbuf_detach(&b, NULL);
  assert_non_null(s);
  return s;
}

typedef struct json_ctx {
  kiln_json_doc_t *doc; /* parse: the result; write: the input */
  kiln_strbuf_t out;    /* write: the output */
} json_ctx_t;

static kiln_status_t json_run_parse(void *p) {
  json_ctx_t *c = p;
  return kiln_json_parse(k_json, sizeof(k_json) - 1, "doc.json", &c->doc);
}

static char *json_snapshot_parse(void *p, bool ok) {
  json_ctx_t *c = p;
  OOM_CHECK(ok || !c->doc, "kiln_json_parse failed and left *out_doc set");
  return json_dump(c->doc);
}

static void json_teardown_parse(void *p) {
  json_ctx_t *c = p;
  kiln_json_doc_free(c->doc);
  c->doc = NULL;
}

static void test_json_parse(void **state) {
  (void)state;
  json_ctx_t c = {0};
  oom_op_t op = {.name = "json_parse",
                 .ctx = &c,
                 .run = json_run_parse,
                 .snapshot = json_snapshot_parse,
                 .teardown = json_teardown_parse,
                 .transactional = true};
  oom_walk(&op);
  oom_assert_clean();
}

static const char k_json_prefix[] = "prefix|";

static void json_setup_write(void *p) {
  json_ctx_t *c = p;
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  c->out = b;
  /* An exact fit, so the first append of run() has to grow the buffer. */
  assert_true(kiln_strbuf_reserve(&c->out, sizeof(k_json_prefix) - 1));
  assert_true(kiln_strbuf_append_str(&c->out, k_json_prefix));
}

/* Every writer, appending to one buffer; the first false stops it. */
static kiln_status_t json_run_write(void *p) {
  json_ctx_t *c = p;
  const kiln_json_t *root = kiln_json_root(c->doc);
  bool ok = kiln_json_write(&c->out, root, false, false) &&
            kiln_json_write(&c->out, root, true, true) &&
            kiln_json_write_string(&c->out, "caf\xc3\xa9 \xf0\x9f\x98\x80 \"q\"\n\x01", 14, true) &&
            kiln_json_write_string(&c->out, "caf\xc3\xa9 \xff", 7, false) &&
            kiln_json_write_number(&c->out, 3.0) && kiln_json_write_number(&c->out, 0.1) &&
            kiln_json_write_double(&c->out, 1e300) && kiln_json_write_double(&c->out, -0.0) &&
            kiln_strbuf_printf(&c->out, "|%d|%s|", 42, "end") &&
            kiln_strbuf_append_utf8(&c->out, 0x1F600);
  if (ok) return NULL;
  OOM_CHECK(c->out.failed && !kiln_strbuf_ok(&c->out),
            "a JSON writer returned false without setting the strbuf's failure flag");
  return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "a JSON writer ran out of memory");
}

static char *json_snapshot_write(void *p, bool ok) {
  json_ctx_t *c = p;
  char *s = strbuf_text(&c->out);
  /* Whatever a failed writer left, what was in the buffer before it is still there. */
  OOM_CHECK(strncmp(s, k_json_prefix, sizeof(k_json_prefix) - 1) == 0,
            "a JSON writer lost what the buffer held before: \"%s\"", s);
  (void)ok;
  return s;
}

static void json_teardown_write(void *p) { kiln_strbuf_free(&((json_ctx_t *)p)->out); }

static void test_json_write(void **state) {
  (void)state;
  json_ctx_t c = {0};
  assert_null(kiln_json_parse(k_json, sizeof(k_json) - 1, "doc.json", &c.doc));
  oom_op_t op = {.name = "json_write",
                 .ctx = &c,
                 .setup = json_setup_write,
                 .run = json_run_write,
                 .snapshot = json_snapshot_write,
                 .teardown = json_teardown_write,
                 .transactional = false};
  oom_walk(&op);
  kiln_json_doc_free(c.doc);
  oom_assert_clean();
}

/* strbuf's promise is stronger than the writers': a failed append leaves the buffer as it was. */
typedef struct strbuf_ctx {
  kiln_strbuf_t b;
  char *detached;
} strbuf_ctx_t;

static void strbuf_setup(void *p) {
  strbuf_ctx_t *c = p;
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  c->b = b;
  c->detached = NULL;
}

static kiln_status_t strbuf_run(void *p) {
  strbuf_ctx_t *c = p;
  kiln_strbuf_t *b = &c->b;
  char big[600];
  memset(big, 'x', sizeof(big));
  /* Each append is checked against the length before it. */
  size_t before = b->len;
  if (!kiln_strbuf_append_str(b, "hello")) goto fail;
  before = b->len;
  if (!kiln_strbuf_append(b, big, sizeof(big))) goto fail;
  before = b->len;
  if (!kiln_strbuf_printf(b, "%s-%0400d", "wide", 7)) goto fail;
  before = b->len;
  if (!kiln_strbuf_reserve(b, 5000)) goto fail;
  before = b->len;
  if (!kiln_strbuf_append_char(b, '!')) goto fail;
  c->detached = kiln_strbuf_detach(b, NULL);
  if (!c->detached) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "kiln_strbuf_detach");
  /* An empty buffer detaches as a malloc'ed "". */
  char *empty = kiln_strbuf_detach(b, NULL);
  if (!empty) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "kiln_strbuf_detach (empty)");
  OOM_CHECK(strcmp(empty, "") == 0, "detaching an empty strbuf gave \"%s\"", empty);
  free(empty);
  return NULL;
fail:
  OOM_CHECK(b->len == before && b->failed,
            "a failed strbuf append changed the length (%zu -> %zu) or left the flag clear", before,
            b->len);
  return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "a strbuf append ran out of memory");
}

static char *strbuf_snapshot(void *p, bool ok) {
  strbuf_ctx_t *c = p;
  if (ok) return xstrdup(c->detached);
  return strbuf_text(&c->b);
}

static void strbuf_teardown(void *p) {
  strbuf_ctx_t *c = p;
  kiln_strbuf_free(&c->b);
  free(c->detached);
  c->detached = NULL;
}

static void test_strbuf(void **state) {
  (void)state;
  strbuf_ctx_t c = {0};
  oom_op_t op = {.name = "strbuf",
                 .ctx = &c,
                 .setup = strbuf_setup,
                 .run = strbuf_run,
                 .snapshot = strbuf_snapshot,
                 .teardown = strbuf_teardown,
                 .transactional = false};
  oom_walk(&op);
  oom_assert_clean();
}

/* ---- tokenizer ------------------------------------------------------------------------------ */

#define G "\xc4\xa0" /* U+0120, ByteLevel's stand-in for a space */

/* A tiny byte-level BPE: the single characters, then one token per merge. */
static const char *const k_tok_chars[] = {"!", ",", ".", "a", "d", "e", "h", "i",
                                          "l", "n", "o", "r", "t", "w", G};
static const char *const k_tok_merges[][2] = {
    {"h", "e"},      {"l", "l"},      {"he", "ll"},   {"hell", "o"},   {G, "w"},
    {"o", "r"},      {G "w", "or"},   {G "wor", "l"}, {G "worl", "d"}, {G, "he"},
    {G "he", "ll"},  {G "hell", "o"}, {"r", "e"},     {G, "t"},        {G "t", "he"},
    {G "the", "re"}, {"h", "i"},      {G, "hi"},      {"e", "n"},      {G, "en"},
    {G "en", "d"},   {"i", "n"},      {G, "a"},       {G "a", "n"},    {G "an", "d"},
    {"t", "h"},      {"th", "e"},     {"a", "n"},     {"an", "d"},     {"w", "or"},
    {"wor", "l"},    {"worl", "d"},   {"e", "r"},     {"o", "n"},      {G, "o"},
};
#define TOK_SPECIAL "<|endoftext|>"

/* Builds the tokenizer.json text (a malloc'ed string). */
static char *tok_json_build(void) {
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  size_t nchars = sizeof(k_tok_chars) / sizeof(k_tok_chars[0]);
  size_t nmerges = sizeof(k_tok_merges) / sizeof(k_tok_merges[0]);
  size_t special_id = nchars + nmerges;
  const char *sp = TOK_SPECIAL;
  kiln_strbuf_printf(
      &b,
      "{\"version\":\"1.0\",\"truncation\":null,\"padding\":null,"
      "\"added_tokens\":[{\"id\":%zu,\"content\":\"%s\",\"single_word\":false,\"lstrip\":false,"
      "\"rstrip\":false,\"normalized\":false,\"special\":true}],"
      "\"normalizer\":{\"type\":\"NFC\"},"
      "\"pre_tokenizer\":{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"trim_offsets\":true,"
      "\"use_regex\":true},"
      "\"post_processor\":{\"type\":\"TemplateProcessing\",\"single\":[{\"Sequence\":{\"id\":\"A\","
      "\"type_id\":0}},{\"SpecialToken\":{\"id\":\"%s\",\"type_id\":0}}],\"pair\":[],"
      "\"special_tokens\":{\"%s\":{\"id\":\"%s\",\"ids\":[%zu],\"tokens\":[\"%s\"]}}},"
      "\"decoder\":{\"type\":\"ByteLevel\",\"add_prefix_space\":true,\"trim_offsets\":true,"
      "\"use_regex\":true},"
      "\"model\":{\"type\":\"BPE\",\"dropout\":null,\"unk_token\":null,\"fuse_unk\":false,"
      "\"byte_fallback\":false,\"vocab\":{",
      special_id, sp, sp, sp, sp, special_id, sp);
  for (size_t i = 0; i < nchars; i++)
    kiln_strbuf_printf(&b, "%s\"%s\":%zu", i ? "," : "", k_tok_chars[i], i);
  for (size_t i = 0; i < nmerges; i++)
    kiln_strbuf_printf(&b, ",\"%s%s\":%zu", k_tok_merges[i][0], k_tok_merges[i][1], nchars + i);
  kiln_strbuf_append_str(&b, "},\"merges\":[");
  for (size_t i = 0; i < nmerges; i++)
    kiln_strbuf_printf(&b, "%s\"%s %s\"", i ? "," : "", k_tok_merges[i][0], k_tok_merges[i][1]);
  kiln_strbuf_append_str(&b, "]}}");
  assert_true(kiln_strbuf_ok(&b));
  return kiln_strbuf_detach(&b, NULL);
}

static const char k_tok_text[] = "hello world, hello there!" TOK_SPECIAL
                                 " hi the end and there. hello hello world on" TOK_SPECIAL "!";

typedef struct tok_ctx {
  char *json;
  kiln_tokenizer_t *tok;
  kiln_tokens_t ids;  /* encode: the output (starts with one id); decode/detok: the input */
  kiln_strbuf_t text; /* decode/detok: the output */
  kiln_detok_t *detok;
} tok_ctx_t;

/* What a tokenizer does with k_tok_text: its ids and their decoding both ways. */
static char *tok_describe(const kiln_tokenizer_t *tok) {
  if (!tok) return xstrdup("(no tokenizer)");
  kiln_tokens_t ids = KILN_TOKENS_INIT;
  kiln_status_t st = kiln_tokenizer_encode(tok, k_tok_text, sizeof(k_tok_text) - 1, true, &ids);
  OOM_CHECK(!st, "the loaded tokenizer cannot encode: %s", kiln_status_message(st));
  kiln_status_free(st);
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  kiln_strbuf_printf(&b, "vocab %zu, special %d:", kiln_tokenizer_vocab_size(tok),
                     (int)kiln_tokenizer_token_to_id(tok, TOK_SPECIAL, strlen(TOK_SPECIAL)));
  for (size_t i = 0; i < ids.len; i++) kiln_strbuf_printf(&b, " %d", (int)ids.ids[i]);
  kiln_strbuf_append_str(&b, "\n");
  for (int skip = 0; skip < 2; skip++) {
    st = kiln_tokenizer_decode(tok, ids.ids, ids.len, skip, &b);
    OOM_CHECK(!st, "the loaded tokenizer cannot decode: %s", kiln_status_message(st));
    kiln_status_free(st);
    kiln_strbuf_append_str(&b, "\n");
  }
  kiln_tokens_free(&ids);
  assert_true(kiln_strbuf_ok(&b));
  return kiln_strbuf_detach(&b, NULL);
}

static kiln_status_t tok_run_load(void *p) {
  tok_ctx_t *c = p;
  return kiln_tokenizer_load_json(c->json, strlen(c->json), "tokenizer.json", &c->tok);
}

static char *tok_snapshot_load(void *p, bool ok) {
  tok_ctx_t *c = p;
  OOM_CHECK(ok || !c->tok, "kiln_tokenizer_load_json failed and left *out set");
  return tok_describe(c->tok);
}

static void tok_teardown(void *p) {
  tok_ctx_t *c = p;
  kiln_detok_free(c->detok);
  c->detok = NULL;
  kiln_tokenizer_free(c->tok);
  c->tok = NULL;
  kiln_tokens_free(&c->ids);
  kiln_strbuf_free(&c->text);
}

/* A fresh tokenizer for each step: encode fills the tokenizer's word cache, which would change
 * the allocations of the next step. */
static void tok_setup_loaded(void *p) {
  tok_ctx_t *c = p;
  assert_null(kiln_tokenizer_load_json(c->json, strlen(c->json), "tokenizer.json", &c->tok));
}

static void tok_setup_encode(void *p) {
  tok_ctx_t *c = p;
  tok_setup_loaded(c);
  assert_true(kiln_tokens_push(&c->ids, 7));
}

static kiln_status_t tok_run_encode(void *p) {
  tok_ctx_t *c = p;
  return kiln_tokenizer_encode(c->tok, k_tok_text, sizeof(k_tok_text) - 1, true, &c->ids);
}

static char *tok_ids_text(const kiln_tokens_t *ids) {
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  kiln_strbuf_printf(&b, "%zu ids:", ids->len);
  for (size_t i = 0; i < ids->len; i++) kiln_strbuf_printf(&b, " %d", (int)ids->ids[i]);
  assert_true(kiln_strbuf_ok(&b));
  return kiln_strbuf_detach(&b, NULL);
}

static char *tok_snapshot_encode(void *p, bool ok) {
  (void)ok;
  return tok_ids_text(&((tok_ctx_t *)p)->ids);
}

static void tok_setup_decode(void *p) {
  tok_ctx_t *c = p;
  tok_setup_loaded(c);
  assert_null(kiln_tokenizer_encode(c->tok, k_tok_text, sizeof(k_tok_text) - 1, true, &c->ids));
}

static kiln_status_t tok_run_decode(void *p) {
  tok_ctx_t *c = p;
  kiln_status_t st = kiln_tokenizer_decode(c->tok, c->ids.ids, c->ids.len, false, &c->text);
  if (!st) st = kiln_tokenizer_decode(c->tok, c->ids.ids, c->ids.len, true, &c->text);
  return st;
}

static char *tok_snapshot_text(void *p, bool ok) {
  (void)ok;
  return strbuf_text(&((tok_ctx_t *)p)->text);
}

/* The whole life of a stream: create, push every id, flush. */
static kiln_status_t tok_run_detok(void *p) {
  tok_ctx_t *c = p;
  kiln_status_t st = kiln_detok_create(c->tok, false, &c->detok);
  if (st) {
    OOM_CHECK(!c->detok, "kiln_detok_create failed and left *out set");
    return st;
  }
  for (size_t i = 0; i < c->ids.len && !st; i++)
    st = kiln_detok_push(c->detok, c->ids.ids[i], &c->text);
  if (!st) st = kiln_detok_flush(c->detok, &c->text);
  return st;
}

static void test_tokenizer_load(void **state) {
  (void)state;
  tok_ctx_t c = {.json = tok_json_build()};
  oom_op_t op = {.name = "tokenizer_load_json",
                 .ctx = &c,
                 .run = tok_run_load,
                 .snapshot = tok_snapshot_load,
                 .teardown = tok_teardown,
                 .transactional = true};
  oom_walk(&op);
  free(c.json);
  oom_assert_clean();
}

static void test_tokenizer_encode(void **state) {
  (void)state;
  tok_ctx_t c = {.json = tok_json_build()};
  /* "On error out keeps its previous length." */
  oom_op_t op = {.name = "tokenizer_encode",
                 .ctx = &c,
                 .setup = tok_setup_encode,
                 .run = tok_run_encode,
                 .snapshot = tok_snapshot_encode,
                 .teardown = tok_teardown,
                 .transactional = true};
  oom_walk(&op);
  free(c.json);
  oom_assert_clean();
}

static void test_tokenizer_decode(void **state) {
  (void)state;
  tok_ctx_t c = {.json = tok_json_build()};
  oom_op_t op = {.name = "tokenizer_decode",
                 .ctx = &c,
                 .setup = tok_setup_decode,
                 .run = tok_run_decode,
                 .snapshot = tok_snapshot_text,
                 .teardown = tok_teardown,
                 .transactional = false};
  oom_walk(&op);
  oom_op_t op_detok = {.name = "tokenizer_detok",
                       .ctx = &c,
                       .setup = tok_setup_decode,
                       .run = tok_run_detok,
                       .snapshot = tok_snapshot_text,
                       .teardown = tok_teardown,
                       .transactional = false};
  oom_walk(&op_detok);
  free(c.json);
  oom_assert_clean();
}

/* ---- chat templates ------------------------------------------------------------------------- */

static const char k_template[] =
    "{%- macro render_content(m) -%}\n"
    "  {%- if m.content is string -%}{{ m.content | trim }}\n"
    "  {%- elif m.content is none -%}(none)\n"
    "  {%- else -%}{% for part in m.content %}{{ part.text | default('?') }}{% endfor %}\n"
    "  {%- endif -%}\n"
    "{%- endmacro -%}\n"
    "{%- set ns = namespace(chars=0, tools=[]) -%}\n"
    "{%- if tools %}<|tools|>{{ tools | tojson }}\n"
    "{% endif -%}\n"
    "{%- for m in messages -%}\n"
    "  {%- if m.role == 'system' -%}\n"
    "<|system|>{{ render_content(m) | upper }}\n"
    "  {%- elif m.tool_calls is defined -%}\n"
    "<|{{ m.role }}|>{% for tc in m.tool_calls %}{{ tc.function.name }}({{ tc.function.arguments "
    "| tojson(indent=2) }}){% if not loop.last %}, {% endif %}{% endfor %}\n"
    "  {%- else -%}\n"
    "<|{{ m.role }}|>[{{ loop.index }}/{{ loop.length }}] {{ render_content(m) | replace('.', '!') "
    "}}{{ ' (last)' if loop.last }}\n"
    "  {%- endif %}\n"
    "{% set ns.chars = ns.chars + (render_content(m) | length) -%}\n"
    "{%- endfor -%}\n"
    "roles={{ messages | map(attribute='role') | join(',') }} chars={{ ns.chars }} "
    "users={{ messages | selectattr('role', 'equalto', 'user') | list | length }}\n"
    "{%- for k, v in {'a': 1, 'b': [1, 2.5, 'x']}.items() %} {{ k }}={{ v | tojson }}"
    "{% endfor %}\n"
    "{{ bos_token ~ (42 | string) ~ ([3, 1, 2] | sort | join('')) }}\n"
    "{%- if add_generation_prompt %}<|assistant|>{% endif -%}\n";

static const char k_template_vars[] =
    "{\"messages\": ["
    "{\"role\": \"system\", \"content\": \"Be brief.  \"},"
    "{\"role\": \"user\", \"content\": \"What is the weather in Paris?\"},"
    "{\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"type\": \"function\", "
    "\"function\": {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": "
    "3}}}]},"
    "{\"role\": \"tool\", \"content\": [{\"type\": \"text\", \"text\": \"18C, sunny.\"}]},"
    "{\"role\": \"user\", \"content\": \"Thanks. And \\u00e9t\\u00e9?\"}],"
    "\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
    "\"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": "
    "\"string\"}}}}}]}";

typedef struct tpl_ctx {
  kiln_json_doc_t *vars;
  kiln_template_t *tpl;
  kiln_strbuf_t out;
} tpl_ctx_t;

/* Renders tpl over the messages and tools of k_template_vars, appending to out. */
static kiln_status_t tpl_render(const tpl_ctx_t *c, const kiln_template_t *tpl,
                                kiln_strbuf_t *out) {
  const kiln_json_t *root = kiln_json_root(c->vars);
  static const kiln_template_string_var_t strings[] = {{"bos_token", "<s>"}, {"eos_token", "</s>"}};
  kiln_template_vars_t vars = {.messages = kiln_json_get(root, "messages"),
                               .tools = kiln_json_get(root, "tools"),
                               .add_generation_prompt = true,
                               .strings = strings,
                               .n_strings = 2};
  return kiln_template_render(tpl, &vars, out);
}

static char *tpl_describe(const tpl_ctx_t *c) {
  if (!c->tpl) return xstrdup("(no template)");
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  kiln_status_t st = tpl_render(c, c->tpl, &b);
  OOM_CHECK(!st, "the compiled template does not render: %s", kiln_status_message(st));
  kiln_status_free(st);
  char *s = kiln_strbuf_detach(&b, NULL);
  assert_non_null(s);
  return s;
}

static kiln_status_t tpl_run_compile(void *p) {
  tpl_ctx_t *c = p;
  return kiln_template_compile(k_template, sizeof(k_template) - 1, "chat_template", &c->tpl);
}

static char *tpl_snapshot_compile(void *p, bool ok) {
  tpl_ctx_t *c = p;
  OOM_CHECK(ok || !c->tpl, "kiln_template_compile failed and left *out_tpl set");
  return tpl_describe(c);
}

static void tpl_teardown(void *p) {
  tpl_ctx_t *c = p;
  kiln_template_free(c->tpl);
  c->tpl = NULL;
  kiln_strbuf_free(&c->out);
}

static void tpl_setup_render(void *p) {
  tpl_ctx_t *c = p;
  assert_null(kiln_template_compile(k_template, sizeof(k_template) - 1, "chat_template", &c->tpl));
}

static kiln_status_t tpl_run_render(void *p) {
  tpl_ctx_t *c = p;
  return tpl_render(c, c->tpl, &c->out);
}

static char *tpl_snapshot_render(void *p, bool ok) {
  (void)ok;
  return strbuf_text(&((tpl_ctx_t *)p)->out);
}

static void test_template(void **state) {
  (void)state;
  tpl_ctx_t c = {0};
  assert_null(kiln_json_parse(k_template_vars, sizeof(k_template_vars) - 1, "vars.json", &c.vars));
  oom_op_t op = {.name = "template_compile",
                 .ctx = &c,
                 .run = tpl_run_compile,
                 .snapshot = tpl_snapshot_compile,
                 .teardown = tpl_teardown,
                 .transactional = true};
  oom_walk(&op);
  oom_op_t op_render = {.name = "template_render",
                        .ctx = &c,
                        .setup = tpl_setup_render,
                        .run = tpl_run_render,
                        .snapshot = tpl_snapshot_render,
                        .teardown = tpl_teardown,
                        .transactional = false};
  oom_walk(&op_render);
  kiln_json_doc_free(c.vars);
  oom_assert_clean();
}

/* ---- plugin loader -------------------------------------------------------------------------- */

typedef struct loader_ctx {
  kiln_hal_registry_options_t options;
  kiln_hal_registry_t *reg;
} loader_ctx_t;

static kiln_status_t loader_run(void *p) {
  loader_ctx_t *c = p;
  return kiln_hal_registry_create(&c->options, &c->reg);
}

/* Every entry with its state and reason, and the search path. */
static char *loader_snapshot(void *p, bool ok) {
  loader_ctx_t *c = p;
  OOM_CHECK(ok || !c->reg, "kiln_hal_registry_create failed and left *out_registry set");
  if (!c->reg) return xstrdup("(no registry)");
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  const char *path = kiln_hal_registry_search_path(c->reg);
  OOM_CHECK(path, "the registry has no search path");
  kiln_strbuf_printf(&b, "search path: %s\n", path ? path : "(null)");
  for (int i = 0; i < kiln_hal_registry_count(c->reg); i++) {
    const kiln_hal_plugin_t *e = kiln_hal_registry_get(c->reg, i);
    OOM_CHECK(e->state == KILN_HAL_PLUGIN_USABLE || e->reason,
              "registry entry %s (%s) has state %d and no reason", e->name, e->path, e->state);
    kiln_strbuf_printf(&b, "%s %s state=%d score=%d reason=%s\n", e->name, e->path, e->state,
                       (int)e->score, e->reason ? e->reason : "-");
  }
  assert_true(kiln_strbuf_ok(&b));
  return kiln_strbuf_detach(&b, NULL);
}

static void loader_teardown(void *p) {
  loader_ctx_t *c = p;
  kiln_hal_registry_free(c->reg);
  c->reg = NULL;
}

static void write_file(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fputs(text, f);
  assert_int_equal(fclose(f), 0);
}

static void test_loader(void **state) {
  (void)state;
  const char *build = getenv("KILN_BUILD_DIR");
  if (!build) skip(); /* run through CTest, which sets it */
  char empty[] = "/tmp/kiln-oom-empty-XXXXXX", odd[] = "/tmp/kiln-oom-odd-XXXXXX";
  assert_non_null(mkdtemp(empty));
  assert_non_null(mkdtemp(odd));
  /* A directory of oddities, each rejected or shadowed with a reason: a plugin that shadows the
   * real cpu plugin found later, a file that is no shared library, a badly named file. */
  char *plugins = kiln_strprintf("%s/lib/kiln", build);
  char *cpu = kiln_strprintf("%s/libkiln-backend-cpu.so", plugins);
  char *link = kiln_strprintf("%s/libkiln-backend-cpu.so", odd);
  char *junk = kiln_strprintf("%s/libkiln-backend-junk.so", odd);
  char *bad = kiln_strprintf("%s/libkiln-backend-Bad.so", odd);
  char *list = kiln_strprintf("%s:%s:%s:%s", empty, plugins, odd, plugins);
  assert_true(plugins && cpu && link && junk && bad && list);
  assert_int_equal(symlink(cpu, link), 0);
  write_file(junk, "not an ELF file\n");
  write_file(bad, "");

  loader_ctx_t c = {.options = {.config_path = list, .skip_env = true, .skip_default_dirs = true}};
  oom_op_t op = {.name = "hal_registry_create",
                 .ctx = &c,
                 .run = loader_run,
                 .snapshot = loader_snapshot,
                 .teardown = loader_teardown,
                 .transactional = true};
  oom_walk(&op);

  /* The default directories too: the one beside the executable ($ORIGIN-relative) and the
   * install directory (neither holds plugins here, but both are looked up and listed). */
  loader_ctx_t d = {.options = {.config_path = empty, .skip_env = true}};
  oom_op_t op_default = {.name = "hal_registry_create(default)",
                         .ctx = &d,
                         .run = loader_run,
                         .snapshot = loader_snapshot,
                         .teardown = loader_teardown,
                         .transactional = true};
  oom_walk(&op_default);

  unlink(link);
  unlink(junk);
  unlink(bad);
  rmdir(odd);
  rmdir(empty);
  free(plugins);
  free(cpu);
  free(link);
  free(junk);
  free(bad);
  free(list);
  oom_assert_clean();
}

/* ---- model loading ------------------------------------------------------------------------- */

/* The fixture <rel> under tests/fixtures/models of KILN_SOURCE_DIR (set by CTest), malloc'ed;
 * NULL outside CTest (the test then skips). */
static char *fixture_path(const char *rel) {
  const char *src = getenv("KILN_SOURCE_DIR");
  if (!src) return NULL;
  char *p = kiln_strprintf("%s/tests/fixtures/models/%s", src, rel);
  assert_non_null(p);
  return p;
}

static void append_hex(kiln_strbuf_t *b, const void *data, size_t n) {
  static const char digits[] = "0123456789abcdef";
  const uint8_t *p = data;
  assert_true(kiln_strbuf_reserve(b, 2 * n));
  for (size_t i = 0; i < n; i++) {
    kiln_strbuf_append_char(b, digits[p[i] >> 4]);
    kiln_strbuf_append_char(b, digits[p[i] & 15]);
  }
}

/* A summary line, then every byte of the struct: equal texts are memcmp-equal configs (the
 * loaders memset it first, so padding is zero). */
static void append_config(kiln_strbuf_t *b, const kiln_model_config_t *cfg) {
  kiln_strbuf_printf(b, "config %s (%s): %lld layers, hidden %lld, vocab %lld, %d eos\n  ",
                     cfg->architecture, cfg->model_type, (long long)cfg->num_layers,
                     (long long)cfg->hidden_size, (long long)cfg->vocab_size, cfg->num_eos);
  append_hex(b, cfg, sizeof(*cfg));
  kiln_strbuf_append_char(b, '\n');
}

/* Every tensor in order: name, type, shape, bytes, file; and each found again by name. */
static void append_weights(kiln_strbuf_t *b, const kiln_weights_t *w) {
  int64_t n = kiln_weights_count(w);
  kiln_strbuf_printf(b, "%lld tensors\n", (long long)n);
  for (int64_t i = 0; i < n; i++) {
    const kiln_weight_t *t = kiln_weights_at(w, i);
    OOM_CHECK(kiln_weights_find(w, t->name) == t, "tensor %s is not found by its name", t->name);
    kiln_strbuf_printf(b, "  %s %s [", t->name, kiln_wtype_name(t->type));
    for (int d = 0; d < t->ndim; d++)
      kiln_strbuf_printf(b, "%s%lld", d ? ", " : "", (long long)t->shape[d]);
    kiln_strbuf_printf(b, "] %lld elements, %llu bytes, %s\n", (long long)t->numel,
                       (unsigned long long)t->nbytes, t->file);
  }
}

typedef struct model_ctx {
  char *path; /* the fixture directory or .gguf file */
  kiln_model_config_t cfg;
  kiln_weights_t *weights;
  /* kiln_model_load */
  const kiln_hal_plugin_t *plugin;
  kiln_hal_device_t *dev;
  kiln_hal_stream_t *stream;
  kiln_model_t *model;
  float *logits; /* [K_SCORE_N, vocab] */
  size_t n_logits;
} model_ctx_t;

static const int32_t k_score_ids[] = {1, 17, 42, 255, 319};
#define K_SCORE_N ((int32_t)(sizeof(k_score_ids) / sizeof(k_score_ids[0])))

static char *model_detach(kiln_strbuf_t *b) {
  assert_true(kiln_strbuf_ok(b));
  char *s = kiln_strbuf_detach(b, NULL);
  assert_non_null(s);
  return s;
}

static void model_teardown(void *p) {
  model_ctx_t *c = p;
  kiln_weights_free(c->weights);
  c->weights = NULL;
  kiln_model_free(c->model);
  c->model = NULL;
}

/* kiln_model_config_load: a pattern in the struct before each run, so that a run that returns
 * success without writing it cannot match. */
static void cfg_setup(void *p) {
  memset(&((model_ctx_t *)p)->cfg, 0xa5, sizeof(kiln_model_config_t));
}

static kiln_status_t cfg_run_load(void *p) {
  model_ctx_t *c = p;
  return kiln_model_config_load(c->path, &c->cfg);
}

/* On error the config's content is unspecified (a partly parsed one): only success shows it. */
static char *cfg_snapshot(void *p, bool ok) {
  model_ctx_t *c = p;
  if (!ok) return xstrdup("(no config)");
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  append_config(&b, &c->cfg);
  return model_detach(&b);
}

static kiln_status_t weights_run_open_dir(void *p) {
  model_ctx_t *c = p;
  return kiln_weights_open_dir(c->path, &c->weights);
}

static char *weights_snapshot(void *p, bool ok) {
  model_ctx_t *c = p;
  OOM_CHECK(ok || !c->weights, "the open failed and left *out_weights set");
  if (!c->weights) return xstrdup("(no weights)");
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  append_weights(&b, c->weights);
  return model_detach(&b);
}

static kiln_status_t gguf_run_open(void *p) {
  model_ctx_t *c = p;
  return kiln_gguf_open(c->path, &c->cfg, &c->weights);
}

static char *gguf_snapshot(void *p, bool ok) {
  model_ctx_t *c = p;
  OOM_CHECK(ok || !c->weights, "kiln_gguf_open failed and left *out_weights set");
  if (!c->weights) return xstrdup("(no weights)");
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  append_config(&b, &c->cfg);
  append_weights(&b, c->weights);
  return model_detach(&b);
}

/* kiln_model_load then kiln_model_score of k_score_ids. The logits start as NaNs (all bits set)
 * so that a success that wrote nothing cannot match. */
static void model_setup(void *p) {
  model_ctx_t *c = p;
  memset(c->logits, 0xff, c->n_logits * sizeof(float));
}

static kiln_status_t model_run_load_score(void *p) {
  model_ctx_t *c = p;
  kiln_model_options_t o = {
      .dtype = KILN_HAL_F32, .max_tokens = 8, .max_seqs = 1, .max_blocks_per_seq = 8};
  kiln_status_t st = kiln_model_load(c->path, &c->plugin->table, c->dev, c->stream, &o, &c->model);
  if (st) {
    OOM_CHECK(!c->model, "kiln_model_load failed and left *out_model set");
    return st;
  }
  OOM_CHECK((size_t)kiln_model_get_config(c->model)->vocab_size * K_SCORE_N == c->n_logits,
            "the model's vocabulary is not the fixture's");
  if ((size_t)kiln_model_get_config(c->model)->vocab_size * K_SCORE_N != c->n_logits)
    return kiln_status_make(KILN_ERR_INTERNAL, "wrong vocabulary size");
  return kiln_model_score(c->model, k_score_ids, K_SCORE_N, 0, 16, c->logits);
}

/* The config, the weight bytes and the logits, bit for bit. */
static char *model_snapshot(void *p, bool ok) {
  model_ctx_t *c = p;
  if (!ok) return xstrdup("(no model)");
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  append_config(&b, kiln_model_get_config(c->model));
  kiln_strbuf_printf(&b, "dtype %d, max_len %lld, %llu bytes of weights\nlogits ",
                     (int)kiln_model_dtype(c->model), (long long)kiln_model_max_len(c->model),
                     (unsigned long long)kiln_model_weight_bytes(c->model));
  append_hex(&b, c->logits, c->n_logits * sizeof(float));
  kiln_strbuf_append_char(&b, '\n');
  return model_detach(&b);
}

static void test_model_config(void **state) {
  (void)state;
  model_ctx_t c = {.path = fixture_path("qwen3")};
  if (!c.path) skip(); /* run through CTest, which sets KILN_SOURCE_DIR */
  oom_op_t op = {.name = "model_config_load",
                 .ctx = &c,
                 .setup = cfg_setup,
                 .run = cfg_run_load,
                 .snapshot = cfg_snapshot,
                 .teardown = model_teardown,
                 .transactional = false};
  oom_walk(&op);
  free(c.path);
  oom_assert_clean();
}

static void test_weights(void **state) {
  (void)state;
  model_ctx_t c = {.path = fixture_path("llama_sharded")};
  if (!c.path) skip();
  oom_op_t op = {.name = "weights_open_dir(sharded)",
                 .ctx = &c,
                 .run = weights_run_open_dir,
                 .snapshot = weights_snapshot,
                 .teardown = model_teardown,
                 .transactional = true};
  oom_walk(&op);
  free(c.path);
  oom_assert_clean();
}

static void test_gguf(void **state) {
  (void)state;
  model_ctx_t c = {.path = fixture_path("llama3_gguf/model.gguf")};
  if (!c.path) skip();
  oom_op_t op = {.name = "gguf_open",
                 .ctx = &c,
                 .setup = cfg_setup,
                 .run = gguf_run_open,
                 .snapshot = gguf_snapshot,
                 .teardown = model_teardown,
                 .transactional = true};
  oom_walk(&op);
  free(c.path);
  oom_assert_clean();
}

static void test_model(void **state) {
  (void)state;
  model_ctx_t c = {.path = fixture_path("llama2")};
  if (!c.path) skip();
  /* The cpu backend, found through KILN_BACKEND_PATH (set by CTest) as test_parity does. */
  kiln_hal_registry_t *reg = NULL;
  kiln_hal_registry_options_t o = {0};
  kiln_status_t st = kiln_hal_registry_create(&o, &reg);
  if (!st) st = kiln_hal_registry_open(reg, "cpu", &c.plugin);
  if (st) fail_msg("%s", kiln_status_message(st));
  const kiln_hal_backend_t *be = &c.plugin->table;
  assert_null(be->device_open(0, &c.dev));
  assert_null(be->stream_create(c.dev, &c.stream));
  kiln_model_config_t cfg;
  assert_null(kiln_model_config_load(c.path, &cfg));
  c.n_logits = (size_t)cfg.vocab_size * K_SCORE_N;
  c.logits = malloc(c.n_logits * sizeof(float));
  assert_non_null(c.logits);
  oom_op_t op = {.name = "model_load+score",
                 .ctx = &c,
                 .setup = model_setup,
                 .run = model_run_load_score,
                 .snapshot = model_snapshot,
                 .teardown = model_teardown,
                 .transactional = false};
  oom_walk(&op);
  free(c.logits);
  be->stream_destroy(c.stream);
  be->device_close(c.dev);
  kiln_hal_registry_free(reg);
  free(c.path);
  oom_assert_clean();
}

/* ---- the block manager and the scheduler ---------------------------------------------------- */

/* A few sequences through a small pool: a prompt with n = 2 (forked once computed, its shared
 * last block copied on write), a prompt sharing its first blocks (prefix cache hits), another
 * one, chunked prefill under a small budget, and preemption when the pool runs out. Tokens are
 * a function of (sequence, position), so the final tokens do not depend on the path (the
 * scheduler absorbs a failure to hash blocks for the prefix cache: fewer hits, same tokens).
 * A failed kiln_scheduler_schedule is retried once (the state it leaves must stay usable: the
 * engine schedules again at its next step); any other failure ends every sequence, after which
 * every block must be free. */

#define SCHED_NSEQ 4
#define SCHED_NEW 6 /* tokens generated per sequence */

typedef struct sched_ctx {
  kiln_kv_manager_t *kv;
  kiln_scheduler_t *s;
  kiln_seq_t seqs[SCHED_NSEQ]; /* 0: n = 2, 1: its fork, 2: shares 0's prefix, 3: other */
  bool added[SCHED_NSEQ];
  int32_t steps;
} sched_ctx_t;

static int32_t sched_token(int32_t seq, int32_t pos) { return 1 + (seq * 7 + pos * 3) % 50; }

static kiln_status_t sched_add_seq(sched_ctx_t *c, int32_t i, int32_t np, int32_t prefix_of0) {
  kiln_seq_t *q = &c->seqs[i];
  for (int32_t p = 0; p < np; p++) {
    kiln_status_t st = kiln_seq_append(q, p < prefix_of0 ? sched_token(0, p) : sched_token(i, p));
    if (st) return st;
  }
  q->num_prompt = np;
  q->owner = c;
  q->arrival = (uint64_t)i;
  kiln_scheduler_add(c->s, q);
  c->added[i] = true;
  return NULL;
}

/* Ends every sequence still in a queue. */
static void sched_end_all(sched_ctx_t *c) {
  for (int32_t i = 0; i < SCHED_NSEQ; i++)
    if (c->added[i] && c->seqs[i].state != KILN_SEQ_FINISHED) kiln_scheduler_finish(c->s, &c->seqs[i]);
}

static kiln_status_t sched_run(void *p) {
  sched_ctx_t *c = p;
  kiln_status_t st = kiln_kv_manager_create(10, 4, true, &c->kv);
  if (st) return st;
  kiln_sched_options_t o = {.max_num_seqs = 4, .max_num_batched_tokens = 12, .chunked_prefill = true};
  if ((st = kiln_scheduler_create(c->kv, &o, &c->s))) return st;
  if ((st = sched_add_seq(c, 0, 10, 0))) goto out;
  c->seqs[0].fork_n = 2;
  if ((st = sched_add_seq(c, 3, 6, 0))) goto out;
  for (c->steps = 0; c->steps < 200; c->steps++) {
    if (c->steps == 2 && (st = sched_add_seq(c, 2, 11, 8))) goto out;
    kiln_sched_step_t *step;
    st = kiln_scheduler_schedule(c->s, &step);
    if (st) { /* once more, as the engine's next step would */
      kiln_status_free(st);
      if ((st = kiln_scheduler_schedule(c->s, &step))) goto out;
    }
    if (!step->num_items) break;
    kiln_scheduler_update_computed(c->s, step);
    for (int32_t k = 0; k < step->num_items; k++) {
      const kiln_sched_item_t *it = &step->items[k];
      kiln_seq_t *q = it->seq;
      if (!it->sample) continue;
      int32_t which[2] = {(int32_t)(q - c->seqs), -1};
      if (q->fork_n > 1) { /* the prompt is computed: fork it, as the engine does */
        kiln_seq_t *child = &c->seqs[1];
        st = kiln_scheduler_fork(c->s, q, child);
        if (!st) {
          child->index = 1;
          kiln_scheduler_add_running_after(c->s, q, child);
          c->added[1] = true;
          which[1] = 1;
        }
        kiln_scheduler_fork_done(c->s, q, st ? 0 : 1);
        if (st) goto out;
      }
      for (int32_t j = 0; j < 2 && which[j] >= 0; j++) {
        kiln_seq_t *s = &c->seqs[which[j]];
        if ((st = kiln_seq_append(s, sched_token(which[j], s->num_tokens)))) goto out;
        if (s->num_tokens - s->num_prompt >= SCHED_NEW) kiln_scheduler_finish(c->s, s);
      }
    }
    kiln_status_t kst = kiln_kv_check(c->kv);
    OOM_CHECK(!kst, "step %d: %s", c->steps, kiln_status_message(kst));
    kiln_status_free(kst);
  }
out:
  sched_end_all(c);
  return st;
}

static char *sched_snapshot(void *p, bool ok) {
  sched_ctx_t *c = p;
  (void)ok;
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  if (c->kv) {
    kiln_status_t st = kiln_kv_check(c->kv);
    OOM_CHECK(!st, "after the run: %s", kiln_status_message(st));
    kiln_status_free(st);
    OOM_CHECK(kiln_kv_num_free(c->kv) == kiln_kv_num_blocks(c->kv),
              "after the run %d of %d blocks are free", kiln_kv_num_free(c->kv),
              kiln_kv_num_blocks(c->kv));
    for (int32_t i = 0; i < kiln_kv_num_blocks(c->kv); i++)
      OOM_CHECK(kiln_kv_refcount(c->kv, i) == 0, "block %d has ref %d after the run", i,
                kiln_kv_refcount(c->kv, i));
  }
  if (c->s) {
    OOM_CHECK(kiln_scheduler_num_running(c->s) == 0 && kiln_scheduler_num_waiting(c->s) == 0,
              "%d running and %d waiting after the run", kiln_scheduler_num_running(c->s),
              kiln_scheduler_num_waiting(c->s));
  }
  for (int32_t i = 0; i < SCHED_NSEQ; i++) {
    const kiln_seq_t *q = &c->seqs[i];
    kiln_strbuf_printf(&b, "seq %d: added %d, state %d, %d tokens (%d prompt):", i,
                       (int)c->added[i], (int)q->state, q->num_tokens, q->num_prompt);
    for (int32_t t = 0; t < q->num_tokens; t++) kiln_strbuf_printf(&b, " %d", q->tokens[t]);
    kiln_strbuf_append_char(&b, '\n');
  }
  assert_true(kiln_strbuf_ok(&b));
  char *s = kiln_strbuf_detach(&b, NULL);
  assert_non_null(s);
  return s;
}

static void sched_teardown(void *p) {
  sched_ctx_t *c = p;
  for (int32_t i = 0; i < SCHED_NSEQ; i++) kiln_seq_free(&c->seqs[i]);
  kiln_scheduler_free(c->s);
  kiln_kv_manager_free(c->kv);
  memset(c, 0, sizeof(*c));
}

/* ---- image decode + Qwen2-VL preprocessing (models/vision) ---------------------------------- */

typedef struct image_ctx {
  char *path;
  kiln_image_t img;
  kiln_image_patches_t patches;
} image_ctx_t;

static kiln_status_t image_run(void *p) {
  image_ctx_t *c = p;
  kiln_status_t st = kiln_image_load_file(c->path, NULL, &c->img);
  if (st) return st;
  kiln_vision_preproc_t pp;
  kiln_vision_preproc_default(&pp);
  return kiln_image_preprocess(&pp, &c->img, &c->patches);
}

static char *image_snapshot(void *p, bool ok) {
  image_ctx_t *c = p;
  if (!ok) {
    OOM_CHECK(!c->patches.pixels && c->patches.num_patches == 0,
              "preprocessing failed and left patches behind");
    if (c->img.rgb) return xstrdup("(decoded, no patches)");
    OOM_CHECK(c->img.width == 0 && c->img.height == 0, "the decode failed and left a size");
    return xstrdup("(no image)");
  }
  uint64_t h[2];
  kiln_image_hash(&c->img, h);
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  assert_true(kiln_strbuf_printf(
      &b, "%d x %d, hash %016llx%016llx, grid %d %d %d, %lld x %lld, ", c->img.width, c->img.height,
      (unsigned long long)h[1], (unsigned long long)h[0], c->patches.grid_t, c->patches.grid_h,
      c->patches.grid_w, (long long)c->patches.num_patches, (long long)c->patches.patch_dim));
  append_hex(&b, c->patches.pixels, sizeof(float) * 64);
  return model_detach(&b);
}

static void image_teardown(void *p) {
  image_ctx_t *c = p;
  kiln_image_free(&c->img);
  kiln_image_patches_free(&c->patches);
}

static void test_image(void **state) {
  (void)state;
  const char *src = getenv("KILN_SOURCE_DIR");
  if (!src) skip();
  static const char *files[] = {"rgb_odd.png", "interlaced.png", "landscape_prog.jpg",
                                "cmyk.jpg",    "lossy.webp",     "alpha_lossless.webp"};
  for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
    image_ctx_t c = {.path = kiln_strprintf("%s/tests/data/images/%s", src, files[i])};
    assert_non_null(c.path);
    char name[64];
    snprintf(name, sizeof name, "image %s", files[i]);
    oom_op_t op = {.name = name,
                   .ctx = &c,
                   .run = image_run,
                   .snapshot = image_snapshot,
                   .teardown = image_teardown,
                   .transactional = false};
    oom_walk(&op);
    free(c.path);
  }
  oom_assert_clean();
}

static void test_scheduler(void **state) {
  (void)state;
  sched_ctx_t c;
  memset(&c, 0, sizeof(c));
  oom_op_t op = {.name = "kv+scheduler",
                 .ctx = &c,
                 .run = sched_run,
                 .snapshot = sched_snapshot,
                 .teardown = sched_teardown,
                 .transactional = false};
  oom_walk(&op);
  oom_assert_clean();
}

/* ---- the engine ------------------------------------------------------------------------------ */

/* What a request delivered, recorded by its callback (which must not allocate: it runs armed). */
#define EV_MAX_TOKENS 32
typedef struct ev_log {
  int32_t tokens[2][EV_MAX_TOKENS];
  int32_t ntok[2];
  int32_t with_logprobs[2], with_top[2]; /* tokens that came with a logprob / 2 alternatives */
  int32_t finals[2];                     /* events with a finish reason, per sequence */
  kiln_finish_reason_t fin[2];
  int32_t events, request_finished, after_finished;
  kiln_finish_reason_t last_fin;
  char error[256];
  int32_t completion_tokens;
  bool bad_event;
} ev_log_t;

static void ev_log_record(ev_log_t *l, const kiln_output_t *o) {
  l->events++;
  if (l->request_finished) l->after_finished++;
  int32_t i = o->index;
  if (i < 0 || i > 1 || o->num_tokens < 0 || o->num_tokens > 1 || !o->text) {
    l->bad_event = true;
    return;
  }
  for (int32_t k = 0; k < o->num_tokens; k++) {
    if (l->ntok[i] < EV_MAX_TOKENS) l->tokens[i][l->ntok[i]] = o->token_ids[k];
    l->ntok[i]++;
    if (o->logprobs) l->with_logprobs[i]++;
    if (o->top_n == 2 && o->top_ids && o->top_logprobs) l->with_top[i]++;
  }
  if (o->finish_reason != KILN_FINISH_NONE) {
    l->finals[i]++;
    l->fin[i] = o->finish_reason;
  }
  if (o->request_finished) {
    l->request_finished++;
    l->last_fin = o->finish_reason;
    l->completion_tokens = o->usage.completion_tokens;
    if (o->error) snprintf(l->error, sizeof(l->error), "%s", o->error);
  }
}

static void ev_log_append(kiln_strbuf_t *b, const ev_log_t *l) {
  for (int32_t i = 0; i < 2; i++) {
    kiln_strbuf_printf(b, "seq %d: %d tokens (%d with logprobs, %d with top 2), finish %s:", i,
                       l->ntok[i], l->with_logprobs[i], l->with_top[i],
                       kiln_finish_reason_name(l->fin[i]) ? kiln_finish_reason_name(l->fin[i]) : "none");
    for (int32_t k = 0; k < l->ntok[i] && k < EV_MAX_TOKENS; k++)
      kiln_strbuf_printf(b, " %d", l->tokens[i][k]);
    kiln_strbuf_append_char(b, '\n');
  }
  kiln_strbuf_printf(b, "%d events, completion tokens %d\n", l->events, l->completion_tokens);
}

/* The promises every run keeps, whatever failed: one request_finished event, nothing after it,
 * at most one final event per sequence, and a message with an error. */
static void ev_log_check(const ev_log_t *l, bool submitted) {
  OOM_CHECK(!l->bad_event, "a malformed event");
  if (!submitted) {
    OOM_CHECK(l->events == 0, "%d events for a request that was not accepted", l->events);
    return;
  }
  OOM_CHECK(l->request_finished == 1, "%d request_finished events", l->request_finished);
  OOM_CHECK(l->after_finished == 0, "%d events after the request_finished one", l->after_finished);
  for (int32_t i = 0; i < 2; i++)
    OOM_CHECK(l->finals[i] <= 1, "sequence %d got %d final events", i, l->finals[i]);
  OOM_CHECK(l->last_fin != KILN_FINISH_ERROR || l->error[0], "an error event without a message");
}

/* The fake model of test_engine_sim.c, reduced: the key of token p hashes its token with the
 * key of token p - 1 read back through the block table; logits are a function of the key. */
#define FAKE_V 48
#define FAKE_NB 8
#define FAKE_BS 8
#define FAKE_TOKENS 32
#define FAKE_ROWS 8

static uint64_t fake_mix(uint64_t a, uint64_t b) {
  uint64_t z = a * 0x9e3779b97f4a7c15ull + b + 0x632be59bd9b4e019ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

typedef struct fake_model {
  uint64_t cache[FAKE_NB * FAKE_BS];
  uint64_t keys[FAKE_TOKENS];
  float logits[FAKE_ROWS * FAKE_V];
  int32_t destroyed;
} fake_model_t;

static kiln_status_t fake_forward(void *ctx, const kiln_batch_t *b) {
  fake_model_t *f = ctx;
  if (b->num_tokens > FAKE_TOKENS || b->num_logits > FAKE_ROWS)
    return kiln_status_make(KILN_ERR_INTERNAL, "fake: batch too big");
  for (int32_t s = 0; s < b->num_seqs; s++) {
    const int32_t *bt = b->block_tables + (size_t)s * b->max_blocks_per_seq;
    for (int32_t t = b->query_start_loc[s]; t < b->query_start_loc[s + 1]; t++) {
      int32_t p = b->positions[t];
      uint64_t prev = p > 0 ? f->cache[bt[(p - 1) / FAKE_BS] * FAKE_BS + (p - 1) % FAKE_BS] : 0x1234;
      uint64_t h = fake_mix(prev, (uint64_t)b->token_ids[t]);
      f->cache[b->slot_mapping[t]] = h;
      f->keys[t] = h;
    }
  }
  for (int32_t r = 0; r < b->num_logits; r++)
    for (int32_t v = 0; v < FAKE_V; v++) {
      uint64_t z = fake_mix(f->keys[b->logits_rows[r]], (uint64_t)v + 1000);
      f->logits[r * FAKE_V + v] = (float)((double)(z >> 11) * (1.0 / 9007199254740992.0) * 8.0 - 4.0);
    }
  return NULL;
}

static kiln_status_t fake_copy(void *ctx, const int32_t *src, const int32_t *dst, int32_t n) {
  fake_model_t *f = ctx;
  for (int32_t i = 0; i < n; i++)
    memcpy(f->cache + dst[i] * FAKE_BS, f->cache + src[i] * FAKE_BS, FAKE_BS * sizeof(uint64_t));
  return NULL;
}

static void fake_logits(void *ctx, int32_t rows, kiln_sample_logits_t *out) {
  fake_model_t *f = ctx;
  memset(out, 0, sizeof(*out));
  out->host = f->logits;
  out->num_rows = rows;
}

static void fake_destroy(void *ctx) { ((fake_model_t *)ctx)->destroyed++; }

typedef struct engine_ctx {
  kiln_config_t *cfg;
  const char *const *overrides; /* the config walk: kiln_engine_create's overrides */
  int32_t num_overrides;
  bool release_early; /* give up the request handle right after submitting */
  int32_t cancel_after; /* cancel and release the request after this many steps (-1: never) */
  int32_t stop_token; /* one that sequence 1 samples early, so that it ends first */
  fake_model_t fake;
  bool created, submitted;
  ev_log_t log;
  /* the config walk: events arrive on the engine thread */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  bool timed_out;
  bool poll; /* the config walk: take the events with kiln_request_poll, not a callback */
} engine_ctx_t;

static const int32_t k_eng_prompt[] = {3, 14, 15, 9, 26};
static const int32_t k_eng_bias_ids[] = {5};
static const float k_eng_bias_values[] = {1.5f};

static void engine_params(kiln_sampling_params_t *sp, const int32_t *stop) {
  kiln_sampling_params_init(sp);
  sp->n = 2;
  sp->max_tokens = 4;
  sp->temperature = 0.8f;
  sp->has_seed = true;
  sp->seed = 12345;
  sp->logprobs = 2;
  sp->stop_token_ids = stop;
  sp->num_stop_token_ids = 1;
  /* A logit bias: every step's sampling rows then take scratch from the engine's arena. */
  sp->logit_bias_ids = k_eng_bias_ids;
  sp->logit_bias_values = k_eng_bias_values;
  sp->num_logit_bias = 1;
}

static void engine_setup(void *p) {
  engine_ctx_t *c = p;
  memset(&c->fake, 0, sizeof(c->fake));
  memset(&c->log, 0, sizeof(c->log));
  c->created = c->submitted = c->timed_out = false;
}

static void engine_on_output(void *user, const kiln_output_t *o) {
  engine_ctx_t *c = user;
  ev_log_record(&c->log, o);
}

/* kiln_engine_create_setup around the fake model, manual stepping, one request, destroy. A
 * request ending with an error becomes this run's OUT_OF_MEMORY. */
static kiln_status_t engine_run_manual(void *p) {
  engine_ctx_t *c = p;
  kiln_engine_setup_t su;
  memset(&su, 0, sizeof(su));
  su.config = c->cfg;
  su.runner = (kiln_runner_t){.ctx = &c->fake, .vocab_size = FAKE_V,
                              .max_model_len = FAKE_NB * FAKE_BS, .max_logits = FAKE_ROWS,
                              .forward = fake_forward, .copy_blocks = fake_copy,
                              .logits = fake_logits, .destroy = fake_destroy};
  su.num_blocks = FAKE_NB;
  int32_t eos = 0;
  su.eos_ids = &eos;
  su.num_eos = 1;
  su.manual = true;
  kiln_engine_t *eng = (kiln_engine_t *)&su; /* must be reset */
  kiln_status_t st = kiln_engine_create_setup(&su, &eng);
  if (st) {
    OOM_CHECK(!eng, "kiln_engine_create_setup failed and left *out set");
    OOM_CHECK(c->fake.destroyed == 1, "kiln_engine_create_setup failed and destroyed the runner "
              "%d times (it owns it: once)", c->fake.destroyed);
    return st;
  }
  c->created = true;
  kiln_sampling_params_t sp;
  engine_params(&sp, &c->stop_token);
  kiln_request_desc_t d = {.struct_size = sizeof(d), .prompt_ids = k_eng_prompt,
                           .num_prompt_ids = (int32_t)(sizeof(k_eng_prompt) / sizeof(int32_t)),
                           .params = &sp, .on_output = engine_on_output, .user = c};
  kiln_request_t *req = NULL;
  st = kiln_engine_submit(eng, &d, &req);
  OOM_CHECK(!st || !req, "kiln_engine_submit failed and left *out set");
  if (!st) {
    c->submitted = true;
    if (c->release_early) {
      kiln_request_release(req);
      req = NULL;
    }
    for (int32_t i = 0; i < 100 && !c->log.request_finished && !st; i++) {
      if (i == c->cancel_after && req) {
        kiln_request_cancel(req);
        kiln_request_release(req);
        req = NULL;
      }
      bool idle = false;
      st = kiln_engine_step(eng, &idle);
    }
    OOM_CHECK(st || c->log.request_finished, "the request did not finish in 100 steps");
    if (c->log.request_finished) {
      /* Finished (or failed): every block is back. */
      kiln_kv_manager_t *kv = kiln_engine_kv(eng);
      kiln_status_t kst = kiln_kv_check(kv);
      OOM_CHECK(!kst, "after the request: %s", kiln_status_message(kst));
      kiln_status_free(kst);
      OOM_CHECK(kiln_kv_num_free(kv) == kiln_kv_num_blocks(kv),
                "after the request %d of %d blocks are free", kiln_kv_num_free(kv),
                kiln_kv_num_blocks(kv));
    }
  }
  kiln_request_release(req);
  kiln_engine_destroy(eng); /* ends a request a failed step left unfinished */
  OOM_CHECK(c->fake.destroyed == 1, "the runner was destroyed %d times", c->fake.destroyed);
  if (!st && c->log.last_fin == KILN_FINISH_ERROR)
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "the request ended with an error: %s",
                          c->log.error);
  return st;
}

static char *engine_snapshot(void *p, bool ok) {
  engine_ctx_t *c = p;
  ev_log_check(&c->log, c->submitted);
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  if (ok) ev_log_append(&b, &c->log);
  else kiln_strbuf_append(&b, "(failed)", 8);
  assert_true(kiln_strbuf_ok(&b));
  char *s = kiln_strbuf_detach(&b, NULL);
  assert_non_null(s);
  return s;
}

static void engine_config(kiln_config_t **cfg) {
  assert_null(kiln_config_create(cfg));
  static const char *const sets[] = {"cache.block_size=8", "engine.max_num_seqs=4",
                                     "engine.max_num_batched_tokens=32",
                                     "cache.enable_prefix_caching=true"};
  for (size_t i = 0; i < sizeof(sets) / sizeof(sets[0]); i++) assert_null(kiln_config_set(*cfg, sets[i]));
}

static void test_engine_manual(void **state) {
  (void)state;
  engine_ctx_t c;
  memset(&c, 0, sizeof(c));
  engine_config(&c.cfg);
  c.stop_token = 33;
  static const char *const names[] = {"engine(manual)", "engine(manual, released)",
                                      "engine(manual, cancelled)"};
  for (int i = 0; i < 3; i++) {
    c.release_early = i == 1;
    c.cancel_after = i == 2 ? 2 : -1;
    oom_op_t op = {.name = names[i],
                   .ctx = &c,
                   .setup = engine_setup,
                   .run = engine_run_manual,
                   .snapshot = engine_snapshot,
                   .transactional = false};
    oom_walk(&op);
  }
  kiln_config_free(c.cfg);
  oom_assert_clean();
}

static void engine_on_output_locked(void *user, const kiln_output_t *o) {
  engine_ctx_t *c = user;
  pthread_mutex_lock(&c->mu);
  ev_log_record(&c->log, o);
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
}

/* kiln_engine_create from overrides on the cpu plugin with the fixture model (the engine
 * thread runs the steps), one request, wait for its end, destroy. The engine thread allocates
 * while this thread waits, so the allocation counter still sees one thread at a time. */
static kiln_status_t engine_run_config(void *p) {
  engine_ctx_t *c = p;
  kiln_engine_t *eng = (kiln_engine_t *)c; /* must be reset */
  kiln_status_t st = kiln_engine_create(NULL, c->overrides, c->num_overrides, &eng);
  if (st) {
    OOM_CHECK(!eng, "kiln_engine_create failed and left *out set");
    return st;
  }
  c->created = true;
  kiln_sampling_params_t sp;
  engine_params(&sp, &c->stop_token);
  sp.num_logit_bias = 0;
  kiln_request_desc_t d = {.struct_size = sizeof(d), .prompt_ids = k_eng_prompt,
                           .num_prompt_ids = (int32_t)(sizeof(k_eng_prompt) / sizeof(int32_t)),
                           .params = &sp, .on_output = engine_on_output_locked, .user = c};
  if (c->poll) d.on_output = NULL;
  kiln_request_t *req = NULL;
  st = kiln_engine_submit(eng, &d, &req);
  OOM_CHECK(!st || !req, "kiln_engine_submit failed and left *out set");
  if (!st && c->poll) {
    /* Poll mode: the final event must arrive even when no event can be allocated then. */
    c->submitted = true;
    for (;;) {
      kiln_output_t *o = NULL;
      kiln_status_t pst = kiln_request_poll(req, 60000, &o);
      OOM_CHECK(!pst, "kiln_request_poll failed");
      kiln_status_free(pst);
      if (!o) {
        c->timed_out = true;
        break;
      }
      ev_log_record(&c->log, o);
      bool last = o->request_finished;
      kiln_output_free(o);
      if (last) break;
    }
    OOM_CHECK(!c->timed_out, "poll: no final event within 60 s");
  } else if (!st) {
    c->submitted = true;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 60;
    pthread_mutex_lock(&c->mu);
    while (!c->log.request_finished && !c->timed_out)
      if (pthread_cond_timedwait(&c->cv, &c->mu, &ts) != 0) c->timed_out = true;
    pthread_mutex_unlock(&c->mu);
    OOM_CHECK(!c->timed_out, "the request did not finish within 60 s");
  }
  kiln_request_release(req);
  kiln_engine_destroy(eng);
  if (!st && c->log.last_fin == KILN_FINISH_ERROR)
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "the request ended with an error: %s",
                          c->log.error);
  return st;
}

static void engine_config_walk(bool poll) {
  char *path = fixture_path("llama2");
  if (!path) skip();
  char *model = kiln_strprintf("model.path=%s", path);
  assert_non_null(model);
  const char *const overrides[] = {model, "backend.name=cpu", "cache.num_blocks=64",
                                   "engine.max_num_seqs=4", "engine.max_num_batched_tokens=64"};
  engine_ctx_t c;
  memset(&c, 0, sizeof(c));
  c.overrides = overrides;
  c.poll = poll;
  c.stop_token = 221;
  c.num_overrides = (int32_t)(sizeof(overrides) / sizeof(overrides[0]));
  pthread_mutex_init(&c.mu, NULL);
  pthread_cond_init(&c.cv, NULL);
  oom_op_t op = {.name = poll ? "engine(config, cpu, poll)" : "engine(config, cpu)",
                 .ctx = &c,
                 .setup = engine_setup,
                 .run = engine_run_config,
                 .snapshot = engine_snapshot,
                 .transactional = false};
  oom_walk(&op);
  pthread_mutex_destroy(&c.mu);
  pthread_cond_destroy(&c.cv);
  free(model);
  free(path);
  oom_assert_clean();
}

static void test_engine_config(void **state) {
  (void)state;
  engine_config_walk(false);
}

static void test_engine_config_poll(void **state) {
  (void)state;
  engine_config_walk(true);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_config_create),
      cmocka_unit_test(test_config_load),
      cmocka_unit_test(test_config_set),
      cmocka_unit_test(test_json_parse),
      cmocka_unit_test(test_json_write),
      cmocka_unit_test(test_strbuf),
      cmocka_unit_test(test_tokenizer_load),
      cmocka_unit_test(test_tokenizer_encode),
      cmocka_unit_test(test_tokenizer_decode),
      cmocka_unit_test(test_template),
      cmocka_unit_test(test_loader),
      cmocka_unit_test(test_model_config),
      cmocka_unit_test(test_weights),
      cmocka_unit_test(test_gguf),
      cmocka_unit_test(test_model),
      cmocka_unit_test(test_image),
      cmocka_unit_test(test_scheduler),
      cmocka_unit_test(test_engine_manual),
      cmocka_unit_test(test_engine_config),
      cmocka_unit_test(test_engine_config_poll),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
