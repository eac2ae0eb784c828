/* test_model_config.c - cmocka tests for models/model_config and models/rope: real config.json
 * shapes (transformers 4.x and 5.x), every refusal with its key named, generation_config.json
 * merging, loading from a directory, and every rope variant against an fp64 reference written
 * here straight from transformers' formulas. */
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
#include <unistd.h>

#include "base/json.h"
#include "kiln/hal.h"
#include "models/model_config.h"
#include "models/rope.h"

/* ---- helpers ------------------------------------------------------------------------------ */

/* The test texts use ' for " so they stay readable; q() swaps them back. */
static char *q(const char *text) {
  char *s = strdup(text);
  assert_non_null(s);
  for (char *p = s; *p; p++)
    if (*p == '\'') *p = '"';
  return s;
}

/* base is "{ ... %s}": extra (", 'key': value" members) goes at the end; a repeated key's last
 * value wins, so extra can also override. */
static char *with(const char *base, const char *extra) {
  const char *at = strstr(base, "%s");
  assert_non_null(at);
  size_t n = strlen(base) + strlen(extra) + 1;
  char *text = malloc(n);
  assert_non_null(text);
  snprintf(text, n, "%.*s%s%s", (int)(at - base), base, extra, at + 2);
  char *s = q(text);
  free(text);
  return s;
}

static kiln_status_t parse_text(const char *json, const char *name, kiln_model_config_t *c) {
  kiln_json_doc_t *doc = NULL;
  kiln_status_t st = kiln_json_parse(json, strlen(json), name, &doc);
  if (st) fail_msg("test JSON does not parse: %s", kiln_status_message(st));
  st = kiln_model_config_parse(kiln_json_root(doc), name, c);
  kiln_json_doc_free(doc);
  return st;
}

static void parse_ok(const char *base, const char *extra, kiln_model_config_t *c) {
  char *json = with(base, extra);
  kiln_status_t st = parse_text(json, "/m/config.json", c);
  if (st) fail_msg("unexpected error: %s\n  for: %s", kiln_status_message(st), json);
  free(json);
}

/* Expects parsing base+extra to fail with code and a message that starts with the file name
 * and contains each of the (up to two) fragments. */
static void parse_err(const char *base, const char *extra, kiln_status_code_t code,
                      const char *frag1, const char *frag2) {
  char *json = with(base, extra);
  kiln_model_config_t c;
  kiln_status_t st = parse_text(json, "/m/config.json", &c);
  if (!st) fail_msg("parsed but should not have: %s", extra);
  const char *msg = kiln_status_message(st);
  if (kiln_status_code(st) != code || strncmp(msg, "/m/config.json: ", 16) != 0 ||
      !strstr(msg, frag1) || (frag2 && !strstr(msg, frag2)))
    fail_msg("extra %s\n  got:  %s %s\n  want: %s ...%s...%s", extra,
             kiln_status_code_name(kiln_status_code(st)), msg, kiln_status_code_name(code), frag1,
             frag2 ? frag2 : "");
  kiln_status_free(st);
  free(json);
}

static kiln_status_t parse_gen_text(const char *text, kiln_model_config_t *c) {
  char *json = q(text);
  kiln_json_doc_t *doc = NULL;
  kiln_status_t st = kiln_json_parse(json, strlen(json), "/m/generation_config.json", &doc);
  if (st) fail_msg("test JSON does not parse: %s", kiln_status_message(st));
  st = kiln_model_config_parse_generation(kiln_json_root(doc), "/m/generation_config.json", c);
  kiln_json_doc_free(doc);
  free(json);
  return st;
}

static void expect_eos(const kiln_model_config_t *c, int n, const int32_t *ids) {
  assert_int_equal(c->num_eos, n);
  for (int i = 0; i < n; i++) assert_int_equal(c->eos_token_ids[i], ids[i]);
}

static void expect_sliding(const kiln_model_config_t *c, int64_t first_sliding, int32_t window) {
  assert_int_equal(c->sliding_window, window);
  for (int64_t i = 0; i < c->num_layers; i++)
    if (c->layer_sliding[i] != (i >= first_sliding))
      fail_msg("layer %lld sliding %d", (long long)i, c->layer_sliding[i]);
}

/* ---- real config.json shapes -------------------------------------------------------------- */

static const char k_llama2_7b[] =
    "{'architectures': ['LlamaForCausalLM'], 'bos_token_id': 1, 'eos_token_id': 2,"
    " 'hidden_act': 'silu', 'hidden_size': 4096, 'initializer_range': 0.02,"
    " 'intermediate_size': 11008, 'max_position_embeddings': 4096, 'model_type': 'llama',"
    " 'num_attention_heads': 32, 'num_hidden_layers': 32, 'num_key_value_heads': 32,"
    " 'pretraining_tp': 1, 'rms_norm_eps': 1e-05, 'rope_scaling': null,"
    " 'tie_word_embeddings': false, 'torch_dtype': 'float16',"
    " 'transformers_version': '4.31.0.dev0', 'use_cache': true, 'vocab_size': 32000 %s}";

static const char k_llama31_8b[] =
    "{'architectures': ['LlamaForCausalLM'], 'attention_bias': false, 'attention_dropout': 0.0,"
    " 'bos_token_id': 128000, 'eos_token_id': [128001, 128008, 128009], 'hidden_act': 'silu',"
    " 'hidden_size': 4096, 'initializer_range': 0.02, 'intermediate_size': 14336,"
    " 'max_position_embeddings': 131072, 'mlp_bias': false, 'model_type': 'llama',"
    " 'num_attention_heads': 32, 'num_hidden_layers': 32, 'num_key_value_heads': 8,"
    " 'pretraining_tp': 1, 'rms_norm_eps': 1e-05,"
    " 'rope_scaling': {'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,"
    "   'original_max_position_embeddings': 8192, 'rope_type': 'llama3'},"
    " 'rope_theta': 500000.0, 'tie_word_embeddings': false, 'torch_dtype': 'bfloat16',"
    " 'transformers_version': '4.43.0.dev0', 'use_cache': true, 'vocab_size': 128256 %s}";

/* Llama-3.2-1B as transformers 5 writes it: dtype, rope_parameters with rope_theta inside. */
static const char k_llama32_1b_v5[] =
    "{'architectures': ['LlamaForCausalLM'], 'attention_bias': false, 'attention_dropout': 0.0,"
    " 'bos_token_id': 128000, 'dtype': 'bfloat16', 'eos_token_id': 128001, 'head_dim': 64,"
    " 'hidden_act': 'silu', 'hidden_size': 2048, 'initializer_range': 0.02,"
    " 'intermediate_size': 8192, 'max_position_embeddings': 131072, 'mlp_bias': false,"
    " 'model_type': 'llama', 'num_attention_heads': 32, 'num_hidden_layers': 16,"
    " 'num_key_value_heads': 8, 'pad_token_id': null, 'pretraining_tp': 1, 'rms_norm_eps': 1e-05,"
    " 'rope_parameters': {'factor': 32.0, 'high_freq_factor': 4.0, 'low_freq_factor': 1.0,"
    "   'original_max_position_embeddings': 8192, 'rope_theta': 500000.0, 'rope_type': 'llama3'},"
    " 'tie_word_embeddings': true, 'transformers_version': '5.0.0', 'use_cache': true,"
    " 'vocab_size': 128256 %s}";

static const char k_mistral_7b[] =
    "{'architectures': ['MistralForCausalLM'], 'bos_token_id': 1, 'eos_token_id': 2,"
    " 'hidden_act': 'silu', 'hidden_size': 4096, 'initializer_range': 0.02,"
    " 'intermediate_size': 14336, 'max_position_embeddings': 32768, 'model_type': 'mistral',"
    " 'num_attention_heads': 32, 'num_hidden_layers': 32, 'num_key_value_heads': 8,"
    " 'rms_norm_eps': 1e-05, 'rope_theta': 10000.0, 'sliding_window': 4096,"
    " 'tie_word_embeddings': false, 'torch_dtype': 'bfloat16',"
    " 'transformers_version': '4.34.0.dev0', 'use_cache': true, 'vocab_size': 32000 %s}";

static const char k_qwen2_7b[] =
    "{'architectures': ['Qwen2ForCausalLM'], 'attention_dropout': 0.0, 'bos_token_id': 151643,"
    " 'eos_token_id': 151643, 'hidden_act': 'silu', 'hidden_size': 3584,"
    " 'initializer_range': 0.02, 'intermediate_size': 18944, 'max_position_embeddings': 131072,"
    " 'max_window_layers': 28, 'model_type': 'qwen2', 'num_attention_heads': 28,"
    " 'num_hidden_layers': 28, 'num_key_value_heads': 4, 'rms_norm_eps': 1e-06,"
    " 'rope_theta': 1000000.0, 'sliding_window': 131072, 'tie_word_embeddings': false,"
    " 'torch_dtype': 'bfloat16', 'transformers_version': '4.37.2', 'use_cache': true,"
    " 'use_sliding_window': false, 'vocab_size': 152064 %s}";

static const char k_qwen3_8b[] =
    "{'architectures': ['Qwen3ForCausalLM'], 'attention_bias': false, 'attention_dropout': 0.0,"
    " 'bos_token_id': 151643, 'eos_token_id': 151645, 'head_dim': 128, 'hidden_act': 'silu',"
    " 'hidden_size': 4096, 'initializer_range': 0.02, 'intermediate_size': 12288,"
    " 'max_position_embeddings': 40960, 'max_window_layers': 36, 'model_type': 'qwen3',"
    " 'num_attention_heads': 32, 'num_hidden_layers': 36, 'num_key_value_heads': 8,"
    " 'rms_norm_eps': 1e-06, 'rope_scaling': null, 'rope_theta': 1000000,"
    " 'sliding_window': null, 'tie_word_embeddings': false, 'torch_dtype': 'bfloat16',"
    " 'transformers_version': '4.51.0', 'use_cache': true, 'use_sliding_window': false,"
    " 'vocab_size': 151936 %s}";

static const char k_qwen25_05b[] =
    "{'architectures': ['Qwen2ForCausalLM'], 'attention_dropout': 0.0, 'bos_token_id': 151643,"
    " 'eos_token_id': 151643, 'hidden_act': 'silu', 'hidden_size': 896,"
    " 'initializer_range': 0.02, 'intermediate_size': 4864, 'max_position_embeddings': 32768,"
    " 'max_window_layers': 24, 'model_type': 'qwen2', 'num_attention_heads': 14,"
    " 'num_hidden_layers': 24, 'num_key_value_heads': 2, 'rms_norm_eps': 1e-06,"
    " 'rope_theta': 1000000.0, 'sliding_window': 32768, 'tie_word_embeddings': true,"
    " 'torch_dtype': 'bfloat16', 'transformers_version': '4.40.1', 'use_cache': true,"
    " 'use_sliding_window': false, 'vocab_size': 151936 %s}";

