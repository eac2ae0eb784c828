/* model_internal.h - the loaded model's layout, shared by model.c (loading, KV cache, batch
 * checks) and llama/llama.c (the forward pass). */
#ifndef KILN_MODELS_MODEL_INTERNAL_H
#define KILN_MODELS_MODEL_INTERNAL_H

#include <string.h>

#include "kiln/hal_util.h"
#include "models/loader/weights.h"
#include "models/model.h"

#define MODEL_NO_TENSOR UINT64_MAX /* an absent optional weight (a bias, a q/k norm) */

/* The rest of a Linear kept in a group format (KILN_HAL_QFMT_INT4_G / INT8_G / FP8_E4M3;
 * hal.h's kiln_hal_qweight_t): byte offsets in the weight buffer of its F16 scales [N, G] (F32
 * for FP8), U8 zeros [N, G] (MODEL_NO_TENSOR for FP8) and I32 g_idx [K] (MODEL_NO_TENSOR:
 * none, g = k / group_size). */
typedef struct model_qlinear {
  int32_t group_size;
  int64_t groups;
  uint64_t scales, zeros, g_idx;
} model_qlinear_t;

/* Byte offsets of one decoder layer's weights in the model's weight buffer. Fused weights
 * keep PyTorch's [out, in] row-major layout, rows concatenated, so one GEMM computes them. */
typedef struct model_layer {
  uint64_t in_norm;   /* [H] input_layernorm */
  uint64_t post_norm; /* [H] post_attention_layernorm */
  uint64_t qkv_w;     /* [NH*D + 2*NKV*D, H]  q_proj; k_proj; v_proj */
  uint64_t qkv_b;     /* [NH*D + 2*NKV*D] or MODEL_NO_TENSOR */
  uint64_t q_norm;    /* [D] or MODEL_NO_TENSOR (Qwen3) */
  uint64_t k_norm;    /* [D] or MODEL_NO_TENSOR */
  uint64_t o_w;       /* [H, NH*D] o_proj */
  uint64_t o_b;       /* [H] or MODEL_NO_TENSOR */
  uint64_t gu_w;      /* [2I, H]  gate_proj; up_proj */
  uint64_t gu_b;      /* [2I] or MODEL_NO_TENSOR */
  uint64_t down_w;    /* [H, I] down_proj */
  uint64_t down_b;    /* [H] or MODEL_NO_TENSOR */
  int32_t window;     /* sliding window of this layer, 0 = full attention */
  /* kiln_hal_qfmt_t of qkv_w, o_w, gu_w, down_w: KILN_HAL_QFMT_NONE = the serving dtype;
   * else the GGUF blocks as they are in the file ([rows, K / E blocks], see gemm_quant), or
   * a group format (GPTQ / AWQ repacked, its scales / zeros / g_idx in *_q). */
  int32_t qkv_fmt, o_fmt, gu_fmt, down_fmt;
  model_qlinear_t qkv_q, o_q, gu_q, down_q;
  /* q/k/v kept apart in GGUF block types that differ: offsets and formats of each part */
  bool qkv_mixed;
  uint64_t qkv_pw[3];
  int32_t qkv_pf[3];
} model_layer_t;

struct kiln_model {
  /* cfg: this rank's view under tensor parallelism (num_heads, num_kv_heads and
   * intermediate_size divided over the ranks: what the forward, the activations and the KV
   * cache use); full: the checkpoint's config as it is (== cfg without TP). */
  kiln_model_config_t cfg, full;
  int32_t tp_size, tp_rank; /* 1, 0 without TP */
  int64_t tp_kv0;           /* first KV head of this rank (replicated: the one it shares) */
  kiln_model_options_t opt;
  bool fp8_xquant; /* [model] fp8_activations = dynamic: FP8 gemm_quant calls set x_quant */
  const kiln_hal_backend_t *be;
  kiln_hal_device_t *dev;
  kiln_hal_stream_t *stream;
  int32_t dtype;   /* serving dtype */
  size_t es;       /* its size in bytes */
  /* The KV cache ([cache] dtype): kiln_hal_kv_format_t, the caches' tensor dtype (the serving
   * dtype, or U8 for FP8) and element size; FP8: kv_scales[2 l] / [2 l + 1] are layer l's
   * k_scale / v_scale, kv_scales_found of them came from the checkpoint. */
  int32_t kv_format, kv_dtype;
  size_t kv_es;
  float *kv_scales;
  int64_t kv_scales_found;
  /* kiln_model_quantization: what the weights are, as loaded ("none" for a float model) */
  char quant_desc[256];
  int64_t max_len; /* rope table rows = longest sequence */

