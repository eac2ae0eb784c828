/* test_vl_parity.c - Qwen2-VL and Qwen2.5-VL against transformers (tools/make_vl_fixtures.py):
 * for every recorded prompt (one image, two images, an image mid-text, one over max_pixels,
 * text only), from transformers' own pixel values and ids,
 *   - kiln_mrope_positions gives exactly the position ids transformers' language model got,
 *     and the same delta;
 *   - the vision tower + the decoder give the logits of every position within FP32_TOL
 *     (max |kiln - ref| / max |ref| over the recorded columns; the full-vocabulary logsumexp
 *     of every row too);
 *   - greedy decoding through the KV cache, at positions p + delta, gives transformers'
 *     8 tokens, and each step's logits match;
 *   - chunked prefill that splits an image's tokens across two forwards gives the all-at-once
 *     logits (SELF_TOL).
 * Both sets of fixtures are committed; a missing one is a failure.
 * The backend is cpu unless KILN_TEST_BACKEND names another. */
#define _GNU_SOURCE
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cmocka.h>

#include "base/json.h"
#include "base/npy.h"
#include "hal/loader.h"
#include "kiln/hal_util.h"
#include "models/model.h"
#include "models/mrope.h"
#include "models/vision/image.h"
#include "models/vision/preproc.h"
#include "models/vision/vision.h"

#define FP32_TOL 1e-4
#define SELF_TOL 2e-5
#define BS 16

static const kiln_hal_plugin_t *g_plugin;
static kiln_hal_registry_t *g_reg;
static kiln_hal_device_t *g_dev;
static kiln_hal_stream_t *g_stream;
static char g_root[1024];

static void check_st(kiln_status_t st) {
  if (st) fail_msg("%s", kiln_status_message(st));
}

static int setup(void **state) {
  (void)state;
  const char *src = getenv("KILN_SOURCE_DIR");
  snprintf(g_root, sizeof(g_root), "%s/tests/fixtures/models", src ? src : "..");
  kiln_hal_registry_options_t o = {0};
  kiln_status_t st = kiln_hal_registry_create(&o, &g_reg);
  const char *want = getenv("KILN_TEST_BACKEND");
  if (!st) st = kiln_hal_registry_open(g_reg, want && *want ? want : "cpu", &g_plugin);
  if (st) {
    fprintf(stderr, "%s\n", kiln_status_message(st));
    kiln_status_free(st);
    return -1;
  }
  const kiln_hal_backend_t *be = &g_plugin->table;
  if (be->device_open(0, &g_dev) || be->stream_create(g_dev, &g_stream)) return -1;
  return 0;
}

static int teardown(void **state) {
  (void)state;
  if (g_stream) g_plugin->table.stream_destroy(g_stream);
  if (g_dev) g_plugin->table.device_close(g_dev);
  kiln_hal_registry_free(g_reg);
  return 0;
}

static int32_t *json_ints(const kiln_json_t *a, int32_t *out_n) {
  assert_true(kiln_json_is(a, KILN_JSON_ARRAY));
  size_t n = kiln_json_len(a);
  int32_t *v = malloc((n ? n : 1) * sizeof(int32_t));
  assert_non_null(v);
  for (size_t i = 0; i < n; i++) {
    int64_t x;
    assert_true(kiln_json_int64(kiln_json_at(a, i), &x));
    v[i] = (int32_t)x;
  }
  *out_n = (int32_t)n;
  return v;
}

static float *read_npy(const char *dir, const kiln_json_t *file, int64_t *rows, int64_t *cols) {
  char path[1400];
  snprintf(path, sizeof(path), "%s/%s", dir, kiln_json_string(file, NULL));
  float *d = NULL;
  check_st(kiln_npy_read_f32(path, &d, rows, cols));
  return d;
}

/* One prompt of a fixture, and what Kiln computed for it. */
typedef struct prompt {
  const kiln_json_t *j;
  char name[64];
  int32_t T, ncols, nimg;
  int32_t *ids, *cols;
  kiln_mrope_grid_t grids[8];
  int32_t *pos; /* [3T] */
  int32_t delta;
  float *pixels; /* [patches, 1176] or NULL */
  float *ref;    /* [T, ncols] */
} prompt_t;

