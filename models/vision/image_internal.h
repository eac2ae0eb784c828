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

#endif /* KILN_MODELS_VISION_IMAGE_INTERNAL_H */