  kiln_hal_buffer_t *weights;
  uint64_t weight_bytes;
  uint64_t embed;      /* [V, H] */
  uint64_t final_norm; /* [H] */
  uint64_t lm_head;    /* [V, H] (== embed when tied, unless kept quantized) */
  int32_t lm_fmt;      /* kiln_hal_qfmt_t of lm_head: NONE = the serving dtype (model.c) */
  model_qlinear_t lm_q;
  model_layer_t *layers;

  kiln_hal_buffer_t *rope; /* [max_len, R] F32 */

  /* Activations, sized for opt.max_tokens rows; offsets in bytes into act. */
  kiln_hal_buffer_t *act;
  uint64_t x, resid, h, qkv, attn, gu, mlp, gather;
  kiln_hal_buffer_t *logits; /* [max_logits, V] F32 */

  /* Batch metadata: one I32 device buffer and its host staging (pinned when possible).
   * Offsets in elements. */
  kiln_hal_buffer_t *meta, *meta_pinned;
  int32_t *meta_host;
  bool meta_host_owned;
  int64_t meta_count;
  int64_t m_ids, m_pos, m_slots, m_seq_lens, m_qsl, m_bt, m_rows;
  bool in_flight; /* a forward's metadata copy may still read meta_host */

  /* The vision tower, NULL for text-only models (models/vision/vision.c). */
  struct kiln_vision *vis;

  /* M-RoPE (cfg.mrope): rows whose (t, h, w) positions differ get a second rope call with a
   * per-forward table of just those rows (mrope_tab [max_tokens, R] F32, staged in
   * mrope_host), built from rope_host, a host copy of the rope table. m_pos2 indexes it (-1:
   * the row is not one of them). */
  float *rope_host;
  float *mrope_host;
  kiln_hal_buffer_t *mrope_tab;
  int64_t m_pos2;

  /* Decode graphs (model.c, "Decode graphs"). graph_sizes is NULL when the model has none. */
  int32_t *graph_sizes; /* [num_graph_sizes] ascending padded batch sizes */
  int32_t num_graph_sizes;
  /* Multi-token decode graphs: query lengths 1..graph_max_q per sequence (1: decode only). A
   * KV cache's graph of query length q and size index i is graphs[(q - 1) * num_graph_sizes +
   * i]; num_graph_slots = graph_max_q * num_graph_sizes. */
  int32_t graph_max_q, num_graph_slots;
  bool graphs_failed; /* a capture failed: eager for good (warned once) */
  kiln_model_graph_stats_t gstats;
};

struct kiln_kv_cache {
  kiln_model_t *m;
  kiln_hal_buffer_t *buf;
  int32_t num_blocks, block_size;
  /* Blocks in the buffer: num_blocks, plus the scratch block (id num_blocks) when the model
   * has graphs. The scratch block is never written (padding rows have slot -1), so it stays
   * zero, and a padding row attends to one zero key. */
  int32_t pool_blocks;
  uint64_t cache_bytes;      /* one K (or V) cache of one layer: pool_blocks * NKV * BS * D * es */
  kiln_hal_graph_t **graphs; /* [m->num_graph_slots], NULL until captured; NULL: no graphs */
};

/* ---- the weight plan (model.c): checkpoint tensors scheduled into the weight buffer ------ */

/* One GPTQ / AWQ / FP8 Linear of the checkpoint (models/qlinear.c): its tensors, checked. */
typedef struct model_qpart model_qpart_t;

/* What an upload of a model_qpart_t writes (models/qlinear.c). */
typedef enum model_qwhat {
  MODEL_Q_CODES = 0, /* [N, row bytes] codes of the group format */
  MODEL_Q_SCALES,    /* F16 [N, G] (F32 for FP8) */
  MODEL_Q_ZEROS,     /* U8 [N, G] (none for FP8) */
  MODEL_Q_GIDX,      /* I32 [K] */
  MODEL_Q_WIDEN,     /* [N, K] dequantized, in the serving dtype */
} model_qwhat_t;

