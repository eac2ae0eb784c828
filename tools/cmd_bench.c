/* cmd_bench.c - `kiln bench MODE`: routes to the benchmark modes (see cmd_bench.h). */
#include "cmd_bench.h"

#include <stdio.h>
#include <string.h>

typedef struct bench_mode {
  const char *name;
  int (*run)(kiln_cli_t *cli);
  const char *help;
} bench_mode_t;

static const bench_mode_t bench_modes[] = {
#ifdef KILN_HTTP
    {"serve", kiln_cmd_bench_serve,
     "drive an OpenAI-compatible HTTP server (--url URL): TTFT, TPOT, ITL, throughput"},
#endif
    {"latency", kiln_cmd_bench_latency,
     "the engine in-process: a batch's prefill, time per output token, end to end"},
    {"throughput", kiln_cmd_bench_throughput,
     "the engine in-process: N requests at once (random or --dataset), tokens/s"},
};

static void bench_usage(FILE *f) {
  fputs(
      "usage: kiln bench <mode> [options]   (kiln bench <mode> --help for its options)\n\nmodes:\n",
      f);
  for (size_t i = 0; i < sizeof(bench_modes) / sizeof(bench_modes[0]); i++)
    fprintf(f, "  %-8s %s\n", bench_modes[i].name, bench_modes[i].help);
}

int kiln_cmd_bench(kiln_cli_t *cli) {
  if (cli->argc < 2) {
    bench_usage(stderr);
    return 2;
  }
  const char *mode = cli->argv[1];
  if (strcmp(mode, "--help") == 0 || strcmp(mode, "-h") == 0 || strcmp(mode, "help") == 0) {
    bench_usage(stdout);
    return 0;
  }
  for (size_t i = 0; i < sizeof(bench_modes) / sizeof(bench_modes[0]); i++) {
    if (strcmp(mode, bench_modes[i].name) != 0) continue;
    /* The mode sees itself as the command: argv[0] = "serve", then its options. */
    kiln_cli_t sub = *cli;
    sub.argc--;
    sub.argv++;
    return bench_modes[i].run(&sub);
  }
  fprintf(stderr, "kiln: unknown bench mode '%s'\n\n", mode);
  bench_usage(stderr);
  return 2;
}
