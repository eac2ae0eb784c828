/* vision.c - the Qwen2-VL / Qwen2.5-VL vision tower as HAL ops (see vision.h).
 *
 * With N patches (rows), E the embed width, NHv heads of Dv = E / NHv, I the MLP width, U the
 * merge unit (spatial_merge_size^2 patches) and K = C * tp * p * p:
 *
 *   x     = pixels @ Wpatch                      the Conv3d, stride = kernel: one GEMM [N,K]x[K,E]
 *   resid = 0
 *   per block:
 *     h     = norm1(resid += x)                  LayerNorm with bias (2-VL) / RMSNorm (2.5)
 *     qkv   = h @ Wqkv + b
 *     q, k  = rope(q, k)                         2-D: frequency i < Dv/4 at the patch's row,
 *                                                the next Dv/4 at its column (host-built table)
 *     pool[slots] = k, v;  a = attention(q, pool, causal = false), one sequence per image
 *                                                (2.5: per window, except full blocks)
 *     x     = a @ Wproj + b
 *     h     = norm2(resid += x)
 *     x     = fc2(quick_gelu(fc1(h)))           2-VL;  2.5: down(silu(gate(h)) * up(h))
 *   h   = ln_q(resid += x)  viewed [N/U, U*E]    (a merge unit's rows are consecutive)
 *   out = mlp2(gelu(mlp0(h)))                    2.5: rows permuted back to the image order
 *
 * For 2.5 the rows are in window order from the start: the host permutes the patches (the
 * patch embedding is per row, so this is the same as permuting its output, as transformers
 * does) and builds the rotary table in that order.
 *
 * Scratch (activations, the one-layer KV pool, the rotary table, metadata, host staging) is
 * grown to the largest call and kept.
 */
#include "models/vision/vision.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hal/loader.h"
#include "kiln/hal_util.h"
#include "models/model_internal.h"
#include "models/rope.h"

#if KILN_HAL_ABI_MINOR >= 2
#define VIS_HAVE_OPS 1
#else
#define VIS_HAVE_OPS 0
#endif

#define VIS_BS 16 /* tokens per block of the scratch KV pool */

typedef struct vis_block {
  uint64_t n1w, n1b, n2w, n2b; /* norms (biases: 2-VL LayerNorm; MODEL_NO_TENSOR for 2.5) */
  uint64_t qkv_w, qkv_b, proj_w, proj_b;
  uint64_t fc1_w, fc1_b; /* 2-VL fc1 [I, E]; 2.5 gate;up [2I, E] */
  uint64_t fc2_w, fc2_b; /* fc2 / down_proj [E, I] */
  bool full;             /* 2.5: a full-attention block (2-VL: every block) */
} vis_block_t;

/* One set of attention sequences over the rows (per image, or per window). */
typedef struct vis_seqs {
  int64_t n, mb, max_len;               /* sequences, widest block table, longest sequence */
  int64_t m_slots, m_qsl, m_lens, m_bt; /* element offsets in the metadata */
} vis_seqs_t;

struct kiln_vision {
  char prefix[32];
  uint64_t patch_w, lnq_w, lnq_b, m0_w, m0_b, m2_w, m2_b;
  vis_block_t *blocks;

  /* Scratch, for up to cap patches. */
  int64_t cap, cap_meta, cap_blocks;
  kiln_hal_buffer_t *act, *kv, *rope, *meta;
  float *host_pix, *host_rope;
  int32_t *host_meta;
  size_t host_pix_cap, host_rope_cap, host_meta_cap;
};

static kiln_status_t hal_st(kiln_hal_error_t *e, const char *what) {
  return e ? kiln_hal_status_from_error(e, what) : NULL;
}

/* ---- weights ------------------------------------------------------------------------------ */

