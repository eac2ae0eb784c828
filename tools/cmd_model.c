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
#include "models/hub/hub.h"
#include "models/model.h"
#include "models/mrope.h"
#include "models/tokenizer/tokenizer.h"
#include "models/vision/preproc.h"
#include "models/vision/vision.h"

#define MC_MAX_IMAGES 64

typedef struct mc_args {
  char model_buf[4096];
  const char *model; /* --model, else [model] path */
  const char *ids;   /* --ids 1,2,3 */
  const char *out;
  const char *dtype; /* --dtype, else [model] dtype */
  const char *quantization; /* --quantization, else [model] quantization */
  int64_t chunk;
  kiln_opt_list_t images; /* --image PATH, one per placeholder of --ids */
} mc_args_t;

typedef struct mc_ctx {
  const kiln_hal_plugin_t *plugin;
  kiln_hal_device_t *dev;
  kiln_hal_stream_t *stream;
  kiln_model_t *model;
  kiln_tokens_t ids;
} mc_ctx_t;

static const kiln_opt_t mc_rows[] = {
    KILN_OPT_STRING("--model", "DIR|FILE.gguf|ORG/NAME", mc_args_t, model,
                    "the model: a path or a Hub id ORG/NAME[@REV] (default:\n"
                    "[model] path; empty: the embedded default)"),
    KILN_OPT_STRING("--ids", "1,2,3", mc_args_t, ids, "the token ids to score (required)"),
    KILN_OPT_STRING("--out", "FILE.npy", mc_args_t, out,
                    "where the logits go: float32 [len(ids), vocab] (required)"),
    KILN_OPT_STRING("--dtype", "NAME", mc_args_t, dtype,
                    "auto, float32, float16 or bfloat16 (default: [model] dtype)"),
    KILN_OPT_STRING("--quantization", "NAME", mc_args_t, quantization,
                    "none or fp8: quantize a float checkpoint's Linears to FP8\n"
                    "at load (default: [model] quantization)"),
    KILN_OPT_INT("--chunk", "N", mc_args_t, chunk, 0, 1 << 24,
                 "most tokens per forward pass (default 0: all of them at once)"),
    KILN_OPT_LIST("--image", "PATH", mc_args_t, images,
                  "an image for the next image placeholder of --ids (repeatable;\n"
                  "vision-language models): the logits are of the expanded prompt"),
};

static const kiln_opts_t mc_opts = {
    .cmd = "score",
    .usage =
        "usage: kiln score [--model DIR|FILE.gguf] --ids 1,2,3 --out FILE.npy [--chunk N]\n"
        "                  [--dtype auto|float32|float16|bfloat16] [--quantization none|fp8]\n"
        "                  [--image PATH...]\n"
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
  if (a->images.n > MC_MAX_IMAGES)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: more than %d --image", cmd,
                            MC_MAX_IMAGES);
  {
    /* --model, else [model] path (relative to its INI file), else the embedded default model;
     * a Hub id resolves through the Hub cache. */
    kiln_model_location_t *loc = malloc(sizeof(*loc));
    if (!loc) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
    kiln_status_t pst = kiln_model_resolve(cli->config, a->model, loc);
    memcpy(a->model_buf, loc->path, sizeof(a->model_buf));
    free(loc);
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
  const char *qs =
      a->quantization ? a->quantization : kiln_config_get_string(cli->config, "model", "quantization");
  if ((st = kiln_cli_quantization(qs, &mo.quantization))) return st;
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

/* The images of --image: decoded and preprocessed with the model's processor settings. */
typedef struct mc_images {
  kiln_image_patches_t p[MC_MAX_IMAGES];
  int32_t n, tokens; /* images, and their tokens together */
} mc_images_t;

static kiln_status_t mc_load_images(const mc_args_t *a, mc_images_t *im) {
  memset(im, 0, sizeof(*im));
  kiln_model_config_t mc;
  kiln_status_t st = kiln_model_config_load(a->model, &mc);
  if (st) return kiln_status_annotate(st, "score");
  if (!mc.vision.present)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "score: --image: model %s takes text only (it has no vision tower)",
                            mc.architecture[0] ? mc.architecture : mc.model_type);
  kiln_vision_preproc_t pp;
  st = kiln_vision_preproc_load(a->model, &pp);
  for (int32_t i = 0; !st && i < a->images.n; i++) {
    kiln_image_t img;
    if ((st = kiln_image_load_file(a->images.v[i], NULL, &img))) break;
    st = kiln_image_preprocess(&pp, &img, &im->p[i]);
    kiln_image_free(&img);
    if (st) {
      st = kiln_status_annotate(st, "%s", a->images.v[i]);
      break;
    }
    im->n++;
    im->tokens += (int32_t)kiln_image_num_tokens(&im->p[i], pp.merge_size);
  }
  return kiln_status_annotate(st, "score");
}

