/* ops_harness.c - backends, random inputs, poisoned buffers and comparisons for test_ops. */
#define _POSIX_C_SOURCE 200809L
#include "ops_harness.h"

#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "hal/loader.h"
#include "hal/ref/ops_ref.h"

#if __has_include(<valgrind/valgrind.h>)
#include <valgrind/valgrind.h>
#endif

oh_backend_t oh_backends[OH_MAX_BACKENDS];
int oh_num_backends;
uint64_t oh_seed;
bool oh_quick;

const int32_t oh_float_dtypes[3] = {KILN_HAL_F32, KILN_HAL_F16, KILN_HAL_BF16};

static kiln_hal_registry_t *g_registry;
static bool g_skip_announced[OH_MAX_BACKENDS][KILN_HAL_DTYPE_COUNT];

/* ---- backends ------------------------------------------------------------------------------ */

/* True when name is listed in the comma-separated list (NULL or "" = everything). */
static bool oh_name_wanted(const char *list, const char *name) {
  if (!list || !*list) return true;
  size_t n = strlen(name);
  const char *p = list;
  while (*p) {
    const char *e = strchr(p, ',');
    size_t len = e ? (size_t)(e - p) : strlen(p);
    if (len == n && strncmp(p, name, n) == 0) return true;
    if (!e) break;
    p = e + 1;
  }
  return false;
}

int oh_setup(const char **out_why) {
  *out_why = NULL;
  const char *quick = getenv("KILN_TEST_QUICK");
  oh_quick = quick && *quick && strcmp(quick, "0") != 0;
#ifdef RUNNING_ON_VALGRIND
  if (RUNNING_ON_VALGRIND) oh_quick = true;
#endif
  if (oh_quick) printf("test_ops: quick mode: cases over %.0e multiply-adds are skipped\n", OH_QUICK_WORK);
  kiln_hal_registry_options_t opts;
  memset(&opts, 0, sizeof(opts));
  kiln_status_t st = kiln_hal_registry_create(&opts, &g_registry);
  if (st) {
    printf("test_ops: registry: %s\n", kiln_status_message(st));
    kiln_status_free(st);
    *out_why = "the backend registry could not be created";
    return 0;
  }
  const char *want = getenv("KILN_TEST_BACKENDS");
  printf("test_ops: backend search path: %s\n", kiln_hal_registry_search_path(g_registry));
  if (want && *want) printf("test_ops: KILN_TEST_BACKENDS=%s\n", want);
  int n = kiln_hal_registry_count(g_registry);
  int missing = 0;
  for (int i = 0; i < n; i++) {
    const kiln_hal_plugin_t *p = kiln_hal_registry_get(g_registry, i);
    if (!oh_name_wanted(want, p->name)) continue;
    if (p->state != KILN_HAL_PLUGIN_USABLE) {
      printf("test_ops: backend %s not usable: %s\n", p->name, p->reason ? p->reason : "?");
      continue;
    }
    if (oh_num_backends == OH_MAX_BACKENDS) break;
    const kiln_hal_plugin_t *op = NULL;
    st = kiln_hal_registry_open(g_registry, p->name, &op);
    if (st) {
      printf("test_ops: backend %s failed to open: %s\n", p->name, kiln_status_message(st));
      kiln_status_free(st);
      missing++;
      continue;
    }
    oh_backend_t *be = &oh_backends[oh_num_backends];
    memset(be, 0, sizeof(*be));
    be->name = op->name;
    be->t = &op->table;
    be->info.struct_size = sizeof(be->info);
    kiln_hal_error_t *err = be->t->device_info(0, &be->info);
    if (!err) err = be->t->device_open(0, &be->dev);
    if (!err) err = be->t->stream_create(be->dev, &be->stream);
    if (err) {
      printf("test_ops: backend %s device 0: %s\n", p->name, err->message);
      kiln_hal_error_free(err);
      if (be->dev) be->t->device_close(be->dev);
      missing++;
      continue;
    }
    printf("test_ops: testing backend %s: %s (%s), caps%s%s%s%s\n", be->name, be->info.name,
           be->info.arch, (be->info.caps & KILN_HAL_CAP_F16) ? " f16" : "",
           (be->info.caps & KILN_HAL_CAP_BF16) ? " bf16" : "",
           (be->info.caps & KILN_HAL_CAP_GRAPHS) ? " graphs" : "",
           (be->info.caps & KILN_HAL_CAP_DEVICE_SAMPLING) ? " device-sampling" : "");
    oh_num_backends++;
  }
  /* Every name asked for explicitly must be under test. */
  if (want && *want) {
    const char *p = want;
    while (*p) {
      const char *e = strchr(p, ',');
      size_t len = e ? (size_t)(e - p) : strlen(p);
      bool found = false;
      for (int i = 0; i < oh_num_backends; i++) {
        if (strlen(oh_backends[i].name) == len && strncmp(oh_backends[i].name, p, len) == 0)
          found = true;
      }
      if (!found && len > 0) {
        printf("test_ops: requested backend '%.*s' is not usable\n", (int)len, p);
        missing++;
      }
      if (!e) break;
      p = e + 1;
    }
  }
  if (oh_num_backends == 0) {
    *out_why = "no usable backend found: a suite that tests nothing must not pass";
  } else if (missing) {
    *out_why = "a backend asked for (or found usable) could not be opened";
  }
  return oh_num_backends;
}

