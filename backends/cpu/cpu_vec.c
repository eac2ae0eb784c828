/* cpu_vec.c - the CPU backend's inner loops: dtype conversion, dot/axpy, exp, small-M GEMM,
 * attention tiles.
 *
 * Each kernel has a portable scalar version and, on x86-64, an AVX2/FMA/F16C version (the
 * attention tiles an AVX-512F one too) compiled with a target attribute (the plugin itself is
 * built for baseline x86-64, so it still loads on any CPU); cpu_vec_init() picks one at run
 * time with __builtin_cpu_supports. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define CPU_HAVE_X86 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define CPU_HAVE_X86 0
#endif

static bool g_avx2;   /* AVX2 + FMA + F16C kernels selected */
static bool g_avx512; /* and the AVX-512F attention tiles */
static char g_features[64] = "scalar";

/* ============================================================================================
 * Scalar kernels
 * ==========================================================================================*/

static void to_f32_scalar(int32_t dtype, const void *src, float *dst, int64_t n) {
  const uint16_t *h = src;
  if (dtype == KILN_HAL_F16)
    for (int64_t i = 0; i < n; i++) dst[i] = kiln_hal_f16_to_f32(h[i]);
  else
    for (int64_t i = 0; i < n; i++) dst[i] = kiln_hal_bf16_to_f32(h[i]);
}

static void from_f32_scalar(int32_t dtype, const float *src, void *dst, int64_t n) {
  uint16_t *h = dst;
  if (dtype == KILN_HAL_F16)
    for (int64_t i = 0; i < n; i++) h[i] = kiln_hal_f32_to_f16(src[i]);
  else
    for (int64_t i = 0; i < n; i++) h[i] = kiln_hal_f32_to_bf16(src[i]);
}

static float dot_scalar(int32_t dtype, const float *a, const void *b, int64_t n) {
  float acc[4] = {0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int j = 0; j < 4; j++) acc[j] += a[i + j] * kiln_hal_load_f32(b, dtype, i + j);
  for (; i < n; i++) acc[0] += a[i] * kiln_hal_load_f32(b, dtype, i);
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

static void axpy_scalar(int32_t dtype, float alpha, const void *x, float *y, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] += alpha * kiln_hal_load_f32(x, dtype, i);
}

static float exp_sum_scalar(float *x, int64_t n, float m) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; i++) {
    x[i] = x[i] == -INFINITY ? 0.0f : expf(x[i] - m);
    s += x[i];
  }
  return s;
}

/* Written without 1 + tanh / 1 + erf, which cancel catastrophically for negative x. */
static float act_scalar(int32_t act, float x) {
  switch (act) {
    case KILN_HAL_ACT_GELU_TANH: {
      float z = 0.7978845608028654f * (x + 0.044715f * x * x * x);
      return x / (1.0f + expf(-2.0f * z)); /* 0.5 x (1 + tanh z) */
    }
    case KILN_HAL_ACT_GELU: return 0.5f * x * erfcf(-x * 0.7071067811865476f);
    case KILN_HAL_ACT_QUICK_GELU: return x / (1.0f + expf(-1.702f * x));
    default: return x / (1.0f + expf(-x));
  }
}

/* Asks for rows pf[j0..j1) (NULL entries skipped) into L2: prefetcht1 does not hold an L1 miss
 * buffer, so a steady trickle of them keeps many more lines in flight than loads alone. */
static inline void prefetch_rows(const void *const *pf, int64_t j0, int64_t j1, int64_t bytes) {
  for (int64_t j = j0; j < j1; j++)
    if (pf[j])
      for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)pf[j] + o, 0, 2);
}

static void qk_tile_scalar(int32_t dtype, const float *q, int64_t nq, int64_t D,
                           const void *const *k, int64_t nk, float *s, int64_t lds,
                           const void *const *pf) {
  if (pf) prefetch_rows(pf, 0, nk, D * (int64_t)kiln_hal_dtype_size(dtype));
  for (int64_t i = 0; i < nq; i++)
    for (int64_t j = 0; j < nk; j++) s[i * lds + j] = dot_scalar(dtype, q + i * D, k[j], D);
}

static void pv_tile_scalar(int32_t dtype, const float *w, int64_t ldw, int64_t nq,
                           const void *const *v, int64_t nk, int64_t D, const float *corr,
                           float *acc, const void *const *pf) {
  if (pf) prefetch_rows(pf, 0, nk, D * (int64_t)kiln_hal_dtype_size(dtype));
  for (int64_t i = 0; i < nq; i++) {
    float *o = acc + i * D;
    for (int64_t d = 0; d < D; d++) o[d] *= corr[i];
    for (int64_t j = 0; j < nk; j++) axpy_scalar(dtype, w[i * ldw + j], v[j], o, D);
  }
}

static float max_scalar(const float *x, int64_t n) {
  float m = -INFINITY;
  for (int64_t i = 0; i < n; i++) m = x[i] > m ? x[i] : m;
  return m;
}

static void gemm_colb_scalar(int32_t dtype, int64_t M, int64_t K, const float *a, const void *b,
                             int64_t ldb, int64_t n0, int64_t n1, float *out, int64_t ldo) {
  for (int64_t n = n0; n < n1; n++) {
    const char *bn = (const char *)b + n * ldb * (int64_t)kiln_hal_dtype_size(dtype);
    for (int64_t m = 0; m < M; m++) out[m * ldo + n] = cpu_vec_dot(dtype, a + m * K, bn, K);
  }
}

