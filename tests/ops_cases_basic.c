/* ops_cases_basic.c - conformance cases for the dense ops: gemm, embedding, rmsnorm, rope,
 * silu_mul, add and copy, each against the fp64 reference on fresh random inputs. */
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

/* Buffers are at least this large so that empty views still get a real buffer. */
static size_t min_bytes(size_t n) { return n < 64 ? 64 : n; }

/* A rows x cols matrix at byte offset off: row-major with leading dimension ld, or
 * column-major (element (r, c) at c * ld + r). */
static kiln_hal_tensor_t mat_view(const oh_buf_t *b, uint64_t off, int32_t dt, int64_t rows,
                                  int64_t cols, bool colmajor, int64_t ld) {
  int64_t shape[2] = {rows, cols};
  int64_t stride[2] = {colmajor ? 1 : ld, colmajor ? ld : 1};
  return oh_view(b, off, dt, 2, shape, stride);
}

/* ================================================================================== gemm == */

typedef struct gemm_case {
  int64_t batch; /* 0: 2-D operands */
  int64_t M, N, K;
  bool a_col, b_col;     /* column-major operand (stride[-2] == 1) */
  bool a_bcast, b_bcast; /* batch stride 0 */
  bool bias;
  float alpha, beta;
  bool c_f32;  /* c and bias in F32 whatever the input dtype */
  int64_t pad; /* extra elements per leading dimension of a, b and c */
  bool tf32;   /* allow_tf32 (only on devices with CAP_TF32; looser tolerance) */
} gemm_case_t;

static const gemm_case_t gemm_cases[] = {
    {0, 1, 1, 1, false, false, false, false, false, 1.0f, 0.0f, false, 0, false},
    {0, 1, 17, 127, false, true, false, false, false, 1.0f, 0.0f, false, 0, false},
    {0, 3, 5, 7, false, false, false, false, true, 1.0f, 0.0f, false, 2, false},
    {0, 17, 33, 1, false, true, false, false, false, 1.0f, 0.0f, false, 0, false},
    {0, 127, 1, 64, true, false, false, false, false, 1.0f, 0.0f, false, 0, false},
    {0, 64, 64, 64, false, false, false, false, true, 0.5f, 0.0f, false, 0, false},
    {0, 33, 129, 300, false, true, false, false, true, 1.0f, 0.0f, false, 3, false},
    {0, 300, 37, 129, true, true, false, false, false, 1.0f, 0.0f, false, 0, false},
    {0, 5, 19, 23, false, false, false, false, true, 1.5f, 0.75f, false, 1, false},
    {0, 8, 16, 32, false, true, false, false, false, 1.0f, 1.0f, false, 0, false},
    {3, 7, 9, 11, false, false, false, false, false, 1.0f, 0.0f, false, 0, false},
    {3, 5, 13, 17, false, true, false, true, true, 1.0f, 0.0f, false, 2, false},
    {2, 4, 6, 8, true, false, true, false, false, 1.0f, 0.5f, false, 0, false},
    {0, 3, 5, 0, false, false, false, false, true, 1.0f, 0.5f, false, 0, false},
    {0, 2, 3, 0, false, false, false, false, false, 1.0f, 0.0f, false, 1, false},
    {0, 17, 31, 65, false, true, false, false, true, 1.0f, 0.0f, true, 0, false},
    {2, 9, 10, 33, false, true, false, false, false, 1.0f, 0.25f, true, 3, false},
    {0, 64, 48, 96, false, true, false, false, false, 1.0f, 0.0f, false, 0, true},
    /* Decode shapes: M <= 8, b the [K, N] view of a PyTorch [N, K] weight, K % 8 == 0 and
     * 16-byte rows (pad 0 or 8). The CUDA plugin runs f16/bf16 ones on its skinny kernel
     * (cuda_gemv.cu): each compile-time M class padded and exact, N below/within/past a block,
     * K below one warp's stride and with a tail, bias/alpha/beta, f16/bf16 and f32 c. */
    {0, 1, 4608, 3584, false, true, false, false, true, 1.0f, 0.0f, false, 0, false},
    {0, 1, 3584, 3584, false, true, false, false, false, 1.0f, 0.0f, false, 0, false},
    {0, 1, 1, 4104, false, true, false, false, true, 1.0f, 0.5f, false, 0, false},
    {0, 1, 3584 * 3 + 5, 64, false, true, false, false, false, -0.5f, 0.0f, false, 8, false},
    {0, 2, 7, 896, false, true, false, false, true, 0.5f, 0.0f, false, 0, false},
    {0, 2, 3584 * 3 + 5, 896, false, true, false, false, false, 1.0f, 0.0f, false, 0, false},
    {0, 3, 1, 64, false, true, false, false, false, 1.0f, 0.75f, false, 0, false},
    {0, 3, 4608, 4104, false, true, false, false, false, 0.75f, 0.0f, false, 8, false},
    {0, 5, 3584 * 3 + 5, 4104, false, true, false, false, true, 1.25f, -0.5f, false, 8, false},
    {0, 5, 7, 896, false, true, false, false, true, 1.0f, 0.0f, true, 0, false},
    {0, 8, 4608, 896, false, true, false, false, true, 1.0f, 0.0f, false, 0, false},
    {0, 8, 7, 3584, false, true, false, false, false, -2.0f, 1.0f, false, 8, false},
    {0, 8, 3584 * 3 + 5, 3584, false, true, false, false, true, 1.0f, 0.0f, false, 0, false},
    {0, 8, 3584, 64, false, true, false, false, true, 1.0f, 0.25f, true, 0, false},
    /* Same kind of shapes that must take the general path: rows 2 bytes off 16-byte alignment
     * (pad 1), and b row-major (strided along K). */
    {0, 4, 4608, 896, false, true, false, false, true, 1.0f, 0.0f, false, 1, false},
    {0, 2, 3584, 896, false, false, false, false, true, 1.0f, 0.5f, false, 0, false},
    /* Enough 128 x 128 tiles (M, N > 64; >= 256 of them) for Kiln's own gemm kernel
     * (cuda_gemm_kernel.cu) to take its large tiles, each product with partial tiles in M, N
     * and K; and a batch past a grid's 65535 blocks along z. */
    {64, 130, 129, 40, true, true, false, false, true, 1.0f, 0.5f, false, 1, false},
    {80, 129, 200, 33, false, false, true, false, false, -1.0f, 0.0f, true, 0, false},
    {66000, 3, 5, 7, false, true, false, false, true, 1.0f, 0.5f, true, 0, false},
    /* Half-precision c with a bias (and beta) whose product (> 8M f32 values) is over the
     * CUDA plugin's 32 MiB f32 staging: formed in two row chunks. GPU backends only (see
     * gemm_run): the CPU has nothing new to show here. */
    {0, 4100, 2060, 24, false, true, false, false, true, 1.0f, 0.0f, false, 0, false},
    {0, 4100, 2060, 40, false, true, false, false, true, 0.5f, 0.5f, false, 8, false},
};

