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

#include "models/vision/image.h"

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

/* out: [rows, out_w, 3] from in rows row0..row0+rows-1 of [*, in_w, 3]. */
static void pass_horizontal(const uint8_t *in, int in_w, int row0, int rows, uint8_t *out,
                            int out_w, const coeffs_t *c) {
  for (int y = 0; y < rows; y++) {
    const uint8_t *src = in + (size_t)(row0 + y) * in_w * 3;
    uint8_t *dst = out + (size_t)y * out_w * 3;
    for (int x = 0; x < out_w; x++) {
      const int32_t *k = c->k + (size_t)x * c->ksize;
      int first = c->bounds[2 * x], n = c->bounds[2 * x + 1];
      int32_t s0 = 1 << (PRECISION_BITS - 1), s1 = s0, s2 = s0; /* see pass_vertical */
      const uint8_t *p = src + (size_t)first * 3;
      for (int j = 0; j < n; j++, p += 3) {
        s0 += (int32_t)p[0] * k[j];
        s1 += (int32_t)p[1] * k[j];
        s2 += (int32_t)p[2] * k[j];
      }
      dst[3 * x] = clip8(s0);
      dst[3 * x + 1] = clip8(s1);
      dst[3 * x + 2] = clip8(s2);
    }
  }
}

/* out: [out_h, w, 3]; the taps of row y are in rows bounds[2y] - row0 ... of in. A whole row
 * is accumulated tap by tap (contiguous, vectorizable) in acc ([w * 3]). 32-bit sums, as in
 * Pillow, cannot overflow: |sum| <= 255 * sum(|k|) * 2^22 + 2^21, and sum(|k|) stays below
 * 1.5 (1.25 for a tap centred between two pixels; a little more where the border cuts taps
 * and the rest are renormalised), so |sum| < 1.7e9 < 2^31. */
static void pass_vertical(const uint8_t *in, int w, int row0, uint8_t *out, int out_h,
                          const coeffs_t *c, int32_t *acc) {
  const size_t stride = (size_t)w * 3;
  for (int y = 0; y < out_h; y++) {
    const int32_t *k = c->k + (size_t)y * c->ksize;
    int first = c->bounds[2 * y] - row0, n = c->bounds[2 * y + 1];
    for (size_t i = 0; i < stride; i++) acc[i] = 1 << (PRECISION_BITS - 1);
    for (int j = 0; j < n; j++) {
      const uint8_t *src = in + (size_t)(first + j) * stride;
      const int32_t kj = k[j];
      for (size_t i = 0; i < stride; i++) acc[i] += (int32_t)src[i] * kj;
    }
    uint8_t *dst = out + (size_t)y * stride;
    for (size_t i = 0; i < stride; i++) dst[i] = clip8(acc[i]);
  }
}

kiln_status_t kiln_image_resize_bicubic(const kiln_image_t *in, int32_t width, int32_t height,
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
  uint8_t *tmp = NULL, *dst = NULL;
  int32_t *acc = NULL;
  const bool need_h = width != in->width, need_v = height != in->height;
  if (!coeffs_make(in->height, height, &cv) || (need_h && !coeffs_make(in->width, width, &ch)))
    goto oom;
  dst = malloc((size_t)width * height * 3);
  acc = malloc(sizeof *acc * (size_t)width * 3);
  if (!dst || !acc) goto oom;
  if (!need_h && !need_v) {
    memcpy(dst, in->rgb, (size_t)width * height * 3);
  } else if (!need_v) {
    pass_horizontal(in->rgb, in->width, 0, in->height, dst, width, &ch);
  } else if (!need_h) {
    pass_vertical(in->rgb, width, 0, dst, height, &cv, acc);
  } else {
    /* Only the source rows the vertical pass reads: bounds[0] .. bounds[last] + n[last]. */
    int row0 = cv.bounds[0];
    int row1 = cv.bounds[2 * (height - 1)] + cv.bounds[2 * (height - 1) + 1];
    tmp = malloc((size_t)width * (size_t)(row1 - row0) * 3);
    if (!tmp) goto oom;
    pass_horizontal(in->rgb, in->width, row0, row1 - row0, tmp, width, &ch);
    pass_vertical(tmp, width, row0, dst, height, &cv, acc);
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
  free(dst);
  free(tmp);
  free(acc);
  coeffs_free(&ch);
  coeffs_free(&cv);
  return st;
}