static void gemm_rowb_scalar(int32_t dtype, int64_t M, int64_t K, const float *a, const void *b,
                             int64_t ldb, int64_t n0, int64_t n1, float *out, int64_t ldo) {
  size_t es = kiln_hal_dtype_size(dtype);
  for (int64_t m = 0; m < M; m++) {
    float *o = out + m * ldo;
    for (int64_t n = n0; n < n1; n++) o[n] = 0.0f;
    for (int64_t k = 0; k < K; k++)
      cpu_vec_axpy(dtype, a[m * K + k], (const char *)b + (k * ldb + n0) * (int64_t)es, o + n0,
                   n1 - n0);
  }
}

/* ============================================================================================
 * AVX2 + FMA + F16C kernels
 * ==========================================================================================*/
#if CPU_HAVE_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define AVX2_INLINE __attribute__((target("avx2,fma,f16c"), always_inline)) static inline

/* Loads 8 elements of dtype at p as f32. */
AVX2_INLINE __m256 ld8(int32_t dtype, const void *p) {
  if (dtype == KILN_HAL_F32) return _mm256_loadu_ps((const float *)p);
  __m128i h = _mm_loadu_si128((const __m128i *)p);
  if (dtype == KILN_HAL_F16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* f32 -> bf16 bits in the low 16 of each 32-bit lane, round to nearest even, NaN kept quiet. */
AVX2_INLINE __m256i bf16_round_bits(__m256 v) {
  __m256i u = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(r, q, nan);
}

/* Stores 8 f32 as dtype at p. */
AVX2_INLINE void st8(int32_t dtype, void *p, __m256 v) {
  if (dtype == KILN_HAL_F32) {
    _mm256_storeu_ps((float *)p, v);
  } else if (dtype == KILN_HAL_F16) {
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  } else {
    __m256i r = bf16_round_bits(v);
    __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(lo, hi));
  }
}

AVX2_INLINE float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* exp(x) for x <= 0 after max subtraction (Cephes polynomial, ~1 ulp); 0 below -87.3. */
AVX2_INLINE __m256 exp8(__m256 x) {
  __m256 zero_mask = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, z, x);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  __m256i n = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
  __m256 pow2n = _mm256_castsi256_ps(_mm256_slli_epi32(n, 23));
  return _mm256_andnot_ps(zero_mask, _mm256_mul_ps(y, pow2n));
}

AVX2 static void to_f32_avx2(int32_t dtype, const void *src, float *dst, int64_t n) {
  const uint16_t *h = src;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, ld8(dtype, h + i));
  to_f32_scalar(dtype, h + i, dst + i, n - i);
}

AVX2 static void from_f32_avx2(int32_t dtype, const float *src, void *dst, int64_t n) {
  uint16_t *h = dst;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) st8(dtype, h + i, _mm256_loadu_ps(src + i));
  from_f32_scalar(dtype, src + i, h + i, n - i);
}

AVX2 static float dot_avx2(int32_t dtype, const float *a, const void *b, int64_t n) {
  size_t es = kiln_hal_dtype_size(dtype);
  const char *bb = b;
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  __m256 s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), ld8(dtype, bb + i * es), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), ld8(dtype, bb + (i + 8) * es), s1);
    s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), ld8(dtype, bb + (i + 16) * es), s2);
    s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), ld8(dtype, bb + (i + 24) * es), s3);
  }
  for (; i + 8 <= n; i += 8)
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), ld8(dtype, bb + i * es), s0);
  float s = hsum8(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
  for (; i < n; i++) s += a[i] * kiln_hal_load_f32(b, dtype, i);
  return s;
}

AVX2 static void axpy_avx2(int32_t dtype, float alpha, const void *x, float *y, int64_t n) {
  size_t es = kiln_hal_dtype_size(dtype);
  const char *xx = x;
  __m256 va = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, ld8(dtype, xx + i * es), _mm256_loadu_ps(y + i)));
    _mm256_storeu_ps(y + i + 8, _mm256_fmadd_ps(va, ld8(dtype, xx + (i + 8) * es),
                                                _mm256_loadu_ps(y + i + 8)));
  }
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, ld8(dtype, xx + i * es), _mm256_loadu_ps(y + i)));
  for (; i < n; i++) y[i] += alpha * kiln_hal_load_f32(x, dtype, i);
}

AVX2 static float exp_sum_avx2(float *x, int64_t n, float m) {
  __m256 vm = _mm256_set1_ps(m), acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  return hsum8(acc) + exp_sum_scalar(x + i, n - i, m);
}

/* x * sigmoid(k * x): SILU (k = 1) and QUICK_GELU (k = 1.702). The sigmoid goes through
 * exp(-|kx|), which keeps exp8's argument <= 0 (its accurate range). */
