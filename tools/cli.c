/* cli.c - shared option handling for the `kiln` subcommands (see cli.h). */
#define _POSIX_C_SOURCE 200809L
#include "cli.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"
#include "models/model_config.h"

#ifndef KILN_INSTALL_SYSCONFDIR
#define KILN_INSTALL_SYSCONFDIR "/usr/local/etc"
#endif

static int cli_file_exists(const char *path) { return access(path, R_OK) == 0; }

/* The config file to use when --config is not given; NULL = built-in defaults. */
static const char *cli_default_config(void) {
  const char *env = getenv("KILN_CONFIG");
  if (env && *env) return env;
  if (cli_file_exists("etc/kiln.ini")) return "etc/kiln.ini";
  if (cli_file_exists(KILN_INSTALL_SYSCONFDIR "/kiln/kiln.ini"))
    return KILN_INSTALL_SYSCONFDIR "/kiln/kiln.ini";
  return NULL;
}

static const char *cli_plugin_config_get(void *ctx, const char *plugin, const char *key) {
  char section[160];
  snprintf(section, sizeof(section), "plugin.%s", plugin);
  return kiln_config_get_raw((const kiln_config_t *)ctx, section, key);
}

/* The index-th key of [plugin.<plugin>] (host->config_key of ABI 1.1). */
static const char *cli_plugin_config_key(void *ctx, const char *plugin, int32_t index) {
  char section[160];
  snprintf(section, sizeof(section), "plugin.%s", plugin);
  return index < 0 ? NULL
                   : kiln_config_section_key((const kiln_config_t *)ctx, section, (size_t)index);
}

/* The options every command takes (kiln_cli_init() takes them out of argv). */
typedef struct cli_common {
  const char *config;
  kiln_opt_list_t sets;
  const char *log_level;
} cli_common_t;

static const kiln_opt_t cli_common_rows[] = {
    KILN_OPT_STRING("--config", "FILE", cli_common_t, config,
                    "INI file (default: $KILN_CONFIG, ./etc/kiln.ini, or the\n"
                    "installed kiln.ini; built-in defaults if none exists)"),
    KILN_OPT_LIST("--set", "section.key=value", cli_common_t, sets,
                  "override one key (repeatable; see --help-config)"),
    KILN_OPT_STRING("--log-level", "LEVEL", cli_common_t, log_level, "error|warn|info|debug"),
};

const kiln_opts_t kiln_cli_common_opts = {
    .opts = cli_common_rows,
    .num_opts = KILN_OPTS_COUNT(cli_common_rows),
    .flags = KILN_OPTS_EQUALS | KILN_OPTS_SAY_MISSING,
    .width = 24,
};

kiln_status_t kiln_cli_init(kiln_cli_t *cli, int argc, char **argv) {
  memset(cli, 0, sizeof(*cli));
  kiln_status_t st = NULL;
  cli_common_t common = {NULL, {NULL, 0}, NULL};
  char **rest = calloc((size_t)argc + 1, sizeof(*rest));
  int nrest = 0;
  const char *config_path = NULL;
  if (!rest) {
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
    goto fail;
  }
  if ((st = kiln_opts_extract(&kiln_cli_common_opts, argc, argv, &common, rest, &nrest))) goto fail;
  config_path = common.config;
  if ((st = kiln_config_create(&cli->config))) goto fail;
  if (!config_path) config_path = cli_default_config();
  if (config_path && (st = kiln_config_load_file(cli->config, config_path))) goto fail;
  cli->config_path = config_path;
  for (int i = 0; i < common.sets.n; i++)
    if ((st = kiln_config_set(cli->config, common.sets.v[i]))) goto fail;
  if (common.log_level &&
      (st = kiln_config_set_value(cli->config, "log", "level", common.log_level, "--log-level")))
    goto fail;
  kiln_log_set_level(
      (kiln_log_level_t)kiln_log_level_parse(kiln_config_get_string(cli->config, "log", "level")));
  kiln_log_set_format(strcmp(kiln_config_get_string(cli->config, "log", "format"), "json") == 0
                          ? KILN_LOG_JSON
                          : KILN_LOG_TEXT);
  cli->argc = nrest;
  cli->argv = rest;
  cli->sets = common.sets.v;
  cli->num_sets = common.sets.n;
  rest = NULL;
  common.sets.v = NULL;
fail:
  kiln_opts_free(&kiln_cli_common_opts, &common);
  free(rest);
  return st;
}

