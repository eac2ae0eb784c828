/* model.h - a loaded model on a device: weights uploaded once, a forward pass over the paged
 * KV cache, logits for the rows that need them.
 *
 *   kiln_model_load()        config + weights (HF directory or .gguf) -> device buffers
 *   kiln_model_kv_create()   a KV pool: per layer, K and V caches of [NB, NKV, BS, D]
 *   kiln_model_forward()     one flattened batch (prefill chunks and decodes mixed) -> logits
 *   kiln_model_read_logits() the logits rows, copied to the host
 *
 * One forward serves every batch shape: token ids, positions and slot mappings for T tokens,
 * and for S sequences their block tables, seq_lens (keys visible after this step) and
 * query_start_loc (which rows of T each owns), as in hal.h's attention op. Logits are computed
 * only for the listed rows (the last token of each sequence that samples this step, or every
 * row when scoring).
 *
 * Decode graphs: with options.graphs on a device with KILN_HAL_CAP_GRAPHS, a batch where every
 * sequence has one new token (T == S) and S (and its logits rows) <= the largest capture size
 * replays a device graph captured for the smallest capture size P that holds them, the batch
 * padded to P rows (logits: the first R of P rows, as kiln_model_logits reads). With
 * options.graph_max_query_len = Q > 1, a batch where every sequence has the same q <= Q new
 * tokens (contiguous rows) replays the graph of (q, P) the same way, P sequences of q rows and
 * up to min(q * P, max_logits) logits rows. Everything else runs eagerly. A graph is captured
 * lazily the first time its size is needed, or ahead of time by kiln_model_graphs_capture. Graphs
 * belong to the KV cache they were captured with. A capture the backend refuses turns graphs off
 * for the model (one warning) and the batch runs eagerly: graphs never change what a forward
 * returns, only how it is launched.
 *
 * The architecture (models/llama/) covers Llama 2/3/3.1, Mistral, Qwen2 and Qwen3 through the
 * config's flags. The model validates every batch on the host before any device work (token
 * ids within the vocabulary, positions within the rope table, slots and block ids within the
 * pool, consistent lengths), so bad metadata is an error, never an out-of-bounds access.
 *
 * Ownership: the model borrows the backend table, device and stream (they must outlive it)
 * and owns its buffers. A KV cache belongs to the model that created it and must be freed
 * before it. Thread-safety: none; one thread drives a model (the engine thread).
 */
#ifndef KILN_MODELS_MODEL_H
#define KILN_MODELS_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/status.h"
#include "kiln/hal.h"
#include "models/model_config.h"

typedef struct kiln_model kiln_model_t;

enum { KILN_FP8_WEIGHTS_AUTO = 0, KILN_FP8_WEIGHTS_KEEP = 1, KILN_FP8_WEIGHTS_WIDEN = 2 };
enum { KILN_FP8_ACT_NONE = 0, KILN_FP8_ACT_DYNAMIC = 1 };
enum { KILN_KV_DTYPE_AUTO = 0, KILN_KV_DTYPE_FP8_E4M3 = 1 };

