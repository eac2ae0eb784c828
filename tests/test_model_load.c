/* test_model_load.c - bad checkpoints are clear errors naming the file and the tensor, never
 * a crash or garbage: a missing shard, a truncated file, a tensor of the wrong shape or
 * dtype, a missing tensor, an unknown model_type, a malformed config.json, a truncated GGUF.
 * Each case copies a good fixture to a temporary directory and breaks one thing. Also: the
 * `kiln score` and `kiln generate --json` commands on a fixture. */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "base/json.h"
#include "base/npy.h"
#include "hal/loader.h"
#include "models/model.h"
#include "models/tokenizer/tokenizer.h"

static const kiln_hal_plugin_t *g_plugin;
static kiln_hal_registry_t *g_reg;
static kiln_hal_device_t *g_dev;
static kiln_hal_stream_t *g_stream;
static char g_root[1024];

static int setup(void **state) {
  (void)state;
  const char *src = getenv("KILN_SOURCE_DIR");
  snprintf(g_root, sizeof(g_root), "%s/tests/fixtures/models", src ? src : "..");
  kiln_hal_registry_options_t o = {0};
  kiln_status_t st = kiln_hal_registry_create(&o, &g_reg);
  if (!st) st = kiln_hal_registry_open(g_reg, "cpu", &g_plugin);
  if (st) {
    fprintf(stderr, "%s\n", kiln_status_message(st));
    kiln_status_free(st);
    return -1;
  }
  if (g_plugin->table.device_open(0, &g_dev) || g_plugin->table.stream_create(g_dev, &g_stream))
    return -1;
  return 0;
}

static int teardown(void **state) {
  (void)state;
  g_plugin->table.stream_destroy(g_stream);
  g_plugin->table.device_close(g_dev);
  kiln_hal_registry_free(g_reg);
  return 0;
}

static void run(const char *cmd) {
  int rc = system(cmd);
  if (rc != 0) fail_msg("command failed (%d): %s", rc, cmd);
}

/* A scratch copy of fixture `name`. */
static void copy_fixture(const char *name, char *dir, size_t n) {
  snprintf(dir, n, "/tmp/kiln-badckpt-XXXXXX");
  assert_non_null(mkdtemp(dir));
  char cmd[4096];
  snprintf(cmd, sizeof(cmd), "cp -r '%s/%s/.' '%s/'", g_root, name, dir);
  run(cmd);
}

static void remove_dir(const char *dir) {
  char cmd[2048];
  snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
  run(cmd);
}

static void truncate_file(const char *path, double frac) {
  struct stat sb;
  assert_int_equal(stat(path, &sb), 0);
  assert_int_equal(truncate(path, (off_t)((double)sb.st_size * frac)), 0);
}

/* Replaces the first occurrence of `from` by `to` (same length) in a file, in place. */
static void patch_file(const char *path, const char *from, const char *to) {
  assert_int_equal(strlen(from), strlen(to));
  FILE *f = fopen(path, "r+b");
  assert_non_null(f);
  fseek(f, 0, SEEK_END);
  long size = ftell(f);
  long scan = size < (1 << 20) ? size : (1 << 20); /* headers live at the start */
  char *buf = malloc((size_t)scan + 1);
  fseek(f, 0, SEEK_SET);
  assert_int_equal(fread(buf, 1, (size_t)scan, f), (size_t)scan);
  buf[scan] = 0;
  char *p = memmem(buf, (size_t)scan, from, strlen(from));
  if (!p) fail_msg("%s: '%s' not found", path, from);
  fseek(f, p - buf, SEEK_SET);
  fwrite(to, 1, strlen(to), f);
  fclose(f);
  free(buf);
}

static void write_file(const char *path, const char *text) {
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
}

