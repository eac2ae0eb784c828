/* image_png.c - PNG through libpng's classic API, converted to RGB as PIL's convert("RGB").
 *
 * libpng reports errors by longjmp. Everything the decode allocates lives in a png_dec_t that
 * outlives the setjmp frame (png_decode_body is the only function that calls setjmp, and it
 * returns at once after a longjmp), so png_dec_free releases it on every path. The transforms
 * asked of libpng: palette -> RGB (libpng may add an alpha channel from tRNS; dropped here),
 * 1/2/4-bit grey -> 8-bit (bit replication, as PIL's "L;2"/"L;4" unpackers), interlace
 * handling. 16-bit samples arrive big-endian and are reduced here: the high byte for colour
 * and grey+alpha (PIL "RGB;16B", "RGBA;16B", "LA;16B"), min(v, 255) for plain 16-bit grey (PIL
 * mode "I;16" -> "RGB" saturates). No gamma, sBIT, iCCP or background handling is asked for,
 * so none is applied (as in PIL).
 */
#include <png.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/vision/image_internal.h"

typedef struct png_dec {
  const uint8_t *data;
  size_t len, pos;
  png_structp png;
  png_infop info;
  uint8_t *raw;    /* [height, rowbytes] as libpng delivers them (not for 8-bit RGB) */
  png_bytep *rows; /* row pointers into raw */
  uint8_t *rgb;    /* the result, handed to the caller on success */
  png_uint_32 width, height;
  int out_channels, out_depth, src_color, src_depth;
  size_t rowbytes;
  kiln_status_t st; /* a limit or OOM found inside the body (not a libpng error) */
  const vimg_limits_t *lim;
  const char *what;
  char msg[200]; /* libpng's last error message */
  bool truncated;
} png_dec_t;

static void png_on_error(png_structp png, png_const_charp msg) {
  png_dec_t *d = png_get_error_ptr(png);
  snprintf(d->msg, sizeof d->msg, "%s", msg ? msg : "unknown error");
  png_longjmp(png, 1);
}

static void png_on_warning(png_structp png, png_const_charp msg) {
  (void)png;
  (void)msg; /* ancillary-chunk CRC errors and the like: PIL reads past them too */
}

static void png_on_read(png_structp png, png_bytep out, size_t n) {
  png_dec_t *d = png_get_io_ptr(png);
  if (n > d->len - d->pos) {
    d->truncated = true;
    png_error(png, "unexpected end of data");
  }
  memcpy(out, d->data + d->pos, n);
  d->pos += n;
}

static void rgb_from_rows(png_dec_t *d) {
  const int ch = d->out_channels, bps = d->out_depth == 16 ? 2 : 1;
  const bool grey = ch <= 2;
  /* Plain 16-bit greyscale saturates (PIL "I;16" -> "RGB"); everything else keeps the MSB. */
  const bool grey16_clip = bps == 2 && d->src_color == PNG_COLOR_TYPE_GRAY;
  for (png_uint_32 y = 0; y < d->height; y++) {
    const uint8_t *s = d->rows[y];
    uint8_t *o = d->rgb + (size_t)y * d->width * 3;
    for (png_uint_32 x = 0; x < d->width; x++, s += (size_t)ch * bps, o += 3) {
      if (grey) {
        uint8_t v;
        if (grey16_clip) {
          unsigned w = ((unsigned)s[0] << 8) | s[1];
          v = w > 255 ? 255 : (uint8_t)w;
        } else {
          v = s[0];
        }
        o[0] = o[1] = o[2] = v;
      } else {
        o[0] = s[0];
        o[1] = s[bps];
        o[2] = s[2 * bps];
      }
    }
  }
}

