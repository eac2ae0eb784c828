/* cpu_sample.c - sampling support on logits rows: argmax, topk, penalize, sample. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"

/* A logit as a sort key: NaN ranks with -inf so it never wins. */
static inline float key(float x) { return x != x ? -INFINITY : x; }

/* True when token a ranks after token b: smaller logit, or equal logit and larger index. */
static inline bool worse(const float *x, int32_t a, int32_t b) {
  float ka = key(x[a]), kb = key(x[b]);
  return ka < kb || (ka == kb && a > b);
}

static void sift_down(const float *x, int32_t *h, int64_t n, int64_t i) {
  for (;;) {
    int64_t l = 2 * i + 1, r = l + 1, w = i;
    if (l < n && worse(x, h[l], h[w])) w = l;
    if (r < n && worse(x, h[r], h[w])) w = r;
    if (w == i) return;
    int32_t t = h[i];
    h[i] = h[w];
    h[w] = t;
    i = w;
  }
}

/* idx[0..m) = the m best tokens of x[0..V) in rank order (logit descending, ties by index).
 * A heap of the m best seen, worst on top: O(V log m). */
static void select_top(const float *x, int64_t V, int64_t m, int32_t *idx) {
  if (m <= 0) return;
  for (int64_t i = 0; i < m; i++) idx[i] = (int32_t)i;
  for (int64_t i = m / 2 - 1; i >= 0; i--) sift_down(x, idx, m, i);
  for (int64_t v = m; v < V; v++)
    if (worse(x, idx[0], (int32_t)v)) {
      idx[0] = (int32_t)v;
      sift_down(x, idx, m, 0);
    }
  /* Heap sort: repeatedly move the worst to the end. */
  for (int64_t n = m - 1; n > 0; n--) {
    int32_t t = idx[0];
    idx[0] = idx[n];
    idx[n] = t;
    sift_down(x, idx, n, 0);
  }
}

/* Index of the largest logit, lowest index among equals (0 for an all-NaN row). */
static int64_t row_argmax(const float *x, int64_t V) {
  int64_t best = 0;
  float bv = key(x[0]);
  for (int64_t v = 1; v < V; v++)
    if (x[v] > bv) {
      bv = x[v];
      best = v;
    }
  return best;
}

/* logsumexp of a row, without modifying it. */
static float row_lse(const float *x, int64_t V) {
  float mx = key(x[row_argmax(x, V)]);
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

static kiln_hal_error_t *check_logits(const char *op, const kiln_hal_tensor_t *t) {
  kiln_hal_error_t *e = cpu_check_tensor(op, "logits", t, CPU_DT(KILN_HAL_F32), 2, true);
  if (!e && t->shape[1] == 0 && t->shape[0] > 0)
    e = cpu_err("%s: logits has V = 0 (no token to choose)", op);
  return e;
}

/* A [S] vector of dtype. */
static kiln_hal_error_t *check_vec(const char *op, const char *name, const kiln_hal_tensor_t *t,
                                   int32_t dtype, int64_t n) {
  kiln_hal_error_t *e = cpu_check_tensor(op, name, t, CPU_DT(dtype), 1, false);
  if (!e && t->shape[0] != n)
    e = cpu_err("%s: %s has %lld entries, want %lld", op, name, (long long)t->shape[0],
                (long long)n);
  return e;
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
    int64_t id = row_argmax(x, V);
    ((int32_t *)cpu_tensor_ptr(&a->out_ids))[s * a->out_ids.stride[0]] = (int32_t)id;
    if (lp)
      ((float *)cpu_tensor_ptr(&a->out_logprob))[s * a->out_logprob.stride[0]] = x[id] - row_lse(x, V);
  }
}

