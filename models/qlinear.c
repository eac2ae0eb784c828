/* qlinear.c - GPTQ, AWQ and FP8 Linear weights: the checkpoint tensors checked at load and
 * repacked once into the group formats of the HAL (hal.h's kiln_hal_qweight_t: codes
 * [N, K]-major, scales / zeros [N, G]; FP8_E4M3 codes as they are with F32 scales [N, G]), or
 * dequantized to the serving dtype for a backend without them. [model] quantization = fp8
 * makes FP8 codes and per-channel scales from a float checkpoint's Linear here too. The
 * checkpoint layouts are written out in kiln/hal_quant.h and docs/models.md. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kiln/hal_quant.h"
#include "kiln/hal_util.h"
#include "models/model_internal.h"

struct model_qpart {
  const kiln_weight_t *qweight, *qzeros, *scales;
  const kiln_weight_t *g_idx_w; /* NULL when absent */
  int32_t *g_idx;               /* owned; NULL when absent or k / group_size everywhere */
  int32_t method, bits;
  bool zero_minus_one;
  int64_t N, K, G;
  int32_t group_size; /* > 0 (K for GPTQ's -1) */
  /* FP8 (method KILN_QUANT_FP8): the weight (F8_E4M3 codes, or a float tensor quantized on
   * the fly), its scale tensor (NULL on the fly), kiln_fp8_scheme_t and block rows. */
  const kiln_weight_t *weight, *scale;
  int32_t scheme, block_n;
};

static int32_t load_i32(const uint8_t *p, int64_t i) {
  int32_t v;
  memcpy(&v, p + 4 * i, 4);
  return v;
}

/* Finds module.suffix: missing is an error naming it; dtype and shape must be as given. */
static kiln_status_t q_tensor(const model_plan_t *p, const char *module, const char *suffix,
                              int32_t type, int64_t d0, int64_t d1, bool required,
                              const kiln_weight_t **out) {
  char name[192];
  snprintf(name, sizeof(name), "%s.%s", module, suffix);
  const kiln_weight_t *w = kiln_weights_find(p->src, name);
  *out = w;
  if (!w) {
    if (!required) return NULL;
    const char *file = kiln_weights_count(p->src) ? kiln_weights_at(p->src, 0)->file : p->path;
    return kiln_status_make(
        KILN_ERR_INVALID_ARGUMENT,
        "%s: tensor %s is missing (a %s Linear needs qweight, qzeros, scales%s)", file, name,
        p->quant->method == KILN_QUANT_GPTQ ? "GPTQ" : "AWQ",
        p->quant->method == KILN_QUANT_GPTQ && p->quant->desc_act ? " and, with desc_act, g_idx"
                                                                  : "");
  }
  if (w->type != type)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: tensor %s has dtype %s, want %s",
                            w->file, name, kiln_wtype_name(w->type), kiln_wtype_name(type));
  const int64_t shape[2] = {d0, d1};
  return kiln_weight_expect_shape(w, d1 > 0 ? 2 : 1, shape);
}

/* A zeroed part, owned by the plan. */
static kiln_status_t qpart_new(model_plan_t *p, const char *module, model_qpart_t **out) {
  model_qpart_t *q = calloc(1, sizeof(*q));
  if (!q) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory planning %s", module);
  if (p->n_qparts == p->cap_qparts) {
    size_t cap = p->cap_qparts ? 2 * p->cap_qparts : 16;
    model_qpart_t **v = realloc(p->qparts, cap * sizeof(*v));
    if (!v) {
      free(q);
      return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory planning %s", module);
    }
    p->qparts = v;
    p->cap_qparts = cap;
  }
  p->qparts[p->n_qparts++] = q; /* owned by the plan from here on, whatever follows */
  *out = q;
  return NULL;
}

