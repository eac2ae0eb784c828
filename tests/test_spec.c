/* test_spec.c - speculative decoding ([speculative] method = ngram, core/engine) on the CPU
 * backend: the n-gram proposer on its own; then greedy requests on the default model
 * (share/models/kiln-tiny) and on fixture models give exactly the tokens, finish reasons and
 * text of plain greedy decoding, with proposals accepted on a copy-heavy prompt (the metrics
 * say so) and none to accept on a random one; in a batch mixed with sampled and
 * non-speculating requests, under preemption (a small KV pool), chunked prefill (a small token
 * budget, which also trims proposals), the batch-size rule, stop strings, stop tokens inside an
 * accepted run and max_tokens in the middle of a proposal; every KV block is free at the end.
 * And the refusals: bad [speculative] values, a per-request k above the engine's, and an old
 * caller's shorter kiln_sampling_params_t. Under valgrind (or KILN_TEST_QUICK=1) the default
 * model's cases are skipped and only the llama2 fixture's copy prompt runs. */
#define _POSIX_C_SOURCE 200809L
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#if defined(__has_include)
#if __has_include(<valgrind/valgrind.h>)
#include <valgrind/valgrind.h>
#endif
#endif

#include "base/config.h"
#include "core/engine/engine_internal.h"
#include "core/kv/block_manager.h"
#include "core/sched/scheduler.h"
#include "kiln/kiln.h"

#define MAXREQ 512
#define MAXTOK 96

static char g_src[1024];
/* Under valgrind (or with KILN_TEST_QUICK set): the llama2 fixture's copy prompt only (the
 * default model's cases took over 10 minutes there). */
static bool g_quick;

static void check_st(kiln_status_t st) {
  if (st) {
    fprintf(stderr, "unexpected error: %s\n", kiln_status_message(st));
    kiln_status_free(st);
    fail();
  }
}

/* ---- the proposer ------------------------------------------------------------------------- */

static void test_ngram_propose(void **state) {
  (void)state;
  int32_t out[8];
  /* ... 1 2 3 [7 8 9] ... 1 2 3 [5 6] ... 1 2 3: the latest match of the 3-gram wins. */
  const int32_t a[] = {1, 2, 3, 7, 8, 9, 4, 1, 2, 3, 5, 6, 0, 1, 2, 3};
  const int32_t na = (int32_t)(sizeof(a) / sizeof(a[0]));
  assert_int_equal(kiln_spec_ngram_propose(a, na, 1, 3, 4, out), 4);
  assert_int_equal(out[0], 5);
  assert_int_equal(out[1], 6);
  assert_int_equal(out[2], 0);
  assert_int_equal(out[3], 1);
  assert_int_equal(kiln_spec_ngram_propose(a, na, 1, 3, 1, out), 1);
  assert_int_equal(out[0], 5);
  assert_int_equal(kiln_spec_ngram_propose(a, na, 1, 3, 0, out), 0);
  /* The longest suffix first: "9 4 3" never occurred, "4 3" neither; the 1-gram "3" did. */
  const int32_t b[] = {3, 5, 9, 4, 3};
  assert_int_equal(kiln_spec_ngram_propose(b, 5, 1, 3, 4, out), 4);
  assert_int_equal(out[0], 5);
  assert_int_equal(out[3], 3);
  assert_int_equal(kiln_spec_ngram_propose(b, 5, 2, 3, 4, out), 0); /* no 2-gram matches */
  /* A longer match beats a later shorter one: "1 2" at 0 (then 9) vs "2" at 4 (then 2). */
  const int32_t c[] = {1, 2, 9, 8, 2, 2, 7, 1, 2};
  assert_int_equal(kiln_spec_ngram_propose(c, 9, 1, 2, 2, out), 2);
  assert_int_equal(out[0], 9);
  assert_int_equal(out[1], 8);
  /* Proposals stop at the end of the sequence (a match right before the suffix). */
  const int32_t d[] = {4, 4, 4};
  assert_int_equal(kiln_spec_ngram_propose(d, 3, 1, 1, 5, out), 1);
  assert_int_equal(out[0], 4);
  assert_int_equal(kiln_spec_ngram_propose(d, 3, 2, 2, 5, out), 1); /* "4 4" at 0, then 4 */
  assert_int_equal(kiln_spec_ngram_propose(d, 1, 1, 4, 5, out), 0);
  /* No match at all. */
  const int32_t e[] = {1, 2, 3, 4, 5};
  assert_int_equal(kiln_spec_ngram_propose(e, 5, 1, 4, 4, out), 0);
}