kiln_hal_error_t *cpu_argmax(kiln_hal_stream_t *s, const kiln_hal_argmax_args_t *a, bool dry_run) {
  (void)s;
  kiln_hal_error_t *e;
  if ((e = check_logits("argmax", &a->logits))) return e;
  int64_t S = a->logits.shape[0];
  if ((e = check_vec("argmax", "out_ids", &a->out_ids, KILN_HAL_I32, S))) return e;
  if (kiln_hal_tensor_present(&a->out_logprob) &&
      (e = check_vec("argmax", "out_logprob", &a->out_logprob, KILN_HAL_F32, S)))
    return e;
  if (dry_run) return NULL;
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
    select_top(x, V, k, idx);
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
  kiln_hal_error_t *e;
  if ((e = check_logits("topk", &a->logits)) ||
      (e = cpu_check_tensor("topk", "out_values", &a->out_values, CPU_DT(KILN_HAL_F32), 2, true)) ||
      (e = cpu_check_tensor("topk", "out_ids", &a->out_ids, CPU_DT(KILN_HAL_I32), 2, true)))
    return e;
  int64_t S = a->logits.shape[0], V = a->logits.shape[1], k = a->out_values.shape[1];
  if (a->out_values.shape[0] != S || a->out_ids.shape[0] != S || a->out_ids.shape[1] != k)
    return cpu_err("topk: out_values is [%lld, %lld] and out_ids [%lld, %lld], want both [S = "
                   "%lld, k]",
                   (long long)a->out_values.shape[0], (long long)k,
                   (long long)a->out_ids.shape[0], (long long)a->out_ids.shape[1], (long long)S);
  if (k > V) return cpu_err("topk: k = %lld exceeds V = %lld", (long long)k, (long long)V);
  if (kiln_hal_tensor_present(&a->out_lse) &&
      (e = check_vec("topk", "out_lse", &a->out_lse, KILN_HAL_F32, S)))
    return e;
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
  uint8_t *mark;   /* V per thread, zero between rows */
  int32_t *count;  /* V per thread, zero between rows */
} pen_ctx_t;

/* Checks an ids/offsets pair: both absent (false), or both present and consistent. */
static kiln_hal_error_t *check_list(const char *ids_name, const kiln_hal_tensor_t *ids,
                                    const char *off_name, const kiln_hal_tensor_t *off, int64_t S,
                                    bool *present) {
  kiln_hal_error_t *e;
  *present = kiln_hal_tensor_present(ids) || kiln_hal_tensor_present(off);
  if (!*present) return NULL;
  if ((e = cpu_check_tensor("penalize", ids_name, ids, CPU_DT(KILN_HAL_I32), 1, false)) ||
      (e = check_vec("penalize", off_name, off, KILN_HAL_I32, S + 1)))
    return e;
  return NULL;
}

