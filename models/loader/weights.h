/* weights.h - a checkpoint's tensors, memory-mapped and never copied until conversion.
 *
 * Two loaders fill the same kiln_weights_t:
 *   - Hugging Face safetensors: <dir>/model.safetensors, or the shards listed by
 *     <dir>/model.safetensors.index.json. Each file is mmap'ed read-only; its JSON header is
 *     parsed and every tensor's byte range is checked against the file before use.
 *   - GGUF (v2 and v3): one file, mmap'ed; llama.cpp's tensor names are translated to Hugging
 *     Face's (blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight) and its metadata
 *     becomes a kiln_model_config_t (see gguf.h).
 * A tensor's shape is always given in Hugging Face's row-major order ([out, in] for a Linear
 * weight); GGUF's reversed ne[] is turned around at load.
 *
 * Conversion: kiln_weight_convert() turns any range of elements into a HAL float dtype
 * (F32, F16, BF16), dequantizing the GGUF block types (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K) on the
 * way, exactly as kiln/hal_quant.h defines them. Callers convert in chunks into a staging
 * buffer and upload; the mapped file is never copied whole. A block-quantized tensor can also
 * be uploaded as it is (its bytes) for a backend with a quantized GEMM (kiln_wtype_qfmt).
 *
 * Errors name the file and the tensor: "model-00002-of-00003.safetensors: tensor
 * model.layers.7.mlp.up_proj.weight: data [1048576, 2097152) lies beyond the end of the file
 * (1500000 bytes): the file is truncated".
 *
 * Ownership: kiln_weights_t owns its mappings; kiln_weight_t pointers and their strings are
 * borrowed from it until kiln_weights_free(). Thread-safety: immutable after open; any number
 * of threads may find/convert concurrently.
 */
#ifndef KILN_MODELS_WEIGHTS_H
#define KILN_MODELS_WEIGHTS_H

#include <stdbool.h>
#include <stdint.h>

#include "base/status.h"

typedef enum kiln_wtype {
  KILN_WTYPE_F32 = 0,
  KILN_WTYPE_F16 = 1,
  KILN_WTYPE_BF16 = 2,
  KILN_WTYPE_Q8_0 = 3, /* GGUF: blocks of 32 values, an f16 scale then 32 int8 (34 bytes) */
  KILN_WTYPE_Q4_0 = 4, /* GGUF block types, defined in kiln/hal_quant.h: 32 values, 18 bytes */
  KILN_WTYPE_Q4_K = 5, /* 256 values, 144 bytes */
  KILN_WTYPE_Q5_K = 6, /* 256 values, 176 bytes */
  KILN_WTYPE_Q6_K = 7, /* 256 values, 210 bytes */
  KILN_WTYPE_I32 = 8,  /* safetensors I32: GPTQ / AWQ packed codes, zeros, g_idx (never converted) */
  KILN_WTYPE_F8_E4M3 = 9,  /* safetensors F8_E4M3: FP8 weight codes, one byte each (never
                              converted: their scales are separate tensors, models/qlinear.c) */
  KILN_WTYPE_F8_E5M2 = 10, /* safetensors F8_E5M2: recognised only to be refused by name */
  KILN_WTYPE_COUNT = 11,
} kiln_wtype_t;

#define KILN_WEIGHT_MAX_DIMS 5 /* Conv3d weights (a vision tower's patch embedding) */

typedef struct kiln_weight {
  const char *name; /* Hugging Face name */
  int32_t type;     /* kiln_wtype_t */
  int32_t ndim;     /* 1..KILN_WEIGHT_MAX_DIMS; a 0-d safetensors tensor reads as [1] */
  int64_t shape[KILN_WEIGHT_MAX_DIMS]; /* row-major, outermost first */
  int64_t numel;
  const uint8_t *data; /* inside the mapping; not necessarily aligned (a safetensors header
                          has any length): read it with memcpy or kiln_weight_convert() */
  uint64_t nbytes;
  const char *file; /* the path of the file that holds it, for messages */
} kiln_weight_t;

typedef struct kiln_weights kiln_weights_t;

/* Opens <dir>/model.safetensors.index.json if present (every shard it names must exist and
 * every tensor it lists must be found in the shard it names), else <dir>/model.safetensors.
 * Errors: KILN_ERR_NOT_FOUND (no weights file, a missing shard: named), KILN_ERR_IO,
 * KILN_ERR_INVALID_ARGUMENT (a malformed header or index, a truncated file, a dtype other than
 * F32/F16/BF16, I32, F8_E4M3 and F8_E5M2 — named with the tensor —, overlapping or out-of-range data offsets, a tensor
 * listed twice), KILN_ERR_OUT_OF_MEMORY. */
kiln_status_t kiln_weights_open_dir(const char *dir, kiln_weights_t **out_weights);

/* Opens one .safetensors file (same errors). */
kiln_status_t kiln_weights_open_safetensors(const char *path, kiln_weights_t **out_weights);

void kiln_weights_free(kiln_weights_t *w);

/* The tensor called name, or NULL. O(1). */
const kiln_weight_t *kiln_weights_find(const kiln_weights_t *w, const char *name);

int64_t kiln_weights_count(const kiln_weights_t *w);
const kiln_weight_t *kiln_weights_at(const kiln_weights_t *w, int64_t i);

/* Converts elements [first, first + n) of w (row-major element index) to dst_dtype
 * (KILN_HAL_F32/F16/BF16) at dst, rounding to nearest even. For a block type, first and n must
 * be multiples of its block (32 for Q8_0/Q4_0, 256 for the K-quants). Errors:
 * KILN_ERR_INVALID_ARGUMENT for a range outside the tensor, a range that is not whole blocks
 * or a non-float dst_dtype. */
kiln_status_t kiln_weight_convert(const kiln_weight_t *w, int64_t first, int64_t n,
                                  int32_t dst_dtype, void *dst);

/* "f32", "f16", "bf16", "q8_0", "q4_0", "q4_K", "q5_K", "q6_K", "i32", "f8_e4m3", "f8_e5m2". */
const char *kiln_wtype_name(int32_t type);

/* The HAL quantized format (KILN_HAL_QFMT_*) of a block type, KILN_HAL_QFMT_NONE for a float
 * type. */
int32_t kiln_wtype_qfmt(int32_t type);

/* Weights per block of type: 1 for the float types, 32 or 256 for the block types. */
int64_t kiln_wtype_block_elems(int32_t type);

/* Checks that w has exactly this shape; else an error naming the tensor, its file, the shape
 * found and the one expected ("... has shape [896, 4864], want [4864, 896]"). */
kiln_status_t kiln_weight_expect_shape(const kiln_weight_t *w, int ndim, const int64_t *shape);

#endif /* KILN_MODELS_WEIGHTS_H */
