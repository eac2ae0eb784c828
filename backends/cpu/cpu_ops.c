/* cpu_ops.c - row-wise ops: embedding, rmsnorm, layernorm, rope, silu_mul, activation, add,
 * copy, kv_write. */
#include <math.h>
#include <string.h>

#include "cpu_internal.h"

/* Below this many elements an op runs on the calling thread: waking the pool costs more. */
#define PAR_MIN_ELEMS 32768

typedef struct rows_job {
  cpu_rows_fn fn;
  void *ctx;
  int64_t rows, per_task;
} rows_job_t;

static void rows_task(void *vctx, int64_t task, int thread) {
  const rows_job_t *j = vctx;
  int64_t r0 = task * j->per_task, r1 = r0 + j->per_task;
  if (r1 > j->rows) r1 = j->rows;
  j->fn(j->ctx, r0, r1, thread);
}

void cpu_parallel_rows(int64_t rows, int64_t elems_per_row, cpu_rows_fn fn, void *ctx) {
  if (rows <= 0) return;
  int64_t tasks = 1;
  if (rows * elems_per_row >= PAR_MIN_ELEMS) {
    tasks = 4 * (int64_t)cpu_num_threads();
    if (tasks > rows) tasks = rows;
  }
  rows_job_t j = {fn, ctx, rows, (rows + tasks - 1) / tasks};
  cpu_pool_run(cpu_g_pool, (rows + j.per_task - 1) / j.per_task, rows_task, &j);
}

/* Element offset of row r of a view whose rows are all dims but the last. */
static int64_t row_offset(const kiln_hal_tensor_t *t, int64_t r) {
  int64_t off = 0;
  for (int d = t->ndim - 2; d >= 0; d--) {
    off += (r % t->shape[d]) * t->stride[d];
    r /= t->shape[d];
  }
  return off;
}

static int64_t row_count(const kiln_hal_tensor_t *t) {
  int64_t n = 1;
  for (int d = 0; d < t->ndim - 1; d++) n *= t->shape[d];
  return n;
}

static char *elem_ptr(const kiln_hal_tensor_t *t, int64_t elem) {
  return (char *)cpu_tensor_ptr(t) + elem * (int64_t)kiln_hal_dtype_size(t->dtype);
}

static kiln_hal_error_t *oom(const char *op) {
  return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY, "%s: out of scratch memory", op);
}

/* ============================================================================================
 * embedding
 * ==========================================================================================*/

typedef struct emb_ctx {
  const kiln_hal_embedding_args_t *a;
  int64_t V, H;
} emb_ctx_t;

static void emb_rows(void *vctx, int64_t r0, int64_t r1, int thread) {
  (void)thread;
  const emb_ctx_t *c = vctx;
  const kiln_hal_embedding_args_t *a = c->a;
  size_t rowbytes = (size_t)c->H * kiln_hal_dtype_size(a->table.dtype);
  const int32_t *ids = cpu_tensor_ptr(&a->ids);
  for (int64_t t = r0; t < r1; t++) {
    int32_t id = ids[t * a->ids.stride[0]];
    char *dst = elem_ptr(&a->out, t * a->out.stride[0]);
    if (id >= 0 && id < c->V) memcpy(dst, elem_ptr(&a->table, id * a->table.stride[0]), rowbytes);
    else memset(dst, 0, rowbytes);
  }
}

kiln_hal_error_t *cpu_embedding(kiln_hal_stream_t *s, const kiln_hal_embedding_args_t *a,
                                bool dry_run) {
  (void)s;
  kiln_hal_error_t *e = kiln_hal_check_embedding(&cpu_check_env, a);
  if (e || dry_run) return e;
  int64_t T = a->ids.shape[0], V = a->table.shape[0], H = a->table.shape[1];
  emb_ctx_t c = {a, V, H};
  cpu_parallel_rows(T, H, emb_rows, &c);
  return NULL;
}

/* ============================================================================================
 * rmsnorm
 * ==========================================================================================*/