static void test_llama2(void **state) {
  (void)state;
  kiln_model_config_t c;
  parse_ok(k_llama2_7b, "", &c);
  assert_string_equal(c.architecture, "LlamaForCausalLM");
  assert_string_equal(c.model_type, "llama");
  assert_int_equal(c.arch, KILN_ARCH_LLAMA);
  assert_int_equal(c.vocab_size, 32000);
  assert_int_equal(c.hidden_size, 4096);
  assert_int_equal(c.intermediate_size, 11008);
  assert_int_equal(c.num_layers, 32);
  assert_int_equal(c.num_heads, 32);
  assert_int_equal(c.num_kv_heads, 32);
  assert_int_equal(c.head_dim, 128);
  assert_int_equal(c.max_position_embeddings, 4096);
  assert_true(c.rms_norm_eps == 1e-5);
  assert_false(c.tie_word_embeddings);
  assert_false(c.qkv_bias);
  assert_false(c.o_bias);
  assert_false(c.mlp_bias);
  assert_false(c.qk_norm);
  assert_int_equal(c.hidden_act, KILN_HAL_ACT_SILU);
  expect_sliding(&c, INT64_MAX, 0);
  assert_int_equal(c.rope.kind, KILN_ROPE_DEFAULT);
  assert_int_equal(c.rope.style, KILN_HAL_ROPE_NEOX);
  assert_int_equal(c.rope.rotary_dim, 128);
  assert_true(c.rope.theta == 10000.0);
  assert_true(c.rope.factor == 1.0);
  assert_int_equal(c.rope.n_freq_factors, 0);
  assert_int_equal(c.dtype, KILN_HAL_F16);
  assert_int_equal(c.bos_token_id, 1);
  assert_int_equal(c.pad_token_id, -1);
  expect_eos(&c, 1, (const int32_t[]){2});
  assert_false(c.has_temperature || c.has_top_p || c.has_top_k || c.has_repetition_penalty ||
               c.do_sample);
  assert_int_equal(kiln_rope_max_positions(&c), 4096);
}

static void test_llama31(void **state) {
  (void)state;
  kiln_model_config_t c;
  parse_ok(k_llama31_8b, "", &c);
  assert_int_equal(c.arch, KILN_ARCH_LLAMA);
  assert_int_equal(c.vocab_size, 128256);
  assert_int_equal(c.intermediate_size, 14336);
  assert_int_equal(c.num_kv_heads, 8);
  assert_int_equal(c.head_dim, 128);
  assert_int_equal(c.max_position_embeddings, 131072);
  assert_int_equal(c.dtype, KILN_HAL_BF16);
  assert_int_equal(c.rope.kind, KILN_ROPE_LLAMA3);
  assert_int_equal(c.rope.rotary_dim, 128);
  assert_true(c.rope.theta == 500000.0);
  assert_true(c.rope.factor == 8.0);
  assert_true(c.rope.low_freq_factor == 1.0);
  assert_true(c.rope.high_freq_factor == 4.0);
  assert_int_equal(c.rope.original_max_position, 8192);
  assert_int_equal(c.bos_token_id, 128000);
  expect_eos(&c, 3, (const int32_t[]){128001, 128008, 128009});
  assert_int_equal(kiln_rope_max_positions(&c), 131072);
  /* attention_bias / mlp_bias switch Llama's biases on */
  parse_ok(k_llama31_8b, ", 'attention_bias': true, 'mlp_bias': true", &c);
  assert_true(c.qkv_bias && c.o_bias && c.mlp_bias);
  /* older 4.x files say "type" */
  parse_ok(k_llama31_8b,
           ", 'rope_scaling': {'type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0,"
           " 'high_freq_factor': 4.0, 'original_max_position_embeddings': 8192}",
           &c);
  assert_int_equal(c.rope.kind, KILN_ROPE_LLAMA3);
}

static void test_v5_rope_parameters(void **state) {
  (void)state;
  kiln_model_config_t c;
  parse_ok(k_llama32_1b_v5, "", &c);
  assert_int_equal(c.hidden_size, 2048);
  assert_int_equal(c.num_layers, 16);
  assert_int_equal(c.head_dim, 64);
  assert_int_equal(c.dtype, KILN_HAL_BF16);
  assert_true(c.tie_word_embeddings);
  assert_int_equal(c.rope.kind, KILN_ROPE_LLAMA3);
  assert_int_equal(c.rope.rotary_dim, 64);
  assert_true(c.rope.theta == 500000.0);
  assert_true(c.rope.factor == 32.0);
  assert_int_equal(c.rope.original_max_position, 8192);
  assert_int_equal(c.pad_token_id, -1);
  expect_eos(&c, 1, (const int32_t[]){128001});
  /* "dtype" wins over a stale "torch_dtype" */
  parse_ok(k_llama32_1b_v5, ", 'torch_dtype': 'float32'", &c);
  assert_int_equal(c.dtype, KILN_HAL_BF16);
  /* a default rope_parameters; rope_theta inside wins over a top-level one */
  parse_ok(k_llama32_1b_v5,
           ", 'rope_theta': 5.0, 'rope_parameters': {'rope_type': 'default', 'rope_theta': 1234.5}",
           &c);
  assert_int_equal(c.rope.kind, KILN_ROPE_DEFAULT);
  assert_true(c.rope.theta == 1234.5);
  assert_true(c.rope.factor == 1.0);
  /* no dtype at all: float32 */
  parse_ok(k_llama2_7b, ", 'torch_dtype': null", &c);
  assert_int_equal(c.dtype, KILN_HAL_F32);
  parse_ok(k_llama2_7b, ", 'torch_dtype': 'float32'", &c);
  assert_int_equal(c.dtype, KILN_HAL_F32);
  /* a v5 file with layer_types for Llama (all full) */
  parse_ok(k_llama2_7b,
           ", 'num_hidden_layers': 2, 'layer_types': ['full_attention', 'full_attention']", &c);
  expect_sliding(&c, INT64_MAX, 0);
}

static void test_mistral(void **state) {
  (void)state;
  kiln_model_config_t c;
  parse_ok(k_mistral_7b, "", &c);
  assert_string_equal(c.architecture, "MistralForCausalLM");
  assert_int_equal(c.arch, KILN_ARCH_MISTRAL);
  assert_int_equal(c.vocab_size, 32000);
  assert_int_equal(c.hidden_size, 4096);
  assert_int_equal(c.intermediate_size, 14336);
  assert_int_equal(c.num_layers, 32);
  assert_int_equal(c.num_heads, 32);
  assert_int_equal(c.num_kv_heads, 8);
  assert_int_equal(c.head_dim, 128);
  assert_int_equal(c.max_position_embeddings, 32768);
  assert_true(c.rms_norm_eps == 1e-5);
  assert_false(c.qkv_bias || c.o_bias || c.mlp_bias || c.qk_norm || c.tie_word_embeddings);
  expect_sliding(&c, 0, 4096);
  assert_int_equal(c.rope.kind, KILN_ROPE_DEFAULT);
  assert_true(c.rope.theta == 10000.0);
  assert_int_equal(c.bos_token_id, 1);
  expect_eos(&c, 1, (const int32_t[]){2});
  assert_int_equal(c.dtype, KILN_HAL_BF16);
  /* v0.2+: sliding_window null = no window; head_dim null = hidden / heads */
  parse_ok(k_mistral_7b, ", 'sliding_window': null, 'head_dim': null, 'rope_theta': 1000000.0", &c);
  expect_sliding(&c, INT64_MAX, 0);
  assert_int_equal(c.head_dim, 128);
  /* MistralConfig's default window is 4096 when the key is absent (rebuild without it) */
  const char *nowin =
      "{'architectures': ['MistralForCausalLM'], 'hidden_size': 1024, 'intermediate_size': 2048,"
      " 'max_position_embeddings': 4096, 'model_type': 'mistral', 'num_attention_heads': 8,"
      " 'num_hidden_layers': 2, 'vocab_size': 1000 %s}";
  parse_ok(nowin, "", &c);
  expect_sliding(&c, 0, 4096);
  assert_int_equal(c.num_kv_heads, 8);
  /* Mistral's attention has no biases: attention_bias is ignored, as transformers does */
  parse_ok(k_mistral_7b, ", 'attention_bias': true", &c);
  assert_false(c.qkv_bias || c.o_bias);
  /* an explicit head_dim (Mistral-Nemo) */
  parse_ok(k_mistral_7b, ", 'head_dim': 128, 'hidden_size': 5120", &c);
  assert_int_equal(c.head_dim, 128);
  assert_int_equal(c.rope.rotary_dim, 128);
}

static void test_qwen2(void **state) {
  (void)state;
  kiln_model_config_t c;
  parse_ok(k_qwen2_7b, "", &c);
  assert_string_equal(c.architecture, "Qwen2ForCausalLM");
  assert_int_equal(c.arch, KILN_ARCH_QWEN2);
  assert_int_equal(c.vocab_size, 152064);
  assert_int_equal(c.hidden_size, 3584);
  assert_int_equal(c.intermediate_size, 18944);
  assert_int_equal(c.num_layers, 28);
  assert_int_equal(c.num_heads, 28);
  assert_int_equal(c.num_kv_heads, 4);
  assert_int_equal(c.head_dim, 128);
  assert_int_equal(c.max_position_embeddings, 131072);
  assert_true(c.rms_norm_eps == 1e-6);
  assert_true(c.qkv_bias);
  assert_false(c.o_bias || c.mlp_bias || c.qk_norm || c.tie_word_embeddings);
  expect_sliding(&c, INT64_MAX, 0); /* use_sliding_window false */
  assert_true(c.rope.theta == 1e6);
  assert_int_equal(c.rope.rotary_dim, 128);
  assert_int_equal(c.bos_token_id, 151643);
  assert_int_equal(c.pad_token_id, -1);
  expect_eos(&c, 1, (const int32_t[]){151643});
  /* use_sliding_window: layers >= max_window_layers slide */
  parse_ok(k_qwen2_7b,
           ", 'use_sliding_window': true, 'sliding_window': 4096, 'max_window_layers': 20", &c);
  expect_sliding(&c, 20, 4096);
  /* ...default window 4096 when the key is absent is covered by Qwen2Config; null = none */
  parse_ok(k_qwen2_7b, ", 'use_sliding_window': true, 'sliding_window': null", &c);
  expect_sliding(&c, INT64_MAX, 0);
  /* attention_bias does not change Qwen2 (q/k/v always biased, o never) */
  parse_ok(k_qwen2_7b, ", 'attention_bias': true", &c);
  assert_true(c.qkv_bias);
  assert_false(c.o_bias);
}

