/* gguf.c - llama.cpp's GGUF files (v2, v3): metadata -> kiln_model_config_t, tensors -> the
 * same kiln_weights_t the safetensors loader fills, under Hugging Face names (see gguf.h).
 *
 * Layout (little endian): "GGUF", u32 version, u64 tensor_count, u64 metadata_kv_count, the
 * metadata entries (string key, u32 value type, value), the tensor infos (string name, u32
 * n_dims, u64 ne[n_dims] innermost first, u32 ggml type, u64 offset), padding up to
 * general.alignment, then the data. A string is a u64 length and that many bytes.
 *
 * The file is untrusted: every read is checked against the file size, counts against what the
 * remaining bytes could possibly hold (so a huge count cannot make us allocate or loop), arrays
 * against a nesting limit, and every tensor's range against the data region.
 */
#include "models/loader/gguf.h"

#include "kiln/hal.h"
#include "models/loader/gguf_internal.h"
#include "models/loader/weights_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_ALIGNMENT ((uint64_t)1 << 30)
#define GGUF_MAX_ARRAY_DEPTH 4
#define GGUF_MAX_NAME 1024 /* tensor names; llama.cpp's own limit is 64 */
#define GGUF_MAX_DIMS 4    /* ggml tensors have at most 4 dimensions */

/* Bytes of a fixed-size value type; 0 for string, array and unknown types. */
static uint64_t value_size(uint32_t type) {
  static const uint8_t sizes[GGUF_TYPE_COUNT] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
  return type < GGUF_TYPE_COUNT ? sizes[type] : 0;
}

static const char *value_type_name(uint32_t type) {
  static const char *const names[GGUF_TYPE_COUNT] = {"u8",  "i8",  "u16",  "i16",    "u32",
                                                     "i32", "f32", "bool", "string", "array",
                                                     "u64", "i64", "f64"};
  return type < GGUF_TYPE_COUNT ? names[type] : "unknown";
}

/* ggml's type ids, for naming the ones Kiln refuses. */
static const char *ggml_type_name(uint32_t type) {
  static const char *const names[] = {
      [0] = "f32",     [1] = "f16",      [2] = "q4_0",   [3] = "q4_1",    [6] = "q5_0",
      [7] = "q5_1",    [8] = "q8_0",     [9] = "q8_1",   [10] = "q2_K",   [11] = "q3_K",
      [12] = "q4_K",   [13] = "q5_K",    [14] = "q6_K",  [15] = "q8_K",   [16] = "iq2_xxs",
      [17] = "iq2_xs", [18] = "iq3_xxs", [19] = "iq1_s", [20] = "iq4_nl", [21] = "iq3_s",
      [22] = "iq2_s",  [23] = "iq4_xs",  [24] = "i8",    [25] = "i16",    [26] = "i32",
      [27] = "i64",    [28] = "f64",     [29] = "iq1_m", [30] = "bf16",   [34] = "tq1_0",
      [35] = "tq2_0",  [39] = "mxfp4",
  };
  if (type < sizeof(names) / sizeof(names[0]) && names[type]) return names[type];
  return "unknown";
}

/* ---- reading ---------------------------------------------------------------------------- */

typedef struct gguf_reader {
  const uint8_t *data;
  uint64_t size, pos;
  const char *file;
  const char *what; /* what is being read, for messages: "the header", "metadata entry 3" */
} gguf_reader_t;

static kiln_status_t rd_need(const gguf_reader_t *r, uint64_t n) {
  if (n <= r->size - r->pos) return NULL;
  return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "%s: %s needs %llu bytes at offset %llu, but the file ends at %llu: "
                          "the file is truncated",
                          r->file, r->what, (unsigned long long)n, (unsigned long long)r->pos,
                          (unsigned long long)r->size);
}

static kiln_status_t rd_array_truncated(const gguf_reader_t *r, uint64_t count) {
  return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "%s: %s: an array of %llu elements at offset %llu runs past the end of "
                          "the file (%llu bytes): the file is truncated or corrupt",
                          r->file, r->what, (unsigned long long)count, (unsigned long long)r->pos,
                          (unsigned long long)r->size);
}

static uint64_t load_le(const uint8_t *p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; i--) v = v << 8 | p[i];
  return v;
}

static kiln_status_t rd_u32(gguf_reader_t *r, uint32_t *out) {
  kiln_status_t st = rd_need(r, 4);
  if (st) return st;
  *out = (uint32_t)load_le(r->data + r->pos, 4);
  r->pos += 4;
  return NULL;
}

static kiln_status_t rd_u64(gguf_reader_t *r, uint64_t *out) {
  kiln_status_t st = rd_need(r, 8);
  if (st) return st;
  *out = load_le(r->data + r->pos, 8);
  r->pos += 8;
  return NULL;
}