static void prompt_open(prompt_t *p, const char *dir, const kiln_json_t *j) {
  memset(p, 0, sizeof(*p));
  p->j = j;
  snprintf(p->name, sizeof(p->name), "%s", kiln_json_string(kiln_json_get(j, "name"), NULL));
  p->ids = json_ints(kiln_json_get(j, "input_ids"), &p->T);
  p->cols = json_ints(kiln_json_get(j, "logit_cols"), &p->ncols);
  const kiln_json_t *g = kiln_json_get(j, "image_grid_thw");
  p->nimg = (int32_t)kiln_json_len(g);
  assert_true(p->nimg <= 8);
  for (int32_t i = 0; i < p->nimg; i++) {
    int32_t n3;
    int32_t *t = json_ints(kiln_json_at(g, (size_t)i), &n3);
    assert_int_equal(n3, 3);
    p->grids[i] = (kiln_mrope_grid_t){t[0], t[1], t[2]};
    free(t);
  }
  const kiln_json_t *pos = kiln_json_get(j, "position_ids");
  assert_int_equal(kiln_json_len(pos), 3);
  p->pos = malloc(sizeof(int32_t) * 3 * (size_t)p->T);
  assert_non_null(p->pos);
  for (int a = 0; a < 3; a++) {
    int32_t n;
    int32_t *row = json_ints(kiln_json_at(pos, (size_t)a), &n);
    assert_int_equal(n, p->T);
    memcpy(p->pos + (size_t)a * p->T, row, sizeof(int32_t) * (size_t)n);
    free(row);
  }
  int64_t d;
  assert_true(kiln_json_int64(kiln_json_get(j, "rope_delta"), &d));
  p->delta = (int32_t)d;
  int64_t r, c;
  p->ref = read_npy(dir, kiln_json_get(j, "logits_file"), &r, &c);
  assert_int_equal(r, p->T);
  assert_int_equal(c, p->ncols);
  const kiln_json_t *pf = kiln_json_get(j, "pixel_values_file");
  if (kiln_json_is(pf, KILN_JSON_STRING)) {
    p->pixels = read_npy(dir, pf, &r, &c);
    int64_t want = 0;
    for (int32_t i = 0; i < p->nimg; i++)
      want += (int64_t)p->grids[i].t * p->grids[i].h * p->grids[i].w;
    assert_int_equal(r, want);
    assert_int_equal(c, 1176);
  }
}

static void prompt_close(prompt_t *p) {
  free(p->ids);
  free(p->cols);
  free(p->pos);
  free(p->pixels);
  free(p->ref);
}

/* max over rows and the recorded columns of |got - ref| / max |ref| */
static double cols_err(const prompt_t *p, const float *got, int64_t V, int32_t rows,
                       const float *ref) {
  double num = 0, den = 0;
  for (int32_t t = 0; t < rows; t++)
    for (int32_t c = 0; c < p->ncols; c++) {
      double g = got[(size_t)t * (size_t)V + (size_t)p->cols[c]], r = ref[(size_t)t * p->ncols + c];
      double d = fabs(g - r);
      if (!(d <= num)) num = d;
      if (fabs(r) > den) den = fabs(r);
    }
  return den > 0 ? num / den : num;
}

static double lse(const float *row, int64_t V) {
  double mx = -INFINITY, s = 0;
  for (int64_t v = 0; v < V; v++) mx = row[v] > mx ? row[v] : mx;
  for (int64_t v = 0; v < V; v++) s += exp((double)row[v] - mx);
  return mx + log(s);
}

static int32_t argmax(const float *row, int64_t V) {
  int32_t b = 0;
  for (int64_t v = 1; v < V; v++)
    if (row[v] > row[b]) b = (int32_t)v;
  return b;
}

typedef struct ctx {
  kiln_model_t *m;
  kiln_kv_cache_t *kv;
  int32_t bt[64], nb;
  int64_t V, H;
  kiln_hal_buffer_t *emb; /* the vision output */
  int32_t emb_rows;
  int32_t emb_dtype; /* 0 = F32 */
} ctx_t;

/* Rows [start, start + n) of a sequence through the KV cache, with M-RoPE positions mpos
 * (3 rows of stride `stride`, or NULL) and the embedding runs of the image tokens in those
 * rows; logits of every row into out. */
