/* ops_cases_quant.c - conformance cases for gemm_quant (ABI 1.4), the quantized-weight GEMM,
 * against the fp64 reference (hal/ref/ops_ref.c, which decodes the blocks on its own), on every
 * backend whose device claims KILN_HAL_CAP_QUANT(format), for every format it claims.
 *
 * Weights are random bytes: every bit pattern of the quants, 6-bit scales and mins and Q6_K's
 * int8 scales is a valid block, so random blocks reach them all; only the f16 super-block
 * scales are set to random finite values in [2^-12, 2^-4] (either sign for d; dmin >= 0 as
 * quantizers write it), which keeps the products in range.
 *
 * Tolerance: hal.h defines W exactly (the f32 values of kiln/hal_quant.h) and x as stored, so
 * the only freedom is the order of an f32 accumulation: oh_tol_gemm's mtol (2e-5 of
 * sum |x * w|) as for gemm, plus the half-ulp rounding of y to its dtype. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "hal/ref/ops_ref.h"
#include "kiln/hal_check.h"
#include "kiln/hal_quant.h"
#include "ops_cases.h"
#include "ops_harness.h"

#define ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

typedef struct gq_case {
  int64_t M, N, K;
  bool bias, y_f32;
  int64_t x_pad, y_pad, w_pad; /* extra elements per row of x and y; extra bytes per row of w */
  uint64_t w_off;              /* bytes before row 0 (unaligned on purpose) */
} gq_case_t;

static const gq_case_t gq_cases[] = {
    {1, 1, 0, false, false, 0, 0, 0, 0},  /* K = one block */
    {1, 64, 0, true, false, 0, 0, 0, 3},  /* decode: one row */
    {1, 129, 0, false, true, 3, 0, 5, 0}, /* N not a multiple of any vector width */
    {2, 33, 0, true, true, 0, 2, 0, 7},   {4, 200, 0, false, false, 1, 0, 0, 0},
    {8, 31, 0, true, false, 0, 0, 11, 1}, /* the last "small M" row count */
    {9, 17, 0, false, true, 0, 0, 0, 0},  /* the first above it */
    {33, 70, 0, true, false, 2, 1, 0, 2}, /* prefill-sized */
    {0, 5, 0, false, false, 0, 0, 0, 0},  /* M = 0: a no-op */
    {3, 0, 0, false, false, 0, 0, 0, 0},  /* N = 0 */
    /* Aligned rows (no pads or pads of 8 elements / 16 bytes): a GPU's vector decode paths. */
    {2, 40, 0, true, false, 0, 0, 0, 0},
    {3, 45, 0, false, true, 8, 1, 16, 16},
    {8, 67, 0, true, true, 0, 0, 0, 0},
    {9, 33, 0, true, false, 8, 0, 16, 0},
    {64, 40, 0, true, false, 0, 0, 0, 0},
};

/* A random finite f16 of magnitude in [2^-12, 2^-4], negative when neg. */
static void put_scale(uint8_t *p, bool neg) {
  double v = ldexp(1.0 + oh_rand_uniform(0, 1), (int)oh_rand_int(-12, -5));
  uint16_t h = kiln_hal_f32_to_f16((float)(neg ? -v : v));
  p[0] = (uint8_t)h;
  p[1] = (uint8_t)(h >> 8);
}

static void random_block(int32_t fmt, uint8_t *blk) {
  const int B = kiln_hal_qfmt_block_bytes(fmt);
  for (int i = 0; i < B; i++) blk[i] = (uint8_t)oh_rand_u64();
  bool neg = oh_rand_int(0, 3) == 0;
  switch (fmt) {
    case KILN_HAL_QFMT_Q6_K: put_scale(blk + 208, neg); break;
    case KILN_HAL_QFMT_Q4_K:
    case KILN_HAL_QFMT_Q5_K:
      put_scale(blk, neg);
      put_scale(blk + 2, false);
      break;
    default: put_scale(blk, neg); break;
  }
}