/* Loading path must fail with `code` and a message holding every string in `needles`. */
static void expect_load_error(const char *path, kiln_status_code_t code,
                              const char *const *needles) {
  kiln_model_options_t o = {0};
  o.dtype = KILN_HAL_F32;
  o.max_tokens = 16;
  o.max_seqs = 1;
  o.max_blocks_per_seq = 64;
  kiln_model_t *m = NULL;
  kiln_status_t st = kiln_model_load(path, &g_plugin->table, g_dev, g_stream, &o, &m);
  assert_null(m);
  if (!st) fail_msg("%s: loaded, but should have failed", path);
  const char *msg = kiln_status_message(st);
  if (getenv("KILN_TEST_VERBOSE")) printf("  %s\n", msg);
  if (kiln_status_code(st) != code)
    fail_msg("want %s, got %s: %s", kiln_status_code_name(code),
             kiln_status_code_name(kiln_status_code(st)), msg);
  for (int i = 0; needles[i]; i++)
    if (!strstr(msg, needles[i])) fail_msg("message lacks '%s': %s", needles[i], msg);
  kiln_status_free(st);
}

static void test_good_fixture_loads(void **s) {
  (void)s;
  char dir[256], path[512];
  copy_fixture("llama2", dir, sizeof(dir));
  kiln_model_options_t o = {.dtype = -1, .max_tokens = 16, .max_seqs = 1, .max_blocks_per_seq = 64};
  kiln_model_t *m = NULL;
  kiln_status_t st = kiln_model_load(dir, &g_plugin->table, g_dev, g_stream, &o, &m);
  if (st) fail_msg("%s", kiln_status_message(st));
  kiln_model_free(m);
  snprintf(path, sizeof(path), "%s/nothing-here", dir);
  expect_load_error(path, KILN_ERR_NOT_FOUND, (const char *const[]){"config.json", NULL});
  remove_dir(dir);
}

static void test_missing_shard(void **s) {
  (void)s;
  char dir[256], path[512];
  copy_fixture("llama_sharded", dir, sizeof(dir));
  /* The second shard named in the index (its file name is in the index JSON). */
  snprintf(path, sizeof(path), "%s/model.safetensors.index.json", dir);
  kiln_json_doc_t *doc = NULL;
  assert_null(kiln_json_parse_file(path, &doc));
  const kiln_json_t *wm = kiln_json_get(kiln_json_root(doc), "weight_map");
  const char *shard = NULL;
  for (size_t i = 0; i < kiln_json_len(wm) && !shard; i++) {
    const char *v = kiln_json_string(kiln_json_value_at(wm, i), NULL);
    if (strstr(v, "00002")) shard = v;
  }
  assert_non_null(shard);
  snprintf(path, sizeof(path), "%s/%s", dir, shard);
  assert_int_equal(unlink(path), 0);
  expect_load_error(dir, KILN_ERR_NOT_FOUND, (const char *const[]){shard, NULL});
  kiln_json_doc_free(doc);
  remove_dir(dir);
}

static void test_truncated_safetensors(void **s) {
  (void)s;
  char dir[256], path[512];
  copy_fixture("llama2", dir, sizeof(dir));
  snprintf(path, sizeof(path), "%s/model.safetensors", dir);
  truncate_file(path, 0.6);
  expect_load_error(dir, KILN_ERR_INVALID_ARGUMENT,
                    (const char *const[]){"model.safetensors", "truncated", NULL});
  truncate_file(path, 0.0);
  expect_load_error(dir, KILN_ERR_INVALID_ARGUMENT,
                    (const char *const[]){"model.safetensors", NULL});
  remove_dir(dir);
}

/* Copies the llama2 fixture, replaces `from` by `to` in one of its files, and expects the load
 * to fail with every needle in the message. */
static void expect_patched_error(const char *file, const char *from, const char *to,
                                 const char *const *needles) {
  char dir[256], path[512];
  copy_fixture("llama2", dir, sizeof(dir));
  snprintf(path, sizeof(path), "%s/%s", dir, file);
  patch_file(path, from, to);
  expect_load_error(dir, KILN_ERR_INVALID_ARGUMENT, needles);
  remove_dir(dir);
}

