/* ops_cases_misc.c - graph capture and replay (embedding -> rmsnorm -> gemm -> argmax with new
 * inputs between replays; copies refused during capture) and bad arguments (every op returns an
 * error with a message, writes nothing and leaves the stream usable). */
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

static kiln_hal_tensor_t v1(const oh_buf_t *b, int32_t dt, int64_t n) {
  int64_t s[1] = {n};
  return oh_view(b, 0, dt, 1, s, NULL);
}

static kiln_hal_tensor_t v2(const oh_buf_t *b, int32_t dt, int64_t r, int64_t c) {
  int64_t s[2] = {r, c};
  return oh_view(b, 0, dt, 2, s, NULL);
}

static kiln_hal_tensor_t v3(const oh_buf_t *b, int32_t dt, int64_t d0, int64_t d1, int64_t d2) {
  int64_t s[3] = {d0, d1, d2};
  return oh_view(b, 0, dt, 3, s, NULL);
}

/* ================================================================================ graphs == */

enum { G_V = 37, G_H = 64, G_N = 53, G_T = 5 };

/* Checks the pipeline's outputs step by step against the reference, using the device's own
 * intermediate results as each op's input so that every op is judged on its own. */
static void graph_check(int32_t dt, oh_buf_t *xb, oh_buf_t *hb, oh_buf_t *lb, oh_buf_t *ob,
                        const double *table, const int32_t *ids, const double *w,
                        const double *wl) {
  double x[G_T * G_H], want_x[G_T * G_H], h[G_T * G_H], want_h[G_T * G_H];
  double lg[G_T * G_N], want_lg[G_T * G_N], mag[G_T * G_N];
  int32_t got_ids[G_T], want_ids[G_T];
  if (!oh_pull(xb) || !oh_pull(hb) || !oh_pull(lb) || !oh_pull(ob)) return;
  kiln_hal_tensor_t xv = v2(xb, dt, G_T, G_H), hv = v2(hb, dt, G_T, G_H);
  kiln_hal_tensor_t lv = v2(lb, KILN_HAL_F32, G_T, G_N), ov = v1(ob, KILN_HAL_I32, G_T);
  oh_read(xb, &xv, x);
  oh_read(hb, &hv, h);
  oh_read(lb, &lv, lg);
  oh_read_i32(ob, &ov, got_ids);
  ops_ref_embedding(G_V, G_H, table, G_T, ids, want_x);
  oh_compare("embedding out", G_T * G_H, x, want_x, NULL, (oh_tol_t){0, 0, 0});
  ops_ref_rmsnorm(dt, G_T, G_H, x, NULL, w, (double)1e-5f, 0.0, want_h);
  oh_compare("rmsnorm out", G_T * G_H, h, want_h, NULL, oh_tol_rmsnorm(dt));
  /* logits = h @ wl^T, wl stored [N, H] */
  double *wt = OH_NEW(double, G_H *G_N);
  for (int n = 0; n < G_N; n++)
    for (int k = 0; k < G_H; k++) wt[k * G_N + n] = wl[n * G_H + k];
  ops_ref_gemm(G_T, G_N, G_H, h, wt, NULL, 1.0, 0.0, NULL, want_lg, mag);
  free(wt);
  oh_compare("gemm out", G_T * G_N, lg, want_lg, mag, oh_tol_gemm(KILN_HAL_F32));
  for (int t = 0; t < G_T; t++) want_ids[t] = ops_ref_argmax(G_N, lg + t * G_N, NULL);
  oh_compare_i32("argmax out", G_T, got_ids, want_ids);
}

