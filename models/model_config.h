/* model_config.h - a Llama-family model's shape and settings, read from a Hugging Face
 * config.json (+ generation_config.json) or from GGUF metadata, validated once.
 *
 * Every architecture Kiln runs through models/llama/ is one kiln_model_config_t: Llama 2/3/3.1,
 * Mistral, Qwen2 and Qwen3 differ only in the flags below. A checkpoint whose config asks for
 * something these flags cannot express (an unknown model_type or architecture, a rope scaling
 * type Kiln does not implement, a quantization_config, an activation other than silu/gelu...)
 * is refused at load with the offending key and value named: it is never run wrongly.
 *
 * Ownership: the struct is plain data (fixed arrays, no pointers); copy it freely.
 */
#ifndef KILN_MODELS_MODEL_CONFIG_H
#define KILN_MODELS_MODEL_CONFIG_H

#include <stdbool.h>
#include <stdint.h>

#include "base/json.h"
#include "base/status.h"

#define KILN_MODEL_MAX_LAYERS 512
#define KILN_MODEL_MAX_EOS 8
#define KILN_ROPE_MAX_FREQS 512 /* rotary_dim / 2 at most: head dims up to 1024 */

typedef enum kiln_arch {
  KILN_ARCH_LLAMA = 0,   /* LlamaForCausalLM, model_type "llama" */
  KILN_ARCH_MISTRAL = 1, /* MistralForCausalLM, "mistral" */
  KILN_ARCH_QWEN2 = 2,   /* Qwen2ForCausalLM, "qwen2" */
  KILN_ARCH_QWEN3 = 3,   /* Qwen3ForCausalLM, "qwen3" */
  /* Vision-language: a Qwen2 decoder with M-RoPE, plus a vision tower (kiln_vision_config_t) */
  KILN_ARCH_QWEN2_VL = 4,   /* Qwen2VLForConditionalGeneration, "qwen2_vl" */
  KILN_ARCH_QWEN2_5_VL = 5, /* Qwen2_5_VLForConditionalGeneration, "qwen2_5_vl" */
} kiln_arch_t;

typedef enum kiln_rope_kind {
  KILN_ROPE_DEFAULT = 0,
  KILN_ROPE_LINEAR = 1,  /* position interpolation: inv_freq / factor */
  KILN_ROPE_DYNAMIC = 2, /* NTK-aware base, fixed at max_position_embeddings (see rope.h) */
  KILN_ROPE_LLAMA3 = 3,  /* Llama 3.1's per-band smoothing */
  KILN_ROPE_YARN = 4,    /* YaRN ramp + attention factor */
} kiln_rope_kind_t;

typedef struct kiln_rope_config {
  int32_t kind;       /* kiln_rope_kind_t */
  int32_t style;      /* KILN_HAL_ROPE_NEOX (HF checkpoints) or _INTERLEAVED (GGUF "llama") */
  int32_t rotary_dim; /* head_dim * partial_rotary_factor; even, <= head_dim */
  double theta;       /* rope_theta (base) */
  double factor;      /* scaling factor (linear, dynamic, llama3, yarn); 1 when none */
  int64_t original_max_position; /* original_max_position_embeddings (llama3, yarn, dynamic) */
  double low_freq_factor, high_freq_factor; /* llama3 */
  double beta_fast, beta_slow;              /* yarn (defaults 32 and 1) */
  double attention_factor;                  /* yarn: 0 = derive: get_mscale(factor, mscale) /
                                               get_mscale(factor, mscale_all_dim) when both are set, else
                                               0.1 ln(factor) + 1 */
  double mscale, mscale_all_dim;            /* yarn (DeepSeek-style), 0 = unset */
  bool truncate;                            /* yarn: round the correction range (default true) */
  /* GGUF rope_freqs.weight: inv_freq[i] /= freq_factors[i]; n_freq_factors = 0 when absent. */
  int32_t n_freq_factors;
  float freq_factors[KILN_ROPE_MAX_FREQS];
} kiln_rope_config_t;

