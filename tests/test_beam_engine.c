/* test_beam_engine.c - beam search through the engine (kiln_sampling_params_t.beam_width) with
 * a fake model that is honest about the KV cache: the key it stores for token p is a hash of
 * the token, the key of token p-1 and the key of one earlier token, all read back through the
 * sequence's block table, and its logits are a function of that key. A beam whose blocks do
 * not hold exactly its own prefix (a wrong fork, a missed copy-on-write, a block freed too
 * early) gets other logits and, very likely, other tokens or scores.
 *
 * Each request's results are compared, exactly (tokens, cumulative logprob, score, order),
 * with core/sample/beam.c driven directly on the same logits computed without the engine
 * (test_beam checks beam.c against a transformers-style reference); width 1 must give the
 * engine's own greedy tokens. Also: blocks in use for 4 beams of a 512-token prompt against 4
 * independent requests; many beam requests at once in a small pool (preemption) and
 * cancellations, after which every block is free; refused parameter combinations. */
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

#include "core/engine/engine_internal.h"
#include "core/sample/beam.h"

#define V 48
#define EOS 0
#define MAX_LEN 1024

static uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t z = a * 0x9e3779b97f4a7c15ull + b + 0x632be59bd9b4e019ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static int32_t far_pos(int32_t p) { return p > 0 ? (int32_t)(mix((uint64_t)p, 7) % (uint64_t)p) : 0; }

static float logit_of(uint64_t h, int32_t v) {
  uint64_t z = mix(h, (uint64_t)v + 1000);
  float x = (float)((double)(z >> 11) * (1.0 / 9007199254740992.0) * 8.0 - 4.0);
  return v == EOS ? x + 1.5f : x; /* hypotheses finish now and then */
}

typedef struct fake {
  int32_t bs, nb, max_logits, max_tokens;
  uint64_t *cache, *keys;
  float *logits;
} fake_t;

static kiln_status_t fake_forward(void *ctx, const kiln_batch_t *b) {
  fake_t *f = ctx;
  for (int32_t s = 0; s < b->num_seqs; s++) {
    const int32_t *bt = b->block_tables + (size_t)s * b->max_blocks_per_seq;
    for (int32_t t = b->query_start_loc[s]; t < b->query_start_loc[s + 1]; t++) {
      int32_t p = b->positions[t];
      uint64_t prev = 0x1234, far = 0;
      if (p > 0) {
        prev = f->cache[(size_t)bt[(p - 1) / f->bs] * f->bs + (p - 1) % f->bs];
        int32_t q = far_pos(p);
        far = f->cache[(size_t)bt[q / f->bs] * f->bs + q % f->bs];
      }
      uint64_t h = mix(mix(prev, (uint64_t)b->token_ids[t]), far);
      f->cache[b->slot_mapping[t]] = h;
      f->keys[t] = h;
    }
  }
  if (b->num_logits > f->max_logits) return kiln_status_make(KILN_ERR_INTERNAL, "fake: rows");
  for (int32_t r = 0; r < b->num_logits; r++)
    for (int32_t v = 0; v < V; v++)
      f->logits[(size_t)r * V + v] = logit_of(f->keys[b->logits_rows[r]], v);
  return NULL;
}

static kiln_status_t fake_copy(void *ctx, const int32_t *src, const int32_t *dst, int32_t n) {
  fake_t *f = ctx;
  for (int32_t i = 0; i < n; i++)
    memcpy(f->cache + (size_t)dst[i] * f->bs, f->cache + (size_t)src[i] * f->bs,
           (size_t)f->bs * sizeof(uint64_t));
  return NULL;
}

static void fake_logits(void *ctx, int32_t rows, kiln_sample_logits_t *out) {
  fake_t *f = ctx;
  memset(out, 0, sizeof(*out));
  out->host = f->logits;
  out->num_rows = rows;
}

typedef struct rig {
  fake_t f;
  kiln_config_t *cfg;
  kiln_engine_t *eng;
  int32_t nb;
} rig_t;