static void test_wrong_shape(void **s) {
  (void)s;
  /* The config now says 192, the tensors hold 160. */
  expect_patched_error(
      "config.json", "\"intermediate_size\": 160", "\"intermediate_size\": 192",
      (const char *const[]){"model.layers.0.mlp.", "[160, 64]", "[192, 64]", NULL});
}

static void test_wrong_dtype(void **s) {
  (void)s;
  expect_patched_error("model.safetensors", "\"dtype\":\"F32\"", "\"dtype\":\"I32\"",
                       (const char *const[]){"model.safetensors", "dtype i32",
                                             "want a float tensor", NULL});
}

static void test_missing_tensor(void **s) {
  (void)s;
  expect_patched_error(
      "model.safetensors", "\"model.norm.weight\"", "\"model.norX.weight\"",
      (const char *const[]){"model.safetensors", "model.norm.weight", "missing", NULL});
}

static void test_unknown_model_type(void **s) {
  (void)s;
  char dir[256], path[512];
  copy_fixture("llama2", dir, sizeof(dir));
  snprintf(path, sizeof(path), "%s/config.json", dir);
  write_file(path,
             "{\"model_type\": \"mamba\", \"architectures\": [\"MambaForCausalLM\"], "
             "\"vocab_size\": 320, \"hidden_size\": 64}");
  expect_load_error(dir, KILN_ERR_UNSUPPORTED, (const char *const[]){"mamba", NULL});
  write_file(path, "{\"model_type\": \"llama\", \"vocab_size\": 320, \"hidden_size\": ");
  expect_load_error(dir, KILN_ERR_INVALID_ARGUMENT, (const char *const[]){"config.json", NULL});
  write_file(path, "{\"model_type\": \"llama\", \"vocab_size\": 320, \"hidden_size\": \"64\"}");
  expect_load_error(dir, KILN_ERR_INVALID_ARGUMENT,
                    (const char *const[]){"config.json", "hidden_size", NULL});
  remove_dir(dir);
}

static void test_truncated_gguf(void **s) {
  (void)s;
  char dir[256], path[512];
  copy_fixture("llama3_gguf", dir, sizeof(dir));
  snprintf(path, sizeof(path), "%s/model.gguf", dir);
  truncate_file(path, 0.7);
  expect_load_error(path, KILN_ERR_INVALID_ARGUMENT, (const char *const[]){"model.gguf", NULL});
  truncate_file(path, 0.01);
  expect_load_error(path, KILN_ERR_INVALID_ARGUMENT, (const char *const[]){"model.gguf", NULL});
  remove_dir(dir);
}

/* ---- batches the model refuses ------------------------------------------------------------ */

typedef struct bad_batch {
  int32_t ids[4], pos[4], slots[4], seq_lens[2], qsl[3], bt[2 * 2], rows[2];
  kiln_batch_t b;
} bad_batch_t;

/* A valid two-sequence batch: sequence 0 prefills 3 tokens into block 1, sequence 1 decodes
 * its 6th token (position 5) with blocks {2, 0}; block size 4, 3 blocks in the pool. */
static void good_batch(bad_batch_t *x) {
  const bad_batch_t init = {.ids = {5, 6, 7, 8},
                            .pos = {0, 1, 2, 5},
                            .slots = {4, 5, 6, 1},
                            .seq_lens = {3, 6},
                            .qsl = {0, 3, 4},
                            .bt = {1, 0, 2, 0},
                            .rows = {2, 3}};
  *x = init;
  x->b = (kiln_batch_t){.num_tokens = 4,
                        .num_seqs = 2,
                        .token_ids = x->ids,
                        .positions = x->pos,
                        .slot_mapping = x->slots,
                        .seq_lens = x->seq_lens,
                        .query_start_loc = x->qsl,
                        .block_tables = x->bt,
                        .max_blocks_per_seq = 2,
                        .num_logits = 2,
                        .logits_rows = x->rows};
}