void oh_teardown(void) {
  oh_free_all();
  for (int i = 0; i < oh_num_backends; i++) {
    oh_backend_t *be = &oh_backends[i];
    if (be->stream) be->t->stream_destroy(be->stream);
    if (be->dev) be->t->device_close(be->dev);
  }
  oh_num_backends = 0;
  kiln_hal_registry_free(g_registry);
  g_registry = NULL;
}

bool oh_dtype_ok(const oh_backend_t *be, int32_t dtype) {
  uint64_t need = dtype == KILN_HAL_F16    ? KILN_HAL_CAP_F16
                  : dtype == KILN_HAL_BF16 ? KILN_HAL_CAP_BF16
                                           : 0;
  if (!need || (be->info.caps & need)) return true;
  int bi = (int)(be - oh_backends);
  if (bi >= 0 && bi < OH_MAX_BACKENDS && !g_skip_announced[bi][dtype]) {
    g_skip_announced[bi][dtype] = true;
    printf("test_ops: [%s] skipping %s: the device lacks CAP_%s\n", be->name,
           kiln_hal_dtype_name(dtype), dtype == KILN_HAL_F16 ? "F16" : "BF16");
  }
  return false;
}

/* ---- bookkeeping ------------------------------------------------------------------------- */

static char g_label[512];
static const char *g_test = "";
static int g_failures;
static int g_cases;   /* oh_case() calls in this test */
static int g_skipped; /* cases skipped by quick mode in this test */
static int g_printed; /* failure lines printed in this test (capped to keep logs readable) */
enum { OH_MAX_PRINTED = 300 };

static uint64_t g_rng[4];

static uint64_t oh_splitmix(uint64_t *x) {
  uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void oh_test_begin(const char *name) {
  uint64_t h = 1469598103934665603ull; /* FNV-1a of the name, mixed with the seed */
  for (const char *p = name; *p; p++) h = (h ^ (uint8_t)*p) * 1099511628211ull;
  uint64_t x = oh_seed ^ h;
  for (int i = 0; i < 4; i++) g_rng[i] = oh_splitmix(&x);
  g_test = name;
  g_failures = 0;
  g_cases = 0;
  g_skipped = 0;
  g_printed = 0;
  snprintf(g_label, sizeof(g_label), "%s", name);
}

void oh_test_end(void) {
  oh_free_all();
  int n = g_failures;
  g_failures = 0;
  if (g_skipped)
    printf("test_ops: %s: %d case(s) checked, %d failure(s), %d big case(s) skipped (quick)\n",
           g_test, g_cases, n, g_skipped);
  else
    printf("test_ops: %s: %d case(s) checked, %d failure(s)\n", g_test, g_cases, n);
  if (n) fail_msg("%s: %d check(s) failed (seed %llu)", g_test, n, (unsigned long long)oh_seed);
}

bool oh_skip_big(double work) {
  if (!oh_quick || work <= OH_QUICK_WORK) return false;
  g_skipped++;
  return true;
}

void oh_case(const oh_backend_t *be, const char *op, int32_t dtype, const char *fmt, ...) {
  g_cases++;
  int k = snprintf(g_label, sizeof(g_label), "[%s] %s %s: ", be ? be->name : "-", op,
                   dtype >= 0 ? kiln_hal_dtype_name(dtype) : "-");
  if (k < 0 || (size_t)k >= sizeof(g_label)) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_label + k, sizeof(g_label) - (size_t)k, fmt, ap);
  va_end(ap);
}

