/* hal_check.h - hal.h's argument rules as code: one check per op that a backend calls before it
 * runs the op, so every backend (and every third-party plugin) accepts and refuses the same
 * arguments. Everything is static inline, like hal_util.h; installed with the SDK beside it.
 *
 * Each kiln_hal_check_<op>() takes the op's args (already copied to a full-size struct with
 * kiln_hal_args_copy) and a kiln_hal_check_env_t that tells it how big a buffer is. It returns
 * NULL when the arguments follow hal.h, else an INVALID_ARGUMENT error, owned by the caller,
 * whose message names the op and the argument ("rmsnorm: weight has 4095 elements, x has
 * H=4096"). The checks cover what hal.h says: dtypes, ndim, shapes consistent across tensors,
 * the contiguity rules, element-aligned offsets and views inside their buffers. They do not
 * read buffer contents (ids, offsets, block tables) and know nothing of a backend's own
 * limits (dtype support, int32 launch dimensions, alignment), which the backend checks after.
 * Thread-safety: the checks only read their arguments; they are safe from any thread. */
#ifndef KILN_HAL_CHECK_H
#define KILN_HAL_CHECK_H

#include <float.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "kiln/hal.h"
#include "kiln/hal_quant.h"
#include "kiln/hal_util.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bit masks of accepted dtypes. */
#define KILN_HAL_DT(d) (1u << (d))
#define KILN_HAL_DT_FLOAT \
  (KILN_HAL_DT(KILN_HAL_F32) | KILN_HAL_DT(KILN_HAL_F16) | KILN_HAL_DT(KILN_HAL_BF16))
#define KILN_HAL_DT_ANY                                                        \
  (KILN_HAL_DT_FLOAT | KILN_HAL_DT(KILN_HAL_I32) | KILN_HAL_DT(KILN_HAL_I64) | \
   KILN_HAL_DT(KILN_HAL_U8))

/* Largest shape or stride accepted in a view: keeps extent and row computations far from
 * int64 overflow (2^40 elements is 4 TiB of f32). */
#define KILN_HAL_CHECK_MAX_DIM ((int64_t)1 << 40)

/* What the checks need to know about the backend's buffers. */
typedef struct kiln_hal_check_env {
  /* Bytes a view into `buffer` may touch. Required. */
  uint64_t (*buffer_size)(void *ctx, kiln_hal_buffer_t *buffer);
  /* Optional (NULL = none): refuses a buffer this call cannot use (another device's memory),
   * returning an error that names op and argument. Called for every present tensor. */
  kiln_hal_error_t *(*check_buffer)(void *ctx, const char *op, const char *name,
                                    kiln_hal_buffer_t *buffer);
  void *ctx; /* passed back to both */
} kiln_hal_check_env_t;

/* The derived sizes of a valid gemm (kiln_hal_check_gemm). Batch strides are in elements,
 * 0 for a broadcast operand (2-D, or a batch of 1). */
typedef struct kiln_hal_gemm_dims {
  int64_t batch, M, N, K;
  int64_t batch_stride_a, batch_stride_b, batch_stride_c;
} kiln_hal_gemm_dims_t;

/* ---- helpers ----------------------------------------------------------------------------- */

/* An INVALID_ARGUMENT error with a printf-style message; never NULL. */
static inline kiln_hal_error_t *kiln_hal_check_fail(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;
static inline kiln_hal_error_t *kiln_hal_check_fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  kiln_hal_error_t *e = kiln_hal_error_vnew(KILN_HAL_ERR_INVALID_ARGUMENT, fmt, ap);
  va_end(ap);
  return e;
}

/* Copies a caller's args struct (struct_size = the caller's sizeof, at least up to its first
 * tensor) into a zeroed full-size local of dst_size bytes, whose struct_size becomes
 * dst_size: members an older caller lacks read as zero. NULL or INVALID_ARGUMENT ("<op>: args
 * is NULL"); dst is zeroed either way. */
static inline kiln_hal_error_t *kiln_hal_args_copy(const char *op, void *dst, size_t dst_size,
                                                   const void *src) {
  memset(dst, 0, dst_size);
  if (!src) return kiln_hal_check_fail("%s: args is NULL", op);
  uint32_t have;
  memcpy(&have, src, sizeof(have));
  if (have < sizeof(uint32_t) + sizeof(kiln_hal_tensor_t))
    return kiln_hal_check_fail("%s: args struct_size %u is too small", op, (unsigned)have);
  memcpy(dst, src, have < dst_size ? have : dst_size);
  uint32_t full = (uint32_t)dst_size;
  memcpy(dst, &full, sizeof(full));
  return NULL;
}

/* "f32/f16/bf16" for a dtype mask. */
static inline const char *kiln_hal_check_dtypes_str(uint32_t dtypes, char *buf, size_t n) {
  size_t used = 0;
  buf[0] = 0;
  for (int d = 0; d < KILN_HAL_DTYPE_COUNT; d++) {
    if (!(dtypes & KILN_HAL_DT(d))) continue;
    int w = snprintf(buf + used, n - used, "%s%s", used ? "/" : "", kiln_hal_dtype_name(d));
    if (w < 0 || (size_t)w >= n - used) break;
    used += (size_t)w;
  }
  return buf;
}

/* "[2, 3, 4]" for a view's shape (its first ndim dims, clamped to 0..KILN_HAL_MAX_DIMS). */
static inline const char *kiln_hal_check_shape_str(const kiln_hal_tensor_t *t, char *buf,
                                                   size_t n) {
  int nd = t->ndim < 0 ? 0 : t->ndim > KILN_HAL_MAX_DIMS ? KILN_HAL_MAX_DIMS : t->ndim;
  size_t used = 0;
  buf[0] = 0;
  int w = snprintf(buf, n, "[");
  for (int i = 0; w >= 0 && i <= nd; i++) {
    used += (size_t)w;
    if (used >= n) break;
    w = i < nd ? snprintf(buf + used, n - used, "%s%lld", i ? ", " : "", (long long)t->shape[i])
               : snprintf(buf + used, n - used, "]");
  }
  return buf;
}

/* True when two views share a byte of the same buffer (empty views share nothing). */
static inline bool kiln_hal_tensor_overlap(const kiln_hal_tensor_t *a, const kiln_hal_tensor_t *b) {
  if (!a->buffer || a->buffer != b->buffer) return false;
  uint64_t aend = kiln_hal_tensor_extent(a), bend = kiln_hal_tensor_extent(b);
  if (aend == 0 || bend == 0) return false;
  return a->offset < bend && b->offset < aend;
}

