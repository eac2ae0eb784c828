/* cpu_sample.c - sampling support on logits rows: argmax, topk, penalize, sample, mask_logits. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"
#include "kiln/hal_rank.h"

/* logsumexp of a row, without modifying it. */
static float row_lse(const float *x, int64_t V) {
  float mx = kiln_rank_key(x[kiln_rank_argmax(x, V)]);
  if (mx == -INFINITY || mx == INFINITY) return mx;
  float buf[1024];
  double sum = 0.0;
  for (int64_t v = 0; v < V; v += 1024) {
    int64_t n = V - v < 1024 ? V - v : 1024;
    memcpy(buf, x + v, (size_t)n * sizeof(float));
    sum += cpu_vec_exp_sum(buf, n, mx);
  }
  return mx + (float)log(sum);
}

static inline const float *logits_row(const kiln_hal_tensor_t *t, int64_t s) {
  return (const float *)cpu_tensor_ptr(t) + s * t->stride[0];
}

static inline float vecf(const kiln_hal_tensor_t *t, int64_t i) {
  return ((const float *)cpu_tensor_ptr(t))[i * t->stride[0]];
}
static inline int32_t veci(const kiln_hal_tensor_t *t, int64_t i) {
  return ((const int32_t *)cpu_tensor_ptr(t))[i * t->stride[0]];
}

/* ============================================================================================
 * argmax
 * ==========================================================================================*/

static void argmax_rows(void *vctx, int64_t r0, int64_t r1, int thread) {
  (void)thread;
  const kiln_hal_argmax_args_t *a = vctx;
  int64_t V = a->logits.shape[1];
  bool lp = kiln_hal_tensor_present(&a->out_logprob);
  for (int64_t s = r0; s < r1; s++) {
    const float *x = logits_row(&a->logits, s);
    int64_t id = kiln_rank_argmax(x, V);
    ((int32_t *)cpu_tensor_ptr(&a->out_ids))[s * a->out_ids.stride[0]] = (int32_t)id;
    if (lp)
      ((float *)cpu_tensor_ptr(&a->out_logprob))[s * a->out_logprob.stride[0]] =
          x[id] - row_lse(x, V);
  }
}

kiln_hal_error_t *cpu_argmax(kiln_hal_stream_t *s, const kiln_hal_argmax_args_t *a, bool dry_run) {
  (void)s;
  kiln_hal_error_t *e = kiln_hal_check_argmax(&cpu_check_env, a);
  if (e || dry_run) return e;
  int64_t S = a->logits.shape[0];
  cpu_parallel_rows(S, a->logits.shape[1], argmax_rows, (void *)a);
  return NULL;
}

/* ============================================================================================
 * topk
 * ==========================================================================================*/

typedef struct topk_ctx {
  const kiln_hal_topk_args_t *a;
  int32_t *heap; /* k per thread */
} topk_ctx_t;

static void topk_rows(void *vctx, int64_t r0, int64_t r1, int thread) {
  const topk_ctx_t *c = vctx;
  const kiln_hal_topk_args_t *a = c->a;
  int64_t V = a->logits.shape[1], k = a->out_values.shape[1];
  int32_t *idx = c->heap + (int64_t)thread * k;
  for (int64_t s = r0; s < r1; s++) {
    const float *x = logits_row(&a->logits, s);
    kiln_rank_select_top(x, V, k, idx);
    float *ov = (float *)cpu_tensor_ptr(&a->out_values) + s * a->out_values.stride[0];
    int32_t *oi = (int32_t *)cpu_tensor_ptr(&a->out_ids) + s * a->out_ids.stride[0];
    for (int64_t i = 0; i < k; i++) {
      ov[i] = x[idx[i]];
      oi[i] = idx[i];
    }
    if (kiln_hal_tensor_present(&a->out_lse))
      ((float *)cpu_tensor_ptr(&a->out_lse))[s * a->out_lse.stride[0]] = row_lse(x, V);
  }
}

