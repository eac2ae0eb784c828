/* test_config.c - cmocka tests for base/config: defaults, parsing, every error, --set, writing. */
#define _POSIX_C_SOURCE 200809L
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/config.h"
#include "kiln/kiln.h"

/* ---- helpers -------------------------------------------------------------------------------- */

static kiln_config_t *new_config(void) {
  kiln_config_t *cfg = NULL;
  kiln_status_t st = kiln_config_create(&cfg);
  if (st) fail_msg("create: %s", kiln_status_message(st));
  assert_non_null(cfg);
  return cfg;
}

static void check_ok(kiln_status_t st) {
  if (st)
    fail_msg("unexpected error %s: %s", kiln_status_code_name(kiln_status_code(st)),
             kiln_status_message(st));
}

/* Checks st has code and a message holding every string of parts (NULL-terminated); frees it. */
static void check_error(kiln_status_t st, kiln_status_code_t code, const char *const *parts) {
  if (!st) fail_msg("expected an error, got OK");
  const char *msg = kiln_status_message(st);
  if (kiln_status_code(st) != code)
    fail_msg("expected code %s, got %s: %s", kiln_status_code_name(code),
             kiln_status_code_name(kiln_status_code(st)), msg);
  for (size_t i = 0; parts[i]; i++)
    if (!strstr(msg, parts[i])) fail_msg("message \"%s\" lacks \"%s\"", msg, parts[i]);
  kiln_status_free(st);
}

#define EXPECT_ERR(st, code, ...) \
  check_error((st), (code), (const char *const[]){__VA_ARGS__, NULL})
#define EXPECT_INVALID(st, ...) EXPECT_ERR((st), KILN_ERR_INVALID_ARGUMENT, __VA_ARGS__)

static kiln_status_t load(kiln_config_t *cfg, const char *text) {
  return kiln_config_load_string(cfg, text, "t.ini");
}

/* What kiln_config_write(cfg) prints, or kiln_config_print_help() for a NULL cfg, as a new
 * string. (A tmpfile rather than open_memstream, which trips GCC 12's -Wdangling-pointer.) */
static char *capture(const kiln_config_t *cfg) {
  FILE *f = tmpfile();
  assert_non_null(f);
  if (cfg)
    kiln_config_write(cfg, f);
  else
    kiln_config_print_help(f);
  assert_int_equal(fflush(f), 0);
  long len = ftell(f);
  assert_true(len > 0);
  rewind(f);
  char *text = malloc((size_t)len + 1);
  assert_non_null(text);
  assert_int_equal(fread(text, 1, (size_t)len, f), (size_t)len);
  text[len] = '\0';
  fclose(f);
  return text;
}

/* The config as written, without comment lines (which name origins). Caller frees. */
static char *written(const kiln_config_t *cfg) {
  char *text = capture(cfg);
  size_t n = 0;
  for (char *line = text; *line;) {
    char *nl = strchr(line, '\n');
    size_t l = nl ? (size_t)(nl - line + 1) : strlen(line);
    if (line[0] != ';') {
      memmove(text + n, line, l);
      n += l;
    }
    line += l;
  }
  text[n] = '\0';
  return text;
}

/* Every key of the table with its default, as the design says they must be. */
typedef struct expected_key {
  const char *section;
  const char *key;
  const char *def;
} expected_key_t;

static const expected_key_t all_keys[] = {
    {"model", "path", ""},
    {"model", "dtype", "auto"},
    {"model", "max_model_len", "0"},
    {"hub", "cache_dir", ""},
    {"hub", "endpoint", ""},
    {"hub", "offline", "false"},
    {"hub", "progress", "auto"},
    {"hub", "timeout", "30"},
    {"engine", "max_num_seqs", "256"},
    {"engine", "max_num_batched_tokens", "8192"},
    {"engine", "seed", "0"},
    {"cache", "block_size", "16"},
    {"cache", "dtype", "auto"},
    {"cache", "gpu_memory_utilization", "0.9"},
    {"cache", "num_blocks", "0"},
    {"cache", "enable_prefix_caching", "true"},
    {"scheduler", "enable_chunked_prefill", "true"},
    {"scheduler", "policy", "fcfs"},
    {"speculative", "method", "off"},
    {"speculative", "num_speculative_tokens", "4"},
    {"speculative", "ngram_min", "2"},
    {"speculative", "ngram_max", "4"},
    {"speculative", "draft_model", ""},
    {"speculative", "draft_kv_fraction", "0"},
    {"speculative", "disable_by_batch_size", "8"},
    {"backend", "name", "auto"},
    {"backend", "path", ""},
    {"backend", "device", "0"},
    {"backend", "threads", "0"},
    {"server", "host", "127.0.0.1"},
    {"server", "port", "8000"},
    {"server", "served_model_name", ""},
    {"server", "api_key", ""},
    {"server", "max_queued_requests", "1024"},
    {"server", "shutdown_timeout", "30"},
    {"server", "request_timeout", "600"},
    {"server", "max_body_bytes", "33554432"},
    {"parallel", "tensor_parallel_size", "1"},
    {"graph", "enabled", "true"},
    {"graph", "capture_sizes",
     "1,2,4,8,16,24,32,40,48,56,64,72,80,88,96,104,112,120,128,136,144,152,160,168,176,184,192,"
     "200,208,216,224,232,240,248,256"},
    {"graph", "capture_budget_s", "60"},
    {"log", "level", "warn"},
    {"log", "format", "text"},
};
#define NUM_KEYS (sizeof(all_keys) / sizeof(all_keys[0]))

/* ---- defaults and types --------------------------------------------------------------------- */

