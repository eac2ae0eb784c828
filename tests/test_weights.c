/* test_weights.c - cmocka tests for models/loader (safetensors): small files written here,
 * lookup, shapes and mapped data, conversion against hal_util.h on random values, sharded
 * checkpoints, and every malformed-file error with the file and tensor it must name. */
#define _POSIX_C_SOURCE 200809L
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/strbuf.h"
#include "kiln/hal_util.h"
#include "models/loader/weights.h"

/* ---- a temporary directory per test ---------------------------------------------------------- */

static char g_dir[64];

static int make_dir(void **state) {
  (void)state;
  snprintf(g_dir, sizeof(g_dir), "/tmp/kiln_weights_XXXXXX");
  return mkdtemp(g_dir) ? 0 : -1;
}

static int remove_dir(void **state) {
  (void)state;
  DIR *d = opendir(g_dir);
  if (!d) return -1;
  struct dirent *e;
  char path[512];
  while ((e = readdir(d))) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
    snprintf(path, sizeof(path), "%s/%s", g_dir, e->d_name);
    unlink(path);
  }
  closedir(d);
  return rmdir(g_dir);
}

/* g_dir/name, in a rotating static buffer (a few may be live at once). */
static const char *in_dir(const char *name) {
  static char bufs[4][512];
  static int next;
  char *b = bufs[next++ % 4];
  snprintf(b, 512, "%s/%s", g_dir, name);
  return b;
}

static void write_bytes(const char *path, const void *data, size_t len) {
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  assert_int_equal(fwrite(data, 1, len, f), len);
  assert_int_equal(fclose(f), 0);
}

static void write_text(const char *path, const char *text) {
  write_bytes(path, text, strlen(text));
}

/* ---- a safetensors writer ----------------------------------------------------------------------
 */

typedef struct st_file {
  kiln_strbuf_t header; /* the JSON members, without the braces */
  kiln_strbuf_t data;
  bool misalign; /* pad the header with spaces so the data region starts at an odd offset */
} st_file_t;

#define ST_AUTO LLONG_MIN

/* Adds a tensor with data_offsets [begin, end); begin = ST_AUTO appends bytes at the end of the
 * data region and uses their range. shape_json is the shape as written ("[2, 3]"). */
static void st_add_at(st_file_t *f, const char *name, const char *dtype, const char *shape_json,
                      const void *bytes, size_t nbytes, long long begin, long long end) {
  if (begin == ST_AUTO) {
    begin = (long long)f->data.len;
    end = begin + (long long)nbytes;
    if (nbytes)
      assert_true(kiln_strbuf_append(&f->data, bytes, nbytes));
    else
      assert_true(kiln_strbuf_reserve(&f->data, 1));
  }
  if (f->header.len) kiln_strbuf_append_char(&f->header, ',');
  kiln_strbuf_printf(&f->header,
                     "\"%s\":{\"dtype\":\"%s\",\"shape\":%s,\"data_offsets\":[%lld,%lld]}", name,
                     dtype, shape_json, begin, end);
  assert_true(kiln_strbuf_ok(&f->header));
}

static void st_add(st_file_t *f, const char *name, const char *dtype, const char *shape_json,
                   const void *bytes, size_t nbytes) {
  st_add_at(f, name, dtype, shape_json, bytes, nbytes, ST_AUTO, 0);
}

/* Writes the file; header_len 0 = the true length; drop removes that many bytes from the end. */
static void st_write_ex(st_file_t *f, const char *path, uint64_t header_len, size_t drop) {
  kiln_strbuf_t out = KILN_STRBUF_INIT;
  kiln_strbuf_t hdr = KILN_STRBUF_INIT;
  kiln_strbuf_printf(&hdr, "{\"__metadata__\":{\"format\":\"pt\"}%s%s}", f->header.len ? "," : "",
                     kiln_strbuf_cstr(&f->header));
  while (f->misalign && (8 + hdr.len) % 8 != 1) kiln_strbuf_append_char(&hdr, ' ');
  uint64_t n = header_len ? header_len : hdr.len;
  uint8_t le[8];
  for (int i = 0; i < 8; i++) le[i] = (uint8_t)(n >> (8 * i));
  kiln_strbuf_append(&out, le, 8);
  kiln_strbuf_append(&out, hdr.data, hdr.len);
  if (f->data.len) kiln_strbuf_append(&out, f->data.data, f->data.len);
  assert_true(kiln_strbuf_ok(&out) && kiln_strbuf_ok(&hdr));
  assert_true(drop <= out.len);
  write_bytes(path, out.data, out.len - drop);
  kiln_strbuf_free(&out);
  kiln_strbuf_free(&hdr);
}

static void st_write(st_file_t *f, const char *path) { st_write_ex(f, path, 0, 0); }

static void st_free(st_file_t *f) {
  kiln_strbuf_free(&f->header);
  kiln_strbuf_free(&f->data);
}

/* ---- random values ----------------------------------------------------------------------------
 */

static uint64_t g_rng;