kiln_status_t kiln_qpart_open(model_plan_t *p, const char *module, int64_t N, int64_t K,
                              model_qpart_t **out) {
  *out = NULL;
  const kiln_quant_config_t *c = p->quant;
  const bool gptq = c->method == KILN_QUANT_GPTQ;
  const int64_t P = 32 / c->bits; /* codes per int32 */
  const int32_t gs = c->group_size > 0 ? c->group_size : (int32_t)K;
  const int64_t G = (K + gs - 1) / gs;
  char name[192];
  snprintf(name, sizeof(name), "%s.qweight", module);
  const kiln_weight_t *qw = kiln_weights_find(p->src, name);
  const char *file = qw ? qw->file : p->path;
  /* The packing needs whole int32 words along the packed dimension. */
  if (gptq ? K % P : N % 8)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor %s: %s %lld is not a multiple of the %lld codes an int32 "
                            "packs",
                            file, name, gptq ? "in_features" : "out_features",
                            (long long)(gptq ? K : N), (long long)(gptq ? P : 8));
  if (gptq && N % P)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor %s.qzeros: out_features %lld is not a multiple of the %lld "
                            "zeros an int32 packs",
                            file, module, (long long)N, (long long)P);
  model_qpart_t *q;
  kiln_status_t st = qpart_new(p, module, &q);
  if (st) return st;
  q->method = c->method;
  q->bits = c->bits;
  q->zero_minus_one = gptq && c->zero_minus_one;
  q->N = N, q->K = K, q->G = G;
  q->group_size = gs;
  if (gptq) {
    if ((st = q_tensor(p, module, "qweight", KILN_WTYPE_I32, K / P, N, true, &q->qweight)) ||
        (st = q_tensor(p, module, "qzeros", KILN_WTYPE_I32, G, N / P, true, &q->qzeros)) ||
        (st = q_tensor(p, module, "scales", KILN_WTYPE_F16, G, N, true, &q->scales)) ||
        (st = q_tensor(p, module, "g_idx", KILN_WTYPE_I32, K, 0, c->desc_act, &q->g_idx_w)))
      return st;
  } else {
    if ((st = q_tensor(p, module, "qweight", KILN_WTYPE_I32, K, N / 8, true, &q->qweight)) ||
        (st = q_tensor(p, module, "qzeros", KILN_WTYPE_I32, G, N / 8, true, &q->qzeros)) ||
        (st = q_tensor(p, module, "scales", KILN_WTYPE_F16, G, N, true, &q->scales)))
      return st;
  }
  if (q->g_idx_w) { /* every entry a group; kept only when it is not k / group_size */
    bool trivial = true;
    for (int64_t k = 0; k < K; k++) {
      int32_t g = load_i32(q->g_idx_w->data, k);
      if (g < 0 || g >= G)
        return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                                "%s: tensor %s.g_idx: entry %lld is %d, outside the %lld groups",
                                q->g_idx_w->file, module, (long long)k, (int)g, (long long)G);
      trivial = trivial && g == k / gs;
    }
    if (!trivial) {
      q->g_idx = malloc((size_t)K * sizeof(int32_t));
      if (!q->g_idx) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory for g_idx");
      memcpy(q->g_idx, q->g_idx_w->data, (size_t)K * sizeof(int32_t));
    }
  }
  *out = q;
  return NULL;
}

void kiln_model_plan_free(model_plan_t *p) {
  for (size_t i = 0; i < p->n_qparts; i++) {
    free(p->qparts[i]->g_idx);
    free(p->qparts[i]);
  }
  free(p->qparts);
  free(p->ups);
  p->qparts = NULL;
  p->ups = NULL;
  p->n_qparts = p->cap_qparts = p->n = p->cap = 0;
}

int64_t kiln_qpart_groups(const model_qpart_t *q) { return q->G; }
int32_t kiln_qpart_group_size(const model_qpart_t *q) { return q->group_size; }
const int32_t *kiln_qpart_g_idx(const model_qpart_t *q) { return q->g_idx; }
int32_t kiln_qpart_format(const model_qpart_t *q) {
  if (q->method == KILN_QUANT_FP8) return KILN_HAL_QFMT_FP8_E4M3;
  return q->bits == 4 ? KILN_HAL_QFMT_INT4_G : KILN_HAL_QFMT_INT8_G;
}

