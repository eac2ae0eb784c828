/* cmd_model.c - `kiln score`: the logits of every position to a .npy file, the command that
 * checks a model against a reference. It runs the model directly over a private KV cache, one
 * sequence at a time (`kiln generate` is in cmd_generate.c, on the engine). */
#define _POSIX_C_SOURCE 200809L
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "base/npy.h"
#include "hal/loader.h"
#include "kiln/hal_util.h"
#include "models/model.h"
#include "models/tokenizer/tokenizer.h"

typedef struct mc_args {
  char model_buf[4096];
  const char *model; /* --model, else [model] path */
  const char *ids;   /* --ids 1,2,3 */
  const char *out;
  const char *dtype; /* --dtype, else [model] dtype */
  int64_t chunk;
} mc_args_t;

typedef struct mc_ctx {
  const kiln_hal_plugin_t *plugin;
  kiln_hal_device_t *dev;
  kiln_hal_stream_t *stream;
  kiln_model_t *model;
  kiln_tokens_t ids;
} mc_ctx_t;

static const kiln_opt_t mc_rows[] = {
    KILN_OPT_STRING("--model", "DIR|FILE.gguf", mc_args_t, model,
                    "the model (default: [model] path; empty: the embedded default)"),
    KILN_OPT_STRING("--ids", "1,2,3", mc_args_t, ids, "the token ids to score (required)"),
    KILN_OPT_STRING("--out", "FILE.npy", mc_args_t, out,
                    "where the logits go: float32 [len(ids), vocab] (required)"),
    KILN_OPT_STRING("--dtype", "NAME", mc_args_t, dtype,
                    "auto, float32, float16 or bfloat16 (default: [model] dtype)"),
    KILN_OPT_INT("--chunk", "N", mc_args_t, chunk, 0, 1 << 24,
                 "most tokens per forward pass (default 0: all of them at once)"),
};

static const kiln_opts_t mc_opts = {
    .cmd = "score",
    .usage =
        "usage: kiln score [--model DIR|FILE.gguf] --ids 1,2,3 --out FILE.npy [--chunk N]\n"
        "                  [--dtype auto|float32|float16|bfloat16]\n"
        "Runs the model over the ids (one sequence) and writes the logits of every position\n"
        "to a .npy file: the command that checks a model against a reference.\n",
    .opts = mc_rows,
    .num_opts = KILN_OPTS_COUNT(mc_rows),
    .common = &kiln_cli_common_opts,
};

/* Parses the options; *out_help when --help came (and was printed). */
static kiln_status_t mc_parse(kiln_cli_t *cli, mc_args_t *a, bool *out_help) {
  const char *cmd = mc_opts.cmd;
  memset(a, 0, sizeof(*a));
  kiln_status_t st = kiln_opts_parse(&mc_opts, cli->argc, cli->argv, a, out_help);
  if (st || *out_help) return st;
  if (!a->model || !a->model[0]) {
    /* [model] path (relative to its INI file), or the embedded default model. */
    kiln_status_t pst = kiln_config_model_path(cli->config, a->model_buf, sizeof(a->model_buf));
    if (pst) return kiln_status_annotate(pst, "%s", cmd);
    a->model = a->model_buf;
  }
  if (!a->out)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: --out FILE.npy is required", cmd);
  if (!a->ids) return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: give --ids 1,2,3", cmd);
  return NULL;
}

static int32_t mc_block_size(kiln_cli_t *cli) {
  return atoi(kiln_config_get_string(cli->config, "cache", "block_size"));
}

/* Opens the backend, a device and a stream, and the model, sized for `batch` tokens per
 * forward and sequences of up to `total` tokens. */
static kiln_status_t mc_open_model(kiln_cli_t *cli, const mc_args_t *a, int32_t batch,
                                   int64_t total, mc_ctx_t *c) {
  kiln_status_t st = kiln_cli_registry(cli);
  if (st) return st;
  const char *want = kiln_config_get_string(cli->config, "backend", "name");
  if ((st = kiln_hal_registry_open(cli->registry, want, &c->plugin))) return st;
  const kiln_hal_backend_t *be = &c->plugin->table;
  int32_t dev_index = (int32_t)kiln_config_get_int(cli->config, "backend", "device");
  kiln_hal_error_t *e = be->device_open(dev_index, &c->dev);
  if (!e) e = be->stream_create(c->dev, &c->stream);
  if (e) return kiln_hal_status_from_error(e, "opening the device");
  const char *dts = a->dtype ? a->dtype : kiln_config_get_string(cli->config, "model", "dtype");
  int32_t dtype;
  if ((st = kiln_cli_dtype(dts, &dtype))) return st;
  kiln_model_options_t mo = {0};
  mo.dtype = dtype;
  mo.max_tokens = batch;
  mo.max_seqs = 1;
  mo.max_logits = batch;
  mo.max_model_len = kiln_config_get_int(cli->config, "model", "max_model_len");
  mo.device_index = dev_index;
  mo.max_blocks_per_seq = (int32_t)((total + mc_block_size(cli) - 1) / mc_block_size(cli));
  return kiln_model_load(a->model, be, c->dev, c->stream, &mo, &c->model);
}

static void mc_close(mc_ctx_t *c) {
  kiln_model_free(c->model);
  kiln_tokens_free(&c->ids);
  if (c->plugin) {
    if (c->stream) c->plugin->table.stream_destroy(c->stream);
    if (c->dev) c->plugin->table.device_close(c->dev);
  }
}

static kiln_status_t mc_check_ids(const mc_ctx_t *c, const char *cmd) {
  int64_t V = kiln_model_get_config(c->model)->vocab_size;
  for (size_t i = 0; i < c->ids.len; i++)
    if (c->ids.ids[i] >= V)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s: token id %d (position %zu) is outside the vocabulary (%lld)",
                              cmd, c->ids.ids[i], i, (long long)V);
  if ((int64_t)c->ids.len > kiln_model_max_len(c->model))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: %zu tokens exceed the model's context of %lld", cmd, c->ids.len,
                            (long long)kiln_model_max_len(c->model));
  return NULL;
}

int kiln_cmd_score(kiln_cli_t *cli) {
  mc_args_t a;
  mc_ctx_t c;
  memset(&c, 0, sizeof(c));
  float *logits = NULL;
  bool help = false;
  kiln_status_t st = mc_parse(cli, &a, &help);
  if (!st && help) return 0;
  if (!st) st = kiln_cli_parse_ids("score", a.ids, &c.ids.ids, &c.ids.len);
  c.ids.cap = c.ids.len;
  int32_t n = (int32_t)c.ids.len;
  int32_t chunk = a.chunk > 0 && a.chunk < n ? (int32_t)a.chunk : n;
  if (!st) st = mc_open_model(cli, &a, chunk, n, &c);
  if (!st) st = mc_check_ids(&c, "score");
  int64_t V = st ? 0 : kiln_model_get_config(c.model)->vocab_size;
  if (!st && !(logits = malloc((size_t)n * (size_t)V * sizeof(float))))
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "score: out of memory for %d x %lld logits", n,
                          (long long)V);
  if (!st) st = kiln_model_score(c.model, c.ids.ids, n, chunk, mc_block_size(cli), logits);
  if (!st) st = kiln_npy_write_f32(a.out, logits, n, V);
  free(logits);
  mc_close(&c);
  if (st) return kiln_cli_fail(st);
  return 0;
}