static uint32_t rnd(void) {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return (uint32_t)(g_rng >> 16);
}

static void seed_rng(void) {
  const char *s = getenv("KILN_TEST_SEED");
  g_rng = s ? strtoull(s, NULL, 10) : (uint64_t)time(NULL);
  if (!g_rng) g_rng = 1;
  print_message("seed %llu (set KILN_TEST_SEED to repeat)\n", (unsigned long long)g_rng);
}

/* A float spread over many magnitudes, with a few special values mixed in. */
static float rnd_float(void) {
  static const uint32_t specials[] = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u,
                                      0x7fc00000u, 0x00000001u, 0x477ff000u, 0x477fefffu,
                                      0x33000000u, 0x3f808000u, 0x3f818000u, 0x387fc000u};
  uint32_t r = rnd();
  if (r % 16 == 0) return kiln_hal_bits_to_f32(specials[rnd() % 12]);
  float mant = (float)(rnd() & 0xffffff) / 16777216.0f + 0.5f;
  int e = (int)(rnd() % 48) - 30;
  float v = mant;
  for (; e > 0; e--) v *= 2;
  for (; e < 0; e++) v /= 2;
  return (r & 1) ? -v : v;
}

/* ---- helpers for results ----------------------------------------------------------------------
 */

static kiln_weights_t *open_file(const char *path) {
  kiln_weights_t *w = NULL;
  kiln_status_t st = kiln_weights_open_safetensors(path, &w);
  if (st) fail_msg("open %s: %s", path, kiln_status_message(st));
  assert_non_null(w);
  return w;
}

/* Expects st to be an error of this code whose message contains every needle (NULL-ended). */
static void expect_status(kiln_status_t st, kiln_status_code_t code, ...) {
  if (!st) fail_msg("expected an error, got success");
  const char *msg = kiln_status_message(st);
  if (kiln_status_code(st) != code)
    fail_msg("expected code %s, got %s: %s", kiln_status_code_name(code),
             kiln_status_code_name(kiln_status_code(st)), msg);
  va_list ap;
  va_start(ap, code);
  for (const char *needle; (needle = va_arg(ap, const char *));)
    if (!strstr(msg, needle)) fail_msg("message lacks \"%s\": %s", needle, msg);
  va_end(ap);
  kiln_status_free(st);
}

static void expect_open_error(const char *path, kiln_status_code_t code, const char *n1,
                              const char *n2, const char *n3) {
  kiln_weights_t *w = (kiln_weights_t *)(uintptr_t)1;
  kiln_status_t st = kiln_weights_open_safetensors(path, &w);
  assert_null(w);
  expect_status(st, code, n1, n2, n3, (const char *)NULL);
}

static void expect_dir_error(kiln_status_code_t code, const char *n1, const char *n2,
                             const char *n3) {
  kiln_weights_t *w = (kiln_weights_t *)(uintptr_t)1;
  kiln_status_t st = kiln_weights_open_dir(g_dir, &w);
  assert_null(w);
  expect_status(st, code, n1, n2, n3, (const char *)NULL);
}

/* ---- tests ------------------------------------------------------------------------------------
 */

