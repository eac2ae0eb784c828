/* cpu_qgemm.c - gemm_quant: y = x @ dequant(W)^T + bias for the GGUF block formats, the
 * group formats INT4_G / INT8_G (GPTQ, AWQ repacked at load; ABI 1.4) and FP8_E4M3 (FP8
 * checkpoints; within ABI 1.5).
 *
 * W is never widened as a whole. Paths:
 *   M <= 8   decode: the pool runs chunks of weight rows; each row is walked block by block,
 *            a block dequantized (AVX2, or kiln/hal_quant.h's portable code) into a 1 KiB
 *            buffer that stays in L1 and FMA'd straight into the M rows' accumulators. The
 *            bound is reading W once, at its quantized size.
 *   M > 8    prefill: each task dequantizes a panel of 64 weight rows into per-thread F32
 *            scratch (K * 64 floats: 1 MiB at K = 4096, L2-sized) and runs one single-threaded
 *            cblas_sgemm of x against it, so every dequantized weight is used M times.
 * The dequantized values are the format's exact f32 values in both paths (the AVX2 code does
 * the same f32 operations as hal_quant.h: integer -> float, then the multiplies and subtract
 * the format defines, never fused); sums are F32, bias added and y rounded once at the end.
 * The group formats take the same two paths with a span of a row (QG_SPAN weights, or the
 * panel's whole rows) dequantized at a time instead of a block: (float)(q - z) * s, exact in
 * f32 either way (AVX2 for groups of a multiple of 8 without g_idx, else hal_quant.h's loop).
 * FP8_E4M3 is a group format with f32 scales and no zeros: the AVX2 code widens 8 codes to f32
 * exactly (an E4M3FN byte shifted into an f16's bit positions, F16C, times 2^8) and multiplies
 * by the group's scale once, as kiln_hal_fp8_dequant; at M = 1 it skips the buffer, 16 codes
 * per step FMA'd straight into the sums with 2^8 folded into the scale (the same product). */
#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"
#include "kiln/hal_quant.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define QG_X86 1
#include <immintrin.h>
#else
#define QG_X86 0
#endif

#define QG_SMALL_M 8 /* rows of x up to which the direct kernel runs */
#define QG_ROWS 16   /* weight rows per task of the direct kernel */
#define QG_PANEL 64  /* weight rows dequantized per sgemm of the prefill path */
#define QG_SPAN 256  /* weights of a group-format row dequantized at a time (direct kernel) */

typedef struct qg_ctx {
  int32_t fmt;
  int64_t M, N, K;
  const float *x; /* [M, K] F32, row stride ldx */
  int64_t ldx;
  const uint8_t *w;
  int64_t row_stride;
  /* Group formats: scales (F16, or F32 for FP8; row stride lds elements, ses bytes each),
   * zeros (U8, ldz; NULL: symmetric), g_idx (NULL: k / group_size). */
  const uint8_t *scales, *zeros;
  int64_t lds, ldz, ses;
  const int32_t *g_idx;
  int32_t group_size;
  int64_t G; /* groups per row */
  const kiln_hal_tensor_t *y, *bias;
  float *tmp; /* prefill: per thread, K * QG_PANEL dequantized weights + M * QG_PANEL sums */
  const float *xs; /* decode, qg_fast_fmt: x's sums over each 16 elements, [M, K / 16] */
  const float *xscale; /* x_quant: row m's FP8 scale s_m (x holds the codes' values), or NULL */
  int64_t tmp_floats;
} qg_ctx_t;

/* ---- block dequantization ----------------------------------------------------------------- */

#if QG_X86
#define QG_AVX2 __attribute__((target("avx2,fma,f16c")))
#define QG_AVX2_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) static inline

/* The 8 signed bytes in the low half of v as f32. */
QG_AVX2_INLINE __m256 qg_i8x8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

/* out[0..32) = (float)b[i] * mul - sub for 32 signed bytes (sub 0: a plain product). */
QG_AVX2_INLINE void qg_store32(__m256i b, __m256 mul, __m256 sub, float *out) {
  __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
  _mm256_storeu_ps(out, _mm256_sub_ps(_mm256_mul_ps(qg_i8x8(lo), mul), sub));
  _mm256_storeu_ps(out + 8, _mm256_sub_ps(_mm256_mul_ps(qg_i8x8(_mm_srli_si128(lo, 8)), mul), sub));
  _mm256_storeu_ps(out + 16, _mm256_sub_ps(_mm256_mul_ps(qg_i8x8(hi), mul), sub));
  _mm256_storeu_ps(out + 24,
                   _mm256_sub_ps(_mm256_mul_ps(qg_i8x8(_mm_srli_si128(hi, 8)), mul), sub));
}