/* ---- the scheduler and the block manager ---------------------------------------------------- */

static void seq_init(kiln_seq_t *q, int32_t n, int32_t base, uint64_t arrival) {
  memset(q, 0, sizeof(*q));
  q->arrival = arrival;
  q->num_prompt = n;
  for (int32_t i = 0; i < n; i++) check_st(kiln_seq_append(q, base + i));
}

/* Adds k drafts (ids 900 + i) to a decoding sequence, as the engine's proposer does. */
static void add_drafts(kiln_seq_t *q, int32_t k) {
  for (int32_t i = 0; i < k; i++) check_st(kiln_seq_append(q, 900 + i));
  q->num_draft = k;
}

static kiln_sched_step_t *schedule(kiln_scheduler_t *s) {
  kiln_sched_step_t *st = NULL;
  check_st(kiln_scheduler_schedule(s, &st));
  return st;
}

static void test_scheduler_drafts(void **state) {
  (void)state;
  kiln_kv_manager_t *kv = NULL;
  check_st(kiln_kv_manager_create(12, 4, true, &kv));
  kiln_sched_options_t o = {.max_num_seqs = 4, .max_num_batched_tokens = 64, .chunked_prefill = true};
  kiln_scheduler_t *s = NULL;
  check_st(kiln_scheduler_create(kv, &o, &s));
  kiln_seq_t a;
  seq_init(&a, 7, 10, 0);
  kiln_scheduler_add(s, &a);
  kiln_sched_step_t *st = schedule(s);
  assert_int_equal(st->num_items, 1);
  assert_int_equal(st->items[0].count, 7);
  assert_int_equal(st->items[0].draft, 0);
  kiln_scheduler_update_computed(s, st);
  check_st(kiln_seq_append(&a, 50)); /* the first output token: 8 tokens, 7 computed */
  kiln_kv_stats_t ks;
  kiln_kv_stats(kv, &ks);
  assert_int_equal(ks.num_cached, 1); /* block 0 (tokens 0-3) */
  /* 5 drafts: one item of 6 tokens, blocks for 13 tokens; only blocks of real tokens cached. */
  add_drafts(&a, 5);
  st = schedule(s);
  assert_int_equal(st->num_items, 1);
  assert_int_equal(st->items[0].start, 7);
  assert_int_equal(st->items[0].count, 6);
  assert_int_equal(st->items[0].draft, 5);
  assert_true(st->items[0].sample);
  assert_int_equal(a.num_blocks, 4);
  kiln_scheduler_update_computed(s, st);
  assert_int_equal(a.num_computed, 13);
  kiln_kv_stats(kv, &ks);
  assert_int_equal(ks.num_cached, 2); /* blocks 0, 1 (tokens 0-7); not 2 (drafts 8-11) */
  /* One draft accepted: 8 tokens, 9 computed (the engine appends the draft and the bonus). */
  kiln_scheduler_accept_drafts(s, &a, 1);
  assert_int_equal(a.num_tokens, 8);
  assert_int_equal(a.num_draft, 0);
  assert_int_equal(a.num_computed, 9);
  assert_int_equal(a.num_blocks, 3);
  assert_int_equal(kiln_kv_num_free(kv), 12 - 3);
  check_st(kiln_seq_append(&a, 900));
  check_st(kiln_seq_append(&a, 51));
  assert_null(kiln_kv_check(kv));
  /* The budget trims drafts: 3 tokens = the decode and 2 of 4 drafts. */
  kiln_scheduler_free(s);
  o.max_num_batched_tokens = 3;
  check_st(kiln_scheduler_create(kv, &o, &s));
  kiln_scheduler_add_running_after(s, NULL, &a);
  add_drafts(&a, 4);
  st = schedule(s);
  assert_int_equal(st->num_items, 1);
  assert_int_equal(st->items[0].count, 3);
  assert_int_equal(st->items[0].draft, 2);
  assert_int_equal(a.num_tokens, 12);
  assert_true(st->items[0].sample);
  kiln_scheduler_update_computed(s, st);
  kiln_scheduler_accept_drafts(s, &a, 0); /* none accepted */
  assert_int_equal(a.num_tokens, 10);
  assert_int_equal(a.num_computed, 10);
  assert_int_equal(a.num_blocks, 3);
  check_st(kiln_seq_append(&a, 52));
  /* The pool is short: a second sequence takes most of it, and a's drafts go rather than b. */
  kiln_scheduler_free(s);
  o.max_num_batched_tokens = 64;
  check_st(kiln_scheduler_create(kv, &o, &s));
  kiln_scheduler_add_running_after(s, NULL, &a);
  kiln_seq_t b;
  seq_init(&b, 35, 200, 1);
  kiln_scheduler_add(s, &b);
  st = schedule(s); /* a's decode (position 10: its third block) and b's 35 tokens (9 blocks) */
  assert_int_equal(st->num_items, 2);
  kiln_scheduler_update_computed(s, st);
  check_st(kiln_seq_append(&a, 53));
  check_st(kiln_seq_append(&b, 54));
  assert_int_equal(kiln_kv_num_free(kv), 0);
  add_drafts(&a, 4); /* positions 11..15 would need a fourth block: none is free */
  st = schedule(s);
  assert_int_equal(st->num_preempted, 0);
  assert_int_equal(st->num_items, 2);
  assert_ptr_equal(st->items[0].seq, &a);
  assert_int_equal(st->items[0].count, 1);
  assert_int_equal(st->items[0].draft, 0);
  assert_int_equal(a.num_tokens, 12);
  assert_int_equal(a.num_draft, 0);
  kiln_scheduler_update_computed(s, st);
  /* Drafts across a block boundary, scheduled beside a new sequence, both accepted. */
  check_st(kiln_seq_append(&a, 55));
  add_drafts(&a, 2);
  kiln_seq_t c;
  seq_init(&c, 3, 300, 2);
  kiln_scheduler_add(s, &c);
  kiln_scheduler_finish(s, &b); /* room for c and a's drafts */
  st = schedule(s);
  kiln_scheduler_update_computed(s, st);
  kiln_scheduler_accept_drafts(s, &a, 2);
  assert_int_equal(a.num_computed, 15);
  check_st(kiln_seq_append(&a, 901));
  check_st(kiln_seq_append(&a, 56));
  check_st(kiln_seq_append(&a, 57));
  assert_int_equal(a.num_tokens, 16);
  assert_null(kiln_kv_check(kv));
  kiln_scheduler_finish(s, &a);
  kiln_scheduler_finish(s, &c);
  assert_int_equal(kiln_kv_num_free(kv), 12);
  assert_null(kiln_kv_check(kv));
  kiln_scheduler_free(s);
  kiln_seq_free(&a);
  kiln_seq_free(&b);
  kiln_seq_free(&c);
  kiln_kv_manager_free(kv);
}