typedef struct model_upload {
  const kiln_weight_t *w;
  uint64_t dst; /* byte offset in the weight buffer */
  bool raw;     /* copy the tensor's bytes as they are (a quantized weight kept quantized) */
  const model_qpart_t *q; /* non-NULL: bytes generated from this GPTQ / AWQ Linear (w unused) */
  int32_t q_what;         /* model_qwhat_t */
  /* Tensor parallelism: sl_rows > 0 uploads only rows [sl_r0, sl_r0 + sl_rows) and columns
   * [sl_c0, sl_c0 + sl_ncols) of the 2-D (or 1-D: sl_cols 1) tensor of sl_cols columns. */
  int64_t sl_r0, sl_rows, sl_c0, sl_ncols, sl_cols;
} model_upload_t;

typedef struct model_plan {
  const char *path;
  const kiln_weights_t *src;
  int32_t dtype;
  size_t es;
  uint64_t size;  /* bytes so far */
  uint64_t qcaps; /* the device's KILN_HAL_CAP_QUANT bits when the backend has gemm_quant */
  const kiln_quant_config_t *quant; /* the checkpoint's quantization_config (method NONE: none) */
  model_upload_t *ups;
  size_t n, cap;
  model_qpart_t **qparts; /* owned (kiln_model_plan_free) */
  size_t n_qparts, cap_qparts;
  int64_t q_kept, q_widened; /* GPTQ / AWQ / FP8 Linears kept in a group format / widened */
  const char *q_widen_why;   /* why the last one was widened */
  const char *q_dense_why;   /* set while planning a Linear that must be dense: why */
  const char *fp8_widen_why; /* [model] fp8_weights: why FP8 Linears are widened, or NULL */
} model_plan_t;

/* Frees what a plan owns (ups, qparts). */
void kiln_model_plan_free(model_plan_t *p);

/* Opens the GPTQ / AWQ Linear `module` (its tensors module.qweight, .qzeros, .scales, .g_idx)
 * of out_features N and in_features K, checking every tensor's presence, dtype and shape
 * against p->quant (errors name the tensor); the part is owned by p. */
kiln_status_t kiln_qpart_open(model_plan_t *p, const char *module, int64_t N, int64_t K,
                               model_qpart_t **out);
/* Opens the FP8 Linear `module` (module.weight F8_E4M3 [N, K], its weight_scale or
 * weight_scale_inv as p->quant says, module.input_scale when static), checking every code (no
 * NaN), the scales' dtype, shape and finiteness; with [model] quantization = fp8
 * (fp8_scheme KILN_FP8_ON_THE_FLY) module.weight is a float tensor quantized at upload.
 * Errors name the tensor; the part is owned by p. */
kiln_status_t kiln_qpart_open_fp8(model_plan_t *p, const char *module, int64_t N, int64_t K,
                                  model_qpart_t **out);
/* The part's group count and group size, its g_idx (NULL when absent or k / group_size), and
 * its group format (KILN_HAL_QFMT_INT4_G / INT8_G / FP8_E4M3). */
int64_t kiln_qpart_groups(const model_qpart_t *q);
int32_t kiln_qpart_group_size(const model_qpart_t *q);
const int32_t *kiln_qpart_g_idx(const model_qpart_t *q);
int32_t kiln_qpart_format(const model_qpart_t *q);
/* Bytes an upload of `what` writes, and writing them into out (dtype: the serving dtype, for
 * MODEL_Q_WIDEN). */
uint64_t kiln_qpart_bytes(const model_qpart_t *q, int32_t what, int32_t dtype);
kiln_status_t kiln_qpart_write(const model_qpart_t *q, int32_t what, int32_t dtype, void *out);

/* Reserves room for a tensor of numel elements; returns its offset. */
uint64_t model_plan_reserve(model_plan_t *p, int64_t numel);
/* Whether the checkpoint has a tensor of that name. */
bool model_plan_has(const model_plan_t *p, const char *name);
/* Finds name with exactly this shape and schedules it at dst. A missing optional tensor leaves
 * *found false; a missing required one is an error naming it. */
kiln_status_t model_plan_tensor_nd(model_plan_t *p, const char *name, int ndim,
                                   const int64_t *shape, uint64_t dst, bool required, bool *found);
/* Reserves and plans a required [d0] (d1 == 0) or [d0, d1] tensor; its offset in *out_off. */
kiln_status_t model_plan_one(model_plan_t *p, const char *name, int64_t d0, int64_t d1,
                             uint64_t *out_off);
/* The rows of several [rows_i, cols] tensors stacked into one (fused QKV, gate+up; cols 0 for
 * vectors). When optional, either all parts exist or none (a mix is an error); *out_off is
 * MODEL_NO_TENSOR when none do. */
kiln_status_t model_plan_fused(model_plan_t *p, int n, char names[][160], const int64_t *rows,
                               int64_t cols, bool optional, uint64_t *out_off);

