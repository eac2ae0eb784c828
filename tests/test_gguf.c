/* test_gguf.c - cmocka tests for models/loader/gguf: GGUF files written here (llama, qwen2,
 * qwen3 metadata; F32, F16, BF16 and Q8_0 tensors), the config and Hugging Face names they
 * become, Q8_0 dequantization against a reference, and malformed files: bad magic and
 * version, every truncation of a small file, unsupported types and architectures, misaligned
 * offsets, missing or mistyped metadata, absurd counts. */
#define _POSIX_C_SOURCE 200809L
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/json.h"
#include "base/strbuf.h"
#include "hal/loader.h"
#include "kiln/hal_quant.h"
#include "kiln/hal_util.h"
#include "models/loader/gguf.h"
#include "models/model.h"
#include "models/model_internal.h"
#include "models/loader/weights.h"
#include "models/model_tokenizer.h"
#include "test_backend.h"

/* ---- a temporary directory per test ---------------------------------------------------------- */

static char g_dir[64];
static char g_path[128]; /* g_dir/model.gguf */

static int make_dir(void **state) {
  (void)state;
  snprintf(g_dir, sizeof(g_dir), "/tmp/kiln_gguf_XXXXXX");
  if (!mkdtemp(g_dir)) return -1;
  snprintf(g_path, sizeof(g_path), "%s/model.gguf", g_dir);
  return 0;
}

static int remove_dir(void **state) {
  (void)state;
  unlink(g_path);
  return rmdir(g_dir);
}

static void write_bytes(const char *path, const void *data, size_t len) {
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  if (len) assert_int_equal(fwrite(data, 1, len, f), len);
  assert_int_equal(fclose(f), 0);
}

/* ---- random values ----------------------------------------------------------------------------
 */

static uint64_t g_rng = 88172645463325252ull;

static uint32_t rnd(void) {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return (uint32_t)(g_rng >> 16);
}

static float rnd_unit(void) { return (float)(rnd() & 0xffffff) / 16777216.0f * 2 - 1; }

/* ---- a GGUF writer ----------------------------------------------------------------------------
 */

enum {
  GT_U8 = 0,
  GT_I8 = 1,
  GT_U16 = 2,
  GT_I16 = 3,
  GT_U32 = 4,
  GT_I32 = 5,
  GT_F32 = 6,
  GT_BOOL = 7,
  GT_STRING = 8,
  GT_ARRAY = 9,
  GT_U64 = 10,
  GT_I64 = 11,
  GT_F64 = 12,
};
enum {
  GGML_F32 = 0,
  GGML_F16 = 1,
  GGML_Q4_0 = 2,
  GGML_Q8_0 = 8,
  GGML_Q2_K = 10,
  GGML_Q4_K = 12,
  GGML_BF16 = 30
};

#define GG_AUTO UINT64_MAX

typedef struct gg {
  kiln_strbuf_t kv, ti, data;
  uint64_t n_kv, n_t;
  uint32_t version;
  uint64_t align;   /* padding used by the writer (general.alignment is written separately) */
  const char *skip; /* a metadata key or tensor name to leave out */
} gg_t;

static void gg_init(gg_t *g) {
  memset(g, 0, sizeof(*g));
  g->version = 3;
  g->align = 32;
}

static void gg_free(gg_t *g) {
  kiln_strbuf_free(&g->kv);
  kiln_strbuf_free(&g->ti);
  kiln_strbuf_free(&g->data);
}

static void put(kiln_strbuf_t *b, const void *p, size_t n) {
  if (n) assert_true(kiln_strbuf_append(b, p, n));
}
static void put_le(kiln_strbuf_t *b, uint64_t v, int n) {
  uint8_t le[8];
  for (int i = 0; i < n; i++) le[i] = (uint8_t)(v >> (8 * i));
  put(b, le, (size_t)n);
}
static void put_str(kiln_strbuf_t *b, const char *s) {
  put_le(b, strlen(s), 8);
  put(b, s, strlen(s));
}

/* Starts a metadata entry; false when the key is the one to skip. */
static bool gg_key(gg_t *g, const char *key, uint32_t type) {
  if (g->skip && strcmp(g->skip, key) == 0) return false;
  put_str(&g->kv, key);
  put_le(&g->kv, type, 4);
  g->n_kv++;
  return true;
}

/* An integer of any integer type (written in that type's width). */
static void gg_int(gg_t *g, const char *key, uint32_t type, uint64_t v) {
  static const int width[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8};
  if (gg_key(g, key, type)) put_le(&g->kv, v, width[type]);
}
static void gg_u32(gg_t *g, const char *key, uint32_t v) { gg_int(g, key, GT_U32, v); }
static void gg_f32(gg_t *g, const char *key, float v) {
  if (gg_key(g, key, GT_F32)) put_le(&g->kv, kiln_hal_f32_to_bits(v), 4);
}
static void gg_f64(gg_t *g, const char *key, double v) {
  uint64_t u;
  memcpy(&u, &v, 8);
  if (gg_key(g, key, GT_F64)) put_le(&g->kv, u, 8);
}
static void gg_str(gg_t *g, const char *key, const char *s) {
  if (gg_key(g, key, GT_STRING)) put_str(&g->kv, s);
}

/* A tokenizer-like vocabulary: arrays of strings, floats and i32, which the loader steps over. */
static void gg_vocab(gg_t *g, int n) {
  if (gg_key(g, "tokenizer.ggml.tokens", GT_ARRAY)) {
    put_le(&g->kv, GT_STRING, 4);
    put_le(&g->kv, (uint64_t)n, 8);
    for (int i = 0; i < n; i++) {
      char tok[16];
      snprintf(tok, sizeof(tok), "<t%d>", i);
      put_str(&g->kv, tok);
    }
  }
  if (gg_key(g, "tokenizer.ggml.scores", GT_ARRAY)) {
    put_le(&g->kv, GT_F32, 4);
    put_le(&g->kv, (uint64_t)n, 8);
    for (int i = 0; i < n; i++) put_le(&g->kv, kiln_hal_f32_to_bits((float)-i), 4);
  }
  if (gg_key(g, "tokenizer.ggml.token_type", GT_ARRAY)) {
    put_le(&g->kv, GT_I32, 4);
    put_le(&g->kv, (uint64_t)n, 8);
    for (int i = 0; i < n; i++) put_le(&g->kv, 1, 4);
  }
}

/* Adds a tensor; offset GG_AUTO appends bytes (aligned) to the data and points at them. ne[0]
 * is innermost, as GGUF stores it. */
static void gg_tensor_at(gg_t *g, const char *name, uint32_t type, uint32_t n_dims,
                         const uint64_t *ne, const void *bytes, size_t nbytes, uint64_t offset) {
  if (g->skip && strcmp(g->skip, name) == 0) return;
  if (offset == GG_AUTO) {
    while (g->data.len % g->align) put(&g->data, "\0", 1);
    offset = g->data.len;
    put(&g->data, bytes, nbytes);
  }
  put_str(&g->ti, name);
  put_le(&g->ti, n_dims, 4);
  for (uint32_t i = 0; i < n_dims; i++) put_le(&g->ti, ne[i], 8);
  put_le(&g->ti, type, 4);
  put_le(&g->ti, offset, 8);
  g->n_t++;
}

static void gg_tensor(gg_t *g, const char *name, uint32_t type, uint32_t n_dims, const uint64_t *ne,
                      const void *bytes, size_t nbytes) {
  gg_tensor_at(g, name, type, n_dims, ne, bytes, nbytes, GG_AUTO);
}

/* The whole file (malloc'ed). */
static uint8_t *gg_bytes(gg_t *g, size_t *out_len) {
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  put(&b, "GGUF", 4);
  put_le(&b, g->version, 4);
  put_le(&b, g->n_t, 8);
  put_le(&b, g->n_kv, 8);
  put(&b, g->kv.data, g->kv.len);
  put(&b, g->ti.data, g->ti.len);
  while (b.len % g->align) put(&b, "\0", 1);
  put(&b, g->data.data, g->data.len);
  return (uint8_t *)kiln_strbuf_detach(&b, out_len);
}

static void gg_write(gg_t *g) {
  size_t len;
  uint8_t *bytes = gg_bytes(g, &len);
  write_bytes(g_path, bytes, len);
  free(bytes);
}

/* ---- tensor data -------------------------------------------------------------------------- */

/* When set, Q8_0 tensors are written as F32 holding their dequantized values (the same random
 * stream): the widened twin of a quantized file. */