/* ---- the engine --------------------------------------------------------------------------- */

typedef struct req_spec {
  const char *prompt;    /* text, or NULL for ids */
  const int32_t *ids;
  int32_t num_ids;
  int32_t max_tokens;
  float temperature;     /* > 0: seeded sampling */
  int32_t top_k;         /* 0 = the default (all) */
  uint64_t seed;         /* 0: 11 + the request's index */
  int32_t spec;          /* num_speculative_tokens (-1 = the engine's) */
  const char *stop;      /* a stop string, or NULL */
  int32_t stop_token;    /* a stop token id, or -1 */
  bool ignore_eos;
} req_spec_t;

typedef struct req_result {
  int32_t ids[MAXTOK];
  int32_t n;
  char text[4096];
  size_t text_len;
  kiln_finish_reason_t fin;
  int32_t stop_token;
  bool finished;
} req_result_t;

typedef struct run_stats {
  uint64_t drafts, draft_tokens, accepted, preemptions, steps;
} run_stats_t;

static void collect(kiln_request_t *r, req_result_t *res) {
  kiln_output_t *o;
  for (;;) {
    check_st(kiln_request_poll(r, 0, &o));
    if (!o) return;
    assert_int_equal(o->index, 0);
    assert_null(o->error);
    for (int32_t i = 0; i < o->num_tokens; i++) {
      assert_true(res->n < MAXTOK);
      res->ids[res->n++] = o->token_ids[i];
    }
    assert_true(res->text_len + o->text_len < sizeof(res->text));
    memcpy(res->text + res->text_len, o->text, o->text_len);
    res->text_len += o->text_len;
    res->text[res->text_len] = '\0';
    if (o->finish_reason != KILN_FINISH_NONE) {
      res->fin = o->finish_reason;
      res->stop_token = o->stop_token;
    }
    if (o->request_finished) {
      assert_false(res->finished);
      res->finished = true;
    }
    kiln_output_free(o);
  }
}

