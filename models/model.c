/* model.c - loading a model onto a device, its KV cache, and the host-side checks and
 * metadata upload around each forward pass, eager or through a decode graph (see model.h). */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include "models/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "base/log.h"
#include "hal/loader.h"
#include "kiln/hal_quant.h"
#include "kiln/hal_util.h"
#include "models/loader/gguf.h"
#include "models/loader/weights.h"
#include "models/model_internal.h"
#include "models/rope.h"

#define ALIGN 256u
#define STAGING_BYTES (32u << 20)

static uint64_t align_up(uint64_t x) { return (x + ALIGN - 1) & ~(uint64_t)(ALIGN - 1); }

static kiln_status_t hal_st(kiln_hal_error_t *e, const char *what) {
  return e ? kiln_hal_status_from_error(e, what) : NULL;
}

/* ---- the weight plan: which checkpoint tensors go where in the device buffer ------------- */

typedef model_plan_t plan_t;
typedef model_upload_t upload_t;

/* Reserves room for a tensor of numel elements; returns its offset. */
uint64_t model_plan_reserve(plan_t *p, int64_t numel) {
  uint64_t off = p->size;
  p->size = align_up(p->size + (uint64_t)numel * p->es);
  return off;
}

static kiln_status_t plan_push_raw(plan_t *p, const kiln_weight_t *w, uint64_t dst, bool raw);
static kiln_status_t plan_push(plan_t *p, const kiln_weight_t *w, uint64_t dst) {
  return plan_push_raw(p, w, dst, false);
}

static kiln_status_t plan_push_raw(plan_t *p, const kiln_weight_t *w, uint64_t dst, bool raw) {
  if (p->n == p->cap) {
    size_t cap = p->cap ? 2 * p->cap : 64;
    upload_t *u = realloc(p->ups, cap * sizeof(*u));
    if (!u) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory planning the upload");
    p->ups = u;
    p->cap = cap;
  }
  memset(&p->ups[p->n], 0, sizeof(p->ups[p->n]));
  p->ups[p->n].w = w;
  p->ups[p->n].dst = dst;
  p->ups[p->n].raw = raw;
  p->n++;
  return NULL;
}

/* Schedules bytes generated from a GPTQ / AWQ Linear (kiln_qpart_write) at dst. */
static kiln_status_t plan_push_q(plan_t *p, const model_qpart_t *q, int32_t what, uint64_t dst) {
  kiln_status_t st = plan_push_raw(p, NULL, dst, false);
  if (st) return st;
  p->ups[p->n - 1].q = q;
  p->ups[p->n - 1].q_what = what;
  return NULL;
}

/* "tensor X is missing from <file>" (or "from the N files of <path>" for shards). */
static kiln_status_t plan_missing(const plan_t *p, const char *name) {
  int64_t n = kiln_weights_count(p->src), files = 0;
  const char *first = n ? kiln_weights_at(p->src, 0)->file : p->path;
  for (int64_t i = 0; i < n; i++) {
    const char *f = kiln_weights_at(p->src, i)->file;
    bool seen = false;
    for (int64_t j = 0; j < i && !seen; j++) seen = kiln_weights_at(p->src, j)->file == f;
    files += !seen;
  }
  if (files <= 1)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor %s is missing (%lld tensors there)", first, name,
                            (long long)n);
  return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "%s: tensor %s is missing from all %lld weight files", p->path, name,
                          (long long)files);
}

kiln_status_t model_plan_tensor_nd(plan_t *p, const char *name, int ndim, const int64_t *shape,
                                   uint64_t dst, bool required, bool *found) {
  const kiln_weight_t *w = kiln_weights_find(p->src, name);
  if (found) *found = w != NULL;
  if (!w) return required ? plan_missing(p, name) : NULL;
  if (w->type == KILN_WTYPE_I32 || w->type == KILN_WTYPE_F8_E4M3 || w->type == KILN_WTYPE_F8_E5M2)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor %s has dtype %s, want a float tensor (F32, F16 or BF16)",
                            w->file, name, kiln_wtype_name(w->type));
  kiln_status_t st = kiln_weight_expect_shape(w, ndim, shape);
  if (st) return st;
  return plan_push(p, w, dst);
}

bool model_plan_has(const plan_t *p, const char *name) {
  return kiln_weights_find(p->src, name) != NULL;
}

/* Finds name with the given shape (ndim 1 or 2) and schedules it at dst. A missing optional
 * tensor leaves *found false; a missing required one is an error. */
static kiln_status_t plan_tensor(plan_t *p, const char *name, int64_t d0, int64_t d1, uint64_t dst,
                                 bool required, bool *found) {
  int64_t shape[2] = {d0, d1};
  return model_plan_tensor_nd(p, name, d1 > 0 ? 2 : 1, shape, dst, required, found);
}

kiln_status_t model_plan_one(plan_t *p, const char *name, int64_t d0, int64_t d1,
                             uint64_t *out_off) {
  *out_off = model_plan_reserve(p, d0 * (d1 > 0 ? d1 : 1));
  return plan_tensor(p, name, d0, d1, *out_off, true, NULL);
}

kiln_status_t model_plan_fused(plan_t *p, int n, char names[][160], const int64_t *rows,
                               int64_t cols, bool optional, uint64_t *out_off) {
  int64_t total = 0;
  int present = 0;
  for (int i = 0; i < n; i++) {
    total += rows[i];
    present += kiln_weights_find(p->src, names[i]) != NULL;
  }
  if (optional && present == 0) {
    *out_off = MODEL_NO_TENSOR;
    return NULL;
  }
  uint64_t off = model_plan_reserve(p, total * (cols > 0 ? cols : 1));
  *out_off = off;
  for (int i = 0; i < n; i++) {
    kiln_status_t st = plan_tensor(p, names[i], rows[i], cols, off, true, NULL);
    if (st) return st;
    off += (uint64_t)rows[i] * (cols > 0 ? cols : 1) * p->es;
  }
  return NULL;
}

/* The GPTQ / AWQ / FP8 side of model_plan_linear: *done false when no part is such a Linear. */
static kiln_status_t plan_qlinear(plan_t *p, int n, char names[][160], const int64_t *rows,
                                  int64_t cols, uint64_t *out_off, int32_t *out_fmt,
                                  model_qlinear_t *out_q, bool *done) {
  *done = false;
  model_qpart_t *qp[3] = {NULL, NULL, NULL};
  int nq = 0;
  for (int i = 0; i < n && i < 3; i++) {
    char mod[160], qn[176];
    size_t len = strlen(names[i]);
    if (len < 7 || strcmp(names[i] + len - 7, ".weight") != 0) continue;
    snprintf(mod, sizeof(mod), "%.*s", (int)(len - 7), names[i]);
    kiln_status_t st;
    if (p->quant->method == KILN_QUANT_FP8) {
      /* FP8: a Linear whose weight is F8 (or, on the fly, any float Linear) */
      const kiln_weight_t *w = kiln_weights_find(p->src, names[i]);
      if (!w) continue; /* model_plan_fused names it */
      const bool f8 = w->type == KILN_WTYPE_F8_E4M3 || w->type == KILN_WTYPE_F8_E5M2;
      const bool flt = w->type == KILN_WTYPE_F32 || w->type == KILN_WTYPE_F16 ||
                       w->type == KILN_WTYPE_BF16;
      if (p->quant->fp8_scheme == KILN_FP8_ON_THE_FLY ? !flt : !f8) continue;
      if (f8 && kiln_quant_ignored(p->quant, mod))
        return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                                "%s: tensor %s is %s, but quantization_config lists %s among the "
                                "modules left unquantized",
                                w->file, names[i], kiln_wtype_name(w->type), mod);
      st = kiln_qpart_open_fp8(p, mod, rows[i], cols, &qp[i]);
    } else {
      snprintf(qn, sizeof(qn), "%s.qweight", mod);
      if (!kiln_weights_find(p->src, qn)) continue;
      st = kiln_qpart_open(p, mod, rows[i], cols, &qp[i]);
    }
    if (st) return st;
    nq++;
  }
  if (nq == 0) return NULL;
  *done = true;
  /* Kept in the group format when every part is quantized alike and the device takes it. */
  const char *why = NULL;
  const int32_t fmt = kiln_qpart_format(qp[0] ? qp[0] : qp[nq - 1]);
  if (nq != n) why = "a fused Linear mixes quantized and float parts";
  for (int i = 1; !why && i < n; i++) {
    const int32_t *a = kiln_qpart_g_idx(qp[0]), *b = kiln_qpart_g_idx(qp[i]);
    if ((a == NULL) != (b == NULL) || (a && memcmp(a, b, (size_t)cols * sizeof(int32_t)) != 0))
      why = "the parts of a fused Linear have different g_idx";
  }
  if (!why && p->q_dense_why) why = p->q_dense_why;
  if (!why && fmt == KILN_HAL_QFMT_FP8_E4M3) why = p->fp8_widen_why;
  if (!why && !(p->qcaps & KILN_HAL_CAP_QUANT(fmt)))
    why = "the backend has no gemm_quant for this format";
  if (!why && fmt == KILN_HAL_QFMT_INT4_G && cols % 2) why = "in_features is odd";
  kiln_status_t st = NULL;
  if (why) { /* dequantized to the serving dtype, parts stacked as model_plan_fused does */
    p->q_widened += nq;
    p->q_widen_why = why;
    int64_t total = 0;
    for (int i = 0; i < n; i++) total += rows[i];
    uint64_t off = model_plan_reserve(p, total * cols);
    *out_off = off;
    for (int i = 0; i < n && !st; i++) {
      if (qp[i])
        st = plan_push_q(p, qp[i], MODEL_Q_WIDEN, off);
      else
        st = plan_tensor(p, names[i], rows[i], cols, off, true, NULL);
      off += (uint64_t)rows[i] * (uint64_t)cols * p->es;
    }
    return st;
  }
  p->q_kept += nq;
  int64_t total = 0;
  for (int i = 0; i < n; i++) total += rows[i];
  const int64_t G = kiln_qpart_groups(qp[0]);
  const uint64_t rb = (uint64_t)kiln_hal_qgroup_row_bytes(fmt, cols);
  const bool fp8 = fmt == KILN_HAL_QFMT_FP8_E4M3; /* F32 scales, no zeros */
  const uint64_t ses = fp8 ? 4 : 2, zes = fp8 ? 0 : 1;
  uint64_t codes = p->size;
  p->size = align_up(p->size + (uint64_t)total * rb);
  uint64_t scales = p->size;
  p->size = align_up(p->size + (uint64_t)(total * G) * ses);
  uint64_t zeros = p->size;
  p->size = align_up(p->size + (uint64_t)(total * G) * zes);
  uint64_t g_idx = MODEL_NO_TENSOR;
  if (kiln_qpart_g_idx(qp[0])) {
    g_idx = p->size;
    p->size = align_up(p->size + (uint64_t)cols * 4);
    st = plan_push_q(p, qp[0], MODEL_Q_GIDX, g_idx);
  }
  *out_off = codes;
  for (int i = 0; i < n && !st; i++) {
    if ((st = plan_push_q(p, qp[i], MODEL_Q_CODES, codes)) ||
        (st = plan_push_q(p, qp[i], MODEL_Q_SCALES, scales)) ||
        (!fp8 && (st = plan_push_q(p, qp[i], MODEL_Q_ZEROS, zeros))))
      break;
    codes += (uint64_t)rows[i] * rb;
    scales += (uint64_t)(rows[i] * G) * ses;
    zeros += (uint64_t)(rows[i] * G) * zes;
  }
  if (st) return st;
  *out_fmt = fmt;
  out_q->group_size = kiln_qpart_group_size(qp[0]);
  out_q->groups = G;
  out_q->scales = scales - (uint64_t)(total * G) * ses;
  out_q->zeros = fp8 ? MODEL_NO_TENSOR : zeros - (uint64_t)(total * G);
  out_q->g_idx = g_idx;
  return NULL;
}