static void mc_free_images(mc_images_t *im) {
  for (int32_t i = 0; i < im->n; i++) kiln_image_patches_free(&im->p[i]);
}

/* The ids with each image placeholder expanded to its image's tokens, and their M-RoPE
 * positions [3 * n]; start[i] is image i's first token. */
static kiln_status_t mc_expand(const kiln_model_t *m, const kiln_tokens_t *ids,
                               const mc_images_t *im, int32_t **out_ids, int32_t **out_pos,
                               int32_t *out_n, int32_t *start) {
  const kiln_model_config_t *c = kiln_model_get_config(m);
  int32_t ph = 0;
  for (size_t i = 0; i < ids->len; i++) ph += ids->ids[i] == c->image_token_id;
  if (ph != im->n)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "score: --ids hold %d image placeholders (id %d) for %d --image", ph,
                            c->image_token_id, im->n);
  int32_t n = (int32_t)ids->len - im->n + im->tokens, k = 0, j = 0;
  int32_t *x = malloc((size_t)n * 4), *pos = malloc((size_t)n * 3 * 4);
  kiln_mrope_grid_t g[MC_MAX_IMAGES];
  if (!x || !pos) {
    free(x);
    free(pos);
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "score: out of memory");
  }
  for (size_t i = 0; i < ids->len; i++) {
    if (ids->ids[i] != c->image_token_id) {
      x[k++] = ids->ids[i];
      continue;
    }
    const kiln_image_patches_t *p = &im->p[j];
    g[j] = (kiln_mrope_grid_t){p->grid_t, p->grid_h, p->grid_w};
    start[j] = k;
    int64_t nt = kiln_mrope_image_tokens(c, g[j]);
    for (int64_t t = 0; t < nt; t++) x[k++] = c->image_token_id;
    j++;
  }
  int32_t delta = 0;
  kiln_status_t st = kiln_mrope_positions(c, x, n, g, im->n, pos, &delta);
  if (st) {
    free(x);
    free(pos);
    return kiln_status_annotate(st, "score");
  }
  *out_ids = x;
  *out_pos = pos;
  *out_n = n;
  return NULL;
}

/* Scores ids[n] with its images: the vision tower's rows for the image tokens, M-RoPE positions,
 * in chunks of `chunk` tokens over a fresh KV cache; logits [n, V] to out. */