void oh_fail(const char *fmt, ...) {
  g_failures++;
  if (g_printed++ >= OH_MAX_PRINTED) {
    if (g_printed == OH_MAX_PRINTED + 1) printf("FAIL (further failures not printed)\n");
    return;
  }
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  printf("FAIL %s: %s\n", g_label, msg);
  fflush(stdout);
}

int oh_failure_count(void) { return g_failures; }

bool oh_ok(kiln_hal_error_t *err, const char *what) {
  if (!err) return true;
  oh_fail("%s failed: %s: %s", what, kiln_hal_code_name(err->code),
          err->message ? err->message : "(no message)");
  kiln_hal_error_free(err);
  return false;
}

bool oh_expect_error(kiln_hal_error_t *err, const char *what) {
  if (!err) {
    oh_fail("%s: accepted (want INVALID_ARGUMENT or UNSUPPORTED)", what);
    return false;
  }
  bool good = true;
  if (err->code != KILN_HAL_ERR_INVALID_ARGUMENT && err->code != KILN_HAL_ERR_UNSUPPORTED) {
    oh_fail("%s: error code %s, want INVALID_ARGUMENT or UNSUPPORTED (%s)", what,
            kiln_hal_code_name(err->code), err->message ? err->message : "");
    good = false;
  }
  if (!err->message || !err->message[0]) {
    oh_fail("%s: the error has an empty message", what);
    good = false;
  }
  kiln_hal_error_free(err);
  return good;
}

/* ---- random numbers ---------------------------------------------------------------------- */

static uint64_t oh_rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t oh_rand_u64(void) {
  uint64_t *s = g_rng;
  uint64_t r = oh_rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
  s[2] ^= s[0];
  s[3] ^= s[1];
  s[1] ^= s[2];
  s[0] ^= s[3];
  s[2] ^= t;
  s[3] = oh_rotl(s[3], 45);
  return r;
}

double oh_rand_uniform(double lo, double hi) {
  return lo + (hi - lo) * ((double)(oh_rand_u64() >> 11) / 9007199254740992.0);
}

int64_t oh_rand_int(int64_t lo, int64_t hi) {
  return lo + (int64_t)(oh_rand_u64() % (uint64_t)(hi - lo + 1));
}

void oh_rand_fill(double *v, int64_t n, double lo, double hi) {
  for (int64_t i = 0; i < n; i++) v[i] = oh_rand_uniform(lo, hi);
}

void oh_shuffle_i32(int32_t *v, int64_t n) {
  for (int64_t i = n - 1; i > 0; i--) {
    int64_t j = oh_rand_int(0, i);
    int32_t t = v[i];
    v[i] = v[j];
    v[j] = t;
  }
}

/* ---- buffers ------------------------------------------------------------------------------- */

static oh_buf_t **g_bufs;
static size_t g_nbufs, g_capbufs;

void *oh_xcalloc(size_t n, size_t size) {
  void *p = calloc(n ? n : 1, size ? size : 1);
  if (!p) {
    fprintf(stderr, "test_ops: out of host memory\n");
    abort();
  }
  return p;
}

oh_buf_t *oh_buf_new(const oh_backend_t *be, size_t bytes) {
  oh_buf_t *b = OH_NEW(oh_buf_t, 1);
  b->be = be;
  b->size = bytes;
  b->host = OH_NEW(uint8_t, bytes);
  b->got = OH_NEW(uint8_t, bytes);
  b->mask = OH_NEW(uint8_t, bytes);
  kiln_hal_error_t *err = be->t->buffer_alloc(be->dev, bytes, 0, &b->b);
  if (err) {
    fprintf(stderr, "test_ops: [%s] buffer_alloc(%zu): %s\n", be->name, bytes, err->message);
    abort();
  }
  if (g_nbufs == g_capbufs) {
    g_capbufs = g_capbufs ? 2 * g_capbufs : 64;
    g_bufs = realloc(g_bufs, g_capbufs * sizeof(*g_bufs));
    if (!g_bufs) abort();
  }
  g_bufs[g_nbufs++] = b;
  oh_poison(b);
  return b;
}