QG_AVX2 static void qg_dequant_avx2(int32_t fmt, const uint8_t *blk, float *out) {
  const __m256i m4 = _mm256_set1_epi8(15), zero = _mm256_setzero_si256();
  const __m256 fz = _mm256_setzero_ps();
  switch (fmt) {
    case KILN_HAL_QFMT_Q8_0: {
      __m256 d = _mm256_set1_ps(kiln_hal_quant_f16(blk));
      qg_store32(_mm256_loadu_si256((const __m256i *)(blk + 2)), d, fz, out);
      return;
    }
    case KILN_HAL_QFMT_Q4_0: {
      __m256 d = _mm256_set1_ps(kiln_hal_quant_f16(blk));
      __m128i q = _mm_loadu_si128((const __m128i *)(blk + 2));
      __m128i lo = _mm_and_si128(q, _mm_set1_epi8(15));
      __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(15));
      __m256i b = _mm256_sub_epi8(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(8));
      qg_store32(b, d, fz, out);
      return;
    }
    case KILN_HAL_QFMT_Q4_K:
    case KILN_HAL_QFMT_Q5_K: {
      const bool five = fmt == KILN_HAL_QFMT_Q5_K;
      const float d = kiln_hal_quant_f16(blk), dmin = kiln_hal_quant_f16(blk + 2);
      const uint8_t *qs = blk + (five ? 48 : 16);
      const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : zero;
      for (int c = 0; c < 4; c++) {
        __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        __m256i nib[2] = {_mm256_and_si256(q, m4), _mm256_and_si256(_mm256_srli_epi16(q, 4), m4)};
        for (int h = 0; h < 2; h++) {
          const int s = 2 * c + h;
          int sc, m;
          kiln_hal_quant_k_scale_min(blk + 4, s, &sc, &m);
          __m256i v = nib[h];
          if (five) {
            __m256i bit = _mm256_set1_epi8((char)(1 << s));
            __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
            v = _mm256_or_si256(v, _mm256_and_si256(set, _mm256_set1_epi8(16)));
          }
          qg_store32(v, _mm256_set1_ps(d * (float)sc), _mm256_set1_ps(dmin * (float)m),
                     out + 32 * s);
        }
      }
      return;
    }
    case KILN_HAL_QFMT_Q6_K: {
      const float d = kiln_hal_quant_f16(blk + 208);
      const int8_t *sc = (const int8_t *)(blk + 192);
      const __m256i m2 = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
      for (int h = 0; h < 2; h++) {
        __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
        __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
        __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        __m256i lows[4] = {_mm256_and_si256(ql0, m4), _mm256_and_si256(ql1, m4),
                           _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                           _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4)};
        for (int r = 0; r < 4; r++) {
          __m256i high = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * r), m2);
          __m256i q = _mm256_sub_epi8(_mm256_or_si256(lows[r], _mm256_slli_epi16(high, 4)), off);
          float *o = out + 128 * h + 32 * r;
          const int is = 8 * h + 2 * r; /* sub-blocks of 16: two per run of 32 */
          __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
          __m256 s0 = _mm256_set1_ps(d * (float)sc[is]), s1 = _mm256_set1_ps(d * (float)sc[is + 1]);
          _mm256_storeu_ps(o, _mm256_mul_ps(s0, qg_i8x8(lo)));
          _mm256_storeu_ps(o + 8, _mm256_mul_ps(s0, qg_i8x8(_mm_srli_si128(lo, 8))));
          _mm256_storeu_ps(o + 16, _mm256_mul_ps(s1, qg_i8x8(hi)));
          _mm256_storeu_ps(o + 24, _mm256_mul_ps(s1, qg_i8x8(_mm_srli_si128(hi, 8))));
        }
      }
      return;
    }
    default: return;
  }
}

/* acc[m] += sum_j x[m * ldx + j] * w[j], j < E (a multiple of 32), for m < M <= 8. */
QG_AVX2_INLINE void qg_fma_rows(int64_t M, const float *x, int64_t ldx, const float *w, int E,
                                __m256 *acc) {
  for (int j = 0; j < E; j += 8) {
    __m256 wv = _mm256_loadu_ps(w + j);
    for (int64_t m = 0; m < M; m++)
      acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ldx + j), wv, acc[m]);
  }
}

/* out[m] = sum_k x[m, k] * W[row, k] for one weight row. */
QG_AVX2 static void qg_row_avx2(int32_t fmt, int64_t M, int64_t K, const float *x, int64_t ldx,
                                const uint8_t *wrow, float *out) {
  const int E = kiln_hal_qfmt_block_elems(fmt), B = kiln_hal_qfmt_block_bytes(fmt);
  float w[256] __attribute__((aligned(32)));
  __m256 acc[QG_SMALL_M];
  for (int64_t m = 0; m < M; m++) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / E; b++) {
    qg_dequant_avx2(fmt, wrow + b * B, w);
    qg_fma_rows(M, x + b * E, ldx, w, E, acc);
  }
  for (int64_t m = 0; m < M; m++) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    out[m] = _mm_cvtss_f32(s);
  }
}
/* The 8 codes of weights k .. k + 7 of a group-format row (k a multiple of 8) as int32s. */
QG_AVX2_INLINE __m256i qg_codes8(bool four, const uint8_t *row, int64_t k) {
  if (four) {
    uint32_t v;
    memcpy(&v, row + k / 2, 4);
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)v), shifts),
                            _mm256_set1_epi32(15));
  }
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + k)));
}