static void rig_open(rig_t *g, int32_t bs, int32_t nb, bool prefix_caching) {
  memset(g, 0, sizeof(*g));
  const int32_t MAX_BATCH = 1024;
  assert_null(kiln_config_create(&g->cfg));
  char kv[64];
  snprintf(kv, sizeof(kv), "cache.block_size=%d", bs);
  assert_null(kiln_config_set(g->cfg, kv));
  assert_null(kiln_config_set(g->cfg, "engine.max_num_seqs=32"));
  snprintf(kv, sizeof(kv), "engine.max_num_batched_tokens=%d", MAX_BATCH);
  assert_null(kiln_config_set(g->cfg, kv));
  assert_null(kiln_config_set(g->cfg, prefix_caching ? "cache.enable_prefix_caching=true"
                                                      : "cache.enable_prefix_caching=false"));
  g->f = (fake_t){.bs = bs, .nb = nb, .max_logits = 2048, .max_tokens = MAX_BATCH};
  g->f.cache = calloc((size_t)nb * bs, sizeof(uint64_t));
  g->f.keys = calloc((size_t)MAX_BATCH, sizeof(uint64_t));
  g->f.logits = calloc((size_t)g->f.max_logits * V, sizeof(float));
  assert_true(g->f.cache && g->f.keys && g->f.logits);
  kiln_engine_setup_t su;
  memset(&su, 0, sizeof(su));
  su.config = g->cfg;
  su.runner = (kiln_runner_t){.ctx = &g->f, .vocab_size = V, .max_model_len = MAX_LEN,
                              .max_logits = g->f.max_logits, .forward = fake_forward,
                              .copy_blocks = fake_copy, .logits = fake_logits};
  su.num_blocks = nb;
  static const int32_t eos = EOS;
  su.eos_ids = &eos;
  su.num_eos = 1;
  su.manual = true;
  assert_null(kiln_engine_create_setup(&su, &g->eng));
  g->nb = nb;
}

static void rig_close(rig_t *g) {
  kiln_kv_manager_t *kv = kiln_engine_kv(g->eng);
  assert_int_equal(kiln_kv_num_free(kv), g->nb); /* every block went back */
  kiln_status_t st = kiln_kv_check(kv);
  if (st) fail_msg("%s", kiln_status_message(st));
  kiln_engine_destroy(g->eng);
  kiln_config_free(g->cfg);
  free(g->f.cache);
  free(g->f.keys);
  free(g->f.logits);
}

static int32_t blocks_used(rig_t *g) { return g->nb - kiln_kv_num_free(kiln_engine_kv(g->eng)); }

/* ---- the reference: beam.c on logits computed directly ------------------------------------- */

typedef struct hyps {
  int32_t n;
  int32_t tok[8][64], len[8];
  double sum[8], score[8];
  kiln_finish_reason_t fin[8];
  int32_t finals;
} hyps_t;

static void keys_of(const int32_t *t, int32_t n, uint64_t *k) {
  for (int32_t p = 0; p < n; p++) {
    uint64_t prev = p ? k[p - 1] : 0x1234, far = p ? k[far_pos(p)] : 0;
    k[p] = mix(mix(prev, (uint64_t)t[p]), far);
  }
}

static void reference(const int32_t *prompt, int32_t np, int32_t W, int32_t n, float lp, int early,
                      int32_t max_new, hyps_t *out) {
  const int32_t eos = EOS;
  kiln_beam_opts_t o = {.width = W, .length_penalty = lp, .early_stopping = early,
                        .max_new_tokens = max_new, .eos = &eos, .num_eos = 1};
  kiln_beam_t *b;
  assert_null(kiln_beam_create(&o, &b));
  static int32_t seq[MAX_LEN];
  static uint64_t keys[MAX_LEN];
  static float lg[8 * V];
  int32_t parent[8], token[8], nn;
  memcpy(seq, prompt, (size_t)np * 4);
  while (!kiln_beam_done(b)) {
    int32_t R = kiln_beam_num_running(b);
    for (int32_t r = 0; r < R; r++) {
      int32_t len;
      const int32_t *t = kiln_beam_running_tokens(b, r, &len, NULL);
      memcpy(seq + np, t, (size_t)len * 4);
      keys_of(seq, np + len, keys);
      for (int32_t v = 0; v < V; v++) lg[r * V + v] = logit_of(keys[np + len - 1], v);
    }
    assert_null(kiln_beam_step(b, lg, V, V, parent, token, &nn));
  }
  out->n = kiln_beam_num_hyps(b) < n ? kiln_beam_num_hyps(b) : n;
  for (int32_t i = 0; i < out->n; i++) {
    const kiln_beam_hyp_t *h = kiln_beam_hyp(b, i);
    out->len[i] = h->len;
    memcpy(out->tok[i], h->tokens, (size_t)h->len * 4);
    out->sum[i] = h->sum_logprob;
    out->score[i] = h->score;
  }
  kiln_beam_free(b);
}