static void test_bad_batches(void **s) {
  (void)s;
  char path[1200];
  snprintf(path, sizeof(path), "%s/llama2", g_root);
  kiln_model_options_t o = {
      .dtype = KILN_HAL_F32, .max_tokens = 4, .max_seqs = 2, .max_blocks_per_seq = 2};
  kiln_model_t *m = NULL;
  assert_null(kiln_model_load(path, &g_plugin->table, g_dev, g_stream, &o, &m));
  kiln_kv_cache_t *kv = NULL;
  assert_null(kiln_model_kv_create(m, 3, 4, &kv));
  bad_batch_t x;
  good_batch(&x);
  assert_null(kiln_model_forward(m, kv, &x.b));
  /* Each case breaks one thing; the message must name what. */
  static const char *const needles[] = {
      "tokens",          "position", "vocabulary", "slot",      "block table entry",
      "query_start_loc", "seq_len",  "logits row", "sequences", "block tables"};
  for (size_t i = 0; i < sizeof(needles) / sizeof(needles[0]); i++) {
    good_batch(&x);
    switch (i) {
      case 0: x.b.num_tokens = 5; break;         /* beyond max_tokens */
      case 1: x.pos[1] = 7; break;               /* not where seq_lens puts it */
      case 2: x.ids[3] = 320; break;             /* vocabulary is 320 */
      case 3: x.slots[0] = 8; break;             /* not the block table's slot */
      case 4: x.bt[2] = 3; break;                /* the pool has blocks 0..2 */
      case 5: x.qsl[2] = 3; break;               /* must end at T */
      case 6: x.seq_lens[1] = 9; break;          /* beyond 2 blocks of 4 */
      case 7: x.rows[1] = 4; break;              /* rows are 0..3 */
      case 8: x.b.num_seqs = 3; break;           /* beyond max_seqs */
      case 9: x.b.max_blocks_per_seq = 3; break; /* beyond max_blocks_per_seq */
    }
    kiln_status_t st = kiln_model_forward(m, kv, &x.b);
    if (!st) fail_msg("case %zu (%s): accepted", i, needles[i]);
    if (getenv("KILN_TEST_VERBOSE")) printf("  %s\n", kiln_status_message(st));
    assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
    if (!strstr(kiln_status_message(st), needles[i]))
      fail_msg("case %zu: message lacks '%s': %s", i, needles[i], kiln_status_message(st));
    kiln_status_free(st);
  }
  /* The model still works after refusing them. */
  good_batch(&x);
  assert_null(kiln_model_forward(m, kv, &x.b));
  kiln_kv_cache_free(kv);
  kiln_model_free(m);
}

/* ---- the commands ---------------------------------------------------------------------- */

static const char *kiln_bin(void) {
  static char path[1024];
  snprintf(path, sizeof(path), "%s/bin/kiln", getenv("KILN_BUILD_DIR"));
  return path;
}