static void graph_run(const oh_backend_t *be, int32_t dt) {
  const kiln_hal_backend_t *t = be->t;
  const size_t es = kiln_hal_dtype_size(dt);
  oh_case(be, "graph", dt, "capture embedding -> rmsnorm -> gemm -> argmax");
  oh_buf_t *tb = oh_buf_new(be, (size_t)(G_V * G_H) * es), *wb = oh_buf_new(be, (size_t)G_H * es);
  oh_buf_t *wlb = oh_buf_new(be, (size_t)(G_N * G_H) * es), *ib = oh_buf_new(be, G_T * 4);
  oh_buf_t *xb = oh_buf_new(be, (size_t)(G_T * G_H) * es),
           *hb = oh_buf_new(be, (size_t)(G_T * G_H) * es);
  oh_buf_t *lb = oh_buf_new(be, (size_t)(G_T * G_N) * 4), *ob = oh_buf_new(be, G_T * 4);
  double table[G_V * G_H], w[G_H], wl[G_N * G_H];
  int32_t ids[G_T] = {3, 0, 36, 17, 3};
  kiln_hal_tensor_t tv = v2(tb, dt, G_V, G_H), wv = v1(wb, dt, G_H), wlv = v2(wlb, dt, G_N, G_H);
  kiln_hal_tensor_t idv = v1(ib, KILN_HAL_I32, G_T);
  oh_write_rand(tb, &tv, -2, 2, table);
  oh_write_rand(wb, &wv, 0.5, 1.5, w);
  oh_write_rand(wlb, &wlv, -1, 1, wl);
  oh_write_i32(ib, &idv, ids);
  oh_push(tb);
  oh_push(wb);
  oh_push(wlb);
  oh_push(ib);

  kiln_hal_embedding_args_t ea = {sizeof(ea), tv, idv, v2(xb, dt, G_T, G_H)};
  kiln_hal_rmsnorm_args_t na;
  memset(&na, 0, sizeof(na));
  na.struct_size = sizeof(na);
  na.x = ea.out;
  na.weight = wv;
  na.out = v2(hb, dt, G_T, G_H);
  na.eps = 1e-5f;
  kiln_hal_gemm_args_t ga;
  memset(&ga, 0, sizeof(ga));
  ga.struct_size = sizeof(ga);
  ga.a = na.out;
  int64_t bs[2] = {G_H, G_N}, bst[2] = {1, G_H}; /* wl [N, H] row-major seen as [H, N] */
  ga.b = oh_view(wlb, 0, dt, 2, bs, bst);
  ga.c = v2(lb, KILN_HAL_F32, G_T, G_N);
  ga.alpha = 1.0f;
  kiln_hal_argmax_args_t aa = {sizeof(aa), ga.c, v1(ob, KILN_HAL_I32, G_T), oh_absent()};

  kiln_hal_graph_t *g = NULL;
  bool ok = oh_ok(t->graph_begin(be->stream), "graph_begin");
  if (ok) {
    ok = oh_ok(t->embedding(be->stream, &ea), "embedding (capturing)");
    ok = oh_ok(t->rmsnorm(be->stream, &na), "rmsnorm (capturing)") && ok;
    ok = oh_ok(t->gemm(be->stream, &ga), "gemm (capturing)") && ok;
    ok = oh_ok(t->argmax(be->stream, &aa), "argmax (capturing)") && ok;
    ok = oh_ok(t->graph_end(be->stream, &g), "graph_end") && ok;
  }
  if (ok && !g) {
    oh_fail("graph_end returned no graph");
    ok = false;
  }
  if (ok) {
    /* Capturing records the ops: nothing may have run yet. */
    oh_case(be, "graph", dt, "outputs before the first replay");
    oh_buf_t *outs[] = {xb, hb, lb, ob};
    for (size_t i = 0; i < ARRAY_LEN(outs); i++) {
      if (oh_pull(outs[i]))
        oh_check_rest(outs[i], "an output written during capture (ops must be recorded, not run)");
    }
    oh_case(be, "graph", dt, "first replay");
    if (oh_ok(t->graph_replay(g, be->stream), "graph_replay"))
      graph_check(dt, xb, hb, lb, ob, table, ids, w, wl);

    /* New contents at the same addresses, uploaded outside the capture. */
    oh_case(be, "graph", dt, "replay after new ids and norm weights");
    int32_t ids2[G_T] = {36, 1, 1, 20, 0};
    memcpy(ids, ids2, sizeof(ids));
    oh_write_i32(ib, &idv, ids);
    oh_write_rand(wb, &wv, 0.5, 1.5, w);
    oh_push(ib);
    oh_push(wb);
    if (oh_ok(t->graph_replay(g, be->stream), "graph_replay"))
      graph_check(dt, xb, hb, lb, ob, table, ids, w, wl);

    oh_case(be, "graph", dt, "replay after a new embedding table");
    oh_write_rand(tb, &tv, -2, 2, table);
    oh_push(tb);
    if (oh_ok(t->graph_replay(g, be->stream), "graph_replay"))
      graph_check(dt, xb, hb, lb, ob, table, ids, w, wl);
  }

  /* Copies are refused while capturing, and write nothing. */
  oh_case(be, "graph", dt, "copy_h2d/copy_d2h during capture");
  if (oh_ok(t->graph_begin(be->stream), "graph_begin")) {
    int32_t junk[G_T] = {9, 9, 9, 9, 9}, back[G_T];
    oh_expect_error(t->copy_h2d(be->stream, ib->b, 0, junk, sizeof(junk)),
                    "copy_h2d during capture");
    oh_expect_error(t->copy_d2h(be->stream, back, ib->b, 0, sizeof(back)),
                    "copy_d2h during capture");
    kiln_hal_graph_t *g2 = NULL;
    kiln_hal_error_t *err = t->graph_end(be->stream, &g2);
    kiln_hal_error_free(err); /* either outcome is allowed after a refused call */
    if (g2) t->graph_destroy(g2);
    if (oh_pull(ib)) oh_check_rest(ib, "ids (a refused copy_h2d wrote)");
    /* The stream still works after the aborted capture. */
    if (ok && oh_ok(t->graph_replay(g, be->stream), "graph_replay after an aborted capture"))
      graph_check(dt, xb, hb, lb, ob, table, ids, w, wl);
  }
  if (g) t->graph_destroy(g);
  oh_free_all();
}