kiln_status_t vision_plan(kiln_model_t *m, model_plan_t *p) {
  const kiln_vision_config_t *vc = &m->cfg.vision;
  const bool v25 = vc->gated_mlp;
  const int64_t E = vc->embed_dim, I = vc->intermediate_size,
                U = vc->spatial_merge_size * vc->spatial_merge_size;
  const int64_t OUT = vc->out_hidden_size;
  struct kiln_vision *v = calloc(1, sizeof(*v));
  if (!v) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  m->vis = v;
  v->blocks = calloc((size_t)vc->depth, sizeof(*v->blocks));
  if (!v->blocks) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  /* visual.* (published files, transformers 5.17's save_pretrained) or model.visual.* (its
   * module tree) */
  snprintf(v->prefix, sizeof(v->prefix), "%s",
           model_plan_has(p, "model.visual.patch_embed.proj.weight") ? "model.visual" : "visual");
  const char *pre = v->prefix;
  char nm[3][160];
  kiln_status_t st;

  snprintf(nm[0], sizeof(nm[0]), "%s.patch_embed.proj.weight", pre);
  const int64_t pshape[5] = {E, vc->in_channels, vc->temporal_patch_size, vc->patch_size,
                             vc->patch_size};
  const int64_t K = vc->in_channels * vc->temporal_patch_size * vc->patch_size * vc->patch_size;
  v->patch_w = model_plan_reserve(p, E * K);
  if ((st = model_plan_tensor_nd(p, nm[0], 5, pshape, v->patch_w, true, NULL))) return st;

  for (int64_t l = 0; l < vc->depth; l++) {
    vis_block_t *B = &v->blocks[l];
#define NAME(i, fmt) snprintf(nm[i], sizeof(nm[i]), "%s.blocks.%lld." fmt, pre, (long long)l)
    NAME(0, "norm1.weight");
    if ((st = model_plan_one(p, nm[0], E, 0, &B->n1w))) return st;
    NAME(0, "norm2.weight");
    if ((st = model_plan_one(p, nm[0], E, 0, &B->n2w))) return st;
    B->n1b = B->n2b = MODEL_NO_TENSOR;
    if (!v25) {
      NAME(0, "norm1.bias");
      if ((st = model_plan_one(p, nm[0], E, 0, &B->n1b))) return st;
      NAME(0, "norm2.bias");
      if ((st = model_plan_one(p, nm[0], E, 0, &B->n2b))) return st;
    }
    NAME(0, "attn.qkv.weight");
    if ((st = model_plan_one(p, nm[0], 3 * E, E, &B->qkv_w))) return st;
    NAME(0, "attn.qkv.bias");
    if ((st = model_plan_one(p, nm[0], 3 * E, 0, &B->qkv_b))) return st;
    NAME(0, "attn.proj.weight");
    if ((st = model_plan_one(p, nm[0], E, E, &B->proj_w))) return st;
    NAME(0, "attn.proj.bias");
    if ((st = model_plan_one(p, nm[0], E, 0, &B->proj_b))) return st;
    if (v25) {
      const int64_t rows[2] = {I, I};
      NAME(0, "mlp.gate_proj.weight");
      NAME(1, "mlp.up_proj.weight");
      if ((st = model_plan_fused(p, 2, nm, rows, E, false, &B->fc1_w))) return st;
      NAME(0, "mlp.gate_proj.bias");
      NAME(1, "mlp.up_proj.bias");
      if ((st = model_plan_fused(p, 2, nm, rows, 0, false, &B->fc1_b))) return st;
      NAME(0, "mlp.down_proj.weight");
      if ((st = model_plan_one(p, nm[0], E, I, &B->fc2_w))) return st;
      NAME(0, "mlp.down_proj.bias");
      if ((st = model_plan_one(p, nm[0], E, 0, &B->fc2_b))) return st;
      B->full = false;
      for (int32_t i = 0; i < vc->num_fullatt; i++) B->full = B->full || vc->fullatt_blocks[i] == l;
      if (vc->window_size <= 0) B->full = true;
    } else {
      NAME(0, "mlp.fc1.weight");
      if ((st = model_plan_one(p, nm[0], I, E, &B->fc1_w))) return st;
      NAME(0, "mlp.fc1.bias");
      if ((st = model_plan_one(p, nm[0], I, 0, &B->fc1_b))) return st;
      NAME(0, "mlp.fc2.weight");
      if ((st = model_plan_one(p, nm[0], E, I, &B->fc2_w))) return st;
      NAME(0, "mlp.fc2.bias");
      if ((st = model_plan_one(p, nm[0], E, 0, &B->fc2_b))) return st;
      B->full = true;
    }
#undef NAME
  }
  snprintf(nm[0], sizeof(nm[0]), "%s.merger.ln_q.weight", pre);
  if ((st = model_plan_one(p, nm[0], E, 0, &v->lnq_w))) return st;
  v->lnq_b = MODEL_NO_TENSOR;
  if (!v25) {
    snprintf(nm[0], sizeof(nm[0]), "%s.merger.ln_q.bias", pre);
    if ((st = model_plan_one(p, nm[0], E, 0, &v->lnq_b))) return st;
  }
  snprintf(nm[0], sizeof(nm[0]), "%s.merger.mlp.0.weight", pre);
  if ((st = model_plan_one(p, nm[0], U * E, U * E, &v->m0_w))) return st;
  snprintf(nm[0], sizeof(nm[0]), "%s.merger.mlp.0.bias", pre);
  if ((st = model_plan_one(p, nm[0], U * E, 0, &v->m0_b))) return st;
  snprintf(nm[0], sizeof(nm[0]), "%s.merger.mlp.2.weight", pre);
  if ((st = model_plan_one(p, nm[0], OUT, U * E, &v->m2_w))) return st;
  snprintf(nm[0], sizeof(nm[0]), "%s.merger.mlp.2.bias", pre);
  if ((st = model_plan_one(p, nm[0], OUT, 0, &v->m2_b))) return st;
  return NULL;
}

static void free_scratch(kiln_model_t *m, struct kiln_vision *v) {
  if (v->act) m->be->buffer_free(v->act);
  if (v->kv) m->be->buffer_free(v->kv);
  if (v->rope) m->be->buffer_free(v->rope);
  if (v->meta) m->be->buffer_free(v->meta);
  v->act = v->kv = v->rope = v->meta = NULL;
  v->cap = v->cap_meta = v->cap_blocks = 0;
}

