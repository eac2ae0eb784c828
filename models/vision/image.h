/* image.h - PNG, JPEG and WebP decoded from memory into 8-bit RGB, as the reference reads them.
 *
 * The reference is what transformers' Qwen2-VL image processor sees: PIL.Image.open(...) then
 * image.convert("RGB") (transformers' convert_to_rgb is exactly that; nothing is composited).
 * So, for every colour type:
 *   - alpha is dropped, not composited on white or black (RGBA, grey+alpha, palette+tRNS,
 *     WebP with alpha: the stored colour of each pixel, whatever its alpha);
 *   - grey (1/2/4/8-bit) is replicated into R = G = B, low bit depths scaled to 0..255;
 *   - palette images are looked up (an index past the PLTE entries reads as black, as in
 *     current Pillow); tRNS alpha tables and colour keys are ignored;
 *   - 16-bit RGB, RGBA and grey+alpha samples keep their high byte (PIL's "RGB;16B" unpacking),
 *     but 16-bit greyscale is clipped to 0..255 (PIL opens it as mode "I;16", whose conversion
 *     to RGB saturates), so a 16-bit grey value of 1000 reads as 255;
 *   - CMYK and YCCK JPEGs are read with Adobe's inverted polarity (PIL's "CMYK;I", always) and
 *     converted as PIL's cmyk2rgb: R = (255 - K) - C * (255 - K) / 255, the product rounded PIL's
 *     way (MULDIV255), likewise G from M and B from Y;
 *   - JPEG is decoded by libjpeg(-turbo) with its defaults (accurate integer IDCT, fancy
 *     upsampling), as Pillow leaves them;
 *   - EXIF orientation is NOT applied (PIL does not apply it unless asked:
 * ImageOps.exif_transpose), and no gamma, ICC profile or colour management is applied. Animated
 * WebP, 2-component JPEG and any other format are refused, naming what was found.
 *
 * Limits: every decode takes a kiln_image_limits_t (NULL = the defaults below); an image whose
 * header declares more pixels or a longer side is refused before anything is allocated for it,
 * as are truncated and corrupt files (libpng's and libjpeg's errors are caught and become a
 * status; nothing longjmps past our cleanup and nothing exits).
 *
 * Ownership: kiln_image_t.rgb is malloc'ed by the decoder and owned by the caller
 * (kiln_image_free). Thread-safety: no shared state; any number of threads may decode at once.
 */
#ifndef KILN_MODELS_VISION_IMAGE_H
#define KILN_MODELS_VISION_IMAGE_H

#include <stddef.h>
#include <stdint.h>

#include "base/status.h"

#define KILN_IMAGE_DEFAULT_MAX_PIXELS (64LL * 1024 * 1024) /* 64 Mpx */
#define KILN_IMAGE_DEFAULT_MAX_SIDE 16384
#define KILN_IMAGE_DEFAULT_MAX_FILE_BYTES ((size_t)256 << 20) /* kiln_image_load_file */
#define KILN_IMAGE_HARD_MAX_SIDE 65535                        /* what any limit may be raised to */

typedef struct kiln_image_limits {
  int64_t max_pixels;    /* width * height at most; <= 0: the default */
  int32_t max_side;      /* width and height at most; <= 0: the default; capped at HARD_MAX */
  size_t max_file_bytes; /* kiln_image_load_file only; 0: the default */
} kiln_image_limits_t;

typedef enum kiln_image_format {
  KILN_IMAGE_FORMAT_UNKNOWN = 0,
  KILN_IMAGE_FORMAT_PNG = 1,
  KILN_IMAGE_FORMAT_JPEG = 2,
  KILN_IMAGE_FORMAT_WEBP = 3,
} kiln_image_format_t;

typedef struct kiln_image {
  int32_t width, height;
  uint8_t *rgb; /* [height, width, 3], row-major, no padding */
} kiln_image_t;

/* The defaults: 64 Mpx, 16384 per side, 256 MiB per file. */
void kiln_image_limits_default(kiln_image_limits_t *out);

/* The format from the first bytes (magic numbers). For a format Kiln does not decode, returns
 * KILN_IMAGE_FORMAT_UNKNOWN and, when out_name is not NULL, sets *out_name to its name ("GIF",
 * "BMP", "TIFF", "AVIF", "HEIC", "ICO", "JPEG XL", "QOI", "PSD", "SVG") or NULL when unknown. */
kiln_image_format_t kiln_image_sniff(const void *data, size_t len, const char **out_name);

/* "PNG", "JPEG", "WebP" or "unknown". */
const char *kiln_image_format_name(kiln_image_format_t f);

/* Decodes len bytes (PNG, JPEG or WebP, told apart by their magic bytes) into *out (zeroed on
 * entry and on error). what names the image in messages ("image 2", a path); NULL reads
 * "image". Errors: KILN_ERR_INVALID_ARGUMENT for empty, truncated or corrupt data and images
 * over the limits ("photo.png: 20000 x 20000 pixels is over the limit of 16384 per side"),
 * KILN_ERR_UNSUPPORTED for another format ("x.gif: GIF images are not supported (PNG, JPEG and
 * WebP are)") or an unsupported variant (animated WebP), KILN_ERR_OUT_OF_MEMORY. */
kiln_status_t kiln_image_decode(const void *data, size_t len, const char *what,
                                const kiln_image_limits_t *limits, kiln_image_t *out);

/* Reads a whole file (at most limits->max_file_bytes) and decodes it; messages name the path.
 * Errors as kiln_image_decode, plus KILN_ERR_NOT_FOUND and KILN_ERR_IO. */
kiln_status_t kiln_image_load_file(const char *path, const kiln_image_limits_t *limits,
                                   kiln_image_t *out);

/* Frees the pixels and zeroes *img; NULL and a zeroed image are no-ops. */
void kiln_image_free(kiln_image_t *img);

/* Resizes with Pillow's BICUBIC filter on uint8 RGB, to the bit: what Image.resize((width,
 * height), Image.BICUBIC) returns for the whole image (see resample.c for the algorithm).
 * *out is zeroed on entry; owned by the caller. Errors: KILN_ERR_INVALID_ARGUMENT (a size < 1
 * or over KILN_IMAGE_HARD_MAX_SIDE), KILN_ERR_OUT_OF_MEMORY. */
kiln_status_t kiln_image_resize_bicubic(const kiln_image_t *in, int32_t width, int32_t height,
                                        kiln_image_t *out);

/* The same on up to `threads` threads (0 = auto: min(4, online CPUs); fewer for a small image):
 * strips of rows of each pass are split between them; the bytes are the same for any count. */
kiln_status_t kiln_image_resize_bicubic_threads(const kiln_image_t *in, int32_t width,
                                                int32_t height, int32_t threads, kiln_image_t *out);

/* XXH3-128 of the width, the height and the RGB bytes: the image's identity for the prefix
 * cache. out[0] is the low 64 bits, out[1] the high. The same pixels give the same hash however
 * they were encoded; any pixel or size difference gives another (collisions are as unlikely as
 * XXH3-128's, about 2^-64 for a birthday pair at 2^32 images). */
void kiln_image_hash(const kiln_image_t *img, uint64_t out[2]);

#endif /* KILN_MODELS_VISION_IMAGE_H */