static void forward(ctx_t *c, const prompt_t *p, const int32_t *ids, int32_t start, int32_t n,
                    const int32_t *mpos, int32_t stride, float *out) {
  int32_t pos[512], slots[512], rows[512], mp[3 * 512];
  assert_true(n <= 512);
  for (int32_t i = 0; i < n; i++) {
    pos[i] = start + i;
    slots[i] = c->bt[(start + i) / BS] * BS + (start + i) % BS;
    rows[i] = i;
    if (mpos)
      for (int a = 0; a < 3; a++) mp[a * n + i] = mpos[(size_t)a * stride + start + i];
  }
  /* Image-token runs within [start, start + n): run k of the prompt takes vision rows
   * [first_k, first_k + len_k). */
  kiln_batch_embed_t em[16];
  int32_t ne = 0, vrow = 0;
  const kiln_model_config_t *cfg = kiln_model_get_config(c->m);
  for (int32_t t = 0; p && t < p->T;) {
    if (p->ids[t] != cfg->image_token_id) {
      t++;
      continue;
    }
    int32_t r = t;
    while (r < p->T && p->ids[r] == cfg->image_token_id) r++;
    int32_t a = t > start ? t : start, b = r < start + n ? r : start + n;
    if (a < b) {
      assert_true(ne < 16);
      em[ne].row = a - start;
      em[ne].count = b - a;
      em[ne].first = vrow + (a - t);
      const int64_t sh[2] = {c->emb_rows, c->H};
      em[ne].src =
          kiln_hal_tensor_make(c->emb, 0, c->emb_dtype ? c->emb_dtype : KILN_HAL_F32, 2, sh);
      ne++;
    }
    vrow += r - t;
    t = r;
  }
  int32_t len = start + n, qsl[2] = {0, n};
  kiln_batch_t b = {.num_tokens = n,
                    .num_seqs = 1,
                    .token_ids = ids + start,
                    .positions = pos,
                    .slot_mapping = slots,
                    .seq_lens = &len,
                    .query_start_loc = qsl,
                    .block_tables = c->bt,
                    .max_blocks_per_seq = c->nb,
                    .num_logits = n,
                    .logits_rows = rows,
                    .mrope_positions = mpos ? mp : NULL,
                    .num_embeds = ne,
                    .embeds = em};
  check_st(kiln_model_forward(c->m, c->kv, &b));
  check_st(kiln_model_read_logits(c->m, n, out));
}

static bool have_fixture(const char *name, char *dir, size_t n) {
  snprintf(dir, n, "%s/%s/reference.json", g_root, name);
  struct stat sb;
  bool ok = stat(dir, &sb) == 0;
  snprintf(dir, n, "%s/%s", g_root, name);
  return ok;
}

