/* resample.c - Pillow's BICUBIC resize of 8-bit RGB, reproduced to the bit.
 *
 * The algorithm, as Pillow implements it (libImaging/Resample.c; written here from that
 * description, not copied):
 *
 *  1. Separable, two passes: horizontal first (into a temporary image holding only the source
 *     rows the vertical pass will read), then vertical. A pass whose size does not change is
 *     skipped (for an interpolating filter at scale 1 it is the identity anyway).
 *  2. Per pass, for output index i of out_size over in_size input samples:
 *       scale = in_size / out_size (the box width in float, then divided in double);
 *       filterscale = max(scale, 1): downscaling widens the filter (antialiasing);
 *       support = 2 * filterscale (bicubic's support is 2);
 *       ksize = ceil(support) * 2 + 1 coefficient slots;
 *       center = (i + 0.5) * scale;
 *       first = (int)(center - support + 0.5) clamped at 0, last = (int)(center + support + 0.5)
 *       clamped at in_size; taps first..last-1;
 *       w_j = K((j - center + 0.5) / filterscale) with the Keys cubic, a = -0.5:
 *         K(x) = ((a + 2)|x| - (a + 3)) x^2 + 1 for |x| < 1, (((|x| - 5)|x| + 8)|x| - 4) a for
 *         |x| < 2, else 0 (evaluated in exactly this form: the rounding below depends on it);
 *       the weights are divided by their sum, then made fixed point with 22 fraction bits
 *       (PRECISION_BITS = 32 - 8 - 2), rounding half away from zero: (int)(w * 2^22 +- 0.5).
 *  3. Each output sample = clip8((2^21 + sum_j in_j * k_j) >> 22), clip8 saturating to 0..255;
 *     the intermediate image is stored as uint8 after the first pass.
 *
 * This file is compiled with -ffp-contract=off (CMake): a fused multiply-add would round
 * differently from Pillow's separate multiply and add.
 */
#include <limits.h>
#include <stdbool.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "models/vision/image.h"
#include "models/vision/image_internal.h"

#define PRECISION_BITS (32 - 8 - 2)

typedef struct coeffs {
  int ksize;
  int32_t *bounds; /* [out_size][2]: first tap, number of taps */
  int32_t *k;      /* [out_size][ksize], fixed point */
} coeffs_t;

static double bicubic(double x) {
  const double a = -0.5;
  if (x < 0.0) x = -x;
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
  if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
  return 0.0;
}

static void coeffs_free(coeffs_t *c) {
  free(c->bounds);
  free(c->k);
  memset(c, 0, sizeof *c);
}

/* Returns false on OOM. */
static bool coeffs_make(int in_size, int out_size, coeffs_t *c) {
  memset(c, 0, sizeof *c);
  const float box0 = 0.0f, box1 = (float)in_size;
  double scale = (double)(box1 - box0) / out_size;
  double filterscale = scale < 1.0 ? 1.0 : scale;
  double support = 2.0 * filterscale;
  int ksize = (int)ceil(support) * 2 + 1;
  double *w = malloc(sizeof *w * (size_t)ksize);
  c->bounds = malloc(sizeof *c->bounds * 2 * (size_t)out_size);
  c->k = malloc(sizeof *c->k * (size_t)ksize * (size_t)out_size);
  if (!w || !c->bounds || !c->k) {
    free(w);
    coeffs_free(c);
    return false;
  }
  c->ksize = ksize;
  const double inv_filterscale = 1.0 / filterscale;
  for (int i = 0; i < out_size; i++) {
    double center = box0 + (i + 0.5) * scale;
    int first = (int)(center - support + 0.5);
    if (first < 0) first = 0;
    int last = (int)(center + support + 0.5);
    if (last > in_size) last = in_size;
    int n = last - first;
    double sum = 0.0;
    for (int j = 0; j < n; j++) {
      double v = bicubic((j + first - center + 0.5) * inv_filterscale);
      w[j] = v;
      sum += v;
    }
    if (sum != 0.0)
      for (int j = 0; j < n; j++) w[j] /= sum;
    int32_t *k = c->k + (size_t)i * ksize;
    for (int j = 0; j < ksize; j++) {
      double v = j < n ? w[j] : 0.0;
      k[j] = v < 0 ? (int32_t)(-0.5 + v * (1 << PRECISION_BITS))
                   : (int32_t)(0.5 + v * (1 << PRECISION_BITS));
    }
    c->bounds[2 * i] = first;
    c->bounds[2 * i + 1] = n;
  }
  free(w);
  return true;
}

