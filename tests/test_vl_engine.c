/* test_vl_engine.c - image requests through the engine (include/kiln/kiln.h) with the tiny
 * Qwen2-VL fixture (tests/fixtures/models/qwen2_vl, made by tools/make_vl_fixtures.py with
 * transformers 5.17), on the cpu backend in float32, the engine stepped by hand:
 *   - every recorded prompt, from transformers' own pixel values and from Kiln's own decoding and
 *     preprocessing of the fixture's image files, gives transformers' greedy tokens, the first
 *     token's logprob within 1e-4 of transformers' (max_logit - logsumexp of the last prompt row)
 *     and usage.prompt_tokens counting the image tokens;
 *   - the prefix cache: the same text with another image of the same size shares only the blocks
 *     before the image and gives other logprobs; the same image again hits the cache and gives the
 *     same logprobs as the first time;
 *   - chunked prefill that splits an image's tokens across steps, a batch mixing text-only and
 *     image requests, and preemption (recompute) of image requests give the same results;
 *   - bad requests are refused with a message naming the image: too many images, placeholders
 *     that do not match, undecodable, truncated and unsupported images, a bad grid, an image to a
 *     text-only model.
 * The same requests on the tiny Qwen2.5-VL fixture (tests/fixtures/models/qwen2_5_vl) too.
 * The backend is cpu unless KILN_TEST_BACKEND names another. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "base/config.h"
#include "base/json.h"
#include "base/npy.h"
#include "core/engine/engine_internal.h"
#include "kiln/kiln.h"

#define LP_TOL 1e-4
#define MAXP 8  /* prompts */
#define MAXI 4  /* images per prompt */
#define STEPS 8 /* greedy tokens recorded */
#define PATCH 1176

static char g_dir[1100], g_src[1024];

typedef struct prompt {
  char name[64];
  int32_t ids[256];  /* collapsed: one placeholder per image */
  int32_t n, full_n; /* collapsed and expanded lengths */
  int32_t nimg;
  int32_t grid[MAXI][3];
  char files[MAXI][1400];
  float *pixels; /* all images' pixel values, in order */
  int32_t greedy[STEPS];
  double first_lp; /* transformers' logprob of the first greedy token */
} prompt_t;

static prompt_t g_p[MAXP];
static int32_t g_np;
static int32_t g_image_token;

static void check_st(kiln_status_t st) {
  if (st) fail_msg("%s", kiln_status_message(st));
}

static int64_t jint(const kiln_json_t *v) {
  int64_t x = 0;
  assert_true(kiln_json_int64(v, &x));
  return x;
}

static const char *g_name = "qwen2_vl"; /* the fixture of the group running */