static void gq_run(const oh_backend_t *be, int32_t fmt, int32_t dt, const gq_case_t *g) {
  const int64_t E = kiln_hal_qfmt_block_elems(fmt), B = kiln_hal_qfmt_block_bytes(fmt);
  const int64_t M = g->M, N = g->N;
  const int64_t K = g->K ? g->K : E * (1 + oh_rand_int(0, 3)); /* 1..4 blocks */
  const int32_t ydt = g->y_f32 ? KILN_HAL_F32 : dt;
  const size_t es = kiln_hal_dtype_size(dt), yes = kiln_hal_dtype_size(ydt);
  if (oh_skip_big((double)M * (double)N * (double)K)) return;
  oh_case(be, "gemm_quant", dt, "%s M=%lld N=%lld K=%lld bias=%d y=%s pads=%lld/%lld/%lld off=%llu",
          kiln_hal_qfmt_name(fmt), (long long)M, (long long)N, (long long)K, g->bias,
          kiln_hal_dtype_name(ydt), (long long)g->x_pad, (long long)g->y_pad, (long long)g->w_pad,
          (unsigned long long)g->w_off);
  const int64_t ldx = K + g->x_pad, ldy = N + g->y_pad;
  const int64_t row_stride = K / E * B + g->w_pad;
  oh_buf_t *xbuf = oh_buf_new(be, (size_t)(M * ldx + 1) * es);
  oh_buf_t *wbuf = oh_buf_new(be, (size_t)(g->w_off + (uint64_t)(N * row_stride) + 16));
  oh_buf_t *ybuf = oh_buf_new(be, (size_t)(M * ldy + 3) * yes);
  oh_buf_t *bbuf = oh_buf_new(be, (size_t)(N + 3) * yes);
  double *xv = OH_NEW(double, M *K + 1), *biasv = OH_NEW(double, N + 1);
  double *want = OH_NEW(double, M *N + 1), *got = OH_NEW(double, M *N + 1);
  double *mag = OH_NEW(double, M *N + 1);

  int64_t xs[2] = {M, K}, xt[2] = {ldx, 1}, ys[2] = {M, N}, yt[2] = {ldy, 1};
  kiln_hal_gemm_quant_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.x = oh_view(xbuf, 0, dt, 2, xs, xt);
  a.y = oh_view(ybuf, 0, ydt, 2, ys, yt);
  a.bias = oh_absent();
  oh_write_rand(xbuf, &a.x, -1, 1, xv);
  if (g->bias) {
    int64_t bs[1] = {N};
    a.bias = oh_view(bbuf, 0, ydt, 1, bs, NULL);
    oh_write_rand(bbuf, &a.bias, -1, 1, biasv);
  }
  uint8_t *wbytes = wbuf->host + g->w_off;
  for (int64_t n = 0; n < N; n++)
    for (int64_t b = 0; b < K / E; b++) random_block(fmt, wbytes + n * row_stride + b * B);
  a.w.buffer = wbuf->b;
  a.w.offset = g->w_off;
  a.w.format = fmt;
  a.w.n = N;
  a.w.k = K;
  a.w.row_stride = row_stride;
  oh_push(xbuf);
  oh_push(wbuf);
  oh_push(ybuf);
  oh_push(bbuf);
  if (oh_ok(be->t->gemm_quant(be->stream, &a), "gemm_quant") && oh_pull(ybuf)) {
    oh_mark(ybuf, &a.y);
    oh_read(ybuf, &a.y, got);
    ops_ref_gemm_quant(M, N, K, xv, fmt, wbytes, row_stride, g->bias ? biasv : NULL, want, mag);
    oh_compare("y", M * N, got, want, mag, oh_tol_gemm(ydt));
    oh_check_rest(ybuf, "y (row padding / tail)");
  }
  free(xv);
  free(biasv);
  free(want);
  free(got);
  free(mag);
  oh_free_all();
}