void vision_free(kiln_model_t *m) {
  struct kiln_vision *v = m->vis;
  if (!v) return;
  free_scratch(m, v);
  free(v->host_pix);
  free(v->host_rope);
  free(v->host_meta);
  free(v->blocks);
  free(v);
  m->vis = NULL;
}

int64_t kiln_vision_image_tokens(const kiln_model_t *m, const kiln_vision_image_t *img) {
  if (!m->vis || !img) return -1;
  const int64_t ms = m->cfg.vision.spatial_merge_size;
  if (img->grid_t < 1 || img->grid_h < ms || img->grid_w < ms || img->grid_h % ms ||
      img->grid_w % ms)
    return -1;
  return (int64_t)img->grid_t * (img->grid_h / ms) * (img->grid_w / ms);
}

/* ---- metadata views and ops ------------------------------------------------------------------ */

static kiln_hal_tensor_t meta1(const struct kiln_vision *v, int64_t first, int64_t n) {
  return kiln_hal_tensor_make(v->meta, (uint64_t)first * 4, KILN_HAL_I32, 1, &n);
}

static kiln_status_t fail(kiln_hal_error_t *e, const char *what, int64_t block) {
  kiln_status_t st = kiln_hal_status_from_error(e, what);
  return block >= 0 ? kiln_status_annotate(st, "vision block %lld", (long long)block) : st;
}

#define HAL(call, what)                   \
  do {                                    \
    kiln_hal_error_t *e_ = (call);        \
    if (e_) return fail(e_, what, block); \
  } while (0)

static kiln_status_t gemm(kiln_model_t *m, kiln_hal_tensor_t a, kiln_hal_tensor_t b,
                          kiln_hal_tensor_t c, kiln_hal_tensor_t bias, int64_t block,
                          const char *what) {
  kiln_hal_gemm_args_t g;
  memset(&g, 0, sizeof(g));
  g.struct_size = sizeof(g);
  g.a = a;
  g.b = b;
  g.c = c;
  g.bias = bias;
  g.alpha = 1.0f;
  g.allow_tf32 = m->opt.allow_tf32;
  HAL(m->be->gemm(m->stream, &g), what);
  return NULL;
}

/* norm(resid += x) -> out: LayerNorm with bias (2-VL) or RMSNorm (2.5), eps 1e-6. */
static kiln_status_t norm(kiln_model_t *m, kiln_hal_tensor_t x, kiln_hal_tensor_t resid,
                          kiln_hal_tensor_t w, kiln_hal_tensor_t b, kiln_hal_tensor_t out,
                          int64_t block, const char *what) {
  if (m->cfg.vision.gated_mlp) {
    kiln_hal_rmsnorm_args_t a;
    memset(&a, 0, sizeof(a));
    a.struct_size = sizeof(a);
    a.x = x;
    a.residual = resid;
    a.weight = w;
    a.out = out;
    a.eps = 1e-6f;
    HAL(m->be->rmsnorm(m->stream, &a), what);
    return NULL;
  }
#if VIS_HAVE_OPS
  if (!KILN_HAL_HAS(m->be, layernorm) || !m->be->layernorm)
    return kiln_status_make(KILN_ERR_UNSUPPORTED,
                            "backend %s has no layernorm op (HAL ABI 1.2): Qwen2-VL's vision tower "
                            "needs it",
                            m->be->name);
  kiln_hal_layernorm_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.x = x;
  a.residual = resid;
  a.weight = w;
  a.bias = b;
  a.out = out;
  a.eps = 1e-6f;
  HAL(m->be->layernorm(m->stream, &a), what);
  return NULL;
#else
  (void)x, (void)resid, (void)w, (void)b, (void)out, (void)block, (void)what;
  return kiln_status_make(KILN_ERR_UNSUPPORTED,
                          "this build's HAL (ABI 1.%d) has no layernorm op: Qwen2-VL's vision "
                          "tower needs ABI 1.2",
                          KILN_HAL_ABI_MINOR);
#endif
}

/* out = act(x) elementwise (in place when out == x). */
static kiln_status_t activation(kiln_model_t *m, kiln_hal_tensor_t x, int32_t act, int64_t block,
                                const char *what) {
#if VIS_HAVE_OPS
  if (!KILN_HAL_HAS(m->be, activation) || !m->be->activation)
    return kiln_status_make(KILN_ERR_UNSUPPORTED,
                            "backend %s has no activation op (HAL ABI 1.2): the vision tower needs "
                            "it",
                            m->be->name);
  kiln_hal_activation_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.x = x;
  a.out = x;
  a.act = act;
  HAL(m->be->activation(m->stream, &a), what);
  return NULL;
#else
  (void)x, (void)act, (void)block, (void)what;
  return kiln_status_make(KILN_ERR_UNSUPPORTED,
                          "this build's HAL (ABI 1.%d) has no activation op: the vision tower "
                          "needs ABI 1.2",
                          KILN_HAL_ABI_MINOR);
#endif
}

