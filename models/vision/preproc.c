/* preproc.c - the Qwen2-VL image processor's settings, smart_resize and patch flattening. */
#define _POSIX_C_SOURCE 200809L
#include "models/vision/preproc.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "models/vision/image_internal.h"

/* transformers' OPENAI_CLIP_MEAN / OPENAI_CLIP_STD, as the Python literals read. */
static const double kClipMean[3] = {0.48145466, 0.4578275, 0.40821073};
static const double kClipStd[3] = {0.26862954, 0.26130258, 0.27577711};

void kiln_vision_preproc_default(kiln_vision_preproc_t *out) {
  memset(out, 0, sizeof *out);
  out->min_pixels = 56 * 56;
  out->max_pixels = 28 * 28 * 1280;
  out->patch_size = 14;
  out->temporal_patch_size = 2;
  out->merge_size = 2;
  memcpy(out->image_mean, kClipMean, sizeof kClipMean);
  memcpy(out->image_std, kClipStd, sizeof kClipStd);
  out->rescale_factor = 1.0 / 255.0;
  out->resample = 3;
  out->do_resize = out->do_rescale = out->do_normalize = out->do_convert_rgb = true;
}

/* ---- reading the settings ------------------------------------------------------------------ */

/* A member that is present and not null (transformers reads None as "the default"). */
static const kiln_json_t *member(const kiln_json_t *obj, const char *key) {
  const kiln_json_t *v = kiln_json_get(obj, key);
  return (v && kiln_json_type(v) != KILN_JSON_NULL) ? v : NULL;
}

static kiln_status_t bad(const char *name, const char *key, const char *want,
                         const kiln_json_t *v) {
  int line = 0, col = 0;
  kiln_json_position(v, &line, &col);
  return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s:%d:%d: %s: want %s, got a %s", name, line,
                          col, key, want, kiln_json_type_name(kiln_json_type(v)));
}

static kiln_status_t get_int(const kiln_json_t *obj, const char *key, const char *name, int64_t lo,
                             int64_t hi, int64_t *out, bool *found) {
  const kiln_json_t *v = member(obj, key);
  if (found) *found = v != NULL;
  if (!v) return NULL;
  int64_t x;
  if (!kiln_json_int64(v, &x)) return bad(name, key, "an integer", v);
  if (x < lo || x > hi)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: %s = %lld is outside %lld..%lld", name,
                            key, (long long)x, (long long)lo, (long long)hi);
  *out = x;
  return NULL;
}

static kiln_status_t get_i32(const kiln_json_t *obj, const char *key, const char *name, int32_t lo,
                             int32_t hi, int32_t *out) {
  int64_t x = *out;
  kiln_status_t st = get_int(obj, key, name, lo, hi, &x, NULL);
  if (!st) *out = (int32_t)x;
  return st;
}

static kiln_status_t get_bool(const kiln_json_t *obj, const char *key, const char *name,
                              bool *out) {
  const kiln_json_t *v = member(obj, key);
  if (!v) return NULL;
  if (!kiln_json_is(v, KILN_JSON_BOOL)) return bad(name, key, "true or false", v);
  *out = kiln_json_bool(v);
  return NULL;
}

/* A list of 3 numbers, or one number for every channel (as transformers accepts). */
static kiln_status_t get_triple(const kiln_json_t *obj, const char *key, const char *name,
                                bool nonzero, double out[3]) {
  const kiln_json_t *v = member(obj, key);
  if (!v) return NULL;
  double x[3];
  if (kiln_json_is(v, KILN_JSON_NUMBER)) {
    x[0] = x[1] = x[2] = kiln_json_number(v);
  } else if (kiln_json_is(v, KILN_JSON_ARRAY) && kiln_json_len(v) == 3) {
    for (size_t i = 0; i < 3; i++) {
      const kiln_json_t *e = kiln_json_at(v, i);
      if (!kiln_json_is(e, KILN_JSON_NUMBER)) return bad(name, key, "a list of 3 numbers", e);
      x[i] = kiln_json_number(e);
    }
  } else {
    if (kiln_json_is(v, KILN_JSON_ARRAY))
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s: %s has %zu values, want 3 (one per RGB channel)", name, key,
                              kiln_json_len(v));
    return bad(name, key, "a list of 3 numbers", v);
  }
  for (int i = 0; i < 3; i++)
    if (!isfinite(x[i]) || (nonzero && x[i] == 0.0))
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: %s[%d] = %g is not %s", name, key, i,
                              x[i], nonzero ? "a finite non-zero number" : "finite");
  memcpy(out, x, sizeof x);
  return NULL;
}

