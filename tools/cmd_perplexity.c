/* cmd_perplexity.c - `kiln perplexity`: the perplexity of a text file under a model, computed
 * the way tools/train_default_model.py records it at training time so the two can be compared.
 *
 * Definition: ids = the tokenizer's encoding of the whole file with no special tokens added;
 * consecutive non-overlapping windows of ctx tokens (the last may be shorter; a window of
 * fewer than 2 tokens is dropped); in each window, positions 1..len-1 are scored given the
 * window's preceding tokens; ppl = exp(total NLL / scored tokens). Log-softmax is computed in
 * double on the host from the float32 logits. Each window is run in chunks over one private
 * KV cache, which the next window overwrites from position 0. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "cli.h"
#include "base/strbuf.h"
#include "hal/loader.h"
#include "kiln/hal_util.h"
#include "models/hub/hub.h"
#include "models/model.h"
#include "models/model_tokenizer.h"
#include "models/tokenizer/tokenizer.h"

typedef struct pp_args {
  const char *model;    /* --model, else pp_model_path() */
  char model_buf[4096]; /* the resolved [model] path */
  const char *file;     /* --file */
  const char *dtype;    /* --dtype, else [model] dtype */
  const char *quantization; /* --quantization, else [model] quantization */
  int64_t ctx;          /* --ctx; 0 = the model's context */
  int64_t chunk;        /* --chunk; 0 = min(ctx, 512) */
  bool json;
} pp_args_t;

typedef struct pp_ctx {
  const kiln_hal_plugin_t *plugin;
  kiln_hal_device_t *dev;
  kiln_hal_stream_t *stream;
  kiln_model_t *model;
  kiln_kv_cache_t *kv;
  kiln_tokenizer_t *tok;
  kiln_tokens_t ids;
  int32_t *block_table;
  float *logits; /* [chunk, V] */
} pp_ctx_t;

/* The result of scoring. */
typedef struct pp_result {
  double nll;
  int64_t scored, windows;
} pp_result_t;

static const char pp_usage[] =
    "usage: kiln perplexity [--model DIR|FILE.gguf] --file TEXT [--ctx N] [--chunk N]\n"
    "                       [--dtype auto|float32|float16|bfloat16] [--quantization none|fp8]\n"
    "                       [--json]\n"
    "Encodes TEXT with the tokenizer.json beside the model (no special tokens added), scores\n"
    "it in consecutive windows of N tokens (default: the model's context) and prints the\n"
    "perplexity exp(total NLL / scored tokens). Without --model, [model] path (empty: the\n"
    "embedded default model) is used.\n"
    "--chunk sets the tokens per forward pass within a window (default min(N, 512)).\n";

static const kiln_opt_t pp_rows[] = {
    KILN_OPT_STRING("--model", "DIR|FILE.gguf|ORG/NAME", pp_args_t, model,
                    "the model: a path or a Hub id ORG/NAME[@REV]\n(default: [model] path)"),
    KILN_OPT_STRING("--file", "TEXT", pp_args_t, file, "the text file to score (required)"),
    KILN_OPT_INT("--ctx", "N", pp_args_t, ctx, 2, 1 << 24,
                 "tokens per window (default: the model's context)"),
    KILN_OPT_INT("--chunk", "N", pp_args_t, chunk, 1, 1 << 24,
                 "tokens per forward pass within a window"),
    KILN_OPT_STRING("--dtype", "NAME", pp_args_t, dtype,
                    "auto, float32, float16 or bfloat16 (default: [model] dtype)"),
    KILN_OPT_STRING("--quantization", "NAME", pp_args_t, quantization,
                    "none or fp8: quantize a float checkpoint's Linears to FP8\n"
                    "at load (default: [model] quantization)"),
    KILN_OPT_FLAG("--json", pp_args_t, json, "print one JSON object"),
};

static const kiln_opts_t pp_opts = {
    .cmd = "perplexity",
    .usage = pp_usage,
    .opts = pp_rows,
    .num_opts = KILN_OPTS_COUNT(pp_rows),
    .flags = KILN_OPTS_USAGE_ON_ERROR,
    .common = &kiln_cli_common_opts,
};

/* The model to load: --model, else [model] path resolved as every command resolves it
 * (relative to the config file; empty = the embedded default model). The one place the path
 * is decided. */
static kiln_status_t pp_model_path(kiln_cli_t *cli, pp_args_t *a) {
  kiln_model_location_t *loc = malloc(sizeof(*loc));
  if (!loc) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  kiln_status_t st = kiln_model_resolve(cli->config, a->model, loc);
  memcpy(a->model_buf, loc->path, sizeof(a->model_buf));
  free(loc);
  if (!st) a->model = a->model_buf;
  return st;
}

/* Parses the options; *out_help when --help came (and was printed). */
static kiln_status_t pp_parse(kiln_cli_t *cli, pp_args_t *a, bool *out_help) {
  memset(a, 0, sizeof(*a));
  kiln_status_t st = kiln_opts_parse(&pp_opts, cli->argc, cli->argv, a, out_help);
  if (st || *out_help) return st;
  if (!a->file)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "perplexity: --file TEXT is required\n%s",
                            pp_usage);
  return NULL;
}

