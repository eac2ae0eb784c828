/* ops_cases_vision.c - conformance cases for the ABI 1.2 ops of the vision encoders (layernorm,
 * activation), against the fp64 reference on fresh random inputs, their argument checks, and
 * their capture in a graph. A backend whose table lacks an op (a 1.1 plugin) is skipped with a
 * note: the ops are optional. */
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

static const char *act_label(int32_t act) {
  switch (act) {
    case KILN_HAL_ACT_SILU: return "silu";
    case KILN_HAL_ACT_GELU_TANH: return "gelu_tanh";
    case KILN_HAL_ACT_GELU: return "gelu";
    case KILN_HAL_ACT_QUICK_GELU: return "quick_gelu";
    default: return "?";
  }
}

/* True when the backend has the op; otherwise says so once per test and backend. */
static bool has_op(const oh_backend_t *be, const void *fn, const char *op) {
  if (fn) return true;
  printf("test_ops: [%s] has no %s (optional in ABI 1.2): skipped\n", be->name, op);
  return false;
}

/* ============================================================================= layernorm == */

typedef struct layernorm_case {
  int64_t T, H;
  bool residual, bias, alias_x, strided;
  double mean_offset; /* rows are centred near +-mean_offset: cancellation in the variance */
  float eps;
} layernorm_case_t;

/* LayerNorm's error budget beyond the output rounding: an f32 mean and a two-pass variance
 * (tree or pairwise sums) err by a few dozen f32 ulps of |s - mean| and |mean|, which the
 * normalisation scales by rstd * |w| (mtol 4e-6 ~ 64 ulps). A one-pass E[s^2] - mean^2 in f32
 * loses ~2^-24 * mean^2 / var of the variance and fails the rows centred near 100. */
static void layernorm_mag(int64_t T, int64_t H, const double *s, const double *w, const double *b,
                          double eps, double *mag) {
  for (int64_t t = 0; t < T; t++) {
    const double *r = s + t * H;
    double mean = 0.0, var = 0.0;
    for (int64_t h = 0; h < H; h++) mean += r[h];
    mean /= (double)H;
    for (int64_t h = 0; h < H; h++) var += (r[h] - mean) * (r[h] - mean);
    double inv = 1.0 / sqrt(var / (double)H + eps);
    for (int64_t h = 0; h < H; h++)
      mag[t * H + h] = (fabs(r[h] - mean) + fabs(mean)) * inv * fabs(w[h]) + (b ? fabs(b[h]) : 0);
  }
}