kiln_status_t model_plan_linear(plan_t *p, int n, char names[][160], const int64_t *rows,
                                int64_t cols, uint64_t *out_off, int32_t *out_fmt,
                                model_qlinear_t *out_q) {
  *out_fmt = KILN_HAL_QFMT_NONE;
  memset(out_q, 0, sizeof(*out_q));
  out_q->scales = out_q->zeros = out_q->g_idx = MODEL_NO_TENSOR;
  if (p->quant && p->quant->method != KILN_QUANT_NONE) {
    bool done;
    kiln_status_t st = plan_qlinear(p, n, names, rows, cols, out_off, out_fmt, out_q, &done);
    if (st || done) return st;
  }
  int32_t fmt = KILN_HAL_QFMT_NONE;
  for (int i = 0; i < n; i++) {
    const kiln_weight_t *w = kiln_weights_find(p->src, names[i]);
    int32_t f = w ? kiln_wtype_qfmt(w->type) : KILN_HAL_QFMT_NONE;
    if (f == KILN_HAL_QFMT_NONE || (i > 0 && f != fmt)) {
      fmt = KILN_HAL_QFMT_NONE;
      break;
    }
    fmt = f;
  }
  if (fmt == KILN_HAL_QFMT_NONE || !(p->qcaps & KILN_HAL_CAP_QUANT(fmt)) ||
      cols % kiln_hal_qfmt_block_elems(fmt))
    return model_plan_fused(p, n, names, rows, cols, false, out_off);
  /* Kept as blocks: rows of cols / E blocks, the parts' rows stacked. */
  const uint64_t row_bytes =
      (uint64_t)(cols / kiln_hal_qfmt_block_elems(fmt)) * (uint64_t)kiln_hal_qfmt_block_bytes(fmt);
  int64_t total = 0;
  for (int i = 0; i < n; i++) total += rows[i];
  uint64_t off = p->size;
  p->size = align_up(p->size + (uint64_t)total * row_bytes);
  *out_off = off;
  for (int i = 0; i < n; i++) {
    const kiln_weight_t *w = kiln_weights_find(p->src, names[i]);
    const int64_t shape[2] = {rows[i], cols};
    kiln_status_t st = kiln_weight_expect_shape(w, 2, shape);
    if (!st) st = plan_push_raw(p, w, off, true);
    if (st) return st;
    off += (uint64_t)rows[i] * row_bytes;
  }
  *out_fmt = fmt;
  return NULL;
}

/* True when the three parts are GGUF block types the device multiplies, not all the same one. */
static bool qkv_mixed_blocks(const plan_t *p, char names[][160]) {
  int32_t f[3];
  for (int i = 0; i < 3; i++) {
    const kiln_weight_t *w = kiln_weights_find(p->src, names[i]);
    f[i] = w ? kiln_wtype_qfmt(w->type) : KILN_HAL_QFMT_NONE;
    if (f[i] == KILN_HAL_QFMT_NONE || kiln_hal_qfmt_is_group(f[i]) ||
        !(p->qcaps & KILN_HAL_CAP_QUANT(f[i])) ||
        w->shape[w->ndim - 1] % kiln_hal_qfmt_block_elems(f[i]))
      return false;
  }
  return f[0] != f[1] || f[1] != f[2];
}

/* Layer l's FP8 KV-cache scales (hal.h: K = k_scale * e4m3(code)), as llm-compressor and
 * vLLM write them: <pre>.layers.l.self_attn.k_scale / v_scale (compressed-tensors'
 * kv_cache_scheme), or the older self_attn.k_proj.output_scale / v_proj.output_scale; one
 * positive finite float each. Absent: 1.0 (kiln_model_load checks that no layer has only
 * some). */
static kiln_status_t model_kv_scales(kiln_model_t *m, plan_t *p, const char *pre, int64_t l) {
  static const char *const names[2][2] = {{"self_attn.k_scale", "self_attn.k_proj.output_scale"},
                                          {"self_attn.v_scale", "self_attn.v_proj.output_scale"}};
  for (int kv = 0; kv < 2; kv++) {
    char name[192];
    const kiln_weight_t *w = NULL;
    for (int i = 0; i < 2 && !w; i++) {
      snprintf(name, sizeof(name), "%s.layers.%lld.%s", pre, (long long)l, names[kv][i]);
      w = kiln_weights_find(p->src, name);
    }
    m->kv_scales[2 * l + kv] = 1.0f;
    if (!w) continue;
    float v = NAN;
    if ((w->type == KILN_WTYPE_F32 || w->type == KILN_WTYPE_F16 || w->type == KILN_WTYPE_BF16) &&
        w->numel == 1) {
      kiln_status_t st = kiln_weight_convert(w, 0, 1, KILN_HAL_F32, &v);
      if (st) return st;
    } else {
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s: tensor %s: an FP8 KV-cache scale is one f32 / bf16 / f16 "
                              "value, got %s with %lld",
                              w->file, name, kiln_wtype_name(w->type), (long long)w->numel);
    }
    if (!(v > 0.0f) || !isfinite(v))
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s: tensor %s is %g: an FP8 KV-cache scale must be positive and "
                              "finite",
                              w->file, name, (double)v);
    m->kv_scales[2 * l + kv] = v;
    m->kv_scales_found++;
  }
  return NULL;
}

/* ---- tensor parallelism: this rank's shard of a layer (docs/parallel.md) ----------------- */

/* Schedules rows [r0, r0 + nr) and columns [c0, c0 + nc) of the float tensor name, whose shape
 * must be [rows, cols] (cols 0: 1-D [rows], sliced as one row: r0 must be 0 and nr 1, the
 * slice is columns [c0, c0 + nc) of it), at dst. */
static kiln_status_t plan_slice(plan_t *p, const char *name, int64_t rows, int64_t cols,
                                int64_t r0, int64_t nr, int64_t c0, int64_t nc, uint64_t dst) {
  const kiln_weight_t *w = kiln_weights_find(p->src, name);
  if (!w) return plan_missing(p, name);
  if (w->type != KILN_WTYPE_F32 && w->type != KILN_WTYPE_F16 && w->type != KILN_WTYPE_BF16)
    return kiln_status_make(KILN_ERR_UNSUPPORTED,
                            "%s: tensor %s has dtype %s: tensor parallelism loads F32, F16 or "
                            "BF16 weights only for now",
                            w->file, name, kiln_wtype_name(w->type));
  const int64_t shape[2] = {rows, cols};
  kiln_status_t st = kiln_weight_expect_shape(w, cols > 0 ? 2 : 1, shape);
  if (!st) st = plan_push(p, w, dst);
  if (st) return st;
  model_upload_t *u = &p->ups[p->n - 1];
  u->sl_r0 = r0;
  u->sl_rows = nr;
  u->sl_c0 = c0;
  u->sl_ncols = nc;
  u->sl_cols = cols > 0 ? cols : rows;
  return NULL;
}

static void qlinear_none(int32_t *fmt, model_qlinear_t *q) {
  *fmt = KILN_HAL_QFMT_NONE;
  memset(q, 0, sizeof(*q));
  q->scales = q->zeros = q->g_idx = MODEL_NO_TENSOR;
}

/* Layer l of rank m->tp_rank: q/k/v and gate/up column-parallel (this rank's rows: its query
 * heads, its KV heads or the one it shares, its slice of the intermediate size), o_proj and
 * down_proj row-parallel (the matching columns), their biases on rank 0 only (the all_reduce
 * adds them once), norms replicated. The layout is the single-device one at the local sizes
 * (m->cfg), so llama.c runs unchanged between the two all_reduce. */
static kiln_status_t plan_layer_tp(kiln_model_t *m, plan_t *p, const char *pre, int64_t l) {
  const kiln_model_config_t *F = &m->full, *c = &m->cfg;
  const int64_t H = F->hidden_size, D = F->head_dim, r = m->tp_rank;
  const int64_t QD = F->num_heads * D, KD = F->num_kv_heads * D, I = F->intermediate_size;
  const int64_t QDl = c->num_heads * D, KDl = c->num_kv_heads * D, Il = c->intermediate_size;
  const int64_t q0 = r * QDl, k0 = m->tp_kv0 * D, i0 = r * Il;
  const uint64_t es = p->es;
  model_layer_t *L = &m->layers[l];
  kiln_status_t st;
  char nm[3][160];
#define NAME(i, fmt) snprintf(nm[i], sizeof(nm[i]), "%s.layers.%lld." fmt, pre, (long long)l)
  NAME(0, "input_layernorm.weight");
  if ((st = model_plan_one(p, nm[0], H, 0, &L->in_norm))) return st;
  NAME(0, "post_attention_layernorm.weight");
  if ((st = model_plan_one(p, nm[0], H, 0, &L->post_norm))) return st;
  qlinear_none(&L->qkv_fmt, &L->qkv_q);
  qlinear_none(&L->o_fmt, &L->o_q);
  qlinear_none(&L->gu_fmt, &L->gu_q);
  qlinear_none(&L->down_fmt, &L->down_q);
  L->qkv_mixed = false;
  L->qkv_w = model_plan_reserve(p, (QDl + 2 * KDl) * H);
  NAME(0, "self_attn.q_proj.weight");
  NAME(1, "self_attn.k_proj.weight");
  NAME(2, "self_attn.v_proj.weight");
  if ((st = plan_slice(p, nm[0], QD, H, q0, QDl, 0, H, L->qkv_w)) ||
      (st = plan_slice(p, nm[1], KD, H, k0, KDl, 0, H, L->qkv_w + (uint64_t)(QDl * H) * es)) ||
      (st = plan_slice(p, nm[2], KD, H, k0, KDl, 0, H,
                       L->qkv_w + (uint64_t)((QDl + KDl) * H) * es)))
    return st;
  NAME(0, "self_attn.q_proj.bias");
  NAME(1, "self_attn.k_proj.bias");
  NAME(2, "self_attn.v_proj.bias");
  L->qkv_b = MODEL_NO_TENSOR;
  if (c->qkv_bias || model_plan_has(p, nm[0])) {
    L->qkv_b = model_plan_reserve(p, QDl + 2 * KDl);
    if ((st = plan_slice(p, nm[0], QD, 0, 0, 1, q0, QDl, L->qkv_b)) ||
        (st = plan_slice(p, nm[1], KD, 0, 0, 1, k0, KDl, L->qkv_b + (uint64_t)QDl * es)) ||
        (st = plan_slice(p, nm[2], KD, 0, 0, 1, k0, KDl, L->qkv_b + (uint64_t)(QDl + KDl) * es)))
      return st;
  }
  L->q_norm = L->k_norm = MODEL_NO_TENSOR;
  if (c->qk_norm) {
    NAME(0, "self_attn.q_norm.weight");
    if ((st = model_plan_one(p, nm[0], D, 0, &L->q_norm))) return st;
    NAME(0, "self_attn.k_norm.weight");
    if ((st = model_plan_one(p, nm[0], D, 0, &L->k_norm))) return st;
  }
  NAME(0, "self_attn.o_proj.weight");
  L->o_w = model_plan_reserve(p, H * QDl);
  if ((st = plan_slice(p, nm[0], H, QD, 0, H, q0, QDl, L->o_w))) return st;
  L->o_b = L->gu_b = L->down_b = MODEL_NO_TENSOR;
  if (c->o_bias && r == 0) {
    NAME(0, "self_attn.o_proj.bias");
    if ((st = model_plan_one(p, nm[0], H, 0, &L->o_b))) return st;
  }
  NAME(0, "mlp.gate_proj.weight");
  NAME(1, "mlp.up_proj.weight");
  L->gu_w = model_plan_reserve(p, 2 * Il * H);
  if ((st = plan_slice(p, nm[0], I, H, i0, Il, 0, H, L->gu_w)) ||
      (st = plan_slice(p, nm[1], I, H, i0, Il, 0, H, L->gu_w + (uint64_t)(Il * H) * es)))
    return st;
  if (c->mlp_bias) {
    NAME(0, "mlp.gate_proj.bias");
    NAME(1, "mlp.up_proj.bias");
    L->gu_b = model_plan_reserve(p, 2 * Il);
    if ((st = plan_slice(p, nm[0], I, 0, 0, 1, i0, Il, L->gu_b)) ||
        (st = plan_slice(p, nm[1], I, 0, 0, 1, i0, Il, L->gu_b + (uint64_t)Il * es)))
      return st;
    NAME(0, "mlp.down_proj.bias");
    if (r == 0 && (st = model_plan_one(p, nm[0], H, 0, &L->down_b))) return st;
  }
  NAME(0, "mlp.down_proj.weight");
  L->down_w = model_plan_reserve(p, H * Il);
  if ((st = plan_slice(p, nm[0], H, I, 0, H, i0, Il, L->down_w))) return st;
#undef NAME
  L->window = c->layer_sliding[l] ? c->sliding_window : 0;
  return NULL;
}

