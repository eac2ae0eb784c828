/* test_tp.c - tensor parallelism in the model (models/model.c's tp_setup and plan_layer_tp,
 * models/llama/llama.c's two all_reduce per layer; docs/parallel.md).
 *
 * Every rank is a thread with its own stream, communicator (the cpu backend's shared-memory
 * collectives), weight shard and KV cache, on the one cpu device; all ranks score the same ids
 * (kiln_model_score: prefill of 12 tokens, then decode steps of 1 and 3), so they issue the
 * same collectives in the same order, as the engine's ranks will. Each rank's logits must
 * equal the TP=1 logits within f32 rounding (the row-parallel sums are regrouped: a GEMM over
 * K/N columns per rank, then the all_reduce in rank order), at TP=2 and TP=4, on:
 *   llama2          4 heads, 4 KV heads: KV heads split (2 or 1 per rank)
 *   qwen2_bf16      Qwen2, 2 KV heads, q/k/v biases: split at TP=2, replicated at TP=4
 *                   (ranks 0, 1 share KV head 0; 2, 3 KV head 1), served in f32
 *   llama_bias_mqa  1 KV head (replicated on every rank), o_proj and MLP biases (the
 *                   row-parallel ones added on rank 0 only, before the all_reduce)
 *   qwen3           q/k norms (the split QKV path)
 *   mistral_swa     sliding window
 * Tolerance 1e-5 of the largest logit, and every argmax must agree. Can it fail? A shard off by
 * one head, a KV head picked for the wrong query heads, a bias added on every rank (N times)
 * or a missing all_reduce changes these random 2-layer fixtures' logits by a large fraction of
 * their size (each weight matters: there is no redundancy to hide a wrong slice), orders of
 * magnitude above 1e-5; only the summation order differs in a correct split (measured: at
 * most 1.1e-6 against largest logits of ~2.4). Checked by mutation: picking the wrong KV head
 * for the replicated ranks failed qwen2_bf16, qwen3 and mistral_swa at TP=4 (errors 2.8-3.8),
 * adding o_proj's bias on every rank failed llama_bias_mqa at TP=2 (error 1.06). Then the
 * refusals, each naming the config value. */
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

#include <cmocka.h>

#include "hal/loader.h"
#include "models/model.h"
#include "test_model_util.h"

#define TOL 1e-5
#define NTOK 12
#define MAXW 4

static const kiln_hal_plugin_t *g_plugin;
static kiln_hal_registry_t *g_reg;
static kiln_hal_device_t *g_dev;
static kiln_hal_stream_t *g_stream; /* opened with the device (test_open_backend); unused */
static char g_src[256];

static kiln_model_options_t opts(int32_t world, int32_t rank, kiln_hal_comm_t *comm) {
  kiln_model_options_t o;
  memset(&o, 0, sizeof(o));
  o.dtype = KILN_HAL_F32;
  o.max_tokens = 16;
  o.max_seqs = 4;
  o.max_blocks_per_seq = 16;
  o.graphs = true; /* turned off under TP (and on the cpu backend a no-op either way) */
  o.tp_size = world;
  o.tp_rank = rank;
  o.tp_comm = comm;
  return o;
}

static void ids_for(int64_t V, int32_t *ids) {
  for (int i = 0; i < NTOK; i++) ids[i] = (int32_t)((i * 37 + 11) % V);
}

typedef struct rank_ctx {
  const char *path;
  int32_t world, rank;
  kiln_hal_comm_id_t id;
  int32_t chunk;
  float *out; /* [NTOK, V] */
  int64_t V;
  char err[512];
} rank_ctx_t;

static void rank_err(rank_ctx_t *c, kiln_status_t st) {
  snprintf(c->err, sizeof(c->err), "rank %d: %s", c->rank, kiln_status_message(st));
  kiln_status_free(st);
}

