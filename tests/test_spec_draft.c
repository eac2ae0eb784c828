/* test_spec_draft.c - speculative decoding with a draft model ([speculative] method = draft,
 * core/engine/draft.c) on the CPU backend: the default model (share/models/kiln-tiny)
 * drafting for itself, where nearly every greedy proposal is accepted, and the qwen3 fixture
 * drafting for the llama2 fixture (same 320-token vocabulary, different weights: few accepted);
 * several concurrent requests of different lengths, greedy and seeded sampled, with
 * per-request k (default, 2, 0), give exactly the tokens, finish reasons and text of the run
 * without speculation, with a roomy pool, a small target pool (preemptions), a small token
 * budget (chunked prefill: the draft's catch-up is chunked too) and a small draft pool (some
 * sequences cannot get draft blocks and do not speculate). Every KV block of both pools is
 * free at the end and both block managers' invariants hold after every step. And the
 * refusals: method = draft without draft_model, a draft path that does not exist, a draft
 * with another vocabulary. Under valgrind (or KILN_TEST_QUICK=1) only the fixtures run. */
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
#include "kiln/kiln.h"

#define MAXREQ 8
#define MAXTOK 64

static char g_src[1024];
static bool g_quick;

static void check_st(kiln_status_t st) {
  if (st) {
    fprintf(stderr, "unexpected error: %s\n", kiln_status_message(st));
    kiln_status_free(st);
    fail();
  }
}

typedef struct req_spec {
  const char *prompt; /* text, or NULL: ids */
  const int32_t *ids;
  int32_t num_ids;
  int32_t max_tokens;
  float temperature; /* > 0: seeded sampling */
  int32_t spec;      /* num_speculative_tokens (-1 = the engine's) */
} req_spec_t;

typedef struct req_result {
  int32_t ids[MAXTOK];
  int32_t n;
  char text[2048];
  size_t text_len;
  kiln_finish_reason_t fin;
  bool finished;
} req_result_t;

typedef struct run_stats {
  uint64_t drafts, draft_tokens, accepted, preemptions;
  double draft_seconds;
  uint64_t graph_multi, draft_graph; /* multi-token graph replays; the draft's replays */
  uint64_t draft_eager;              /* the draft's eager forwards */
} run_stats_t;

static void collect(kiln_request_t *r, req_result_t *res) {
  kiln_output_t *o;
  for (;;) {
    check_st(kiln_request_poll(r, 0, &o));
    if (!o) return;
    assert_null(o->error);
    for (int32_t i = 0; i < o->num_tokens; i++) {
      assert_true(res->n < MAXTOK);
      res->ids[res->n++] = o->token_ids[i];
    }
    assert_true(res->text_len + o->text_len < sizeof(res->text));
    memcpy(res->text + res->text_len, o->text, o->text_len);
    res->text_len += o->text_len;
    if (o->finish_reason != KILN_FINISH_NONE) res->fin = o->finish_reason;
    if (o->request_finished) res->finished = true;
    kiln_output_free(o);
  }
}

/* Runs the requests together (manual stepping) on an engine made from the model and the
 * overrides; checks both pools' invariants after every step and that they are free at the
 * end. */