static void test_defaults(void **state) {
  (void)state;
  kiln_config_t *cfg = new_config();
  for (size_t i = 0; i < NUM_KEYS; i++) {
    assert_string_equal(kiln_config_get_raw(cfg, all_keys[i].section, all_keys[i].key),
                        all_keys[i].def);
    assert_string_equal(kiln_config_origin(cfg, all_keys[i].section, all_keys[i].key), "default");
  }
  assert_string_equal(kiln_config_get_string(cfg, "model", "path"), "");
  assert_string_equal(kiln_config_get_string(cfg, "model", "dtype"), "auto");
  assert_int_equal(kiln_config_get_int(cfg, "model", "max_model_len"), 0);
  assert_int_equal(kiln_config_get_int(cfg, "engine", "max_num_seqs"), 256);
  assert_int_equal(kiln_config_get_int(cfg, "engine", "max_num_batched_tokens"), 8192);
  assert_int_equal(kiln_config_get_int(cfg, "engine", "seed"), 0);
  assert_int_equal(kiln_config_get_int(cfg, "cache", "block_size"), 16);
  assert_string_equal(kiln_config_get_string(cfg, "cache", "block_size"), "16");
  assert_true(kiln_config_get_float(cfg, "cache", "gpu_memory_utilization") == 0.9);
  assert_int_equal(kiln_config_get_int(cfg, "cache", "num_blocks"), 0);
  assert_true(kiln_config_get_bool(cfg, "cache", "enable_prefix_caching"));
  assert_true(kiln_config_get_bool(cfg, "scheduler", "enable_chunked_prefill"));
  assert_string_equal(kiln_config_get_string(cfg, "scheduler", "policy"), "fcfs");
  assert_string_equal(kiln_config_get_string(cfg, "backend", "name"), "auto");
  assert_string_equal(kiln_config_get_string(cfg, "backend", "path"), "");
  assert_int_equal(kiln_config_get_int(cfg, "backend", "device"), 0);
  assert_int_equal(kiln_config_get_int(cfg, "backend", "threads"), 0);
  assert_string_equal(kiln_config_get_string(cfg, "server", "host"), "127.0.0.1");
  assert_int_equal(kiln_config_get_int(cfg, "server", "port"), 8000);
  assert_string_equal(kiln_config_get_string(cfg, "server", "api_key"), "");
  assert_int_equal(kiln_config_get_int(cfg, "server", "max_queued_requests"), 1024);
  assert_true(kiln_config_get_float(cfg, "server", "shutdown_timeout") == 30.0);
  assert_true(kiln_config_get_float(cfg, "server", "request_timeout") == 600.0);
  assert_int_equal(kiln_config_get_int(cfg, "server", "max_body_bytes"), 33554432);
  assert_true(kiln_config_get_bool(cfg, "graph", "enabled"));
  assert_true(kiln_config_get_float(cfg, "graph", "capture_budget_s") == 60.0);
  assert_string_equal(kiln_config_get_string(cfg, "log", "level"), "warn");
  assert_string_equal(kiln_config_get_string(cfg, "log", "format"), "text");

  const int64_t *sizes = NULL;
  size_t n = kiln_config_get_int_list(cfg, "graph", "capture_sizes", &sizes);
  assert_int_equal(n, 35);
  assert_int_equal(sizes[0], 1);
  assert_int_equal(sizes[1], 2);
  assert_int_equal(sizes[2], 4);
  for (size_t i = 3; i < n; i++) assert_int_equal(sizes[i], 8 * (int64_t)(i - 2));

  /* Unknown keys and unset plugin keys read as NULL through the untyped getters. */
  assert_null(kiln_config_get_raw(cfg, "engine", "nope"));
  assert_null(kiln_config_get_raw(cfg, "plugin.trace", "level"));
  assert_null(kiln_config_origin(cfg, "nope", "nope"));
  kiln_config_free(cfg);
  kiln_config_free(NULL);
}

static void test_parse_every_type(void **state) {
  (void)state;
  kiln_config_t *cfg = new_config();
  check_ok(load(cfg,
                "\xEF\xBB\xBF; a comment\n"
                "# another comment\n"
                "[model]\n"
                "path = /models/my model dir\n"
                "dtype = BFloat16\n"
                "max_model_len=4096\r\n"
                "[engine]\n"
                "seed: +9223372036854775807\n"
                "max_num_seqs = 1 ; inline comment\n"
                "[cache]\n"
                "block_size = 64\n"
                "gpu_memory_utilization = 5e-1\n"
                "enable_prefix_caching = Off\n"
                "[scheduler]\n"
                "enable_chunked_prefill = NO\n"
                "policy = priority\n"
                "[server]\n"
                "api_key = abc;def=ghi\n"
                "request_timeout = 0\n"
                "[graph]\n"
                "capture_sizes =  8 ,1,\t4096 \n"
                "enabled = 0\n"
                "[log]\n"
                "level = DEBUG\n"));
  assert_string_equal(kiln_config_get_string(cfg, "model", "path"), "/models/my model dir");
  assert_string_equal(kiln_config_get_string(cfg, "model", "dtype"), "bfloat16");
  assert_string_equal(kiln_config_get_raw(cfg, "model", "dtype"), "BFloat16");
  assert_int_equal(kiln_config_get_int(cfg, "model", "max_model_len"), 4096);
  assert_true(kiln_config_get_int(cfg, "engine", "seed") == INT64_MAX);
  assert_int_equal(kiln_config_get_int(cfg, "engine", "max_num_seqs"), 1);
  assert_int_equal(kiln_config_get_int(cfg, "cache", "block_size"), 64);
  assert_true(kiln_config_get_float(cfg, "cache", "gpu_memory_utilization") == 0.5);
  assert_false(kiln_config_get_bool(cfg, "cache", "enable_prefix_caching"));
  assert_false(kiln_config_get_bool(cfg, "scheduler", "enable_chunked_prefill"));
  assert_string_equal(kiln_config_get_string(cfg, "scheduler", "policy"), "priority");
  assert_string_equal(kiln_config_get_string(cfg, "server", "api_key"), "abc;def=ghi");
  assert_true(kiln_config_get_float(cfg, "server", "request_timeout") == 0.0);
  assert_false(kiln_config_get_bool(cfg, "graph", "enabled"));
  assert_string_equal(kiln_config_get_string(cfg, "log", "level"), "debug");
  const int64_t *sizes = NULL;
  assert_int_equal(kiln_config_get_int_list(cfg, "graph", "capture_sizes", &sizes), 3);
  assert_int_equal(sizes[0], 8);
  assert_int_equal(sizes[1], 1);
  assert_int_equal(sizes[2], 4096);
  /* Keys the text did not mention keep their defaults. */
  assert_int_equal(kiln_config_get_int(cfg, "server", "port"), 8000);
  assert_string_equal(kiln_config_origin(cfg, "server", "port"), "default");
  kiln_config_free(cfg);
}

static void test_bool_words(void **state) {
  (void)state;
  static const char *const yes[] = {"true", "TRUE", "yes", "Yes", "on", "ON", "1"};
  static const char *const no[] = {"false", "False", "no", "NO", "off", "oFF", "0"};
  kiln_config_t *cfg = new_config();
  for (size_t i = 0; i < sizeof(yes) / sizeof(yes[0]); i++) {
    check_ok(kiln_config_set_value(cfg, "graph", "enabled", no[i], "t"));
    assert_false(kiln_config_get_bool(cfg, "graph", "enabled"));
    check_ok(kiln_config_set_value(cfg, "graph", "enabled", yes[i], "t"));
    assert_true(kiln_config_get_bool(cfg, "graph", "enabled"));
  }
  kiln_config_free(cfg);
}

static void test_range_edges(void **state) {
  (void)state;
  kiln_config_t *cfg = new_config();
  check_ok(load(cfg,
                "[server]\nport = 1\nmax_body_bytes = 1073741824\nshutdown_timeout=3600\n"
                "[cache]\ngpu_memory_utilization = 0.01\nnum_blocks = 1000000000\n"));
  assert_int_equal(kiln_config_get_int(cfg, "server", "port"), 1);
  assert_int_equal(kiln_config_get_int(cfg, "server", "max_body_bytes"), 1073741824);
  assert_true(kiln_config_get_float(cfg, "server", "shutdown_timeout") == 3600.0);
  assert_true(kiln_config_get_float(cfg, "cache", "gpu_memory_utilization") == 0.01);
  assert_int_equal(kiln_config_get_int(cfg, "cache", "num_blocks"), 1000000000);
  check_ok(kiln_config_set(cfg, "server.port=65535"));
  assert_int_equal(kiln_config_get_int(cfg, "server", "port"), 65535);
  check_ok(kiln_config_set(cfg, "cache.gpu_memory_utilization=1"));
  assert_true(kiln_config_get_float(cfg, "cache", "gpu_memory_utilization") == 1.0);
  kiln_config_free(cfg);
}

