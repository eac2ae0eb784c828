/* hal_util.h - optional header-only helpers for backend authors: error objects, tensor views,
 * f16/bf16 conversion. Everything is static inline, so a plugin that includes it exports
 * nothing new and links nothing. Installed with the SDK beside hal.h. */
#ifndef KILN_HAL_UTIL_H
#define KILN_HAL_UTIL_H

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kiln/hal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- errors ---------------------------------------------------------------------------- */

typedef struct kiln_hal_error_heap {
  kiln_hal_error_t base;
  char message[]; /* flexible array: base.message points here */
} kiln_hal_error_heap_t;

static inline void kiln_hal_error_heap_destroy(kiln_hal_error_t *err) { free(err); }
static inline void kiln_hal_error_static_destroy(kiln_hal_error_t *err) { (void)err; }

/* Returned when even the error cannot be allocated. destroy() is a no-op. */
static kiln_hal_error_t kiln_hal_error_oom_static = {
    sizeof(kiln_hal_error_t), KILN_HAL_ERR_OUT_OF_MEMORY,
    "out of host memory (while creating an error)", kiln_hal_error_static_destroy};

static inline kiln_hal_error_t *kiln_hal_error_vnew(int32_t code, const char *fmt, va_list ap)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 0)))
#endif
    ;
static inline kiln_hal_error_t *kiln_hal_error_vnew(int32_t code, const char *fmt, va_list ap) {
  va_list ap2;
  va_copy(ap2, ap);
  int n = vsnprintf(NULL, 0, fmt, ap2);
  va_end(ap2);
  if (n < 0) n = 0;
  kiln_hal_error_heap_t *e = (kiln_hal_error_heap_t *)malloc(sizeof(*e) + (size_t)n + 1);
  if (!e) return &kiln_hal_error_oom_static;
  vsnprintf(e->message, (size_t)n + 1, fmt, ap);
  e->base.struct_size = sizeof(kiln_hal_error_t);
  e->base.code = code;
  e->base.message = e->message;
  e->base.destroy = kiln_hal_error_heap_destroy;
  return &e->base;
}