/* A string: *out points into the file (not NUL-terminated). */
static kiln_status_t rd_str(gguf_reader_t *r, const char **out, uint64_t *out_len) {
  uint64_t len;
  kiln_status_t st = rd_u64(r, &len);
  if (st) return st;
  if (len > r->size - r->pos)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: %s: a string of %llu bytes at offset %llu runs past the end of "
                            "the file (%llu bytes): the file is truncated or corrupt",
                            r->file, r->what, (unsigned long long)len, (unsigned long long)r->pos,
                            (unsigned long long)r->size);
  *out = (const char *)r->data + r->pos;
  *out_len = len;
  r->pos += len;
  return NULL;
}

/* Steps over one value of the given type. */
static kiln_status_t rd_skip(gguf_reader_t *r, uint32_t type, int depth) {
  kiln_status_t st;
  uint64_t es = value_size(type);
  if (es) {
    st = rd_need(r, es);
    if (!st) r->pos += es;
    return st;
  }
  if (type == GGUF_STRING) {
    const char *s;
    uint64_t len;
    return rd_str(r, &s, &len);
  }
  if (type != GGUF_ARRAY)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: %s: unknown value type %u at offset %llu", r->file, r->what, type,
                            (unsigned long long)(r->pos - 4));
  if (depth >= GGUF_MAX_ARRAY_DEPTH)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: %s: arrays nested more than %d deep",
                            r->file, r->what, GGUF_MAX_ARRAY_DEPTH);
  uint32_t etype;
  uint64_t count;
  if ((st = rd_u32(r, &etype)) || (st = rd_u64(r, &count))) return st;
  es = value_size(etype);
  if (es) {
    if (count > (r->size - r->pos) / es) return rd_array_truncated(r, count);
    r->pos += count * es;
    return NULL;
  }
  if (etype != GGUF_STRING && etype != GGUF_ARRAY)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: %s: unknown array element type %u",
                            r->file, r->what, etype);
  /* Each element takes at least 8 bytes (a length or a count), so count is bounded by the file
   * before the loop runs. */
  if (count > (r->size - r->pos) / 8) return rd_array_truncated(r, count);
  for (uint64_t i = 0; i < count; i++) {
    st = rd_skip(r, etype, depth + 1);
    if (st) return st;
  }
  return NULL;
}

/* ---- metadata ------------------------------------------------------------------------------ */

typedef struct gguf_kv {
  const char *key; /* into the file */
  uint64_t key_len;
  uint32_t type;
  uint64_t pos; /* the value's offset, already checked to lie within the file */
} gguf_kv_t;

typedef struct gguf_tensor_info {
  const char *name; /* into the file */
  uint64_t name_len;
  uint32_t n_dims;
  int64_t ne[GGUF_MAX_DIMS];
  uint32_t type;
  uint64_t offset;
} gguf_tensor_info_t;

typedef struct gguf {
  const uint8_t *data;
  uint64_t size;
  const char *file;
  gguf_kv_t *kvs;
  uint64_t n_kv;
  char arch[32]; /* general.architecture, the prefix of the model keys */
} gguf_t;

static const gguf_kv_t *kv_find(const gguf_t *g, const char *key) {
  size_t len = strlen(key);
  for (uint64_t i = 0; i < g->n_kv; i++)
    if (g->kvs[i].key_len == len && memcmp(g->kvs[i].key, key, len) == 0) return &g->kvs[i];
  return NULL;
}

static kiln_status_t kv_missing(const gguf_t *g, const char *key) {
  return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: the metadata key %s is missing", g->file,
                          key);
}

static kiln_status_t kv_mistyped(const gguf_t *g, const gguf_kv_t *kv, const char *want) {
  return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "%s: the metadata key %.*s has type %s, want %s", g->file,
                          (int)kv->key_len, kv->key, value_type_name(kv->type), want);
}

/* An integer of any integer type; *out = dflt (and NULL) when absent and not required. */
static kiln_status_t kv_int(const gguf_t *g, const char *key, bool required, int64_t dflt,
                            int64_t *out) {
  *out = dflt;
  const gguf_kv_t *kv = kv_find(g, key);
  if (!kv) return required ? kv_missing(g, key) : NULL;
  const uint8_t *p = g->data + kv->pos;
  uint64_t u;
  switch (kv->type) {
    case GGUF_U8: *out = p[0]; return NULL;
    case GGUF_I8: *out = (int8_t)p[0]; return NULL;
    case GGUF_U16: *out = (int64_t)load_le(p, 2); return NULL;
    case GGUF_I16: *out = (int16_t)load_le(p, 2); return NULL;
    case GGUF_U32: *out = (int64_t)load_le(p, 4); return NULL;
    case GGUF_I32: *out = (int32_t)load_le(p, 4); return NULL;
    case GGUF_I64: *out = (int64_t)load_le(p, 8); return NULL;
    case GGUF_U64:
      u = load_le(p, 8);
      if (u > INT64_MAX)
        return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                                "%s: the metadata key %s is too large (%llu)", g->file, key,
                                (unsigned long long)u);
      *out = (int64_t)u;
      return NULL;
    default: return kv_mistyped(g, kv, "an integer");
  }
}