/* 8 E4M3FN codes (not NaN), each in the high byte of a 16-bit lane, as f32 values 2^-8 times
 * theirs, exactly: an arithmetic shift right by one puts the sign at bit 15 (and a copy at
 * bit 14, cleared), the exponent at bits 13..10 and the mantissa at 9..7, an f16 whose value
 * is the code's over 2^8 (the biases differ by 15 - 7; e4m3 subnormals are f16 subnormals),
 * widened by F16C. */
QG_AVX2_INLINE __m256 qg_fp8_h8(__m128i hi_bytes) {
  const __m128i h = _mm_and_si128(_mm_srai_epi16(hi_bytes, 1), _mm_set1_epi16((short)0xBFFF));
  return _mm256_cvtph_ps(h);
}

/* The 8 codes row[k .. k + 7] as their exact f32 values. */
QG_AVX2_INLINE __m256 qg_fp8x8(const uint8_t *row, int64_t k) {
  const __m128i b =
      _mm_unpacklo_epi8(_mm_setzero_si128(), _mm_loadl_epi64((const __m128i *)(row + k)));
  return _mm256_mul_ps(qg_fp8_h8(b), _mm256_set1_ps(256.0f));
}

/* out[0] = sum_k x[k] * W[n, k] for one FP8 row at M = 1 (group_size a multiple of 16, or
 * K): 16 codes per step straight into two accumulators, no buffer. Each weight is
 * f32(h * (256 s)), h the code's value over 2^8: the same real product as e4m3(q) * s, so
 * the same f32 (256 s is exact while |s| < 2^100, which the caller checked). */
QG_AVX2 static void qg_fp8_row1_avx2(const qg_ctx_t *c, int64_t n, const float *s256, float *out) {
  const uint8_t *row = c->w + n * c->row_stride;
  const float *x = c->x;
  const int64_t K = c->K, gs = c->group_size;
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  const __m128i z = _mm_setzero_si128();
  int64_t k = 0;
  for (int64_t g = 0; k + 16 <= K; g++) {
    int64_t end = (g + 1) * gs;
    if (end > K) end = K;
    const __m256 sc = _mm256_set1_ps(s256[g]);
    for (; k + 16 <= end; k += 16) {
      const __m128i v = _mm_loadu_si128((const __m128i *)(row + k));
      const __m256 w0 = _mm256_mul_ps(qg_fp8_h8(_mm_unpacklo_epi8(z, v)), sc);
      const __m256 w1 = _mm256_mul_ps(qg_fp8_h8(_mm_unpackhi_epi8(z, v)), sc);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), w0, a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), w1, a1);
    }
    if (k < end) break; /* fewer than 16 left: only at the end of K */
  }
  float tail = 0.0f, w[16];
  if (k < K) {
    kiln_hal_fp8_dequant(row, c->scales + c->ses * n * c->lds, c->group_size, k, K - k, w);
    for (int64_t j = 0; j < K - k; j++) tail += x[k + j] * w[j];
  }
  const __m256 t = _mm256_add_ps(a0, a1);
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  out[0] = _mm_cvtss_f32(r) + tail;
}
#endif /* QG_X86 */

#define QG_MAXG 1024 /* groups per row the AVX2 path tabulates (more: the portable loop) */

/* A row's groups as f32 scales and int zeros: the values kiln_hal_qgroup_dequant uses. */
typedef struct qg_row_groups {
  float s[QG_MAXG];
  int32_t z[QG_MAXG];
} qg_row_groups_t;

static bool qg_row_groups(const qg_ctx_t *c, int64_t n, qg_row_groups_t *rg) {
  if (c->G > QG_MAXG) return false;
  const uint8_t *srow = c->scales + c->ses * n * c->lds,
                *zrow = c->zeros ? c->zeros + n * c->ldz : NULL;
  const int sym = c->fmt == KILN_HAL_QFMT_INT4_G ? 8 : 128;
  if (c->fmt == KILN_HAL_QFMT_FP8_E4M3) {
    memcpy(rg->s, srow, (size_t)c->G * 4);
    return true;
  }
  for (int64_t g = 0; g < c->G; g++) {
    rg->s[g] = kiln_hal_quant_f16(srow + 2 * g);
    rg->z[g] = zrow ? zrow[g] : sym;
  }
  return true;
}

#if QG_X86
/* out[i] = W[n, k0 + i], i < count (k0 a multiple of 8; without g_idx, group_size too): 8
 * weights at a time, the same f32 operations as kiln_hal_qgroup_dequant (integer q - z to f32,
 * times the scale), the group's scale and zero broadcast per group, or gathered through g_idx. */