typedef struct norm_ctx {
  const kiln_hal_rmsnorm_args_t *a;
  int64_t H;
  const float *w; /* weight + weight_offset, F32 */
  float *tmp;     /* 2 * H floats per thread */
} norm_ctx_t;

static void norm_rows(void *vctx, int64_t r0, int64_t r1, int thread) {
  const norm_ctx_t *c = vctx;
  const kiln_hal_rmsnorm_args_t *a = c->a;
  int32_t dt = a->x.dtype;
  int64_t H = c->H;
  float *sv = c->tmp + (int64_t)thread * 2 * H, *rv = sv + H;
  bool res = kiln_hal_tensor_present(&a->residual);
  for (int64_t t = r0; t < r1; t++) {
    cpu_vec_to_f32(dt, elem_ptr(&a->x, t * a->x.stride[0]), sv, H);
    if (res) {
      char *rp = elem_ptr(&a->residual, t * a->residual.stride[0]);
      cpu_vec_to_f32(dt, rp, rv, H);
      for (int64_t i = 0; i < H; i++) sv[i] += rv[i];
      cpu_vec_from_f32(dt, sv, rp, H);
      cpu_vec_round(dt, sv, H);
    }
    float ms = H ? cpu_vec_dot(KILN_HAL_F32, sv, sv, H) / (float)H : 0.0f;
    float r = 1.0f / sqrtf(ms + a->eps);
    for (int64_t i = 0; i < H; i++) sv[i] *= r;
    cpu_vec_round(dt, sv, H);
    for (int64_t i = 0; i < H; i++) sv[i] *= c->w[i];
    cpu_vec_from_f32(dt, sv, elem_ptr(&a->out, t * a->out.stride[0]), H);
  }
}

kiln_hal_error_t *cpu_rmsnorm(kiln_hal_stream_t *s, const kiln_hal_rmsnorm_args_t *a,
                              bool dry_run) {
  kiln_hal_error_t *e = kiln_hal_check_rmsnorm(&cpu_check_env, a);
  int64_t T = a->x.shape[0], H = a->x.shape[1];
  if (e || dry_run || T == 0 || H == 0) return e;
  int threads = cpu_num_threads();
  float *w = cpu_scratch(s, (size_t)H * sizeof(float) * (1 + 2 * (size_t)threads));
  if (!w) return oom("rmsnorm");
  cpu_vec_to_f32(a->weight.dtype, cpu_tensor_ptr(&a->weight), w, H);
  for (int64_t i = 0; i < H; i++) w[i] += a->weight_offset;
  norm_ctx_t c = {a, H, w, w + H};
  cpu_parallel_rows(T, 4 * H, norm_rows, &c);
  return NULL;
}

/* ============================================================================================
 * layernorm
 * ==========================================================================================*/

typedef struct ln_ctx {
  const kiln_hal_layernorm_args_t *a;
  int64_t H;
  const float *w, *b; /* weight and bias (zeros when absent), F32 */
  float *tmp;         /* 2 * H floats per thread */
} ln_ctx_t;

static void ln_rows(void *vctx, int64_t r0, int64_t r1, int thread) {
  const ln_ctx_t *c = vctx;
  const kiln_hal_layernorm_args_t *a = c->a;
  int32_t dt = a->x.dtype;
  int64_t H = c->H;
  float *sv = c->tmp + (int64_t)thread * 2 * H, *rv = sv + H;
  bool res = kiln_hal_tensor_present(&a->residual);
  for (int64_t t = r0; t < r1; t++) {
    cpu_vec_to_f32(dt, elem_ptr(&a->x, t * a->x.stride[0]), sv, H);
    if (res) {
      char *rp = elem_ptr(&a->residual, t * a->residual.stride[0]);
      cpu_vec_to_f32(dt, rp, rv, H);
      for (int64_t i = 0; i < H; i++) sv[i] += rv[i];
      cpu_vec_from_f32(dt, sv, rp, H);
      cpu_vec_round(dt, sv, H);
    }
    /* Two passes in double: the mean first, then the centred squares, so a row with a large
     * mean and a small spread (LayerNorm's usual input) loses nothing to cancellation. */
    double sum = 0.0;
    for (int64_t i = 0; i < H; i++) sum += sv[i];
    float mean = (float)(sum / (double)H);
    double ss = 0.0;
    for (int64_t i = 0; i < H; i++) {
      sv[i] -= mean;
      ss += (double)sv[i] * sv[i];
    }
    float r = (float)(1.0 / sqrt(ss / (double)H + (double)a->eps));
    for (int64_t i = 0; i < H; i++) sv[i] = sv[i] * r * c->w[i] + c->b[i];
    cpu_vec_from_f32(dt, sv, elem_ptr(&a->out, t * a->out.stride[0]), H);
  }
}