/* A number of any numeric type. */
static kiln_status_t kv_float(const gguf_t *g, const char *key, bool required, double dflt,
                              double *out) {
  *out = dflt;
  const gguf_kv_t *kv = kv_find(g, key);
  if (!kv) return required ? kv_missing(g, key) : NULL;
  const uint8_t *p = g->data + kv->pos;
  if (kv->type == GGUF_F32) {
    uint32_t u = (uint32_t)load_le(p, 4);
    float f;
    memcpy(&f, &u, 4);
    *out = f;
    return NULL;
  }
  if (kv->type == GGUF_F64) {
    uint64_t u = load_le(p, 8);
    memcpy(out, &u, 8);
    return NULL;
  }
  int64_t i;
  if (kv->type == GGUF_BOOL || value_size(kv->type) == 0) return kv_mistyped(g, kv, "a number");
  kiln_status_t st = kv_int(g, key, true, 0, &i);
  if (!st) *out = (double)i;
  return st;
}

/* A string (not NUL-terminated); *out = NULL when absent and not required. */
static kiln_status_t kv_str(const gguf_t *g, const char *key, bool required, const char **out,
                            uint64_t *out_len) {
  *out = NULL;
  *out_len = 0;
  const gguf_kv_t *kv = kv_find(g, key);
  if (!kv) return required ? kv_missing(g, key) : NULL;
  if (kv->type != GGUF_STRING) return kv_mistyped(g, kv, "a string");
  *out_len = load_le(g->data + kv->pos, 8);
  *out = (const char *)g->data + kv->pos + 8;
  return NULL;
}

/* "<arch>.<suffix>" */
static const char *arch_key(const gguf_t *g, char *buf, size_t cap, const char *suffix) {
  snprintf(buf, cap, "%s.%s", g->arch, suffix);
  return buf;
}

static kiln_status_t arch_int(const gguf_t *g, const char *suffix, bool required, int64_t dflt,
                              int64_t *out) {
  char key[128];
  return kv_int(g, arch_key(g, key, sizeof(key), suffix), required, dflt, out);
}

static kiln_status_t arch_float(const gguf_t *g, const char *suffix, bool required, double dflt,
                                double *out) {
  char key[128];
  return kv_float(g, arch_key(g, key, sizeof(key), suffix), required, dflt, out);
}

/* An integer metadata value that must fit an int32 field (token ids, windows, dims). */
static kiln_status_t check_i32(const gguf_t *g, const char *key, int64_t v, int64_t lo) {
  if (v >= lo && v <= INT32_MAX) return NULL;
  return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "%s: the metadata key %s is %lld, out of range", g->file, key,
                          (long long)v);
}

/* ---- tensor names ------------------------------------------------------------------------- */

typedef struct name_map {
  const char *gguf, *hf;
} name_map_t;

static const name_map_t top_names[] = {
    {"token_embd", "model.embed_tokens"},
    {"output_norm", "model.norm"},
    {"output", "lm_head"},
};

static const name_map_t layer_names[] = {
    {"attn_norm", "input_layernorm"},    {"ffn_norm", "post_attention_layernorm"},
    {"attn_q", "self_attn.q_proj"},      {"attn_k", "self_attn.k_proj"},
    {"attn_v", "self_attn.v_proj"},      {"attn_output", "self_attn.o_proj"},
    {"attn_q_norm", "self_attn.q_norm"}, {"attn_k_norm", "self_attn.k_norm"},
    {"ffn_gate", "mlp.gate_proj"},       {"ffn_up", "mlp.up_proj"},
    {"ffn_down", "mlp.down_proj"},
};

static const char *lookup_name(const name_map_t *map, size_t n, const char *s, size_t len) {
  for (size_t i = 0; i < n; i++)
    if (strlen(map[i].gguf) == len && memcmp(map[i].gguf, s, len) == 0) return map[i].hf;
  return NULL;
}

/* Writes the Hugging Face name of GGUF tensor name (NUL-terminated, < GGUF_MAX_NAME) into out
 * (cap >= GGUF_MAX_NAME + 64); a name with no counterpart is kept as it is. */