static void check_fixture(const char *name) {
  char dir[1200];
  if (!have_fixture(name, dir, sizeof(dir)))
    fail_msg("%s: missing fixture %s (tools/make_vl_fixtures.py, tools/make_vl_selftest.py)", name,
             dir);
  char path[1400];
  snprintf(path, sizeof(path), "%s/reference.json", dir);
  kiln_json_doc_t *doc = NULL;
  check_st(kiln_json_parse_file(path, &doc));
  const kiln_json_t *ref = kiln_json_root(doc);
  kiln_model_options_t o = {0};
  o.dtype = KILN_HAL_F32;
  o.max_tokens = 256;
  o.max_seqs = 2;
  o.max_blocks_per_seq = 64;
  ctx_t c;
  memset(&c, 0, sizeof(c));
  check_st(kiln_model_load(dir, &g_plugin->table, g_dev, g_stream, &o, &c.m));
  const kiln_model_config_t *cfg = kiln_model_get_config(c.m);
  assert_true(kiln_model_has_vision(c.m));
  assert_true(kiln_model_has_mrope(c.m));
  int64_t tid;
  assert_true(kiln_json_int64(kiln_json_get(ref, "image_token_id"), &tid));
  assert_int_equal(cfg->image_token_id, tid);
  c.V = cfg->vocab_size;
  c.H = cfg->hidden_size;
  c.nb = 40;
  for (int32_t i = 0; i < c.nb; i++) c.bt[i] = c.nb - 1 - i; /* reversed: slots must follow */
  const kiln_hal_backend_t *be = &g_plugin->table;

  const kiln_json_t *prompts = kiln_json_get(ref, "prompts");
  double worst = 0, worst_lse = 0;
  for (size_t pi = 0; pi < kiln_json_len(prompts); pi++) {
    prompt_t p;
    prompt_open(&p, dir, kiln_json_at(prompts, pi));
    assert_true(p.T + 8 <= c.nb * BS && p.T <= o.max_tokens);

    /* M-RoPE positions */
    int32_t *mpos = malloc(sizeof(int32_t) * 3 * (size_t)p.T);
    int32_t delta = 12345;
    assert_non_null(mpos);
    check_st(kiln_mrope_positions(cfg, p.ids, p.T, p.grids, p.nimg, mpos, &delta));
    for (int32_t i = 0; i < 3 * p.T; i++)
      if (mpos[i] != p.pos[i])
        fail_msg("%s/%s: M-RoPE %c position of token %d: kiln %d, transformers %d", name, p.name,
                 "thw"[i / p.T], i % p.T, mpos[i], p.pos[i]);
    assert_int_equal(delta, p.delta);

    /* the vision tower */
    kiln_vision_image_t imgs[8];
    int32_t tokens = 0;
    int64_t off = 0;
    for (int32_t i = 0; i < p.nimg; i++) {
      imgs[i] =
          (kiln_vision_image_t){p.pixels + off * 1176, p.grids[i].t, p.grids[i].h, p.grids[i].w};
      off += (int64_t)p.grids[i].t * p.grids[i].h * p.grids[i].w;
      tokens += (int32_t)kiln_vision_image_tokens(c.m, &imgs[i]);
    }
    c.emb_rows = tokens > 0 ? tokens : 1;
    assert_null(be->buffer_alloc(g_dev, (uint64_t)c.emb_rows * (uint64_t)c.H * 4, 0, &c.emb));
    if (p.nimg) {
      const int64_t sh[2] = {tokens, c.H};
      check_st(kiln_vision_encode(c.m, imgs, p.nimg,
                                  kiln_hal_tensor_make(c.emb, 0, KILN_HAL_F32, 2, sh)));
    }

    /* prefill: every row's logits */
    check_st(kiln_model_kv_create(c.m, c.nb, BS, &c.kv));
    float *all = malloc(sizeof(float) * (size_t)p.T * (size_t)c.V);
    assert_non_null(all);
    forward(&c, &p, p.ids, 0, p.T, mpos, p.T, all);
    double e = cols_err(&p, all, c.V, p.T, p.ref);
    const kiln_json_t *lj = kiln_json_get(p.j, "logsumexp");
    const kiln_json_t *aj = kiln_json_get(p.j, "argmax");
    double lse_err = 0, lse_den = 0;
    int32_t amiss = 0;
    for (int32_t t = 0; t < p.T; t++) {
      double want = kiln_json_number(kiln_json_at(lj, (size_t)t));
      double d = fabs(lse(all + (size_t)t * c.V, c.V) - want);
      if (d > lse_err) lse_err = d;
      if (fabs(want) > lse_den) lse_den = fabs(want);
      int64_t am;
      assert_true(kiln_json_int64(kiln_json_at(aj, (size_t)t), &am));
      amiss += argmax(all + (size_t)t * c.V, c.V) != am;
    }
    lse_err /= lse_den > 0 ? lse_den : 1;
    printf(
        "  %-10s %-11s T=%3d image tokens %3d: logits rel err %.3g, logsumexp %.3g, argmax "
        "differs at %d of %d rows\n",
        name, p.name, p.T, tokens, e, lse_err, amiss, p.T);
    if (!(e <= FP32_TOL))
      fail_msg("%s/%s: logits relative error %.3g > %.0e", name, p.name, e, FP32_TOL);
    if (!(lse_err <= FP32_TOL))
      fail_msg("%s/%s: logsumexp relative error %.3g", name, p.name, lse_err);
    if (e > worst) worst = e;
    if (lse_err > worst_lse) worst_lse = lse_err;

    /* greedy through the KV cache */
    const kiln_json_t *g = kiln_json_get(p.j, "greedy");
    int32_t ng;
    int32_t *want_toks = json_ints(kiln_json_get(g, "token_ids"), &ng);
    int64_t sr, sc;
    float *step_ref = read_npy(dir, kiln_json_get(g, "step_logits_file"), &sr, &sc);
    assert_int_equal(sr, ng);
    assert_int_equal(sc, p.ncols);
    int32_t seq[512];
    memcpy(seq, p.ids, sizeof(int32_t) * (size_t)p.T);
    float *last = malloc(sizeof(float) * (size_t)c.V);
    assert_non_null(last);
    memcpy(last, all + (size_t)(p.T - 1) * c.V, sizeof(float) * (size_t)c.V);
    for (int32_t s = 0; s < ng; s++) {
      double se = cols_err(&p, last, c.V, 1, step_ref + (size_t)s * p.ncols);
      if (!(se <= FP32_TOL))
        fail_msg("%s/%s: greedy step %d logits relative error %.3g", name, p.name, s, se);
      int32_t tok = argmax(last, c.V);
      if (tok != want_toks[s])
        fail_msg("%s/%s: greedy token %d: kiln %d, transformers %d", name, p.name, s, tok,
                 want_toks[s]);
      if (s == ng - 1) break;
      seq[p.T + s] = tok;
      const int32_t at = p.T + s, rp = at + p.delta;
      int32_t dpos[3 * 512];
      for (int a = 0; a < 3; a++) dpos[a * 512 + at] = rp; /* text: t == h == w */
      forward(&c, NULL, seq, at, 1, p.delta ? dpos : NULL, 512, last);
    }
    free(last);
    free(step_ref);
    free(want_toks);
    kiln_kv_cache_free(c.kv);

    /* chunked prefill splitting the first image's tokens */
    if (p.nimg) {
      int32_t first = 0;
      while (p.ids[first] != cfg->image_token_id) first++;
      int32_t split = first + (int32_t)kiln_vision_image_tokens(c.m, &imgs[0]) / 2;
      if (split == first) split++;
      check_st(kiln_model_kv_create(c.m, c.nb, BS, &c.kv));
      float *chunked = malloc(sizeof(float) * (size_t)p.T * (size_t)c.V);
      assert_non_null(chunked);
      forward(&c, &p, p.ids, 0, split, mpos, p.T, chunked);
      forward(&c, &p, p.ids, split, p.T - split, mpos, p.T, chunked + (size_t)split * c.V);
      double num = 0, den = 0;
      for (size_t i = 0; i < (size_t)p.T * (size_t)c.V; i++) {
        double d = fabs((double)chunked[i] - all[i]);
        if (!(d <= num)) num = d;
        if (fabs(all[i]) > den) den = fabs(all[i]);
      }
      double ce = den > 0 ? num / den : num;
      if (!(ce <= SELF_TOL))
        fail_msg("%s/%s: chunked prefill (split at %d) differs by %.3g", name, p.name, split, ce);
      free(chunked);
      kiln_kv_cache_free(c.kv);
    }
    free(all);
    free(mpos);
    be->buffer_free(c.emb);
    prompt_close(&p);
  }
  printf("  %s: worst logits rel err %.3g, logsumexp %.3g\n", name, worst, worst_lse);
  kiln_model_free(c.m);
  kiln_json_doc_free(doc);
}