kiln_hal_error_t *cpu_layernorm(kiln_hal_stream_t *s, const kiln_hal_layernorm_args_t *a,
                                bool dry_run) {
  kiln_hal_error_t *e = kiln_hal_check_layernorm(&cpu_check_env, a);
  int64_t T = a->x.shape[0], H = a->x.shape[1];
  if (e || dry_run || T == 0 || H == 0) return e;
  int threads = cpu_num_threads();
  float *w = cpu_scratch(s, (size_t)H * sizeof(float) * (2 + 2 * (size_t)threads));
  if (!w) return oom("layernorm");
  float *b = w + H;
  cpu_vec_to_f32(a->weight.dtype, cpu_tensor_ptr(&a->weight), w, H);
  if (kiln_hal_tensor_present(&a->bias))
    cpu_vec_to_f32(a->bias.dtype, cpu_tensor_ptr(&a->bias), b, H);
  else
    memset(b, 0, (size_t)H * sizeof(float));
  ln_ctx_t c = {a, H, w, b, b + H};
  cpu_parallel_rows(T, 4 * H, ln_rows, &c);
  return NULL;
}

/* ============================================================================================
 * rope
 * ==========================================================================================*/

typedef struct rope_ctx {
  const kiln_hal_rope_args_t *a;
  int64_t P, R;
  float *tmp; /* R floats per thread */
} rope_ctx_t;

static void rope_heads(const rope_ctx_t *c, const kiln_hal_tensor_t *x, int64_t t,
                       const float *cs, float *v) {
  int64_t R = c->R, half = R / 2;
  bool neox = c->a->style == KILN_HAL_ROPE_NEOX;
  for (int64_t h = 0; h < x->shape[1]; h++) {
    char *p = elem_ptr(x, t * x->stride[0] + h * x->stride[1]);
    cpu_vec_to_f32(x->dtype, p, v, R);
    for (int64_t i = 0; i < half; i++) {
      int64_t i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
      float x0 = v[i0], x1 = v[i1], co = cs[i], si = cs[half + i];
      v[i0] = x0 * co - x1 * si;
      v[i1] = x1 * co + x0 * si;
    }
    cpu_vec_from_f32(x->dtype, v, p, R);
  }
}

static void rope_rows(void *vctx, int64_t r0, int64_t r1, int thread) {
  const rope_ctx_t *c = vctx;
  const kiln_hal_rope_args_t *a = c->a;
  const int32_t *pos = cpu_tensor_ptr(&a->positions);
  float *v = c->tmp + (int64_t)thread * c->R;
  for (int64_t t = r0; t < r1; t++) {
    int32_t p = pos[t * a->positions.stride[0]];
    if (p < 0 || p >= c->P) continue;
    const float *cs = (const float *)cpu_tensor_ptr(&a->cos_sin) + (int64_t)p * a->cos_sin.stride[0];
    if (kiln_hal_tensor_present(&a->q)) rope_heads(c, &a->q, t, cs, v);
    if (kiln_hal_tensor_present(&a->k)) rope_heads(c, &a->k, t, cs, v);
  }
}