static void hf_name(const char *name, char *out, size_t cap) {
  const char *dot = strrchr(name, '.');
  if (dot && (strcmp(dot, ".weight") == 0 || strcmp(dot, ".bias") == 0)) {
    size_t base_len = (size_t)(dot - name);
    const char *hf =
        lookup_name(top_names, sizeof(top_names) / sizeof(top_names[0]), name, base_len);
    if (hf) {
      snprintf(out, cap, "%s%s", hf, dot);
      return;
    }
    if (strncmp(name, "blk.", 4) == 0) {
      const char *num = name + 4, *p = num;
      while (*p >= '0' && *p <= '9') p++;
      /* Canonical layer numbers only ("blk.01" would not match any model's lookup anyway). */
      bool ok = p > num && *p == '.' && p < dot && !(num[0] == '0' && p - num > 1);
      hf = ok ? lookup_name(layer_names, sizeof(layer_names) / sizeof(layer_names[0]), p + 1,
                            (size_t)(dot - p - 1))
              : NULL;
      if (hf) {
        snprintf(out, cap, "model.layers.%.*s.%s%s", (int)(p - num), num, hf, dot);
        return;
      }
    }
  }
  snprintf(out, cap, "%s", name);
}

/* ---- the config ------------------------------------------------------------------------- */

typedef struct gguf_arch {
  const char *name, *architecture;
  int32_t arch, rope_style;
  bool qkv_bias, qk_norm;
} gguf_arch_t;

static const gguf_arch_t archs[] = {
    /* llama.cpp permutes llama's q/k rows for its adjacent-pair rope: keep them, rope to match. */
    {"llama", "LlamaForCausalLM", KILN_ARCH_LLAMA, KILN_HAL_ROPE_INTERLEAVED, false, false},
    {"qwen2", "Qwen2ForCausalLM", KILN_ARCH_QWEN2, KILN_HAL_ROPE_NEOX, true, false},
    {"qwen3", "Qwen3ForCausalLM", KILN_ARCH_QWEN3, KILN_HAL_ROPE_NEOX, false, true},
};

/* Fills c from the metadata and the tensor set (which already holds every tensor but
 * rope_freqs, passed as freqs, or NULL). */