uint64_t kiln_qpart_bytes(const model_qpart_t *q, int32_t what, int32_t dtype) {
  const uint64_t N = (uint64_t)q->N, K = (uint64_t)q->K, G = (uint64_t)q->G;
  const bool fp8 = q->method == KILN_QUANT_FP8;
  switch (what) {
    case MODEL_Q_CODES: return N * (uint64_t)kiln_hal_qgroup_row_bytes(kiln_qpart_format(q), q->K);
    case MODEL_Q_SCALES: return N * G * (fp8 ? 4 : 2);
    case MODEL_Q_ZEROS: return fp8 ? 0 : N * G;
    case MODEL_Q_GIDX: return K * 4;
    default: return N * K * kiln_hal_dtype_size(dtype);
  }
}

/* ---- FP8 ------------------------------------------------------------------------------------ */

static const char *fp8_file(const model_plan_t *p) {
  return kiln_weights_count(p->src) ? kiln_weights_at(p->src, 0)->file : p->path;
}

/* Element i of a float tensor (F32, F16, BF16) as f32. */
static float fp8_load(const kiln_weight_t *w, int64_t i) {
  float v = NAN;
  kiln_status_t st = kiln_weight_convert(w, i, 1, KILN_HAL_F32, &v);
  kiln_status_free(st); /* the callers checked the type and the index */
  return v;
}

static bool fp8_float_type(int32_t t) {
  return t == KILN_WTYPE_F32 || t == KILN_WTYPE_F16 || t == KILN_WTYPE_BF16;
}

/* Checks module.input_scale, when present (required for static activation scales): one
 * positive finite float. Read and checked only: Kiln runs FP8 weight-only (docs/models.md). */
static kiln_status_t fp8_input_scale(const model_plan_t *p, const char *module) {
  char name[192];
  snprintf(name, sizeof(name), "%s.input_scale", module);
  const kiln_weight_t *w = kiln_weights_find(p->src, name);
  if (!w) {
    if (!p->quant->act_static) return NULL;
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor %s is missing (static activation scales: every FP8 Linear "
                            "needs one)",
                            fp8_file(p), name);
  }
  if (!fp8_float_type(w->type) || w->numel != 1)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor %s: want one f32 / bf16 / f16 value, got %s with %lld",
                            w->file, name, kiln_wtype_name(w->type), (long long)w->numel);
  const float v = fp8_load(w, 0);
  if (!(v > 0.0f) || !isfinite(v))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor %s is %g: an activation scale must be positive and finite",
                            w->file, name, (double)v);
  return NULL;
}