static void test_qwen3(void **state) {
  (void)state;
  kiln_model_config_t c;
  parse_ok(k_qwen3_8b, "", &c);
  assert_string_equal(c.architecture, "Qwen3ForCausalLM");
  assert_string_equal(c.model_type, "qwen3");
  assert_int_equal(c.arch, KILN_ARCH_QWEN3);
  assert_int_equal(c.vocab_size, 151936);
  assert_int_equal(c.hidden_size, 4096);
  assert_int_equal(c.intermediate_size, 12288);
  assert_int_equal(c.num_layers, 36);
  assert_int_equal(c.num_heads, 32);
  assert_int_equal(c.num_kv_heads, 8);
  assert_int_equal(c.head_dim, 128);
  assert_int_equal(c.max_position_embeddings, 40960);
  assert_true(c.rms_norm_eps == 1e-6);
  assert_true(c.qk_norm);
  assert_false(c.qkv_bias || c.o_bias || c.mlp_bias || c.tie_word_embeddings);
  assert_int_equal(c.hidden_act, KILN_HAL_ACT_SILU);
  expect_sliding(&c, INT64_MAX, 0);
  assert_int_equal(c.rope.kind, KILN_ROPE_DEFAULT);
  assert_true(c.rope.theta == 1e6);
  assert_int_equal(c.rope.rotary_dim, 128);
  assert_int_equal(c.dtype, KILN_HAL_BF16);
  assert_int_equal(c.bos_token_id, 151643);
  expect_eos(&c, 1, (const int32_t[]){151645});
  /* attention_bias biases q/k/v and o */
  parse_ok(k_qwen3_8b, ", 'attention_bias': true", &c);
  assert_true(c.qkv_bias && c.o_bias);
  /* Qwen3-0.6B: head_dim 128 with hidden 1024 / 16 heads */
  parse_ok(k_qwen3_8b,
           ", 'hidden_size': 1024, 'num_attention_heads': 16, 'tie_word_embeddings': true", &c);
  assert_int_equal(c.head_dim, 128);
  assert_true(c.tie_word_embeddings);
  /* Qwen3Config's head_dim default (absent) is 128, not hidden / heads */
  const char *nohd =
      "{'model_type': 'qwen3', 'hidden_size': 1024, 'intermediate_size': 3072,"
      " 'max_position_embeddings': 4096, 'num_attention_heads': 16, 'num_hidden_layers': 4,"
      " 'vocab_size': 1000 %s}";
  parse_ok(nohd, "", &c);
  assert_int_equal(c.head_dim, 128);
  assert_string_equal(c.architecture, "Qwen3ForCausalLM");
  assert_int_equal(c.bos_token_id, -1);
  assert_int_equal(c.num_eos, 0);
  assert_int_equal(c.dtype, KILN_HAL_F32);
  parse_ok(nohd, ", 'head_dim': null", &c);
  assert_int_equal(c.head_dim, 64);
  /* a v5 Qwen3 file with explicit layer_types */
  parse_ok(nohd,
           ", 'use_sliding_window': true, 'sliding_window': 512,"
           " 'layer_types': ['full_attention', 'sliding_attention', 'full_attention', "
           "'sliding_attention']",
           &c);
  assert_int_equal(c.sliding_window, 512);
  assert_int_equal(c.layer_sliding[0], 0);
  assert_int_equal(c.layer_sliding[1], 1);
  assert_int_equal(c.layer_sliding[2], 0);
  assert_int_equal(c.layer_sliding[3], 1);
  /* Qwen3 with YaRN as its model card suggests (4.x style): the explicit factor is used */
  parse_ok(k_qwen3_8b,
           ", 'rope_scaling': {'rope_type': 'yarn', 'factor': 4.0,"
           " 'original_max_position_embeddings': 32768}",
           &c);
  assert_int_equal(c.rope.kind, KILN_ROPE_YARN);
  assert_true(c.rope.factor == 4.0);
  assert_int_equal(c.rope.original_max_position, 32768);
  assert_true(c.rope.beta_fast == 32 && c.rope.beta_slow == 1);
  assert_true(c.rope.attention_factor == 0 && c.rope.mscale == 0 && c.rope.mscale_all_dim == 0);
  assert_true(c.rope.truncate);
  assert_int_equal(kiln_rope_max_positions(&c), 40960);
}

static void test_qwen25_tied(void **state) {
  (void)state;
  kiln_model_config_t c;
  parse_ok(k_qwen25_05b, "", &c);
  assert_int_equal(c.arch, KILN_ARCH_QWEN2);
  assert_int_equal(c.hidden_size, 896);
  assert_int_equal(c.intermediate_size, 4864);
  assert_int_equal(c.num_layers, 24);
  assert_int_equal(c.num_heads, 14);
  assert_int_equal(c.num_kv_heads, 2);
  assert_int_equal(c.head_dim, 64);
  assert_int_equal(c.max_position_embeddings, 32768);
  assert_true(c.tie_word_embeddings);
  assert_true(c.qkv_bias);
  assert_false(c.o_bias);
  expect_sliding(&c, INT64_MAX, 0);
  assert_int_equal(c.rope.rotary_dim, 64);
  assert_true(c.rope.theta == 1e6);
  expect_eos(&c, 1, (const int32_t[]){151643});
}

static void test_rope_parse_variants(void **state) {
  (void)state;
  kiln_model_config_t c;
  /* linear, dynamic */
  parse_ok(k_llama2_7b, ", 'rope_scaling': {'type': 'linear', 'factor': 4.0}", &c);
  assert_int_equal(c.rope.kind, KILN_ROPE_LINEAR);
  assert_true(c.rope.factor == 4.0);
  parse_ok(k_llama2_7b, ", 'rope_scaling': {'rope_type': 'dynamic', 'factor': 2.0}", &c);
  assert_int_equal(c.rope.kind, KILN_ROPE_DYNAMIC);
  assert_true(c.rope.factor == 2.0);
  assert_int_equal(c.rope.original_max_position, 4096);
  assert_int_equal(kiln_rope_max_positions(&c), 8192);
  /* dynamic uses max_position_embeddings even when the object names an original length */
  parse_ok(k_llama2_7b,
           ", 'rope_scaling': {'rope_type': 'dynamic', 'factor': 2.0,"
           " 'original_max_position_embeddings': 1024}",
           &c);
  assert_int_equal(c.rope.original_max_position, 4096);
  /* partial rotary: top level, and inside rope_parameters */
  parse_ok(k_llama2_7b, ", 'partial_rotary_factor': 0.5", &c);
  assert_int_equal(c.rope.rotary_dim, 64);
  parse_ok(k_llama2_7b,
           ", 'partial_rotary_factor': 0.5,"
           " 'rope_parameters': {'rope_type': 'default', 'rope_theta': 10000.0,"
           " 'partial_rotary_factor': 0.25}",
           &c);
  assert_int_equal(c.rope.rotary_dim, 32);
  /* yarn, every key */
  parse_ok(k_llama2_7b,
           ", 'rope_scaling': {'rope_type': 'yarn', 'factor': 40.0, 'beta_fast': 16,"
           " 'beta_slow': 2, 'mscale': 0.707, 'mscale_all_dim': 0.5, 'attention_factor': 1.25,"
           " 'original_max_position_embeddings': 1024, 'truncate': false}",
           &c);
  assert_int_equal(c.rope.kind, KILN_ROPE_YARN);
  assert_true(c.rope.factor == 40.0);
  assert_true(c.rope.beta_fast == 16 && c.rope.beta_slow == 2);
  assert_true(c.rope.mscale == 0.707 && c.rope.mscale_all_dim == 0.5);
  assert_true(c.rope.attention_factor == 1.25);
  assert_int_equal(c.rope.original_max_position, 1024);
  assert_false(c.rope.truncate);
  /* yarn: beta 0 / null mean the defaults ("or 32"); truncate null means false */
  parse_ok(k_llama2_7b,
           ", 'rope_scaling': {'rope_type': 'yarn', 'factor': 2.0, 'beta_fast': 0,"
           " 'beta_slow': null, 'truncate': null}",
           &c);
  assert_true(c.rope.beta_fast == 32 && c.rope.beta_slow == 1);
  assert_false(c.rope.truncate);
  assert_int_equal(c.rope.original_max_position, 4096); /* defaults to max_position_embeddings */
  /* yarn, v5: factor null is derived from max / original */
  parse_ok(k_llama2_7b,
           ", 'rope_parameters': {'rope_type': 'yarn', 'rope_theta': 10000.0, 'factor': null,"
           " 'original_max_position_embeddings': 1024}",
           &c);
  assert_true(c.rope.factor == 4.0);
  /* a top-level original_max_position_embeddings wins (transformers 5) */
  parse_ok(k_llama2_7b,
           ", 'original_max_position_embeddings': 2048, 'rope_scaling': {'rope_type': 'yarn',"
           " 'factor': 2.0, 'original_max_position_embeddings': 1024}",
           &c);
  assert_int_equal(c.rope.original_max_position, 2048);
  /* an empty rope_scaling falls through to rope_parameters */
  parse_ok(k_llama2_7b,
           ", 'rope_scaling': {}, 'rope_parameters': {'rope_type': 'linear', 'factor': 2.0}", &c);
  assert_int_equal(c.rope.kind, KILN_ROPE_LINEAR);
  /* activations */
  parse_ok(k_llama2_7b, ", 'hidden_act': 'gelu_pytorch_tanh'", &c);
  assert_int_equal(c.hidden_act, KILN_HAL_ACT_GELU_TANH);
  parse_ok(k_llama2_7b, ", 'hidden_act': 'gelu_new'", &c);
  assert_int_equal(c.hidden_act, KILN_HAL_ACT_GELU_TANH);
  parse_ok(k_llama2_7b, ", 'hidden_act': 'gelu'", &c);
  assert_int_equal(c.hidden_act, KILN_HAL_ACT_GELU);
  /* ignored keys and harmless nulls */
  parse_ok(k_llama2_7b,
           ", 'pretraining_tp': 2, 'attn_logit_softcapping': null, 'final_logit_softcapping': null,"
           " 'quantization_config': null, 'num_key_value_heads': null, 'pad_token_id': -1",
           &c);
  assert_int_equal(c.num_kv_heads, 32);
  assert_int_equal(c.pad_token_id, -1);
  /* model_type inferred from architectures; eos dedup */
  parse_ok(k_llama2_7b, ", 'model_type': null, 'eos_token_id': [2, 2, 7, 2]", &c);
  assert_int_equal(c.arch, KILN_ARCH_LLAMA);
  expect_eos(&c, 2, (const int32_t[]){2, 7});
  assert_string_equal(kiln_arch_name(KILN_ARCH_QWEN3), "Qwen3ForCausalLM");
  assert_string_equal(kiln_arch_name(KILN_ARCH_MISTRAL), "MistralForCausalLM");
}