typedef struct kiln_model_options {
  int32_t dtype;              /* serving dtype: KILN_HAL_F32/F16/BF16, or -1 = the checkpoint's */
  /* [model] quantization: KILN_QUANT_NONE (0: the checkpoint as it is) or KILN_QUANT_FP8 (a
   * float checkpoint's decoder Linears quantized to FP8 e4m3 at load, per-channel scales;
   * docs/models.md "FP8"). */
  int32_t quantization;
  /* [model] fp8_weights: what happens to FP8 Linear weights (checkpoints, or quantization =
   * fp8) on a device whose gemm_quant takes FP8_E4M3. KILN_FP8_WEIGHTS_AUTO (0): kept in FP8
   * on host-memory (CPU) devices, dequantized to the serving dtype at load on GPUs, whose
   * gemm_quant has no tensor-core FP8 path yet (prefill would run at CUDA-core speed); KEEP:
   * kept wherever the device takes them (half the bytes: a model that fits only in FP8);
   * WIDEN: always dequantized at load. */
  int32_t fp8_weights;
  /* [model] fp8_activations: KILN_FP8_ACT_NONE (0, weight-only) or KILN_FP8_ACT_DYNAMIC (the
   * kept FP8 Linears quantize each row of x to FP8 with its own scale: hal.h's x_quant). */
  int32_t fp8_activations;
  /* [cache] dtype: KILN_KV_DTYPE_AUTO (0: the KV cache in the serving dtype) or
   * KILN_KV_DTYPE_FP8_E4M3 (hal.h's FP8 KV cache, half the bytes of bf16: E4M3FN codes with a
   * static scale per layer for K and one for V, the checkpoint's k_scale / v_scale when it
   * has them, else 1.0; needs KILN_HAL_CAP_KV_FP8). */
  int32_t kv_dtype;
  int32_t max_tokens;         /* most tokens in one forward (sizes the activations) */
  int32_t max_seqs;           /* most sequences in one forward */
  int32_t max_blocks_per_seq; /* widest block table a forward takes */
  int32_t max_logits;         /* most logits rows in one forward; 0 = max_tokens */
  int64_t max_model_len;      /* 0 = the model's context (rope table rows) */
  bool allow_tf32;
  int32_t device_index; /* the index the device was opened with (for its caps) */
  /* Decode graphs ([graph] enabled; off when zeroed). Used only when the device has
   * KILN_HAL_CAP_GRAPHS and the backend the graph members. */
  bool graphs;
  /* Padded decode batch sizes to capture ([graph] capture_sizes), borrowed for the load only;
   * sizes above min(max_seqs, max_tokens, max_logits) are dropped, the rest sorted and
   * deduplicated. NULL/0 = 1, 2, 4, then multiples of 8 up to 256. */
  const int64_t *capture_sizes;
  int32_t num_capture_sizes;
  /* Multi-token decode graphs: the longest query per sequence a graph is kept for (0 or 1:
   * decode batches only). With q > 1, a batch where every sequence has the same q new tokens
   * (T == q * S, sequence s owning rows q*s..q*s+q-1: speculative decoding's verification and a
   * draft model's catch-up) and q <= graph_max_query_len replays a graph too (see "Decode
   * graphs" above). The engine sets it from [speculative] num_speculative_tokens. */
  int32_t graph_max_query_len;
  /* The most sequences a multi-token decode batch has (0 = max_seqs): graphs of query length
   * q > 1 are kept for the capture sizes up to the smallest one that holds them. */
  int32_t graph_query_max_seqs;
  /* Tensor parallelism ([parallel] tensor_parallel_size; docs/parallel.md). tp_size 0 or 1:
   * none. Else this model is rank tp_rank of tp_size: it loads only its shard (column-parallel
   * q/k/v and gate/up, row-parallel o_proj and down_proj, KV heads split or replicated when
   * num_kv_heads < tp_size; embedding, norms and lm_head replicated), its KV cache holds only
   * its KV heads, and each forward issues two all_reduce per layer on tp_comm (a communicator
   * of tp_size ranks on this model's device, borrowed: it must outlive the model). Every rank
   * must run the same forwards in the same order; each ends with the full logits. Graphs are
   * off under TP (see docs/parallel.md). Only the llama-family decoder, float safetensors. */
  int32_t tp_size, tp_rank;
  kiln_hal_comm_t *tp_comm;
} kiln_model_options_t;

/* Loads path: a directory holding config.json and safetensors (single or sharded), or a
 * .gguf file. Errors: everything the config and weight loaders report (naming the file and
 * tensor), a missing tensor or a tensor of the wrong shape (named with both shapes),
 * KILN_ERR_UNSUPPORTED for a dtype the device cannot compute in, device errors and
 * KILN_ERR_OUT_OF_MEMORY (with the bytes asked for). Nothing is leaked on failure. */
kiln_status_t kiln_model_load(const char *path, const kiln_hal_backend_t *backend,
                              kiln_hal_device_t *device, kiln_hal_stream_t *stream,
                              const kiln_model_options_t *options, kiln_model_t **out_model);
void kiln_model_free(kiln_model_t *m);

/* The folder a model's tokenizer.json would sit in: the directory itself, or a .gguf file's
 * folder ("." for a bare file name), written to buf. Looks only at the path, not the disk.
 * Errors: the path does not fit (KILN_ERR_INVALID_ARGUMENT, buf then empty). */