QG_AVX2 static void qg_group_span_avx2(const qg_ctx_t *c, int64_t n, const qg_row_groups_t *rg,
                                       int64_t k0, int64_t count, float *out) {
  const uint8_t *row = c->w + n * c->row_stride;
  const bool four = c->fmt == KILN_HAL_QFMT_INT4_G;
  int64_t i = 0;
  if (c->fmt == KILN_HAL_QFMT_FP8_E4M3) { /* no g_idx, no zeros */
    while (i + 8 <= count) {
      const int64_t g = (k0 + i) / c->group_size;
      int64_t end = (g + 1) * c->group_size - k0;
      if (end > count) end = count;
      const __m256 sc = _mm256_set1_ps(rg->s[g]);
      for (; i + 8 <= end; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(qg_fp8x8(row, k0 + i), sc));
    }
  } else if (c->g_idx) {
    for (; i + 8 <= count; i += 8) {
      const __m256i gi = _mm256_loadu_si256((const __m256i *)(c->g_idx + k0 + i));
      const __m256 sc = _mm256_i32gather_ps(rg->s, gi, 4);
      const __m256i z = _mm256_i32gather_epi32(rg->z, gi, 4);
      const __m256i q = qg_codes8(four, row, k0 + i);
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, z)), sc));
    }
  } else {
    while (i + 8 <= count) { /* one group (a multiple of 8 weights) per pass */
      const int64_t g = (k0 + i) / c->group_size;
      int64_t end = (g + 1) * c->group_size - k0;
      if (end > count) end = count;
      const __m256 sc = _mm256_set1_ps(rg->s[g]);
      const __m256i z = _mm256_set1_epi32(rg->z[g]);
      for (; i + 8 <= end; i += 8) {
        const __m256i q = qg_codes8(four, row, k0 + i);
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, z)), sc));
      }
    }
  }
  if (i < count)
    kiln_hal_qgroup_dequant(c->fmt, row, c->scales + c->ses * n * c->lds,
                            c->zeros ? c->zeros + n * c->ldz : NULL, c->g_idx, c->group_size,
                            k0 + i, count - i, out + i);
}
#endif /* QG_X86 */

/* out[i] = W[n, k0 + i] for i < count, a group format; rg: the row's groups, or NULL. */
static void qg_group_span(const qg_ctx_t *c, int64_t n, const qg_row_groups_t *rg, int64_t k0,
                          int64_t count, float *out) {
#if QG_X86
  if (rg && cpu_vec_avx2() && k0 % 8 == 0 && (c->g_idx || c->group_size % 8 == 0)) {
    qg_group_span_avx2(c, n, rg, k0, count, out);
    return;
  }
#else
  (void)rg;
#endif
  kiln_hal_qgroup_dequant(c->fmt, c->w + n * c->row_stride, c->scales + c->ses * n * c->lds,
                          c->zeros ? c->zeros + n * c->ldz : NULL, c->g_idx, c->group_size, k0,
                          count, out);
}

#if QG_X86
/* out[m] = sum_k x[m, k] * W[n, k] for one group-format weight row. */
QG_AVX2 static void qg_group_row_avx2(const qg_ctx_t *c, int64_t n, float *out) {
  float w[QG_SPAN] __attribute__((aligned(32)));
  qg_row_groups_t rg;
  const bool tab = qg_row_groups(c, n, &rg);
  __m256 acc[QG_SMALL_M];
  float tail[QG_SMALL_M] = {0};
  for (int64_t m = 0; m < c->M; m++) acc[m] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < c->K; k0 += QG_SPAN) {
    const int cnt = (int)(c->K - k0 < QG_SPAN ? c->K - k0 : QG_SPAN), e8 = cnt & ~7;
    qg_group_span(c, n, tab ? &rg : NULL, k0, cnt, w);
    qg_fma_rows(c->M, c->x + k0, c->ldx, w, e8, acc);
    for (int64_t m = 0; m < c->M; m++)
      for (int j = e8; j < cnt; j++) tail[m] += c->x[m * c->ldx + k0 + j] * w[j];
  }
  for (int64_t m = 0; m < c->M; m++) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc[m]), _mm256_extractf128_ps(acc[m], 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    out[m] = _mm_cvtss_f32(s) + tail[m];
  }
}
#endif

static void qg_group_row_scalar(const qg_ctx_t *c, int64_t n, float *out) {
  float w[QG_SPAN], acc[QG_SMALL_M] = {0};
  for (int64_t k0 = 0; k0 < c->K; k0 += QG_SPAN) {
    const int64_t cnt = c->K - k0 < QG_SPAN ? c->K - k0 : QG_SPAN;
    qg_group_span(c, n, NULL, k0, cnt, w);
    for (int64_t m = 0; m < c->M; m++) {
      const float *xm = c->x + m * c->ldx + k0;
      float s = 0.0f;
      for (int64_t j = 0; j < cnt; j++) s += xm[j] * w[j];
      acc[m] += s;
    }
  }
  for (int64_t m = 0; m < c->M; m++) out[m] = acc[m];
}

