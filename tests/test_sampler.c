/* test_sampler.c - the sampler (core/sample) against the fp64 references of hal/ref/ops_ref.c,
 * on the host path and on the CPU backend's device path, plus reproducibility and errors.
 *
 * Inputs are random with a fresh seed per run (KILN_TEST_SEED=n repeats one; the seed is
 * printed). Token choices must equal the reference's exactly, except on rows where the
 * reference reports a decision within a margin of its threshold (ops_ref_sample's out_margin:
 * the smallest relative distance between any top_p / min_p cut or the draw and its
 * threshold). There, arithmetic that is correct but rounds differently may choose otherwise:
 * the host path rounds penalized logits to f32 (the reference keeps them in double, ~1e-6
 * relative after temperature), so host-vs-reference uses 1e-5; the CPU backend's f32
 * softmax and f32 partition sum err by ~1e-6 to 1e-5 at V = 32000, so device-vs-host uses
 * 1e-4 (the op conformance suite's bound). Such rows are counted and printed, and most rows
 * must be checked exactly. Logprobs match within 1e-4 (relative above 1).
 */
#define _POSIX_C_SOURCE 200809L
#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "core/sample/sampler.h"
#include "hal/loader.h"
#include "hal/ref/ops_ref.h"
#include "kiln/hal_util.h"

#define ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))
#define MAX_TOP 5
#define MAX_ROWS 32
#define HOST_MARGIN 1e-5
#define DEVICE_MARGIN 1e-4
#define LOGPROB_TOL 1e-4

static uint64_t g_seed, g_rng;
static kiln_hal_registry_t *g_registry;
static const kiln_hal_backend_t *g_be;
static kiln_hal_device_t *g_dev;
static kiln_hal_stream_t *g_stream;

/* ---- random numbers ------------------------------------------------------------------------ */

