/* test_vl_config.c - Qwen2-VL / Qwen2.5-VL config.json as the published checkpoints have it
 * (text keys at the top level, rope_scaling {type: mrope}) and as transformers 5 writes it
 * (text_config, rope_parameters), every refusal with its key named, and M-RoPE positions
 * against values worked out by hand from transformers' get_rope_index. */
#define _POSIX_C_SOURCE 200809L
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/json.h"
#include "kiln/hal.h"
#include "models/model_config.h"
#include "models/mrope.h"

static char *q(const char *text) {
  char *s = strdup(text);
  assert_non_null(s);
  for (char *p = s; *p; p++)
    if (*p == '\'') *p = '"';
  return s;
}

/* base holds one %s where extra members (", 'k': v") go; a repeated key's last value wins. */
static kiln_status_t parse(const char *base, const char *extra, kiln_model_config_t *c) {
  size_t n = strlen(base) + strlen(extra) + 1;
  char *t = malloc(n);
  assert_non_null(t);
  const char *at = strstr(base, "%s");
  assert_non_null(at);
  snprintf(t, n, "%.*s%s%s", (int)(at - base), base, extra, at + 2);
  char *json = q(t);
  free(t);
  kiln_json_doc_t *doc = NULL;
  kiln_status_t st = kiln_json_parse(json, strlen(json), "config.json", &doc);
  if (st) fail_msg("test JSON does not parse: %s\n%s", kiln_status_message(st), json);
  st = kiln_model_config_parse(kiln_json_root(doc), "config.json", c);
  kiln_json_doc_free(doc);
  free(json);
  return st;
}

static void expect_error(const char *base, const char *extra, kiln_status_code_t code,
                         const char *needle) {
  kiln_model_config_t c;
  kiln_status_t st = parse(base, extra, &c);
  if (!st) fail_msg("expected an error naming %s for: %s", needle, extra);
  if (kiln_status_code(st) != code || !strstr(kiln_status_message(st), needle))
    fail_msg("error %d \"%s\" does not name \"%s\" (want code %d)", kiln_status_code(st),
             kiln_status_message(st), needle, code);
  kiln_status_free(st);
}

/* Qwen/Qwen2-VL-7B-Instruct's config.json (published layout). */
static const char *QWEN2_VL_7B =
    "{'architectures': ['Qwen2VLForConditionalGeneration'], 'attention_dropout': 0.0,"
    " 'bos_token_id': 151643, 'eos_token_id': 151645, 'vision_start_token_id': 151652,"
    " 'vision_end_token_id': 151653, 'vision_token_id': 151654, 'image_token_id': 151655,"
    " 'video_token_id': 151656, 'hidden_act': 'silu', 'hidden_size': 3584,"
    " 'initializer_range': 0.02, 'intermediate_size': 18944, 'max_position_embeddings': 32768,"
    " 'max_window_layers': 28, 'model_type': 'qwen2_vl', 'num_attention_heads': 28,"
    " 'num_hidden_layers': 28, 'num_key_value_heads': 4, 'rms_norm_eps': 1e-06,"
    " 'rope_theta': 1000000.0, 'sliding_window': 32768, 'tie_word_embeddings': false,"
    " 'torch_dtype': 'bfloat16', 'transformers_version': '4.41.2', 'use_cache': true,"
    " 'use_sliding_window': false,"
    " 'vision_config': {'depth': 32, 'embed_dim': 1280, 'mlp_ratio': 4, 'num_heads': 16,"
    "   'in_chans': 3, 'hidden_size': 3584, 'patch_size': 14, 'spatial_merge_size': 2,"
    "   'spatial_patch_size': 14, 'temporal_patch_size': 2},"
    " 'rope_scaling': {'type': 'mrope', 'mrope_section': [16, 24, 24]},"
    " 'vocab_size': 152064 %s}";

