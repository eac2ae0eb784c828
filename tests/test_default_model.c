/* test_default_model.c - the embedded default model (share/models/kiln-tiny) on the CPU
 * backend against what transformers recorded when it was trained
 * (tests/fixtures/default_model/reference.json, written by tools/train_default_model.py):
 *   - the held-out perplexity of heldout.txt in float32 and in the checkpoint's bf16, within
 *     1% of transformers' figures (measured: 6e-9 in fp32, 3e-4 in bf16);
 *   - greedy 32-token continuations in float32 equal transformers' ids (a divergence is
 *     allowed only after a step whose recorded top-1/top-2 logit gap is below 1e-3), and a
 *     second run gives the same ids;
 *   - the tokenizer encodes the prompts to the same ids, and the chat template renders the
 *     conversation exactly as transformers' apply_chat_template did;
 *   - `kiln perplexity --json` agrees, and fails clearly on bad input.
 * The perplexity definition is the one in tools/cmd_perplexity.c. */
#define _GNU_SOURCE
#include <math.h>
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
#include "base/strbuf.h"
#include "hal/loader.h"
#include "kiln/hal_util.h"
#include "models/model.h"
#include "models/template/template.h"
#include "models/tokenizer/tokenizer.h"

#define PPL_TOL 1e-2         /* the bar: Kiln's perplexity within 1% of transformers' */
#define NEAR_TIE 1e-3        /* a greedy step this close to a tie may pick either token */
#define MAX_MODEL_BYTES 25e6 /* the shipped directory stays small */

static const kiln_hal_plugin_t *g_plugin;
static kiln_hal_registry_t *g_reg;
static kiln_hal_device_t *g_dev;
static kiln_hal_stream_t *g_stream;
static char g_model[1024], g_fixture[1024];
static kiln_json_doc_t *g_ref_doc;
static const kiln_json_t *g_ref;
static kiln_tokenizer_t *g_tok;
static double g_ppl_f32; /* Kiln's fp32 figure, for the command's check */

static void check_st(kiln_status_t st) {
  if (st) fail_msg("%s", kiln_status_message(st));
}

static int setup(void **state) {
  (void)state;
  const char *src = getenv("KILN_SOURCE_DIR");
  snprintf(g_model, sizeof(g_model), "%s/share/models/kiln-tiny", src ? src : "..");
  snprintf(g_fixture, sizeof(g_fixture), "%s/tests/fixtures/default_model", src ? src : "..");
  char path[1200];
  snprintf(path, sizeof(path), "%s/reference.json", g_fixture);
  kiln_status_t st = kiln_json_parse_file(path, &g_ref_doc);
  if (!st) st = kiln_tokenizer_load(g_model, &g_tok);
  kiln_hal_registry_options_t o = {0};
  if (!st) st = kiln_hal_registry_create(&o, &g_reg);
  if (!st) st = kiln_hal_registry_open(g_reg, "cpu", &g_plugin);
  if (st) {
    fprintf(stderr, "%s\n", kiln_status_message(st));
    kiln_status_free(st);
    return -1;
  }
  g_ref = kiln_json_root(g_ref_doc);
  if (g_plugin->table.device_open(0, &g_dev) || g_plugin->table.stream_create(g_dev, &g_stream))
    return -1;
  return 0;
}

static int teardown(void **state) {
  (void)state;
  if (g_stream) g_plugin->table.stream_destroy(g_stream);
  if (g_dev) g_plugin->table.device_close(g_dev);
  kiln_hal_registry_free(g_reg);
  kiln_tokenizer_free(g_tok);
  kiln_json_doc_free(g_ref_doc);
  return 0;
}

/* ---- helpers ------------------------------------------------------------------------------ */

static const kiln_json_t *ref_path(const char *a, const char *b, const char *c) {
  const kiln_json_t *v = kiln_json_get(g_ref, a);
  if (b) v = kiln_json_get(v, b);
  if (c) v = kiln_json_get(v, c);
  if (!v)
    fail_msg("reference.json has no %s%s%s%s%s", a, b ? "." : "", b ? b : "", c ? "." : "",
             c ? c : "");
  return v;
}