static void qg_dequant(int32_t fmt, const uint8_t *blk, float *out) {
#if QG_X86
  if (cpu_vec_avx2()) {
    qg_dequant_avx2(fmt, blk, out);
    return;
  }
#endif
  kiln_hal_quant_dequant(fmt, blk, out);
}

static void qg_row_scalar(int32_t fmt, int64_t M, int64_t K, const float *x, int64_t ldx,
                          const uint8_t *wrow, float *out) {
  const int E = kiln_hal_qfmt_block_elems(fmt), B = kiln_hal_qfmt_block_bytes(fmt);
  float w[256], acc[QG_SMALL_M] = {0};
  for (int64_t b = 0; b < K / E; b++) {
    kiln_hal_quant_dequant(fmt, wrow + b * B, w);
    for (int64_t m = 0; m < M; m++) {
      const float *xm = x + m * ldx + b * E;
      float s = 0.0f;
      for (int j = 0; j < E; j++) s += xm[j] * w[j];
      acc[m] += s;
    }
  }
  for (int64_t m = 0; m < M; m++) out[m] = acc[m];
}

/* ---- the decode kernel with the block scales factored out ------------------------------------
 * For one row of x (M = 1) and the formats whose weights are a * q - b per sub-block (q a small
 * integer, a and b the sub-block's f32 scale and offset, exactly as kiln/hal_quant.h computes
 * them): sum_j x_j (a q_j - b) = sum_j x_j (a q_j) - b * sum_j x_j. The integers q go to f32
 * (exact) in registers, a q_j is the f32 product hal_quant.h forms too, and it meets x in one FMA;
 * b multiplies sum_j x_j, computed once per call for every 16 elements of each row (xs), not once
 * per weight row. So the subtraction of b is distributed over the sum (hal.h allows it: ABI
 * 1.4's gemm_quant), and the weights never go through memory as f32. Q4_0, Q8_0, Q4_K, Q6_K
 * and Q5_K take it. */

static bool qg_fast_fmt(int32_t fmt) {
  return fmt == KILN_HAL_QFMT_Q4_0 || fmt == KILN_HAL_QFMT_Q8_0 || fmt == KILN_HAL_QFMT_Q4_K ||
         fmt == KILN_HAL_QFMT_Q5_K || fmt == KILN_HAL_QFMT_Q6_K;
}

#if QG_X86
/* The 8 unsigned bytes in the low half of v as f32. */
QG_AVX2_INLINE __m256 qg_u8x8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }

/* 32 bytes of q (unsigned, or signed when sgn) as four 8-lane f32 vectors. */
QG_AVX2_INLINE void qg_q32(__m256i b, bool sgn, __m256 *q) {
  __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
  if (sgn) {
    q[0] = qg_i8x8(lo), q[1] = qg_i8x8(_mm_srli_si128(lo, 8));
    q[2] = qg_i8x8(hi), q[3] = qg_i8x8(_mm_srli_si128(hi, 8));
  } else {
    q[0] = qg_u8x8(lo), q[1] = qg_u8x8(_mm_srli_si128(lo, 8));
    q[2] = qg_u8x8(hi), q[3] = qg_u8x8(_mm_srli_si128(hi, 8));
  }
}

/* acc[m][at + c] += (a * q[c]) * x[m] chunk c, for the n chunks of 8 of a sub-block (x at its
 * first element): a * q is the f32 product kiln/hal_quant.h forms for the weight's scaled part;
 * four accumulators per row keep the FMAs independent. */
QG_AVX2_INLINE void qg_sub(int64_t M, const __m256 *q, int n, const float *x, int64_t ldx, float a,
                           int at, __m256 (*acc)[4]) {
  const __m256 av = _mm256_set1_ps(a);
  __m256 w[4];
  for (int c = 0; c < n; c++) w[c] = _mm256_mul_ps(q[c], av);
  for (int64_t m = 0; m < M; m++) {
    const float *xm = x + m * ldx;
    for (int c = 0; c < n; c++)
      acc[m][at + c] = _mm256_fmadd_ps(w[c], _mm256_loadu_ps(xm + 8 * c), acc[m][at + c]);
  }
}

/* M is a constant where this is inlined (qg_row_fast_avx2: 1), so the accumulators live in
 * registers. */