static void test_single_file(void **state) {
  (void)state;
  float a[6] = {1, -2, 3.5f, 0, 1e-3f, -7};
  uint16_t b[4] = {0x3c00, 0xc000, 0x7bff, 0x0001}; /* f16 1, -2, 65504, 2^-24 */
  uint16_t c[12];
  for (int i = 0; i < 12; i++) c[i] = kiln_hal_f32_to_bf16((float)i - 5.5f);
  float s = 42;
  st_file_t f = {0};
  st_add(&f, "model.a", "F32", "[2, 3]", a, sizeof(a));
  st_add(&f, "model.b", "F16", "[4]", b, sizeof(b));
  st_add(&f, "model.layers.0.c", "BF16", "[3, 2, 2]", c, sizeof(c));
  st_add(&f, "scalar", "F32", "[]", &s, sizeof(s));
  st_add(&f, "empty", "BF16", "[0, 8]", NULL, 0);
  st_write(&f, in_dir("model.safetensors"));
  st_free(&f);

  kiln_weights_t *w = open_file(in_dir("model.safetensors"));
  assert_int_equal(kiln_weights_count(w), 5);
  const kiln_weight_t *t = kiln_weights_find(w, "model.a");
  assert_non_null(t);
  assert_string_equal(t->name, "model.a");
  assert_int_equal(t->type, KILN_WTYPE_F32);
  assert_int_equal(t->ndim, 2);
  assert_int_equal(t->shape[0], 2);
  assert_int_equal(t->shape[1], 3);
  assert_int_equal(t->numel, 6);
  assert_int_equal(t->nbytes, sizeof(a));
  assert_memory_equal(t->data, a, sizeof(a));
  assert_non_null(strstr(t->file, "model.safetensors"));
  assert_ptr_equal(kiln_weights_at(w, 0), t);

  t = kiln_weights_find(w, "model.b");
  assert_non_null(t);
  /* Both point into one mapping of the file, as far apart as their offsets: nothing copied. */
  assert_int_equal(t->data - kiln_weights_find(w, "model.a")->data, sizeof(a));
  assert_int_equal(t->type, KILN_WTYPE_F16);
  assert_int_equal(t->ndim, 1);
  assert_int_equal(t->shape[0], 4);
  assert_memory_equal(t->data, b, sizeof(b));

  t = kiln_weights_find(w, "model.layers.0.c");
  assert_non_null(t);
  assert_int_equal(t->type, KILN_WTYPE_BF16);
  assert_int_equal(t->ndim, 3);
  assert_int_equal(t->shape[0], 3);
  assert_int_equal(t->shape[2], 2);
  assert_int_equal(t->numel, 12);
  assert_memory_equal(t->data, c, sizeof(c));
  float back[12];
  assert_null(kiln_weight_convert(t, 0, 12, KILN_HAL_F32, back));
  for (int i = 0; i < 12; i++) assert_true(back[i] == (float)i - 5.5f);

  t = kiln_weights_find(w, "scalar"); /* shape [] reads as [1] */
  assert_non_null(t);
  assert_int_equal(t->ndim, 1);
  assert_int_equal(t->shape[0], 1);
  assert_int_equal(t->numel, 1);
  t = kiln_weights_find(w, "empty");
  assert_non_null(t);
  assert_int_equal(t->numel, 0);
  assert_int_equal(t->nbytes, 0);
  assert_null(kiln_weight_convert(t, 0, 0, KILN_HAL_F32, NULL));

  assert_null(kiln_weights_find(w, "model.c"));
  assert_null(kiln_weights_find(w, ""));
  assert_null(kiln_weights_at(w, -1));
  assert_null(kiln_weights_at(w, 5));
  for (int64_t i = 0; i < kiln_weights_count(w); i++)
    assert_ptr_equal(kiln_weights_find(w, kiln_weights_at(w, i)->name), kiln_weights_at(w, i));
  kiln_weights_free(w);

  /* The same file through the directory entry point. */
  w = NULL;
  assert_null(kiln_weights_open_dir(g_dir, &w));
  assert_int_equal(kiln_weights_count(w), 5);
  kiln_weights_free(w);
  kiln_weights_free(NULL);
}

/* Many tensors: the index grows and every one is still found. */
static void test_many_tensors(void **state) {
  (void)state;
  st_file_t f = {0};
  enum { N = 1000 };
  for (int i = 0; i < N; i++) {
    char name[64];
    float v = (float)i;
    snprintf(name, sizeof(name), "model.layers.%d.w", i);
    st_add(&f, name, "F32", "[1]", &v, sizeof(v));
  }
  st_write(&f, in_dir("many.safetensors"));
  st_free(&f);
  kiln_weights_t *w = open_file(in_dir("many.safetensors"));
  assert_int_equal(kiln_weights_count(w), N);
  for (int i = 0; i < N; i++) {
    char name[64];
    snprintf(name, sizeof(name), "model.layers.%d.w", i);
    const kiln_weight_t *t = kiln_weights_find(w, name);
    assert_non_null(t);
    float v;
    memcpy(&v, t->data, 4);
    assert_true(v == (float)i);
  }
  kiln_weights_free(w);
}

/* The reference: element i of a source in its stored form, converted with hal_util.h alone.
 * The same type is copied bit for bit (NaN payloads included). */
static void reference_convert(int32_t src_type, const void *src, int64_t i, int32_t dst_dtype,
                              void *dst, int64_t j) {
  if (src_type == dst_dtype) {
    size_t es = kiln_hal_dtype_size(dst_dtype);
    memcpy((uint8_t *)dst + j * (int64_t)es, (const uint8_t *)src + i * (int64_t)es, es);
    return;
  }
  float x;
  if (src_type == KILN_WTYPE_F32) {
    x = ((const float *)src)[i];
  } else {
    uint16_t h = ((const uint16_t *)src)[i];
    x = src_type == KILN_WTYPE_F16 ? kiln_hal_f16_to_f32(h) : kiln_hal_bf16_to_f32(h);
  }
  if (dst_dtype == KILN_HAL_F32) ((float *)dst)[j] = x;
  if (dst_dtype == KILN_HAL_F16) ((uint16_t *)dst)[j] = kiln_hal_f32_to_f16(x);
  if (dst_dtype == KILN_HAL_BF16) ((uint16_t *)dst)[j] = kiln_hal_f32_to_bf16(x);
}