static int64_t json_i64(const kiln_json_t *v) {
  int64_t x;
  assert_true(kiln_json_int64(v, &x));
  return x;
}

static void read_text(const char *path, kiln_strbuf_t *out) {
  FILE *f = fopen(path, "rb");
  if (!f) fail_msg("cannot open %s", path);
  char buf[65536];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), f)) > 0) kiln_strbuf_append(out, buf, n);
  fclose(f);
  assert_true(kiln_strbuf_ok(out));
}

static kiln_model_t *load(int32_t dtype, int32_t max_tokens, int32_t max_blocks) {
  kiln_model_options_t o = {0};
  o.dtype = dtype;
  o.max_tokens = max_tokens;
  o.max_seqs = 1;
  o.max_blocks_per_seq = max_blocks;
  kiln_model_t *m = NULL;
  check_st(kiln_model_load(g_model, &g_plugin->table, g_dev, g_stream, &o, &m));
  return m;
}

typedef struct ppl {
  double nll, perplexity;
  int64_t scored, windows;
} ppl_t;

/* The perplexity of ids under m: windows of ctx tokens, each in chunks of `chunk` over one KV
 * cache, log-softmax in double (the definition in reference.json). */
static ppl_t perplexity(kiln_model_t *m, const kiln_tokens_t *ids, int32_t ctx, int32_t chunk) {
  const int32_t bs = 16, nb = (ctx + bs - 1) / bs;
  const int64_t V = kiln_model_get_config(m)->vocab_size;
  kiln_kv_cache_t *kv = NULL;
  check_st(kiln_model_kv_create(m, nb, bs, &kv));
  int32_t *bt = malloc((size_t)nb * sizeof(int32_t));
  float *lg = malloc((size_t)chunk * (size_t)V * sizeof(float));
  assert_non_null(bt);
  assert_non_null(lg);
  for (int32_t i = 0; i < nb; i++) bt[i] = nb - 1 - i;
  ppl_t r = {0};
  for (size_t s = 0; s < ids->len; s += (size_t)ctx) {
    int32_t len = (int32_t)(ids->len - s < (size_t)ctx ? ids->len - s : (size_t)ctx);
    if (len < 2) continue;
    const int32_t *w = ids->ids + s;
    for (int32_t off = 0; off < len - 1; off += chunk) {
      int32_t t = len - 1 - off < chunk ? len - 1 - off : chunk;
      check_st(kiln_model_forward_seq(m, kv, bt, nb, w + off, off, t, t));
      check_st(kiln_model_read_logits(m, t, lg));
      for (int32_t k = 0; k < t; k++) {
        const float *row = lg + (size_t)k * (size_t)V;
        double mx = (double)row[0];
        for (int64_t v = 1; v < V; v++) mx = fmax(mx, (double)row[v]);
        double sum = exp((double)row[0] - mx);
        for (int64_t v = 1; v < V; v++) sum += exp((double)row[v] - mx);
        r.nll += mx + log(sum) - (double)row[w[off + k + 1]];
      }
      r.scored += t;
    }
    r.windows++;
  }
  r.perplexity = exp(r.nll / (double)r.scored);
  free(bt);
  free(lg);
  kiln_kv_cache_free(kv);
  return r;
}

static void heldout_ids(kiln_tokens_t *ids) {
  char path[1200];
  snprintf(path, sizeof(path), "%s/heldout.txt", g_fixture);
  kiln_strbuf_t text = KILN_STRBUF_INIT;
  read_text(path, &text);
  check_st(kiln_tokenizer_encode(g_tok, kiln_strbuf_cstr(&text), text.len, false, ids));
  kiln_strbuf_free(&text);
  assert_int_equal((int64_t)ids->len, json_i64(ref_path("heldout", "tokens", NULL)));
}

