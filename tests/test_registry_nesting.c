/* test_registry_nesting.c - one plugin life cycle per process (hal.h, LIFETIME): several
 * registries opening the same plugin file share one init() and one shutdown(), at the last
 * release, whichever registry is freed first; the host pointer, its ctx and the config strings a
 * plugin kept from init stay valid until its shutdown (run under ASan: build-*-asan); a wrapper's
 * table from load_backend() outlives the registry that loaded it, and the wrapper is shut down
 * before what it wraps across registries; registries from several threads at once.
 *
 * The fake plugins (tests/plugins/fake_backend.c, FAKE_COUNT_INIT) append their life cycle to
 * the file named by [plugin.<name>] counts_file: "<name> init|shutdown|touch ...". device_count
 * "touches" the plugin: it logs and reads config through the host pointer kept since init and
 * prints the greeting it read then (kept=) and now. */
#define _GNU_SOURCE
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "base/config.h"
#include "hal/loader.h"
#include "kiln/hal_util.h"

/* ---- a scenario: a directory of plugins and a counts file ------------------------------------ */

typedef struct scenario {
  char dir[256];
  char counts[300];
} scenario_t;

static void scenario_init(scenario_t *s) {
  memset(s, 0, sizeof(*s));
  snprintf(s->dir, sizeof(s->dir), "/tmp/kiln-nesting-XXXXXX");
  assert_non_null(mkdtemp(s->dir));
  snprintf(s->counts, sizeof(s->counts), "%s/counts.txt", s->dir);
}

/* Links fake variant `variant` (libfake-<variant>.so) or an absolute path in as `file`. */
static void scenario_add(scenario_t *s, const char *variant, const char *file) {
  char src[512], dst[600];
  if (variant[0] == '/') {
    snprintf(src, sizeof(src), "%s", variant);
  } else {
    const char *d = getenv("KILN_FAKE_PLUGIN_DIR");
    assert_non_null(d);
    snprintf(src, sizeof(src), "%s/libfake-%s.so", d, variant);
  }
  snprintf(dst, sizeof(dst), "%s/%s", s->dir, file);
  assert_int_equal(symlink(src, dst), 0);
}

static void scenario_add_cpu(scenario_t *s) {
  const char *b = getenv("KILN_BUILD_DIR");
  assert_non_null(b);
  char src[512];
  snprintf(src, sizeof(src), "%s/lib/kiln/libkiln-backend-cpu.so", b);
  scenario_add(s, src, "libkiln-backend-cpu.so");
}

static void scenario_free(scenario_t *s) {
  char cmd[300];
  snprintf(cmd, sizeof(cmd), "rm -rf '%s'", s->dir);
  assert_int_equal(system(cmd), 0);
}

/* The counts file (malloc'ed; "" when absent). */
static char *counts_read(const scenario_t *s) {
  FILE *f = fopen(s->counts, "r");
  if (!f) return strdup("");
  char *buf = NULL;
  size_t len = 0;
  FILE *m = open_memstream(&buf, &len);
  assert_non_null(m);
  char chunk[4096];
  size_t n;
  while ((n = fread(chunk, 1, sizeof(chunk), f)) > 0) fwrite(chunk, 1, n, m);
  fclose(f);
  fclose(m);
  return buf;
}

/* Lines of the counts file that start with prefix. */
static int counts_lines(const scenario_t *s, const char *prefix) {
  char *text = counts_read(s);
  int n = 0;
  size_t pl = strlen(prefix);
  for (char *line = text; line && *line;) {
    if (strncmp(line, prefix, pl) == 0) n++;
    char *nl = strchr(line, '\n');
    line = nl ? nl + 1 : NULL;
  }
  free(text);
  return n;
}

/* The last line starting with prefix (malloc'ed), or NULL. */
static char *counts_last(const scenario_t *s, const char *prefix) {
  char *text = counts_read(s), *last = NULL;
  size_t pl = strlen(prefix);
  for (char *line = text; line && *line;) {
    char *nl = strchr(line, '\n');
    if (strncmp(line, prefix, pl) == 0) {
      free(last);
      last = nl ? strndup(line, (size_t)(nl - line)) : strdup(line);
    }
    line = nl ? nl + 1 : NULL;
  }
  free(text);
  return last;
}

