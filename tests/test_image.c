/* test_image.c - cmocka tests for models/vision: decoding every colour type against PIL's
 * convert("RGB"), refusals (truncated, corrupt, over the limits, other formats), smart_resize
 * against transformers' own results and hand-worked cases, the resampler's invariants, the patch
 * order against an independent index computation, the config files, the image hash, and the
 * pixel values against transformers' Qwen2VLImageProcessor (max abs error and share of
 * identical values printed for docs/models.md).
 *
 * Goldens: $KILN_IMAGE_GOLDENS, else tests/data/images/goldens (tools/make_image_goldens.py on
 * the GPU machine, transformers 5.x). tests/test_image_pil.sh runs this binary a second time on
 * goldens made at test time by the same script with --source pil (Pillow + numpy, every image
 * through every setting), with KILN_IMAGE_REQUIRE_GOLDENS=1 so that a missing golden fails.
 * KILN_IMAGE_TOLERANCE (default 0: bit-exact) is the max abs error allowed on pixel values. */
#define _POSIX_C_SOURCE 200809L
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/json.h"
#include "base/npy.h"
#include "models/vision/image.h"
#include "models/vision/preproc.h"
#include "models/vision/vision.h"

/* ---- helpers ------------------------------------------------------------------------------ */

static char g_images[4000];  /* tests/data/images */
static char g_goldens[4096]; /* the goldens folder, "" when there is none */

static void *read_all(const char *path, size_t *out_len) {
  FILE *f = fopen(path, "rb");
  if (!f) fail_msg("cannot open %s", path);
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  void *buf = malloc(n > 0 ? (size_t)n : 1);
  assert_non_null(buf);
  assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
  fclose(f);
  *out_len = (size_t)n;
  return buf;
}

static void *read_image_file(const char *name, size_t *out_len) {
  char path[8192];
  snprintf(path, sizeof path, "%s/%s", g_images, name);
  return read_all(path, out_len);
}

static void decode_ok(const char *name, kiln_image_t *img) {
  char path[8192];
  snprintf(path, sizeof path, "%s/%s", g_images, name);
  kiln_status_t st = kiln_image_load_file(path, NULL, img);
  if (st) fail_msg("%s: %s", name, kiln_status_message(st));
}

/* Decodes data and expects a failure with code and a message containing want. */
static void expect_error(const void *data, size_t len, const kiln_image_limits_t *lim,
                         kiln_status_code_t code, const char *want) {
  kiln_image_t img;
  kiln_status_t st = kiln_image_decode(data, len, "test.img", lim, &img);
  if (!st)
    fail_msg("decoded %zu bytes (%d x %d), want an error containing '%s'", len, img.width,
             img.height, want);
  if (kiln_status_code(st) != code || !strstr(kiln_status_message(st), want))
    fail_msg("got %s '%s', want %s containing '%s'", kiln_status_code_name(kiln_status_code(st)),
             kiln_status_message(st), kiln_status_code_name(code), want);
  assert_null(img.rgb);
  assert_int_equal(img.width, 0);
  kiln_status_free(st);
}

/* Binary PPM (P6, maxval 255) as tools/make_image_goldens.py writes it. */
static uint8_t *read_ppm(const char *path, int *w, int *h) {
  size_t n;
  uint8_t *buf = read_all(path, &n);
  int maxval = 0, off = 0;
  if (sscanf((char *)buf, "P6 %d %d %d%n", w, h, &maxval, &off) != 3 || maxval != 255)
    fail_msg("%s: not a P6 PPM", path);
  off++; /* the single whitespace byte after maxval */
  size_t want = (size_t)*w * (size_t)*h * 3;
  if ((size_t)off + want > n) fail_msg("%s: short PPM", path);
  uint8_t *rgb = malloc(want);
  assert_non_null(rgb);
  memcpy(rgb, buf + off, want);
  free(buf);
  return rgb;
}

static bool dir_exists(const char *path) {
  struct stat sb;
  return stat(path, &sb) == 0 && S_ISDIR(sb.st_mode);
}

static bool require_goldens(void) {
  const char *r = getenv("KILN_IMAGE_REQUIRE_GOLDENS");
  return r && *r && strcmp(r, "0") != 0;
}

/* The goldens' manifest, or NULL (and the test skipped) when there are none. */
static kiln_json_doc_t *manifest_or_skip(void) {
  if (!g_goldens[0]) {
    if (require_goldens()) fail_msg("no goldens folder and KILN_IMAGE_REQUIRE_GOLDENS is set");
    print_message("no image goldens (run tools/make_image_goldens.py); skipped\n");
    skip();
  }
  char path[8192];
  snprintf(path, sizeof path, "%s/manifest.json", g_goldens);
  kiln_json_doc_t *doc = NULL;
  kiln_status_t st = kiln_json_parse_file(path, &doc);
  if (st) fail_msg("%s", kiln_status_message(st));
  return doc;
}

static kiln_json_doc_t *images_json(void) {
  char path[8192];
  snprintf(path, sizeof path, "%s/images.json", g_images);
  kiln_json_doc_t *doc = NULL;
  kiln_status_t st = kiln_json_parse_file(path, &doc);
  if (st) fail_msg("%s", kiln_status_message(st));
  return doc;
}

/* ---- decoding ------------------------------------------------------------------------------ */

/* Every committed image decodes to exactly the RGB pixels PIL's convert("RGB") gives. */
static void test_decode_matches_pil(void **state) {
  (void)state;
  kiln_json_doc_t *man = manifest_or_skip();
  kiln_json_doc_t *doc = images_json();
  const kiln_json_t *list = kiln_json_get(kiln_json_root(doc), "images");
  assert_true(kiln_json_len(list) >= 20);
  int checked = 0;
  for (size_t i = 0; i < kiln_json_len(list); i++) {
    const char *name = kiln_json_string(kiln_json_get(kiln_json_at(list, i), "name"), NULL);
    char path[8192];
    snprintf(path, sizeof path, "%s/decoded/%s.ppm", g_goldens, name);
    if (access(path, R_OK) != 0) fail_msg("%s: no decode golden %s", name, path);
    int w, h;
    uint8_t *want = read_ppm(path, &w, &h);
    kiln_image_t img;
    decode_ok(name, &img);
    if (img.width != w || img.height != h)
      fail_msg("%s: decoded %d x %d, PIL %d x %d", name, img.width, img.height, w, h);
    size_t n = (size_t)w * h * 3, diff = 0, first = n;
    for (size_t k = 0; k < n; k++)
      if (img.rgb[k] != want[k]) {
        if (first == n) first = k;
        diff++;
      }
    if (diff)
      fail_msg(
          "%s: %zu of %zu bytes differ from PIL's convert('RGB'); first at pixel (%zu, %zu) "
          "channel %zu: %d, PIL %d",
          name, diff, n, (first / 3) % (size_t)w, (first / 3) / (size_t)w, first % 3,
          img.rgb[first], want[first]);
    checked++;
    free(want);
    kiln_image_free(&img);
  }
  print_message("decode: %d images identical to PIL's convert('RGB')\n", checked);
  kiln_json_doc_free(doc);
  kiln_json_doc_free(man);
}