static kiln_status_t gguf_config(gguf_t *g, const kiln_weights_t *w, const kiln_weight_t *freqs,
                                 kiln_model_config_t *c) {
  kiln_status_t st;
  char key[128];
  const char *s;
  uint64_t len;
  if ((st = kv_str(g, "general.architecture", true, &s, &len))) return st;
  const gguf_arch_t *a = NULL;
  for (size_t i = 0; i < sizeof(archs) / sizeof(archs[0]); i++)
    if (s && strlen(archs[i].name) == len && memcmp(archs[i].name, s, len) == 0) a = &archs[i];
  if (!a)
    return kiln_status_make(KILN_ERR_UNSUPPORTED,
                            "%s: general.architecture \"%.*s\" is not supported (llama, qwen2, "
                            "qwen3)",
                            g->file, len > 64 ? 64 : (int)len, s);
  snprintf(g->arch, sizeof(g->arch), "%s", a->name);
  snprintf(c->architecture, sizeof(c->architecture), "%s", a->architecture);
  snprintf(c->model_type, sizeof(c->model_type), "%s", a->name);
  c->arch = a->arch;

  int64_t v;
  if ((st = arch_int(g, "context_length", true, 0, &c->max_position_embeddings)) ||
      (st = arch_int(g, "embedding_length", true, 0, &c->hidden_size)) ||
      (st = arch_int(g, "block_count", true, 0, &c->num_layers)) ||
      (st = arch_int(g, "feed_forward_length", true, 0, &c->intermediate_size)) ||
      (st = arch_int(g, "attention.head_count", true, 0, &c->num_heads)) ||
      (st = arch_int(g, "attention.head_count_kv", false, c->num_heads, &c->num_kv_heads)) ||
      (st = arch_float(g, "attention.layer_norm_rms_epsilon", true, 0, &c->rms_norm_eps)) ||
      (st = arch_float(g, "rope.freq_base", false, 10000.0, &c->rope.theta)))
    return st;
  int64_t head_dim = c->num_heads > 0 ? c->hidden_size / c->num_heads : 0;
  if ((st = arch_int(g, "attention.key_length", false, head_dim, &c->head_dim))) return st;
  if ((st = arch_int(g, "attention.value_length", false, c->head_dim, &v))) return st;
  if (v != c->head_dim)
    return kiln_status_make(KILN_ERR_UNSUPPORTED,
                            "%s: %s.attention.value_length %lld differs from key_length %lld, "
                            "which Kiln does not run",
                            g->file, g->arch, (long long)v, (long long)c->head_dim);
  if ((st = arch_int(g, "rope.dimension_count", false, c->head_dim, &v)) ||
      (st = check_i32(g, arch_key(g, key, sizeof(key), "rope.dimension_count"), v, 0)))
    return st;
  c->rope.rotary_dim = (int32_t)v;

  const kiln_weight_t *embed = kiln_weights_find(w, "model.embed_tokens.weight");
  if (!embed)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: the tensor token_embd.weight is missing", g->file);
  if ((st = arch_int(g, "vocab_size", false, embed->shape[0], &c->vocab_size))) return st;
  switch (embed->type) {
    case KILN_WTYPE_F32: c->dtype = KILN_HAL_F32; break;
    case KILN_WTYPE_F16: c->dtype = KILN_HAL_F16; break;
    default: c->dtype = KILN_HAL_BF16; break; /* BF16, and the block types dequantized */
  }

  if ((st = arch_int(g, "attention.sliding_window", false, 0, &v)) ||
      (st = check_i32(g, arch_key(g, key, sizeof(key), "attention.sliding_window"), v, INT64_MIN)))
    return st;
  if (v > 0) {
    c->sliding_window = (int32_t)v;
    for (int64_t i = 0; i < c->num_layers && i < KILN_MODEL_MAX_LAYERS; i++)
      c->layer_sliding[i] = 1;
  }

  /* Rope scaling. llama.cpp writes factor 0 for "none"; older files say rope.scale_linear. */
  c->rope.style = a->rope_style;
  c->rope.kind = KILN_ROPE_DEFAULT;
  c->rope.beta_fast = 32;
  c->rope.beta_slow = 1;
  c->rope.truncate = true;
  c->rope.original_max_position = c->max_position_embeddings;
  if ((st = arch_float(g, "rope.scaling.factor", false, 1.0, &c->rope.factor))) return st;
  if (c->rope.factor == 0) c->rope.factor = 1;
  if ((st = kv_str(g, arch_key(g, key, sizeof(key), "rope.scaling.type"), false, &s, &len)))
    return st;
  if (!s) {
    double lin;
    if ((st = arch_float(g, "rope.scale_linear", false, 1.0, &lin))) return st;
    if (lin != 1.0 && lin != 0) {
      c->rope.kind = KILN_ROPE_LINEAR;
      c->rope.factor = lin;
    }
  } else if (len == 4 && memcmp(s, "none", 4) == 0) {
    c->rope.factor = 1;
  } else if (len == 6 && memcmp(s, "linear", 6) == 0) {
    c->rope.kind = KILN_ROPE_LINEAR;
  } else if (len == 4 && memcmp(s, "yarn", 4) == 0) {
    c->rope.kind = KILN_ROPE_YARN;
    if ((st = arch_int(g, "rope.scaling.original_context_length", false, c->max_position_embeddings,
                       &c->rope.original_max_position)))
      return st;
  } else {
    return kiln_status_make(KILN_ERR_UNSUPPORTED,
                            "%s: %s.rope.scaling.type \"%.*s\" is not supported (none, linear, "
                            "yarn)",
                            g->file, g->arch, len > 64 ? 64 : (int)len, s);
  }
  if (freqs) {
    int64_t want = c->rope.rotary_dim / 2;
    if (freqs->type != KILN_WTYPE_F32 || freqs->ndim != 1 || freqs->numel != want ||
        want > KILN_ROPE_MAX_FREQS)
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s: tensor rope_freqs.weight is %s with %lld elements, want f32 "
                              "with rotary_dim / 2 = %lld (at most %d)",
                              g->file, kiln_wtype_name(freqs->type), (long long)freqs->numel,
                              (long long)want, KILN_ROPE_MAX_FREQS);
    memcpy(c->rope.freq_factors, freqs->data, (size_t)want * sizeof(float));
    c->rope.n_freq_factors = (int32_t)want;
  }

  c->bos_token_id = -1;
  c->pad_token_id = -1;
  if ((st = kv_int(g, "tokenizer.ggml.bos_token_id", false, -1, &v)) ||
      (st = check_i32(g, "tokenizer.ggml.bos_token_id", v, -1)))
    return st;
  c->bos_token_id = (int32_t)v;
  /* End of sequence, plus llama.cpp's end-of-turn and end-of-message ids (Llama 3 instruct
   * ends its turns with <|eot_id|>, which generation_config.json lists as an eos id). */
  static const char *const eos_keys[] = {
      "tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"};
  for (size_t i = 0; i < sizeof(eos_keys) / sizeof(eos_keys[0]); i++) {
    if ((st = kv_int(g, eos_keys[i], false, -1, &v)) || (st = check_i32(g, eos_keys[i], v, -1)))
      return st;
    bool dup = false;
    for (int32_t j = 0; j < c->num_eos; j++) dup |= c->eos_token_ids[j] == (int32_t)v;
    if (v >= 0 && !dup) c->eos_token_ids[c->num_eos++] = (int32_t)v;
  }

  c->hidden_act = KILN_HAL_ACT_SILU;
  c->tie_word_embeddings = kiln_weights_find(w, "lm_head.weight") == NULL;
  /* The flags the architecture implies, plus any the tensors show (a Llama with biases). */
  c->qkv_bias = a->qkv_bias || kiln_weights_find(w, "model.layers.0.self_attn.q_proj.bias");
  c->o_bias = kiln_weights_find(w, "model.layers.0.self_attn.o_proj.bias") != NULL;
  c->mlp_bias = kiln_weights_find(w, "model.layers.0.mlp.up_proj.bias") != NULL;
  c->qk_norm = a->qk_norm || kiln_weights_find(w, "model.layers.0.self_attn.q_norm.weight");
  return kiln_model_config_validate(c, g->file);
}