kiln_status_t kiln_model_tokenizer_dir(const char *model_path, char *buf, size_t size);

const kiln_model_config_t *kiln_model_get_config(const kiln_model_t *m);
int32_t kiln_model_dtype(const kiln_model_t *m);
/* Longest sequence the model takes (rope rows, capped by max_model_len). */
int64_t kiln_model_max_len(const kiln_model_t *m);
/* Whether the model takes 3-D M-RoPE positions (Qwen2-VL) / has a vision tower
 * (models/vision/vision.h). */
bool kiln_model_has_mrope(const kiln_model_t *m);
bool kiln_model_has_vision(const kiln_model_t *m);
/* Device bytes held by the weights. */
uint64_t kiln_model_weight_bytes(const kiln_model_t *m);
/* The KV cache's storage: "bf16", "f16", "f32" (the serving dtype) or "fp8_e4m3"; and, for
 * FP8, where its scales came from ("the checkpoint's k_scale / v_scale", "1.0 (the checkpoint
 * has no k_scale / v_scale)"); NULL for a float cache. */
const char *kiln_model_kv_dtype_name(const kiln_model_t *m);
const char *kiln_model_kv_scales_source(const kiln_model_t *m);
/* The weights' quantization as loaded: "none" for float weights; a checkpoint's or [model]
 * quantization's scheme (kiln_model_quant_describe) with how many Linears are kept quantized or
 * were dequantized at load, and FP8 activations when fp8_activations = dynamic applies; for a
 * GGUF file its quantized weight types and their counts ("gguf: Q4_K x 97, Q6_K x 16"). */
const char *kiln_model_quantization(const kiln_model_t *m);

/* ---- the paged KV cache ----------------------------------------------------------------- */

typedef struct kiln_kv_cache kiln_kv_cache_t;

/* Bytes one block takes across all layers (K and V) for this model and block size. */
uint64_t kiln_model_kv_block_bytes(const kiln_model_t *m, int32_t block_size);
/* Allocates num_blocks blocks of block_size tokens for every layer (one device buffer),
 * zeroed. When the model has decode graphs, one more block is allocated as the scratch block
 * the graphs' padding rows attend to; batches can never name it (block ids stay < num_blocks).
 * Errors: KILN_ERR_INVALID_ARGUMENT, KILN_ERR_OUT_OF_MEMORY (with the bytes). */
kiln_status_t kiln_model_kv_create(kiln_model_t *m, int32_t num_blocks, int32_t block_size,
                                   kiln_kv_cache_t **out_kv);
void kiln_kv_cache_free(kiln_kv_cache_t *kv);
int32_t kiln_kv_cache_num_blocks(const kiln_kv_cache_t *kv);
int32_t kiln_kv_cache_block_size(const kiln_kv_cache_t *kv);
/* Copies whole blocks src[i] -> dst[i] in every layer (copy-on-write). */
kiln_status_t kiln_kv_cache_copy_blocks(kiln_kv_cache_t *kv, const int32_t *src, const int32_t *dst,
                                        int32_t n);

/* ---- one forward pass -------------------------------------------------------------------- */

/* A run of batch rows whose input embeddings are given instead of looked up (a vision encoder's
 * output for an image's tokens): batch rows [row, row + count) take rows [first, first + count)
 * of src, copied after the embedding lookup. src: [N, H] in any float dtype (converted to the
 * serving dtype), row stride >= H, on the model's device; it must stay valid until the forward
 * has run (the next stream sync). */
typedef struct kiln_batch_embed {
  int32_t row, count, first;
  kiln_hal_tensor_t src;
} kiln_batch_embed_t;