static void expect_ppl(const char *what, const ppl_t *got, const char *dtype) {
  const kiln_json_t *ref = ref_path("heldout", dtype, NULL);
  double want = kiln_json_number(kiln_json_get(ref, "perplexity"));
  double rel = fabs(got->perplexity - want) / want;
  printf("  %s: perplexity %.6f, transformers %.6f (relative difference %.2e, tolerance %.0e)\n",
         what, got->perplexity, want, rel, PPL_TOL);
  assert_int_equal(got->scored, json_i64(kiln_json_get(ref, "scored")));
  assert_int_equal(got->windows, json_i64(kiln_json_get(ref, "windows")));
  if (!(rel <= PPL_TOL))
    fail_msg("%s: perplexity %.6f vs %.6f: off by %.3g", what, got->perplexity, want, rel);
}

/* ---- tests ------------------------------------------------------------------------------------
 */

/* The shipped directory has every file a Hugging Face loader expects, and stays small. */
static void test_files(void **s) {
  (void)s;
  static const char *const files[] = {"config.json",           "generation_config.json",
                                      "model.safetensors",     "tokenizer.json",
                                      "tokenizer_config.json", "README.md"};
  double total = 0;
  for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++) {
    char path[1200];
    struct stat st;
    snprintf(path, sizeof(path), "%s/%s", g_model, files[i]);
    if (stat(path, &st) != 0) fail_msg("missing %s", path);
    total += (double)st.st_size;
  }
  assert_true(total <= MAX_MODEL_BYTES);
}

/* Kiln's tokenizer and chat template give what transformers gave for the greedy prompts. */
static void test_tokenizer_and_template(void **s) {
  (void)s;
  const kiln_json_t *prompts = ref_path("greedy", "prompts", NULL);
  kiln_chat_template_t *ct = NULL;
  check_st(kiln_chat_template_load(g_model, &ct));
  int rendered = 0;
  for (size_t i = 0; i < kiln_json_len(prompts); i++) {
    const kiln_json_t *p = kiln_json_at(prompts, i);
    const char *name = kiln_json_string(kiln_json_get(p, "name"), NULL);
    size_t plen;
    const char *prompt = kiln_json_string(kiln_json_get(p, "prompt"), &plen);
    const kiln_json_t *want = kiln_json_get(p, "prompt_ids");
    kiln_tokens_t ids = KILN_TOKENS_INIT;
    check_st(kiln_tokenizer_encode(g_tok, prompt, plen, false, &ids));
    assert_int_equal(ids.len, kiln_json_len(want));
    for (size_t k = 0; k < ids.len; k++)
      assert_int_equal(ids.ids[k], json_i64(kiln_json_at(want, k)));
    kiln_tokens_free(&ids);
    const kiln_json_t *msgs = kiln_json_get(p, "messages");
    if (!msgs) continue;
    kiln_template_vars_t vars = {.messages = msgs, .add_generation_prompt = true};
    kiln_strbuf_t out = KILN_STRBUF_INIT;
    check_st(kiln_chat_template_render(ct, &vars, &out));
    const char *hf = kiln_json_string(ref_path("chat_template_render", "rendered", name), NULL);
    assert_string_equal(kiln_strbuf_cstr(&out), hf);
    assert_string_equal(kiln_strbuf_cstr(&out), prompt);
    kiln_strbuf_free(&out);
    rendered++;
  }
  assert_int_equal(rendered, 1);
  kiln_chat_template_free(ct);
}

static void test_perplexity_float32(void **s) {
  (void)s;
  kiln_tokens_t ids = KILN_TOKENS_INIT;
  heldout_ids(&ids);
  int32_t ctx = (int32_t)json_i64(ref_path("ctx", NULL, NULL));
  kiln_model_t *m = load(KILN_HAL_F32, 512, (ctx + 15) / 16);
  assert_int_equal(kiln_model_max_len(m), ctx);
  ppl_t r = perplexity(m, &ids, ctx, 512);
  expect_ppl("float32", &r, "float32");
  g_ppl_f32 = r.perplexity;
  kiln_model_free(m);
  kiln_tokens_free(&ids);
}

/* The checkpoint's own dtype (bf16) through `kiln perplexity`, which must agree with the bf16
 * reference and print every field. */