kiln_hal_error_t *cpu_topk(kiln_hal_stream_t *s, const kiln_hal_topk_args_t *a, bool dry_run) {
  kiln_hal_error_t *e = kiln_hal_check_topk(&cpu_check_env, a);
  if (e) return e;
  int64_t S = a->logits.shape[0], V = a->logits.shape[1], k = a->out_values.shape[1];
  if (dry_run || S == 0) return NULL;
  int32_t *heap = cpu_scratch(s, (size_t)(k + 1) * sizeof(int32_t) * (size_t)cpu_num_threads());
  if (!heap) return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY, "topk: out of scratch memory");
  topk_ctx_t c = {a, heap};
  cpu_parallel_rows(S, V, topk_rows, &c);
  return NULL;
}

/* ============================================================================================
 * penalize
 * ==========================================================================================*/

typedef struct pen_ctx {
  const kiln_hal_penalize_args_t *a;
  int64_t V;
  bool prompt, output, bias;
  uint8_t *mark;  /* V per thread, zero between rows */
  int32_t *count; /* V per thread, zero between rows */
} pen_ctx_t;

/* Offsets are data: checked when the op runs, before any logit changes. */
static kiln_hal_error_t *check_offsets(const char *name, const kiln_hal_tensor_t *off, int64_t len,
                                       int64_t S) {
  for (int64_t s = 0; s <= S; s++) {
    int32_t o = veci(off, s);
    if (o < 0 || o > len || (s > 0 && o < veci(off, s - 1)))
      return cpu_err("penalize: %s[%lld] = %d is not a non-decreasing offset into %lld ids", name,
                     (long long)s, (int)o, (long long)len);
  }
  return NULL;
}

static void pen_rows(void *vctx, int64_t r0, int64_t r1, int thread) {
  const pen_ctx_t *c = vctx;
  const kiln_hal_penalize_args_t *a = c->a;
  int64_t V = c->V;
  uint8_t *mark = c->mark + (int64_t)thread * V;
  int32_t *count = c->count + (int64_t)thread * V;
  for (int64_t s = r0; s < r1; s++) {
    float *x = (float *)cpu_tensor_ptr(&a->logits) + s * a->logits.stride[0];
    const kiln_hal_tensor_t *lists[2] = {&a->prompt_ids, &a->output_ids};
    const kiln_hal_tensor_t *offs[2] = {&a->prompt_offsets, &a->output_offsets};
    bool have[2] = {c->prompt, c->output};
    if (kiln_hal_tensor_present(&a->repetition)) {
      float r = vecf(&a->repetition, s);
      for (int pass = 0; pass < 2 && r != 1.0f; pass++)
        for (int l = 0; l < 2; l++) {
          if (!have[l]) continue;
          for (int32_t i = veci(offs[l], s); i < veci(offs[l], s + 1); i++) {
            int32_t id = veci(lists[l], i);
            if (id < 0 || id >= V) continue;
            if (pass == 0 && !mark[id]) {
              mark[id] = 1;
              x[id] = x[id] > 0.0f ? x[id] / r : x[id] * r;
            } else if (pass == 1) {
              mark[id] = 0;
            }
          }
        }
    }
    float f = kiln_hal_tensor_present(&a->frequency) ? vecf(&a->frequency, s) : 0.0f;
    float p = kiln_hal_tensor_present(&a->presence) ? vecf(&a->presence, s) : 0.0f;
    if (c->output && (f != 0.0f || p != 0.0f)) {
      int32_t o0 = veci(&a->output_offsets, s), o1 = veci(&a->output_offsets, s + 1);
      for (int32_t i = o0; i < o1; i++) {
        int32_t id = veci(&a->output_ids, i);
        if (id >= 0 && id < V) count[id]++;
      }
      for (int32_t i = o0; i < o1; i++) {
        int32_t id = veci(&a->output_ids, i);
        if (id < 0 || id >= V || count[id] == 0) continue;
        x[id] -= f * (float)count[id] + p;
        count[id] = 0;
      }
    }
    if (c->bias)
      for (int32_t i = veci(&a->bias_offsets, s); i < veci(&a->bias_offsets, s + 1); i++) {
        int32_t id = veci(&a->bias_ids, i);
        if (id >= 0 && id < V) x[id] += vecf(&a->bias_values, i);
      }
  }
}