/* Checks tensor `name` of op `op`: present, dtype in `dtypes`, ndim == `ndim` (1..4 when 0),
 * shapes and strides in [0, KILN_HAL_CHECK_MAX_DIM], an element-aligned offset, (when
 * last_contig) a contiguous last dimension (stride 1 unless that dim has size <= 1), a buffer
 * env accepts, and every element inside the buffer. */
static inline kiln_hal_error_t *kiln_hal_check_tensor(const kiln_hal_check_env_t *env,
                                                      const char *op, const char *name,
                                                      const kiln_hal_tensor_t *t, uint32_t dtypes,
                                                      int32_t ndim, bool last_contig) {
  char buf[96];
  if (!t->buffer) return kiln_hal_check_fail("%s: %s is absent", op, name);
  if (t->dtype < 0 || t->dtype >= KILN_HAL_DTYPE_COUNT || !(dtypes & KILN_HAL_DT(t->dtype)))
    return kiln_hal_check_fail("%s: %s has dtype %s (%d), want %s", op, name,
                               kiln_hal_dtype_name(t->dtype), (int)t->dtype,
                               kiln_hal_check_dtypes_str(dtypes, buf, sizeof(buf)));
  if (t->ndim < 1 || t->ndim > KILN_HAL_MAX_DIMS || (ndim && t->ndim != ndim)) {
    if (ndim)
      return kiln_hal_check_fail("%s: %s has ndim %d, want %d", op, name, (int)t->ndim, (int)ndim);
    return kiln_hal_check_fail("%s: %s has ndim %d, want 1..%d", op, name, (int)t->ndim,
                               KILN_HAL_MAX_DIMS);
  }
  for (int i = 0; i < t->ndim; i++) {
    if (t->shape[i] < 0 || t->shape[i] > KILN_HAL_CHECK_MAX_DIM)
      return kiln_hal_check_fail("%s: %s has shape[%d] = %lld", op, name, i,
                                 (long long)t->shape[i]);
    if (t->stride[i] < 0 || t->stride[i] > KILN_HAL_CHECK_MAX_DIM)
      return kiln_hal_check_fail("%s: %s has stride[%d] = %lld", op, name, i,
                                 (long long)t->stride[i]);
  }
  size_t es = kiln_hal_dtype_size(t->dtype);
  if (t->offset % es != 0)
    return kiln_hal_check_fail("%s: %s offset %llu is not a multiple of its element size %zu", op,
                               name, (unsigned long long)t->offset, es);
  if (last_contig && t->shape[t->ndim - 1] > 1 && t->stride[t->ndim - 1] != 1)
    return kiln_hal_check_fail(
        "%s: %s must be contiguous in its last dimension (stride[%d] = %lld)", op, name,
        (int)t->ndim - 1, (long long)t->stride[t->ndim - 1]);
  if (env->check_buffer) {
    kiln_hal_error_t *e = env->check_buffer(env->ctx, op, name, t->buffer);
    if (e) return e;
  }
  uint64_t end = kiln_hal_tensor_extent(t), size = env->buffer_size(env->ctx, t->buffer);
  if (end == UINT64_MAX)
    return kiln_hal_check_fail("%s: %s spans more memory than any buffer can hold", op, name);
  if (end > size)
    return kiln_hal_check_fail(
        "%s: %s (shape %s, offset %llu) reaches byte %llu, past the end of its buffer of %llu "
        "bytes",
        op, name, kiln_hal_check_shape_str(t, buf, sizeof(buf)), (unsigned long long)t->offset,
        (unsigned long long)end, (unsigned long long)size);
  return NULL;
}

/* An error unless a and b have the same ndim and shape. */
static inline kiln_hal_error_t *kiln_hal_check_same_shape(const char *op, const char *an,
                                                          const kiln_hal_tensor_t *a,
                                                          const char *bn,
                                                          const kiln_hal_tensor_t *b) {
  bool same = a->ndim == b->ndim;
  for (int d = 0; same && d < a->ndim && d < KILN_HAL_MAX_DIMS; d++)
    same = a->shape[d] == b->shape[d];
  if (same) return NULL;
  char sa[96], sb[96];
  return kiln_hal_check_fail("%s: %s has shape %s but %s has shape %s", op, bn,
                             kiln_hal_check_shape_str(b, sb, sizeof(sb)), an,
                             kiln_hal_check_shape_str(a, sa, sizeof(sa)));
}

/* A [n] vector of dtype; when optional, an absent one passes. */
static inline kiln_hal_error_t *kiln_hal_check_vec(const kiln_hal_check_env_t *env, const char *op,
                                                   const char *name, const kiln_hal_tensor_t *t,
                                                   int32_t dtype, int64_t n, bool optional) {
  if (optional && !t->buffer) return NULL;
  kiln_hal_error_t *e = kiln_hal_check_tensor(env, op, name, t, KILN_HAL_DT(dtype), 1, true);
  if (!e && t->shape[0] != n)
    e = kiln_hal_check_fail("%s: %s has %lld entries, want %lld", op, name, (long long)t->shape[0],
                            (long long)n);
  return e;
}

/* ---- one check per op (the rules are hal.h's, above each args struct) ---------------------- */

static inline kiln_hal_error_t *kiln_hal_gemm_layout(const char *name, const kiln_hal_tensor_t *t) {
  int64_t rows = t->shape[t->ndim - 2], cols = t->shape[t->ndim - 1];
  int64_t rs = t->stride[t->ndim - 2], cs = t->stride[t->ndim - 1];
  if (cs == 1 || rs == 1 || cols <= 1 || rows <= 1) return NULL;
  return kiln_hal_check_fail(
      "gemm: %s must be row-major (stride[-1] == 1) or column-major (stride[-2] == 1), got "
      "strides {%lld, %lld}",
      name, (long long)rs, (long long)cs);
}