AVX2_INLINE __m256 xsig8(__m256 x, __m256 k) {
  __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  __m256 kx = _mm256_mul_ps(k, x);
  __m256 akx = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), kx);
  __m256 e = exp8(_mm256_sub_ps(zero, akx));
  __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
  __m256 sig = _mm256_blendv_ps(_mm256_mul_ps(e, inv), inv, _mm256_cmp_ps(kx, zero, _CMP_GE_OQ));
  return _mm256_mul_ps(x, sig);
}

/* The sigmoid scale of an activation that has the x * sigmoid(kx) form, else 0. */
static float act_sigmoid_scale(int32_t act) {
  return act == KILN_HAL_ACT_SILU ? 1.0f : act == KILN_HAL_ACT_QUICK_GELU ? 1.702f : 0.0f;
}

AVX2 static void act_mul_avx2(int32_t act, float *g, const float *u, int64_t n) {
  int64_t i = 0;
  float k = act_sigmoid_scale(act);
  if (k != 0.0f) {
    __m256 vk = _mm256_set1_ps(k);
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(g + i,
                       _mm256_mul_ps(xsig8(_mm256_loadu_ps(g + i), vk), _mm256_loadu_ps(u + i)));
  }
  for (; i < n; i++) g[i] = act_scalar(act, g[i]) * u[i];
}

AVX2 static void act_avx2(int32_t act, float *x, int64_t n) {
  int64_t i = 0;
  float k = act_sigmoid_scale(act);
  if (k != 0.0f) {
    __m256 vk = _mm256_set1_ps(k);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, xsig8(_mm256_loadu_ps(x + i), vk));
  }
  for (; i < n; i++) x[i] = act_scalar(act, x[i]);
}

/* Lane i of the result = the sum of the 8 lanes of v[i]. */
AVX2_INLINE __m256 hsum8x8(const __m256 v[8]) {
  __m256 h0 = _mm256_hadd_ps(v[0], v[1]), h1 = _mm256_hadd_ps(v[2], v[3]);
  __m256 h2 = _mm256_hadd_ps(v[4], v[5]), h3 = _mm256_hadd_ps(v[6], v[7]);
  __m256 x = _mm256_hadd_ps(h0, h1), y = _mm256_hadd_ps(h2, h3); /* [0..3 | 0..3], [4..7 | 4..7] */
  return _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
}

/* Scores of NI queries x KB keys (NI * KB == 8): the 8 dot products accumulate in registers
 * over the whole row and are reduced together once. Queries past ni and keys past nk
 * repeat the first (their sums are not stored). */
AVX2_INLINE void qk_block_avx2(int32_t dtype, int NI, int KB, const float *q, int64_t ni, int64_t D,
                               const void *const *k, int64_t nk, float *s, int64_t lds) {
  size_t es = kiln_hal_dtype_size(dtype);
  const char *kj[8];
  for (int j = 0; j < KB; j++) kj[j] = k[j < nk ? j : 0];
  __m256 acc[8];
  for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    __m256 kv[8];
    for (int j = 0; j < KB; j++) kv[j] = ld8(dtype, kj[j] + d * es);
    for (int i = 0; i < NI; i++) {
      __m256 qv = _mm256_loadu_ps(q + (i < ni ? i : 0) * D + d);
      for (int j = 0; j < KB; j++) acc[i * KB + j] = _mm256_fmadd_ps(qv, kv[j], acc[i * KB + j]);
    }
  }
  float r[8];
  _mm256_storeu_ps(r, hsum8x8(acc));
  for (int64_t i = 0; i < ni; i++)
    for (int64_t j = 0; j < KB && j < nk; j++) {
      float x = r[i * KB + j];
      for (int64_t dd = d; dd < D; dd++) x += q[i * D + dd] * kiln_hal_load_f32(kj[j], dtype, dd);
      s[i * lds + j] = x;
    }
}

AVX2_INLINE void qk_tile_avx2_dt(int32_t dtype, const float *q, int64_t nq, int64_t D,
                                 const void *const *k, int64_t nk, float *s, int64_t lds,
                                 const void *const *pf) {
  int64_t rb = D * (int64_t)kiln_hal_dtype_size(dtype);
  for (int64_t i0 = 0; i0 < nq; i0 += 4) {
    int64_t ni = nq - i0 < 4 ? nq - i0 : 4;
    const float *qi = q + i0 * D;
    float *si = s + i0 * lds;
    if (ni >= 3)
      for (int64_t j = 0; j < nk; j += 2) {
        if (pf && i0 == 0) prefetch_rows(pf, j, j + 2 < nk ? j + 2 : nk, rb);
        qk_block_avx2(dtype, 4, 2, qi, ni, D, k + j, nk - j, si + j, lds);
      }
    else if (ni == 2)
      for (int64_t j = 0; j < nk; j += 4) {
        if (pf && i0 == 0) prefetch_rows(pf, j, j + 4 < nk ? j + 4 : nk, rb);
        qk_block_avx2(dtype, 2, 4, qi, 2, D, k + j, nk - j, si + j, lds);
      }
    else
      for (int64_t j = 0; j < nk; j += 8) {
        if (pf && i0 == 0) prefetch_rows(pf, j, j + 8 < nk ? j + 8 : nk, rb);
        qk_block_avx2(dtype, 1, 8, qi, 1, D, k + j, nk - j, si + j, lds);
      }
  }
}