static void layernorm_run(const oh_backend_t *be, int32_t dt, const layernorm_case_t *r) {
  const int64_t T = r->T, H = r->H, pad = r->strided ? 3 : 0;
  const size_t es = kiln_hal_dtype_size(dt);
  oh_case(be, "layernorm", dt, "T=%lld H=%lld residual=%d bias=%d out%sx strided=%d mean~%g eps=%g",
          (long long)T, (long long)H, r->residual, r->bias, r->alias_x ? "==" : "!=", r->strided,
          r->mean_offset, (double)r->eps);
  oh_buf_t *xb = oh_buf_new(be, (size_t)(T * (H + pad) + 2) * es);
  oh_buf_t *rb = oh_buf_new(be, (size_t)(T * (H + 2 * pad) + 2) * es);
  oh_buf_t *wb = oh_buf_new(be, (size_t)(H + 1) * es);
  oh_buf_t *bb = oh_buf_new(be, (size_t)(H + 3) * es);
  oh_buf_t *ob = r->alias_x ? xb : oh_buf_new(be, (size_t)(T * (H + pad + 1) + 4) * es);
  double *x = OH_NEW(double, T *H), *res = OH_NEW(double, T *H), *w = OH_NEW(double, H);
  double *bias = OH_NEW(double, H), *want = OH_NEW(double, T *H), *got = OH_NEW(double, T *H);
  double *mag = OH_NEW(double, T *H);
  int64_t shape[2] = {T, H}, xs[2] = {H + pad, 1}, rs[2] = {H + 2 * pad, 1},
          os[2] = {H + pad + (r->alias_x ? 0 : 1), 1}, wshape[1] = {H};
  kiln_hal_layernorm_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.x = oh_view(xb, 0, dt, 2, shape, xs);
  a.residual = r->residual ? oh_view(rb, 0, dt, 2, shape, rs) : oh_absent();
  a.weight = oh_view(wb, 0, dt, 1, wshape, NULL);
  a.bias = r->bias ? oh_view(bb, 2 * es, dt, 1, wshape, NULL) : oh_absent();
  a.out = r->alias_x ? a.x : oh_view(ob, 0, dt, 2, shape, os);
  a.eps = r->eps;
  /* x (and residual) rows: a random spread of +-2 around a per-row mean of up to +-offset. */
  oh_write_rand(xb, &a.x, -2, 2, x);
  for (int64_t t = 0; t < T; t++) {
    double m = oh_rand_uniform(-r->mean_offset, r->mean_offset);
    for (int64_t h = 0; h < H; h++) x[t * H + h] += m;
  }
  oh_write(xb, &a.x, x);
  if (r->residual) oh_write_rand(rb, &a.residual, -2, 2, res);
  oh_write_rand(wb, &a.weight, -1.5, 1.5, w);
  if (r->bias) oh_write_rand(bb, &a.bias, -0.5, 0.5, bias);
  oh_push(xb);
  oh_push(rb);
  oh_push(wb);
  oh_push(bb);
  if (oh_ok(be->t->layernorm(be->stream, &a), "layernorm") && oh_pull(ob)) {
    ops_ref_layernorm(dt, T, H, x, r->residual ? res : NULL, w, r->bias ? bias : NULL,
                      (double)r->eps, want);
    layernorm_mag(T, H, r->residual ? res : x, w, r->bias ? bias : NULL, (double)r->eps, mag);
    oh_tol_t tol = oh_tol_elementwise(dt);
    tol.mtol = 4e-6;
    oh_mark(ob, &a.out);
    oh_read(ob, &a.out, got);
    oh_compare("out", T * H, got, want, mag, tol);
    oh_check_rest(ob, r->alias_x ? "x/out (row padding)" : "out (row padding / tail)");
    if (!r->alias_x && oh_pull(xb)) oh_check_rest(xb, "x (an input)");
    if (oh_pull(wb)) oh_check_rest(wb, "weight (an input)");
    if (oh_pull(bb)) oh_check_rest(bb, "bias (an input)");
    if (r->residual && oh_pull(rb)) {
      oh_mark(rb, &a.residual);
      oh_read(rb, &a.residual, got);
      oh_compare("residual", T * H, got, res, NULL, oh_tol_elementwise(dt));
      oh_check_rest(rb, "residual (row padding)");
    }
  }
  free(x);
  free(res);
  free(w);
  free(bias);
  free(want);
  free(got);
  free(mag);
  oh_free_all();
}

void test_ops_layernorm(void **state) {
  (void)state;
  /* Qwen2-VL's vision blocks are H = 1280, its merger's LayerNorm H = 1280 and the LLM side
   * 3584; the rest are odd sizes, one row, one column and sizes across block widths. */
  static const int64_t shapes[][2] = {{1, 1},    {3, 17},   {17, 128}, {5, 1000},
                                      {4, 1280}, {2, 3584}, {3, 4097}, {33, 80}};
  oh_test_begin("layernorm");
  for (int bi = 0; bi < oh_num_backends; bi++) {
    const oh_backend_t *be = &oh_backends[bi];
    if (!has_op(be, (const void *)be->t->layernorm, "layernorm")) continue;
    for (int di = 0; di < 3; di++) {
      int32_t dt = oh_float_dtypes[di];
      if (!oh_dtype_ok(be, dt)) continue;
      for (size_t si = 0; si < ARRAY_LEN(shapes); si++) {
        if (oh_skip_big((double)shapes[si][0] * (double)shapes[si][1] * 64.0)) continue;
        for (int combo = 0; combo < 4; combo++) {
          layernorm_case_t c = {shapes[si][0], shapes[si][1], combo & 1, (combo & 2) != 0,
                                false,         false,         0.0,       si % 2 ? 1e-6f : 1e-5f};
          c.alias_x = ((size_t)combo + si) % 3 == 1;
          c.strided = ((size_t)combo + si) % 2 == 1;
          static const double offsets[] = {0.5, 8.0, 0.5, 100.0};
          c.mean_offset = offsets[((size_t)combo + si) % 4];
          layernorm_run(be, dt, &c);
        }
      }
    }
  }
  oh_test_end();
}