/* Arguments the op must refuse (checked on the host, before anything runs). */
static void gq_bad_args(const oh_backend_t *be, int32_t fmt) {
  oh_case(be, "gemm_quant", KILN_HAL_F32, "%s bad arguments", kiln_hal_qfmt_name(fmt));
  const int64_t E = kiln_hal_qfmt_block_elems(fmt), B = kiln_hal_qfmt_block_bytes(fmt);
  oh_buf_t *xbuf = oh_buf_new(be, 4 * 2 * (size_t)E), *ybuf = oh_buf_new(be, 64);
  oh_buf_t *wbuf = oh_buf_new(be, 4 * (size_t)B);
  kiln_hal_gemm_quant_args_t good, a;
  memset(&good, 0, sizeof(good));
  good.struct_size = sizeof(good);
  good.x = oh_view(xbuf, 0, KILN_HAL_F32, 2, (const int64_t[]){2, E}, NULL);
  good.y = oh_view(ybuf, 0, KILN_HAL_F32, 2, (const int64_t[]){2, 4}, NULL);
  good.w = (kiln_hal_qweight_t){.buffer = wbuf->b, .format = fmt, .n = 4, .k = E, .row_stride = B};
  a = good, a.w.format = 99;
  oh_expect_error(be->t->gemm_quant(be->stream, &a), "unknown format");
  a = good, a.w.k = E + 1, a.x.shape[1] = E + 1;
  oh_expect_error(be->t->gemm_quant(be->stream, &a), "K not whole blocks");
  a = good, a.w.row_stride = B - 1;
  oh_expect_error(be->t->gemm_quant(be->stream, &a), "row_stride below a row");
  a = good, a.w.offset = 1;
  oh_expect_error(be->t->gemm_quant(be->stream, &a), "w past its buffer");
  a = good, a.w.group_size = 128;
  oh_expect_error(be->t->gemm_quant(be->stream, &a), "group_size on a GGUF format");
  a = good, a.y.shape[1] = 3;
  oh_expect_error(be->t->gemm_quant(be->stream, &a), "y of the wrong shape");
  a = good, a.x.dtype = KILN_HAL_I32;
  oh_expect_error(be->t->gemm_quant(be->stream, &a), "integer x");
  a = good, a.y = a.x, a.y.shape[1] = 4;
  oh_expect_error(be->t->gemm_quant(be->stream, &a), "y overlapping x");
  oh_free_all();
}

/* ---- the group formats (INT4_G, INT8_G: GPTQ / AWQ repacked) ----------------------------------
 * Random codes (every nibble / byte), random zeros (or absent: symmetric), random finite f16
 * scales of either sign in [2^-12, 2^-4], group_size 32/64/128 or K (GPTQ's -1), g_idx absent
 * or a random act-order assignment (each group gets group_size columns, shuffled over K). W is
 * exact in f32 (hal.h), so the tolerance is gemm's, as for the block formats. */
/* A random finite f32 scale of either sign in [2^-12, 2^-4) (FP8 checkpoints' scales are
 * positive; the sign costs nothing to cover). */
static void put_scale_f32(uint8_t *p) {
  float v = (float)ldexp(1.0 + oh_rand_uniform(0, 1), (int)oh_rand_int(-12, -5));
  if (oh_rand_int(0, 1)) v = -v;
  memcpy(p, &v, 4);
}

/* FP8 codes over random bytes: a NaN code (S.1111.111) becomes +-448 (0x7E / 0xFE); the first
 * bytes are the extremes (+-448, +-2^-9 the smallest subnormals, 0x07 the largest subnormal,
 * 0x08 = 2^-6 the smallest normal, +-0, +-1). */
static void fp8_codes(uint8_t *b, int64_t n) {
  static const uint8_t edge[] = {0x7E, 0xFE, 0x01, 0x81, 0x07, 0x08, 0x00, 0x80, 0x38, 0xB8};
  for (int64_t i = 0; i < n; i++)
    if (kiln_hal_fp8_e4m3_is_nan(b[i])) b[i] = (uint8_t)(b[i] - 1);
  for (size_t i = 0; i < sizeof(edge) && (int64_t)i < n; i++) b[i] = edge[i];
}

typedef struct gqg_case {
  int64_t M, N, K;
  int32_t group_size; /* 0: K (one group) */
  bool zeros, g_idx, bias, y_f32;
  int64_t w_pad, s_pad; /* extra bytes per code row; extra elements per scale / zero row */
  bool xq;              /* FP8: x_quant = FP8_TOKEN (W8A8, ABI 1.6) */
} gqg_case_t;