/* Properties that need no golden: sizes, grey replication, EXIF orientation left alone. */
static void test_decode_basics(void **state) {
  (void)state;
  static const struct {
    const char *name;
    int w, h;
    bool grey;
  } cases[] = {
      {"rgb_odd.png", 61, 47, false},
      {"portrait.jpg", 45, 97, false},
      {"landscape_prog.jpg", 75, 40, false},
      {"lossy.webp", 70, 50, false},
      {"grey.png", 50, 40, true},
      {"grey.jpg", 40, 36, true},
      {"grey1.png", 30, 29, true},
      {"grey2.png", 29, 30, true},
      {"grey16.png", 31, 28, true},
      {"la.png", 33, 29, true},
      {"la16.png", 29, 29, true},
      {"interlaced.png", 37, 41, false},
      {"exif_rot.jpg", 60, 30, false}, /* stored 60 x 30; orientation 6 would make it 30 x 60 */
      {"alpha_lossless.webp", 40, 34, false},
      {"cmyk.jpg", 32, 32, false},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    kiln_image_t img;
    decode_ok(cases[i].name, &img);
    if (img.width != cases[i].w || img.height != cases[i].h)
      fail_msg("%s: %d x %d, want %d x %d", cases[i].name, img.width, img.height, cases[i].w,
               cases[i].h);
    if (cases[i].grey)
      for (int k = 0; k < img.width * img.height; k++)
        if (img.rgb[3 * k] != img.rgb[3 * k + 1] || img.rgb[3 * k] != img.rgb[3 * k + 2])
          fail_msg("%s: pixel %d is not grey", cases[i].name, k);
    kiln_image_free(&img);
  }
  /* 1-bit grey is 0 or 255; 2-bit grey is a multiple of 85; 16-bit grey saturates at 255 (the
   * file holds values up to 765, so some pixels must be 255 and none may wrap around). */
  kiln_image_t img;
  decode_ok("grey1.png", &img);
  for (int k = 0; k < img.width * img.height; k++)
    assert_true(img.rgb[3 * k] == 0 || img.rgb[3 * k] == 255);
  kiln_image_free(&img);
  decode_ok("grey2.png", &img);
  for (int k = 0; k < img.width * img.height; k++) assert_int_equal(img.rgb[3 * k] % 85, 0);
  kiln_image_free(&img);
  decode_ok("grey16.png", &img);
  int saturated = 0;
  for (int k = 0; k < img.width * img.height; k++) saturated += img.rgb[3 * k] == 255;
  assert_true(saturated > img.width * img.height / 4);
  kiln_image_free(&img);
  /* RGBA: alpha is dropped, not composited. Columns 10..29 of rows 10..19 have alpha 0 and
   * the column alpha ramps from 0 at the left edge: composited on white they would all be
   * (255, 255, 255), on black (0, 0, 0); the stored colours vary. */
  decode_ok("rgba.png", &img);
  int white = 0, black = 0, block = 0;
  for (int y = 10; y < 20; y++)
    for (int x = 10; x < 30; x++, block++) {
      const uint8_t *p = img.rgb + ((size_t)y * img.width + x) * 3;
      white += p[0] == 255 && p[1] == 255 && p[2] == 255;
      black += p[0] == 0 && p[1] == 0 && p[2] == 0;
    }
  assert_true(white < block / 2 && black < block / 2);
  kiln_image_free(&img);
}

static void test_sniff(void **state) {
  (void)state;
  const char *name = "x";
  assert_int_equal(kiln_image_sniff("\x89PNG\r\n\x1a\n", 8, &name), KILN_IMAGE_FORMAT_PNG);
  assert_null(name);
  assert_int_equal(kiln_image_sniff("\xff\xd8\xff\xe0", 4, NULL), KILN_IMAGE_FORMAT_JPEG);
  assert_int_equal(kiln_image_sniff("RIFF\x10\0\0\0WEBPVP8 ", 16, NULL), KILN_IMAGE_FORMAT_WEBP);
  assert_int_equal(kiln_image_sniff("RIFF\x10\0\0\0WAVEfmt ", 16, &name),
                   KILN_IMAGE_FORMAT_UNKNOWN);
  assert_null(name);
  assert_int_equal(kiln_image_sniff("GIF89a", 6, &name), KILN_IMAGE_FORMAT_UNKNOWN);
  assert_string_equal(name, "GIF");
  assert_int_equal(kiln_image_sniff("\0\0\0\x1c"
                                    "ftypavif",
                                    12, &name),
                   KILN_IMAGE_FORMAT_UNKNOWN);
  assert_string_equal(name, "AVIF");
  assert_int_equal(kiln_image_sniff("\x89PN", 3, &name), KILN_IMAGE_FORMAT_UNKNOWN);
  assert_int_equal(kiln_image_sniff(NULL, 0, &name), KILN_IMAGE_FORMAT_UNKNOWN);
  assert_string_equal(kiln_image_format_name(KILN_IMAGE_FORMAT_WEBP), "WebP");
}

static void test_refused_formats_and_garbage(void **state) {
  (void)state;
  size_t n;
  void *gif = read_image_file("tiny.gif", &n);
  expect_error(gif, n, NULL, KILN_ERR_UNSUPPORTED, "GIF images are not supported");
  free(gif);
  void *bmp = read_image_file("tiny.bmp", &n);
  expect_error(bmp, n, NULL, KILN_ERR_UNSUPPORTED, "BMP images are not supported");
  free(bmp);
  expect_error("", 0, NULL, KILN_ERR_INVALID_ARGUMENT, "empty image data (0 bytes)");
  expect_error(NULL, 0, NULL, KILN_ERR_INVALID_ARGUMENT, "empty");
  uint8_t junk[512];
  uint32_t x = 12345;
  for (size_t i = 0; i < sizeof junk; i++) {
    x = x * 1103515245u + 12345u;
    junk[i] = (uint8_t)(x >> 24);
  }
  junk[0] = 0x42;
  junk[1] = 0x00;
  expect_error(junk, sizeof junk, NULL, KILN_ERR_UNSUPPORTED, "not a PNG, JPEG or WebP image");
  /* The right magic followed by garbage. */
  memcpy(junk, "\x89PNG\r\n\x1a\n", 8);
  expect_error(junk, sizeof junk, NULL, KILN_ERR_INVALID_ARGUMENT, "corrupt PNG");
  memcpy(junk, "\xff\xd8\xff\xe0", 4);
  expect_error(junk, sizeof junk, NULL, KILN_ERR_INVALID_ARGUMENT, "JPEG");
  memcpy(junk, "RIFF\xf8\x01\0\0WEBPVP8 ", 16);
  expect_error(junk, sizeof junk, NULL, KILN_ERR_INVALID_ARGUMENT, "corrupt WebP");
  /* A missing file. */
  kiln_image_t img;
  kiln_status_t st = kiln_image_load_file("/nonexistent/x.png", NULL, &img);
  assert_int_equal(kiln_status_code(st), KILN_ERR_NOT_FOUND);
  assert_non_null(strstr(kiln_status_message(st), "/nonexistent/x.png"));
  kiln_status_free(st);
}