kiln_status_t kiln_qpart_open_fp8(model_plan_t *p, const char *module, int64_t N, int64_t K,
                                  model_qpart_t **out) {
  *out = NULL;
  const kiln_quant_config_t *c = p->quant;
  char name[192];
  snprintf(name, sizeof(name), "%s.weight", module);
  const kiln_weight_t *w = kiln_weights_find(p->src, name);
  if (!w) return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: tensor %s is missing",
                                  fp8_file(p), name);
  const bool fly = c->fp8_scheme == KILN_FP8_ON_THE_FLY;
  if (w->type == KILN_WTYPE_F8_E5M2)
    return kiln_status_make(KILN_ERR_UNSUPPORTED,
                            "%s: tensor %s has dtype f8_e5m2: only e4m3 FP8 weights (F8_E4M3) are "
                            "supported",
                            w->file, name);
  if (fly ? !fp8_float_type(w->type) : w->type != KILN_WTYPE_F8_E4M3)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: tensor %s has dtype %s, want %s",
                            w->file, name, kiln_wtype_name(w->type),
                            fly ? "f32, f16 or bf16" : "f8_e4m3");
  const int64_t shape[2] = {N, K};
  kiln_status_t st = kiln_weight_expect_shape(w, 2, shape);
  if (st) return st;
  model_qpart_t *q;
  if ((st = qpart_new(p, module, &q))) return st;
  q->method = KILN_QUANT_FP8;
  q->bits = 8;
  q->N = N, q->K = K;
  q->weight = w;
  q->scheme = c->fp8_scheme;
  q->group_size = c->fp8_scheme == KILN_FP8_BLOCK ? c->block_k : (int32_t)K;
  if (q->group_size > K) q->group_size = (int32_t)K; /* one block over all of K */
  q->G = (K + q->group_size - 1) / q->group_size;
  q->block_n = c->block_n;
  *out = q;
  if (fly) return NULL; /* scales made from the weights at upload */
  /* Every code a number: the HAL leaves NaN codes undefined. */
  for (int64_t i = 0; i < N * K; i++)
    if (kiln_hal_fp8_e4m3_is_nan(w->data[i]))
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s: tensor %s: the code of row %lld, column %lld is 0x%02x, an "
                              "e4m3 NaN",
                              w->file, name, (long long)(i / K), (long long)(i % K), w->data[i]);
  const char *sfx = c->scale_inv ? "weight_scale_inv" : "weight_scale";
  snprintf(name, sizeof(name), "%s.%s", module, sfx);
  const kiln_weight_t *s = kiln_weights_find(p->src, name);
  if (!s)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor %s is missing (an FP8 Linear needs weight and %s)",
                            w->file, name, sfx);
  if (!fp8_float_type(s->type))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor %s has dtype %s, want f32 (or bf16 / f16)", s->file, name,
                            kiln_wtype_name(s->type));
  int64_t rows = 1, cols = 1;
  const char *what = "[1] (per tensor)";
  char want[64];
  if (q->scheme == KILN_FP8_CHANNEL) {
    rows = N;
    what = want;
    snprintf(want, sizeof(want), "[%lld, 1] (per channel)", (long long)N);
  } else if (q->scheme == KILN_FP8_BLOCK) {
    rows = (N + q->block_n - 1) / q->block_n;
    cols = (K + c->block_k - 1) / c->block_k;
    what = want;
    snprintf(want, sizeof(want), "[%lld, %lld] (blocks of %d x %d)", (long long)rows,
             (long long)cols, (int)c->block_n, (int)c->block_k);
  }
  const bool ok = q->scheme == KILN_FP8_TENSOR
                      ? s->numel == 1
                      : s->ndim == 2 && s->shape[0] == rows && s->shape[1] == cols;
  if (!ok) {
    char got[96];
    int len = snprintf(got, sizeof(got), "[");
    for (int i = 0; i < s->ndim && len < 80; i++)
      len += snprintf(got + len, sizeof(got) - (size_t)len, "%s%lld", i ? ", " : "",
                      (long long)s->shape[i]);
    snprintf(got + len, sizeof(got) - (size_t)len, "]");
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: tensor %s has shape %s, want %s",
                            s->file, name, got, what);
  }
  for (int64_t i = 0; i < s->numel; i++) {
    const float v = fp8_load(s, i);
    if (!isfinite(v))
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s: tensor %s: scale %lld is %g, not finite", s->file, name,
                              (long long)i, (double)v);
  }
  q->scale = s;
  return fp8_input_scale(p, module);
}

/* Row n of an on-the-fly part as f32 (row: K floats); an error for a NaN or infinity. */
static kiln_status_t fp8_fly_row(const model_qpart_t *q, int64_t n, float *row, float *scale) {
  kiln_status_t st = kiln_weight_convert(q->weight, n * q->K, q->K, KILN_HAL_F32, row);
  if (st) return st;
  float amax = 0.0f;
  for (int64_t k = 0; k < q->K; k++) {
    if (!isfinite(row[k]))
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s: tensor %s: the weight of row %lld, column %lld is %g: FP8 "
                              "quantization needs finite weights",
                              q->weight->file, q->weight->name, (long long)n, (long long)k,
                              (double)row[k]);
    if (fabsf(row[k]) > amax) amax = fabsf(row[k]);
  }
  /* s = absmax / 448 (the row's largest weight becomes +-448); an all-zero row takes 1. */
  *scale = amax > 0.0f ? amax / 448.0f : 1.0f;
  return NULL;
}

