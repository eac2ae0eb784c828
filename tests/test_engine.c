/* test_engine.c - the engine's public API (include/kiln/kiln.h) on the real CPU backend
 * (KILN_TEST_BACKEND picks another, e.g. cuda on the GPU machine) with a fixture model
 * (tests/fixtures/models/llama2, float32): many requests at once give the same tokens as each one
 * alone, under KV pressure (preemption), with and without chunked prefill, with prefix-cache hits,
 * with seeded sampling in any batch; cancellation frees the blocks; bad requests are refused with
 * the numbers; every request gets exactly one final event. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "core/engine/engine_internal.h"
#include "base/json.h"
#include "base/npy.h"
#include "kiln/kiln.h"
#include "test_engine_util.h"

#define MAXTOK 128

static char g_model[1024];

typedef struct result {
  int32_t ids[4][MAXTOK];
  int32_t n[4];
  float lp[4][MAXTOK];
  int32_t top_ids[8];
  float top_lps[8];
  int32_t top_n;
  kiln_finish_reason_t fin[4];
  int32_t finished_events;
  int32_t final_events[4];
  int32_t cached;
  int32_t completion;
} result_t;

/* Creates an engine on the cpu backend with the fixture and extra overrides. */
static kiln_engine_t *make_engine(const char *const *extra, int32_t nextra) {
  const char *ov[16];
  static test_engine_base_t base;
  int32_t n = test_engine_base(&base, g_model, 2, ov);
  /* KILN_TEST_SET: more overrides, ';'-separated, e.g. a wrapper's section with
   * KILN_TEST_BACKEND=trace: "plugin.trace.backend=cpu;plugin.trace.output=/tmp/trace.txt". */
  static char more[1024];
  const char *env = getenv("KILN_TEST_SET");
  snprintf(more, sizeof(more), "%s", env ? env : "");
  char *save = NULL;
  for (char *tok = strtok_r(more, ";", &save); tok && n < 12; tok = strtok_r(NULL, ";", &save))
    ov[n++] = tok;
  for (int32_t i = 0; i < nextra; i++) ov[n++] = extra[i];
  kiln_engine_t *e = NULL;
  kiln_status_t st = kiln_engine_create(NULL, ov, n, &e);
  if (st) fprintf(stderr, "engine: %s\n", kiln_status_message(st));
  assert_null(st);
  return e;
}

/* Collects a request's events by polling until its final event. */
static void drain(kiln_request_t *r, result_t *res) {
  for (;;) {
    kiln_output_t *o;
    assert_null(kiln_request_poll(r, -1, &o));
    assert_non_null(o);
    int32_t i = o->index;
    assert_true(i >= 0 && i < 4);
    for (int32_t k = 0; k < o->num_tokens; k++) {
      assert_true(res->n[i] < MAXTOK);
      if (o->logprobs) res->lp[i][res->n[i]] = o->logprobs[k];
      if (o->top_n && i == 0 && res->n[0] == 0) {
        res->top_n = o->top_n;
        memcpy(res->top_ids, o->top_ids, (size_t)o->top_n * 4);
        memcpy(res->top_lps, o->top_logprobs, (size_t)o->top_n * 4);
      }
      res->ids[i][res->n[i]++] = o->token_ids[k];
    }
    if (o->finish_reason != KILN_FINISH_NONE) {
      res->fin[i] = o->finish_reason;
      res->final_events[i]++;
    }
    res->cached = o->usage.cached_tokens;
    res->completion = o->usage.completion_tokens;
    bool last = o->request_finished;
    kiln_output_free(o);
    if (last) break;
  }
  kiln_output_t *o = (kiln_output_t *)1;
  assert_null(kiln_request_poll(r, 0, &o));
  assert_null(o); /* nothing after the final event */
}

typedef struct job {
  int32_t prompt[MAXTOK];
  int32_t np;
  kiln_sampling_params_t p;
} job_t;

static void make_jobs(job_t *jobs, int32_t n, uint64_t seed) {
  for (int32_t j = 0; j < n; j++) {
    job_t *b = &jobs[j];
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    b->np = 3 + (int32_t)((seed >> 33) % 60);
    for (int32_t i = 0; i < b->np; i++) {
      seed = seed * 6364136223846793005ull + 1442695040888963407ull;
      b->prompt[i] = 3 + (int32_t)((seed >> 33) % 300);
    }
    kiln_sampling_params_init(&b->p);
    b->p.max_tokens = 8 + j % 9;
    b->p.ignore_eos = true;
    b->p.temperature = j % 3 == 2 ? 0.9f : 0.0f;
    b->p.has_seed = true;
    b->p.seed = 1000 + (uint64_t)j;
    b->p.logprobs = 0;
  }
}