static void gemm_run(const oh_backend_t *be, int32_t dt, const gemm_case_t *g) {
  if (g->tf32 && (dt != KILN_HAL_F32 || !(be->info.caps & KILN_HAL_CAP_TF32))) return;
  const int32_t cdt = g->c_f32 ? KILN_HAL_F32 : dt;
  const int64_t M = g->M, N = g->N, K = g->K, B = g->batch ? g->batch : 1;
  const size_t es = kiln_hal_dtype_size(dt), ces = kiln_hal_dtype_size(cdt);
  if (oh_skip_big((double)M * (double)N * (double)(K > 0 ? K : 1) * (double)B)) return;
  if ((double)M * (double)N * (double)B > (double)(1 << 23) && be->info.kind == KILN_HAL_DEVICE_CPU)
    return; /* the large staging cases: GPU backends only */
  oh_case(be, "gemm", dt,
          "batch=%lld M=%lld N=%lld K=%lld a=%s%s b=%s%s bias=%d alpha=%g beta=%g c=%s pad=%lld%s",
          (long long)g->batch, (long long)M, (long long)N, (long long)K, g->a_col ? "col" : "row",
          g->a_bcast ? "(bcast)" : "", g->b_col ? "col" : "row", g->b_bcast ? "(bcast)" : "",
          g->bias, (double)g->alpha, (double)g->beta, kiln_hal_dtype_name(cdt), (long long)g->pad,
          g->tf32 ? " tf32" : "");

  const int64_t lda = (g->a_col ? M : K) + g->pad, msz_a = (g->a_col ? K : M) * lda;
  const int64_t ldb = (g->b_col ? K : N) + g->pad, msz_b = (g->b_col ? N : K) * ldb;
  const int64_t ldc = N + g->pad, msz_c = M * ldc;
  const int64_t na = g->a_bcast ? 1 : B, nb = g->b_bcast ? 1 : B;
  oh_buf_t *abuf = oh_buf_new(be, min_bytes((size_t)(na * msz_a) * es));
  oh_buf_t *bbuf = oh_buf_new(be, min_bytes((size_t)(nb * msz_b) * es));
  oh_buf_t *cbuf = oh_buf_new(be, (size_t)(B * msz_c + 7) * ces);
  oh_buf_t *biasbuf = oh_buf_new(be, (size_t)(N + 3) * ces);
  double *av = OH_NEW(double, B *M *K + 1), *bv = OH_NEW(double, B *K *N + 1);
  double *cin = OH_NEW(double, B *M *N + 1), *want = OH_NEW(double, B *M *N + 1);
  double *mag = OH_NEW(double, B *M *N + 1), *got = OH_NEW(double, B *M *N + 1);
  double *biasv = OH_NEW(double, N + 1);

  for (int64_t i = 0; i < B; i++) {
    if (i < na) {
      kiln_hal_tensor_t v = mat_view(abuf, (uint64_t)(i * msz_a) * es, dt, M, K, g->a_col, lda);
      oh_write_rand(abuf, &v, -1, 1, av + i * M * K);
    } else {
      memcpy(av + i * M * K, av, sizeof(double) * (size_t)(M * K));
    }
    if (i < nb) {
      kiln_hal_tensor_t v = mat_view(bbuf, (uint64_t)(i * msz_b) * es, dt, K, N, g->b_col, ldb);
      oh_write_rand(bbuf, &v, -1, 1, bv + i * K * N);
    } else {
      memcpy(bv + i * K * N, bv, sizeof(double) * (size_t)(K * N));
    }
    if (g->beta != 0.0f) {
      kiln_hal_tensor_t v = mat_view(cbuf, (uint64_t)(i * msz_c) * ces, cdt, M, N, false, ldc);
      oh_write_rand(cbuf, &v, -1, 1, cin + i * M * N);
    }
  }
  kiln_hal_tensor_t biasview = oh_absent();
  if (g->bias) {
    int64_t shape[1] = {N};
    biasview = oh_view(biasbuf, 0, cdt, 1, shape, NULL);
    oh_write_rand(biasbuf, &biasview, -1, 1, biasv);
  }
  oh_push(abuf);
  oh_push(bbuf);
  oh_push(cbuf); /* c holds NaN poison wherever beta == 0 must not read it */
  oh_push(biasbuf);

  kiln_hal_gemm_args_t args;
  memset(&args, 0, sizeof(args));
  args.struct_size = sizeof(args);
  if (g->batch) {
    int64_t sa[3] = {B, M, K},
            ta[3] = {g->a_bcast ? 0 : msz_a, g->a_col ? 1 : lda, g->a_col ? lda : 1};
    int64_t sb[3] = {B, K, N},
            tb[3] = {g->b_bcast ? 0 : msz_b, g->b_col ? 1 : ldb, g->b_col ? ldb : 1};
    int64_t sc[3] = {B, M, N}, tc[3] = {msz_c, ldc, 1};
    args.a = oh_view(abuf, 0, dt, 3, sa, ta);
    args.b = oh_view(bbuf, 0, dt, 3, sb, tb);
    args.c = oh_view(cbuf, 0, cdt, 3, sc, tc);
  } else {
    args.a = mat_view(abuf, 0, dt, M, K, g->a_col, lda);
    args.b = mat_view(bbuf, 0, dt, K, N, g->b_col, ldb);
    args.c = mat_view(cbuf, 0, cdt, M, N, false, ldc);
  }
  args.bias = biasview;
  args.alpha = g->alpha;
  args.beta = g->beta;
  args.allow_tf32 = g->tf32;
  if (oh_ok(be->t->gemm(be->stream, &args), "gemm") && oh_pull(cbuf)) {
    oh_mark(cbuf, &args.c);
    oh_read(cbuf, &args.c, got);
    for (int64_t i = 0; i < B; i++) {
      ops_ref_gemm(M, N, K, av + i * M * K, bv + i * K * N, g->bias ? biasv : NULL, g->alpha,
                   g->beta, cin + i * M * N, want + i * M * N, mag + i * M * N);
    }
    oh_tol_t tol = oh_tol_gemm(cdt);
    if (g->tf32) tol.mtol = 3e-3; /* inputs rounded to a 10-bit mantissa */
    oh_compare("c", B * M * N, got, want, mag, tol);
    oh_check_rest(cbuf, "c (row padding / tail)");
  }
  free(av);
  free(bv);
  free(cin);
  free(want);
  free(mag);
  free(got);
  free(biasv);
  oh_free_all();
}