static bool g_widen_q8;
/* When set, build_llama leaves out what kiln_model_load would refuse. */
static bool g_loadable;

/* n random values stored as type; *out_f32 gets them as f32 (exactly what the bytes hold). */
static void *make_data(uint32_t type, size_t n, float *out_f32, size_t *out_nbytes) {
  if (type == GGML_Q4_0 && g_widen_q8) { /* the widened twin of a Q4_0 tensor, like Q8_0's */
    float *f = malloc(n * sizeof(float));
    assert_non_null(f);
    g_widen_q8 = false;
    size_t nb;
    free(make_data(GGML_Q4_0, n, f, &nb));
    g_widen_q8 = true;
    if (out_f32) memcpy(out_f32, f, n * sizeof(float));
    *out_nbytes = n * sizeof(float);
    return f;
  }
  if (type == GGML_Q4_0) { /* random nibbles, a random finite f16 scale per block */
    assert_int_equal(n % 32, 0);
    uint8_t *q = malloc(n / 32 * 18);
    assert_non_null(q);
    for (size_t b = 0; b < n / 32; b++) {
      uint16_t d = kiln_hal_f32_to_f16(0.001f + fabsf(rnd_unit()) * 0.05f);
      memcpy(q + b * 18, &d, 2);
      for (int j = 0; j < 16; j++) q[b * 18 + 2 + j] = (uint8_t)(rnd() & 0xff);
      if (out_f32) kiln_hal_quant_dequant(KILN_HAL_QFMT_Q4_0, q + b * 18, out_f32 + b * 32);
    }
    *out_nbytes = n / 32 * 18;
    return q;
  }
  if (type == GGML_Q8_0 && g_widen_q8) {
    float *f = malloc(n * sizeof(float));
    assert_non_null(f);
    g_widen_q8 = false;
    size_t nb;
    free(make_data(GGML_Q8_0, n, f, &nb));
    g_widen_q8 = true;
    if (out_f32) memcpy(out_f32, f, n * sizeof(float));
    *out_nbytes = n * sizeof(float);
    return f;
  }
  if (type == GGML_Q8_0) {
    assert_int_equal(n % 32, 0);
    uint8_t *q = malloc(n / 32 * 34);
    assert_non_null(q);
    for (size_t b = 0; b < n / 32; b++) {
      uint16_t d = kiln_hal_f32_to_f16(0.001f + fabsf(rnd_unit()) * 0.05f);
      memcpy(q + b * 34, &d, 2);
      for (int j = 0; j < 32; j++) {
        int8_t v = (int8_t)(rnd() & 0xff);
        q[b * 34 + 2 + j] = (uint8_t)v;
        /* The reference: llama.cpp's dequantize_row_q8_0, y = GGML_FP16_TO_FP32(d) * q. */
        if (out_f32) out_f32[b * 32 + j] = kiln_hal_f16_to_f32(d) * (float)v;
      }
    }
    *out_nbytes = n / 32 * 34;
    return q;
  }
  size_t es = type == GGML_F32 ? 4 : 2;
  uint8_t *p = malloc(n * es);
  assert_non_null(p);
  for (size_t i = 0; i < n; i++) {
    float x = rnd_unit() * 4;
    if (type == GGML_F32) {
      memcpy(p + i * 4, &x, 4);
    } else {
      uint16_t h = type == GGML_F16 ? kiln_hal_f32_to_f16(x) : kiln_hal_f32_to_bf16(x);
      memcpy(p + i * 2, &h, 2);
      x = type == GGML_F16 ? kiln_hal_f16_to_f32(h) : kiln_hal_bf16_to_f32(h);
    }
    if (out_f32) out_f32[i] = x;
  }
  *out_nbytes = n * es;
  return p;
}

/* A tensor of random values; returns them as f32 (caller frees) when want_values. */
static float *add_random(gg_t *g, const char *name, uint32_t type, uint32_t n_dims,
                         const uint64_t *ne, bool want_values) {
  size_t n = 1, nbytes;
  for (uint32_t i = 0; i < n_dims; i++) n *= ne[i];
  float *vals = want_values ? malloc(n * sizeof(float)) : NULL;
  void *bytes = make_data(type, n, vals, &nbytes);
  gg_tensor(g, name, (type == GGML_Q8_0 || type == GGML_Q4_0) && g_widen_q8 ? GGML_F32 : type,
            n_dims, ne, bytes, nbytes);
  free(bytes);
  return vals;
}

/* ---- the models --------------------------------------------------------------------------- */

/* A tiny llama: hidden 64, 4 heads of 16, 2 kv heads, 2 layers, vocab 32. The values of
 * token_embd (f16), output (q8_0), blk.0.attn_q (bf16) and blk.1.ffn_down (q8_0) are kept. */
typedef struct llama_values {
  float *embd, *output, *attn_q, *ffn_down;
  float freqs[8];
} llama_values_t;

