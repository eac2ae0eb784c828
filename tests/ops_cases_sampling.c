/* ops_cases_sampling.c - conformance cases for the sampling support ops on F32 logits: argmax,
 * topk, penalize and sample (exact token match with the reference rule). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "ops_cases.h"
#include "ops_harness.h"
#include "hal/ref/ops_ref.h"

#define ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

/* An [S, V] F32 logits view with `pad` extra elements per row in a fresh buffer. */
static kiln_hal_tensor_t logits_view(oh_buf_t **out_buf, const oh_backend_t *be, int64_t S,
                                     int64_t V, int64_t pad) {
  *out_buf = oh_buf_new(be, (size_t)(S * (V + pad) + 3) * 4);
  int64_t shape[2] = {S, V}, stride[2] = {V + pad, 1};
  return oh_view(*out_buf, 0, KILN_HAL_F32, 2, shape, stride);
}

static kiln_hal_tensor_t vec_view(oh_buf_t **out_buf, const oh_backend_t *be, int32_t dt,
                                  int64_t n) {
  *out_buf = oh_buf_new(be, (size_t)(n + 2) * kiln_hal_dtype_size(dt));
  int64_t shape[1] = {n};
  return oh_view(*out_buf, 0, dt, 1, shape, NULL);
}

/* Random logits, with ties planted at the row maximum (and, for every third row, -inf
 * entries), rounded to f32. */
static void make_logits(double *row, int64_t V, double spread, bool ties, bool neg_inf) {
  oh_rand_fill(row, V, -spread, spread);
  if (neg_inf && V > 4) {
    for (int k = 0; k < 3; k++) row[oh_rand_int(0, V - 1)] = -INFINITY;
  }
  if (ties && V > 1) {
    int64_t i = oh_rand_int(0, V - 2), j = oh_rand_int(i + 1, V - 1);
    row[i] = row[j] = spread + 1.0;
  }
  for (int64_t v = 0; v < V; v++) row[v] = (double)(float)row[v];
}

/* ================================================================================ argmax == */

static void argmax_run(const oh_backend_t *be, int64_t S, int64_t V, int64_t pad, bool lp) {
  oh_case(be, "argmax", KILN_HAL_F32, "S=%lld V=%lld row_pad=%lld logprob=%d", (long long)S,
          (long long)V, (long long)pad, lp);
  oh_buf_t *lb, *ib, *pb;
  kiln_hal_argmax_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.logits = logits_view(&lb, be, S, V, pad);
  a.out_ids = vec_view(&ib, be, KILN_HAL_I32, S);
  kiln_hal_tensor_t lpv = vec_view(&pb, be, KILN_HAL_F32, S);
  a.out_logprob = lp ? lpv : oh_absent();
  double *lg = OH_NEW(double, S *V), *want_lp = OH_NEW(double, S), *got_lp = OH_NEW(double, S);
  int32_t *want = OH_NEW(int32_t, S), *got = OH_NEW(int32_t, S);
  for (int64_t s = 0; s < S; s++) {
    if (s % 4 == 2) { /* a constant row: every entry ties */
      double c = oh_rand_uniform(-2, 2);
      for (int64_t v = 0; v < V; v++) lg[s * V + v] = c;
    } else {
      make_logits(lg + s * V, V, 5.0, s % 2 == 0, s % 3 == 1);
    }
  }
  oh_write(lb, &a.logits, lg);
  oh_push(lb);
  if (oh_ok(be->t->argmax(be->stream, &a), "argmax") && oh_pull(ib) && oh_pull(pb) && oh_pull(lb)) {
    for (int64_t s = 0; s < S; s++) want[s] = ops_ref_argmax(V, lg + s * V, &want_lp[s]);
    oh_mark(ib, &a.out_ids);
    oh_read_i32(ib, &a.out_ids, got);
    oh_compare_i32("out_ids", S, got, want);
    oh_check_rest(ib, "out_ids (tail)");
    if (lp) {
      oh_mark(pb, &lpv);
      oh_read(pb, &lpv, got_lp);
      oh_compare("out_logprob", S, got_lp, want_lp, NULL, oh_tol_logprob());
    }
    oh_check_rest(pb,
                  lp ? "out_logprob (tail)" : "out_logprob buffer (absent: must not be written)");
    oh_check_rest(lb, "logits (an input)");
  }
  free(lg);
  free(want_lp);
  free(got_lp);
  free(want);
  free(got);
  oh_free_all();
}