static kiln_status_t mc_score_images(mc_ctx_t *c, const int32_t *ids, const int32_t *pos, int32_t n,
                                     const mc_images_t *im, const int32_t *start, int32_t chunk,
                                     int32_t bs, float *out) {
  const kiln_hal_backend_t *be = &c->plugin->table;
  const kiln_model_config_t *cfg = kiln_model_get_config(c->model);
  const int64_t H = cfg->hidden_size, V = cfg->vocab_size;
  const int32_t dt = kiln_model_dtype(c->model), nb = (n + bs - 1) / bs;
  kiln_hal_buffer_t *enc = NULL;
  kiln_kv_cache_t *kv = NULL;
  kiln_vision_image_t vi[MC_MAX_IMAGES];
  int32_t first[MC_MAX_IMAGES];
  for (int32_t i = 0, off = 0; i < im->n; i++) {
    vi[i] =
        (kiln_vision_image_t){im->p[i].pixels, im->p[i].grid_t, im->p[i].grid_h, im->p[i].grid_w};
    first[i] = off;
    off += (int32_t)kiln_vision_image_tokens(c->model, &vi[i]);
  }
  int32_t *tab = malloc((size_t)nb * 4), *meta = malloc((size_t)chunk * 6 * 4);
  kiln_batch_embed_t *em = malloc((size_t)(im->n ? im->n : 1) * sizeof(*em));
  kiln_status_t st = NULL;
  if (!tab || !meta || !em) st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "score: out of memory");
  kiln_hal_error_t *he =
      st ? NULL
         : be->buffer_alloc(c->dev, (uint64_t)im->tokens * (uint64_t)H * kiln_hal_dtype_size(dt), 0,
                            &enc);
  if (he) st = kiln_hal_status_from_error(he, "score: the images' embeddings");
  const int64_t es[2] = {im->tokens, H};
  kiln_hal_tensor_t et = st ? (kiln_hal_tensor_t){0} : kiln_hal_tensor_make(enc, 0, dt, 2, es);
  if (!st) st = kiln_vision_encode(c->model, vi, im->n, et);
  if (!st) st = kiln_model_kv_create(c->model, nb, bs, &kv);
  for (int32_t i = 0; i < nb && tab; i++) tab[i] = i;
  for (int32_t s0 = 0; !st && s0 < n; s0 += chunk) {
    const int32_t cn = n - s0 < chunk ? n - s0 : chunk;
    int32_t *p = meta, *slots = meta + chunk, *rows = meta + 2 * chunk, *mp = meta + 3 * chunk;
    for (int32_t t = 0; t < cn; t++) {
      p[t] = slots[t] = s0 + t;
      rows[t] = t;
      for (int a3 = 0; a3 < 3; a3++) mp[a3 * cn + t] = pos[(size_t)a3 * n + s0 + t];
    }
    int32_t ne = 0;
    for (int32_t i = 0; i < im->n; i++) {
      int32_t lo = start[i] > s0 ? start[i] : s0;
      int32_t hi = start[i] + (int32_t)kiln_vision_image_tokens(c->model, &vi[i]);
      if (hi > s0 + cn) hi = s0 + cn;
      if (lo < hi)
        em[ne++] = (kiln_batch_embed_t){
            .row = lo - s0, .count = hi - lo, .first = first[i] + lo - start[i], .src = et};
    }
    const int32_t len = s0 + cn, qsl[2] = {0, cn};
    kiln_batch_t b = {.num_tokens = cn,
                      .num_seqs = 1,
                      .token_ids = ids + s0,
                      .positions = p,
                      .slot_mapping = slots,
                      .seq_lens = &len,
                      .query_start_loc = qsl,
                      .block_tables = tab,
                      .max_blocks_per_seq = nb,
                      .num_logits = cn,
                      .logits_rows = rows,
                      .mrope_positions = mp,
                      .num_embeds = ne,
                      .embeds = ne ? em : NULL};
    st = kiln_model_forward(c->model, kv, &b);
    if (!st) st = kiln_model_read_logits(c->model, cn, out + (size_t)s0 * (size_t)V);
  }
  kiln_kv_cache_free(kv);
  if (enc) {
    be->stream_sync(c->stream);
    be->buffer_free(enc);
  }
  free(tab);
  free(meta);
  free(em);
  return st;
}

int kiln_cmd_score(kiln_cli_t *cli) {
  mc_args_t a;
  mc_ctx_t c;
  memset(&c, 0, sizeof(c));
  float *logits = NULL;
  bool help = false;
  kiln_status_t st = mc_parse(cli, &a, &help);
  if (!st && help) {
    kiln_opts_free(&mc_opts, &a);
    return 0;
  }
  if (!st) st = kiln_cli_parse_ids("score", a.ids, &c.ids.ids, &c.ids.len);
  c.ids.cap = c.ids.len;
  int32_t n = (int32_t)c.ids.len;
  int32_t chunk = a.chunk > 0 && a.chunk < n ? (int32_t)a.chunk : n;
  /* With images the prompt grows by their tokens: the model is sized for the whole prompt
   * (--chunk still splits it). */
  mc_images_t im;
  memset(&im, 0, sizeof(im));
  int32_t *xids = NULL, *xpos = NULL, start[MC_MAX_IMAGES], total = n;
  if (!st && a.images.n) {
    st = mc_load_images(&a, &im);
    total = n - im.n + im.tokens;
    chunk = a.chunk > 0 && a.chunk < total ? (int32_t)a.chunk : total;
  }
  if (!st) st = mc_open_model(cli, &a, chunk, total, &c);
  if (!st) st = mc_check_ids(&c, "score");
  if (!st && a.images.n && !kiln_model_has_vision(c.model))
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "score: --image: model %s takes text only (it has no vision tower)",
                          kiln_model_get_config(c.model)->architecture);
  if (!st && a.images.n) st = mc_expand(c.model, &c.ids, &im, &xids, &xpos, &n, start);
  int64_t V = st ? 0 : kiln_model_get_config(c.model)->vocab_size;
  if (!st && !(logits = malloc((size_t)n * (size_t)V * sizeof(float))))
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "score: out of memory for %d x %lld logits", n,
                          (long long)V);
  if (!st && a.images.n)
    st = mc_score_images(&c, xids, xpos, n, &im, start, chunk, mc_block_size(cli), logits);
  else if (!st)
    st = kiln_model_score(c.model, c.ids.ids, n, chunk, mc_block_size(cli), logits);
  if (!st) st = kiln_npy_write_f32(a.out, logits, n, V);
  free(logits);
  free(xids);
  free(xpos);
  mc_free_images(&im);
  mc_close(&c);
  kiln_opts_free(&mc_opts, &a);
  if (st) return kiln_cli_fail(st);
  return 0;
}