/* ---- the host side of one call: row order, rotary table, attention metadata ---------------- */

/* Grows a host array to at least n elements of size es. */
static kiln_status_t grow_host(void **p, size_t *cap, size_t n, size_t es) {
  if (n <= *cap) return NULL;
  void *q = realloc(*p, n * es);
  if (!q)
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of host memory for the vision tower");
  *p = q;
  *cap = n;
  return NULL;
}

/* Appends a sequence set of the given lengths (consecutive rows from 0) to the metadata at
 * *mo: slots (a contiguous block range per sequence), query_start_loc, seq_lens, block
 * tables. Returns the blocks it uses. */
static int64_t seqs_build(int32_t *meta, int64_t *mo, const int64_t *lens, int64_t n, int64_t N,
                          vis_seqs_t *s) {
  int64_t mb = 1, ml = 1;
  for (int64_t i = 0; i < n; i++) {
    int64_t b = (lens[i] + VIS_BS - 1) / VIS_BS;
    if (b > mb) mb = b;
    if (lens[i] > ml) ml = lens[i];
  }
  s->n = n;
  s->mb = mb;
  s->max_len = ml;
  s->m_slots = *mo;
  s->m_qsl = s->m_slots + N;
  s->m_lens = s->m_qsl + n + 1;
  s->m_bt = s->m_lens + n;
  *mo = s->m_bt + n * mb;
  int64_t row = 0, blk = 0;
  for (int64_t i = 0; i < n; i++) {
    int64_t nb = (lens[i] + VIS_BS - 1) / VIS_BS;
    meta[s->m_qsl + i] = (int32_t)row;
    meta[s->m_lens + i] = (int32_t)lens[i];
    for (int64_t j = 0; j < mb; j++) meta[s->m_bt + i * mb + j] = (int32_t)(blk + (j < nb ? j : 0));
    for (int64_t r = 0; r < lens[i]; r++) meta[s->m_slots + row + r] = (int32_t)(blk * VIS_BS + r);
    row += lens[i];
    blk += nb;
  }
  meta[s->m_qsl + n] = (int32_t)row;
  return blk;
}

/* Metadata elements a sequence set of n sequences over N rows takes at most. */
static int64_t seqs_size(int64_t n, int64_t N) { return N + 2 * n + 1 + n * (N / VIS_BS + 2); }

/* Grows a device buffer to at least bytes. */
static kiln_status_t grow_dev(kiln_model_t *m, kiln_hal_buffer_t **buf, uint64_t bytes,
                              const char *what) {
  if (*buf) m->be->buffer_free(*buf);
  *buf = NULL;
  kiln_hal_error_t *e = m->be->buffer_alloc(m->dev, bytes ? bytes : 1, 0, buf);
  if (!e) return NULL;
  *buf = NULL;
  return kiln_status_annotate(kiln_hal_status_from_error(e, what), "allocating %.1f MiB for %s",
                              (double)bytes / (1 << 20), what);
}