QG_AVX2_INLINE void qg_row_fast_body(const qg_ctx_t *c, const uint8_t *wrow, float *out,
                                     const int64_t M) {
  const int64_t K = c->K, ldx = c->ldx, ns = K / 16;
  const int E = kiln_hal_qfmt_block_elems(c->fmt), B = kiln_hal_qfmt_block_bytes(c->fmt);
  const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
  __m256 acc[QG_SMALL_M][4], q[4];
  float off[QG_SMALL_M] = {0}; /* the sum of b * sum(x) terms */
  for (int64_t m = 0; m < M; m++)
    for (int j = 0; j < 4; j++) acc[m][j] = _mm256_setzero_ps();
  for (int64_t blk = 0; blk < K / E; blk++) {
    const uint8_t *p = wrow + blk * B;
    const int64_t k0 = blk * E;
    const float *x = c->x + k0, *xs = c->xs + k0 / 16;
    switch (c->fmt) {
      case KILN_HAL_QFMT_Q8_0: {
        qg_q32(_mm256_loadu_si256((const __m256i *)(p + 2)), true, q);
        qg_sub(M, q, 4, x, ldx, kiln_hal_quant_f16(p), 0, acc);
        break;
      }
      case KILN_HAL_QFMT_Q4_0: { /* w = d (q - 8): a = d, b = 8 d */
        const float d = kiln_hal_quant_f16(p);
        __m128i v = _mm_loadu_si128((const __m128i *)(p + 2));
        __m128i lo = _mm_and_si128(v, _mm_set1_epi8(15));
        __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(15));
        qg_q32(_mm256_set_m128i(hi, lo), false, q);
        qg_sub(M, q, 4, x, ldx, d, 0, acc);
        for (int64_t m = 0; m < M; m++) off[m] += 8.0f * d * (xs[m * ns] + xs[m * ns + 1]);
        break;
      }
      case KILN_HAL_QFMT_Q4_K:
      case KILN_HAL_QFMT_Q5_K: { /* sub-block s: a = d sc[s], b = dmin m[s] */
        const bool five = c->fmt == KILN_HAL_QFMT_Q5_K;
        const float d = kiln_hal_quant_f16(p), dmin = kiln_hal_quant_f16(p + 2);
        const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(p + 16)) : m4;
        for (int cc = 0; cc < 4; cc++) {
          __m256i v = _mm256_loadu_si256((const __m256i *)(p + (five ? 48 : 16) + 32 * cc));
          for (int h = 0; h < 2; h++) {
            const int sb = 2 * cc + h;
            int sc, mn;
            kiln_hal_quant_k_scale_min(p + 4, sb, &sc, &mn);
            __m256i nib = h ? _mm256_and_si256(_mm256_srli_epi16(v, 4), m4) : _mm256_and_si256(v, m4);
            if (five) /* bit sb of qh[l] is weight l's fifth bit: 16 more */
              nib = _mm256_or_si256(
                  nib, _mm256_slli_epi16(
                           _mm256_and_si256(_mm256_srli_epi16(qh, sb), _mm256_set1_epi8(1)), 4));
            qg_q32(nib, false, q);
            qg_sub(M, q, 4, x + 32 * sb, ldx, d * (float)sc, 0, acc);
            const float b = dmin * (float)mn;
            for (int64_t m = 0; m < M; m++)
              off[m] += b * (xs[m * ns + 2 * sb] + xs[m * ns + 2 * sb + 1]);
          }
        }
        break;
      }
      case KILN_HAL_QFMT_Q6_K: { /* sub-block i of 16: a = d scales[i], b = 32 a */
        const float d = kiln_hal_quant_f16(p + 208);
        const int8_t *sc = (const int8_t *)(p + 192);
        for (int hf = 0; hf < 2; hf++) {
          const uint8_t *ql = p + 64 * hf, *qh = p + 128 + 32 * hf;
          const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
          const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
          const __m256i hb = _mm256_loadu_si256((const __m256i *)qh);
          __m256i qq[4];
          qq[0] = _mm256_or_si256(_mm256_and_si256(l0, m4),
                                  _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30));
          qq[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                  _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30));
          qq[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                  _mm256_and_si256(hb, m30));
          qq[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                  _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30));
          for (int j = 0; j < 4; j++) { /* weights 128 hf + 32 j .. + 31: sub-blocks i, i + 1 */
            qg_q32(qq[j], false, q);
            const int i = 8 * hf + 2 * j;
            const float a0 = d * (float)sc[i], a1 = d * (float)sc[i + 1];
            const int64_t k = 128 * hf + 32 * j;
            qg_sub(M, q, 2, x + k, ldx, a0, 0, acc);
            qg_sub(M, q + 2, 2, x + k + 16, ldx, a1, 2, acc);
            for (int64_t m = 0; m < M; m++)
              off[m] += 32.0f * (a0 * xs[m * ns + i] + a1 * xs[m * ns + i + 1]);
          }
        }
        break;
      }
      default: break;
    }
  }
  for (int64_t m = 0; m < M; m++) {
    __m256 t =
        _mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), _mm256_add_ps(acc[m][2], acc[m][3]));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    out[m] = _mm_cvtss_f32(s) - off[m];
  }
}

/* One row of x (decode at batch 1). With several, the four accumulators per row would not stay
 * in registers and the buffer path (qg_row_avx2) is faster. */
QG_AVX2 static void qg_row_fast_avx2(const qg_ctx_t *c, const uint8_t *wrow, float *out) {
  qg_row_fast_body(c, wrow, out, 1);
}
#endif /* QG_X86 */

/* ---- the op --------------------------------------------------------------------------------- */