/* Runs the requests together on an engine (manual stepping) made from the model and the
 * overrides; checks that every block is free afterwards. */
static void run(const char *model, const char *const *extra, int32_t nextra, const req_spec_t *rq,
                int32_t nreq, req_result_t *res, run_stats_t *stats) {
  kiln_config_t *cfg = NULL;
  check_st(kiln_config_create(&cfg));
  char mp[1200];
  snprintf(mp, sizeof(mp), "model.path=%s", model);
  const char *base[] = {mp, "backend.name=cpu", "backend.threads=2", "model.dtype=float32",
                        "engine.max_num_seqs=8"};
  for (size_t i = 0; i < sizeof(base) / sizeof(base[0]); i++) check_st(kiln_config_set(cfg, base[i]));
  for (int32_t i = 0; i < nextra; i++) check_st(kiln_config_set(cfg, extra[i]));
  kiln_engine_setup_t su;
  memset(&su, 0, sizeof(su));
  su.config = cfg;
  su.manual = true;
  kiln_engine_t *e = NULL;
  check_st(kiln_engine_create_setup(&su, &e));
  static kiln_request_t *reqs[MAXREQ];
  assert_true(nreq <= MAXREQ);
  for (int32_t k = 0; k < nreq; k++) {
    kiln_sampling_params_t p;
    kiln_sampling_params_init(&p);
    p.max_tokens = rq[k].max_tokens;
    p.temperature = rq[k].temperature;
    if (rq[k].top_k) p.top_k = rq[k].top_k;
    p.has_seed = true;
    p.seed = rq[k].seed ? rq[k].seed : 11 + (uint64_t)k;
    p.num_speculative_tokens = rq[k].spec;
    p.ignore_eos = rq[k].ignore_eos;
    const char *stops[1] = {rq[k].stop};
    if (rq[k].stop) {
      p.stop = stops;
      p.num_stop = 1;
    }
    int32_t st_ids[1] = {rq[k].stop_token};
    if (rq[k].stop_token >= 0) {
      p.stop_token_ids = st_ids;
      p.num_stop_token_ids = 1;
    }
    kiln_request_desc_t d = {.struct_size = sizeof(d), .params = &p};
    if (rq[k].prompt) {
      d.prompt = rq[k].prompt;
    } else {
      d.prompt_ids = rq[k].ids;
      d.num_prompt_ids = rq[k].num_ids;
    }
    memset(&res[k], 0, sizeof(res[k]));
    check_st(kiln_engine_submit(e, &d, &reqs[k]));
  }
  for (int32_t guard = 0; guard < 10000; guard++) {
    bool idle = false;
    check_st(kiln_engine_step(e, &idle));
    assert_null(kiln_kv_check(kiln_engine_kv(e)));
    for (int32_t k = 0; k < nreq; k++) collect(reqs[k], &res[k]);
    if (idle) break;
  }
  for (int32_t k = 0; k < nreq; k++) {
    assert_true(res[k].finished);
    kiln_request_release(reqs[k]);
  }
  kiln_kv_manager_t *kv = kiln_engine_kv(e);
  assert_int_equal(kiln_kv_num_free(kv), kiln_kv_num_blocks(kv));
  assert_null(kiln_kv_check(kv));
  kiln_metrics_t m;
  kiln_engine_get_metrics(e, &m);
  if (stats)
    *stats = (run_stats_t){.drafts = m.spec_drafts,
                           .draft_tokens = m.spec_draft_tokens,
                           .accepted = m.spec_accepted_tokens,
                           .preemptions = m.preemptions,
                           .steps = m.steps};
  assert_true(m.spec_accepted_tokens <= m.spec_draft_tokens);
  kiln_engine_destroy(e);
  kiln_config_free(cfg);
}