static void run(const char *model, const char *const *extra, int32_t nextra, const req_spec_t *rq,
                int32_t nreq, req_result_t *res, run_stats_t *stats) {
  kiln_config_t *cfg = NULL;
  check_st(kiln_config_create(&cfg));
  char mp[1200];
  snprintf(mp, sizeof(mp), "model.path=%s", model);
  const char *base[] = {mp, "backend.name=cpu", "backend.threads=2", "model.dtype=float32",
                        "engine.max_num_seqs=8", "graph.enabled=false"};
  for (size_t i = 0; i < sizeof(base) / sizeof(base[0]); i++) check_st(kiln_config_set(cfg, base[i]));
  for (int32_t i = 0; i < nextra; i++) check_st(kiln_config_set(cfg, extra[i]));
  kiln_engine_setup_t su;
  memset(&su, 0, sizeof(su));
  su.config = cfg;
  su.manual = true;
  kiln_engine_t *e = NULL;
  check_st(kiln_engine_create_setup(&su, &e));
  kiln_request_t *reqs[MAXREQ];
  assert_true(nreq <= MAXREQ);
  for (int32_t k = 0; k < nreq; k++) {
    kiln_sampling_params_t p;
    kiln_sampling_params_init(&p);
    p.max_tokens = rq[k].max_tokens;
    p.temperature = rq[k].temperature;
    p.has_seed = true;
    p.seed = 17 + (uint64_t)k;
    p.num_speculative_tokens = rq[k].spec;
    p.ignore_eos = true;
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
  kiln_kv_manager_t *dkv = kiln_engine_draft_kv(e);
  for (int32_t guard = 0; guard < 5000; guard++) {
    bool idle = false;
    check_st(kiln_engine_step(e, &idle));
    assert_null(kiln_kv_check(kiln_engine_kv(e)));
    if (dkv) assert_null(kiln_kv_check(dkv));
    for (int32_t k = 0; k < nreq; k++) collect(reqs[k], &res[k]);
    if (idle) break;
  }
  for (int32_t k = 0; k < nreq; k++) {
    assert_true(res[k].finished);
    kiln_request_release(reqs[k]);
  }
  kiln_kv_manager_t *kv = kiln_engine_kv(e);
  assert_int_equal(kiln_kv_num_free(kv), kiln_kv_num_blocks(kv));
  if (dkv) assert_int_equal(kiln_kv_num_free(dkv), kiln_kv_num_blocks(dkv));
  kiln_metrics_t m;
  kiln_engine_get_metrics(e, &m);
  if (stats)
    *stats = (run_stats_t){.drafts = m.spec_drafts,
                           .draft_tokens = m.spec_draft_tokens,
                           .accepted = m.spec_accepted_tokens,
                           .preemptions = m.preemptions,
                           .draft_seconds = m.spec_draft_seconds,
                           .graph_multi = m.graph_multi_replays,
                           .draft_graph = m.draft_graph_replays,
                           .draft_eager = m.draft_eager_forwards};
  assert_true(m.spec_accepted_tokens <= m.spec_draft_tokens);
  kiln_engine_destroy(e);
  kiln_config_free(cfg);
}

static void expect_same(const req_result_t *a, const req_result_t *b, int32_t nreq,
                        const char *what) {
  for (int32_t k = 0; k < nreq; k++) {
    bool same = a[k].n == b[k].n && !memcmp(a[k].ids, b[k].ids, (size_t)a[k].n * 4) &&
                a[k].fin == b[k].fin && a[k].text_len == b[k].text_len &&
                !memcmp(a[k].text, b[k].text, a[k].text_len);
    if (!same) {
      fprintf(stderr, "%s: request %d differs (%d vs %d tokens)\n", what, k, a[k].n, b[k].n);
      for (int32_t i = 0; i < a[k].n || i < b[k].n; i++)
        fprintf(stderr, "  %d: %d %d\n", i, i < a[k].n ? a[k].ids[i] : -1,
                i < b[k].n ? b[k].ids[i] : -1);
      fail();
    }
  }
}

typedef struct case_cfg {
  const char *name;
  const char *set[3];
  int32_t nset;
  bool expect_preemption;
  /* graph.enabled=true: 1, verifications and draft steps replay graphs; 2, with
   * graph.multi_token=false only the draft's one-token steps do */
  int expect_graphs;
} case_cfg_t;

/* The requests under every case: plain run and draft run with the same pool and budget
 * (sampled tokens may depend on the batch's shape through near ties; the comparison is with
 * the plain run of the same shape, as in test_spec). */
static void check_cases(const char *target, const char *draft, const req_spec_t *rq, int32_t nreq,
                        const case_cfg_t *cases, int32_t ncases, double min_rate,
                        const char *what, run_stats_t *out) {
  char dm[1300];
  snprintf(dm, sizeof(dm), "speculative.draft_model=%s", draft);
  for (int32_t c = 0; c < ncases; c++) {
    const char *ov[8] = {"speculative.method=draft", dm, "speculative.num_speculative_tokens=4"};
    int32_t n = 3;
    for (int32_t i = 0; i < cases[c].nset; i++) ov[n++] = cases[c].set[i];
    req_result_t plain[MAXREQ], spec[MAXREQ];
    run_stats_t st;
    run(target, ov + 3, n - 3, rq, nreq, plain, NULL);
    run(target, ov, n, rq, nreq, spec, &st);
    fprintf(stderr,
            "%s %s: %llu verifications, %llu proposed, %llu accepted (%.3f), %llu preemptions, "
            "draft %.3f s\n",
            what, cases[c].name, (unsigned long long)st.drafts,
            (unsigned long long)st.draft_tokens, (unsigned long long)st.accepted,
            st.draft_tokens ? (double)st.accepted / (double)st.draft_tokens : 0.0,
            (unsigned long long)st.preemptions, st.draft_seconds);
    expect_same(plain, spec, nreq, cases[c].name);
    assert_true(st.draft_tokens > 0);
    assert_true(st.draft_seconds > 0);
    if (min_rate > 0) assert_true((double)st.accepted > min_rate * (double)st.draft_tokens);
    if (cases[c].expect_preemption) assert_true(st.preemptions > 0);
    if (cases[c].expect_graphs == 2) {
      assert_int_equal(st.graph_multi, 0);
      assert_true(st.draft_graph > 0);
    } else if (cases[c].expect_graphs) {
      fprintf(stderr, "%s %s: %llu multi-token graph replays, draft %llu replays %llu eager\n",
              what, cases[c].name, (unsigned long long)st.graph_multi,
              (unsigned long long)st.draft_graph, (unsigned long long)st.draft_eager);
      assert_true(st.graph_multi > 0);
      assert_true(st.draft_graph > 0);
      /* Every catch-up after a verification is two tokens (the draft keeps the proposals it
       * was fed that were accepted): only the prompts' catch-ups, one per request at most, run
       * eagerly. */
      if (st.draft_eager > (uint64_t)nreq)
        fail_msg("%s: %llu eager draft forwards for %d requests", cases[c].name,
                 (unsigned long long)st.draft_eager, nreq);
    }
    if (out) out[c] = st;
  }
}

static void model_path(char *out, size_t n, const char *rel) {
  snprintf(out, n, "%s/%s", g_src, rel);
}

#define TEXT_A "The list: apples, pears, plums, cherries, grapes, lemons, limes, melons."
#define TEXT_B                                                                                   \
  "Once upon a time there was a little town by the sea, and in the town there lived an old " \
  "fisherman who went out every morning before the sun rose over the hills"

/* kiln-tiny drafting for itself: greedy proposals of the target's own argmax, so nearly every
 * one is accepted (> 90%: only where the draft's and the verification's rows differ in the
 * last bits at a near tie could one be rejected). */
static void test_self_draft(void **state) {
  (void)state;
  if (g_quick) skip();
  char p[1100];
  model_path(p, sizeof(p), "share/models/kiln-tiny");
  const req_spec_t greedy[4] = {
      {.prompt = TEXT_A, .max_tokens = 30, .spec = -1},
      {.prompt = TEXT_B, .max_tokens = 21, .spec = -1},
      {.prompt = "Hello", .max_tokens = 26, .spec = 2},
      {.prompt = TEXT_B " and", .max_tokens = 17, .spec = -1},
  };
  const case_cfg_t cases[] = {
      {"roomy", {"cache.num_blocks=128"}, 1, false, 0},
      {"small pool", {"cache.num_blocks=16", "cache.block_size=8"}, 2, true, 0},
      {"chunked", {"engine.max_num_batched_tokens=19", "cache.block_size=8"}, 2, false, 0},
      {"graphs", {"cache.num_blocks=128", "graph.enabled=true"}, 2, false, 1},
      {"graphs, multi_token off", {"graph.enabled=true", "graph.multi_token=false"}, 2, false, 2},
  };
  check_cases(p, p, greedy, 4, cases, 5, 0.9, "kiln-tiny self", NULL);
  /* Mixed with a sampled request and a non-speculating one; a draft pool that fits only some
   * of the sequences (the others go without proposals). */
  const req_spec_t mixed[5] = {
      {.prompt = TEXT_A, .max_tokens = 30, .spec = -1},
      {.prompt = TEXT_B, .max_tokens = 25, .temperature = 0.8f, .spec = -1},
      {.prompt = "Hello", .max_tokens = 20, .spec = 0},
      {.prompt = TEXT_B " and", .max_tokens = 30, .spec = -1},
      {.prompt = TEXT_A " Again:", .max_tokens = 20, .temperature = 1.0f, .spec = 3},
  };
  const case_cfg_t mcases[] = {
      {"mixed", {"cache.num_blocks=128"}, 1, false, 0},
      {"small draft pool",
       {"cache.num_blocks=40", "cache.block_size=8", "speculative.draft_kv_fraction=0.2"},
       3,
       false,
       0},
  };
  run_stats_t ms[2];
  check_cases(p, p, mixed, 5, mcases, 2, 0, "kiln-tiny self", ms);
  assert_true(ms[1].drafts < ms[0].drafts); /* some steps without proposals: no draft blocks */
}

/* Fixture ids below 320 from a 64-bit LCG. */
static void fill_ids(int32_t *ids, int32_t n, uint64_t seed) {
  for (int32_t i = 0; i < n; i++) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    ids[i] = (int32_t)((seed >> 33) % 320u);
  }
}