static void *rank_main(void *arg) {
  rank_ctx_t *c = arg;
  const kiln_hal_backend_t *be = &g_plugin->table;
  kiln_hal_stream_t *s = NULL;
  kiln_hal_comm_t *comm = NULL;
  kiln_model_t *m = NULL;
  if (be->stream_create(g_dev, &s)) {
    snprintf(c->err, sizeof(c->err), "rank %d: stream_create failed", c->rank);
    return NULL;
  }
  kiln_hal_comm_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.world_size = c->world;
  a.rank = c->rank;
  a.timeout_ms = 60000;
  a.id = c->id;
  kiln_hal_error_t *e = be->comm_create(g_dev, &a, &comm);
  if (e) {
    rank_err(c, kiln_hal_status_from_error(e, "comm_create"));
  } else {
    kiln_model_options_t o = opts(c->world, c->rank, comm);
    kiln_status_t st = kiln_model_load(c->path, be, g_dev, s, &o, &m);
    if (!st) {
      c->V = kiln_model_get_config(m)->vocab_size;
      int32_t ids[NTOK];
      ids_for(c->V, ids);
      c->out = malloc((size_t)(NTOK * c->V) * sizeof(float));
      st = c->out ? kiln_model_score(m, ids, NTOK, c->chunk, 4, c->out)
                  : kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
    }
    if (st) rank_err(c, st);
  }
  kiln_model_free(m);
  if (comm) be->comm_destroy(comm);
  be->stream_destroy(s);
  return NULL;
}

/* Scores the fixture with world ranks (1: no TP, no communicator); out[r] = rank r's logits. */
static void run_world(const char *path, int32_t world, int32_t chunk, float **out, int64_t *V) {
  rank_ctx_t ctx[MAXW];
  pthread_t th[MAXW];
  memset(ctx, 0, sizeof(ctx));
  kiln_hal_comm_id_t id;
  memset(&id, 0, sizeof(id));
  if (world > 1) assert_null(g_plugin->table.comm_get_unique_id(&id));
  for (int32_t r = 0; r < world; r++) {
    ctx[r].path = path;
    ctx[r].world = world;
    ctx[r].rank = r;
    ctx[r].id = id;
    ctx[r].chunk = chunk;
  }
  if (world == 1) {
    /* No communicator: the plain single-device path, the reference. */
    const kiln_hal_backend_t *be = &g_plugin->table;
    kiln_hal_stream_t *s = NULL;
    kiln_model_t *m = NULL;
    assert_null(be->stream_create(g_dev, &s));
    kiln_model_options_t o = opts(1, 0, NULL);
    check_st(kiln_model_load(path, be, g_dev, s, &o, &m));
    *V = kiln_model_get_config(m)->vocab_size;
    int32_t ids[NTOK];
    ids_for(*V, ids);
    out[0] = malloc((size_t)(NTOK * *V) * sizeof(float));
    assert_non_null(out[0]);
    check_st(kiln_model_score(m, ids, NTOK, chunk, 4, out[0]));
    kiln_model_free(m);
    be->stream_destroy(s);
    return;
  }
  for (int32_t r = 0; r < world; r++)
    assert_int_equal(pthread_create(&th[r], NULL, rank_main, &ctx[r]), 0);
  for (int32_t r = 0; r < world; r++) pthread_join(th[r], NULL);
  for (int32_t r = 0; r < world; r++) {
    out[r] = ctx[r].out;
    *V = ctx[r].V;
  }
  for (int32_t r = 0; r < world; r++)
    if (ctx[r].err[0]) {
      for (int32_t q = 0; q < world; q++) free(out[q]);
      fail_msg("%s", ctx[r].err);
    }
}

static int64_t argmax(const float *v, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; i++)
    if (v[i] > v[best]) best = i;
  return best;
}

static void parity(const char *fixture) {
  char path[512];
  snprintf(path, sizeof(path), "%s/%s", g_src, fixture);
  static const int32_t chunks[] = {0, 1, 3}; /* prefill, decode, 3 tokens a step */
  for (size_t ci = 0; ci < sizeof(chunks) / sizeof(chunks[0]); ci++) {
    float *ref[MAXW] = {0};
    int64_t V = 0;
    run_world(path, 1, chunks[ci], ref, &V);
    double amax = 0;
    for (int64_t i = 0; i < NTOK * V; i++)
      if (fabs(ref[0][i]) > amax) amax = fabs(ref[0][i]);
    static const int32_t worlds[] = {2, 4};
    for (size_t wi = 0; wi < 2; wi++) {
      const int32_t W = worlds[wi];
      float *out[MAXW] = {0};
      int64_t V2 = 0;
      run_world(path, W, chunks[ci], out, &V2);
      assert_int_equal(V2, V);
      for (int32_t r = 0; r < W; r++) {
        double err = 0;
        for (int64_t i = 0; i < NTOK * V; i++) {
          double d = fabs((double)out[r][i] - (double)ref[0][i]);
          if (!(d <= err)) err = d;
        }
        if (getenv("KILN_TEST_VERBOSE"))
          printf("  %-15s TP=%d rank %d chunk %d: max err %.3g of %.3g\n", fixture, W, r,
                 chunks[ci], err, amax);
        if (!(err <= TOL * amax))
          fail_msg("%s TP=%d rank %d chunk %d: logits differ from TP=1 by %.3g (largest %.3g)",
                   fixture, W, r, chunks[ci], err, amax);
        for (int t = 0; t < NTOK; t++)
          if (argmax(out[r] + t * V, V) != argmax(ref[0] + t * V, V))
            fail_msg("%s TP=%d rank %d: argmax differs at position %d", fixture, W, r, t);
      }
      for (int32_t r = 0; r < W; r++) free(out[r]);
    }
    free(ref[0]);
  }
}