void test_ops_argmax(void **state) {
  (void)state;
  static const int64_t cases[][3] = {
      {1, 1, 0}, {3, 17, 0}, {8, 1000, 0}, {2, 32000, 0}, {5, 129, 7}};
  oh_test_begin("argmax");
  for (int bi = 0; bi < oh_num_backends; bi++) {
    for (size_t ci = 0; ci < ARRAY_LEN(cases); ci++) {
      for (int lp = 0; lp < 2; lp++)
        argmax_run(&oh_backends[bi], cases[ci][0], cases[ci][1], cases[ci][2], lp);
    }
  }
  oh_test_end();
}

/* ================================================================================== topk == */

static void topk_run(const oh_backend_t *be, int64_t S, int64_t V, int64_t k, int64_t pad,
                     bool lse) {
  oh_case(be, "topk", KILN_HAL_F32, "S=%lld V=%lld k=%lld row_pad=%lld lse=%d", (long long)S,
          (long long)V, (long long)k, (long long)pad, lse);
  oh_buf_t *lb, *lsb;
  kiln_hal_topk_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.logits = logits_view(&lb, be, S, V, pad);
  oh_buf_t *vb = oh_buf_new(be, (size_t)(S * (k + 1) + 2) * 4);
  oh_buf_t *ib = oh_buf_new(be, (size_t)(S * (k + 2) + 2) * 4);
  int64_t oshape[2] = {S, k}, vstride[2] = {k + 1, 1}, istride[2] = {k + 2, 1};
  a.out_values = oh_view(vb, 0, KILN_HAL_F32, 2, oshape, vstride);
  a.out_ids = oh_view(ib, 0, KILN_HAL_I32, 2, oshape, istride);
  kiln_hal_tensor_t lsev = vec_view(&lsb, be, KILN_HAL_F32, S);
  a.out_lse = lse ? lsev : oh_absent();
  double *lg = OH_NEW(double, S *V), *want_v = OH_NEW(double, S *k), *got_v = OH_NEW(double, S *k);
  double *want_lse = OH_NEW(double, S), *got_lse = OH_NEW(double, S);
  int32_t *want_i = OH_NEW(int32_t, S * k), *got_i = OH_NEW(int32_t, S * k);
  for (int64_t s = 0; s < S; s++) {
    if (s % 2 == 0) { /* values on a grid of 0.25: many ties, also across the k-th place */
      for (int64_t v = 0; v < V; v++) lg[s * V + v] = 0.25 * (double)oh_rand_int(-16, 16);
    } else {
      make_logits(lg + s * V, V, 4.0, true, s % 3 == 1);
    }
  }
  oh_write(lb, &a.logits, lg);
  oh_push(lb);
  if (oh_ok(be->t->topk(be->stream, &a), "topk") && oh_pull(vb) && oh_pull(ib) && oh_pull(lsb)) {
    for (int64_t s = 0; s < S; s++) {
      ops_ref_topk(V, lg + s * V, k, want_i + s * k, want_v + s * k);
      want_lse[s] = ops_ref_logsumexp(V, lg + s * V);
    }
    oh_mark(vb, &a.out_values);
    oh_read(vb, &a.out_values, got_v);
    oh_mark(ib, &a.out_ids);
    oh_read_i32(ib, &a.out_ids, got_i);
    oh_compare("out_values", S * k, got_v, want_v, NULL, (oh_tol_t){0, 0, 0});
    oh_compare_i32("out_ids", S * k, got_i, want_i);
    oh_check_rest(vb, "out_values (row padding)");
    oh_check_rest(ib, "out_ids (row padding)");
    if (lse) {
      oh_mark(lsb, &lsev);
      oh_read(lsb, &lsev, got_lse);
      oh_compare("out_lse", S, got_lse, want_lse, NULL, oh_tol_logprob());
    }
    oh_check_rest(lsb, lse ? "out_lse (tail)" : "out_lse buffer (absent: must not be written)");
  }
  free(lg);
  free(want_v);
  free(got_v);
  free(want_lse);
  free(got_lse);
  free(want_i);
  free(got_i);
  oh_free_all();
}