/* The tiny checkpoints of tools/make_vl_selftest.py (an independent float64 reference in the
 * standard library), always present. */
static void test_tiny_qwen2_vl(void **state) {
  (void)state;
  check_fixture("vl_tiny_qwen2_vl");
}

static void test_tiny_qwen2_5_vl(void **state) {
  (void)state;
  check_fixture("vl_tiny_qwen2_5_vl");
}

/* bf16 serving: the vision tower converts the pixels and everything runs in bf16; the logits
 * stay close to the float64 reference (a sanity bound: bf16 rounding through 2-3 blocks and 2
 * layers gives ~1%; a wrong conversion or a dtype mix-up gives 100%). */
static void test_tiny_bf16(void **state) {
  (void)state;
  char dir[1200];
  assert_true(have_fixture("vl_tiny_qwen2_5_vl", dir, sizeof(dir)));
  char path[1400];
  snprintf(path, sizeof(path), "%s/reference.json", dir);
  kiln_json_doc_t *doc = NULL;
  check_st(kiln_json_parse_file(path, &doc));
  prompt_t p;
  prompt_open(&p, dir, kiln_json_at(kiln_json_get(kiln_json_root(doc), "prompts"), 0));
  kiln_model_options_t o = {0};
  o.dtype = KILN_HAL_BF16;
  o.max_tokens = 64;
  o.max_seqs = 1;
  o.max_blocks_per_seq = 64;
  ctx_t c;
  memset(&c, 0, sizeof(c));
  kiln_status_t st = kiln_model_load(dir, &g_plugin->table, g_dev, g_stream, &o, &c.m);
  if (kiln_status_code(st) == KILN_ERR_UNSUPPORTED) {
    printf("  bf16: %s\n", kiln_status_message(st));
    kiln_status_free(st);
    prompt_close(&p);
    kiln_json_doc_free(doc);
    skip();
  }
  check_st(st);
  c.V = kiln_model_get_config(c.m)->vocab_size;
  c.H = kiln_model_get_config(c.m)->hidden_size;
  c.nb = 8;
  for (int32_t i = 0; i < c.nb; i++) c.bt[i] = i;
  kiln_vision_image_t imgs[8];
  int64_t off = 0;
  int32_t tokens = 0;
  for (int32_t i = 0; i < p.nimg; i++) {
    imgs[i] = (kiln_vision_image_t){p.pixels + off * 1176, 1, p.grids[i].h, p.grids[i].w};
    off += (int64_t)p.grids[i].h * p.grids[i].w;
    tokens += (int32_t)kiln_vision_image_tokens(c.m, &imgs[i]);
  }
  const kiln_hal_backend_t *be = &g_plugin->table;
  assert_null(be->buffer_alloc(g_dev, (uint64_t)tokens * (uint64_t)c.H * 2, 0, &c.emb));
  c.emb_rows = tokens;
  const int64_t sh[2] = {tokens, c.H};
  kiln_hal_tensor_t out = kiln_hal_tensor_make(c.emb, 0, KILN_HAL_BF16, 2, sh);
  check_st(kiln_vision_encode(c.m, imgs, p.nimg, out));
  int32_t *mpos = malloc(sizeof(int32_t) * 3 * (size_t)p.T), delta;
  assert_non_null(mpos);
  check_st(
      kiln_mrope_positions(kiln_model_get_config(c.m), p.ids, p.T, p.grids, p.nimg, mpos, &delta));
  check_st(kiln_model_kv_create(c.m, c.nb, BS, &c.kv));
  float *all = malloc(sizeof(float) * (size_t)p.T * (size_t)c.V);
  assert_non_null(all);
  c.emb_dtype = KILN_HAL_BF16;
  forward(&c, &p, p.ids, 0, p.T, mpos, p.T, all);
  double e = cols_err(&p, all, c.V, p.T, p.ref);
  printf("  bf16 %s: logits rel err %.3g\n", p.name, e);
  if (!(e <= 5e-2)) fail_msg("bf16 logits relative error %.3g", e);
  free(all);
  free(mpos);
  kiln_kv_cache_free(c.kv);
  be->buffer_free(c.emb);
  kiln_model_free(c.m);
  prompt_close(&p);
  kiln_json_doc_free(doc);
}