/* The f32 scale of (row n, group g) of a checkpoint part. */
static float fp8_scale(const model_qpart_t *q, int64_t n, int64_t g) {
  switch (q->scheme) {
    case KILN_FP8_TENSOR: return fp8_load(q->scale, 0);
    case KILN_FP8_CHANNEL: return fp8_load(q->scale, n);
    default: return fp8_load(q->scale, (n / q->block_n) * q->G + g);
  }
}

/* Rows n0 .. n1 - 1 of an on-the-fly part (codes or scales) or of a widened one (either). */
static kiln_status_t fp8_rows(const model_qpart_t *q, int32_t what, int32_t dtype, void *out,
                              int64_t n0, int64_t n1) {
  const int64_t K = q->K, G = q->G;
  float *row = malloc((size_t)K * sizeof(float)), *sc = malloc((size_t)G * sizeof(float));
  uint8_t *codes = malloc((size_t)K);
  kiln_status_t st = NULL;
  if (!row || !sc || !codes) {
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory quantizing %s", q->weight->name);
    goto done;
  }
  for (int64_t n = n0; n < n1 && !st; n++) {
    const uint8_t *crow = q->weight->data + n * K;
    if (q->scheme == KILN_FP8_ON_THE_FLY) {
      if ((st = fp8_fly_row(q, n, row, &sc[0]))) break;
      for (int64_t k = 0; k < K; k++) codes[k] = kiln_hal_f32_to_fp8_e4m3(row[k] / sc[0]);
      crow = codes;
    } else {
      for (int64_t g = 0; g < G; g++) sc[g] = fp8_scale(q, n, g);
    }
    if (what == MODEL_Q_CODES) {
      memcpy((uint8_t *)out + n * K, crow, (size_t)K);
      continue;
    }
    if (what == MODEL_Q_SCALES) {
      memcpy((float *)out + n * G, sc, (size_t)G * sizeof(float));
      continue;
    }
    /* Widened: hal.h's exact f32 values, rounded once to dtype. */
    kiln_hal_fp8_dequant(crow, (const uint8_t *)sc, q->group_size, 0, K, row);
    for (int64_t k = 0; k < K; k++) {
      const int64_t i = n * K + k;
      if (dtype == KILN_HAL_F32)
        ((float *)out)[i] = row[k];
      else if (dtype == KILN_HAL_F16)
        ((uint16_t *)out)[i] = kiln_hal_f32_to_f16(row[k]);
      else
        ((uint16_t *)out)[i] = kiln_hal_f32_to_bf16(row[k]);
    }
  }
done:
  free(row);
  free(sc);
  free(codes);
  return st;
}

typedef struct fp8_job {
  const model_qpart_t *q;
  int32_t what, dtype;
  void *out;
  int64_t n0, n1;
  kiln_status_t st;
} fp8_job_t;

static void *fp8_job_main(void *arg) {
  fp8_job_t *j = arg;
  j->st = fp8_rows(j->q, j->what, j->dtype, j->out, j->n0, j->n1);
  return NULL;
}

/* fp8_rows over every row, split over the host's cores for a large Linear (on-the-fly
 * quantization of a 7B is ~15 G element conversions: a single core took ~70 s). Rows are
 * independent, so the result is the same however they are split; the first error (lowest rows)
 * is returned. */