void test_ops_gemm(void **state) {
  (void)state;
  oh_test_begin("gemm");
  for (int bi = 0; bi < oh_num_backends; bi++) {
    for (int di = 0; di < 3; di++) {
      if (!oh_dtype_ok(&oh_backends[bi], oh_float_dtypes[di])) continue;
      for (size_t ci = 0; ci < ARRAY_LEN(gemm_cases); ci++)
        gemm_run(&oh_backends[bi], oh_float_dtypes[di], &gemm_cases[ci]);
      /* Fresh shapes and layouts every run (the seed reproduces them). */
      for (int r = 0; r < 6; r++) {
        gemm_case_t g;
        memset(&g, 0, sizeof(g));
        g.batch = oh_rand_int(0, 3) == 0 ? oh_rand_int(1, 3) : 0;
        g.M = oh_rand_int(1, 150);
        g.N = oh_rand_int(1, 150);
        g.K = oh_rand_int(1, 200);
        g.a_col = oh_rand_int(0, 1);
        g.b_col = oh_rand_int(0, 1);
        g.a_bcast = g.batch && oh_rand_int(0, 3) == 0;
        g.b_bcast = g.batch && !g.a_bcast && oh_rand_int(0, 2) == 0;
        g.bias = oh_rand_int(0, 1);
        g.alpha = oh_rand_int(0, 1) ? 1.0f : (float)oh_rand_uniform(-2, 2);
        g.beta = oh_rand_int(0, 2) ? 0.0f : (float)oh_rand_uniform(-1, 1);
        g.c_f32 = oh_rand_int(0, 1);
        g.pad = oh_rand_int(0, 1) ? 0 : oh_rand_int(1, 5);
        gemm_run(&oh_backends[bi], oh_float_dtypes[di], &g);
      }
    }
  }
  oh_test_end();
}

/* ============================================================================= embedding == */

typedef struct embedding_case {
  int64_t V, H, T;
  int64_t table_pad, out_pad; /* extra elements per row */
} embedding_case_t;

static const embedding_case_t embedding_cases[] = {
    {1, 1, 3, 0, 0},
    {50, 17, 9, 0, 2},
    {1000, 128, 33, 0, 0},
    {7, 300, 12, 3, 5},
};