/* gemm. out_dims (may be NULL) receives the sizes and batch strides; zeroed on error. */
static inline kiln_hal_error_t *kiln_hal_check_gemm(const kiln_hal_check_env_t *env,
                                                    const kiln_hal_gemm_args_t *g,
                                                    kiln_hal_gemm_dims_t *out_dims) {
  const char *op = "gemm";
  const kiln_hal_tensor_t *a = &g->a, *b = &g->b, *c = &g->c;
  kiln_hal_error_t *e;
  if (out_dims) memset(out_dims, 0, sizeof(*out_dims));
  if ((e = kiln_hal_check_tensor(env, op, "a", a, KILN_HAL_DT_FLOAT, 0, false)) ||
      (e = kiln_hal_check_tensor(env, op, "b", b, KILN_HAL_DT_FLOAT, 0, false)) ||
      (e = kiln_hal_check_tensor(env, op, "c", c, KILN_HAL_DT_FLOAT, 0, false)))
    return e;
  if (a->ndim < 2 || b->ndim < 2 || c->ndim < 2 || a->ndim > 3 || b->ndim > 3 || c->ndim > 3)
    return kiln_hal_check_fail("gemm: a, b and c must have 2 or 3 dims (got %d, %d, %d)",
                               (int)a->ndim, (int)b->ndim, (int)c->ndim);
  if (a->ndim != c->ndim || b->ndim != c->ndim)
    return kiln_hal_check_fail(
        "gemm: a, b and c must have the same number of dims (got %d, %d, %d); broadcast with a "
        "batch stride of 0",
        (int)a->ndim, (int)b->ndim, (int)c->ndim);
  if (a->dtype != b->dtype)
    return kiln_hal_check_fail("gemm: a is %s but b is %s (they must match)",
                               kiln_hal_dtype_name(a->dtype), kiln_hal_dtype_name(b->dtype));
  if (c->dtype != a->dtype && c->dtype != KILN_HAL_F32)
    return kiln_hal_check_fail("gemm: c is %s, want %s or f32", kiln_hal_dtype_name(c->dtype),
                               kiln_hal_dtype_name(a->dtype));
  int64_t M = a->shape[a->ndim - 2], K = a->shape[a->ndim - 1];
  int64_t Kb = b->shape[b->ndim - 2], N = b->shape[b->ndim - 1];
  if (K != Kb)
    return kiln_hal_check_fail("gemm: a is [%lld, %lld] but b is [%lld, %lld] (inner dims differ)",
                               (long long)M, (long long)K, (long long)Kb, (long long)N);
  if (c->shape[c->ndim - 2] != M || c->shape[c->ndim - 1] != N)
    return kiln_hal_check_fail("gemm: c is [%lld, %lld], want [M, N] = [%lld, %lld]",
                               (long long)c->shape[c->ndim - 2], (long long)c->shape[c->ndim - 1],
                               (long long)M, (long long)N);
  int64_t batch = c->ndim == 3 ? c->shape[0] : 1;
  int64_t sa = 0, sb = 0, sc = c->ndim == 3 ? c->stride[0] : 0;
  if (a->ndim == 3) {
    if (a->shape[0] != batch && a->shape[0] != 1)
      return kiln_hal_check_fail("gemm: a has batch %lld, c has batch %lld", (long long)a->shape[0],
                                 (long long)batch);
    sa = a->shape[0] == 1 ? 0 : a->stride[0];
  }
  if (b->ndim == 3) {
    if (b->shape[0] != batch && b->shape[0] != 1)
      return kiln_hal_check_fail("gemm: b has batch %lld, c has batch %lld", (long long)b->shape[0],
                                 (long long)batch);
    sb = b->shape[0] == 1 ? 0 : b->stride[0];
  }
  if ((e = kiln_hal_gemm_layout("a", a)) || (e = kiln_hal_gemm_layout("b", b))) return e;
  int64_t crs = c->stride[c->ndim - 2], ccs = c->stride[c->ndim - 1];
  if (ccs != 1 && N > 1)
    return kiln_hal_check_fail("gemm: c must be row-major (stride[-1] == 1), got stride %lld",
                               (long long)ccs);
  if (M > 1 && crs < N)
    return kiln_hal_check_fail("gemm: c rows overlap (row stride %lld < N = %lld)", (long long)crs,
                               (long long)N);
  /* Batches of c must not share an element: batch i+1 starts after batch i's last one. */
  int64_t ldc = M > 1 ? crs : (N > 1 ? N : 1);
  if (batch > 1 && M > 0 && N > 0 && sc < ldc * (M - 1) + N)
    return kiln_hal_check_fail("gemm: c's batches overlap (batch stride %lld, a batch spans %lld)",
                               (long long)sc, (long long)(ldc * (M - 1) + N));
  if (g->bias.buffer) {
    if ((e = kiln_hal_check_tensor(env, op, "bias", &g->bias, KILN_HAL_DT(c->dtype), 1, true)))
      return e;
    if (g->bias.shape[0] != N)
      return kiln_hal_check_fail("gemm: bias has %lld elements, want N = %lld",
                                 (long long)g->bias.shape[0], (long long)N);
  }
  if (out_dims) {
    out_dims->batch = batch;
    out_dims->M = M;
    out_dims->N = N;
    out_dims->K = K;
    out_dims->batch_stride_a = sa;
    out_dims->batch_stride_b = sb;
    out_dims->batch_stride_c = sc;
  }
  return NULL;
}

static inline kiln_hal_error_t *kiln_hal_check_embedding(const kiln_hal_check_env_t *env,
                                                         const kiln_hal_embedding_args_t *a) {
  const char *op = "embedding";
  kiln_hal_error_t *e;
  if ((e = kiln_hal_check_tensor(env, op, "table", &a->table, KILN_HAL_DT_FLOAT, 2, true)) ||
      (e = kiln_hal_check_tensor(env, op, "ids", &a->ids, KILN_HAL_DT(KILN_HAL_I32), 1, true)) ||
      (e = kiln_hal_check_tensor(env, op, "out", &a->out, KILN_HAL_DT(a->table.dtype), 2, true)))
    return e;
  int64_t T = a->ids.shape[0], H = a->table.shape[1];
  if (a->out.shape[0] != T || a->out.shape[1] != H)
    return kiln_hal_check_fail("embedding: out is [%lld, %lld], want [T, H] = [%lld, %lld]",
                               (long long)a->out.shape[0], (long long)a->out.shape[1], (long long)T,
                               (long long)H);
  return NULL;
}

static inline kiln_hal_error_t *kiln_hal_check_rmsnorm(const kiln_hal_check_env_t *env,
                                                       const kiln_hal_rmsnorm_args_t *a) {
  const char *op = "rmsnorm";
  kiln_hal_error_t *e;
  if ((e = kiln_hal_check_tensor(env, op, "x", &a->x, KILN_HAL_DT_FLOAT, 2, true))) return e;
  uint32_t dt = KILN_HAL_DT(a->x.dtype);
  if ((e = kiln_hal_check_tensor(env, op, "out", &a->out, dt, 2, true)) ||
      (e = kiln_hal_check_tensor(env, op, "weight", &a->weight, dt, 1, true)) ||
      (e = kiln_hal_check_same_shape(op, "x", &a->x, "out", &a->out)))
    return e;
  if (a->residual.buffer) {
    if ((e = kiln_hal_check_tensor(env, op, "residual", &a->residual, dt, 2, true)) ||
        (e = kiln_hal_check_same_shape(op, "x", &a->x, "residual", &a->residual)))
      return e;
    if (kiln_hal_tensor_overlap(&a->out, &a->residual))
      return kiln_hal_check_fail("rmsnorm: out must not alias residual");
  }
  if (a->weight.shape[0] != a->x.shape[1])
    return kiln_hal_check_fail("rmsnorm: weight has %lld elements, x has H=%lld",
                               (long long)a->weight.shape[0], (long long)a->x.shape[1]);
  if (!(a->eps >= 0.0f && a->eps <= FLT_MAX))
    return kiln_hal_check_fail("rmsnorm: eps is %g, want a finite value >= 0", (double)a->eps);
  return NULL;
}

