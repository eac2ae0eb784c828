/* test_beam.c - beam search's bookkeeping (core/sample/beam.c) against an independent
 * reference written here the way transformers' vectorized _beam_search computes it: W running
 * rows (W - 1 placeholders at -1e9 before the first step), top-K of beams x vocab, -1e9 masks
 * for the candidates that hit a stop or may not finish, finished hypotheses merged by a top-W
 * over the old set and the new candidates, and its _beam_search_has_unfinished_sequences.
 * The "model" is a deterministic function of the prefix whose logits are multiples of 0.5, so
 * ties (in logits and in cumulative scores) are frequent and the tie-breaks are exercised.
 * Tokens, lengths, cumulative logprobs and scores must match exactly (the same double math).
 * Width 1 must be greedy search. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "core/sample/beam.h"

#define V 16
#define MAXL 12
#define MAXW 4

/* logits of the next token after prefix[0..n) */
static void model(uint64_t seed, const int32_t *prefix, int32_t n, float *out) {
  uint64_t h = seed * 0x9e3779b97f4a7c15ull + 1;
  for (int32_t i = 0; i < n; i++) h = (h ^ (uint64_t)(prefix[i] + 1)) * 0x100000001b3ull;
  for (int32_t v = 0; v < V; v++) {
    h ^= h >> 29;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 32;
    out[v] = 0.5f * (float)((int)(h % 13) - 6);
  }
  out[0] += 0.5f * (float)(n / 2); /* token 0 (the end of sequence) grows likelier */
}

static double lsm(const float *x, int32_t v) {
  double m = -INFINITY, s = 0.0;
  for (int32_t i = 0; i < V; i++)
    if ((double)x[i] > m) m = (double)x[i];
  for (int32_t i = 0; i < V; i++) s += exp((double)x[i] - m);
  return (double)x[v] - (m + log(s));
}

/* sorts idx[0..n) by key descending, stable */
static void argsort(const double *key, int32_t *idx, int32_t n) {
  for (int32_t i = 0; i < n; i++) idx[i] = i;
  for (int32_t i = 1; i < n; i++) {
    int32_t t = idx[i], j = i;
    while (j > 0 && key[idx[j - 1]] < key[t]) {
      idx[j] = idx[j - 1];
      j--;
    }
    idx[j] = t;
  }
}

typedef struct ref_out {
  int32_t n;
  int32_t tok[MAXW][MAXL], len[MAXW];
  double sum[MAXW], score[MAXW];
} ref_out_t;