/* ---- the file ------------------------------------------------------------------------------ */

/* Reads the header and the metadata entries (g->data, size and file set; g->kvs allocated
 * here, freed by the caller even on error); *out_n_tensors and r->pos are left at the
 * tensor infos. */
static kiln_status_t read_meta(gguf_t *g, gguf_reader_t *r, uint64_t *out_n_tensors) {
  uint32_t version;
  uint64_t n_kv;
  kiln_status_t st;
  char what[96];
  if ((st = rd_need(r, 4))) return st;
  if (memcmp(g->data, "GGUF", 4) != 0) {
    return kiln_status_make(
        KILN_ERR_INVALID_ARGUMENT,
        "%s: not a GGUF file (it starts with %02x %02x %02x %02x, not \"GGUF\")", g->file,
        g->data[0], g->data[1], g->data[2], g->data[3]);
  }
  r->pos = 4;
  if ((st = rd_u32(r, &version))) return st;
  if (version != 2 && version != 3) {
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: GGUF version %u is not supported (only 2 and 3)", g->file,
                            version);
  }
  if ((st = rd_u64(r, out_n_tensors)) || (st = rd_u64(r, &n_kv))) return st;

  /* A metadata entry takes at least 13 bytes (key length, type, a 1-byte value). */
  if (n_kv > (g->size - r->pos) / 13) {
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: metadata_kv_count %llu cannot fit in a %llu-byte file: the file "
                            "is truncated or corrupt",
                            g->file, (unsigned long long)n_kv, (unsigned long long)g->size);
  }
  g->kvs = calloc(n_kv ? n_kv : 1, sizeof(*g->kvs));
  if (!g->kvs) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", g->file);
  r->what = what;
  for (uint64_t i = 0; i < n_kv; i++) {
    gguf_kv_t *kv = &g->kvs[i];
    snprintf(what, sizeof(what), "metadata entry %llu", (unsigned long long)i);
    if ((st = rd_str(r, &kv->key, &kv->key_len)) || (st = rd_u32(r, &kv->type))) return st;
    snprintf(what, sizeof(what), "metadata entry %llu (%.*s)", (unsigned long long)i,
             kv->key_len > 48 ? 48 : (int)kv->key_len, kv->key);
    kv->pos = r->pos;
    if ((st = rd_skip(r, kv->type, 0))) return st;
    g->n_kv = i + 1;
  }

  r->what = "the tensor infos";
  return NULL;
}