kiln_status_t kiln_vision_host_rows(const kiln_vision_image_t *images, int32_t n, int32_t ms,
                                    int32_t vw, int64_t K, int64_t Dv, double theta, float *pix,
                                    float *rope, int32_t *order, int64_t *lens) {
  const int64_t U = (int64_t)ms * ms, q = Dv / 4;
  if (n < 1 || ms < 1 || vw < 0 || K < 1 || Dv < 4 || Dv % 4 || q > KILN_ROPE_MAX_FREQS)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "vision rows: %d images, merge %d, window %d, patch_dim %lld, head_dim "
                            "%lld",
                            n, ms, vw, (long long)K, (long long)Dv);
  float inv[KILN_ROPE_MAX_FREQS];
  kiln_rope_config_t rc;
  memset(&rc, 0, sizeof(rc));
  rc.kind = KILN_ROPE_DEFAULT;
  rc.style = KILN_HAL_ROPE_NEOX;
  rc.rotary_dim = (int32_t)(Dv / 2); /* VisionRotaryEmbedding(head_dim / 2, theta) */
  rc.theta = theta;
  rc.factor = 1.0;
  kiln_status_t st = kiln_rope_inv_freq(&rc, 1, inv, NULL);
  if (st) return st;
  /* Unit order (window order for 2.5) and window lengths. */
  int64_t N = 0;
  {
    int64_t u0 = 0, nw = 0, row = 0;
    for (int32_t i = 0; i < n; i++) {
      const int64_t gh = images[i].grid_h / ms, gw = images[i].grid_w / ms;
      if (vw > 0) {
        for (int64_t wy = 0; wy < gh; wy += vw)
          for (int64_t wx = 0; wx < gw; wx += vw) {
            int64_t cnt = 0;
            for (int64_t y = wy; y < wy + vw && y < gh; y++)
              for (int64_t x = wx; x < wx + vw && x < gw; x++)
                order[row / U + cnt++] = (int32_t)(u0 + y * gw + x);
            lens[n + nw++] = cnt * U;
            row += cnt * U;
          }
      } else {
        for (int64_t u = 0; u < gh * gw; u++) order[row / U + u] = (int32_t)(u0 + u);
        row += gh * gw * U;
      }
      lens[i] = gh * gw * U;
      u0 += gh * gw;
    }
    N = row;
  }
  /* The rotary row of a patch is four pieces of cos/sin(index * f_i) for its row and column
   * index: computed once per distinct index (the longest grid side) and frequency, the same
   * float and double operations as per patch. */
  int64_t maxg = 1;
  for (int32_t i = 0; i < n; i++) {
    if (images[i].grid_h > maxg) maxg = images[i].grid_h;
    if (images[i].grid_w > maxg) maxg = images[i].grid_w;
  }
  float *tab = malloc(sizeof(float) * (size_t)(maxg * 2 * q)); /* [index][cos q, sin q] */
  if (!tab)
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of host memory for the vision tower");
  for (int64_t i = 0; i < maxg; i++)
    for (int64_t f = 0; f < q; f++) {
      const float a = (float)i * inv[f];
      tab[i * 2 * q + f] = (float)cos((double)a);
      tab[i * 2 * q + q + f] = (float)sin((double)a);
    }
  /* Pixels and rotary rows in that order (order[] runs image by image). A run of units that
   * are consecutive in the source too (all of them without windows) is one copy: large copies
   * are the fastest (glibc streams those past the caches). */
  const size_t qb = (size_t)q * sizeof(float), unit = (size_t)(U * K);
  int64_t img = 0, img_u0 = 0, img_units = (images[0].grid_h / ms) * (images[0].grid_w / ms);
  int64_t run_r = 0, run_len = 0; /* the pending copy: rows' units run_r .. run_r + run_len - 1 */
  const float *run_src = NULL;
  for (int64_t r = 0; r < N / U; r++) {
    const int64_t src = order[r];
    while (src >= img_u0 + img_units) {
      img_u0 += img_units;
      img++;
      img_units = (images[img].grid_h / ms) * (images[img].grid_w / ms);
    }
    const int64_t gw = images[img].grid_w / ms, ul = src - img_u0;
    const float *sp = images[img].pixels + (size_t)ul * unit;
    if (run_len > 0 && sp == run_src + (size_t)run_len * unit) {
      run_len++;
    } else {
      if (run_len > 0)
        memcpy(pix + (size_t)run_r * unit, run_src, (size_t)run_len * unit * sizeof(float));
      run_r = r;
      run_len = 1;
      run_src = sp;
    }
    for (int64_t w = 0; w < U; w++) {
      /* transformers' rot_pos_emb: the patch's row and column in the image's patch grid */
      const int64_t hp = (ul / gw) * ms + w / ms, wp = (ul % gw) * ms + w % ms;
      float *rr = rope + (r * U + w) * Dv;
      memcpy(rr, tab + hp * 2 * q, qb);             /* cos(hp f) */
      memcpy(rr + q, tab + wp * 2 * q, qb);         /* cos(wp f) */
      memcpy(rr + 2 * q, tab + hp * 2 * q + q, qb); /* sin(hp f) */
      memcpy(rr + 3 * q, tab + wp * 2 * q + q, qb); /* sin(wp f) */
    }
  }
  if (run_len > 0)
    memcpy(pix + (size_t)run_r * unit, run_src, (size_t)run_len * unit * sizeof(float));
  free(tab);
  return NULL;
}

#define ALIGN_UP(x) (((x) + 255u) & ~(uint64_t)255u)