static void expect_same(const req_result_t *a, const req_result_t *b, int32_t nreq,
                        const char *what) {
  for (int32_t k = 0; k < nreq; k++) {
    bool same = a[k].n == b[k].n && !memcmp(a[k].ids, b[k].ids, (size_t)a[k].n * 4) &&
                a[k].fin == b[k].fin && a[k].stop_token == b[k].stop_token &&
                a[k].text_len == b[k].text_len && !memcmp(a[k].text, b[k].text, a[k].text_len);
    if (!same) {
      fprintf(stderr, "%s: request %d differs (%d vs %d tokens, finish %d vs %d)\n", what, k,
              a[k].n, b[k].n, (int)a[k].fin, (int)b[k].fin);
      for (int32_t i = 0; i < a[k].n || i < b[k].n; i++)
        fprintf(stderr, "  %d: %d %d\n", i, i < a[k].n ? a[k].ids[i] : -1,
                i < b[k].n ? b[k].ids[i] : -1);
      fail();
    }
  }
}

#define COPY_TEXT                                                                                \
  "Please repeat the list exactly. apples, pears, plums, cherries, grapes, lemons, limes, "      \
  "melons. Again: apples, pears, plums, cherries, grapes, lemons, limes, melons. Again: apples, " \
  "pears,"

/* n ids below vocab from a 64-bit LCG started at seed (the same ids on every run). */
static void fill_lcg_ids(int32_t *ids, int32_t n, uint64_t seed, int32_t vocab) {
  for (int32_t i = 0; i < n; i++) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    ids[i] = (int32_t)((seed >> 33) % (uint64_t)vocab);
  }
}

static int32_t g_random_ids[40];

static void fill_random_ids(int32_t vocab) { fill_lcg_ids(g_random_ids, 40, 0x12345678u, vocab); }

/* Copy-heavy ids for a model without a tokenizer: a random phrase of 12 tokens, three times. */
static int32_t g_copy_ids[36];

static void fill_copy_ids(int32_t vocab) {
  fill_lcg_ids(g_copy_ids, 12, 0x9e3779b9u, vocab);
  for (int32_t i = 12; i < 36; i++) g_copy_ids[i] = g_copy_ids[i - 12];
}

static const char *const k_spec_on[] = {"speculative.method=ngram",
                                        "speculative.num_speculative_tokens=4",
                                        "speculative.ngram_min=1", "speculative.ngram_max=3"};

/* One request at a time: copy-heavy (proposals accepted) and random. */
static void check_alone(const char *model, bool text, int32_t vocab, const char *name) {
  fill_random_ids(vocab);
  fill_copy_ids(vocab);
  req_spec_t rq[2] = {
      {.prompt = text ? COPY_TEXT : NULL, .ids = g_copy_ids, .num_ids = 36, .max_tokens = 48,
       .spec = -1, .stop_token = -1, .ignore_eos = true},
      {.ids = g_random_ids, .num_ids = 40, .max_tokens = 40, .spec = -1, .stop_token = -1,
       .ignore_eos = true},
  };
  for (int32_t k = 0; k < (g_quick ? 1 : 2); k++) {
    req_result_t plain, spec;
    run_stats_t st;
    run(model, NULL, 0, &rq[k], 1, &plain, NULL);
    run(model, k_spec_on, 4, &rq[k], 1, &spec, &st);
    expect_same(&plain, &spec, 1, name);
    fprintf(stderr, "%s %s: %d tokens, %llu drafts, %llu proposed, %llu accepted, %llu steps\n",
            name, k ? "random" : "copy", spec.n, (unsigned long long)st.drafts,
            (unsigned long long)st.draft_tokens, (unsigned long long)st.accepted,
            (unsigned long long)st.steps);
    if (k == 0 && text) assert_true(st.accepted > 0); /* the default model copies the list */
    /* Sampled, seeded: the same tokens too (each proposal's row samples with the draw its
     * token will have). */
    req_spec_t sq = rq[k];
    sq.temperature = 0.7f;
    run(model, NULL, 0, &sq, 1, &plain, NULL);
    run(model, k_spec_on, 4, &sq, 1, &spec, &st);
    expect_same(&plain, &spec, 1, name);
    fprintf(stderr, "%s %s sampled: %d tokens, %llu proposed, %llu accepted\n", name,
            k ? "random" : "copy", spec.n, (unsigned long long)st.draft_tokens,
            (unsigned long long)st.accepted);
    if (k == 0 && text) assert_true(st.accepted > 0);
  }
}