void test_ops_graphs(void **state) {
  (void)state;
  oh_test_begin("graphs");
  for (int bi = 0; bi < oh_num_backends; bi++) {
    const oh_backend_t *be = &oh_backends[bi];
    const kiln_hal_backend_t *t = be->t;
    if (!(be->info.caps & KILN_HAL_CAP_GRAPHS) || !t->graph_begin || !t->graph_end ||
        !t->graph_replay || !t->graph_destroy) {
      printf("test_ops: [%s] no graphs (CAP_GRAPHS %s, members %s): skipping the graph test\n",
             be->name, (be->info.caps & KILN_HAL_CAP_GRAPHS) ? "set" : "unset",
             t->graph_begin ? "present" : "absent");
      continue;
    }
    for (int di = 0; di < 3; di++) {
      if (oh_dtype_ok(be, oh_float_dtypes[di])) graph_run(be, oh_float_dtypes[di]);
    }
  }
  oh_test_end();
}

/* ========================================================================= bad arguments == */

/* A buffer of n bytes whose host mirror holds small f32 values (kind 'f'), zeros ('0') or
 * poison ('p'), uploaded. */
static oh_buf_t *bad_buf(const oh_backend_t *be, size_t n, char kind) {
  oh_buf_t *b = oh_buf_new(be, n);
  if (kind == 'f') {
    for (size_t i = 0; i + 4 <= n; i += 4) {
      float f = (float)oh_rand_uniform(-1, 1);
      memcpy(b->host + i, &f, 4);
    }
  } else if (kind == '0') {
    memset(b->host, 0, n);
  }
  oh_push(b);
  return b;
}

/* Moves a view so that it ends past its buffer. */
static void past_end(kiln_hal_tensor_t *t, const oh_buf_t *b) {
  t->offset = b->size - kiln_hal_dtype_size(t->dtype);
}

/* Checks the base arguments run, so that each mutation alone is what makes a call bad. */
static void bad_base(const oh_backend_t *be, const char *op, kiln_hal_error_t *err) {
  oh_case(be, op, KILN_HAL_F32, "valid base arguments of the bad-argument cases");
  oh_ok(err, op);
  oh_ok(be->t->stream_sync(be->stream), "stream_sync");
}

static void bad_prepare(const oh_backend_t *be, const char *op, const char *what, oh_buf_t **w,
                        size_t n) {
  oh_case(be, op, -1, "bad arguments: %s", what);
  for (size_t i = 0; i < n; i++) oh_push(w[i]); /* restore poison / inputs */
}

static void bad_check(const oh_backend_t *be, kiln_hal_error_t *err, oh_buf_t **w, size_t n) {
  oh_expect_error(err, "the call");
  oh_ok(be->t->stream_sync(be->stream), "stream_sync after a refused call");
  for (size_t i = 0; i < n; i++) {
    if (oh_pull(w[i])) oh_check_rest(w[i], "a buffer the refused call must not write");
  }
}