/* The qwen3 fixture drafting for the llama2 fixture (random weights, the same vocabulary):
 * few proposals are accepted, the output is still the target's. And llama2 for itself. */
static void test_fixture_draft(void **state) {
  (void)state;
  char tp[1400], dp[1400];
  model_path(tp, sizeof(tp), "tests/fixtures/models/llama2");
  model_path(dp, sizeof(dp), "tests/fixtures/models/qwen3");
  static int32_t a[30], b[11], c[45];
  fill_ids(a, 30, 1);
  fill_ids(b, 11, 2);
  fill_ids(c, 45, 3);
  for (int32_t i = 15; i < 30; i++) a[i] = a[i - 15]; /* a copy: the fixtures echo it a bit */
  const req_spec_t rq[4] = {
      {.ids = a, .num_ids = 30, .max_tokens = 24, .spec = -1},
      {.ids = b, .num_ids = 11, .max_tokens = 31, .spec = -1},
      {.ids = c, .num_ids = 45, .max_tokens = 17, .temperature = 0.9f, .spec = -1},
      {.ids = c, .num_ids = 20, .max_tokens = 28, .spec = 2},
  };
  const case_cfg_t cases[] = {
      {"roomy", {"cache.num_blocks=64"}, 1, false, 0},
      {"small pool", {"cache.num_blocks=14", "cache.block_size=8"}, 2, true, 0},
      {"chunked", {"engine.max_num_batched_tokens=13", "cache.block_size=8"}, 2, false, 0},
  };
  check_cases(tp, dp, rq, 4, cases, g_quick ? 1 : 3, 0, "llama2 <- qwen3", NULL);
  const req_spec_t greedy[3] = {rq[0], rq[1], rq[3]};
  check_cases(tp, tp, greedy, 3, cases, g_quick ? 1 : 2, 0.9, "llama2 self", NULL);
}

