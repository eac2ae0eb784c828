/* cli.h - what every `kiln` subcommand shares: option parsing for --config/--set, the
 * config file search, and opening the configured backend. */
#ifndef KILN_TOOLS_CLI_H
#define KILN_TOOLS_CLI_H

#include <stdio.h>

#include "core/config.h"
#include "core/status.h"
#include "hal/loader.h"

typedef struct kiln_cli {
  int argc;           /* the subcommand's own arguments (after the common ones are removed) */
  char **argv;
  const char *config_path; /* the file loaded, or NULL for built-in defaults */
  kiln_config_t *config;
  kiln_hal_registry_t *registry; /* created by kiln_cli_registry() */
  const char **sets;   /* the --set overrides, in order (for kiln_engine_create) */
  int num_sets;
} kiln_cli_t;

/* Parses --config FILE and --set section.key=value (repeatable) and --log-level out of argv,
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

int kiln_cmd_info(kiln_cli_t *cli);
int kiln_cmd_selftest(kiln_cli_t *cli);
int kiln_cmd_tokenize(kiln_cli_t *cli);
int kiln_cmd_detokenize(kiln_cli_t *cli);
int kiln_cmd_template(kiln_cli_t *cli);
int kiln_cmd_score(kiln_cli_t *cli);
int kiln_cmd_generate(kiln_cli_t *cli);
int kiln_cmd_perplexity(kiln_cli_t *cli);

#endif /* KILN_TOOLS_CLI_H */