static void reference(uint64_t seed, int32_t W, double lp, int early, int32_t max_new,
                      ref_out_t *o) {
  const int32_t K = 2 * W; /* one end-of-sequence id */
  int32_t run[MAXW][MAXL], fin[MAXW][MAXL], fin_len[MAXW];
  double run_s[MAXW], fin_s[MAXW], fin_sum[MAXW];
  bool fin_ok[MAXW];
  for (int32_t b = 0; b < W; b++) {
    run_s[b] = b ? -1e9 : 0.0;
    fin_s[b] = -1e9;
    fin_ok[b] = false;
  }
  static double cs[MAXW * V];
  static int32_t ci[MAXW * V];
  for (int32_t cur = 0; cur < max_new; cur++) {
    float lg[V];
    for (int32_t b = 0; b < W; b++) {
      model(seed, run[b], cur, lg);
      for (int32_t v = 0; v < V; v++) cs[b * V + v] = run_s[b] + lsm(lg, v);
    }
    argsort(cs, ci, W * V);
    bool hit[2 * MAXW], all_hit = true;
    for (int32_t i = 0; i < K; i++) {
      hit[i] = ci[i] % V == 0 || cur + 1 >= max_new;
      all_hit = all_hit && hit[i];
    }
    /* running */
    double mk[2 * MAXW];
    int32_t mi[2 * MAXW];
    for (int32_t i = 0; i < K; i++) mk[i] = cs[ci[i]] + (hit[i] ? -1e9 : 0.0);
    argsort(mk, mi, K);
    int32_t nrun[MAXW][MAXL];
    double nrun_s[MAXW];
    for (int32_t j = 0; j < W; j++) {
      int32_t c = ci[mi[j]];
      memcpy(nrun[j], run[c / V], (size_t)cur * 4);
      nrun[j][cur] = c % V;
      nrun_s[j] = mk[mi[j]];
    }
    /* finished */
    bool all_fin = true;
    for (int32_t b = 0; b < W; b++) all_fin = all_fin && fin_ok[b];
    double mg[3 * MAXW];
    int32_t gi[3 * MAXW];
    for (int32_t b = 0; b < W; b++) mg[b] = fin_s[b];
    for (int32_t i = 0; i < K; i++) {
      mg[W + i] = cs[ci[i]] / pow((double)(cur + 1), lp);
      if (all_fin && early == 1) mg[W + i] += -1e9;
      if (!(hit[i] && i < W)) mg[W + i] += -1e9;
    }
    argsort(mg, gi, W + K);
    int32_t nfin[MAXW][MAXL], nfin_len[MAXW];
    double nfin_s[MAXW], nfin_sum[MAXW];
    bool nfin_ok[MAXW];
    for (int32_t j = 0; j < W; j++) {
      int32_t g = gi[j];
      if (g < W) {
        memcpy(nfin[j], fin[g], sizeof(fin[g]));
        nfin_len[j] = fin_len[g];
        nfin_s[j] = fin_s[g];
        nfin_sum[j] = fin_sum[g];
        nfin_ok[j] = fin_ok[g];
      } else {
        int32_t i = g - W, c = ci[i];
        memcpy(nfin[j], run[c / V], (size_t)cur * 4);
        nfin[j][cur] = c % V;
        nfin_len[j] = cur + 1;
        nfin_s[j] = mg[g];
        nfin_sum[j] = cs[c];
        nfin_ok[j] = hit[i] && i < W && !(all_fin && early == 1);
      }
    }
    memcpy(run, nrun, sizeof(run));
    memcpy(run_s, nrun_s, sizeof(run_s));
    memcpy(fin, nfin, sizeof(fin));
    memcpy(fin_len, nfin_len, sizeof(fin_len));
    memcpy(fin_s, nfin_s, sizeof(fin_s));
    memcpy(fin_sum, nfin_sum, sizeof(fin_sum));
    memcpy(fin_ok, nfin_ok, sizeof(fin_ok));
    int32_t cl = cur + 1;
    int32_t L = early == 2 && lp > 0.0 ? max_new : cl;
    double best = run_s[0] / pow((double)L, lp), worst = 1e300;
    bool improve = false;
    for (int32_t b = 0; b < W; b++)
      if (fin_s[b] < worst) worst = fin_s[b];
    for (int32_t b = 0; b < W; b++) improve = improve || best > (fin_ok[b] ? worst : -1e9);
    bool all_fin2 = true;
    for (int32_t b = 0; b < W; b++) all_fin2 = all_fin2 && fin_ok[b];
    bool open = !(all_fin2 && early == 1);
    if (!(improve && open && !all_hit)) break;
  }
  o->n = 0;
  for (int32_t b = 0; b < W; b++) {
    if (!fin_ok[b]) continue;
    memcpy(o->tok[o->n], fin[b], sizeof(fin[b]));
    o->len[o->n] = fin_len[b];
    o->sum[o->n] = fin_sum[b];
    o->score[o->n++] = fin_s[b];
  }
}

/* drives kiln_beam with the model, tracking the prefixes through parent/token */
static kiln_beam_t *run_beam(uint64_t seed, int32_t W, float lp, int early, int32_t max_new) {
  const int32_t eos = 0;
  kiln_beam_opts_t o = {.width = W, .length_penalty = lp, .early_stopping = early,
                        .max_new_tokens = max_new, .eos = &eos, .num_eos = 1};
  kiln_beam_t *b;
  kiln_status_t st = kiln_beam_create(&o, &b);
  assert_null(st);
  float lg[MAXW * V];
  int32_t parent[MAXW], token[MAXW], nn;
  while (!kiln_beam_done(b)) {
    int32_t R = kiln_beam_num_running(b);
    for (int32_t r = 0; r < R; r++) {
      int32_t len;
      const int32_t *t = kiln_beam_running_tokens(b, r, &len, NULL);
      model(seed, t, len, lg + r * V);
    }
    assert_null(kiln_beam_step(b, lg, V, V, parent, token, &nn));
    for (int32_t j = 0; j < nn; j++) { /* parent/token describe the new running beams */
      int32_t len;
      const int32_t *t = kiln_beam_running_tokens(b, j, &len, NULL);
      assert_int_equal(t[len - 1], token[j]);
      assert_true(parent[j] >= 0 && parent[j] < R);
    }
  }
  return b;
}

