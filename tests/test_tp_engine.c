/* test_tp_engine.c - tensor parallelism in the engine ([parallel] tensor_parallel_size;
 * core/engine/runner.c's TP runner, docs/parallel.md "Engine"), through the public API
 * (include/kiln/kiln.h) on the cpu backend, ranks as threads over the cpu backend's
 * shared-memory collectives:
 *   parity      several greedy requests batched together (prompts of 3..40 tokens, up to 14
 *               new tokens) give exactly the TP=1 tokens at TP=2 and TP=4, and their sampled
 *               token's logprob and first-token top-5 logprobs within 1e-4, on llama2 (KV heads
 *               split) and qwen2_bf16 (2 KV heads: split at TP=2, replicated at TP=4; biases)
 *   pressure    a pool of 10 blocks with 8-token chunks (preemption, prefills sharing steps)
 *               and prompts sharing a 32-token prefix (prefix-cache hits, copy-on-write free
 *               blocks): TP=2 gives the tokens of a roomy TP=1 run, every block comes back
 *   draft       speculative decoding with a draft model (unsharded, on rank 0) under TP=2 gives
 *               the plain TP=1 tokens
 *   refusals    tensor_parallel_size = 3 with 4 heads, a vision tower, a GGUF file: the
 *               model layer's errors reach kiln_engine_create, naming tensor_parallel_size
 * Can it fail? A rank that misses a forward or a block copy, runs another batch, or whose KV
 * cache has another block count makes the ranks' all_reduce sums wrong (or the collectives
 * mismatch and fail the step), which changes these random fixtures' logits by a large fraction
 * (test_tp.c measures the shards themselves); only the summation order differs in a correct
 * run (1e-6 of logits of ~2.4), far from the gaps between the greedy tokens here.
 * KILN_TEST_BACKEND picks another backend (cuda on a machine with GPUs: rank r on device r) and
 * KILN_TEST_MAX_TP the largest world run (default 4; the cases above it are skipped). */
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
#include "kiln/kiln.h"
#include "test_engine_util.h"

#define MAXTOK 96
#define NJOBS 6
#define TOP 5

static char g_src[1024];

typedef struct result {
  int32_t ids[MAXTOK];
  float lp[MAXTOK];
  int32_t n;
  int32_t top_ids[TOP];
  float top_lps[TOP];
  int32_t top_n;
  int32_t cached;
} result_t;

typedef struct job {
  int32_t prompt[MAXTOK];
  int32_t np;
  kiln_sampling_params_t p;
} job_t;

static kiln_status_t try_engine(const char *model, int32_t tp, const char *const *extra,
                                int32_t nextra, kiln_engine_t **out) {
  const char *ov[16];
  char path[1100], tps[64];
  snprintf(path, sizeof(path), "%s/%s", g_src, model);
  snprintf(tps, sizeof(tps), "parallel.tensor_parallel_size=%d", (int)tp);
  test_engine_base_t base;
  int32_t n = test_engine_base(&base, path, 1, ov); /* 1 thread: N ranks share the cores */
  ov[n++] = tps;
  if (getenv("KILN_TEST_VERBOSE")) ov[n++] = "log.level=info";
  for (int32_t i = 0; i < nextra; i++) ov[n++] = extra[i];
  return kiln_engine_create(NULL, ov, n, out);
}

static kiln_engine_t *make_engine(const char *model, int32_t tp, const char *const *extra,
                                  int32_t nextra) {
  kiln_engine_t *e = NULL;
  kiln_status_t st = try_engine(model, tp, extra, nextra, &e);
  if (st) fail_msg("engine (%s, TP=%d): %s", model, (int)tp, kiln_status_message(st));
  return e;
}

