/* kiln.c - the `kiln` command: dispatches to the subcommands. */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "cmd_bench.h"
#include "kiln/hal.h"

static const kiln_opts_t config_opts = {
    .cmd = "config",
    .usage =
        "usage: kiln config [--config FILE] [--set section.key=value]...\n"
        "Prints the effective configuration (the file, then the overrides, over the built-in\n"
        "defaults) as an INI file that --config reads back.\n",
    .common = &kiln_cli_common_opts,
};

static int cmd_config(kiln_cli_t *cli) {
  bool help = false;
  kiln_status_t st = kiln_opts_parse(&config_opts, cli->argc, cli->argv, NULL, &help);
  if (st) return kiln_cli_fail(st);
  if (!help) kiln_config_write(cli->config, stdout);
  return 0;
}

typedef struct kiln_command {
  const char *name;
  int (*run)(kiln_cli_t *cli);
  const char *help;
} kiln_command_t;

static const kiln_command_t commands[] = {
    {"info", kiln_cmd_info, "list backend plugins, their devices, and why any were rejected"},
    {"selftest", kiln_cmd_selftest,
     "run a transformer layer's ops on the configured backend against an fp64 reference"},
    {"tokenize", kiln_cmd_tokenize,
     "text on stdin -> token ids (--tokenizer DIR [--special] [--json])"},
    {"detokenize", kiln_cmd_detokenize, "token ids on stdin -> text (--tokenizer DIR)"},
    {"template", kiln_cmd_template,
     "render a chat template (--tokenizer DIR --messages FILE.json [--add-generation-prompt])"},
    {"score", kiln_cmd_score,
     "logits of every position to a .npy file (--model DIR --ids 1,2 [--image P] --out F.npy)"},
    {"generate", kiln_cmd_generate,
     "continue a prompt (--prompt TEXT [--image PATH] | --ids | --messages F) or --input FILE"},
    {"chat", kiln_cmd_chat,
     "an interactive chat in the terminal (--model DIR; /reset, Ctrl-C stops a reply)"},
    {"perplexity", kiln_cmd_perplexity,
     "perplexity of a text file (--model DIR --file TEXT [--ctx N] [--json])"},
#ifdef KILN_HTTP
    {"serve", kiln_cmd_serve,
     "the OpenAI-compatible HTTP server (--model DIR --port N; [server] in the INI file)"},
#endif
    {"bench", kiln_cmd_bench,
     "benchmarks: serve (an HTTP server under load), latency, throughput (the engine)"},
    {"download", kiln_cmd_download,
     "fetch a Hugging Face Hub model into the Hub cache (ORG/NAME[@REV]), print its path"},
    {"config", cmd_config, "print the effective configuration as an INI file"},
};

static void usage(FILE *f) {
  fprintf(f,
          "usage: kiln <command> [--config FILE] [--set section.key=value]... [options]\n"
          "       kiln --help-config | --version | --help\n\ncommands:\n");
  for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
    fprintf(f, "  %-10s %s\n", commands[i].name, commands[i].help);
  fputs("\ncommon options:\n", f);
  kiln_opts_print_rows(&kiln_cli_common_opts, f);
}

int main(int argc, char **argv) {
  if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
      strcmp(argv[1], "help") == 0) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  if (strcmp(argv[1], "--help-config") == 0) {
    kiln_config_print_help(stdout);
    return 0;
  }
  if (strcmp(argv[1], "--version") == 0 || strcmp(argv[1], "version") == 0) {
    printf("kiln %s (backend ABI %d.%d)\n", KILN_VERSION_STRING, KILN_HAL_ABI_MAJOR,
           KILN_HAL_ABI_MINOR);
    return 0;
  }
  const kiln_command_t *cmd = NULL;
  for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
    if (strcmp(argv[1], commands[i].name) == 0) cmd = &commands[i];
  if (!cmd) {
    fprintf(stderr, "kiln: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
  }
  kiln_cli_t cli;
  kiln_status_t st = kiln_cli_init(&cli, argc - 1, argv + 1);
  if (st) {
    kiln_cli_free(&cli);
    return kiln_cli_fail(st);
  }
  int rc = cmd->run(&cli);
  kiln_cli_free(&cli);
  return rc;
}
