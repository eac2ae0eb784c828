/* image.c - format sniffing, limits, file loading and hashing around the format decoders. */
#define _POSIX_C_SOURCE 200809L
#include "models/vision/image.h"

#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

#include "models/vision/image_internal.h"

void kiln_image_limits_default(kiln_image_limits_t *out) {
  out->max_pixels = KILN_IMAGE_DEFAULT_MAX_PIXELS;
  out->max_side = KILN_IMAGE_DEFAULT_MAX_SIDE;
  out->max_file_bytes = KILN_IMAGE_DEFAULT_MAX_FILE_BYTES;
}

static void limits_resolve(const kiln_image_limits_t *in, vimg_limits_t *out) {
  out->max_pixels = (in && in->max_pixels > 0) ? in->max_pixels : KILN_IMAGE_DEFAULT_MAX_PIXELS;
  out->max_side = (in && in->max_side > 0) ? in->max_side : KILN_IMAGE_DEFAULT_MAX_SIDE;
  if (out->max_side > KILN_IMAGE_HARD_MAX_SIDE) out->max_side = KILN_IMAGE_HARD_MAX_SIDE;
}

kiln_status_t vimg_check_size(const char *what, const char *format, int64_t width, int64_t height,
                              const vimg_limits_t *lim) {
  if (width <= 0 || height <= 0)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: %s image of %lld x %lld pixels is empty", what, format,
                            (long long)width, (long long)height);
  if (width > lim->max_side || height > lim->max_side)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: %s image of %lld x %lld pixels is over the limit of %d pixels per "
                            "side",
                            what, format, (long long)width, (long long)height, (int)lim->max_side);
  if (width * height > lim->max_pixels)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: %s image of %lld x %lld = %lld pixels is over the limit of %lld "
                            "pixels",
                            what, format, (long long)width, (long long)height,
                            (long long)(width * height), (long long)lim->max_pixels);
  return NULL;
}

static bool starts(const uint8_t *p, size_t len, size_t off, const char *magic, size_t n) {
  return len >= off + n && memcmp(p + off, magic, n) == 0;
}

kiln_image_format_t kiln_image_sniff(const void *data, size_t len, const char **out_name) {
  const uint8_t *p = data;
  if (out_name) *out_name = NULL;
  if (!p || len == 0) return KILN_IMAGE_FORMAT_UNKNOWN;
  if (starts(p, len, 0, "\x89PNG\r\n\x1a\n", 8)) return KILN_IMAGE_FORMAT_PNG;
  if (starts(p, len, 0, "\xff\xd8\xff", 3)) return KILN_IMAGE_FORMAT_JPEG;
  if (starts(p, len, 0, "RIFF", 4) && starts(p, len, 8, "WEBP", 4)) return KILN_IMAGE_FORMAT_WEBP;
  static const struct {
    size_t off, n;
    const char *magic, *name;
  } others[] = {
      {0, 6, "GIF87a", "GIF"},
      {0, 6, "GIF89a", "GIF"},
      {0, 2, "BM", "BMP"},
      {0, 4, "II*\0", "TIFF"},
      {0, 4, "MM\0*", "TIFF"},
      {4, 8, "ftypavif", "AVIF"},
      {4, 8, "ftypavis", "AVIF"},
      {4, 8, "ftypheic", "HEIC"},
      {4, 8, "ftypheix", "HEIC"},
      {4, 8, "ftypmif1", "HEIF"},
      {0, 4, "\0\0\1\0", "ICO"},
      {0, 2, "\xff\x0a", "JPEG XL"},
      {0, 12, "\0\0\0\x0cJXL \r\n\x87\n", "JPEG XL"},
      {0, 4, "qoif", "QOI"},
      {0, 4, "8BPS", "PSD"},
      {0, 4, "<svg", "SVG"},
      {0, 5, "<?xml", "SVG/XML"},
      {0, 4, "\0\0\0\x0cjP  ", "JPEG 2000"},
      {0, 4, "%PDF", "PDF"},
  };
  for (size_t i = 0; i < sizeof others / sizeof others[0]; i++)
    if (starts(p, len, others[i].off, others[i].magic, others[i].n)) {
      if (out_name) *out_name = others[i].name;
      break;
    }
  return KILN_IMAGE_FORMAT_UNKNOWN;
}