static void test_llama2(void **state) {
  (void)state;
  parity("llama2");
}
static void test_qwen2_replicated_kv(void **state) {
  (void)state;
  parity("qwen2_bf16");
}
static void test_bias_mqa(void **state) {
  (void)state;
  parity("llama_bias_mqa");
}
static void test_qwen3(void **state) {
  (void)state;
  parity("qwen3");
}
static void test_mistral(void **state) {
  (void)state;
  parity("mistral_swa");
}

/* Refusals: each before any collective, naming the config value. A world-1 communicator
 * stands in for the real one (nothing is issued on it). */
static void test_refusals(void **state) {
  (void)state;
  const kiln_hal_backend_t *be = &g_plugin->table;
  kiln_hal_stream_t *s = NULL;
  kiln_hal_comm_t *comm = NULL;
  assert_null(be->stream_create(g_dev, &s));
  kiln_hal_comm_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.world_size = 1;
  assert_null(be->comm_get_unique_id(&a.id));
  assert_null(be->comm_create(g_dev, &a, &comm));
  char p[512];
  kiln_model_t *m = NULL;
  kiln_model_options_t o;

  snprintf(p, sizeof(p), "%s/llama2", g_src);
  o = opts(3, 0, comm);
  expect_err(kiln_model_load(p, be, g_dev, s, &o, &m), "tensor_parallel_size = 3",
             "num_attention_heads = 4");
  o = opts(8, 0, comm);
  expect_err(kiln_model_load(p, be, g_dev, s, &o, &m), "tensor_parallel_size = 8",
             "num_attention_heads = 4");
  o = opts(2, 2, comm);
  expect_err(kiln_model_load(p, be, g_dev, s, &o, &m), "rank 2", "0..1");
  o = opts(-1, 0, comm);
  expect_err(kiln_model_load(p, be, g_dev, s, &o, &m), "tensor_parallel_size = -1", NULL);
  o = opts(2, 0, NULL);
  expect_err(kiln_model_load(p, be, g_dev, s, &o, &m), "needs a communicator", NULL);
  o = opts(2, 0, comm);
  o.quantization = KILN_QUANT_FP8;
  expect_err(kiln_model_load(p, be, g_dev, s, &o, &m), "quantized", "not sharded");
  snprintf(p, sizeof(p), "%s/vl_tiny_qwen2_vl", g_src);
  o = opts(2, 0, comm);
  expect_err(kiln_model_load(p, be, g_dev, s, &o, &m), "vision tower", "tensor_parallel_size = 1");
  snprintf(p, sizeof(p), "%s/qwen3_gguf/model.gguf", g_src);
  expect_err(kiln_model_load(p, be, g_dev, s, &o, &m), "GGUF", "not sharded");
  assert_null(m);
  be->comm_destroy(comm);
  be->stream_destroy(s);
}

static int setup(void **state) {
  (void)state;
  if (test_open_backend(&g_reg, &g_plugin, &g_dev, &g_stream)) return -1;
  const kiln_hal_backend_t *be = &g_plugin->table;
  if (!KILN_HAL_HAS(be, comm_create) || !be->comm_create) {
    fprintf(stderr, "test_tp: backend %s has no collectives\n", be->name);
    return -1;
  }
  const char *src = getenv("KILN_SOURCE_DIR");
  if (!src) src = "..";
  snprintf(g_src, sizeof(g_src), "%s/tests/fixtures/models", src);
  return 0;
}

static int teardown(void **state) {
  (void)state;
  if (g_stream) g_plugin->table.stream_destroy(g_stream);
  if (g_dev) g_plugin->table.device_close(g_dev);
  kiln_hal_registry_free(g_reg);
  return 0;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_llama2),  cmocka_unit_test(test_qwen2_replicated_kv),
      cmocka_unit_test(test_bias_mqa), cmocka_unit_test(test_qwen3),
      cmocka_unit_test(test_mistral), cmocka_unit_test(test_refusals),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