/* Runs the jobs all at once (submitted together) or one at a time. */
static void run_jobs(kiln_engine_t *e, const job_t *jobs, int32_t n, bool together, result_t *res) {
  kiln_request_t *reqs[32];
  memset(res, 0, (size_t)n * sizeof(*res));
  for (int32_t j = 0; j < n; j++) {
    kiln_request_desc_t d = {.struct_size = sizeof(d),
                             .prompt_ids = jobs[j].prompt,
                             .num_prompt_ids = jobs[j].np,
                             .params = &jobs[j].p};
    kiln_status_t st = kiln_engine_submit(e, &d, &reqs[j]);
    if (st) fprintf(stderr, "submit: %s\n", kiln_status_message(st));
    assert_null(st);
    if (!together) {
      drain(reqs[j], &res[j]);
      kiln_request_release(reqs[j]);
    }
  }
  if (together)
    for (int32_t j = 0; j < n; j++) {
      drain(reqs[j], &res[j]);
      kiln_request_release(reqs[j]);
    }
}

static void expect_same(const result_t *a, const result_t *b, int32_t n, const char *what) {
  for (int32_t j = 0; j < n; j++) {
    if (a[j].n[0] != b[j].n[0] || memcmp(a[j].ids[0], b[j].ids[0], (size_t)a[j].n[0] * 4) != 0) {
      fprintf(stderr, "%s: request %d differs (%d vs %d tokens)\n", what, j, a[j].n[0], b[j].n[0]);
      fail();
    }
    assert_int_equal(a[j].fin[0], b[j].fin[0]);
    assert_int_equal(a[j].final_events[0], 1);
  }
}

static void expect_all_free(kiln_engine_t *e) {
  kiln_kv_manager_t *kv = kiln_engine_kv(e);
  assert_int_equal(kiln_kv_num_free(kv), kiln_kv_num_blocks(kv));
  assert_null(kiln_kv_check(kv));
}

#define NJOBS 12

/* Together vs alone; pressured pool (preemption); chunked vs not; seeded sampling in any
 * batch. */
static void test_batching_is_invisible(void **state) {
  (void)state;
  job_t jobs[NJOBS];
  make_jobs(jobs, NJOBS, 7);
  static result_t alone[NJOBS], together[NJOBS], pressured[NJOBS], unchunked[NJOBS];
  kiln_engine_t *e = make_engine(NULL, 0);
  run_jobs(e, jobs, NJOBS, false, alone);
  run_jobs(e, jobs, NJOBS, true, together);
  expect_same(alone, together, NJOBS, "together");
  expect_all_free(e);
  kiln_metrics_t m;
  kiln_engine_get_metrics(e, &m);
  assert_int_equal(m.requests_finished[KILN_FINISH_LENGTH], 2 * NJOBS);
  kiln_engine_destroy(e);

  /* 10 blocks of 16 tokens: a fraction of what 12 requests of up to 80 tokens need. Chunks of
   * 8 tokens, so prefills share steps with decodes. */
  const char *small[] = {"cache.num_blocks=10", "engine.max_num_batched_tokens=8"};
  e = make_engine(small, 2);
  run_jobs(e, jobs, NJOBS, true, pressured);
  kiln_engine_get_metrics(e, &m);
  fprintf(stderr, "pressured run: %llu preemptions, %llu steps\n",
          (unsigned long long)m.preemptions, (unsigned long long)m.steps);
  assert_true(m.preemptions > 0);
  expect_same(alone, pressured, NJOBS, "pressured");
  expect_all_free(e);
  kiln_engine_destroy(e);

  const char *noch[] = {"scheduler.enable_chunked_prefill=false",
                        "cache.enable_prefix_caching=false"};
  e = make_engine(noch, 2);
  run_jobs(e, jobs, NJOBS, true, unchunked);
  expect_same(alone, unchunked, NJOBS, "unchunked");
  expect_all_free(e);
  kiln_engine_destroy(e);
}

/* kiln_engine_hold_intake: held requests are queued but not scheduled (no step runs, no event
 * comes) until the last hold is released; then they run as if submitted together. */
static void test_intake_hold(void **state) {
  (void)state;
  job_t jobs[4];
  make_jobs(jobs, 4, 11);
  static result_t alone[4], held[4];
  kiln_engine_t *e = make_engine(NULL, 0);
  run_jobs(e, jobs, 4, false, alone);
  kiln_metrics_t m0, m1;
  kiln_engine_hold_intake(e, true);
  kiln_engine_hold_intake(e, true); /* holds count */
  kiln_request_t *reqs[4];
  for (int32_t j = 0; j < 4; j++) {
    kiln_request_desc_t d = {.struct_size = sizeof(d),
                             .prompt_ids = jobs[j].prompt,
                             .num_prompt_ids = jobs[j].np,
                             .params = &jobs[j].p};
    assert_null(kiln_engine_submit(e, &d, &reqs[j]));
  }
  kiln_engine_hold_intake(e, false);
  kiln_output_t *o = (kiln_output_t *)1;
  assert_null(kiln_request_poll(reqs[0], 200, &o));
  assert_null(o); /* still held once */
  /* and the engine idles: no step between two readings (the first one after the last step of
   * the earlier requests, which may end after their final events) */
  kiln_engine_get_metrics(e, &m0);
  assert_null(kiln_request_poll(reqs[1], 100, &o));
  assert_null(o);
  kiln_engine_get_metrics(e, &m1);
  assert_int_equal(m1.steps, m0.steps);
  kiln_engine_hold_intake(e, false);
  kiln_engine_hold_intake(e, false); /* a release without a hold does nothing */
  memset(held, 0, sizeof(held));
  for (int32_t j = 0; j < 4; j++) {
    drain(reqs[j], &held[j]);
    kiln_request_release(reqs[j]);
  }
  expect_same(alone, held, 4, "held");
  /* the intake is not left held: a new request runs */
  run_jobs(e, jobs, 1, false, held);
  expect_same(alone, held, 1, "after the hold");
  /* shutdown takes held requests: each gets its final event */
  kiln_engine_hold_intake(e, true);
  kiln_request_desc_t d = {.struct_size = sizeof(d),
                           .prompt_ids = jobs[0].prompt,
                           .num_prompt_ids = jobs[0].np,
                           .params = &jobs[0].p};
  kiln_request_t *r = NULL;
  assert_null(kiln_engine_submit(e, &d, &r));
  kiln_engine_destroy(e);
  memset(held, 0, sizeof(held));
  drain(r, &held[0]);
  kiln_request_release(r);
}