const char *kiln_image_format_name(kiln_image_format_t f) {
  switch (f) {
    case KILN_IMAGE_FORMAT_PNG: return "PNG";
    case KILN_IMAGE_FORMAT_JPEG: return "JPEG";
    case KILN_IMAGE_FORMAT_WEBP: return "WebP";
    default: return "unknown";
  }
}

kiln_status_t kiln_image_decode(const void *data, size_t len, const char *what,
                                const kiln_image_limits_t *limits, kiln_image_t *out) {
  memset(out, 0, sizeof *out);
  if (!what) what = "image";
  if (!data || len == 0)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: empty image data (0 bytes)", what);
  vimg_limits_t lim;
  limits_resolve(limits, &lim);
  const char *other = NULL;
  kiln_status_t st;
  switch (kiln_image_sniff(data, len, &other)) {
    case KILN_IMAGE_FORMAT_PNG: st = vimg_decode_png(data, len, what, &lim, out); break;
    case KILN_IMAGE_FORMAT_JPEG: st = vimg_decode_jpeg(data, len, what, &lim, out); break;
    case KILN_IMAGE_FORMAT_WEBP: st = vimg_decode_webp(data, len, what, &lim, out); break;
    default:
      /* Too short to hold a whole signature, but the start of one: a truncated file. */
      if ((len < 8 && memcmp(data, "\x89PNG\r\n\x1a\n", len) == 0) ||
          (len < 3 && memcmp(data, "\xff\xd8\xff", len) == 0) ||
          (len < 12 && memcmp(data, "RIFF", len < 4 ? len : 4) == 0 &&
           (len <= 8 || memcmp((const uint8_t *)data + 8, "WEBP", len - 8) == 0))) {
        const char *fmt = ((const uint8_t *)data)[0] == 0x89   ? "PNG"
                          : ((const uint8_t *)data)[0] == 0xff ? "JPEG"
                                                               : "WebP";
        return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                                "%s: truncated %s (the data ends after %zu bytes)", what, fmt, len);
      }
      if (other)
        return kiln_status_make(KILN_ERR_UNSUPPORTED,
                                "%s: %s images are not supported (PNG, JPEG and WebP are)", what,
                                other);
      {
        const uint8_t *p = data;
        return kiln_status_make(KILN_ERR_UNSUPPORTED,
                                "%s: not a PNG, JPEG or WebP image (%zu bytes starting %02x %02x "
                                "%02x %02x)",
                                what, len, p[0], len > 1 ? p[1] : 0, len > 2 ? p[2] : 0,
                                len > 3 ? p[3] : 0);
      }
  }
  if (st) kiln_image_free(out);
  return st;
}

kiln_status_t kiln_image_load_file(const char *path, const kiln_image_limits_t *limits,
                                   kiln_image_t *out) {
  memset(out, 0, sizeof *out);
  size_t max_bytes = (limits && limits->max_file_bytes) ? limits->max_file_bytes
                                                        : KILN_IMAGE_DEFAULT_MAX_FILE_BYTES;
  kiln_status_t st = NULL;
  uint8_t *buf = NULL;
  FILE *f = fopen(path, "rb");
  if (!f)
    return kiln_status_make(errno == ENOENT ? KILN_ERR_NOT_FOUND : KILN_ERR_IO, "%s: %s", path,
                            strerror(errno));
  struct stat sb;
  if (fstat(fileno(f), &sb) != 0) {
    st = kiln_status_make(KILN_ERR_IO, "%s: %s", path, strerror(errno));
    goto done;
  }
  if (!S_ISREG(sb.st_mode)) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: not a regular file", path);
    goto done;
  }
  if ((uint64_t)sb.st_size > max_bytes) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "%s: %lld bytes is over the image file limit of %zu bytes", path,
                          (long long)sb.st_size, max_bytes);
    goto done;
  }
  size_t n = (size_t)sb.st_size;
  buf = malloc(n ? n : 1);
  if (!buf) {
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: cannot allocate %zu bytes", path, n);
    goto done;
  }
  if (n && fread(buf, 1, n, f) != n) {
    st = kiln_status_make(KILN_ERR_IO, "%s: short read", path);
    goto done;
  }
  st = kiln_image_decode(buf, n, path, limits, out);