static void test_convert(void **state) {
  (void)state;
  seed_rng();
  enum { N = 4099 };
  float *f32 = malloc(N * 4);
  uint16_t *f16 = malloc(N * 2), *bf16 = malloc(N * 2);
  assert_true(f32 && f16 && bf16);
  for (int i = 0; i < N; i++) {
    f32[i] = rnd_float();
    f16[i] = (uint16_t)rnd(); /* every bit pattern: subnormals, infinities, NaNs */
    bf16[i] = (uint16_t)rnd();
  }
  /* The data region starts at an odd offset: conversion must not assume aligned sources. */
  st_file_t f = {.misalign = true};
  st_add(&f, "f32", "F32", "[4099]", f32, N * 4);
  st_add(&f, "f16", "F16", "[4099]", f16, N * 2);
  st_add(&f, "bf16", "BF16", "[4099]", bf16, N * 2);
  st_write(&f, in_dir("conv.safetensors"));
  st_free(&f);
  kiln_weights_t *w = open_file(in_dir("conv.safetensors"));

  const char *names[3] = {"f32", "f16", "bf16"};
  const void *srcs[3] = {f32, f16, bf16};
  int32_t dsts[3] = {KILN_HAL_F32, KILN_HAL_F16, KILN_HAL_BF16};
  uint8_t *got = malloc(N * 4), *want = malloc(N * 4);
  assert_true(got && want);
  for (int s = 0; s < 3; s++) {
    const kiln_weight_t *t = kiln_weights_find(w, names[s]);
    assert_non_null(t);
    assert_int_equal(t->type, s); /* KILN_WTYPE_F32/F16/BF16 */
    for (int d = 0; d < 3; d++) {
      size_t es = kiln_hal_dtype_size(dsts[d]);
      /* The whole tensor, then ranges that start and end at odd places. */
      const int64_t ranges[][2] = {{0, N}, {1, 1000}, {4098, 1}, {17, 4082}, {5, 0}};
      for (size_t r = 0; r < sizeof(ranges) / sizeof(ranges[0]); r++) {
        int64_t first = ranges[r][0], n = ranges[r][1];
        memset(got, 0xa5, N * 4);
        memset(want, 0xa5, N * 4);
        for (int64_t i = 0; i < n; i++) reference_convert(s, srcs[s], first + i, dsts[d], want, i);
        kiln_status_t st = kiln_weight_convert(t, first, n, dsts[d], got);
        if (st) fail_msg("%s -> %d: %s", names[s], dsts[d], kiln_status_message(st));
        if (memcmp(got, want, N * es) != 0) {
          for (int64_t i = 0; i < n; i++)
            if (memcmp(got + i * es, want + i * es, es) != 0)
              fail_msg("%s -> %s, range [%lld, +%lld): element %lld differs", names[s],
                       kiln_hal_dtype_name(dsts[d]), (long long)first, (long long)n,
                       (long long)(first + i));
          fail_msg("%s -> %s wrote past its range", names[s], kiln_hal_dtype_name(dsts[d]));
        }
      }
    }
    /* Errors: ranges outside the tensor, a non-float destination. */
    expect_status(kiln_weight_convert(t, 0, N + 1, KILN_HAL_F32, got), KILN_ERR_INVALID_ARGUMENT,
                  names[s], "conv.safetensors", (const char *)NULL);
    expect_status(kiln_weight_convert(t, N, 1, KILN_HAL_F32, got), KILN_ERR_INVALID_ARGUMENT,
                  names[s], (const char *)NULL);
    expect_status(kiln_weight_convert(t, -1, 1, KILN_HAL_F32, got), KILN_ERR_INVALID_ARGUMENT,
                  names[s], (const char *)NULL);
    expect_status(kiln_weight_convert(t, 1, INT64_MAX, KILN_HAL_F32, got),
                  KILN_ERR_INVALID_ARGUMENT, names[s], (const char *)NULL);
    expect_status(kiln_weight_convert(t, 0, 1, 99, got), KILN_ERR_INVALID_ARGUMENT, names[s],
                  (const char *)NULL);
  }
  free(got);
  free(want);
  free(f32);
  free(f16);
  free(bf16);
  kiln_weights_free(w);
}

static void test_wtype_names(void **state) {
  (void)state;
  assert_string_equal(kiln_wtype_name(KILN_WTYPE_F32), "f32");
  assert_string_equal(kiln_wtype_name(KILN_WTYPE_F16), "f16");
  assert_string_equal(kiln_wtype_name(KILN_WTYPE_BF16), "bf16");
  assert_string_equal(kiln_wtype_name(KILN_WTYPE_Q8_0), "q8_0");
  assert_string_equal(kiln_wtype_name(KILN_WTYPE_I32), "i32");
  assert_non_null(kiln_wtype_name(99));
}

/* I32 tensors (GPTQ / AWQ qweight, qzeros, g_idx) load as they are and never convert. */
static void test_i32(void **state) {
  (void)state;
  int32_t q[6] = {0x76543210, -1, 2, 3, 4, 5};
  st_file_t f = {0};
  st_add(&f, "m.qweight", "I32", "[2, 3]", q, sizeof(q));
  st_write(&f, in_dir("i32.safetensors"));
  st_free(&f);
  kiln_weights_t *w = open_file(in_dir("i32.safetensors"));
  const kiln_weight_t *t = kiln_weights_find(w, "m.qweight");
  assert_non_null(t);
  assert_int_equal(t->type, KILN_WTYPE_I32);
  assert_int_equal(t->numel, 6);
  assert_int_equal(t->nbytes, sizeof(q));
  assert_memory_equal(t->data, q, sizeof(q));
  float out[6];
  expect_status(kiln_weight_convert(t, 0, 6, KILN_HAL_F32, out), KILN_ERR_INVALID_ARGUMENT,
                "m.qweight", "i32", (const char *)NULL);
  kiln_weights_free(w);
}