/* ---- refusals ----------------------------------------------------------------------------- */

static void test_exact_message(void **state) {
  (void)state;
  char *json = with(k_llama2_7b, ", 'num_attention_heads': 'abc'");
  kiln_model_config_t c;
  kiln_status_t st = parse_text(json, "/m/config.json", &c);
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  assert_string_equal(kiln_status_message(st),
                      "/m/config.json: num_attention_heads: want a positive integer, got \"abc\" "
                      "(string)");
  kiln_status_free(st);
  free(json);
}

static void test_quant_config(void **state) {
  (void)state;
  kiln_model_config_t c;
  char d[96];
  parse_ok(k_llama2_7b, "", &c);
  assert_int_equal(c.quant.method, KILN_QUANT_NONE);
  parse_ok(k_llama2_7b,
           ", 'quantization_config': {'quant_method': 'gptq', 'bits': 4, 'group_size': 128, "
           "'desc_act': true, 'sym': false, 'damp_percent': 0.01}",
           &c);
  assert_int_equal(c.quant.method, KILN_QUANT_GPTQ);
  assert_int_equal(c.quant.bits, 4);
  assert_int_equal(c.quant.group_size, 128);
  assert_true(c.quant.desc_act && !c.quant.sym && c.quant.zero_minus_one);
  kiln_model_quant_describe(&c.quant, d, sizeof(d));
  assert_string_equal(d, "gptq 4-bit, group 128, asym, desc_act, gptq (v1)");
  parse_ok(k_llama2_7b,
           ", 'quantization_config': {'quant_method': 'gptq', 'bits': 8, 'group_size': -1, "
           "'checkpoint_format': 'gptq_v2'}",
           &c);
  assert_int_equal(c.quant.bits, 8);
  assert_int_equal(c.quant.group_size, -1);
  assert_true(c.quant.sym && !c.quant.desc_act && !c.quant.zero_minus_one);
  parse_ok(k_llama2_7b,
           ", 'quantization_config': {'quant_method': 'awq', 'bits': 4, 'group_size': 64, "
           "'version': 'GEMM', 'zero_point': true, 'modules_to_not_convert': ['lm_head']}",
           &c);
  assert_int_equal(c.quant.method, KILN_QUANT_AWQ);
  assert_int_equal(c.quant.group_size, 64);
  kiln_model_quant_describe(&c.quant, d, sizeof(d));
  assert_string_equal(d, "awq 4-bit, group 64");
  parse_ok(k_llama2_7b, ", 'quantization_config': null", &c);
  assert_int_equal(c.quant.method, KILN_QUANT_NONE);
}

/* FP8: compressed-tensors (llm-compressor's FP8 / FP8-dynamic) and quant_method fp8 blocks. */
#define CT_FP8(weights, acts, extra)                                                        \
  ", 'quantization_config': {'quant_method': 'compressed-tensors', 'format': "              \
  "'float-quantized', 'quantization_status': 'compressed', 'config_groups': {'group_0': "   \
  "{'targets': ['Linear'], 'weights': {'num_bits': 8, 'type': 'float', 'symmetric': true, " \
  "'dynamic': false, " weights "}, 'input_activations': " acts                              \
  ", 'output_activations': null}}" extra "}"

static void test_fp8_config(void **state) {
  (void)state;
  kiln_model_config_t c;
  char d[128];
  parse_ok(k_llama2_7b,
           CT_FP8("'strategy': 'channel'",
                  "{'num_bits': 8, 'type': 'float', 'symmetric': true, 'dynamic': true, "
                  "'strategy': 'token'}",
                  ", 'ignore': ['lm_head', 're:.*mlp\\\\.down_proj$'], 'kv_cache_scheme': null"),
           &c);
  assert_int_equal(c.quant.method, KILN_QUANT_FP8);
  assert_int_equal(c.quant.fp8_scheme, KILN_FP8_CHANNEL);
  assert_true(c.quant.act_quantized && !c.quant.act_static && !c.quant.scale_inv);
  assert_int_equal(c.quant.n_ignore, 2);
  assert_true(kiln_quant_ignored(&c.quant, "lm_head"));
  assert_true(kiln_quant_ignored(&c.quant, "model.layers.3.mlp.down_proj"));
  assert_false(kiln_quant_ignored(&c.quant, "model.layers.3.mlp.up_proj"));
  kiln_model_quant_describe(&c.quant, d, sizeof(d));
  assert_string_equal(d, "fp8 e4m3, per-channel weight scales, activations not quantized (W8A16)");
  parse_ok(k_llama2_7b,
           CT_FP8("'strategy': 'tensor'",
                  "{'num_bits': 8, 'type': 'float', 'dynamic': false, 'strategy': 'tensor'}", ""),
           &c);
  assert_int_equal(c.quant.fp8_scheme, KILN_FP8_TENSOR);
  assert_true(c.quant.act_static);
  parse_ok(k_llama2_7b, CT_FP8("'strategy': 'block', 'block_structure': [128, 128]", "null", ""),
           &c);
  assert_int_equal(c.quant.fp8_scheme, KILN_FP8_BLOCK);
  assert_int_equal(c.quant.block_n, 128);
  assert_false(c.quant.act_quantized);
  kiln_model_quant_describe(&c.quant, d, sizeof(d));
  assert_string_equal(d, "fp8 e4m3, 128x128-block weight scales, weight-only");
  parse_ok(k_llama2_7b,
           ", 'quantization_config': {'quant_method': 'fp8', 'fmt': 'e4m3', "
           "'activation_scheme': 'dynamic', 'weight_block_size': [128, 64], "
           "'modules_to_not_convert': ['lm_head']}",
           &c);
  assert_int_equal(c.quant.method, KILN_QUANT_FP8);
  assert_int_equal(c.quant.fp8_scheme, KILN_FP8_BLOCK);
  assert_true(c.quant.scale_inv);
  assert_int_equal(c.quant.block_n, 128);
  assert_int_equal(c.quant.block_k, 64);
  assert_int_equal(c.quant.n_ignore, 1);
  /* AutoFP8: no blocks, per-tensor weight_scale, ignored_layers. */
  parse_ok(k_llama2_7b,
           ", 'quantization_config': {'quant_method': 'fp8', 'activation_scheme': 'static', "
           "'ignored_layers': ['lm_head']}",
           &c);
  assert_int_equal(c.quant.fp8_scheme, KILN_FP8_TENSOR);
  assert_true(c.quant.act_static && !c.quant.scale_inv);
  assert_int_equal(c.quant.n_ignore, 1);

  const kiln_status_code_t U = KILN_ERR_UNSUPPORTED;
  parse_err(k_llama2_7b,
            ", 'quantization_config': {'quant_method': 'compressed-tensors', 'format': "
            "'pack-quantized'}",
            U, "quantization_config.format", "pack-quantized");
  parse_err(k_llama2_7b, CT_FP8("'strategy': 'group', 'group_size': 128", "null", ""), U,
            "weights.strategy", "\"group\"");
  parse_err(k_llama2_7b, CT_FP8("'strategy': 'channel', 'actorder': 'group'", "null", ""), U,
            "weights.actorder", "group");
  parse_err(
      k_llama2_7b,
      CT_FP8("'strategy': 'channel'", "{'num_bits': 4, 'type': 'float', 'strategy': 'token'}", ""),
      U, "input_activations.num_bits", "4");
  parse_err(
      k_llama2_7b,
      CT_FP8("'strategy': 'channel'", "{'num_bits': 8, 'type': 'int', 'strategy': 'token'}", ""), U,
      "input_activations.type", "\"int\"");
  parse_err(k_llama2_7b, CT_FP8("'strategy': 'channel'", "null", ", 'ignore': 'lm_head'"),
            KILN_ERR_INVALID_ARGUMENT, "quantization_config.ignore", "list");
  parse_err(k_llama2_7b,
            ", 'quantization_config': {'quant_method': 'fp8', 'fmt': 'e5m2', "
            "'weight_block_size': [128, 128]}",
            U, "quantization_config.fmt", "e5m2");
  parse_err(k_llama2_7b,
            ", 'quantization_config': {'quant_method': 'fp8', 'weight_block_size': [128]}",
            KILN_ERR_INVALID_ARGUMENT, "quantization_config.weight_block_size", "[rows, columns]");
  parse_err(k_llama2_7b,
            ", 'quantization_config': {'quant_method': 'fp8', 'activation_scheme': 'none'}", U,
            "quantization_config.activation_scheme", "\"none\"");
  parse_err(k_llama2_7b,
            ", 'quantization_config': {'quant_method': 'fp8', 'modules_to_not_convert': "
            "['re:(']}",
            KILN_ERR_INVALID_ARGUMENT, "modules_to_not_convert[0]", "regular expression");
}