void oh_free_all(void) {
  for (size_t i = 0; i < g_nbufs; i++) {
    oh_buf_t *b = g_bufs[i];
    b->be->t->buffer_free(b->b);
    free(b->host);
    free(b->got);
    free(b->mask);
    free(b);
  }
  g_nbufs = 0;
}

kiln_hal_tensor_t oh_view(const oh_buf_t *b, uint64_t byte_offset, int32_t dtype, int ndim,
                          const int64_t *shape, const int64_t *stride) {
  kiln_hal_tensor_t t = kiln_hal_tensor_make(b ? b->b : NULL, byte_offset, dtype, ndim, shape);
  if (stride) {
    for (int i = 0; i < ndim; i++) t.stride[i] = stride[i];
  }
  return t;
}

kiln_hal_tensor_t oh_absent(void) {
  kiln_hal_tensor_t t;
  memset(&t, 0, sizeof(t));
  return t;
}

int64_t oh_numel(const kiln_hal_tensor_t *v) { return kiln_hal_tensor_numel(v); }

/* Byte offset of dense element n of view v within its buffer. */
static size_t oh_elem_byte(const kiln_hal_tensor_t *v, int64_t n) {
  int64_t off = 0;
  for (int d = v->ndim - 1; d >= 0; d--) {
    int64_t i = n % v->shape[d];
    n /= v->shape[d];
    off += i * v->stride[d];
  }
  return (size_t)(v->offset + (uint64_t)off * kiln_hal_dtype_size(v->dtype));
}

static void oh_bounds(const oh_buf_t *b, size_t at, size_t es) {
  if (at + es > b->size) {
    fprintf(stderr, "test_ops: test bug: view element at byte %zu outside a %zu-byte buffer\n", at,
            b->size);
    abort();
  }
}

static void oh_store(uint8_t *p, int32_t dtype, double v) {
  switch (dtype) {
    case KILN_HAL_I32: {
      int32_t x = (int32_t)v;
      memcpy(p, &x, 4);
      break;
    }
    case KILN_HAL_I64: {
      int64_t x = (int64_t)v;
      memcpy(p, &x, 8);
      break;
    }
    case KILN_HAL_U8: *p = (uint8_t)v; break;
    default: kiln_hal_store_f32(p, dtype, 0, (float)v); break;
  }
}

static double oh_load(const uint8_t *p, int32_t dtype) {
  switch (dtype) {
    case KILN_HAL_I32: {
      int32_t x;
      memcpy(&x, p, 4);
      return x;
    }
    case KILN_HAL_I64: {
      int64_t x;
      memcpy(&x, p, 8);
      return (double)x;
    }
    case KILN_HAL_U8: return *p;
    case KILN_HAL_F32: {
      float f;
      memcpy(&f, p, 4);
      return f;
    }
    default: {
      uint16_t h;
      memcpy(&h, p, 2);
      return dtype == KILN_HAL_F16 ? kiln_hal_f16_to_f32(h) : kiln_hal_bf16_to_f32(h);
    }
  }
}

void oh_write(oh_buf_t *b, const kiln_hal_tensor_t *v, double *vals) {
  size_t es = kiln_hal_dtype_size(v->dtype);
  int64_t n = oh_numel(v);
  bool is_float = v->dtype == KILN_HAL_F32 || v->dtype == KILN_HAL_F16 || v->dtype == KILN_HAL_BF16;
  for (int64_t i = 0; i < n; i++) {
    size_t at = oh_elem_byte(v, i);
    oh_bounds(b, at, es);
    if (is_float) vals[i] = ops_ref_round(v->dtype, vals[i]);
    oh_store(b->host + at, v->dtype, vals[i]);
  }
}

void oh_write_i32(oh_buf_t *b, const kiln_hal_tensor_t *v, const int32_t *vals) {
  int64_t n = oh_numel(v);
  for (int64_t i = 0; i < n; i++) {
    size_t at = oh_elem_byte(v, i);
    oh_bounds(b, at, 4);
    memcpy(b->host + at, &vals[i], 4);
  }
}