static void embedding_run(const oh_backend_t *be, int32_t dt, const embedding_case_t *e) {
  const int64_t V = e->V, H = e->H, T = e->T;
  const size_t es = kiln_hal_dtype_size(dt);
  oh_case(be, "embedding", dt, "V=%lld H=%lld T=%lld table_pad=%lld out_pad=%lld", (long long)V,
          (long long)H, (long long)T, (long long)e->table_pad, (long long)e->out_pad);
  oh_buf_t *tb = oh_buf_new(be, (size_t)(V * (H + e->table_pad)) * es);
  oh_buf_t *ib = oh_buf_new(be, (size_t)T * 4);
  oh_buf_t *ob = oh_buf_new(be, (size_t)(T * (H + e->out_pad) + 5) * es);
  double *tv = OH_NEW(double, V *H), *want = OH_NEW(double, T *H), *got = OH_NEW(double, T *H);
  int32_t *ids = OH_NEW(int32_t, T);
  /* Out-of-range ids first, then valid ones (including both ends of the table). */
  const int32_t bad[] = {-1, (int32_t)V, (int32_t)V + 5, INT32_MIN, INT32_MAX};
  for (int64_t t = 0; t < T; t++) {
    if (T > 2 && t % 3 == 1) {
      ids[t] = bad[(t / 3) % 5];
    } else {
      int64_t r = oh_rand_int(0, V - 1);
      ids[t] = (int32_t)(t == 0 ? 0 : t == 2 ? V - 1 : r);
    }
  }
  int64_t tshape[2] = {V, H}, tstride[2] = {H + e->table_pad, 1};
  int64_t oshape[2] = {T, H}, ostride[2] = {H + e->out_pad, 1}, ishape[1] = {T};
  kiln_hal_embedding_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.table = oh_view(tb, 0, dt, 2, tshape, tstride);
  a.ids = oh_view(ib, 0, KILN_HAL_I32, 1, ishape, NULL);
  a.out = oh_view(ob, 0, dt, 2, oshape, ostride);
  oh_write_rand(tb, &a.table, -2, 2, tv);
  oh_write_i32(ib, &a.ids, ids);
  oh_push(tb);
  oh_push(ib);
  if (oh_ok(be->t->embedding(be->stream, &a), "embedding") && oh_pull(ob)) {
    oh_mark(ob, &a.out);
    oh_read(ob, &a.out, got);
    ops_ref_embedding(V, H, tv, T, ids, want);
    oh_compare("out", T * H, got, want, NULL, (oh_tol_t){0, 0, 0});
    oh_check_rest(ob, "out (row padding / tail)");
  }
  free(tv);
  free(want);
  free(got);
  free(ids);
  oh_free_all();
}

void test_ops_embedding(void **state) {
  (void)state;
  oh_test_begin("embedding");
  for (int bi = 0; bi < oh_num_backends; bi++) {
    for (int di = 0; di < 3; di++) {
      if (!oh_dtype_ok(&oh_backends[bi], oh_float_dtypes[di])) continue;
      for (size_t ci = 0; ci < ARRAY_LEN(embedding_cases); ci++)
        embedding_run(&oh_backends[bi], oh_float_dtypes[di], &embedding_cases[ci]);
    }
  }
  oh_test_end();
}

/* =============================================================================== rmsnorm == */

typedef struct rmsnorm_case {
  int64_t T, H;
  bool residual, alias_x, strided;
  float weight_offset, eps;
} rmsnorm_case_t;