static void build_llama(gg_t *g, llama_values_t *vals) {
  gg_str(g, "general.architecture", "llama");
  gg_str(g, "general.name", "tiny llama");
  gg_u32(g, "llama.context_length", 256);
  gg_u32(g, "llama.embedding_length", 64);
  gg_u32(g, "llama.block_count", 2);
  gg_u32(g, "llama.feed_forward_length", 128);
  gg_u32(g, "llama.attention.head_count", 4);
  gg_u32(g, "llama.attention.head_count_kv", 2);
  gg_f32(g, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
  gg_f32(g, "llama.rope.freq_base", 500000.0f);
  gg_u32(g, "llama.rope.dimension_count", 16);
  gg_u32(g, "llama.vocab_size", 32);
  gg_str(g, "tokenizer.ggml.model", "gpt2");
  gg_vocab(g, 32);
  gg_u32(g, "tokenizer.ggml.bos_token_id", 1);
  gg_u32(g, "tokenizer.ggml.eos_token_id", 2);

  bool keep = vals != NULL;
  llama_values_t dummy;
  if (!vals) vals = &dummy;
  vals->embd = add_random(g, "token_embd.weight", GGML_F16, 2, (const uint64_t[]){64, 32}, keep);
  free(add_random(g, "output_norm.weight", GGML_F32, 1, (const uint64_t[]){64}, false));
  vals->output = add_random(g, "output.weight", GGML_Q8_0, 2, (const uint64_t[]){64, 32}, keep);
  for (int i = 0; i < 8; i++) vals->freqs[i] = 1.0f + (float)i;
  gg_tensor(g, "rope_freqs.weight", GGML_F32, 1, (const uint64_t[]){8}, vals->freqs,
            sizeof(vals->freqs));
  for (int l = 0; l < 2; l++) {
    char name[64];
#define LAYER(fmt) (snprintf(name, sizeof(name), "blk.%d." fmt, l), name)
    free(add_random(g, LAYER("attn_norm.weight"), GGML_F32, 1, (const uint64_t[]){64}, false));
    /* A loadable file's layer 1 has q, k and v in three block types (kept apart, llama.c). */
    const bool mixed = g_loadable && l == 1;
    float *q = add_random(g, LAYER("attn_q.weight"), mixed ? GGML_Q8_0 : GGML_BF16, 2,
                          (const uint64_t[]){64, 64}, keep && l == 0);
    if (l == 0) vals->attn_q = q;
    free(add_random(g, LAYER("attn_k.weight"), mixed ? GGML_Q4_0 : GGML_BF16, 2,
                    (const uint64_t[]){64, 32}, false));
    free(add_random(g, LAYER("attn_v.weight"), GGML_Q8_0, 2, (const uint64_t[]){64, 32}, false));
    free(
        add_random(g, LAYER("attn_output.weight"), GGML_F16, 2, (const uint64_t[]){64, 64}, false));
    free(add_random(g, LAYER("ffn_norm.weight"), GGML_F32, 1, (const uint64_t[]){64}, false));
    free(add_random(g, LAYER("ffn_gate.weight"), GGML_Q8_0, 2, (const uint64_t[]){64, 128}, false));
    free(add_random(g, LAYER("ffn_up.weight"), GGML_Q8_0, 2, (const uint64_t[]){64, 128}, false));
    float *down = add_random(g, LAYER("ffn_down.weight"), GGML_Q8_0, 2, (const uint64_t[]){128, 64},
                             keep && l == 1);
    if (l == 1) vals->ffn_down = down;
#undef LAYER
  }
  /* A lone q bias (the loader's business, not a model's: kiln_model_load wants all three). */
  if (!g_loadable) free(add_random(g, "blk.0.attn_q.bias", GGML_F32, 1, (const uint64_t[]){64}, false));
  free(add_random(g, "some.unknown.tensor", GGML_F32, 1, (const uint64_t[]){3}, false));
  if (!keep) {
    free(dummy.embd);
    free(dummy.output);
    free(dummy.attn_q);
    free(dummy.ffn_down);
  }
}

static void free_values(llama_values_t *v) {
  free(v->embd);
  free(v->output);
  free(v->attn_q);
  free(v->ffn_down);
}

/* A small qwen3 (or another architecture's name): every integer in a different integer type,
 * yarn scaling, a q8_0 embedding tied to the output, q/k norms, alignment 64. */
static void build_qwen3(gg_t *g, const char *arch) {
  char key[128];
#define K(suffix) (snprintf(key, sizeof(key), "%s." suffix, arch), key)
  g->align = 64;
  gg_str(g, "general.architecture", arch);
  gg_int(g, "general.alignment", GT_U32, 64);
  gg_int(g, K("context_length"), GT_U64, 4096);
  gg_int(g, K("embedding_length"), GT_I32, 64);
  gg_int(g, K("block_count"), GT_U16, 3);
  gg_int(g, K("feed_forward_length"), GT_I64, 96);
  gg_int(g, K("attention.head_count"), GT_U8, 4);
  gg_int(g, K("attention.head_count_kv"), GT_I16, 1);
  gg_int(g, K("attention.key_length"), GT_U32, 32);
  gg_int(g, K("attention.value_length"), GT_I8, 32);
  gg_f64(g, K("attention.layer_norm_rms_epsilon"), 1e-6);
  gg_f32(g, K("rope.freq_base"), 1000000.0f);
  gg_int(g, K("attention.sliding_window"), GT_U32, 1024);
  gg_str(g, K("rope.scaling.type"), "yarn");
  gg_f32(g, K("rope.scaling.factor"), 4.0f);
  gg_int(g, K("rope.scaling.original_context_length"), GT_U32, 1024);
  gg_int(g, "tokenizer.ggml.eos_token_id", GT_I32, 39);
  /* A nested array (allowed) and a bool, both stepped over. */
  if (gg_key(g, "test.nested", GT_ARRAY)) {
    put_le(&g->kv, GT_ARRAY, 4);
    put_le(&g->kv, 2, 8);
    for (int i = 0; i < 2; i++) {
      put_le(&g->kv, GT_U8, 4);
      put_le(&g->kv, 3, 8);
      put(&g->kv, "abc", 3);
    }
  }
  gg_int(g, "test.flag", GT_BOOL, 1);
#undef K
  free(add_random(g, "token_embd.weight", GGML_Q8_0, 2, (const uint64_t[]){64, 40}, false));
  free(add_random(g, "output_norm.weight", GGML_F32, 1, (const uint64_t[]){64}, false));
  free(add_random(g, "blk.0.attn_q.weight", GGML_F16, 2, (const uint64_t[]){64, 128}, false));
  free(add_random(g, "blk.0.attn_q_norm.weight", GGML_F32, 1, (const uint64_t[]){32}, false));
  free(add_random(g, "blk.0.attn_k_norm.weight", GGML_F32, 1, (const uint64_t[]){32}, false));
  free(add_random(g, "blk.2.ffn_up.bias", GGML_BF16, 1, (const uint64_t[]){96}, false));
}

/* ---- helpers for results ----------------------------------------------------------------------
 */

static kiln_weights_t *open_ok(kiln_model_config_t *cfg) {
  kiln_weights_t *w = NULL;
  kiln_status_t st = kiln_gguf_open(g_path, cfg, &w);
  if (st) fail_msg("kiln_gguf_open: %s", kiln_status_message(st));
  assert_non_null(w);
  return w;
}

/* Expects opening g_path to fail with code and a message holding every needle (NULL-ended). */
static void expect_open_error(kiln_status_code_t code, ...) {
  kiln_model_config_t cfg;
  kiln_weights_t *w = (kiln_weights_t *)(uintptr_t)1;
  kiln_status_t st = kiln_gguf_open(g_path, &cfg, &w);
  va_list ap;
  va_start(ap, code);
  const char *first = va_arg(ap, const char *);
  va_end(ap);
  if (!st) {
    kiln_weights_free(w);
    fail_msg("expected an error about \"%s\", got success", first ? first : "");
  }
  assert_null(w);
  const char *msg = kiln_status_message(st);
  if (kiln_status_code(st) != code)
    fail_msg("expected code %s, got %s: %s", kiln_status_code_name(code),
             kiln_status_code_name(kiln_status_code(st)), msg);
  va_start(ap, code);
  for (const char *needle; (needle = va_arg(ap, const char *));)
    if (!strstr(msg, needle)) fail_msg("message lacks \"%s\": %s", needle, msg);
  va_end(ap);
  if (!strstr(msg, "model.gguf")) fail_msg("message lacks the file name: %s", msg);
  kiln_status_free(st);
}

static const kiln_weight_t *expect_tensor(const kiln_weights_t *w, const char *name, int32_t type,
                                          int ndim, const int64_t *shape) {
  const kiln_weight_t *t = kiln_weights_find(w, name);
  if (!t) fail_msg("no tensor %s", name);
  assert_int_equal(t->type, type);
  kiln_status_t st = kiln_weight_expect_shape(t, ndim, shape);
  if (st) fail_msg("%s", kiln_status_message(st));
  assert_non_null(strstr(t->file, "model.gguf"));
  return t;
}

/* Converts all of t to each float dtype and compares with want (the f32 values) rounded with
 * hal_util.h. */
static void expect_values(const kiln_weight_t *t, const float *want) {
  int64_t n = t->numel;
  uint8_t *got = malloc((size_t)n * 4);
  assert_non_null(got);
  const int32_t dsts[] = {KILN_HAL_F32, KILN_HAL_F16, KILN_HAL_BF16};
  for (int d = 0; d < 3; d++) {
    kiln_status_t st = kiln_weight_convert(t, 0, n, dsts[d], got);
    if (st) fail_msg("%s", kiln_status_message(st));
    for (int64_t i = 0; i < n; i++) {
      float g = kiln_hal_load_f32(got, dsts[d], i);
      float r = kiln_hal_round_to(dsts[d], want[i]);
      if (memcmp(&g, &r, 4) != 0)
        fail_msg("%s -> %s: element %lld is %.9g, want %.9g", t->name, kiln_hal_dtype_name(dsts[d]),
                 (long long)i, (double)g, (double)r);
    }
  }
  free(got);
}

/* ---- tests ------------------------------------------------------------------------------------
 */

static void test_llama(void **state) {
  (void)state;
  gg_t g;
  gg_init(&g);
  llama_values_t vals;
  build_llama(&g, &vals);
  gg_write(&g);
  gg_free(&g);

  kiln_model_config_t c;
  kiln_weights_t *w = open_ok(&c);
  assert_string_equal(c.architecture, "LlamaForCausalLM");
  assert_string_equal(c.model_type, "llama");
  assert_int_equal(c.arch, KILN_ARCH_LLAMA);
  assert_int_equal(c.vocab_size, 32);
  assert_int_equal(c.hidden_size, 64);
  assert_int_equal(c.intermediate_size, 128);
  assert_int_equal(c.num_layers, 2);
  assert_int_equal(c.num_heads, 4);
  assert_int_equal(c.num_kv_heads, 2);
  assert_int_equal(c.head_dim, 16);
  assert_int_equal(c.max_position_embeddings, 256);
  assert_true(c.rms_norm_eps == (double)1e-5f);
  assert_false(c.tie_word_embeddings);
  assert_true(c.qkv_bias); /* blk.0.attn_q.bias is there */
  assert_false(c.o_bias);
  assert_false(c.mlp_bias);
  assert_false(c.qk_norm);
  assert_int_equal(c.hidden_act, KILN_HAL_ACT_SILU);
  assert_int_equal(c.sliding_window, 0);
  assert_int_equal(c.layer_sliding[0], 0);
  assert_int_equal(c.rope.kind, KILN_ROPE_DEFAULT);
  assert_int_equal(c.rope.style, KILN_HAL_ROPE_INTERLEAVED);
  assert_int_equal(c.rope.rotary_dim, 16);
  assert_true(c.rope.theta == 500000.0);
  assert_true(c.rope.factor == 1.0);
  assert_int_equal(c.rope.n_freq_factors, 8);
  for (int i = 0; i < 8; i++) assert_true(c.rope.freq_factors[i] == vals.freqs[i]);
  assert_int_equal(c.dtype, KILN_HAL_F16);
  assert_int_equal(c.bos_token_id, 1);
  assert_int_equal(c.pad_token_id, -1);
  assert_int_equal(c.num_eos, 1);
  assert_int_equal(c.eos_token_ids[0], 2);

  /* Hugging Face names, reversed shapes; rope_freqs is config, not a weight. */
  assert_int_equal(kiln_weights_count(w), 3 + 2 * 9 + 2);
  assert_null(kiln_weights_find(w, "rope_freqs.weight"));
  assert_null(kiln_weights_find(w, "token_embd.weight"));
  const kiln_weight_t *t;
  t = expect_tensor(w, "model.embed_tokens.weight", KILN_WTYPE_F16, 2, (const int64_t[]){32, 64});
  expect_values(t, vals.embd);
  expect_tensor(w, "model.norm.weight", KILN_WTYPE_F32, 1, (const int64_t[]){64});
  t = expect_tensor(w, "lm_head.weight", KILN_WTYPE_Q8_0, 2, (const int64_t[]){32, 64});
  assert_int_equal(t->nbytes, 32 * 64 / 32 * 34);
  expect_values(t, vals.output);
  t = expect_tensor(w, "model.layers.0.self_attn.q_proj.weight", KILN_WTYPE_BF16, 2,
                    (const int64_t[]){64, 64});
  expect_values(t, vals.attn_q);
  t = expect_tensor(w, "model.layers.1.mlp.down_proj.weight", KILN_WTYPE_Q8_0, 2,
                    (const int64_t[]){64, 128});
  expect_values(t, vals.ffn_down);
  const char *names[] = {"input_layernorm.weight",  "post_attention_layernorm.weight",
                         "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                         "self_attn.o_proj.weight", "mlp.gate_proj.weight",
                         "mlp.up_proj.weight"};
  for (int l = 0; l < 2; l++)
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
      char name[128];
      snprintf(name, sizeof(name), "model.layers.%d.%s", l, names[i]);
      if (!kiln_weights_find(w, name)) fail_msg("no tensor %s", name);
    }
  expect_tensor(w, "model.layers.0.self_attn.k_proj.weight", KILN_WTYPE_BF16, 2,
                (const int64_t[]){32, 64});
  expect_tensor(w, "model.layers.0.mlp.gate_proj.weight", KILN_WTYPE_Q8_0, 2,
                (const int64_t[]){128, 64});
  expect_tensor(w, "model.layers.0.self_attn.q_proj.bias", KILN_WTYPE_F32, 1,
                (const int64_t[]){64});
  expect_tensor(w, "some.unknown.tensor", KILN_WTYPE_F32, 1, (const int64_t[]){3});

  /* Q8_0 ranges: whole blocks only. */
  t = kiln_weights_find(w, "lm_head.weight");
  float part[64];
  assert_null(kiln_weight_convert(t, 32, 64, KILN_HAL_F32, part));
  for (int i = 0; i < 64; i++) assert_true(part[i] == vals.output[32 + i]);
  kiln_status_t st = kiln_weight_convert(t, 16, 32, KILN_HAL_F32, part);
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(kiln_status_message(st), "lm_head.weight"));
  kiln_status_free(st);
  st = kiln_weight_convert(t, 0, 48, KILN_HAL_F32, part);
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  kiln_status_free(st);
  st = kiln_weight_convert(t, 0, 32 * 65, KILN_HAL_F32, part);
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  kiln_status_free(st);
  kiln_weights_free(w);
  free_values(&vals);

  /* Version 2 reads the same; defaults fill what is left out. */
  gg_init(&g);
  g.version = 2;
  build_llama(&g, NULL);
  gg_write(&g);
  gg_free(&g);
  w = open_ok(&c);
  kiln_weights_free(w);
  const char *optional[] = {"llama.attention.head_count_kv",
                            "llama.rope.freq_base",
                            "llama.rope.dimension_count",
                            "llama.vocab_size",
                            "tokenizer.ggml.bos_token_id",
                            "tokenizer.ggml.eos_token_id",
                            "output.weight"};
  for (size_t i = 0; i < sizeof(optional) / sizeof(optional[0]); i++) {
    gg_init(&g);
    g.skip = optional[i];
    build_llama(&g, NULL);
    gg_write(&g);
    gg_free(&g);
    w = open_ok(&c);
    kiln_weights_free(w);
    switch (i) {
      case 0: assert_int_equal(c.num_kv_heads, 4); break;
      case 1: assert_true(c.rope.theta == 10000.0); break;
      case 2: assert_int_equal(c.rope.rotary_dim, 16); break;
      case 3: assert_int_equal(c.vocab_size, 32); break; /* token_embd's first dim */
      case 4: assert_int_equal(c.bos_token_id, -1); break;
      case 5: assert_int_equal(c.num_eos, 0); break;
      case 6: assert_true(c.tie_word_embeddings); break;
    }
  }
}