kiln_hal_error_t *cpu_rope(kiln_hal_stream_t *s, const kiln_hal_rope_args_t *a, bool dry_run) {
  kiln_hal_error_t *e = kiln_hal_check_rope(&cpu_check_env, a);
  if (e) return e;
  int64_t T = a->positions.shape[0], P = a->cos_sin.shape[0], R = a->cos_sin.shape[1];
  if (dry_run || T == 0 || R == 0) return NULL;
  int threads = cpu_num_threads();
  float *tmp = cpu_scratch(s, (size_t)R * sizeof(float) * (size_t)threads);
  if (!tmp) return oom("rope");
  rope_ctx_t c = {a, P, R, tmp};
  int64_t heads = (kiln_hal_tensor_present(&a->q) ? a->q.shape[1] : 0) +
                  (kiln_hal_tensor_present(&a->k) ? a->k.shape[1] : 0);
  cpu_parallel_rows(T, heads * R, rope_rows, &c);
  return NULL;
}

/* ============================================================================================
 * silu_mul (gated activations)
 * ==========================================================================================*/

typedef struct act_ctx {
  const kiln_hal_silu_mul_args_t *a;
  int64_t I;
  float *tmp; /* 2 * I floats per thread */
} act_ctx_t;

static void act_rows(void *vctx, int64_t r0, int64_t r1, int thread) {
  const act_ctx_t *c = vctx;
  const kiln_hal_silu_mul_args_t *a = c->a;
  int64_t I = c->I;
  float *g = c->tmp + (int64_t)thread * 2 * I, *u = g + I;
  for (int64_t t = r0; t < r1; t++) {
    const char *x = elem_ptr(&a->x, t * a->x.stride[0]);
    cpu_vec_to_f32(a->x.dtype, x, g, 2 * I);
    cpu_vec_act_mul(a->act, g, u, I);
    cpu_vec_from_f32(a->out.dtype, g, elem_ptr(&a->out, t * a->out.stride[0]), I);
  }
}

kiln_hal_error_t *cpu_silu_mul(kiln_hal_stream_t *s, const kiln_hal_silu_mul_args_t *a,
                               bool dry_run) {
  kiln_hal_error_t *e = kiln_hal_check_silu_mul(&cpu_check_env, a);
  if (e) return e;
  int64_t T = a->x.shape[0], I = a->out.shape[1];
  if (dry_run || T == 0 || I == 0) return NULL;
  float *tmp = cpu_scratch(s, (size_t)I * 2 * sizeof(float) * (size_t)cpu_num_threads());
  if (!tmp) return oom("silu_mul");
  act_ctx_t c = {a, I, tmp};
  cpu_parallel_rows(T, 4 * I, act_rows, &c);
  return NULL;
}

/* ============================================================================================
 * activation (elementwise)
 * ==========================================================================================*/

typedef struct actv_ctx {
  const kiln_hal_activation_args_t *a;
  int64_t N;
  float *tmp; /* N floats per thread */
} actv_ctx_t;

static void actv_rows(void *vctx, int64_t r0, int64_t r1, int thread) {
  const actv_ctx_t *c = vctx;
  const kiln_hal_activation_args_t *a = c->a;
  float *v = c->tmp + (int64_t)thread * c->N;
  for (int64_t t = r0; t < r1; t++) {
    cpu_vec_to_f32(a->x.dtype, elem_ptr(&a->x, t * a->x.stride[0]), v, c->N);
    cpu_vec_act(a->act, v, c->N);
    cpu_vec_from_f32(a->out.dtype, v, elem_ptr(&a->out, t * a->out.stride[0]), c->N);
  }
}

kiln_hal_error_t *cpu_activation(kiln_hal_stream_t *s, const kiln_hal_activation_args_t *a,
                                 bool dry_run) {
  kiln_hal_error_t *e = kiln_hal_check_activation(&cpu_check_env, a);
  if (e) return e;
  int64_t T = a->x.shape[0], N = a->x.shape[1];
  if (dry_run || T == 0 || N == 0) return NULL;
  float *tmp = cpu_scratch(s, (size_t)N * sizeof(float) * (size_t)cpu_num_threads());
  if (!tmp) return oom("activation");
  actv_ctx_t c = {a, N, tmp};
  cpu_parallel_rows(T, 4 * N, actv_rows, &c);
  return NULL;
}