/* Cut every format at several points before its pixel data ends: always a clean error. */
static void test_truncated(void **state) {
  (void)state;
  static const struct {
    const char *name, *want;
  } files[] = {
      {"rgb_odd.png", "PNG"},
      {"interlaced.png", "PNG"},
      {"rgb16.png", "PNG"},
      {"portrait.jpg", "truncated JPEG"},
      {"landscape_prog.jpg", "truncated JPEG"},
      {"cmyk.jpg", "truncated JPEG"},
      {"lossy.webp", "truncated WebP"},
      {"alpha_lossless.webp", "truncated WebP"},
  };
  for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
    size_t n;
    uint8_t *data = read_image_file(files[i].name, &n);
    /* PNG: IEND (12 bytes) may go missing without harm, as in PIL; cut before it. */
    size_t end = strstr(files[i].want, "PNG") ? n - 12 - 1 : n - 3;
    size_t cuts[] = {4, 9, 30, n / 3, n / 2, end};
    for (size_t c = 0; c < sizeof cuts / sizeof cuts[0]; c++) {
      uint8_t *part = malloc(cuts[c]);
      assert_non_null(part);
      memcpy(part, data, cuts[c]);
      kiln_image_t img;
      kiln_status_t st = kiln_image_decode(part, cuts[c], files[i].name, NULL, &img);
      if (!st) fail_msg("%s cut to %zu of %zu bytes decoded", files[i].name, cuts[c], n);
      if (kiln_status_code(st) != KILN_ERR_INVALID_ARGUMENT ||
          !strstr(kiln_status_message(st), files[i].want) ||
          !strstr(kiln_status_message(st), files[i].name))
        fail_msg("%s cut to %zu: %s", files[i].name, cuts[c], kiln_status_message(st));
      kiln_status_free(st);
      free(part);
    }
    free(data);
  }
  /* The PNG cut only in its IEND chunk still decodes (PIL does not read IEND either). */
  size_t n;
  uint8_t *png = read_image_file("rgb_odd.png", &n);
  kiln_image_t img;
  kiln_status_t st = kiln_image_decode(png, n - 12, "no-iend", NULL, &img);
  if (st) fail_msg("%s", kiln_status_message(st));
  kiln_image_free(&img);
  /* A PNG whose IDAT CRC is wrong is corrupt. */
  uint8_t *bad = malloc(n);
  memcpy(bad, png, n);
  bad[n - 12 - 1] ^= 0x55; /* the last byte of the IDAT CRC */
  expect_error(bad, n, NULL, KILN_ERR_INVALID_ARGUMENT, "corrupt PNG");
  free(bad);
  free(png);
}

/* Random damage (a few bytes overwritten, a run zeroed, a cut) to every committed image:
 * decoding returns an image or a status, never crashes, never leaks (the sanitizer and valgrind
 * runs of this test are what checks that), and a decoded image has a sane size. */
static void test_damaged_files(void **state) {
  (void)state;
  kiln_json_doc_t *doc = images_json();
  const kiln_json_t *list = kiln_json_get(kiln_json_root(doc), "images");
  uint64_t rng = 0x9e3779b97f4a7c15ull;
  int decoded = 0, refused = 0;
  for (size_t i = 0; i < kiln_json_len(list); i++) {
    const char *name = kiln_json_string(kiln_json_get(kiln_json_at(list, i), "name"), NULL);
    size_t n;
    uint8_t *orig = read_image_file(name, &n);
    uint8_t *buf = malloc(n);
    assert_non_null(buf);
    for (int trial = 0; trial < 40; trial++) {
      memcpy(buf, orig, n);
      size_t len = n;
      rng = rng * 6364136223846793005ull + 1442695040888963407ull;
      int kind = (int)(rng >> 61) % 3, hits = 1 + (int)((rng >> 40) % 4);
      for (int h = 0; h < hits; h++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        size_t at = (size_t)(rng >> 33) % n;
        if (kind == 0) {
          buf[at] = (uint8_t)(rng >> 20);
        } else if (kind == 1) {
          size_t run = 1 + (size_t)(rng >> 12) % 64;
          memset(buf + at, 0, at + run <= n ? run : n - at);
        } else {
          buf[at] ^= (uint8_t)(1u << ((rng >> 8) % 8));
          len = n - (size_t)(rng >> 50) % (n / 4 + 1);
        }
      }
      kiln_image_t img;
      kiln_status_t st = kiln_image_decode(buf, len, name, NULL, &img);
      if (st) {
        assert_null(img.rgb);
        refused++;
        kiln_status_free(st);
      } else {
        assert_true(img.width > 0 && img.height > 0 && img.width <= 16384 && img.rgb);
        decoded++;
        kiln_image_free(&img);
      }
    }
    free(buf);
    free(orig);
  }
  print_message("damaged files: %d decoded, %d refused, none crashed\n", decoded, refused);
  assert_true(refused > 0);
  kiln_json_doc_free(doc);
}

static void test_limits(void **state) {
  (void)state;
  size_t n;
  void *huge = read_image_file("huge_dims.png", &n);
  expect_error(huge, n, NULL, KILN_ERR_INVALID_ARGUMENT,
               "PNG image of 20000 x 20000 pixels is over the limit of 16384 pixels per side");
  kiln_image_limits_t lim = {.max_side = 20000};
  expect_error(huge, n, &lim, KILN_ERR_INVALID_ARGUMENT,
               "20000 x 20000 = 400000000 pixels is over the limit of 67108864 pixels");
  free(huge);
  static const char *files[] = {"rgb_odd.png", "portrait.jpg", "lossy.webp"};
  for (size_t i = 0; i < 3; i++) {
    void *data = read_image_file(files[i], &n);
    kiln_image_limits_t side = {.max_side = 44};
    expect_error(data, n, &side, KILN_ERR_INVALID_ARGUMENT, "over the limit of 44 pixels per side");
    kiln_image_limits_t px = {.max_pixels = 1000};
    expect_error(data, n, &px, KILN_ERR_INVALID_ARGUMENT, "pixels is over the limit of 1000");
    kiln_image_limits_t ok = {.max_pixels = 100 * 100, .max_side = 100};
    kiln_image_t img;
    kiln_status_t st = kiln_image_decode(data, n, files[i], &ok, &img);
    if (st) fail_msg("%s", kiln_status_message(st));
    kiln_image_free(&img);
    free(data);
  }
  /* A JPEG whose frame header claims 30000 rows is refused before any pixel is decoded. */
  uint8_t *jpg = read_image_file("portrait.jpg", &n);
  size_t sof = 0;
  for (size_t i = 2; i + 9 < n; i++)
    if (jpg[i] == 0xff && (jpg[i + 1] == 0xc0 || jpg[i + 1] == 0xc2)) {
      sof = i;
      break;
    }
  assert_true(sof > 0);
  jpg[sof + 5] = 30000 >> 8;
  jpg[sof + 6] = 30000 & 0xff;
  expect_error(jpg, n, NULL, KILN_ERR_INVALID_ARGUMENT, "JPEG image of 45 x 30000 pixels");
  free(jpg);
  /* The file-size bound of kiln_image_load_file. */
  char path[8192];
  snprintf(path, sizeof path, "%s/rgb_odd.png", g_images);
  kiln_image_limits_t small = {.max_file_bytes = 100};
  kiln_image_t img;
  kiln_status_t st = kiln_image_load_file(path, &small, &img);
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(kiln_status_message(st), "over the image file limit of 100 bytes"));
  kiln_status_free(st);
}

static void test_hash(void **state) {
  (void)state;
  kiln_image_t a, b;
  decode_ok("rgb_odd.png", &a);
  decode_ok("rgb_odd.png", &b);
  uint64_t ha[2], hb[2];
  kiln_image_hash(&a, ha);
  kiln_image_hash(&b, hb);
  assert_memory_equal(ha, hb, sizeof ha);
  b.rgb[1000] ^= 1; /* one bit of one pixel */
  kiln_image_hash(&b, hb);
  assert_false(ha[0] == hb[0] && ha[1] == hb[1]);
  kiln_image_free(&b);
  /* Same bytes, other shape. */
  uint8_t px[18] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18};
  kiln_image_t s23 = {2, 3, px}, s32 = {3, 2, px};
  kiln_image_hash(&s23, ha);
  kiln_image_hash(&s32, hb);
  assert_false(ha[0] == hb[0] && ha[1] == hb[1]);
  /* The patches carry the decoded image's hash. */
  kiln_vision_preproc_t pp;
  kiln_vision_preproc_default(&pp);
  kiln_image_patches_t p;
  kiln_status_t st = kiln_image_preprocess(&pp, &a, &p);
  if (st) fail_msg("%s", kiln_status_message(st));
  kiln_image_hash(&a, ha);
  assert_memory_equal(p.hash, ha, sizeof ha);
  kiln_image_patches_free(&p);
  /* Different images, different hashes (all the committed ones). */
  static const char *names[] = {"portrait.jpg", "lossy.webp", "grey.png", "rgba.png"};
  for (size_t i = 0; i < 4; i++) {
    decode_ok(names[i], &b);
    kiln_image_hash(&b, hb);
    assert_false(ha[0] == hb[0] && ha[1] == hb[1]);
    kiln_image_free(&b);
  }
  kiln_image_free(&a);
}

