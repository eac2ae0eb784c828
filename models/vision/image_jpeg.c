/* image_jpeg.c - JPEG through libjpeg(-turbo), converted to RGB as PIL reads it.
 *
 * Settings are libjpeg's defaults, which Pillow keeps outside draft mode: accurate integer IDCT
 * (JDCT_ISLOW), fancy upsampling, block smoothing. The colour space is the library's own guess
 * from the file (Pillow passes none): 1 component -> grey, replicated; 3 -> YCbCr or RGB ->
 * RGB by libjpeg; 4 -> CMYK (YCCK converted by libjpeg), inverted as PIL's "CMYK;I" always
 * does, then PIL's cmyk2rgb. 2-component files are refused, as PIL refuses them.
 *
 * libjpeg reports errors through error_exit, which must not return: ours formats the message
 * and longjmps to jpeg_decode_body, the only function that calls setjmp; everything allocated
 * lives in the jpeg_dec_t, released on every path. Warnings are counted and ignored (PIL
 * decodes through "corrupt data: extraneous bytes" and the like), except the end-of-data
 * warning before the last scanline, which is a truncated file: PIL refuses those ("image file
 * is truncated") and so do we. A progress monitor bounds the scan count of progressive files
 * (a file of thousands of tiny scans costs minutes; libjpeg-turbo's own tools stop at 500).
 */
#include <setjmp.h>
#include <stdio.h> /* before jpeglib.h, which uses FILE */
#include <stdlib.h>
#include <string.h>

#include <jerror.h>
#include <jpeglib.h>

#include "models/vision/image_internal.h"

#define JPEG_MAX_SCANS 1000

typedef struct jpeg_dec {
  struct jpeg_decompress_struct cinfo;
  struct jpeg_error_mgr jerr;
  struct jpeg_progress_mgr progress;
  jmp_buf jmp;
  bool created;
  bool truncated;
  bool too_many_scans;
  uint32_t lines_done;
  uint8_t *row;     /* one scanline as libjpeg delivers it */
  uint8_t *rgb;     /* the result */
  kiln_status_t st; /* a limit or OOM found inside the body */
  const vimg_limits_t *lim;
  const char *what;
  char msg[JMSG_LENGTH_MAX];
} jpeg_dec_t;

static void jpeg_on_error(j_common_ptr cinfo) {
  jpeg_dec_t *d = (jpeg_dec_t *)cinfo->client_data;
  (*cinfo->err->format_message)(cinfo, d->msg);
  longjmp(d->jmp, 1);
}

static void jpeg_on_message(j_common_ptr cinfo, int level) {
  jpeg_dec_t *d = (jpeg_dec_t *)cinfo->client_data;
  if (level >= 0) return; /* trace messages */
  cinfo->err->num_warnings++;
  if (cinfo->err->msg_code == JWRN_JPEG_EOF &&
      (d->cinfo.output_height == 0 || d->lines_done < d->cinfo.output_height)) {
    d->truncated = true;
    (*cinfo->err->format_message)(cinfo, d->msg);
    longjmp(d->jmp, 1);
  }
}

static void jpeg_on_output(j_common_ptr cinfo) { (void)cinfo; /* never print to stderr */ }

static void jpeg_on_progress(j_common_ptr cinfo) {
  jpeg_dec_t *d = (jpeg_dec_t *)cinfo->client_data;
  if (cinfo->is_decompressor && ((j_decompress_ptr)cinfo)->input_scan_number > JPEG_MAX_SCANS) {
    d->too_many_scans = true;
    snprintf(d->msg, sizeof d->msg, "more than %d progressive scans", JPEG_MAX_SCANS);
    longjmp(d->jmp, 1);
  }
}

/* PIL's MULDIV255: a * b / 255, rounded its way. */
static inline int muldiv255(int a, int b) {
  int t = a * b + 128;
  return ((t >> 8) + t) >> 8;
}

static inline uint8_t clip8(int v) { return (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v); }

static void row_to_rgb(const uint8_t *in, uint8_t *out, uint32_t width, int comps) {
  for (uint32_t x = 0; x < width; x++, out += 3) {
    if (comps == 1) {
      out[0] = out[1] = out[2] = in[x];
    } else if (comps == 3) {
      memcpy(out, in + 3 * (size_t)x, 3);
    } else {
      /* "CMYK;I": every channel inverted, then cmyk2rgb: nk = 255 - k, v = nk - c * nk / 255 */
      const uint8_t *p = in + 4 * (size_t)x;
      int c = 255 - p[0], m = 255 - p[1], y = 255 - p[2], k = 255 - p[3];
      int nk = 255 - k;
      out[0] = clip8(nk - muldiv255(c, nk));
      out[1] = clip8(nk - muldiv255(m, nk));
      out[2] = clip8(nk - muldiv255(y, nk));
    }
  }
}