static inline uint8_t clip8(int32_t ss) {
  if (ss < 0) return 0;
  ss >>= PRECISION_BITS;
  return (uint8_t)(ss > 255 ? 255 : ss);
}

/* ---- the kernels ------------------------------------------------------------------------------
 *
 * Both passes come down to one kernel: LANES independent sums, each 2^21 + sum_j s_j[l] * k_j
 * over n taps whose samples lie `step` bytes apart, clipped to a byte. The vertical pass runs
 * it along each output row (the taps are whole source rows); the horizontal pass runs it on a
 * strip of STRIP rows transposed to [x][row][channel] (the taps of an output column are then
 * LANES consecutive bytes, SX apart), and transposes the result back. It is the same integer
 * arithmetic as Pillow's (32-bit products and sums, the same rounding and clipping), only in
 * another order, so the bytes are Pillow's. 32-bit sums cannot overflow: |sum| <= 255 *
 * sum(|k|) * 2^22 + 2^21, and sum(|k|) stays below 1.5 (1.25 for a tap centred between two
 * pixels; a little more where the border cuts taps and the rest are renormalised), so |sum| <
 * 1.7e9 < 2^31.
 *
 * The kernel is written twice: portable C that compilers vectorise (NEON has a 32-bit vector
 * multiply; baseline x86-64's SSE2 does not, so there it is slower than the old scalar loops)
 * and AVX2 intrinsics, picked at run time on x86-64; KILN_CPU_VEC=scalar keeps the portable
 * one (the tests run both). */

#define STRIP 16          /* rows per horizontal strip */
#define LANES (STRIP * 3) /* sums per kernel call: one strip column; a chunk of a row */
#define SX (LANES + 4)    /* bytes per column in the strip buffers: room for a 4-byte copy */
#define INLINE static inline __attribute__((always_inline))

INLINE void conv_c(const uint8_t *s, size_t step, const int32_t *k, int n, uint8_t *out) {
  int32_t acc[LANES];
  for (int l = 0; l < LANES; l++) acc[l] = 1 << (PRECISION_BITS - 1);
  for (int j = 0; j < n; j++, s += step) {
    const int32_t kj = k[j];
    for (int l = 0; l < LANES; l++) acc[l] += (int32_t)s[l] * kj;
  }
  for (int l = 0; l < LANES; l++) out[l] = clip8(acc[l]);
}

/* m < LANES sums (a row's tail). */
static void conv_tail(const uint8_t *s, size_t step, const int32_t *k, int n, uint8_t *out,
                      size_t m) {
  for (size_t l = 0; l < m; l++) {
    int32_t acc = 1 << (PRECISION_BITS - 1);
    for (int j = 0; j < n; j++) acc += (int32_t)s[(size_t)j * step + l] * k[j];
    out[l] = clip8(acc);
  }
}

/* The strip transposes, 4 bytes at a time: each copy's fourth byte lands where the next copy
 * (the next row of the strip, or the pad at the end of a column; the next pixel of a row) puts
 * its own, so only a row's last pixel is copied as 3 bytes (it may end the buffer). */
static void strip_gather(const uint8_t *src, int w, uint8_t *d) {
  for (int x = 0; x < w - 1; x++, src += 3, d += SX) memcpy(d, src, 4);
  memcpy(d, src, 3);
}

static void strip_scatter(const uint8_t *o, int w, uint8_t *dst) {
  for (int x = 0; x < w - 1; x++, dst += 3, o += SX) memcpy(dst, o, 4);
  memcpy(dst, o, 3);
}

