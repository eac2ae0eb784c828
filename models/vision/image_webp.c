/* image_webp.c - still WebP (lossy VP8, lossless VP8L, either with alpha) through libwebp.
 *
 * Pillow decodes WebP with libwebp's animation decoder, default options: RGBA, not
 * premultiplied, fancy upsampling, the first frame decoded straight into a blank canvas. For a
 * still image that is what WebPDecode gives in MODE_RGBA, which is used here; the alpha byte is
 * then dropped (convert("RGB")). Animated files are refused rather than reduced to a frame.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <webp/decode.h>

#include "models/vision/image_internal.h"

static const char *vp8_status_name(VP8StatusCode c) {
  switch (c) {
    case VP8_STATUS_OK: return "ok";
    case VP8_STATUS_OUT_OF_MEMORY: return "out of memory";
    case VP8_STATUS_INVALID_PARAM: return "invalid parameter";
    case VP8_STATUS_BITSTREAM_ERROR: return "bitstream error";
    case VP8_STATUS_UNSUPPORTED_FEATURE: return "unsupported feature";
    case VP8_STATUS_SUSPENDED: return "suspended";
    case VP8_STATUS_USER_ABORT: return "aborted";
    case VP8_STATUS_NOT_ENOUGH_DATA: return "not enough data";
  }
  return "unknown status";
}

static kiln_status_t webp_error(const char *what, const char *stage, VP8StatusCode c, size_t len) {
  if (c == VP8_STATUS_NOT_ENOUGH_DATA)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: truncated WebP (the data ends after %zu bytes)", what, len);
  if (c == VP8_STATUS_OUT_OF_MEMORY)
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: WebP: out of memory", what);
  if (c == VP8_STATUS_UNSUPPORTED_FEATURE)
    return kiln_status_make(KILN_ERR_UNSUPPORTED, "%s: WebP: %s: unsupported feature", what, stage);
  return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: corrupt WebP: %s: %s", what, stage,
                          vp8_status_name(c));
}

kiln_status_t vimg_decode_webp(const uint8_t *data, size_t len, const char *what,
                               const vimg_limits_t *lim, kiln_image_t *out) {
  WebPDecoderConfig cfg;
  if (!WebPInitDecoderConfig(&cfg))
    return kiln_status_make(KILN_ERR_INTERNAL, "%s: libwebp's decoder ABI does not match", what);
  /* The RIFF header states the file's size; a shorter buffer is a truncated file even where
   * the missing part is only trailing chunks (libwebp would accept those silently). */
  if (len >= 8) {
    uint32_t riff = (uint32_t)data[4] | (uint32_t)data[5] << 8 | (uint32_t)data[6] << 16 |
                    (uint32_t)data[7] << 24;
    if ((uint64_t)riff + 8 > len)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s: truncated WebP (the data ends after %zu of %llu bytes)", what,
                              len, (unsigned long long)riff + 8);
  }
  VP8StatusCode c = WebPGetFeatures(data, len, &cfg.input);
  if (c != VP8_STATUS_OK) return webp_error(what, "header", c, len);
  if (cfg.input.has_animation)
    return kiln_status_make(KILN_ERR_UNSUPPORTED,
                            "%s: animated WebP is not supported (a still image is)", what);
  kiln_status_t st = vimg_check_size(what, "WebP", cfg.input.width, cfg.input.height, lim);
  if (st) return st;
  const size_t w = (size_t)cfg.input.width, h = (size_t)cfg.input.height;
  uint8_t *rgba = malloc(w * h * 4);
  if (!rgba)
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: WebP: cannot allocate %zu x %zu pixels",
                            what, w, h);
  cfg.output.colorspace = MODE_RGBA;
  cfg.output.is_external_memory = 1;
  cfg.output.u.RGBA.rgba = rgba;
  cfg.output.u.RGBA.stride = (int)(w * 4);
  cfg.output.u.RGBA.size = w * h * 4;
  c = WebPDecode(data, len, &cfg);
  WebPFreeDecBuffer(&cfg.output); /* external memory: frees nothing of ours */
  if (c != VP8_STATUS_OK) {
    free(rgba);
    return webp_error(what, "pixels", c, len);
  }
  /* RGBA -> RGB in place: the write index never passes the read index. */
  for (size_t i = 0; i < w * h; i++) memmove(rgba + 3 * i, rgba + 4 * i, 3);
  uint8_t *rgb = realloc(rgba, w * h * 3);
  out->width = (int32_t)w;
  out->height = (int32_t)h;
  out->rgb = rgb ? rgb : rgba;
  return NULL;
}