/* ---- driving the engine -------------------------------------------------------------------- */

static kiln_request_t *submit(rig_t *g, const int32_t *prompt, int32_t np, int32_t W, int32_t n,
                              float lp, int early, int32_t max_new) {
  kiln_sampling_params_t sp;
  kiln_sampling_params_init(&sp);
  sp.beam_width = W;
  sp.n = n;
  sp.length_penalty = lp;
  sp.early_stopping = early;
  sp.max_tokens = max_new;
  sp.detokenize = false;
  kiln_request_desc_t d = {.struct_size = sizeof(d), .prompt_ids = prompt, .num_prompt_ids = np,
                           .params = &sp};
  kiln_request_t *r;
  kiln_status_t st = kiln_engine_submit(g->eng, &d, &r);
  if (st) fail_msg("%s", kiln_status_message(st));
  return r;
}

/* Takes what r delivered so far; true once it finished. */
static bool drain(kiln_request_t *r, hyps_t *h) {
  kiln_output_t *o;
  bool fin = false;
  while (!kiln_request_poll(r, 0, &o) && o) {
    if (o->finish_reason == KILN_FINISH_LENGTH || o->finish_reason == KILN_FINISH_STOP) {
      assert_int_equal(o->index, h->n); /* one event per hypothesis, in order */
      assert_true(o->num_tokens <= 64);
      memcpy(h->tok[h->n], o->token_ids, (size_t)o->num_tokens * 4);
      h->len[h->n] = o->num_tokens;
      h->sum[h->n] = o->cumulative_logprob;
      h->score[h->n] = o->beam_score;
      h->fin[h->n++] = o->finish_reason;
    } else {
      h->fin[0] = o->finish_reason;
    }
    if (o->request_finished) {
      h->finals++;
      fin = true;
    }
    kiln_output_free(o);
  }
  return fin;
}

static void run_until_idle(rig_t *g) {
  for (int32_t i = 0; i < 100000; i++) {
    bool idle;
    kiln_status_t st = kiln_engine_step(g->eng, &idle);
    if (st) fail_msg("%s", kiln_status_message(st));
    if (idle) return;
  }
  fail_msg("the engine never went idle");
}

static void expect_same(const hyps_t *a, const hyps_t *ref, const char *what) {
  if (a->n != ref->n) fail_msg("%s: %d hypotheses, the reference %d", what, a->n, ref->n);
  for (int32_t i = 0; i < a->n; i++)
    if (a->len[i] != ref->len[i] || memcmp(a->tok[i], ref->tok[i], (size_t)a->len[i] * 4) ||
        a->sum[i] != ref->sum[i] || a->score[i] != ref->score[i])
      fail_msg("%s: hypothesis %d differs (len %d/%d, score %.17g/%.17g)", what, i, a->len[i],
               ref->len[i], a->score[i], ref->score[i]);
}

static void make_prompt(int32_t *p, int32_t np, uint64_t seed) {
  for (int32_t i = 0; i < np; i++) p[i] = 1 + (int32_t)(mix(seed, (uint64_t)i) % (V - 1));
}