static int setup(void **state) {
  (void)state;
  const char *src = getenv("KILN_SOURCE_DIR");
  snprintf(g_src, sizeof(g_src), "%s", src ? src : "..");
  snprintf(g_dir, sizeof(g_dir), "%s/tests/fixtures/models/%s", g_src, g_name);
  g_np = 0;
  char path[1200];
  snprintf(path, sizeof(path), "%s/reference.json", g_dir);
  kiln_json_doc_t *doc = NULL;
  kiln_status_t st = kiln_json_parse_file(path, &doc);
  if (st) {
    fprintf(stderr, "%s\n", kiln_status_message(st));
    kiln_status_free(st);
    return -1;
  }
  const kiln_json_t *root = kiln_json_root(doc);
  g_image_token = (int32_t)jint(kiln_json_get(root, "image_token_id"));
  const kiln_json_t *ps = kiln_json_get(root, "prompts");
  for (size_t i = 0; i < kiln_json_len(ps) && g_np < MAXP; i++) {
    const kiln_json_t *j = kiln_json_at(ps, i);
    prompt_t *p = &g_p[g_np++];
    memset(p, 0, sizeof(*p));
    snprintf(p->name, sizeof(p->name), "%s", kiln_json_string(kiln_json_get(j, "name"), NULL));
    const kiln_json_t *ids = kiln_json_get(j, "input_ids");
    p->full_n = (int32_t)kiln_json_len(ids);
    for (int32_t t = 0; t < p->full_n; t++) {
      int32_t id = (int32_t)jint(kiln_json_at(ids, (size_t)t));
      if (id == g_image_token && p->n && p->ids[p->n - 1] == g_image_token) continue;
      assert_true(p->n < 256);
      p->ids[p->n++] = id;
    }
    const kiln_json_t *imgs = kiln_json_get(j, "images"),
                      *grids = kiln_json_get(j, "image_grid_thw");
    p->nimg = (int32_t)kiln_json_len(imgs);
    assert_true(p->nimg <= MAXI);
    int64_t rows = 0;
    for (int32_t k = 0; k < p->nimg; k++) {
      snprintf(p->files[k], sizeof(p->files[k]), "%s/images/%s", g_dir,
               kiln_json_string(kiln_json_at(imgs, (size_t)k), NULL));
      for (int a = 0; a < 3; a++)
        p->grid[k][a] = (int32_t)jint(kiln_json_at(kiln_json_at(grids, (size_t)k), (size_t)a));
      rows += (int64_t)p->grid[k][0] * p->grid[k][1] * p->grid[k][2];
    }
    const kiln_json_t *pf = kiln_json_get(j, "pixel_values_file");
    if (p->nimg) {
      snprintf(path, sizeof(path), "%s/%s", g_dir, kiln_json_string(pf, NULL));
      int64_t r = 0, c = 0;
      check_st(kiln_npy_read_f32(path, &p->pixels, &r, &c));
      assert_int_equal(r, rows);
      assert_int_equal(c, PATCH);
    }
    const kiln_json_t *g = kiln_json_get(kiln_json_get(j, "greedy"), "token_ids");
    assert_int_equal(kiln_json_len(g), STEPS);
    for (int32_t k = 0; k < STEPS; k++) p->greedy[k] = (int32_t)jint(kiln_json_at(g, (size_t)k));
    const kiln_json_t *ml = kiln_json_get(j, "max_logit"), *ls = kiln_json_get(j, "logsumexp");
    p->first_lp = kiln_json_number(kiln_json_at(ml, (size_t)p->full_n - 1)) -
                  kiln_json_number(kiln_json_at(ls, (size_t)p->full_n - 1));
  }
  kiln_json_doc_free(doc);
  return g_np >= 4 ? 0 : -1;
}

static int teardown(void **state) {
  (void)state;
  for (int32_t i = 0; i < g_np; i++) free(g_p[i].pixels);
  g_np = 0;
  return 0;
}

static int setup_2_5(void **state) {
  g_name = "qwen2_5_vl";
  return setup(state);
}

static const prompt_t *find(const char *name) {
  for (int32_t i = 0; i < g_np; i++)
    if (!strcmp(g_p[i].name, name)) return &g_p[i];
  fail_msg("no prompt %s in reference.json", name);
  return NULL;
}

/* ---- an engine stepped by hand ------------------------------------------------------------ */

typedef struct eng {
  kiln_config_t *cfg;
  kiln_engine_t *e;
} eng_t;

static uint64_t g_enc_bytes; /* the next engine's encoder cache bound (0: the config's) */