static void rmsnorm_run(const oh_backend_t *be, int32_t dt, const rmsnorm_case_t *r) {
  const int64_t T = r->T, H = r->H, pad = r->strided ? 3 : 0;
  const size_t es = kiln_hal_dtype_size(dt);
  oh_case(be, "rmsnorm", dt, "T=%lld H=%lld residual=%d out%sx strided=%d weight_offset=%g eps=%g",
          (long long)T, (long long)H, r->residual, r->alias_x ? "==" : "!=", r->strided,
          (double)r->weight_offset, (double)r->eps);
  oh_buf_t *xb = oh_buf_new(be, (size_t)(T * (H + pad) + 2) * es);
  oh_buf_t *rb = oh_buf_new(be, (size_t)(T * (H + 2 * pad) + 2) * es);
  oh_buf_t *wb = oh_buf_new(be, (size_t)(H + 1) * es);
  oh_buf_t *ob = r->alias_x ? xb : oh_buf_new(be, (size_t)(T * (H + pad + 1) + 4) * es);
  double *x = OH_NEW(double, T *H), *res = OH_NEW(double, T *H), *w = OH_NEW(double, H);
  double *want = OH_NEW(double, T *H), *got = OH_NEW(double, T *H);
  int64_t shape[2] = {T, H}, xs[2] = {H + pad, 1}, rs[2] = {H + 2 * pad, 1},
          os[2] = {H + pad + (r->alias_x ? 0 : 1), 1}, wshape[1] = {H};
  kiln_hal_rmsnorm_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.x = oh_view(xb, 0, dt, 2, shape, xs);
  a.residual = r->residual ? oh_view(rb, 0, dt, 2, shape, rs) : oh_absent();
  a.weight = oh_view(wb, 0, dt, 1, wshape, NULL);
  a.out = r->alias_x ? a.x : oh_view(ob, 0, dt, 2, shape, os);
  a.eps = r->eps;
  a.weight_offset = r->weight_offset;
  oh_write_rand(xb, &a.x, -2, 2, x);
  if (r->residual) oh_write_rand(rb, &a.residual, -2, 2, res);
  if (r->weight_offset != 0.0f)
    oh_write_rand(wb, &a.weight, -0.3, 0.3, w);
  else
    oh_write_rand(wb, &a.weight, 0.5, 1.5, w);
  oh_push(xb);
  oh_push(rb);
  oh_push(wb);
  if (oh_ok(be->t->rmsnorm(be->stream, &a), "rmsnorm") && oh_pull(ob)) {
    ops_ref_rmsnorm(dt, T, H, x, r->residual ? res : NULL, w, (double)r->eps,
                    (double)r->weight_offset, want);
    oh_mark(ob, &a.out);
    oh_read(ob, &a.out, got);
    oh_compare("out", T * H, got, want, NULL, oh_tol_rmsnorm(dt));
    oh_check_rest(ob, r->alias_x ? "x/out (row padding)" : "out (row padding / tail)");
    if (!r->alias_x && oh_pull(xb)) oh_check_rest(xb, "x (an input)");
    if (r->residual && oh_pull(rb)) {
      oh_mark(rb, &a.residual);
      oh_read(rb, &a.residual, got);
      /* residual = round(x + residual): one rounding of an exact f32 sum */
      oh_compare("residual", T * H, got, res, NULL, oh_tol_elementwise(dt));
      oh_check_rest(rb, "residual (row padding)");
    }
  }
  free(x);
  free(res);
  free(w);
  free(want);
  free(got);
  oh_free_all();
}

void test_ops_rmsnorm(void **state) {
  (void)state;
  static const int64_t shapes[][2] = {{1, 1}, {3, 17}, {17, 128}, {5, 1000}, {2, 4096}};
  oh_test_begin("rmsnorm");
  for (int bi = 0; bi < oh_num_backends; bi++) {
    for (int di = 0; di < 3; di++) {
      int32_t dt = oh_float_dtypes[di];
      if (!oh_dtype_ok(&oh_backends[bi], dt)) continue;
      for (size_t si = 0; si < ARRAY_LEN(shapes); si++) {
        for (int combo = 0; combo < 4; combo++) {
          rmsnorm_case_t c = {shapes[si][0],
                              shapes[si][1],
                              combo & 1,
                              false,
                              false,
                              (combo & 2) ? 1.0f : 0.0f,
                              si % 2 ? 1e-6f : 1e-5f};
          c.alias_x = ((size_t)combo + si) % 3 == 1;
          c.strided = ((size_t)combo + si) % 2 == 1;
          rmsnorm_run(&oh_backends[bi], dt, &c);
        }
      }
    }
  }
  oh_test_end();
}

/* ================================================================================== rope == */

enum { ROPE_Q = 1, ROPE_K = 2 };

typedef struct rope_case {
  int64_t T, NH, NKV, D, R;
  int32_t style;
  int which;  /* ROPE_Q | ROPE_K */
  bool fused; /* q and k are strided slices of one [T, (NH + 2 NKV) * D] QKV buffer */
  double theta;
} rope_case_t;

static const rope_case_t rope_cases[] = {
    {1, 1, 1, 64, 64, KILN_HAL_ROPE_NEOX, ROPE_Q | ROPE_K, false, 1e4},
    {7, 4, 2, 64, 64, KILN_HAL_ROPE_INTERLEAVED, ROPE_Q | ROPE_K, true, 1e6},
    {17, 2, 1, 128, 64, KILN_HAL_ROPE_NEOX, ROPE_Q, false, 1e4},
    {5, 3, 3, 80, 80, KILN_HAL_ROPE_INTERLEAVED, ROPE_K, false, 1e4},
    {33, 8, 2, 128, 128, KILN_HAL_ROPE_NEOX, ROPE_Q | ROPE_K, true, 1e6},
    {9, 2, 2, 96, 32, KILN_HAL_ROPE_INTERLEAVED, ROPE_Q | ROPE_K, true, 1e4},
    {4, 4, 1, 256, 256, KILN_HAL_ROPE_NEOX, ROPE_Q, true, 1e4},
    {6, 2, 1, 64, 48, KILN_HAL_ROPE_NEOX, ROPE_K, true, 1e6},
    {3, 1, 1, 2, 2, KILN_HAL_ROPE_NEOX, ROPE_Q | ROPE_K, false, 1e4},
};