/* layernorm (ABI 1.2): rmsnorm's rules plus the optional bias. */
static inline kiln_hal_error_t *kiln_hal_check_layernorm(const kiln_hal_check_env_t *env,
                                                         const kiln_hal_layernorm_args_t *a) {
  const char *op = "layernorm";
  kiln_hal_error_t *e;
  if ((e = kiln_hal_check_tensor(env, op, "x", &a->x, KILN_HAL_DT_FLOAT, 2, true))) return e;
  uint32_t dt = KILN_HAL_DT(a->x.dtype);
  if ((e = kiln_hal_check_tensor(env, op, "out", &a->out, dt, 2, true)) ||
      (e = kiln_hal_check_tensor(env, op, "weight", &a->weight, dt, 1, true)) ||
      (e = kiln_hal_check_same_shape(op, "x", &a->x, "out", &a->out)))
    return e;
  if (a->residual.buffer) {
    if ((e = kiln_hal_check_tensor(env, op, "residual", &a->residual, dt, 2, true)) ||
        (e = kiln_hal_check_same_shape(op, "x", &a->x, "residual", &a->residual)))
      return e;
    if (kiln_hal_tensor_overlap(&a->out, &a->residual))
      return kiln_hal_check_fail("layernorm: out must not alias residual");
  }
  if (a->weight.shape[0] != a->x.shape[1])
    return kiln_hal_check_fail("layernorm: weight has %lld elements, x has H=%lld",
                               (long long)a->weight.shape[0], (long long)a->x.shape[1]);
  if (a->bias.buffer) {
    if ((e = kiln_hal_check_tensor(env, op, "bias", &a->bias, dt, 1, true))) return e;
    if (a->bias.shape[0] != a->x.shape[1])
      return kiln_hal_check_fail("layernorm: bias has %lld elements, x has H=%lld",
                                 (long long)a->bias.shape[0], (long long)a->x.shape[1]);
  }
  if (!(a->eps >= 0.0f && a->eps <= FLT_MAX))
    return kiln_hal_check_fail("layernorm: eps is %g, want a finite value >= 0", (double)a->eps);
  return NULL;
}

static inline kiln_hal_error_t *kiln_hal_check_rope(const kiln_hal_check_env_t *env,
                                                    const kiln_hal_rope_args_t *a) {
  const char *op = "rope";
  kiln_hal_error_t *e;
  if (a->style != KILN_HAL_ROPE_NEOX && a->style != KILN_HAL_ROPE_INTERLEAVED)
    return kiln_hal_check_fail("rope: unknown style %d", (int)a->style);
  if ((e = kiln_hal_check_tensor(env, op, "positions", &a->positions, KILN_HAL_DT(KILN_HAL_I32), 1,
                                 true)) ||
      (e = kiln_hal_check_tensor(env, op, "cos_sin", &a->cos_sin, KILN_HAL_DT(KILN_HAL_F32), 2,
                                 true)))
    return e;
  int64_t T = a->positions.shape[0], R = a->cos_sin.shape[1];
  if (R % 2 != 0)
    return kiln_hal_check_fail("rope: cos_sin has an odd rotary dim R = %lld", (long long)R);
  const kiln_hal_tensor_t *xs[2] = {&a->q, &a->k};
  const char *names[2] = {"q", "k"};
  for (int i = 0; i < 2; i++) {
    if (!xs[i]->buffer) continue;
    if ((e = kiln_hal_check_tensor(env, op, names[i], xs[i], KILN_HAL_DT_FLOAT, 3, true))) return e;
    if (xs[i]->shape[0] != T)
      return kiln_hal_check_fail("rope: %s has %lld tokens, positions has %lld", names[i],
                                 (long long)xs[i]->shape[0], (long long)T);
    if (xs[i]->shape[2] < R)
      return kiln_hal_check_fail("rope: %s has head dim %lld < rotary dim R = %lld", names[i],
                                 (long long)xs[i]->shape[2], (long long)R);
  }
  if (a->q.buffer && a->k.buffer && (a->k.shape[2] != a->q.shape[2] || a->k.dtype != a->q.dtype))
    return kiln_hal_check_fail(
        "rope: k is %s with head dim %lld, q is %s with head dim %lld "
        "(they must match)",
        kiln_hal_dtype_name(a->k.dtype), (long long)a->k.shape[2], kiln_hal_dtype_name(a->q.dtype),
        (long long)a->q.shape[2]);
  return NULL;
}

/* True for a kiln_hal_act_t this header knows (ABI 1.2: SILU, GELU_TANH, GELU, QUICK_GELU). */
static inline bool kiln_hal_act_valid(int32_t act) {
  return act == KILN_HAL_ACT_SILU || act == KILN_HAL_ACT_GELU_TANH || act == KILN_HAL_ACT_GELU ||
         act == KILN_HAL_ACT_QUICK_GELU;
}

static inline kiln_hal_error_t *kiln_hal_check_silu_mul(const kiln_hal_check_env_t *env,
                                                        const kiln_hal_silu_mul_args_t *a) {
  const char *op = "silu_mul";
  kiln_hal_error_t *e;
  if (!kiln_hal_act_valid(a->act))
    return kiln_hal_check_fail("silu_mul: unknown activation %d", (int)a->act);
  if ((e = kiln_hal_check_tensor(env, op, "x", &a->x, KILN_HAL_DT_FLOAT, 2, true)) ||
      (e = kiln_hal_check_tensor(env, op, "out", &a->out, KILN_HAL_DT(a->x.dtype), 2, true)))
    return e;
  if (a->out.shape[0] != a->x.shape[0] || a->x.shape[1] != 2 * a->out.shape[1])
    return kiln_hal_check_fail(
        "silu_mul: x is [%lld, %lld] and out is [%lld, %lld], want [T, 2I] and [T, I]",
        (long long)a->x.shape[0], (long long)a->x.shape[1], (long long)a->out.shape[0],
        (long long)a->out.shape[1]);
  return NULL;
}