/* A Qwen2.5-VL config as transformers 5 writes it: text_config, rope_parameters. */
static const char *QWEN25_VL_TF5 =
    "{'architectures': ['Qwen2_5_VLForConditionalGeneration'], 'model_type': 'qwen2_5_vl',"
    " 'dtype': 'bfloat16', 'image_token_id': 151655, 'video_token_id': 151656,"
    " 'vision_start_token_id': 151652, 'vision_end_token_id': 151653,"
    " 'text_config': {'model_type': 'qwen2_5_vl_text', 'vocab_size': 151936, 'hidden_size': 16,"
    "   'intermediate_size': 48, 'num_hidden_layers': 2, 'num_attention_heads': 1,"
    "   'num_key_value_heads': 1, 'rms_norm_eps': 1e-06, 'max_position_embeddings': 4096,"
    "   'hidden_act': 'silu', 'tie_word_embeddings': true, 'use_sliding_window': false,"
    "   'sliding_window': null, 'max_window_layers': 80, 'bos_token_id': 151643,"
    "   'eos_token_id': 151645,"
    "   'layer_types': ['full_attention', 'full_attention'],"
    "   'rope_parameters': {'rope_type': 'default', 'rope_theta': 1000.0, 'mrope_section': [2, 3, "
    "3]}},"
    " 'vision_config': {'model_type': 'qwen2_5_vl', 'depth': 3, 'hidden_size': 32,"
    "   'out_hidden_size': 16, 'intermediate_size': 64, 'num_heads': 2, 'hidden_act': 'silu',"
    "   'in_channels': 3, 'patch_size': 14, 'spatial_merge_size': 2, 'temporal_patch_size': 2,"
    "   'window_size': 56, 'fullatt_block_indexes': [1], 'tokens_per_second': 2}"
    " %s}";

static void test_published_qwen2_vl(void **state) {
  (void)state;
  kiln_model_config_t c;
  kiln_status_t st = parse(QWEN2_VL_7B, "", &c);
  if (st) fail_msg("%s", kiln_status_message(st));
  assert_int_equal(c.arch, KILN_ARCH_QWEN2_VL);
  assert_string_equal(c.architecture, "Qwen2VLForConditionalGeneration");
  assert_int_equal(c.hidden_size, 3584);
  assert_int_equal(c.head_dim, 128);
  assert_true(c.qkv_bias);
  assert_false(c.o_bias);
  assert_false(c.tie_word_embeddings);
  assert_int_equal(c.dtype, KILN_HAL_BF16);
  assert_int_equal(c.sliding_window, 0);
  assert_true(c.mrope);
  assert_int_equal(c.mrope_section[0], 16);
  assert_int_equal(c.mrope_section[1], 24);
  assert_int_equal(c.mrope_section[2], 24);
  assert_int_equal(c.rope.kind, KILN_ROPE_DEFAULT);
  assert_true(c.rope.theta == 1e6);
  assert_int_equal(c.image_token_id, 151655);
  assert_int_equal(c.video_token_id, 151656);
  assert_int_equal(c.vision_start_token_id, 151652);
  assert_int_equal(c.vision_end_token_id, 151653);
  assert_int_equal(c.num_eos, 1);
  assert_int_equal(c.eos_token_ids[0], 151645);
  const kiln_vision_config_t *v = &c.vision;
  assert_true(v->present);
  assert_int_equal(v->depth, 32);
  assert_int_equal(v->embed_dim, 1280);
  assert_int_equal(v->num_heads, 16);
  assert_int_equal(v->intermediate_size, 5120);
  assert_int_equal(v->out_hidden_size, 3584);
  assert_int_equal(v->hidden_act, KILN_HAL_ACT_QUICK_GELU); /* the class default */
  assert_false(v->gated_mlp);
  assert_int_equal(v->patch_size, 14);
  assert_int_equal(v->temporal_patch_size, 2);
  assert_int_equal(v->spatial_merge_size, 2);
}

static void test_published_qwen2_5_vl(void **state) {
  (void)state;
  /* Qwen/Qwen2.5-VL-7B-Instruct: the same text model, another vision_config. */
  static const char *vis =
      ", 'architectures': ['Qwen2_5_VLForConditionalGeneration'], 'model_type': 'qwen2_5_vl',"
      " 'vision_config': {'depth': 32, 'hidden_act': 'silu', 'hidden_size': 1280,"
      "   'intermediate_size': 3420, 'num_heads': 16, 'in_chans': 3, 'out_hidden_size': 3584,"
      "   'patch_size': 14, 'spatial_merge_size': 2, 'spatial_patch_size': 14,"
      "   'window_size': 112, 'fullatt_block_indexes': [7, 15, 23, 31],"
      "   'tokens_per_second': 2, 'temporal_patch_size': 2}";
  kiln_model_config_t c;
  kiln_status_t st = parse(QWEN2_VL_7B, vis, &c);
  if (st) fail_msg("%s", kiln_status_message(st));
  assert_int_equal(c.arch, KILN_ARCH_QWEN2_5_VL);
  const kiln_vision_config_t *v = &c.vision;
  assert_true(v->gated_mlp);
  assert_int_equal(v->embed_dim, 1280);
  assert_int_equal(v->intermediate_size, 3420);
  assert_int_equal(v->out_hidden_size, 3584);
  assert_int_equal(v->window_size, 112);
  assert_int_equal(v->num_fullatt, 4);
  assert_int_equal(v->fullatt_blocks[3], 31);
  assert_int_equal(v->hidden_act, KILN_HAL_ACT_SILU);
  assert_true(v->tokens_per_second == 2);
}