/* Bad batches and bad images are errors that name what is wrong. */
static void expect_err(kiln_status_t st, const char *needle) {
  if (!st) fail_msg("expected an error naming \"%s\"", needle);
  if (!strstr(kiln_status_message(st), needle))
    fail_msg("\"%s\" does not name \"%s\"", kiln_status_message(st), needle);
  kiln_status_free(st);
}

static void test_bad_input(void **state) {
  (void)state;
  char dir[1200];
  assert_true(have_fixture("vl_tiny_qwen2_vl", dir, sizeof(dir)));
  kiln_model_options_t o = {0};
  o.dtype = KILN_HAL_F32;
  o.max_tokens = 64;
  o.max_seqs = 1;
  o.max_blocks_per_seq = 8;
  kiln_model_t *m = NULL;
  check_st(kiln_model_load(dir, &g_plugin->table, g_dev, g_stream, &o, &m));
  const kiln_hal_backend_t *be = &g_plugin->table;
  kiln_kv_cache_t *kv = NULL;
  check_st(kiln_model_kv_create(m, 8, BS, &kv));
  kiln_hal_buffer_t *buf = NULL;
  assert_null(be->buffer_alloc(g_dev, 64 * 16 * 4, 0, &buf));
  assert_null(be->fill(g_stream, buf, 0, 64 * 16 * 4, 0)); /* the rows an embedding run copies */
  const int64_t sh[2] = {4, 16};
  kiln_hal_tensor_t src = kiln_hal_tensor_make(buf, 0, KILN_HAL_F32, 2, sh);
  int32_t ids[4] = {1, 2, 3, 4}, pos[4] = {0, 1, 2, 3}, slots[4] = {0, 1, 2, 3}, len = 4;
  int32_t qsl[2] = {0, 4}, bt[8] = {0}, rows[1] = {3};
  int32_t mp[12] = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3};
  kiln_batch_embed_t em[2] = {{.row = 1, .count = 2, .first = 0, .src = src},
                              {.row = 2, .count = 1, .first = 0, .src = src}};
  kiln_batch_t b = {.num_tokens = 4,
                    .num_seqs = 1,
                    .token_ids = ids,
                    .positions = pos,
                    .slot_mapping = slots,
                    .seq_lens = &len,
                    .query_start_loc = qsl,
                    .block_tables = bt,
                    .max_blocks_per_seq = 1,
                    .num_logits = 1,
                    .logits_rows = rows,
                    .mrope_positions = mp};
  check_st(kiln_model_forward(m, kv, &b));
  mp[5] = 512; /* beyond the rope table */
  expect_err(kiln_model_forward(m, kv, &b), "M-RoPE h position 512");
  mp[5] = 1;
  mp[10] = -1;
  expect_err(kiln_model_forward(m, kv, &b), "M-RoPE w position -1");
  mp[10] = 2;
  b.num_embeds = 2;
  b.embeds = em;
  expect_err(kiln_model_forward(m, kv, &b), "embedding run 1"); /* overlaps run 0 */
  em[1].row = 3;
  em[1].first = 4; /* source rows [4, 5) of 4 */
  expect_err(kiln_model_forward(m, kv, &b), "source rows [4, 5) of 4");
  em[1].first = 3;
  em[1].src.shape[1] = 8;
  expect_err(kiln_model_forward(m, kv, &b), "embedding run 1: the source");
  em[1].src.shape[1] = 16;
  check_st(kiln_model_forward(m, kv, &b));
  b.num_embeds = 0;

  /* images */
  float px[16 * 1176] = {0};
  kiln_vision_image_t im = {px, 1, 4, 4};
  const int64_t osh[2] = {4, 16};
  kiln_hal_tensor_t out = kiln_hal_tensor_make(buf, 0, KILN_HAL_F32, 2, osh);
  check_st(kiln_vision_encode(m, &im, 1, out));
  kiln_vision_image_t odd = {px, 1, 3, 4};
  expect_err(kiln_vision_encode(m, &odd, 1, out), "image 0: grid 1 x 3 x 4");
  kiln_vision_image_t video = {px, 2, 2, 2};
  expect_err(kiln_vision_encode(m, &video, 1, out), "videos are not supported");
  const int64_t small[2] = {3, 16};
  expect_err(kiln_vision_encode(m, &im, 1, kiln_hal_tensor_make(buf, 0, KILN_HAL_F32, 2, small)),
             "the output must be");
  expect_err(kiln_vision_encode(m, &im, 0, out), "0 images");

  kiln_kv_cache_free(kv);
  be->buffer_free(buf);
  kiln_model_free(m);

  /* M-RoPE positions to a text-only model */
  snprintf(dir, sizeof(dir), "%s/llama2", g_root);
  check_st(kiln_model_load(dir, &g_plugin->table, g_dev, g_stream, &o, &m));
  check_st(kiln_model_kv_create(m, 8, BS, &kv));
  assert_false(kiln_model_has_mrope(m));
  assert_false(kiln_model_has_vision(m));
  expect_err(kiln_model_forward(m, kv, &b), "has no M-RoPE");
  expect_err(kiln_vision_encode(m, &im, 1, out), "has no vision tower");
  kiln_kv_cache_free(kv);
  kiln_model_free(m);
}

