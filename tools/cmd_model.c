/* cmd_model.c - `kiln score` (logits of every position to a .npy file) and `kiln generate`
 * (a single-sequence continuation): the commands that check a model against a reference.
 * Both run the model directly over a private KV cache, one sequence at a time. */
#define _POSIX_C_SOURCE 200809L /* strdup, strndup, clock_gettime */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "core/json.h"
#include "core/npy.h"
#include "core/strbuf.h"
#include "hal/loader.h"
#include "kiln/hal_util.h"
#include "models/model.h"
#include "models/tokenizer/tokenizer.h"

typedef struct mc_args {
  const char *model; /* --model, else [model] path */
  const char *ids;   /* --ids 1,2,3 */
  const char *prompt;
  const char *out;
  const char *dtype; /* --dtype, else [model] dtype */
  int64_t max_tokens, chunk, seed;
  double temperature, top_p;
  int64_t top_k;
  bool ignore_eos, json, has_seed;
} mc_args_t;

typedef struct mc_ctx {
  const kiln_hal_plugin_t *plugin;
  kiln_hal_device_t *dev;
  kiln_hal_stream_t *stream;
  kiln_model_t *model;
  kiln_tokenizer_t *tok;
  kiln_tokens_t ids;
} mc_ctx_t;

static kiln_status_t mc_bad(const char *cmd, const char *fmt, const char *what) {
  return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: %s '%s'", cmd, fmt, what);
}

static kiln_status_t mc_int(const char *cmd, const char *opt, const char *v, int64_t lo, int64_t hi,
                            int64_t *out) {
  char *end;
  errno = 0;
  long long x = strtoll(v, &end, 10);
  if (errno || end == v || *end || x < lo || x > hi)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: %s wants an integer in [%lld, %lld], got '%s'", cmd, opt,
                            (long long)lo, (long long)hi, v);
  *out = x;
  return NULL;
}

static kiln_status_t mc_float(const char *cmd, const char *opt, const char *v, double lo, double hi,
                              double *out) {
  char *end;
  errno = 0;
  double x = strtod(v, &end);
  if (errno || end == v || *end || !(x >= lo && x <= hi))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: %s wants a number in [%g, %g], got '%s'", cmd, opt, lo, hi, v);
  *out = x;
  return NULL;
}

/* Options shared by score and generate; `gen` enables generate's. */
static kiln_status_t mc_parse(kiln_cli_t *cli, bool gen, mc_args_t *a) {
  const char *cmd = cli->argv[0];
  memset(a, 0, sizeof(*a));
  a->max_tokens = 64;
  a->top_p = 1.0;
  kiln_status_t st = NULL;
  for (int i = 1; i < cli->argc && !st; i++) {
    const char *o = cli->argv[i];
    const char *v = i + 1 < cli->argc ? cli->argv[i + 1] : NULL;
#define TAKES(name) (strcmp(o, name) == 0 && v && (i++, 1))
    if (TAKES("--model"))
      a->model = v;
    else if (TAKES("--ids"))
      a->ids = v;
    else if (TAKES("--dtype"))
      a->dtype = v;
    else if (TAKES("--chunk"))
      st = mc_int(cmd, o, v, 0, 1 << 24, &a->chunk);
    else if (!gen && TAKES("--out"))
      a->out = v;
    else if (gen && TAKES("--prompt"))
      a->prompt = v;
    else if (gen && TAKES("--max-tokens"))
      st = mc_int(cmd, o, v, 0, 1 << 24, &a->max_tokens);
    else if (gen && TAKES("--temperature"))
      st = mc_float(cmd, o, v, 0, 100, &a->temperature);
    else if (gen && TAKES("--top-p"))
      st = mc_float(cmd, o, v, 1e-6, 1, &a->top_p);
    else if (gen && TAKES("--top-k"))
      st = mc_int(cmd, o, v, 0, 1 << 30, &a->top_k);
    else if (gen && TAKES("--seed"))
      st = mc_int(cmd, o, v, 0, INT64_MAX, &a->seed), a->has_seed = true;
    else if (gen && strcmp(o, "--ignore-eos") == 0)
      a->ignore_eos = true;
    else if (gen && strcmp(o, "--json") == 0)
      a->json = true;
    else
      st = mc_bad(cmd, "unknown or incomplete option", o);
#undef TAKES
  }
  if (st) return st;
  if (!a->model || !a->model[0]) a->model = kiln_config_get_string(cli->config, "model", "path");
  if (!a->model || !a->model[0])
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: no model: give --model DIR (or a .gguf file) or set [model] path",
                            cmd);
  if (!gen && !a->out)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: --out FILE.npy is required", cmd);
  if ((a->ids != NULL) == (a->prompt != NULL))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: give %s", cmd,
                            gen ? "exactly one of --ids 1,2,3 and --prompt TEXT" : "--ids 1,2,3");
  return NULL;
}