static void test_perplexity_command(void **s) {
  (void)s;
  char cmd[4096];
  snprintf(cmd, sizeof(cmd),
           "'%s/bin/kiln' perplexity --set backend.name=cpu --model '%s' --file "
           "'%s/heldout.txt' --json",
           getenv("KILN_BUILD_DIR"), g_model, g_fixture);
  FILE *f = popen(cmd, "r");
  assert_non_null(f);
  char out[4096];
  size_t n = fread(out, 1, sizeof(out) - 1, f);
  out[n] = 0;
  assert_int_equal(pclose(f), 0);
  kiln_json_doc_t *doc = NULL;
  kiln_status_t st = kiln_json_parse(out, n, "perplexity output", &doc);
  if (st) fail_msg("%s\n%s", kiln_status_message(st), out);
  const kiln_json_t *r = kiln_json_root(doc);
  static const char *const keys[] = {"tokens", "scored",  "nll",    "perplexity",
                                     "ctx",    "windows", "seconds"};
  for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++)
    if (!kiln_json_is(kiln_json_get(r, keys[i]), KILN_JSON_NUMBER))
      fail_msg("no number \"%s\" in %s", keys[i], out);
  assert_string_equal(kiln_json_string(kiln_json_get(r, "dtype"), NULL), "bfloat16");
  assert_int_equal(json_i64(kiln_json_get(r, "tokens")),
                   json_i64(ref_path("heldout", "tokens", NULL)));
  assert_int_equal(json_i64(kiln_json_get(r, "ctx")), json_i64(ref_path("ctx", NULL, NULL)));
  ppl_t got = {kiln_json_number(kiln_json_get(r, "nll")),
               kiln_json_number(kiln_json_get(r, "perplexity")),
               json_i64(kiln_json_get(r, "scored")), json_i64(kiln_json_get(r, "windows"))};
  assert_true(fabs(exp(got.nll / (double)got.scored) - got.perplexity) <= 1e-9 * got.perplexity);
  expect_ppl("bfloat16 (kiln perplexity)", &got, "bfloat16");
  /* bf16 rounding moves the figure a little, not a lot */
  if (g_ppl_f32 > 0) assert_true(fabs(got.perplexity - g_ppl_f32) / g_ppl_f32 < PPL_TOL);
  kiln_json_doc_free(doc);
}

/* Bad input: a clear message and exit code 1. */
static void test_perplexity_errors(void **s) {
  (void)s;
  char dir[] = "/tmp/kiln-ppl-XXXXXX", cmd[4096], empty[256], text[256], llama2[1200];
  assert_non_null(mkdtemp(dir));
  snprintf(empty, sizeof(empty), "%s/empty.txt", dir);
  snprintf(text, sizeof(text), "%s/text.txt", dir);
  FILE *f = fopen(empty, "wb");
  assert_non_null(f);
  fclose(f);
  f = fopen(text, "wb");
  assert_non_null(f);
  fputs("Once upon a time\n", f);
  fclose(f);
  const char *src = getenv("KILN_SOURCE_DIR");
  /* a fixture model without a tokenizer.json */
  snprintf(llama2, sizeof(llama2), "%s/tests/fixtures/models/llama2", src ? src : "..");
  const struct {
    const char *model, *file, *needle;
  } cases[] = {
      {g_model, "/nonexistent/text.txt", "cannot open /nonexistent/text.txt"},
      {g_model, empty, "is empty"},
      {llama2, text, "no tokenizer.json"},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    snprintf(cmd, sizeof(cmd),
             "'%s/bin/kiln' perplexity --set backend.name=cpu --model '%s' --file '%s' 2>&1",
             getenv("KILN_BUILD_DIR"), cases[i].model, cases[i].file);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    char out[4096];
    size_t n = fread(out, 1, sizeof(out) - 1, p);
    out[n] = 0;
    int rc = pclose(p);
    if (rc == 0 || !strstr(out, cases[i].needle))
      fail_msg("%s: exit %d, wanted an error with '%s', got: %s", cmd, rc, cases[i].needle, out);
  }
  remove(empty);
  remove(text);
  rmdir(dir);
}