/* Reads the whole file into out. */
static kiln_status_t pp_read_file(const char *path, kiln_strbuf_t *out) {
  FILE *f = fopen(path, "rb");
  if (!f)
    return kiln_status_make(errno == ENOENT ? KILN_ERR_NOT_FOUND : KILN_ERR_IO,
                            "perplexity: cannot open %s: %s", path, strerror(errno));
  char chunk[65536];
  size_t n;
  while ((n = fread(chunk, 1, sizeof(chunk), f)) > 0) kiln_strbuf_append(out, chunk, n);
  bool bad = ferror(f) != 0;
  fclose(f);
  if (bad) return kiln_status_make(KILN_ERR_IO, "perplexity: cannot read %s", path);
  if (!kiln_strbuf_ok(out)) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  if (out->len == 0)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "perplexity: %s is empty", path);
  return NULL;
}

/* Loads the model's tokenizer: tokenizer.json beside it (the directory, or a .gguf file's
 * folder), else a .gguf file's own. */
static kiln_status_t pp_open_tokenizer(const char *model, kiln_tokenizer_t **out) {
  struct stat sb;
  if (stat(model, &sb) != 0)
    return kiln_status_make(KILN_ERR_NOT_FOUND, "perplexity: no model at %s: %s", model,
                            strerror(errno));
  kiln_status_t st = kiln_model_open_tokenizer(model, out, NULL, NULL, NULL);
  if (st) return kiln_status_annotate(st, "perplexity");
  if (!*out)
    return kiln_status_make(KILN_ERR_NOT_FOUND,
                            "perplexity: the model %s has no tokenizer (no tokenizer.json beside "
                            "it, no tokenizer in a .gguf file): one is needed to encode the text",
                            model);
  return NULL;
}

static const char *pp_dtype_name(int32_t dt) {
  return dt == KILN_HAL_F32    ? "float32"
         : dt == KILN_HAL_F16  ? "float16"
         : dt == KILN_HAL_BF16 ? "bfloat16"
                               : "?";
}

/* Opens the backend, a device, a stream and the model; then settles ctx (the window) and
 * chunk (tokens per forward) and allocates the KV cache and the host logits for them. */
static kiln_status_t pp_open(kiln_cli_t *cli, pp_args_t *a, pp_ctx_t *c) {
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
  int32_t bs = atoi(kiln_config_get_string(cli->config, "cache", "block_size"));
  int64_t max_model_len = kiln_config_get_int(cli->config, "model", "max_model_len");
  /* The widest window asked for sizes the block tables; without --ctx it is the model's
   * context, unknown until the model is loaded, so allow up to 2^20 tokens (a 256 KiB table). */
  int64_t want_ctx = a->ctx ? a->ctx : max_model_len ? max_model_len : (int64_t)1 << 20;
  int32_t chunk = (int32_t)(a->chunk ? a->chunk : 512);
  if (a->ctx && chunk > a->ctx) chunk = (int32_t)a->ctx;
  kiln_model_options_t mo = {0};
  const char *qs =
      a->quantization ? a->quantization : kiln_config_get_string(cli->config, "model", "quantization");
  if ((st = kiln_cli_quantization(qs, &mo.quantization))) return st;
  mo.dtype = dtype;
  mo.max_tokens = chunk;
  mo.max_seqs = 1;
  mo.max_logits = chunk;
  mo.max_model_len = max_model_len;
  mo.device_index = dev_index;
  mo.max_blocks_per_seq = (int32_t)((want_ctx + bs - 1) / bs);
  if ((st = kiln_model_load(a->model, be, c->dev, c->stream, &mo, &c->model))) return st;
  int64_t max_len = kiln_model_max_len(c->model);
  if (a->ctx > max_len)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "perplexity: --ctx %lld exceeds the model's context of %lld",
                            (long long)a->ctx, (long long)max_len);
  if (!a->ctx) a->ctx = max_len < want_ctx ? max_len : want_ctx;
  if (a->ctx < 2)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "perplexity: the model's context (%lld) is shorter than 2 tokens",
                            (long long)a->ctx);
  if (chunk > a->ctx) chunk = (int32_t)a->ctx;
  a->chunk = chunk;
  int32_t nb = (int32_t)((a->ctx + bs - 1) / bs);
  if ((st = kiln_model_kv_create(c->model, nb, bs, &c->kv))) return st;
  int64_t V = kiln_model_get_config(c->model)->vocab_size;
  c->block_table = malloc((size_t)nb * sizeof(int32_t));
  c->logits = malloc((size_t)chunk * (size_t)V * sizeof(float));
  if (!c->block_table || !c->logits)
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY,
                            "perplexity: out of memory for %d x %lld logits", chunk, (long long)V);
  for (int32_t i = 0; i < nb; i++) c->block_table[i] = i;
  return NULL;
}