#define assert_contains(hay, needle)                                        \
  do {                                                                      \
    const char *h_ = (hay);                                                 \
    if (!h_ || !strstr(h_, (needle)))                                       \
      fail_msg("'%s' does not contain '%s'", h_ ? h_ : "(null)", (needle)); \
  } while (0)

static void assert_last_contains(const scenario_t *s, const char *prefix, const char *needle) {
  char *line = counts_last(s, prefix);
  assert_contains(line, needle);
  free(line);
}

/* ---- a config per registry: heap strings, freed (and so poisoned under ASan) on demand ------ */

typedef struct test_config {
  char *counts_file;
  char *greeting;
} test_config_t;

static test_config_t *config_new(const scenario_t *s, const char *greeting) {
  test_config_t *c = calloc(1, sizeof(*c));
  assert_non_null(c);
  c->counts_file = strdup(s->counts);
  c->greeting = strdup(greeting);
  assert_true(c->counts_file && c->greeting);
  return c;
}

static void config_free(test_config_t *c) {
  if (!c) return;
  free(c->counts_file);
  free(c->greeting);
  free(c);
}

/* The same section for every plugin: counts_file, greeting, and extra = 1. */
static const char *cfg_get(void *ctx, const char *plugin, const char *key) {
  (void)plugin;
  test_config_t *c = ctx;
  if (strcmp(key, "counts_file") == 0) return c->counts_file;
  if (strcmp(key, "greeting") == 0) return c->greeting;
  if (strcmp(key, "extra") == 0) return "1";
  return NULL;
}

static const char *cfg_key(void *ctx, const char *plugin, int32_t index) {
  (void)ctx;
  (void)plugin;
  static const char *const keys[] = {"counts_file", "greeting", "extra"};
  return index >= 0 && index < 3 ? keys[index] : NULL;
}

/* A registry over s->dir with config c; lazy = no config_key in the options. */
static kiln_hal_registry_t *registry_new(const scenario_t *s, test_config_t *c, bool lazy) {
  kiln_hal_registry_options_t o = {0};
  o.config_path = s->dir;
  o.skip_env = true;
  o.skip_default_dirs = true;
  o.num_threads = 1;
  o.config_get = cfg_get;
  o.config_key = lazy ? NULL : cfg_key;
  o.config_ctx = c;
  kiln_hal_registry_t *r = NULL;
  kiln_status_t st = kiln_hal_registry_create(&o, &r);
  if (st) fail_msg("registry: %s", kiln_status_message(st));
  return r;
}

static const kiln_hal_plugin_t *open_ok(kiln_hal_registry_t *r, const char *name) {
  const kiln_hal_plugin_t *p = NULL;
  kiln_status_t st = kiln_hal_registry_open(r, name, &p);
  if (st) fail_msg("open %s: %s", name, kiln_status_message(st));
  assert_int_equal(p->state, KILN_HAL_PLUGIN_OPEN);
  return p;
}

/* device_count of a counting plugin: it logs and reads config through its kept host. */
static void touch(const kiln_hal_plugin_t *p) {
  int32_t n = 0;
  kiln_hal_error_t *err = p->table.device_count(&n);
  if (err) fail_msg("device_count: %s", err->message);
  assert_int_equal(n, 1);
}

/* ---- tests ------------------------------------------------------------------------------------
 */

/* Two registries open one plugin: one init; shutdown only when the second is freed. The first
 * registry (and its config) goes first: the plugin's kept host and strings still work. */