/* Greedy continuation of one prompt in float32: prefill, then one token per step, argmax on
 * the host (the first index on a tie, as torch.argmax). */
static void greedy(kiln_model_t *m, const int32_t *prompt, int32_t n, int32_t steps, int32_t *out) {
  const int32_t bs = 16, nb = (n + steps + bs - 1) / bs;
  const int64_t V = kiln_model_get_config(m)->vocab_size;
  kiln_kv_cache_t *kv = NULL;
  check_st(kiln_model_kv_create(m, nb, bs, &kv));
  int32_t bt[64];
  assert_true(nb <= 64);
  for (int32_t i = 0; i < nb; i++) bt[i] = i;
  float *lg = malloc((size_t)V * sizeof(float));
  assert_non_null(lg);
  int32_t len = 0;
  for (int32_t i = 0; i < steps; i++) {
    if (i == 0)
      check_st(kiln_model_forward_seq(m, kv, bt, nb, prompt, 0, n, 1)), len = n;
    else
      check_st(kiln_model_forward_seq(m, kv, bt, nb, &out[i - 1], len, 1, 1)), len++;
    check_st(kiln_model_read_logits(m, 1, lg));
    int32_t best = 0;
    for (int64_t v = 1; v < V; v++)
      if (lg[v] > lg[best]) best = (int32_t)v;
    out[i] = best;
  }
  free(lg);
  kiln_kv_cache_free(kv);
}

static void test_greedy_float32(void **s) {
  (void)s;
  kiln_model_t *m = load(KILN_HAL_F32, 64, 8);
  const kiln_json_t *prompts = ref_path("greedy", "prompts", NULL);
  assert_true(kiln_json_len(prompts) >= 3);
  for (size_t i = 0; i < kiln_json_len(prompts); i++) {
    const kiln_json_t *p = kiln_json_at(prompts, i);
    const kiln_json_t *pj = kiln_json_get(p, "prompt_ids"), *want = kiln_json_get(p, "token_ids");
    const kiln_json_t *gaps = kiln_json_get(p, "top1_top2_gaps");
    int32_t n = (int32_t)kiln_json_len(pj), steps = (int32_t)kiln_json_len(want);
    int32_t prompt[64], a[64], b[64];
    assert_true(n <= 64 && steps <= 64 && steps >= 1);
    for (int32_t k = 0; k < n; k++) prompt[k] = (int32_t)json_i64(kiln_json_at(pj, (size_t)k));
    greedy(m, prompt, n, steps, a);
    greedy(m, prompt, n, steps, b);
    assert_memory_equal(a, b, (size_t)steps * sizeof(int32_t)); /* stable run to run */
    int32_t agree = 0;
    for (int32_t k = 0; k < steps; k++) {
      int32_t w = (int32_t)json_i64(kiln_json_at(want, (size_t)k));
      if (a[k] != w) {
        double gap = kiln_json_number(kiln_json_at(gaps, (size_t)k));
        if (gap >= NEAR_TIE)
          fail_msg("%s: step %d: token %d, transformers chose %d with a margin of %.4g",
                   kiln_json_string(kiln_json_get(p, "name"), NULL), k, a[k], w, gap);
        break; /* a near tie: the continuations may part here */
      }
      agree++;
    }
    kiln_strbuf_t text = KILN_STRBUF_INIT;
    check_st(kiln_tokenizer_decode(g_tok, a, (size_t)steps, false, &text));
    printf("  greedy %-6s %d/%d tokens as transformers: %s\n",
           kiln_json_string(kiln_json_get(p, "name"), NULL), agree, steps, kiln_strbuf_cstr(&text));
    kiln_strbuf_free(&text);
  }
  kiln_model_free(m);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_files),
      cmocka_unit_test(test_tokenizer_and_template),
      cmocka_unit_test(test_perplexity_float32),
      cmocka_unit_test(test_perplexity_command),
      cmocka_unit_test(test_perplexity_errors),
      cmocka_unit_test(test_greedy_float32),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