/* y[m, n] = round(acc + bias[n]). */
static void qg_store(const qg_ctx_t *c, int64_t m, int64_t n, float acc) {
  const kiln_hal_tensor_t *y = c->y;
  if (c->xscale) acc *= c->xscale[m];
  if (c->bias->buffer) acc += kiln_hal_load_f32(cpu_tensor_ptr(c->bias), c->bias->dtype, n);
  kiln_hal_store_f32(cpu_tensor_ptr(y), y->dtype, m * y->stride[0] + n, acc);
}

#if QG_X86
/* FP8 at M = 1 through qg_fp8_row1_avx2 when the row's scales allow it (groups of a multiple
 * of 16 or one group, at most QG_MAXG, every |s| < 2^100); stores y[0, n]. */
static bool qg_fp8_fast(const qg_ctx_t *c, int64_t n) {
  if (c->G > QG_MAXG || (c->G > 1 && c->group_size % 16)) return false;
  float s256[QG_MAXG];
  memcpy(s256, c->scales + c->ses * n * c->lds, (size_t)c->G * 4);
  for (int64_t g = 0; g < c->G; g++) {
    if (!(fabsf(s256[g]) < 0x1p100f)) return false;
    s256[g] *= 256.0f;
  }
  float out;
  qg_fp8_row1_avx2(c, n, s256, &out);
  qg_store(c, 0, n, out);
  return true;
}
#endif

static void qg_small_task(void *vctx, int64_t task, int thread) {
  (void)thread;
  const qg_ctx_t *c = vctx;
  int64_t n0 = task * QG_ROWS, n1 = n0 + QG_ROWS < c->N ? n0 + QG_ROWS : c->N;
  float out[QG_SMALL_M];
  const bool group = kiln_hal_qfmt_is_group(c->fmt);
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t *wrow = c->w + n * c->row_stride;
    if (group) {
#if QG_X86
      if (c->fmt == KILN_HAL_QFMT_FP8_E4M3 && c->M == 1 && cpu_vec_avx2() && qg_fp8_fast(c, n))
        continue;
      if (cpu_vec_avx2())
        qg_group_row_avx2(c, n, out);
      else
#endif
        qg_group_row_scalar(c, n, out);
      for (int64_t m = 0; m < c->M; m++) qg_store(c, m, n, out[m]);
      continue;
    }
#if QG_X86
    if (c->xs)
      qg_row_fast_avx2(c, wrow, out);
    else if (cpu_vec_avx2())
      qg_row_avx2(c->fmt, c->M, c->K, c->x, c->ldx, wrow, out);
    else
#endif
      qg_row_scalar(c->fmt, c->M, c->K, c->x, c->ldx, wrow, out);
    for (int64_t m = 0; m < c->M; m++) qg_store(c, m, n, out[m]);
  }
}

static void qg_panel_task(void *vctx, int64_t task, int thread) {
  const qg_ctx_t *c = vctx;
  const int E = kiln_hal_qfmt_block_elems(c->fmt), B = kiln_hal_qfmt_block_bytes(c->fmt);
  int64_t n0 = task * QG_PANEL, nr = c->N - n0 < QG_PANEL ? c->N - n0 : QG_PANEL;
  float *wp = c->tmp + (int64_t)thread * c->tmp_floats, *yp = wp + c->K * QG_PANEL;
  for (int64_t r = 0; r < nr; r++) {
    if (kiln_hal_qfmt_is_group(c->fmt)) {
      qg_row_groups_t rg;
      const bool tab = cpu_vec_avx2() && qg_row_groups(c, n0 + r, &rg);
      qg_group_span(c, n0 + r, tab ? &rg : NULL, 0, c->K, wp + r * c->K);
      continue;
    }
    const uint8_t *wrow = c->w + (n0 + r) * c->row_stride;
    for (int64_t b = 0; b < c->K / E; b++) qg_dequant(c->fmt, wrow + b * B, wp + r * c->K + b * E);
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)c->M, (int)nr, (int)c->K, 1.0f, c->x,
              (int)c->ldx, wp, (int)c->K, 0.0f, yp, (int)nr);
  for (int64_t m = 0; m < c->M; m++)
    for (int64_t r = 0; r < nr; r++) qg_store(c, m, n0 + r, yp[m * nr + r]);
}