static kiln_status_t model_plan(kiln_model_t *m, plan_t *p) {
  const kiln_model_config_t *c = &m->cfg;
  const int64_t H = c->hidden_size, I = c->intermediate_size, V = c->vocab_size;
  const int64_t QD = c->num_heads * c->head_dim, KD = c->num_kv_heads * c->head_dim;
  kiln_status_t st;
  /* Vision-language checkpoints: the published files and transformers 5.17's save_pretrained
   * name the decoder model.*; transformers 5's module tree (and files saved from it as is)
   * model.language_model.*. */
  const char *pre = "model";
  if (c->vision.present && model_plan_has(p, "model.language_model.embed_tokens.weight"))
    pre = "model.language_model";
  char nm[3][160];
  snprintf(nm[0], sizeof(nm[0]), "%s.embed_tokens.weight", pre);
  snprintf(nm[1], sizeof(nm[1]), "%s.norm.weight", pre);
  if ((st = model_plan_one(p, nm[0], V, H, &m->embed)) ||
      (st = model_plan_one(p, nm[1], H, 0, &m->final_norm)))
    return st;
  /* lm_head: a GGUF block type the device multiplies stays quantized (a second copy of a tied
   * embedding, whose lookup keeps the widened rows): at batch 1 it is the largest matrix
   * streamed per token (Llama 3.2 1B: 128256 x 2048). */
  m->lm_fmt = KILN_HAL_QFMT_NONE;
  memset(&m->lm_q, 0, sizeof(m->lm_q));
  m->lm_q.scales = m->lm_q.zeros = m->lm_q.g_idx = MODEL_NO_TENSOR;
  snprintf(nm[2], sizeof(nm[2]), "%s", c->tie_word_embeddings ? nm[0] : "lm_head.weight");
  const kiln_weight_t *lw = kiln_weights_find(p->src, nm[2]);
  const int32_t lf = lw ? kiln_wtype_qfmt(lw->type) : KILN_HAL_QFMT_NONE;
  /* An FP8 checkpoint's lm_head in F8 (not in its ignore list) is an FP8 Linear like the
   * others; [model] quantization = fp8 leaves lm_head as it is. */
  const bool lm_fp8 = lw && !c->tie_word_embeddings && c->quant.method == KILN_QUANT_FP8 &&
                      (lw->type == KILN_WTYPE_F8_E4M3 || lw->type == KILN_WTYPE_F8_E5M2);
  if (lm_fp8 || (lf != KILN_HAL_QFMT_NONE && !kiln_hal_qfmt_is_group(lf) &&
                 (p->qcaps & KILN_HAL_CAP_QUANT(lf)) && H % kiln_hal_qfmt_block_elems(lf) == 0)) {
    const int64_t vrows[1] = {V};
    if ((st = model_plan_linear(p, 1, &nm[2], vrows, H, &m->lm_head, &m->lm_fmt, &m->lm_q)))
      return st;
  } else if (c->tie_word_embeddings) {
    m->lm_head = m->embed;
  } else if ((st = model_plan_one(p, "lm_head.weight", V, H, &m->lm_head))) {
    return st;
  }
  for (int64_t l = 0; l < c->num_layers; l++) {
    if (m->tp_size > 1) {
      if ((st = plan_layer_tp(m, p, pre, l))) return st;
      continue;
    }
    model_layer_t *L = &m->layers[l];
#define NAME(i, fmt) snprintf(nm[i], sizeof(nm[i]), "%s.layers.%lld." fmt, pre, (long long)l)
    NAME(0, "input_layernorm.weight");
    if ((st = model_plan_one(p, nm[0], H, 0, &L->in_norm))) return st;
    NAME(0, "post_attention_layernorm.weight");
    if ((st = model_plan_one(p, nm[0], H, 0, &L->post_norm))) return st;
    const int64_t qkv_rows[3] = {QD, KD, KD};
    if (m->kv_format == KILN_HAL_KV_FP8_E4M3 && (st = model_kv_scales(m, p, pre, l))) return st;
    NAME(0, "self_attn.q_proj.weight");
    NAME(1, "self_attn.k_proj.weight");
    NAME(2, "self_attn.v_proj.weight");
    /* Qwen3's q/k norms split the QKV GEMM (llama.c): those layers stay dense. */
    if (c->qk_norm) { /* dense: a device without the formats' caps widens every part */
      const uint64_t caps = p->qcaps;
      p->qcaps = 0;
      p->q_dense_why = "Qwen3's q/k norms split the fused QKV";
      st = model_plan_linear(p, 3, nm, qkv_rows, H, &L->qkv_w, &L->qkv_fmt, &L->qkv_q);
      p->qcaps = caps;
      p->q_dense_why = NULL;
      if (st) return st;
    } else if (qkv_mixed_blocks(p, nm)) {
      /* GGUF q/k/v in different block types (Q4_K_M's attn_v is Q6_K in some layers): each
       * part kept in its own, three GEMMs into the fused output's columns (llama.c). */
      L->qkv_fmt = KILN_HAL_QFMT_NONE;
      L->qkv_mixed = true;
      for (int i = 0; i < 3; i++)
        if ((st = model_plan_linear(p, 1, &nm[i], &qkv_rows[i], H, &L->qkv_pw[i], &L->qkv_pf[i],
                                    &L->qkv_q)))
          return st;
      L->qkv_w = L->qkv_pw[0];
    } else if ((st = model_plan_linear(p, 3, nm, qkv_rows, H, &L->qkv_w, &L->qkv_fmt, &L->qkv_q))) {
      return st;
    }
    NAME(0, "self_attn.q_proj.bias");
    NAME(1, "self_attn.k_proj.bias");
    NAME(2, "self_attn.v_proj.bias");
    if ((st = model_plan_fused(p, 3, nm, qkv_rows, 0, !c->qkv_bias, &L->qkv_b))) return st;
    if (c->qkv_bias && L->qkv_b == MODEL_NO_TENSOR) return plan_missing(p, nm[0]);
    L->q_norm = L->k_norm = MODEL_NO_TENSOR;
    if (c->qk_norm) {
      NAME(0, "self_attn.q_norm.weight");
      if ((st = model_plan_one(p, nm[0], c->head_dim, 0, &L->q_norm))) return st;
      NAME(0, "self_attn.k_norm.weight");
      if ((st = model_plan_one(p, nm[0], c->head_dim, 0, &L->k_norm))) return st;
    }
    NAME(0, "self_attn.o_proj.weight");
    const int64_t o_rows[1] = {H}, down_rows[1] = {H};
    if ((st = model_plan_linear(p, 1, nm, o_rows, QD, &L->o_w, &L->o_fmt, &L->o_q))) return st;
    L->o_b = MODEL_NO_TENSOR;
    if (c->o_bias) {
      NAME(0, "self_attn.o_proj.bias");
      if ((st = model_plan_one(p, nm[0], H, 0, &L->o_b))) return st;
    }
    const int64_t gu_rows[2] = {I, I};
    NAME(0, "mlp.gate_proj.weight");
    NAME(1, "mlp.up_proj.weight");
    if ((st = model_plan_linear(p, 2, nm, gu_rows, H, &L->gu_w, &L->gu_fmt, &L->gu_q))) return st;
    L->gu_b = L->down_b = MODEL_NO_TENSOR;
    if (c->mlp_bias) {
      NAME(0, "mlp.gate_proj.bias");
      NAME(1, "mlp.up_proj.bias");
      if ((st = model_plan_fused(p, 2, nm, gu_rows, 0, false, &L->gu_b))) return st;
      NAME(0, "mlp.down_proj.bias");
      if ((st = model_plan_one(p, nm[0], H, 0, &L->down_b))) return st;
    }
    NAME(0, "mlp.down_proj.weight");
    if ((st = model_plan_linear(p, 1, nm, down_rows, I, &L->down_w, &L->down_fmt, &L->down_q)))
      return st;
#undef NAME
    L->window = c->layer_sliding[l] ? c->sliding_window : 0;
  }
  if (c->vision.present) return vision_plan(m, p);
  return NULL;
}

/* Converts every planned tensor to the serving dtype and copies it into the weight buffer:
 * straight into it when the buffer is host memory, else through a (pinned when possible)
 * staging buffer, one chunk at a time. */
static kiln_status_t model_upload(kiln_model_t *m, const plan_t *p) {
  kiln_status_t st = NULL;
  uint8_t *direct = m->be->buffer_host_ptr ? m->be->buffer_host_ptr(m->weights) : NULL;
  kiln_hal_buffer_t *pinned = NULL;
  uint8_t *stage = NULL;
  bool stage_owned = false;
  if (!direct) {
    if (!m->be->buffer_alloc(m->dev, STAGING_BYTES, KILN_HAL_BUFFER_HOST_PINNED, &pinned) &&
        m->be->buffer_host_ptr)
      stage = m->be->buffer_host_ptr(pinned);
    if (!stage) {
      stage = malloc(STAGING_BYTES);
      stage_owned = true;
      if (!stage) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of host memory for staging");
    }
  }
  const int64_t chunk = (int64_t)(STAGING_BYTES / m->es) & ~(int64_t)255; /* whole blocks */
  for (size_t i = 0; i < p->n && !st; i++) {
    const kiln_weight_t *w = p->ups[i].w;
    if (p->ups[i].q) { /* GPTQ / AWQ: repacked (or widened) on the host, then copied */
      const model_qpart_t *q = p->ups[i].q;
      const uint64_t nb = kiln_qpart_bytes(q, p->ups[i].q_what, m->dtype);
      uint8_t *tmp = direct ? direct + p->ups[i].dst : malloc(nb ? (size_t)nb : 1);
      if (!tmp) {
        st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of host memory repacking weights");
        break;
      }
      st = kiln_qpart_write(q, p->ups[i].q_what, m->dtype, tmp);
      for (uint64_t done = 0; !direct && !st && done < nb; done += STAGING_BYTES) {
        uint64_t n = nb - done < STAGING_BYTES ? nb - done : STAGING_BYTES;
        memcpy(stage, tmp + done, (size_t)n);
        st = hal_st(m->be->copy_h2d(m->stream, m->weights, p->ups[i].dst + done, stage, n),
                    "uploading weights");
        if (!st) st = hal_st(m->be->stream_sync(m->stream), "uploading weights");
      }
      if (!direct) free(tmp);
      continue;
    }
    if (p->ups[i].sl_rows > 0) { /* a tensor-parallel shard: row by row */
      const model_upload_t *u = &p->ups[i];
      const uint64_t nb = (uint64_t)(u->sl_rows * u->sl_ncols) * m->es;
      uint8_t *tmp = direct ? direct + u->dst : malloc((size_t)nb);
      if (!tmp) {
        st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of host memory slicing weights");
        break;
      }
      for (int64_t j = 0; j < u->sl_rows && !st; j++)
        st = kiln_weight_convert(w, (u->sl_r0 + j) * u->sl_cols + u->sl_c0, u->sl_ncols, m->dtype,
                                 tmp + (uint64_t)(j * u->sl_ncols) * m->es);
      if (!direct && !st) {
        st = hal_st(m->be->copy_h2d(m->stream, m->weights, u->dst, tmp, nb), "uploading weights");
        if (!st) st = hal_st(m->be->stream_sync(m->stream), "uploading weights");
      }
      if (!direct) free(tmp);
      continue;
    }
    if (p->ups[i].raw) { /* quantized blocks, as they are in the file */
      if (direct) {
        memcpy(direct + p->ups[i].dst, w->data, (size_t)w->nbytes);
        continue;
      }
      for (uint64_t done = 0; done < w->nbytes && !st; done += STAGING_BYTES) {
        uint64_t n = w->nbytes - done < STAGING_BYTES ? w->nbytes - done : STAGING_BYTES;
        memcpy(stage, w->data + done, (size_t)n);
        st = hal_st(m->be->copy_h2d(m->stream, m->weights, p->ups[i].dst + done, stage, n),
                    "uploading weights");
        if (!st) st = hal_st(m->be->stream_sync(m->stream), "uploading weights");
      }
      continue;
    }
    if (direct) {
      st = kiln_weight_convert(w, 0, w->numel, m->dtype, direct + p->ups[i].dst);
      continue;
    }
    for (int64_t first = 0; first < w->numel && !st; first += chunk) {
      int64_t n = w->numel - first < chunk ? w->numel - first : chunk;
      if ((st = kiln_weight_convert(w, first, n, m->dtype, stage))) break;
      st = hal_st(m->be->copy_h2d(m->stream, m->weights, p->ups[i].dst + (uint64_t)first * m->es,
                                  stage, (uint64_t)n * m->es),
                  "uploading weights");
      if (!st) st = hal_st(m->be->stream_sync(m->stream), "uploading weights");
    }
  }
  if (pinned) m->be->buffer_free(pinned);
  if (stage_owned) free(stage);
  return st;
}