static void test_tf5_nested(void **state) {
  (void)state;
  kiln_model_config_t c;
  kiln_status_t st = parse(QWEN25_VL_TF5, "", &c);
  if (st) fail_msg("%s", kiln_status_message(st));
  assert_int_equal(c.arch, KILN_ARCH_QWEN2_5_VL);
  assert_int_equal(c.vocab_size, 151936);
  assert_int_equal(c.hidden_size, 16);
  assert_int_equal(c.head_dim, 16);
  assert_true(c.tie_word_embeddings);
  assert_int_equal(c.dtype, KILN_HAL_BF16);
  assert_true(c.rope.theta == 1000.0);
  assert_int_equal(c.rope.rotary_dim, 16);
  assert_int_equal(c.mrope_section[0], 2);
  assert_int_equal(c.mrope_section[2], 3);
  assert_int_equal(c.eos_token_ids[0], 151645);
  assert_int_equal(c.vision.embed_dim, 32);
  assert_int_equal(c.vision.depth, 3);
  assert_int_equal(c.vision.num_fullatt, 1);
  assert_int_equal(c.vision.fullatt_blocks[0], 1);
  assert_true(c.vision.rope_theta == 10000.0);
  st = parse(QWEN25_VL_TF5,
             ", 'vision_config': {'hidden_size': 32, 'out_hidden_size': 16, 'num_heads': 2,"
             " 'rope_parameters': {'rope_type': 'axial', 'rope_theta': 500.0}}",
             &c);
  if (st) fail_msg("%s", kiln_status_message(st));
  assert_true(c.vision.rope_theta == 500.0);
  expect_error(QWEN25_VL_TF5,
               ", 'vision_config': {'hidden_size': 32, 'out_hidden_size': 16, 'num_heads': 2,"
               " 'rope_parameters': {'rope_type': 'yarn', 'rope_theta': 500.0}}",
               KILN_ERR_UNSUPPORTED, "vision_config.rope_parameters.rope_type");
  /* tie_word_embeddings given at both levels must agree */
  expect_error(QWEN25_VL_TF5, ", 'tie_word_embeddings': false", KILN_ERR_INVALID_ARGUMENT,
               "tie_word_embeddings");
  st = parse(QWEN25_VL_TF5, ", 'tie_word_embeddings': true", &c);
  if (st) fail_msg("%s", kiln_status_message(st));
}