/* ---- smart_resize -------------------------------------------------------------------------- */

static void resize_ok(int64_t h, int64_t w, int64_t mn, int64_t mx, int32_t want_h,
                      int32_t want_w) {
  int32_t rh, rw;
  kiln_status_t st = kiln_vision_smart_resize(h, w, 28, mn, mx, &rh, &rw);
  if (st) fail_msg("%lld x %lld: %s", (long long)h, (long long)w, kiln_status_message(st));
  if (rh != want_h || rw != want_w)
    fail_msg("smart_resize(%lld, %lld, min %lld, max %lld) = %d x %d, want %d x %d", (long long)h,
             (long long)w, (long long)mn, (long long)mx, rh, rw, want_h, want_w);
}

/* Worked by hand from transformers' smart_resize. */
static void test_smart_resize_rules(void **state) {
  (void)state;
  const int64_t mn = 56 * 56, mx = 28 * 28 * 1280;
  resize_ok(47, 61, mn, mx, 56, 56);   /* round(1.68) = 2, round(2.18) = 2: 3136, = min */
  resize_ok(97, 45, mn, mx, 84, 56);   /* round(3.46) = 3, round(1.61) = 2 */
  resize_ok(70, 70, mn, mx, 56, 56);   /* 70/28 = 2.5 rounds half to even: 2, not 3 */
  resize_ok(98, 98, mn, mx, 112, 112); /* 98/28 = 3.5 rounds to 4 */
  resize_ok(720, 1280, mn, mx, 728, 1288);
  /* Under min_pixels: scaled up by sqrt(min / area), each side ceil'ed to 28. 40 x 75 rounds to
   * 28 x 84 = 2352 < 3136; beta = sqrt(3136 / 3000): 40 * 1.0224 / 28 = 1.46 -> 2, 75 -> 3. */
  resize_ok(40, 75, mn, mx, 56, 84);
  resize_ok(1, 1, mn, mx, 56, 56);
  /* Over max_pixels: down by sqrt(area / max), floored to 28 (never below 28). 130 x 200 with
   * max 6272: beta = sqrt(26000 / 6272) = 2.036: 130 / 2.036 / 28 = 2.28 -> 56, 200 -> 84. */
  resize_ok(130, 200, mn, 28 * 28 * 8, 56, 84);
  resize_ok(1080, 1920, mn, mx, 728, 1316); /* 756 x 1344 = 1016064 > 1003520 */
  /* 14/28 = 0.5 rounds to 0, so the min branch scales 14 x 2800 up to 28 x 420 = 11760 pixels:
   * over max_pixels, which smart_resize does not look at again. */
  resize_ok(14, 2800, 28 * 28, 28 * 28 * 4, 28, 420);
  resize_ok(8192, 8192, mn, mx, 980, 980);
  /* Aspect ratio: 200 is allowed, anything above is refused, in transformers' words. */
  resize_ok(10, 2000, mn, mx, 28, 812);
  int32_t rh, rw;
  kiln_status_t st = kiln_vision_smart_resize(10, 2001, 28, mn, mx, &rh, &rw);
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  assert_non_null(
      strstr(kiln_status_message(st), "absolute aspect ratio must be smaller than 200"));
  kiln_status_free(st);
  st = kiln_vision_smart_resize(0, 10, 28, mn, mx, &rh, &rw);
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  kiln_status_free(st);
}

/* transformers' smart_resize on a table of sizes and limits (smart_resize.json). */
static void test_smart_resize_table(void **state) {
  (void)state;
  kiln_json_doc_t *man = manifest_or_skip();
  char path[8192];
  snprintf(path, sizeof path, "%s/smart_resize.json", g_goldens);
  kiln_json_doc_t *doc = NULL;
  kiln_status_t st = kiln_json_parse_file(path, &doc);
  if (st) fail_msg("%s", kiln_status_message(st));
  const kiln_json_t *cases = kiln_json_get(kiln_json_root(doc), "cases");
  assert_true(kiln_json_len(cases) > 100);
  int ok = 0, errors = 0;
  for (size_t i = 0; i < kiln_json_len(cases); i++) {
    const kiln_json_t *c = kiln_json_at(cases, i);
    int64_t h, w, f, mn, mx;
    assert_true(kiln_json_int64(kiln_json_get(c, "height"), &h));
    assert_true(kiln_json_int64(kiln_json_get(c, "width"), &w));
    assert_true(kiln_json_int64(kiln_json_get(c, "factor"), &f));
    assert_true(kiln_json_int64(kiln_json_get(c, "min_pixels"), &mn));
    assert_true(kiln_json_int64(kiln_json_get(c, "max_pixels"), &mx));
    int32_t rh, rw;
    st = kiln_vision_smart_resize(h, w, (int32_t)f, mn, mx, &rh, &rw);
    const kiln_json_t *res = kiln_json_get(c, "resized");
    if (res) {
      int64_t wh, ww;
      assert_true(kiln_json_int64(kiln_json_at(res, 0), &wh));
      assert_true(kiln_json_int64(kiln_json_at(res, 1), &ww));
      if (st)
        fail_msg("case %zu (%lld x %lld, %lld..%lld): %s, transformers gives %lld x %lld", i,
                 (long long)h, (long long)w, (long long)mn, (long long)mx, kiln_status_message(st),
                 (long long)wh, (long long)ww);
      if (rh != wh || rw != ww)
        fail_msg("case %zu (%lld x %lld, %lld..%lld): %d x %d, transformers %lld x %lld", i,
                 (long long)h, (long long)w, (long long)mn, (long long)mx, rh, rw, (long long)wh,
                 (long long)ww);
      ok++;
    } else {
      if (!st)
        fail_msg("case %zu (%lld x %lld): %d x %d, transformers raised %s", i, (long long)h,
                 (long long)w, rh, rw, kiln_json_string(kiln_json_get(c, "error"), NULL));
      kiln_status_free(st);
      errors++;
    }
  }
  print_message("smart_resize: %d sizes and %d errors as transformers\n", ok, errors);
  kiln_json_doc_free(doc);
  kiln_json_doc_free(man);
}

/* ---- the resampler ------------------------------------------------------------------------- */

static void test_resize_invariants(void **state) {
  (void)state;
  kiln_image_t img, out;
  decode_ok("rgb_odd.png", &img);
  /* Same size: identical. */
  kiln_status_t st = kiln_image_resize_bicubic(&img, img.width, img.height, &out);
  if (st) fail_msg("%s", kiln_status_message(st));
  assert_memory_equal(out.rgb, img.rgb, (size_t)img.width * img.height * 3);
  kiln_image_free(&out);
  /* A constant image stays constant at any size, up or down. */
  memset(img.rgb, 201, (size_t)img.width * img.height * 3);
  const int32_t sizes[][2] = {{1, 1}, {7, 300}, {300, 7}, {28, 56}, {122, 94}, {61, 47}};
  for (size_t i = 0; i < 6; i++) {
    st = kiln_image_resize_bicubic(&img, sizes[i][0], sizes[i][1], &out);
    if (st) fail_msg("%s", kiln_status_message(st));
    for (size_t k = 0; k < (size_t)out.width * out.height * 3; k++)
      if (out.rgb[k] != 201)
        fail_msg("%d x %d: byte %zu is %d", out.width, out.height, k, out.rgb[k]);
    kiln_image_free(&out);
  }
  st = kiln_image_resize_bicubic(&img, 0, 5, &out);
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  kiln_status_free(st);
  kiln_image_free(&img);
}