/* F8_E4M3 / F8_E5M2 tensors (FP8 checkpoints' codes) load as they are, one byte per element,
 * and never convert (their scales are separate tensors: models/qlinear.c). */
static void test_f8(void **state) {
  (void)state;
  uint8_t q[6] = {0x38, 0xB8, 0x7E, 0x01, 0x08, 0x00};
  st_file_t f = {0};
  st_add(&f, "m.weight", "F8_E4M3", "[2, 3]", q, sizeof(q));
  st_add(&f, "m2.weight", "F8_E5M2", "[6]", q, sizeof(q));
  st_write(&f, in_dir("f8.safetensors"));
  st_free(&f);
  kiln_weights_t *w = open_file(in_dir("f8.safetensors"));
  const kiln_weight_t *t = kiln_weights_find(w, "m.weight");
  assert_non_null(t);
  assert_int_equal(t->type, KILN_WTYPE_F8_E4M3);
  assert_int_equal(t->numel, 6);
  assert_int_equal(t->nbytes, 6);
  assert_memory_equal(t->data, q, sizeof(q));
  assert_string_equal(kiln_wtype_name(t->type), "f8_e4m3");
  float out[6];
  expect_status(kiln_weight_convert(t, 0, 6, KILN_HAL_F32, out), KILN_ERR_INVALID_ARGUMENT,
                "m.weight", "f8_e4m3", "scales", (const char *)NULL);
  t = kiln_weights_find(w, "m2.weight");
  assert_non_null(t);
  assert_int_equal(t->type, KILN_WTYPE_F8_E5M2);
  assert_string_equal(kiln_wtype_name(t->type), "f8_e5m2");
  kiln_weights_free(w);
  /* A byte count that disagrees with one byte per element. */
  memset(&f, 0, sizeof(f));
  st_add(&f, "m.weight", "F8_E4M3", "[2, 4]", q, sizeof(q));
  st_write(&f, in_dir("f8bad.safetensors"));
  st_free(&f);
  expect_open_error(in_dir("f8bad.safetensors"), KILN_ERR_INVALID_ARGUMENT, "m.weight", NULL, NULL);
}

static void test_expect_shape(void **state) {
  (void)state;
  float z[6] = {0};
  st_file_t f = {0};
  st_add(&f, "model.layers.3.mlp.up_proj.weight", "F32", "[2, 3]", z, sizeof(z));
  st_write(&f, in_dir("shape.safetensors"));
  st_free(&f);
  kiln_weights_t *w = open_file(in_dir("shape.safetensors"));
  const kiln_weight_t *t = kiln_weights_find(w, "model.layers.3.mlp.up_proj.weight");
  assert_non_null(t);
  assert_null(kiln_weight_expect_shape(t, 2, (const int64_t[]){2, 3}));
  expect_status(kiln_weight_expect_shape(t, 2, (const int64_t[]){3, 2}), KILN_ERR_INVALID_ARGUMENT,
                "shape.safetensors", "model.layers.3.mlp.up_proj.weight",
                "has shape [2, 3], want [3, 2]", (const char *)NULL);
  expect_status(kiln_weight_expect_shape(t, 1, (const int64_t[]){6}), KILN_ERR_INVALID_ARGUMENT,
                "has shape [2, 3], want [6]", (const char *)NULL);
  expect_status(kiln_weight_expect_shape(t, 3, (const int64_t[]){2, 3, 1}),
                KILN_ERR_INVALID_ARGUMENT, "want [2, 3, 1]", (const char *)NULL);
  kiln_weights_free(w);
}

/* Two shards and an index; the index also carries metadata. */
static void write_two_shards(const char *extra_in_first) {
  float a[4] = {1, 2, 3, 4}, b[2] = {5, 6}, c[3] = {7, 8, 9};
  st_file_t f1 = {0}, f2 = {0};
  st_add(&f1, "model.a", "F32", "[2, 2]", a, sizeof(a));
  st_add(&f1, "model.b", "F32", "[2]", b, sizeof(b));
  if (extra_in_first) st_add(&f1, extra_in_first, "F32", "[3]", c, sizeof(c));
  st_add(&f2, "model.c", "F32", "[3]", c, sizeof(c));
  st_write(&f1, in_dir("model-00001-of-00002.safetensors"));
  st_write(&f2, in_dir("model-00002-of-00002.safetensors"));
  st_free(&f1);
  st_free(&f2);
}

static void write_index(const char *weight_map) {
  char text[1024];
  snprintf(text, sizeof(text), "{\"metadata\":{\"total_size\":36},\"weight_map\":{%s}}",
           weight_map);
  write_text(in_dir("model.safetensors.index.json"), text);
}