/* ---- value errors --------------------------------------------------------------------------- */

static void test_int_errors(void **state) {
  (void)state;
  kiln_config_t *cfg = new_config();
  EXPECT_INVALID(load(cfg, "[engine]\nmax_num_seqs = abc\n"), "t.ini:2: ", "engine.max_num_seqs",
                 "'abc' is not an integer");
  EXPECT_INVALID(load(cfg, "[engine]\nmax_num_seqs = 12abc\n"), "t.ini:2: ", "engine.max_num_seqs",
                 "'12abc'", "trailing 'abc'");
  EXPECT_INVALID(load(cfg, "[engine]\nmax_num_seqs = 1.5\n"), "t.ini:2: ", "trailing '.5'");
  EXPECT_INVALID(load(cfg, "[engine]\nmax_num_seqs = 0x10\n"), "t.ini:2: ", "trailing 'x10'");
  EXPECT_INVALID(load(cfg, "[engine]\nmax_num_seqs = - 5\n"), "t.ini:2: ", "not an integer");
  EXPECT_INVALID(load(cfg, "[engine]\nmax_num_seqs =\n"), "t.ini:2: ", "empty value", "[1, 65536]");
  EXPECT_INVALID(load(cfg, "[engine]\nseed = 9223372036854775808\n"), "t.ini:2: ", "engine.seed",
                 "overflows a 64-bit integer", "[0, 9223372036854775807]");
  EXPECT_INVALID(load(cfg, "[engine]\nseed = -99999999999999999999\n"), "overflows");
  EXPECT_INVALID(load(cfg, "[engine]\nseed = -1\n"), "t.ini:2: ", "engine.seed",
                 "-1 is out of range [0, 9223372036854775807]");
  EXPECT_INVALID(load(cfg, "\n[engine]\n\nmax_num_seqs = 0\n"), "t.ini:4: ", "engine.max_num_seqs",
                 "0 is out of range [1, 65536]");
  EXPECT_INVALID(load(cfg, "[server]\nport = 65536\n"), "t.ini:2: ", "server.port",
                 "65536 is out of range [0, 65535]");
  EXPECT_INVALID(load(cfg, "[server]\nport = 80 # http\n"), "server.port", "trailing",
                 "only ';' after a space starts an inline comment");
  kiln_config_free(cfg);
}

static void test_float_errors(void **state) {
  (void)state;
  kiln_config_t *cfg = new_config();
  static const char *const not_finite[] = {"nan", "NaN", "inf", "-inf", "infinity", "1e999"};
  for (size_t i = 0; i < sizeof(not_finite) / sizeof(not_finite[0]); i++) {
    char text[128];
    snprintf(text, sizeof(text), "[server]\nshutdown_timeout = %s\n", not_finite[i]);
    EXPECT_INVALID(load(cfg, text), "t.ini:2: ", "server.shutdown_timeout", not_finite[i],
                   "not a finite number");
  }
  EXPECT_INVALID(load(cfg, "[server]\nshutdown_timeout = soon\n"),
                 "t.ini:2: ", "server.shutdown_timeout", "'soon' is not a number");
  EXPECT_INVALID(load(cfg, "[server]\nshutdown_timeout = 10s\n"),
                 "t.ini:2: ", "'10s' is not a number", "trailing 's'");
  EXPECT_INVALID(load(cfg, "[server]\nshutdown_timeout =\n"), "empty value", "[0, 3600]");
  EXPECT_INVALID(load(cfg, "[cache]\ngpu_memory_utilization = 1.5\n"),
                 "t.ini:2: ", "cache.gpu_memory_utilization", "1.5 is out of range [0.01, 1]");
  EXPECT_INVALID(load(cfg, "[cache]\ngpu_memory_utilization = 0\n"), "0 is out of range [0.01, 1]");
  EXPECT_INVALID(load(cfg, "[server]\nrequest_timeout = -1\n"), "server.request_timeout",
                 "-1 is out of range [0, 86400]");
  kiln_config_free(cfg);
}

static void test_bool_enum_errors(void **state) {
  (void)state;
  kiln_config_t *cfg = new_config();
  EXPECT_INVALID(load(cfg, "[graph]\nenabled = maybe\n"), "t.ini:2: ", "graph.enabled",
                 "'maybe' is not a boolean", "true/false, yes/no, on/off or 1/0");
  EXPECT_INVALID(load(cfg, "[graph]\nenabled =\n"), "graph.enabled", "is not a boolean");
  EXPECT_INVALID(load(cfg, "[model]\ndtype = fp8\n"), "t.ini:2: ", "model.dtype",
                 "'fp8' is not allowed", "auto, float32, float16, bfloat16");
  EXPECT_INVALID(load(cfg, "[cache]\nblock_size = 24\n"), "t.ini:2: ", "cache.block_size", "'24'",
                 "8, 16, 32, 64, 128");
  EXPECT_INVALID(load(cfg, "[cache]\ndtype = fp8\n"), "t.ini:2: ", "cache.dtype", "'fp8'",
                 "auto, fp8_e4m3");
  EXPECT_INVALID(load(cfg, "[cache]\ndtype = bf16\n"), "cache.dtype", "'bf16'", "auto, fp8_e4m3");
  EXPECT_INVALID(load(cfg, "[log]\nformat = xml\n"), "log.format", "text, json");
  EXPECT_INVALID(load(cfg, "[scheduler]\npolicy = lifo\n"), "scheduler.policy", "fcfs, priority");
  kiln_config_free(cfg);
}

static void test_list_errors(void **state) {
  (void)state;
  kiln_config_t *cfg = new_config();
  EXPECT_INVALID(load(cfg, "[graph]\ncapture_sizes =\n"), "t.ini:2: ", "graph.capture_sizes",
                 "empty list", "[1, 4096]");
  EXPECT_INVALID(load(cfg, "[graph]\ncapture_sizes = 1,,2\n"), "t.ini:2: ", "graph.capture_sizes",
                 "element 2 of '1,,2' is empty");
  EXPECT_INVALID(load(cfg, "[graph]\ncapture_sizes = 1,2,\n"), "element 3", "is empty");
  EXPECT_INVALID(load(cfg, "[graph]\ncapture_sizes = ,1\n"), "element 1", "is empty");
  EXPECT_INVALID(load(cfg, "[graph]\ncapture_sizes = 1, 2, x\n"),
                 "t.ini:2: ", "graph.capture_sizes", "element 3", "'x' is not an integer");
  EXPECT_INVALID(load(cfg, "[graph]\ncapture_sizes = 1 2\n"), "element 1", "trailing");
  EXPECT_INVALID(load(cfg, "[graph]\ncapture_sizes = 8, 5000\n"),
                 "t.ini:2: ", "graph.capture_sizes", "element 2", "5000 is out of range [1, 4096]");
  EXPECT_INVALID(load(cfg, "[graph]\ncapture_sizes = 0\n"), "0 is out of range [1, 4096]");
  kiln_config_free(cfg);
}