/* ============================================================================ activation == */

static void activation_run(const oh_backend_t *be, int32_t dt, int32_t act, int64_t T, int64_t N,
                           int64_t pad, bool alias) {
  const size_t es = kiln_hal_dtype_size(dt);
  oh_case(be, "activation", dt, "act=%s T=%lld N=%lld pad=%lld out%sx", act_label(act),
          (long long)T, (long long)N, (long long)pad, alias ? "==" : "!=");
  oh_buf_t *xb = oh_buf_new(be, (size_t)(T * (N + pad) + 1) * es);
  oh_buf_t *ob = alias ? xb : oh_buf_new(be, (size_t)(T * (N + 2 * pad) + 3) * es);
  double *x = OH_NEW(double, T *N), *want = OH_NEW(double, T *N), *got = OH_NEW(double, T *N);
  int64_t shape[2] = {T, N}, xst[2] = {N + pad, 1}, ost[2] = {N + 2 * pad, 1};
  kiln_hal_activation_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.x = oh_view(xb, 0, dt, 2, shape, xst);
  a.out = alias ? a.x : oh_view(ob, es, dt, 2, shape, ost);
  a.act = act;
  oh_write_rand(xb, &a.x, -6, 6, x);
  oh_push(xb);
  if (oh_ok(be->t->activation(be->stream, &a), "activation") && oh_pull(ob)) {
    ops_ref_activation(act, T * N, x, want);
    oh_mark(ob, &a.out);
    oh_read(ob, &a.out, got);
    oh_compare("out", T * N, got, want, NULL, oh_tol_elementwise(dt));
    oh_check_rest(ob, alias ? "x/out (row padding)" : "out (row padding / head / tail)");
    if (!alias && oh_pull(xb)) oh_check_rest(xb, "x (an input)");
  }
  free(x);
  free(want);
  free(got);
  oh_free_all();
}

void test_ops_activation(void **state) {
  (void)state;
  /* {T, N, pad}: Qwen2-VL's vision MLP is N = 5120 (1280 * 4); odd sizes for vector tails. */
  static const int64_t shapes[][3] = {{1, 1, 0},   {3, 17, 2},   {17, 128, 0},
                                      {4, 300, 5}, {2, 5120, 0}, {5, 1283, 1}};
  oh_test_begin("activation");
  for (int bi = 0; bi < oh_num_backends; bi++) {
    const oh_backend_t *be = &oh_backends[bi];
    if (!has_op(be, (const void *)be->t->activation, "activation")) continue;
    for (int di = 0; di < 3; di++) {
      if (!oh_dtype_ok(be, oh_float_dtypes[di])) continue;
      for (int32_t act = 0; act <= KILN_HAL_ACT_QUICK_GELU; act++) {
        for (size_t si = 0; si < ARRAY_LEN(shapes); si++)
          activation_run(be, oh_float_dtypes[di], act, shapes[si][0], shapes[si][1], shapes[si][2],
                         (si + (size_t)act) % 2 == 1);
      }
    }
  }
  oh_test_end();
}

/* ======================================================================= bad arguments == */

static kiln_hal_tensor_t vec_view(const oh_buf_t *b, int32_t dt, int64_t n) {
  int64_t shape[1] = {n};
  return oh_view(b, 0, dt, 1, shape, NULL);
}

static kiln_hal_tensor_t mat(const oh_buf_t *b, uint64_t off, int32_t dt, int64_t rows,
                             int64_t cols) {
  int64_t shape[2] = {rows, cols};
  return oh_view(b, off, dt, 2, shape, NULL);
}

/* Each mutation of a valid call must be refused with an error (never run, never crash), and
 * the valid call itself must succeed (so the refusals are about the mutation). */