done:
  free(buf);
  fclose(f);
  return st;
}

void kiln_image_free(kiln_image_t *img) {
  if (!img) return;
  free(img->rgb);
  memset(img, 0, sizeof *img);
}

void kiln_image_hash(const kiln_image_t *img, uint64_t out[2]) {
  XXH3_state_t st;
  XXH3_128bits_reset(&st);
  /* The size first, little-endian, so that a 2x3 and a 3x2 image of the same bytes differ. */
  uint8_t hdr[16] = {'k', 'i', 'l', 'n', 'r', 'g', 'b', '8'};
  uint32_t w = (uint32_t)img->width, h = (uint32_t)img->height;
  for (int i = 0; i < 4; i++) {
    hdr[8 + i] = (uint8_t)(w >> (8 * i));
    hdr[12 + i] = (uint8_t)(h >> (8 * i));
  }
  XXH3_128bits_update(&st, hdr, sizeof hdr);
  if (img->rgb) XXH3_128bits_update(&st, img->rgb, (size_t)img->width * (size_t)img->height * 3);
  XXH128_hash_t hv = XXH3_128bits_digest(&st);
  out[0] = hv.low64;
  out[1] = hv.high64;
}

/* ---- threads ------------------------------------------------------------------------------- */

int vimg_threads(int32_t requested, int64_t n, int64_t work) {
  int64_t t = requested;
  if (t <= 0) { /* auto: a few cores, and none for a small image (a thread costs ~50 us) */
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    t = cpus < 1 ? 1 : cpus < 4 ? cpus : 4;
    if (t > work) t = work;
  }
  if (t > VIMG_MAX_THREADS) t = VIMG_MAX_THREADS;
  if (t > n) t = n;
  return t < 1 ? 1 : (int)t;
}

typedef struct vimg_worker {
  vimg_task_fn fn;
  void *ctx;
  int64_t begin, end;
  int index;
} vimg_worker_t;

static void *vimg_worker_main(void *arg) {
  const vimg_worker_t *w = arg;
  w->fn(w->ctx, w->begin, w->end, w->index);
  return NULL;
}

void vimg_parallel(int nt, int64_t n, vimg_task_fn fn, void *ctx) {
  if (n <= 0) return;
  if (nt > VIMG_MAX_THREADS) nt = VIMG_MAX_THREADS;
  if (nt > n) nt = (int)n;
  if (nt <= 1) {
    fn(ctx, 0, n, 0);
    return;
  }
  vimg_worker_t w[VIMG_MAX_THREADS];
  pthread_t th[VIMG_MAX_THREADS];
  bool started[VIMG_MAX_THREADS] = {false};
  for (int t = 0; t < nt; t++) w[t] = (vimg_worker_t){fn, ctx, n * t / nt, n * (t + 1) / nt, t};
  for (int t = 1; t < nt; t++)
    started[t] = pthread_create(&th[t], NULL, vimg_worker_main, &w[t]) == 0;
  fn(ctx, w[0].begin, w[0].end, 0);
  for (int t = 1; t < nt; t++) {
    if (started[t])
      pthread_join(th[t], NULL);
    else
      fn(ctx, w[t].begin, w[t].end, t);
  }
}