void oh_write_rand(oh_buf_t *b, const kiln_hal_tensor_t *v, double lo, double hi, double *vals) {
  oh_rand_fill(vals, oh_numel(v), lo, hi);
  oh_write(b, v, vals);
}

void oh_push(oh_buf_t *b) {
  const oh_backend_t *be = b->be;
  if (b->size == 0) return;
  oh_ok(be->t->copy_h2d(be->stream, b->b, 0, b->host, b->size), "copy_h2d");
  oh_ok(be->t->stream_sync(be->stream), "stream_sync after copy_h2d");
}

void oh_poison(oh_buf_t *b) {
  const oh_backend_t *be = b->be;
  memset(b->host, 0xFF, b->size);
  if (b->size == 0) return;
  oh_ok(be->t->fill(be->stream, b->b, 0, b->size, 0xFF), "fill (poison)");
}

bool oh_pull(oh_buf_t *b) {
  const oh_backend_t *be = b->be;
  memset(b->mask, 0, b->size);
  memset(b->got, 0xFF, b->size);
  if (!oh_ok(be->t->stream_sync(be->stream), "stream_sync after the op")) return false;
  if (b->size == 0) return true;
  if (!oh_ok(be->t->copy_d2h(be->stream, b->got, b->b, 0, b->size), "copy_d2h")) return false;
  return oh_ok(be->t->stream_sync(be->stream), "stream_sync after copy_d2h");
}

void oh_read(const oh_buf_t *b, const kiln_hal_tensor_t *v, double *vals) {
  size_t es = kiln_hal_dtype_size(v->dtype);
  int64_t n = oh_numel(v);
  for (int64_t i = 0; i < n; i++) {
    size_t at = oh_elem_byte(v, i);
    oh_bounds(b, at, es);
    vals[i] = oh_load(b->got + at, v->dtype);
  }
}

void oh_read_i32(const oh_buf_t *b, const kiln_hal_tensor_t *v, int32_t *vals) {
  int64_t n = oh_numel(v);
  for (int64_t i = 0; i < n; i++) {
    size_t at = oh_elem_byte(v, i);
    oh_bounds(b, at, 4);
    memcpy(&vals[i], b->got + at, 4);
  }
}

void oh_mark(oh_buf_t *b, const kiln_hal_tensor_t *v) {
  size_t es = kiln_hal_dtype_size(v->dtype);
  int64_t n = oh_numel(v);
  for (int64_t i = 0; i < n; i++) {
    size_t at = oh_elem_byte(v, i);
    oh_bounds(b, at, es);
    memset(b->mask + at, 1, es);
  }
}

void oh_mark_bytes(oh_buf_t *b, size_t offset, size_t n) {
  oh_bounds(b, offset, n);
  memset(b->mask + offset, 1, n);
}

int64_t oh_check_rest(const oh_buf_t *b, const char *what) {
  int64_t bad = 0;
  size_t first = 0, last = 0;
  for (size_t i = 0; i < b->size; i++) {
    if (b->mask[i] || b->got[i] == b->host[i]) continue;
    if (!bad) first = i;
    last = i;
    bad++;
  }
  if (bad) {
    bool poison = b->host[first] == 0xFF;
    oh_fail(
        "%s: %lld byte(s) the op must not write changed (bytes %zu..%zu of %zu; byte %zu is "
        "0x%02x, want 0x%02x%s)",
        what, (long long)bad, first, last, b->size, first, b->got[first], b->host[first],
        poison ? " poison" : "");
  }
  return bad;
}

/* ---- comparisons ------------------------------------------------------------------------- */