static void test_unsupported(void **state) {
  (void)state;
  const kiln_status_code_t U = KILN_ERR_UNSUPPORTED;
  parse_err(k_llama2_7b, ", 'model_type': 'gpt2'", U, "model_type", "\"gpt2\"");
  parse_err(k_llama2_7b, ", 'model_type': 'gemma2'", U, "supported: llama", "qwen3");
  parse_err(k_llama2_7b, ", 'architectures': ['MistralForCausalLM']", U, "architectures",
            "MistralForCausalLM");
  parse_err(k_llama2_7b, ", 'architectures': ['LlamaForSequenceClassification']", U,
            "architectures", "LlamaForSequenceClassification");
  parse_err(k_llama2_7b, ", 'model_type': null, 'architectures': ['GPT2LMHeadModel']", U,
            "architectures", "GPT2LMHeadModel");
  parse_err(k_llama2_7b, ", 'hidden_act': 'relu'", U, "hidden_act", "\"relu\"");
  parse_err(k_llama2_7b, ", 'torch_dtype': 'float64'", U, "torch_dtype", "float64");
  parse_err(k_llama32_1b_v5, ", 'dtype': 'int8'", U, "dtype", "int8");
  /* quantization_config: GPTQ 4/8-bit (v1, v2) and AWQ 4-bit GEMM only (test_quant_config). */
  parse_err(k_llama2_7b, ", 'quantization_config': {'quant_method': 'bitsandbytes'}", U,
            "quantization_config", "\"bitsandbytes\"");
  parse_err(k_llama2_7b, ", 'quantization_config': {'quant_method': 'gptq', 'bits': 3}", U,
            "quantization_config.bits", "4 or 8");
  parse_err(k_llama2_7b, ", 'quantization_config': {'quant_method': 'gptq', 'bits': 2}", U,
            "quantization_config.bits", "2");
  parse_err(k_llama2_7b, ", 'quantization_config': {'quant_method': 'awq', 'bits': 8}", U,
            "quantization_config.bits", "AWQ runs with 4 bits");
  parse_err(k_llama2_7b, ", 'quantization_config': {'quant_method': 'awq', 'version': 'gemv'}", U,
            "quantization_config.version", "gemv");
  parse_err(k_llama2_7b, ", 'quantization_config': {'quant_method': 'awq', 'version': 'exllama'}",
            U, "quantization_config.version", "exllama");
  parse_err(k_llama2_7b, ", 'quantization_config': {'quant_method': 'awq', 'zero_point': false}",
            U, "quantization_config.zero_point", "without zero points");
  parse_err(k_llama2_7b,
            ", 'quantization_config': {'quant_method': 'gptq', 'checkpoint_format': 'marlin'}", U,
            "quantization_config.checkpoint_format", "marlin");
  parse_err(k_llama2_7b,
            ", 'quantization_config': {'quant_method': 'gptq', 'is_marlin_format': true}", U,
            "quantization_config.is_marlin_format", "Marlin");
  parse_err(k_llama2_7b, ", 'quantization_config': {'quant_method': 'gptq', 'lm_head': true}", U,
            "quantization_config.lm_head", "lm_head");
  parse_err(k_llama2_7b, ", 'quantization_config': {'quant_method': 'gptq', 'group_size': 0}", U,
            "quantization_config.group_size", "-1");
  parse_err(k_llama2_7b, ", 'attn_logit_softcapping': 50.0", U, "attn_logit_softcapping", "50");
  parse_err(k_llama2_7b, ", 'final_logit_softcapping': 30.0", U, "final_logit_softcapping", "30");
  parse_err(k_llama2_7b, ", 'rope_scaling': {'type': 'su', 'factor': 2.0}", U, "rope_scaling.type",
            "\"su\"");
  parse_err(k_llama2_7b,
            ", 'rope_scaling': {'rope_type': 'longrope', 'short_factor': [1], 'long_factor': [1]}",
            U, "rope_scaling.rope_type", "\"longrope\"");
  parse_err(k_qwen2_7b, ", 'rope_scaling': {'type': 'mrope', 'mrope_section': [16, 24, 24]}", U,
            "rope_scaling.type", "\"mrope\"");
  parse_err(k_llama32_1b_v5, ", 'rope_parameters': {'rope_type': 'proportional', 'factor': 2.0}", U,
            "rope_parameters.rope_type", "\"proportional\"");
  parse_err(k_llama2_7b, ", 'rope_scaling': {'rope_type': 'dynamic-ntk', 'factor': 2.0}", U,
            "dynamic-ntk", "supported: default, linear, dynamic, llama3, yarn");
  parse_err(k_llama32_1b_v5,
            ", 'rope_parameters': {'full_attention':"
            " {'rope_type': 'default', 'rope_theta': 10000.0}}",
            U, "rope_parameters.full_attention", "per-layer");
  parse_err(k_llama2_7b, ", 'num_hidden_layers': 1000", U, "num_hidden_layers", "1000");
  parse_err(k_qwen3_8b,
            ", 'num_hidden_layers': 2, 'layer_types': ['full_attention', 'chunked_attention']", U,
            "layer_types[1]", "chunked_attention");
  parse_err(k_mistral_7b,
            ", 'num_hidden_layers': 2, 'layer_types': ['full_attention', 'sliding_attention']", U,
            "layer_types[0]", "ignores layer_types");
  parse_err(k_llama2_7b,
            ", 'num_hidden_layers': 2, 'layer_types': ['sliding_attention', 'full_attention']", U,
            "layer_types[0]", "llama");
}

static void test_invalid(void **state) {
  (void)state;
  const kiln_status_code_t I = KILN_ERR_INVALID_ARGUMENT;
  const char *bare =
      "{'model_type': 'llama', 'vocab_size': 100, 'hidden_size': 64, 'intermediate_size': 128,"
      " 'num_hidden_layers': 2, 'max_position_embeddings': 256 %s}";
  parse_err(bare, "", I, "num_attention_heads", "missing");
  parse_err(bare, ", 'num_attention_heads': 0", I, "num_attention_heads", "got 0 (number)");
  parse_err(bare, ", 'num_attention_heads': -4", I, "num_attention_heads", "-4");
  parse_err(bare, ", 'num_attention_heads': 2.5", I, "num_attention_heads", "2.5");
  parse_err(bare, ", 'num_attention_heads': true", I, "num_attention_heads", "true (bool)");
  parse_err(bare, ", 'num_attention_heads': null", I, "num_attention_heads", "null");
  parse_err(k_llama2_7b, ", 'vocab_size': [1]", I, "vocab_size", "array");
  parse_err(k_llama2_7b, ", 'hidden_size': {}", I, "hidden_size", "object");
  parse_err(k_llama2_7b, ", 'max_position_embeddings': 'x'", I, "max_position_embeddings", NULL);
  parse_err(k_llama2_7b, ", 'intermediate_size': 0", I, "intermediate_size", NULL);
  parse_err(k_llama2_7b, ", 'num_key_value_heads': 5", I, "num_key_value_heads", "5");
  parse_err(k_llama2_7b, ", 'num_key_value_heads': 64", I, "num_key_value_heads", "64");
  parse_err(k_llama2_7b, ", 'head_dim': 127", I, "head_dim", "127");
  parse_err(k_llama2_7b, ", 'head_dim': 2048", I, "head_dim", "2048");
  parse_err(k_llama2_7b, ", 'rms_norm_eps': 0", I, "rms_norm_eps", NULL);
  parse_err(k_llama2_7b, ", 'rms_norm_eps': '1e-5'", I, "rms_norm_eps", "string");
  parse_err(k_llama2_7b, ", 'tie_word_embeddings': 'yes'", I, "tie_word_embeddings", "\"yes\"");
  parse_err(k_llama2_7b, ", 'attention_bias': 1", I, "attention_bias", NULL);
  parse_err(k_llama2_7b, ", 'hidden_act': 7", I, "hidden_act", NULL);
  parse_err(k_llama2_7b, ", 'torch_dtype': 16", I, "torch_dtype", NULL);
  parse_err(k_llama2_7b, ", 'model_type': 3", I, "model_type", NULL);
  parse_err(k_llama2_7b, ", 'architectures': 'LlamaForCausalLM'", I, "architectures", NULL);
  parse_err(k_llama2_7b, ", 'architectures': null, 'model_type': null", I, "model_type", "missing");
  /* rope */
  parse_err(k_llama2_7b, ", 'rope_theta': -1", I, "rope_theta", NULL);
  parse_err(k_llama2_7b, ", 'rope_theta': 'big'", I, "rope_theta", NULL);
  parse_err(k_llama2_7b, ", 'rope_scaling': 'linear'", I, "rope_scaling", NULL);
  parse_err(k_llama2_7b, ", 'rope_scaling': {'type': 'linear'}", I, "rope_scaling.factor",
            "missing");
  parse_err(k_llama2_7b, ", 'rope_scaling': {'type': 'linear', 'factor': 0.5}", I,
            "rope_scaling.factor", "0.5");
  parse_err(k_llama2_7b, ", 'rope_scaling': {'type': 'dynamic', 'factor': 'x'}", I,
            "rope_scaling.factor", NULL);
  parse_err(k_llama2_7b, ", 'rope_scaling': {'type': 7, 'factor': 2.0}", I, "rope_scaling.type",
            NULL);
  parse_err(k_llama31_8b,
            ", 'rope_scaling': {'rope_type': 'llama3', 'factor': 8.0, 'high_freq_factor': 4.0,"
            " 'original_max_position_embeddings': 8192}",
            I, "rope_scaling.low_freq_factor", "missing");
  parse_err(k_llama31_8b,
            ", 'rope_scaling': {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 4.0,"
            " 'high_freq_factor': 4.0, 'original_max_position_embeddings': 8192}",
            I, "high_freq_factor", NULL);
  parse_err(k_llama31_8b,
            ", 'rope_scaling': {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0,"
            " 'high_freq_factor': 4.0, 'original_max_position_embeddings': 0}",
            I, "rope_scaling.original_max_position_embeddings", NULL);
  parse_err(k_llama2_7b, ", 'rope_scaling': {'rope_type': 'yarn', 'factor': 2.0, 'truncate': 'no'}",
            I, "rope_scaling.truncate", NULL);
  parse_err(k_llama2_7b,
            ", 'rope_scaling': {'rope_type': 'yarn', 'factor': 2.0, 'attention_factor': -1.0}", I,
            "attention_factor", NULL);
  parse_err(k_llama2_7b, ", 'rope_scaling': {'rope_type': 'yarn', 'factor': 2.0, 'beta_fast': -3}",
            I, "beta_fast", NULL);
  parse_err(k_llama2_7b, ", 'rope_scaling': {'rope_type': 'yarn', 'factor': 2.0, 'mscale': 'x'}", I,
            "rope_scaling.mscale", NULL);
  parse_err(k_llama2_7b, ", 'partial_rotary_factor': 1.5", I, "partial_rotary_factor", NULL);
  parse_err(k_llama2_7b, ", 'partial_rotary_factor': 0.2", I, "rotary_dim: 25", NULL); /* 25.6 */
  /* sliding windows, layer types */
  parse_err(k_mistral_7b, ", 'sliding_window': -5", I, "sliding_window", "-5");
  parse_err(k_mistral_7b, ", 'sliding_window': 'all'", I, "sliding_window", NULL);
  parse_err(k_qwen2_7b, ", 'use_sliding_window': 'yes'", I, "use_sliding_window", NULL);
  parse_err(k_qwen2_7b, ", 'use_sliding_window': true, 'max_window_layers': -1", I,
            "max_window_layers", NULL);
  parse_err(k_qwen3_8b, ", 'layer_types': ['full_attention']", I, "layer_types", "36");
  parse_err(k_qwen3_8b, ", 'layer_types': 'full_attention'", I, "layer_types", NULL);
  parse_err(k_qwen3_8b, ", 'num_hidden_layers': 2, 'layer_types': ['full_attention', 3]", I,
            "layer_types[1]", NULL);
  parse_err(k_qwen3_8b,
            ", 'num_hidden_layers': 2, 'layer_types': ['full_attention', 'sliding_attention']", I,
            "layer_types[1]", "no sliding window");
  /* token ids */
  parse_err(k_llama2_7b, ", 'eos_token_id': 'x'", I, "eos_token_id", NULL);
  parse_err(k_llama2_7b, ", 'eos_token_id': [1, 'x']", I, "eos_token_id[1]", NULL);
  parse_err(k_llama2_7b, ", 'eos_token_id': [1, 2, 3, 4, 5, 6, 7, 8, 9]", I, "eos_token_id",
            "more than 8");
  parse_err(k_llama2_7b, ", 'bos_token_id': -7", I, "bos_token_id", NULL);
  parse_err(k_llama2_7b, ", 'pad_token_id': 4294967296", I, "pad_token_id", NULL);
  /* not an object */
  kiln_json_doc_t *doc = NULL;
  assert_null(kiln_json_parse("[1]", 3, "t", &doc));
  kiln_model_config_t c;
  kiln_status_t st = kiln_model_config_parse(kiln_json_root(doc), "/m/config.json", &c);
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(kiln_status_message(st), "/m/config.json: "));
  kiln_status_free(st);
  kiln_json_doc_free(doc);
}