static void eng_open(eng_t *g, const char *model_dir, const char *const *extra, int32_t nextra) {
  memset(g, 0, sizeof(*g));
  check_st(kiln_config_create(&g->cfg));
  char mp[1200], be[80];
  snprintf(mp, sizeof(mp), "model.path=%s", model_dir);
  const char *want = getenv("KILN_TEST_BACKEND");
  snprintf(be, sizeof(be), "backend.name=%s", want && want[0] ? want : "cpu");
  const char *base[] = {mp,
                        be,
                        "backend.threads=2",
                        "model.dtype=float32",
                        "cache.block_size=8",
                        "cache.num_blocks=256"};
  for (size_t i = 0; i < sizeof(base) / sizeof(base[0]); i++)
    check_st(kiln_config_set(g->cfg, base[i]));
  for (int32_t i = 0; i < nextra; i++) check_st(kiln_config_set(g->cfg, extra[i]));
  kiln_engine_setup_t su;
  memset(&su, 0, sizeof(su));
  su.config = g->cfg;
  su.manual = true;
  su.encoder_cache_bytes = g_enc_bytes;
  check_st(kiln_engine_create_setup(&su, &g->e));
}

static void eng_close(eng_t *g) {
  check_st(kiln_kv_check(kiln_engine_kv(g->e)));
  uint64_t enc, ev, used;
  kiln_engine_encoder_stats(g->e, &enc, &ev, &used);
  assert_int_equal(used, 0); /* every encoder output was freed once consumed */
  kiln_engine_destroy(g->e);
  kiln_config_free(g->cfg);
}

typedef struct result {
  int32_t ids[64];
  int32_t n;
  float lp0; /* the first token's logprob */
  int32_t prompt_tokens, cached;
  kiln_finish_reason_t fin;
  bool done;
} result_t;

/* Images of prompt p as kiln_image_input_t: pixel values (files = false) or the files' bytes,
 * read into bufs (freed by the caller). */
static int32_t make_images(const prompt_t *p, bool files, kiln_image_input_t *im, void **bufs) {
  int64_t off = 0;
  for (int32_t k = 0; k < p->nimg; k++) {
    memset(&im[k], 0, sizeof(im[k]));
    bufs[k] = NULL;
    if (files) {
      FILE *f = fopen(p->files[k], "rb");
      assert_non_null(f);
      fseek(f, 0, SEEK_END);
      long sz = ftell(f);
      fseek(f, 0, SEEK_SET);
      bufs[k] = malloc((size_t)sz);
      assert_non_null(bufs[k]);
      assert_int_equal(fread(bufs[k], 1, (size_t)sz, f), (size_t)sz);
      fclose(f);
      im[k].data = bufs[k];
      im[k].size = (size_t)sz;
    } else {
      im[k].pixel_values = p->pixels + off * PATCH;
      im[k].grid_t = p->grid[k][0];
      im[k].grid_h = p->grid[k][1];
      im[k].grid_w = p->grid[k][2];
    }
    off += (int64_t)p->grid[k][0] * p->grid[k][1] * p->grid[k][2];
  }
  return p->nimg;
}

static kiln_status_t submit(eng_t *g, const int32_t *ids, int32_t n, const kiln_image_input_t *im,
                            int32_t nimg, int32_t max_tokens, kiln_request_t **out) {
  kiln_sampling_params_t sp;
  kiln_sampling_params_init(&sp);
  sp.temperature = 0;
  sp.max_tokens = max_tokens;
  sp.ignore_eos = true;
  sp.logprobs = 0;
  sp.detokenize = false;
  kiln_request_desc_t d = {.struct_size = sizeof(d),
                           .prompt_ids = ids,
                           .num_prompt_ids = n,
                           .params = &sp,
                           .images = im,
                           .num_images = nimg};
  return kiln_engine_submit(g->e, &d, out);
}