static void test_string_checks(void **state) {
  (void)state;
  kiln_config_t *cfg = new_config();
  static const char *const ok[] = {
      "auto", "cuda", "rocm", "cpu", "/opt/libkiln-backend-x.so", "./libkiln-backend-y.so"};
  for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
    check_ok(kiln_config_set_value(cfg, "backend", "name", ok[i], "t"));
    assert_string_equal(kiln_config_get_string(cfg, "backend", "name"), ok[i]);
  }
  /* A third party's plugin is named like ours. */
  check_ok(load(cfg, "[backend]\nname = trace\n"));
  assert_string_equal(kiln_config_get_string(cfg, "backend", "name"), "trace");
  EXPECT_INVALID(load(cfg, "[backend]\nname = my gpu\n"), "t.ini:2: ", "backend.name",
                 "'my gpu' is not a backend", "auto, a plugin name such as cpu, cuda or rocm");
  EXPECT_INVALID(load(cfg, "[backend]\nname = CUDA\n"), "backend.name", "'CUDA'");
  EXPECT_INVALID(load(cfg, "[backend]\nname =\n"), "backend.name", "is not a backend");
  EXPECT_INVALID(load(cfg, "[server]\nhost =\n"), "t.ini:2: ", "server.host", "is not an address");
  check_ok(load(cfg, "[backend]\npath = /a/b:/c\n[server]\nhost = 0.0.0.0\n"));
  assert_string_equal(kiln_config_get_string(cfg, "backend", "path"), "/a/b:/c");
  assert_string_equal(kiln_config_get_string(cfg, "server", "host"), "0.0.0.0");
  kiln_config_free(cfg);
}

/* ---- structural errors ---------------------------------------------------------------------- */

static void test_unknown_section(void **state) {
  (void)state;
  kiln_config_t *cfg = new_config();
  EXPECT_INVALID(
      load(cfg, "[modle]\npath = x\n"), "t.ini:1: ", "unknown section [modle]",
      "did you mean [model]?",
      "model, hub, engine, cache, scheduler, speculative, backend, server, parallel, graph, log, plugin.<name>");
  EXPECT_INVALID(load(cfg, "[network]\nport = 1\n"), "unknown section [network]",
                 "valid sections: model");
  EXPECT_INVALID(load(cfg, "[Model]\npath = x\n"), "unknown section [Model]",
                 "did you mean [model]?");
  EXPECT_INVALID(load(cfg, "port = 1\n"), "t.ini:1: ", "key 'port' comes before any [section]",
                 "valid sections: model");
  EXPECT_INVALID(load(cfg, "[plugin]\nx = 1\n"), "t.ini:1: ", "unknown section [plugin]");
  EXPECT_INVALID(load(cfg, "[plugin.]\nx = 1\n"), "t.ini:2: ", "bad plugin section [plugin.]");
  EXPECT_INVALID(load(cfg, "[plugin.a b]\nx = 1\n"), "bad plugin section [plugin.a b]");
  EXPECT_INVALID(load(cfg, "[plugin.aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa]\nx = 1\n"),
                 "t.ini:2: ", "is too long");
  /* A misspelt header is an error even with no key under it (it is checked as it is read). */
  EXPECT_INVALID(load(cfg, "[engine]\n\n[enigne]\n"), "t.ini:3: ", "unknown section [enigne]",
                 "did you mean [engine]?");
  check_ok(load(cfg, "[engine]\n[plugin.trace]\n"));
  kiln_config_free(cfg);
}

static void test_unknown_key(void **state) {
  (void)state;
  kiln_config_t *cfg = new_config();
  EXPECT_INVALID(load(cfg, "[engine]\nmax_num_seq = 3\n"),
                 "t.ini:2: ", "unknown key 'max_num_seq' in [engine]",
                 "did you mean 'max_num_seqs'?",
                 "valid keys: max_num_seqs, max_num_batched_tokens, seed");
  EXPECT_INVALID(load(cfg, "[server]\nprot = 3\n"), "unknown key 'prot' in [server]",
                 "did you mean 'port'?", "valid keys: host, port, served_model_name, api_key");
  EXPECT_INVALID(load(cfg, "[server]\nPORT = 3\n"), "did you mean 'port'?");
  /* Too far from every key: no suggestion. */
  kiln_status_t st = load(cfg, "[server]\nworkers = 3\n");
  assert_non_null(st);
  assert_null(strstr(kiln_status_message(st), "did you mean"));
  EXPECT_INVALID(st, "t.ini:2: ", "unknown key 'workers' in [server]", "valid keys: host");
  /* A key of another section says where it belongs. */
  EXPECT_INVALID(load(cfg, "[engine]\nblock_size = 16\n"), "unknown key 'block_size' in [engine]",
                 "it belongs in [cache]");
  EXPECT_INVALID(load(cfg, "[engine]\n= 3\n"), "t.ini:2: ", "unknown key '' in [engine]");
  kiln_config_free(cfg);
}

static void test_duplicate_key(void **state) {
  (void)state;
  kiln_config_t *cfg = new_config();
  EXPECT_INVALID(load(cfg, "[engine]\nseed = 1\nmax_num_seqs = 2\nseed = 3\n"),
                 "t.ini:4: ", "engine.seed is given twice (lines 2 and 4)");
  EXPECT_INVALID(load(cfg, "[engine]\nseed = 1\n[server]\nport = 1\n[engine]\nseed = 1\n"),
                 "t.ini:6: ", "engine.seed", "lines 2 and 6");
  EXPECT_INVALID(load(cfg, "[plugin.trace]\nlevel = 1\nlevel = 2\n"),
                 "t.ini:3: ", "plugin.trace.level is given twice (lines 2 and 3)");
  /* Twice across loads is an override, not a duplicate. */
  check_ok(load(cfg, "[engine]\nseed = 1\n[plugin.trace]\nlevel = 1\n"));
  check_ok(load(cfg, "[engine]\nseed = 2\n[plugin.trace]\nlevel = 2\n"));
  assert_int_equal(kiln_config_get_int(cfg, "engine", "seed"), 2);
  assert_string_equal(kiln_config_get_raw(cfg, "plugin.trace", "level"), "2");
  kiln_config_free(cfg);
}