static void test_qwen3(void **state) {
  (void)state;
  gg_t g;
  gg_init(&g);
  build_qwen3(&g, "qwen3");
  gg_write(&g);
  gg_free(&g);
  kiln_model_config_t c;
  kiln_weights_t *w = open_ok(&c);
  assert_string_equal(c.architecture, "Qwen3ForCausalLM");
  assert_string_equal(c.model_type, "qwen3");
  assert_int_equal(c.arch, KILN_ARCH_QWEN3);
  assert_int_equal(c.max_position_embeddings, 4096);
  assert_int_equal(c.hidden_size, 64);
  assert_int_equal(c.num_layers, 3);
  assert_int_equal(c.intermediate_size, 96);
  assert_int_equal(c.num_heads, 4);
  assert_int_equal(c.num_kv_heads, 1);
  assert_int_equal(c.head_dim, 32); /* key_length, not hidden / heads */
  assert_int_equal(c.rope.rotary_dim, 32);
  assert_int_equal(c.vocab_size, 40); /* from token_embd */
  assert_true(c.rms_norm_eps == 1e-6);
  assert_true(c.rope.theta == 1e6);
  assert_int_equal(c.rope.style, KILN_HAL_ROPE_NEOX);
  assert_int_equal(c.rope.kind, KILN_ROPE_YARN);
  assert_true(c.rope.factor == 4.0);
  assert_int_equal(c.rope.original_max_position, 1024);
  assert_true(c.rope.beta_fast == 32 && c.rope.beta_slow == 1 && c.rope.truncate);
  assert_int_equal(c.rope.n_freq_factors, 0);
  assert_int_equal(c.sliding_window, 1024);
  for (int l = 0; l < 3; l++) assert_int_equal(c.layer_sliding[l], 1);
  assert_int_equal(c.layer_sliding[3], 0);
  assert_true(c.qk_norm);
  assert_false(c.qkv_bias);
  assert_true(c.tie_word_embeddings);
  assert_int_equal(c.dtype, KILN_HAL_BF16); /* q8_0 embeddings */
  assert_int_equal(c.bos_token_id, -1);
  assert_int_equal(c.num_eos, 1);
  assert_int_equal(c.eos_token_ids[0], 39);
  expect_tensor(w, "model.embed_tokens.weight", KILN_WTYPE_Q8_0, 2, (const int64_t[]){40, 64});
  expect_tensor(w, "model.layers.0.self_attn.q_norm.weight", KILN_WTYPE_F32, 1,
                (const int64_t[]){32});
  expect_tensor(w, "model.layers.0.self_attn.k_norm.weight", KILN_WTYPE_F32, 1,
                (const int64_t[]){32});
  expect_tensor(w, "model.layers.0.self_attn.q_proj.weight", KILN_WTYPE_F16, 2,
                (const int64_t[]){128, 64});
  expect_tensor(w, "model.layers.2.mlp.up_proj.bias", KILN_WTYPE_BF16, 1, (const int64_t[]){96});
  for (int64_t i = 0; i < kiln_weights_count(w); i++) /* data at multiples of 64 past the start */
    assert_int_equal((kiln_weights_at(w, i)->data - kiln_weights_at(w, 0)->data) % 64, 0);
  kiln_weights_free(w);

  /* The same metadata under qwen2: biases, not norms; linear scaling. */
  gg_init(&g);
  build_qwen3(&g, "qwen2");
  gg_write(&g);
  gg_free(&g);
  w = open_ok(&c);
  assert_string_equal(c.architecture, "Qwen2ForCausalLM");
  assert_int_equal(c.arch, KILN_ARCH_QWEN2);
  assert_true(c.qkv_bias);
  assert_true(c.qk_norm); /* the file has q_norm tensors */
  assert_int_equal(c.rope.style, KILN_HAL_ROPE_NEOX);
  kiln_weights_free(w);
}

