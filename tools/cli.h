/* cli.h - what every `kiln` subcommand shares: the common options (--config, --set,
 * --log-level), the config file search, and opening the configured backend. Each command's own
 * options are a table of opts.h. */
#ifndef KILN_TOOLS_CLI_H
#define KILN_TOOLS_CLI_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "base/config.h"
#include "base/status.h"
#include "hal/loader.h"
#include "opts.h"

typedef struct kiln_cli {
  int argc; /* the subcommand's own arguments (after the common ones are removed) */
  char **argv;
  const char *config_path; /* the file loaded, or NULL for built-in defaults */
  kiln_config_t *config;
  kiln_hal_registry_t *registry; /* created by kiln_cli_registry() */
  const char **sets;             /* the --set overrides, in order (for kiln_engine_create) */
  int num_sets;
} kiln_cli_t;

/* The options every command takes: --config FILE, --set section.key=value (repeatable) and
 * --log-level LEVEL; each command's table lists them as its `common` options. */
extern const kiln_opts_t kiln_cli_common_opts;

/* Takes the common options out of argv (anywhere in it; "--config=FILE" works too),
 * loads the config (explicit file, else $KILN_CONFIG, else ./etc/kiln.ini, else the
 * installed one, else built-in defaults), applies the overrides and the [log] settings.
 * The remaining arguments are left in cli->argc/argv (argv[0] = the subcommand name). */
kiln_status_t kiln_cli_init(kiln_cli_t *cli, int argc, char **argv);

/* Builds the plugin registry from [backend] path and threads. */
kiln_status_t kiln_cli_registry(kiln_cli_t *cli);

void kiln_cli_free(kiln_cli_t *cli);

/* Prints a status as "kiln: <message>" on stderr and frees it; returns the exit code 1. */
int kiln_cli_fail(kiln_status_t st);

/* Formats a byte count as "23.4 GiB" into buf. */
const char *kiln_cli_bytes(char *buf, size_t n, unsigned long long bytes);

/* ---- option values (the options themselves: opts.h) --------------------------------------- */

/* Parses --ids: token ids (non-negative integers that fit int32) separated by commas, spaces
 * allowed after each id. On success *out_ids is a malloc'ed array of *out_len >= 1 ids (the
 * caller frees it). Errors: KILN_ERR_INVALID_ARGUMENT for a malformed or empty list (naming
 * the list), KILN_ERR_OUT_OF_MEMORY; then *out_ids is NULL and *out_len 0. */
kiln_status_t kiln_cli_parse_ids(const char *cmd, const char *s, int32_t **out_ids,
                                 size_t *out_len);

/* Parses a --dtype value: "auto" (or NULL) = -1, the checkpoint's dtype; float32, float16,
 * bfloat16 = the KILN_HAL_* dtype. Errors: KILN_ERR_INVALID_ARGUMENT for any other name. */
kiln_status_t kiln_cli_dtype(const char *name, int32_t *out_dtype);

/* Parses a --quantization ([model] quantization) value: "none" (or NULL) = KILN_QUANT_NONE,
 * "fp8" = KILN_QUANT_FP8 (kiln_model_options_t.quantization). Errors:
 * KILN_ERR_INVALID_ARGUMENT for any other name. */
kiln_status_t kiln_cli_quantization(const char *name, int32_t *out_method);

/* Seconds on the monotonic clock (for timing runs). */
double kiln_cli_now(void);

/* Summary statistics of v[n] in v's own units; v is sorted in place. Percentiles interpolate
 * linearly between ranks (numpy's default). All zero when n is 0. */
typedef struct kiln_cli_stats {
  size_t count;
  double mean, p50, p90, p99, min, max;
} kiln_cli_stats_t;
kiln_cli_stats_t kiln_cli_stats(double *v, size_t n);

int kiln_cmd_info(kiln_cli_t *cli);
int kiln_cmd_selftest(kiln_cli_t *cli);
int kiln_cmd_tokenize(kiln_cli_t *cli);
int kiln_cmd_detokenize(kiln_cli_t *cli);
int kiln_cmd_template(kiln_cli_t *cli);
int kiln_cmd_score(kiln_cli_t *cli);
int kiln_cmd_generate(kiln_cli_t *cli);
int kiln_cmd_chat(kiln_cli_t *cli);
int kiln_cmd_perplexity(kiln_cli_t *cli);
int kiln_cmd_serve(kiln_cli_t *cli);
int kiln_cmd_download(kiln_cli_t *cli);

#endif /* KILN_TOOLS_CLI_H */