static void test_score_command(void **s) {
  (void)s;
  char dir[256], cmd[4096], out[512];
  snprintf(dir, sizeof(dir), "/tmp/kiln-score-XXXXXX");
  assert_non_null(mkdtemp(dir));
  snprintf(out, sizeof(out), "%s/logits.npy", dir);
  snprintf(cmd, sizeof(cmd),
           "'%s' score --set backend.name=cpu --model '%s/llama2' --ids 5,9,200,31,7 --out '%s'",
           kiln_bin(), g_root, out);
  run(cmd);
  float *lg = NULL;
  int64_t r, c;
  assert_null(kiln_npy_read_f32(out, &lg, &r, &c));
  assert_int_equal(r, 5);
  assert_int_equal(c, 320);
  /* The same positions scored through the library. */
  kiln_model_options_t o = {
      .dtype = KILN_HAL_F32, .max_tokens = 5, .max_seqs = 1, .max_blocks_per_seq = 8};
  kiln_model_t *m = NULL;
  char mp[1200];
  snprintf(mp, sizeof(mp), "%s/llama2", g_root);
  assert_null(kiln_model_load(mp, &g_plugin->table, g_dev, g_stream, &o, &m));
  float ref[5 * 320];
  int32_t ids[5] = {5, 9, 200, 31, 7};
  assert_null(kiln_model_score(m, ids, 5, 0, 16, ref));
  for (int i = 0; i < 5 * 320; i++) assert_float_equal(lg[i], ref[i], 1e-6);
  kiln_model_free(m);
  free(lg);
  /* Bad input is an error with a message, exit code 1. */
  snprintf(
      cmd, sizeof(cmd),
      "'%s' score --set backend.name=cpu --model '%s/llama2' --ids 5,999 --out '%s' 2>/dev/null",
      kiln_bin(), g_root, out);
  assert_int_not_equal(system(cmd), 0);
  snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
  run(cmd);
}

static void test_generate_command(void **s) {
  (void)s;
  char path[1200], cmd[4096];
  snprintf(path, sizeof(path), "%s/llama2/reference.json", g_root);
  kiln_json_doc_t *ref = NULL;
  assert_null(kiln_json_parse_file(path, &ref));
  const kiln_json_t *g = kiln_json_get(kiln_json_root(ref), "greedy");
  const kiln_json_t *p = kiln_json_get(g, "prompt_ids"), *want = kiln_json_get(g, "token_ids");
  char ids[512] = "";
  for (size_t i = 0; i < kiln_json_len(p); i++) {
    size_t l = strlen(ids);
    snprintf(ids + l, sizeof(ids) - l, "%s%d", i ? "," : "",
             (int)kiln_json_number(kiln_json_at(p, i)));
  }
  snprintf(cmd, sizeof(cmd),
           "'%s' generate --set backend.name=cpu --model '%s/llama2' --ids %s --max-tokens %zu "
           "--temperature 0 --ignore-eos --json",
           kiln_bin(), g_root, ids, kiln_json_len(want));
  FILE *f = popen(cmd, "r");
  assert_non_null(f);
  char out[8192];
  size_t n = fread(out, 1, sizeof(out) - 1, f);
  out[n] = 0;
  assert_int_equal(pclose(f), 0);
  kiln_json_doc_t *doc = NULL;
  kiln_status_t st = kiln_json_parse(out, n, "generate output", &doc);
  if (st) fail_msg("%s\n%s", kiln_status_message(st), out);
  const kiln_json_t *got = kiln_json_get(kiln_json_root(doc), "token_ids");
  assert_int_equal(kiln_json_len(got), kiln_json_len(want));
  for (size_t i = 0; i < kiln_json_len(want); i++)
    assert_int_equal((int)kiln_json_number(kiln_json_at(got, i)),
                     (int)kiln_json_number(kiln_json_at(want, i)));
  assert_string_equal(kiln_json_string(kiln_json_get(kiln_json_root(doc), "finish_reason"), NULL),
                      "length");
  kiln_json_doc_free(doc);
  kiln_json_doc_free(ref);
}

/* A byte-level BPE tokenizer.json over the fixture's 320 ids: the 256 bytes (GPT-2's byte to
 * character map, id = byte value) and four merges. */