/* ============================================================================================
 * add
 * ==========================================================================================*/

typedef struct add_ctx {
  const kiln_hal_add_args_t *a;
  int64_t H;
  float *tmp; /* 2 * H floats per thread */
} add_ctx_t;

static void add_rows(void *vctx, int64_t r0, int64_t r1, int thread) {
  const add_ctx_t *c = vctx;
  const kiln_hal_add_args_t *a = c->a;
  int32_t dt = a->a.dtype;
  float *x = c->tmp + (int64_t)thread * 2 * c->H, *y = x + c->H;
  for (int64_t r = r0; r < r1; r++) {
    cpu_vec_to_f32(dt, elem_ptr(&a->a, row_offset(&a->a, r)), x, c->H);
    cpu_vec_to_f32(dt, elem_ptr(&a->b, row_offset(&a->b, r)), y, c->H);
    for (int64_t i = 0; i < c->H; i++) x[i] += y[i];
    cpu_vec_from_f32(dt, x, elem_ptr(&a->out, row_offset(&a->out, r)), c->H);
  }
}

kiln_hal_error_t *cpu_add(kiln_hal_stream_t *s, const kiln_hal_add_args_t *a, bool dry_run) {
  kiln_hal_error_t *e = kiln_hal_check_add(&cpu_check_env, a);
  if (e) return e;
  int64_t rows = row_count(&a->a), H = a->a.shape[a->a.ndim - 1];
  if (dry_run || rows == 0 || H == 0) return NULL;
  float *tmp = cpu_scratch(s, (size_t)H * 2 * sizeof(float) * (size_t)cpu_num_threads());
  if (!tmp) return oom("add");
  add_ctx_t c = {a, H, tmp};
  cpu_parallel_rows(rows, 3 * H, add_rows, &c);
  return NULL;
}

/* ============================================================================================
 * copy (with dtype conversion, any strides)
 * ==========================================================================================*/

typedef struct copy_ctx {
  const kiln_hal_copy_args_t *a;
  int64_t n; /* elements per row */
  float *tmp; /* n floats per thread */
} copy_ctx_t;

static void copy_rows(void *vctx, int64_t r0, int64_t r1, int thread) {
  const copy_ctx_t *c = vctx;
  const kiln_hal_tensor_t *src = &c->a->src, *dst = &c->a->dst;
  int64_t n = c->n, ss = src->stride[src->ndim - 1], ds = dst->stride[dst->ndim - 1];
  size_t es = kiln_hal_dtype_size(src->dtype), ed = kiln_hal_dtype_size(dst->dtype);
  bool same = src->dtype == dst->dtype;
  for (int64_t r = r0; r < r1; r++) {
    const char *sp = elem_ptr(src, row_offset(src, r));
    char *dp = elem_ptr(dst, row_offset(dst, r));
    if ((ss == 1 || n == 1) && (ds == 1 || n == 1)) {
      if (same) {
        memmove(dp, sp, (size_t)n * es);
      } else {
        float *v = c->tmp + (int64_t)thread * n;
        cpu_vec_to_f32(src->dtype, sp, v, n);
        cpu_vec_from_f32(dst->dtype, v, dp, n);
      }
    } else if (same) {
      for (int64_t i = 0; i < n; i++) memcpy(dp + i * ds * (int64_t)ed, sp + i * ss * (int64_t)es, es);
    } else {
      for (int64_t i = 0; i < n; i++)
        kiln_hal_store_f32(dp, dst->dtype, i * ds, kiln_hal_load_f32(sp, src->dtype, i * ss));
    }
  }
}

kiln_hal_error_t *cpu_copy(kiln_hal_stream_t *s, const kiln_hal_copy_args_t *a, bool dry_run) {
  kiln_hal_error_t *e = kiln_hal_check_copy(&cpu_check_env, a);
  if (e) return e;
  int64_t rows = row_count(&a->src), n = a->src.shape[a->src.ndim - 1];
  if (dry_run || rows == 0 || n == 0) return NULL;
  float *tmp = cpu_scratch(s, (size_t)n * sizeof(float) * (size_t)cpu_num_threads());
  if (!tmp) return oom("copy");
  copy_ctx_t c = {a, n, tmp};
  cpu_parallel_rows(rows, n, copy_rows, &c);
  return NULL;
}