static void test_refusals(void **state) {
  (void)state;
  expect_error(QWEN2_VL_7B, ", 'rope_scaling': {'type': 'default'}", KILN_ERR_INVALID_ARGUMENT,
               "mrope_section");
  expect_error(QWEN2_VL_7B, ", 'rope_scaling': {'type': 'mrope', 'mrope_section': [16, 24, 23]}",
               KILN_ERR_INVALID_ARGUMENT, "mrope_section");
  expect_error(QWEN2_VL_7B, ", 'rope_scaling': {'type': 'mrope', 'mrope_section': [16, 48]}",
               KILN_ERR_INVALID_ARGUMENT, "mrope_section");
  expect_error(QWEN2_VL_7B,
               ", 'rope_scaling': {'type': 'yarn', 'factor': 2, 'mrope_section': [16, 24, 24]}",
               KILN_ERR_UNSUPPORTED, "yarn");
  expect_error(QWEN2_VL_7B, ", 'image_token_id': null", KILN_ERR_INVALID_ARGUMENT,
               "image_token_id");
  expect_error(QWEN2_VL_7B, ", 'vision_start_token_id': 'x'", KILN_ERR_INVALID_ARGUMENT,
               "vision_start_token_id");
  expect_error(QWEN2_VL_7B, ", 'use_sliding_window': true", KILN_ERR_UNSUPPORTED,
               "use_sliding_window");
  expect_error(QWEN2_VL_7B, ", 'vision_config': null", KILN_ERR_INVALID_ARGUMENT, "vision_config");
  expect_error(QWEN2_VL_7B,
               ", 'vision_config': {'embed_dim': 1280, 'num_heads': 16, 'hidden_size': 1536}",
               KILN_ERR_INVALID_ARGUMENT, "vision_config.hidden_size");
  expect_error(QWEN2_VL_7B,
               ", 'vision_config': {'embed_dim': 1280, 'num_heads': 16, 'hidden_size': 3584,"
               " 'hidden_act': 'relu'}",
               KILN_ERR_UNSUPPORTED, "vision_config.hidden_act");
  expect_error(QWEN2_VL_7B,
               ", 'vision_config': {'embed_dim': 1260, 'num_heads': 18, 'hidden_size': 3584}",
               KILN_ERR_UNSUPPORTED, "multiple of 4");
  expect_error(QWEN2_VL_7B,
               ", 'vision_config': {'embed_dim': 1280, 'num_heads': 16, 'hidden_size': 3584,"
               " 'in_channels': 4}",
               KILN_ERR_UNSUPPORTED, "in_channels");
  expect_error(QWEN2_VL_7B, ", 'head_dim': 64", KILN_ERR_INVALID_ARGUMENT, "head_dim");
  expect_error(QWEN25_VL_TF5,
               ", 'vision_config': {'hidden_size': 32, 'out_hidden_size': 16, 'num_heads': 2,"
               " 'fullatt_block_indexes': [40]}",
               KILN_ERR_INVALID_ARGUMENT, "fullatt_block_indexes[0]");
  expect_error(QWEN25_VL_TF5,
               ", 'vision_config': {'hidden_size': 32, 'out_hidden_size': 16, 'num_heads': 2,"
               " 'window_size': 50}",
               KILN_ERR_UNSUPPORTED, "window_size");
  expect_error(QWEN25_VL_TF5, ", 'text_config': {'hidden_size': 16}", KILN_ERR_INVALID_ARGUMENT,
               "vocab_size");
  expect_error(QWEN2_VL_7B,
               ", 'vision_config': {'embed_dim': 1280, 'num_heads': 16, 'hidden_size': 3584,"
               " 'mlp_ratio': 'x'}",
               KILN_ERR_INVALID_ARGUMENT, "vision_config.mlp_ratio");
}

/* ---- M-RoPE positions ---------------------------------------------------------------------- */

#define VS 151652
#define VE 151653
#define IM 151655
#define VD 151656

static kiln_model_config_t vl_config(const char *extra) {
  kiln_model_config_t c;
  kiln_status_t st = parse(QWEN2_VL_7B, extra, &c);
  if (st) fail_msg("%s", kiln_status_message(st));
  return c;
}