static void test_rope_scaling(void **state) {
  (void)state;
  struct {
    const char *type; /* NULL: no scaling.type key */
    float factor;
    int32_t kind;
    double want_factor;
  } cases[] = {
      {"none", 0, KILN_ROPE_DEFAULT, 1},
      {"linear", 2, KILN_ROPE_LINEAR, 2},
      {"yarn", 8, KILN_ROPE_YARN, 8},
      {NULL, 0, KILN_ROPE_DEFAULT, 1},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    gg_t g;
    gg_init(&g);
    build_llama(&g, NULL);
    if (cases[i].type) gg_str(&g, "llama.rope.scaling.type", cases[i].type);
    if (cases[i].factor) gg_f32(&g, "llama.rope.scaling.factor", cases[i].factor);
    gg_write(&g);
    gg_free(&g);
    kiln_model_config_t c;
    kiln_weights_t *w = open_ok(&c);
    assert_int_equal(c.rope.kind, cases[i].kind);
    assert_true(c.rope.factor == cases[i].want_factor);
    if (cases[i].kind == KILN_ROPE_YARN) assert_int_equal(c.rope.original_max_position, 256);
    kiln_weights_free(w);
  }
  gg_t g;
  gg_init(&g);
  build_llama(&g, NULL);
  gg_str(&g, "llama.rope.scaling.type", "longrope");
  gg_write(&g);
  gg_free(&g);
  expect_open_error(KILN_ERR_UNSUPPORTED, "longrope", (const char *)NULL);
}

/* A small file whose every proper prefix must be refused. */
static uint8_t *small_file(size_t *out_len) {
  gg_t g;
  gg_init(&g);
  gg_str(&g, "general.architecture", "llama");
  gg_u32(&g, "llama.context_length", 64);
  gg_u32(&g, "llama.embedding_length", 32);
  gg_u32(&g, "llama.block_count", 1);
  gg_u32(&g, "llama.feed_forward_length", 64);
  gg_u32(&g, "llama.attention.head_count", 2);
  gg_f32(&g, "llama.attention.layer_norm_rms_epsilon", 1e-5f);
  gg_vocab(&g, 4);
  free(add_random(&g, "token_embd.weight", GGML_Q8_0, 2, (const uint64_t[]){32, 4}, false));
  float freqs[8] = {1, 1, 1, 1, 2, 2, 2, 2};
  gg_tensor(&g, "rope_freqs.weight", GGML_F32, 1, (const uint64_t[]){8}, freqs, sizeof(freqs));
  free(add_random(&g, "output_norm.weight", GGML_BF16, 1, (const uint64_t[]){32}, false));
  uint8_t *bytes = gg_bytes(&g, out_len);
  gg_free(&g);
  return bytes;
}

static void test_truncated(void **state) {
  (void)state;
  size_t len;
  uint8_t *bytes = small_file(&len);
  write_bytes(g_path, bytes, len);
  kiln_model_config_t c;
  kiln_weights_free(open_ok(&c));
  for (size_t n = 0; n < len; n++) {
    write_bytes(g_path, bytes, n);
    kiln_weights_t *w = (kiln_weights_t *)(uintptr_t)1;
    kiln_status_t st = kiln_gguf_open(g_path, &c, &w);
    if (!st) fail_msg("a file cut to %zu of %zu bytes opened", n, len);
    assert_null(w);
    assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
    if (!strstr(kiln_status_message(st), "model.gguf"))
      fail_msg("cut to %zu: %s", n, kiln_status_message(st));
    if (n >= 4 && !strstr(kiln_status_message(st), "truncated"))
      fail_msg("cut to %zu: %s", n, kiln_status_message(st));
    kiln_status_free(st);
  }
  free(bytes);
}

/* Random corruption of a small file: any result but a crash (ASan watches the reads). */
static void test_corrupt_bytes(void **state) {
  (void)state;
  size_t len;
  uint8_t *bytes = small_file(&len);
  uint8_t *copy = malloc(len);
  assert_non_null(copy);
  for (int iter = 0; iter < 400; iter++) {
    memcpy(copy, bytes, len);
    int flips = 1 + (int)(rnd() % 4);
    for (int k = 0; k < flips; k++) {
      size_t at = rnd() % len;
      copy[at] = (rnd() & 1) ? (uint8_t)rnd() : 0xff;
    }
    write_bytes(g_path, copy, len);
    kiln_model_config_t c;
    kiln_weights_t *w = NULL;
    kiln_status_t st = kiln_gguf_open(g_path, &c, &w);
    if (st) assert_null(w);
    kiln_status_free(st);
    kiln_weights_free(w);
  }
  free(copy);
  free(bytes);
}

static void write_llama_with(void (*edit)(gg_t *g), const char *skip) {
  gg_t g;
  gg_init(&g);
  g.skip = skip;
  build_llama(&g, NULL);
  g.skip = NULL; /* the edit may put back what was skipped, in another form */
  if (edit) edit(&g);
  gg_write(&g);
  gg_free(&g);
}

static void add_q2k(gg_t *g) {
  uint8_t zeros[84] = {0};
  gg_tensor(g, "blk.0.ffn_extra.weight", GGML_Q2_K, 2, (const uint64_t[]){256, 1}, zeros,
            sizeof(zeros));
}
static void add_q4k_bad_row(gg_t *g) {
  uint8_t zeros[288] = {0};
  gg_tensor(g, "blk.0.odd.weight", GGML_Q4_K, 2, (const uint64_t[]){128, 4}, zeros, sizeof(zeros));
}
static void add_misaligned(gg_t *g) {
  gg_tensor_at(g, "blk.0.misaligned.weight", GGML_F32, 1, (const uint64_t[]){4}, NULL, 0, 16);
}
static void add_beyond_eof(gg_t *g) {
  gg_tensor_at(g, "blk.0.far.weight", GGML_F32, 1, (const uint64_t[]){4}, NULL, 0, 1u << 30);
}
static void add_long_tail(gg_t *g) {
  gg_tensor_at(g, "blk.0.long.weight", GGML_F32, 2, (const uint64_t[]){1u << 20, 1u << 20}, NULL, 0,
               0);
}
static void add_huge_ne(gg_t *g) {
  gg_tensor_at(g, "blk.0.huge.weight", GGML_F32, 2, (const uint64_t[]){1ull << 40, 1ull << 40},
               NULL, 0, 0);
}
static void add_q8_bad_row(gg_t *g) {
  uint8_t zeros[68] = {0};
  gg_tensor(g, "blk.0.odd.weight", GGML_Q8_0, 2, (const uint64_t[]){48, 1}, zeros, sizeof(zeros));
}
static void add_5d(gg_t *g) {
  float z[1] = {0};
  gg_tensor(g, "blk.0.fived.weight", GGML_F32, 5, (const uint64_t[]){1, 1, 1, 1, 1}, z, 4);
}
static void add_dup(gg_t *g) {
  float z[64] = {0};
  gg_tensor(g, "output_norm.weight", GGML_F32, 1, (const uint64_t[]){64}, z, sizeof(z));
}
static void add_bad_alignment(gg_t *g) { gg_int(g, "general.alignment", GT_U32, 48); }
static void add_zero_alignment(gg_t *g) { gg_int(g, "general.alignment", GT_U32, 0); }
static void add_bad_value_type(gg_t *g) {
  if (gg_key(g, "test.weird", 13)) put_le(&g->kv, 0, 4);
}
static void add_deep_array(gg_t *g) {
  if (!gg_key(g, "test.deep", GT_ARRAY)) return;
  for (int i = 0; i < 8; i++) {
    put_le(&g->kv, GT_ARRAY, 4);
    put_le(&g->kv, 1, 8);
  }
  put_le(&g->kv, GT_U8, 4);
  put_le(&g->kv, 0, 8);
}
static void add_huge_array(gg_t *g) {
  if (!gg_key(g, "test.huge", GT_ARRAY)) return;
  put_le(&g->kv, GT_U64, 4);
  put_le(&g->kv, 1ull << 61, 8);
}
static void add_huge_string_array(gg_t *g) {
  if (!gg_key(g, "test.huge", GT_ARRAY)) return;
  put_le(&g->kv, GT_STRING, 4);
  put_le(&g->kv, UINT64_MAX, 8);
}
static void add_bad_freqs(gg_t *g) { /* 4 entries where rotary_dim 16 wants 8 */
  float f[4] = {1, 2, 3, 4};
  gg_tensor(g, "rope_freqs.weight", GGML_F32, 1, (const uint64_t[]){4}, f, sizeof(f));
}
static void add_value_length(gg_t *g) { gg_u32(g, "llama.attention.value_length", 8); }
static void add_string_block_count(gg_t *g) { gg_str(g, "llama.block_count", "two"); }
static void add_float_heads(gg_t *g) { gg_f32(g, "llama.attention.head_count", 4.0f); }
static void add_big_bos(gg_t *g) { gg_int(g, "tokenizer.ggml.bos_token_id", GT_U64, 1ull << 40); }
static void add_invalid_kv_heads(gg_t *g) { gg_u32(g, "llama.attention.head_count_kv", 3); }