static void gqg_run(const oh_backend_t *be, int32_t fmt, int32_t dt, const gqg_case_t *g) {
  const int64_t M = g->M, N = g->N, K = g->K;
  const int32_t gs = g->group_size ? g->group_size : (int32_t)K;
  const int64_t G = (K + gs - 1) / gs;
  const int32_t ydt = g->y_f32 ? KILN_HAL_F32 : dt;
  const size_t es = kiln_hal_dtype_size(dt), yes = kiln_hal_dtype_size(ydt);
  if (oh_skip_big((double)M * (double)N * (double)K)) return;
  oh_case(be, "gemm_quant", dt,
          "%s M=%lld N=%lld K=%lld group_size=%d zeros=%d g_idx=%d bias=%d y=%s%s",
          kiln_hal_qfmt_name(fmt), (long long)M, (long long)N, (long long)K, (int)gs, g->zeros,
          g->g_idx, g->bias, kiln_hal_dtype_name(ydt), g->xq ? " x_quant=fp8_token" : "");
  const int64_t rb = kiln_hal_qgroup_row_bytes(fmt, K) + g->w_pad, lds = G + g->s_pad;
  const bool fp8 = fmt == KILN_HAL_QFMT_FP8_E4M3;
  const size_t ses = fp8 ? 4 : 2;
  oh_buf_t *xbuf = oh_buf_new(be, (size_t)(M * K + 1) * es);
  oh_buf_t *wbuf = oh_buf_new(be, (size_t)(N * rb + 8));
  oh_buf_t *sbuf = oh_buf_new(be, (size_t)(N * lds + 1) * ses);
  oh_buf_t *zbuf = oh_buf_new(be, (size_t)(N * lds + 1));
  oh_buf_t *ibuf = oh_buf_new(be, (size_t)(K + 1) * 4);
  oh_buf_t *ybuf = oh_buf_new(be, (size_t)(M * N + 3) * yes);
  oh_buf_t *bbuf = oh_buf_new(be, (size_t)(N + 3) * yes);
  double *xv = OH_NEW(double, M *K + 1), *biasv = OH_NEW(double, N + 1);
  double *want = OH_NEW(double, M *N + 1), *got = OH_NEW(double, M *N + 1);
  double *mag = OH_NEW(double, M *N + 1);
  int32_t *gidx = OH_NEW(int32_t, K + 1);

  kiln_hal_gemm_quant_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.x = oh_view(xbuf, 0, dt, 2, (const int64_t[]){M, K}, NULL);
  a.y = oh_view(ybuf, 0, ydt, 2, (const int64_t[]){M, N}, NULL);
  a.bias = oh_absent();
  a.x_quant = g->xq ? KILN_HAL_XQUANT_FP8_TOKEN : KILN_HAL_XQUANT_NONE;
  /* x_quant: rows of very different magnitudes (each row's own scale must be used), one row
   * of zeros (scale 1) */
  oh_write_rand(xbuf, &a.x, g->xq ? -64 : -1, g->xq ? 64 : 1, xv);
  if (g->xq) {
    for (int64_t m = 0; m < M; m++)
      for (int64_t k = 0; k < K; k++)
        xv[m * K + k] = m == 1 ? 0.0 : ldexp(xv[m * K + k], -(int)(3 * m % 13));
    oh_write(xbuf, &a.x, xv);
  }
  if (g->bias) {
    a.bias = oh_view(bbuf, 0, ydt, 1, (const int64_t[]){N}, NULL);
    oh_write_rand(bbuf, &a.bias, -1, 1, biasv);
  }
  for (int64_t i = 0; i < N * rb + 8; i++) wbuf->host[i] = (uint8_t)oh_rand_u64();
  const int zmax = fmt == KILN_HAL_QFMT_INT4_G ? 16 : 255; /* 16: GPTQ v1's stored 15 + 1 */
  for (int64_t i = 0; i < N * lds; i++) {
    if (fp8)
      put_scale_f32(sbuf->host + 4 * i);
    else
      put_scale(sbuf->host + 2 * i, oh_rand_int(0, 1));
    zbuf->host[i] = (uint8_t)oh_rand_int(0, zmax);
  }
  if (fp8) fp8_codes(wbuf->host, N * rb + 8);
  a.w = (kiln_hal_qweight_t){
      .buffer = wbuf->b, .format = fmt, .group_size = gs, .n = N, .k = K, .row_stride = rb};
  a.w.scales = oh_view(sbuf, 0, fp8 ? KILN_HAL_F32 : KILN_HAL_F16, 2, (const int64_t[]){N, G},
                       (const int64_t[]){lds, 1});
  a.w.zeros = oh_absent();
  a.w.g_idx = oh_absent();
  if (g->zeros)
    a.w.zeros =
        oh_view(zbuf, 0, KILN_HAL_U8, 2, (const int64_t[]){N, G}, (const int64_t[]){lds, 1});
  if (g->g_idx) { /* k / gs, shuffled (Fisher-Yates): act-order's assignment */
    for (int64_t k = 0; k < K; k++) gidx[k] = (int32_t)(k / gs);
    for (int64_t k = K - 1; k > 0; k--) {
      int64_t j = oh_rand_int(0, k);
      int32_t t = gidx[k];
      gidx[k] = gidx[j];
      gidx[j] = t;
    }
    memcpy(ibuf->host, gidx, (size_t)K * 4);
    a.w.g_idx = oh_view(ibuf, 0, KILN_HAL_I32, 1, (const int64_t[]){K}, NULL);
  }
  oh_push(xbuf);
  oh_push(wbuf);
  oh_push(sbuf);
  oh_push(zbuf);
  oh_push(ibuf);
  oh_push(ybuf);
  oh_push(bbuf);
  if (oh_ok(be->t->gemm_quant(be->stream, &a), "gemm_quant") && oh_pull(ybuf)) {
    oh_mark(ybuf, &a.y);
    oh_read(ybuf, &a.y, got);
    oh_tol_t tol = oh_tol_gemm(ydt);
    if (g->xq) { /* the reference on the quantized rows, then s_m * sum + bias */
      double *xq = OH_NEW(double, M * K + 1), *sx = OH_NEW(double, M + 1);
      ops_ref_fp8_xquant(M, K, xv, xq, sx);
      ops_ref_gemm_qgroup(M, N, K, xq, fmt, wbuf->host, rb, sbuf->host, lds, NULL, lds, NULL, gs,
                          NULL, want, mag);
      for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) {
          const double b = g->bias ? biasv[n] : 0.0;
          want[m * N + n] = sx[m] * want[m * N + n] + b;
          mag[m * N + n] = sx[m] * mag[m * N + n] + fabs(b);
        }
      free(xq);
      free(sx);
      /* FP8 matrix units (Hopper's wgmma) add the products in an accumulator narrower than
       * f32 between the promotions to f32 that cuBLASLt makes (DeepSeek-V3 reports ~14 bits
       * kept): 2^-12 of sum |x_q w| admits that; one wrong code (an e4m3 step, 6-12% of one
       * of K = 256 terms) still shows above it. */
      tol.mtol = 0x1p-12;
    } else {
      ops_ref_gemm_qgroup(M, N, K, xv, fmt, wbuf->host, rb, sbuf->host, lds,
                          g->zeros ? zbuf->host : NULL, lds, g->g_idx ? gidx : NULL, gs,
                          g->bias ? biasv : NULL, want, mag);
    }
    oh_compare("y", M * N, got, want, mag, tol);
    oh_check_rest(ybuf, "y (tail)");
  }
  free(xv);
  free(biasv);
  free(want);
  free(got);
  free(mag);
  free(gidx);
  oh_free_all();
}

