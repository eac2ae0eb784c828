/* cpu_vec.c - the CPU backend's inner loops: dtype conversion, dot/axpy, exp, small-M GEMM.
 *
 * Each kernel has a portable scalar version and, on x86-64, an AVX2/FMA/F16C version compiled
 * with a target attribute (the plugin itself is built for baseline x86-64, so it still loads
 * on any CPU); cpu_vec_init() picks one at run time with __builtin_cpu_supports. */
#include <math.h>
#include <string.h>

#include "cpu_internal.h"

#if defined(__x86_64__) && defined(__GNUC__)
#define CPU_HAVE_X86 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define CPU_HAVE_X86 0
#endif

static bool g_avx2; /* AVX2 + FMA + F16C kernels selected */
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
    default: return x / (1.0f + expf(-x));
  }
}

static void dot4_scalar(int32_t dtype, const float *q, int64_t qs, int64_t nq, const void *k,
                        int64_t n, float *out, int64_t os) {
  for (int64_t i = 0; i < nq; i++) out[i * os] = dot_scalar(dtype, q + i * qs, k, n);
}

static void gemv_acc_scalar(const float *w, int64_t nw, const float *v, int64_t ldv, int64_t n,
                            float *acc) {
  for (int64_t j = 0; j < nw; j++)
    for (int64_t d = 0; d < n; d++) acc[d] += w[j] * v[j * ldv + d];
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

AVX2 static void act_mul_avx2(int32_t act, float *g, const float *u, int64_t n) {
  int64_t i = 0;
  if (act == KILN_HAL_ACT_SILU) {
    __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      __m256 x = _mm256_loadu_ps(g + i);
      /* sigmoid via exp(-|x|) keeps exp8's argument <= 0 (its accurate range). */
      __m256 ax = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
      __m256 e = exp8(_mm256_sub_ps(zero, ax));
      __m256 inv = _mm256_div_ps(one, _mm256_add_ps(one, e));
      __m256 sig = _mm256_blendv_ps(_mm256_mul_ps(e, inv), inv, _mm256_cmp_ps(x, zero, _CMP_GE_OQ));
      _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
    }
  }
  for (; i < n; i++) g[i] = act_scalar(act, g[i]) * u[i];
}

/* out[i*os] = dot(q + i*qs, k) for i < nq <= 4: each k vector is converted once for all. */
AVX2 static void dot4_avx2(int32_t dtype, const float *q, int64_t qs, int64_t nq, const void *k,
                           int64_t n, float *out, int64_t os) {
  size_t es = kiln_hal_dtype_size(dtype);
  const char *kb = k;
  const float *q0 = q, *q1 = q + (nq > 1 ? qs : 0), *q2 = q + (nq > 2 ? 2 * qs : 0);
  const float *q3 = q + (nq > 3 ? 3 * qs : 0);
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  __m256 s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 kv = ld8(dtype, kb + i * es);
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + i), kv, s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + i), kv, s1);
    s2 = _mm256_fmadd_ps(_mm256_loadu_ps(q2 + i), kv, s2);
    s3 = _mm256_fmadd_ps(_mm256_loadu_ps(q3 + i), kv, s3);
  }
  float r[4] = {hsum8(s0), hsum8(s1), hsum8(s2), hsum8(s3)};
  const float *qq[4] = {q0, q1, q2, q3};
  for (; i < n; i++) {
    float kv = kiln_hal_load_f32(k, dtype, i);
    for (int j = 0; j < 4; j++) r[j] += qq[j][i] * kv;
  }
  for (int64_t j = 0; j < nq; j++) out[j * os] = r[j];
}

/* acc[d] += sum_j w[j] * v[j*ldv + d]: 32 columns of acc stay in registers over all j. */
AVX2 static void gemv_acc_avx2(const float *w, int64_t nw, const float *v, int64_t ldv, int64_t n,
                               float *acc) {
  int64_t d = 0;
  for (; d + 32 <= n; d += 32) {
    __m256 a0 = _mm256_loadu_ps(acc + d), a1 = _mm256_loadu_ps(acc + d + 8);
    __m256 a2 = _mm256_loadu_ps(acc + d + 16), a3 = _mm256_loadu_ps(acc + d + 24);
    for (int64_t j = 0; j < nw; j++) {
      __m256 wj = _mm256_set1_ps(w[j]);
      const float *vj = v + j * ldv + d;
      a0 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(vj), a0);
      a1 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(vj + 8), a1);
      a2 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(vj + 16), a2);
      a3 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(vj + 24), a3);
    }
    _mm256_storeu_ps(acc + d, a0);
    _mm256_storeu_ps(acc + d + 8, a1);
    _mm256_storeu_ps(acc + d + 16, a2);
    _mm256_storeu_ps(acc + d + 24, a3);
  }
  for (; d + 8 <= n; d += 8) {
    __m256 a0 = _mm256_loadu_ps(acc + d);
    for (int64_t j = 0; j < nw; j++)
      a0 = _mm256_fmadd_ps(_mm256_set1_ps(w[j]), _mm256_loadu_ps(v + j * ldv + d), a0);
    _mm256_storeu_ps(acc + d, a0);
  }
  if (d < n) gemv_acc_scalar(w, nw, v + d, ldv, n - d, acc + d);
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
  bool f16c = cpu_has_f16c();
  g_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
  g_features[0] = '\0';
  static const char *const names[] = {"sse4.2", "avx", "avx2", "fma", "f16c", "avx512f"};
  bool have[6] = {__builtin_cpu_supports("sse4.2"), __builtin_cpu_supports("avx"),
                  __builtin_cpu_supports("avx2"), __builtin_cpu_supports("fma"),
                  f16c, __builtin_cpu_supports("avx512f")};
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

void cpu_vec_dot4(int32_t dtype, const float *q, int64_t qs, int64_t nq, const void *k, int64_t n,
                  float *out, int64_t os) {
#if CPU_HAVE_X86
  if (g_avx2) {
    dot4_avx2(dtype, q, qs, nq, k, n, out, os);
    return;
  }
#endif
  dot4_scalar(dtype, q, qs, nq, k, n, out, os);
}

void cpu_vec_gemv_acc(const float *w, int64_t nw, const float *v, int64_t ldv, int64_t n,
                      float *acc) {
#if CPU_HAVE_X86
  if (g_avx2) {
    gemv_acc_avx2(w, nw, v, ldv, n, acc);
    return;
  }
#endif
  gemv_acc_scalar(w, nw, v, ldv, n, acc);
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