#define GOOD_MAP                                      \
  "\"model.a\":\"model-00001-of-00002.safetensors\"," \
  "\"model.b\":\"model-00001-of-00002.safetensors\"," \
  "\"model.c\":\"model-00002-of-00002.safetensors\""

static void test_sharded(void **state) {
  (void)state;
  write_two_shards(NULL);
  write_index(GOOD_MAP);
  kiln_weights_t *w = NULL;
  kiln_status_t st = kiln_weights_open_dir(g_dir, &w);
  if (st) fail_msg("%s", kiln_status_message(st));
  assert_int_equal(kiln_weights_count(w), 3);
  const kiln_weight_t *a = kiln_weights_find(w, "model.a"), *c = kiln_weights_find(w, "model.c");
  assert_non_null(a);
  assert_non_null(c);
  assert_non_null(strstr(a->file, "model-00001-of-00002.safetensors"));
  assert_non_null(strstr(c->file, "model-00002-of-00002.safetensors"));
  float v[3];
  assert_null(kiln_weight_convert(c, 0, 3, KILN_HAL_F32, v));
  assert_true(v[0] == 7 && v[1] == 8 && v[2] == 9);
  assert_int_equal(a->shape[0], 2);
  kiln_weights_free(w);
  /* The index wins over a model.safetensors beside it. */
  st_file_t f = {0};
  st_add(&f, "other", "F32", "[1]", v, 4);
  st_write(&f, in_dir("model.safetensors"));
  st_free(&f);
  assert_null(kiln_weights_open_dir(g_dir, &w));
  assert_null(kiln_weights_find(w, "other"));
  assert_non_null(kiln_weights_find(w, "model.b"));
  kiln_weights_free(w);
}

static void test_shard_errors(void **state) {
  (void)state;
  /* No weights at all: both names are listed. */
  expect_dir_error(KILN_ERR_NOT_FOUND, "model.safetensors.index.json", "looked for", g_dir);
  kiln_weights_t *w = (kiln_weights_t *)(uintptr_t)1;
  expect_status(kiln_weights_open_dir("/nonexistent/kiln/model", &w), KILN_ERR_NOT_FOUND,
                "/nonexistent/kiln/model", (const char *)NULL);
  assert_null(w);

  /* A missing shard: named with a tensor it holds. */
  write_two_shards(NULL);
  write_index(GOOD_MAP ",\"model.d\":\"model-00003-of-00003.safetensors\"");
  expect_dir_error(KILN_ERR_NOT_FOUND, "model-00003-of-00003.safetensors", "model.d", g_dir);

  /* The index names a tensor its shard lacks: one that lives in the other shard... */
  write_index(
      "\"model.a\":\"model-00001-of-00002.safetensors\","
      "\"model.b\":\"model-00002-of-00002.safetensors\","
      "\"model.c\":\"model-00002-of-00002.safetensors\"");
  expect_dir_error(KILN_ERR_INVALID_ARGUMENT, "model.b", "model-00001-of-00002.safetensors",
                   "model-00002-of-00002.safetensors");
  write_index(
      "\"model.a\":\"model-00001-of-00002.safetensors\","
      "\"model.c\":\"model-00001-of-00002.safetensors\"");
  expect_dir_error(KILN_ERR_INVALID_ARGUMENT, "model.c", "model-00001-of-00002.safetensors",
                   "index.json");
  /* ... or one that no shard has. */
  write_index(GOOD_MAP ",\"model.zzz\":\"model-00002-of-00002.safetensors\"");
  expect_dir_error(KILN_ERR_INVALID_ARGUMENT, "model.zzz", "model-00002-of-00002.safetensors",
                   "index.json");

  /* The same tensor in two shards. */
  write_two_shards("model.c");
  write_index(GOOD_MAP);
  expect_dir_error(KILN_ERR_INVALID_ARGUMENT, "model.c", "model-00001-of-00002.safetensors",
                   "model-00002-of-00002.safetensors");

  /* Shard names that lead out of the directory. */
  write_two_shards(NULL);
  const char *bad[] = {
      "../model-00001-of-00002.safetensors", "sub/x.safetensors", "..", ".", "/etc/passwd", ""};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    char map[512];
    snprintf(map, sizeof(map), GOOD_MAP ",\"model.evil\":\"%s\"", bad[i]);
    write_index(map);
    expect_dir_error(KILN_ERR_INVALID_ARGUMENT, "model.evil", "index.json", bad[i]);
  }

  /* Malformed indexes. */
  write_text(in_dir("model.safetensors.index.json"), "{\"weight_map\": [");
  expect_dir_error(KILN_ERR_INVALID_ARGUMENT, "model.safetensors.index.json", "line 1", NULL);
  write_text(in_dir("model.safetensors.index.json"), "{\"metadata\": {}}");
  expect_dir_error(KILN_ERR_INVALID_ARGUMENT, "weight_map", NULL, NULL);
  write_text(in_dir("model.safetensors.index.json"), "{\"weight_map\": {}}");
  expect_dir_error(KILN_ERR_INVALID_ARGUMENT, "weight_map", NULL, NULL);
  write_text(in_dir("model.safetensors.index.json"), "{\"weight_map\": {\"model.a\": 3}}");
  expect_dir_error(KILN_ERR_INVALID_ARGUMENT, "model.a", NULL, NULL);
  write_index(GOOD_MAP);
  assert_null(kiln_weights_open_dir(g_dir, &w));
  kiln_weights_free(w);
}