/* Pillow's Image.resize((w, h), BICUBIC) at odd sizes (the resize/ folder): identical bytes. */
static void test_resize_matches_pil(void **state) {
  (void)state;
  kiln_json_doc_t *man = manifest_or_skip();
  const kiln_json_t *list = kiln_json_get(kiln_json_root(man), "resizes");
  if (!list && !require_goldens()) {
    /* Goldens made before the script recorded resizes: the Pillow run (test_image_pil) has them. */
    print_message("no resize goldens in this manifest; skipped\n");
    kiln_json_doc_free(man);
    skip();
  }
  assert_true(kiln_json_len(list) >= 10);
  for (size_t i = 0; i < kiln_json_len(list); i++) {
    const kiln_json_t *r = kiln_json_at(list, i);
    const char *image = kiln_json_string(kiln_json_get(r, "image"), NULL);
    const char *file = kiln_json_string(kiln_json_get(r, "file"), NULL);
    int64_t w, h;
    assert_true(kiln_json_int64(kiln_json_get(r, "width"), &w));
    assert_true(kiln_json_int64(kiln_json_get(r, "height"), &h));
    char path[8192];
    if (snprintf(path, sizeof path, "%s/%s", g_goldens, file) >= (int)sizeof path) fail();
    int pw, ph;
    uint8_t *want = read_ppm(path, &pw, &ph);
    assert_int_equal(pw, w);
    assert_int_equal(ph, h);
    kiln_image_t img, out;
    decode_ok(image, &img);
    /* one thread, and three: the passes' rows split between threads (strips cut short) */
    for (int32_t threads = 1; threads <= 3; threads += 2) {
      kiln_status_t st =
          kiln_image_resize_bicubic_threads(&img, (int32_t)w, (int32_t)h, threads, &out);
      if (st) fail_msg("%s", kiln_status_message(st));
      size_t n = (size_t)w * (size_t)h * 3, diff = 0;
      for (size_t k = 0; k < n; k++) diff += out.rgb[k] != want[k];
      if (diff)
        fail_msg("%s -> %lld x %lld on %d threads: %zu of %zu bytes differ from Pillow", image,
                 (long long)w, (long long)h, (int)threads, diff, n);
      kiln_image_free(&out);
    }
    free(want);
    kiln_image_free(&img);
  }
  print_message("resize: %zu sizes identical to Pillow's BICUBIC (1 and 3 threads)\n",
                kiln_json_len(list));
  kiln_json_doc_free(man);
}

/* Any thread count gives the one-thread bytes: sizes around the strip height (16 rows), one
 * pass or both, up and down, on more threads than rows. */
static void test_resize_threads(void **state) {
  (void)state;
  kiln_image_t img;
  decode_ok("big_landscape.png", &img); /* 200 x 130 */
  const int32_t sizes[][2] = {{213, 140}, {200, 17},  {199, 130}, {64, 15},   {333, 16},
                              {7, 33},    {200, 131}, {1, 130},   {400, 260}, {57, 1}};
  const int32_t threads[] = {0, 2, 3, 5, 8, 32};
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    kiln_image_t one, many;
    kiln_status_t st = kiln_image_resize_bicubic(&img, sizes[i][0], sizes[i][1], &one);
    if (st) fail_msg("%s", kiln_status_message(st));
    for (size_t t = 0; t < sizeof threads / sizeof threads[0]; t++) {
      st = kiln_image_resize_bicubic_threads(&img, sizes[i][0], sizes[i][1], threads[t], &many);
      if (st) fail_msg("%s", kiln_status_message(st));
      assert_int_equal(many.width, sizes[i][0]);
      assert_int_equal(many.height, sizes[i][1]);
      if (memcmp(one.rgb, many.rgb, (size_t)sizes[i][0] * sizes[i][1] * 3))
        fail_msg("%d x %d on %d threads differs from one thread", sizes[i][0], sizes[i][1],
                 threads[t]);
      kiln_image_free(&many);
    }
    kiln_image_free(&one);
  }
  kiln_image_free(&img);
}

/* The whole preprocessing on 1, 2 and 7 threads: the same floats. */
static void test_preprocess_threads(void **state) {
  (void)state;
  const char *names[] = {"big_landscape.png", "portrait.jpg"};
  for (size_t i = 0; i < 2; i++) {
    kiln_image_t img;
    decode_ok(names[i], &img);
    kiln_vision_preproc_t pp;
    kiln_vision_preproc_default(&pp);
    pp.min_pixels = 224 * 224; /* large enough for several rows of merge windows */
    kiln_image_patches_t ref, p;
    pp.threads = 1;
    kiln_status_t st = kiln_image_preprocess(&pp, &img, &ref);
    if (st) fail_msg("%s", kiln_status_message(st));
    assert_true(ref.grid_h >= 8);
    for (int32_t t = 2; t <= 7; t += 5) {
      pp.threads = t;
      st = kiln_image_preprocess(&pp, &img, &p);
      if (st) fail_msg("%s", kiln_status_message(st));
      assert_int_equal(p.num_patches, ref.num_patches);
      if (memcmp(p.pixels, ref.pixels, sizeof(float) * (size_t)(ref.num_patches * ref.patch_dim)))
        fail_msg("%s: the patches on %d threads differ from one thread's", names[i], (int)t);
      assert_memory_equal(p.hash, ref.hash, sizeof p.hash);
      kiln_image_patches_free(&p);
    }
    kiln_image_patches_free(&ref);
    kiln_image_free(&img);
  }
}

/* kiln_vision_host_rows against the image itself: with resize, rescale and normalize off each
 * pixel's red byte is its patch row and its green byte its patch column, so every row the
 * tower gets says where its patch lies; its rotary row must be the cos/sin of exactly those
 * (float32 frequencies as PyTorch's VisionRotaryEmbedding, the angle rounded to float32).
 * Qwen2-VL's order (the processor's) and Qwen2.5-VL's windows (4 x 4 merge units). */
