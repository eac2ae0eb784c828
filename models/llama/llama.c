/* llama.c - the Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2, Qwen3) as a sequence of
 * HAL ops over the paged KV cache. Differences between the architectures are the config's
 * flags: biases, q/k norms, sliding windows, rope scaling (already in the rope table).
 *
 * Per layer, with x the previous layer's output and resid the running residual stream:
 *
 *   h     = rmsnorm(resid += x)                 fused residual add (layer 0: resid = 0)
 *   qkv   = h @ Wqkv (+ b)                      one GEMM (three when q/k are normed)
 *   q, k  = rmsnorm_per_head(q, k)              Qwen3 only
 *   q, k  = rope(q, k, positions)
 *   cache[slot_mapping] = k, v
 *   a     = paged_attention(q, cache, block_tables, seq_lens, query_start_loc)
 *   x     = a @ Wo (+ b)
 *   h     = rmsnorm(resid += x)
 *   x     = down(act(h @ Wgate) * (h @ Wup))    gate and up as one GEMM
 *
 * then logits = lm_head(rmsnorm(resid += x)) for the requested rows only (gathered first).
 *
 * Tensor parallelism (model.c's tp_setup, docs/parallel.md): every size here is this rank's
 * (m->cfg: its heads, KV heads and intermediate slice); o_proj and down_proj produce partial
 * sums that one all_reduce each completes, so x is whole again before each rmsnorm. The
 * embedding, norms and lm_head are replicated: every rank ends with the full logits.
 *
 * Only HAL ops, with every size taken from the model_pass_t and every index from m->meta, so
 * that the same call records a decode graph (models/model.c) as well as it runs eagerly.
 */
#include <math.h>
#include <string.h>

#include "hal/loader.h"
#include "kiln/hal_util.h"
#include "kiln/hal_quant.h"
#include "models/model_internal.h"

/* n int32 values of the batch metadata, from element first. */
static kiln_hal_tensor_t meta1(const kiln_model_t *m, int64_t first, int64_t n) {
  return kiln_hal_tensor_make(m->meta, (uint64_t)first * 4, KILN_HAL_I32, 1, &n);
}

static kiln_status_t hal_fail(kiln_hal_error_t *e, const char *what, int64_t layer) {
  kiln_status_t st = kiln_hal_status_from_error(e, what);
  return layer >= 0 ? kiln_status_annotate(st, "layer %lld", (long long)layer) : st;
}

#define HAL(call, what)                       \
  do {                                        \
    kiln_hal_error_t *e_ = (call);            \
    if (e_) return hal_fail(e_, what, layer); \
  } while (0)

static kiln_status_t gemm(kiln_model_t *m, kiln_hal_tensor_t a, kiln_hal_tensor_t b,
                          kiln_hal_tensor_t c, kiln_hal_tensor_t bias, int64_t layer,
                          const char *what) {
  kiln_hal_gemm_args_t g;
  memset(&g, 0, sizeof(g));
  g.struct_size = sizeof(g);
  g.a = a;
  g.b = b;
  g.c = c;
  g.bias = bias;
  g.alpha = 1.0f;
  g.beta = 0.0f;
  g.allow_tf32 = m->opt.allow_tf32;
  HAL(m->be->gemm(m->stream, &g), what);
  return NULL;
}

/* y = x @ W^T + bias for a Linear weight W [N, K] at byte offset off of the weight buffer:
 * gemm on the serving dtype, or gemm_quant on GGUF blocks kept quantized (fmt, model.c). */