static void rope_run(const oh_backend_t *be, int32_t dt, const rope_case_t *r) {
  const int64_t T = r->T, NH = r->NH, NKV = r->NKV, D = r->D, R = r->R, P = 64;
  const int64_t QKV = (NH + 2 * NKV) * D, cs_ld = r->fused ? R + 4 : R;
  const size_t es = kiln_hal_dtype_size(dt);
  oh_case(be, "rope", dt, "%s T=%lld NH=%lld NKV=%lld D=%lld R=%lld rotate=%s%s%s theta=%g",
          r->style == KILN_HAL_ROPE_NEOX ? "neox" : "interleaved", (long long)T, (long long)NH,
          (long long)NKV, (long long)D, (long long)R, (r->which & ROPE_Q) ? "q" : "",
          (r->which & ROPE_K) ? "k" : "", r->fused ? " (fused QKV slices)" : "", r->theta);
  oh_buf_t *qb = oh_buf_new(be, (size_t)(r->fused ? T * QKV : T * NH * D) * es);
  oh_buf_t *kb = r->fused ? qb : oh_buf_new(be, (size_t)(T * NKV * D) * es);
  oh_buf_t *pb = oh_buf_new(be, (size_t)T * 4);
  oh_buf_t *cb = oh_buf_new(be, (size_t)(P * cs_ld) * 4);
  double *q = OH_NEW(double, T *NH *D), *k = OH_NEW(double, T *NKV *D);
  double *got = OH_NEW(double, T *NH *D + T * NKV * D), *cs = OH_NEW(double, P *R);
  float *csf = OH_NEW(float, P *R);
  int32_t *pos = OH_NEW(int32_t, T);
  const int32_t bad[] = {-1, (int32_t)P, 1000, INT32_MIN};
  for (int64_t t = 0; t < T; t++)
    pos[t] = (T >= 4 && t % 4 == 3) ? bad[(t / 4) % 4] : (int32_t)oh_rand_int(0, P - 1);

  kiln_hal_rope_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  int64_t qshape[3] = {T, NH, D}, kshape[3] = {T, NKV, D};
  int64_t fstride[3] = {QKV, D, 1}, pshape[1] = {T}, cshape[2] = {P, R}, cstride[2] = {cs_ld, 1};
  kiln_hal_tensor_t qv = oh_view(qb, 0, dt, 3, qshape, r->fused ? fstride : NULL);
  kiln_hal_tensor_t kv =
      oh_view(kb, r->fused ? (uint64_t)(NH * D) * es : 0, dt, 3, kshape, r->fused ? fstride : NULL);
  oh_write_rand(qb, &qv, -1, 1, q);
  oh_write_rand(kb, &kv, -1, 1, k);
  if (r->fused) { /* the V slice: must stay untouched */
    kiln_hal_tensor_t vv = kv;
    double *tmp = OH_NEW(double, T *NKV *D);
    vv.offset = (uint64_t)((NH + NKV) * D) * es;
    oh_write_rand(qb, &vv, -1, 1, tmp);
    free(tmp);
  }
  a.q = (r->which & ROPE_Q) ? qv : oh_absent();
  a.k = (r->which & ROPE_K) ? kv : oh_absent();
  a.positions = oh_view(pb, 0, KILN_HAL_I32, 1, pshape, NULL);
  a.cos_sin = oh_view(cb, 0, KILN_HAL_F32, 2, cshape, cstride);
  a.style = r->style;
  ops_ref_rope_table(P, R, r->theta, csf);
  for (int64_t i = 0; i < P * R; i++) cs[i] = csf[i];
  oh_write(cb, &a.cos_sin, cs);
  oh_write_i32(pb, &a.positions, pos);
  oh_push(qb);
  if (!r->fused) oh_push(kb);
  oh_push(pb);
  oh_push(cb);
  if (oh_ok(be->t->rope(be->stream, &a), "rope") && oh_pull(qb) && (r->fused || oh_pull(kb))) {
    if (r->which & ROPE_Q) {
      ops_ref_rope(r->style, T, NH, D, R, pos, P, cs, q);
      oh_mark(qb, &qv);
      oh_read(qb, &qv, got);
      oh_compare("q", T * NH * D, got, q, NULL, oh_tol_elementwise(dt));
    }
    if (r->which & ROPE_K) {
      ops_ref_rope(r->style, T, NKV, D, R, pos, P, cs, k);
      oh_mark(kb, &kv);
      oh_read(kb, &kv, got);
      oh_compare("k", T * NKV * D, got, k, NULL, oh_tol_elementwise(dt));
    }
    oh_check_rest(qb, r->fused ? "qkv (parts not rotated)" : "q (not rotated)");
    if (!r->fused) oh_check_rest(kb, "k (not rotated)");
  }
  free(q);
  free(k);
  free(got);
  free(cs);
  free(csf);
  free(pos);
  oh_free_all();
}

void test_ops_rope(void **state) {
  (void)state;
  oh_test_begin("rope");
  for (int bi = 0; bi < oh_num_backends; bi++) {
    for (int di = 0; di < 3; di++) {
      if (!oh_dtype_ok(&oh_backends[bi], oh_float_dtypes[di])) continue;
      for (size_t ci = 0; ci < ARRAY_LEN(rope_cases); ci++)
        rope_run(&oh_backends[bi], oh_float_dtypes[di], &rope_cases[ci]);
    }
  }
  oh_test_end();
}

/* ============================================================================== silu_mul == */

static const char *act_name(int32_t act) {
  return act == KILN_HAL_ACT_SILU        ? "silu"
         : act == KILN_HAL_ACT_GELU_TANH ? "gelu_tanh"
         : act == KILN_HAL_ACT_GELU      ? "gelu"
                                         : "quick_gelu";
}