typedef void (*conv_fn)(const uint8_t *s, size_t step, const int32_t *k, int n, uint8_t *out);

/* Output rows y0..y1-1 of [out_h, w, 3] from in, whose first row is source row row0. */
INLINE void vertical_body(conv_fn conv, const uint8_t *in, int w, int row0, uint8_t *out, int y0,
                          int y1, const coeffs_t *c) {
  const size_t stride = (size_t)w * 3, full = stride / LANES * LANES;
  for (int y = y0; y < y1; y++) {
    const int32_t *k = c->k + (size_t)y * c->ksize;
    const int n = c->bounds[2 * y + 1];
    const uint8_t *src = in + (size_t)(c->bounds[2 * y] - row0) * stride;
    uint8_t *dst = out + (size_t)y * stride;
    for (size_t i = 0; i < full; i += LANES) conv(src + i, stride, k, n, dst + i);
    if (full < stride) conv_tail(src + full, stride, k, n, dst + full, stride - full);
  }
}

/* Output rows r0..r1-1 of out [*, out_w, 3] from source rows row0 + r of in [*, in_w, 3], a
 * strip at a time through the transposed buffers st ([in_w][SX]) and ot ([out_w][SX]), both
 * zeroed when allocated. */
INLINE void horizontal_body(conv_fn conv, const uint8_t *in, int in_w, int row0, int r0, int r1,
                            uint8_t *out, int out_w, const coeffs_t *c, uint8_t *st, uint8_t *ot) {
  const size_t in_stride = (size_t)in_w * 3, out_stride = (size_t)out_w * 3;
  for (int s0 = r0; s0 < r1; s0 += STRIP) {
    const int rows = r1 - s0 < STRIP ? r1 - s0 : STRIP;
    for (int r = 0; r < rows; r++)
      strip_gather(in + (size_t)(row0 + s0 + r) * in_stride, in_w, st + r * 3);
    if (rows < STRIP) /* the missing rows' sums are computed and dropped: keep them defined */
      for (int x = 0; x < in_w; x++)
        memset(st + (size_t)x * SX + rows * 3, 0, (size_t)(SX - rows * 3));
    for (int x = 0; x < out_w; x++)
      conv(st + (size_t)c->bounds[2 * x] * SX, SX, c->k + (size_t)x * c->ksize,
           c->bounds[2 * x + 1], ot + (size_t)x * SX);
    for (int r = 0; r < rows; r++)
      strip_scatter(ot + r * 3, out_w, out + (size_t)(s0 + r) * out_stride);
  }
}

static void vertical_base(const uint8_t *in, int w, int row0, uint8_t *out, int y0, int y1,
                          const coeffs_t *c) {
  vertical_body(conv_c, in, w, row0, out, y0, y1, c);
}

static void horizontal_base(const uint8_t *in, int in_w, int row0, int r0, int r1, uint8_t *out,
                            int out_w, const coeffs_t *c, uint8_t *st, uint8_t *ot) {
  horizontal_body(conv_c, in, in_w, row0, r0, r1, out, out_w, c, st, ot);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define HAVE_AVX2_KERNELS 1
#define AVX2 __attribute__((target("avx2")))

/* conv_c with intrinsics: six vectors of eight 32-bit sums. */
AVX2 INLINE void conv_avx2(const uint8_t *s, size_t step, const int32_t *k, int n, uint8_t *out) {
  const __m256i half = _mm256_set1_epi32(1 << (PRECISION_BITS - 1));
  __m256i a0 = half, a1 = half, a2 = half, a3 = half, a4 = half, a5 = half;
  for (int j = 0; j < n; j++, s += step) {
    const __m256i kj = _mm256_set1_epi32(k[j]);
    const __m128i b0 = _mm_loadu_si128((const __m128i *)s);
    const __m128i b1 = _mm_loadu_si128((const __m128i *)(s + 16));
    const __m128i b2 = _mm_loadu_si128((const __m128i *)(s + 32));
    a0 = _mm256_add_epi32(a0, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(b0), kj));
    a1 = _mm256_add_epi32(a1, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(b0, 8)), kj));
    a2 = _mm256_add_epi32(a2, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(b1), kj));
    a3 = _mm256_add_epi32(a3, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(b1, 8)), kj));
    a4 = _mm256_add_epi32(a4, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(b2), kj));
    a5 = _mm256_add_epi32(a5, _mm256_mullo_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(b2, 8)), kj));
  }
  /* clip8: a negative sum is 0, else sum >> 22 saturated at 255 (the packs saturate). */
  const __m256i zero = _mm256_setzero_si256();