static void test_validate(void **state) {
  (void)state;
  kiln_model_config_t c, d;
  parse_ok(k_llama31_8b, "", &c);
  assert_null(kiln_model_config_validate(&c, "x"));
  for (int i = 0; i < KILN_ROPE_MAX_FREQS; i++) c.rope.freq_factors[i] = 1; /* unused: n = 0 */
#define CHECK_BAD(stmt, frag)                                                    \
  do {                                                                           \
    d = c;                                                                       \
    stmt;                                                                        \
    kiln_status_t st_ = kiln_model_config_validate(&d, "gguf:x");                \
    if (!st_) fail_msg("validate accepted: %s", #stmt);                          \
    if (strncmp(kiln_status_message(st_), "gguf:x: ", 8) != 0 ||                 \
        !strstr(kiln_status_message(st_), frag))                                 \
      fail_msg("%s: got %s, want ...%s", #stmt, kiln_status_message(st_), frag); \
    kiln_status_free(st_);                                                       \
  } while (0)
  CHECK_BAD(d.vocab_size = 0, "vocab_size");
  CHECK_BAD(d.num_layers = KILN_MODEL_MAX_LAYERS + 1, "num_hidden_layers");
  CHECK_BAD(d.num_kv_heads = 3, "num_key_value_heads: 3");
  CHECK_BAD(d.head_dim = 1026, "head_dim: 1026");
  CHECK_BAD(d.rms_norm_eps = NAN, "rms_norm_eps");
  CHECK_BAD(d.rope.theta = 0, "rope_theta");
  CHECK_BAD(d.rope.theta = INFINITY, "rope_theta");
  CHECK_BAD(d.rope.rotary_dim = 130, "rotary_dim: 130");
  CHECK_BAD(d.rope.rotary_dim = 63, "rotary_dim: 63");
  CHECK_BAD(d.rope.factor = 0.5, "factor");
  CHECK_BAD(d.rope.factor = NAN, "factor");
  CHECK_BAD(d.rope.high_freq_factor = 0.5, "high_freq_factor");
  CHECK_BAD(d.rope.original_max_position = 0, "original_max_position_embeddings");
  CHECK_BAD(d.rope.n_freq_factors = 3, "freq_factors");
  CHECK_BAD((d.rope.n_freq_factors = 64, d.rope.freq_factors[5] = 0), "freq_factors[5]");
  CHECK_BAD(d.rope.style = 9, "rope.style");
  CHECK_BAD(d.rope.kind = 9, "rope.kind");
  CHECK_BAD(d.hidden_act = 7, "hidden_act");
  CHECK_BAD(d.dtype = KILN_HAL_I32, "dtype");
  CHECK_BAD(d.layer_sliding[3] = 1, "layer 3");
  CHECK_BAD(d.num_eos = 9, "eos_token_id");
  CHECK_BAD((d.has_top_p = true, d.top_p = 2), "top_p");
  CHECK_BAD((d.rope.kind = KILN_ROPE_YARN, d.rope.beta_fast = 0), "beta_fast");
  CHECK_BAD((d.rope.kind = KILN_ROPE_YARN, d.rope.beta_fast = 32, d.rope.beta_slow = 1,
             d.rope.theta = 1.0),
            "rope_theta");
  CHECK_BAD((d.rope.kind = KILN_ROPE_DYNAMIC, d.rope.rotary_dim = 2), "rotary_dim");
#undef CHECK_BAD
}

/* ---- generation_config.json, loading ------------------------------------------------------- */

static void test_generation(void **state) {
  (void)state;
  kiln_model_config_t c;
  /* Llama 3.1 Instruct: config.json eos 128001 (base), generation_config's list */
  parse_ok(k_llama31_8b, ", 'eos_token_id': 128001", &c);
  assert_null(
      parse_gen_text("{'bos_token_id': 128000, 'do_sample': true, 'eos_token_id': [128001,"
                     " 128008, 128009], 'temperature': 0.6, 'top_p': 0.9,"
                     " 'transformers_version': '4.42.3'}",
                     &c));
  expect_eos(&c, 3, (const int32_t[]){128001, 128008, 128009});
  assert_true(c.do_sample);
  assert_true(c.has_temperature && c.temperature == 0.6);
  assert_true(c.has_top_p && c.top_p == 0.9);
  assert_false(c.has_top_k || c.has_repetition_penalty);
  /* Qwen2.5 Instruct: generation ids first, then config's */
  parse_ok(k_qwen25_05b, ", 'eos_token_id': 151643", &c);
  assert_null(
      parse_gen_text("{'bos_token_id': 151643, 'pad_token_id': 151643, 'do_sample': true,"
                     " 'eos_token_id': [151645, 151643], 'repetition_penalty': 1.1,"
                     " 'temperature': 0.7, 'top_p': 0.8, 'top_k': 20}",
                     &c));
  expect_eos(&c, 2, (const int32_t[]){151645, 151643});
  assert_int_equal(c.pad_token_id, 151643);
  assert_int_equal(c.bos_token_id, 151643);
  assert_true(c.has_top_k && c.top_k == 20);
  assert_true(c.has_repetition_penalty && c.repetition_penalty == 1.1);
  /* int eos merges in front; nulls leave the config's values */
  parse_ok(k_qwen3_8b, "", &c);
  assert_null(
      parse_gen_text("{'eos_token_id': 151643, 'pad_token_id': null, 'temperature': null}", &c));
  expect_eos(&c, 2, (const int32_t[]){151643, 151645});
  assert_false(c.has_temperature);
  /* errors name the file and key, and leave cfg untouched */
  parse_ok(k_qwen3_8b, "", &c);
  kiln_model_config_t before = c;
  static const struct {
    const char *text, *frag;
  } bad[] = {
      {"{'temperature': 'hot'}", "temperature"},
      {"{'temperature': -1}", "temperature"},
      {"{'top_p': 1.5}", "top_p"},
      {"{'top_k': -1}", "top_k"},
      {"{'top_k': 2.5}", "top_k"},
      {"{'repetition_penalty': 0}", "repetition_penalty"},
      {"{'do_sample': 1}", "do_sample"},
      {"{'eos_token_id': [1, 2, 3, 4, 5, 6, 7, 8]}", "eos_token_id"}, /* 9 with config's */
      {"{'eos_token_id': {}}", "eos_token_id"},
      {"{'bos_token_id': 'a', 'top_k': 5}", "bos_token_id"},
      {"[]", "/m/generation_config.json"},
  };
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    kiln_status_t st = parse_gen_text(bad[i].text, &c);
    if (!st) fail_msg("accepted %s", bad[i].text);
    const char *msg = kiln_status_message(st);
    if (strncmp(msg, "/m/generation_config.json: ", 27) != 0 || !strstr(msg, bad[i].frag))
      fail_msg("%s: got %s", bad[i].text, msg);
    kiln_status_free(st);
    assert_memory_equal(&c, &before, sizeof(c));
  }
}

static void write_file(const char *dir, const char *file, const char *text) {
  char path[512];
  snprintf(path, sizeof(path), "%s/%s", dir, file);
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  char *t = q(text);
  fputs(t, f);
  free(t);
  fclose(f);
}

static void test_load(void **state) {
  (void)state;
  char dir[] = "/tmp/kiln_test_model_config_XXXXXX";
  assert_non_null(mkdtemp(dir));
  kiln_model_config_t c;
  char path[600];
  /* no config.json */
  kiln_status_t st = kiln_model_config_load(dir, &c);
  assert_int_equal(kiln_status_code(st), KILN_ERR_NOT_FOUND);
  assert_non_null(strstr(kiln_status_message(st), "config.json"));
  kiln_status_free(st);
  /* config.json alone */
  char *cfg = with(k_qwen25_05b, "");
  snprintf(path, sizeof(path), "%s/config.json", dir);
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fputs(cfg, f);
  fclose(f);
  free(cfg);
  assert_null(kiln_model_config_load(dir, &c));
  assert_int_equal(c.hidden_size, 896);
  expect_eos(&c, 1, (const int32_t[]){151643});
  /* with generation_config.json (and a trailing slash on the directory) */
  write_file(dir, "generation_config.json", "{'eos_token_id': [151645, 151643], 'top_k': 20}");
  char slash[600];
  snprintf(slash, sizeof(slash), "%s/", dir);
  assert_null(kiln_model_config_load(slash, &c));
  expect_eos(&c, 2, (const int32_t[]){151645, 151643});
  assert_true(c.has_top_k && c.top_k == 20);
  /* a malformed generation_config.json is an error naming it */
  write_file(dir, "generation_config.json", "{'top_k': 20,}");
  st = kiln_model_config_load(dir, &c);
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(kiln_status_message(st), "generation_config.json"));
  kiln_status_free(st);
  write_file(dir, "generation_config.json", "{'top_k': 'many'}");
  st = kiln_model_config_load(dir, &c);
  assert_non_null(strstr(kiln_status_message(st), "generation_config.json: top_k"));
  kiln_status_free(st);
  /* a bad config.json names its path */
  write_file(dir, "config.json", "{'model_type': 'bert'}");
  st = kiln_model_config_load(dir, &c);
  assert_int_equal(kiln_status_code(st), KILN_ERR_UNSUPPORTED);
  snprintf(path, sizeof(path), "%s/config.json: model_type", dir);
  assert_non_null(strstr(kiln_status_message(st), path));
  kiln_status_free(st);
  snprintf(path, sizeof(path), "%s/config.json", dir);
  unlink(path);
  snprintf(path, sizeof(path), "%s/generation_config.json", dir);
  unlink(path);
  rmdir(dir);
}

/* ---- rope against an fp64 reference -------------------------------------------------------- */