static void test_mrope_positions(void **state) {
  (void)state;
  kiln_model_config_t c = vl_config("");
  /* Two text tokens, an image of 4 x 6 patches (2 x 3 merged), two more text tokens, an image
   * of 2 x 2 patches (1 token), one text token. By get_rope_index: the first image starts at
   * st = 3 (after the 3 text tokens, vision_start included): t = 3, h = 3 + row, w = 3 + col;
   * the text after continues from max (3 + 2 = 5) + 1 = 6. */
  const int32_t ids[] = {1, 2, VS, IM, IM, IM, IM, IM, IM, VE, 5, VS, IM, VE, 7};
  const int32_t n = (int32_t)(sizeof(ids) / sizeof(ids[0]));
  const kiln_mrope_grid_t g[2] = {{1, 4, 6}, {1, 2, 2}};
  const int32_t want_t[] = {0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7, 8, 9, 10, 11};
  const int32_t want_h[] = {0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7, 8, 9, 10, 11};
  const int32_t want_w[] = {0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8, 9, 10, 11};
  int32_t out[3 * 15], delta = 0;
  kiln_status_t st = kiln_mrope_positions(&c, ids, n, g, 2, out, &delta);
  if (st) fail_msg("%s", kiln_status_message(st));
  for (int32_t i = 0; i < n; i++) {
    assert_int_equal(out[i], want_t[i]);
    assert_int_equal(out[n + i], want_h[i]);
    assert_int_equal(out[2 * n + i], want_w[i]);
  }
  assert_int_equal(delta, 12 - n); /* max 11 + 1 - 15 */
  assert_int_equal(kiln_mrope_image_tokens(&c, g[0]), 6);
  assert_int_equal(kiln_mrope_image_tokens(&c, (kiln_mrope_grid_t){1, 3, 4}), -1);

  /* Two frames: Qwen2-VL's temporal index is the frame, Qwen2.5-VL's 0 for an image. */
  const int32_t ids2[] = {VS, IM, IM, VE};
  const kiln_mrope_grid_t g2 = {2, 2, 2};
  int32_t o2[12];
  st = kiln_mrope_positions(&c, ids2, 4, &g2, 1, o2, &delta);
  if (st) fail_msg("%s", kiln_status_message(st));
  assert_int_equal(o2[1], 1);
  assert_int_equal(o2[2], 2); /* frame 1: 1 + 1 */
  assert_int_equal(o2[4 + 2], 1);
  assert_int_equal(o2[3], 3);
  kiln_model_config_t c25 = vl_config(
      ", 'architectures': ['Qwen2_5_VLForConditionalGeneration'], 'model_type': 'qwen2_5_vl',"
      " 'vision_config': {'hidden_size': 1280, 'out_hidden_size': 3584, 'num_heads': 16}");
  st = kiln_mrope_positions(&c25, ids2, 4, &g2, 1, o2, &delta);
  if (st) fail_msg("%s", kiln_status_message(st));
  assert_int_equal(o2[2], 1);
  assert_int_equal(o2[3], 2);
  assert_int_equal(delta, 3 - 4);

  /* text only: 0..n-1, delta 0 */
  const int32_t t3[] = {5, 6, 7};
  int32_t o3[9];
  st = kiln_mrope_positions(&c, t3, 3, NULL, 0, o3, &delta);
  if (st) fail_msg("%s", kiln_status_message(st));
  assert_int_equal(o3[2], 2);
  assert_int_equal(o3[8], 2);
  assert_int_equal(delta, 0);
}

static void expect_mrope_error(const kiln_model_config_t *c, const int32_t *ids, int32_t n,
                               const kiln_mrope_grid_t *g, int32_t ng, const char *needle) {
  int32_t out[64], delta;
  kiln_status_t st = kiln_mrope_positions(c, ids, n, g, ng, out, &delta);
  if (!st) fail_msg("expected an error naming \"%s\"", needle);
  if (!strstr(kiln_status_message(st), needle))
    fail_msg("\"%s\" does not name \"%s\"", kiln_status_message(st), needle);
  kiln_status_free(st);
}

static void test_mrope_errors(void **state) {
  (void)state;
  kiln_model_config_t c = vl_config("");
  const kiln_mrope_grid_t g = {1, 4, 4}; /* 4 tokens */
  const int32_t ok[] = {VS, IM, IM, IM, IM, VE};
  const int32_t short_run[] = {VS, IM, IM, IM, VE};
  const int32_t no_start[] = {1, IM, IM, IM, IM, VE};
  const int32_t video[] = {VS, VD, VE};
  expect_mrope_error(&c, ok, 6, &g, 0, "only 0 image grids");
  expect_mrope_error(&c, ok, 6, NULL, 0, "only 0 image grids");
  expect_mrope_error(&c, short_run, 5, &g, 1, "needs 4 image tokens");
  expect_mrope_error(&c, no_start, 6, &g, 1, "vision_start");
  expect_mrope_error(&c, video, 3, NULL, 0, "video");
  const kiln_mrope_grid_t two[2] = {{1, 4, 4}, {1, 2, 2}};
  expect_mrope_error(&c, ok, 6, two, 2, "2 image grids for 1 images");
  const kiln_mrope_grid_t odd = {1, 3, 4};
  expect_mrope_error(&c, ok, 6, &odd, 1, "merge units");
  kiln_model_config_t text = c;
  text.mrope = false;
  expect_mrope_error(&text, ok, 6, &g, 1, "no M-RoPE");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_published_qwen2_vl), cmocka_unit_test(test_published_qwen2_5_vl),
      cmocka_unit_test(test_tf5_nested),         cmocka_unit_test(test_refusals),
      cmocka_unit_test(test_mrope_positions),    cmocka_unit_test(test_mrope_errors),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