static void test_two_registries_one_init(void **state) {
  (void)state;
  scenario_t s;
  scenario_init(&s);
  scenario_add(&s, "counter", "libkiln-backend-counter.so");
  test_config_t *ca = config_new(&s, "from-A"), *cb = config_new(&s, "from-B");
  kiln_hal_registry_t *ra = registry_new(&s, ca, false), *rb = registry_new(&s, cb, false);
  const kiln_hal_plugin_t *pa = open_ok(ra, "counter");
  assert_int_equal(counts_lines(&s, "counter init "), 1);
  const kiln_hal_plugin_t *pb = open_ok(rb, "counter");
  assert_non_null(pb);
  assert_int_equal(counts_lines(&s, "counter init "), 1); /* shared, not initialised again */
  assert_int_equal(counts_lines(&s, "counter shutdown "), 0);
  char host_size[32];
  snprintf(host_size, sizeof(host_size), "host_size=%zu", sizeof(kiln_hal_host_t));
  assert_last_contains(&s, "counter init ", host_size);
  touch(pa);
  assert_last_contains(&s, "counter touch ",
                       "greeting=from-A kept=from-A keys=counts_file,greeting,extra");

  kiln_hal_registry_free(ra); /* the first opener goes first */
  assert_int_equal(counts_lines(&s, "counter shutdown "), 0);
  config_free(ca); /* and its config: the plugin's strings are the host's copies */
  touch(pb);       /* log + config_get + config_key through the host kept since init */
  assert_last_contains(&s, "counter touch ",
                       "greeting=from-A kept=from-A keys=counts_file,greeting,extra");
  kiln_hal_registry_free(rb);
  assert_int_equal(counts_lines(&s, "counter init "), 1);
  assert_int_equal(counts_lines(&s, "counter shutdown "), 1);

  /* After the shutdown, a new registry initialises it afresh (never nested). */
  kiln_hal_registry_t *rc = registry_new(&s, cb, false);
  touch(open_ok(rc, "counter"));
  assert_last_contains(&s, "counter touch ", "greeting=from-B kept=from-B");
  kiln_hal_registry_free(rc);
  assert_int_equal(counts_lines(&s, "counter init "), 2);
  assert_int_equal(counts_lines(&s, "counter shutdown "), 2);
  assert_int_equal(counts_lines(&s, "counter init inits=2 shutdowns=1 "), 1);
  char *all = counts_read(&s);
  if (strstr(all, "NESTED") || strstr(all, "NOT-INITIALISED")) fail_msg("%s", all);
  free(all);
  config_free(cb);
  scenario_free(&s);
}

/* The same, the second registry freed first; and a registry that only scanned the plugin (never
 * opened it) takes no part. */
static void test_second_registry_freed_first(void **state) {
  (void)state;
  scenario_t s;
  scenario_init(&s);
  scenario_add(&s, "counter", "libkiln-backend-counter.so");
  test_config_t *ca = config_new(&s, "from-A"), *cb = config_new(&s, "from-B");
  kiln_hal_registry_t *ra = registry_new(&s, ca, false), *rb = registry_new(&s, cb, false);
  kiln_hal_registry_t *scan_only = registry_new(&s, cb, false);
  const kiln_hal_plugin_t *pa = open_ok(ra, "counter");
  open_ok(rb, "counter");
  kiln_hal_registry_free(scan_only);
  kiln_hal_registry_free(rb);
  assert_int_equal(counts_lines(&s, "counter shutdown "), 0);
  touch(pa);
  assert_last_contains(&s, "counter touch ", "greeting=from-A");
  kiln_hal_registry_free(ra);
  assert_int_equal(counts_lines(&s, "counter init "), 1);
  assert_int_equal(counts_lines(&s, "counter shutdown "), 1);
  config_free(ca);
  config_free(cb);
  scenario_free(&s);
}

/* Options without config_key: the host offers no config_key, and copies each value when first
 * read, from the first opener; the copy outlives that registry and its config. */
static void test_lazy_config_outlives_first_registry(void **state) {
  (void)state;
  scenario_t s;
  scenario_init(&s);
  scenario_add(&s, "counter", "libkiln-backend-counter.so");
  test_config_t *ca = config_new(&s, "lazy-A"), *cb = config_new(&s, "lazy-B");
  kiln_hal_registry_t *ra = registry_new(&s, ca, true), *rb = registry_new(&s, cb, true);
  open_ok(ra, "counter");
  const kiln_hal_plugin_t *pb = open_ok(rb, "counter");
  kiln_hal_registry_free(ra);
  config_free(ca);
  touch(pb);
  assert_last_contains(&s, "counter touch ", "greeting=lazy-A kept=lazy-A keys=(no config_key)");
  kiln_hal_registry_free(rb);
  assert_int_equal(counts_lines(&s, "counter init "), 1);
  assert_int_equal(counts_lines(&s, "counter shutdown "), 1);
  config_free(cb);
  scenario_free(&s);
}