static void model_path(char *out, size_t n, const char *rel) {
  snprintf(out, n, "%s/%s", g_src, rel);
}

static void test_default_model_alone(void **state) {
  (void)state;
  if (g_quick) skip();
  char p[1100];
  model_path(p, sizeof(p), "share/models/kiln-tiny");
  check_alone(p, true, 4096, "kiln-tiny");
}

static void test_fixtures_alone(void **state) {
  (void)state;
  static const char *const fx[] = {"llama2", "qwen3", "mistral_swa", "llama_bias_mqa"};
  for (size_t i = 0; i < (g_quick ? 1 : sizeof(fx) / sizeof(fx[0])); i++) {
    char rel[256], p[1400];
    snprintf(rel, sizeof(rel), "tests/fixtures/models/%s", fx[i]);
    model_path(p, sizeof(p), rel);
    /* the fixtures' vocabularies are at least 256 tokens */
    check_alone(p, false, 256, fx[i]);
  }
}

/* A mixed batch on the default model: speculating and non-speculating greedy requests, a
 * sampled one, a stop string, a stop token, max_tokens in the middle of a proposal; with a
 * small pool (preemption), a small token budget (chunked prefill, proposals trimmed) and the
 * batch-size rule. */
static void test_default_model_batch(void **state) {
  (void)state;
  if (g_quick) skip();
  char p[1100];
  model_path(p, sizeof(p), "share/models/kiln-tiny");
  fill_random_ids(4096);
  /* The plain run's output of the copy prompt, to place a stop token inside an accepted run. */
  req_spec_t probe = {.prompt = COPY_TEXT, .max_tokens = 40, .spec = -1, .stop_token = -1,
                      .ignore_eos = true};
  req_result_t pr;
  run(p, NULL, 0, &probe, 1, &pr, NULL);
  assert_true(pr.n >= 20);
  const int32_t stop_tok = pr.ids[13];
  const req_spec_t rq[7] = {
      {.prompt = COPY_TEXT, .max_tokens = 40, .spec = -1, .stop_token = -1, .ignore_eos = true},
      {.prompt = COPY_TEXT " plums", .max_tokens = 13, .spec = -1, .stop_token = -1,
       .ignore_eos = true},
      {.prompt = COPY_TEXT, .max_tokens = 40, .spec = -1, .stop = "lemons", .stop_token = -1},
      {.prompt = COPY_TEXT, .max_tokens = 40, .spec = 2, .stop_token = stop_tok},
      {.prompt = COPY_TEXT, .max_tokens = 24, .spec = 0, .stop_token = -1, .ignore_eos = true},
      {.prompt = COPY_TEXT, .max_tokens = 24, .temperature = 0.8f, .spec = -1, .stop_token = -1,
       .ignore_eos = true},
      {.ids = g_random_ids, .num_ids = 40, .max_tokens = 30, .spec = -1, .stop_token = -1},
  };
  const int32_t nreq = 7;
  req_result_t plain[7], spec[7];
  run(p, NULL, 0, rq, nreq, plain, NULL);
  assert_int_equal(plain[3].fin, KILN_FINISH_STOP);
  assert_int_equal(plain[3].stop_token, stop_tok);
  assert_int_equal(plain[1].n, 13);
  struct {
    const char *name;
    const char *set[4];
    int32_t nset;
  } cfgs[] = {
      {"roomy", {"speculative.disable_by_batch_size=8"}, 1},
      {"small pool", {"cache.num_blocks=20", "cache.block_size=8"}, 2},
      {"chunked", {"engine.max_num_batched_tokens=19", "cache.block_size=8"}, 2},
      {"batch rule", {"speculative.disable_by_batch_size=3"}, 1},
      {"tight budget", {"engine.max_num_batched_tokens=6"}, 1},
  };
  for (size_t c = 0; c < sizeof(cfgs) / sizeof(cfgs[0]); c++) {
    const char *ov[8];
    int32_t n = 0;
    for (int32_t i = 0; i < 4; i++) ov[n++] = k_spec_on[i];
    for (int32_t i = 0; i < cfgs[c].nset; i++) ov[n++] = cfgs[c].set[i];
    run_stats_t st;
    /* the plain run with the same pool and budget too: the sampled request's tokens may
     * depend on the batch's shape (near ties), greedy ones must not */
    req_result_t base[7];
    run(p, ov + 4, n - 4, rq, nreq, base, NULL);
    expect_same(plain, base, 5, cfgs[c].name);
    run(p, ov, n, rq, nreq, spec, &st);
    fprintf(stderr, "batch %s: %llu drafts, %llu proposed, %llu accepted, %llu preemptions\n",
            cfgs[c].name, (unsigned long long)st.drafts, (unsigned long long)st.draft_tokens,
            (unsigned long long)st.accepted, (unsigned long long)st.preemptions);
    expect_same(base, spec, nreq, cfgs[c].name);
    assert_true(st.accepted > 0);
    if (c == 1) assert_true(st.preemptions > 0);
  }
}