/* activation (ABI 1.2). */
static inline kiln_hal_error_t *kiln_hal_check_activation(const kiln_hal_check_env_t *env,
                                                          const kiln_hal_activation_args_t *a) {
  const char *op = "activation";
  kiln_hal_error_t *e;
  if (!kiln_hal_act_valid(a->act))
    return kiln_hal_check_fail("activation: unknown activation %d", (int)a->act);
  if ((e = kiln_hal_check_tensor(env, op, "x", &a->x, KILN_HAL_DT_FLOAT, 2, true)) ||
      (e = kiln_hal_check_tensor(env, op, "out", &a->out, KILN_HAL_DT(a->x.dtype), 2, true)) ||
      (e = kiln_hal_check_same_shape(op, "x", &a->x, "out", &a->out)))
    return e;
  return NULL;
}

static inline kiln_hal_error_t *kiln_hal_check_add(const kiln_hal_check_env_t *env,
                                                   const kiln_hal_add_args_t *a) {
  const char *op = "add";
  kiln_hal_error_t *e;
  if ((e = kiln_hal_check_tensor(env, op, "a", &a->a, KILN_HAL_DT_FLOAT, 2, true))) return e;
  uint32_t dt = KILN_HAL_DT(a->a.dtype);
  if ((e = kiln_hal_check_tensor(env, op, "b", &a->b, dt, 2, true)) ||
      (e = kiln_hal_check_tensor(env, op, "out", &a->out, dt, 2, true)) ||
      (e = kiln_hal_check_same_shape(op, "a", &a->a, "b", &a->b)) ||
      (e = kiln_hal_check_same_shape(op, "a", &a->a, "out", &a->out)))
    return e;
  return NULL;
}

static inline kiln_hal_error_t *kiln_hal_check_copy(const kiln_hal_check_env_t *env,
                                                    const kiln_hal_copy_args_t *a) {
  const char *op = "copy";
  kiln_hal_error_t *e;
  if ((e = kiln_hal_check_tensor(env, op, "src", &a->src, KILN_HAL_DT_ANY, 0, false)) ||
      (e = kiln_hal_check_tensor(env, op, "dst", &a->dst, KILN_HAL_DT_ANY, 0, false)) ||
      (e = kiln_hal_check_same_shape(op, "src", &a->src, "dst", &a->dst)))
    return e;
  bool sf = (KILN_HAL_DT_FLOAT & KILN_HAL_DT(a->src.dtype)) != 0;
  bool df = (KILN_HAL_DT_FLOAT & KILN_HAL_DT(a->dst.dtype)) != 0;
  if (!(sf && df) && a->src.dtype != a->dst.dtype)
    return kiln_hal_check_fail(
        "copy: cannot convert %s to %s (float dtypes convert; integer dtypes must match)",
        kiln_hal_dtype_name(a->src.dtype), kiln_hal_dtype_name(a->dst.dtype));
  return NULL;
}

/* The 1.7 members shared by kv_write and attention: kv_format and, for FP8, the scales. Also
 * gives the dtype mask the caches must have (the float dtype dt_float, or U8 for FP8). */
static inline kiln_hal_error_t *kiln_hal_check_kv_format(const char *op, int32_t kv_format,
                                                         float k_scale, float v_scale,
                                                         uint32_t dt_float, uint32_t *cache_dt) {
  if (kv_format == KILN_HAL_KV_FLOAT) {
    *cache_dt = dt_float;
    return NULL;
  }
  if (kv_format != KILN_HAL_KV_FP8_E4M3)
    return kiln_hal_check_fail("%s: kv_format = %d is not one of float (0) and fp8_e4m3 (1)", op,
                               (int)kv_format);
  if (!(k_scale > 0.0f && k_scale <= FLT_MAX) || !(v_scale > 0.0f && v_scale <= FLT_MAX))
    return kiln_hal_check_fail("%s: FP8 KV cache scales k_scale = %g, v_scale = %g, want finite "
                               "values > 0",
                               op, (double)k_scale, (double)v_scale);
  *cache_dt = KILN_HAL_DT(KILN_HAL_U8);
  return NULL;
}

static inline kiln_hal_error_t *kiln_hal_check_kv_write(const kiln_hal_check_env_t *env,
                                                        const kiln_hal_kv_write_args_t *a) {
  const char *op = "kv_write";
  kiln_hal_error_t *e;
  if ((e = kiln_hal_check_tensor(env, op, "k", &a->k, KILN_HAL_DT_FLOAT, 3, true))) return e;
  uint32_t dt = KILN_HAL_DT(a->k.dtype), cdt = dt;
  if ((e = kiln_hal_check_kv_format(op, a->kv_format, a->k_scale, a->v_scale, dt, &cdt)) ||
      (e = kiln_hal_check_tensor(env, op, "k_cache", &a->k_cache, cdt, 4, true)) ||
      (e = kiln_hal_check_tensor(env, op, "v_cache", &a->v_cache, cdt, 4, true)) ||
      (e = kiln_hal_check_tensor(env, op, "v", &a->v, dt, 3, true)) ||
      (e = kiln_hal_check_tensor(env, op, "slot_mapping", &a->slot_mapping,
                                 KILN_HAL_DT(KILN_HAL_I32), 1, true)) ||
      (e = kiln_hal_check_same_shape(op, "k_cache", &a->k_cache, "v_cache", &a->v_cache)) ||
      (e = kiln_hal_check_same_shape(op, "k", &a->k, "v", &a->v)))
    return e;
  int64_t T = a->k.shape[0], NKV = a->k.shape[1], D = a->k.shape[2];
  if (a->slot_mapping.shape[0] != T)
    return kiln_hal_check_fail("kv_write: slot_mapping has %lld entries, k has T=%lld",
                               (long long)a->slot_mapping.shape[0], (long long)T);
  if (a->k_cache.shape[1] != NKV || a->k_cache.shape[3] != D)
    return kiln_hal_check_fail(
        "kv_write: k is [T, %lld, %lld] but the cache is [NB, %lld, BS, %lld]", (long long)NKV,
        (long long)D, (long long)a->k_cache.shape[1], (long long)a->k_cache.shape[3]);
  if (!kiln_hal_tensor_is_contiguous(&a->k_cache) || !kiln_hal_tensor_is_contiguous(&a->v_cache))
    return kiln_hal_check_fail("kv_write: k_cache and v_cache must be dense");
  return NULL;
}