static void test_against_reference(void **state) {
  (void)state;
  const float lps[] = {1.0f, 0.0f, 2.0f, -0.5f};
  int32_t cases = 0;
  for (uint64_t seed = 1; seed <= 60; seed++)
    for (int32_t W = 2; W <= MAXW; W++)
      for (int early = 0; early <= 2; early++)
        for (int32_t li = 0; li < 4; li++) {
          int32_t max_new = 1 + (int32_t)(seed % MAXL);
          ref_out_t ref;
          reference(seed, W, (double)lps[li], early, max_new, &ref);
          kiln_beam_t *b = run_beam(seed, W, lps[li], early, max_new);
          assert_int_equal(kiln_beam_num_hyps(b), ref.n);
          for (int32_t i = 0; i < ref.n; i++) {
            const kiln_beam_hyp_t *h = kiln_beam_hyp(b, i);
            if (h->len != ref.len[i] || h->score != ref.score[i] || h->sum_logprob != ref.sum[i] ||
                memcmp(h->tokens, ref.tok[i], (size_t)h->len * 4))
              fail_msg("seed %llu W %d early %d lp %g: hypothesis %d differs (len %d/%d score "
                       "%.17g/%.17g)",
                       (unsigned long long)seed, W, early, (double)lps[li], i, h->len,
                       ref.len[i], h->score, ref.score[i]);
          }
          kiln_beam_free(b);
          cases++;
        }
  printf("beam search = reference in %d cases\n", cases);
}

static void test_width1_is_greedy(void **state) {
  (void)state;
  for (uint64_t seed = 1; seed <= 50; seed++)
    for (int early = 0; early <= 2; early++) {
      int32_t max_new = 1 + (int32_t)(seed % MAXL), g[MAXL], n = 0;
      double sum = 0.0;
      float lg[V];
      while (n < max_new) {
        model(seed, g, n, lg);
        int32_t best = 0;
        for (int32_t v = 1; v < V; v++)
          if (lg[v] > lg[best]) best = v;
        sum += lsm(lg, best);
        g[n++] = best;
        if (best == 0) break;
      }
      kiln_beam_t *b = run_beam(seed, 1, 1.0f, early, max_new);
      assert_int_equal(kiln_beam_num_hyps(b), 1);
      const kiln_beam_hyp_t *h = kiln_beam_hyp(b, 0);
      assert_int_equal(h->len, n);
      assert_memory_equal(h->tokens, g, (size_t)n * 4);
      assert_true(h->sum_logprob == sum);
      assert_true(h->score == sum / (double)n);
      kiln_beam_free(b);
    }
}

static void test_errors(void **state) {
  (void)state;
  kiln_beam_t *b;
  kiln_beam_opts_t o = {.width = 0, .length_penalty = 1.0f, .max_new_tokens = 4};
  kiln_status_t st = kiln_beam_create(&o, &b);
  assert_non_null(st);
  assert_non_null(strstr(kiln_status_message(st), "beam_width"));
  kiln_status_free(st);
  o.width = 2;
  o.early_stopping = (kiln_beam_early_stop_t)7;
  st = kiln_beam_create(&o, &b);
  assert_non_null(strstr(kiln_status_message(st), "early_stopping"));
  kiln_status_free(st);
  o.early_stopping = KILN_BEAM_EARLY_FALSE;
  o.length_penalty = NAN;
  st = kiln_beam_create(&o, &b);
  assert_non_null(strstr(kiln_status_message(st), "length_penalty"));
  kiln_status_free(st);
  o.length_penalty = 1.0f;
  assert_null(kiln_beam_create(&o, &b));
  float lg[V];
  for (int32_t v = 0; v < V; v++) lg[v] = (float)v;
  lg[3] = NAN;
  int32_t p[2], t[2], nn;
  st = kiln_beam_step(b, lg, V, V, p, t, &nn);
  assert_non_null(strstr(kiln_status_message(st), "NaN"));
  kiln_status_free(st);
  kiln_beam_free(b);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_against_reference),
      cmocka_unit_test(test_width1_is_greedy),
      cmocka_unit_test(test_errors),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