static const char *resample_name(int64_t r) {
  static const char *names[] = {"nearest", "lanczos", "bilinear", "bicubic", "box", "hamming"};
  return r >= 0 && r < 6 ? names[r] : "unknown";
}

kiln_status_t kiln_vision_preproc_from_json(const kiln_json_t *root, const char *name,
                                            kiln_vision_preproc_t *out) {
  kiln_vision_preproc_default(out);
  if (!name) name = "image processor config";
  if (!kiln_json_is(root, KILN_JSON_OBJECT))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: want a JSON object, got a %s", name,
                            kiln_json_type_name(kiln_json_type(root)));
  const kiln_json_t *obj = root, *nested = kiln_json_get(root, "image_processor");
  if (nested) {
    if (!kiln_json_is(nested, KILN_JSON_OBJECT))
      return bad(name, "image_processor", "an object", nested);
    obj = nested;
  }
  kiln_status_t st = NULL;
  const int64_t kMaxPixels = (int64_t)KILN_IMAGE_HARD_MAX_SIDE * KILN_IMAGE_HARD_MAX_SIDE;
#define TRY(x)         \
  do {                 \
    st = (x);          \
    if (st) return st; \
  } while (0)
  /* size first; min_pixels/max_pixels override it (transformers' backward compatibility). */
  const kiln_json_t *size = member(obj, "size");
  bool have_se = false, have_le = false;
  if (size) {
    if (!kiln_json_is(size, KILN_JSON_OBJECT))
      return bad(name, "size", "an object {\"shortest_edge\", \"longest_edge\"}", size);
    bool f1 = false, f2 = false;
    TRY(get_int(size, "shortest_edge", name, 1, kMaxPixels, &out->min_pixels, &have_se));
    TRY(get_int(size, "longest_edge", name, 1, kMaxPixels, &out->max_pixels, &have_le));
    /* transformers 4.45..4.47 wrote size as {"min_pixels", "max_pixels"}. */
    if (!have_se) TRY(get_int(size, "min_pixels", name, 1, kMaxPixels, &out->min_pixels, &f1));
    if (!have_le) TRY(get_int(size, "max_pixels", name, 1, kMaxPixels, &out->max_pixels, &f2));
    have_se |= f1;
    have_le |= f2;
  }
  bool have_min = false, have_max = false;
  TRY(get_int(obj, "min_pixels", name, 1, kMaxPixels, &out->min_pixels, &have_min));
  TRY(get_int(obj, "max_pixels", name, 1, kMaxPixels, &out->max_pixels, &have_max));
  if (size && (!(have_se || have_min) || !(have_le || have_max)))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: size must contain 'shortest_edge' and 'longest_edge' keys", name);
  if (out->min_pixels > out->max_pixels)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: min_pixels %lld is more than max_pixels %lld", name,
                            (long long)out->min_pixels, (long long)out->max_pixels);
  TRY(get_i32(obj, "patch_size", name, 1, 1024, &out->patch_size));
  TRY(get_i32(obj, "temporal_patch_size", name, 1, 16, &out->temporal_patch_size));
  TRY(get_i32(obj, "merge_size", name, 1, 16, &out->merge_size));
  TRY(get_triple(obj, "image_mean", name, false, out->image_mean));
  TRY(get_triple(obj, "image_std", name, true, out->image_std));
  const kiln_json_t *rf = member(obj, "rescale_factor");
  if (rf) {
    if (!kiln_json_is(rf, KILN_JSON_NUMBER)) return bad(name, "rescale_factor", "a number", rf);
    out->rescale_factor = kiln_json_number(rf);
    if (!isfinite(out->rescale_factor) || out->rescale_factor <= 0)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: rescale_factor = %g is not positive",
                              name, out->rescale_factor);
  }
  TRY(get_bool(obj, "do_resize", name, &out->do_resize));
  TRY(get_bool(obj, "do_rescale", name, &out->do_rescale));
  TRY(get_bool(obj, "do_normalize", name, &out->do_normalize));
  TRY(get_bool(obj, "do_convert_rgb", name, &out->do_convert_rgb));
  int64_t resample = out->resample;
  TRY(get_int(obj, "resample", name, INT32_MIN, INT32_MAX, &resample, NULL));
  if (resample != 3)
    return kiln_status_make(KILN_ERR_UNSUPPORTED,
                            "%s: resample = %lld (%s) is not supported; Kiln implements 3 (PIL's "
                            "bicubic), what Qwen2-VL uses",
                            name, (long long)resample, resample_name(resample));
  out->resample = 3;
