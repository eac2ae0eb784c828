/* test_loader.c - the plugin loader against purpose-built bad plugins: wrong ABI major,
 * missing entry symbol, missing dependency, shorter (older) and longer (newer) tables, a
 * plugin built against ABI 1.0 under this (1.2) host, a probe of 0, a NULL required member, an
 * op that fails, bad file names, auto selection. (Several registries sharing one plugin:
 * test_registry_nesting.c.) */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "hal/loader.h"
#include "kiln/hal_util.h"

/* A scenario: a fresh directory holding plugins under chosen file names. */
typedef struct scenario {
  char dir[256];
  kiln_hal_registry_t *reg;
} scenario_t;

static const char *fake_dir(void) {
  const char *d = getenv("KILN_FAKE_PLUGIN_DIR");
  assert_non_null(d);
  return d;
}

static void scenario_init(scenario_t *s) {
  memset(s, 0, sizeof(*s));
  snprintf(s->dir, sizeof(s->dir), "/tmp/kiln-loader-XXXXXX");
  assert_non_null(mkdtemp(s->dir));
}

/* Links fake variant `variant` (or an absolute path) into the scenario as file `file`. */
static void scenario_add(scenario_t *s, const char *variant, const char *file) {
  char src[512], dst[512];
  if (variant[0] == '/')
    snprintf(src, sizeof(src), "%s", variant);
  else
    snprintf(src, sizeof(src), "%s/libfake-%s.so", fake_dir(), variant);
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

static void scenario_write(scenario_t *s, const char *file, const char *text) {
  char dst[512];
  snprintf(dst, sizeof(dst), "%s/%s", s->dir, file);
  FILE *f = fopen(dst, "w");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
}

static void scenario_load(scenario_t *s) {
  kiln_hal_registry_options_t o = {0};
  o.config_path = s->dir;
  o.skip_env = true;
  o.skip_default_dirs = true;
  o.num_threads = 1;
  kiln_status_t st = kiln_hal_registry_create(&o, &s->reg);
  assert_null(st);
  assert_non_null(s->reg);
}

static void scenario_free(scenario_t *s) {
  kiln_hal_registry_free(s->reg);
  char cmd[300];
  snprintf(cmd, sizeof(cmd), "rm -rf '%s'", s->dir);
  assert_int_equal(system(cmd), 0);
}

static const kiln_hal_plugin_t *find(scenario_t *s, const char *name) {
  for (int i = 0; i < kiln_hal_registry_count(s->reg); i++) {
    const kiln_hal_plugin_t *p = kiln_hal_registry_get(s->reg, i);
    if (strcmp(p->name, name) == 0) return p;
  }
  fail_msg("no registry entry named %s", name);
  return NULL;
}

/* "plugin ABI 2.0, host ABI <this host's major.minor>" */
static const char *major2_reason(void) {
  static char buf[64];
  snprintf(buf, sizeof(buf), "plugin ABI 2.0, host ABI %d.%d", KILN_HAL_ABI_MAJOR,
           KILN_HAL_ABI_MINOR);
  return buf;
}

#define assert_contains(hay, needle)                                                     \
  do {                                                                                   \
    const char *h_ = (hay);                                                              \
    if (!h_ || !strstr(h_, (needle))) fail_msg("'%s' does not contain '%s'", h_ ? h_ : "(null)", (needle)); \
  } while (0)

/* Asserts that opening `name` fails with a message containing `needle`. */
static void assert_open_fails(scenario_t *s, const char *name, const char *needle) {
  const kiln_hal_plugin_t *p = (const kiln_hal_plugin_t *)1;
  kiln_status_t st = kiln_hal_registry_open(s->reg, name, &p);
  assert_non_null(st);
  assert_null(p);
  assert_contains(kiln_status_message(st), needle);
  kiln_status_free(st);
}

static void test_wrong_major(void **state) {
  scenario_t s;
  scenario_init(&s);
  scenario_add(&s, "badabi", "libkiln-backend-badabi.so");
  scenario_load(&s);
  const kiln_hal_plugin_t *p = find(&s, "badabi");
  assert_int_equal(p->state, KILN_HAL_PLUGIN_REJECTED);
  assert_int_equal(p->abi_major, 2);
  assert_contains(p->reason, major2_reason());
  /* Naming a rejected backend explicitly is a hard error quoting the reason. */
  assert_open_fails(&s, "badabi", major2_reason());
  scenario_free(&s);
}

static void test_missing_entry_symbol(void **state) {
  scenario_t s;
  scenario_init(&s);
  scenario_add(&s, "nosym", "libkiln-backend-nosym.so");
  scenario_load(&s);
  const kiln_hal_plugin_t *p = find(&s, "nosym");
  assert_int_equal(p->state, KILN_HAL_PLUGIN_REJECTED);
  assert_contains(p->reason, "missing entry symbol kiln_backend_query");
  assert_open_fails(&s, "nosym", "missing entry symbol");
  scenario_free(&s);
}

static void test_missing_dependency(void **state) {
  scenario_t s;
  scenario_init(&s);
  scenario_add(&s, "missingdep", "libkiln-backend-missingdep.so");
  scenario_load(&s);
  const kiln_hal_plugin_t *p = find(&s, "missingdep");
  assert_int_equal(p->state, KILN_HAL_PLUGIN_REJECTED);
  assert_contains(p->reason, "libkiln_test_missing.so: cannot open shared object file");
  scenario_free(&s);
}

static void test_shorter_table_reads_as_null(void **state) {
  scenario_t s;
  scenario_init(&s);
  scenario_add(&s, "short", "libkiln-backend-short.so");
  scenario_load(&s);
  const kiln_hal_plugin_t *p = NULL;
  kiln_status_t st = kiln_hal_registry_open(s.reg, "short", &p);
  assert_null(st);
  assert_int_equal(p->state, KILN_HAL_PLUGIN_OPEN);
  assert_int_equal(p->score, 50);
  /* The poisoned graph_begin past struct_size must not have been copied. */
  assert_null(p->table.graph_begin);
  assert_null(p->table.graph_end);
  assert_null(p->table.graph_replay);
  assert_null(p->table.graph_destroy);
  assert_non_null(p->table.sample);
  scenario_free(&s);
}

static void test_newer_minor_accepted(void **state) {
  scenario_t s;
  scenario_init(&s);
  scenario_add(&s, "newer", "libkiln-backend-newer.so");
  scenario_load(&s);
  const kiln_hal_plugin_t *p = NULL;
  kiln_status_t st = kiln_hal_registry_open(s.reg, "newer", &p);
  assert_null(st);
  assert_int_equal(p->abi_major, KILN_HAL_ABI_MAJOR);
  assert_int_equal(p->abi_minor, 8);
  assert_int_equal(p->table.struct_size, sizeof(kiln_hal_backend_t));
  scenario_free(&s);
}

/* A plugin built against ABI 1.0 (FAKE_MINOR=0: it reports minor 0, its table has 1.0's size
 * and it reads kiln_hal_host_t only up to num_threads, as 1.0 declared it) works under this host:
 * it loads, init gets a host it can read (a larger struct_size, the 1.0 members in place), and
 * config_get answers through the 1.0 layout. */
static const char *v10_config_get(void *ctx, const char *plugin, const char *key) {
  if (strcmp(plugin, "v10") != 0) return NULL;
  if (strcmp(key, "counts_file") == 0) return ctx;
  if (strcmp(key, "greeting") == 0) return "hello-1.0";
  return NULL;
}

static const char *v10_config_key(void *ctx, const char *plugin, int32_t index) {
  (void)ctx;
  static const char *const keys[] = {"counts_file", "greeting"};
  return strcmp(plugin, "v10") == 0 && index >= 0 && index < 2 ? keys[index] : NULL;
}

static void test_abi_1_0_plugin_under_1_1_host(void **state) {
  /* What changed in 1.1 is appended: 1.0's members keep their offsets, the table its size. */
  assert_int_equal(offsetof(kiln_hal_host_t, num_threads), 40);
  assert_true(offsetof(kiln_hal_host_t, config_key) >=
              offsetof(kiln_hal_host_t, num_threads) + sizeof(int32_t));
  assert_int_equal(offsetof(kiln_hal_backend_t, graph_destroy) + sizeof(void *),
                   offsetof(kiln_hal_backend_t, layernorm));
  scenario_t s;
  scenario_init(&s);
  scenario_add(&s, "v10", "libkiln-backend-v10.so");
  char counts[300];
  snprintf(counts, sizeof(counts), "%s/counts.txt", s.dir);
  kiln_hal_registry_options_t o = {0};
  o.config_path = s.dir;
  o.skip_env = o.skip_default_dirs = true;
  o.config_get = v10_config_get;
  o.config_key = v10_config_key;
  o.config_ctx = counts;
  assert_null(kiln_hal_registry_create(&o, &s.reg));
  const kiln_hal_plugin_t *p = NULL;
  kiln_status_t st = kiln_hal_registry_open(s.reg, "v10", &p);
  if (st) fail_msg("open v10: %s", kiln_status_message(st));
  assert_int_equal(p->state, KILN_HAL_PLUGIN_OPEN);
  assert_int_equal(p->abi_major, 1);
  assert_int_equal(p->abi_minor, 0);
  assert_non_null(p->table.sample);
  /* Its table ends at graph_destroy: 1.2's optional ops read as NULL. */
  assert_null(p->table.layernorm);
  assert_null(p->table.activation);
  int32_t n = 0;
  assert_null(p->table.device_count(&n)); /* the plugin reads config through its 1.0 view */
  assert_int_equal(n, 1);
  FILE *f = fopen(counts, "r");
  assert_non_null(f);
  char text[2048] = "";
  size_t len = fread(text, 1, sizeof(text) - 1, f);
  text[len] = '\0';
  fclose(f);
  char want[64];
  snprintf(want, sizeof(want), "v10 init inits=1 shutdowns=0 host_size=%zu",
           sizeof(kiln_hal_host_t));
  assert_contains(text, want);
  assert_contains(text, "v10 touch inits=1 shutdowns=0 greeting=hello-1.0 kept=hello-1.0 "
                        "keys=(ABI 1.0: no config_key)");
  scenario_free(&s);
}

static void test_probe_zero(void **state) {
  scenario_t s;
  scenario_init(&s);
  scenario_add(&s, "noprobe", "libkiln-backend-noprobe.so");
  scenario_load(&s);
  const kiln_hal_plugin_t *p = find(&s, "noprobe");
  assert_int_equal(p->state, KILN_HAL_PLUGIN_REJECTED);
  assert_contains(p->reason, "probe found no usable device");
  assert_contains(p->reason, "no FakeGPU adapter present");
  assert_open_fails(&s, "noprobe", "no FakeGPU adapter present");
  scenario_free(&s);
}

static void test_null_required_member(void **state) {
  scenario_t s;
  scenario_init(&s);
  scenario_add(&s, "nullrope", "libkiln-backend-nullrope.so");
  scenario_load(&s);
  const kiln_hal_plugin_t *p = find(&s, "nullrope");
  assert_int_equal(p->state, KILN_HAL_PLUGIN_REJECTED);
  assert_contains(p->reason, "lacks required member 'rope'");
  scenario_free(&s);
}

static void test_op_error_is_reported(void **state) {
  scenario_t s;
  scenario_init(&s);
  scenario_add(&s, "failgemm", "libkiln-backend-failgemm.so");
  scenario_load(&s);
  const kiln_hal_plugin_t *p = NULL;
  assert_null(kiln_hal_registry_open(s.reg, "failgemm", &p));
  const kiln_hal_backend_t *t = &p->table;
  kiln_hal_device_t *dev = NULL;
  kiln_hal_stream_t *stream = NULL;
  assert_null(t->device_open(0, &dev));
  assert_null(t->stream_create(dev, &stream));
  kiln_hal_gemm_args_t g;
  memset(&g, 0, sizeof(g));
  g.struct_size = sizeof(g);
  kiln_hal_error_t *err = t->gemm(stream, &g);
  assert_non_null(err);
  assert_int_equal(err->code, KILN_HAL_ERR_DEVICE);
  kiln_status_t st = kiln_hal_status_from_error(err, "layer 0 gemm");
  assert_int_equal(kiln_status_code(st), KILN_ERR_DEVICE);
  assert_contains(kiln_status_message(st), "layer 0 gemm: injected failure");
  kiln_status_free(st);
  t->stream_destroy(stream);
  t->device_close(dev);
  scenario_free(&s);
}

static void test_name_mismatch_and_bad_files(void **state) {
  scenario_t s;
  scenario_init(&s);
  scenario_add(&s, "misnamed", "libkiln-backend-foo.so");
  scenario_add(&s, "gpu", "libkiln-backend-Fake.so"); /* upper case: not a valid name */
  scenario_write(&s, "libkiln-backend-junk.so", "this is not an ELF file\n");
  scenario_write(&s, "README.txt", "unrelated files are ignored\n");
  scenario_load(&s);
  assert_int_equal(kiln_hal_registry_count(s.reg), 3);
  assert_contains(find(&s, "foo")->reason, "calls itself 'bar'");
  assert_contains(find(&s, "libkiln-backend-Fake.so")->reason, "file name does not match");
  const kiln_hal_plugin_t *junk = find(&s, "junk");
  assert_int_equal(junk->state, KILN_HAL_PLUGIN_REJECTED);
  assert_contains(junk->reason, "dlopen failed");
  scenario_free(&s);
}

static void test_auto_prefers_gpu(void **state) {
  scenario_t s;
  scenario_init(&s);
  scenario_add_cpu(&s);
  scenario_add(&s, "gpu", "libkiln-backend-fakegpu.so");
  scenario_load(&s);
  const kiln_hal_plugin_t *p = NULL;
  assert_null(kiln_hal_registry_open(s.reg, "auto", &p));
  assert_string_equal(p->name, "fakegpu");
  /* Explicitly asking for cpu still gives cpu. */
  assert_null(kiln_hal_registry_open(s.reg, "cpu", &p));
  assert_string_equal(p->name, "cpu");
  scenario_free(&s);
}

static void test_auto_falls_back_to_cpu(void **state) {
  scenario_t s;
  scenario_init(&s);
  scenario_add_cpu(&s);
  scenario_add(&s, "badabi", "libkiln-backend-badabi.so");
  scenario_add(&s, "noprobe", "libkiln-backend-noprobe.so");
  scenario_load(&s);
  const kiln_hal_plugin_t *p = NULL;
  assert_null(kiln_hal_registry_open(s.reg, "auto", &p));
  assert_string_equal(p->name, "cpu");
  assert_true(p->score > 0 && p->score < 100);
  /* But naming the broken one is an error, not a fallback. */
  assert_open_fails(&s, "noprobe", "probe found no usable device");
  scenario_free(&s);
}

static void test_auto_without_cpu_fails(void **state) {
  scenario_t s;
  scenario_init(&s);
  scenario_add(&s, "badabi", "libkiln-backend-badabi.so");
  scenario_load(&s);
  assert_open_fails(&s, "auto", major2_reason());
  scenario_free(&s);
}

static void test_unknown_name_and_paths(void **state) {
  scenario_t s;
  scenario_init(&s);
  scenario_load(&s);
  assert_int_equal(kiln_hal_registry_count(s.reg), 0);
  assert_open_fails(&s, "rocm", "no file libkiln-backend-rocm.so");
  assert_open_fails(&s, "/nonexistent/libkiln-backend-x.so", "No such file or directory");
  /* An explicit path outside the search path loads that file. */
  char path[512];
  snprintf(path, sizeof(path), "%s/libfake-gpu.so", fake_dir());
  assert_open_fails(&s, path, "file name does not match"); /* wrong file name */
  scenario_t other;
  scenario_init(&other);
  scenario_add(&other, "gpu", "libkiln-backend-fakegpu.so");
  scenario_add(&other, "badabi", "libkiln-backend-badabi.so");
  snprintf(path, sizeof(path), "%s/libkiln-backend-fakegpu.so", other.dir);
  const kiln_hal_plugin_t *p = NULL;
  kiln_status_t st = kiln_hal_registry_open(s.reg, path, &p);
  if (st) fail_msg("open %s: %s", path, kiln_status_message(st));
  assert_string_equal(p->name, "fakegpu");
  snprintf(path, sizeof(path), "%s/libkiln-backend-badabi.so", other.dir);
  assert_open_fails(&s, path, "plugin ABI 2.0");
  scenario_free(&s);
  scenario_free(&other);
}

static void test_shadowing_and_env_path(void **state) {
  scenario_t a, b;
  scenario_init(&a);
  scenario_init(&b);
  scenario_add(&a, "gpu", "libkiln-backend-fakegpu.so");
  scenario_add(&b, "gpu", "libkiln-backend-fakegpu.so");
  char env[600];
  snprintf(env, sizeof(env), "%s:%s", a.dir, b.dir);
  setenv("KILN_BACKEND_PATH", env, 1);
  kiln_hal_registry_options_t o = {0};
  o.skip_default_dirs = true;
  kiln_hal_registry_t *reg = NULL;
  assert_null(kiln_hal_registry_create(&o, &reg));
  assert_int_equal(kiln_hal_registry_count(reg), 2);
  assert_int_equal(kiln_hal_registry_get(reg, 0)->state, KILN_HAL_PLUGIN_USABLE);
  assert_int_equal(kiln_hal_registry_get(reg, 1)->state, KILN_HAL_PLUGIN_SHADOWED);
  assert_contains(kiln_hal_registry_get(reg, 1)->reason, "shadowed by");
  assert_string_equal(kiln_hal_registry_search_path(reg), env);
  kiln_hal_registry_free(reg);
  unsetenv("KILN_BACKEND_PATH");
  scenario_free(&a);
  scenario_free(&b);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_wrong_major),
      cmocka_unit_test(test_missing_entry_symbol),
      cmocka_unit_test(test_missing_dependency),
      cmocka_unit_test(test_shorter_table_reads_as_null),
      cmocka_unit_test(test_newer_minor_accepted),
      cmocka_unit_test(test_abi_1_0_plugin_under_1_1_host),
      cmocka_unit_test(test_probe_zero),
      cmocka_unit_test(test_null_required_member),
      cmocka_unit_test(test_op_error_is_reported),
      cmocka_unit_test(test_name_mismatch_and_bad_files),
      cmocka_unit_test(test_auto_prefers_gpu),
      cmocka_unit_test(test_auto_falls_back_to_cpu),
      cmocka_unit_test(test_auto_without_cpu_fails),
      cmocka_unit_test(test_unknown_name_and_paths),
      cmocka_unit_test(test_shadowing_and_env_path),
  };
  return cmocka_run_group_tests_name("loader", tests, NULL, NULL);
}