static void test_vision_host_rows(void **state) {
  (void)state;
  const int W = 13 * 28, H = 9 * 28; /* grid 18 x 26 patches, 9 x 13 merge units */
  kiln_image_t img = {W, H, malloc((size_t)W * H * 3)};
  for (int y = 0; y < H; y++)
    for (int x = 0; x < W; x++) {
      uint8_t *p = img.rgb + ((size_t)y * W + x) * 3;
      p[0] = (uint8_t)(y / 14);
      p[1] = (uint8_t)(x / 14);
      p[2] = 7;
    }
  kiln_vision_preproc_t pp;
  kiln_vision_preproc_default(&pp);
  pp.do_resize = pp.do_rescale = pp.do_normalize = false;
  kiln_image_patches_t pt;
  kiln_status_t st = kiln_image_preprocess(&pp, &img, &pt);
  if (st) fail_msg("%s", kiln_status_message(st));
  const int64_t N = pt.num_patches, K = pt.patch_dim, Dv = 80, q = Dv / 4, U = 4;
  const double theta = 10000.0;
  float inv[20];
  for (int f = 0; f < q; f++) {
    float e = (float)(2 * f) / (float)(Dv / 2);
    inv[f] = 1.0f / (float)pow((double)(float)theta, (double)e);
  }
  float *pix = malloc(sizeof(float) * (size_t)(N * K)),
        *rope = malloc(sizeof(float) * (size_t)(N * Dv));
  int32_t *order = malloc(sizeof(int32_t) * (size_t)(N / U));
  int64_t *lens = malloc(sizeof(int64_t) * (size_t)(1 + N / U));
  kiln_vision_image_t vi = {pt.pixels, 1, pt.grid_h, pt.grid_w};
  for (int32_t vw = 0; vw <= 4; vw += 4) {
    st = kiln_vision_host_rows(&vi, 1, 2, vw, K, Dv, theta, pix, rope, order, lens);
    if (st) fail_msg("%s", kiln_status_message(st));
    assert_int_equal(lens[0], N);
    int64_t nwin = 0, sum = 0;
    if (vw) {
      nwin = ((9 + 3) / 4) * ((13 + 3) / 4); /* 3 x 4 windows, the last row and column cut */
      for (int64_t w = 0; w < nwin; w++) sum += lens[1 + w];
      assert_int_equal(sum, N);
      assert_int_equal(lens[1], 4 * 4 * U);
      assert_int_equal(lens[1 + nwin - 1], 1 * 1 * U); /* the corner: 1 x 1 unit */
    }
    int64_t win = 0, in_win = 0;
    for (int64_t r = 0; r < N; r++) {
      const float *row = pix + r * K;
      const int h = (int)row[0], w = (int)row[14 * 14 * 2]; /* the first pixel's red, green */
      for (int64_t e = 0; e < K; e += 97) /* the whole patch is one patch's pixels */
        assert_true(row[e] == (e < 392 ? (float)h : e < 784 ? (float)w : 7.0f));
      /* rows run merge unit by merge unit: 2 x 2 patches, row-major */
      const int64_t first = r - r % U;
      assert_int_equal(h, (int)pix[first * K] + (int)(r % U) / 2);
      assert_int_equal(w, (int)pix[first * K + 392] + (int)(r % U) % 2);
      if (vw) { /* and window by window: every unit of a window inside its 8 x 8 patches */
        const int wh = (int)pix[(r - in_win) * K] / 8, ww = (int)pix[(r - in_win) * K + 392] / 8;
        assert_int_equal(h / 8, wh);
        assert_int_equal(w / 8, ww);
        if (++in_win == lens[1 + win]) {
          win++;
          in_win = 0;
        }
      } else if (r > 0 && r % U == 0) { /* without windows: the processor's order itself */
        assert_true(memcmp(row, pt.pixels + r * K, sizeof(float) * (size_t)K) == 0);
      }
      for (int64_t f = 0; f < q; f++) {
        const float a = (float)h * inv[f], b = (float)w * inv[f];
        const float *rr = rope + r * Dv;
        if (rr[f] != (float)cos((double)a) || rr[q + f] != (float)cos((double)b) ||
            rr[2 * q + f] != (float)sin((double)a) || rr[3 * q + f] != (float)sin((double)b))
          fail_msg("window %d: row %lld (patch %d, %d) frequency %lld: rotary %g %g %g %g", vw,
                   (long long)r, h, w, (long long)f, rr[f], rr[q + f], rr[2 * q + f],
                   rr[3 * q + f]);
      }
    }
    if (vw) assert_int_equal(win, nwin);
  }
  st = kiln_vision_host_rows(&vi, 1, 2, 0, K, 78, theta, pix, rope, order, lens);
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  kiln_status_free(st);
  free(pix);
  free(rope);
  free(order);
  free(lens);
  kiln_image_patches_free(&pt);
  free(img.rgb);
}

/* ---- patches ------------------------------------------------------------------------------- */

/* With resize, rescale and normalize off, every value is a pixel byte; check each one's place
 * from the flat index alone, decomposed the other way round from preproc.c's loops. */
static void test_patch_order(void **state) {
  (void)state;
  const int W = 84, H = 56; /* 3 x 2 merge windows of 2 x 2 patches of 14 x 14 */
  kiln_image_t img = {W, H, malloc((size_t)W * H * 3)};
  for (int y = 0; y < H; y++)
    for (int x = 0; x < W; x++)
      for (int c = 0; c < 3; c++)
        img.rgb[(y * W + x) * 3 + c] = (uint8_t)((y * 7 + x * 3 + c * 101) % 251);
  kiln_vision_preproc_t pp;
  kiln_vision_preproc_default(&pp);
  pp.do_resize = pp.do_rescale = pp.do_normalize = false;
  kiln_image_patches_t p;
  kiln_status_t st = kiln_image_preprocess(&pp, &img, &p);
  if (st) fail_msg("%s", kiln_status_message(st));
  assert_int_equal(p.grid_t, 1);
  assert_int_equal(p.grid_h, 4);
  assert_int_equal(p.grid_w, 6);
  assert_int_equal(p.num_patches, 24);
  assert_int_equal(p.patch_dim, 1176);
  assert_int_equal(kiln_image_num_tokens(&p, 2), 6);
  for (int64_t idx = 0; idx < p.num_patches * p.patch_dim; idx++) {
    int64_t patch = idx / 1176, e = idx % 1176;
    int px = (int)(e % 14), py = (int)(e / 14 % 14), c = (int)(e / (14 * 14 * 2));
    /* patch = ((window_row * 3 + window_col) * 2 + row_in_window) * 2 + col_in_window */
    int mw = (int)(patch % 2), mh = (int)(patch / 2 % 2), win = (int)(patch / 4);
    int wy = win / 3, wx = win % 3;
    int y = (wy * 2 + mh) * 14 + py, x = (wx * 2 + mw) * 14 + px;
    float want = img.rgb[(y * W + x) * 3 + c];
    if (p.pixels[idx] != want)
      fail_msg("value %lld (patch %lld, elem %lld): %g, want pixel (%d, %d) channel %d = %g",
               (long long)idx, (long long)patch, (long long)e, p.pixels[idx], x, y, c, want);
  }
  kiln_image_patches_free(&p);
  /* Without resize, a side that is not a multiple of 28 is refused. */
  img.width = 70;
  st = kiln_image_preprocess(&pp, &img, &p);
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(kiln_status_message(st), "multiple of patch_size * merge_size = 28"));
  kiln_status_free(st);
  free(img.rgb);
}

/* Rescale and normalize: float64 product cast to float32, then float32 arithmetic. */
static void test_normalize_values(void **state) {
  (void)state;
  kiln_image_t img = {56, 56, malloc(56 * 56 * 3)};
  for (int k = 0; k < 56 * 56 * 3; k++) img.rgb[k] = (uint8_t)(k % 256);
  kiln_vision_preproc_t pp;
  kiln_vision_preproc_default(&pp);
  kiln_image_patches_t p;
  kiln_status_t st = kiln_image_preprocess(&pp, &img, &p);
  if (st) fail_msg("%s", kiln_status_message(st));
  assert_int_equal(p.num_patches, 16);
  /* Patch 0, channel 0, time 0, row 0, column 0 is pixel (0, 0) channel 0, value 0. */
  volatile float x = (float)(0.0 * (1.0 / 255.0));
  float want0 = (x - (float)0.48145466) / (float)0.26862954;
  assert_true(p.pixels[0] == want0);
  /* Time 1 repeats time 0. */
  for (int k = 0; k < 196; k++) assert_true(p.pixels[k] == p.pixels[196 + k]);
  /* Pixel (1, 0) channel 1 (byte 4): patch 0, channel 1, time 0, row 0, column 1. */
  x = (float)(4.0 * (1.0 / 255.0));
  float want = (x - (float)0.4578275) / (float)0.26130258;
  assert_true(p.pixels[2 * 196 + 1] == want);
  kiln_image_patches_free(&p);
  free(img.rgb);
}