static void test_syntax_errors(void **state) {
  (void)state;
  kiln_config_t *cfg = new_config();
  EXPECT_INVALID(load(cfg, "[engine]\nseed = 1\nthis is not ini\n"), "t.ini:3: syntax error",
                 "'this is not ini'");
  EXPECT_INVALID(load(cfg, "[engine\nseed = 1\n"), "t.ini:1: syntax error", "'[engine'",
                 "no closing ']'");
  EXPECT_INVALID(load(cfg, "[engine]\n\n\n[server\n"), "t.ini:4: syntax error");
  EXPECT_INVALID(
      load(cfg,
           "[engine]\n  a long line without an equals sign that goes on and on "
           "and on and on\n"),
      "t.ini:2: syntax error: 'a long line without an equals sign that goes on and on and o"
      "...' is neither");
  /* inih keeps going after a syntax error; the first error in the text is the one reported,
   * whichever kind it is. */
  EXPECT_INVALID(load(cfg, "[engine]\nbogus\nseed = x\n"), "t.ini:2: syntax error");
  EXPECT_INVALID(load(cfg, "[engine]\nseed = x\nbogus\n"), "t.ini:2: ", "engine.seed",
                 "not an integer");
  /* An indented line after a key is a continuation line to inih. */
  EXPECT_INVALID(load(cfg, "[server]\nhost = a\n  port = 9000\n"),
                 "t.ini:3: ", "continues server.host from line 2",
                 "multi-line values are not supported");
  /* ...but an indented key right after a section header is an ordinary key. */
  check_ok(load(cfg, "[server]\n  port = 9001\n"));
  assert_int_equal(kiln_config_get_int(cfg, "server", "port"), 9001);
  /* Empty text and comment-only text are fine. */
  check_ok(load(cfg, ""));
  check_ok(load(cfg, "; nothing\n# here\n\n"));
  check_ok(load(cfg, "[server]\nport = 9002"));
  assert_int_equal(kiln_config_get_int(cfg, "server", "port"), 9002);
  kiln_config_free(cfg);
}

static void test_long_lines(void **state) {
  (void)state;
  kiln_config_t *cfg = new_config();
  char text[1024];
  /* "path = " + 190 characters = 197, the longest line allowed. */
  char value[512];
  memset(value, 'a', 190);
  value[0] = '/';
  value[190] = '\0';
  snprintf(text, sizeof(text), "[model]\npath = %s\n", value);
  check_ok(load(cfg, text));
  assert_string_equal(kiln_config_get_string(cfg, "model", "path"), value);
  snprintf(text, sizeof(text), "[model]\npath = %s\r\n", value);
  check_ok(load(cfg, text));
  /* One more is rejected rather than split in two by inih. */
  value[190] = 'b';
  value[191] = '\0';
  snprintf(text, sizeof(text), "[model]\npath = %s\n[engine]\nseed = 7\n", value);
  EXPECT_INVALID(load(cfg, text), "t.ini:2: line is too long (198 characters; at most 197)");
  assert_int_equal(kiln_config_get_int(cfg, "engine", "seed"), 0);
  /* Comment lines are lines too. */
  memset(value, ';', 300);
  value[300] = '\0';
  snprintf(text, sizeof(text), "[model]\n%s\n", value);
  EXPECT_INVALID(load(cfg, text), "t.ini:2: line is too long");
  kiln_config_free(cfg);
}

/* ---- transactions, overrides, plugins, origins ---------------------------------------------- */

static void test_transactional_load(void **state) {
  (void)state;
  kiln_config_t *cfg = new_config();
  check_ok(load(cfg, "[server]\nport = 9000\n[plugin.a]\nx = 1\n"));
  char *before = written(cfg);
  static const char *const bad[] = {
      ("[server]\nport = 9001\nhost = 0.0.0.0\n[plugin.a]\nx = 2\n[plugin.b]\ny = 1\n[engine]\n"
       "seed = x\n"),
      "[server]\nport = 9001\n[plugin.b]\ny = 1\nbroken line\n",
      "[server]\nport = 9001\n[plugin.b]\ny = 1\n[nope]\nz = 1\n",
      "[graph]\ncapture_sizes = 1,2\nenabled = false\ncapture_sizes = 3\n",
  };
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    kiln_status_t st = load(cfg, bad[i]);
    assert_non_null(st);
    kiln_status_free(st);
    char *after = written(cfg);
    assert_string_equal(after, before);
    free(after);
    assert_int_equal(kiln_config_get_int(cfg, "server", "port"), 9000);
    assert_string_equal(kiln_config_origin(cfg, "server", "port"), "t.ini:2");
    assert_string_equal(kiln_config_origin(cfg, "server", "host"), "default");
    assert_null(kiln_config_get_raw(cfg, "plugin.b", "y"));
    assert_string_equal(kiln_config_get_raw(cfg, "plugin.a", "x"), "1");
    const int64_t *sizes = NULL;
    assert_int_equal(kiln_config_get_int_list(cfg, "graph", "capture_sizes", &sizes), 35);
  }
  /* A failed single set changes nothing either. */
  EXPECT_INVALID(kiln_config_set(cfg, "server.port=70000"), "--set server.port");
  assert_int_equal(kiln_config_get_int(cfg, "server", "port"), 9000);
  EXPECT_INVALID(kiln_config_set(cfg, "graph.capture_sizes=1,2,0"), "--set graph.capture_sizes");
  char *after = written(cfg);
  assert_string_equal(after, before);
  free(after);
  free(before);
  kiln_config_free(cfg);
}

static void test_set_overrides(void **state) {
  (void)state;
  kiln_config_t *cfg = new_config();
  check_ok(load(cfg, "[server]\nport = 9000\nhost = 0.0.0.0\n"));
  check_ok(kiln_config_set(cfg, "server.port=9100"));
  assert_int_equal(kiln_config_get_int(cfg, "server", "port"), 9100);
  assert_string_equal(kiln_config_origin(cfg, "server", "port"), "--set");
  assert_string_equal(kiln_config_origin(cfg, "server", "host"), "t.ini:3");
  /* Whitespace around the parts is ignored; the value may hold '=' and be empty. */
  check_ok(kiln_config_set(cfg, "  server.api_key =  a=b==  "));
  assert_string_equal(kiln_config_get_string(cfg, "server", "api_key"), "a=b==");
  check_ok(kiln_config_set(cfg, "server.api_key="));
  assert_string_equal(kiln_config_get_string(cfg, "server", "api_key"), "");
  check_ok(kiln_config_set(cfg, "graph.capture_sizes=1, 2, 4"));
  const int64_t *sizes = NULL;
  assert_int_equal(kiln_config_get_int_list(cfg, "graph", "capture_sizes", &sizes), 3);
  assert_int_equal(sizes[2], 4);
  check_ok(kiln_config_set(cfg, "cache.block_size=32"));
  assert_int_equal(kiln_config_get_int(cfg, "cache", "block_size"), 32);
  /* A later load of a file still replaces what it names. */
  check_ok(load(cfg, "[server]\nport = 9200\n"));
  assert_int_equal(kiln_config_get_int(cfg, "server", "port"), 9200);

  EXPECT_INVALID(kiln_config_set(cfg, "server.port"), "--set 'server.port'", "no '='");
  EXPECT_INVALID(kiln_config_set(cfg, "port=1"), "--set 'port=1'", "no section");
  EXPECT_INVALID(kiln_config_set(cfg, ".port=1"), "--set '.port=1'", "empty section");
  EXPECT_INVALID(kiln_config_set(cfg, "server.=1"), "--set 'server.=1'", "empty key");
  EXPECT_INVALID(kiln_config_set(cfg, "server. =1"), "empty key");
  EXPECT_INVALID(kiln_config_set(cfg, "=1"), "no section");
  EXPECT_INVALID(kiln_config_set(cfg, ""), "no '='");
  EXPECT_INVALID(kiln_config_set(cfg, "server.port=http"),
                 "--set server.port: ", "'http' is not an integer");
  EXPECT_INVALID(kiln_config_set(cfg, "server.port=65536"),
                 "--set server.port: ", "65536 is out of range [0, 65535]");
  EXPECT_INVALID(kiln_config_set(cfg, "server.prot=1"),
                 "--set server.prot: ", "unknown key 'prot' in [server]", "did you mean 'port'?");
  EXPECT_INVALID(kiln_config_set(cfg, "srv.port=1"), "--set srv.port: ", "unknown section [srv]");
  EXPECT_INVALID(kiln_config_set(cfg, "log.level=loud"),
                 "--set log.level: ", "error, warn, info, debug");
  assert_int_equal(kiln_config_get_int(cfg, "server", "port"), 9200);
  kiln_config_free(cfg);
}