#undef TRY
  snprintf(out->source, sizeof out->source, "%s", name);
  return NULL;
}

static bool file_exists(const char *path) {
  struct stat sb;
  return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

kiln_status_t kiln_vision_preproc_load(const char *model_dir, kiln_vision_preproc_t *out) {
  kiln_vision_preproc_default(out);
  static const char *const names[] = {"preprocessor_config.json", "processor_config.json"};
  char path[4096];
  for (size_t i = 0; i < 2; i++) {
    int n = snprintf(path, sizeof path, "%s/%s", model_dir, names[i]);
    if (n < 0 || (size_t)n >= sizeof path)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: path too long", model_dir);
    if (!file_exists(path)) continue;
    kiln_json_doc_t *doc = NULL;
    kiln_status_t st = kiln_json_parse_file(path, &doc);
    if (!st) st = kiln_vision_preproc_from_json(kiln_json_root(doc), path, out);
    kiln_json_doc_free(doc);
    return st;
  }
  return kiln_status_make(KILN_ERR_NOT_FOUND,
                          "%s: neither preprocessor_config.json nor processor_config.json is "
                          "there; a vision-language model needs its image processor settings",
                          model_dir);
}

/* ---- smart_resize ---------------------------------------------------------------------------- */

kiln_status_t kiln_vision_smart_resize(int64_t height, int64_t width, int32_t factor,
                                       int64_t min_pixels, int64_t max_pixels, int32_t *out_height,
                                       int32_t *out_width) {
  *out_height = *out_width = 0;
  if (height < 1 || width < 1 || height > INT32_MAX || width > INT32_MAX)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "smart_resize: image size %lld x %lld",
                            (long long)width, (long long)height);
  if (factor < 1)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "smart_resize: factor %d", (int)factor);
  const double hi = (double)(height > width ? height : width);
  const double lo = (double)(height > width ? width : height);
  if (hi / lo > 200)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "absolute aspect ratio must be smaller than 200, got %.17g (%lld x "
                            "%lld)",
                            hi / lo, (long long)width, (long long)height);
  const double f = factor;
  /* Python's round() on a float: to nearest, ties to even, which nearbyint does in the default
   * rounding mode. The products stay far below 2^53, so every double here is exact where
   * Python's integers are. */
  int64_t h_bar = (int64_t)nearbyint((double)height / f) * factor;
  int64_t w_bar = (int64_t)nearbyint((double)width / f) * factor;
  const int64_t area = height * width;
  if (h_bar * w_bar > max_pixels) {
    double beta = sqrt((double)area / (double)max_pixels);
    h_bar = (int64_t)floor((double)height / beta / f) * factor;
    w_bar = (int64_t)floor((double)width / beta / f) * factor;
    if (h_bar < factor) h_bar = factor;
    if (w_bar < factor) w_bar = factor;
  } else if (h_bar * w_bar < min_pixels) {
    double beta = sqrt((double)min_pixels / (double)area);
    h_bar = (int64_t)ceil((double)height * beta / f) * factor;
    w_bar = (int64_t)ceil((double)width * beta / f) * factor;
  }
  if (h_bar < 1 || w_bar < 1 || h_bar > KILN_IMAGE_HARD_MAX_SIDE ||
      w_bar > KILN_IMAGE_HARD_MAX_SIDE)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "smart_resize: %lld x %lld resizes to %lld x %lld (min_pixels %lld, "
                            "max_pixels %lld), outside 1..%d per side",
                            (long long)width, (long long)height, (long long)w_bar, (long long)h_bar,
                            (long long)min_pixels, (long long)max_pixels, KILN_IMAGE_HARD_MAX_SIDE);
  *out_height = (int32_t)h_bar;
  *out_width = (int32_t)w_bar;
  return NULL;
}