/* Steps the engine until every request has finished, collecting their events. */
static void run_all(eng_t *g, kiln_request_t **r, result_t *res, int32_t n) {
  for (int32_t i = 0; i < n; i++) memset(&res[i], 0, sizeof(res[i]));
  for (int32_t guard = 0; guard < 10000; guard++) {
    bool idle = false;
    check_st(kiln_engine_step(g->e, &idle));
    bool all = true;
    for (int32_t i = 0; i < n; i++) {
      kiln_output_t *o;
      while (!res[i].done && !kiln_request_poll(r[i], 0, &o) && o) {
        for (int32_t k = 0; k < o->num_tokens; k++) {
          if (res[i].n == 0) res[i].lp0 = o->logprobs ? o->logprobs[k] : NAN;
          assert_true(res[i].n < 64);
          res[i].ids[res[i].n++] = o->token_ids[k];
        }
        res[i].prompt_tokens = o->usage.prompt_tokens;
        res[i].cached = o->usage.cached_tokens;
        if (o->request_finished) {
          res[i].done = true;
          res[i].fin = o->finish_reason;
          if (o->error) fail_msg("request %d: %s", i, o->error);
        }
        kiln_output_free(o);
      }
      all &= res[i].done;
    }
    if (all) {
      for (int32_t i = 0; i < n; i++) kiln_request_release(r[i]);
      return;
    }
  }
  fail_msg("the requests did not finish");
}

static void expect_reference(const prompt_t *p, const result_t *res, const char *how) {
  assert_int_equal(res->fin, KILN_FINISH_LENGTH);
  assert_int_equal(res->n, STEPS);
  for (int32_t k = 0; k < STEPS; k++)
    if (res->ids[k] != p->greedy[k])
      fail_msg("%s (%s): token %d is %d, transformers %d", p->name, how, k, res->ids[k],
               p->greedy[k]);
  assert_int_equal(res->prompt_tokens, p->full_n);
  if (!(fabs(res->lp0 - p->first_lp) <= LP_TOL))
    fail_msg("%s (%s): first logprob %.7f, transformers %.7f", p->name, how, (double)res->lp0,
             p->first_lp);
}

/* ---- tests -------------------------------------------------------------------------------- */

static void run_prompts(bool files, const char *const *extra, int32_t nextra, const char *how,
                        bool together) {
  eng_t g;
  eng_open(&g, g_dir, extra, nextra);
  kiln_request_t *r[MAXP];
  result_t res[MAXP];
  void *bufs[MAXP][MAXI];
  kiln_image_input_t im[MAXP][MAXI];
  for (int32_t i = 0; i < g_np; i++) {
    int32_t ni = make_images(&g_p[i], files, im[i], bufs[i]);
    check_st(submit(&g, g_p[i].ids, g_p[i].n, im[i], ni, STEPS, &r[i]));
    if (!together) {
      run_all(&g, &r[i], &res[i], 1);
      expect_reference(&g_p[i], &res[i], how);
    }
  }
  if (together) {
    run_all(&g, r, res, g_np);
    for (int32_t i = 0; i < g_np; i++) expect_reference(&g_p[i], &res[i], how);
  }
  for (int32_t i = 0; i < g_np; i++)
    for (int32_t k = 0; k < g_p[i].nimg; k++) free(bufs[i][k]);
  if (together) {
    kiln_metrics_t m;
    kiln_engine_get_metrics(g.e, &m);
    kiln_model_graph_stats_t gs;
    kiln_model_graph_stats(kiln_engine_model(g.e), &gs);
    print_message("%s: %llu steps, %llu preemptions, %lld graph replays, %lld eager forwards\n",
                  how, (unsigned long long)m.steps, (unsigned long long)m.preemptions,
                  (long long)gs.replays, (long long)gs.eager_forwards);
    /* decode steps of image requests (M-RoPE delta != 0) replay the decode graphs */
    if (gs.active) assert_true(gs.replays > 0);
  }
  eng_close(&g);
}

/* Every prompt alone, from transformers' pixel values, then from the image files. */
static void test_reference_pixel_values(void **state) {
  (void)state;
  const char *ex[] = {"cache.enable_prefix_caching=false"};
  run_prompts(false, ex, 1, "pixel values", false);
}

static void test_reference_files(void **state) {
  (void)state;
  const char *ex[] = {"cache.enable_prefix_caching=false"};
  run_prompts(true, ex, 1, "Kiln's preprocessing", false);
}