static inline kiln_hal_error_t *kiln_hal_check_attention(const kiln_hal_check_env_t *env,
                                                         const kiln_hal_attention_args_t *a) {
  const char *op = "attention";
  const uint32_t i32 = KILN_HAL_DT(KILN_HAL_I32);
  kiln_hal_error_t *e;
  if ((e = kiln_hal_check_tensor(env, op, "q", &a->q, KILN_HAL_DT_FLOAT, 3, true))) return e;
  uint32_t dt = KILN_HAL_DT(a->q.dtype), cdt = dt;
  if ((e = kiln_hal_check_kv_format(op, a->kv_format, a->k_scale, a->v_scale, dt, &cdt)) ||
      (e = kiln_hal_check_tensor(env, op, "out", &a->out, dt, 3, true)) ||
      (e = kiln_hal_check_tensor(env, op, "k_cache", &a->k_cache, cdt, 4, true)) ||
      (e = kiln_hal_check_tensor(env, op, "v_cache", &a->v_cache, cdt, 4, true)) ||
      (e = kiln_hal_check_tensor(env, op, "block_table", &a->block_table, i32, 2, true)) ||
      (e = kiln_hal_check_tensor(env, op, "seq_lens", &a->seq_lens, i32, 1, true)) ||
      (e = kiln_hal_check_tensor(env, op, "query_start_loc", &a->query_start_loc, i32, 1, true)) ||
      (e = kiln_hal_check_same_shape(op, "q", &a->q, "out", &a->out)) ||
      (e = kiln_hal_check_same_shape(op, "k_cache", &a->k_cache, "v_cache", &a->v_cache)))
    return e;
  int64_t NH = a->q.shape[1], D = a->q.shape[2], NKV = a->k_cache.shape[1];
  if (a->k_cache.shape[3] != D)
    return kiln_hal_check_fail("attention: q has head dim %lld, the cache %lld", (long long)D,
                               (long long)a->k_cache.shape[3]);
  if (!kiln_hal_tensor_is_contiguous(&a->k_cache) || !kiln_hal_tensor_is_contiguous(&a->v_cache))
    return kiln_hal_check_fail("attention: k_cache and v_cache must be dense");
  if (NKV == 0 || NH % NKV != 0)
    return kiln_hal_check_fail("attention: %lld query heads is not a multiple of %lld KV heads",
                               (long long)NH, (long long)NKV);
  if (a->k_cache.shape[2] == 0) return kiln_hal_check_fail("attention: block size is 0");
  int64_t S = a->num_seqs;
  if (S < 0 || a->block_table.shape[0] != S || a->seq_lens.shape[0] != S ||
      a->query_start_loc.shape[0] != S + 1)
    return kiln_hal_check_fail(
        "attention: num_seqs = %lld but block_table has %lld rows, seq_lens %lld entries and "
        "query_start_loc %lld (want S, S, S + 1)",
        (long long)S, (long long)a->block_table.shape[0], (long long)a->seq_lens.shape[0],
        (long long)a->query_start_loc.shape[0]);
  if (a->max_query_len < 0 || a->max_seq_len < 0)
    return kiln_hal_check_fail("attention: max_query_len = %d, max_seq_len = %d, want >= 0",
                               (int)a->max_query_len, (int)a->max_seq_len);
  if (a->sliding_window < 0)
    return kiln_hal_check_fail("attention: sliding_window = %d, want >= 0", (int)a->sliding_window);
  if (!(a->softcap >= 0.0f && a->softcap <= FLT_MAX))
    return kiln_hal_check_fail("attention: softcap = %g, want a finite value >= 0",
                               (double)a->softcap);
  if (!(a->scale >= -FLT_MAX && a->scale <= FLT_MAX))
    return kiln_hal_check_fail("attention: scale is not finite");
  return NULL;
}

/* logits: [S, V] F32, contiguous rows, V > 0 unless S == 0. */
static inline kiln_hal_error_t *kiln_hal_check_logits(const kiln_hal_check_env_t *env,
                                                      const char *op, const kiln_hal_tensor_t *t) {
  kiln_hal_error_t *e =
      kiln_hal_check_tensor(env, op, "logits", t, KILN_HAL_DT(KILN_HAL_F32), 2, true);
  if (!e && t->shape[1] == 0 && t->shape[0] > 0)
    e = kiln_hal_check_fail("%s: logits has V = 0 (no token to choose)", op);
  return e;
}

static inline kiln_hal_error_t *kiln_hal_check_argmax(const kiln_hal_check_env_t *env,
                                                      const kiln_hal_argmax_args_t *a) {
  const char *op = "argmax";
  kiln_hal_error_t *e;
  if ((e = kiln_hal_check_logits(env, op, &a->logits))) return e;
  int64_t S = a->logits.shape[0];
  if ((e = kiln_hal_check_vec(env, op, "out_ids", &a->out_ids, KILN_HAL_I32, S, false)) ||
      (e = kiln_hal_check_vec(env, op, "out_logprob", &a->out_logprob, KILN_HAL_F32, S, true)))
    return e;
  return NULL;
}

static inline kiln_hal_error_t *kiln_hal_check_topk(const kiln_hal_check_env_t *env,
                                                    const kiln_hal_topk_args_t *a) {
  const char *op = "topk";
  kiln_hal_error_t *e;
  if ((e = kiln_hal_check_logits(env, op, &a->logits)) ||
      (e = kiln_hal_check_tensor(env, op, "out_values", &a->out_values, KILN_HAL_DT(KILN_HAL_F32),
                                 2, true)) ||
      (e = kiln_hal_check_tensor(env, op, "out_ids", &a->out_ids, KILN_HAL_DT(KILN_HAL_I32), 2,
                                 true)))
    return e;
  int64_t S = a->logits.shape[0], V = a->logits.shape[1], k = a->out_values.shape[1];
  if (a->out_values.shape[0] != S || a->out_ids.shape[0] != S || a->out_ids.shape[1] != k)
    return kiln_hal_check_fail(
        "topk: out_values is [%lld, %lld] and out_ids [%lld, %lld], want both [S = %lld, k]",
        (long long)a->out_values.shape[0], (long long)k, (long long)a->out_ids.shape[0],
        (long long)a->out_ids.shape[1], (long long)S);
  if (k > V)
    return kiln_hal_check_fail("topk: k = %lld exceeds V = %lld", (long long)k, (long long)V);
  return kiln_hal_check_vec(env, op, "out_lse", &a->out_lse, KILN_HAL_F32, S, true);
}