static kiln_status_t linear(kiln_model_t *m, kiln_hal_tensor_t x, uint64_t off, int32_t fmt,
                            const model_qlinear_t *q, int64_t K, int64_t N, kiln_hal_tensor_t y,
                            kiln_hal_tensor_t bias, int64_t layer, const char *what) {
  if (fmt == KILN_HAL_QFMT_NONE) return gemm(m, x, model_weight_t(m, off, K, N), y, bias, layer, what);
  kiln_hal_gemm_quant_args_t g;
  memset(&g, 0, sizeof(g));
  g.struct_size = sizeof(g);
  g.x = x;
  g.y = y;
  g.bias = bias;
  g.w.buffer = m->weights;
  g.w.offset = off;
  g.w.format = fmt;
  g.w.n = N;
  g.w.k = K;
  if (fmt == KILN_HAL_QFMT_FP8_E4M3 && m->fp8_xquant) g.x_quant = KILN_HAL_XQUANT_FP8_TOKEN;
  if (kiln_hal_qfmt_is_group(fmt)) { /* GPTQ / AWQ / FP8 at load (model.c, qlinear.c) */
    g.w.row_stride = kiln_hal_qgroup_row_bytes(fmt, K);
    g.w.group_size = q->group_size;
    const int64_t G = q->groups;
    g.w.scales = (kiln_hal_tensor_t){.buffer = m->weights,
                                     .offset = q->scales,
                                     .dtype = kiln_hal_qgroup_scale_dtype(fmt),
                                     .ndim = 2,
                                     .shape = {N, G},
                                     .stride = {G, 1}};
    if (q->zeros != MODEL_NO_TENSOR) /* FP8 has none */
      g.w.zeros = (kiln_hal_tensor_t){.buffer = m->weights,
                                    .offset = q->zeros,
                                    .dtype = KILN_HAL_U8,
                                    .ndim = 2,
                                    .shape = {N, G},
                                    .stride = {G, 1}};
    if (q->g_idx != MODEL_NO_TENSOR)
      g.w.g_idx = (kiln_hal_tensor_t){.buffer = m->weights,
                                      .offset = q->g_idx,
                                      .dtype = KILN_HAL_I32,
                                      .ndim = 1,
                                      .shape = {K},
                                      .stride = {1}};
  } else {
    g.w.row_stride = K / kiln_hal_qfmt_block_elems(fmt) * kiln_hal_qfmt_block_bytes(fmt);
  }
  HAL(m->be->gemm_quant(m->stream, &g), what);
  return NULL;
}

/* Tensor parallelism: x [T, H] = the sum of every rank's partial x, in place (after the
 * row-parallel o_proj and down_proj; rank 0's partial holds the bias). */
static kiln_status_t tp_reduce(kiln_model_t *m, kiln_hal_tensor_t x, int64_t layer,
                               const char *what) {
  if (m->tp_size <= 1) return NULL;
  kiln_hal_coll_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.comm = m->opt.tp_comm;
  a.src = x;
  a.dst = x;
  HAL(m->be->all_reduce(m->stream, &a), what);
  return NULL;
}

static kiln_status_t rmsnorm(kiln_model_t *m, kiln_hal_tensor_t x, kiln_hal_tensor_t residual,
                             kiln_hal_tensor_t w, kiln_hal_tensor_t out, int64_t layer,
                             const char *what) {
  kiln_hal_rmsnorm_args_t a;
  memset(&a, 0, sizeof(a));
  a.struct_size = sizeof(a);
  a.x = x;
  a.residual = residual;
  a.weight = w;
  a.out = out;
  a.eps = (float)m->cfg.rms_norm_eps;
  HAL(m->be->rmsnorm(m->stream, &a), what);
  return NULL;
}