/* ---- patches --------------------------------------------------------------------------------- */

static kiln_status_t check_geometry(const kiln_vision_preproc_t *pp) {
  const int32_t ps = pp->patch_size, tps = pp->temporal_patch_size, m = pp->merge_size;
  if (ps < 1 || tps < 1 || m < 1 || (int64_t)ps * m > KILN_IMAGE_HARD_MAX_SIDE)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "preprocess: patch_size %d, temporal_patch_size %d, merge_size %d",
                            (int)ps, (int)tps, (int)m);
  return NULL;
}

/* Patch order: merge windows row-major, then the m x m patches inside each window row-major;
 * inside a patch: channel, time, row, column (transformers' reshape + transpose). Each value is
 * looked up straight from the resized image's byte, once per frame. */
typedef struct patch_job {
  const uint8_t *rgb;
  int32_t rw, ps, tps, m;
  int64_t wins, dim; /* merge windows per row, values per patch */
  const float (*lut)[256];
  float *out;
} patch_job_t;

/* Copies a finished patch out. On x86-64 with streaming stores: the patches (22 MB for a
 * 1288 x 728 image) are written once and read much later, so their cache lines need not be
 * read in first nor kept. */
static void patch_store(float *dst, const float *src, size_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (((uintptr_t)dst & 15) == 0) {
    size_t i = 0;
    for (; i + 4 <= n; i += 4) _mm_stream_ps(dst + i, _mm_loadu_ps(src + i));
    for (; i < n; i++) dst[i] = src[i];
    return;
  }
#endif
  memcpy(dst, src, n * sizeof *dst);
}

static void patch_task(void *ctx, int64_t begin, int64_t end, int worker) {
  const patch_job_t *j = ctx;
  (void)worker;
  /* locals, so that the stores (float) cannot be taken to alias the job or the table */
  const int32_t ps = j->ps, m = j->m;
  const size_t frames = (size_t)j->tps, rw = (size_t)j->rw;
  const int64_t wins = j->wins, dim = j->dim;
  const uint8_t *rgb = j->rgb;
  float lut[3][256];
  memcpy(lut, j->lut, sizeof lut);
  float one[4096], *buf = dim <= 4096 ? one : malloc(sizeof *buf * (size_t)dim);
  for (int64_t bh = begin; bh < end; bh++)
    for (int64_t bw = 0; bw < wins; bw++)
      for (int mh = 0; mh < m; mh++)
        for (int mw = 0; mw < m; mw++) {
          float *out = j->out + (((bh * wins + bw) * m + mh) * m + mw) * dim;
          float *restrict dst = buf ? buf : out; /* straight to the output if malloc failed */
          const size_t y0 = (size_t)((bh * m + mh) * ps), x0 = (size_t)((bw * m + mw) * ps);
          for (int c = 0; c < 3; c++) {
            const float *restrict lc = lut[c];
            for (size_t t = 0; t < frames; t++)
              for (int py = 0; py < ps; py++) {
                const uint8_t *restrict row = rgb + ((y0 + (size_t)py) * rw + x0) * 3 + c;
                for (int px = 0; px < ps; px++) *dst++ = lc[row[3 * px]];
              }
          }
          if (buf) patch_store(out, buf, (size_t)dim);
        }
#if defined(__x86_64__) && defined(__GNUC__)
  _mm_sfence(); /* the streaming stores are visible before the caller reads the patches */
#endif
  if (buf != one) free(buf);
}