/* A counting wrapper over a counting "cpu": the wrapped backend lives as long as the wrapper,
 * and shuts down after it, across registries, whichever order they are freed in. */
static void test_wrapper_shuts_down_first_across_registries(void **state) {
  (void)state;
  scenario_t s;
  scenario_init(&s);
  scenario_add(&s, "countwrap", "libkiln-backend-countwrap.so");
  scenario_add(&s, "countcpu", "libkiln-backend-cpu.so");
  test_config_t *c = config_new(&s, "wrapped");
  kiln_hal_registry_t *ra = registry_new(&s, c, false), *rb = registry_new(&s, c, false);
  open_ok(ra, "countwrap"); /* loads cpu in ra */
  assert_int_equal(counts_lines(&s, "cpu init "), 1);
  assert_int_equal(counts_lines(&s, "countwrap init "), 1);
  const kiln_hal_plugin_t *wb = open_ok(rb, "countwrap");
  /* rb opens cpu itself, after the wrapper: its own reverse order would release cpu first. */
  const kiln_hal_plugin_t *cb = open_ok(rb, "cpu");
  assert_int_equal(counts_lines(&s, "cpu init "), 1);
  kiln_hal_registry_free(ra); /* the registry that loaded cpu for the wrapper */
  assert_int_equal(counts_lines(&s, "cpu shutdown "), 0);
  assert_int_equal(counts_lines(&s, "countwrap shutdown "), 0);
  touch(wb); /* the wrapper's touch, then the wrapped table's device_count (cpu's touch) */
  assert_last_contains(&s, "cpu touch ", "greeting=wrapped");
  touch(cb);
  kiln_hal_registry_free(rb);
  char *all = counts_read(&s);
  char *w = strstr(all, "countwrap shutdown "), *k = strstr(all, "cpu shutdown ");
  if (!w || !k || w > k) fail_msg("the wrapper must shut down before cpu:\n%s", all);
  assert_int_equal(counts_lines(&s, "cpu shutdown "), 1);
  assert_int_equal(counts_lines(&s, "countwrap shutdown "), 1);
  free(all);
  config_free(c);
  scenario_free(&s);
}

/* The FAKE_WRAP_CPU fake GPU over the real cpu backend: after the registry that loaded it (and
 * cpu) is freed, the wrapper, open in another registry, still runs a GEMM on cpu through the
 * table load_backend gave it. */
static void test_wrapper_table_outlives_loading_registry(void **state) {
  (void)state;
  scenario_t s;
  scenario_init(&s);
  scenario_add(&s, "gpuwrap", "libkiln-backend-fakegpu.so");
  scenario_add_cpu(&s);
  test_config_t *c = config_new(&s, "real");
  kiln_hal_registry_t *ra = registry_new(&s, c, false), *rb = registry_new(&s, c, false);
  open_ok(ra, "fakegpu");
  const kiln_hal_plugin_t *p = open_ok(rb, "fakegpu");
  kiln_hal_registry_free(ra);
  const kiln_hal_backend_t *t = &p->table;
  kiln_hal_device_t *dev = NULL;
  kiln_hal_stream_t *stream = NULL;
  kiln_hal_buffer_t *ba = NULL, *bb = NULL, *bc = NULL;
  assert_null(t->device_open(0, &dev));
  assert_null(t->stream_create(dev, &stream));
  const float a[4] = {1, 2, 3, 4}, b[4] = {5, 6, 7, 8};
  float out[4] = {0};
  assert_null(t->buffer_alloc(dev, sizeof(a), 0, &ba));
  assert_null(t->buffer_alloc(dev, sizeof(b), 0, &bb));
  assert_null(t->buffer_alloc(dev, sizeof(out), 0, &bc));
  assert_null(t->copy_h2d(stream, ba, 0, a, sizeof(a)));
  assert_null(t->copy_h2d(stream, bb, 0, b, sizeof(b)));
  kiln_hal_gemm_args_t g;
  memset(&g, 0, sizeof(g));
  g.struct_size = sizeof(g);
  kiln_hal_tensor_t *ts[3] = {&g.a, &g.b, &g.c};
  kiln_hal_buffer_t *bufs[3] = {ba, bb, bc};
  for (int i = 0; i < 3; i++) {
    ts[i]->buffer = bufs[i];
    ts[i]->dtype = KILN_HAL_F32;
    ts[i]->ndim = 2;
    ts[i]->shape[0] = ts[i]->shape[1] = 2;
    ts[i]->stride[0] = 2;
    ts[i]->stride[1] = 1;
  }
  g.alpha = 1.0f;
  kiln_hal_error_t *err = t->gemm(stream, &g);
  if (err) fail_msg("gemm: %s", err->message);
  assert_null(t->copy_d2h(stream, out, bc, 0, sizeof(out)));
  assert_null(t->stream_sync(stream));
  assert_true(out[0] == 19 && out[1] == 22 && out[2] == 43 && out[3] == 50);
  t->buffer_free(ba);
  t->buffer_free(bb);
  t->buffer_free(bc);
  t->stream_destroy(stream);
  t->device_close(dev);
  kiln_hal_registry_free(rb);
  config_free(c);
  scenario_free(&s);
}