kiln_hal_error_t *cpu_gemm_quant(kiln_hal_stream_t *s, const kiln_hal_gemm_quant_args_t *a,
                                 bool dry_run) {
  kiln_hal_error_t *e = kiln_hal_check_gemm_quant(&cpu_check_env, a);
  if (e) return e;
  const int64_t M = a->x.shape[0], K = a->x.shape[1], N = a->w.n;
  /* sgemm takes int dimensions and leading dimensions. */
  if (M > INT32_MAX || N > INT32_MAX || K > INT32_MAX / QG_PANEL || a->x.stride[0] > INT32_MAX)
    return kiln_hal_error_new(KILN_HAL_ERR_UNSUPPORTED,
                              "gemm_quant: M = %lld, N = %lld, K = %lld is beyond the CPU "
                              "backend's int32 limits",
                              (long long)M, (long long)N, (long long)K);
  if (dry_run || M == 0 || N == 0) return NULL;
  qg_ctx_t c;
  memset(&c, 0, sizeof(c));
  c.fmt = a->w.format;
  c.M = M, c.N = N, c.K = K;
  c.w = (const uint8_t *)a->w.buffer->data + a->w.offset;
  c.row_stride = a->w.row_stride;
  if (kiln_hal_qfmt_is_group(c.fmt)) {
    const kiln_hal_qweight_t *w = &a->w;
    c.scales = (const uint8_t *)cpu_tensor_ptr(&w->scales);
    c.lds = w->scales.stride[0];
    c.ses = (int64_t)kiln_hal_dtype_size(w->scales.dtype);
    c.zeros = w->zeros.buffer ? (const uint8_t *)cpu_tensor_ptr(&w->zeros) : NULL;
    c.ldz = w->zeros.buffer ? w->zeros.stride[0] : 0;
    c.group_size = w->group_size;
    c.G = w->scales.shape[1];
    if (w->g_idx.buffer) { /* every group must exist: never read past the scales */
      const char *gp = cpu_tensor_ptr(&w->g_idx);
      const int64_t G = w->scales.shape[1], gs = w->g_idx.stride[0];
      for (int64_t k = 0; k < K; k++) {
        int32_t g;
        memcpy(&g, gp + (size_t)(k * gs) * 4, 4);
        if (g < 0 || g >= G)
          return kiln_hal_error_new(KILN_HAL_ERR_INVALID_ARGUMENT,
                                    "gemm_quant: w.g_idx[%lld] = %d lies outside the %lld groups",
                                    (long long)k, (int)g, (long long)G);
      }
      c.g_idx = (const int32_t *)gp; /* stride 1 (hal_check: contiguous when K > 1) */
    }
  }
  c.y = &a->y;
  c.bias = &a->bias;
  const bool small = M <= QG_SMALL_M;
  const int threads = cpu_num_threads();
  const bool xq = a->x_quant == KILN_HAL_XQUANT_FP8_TOKEN;
  const bool x_direct = a->x.dtype == KILN_HAL_F32 && !xq;
  size_t xbytes =
      x_direct ? 0 : ((size_t)(M * K + (xq ? M : 0)) * sizeof(float) + 63) & ~(size_t)63;
  if (!small) c.tmp_floats = (K * QG_PANEL + M * QG_PANEL + 15) & ~(int64_t)15;
  size_t tbytes = (size_t)(c.tmp_floats * threads) * sizeof(float);
  const bool fast = M == 1 && QG_X86 && cpu_vec_avx2() && qg_fast_fmt(c.fmt);
  if (fast) tbytes += (size_t)(M * (K / 16)) * sizeof(float);
  char *scratch = (xbytes + tbytes) ? cpu_scratch(s, xbytes + tbytes + 64) : NULL;
  if ((xbytes + tbytes) && !scratch)
    return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY,
                              "gemm_quant: cannot allocate %zu bytes of scratch", xbytes + tbytes);
  const char *xp = cpu_tensor_ptr(&a->x);
  if (x_direct) {
    c.x = (const float *)xp;
    c.ldx = a->x.stride[0];
  } else { /* widen x once: [M, K] dense F32 */
    const size_t es = kiln_hal_dtype_size(a->x.dtype);
    float *xf = (float *)scratch;
    for (int64_t m = 0; m < M; m++)
      cpu_vec_to_f32(a->x.dtype, xp + (size_t)(m * a->x.stride[0]) * es, xf + m * K, K);
    if (xq) { /* hal.h's x_quant: the codes' values in place, the row scales after them */
      float *sc = xf + M * K;
      for (int64_t m = 0; m < M; m++)
        sc[m] = kiln_hal_fp8_xquant_row(xf + m * K, K, NULL, xf + m * K);
      c.xscale = sc;
    }
    c.x = xf;
    c.ldx = K;
  }
  c.tmp = (float *)(scratch + xbytes);
  if (fast) { /* every block format's K is a multiple of 32: the sums of 16 tile it */
    float *xs = c.tmp;
    for (int64_t m = 0; m < M; m++)
      for (int64_t j = 0; j < K / 16; j++) {
        const float *v = c.x + m * c.ldx + 16 * j;
        float t = 0.0f;
        for (int i = 0; i < 16; i++) t += v[i];
        xs[m * (K / 16) + j] = t;
      }
    c.xs = xs;
  }
  if (small)
    cpu_pool_run(cpu_g_pool, (N + QG_ROWS - 1) / QG_ROWS, qg_small_task, &c);
  else
    cpu_pool_run(cpu_g_pool, (N + QG_PANEL - 1) / QG_PANEL, qg_panel_task, &c);
  return NULL;
}