static kiln_status_t alloc_buf(kiln_model_t *m, uint64_t size, uint32_t flags, const char *what,
                               kiln_hal_buffer_t **out) {
  kiln_hal_error_t *e = m->be->buffer_alloc(m->dev, size ? size : 1, flags, out);
  if (!e) return NULL;
  char b[32];
  snprintf(b, sizeof(b), "%.1f MiB", (double)size / (1 << 20));
  return kiln_status_annotate(kiln_hal_status_from_error(e, what), "allocating %s for %s", b, what);
}

/* m->quant_desc for a GGUF file: the quantized types of its 2-D weights, with counts. */
static void gguf_quant_describe(kiln_model_t *m, const kiln_weights_t *src) {
  int64_t count[KILN_WTYPE_COUNT] = {0};
  for (int64_t i = 0; i < kiln_weights_count(src); i++) {
    const kiln_weight_t *w = kiln_weights_at(src, i);
    if (w->ndim == 2 && w->type >= 0 && w->type < KILN_WTYPE_COUNT) count[w->type]++;
  }
  size_t n = 0;
  for (int t = 0; t < KILN_WTYPE_COUNT; t++) {
    if (!count[t] || t == KILN_WTYPE_F32 || t == KILN_WTYPE_F16 || t == KILN_WTYPE_BF16) continue;
    int k = snprintf(m->quant_desc + n, sizeof(m->quant_desc) - n, "%s%s x %lld",
                     n ? ", " : "gguf: ", kiln_wtype_name(t), (long long)count[t]);
    if (k < 0 || (size_t)k >= sizeof(m->quant_desc) - n) break;
    n += (size_t)k;
  }
}

static bool is_gguf(const char *path) {
  struct stat sb;
  if (stat(path, &sb) != 0 || !S_ISREG(sb.st_mode)) return false;
  FILE *f = fopen(path, "rb");
  if (!f) return false;
  char magic[4] = {0};
  size_t n = fread(magic, 1, 4, f);
  fclose(f);
  return n == 4 && memcmp(magic, "GGUF", 4) == 0;
}

kiln_status_t kiln_model_tokenizer_dir(const char *model_path, char *buf, size_t size) {
  size_t n = strlen(model_path), len = n;
  const char *src = model_path;
  if (n > 5 && strcmp(model_path + n - 5, ".gguf") == 0) {
    const char *slash = strrchr(model_path, '/');
    src = slash ? model_path : ".";
    len = slash ? (size_t)(slash - model_path) : 1;
  }
  if (len >= size) {
    if (size) buf[0] = 0;
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "model path %s: its tokenizer folder takes %zu bytes, more than the "
                            "%zu there is room for",
                            model_path, len + 1, size);
  }
  memcpy(buf, src, len);
  buf[len] = 0;
  return NULL;
}

static int32_t cap_for(int32_t dt) {
  return dt == KILN_HAL_BF16 ? KILN_HAL_CAP_BF16 : dt == KILN_HAL_F16 ? KILN_HAL_CAP_F16 : 0;
}

static int cmp_i32(const void *a, const void *b) {
  int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
  return (x > y) - (x < y);
}

/* The longest query per sequence a multi-token decode graph is kept for (speculation's
 * verification takes num_speculative_tokens + 1 <= 33). */
#define GRAPH_MAX_Q 64

/* The decode graph sizes: options.capture_sizes (or the default list) within what one forward
 * takes, ascending, without duplicates. Leaves m->graph_sizes NULL when none is left. */
static kiln_status_t graph_sizes_init(kiln_model_t *m, const kiln_model_options_t *o) {
  int32_t limit = m->opt.max_seqs;
  if (m->opt.max_tokens < limit) limit = m->opt.max_tokens;
  if (m->opt.max_logits < limit) limit = m->opt.max_logits;
  int32_t n = o->capture_sizes ? o->num_capture_sizes : 0;
  int32_t *v = malloc((size_t)(n > 0 ? n : 35) * sizeof(*v));
  if (!v) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory for the graph sizes");
  int32_t k = 0;
  if (n > 0) {
    for (int32_t i = 0; i < n; i++)
      if (o->capture_sizes[i] >= 1 && o->capture_sizes[i] <= limit)
        v[k++] = (int32_t)o->capture_sizes[i];
  } else {
    for (int32_t s = 1; s <= 256 && s <= limit; s = s < 8 ? 2 * s : s + 8) v[k++] = s;
  }
  qsort(v, (size_t)k, sizeof(*v), cmp_i32);
  int32_t u = 0;
  for (int32_t i = 0; i < k; i++)
    if (u == 0 || v[i] != v[u - 1]) v[u++] = v[i];
  if (u == 0) {
    free(v);
    kiln_log(KILN_LOG_INFO,
             "graphs: no capture size fits a forward of at most %d sequences: decode runs eagerly",
             limit);
    return NULL;
  }
  m->graph_sizes = v;
  m->num_graph_sizes = u;
  /* Query lengths above what one forward takes are never asked for: q <= max_tokens. */
  int32_t q = o->graph_max_query_len > 1 ? o->graph_max_query_len : 1;
  if (q > m->opt.max_tokens) q = m->opt.max_tokens;
  if (q > GRAPH_MAX_Q) q = GRAPH_MAX_Q;
  m->graph_max_q = q;
  m->num_graph_slots = q * u;
  m->gstats.max_query_len = q;
  m->gstats.active = true;
  m->gstats.num_sizes = u;
  m->gstats.max_size = v[u - 1];
  return NULL;
}

/* Tensor parallelism: checks the options and the config, keeps the checkpoint's config in
 * m->full and divides m->cfg's heads and intermediate size over the ranks. Errors name the
 * config values. */
static kiln_status_t tp_setup(kiln_model_t *m, const char *path) {
  const int32_t N = m->opt.tp_size;
  m->full = m->cfg;
  m->tp_size = 1;
  m->tp_rank = 0;
  m->tp_kv0 = 0;
  if (N == 0 || N == 1) return NULL;
  kiln_model_config_t *c = &m->cfg;
  if (N < 0 || N > KILN_HAL_COMM_MAX_RANKS)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "[parallel] tensor_parallel_size = %d: must be 1..%d", (int)N,
                            KILN_HAL_COMM_MAX_RANKS);
  if (m->opt.tp_rank < 0 || m->opt.tp_rank >= N)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "tensor parallelism: rank %d is not in 0..%d", (int)m->opt.tp_rank,
                            (int)N - 1);
  if (!m->opt.tp_comm || !KILN_HAL_HAS(m->be, all_reduce) || !m->be->all_reduce)
    return kiln_status_make(KILN_ERR_UNSUPPORTED,
                            "tensor_parallel_size = %d needs a communicator and a backend with "
                            "collectives (backend %s%s)",
                            (int)N, m->be->name, m->opt.tp_comm ? " has no all_reduce" : "");
  if (is_gguf(path))
    return kiln_status_make(KILN_ERR_UNSUPPORTED,
                            "tensor_parallel_size = %d: GGUF files are not sharded yet (%s); use a "
                            "safetensors checkpoint or tensor_parallel_size = 1",
                            (int)N, path);
  if (c->vision.present)
    return kiln_status_make(KILN_ERR_UNSUPPORTED,
                            "tensor_parallel_size = %d: %s has a vision tower, which is not "
                            "sharded yet; use tensor_parallel_size = 1",
                            (int)N, c->architecture);
  if (c->quant.method != KILN_QUANT_NONE)
    return kiln_status_make(KILN_ERR_UNSUPPORTED,
                            "tensor_parallel_size = %d: quantized weights (%s, or [model] "
                            "quantization = fp8) are not sharded yet; use a float checkpoint",
                            (int)N, path);
  if (c->num_heads % N)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "tensor_parallel_size = %d does not divide num_attention_heads = %lld "
                            "of %s",
                            (int)N, (long long)c->num_heads, path);
  if (c->num_kv_heads % N && N % c->num_kv_heads)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "tensor_parallel_size = %d and num_key_value_heads = %lld of %s: one "
                            "must divide the other (KV heads are split, or replicated when fewer)",
                            (int)N, (long long)c->num_kv_heads, path);
  if (c->intermediate_size % N)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "tensor_parallel_size = %d does not divide intermediate_size = %lld "
                            "of %s",
                            (int)N, (long long)c->intermediate_size, path);
  m->tp_size = N;
  m->tp_rank = m->opt.tp_rank;
  c->num_heads /= N;
  c->intermediate_size /= N;
  if (c->num_kv_heads >= N) {
    c->num_kv_heads /= N;
    m->tp_kv0 = m->tp_rank * c->num_kv_heads;
  } else { /* replicated: ranks r*K/N .. share KV head r / (N / K) */
    m->tp_kv0 = m->tp_rank / (N / m->full.num_kv_heads);
    c->num_kv_heads = 1;
  }
  if (m->opt.graphs && m->tp_rank == 0)
    kiln_log(KILN_LOG_INFO, "graphs: off under tensor parallelism (tensor_parallel_size = %d): "
                            "decode runs eagerly (docs/parallel.md)",
             (int)N);
  m->opt.graphs = false;
  return NULL;
}