static void test_errors(void **state) {
  (void)state;
  size_t len;
  uint8_t *bytes = small_file(&len);

  /* Magic and version. */
  memcpy(bytes, "GGUX", 4);
  write_bytes(g_path, bytes, len);
  expect_open_error(KILN_ERR_INVALID_ARGUMENT, "not a GGUF file", (const char *)NULL);
  memcpy(bytes, "GGUF", 4);
  for (uint32_t v = 0; v < 6; v++) {
    if (v == 2 || v == 3) continue;
    bytes[4] = (uint8_t)v;
    write_bytes(g_path, bytes, len);
    char want[32];
    snprintf(want, sizeof(want), "version %u", v);
    expect_open_error(KILN_ERR_INVALID_ARGUMENT, want, (const char *)NULL);
  }
  bytes[4] = 3;
  write_bytes(g_path, bytes, len);
  kiln_model_config_t c;
  kiln_weights_free(open_ok(&c));

  /* Absurd counts and lengths, patched into the header. */
  const struct {
    size_t at;
    uint64_t value;
    const char *needle;
  } patches[] = {
      {8, UINT64_MAX, "tensor_count"},
      {8, 1000, "tensor_count"},
      {16, UINT64_MAX, "metadata_kv_count"},
      {16, 1ull << 40, "metadata_kv_count"},
      {24, UINT64_MAX, "truncated"}, /* the first key's length */
      {24, 1000000, "truncated"},
  };
  for (size_t i = 0; i < sizeof(patches) / sizeof(patches[0]); i++) {
    uint8_t *copy = malloc(len);
    memcpy(copy, bytes, len);
    for (int k = 0; k < 8; k++) copy[patches[i].at + k] = (uint8_t)(patches[i].value >> (8 * k));
    write_bytes(g_path, copy, len);
    free(copy);
    expect_open_error(KILN_ERR_INVALID_ARGUMENT, patches[i].needle, (const char *)NULL);
  }
  free(bytes);

  /* Missing files. */
  kiln_weights_t *w = (kiln_weights_t *)(uintptr_t)1;
  kiln_status_t st = kiln_gguf_open("/nonexistent/kiln/model.gguf", &c, &w);
  assert_null(w);
  assert_int_equal(kiln_status_code(st), KILN_ERR_NOT_FOUND);
  kiln_status_free(st);
  write_bytes(g_path, "", 0);
  expect_open_error(KILN_ERR_INVALID_ARGUMENT, "truncated", (const char *)NULL);

  /* Tensors Kiln does not run, or whose data cannot be where they say. */
  write_llama_with(add_q2k, NULL);
  expect_open_error(KILN_ERR_UNSUPPORTED, "blk.0.ffn_extra.weight", "10", "q2_K",
                    (const char *)NULL);
  write_llama_with(add_q4k_bad_row, NULL);
  expect_open_error(KILN_ERR_INVALID_ARGUMENT, "blk.0.odd.weight", "q4_K", "128", "256",
                    (const char *)NULL);
  write_llama_with(add_misaligned, NULL);
  expect_open_error(KILN_ERR_INVALID_ARGUMENT, "blk.0.misaligned.weight", "16", "alignment",
                    (const char *)NULL);
  write_llama_with(add_beyond_eof, NULL);
  expect_open_error(KILN_ERR_INVALID_ARGUMENT, "blk.0.far.weight", "truncated", (const char *)NULL);
  write_llama_with(add_long_tail, NULL);
  expect_open_error(KILN_ERR_INVALID_ARGUMENT, "blk.0.long.weight", "truncated",
                    (const char *)NULL);
  write_llama_with(add_huge_ne, NULL);
  expect_open_error(KILN_ERR_INVALID_ARGUMENT, "blk.0.huge.weight", (const char *)NULL);
  write_llama_with(add_q8_bad_row, NULL);
  expect_open_error(KILN_ERR_INVALID_ARGUMENT, "blk.0.odd.weight", "32", (const char *)NULL);
  write_llama_with(add_5d, NULL);
  expect_open_error(KILN_ERR_INVALID_ARGUMENT, "blk.0.fived.weight", "5 dimensions",
                    (const char *)NULL);
  write_llama_with(add_dup, NULL);
  expect_open_error(KILN_ERR_INVALID_ARGUMENT, "model.norm.weight", "twice", (const char *)NULL);
  write_llama_with(add_bad_freqs, "rope_freqs.weight");
  expect_open_error(KILN_ERR_INVALID_ARGUMENT, "rope_freqs", (const char *)NULL);
  write_llama_with(NULL, "token_embd.weight");
  expect_open_error(KILN_ERR_INVALID_ARGUMENT, "token_embd.weight", (const char *)NULL);

  /* Metadata: alignment, value types, nesting, sizes. */
  write_llama_with(add_bad_alignment, NULL);
  expect_open_error(KILN_ERR_INVALID_ARGUMENT, "general.alignment", "48", (const char *)NULL);
  write_llama_with(add_zero_alignment, NULL);
  expect_open_error(KILN_ERR_INVALID_ARGUMENT, "general.alignment", (const char *)NULL);
  write_llama_with(add_bad_value_type, NULL);
  expect_open_error(KILN_ERR_INVALID_ARGUMENT, "test.weird", "13", (const char *)NULL);
  write_llama_with(add_deep_array, NULL);
  expect_open_error(KILN_ERR_INVALID_ARGUMENT, "test.deep", "nested", (const char *)NULL);
  write_llama_with(add_huge_array, NULL);
  expect_open_error(KILN_ERR_INVALID_ARGUMENT, "test.huge", (const char *)NULL);
  write_llama_with(add_huge_string_array, NULL);
  expect_open_error(KILN_ERR_INVALID_ARGUMENT, "test.huge", (const char *)NULL);
  write_llama_with(add_value_length, NULL);
  expect_open_error(KILN_ERR_UNSUPPORTED, "value_length", (const char *)NULL);
  write_llama_with(add_big_bos, NULL); /* the first bos_token_id wins: still fine */
  kiln_weights_free(open_ok(&c));

  /* Missing and mistyped keys; the config's own checks. */
  const char *required[] = {"general.architecture",
                            "llama.context_length",
                            "llama.embedding_length",
                            "llama.block_count",
                            "llama.feed_forward_length",
                            "llama.attention.head_count",
                            "llama.attention.layer_norm_rms_epsilon"};
  for (size_t i = 0; i < sizeof(required) / sizeof(required[0]); i++) {
    write_llama_with(NULL, required[i]);
    expect_open_error(KILN_ERR_INVALID_ARGUMENT, required[i], "missing", (const char *)NULL);
  }
  write_llama_with(add_string_block_count, "llama.block_count");
  expect_open_error(KILN_ERR_INVALID_ARGUMENT, "llama.block_count", "string", (const char *)NULL);
  write_llama_with(add_float_heads, "llama.attention.head_count");
  expect_open_error(KILN_ERR_INVALID_ARGUMENT, "llama.attention.head_count", "f32",
                    (const char *)NULL);
  write_llama_with(add_big_bos, "tokenizer.ggml.bos_token_id");
  expect_open_error(KILN_ERR_INVALID_ARGUMENT, "bos_token_id", (const char *)NULL);
  write_llama_with(add_invalid_kv_heads, "llama.attention.head_count_kv");
  expect_open_error(KILN_ERR_INVALID_ARGUMENT, "num_key_value_heads", (const char *)NULL);

  /* Architectures Kiln does not run. */
  const char *archs[] = {"gpt2", "llama4", "qwen", "falcon"};
  for (size_t i = 0; i < sizeof(archs) / sizeof(archs[0]); i++) {
    gg_t g;
    gg_init(&g);
    build_qwen3(&g, archs[i]);
    gg_write(&g);
    gg_free(&g);
    char want[32];
    snprintf(want, sizeof(want), "\"%s\"", archs[i]);
    expect_open_error(KILN_ERR_UNSUPPORTED, want, "general.architecture", (const char *)NULL);
  }
}