kiln_hal_error_t *cpu_penalize(kiln_hal_stream_t *s, const kiln_hal_penalize_args_t *a,
                               bool dry_run) {
  kiln_hal_error_t *e = kiln_hal_check_penalize(&cpu_check_env, a);
  if (e) return e;
  int64_t S = a->logits.shape[0], V = a->logits.shape[1];
  pen_ctx_t c = {a, V, false, false, false, NULL, NULL};
  c.prompt = kiln_hal_tensor_present(&a->prompt_ids);
  c.output = kiln_hal_tensor_present(&a->output_ids);
  c.bias = kiln_hal_tensor_present(&a->bias_ids);
  if (dry_run || S == 0 || V == 0) return NULL;
  if ((c.prompt &&
       (e = check_offsets("prompt_offsets", &a->prompt_offsets, a->prompt_ids.shape[0], S))) ||
      (c.output &&
       (e = check_offsets("output_offsets", &a->output_offsets, a->output_ids.shape[0], S))) ||
      (c.bias && (e = check_offsets("bias_offsets", &a->bias_offsets, a->bias_ids.shape[0], S))))
    return e;
  int threads = cpu_num_threads();
  size_t per = (size_t)V * (sizeof(uint8_t) + sizeof(int32_t));
  char *scratch = cpu_scratch(s, per * (size_t)threads + 64);
  if (!scratch)
    return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY, "penalize: out of scratch memory");
  memset(scratch, 0, per * (size_t)threads);
  c.count = (int32_t *)scratch;
  c.mark = (uint8_t *)(scratch + (size_t)V * sizeof(int32_t) * (size_t)threads);
  int64_t work = 0;
  if (c.prompt) work += a->prompt_ids.shape[0];
  if (c.output) work += 2 * a->output_ids.shape[0];
  cpu_parallel_rows(S, S ? work / S + 1 : 1, pen_rows, &c);
  return NULL;
}

/* ============================================================================================
 * sample
 * ==========================================================================================*/

typedef struct sample_ctx {
  const kiln_hal_sample_args_t *a;
  int64_t V;
  float *e;     /* V per thread: exp((x - max) / t) */
  int32_t *idx; /* V per thread: ranked candidates, then kept tokens */
} sample_ctx_t;

static int cmp_i32(const void *pa, const void *pb) {
  int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
  return (a > b) - (a < b);
}

/* One row of `sample` (see hal.h): returns the chosen token. */
static int64_t sample_row(const sample_ctx_t *c, int64_t s, const float *x, float *e,
                          int32_t *idx) {
  const kiln_hal_sample_args_t *a = c->a;
  int64_t V = c->V;
  float t = vecf(&a->temperature, s);
  int64_t imax = kiln_rank_argmax(x, V);
  if (!(t > 0.0f)) return imax;
  int64_t k = kiln_hal_tensor_present(&a->top_k) ? veci(&a->top_k, s) : 0;
  float tp = kiln_hal_tensor_present(&a->top_p) ? vecf(&a->top_p, s) : 1.0f;
  float mp = kiln_hal_tensor_present(&a->min_p) ? vecf(&a->min_p, s) : 0.0f;
  float u = vecf(&a->uniform, s);
  float xmax = kiln_rank_key(x[imax]);
  if (xmax == -INFINITY || xmax == INFINITY) return imax;
  /* e[v] = p[v] * Z with e[imax] = 1, so p[v] >= min_p * max(p) reads e[v] >= min_p. */
  float it = 1.0f / t;
  for (int64_t v = 0; v < V; v++) e[v] = x[v] != x[v] ? -INFINITY : (x[v] - xmax) * it;
  double Z = (double)cpu_vec_exp_sum(e, V, 0.0f);
  bool use_k = k > 0 && k < V, use_p = tp < 1.0f;
  int64_t nkept = 0;
  if (!use_k && !use_p) {
    for (int64_t v = 0; v < V; v++)
      if (v == imax || !(mp > 0.0f) || e[v] >= mp) idx[nkept++] = (int32_t)v;
  } else {
    /* Rank order is only needed for the first m tokens: all of top_k, or (top_p alone) enough
     * tokens to cover top_p of the mass, since any later token has mass_before >= top_p. */
    int64_t m = use_k ? k : (V < 1024 ? V : 1024);
    for (;;) {
      kiln_rank_select_top(x, V, m, idx);
      if (use_k || m == V) break;
      double mass = 0.0;
      for (int64_t i = 0; i < m; i++) mass += e[idx[i]];
      if (mass / Z >= (double)tp) break;
      m = m * 4 < V ? m * 4 : V;
    }
    double before = 0.0;
    for (int64_t i = 0; i < m; i++) {
      int32_t v = idx[i];
      bool keep = i == 0 || ((!use_p || before / Z < (double)tp) && (!(mp > 0.0f) || e[v] >= mp));
      before += e[v];
      if (keep) idx[nkept++] = v;
    }
    qsort(idx, (size_t)nkept, sizeof(int32_t), cmp_i32);
  }
  double W = 0.0;
  for (int64_t i = 0; i < nkept; i++) W += e[idx[i]];
  double target = (double)u * W, cum = 0.0;
  for (int64_t i = 0; i < nkept; i++) {
    cum += e[idx[i]];
    if (cum > target) return idx[i];
  }
  return nkept ? idx[nkept - 1] : imax;
}