#define CLIP(a) _mm256_srai_epi32(_mm256_max_epi32((a), zero), PRECISION_BITS)
#define PACK(x, y, dst)                                                                    \
  do {                                                                                     \
    __m256i w_ = _mm256_permute4x64_epi64(_mm256_packs_epi32(CLIP(x), CLIP(y)), 0xd8);     \
    _mm_storeu_si128((__m128i *)(dst), _mm_packus_epi16(_mm256_castsi256_si128(w_),        \
                                                        _mm256_extracti128_si256(w_, 1))); \
  } while (0)
  PACK(a0, a1, out);
  PACK(a2, a3, out + 16);
  PACK(a4, a5, out + 32);
#undef PACK
#undef CLIP
}

AVX2 static void vertical_avx2(const uint8_t *in, int w, int row0, uint8_t *out, int y0, int y1,
                               const coeffs_t *c) {
  vertical_body(conv_avx2, in, w, row0, out, y0, y1, c);
}

AVX2 static void horizontal_avx2(const uint8_t *in, int in_w, int row0, int r0, int r1,
                                 uint8_t *out, int out_w, const coeffs_t *c, uint8_t *st,
                                 uint8_t *ot) {
  horizontal_body(conv_avx2, in, in_w, row0, r0, r1, out, out_w, c, st, ot);
}

static bool use_avx2(void) {
  static int cached = -1; /* every thread computes the same value */
  int v = __atomic_load_n(&cached, __ATOMIC_RELAXED);
  if (v < 0) {
    __builtin_cpu_init();
    const char *cap = getenv("KILN_CPU_VEC");
    v = __builtin_cpu_supports("avx2") && !(cap && !strcmp(cap, "scalar"));
    __atomic_store_n(&cached, v, __ATOMIC_RELAXED);
  }
  return v;
}
#else
#define HAVE_AVX2_KERNELS 0
#endif

/* ---- the passes, split over threads -----------------------------------------------------------
 */

typedef struct resize_job {
  const uint8_t *in;
  int in_w, row0, rows; /* horizontal: source rows row0 .. row0 + rows - 1 */
  uint8_t *mid;         /* the horizontal result: rows x out_w (the output when !need_v) */
  const uint8_t *vin;   /* what the vertical pass reads: mid, or the source (first row row0) */
  int out_w, out_h;
  uint8_t *out;
  const coeffs_t *ch, *cv;
  uint8_t **st, **ot; /* per worker strip buffers */
  bool avx2;
} resize_job_t;

static void horizontal_task(void *ctx, int64_t begin, int64_t end, int worker) {
  const resize_job_t *j = ctx;
  /* begin/end count strips, so that no strip is split between workers */
  const int r0 = (int)begin * STRIP, r1 = (int)(end * STRIP < j->rows ? end * STRIP : j->rows);
#if HAVE_AVX2_KERNELS
  if (j->avx2) {
    horizontal_avx2(j->in, j->in_w, j->row0, r0, r1, j->mid, j->out_w, j->ch, j->st[worker],
                    j->ot[worker]);
    return;
  }
#endif
  horizontal_base(j->in, j->in_w, j->row0, r0, r1, j->mid, j->out_w, j->ch, j->st[worker],
                  j->ot[worker]);
}

static void vertical_task(void *ctx, int64_t begin, int64_t end, int worker) {
  const resize_job_t *j = ctx;
  (void)worker;
#if HAVE_AVX2_KERNELS
  if (j->avx2) {
    vertical_avx2(j->vin, j->out_w, j->row0, j->out, (int)begin, (int)end, j->cv);
    return;
  }
#endif
  vertical_base(j->vin, j->out_w, j->row0, j->out, (int)begin, (int)end, j->cv);
}