/* transformers' formulas in double, nothing shared with rope.c. */
static void ref_inv_freq(const kiln_rope_config_t *rc, int64_t max_pos, double *inv, double *attn) {
  const int r = rc->rotary_dim, half = r / 2;
  const double pi = 3.14159265358979323846;
  double base = rc->theta;
  *attn = 1.0;
  if (rc->kind == KILN_ROPE_DYNAMIC) {
    double orig = (double)(rc->original_max_position ? rc->original_max_position : max_pos);
    double L = orig * rc->factor; /* the longest context (rope.h) */
    base *= pow(rc->factor * L / orig - (rc->factor - 1), (double)r / (r - 2));
  }
  for (int i = 0; i < half; i++) inv[i] = 1.0 / pow(base, 2.0 * i / r);
  if (rc->kind == KILN_ROPE_LINEAR)
    for (int i = 0; i < half; i++) inv[i] /= rc->factor;
  if (rc->kind == KILN_ROPE_LLAMA3) {
    double old = (double)rc->original_max_position;
    double low_wl = old / rc->low_freq_factor, high_wl = old / rc->high_freq_factor;
    for (int i = 0; i < half; i++) {
      double wl = 2 * pi / inv[i];
      if (wl < high_wl) continue;
      if (wl > low_wl) {
        inv[i] /= rc->factor;
        continue;
      }
      double s = (old / wl - rc->low_freq_factor) / (rc->high_freq_factor - rc->low_freq_factor);
      inv[i] = (1 - s) * inv[i] / rc->factor + s * inv[i];
    }
  }
  if (rc->kind == KILN_ROPE_YARN) {
    double f = rc->factor;
    double orig = (double)(rc->original_max_position ? rc->original_max_position : max_pos);
    double lo = r * log(orig / (rc->beta_fast * 2 * pi)) / (2 * log(rc->theta));
    double hi = r * log(orig / (rc->beta_slow * 2 * pi)) / (2 * log(rc->theta));
    if (rc->truncate) lo = floor(lo), hi = ceil(hi);
    lo = fmax(lo, 0);
    hi = fmin(hi, r - 1);
    if (lo == hi) hi += 0.001;
    for (int i = 0; i < half; i++) {
      double ramp = fmin(fmax((i - lo) / (hi - lo), 0), 1);
      double extrapolation_weight = 1 - ramp;
      inv[i] = inv[i] / f * ramp + inv[i] * extrapolation_weight;
    }
    if (rc->attention_factor > 0)
      *attn = rc->attention_factor;
    else if (rc->mscale != 0 && rc->mscale_all_dim != 0)
      *attn = (f <= 1 ? 1 : 0.1 * rc->mscale * log(f) + 1) /
              (f <= 1 ? 1 : 0.1 * rc->mscale_all_dim * log(f) + 1);
    else
      *attn = f <= 1 ? 1 : 0.1 * log(f) + 1;
  }
  for (int i = 0; i < rc->n_freq_factors; i++) inv[i] /= rc->freq_factors[i];
}

/* Compares inv_freq (1e-6 relative) and a P-row table with the reference. The table is
 * computed as PyTorch does, with the angle p * inv_freq rounded to float32, so at position p the
 * angle itself carries an error of a few ulp of p * inv_freq (~2.4e-4 rad at p = 4096, inv = 1):
 * the bound is 1e-5 plus 8 float32 ulps of the angle, times the attention factor. */
static void check_rope(const char *what, const kiln_rope_config_t *rc, int64_t max_pos, int64_t P) {
  const int half = rc->rotary_dim / 2, r = rc->rotary_dim;
  double ref[KILN_ROPE_MAX_FREQS], attn_ref;
  ref_inv_freq(rc, max_pos, ref, &attn_ref);
  float inv[KILN_ROPE_MAX_FREQS], attn = 0;
  kiln_status_t st = kiln_rope_inv_freq(rc, max_pos, inv, &attn);
  if (st) fail_msg("%s: %s", what, kiln_status_message(st));
  for (int i = 0; i < half; i++)
    if (!(fabs(inv[i] - ref[i]) <= 1e-6 * ref[i]))
      fail_msg("%s: inv_freq[%d] = %.9g, reference %.9g (rel %.3g)", what, i, (double)inv[i],
               ref[i], fabs(inv[i] - ref[i]) / ref[i]);
  if (!(fabs(attn - attn_ref) <= 1e-6 * attn_ref))
    fail_msg("%s: attention factor %.9g, reference %.9g", what, (double)attn, attn_ref);
  float *table = malloc(sizeof(float) * (size_t)(P * r));
  assert_non_null(table);
  st = kiln_rope_build_table(rc, max_pos, P, table);
  if (st) fail_msg("%s: %s", what, kiln_status_message(st));
  for (int64_t p = 0; p < P; p++)
    for (int i = 0; i < half; i++) {
      double angle = (double)p * ref[i];
      double tol = (1e-5 + 8 * angle * 0x1p-24) * attn_ref;
      double c = cos(angle) * attn_ref, s = sin(angle) * attn_ref;
      double ec = fabs(table[p * r + i] - c), es = fabs(table[p * r + half + i] - s);
      if (!(ec <= tol) || !(es <= tol))
        fail_msg("%s: p %lld i %d: cos %.8f sin %.8f, reference %.8f %.8f (tol %.3g)", what,
                 (long long)p, i, (double)table[p * r + i], (double)table[p * r + half + i], c, s,
                 tol);
    }
  free(table);
}

static kiln_rope_config_t rope_base(double theta, int32_t r) {
  kiln_rope_config_t rc;
  memset(&rc, 0, sizeof(rc));
  rc.kind = KILN_ROPE_DEFAULT;
  rc.style = KILN_HAL_ROPE_NEOX;
  rc.rotary_dim = r;
  rc.theta = theta;
  rc.factor = 1;
  rc.truncate = true;
  return rc;
}

static void test_rope_default_linear_dynamic(void **state) {
  (void)state;
  kiln_rope_config_t rc = rope_base(10000, 128);
  check_rope("llama2 default", &rc, 4096, 4096);
  rc = rope_base(1e6, 128);
  check_rope("qwen default", &rc, 32768, 4096);
  rc = rope_base(10000, 32); /* head_dim 128, partial_rotary_factor 0.25 */
  check_rope("partial rotary", &rc, 4096, 4096);
  rc = rope_base(10000, 2);
  check_rope("rotary_dim 2", &rc, 4096, 512);
  rc = rope_base(10000, 1024);
  check_rope("rotary_dim 1024", &rc, 4096, 64);
  rc = rope_base(10000, 128);
  rc.kind = KILN_ROPE_LINEAR;
  rc.factor = 4;
  check_rope("linear x4", &rc, 4096, 4096);
  rc.factor = 2.5;
  check_rope("linear x2.5", &rc, 4096, 4096);
  rc = rope_base(10000, 128);
  rc.kind = KILN_ROPE_DYNAMIC;
  rc.factor = 2;
  rc.original_max_position = 4096;
  check_rope("dynamic x2", &rc, 4096, 4096);
  rc.original_max_position = 0; /* falls back to max_position_embeddings */
  check_rope("dynamic x2, no original", &rc, 4096, 1024);
  rc = rope_base(500000, 64);
  rc.kind = KILN_ROPE_DYNAMIC;
  rc.factor = 3;
  rc.original_max_position = 2048;
  check_rope("dynamic x3 partial", &rc, 2048, 2048);
  /* the dynamic base is that of transformers at seq_len = original * factor */
  float inv[64], attn;
  rc = rope_base(10000, 128);
  rc.kind = KILN_ROPE_DYNAMIC;
  rc.factor = 2;
  rc.original_max_position = 4096;
  assert_null(kiln_rope_inv_freq(&rc, 4096, inv, &attn));
  double base = 10000 * pow(2.0 * 8192 / 4096 - 1, 128.0 / 126);
  assert_true(fabs(inv[1] - 1 / pow(base, 2.0 / 128)) < 1e-7);
  kiln_model_config_t c;
  memset(&c, 0, sizeof(c));
  c.max_position_embeddings = 4096;
  c.rope = rc;
  assert_int_equal(kiln_rope_max_positions(&c), 8192);
  c.rope.factor = 0.5; /* invalid, but max_positions never shrinks */
  assert_int_equal(kiln_rope_max_positions(&c), 4096);
  c.rope = rope_base(10000, 128);
  assert_int_equal(kiln_rope_max_positions(&c), 4096);
  /* the table layout: row p = cos(p f_0..), sin(p f_0..) */
  float t[3 * 4];
  rc = rope_base(100, 4);
  assert_null(kiln_rope_build_table(&rc, 16, 3, t));
  assert_true(t[0] == 1 && t[1] == 1 && t[2] == 0 && t[3] == 0);
  assert_true(fabsf(t[4] - cosf(1)) < 1e-7 && fabsf(t[6] - sinf(1)) < 1e-7);
  assert_true(fabsf(t[5] - cosf(0.1f)) < 1e-7 && fabsf(t[7] - sinf(0.1f)) < 1e-7);
  assert_null(kiln_rope_build_table(&rc, 16, 0, t));
}

static void test_rope_llama3(void **state) {
  (void)state;
  kiln_rope_config_t rc = rope_base(500000, 128);
  rc.kind = KILN_ROPE_LLAMA3;
  rc.factor = 8;
  rc.low_freq_factor = 1;
  rc.high_freq_factor = 4;
  rc.original_max_position = 8192;
  check_rope("llama3.1", &rc, 131072, 4096);
  /* the bands: wavelength < 2048 kept, > 8192 divided by 8, smooth in between */
  float inv[64], def[64], attn;
  assert_null(kiln_rope_inv_freq(&rc, 131072, inv, &attn));
  kiln_rope_config_t d = rope_base(500000, 128);
  assert_null(kiln_rope_inv_freq(&d, 131072, def, &attn));
  int high = 0, low = 0, mid = 0;
  for (int i = 0; i < 64; i++) {
    double wl = 2 * 3.14159265358979323846 / def[i];
    if (wl < 2048) {
      assert_true(inv[i] == def[i]);
      high++;
    } else if (wl > 8192) {
      assert_true(inv[i] == def[i] / 8.0f);
      low++;
    } else {
      assert_true(inv[i] < def[i] && inv[i] > def[i] / 8.0f);
      mid++;
    }
  }
  assert_true(high > 0 && low > 0 && mid > 0);
  /* Llama 3.2: factor 32; other band edges (both bands empty / everything smoothed) */
  rc.factor = 32;
  check_rope("llama3.2", &rc, 131072, 4096);
  rc = rope_base(10000, 64);
  rc.kind = KILN_ROPE_LLAMA3;
  rc.factor = 4;
  rc.low_freq_factor = 0.5;
  rc.high_freq_factor = 64;
  rc.original_max_position = 4096;
  check_rope("llama3 wide band", &rc, 16384, 2048);
  rc.low_freq_factor = 2;
  rc.high_freq_factor = 3;
  check_rope("llama3 band 2..3", &rc, 16384, 2048);
  /* an edge that falls on a frequency: orig / low_freq_factor == 2 pi / inv_freq[0] */
  rc = rope_base(10000, 64);
  rc.kind = KILN_ROPE_LLAMA3;
  rc.factor = 4;
  rc.original_max_position = 8192;
  rc.low_freq_factor = 8192 / (2 * 3.14159265358979323846);
  rc.high_freq_factor = rc.low_freq_factor * 2;
  check_rope("llama3 edge on f0", &rc, 16384, 1024);
  /* freq_factors (GGUF rope_freqs.weight): default / factors == llama3 */
  rc = rope_base(500000, 128);
  rc.kind = KILN_ROPE_LLAMA3;
  rc.factor = 8;
  rc.low_freq_factor = 1;
  rc.high_freq_factor = 4;
  rc.original_max_position = 8192;
  assert_null(kiln_rope_inv_freq(&rc, 131072, inv, &attn));
  kiln_rope_config_t g = rope_base(500000, 128);
  g.n_freq_factors = 64;
  for (int i = 0; i < 64; i++) g.freq_factors[i] = def[i] / inv[i];
  check_rope("freq_factors", &g, 131072, 4096);
  float ginv[64];
  assert_null(kiln_rope_inv_freq(&g, 131072, ginv, &attn));
  for (int i = 0; i < 64; i++) assert_true(fabsf(ginv[i] - inv[i]) <= 2e-7f * inv[i]);
}