/* kiln_engine_get_info: the macro fills the whole struct; the function of that name (what a
 * program built before kv_cache_dtype existed calls) and a short size write nothing past
 * their layout. */
static void test_info_sizes(void **state) {
  (void)state;
  kiln_engine_t *e = make_engine(NULL, 0);
  kiln_engine_info_t i;
  kiln_engine_get_info(e, &i);
  assert_non_null(i.kv_cache_dtype);
  assert_true(i.kv_cache_dtype[0] != 0);
  assert_true(i.num_blocks > 0 && i.vocab_size > 0);
  const size_t old = offsetof(kiln_engine_info_t, kv_cache_dtype);
  unsigned char buf[sizeof(kiln_engine_info_t) + 16];
  memset(buf, 0xAB, sizeof(buf));
  (kiln_engine_get_info)(e, (kiln_engine_info_t *)(void *)buf);
  for (size_t k = old; k < sizeof(buf); k++) assert_int_equal(buf[k], 0xAB);
  assert_int_equal(((kiln_engine_info_t *)(void *)buf)->num_blocks, i.num_blocks);
  memset(buf, 0xAB, sizeof(buf));
  kiln_engine_get_info_sized(e, (kiln_engine_info_t *)(void *)buf, 8);
  for (size_t k = 8; k < sizeof(buf); k++) assert_int_equal(buf[k], 0xAB);
  kiln_engine_destroy(e);
}

/* [engine] warmup: the dummy requests leave no trace. The same jobs (seeded and unseeded
 * sampling: an unseeded request's seed derives from its number) give the same tokens, the
 * metrics count only them, no warm-up prefix is cached; a pool too small for the larger
 * warm-up prompts skips them. */
static void test_warmup(void **state) {
  (void)state;
  job_t jobs[NJOBS];
  make_jobs(jobs, NJOBS, 11);
  for (int32_t j = 0; j < 3; j++) {
    jobs[j].p.temperature = 0.8f;
    jobs[j].p.has_seed = false;
  }
  static result_t off[NJOBS], on[NJOBS];
  const char *o1[] = {"engine.warmup=off"}, *o2[] = {"engine.warmup=on"};
  kiln_engine_t *e = make_engine(o1, 1);
  run_jobs(e, jobs, NJOBS, true, off);
  kiln_metrics_t m_off, m_on;
  kiln_engine_get_metrics(e, &m_off);
  assert_int_equal(m_off.warmup_requests, 0);
  kiln_engine_destroy(e);
  e = make_engine(o2, 1);
  kiln_metrics_t m0;
  kiln_engine_get_metrics(e, &m0);
  assert_int_equal(m0.requests_submitted, 0);
  assert_int_equal(m0.steps, 0);
  assert_int_equal(m0.prefix_cache_queries, 0);
  /* the distinct prefill lengths that fit the fixture's context, and the sampled one */
  const uint64_t full = m0.warmup_requests;
  assert_true(full >= 3);
  assert_true(m0.warmup_seconds > 0);
  kiln_kv_stats_t ks;
  kiln_kv_stats(kiln_engine_kv(e), &ks);
  assert_int_equal(ks.num_cached, 0);
  assert_int_equal(ks.lookups, 0);
  run_jobs(e, jobs, NJOBS, true, on);
  kiln_engine_get_metrics(e, &m_on);
  expect_same(off, on, NJOBS, "warm-up");
  assert_int_equal(m_on.requests_submitted, m_off.requests_submitted);
  assert_int_equal(m_on.requests_finished[KILN_FINISH_LENGTH], NJOBS);
  assert_int_equal(m_on.prompt_tokens, m_off.prompt_tokens);
  assert_int_equal(m_on.prefix_cache_hits, m_off.prefix_cache_hits);
  expect_all_free(e);
  kiln_engine_destroy(e);
  const char *tiny[] = {"engine.warmup=on", "cache.num_blocks=3"};
  e = make_engine(tiny, 2);
  kiln_engine_get_metrics(e, &m0);
  assert_true(m0.warmup_requests >= 1 && m0.warmup_requests < full); /* the long ones skipped */
  run_jobs(e, jobs, 2, false, on);
  expect_same(off, on, 2, "warm-up, 3 blocks");
  kiln_engine_destroy(e);
}