/* The sampled distribution, statistically: N seeded requests with speculation and N with other
 * seeds without it, temperature 1 and top-k 2 on the copy prompt (the copy is likely but not
 * certain, so proposals are both accepted and rejected), 3 tokens each; the two samples of
 * 3-token outputs (at most 8 outcomes) must pass a chi-square test of homogeneity at
 * p = 0.001. Tokens 2 and 3 come from verification rows whenever a proposal was made, so a
 * verification that skewed the distribution (accepting a proposal more often than p(x), or a
 * residual not renormalised) shows here. */
static void test_sampled_distribution(void **state) {
  (void)state;
  if (g_quick) skip();
  char p[1100];
  model_path(p, sizeof(p), "share/models/kiln-tiny");
  enum { N = 500 };
  static req_spec_t rq[N];
  static req_result_t res[2][N];
  for (int32_t i = 0; i < N; i++)
    rq[i] = (req_spec_t){.prompt = COPY_TEXT,
                         .max_tokens = 3,
                         .temperature = 1.0f,
                         .top_k = 2,
                         .spec = -1,
                         .stop_token = -1,
                         .ignore_eos = true};
  run_stats_t st;
  for (int pass = 0; pass < 2; pass++) {
    for (int32_t i = 0; i < N; i++) rq[i].seed = 1000003ull * (uint64_t)(pass + 1) + (uint64_t)i;
    run(p, pass ? k_spec_on : NULL, pass ? 4 : 0, rq, N, res[pass], pass ? &st : NULL);
  }
  fprintf(stderr, "sampled distribution: %llu proposals, %llu proposed tokens, %llu accepted\n",
          (unsigned long long)st.drafts, (unsigned long long)st.draft_tokens,
          (unsigned long long)st.accepted);
  /* The outcomes: distinct 3-token outputs. */
  int32_t keys[2 * N][3], counts[2 * N][2], nk = 0;
  for (int pass = 0; pass < 2; pass++)
    for (int32_t i = 0; i < N; i++) {
      assert_int_equal(res[pass][i].n, 3);
      int32_t k = 0;
      while (k < nk && memcmp(keys[k], res[pass][i].ids, sizeof(keys[k]))) k++;
      if (k == nk) {
        memcpy(keys[nk], res[pass][i].ids, sizeof(keys[nk]));
        counts[nk][0] = counts[nk][1] = 0;
        nk++;
      }
      counts[k][pass]++;
    }
  /* Outcomes expected fewer than 5 times in a sample are pooled into one cell. */
  double chi = 0, pool[2] = {0, 0};
  int32_t cells = 0;
  for (int32_t k = 0; k < nk; k++) {
    double tot = counts[k][0] + counts[k][1], ex = tot / 2;
    if (ex < 5) {
      pool[0] += counts[k][0];
      pool[1] += counts[k][1];
      continue;
    }
    for (int s2 = 0; s2 < 2; s2++) chi += (counts[k][s2] - ex) * (counts[k][s2] - ex) / ex;
    cells++;
  }
  if (pool[0] + pool[1] >= 10) {
    double ex = (pool[0] + pool[1]) / 2;
    for (int s2 = 0; s2 < 2; s2++) chi += (pool[s2] - ex) * (pool[s2] - ex) / ex;
    cells++;
  }
  /* Critical values of chi-square at p = 0.001 for 1..8 degrees of freedom. */
  static const double crit[9] = {0, 10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12};
  int32_t df = cells - 1;
  fprintf(stderr,
          "sampled distribution: %d outcomes, %d cells, chi-square %.2f (df %d, "
          "critical %.2f)\n",
          nk, cells, chi, df, df >= 1 && df <= 8 ? crit[df] : 0.0);
  assert_true(df >= 1 && df <= 8);
  assert_true(chi < crit[df]);
  assert_true(st.accepted > 0);
  assert_true(st.accepted < st.draft_tokens); /* some rejected too */
}