/* Kiln's own image decoding and preprocessing (models/vision/preproc.h) on the fixture's image
 * files: the same grids, pixel values as close as the image code promises (printed), and the
 * greedy tokens transformers produced from its own pixel values. */
static void check_own_preprocessing(const char *name) {
  char dir[1200], path[1400];
  if (!have_fixture(name, dir, sizeof(dir))) fail_msg("%s: missing fixture %s", name, dir);
  snprintf(path, sizeof(path), "%s/reference.json", dir);
  kiln_json_doc_t *doc = NULL;
  check_st(kiln_json_parse_file(path, &doc));
  kiln_vision_preproc_t pp;
  check_st(kiln_vision_preproc_load(dir, &pp));
  kiln_model_options_t o = {0};
  o.dtype = KILN_HAL_F32;
  o.max_tokens = 256;
  o.max_seqs = 1;
  o.max_blocks_per_seq = 64;
  ctx_t c;
  memset(&c, 0, sizeof(c));
  check_st(kiln_model_load(dir, &g_plugin->table, g_dev, g_stream, &o, &c.m));
  const kiln_model_config_t *cfg = kiln_model_get_config(c.m);
  c.V = cfg->vocab_size;
  c.H = cfg->hidden_size;
  c.nb = 40;
  for (int32_t i = 0; i < c.nb; i++) c.bt[i] = i;
  const kiln_hal_backend_t *be = &g_plugin->table;
  const kiln_json_t *prompts = kiln_json_get(kiln_json_root(doc), "prompts");
  for (size_t pi = 0; pi < kiln_json_len(prompts); pi++) {
    prompt_t p;
    prompt_open(&p, dir, kiln_json_at(prompts, pi));
    if (p.nimg == 0) {
      prompt_close(&p);
      continue;
    }
    const kiln_json_t *files = kiln_json_get(p.j, "images");
    assert_int_equal(kiln_json_len(files), p.nimg);
    kiln_image_patches_t pat[8];
    kiln_vision_image_t imgs[8];
    memset(pat, 0, sizeof(pat));
    int64_t off = 0, same = 0, total = 0;
    double maxerr = 0;
    int32_t tokens = 0;
    for (int32_t i = 0; i < p.nimg; i++) {
      snprintf(path, sizeof(path), "%s/images/%s", dir,
               kiln_json_string(kiln_json_at(files, (size_t)i), NULL));
      kiln_image_t img;
      check_st(kiln_image_load_file(path, NULL, &img));
      check_st(kiln_image_preprocess(&pp, &img, &pat[i]));
      kiln_image_free(&img);
      if (pat[i].grid_t != p.grids[i].t || pat[i].grid_h != p.grids[i].h ||
          pat[i].grid_w != p.grids[i].w)
        fail_msg("%s/%s image %d: kiln's grid %d x %d x %d, transformers' %d x %d x %d", name,
                 p.name, i, pat[i].grid_t, pat[i].grid_h, pat[i].grid_w, p.grids[i].t, p.grids[i].h,
                 p.grids[i].w);
      const int64_t n = pat[i].num_patches * pat[i].patch_dim;
      for (int64_t k = 0; k < n; k++) {
        double d = fabs((double)pat[i].pixels[k] - (double)p.pixels[off * 1176 + k]);
        if (d > maxerr) maxerr = d;
        same += d == 0;
      }
      total += n;
      off += pat[i].num_patches;
      imgs[i] = (kiln_vision_image_t){pat[i].pixels, pat[i].grid_t, pat[i].grid_h, pat[i].grid_w};
      tokens += (int32_t)kiln_vision_image_tokens(c.m, &imgs[i]);
    }
    c.emb_rows = tokens;
    assert_null(be->buffer_alloc(g_dev, (uint64_t)tokens * (uint64_t)c.H * 4, 0, &c.emb));
    const int64_t sh[2] = {tokens, c.H};
    check_st(
        kiln_vision_encode(c.m, imgs, p.nimg, kiln_hal_tensor_make(c.emb, 0, KILN_HAL_F32, 2, sh)));
    int32_t *mpos = malloc(sizeof(int32_t) * 3 * (size_t)p.T), delta;
    assert_non_null(mpos);
    check_st(kiln_mrope_positions(cfg, p.ids, p.T, p.grids, p.nimg, mpos, &delta));
    check_st(kiln_model_kv_create(c.m, c.nb, BS, &c.kv));
    float *all = malloc(sizeof(float) * (size_t)p.T * (size_t)c.V);
    assert_non_null(all);
    forward(&c, &p, p.ids, 0, p.T, mpos, p.T, all);
    double e = cols_err(&p, all, c.V, p.T, p.ref);
    int32_t ng;
    int32_t *want = json_ints(kiln_json_get(kiln_json_get(p.j, "greedy"), "token_ids"), &ng);
    int32_t seq[512], got[16];
    memcpy(seq, p.ids, sizeof(int32_t) * (size_t)p.T);
    float *last = malloc(sizeof(float) * (size_t)c.V);
    assert_non_null(last);
    memcpy(last, all + (size_t)(p.T - 1) * c.V, sizeof(float) * (size_t)c.V);
    for (int32_t s = 0; s < ng && s < 16; s++) {
      got[s] = argmax(last, c.V);
      if (s == ng - 1) break;
      seq[p.T + s] = got[s];
      int32_t dpos[3 * 512];
      for (int a = 0; a < 3; a++) dpos[a * 512 + p.T + s] = p.T + s + delta;
      forward(&c, NULL, seq, p.T + s, 1, dpos, 512, last);
    }
    printf(
        "  %-10s %-11s kiln's pixels: max |diff| %.3g, %.4f%% identical; logits rel err %.3g "
        "from transformers' pixels' logits\n",
        name, p.name, maxerr, 100.0 * (double)same / (double)total, e);
    for (int32_t s = 0; s < ng; s++)
      if (got[s] != want[s])
        fail_msg("%s/%s: with kiln's preprocessing greedy token %d is %d, transformers %d", name,
                 p.name, s, got[s], want[s]);
    free(want);
    free(last);
    free(all);
    free(mpos);
    kiln_kv_cache_free(c.kv);
    be->buffer_free(c.emb);
    for (int32_t i = 0; i < p.nimg; i++) kiln_image_patches_free(&pat[i]);
    prompt_close(&p);
  }
  kiln_model_free(c.m);
  kiln_json_doc_free(doc);
}

static void test_own_preprocessing(void **state) {
  (void)state;
  check_own_preprocessing("qwen2_vl");
  check_own_preprocessing("qwen2_5_vl");
}

static void test_qwen2_vl(void **state) {
  (void)state;
  check_fixture("qwen2_vl");
}

static void test_qwen2_5_vl(void **state) {
  (void)state;
  check_fixture("qwen2_5_vl");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_tiny_qwen2_vl),     cmocka_unit_test(test_tiny_qwen2_5_vl),
      cmocka_unit_test(test_tiny_bf16),         cmocka_unit_test(test_bad_input),
      cmocka_unit_test(test_qwen2_vl),          cmocka_unit_test(test_qwen2_5_vl),
      cmocka_unit_test(test_own_preprocessing),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