/* Returns 0 when done, 1 when d->st was set, -1 after a libjpeg error (d->msg). */
static int jpeg_decode_body(jpeg_dec_t *d, const uint8_t *data, size_t len) {
  if (setjmp(d->jmp)) return -1;
  jpeg_create_decompress(&d->cinfo);
  d->created = true;
  d->cinfo.progress = &d->progress;
  jpeg_mem_src(&d->cinfo, data, (unsigned long)len);
  jpeg_read_header(&d->cinfo, TRUE);
  d->st = vimg_check_size(d->what, "JPEG", d->cinfo.image_width, d->cinfo.image_height, d->lim);
  if (d->st) return 1;
  int comps = d->cinfo.num_components;
  switch (d->cinfo.jpeg_color_space) {
    case JCS_GRAYSCALE: d->cinfo.out_color_space = JCS_GRAYSCALE; break;
    case JCS_YCbCr:
    case JCS_RGB: d->cinfo.out_color_space = JCS_RGB; break;
    case JCS_CMYK:
    case JCS_YCCK: d->cinfo.out_color_space = JCS_CMYK; break;
    default:
      d->st = kiln_status_make(KILN_ERR_UNSUPPORTED,
                               "%s: JPEG with %d colour components is not supported (1, 3 and 4 "
                               "are)",
                               d->what, comps);
      return 1;
  }
  jpeg_start_decompress(&d->cinfo);
  const int out_comps = d->cinfo.output_components;
  const uint32_t w = d->cinfo.output_width, h = d->cinfo.output_height;
  if ((out_comps != 1 && out_comps != 3 && out_comps != 4) || w != d->cinfo.image_width ||
      h != d->cinfo.image_height) {
    d->st = kiln_status_make(KILN_ERR_INTERNAL,
                             "%s: JPEG: libjpeg delivers %d components of %u x %u pixels", d->what,
                             out_comps, (unsigned)w, (unsigned)h);
    return 1;
  }
  d->row = malloc((size_t)w * out_comps);
  d->rgb = malloc((size_t)w * h * 3);
  if (!d->row || !d->rgb) {
    d->st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: JPEG: cannot allocate %u x %u pixels",
                             d->what, (unsigned)w, (unsigned)h);
    return 1;
  }
  while (d->cinfo.output_scanline < h) {
    JSAMPROW rows[1] = {d->row};
    uint32_t y = d->cinfo.output_scanline;
    if (jpeg_read_scanlines(&d->cinfo, rows, 1) != 1) {
      snprintf(d->msg, sizeof d->msg, "no scanline %u", (unsigned)y);
      d->truncated = true;
      return -1;
    }
    row_to_rgb(d->row, d->rgb + (size_t)y * w * 3, w, out_comps);
    d->lines_done = y + 1;
  }
  jpeg_finish_decompress(&d->cinfo);
  return 0;
}

kiln_status_t vimg_decode_jpeg(const uint8_t *data, size_t len, const char *what,
                               const vimg_limits_t *lim, kiln_image_t *out) {
  jpeg_dec_t *d = calloc(1, sizeof *d);
  if (!d) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: JPEG: out of memory", what);
  d->lim = lim;
  d->what = what;
  d->cinfo.err = jpeg_std_error(&d->jerr);
  d->jerr.error_exit = jpeg_on_error;
  d->jerr.emit_message = jpeg_on_message;
  d->jerr.output_message = jpeg_on_output;
  d->progress.progress_monitor = jpeg_on_progress;
  d->cinfo.client_data = d;
  kiln_status_t st = NULL;
  int rc = jpeg_decode_body(d, data, len);
  if (rc > 0) {
    st = d->st;
    d->st = NULL;
  } else if (rc < 0) {
    if (d->truncated && d->cinfo.output_height == 0)
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: truncated JPEG (the data ends after %zu bytes, in the headers)",
                            what, len);
    else if (d->truncated)
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: truncated JPEG (the data ends after %zu bytes, before row %u of "
                            "%u)",
                            what, len, (unsigned)d->lines_done + 1,
                            (unsigned)d->cinfo.output_height);
    else
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: corrupt JPEG: %s", what, d->msg);
  } else {
    out->width = (int32_t)d->cinfo.output_width;
    out->height = (int32_t)d->cinfo.output_height;
    out->rgb = d->rgb;
    d->rgb = NULL;
  }
  if (d->created) jpeg_destroy_decompress(&d->cinfo);
  free(d->row);
  free(d->rgb);
  free(d);
  return st;
}