/* Offsets are data: checked when the op runs, before any logit changes. */
static kiln_hal_error_t *check_offsets(const char *name, const kiln_hal_tensor_t *off,
                                       int64_t len, int64_t S) {
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
  kiln_hal_error_t *e;
  if ((e = cpu_check_tensor("penalize", "logits", &a->logits, CPU_DT(KILN_HAL_F32), 2, true)))
    return e;
  int64_t S = a->logits.shape[0], V = a->logits.shape[1];
  pen_ctx_t c = {a, V, false, false, false, NULL, NULL};
  if ((e = check_list("prompt_ids", &a->prompt_ids, "prompt_offsets", &a->prompt_offsets, S,
                      &c.prompt)) ||
      (e = check_list("output_ids", &a->output_ids, "output_offsets", &a->output_offsets, S,
                      &c.output)) ||
      (e = check_list("bias_ids", &a->bias_ids, "bias_offsets", &a->bias_offsets, S, &c.bias)))
    return e;
  const kiln_hal_tensor_t *vecs[3] = {&a->repetition, &a->frequency, &a->presence};
  const char *names[3] = {"repetition", "frequency", "presence"};
  for (int i = 0; i < 3; i++)
    if (kiln_hal_tensor_present(vecs[i]) &&
        (e = check_vec("penalize", names[i], vecs[i], KILN_HAL_F32, S)))
      return e;
  if (c.bias) {
    if ((e = check_vec("penalize", "bias_values", &a->bias_values, KILN_HAL_F32,
                       a->bias_ids.shape[0])))
      return e;
  } else if (kiln_hal_tensor_present(&a->bias_values)) {
    return cpu_err("penalize: bias_values is present without bias_ids and bias_offsets");
  }
  if (dry_run || S == 0 || V == 0) return NULL;
  if ((c.prompt && (e = check_offsets("prompt_offsets", &a->prompt_offsets,
                                      a->prompt_ids.shape[0], S))) ||
      (c.output && (e = check_offsets("output_offsets", &a->output_offsets,
                                      a->output_ids.shape[0], S))) ||
      (c.bias && (e = check_offsets("bias_offsets", &a->bias_offsets, a->bias_ids.shape[0], S))))
    return e;
  int threads = cpu_num_threads();
  size_t per = (size_t)V * (sizeof(uint8_t) + sizeof(int32_t));
  char *scratch = cpu_scratch(s, per * (size_t)threads + 64);
  if (!scratch) return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY, "penalize: out of scratch memory");
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
static int64_t sample_row(const sample_ctx_t *c, int64_t s, const float *x, float *e, int32_t *idx) {
  const kiln_hal_sample_args_t *a = c->a;
  int64_t V = c->V;
  float t = vecf(&a->temperature, s);
  int64_t imax = row_argmax(x, V);
  if (!(t > 0.0f)) return imax;
  int64_t k = kiln_hal_tensor_present(&a->top_k) ? veci(&a->top_k, s) : 0;
  float tp = kiln_hal_tensor_present(&a->top_p) ? vecf(&a->top_p, s) : 1.0f;
  float mp = kiln_hal_tensor_present(&a->min_p) ? vecf(&a->min_p, s) : 0.0f;
  float u = vecf(&a->uniform, s);
  float xmax = key(x[imax]);
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
      select_top(x, V, m, idx);
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
  kiln_hal_error_t *e;
  if ((e = check_logits("sample", &a->logits))) return e;
  int64_t S = a->logits.shape[0], V = a->logits.shape[1];
  if ((e = check_vec("sample", "temperature", &a->temperature, KILN_HAL_F32, S)) ||
      (e = check_vec("sample", "uniform", &a->uniform, KILN_HAL_F32, S)) ||
      (e = check_vec("sample", "out_ids", &a->out_ids, KILN_HAL_I32, S)))
    return e;
  /* top_k, top_p and min_p may be absent: that filter is off. */
  if ((kiln_hal_tensor_present(&a->top_k) &&
       (e = check_vec("sample", "top_k", &a->top_k, KILN_HAL_I32, S))) ||
      (kiln_hal_tensor_present(&a->top_p) &&
       (e = check_vec("sample", "top_p", &a->top_p, KILN_HAL_F32, S))) ||
      (kiln_hal_tensor_present(&a->min_p) &&
       (e = check_vec("sample", "min_p", &a->min_p, KILN_HAL_F32, S))) ||
      (kiln_hal_tensor_present(&a->out_logprob) &&
       (e = check_vec("sample", "out_logprob", &a->out_logprob, KILN_HAL_F32, S))))
    return e;
  if (dry_run || S == 0) return NULL;
  int threads = cpu_num_threads();
  size_t per = (size_t)V * (sizeof(float) + sizeof(int32_t));
  char *scratch = cpu_scratch(s, per * (size_t)threads);
  if (!scratch) return kiln_hal_error_new(KILN_HAL_ERR_OUT_OF_MEMORY, "sample: out of scratch memory");
  sample_ctx_t c = {a, V, (float *)scratch,
                    (int32_t *)(scratch + (size_t)V * sizeof(float) * (size_t)threads)};
  cpu_parallel_rows(S, 4 * V, sample_rows, &c);
  return NULL;
}