/* The dtype as a constant: no per-load dtype test in the inner loops. */
AVX2 static void qk_tile_avx2(int32_t dtype, const float *q, int64_t nq, int64_t D,
                              const void *const *k, int64_t nk, float *s, int64_t lds,
                              const void *const *pf) {
  if (dtype == KILN_HAL_BF16)
    qk_tile_avx2_dt(KILN_HAL_BF16, q, nq, D, k, nk, s, lds, pf);
  else if (dtype == KILN_HAL_F16)
    qk_tile_avx2_dt(KILN_HAL_F16, q, nq, D, k, nk, s, lds, pf);
  else
    qk_tile_avx2_dt(KILN_HAL_F32, q, nq, D, k, nk, s, lds, pf);
}

/* acc[i][d0 + 8c] (c < C) of NI queries held in registers over all nk values: each V vector
 * is loaded and converted once for the NI queries. */
AVX2_INLINE void pv_block_avx2(int32_t dtype, int NI, int C, const void *const *pf, const float *w,
                               int64_t ldw, const void *const *v, int64_t nk, int64_t D, int64_t d0,
                               const float *corr, float *acc) {
  size_t es = kiln_hal_dtype_size(dtype);
  __m256 a[4][4];
  for (int i = 0; i < NI; i++) {
    __m256 ci = _mm256_set1_ps(corr[i]);
    for (int c = 0; c < C; c++)
      a[i][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + i * D + d0 + 8 * c), ci);
  }
  for (int64_t j = 0; j < nk; j++) {
    if (pf) prefetch_rows(pf, j, j + 1, D * (int64_t)es);
    const char *vj = (const char *)v[j] + d0 * es;
    __m256 vv[4];
    for (int c = 0; c < C; c++) vv[c] = ld8(dtype, vj + 8 * c * es);
    for (int i = 0; i < NI; i++) {
      __m256 wv = _mm256_set1_ps(w[i * ldw + j]);
      for (int c = 0; c < C; c++) a[i][c] = _mm256_fmadd_ps(wv, vv[c], a[i][c]);
    }
  }
  for (int i = 0; i < NI; i++)
    for (int c = 0; c < C; c++) _mm256_storeu_ps(acc + i * D + d0 + 8 * c, a[i][c]);
}

AVX2_INLINE void pv_rows_avx2(int32_t dtype, int NI, int C, const float *w, int64_t ldw,
                              const void *const *v, int64_t nk, int64_t D, const float *corr,
                              float *acc, const void *const *pf) {
  int64_t d = 0;
  for (; d + 8 * C <= D; d += 8 * C)
    pv_block_avx2(dtype, NI, C, d == 0 ? pf : NULL, w, ldw, v, nk, D, d, corr, acc);
  for (; d + 8 <= D; d += 8)
    pv_block_avx2(dtype, NI, 1, d == 0 ? pf : NULL, w, ldw, v, nk, D, d, corr, acc);
  for (int i = 0; i < NI && d < D; i++) {
    float *o = acc + i * D;
    for (int64_t dd = d; dd < D; dd++) o[dd] *= corr[i];
    for (int64_t j = 0; j < nk; j++)
      for (int64_t dd = d; dd < D; dd++)
        o[dd] += w[i * ldw + j] * kiln_hal_load_f32(v[j], dtype, dd);
  }
}

AVX2_INLINE void pv_tile_avx2_dt(int32_t dtype, const float *w, int64_t ldw, int64_t nq,
                                 const void *const *v, int64_t nk, int64_t D, const float *corr,
                                 float *acc, const void *const *pf) {
  for (int64_t i0 = 0; i0 < nq; i0 += 4) {
    const float *wi = w + i0 * ldw, *ci = corr + i0;
    float *ai = acc + i0 * D;
    switch (nq - i0 < 4 ? nq - i0 : 4) {
      case 1: pv_rows_avx2(dtype, 1, 4, wi, ldw, v, nk, D, ci, ai, i0 == 0 ? pf : NULL); break;
      case 2: pv_rows_avx2(dtype, 2, 4, wi, ldw, v, nk, D, ci, ai, i0 == 0 ? pf : NULL); break;
      case 3: pv_rows_avx2(dtype, 3, 2, wi, ldw, v, nk, D, ci, ai, i0 == 0 ? pf : NULL); break;
      default: pv_rows_avx2(dtype, 4, 2, wi, ldw, v, nk, D, ci, ai, i0 == 0 ? pf : NULL); break;
    }
  }
}

/* The dtype as a constant: no per-load dtype test in the inner loops. */
AVX2 static void pv_tile_avx2(int32_t dtype, const float *w, int64_t ldw, int64_t nq,
                              const void *const *v, int64_t nk, int64_t D, const float *corr,
                              float *acc, const void *const *pf) {
  if (dtype == KILN_HAL_BF16)
    pv_tile_avx2_dt(KILN_HAL_BF16, w, ldw, nq, v, nk, D, corr, acc, pf);
  else if (dtype == KILN_HAL_F16)
    pv_tile_avx2_dt(KILN_HAL_F16, w, ldw, nq, v, nk, D, corr, acc, pf);
  else
    pv_tile_avx2_dt(KILN_HAL_F32, w, ldw, nq, v, nk, D, corr, acc, pf);
}