/* End to end through the CPU backend (or the GPU one KILN_TEST_BACKEND / KILN_TEST_BACKENDS
 * names, see tests/test_backend.h): the llama file's Q8_0 gate/up and down weights stay
 * quantized (gemm_quant, decode and prefill paths), and its logits match those of the same
 * file with every Q8_0 tensor written as F32 holding the dequantized values. Both run in f32;
 * they differ only in the order of f32 sums (gemm_quant vs sgemm), so 1e-4 relative to the
 * logits' scale is ample (the logits are O(1), K <= 128). */
/* quantized: the file's blocks are kept as they are (layer 1's q/k/v apart in their three types,
 * lm_head in Q8_0), which the widened twin's are not. */
static void score_file(const char *path, const kiln_hal_backend_t *be, kiln_hal_device_t *dev,
                       kiln_hal_stream_t *stream, int32_t chunk, bool quantized, float *out) {
  kiln_model_options_t o = {
      .dtype = KILN_HAL_F32, .max_tokens = 12, .max_seqs = 1, .max_blocks_per_seq = 8};
  kiln_model_t *m = NULL;
  kiln_status_t st = kiln_model_load(path, be, dev, stream, &o, &m);
  if (st) fprintf(stderr, "%s\n", kiln_status_message(st));
  assert_null(st);
  assert_int_equal(m->layers[1].qkv_mixed, quantized);
  assert_int_equal(m->layers[1].qkv_pf[1], quantized ? KILN_HAL_QFMT_Q4_0 : 0);
  assert_int_equal(m->lm_fmt, quantized ? KILN_HAL_QFMT_Q8_0 : KILN_HAL_QFMT_NONE);
  static const int32_t ids[12] = {3, 7, 1, 30, 12, 5, 9, 17, 22, 4, 0, 31};
  assert_null(kiln_model_score(m, ids, 12, chunk, 16, out));
  kiln_model_free(m);
}


static void test_quantized_model(void **state) {
  (void)state;
  kiln_hal_registry_options_t ro = {0};
  kiln_hal_registry_t *reg = NULL;
  const kiln_hal_plugin_t *pl = NULL;
  kiln_status_t st = kiln_hal_registry_create(&ro, &reg);
  if (!st) st = kiln_hal_registry_open(reg, test_backend_name(), &pl);
  if (st) fprintf(stderr, "%s\n", kiln_status_message(st));
  assert_null(st);
  kiln_hal_device_t *dev = NULL;
  kiln_hal_stream_t *stream = NULL;
  assert_null(pl->table.device_open(0, &dev));
  assert_null(pl->table.stream_create(dev, &stream));
  char wide[200];
  snprintf(wide, sizeof(wide), "%s/wide.gguf", g_dir);
  const uint64_t seed = g_rng;
  g_loadable = true;
  for (int pass = 0; pass < 2; pass++) {
    gg_t g;
    g_rng = seed; /* the same random stream for both files */
    gg_init(&g);
    g_widen_q8 = pass == 0; /* the widened twin first, renamed to wide.gguf */
    build_llama(&g, NULL);
    gg_write(&g);
    gg_free(&g);
    g_widen_q8 = false;
    if (pass == 0) assert_int_equal(rename(g_path, wide), 0);
  }
  g_loadable = false;
  float q[12 * 32], w[12 * 32], q1[12 * 32];
  score_file(g_path, &pl->table, dev, stream, 0, true, q);  /* prefill: M = 12 rows */
  score_file(g_path, &pl->table, dev, stream, 1, true, q1); /* decode: M = 1 */
  score_file(wide, &pl->table, dev, stream, 0, false, w);
  double scale = 0;
  for (int i = 0; i < 12 * 32; i++) scale = fmax(scale, fabs(w[i]));
  assert_true(scale > 0.1);
  for (int i = 0; i < 12 * 32; i++) {
    assert_true(fabs(q[i] - w[i]) <= 1e-4 * scale);
    assert_true(fabs(q1[i] - w[i]) <= 1e-4 * scale);
  }
  unlink(wide);
  pl->table.stream_destroy(stream);
  pl->table.device_close(dev);
  kiln_hal_registry_free(reg);
}

/* ---- the tokenizer in the metadata (gguf_vocab.c) ------------------------------------------ */

typedef struct vtok {
  const char *s;
  float score;
  int32_t type;
} vtok_t;

static void gg_str_array(gg_t *g, const char *key, const char *const *v, size_t n) {
  if (!gg_key(g, key, GT_ARRAY)) return;
  put_le(&g->kv, GT_STRING, 4);
  put_le(&g->kv, n, 8);
  for (size_t i = 0; i < n; i++) put_str(&g->kv, v[i]);
}

static void gg_bool(gg_t *g, const char *key, bool b) {
  if (gg_key(g, key, GT_BOOL)) put_le(&g->kv, b, 1);
}

/* A SentencePiece vocabulary, no merges: they come from the scores. bad_type_count writes one
 * token type too few. */
static void build_spm(gg_t *g, const vtok_t *t, size_t n, bool bad_type_count) {
  gg_str(g, "general.architecture", "llama");
  gg_str(g, "tokenizer.ggml.model", "llama");
  const char *s[16];
  for (size_t i = 0; i < n; i++) s[i] = t[i].s;
  gg_str_array(g, "tokenizer.ggml.tokens", s, n);
  if (gg_key(g, "tokenizer.ggml.scores", GT_ARRAY)) {
    put_le(&g->kv, GT_F32, 4);
    put_le(&g->kv, n, 8);
    for (size_t i = 0; i < n; i++) put_le(&g->kv, kiln_hal_f32_to_bits(t[i].score), 4);
  }
  if (gg_key(g, "tokenizer.ggml.token_type", GT_ARRAY)) {
    size_t nt = bad_type_count ? n - 1 : n;
    put_le(&g->kv, GT_I32, 4);
    put_le(&g->kv, nt, 8);
    for (size_t i = 0; i < nt; i++) put_le(&g->kv, (uint64_t)t[i].type, 4);
  }
  gg_u32(g, "tokenizer.ggml.bos_token_id", 1);
  gg_u32(g, "tokenizer.ggml.eos_token_id", 2);
  gg_u32(g, "tokenizer.ggml.unknown_token_id", 0);
  gg_str(g, "tokenizer.chat_template",
         "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}"
         "{% endfor %}");
}

static const vtok_t spm_vocab[] = {
    {"<unk>", 0, 2},
    {"<s>", 0, 3},
    {"</s>", 0, 3},
    {"<0x21>", 0, 6},
    {"\xe2\x96\x81", -1, 1},
    {"a", -2, 1},
    {"b", -3, 1},
    {"ab", -4, 1},
    {"\xe2\x96\x81"
     "a",
     -5, 1},
    {"\xe2\x96\x81"
     "ab",
     -6, 1},
};
#define N_SPM (sizeof(spm_vocab) / sizeof(spm_vocab[0]))

static void expect_ids(const kiln_tokenizer_t *tok, const char *text, bool special,
                       const int32_t *want, size_t n) {
  kiln_tokens_t ids = KILN_TOKENS_INIT;
  assert_null(kiln_tokenizer_encode(tok, text, strlen(text), special, &ids));
  if (ids.len != n) fail_msg("\"%s\": %zu ids, want %zu", text, ids.len, n);
  for (size_t i = 0; i < n; i++)
    if (ids.ids[i] != want[i])
      fail_msg("\"%s\": id %zu is %d, want %d", text, i, ids.ids[i], want[i]);
  kiln_tokens_free(&ids);
}

static void expect_tokenizer_error(kiln_status_code_t code, const char *needle) {
  kiln_tokenizer_t *tok = (kiln_tokenizer_t *)(uintptr_t)1;
  kiln_status_t st = kiln_model_open_tokenizer(g_path, &tok, NULL, NULL, NULL);
  if (!st) fail_msg("expected an error about \"%s\", got success", needle);
  assert_null(tok);
  const char *msg = kiln_status_message(st);
  if (kiln_status_code(st) != code || !strstr(msg, needle) || !strstr(msg, "model.gguf"))
    fail_msg("expected %s about \"%s\", got %s: %s", kiln_status_code_name(code), needle,
             kiln_status_code_name(kiln_status_code(st)), msg);
  kiln_status_free(st);
}