static void drain(kiln_request_t *r, result_t *res) {
  for (;;) {
    kiln_output_t *o;
    assert_null(kiln_request_poll(r, -1, &o));
    assert_non_null(o);
    if (o->finish_reason == KILN_FINISH_ERROR) fail_msg("request failed: %s", o->error);
    for (int32_t k = 0; k < o->num_tokens; k++) {
      assert_true(res->n < MAXTOK);
      if (o->logprobs) res->lp[res->n] = o->logprobs[k];
      if (o->top_n && res->n == 0) {
        res->top_n = o->top_n < TOP ? o->top_n : TOP;
        memcpy(res->top_ids, o->top_ids + (size_t)k * (size_t)o->top_n, (size_t)res->top_n * 4);
        memcpy(res->top_lps, o->top_logprobs + (size_t)k * (size_t)o->top_n,
               (size_t)res->top_n * 4);
      }
      res->ids[res->n++] = o->token_ids[k];
    }
    res->cached = o->usage.cached_tokens;
    bool last = o->request_finished;
    kiln_output_free(o);
    if (last) break;
  }
}

/* Greedy jobs over the fixtures' 320-token vocabulary; with shared > 0 every prompt starts
 * with the same `shared` tokens (prefix-cache hits). */
static void make_jobs(job_t *jobs, int32_t n, uint64_t seed, int32_t shared) {
  for (int32_t j = 0; j < n; j++) {
    job_t *b = &jobs[j];
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    b->np = shared + 3 + (int32_t)((seed >> 33) % 38);
    for (int32_t i = 0; i < b->np; i++) {
      seed = seed * 6364136223846793005ull + 1442695040888963407ull;
      b->prompt[i] = i < shared ? 5 + (i * 53) % 300 : 3 + (int32_t)((seed >> 33) % 310);
    }
    kiln_sampling_params_init(&b->p);
    b->p.max_tokens = 6 + j % 9 + (shared ? 12 : 0);
    b->p.ignore_eos = true;
    b->p.temperature = 0.0f;
    b->p.logprobs = TOP;
  }
}

/* Submits every job at once, so they run batched. */
static void run_jobs(kiln_engine_t *e, const job_t *jobs, int32_t n, result_t *res) {
  kiln_request_t *reqs[NJOBS * 2];
  memset(res, 0, (size_t)n * sizeof(*res));
  for (int32_t j = 0; j < n; j++) {
    kiln_request_desc_t d = {.struct_size = sizeof(d),
                             .prompt_ids = jobs[j].prompt,
                             .num_prompt_ids = jobs[j].np,
                             .params = &jobs[j].p};
    kiln_status_t st = kiln_engine_submit(e, &d, &reqs[j]);
    if (st) fail_msg("submit: %s", kiln_status_message(st));
  }
  for (int32_t j = 0; j < n; j++) {
    drain(reqs[j], &res[j]);
    kiln_request_release(reqs[j]);
  }
}

static void expect_same(const result_t *ref, const result_t *got, int32_t n, bool logprobs,
                        const char *what) {
  for (int32_t j = 0; j < n; j++) {
    if (ref[j].n != got[j].n || memcmp(ref[j].ids, got[j].ids, (size_t)ref[j].n * 4) != 0) {
      for (int32_t t = 0; t < ref[j].n || t < got[j].n; t++)
        fprintf(stderr, "  %d: %d %d\n", (int)t, t < ref[j].n ? ref[j].ids[t] : -1,
                t < got[j].n ? got[j].ids[t] : -1);
      fail_msg("%s: request %d's tokens differ from TP=1's (%d vs %d tokens)", what, (int)j,
               (int)ref[j].n, (int)got[j].n);
    }
    if (!logprobs) continue;
    for (int32_t t = 0; t < ref[j].n; t++)
      if (!(fabsf(ref[j].lp[t] - got[j].lp[t]) < 1e-4f))
        fail_msg("%s: request %d token %d: logprob %.7f, TP=1 %.7f", what, (int)j, (int)t,
                 (double)got[j].lp[t], (double)ref[j].lp[t]);
    assert_int_equal(ref[j].top_n, TOP);
    assert_int_equal(got[j].top_n, TOP);
    for (int32_t k = 0; k < TOP; k++) {
      assert_int_equal(ref[j].top_ids[k], got[j].top_ids[k]);
      if (!(fabsf(ref[j].top_lps[k] - got[j].top_lps[k]) < 1e-4f))
        fail_msg("%s: request %d top %d: logprob %.7f, TP=1 %.7f", what, (int)j, (int)k,
                 (double)got[j].top_lps[k], (double)ref[j].top_lps[k]);
    }
  }
}