AVX2 static float max_avx2(const float *x, int64_t n) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  /* max_ps(x, m) keeps m when x is NaN, as the scalar loop does. */
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(_mm256_loadu_ps(x + i), m);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  float r = _mm_cvtss_f32(h), t = max_scalar(x + i, n - i);
  return t > r ? t : r;
}

/* Small-M GEMM, B with K contiguous per column: 4 columns x up to 2 rows of A per pass, so
 * each converted B vector feeds two FMAs and A rows stay in L1. */
AVX2_INLINE void colb_block(int32_t dtype, int64_t mr, int64_t K, const float *a, const char *b,
                            int64_t ldbb, int64_t nr, float *out, int64_t ldo) {
  size_t es = kiln_hal_dtype_size(dtype);
  __m256 acc[2][4];
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_ps();
  const char *bj[4];
  for (int j = 0; j < 4; j++) bj[j] = b + (j < nr ? j : 0) * ldbb;
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 a0 = _mm256_loadu_ps(a + k);
    __m256 a1 = mr > 1 ? _mm256_loadu_ps(a + K + k) : a0;
    for (int j = 0; j < 4; j++) {
      __m256 bv = ld8(dtype, bj[j] + k * es);
      acc[0][j] = _mm256_fmadd_ps(a0, bv, acc[0][j]);
      if (mr > 1) acc[1][j] = _mm256_fmadd_ps(a1, bv, acc[1][j]);
    }
  }
  for (int64_t i = 0; i < mr; i++)
    for (int64_t j = 0; j < nr; j++) {
      float s = hsum8(acc[i][j]);
      for (int64_t kk = k; kk < K; kk++) s += a[i * K + kk] * kiln_hal_load_f32(bj[j], dtype, kk);
      out[i * ldo + j] = s;
    }
}

AVX2 static void gemm_colb_avx2(int32_t dtype, int64_t M, int64_t K, const float *a,
                                const void *b, int64_t ldb, int64_t n0, int64_t n1, float *out,
                                int64_t ldo) {
  int64_t ldbb = ldb * (int64_t)kiln_hal_dtype_size(dtype);
  for (int64_t n = n0; n < n1; n += 4) {
    int64_t nr = n1 - n < 4 ? n1 - n : 4;
    const char *bn = (const char *)b + n * ldbb;
    for (int64_t m = 0; m < M; m += 2) {
      if (M - m >= 2)
        colb_block(dtype, 2, K, a + m * K, bn, ldbb, nr, out + m * ldo + n, ldo);
      else
        colb_block(dtype, 1, K, a + m * K, bn, ldbb, nr, out + m * ldo + n, ldo);
    }
  }
}

/* Small-M GEMM, B with N contiguous: 32 columns x up to 2 rows of A per pass. */
AVX2 static void gemm_rowb_avx2(int32_t dtype, int64_t M, int64_t K, const float *a,
                                const void *b, int64_t ldb, int64_t n0, int64_t n1, float *out,
                                int64_t ldo) {
  size_t es = kiln_hal_dtype_size(dtype);
  int64_t n = n0;
  for (; n + 32 <= n1; n += 32) {
    for (int64_t m = 0; m < M; m += 2) {
      int64_t mr = M - m >= 2 ? 2 : 1;
      const float *a0 = a + m * K, *a1 = a0 + (mr > 1 ? K : 0);
      __m256 acc[2][4];
      for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; k++) {
        const char *bk = (const char *)b + (k * ldb + n) * (int64_t)es;
        __m256 x0 = _mm256_set1_ps(a0[k]), x1 = _mm256_set1_ps(a1[k]);
        for (int j = 0; j < 4; j++) {
          __m256 bv = ld8(dtype, bk + j * 8 * (int64_t)es);
          acc[0][j] = _mm256_fmadd_ps(x0, bv, acc[0][j]);
          acc[1][j] = _mm256_fmadd_ps(x1, bv, acc[1][j]);
        }
      }
      for (int64_t i = 0; i < mr; i++)
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + (m + i) * ldo + n + j * 8, acc[i][j]);
    }
  }
  if (n < n1) gemm_rowb_scalar(dtype, M, K, a, b, ldb, n, n1, out, ldo);
}

/* ============================================================================================
 * AVX-512F kernels (the attention tiles): 32 vector registers hold a 4 x 4 score block or
 * 4 queries x 64 output columns.
 * ==========================================================================================*/
#define AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
#define AVX512_INLINE __attribute__((target("avx512f,avx2,fma,f16c"), always_inline)) static inline