static void test_set_value_checks(void **state) {
  (void)state;
  kiln_config_t *cfg = new_config();
  check_ok(kiln_config_set_value(cfg, "server", "api_key", "k", "env KILN_API_KEY"));
  assert_string_equal(kiln_config_origin(cfg, "server", "api_key"), "env KILN_API_KEY");
  check_ok(kiln_config_set_value(cfg, "server", "api_key", "k2", NULL));
  assert_string_equal(kiln_config_origin(cfg, "server", "api_key"), "api");
  /* Values that an INI file could not hold are refused, so that write() round-trips. */
  EXPECT_INVALID(kiln_config_set_value(cfg, "server", "api_key", "a\nb", "x.ini:3"),
                 "x.ini:3: ", "server.api_key", "line break");
  EXPECT_INVALID(kiln_config_set_value(cfg, "server", "api_key", " a", "x.ini:3"),
                 "starts or ends with whitespace");
  EXPECT_INVALID(kiln_config_set_value(cfg, "server", "api_key", "a ;b", "--set"),
                 "--set server.api_key: ", "';' after whitespace");
  EXPECT_INVALID(kiln_config_set_value(cfg, "plugin.p", "k", "a\tb\r", "--set"),
                 "--set plugin.p.k: ", "line break");
  char longv[256];
  memset(longv, 'x', sizeof(longv) - 1);
  longv[sizeof(longv) - 1] = '\0';
  EXPECT_INVALID(kiln_config_set_value(cfg, "model", "path", longv, "--set"),
                 "--set model.path: ", "too long", "at most 197");
  assert_string_equal(kiln_config_get_string(cfg, "server", "api_key"), "k2");
  kiln_config_free(cfg);
}

static void test_plugin_sections(void **state) {
  (void)state;
  kiln_config_t *cfg = new_config();
  check_ok(load(cfg,
                "[plugin.trace]\nlevel = 2\nout-file = /tmp/t.json\n"
                "[plugin.my_ext.v2]\nAnything = goes here, unchecked: 1e999\n"));
  assert_string_equal(kiln_config_get_raw(cfg, "plugin.trace", "level"), "2");
  assert_string_equal(kiln_config_get_raw(cfg, "plugin.trace", "out-file"), "/tmp/t.json");
  assert_string_equal(kiln_config_origin(cfg, "plugin.trace", "out-file"), "t.ini:3");
  assert_string_equal(kiln_config_get_raw(cfg, "plugin.my_ext.v2", "Anything"),
                      "goes here, unchecked: 1e999");
  assert_null(kiln_config_get_raw(cfg, "plugin.trace", "nope"));
  assert_null(kiln_config_origin(cfg, "plugin.other", "level"));
  /* --set splits at the last '.', so dotted plugin names work. */
  check_ok(kiln_config_set(cfg, "plugin.trace.level=3"));
  check_ok(kiln_config_set(cfg, "plugin.my_ext.v2.extra=1"));
  check_ok(kiln_config_set(cfg, "plugin.new.k="));
  assert_string_equal(kiln_config_get_raw(cfg, "plugin.trace", "level"), "3");
  assert_string_equal(kiln_config_origin(cfg, "plugin.trace", "level"), "--set");
  assert_string_equal(kiln_config_get_raw(cfg, "plugin.my_ext.v2", "extra"), "1");
  assert_string_equal(kiln_config_get_raw(cfg, "plugin.new", "k"), "");
  EXPECT_INVALID(load(cfg, "[plugin.trace]\nbad key = 1\n"),
                 "t.ini:2: ", "bad key name 'bad key' in [plugin.trace]");
  EXPECT_INVALID(kiln_config_set(cfg, "plugin.trace.a/b=1"),
                 "--set plugin.trace.a/b: ", "bad key name");
  EXPECT_INVALID(kiln_config_set(cfg, "plugin..x=1"), "bad plugin section [plugin.]");
  /* Many keys: the plugin store grows. */
  for (int i = 0; i < 40; i++) {
    char set[64];
    snprintf(set, sizeof(set), "plugin.p%d.key%d=%d", i % 3, i, i);
    check_ok(kiln_config_set(cfg, set));
  }
  assert_string_equal(kiln_config_get_raw(cfg, "plugin.p1", "key37"), "37");
  kiln_config_free(cfg);
}

static void test_origins(void **state) {
  (void)state;
  kiln_config_t *cfg = new_config();
  check_ok(kiln_config_load_string(cfg, "[engine]\n\nseed = 5\n", "site.ini"));
  check_ok(kiln_config_load_string(cfg, "[server]\nport = 1234\n", NULL));
  check_ok(kiln_config_set(cfg, "log.level=info"));
  assert_string_equal(kiln_config_origin(cfg, "engine", "seed"), "site.ini:3");
  assert_string_equal(kiln_config_origin(cfg, "server", "port"), "<string>:2");
  assert_string_equal(kiln_config_origin(cfg, "log", "level"), "--set");
  assert_string_equal(kiln_config_origin(cfg, "log", "format"), "default");
  EXPECT_INVALID(kiln_config_load_string(cfg, "[engine]\nseed = x\n", NULL), "<string>:2: ");
  kiln_config_free(cfg);
}

/* ---- writing, help, files ------------------------------------------------------------------- */