static void expect_all_free(kiln_engine_t *e) {
  kiln_kv_manager_t *kv = kiln_engine_kv(e);
  assert_int_equal(kiln_kv_num_free(kv), kiln_kv_num_blocks(kv));
  assert_null(kiln_kv_check(kv));
}

static int32_t max_tp(void) {
  const char *v = getenv("KILN_TEST_MAX_TP");
  return v && atoi(v) > 0 ? atoi(v) : 4;
}

static void parity(const char *model) {
  job_t jobs[NJOBS];
  make_jobs(jobs, NJOBS, 11, 0);
  static result_t ref[NJOBS], got[NJOBS];
  kiln_engine_t *e = make_engine(model, 1, NULL, 0);
  run_jobs(e, jobs, NJOBS, ref);
  kiln_engine_destroy(e);
  static const int32_t worlds[] = {2, 4};
  for (size_t w = 0; w < sizeof(worlds) / sizeof(worlds[0]) && worlds[w] <= max_tp(); w++) {
    char what[64];
    snprintf(what, sizeof(what), "%s TP=%d", model, (int)worlds[w]);
    e = make_engine(model, worlds[w], NULL, 0);
    run_jobs(e, jobs, NJOBS, got);
    expect_same(ref, got, NJOBS, true, what);
    expect_all_free(e);
    kiln_engine_destroy(e);
  }
}

static void test_parity_llama2(void **state) {
  (void)state;
  parity("llama2");
}

static void test_parity_qwen2(void **state) {
  (void)state;
  parity("qwen2_bf16");
}

/* Preemption, chunked prefill and prefix caching under TP=2: the tokens of a roomy TP=1 run. */
static void test_pressure(void **state) {
  (void)state;
  enum { N = 8 };
  job_t jobs[N];
  make_jobs(jobs, N, 5, 32);
  static result_t ref[N], got[N];
  kiln_engine_t *e = make_engine("llama2", 1, NULL, 0);
  run_jobs(e, jobs, N, ref);
  kiln_engine_destroy(e);
  const char *small[] = {"cache.num_blocks=14", "cache.block_size=8",
                         "engine.max_num_batched_tokens=8", "cache.enable_prefix_caching=true"};
  e = make_engine("llama2", 2, small, 4);
  kiln_engine_info_t info;
  kiln_engine_get_info(e, &info);
  assert_int_equal(info.num_blocks, 14);
  run_jobs(e, jobs, N, got);
  /* And again: the shared prefix (and whatever survived) comes from the cache. */
  static result_t again[N];
  run_jobs(e, jobs, N, again);
  kiln_metrics_t m;
  kiln_engine_get_metrics(e, &m);
  fprintf(stderr, "TP=2 pressured: %llu preemptions, %llu prefix-cache hit tokens, %llu steps\n",
          (unsigned long long)m.preemptions, (unsigned long long)m.prefix_cache_hits,
          (unsigned long long)m.steps);
  assert_true(m.preemptions > 0);
  assert_true(m.prefix_cache_hits > 0);
  expect_same(ref, got, N, false, "TP=2 pressured");
  expect_same(ref, again, N, false, "TP=2 pressured, again");
  expect_all_free(e);
  kiln_engine_destroy(e);
}

/* n = 3 seeded samples of one prompt of 21 tokens: the forks share its partial last block,
 * so the first decode step copies it (copy-on-write on every rank). The tokens are TP=1's. */
static void run_fork(const char *model, int32_t tp, int32_t ids[3][MAXTOK], int32_t *n) {
  int32_t prompt[21];
  for (int32_t i = 0; i < 21; i++) prompt[i] = 7 + (i * 29) % 300;
  kiln_sampling_params_t p;
  kiln_sampling_params_init(&p);
  p.n = 3;
  p.temperature = 1.0f;
  p.has_seed = true;
  p.seed = 3;
  p.max_tokens = 10;
  p.ignore_eos = true;
  kiln_engine_t *e = make_engine(model, tp, NULL, 0);
  kiln_request_desc_t d = {
      .struct_size = sizeof(d), .prompt_ids = prompt, .num_prompt_ids = 21, .params = &p};
  kiln_request_t *r = NULL;
  assert_null(kiln_engine_submit(e, &d, &r));
  memset(n, 0, 3 * sizeof(*n));
  for (;;) {
    kiln_output_t *o;
    assert_null(kiln_request_poll(r, -1, &o));
    assert_non_null(o);
    assert_true(o->index >= 0 && o->index < 3);
    for (int32_t k = 0; k < o->num_tokens && n[o->index] < MAXTOK; k++)
      ids[o->index][n[o->index]++] = o->token_ids[k];
    bool last = o->request_finished;
    kiln_output_free(o);
    if (last) break;
  }
  kiln_request_release(r);
  expect_all_free(e);
  kiln_engine_destroy(e);
}