/* The vision tower of a Qwen2-VL / Qwen2.5-VL checkpoint ("vision_config"). */
typedef struct kiln_vision_config {
  bool present;
  int64_t depth;             /* blocks */
  int64_t embed_dim;         /* qwen2_vl embed_dim; qwen2_5_vl hidden_size */
  int64_t num_heads;         /* head_dim = embed_dim / num_heads, a multiple of 4 */
  int64_t intermediate_size; /* MLP width: int(embed_dim * mlp_ratio) (2-VL) or intermediate_size */
  int64_t out_hidden_size;   /* merger output = the text hidden_size (2-VL hidden_size, 2.5
                                out_hidden_size) */
  int64_t in_channels;       /* 3 */
  int64_t patch_size;        /* 14 */
  int64_t temporal_patch_size; /* 2 */
  int64_t spatial_merge_size;  /* 2 */
  int32_t hidden_act;          /* KILN_HAL_ACT_QUICK_GELU (2-VL) / _SILU (2.5, gated) ... */
  bool gated_mlp;           /* 2.5: gate/up/down with biases, RMSNorm; 2-VL: fc1/fc2, LayerNorm */
  int64_t window_size;      /* 2.5: in pixels (112); 0 = no windowed blocks */
  double tokens_per_second; /* 2.5 (videos only) */
  double rope_theta;   /* the 2-D rotary base: rope_parameters.rope_theta (transformers 5), 10000 */
  int32_t num_fullatt; /* 2.5 fullatt_block_indexes */
  int32_t fullatt_blocks[KILN_MODEL_MAX_LAYERS];
} kiln_vision_config_t;

/* quantization_config of a GPTQ, AWQ or FP8 checkpoint (docs/models.md "GPTQ and AWQ",
 * "FP8"), or [model] quantization = fp8 on a float checkpoint. */
typedef enum kiln_quant_method {
  KILN_QUANT_NONE = 0,
  KILN_QUANT_GPTQ = 1,
  KILN_QUANT_AWQ = 2,
  KILN_QUANT_FP8 = 3, /* e4m3 weights: compressed-tensors, block FP8, or on the fly */
} kiln_quant_method_t;

/* How an FP8 checkpoint scales its weights. */
typedef enum kiln_fp8_scheme {
  KILN_FP8_TENSOR = 0,  /* compressed-tensors strategy "tensor": weight_scale [1] or [] */
  KILN_FP8_CHANNEL = 1, /* compressed-tensors strategy "channel": weight_scale [N, 1] */
  KILN_FP8_BLOCK = 2,   /* blocks of block_n x block_k: [ceil(N / bn), ceil(K / bk)] */
  KILN_FP8_ON_THE_FLY = 3, /* [model] quantization = fp8: per-channel scales made at load */
} kiln_fp8_scheme_t;

#define KILN_QUANT_IGNORE_BYTES 4096

typedef struct kiln_quant_config {
  int32_t method;     /* kiln_quant_method_t */
  int32_t bits;       /* GPTQ 4 or 8, AWQ 4, FP8 8 */
  int32_t group_size; /* > 0, or -1: one group over all of K (GPTQ, AWQ) */
  bool desc_act;      /* GPTQ act-order: every quantized Linear needs its g_idx */
  bool sym;           /* GPTQ symmetric (the zeros are read from qzeros either way) */
  bool zero_minus_one; /* GPTQ checkpoint_format "gptq" (v1): qzeros hold z - 1 */
  /* FP8 */
  int32_t fp8_scheme;       /* kiln_fp8_scheme_t */
  int32_t block_n, block_k; /* KILN_FP8_BLOCK: weight_block_size / block_structure */
  bool scale_inv;           /* scales are module.weight_scale_inv (quant_method "fp8"), else
                               module.weight_scale (compressed-tensors) */
  bool act_static;          /* static activation scales: module.input_scale is read and
                               checked, not applied (weight-only FP8, docs/models.md) */
  bool act_quantized;       /* the checkpoint names an activation scheme (W8A8); Kiln runs
                               W8A16 either way */
  /* compressed-tensors kv_cache_scheme: 0 absent (or null), 1 FP8 ("type": "float",
   * "num_bits": 8: calibrated self_attn.k_scale / v_scale tensors), 2 another scheme; used by
   * [cache] dtype = fp8_e4m3 (models/model.c) */
  int32_t kv_cache_scheme;
  /* Modules left in the checkpoint's float dtype: compressed-tensors "ignore" / fp8's
   * modules_to_not_convert, n_ignore NUL-terminated entries one after another (a name, or
   * "re:" and a regular expression matched from the start of the module name). */
  int32_t n_ignore;
  char ignore[KILN_QUANT_IGNORE_BYTES];
} kiln_quant_config_t;

/* Whether the module (a Linear's name without ".weight") is in q's ignore list. */
bool kiln_quant_ignored(const kiln_quant_config_t *q, const char *module);