/* FP8_E4M3 arguments the op must refuse. */
static void gq8_bad_args(const oh_backend_t *be) {
  const int32_t fmt = KILN_HAL_QFMT_FP8_E4M3;
  oh_case(be, "gemm_quant", KILN_HAL_F32, "%s bad arguments", kiln_hal_qfmt_name(fmt));
  const int64_t K = 64, N = 4;
  oh_buf_t *xbuf = oh_buf_new(be, 4 * 2 * K), *ybuf = oh_buf_new(be, 64);
  oh_buf_t *wbuf = oh_buf_new(be, (size_t)(N * K)), *sbuf = oh_buf_new(be, 128);
  oh_buf_t *ibuf = oh_buf_new(be, (size_t)K * 4);
  memset(sbuf->host, 0, 128);
  memset(ibuf->host, 0, (size_t)K * 4);
  oh_push(sbuf);
  oh_push(ibuf);
  kiln_hal_gemm_quant_args_t good, a;
  memset(&good, 0, sizeof(good));
  good.struct_size = sizeof(good);
  good.x = oh_view(xbuf, 0, KILN_HAL_F32, 2, (const int64_t[]){2, K}, NULL);
  good.y = oh_view(ybuf, 0, KILN_HAL_F32, 2, (const int64_t[]){2, N}, NULL);
  good.w = (kiln_hal_qweight_t){
      .buffer = wbuf->b, .format = fmt, .group_size = 32, .n = N, .k = K, .row_stride = K};
  good.w.scales = oh_view(sbuf, 0, KILN_HAL_F32, 2, (const int64_t[]){N, 2}, NULL);
  good.w.zeros = oh_absent();
  good.w.g_idx = oh_absent();
  a = good, a.w.group_size = 0;
  oh_expect_error(be->t->gemm_quant(be->stream, &a), "group_size 0");
  a = good, a.w.scales = oh_absent();
  oh_expect_error(be->t->gemm_quant(be->stream, &a), "scales absent");
  a = good, a.w.scales.dtype = KILN_HAL_F16;
  oh_expect_error(be->t->gemm_quant(be->stream, &a), "f16 scales");
  a = good, a.w.group_size = 16;
  oh_expect_error(be->t->gemm_quant(be->stream, &a), "groups != ceil(K / group_size)");
  a = good, a.w.zeros = oh_view(sbuf, 0, KILN_HAL_U8, 2, (const int64_t[]){N, 2}, NULL);
  oh_expect_error(be->t->gemm_quant(be->stream, &a), "zeros present");
  a = good, a.w.g_idx = oh_view(ibuf, 0, KILN_HAL_I32, 1, (const int64_t[]){K}, NULL);
  oh_expect_error(be->t->gemm_quant(be->stream, &a), "g_idx present");
  a = good, a.w.row_stride -= 1;
  oh_expect_error(be->t->gemm_quant(be->stream, &a), "row_stride below a row");
  a = good, a.x_quant = 2;
  oh_expect_error(be->t->gemm_quant(be->stream, &a), "x_quant 2");
  a = good, a.x_quant = -1;
  oh_expect_error(be->t->gemm_quant(be->stream, &a), "x_quant -1");
  oh_free_all();
}