/* A prompt served from the prefix cache gives the logprobs of a cold run. */
static void test_prefix_cache(void **state) {
  (void)state;
  kiln_engine_t *e = make_engine(NULL, 0);
  job_t j;
  make_jobs(&j, 1, 99);
  j.np = 50;
  for (int32_t i = 0; i < j.np; i++) j.prompt[i] = 10 + (i * 37) % 290;
  j.p.logprobs = 5;
  j.p.max_tokens = 4;
  result_t cold, warm;
  run_jobs(e, &j, 1, false, &cold);
  run_jobs(e, &j, 1, false, &warm);
  assert_int_equal(cold.cached, 0);
  assert_int_equal(warm.cached, 48); /* 3 full blocks of 16; the last token is recomputed */
  expect_same(&cold, &warm, 1, "prefix cache");
  assert_int_equal(cold.top_n, 5);
  for (int32_t k = 0; k < 5; k++) {
    assert_int_equal(cold.top_ids[k], warm.top_ids[k]);
    assert_true(fabsf(cold.top_lps[k] - warm.top_lps[k]) < 1e-4f);
  }
  for (int32_t t = 0; t < cold.n[0]; t++) assert_true(fabsf(cold.lp[0][t] - warm.lp[0][t]) < 1e-4f);
  /* The logprobs are log-probabilities: the top one is the greedy token's. */
  assert_int_equal(cold.top_ids[0], cold.ids[0][0]);
  assert_true(cold.top_lps[0] <= 0 && cold.top_lps[0] >= cold.top_lps[1]);
  kiln_metrics_t m;
  kiln_engine_get_metrics(e, &m);
  assert_true(m.prefix_cache_hits >= 48);
  kiln_engine_destroy(e);
}

/* n > 1: forked sequences share the prompt, each follows its own generator. */
static void test_n_sequences(void **state) {
  (void)state;
  kiln_engine_t *e = make_engine(NULL, 0);
  job_t j;
  make_jobs(&j, 1, 5);
  j.p.n = 3;
  j.p.temperature = 1.0f;
  j.p.max_tokens = 12;
  result_t a, b;
  run_jobs(e, &j, 1, false, &a);
  run_jobs(e, &j, 1, false, &b);
  assert_int_equal(a.completion, 36);
  for (int32_t i = 0; i < 3; i++) {
    assert_int_equal(a.n[i], 12);
    assert_int_equal(a.final_events[i], 1);
    assert_memory_equal(a.ids[i], b.ids[i], 12 * 4); /* seeded: reproducible */
  }
  assert_true(memcmp(a.ids[0], a.ids[1], 48) != 0 || memcmp(a.ids[1], a.ids[2], 48) != 0);
  expect_all_free(e);
  kiln_engine_destroy(e);
}

typedef struct cb_state {
  pthread_mutex_t mu;
  int32_t events, finals, tokens;
  kiln_finish_reason_t fin;
  bool cancel_at_first;
} cb_state_t;

static void on_out(void *user, const kiln_output_t *o) {
  cb_state_t *c = user;
  pthread_mutex_lock(&c->mu);
  c->events++;
  c->tokens += o->num_tokens;
  if (c->cancel_at_first && c->events == 1) kiln_request_cancel(o->request);
  if (o->request_finished) {
    c->finals++;
    c->fin = o->finish_reason;
  }
  pthread_mutex_unlock(&c->mu);
}