static void pp_close(pp_ctx_t *c) {
  kiln_kv_cache_free(c->kv);
  kiln_model_free(c->model);
  kiln_tokenizer_free(c->tok);
  kiln_tokens_free(&c->ids);
  free(c->block_table);
  free(c->logits);
  if (c->plugin) {
    if (c->stream) c->plugin->table.stream_destroy(c->stream);
    if (c->dev) c->plugin->table.device_close(c->dev);
  }
}

/* -log softmax(row)[target], in double. */
static double pp_nll(const float *row, int64_t V, int32_t target) {
  double mx = (double)row[0];
  for (int64_t v = 1; v < V; v++)
    if ((double)row[v] > mx) mx = (double)row[v];
  double sum = exp((double)row[0] - mx);
  for (int64_t v = 1; v < V; v++) sum += exp((double)row[v] - mx);
  return mx + log(sum) - (double)row[target];
}

/* Scores every window of the encoded text. */
static kiln_status_t pp_score(pp_ctx_t *c, const pp_args_t *a, pp_result_t *r) {
  const int64_t V = kiln_model_get_config(c->model)->vocab_size;
  const int32_t nb = kiln_kv_cache_num_blocks(c->kv);
  const int64_t n = (int64_t)c->ids.len;
  memset(r, 0, sizeof(*r));
  for (size_t i = 0; i < c->ids.len; i++)
    if (c->ids.ids[i] < 0 || c->ids.ids[i] >= V)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "perplexity: the tokenizer gave id %d (token %zu), outside the "
                              "model's vocabulary of %lld: tokenizer and model do not match",
                              c->ids.ids[i], i, (long long)V);
  for (int64_t s = 0; s < n; s += a->ctx) {
    const int32_t len = (int32_t)(n - s < a->ctx ? n - s : a->ctx);
    if (len < 2) continue;
    const int32_t *w = c->ids.ids + s;
    for (int32_t off = 0; off < len - 1; off += (int32_t)a->chunk) {
      /* the window's last token is only ever a target, so it is never run */
      int32_t t = len - 1 - off < a->chunk ? len - 1 - off : (int32_t)a->chunk;
      kiln_status_t st =
          kiln_model_forward_seq(c->model, c->kv, c->block_table, nb, w + off, off, t, t);
      if (!st) st = kiln_model_read_logits(c->model, t, c->logits);
      if (st) return st;
      for (int32_t k = 0; k < t; k++) {
        double x = pp_nll(c->logits + (size_t)k * (size_t)V, V, w[off + k + 1]);
        if (!isfinite(x))
          return kiln_status_make(KILN_ERR_INTERNAL,
                                  "perplexity: non-finite log-probability at token %lld",
                                  (long long)(s + off + k + 1));
        r->nll += x;
      }
      r->scored += t;
    }
    r->windows++;
  }
  return NULL;
}

int kiln_cmd_perplexity(kiln_cli_t *cli) {
  pp_args_t a;
  pp_ctx_t c;
  pp_result_t r = {0};
  memset(&c, 0, sizeof(c));
  kiln_strbuf_t text = KILN_STRBUF_INIT;
  struct timespec t0, t1;
  bool help = false;
  kiln_status_t st = pp_parse(cli, &a, &help);
  if (!st && help) return 0;
  if (!st) st = pp_model_path(cli, &a);
  if (!st) st = pp_read_file(a.file, &text);
  if (!st) st = pp_open_tokenizer(a.model, &c.tok);
  if (!st) st = kiln_tokenizer_encode(c.tok, kiln_strbuf_cstr(&text), text.len, false, &c.ids);
  if (!st && c.ids.len < 2)
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "perplexity: %s encodes to %zu token(s); at least 2 are needed", a.file,
                          c.ids.len);
  if (!st) st = pp_open(cli, &a, &c);
  clock_gettime(CLOCK_MONOTONIC, &t0);
  if (!st) st = pp_score(&c, &a, &r);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  if (!st) {
    double secs = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    double ppl = exp(r.nll / (double)r.scored);
    const char *dt = pp_dtype_name(kiln_model_dtype(c.model));
    if (a.json)
      printf(
          "{\"tokens\": %zu, \"scored\": %lld, \"nll\": %.17g, \"perplexity\": %.17g, "
          "\"ctx\": %lld, \"windows\": %lld, \"dtype\": \"%s\", \"seconds\": %.6f}\n",
          c.ids.len, (long long)r.scored, r.nll, ppl, (long long)a.ctx, (long long)r.windows, dt,
          secs);
    else
      printf(
          "perplexity %.4f (%lld tokens scored of %zu, %lld window%s of up to %lld, %s, "
          "nll %.3f, %.2f s)\n",
          ppl, (long long)r.scored, c.ids.len, (long long)r.windows, r.windows == 1 ? "" : "s",
          (long long)a.ctx, dt, r.nll, secs);
  }
  kiln_strbuf_free(&text);
  pp_close(&c);
  if (st) return kiln_cli_fail(st);
  return 0;
}