/* All prompts at once: text-only and image requests in the same batches. */
static void test_mixed_batch(void **state) {
  (void)state;
  run_prompts(false, NULL, 0, "mixed batch", true);
}

/* Chunks of 12 tokens: every image's tokens are split across steps (with 7 prompts in flight,
 * the chunks also land at every offset). */
static void test_chunked_split(void **state) {
  (void)state;
  const char *ex[] = {"engine.max_num_batched_tokens=12", "cache.enable_prefix_caching=false"};
  run_prompts(false, ex, 2, "chunks of 12", false);
  run_prompts(true, ex, 2, "chunks of 12, together", true);
}

/* A pool of 14 blocks of 8 tokens: the longest request alone needs 9, so running them together
 * preempts (recomputing the image requests' prompts, re-encoding their images). */
static void test_preemption(void **state) {
  (void)state;
  const char *ex[] = {"cache.num_blocks=14", "cache.enable_prefix_caching=false"};
  eng_t g;
  eng_open(&g, g_dir, ex, 2);
  kiln_request_t *r[MAXP];
  result_t res[MAXP];
  void *bufs[MAXP][MAXI];
  kiln_image_input_t im[MAXP][MAXI];
  const prompt_t *ps[MAXP];
  int32_t n = 0, images = 0;
  for (int32_t i = 0; i < g_np; i++) {
    if (!g_p[i].nimg) continue; /* image requests only: whoever is preempted has images */
    ps[n] = &g_p[i];
    int32_t ni = make_images(ps[n], false, im[n], bufs[n]);
    images += ni;
    check_st(submit(&g, ps[n]->ids, ps[n]->n, im[n], ni, STEPS, &r[n]));
    n++;
  }
  run_all(&g, r, res, n);
  for (int32_t i = 0; i < n; i++) expect_reference(ps[i], &res[i], "preempted");
  kiln_metrics_t m;
  kiln_engine_get_metrics(g.e, &m);
  uint64_t enc, ev, used;
  kiln_engine_encoder_stats(g.e, &enc, &ev, &used);
  print_message("preemption: %llu preemptions, %llu encodes for %d images\n",
                (unsigned long long)m.preemptions, (unsigned long long)enc, images);
  assert_true(m.preemptions > 0);
  assert_true(enc > (uint64_t)images); /* a recomputed prompt encodes its images again */
  eng_close(&g);
}

/* An encoder cache that holds one image's output (18 tokens x 16 x 4 bytes, the largest), every
 * prompt in flight in chunks of 12 in a pool small enough to preempt: every result is still
 * transformers', and every output is freed once consumed. (Evictions need an output that waits
 * while another image is encoded, which this scheduler rarely makes: the count is printed, not
 * required.) An image larger than the bound is refused. */
static void test_encoder_cache_bound(void **state) {
  (void)state;
  const char *ex[] = {"engine.max_num_batched_tokens=12", "cache.enable_prefix_caching=false",
                      "cache.num_blocks=14"};
  g_enc_bytes = 18 * 16 * 4;
  eng_t g;
  eng_open(&g, g_dir, ex, 3);
  kiln_request_t *r[MAXP];
  result_t res[MAXP];
  void *bufs[MAXP][MAXI];
  kiln_image_input_t im[MAXP][MAXI];
  int32_t images = 0;
  for (int32_t i = 0; i < g_np; i++) {
    int32_t ni = make_images(&g_p[i], false, im[i], bufs[i]);
    images += ni;
    check_st(submit(&g, g_p[i].ids, g_p[i].n, im[i], ni, STEPS, &r[i]));
  }
  run_all(&g, r, res, g_np);
  for (int32_t i = 0; i < g_np; i++) expect_reference(&g_p[i], &res[i], "bounded encoder cache");
  uint64_t enc, ev, used;
  kiln_engine_encoder_stats(g.e, &enc, &ev, &used);
  print_message("encoder cache of %llu bytes: %llu encodes for %d images, %llu evictions\n",
                (unsigned long long)g_enc_bytes, (unsigned long long)enc, images,
                (unsigned long long)ev);
  assert_true(enc >= (uint64_t)images);
  eng_close(&g);
  /* one image's output over the bound */
  g_enc_bytes = 14 * 16 * 4;
  eng_open(&g, g_dir, NULL, 0);
  const prompt_t *p = find("one_image");
  kiln_image_input_t a = {
      .pixel_values = p->pixels, .grid_t = 1, .grid_h = p->grid[0][1], .grid_w = p->grid[0][2]};
  kiln_request_t *rq = NULL;
  kiln_status_t st = submit(&g, p->ids, p->n, &a, 1, STEPS, &rq);
  assert_non_null(st);
  assert_non_null(strstr(kiln_status_message(st),
                         "image 0: its encoder output (15 tokens, 960 bytes) is larger than the "
                         "encoder cache ([model] encoder_cache_mb: 896 bytes)"));
  kiln_status_free(st);
  eng_close(&g);
  g_enc_bytes = 0;
}