static void test_rope_yarn(void **state) {
  (void)state;
  kiln_rope_config_t rc = rope_base(1e6, 128);
  rc.kind = KILN_ROPE_YARN;
  rc.factor = 4;
  rc.original_max_position = 32768;
  rc.beta_fast = 32;
  rc.beta_slow = 1;
  check_rope("qwen3 yarn x4", &rc, 40960, 4096);
  float inv[64], attn;
  assert_null(kiln_rope_inv_freq(&rc, 40960, inv, &attn));
  assert_true(fabs(attn - (0.1 * log(4.0) + 1)) < 1e-6);
  rc.truncate = false;
  check_rope("yarn no truncate", &rc, 40960, 4096);
  rc.truncate = true;
  rc.attention_factor = 0.8;
  check_rope("yarn attention_factor", &rc, 40960, 2048);
  rc.attention_factor = 0;
  /* DeepSeek-style mscale: equal -> factor 1; unequal -> ratio */
  rc = rope_base(10000, 64);
  rc.kind = KILN_ROPE_YARN;
  rc.factor = 40;
  rc.original_max_position = 4096;
  rc.beta_fast = 32;
  rc.beta_slow = 1;
  rc.mscale = 0.707;
  rc.mscale_all_dim = 0.707;
  check_rope("yarn mscale equal", &rc, 163840, 4096);
  assert_null(kiln_rope_inv_freq(&rc, 163840, inv, &attn));
  assert_true(attn == 1.0f);
  rc.mscale = 1.0;
  rc.mscale_all_dim = 0.5;
  check_rope("yarn mscale ratio", &rc, 163840, 4096);
  rc.mscale_all_dim = 0; /* only one set: plain get_mscale(factor) */
  check_rope("yarn mscale one", &rc, 163840, 4096);
  assert_null(kiln_rope_inv_freq(&rc, 163840, inv, &attn));
  assert_true(fabs(attn - (0.1 * log(40.0) + 1)) < 1e-6);
  /* other betas, partial rotary, original from max_position_embeddings, factor 1 */
  rc = rope_base(10000, 96);
  rc.kind = KILN_ROPE_YARN;
  rc.factor = 8;
  rc.beta_fast = 16;
  rc.beta_slow = 2;
  check_rope("yarn betas", &rc, 2048, 4096);
  rc.truncate = false;
  check_rope("yarn betas no truncate", &rc, 2048, 4096);
  rc.factor = 1;
  check_rope("yarn factor 1", &rc, 2048, 1024);
  /* a ramp of zero width (low == high after truncation) */
  rc = rope_base(10000, 64);
  rc.kind = KILN_ROPE_YARN;
  rc.factor = 4;
  rc.beta_fast = 2;
  rc.beta_slow = 1.9;
  rc.original_max_position = 4096;
  check_rope("yarn narrow ramp", &rc, 4096, 1024);
}

static void test_rope_errors(void **state) {
  (void)state;
  float inv[KILN_ROPE_MAX_FREQS], attn, table[16];
  static const struct {
    int field;
    double value;
    const char *frag;
  } cases[] = {
      {0, 63, "rotary_dim"}, {0, 0, "rotary_dim"}, {0, 2048, "rotary_dim"}, {1, 0, "theta"},
      {1, -5, "theta"},      {1, NAN, "theta"},    {1, INFINITY, "theta"},  {1, 1e300, "theta"},
      {2, 0.5, "factor"},    {2, NAN, "factor"},   {2, INFINITY, "factor"}, {3, 9, "kind"},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    kiln_rope_config_t rc = rope_base(10000, 64);
    rc.kind = KILN_ROPE_LINEAR;
    rc.factor = 2;
    if (cases[i].field == 0) rc.rotary_dim = (int32_t)cases[i].value;
    if (cases[i].field == 1) rc.theta = cases[i].value;
    if (cases[i].field == 2) rc.factor = cases[i].value;
    if (cases[i].field == 3) rc.kind = (int32_t)cases[i].value;
    kiln_status_t st = kiln_rope_inv_freq(&rc, 4096, inv, &attn);
    if (kiln_status_code(st) != KILN_ERR_INVALID_ARGUMENT ||
        !strstr(kiln_status_message(st), cases[i].frag))
      fail_msg("case %zu: %s", i, kiln_status_message(st));
    kiln_status_free(st);
  }
#define ROPE_BAD(setup, frag)                                      \
  do {                                                             \
    kiln_rope_config_t rc = rope_base(10000, 64);                  \
    setup;                                                         \
    kiln_status_t st = kiln_rope_build_table(&rc, 4096, 1, table); \
    if (kiln_status_code(st) != KILN_ERR_INVALID_ARGUMENT ||       \
        !strstr(kiln_status_message(st), frag))                    \
      fail_msg("%s: %s", #setup, kiln_status_message(st));         \
    kiln_status_free(st);                                          \
  } while (0)
  ROPE_BAD(rc.n_freq_factors = 5, "freq_factors");
  ROPE_BAD((rc.n_freq_factors = 32, rc.freq_factors[0] = 1), "freq_factors[1]");
  ROPE_BAD((rc.n_freq_factors = 32, rc.freq_factors[0] = NAN), "freq_factors[0]");
  ROPE_BAD((rc.kind = KILN_ROPE_LLAMA3, rc.factor = 8, rc.original_max_position = 8192,
            rc.low_freq_factor = 4, rc.high_freq_factor = 1),
           "high_freq_factor");
  ROPE_BAD(
      (rc.kind = KILN_ROPE_YARN, rc.factor = 2, rc.beta_fast = 32, rc.beta_slow = 1, rc.theta = 1),
      "theta > 1");
  ROPE_BAD((rc.kind = KILN_ROPE_YARN, rc.factor = 2, rc.beta_fast = 0, rc.beta_slow = 1), "beta");
  ROPE_BAD((rc.kind = KILN_ROPE_YARN, rc.factor = 2, rc.beta_fast = 32, rc.beta_slow = 1,
            rc.attention_factor = NAN),
           "attention_factor");
  ROPE_BAD((rc.kind = KILN_ROPE_DYNAMIC, rc.factor = 2, rc.rotary_dim = 2), "rotary_dim > 2");
  ROPE_BAD((rc.kind = KILN_ROPE_DYNAMIC, rc.factor = 1e300), "base");
  /* no original length anywhere */
  kiln_rope_config_t rc = rope_base(10000, 64);
  rc.kind = KILN_ROPE_YARN;
  rc.factor = 2;
  rc.beta_fast = 32;
  rc.beta_slow = 1;
  kiln_status_t st = kiln_rope_inv_freq(&rc, 0, inv, &attn);
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(kiln_status_message(st), "original_max_position"));
  kiln_status_free(st);
  st = kiln_rope_build_table(&rc, 4096, -1, table);
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  kiln_status_free(st);
  st = kiln_rope_inv_freq(NULL, 4096, inv, &attn);
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  kiln_status_free(st);
#undef ROPE_BAD
}

/* Every config above, parsed, builds its table (the path the model loader takes). */
static void test_parsed_configs_build(void **state) {
  (void)state;
  static const char *const configs[] = {k_llama2_7b, k_llama31_8b, k_llama32_1b_v5, k_mistral_7b,
                                        k_qwen2_7b,  k_qwen3_8b,   k_qwen25_05b};
  for (size_t i = 0; i < sizeof(configs) / sizeof(configs[0]); i++) {
    kiln_model_config_t c;
    parse_ok(configs[i], "", &c);
    check_rope(c.architecture, &c.rope, c.max_position_embeddings, 2048);
  }
  kiln_model_config_t c;
  parse_ok(k_qwen3_8b,
           ", 'rope_scaling': {'rope_type': 'yarn', 'factor': 4.0,"
           " 'original_max_position_embeddings': 32768}",
           &c);
  check_rope("qwen3 yarn parsed", &c.rope, c.max_position_embeddings, 2048);
  parse_ok(k_llama2_7b, ", 'rope_scaling': {'type': 'dynamic', 'factor': 2.0}", &c);
  check_rope("dynamic parsed", &c.rope, c.max_position_embeddings, 2048);
  parse_ok(k_llama2_7b,
           ", 'partial_rotary_factor': 0.5, 'rope_scaling': {'type': 'linear', 'factor': 2.0}", &c);
  check_rope("partial linear parsed", &c.rope, c.max_position_embeddings, 2048);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_llama2),
      cmocka_unit_test(test_llama31),
      cmocka_unit_test(test_v5_rope_parameters),
      cmocka_unit_test(test_mistral),
      cmocka_unit_test(test_qwen2),
      cmocka_unit_test(test_qwen3),
      cmocka_unit_test(test_qwen25_tied),
      cmocka_unit_test(test_rope_parse_variants),
      cmocka_unit_test(test_exact_message),
      cmocka_unit_test(test_unsupported),
      cmocka_unit_test(test_quant_config),
      cmocka_unit_test(test_fp8_config),
      cmocka_unit_test(test_invalid),
      cmocka_unit_test(test_validate),
      cmocka_unit_test(test_generation),
      cmocka_unit_test(test_load),
      cmocka_unit_test(test_rope_default_linear_dynamic),
      cmocka_unit_test(test_rope_llama3),
      cmocka_unit_test(test_rope_yarn),
      cmocka_unit_test(test_rope_errors),
      cmocka_unit_test(test_parsed_configs_build),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