static uint64_t rng_u64(void) {
  uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static double rng_uniform(void) { return (double)(rng_u64() >> 11) * (1.0 / 9007199254740992.0); }
static int32_t rng_int(int32_t n) { return (int32_t)(rng_u64() % (uint64_t)n); }
static double rng_normal(void) {
  double u = rng_uniform(), v = rng_uniform();
  return sqrt(-2.0 * log(u + 1e-300)) * cos(6.283185307179586 * v);
}
static double pick(const double *menu, size_t n) { return menu[rng_int((int32_t)n)]; }

/* ---- fixture ------------------------------------------------------------------------------ */

static void die_status(kiln_status_t st, const char *what) {
  if (!st) return;
  print_error("%s: %s\n", what, kiln_status_message(st));
  kiln_status_free(st);
  fail();
}

static void die_hal(kiln_hal_error_t *e, const char *what) {
  if (!e) return;
  print_error("%s: %s\n", what, e->message);
  kiln_hal_error_free(e);
  fail();
}

static int group_setup(void **state) {
  (void)state;
  const char *env = getenv("KILN_TEST_SEED");
  g_seed = env && *env ? strtoull(env, NULL, 0) : (uint64_t)time(NULL) ^ (uint64_t)clock();
  g_rng = g_seed;
  printf("test_sampler: seed %llu (KILN_TEST_SEED=%llu repeats this run)\n",
         (unsigned long long)g_seed, (unsigned long long)g_seed);
  /* Only the CPU plugin, by path from the first directory of $KILN_BACKEND_PATH (what ctest
   * sets): scanning would also load the GPU plugins, whose runtimes cost seconds under
   * valgrind. Without the variable, the usual search finds "cpu". */
  kiln_hal_registry_options_t opts;
  memset(&opts, 0, sizeof(opts));
  char path[4096] = "cpu";
  const char *dirs = getenv("KILN_BACKEND_PATH");
  if (dirs && *dirs) {
    size_t n = strcspn(dirs, ":");
    snprintf(path, sizeof(path), "%.*s/libkiln-backend-cpu.so", (int)n, dirs);
    opts.skip_env = opts.skip_default_dirs = true;
  }
  kiln_status_t st = kiln_hal_registry_create(&opts, &g_registry);
  const kiln_hal_plugin_t *p = NULL;
  if (!st) st = kiln_hal_registry_open(g_registry, path, &p);
  if (st) {
    printf("test_sampler: cannot open the cpu backend: %s\n", kiln_status_message(st));
    kiln_status_free(st);
    return -1; /* the device path must be tested: no silent pass */
  }
  g_be = &p->table;
  kiln_hal_error_t *e = g_be->device_open(0, &g_dev);
  if (!e) e = g_be->stream_create(g_dev, &g_stream);
  if (e) {
    printf("test_sampler: cpu device 0: %s\n", e->message);
    kiln_hal_error_free(e);
    return -1;
  }
  return 0;
}

static int group_teardown(void **state) {
  (void)state;
  if (g_stream) g_be->stream_destroy(g_stream);
  if (g_dev) g_be->device_close(g_dev);
  kiln_hal_registry_free(g_registry);
  return 0;
}

/* ---- batches ------------------------------------------------------------------------------ */

typedef struct batch {
  int32_t V, R, ns, nc;
  float *logits; /* [R, V] */
  kiln_sample_row_t rows[MAX_ROWS];
  kiln_score_row_t scores[MAX_ROWS];
  int32_t *ids;    /* storage for every row's token lists */
  float *bvals;    /* storage for bias values */
  uint32_t *masks; /* [MAX_ROWS, ceil(V / 32)] token masks of constrained decoding */
} batch_t;

typedef struct results {
  int32_t tokens[MAX_ROWS];
  float logprobs[MAX_ROWS];
  int32_t top_ids[MAX_ROWS * MAX_TOP];
  float top_logprobs[MAX_ROWS * MAX_TOP];
  float score_logprobs[MAX_ROWS];
  int32_t score_top_ids[MAX_ROWS * MAX_TOP];
  float score_top_logprobs[MAX_ROWS * MAX_TOP];
} results_t;

static kiln_sample_out_t out_of(results_t *r) {
  memset(r, 0, sizeof(*r));
  kiln_sample_out_t o = {r->tokens,         r->logprobs,      r->top_ids,           r->top_logprobs,
                         r->score_logprobs, r->score_top_ids, r->score_top_logprobs};
  return o;
}

/* Logits like a model's: a peaked normal spread, a few -inf entries and exact ties. */
static void make_row(float *x, int32_t V) {
  double scale = 1.0 + 5.0 * rng_uniform();
  float mx = -INFINITY;
  for (int32_t v = 0; v < V; v++) {
    x[v] = (float)(scale * rng_normal());
    if (x[v] > mx) mx = x[v];
  }
  if (V > 2 && rng_int(3) == 0) x[rng_int(V)] = mx; /* a tie with the maximum */
  if (V > 2 && rng_int(2) == 0) x[rng_int(V)] = x[rng_int(V)];
  if (V > 4 && rng_int(3) == 0) x[rng_int(V)] = -INFINITY;
}

static void random_row(batch_t *b, kiln_sample_row_t *r, int32_t **ids, float **bv, uint64_t *gen) {
  static const double temps[] = {0.5, 0.7, 1.0, 1.0, 1.3};
  static const double topps[] = {0.01, 0.5, 0.8, 0.9, 0.95};
  static const double minps[] = {0.02, 0.05, 0.1, 0.3};
  static const double reps[] = {0.9, 1.1, 1.3};
  static const double pens[] = {-0.3, 0.2, 0.5};
  const int32_t V = b->V;
  memset(r, 0, sizeof(*r));
  r->logits_row = rng_int(b->R);
  r->temperature = rng_int(5) == 0 ? 0.0f : (float)pick(temps, ARRAY_LEN(temps));
  if (rng_int(2)) {
    int32_t ks[] = {1, 2, 5, 40, V + 3};
    r->top_k = ks[rng_int((int32_t)ARRAY_LEN(ks))];
  }
  r->top_p = rng_int(2) ? 1.0f : (float)pick(topps, ARRAY_LEN(topps));
  r->min_p = rng_int(5) < 3 ? 0.0f : (float)pick(minps, ARRAY_LEN(minps));
  r->repetition = rng_int(5) < 3 ? 1.0f : (float)pick(reps, ARRAY_LEN(reps));
  if (rng_int(5) >= 3) {
    r->frequency = (float)pick(pens, ARRAY_LEN(pens));
    r->presence = (float)pick(pens, ARRAY_LEN(pens));
  }
  r->uniform = kiln_sample_uniform(gen);
  /* Token lists, with ids outside [0, V) that must be ignored, and repeats. */
  r->prompt_ids = *ids;
  r->num_prompt = rng_int(3) ? rng_int(20) : 0;
  for (int32_t i = 0; i < r->num_prompt; i++) (*ids)[i] = rng_int(V + 4) - 2;
  *ids += r->num_prompt;
  r->output_ids = *ids;
  r->num_output = rng_int(3) ? rng_int(15) : 0;
  int32_t base = rng_int(V);
  for (int32_t i = 0; i < r->num_output; i++)
    (*ids)[i] = rng_int(6) == 0 ? V + 1 : (base + rng_int(4)) % V;
  *ids += r->num_output;
  r->bias_ids = *ids;
  r->bias_values = *bv;
  r->num_bias = rng_int(2) ? rng_int(5) : 0;
  const float *row = b->logits + (int64_t)r->logits_row * V;
  int32_t amax = 0;
  for (int32_t v = 1; v < V; v++)
    if (row[v] > row[amax]) amax = v;
  for (int32_t i = 0; i < r->num_bias; i++) {
    int32_t kind = rng_int(4);
    (*ids)[i] = kind == 0 ? amax : kind == 1 && i > 0 ? (*ids)[i - 1] : rng_int(V + 2) - 1;
    (*bv)[i] = rng_int(3) == 0 ? -INFINITY : (float)(10.0 * rng_uniform() - 5.0);
  }
  *ids += r->num_bias;
  *bv += r->num_bias;
  r->num_top = rng_int(MAX_TOP + 2) - 1;
  if (r->num_top > V) r->num_top = V;
  /* a token mask on a third of the rows: random, sparse (a few tokens, one of them perhaps
   * the row's maximum) or a single token; always at least one token allowed */
  if (rng_int(3) == 0) {
    const int32_t W = (V + 31) / 32;
    uint32_t *m = b->masks + (int64_t)(r - b->rows) * W;
    int32_t kind = rng_int(3);
    memset(m, 0, (size_t)W * 4);
    if (kind == 0) {
      for (int32_t w = 0; w < W; w++) m[w] = (uint32_t)rng_u64();
    } else {
      int32_t n = kind == 1 ? 1 + rng_int(8) : 1;
      for (int32_t i = 0; i < n; i++) {
        int32_t v = rng_int(2) ? amax : rng_int(V);
        m[v >> 5] |= 1u << (v & 31);
      }
    }
    /* and one token that keeps a finite logit (not -inf, not banned by the bias), so the
     * row has something to sample, as the engine's rows always do */
    int32_t v0 = rng_int(V);
    for (int tries = 0; tries < 4 * V; tries++, v0 = (v0 + 1) % V) {
      bool banned = row[v0] == -INFINITY;
      for (int32_t i = 0; i < r->num_bias; i++)
        banned |= r->bias_ids[i] == v0 && r->bias_values[i] == -INFINITY;
      if (!banned) break;
    }
    m[v0 >> 5] |= 1u << (v0 & 31);
    r->mask = m;
  }
}

static void batch_make(batch_t *b, int32_t V, int32_t R, int32_t ns, int32_t nc, uint64_t *gen) {
  memset(b, 0, sizeof(*b));
  b->V = V;
  b->R = R;
  b->ns = ns;
  b->nc = nc;
  b->logits = malloc(sizeof(float) * (size_t)R * (size_t)V);
  b->ids = malloc(sizeof(int32_t) * MAX_ROWS * 64);
  b->bvals = malloc(sizeof(float) * MAX_ROWS * 8);
  b->masks = malloc(sizeof(uint32_t) * MAX_ROWS * (size_t)((V + 31) / 32));
  assert_non_null(b->masks);
  assert_non_null(b->logits);
  assert_non_null(b->ids);
  assert_non_null(b->bvals);
  for (int32_t r = 0; r < R; r++) make_row(b->logits + (int64_t)r * V, V);
  int32_t *ids = b->ids;
  float *bv = b->bvals;
  for (int32_t i = 0; i < ns; i++) random_row(b, &b->rows[i], &ids, &bv, gen);
  for (int32_t j = 0; j < nc; j++) {
    b->scores[j].logits_row = rng_int(R);
    b->scores[j].token = rng_int(V);
    b->scores[j].num_top = rng_int(MAX_TOP + 1);
    if (b->scores[j].num_top > V) b->scores[j].num_top = V;
  }
}

static void batch_free(batch_t *b) {
  free(b->masks);
  free(b->logits);
  free(b->ids);
  free(b->bvals);
}

/* ---- the reference ------------------------------------------------------------------------ */

typedef struct ref_row {
  double *x; /* [V] processed logits */
  double lse;
  int32_t token;
  double margin;
  int32_t top_ids[MAX_TOP];
  double top_values[MAX_TOP];
} ref_row_t;

static void ref_sample_row(const batch_t *b, const kiln_sample_row_t *r, ref_row_t *o) {
  const int32_t V = b->V;
  o->x = malloc(sizeof(double) * (size_t)V);
  assert_non_null(o->x);
  for (int32_t v = 0; v < V; v++) o->x[v] = b->logits[(int64_t)r->logits_row * V + v];
  double *bv = malloc(sizeof(double) * ((size_t)r->num_bias + 1));
  assert_non_null(bv);
  for (int32_t i = 0; i < r->num_bias; i++) bv[i] = r->bias_values[i];
  ops_ref_penalize_row(V, o->x, r->prompt_ids, r->num_prompt, r->output_ids, r->num_output,
                       r->repetition != 1.0f, r->repetition,
                       r->frequency != 0.0f || r->presence != 0.0f, r->frequency, r->presence,
                       r->bias_ids, bv, r->num_bias);
  free(bv);
  if (r->mask)
    for (int32_t v = 0; v < V; v++)
      if (!((r->mask[v >> 5] >> (v & 31)) & 1)) o->x[v] = -INFINITY;
  o->token =
      ops_ref_sample(V, o->x, r->temperature, r->top_k, r->top_p, r->min_p, r->uniform, &o->margin);
  o->lse = ops_ref_logsumexp(V, o->x);
  if (r->num_top > 0) ops_ref_topk(V, o->x, r->num_top, o->top_ids, o->top_values);
}

static void ref_score_row(const batch_t *b, const kiln_score_row_t *c, ref_row_t *o) {
  const int32_t V = b->V;
  o->x = malloc(sizeof(double) * (size_t)V);
  assert_non_null(o->x);
  for (int32_t v = 0; v < V; v++) o->x[v] = b->logits[(int64_t)c->logits_row * V + v];
  o->lse = ops_ref_logsumexp(V, o->x);
  o->token = c->token;
  o->margin = INFINITY;
  if (c->num_top > 0) ops_ref_topk(V, o->x, c->num_top, o->top_ids, o->top_values);
}

/* ---- comparisons -------------------------------------------------------------------------- */

typedef struct tally {
  int rows, sampled, exact, loose, mismatches;
} tally_t;

/* mag: the magnitude of the logit and the logsumexp the logprob was computed from: an f32
 * implementation rounds each to ~6e-8 of it (logits of size 900 lose ~1e-4). */
static bool close_lp(double got, double want, double mag) {
  if (got == want) return true;              /* -inf */
  if (isnan(got) && isnan(want)) return true; /* the reference is NaN too (no finite logit) */
  return fabs(got - want) <= LOGPROB_TOL * fmax(1.0, fabs(want)) + 8 * FLT_EPSILON * mag;
}

static void check_lp(const char *label, const char *what, int32_t row, double got, double want,
                     double mag) {
  if (close_lp(got, want, mag)) return;
  print_error("%s: %s of row %d: got %.9g, want %.9g (seed %llu)\n", label, what, (int)row, got,
              want, (unsigned long long)g_seed);
  fail();
}

/* Top-N: ids in rank order (a swap is allowed between values equal within rounding), and
 * logprob = value - lse. */
static void check_top(const char *label, int32_t row, int32_t n, const int32_t *got_ids,
                      const float *got_lps, const ref_row_t *ref) {
  for (int32_t q = 0; q < n; q++) {
    int32_t g = got_ids[q], w = ref->top_ids[q];
    if (g != w) {
      double vg = ref->x[g], vw = ref->top_values[q];
      if (!(fabs(vg - vw) <= 1e-5 * fmax(1.0, fabs(vw)))) {
        print_error("%s: row %d top[%d]: got token %d (logit %.9g), want %d (%.9g) (seed %llu)\n",
                    label, (int)row, (int)q, (int)g, vg, (int)w, vw, (unsigned long long)g_seed);
        fail();
      }
    }
    check_lp(label, "top logprob", row, got_lps[q], ref->x[g] - ref->lse,
             fabs(ref->x[g]) + fabs(ref->lse));
  }
}

/* Checks results against the reference; `expect` (NULL: the reference's tokens) gives the
 * tokens to match, with mismatches allowed where the reference's margin < margin_tol. */
static void check_results(const char *label, const batch_t *b, const results_t *got,
                          const ref_row_t *ref, const int32_t *expect, double margin_tol,
                          tally_t *t) {
  for (int32_t i = 0; i < b->ns; i++) {
    const kiln_sample_row_t *r = &b->rows[i];
    int32_t g = got->tokens[i], w = expect ? expect[i] : ref[i].token;
    t->rows++;
    if (r->temperature > 0) t->sampled++;
    if (g < 0 || g >= b->V) {
      print_error("%s: row %d: token %d outside [0, %d)\n", label, (int)i, (int)g, (int)b->V);
      fail();
    }
    if (ref[i].margin >= margin_tol)
      t->exact++;
    else
      t->loose++;
    if (g != w) {
      if (ref[i].margin >= margin_tol) {
        print_error(
            "%s: row %d (t %g, top_k %d, top_p %g, min_p %g, rep %g, freq %g, pres %g, "
            "bias %d, uniform %.9g): got token %d, want %d, reference margin %.3g "
            "(seed %llu)\n",
            label, (int)i, (double)r->temperature, (int)r->top_k, (double)r->top_p,
            (double)r->min_p, (double)r->repetition, (double)r->frequency, (double)r->presence,
            (int)r->num_bias, (double)r->uniform, (int)g, (int)w, ref[i].margin,
            (unsigned long long)g_seed);
        fail();
      }
      t->mismatches++;
      printf(
          "test_sampler: %s: row %d: token %d vs %d where the reference margin is %.3g "
          "(allowed)\n",
          label, (int)i, (int)g, (int)w, ref[i].margin);
    }
    if (r->num_top >= 0)
      check_lp(label, "logprob", i, got->logprobs[i], ref[i].x[g] - ref[i].lse,
               fabs(ref[i].x[g]) + fabs(ref[i].lse));
    else if (got->logprobs[i] != 0.0f)
      fail_msg("%s: row %d: logprob of a num_top -1 row", label, (int)i);
    if (r->num_top > 0)
      check_top(label, i, r->num_top, got->top_ids + i * MAX_TOP, got->top_logprobs + i * MAX_TOP,
                &ref[i]);
  }
  for (int32_t j = 0; j < b->nc; j++) {
    const ref_row_t *rr = &ref[b->ns + j];
    check_lp(label, "score logprob", j, got->score_logprobs[j], rr->x[rr->token] - rr->lse,
             fabs(rr->x[rr->token]) + fabs(rr->lse));
    check_top(label, j, b->scores[j].num_top, got->score_top_ids + j * MAX_TOP,
              got->score_top_logprobs + j * MAX_TOP, rr);
  }
}

/* ---- samplers and device logits ----------------------------------------------------------- */

typedef struct samplers {
  kiln_sampler_t *host, *dev, *forced, *old;
} samplers_t;

/* The cpu backend's table without ABI 1.3's mask_logits: masks go through penalize's biases. */
static kiln_hal_backend_t g_old_be;

static void samplers_make(samplers_t *s, int32_t V) {
  die_status(kiln_sampler_create(NULL, NULL, NULL, false, MAX_ROWS, MAX_TOP, V, &s->host),
             "create (host)");
  die_status(kiln_sampler_create(g_be, g_dev, g_stream, false, MAX_ROWS, MAX_TOP, V, &s->dev),
             "create (device)");
  die_status(kiln_sampler_create(g_be, g_dev, g_stream, true, MAX_ROWS, MAX_TOP, V, &s->forced),
             "create (force_host)");
  g_old_be = *g_be;
  g_old_be.mask_logits = NULL;
  die_status(kiln_sampler_create(&g_old_be, g_dev, g_stream, false, MAX_ROWS, MAX_TOP, V, &s->old),
             "create (device, no mask_logits)");
  assert_non_null(g_be->mask_logits);
  assert_false(kiln_sampler_on_device(s->host));
  assert_true(kiln_sampler_on_device(s->dev)); /* the CPU backend has DEVICE_SAMPLING */
  assert_false(kiln_sampler_on_device(s->forced));
}

static void samplers_free(samplers_t *s) {
  kiln_sampler_free(s->host);
  kiln_sampler_free(s->dev);
  kiln_sampler_free(s->forced);
  kiln_sampler_free(s->old);
}

/* The batch's logits in a backend buffer, rows `pad` floats apart beyond V. */
static kiln_hal_tensor_t upload(const batch_t *b, int32_t pad, kiln_hal_buffer_t **out_buf) {
  const int64_t ld = b->V + pad;
  const uint64_t off = 64; /* a view that does not start the buffer */
  uint64_t bytes = off + sizeof(float) * (uint64_t)b->R * (uint64_t)ld;
  die_hal(g_be->buffer_alloc(g_dev, bytes, 0, out_buf), "buffer_alloc");
  float *stage = calloc((size_t)b->R * (size_t)ld, sizeof(float));
  assert_non_null(stage);
  for (int32_t r = 0; r < b->R; r++)
    memcpy(stage + r * ld, b->logits + (int64_t)r * b->V, sizeof(float) * (size_t)b->V);
  die_hal(g_be->copy_h2d(g_stream, *out_buf, off, stage, bytes - off), "copy_h2d");
  die_hal(g_be->stream_sync(g_stream), "stream_sync");
  free(stage);
  int64_t shape[2] = {b->R, b->V};
  kiln_hal_tensor_t t = kiln_hal_tensor_make(*out_buf, off, KILN_HAL_F32, 2, shape);
  t.stride[0] = ld;
  return t;
}

static void run(kiln_sampler_t *s, const kiln_sample_logits_t *lg, const batch_t *b, results_t *res,
                const char *what) {
  kiln_sample_out_t o = out_of(res);
  die_status(kiln_sampler_run(s, lg, b->rows, b->ns, b->scores, b->nc, &o), what);
}

/* ---- tests -------------------------------------------------------------------------------- */

static void test_random_batches(void **state) {
  (void)state;
  static const struct {
    int32_t V, batches, R, ns, nc;
  } plan[] = {{7, 30, 3, 10, 3}, {1000, 12, 4, 14, 4}, {32000, 2, 4, 8, 3}};
  tally_t th = {0}, td = {0}, tf = {0};
  uint64_t gen = rng_u64();
  for (size_t pi = 0; pi < ARRAY_LEN(plan); pi++) {
    samplers_t sm;
    samplers_make(&sm, plan[pi].V);
    for (int32_t bi = 0; bi < plan[pi].batches; bi++) {
      batch_t b;
      batch_make(&b, plan[pi].V, 1 + rng_int(plan[pi].R), 1 + rng_int(plan[pi].ns),
                 rng_int(plan[pi].nc + 1), &gen);
      ref_row_t ref[2 * MAX_ROWS];
      memset(ref, 0, sizeof(ref));
      for (int32_t i = 0; i < b.ns; i++) ref_sample_row(&b, &b.rows[i], &ref[i]);
      for (int32_t j = 0; j < b.nc; j++) ref_score_row(&b, &b.scores[j], &ref[b.ns + j]);

      results_t rh, rd, rf;
      kiln_sample_logits_t lh = {{0}, b.logits, b.R};
      run(sm.host, &lh, &b, &rh, "run (host)");
      char label[64];
      snprintf(label, sizeof(label), "host V=%d batch %d", (int)b.V, (int)bi);
      check_results(label, &b, &rh, ref, NULL, HOST_MARGIN, &th);

      kiln_hal_buffer_t *buf = NULL;
      kiln_sample_logits_t ld = {upload(&b, bi % 2 ? 3 : 0, &buf), NULL, b.R};
      run(sm.dev, &ld, &b, &rd, "run (device)");
      snprintf(label, sizeof(label), "device V=%d batch %d", (int)b.V, (int)bi);
      check_results(label, &b, &rd, ref, rh.tokens, DEVICE_MARGIN, &td);
      results_t ro;
      run(sm.old, &ld, &b, &ro, "run (device, masks as biases)");
      snprintf(label, sizeof(label), "device without mask_logits V=%d batch %d", (int)b.V, (int)bi);
      check_results(label, &b, &ro, ref, rh.tokens, DEVICE_MARGIN, &td);
      run(sm.forced, &ld, &b, &rf, "run (force_host)");
      snprintf(label, sizeof(label), "force_host V=%d batch %d", (int)b.V, (int)bi);
      check_results(label, &b, &rf, ref, rh.tokens, HOST_MARGIN, &tf);
      /* The same host code on the same floats: identical to the last bit. */
      assert_memory_equal(rf.tokens, rh.tokens, sizeof(int32_t) * (size_t)b.ns);
      assert_memory_equal(rf.logprobs, rh.logprobs, sizeof(float) * (size_t)b.ns);
      g_be->buffer_free(buf);
      for (int32_t i = 0; i < b.ns + b.nc; i++) free(ref[i].x);
      batch_free(&b);
    }
    samplers_free(&sm);
  }
  const tally_t *ts[3] = {&th, &td, &tf};
  const char *names[3] = {"host vs reference", "device vs host", "force_host vs host"};
  for (int i = 0; i < 3; i++) {
    printf(
        "test_sampler: %s: %d rows (%d sampled), %d checked exactly, %d near a threshold, "
        "%d allowed mismatches\n",
        names[i], ts[i]->rows, ts[i]->sampled, ts[i]->exact, ts[i]->loose, ts[i]->mismatches);
    /* A test that checks nothing exactly proves nothing. */
    assert_true(ts[i]->exact * 10 >= ts[i]->rows * 7);
  }
}

/* Many single-filter and mixed rows over flat and peaked rows, so the selection paths (deep
 * quickselects, min_p thresholds, ties) are exercised far more often than in mixed batches. */
static void test_filters(void **state) {
  (void)state;
  static const int32_t vocab[] = {300, 4000};
  tally_t th = {0}, td = {0};
  uint64_t gen = rng_u64();
  for (size_t vi = 0; vi < ARRAY_LEN(vocab); vi++) {
    const int32_t V = vocab[vi];
    samplers_t sm;
    samplers_make(&sm, V);
    for (int32_t bi = 0; bi < (V > 1000 ? 2 : 12); bi++) {
      batch_t b;
      batch_make(&b, V, 4, MAX_ROWS, 0, &gen);
      const bool extreme = bi % 3 == 1, flat = bi % 3 == 2;
      for (int32_t r = 0; r < b.R; r++) {
        float *x = b.logits + (int64_t)r * V;
        if (flat) { /* nearly uniform: top_p cuts deep inside a few mass buckets */
          double scale = 0.002 * (1 + r);
          for (int32_t v = 0; v < V; v++) x[v] = (float)(x[v] * scale);
        } else if (!extreme) { /* flatter rows: hundreds of candidates */
          double scale = r == 0 ? 0.005 : r == 1 ? 0.5 : 1.0;
          for (int32_t v = 0; v < V; v++) x[v] = (float)(x[v] * scale);
        } else { /* many exact ties (quantized), or a spread where most masses underflow */
          for (int32_t v = 0; v < V; v++)
            x[v] = r < 2 ? (float)(0.5 * floor(x[v] * (r == 0 ? 0.5 : 2.0)))
                         : (float)(x[v] * (r == 2 ? 40.0 : 300.0));
        }
      }
      for (int32_t i = 0; i < b.ns; i++) {
        kiln_sample_row_t *r = &b.rows[i];
        if (!extreme) {
          r->temperature = (float)(0.5 + rng_uniform());
          r->top_k = i % 4 == 0 ? 1 + rng_int(V) : 0;
          r->top_p = i % 2 == 0 ? (float)(0.05 + 0.9 * rng_uniform()) : 1.0f;
          r->min_p = i % 3 == 0 ? (float)(0.3 * rng_uniform()) : 0.0f;
          if (i % 4 == 2) r->logits_row = 0; /* top_p over the flat row: deep quickselects */
          if (flat) {
            r->top_p = (float)(0.02 + 0.96 * rng_uniform());
            r->top_k = i % 3 == 0 ? 1 + rng_int(V) : 0;
          }
        } else {
          static const double temps[] = {0.01, 0.3, 1.0, 5.0, 100.0};
          static const double topps[] = {-0.5, 0.0, 1e-6, 0.5, 0.9999, 1.0, 1.0};
          static const double minps[] = {0.0, 0.0, 1e-12, 0.5, 1.0, 1.5};
          int32_t ks[] = {0, 0, 1, V - 1, V, V / 2, 3};
          r->temperature = (float)pick(temps, ARRAY_LEN(temps));
          r->top_k = ks[rng_int((int32_t)ARRAY_LEN(ks))];
          r->top_p = (float)pick(topps, ARRAY_LEN(topps));
          r->min_p = (float)pick(minps, ARRAY_LEN(minps));
          /* Penalties on the quantized rows' grid, where f32 and f64 arithmetic are both
           * exact: off the grid an f32 penalty can round onto a tie that f64 misses (hal.h
           * allows either), and the tie-break by index then differs legitimately. */
          static const double reps[] = {1.0, 2.0, 0.5};
          static const double pens[] = {0.0, 0.5, -0.5, 1.0};
          r->repetition = (float)pick(reps, ARRAY_LEN(reps));
          r->frequency = (float)pick(pens, ARRAY_LEN(pens));
          r->presence = (float)pick(pens, ARRAY_LEN(pens));
          float *bv = b.bvals + (r->bias_values - b.bvals); /* the batch's own storage */
          for (int32_t q = 0; q < r->num_bias; q++)
            if (isfinite(bv[q])) bv[q] = (float)(0.5 * rng_int(9) - 2.0);
        }
      }
      ref_row_t ref[MAX_ROWS];
      memset(ref, 0, sizeof(ref));
      for (int32_t i = 0; i < b.ns; i++) ref_sample_row(&b, &b.rows[i], &ref[i]);
      results_t rh, rd;
      kiln_sample_logits_t lh = {{0}, b.logits, b.R};
      run(sm.host, &lh, &b, &rh, "run (host)");
      check_results("filters host", &b, &rh, ref, NULL, HOST_MARGIN, &th);
      kiln_hal_buffer_t *buf = NULL;
      kiln_sample_logits_t ld = {upload(&b, 0, &buf), NULL, b.R};
      run(sm.dev, &ld, &b, &rd, "run (device)");
      check_results("filters device", &b, &rd, ref, rh.tokens, DEVICE_MARGIN, &td);
      g_be->buffer_free(buf);
      for (int32_t i = 0; i < b.ns; i++) free(ref[i].x);
      batch_free(&b);
    }
    samplers_free(&sm);
  }
  printf(
      "test_sampler: filters: host %d rows, %d exact, %d allowed mismatches; device %d exact, "
      "%d allowed mismatches\n",
      th.rows, th.exact, th.mismatches, td.exact, td.mismatches);
  assert_true(th.exact * 10 >= th.rows * 7);
  assert_true(td.exact * 10 >= td.rows * 5);
}

/* The same row with the same uniform gives the same token, logprob and top-N whatever else is
 * in the batch and in whatever order; penalties of one row never reach another that reads
 * the same logits row. */
static void test_reproducible(void **state) {
  (void)state;
  const int32_t V = 1000;
  uint64_t gen = rng_u64();
  samplers_t sm;
  samplers_make(&sm, V);
  batch_t a;
  batch_make(&a, V, 3, 8, 3, &gen);
  /* b: a's logits rows at other positions among new rows; a's rows shuffled among new ones. */
  batch_t b;
  batch_make(&b, V, 7, 20, 8, &gen);
  const int32_t map[3] = {5, 1, 3}; /* a's logits row r lives at b's row map[r] */
  for (int32_t r = 0; r < 3; r++)
    memcpy(b.logits + (int64_t)map[r] * V, a.logits + (int64_t)r * V, sizeof(float) * V);
  int32_t pos[8], spos[3];
  for (int32_t i = 0; i < 8; i++) pos[i] = 19 - 2 * i; /* reversed, interleaved */
  for (int32_t j = 0; j < 3; j++) spos[j] = 7 - 3 * j;
  for (int32_t i = 0; i < 8; i++) {
    b.rows[pos[i]] = a.rows[i];
    b.rows[pos[i]].logits_row = map[a.rows[i].logits_row];
  }
  for (int32_t j = 0; j < 3; j++) {
    b.scores[spos[j]] = a.scores[j];
    b.scores[spos[j]].logits_row = map[a.scores[j].logits_row];
  }
  kiln_sampler_t *which[2] = {sm.host, sm.dev};
  for (int w = 0; w < 2; w++) {
    results_t ra, rb;
    kiln_hal_buffer_t *ba = NULL, *bb = NULL;
    kiln_sample_logits_t la = {{0}, a.logits, a.R}, lb = {{0}, b.logits, b.R};
    if (w == 1) {
      la.tensor = upload(&a, 0, &ba);
      lb.tensor = upload(&b, 1, &bb);
      la.host = lb.host = NULL;
    }
    run(which[w], &la, &a, &ra, "run (a)");
    run(which[w], &lb, &b, &rb, "run (b)");
    for (int32_t i = 0; i < 8; i++) {
      int32_t k = pos[i];
      assert_int_equal(ra.tokens[i], rb.tokens[k]);
      assert_true(ra.logprobs[i] == rb.logprobs[k]);
      for (int32_t q = 0; q < a.rows[i].num_top; q++) {
        assert_int_equal(ra.top_ids[i * MAX_TOP + q], rb.top_ids[k * MAX_TOP + q]);
        assert_true(ra.top_logprobs[i * MAX_TOP + q] == rb.top_logprobs[k * MAX_TOP + q]);
      }
    }
    for (int32_t j = 0; j < 3; j++) {
      int32_t k = spos[j];
      assert_true(ra.score_logprobs[j] == rb.score_logprobs[k]);
      for (int32_t q = 0; q < a.scores[j].num_top; q++)
        assert_int_equal(ra.score_top_ids[j * MAX_TOP + q], rb.score_top_ids[k * MAX_TOP + q]);
    }
    if (ba) g_be->buffer_free(ba);
    if (bb) g_be->buffer_free(bb);
  }

  /* No leaks between rows sharing a logits row: row 0 bans the argmax, row 1 is plain greedy,
   * row 2 bans it again. */
  batch_t c;
  batch_make(&c, V, 1, 3, 0, &gen);
  int32_t amax = 0;
  for (int32_t v = 1; v < V; v++)
    if (c.logits[v] > c.logits[amax]) amax = v;
  static int32_t ban_id[1];
  static float ban_val[1] = {-INFINITY};
  ban_id[0] = amax;
  for (int32_t i = 0; i < 3; i++) {
    kiln_sample_row_t *r = &c.rows[i];
    memset(r, 0, sizeof(*r));
    r->top_p = 1.0f;
    r->repetition = 1.0f;
    r->num_top = 0;
    if (i != 1) {
      r->bias_ids = ban_id;
      r->bias_values = ban_val;
      r->num_bias = 1;
    }
  }
  for (int w = 0; w < 2; w++) {
    results_t rc;
    kiln_hal_buffer_t *bc = NULL;
    kiln_sample_logits_t lc = {{0}, c.logits, 1};
    if (w == 1) {
      lc.tensor = upload(&c, 0, &bc);
      lc.host = NULL;
    }
    run(which[w], &lc, &c, &rc, "run (leak)");
    assert_int_not_equal(rc.tokens[0], amax);
    assert_int_equal(rc.tokens[1], amax);
    assert_int_not_equal(rc.tokens[2], amax);
    if (bc) g_be->buffer_free(bc);
  }
  batch_free(&a);
  batch_free(&b);
  batch_free(&c);
  samplers_free(&sm);
}

/* Penalty lists longer than the device staging's first capacity (it grows), repeated rows. */
static void test_long_lists(void **state) {
  (void)state;
  const int32_t V = 1000, N = 30000;
  uint64_t gen = rng_u64();
  samplers_t sm;
  samplers_make(&sm, V);
  batch_t b;
  batch_make(&b, V, 2, 4, 1, &gen);
  int32_t *prompt = malloc(sizeof(int32_t) * N), *output = malloc(sizeof(int32_t) * N);
  assert_non_null(prompt);
  assert_non_null(output);
  for (int32_t i = 0; i < N; i++) {
    prompt[i] = rng_int(V + 10) - 5;
    output[i] = rng_int(V / 4);
  }
  for (int32_t i = 0; i < b.ns; i++) {
    kiln_sample_row_t *r = &b.rows[i];
    r->logits_row = i % 2;
    r->prompt_ids = prompt + i * 100; /* overlapping windows */
    r->num_prompt = N - i * 100;
    r->output_ids = output;
    r->num_output = N / (i + 1);
    r->repetition = 1.2f;
    r->frequency = i % 2 ? 0.01f : 0.0f;
    r->presence = 0.3f;
  }
  ref_row_t ref[MAX_ROWS];
  memset(ref, 0, sizeof(ref));
  for (int32_t i = 0; i < b.ns; i++) ref_sample_row(&b, &b.rows[i], &ref[i]);
  for (int32_t j = 0; j < b.nc; j++) ref_score_row(&b, &b.scores[j], &ref[b.ns + j]);
  tally_t t = {0};
  results_t rh, rd;
  kiln_sample_logits_t lh = {{0}, b.logits, b.R};
  run(sm.host, &lh, &b, &rh, "run (host)");
  check_results("long lists host", &b, &rh, ref, NULL, HOST_MARGIN, &t);
  kiln_hal_buffer_t *buf = NULL;
  kiln_sample_logits_t ld = {upload(&b, 0, &buf), NULL, b.R};
  for (int rep = 0; rep < 2; rep++) { /* the grown staging is reused */
    run(sm.dev, &ld, &b, &rd, "run (device)");
    check_results("long lists device", &b, &rd, ref, rh.tokens, DEVICE_MARGIN, &t);
  }
  g_be->buffer_free(buf);
  for (int32_t i = 0; i < b.ns + b.nc; i++) free(ref[i].x);
  free(prompt);
  free(output);
  batch_free(&b);
  samplers_free(&sm);
}

/* Rows holding NaN, or nothing but -inf, still give ids inside the vocabulary. */
static void test_degenerate_rows(void **state) {
  (void)state;
  const int32_t V = 50;
  uint64_t gen = rng_u64();
  samplers_t sm;
  samplers_make(&sm, V);
  batch_t b;
  batch_make(&b, V, 3, 12, 2, &gen);
  for (int32_t v = 0; v < V; v++) {
    b.logits[v] = v % 3 == 0 ? NAN : b.logits[v]; /* some NaN */
    b.logits[V + v] = NAN;                        /* all NaN */
    b.logits[2 * V + v] = -INFINITY;              /* all banned */
  }
  kiln_sampler_t *which[3] = {sm.host, sm.dev, sm.forced};
  for (int w = 0; w < 3; w++) {
    results_t r;
    kiln_hal_buffer_t *buf = NULL;
    kiln_sample_logits_t lg = {{0}, b.logits, b.R};
    if (w > 0) {
      lg.tensor = upload(&b, 0, &buf);
      lg.host = NULL;
    }
    run(which[w], &lg, &b, &r, "run (degenerate)");
    for (int32_t i = 0; i < b.ns; i++) {
      assert_true(r.tokens[i] >= 0);
      assert_true(r.tokens[i] < V);
    }
    if (buf) g_be->buffer_free(buf);
  }
  batch_free(&b);
  samplers_free(&sm);
}

static void expect_invalid(kiln_status_t st, const char *needle) {
  assert_non_null(st);
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  if (!strstr(kiln_status_message(st), needle)) {
    print_error("message \"%s\" does not name \"%s\"\n", kiln_status_message(st), needle);
    kiln_status_free(st);
    fail();
  }
  kiln_status_free(st);
}

static void test_errors(void **state) {
  (void)state;
  const int32_t V = 100;
  uint64_t gen = rng_u64();
  samplers_t sm;
  samplers_make(&sm, V);
  batch_t b;
  batch_make(&b, V, 2, 3, 2, &gen);
  kiln_hal_buffer_t *buf = NULL;
  kiln_sample_logits_t lh = {{0}, b.logits, b.R}, ld = {upload(&b, 0, &buf), NULL, b.R};
  kiln_sampler_t *which[3] = {sm.host, sm.dev, sm.forced};
  const kiln_sample_logits_t *lgs[3] = {&lh, &ld, &ld};
  for (int w = 0; w < 3; w++) {
    kiln_sampler_t *s = which[w];
    const kiln_sample_logits_t *lg = lgs[w];
    results_t res;
    kiln_sample_out_t o = out_of(&res);
    b.rows[1].logits_row = 2;
    expect_invalid(kiln_sampler_run(s, lg, b.rows, 3, b.scores, 2, &o), "samples[1].logits_row");
    b.rows[1].logits_row = -1;
    expect_invalid(kiln_sampler_run(s, lg, b.rows, 3, b.scores, 2, &o), "samples[1].logits_row");
    b.rows[1].logits_row = 0;
    b.rows[2].num_top = MAX_TOP + 1;
    expect_invalid(kiln_sampler_run(s, lg, b.rows, 3, b.scores, 2, &o), "samples[2].num_top");
    b.rows[2].num_top = 0;
    b.rows[0].uniform = 1.0f;
    expect_invalid(kiln_sampler_run(s, lg, b.rows, 3, b.scores, 2, &o), "samples[0].uniform");
    b.rows[0].uniform = 0.5f;
    b.rows[0].num_prompt = 3;
    b.rows[0].prompt_ids = NULL;
    expect_invalid(kiln_sampler_run(s, lg, b.rows, 3, b.scores, 2, &o), "samples[0].prompt_ids");
    b.rows[0].num_prompt = 0;
    b.scores[1].logits_row = 7;
    expect_invalid(kiln_sampler_run(s, lg, b.rows, 3, b.scores, 2, &o), "scores[1].logits_row");
    b.scores[1].logits_row = 1;
    b.scores[0].token = V;
    expect_invalid(kiln_sampler_run(s, lg, b.rows, 3, b.scores, 2, &o), "scores[0].token");
    b.scores[0].token = 0;
    b.scores[0].num_top = MAX_TOP + 1;
    expect_invalid(kiln_sampler_run(s, lg, b.rows, 3, b.scores, 2, &o), "scores[0].num_top");
    b.scores[0].num_top = 1;
    expect_invalid(kiln_sampler_run(s, lg, b.rows, MAX_ROWS, b.scores, 1, &o), "max_rows");
    o.tokens = NULL;
    expect_invalid(kiln_sampler_run(s, lg, b.rows, 3, b.scores, 2, &o), "out->tokens");
    o = out_of(&res);
    /* After all that, a valid run still works. */
    die_status(kiln_sampler_run(s, lg, b.rows, 3, b.scores, 2, &o), "run after errors");
    die_status(kiln_sampler_run(s, lg, NULL, 0, NULL, 0, &o), "empty run");
  }
  kiln_sampler_t *bad = NULL;
  expect_invalid(kiln_sampler_create(NULL, NULL, NULL, false, 0, 1, V, &bad), "max_rows");
  assert_null(bad);
  expect_invalid(kiln_sampler_create(g_be, NULL, g_stream, false, 4, 1, V, &bad), "device");
  g_be->buffer_free(buf);
  batch_free(&b);
  samplers_free(&sm);
}

/* splitmix64 state `s` is the one whose next draw is z (the mixer is a bijection). */
static uint64_t unxorshift(uint64_t y, int sh) {
  uint64_t x = y;
  for (int i = 0; i < 64 / sh + 1; i++) x = y ^ (x >> sh);
  return x;
}
static uint64_t inv_odd(uint64_t c) {
  uint64_t x = c; /* Newton: each step doubles the correct low bits */
  for (int i = 0; i < 6; i++) x *= 2 - c * x;
  return x;
}

static void test_uniform(void **state) {
  (void)state;
  uint64_t a = 12345, b = 12345, ref = 12345;
  for (int i = 0; i < 10000; i++) {
    float u = kiln_sample_uniform(&a);
    assert_true(u >= 0.0f && u < 1.0f);
    assert_true(u == kiln_sample_uniform(&b)); /* deterministic */
    /* mc_uniform's double, rounded down to a float. */
    uint64_t z = (ref += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    double d = (double)(z >> 11) * (1.0 / 9007199254740992.0);
    assert_true((double)u <= d);
    assert_true(d - (double)u < ldexp(1.0, -24));
  }
  /* The state whose draw is the largest 53-bit value: naive rounding would give 1.0f. */
  uint64_t z = ~(uint64_t)0;
  z = unxorshift(z, 31) * inv_odd(0x94d049bb133111ebull);
  z = unxorshift(z, 27) * inv_odd(0xbf58476d1ce4e5b9ull);
  z = unxorshift(z, 30);
  uint64_t st = z - 0x9e3779b97f4a7c15ull;
  float u = kiln_sample_uniform(&st);
  assert_true(st == z);
  assert_true(u < 1.0f);
  assert_true(u == nextafterf(1.0f, 0.0f));
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_uniform),    cmocka_unit_test(test_random_batches),
      cmocka_unit_test(test_filters),    cmocka_unit_test(test_reproducible),
      cmocka_unit_test(test_long_lists), cmocka_unit_test(test_degenerate_rows),
      cmocka_unit_test(test_errors),
  };
  return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