static void test_write_round_trip(void **state) {
  (void)state;
  kiln_config_t *a = new_config();
  check_ok(load(a,
                "[model]\npath = /m/qwen 0.5b\ndtype = float16\n[engine]\n"
                "seed = 9223372036854775807\n[cache]\ngpu_memory_utilization = 0.123456789\n"
                "enable_prefix_caching = off\n[graph]\ncapture_sizes = 1, 2 ,3\n"
                "[plugin.trace]\nlevel = 2\n[plugin.b]\nk = v\n"));
  check_ok(kiln_config_set(a, "server.api_key=sk-x;y"));
  check_ok(kiln_config_set(a, "plugin.trace.out=/tmp/x"));
  check_ok(kiln_config_set(a, "plugin.e.k="));
  check_ok(kiln_config_set(a, "backend.name=./libkiln-backend-z.so"));
  /* A value starting with ';' (no space before it in the file) is not a comment. */
  check_ok(kiln_config_load_string(a, "[backend]\npath =;x:/y\n[plugin.c]\nk=;\n", "s.ini"));
  assert_string_equal(kiln_config_get_string(a, "backend", "path"), ";x:/y");
  char *text_a = capture(a);
  assert_non_null(strstr(text_a, "; from --set\napi_key = sk-x;y\n"));
  assert_non_null(strstr(text_a, "; from t.ini:2\npath = /m/qwen 0.5b\n"));
  assert_non_null(strstr(text_a, "\npath =;x:/y\n"));
  assert_non_null(strstr(text_a, "[plugin.e]\n; from --set\nk =\n")); /* empty value */
  assert_non_null(strstr(text_a, "[plugin.c]\n; from s.ini:4\nk =;\n"));

  kiln_config_t *b = new_config();
  check_ok(kiln_config_load_string(b, text_a, "written.ini"));
  char *wa = written(a), *wb = written(b);
  assert_string_equal(wa, wb);
  assert_string_equal(kiln_config_get_string(b, "model", "path"), "/m/qwen 0.5b");
  assert_true(kiln_config_get_float(b, "cache", "gpu_memory_utilization") == 0.123456789);
  assert_true(kiln_config_get_int(b, "engine", "seed") == INT64_MAX);
  assert_false(kiln_config_get_bool(b, "cache", "enable_prefix_caching"));
  assert_string_equal(kiln_config_get_raw(b, "plugin.trace", "out"), "/tmp/x");
  assert_string_equal(kiln_config_get_raw(b, "plugin.b", "k"), "v");
  assert_string_equal(kiln_config_get_string(b, "backend", "path"), ";x:/y");
  assert_string_equal(kiln_config_get_raw(b, "plugin.c", "k"), ";");
  assert_string_equal(kiln_config_get_raw(b, "plugin.e", "k"), "");
  const int64_t *sizes = NULL;
  assert_int_equal(kiln_config_get_int_list(b, "graph", "capture_sizes", &sizes), 3);
  /* Every table key is written, so every key of b now comes from the file. */
  for (size_t i = 0; i < NUM_KEYS; i++)
    assert_non_null(
        strstr(kiln_config_origin(b, all_keys[i].section, all_keys[i].key), "written.ini:"));
  /* Plugin sections appear once each, in the order first set. */
  char *trace = strstr(wa, "[plugin.trace]\nlevel = 2\nout = /tmp/x\n");
  char *pb = strstr(wa, "[plugin.b]\nk = v\n");
  assert_non_null(trace);
  assert_non_null(pb);
  assert_true(trace < pb);
  free(wa);
  free(wb);
  free(text_a);
  kiln_config_free(a);
  kiln_config_free(b);
}

static void test_print_help(void **state) {
  (void)state;
  char *help = capture(NULL);
  for (size_t i = 0; i < NUM_KEYS; i++) {
    char header[64];
    snprintf(header, sizeof(header), "\n[%s]\n", all_keys[i].section);
    const char *sec = strstr(help, header);
    assert_non_null(sec);
    /* The key is listed in its own section: after the header, before the next one. */
    char needle[64];
    snprintf(needle, sizeof(needle), "\n  %s ", all_keys[i].key);
    const char *key = sec ? strstr(sec, needle) : NULL;
    const char *next = sec ? strstr(sec + 1, "\n[") : NULL;
    if (!key || (next && key > next)) {
      fail_msg("help lacks %s.%s", all_keys[i].section, all_keys[i].key);
    } else if (all_keys[i].def[0] && !strstr(key, all_keys[i].def)) {
      fail_msg("help lacks the default of %s.%s", all_keys[i].section, all_keys[i].key);
    }
  }
  static const char *const facts[] = {"[1, 65536]",
                                      "[0.01, 1]",
                                      "auto | float32 | float16 | bfloat16",
                                      "8 | 16 | 32 | 64 | 128",
                                      "each in [1, 4096]",
                                      "[plugin.<name>]",
                                      "--set section.key=value",
                                      "0 = all cores",
                                      "int list",
                                      "bool",
                                      "float",
                                      "enum",
                                      "string"};
  for (size_t i = 0; i < sizeof(facts) / sizeof(facts[0]); i++)
    if (!strstr(help, facts[i])) fail_msg("help lacks \"%s\"", facts[i]);
  free(help);
}

/* Writes text to a new temporary file; returns its path (caller unlinks and frees). */
static char *temp_file(const char *text, size_t len) {
  char *path = strdup("/tmp/kiln_test_config_XXXXXX");
  assert_non_null(path);
  int fd = mkstemp(path);
  assert_true(fd >= 0);
  assert_int_equal(write(fd, text, len), (ssize_t)len);
  assert_int_equal(close(fd), 0);
  return path;
}

static void test_load_file(void **state) {
  (void)state;
  kiln_config_t *cfg = new_config();
  static const char text[] = "; site config\n[server]\nport = 9300\n[plugin.x]\nk = v\n";
  char *path = temp_file(text, sizeof(text) - 1);
  check_ok(kiln_config_load_file(cfg, path));
  assert_int_equal(kiln_config_get_int(cfg, "server", "port"), 9300);
  char origin[64];
  snprintf(origin, sizeof(origin), "%s:3", path);
  assert_string_equal(kiln_config_origin(cfg, "server", "port"), origin);
  unlink(path);
  free(path);

  static const char bad[] = "[server]\nport = 9300\n\nport = 9400\n";
  path = temp_file(bad, sizeof(bad) - 1);
  snprintf(origin, sizeof(origin), "%s:4: ", path);
  EXPECT_INVALID(kiln_config_load_file(cfg, path), origin, "lines 2 and 4");
  unlink(path);
  free(path);

  static const char nul[] = "[server]\nport = 1\0\n";
  path = temp_file(nul, sizeof(nul) - 1);
  snprintf(origin, sizeof(origin), "%s:2: ", path);
  EXPECT_INVALID(kiln_config_load_file(cfg, path), origin, "NUL byte");
  unlink(path);
  free(path);

  path = temp_file("", 0);
  check_ok(kiln_config_load_file(cfg, path));
  unlink(path);
  free(path);

  EXPECT_ERR(kiln_config_load_file(cfg, "/nonexistent/kiln.ini"), KILN_ERR_NOT_FOUND,
             "'/nonexistent/kiln.ini'", "No such file or directory");
  EXPECT_ERR(kiln_config_load_file(cfg, "/tmp"), KILN_ERR_IO, "'/tmp'", "Is a directory");
  if (geteuid() != 0) { /* root reads anything */
    path = temp_file(text, sizeof(text) - 1);
    assert_int_equal(chmod(path, 0), 0);
    EXPECT_ERR(kiln_config_load_file(cfg, path), KILN_ERR_IO, "Permission denied");
    unlink(path);
    free(path);
  }
  assert_int_equal(kiln_config_get_int(cfg, "server", "port"), 9300);
  kiln_config_free(cfg);
}

/* etc/kiln.ini documents every key at its default: it must load and change nothing but
 * [model] path, which names the embedded default model relative to the file. */
