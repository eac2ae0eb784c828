/* cmd_bench.h - `kiln bench MODE`: the benchmark modes of the `kiln` command. */
#ifndef KILN_TOOLS_CMD_BENCH_H
#define KILN_TOOLS_CMD_BENCH_H

#include "cli.h"

/* `kiln bench MODE [options]`: cli->argv[0] is "bench", argv[1] the mode. Runs the mode and
 * returns its exit status; 2 (with the list of modes on stderr) for a missing or unknown mode. */
int kiln_cmd_bench(kiln_cli_t *cli);

/* The modes. Each gets a kiln_cli_t whose argv[0] is the mode's name ("serve") and whose other
 * arguments are the mode's options. */

/* `kiln bench serve`: drives an OpenAI-compatible HTTP server with streamed requests and reports
 * TTFT, TPOT, ITL and end-to-end latency and throughput. 0 when every request succeeded, 1
 * otherwise (or on a bad option). */
int kiln_cmd_bench_serve(kiln_cli_t *cli);

/* `kiln bench latency` / `kiln bench throughput` (cmd_bench_offline.c): the engine measured
 * in-process through the public API; a table on stdout and --json FILE. 0 on success. */
int kiln_cmd_bench_latency(kiln_cli_t *cli);
int kiln_cmd_bench_throughput(kiln_cli_t *cli);

#endif /* KILN_TOOLS_CMD_BENCH_H */