kiln_status_t kiln_model_load(const char *path, const kiln_hal_backend_t *backend,
                              kiln_hal_device_t *device, kiln_hal_stream_t *stream,
                              const kiln_model_options_t *options, kiln_model_t **out_model) {
  *out_model = NULL;
  kiln_status_t st = NULL;
  kiln_weights_t *src = NULL;
  plan_t plan;
  memset(&plan, 0, sizeof(plan));
  float *table = NULL;
  kiln_model_t *m = calloc(1, sizeof(*m));
  if (!m) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  m->be = backend;
  m->dev = device;
  m->stream = stream;
  m->opt = *options;
  if (m->opt.max_tokens < 1 || m->opt.max_seqs < 1 || m->opt.max_blocks_per_seq < 1 ||
      m->opt.max_logits < 0) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "model options: max_tokens %d, max_seqs %d, max_blocks_per_seq %d and "
                          "max_logits %d must be positive",
                          m->opt.max_tokens, m->opt.max_seqs, m->opt.max_blocks_per_seq,
                          m->opt.max_logits);
    goto fail;
  }
  if (m->opt.max_logits == 0) m->opt.max_logits = m->opt.max_tokens;

  if (is_gguf(path)) {
    st = kiln_gguf_open(path, &m->cfg, &src);
  } else {
    st = kiln_model_config_load(path, &m->cfg);
    if (!st) st = kiln_weights_open_dir(path, &src);
  }
  if (st) goto fail;
  if (options->quantization == KILN_QUANT_FP8) { /* [model] quantization = fp8 */
    char qdesc[128];
    kiln_model_quant_describe(&m->cfg.quant, qdesc, sizeof(qdesc));
    if (m->cfg.quant.method != KILN_QUANT_NONE || is_gguf(path)) {
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "[model] quantization = fp8 quantizes a float (f32, f16, bf16) "
                            "safetensors checkpoint at load, but %s is already quantized (%s); "
                            "use quantization = none",
                            path, is_gguf(path) ? "GGUF" : qdesc);
      goto fail;
    }
    if (m->cfg.vision.present) {
      st = kiln_status_make(KILN_ERR_UNSUPPORTED,
                            "[model] quantization = fp8: vision-language models are not "
                            "supported yet (%s); use quantization = none",
                            path);
      goto fail;
    }
    m->cfg.quant.method = KILN_QUANT_FP8;
    m->cfg.quant.bits = 8;
    m->cfg.quant.sym = true;
    m->cfg.quant.fp8_scheme = KILN_FP8_ON_THE_FLY;
  }
  if (options->fp8_weights < KILN_FP8_WEIGHTS_AUTO || options->fp8_weights > KILN_FP8_WEIGHTS_WIDEN) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "model options: fp8_weights %d is not one of auto (0), keep (1) and "
                          "widen (2)",
                          (int)options->fp8_weights);
    goto fail;
  }
  if (options->fp8_activations != KILN_FP8_ACT_NONE &&
      options->fp8_activations != KILN_FP8_ACT_DYNAMIC) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "model options: fp8_activations %d is not one of none (0) and dynamic (1)",
                          (int)options->fp8_activations);
    goto fail;
  }
  if (options->kv_dtype != KILN_KV_DTYPE_AUTO && options->kv_dtype != KILN_KV_DTYPE_FP8_E4M3) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "model options: kv_dtype %d is not one of auto (0) and fp8_e4m3 (1)",
                          (int)options->kv_dtype);
    goto fail;
  }
  if (options->quantization != KILN_QUANT_FP8 && options->quantization != KILN_QUANT_NONE) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "model options: quantization %d is not one of none (0) and fp8 (%d)",
                          (int)options->quantization, (int)KILN_QUANT_FP8);
    goto fail;
  }
  if ((st = tp_setup(m, path))) goto fail;
  const kiln_model_config_t *c = &m->cfg;

  /* The serving dtype and whether the device computes in it. */
  m->dtype = options->dtype >= 0 ? options->dtype : c->dtype;
  if (m->dtype != KILN_HAL_F32 && m->dtype != KILN_HAL_F16 && m->dtype != KILN_HAL_BF16) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "model dtype %d is not a float dtype",
                          m->dtype);
    goto fail;
  }
  kiln_hal_device_info_t di;
  memset(&di, 0, sizeof(di));
  di.struct_size = sizeof(di);
  {
    kiln_hal_error_t *e = backend->device_info(options->device_index, &di);
    if (e) {
      st = kiln_hal_status_from_error(e, "device_info");
      goto fail;
    }
  }
  if (cap_for(m->dtype)) {
    if (!(di.caps & (uint64_t)cap_for(m->dtype))) {
      st = kiln_status_make(KILN_ERR_UNSUPPORTED,
                            "backend %s cannot compute in %s on %s: set [model] dtype = float32",
                            backend->name, kiln_hal_dtype_name(m->dtype), di.name);
      goto fail;
    }
  }
  m->es = kiln_hal_dtype_size(m->dtype);

  m->max_len = kiln_rope_max_positions(c);
  if (options->max_model_len > 0) {
    if (options->max_model_len > m->max_len) {
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "max_model_len %lld exceeds the model's context of %lld positions",
                            (long long)options->max_model_len, (long long)m->max_len);
      goto fail;
    }
    m->max_len = options->max_model_len;
  }

  /* Weights: plan, allocate once, upload. */
  m->layers = calloc((size_t)c->num_layers, sizeof(*m->layers));
  if (!m->layers) {
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
    goto fail;
  }
  plan.path = path;
  plan.src = src;
  plan.dtype = m->dtype;
  plan.es = m->es;
  /* Quantized GGUF weights stay quantized where the backend multiplies them (gemm_quant and
   * the format's capability); elsewhere they are widened to the serving dtype at load. */
  if (KILN_HAL_HAS(backend, gemm_quant) && backend->gemm_quant)
    plan.qcaps = di.caps & ~(uint64_t)0xffffffffu;
  plan.quant = &c->quant;
  const bool dyn = options->fp8_activations == KILN_FP8_ACT_DYNAMIC;
  if (dyn && options->fp8_weights == KILN_FP8_WEIGHTS_WIDEN) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "[model] fp8_activations = dynamic quantizes the activations of FP8 "
                          "Linears kept in FP8, but fp8_weights = widen dequantizes them at load");
    goto fail;
  }
  if (dyn && !(di.caps & KILN_HAL_CAP_FP8_XQUANT)) {
    st = kiln_status_make(KILN_ERR_UNSUPPORTED,
                          "[model] fp8_activations = dynamic: backend %s (%s) cannot quantize "
                          "activations to FP8 (no KILN_HAL_CAP_FP8_XQUANT)",
                          backend->name, di.name);
    goto fail;
  }
  m->fp8_xquant = dyn;
  /* The KV cache's storage ([cache] dtype). */
  m->kv_format = KILN_HAL_KV_FLOAT;
  m->kv_dtype = m->dtype;
  m->kv_es = m->es;
  if (options->kv_dtype == KILN_KV_DTYPE_FP8_E4M3) {
    if (!(di.caps & KILN_HAL_CAP_KV_FP8)) {
      st = kiln_status_make(KILN_ERR_UNSUPPORTED,
                            "[cache] dtype = fp8_e4m3: backend %s (%s) cannot hold an FP8 KV "
                            "cache (no KILN_HAL_CAP_KV_FP8); use dtype = auto",
                            backend->name, di.name);
      goto fail;
    }
    if (!(m->kv_scales = calloc((size_t)(2 * c->num_layers), sizeof(float)))) {
      st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
      goto fail;
    }
    for (int64_t i = 0; i < 2 * c->num_layers; i++) m->kv_scales[i] = 1.0f; /* model_plan reads */
    m->kv_format = KILN_HAL_KV_FP8_E4M3;
    m->kv_dtype = KILN_HAL_U8;
    m->kv_es = 1;
  }
  if (options->fp8_weights == KILN_FP8_WEIGHTS_WIDEN)
    plan.fp8_widen_why = "[model] fp8_weights = widen";
  else if (options->fp8_weights == KILN_FP8_WEIGHTS_AUTO && !dyn &&
           !(di.caps & KILN_HAL_CAP_HOST_MEMORY))
    plan.fp8_widen_why = "[model] fp8_weights = auto widens FP8 on GPUs: their gemm_quant has no "
                         "tensor-core FP8 path yet; keep stores it in FP8";
  if ((st = model_plan(m, &plan))) goto fail;
  m->weight_bytes = plan.size;
  if (m->kv_format == KILN_HAL_KV_FP8_E4M3) {
    if (c->quant.kv_cache_scheme == 2) {
      st = kiln_status_make(KILN_ERR_UNSUPPORTED,
                            "%s: quantization_config.kv_cache_scheme is not FP8 (\"type\": "
                            "\"float\", \"num_bits\": 8): its k_scale / v_scale are not e4m3 "
                            "scales; use [cache] dtype = auto",
                            path);
      goto fail;
    }
    if (c->quant.kv_cache_scheme == 1 && m->kv_scales_found == 0) {
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: quantization_config.kv_cache_scheme names FP8 KV-cache scales "
                            "but the checkpoint has no self_attn.k_scale / v_scale tensors",
                            path);
      goto fail;
    }
    if (m->kv_scales_found != 0 && m->kv_scales_found != 2 * c->num_layers) {
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: %lld of the %lld FP8 KV-cache scales (self_attn.k_scale, "
                            "v_scale) are in the checkpoint: every layer needs both or none",
                            path, (long long)m->kv_scales_found, (long long)(2 * c->num_layers));
      goto fail;
    }
    kiln_log(KILN_LOG_INFO, "KV cache: fp8_e4m3 (e4m3fn codes, per-layer k/v scales: %s)",
             kiln_model_kv_scales_source(m));
  } else if (c->quant.kv_cache_scheme == 1) {
    kiln_log(KILN_LOG_INFO, "%s has calibrated FP8 KV-cache scales (kv_cache_scheme): [cache] "
                            "dtype = fp8_e4m3 would use them",
             path);
  }
  if (c->quant.method != KILN_QUANT_NONE) {
    char qdesc[128];
    kiln_model_quant_describe(&c->quant, qdesc, sizeof(qdesc));
    const int32_t qf = c->quant.method == KILN_QUANT_FP8 ? KILN_HAL_QFMT_FP8_E4M3
                       : c->quant.bits == 4              ? KILN_HAL_QFMT_INT4_G
                                                         : KILN_HAL_QFMT_INT8_G;
    if (plan.q_kept)
      kiln_log(KILN_LOG_INFO, "quantization %s: %lld Linear weights kept quantized (%s)", qdesc,
               (long long)plan.q_kept, kiln_hal_qfmt_name(qf));
    if (plan.q_widened)
      kiln_log(KILN_LOG_INFO, "quantization %s: %lld Linear weights dequantized to %s at load (%s)",
               qdesc, (long long)plan.q_widened, kiln_hal_dtype_name(m->dtype), plan.q_widen_why);
    char kept[64] = "", widened[64] = "";
    if (plan.q_kept)
      snprintf(kept, sizeof(kept), "; %lld Linears kept in %s", (long long)plan.q_kept,
               kiln_hal_qfmt_name(qf));
    if (plan.q_widened)
      snprintf(widened, sizeof(widened), "; %lld dequantized to %s at load",
               (long long)plan.q_widened, kiln_hal_dtype_name(m->dtype));
    const bool xq = m->fp8_xquant && plan.q_kept && qf == KILN_HAL_QFMT_FP8_E4M3;
    char *act = xq ? strrchr(qdesc, ',') : NULL; /* the describe's activation clause */
    if (act) *act = 0;
    snprintf(m->quant_desc, sizeof(m->quant_desc), "%s%s%s%s", qdesc,
             xq ? ", activations FP8 per token (dynamic, W8A8)" : "", kept, widened);
  } else if (is_gguf(path)) {
    gguf_quant_describe(m, src);
  }
  if ((st = alloc_buf(m, plan.size, 0, "the weights", &m->weights))) goto fail;
  if ((st = model_upload(m, &plan))) goto fail;

  /* The rope table. */
  const int64_t R = c->rope.rotary_dim;
  table = malloc((size_t)(m->max_len * R) * sizeof(float));
  if (!table) {
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory for the rope table");
    goto fail;
  }
  if ((st = kiln_rope_build_table(&c->rope, c->max_position_embeddings, m->max_len, table)))
    goto fail;
  uint64_t rope_bytes = (uint64_t)(m->max_len * R) * sizeof(float);
  if ((st = alloc_buf(m, rope_bytes, 0, "the rope table", &m->rope))) goto fail;
  if ((st = hal_st(backend->copy_h2d(stream, m->rope, 0, table, rope_bytes), "rope table")) ||
      (st = hal_st(backend->stream_sync(stream), "rope table")))
    goto fail;
  if (c->mrope) {
    /* M-RoPE rows take their cos/sin from the same table, one frequency band per axis. */
    m->rope_host = table;
    table = NULL;
    const uint64_t mt = (uint64_t)m->opt.max_tokens * (uint64_t)R * sizeof(float);
    m->mrope_host = malloc(mt + (uint64_t)m->opt.max_tokens * 2 * sizeof(int32_t));
    if (!m->mrope_host) {
      st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory for the M-RoPE staging");
      goto fail;
    }
    if ((st = alloc_buf(m, mt, 0, "the M-RoPE table", &m->mrope_tab))) goto fail;
  }

  /* Activations. */
  const int64_t TM = m->opt.max_tokens, H = c->hidden_size, I = c->intermediate_size;
  const int64_t QD = c->num_heads * c->head_dim, KD = c->num_kv_heads * c->head_dim;
  const size_t es = m->es;
  uint64_t off = 0;
#define CARVE(field, elems)                     \
  do {                                          \
    m->field = off;                             \
    off = align_up(off + (uint64_t)(elems)*es); \
  } while (0)
  CARVE(x, TM * H);
  CARVE(resid, TM * H);
  CARVE(h, TM * H);
  CARVE(qkv, TM * (QD + 2 * KD));
  CARVE(attn, TM * QD);
  CARVE(gu, TM * 2 * I);
  CARVE(mlp, TM * I);
  CARVE(gather, (int64_t)m->opt.max_logits * H);