/* Group-format arguments the op must refuse. */
static void gqg_bad_args(const oh_backend_t *be, int32_t fmt) {
  oh_case(be, "gemm_quant", KILN_HAL_F32, "%s bad arguments", kiln_hal_qfmt_name(fmt));
  const int64_t K = 64, N = 4;
  oh_buf_t *xbuf = oh_buf_new(be, 4 * 2 * K), *ybuf = oh_buf_new(be, 64);
  oh_buf_t *wbuf = oh_buf_new(be, (size_t)(N * K)), *sbuf = oh_buf_new(be, 64);
  oh_buf_t *ibuf = oh_buf_new(be, (size_t)K * 4);
  memset(sbuf->host, 0, 64);
  for (int64_t k = 0; k < K; k++) ((int32_t *)(void *)ibuf->host)[k] = (int32_t)(k / 32);
  ((int32_t *)(void *)ibuf->host)[K - 1] = 2; /* one group past the two there are */
  oh_push(sbuf);
  oh_push(ibuf);
  kiln_hal_gemm_quant_args_t good, a;
  memset(&good, 0, sizeof(good));
  good.struct_size = sizeof(good);
  good.x = oh_view(xbuf, 0, KILN_HAL_F32, 2, (const int64_t[]){2, K}, NULL);
  good.y = oh_view(ybuf, 0, KILN_HAL_F32, 2, (const int64_t[]){2, N}, NULL);
  good.w = (kiln_hal_qweight_t){.buffer = wbuf->b,
                                .format = fmt,
                                .group_size = 32,
                                .n = N,
                                .k = K,
                                .row_stride = kiln_hal_qgroup_row_bytes(fmt, K)};
  good.w.scales = oh_view(sbuf, 0, KILN_HAL_F16, 2, (const int64_t[]){N, 2}, NULL);
  good.w.zeros = oh_absent();
  good.w.g_idx = oh_absent();
  a = good, a.w.group_size = 0;
  oh_expect_error(be->t->gemm_quant(be->stream, &a), "group_size 0");
  a = good, a.w.scales = oh_absent();
  oh_expect_error(be->t->gemm_quant(be->stream, &a), "scales absent");
  a = good, a.w.scales.dtype = KILN_HAL_BF16;
  oh_expect_error(be->t->gemm_quant(be->stream, &a), "bf16 scales");
  a = good, a.w.group_size = 16;
  oh_expect_error(be->t->gemm_quant(be->stream, &a), "groups != ceil(K / group_size)");
  a = good, a.w.zeros = oh_view(sbuf, 0, KILN_HAL_U8, 2, (const int64_t[]){N, 3}, NULL);
  oh_expect_error(be->t->gemm_quant(be->stream, &a), "zeros of another shape");
  a = good, a.w.row_stride -= 1;
  oh_expect_error(be->t->gemm_quant(be->stream, &a), "row_stride below a row");
  a = good, a.w.g_idx = oh_view(ibuf, 0, KILN_HAL_I32, 1, (const int64_t[]){K - 1}, NULL);
  oh_expect_error(be->t->gemm_quant(be->stream, &a), "g_idx of K - 1 entries");
  a = good, a.w.g_idx = oh_view(ibuf, 0, KILN_HAL_I32, 1, (const int64_t[]){K}, NULL);
  oh_expect_error(be->t->gemm_quant(be->stream, &a), "g_idx entry outside the groups");
  if (fmt == KILN_HAL_QFMT_INT4_G) {
    a = good, a.w.k = K - 1, a.x.shape[1] = K - 1;
    oh_expect_error(be->t->gemm_quant(be->stream, &a), "odd K");
  }
  oh_free_all();
}