/* Loads 16 elements of dtype at p as f32. */
AVX512_INLINE __m512 ld16(int32_t dtype, const void *p) {
  if (dtype == KILN_HAL_F32) return _mm512_loadu_ps((const float *)p);
  __m256i h = _mm256_loadu_si256((const __m256i *)p);
  if (dtype == KILN_HAL_F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Lane i of the result = the sum of the 16 lanes of v[i]: a transposing add tree (45 ops for
 * 16 sums, against ~8 per sum reduced one by one). */
AVX512_INLINE __m512 hsum16x16(const __m512 v[16]) {
  __m512 t[8], u[4], w0, w1;
  for (int m = 0; m < 8; m++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
    t[m] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * m], v[2 * m + 1]),
                         _mm512_unpackhi_ps(v[2 * m], v[2 * m + 1]));
  for (int m = 0; m < 4; m++) /* per 128-bit lane: the lane's sums of v[4m .. 4m+3] */
    u[m] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * m], t[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * m], t[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                     _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                     _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* As qk_block_avx2 with NI * KB == 16 dot products per block. */
AVX512_INLINE void qk_block_avx512(int32_t dtype, int NI, int KB, const float *q, int64_t ni,
                                   int64_t D, const void *const *k, int64_t nk, float *s,
                                   int64_t lds) {
  size_t es = kiln_hal_dtype_size(dtype);
  const char *kj[16];
  for (int j = 0; j < KB; j++) kj[j] = k[j < nk ? j : 0];
  __m512 acc[16];
  for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    __m512 kv[16];
    for (int j = 0; j < KB; j++) kv[j] = ld16(dtype, kj[j] + d * es);
    for (int i = 0; i < NI; i++) {
      __m512 qv = _mm512_loadu_ps(q + (i < ni ? i : 0) * D + d);
      for (int j = 0; j < KB; j++) acc[i * KB + j] = _mm512_fmadd_ps(qv, kv[j], acc[i * KB + j]);
    }
  }
  float r[16];
  _mm512_storeu_ps(r, hsum16x16(acc));
  for (int64_t i = 0; i < ni; i++)
    for (int64_t j = 0; j < KB && j < nk; j++) {
      float x = r[i * KB + j];
      for (int64_t dd = d; dd < D; dd++) x += q[i * D + dd] * kiln_hal_load_f32(kj[j], dtype, dd);
      s[i * lds + j] = x;
    }
}

AVX512_INLINE void qk_tile_avx512_dt(int32_t dtype, const float *q, int64_t nq, int64_t D,
                                     const void *const *k, int64_t nk, float *s, int64_t lds,
                                     const void *const *pf) {
  int64_t rb = D * (int64_t)kiln_hal_dtype_size(dtype);
  for (int64_t i0 = 0; i0 < nq; i0 += 4) {
    int64_t ni = nq - i0 < 4 ? nq - i0 : 4;
    const float *qi = q + i0 * D;
    float *si = s + i0 * lds;
    if (ni >= 3)
      for (int64_t j = 0; j < nk; j += 4) {
        if (pf && i0 == 0) prefetch_rows(pf, j, j + 4 < nk ? j + 4 : nk, rb);
        qk_block_avx512(dtype, 4, 4, qi, ni, D, k + j, nk - j, si + j, lds);
      }
    else if (ni == 2)
      for (int64_t j = 0; j < nk; j += 8) {
        if (pf && i0 == 0) prefetch_rows(pf, j, j + 8 < nk ? j + 8 : nk, rb);
        qk_block_avx512(dtype, 2, 8, qi, 2, D, k + j, nk - j, si + j, lds);
      }
    else
      for (int64_t j = 0; j < nk; j += 16) {
        if (pf && i0 == 0) prefetch_rows(pf, j, j + 16 < nk ? j + 16 : nk, rb);
        qk_block_avx512(dtype, 1, 16, qi, 1, D, k + j, nk - j, si + j, lds);
      }
  }
}

/* The dtype as a constant: no per-load dtype test in the inner loops. */
AVX512 static void qk_tile_avx512(int32_t dtype, const float *q, int64_t nq, int64_t D,
                                  const void *const *k, int64_t nk, float *s, int64_t lds,
                                  const void *const *pf) {
  if (dtype == KILN_HAL_BF16)
    qk_tile_avx512_dt(KILN_HAL_BF16, q, nq, D, k, nk, s, lds, pf);
  else if (dtype == KILN_HAL_F16)
    qk_tile_avx512_dt(KILN_HAL_F16, q, nq, D, k, nk, s, lds, pf);
  else
    qk_tile_avx512_dt(KILN_HAL_F32, q, nq, D, k, nk, s, lds, pf);
}

AVX512_INLINE void pv_block_avx512(int32_t dtype, int NI, int C, const void *const *pf,
                                   const float *w, int64_t ldw, const void *const *v, int64_t nk,
                                   int64_t D, int64_t d0, const float *corr, float *acc) {
  size_t es = kiln_hal_dtype_size(dtype);
  __m512 a[4][8];
  for (int i = 0; i < NI; i++) {
    __m512 ci = _mm512_set1_ps(corr[i]);
    for (int c = 0; c < C; c++)
      a[i][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + i * D + d0 + 16 * c), ci);
  }
  for (int64_t j = 0; j < nk; j++) {
    if (pf) prefetch_rows(pf, j, j + 1, D * (int64_t)es);
    const char *vj = (const char *)v[j] + d0 * es;
    __m512 vv[8];
    for (int c = 0; c < C; c++) vv[c] = ld16(dtype, vj + 16 * c * es);
    for (int i = 0; i < NI; i++) {
      __m512 wv = _mm512_set1_ps(w[i * ldw + j]);
      for (int c = 0; c < C; c++) a[i][c] = _mm512_fmadd_ps(wv, vv[c], a[i][c]);
    }
  }
  for (int i = 0; i < NI; i++)
    for (int c = 0; c < C; c++) _mm512_storeu_ps(acc + i * D + d0 + 16 * c, a[i][c]);
}