#undef CARVE
  if ((st = alloc_buf(m, off, 0, "activations", &m->act)) ||
      (st = alloc_buf(m, (uint64_t)m->opt.max_logits * (uint64_t)c->vocab_size * 4, 0, "logits",
                      &m->logits)))
    goto fail;

  /* Batch metadata. */
  const int64_t SM = m->opt.max_seqs;
  int64_t mo = 0;
  m->m_ids = mo, mo += TM;
  m->m_pos = mo, mo += TM;
  m->m_slots = mo, mo += TM;
  m->m_seq_lens = mo, mo += SM;
  m->m_qsl = mo, mo += SM + 1;
  m->m_rows = mo, mo += m->opt.max_logits;
  m->m_pos2 = mo, mo += TM;
  m->m_bt = mo, mo += SM * m->opt.max_blocks_per_seq;
  m->meta_count = mo;
  if ((st = alloc_buf(m, (uint64_t)mo * 4, 0, "batch metadata", &m->meta))) goto fail;
  if (!backend->buffer_alloc(device, (uint64_t)mo * 4, KILN_HAL_BUFFER_HOST_PINNED,
                             &m->meta_pinned) &&
      backend->buffer_host_ptr)
    m->meta_host = backend->buffer_host_ptr(m->meta_pinned);
  if (!m->meta_host) {
    m->meta_host = malloc((size_t)mo * 4);
    m->meta_host_owned = true;
    if (!m->meta_host) {
      st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
      goto fail;
    }
  }
  /* A graph uploads whole block-table rows, whose unused tails are whatever the staging held:
   * zeros, never uninitialised bytes. */
  memset(m->meta_host, 0, (size_t)mo * 4);

  if (m->opt.graphs) {
    bool members = KILN_HAL_HAS(backend, graph_destroy) && backend->graph_begin &&
                   backend->graph_end && backend->graph_replay && backend->graph_destroy;
    if (!(di.caps & KILN_HAL_CAP_GRAPHS) || !members)
      kiln_log(KILN_LOG_INFO, "graphs: backend %s has no graphs on %s: decode runs eagerly",
               backend->name, di.name);
    else if ((st = graph_sizes_init(m, options)))
      goto fail;
  }
  kiln_log(KILN_LOG_INFO,
           "model %s (%s): %lld layers, hidden %lld, %lld heads / %lld KV, head dim "
           "%lld, vocab %lld, %s, %.1f MiB of weights",
           path, c->architecture, (long long)c->num_layers, (long long)H, (long long)c->num_heads,
           (long long)c->num_kv_heads, (long long)c->head_dim, (long long)c->vocab_size,
           kiln_hal_dtype_name(m->dtype), (double)m->weight_bytes / (1 << 20));
  kiln_model_plan_free(&plan);
  free(table);
  kiln_weights_free(src);
  *out_model = m;
  return NULL;

fail:
  kiln_model_plan_free(&plan);
  free(table);
  kiln_weights_free(src);
  kiln_model_free(m);
  return st;
}

void kiln_model_free(kiln_model_t *m) {
  if (!m) return;
  if (m->in_flight) {
    kiln_hal_error_t *e = m->be->stream_sync(m->stream);
    if (e) e->destroy(e);
  }
  if (m->weights) m->be->buffer_free(m->weights);
  if (m->rope) m->be->buffer_free(m->rope);
  if (m->act) m->be->buffer_free(m->act);
  if (m->logits) m->be->buffer_free(m->logits);
  if (m->meta) m->be->buffer_free(m->meta);
  if (m->meta_pinned) m->be->buffer_free(m->meta_pinned);
  if (m->meta_host_owned) free(m->meta_host);
  if (m->mrope_tab) m->be->buffer_free(m->mrope_tab);
  free(m->rope_host);
  free(m->mrope_host);
  vision_free(m);
  free(m->graph_sizes);
  free(m->layers);
  free(m->kv_scales);
  free(m);
}

const kiln_model_config_t *kiln_model_get_config(const kiln_model_t *m) { return &m->cfg; }
int32_t kiln_model_dtype(const kiln_model_t *m) { return m->dtype; }
int64_t kiln_model_max_len(const kiln_model_t *m) { return m->max_len; }
bool kiln_model_has_mrope(const kiln_model_t *m) { return m->cfg.mrope; }
bool kiln_model_has_vision(const kiln_model_t *m) { return m->vis != NULL; }
uint64_t kiln_model_weight_bytes(const kiln_model_t *m) { return m->weight_bytes; }
const char *kiln_model_kv_dtype_name(const kiln_model_t *m) {
  return m->kv_format == KILN_HAL_KV_FP8_E4M3 ? "fp8_e4m3" : kiln_hal_dtype_name(m->dtype);
}
const char *kiln_model_quantization(const kiln_model_t *m) {
  return m->quant_desc[0] ? m->quant_desc : "none";
}

const char *kiln_model_kv_scales_source(const kiln_model_t *m) {
  if (m->kv_format != KILN_HAL_KV_FP8_E4M3) return NULL;
  return m->kv_scales_found ? "the checkpoint's k_scale / v_scale"
                            : "1.0 (the checkpoint has no k_scale / v_scale)";
}

/* ---- KV cache ------------------------------------------------------------------------- */

uint64_t kiln_model_kv_block_bytes(const kiln_model_t *m, int32_t block_size) {
  return (uint64_t)m->cfg.num_layers * 2 * (uint64_t)m->cfg.num_kv_heads * (uint64_t)block_size *
         (uint64_t)m->cfg.head_dim * m->kv_es;
}

kiln_status_t kiln_model_kv_create(kiln_model_t *m, int32_t num_blocks, int32_t block_size,
                                   kiln_kv_cache_t **out_kv) {
  *out_kv = NULL;
  if (num_blocks < 1 || block_size < 1 || block_size > 1024)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "KV cache: %d blocks of %d tokens (want >= 1 block of 1..1024 tokens)",
                            num_blocks, block_size);
  if (m->graph_sizes && num_blocks == INT32_MAX)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "KV cache: %d blocks leave no id for the graphs' scratch block",
                            num_blocks);
  kiln_kv_cache_t *kv = calloc(1, sizeof(*kv));
  if (!kv) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  kv->m = m;
  kv->num_blocks = num_blocks;
  kv->block_size = block_size;
  kv->pool_blocks = num_blocks + (m->graph_sizes ? 1 : 0);
  kiln_status_t st = NULL;
  if (m->graph_sizes && !(kv->graphs = calloc((size_t)m->num_graph_slots, sizeof(*kv->graphs)))) {
    free(kv);
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory for the KV cache's graphs");
  }
  kv->cache_bytes = align_up((uint64_t)kv->pool_blocks * (uint64_t)m->cfg.num_kv_heads *
                             (uint64_t)block_size * (uint64_t)m->cfg.head_dim * m->kv_es);
  const uint64_t bytes = kv->cache_bytes * 2 * (uint64_t)m->cfg.num_layers;
  st = alloc_buf(m, bytes, 0, "the KV cache", &kv->buf);
  /* Zeroed, so that a slot no forward has written reads as a zero key and value: a misused
   * block table gives a wrong answer the tests can see, never uninitialised memory (and the
   * pool's pages are committed now, not in the middle of serving). */
  if (!st) st = hal_st(m->be->fill(m->stream, kv->buf, 0, bytes, 0), "zeroing the KV cache");
  if (!st) st = hal_st(m->be->stream_sync(m->stream), "zeroing the KV cache");
  if (st) {
    if (kv->buf) m->be->buffer_free(kv->buf);
    free(kv->graphs);
    free(kv);
    return st;
  }
  *out_kv = kv;
  return NULL;
}

void kiln_kv_cache_free(kiln_kv_cache_t *kv) {
  if (!kv) return;
  kiln_model_t *m = kv->m;
  /* A replay may still be running on the stream: let it finish before its graph and buffers
   * go. */
  if (m->in_flight) {
    kiln_hal_error_t *e = m->be->stream_sync(m->stream);
    if (e) e->destroy(e);
  }
  for (int32_t i = 0; kv->graphs && i < m->num_graph_slots; i++)
    if (kv->graphs[i]) m->be->graph_destroy(kv->graphs[i]);
  free(kv->graphs);
  m->be->buffer_free(kv->buf);
  free(kv);
}

int32_t kiln_kv_cache_num_blocks(const kiln_kv_cache_t *kv) { return kv->num_blocks; }
int32_t kiln_kv_cache_block_size(const kiln_kv_cache_t *kv) { return kv->block_size; }

kiln_status_t kiln_kv_cache_copy_blocks(kiln_kv_cache_t *kv, const int32_t *src, const int32_t *dst,
                                        int32_t n) {
  const kiln_model_t *m = kv->m;
  uint64_t block =
      (uint64_t)m->cfg.num_kv_heads * (uint64_t)kv->block_size * (uint64_t)m->cfg.head_dim * m->kv_es;
  for (int32_t i = 0; i < n; i++) {
    if (src[i] < 0 || src[i] >= kv->num_blocks || dst[i] < 0 || dst[i] >= kv->num_blocks)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "KV copy %d -> %d: block ids must be in [0, %d)", src[i], dst[i],
                              kv->num_blocks);
    for (int64_t l = 0; l < 2 * m->cfg.num_layers; l++) {
      uint64_t base = (uint64_t)l * kv->cache_bytes;
      kiln_hal_error_t *e = m->be->copy_d2d(m->stream, kv->buf, base + (uint64_t)dst[i] * block,
                                            kv->buf, base + (uint64_t)src[i] * block, block);
      if (e) return kiln_hal_status_from_error(e, "KV block copy");
    }
  }
  return NULL;
}

/* ---- forward ---------------------------------------------------------------------------- */

#define BAD(...) kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "batch: " __VA_ARGS__)

/* Everything the device will trust, checked on the host: the ops never read or write out of
 * bounds, and a batch whose pieces disagree (a position that is not where the sequence's
 * length puts it, a slot outside its block table) is refused instead of computing garbage. */