static kiln_status_t fp8_rows_parallel(const model_qpart_t *q, int32_t what, int32_t dtype,
                                       void *out) {
  enum { MAX_JOBS = 32 };
  const int64_t N = q->N;
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  int64_t jobs = cpus < 1 ? 1 : cpus > MAX_JOBS ? MAX_JOBS : cpus;
  if (N * q->K < ((int64_t)1 << 14)) jobs = 1; /* small (the fixtures' gate_up is 2^14.3) */
  if (jobs > N) jobs = N;
  if (jobs <= 1) return fp8_rows(q, what, dtype, out, 0, N);
  fp8_job_t job[MAX_JOBS];
  pthread_t th[MAX_JOBS];
  bool started[MAX_JOBS];
  for (int64_t t = 0; t < jobs; t++) {
    job[t] = (fp8_job_t){q, what, dtype, out, N * t / jobs, N * (t + 1) / jobs, NULL};
    started[t] = t > 0 && pthread_create(&th[t], NULL, fp8_job_main, &job[t]) == 0;
  }
  fp8_job_main(&job[0]);
  for (int64_t t = 1; t < jobs; t++) {
    if (started[t])
      pthread_join(th[t], NULL);
    else
      fp8_job_main(&job[t]); /* no thread: this one does it */
  }
  kiln_status_t st = NULL;
  for (int64_t t = 0; t < jobs; t++) {
    if (!st)
      st = job[t].st;
    else
      kiln_status_free(job[t].st);
  }
  return st;
}

static kiln_status_t fp8_write(const model_qpart_t *q, int32_t what, int32_t dtype, void *out) {
  const int64_t N = q->N, K = q->K, G = q->G;
  if (what == MODEL_Q_ZEROS || what == MODEL_Q_GIDX) return NULL; /* none */
  if (q->scheme != KILN_FP8_ON_THE_FLY) {
    if (what == MODEL_Q_CODES) {
      memcpy(out, q->weight->data, (size_t)(N * K));
      return NULL;
    }
    if (what == MODEL_Q_SCALES) {
      float *s = out;
      for (int64_t n = 0; n < N; n++)
        for (int64_t g = 0; g < G; g++) s[n * G + g] = fp8_scale(q, n, g);
      return NULL;
    }
  }
  return fp8_rows_parallel(q, what, dtype, out);
}

/* The zero point of (group g, column n), from qzeros (GPTQ v1: stored + 1). */
static int q_zero(const model_qpart_t *q, int64_t g, int64_t n) {
  const uint8_t *d = q->qzeros->data;
  if (q->method == KILN_QUANT_GPTQ) {
    const int64_t P = 32 / q->bits;
    const uint32_t word = (uint32_t)load_i32(d, g * (q->N / P) + n / P);
    return (int)((word >> (q->bits * (n % P))) & ((1u << q->bits) - 1)) +
           (q->zero_minus_one ? 1 : 0);
  }
  const uint32_t word = (uint32_t)load_i32(d, g * (q->N / 8) + n / 8);
  return (int)((word >> (4 * kiln_hal_awq_nibble((int)(n % 8)))) & 15);
}

/* The codes in hal.h's [N, K]-major layout. GPTQ's words already hold their codes in that
 * order (4-bit: k even low nibble, k odd high; 8-bit: one byte per k, lowest first, both little
 * endian), so row n is column n of qweight's words: a transpose of int32s. AWQ's nibbles are
 * regrouped two rows of k at a time. */
static void write_codes(const model_qpart_t *q, uint8_t *out) {
  const int32_t fmt = kiln_qpart_format(q);
  const int64_t rb = kiln_hal_qgroup_row_bytes(fmt, q->K), N = q->N, K = q->K;
  const uint8_t *d = q->qweight->data;
  if (q->method == KILN_QUANT_GPTQ) {
    const int64_t words = K / (32 / q->bits); /* per column */
    for (int64_t kw = 0; kw < words; kw++)
      for (int64_t n = 0; n < N; n++) memcpy(out + n * rb + 4 * kw, d + 4 * (kw * N + n), 4);
    return;
  }
  const int64_t J = N / 8;
  memset(out, 0, (size_t)(N * rb));
  for (int64_t k = 0; k < K; k += 2)
    for (int64_t j = 0; j < J; j++) {
      const uint32_t w0 = (uint32_t)load_i32(d, k * J + j);
      const uint32_t w1 = k + 1 < K ? (uint32_t)load_i32(d, (k + 1) * J + j) : 0;
      for (int c = 0; c < 8; c++) {
        const int sh = 4 * kiln_hal_awq_nibble(c);
        out[(8 * j + c) * rb + k / 2] = (uint8_t)(((w0 >> sh) & 15) | ((w1 >> sh) & 15) << 4);
      }
    }
}