static void silu_mul_run(const oh_backend_t *be, int32_t dt, int32_t act, int64_t T, int64_t I,
                         int64_t pad) {
  const size_t es = kiln_hal_dtype_size(dt);
  oh_case(be, "silu_mul", dt, "act=%s T=%lld I=%lld pad=%lld", act_name(act), (long long)T,
          (long long)I, (long long)pad);
  oh_buf_t *xb = oh_buf_new(be, (size_t)(T * (2 * I + pad)) * es);
  oh_buf_t *ob = oh_buf_new(be, (size_t)(T * (I + pad) + 3) * es);
  double *x = OH_NEW(double, T * 2 * I), *want = OH_NEW(double, T *I), *got = OH_NEW(double, T *I);
  int64_t xs[2] = {T, 2 * I}, xst[2] = {2 * I + pad, 1}, os[2] = {T, I}, ost[2] = {I + pad, 1};
  kiln_hal_silu_mul_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.x = oh_view(xb, 0, dt, 2, xs, xst);
  a.out = oh_view(ob, 0, dt, 2, os, ost);
  a.act = act;
  oh_write_rand(xb, &a.x, -6, 6, x);
  oh_push(xb);
  if (oh_ok(be->t->silu_mul(be->stream, &a), "silu_mul") && oh_pull(ob)) {
    ops_ref_act_mul(act, T, I, x, want);
    oh_mark(ob, &a.out);
    oh_read(ob, &a.out, got);
    oh_compare("out", T * I, got, want, NULL, oh_tol_elementwise(dt));
    oh_check_rest(ob, "out (row padding / tail)");
  }
  free(x);
  free(want);
  free(got);
  oh_free_all();
}

void test_ops_silu_mul(void **state) {
  (void)state;
  static const int64_t shapes[][3] = {{1, 1, 0}, {3, 17, 2}, {17, 128, 0}, {4, 300, 5}};
  oh_test_begin("silu_mul");
  for (int bi = 0; bi < oh_num_backends; bi++) {
    for (int di = 0; di < 3; di++) {
      if (!oh_dtype_ok(&oh_backends[bi], oh_float_dtypes[di])) continue;
      for (int32_t act = 0; act <= KILN_HAL_ACT_QUICK_GELU; act++) {
        for (size_t si = 0; si < ARRAY_LEN(shapes); si++)
          silu_mul_run(&oh_backends[bi], oh_float_dtypes[di], act, shapes[si][0], shapes[si][1],
                       shapes[si][2]);
      }
    }
  }
  oh_test_end();
}

/* =================================================================================== add == */

enum { ADD_DENSE = 0, ADD_STRIDED = 1, ADD_ALIAS_A = 2, ADD_ALIAS_B = 3 };

static void add_run(const oh_backend_t *be, int32_t dt, int64_t T, int64_t H, int mode) {
  static const char *names[] = {"dense", "strided", "out==a", "out==b"};
  const size_t es = kiln_hal_dtype_size(dt);
  const int64_t pad = mode == ADD_STRIDED ? 3 : 0;
  oh_case(be, "add", dt, "T=%lld H=%lld %s", (long long)T, (long long)H, names[mode]);
  oh_buf_t *ab = oh_buf_new(be, (size_t)(T * (H + pad) + 1) * es);
  oh_buf_t *bb = oh_buf_new(be, (size_t)(T * (H + 2 * pad) + 1) * es);
  oh_buf_t *ob = mode == ADD_ALIAS_A   ? ab
                 : mode == ADD_ALIAS_B ? bb
                                       : oh_buf_new(be, (size_t)(T * (H + pad + 1) + 2) * es);
  double *av = OH_NEW(double, T *H), *bv = OH_NEW(double, T *H);
  double *want = OH_NEW(double, T *H), *got = OH_NEW(double, T *H);
  int64_t shape[2] = {T, H}, as[2] = {H + pad, 1}, bs[2] = {H + 2 * pad, 1},
          os[2] = {H + pad + 1, 1};
  kiln_hal_add_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.a = oh_view(ab, 0, dt, 2, shape, as);
  a.b = oh_view(bb, 0, dt, 2, shape, bs);
  a.out = mode == ADD_ALIAS_A ? a.a : mode == ADD_ALIAS_B ? a.b : oh_view(ob, 0, dt, 2, shape, os);
  oh_write_rand(ab, &a.a, -3, 3, av);
  oh_write_rand(bb, &a.b, -3, 3, bv);
  oh_push(ab);
  oh_push(bb);
  if (oh_ok(be->t->add(be->stream, &a), "add") && oh_pull(ob)) {
    for (int64_t i = 0; i < T * H; i++) want[i] = av[i] + bv[i];
    oh_mark(ob, &a.out);
    oh_read(ob, &a.out, got);
    oh_compare("out", T * H, got, want, NULL, oh_tol_elementwise(dt));
    oh_check_rest(ob, "out (row padding / tail)");
    if (mode != ADD_ALIAS_A && oh_pull(ab)) oh_check_rest(ab, "a (an input)");
    if (mode != ADD_ALIAS_B && oh_pull(bb)) oh_check_rest(bb, "b (an input)");
  }
  free(av);
  free(bv);
  free(want);
  free(got);
  oh_free_all();
}