static void test_engine_equals_reference(void **state) {
  (void)state;
  rig_t g;
  rig_open(&g, 8, 256, true);
  const float lps[] = {1.0f, 0.0f, 2.0f};
  int32_t cases = 0;
  for (uint64_t seed = 1; seed <= 8; seed++)
    for (int32_t W = 1; W <= 4; W++)
      for (int early = 0; early <= 2; early++) {
        int32_t prompt[64], np = 5 + (int32_t)(seed * 7 % 40), max_new = 3 + (int32_t)(seed % 10);
        float lp = lps[(seed + (uint64_t)early) % 3];
        int32_t n = 1 + (int32_t)(seed % (uint64_t)W);
        make_prompt(prompt, np, seed);
        hyps_t ref, got;
        memset(&got, 0, sizeof(got));
        reference(prompt, np, W, n, lp, early, max_new, &ref);
        kiln_request_t *r = submit(&g, prompt, np, W, n, lp, early, max_new);
        run_until_idle(&g);
        assert_true(drain(r, &got));
        assert_int_equal(got.finals, 1);
        kiln_request_release(r);
        char what[96];
        snprintf(what, sizeof(what), "seed %llu W %d n %d early %d lp %g", (unsigned long long)seed,
                 W, n, early, (double)lp);
        expect_same(&got, &ref, what);
        for (int32_t i = 0; i < got.n; i++)
          assert_int_equal(got.fin[i], got.tok[i][got.len[i] - 1] == EOS ? KILN_FINISH_STOP
                                                                          : KILN_FINISH_LENGTH);
        if (W == 1) { /* width 1 = the engine's own greedy search */
          kiln_sampling_params_t sp;
          kiln_sampling_params_init(&sp);
          sp.temperature = 0;
          sp.max_tokens = max_new;
          sp.detokenize = false;
          kiln_request_desc_t d = {.struct_size = sizeof(d), .prompt_ids = prompt,
                                   .num_prompt_ids = np, .params = &sp};
          kiln_request_t *gr;
          assert_null(kiln_engine_submit(g.eng, &d, &gr));
          run_until_idle(&g);
          int32_t toks[64], nt = 0;
          kiln_output_t *o;
          while (!kiln_request_poll(gr, 0, &o) && o) {
            for (int32_t t = 0; t < o->num_tokens; t++) toks[nt++] = o->token_ids[t];
            kiln_output_free(o);
          }
          kiln_request_release(gr);
          assert_int_equal(nt, got.len[0]);
          assert_memory_equal(toks, got.tok[0], (size_t)nt * 4);
        }
        cases++;
      }
  printf("engine beam search = reference in %d requests\n", cases);
  rig_close(&g);
}

/* 4 beams of a 512-token prompt share the prompt's blocks; 4 independent requests (prefix
 * caching off, so they do not share) hold 4 copies. */
static void test_block_sharing(void **state) {
  (void)state;
  const int32_t BS = 16, NP = 512, MAXNEW = 8;
  int32_t prompt[NP];
  make_prompt(prompt, NP, 99);
  rig_t g;
  rig_open(&g, BS, 512, false);
  kiln_request_t *r = submit(&g, prompt, NP, 4, 4, 1.0f, 0, MAXNEW);
  int32_t peak_beam = 0;
  for (int32_t i = 0; i < 1000; i++) {
    bool idle;
    assert_null(kiln_engine_step(g.eng, &idle));
    if (blocks_used(&g) > peak_beam) peak_beam = blocks_used(&g);
    if (idle) break;
  }
  hyps_t got;
  memset(&got, 0, sizeof(got));
  assert_true(drain(r, &got));
  kiln_request_release(r);
  assert_int_equal(blocks_used(&g), 0);
  kiln_request_t *ind[4];
  for (int32_t k = 0; k < 4; k++) {
    kiln_sampling_params_t sp;
    kiln_sampling_params_init(&sp);
    sp.temperature = 0;
    sp.max_tokens = MAXNEW;
    sp.ignore_eos = true;
    sp.detokenize = false;
    kiln_request_desc_t d = {.struct_size = sizeof(d), .prompt_ids = prompt, .num_prompt_ids = NP,
                             .params = &sp};
    assert_null(kiln_engine_submit(g.eng, &d, &ind[k]));
  }
  int32_t peak_ind = 0;
  for (int32_t i = 0; i < 1000; i++) {
    bool idle;
    assert_null(kiln_engine_step(g.eng, &idle));
    if (blocks_used(&g) > peak_ind) peak_ind = blocks_used(&g);
    if (idle) break;
  }
  for (int32_t k = 0; k < 4; k++) {
    kiln_request_cancel(ind[k]);
    kiln_request_release(ind[k]);
  }
  run_until_idle(&g);
  printf("KV blocks in use (block size %d), 512-token prompt, %d new tokens: 4 beams %d, "
         "4 independent requests %d\n",
         BS, MAXNEW, peak_beam, peak_ind);
  /* the beams: the prompt's 32 blocks once, plus at most one block of their own each */
  assert_true(peak_beam <= NP / BS + 4 + 1);
  assert_true(peak_ind >= 4 * (NP / BS));
  rig_close(&g);
}