static void test_file_errors(void **state) {
  (void)state;
  const char *path = in_dir("bad.safetensors");
  float a[6] = {1, 2, 3, 4, 5, 6};
  int64_t i64[2] = {1, 2};

  expect_open_error("/nonexistent/kiln/x.safetensors", KILN_ERR_NOT_FOUND,
                    "/nonexistent/kiln/x.safetensors", NULL, NULL);
  expect_open_error(g_dir, KILN_ERR_IO, g_dir, NULL, NULL); /* a directory */

  /* Shorter than the length field; empty. */
  write_bytes(path, "\x02\0\0", 3);
  expect_open_error(path, KILN_ERR_INVALID_ARGUMENT, "bad.safetensors", "truncated", NULL);
  write_bytes(path, "", 0);
  expect_open_error(path, KILN_ERR_INVALID_ARGUMENT, "bad.safetensors", "truncated", NULL);

  /* Data beyond the end of the file: names the file, tensor, byte range and file size. */
  st_file_t f = {0};
  st_add(&f, "model.ok", "F32", "[1]", a, 4);
  st_add(&f, "model.layers.7.mlp.up_proj.weight", "F32", "[2, 3]", a, sizeof(a));
  st_write_ex(&f, path, 0, 5);
  char hdr[256];
  snprintf(hdr, sizeof(hdr), "{\"__metadata__\":{\"format\":\"pt\"},%s}",
           kiln_strbuf_cstr(&f.header));
  size_t start = 8 + strlen(hdr), size = start + 28 - 5;
  char range[96], fsize[64];
  snprintf(range, sizeof(range), "[%zu, %zu)", start + 4, start + 28);
  snprintf(fsize, sizeof(fsize), "(%zu bytes)", size);
  kiln_weights_t *w = (kiln_weights_t *)(uintptr_t)1;
  kiln_status_t st = kiln_weights_open_safetensors(path, &w);
  assert_null(w);
  expect_status(st, KILN_ERR_INVALID_ARGUMENT, "bad.safetensors",
                "model.layers.7.mlp.up_proj.weight", "truncated", range, fsize, (const char *)NULL);

  /* The header length runs past the file. */
  st_write_ex(&f, path, 1u << 20, 0);
  expect_open_error(path, KILN_ERR_INVALID_ARGUMENT, "bad.safetensors", "1048576", "header");
  st_write_ex(&f, path, UINT64_MAX, 0);
  expect_open_error(path, KILN_ERR_INVALID_ARGUMENT, "bad.safetensors", "header", NULL);
  /* ... or stops inside the JSON. */
  st_write_ex(&f, path, 20, 0);
  expect_open_error(path, KILN_ERR_INVALID_ARGUMENT, "bad.safetensors", "line 1", NULL);
  st_free(&f);

  /* Malformed JSON headers. */
  const char *bad_headers[] = {"{\"a\": {\"dtype\": \"F32\",}}", "{\"a\": 1", "[1, 2]", "nope"};
  for (size_t i = 0; i < sizeof(bad_headers) / sizeof(bad_headers[0]); i++) {
    size_t n = strlen(bad_headers[i]);
    uint8_t buf[128] = {(uint8_t)n};
    memcpy(buf + 8, bad_headers[i], n);
    write_bytes(path, buf, 8 + n);
    expect_open_error(path, KILN_ERR_INVALID_ARGUMENT, "bad.safetensors", NULL, NULL);
  }

  /* A dtype other than F32/F16/BF16. */
  const char *dtypes[] = {"I64", "F8_E4M3FNUZ", "BOOL", "F64", "U8"};
  for (size_t i = 0; i < sizeof(dtypes) / sizeof(dtypes[0]); i++) {
    memset(&f, 0, sizeof(f));
    st_add(&f, "model.pos_ids", dtypes[i], "[2]", i64, sizeof(i64));
    st_write(&f, path);
    st_free(&f);
    expect_open_error(path, KILN_ERR_INVALID_ARGUMENT, "model.pos_ids", dtypes[i], "F32, F16");
  }

  /* Offsets that disagree with the shape, end before they begin, overlap, or lie outside. */
  struct {
    const char *shape;
    long long begin, end;
    const char *needle;
  } cases[] = {
      {"[2, 3]", 0, 20, "model.w"}, /* 20 bytes for 6 f32 */
      {"[2, 3]", 0, 28, "model.w"},
      {"[2, 3]", 24, 0, "model.w"}, /* end < begin */
      {"[2, 3]", 8, 32, "overlap"}, /* model.first [0, 24), model.tail [24, 48) */
      {"[2, 3]", 20, 44, "overlap"},
      {"[2, 3]", 48, 72, "truncated"}, /* beyond the data region */
      {"[2, -3]", 24, 48, "shape"},
      {"[2, 3.5]", 24, 48, "shape"},
      {"[1, 1, 1, 1, 1, 6]", 24, 48, "6 dimensions"},
      {"\"x\"", 24, 48, "shape"},
      {"[4611686018427387904, 4]", 24, 48, "model.w"},
      {"[2, 3]", -5, 19, "data_offsets"},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    memset(&f, 0, sizeof(f));
    st_add(&f, "model.first", "F32", "[2, 3]", a, sizeof(a));
    st_add(&f, "model.tail", "F32", "[2, 3]", a, sizeof(a));
    st_add_at(&f, "model.w", "F32", cases[i].shape, NULL, 0, cases[i].begin, cases[i].end);
    st_write(&f, path);
    st_free(&f);
    expect_open_error(path, KILN_ERR_INVALID_ARGUMENT, "bad.safetensors", "model.w",
                      cases[i].needle);
  }
  /* The overlap message names both tensors. */
  memset(&f, 0, sizeof(f));
  st_add(&f, "model.first", "F32", "[2, 3]", a, sizeof(a));
  st_add_at(&f, "model.w", "F32", "[2]", NULL, 0, 16, 24);
  st_write(&f, path);
  st_free(&f);
  expect_open_error(path, KILN_ERR_INVALID_ARGUMENT, "model.first", "model.w", "overlap");

  /* Entries that are not objects or lack fields; a tensor listed twice in one header. */
  const char *bad_entries[] = {
      "\"model.w\": 3",
      "\"model.w\": {\"shape\": [1], \"data_offsets\": [0, 4]}",
      "\"model.w\": {\"dtype\": \"F32\", \"data_offsets\": [0, 4]}",
      "\"model.w\": {\"dtype\": \"F32\", \"shape\": [1]}",
      "\"model.w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0]}",
      "\"model.w\": {\"dtype\": 1, \"shape\": [1], \"data_offsets\": [0, 4]}",
      "\"model.w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]},"
      "\"model.w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}",
  };
  for (size_t i = 0; i < sizeof(bad_entries) / sizeof(bad_entries[0]); i++) {
    char json[512];
    int n = snprintf(json, sizeof(json), "{%s}", bad_entries[i]);
    uint8_t buf[600] = {(uint8_t)n};
    memcpy(buf + 8, json, (size_t)n);
    memcpy(buf + 8 + n, a, 8);
    write_bytes(path, buf, 8 + (size_t)n + 8);
    expect_open_error(path, KILN_ERR_INVALID_ARGUMENT, "bad.safetensors", "model.w", NULL);
  }
}