static void test_fork(void **state) {
  (void)state;
  static int32_t ref[3][MAXTOK], got[3][MAXTOK];
  int32_t nref[3], ngot[3];
  run_fork("llama2", 1, ref, nref);
  run_fork("llama2", 2, got, ngot);
  for (int32_t i = 0; i < 3; i++) {
    assert_int_equal(nref[i], 10);
    assert_int_equal(ngot[i], 10);
    if (memcmp(ref[i], got[i], 10 * 4) != 0)
      fail_msg("sample %d of n = 3 differs between TP=2 and TP=1", (int)i);
  }
  assert_true(memcmp(ref[0], ref[1], 40) != 0 || memcmp(ref[1], ref[2], 40) != 0);
}

/* A draft model under TP=2: proposals from the unsharded draft on rank 0, verification on
 * both ranks; the tokens are plain TP=1 greedy's. */
static void test_draft(void **state) {
  (void)state;
  job_t jobs[3];
  make_jobs(jobs, 3, 23, 0);
  for (int32_t j = 0; j < 3; j++) jobs[j].p.logprobs = 0;
  static result_t ref[3], got[3];
  kiln_engine_t *e = make_engine("llama2", 1, NULL, 0);
  run_jobs(e, jobs, 3, ref);
  kiln_engine_destroy(e);
  char dm[1200];
  snprintf(dm, sizeof(dm), "speculative.draft_model=%s/llama2", g_src);
  const char *spec[] = {"speculative.method=draft", dm, "speculative.num_speculative_tokens=3",
                        "cache.num_blocks=64"};
  e = make_engine("llama2", 2, spec, 4);
  run_jobs(e, jobs, 3, got);
  kiln_metrics_t m;
  kiln_engine_get_metrics(e, &m);
  assert_true(m.spec_draft_tokens > 0);
  assert_true(m.spec_accepted_tokens > 0);
  expect_same(ref, got, 3, false, "TP=2 with a draft model");
  kiln_engine_destroy(e);
}

static void expect_refused(const char *model, int32_t tp, const char *frag1, const char *frag2) {
  kiln_engine_t *e = NULL;
  kiln_status_t st = try_engine(model, tp, NULL, 0, &e);
  if (!st) fail_msg("%s at TP=%d: no error (wanted one mentioning %s)", model, (int)tp, frag1);
  const char *msg = kiln_status_message(st);
  if (!strstr(msg, frag1) || (frag2 && !strstr(msg, frag2)))
    fail_msg("got: %s\n  want: ...%s...%s", msg, frag1, frag2 ? frag2 : "");
  assert_null(e);
  kiln_status_free(st);
}

static void test_refusals(void **state) {
  (void)state;
  expect_refused("llama2", 3, "tensor_parallel_size = 3", "num_attention_heads = 4");
  expect_refused("vl_tiny_qwen2_vl", 2, "vision tower", "tensor_parallel_size = 1");
  expect_refused("qwen3_gguf/model.gguf", 2, "GGUF", "tensor_parallel_size = 1");
}

static int setup(void **state) {
  (void)state;
  const char *src = getenv("KILN_SOURCE_DIR");
  snprintf(g_src, sizeof(g_src), "%s/tests/fixtures/models", src ? src : "..");
  return 0;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_parity_llama2), cmocka_unit_test(test_parity_qwen2),
      cmocka_unit_test(test_pressure),      cmocka_unit_test(test_fork),
      cmocka_unit_test(test_draft),
      cmocka_unit_test(test_refusals),
  };
  return cmocka_run_group_tests(tests, setup, NULL);
}