static void gqg_all(const oh_backend_t *be, int32_t fmt) {
  /* FP8: no zeros, no g_idx; group_size K (0 here) is per-channel (and per-tensor) scales,
   * 128 the block checkpoints' [128, 128] blocks. */
  const bool fp8 = fmt == KILN_HAL_QFMT_FP8_E4M3;
  static const int64_t Ms[] = {1, 2, 3, 8, 9, 17, 64};
  static const int32_t gss[] = {32, 64, 128, 0};
  for (int di = 0; di < 3; di++) {
    const int32_t dt = oh_float_dtypes[di];
    if (!oh_dtype_ok(be, dt)) continue;
    for (size_t mi = 0; mi < ARRAY_LEN(Ms); mi++)
      for (size_t gi = 0; gi < ARRAY_LEN(gss); gi++)
        for (int v = 0; v < 2; v++) {
          gqg_case_t g;
          memset(&g, 0, sizeof(g));
          g.M = Ms[mi];
          g.N = oh_rand_int(1, 40);
          g.K = 256;
          g.group_size = gss[gi];
          g.zeros = !fp8 && (v == 0 || oh_rand_int(0, 1));
          g.g_idx = !fp8 && v == 1;
          g.bias = oh_rand_int(0, 1);
          g.y_f32 = oh_rand_int(0, 1);
          g.w_pad = oh_rand_int(0, 3);
          g.s_pad = oh_rand_int(0, 2);
          gqg_run(be, fmt, dt, &g);
        }
    /* K not a multiple of the group (ceil) nor of 8 or the span, and symmetric. */
    gqg_case_t odd = {5, 19, 298, 64, false, false, true, false, 1, 0, false};
    gqg_run(be, fmt, dt, &odd);
    odd.M = 20, odd.g_idx = !fp8, odd.zeros = !fp8;
    gqg_run(be, fmt, dt, &odd);
    if (fp8) { /* per-channel over an odd K; blocks of 128 over a K with a partial block */
      gqg_case_t pc = {3, 7, 298, 0, false, false, true, true, 0, 1, false};
      gqg_run(be, fmt, dt, &pc);
      pc.M = 33, pc.K = 200, pc.group_size = 128;
      gqg_run(be, fmt, dt, &pc);
      /* The decode paths' corners (CUDA: M <= 8 with x rows 16-byte aligned is the GEMV, 16
       * codes a load when rows are 16-byte aligned): a K % 16 tail with aligned rows (w_pad
       * 6: 304-byte rows) and with odd ones, groups of 20 that split the 16-code pieces, a K
       * below one piece, M = 8 over a partial block of 128. */
      static const gqg_case_t dec[] = {{1, 13, 298, 64, false, false, true, false, 6, 0, false},
                                       {1, 13, 298, 0, false, false, false, true, 0, 1, false},
                                       {2, 11, 304, 20, false, false, true, true, 0, 0, false},
                                       {1, 5, 8, 0, false, false, true, false, 0, 0, false},
                                       {8, 9, 200, 128, false, false, true, false, 8, 0, false}};
      for (size_t i = 0; i < ARRAY_LEN(dec); i++) gqg_run(be, fmt, dt, &dec[i]);
      /* x_quant = FP8_TOKEN (W8A8): decode and prefill sizes (the GEMV and the tiled or
       * FP8-matrix paths), per-channel and blocks of 128, bias, f32 y, padded rows, an odd K. */
      if (be->info.caps & KILN_HAL_CAP_FP8_XQUANT) {
        static const gqg_case_t xqc[] = {{1, 24, 256, 0, false, false, true, false, 0, 0, true},
                                         {3, 37, 512, 0, false, false, false, true, 16, 1, true},
                                         {8, 16, 256, 128, false, false, true, false, 0, 0, true},
                                         {40, 48, 256, 0, false, false, true, false, 0, 0, true},
                                         {64, 64, 512, 0, false, false, false, false, 0, 0, true},
                                         {70, 33, 298, 0, false, false, true, true, 6, 2, true},
                                         {33, 40, 512, 128, false, false, false, true, 0, 0, true}};
        for (size_t i = 0; i < ARRAY_LEN(xqc); i++) gqg_run(be, fmt, dt, &xqc[i]);
      }
    }
  }
  gqg_case_t big = {1, 256, 4096, 128, !fp8, false, true, false, 0, 0, false};
  gqg_run(be, fmt, KILN_HAL_F32, &big);
  big.M = 5, big.g_idx = !fp8;
  gqg_run(be, fmt, KILN_HAL_F32, &big);
  if (fp8)
    gq8_bad_args(be);
  else
    gqg_bad_args(be, fmt);
}