kiln_status_t kiln_gguf_open(const char *path, kiln_model_config_t *out_config,
                             kiln_weights_t **out_weights) {
  memset(out_config, 0, sizeof(*out_config));
  *out_weights = NULL;
  kiln_weights_t *w = NULL;
  gguf_tensor_info_t *infos = NULL;
  gguf_t g = {0};
  char what[96] = "the tensor infos";
  kiln_status_t st = weights_create(&w);
  if (st) goto done;
  if ((st = weights_map_file(w, path, &g.data, &g.size, &g.file))) goto done;
  gguf_reader_t r = {g.data, g.size, 0, g.file, "the header"};
  uint64_t n_tensors;
  if ((st = read_meta(&g, &r, &n_tensors))) goto done;
  r.what = what; /* "tensor info 3 (name)", set as each is read */

  /* A tensor info takes at least 24 bytes (name length, n_dims, type, offset). */
  if (n_tensors > (g.size - r.pos) / 24) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "%s: tensor_count %llu cannot fit in a %llu-byte file: the file is "
                          "truncated or corrupt",
                          g.file, (unsigned long long)n_tensors, (unsigned long long)g.size);
    goto done;
  }
  infos = calloc(n_tensors ? n_tensors : 1, sizeof(*infos));
  if (!infos) goto oom;
  for (uint64_t i = 0; i < n_tensors; i++) {
    gguf_tensor_info_t *ti = &infos[i];
    snprintf(what, sizeof(what), "tensor info %llu", (unsigned long long)i);
    if ((st = rd_str(&r, &ti->name, &ti->name_len))) goto done;
    if (ti->name_len == 0 || ti->name_len >= GGUF_MAX_NAME || memchr(ti->name, 0, ti->name_len)) {
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor info %llu: the name is empty, longer than %d bytes or "
                            "holds a NUL",
                            g.file, (unsigned long long)i, GGUF_MAX_NAME - 1);
      goto done;
    }
    snprintf(what, sizeof(what), "tensor info %llu (%.*s)", (unsigned long long)i,
             ti->name_len > 48 ? 48 : (int)ti->name_len, ti->name);
    if ((st = rd_u32(&r, &ti->n_dims))) goto done;
    if (ti->n_dims > GGUF_MAX_DIMS) {
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor %.*s has %u dimensions (at most %d)", g.file,
                            (int)ti->name_len, ti->name, ti->n_dims, GGUF_MAX_DIMS);
      goto done;
    }
    int64_t numel = 1;
    for (uint32_t d = 0; d < ti->n_dims; d++) {
      uint64_t ne;
      if ((st = rd_u64(&r, &ne))) goto done;
      if (ne > INT64_MAX || (ne > 0 && (uint64_t)numel > INT64_MAX / ne)) {
        st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s: tensor %.*s: ne[%u] = %llu is too large", g.file,
                              (int)ti->name_len, ti->name, d, (unsigned long long)ne);
        goto done;
      }
      ti->ne[d] = (int64_t)ne;
      numel *= (int64_t)ne;
    }
    if ((st = rd_u32(&r, &ti->type)) || (st = rd_u64(&r, &ti->offset))) goto done;
  }

  int64_t align = GGUF_DEFAULT_ALIGNMENT;
  if ((st = kv_int(&g, "general.alignment", false, GGUF_DEFAULT_ALIGNMENT, &align))) goto done;
  if (align <= 0 || (uint64_t)align > GGUF_MAX_ALIGNMENT || (align & (align - 1))) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "%s: general.alignment %lld is not a power of two up to 2^30", g.file,
                          (long long)align);
    goto done;
  }
  /* r.pos <= size < 2^63, so rounding up cannot overflow. */
  uint64_t data_start = (r.pos + (uint64_t)align - 1) & ~((uint64_t)align - 1);
  uint64_t data_size = data_start <= g.size ? g.size - data_start : 0;

  const kiln_weight_t *freqs = NULL;
  kiln_weight_t freqs_w;
  for (uint64_t i = 0; i < n_tensors; i++) {
    const gguf_tensor_info_t *ti = &infos[i];
    char name[GGUF_MAX_NAME], hf[GGUF_MAX_NAME + 64];
    memcpy(name, ti->name, ti->name_len);
    name[ti->name_len] = '\0';
    int32_t type;
    switch (ti->type) {
      case 0: type = KILN_WTYPE_F32; break;
      case 1: type = KILN_WTYPE_F16; break;
      case 2: type = KILN_WTYPE_Q4_0; break;
      case 8: type = KILN_WTYPE_Q8_0; break;
      case 12: type = KILN_WTYPE_Q4_K; break;
      case 13: type = KILN_WTYPE_Q5_K; break;
      case 14: type = KILN_WTYPE_Q6_K; break;
      case 30: type = KILN_WTYPE_BF16; break;
      default:
        st = kiln_status_make(KILN_ERR_UNSUPPORTED,
                              "%s: tensor %s has ggml type %u (%s), which Kiln does not run "
                              "(only f32, f16, bf16, q8_0, q4_0, q4_K, q5_K and q6_K)",
                              g.file, name, ti->type, ggml_type_name(ti->type));
        goto done;
    }
    int ndim = ti->n_dims ? (int)ti->n_dims : 1;
    int64_t shape[KILN_WEIGHT_MAX_DIMS] = {1}, numel = 1;
    for (int d = 0; d < (int)ti->n_dims; d++) {
      shape[d] = ti->ne[ti->n_dims - 1 - d]; /* ne[0] is innermost: Kiln's last dim */
      numel *= ti->ne[d];
    }
    const int64_t be = kiln_wtype_block_elems(type);
    if (be > 1 && (ti->n_dims == 0 || ti->ne[0] % be)) {
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor %s is %s, but its innermost dimension %lld is not a "
                            "multiple of %lld",
                            g.file, name, kiln_wtype_name(type),
                            (long long)(ti->n_dims ? ti->ne[0] : 1), (long long)be);
      goto done;
    }
    uint64_t nbytes = weights_type_nbytes(type, numel);
    if (ti->offset % (uint64_t)align) {
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor %s: offset %llu is not a multiple of the alignment %lld",
                            g.file, name, (unsigned long long)ti->offset, (long long)align);
      goto done;
    }
    if (ti->offset > data_size || nbytes > data_size - ti->offset) {
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tensor %s: %llu bytes of data at offset %llu lie beyond the end "
                            "of the file (%llu bytes): the file is truncated",
                            g.file, name, (unsigned long long)nbytes,
                            (unsigned long long)(data_start + ti->offset),
                            (unsigned long long)g.size);
      goto done;
    }
    const uint8_t *tdata = g.data + data_start + ti->offset;
    if (strcmp(name, "rope_freqs.weight") == 0) {
      /* Rope frequency factors (Llama 3.1) belong to the config, not the weights. */
      freqs_w = (kiln_weight_t){.name = "rope_freqs.weight",
                                .type = type,
                                .ndim = ndim,
                                .numel = numel,
                                .data = tdata,
                                .nbytes = nbytes,
                                .file = g.file};
      memcpy(freqs_w.shape, shape, sizeof(shape));
      freqs = &freqs_w;
      continue;
    }
    hf_name(name, hf, sizeof(hf));
    if ((st = weights_add(w, hf, type, ndim, shape, tdata, nbytes, g.file))) goto done;
  }

  if ((st = gguf_config(&g, w, freqs, out_config))) goto done;
  *out_weights = w;
  w = NULL;
  goto done;