static void sample_rows(void *vctx, int64_t r0, int64_t r1, int thread) {
  const sample_ctx_t *c = vctx;
  const kiln_hal_sample_args_t *a = c->a;
  float *e = c->e + (int64_t)thread * c->V;
  int32_t *idx = c->idx + (int64_t)thread * c->V;
  for (int64_t s = r0; s < r1; s++) {
    const float *x = logits_row(&a->logits, s);
    int64_t id = sample_row(c, s, x, e, idx);
    ((int32_t *)cpu_tensor_ptr(&a->out_ids))[s * a->out_ids.stride[0]] = (int32_t)id;
    if (kiln_hal_tensor_present(&a->out_logprob))
      ((float *)cpu_tensor_ptr(&a->out_logprob))[s * a->out_logprob.stride[0]] =
          x[id] - row_lse(x, c->V);
  }
}

kiln_hal_error_t *cpu_sample(kiln_hal_stream_t *s, const kiln_hal_sample_args_t *a, bool dry_run) {
  kiln_hal_error_t *e = kiln_hal_check_sample(&cpu_check_env, a);
  if (e) return e;
  int64_t S = a->logits.shape[0], V = a->logits.shape[1];
  if (dry_run || S == 0) return NULL;
  int threads = cpu_num_threads();
  size_t per = (size_t)V * (sizeof(float) + sizeof(int32_t));
  char *scratch = cpu_scratch(s, per * (size_t)threads);
  if (!scratch)
    return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY, "sample: out of scratch memory");
  sample_ctx_t c = {a, V, (float *)scratch,
                    (int32_t *)(scratch + (size_t)V * sizeof(float) * (size_t)threads)};
  cpu_parallel_rows(S, 4 * V, sample_rows, &c);
  return NULL;
}

/* ============================================================================================
 * mask_logits (ABI 1.3)
 * ==========================================================================================*/

static void mask_rows(void *vctx, int64_t r0, int64_t r1, int thread) {
  (void)thread;
  const kiln_hal_mask_args_t *a = vctx;
  const int64_t V = a->logits.shape[1], M = a->mask.shape[0];
  const bool rows = kiln_hal_tensor_present(&a->rows);
  for (int64_t s = r0; s < r1; s++) {
    int64_t r = rows ? veci(&a->rows, s) : s;
    if (r < 0 || r >= M) continue;
    float *x = (float *)cpu_tensor_ptr(&a->logits) + s * a->logits.stride[0];
    const uint32_t *m = (const uint32_t *)cpu_tensor_ptr(&a->mask) + r * a->mask.stride[0];
    for (int64_t w = 0; w * 32 < V; w++) {
      uint32_t bits = m[w];
      if (bits == 0xFFFFFFFFu) continue;
      int64_t n = V - w * 32 < 32 ? V - w * 32 : 32;
      for (int64_t b = 0; b < n; b++)
        if (!((bits >> b) & 1)) x[w * 32 + b] = -INFINITY;
    }
  }
}

kiln_hal_error_t *cpu_mask_logits(kiln_hal_stream_t *s, const kiln_hal_mask_args_t *a,
                                  bool dry_run) {
  (void)s;
  kiln_hal_error_t *e = kiln_hal_check_mask_logits(&cpu_check_env, a);
  if (e || dry_run) return e;
  cpu_parallel_rows(a->logits.shape[0], a->logits.shape[1], mask_rows, (void *)a);
  return NULL;
}