/* ---- refusals ----------------------------------------------------------------------------- */

static void expect_create_error(const char *target, const char *const *set, int32_t n,
                                const char *needle, const char *needle2) {
  char mp[1200];
  snprintf(mp, sizeof(mp), "model.path=%s", target);
  const char *ov[8] = {mp, "backend.name=cpu", "backend.threads=2", "speculative.method=draft"};
  int32_t k = 4;
  for (int32_t i = 0; i < n; i++) ov[k++] = set[i];
  kiln_engine_t *e = NULL;
  kiln_status_t st = kiln_engine_create(NULL, ov, k, &e);
  assert_non_null(st);
  const char *msg = kiln_status_message(st);
  if (!strstr(msg, needle)) fail_msg("%s lacks %s", msg, needle);
  if (needle2 && !strstr(msg, needle2)) fail_msg("%s lacks %s", msg, needle2);
  assert_null(e);
  kiln_status_free(st);
}

static void test_refusals(void **state) {
  (void)state;
  char tiny[1100], llama[1400], dm[1500];
  model_path(tiny, sizeof(tiny), "share/models/kiln-tiny");
  model_path(llama, sizeof(llama), "tests/fixtures/models/llama2");
  /* method = draft without draft_model */
  expect_create_error(tiny, NULL, 0, "speculative.draft_model", "method = draft");
  /* a draft that does not exist */
  const char *missing[] = {"speculative.draft_model=/nonexistent/draft-model"};
  expect_create_error(tiny, missing, 1, "speculative.draft_model", "/nonexistent/draft-model");
  /* another vocabulary: both models named */
  snprintf(dm, sizeof(dm), "speculative.draft_model=%s", llama);
  const char *vocab[] = {dm};
  expect_create_error(tiny, vocab, 1, "320", "4096");
  expect_create_error(tiny, vocab, 1, "fixtures/models/llama2", "share/models/kiln-tiny");
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
      cmocka_unit_test(test_self_draft),
      cmocka_unit_test(test_fixture_draft),
      cmocka_unit_test(test_refusals),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