/* The prefix cache tells images apart. */
static void test_prefix_cache(void **state) {
  (void)state;
  const prompt_t *p = find("one_image");
  int64_t rows = (int64_t)p->grid[0][0] * p->grid[0][1] * p->grid[0][2];
  float *other = malloc((size_t)rows * PATCH * sizeof(float));
  assert_non_null(other);
  memcpy(other, p->pixels, (size_t)rows * PATCH * sizeof(float));
  for (int64_t i = 0; i < rows * PATCH; i += 7) other[i] = -other[i]; /* another picture */
  int32_t first = -1;                                                 /* the first image token */
  for (int32_t t = 0; t < p->n && first < 0; t++)
    if (p->ids[t] == g_image_token) first = t;
  assert_true(first > 8); /* so that block 0 (8 tokens) is text only */
  eng_t g;
  eng_open(&g, g_dir, NULL, 0);
  kiln_image_input_t a = {
      .pixel_values = p->pixels, .grid_t = 1, .grid_h = p->grid[0][1], .grid_w = p->grid[0][2]};
  kiln_image_input_t b = a;
  b.pixel_values = other;
  kiln_request_t *r;
  result_t ra, rb, rc, rd;
  check_st(submit(&g, p->ids, p->n, &a, 1, STEPS, &r));
  run_all(&g, &r, &ra, 1);
  expect_reference(p, &ra, "prefix cache, first");
  assert_int_equal(ra.cached, 0);
  /* The same text, another image of the same size: only the blocks before the image. */
  check_st(submit(&g, p->ids, p->n, &b, 1, STEPS, &r));
  run_all(&g, &r, &rb, 1);
  assert_int_equal(rb.cached, first / 8 * 8);
  assert_int_equal(rb.prompt_tokens, p->full_n);
  if (!(fabs(rb.lp0 - ra.lp0) > 1e-6))
    fail_msg("another image gave the same first logprob %.7f", (double)rb.lp0);
  /* The first image again: a cache hit past the image, and the first result. */
  check_st(submit(&g, p->ids, p->n, &a, 1, STEPS, &r));
  run_all(&g, &r, &rc, 1);
  print_message("prefix cache: cached %d, %d, %d of %d\n", ra.cached, rb.cached, rc.cached,
                p->full_n);
  assert_true(rc.cached > first + p->full_n - p->n);
  expect_reference(p, &rc, "prefix cache, again");
  /* And the other image again: its own blocks, its own result. */
  check_st(submit(&g, p->ids, p->n, &b, 1, STEPS, &r));
  run_all(&g, &r, &rd, 1);
  assert_true(rd.cached > first + p->full_n - p->n);
  assert_true(fabs(rd.lp0 - rb.lp0) <= 1e-6);
  for (int32_t k = 0; k < STEPS; k++) assert_int_equal(rd.ids[k], rb.ids[k]);
  /* The same image, other text after it: the hit ends inside the image's tokens (blocks of 8:
   * the image's last block also holds the changed text), so the step starts mid-image and
   * takes the encoder's rows from there; the result is the one computed without the cache. */
  int32_t alt[256];
  memcpy(alt, p->ids, sizeof(int32_t) * (size_t)p->n);
  alt[first + 2] = 100; /* the first text token after <|vision_end|> */
  const int32_t img_end = first + p->full_n - p->n + 1; /* past the image's tokens */
  assert_true(img_end % 8 != 0);
  result_t re, rf;
  check_st(submit(&g, alt, p->n, &a, 1, STEPS, &r));
  run_all(&g, &r, &re, 1);
  print_message("prefix cache: another text after the image: cached %d (image tokens %d..%d)\n",
                re.cached, first, img_end - 1);
  assert_int_equal(re.cached, (img_end - 1) / 8 * 8);
  assert_true(re.cached > first); /* inside the image */
  eng_close(&g);
  const char *nocache[] = {"cache.enable_prefix_caching=false"};
  eng_open(&g, g_dir, nocache, 1);
  check_st(submit(&g, alt, p->n, &a, 1, STEPS, &r));
  run_all(&g, &r, &rf, 1);
  assert_int_equal(rf.cached, 0);
  if (!(fabs(re.lp0 - rf.lp0) <= 1e-5))
    fail_msg("from mid-image: first logprob %.7f, computed whole %.7f", (double)re.lp0,
             (double)rf.lp0);
  for (int32_t k = 0; k < STEPS; k++) assert_int_equal(re.ids[k], rf.ids[k]);
  free(other);
  eng_close(&g);
}