/* A kiln_config_t behind the options, wired as tools/cli.c and the engine wire it
 * (kiln_config_get_raw + kiln_config_section_key): the plugin lists exactly its own section's
 * keys, in the order they were first set, and keeps its copies after the config is freed. */
static const char *kcfg_get(void *ctx, const char *plugin, const char *key) {
  char section[160];
  snprintf(section, sizeof(section), "plugin.%s", plugin);
  return kiln_config_get_raw(ctx, section, key);
}

static const char *kcfg_key(void *ctx, const char *plugin, int32_t index) {
  char section[160];
  snprintf(section, sizeof(section), "plugin.%s", plugin);
  return index < 0 ? NULL : kiln_config_section_key(ctx, section, (size_t)index);
}

static void test_kiln_config_keys(void **state) {
  (void)state;
  scenario_t s;
  scenario_init(&s);
  scenario_add(&s, "counter", "libkiln-backend-counter.so");
  kiln_config_t *cfg = NULL;
  assert_null(kiln_config_create(&cfg));
  char *ini = NULL;
  assert_true(asprintf(&ini,
                       "[plugin.counter]\ngreeting = from-ini\nzeta = 1\n[plugin.other]\n"
                       "alpha = 2\n[plugin.counter]\ncounts_file = %s\n",
                       s.counts) > 0);
  kiln_status_t st = kiln_config_load_string(cfg, ini, "test.ini");
  if (st) fail_msg("%s", kiln_status_message(st));
  free(ini);
  assert_null(kiln_config_set(cfg, "plugin.counter.greeting=from-set")); /* replaces, same place */
  assert_string_equal(kiln_config_section_key(cfg, "plugin.counter", 0), "greeting");
  assert_string_equal(kiln_config_section_key(cfg, "plugin.counter", 2), "counts_file");
  assert_null(kiln_config_section_key(cfg, "plugin.counter", 3));
  assert_string_equal(kiln_config_section_key(cfg, "plugin.other", 0), "alpha");
  assert_null(kiln_config_section_key(cfg, "plugin.none", 0));
  assert_null(kiln_config_section_key(cfg, "backend", 0));
  kiln_hal_registry_options_t o = {0};
  o.config_path = s.dir;
  o.skip_env = o.skip_default_dirs = true;
  o.config_get = kcfg_get;
  o.config_key = kcfg_key;
  o.config_ctx = cfg;
  kiln_hal_registry_t *ra = NULL, *rb = NULL;
  assert_null(kiln_hal_registry_create(&o, &ra));
  test_config_t *cb = config_new(&s, "from-B");
  rb = registry_new(&s, cb, false);
  open_ok(ra, "counter");
  const kiln_hal_plugin_t *pb = open_ok(rb, "counter");
  kiln_hal_registry_free(ra);
  kiln_config_free(cfg);
  touch(pb);
  assert_last_contains(&s, "counter touch ",
                       "greeting=from-set kept=from-set keys=greeting,zeta,counts_file");
  kiln_hal_registry_free(rb);
  assert_int_equal(counts_lines(&s, "counter shutdown "), 1);
  config_free(cb);
  scenario_free(&s);
}

/* ---- registries from several threads at once ----------------------------------------------- */

enum { N_THREADS = 4, N_ROUNDS = 25 };