static void vision_bad_args_run(const oh_backend_t *be) {
  const int32_t dt = KILN_HAL_F32;
  oh_buf_t *xb = oh_buf_new(be, 3 * 8 * 4), *rb = oh_buf_new(be, 3 * 8 * 4);
  oh_buf_t *wb = oh_buf_new(be, 16 * 4), *ob = oh_buf_new(be, 3 * 8 * 4);
  if (be->t->layernorm) {
    kiln_hal_layernorm_args_t base = {sizeof(base),
                                      mat(xb, 0, dt, 3, 8),
                                      mat(rb, 0, dt, 3, 8),
                                      vec_view(wb, dt, 8),
                                      vec_view(wb, dt, 8),
                                      mat(ob, 0, dt, 3, 8),
                                      1e-6f};
    double zeros[3 * 8] = {0};
    oh_write(xb, &base.x, zeros);
    oh_write(rb, &base.residual, zeros);
    oh_push(xb);
    oh_push(rb);
    oh_case(be, "layernorm", dt, "a valid call (the base of the bad ones)");
    oh_ok(be->t->layernorm(be->stream, &base), "layernorm");
    for (int m = 0; m < 9; m++) {
      kiln_hal_layernorm_args_t a = base;
      const char *what = "";
      switch (m) {
        case 0:
          what = "out aliases residual";
          a.out = a.residual;
          break;
        case 1:
          what = "weight has H-1 elements";
          a.weight = vec_view(wb, dt, 7);
          break;
        case 2:
          what = "bias has H+1 elements";
          a.bias = vec_view(wb, dt, 9);
          break;
        case 3:
          what = "bias is f16 with f32 x";
          a.bias = vec_view(wb, KILN_HAL_F16, 8);
          break;
        case 4:
          what = "eps is NaN";
          a.eps = NAN;
          break;
        case 5:
          what = "eps is negative";
          a.eps = -1e-6f;
          break;
        case 6:
          what = "out is [3, 7]";
          a.out = mat(ob, 0, dt, 3, 7);
          break;
        case 7:
          what = "residual is [2, 8]";
          a.residual = mat(rb, 0, dt, 2, 8);
          break;
        case 8:
          what = "x runs past its buffer";
          a.x = mat(xb, 4, dt, 3, 8);
          break;
      }
      oh_case(be, "layernorm", dt, "bad: %s", what);
      oh_expect_error(be->t->layernorm(be->stream, &a), "layernorm");
    }
    oh_case(be, "layernorm", dt, "bad: args is NULL");
    oh_expect_error(be->t->layernorm(be->stream, NULL), "layernorm");
  }
  if (be->t->activation) {
    kiln_hal_activation_args_t base = {sizeof(base), mat(xb, 0, dt, 3, 8), mat(ob, 0, dt, 3, 8),
                                       KILN_HAL_ACT_QUICK_GELU};
    oh_case(be, "activation", dt, "a valid call (the base of the bad ones)");
    oh_ok(be->t->activation(be->stream, &base), "activation");
    for (int m = 0; m < 5; m++) {
      kiln_hal_activation_args_t a = base;
      const char *what = "";
      switch (m) {
        case 0:
          what = "act = 4";
          a.act = 4;
          break;
        case 1:
          what = "act = -1";
          a.act = -1;
          break;
        case 2:
          what = "out is [3, 4]";
          a.out = mat(ob, 0, dt, 3, 4);
          break;
        case 3:
          what = "out is f16";
          a.out = mat(ob, 0, KILN_HAL_F16, 3, 8);
          break;
        case 4:
          what = "x is i32";
          a.x = mat(xb, 0, KILN_HAL_I32, 3, 8);
          break;
      }
      oh_case(be, "activation", dt, "bad: %s", what);
      oh_expect_error(be->t->activation(be->stream, &a), "activation");
    }
  }
  /* silu_mul takes QUICK_GELU since 1.2, and still refuses what is not an activation. */
  int64_t xs[2] = {3, 8}, os[2] = {3, 4};
  kiln_hal_silu_mul_args_t s = {sizeof(s), oh_view(xb, 0, dt, 2, xs, NULL),
                                oh_view(ob, 0, dt, 2, os, NULL), 4};
  oh_case(be, "silu_mul", dt, "bad: act = 4");
  oh_expect_error(be->t->silu_mul(be->stream, &s), "silu_mul");
  oh_free_all();
}