/* ============================================================================================
 * kv_write
 * ==========================================================================================*/

typedef struct kvw_ctx {
  const kiln_hal_kv_write_args_t *a;
  int64_t NKV, D, BS, slots;
  bool fp8;   /* kv_format = KILN_HAL_KV_FP8_E4M3 (ABI 1.7) */
  float *tmp; /* FP8: a row of D f32 per thread */
} kvw_ctx_t;

static void kvw_rows(void *vctx, int64_t r0, int64_t r1, int thread) {
  const kvw_ctx_t *c = vctx;
  const kiln_hal_kv_write_args_t *a = c->a;
  const int32_t *sm = cpu_tensor_ptr(&a->slot_mapping);
  size_t rowbytes = (size_t)c->D * kiln_hal_dtype_size(a->k.dtype);
  float *row = c->fp8 ? c->tmp + (int64_t)thread * c->D : NULL;
  for (int64_t t = r0; t < r1; t++) {
    int64_t slot = sm[t * a->slot_mapping.stride[0]];
    if (slot < 0 || slot >= c->slots) continue;
    int64_t blk = slot / c->BS, off = slot % c->BS;
    for (int64_t h = 0; c->fp8 && h < c->NKV; h++) { /* hal.h: f32 division, then the RNE cast */
      for (int w = 0; w < 2; w++) {
        const kiln_hal_tensor_t *src = w ? &a->v : &a->k, *dst = w ? &a->v_cache : &a->k_cache;
        const float sc = w ? a->v_scale : a->k_scale;
        cpu_vec_to_f32(src->dtype, elem_ptr(src, t * src->stride[0] + h * src->stride[1]), row,
                       c->D);
        uint8_t *q = (uint8_t *)elem_ptr(dst, blk * dst->stride[0] + h * dst->stride[1] +
                                                  off * dst->stride[2]);
        for (int64_t d = 0; d < c->D; d++) q[d] = kiln_hal_f32_to_fp8_e4m3(row[d] / sc);
      }
    }
    for (int64_t h = 0; !c->fp8 && h < c->NKV; h++) {
      memcpy(elem_ptr(&a->k_cache, blk * a->k_cache.stride[0] + h * a->k_cache.stride[1] +
                                       off * a->k_cache.stride[2]),
             elem_ptr(&a->k, t * a->k.stride[0] + h * a->k.stride[1]), rowbytes);
      memcpy(elem_ptr(&a->v_cache, blk * a->v_cache.stride[0] + h * a->v_cache.stride[1] +
                                       off * a->v_cache.stride[2]),
             elem_ptr(&a->v, t * a->v.stride[0] + h * a->v.stride[1]), rowbytes);
    }
  }
}

kiln_hal_error_t *cpu_kv_write(kiln_hal_stream_t *s, const kiln_hal_kv_write_args_t *a,
                               bool dry_run) {
  (void)s;
  kiln_hal_error_t *e = kiln_hal_check_kv_write(&cpu_check_env, a);
  if (e) return e;
  int64_t T = a->k.shape[0], NKV = a->k.shape[1], D = a->k.shape[2];
  int64_t NB = a->k_cache.shape[0], BS = a->k_cache.shape[2];
  if (dry_run || T == 0 || NKV == 0 || D == 0 || BS == 0) return NULL;
  kvw_ctx_t c = {a, NKV, D, BS, NB * BS, a->kv_format == KILN_HAL_KV_FP8_E4M3, NULL};
  if (c.fp8 && !(c.tmp = cpu_scratch(s, (size_t)(D * cpu_num_threads()) * sizeof(float))))
    return oom("kv_write");
  cpu_parallel_rows(T, 2 * NKV * D, kvw_rows, &c);
  return NULL;
}