/* ---- refusals ----------------------------------------------------------------------------- */

static void expect_create_error(const char *const *set, int32_t n, const char *needle) {
  char mp[1200];
  snprintf(mp, sizeof(mp), "model.path=%s/share/models/kiln-tiny", g_src);
  const char *ov[8] = {mp, "backend.name=cpu", "backend.threads=2"};
  int32_t k = 3;
  for (int32_t i = 0; i < n; i++) ov[k++] = set[i];
  kiln_engine_t *e = NULL;
  kiln_status_t st = kiln_engine_create(NULL, ov, k, &e);
  assert_non_null(st);
  if (!strstr(kiln_status_message(st), needle)) fail_msg("%s lacks %s", kiln_status_message(st), needle);
  assert_null(e);
  kiln_status_free(st);
}

static void test_refusals(void **state) {
  (void)state;
  const char *a[] = {"speculative.method=ngram", "speculative.ngram_min=5",
                     "speculative.ngram_max=3"};
  expect_create_error(a, 3, "speculative.ngram_min (5) is larger than speculative.ngram_max (3)");
  const char *b[] = {"speculative.method=eagle"};
  expect_create_error(b, 1, "method");
  const char *c[] = {"speculative.num_speculative_tokens=0"};
  expect_create_error(c, 1, "num_speculative_tokens");
  const char *d[] = {"speculative.disable_by_batch_size=0"};
  expect_create_error(d, 1, "disable_by_batch_size");

  /* Per request: k outside [-1, 32] is refused; k above the engine's (or with speculation
   * off) only caps nothing. */
  char mp[1200];
  snprintf(mp, sizeof(mp), "model.path=%s/share/models/kiln-tiny", g_src);
  for (int pass = 0; pass < 2; pass++) {
    const char *ov[] = {mp, "backend.name=cpu", "backend.threads=2",
                        pass ? "speculative.method=ngram" : "speculative.method=off"};
    kiln_engine_t *e = NULL;
    check_st(kiln_engine_create(NULL, ov, 4, &e));
    kiln_sampling_params_t p;
    kiln_sampling_params_init(&p);
    assert_int_equal(p.num_speculative_tokens, -1);
    p.temperature = 0;
    p.max_tokens = 4;
    kiln_request_desc_t dsc = {.struct_size = sizeof(dsc), .prompt = "a b a b", .params = &p};
    kiln_request_t *r = NULL;
    const int32_t badk[] = {33, -2, INT32_MIN};
    for (int i = 0; i < 3; i++) {
      p.num_speculative_tokens = badk[i];
      kiln_status_t st = kiln_engine_submit(e, &dsc, &r);
      assert_non_null(st);
      assert_non_null(strstr(kiln_status_message(st), "num_speculative_tokens"));
      kiln_status_free(st);
    }
    /* An older caller's struct ends before the field: it gets the engine's setting. */
    p.num_speculative_tokens = 99;
    p.struct_size = (uint32_t)offsetof(kiln_sampling_params_t, num_speculative_tokens);
    check_st(kiln_engine_submit(e, &dsc, &r));
    kiln_output_t *o = NULL;
    for (;;) {
      check_st(kiln_request_poll(r, -1, &o));
      assert_non_null(o);
      bool fin = o->request_finished;
      kiln_output_free(o);
      if (fin) break;
    }
    kiln_request_release(r);
    kiln_engine_destroy(e);
  }
}

int main(void) {
  const char *src = getenv("KILN_SOURCE_DIR");
  snprintf(g_src, sizeof(g_src), "%s", src ? src : "..");
  const char *quick = getenv("KILN_TEST_QUICK");
  g_quick = quick && *quick && strcmp(quick, "0") != 0;
#ifdef RUNNING_ON_VALGRIND
  if (RUNNING_ON_VALGRIND) g_quick = true;
#endif
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_ngram_propose),
      cmocka_unit_test(test_scheduler_drafts),
      cmocka_unit_test(test_default_model_alone),
      cmocka_unit_test(test_fixtures_alone),
      cmocka_unit_test(test_default_model_batch),
      cmocka_unit_test(test_sampled_distribution),
      cmocka_unit_test(test_refusals),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