kiln_status_t kiln_image_resize_bicubic_threads(const kiln_image_t *in, int32_t width,
                                                int32_t height, int32_t threads,
                                                kiln_image_t *out) {
  memset(out, 0, sizeof *out);
  if (!in || !in->rgb || in->width < 1 || in->height < 1)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "resize: no input image");
  if (width < 1 || height < 1 || width > KILN_IMAGE_HARD_MAX_SIDE ||
      height > KILN_IMAGE_HARD_MAX_SIDE)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "resize: target size %d x %d is outside 1..%d per side", (int)width,
                            (int)height, KILN_IMAGE_HARD_MAX_SIDE);
  kiln_status_t st = NULL;
  coeffs_t ch = {0}, cv = {0};
  uint8_t *tmp = NULL, *dst = NULL, *bufs[2 * VIMG_MAX_THREADS] = {0};
  /* Pillow's ImagingResampleInner: an axis is resampled when its size changes (the box is
   * always the whole image here); both unchanged is a copy. */
  const bool need_h = width != in->width, need_v = height != in->height;
  if ((need_v && !coeffs_make(in->height, height, &cv)) ||
      (need_h && !coeffs_make(in->width, width, &ch)))
    goto oom;
  dst = malloc((size_t)width * height * 3);
  if (!dst) goto oom;
  resize_job_t job = {.in = in->rgb,
                      .in_w = in->width,
                      .out_w = width,
                      .out_h = height,
                      .out = dst,
                      .ch = &ch,
                      .cv = &cv,
                      .st = bufs,
                      .ot = bufs + VIMG_MAX_THREADS};
#if HAVE_AVX2_KERNELS
  job.avx2 = use_avx2();
#endif
  if (!need_h && !need_v) {
    memcpy(dst, in->rgb, (size_t)width * height * 3);
  } else {
    if (need_h) {
      /* Only the source rows the vertical pass reads: bounds[0] .. bounds[last] + n[last]. */
      job.row0 = need_v ? cv.bounds[0] : 0;
      job.rows = need_v ? cv.bounds[2 * (height - 1)] + cv.bounds[2 * (height - 1) + 1] - job.row0
                        : in->height;
      if (need_v) {
        tmp = malloc((size_t)width * (size_t)job.rows * 3);
        if (!tmp) goto oom;
      }
      job.mid = need_v ? tmp : dst;
      job.vin = tmp;
      const int64_t strips = (job.rows + STRIP - 1) / STRIP;
      const int nt = vimg_threads(threads, strips, (int64_t)job.rows * width / 65536);
      for (int t = 0; t < nt; t++) {
        bufs[t] = calloc((size_t)in->width, SX);
        bufs[VIMG_MAX_THREADS + t] = calloc((size_t)width, SX);
        if (!bufs[t] || !bufs[VIMG_MAX_THREADS + t]) goto oom;
      }
      vimg_parallel(nt, strips, horizontal_task, &job);
    } else {
      job.vin = in->rgb; /* the vertical pass reads the source rows themselves */
      job.row0 = 0;
    }
    if (need_v)
      vimg_parallel(vimg_threads(threads, height, (int64_t)height * width / 65536), height,
                    vertical_task, &job);
  }
  out->width = width;
  out->height = height;
  out->rgb = dst;
  dst = NULL;
  goto done;
oom:
  st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "resize: out of memory for %d x %d -> %d x %d",
                        (int)in->width, (int)in->height, (int)width, (int)height);
done:
  for (int t = 0; t < 2 * VIMG_MAX_THREADS; t++) free(bufs[t]);
  free(dst);
  free(tmp);
  coeffs_free(&ch);
  coeffs_free(&cv);
  return st;
}

kiln_status_t kiln_image_resize_bicubic(const kiln_image_t *in, int32_t width, int32_t height,
                                        kiln_image_t *out) {
  return kiln_image_resize_bicubic_threads(in, width, height, 1, out);
}