void test_ops_topk(void **state) {
  (void)state;
  static const int64_t cases[][4] = {{1, 1, 1, 0},     {3, 17, 5, 0},     {4, 1000, 50, 3},
                                     {2, 129, 129, 0}, {3, 32000, 40, 0}, {5, 64, 1, 1}};
  oh_test_begin("topk");
  for (int bi = 0; bi < oh_num_backends; bi++) {
    for (size_t ci = 0; ci < ARRAY_LEN(cases); ci++) {
      for (int lse = 0; lse < 2; lse++)
        topk_run(&oh_backends[bi], cases[ci][0], cases[ci][1], cases[ci][2], cases[ci][3], lse);
    }
  }
  oh_test_end();
}

/* ============================================================================== penalize == */

enum { PEN_PROMPT = 1, PEN_OUTPUT = 2, PEN_REP = 4, PEN_FREQ = 8, PEN_BIAS = 16 };

/* A flattened list of token ids for S rows: repeats, and ids outside [0, V). */
static int64_t make_token_lists(int64_t S, int64_t V, int64_t maxlen, int32_t *ids, int32_t *off) {
  int64_t n = 0;
  off[0] = 0;
  for (int64_t s = 0; s < S; s++) {
    int64_t len = s == 1 ? 0 : oh_rand_int(1, maxlen); /* row 1: an empty list */
    for (int64_t i = 0; i < len; i++) {
      int64_t r = oh_rand_int(0, 9);
      if (r == 0)
        ids[n++] =
            oh_rand_int(0, 1) ? -1 - (int32_t)oh_rand_int(0, 5) : (int32_t)(V + oh_rand_int(0, 5));
      else if (r <= 3 && i > 0)
        ids[n] = ids[n - 1 - oh_rand_int(0, i - 1)]; /* repeat an earlier token of the row */
      else
        ids[n] = (int32_t)oh_rand_int(0, V - 1);
      if (r != 0) n++;
    }
    off[s + 1] = (int32_t)n;
  }
  return n;
}