kiln_status_t kiln_image_patchify(const kiln_vision_preproc_t *pp, const kiln_image_t *src,
                                  kiln_image_patches_t *out) {
  memset(out, 0, sizeof *out);
  if (!src || !src->rgb || src->width < 1 || src->height < 1)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "preprocess: no image");
  kiln_status_t st = check_geometry(pp);
  if (st) return st;
  const int32_t ps = pp->patch_size, tps = pp->temporal_patch_size, m = pp->merge_size;
  const int32_t factor = ps * m, rh = src->height, rw = src->width;
  if (rh % factor || rw % factor)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "preprocess: with do_resize off the image (%d x %d) must be a "
                            "multiple of patch_size * merge_size = %d on each side",
                            (int)rw, (int)rh, (int)factor);
  /* Rescale and normalize depend only on the channel and the byte value: a table per channel
   * computed exactly as transformers computes each pixel (float64 product cast to float32, then
   * float32 subtraction and division). */
  float lut[3][256];
  for (int c = 0; c < 3; c++) {
    const float mean = (float)pp->image_mean[c], sd = (float)pp->image_std[c];
    for (int v = 0; v < 256; v++) {
      float x = pp->do_rescale ? (float)((double)v * pp->rescale_factor) : (float)v;
      if (pp->do_normalize) x = (x - mean) / sd;
      lut[c][v] = x;
    }
  }
  const int64_t gh = rh / ps, gw = rw / ps;
  const int64_t dim = 3 * (int64_t)tps * ps * ps;
  const int64_t n = gh * gw; /* grid_t = 1: one image repeated over the temporal patch */
  out->pixels = malloc(sizeof *out->pixels * (size_t)(n * dim));
  if (!out->pixels)
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "preprocess: out of memory for %lld patches",
                            (long long)n);
  patch_job_t job = {.rgb = src->rgb,
                     .rw = rw,
                     .ps = ps,
                     .tps = tps,
                     .m = m,
                     .wins = gw / m,
                     .dim = dim,
                     .lut = lut,
                     .out = out->pixels};
  /* Rows of merge windows go to the workers. */
  vimg_parallel(vimg_threads(pp->threads, gh / m, n * dim / 65536), gh / m, patch_task, &job);
  out->num_patches = n;
  out->patch_dim = dim;
  out->grid_t = 1;
  out->grid_h = (int32_t)gh;
  out->grid_w = (int32_t)gw;
  out->resized_height = rh;
  out->resized_width = rw;
  return NULL;
}

kiln_status_t kiln_image_preprocess(const kiln_vision_preproc_t *pp, const kiln_image_t *img,
                                    kiln_image_patches_t *out) {
  memset(out, 0, sizeof *out);
  if (!img || !img->rgb || img->width < 1 || img->height < 1)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "preprocess: no image");
  kiln_status_t st = check_geometry(pp);
  if (st) return st;
  const int32_t factor = pp->patch_size * pp->merge_size;
  kiln_image_t resized = {0};
  const kiln_image_t *src = img;
  int32_t rh = img->height, rw = img->width;
  if (pp->do_resize) {
    st = kiln_vision_smart_resize(img->height, img->width, factor, pp->min_pixels, pp->max_pixels,
                                  &rh, &rw);
    if (st) return kiln_status_annotate(st, "preprocess");
    if (rh != img->height || rw != img->width) {
      st = kiln_image_resize_bicubic_threads(img, rw, rh, pp->threads, &resized);
      if (st) return st;
      src = &resized;
    }
  }
  st = kiln_image_patchify(pp, src, out);
  kiln_image_free(&resized);
  if (!st) kiln_image_hash(img, out->hash);
  return st;
}

void kiln_image_patches_free(kiln_image_patches_t *p) {
  if (!p) return;
  free(p->pixels);
  memset(p, 0, sizeof *p);
}

int64_t kiln_image_num_tokens(const kiln_image_patches_t *p, int32_t merge_size) {
  if (!p || merge_size < 1) return 0;
  return (int64_t)p->grid_t * p->grid_h * p->grid_w / ((int64_t)merge_size * merge_size);
}