void test_ops_add(void **state) {
  (void)state;
  static const int64_t shapes[][2] = {{1, 1}, {3, 17}, {33, 128}, {7, 1000}};
  oh_test_begin("add");
  for (int bi = 0; bi < oh_num_backends; bi++) {
    for (int di = 0; di < 3; di++) {
      if (!oh_dtype_ok(&oh_backends[bi], oh_float_dtypes[di])) continue;
      for (size_t si = 0; si < ARRAY_LEN(shapes); si++) {
        for (int mode = 0; mode < 4; mode++)
          add_run(&oh_backends[bi], oh_float_dtypes[di], shapes[si][0], shapes[si][1], mode);
      }
    }
  }
  oh_test_end();
}

/* ================================================================================== copy == */

typedef struct copy_layout {
  const char *name;
  int ndim;
  int64_t shape[4];
  int64_t src_stride[4], dst_stride[4]; /* all zero: dense */
  int64_t src_elems, dst_elems;         /* buffer sizes in elements */
} copy_layout_t;

static const copy_layout_t copy_layouts[] = {
    {"1-D 127", 1, {127}, {0}, {0}, 127, 130},
    {"2-D 1x1", 2, {1, 1}, {0}, {0}, 1, 3},
    {"2-D 17x33 src transposed, dst padded rows", 2, {17, 33}, {1, 17}, {40, 1}, 17 * 33, 17 * 40},
    {"3-D 3x5x7 src permuted, dst padded", 3, {3, 5, 7}, {1, 21, 3}, {48, 8, 1}, 105, 3 * 48},
    {"4-D 2x3x4x5 dst every other element", 4, {2, 3, 4, 5}, {0}, {240, 80, 20, 2}, 120, 480},
    {"4-D 2x3x4x5 src transposed last two dims", 4, {2, 3, 4, 5}, {60, 20, 1, 4}, {0}, 120, 122},
};

static void copy_run(const oh_backend_t *be, int32_t sdt, int32_t ddt, const copy_layout_t *l,
                     bool specials) {
  oh_case(be, "copy", ddt, "%s -> %s, %s%s", kiln_hal_dtype_name(sdt), kiln_hal_dtype_name(ddt),
          l->name, specials ? " (special values)" : "");
  oh_buf_t *sb = oh_buf_new(be, (size_t)l->src_elems * kiln_hal_dtype_size(sdt));
  oh_buf_t *db = oh_buf_new(be, (size_t)l->dst_elems * kiln_hal_dtype_size(ddt));
  kiln_hal_copy_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.src = oh_view(sb, 0, sdt, l->ndim, l->shape, l->src_stride[0] ? l->src_stride : NULL);
  a.dst = oh_view(db, 0, ddt, l->ndim, l->shape, l->dst_stride[0] ? l->dst_stride : NULL);
  int64_t n = oh_numel(&a.src);
  double *v = OH_NEW(double, n), *got = OH_NEW(double, n);
  if (sdt == KILN_HAL_I32) {
    for (int64_t i = 0; i < n; i++) v[i] = (double)(int32_t)oh_rand_u64();
    oh_write(sb, &a.src, v);
  } else {
    oh_rand_fill(v, n, -4, 4);
    if (specials) {
      static const double sp[] = {0.0,      -0.0, 1e-6,       -3e-7,  65519.0, 70000.0,
                                  -70000.0, 1e30, 3.14159265, 6.1e-5, -2.9e-8, 1.0 + 1.0 / 2048};
      for (size_t i = 0; i < ARRAY_LEN(sp) && (int64_t)i < n; i++) v[i] = sp[i];
    }
    oh_write(sb, &a.src, v); /* rounds v to the source dtype */
    for (int64_t i = 0; i < n; i++) v[i] = ops_ref_round(ddt, v[i]);
  }
  oh_push(sb);
  if (oh_ok(be->t->copy(be->stream, &a), "copy") && oh_pull(db)) {
    oh_mark(db, &a.dst);
    oh_read(db, &a.dst, got);
    /* A conversion is one correctly rounded step: exact. */
    oh_compare("dst", n, got, v, NULL, (oh_tol_t){0, 0, 0});
    oh_check_rest(db, "dst (gaps / padding)");
  }
  free(v);
  free(got);
  oh_free_all();
}

void test_ops_copy(void **state) {
  (void)state;
  oh_test_begin("copy");
  for (int bi = 0; bi < oh_num_backends; bi++) {
    const oh_backend_t *be = &oh_backends[bi];
    for (int si = 0; si < 3; si++) {
      for (int di = 0; di < 3; di++) {
        int32_t sdt = oh_float_dtypes[si], ddt = oh_float_dtypes[di];
        if (!oh_dtype_ok(be, sdt) || !oh_dtype_ok(be, ddt)) continue;
        for (size_t li = 0; li < ARRAY_LEN(copy_layouts); li++)
          copy_run(be, sdt, ddt, &copy_layouts[li], li == 0);
      }
    }
    for (size_t li = 0; li < ARRAY_LEN(copy_layouts); li++)
      copy_run(be, KILN_HAL_I32, KILN_HAL_I32, &copy_layouts[li], false);
  }
  oh_test_end();
}