/* ---- settings files ------------------------------------------------------------------------ */

static char g_tmp[4096];

static void write_file(const char *dir, const char *name, const char *text) {
  char path[8192];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  for (const char *s = text; *s; s++) fputc(*s == '\'' ? '"' : *s, f);
  fclose(f);
}

static void remove_file(const char *dir, const char *name) {
  char path[8192];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  unlink(path);
}

static kiln_status_t load_text(const char *file, const char *text, kiln_vision_preproc_t *pp) {
  remove_file(g_tmp, "preprocessor_config.json");
  remove_file(g_tmp, "processor_config.json");
  write_file(g_tmp, file, text);
  return kiln_vision_preproc_load(g_tmp, pp);
}

static void expect_config_error(const char *file, const char *text, kiln_status_code_t code,
                                const char *want) {
  kiln_vision_preproc_t pp;
  kiln_status_t st = load_text(file, text, &pp);
  if (!st) fail_msg("accepted: %s", text);
  if (kiln_status_code(st) != code || !strstr(kiln_status_message(st), want))
    fail_msg("got '%s', want '%s'", kiln_status_message(st), want);
  kiln_status_free(st);
}

static void test_config_files(void **state) {
  (void)state;
  snprintf(g_tmp, sizeof g_tmp, "/tmp/kiln_test_image_XXXXXX");
  assert_non_null(mkdtemp(g_tmp));
  kiln_vision_preproc_t pp;
  /* Neither file: NOT_FOUND. */
  kiln_status_t st = kiln_vision_preproc_load(g_tmp, &pp);
  assert_int_equal(kiln_status_code(st), KILN_ERR_NOT_FOUND);
  assert_non_null(strstr(kiln_status_message(st), "preprocessor_config.json"));
  kiln_status_free(st);
  /* Qwen2-VL-7B-Instruct's published preprocessor_config.json. */
  st = load_text("preprocessor_config.json",
                 "{'min_pixels': 3136, 'max_pixels': 12845056, 'patch_size': 14, "
                 "'temporal_patch_size': 2, 'merge_size': 2, 'image_mean': [0.48145466, "
                 "0.4578275, 0.40821073], 'image_std': [0.26862954, 0.26130258, 0.27577711], "
                 "'image_processor_type': 'Qwen2VLImageProcessor', 'processor_class': "
                 "'Qwen2VLProcessor'}",
                 &pp);
  if (st) fail_msg("%s", kiln_status_message(st));
  assert_int_equal(pp.min_pixels, 3136);
  assert_int_equal(pp.max_pixels, 12845056);
  assert_true(pp.do_resize && pp.do_rescale && pp.do_normalize && pp.do_convert_rgb);
  assert_true(pp.rescale_factor == 1.0 / 255.0);
  assert_true(pp.image_std[2] == 0.27577711);
  assert_non_null(strstr(pp.source, "preprocessor_config.json"));
  /* transformers 5.x: size {shortest_edge, longest_edge}, nested in processor_config.json. */
  st = load_text("processor_config.json",
                 "{'image_processor': {'size': {'shortest_edge': 1000, 'longest_edge': 5000}, "
                 "'rescale_factor': 0.00392156862745098, 'resample': 3, 'do_resize': true}, "
                 "'processor_class': 'Qwen2VLProcessor'}",
                 &pp);
  if (st) fail_msg("%s", kiln_status_message(st));
  assert_int_equal(pp.min_pixels, 1000);
  assert_int_equal(pp.max_pixels, 5000);
  assert_true(pp.rescale_factor == 1.0 / 255.0);
  /* min_pixels/max_pixels override size; transformers 4.45's size {min_pixels, max_pixels}. */
  st =
      load_text("preprocessor_config.json",
                "{'size': {'shortest_edge': 1000, 'longest_edge': 5000}, 'max_pixels': 9000}", &pp);
  if (st) fail_msg("%s", kiln_status_message(st));
  assert_int_equal(pp.min_pixels, 1000);
  assert_int_equal(pp.max_pixels, 9000);
  st = load_text("preprocessor_config.json", "{'size': {'min_pixels': 100, 'max_pixels': 200}}",
                 &pp);
  if (st) fail_msg("%s", kiln_status_message(st));
  assert_int_equal(pp.min_pixels, 100);
  assert_int_equal(pp.max_pixels, 200);
  /* Both files: preprocessor_config.json wins, as in transformers. */
  remove_file(g_tmp, "processor_config.json");
  write_file(g_tmp, "processor_config.json", "{'image_processor': {'max_pixels': 7777}}");
  write_file(g_tmp, "preprocessor_config.json", "{'max_pixels': 8888}");
  st = kiln_vision_preproc_load(g_tmp, &pp);
  if (st) fail_msg("%s", kiln_status_message(st));
  assert_int_equal(pp.max_pixels, 8888);
  /* Nulls read as absent. */
  st = load_text("preprocessor_config.json", "{'min_pixels': null, 'image_mean': null}", &pp);
  if (st) fail_msg("%s", kiln_status_message(st));
  assert_int_equal(pp.min_pixels, 3136);
  /* Refusals name the file and the key. */
  expect_config_error("preprocessor_config.json", "{'patch_size': '14'}", KILN_ERR_INVALID_ARGUMENT,
                      "patch_size: want an integer, got a string");
  expect_config_error("preprocessor_config.json", "{'image_mean': [0.5, 0.5]}",
                      KILN_ERR_INVALID_ARGUMENT, "image_mean has 2 values, want 3");
  expect_config_error("preprocessor_config.json", "{'image_std': [0.5, 0, 0.5]}",
                      KILN_ERR_INVALID_ARGUMENT, "image_std[1] = 0");
  expect_config_error("preprocessor_config.json", "{'resample': 2}", KILN_ERR_UNSUPPORTED,
                      "resample = 2 (bilinear) is not supported");
  expect_config_error("preprocessor_config.json", "{'do_rescale': 1}", KILN_ERR_INVALID_ARGUMENT,
                      "do_rescale: want true or false");
  expect_config_error("preprocessor_config.json", "{'min_pixels': 9000, 'max_pixels': 100}",
                      KILN_ERR_INVALID_ARGUMENT, "min_pixels 9000 is more than max_pixels 100");
  expect_config_error("preprocessor_config.json", "{'size': {'height': 224, 'width': 224}}",
                      KILN_ERR_INVALID_ARGUMENT, "size must contain 'shortest_edge'");
  expect_config_error("processor_config.json", "{'image_processor': [1]}",
                      KILN_ERR_INVALID_ARGUMENT, "image_processor: want an object");
  expect_config_error("preprocessor_config.json", "{'max_pixels': 5,}", KILN_ERR_INVALID_ARGUMENT,
                      "preprocessor_config.json");
  remove_file(g_tmp, "preprocessor_config.json");
  remove_file(g_tmp, "processor_config.json");
  rmdir(g_tmp);
}