static void expect_refused(eng_t *g, const int32_t *ids, int32_t n, const kiln_image_input_t *im,
                           int32_t nimg, int code, const char *needle) {
  kiln_request_t *r = NULL;
  kiln_status_t st = submit(g, ids, n, im, nimg, 4, &r);
  if (!st) fail_msg("accepted; wanted an error with '%s'", needle);
  assert_null(r);
  const char *msg = kiln_status_message(st);
  if (!strstr(msg, needle)) fail_msg("error '%s' does not say '%s'", msg, needle);
  if (code >= 0) assert_int_equal(kiln_status_code(st), code);
  kiln_status_free(st);
}

static void *read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  fseek(f, 0, SEEK_END);
  long sz = ftell(f);
  fseek(f, 0, SEEK_SET);
  void *b = malloc((size_t)sz + 1);
  assert_non_null(b);
  assert_int_equal(fread(b, 1, (size_t)sz, f), (size_t)sz);
  fclose(f);
  *len = (size_t)sz;
  return b;
}

static void test_errors(void **state) {
  (void)state;
  const char *ex[] = {"model.max_images_per_prompt=1"};
  eng_t g;
  eng_open(&g, g_dir, ex, 1);
  const prompt_t *one = find("one_image"), *two = find("two_images"), *txt = find("text_only");
  kiln_image_input_t im[MAXI];
  void *bufs[MAXI];
  make_images(two, true, im, bufs);
  expect_refused(&g, two->ids, two->n, im, 2, KILN_ERR_INVALID_ARGUMENT,
                 "2 images, more than [model] max_images_per_prompt (1)");
  expect_refused(&g, txt->ids, txt->n, im, 1, KILN_ERR_INVALID_ARGUMENT,
                 "the prompt has 0 image placeholders (token 151655, <|image_pad|>) for 1 image");
  expect_refused(&g, one->ids, one->n, im, 0, KILN_ERR_INVALID_ARGUMENT,
                 "the prompt has 1 image placeholder (token 151655, <|image_pad|>) for 0 images");
  /* undecodable, truncated, unsupported, empty */
  size_t len = 0;
  char path[1200];
  kiln_image_input_t bad = {.data = "this is not an image at all", .size = 27};
  expect_refused(&g, one->ids, one->n, &bad, 1, KILN_ERR_UNSUPPORTED,
                 "image 0: not a PNG, JPEG or WebP image");
  bad = (kiln_image_input_t){.data = im[0].data, .size = im[0].size / 2};
  expect_refused(&g, one->ids, one->n, &bad, 1, KILN_ERR_INVALID_ARGUMENT, "image 0: ");
  snprintf(path, sizeof(path), "%s/tests/data/images/tiny.gif", g_src);
  void *gif = read_file(path, &len);
  bad = (kiln_image_input_t){.data = gif, .size = len};
  expect_refused(&g, one->ids, one->n, &bad, 1, KILN_ERR_UNSUPPORTED,
                 "image 0: GIF images are not supported (PNG, JPEG and WebP are)");
  free(gif);
  bad = (kiln_image_input_t){.data = NULL, .size = 0};
  expect_refused(&g, one->ids, one->n, &bad, 1, KILN_ERR_INVALID_ARGUMENT,
                 "image 0: no image data");
  /* pixel values with a grid that is not whole merge units, or a video */
  bad = (kiln_image_input_t){.pixel_values = one->pixels, .grid_t = 1, .grid_h = 3, .grid_w = 4};
  expect_refused(&g, one->ids, one->n, &bad, 1, KILN_ERR_INVALID_ARGUMENT,
                 "image 0: grid 1 x 3 x 4 is not whole 2 x 2 merge units");
  bad.grid_t = 2;
  expect_refused(&g, one->ids, one->n, &bad, 1, KILN_ERR_UNSUPPORTED, "image 0: grid_t is 2");
  for (int32_t k = 0; k < two->nimg; k++) free(bufs[k]);
  assert_int_equal(kiln_engine_max_images(g.e), 1);
  kiln_metrics_t m;
  kiln_engine_get_metrics(g.e, &m);
  assert_int_equal(m.requests_rejected, 9);
  eng_close(&g);
  /* a text-only model */
  char llama[1200];
  snprintf(llama, sizeof(llama), "%s/tests/fixtures/models/llama2", g_src);
  eng_open(&g, llama, NULL, 0);
  assert_int_equal(kiln_engine_max_images(g.e), 0);
  int32_t ids[4] = {1, 2, 3, 4};
  kiln_image_input_t px = {.pixel_values = one->pixels, .grid_t = 1, .grid_h = 6, .grid_w = 10};
  expect_refused(&g, ids, 4, &px, 1, KILN_ERR_INVALID_ARGUMENT,
                 "1 image given, but model LlamaForCausalLM takes text only (it has no vision "
                 "tower)");
  eng_close(&g);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_reference_pixel_values),
      cmocka_unit_test(test_reference_files),
      cmocka_unit_test(test_mixed_batch),
      cmocka_unit_test(test_chunked_split),
      cmocka_unit_test(test_preemption),
      cmocka_unit_test(test_encoder_cache_bound),
      cmocka_unit_test(test_prefix_cache),
      cmocka_unit_test(test_errors),
  };
  /* Qwen2.5-VL (RMSNorm, SwiGLU, windowed attention in the tower; 0 temporal stride in M-RoPE):
   * the same requests. */
  const struct CMUnitTest tests_2_5[] = {
      cmocka_unit_test(test_reference_pixel_values),
      cmocka_unit_test(test_reference_files),
      cmocka_unit_test(test_mixed_batch),
      cmocka_unit_test(test_chunked_split),
      cmocka_unit_test(test_preemption),
      cmocka_unit_test(test_prefix_cache),
  };
  int rc = cmocka_run_group_tests_name("qwen2_vl", tests, setup, teardown);
  return rc | cmocka_run_group_tests_name("qwen2_5_vl", tests_2_5, setup_2_5, teardown);
}