static kiln_status_t model_check_batch(const kiln_model_t *m, const kiln_kv_cache_t *kv,
                                       const kiln_batch_t *b, int32_t *out_mq, int32_t *out_ms) {
  const int64_t T = b->num_tokens, S = b->num_seqs, MB = b->max_blocks_per_seq;
  const int64_t NB = kv->num_blocks, BS = kv->block_size, V = m->cfg.vocab_size;
  if (kv->m != m) return BAD("the KV cache belongs to another model");
  if (T < 1 || T > m->opt.max_tokens)
    return BAD("%lld tokens, want 1..%d (max_tokens)", (long long)T, m->opt.max_tokens);
  if (S < 1 || S > m->opt.max_seqs || S > T)
    return BAD("%lld sequences, want 1..min(%d, tokens)", (long long)S, m->opt.max_seqs);
  if (MB < 1 || MB > m->opt.max_blocks_per_seq)
    return BAD("block tables %lld wide, want 1..%d", (long long)MB, m->opt.max_blocks_per_seq);
  if (b->num_logits < 0 || b->num_logits > m->opt.max_logits)
    return BAD("%d logits rows, want 0..%d", b->num_logits, m->opt.max_logits);
  if (b->query_start_loc[0] != 0 || b->query_start_loc[S] != T)
    return BAD("query_start_loc must run from 0 to %lld tokens", (long long)T);
  int32_t mq = 0, ms = 0;
  for (int64_t s = 0; s < S; s++) {
    int64_t q0 = b->query_start_loc[s], q1 = b->query_start_loc[s + 1];
    int64_t len = b->seq_lens[s], ql = q1 - q0;
    if (ql < 1 || q1 > T)
      return BAD("sequence %lld owns rows [%lld, %lld): want at least one, within %lld tokens",
                 (long long)s, (long long)q0, (long long)q1, (long long)T);
    if (len < ql || len > m->max_len || len > MB * BS)
      return BAD(
          "sequence %lld: seq_len %lld must cover its %lld new tokens and fit the context "
          "(%lld) and its block table (%lld x %lld)",
          (long long)s, (long long)len, (long long)ql, (long long)m->max_len, (long long)MB,
          (long long)BS);
    const int32_t *bt = b->block_tables + s * MB;
    for (int64_t j = 0; j < (len + BS - 1) / BS; j++)
      if (bt[j] < 0 || bt[j] >= NB)
        return BAD("sequence %lld: block table entry %lld is %d, want 0..%lld", (long long)s,
                   (long long)j, bt[j], (long long)NB - 1);
    for (int64_t t = q0; t < q1; t++) {
      int64_t pos = len - ql + (t - q0);
      if (b->positions[t] != pos)
        return BAD(
            "token %lld (sequence %lld) has position %d; its sequence length puts it at %lld",
            (long long)t, (long long)s, b->positions[t], (long long)pos);
      if (b->token_ids[t] < 0 || b->token_ids[t] >= V)
        return BAD("token %lld is id %d, outside the vocabulary (%lld)", (long long)t,
                   b->token_ids[t], (long long)V);
      int32_t slot = b->slot_mapping[t];
      if (slot >= 0 && slot != bt[pos / BS] * BS + pos % BS)
        return BAD("token %lld (position %lld) maps to slot %d, not to its block table's %lld",
                   (long long)t, (long long)pos, slot, (long long)(bt[pos / BS] * BS + pos % BS));
    }
    if (ql > mq) mq = (int32_t)ql;
    if (len > ms) ms = (int32_t)len;
  }
  for (int32_t i = 0; i < b->num_logits; i++)
    if (b->logits_rows[i] < 0 || b->logits_rows[i] >= T)
      return BAD("logits row %d is %d, want 0..%lld", i, b->logits_rows[i], (long long)T - 1);
  if (b->mrope_positions) {
    if (!m->cfg.mrope)
      return BAD("M-RoPE positions given, but model %s has no M-RoPE", m->cfg.architecture);
    static const char axis[3] = {'t', 'h', 'w'};
    for (int64_t i = 0; i < 3 * T; i++) {
      const int32_t v = b->mrope_positions[i];
      if (v < 0 || v >= m->max_len)
        return BAD("token %lld has M-RoPE %c position %d, want 0..%lld", (long long)(i % T),
                   axis[i / T], v, (long long)m->max_len - 1);
    }
  }
  if (b->num_embeds < 0 || b->num_embeds > T || (b->num_embeds > 0 && !b->embeds))
    return BAD("%d embedding runs for %lld tokens", b->num_embeds, (long long)T);
  int64_t end = 0;
  for (int32_t i = 0; i < b->num_embeds; i++) {
    const kiln_batch_embed_t *e = &b->embeds[i];
    const kiln_hal_tensor_t *t = &e->src;
    if (e->count < 1 || e->row < end || e->row > T - e->count)
      return BAD(
          "embedding run %d covers rows [%d, %lld): want runs of >= 1 row, ascending, not "
          "overlapping, within %lld tokens",
          i, e->row, (long long)e->row + e->count, (long long)T);
    end = (int64_t)e->row + e->count;
    if (!t->buffer || t->ndim != 2 || t->shape[1] != m->cfg.hidden_size || t->stride[1] != 1 ||
        t->stride[0] < t->shape[1] ||
        (t->dtype != KILN_HAL_F32 && t->dtype != KILN_HAL_F16 && t->dtype != KILN_HAL_BF16))
      return BAD("embedding run %d: the source must be a float [N, %lld] row-major tensor", i,
                 (long long)m->cfg.hidden_size);
    if (e->first < 0 || e->first > t->shape[0] - e->count)
      return BAD("embedding run %d reads source rows [%d, %lld) of %lld", i, e->first,
                 (long long)e->first + e->count, (long long)t->shape[0]);
  }
  *out_mq = mq;
  *out_ms = ms;
  return NULL;
}

/* ---- decode graphs ------------------------------------------------------------------------
 *
 * A decode batch (every sequence has one new token, so T == S) of S <= the largest capture
 * size runs as the graph of the smallest capture size P >= S, captured once per KV cache:
 *
 *   rows 0..S-1    the batch as given
 *   rows S..P-1    padding: token 0 at position 0, slot -1 (kv_write skips it), seq_len 1,
 *                  a block table whose first entry is the KV cache's scratch block (id
 *                  num_blocks, never written, so zero): each attends to one zero key, so every
 *                  value it computes is finite and depends on nothing else in the batch
 *   block tables   rows of the model's fixed width (opt.max_blocks_per_seq: the whole context);
 *                  entries past a sequence's last block are never read and are left as they are
 *   logits         always gathered through m_rows, P rows: the batch's R rows first, then row 0
 *                  again; the caller reads the first R (kiln_model_logits), as after an eager
 *                  forward
 *   attention      max_query_len 1, max_seq_len = the model's max length: valid for any batch
 *
 * Multi-token decode (opt.graph_max_query_len = Q > 1): a batch whose S sequences each have
 * the same q <= Q new tokens, sequence s owning rows q*s..q*s+q-1 (speculative decoding's
 * verification of q - 1 proposals, a draft model's catch-up), runs as the graph of (q, P):
 * P*q token rows, a padding sequence has q rows at position 0 and seq_len q (its first
 * ceil(q / block_size) table entries the scratch block), query_start_loc is s*q, attention
 * takes max_query_len q (causal within each sequence's rows, as eagerly), and the graph gathers
 * min(P*q, max_logits) logits rows, so it serves batches asking for at most that many. The
 * attention kernels pick their shape from max_query_len at capture, so every q has graphs of
 * its own (one slot per q and capture size).
 *
 * Every tensor the graph names lives at a fixed address for the KV cache's life: the weights,
 * the rope table, the activations, the logits and the metadata buffer (the model's), the KV
 * buffer (the cache's). A replay is: stage the padded metadata on the host, one copy_h2d into
 * m->meta, graph_replay. Capture (graph_begin, llama_forward, graph_end) issues no copy, no
 * synchronisation and no allocation. When the backend refuses a capture (an error from
 * graph_begin, from an op while recording, or from graph_end), graphs are off for the model
 * from then on, with one warning, and the batch runs eagerly. */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* A graph slot's query length, padded sequences and gathered logits rows. */
static int32_t slot_q(const kiln_model_t *m, int32_t slot) { return slot / m->num_graph_sizes + 1; }
static int32_t slot_p(const kiln_model_t *m, int32_t slot) {
  return m->graph_sizes[slot % m->num_graph_sizes];
}
static int32_t slot_rows(const kiln_model_t *m, int32_t slot) {
  const int32_t q = slot_q(m, slot), P = slot_p(m, slot);
  if (q == 1) return P;
  const int64_t r = (int64_t)q * P;
  return r < m->opt.max_logits ? (int32_t)r : m->opt.max_logits;
}
/* Whether slot can exist: its token rows fit one forward, and a multi-token slot's size is at
 * most the smallest capture size holding graph_query_max_seqs sequences. */
static bool slot_valid(const kiln_model_t *m, int32_t slot) {
  const int32_t q = slot_q(m, slot), i = slot % m->num_graph_sizes;
  if ((int64_t)q * slot_p(m, slot) > m->opt.max_tokens) return false;
  const int32_t lim =
      m->opt.graph_query_max_seqs > 0 ? m->opt.graph_query_max_seqs : m->opt.max_seqs;
  return q == 1 || i == 0 || m->graph_sizes[i - 1] < lim;
}

/* The graph slot for a batch that passed model_check_batch, or -1: run it eagerly. The graph
 * has a row for every sequence and every logits row (a row may be asked for twice). */
static int32_t graph_slot(const kiln_model_t *m, const kiln_kv_cache_t *kv, const kiln_batch_t *b,
                          int32_t max_query_len, int32_t mrope_rows) {
  if (!kv->graphs || m->graphs_failed || max_query_len < 1 || max_query_len > m->graph_max_q ||
      (int64_t)b->num_tokens != (int64_t)max_query_len * b->num_seqs || mrope_rows > 0 ||
      b->num_embeds > 0)
    return -1;
  const int32_t q = max_query_len, S = b->num_seqs;
  if (q > 1)
    for (int32_t s = 0; s <= S; s++)
      if (b->query_start_loc[s] != q * s) return -1;
  for (int32_t i = 0; i < m->num_graph_sizes; i++) {
    const int32_t slot = (q - 1) * m->num_graph_sizes + i;
    if (m->graph_sizes[i] >= S && slot_rows(m, slot) >= b->num_logits &&
        (q > 1 || m->graph_sizes[i] >= b->num_logits))
      return slot_valid(m, slot) ? slot : -1;
  }
  return -1;
}

/* The pass the graph of a slot records. */
static model_pass_t graph_pass(const kiln_model_t *m, int32_t slot) {
  const int32_t q = slot_q(m, slot), P = slot_p(m, slot);
  model_pass_t p = {.num_tokens = q * P,
                    .num_seqs = P,
                    .num_logits = slot_rows(m, slot),
                    .bt_width = m->opt.max_blocks_per_seq,
                    .max_query_len = q,
                    .max_seq_len = m->max_len < INT32_MAX ? (int32_t)m->max_len : INT32_MAX,
                    .gather = true};
  return p;
}

/* Records the graph of a slot for kv. On failure nothing is kept and the stream is out of
 * capture mode again. */
static kiln_status_t graph_capture(kiln_model_t *m, kiln_kv_cache_t *kv, int32_t slot) {
  const int32_t P = slot_p(m, slot), q = slot_q(m, slot);
  kiln_status_t st = hal_st(m->be->graph_begin(m->stream), "graph_begin");
  if (st)
    return kiln_status_annotate(st, "capturing the decode graph of %d rows (query length %d)", P,
                                q);
  model_pass_t p = graph_pass(m, slot);
  st = llama_forward(m, kv, &p);
  kiln_hal_graph_t *g = NULL;
  kiln_hal_error_t *e = m->be->graph_end(m->stream, &g); /* always: it ends the capture */
  if (e && !st)
    st = hal_st(e, "graph_end");
  else if (e)
    e->destroy(e);
  if (!st && !g)
    st =
        kiln_status_make(KILN_ERR_INTERNAL, "graph_end: backend %s returned no graph", m->be->name);
  if (st) {
    if (g) m->be->graph_destroy(g);
    return kiln_status_annotate(st, "capturing the decode graph of %d rows (query length %d)", P,
                                q);
  }
  kv->graphs[slot] = g;
  m->gstats.captures++;
  return NULL;
}

/* A refused capture: eager from now on, said once. */
static void graphs_give_up(kiln_model_t *m, kiln_status_t st) {
  if (!m->graphs_failed)
    kiln_log(KILN_LOG_WARN, "graphs: %s; decode runs eagerly from now on (backend %s)",
             kiln_status_message(st), m->be->name);
  m->graphs_failed = true;
  m->gstats.failed = true;
  m->gstats.active = false;
  kiln_status_free(st);
}

/* Stages batch b padded to the slot's P sequences of q rows in m->meta_host; returns the bytes
 * to upload. */
static uint64_t graph_stage(kiln_model_t *m, const kiln_kv_cache_t *kv, const kiln_batch_t *b,
                            const int32_t *rope_pos, int32_t slot) {
  const int32_t S = b->num_seqs, R = b->num_logits, W = m->opt.max_blocks_per_seq;
  const int32_t MB = b->max_blocks_per_seq, q = slot_q(m, slot), P = slot_p(m, slot);
  const int32_t T = b->num_tokens, RG = slot_rows(m, slot);
  int32_t *h = m->meta_host;
  int32_t *ids = h + m->m_ids, *pos = h + m->m_pos, *slots = h + m->m_slots;
  int32_t *lens = h + m->m_seq_lens, *qsl = h + m->m_qsl, *rows = h + m->m_rows, *bt = h + m->m_bt;
  memcpy(ids, b->token_ids, (size_t)T * 4);
  memcpy(pos, rope_pos, (size_t)T * 4);
  memcpy(slots, b->slot_mapping, (size_t)T * 4);
  memcpy(lens, b->seq_lens, (size_t)S * 4);
  if (R) memcpy(rows, b->logits_rows, (size_t)R * 4);
  for (int32_t r = R; r < RG; r++) rows[r] = 0;
  for (int32_t s = 0; s <= P; s++) qsl[s] = q * s;
  if (MB == W) {
    memcpy(bt, b->block_tables, (size_t)S * (size_t)W * 4);
  } else {
    for (int32_t s = 0; s < S; s++)
      memcpy(bt + (size_t)s * W, b->block_tables + (size_t)s * MB, (size_t)MB * 4);
  }
  const int32_t pad_blocks = (q + kv->block_size - 1) / kv->block_size;
  for (int32_t t = T; t < q * P; t++) {
    ids[t] = 0;
    pos[t] = 0;
    slots[t] = -1;
  }
  for (int32_t s = S; s < P; s++) {
    lens[s] = q;
    for (int32_t j = 0; j < pad_blocks && j < W; j++)
      bt[(size_t)s * W + j] = kv->num_blocks; /* the scratch block */
  }
  return (uint64_t)(m->m_bt + (int64_t)P * W) * 4;
}