/* The processors' own save_pretrained output loads to the settings they were made with. */
static void test_saved_configs(void **state) {
  (void)state;
  kiln_json_doc_t *man = manifest_or_skip();
  const kiln_json_t *procs = kiln_json_get(kiln_json_root(man), "processors");
  assert_true(kiln_json_len(procs) >= 3);
  for (size_t i = 0; i < kiln_json_len(procs); i++) {
    const char *pname = kiln_json_key_at(procs, i, NULL);
    const kiln_json_t *lim = kiln_json_value_at(procs, i);
    int64_t mn, mx;
    assert_true(kiln_json_int64(kiln_json_get(lim, "min_pixels"), &mn));
    assert_true(kiln_json_int64(kiln_json_get(lim, "max_pixels"), &mx));
    char dir[8192];
    snprintf(dir, sizeof dir, "%s/proc_%s", g_goldens, pname);
    kiln_vision_preproc_t pp;
    kiln_status_t st = kiln_vision_preproc_load(dir, &pp);
    if (st) fail_msg("%s", kiln_status_message(st));
    assert_int_equal(pp.min_pixels, mn);
    assert_int_equal(pp.max_pixels, mx);
    assert_int_equal(pp.patch_size, 14);
    assert_int_equal(pp.merge_size, 2);
    assert_true(pp.rescale_factor == 1.0 / 255.0);
  }
  /* A whole Qwen2VLProcessor saved by transformers 5.x (processor_config.json), when the golden
   * run could build one: small_max's limits. */
  char dir[8192];
  snprintf(dir, sizeof dir, "%s/proc_processor", g_goldens);
  char cfg[8300];
  snprintf(cfg, sizeof cfg, "%s/processor_config.json", dir);
  if (access(cfg, R_OK) == 0) {
    kiln_vision_preproc_t pp;
    kiln_status_t st = kiln_vision_preproc_load(dir, &pp);
    if (st) fail_msg("%s", kiln_status_message(st));
    assert_int_equal(pp.min_pixels, 56 * 56);
    assert_int_equal(pp.max_pixels, 28 * 28 * 8);
    print_message("processor config: %s loads\n", pp.source);
  }
  kiln_json_doc_free(man);
}

/* ---- pixel values against transformers ----------------------------------------------------- */

static void test_pixel_values(void **state) {
  (void)state;
  kiln_json_doc_t *man = manifest_or_skip();
  const char *tol_env = getenv("KILN_IMAGE_TOLERANCE");
  const double tol = tol_env ? atof(tol_env) : 0.0;
  const kiln_json_t *root = kiln_json_root(man);
  const kiln_json_t *goldens = kiln_json_get(root, "goldens");
  assert_true(kiln_json_len(goldens) >= 10);
  const char *source = kiln_json_string(kiln_json_get(root, "source"), NULL);
  const char *tv = kiln_json_string(kiln_json_get(root, "transformers_version"), NULL);
  double worst = 0;
  int64_t total = 0, same = 0;
  for (size_t i = 0; i < kiln_json_len(goldens); i++) {
    const kiln_json_t *g = kiln_json_at(goldens, i);
    const char *image = kiln_json_string(kiln_json_get(g, "image"), NULL);
    const char *pname = kiln_json_string(kiln_json_get(g, "processor"), NULL);
    const char *file = kiln_json_string(kiln_json_get(g, "file"), NULL);
    const kiln_json_t *grid = kiln_json_get(g, "image_grid_thw");
    int64_t gt, gh, gw;
    assert_true(kiln_json_int64(kiln_json_at(grid, 0), &gt) &&
                kiln_json_int64(kiln_json_at(grid, 1), &gh) &&
                kiln_json_int64(kiln_json_at(grid, 2), &gw));
    char path[8192];
    snprintf(path, sizeof path, "%s/proc_%s", g_goldens, pname);
    kiln_vision_preproc_t pp;
    kiln_status_t st = kiln_vision_preproc_load(path, &pp);
    if (st) fail_msg("%s", kiln_status_message(st));
    kiln_image_t img;
    decode_ok(image, &img);
    kiln_image_patches_t p;
    st = kiln_image_preprocess(&pp, &img, &p);
    if (st) fail_msg("%s under %s: %s", image, pname, kiln_status_message(st));
    if (p.grid_t != gt || p.grid_h != gh || p.grid_w != gw)
      fail_msg("%s under %s: grid %d %d %d, transformers %lld %lld %lld", image, pname, p.grid_t,
               p.grid_h, p.grid_w, (long long)gt, (long long)gh, (long long)gw);
    if (snprintf(path, sizeof path, "%s/%s", g_goldens, file) >= (int)sizeof path) fail();
    float *want = NULL;
    int64_t rows = 0, cols = 0;
    st = kiln_npy_read_f32(path, &want, &rows, &cols);
    if (st) fail_msg("%s", kiln_status_message(st));
    if (rows != p.num_patches || cols != p.patch_dim)
      fail_msg("%s: golden [%lld, %lld], Kiln [%lld, %lld]", file, (long long)rows, (long long)cols,
               (long long)p.num_patches, (long long)p.patch_dim);
    double maxd = 0;
    int64_t n = rows * cols, eq = 0, at = -1;
    for (int64_t k = 0; k < n; k++) {
      double d = fabs((double)p.pixels[k] - (double)want[k]);
      if (p.pixels[k] == want[k]) eq++;
      if (d > maxd) {
        maxd = d;
        at = k;
      }
    }
    print_message("%-10s %-22s grid %lld x %lld: max abs err %.3g, identical %.4f%%\n", pname,
                  image, (long long)gh, (long long)gw, maxd, 100.0 * (double)eq / (double)n);
    if (maxd > tol)
      fail_msg("%s under %s: max abs error %.6g at %lld (Kiln %.9g, reference %.9g) > %g", image,
               pname, maxd, (long long)at, p.pixels[at], want[at], tol);
    if (maxd > worst) worst = maxd;
    total += n;
    same += eq;
    free(want);
    kiln_image_patches_free(&p);
    kiln_image_free(&img);
  }
  print_message(
      "pixel values vs %s%s%s: %zu goldens, %lld values, max abs err %.3g, identical "
      "%.4f%%\n",
      source ? source : "?", tv ? " " : "", tv ? tv : "", kiln_json_len(goldens), (long long)total,
      worst, 100.0 * (double)same / (double)total);
  kiln_json_doc_free(man);
}

static int setup(void **state) {
  (void)state;
  const char *src = getenv("KILN_SOURCE_DIR");
  if (!src) src = ".";
  snprintf(g_images, sizeof g_images, "%s/tests/data/images", src);
  const char *g = getenv("KILN_IMAGE_GOLDENS");
  if (g && *g)
    snprintf(g_goldens, sizeof g_goldens, "%s", g);
  else
    snprintf(g_goldens, sizeof g_goldens, "%s/goldens", g_images);
  if (!dir_exists(g_goldens)) g_goldens[0] = 0;
  return 0;
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_sniff),
      cmocka_unit_test(test_decode_basics),
      cmocka_unit_test(test_decode_matches_pil),
      cmocka_unit_test(test_refused_formats_and_garbage),
      cmocka_unit_test(test_truncated),
      cmocka_unit_test(test_damaged_files),
      cmocka_unit_test(test_limits),
      cmocka_unit_test(test_hash),
      cmocka_unit_test(test_smart_resize_rules),
      cmocka_unit_test(test_smart_resize_table),
      cmocka_unit_test(test_resize_invariants),
      cmocka_unit_test(test_resize_matches_pil),
      cmocka_unit_test(test_resize_threads),
      cmocka_unit_test(test_preprocess_threads),
      cmocka_unit_test(test_vision_host_rows),
      cmocka_unit_test(test_patch_order),
      cmocka_unit_test(test_normalize_values),
      cmocka_unit_test(test_config_files),
      cmocka_unit_test(test_saved_configs),
      cmocka_unit_test(test_pixel_values),
  };
  return cmocka_run_group_tests(tests, setup, NULL);
}