/* Runs one op over its mutations: `mutate(a, m)` returns NULL past the last one. */
#define BAD_LOOP(op, type, base, watch, mutate)                             \
  do {                                                                      \
    bad_base(be, #op, be->t->op(be->stream, &(base)));                      \
    for (int m_ = 0;; m_++) {                                               \
      type a_ = (base);                                                     \
      const char *what_ = mutate(&a_, m_);                                  \
      if (!what_) break;                                                    \
      bad_prepare(be, #op, what_, (watch), ARRAY_LEN(watch));               \
      bad_check(be, be->t->op(be->stream, &a_), (watch), ARRAY_LEN(watch)); \
    }                                                                       \
  } while (0)

/* Buffers of the current op, for the mutators (which may move views past their ends). */
static oh_buf_t *g_b[12];

static const char *gemm_mut(kiln_hal_gemm_args_t *a, int m) {
  switch (m) {
    case 0:
      a->a.dtype = KILN_HAL_I32;
      a->b.dtype = KILN_HAL_I32;
      return "a, b dtype i32";
    case 1: a->b.dtype = KILN_HAL_F16; return "b f16 with a f32";
    case 2: a->c.dtype = KILN_HAL_F16; return "c f16 with f32 inputs";
    case 3: a->b.shape[0] = 7; return "b [7, 6] with a [4, 8] (K mismatch)";
    case 4: a->c.shape[1] = 5; return "c [4, 5] for [4, 8] @ [8, 6]";
    case 5: past_end(&a->a, g_b[0]); return "a past the end of its buffer";
    case 6:
      a->c.stride[0] = 1;
      a->c.stride[1] = 4;
      return "c column-major";
    case 7:
      a->a.stride[0] = 16;
      a->a.stride[1] = 2;
      return "a with neither dim contiguous";
    case 8: a->bias.shape[0] = 5; return "bias [5] for N = 6";
    case 9: a->bias.dtype = KILN_HAL_F16; return "bias f16 with c f32";
    case 10:
      a->a = v3(g_b[0], KILN_HAL_F32, 2, 4, 8);
      a->b = v3(g_b[1], KILN_HAL_F32, 3, 8, 6);
      a->c = v3(g_b[2], KILN_HAL_F32, 2, 4, 6);
      return "batch 2 a with batch 3 b";
    case 11: a->a.ndim = 5; return "a ndim 5";
    case 12: past_end(&a->c, g_b[2]); return "c past the end of its buffer";
    case 13:
      a->c = v3(g_b[2], KILN_HAL_F32, 1, 4, 6);
      return "2-D a and b with a 3-D c (hal.h: same ndim)";
    default: return NULL;
  }
}

static const char *embedding_mut(kiln_hal_embedding_args_t *a, int m) {
  switch (m) {
    case 0: a->ids.dtype = KILN_HAL_F32; return "ids f32";
    case 1: a->out.dtype = KILN_HAL_F16; return "out f16 with table f32";
    case 2: a->out.shape[1] = 7; return "out [4, 7] for H = 8";
    case 3: a->out.shape[0] = 3; return "out [3, 8] for 4 ids";
    case 4: past_end(&a->table, g_b[0]); return "table past the end of its buffer";
    case 5:
      a->out.stride[0] = 16;
      a->out.stride[1] = 2;
      return "out last dim not contiguous";
    case 6:
      a->table.dtype = KILN_HAL_I32;
      a->out.dtype = KILN_HAL_I32;
      return "table, out i32";
    default: return NULL;
  }
}

static const char *rmsnorm_mut(kiln_hal_rmsnorm_args_t *a, int m) {
  switch (m) {
    case 0: a->weight.shape[0] = 7; return "weight [7] for H = 8";
    case 1: a->residual.dtype = KILN_HAL_F16; return "residual f16 with x f32";
    case 2:
      a->x.dtype = a->out.dtype = a->weight.dtype = a->residual.dtype = KILN_HAL_I32;
      return "all i32";
    case 3: a->out.shape[1] = 7; return "out [3, 7] for x [3, 8]";
    case 4: past_end(&a->out, g_b[3]); return "out past the end of its buffer";
    case 5:
      a->x.stride[0] = 16;
      a->x.stride[1] = 2;
      return "x last dim not contiguous";
    case 6: a->residual.shape[0] = 2; return "residual [2, 8] for x [3, 8]";
    default: return NULL;
  }
}

static const char *rope_mut(kiln_hal_rope_args_t *a, int m) {
  switch (m) {
    case 0: a->positions.dtype = KILN_HAL_F32; return "positions f32";
    case 1: a->cos_sin.dtype = KILN_HAL_F16; return "cos_sin f16";
    case 2:
      a->cos_sin.shape[1] = 10;
      a->cos_sin.stride[0] = 10;
      return "cos_sin [4, 10]: R > D = 8";
    case 3: a->cos_sin.shape[1] = 7; return "cos_sin [4, 7]: odd R";
    case 4:
      a->q.stride[0] = 32;
      a->q.stride[1] = 16;
      a->q.stride[2] = 2;
      return "q last dim not contiguous";
    case 5: a->positions.shape[0] = 2; return "positions [2] for T = 3";
    case 6: a->k.shape[2] = 4; return "k head dim 4, q head dim 8";
    case 7: a->q.dtype = KILN_HAL_I32; return "q i32";
    case 8: past_end(&a->q, g_b[0]); return "q past the end of its buffer";
    case 9: a->style = 5; return "style 5";
    default: return NULL;
  }
}

static const char *silu_mul_mut(kiln_hal_silu_mul_args_t *a, int m) {
  switch (m) {
    case 0: a->x.shape[1] = 11; return "x [3, 11]: odd";
    case 1: a->out.shape[1] = 4; return "out [3, 4] for x [3, 10]";
    case 2: a->out.dtype = KILN_HAL_F16; return "out f16 with x f32";
    case 3: a->x.dtype = a->out.dtype = KILN_HAL_I32; return "x, out i32";
    case 4: past_end(&a->out, g_b[1]); return "out past the end of its buffer";
    case 5:
      a->x.stride[0] = 20;
      a->x.stride[1] = 2;
      return "x last dim not contiguous";
    case 6: a->act = 7; return "act 7";
    default: return NULL;
  }
}

static const char *add_mut(kiln_hal_add_args_t *a, int m) {
  switch (m) {
    case 0: a->b.shape[1] = 4; return "b [3, 4] with a [3, 5]";
    case 1: a->b.dtype = KILN_HAL_F16; return "b f16 with a f32";
    case 2: past_end(&a->out, g_b[2]); return "out past the end of its buffer";
    case 3:
      a->a.stride[0] = 10;
      a->a.stride[1] = 2;
      return "a last dim not contiguous";
    case 4: a->a.dtype = a->b.dtype = a->out.dtype = KILN_HAL_I32; return "all i32";
    default: return NULL;
  }
}

static const char *copy_mut(kiln_hal_copy_args_t *a, int m) {
  switch (m) {
    case 0: a->dst.shape[1] = 4; return "dst [3, 4] for src [3, 5]";
    case 1: a->src.dtype = KILN_HAL_I32; return "i32 -> f32";
    case 2:
      a->src.dtype = KILN_HAL_I32;
      a->dst.dtype = KILN_HAL_I64;
      return "i32 -> i64";
    case 3: past_end(&a->dst, g_b[1]); return "dst past the end of its buffer";
    case 4: a->src.stride[0] = 100; return "src rows strided past the end of its buffer";
    case 5: a->src.ndim = a->dst.ndim = 5; return "ndim 5";
    default: return NULL;
  }
}

static const char *kv_write_mut(kiln_hal_kv_write_args_t *a, int m) {
  switch (m) {
    case 0: a->k.dtype = a->v.dtype = KILN_HAL_F16; return "k, v f16 with the cache f32";
    case 1: a->k.shape[2] = 4; return "k head dim 4, cache head dim 8";
    case 2: a->slot_mapping.dtype = KILN_HAL_F32; return "slot_mapping f32";
    case 3: a->k_cache.offset = 8 * 4; return "k_cache past the end of its buffer";
    case 4:
      a->k.stride[0] = 32;
      a->k.stride[1] = 16;
      a->k.stride[2] = 2;
      return "k last dim not contiguous";
    case 5: a->k_cache.ndim = 3; return "k_cache ndim 3";
    case 6: a->v.shape[1] = 1; return "v with 1 head, cache with 2";
    case 7: a->slot_mapping.shape[0] = 2; return "slot_mapping [2] for T = 3";
    /* ABI 1.7: the FP8 KV cache */
    case 8: a->kv_format = 2; return "kv_format 2";
    case 9:
      a->kv_format = KILN_HAL_KV_FP8_E4M3;
      a->k_scale = a->v_scale = 1.0f;
      return "kv_format fp8_e4m3 with f32 caches";
    case 10:
      a->kv_format = KILN_HAL_KV_FP8_E4M3;
      a->k_cache.dtype = a->v_cache.dtype = KILN_HAL_U8;
      a->k_scale = 0.0f;
      a->v_scale = 1.0f;
      return "fp8_e4m3 caches with k_scale 0";
    case 11:
      a->kv_format = KILN_HAL_KV_FP8_E4M3;
      a->k_cache.dtype = a->v_cache.dtype = KILN_HAL_U8;
      a->k_scale = 1.0f;
      a->v_scale = INFINITY;
      return "fp8_e4m3 caches with v_scale inf";
    case 12:
      a->k_cache.dtype = a->v_cache.dtype = KILN_HAL_U8;
      return "u8 caches with kv_format float";
    default: return NULL;
  }
}

static const char *attention_mut(kiln_hal_attention_args_t *a, int m) {
  switch (m) {
    case 0: a->q.dtype = a->out.dtype = KILN_HAL_I32; return "q, out i32";
    case 1: a->q.shape[2] = a->out.shape[2] = 4; return "q head dim 4, cache head dim 8";
    case 2: a->q.shape[1] = a->out.shape[1] = 3; return "3 query heads over 2 KV heads";
    case 3: a->block_table.dtype = KILN_HAL_F32; return "block_table f32";
    case 4: a->query_start_loc.shape[0] = 2; return "query_start_loc [2] for S = 2";
    case 5: a->num_seqs = 3; return "num_seqs 3 with a [2, 2] block table";
    case 6: past_end(&a->out, g_b[1]); return "out past the end of its buffer";
    case 7:
      a->q.stride[0] = 64;
      a->q.stride[1] = 16;
      a->q.stride[2] = 2;
      return "q last dim not contiguous";
    case 8: a->out.dtype = KILN_HAL_F16; return "out f16 with q f32";
    case 9: a->seq_lens.shape[0] = 1; return "seq_lens [1] for S = 2";
    case 10: a->v_cache.shape[2] = 2; return "v_cache block size 2, k_cache 4";
    case 11: a->k_cache.dtype = a->v_cache.dtype = KILN_HAL_I32; return "caches i32";
    /* ABI 1.7: the FP8 KV cache */
    case 12: a->kv_format = -1; return "kv_format -1";
    case 13:
      a->kv_format = KILN_HAL_KV_FP8_E4M3;
      a->k_scale = a->v_scale = 1.0f;
      return "kv_format fp8_e4m3 with f32 caches";
    case 14:
      a->kv_format = KILN_HAL_KV_FP8_E4M3;
      a->k_cache.dtype = a->v_cache.dtype = KILN_HAL_U8;
      a->k_scale = 1.0f;
      a->v_scale = NAN;
      return "fp8_e4m3 caches with v_scale NaN";
    case 15:
      a->kv_format = KILN_HAL_KV_FP8_E4M3;
      a->k_cache.dtype = KILN_HAL_U8;
      a->k_scale = a->v_scale = 1.0f;
      return "fp8_e4m3 with a u8 k_cache and an f32 v_cache";
    default: return NULL;
  }
}

static const char *argmax_mut(kiln_hal_argmax_args_t *a, int m) {
  switch (m) {
    case 0: a->logits.dtype = KILN_HAL_F16; return "logits f16";
    case 1: a->out_ids.dtype = KILN_HAL_F32; return "out_ids f32";
    case 2: a->out_ids.shape[0] = 2; return "out_ids [2] for S = 3";
    case 3: past_end(&a->logits, g_b[0]); return "logits past the end of its buffer";
    case 4:
      a->logits.stride[0] = 20;
      a->logits.stride[1] = 2;
      return "logits last dim not contiguous";
    case 5: a->out_logprob.shape[0] = 2; return "out_logprob [2] for S = 3";
    default: return NULL;
  }
}

static const char *topk_mut(kiln_hal_topk_args_t *a, int m) {
  switch (m) {
    case 0: a->out_values.shape[1] = a->out_ids.shape[1] = 11; return "k = 11 > V = 10";
    case 1: a->out_ids.shape[1] = 3; return "out_ids [3, 3], out_values [3, 4]";
    case 2: a->out_values.dtype = KILN_HAL_F16; return "out_values f16";
    case 3: a->out_lse.shape[0] = 2; return "out_lse [2] for S = 3";
    case 4: past_end(&a->logits, g_b[0]); return "logits past the end of its buffer";
    case 5: a->logits.dtype = KILN_HAL_F16; return "logits f16";
    default: return NULL;
  }
}

static const char *penalize_mut(kiln_hal_penalize_args_t *a, int m) {
  switch (m) {
    case 0: a->logits.dtype = KILN_HAL_F16; return "logits f16";
    case 1: a->prompt_offsets.shape[0] = 2; return "prompt_offsets [2] for S = 2";
    case 2: a->repetition.shape[0] = 1; return "repetition [1] for S = 2";
    case 3: a->output_ids.dtype = KILN_HAL_F32; return "output_ids f32";
    case 4: a->bias_values.dtype = KILN_HAL_F16; return "bias_values f16";
    case 5: past_end(&a->logits, g_b[0]); return "logits past the end of its buffer";
    case 6:
      a->logits.stride[0] = 20;
      a->logits.stride[1] = 2;
      return "logits last dim not contiguous";
    case 7: a->presence = oh_absent(); return "frequency without presence";
    case 8:
      a->output_ids = oh_absent();
      a->output_offsets = oh_absent();
      return "frequency/presence without the output list";
    default: return NULL;
  }
}

static const char *sample_mut(kiln_hal_sample_args_t *a, int m) {
  switch (m) {
    case 0: a->logits.dtype = KILN_HAL_F16; return "logits f16";
    case 1: a->temperature.shape[0] = 2; return "temperature [2] for S = 3";
    case 2: a->top_k.dtype = KILN_HAL_F32; return "top_k f32";
    case 3: a->out_ids.shape[0] = 2; return "out_ids [2] for S = 3";
    case 4: a->uniform = oh_absent(); return "uniform absent";
    case 5: past_end(&a->logits, g_b[0]); return "logits past the end of its buffer";
    case 6: a->out_logprob.dtype = KILN_HAL_F16; return "out_logprob f16";
    default: return NULL;
  }
}

static void bad_args_run(const oh_backend_t *be) {
  const int32_t F = KILN_HAL_F32, I = KILN_HAL_I32;
  { /* gemm: [4, 8] @ [8, 6] + bias[6] */
    g_b[0] = bad_buf(be, 4 * 128, 'f');
    g_b[1] = bad_buf(be, 4 * 160, 'f');
    g_b[2] = bad_buf(be, 4 * 64, 'p');
    g_b[3] = bad_buf(be, 4 * 8, 'f');
    kiln_hal_gemm_args_t base = {sizeof(base),
                                 v2(g_b[0], F, 4, 8),
                                 v2(g_b[1], F, 8, 6),
                                 v2(g_b[2], F, 4, 6),
                                 v1(g_b[3], F, 6),
                                 1.0f,
                                 0.0f,
                                 false};
    oh_buf_t *watch[] = {g_b[2]};
    BAD_LOOP(gemm, kiln_hal_gemm_args_t, base, watch, gemm_mut);
    oh_free_all();
  }
  { /* embedding: table [10, 8], 4 ids */
    g_b[0] = bad_buf(be, 4 * 80, 'f');
    g_b[1] = bad_buf(be, 4 * 4, '0');
    g_b[2] = bad_buf(be, 4 * 64, 'p');
    kiln_hal_embedding_args_t base = {sizeof(base), v2(g_b[0], F, 10, 8), v1(g_b[1], I, 4),
                                      v2(g_b[2], F, 4, 8)};
    oh_buf_t *watch[] = {g_b[2]};
    BAD_LOOP(embedding, kiln_hal_embedding_args_t, base, watch, embedding_mut);
    oh_free_all();
  }
  { /* rmsnorm: x, residual [3, 8] */
    g_b[0] = bad_buf(be, 4 * 48, 'f');
    g_b[1] = bad_buf(be, 4 * 24, 'f');
    g_b[2] = bad_buf(be, 4 * 8, 'f');
    g_b[3] = bad_buf(be, 4 * 24, 'p');
    kiln_hal_rmsnorm_args_t base = {sizeof(base),
                                    v2(g_b[0], F, 3, 8),
                                    v2(g_b[1], F, 3, 8),
                                    v1(g_b[2], F, 8),
                                    v2(g_b[3], F, 3, 8),
                                    1e-5f,
                                    0.0f};
    oh_buf_t *watch[] = {g_b[0], g_b[1], g_b[3]};
    BAD_LOOP(rmsnorm, kiln_hal_rmsnorm_args_t, base, watch, rmsnorm_mut);
    oh_free_all();
  }
  { /* rope: q [3, 2, 8], k [3, 1, 8], P = 4, R = 8 */
    g_b[0] = bad_buf(be, 4 * 96, 'f');
    g_b[1] = bad_buf(be, 4 * 24, 'f');
    g_b[2] = bad_buf(be, 4 * 3, '0');
    g_b[3] = bad_buf(be, 4 * 40, 'f');
    kiln_hal_rope_args_t base = {sizeof(base),     v3(g_b[0], F, 3, 2, 8), v3(g_b[1], F, 3, 1, 8),
                                 v1(g_b[2], I, 3), v2(g_b[3], F, 4, 8),    KILN_HAL_ROPE_NEOX};
    oh_buf_t *watch[] = {g_b[0], g_b[1]};
    BAD_LOOP(rope, kiln_hal_rope_args_t, base, watch, rope_mut);
    oh_free_all();
  }
  { /* silu_mul: x [3, 10] -> out [3, 5] */
    g_b[0] = bad_buf(be, 4 * 64, 'f');
    g_b[1] = bad_buf(be, 4 * 15, 'p');
    kiln_hal_silu_mul_args_t base = {sizeof(base), v2(g_b[0], F, 3, 10), v2(g_b[1], F, 3, 5),
                                     KILN_HAL_ACT_SILU};
    oh_buf_t *watch[] = {g_b[1]};
    BAD_LOOP(silu_mul, kiln_hal_silu_mul_args_t, base, watch, silu_mul_mut);
    oh_free_all();
  }
  { /* add: [3, 5] */
    g_b[0] = bad_buf(be, 4 * 32, 'f');
    g_b[1] = bad_buf(be, 4 * 15, 'f');
    g_b[2] = bad_buf(be, 4 * 15, 'p');
    kiln_hal_add_args_t base = {sizeof(base), v2(g_b[0], F, 3, 5), v2(g_b[1], F, 3, 5),
                                v2(g_b[2], F, 3, 5)};
    oh_buf_t *watch[] = {g_b[2]};
    BAD_LOOP(add, kiln_hal_add_args_t, base, watch, add_mut);
    oh_free_all();
  }
  { /* copy: [3, 5] */
    g_b[0] = bad_buf(be, 4 * 15, 'f');
    g_b[1] = bad_buf(be, 8 * 15, 'p');
    kiln_hal_copy_args_t base = {sizeof(base), v2(g_b[0], F, 3, 5), v2(g_b[1], F, 3, 5)};
    oh_buf_t *watch[] = {g_b[1]};
    BAD_LOOP(copy, kiln_hal_copy_args_t, base, watch, copy_mut);
    oh_free_all();
  }
  { /* kv_write: k, v [3, 2, 8] into [3, 2, 4, 8] caches */
    g_b[0] = bad_buf(be, 4 * 96, 'f');
    g_b[1] = bad_buf(be, 4 * 48, 'f');
    g_b[2] = bad_buf(be, 4 * 192, 'p');
    g_b[3] = bad_buf(be, 4 * 192, 'p');
    g_b[4] = bad_buf(be, 4 * 3, '0');
    int64_t cs[4] = {3, 2, 4, 8};
    kiln_hal_kv_write_args_t base = {sizeof(base),
                                     v3(g_b[0], F, 3, 2, 8),
                                     v3(g_b[1], F, 3, 2, 8),
                                     oh_view(g_b[2], 0, F, 4, cs, NULL),
                                     oh_view(g_b[3], 0, F, 4, cs, NULL),
                                     v1(g_b[4], I, 3),
                                     KILN_HAL_KV_FLOAT,
                                     0.0f,
                                     0.0f};
    oh_buf_t *watch[] = {g_b[2], g_b[3]};
    BAD_LOOP(kv_write, kiln_hal_kv_write_args_t, base, watch, kv_write_mut);
    oh_free_all();
  }
  { /* attention: q [3, 4, 8], caches [4, 2, 4, 8], S = 2 (q_len 2 of 2, 1 of 1) */
    g_b[0] = bad_buf(be, 4 * 192, 'f');
    g_b[1] = bad_buf(be, 4 * 96, 'p');
    g_b[2] = bad_buf(be, 4 * 256, 'f');
    g_b[3] = bad_buf(be, 4 * 256, 'f');
    g_b[4] = bad_buf(be, 4 * 4, '0');
    g_b[5] = bad_buf(be, 4 * 2, '0');
    g_b[6] = bad_buf(be, 4 * 3, '0');
    int32_t lens[2] = {2, 1}, qsl[3] = {0, 2, 3};
    memcpy(g_b[5]->host, lens, sizeof(lens));
    memcpy(g_b[6]->host, qsl, sizeof(qsl));
    oh_push(g_b[5]);
    oh_push(g_b[6]);
    int64_t cs[4] = {4, 2, 4, 8};
    kiln_hal_attention_args_t base;
    memset(&base, 0, sizeof(base));
    base.struct_size = sizeof(base);
    base.q = v3(g_b[0], F, 3, 4, 8);
    base.out = v3(g_b[1], F, 3, 4, 8);
    base.k_cache = oh_view(g_b[2], 0, F, 4, cs, NULL);
    base.v_cache = oh_view(g_b[3], 0, F, 4, cs, NULL);
    base.block_table = v2(g_b[4], I, 2, 2);
    base.seq_lens = v1(g_b[5], I, 2);
    base.query_start_loc = v1(g_b[6], I, 3);
    base.num_seqs = 2;
    base.max_query_len = 2;
    base.max_seq_len = 2;
    base.scale = 0.35f;
    base.causal = true;
    oh_buf_t *watch[] = {g_b[1]};
    BAD_LOOP(attention, kiln_hal_attention_args_t, base, watch, attention_mut);
    oh_free_all();
  }
  { /* argmax: [3, 10] */
    g_b[0] = bad_buf(be, 4 * 60, 'f');
    g_b[1] = bad_buf(be, 4 * 3, 'p');
    g_b[2] = bad_buf(be, 4 * 3, 'p');
    kiln_hal_argmax_args_t base = {sizeof(base), v2(g_b[0], F, 3, 10), v1(g_b[1], I, 3),
                                   v1(g_b[2], F, 3)};
    oh_buf_t *watch[] = {g_b[1], g_b[2]};
    BAD_LOOP(argmax, kiln_hal_argmax_args_t, base, watch, argmax_mut);
    oh_free_all();
  }
  { /* topk: [3, 10], k = 4 */
    g_b[0] = bad_buf(be, 4 * 30, 'f');
    g_b[1] = bad_buf(be, 4 * 33, 'p');
    g_b[2] = bad_buf(be, 4 * 33, 'p');
    g_b[3] = bad_buf(be, 4 * 3, 'p');
    kiln_hal_topk_args_t base = {sizeof(base), v2(g_b[0], F, 3, 10), v2(g_b[1], F, 3, 4),
                                 v2(g_b[2], I, 3, 4), v1(g_b[3], F, 3)};
    oh_buf_t *watch[] = {g_b[1], g_b[2], g_b[3]};
    BAD_LOOP(topk, kiln_hal_topk_args_t, base, watch, topk_mut);
    oh_free_all();
  }
  { /* penalize: [2, 10], every group present, empty token lists */
    g_b[0] = bad_buf(be, 4 * 40, 'f');
    g_b[1] = bad_buf(be, 4 * 1, '0');
    g_b[2] = bad_buf(be, 4 * 3, '0');
    g_b[3] = bad_buf(be, 4 * 2, 'f');
    g_b[4] = bad_buf(be, 4 * 1, 'f');
    kiln_hal_penalize_args_t base;
    memset(&base, 0, sizeof(base));
    base.struct_size = sizeof(base);
    base.logits = v2(g_b[0], F, 2, 10);
    base.prompt_ids = base.output_ids = base.bias_ids = v1(g_b[1], I, 1);
    base.prompt_offsets = base.output_offsets = base.bias_offsets = v1(g_b[2], I, 3);
    base.repetition = base.frequency = base.presence = v1(g_b[3], F, 2);
    base.bias_values = v1(g_b[4], F, 1);
    oh_buf_t *watch[] = {g_b[0]};
    BAD_LOOP(penalize, kiln_hal_penalize_args_t, base, watch, penalize_mut);
    oh_free_all();
  }
  { /* sample: [3, 10] */
    g_b[0] = bad_buf(be, 4 * 30, 'f');
    g_b[1] = bad_buf(be, 4 * 3, '0'); /* temperature 1 (set below) */
    g_b[2] = bad_buf(be, 4 * 3, '0');
    g_b[3] = bad_buf(be, 4 * 3, 'p');
    g_b[4] = bad_buf(be, 4 * 3, 'p');
    float ones[3] = {1.0f, 1.0f, 1.0f};
    memcpy(g_b[1]->host, ones, sizeof(ones));
    oh_push(g_b[1]);
    oh_buf_t *top_p = bad_buf(be, 4 * 3, '0'), *min_p = bad_buf(be, 4 * 3, '0');
    oh_buf_t *uni = bad_buf(be, 4 * 3, '0');
    memcpy(top_p->host, ones, sizeof(ones));
    oh_push(top_p);
    kiln_hal_sample_args_t base = {sizeof(base),     v2(g_b[0], F, 3, 10), v1(g_b[1], F, 3),
                                   v1(g_b[2], I, 3), v1(top_p, F, 3),      v1(min_p, F, 3),
                                   v1(uni, F, 3),    v1(g_b[3], I, 3),     v1(g_b[4], F, 3)};
    oh_buf_t *watch[] = {g_b[3], g_b[4]};
    BAD_LOOP(sample, kiln_hal_sample_args_t, base, watch, sample_mut);
    oh_free_all();
  }
}

void test_ops_bad_args(void **state) {
  (void)state;
  oh_test_begin("bad_args");
  for (int bi = 0; bi < oh_num_backends; bi++) bad_args_run(&oh_backends[bi]);
  oh_test_end();
}