kiln_status_t llama_forward(kiln_model_t *m, kiln_kv_cache_t *kv, const model_pass_t *p) {
  const kiln_model_config_t *c = &m->cfg;
  const int32_t dt = m->dtype;
  const int64_t T = p->num_tokens, S = p->num_seqs, R = p->num_logits, MB = p->bt_width;
  const int64_t H = c->hidden_size, I = c->intermediate_size, V = c->vocab_size;
  const int64_t NH = c->num_heads, NKV = c->num_kv_heads, D = c->head_dim;
  const int64_t QD = NH * D, KD = NKV * D, QKV = QD + 2 * KD;
  const int64_t TM = m->opt.max_tokens;
  const size_t es = m->es;
  kiln_status_t st;
  int64_t layer = -1;

  kiln_hal_tensor_t x = model_view2(m->act, m->x, dt, T, H, H);
  kiln_hal_tensor_t resid = model_view2(m->act, m->resid, dt, T, H, H);
  kiln_hal_tensor_t h = model_view2(m->act, m->h, dt, T, H, H);
  kiln_hal_tensor_t none;
  memset(&none, 0, sizeof(none));

  kiln_hal_embedding_args_t emb;
  memset(&emb, 0, sizeof(emb));
  emb.struct_size = sizeof(emb);
  emb.table = model_view2(m->weights, m->embed, dt, V, H, H);
  emb.ids = meta1(m, m->m_ids, T);
  emb.out = x;
  HAL(m->be->embedding(m->stream, &emb), "embedding");
  /* Rows whose embeddings are given (an image's tokens): copied over the lookup. */
  for (int32_t i = 0; i < p->num_embeds; i++) {
    const kiln_batch_embed_t *e = &p->embeds[i];
    kiln_hal_copy_args_t ca;
    memset(&ca, 0, sizeof(ca));
    ca.struct_size = sizeof(ca);
    ca.src = e->src;
    ca.src.offset += (uint64_t)e->first * (uint64_t)e->src.stride[0] *
                     (uint64_t)kiln_hal_dtype_size(e->src.dtype);
    ca.src.shape[0] = e->count;
    ca.dst = model_view2(m->act, m->x + (uint64_t)e->row * H * es, dt, e->count, H, H);
    HAL(m->be->copy(m->stream, &ca), "embedding rows");
  }
  HAL(m->be->fill(m->stream, m->act, m->resid, (uint64_t)T * H * es, 0), "fill");

  /* q, k, v: slices of one fused GEMM output, or (with q/k norms, which need each head's
   * rows contiguous) three dense buffers carved from the same space. */
  const bool split = c->qk_norm;
  kiln_hal_tensor_t q, k, v;
  if (split) {
    q = model_view3(m->act, m->qkv, dt, T, NH, D, QD);
    k = model_view3(m->act, m->qkv + (uint64_t)TM * QD * es, dt, T, NKV, D, KD);
    v = model_view3(m->act, m->qkv + (uint64_t)TM * (QD + KD) * es, dt, T, NKV, D, KD);
  } else {
    q = model_view3(m->act, m->qkv, dt, T, NH, D, QKV);
    k = model_view3(m->act, m->qkv + (uint64_t)QD * es, dt, T, NKV, D, QKV);
    v = model_view3(m->act, m->qkv + (uint64_t)(QD + KD) * es, dt, T, NKV, D, QKV);
  }
  kiln_hal_tensor_t attn = model_view3(m->act, m->attn, dt, T, NH, D, QD);
  kiln_hal_tensor_t attn2 = model_view2(m->act, m->attn, dt, T, QD, QD);
  kiln_hal_tensor_t gu = model_view2(m->act, m->gu, dt, T, 2 * I, 2 * I);
  kiln_hal_tensor_t mlp = model_view2(m->act, m->mlp, dt, T, I, I);

  const int64_t rope_shape[2] = {m->max_len, c->rope.rotary_dim};
  const kiln_hal_tensor_t rope_tab = kiln_hal_tensor_make(m->rope, 0, KILN_HAL_F32, 2, rope_shape);

  const int64_t NB = kv->pool_blocks, BS = kv->block_size;
  for (layer = 0; layer < c->num_layers; layer++) {
    const model_layer_t *L = &m->layers[layer];
    if ((st = rmsnorm(m, x, resid, model_vec(m, L->in_norm, H), h, layer, "input_layernorm")))
      return st;

    if (!split && L->qkv_mixed) { /* parts in different block types: into qkv's columns */
      static const char *const what[3] = {"q_proj", "k_proj", "v_proj"};
      const int64_t cols[3] = {QD, KD, KD}, at[3] = {0, QD, QD + KD};
      for (int i = 0; i < 3; i++) {
        kiln_hal_tensor_t y =
            model_view2(m->act, m->qkv + (uint64_t)at[i] * es, dt, T, cols[i], QKV);
        kiln_hal_tensor_t b = L->qkv_b == MODEL_NO_TENSOR
                                  ? none
                                  : model_vec(m, L->qkv_b + (uint64_t)at[i] * es, cols[i]);
        if ((st = linear(m, h, L->qkv_pw[i], L->qkv_pf[i], &L->qkv_q, H, cols[i], y, b, layer,
                         what[i])))
          return st;
      }
    } else if (!split) {
      kiln_hal_tensor_t qkv = model_view2(m->act, m->qkv, dt, T, QKV, QKV);
      if ((st = linear(m, h, L->qkv_w, L->qkv_fmt, &L->qkv_q, H, QKV, qkv,
                       model_vec(m, L->qkv_b, QKV), layer, "qkv_proj")))
        return st;
    } else {
      const uint64_t wq = L->qkv_w, wk = wq + (uint64_t)QD * H * es,
                     wv = wk + (uint64_t)KD * H * es;
      kiln_hal_tensor_t bq = none, bk = none, bv = none;
      if (L->qkv_b != MODEL_NO_TENSOR) {
        bq = model_vec(m, L->qkv_b, QD);
        bk = model_vec(m, L->qkv_b + (uint64_t)QD * es, KD);
        bv = model_vec(m, L->qkv_b + (uint64_t)(QD + KD) * es, KD);
      }
      if ((st = gemm(m, h, model_weight_t(m, wq, H, QD),
                     model_view2(m->act, q.offset, dt, T, QD, QD), bq, layer, "q_proj")) ||
          (st = gemm(m, h, model_weight_t(m, wk, H, KD),
                     model_view2(m->act, k.offset, dt, T, KD, KD), bk, layer, "k_proj")) ||
          (st = gemm(m, h, model_weight_t(m, wv, H, KD),
                     model_view2(m->act, v.offset, dt, T, KD, KD), bv, layer, "v_proj")))
        return st;
      kiln_hal_tensor_t qh = model_view2(m->act, q.offset, dt, T * NH, D, D);
      kiln_hal_tensor_t kh = model_view2(m->act, k.offset, dt, T * NKV, D, D);
      if ((st = rmsnorm(m, qh, none, model_vec(m, L->q_norm, D), qh, layer, "q_norm")) ||
          (st = rmsnorm(m, kh, none, model_vec(m, L->k_norm, D), kh, layer, "k_norm")))
        return st;
    }

    kiln_hal_rope_args_t ra;
    memset(&ra, 0, sizeof(ra));
    ra.struct_size = sizeof(ra);
    ra.q = q;
    ra.k = k;
    ra.positions = meta1(m, m->m_pos, T);
    ra.cos_sin = rope_tab;
    ra.style = c->rope.style;
    HAL(m->be->rope(m->stream, &ra), "rope");
    if (p->num_mrope_rows > 0) { /* M-RoPE rows whose t, h, w differ: their own table */
      const int64_t ms[2] = {p->num_mrope_rows, c->rope.rotary_dim};
      ra.positions = meta1(m, m->m_pos2, T);
      ra.cos_sin = kiln_hal_tensor_make(m->mrope_tab, 0, KILN_HAL_F32, 2, ms);
      HAL(m->be->rope(m->stream, &ra), "rope (M-RoPE rows)");
    }

    const uint64_t kc_off = (uint64_t)layer * 2 * kv->cache_bytes,
                   vc_off = kc_off + kv->cache_bytes;
    const int64_t cache_shape[4] = {NB, NKV, BS, D};
    kiln_hal_tensor_t kc = kiln_hal_tensor_make(kv->buf, kc_off, m->kv_dtype, 4, cache_shape);
    kiln_hal_tensor_t vc = kiln_hal_tensor_make(kv->buf, vc_off, m->kv_dtype, 4, cache_shape);
    const bool kv8 = m->kv_format == KILN_HAL_KV_FP8_E4M3; /* [cache] dtype = fp8_e4m3 */
    const float k_scale = kv8 ? m->kv_scales[2 * layer] : 0.0f;
    const float v_scale = kv8 ? m->kv_scales[2 * layer + 1] : 0.0f;

    kiln_hal_kv_write_args_t kw;
    memset(&kw, 0, sizeof(kw));
    kw.struct_size = sizeof(kw);
    kw.k = k;
    kw.v = v;
    kw.k_cache = kc;
    kw.v_cache = vc;
    kw.slot_mapping = meta1(m, m->m_slots, T);
    kw.kv_format = m->kv_format;
    kw.k_scale = k_scale;
    kw.v_scale = v_scale;
    HAL(m->be->kv_write(m->stream, &kw), "kv_write");

    kiln_hal_attention_args_t aa;
    memset(&aa, 0, sizeof(aa));
    aa.struct_size = sizeof(aa);
    aa.q = q;
    aa.k_cache = kc;
    aa.v_cache = vc;
    aa.out = attn;
    aa.block_table = model_view2(m->meta, (uint64_t)m->m_bt * 4, KILN_HAL_I32, S, MB, MB);
    aa.seq_lens = meta1(m, m->m_seq_lens, S);
    aa.query_start_loc = meta1(m, m->m_qsl, S + 1);
    aa.num_seqs = (int32_t)S;
    aa.max_query_len = p->max_query_len;
    aa.max_seq_len = p->max_seq_len;
    aa.scale = (float)(1.0 / sqrt((double)D));
    aa.causal = true;
    aa.sliding_window = L->window;
    aa.kv_format = m->kv_format;
    aa.k_scale = k_scale;
    aa.v_scale = v_scale;
    HAL(m->be->attention(m->stream, &aa), "attention");

    if ((st = linear(m, attn2, L->o_w, L->o_fmt, &L->o_q, QD, H, x, model_vec(m, L->o_b, H), layer,
                     "o_proj")) ||
        (st = tp_reduce(m, x, layer, "o_proj all_reduce")) ||
        (st = rmsnorm(m, x, resid, model_vec(m, L->post_norm, H), h, layer,
                      "post_attention_layernorm")) ||
        (st = linear(m, h, L->gu_w, L->gu_fmt, &L->gu_q, H, 2 * I, gu, model_vec(m, L->gu_b, 2 * I),
                     layer, "gate_up_proj")))
      return st;
    kiln_hal_silu_mul_args_t sm;
    memset(&sm, 0, sizeof(sm));
    sm.struct_size = sizeof(sm);
    sm.x = gu;
    sm.out = mlp;
    sm.act = c->hidden_act;
    HAL(m->be->silu_mul(m->stream, &sm), "act_mul");
    if ((st = linear(m, mlp, L->down_w, L->down_fmt, &L->down_q, I, H, x,
                     model_vec(m, L->down_b, H), layer, "down_proj")) ||
        (st = tp_reduce(m, x, layer, "down_proj all_reduce")))
      return st;
  }

  layer = -1;
  if (R == 0) return NULL;
  /* The final norm adds the last residual for every row (cheap: [T, H]); only the R rows that
   * need logits are gathered (an embedding lookup into h) and multiplied by lm_head. */
  if ((st = rmsnorm(m, x, resid, model_vec(m, m->final_norm, H), h, layer, "norm"))) return st;
  kiln_hal_tensor_t rows = model_view2(m->act, m->h, dt, R, H, H); /* rows 0..R-1 (R <= T) */
  if (p->gather) {
    rows = model_view2(m->act, m->gather, dt, R, H, H);
    kiln_hal_embedding_args_t ga;
    memset(&ga, 0, sizeof(ga));
    ga.struct_size = sizeof(ga);
    ga.table = h;
    ga.ids = meta1(m, m->m_rows, R);
    ga.out = rows;
    HAL(m->be->embedding(m->stream, &ga), "gather logits rows");
  }
  kiln_hal_tensor_t logits = model_view2(m->logits, 0, KILN_HAL_F32, R, V, V);
  return linear(m, rows, m->lm_head, m->lm_fmt, &m->lm_q, H, V, logits, none, layer, "lm_head");
}