typedef struct kiln_batch {
  int32_t num_tokens;             /* T */
  int32_t num_seqs;               /* S */
  const int32_t *token_ids;       /* [T] */
  const int32_t *positions;       /* [T] */
  const int32_t *slot_mapping;    /* [T] block_id * block_size + offset; < 0 = do not store */
  const int32_t *seq_lens;        /* [S] keys visible to each sequence after this step */
  const int32_t *query_start_loc; /* [S + 1] */
  const int32_t *block_tables;    /* [S, max_blocks_per_seq] row-major; unused entries any */
  int32_t max_blocks_per_seq;
  int32_t num_logits;         /* R: rows of logits wanted (may be 0) */
  const int32_t *logits_rows; /* [R] indices into [0, T) */
  /* Optional, zeroed = off. */
  /* M-RoPE models only (kiln_model_has_mrope): each row's rotary (t, h, w) positions, [3 * T]
   * (every row's t, then every row's h, then every row's w; see models/mrope.h). NULL: the
   * rotary position is `positions`. `positions` stays the row's place in the KV cache. */
  const int32_t *mrope_positions;
  int32_t num_embeds;               /* E: runs of rows with given input embeddings */
  const kiln_batch_embed_t *embeds; /* [E], by ascending row, not overlapping */
} kiln_batch_t;

/* Runs the model on one batch and leaves float32 logits [R, V] on the device (read them with
 * kiln_model_read_logits or use kiln_model_logits for device-side sampling). Enqueues work on
 * the stream and returns without waiting (except for the one host-to-device copy of the
 * metadata, which is staged). Errors: invalid batch metadata (named: "batch: token 3 has
 * position 4100, beyond the rope table (4096)"), device errors. */
kiln_status_t kiln_model_forward(kiln_model_t *m, kiln_kv_cache_t *kv, const kiln_batch_t *b);

/* The logits of the last forward: a [rows, V] F32 view on the device. */
kiln_hal_tensor_t kiln_model_logits(const kiln_model_t *m, int32_t rows);
/* Waits for the stream and copies rows x V floats to out. */
kiln_status_t kiln_model_read_logits(kiln_model_t *m, int32_t rows, float *out);

/* One sequence's next n tokens (ids, at positions start .. start + n - 1) through its block
 * table of num_blocks entries, with logits for the last num_logits of them (rows 0 ..
 * num_logits - 1 of kiln_model_logits). Slots follow from the block table. The simple case of
 * kiln_model_forward, for tools and tests that drive one sequence. */
kiln_status_t kiln_model_forward_seq(kiln_model_t *m, kiln_kv_cache_t *kv,
                                     const int32_t *block_table, int32_t num_blocks,
                                     const int32_t *ids, int32_t start, int32_t n,
                                     int32_t num_logits);

/* ---- decode graphs ------------------------------------------------------------------------ */

/* Captures the decode graphs of kv that are not captured yet, smallest size first (query
 * length 1 at every size, then, size by size, the longer query lengths), until
 * budget_s seconds have gone by (checked before each capture; 0 = none); the rest are captured
 * when first needed. Returns the number of kv's graphs captured afterwards (0 when the model
 * has no graphs). A capture the backend refuses turns graphs off (one warning), never an
 * error. Runs no forward: it only records. */
int32_t kiln_model_graphs_capture(kiln_model_t *m, kiln_kv_cache_t *kv, double budget_s);

typedef struct kiln_model_graph_stats {
  int32_t num_sizes;      /* capture sizes kept (0: the model has no graphs) */
  int32_t max_size;       /* the largest; decode batches above it run eagerly */
  bool active;            /* graphs are in use (the model has them; no capture failed) */
  bool failed;            /* a capture failed: eager for good */
  int64_t captures;       /* graphs captured, over all KV caches */
  int64_t replays;        /* forwards that replayed a graph */
  int64_t padded_rows;    /* padding sequences those replays computed (q rows each) */
  int64_t eager_forwards; /* forwards that ran eagerly */
  int32_t max_query_len;  /* the longest query per sequence graphs are kept for (1: decode) */
  int64_t multi_replays;  /* replays of multi-token decode graphs (query length > 1) */
} kiln_model_graph_stats_t;

/* The graph counters since the load. */
void kiln_model_graph_stats(const kiln_model_t *m, kiln_model_graph_stats_t *out);

/* Convenience for tools and tests: scores one sequence of n tokens from position 0 in chunks
 * of at most chunk tokens (0 = all at once) over a fresh KV cache of block_size-token blocks,
 * writing the logits of every position to out[n * V]. */
kiln_status_t kiln_model_score(kiln_model_t *m, const int32_t *ids, int32_t n, int32_t chunk,
                               int32_t block_size, float *out);

#endif /* KILN_MODELS_MODEL_H */