/* Tolerances. The reference is exact (fp64 on the stored inputs); a backend computes in f32
 * and rounds each output once, so an elementwise result may be off by half an ulp of its
 * dtype plus a few f32 ulps of work:
 *   elementwise (add, silu_mul, rope, embedding, penalize):  f32 rtol 1e-5, f16 2e-3, bf16 1e-2
 *       (f16 ulp 2^-10 ~ 9.8e-4, bf16 ulp 2^-7 ~ 7.8e-3), plus a small atol for values near 0.
 *   rmsnorm: two rounding points inside the op (the normalised value, then the product), and
 *       an f32 rsqrt can flip the first one, so up to two ulps: f16 2.5e-3, bf16 2e-2.
 *   gemm: an f32 accumulation over K terms errs by up to ~K * 2^-24 * sum|a*b| (mag from
 *       ops_ref_gemm); with K <= 300 that is < 2e-5 * mag. Plus the output rounding (rtol).
 *   attention: out is a convex combination of v (|v| <= 1 here), so the absolute error is
 *       bounded by the error of the weights: f32 ~1e-6, but half-precision kernels commonly
 *       round the probabilities to the storage dtype before the P@V product, costing one ulp
 *       of the dtype: atol f16 2e-3, bf16 1e-2, plus the output rounding (rtol).
 *   log-probabilities (argmax/topk/sample, f32): a logsumexp over up to 32k terms in f32,
 *       atol 1e-4 + rtol 1e-5. */
oh_tol_t oh_tol_elementwise(int32_t dtype) {
  switch (dtype) {
    case KILN_HAL_F16: return (oh_tol_t){1e-5, 2e-3, 0};
    case KILN_HAL_BF16: return (oh_tol_t){1e-5, 1e-2, 0};
    default: return (oh_tol_t){1e-6, 1e-5, 0};
  }
}

oh_tol_t oh_tol_rmsnorm(int32_t dtype) {
  switch (dtype) {
    case KILN_HAL_F16: return (oh_tol_t){1e-5, 2.5e-3, 0};
    case KILN_HAL_BF16: return (oh_tol_t){1e-5, 2e-2, 0};
    default: return (oh_tol_t){1e-6, 1e-5, 0};
  }
}

oh_tol_t oh_tol_gemm(int32_t out_dtype) {
  oh_tol_t t = oh_tol_elementwise(out_dtype);
  t.mtol = 2e-5;
  return t;
}

oh_tol_t oh_tol_attention(int32_t dtype) {
  switch (dtype) {
    case KILN_HAL_F16: return (oh_tol_t){2e-3, 2e-3, 0};
    case KILN_HAL_BF16: return (oh_tol_t){1e-2, 1e-2, 0};
    default: return (oh_tol_t){2e-5, 1e-5, 0};
  }
}

oh_tol_t oh_tol_logprob(void) { return (oh_tol_t){1e-4, 1e-5, 0}; }

int64_t oh_compare(const char *what, int64_t n, const double *got, const double *want,
                   const double *mag, oh_tol_t tol) {
  int64_t bad = 0;
  double worst = 0;
  int64_t worst_i = -1;
  for (int64_t i = 0; i < n; i++) {
    double lim = tol.atol + tol.rtol * fabs(want[i]) + (mag ? tol.mtol * mag[i] : 0.0);
    bool ok;
    if (isnan(want[i])) {
      ok = isnan(got[i]);
    } else if (isinf(want[i])) {
      ok = got[i] == want[i];
    } else {
      ok = isfinite(got[i]) && fabs(got[i] - want[i]) <= lim;
    }
    if (ok) continue;
    if (bad < 4) {
      oh_fail("%s[%lld]: want %.9g, got %.9g%s (|err| %.3g, tol %.3g)", what, (long long)i, want[i],
              got[i], isnan(got[i]) ? " (NaN: not written?)" : "", fabs(got[i] - want[i]), lim);
    }
    double r = isfinite(got[i]) ? fabs(got[i] - want[i]) / lim : INFINITY;
    if (worst_i < 0 || r > worst) {
      worst = r;
      worst_i = i;
    }
    bad++;
  }
  if (bad > 4) {
    oh_fail("%s: %lld of %lld elements wrong; worst [%lld]: want %.9g got %.9g", what,
            (long long)bad, (long long)n, (long long)worst_i, want[worst_i], got[worst_i]);
  }
  return bad;
}

int64_t oh_compare_i32(const char *what, int64_t n, const int32_t *got, const int32_t *want) {
  int64_t bad = 0;
  for (int64_t i = 0; i < n; i++) {
    if (got[i] == want[i]) continue;
    if (bad < 4) oh_fail("%s[%lld]: want %d, got %d", what, (long long)i, want[i], got[i]);
    bad++;
  }
  if (bad > 4) oh_fail("%s: %lld of %lld wrong", what, (long long)bad, (long long)n);
  return bad;
}