static void penalize_run(const oh_backend_t *be, int64_t S, int64_t V, int groups) {
  oh_case(be, "penalize", KILN_HAL_F32, "S=%lld V=%lld groups:%s%s%s%s%s%s", (long long)S,
          (long long)V, (groups & PEN_PROMPT) ? " prompt" : "",
          (groups & PEN_OUTPUT) ? " output" : "", (groups & PEN_REP) ? " repetition" : "",
          (groups & PEN_FREQ) ? " frequency/presence" : "", (groups & PEN_BIAS) ? " bias" : "",
          groups ? "" : " (none)");
  const int64_t maxlen = 40;
  oh_buf_t *lb;
  kiln_hal_penalize_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.logits = logits_view(&lb, be, S, V, 5);
  double *lg = OH_NEW(double, S *V), *got = OH_NEW(double, S *V);
  int32_t *pids = OH_NEW(int32_t, S * maxlen + 1), *poff = OH_NEW(int32_t, S + 1);
  int32_t *oids = OH_NEW(int32_t, S * maxlen + 1), *ooff = OH_NEW(int32_t, S + 1);
  int32_t *bids = OH_NEW(int32_t, S * 8 + 1), *boff = OH_NEW(int32_t, S + 1);
  double *bval = OH_NEW(double, S * 8 + 1), *rep = OH_NEW(double, S), *freq = OH_NEW(double, S),
         *pres = OH_NEW(double, S);
  for (int64_t s = 0; s < S * V; s++) lg[s] = oh_rand_uniform(-5, 5);
  int64_t np = make_token_lists(S, V, maxlen, pids, poff);
  int64_t no = make_token_lists(S, V, maxlen, oids, ooff);
  /* Bias: distinct ids per row (plus out-of-range ones), row 2 has none. */
  int64_t nbias = 0;
  boff[0] = 0;
  for (int64_t s = 0; s < S; s++) {
    int64_t len = s == 2 ? 0 : oh_rand_int(1, 6);
    int64_t start = oh_rand_int(0, V - 1);
    for (int64_t i = 0; i < len; i++) {
      bids[nbias] = (int32_t)((start + i * 7) % V);
      if (i == 5) bids[nbias] = (int32_t)(V + 3);
      if (i == 4) bids[nbias] = -2;
      bval[nbias++] = oh_rand_uniform(-3, 3);
    }
    boff[s + 1] = (int32_t)nbias;
  }
  for (int64_t s = 0; s < S; s++) {
    rep[s] = s == 3 ? 1.0 : oh_rand_uniform(1.0, 2.0); /* row 3: repetition off */
    freq[s] = oh_rand_uniform(0, 1.0);
    pres[s] = s == 4 ? 0.0 : oh_rand_uniform(0, 1.5);
  }
  oh_buf_t *b_pids, *b_poff, *b_oids, *b_ooff, *b_bids, *b_boff, *b_bval, *b_rep, *b_freq, *b_pres;
  kiln_hal_tensor_t pv = vec_view(&b_pids, be, KILN_HAL_I32, np > 0 ? np : 1);
  kiln_hal_tensor_t pov = vec_view(&b_poff, be, KILN_HAL_I32, S + 1);
  kiln_hal_tensor_t ov = vec_view(&b_oids, be, KILN_HAL_I32, no > 0 ? no : 1);
  kiln_hal_tensor_t oov = vec_view(&b_ooff, be, KILN_HAL_I32, S + 1);
  kiln_hal_tensor_t bv = vec_view(&b_bids, be, KILN_HAL_I32, nbias > 0 ? nbias : 1);
  kiln_hal_tensor_t bvv = vec_view(&b_bval, be, KILN_HAL_F32, nbias > 0 ? nbias : 1);
  kiln_hal_tensor_t bov = vec_view(&b_boff, be, KILN_HAL_I32, S + 1);
  kiln_hal_tensor_t rv = vec_view(&b_rep, be, KILN_HAL_F32, S);
  kiln_hal_tensor_t fv = vec_view(&b_freq, be, KILN_HAL_F32, S);
  kiln_hal_tensor_t prv = vec_view(&b_pres, be, KILN_HAL_F32, S);
  oh_write(lb, &a.logits, lg);
  if (np) oh_write_i32(b_pids, &pv, pids);
  oh_write_i32(b_poff, &pov, poff);
  if (no) oh_write_i32(b_oids, &ov, oids);
  oh_write_i32(b_ooff, &oov, ooff);
  if (nbias) {
    oh_write_i32(b_bids, &bv, bids);
    oh_write(b_bval, &bvv, bval);
  }
  oh_write_i32(b_boff, &bov, boff);
  oh_write(b_rep, &rv, rep);
  oh_write(b_freq, &fv, freq);
  oh_write(b_pres, &prv, pres);
  oh_buf_t *all[] = {lb,     b_pids, b_poff, b_oids, b_ooff, b_bids,
                     b_boff, b_bval, b_rep,  b_freq, b_pres};
  for (size_t i = 0; i < ARRAY_LEN(all); i++) oh_push(all[i]);
  if (groups & PEN_PROMPT) {
    a.prompt_ids = pv;
    a.prompt_offsets = pov;
  }
  if (groups & PEN_OUTPUT) {
    a.output_ids = ov;
    a.output_offsets = oov;
  }
  if (groups & PEN_REP) a.repetition = rv;
  if (groups & PEN_FREQ) {
    a.frequency = fv;
    a.presence = prv;
  }
  if (groups & PEN_BIAS) {
    a.bias_ids = bv;
    a.bias_values = bvv;
    a.bias_offsets = bov;
  }
  if (oh_ok(be->t->penalize(be->stream, &a), "penalize") && oh_pull(lb)) {
    for (int64_t s = 0; s < S; s++) {
      bool hp = groups & PEN_PROMPT, ho = groups & PEN_OUTPUT, hb = groups & PEN_BIAS;
      ops_ref_penalize_row(V, lg + s * V, hp ? pids + poff[s] : NULL,
                           hp ? poff[s + 1] - poff[s] : 0, ho ? oids + ooff[s] : NULL,
                           ho ? ooff[s + 1] - ooff[s] : 0, (groups & PEN_REP) != 0, rep[s],
                           (groups & PEN_FREQ) != 0, freq[s], pres[s], hb ? bids + boff[s] : NULL,
                           hb ? bval + boff[s] : NULL, hb ? boff[s + 1] - boff[s] : 0);
    }
    oh_mark(lb, &a.logits);
    oh_read(lb, &a.logits, got);
    oh_compare("logits", S * V, got, lg, NULL, (oh_tol_t){1e-5, 1e-5, 0});
    oh_check_rest(lb, "logits (row padding)");
  }
  free(lg);
  free(got);
  free(pids);
  free(poff);
  free(oids);
  free(ooff);
  free(bids);
  free(boff);
  free(bval);
  free(rep);
  free(freq);
  free(pres);
  oh_free_all();
}