AVX512_INLINE void pv_rows_avx512(int32_t dtype, int NI, int C, const float *w, int64_t ldw,
                                  const void *const *v, int64_t nk, int64_t D, const float *corr,
                                  float *acc, const void *const *pf) {
  int64_t d = 0;
  for (; d + 16 * C <= D; d += 16 * C)
    pv_block_avx512(dtype, NI, C, d == 0 ? pf : NULL, w, ldw, v, nk, D, d, corr, acc);
  for (; d + 16 <= D; d += 16)
    pv_block_avx512(dtype, NI, 1, d == 0 ? pf : NULL, w, ldw, v, nk, D, d, corr, acc);
  for (int i = 0; i < NI && d < D; i++) {
    float *o = acc + i * D;
    for (int64_t dd = d; dd < D; dd++) o[dd] *= corr[i];
    for (int64_t j = 0; j < nk; j++)
      for (int64_t dd = d; dd < D; dd++)
        o[dd] += w[i * ldw + j] * kiln_hal_load_f32(v[j], dtype, dd);
  }
}

AVX512_INLINE void pv_tile_avx512_dt(int32_t dtype, const float *w, int64_t ldw, int64_t nq,
                                     const void *const *v, int64_t nk, int64_t D, const float *corr,
                                     float *acc, const void *const *pf) {
  for (int64_t i0 = 0; i0 < nq; i0 += 4) {
    const float *wi = w + i0 * ldw, *ci = corr + i0;
    float *ai = acc + i0 * D;
    switch (nq - i0 < 4 ? nq - i0 : 4) {
      case 1: pv_rows_avx512(dtype, 1, 8, wi, ldw, v, nk, D, ci, ai, i0 == 0 ? pf : NULL); break;
      case 2: pv_rows_avx512(dtype, 2, 8, wi, ldw, v, nk, D, ci, ai, i0 == 0 ? pf : NULL); break;
      case 3: pv_rows_avx512(dtype, 3, 4, wi, ldw, v, nk, D, ci, ai, i0 == 0 ? pf : NULL); break;
      default: pv_rows_avx512(dtype, 4, 4, wi, ldw, v, nk, D, ci, ai, i0 == 0 ? pf : NULL); break;
    }
  }
}

/* The dtype as a constant: no per-load dtype test in the inner loops. */
AVX512 static void pv_tile_avx512(int32_t dtype, const float *w, int64_t ldw, int64_t nq,
                                  const void *const *v, int64_t nk, int64_t D, const float *corr,
                                  float *acc, const void *const *pf) {
  if (dtype == KILN_HAL_BF16)
    pv_tile_avx512_dt(KILN_HAL_BF16, w, ldw, nq, v, nk, D, corr, acc, pf);
  else if (dtype == KILN_HAL_F16)
    pv_tile_avx512_dt(KILN_HAL_F16, w, ldw, nq, v, nk, D, corr, acc, pf);
  else
    pv_tile_avx512_dt(KILN_HAL_F32, w, ldw, nq, v, nk, D, corr, acc, pf);
}
#endif /* CPU_HAVE_X86 */

/* ============================================================================================
 * Dispatch
 * ==========================================================================================*/

#if CPU_HAVE_X86
/* F16C from CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports does not know "f16c". */
static bool cpu_has_f16c(void) {
  unsigned a, b, c, d;
  return __get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 29));
}
#endif

void cpu_vec_init(void) {
#if CPU_HAVE_X86
  __builtin_cpu_init();
  bool f16c = cpu_has_f16c(), avx512f = __builtin_cpu_supports("avx512f");
  g_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
  g_avx512 = g_avx2 && avx512f;
  /* KILN_CPU_VEC=avx2 or =scalar caps the kernels, so tests can cover the narrower paths on a
   * wider CPU. */
  const char *cap = getenv("KILN_CPU_VEC");
  if (cap && (!strcmp(cap, "avx2") || !strcmp(cap, "scalar"))) g_avx512 = false;
  if (cap && !strcmp(cap, "scalar")) g_avx2 = false;
  g_features[0] = '\0';
  static const char *const names[] = {"sse4.2", "avx", "avx2", "fma", "f16c", "avx512f"};
  bool have[6] = {__builtin_cpu_supports("sse4.2"), __builtin_cpu_supports("avx"),
                  __builtin_cpu_supports("avx2"), __builtin_cpu_supports("fma"),
                  f16c, avx512f};
  if (cap)
    for (int i = 1; i < 6; i++) have[i] = have[i] && (i < 5 ? g_avx2 : g_avx512);
  size_t len = 0;
  for (int i = 0; i < 6; i++)
    if (have[i]) {
      size_t nl = strlen(names[i]);
      if (len + nl + 2 > sizeof(g_features)) break;
      if (len) g_features[len++] = ' ';
      memcpy(g_features + len, names[i], nl + 1);
      len += nl;
    }
  if (len == 0) strcpy(g_features, "baseline");
#endif
}

const char *cpu_vec_features(void) { return g_features; }

bool cpu_vec_avx2(void) { return g_avx2; }