typedef struct kiln_model_config {
  char architecture[64]; /* "LlamaForCausalLM" (GGUF: derived from general.architecture) */
  char model_type[32];   /* "llama", "mistral", "qwen2", "qwen3", "qwen2_vl", "qwen2_5_vl" */
  int32_t arch;          /* kiln_arch_t */

  int64_t vocab_size;
  int64_t hidden_size;
  int64_t intermediate_size;
  int64_t num_layers;
  int64_t num_heads;
  int64_t num_kv_heads; /* num_key_value_heads; = num_heads when absent */
  int64_t head_dim;     /* explicit head_dim, else hidden_size / num_heads */
  int64_t max_position_embeddings;
  double rms_norm_eps;

  bool tie_word_embeddings; /* lm_head shares embed_tokens (no lm_head.weight needed) */
  bool qkv_bias;            /* q/k/v projections have biases (Qwen2; Llama attention_bias) */
  bool o_bias;              /* o_proj has a bias (Llama's and Qwen3's attention_bias) */
  bool mlp_bias;            /* gate/up/down have biases (Llama mlp_bias) */
  bool qk_norm;             /* per-head RMSNorm on q and k before rope (Qwen3) */
  int32_t hidden_act;       /* KILN_HAL_ACT_SILU / _GELU_TANH / _GELU */

  int32_t sliding_window;                       /* window for sliding layers; 0 = none */
  uint8_t layer_sliding[KILN_MODEL_MAX_LAYERS]; /* 1 = this layer uses sliding_window */

  kiln_rope_config_t rope;

  /* M-RoPE (Qwen2-VL): rotary frequency i < mrope_section[0] takes the temporal position,
   * then mrope_section[1] the height, mrope_section[2] the width; the three sum to
   * rotary_dim / 2. mrope false for text-only architectures. */
  bool mrope;
  int32_t mrope_section[3];
  kiln_vision_config_t vision;
  /* Vision special tokens from config.json (-1 when the model has none). */
  int32_t image_token_id, video_token_id, vision_start_token_id, vision_end_token_id;

  int32_t dtype; /* the checkpoint's torch_dtype / dtype as a KILN_HAL_* float dtype;
                    KILN_HAL_F32 when absent */
  kiln_quant_config_t quant; /* method KILN_QUANT_NONE without a quantization_config */

  /* Token ids; -1 when unknown. eos ids merge config.json and generation_config.json. */
  int32_t bos_token_id;
  int32_t pad_token_id;
  int32_t num_eos;
  int32_t eos_token_ids[KILN_MODEL_MAX_EOS];

  /* generation_config.json defaults; has_* false when the file or key is absent. */
  bool has_temperature, has_top_p, has_top_k, has_repetition_penalty, do_sample;
  double temperature, top_p, repetition_penalty;
  int32_t top_k;
} kiln_model_config_t;

/* "gptq 4-bit, group 128, asym, desc_act, v1" / "awq 4-bit, group 128" / "fp8 e4m3, per-channel
 * scales, ..." / "none" into buf. */
void kiln_model_quant_describe(const kiln_quant_config_t *q, char *buf, size_t size);

/* Fills *out from a parsed config.json object. name is used in messages ("<dir>/config.json").
 * Errors (KILN_ERR_INVALID_ARGUMENT unless noted): a missing or mistyped required key (names
 * the key and the type found); KILN_ERR_UNSUPPORTED for an unknown model_type / architecture,
 * an unknown or unimplemented rope scaling type, a quantization_config other than GPTQ
 * (4/8-bit, checkpoint_format gptq or gptq_v2) or AWQ (4-bit GEMM), an unsupported
 * hidden_act, and every other setting Kiln cannot run exactly. Calls
 * kiln_model_config_validate() before returning. */
kiln_status_t kiln_model_config_parse(const kiln_json_t *root, const char *name,
                                      kiln_model_config_t *out);

/* Merges generation_config.json (eos_token_id int or list, bos, pad, temperature, top_p,
 * top_k, repetition_penalty, do_sample) into cfg. */
kiln_status_t kiln_model_config_parse_generation(const kiln_json_t *root, const char *name,
                                                 kiln_model_config_t *cfg);

/* Reads <dir>/config.json and, when present, <dir>/generation_config.json.
 * Errors: KILN_ERR_NOT_FOUND when config.json is missing; as above otherwise. */
kiln_status_t kiln_model_config_load(const char *dir, kiln_model_config_t *out);

/* Consistency checks shared by every loader: positive sizes, num_heads % num_kv_heads == 0,
 * head_dim even and <= 1024, rotary_dim even and <= head_dim, num_layers <= MAX_LAYERS, eps > 0,
 * theta > 0, factors >= 1 where required... Messages name the field and its value. */
kiln_status_t kiln_model_config_validate(const kiln_model_config_t *c, const char *name);

/* "LlamaForCausalLM" etc. for an arch. */
const char *kiln_arch_name(int32_t arch);

#endif /* KILN_MODELS_MODEL_CONFIG_H */