void test_ops_vision_bad_args(void **state) {
  (void)state;
  oh_test_begin("vision_bad_args");
  for (int bi = 0; bi < oh_num_backends; bi++) vision_bad_args_run(&oh_backends[bi]);
  oh_test_end();
}

/* ================================================================================ graphs == */

/* Captures layernorm -> activation, then replays it twice with new inputs written between. */
static void vision_graph_run(const oh_backend_t *be, int32_t dt) {
  enum { T = 6, H = 96 };
  const kiln_hal_backend_t *t = be->t;
  const size_t es = kiln_hal_dtype_size(dt);
  oh_buf_t *xb = oh_buf_new(be, T * H * es), *wb = oh_buf_new(be, H * es);
  oh_buf_t *bb = oh_buf_new(be, H * es), *hb = oh_buf_new(be, T * H * es);
  kiln_hal_layernorm_args_t la = {
      sizeof(la),          mat(xb, 0, dt, T, H), oh_absent(), vec_view(wb, dt, H),
      vec_view(bb, dt, H), mat(hb, 0, dt, T, H), 1e-6f};
  kiln_hal_activation_args_t aa = {sizeof(aa), la.out, la.out, KILN_HAL_ACT_QUICK_GELU};
  double x[T * H], w[H], b[H], h[T * H], want[T * H], got[T * H];
  oh_write_rand(wb, &la.weight, -1.5, 1.5, w);
  oh_write_rand(bb, &la.bias, -0.5, 0.5, b);
  oh_push(wb);
  oh_push(bb);
  oh_case(be, "graph", dt, "capture layernorm -> activation(quick_gelu, in place)");
  kiln_hal_graph_t *g = NULL;
  bool ok = oh_ok(t->graph_begin(be->stream), "graph_begin");
  if (ok) {
    ok = oh_ok(t->layernorm(be->stream, &la), "layernorm (capturing)");
    ok = oh_ok(t->activation(be->stream, &aa), "activation (capturing)") && ok;
    ok = oh_ok(t->graph_end(be->stream, &g), "graph_end") && ok;
  }
  if (ok && !g) {
    oh_fail("graph_end returned no graph");
    ok = false;
  }
  if (ok && oh_pull(hb)) oh_check_rest(hb, "layernorm out written during capture");
  for (int rep = 0; ok && rep < 2; rep++) {
    oh_case(be, "graph", dt, "replay %d with new inputs", rep);
    oh_write_rand(xb, &la.x, -3, 3, x);
    oh_push(xb);
    if (!oh_ok(t->graph_replay(g, be->stream), "graph_replay") || !oh_pull(hb)) break;
    ops_ref_layernorm(dt, T, H, x, NULL, w, b, 1e-6, h);
    /* the activation reads the stored (rounded) layernorm output */
    for (int i = 0; i < T * H; i++) h[i] = ops_ref_round(dt, h[i]);
    ops_ref_activation(KILN_HAL_ACT_QUICK_GELU, T * H, h, want);
    oh_mark(hb, &la.out);
    oh_read(hb, &la.out, got);
    /* One ulp of slack on top of the elementwise tolerance: the activation's input is the
     * backend's rounded layernorm output, which may differ from the reference's by an ulp. */
    oh_tol_t tol = oh_tol_elementwise(dt);
    tol.rtol *= 3;
    tol.atol = dt == KILN_HAL_F32 ? 1e-5 : tol.rtol;
    oh_compare("out", T * H, got, want, NULL, tol);
  }
  if (g) t->graph_destroy(g);
  oh_free_all();
}

void test_ops_vision_graphs(void **state) {
  (void)state;
  oh_test_begin("vision_graphs");
  for (int bi = 0; bi < oh_num_backends; bi++) {
    const oh_backend_t *be = &oh_backends[bi];
    if (!be->t->layernorm || !be->t->activation || !be->t->graph_begin ||
        !(be->info.caps & KILN_HAL_CAP_GRAPHS))
      continue;
    for (int di = 0; di < 3; di++)
      if (oh_dtype_ok(be, oh_float_dtypes[di])) vision_graph_run(be, oh_float_dtypes[di]);
  }
  oh_test_end();
}