void test_ops_penalize(void **state) {
  (void)state;
  static const int groups[] = {
      0,
      PEN_PROMPT | PEN_OUTPUT | PEN_REP,
      PEN_PROMPT | PEN_REP,
      PEN_OUTPUT | PEN_REP,
      PEN_OUTPUT | PEN_FREQ,
      PEN_BIAS,
      PEN_PROMPT | PEN_OUTPUT | PEN_REP | PEN_FREQ | PEN_BIAS,
      PEN_PROMPT | PEN_OUTPUT | PEN_FREQ | PEN_BIAS, /* lists present, repetition absent */
  };
  oh_test_begin("penalize");
  for (int bi = 0; bi < oh_num_backends; bi++) {
    for (size_t gi = 0; gi < ARRAY_LEN(groups); gi++) {
      penalize_run(&oh_backends[bi], 6, 100, groups[gi]);
      penalize_run(&oh_backends[bi], 5, 1000, groups[gi]);
    }
  }
  oh_test_end();
}

/* =========================================================================== mask_logits == */

/* S rows of V logits, M masks; rows_mode 0: no rows tensor (M == S), 1: rows with -1, an
 * out-of-range index and repeats. */
static void mask_run(const oh_backend_t *be, int64_t S, int64_t V, int64_t M, int rows_mode) {
  oh_case(be, "mask_logits", KILN_HAL_F32, "S=%lld V=%lld M=%lld%s", (long long)S, (long long)V,
          (long long)M, rows_mode ? " rows" : "");
  if (!be->t->mask_logits) {
    oh_fail("mask_logits: the backend lacks the ABI 1.3 op");
    return;
  }
  const int64_t W = (V + 31) / 32 + 1; /* one spare word: bits beyond V are ignored */
  oh_buf_t *lb, *mb, *rb = NULL;
  kiln_hal_mask_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.logits = logits_view(&lb, be, S, V, 3);
  mb = oh_buf_new(be, (size_t)(M * W + 2) * 4);
  int64_t mshape[2] = {M, W};
  a.mask = oh_view(mb, 0, KILN_HAL_I32, 2, mshape, NULL);
  double *lg = OH_NEW(double, S *V), *got = OH_NEW(double, S *V);
  int32_t *mask = OH_NEW(int32_t, M * W), *rows = OH_NEW(int32_t, S);
  for (int64_t i = 0; i < S * V; i++) lg[i] = oh_rand_uniform(-5, 5);
  for (int64_t r = 0; r < M; r++)
    for (int64_t w = 0; w < W; w++) {
      /* all-allowed, all-banned and random words */
      int64_t k = oh_rand_int(0, 5);
      uint32_t bits = k == 0 ? 0xFFFFFFFFu
                      : k == 1
                          ? 0u
                          : (uint32_t)oh_rand_int(0, 0x7FFFFFFF) * 2u + (uint32_t)oh_rand_int(0, 1);
      memcpy(&mask[r * W + w], &bits, 4);
    }
  for (int64_t s = 0; s < S; s++)
    rows[s] = s == 1 ? -1 : s == 2 ? (int32_t)(M + 4) : (int32_t)oh_rand_int(0, M - 1);
  oh_write(lb, &a.logits, lg);
  oh_write_i32(mb, &a.mask, mask);
  if (rows_mode) {
    a.rows = vec_view(&rb, be, KILN_HAL_I32, S);
    oh_write_i32(rb, &a.rows, rows);
    oh_push(rb);
  }
  oh_push(lb);
  oh_push(mb);
  if (oh_ok(be->t->mask_logits(be->stream, &a), "mask_logits") && oh_pull(lb)) {
    for (int64_t s = 0; s < S; s++) {
      int64_t r = rows_mode ? rows[s] : s;
      if (r < 0 || r >= M) continue;
      for (int64_t v = 0; v < V; v++) {
        uint32_t bits;
        memcpy(&bits, &mask[r * W + v / 32], 4);
        if (!((bits >> (v % 32)) & 1)) lg[s * V + v] = -INFINITY;
      }
    }
    oh_mark(lb, &a.logits);
    oh_read(lb, &a.logits, got);
    oh_compare("logits", S * V, got, lg, NULL, (oh_tol_t){0, 0, 0});
    oh_check_rest(lb, "logits (row padding)");
  }
  /* a mask too narrow for V is refused */
  int64_t narrow[2] = {M, (V + 31) / 32 - 1};
  if (narrow[1] >= 0 && V > 32) {
    kiln_hal_mask_args_t b = a;
    b.mask = oh_view(mb, 0, KILN_HAL_I32, 2, narrow, NULL);
    oh_expect_error(be->t->mask_logits(be->stream, &b), "mask_logits with a narrow mask");
  }
  free(lg);
  free(got);
  free(mask);
  free(rows);
  oh_free_all();
}