kiln_status_t kiln_vision_encode(kiln_model_t *m, const kiln_vision_image_t *images, int32_t n,
                                 kiln_hal_tensor_t out) {
  struct kiln_vision *v = m->vis;
  if (!v)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "model %s has no vision tower",
                            m->cfg.architecture);
  const kiln_vision_config_t *vc = &m->cfg.vision;
  const bool v25 = vc->gated_mlp;
  const int32_t dt = m->dtype;
  const size_t es = m->es;
  const int64_t ms = vc->spatial_merge_size, U = ms * ms, E = vc->embed_dim,
                I = vc->intermediate_size;
  const int64_t NHv = vc->num_heads, Dv = E / NHv, OUT = vc->out_hidden_size;
  const int64_t K = vc->in_channels * vc->temporal_patch_size * vc->patch_size * vc->patch_size;
  kiln_status_t st = NULL;
  int64_t block = -1;

  if (n < 1 || !images) return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "vision: %d images", n);
  int64_t N = 0, tokens = 0, nwin = 0;
  const int64_t vw = v25 && vc->window_size > 0 ? vc->window_size / ms / vc->patch_size : 0;
  for (int32_t i = 0; i < n; i++) {
    const kiln_vision_image_t *im = &images[i];
    int64_t t = kiln_vision_image_tokens(m, im);
    if (t < 0 || !im->pixels)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "vision: image %d: grid %d x %d x %d is not whole %lld x %lld merge "
                              "units (or has no pixels)",
                              i, im->grid_t, im->grid_h, im->grid_w, (long long)ms, (long long)ms);
    if (im->grid_t != 1)
      return kiln_status_make(KILN_ERR_UNSUPPORTED,
                              "vision: image %d has %d frames: videos are not supported yet", i,
                              im->grid_t);
    if ((int64_t)im->grid_h * im->grid_w > (1 << 22))
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "vision: image %d: %d x %d patches is too large", i, im->grid_h,
                              im->grid_w);
    N += (int64_t)im->grid_h * im->grid_w;
    tokens += t;
    if (vw > 0) nwin += ((im->grid_h / ms + vw - 1) / vw) * ((im->grid_w / ms + vw - 1) / vw);
  }
  if (N > (1 << 24))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "vision: %lld patches in one call is too many", (long long)N);
  if (out.dtype != dt || out.ndim != 2 || out.shape[0] < tokens || out.shape[1] != OUT ||
      out.stride[1] != 1 || out.stride[0] != OUT || !out.buffer)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "vision: the output must be a dense [>= %lld, %lld] %s tensor",
                            (long long)tokens, (long long)OUT, kiln_hal_dtype_name(dt));

  /* The previous call's staging may still be read by its copies. */
  if ((st = hal_st(m->be->stream_sync(m->stream), "vision"))) return st;
  m->in_flight = false;

  /* ---- host: row order, rotary table, metadata ---- */
  if ((st = grow_host((void **)&v->host_pix, &v->host_pix_cap, (size_t)(N * K), sizeof(float))) ||
      (st = grow_host((void **)&v->host_rope, &v->host_rope_cap, (size_t)(N * Dv), sizeof(float))))
    return st;
  const int64_t nseq_full = n, nseq_win = vw > 0 ? nwin : 0;
  const int64_t meta_n =
      N /* iota */ + seqs_size(nseq_full, N) + seqs_size(nseq_win, N) + N / U + 8;
  if ((st = grow_host((void **)&v->host_meta, &v->host_meta_cap, (size_t)meta_n, sizeof(int32_t))))
    return st;
  int32_t *meta = v->host_meta;
  int64_t *lens = malloc(sizeof(int64_t) * (size_t)(nseq_full + nseq_win + 1));
  int32_t *order = malloc(sizeof(int32_t) * (size_t)(N / U + 1)); /* merge unit -> source unit */
  if (!lens || !order) {
    free(lens);
    free(order);
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of host memory for the vision tower");
  }
  if ((st = kiln_vision_host_rows(images, n, (int32_t)ms, (int32_t)vw, K, Dv, vc->rope_theta,
                                  v->host_pix, v->host_rope, order, lens)))
    goto done;
  /* Metadata: iota, the full sets, the window sets, the reverse permutation. */
  int64_t mo = 0;
  for (int64_t r = 0; r < N; r++) meta[r] = (int32_t)r;
  mo = N;
  vis_seqs_t full, win;
  memset(&win, 0, sizeof(win));
  int64_t blocks = seqs_build(meta, &mo, lens, nseq_full, N, &full);
  if (nseq_win > 0) {
    int64_t b2 = seqs_build(meta, &mo, lens + nseq_full, nseq_win, N, &win);
    if (b2 > blocks) blocks = b2;
  }
  const int64_t m_rev = mo;
  for (int64_t r = 0; r < N / U; r++) meta[m_rev + order[r]] = (int32_t)r;
  mo += N / U;

  /* ---- device scratch ---- */
  const int64_t MW = v25 ? 2 * I : I;
  uint64_t off = 0;
  const uint64_t o_pix32 = off;
  if (dt != KILN_HAL_F32) off = ALIGN_UP(off + (uint64_t)(N * K) * 4);
  const uint64_t o_pix = off;
  off = ALIGN_UP(off + (uint64_t)(N * K) * es);
  const uint64_t o_x = off;
  off = ALIGN_UP(off + (uint64_t)(N * E) * es);
  const uint64_t o_res = off;
  off = ALIGN_UP(off + (uint64_t)(N * E) * es);
  const uint64_t o_h = off;
  off = ALIGN_UP(off + (uint64_t)(N * E) * es);
  const uint64_t o_qkv = off;
  off = ALIGN_UP(off + (uint64_t)(N * 3 * E) * es);
  const uint64_t o_attn = off;
  off = ALIGN_UP(off + (uint64_t)(N * E) * es);
  const uint64_t o_mlp = off;
  off = ALIGN_UP(off + (uint64_t)(N * MW) * es);
  const uint64_t o_mlp2 = off;
  off = ALIGN_UP(off + (uint64_t)(N * I) * es);
  const uint64_t o_mh = off;
  off = ALIGN_UP(off + (uint64_t)(N / U * U * E) * es);
  const uint64_t o_mout = off;
  off = ALIGN_UP(off + (uint64_t)(N / U * OUT) * es);
  if (N > v->cap) {
    free_scratch(m, v);
    if ((st = grow_dev(m, &v->act, off, "vision activations")) ||
        (st = grow_dev(m, &v->rope, (uint64_t)(N * Dv) * 4, "the vision rotary table")))
      goto done;
    v->cap = N;
  }
  if (mo > v->cap_meta) {
    if ((st = grow_dev(m, &v->meta, (uint64_t)mo * 4, "vision metadata"))) goto done;
    v->cap_meta = mo;
  }
  const uint64_t cache_bytes = (uint64_t)blocks * (uint64_t)(NHv * VIS_BS * Dv) * es;
  if (blocks > v->cap_blocks) {
    if ((st = grow_dev(m, &v->kv, 2 * cache_bytes, "the vision KV scratch"))) goto done;
    v->cap_blocks = blocks;
  }
  const uint64_t pool_bytes = (uint64_t)v->cap_blocks * (uint64_t)(NHv * VIS_BS * Dv) * es;

  /* ---- uploads ---- */
  kiln_hal_buffer_t *act = v->act;
  if ((st = hal_st(m->be->copy_h2d(m->stream, act, dt == KILN_HAL_F32 ? o_pix : o_pix32,
                                   v->host_pix, (uint64_t)(N * K) * 4),
                   "vision pixels")) ||
      (st = hal_st(m->be->copy_h2d(m->stream, v->rope, 0, v->host_rope, (uint64_t)(N * Dv) * 4),
                   "vision rotary table")) ||
      (st = hal_st(m->be->copy_h2d(m->stream, v->meta, 0, meta, (uint64_t)mo * 4),
                   "vision metadata")))
    goto done;
  m->in_flight = true;

  /* ---- the tower ---- */
  {
    kiln_hal_tensor_t none;
    memset(&none, 0, sizeof(none));
    kiln_hal_tensor_t pix = model_view2(act, o_pix, dt, N, K, K);
    if (dt != KILN_HAL_F32) {
      kiln_hal_copy_args_t ca;
      memset(&ca, 0, sizeof(ca));
      ca.struct_size = sizeof(ca);
      ca.src = model_view2(act, o_pix32, KILN_HAL_F32, N, K, K);
      ca.dst = pix;
      kiln_hal_error_t *e = m->be->copy(m->stream, &ca);
      if (e) {
        st = fail(e, "vision pixels to the serving dtype", -1);
        goto done;
      }
    }
    kiln_hal_tensor_t x = model_view2(act, o_x, dt, N, E, E),
                      resid = model_view2(act, o_res, dt, N, E, E);
    kiln_hal_tensor_t h = model_view2(act, o_h, dt, N, E, E);
    kiln_hal_tensor_t qkv = model_view2(act, o_qkv, dt, N, 3 * E, 3 * E);
    kiln_hal_tensor_t q = model_view3(act, o_qkv, dt, N, NHv, Dv, 3 * E);
    kiln_hal_tensor_t k = model_view3(act, o_qkv + (uint64_t)E * es, dt, N, NHv, Dv, 3 * E);
    kiln_hal_tensor_t vv = model_view3(act, o_qkv + (uint64_t)(2 * E) * es, dt, N, NHv, Dv, 3 * E);
    kiln_hal_tensor_t attn = model_view3(act, o_attn, dt, N, NHv, Dv, E);
    kiln_hal_tensor_t attn2 = model_view2(act, o_attn, dt, N, E, E);
    kiln_hal_tensor_t mlp = model_view2(act, o_mlp, dt, N, MW, MW);
    kiln_hal_tensor_t mlp2 = model_view2(act, o_mlp2, dt, N, I, I);
    const int64_t cs[4] = {v->cap_blocks, NHv, VIS_BS, Dv};
    kiln_hal_tensor_t kc = kiln_hal_tensor_make(v->kv, 0, dt, 4, cs);
    kiln_hal_tensor_t vcache = kiln_hal_tensor_make(v->kv, pool_bytes, dt, 4, cs);
    const int64_t rs[2] = {N, Dv};
    kiln_hal_tensor_t rope_tab = kiln_hal_tensor_make(v->rope, 0, KILN_HAL_F32, 2, rs);

    if ((st = gemm(m, pix, model_weight_t(m, v->patch_w, K, E), x, none, -1, "patch_embed")))
      goto done;
    {
      kiln_hal_error_t *e = m->be->fill(m->stream, act, o_res, (uint64_t)(N * E) * es, 0);
      if (e) {
        st = fail(e, "fill", -1);
        goto done;
      }
    }
    for (block = 0; block < vc->depth; block++) {
      const vis_block_t *B = &v->blocks[block];
      const vis_seqs_t *sq = B->full || nseq_win == 0 ? &full : &win;
      if ((st = norm(m, x, resid, model_vec(m, B->n1w, E), model_vec(m, B->n1b, E), h, block,
                     "norm1")) ||
          (st = gemm(m, h, model_weight_t(m, B->qkv_w, E, 3 * E), qkv,
                     model_vec(m, B->qkv_b, 3 * E), block, "attn.qkv")))
        goto done;
      kiln_hal_rope_args_t ra;
      memset(&ra, 0, sizeof(ra));
      ra.struct_size = sizeof(ra);
      ra.q = q;
      ra.k = k;
      ra.positions = meta1(v, 0, N);
      ra.cos_sin = rope_tab;
      ra.style = KILN_HAL_ROPE_NEOX;
      kiln_hal_error_t *e = m->be->rope(m->stream, &ra);
      if (e) {
        st = fail(e, "rope", block);
        goto done;
      }
      kiln_hal_kv_write_args_t kw;
      memset(&kw, 0, sizeof(kw));
      kw.struct_size = sizeof(kw);
      kw.k = k;
      kw.v = vv;
      kw.k_cache = kc;
      kw.v_cache = vcache;
      kw.slot_mapping = meta1(v, sq->m_slots, N);
      if ((e = m->be->kv_write(m->stream, &kw))) {
        st = fail(e, "kv_write", block);
        goto done;
      }
      kiln_hal_attention_args_t aa;
      memset(&aa, 0, sizeof(aa));
      aa.struct_size = sizeof(aa);
      aa.q = q;
      aa.k_cache = kc;
      aa.v_cache = vcache;
      aa.out = attn;
      aa.block_table =
          model_view2(v->meta, (uint64_t)sq->m_bt * 4, KILN_HAL_I32, sq->n, sq->mb, sq->mb);
      aa.seq_lens = meta1(v, sq->m_lens, sq->n);
      aa.query_start_loc = meta1(v, sq->m_qsl, sq->n + 1);
      aa.num_seqs = (int32_t)sq->n;
      aa.max_query_len = (int32_t)sq->max_len;
      aa.max_seq_len = (int32_t)sq->max_len;
      aa.scale = (float)(1.0 / sqrt((double)Dv));
      aa.causal = false;
      if ((e = m->be->attention(m->stream, &aa))) {
        st = fail(e, "attention", block);
        goto done;
      }
      if ((st = gemm(m, attn2, model_weight_t(m, B->proj_w, E, E), x, model_vec(m, B->proj_b, E),
                     block, "attn.proj")) ||
          (st = norm(m, x, resid, model_vec(m, B->n2w, E), model_vec(m, B->n2b, E), h, block,
                     "norm2")) ||
          (st = gemm(m, h, model_weight_t(m, B->fc1_w, E, MW), mlp, model_vec(m, B->fc1_b, MW),
                     block, v25 ? "mlp.gate_up_proj" : "mlp.fc1")))
        goto done;
      if (v25) {
        kiln_hal_silu_mul_args_t sm;
        memset(&sm, 0, sizeof(sm));
        sm.struct_size = sizeof(sm);
        sm.x = mlp;
        sm.out = mlp2;
        sm.act = vc->hidden_act;
        if ((e = m->be->silu_mul(m->stream, &sm))) {
          st = fail(e, "mlp act_mul", block);
          goto done;
        }
        if ((st = gemm(m, mlp2, model_weight_t(m, B->fc2_w, I, E), x, model_vec(m, B->fc2_b, E),
                       block, "mlp.down_proj")))
          goto done;
      } else {
        if ((st = activation(m, mlp, vc->hidden_act, block, "mlp.act")) ||
            (st = gemm(m, mlp, model_weight_t(m, B->fc2_w, I, E), x, model_vec(m, B->fc2_b, E),
                       block, "mlp.fc2")))
          goto done;
      }
    }
    block = -1;
    /* The merger: ln_q over the last residual, then the MLP over each merge unit's U rows. */
    const int64_t NU = N / U;
    kiln_hal_tensor_t hm = model_view2(act, o_h, dt, NU, U * E, U * E);
    kiln_hal_tensor_t mh = model_view2(act, o_mh, dt, NU, U * E, U * E);
    kiln_hal_tensor_t dst = v25 ? model_view2(act, o_mout, dt, NU, OUT, OUT)
                                : model_view2(out.buffer, out.offset, dt, NU, OUT, OUT);
    if ((st = norm(m, x, resid, model_vec(m, v->lnq_w, E), model_vec(m, v->lnq_b, E), h, -1,
                   "merger.ln_q")) ||
        (st = gemm(m, hm, model_weight_t(m, v->m0_w, U * E, U * E), mh,
                   model_vec(m, v->m0_b, U * E), -1, "merger.mlp.0")) ||
        (st = activation(m, mh, KILN_HAL_ACT_GELU, -1, "merger.gelu")) ||
        (st = gemm(m, mh, model_weight_t(m, v->m2_w, U * E, OUT), dst, model_vec(m, v->m2_b, OUT),
                   -1, "merger.mlp.2")))
      goto done;
    if (v25) { /* rows back to the image order */
      kiln_hal_embedding_args_t ga;
      memset(&ga, 0, sizeof(ga));
      ga.struct_size = sizeof(ga);
      ga.table = dst;
      ga.ids = meta1(v, m_rev, NU);
      ga.out = model_view2(out.buffer, out.offset, dt, NU, OUT, OUT);
      kiln_hal_error_t *e = m->be->embedding(m->stream, &ga);
      if (e) {
        st = fail(e, "merger row order", -1);
        goto done;
      }
    }
  }
done:
  free(lens);
  free(order);
  return st;
}
