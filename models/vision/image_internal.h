/* image_internal.h - what the format decoders (image_png.c, image_jpeg.c, image_webp.c) share
 * with image.c: each decodes one format into an RGB kiln_image_t within resolved limits. */
#ifndef KILN_MODELS_VISION_IMAGE_INTERNAL_H
#define KILN_MODELS_VISION_IMAGE_INTERNAL_H

#include <stdbool.h>

#include "models/vision/image.h"

/* Limits with the defaults filled in (every field positive). */
typedef struct vimg_limits {
  int64_t max_pixels;
  int32_t max_side;
} vimg_limits_t;

/* NULL when width x height is within the limits, else an INVALID_ARGUMENT status naming what
 * and the format. Also refuses a zero size. */
kiln_status_t vimg_check_size(const char *what, const char *format, int64_t width, int64_t height,
                              const vimg_limits_t *lim);

/* Each: *out is zeroed by the caller; on error nothing is left allocated. */
kiln_status_t vimg_decode_png(const uint8_t *data, size_t len, const char *what,
                              const vimg_limits_t *lim, kiln_image_t *out);
kiln_status_t vimg_decode_jpeg(const uint8_t *data, size_t len, const char *what,
                               const vimg_limits_t *lim, kiln_image_t *out);
kiln_status_t vimg_decode_webp(const uint8_t *data, size_t len, const char *what,
                               const vimg_limits_t *lim, kiln_image_t *out);

/* ---- a few threads for one image (resample.c, preproc.c) ----
 * vimg_parallel runs fn over [0, n) cut into nt contiguous ranges, one per worker (0 .. nt-1;
 * worker 0 is the calling thread), and returns when all are done. Every item must be computed
 * the same way whichever worker runs it, so the result does not depend on nt. A thread that
 * cannot be started has its range run on the calling thread afterwards. */
#define VIMG_MAX_THREADS 32
typedef void (*vimg_task_fn)(void *ctx, int64_t begin, int64_t end, int worker);
void vimg_parallel(int nt, int64_t n, vimg_task_fn fn, void *ctx);

/* The workers for a job of n items and about work units of 64K byte operations: requested,
 * or for 0 (auto) min(4, online CPUs, work); then at most VIMG_MAX_THREADS and n, at least 1. */
int vimg_threads(int32_t requested, int64_t n, int64_t work);

#endif /* KILN_MODELS_VISION_IMAGE_INTERNAL_H */