/* Returns 0 when done, 1 when d->st was set, -1 after a libpng error (d->msg). */
static int png_decode_body(png_dec_t *d) {
  if (setjmp(png_jmpbuf(d->png))) return -1;
  png_set_read_fn(d->png, d, png_on_read);
  /* Our own check after IHDR names the limit; libpng's would only say "exceeds user limit". */
  png_set_user_limits(d->png, PNG_UINT_31_MAX, PNG_UINT_31_MAX);
  png_set_chunk_malloc_max(d->png, 64u << 20); /* text/ICC chunks: no more than 64 MiB each */
  png_read_info(d->png, d->info);
  int interlace, compression, filter;
  png_get_IHDR(d->png, d->info, &d->width, &d->height, &d->src_depth, &d->src_color, &interlace,
               &compression, &filter);
  d->st = vimg_check_size(d->what, "PNG", d->width, d->height, d->lim);
  if (d->st) return 1;
  if (d->src_color == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(d->png);
  if (d->src_color == PNG_COLOR_TYPE_GRAY && d->src_depth < 8)
    png_set_expand_gray_1_2_4_to_8(d->png);
  png_set_interlace_handling(d->png);
  png_read_update_info(d->png, d->info);
  d->out_channels = png_get_channels(d->png, d->info);
  d->out_depth = png_get_bit_depth(d->png, d->info);
  d->rowbytes = png_get_rowbytes(d->png, d->info);
  if (d->out_channels < 1 || d->out_channels > 4 || (d->out_depth != 8 && d->out_depth != 16) ||
      d->rowbytes < (size_t)d->width * d->out_channels * (d->out_depth / 8)) {
    d->st = kiln_status_make(KILN_ERR_INTERNAL,
                             "%s: PNG: libpng delivers %d channels of %d bits (%zu bytes a row)",
                             d->what, d->out_channels, d->out_depth, d->rowbytes);
    return 1;
  }
  /* 8-bit RGB, what libpng delivers is the result: its rows go straight into it. */
  const bool direct =
      d->out_channels == 3 && d->out_depth == 8 && d->rowbytes == (size_t)d->width * 3;
  if (!direct) d->raw = malloc(d->rowbytes * d->height);
  d->rows = malloc(sizeof *d->rows * d->height);
  d->rgb = malloc((size_t)d->width * d->height * 3);
  if ((!direct && !d->raw) || !d->rows || !d->rgb) {
    d->st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: PNG: cannot allocate %u x %u pixels",
                             d->what, (unsigned)d->width, (unsigned)d->height);
    return 1;
  }
  uint8_t *base = direct ? d->rgb : d->raw;
  for (png_uint_32 y = 0; y < d->height; y++) d->rows[y] = base + (size_t)y * d->rowbytes;
  png_read_image(d->png, d->rows);
  /* The image is complete; what follows (ancillary chunks, IEND) does not change it, and PIL
   * does not read it either, so a file cut after its last IDAT still decodes. */
  if (!direct) rgb_from_rows(d);
  return 0;
}

static void png_dec_free(png_dec_t *d) {
  if (d->png) png_destroy_read_struct(&d->png, d->info ? &d->info : NULL, NULL);
  free(d->raw);
  free(d->rows);
  free(d->rgb);
}

kiln_status_t vimg_decode_png(const uint8_t *data, size_t len, const char *what,
                              const vimg_limits_t *lim, kiln_image_t *out) {
  png_dec_t *d = calloc(1, sizeof *d);
  if (!d) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: PNG: out of memory", what);
  d->data = data;
  d->len = len;
  d->lim = lim;
  d->what = what;
  kiln_status_t st = NULL;
  d->png = png_create_read_struct(PNG_LIBPNG_VER_STRING, d, png_on_error, png_on_warning);
  if (d->png) d->info = png_create_info_struct(d->png);
  if (!d->png || !d->info) {
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: PNG: cannot create a libpng reader", what);
    goto done;
  }
  int rc = png_decode_body(d);
  if (rc > 0) {
    st = d->st;
    d->st = NULL;
  } else if (rc < 0) {
    if (d->truncated)
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: truncated PNG (the data ends after %zu bytes)", what, len);
    else
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: corrupt PNG: %s", what, d->msg);
  } else {
    out->width = (int32_t)d->width;
    out->height = (int32_t)d->height;
    out->rgb = d->rgb;
    d->rgb = NULL;
  }
done:
  png_dec_free(d);
  free(d);
  return st;
}