kiln_status_t kiln_cli_registry(kiln_cli_t *cli) {
  kiln_hal_registry_options_t opts = {0};
  opts.config_path = kiln_config_get_string(cli->config, "backend", "path");
  opts.num_threads = (int32_t)kiln_config_get_int(cli->config, "backend", "threads");
  opts.config_get = cli_plugin_config_get;
  opts.config_key = cli_plugin_config_key;
  opts.config_ctx = cli->config;
  return kiln_hal_registry_create(&opts, &cli->registry);
}

void kiln_cli_free(kiln_cli_t *cli) {
  kiln_hal_registry_free(cli->registry);
  kiln_config_free(cli->config);
  free(cli->argv);
  free(cli->sets);
  memset(cli, 0, sizeof(*cli));
}

int kiln_cli_fail(kiln_status_t st) {
  fprintf(stderr, "kiln: %s\n", kiln_status_message(st));
  kiln_status_free(st);
  return 1;
}

const char *kiln_cli_bytes(char *buf, size_t n, unsigned long long bytes) {
  const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = (double)bytes;
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    u++;
  }
  snprintf(buf, n, u ? "%.1f %s" : "%.0f %s", v, units[u]);
  return buf;
}

kiln_status_t kiln_cli_parse_ids(const char *cmd, const char *s, int32_t **out_ids,
                                 size_t *out_len) {
  *out_ids = NULL;
  *out_len = 0;
  kiln_status_t st = NULL;
  int32_t *ids = NULL;
  size_t len = 0, cap = 0;
  const char *p = s;
  while (*p) {
    char *end;
    errno = 0;
    long long x = strtoll(p, &end, 10);
    if (end == p || errno || x < 0 || x > INT32_MAX) {
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: --ids: '%s' is not a list of token ids "
                            "(non-negative integers separated by commas)",
                            cmd, s);
      goto fail;
    }
    if (len == cap) {
      size_t ncap = cap ? 2 * cap : 16;
      int32_t *grown = realloc(ids, ncap * sizeof(*grown));
      if (!grown) {
        st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
        goto fail;
      }
      ids = grown;
      cap = ncap;
    }
    ids[len++] = (int32_t)x;
    p = end;
    while (*p == ' ') p++;
    if (*p == ',') {
      p++;
    } else if (*p) {
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: --ids: unexpected '%c' in '%s'", cmd,
                            *p, s);
      goto fail;
    }
  }
  if (len == 0) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: --ids is empty", cmd);
    goto fail;
  }
  *out_ids = ids;
  *out_len = len;
  return NULL;
fail:
  free(ids);
  return st;
}

kiln_status_t kiln_cli_dtype(const char *name, int32_t *out_dtype) {
  if (!name || !strcmp(name, "auto"))
    *out_dtype = -1;
  else if (!strcmp(name, "float32"))
    *out_dtype = KILN_HAL_F32;
  else if (!strcmp(name, "float16"))
    *out_dtype = KILN_HAL_F16;
  else if (!strcmp(name, "bfloat16"))
    *out_dtype = KILN_HAL_BF16;
  else
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "--dtype: '%s' is not one of auto, float32, float16, bfloat16", name);
  return NULL;
}

kiln_status_t kiln_cli_quantization(const char *name, int32_t *out_method) {
  if (!name || !strcmp(name, "none"))
    *out_method = KILN_QUANT_NONE;
  else if (!strcmp(name, "fp8"))
    *out_method = KILN_QUANT_FP8;
  else
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "--quantization: '%s' is not one of none, fp8", name);
  return NULL;
}

double kiln_cli_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int cli_cmp_double(const void *x, const void *y) {
  double a = *(const double *)x, b = *(const double *)y;
  return (a > b) - (a < b);
}

/* Percentile p of sorted v[n], interpolating between ranks. */
static double cli_percentile(const double *v, size_t n, double p) {
  double rank = p / 100.0 * (double)(n - 1);
  size_t lo = (size_t)floor(rank), hi = (size_t)ceil(rank);
  return v[lo] + (v[hi] - v[lo]) * (rank - (double)lo);
}

kiln_cli_stats_t kiln_cli_stats(double *v, size_t n) {
  kiln_cli_stats_t s = {n, 0, 0, 0, 0, 0, 0};
  if (!n) return s;
  qsort(v, n, sizeof(*v), cli_cmp_double);
  double sum = 0;
  for (size_t i = 0; i < n; i++) sum += v[i];
  s.mean = sum / (double)n;
  s.p50 = cli_percentile(v, n, 50);
  s.p90 = cli_percentile(v, n, 90);
  s.p99 = cli_percentile(v, n, 99);
  s.min = v[0];
  s.max = v[n - 1];
  return s;
}
