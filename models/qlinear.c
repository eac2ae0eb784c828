/* qlinear.c - GPTQ and AWQ Linear weights: the checkpoint tensors checked at load and repacked
 * once into the group formats of the HAL (hal.h's kiln_hal_qweight_t: codes [N, K]-major,
 * scales / zeros [N, G]), or dequantized to the serving dtype for a backend without them.
 * The checkpoint layouts are written out in kiln/hal_quant.h and docs/models.md. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
  q->method = c->method;
  q->bits = c->bits;
  q->zero_minus_one = gptq && c->zero_minus_one;
  q->N = N, q->K = K, q->G = G;
  q->group_size = gs;
  kiln_status_t st;
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
  return q->bits == 4 ? KILN_HAL_QFMT_INT4_G : KILN_HAL_QFMT_INT8_G;
}

uint64_t kiln_qpart_bytes(const model_qpart_t *q, int32_t what, int32_t dtype) {
  const uint64_t N = (uint64_t)q->N, K = (uint64_t)q->K, G = (uint64_t)q->G;
  switch (what) {
    case MODEL_Q_CODES: return N * (uint64_t)kiln_hal_qgroup_row_bytes(kiln_qpart_format(q), q->K);
    case MODEL_Q_SCALES: return N * G * 2;
    case MODEL_Q_ZEROS: return N * G;
    case MODEL_Q_GIDX: return K * 4;
    default: return N * K * kiln_hal_dtype_size(dtype);
  }
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