static kiln_status_t write_zeros(const model_qpart_t *q, uint8_t *out) {
  for (int64_t g = 0; g < q->G; g++)
    for (int64_t n = 0; n < q->N; n++) {
      const int z = q_zero(q, g, n);
      if (z > 255) /* a v1 8-bit checkpoint's stored 255 */
        return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                                "%s: tensor %s: the zero of group %lld, column %lld is %d (stored "
                                "%d + 1, GPTQ v1), beyond 8 bits",
                                q->qzeros->file, q->qzeros->name, (long long)g, (long long)n, z,
                                z - 1);
      out[n * q->G + g] = (uint8_t)z;
    }
  return NULL;
}

static void write_scales(const model_qpart_t *q, uint8_t *out) {
  for (int64_t g = 0; g < q->G; g++)
    for (int64_t n = 0; n < q->N; n++)
      memcpy(out + 2 * (n * q->G + g), q->scales->data + 2 * (g * q->N + n), 2);
}

kiln_status_t kiln_qpart_write(const model_qpart_t *q, int32_t what, int32_t dtype, void *out) {
  if (q->method == KILN_QUANT_FP8) return fp8_write(q, what, dtype, out);
  switch (what) {
    case MODEL_Q_CODES: write_codes(q, out); return NULL;
    case MODEL_Q_SCALES: write_scales(q, out); return NULL;
    case MODEL_Q_ZEROS: return write_zeros(q, out);
    case MODEL_Q_GIDX:
      if (q->g_idx) {
        memcpy(out, q->g_idx, (size_t)q->K * 4);
      } else {
        for (int64_t k = 0; k < q->K; k++) ((int32_t *)out)[k] = (int32_t)(k / q->group_size);
      }
      return NULL;
    default: break;
  }
  /* Widened: the group format's exact f32 values (kiln/hal_quant.h), rounded once to dtype. */
  const int32_t fmt = kiln_qpart_format(q);
  const int64_t rb = kiln_hal_qgroup_row_bytes(fmt, q->K);
  uint8_t *codes = malloc((size_t)(q->N * rb)), *sc = malloc((size_t)(q->N * q->G * 2));
  uint8_t *zeros = malloc((size_t)(q->N * q->G));
  float *row = malloc((size_t)q->K * sizeof(float));
  kiln_status_t st = NULL;
  if (!codes || !sc || !zeros || !row) {
    st =
        kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory dequantizing %s", q->qweight->name);
    goto done;
  }
  write_codes(q, codes);
  write_scales(q, sc);
  if ((st = write_zeros(q, zeros))) goto done;
  for (int64_t n = 0; n < q->N; n++) {
    kiln_hal_qgroup_dequant(fmt, codes + n * rb, sc + 2 * n * q->G, zeros + n * q->G, q->g_idx,
                            q->group_size, 0, q->K, row);
    for (int64_t k = 0; k < q->K; k++) {
      const int64_t i = n * q->K + k;
      if (dtype == KILN_HAL_F32)
        ((float *)out)[i] = row[k];
      else if (dtype == KILN_HAL_F16)
        ((uint16_t *)out)[i] = kiln_hal_f32_to_f16(row[k]);
      else
        ((uint16_t *)out)[i] = kiln_hal_f32_to_bf16(row[k]);
    }
  }
done:
  free(codes);
  free(sc);
  free(zeros);
  free(row);
  return st;
}