static void test_etc_kiln_ini(void **state) {
  (void)state;
  const char *src = getenv("KILN_SOURCE_DIR");
  if (!src) {
    print_message("KILN_SOURCE_DIR is not set; skipping\n");
    skip();
  }
  char path[4096];
  snprintf(path, sizeof(path), "%s/etc/kiln.ini", src);
  kiln_config_t *defaults = new_config();
  kiln_config_t *cfg = new_config();
  check_ok(kiln_config_load_file(cfg, path));
  assert_string_equal(kiln_config_get_string(cfg, "model", "path"), "../share/models/kiln-tiny");
  char resolved[4096], want_path[4200];
  check_ok(kiln_config_get_path(cfg, "model", "path", resolved, sizeof(resolved)));
  snprintf(want_path, sizeof(want_path), "%s/etc/../share/models/kiln-tiny", src);
  assert_string_equal(resolved, want_path);
  check_ok(kiln_config_set(cfg, "model.path="));
  char *want = written(defaults), *got = written(cfg);
  assert_string_equal(got, want);
  for (size_t i = 0; i < NUM_KEYS; i++) {
    const char *origin = kiln_config_origin(cfg, all_keys[i].section, all_keys[i].key);
    if (!strcmp(all_keys[i].section, "model") && !strcmp(all_keys[i].key, "path")) continue;
    if (strncmp(origin, path, strlen(path)) != 0)
      fail_msg("etc/kiln.ini does not set %s.%s", all_keys[i].section, all_keys[i].key);
  }
  free(want);
  free(got);
  kiln_config_free(defaults);
  kiln_config_free(cfg);
}

/* ---- programmer errors abort ---------------------------------------------------------------- */

typedef enum misuse {
  MISUSE_UNKNOWN_KEY,
  MISUSE_WRONG_TYPE,
  MISUSE_WORD_ENUM_AS_INT,
  MISUSE_PLUGIN_KEY_TYPED,
  MISUSE_INT_AS_STRING,
  MISUSE_COUNT,
} misuse_t;

static void misuse(kiln_config_t *cfg, misuse_t m) {
  const int64_t *v = NULL;
  switch (m) {
    case MISUSE_UNKNOWN_KEY: (void)kiln_config_get_int(cfg, "engine", "nope"); break;
    case MISUSE_WRONG_TYPE: (void)kiln_config_get_bool(cfg, "engine", "seed"); break;
    case MISUSE_WORD_ENUM_AS_INT: (void)kiln_config_get_int(cfg, "log", "level"); break;
    case MISUSE_PLUGIN_KEY_TYPED: (void)kiln_config_get_int_list(cfg, "plugin.x", "k", &v); break;
    case MISUSE_INT_AS_STRING: (void)kiln_config_get_string(cfg, "server", "port"); break;
    case MISUSE_COUNT: break;
  }
}

static void test_getter_misuse_aborts(void **state) {
  (void)state;
  kiln_config_t *cfg = new_config();
  for (int m = 0; m < MISUSE_COUNT; m++) {
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
      if (!freopen("/dev/null", "w", stderr)) _exit(2);
      misuse(cfg, (misuse_t)m);
      _exit(0);
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    if (!WIFSIGNALED(status) || WTERMSIG(status) != SIGABRT)
      fail_msg("misuse %d did not abort (status %d)", m, status);
  }
  kiln_config_free(cfg);
}

/* kiln_engine_config_key (kiln.h) and kiln_config_row_info: every key of the table once, in
 * --help-config's order, each one a key a fresh config holds at its default, with the type
 * word and help line --help-config prints; nothing past the end. */
static void test_key_list(void **state) {
  (void)state;
  kiln_config_t *cfg = new_config();
  char *help_text = NULL;
  size_t help_len = 0;
  FILE *f = open_memstream(&help_text, &help_len);
  assert_non_null(f);
  kiln_config_print_help(f);
  fclose(f);
  int32_t n = 0;
  const char *sec, *key, *type, *help, *def;
  size_t found = 0, last_help_at = 0;
  while (kiln_engine_config_key(n, &sec, &key, &type, &help)) {
    assert_true(kiln_config_row_info((size_t)n, NULL, NULL, NULL, &def, NULL));
    assert_string_equal(kiln_config_origin(cfg, sec, key), "default");
    assert_string_equal(kiln_config_get_raw(cfg, sec, key), def);
    assert_true(!strcmp(type, "string") || !strcmp(type, "int") || !strcmp(type, "float") ||
                !strcmp(type, "bool") || !strcmp(type, "enum") || !strcmp(type, "int list"));
    /* "  key  type ..." then the help line, after the previous key's */
    char line[256];
    snprintf(line, sizeof(line), "\n  %s ", key);
    const char *at = strstr(help_text + last_help_at, line);
    assert_non_null(at);
    assert_non_null(strstr(at, help));
    last_help_at = (size_t)(at - help_text) + 1;
    for (size_t i = 0; i < NUM_KEYS; i++)
      if (!strcmp(all_keys[i].section, sec) && !strcmp(all_keys[i].key, key)) found++;
    n++;
  }
  assert_int_equal(found, NUM_KEYS);
  assert_true(n >= (int32_t)NUM_KEYS);
  sec = key = type = help = "untouched";
  assert_false(kiln_engine_config_key(n, &sec, &key, &type, &help));
  assert_false(kiln_engine_config_key(-1, &sec, &key, &type, &help));
  assert_false(kiln_engine_config_key(INT32_MAX, NULL, NULL, NULL, NULL));
  assert_string_equal(sec, "untouched");
  assert_string_equal(help, "untouched");
  assert_false(kiln_config_row_info((size_t)n, &sec, NULL, NULL, NULL, NULL));
  assert_true(kiln_engine_config_key(0, NULL, NULL, NULL, NULL));
  free(help_text);
  kiln_config_free(cfg);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_defaults),
      cmocka_unit_test(test_parse_every_type),
      cmocka_unit_test(test_bool_words),
      cmocka_unit_test(test_range_edges),
      cmocka_unit_test(test_int_errors),
      cmocka_unit_test(test_float_errors),
      cmocka_unit_test(test_bool_enum_errors),
      cmocka_unit_test(test_list_errors),
      cmocka_unit_test(test_string_checks),
      cmocka_unit_test(test_unknown_section),
      cmocka_unit_test(test_unknown_key),
      cmocka_unit_test(test_duplicate_key),
      cmocka_unit_test(test_syntax_errors),
      cmocka_unit_test(test_long_lines),
      cmocka_unit_test(test_transactional_load),
      cmocka_unit_test(test_set_overrides),
      cmocka_unit_test(test_set_value_checks),
      cmocka_unit_test(test_plugin_sections),
      cmocka_unit_test(test_origins),
      cmocka_unit_test(test_write_round_trip),
      cmocka_unit_test(test_print_help),
      cmocka_unit_test(test_load_file),
      cmocka_unit_test(test_etc_kiln_ini),
      cmocka_unit_test(test_getter_misuse_aborts),
      cmocka_unit_test(test_key_list),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