typedef struct thread_arg {
  const scenario_t *s;
  test_config_t *c;
  pthread_barrier_t *all_open; /* each round, every thread holds its registry open here */
  int failures;
  char why[256];
} thread_arg_t;

static void thread_fail(thread_arg_t *a, const char *why) {
  a->failures++;
  snprintf(a->why, sizeof(a->why), "%s", why);
}

static void *thread_main(void *p) {
  thread_arg_t *a = p;
  for (int i = 0; i < N_ROUNDS; i++) {
    kiln_hal_registry_options_t o = {0};
    o.config_path = a->s->dir;
    o.skip_env = o.skip_default_dirs = true;
    o.num_threads = 1;
    o.config_get = cfg_get;
    o.config_key = cfg_key;
    o.config_ctx = a->c;
    kiln_hal_registry_t *r = NULL;
    kiln_status_t st = kiln_hal_registry_create(&o, &r);
    const kiln_hal_plugin_t *p1 = NULL, *p2 = NULL;
    if (!st) st = kiln_hal_registry_open(r, "counter", &p1);
    if (!st) st = kiln_hal_registry_open(r, "cpu", &p2); /* the real cpu: refuses a nested init */
    bool ok = !st;
    if (st) thread_fail(a, kiln_status_message(st));
    kiln_status_free(st);
    pthread_barrier_wait(a->all_open); /* every round, even after a failure: no deadlock */
    if (ok) {
      int32_t n = 0;
      kiln_hal_error_t *err = p1->table.device_count(&n);
      if (!err) err = p2->table.device_count(&n);
      if (err) thread_fail(a, err->message);
      kiln_hal_error_free(err);
    }
    kiln_hal_registry_free(r);
    /* Every other round ends with every registry freed: the next one initialises afresh. */
    if (i % 2) pthread_barrier_wait(a->all_open);
  }
  return NULL;
}

static void test_registries_from_threads(void **state) {
  (void)state;
  scenario_t s;
  scenario_init(&s);
  scenario_add(&s, "counter", "libkiln-backend-counter.so");
  scenario_add_cpu(&s);
  test_config_t *c = config_new(&s, "threads");
  pthread_t th[N_THREADS];
  thread_arg_t args[N_THREADS];
  pthread_barrier_t all_open;
  assert_int_equal(pthread_barrier_init(&all_open, NULL, N_THREADS), 0);
  for (int i = 0; i < N_THREADS; i++) {
    args[i] = (thread_arg_t){.s = &s, .c = c, .all_open = &all_open};
    assert_int_equal(pthread_create(&th[i], NULL, thread_main, &args[i]), 0);
  }
  for (int i = 0; i < N_THREADS; i++) assert_int_equal(pthread_join(th[i], NULL), 0);
  pthread_barrier_destroy(&all_open);
  for (int i = 0; i < N_THREADS; i++)
    if (args[i].failures) fail_msg("thread %d: %s", i, args[i].why);
  int inits = counts_lines(&s, "counter init "), shutdowns = counts_lines(&s, "counter shutdown ");
  print_message("%d registries from %d threads: %d init/shutdown pairs (the rest shared)\n",
                N_THREADS * N_ROUNDS, N_THREADS, inits);
  assert_true(inits >= N_ROUNDS / 2 + 1); /* a fresh start after each odd round */
  assert_true(inits <= N_ROUNDS);         /* all N_THREADS registries are open at once each round */
  assert_int_equal(inits, shutdowns);
  assert_int_equal(counts_lines(&s, "counter touch "), N_THREADS * N_ROUNDS);
  char *all = counts_read(&s);
  if (strstr(all, "NESTED") || strstr(all, "NOT-INITIALISED")) fail_msg("%s", all);
  free(all);
  config_free(c);
  scenario_free(&s);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_two_registries_one_init),
      cmocka_unit_test(test_second_registry_freed_first),
      cmocka_unit_test(test_lazy_config_outlives_first_registry),
      cmocka_unit_test(test_kiln_config_keys),
      cmocka_unit_test(test_wrapper_shuts_down_first_across_registries),
      cmocka_unit_test(test_wrapper_table_outlives_loading_registry),
      cmocka_unit_test(test_registries_from_threads),
  };
  return cmocka_run_group_tests_name("registry_nesting", tests, NULL, NULL);
}