/* Many beam requests in a pool too small for all at once: preemptions happen, the results are
 * still the reference's, and cancelled ones free everything. */
static void test_preemption_and_cancel(void **state) {
  (void)state;
  rig_t g;
  rig_open(&g, 8, 48, true);
  enum { NR = 8 };
  kiln_request_t *rs[NR];
  hyps_t got[NR], ref[NR];
  int32_t prompts[NR][64], nps[NR];
  memset(got, 0, sizeof(got));
  for (int32_t k = 0; k < NR; k++) {
    nps[k] = 20 + k * 3;
    make_prompt(prompts[k], nps[k], 1000 + (uint64_t)k);
    reference(prompts[k], nps[k], 4, 2, 1.0f, k % 3, 16, &ref[k]);
    rs[k] = submit(&g, prompts[k], nps[k], 4, 2, 1.0f, k % 3, 16);
  }
  kiln_metrics_t m0, m1;
  kiln_engine_get_metrics(g.eng, &m0);
  bool done[NR] = {false};
  for (int32_t step = 0; step < 100000; step++) {
    bool idle;
    assert_null(kiln_engine_step(g.eng, &idle));
    if (step == 3) kiln_request_cancel(rs[NR - 1]); /* mid-search */
    for (int32_t k = 0; k < NR; k++)
      if (!done[k]) done[k] = drain(rs[k], &got[k]);
    if (idle) break;
  }
  kiln_engine_get_metrics(g.eng, &m1);
  printf("preemptions with beam search in a %d-block pool: %llu\n", g.nb,
         (unsigned long long)(m1.preemptions - m0.preemptions));
  assert_true(m1.preemptions > m0.preemptions);
  for (int32_t k = 0; k < NR; k++) {
    assert_true(done[k]);
    assert_int_equal(got[k].finals, 1);
    if (k == NR - 1) {
      assert_int_equal(got[k].fin[0], KILN_FINISH_ABORT);
    } else {
      expect_same(&got[k], &ref[k], "under preemption");
    }
    kiln_request_release(rs[k]);
  }
  rig_close(&g);
}

static void expect_refused(rig_t *g, const kiln_sampling_params_t *sp, const char *needle) {
  int32_t prompt[4] = {1, 2, 3, 4};
  kiln_request_desc_t d = {.struct_size = sizeof(d), .prompt_ids = prompt, .num_prompt_ids = 4,
                           .params = sp};
  kiln_request_t *r = NULL;
  kiln_status_t st = kiln_engine_submit(g->eng, &d, &r);
  assert_non_null(st);
  if (!strstr(kiln_status_message(st), needle))
    fail_msg("expected \"%s\" in \"%s\"", needle, kiln_status_message(st));
  kiln_status_free(st);
  assert_null(r);
}

static void test_refused(void **state) {
  (void)state;
  rig_t g;
  rig_open(&g, 8, 64, true);
  kiln_sampling_params_t sp;
  kiln_sampling_params_init(&sp);
  sp.beam_width = 2;
  sp.n = 3;
  expect_refused(&g, &sp, "n (3) must be <= beam_width (2)");
  sp.n = 1;
  sp.logprobs = 0;
  expect_refused(&g, &sp, "logprobs");
  sp.logprobs = -1;
  sp.repetition_penalty = 1.2f;
  expect_refused(&g, &sp, "repetition_penalty");
  sp.repetition_penalty = 1.0f;
  sp.early_stopping = 5;
  expect_refused(&g, &sp, "early_stopping");
  sp.early_stopping = 0;
  sp.beam_width = 30; /* K = 60 candidates > the 48-token vocabulary */
  expect_refused(&g, &sp, "vocabulary");
  sp.beam_width = 0;
  sp.length_penalty = 2.0f;
  expect_refused(&g, &sp, "need beam search");
  rig_close(&g);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_engine_equals_reference),
      cmocka_unit_test(test_block_sharing),
      cmocka_unit_test(test_preemption_and_cancel),
      cmocka_unit_test(test_refused),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