void test_ops_mask_logits(void **state) {
  (void)state;
  oh_test_begin("mask_logits");
  for (int bi = 0; bi < oh_num_backends; bi++) {
    mask_run(&oh_backends[bi], 1, 1, 1, 0);
    mask_run(&oh_backends[bi], 3, 33, 3, 0);
    mask_run(&oh_backends[bi], 5, 1000, 2, 1);
    mask_run(&oh_backends[bi], 4, 151936, 3, 1);
  }
  oh_test_end();
}

/* ================================================================================ sample == */

typedef struct sample_row {
  float temperature;
  int32_t top_k; /* -1: V + 5 */
  float top_p, min_p;
} sample_row_t;

static const sample_row_t sample_rows[] = {
    {0.0f, 0, 1.0f, 0.0f},  {0.7f, 1, 1.0f, 0.0f},  {1.0f, 0, 1.0f, 0.0f},   {0.8f, 20, 1.0f, 0.0f},
    {1.2f, 0, 0.9f, 0.0f},  {1.0f, 0, 1.0f, 0.1f},  {0.9f, 50, 0.8f, 0.05f}, {1.5f, 0, 0.5f, 0.0f},
    {1.0f, -1, 1.0f, 0.0f}, {1.0f, 0, 0.01f, 0.0f}, {-1.0f, 5, 0.5f, 0.2f},  {0.5f, 3, 1.0f, 0.3f},
};

/* Decisions closer than this to their thresholds are re-drawn: an f32 softmax and CDF err by
 * ~1e-6, so a closer call could legitimately go either way. */
#define SAMPLE_MIN_MARGIN 1e-4