static kiln_status_t mc_parse_ids(const char *cmd, const char *s, kiln_tokens_t *out) {
  const char *p = s;
  while (*p) {
    char *end;
    errno = 0;
    long long x = strtoll(p, &end, 10);
    if (end == p || errno || x < 0 || x > INT32_MAX)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s: --ids: '%s' is not a list of token ids "
                              "(non-negative integers separated by commas)",
                              cmd, s);
    if (!kiln_tokens_push(out, (int32_t)x))
      return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
    p = end;
    while (*p == ' ') p++;
    if (*p == ',')
      p++;
    else if (*p)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: --ids: unexpected '%c' in '%s'", cmd,
                              *p, s);
  }
  if (out->len == 0) return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: --ids is empty", cmd);
  return NULL;
}

static int32_t mc_block_size(kiln_cli_t *cli) {
  return atoi(kiln_config_get_string(cli->config, "cache", "block_size"));
}

static int32_t mc_dtype(const char *name) {
  if (!name || !strcmp(name, "auto")) return -1;
  if (!strcmp(name, "float32")) return KILN_HAL_F32;
  if (!strcmp(name, "float16")) return KILN_HAL_F16;
  if (!strcmp(name, "bfloat16")) return KILN_HAL_BF16;
  return -2;
}

/* The directory a tokenizer would sit in: the model directory, or a .gguf file's folder. */
static char *mc_tokenizer_dir(const char *model) {
  size_t n = strlen(model);
  if (n > 5 && strcmp(model + n - 5, ".gguf") == 0) {
    const char *slash = strrchr(model, '/');
    return slash ? strndup(model, (size_t)(slash - model)) : strdup(".");
  }
  return strdup(model);
}

/* Loads the tokenizer when the model folder has a tokenizer.json (else leaves it NULL). */
static kiln_status_t mc_open_tokenizer(const mc_args_t *a, mc_ctx_t *c) {
  char *tdir = mc_tokenizer_dir(a->model);
  if (!tdir) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  char path[4096];
  snprintf(path, sizeof(path), "%s/tokenizer.json", tdir);
  kiln_status_t st = NULL;
  FILE *f = fopen(path, "rb");
  if (f) {
    fclose(f);
    st = kiln_tokenizer_load(tdir, &c->tok);
  }
  free(tdir);
  return st;
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
  int32_t dtype = mc_dtype(dts);
  if (dtype == -2)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "--dtype: '%s' is not one of auto, float32, float16, bfloat16", dts);
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
  kiln_tokenizer_free(c->tok);
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
  kiln_status_t st = mc_parse(cli, false, &a);
  if (!st) st = mc_parse_ids("score", a.ids, &c.ids);
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