oom:
  st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
done:
  kiln_weights_free(w);
  free(infos);
  free(g.kvs);
  if (st) memset(out_config, 0, sizeof(*out_config));
  return st;
}

/* ---- metadata for other readers (gguf_internal.h) ------------------------------------------ */

struct gguf_meta {
  kiln_weights_t *w; /* owns the mapping */
  gguf_t g;
};

kiln_status_t gguf_meta_open(const char *path, gguf_meta_t **out) {
  *out = NULL;
  gguf_meta_t *m = calloc(1, sizeof(*m));
  if (!m) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
  kiln_status_t st = weights_create(&m->w);
  if (!st) st = weights_map_file(m->w, path, &m->g.data, &m->g.size, &m->g.file);
  if (!st) {
    gguf_reader_t r = {m->g.data, m->g.size, 0, m->g.file, "the header"};
    uint64_t n_tensors;
    st = read_meta(&m->g, &r, &n_tensors);
  }
  if (st) {
    gguf_meta_free(m);
    return st;
  }
  *out = m;
  return NULL;
}

void gguf_meta_free(gguf_meta_t *m) {
  if (!m) return;
  free(m->g.kvs);
  kiln_weights_free(m->w);
  free(m);
}

const char *gguf_meta_file(const gguf_meta_t *m) { return m->g.file; }

uint64_t gguf_meta_count(const gguf_meta_t *m) { return m->g.n_kv; }

const char *gguf_meta_key(const gguf_meta_t *m, uint64_t i, uint64_t *out_len) {
  *out_len = m->g.kvs[i].key_len;
  return m->g.kvs[i].key;
}

kiln_status_t gguf_meta_int(const gguf_meta_t *m, const char *key, bool required, int64_t dflt,
                            int64_t *out) {
  return kv_int(&m->g, key, required, dflt, out);
}

kiln_status_t gguf_meta_str(const gguf_meta_t *m, const char *key, bool required, const char **out,
                            uint64_t *out_len) {
  return kv_str(&m->g, key, required, out, out_len);
}

kiln_status_t gguf_meta_bool(const gguf_meta_t *m, const char *key, bool dflt, bool *out) {
  *out = dflt;
  const gguf_kv_t *kv = kv_find(&m->g, key);
  if (!kv) return NULL;
  if (kv->type != GGUF_BOOL) return kv_mistyped(&m->g, kv, "a bool");
  *out = m->g.data[kv->pos] != 0;
  return NULL;
}

kiln_status_t gguf_meta_array(const gguf_meta_t *m, const char *key, bool required, uint32_t etype,
                              gguf_meta_array_t *out) {
  memset(out, 0, sizeof(*out));
  const gguf_kv_t *kv = kv_find(&m->g, key);
  if (!kv) return required ? kv_missing(&m->g, key) : NULL;
  char want[48];
  snprintf(want, sizeof(want), "an array of %s", value_type_name(etype));
  if (kv->type != GGUF_ARRAY) return kv_mistyped(&m->g, kv, want);
  const uint8_t *p = m->g.data + kv->pos; /* u32 element type, u64 count: checked at parse */
  uint32_t have = (uint32_t)load_le(p, 4);
  /* Token types are i32 in llama.cpp's files; accept u32 the same. */
  bool ok = have == etype || (etype == GGUF_I32 && have == GGUF_U32);
  if (!ok)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: the metadata key %s is an array of %s, want %s", m->g.file, key,
                            value_type_name(have), want);
  out->count = load_le(p + 4, 8);
  out->etype = have;
  out->data = p + 12;
  return NULL;
}

const char *gguf_array_next_str(const uint8_t **p, uint64_t *out_len) {
  *out_len = load_le(*p, 8);
  const char *s = (const char *)*p + 8;
  *p += 8 + *out_len;
  return s;
}

uint32_t gguf_array_u32(const gguf_meta_array_t *a, uint64_t i) {
  return (uint32_t)load_le(a->data + 4 * i, 4);
}