static void sample_run(const oh_backend_t *be, int64_t V, bool lp, int trial) {
  const int64_t S = (int64_t)ARRAY_LEN(sample_rows);
  oh_case(be, "sample", KILN_HAL_F32, "V=%lld logprob=%d trial %d", (long long)V, lp, trial);
  oh_buf_t *lb, *tb, *kb, *pb, *mb, *ub, *ib, *opb;
  kiln_hal_sample_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.logits = logits_view(&lb, be, S, V, trial % 2 ? 3 : 0);
  a.temperature = vec_view(&tb, be, KILN_HAL_F32, S);
  a.top_k = vec_view(&kb, be, KILN_HAL_I32, S);
  a.top_p = vec_view(&pb, be, KILN_HAL_F32, S);
  a.min_p = vec_view(&mb, be, KILN_HAL_F32, S);
  a.uniform = vec_view(&ub, be, KILN_HAL_F32, S);
  a.out_ids = vec_view(&ib, be, KILN_HAL_I32, S);
  kiln_hal_tensor_t lpv = vec_view(&opb, be, KILN_HAL_F32, S);
  a.out_logprob = lp ? lpv : oh_absent();
  double *lg = OH_NEW(double, S *V), *temp = OH_NEW(double, S), *topp = OH_NEW(double, S),
         *minp = OH_NEW(double, S), *uni = OH_NEW(double, S), *want_lp = OH_NEW(double, S),
         *got_lp = OH_NEW(double, S);
  int32_t *topk = OH_NEW(int32_t, S), *want = OH_NEW(int32_t, S), *got = OH_NEW(int32_t, S);
  for (int64_t s = 0; s < S; s++) {
    const sample_row_t *r = &sample_rows[s];
    temp[s] = r->temperature;
    topk[s] = r->top_k < 0 ? (int32_t)V + 5 : r->top_k;
    topp[s] = r->top_p;
    minp[s] = r->min_p;
    double *row = lg + s * V, margin = 0;
    for (int attempt = 0; attempt < 100; attempt++) {
      /* Each retry is more peaked: a flat 32k-token distribution puts CDF steps closer
       * together than an f32 sum can resolve. */
      make_logits(row, V, oh_rand_uniform(1.0, 6.0) + 2.0 * attempt, s < 2, false);
      uni[s] = (double)(float)oh_rand_uniform(0, 1);
      if (uni[s] >= 1.0) uni[s] = 0.5;
      want[s] = ops_ref_sample(V, row, temp[s], topk[s], topp[s], minp[s], uni[s], &margin);
      if (margin >= SAMPLE_MIN_MARGIN) break;
    }
    if (margin < SAMPLE_MIN_MARGIN)
      oh_fail("test bug: row %lld: no draw with a safe margin", (long long)s);
    want_lp[s] = row[want[s]] - ops_ref_logsumexp(V, row);
  }
  oh_write(lb, &a.logits, lg);
  oh_write(tb, &a.temperature, temp);
  oh_write_i32(kb, &a.top_k, topk);
  oh_write(pb, &a.top_p, topp);
  oh_write(mb, &a.min_p, minp);
  oh_write(ub, &a.uniform, uni);
  oh_buf_t *ins[] = {lb, tb, kb, pb, mb, ub};
  for (size_t i = 0; i < ARRAY_LEN(ins); i++) oh_push(ins[i]);
  if (oh_ok(be->t->sample(be->stream, &a), "sample") && oh_pull(ib) && oh_pull(opb)) {
    oh_mark(ib, &a.out_ids);
    oh_read_i32(ib, &a.out_ids, got);
    for (int64_t s = 0; s < S; s++) {
      if (got[s] == want[s]) continue;
      const sample_row_t *r = &sample_rows[s];
      oh_fail(
          "row %lld (temperature %g, top_k %d, top_p %g, min_p %g, uniform %.9g): want token "
          "%d, got %d",
          (long long)s, (double)r->temperature, topk[s], (double)r->top_p, (double)r->min_p, uni[s],
          want[s], got[s]);
    }
    oh_check_rest(ib, "out_ids (tail)");
    if (lp) {
      oh_mark(opb, &lpv);
      oh_read(opb, &lpv, got_lp);
      oh_compare("out_logprob", S, got_lp, want_lp, NULL, oh_tol_logprob());
    }
    oh_check_rest(opb,
                  lp ? "out_logprob (tail)" : "out_logprob buffer (absent: must not be written)");
  }
  free(lg);
  free(temp);
  free(topp);
  free(minp);
  free(uni);
  free(want_lp);
  free(got_lp);
  free(topk);
  free(want);
  free(got);
  oh_free_all();
}

void test_ops_sample(void **state) {
  (void)state;
  static const int64_t vocab[] = {1, 2, 50, 1000, 32000};
  oh_test_begin("sample");
  for (int bi = 0; bi < oh_num_backends; bi++) {
    for (size_t vi = 0; vi < ARRAY_LEN(vocab); vi++) {
      int trials = vocab[vi] >= 32000 ? 1 : vocab[vi] >= 1000 ? 6 : 3;
      for (int trial = 0; trial < trials; trial++)
        sample_run(&oh_backends[bi], vocab[vi], trial % 2 == 0, trial);
    }
  }
  oh_test_end();
}