void cpu_vec_to_f32(int32_t dtype, const void *src, float *dst, int64_t n) {
  if (dtype == KILN_HAL_F32) {
    if ((const void *)dst != src) memmove(dst, src, (size_t)n * sizeof(float));
    return;
  }
#if CPU_HAVE_X86
  if (g_avx2) {
    to_f32_avx2(dtype, src, dst, n);
    return;
  }
#endif
  to_f32_scalar(dtype, src, dst, n);
}

void cpu_vec_from_f32(int32_t dtype, const float *src, void *dst, int64_t n) {
  if (dtype == KILN_HAL_F32) {
    if ((void *)src != dst) memmove(dst, src, (size_t)n * sizeof(float));
    return;
  }
#if CPU_HAVE_X86
  if (g_avx2) {
    from_f32_avx2(dtype, src, dst, n);
    return;
  }
#endif
  from_f32_scalar(dtype, src, dst, n);
}

void cpu_vec_round(int32_t dtype, float *x, int64_t n) {
  if (dtype == KILN_HAL_F32) return;
  uint16_t tmp[256];
  for (int64_t i = 0; i < n; i += 256) {
    int64_t c = n - i < 256 ? n - i : 256;
    cpu_vec_from_f32(dtype, x + i, tmp, c);
    cpu_vec_to_f32(dtype, tmp, x + i, c);
  }
}

float cpu_vec_dot(int32_t dtype, const float *a, const void *b, int64_t n) {
#if CPU_HAVE_X86
  if (g_avx2) return dot_avx2(dtype, a, b, n);
#endif
  return dot_scalar(dtype, a, b, n);
}

void cpu_vec_axpy(int32_t dtype, float alpha, const void *x, float *y, int64_t n) {
#if CPU_HAVE_X86
  if (g_avx2) {
    axpy_avx2(dtype, alpha, x, y, n);
    return;
  }
#endif
  axpy_scalar(dtype, alpha, x, y, n);
}

float cpu_vec_exp_sum(float *x, int64_t n, float m) {
#if CPU_HAVE_X86
  if (g_avx2) return exp_sum_avx2(x, n, m);
#endif
  return exp_sum_scalar(x, n, m);
}

void cpu_vec_act_mul(int32_t act, float *g, const float *u, int64_t n) {
#if CPU_HAVE_X86
  if (g_avx2) {
    act_mul_avx2(act, g, u, n);
    return;
  }
#endif
  for (int64_t i = 0; i < n; i++) g[i] = act_scalar(act, g[i]) * u[i];
}

void cpu_vec_act(int32_t act, float *x, int64_t n) {
#if CPU_HAVE_X86
  if (g_avx2) {
    act_avx2(act, x, n);
    return;
  }
#endif
  for (int64_t i = 0; i < n; i++) x[i] = act_scalar(act, x[i]);
}

void cpu_vec_qk_tile(int32_t dtype, const float *q, int64_t nq, int64_t D, const void *const *k,
                     int64_t nk, float *s, int64_t lds, const void *const *pf) {
#if CPU_HAVE_X86
  if (g_avx512) {
    qk_tile_avx512(dtype, q, nq, D, k, nk, s, lds, pf);
    return;
  }
  if (g_avx2) {
    qk_tile_avx2(dtype, q, nq, D, k, nk, s, lds, pf);
    return;
  }
#endif
  qk_tile_scalar(dtype, q, nq, D, k, nk, s, lds, pf);
}

void cpu_vec_pv_tile(int32_t dtype, const float *w, int64_t ldw, int64_t nq, const void *const *v,
                     int64_t nk, int64_t D, const float *corr, float *acc, const void *const *pf) {
#if CPU_HAVE_X86
  if (g_avx512) {
    pv_tile_avx512(dtype, w, ldw, nq, v, nk, D, corr, acc, pf);
    return;
  }
  if (g_avx2) {
    pv_tile_avx2(dtype, w, ldw, nq, v, nk, D, corr, acc, pf);
    return;
  }
#endif
  pv_tile_scalar(dtype, w, ldw, nq, v, nk, D, corr, acc, pf);
}

float cpu_vec_max(const float *x, int64_t n) {
#if CPU_HAVE_X86
  if (g_avx2) return max_avx2(x, n);
#endif
  return max_scalar(x, n);
}

void cpu_vec_gemm_colb(int32_t dtype, int64_t M, int64_t K, const float *a, const void *b,
                       int64_t ldb, int64_t n0, int64_t n1, float *out, int64_t ldo) {
#if CPU_HAVE_X86
  if (g_avx2) {
    gemm_colb_avx2(dtype, M, K, a, b, ldb, n0, n1, out, ldo);
    return;
  }
#endif
  gemm_colb_scalar(dtype, M, K, a, b, ldb, n0, n1, out, ldo);
}

void cpu_vec_gemm_rowb(int32_t dtype, int64_t M, int64_t K, const float *a, const void *b,
                       int64_t ldb, int64_t n0, int64_t n1, float *out, int64_t ldo) {
#if CPU_HAVE_X86
  if (g_avx2) {
    gemm_rowb_avx2(dtype, M, K, a, b, ldb, n0, n1, out, ldo);
    return;
  }
#endif
  gemm_rowb_scalar(dtype, M, K, a, b, ldb, n0, n1, out, ldo);
}