/* Creates an error with a printf-style message; never returns NULL. */
static inline kiln_hal_error_t *kiln_hal_error_new(int32_t code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
static inline kiln_hal_error_t *kiln_hal_error_new(int32_t code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  kiln_hal_error_t *e = kiln_hal_error_vnew(code, fmt, ap);
  va_end(ap);
  return e;
}

/* Releases an error from any source; NULL is a no-op. */
static inline void kiln_hal_error_free(kiln_hal_error_t *err) {
  if (err && err->destroy) err->destroy(err);
}

static inline const char *kiln_hal_code_name(int32_t code) {
  switch (code) {
    case KILN_HAL_OK: return "OK";
    case KILN_HAL_ERR_INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case KILN_HAL_ERR_UNSUPPORTED: return "UNSUPPORTED";
    case KILN_HAL_ERR_OUT_OF_MEMORY: return "OUT_OF_MEMORY";
    case KILN_HAL_ERR_NO_DEVICE: return "NO_DEVICE";
    case KILN_HAL_ERR_DEVICE: return "DEVICE";
    case KILN_HAL_ERR_INTERNAL: return "INTERNAL";
    default: return "UNKNOWN";
  }
}

/* ---- tensor views ---------------------------------------------------------------------- */

static inline bool kiln_hal_tensor_present(const kiln_hal_tensor_t *t) { return t->buffer != NULL; }

static inline int64_t kiln_hal_tensor_numel(const kiln_hal_tensor_t *t) {
  int64_t n = 1;
  for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
  return n;
}

/* A dense row-major view of shape (d0, d1, ...) at byte offset `offset`. */
static inline kiln_hal_tensor_t kiln_hal_tensor_make(kiln_hal_buffer_t *buffer, uint64_t offset,
                                                     int32_t dtype, int32_t ndim,
                                                     const int64_t *shape) {
  kiln_hal_tensor_t t;
  memset(&t, 0, sizeof(t));
  t.buffer = buffer;
  t.offset = offset;
  t.dtype = dtype;
  t.ndim = ndim;
  int64_t s = 1;
  for (int i = ndim - 1; i >= 0; i--) {
    t.shape[i] = shape[i];
    t.stride[i] = s;
    s *= shape[i];
  }
  return t;
}

/* True when the view is dense row-major (strides of size-1 dims are ignored). */
static inline bool kiln_hal_tensor_is_contiguous(const kiln_hal_tensor_t *t) {
  int64_t s = 1;
  for (int i = t->ndim - 1; i >= 0; i--) {
    if (t->shape[i] != 1 && t->stride[i] != s) return false;
    s *= t->shape[i];
  }
  return true;
}

/* Bytes from offset 0 of the buffer to one past the last element the view can touch (0 for
 * an empty view), or UINT64_MAX when a shape, stride or the sum is negative or overflows: a
 * caller compares the result with the buffer size, and UINT64_MAX never fits. */
static inline uint64_t kiln_hal_tensor_extent(const kiln_hal_tensor_t *t) {
  const uint64_t limit = (uint64_t)1 << 62; /* far beyond any buffer, and overflow-safe */
  uint64_t es = kiln_hal_dtype_size(t->dtype);
  if (t->ndim < 0 || t->ndim > KILN_HAL_MAX_DIMS) return UINT64_MAX;
  uint64_t last = 0;
  for (int i = 0; i < t->ndim; i++) {
    if (t->shape[i] < 0 || t->stride[i] < 0) return UINT64_MAX;
    if (t->shape[i] == 0) return 0;
    uint64_t n = (uint64_t)t->shape[i] - 1, st = (uint64_t)t->stride[i];
    if (n && st > limit / n) return UINT64_MAX;
    last += n * st;
    if (last > limit) return UINT64_MAX;
  }
  if (t->offset > limit || (last + 1) > limit / (es ? es : 1)) return UINT64_MAX;
  return t->offset + (last + 1) * es;
}

/* ---- f16 / bf16 <-> f32 ----------------------------------------------------------------- */

static inline float kiln_hal_bits_to_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static inline uint32_t kiln_hal_f32_to_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static inline float kiln_hal_bf16_to_f32(uint16_t h) { return kiln_hal_bits_to_f32((uint32_t)h << 16); }

/* Round to nearest even; NaN stays NaN (quiet). */
static inline uint16_t kiln_hal_f32_to_bf16(float f) {
  uint32_t u = kiln_hal_f32_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static inline float kiln_hal_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0) {
    if (man == 0) return kiln_hal_bits_to_f32(sign);
    /* subnormal: man * 2^-24 */
    float f = (float)man * (1.0f / 16777216.0f);
    return sign ? -f : f;
  }
  if (exp == 31) return kiln_hal_bits_to_f32(sign | 0x7f800000u | (man << 13));
  return kiln_hal_bits_to_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

/* Round to nearest even, overflow to infinity, NaN stays NaN. */
static inline uint16_t kiln_hal_f32_to_f16(float f) {
  uint32_t u = kiln_hal_f32_to_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds to inf */
  if (a < 0x38800000u) {                                    /* below 2^-14: subnormal or 0 */
    /* value * 2^24 rounded to nearest even integer gives the subnormal mantissa */
    float v = kiln_hal_bits_to_f32(a) * 16777216.0f;
    uint32_t m = (uint32_t)v;
    float rem = v - (float)m;
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) m++;
    return (uint16_t)(sign | m);
  }
  uint32_t exp = (a >> 23) - 112u;
  uint32_t man = a & 0x7fffffu;
  uint32_t h = (exp << 10) | (man >> 13);
  uint32_t rest = man & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
  return (uint16_t)(sign | h);
}

/* Loads element i (already including strides) of a float-typed array as f32. */
static inline float kiln_hal_load_f32(const void *base, int32_t dtype, int64_t i) {
  switch (dtype) {
    case KILN_HAL_F32: return ((const float *)base)[i];
    case KILN_HAL_F16: return kiln_hal_f16_to_f32(((const uint16_t *)base)[i]);
    case KILN_HAL_BF16: return kiln_hal_bf16_to_f32(((const uint16_t *)base)[i]);
    default: return 0.0f;
  }
}

static inline void kiln_hal_store_f32(void *base, int32_t dtype, int64_t i, float v) {
  switch (dtype) {
    case KILN_HAL_F32: ((float *)base)[i] = v; break;
    case KILN_HAL_F16: ((uint16_t *)base)[i] = kiln_hal_f32_to_f16(v); break;
    case KILN_HAL_BF16: ((uint16_t *)base)[i] = kiln_hal_f32_to_bf16(v); break;
    default: break;
  }
}

/* Rounds v to what dtype can hold (identity for F32). */
static inline float kiln_hal_round_to(int32_t dtype, float v) {
  switch (dtype) {
    case KILN_HAL_F16: return kiln_hal_f16_to_f32(kiln_hal_f32_to_f16(v));
    case KILN_HAL_BF16: return kiln_hal_bf16_to_f32(kiln_hal_f32_to_bf16(v));
    default: return v;
  }
}

#ifdef __cplusplus
}
#endif

#endif /* KILN_HAL_UTIL_H */