/* A linear weight made of n stacked [rows_i, cols] parts (as model_plan_fused, required):
 * kept quantized when every part has the same GGUF block type and the device runs gemm_quant
 * on it (*out_fmt = its kiln_hal_qfmt_t), else converted to the serving dtype
 * (*out_fmt = KILN_HAL_QFMT_NONE). With a GPTQ / AWQ quantization_config, a part whose module
 * has a .qweight (names[i] minus ".weight") is that Linear: kept in a group format (*out_q
 * says where its scales, zeros and g_idx went) when every part is one with the same groups and
 * g_idx and the device takes the format, else dequantized to the serving dtype at load. */
kiln_status_t model_plan_linear(model_plan_t *p, int n, char names[][160], const int64_t *rows,
                                int64_t cols, uint64_t *out_off, int32_t *out_fmt,
                                model_qlinear_t *out_q);

/* The vision tower (models/vision/vision.c): plans its weights after the decoder's, and frees
 * what it allocated (its scratch buffers) with the model. */
kiln_status_t vision_plan(kiln_model_t *m, model_plan_t *p);
void vision_free(kiln_model_t *m);

/* One pass of the forward, as llama_forward sees it: sizes only; the contents are in m->meta. */
typedef struct model_pass {
  int32_t num_tokens; /* T rows of activations */
  int32_t num_seqs;   /* S rows of block tables, seq_lens; S + 1 of query_start_loc */
  int32_t num_logits; /* R rows of logits (0: none) */
  int32_t bt_width;   /* elements per block-table row in m->meta */
  int32_t max_query_len, max_seq_len;
  bool gather;            /* logits rows come through m->m_rows; false: they are rows 0..R-1 */
  int32_t num_mrope_rows; /* rows of m->mrope_tab this pass uses (0: no second rope) */
  int32_t num_embeds;     /* embedding overrides (kiln_batch_t.embeds), eager only */
  const kiln_batch_embed_t *embeds;
} model_pass_t;

/* The forward pass of models/llama/llama.c, after the batch passed model_check_batch() and
 * its metadata was copied to m->meta (or, under graph capture, will be before each replay).
 * It issues HAL ops only: no copies to or from the host, no synchronisation, no allocation. */
kiln_status_t llama_forward(kiln_model_t *m, kiln_kv_cache_t *kv, const model_pass_t *p);

/* ---- tensor views over the model's buffers, shared by the architectures (llama/, vision/) -- */

/* A dense row-major [rows, cols] view with row stride ld (elements). */
static inline kiln_hal_tensor_t model_view2(kiln_hal_buffer_t *buf, uint64_t off, int32_t dt,
                                            int64_t rows, int64_t cols, int64_t ld) {
  kiln_hal_tensor_t t;
  memset(&t, 0, sizeof(t));
  t.buffer = buf;
  t.offset = off;
  t.dtype = dt;
  t.ndim = 2;
  t.shape[0] = rows;
  t.shape[1] = cols;
  t.stride[0] = ld;
  t.stride[1] = 1;
  return t;
}

/* [T, heads, D] with token stride ld (elements). */
static inline kiln_hal_tensor_t model_view3(kiln_hal_buffer_t *buf, uint64_t off, int32_t dt,
                                            int64_t T, int64_t heads, int64_t D, int64_t ld) {
  kiln_hal_tensor_t t = model_view2(buf, off, dt, T, heads, ld);
  t.ndim = 3;
  t.shape[2] = D;
  t.stride[1] = D;
  t.stride[2] = 1;
  return t;
}

/* A PyTorch Linear weight [N, K] row-major, seen as the GEMM's b = [K, N] column-major. */
static inline kiln_hal_tensor_t model_weight_t(const kiln_model_t *m, uint64_t off, int64_t K,
                                               int64_t N) {
  kiln_hal_tensor_t t = model_view2(m->weights, off, m->dtype, K, N, 1);
  t.stride[1] = K;
  return t;
}

/* A weight vector (a norm or a bias), or an absent tensor for MODEL_NO_TENSOR. */
static inline kiln_hal_tensor_t model_vec(const kiln_model_t *m, uint64_t off, int64_t n) {
  kiln_hal_tensor_t t;
  memset(&t, 0, sizeof(t));
  return off == MODEL_NO_TENSOR ? t : kiln_hal_tensor_make(m->weights, off, m->dtype, 1, &n);
}

#endif /* KILN_MODELS_MODEL_INTERNAL_H */