static void test_tokenizer_metadata(void **state) {
  (void)state;
  gg_t g;
  gg_init(&g);
  build_spm(&g, spm_vocab, N_SPM, false);
  gg_write(&g);
  gg_free(&g);
  kiln_tokenizer_t *tok = NULL;
  kiln_chat_template_t *chat = NULL;
  kiln_status_t ct = NULL;
  kiln_tokenizer_source_t src;
  kiln_status_t st = kiln_model_open_tokenizer(g_path, &tok, &chat, &ct, &src);
  if (st) fail_msg("%s", kiln_status_message(st));
  assert_null(ct);
  assert_int_equal(src, KILN_TOKENIZER_GGUF);
  assert_int_equal(kiln_tokenizer_vocab_size(tok), N_SPM);
  /* "▁ab▁ab": merges by score: (a b), (▁ a), then ▁ab's splits by left id: (▁ ab), (▁a b). */
  expect_ids(tok, "ab ab", false, (const int32_t[]){9, 9}, 2);
  expect_ids(tok, "ab ab", true, (const int32_t[]){1, 9, 9}, 3); /* add_bos by default */
  expect_ids(tok, "!", false, (const int32_t[]){4, 3}, 2);       /* byte fallback */
  expect_ids(tok, "cc", false, (const int32_t[]){4, 0}, 2);      /* unknown, fused */
  expect_ids(tok, "<s>ab", false, (const int32_t[]){1, 9}, 2);   /* each segment gets its ▁ */
  kiln_strbuf_t out = KILN_STRBUF_INIT;
  assert_null(kiln_tokenizer_decode(tok, (const int32_t[]){1, 9, 9, 2}, 4, true, &out));
  assert_string_equal(out.data, "ab ab");
  kiln_strbuf_reset(&out);
  assert_int_equal(kiln_tokenizer_bos_id(tok), 1);
  assert_int_equal(kiln_tokenizer_eos_id(tok), 2);
  /* tokenizer.chat_template, with the special tokens the metadata names. */
  kiln_json_doc_t *msgs = NULL;
  const char *mj = "[{\"role\": \"user\", \"content\": \"hi\"}]";
  assert_null(kiln_json_parse(mj, strlen(mj), "messages", &msgs));
  kiln_template_vars_t vars = {.messages = kiln_json_root(msgs)};
  assert_null(kiln_chat_template_render(chat, &vars, &out));
  assert_string_equal(out.data, "<s>[user] hi</s>");
  kiln_json_doc_free(msgs);
  kiln_strbuf_free(&out);
  kiln_chat_template_free(chat);
  kiln_tokenizer_free(tok);

  /* No tokenizer.ggml.model: no tokenizer, and no error. */
  gg_init(&g);
  gg_str(&g, "general.architecture", "llama");
  gg_write(&g);
  gg_free(&g);
  assert_null(kiln_model_open_tokenizer(g_path, &tok, NULL, NULL, &src));
  assert_null(tok);
  assert_int_equal(src, KILN_TOKENIZER_NONE);

  /* What is refused, named. */
  gg_init(&g);
  gg_str(&g, "tokenizer.ggml.model", "bert");
  gg_write(&g);
  gg_free(&g);
  expect_tokenizer_error(KILN_ERR_UNSUPPORTED, "tokenizer.ggml.model \"bert\"");

  gg_init(&g);
  build_spm(&g, spm_vocab, N_SPM, true);
  gg_write(&g);
  gg_free(&g);
  expect_tokenizer_error(KILN_ERR_INVALID_ARGUMENT, "token_type holds 9 entries for 10 tokens");

  vtok_t bad[N_SPM];
  memcpy(bad, spm_vocab, sizeof(bad));
  bad[5].s = "\xc3";
  gg_init(&g);
  build_spm(&g, bad, N_SPM, false);
  gg_write(&g);
  gg_free(&g);
  expect_tokenizer_error(KILN_ERR_INVALID_ARGUMENT, "tokens[5] is not valid UTF-8");

  memcpy(bad, spm_vocab, sizeof(bad));
  bad[6].type = 9;
  gg_init(&g);
  build_spm(&g, bad, N_SPM, false);
  gg_write(&g);
  gg_free(&g);
  expect_tokenizer_error(KILN_ERR_INVALID_ARGUMENT, "token_type[6] is 9");

  gg_init(&g);
  g.skip = "tokenizer.ggml.scores";
  build_spm(&g, spm_vocab, N_SPM, false);
  gg_write(&g);
  gg_free(&g);
  expect_tokenizer_error(KILN_ERR_INVALID_ARGUMENT, "needs tokenizer.ggml.scores");

  gg_init(&g);
  build_spm(&g, spm_vocab, N_SPM, false);
  gg_u32(&g, "tokenizer.ggml.padding_token_id", 99);
  gg_write(&g);
  gg_free(&g);
  expect_tokenizer_error(KILN_ERR_INVALID_ARGUMENT, "padding_token_id is 99");

  gg_init(&g);
  g.skip = "tokenizer.ggml.bos_token_id";
  build_spm(&g, spm_vocab, N_SPM, false);
  gg_write(&g);
  gg_free(&g);
  expect_tokenizer_error(KILN_ERR_INVALID_ARGUMENT, "add_bos_token is true but");

  /* Byte-level BPE: merges from the file, a pre-tokenizer by name. */
  static const char *const bl[] = {"a",
                                   "b",
                                   "ab",
                                   "\xc4\xa0",
                                   "\xc4\xa0"
                                   "ab",
                                   "<|end|>"};
  static const char *const merges[] = {"a b", "\xc4\xa0 ab"};
  for (int k = 0; k < 4; k++) {
    gg_init(&g);
    gg_str(&g, "tokenizer.ggml.model", "gpt2");
    gg_str(&g, "tokenizer.ggml.pre", k == 1 ? "falcon" : "qwen2");
    gg_str_array(&g, "tokenizer.ggml.tokens", bl, 6);
    if (gg_key(&g, "tokenizer.ggml.token_type", GT_ARRAY)) {
      put_le(&g.kv, GT_I32, 4);
      put_le(&g.kv, 6, 8);
      for (int i = 0; i < 6; i++) put_le(&g.kv, i == 5 ? 3 : 1, 4);
    }
    if (k != 2) gg_str_array(&g, "tokenizer.ggml.merges", k == 3 ? bl : merges, 2);
    gg_u32(&g, "tokenizer.ggml.eos_token_id", 5);
    gg_bool(&g, "tokenizer.ggml.add_bos_token", false);
    gg_write(&g);
    gg_free(&g);
    if (k == 1) {
      expect_tokenizer_error(KILN_ERR_UNSUPPORTED, "tokenizer.ggml.pre \"falcon\"");
      continue;
    }
    if (k == 2) {
      expect_tokenizer_error(KILN_ERR_INVALID_ARGUMENT, "tokenizer.ggml.merges is missing");
      continue;
    }
    if (k == 3) {
      expect_tokenizer_error(KILN_ERR_INVALID_ARGUMENT, "tokenizer.ggml.merges[0]");
      continue;
    }
    assert_null(kiln_model_open_tokenizer(g_path, &tok, NULL, NULL, &src));
    expect_ids(tok, "ab ab<|end|>", true, (const int32_t[]){2, 4, 5}, 3);
    assert_null(kiln_tokenizer_decode(tok, (const int32_t[]){2, 4, 5}, 3, true, &out));
    assert_string_equal(out.data, "ab ab");
    kiln_strbuf_free(&out);
    kiln_tokenizer_free(tok);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_llama, make_dir, remove_dir),
      cmocka_unit_test_setup_teardown(test_qwen3, make_dir, remove_dir),
      cmocka_unit_test_setup_teardown(test_rope_scaling, make_dir, remove_dir),
      cmocka_unit_test_setup_teardown(test_truncated, make_dir, remove_dir),
      cmocka_unit_test_setup_teardown(test_corrupt_bytes, make_dir, remove_dir),
      cmocka_unit_test_setup_teardown(test_errors, make_dir, remove_dir),
      cmocka_unit_test_setup_teardown(test_quantized_model, make_dir, remove_dir),
      cmocka_unit_test_setup_teardown(test_tokenizer_metadata, make_dir, remove_dir),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