/* Runs a checked decode batch through a graph slot. *out_eager is set when the capture was
 * refused and the batch must run eagerly instead (nothing was enqueued then). */
static kiln_status_t forward_graph(kiln_model_t *m, kiln_kv_cache_t *kv, const kiln_batch_t *b,
                                   const int32_t *rope_pos, int32_t slot, bool *out_eager) {
  *out_eager = false;
  if (!kv->graphs[slot]) {
    kiln_status_t cst = graph_capture(m, kv, slot);
    if (cst) {
      graphs_give_up(m, cst);
      *out_eager = true;
      return NULL;
    }
  }
  const int32_t P = slot_p(m, slot);
  uint64_t bytes = graph_stage(m, kv, b, rope_pos, slot);
  kiln_status_t st =
      hal_st(m->be->copy_h2d(m->stream, m->meta, 0, m->meta_host, bytes), "batch metadata");
  if (st) return st;
  m->in_flight = true;
  if ((st = hal_st(m->be->graph_replay(kv->graphs[slot], m->stream), "graph_replay")))
    return kiln_status_annotate(st, "decode graph of %d rows, query length %d (batch of %d)", P,
                                slot_q(m, slot), b->num_seqs);
  m->gstats.replays++;
  if (slot_q(m, slot) > 1) m->gstats.multi_replays++;
  m->gstats.padded_rows += P - b->num_seqs;
  return NULL;
}

/* Ahead of time: the decode graphs (query length 1) of every size, then, size by size, those of
 * the longer queries. */
int32_t kiln_model_graphs_capture(kiln_model_t *m, kiln_kv_cache_t *kv, double budget_s) {
  if (!kv->graphs || m->graphs_failed) return 0;
  const double t0 = now_s();
  int32_t have = 0, fresh = 0, valid = 0;
  const int32_t n = m->num_graph_sizes;
  for (int32_t k = 0; k < m->num_graph_slots; k++) {
    /* k < n: query length 1, size k; then j = k - n walks size j / (Q - 1), query length
     * j % (Q - 1) + 2. */
    const int32_t j = k - n, Q1 = m->graph_max_q - 1;
    const int32_t slot = k < n ? k : (j % Q1 + 1) * n + j / Q1;
    if (!slot_valid(m, slot)) continue;
    valid++;
    if (!kv->graphs[slot] && !m->graphs_failed && now_s() - t0 < budget_s) {
      kiln_status_t st = graph_capture(m, kv, slot);
      if (st)
        graphs_give_up(m, st);
      else
        fresh++;
    }
    have += kv->graphs[slot] != NULL;
  }
  if (fresh)
    kiln_log(KILN_LOG_INFO,
             "graphs: captured %d decode graphs (%d of %d: sizes 1..%d rows, query lengths 1..%d) "
             "in %.3f s",
             fresh, have, valid, m->graph_sizes[n - 1], m->graph_max_q, now_s() - t0);
  return have;
}

void kiln_model_graph_stats(const kiln_model_t *m, kiln_model_graph_stats_t *out) {
  *out = m->gstats;
}

/* The rotary positions of a batch with M-RoPE positions, staged after the model's M-RoPE
 * table: [2T] int32, the first T the rows' positions in the normal rope table (-1 for a row
 * whose t, h and w differ), the next T those rows' indices into m->mrope_tab (-1 for the
 * others); their cos/sin rows are written to m->mrope_host. A row whose three positions are
 * equal (every text token) is an ordinary rope row at that position: the sections then all
 * read the same table row. */
static const int32_t *mrope_stage(kiln_model_t *m, const kiln_batch_t *b, int32_t *out_rows) {
  const int64_t T = b->num_tokens, R = m->cfg.rope.rotary_dim, half = R / 2;
  const int32_t *pt = b->mrope_positions, *ph = pt + T, *pw = ph + T;
  float *tab = m->mrope_host;
  int32_t *pos = (int32_t *)(tab + (size_t)m->opt.max_tokens * (size_t)R), *pos2 = pos + T;
  const int32_t s0 = m->cfg.mrope_section[0], s1 = s0 + m->cfg.mrope_section[1];
  int32_t k = 0;
  for (int64_t t = 0; t < T; t++) {
    if (pt[t] == ph[t] && ph[t] == pw[t]) {
      pos[t] = pt[t];
      pos2[t] = -1;
      continue;
    }
    pos[t] = -1;
    pos2[t] = k;
    float *row = tab + (size_t)k * (size_t)R;
    for (int64_t i = 0; i < half; i++) {
      const int32_t p = i < s0 ? pt[t] : i < s1 ? ph[t] : pw[t];
      const float *src = m->rope_host + (size_t)p * (size_t)R;
      row[i] = src[i];
      row[half + i] = src[half + i];
    }
    k++;
  }
  *out_rows = k;
  return pos;
}

kiln_status_t kiln_model_forward(kiln_model_t *m, kiln_kv_cache_t *kv, const kiln_batch_t *b) {
  int32_t mq = 0, ms = 0;
  kiln_status_t st = model_check_batch(m, kv, b, &mq, &ms);
  if (st) return st;
  /* The staging area is reused: the previous forward's copy must be done with it. */
  if (m->in_flight) {
    if ((st = hal_st(m->be->stream_sync(m->stream), "forward"))) return st;
    m->in_flight = false;
  }
  const int64_t T = b->num_tokens, S = b->num_seqs;
  int32_t mrope_rows = 0;
  const int32_t *rope_pos = b->mrope_positions ? mrope_stage(m, b, &mrope_rows) : b->positions;
  int32_t gi = graph_slot(m, kv, b, mq, mrope_rows);
  if (gi >= 0) {
    bool eager = false;
    st = forward_graph(m, kv, b, rope_pos, gi, &eager);
    if (!eager) return st;
  }
  m->gstats.eager_forwards++;
  int32_t *h = m->meta_host;
  memcpy(h + m->m_ids, b->token_ids, (size_t)T * 4);
  memcpy(h + m->m_pos, rope_pos, (size_t)T * 4);
  if (mrope_rows) {
    memcpy(h + m->m_pos2, rope_pos + T, (size_t)T * 4);
    const uint64_t tb = (uint64_t)mrope_rows * (uint64_t)m->cfg.rope.rotary_dim * sizeof(float);
    if ((st = hal_st(m->be->copy_h2d(m->stream, m->mrope_tab, 0, m->mrope_host, tb),
                     "M-RoPE table")))
      return st;
  }
  memcpy(h + m->m_slots, b->slot_mapping, (size_t)T * 4);
  memcpy(h + m->m_seq_lens, b->seq_lens, (size_t)S * 4);
  memcpy(h + m->m_qsl, b->query_start_loc, (size_t)(S + 1) * 4);
  if (b->num_logits) memcpy(h + m->m_rows, b->logits_rows, (size_t)b->num_logits * 4);
  memcpy(h + m->m_bt, b->block_tables, (size_t)(S * b->max_blocks_per_seq) * 4);
  /* One copy from ids up to the end of this batch's block tables. */
  uint64_t bytes = (uint64_t)(m->m_bt + S * b->max_blocks_per_seq) * 4;
  if ((st = hal_st(m->be->copy_h2d(m->stream, m->meta, 0, h, bytes), "batch metadata"))) return st;
  m->in_flight = true;
  model_pass_t p = {.num_tokens = b->num_tokens,
                    .num_seqs = b->num_seqs,
                    .num_logits = b->num_logits,
                    .bt_width = b->max_blocks_per_seq,
                    .max_query_len = mq,
                    .max_seq_len = ms,
                    .gather = b->num_logits != b->num_tokens,
                    .num_mrope_rows = mrope_rows,
                    .num_embeds = b->num_embeds,
                    .embeds = b->embeds};
  for (int32_t i = 0; !p.gather && i < b->num_logits; i++) p.gather = b->logits_rows[i] != i;
  return llama_forward(m, kv, &p);
}

kiln_hal_tensor_t kiln_model_logits(const kiln_model_t *m, int32_t rows) {
  const int64_t shape[2] = {rows, m->cfg.vocab_size};
  return kiln_hal_tensor_make(m->logits, 0, KILN_HAL_F32, 2, shape);
}

kiln_status_t kiln_model_read_logits(kiln_model_t *m, int32_t rows, float *out) {
  if (rows < 0 || rows > m->opt.max_logits)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "read_logits: %d rows, want 0..%d", rows,
                            m->opt.max_logits);
  uint64_t bytes = (uint64_t)rows * (uint64_t)m->cfg.vocab_size * 4;
  kiln_status_t st = NULL;
  if (bytes) st = hal_st(m->be->copy_d2h(m->stream, out, m->logits, 0, bytes), "reading logits");
  if (!st) st = hal_st(m->be->stream_sync(m->stream), "reading logits");
  if (!st) m->in_flight = false;
  return st;
}

kiln_status_t kiln_model_forward_seq(kiln_model_t *m, kiln_kv_cache_t *kv,
                                     const int32_t *block_table, int32_t num_blocks,
                                     const int32_t *ids, int32_t start, int32_t n,
                                     int32_t num_logits) {
  if (n < 1 || num_logits < 0 || num_logits > n)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "forward_seq: %d tokens with %d logits rows",
                            n, num_logits);
  int32_t *buf = malloc((size_t)n * 3 * sizeof(int32_t));
  if (!buf) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  int32_t *pos = buf, *slots = buf + n, *rows = buf + 2 * n;
  const int32_t bs = kv->block_size;
  for (int32_t i = 0; i < n; i++) {
    int32_t p = start + i, j = p / bs;
    pos[i] = p;
    /* A position beyond the table is left for model_check_batch to report. */
    slots[i] = j < num_blocks ? block_table[j] * bs + p % bs : -1;
    rows[i] = n - num_logits + i;
  }
  int32_t len = start + n, qsl[2] = {0, n};
  kiln_batch_t b = {.num_tokens = n,
                    .num_seqs = 1,
                    .token_ids = ids,
                    .positions = pos,
                    .slot_mapping = slots,
                    .seq_lens = &len,
                    .query_start_loc = qsl,
                    .block_tables = block_table,
                    .max_blocks_per_seq = num_blocks,
                    .num_logits = num_logits,
                    .logits_rows = rows};
  kiln_status_t st = kiln_model_forward(m, kv, &b);
  free(buf);
  return st;
}

kiln_status_t kiln_model_score(kiln_model_t *m, const int32_t *ids, int32_t n, int32_t chunk,
                               int32_t block_size, float *out) {
  if (n < 1) return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "score: no tokens");
  if (chunk <= 0 || chunk > n) chunk = n;
  if (chunk > m->opt.max_tokens || chunk > m->opt.max_logits)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "score: chunks of %d tokens exceed the model's batch limits (%d)",
                            chunk, m->opt.max_tokens);
  if (n > m->max_len)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "score: %d tokens exceed the model's context of %lld", n,
                            (long long)m->max_len);
  int32_t nb = (n + block_size - 1) / block_size;
  kiln_kv_cache_t *kv = NULL;
  kiln_status_t st = kiln_model_kv_create(m, nb, block_size, &kv);
  if (st) return st;
  int32_t *bt = malloc((size_t)nb * 4);
  if (!bt) st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  /* Blocks in reverse order, so a position-to-slot mistake cannot go unnoticed. */
  for (int32_t i = 0; !st && i < nb; i++) bt[i] = nb - 1 - i;
  for (int32_t start = 0; start < n && !st; start += chunk) {
    int32_t t = n - start < chunk ? n - start : chunk;
    st = kiln_model_forward_seq(m, kv, bt, nb, ids + start, start, t, t);
    if (!st) st = kiln_model_read_logits(m, t, out + (size_t)start * (size_t)m->cfg.vocab_size);
  }
  free(bt);
  kiln_kv_cache_free(kv);
  return st;
}