/* splitmix64: the per-request generator behind the sampler's uniforms. */
static double mc_uniform(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

/* Samples the next token from the logits row on the device (argmax when temperature is 0).
 * Sampling parameters travel in a small device buffer. */
static kiln_status_t mc_sample(mc_ctx_t *c, const mc_args_t *a, uint64_t *rng,
                               kiln_hal_buffer_t *buf, int32_t *out_id) {
  const kiln_hal_backend_t *be = &c->plugin->table;
  kiln_hal_tensor_t logits = kiln_model_logits(c->model, 1);
  int64_t one = 1;
  kiln_hal_tensor_t id_t = kiln_hal_tensor_make(buf, 0, KILN_HAL_I32, 1, &one);
  kiln_hal_error_t *e;
  if (a->temperature <= 0) {
    kiln_hal_argmax_args_t am;
    memset(&am, 0, sizeof(am));
    am.struct_size = sizeof(am);
    am.logits = logits;
    am.out_ids = id_t;
    e = be->argmax(c->stream, &am);
  } else {
    struct {
      float temp, top_p, u;
      int32_t top_k;
    } p = {(float)a->temperature, (float)a->top_p, (float)mc_uniform(rng), (int32_t)a->top_k};
    e = be->copy_h2d(c->stream, buf, 256, &p, sizeof(p));
    if (!e) {
      kiln_hal_sample_args_t sa;
      memset(&sa, 0, sizeof(sa));
      sa.struct_size = sizeof(sa);
      sa.logits = logits;
      sa.temperature = kiln_hal_tensor_make(buf, 256, KILN_HAL_F32, 1, &one);
      sa.top_p = kiln_hal_tensor_make(buf, 260, KILN_HAL_F32, 1, &one);
      sa.uniform = kiln_hal_tensor_make(buf, 264, KILN_HAL_F32, 1, &one);
      sa.top_k = kiln_hal_tensor_make(buf, 268, KILN_HAL_I32, 1, &one);
      sa.out_ids = id_t;
      e = be->sample(c->stream, &sa);
    }
  }
  if (!e) e = be->copy_d2h(c->stream, out_id, buf, 0, 4);
  if (!e) e = be->stream_sync(c->stream);
  return e ? kiln_hal_status_from_error(e, "sampling") : NULL;
}

static bool mc_is_eos(const kiln_model_config_t *cfg, int32_t id) {
  for (int i = 0; i < cfg->num_eos; i++)
    if (cfg->eos_token_ids[i] == id) return true;
  return false;
}

int kiln_cmd_generate(kiln_cli_t *cli) {
  mc_args_t a;
  mc_ctx_t c;
  memset(&c, 0, sizeof(c));
  kiln_kv_cache_t *kv = NULL;
  kiln_hal_buffer_t *sbuf = NULL;
  kiln_tokens_t out = KILN_TOKENS_INIT;
  kiln_strbuf_t text = KILN_STRBUF_INIT;
  int32_t *bt = NULL;
  const char *finish = "length";
  kiln_status_t st = mc_parse(cli, true, &a);
  if (!st && a.ids) st = mc_parse_ids("generate", a.ids, &c.ids);
  int32_t chunk = (int32_t)(a.chunk > 0 ? a.chunk : 512);
  if (!st) st = mc_open_tokenizer(&a, &c);
  if (!st && a.prompt) {
    if (!c.tok)
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "generate: --prompt needs a tokenizer.json beside the model (%s); "
                            "give --ids instead",
                            a.model);
    else
      st = kiln_tokenizer_encode(c.tok, a.prompt, strlen(a.prompt), true, &c.ids);
    if (!st && c.ids.len == 0)
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "generate: the prompt encodes to no tokens");
  }
  if (!st) st = mc_open_model(cli, &a, chunk, (int64_t)c.ids.len + a.max_tokens, &c);
  if (!st) st = mc_check_ids(&c, "generate");
  const kiln_model_config_t *cfg = st ? NULL : kiln_model_get_config(c.model);
  const kiln_hal_backend_t *be = c.plugin ? &c.plugin->table : NULL;
  int32_t n = (int32_t)c.ids.len;
  int64_t total = n + a.max_tokens;
  if (!st && total > kiln_model_max_len(c.model)) total = kiln_model_max_len(c.model);
  int32_t bs = mc_block_size(cli);
  int32_t nb = st ? 0 : (int32_t)((total + bs - 1) / bs);
  if (!st) st = kiln_model_kv_create(c.model, nb, bs, &kv);
  if (!st) {
    kiln_hal_error_t *e = be->buffer_alloc(c.dev, 512, 0, &sbuf);
    if (e) st = kiln_hal_status_from_error(e, "sampling buffer");
  }
  if (!st && !(bt = malloc((size_t)nb * 4)))
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  for (int32_t i = 0; !st && i < nb; i++) bt[i] = i;
  uint64_t rng =
      a.has_seed ? (uint64_t)a.seed : (uint64_t)kiln_config_get_int(cli->config, "engine", "seed");
  struct timespec t0, t1, t2;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  t1 = t0;
  /* Prefill in chunks, then one token per step; each step samples from its last row. */
  int32_t len = 0;
  kiln_tokens_t *seq = &c.ids;
  while (!st && (int64_t)out.len < a.max_tokens && len < total) {
    int32_t t = len < n ? (n - len < chunk ? n - len : chunk) : 1;
    const int32_t *ids = len < n ? seq->ids + len : &out.ids[out.len - 1];
    st = kiln_model_forward_seq(c.model, kv, bt, nb, ids, len, t, len + t >= n ? 1 : 0);
    len += t;
    if (st || len < n) continue;
    int32_t id;
    if ((st = mc_sample(&c, &a, &rng, sbuf, &id))) break;
    if (out.len == 0) clock_gettime(CLOCK_MONOTONIC, &t1);
    if (!kiln_tokens_push(&out, id)) st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
    if (!a.ignore_eos && mc_is_eos(cfg, id)) {
      finish = "stop";
      break;
    }
  }
  clock_gettime(CLOCK_MONOTONIC, &t2);
  if (!st && c.tok) st = kiln_tokenizer_decode(c.tok, out.ids, out.len, true, &text);
  if (!st) {
    double ttft = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    double all = (double)(t2.tv_sec - t0.tv_sec) + 1e-9 * (double)(t2.tv_nsec - t0.tv_nsec);
    if (a.json) {
      kiln_strbuf_t j = KILN_STRBUF_INIT;
      kiln_strbuf_printf(&j, "{\"prompt_ids\": [");
      for (size_t i = 0; i < c.ids.len; i++)
        kiln_strbuf_printf(&j, "%s%d", i ? ", " : "", c.ids.ids[i]);
      kiln_strbuf_printf(&j, "], \"token_ids\": [");
      for (size_t i = 0; i < out.len; i++)
        kiln_strbuf_printf(&j, "%s%d", i ? ", " : "", out.ids[i]);
      kiln_strbuf_printf(&j, "]");
      if (c.tok) {
        kiln_strbuf_printf(&j, ", \"text\": ");
        kiln_json_write_string(&j, kiln_strbuf_cstr(&text), text.len, false);
      }
      kiln_strbuf_printf(&j,
                         ", \"finish_reason\": \"%s\", \"usage\": {\"prompt_tokens\": %zu, "
                         "\"completion_tokens\": %zu}, \"time_to_first_token_s\": %.6f, "
                         "\"total_time_s\": %.6f}\n",
                         finish, c.ids.len, out.len, ttft, all);
      if (!kiln_strbuf_ok(&j))
        st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
      else
        fputs(kiln_strbuf_cstr(&j), stdout);
      kiln_strbuf_free(&j);
    } else if (c.tok) {
      printf("%s%s\n", a.prompt ? a.prompt : "", kiln_strbuf_cstr(&text));
    } else {
      for (size_t i = 0; i < out.len; i++) printf("%s%d", i ? "," : "", out.ids[i]);
      printf("\n");
    }
    if (!a.json)
      fprintf(stderr,
              "kiln: %zu prompt + %zu generated tokens, first token %.1f ms, %.1f tokens/s\n",
              c.ids.len, out.len, 1e3 * ttft,
              out.len > 1 && all > ttft ? (double)(out.len - 1) / (all - ttft) : 0.0);
  }
  free(bt);
  kiln_tokens_free(&out);
  kiln_strbuf_free(&text);
  if (sbuf) be->buffer_free(sbuf);
  kiln_kv_cache_free(kv);
  mc_close(&c);
  if (st) return kiln_cli_fail(st);
  return 0;
}