static void write_tokenizer(const char *dir) {
  char path[512];
  snprintf(path, sizeof(path), "%s/tokenizer.json", dir);
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  fputs(
      "{\"version\": \"1.0\", \"added_tokens\": [], \"normalizer\": null,\n"
      " \"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, "
      "\"trim_offsets\": true, \"use_regex\": true},\n"
      " \"post_processor\": null,\n"
      " \"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": true, "
      "\"trim_offsets\": true, \"use_regex\": true},\n"
      " \"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": null, "
      "\"continuing_subword_prefix\": null, \"end_of_word_suffix\": null, \"fuse_unk\": false, "
      "\"byte_fallback\": false, \"vocab\": {",
      f);
  int n = 0;
  for (int b = 0; b < 256; b++) {
    bool self = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
    unsigned cp = self ? (unsigned)b : 256u + (unsigned)n++;
    char u[8];
    if (cp < 0x80) {
      u[0] = (char)cp, u[1] = 0;
    } else {
      u[0] = (char)(0xc0 | (cp >> 6)), u[1] = (char)(0x80 | (cp & 0x3f)), u[2] = 0;
    }
    if (cp == '"' || cp == '\\')
      fprintf(f, "\"\\%s\": %d, ", u, b);
    else
      fprintf(f, "\"%s\": %d, ", u, b);
  }
  fputs(
      "\"he\": 256, \"ll\": 257, \"\u0120t\": 258, \"on\": 259}, "
      "\"merges\": [\"h e\", \"l l\", \"\u0120 t\", \"o n\"]}}\n",
      f);
  fclose(f);
}

/* --prompt goes through the tokenizer beside the model, and the output carries its text. */
static void test_generate_prompt(void **s) {
  (void)s;
  char dir[256], cmd[4096];
  copy_fixture("llama2", dir, sizeof(dir));
  write_tokenizer(dir);
  snprintf(
      cmd, sizeof(cmd),
      "'%s' generate --set backend.name=cpu --model '%s' --prompt 'hello there' --max-tokens 6 "
      "--ignore-eos --json",
      kiln_bin(), dir);
  FILE *f = popen(cmd, "r");
  assert_non_null(f);
  char out[8192];
  size_t n = fread(out, 1, sizeof(out) - 1, f);
  out[n] = 0;
  assert_int_equal(pclose(f), 0);
  kiln_json_doc_t *doc = NULL;
  kiln_status_t st = kiln_json_parse(out, n, "generate output", &doc);
  if (st) fail_msg("%s\n%s", kiln_status_message(st), out);
  const kiln_json_t *root = kiln_json_root(doc);
  /* "hello there" -> he ll o | Ġt he r e */
  const int want[] = {256, 257, 111, 258, 256, 114, 101};
  const kiln_json_t *p = kiln_json_get(root, "prompt_ids");
  assert_int_equal(kiln_json_len(p), 7);
  for (int i = 0; i < 7; i++)
    assert_int_equal((int)kiln_json_number(kiln_json_at(p, (size_t)i)), want[i]);
  const kiln_json_t *ids = kiln_json_get(root, "token_ids");
  assert_int_equal(kiln_json_len(ids), 6);
  /* The text is the tokenizer's decoding of the generated ids. */
  kiln_tokenizer_t *tok = NULL;
  assert_null(kiln_tokenizer_load(dir, &tok));
  int32_t gen[6];
  for (int i = 0; i < 6; i++) gen[i] = (int32_t)kiln_json_number(kiln_json_at(ids, (size_t)i));
  kiln_strbuf_t text = KILN_STRBUF_INIT;
  assert_null(kiln_tokenizer_decode(tok, gen, 6, true, &text));
  assert_string_equal(kiln_json_string(kiln_json_get(root, "text"), NULL), kiln_strbuf_cstr(&text));
  kiln_strbuf_free(&text);
  kiln_tokenizer_free(tok);
  kiln_json_doc_free(doc);
  remove_dir(dir);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_good_fixture_loads),    cmocka_unit_test(test_missing_shard),
      cmocka_unit_test(test_truncated_safetensors), cmocka_unit_test(test_wrong_shape),
      cmocka_unit_test(test_wrong_dtype),           cmocka_unit_test(test_missing_tensor),
      cmocka_unit_test(test_unknown_model_type),    cmocka_unit_test(test_truncated_gguf),
      cmocka_unit_test(test_score_command),         cmocka_unit_test(test_generate_command),
      cmocka_unit_test(test_generate_prompt),       cmocka_unit_test(test_bad_batches),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