/* Cancel frees the blocks; callbacks see exactly one final event; destroy ends the rest. */
static void test_cancel_and_shutdown(void **state) {
  (void)state;
  kiln_engine_t *e = make_engine(NULL, 0);
  job_t j;
  make_jobs(&j, 1, 3);
  j.p.max_tokens = 100;
  kiln_request_desc_t d = {
      .struct_size = sizeof(d), .prompt_ids = j.prompt, .num_prompt_ids = 10, .params = &j.p};
  kiln_request_t *r;
  /* Cancelled from its first event's callback: it ends at the next step with ABORT. */
  cb_state_t cs;
  memset(&cs, 0, sizeof(cs));
  pthread_mutex_init(&cs.mu, NULL);
  cs.cancel_at_first = true;
  d.on_output = on_out;
  d.user = &cs;
  assert_null(kiln_engine_submit(e, &d, &r));
  kiln_output_t *o = NULL;
  kiln_status_t pst = kiln_request_poll(r, 0, &o); /* callback requests cannot be polled */
  assert_non_null(pst);
  kiln_status_free(pst);
  for (int i = 0; i < 2000; i++) {
    pthread_mutex_lock(&cs.mu);
    int32_t f = cs.finals;
    pthread_mutex_unlock(&cs.mu);
    if (f) break;
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  assert_int_equal(cs.finals, 1);
  assert_int_equal(cs.fin, KILN_FINISH_ABORT);
  assert_true(cs.tokens <= 2);
  kiln_request_release(r);
  expect_all_free(e);
  /* Callback requests left running when the engine is destroyed end with ABORT. */
  memset(&cs.events, 0, sizeof(cs) - offsetof(cb_state_t, events));
  for (int32_t i = 0; i < 4; i++) {
    assert_null(kiln_engine_submit(e, &d, &r));
    kiln_request_release(r);
  }
  kiln_engine_destroy(e);
  assert_int_equal(cs.finals, 4);
  pthread_mutex_destroy(&cs.mu);
}

static void expect_refused(kiln_engine_t *e, const int32_t *ids, int32_t n,
                           const kiln_sampling_params_t *p, const char *text, const char *needle) {
  kiln_request_desc_t d = {.struct_size = sizeof(d),
                           .prompt_ids = ids,
                           .num_prompt_ids = n,
                           .params = p,
                           .prompt = text};
  kiln_request_t *r = NULL;
  kiln_status_t st = kiln_engine_submit(e, &d, &r);
  assert_non_null(st);
  assert_null(r);
  if (!strstr(kiln_status_message(st), needle)) {
    fprintf(stderr, "expected '%s' in: %s\n", needle, kiln_status_message(st));
    fail();
  }
  kiln_status_free(st);
}

static void test_refusals(void **state) {
  (void)state;
  const char *ov[] = {"cache.num_blocks=4", "engine.max_num_seqs=4"};
  kiln_engine_t *e = make_engine(ov, 2);
  int32_t ids[200];
  for (int32_t i = 0; i < 200; i++) ids[i] = 5 + i;
  kiln_sampling_params_t p;
  kiln_sampling_params_init(&p);
  expect_refused(e, ids, 0, &p, NULL, "empty");
  expect_refused(e, ids, 130, &p, NULL, "context of 128");
  p.max_tokens = 100;
  expect_refused(e, ids, 40, &p, NULL, "140 in all");
  p.max_tokens = 60;
  expect_refused(e, ids, 10, &p, NULL, "the pool has 4"); /* 70 tokens = 5 blocks of 16 */
  kiln_sampling_params_init(&p);
  int32_t bad[2] = {5, 320};
  expect_refused(e, bad, 2, &p, NULL, "outside the vocabulary");
  p.top_p = 0;
  expect_refused(e, ids, 3, &p, NULL, "top_p");
  kiln_sampling_params_init(&p);
  p.n = 5;
  expect_refused(e, ids, 3, &p, NULL, "n must be in [1, 4]");
  kiln_sampling_params_init(&p);
  p.temperature = -1;
  expect_refused(e, ids, 3, &p, NULL, "temperature");
  kiln_sampling_params_init(&p);
  expect_refused(e, NULL, 0, &p, "hello", "needs a tokenizer");
  kiln_metrics_t m;
  kiln_engine_get_metrics(e, &m);
  assert_int_equal(m.requests_rejected, 9);
  char *text = kiln_metrics_prometheus(&m, "llama2");
  assert_non_null(text);
  assert_non_null(strstr(text, "kiln:requests_rejected_total"));
  free(text);
  kiln_engine_destroy(e);
  /* Engine creation errors. */
  const char *nomodel[] = {"model.path=/nonexistent/model"};
  kiln_engine_t *e2 = NULL;
  kiln_status_t st = kiln_engine_create(NULL, nomodel, 1, &e2);
  assert_non_null(st);
  assert_null(e2);
  kiln_status_free(st);
}

static int32_t *json_ids(const kiln_json_t *a, int32_t *out_n) {
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

/* The engine against transformers' own numbers on the fixture: prompt logprobs (and their
 * top-3) against log_softmax of transformers' logits, and the greedy continuation against
 * transformers' generate. */
static void test_against_transformers(void **state) {
  (void)state;
  char path[1200];
  snprintf(path, sizeof(path), "%s/reference.json", g_model);
  kiln_json_doc_t *doc;
  assert_null(kiln_json_parse_file(path, &doc));
  const kiln_json_t *ref = kiln_json_root(doc);
  int32_t np, ngp, ngt;
  int32_t *prompt = json_ids(kiln_json_get(ref, "prompt_ids"), &np);
  const kiln_json_t *g = kiln_json_get(ref, "greedy");
  int32_t *gprompt = json_ids(kiln_json_get(g, "prompt_ids"), &ngp);
  int32_t *gwant = json_ids(kiln_json_get(g, "token_ids"), &ngt);
  float *logits;
  int64_t rows, V;
  snprintf(path, sizeof(path), "%s/logits.npy", g_model);
  assert_null(kiln_npy_read_f32(path, &logits, &rows, &V));
  assert_int_equal(rows, np);
  kiln_sampling_params_t p;
  /* Whole prompt in one step and 1 token; then in 8-token chunks and 3 tokens. */
  const char *chunked[] = {"engine.max_num_batched_tokens=8"};
  kiln_engine_t *e = NULL;
  for (int variant = 0; variant < 2; variant++) {
    if (e) kiln_engine_destroy(e);
    e = make_engine(variant ? chunked : NULL, variant ? 1 : 0);
    kiln_sampling_params_init(&p);
    p.max_tokens = variant ? 3 : 1;
    p.temperature = 0;
    p.prompt_logprobs = 3;
    kiln_request_desc_t d = {
        .struct_size = sizeof(d), .prompt_ids = prompt, .num_prompt_ids = np, .params = &p};
    kiln_request_t *r;
    assert_null(kiln_engine_submit(e, &d, &r));
    int32_t seen = 0;
    for (;;) {
      kiln_output_t *o;
      assert_null(kiln_request_poll(r, -1, &o));
      if (o->num_prompt_logprobs) {
        assert_int_equal(o->num_prompt_logprobs, np - 1);
        assert_int_equal(o->prompt_top_n, 3);
        for (int32_t i = 0; i + 1 < np; i++) {
          const float *row = logits + (size_t)i * (size_t)V;
          double mx = row[0], sum = 0;
          for (int64_t v = 1; v < V; v++) mx = row[v] > mx ? row[v] : mx;
          for (int64_t v = 0; v < V; v++) sum += exp((double)row[v] - mx);
          double lse = mx + log(sum);
          double want = (double)row[prompt[i + 1]] - lse;
          assert_true(fabs(want - (double)o->prompt_logprobs[i]) < 2e-4);
          for (int32_t k = 0; k < 3; k++) {
            int32_t id = o->prompt_top_ids[i * 3 + k];
            assert_true(fabs((double)row[id] - lse - (double)o->prompt_top_logprobs[i * 3 + k]) <
                        2e-4);
            if (k)
              assert_true(o->prompt_top_logprobs[i * 3 + k] <=
                          o->prompt_top_logprobs[i * 3 + k - 1]);
          }
          seen++;
        }
      }
      bool last = o->request_finished;
      kiln_output_free(o);
      if (last) break;
    }
    assert_int_equal(seen, np - 1);
    kiln_request_release(r);
  }
  /* Greedy continuation = transformers' generate (the fixture's margins are >= 0.04). */
  kiln_sampling_params_init(&p);
  p.max_tokens = ngt;
  p.temperature = 0;
  p.ignore_eos = true;
  job_t j;
  memset(&j, 0, sizeof(j));
  memcpy(j.prompt, gprompt, (size_t)ngp * 4);
  j.np = ngp;
  j.p = p;
  result_t res;
  run_jobs(e, &j, 1, false, &res);
  assert_int_equal(res.n[0], ngt);
  assert_memory_equal(res.ids[0], gwant, (size_t)ngt * 4);
  kiln_engine_destroy(e);
  free(logits);
  free(prompt);
  free(gprompt);
  free(gwant);
  kiln_json_doc_free(doc);
}

/* A GGUF file through the engine: the greedy continuation transformers computed from exactly
 * the dequantized weights (F16/BF16/Q8_0/F32 tensors, permuted q/k, rope_freqs). */
static void test_gguf(void **state) {
  (void)state;
  const char *src = getenv("KILN_SOURCE_DIR");
  char dir[1200], path[1300], mp[1300];
  snprintf(dir, sizeof(dir), "%s/tests/fixtures/models/llama3_gguf", src ? src : "..");
  snprintf(path, sizeof(path), "%s/reference.json", dir);
  kiln_json_doc_t *doc;
  assert_null(kiln_json_parse_file(path, &doc));
  const kiln_json_t *g = kiln_json_get(kiln_json_root(doc), "greedy");
  int32_t np, nt;
  int32_t *prompt = json_ids(kiln_json_get(g, "prompt_ids"), &np);
  int32_t *want = json_ids(kiln_json_get(g, "token_ids"), &nt);
  snprintf(mp, sizeof(mp), "model.path=%s/model.gguf", dir);
  const char *ov[] = {mp, "backend.name=cpu", "model.dtype=float32"};
  kiln_engine_t *e = NULL;
  kiln_status_t st = kiln_engine_create(NULL, ov, 3, &e);
  if (st) fprintf(stderr, "%s\n", kiln_status_message(st));
  assert_null(st);
  job_t j;
  memset(&j, 0, sizeof(j));
  memcpy(j.prompt, prompt, (size_t)np * 4);
  j.np = np;
  kiln_sampling_params_init(&j.p);
  j.p.max_tokens = nt;
  j.p.temperature = 0;
  j.p.ignore_eos = true;
  result_t res;
  run_jobs(e, &j, 1, false, &res);
  assert_int_equal(res.n[0], nt);
  assert_memory_equal(res.ids[0], want, (size_t)nt * 4);
  kiln_engine_destroy(e);
  free(prompt);
  free(want);
  kiln_json_doc_free(doc);
}

typedef struct thread_job {
  kiln_engine_t *e;
  const job_t *jobs;
  int32_t n;
  result_t *res;
} thread_job_t;

static void *submit_thread(void *arg) {
  thread_job_t *t = arg;
  kiln_request_t *reqs[8];
  for (int32_t j = 0; j < t->n; j++) {
    kiln_request_desc_t d = {.struct_size = sizeof(d),
                             .prompt_ids = t->jobs[j].prompt,
                             .num_prompt_ids = t->jobs[j].np,
                             .params = &t->jobs[j].p};
    if (kiln_engine_submit(t->e, &d, &reqs[j])) return (void *)1;
  }
  for (int32_t j = 0; j < t->n; j++) {
    drain(reqs[j], &t->res[j]);
    kiln_request_release(reqs[j]);
  }
  return NULL;
}

/* Four threads submit and drain at once: each request still gets its own-alone tokens. */
static void test_threads(void **state) {
  (void)state;
  enum { NT = 4, PER = 6 };
  static job_t jobs[NT * PER];
  static result_t alone[NT * PER], multi[NT * PER];
  make_jobs(jobs, NT * PER, 11);
  kiln_engine_t *e = make_engine(NULL, 0);
  run_jobs(e, jobs, NT * PER, false, alone);
  memset(multi, 0, sizeof(multi));
  pthread_t th[NT];
  thread_job_t tj[NT];
  for (int32_t t = 0; t < NT; t++) {
    tj[t] = (thread_job_t){.e = e, .jobs = jobs + t * PER, .n = PER, .res = multi + t * PER};
    assert_int_equal(pthread_create(&th[t], NULL, submit_thread, &tj[t]), 0);
  }
  for (int32_t t = 0; t < NT; t++) {
    void *rv;
    pthread_join(th[t], &rv);
    assert_null(rv);
  }
  expect_same(alone, multi, NT * PER, "threads");
  expect_all_free(e);
  kiln_engine_destroy(e);
}

/* Stop strings and streamed text through the API, on the embedded default model (which has a
 * tokenizer): the streamed deltas add up to the text, cut before the stop string. */
static void test_stop_strings(void **state) {
  (void)state;
  const char *src = getenv("KILN_SOURCE_DIR");
  char mp[1200];
  snprintf(mp, sizeof(mp), "model.path=%s/share/models/kiln-tiny", src ? src : "..");
  const char *ov[] = {mp, "backend.name=cpu", "model.dtype=float32", "backend.threads=2"};
  kiln_engine_t *e = NULL;
  kiln_status_t st = kiln_engine_create(NULL, ov, 4, &e);
  if (st) {
    fprintf(stderr, "%s\n", kiln_status_message(st));
    kiln_status_free(st);
    fail();
  }
  kiln_engine_info_t info;
  kiln_engine_get_info(e, &info);
  assert_true(info.has_tokenizer);
  /* First the full greedy text, then the same with a stop string taken from its middle. */
  char full[4096] = "", cut[4096] = "";
  const char *stop_str = NULL;
  char stop_buf[64];
  for (int pass = 0; pass < 2; pass++) {
    kiln_sampling_params_t p;
    kiln_sampling_params_init(&p);
    p.max_tokens = 40;
    p.temperature = 0;
    p.ignore_eos = true;
    const char *stops[1] = {stop_buf};
    if (pass == 1) {
      p.stop = stops;
      p.num_stop = 1;
    }
    kiln_request_desc_t d = {.struct_size = sizeof(d), .prompt = "Once upon a time", .params = &p};
    kiln_request_t *r;
    assert_null(kiln_engine_submit(e, &d, &r));
    char *out = pass ? cut : full;
    for (;;) {
      kiln_output_t *o;
      assert_null(kiln_request_poll(r, -1, &o));
      strncat(out, o->text, 4095 - strlen(out));
      if (o->request_finished) {
        assert_int_equal(o->finish_reason, pass ? KILN_FINISH_STOP : KILN_FINISH_LENGTH);
        if (pass) {
          assert_non_null(o->stop_str);
          assert_string_equal(o->stop_str, stop_buf);
          stop_str = o->stop_str;
        }
      }
      bool last = o->request_finished;
      kiln_output_free(o);
      if (last) break;
    }
    kiln_request_release(r);
    if (pass == 0) {
      /* A stop string from the middle of the text: 4 bytes starting a third of the way in. */
      size_t n = strlen(full);
      assert_true(n > 12);
      size_t at = n / 3;
      snprintf(stop_buf, sizeof(stop_buf), "%.4s", full + at);
    }
  }
  (void)stop_str;
  const char *hit = strstr(full, stop_buf);
  assert_non_null(hit);
  assert_int_equal(strlen(cut), (size_t)(hit - full));
  assert_memory_equal(cut, full, strlen(cut));
  /* The API's tokenizer round trip. */
  int32_t *ids = NULL, n = 0;
  assert_null(kiln_engine_tokenize(e, "Once upon a time", 16, true, &ids, &n));
  char *text = NULL;
  assert_null(kiln_engine_detokenize(e, ids, (size_t)n, true, &text));
  assert_string_equal(text, "Once upon a time");
  free(ids);
  free(text);
  kiln_engine_destroy(e);
}

/* The chat template through the public API, and poll mode's on_queued wake-up: one thread
 * waits on its own condition variable for two requests at once. */
typedef struct waker {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int wakes;
} waker_t;

static void on_queued(void *user) {
  waker_t *w = user;
  pthread_mutex_lock(&w->mu);
  w->wakes++;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
}

static void test_chat_and_notify(void **state) {
  (void)state;
  const char *src = getenv("KILN_SOURCE_DIR");
  char mp[1200];
  snprintf(mp, sizeof(mp), "model.path=%s/share/models/kiln-tiny", src ? src : "..");
  const char *ov[] = {mp, "backend.name=cpu", "backend.threads=2"};
  kiln_engine_t *e = NULL;
  kiln_status_t st = kiln_engine_create(NULL, ov, 3, &e);
  if (st) fail_msg("%s", kiln_status_message(st));
  static const char msgs[] = "[{\"role\": \"system\", \"content\": \"Be brief.\"}, "
                             "{\"role\": \"user\", \"content\": \"Hi!\"}]";
  kiln_chat_args_t a = {msgs, strlen(msgs), NULL, 0, NULL, 0, true};
  char *prompt = NULL;
  size_t plen = 0;
  assert_null(kiln_engine_apply_chat_template(e, &a, &prompt, &plen));
  /* what transformers' apply_chat_template renders with kiln-tiny's ChatML template */
  assert_string_equal(prompt, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!"
                              "<|im_end|>\n<|im_start|>assistant\n");
  assert_int_equal(plen, strlen(prompt));
  free(prompt);
  a.add_generation_prompt = false;
  assert_null(kiln_engine_apply_chat_template(e, &a, &prompt, NULL));
  assert_null(strstr(prompt, "assistant"));
  free(prompt);
  /* malformed messages and wrong argument types are errors, not crashes */
  a.messages_json = "[{";
  a.messages_len = 2;
  st = kiln_engine_apply_chat_template(e, &a, &prompt, NULL);
  assert_non_null(st);
  assert_null(prompt);
  assert_non_null(strstr(kiln_status_message(st), "messages"));
  kiln_status_free(st);
  a.messages_json = msgs;
  a.messages_len = strlen(msgs);
  a.extra_json = "[1]";
  a.extra_len = 3;
  st = kiln_engine_apply_chat_template(e, &a, &prompt, NULL);
  assert_non_null(st);
  assert_non_null(strstr(kiln_status_message(st), "chat_template_kwargs"));
  kiln_status_free(st);
  /* a message without content: the template fails inside; the error says so */
  static const char bad[] = "[{\"role\": \"user\"}]";
  kiln_chat_args_t b = {bad, strlen(bad), NULL, 0, NULL, 0, true};
  st = kiln_engine_apply_chat_template(e, &b, &prompt, NULL);
  assert_non_null(st);
  kiln_status_free(st);

  waker_t w = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
  kiln_sampling_params_t p;
  kiln_sampling_params_init(&p);
  p.max_tokens = 8;
  p.ignore_eos = true;
  kiln_request_t *r[2];
  for (int i = 0; i < 2; i++) {
    kiln_request_desc_t d = {.struct_size = sizeof(d), .prompt = i ? "The cat" : "Once upon",
                             .params = &p, .user = &w, .on_queued = on_queued};
    assert_null(kiln_engine_submit(e, &d, &r[i]));
  }
  int events = 0, done = 0;
  bool finished[2] = {false, false};
  while (done < 2) {
    int got = 0;
    for (int i = 0; i < 2; i++) {
      kiln_output_t *o = NULL;
      while (!finished[i] && !kiln_request_poll(r[i], 0, &o) && o) {
        got++;
        events++;
        if (o->request_finished) {
          finished[i] = true;
          done++;
        }
        kiln_output_free(o);
      }
    }
    if (got) continue;
    pthread_mutex_lock(&w.mu);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += 10; /* a missed wake-up fails the test instead of hanging it */
    int before = w.wakes;
    while (w.wakes == before && done < 2) {
      if (pthread_cond_timedwait(&w.cv, &w.mu, &ts)) {
        bool pending = false;
        for (int i = 0; i < 2; i++) {
          kiln_output_t *o = NULL;
          if (!finished[i] && !kiln_request_poll(r[i], 0, &o) && o) {
            pending = true;
            kiln_output_free(o);
          }
        }
        pthread_mutex_unlock(&w.mu);
        fail_msg("no wake-up in 10 s (an event was %s)", pending ? "queued" : "not queued");
      }
    }
    pthread_mutex_unlock(&w.mu);
  }
  assert_true(events >= 2);
  assert_true(w.wakes >= events); /* one wake-up per queued event */
  kiln_request_release(r[0]);
  kiln_request_release(r[1]);
  kiln_engine_destroy(e);
}

int main(void) {
  const char *src = getenv("KILN_SOURCE_DIR");
  snprintf(g_model, sizeof(g_model), "%s/tests/fixtures/models/llama2", src ? src : "..");
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_batching_is_invisible),
      cmocka_unit_test(test_intake_hold),
      cmocka_unit_test(test_info_sizes),
      cmocka_unit_test(test_prefix_cache),
      cmocka_unit_test(test_warmup),
      cmocka_unit_test(test_n_sequences),
      cmocka_unit_test(test_cancel_and_shutdown),
      cmocka_unit_test(test_refusals),
      cmocka_unit_test(test_against_transformers),
      cmocka_unit_test(test_threads),
      cmocka_unit_test(test_gguf),
      cmocka_unit_test(test_stop_strings),
      cmocka_unit_test(test_chat_and_notify),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