void test_ops_gemm_quant(void **state) {
  (void)state;
  oh_test_begin("gemm_quant");
  for (int bi = 0; bi < oh_num_backends; bi++) {
    const oh_backend_t *be = &oh_backends[bi];
    const bool has_op = KILN_HAL_HAS(be->t, gemm_quant) && be->t->gemm_quant;
    for (int32_t fmt = 1; fmt < KILN_HAL_QFMT_COUNT; fmt++) {
      if (!(be->info.caps & KILN_HAL_CAP_QUANT(fmt))) continue;
      if (!has_op) {
        oh_case(be, "gemm_quant", KILN_HAL_F32, "%s", kiln_hal_qfmt_name(fmt));
        oh_fail("the device claims KILN_HAL_CAP_QUANT(%s) but the table has no gemm_quant",
                kiln_hal_qfmt_name(fmt));
        continue;
      }
      for (int di = 0; di < 3; di++) {
        if (!oh_dtype_ok(be, oh_float_dtypes[di])) continue;
        for (size_t ci = 0; ci < ARRAY_LEN(gq_cases); ci++)
          gq_run(be, fmt, oh_float_dtypes[di], &gq_cases[ci]);
        /* Fresh shapes every run (the seed reproduces them). */
        for (int r = 0; r < 3; r++) {
          gq_case_t g;
          memset(&g, 0, sizeof(g));
          g.M = oh_rand_int(1, 40);
          g.N = oh_rand_int(1, 90);
          g.bias = oh_rand_int(0, 1);
          g.y_f32 = oh_rand_int(0, 1);
          g.x_pad = oh_rand_int(0, 2);
          g.y_pad = oh_rand_int(0, 2);
          g.w_pad = oh_rand_int(0, 9);
          g.w_off = (uint64_t)oh_rand_int(0, 40);
          gq_run(be, fmt, oh_float_dtypes[di], &g);
        }
      }
      /* Decode at a real model's width: K = 4096, N = 256, M = 1 and 5 (the portable and
       * vector paths over many blocks), f32 x only. */
      gq_case_t big = {1, 256, 4096, true, false, 0, 0, 0, 0};
      gq_run(be, fmt, KILN_HAL_F32, &big);
      big.M = 5;
      gq_run(be, fmt, oh_dtype_ok(be, KILN_HAL_BF16) ? KILN_HAL_BF16 : KILN_HAL_F32, &big);
      big.M = 8;
      gq_run(be, fmt, oh_dtype_ok(be, KILN_HAL_F16) ? KILN_HAL_F16 : KILN_HAL_F32, &big);
      gq_bad_args(be, fmt);
    }
    for (int32_t fmt = KILN_HAL_QFMT_INT4_G; fmt < KILN_HAL_QFMT_GROUP_END; fmt++) {
      if (!(be->info.caps & KILN_HAL_CAP_QUANT(fmt))) continue;
      if (!has_op) {
        oh_case(be, "gemm_quant", KILN_HAL_F32, "%s", kiln_hal_qfmt_name(fmt));
        oh_fail("the device claims KILN_HAL_CAP_QUANT(%s) but the table has no gemm_quant",
                kiln_hal_qfmt_name(fmt));
        continue;
      }
      gqg_all(be, fmt);
    }
  }
  oh_test_end();
}