/* A flattened token list of penalize: ids [N] I32 and offsets [S + 1] I32, both or neither. */
static inline kiln_hal_error_t *kiln_hal_check_token_list(const kiln_hal_check_env_t *env,
                                                          const char *ids_name,
                                                          const kiln_hal_tensor_t *ids,
                                                          const char *off_name,
                                                          const kiln_hal_tensor_t *off, int64_t S) {
  const char *op = "penalize";
  kiln_hal_error_t *e;
  if (!ids->buffer && !off->buffer) return NULL;
  if (!ids->buffer || !off->buffer)
    return kiln_hal_check_fail("penalize: %s and %s must both be present or both absent", ids_name,
                               off_name);
  if ((e = kiln_hal_check_tensor(env, op, ids_name, ids, KILN_HAL_DT(KILN_HAL_I32), 1, true)) ||
      (e = kiln_hal_check_vec(env, op, off_name, off, KILN_HAL_I32, S + 1, false)))
    return e;
  return NULL;
}

static inline kiln_hal_error_t *kiln_hal_check_penalize(const kiln_hal_check_env_t *env,
                                                        const kiln_hal_penalize_args_t *a) {
  const char *op = "penalize";
  kiln_hal_error_t *e;
  if ((e = kiln_hal_check_logits(env, op, &a->logits))) return e;
  int64_t S = a->logits.shape[0];
  if ((e = kiln_hal_check_token_list(env, "prompt_ids", &a->prompt_ids, "prompt_offsets",
                                     &a->prompt_offsets, S)) ||
      (e = kiln_hal_check_token_list(env, "output_ids", &a->output_ids, "output_offsets",
                                     &a->output_offsets, S)) ||
      (e = kiln_hal_check_vec(env, op, "repetition", &a->repetition, KILN_HAL_F32, S, true)) ||
      (e = kiln_hal_check_vec(env, op, "frequency", &a->frequency, KILN_HAL_F32, S, true)) ||
      (e = kiln_hal_check_vec(env, op, "presence", &a->presence, KILN_HAL_F32, S, true)))
    return e;
  if (!a->frequency.buffer != !a->presence.buffer)
    return kiln_hal_check_fail("penalize: frequency and presence must both be present or both "
                               "absent");
  if (a->frequency.buffer && !a->output_ids.buffer)
    return kiln_hal_check_fail("penalize: frequency/presence need output_ids and output_offsets");
  if (a->bias_ids.buffer || a->bias_values.buffer || a->bias_offsets.buffer) {
    if (!a->bias_ids.buffer || !a->bias_values.buffer || !a->bias_offsets.buffer)
      return kiln_hal_check_fail(
          "penalize: bias_ids, bias_values and bias_offsets must all be present or all absent");
    if ((e = kiln_hal_check_token_list(env, "bias_ids", &a->bias_ids, "bias_offsets",
                                       &a->bias_offsets, S)) ||
        (e = kiln_hal_check_vec(env, op, "bias_values", &a->bias_values, KILN_HAL_F32,
                                a->bias_ids.shape[0], false)))
      return e;
  }
  return NULL;
}

static inline kiln_hal_error_t *kiln_hal_check_sample(const kiln_hal_check_env_t *env,
                                                      const kiln_hal_sample_args_t *a) {
  const char *op = "sample";
  kiln_hal_error_t *e;
  if ((e = kiln_hal_check_logits(env, op, &a->logits))) return e;
  int64_t S = a->logits.shape[0];
  /* top_k, top_p and min_p may be absent: that filter is off. */
  if ((e = kiln_hal_check_vec(env, op, "temperature", &a->temperature, KILN_HAL_F32, S, false)) ||
      (e = kiln_hal_check_vec(env, op, "uniform", &a->uniform, KILN_HAL_F32, S, false)) ||
      (e = kiln_hal_check_vec(env, op, "out_ids", &a->out_ids, KILN_HAL_I32, S, false)) ||
      (e = kiln_hal_check_vec(env, op, "top_k", &a->top_k, KILN_HAL_I32, S, true)) ||
      (e = kiln_hal_check_vec(env, op, "top_p", &a->top_p, KILN_HAL_F32, S, true)) ||
      (e = kiln_hal_check_vec(env, op, "min_p", &a->min_p, KILN_HAL_F32, S, true)) ||
      (e = kiln_hal_check_vec(env, op, "out_logprob", &a->out_logprob, KILN_HAL_F32, S, true)))
    return e;
  return NULL;
}

/* mask_logits (ABI 1.3). */
static inline kiln_hal_error_t *kiln_hal_check_mask_logits(const kiln_hal_check_env_t *env,
                                                           const kiln_hal_mask_args_t *a) {
  const char *op = "mask_logits";
  kiln_hal_error_t *e;
  if ((e = kiln_hal_check_logits(env, op, &a->logits)) ||
      (e = kiln_hal_check_tensor(env, op, "mask", &a->mask, KILN_HAL_DT(KILN_HAL_I32), 2, true)))
    return e;
  int64_t S = a->logits.shape[0], V = a->logits.shape[1];
  if (a->mask.shape[1] * 32 < V)
    return kiln_hal_check_fail("mask_logits: mask rows have %lld words, V = %lld needs %lld",
                               (long long)a->mask.shape[1], (long long)V, (long long)((V + 31) / 32));
  if (!a->rows.buffer && a->mask.shape[0] != S)
    return kiln_hal_check_fail("mask_logits: without rows, mask must have S = %lld rows, not %lld",
                               (long long)S, (long long)a->mask.shape[0]);
  return kiln_hal_check_vec(env, op, "rows", &a->rows, KILN_HAL_I32, S, true);
}

/* The scales, zeros, g_idx and group_size of a group-format w (hal.h's kiln_hal_qweight_t). */
static inline kiln_hal_error_t *kiln_hal_check_qgroup(const kiln_hal_check_env_t *env,
                                                      const kiln_hal_qweight_t *w) {
  const char *op = "gemm_quant", *fmt = kiln_hal_qfmt_name(w->format);
  kiln_hal_error_t *e;
  if (w->group_size <= 0)
    return kiln_hal_check_fail("gemm_quant: w is %s: group_size must be > 0 (is %d)", fmt,
                               (int)w->group_size);
  const bool fp8 = w->format == KILN_HAL_QFMT_FP8_E4M3;
  if ((e = kiln_hal_check_tensor(env, op, "w.scales", &w->scales,
                                 KILN_HAL_DT(kiln_hal_qgroup_scale_dtype(w->format)), 2, true)))
    return e;
  if (fp8 && (w->zeros.buffer || w->g_idx.buffer))
    return kiln_hal_check_fail("gemm_quant: w is fp8_e4m3: zeros and g_idx must be absent");
  const int64_t G = w->scales.shape[1];
  if (w->scales.shape[0] != w->n || G < 1)
    return kiln_hal_check_fail(
        "gemm_quant: w.scales has shape [%lld, %lld], want [N = %lld, G >= 1]",
        (long long)w->scales.shape[0], (long long)G, (long long)w->n);
  if (w->zeros.buffer) {
    if ((e = kiln_hal_check_tensor(env, op, "w.zeros", &w->zeros, KILN_HAL_DT(KILN_HAL_U8), 2,
                                   true)) ||
        (e = kiln_hal_check_same_shape(op, "w.scales", &w->scales, "w.zeros", &w->zeros)))
      return e;
  }
  if (w->g_idx.buffer)
    return kiln_hal_check_vec(env, op, "w.g_idx", &w->g_idx, KILN_HAL_I32, w->k, false);
  const int64_t want = (w->k + w->group_size - 1) / w->group_size;
  if (G != want)
    return kiln_hal_check_fail(
        "gemm_quant: w.scales has %lld groups, want ceil(K / group_size) = ceil(%lld / %d) = %lld "
        "without g_idx",
        (long long)G, (long long)w->k, (int)w->group_size, (long long)want);
  return NULL;
}