/* Every proper prefix of a valid file is refused, cleanly (ASan watches the reads). */
static void test_every_truncation(void **state) {
  (void)state;
  float a[6] = {1, 2, 3, 4, 5, 6};
  uint16_t b[3] = {1, 2, 3};
  st_file_t f = {0};
  st_add(&f, "model.a", "F32", "[2, 3]", a, sizeof(a));
  st_add(&f, "model.b", "BF16", "[3]", b, sizeof(b));
  st_add(&f, "model.c", "F32", "[1]", a, 4);
  const char *path = in_dir("cut.safetensors");
  st_write(&f, path);
  kiln_weights_free(open_file(path));
  FILE *fp = fopen(path, "rb");
  assert_non_null(fp);
  uint8_t whole[1024];
  size_t len = fread(whole, 1, sizeof(whole), fp);
  fclose(fp);
  assert_true(len > 8 && len < sizeof(whole));
  for (size_t n = 0; n < len; n++) {
    write_bytes(path, whole, n);
    kiln_weights_t *w = (kiln_weights_t *)(uintptr_t)1;
    kiln_status_t st = kiln_weights_open_safetensors(path, &w);
    if (!st) fail_msg("a file cut to %zu of %zu bytes opened", n, len);
    assert_null(w);
    expect_status(st, KILN_ERR_INVALID_ARGUMENT, "cut.safetensors", (const char *)NULL);
  }
  st_free(&f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_single_file, make_dir, remove_dir),
      cmocka_unit_test_setup_teardown(test_many_tensors, make_dir, remove_dir),
      cmocka_unit_test_setup_teardown(test_convert, make_dir, remove_dir),
      cmocka_unit_test(test_wtype_names),
      cmocka_unit_test_setup_teardown(test_i32, make_dir, remove_dir),
      cmocka_unit_test_setup_teardown(test_f8, make_dir, remove_dir),
      cmocka_unit_test_setup_teardown(test_expect_shape, make_dir, remove_dir),
      cmocka_unit_test_setup_teardown(test_sharded, make_dir, remove_dir),
      cmocka_unit_test_setup_teardown(test_shard_errors, make_dir, remove_dir),
      cmocka_unit_test_setup_teardown(test_file_errors, make_dir, remove_dir),
      cmocka_unit_test_setup_teardown(test_every_truncation, make_dir, remove_dir),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