/* gemm_quant (ABI 1.4): x [M, K] float, w a kiln_hal_qweight_t [N, K] whose rows lie inside
 * its buffer, y [M, N] in x's dtype or F32 not overlapping x or w, bias absent or [N] in y's
 * dtype. Whether the backend takes the format (KILN_HAL_CAP_QUANT) is the backend's check. */
static inline kiln_hal_error_t *kiln_hal_check_gemm_quant(const kiln_hal_check_env_t *env,
                                                          const kiln_hal_gemm_quant_args_t *a) {
  const char *op = "gemm_quant";
  kiln_hal_error_t *e;
  if ((e = kiln_hal_check_tensor(env, op, "x", &a->x, KILN_HAL_DT_FLOAT, 2, true))) return e;
  const uint32_t ydt = KILN_HAL_DT(a->x.dtype) | KILN_HAL_DT(KILN_HAL_F32);
  if ((e = kiln_hal_check_tensor(env, op, "y", &a->y, ydt, 2, true))) return e;
  const kiln_hal_qweight_t *w = &a->w;
  /* A group format's row is K codes: "blocks" of 2 codes per byte (INT4_G) or 1 (INT8_G). */
  const bool group = kiln_hal_qfmt_is_group(w->format);
  const int64_t E =
      group ? 8 / kiln_hal_qfmt_group_bits(w->format) : kiln_hal_qfmt_block_elems(w->format);
  const int64_t B = group ? 1 : kiln_hal_qfmt_block_bytes(w->format);
  if (!w->buffer) return kiln_hal_check_fail("gemm_quant: w is absent");
  if (E == 0)
    return kiln_hal_check_fail("gemm_quant: w has unknown format %d", (int)w->format);
  const char *fmt = kiln_hal_qfmt_name(w->format);
  if (a->x_quant != KILN_HAL_XQUANT_NONE && a->x_quant != KILN_HAL_XQUANT_FP8_TOKEN)
    return kiln_hal_check_fail("gemm_quant: x_quant %d is not a kiln_hal_xquant_t",
                               (int)a->x_quant);
  if (a->x_quant == KILN_HAL_XQUANT_FP8_TOKEN && w->format != KILN_HAL_QFMT_FP8_E4M3)
    return kiln_hal_check_fail(
        "gemm_quant: x_quant fp8_token needs FP8 weights, w is %s", fmt);
  if (!group && (w->group_size != 0 || w->scales.buffer || w->zeros.buffer || w->g_idx.buffer))
    return kiln_hal_check_fail(
        "gemm_quant: w is %s, whose blocks hold their scales: group_size must be 0 (is %d) and "
        "scales, zeros, g_idx absent",
        fmt, (int)w->group_size);
  if (w->n < 0 || w->n > KILN_HAL_CHECK_MAX_DIM || w->k <= 0 || w->k > KILN_HAL_CHECK_MAX_DIM ||
      w->k % E)
    return kiln_hal_check_fail(
        "gemm_quant: w is %s [%lld, %lld]: K must be a positive multiple of its %lld-weight "
        "block",
        fmt, (long long)w->n, (long long)w->k, (long long)E);
  const int64_t M = a->x.shape[0], K = a->x.shape[1], N = w->n;
  if (K != w->k)
    return kiln_hal_check_fail("gemm_quant: x has K = %lld columns but w has K = %lld",
                               (long long)K, (long long)w->k);
  if (a->y.shape[0] != M || a->y.shape[1] != N)
    return kiln_hal_check_fail("gemm_quant: y has shape [%lld, %lld], want [M, N] = [%lld, %lld]",
                               (long long)a->y.shape[0], (long long)a->y.shape[1], (long long)M,
                               (long long)N);
  const uint64_t row_bytes = (uint64_t)(K / E) * (uint64_t)B;
  if (w->row_stride < 0 || (uint64_t)w->row_stride < row_bytes || w->row_stride > ((int64_t)1 << 40))
    return kiln_hal_check_fail(
        "gemm_quant: w row_stride %lld bytes is below a row of %lld %s blocks (%llu bytes)",
        (long long)w->row_stride, (long long)(K / E), fmt, (unsigned long long)row_bytes);
  if (group && (e = kiln_hal_check_qgroup(env, w))) return e;
  if (env->check_buffer && (e = env->check_buffer(env->ctx, op, "w", w->buffer))) return e;
  const uint64_t size = env->buffer_size(env->ctx, w->buffer);
  const uint64_t wend = N ? (uint64_t)(N - 1) * (uint64_t)w->row_stride + row_bytes : 0;
  if (w->offset > size || wend > size - w->offset)
    return kiln_hal_check_fail(
        "gemm_quant: w (%lld rows of %llu bytes, stride %lld, offset %llu) runs past the end of "
        "its buffer of %llu bytes",
        (long long)N, (unsigned long long)row_bytes, (long long)w->row_stride,
        (unsigned long long)w->offset, (unsigned long long)size);
  if (kiln_hal_tensor_overlap(&a->y, &a->x))
    return kiln_hal_check_fail("gemm_quant: y overlaps x");
  if (a->y.buffer == w->buffer && N > 0) {
    uint64_t yend = kiln_hal_tensor_extent(&a->y);
    if (yend && a->y.offset < w->offset + wend && w->offset < yend)
      return kiln_hal_check_fail("gemm_quant: y overlaps w");
  }
  return kiln_hal_check_vec(env, op, "bias", &a->bias, a->y.dtype, N, true);
}

#ifdef __cplusplus
}
#endif

#endif /* KILN_HAL_CHECK_H */
