/* test_tokenizer.c - cmocka tests for models/tokenizer: each component on tiny synthetic
 * tokenizer.json files, the error paths, the streaming detokenizer, and (in
 * test_tokenizer_golden.c) the real tokenizers against Hugging Face goldens. */
#define _POSIX_C_SOURCE 200809L
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "models/tokenizer/tok_internal.h"
#include "models/tokenizer/tokenizer.h"

void tkt_golden_qwen3(void **state);
void tkt_golden_llama3(void **state);
void tkt_golden_llama2(void **state);
void tkt_golden_gemma3(void **state);
void tkt_golden_mistral_nemo(void **state);
void tkt_golden_deepseek_v3(void **state);
void tkt_golden_gpt4o(void **state);
void tkt_gguf_vocabs(void **state);

/* ---- helpers --------------------------------------------------------------------------- */

static kiln_tokenizer_t *load(const char *json) {
  kiln_tokenizer_t *tok = NULL;
  kiln_status_t st = kiln_tokenizer_load_json(json, strlen(json), "test.json", &tok);
  if (st) fail_msg("load failed: %s", kiln_status_message(st));
  return tok;
}

static void expect_error(const char *json, kiln_status_code_t code, const char *needle) {
  kiln_tokenizer_t *tok = NULL;
  kiln_status_t st = kiln_tokenizer_load_json(json, strlen(json), "tokenizer.json", &tok);
  assert_null(tok);
  if (!st) fail_msg("expected an error containing '%s'", needle);
  if (!strstr(kiln_status_message(st), needle) || kiln_status_code(st) != code) {
    fail_msg("got [%s] %s; want [%s] containing '%s'", kiln_status_code_name(kiln_status_code(st)),
             kiln_status_message(st), kiln_status_code_name(code), needle);
  }
  kiln_status_free(st);
}

/* Encodes and renders the ids as "1 2 3". */
static char *enc(const kiln_tokenizer_t *tok, const char *text, bool special) {
  kiln_tokens_t ids = KILN_TOKENS_INIT;
  kiln_status_t st = kiln_tokenizer_encode(tok, text, strlen(text), special, &ids);
  if (st) fail_msg("encode(%s) failed: %s", text, kiln_status_message(st));
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  for (size_t i = 0; i < ids.len; i++) kiln_strbuf_printf(&b, i ? " %d" : "%d", (int)ids.ids[i]);
  kiln_tokens_free(&ids);
  return kiln_strbuf_detach(&b, NULL);
}

#define ASSERT_ENC(tok, text, special, want)                                                     \
  do {                                                                                           \
    char *got_ = enc(tok, text, special);                                                        \
    if (strcmp(got_, want) != 0) fail_msg("encode(\"%s\") = [%s], want [%s]", text, got_, want); \
    free(got_);                                                                                  \
  } while (0)

static char *dec(const kiln_tokenizer_t *tok, const int32_t *ids, size_t n, bool skip) {
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  kiln_status_t st = kiln_tokenizer_decode(tok, ids, n, skip, &b);
  if (st) fail_msg("decode failed: %s", kiln_status_message(st));
  return kiln_strbuf_detach(&b, NULL);
}

/* The streamed pieces must concatenate to the full decode. */
static void assert_stream(const kiln_tokenizer_t *tok, const int32_t *ids, size_t n, bool skip) {
  char *want = dec(tok, ids, n, skip);
  kiln_detok_t *d = NULL;
  assert_null(kiln_detok_create(tok, skip, &d));
  kiln_strbuf_t acc = KILN_STRBUF_INIT;
  for (size_t i = 0; i < n; i++) assert_null(kiln_detok_push(d, ids[i], &acc));
  assert_null(kiln_detok_flush(d, &acc));
  assert_string_equal(kiln_strbuf_cstr(&acc), want);
  kiln_strbuf_free(&acc);
  kiln_detok_free(d);
  free(want);
}

/* Runs one normalizer given as JSON over text. */
static char *normalize(const char *json, const char *text) {
  kiln_json_doc_t *doc = NULL;
  assert_null(kiln_json_parse(json, strlen(json), "n", &doc));
  kiln_arena_t a = KILN_ARENA_INIT;
  ktok_normalizer_t *nz = NULL;
  kiln_status_t st = ktok_normalizer_parse(&a, kiln_json_root(doc), "normalizer", &nz);
  if (st) fail_msg("%s", kiln_status_message(st));
  ktok_match_ctx_t mc;
  ktok_match_ctx_init(&mc);
  kiln_strbuf_t out = KILN_STRBUF_INIT;
  assert_null(ktok_normalize(nz, &mc, text, strlen(text), &out));
  ktok_match_ctx_free(&mc);
  ktok_normalizer_free(nz);
  kiln_arena_free(&a);
  kiln_json_doc_free(doc);
  return kiln_strbuf_detach(&out, NULL);
}

#define ASSERT_NORM(json, text, want)                                         \
  do {                                                                        \
    char *got_ = normalize(json, text);                                       \
    if (strcmp(got_, want) != 0)                                              \
      fail_msg("%s on \"%s\" = \"%s\", want \"%s\"", json, text, got_, want); \
    free(got_);                                                               \
  } while (0)

/* Runs one pre-tokenizer given as JSON over text; pieces joined with '|'. */
static char *pretok(const char *json, const char *text) {
  kiln_json_doc_t *doc = NULL;
  assert_null(kiln_json_parse(json, strlen(json), "p", &doc));
  kiln_arena_t a = KILN_ARENA_INIT;
  ktok_pretok_t *pt = NULL;
  kiln_status_t st = ktok_pretok_parse(&a, kiln_json_root(doc), "pre_tokenizer", &pt);
  if (st) fail_msg("%s", kiln_status_message(st));
  ktok_match_ctx_t mc;
  ktok_match_ctx_init(&mc);
  ktok_pieces_t p[3];
  memset(p, 0, sizeof(p));
  assert_true(ktok_pieces_add(&p[0], text, strlen(text), true));
  assert_null(ktok_pretokenize(pt, &mc, &p[0], &p[1], &p[2]));
  kiln_strbuf_t out = KILN_STRBUF_INIT;
  for (size_t i = 0; i < p[1].n; i++) {
    if (i) kiln_strbuf_append_char(&out, '|');
    kiln_strbuf_append(&out, p[1].text.data + p[1].v[i].off, p[1].v[i].len);
  }
  for (int i = 0; i < 3; i++) ktok_pieces_free(&p[i]);
  ktok_match_ctx_free(&mc);
  ktok_pretok_free(pt);
  kiln_arena_free(&a);
  kiln_json_doc_free(doc);
  return kiln_strbuf_detach(&out, NULL);
}

#define ASSERT_PRE(json, text, want)                                          \
  do {                                                                        \
    char *got_ = pretok(json, text);                                          \
    if (strcmp(got_, want) != 0)                                              \
      fail_msg("%s on \"%s\" = \"%s\", want \"%s\"", json, text, got_, want); \
    free(got_);                                                               \
  } while (0)

/* Copies tmpl into out with its one "@@" replaced by x (templates of JSON files). */
static void subst(char *out, size_t n, const char *tmpl, const char *x) {
  const char *at = strstr(tmpl, "@@");
  assert_non_null(at);
  assert_true(strlen(tmpl) + strlen(x) < n);
  size_t pre = (size_t)(at - tmpl);
  memcpy(out, tmpl, pre);
  strcpy(out + pre, x);
  strcat(out, at + 2);
}

/* ---- BPE ------------------------------------------------------------------------------- */

#define BPE_HEAD                                                                                \
  "{\"version\":\"1.0\",\"truncation\":null,\"padding\":null,\"added_tokens\":[],"              \
  "\"normalizer\":null,"                                                                        \
  "\"pre_tokenizer\":{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"trim_offsets\":true," \
  "\"use_regex\":true},"                                                                        \
  "\"post_processor\":null,\"decoder\":{\"type\":\"ByteLevel\"},"

static void test_bpe_merge_order(void **state) {
  (void)state;
  /* (b,c) has the better rank, so "abc" merges b+c first, then a+bc. */
  const char *json = BPE_HEAD
      "\"model\":{\"type\":\"BPE\",\"dropout\":null,\"unk_token\":null,\"fuse_unk\":false,"
      "\"byte_fallback\":false,\"vocab\":{\"a\":0,\"b\":1,\"c\":2,\"ab\":3,\"bc\":4,\"abc\":5,"
      "\"\\u0120\":6,\"\\u0120a\":7},\"merges\":[\"b c\",\"a b\",\"a bc\",\"\\u0120 a\"]}}";
  kiln_tokenizer_t *tok = load(json);
  ASSERT_ENC(tok, "abc", false, "5");
  ASSERT_ENC(tok, "ab", false, "3");
  ASSERT_ENC(tok, "abab", false, "3 3");
  ASSERT_ENC(tok, "cab", false, "2 3");
  ASSERT_ENC(tok, "ab abc", false, "3 6 5"); /* a+bc (rank 2) beats \u0120+a (rank 3) */
  ASSERT_ENC(tok, "", false, "");
  int32_t ids[] = {3, 7, 4};
  char *s = dec(tok, ids, 3, false);
  assert_string_equal(s, "ab abc");
  free(s);
  assert_int_equal(kiln_tokenizer_token_to_id(tok, "abc", 3), 5);
  size_t n = 0;
  assert_string_equal(kiln_tokenizer_id_to_token(tok, 4, &n), "bc");
  assert_int_equal(n, 2);
  assert_null(kiln_tokenizer_id_to_token(tok, 99, NULL));
  assert_int_equal(kiln_tokenizer_vocab_size(tok), 8);
  kiln_tokenizer_free(tok);

  /* The same merges in the pair form, with a different priority. */
  json = BPE_HEAD
      "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1,\"c\":2,\"ab\":3,\"bc\":4,\"abc\":5},"
      "\"merges\":[[\"a\",\"b\"],[\"b\",\"c\"]]}}";
  tok = load(json);
  ASSERT_ENC(tok, "abc", false, "3 2");
  kiln_tokenizer_free(tok);
}

static void test_bpe_ignore_merges(void **state) {
  (void)state;
  const char *fmt = BPE_HEAD
      "\"model\":{\"type\":\"BPE\",\"ignore_merges\":@@,\"vocab\":{\"a\":0,\"b\":1,\"c\":2,"
      "\"abc\":3,\"ab\":4},\"merges\":[\"a b\"]}}";
  char json[2048];
  subst(json, sizeof(json), fmt, "true");
  kiln_tokenizer_t *tok = load(json);
  ASSERT_ENC(tok, "abc", false, "3");
  kiln_tokenizer_free(tok);
  subst(json, sizeof(json), fmt, "false");
  tok = load(json);
  ASSERT_ENC(tok, "abc", false, "4 2");
  kiln_tokenizer_free(tok);
}

/* SentencePiece style: Prepend + Replace normalizer, byte fallback, unk, Llama 2's decoder. */
#define SP_JSON(byte_fallback, fuse)                                                              \
  "{\"added_tokens\":[{\"id\":0,\"content\":\"<unk>\",\"special\":true,\"normalized\":false},"    \
  "{\"id\":9,\"content\":\"<s>\",\"special\":true,\"normalized\":false}],"                        \
  "\"normalizer\":{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"Prepend\",\"prepend\":"     \
  "\"\\u2581\"},"                                                                                 \
  "{\"type\":\"Replace\",\"pattern\":{\"String\":\" \"},\"content\":\"\\u2581\"}]},"              \
  "\"pre_tokenizer\":null,"                                                                       \
  "\"post_processor\":{\"type\":\"TemplateProcessing\",\"single\":[{\"SpecialToken\":{\"id\":\"<" \
  "s>\",\"type_id\":0}},"                                                                         \
  "{\"Sequence\":{\"id\":\"A\",\"type_id\":0}}],\"pair\":[],\"special_tokens\":{\"<s>\":{\"id\":" \
  "\"<s>\",\"ids\":[9],\"tokens\":[\"<s>\"]}}},"                                                  \
  "\"decoder\":{\"type\":\"Sequence\",\"decoders\":[{\"type\":\"Replace\",\"pattern\":{"          \
  "\"String\":\"\\u2581\"},\"content\":\" \"},"                                                   \
  "{\"type\":\"ByteFallback\"},{\"type\":\"Fuse\"},{\"type\":\"Strip\",\"content\":\" "           \
  "\",\"start\":1,\"stop\":0}]},"                                                                 \
  "\"model\":{\"type\":\"BPE\",\"unk_token\":\"<unk>\",\"fuse_unk\":" fuse                        \
  ",\"byte_fallback\":" byte_fallback                                                             \
  ","                                                                                             \
  "\"vocab\":{\"<unk>\":0,\"\\u2581\":1,\"h\":2,\"i\":3,\"<0xE4>\":4,\"<0xBD>\":5,\"<0xA0>\":6,"  \
  "\"\\u2581h\":7,\"\\u2581hi\":8,\"<s>\":9},\"merges\":[\"\\u2581 h\",\"\\u2581h i\"]}}"

static void test_bpe_byte_fallback_unk(void **state) {
  (void)state;
  kiln_tokenizer_t *tok = load(SP_JSON("true", "true"));
  ASSERT_ENC(tok, "hi", false, "8");
  ASSERT_ENC(tok, "hi", true, "9 8");
  ASSERT_ENC(tok, "hi hi", false, "8 8");
  ASSERT_ENC(tok, "hi\xe4\xbd\xa0", false, "8 4 5 6");         /* 你 via byte fallback */
  ASSERT_ENC(tok, "hi\xe5\xa5\xbd\xe5\xa5\xbd", false, "8 0"); /* 好好: no bytes, fused unk */
  ASSERT_ENC(tok, "<s>hi", false, "9 8"); /* "\u2581" is prepended after an added token too */
  ASSERT_ENC(tok, "", true, "9");
  int32_t ids[] = {9, 8, 4, 5, 6, 1, 2};
  char *s = dec(tok, ids, 7, false);
  assert_string_equal(s, "<s> hi\xe4\xbd\xa0 h");
  free(s);
  s = dec(tok, ids, 7, true);
  assert_string_equal(s, "hi\xe4\xbd\xa0 h");
  free(s);
  int32_t bad[] = {8, 4, 5, 2}; /* an incomplete byte run: one U+FFFD per byte */
  s = dec(tok, bad, 4, false);
  assert_string_equal(s, "hi\xef\xbf\xbd\xef\xbf\xbdh");
  free(s);
  assert_stream(tok, ids, 7, false);
  assert_stream(tok, ids, 7, true);
  assert_stream(tok, bad, 4, false);
  int32_t spaces[] = {1, 1, 7, 1, 4, 5, 6, 4, 2, 0, 1};
  assert_stream(tok, spaces, sizeof(spaces) / sizeof(spaces[0]), false);
  assert_stream(tok, spaces, sizeof(spaces) / sizeof(spaces[0]), true);
  assert_true(kiln_tokenizer_is_special(tok, 9));
  assert_false(kiln_tokenizer_is_special(tok, 8));
  kiln_tokenizer_free(tok);

  tok = load(SP_JSON("false", "false"));
  ASSERT_ENC(tok, "hi\xe4\xbd\xa0\xe5\xa5\xbd", false, "8 0 0");
  kiln_tokenizer_free(tok);
}

/* ---- normalizers ----------------------------------------------------------------------- */

static void test_normalizers(void **state) {
  (void)state;
  ASSERT_NORM("{\"type\":\"NFC\"}", "e\xcc\x81", "\xc3\xa9");
  ASSERT_NORM("{\"type\":\"NFD\"}", "\xc3\xa9", "e\xcc\x81");
  ASSERT_NORM("{\"type\":\"NFKC\"}", "\xef\xac\x81 \xef\xbc\xa1", "fi A"); /* ﬁ, full-width A */
  ASSERT_NORM("{\"type\":\"NFKD\"}", "\xc3\xa9", "e\xcc\x81");
  ASSERT_NORM("{\"type\":\"NFC\"}", "plain ascii", "plain ascii");
  ASSERT_NORM("{\"type\":\"Lowercase\"}", "HeLLo \xc3\x89\xc4\xb0", "hello \xc3\xa9i\xcc\x87");
  ASSERT_NORM("{\"type\":\"Replace\",\"pattern\":{\"String\":\" \"},\"content\":\"\\u2581\"}",
              "a b  c",
              "a\xe2\x96\x81"
              "b\xe2\x96\x81\xe2\x96\x81"
              "c");
  ASSERT_NORM("{\"type\":\"Replace\",\"pattern\":{\"Regex\":\" {2,}\"},\"content\":\" \"}",
              "a  b     c d", "a b c d");
  ASSERT_NORM("{\"type\":\"Prepend\",\"prepend\":\"\\u2581\"}", "x", "\xe2\x96\x81x");
  ASSERT_NORM("{\"type\":\"Prepend\",\"prepend\":\"\\u2581\"}", "", "");
  ASSERT_NORM("{\"type\":\"Strip\",\"strip_left\":true,\"strip_right\":true}", " \t a b \n", "a b");
  ASSERT_NORM("{\"type\":\"Strip\",\"strip_left\":false,\"strip_right\":true}", "  a  ", "  a");
  ASSERT_NORM("{\"type\":\"StripAccents\"}", "e\xcc\x81", "e");
  ASSERT_NORM(
      "{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"NFD\"},{\"type\":\"StripAccents\"},"
      "{\"type\":\"Lowercase\"}]}",
      "\xc3\x89t\xc3\xa9", "ete");
  ASSERT_NORM("{\"type\":\"Sequence\",\"normalizers\":[]}", "same", "same");
}

/* ---- pre-tokenizers -------------------------------------------------------------------- */

static void test_pretokenizers(void **state) {
  (void)state;
#define SPLIT(re, beh, inv)                                                    \
  "{\"type\":\"Split\",\"pattern\":{\"Regex\":\"" re "\"},\"behavior\":\"" beh \
  "\",\"invert\":" inv "}"
  ASSERT_PRE(SPLIT("\\\\d+", "Isolated", "false"), "ab12cd345", "ab|12|cd|345");
  ASSERT_PRE(SPLIT("\\\\d+", "Removed", "false"), "ab12cd345", "ab|cd");
  ASSERT_PRE(SPLIT("\\\\d+", "Removed", "true"), "ab12cd345", "12|345");
  ASSERT_PRE(SPLIT("\\\\d+", "MergedWithPrevious", "false"), "ab12cd345", "ab12|cd345");
  ASSERT_PRE(SPLIT("\\\\d+", "MergedWithNext", "false"), "ab12cd345x", "ab|12cd|345x");
  ASSERT_PRE(SPLIT("\\\\d", "Contiguous", "false"), "ab12cd3", "ab|12|cd|3");
  ASSERT_PRE(SPLIT("\\\\d", "Isolated", "false"), "ab12cd3", "ab|1|2|cd|3");
  ASSERT_PRE(
      "{\"type\":\"Split\",\"pattern\":{\"String\":\"-\"},\"behavior\":\"Removed\",\"invert\":"
      "false}",
      "a-b--c", "a|b|c");
  ASSERT_PRE(
      "{\"type\":\"Metaspace\",\"replacement\":\"\\u2581\",\"prepend_scheme\":\"always\",\"split\":"
      "true}",
      "Hey   friend!",
      "\xe2\x96\x81Hey|\xe2\x96\x81|\xe2\x96\x81|\xe2\x96\x81"
      "friend!");
  ASSERT_PRE(
      "{\"type\":\"Metaspace\",\"replacement\":\"\\u2581\",\"prepend_scheme\":\"never\",\"split\":"
      "false}",
      "a b",
      "a\xe2\x96\x81"
      "b");
  ASSERT_PRE("{\"type\":\"Digits\",\"individual_digits\":true}", "a123b", "a|1|2|3|b");
  ASSERT_PRE("{\"type\":\"Digits\",\"individual_digits\":false}", "a123b", "a|123|b");
  ASSERT_PRE("{\"type\":\"Whitespace\"}", "Hey friend!  ok?", "Hey|friend|!|ok|?");
  ASSERT_PRE("{\"type\":\"WhitespaceSplit\"}", "a  b\tc ", "a|b|c");
  ASSERT_PRE("{\"type\":\"Punctuation\",\"behavior\":\"Isolated\"}", "Hey, you!", "Hey|,| you|!");
  ASSERT_PRE("{\"type\":\"ByteLevel\",\"add_prefix_space\":true,\"use_regex\":true}", "Hello world",
             "\xc4\xa0Hello|\xc4\xa0world");
  ASSERT_PRE("{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"use_regex\":true}",
             "I'm  \xc3\xa9t\xc3\xa9\n",
             "I|'m|\xc4\xa0|\xc4\xa0\xc3\x83\xc2\xa9t\xc3\x83\xc2\xa9|\xc4\x8a");
  ASSERT_PRE(
      "{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"WhitespaceSplit\"},"
      "{\"type\":\"Digits\",\"individual_digits\":true},{\"type\":\"Sequence\",\"pretokenizers\":"
      "[{\"type\":\"Punctuation\"}]}]}",
      "ab12 x,y", "ab|1|2|x|,|y");
#undef SPLIT
}

/* ---- added tokens ---------------------------------------------------------------------- */

static void test_added_tokens(void **state) {
  (void)state;
  const char *json =
      "{\"added_tokens\":["
      "{\"id\":3,\"content\":\"<m>\",\"single_word\":false,\"lstrip\":true,\"rstrip\":true,"
      "\"normalized\":false,\"special\":true},"
      "{\"id\":4,\"content\":\"ab\",\"single_word\":true,\"lstrip\":false,\"rstrip\":false,"
      "\"normalized\":false,\"special\":false},"
      "{\"id\":5,\"content\":\"CD\",\"single_word\":false,\"lstrip\":false,\"rstrip\":false,"
      "\"normalized\":true,\"special\":false},"
      "{\"id\":8,\"content\":\"<mm>\",\"normalized\":false,\"special\":true}],"
      "\"normalizer\":{\"type\":\"Lowercase\"},\"pre_tokenizer\":null,\"post_processor\":null,"
      "\"decoder\":null,"
      "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1,\" "
      "\":2,\"c\":6,\"d\":7},\"merges\":[]}}";
  kiln_tokenizer_t *tok = load(json);
  ASSERT_ENC(tok, "a <m> b", false, "0 3 1");
  ASSERT_ENC(tok, "a  <m>", false, "0 3");
  ASSERT_ENC(tok, "a<mm>b", false, "0 8 1"); /* longest match wins */
  ASSERT_ENC(tok, "ab", false, "4");
  ASSERT_ENC(tok, "aab", false, "0 0 1"); /* single_word: not inside a word */
  ASSERT_ENC(tok, "ab b", false, "4 2 1");
  ASSERT_ENC(tok, "aCDa", false, "0 5 0"); /* matched after normalization */
  ASSERT_ENC(tok, "acda", false, "0 5 0");
  ASSERT_ENC(tok, "A", false, "0");
  int32_t ids[] = {0, 3, 1};
  char *s = dec(tok, ids, 3, false);
  assert_string_equal(s, "a <m> b"); /* no decoder: tokens joined with spaces */
  free(s);
  s = dec(tok, ids, 3, true);
  assert_string_equal(s, "a b");
  free(s);
  assert_int_equal(kiln_tokenizer_token_to_id(tok, "<m>", 3), 3);
  assert_true(kiln_tokenizer_is_special(tok, 3));
  assert_false(kiln_tokenizer_is_special(tok, 4));
  assert_int_equal(kiln_tokenizer_vocab_size(tok), 9);
  assert_null(kiln_tokenizer_id_to_token(tok, -1, NULL));
  kiln_tokenizer_free(tok);
}

/* ---- post-processors and decoders ------------------------------------------------------ */

static void test_post_processors(void **state) {
  (void)state;
  const char *fmt =
      "{\"added_tokens\":[],\"normalizer\":null,\"pre_tokenizer\":null,\"decoder\":null,"
      "\"post_processor\":@@,"
      "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"<s>\":1,\"</s>\":2},\"merges\":[]}}";
  char json[4096];
  subst(json, sizeof(json), fmt,
        "{\"type\":\"TemplateProcessing\",\"single\":[{\"SpecialToken\":{\"id\":\"<s>\",\"type_"
        "id\":0}},"
        "{\"Sequence\":{\"id\":\"A\",\"type_id\":0}},{\"SpecialToken\":{\"id\":\"</"
        "s>\",\"type_id\":0}}],"
        "\"pair\":[],\"special_tokens\":{\"<s>\":{\"id\":\"<s>\",\"ids\":[1],\"tokens\":[\"<s>\"]},"
        "\"</s>\":{\"id\":\"</s>\",\"ids\":[2],\"tokens\":[\"</s>\"]}}}");
  kiln_tokenizer_t *tok = load(json);
  ASSERT_ENC(tok, "aa", true, "1 0 0 2");
  ASSERT_ENC(tok, "aa", false, "0 0");
  kiln_tokenizer_free(tok);
  subst(json, sizeof(json), fmt,
        "{\"type\":\"Sequence\",\"processors\":[{\"type\":\"ByteLevel\",\"trim_offsets\":false},"
        "{\"type\":\"RobertaProcessing\",\"sep\":[\"</"
        "s>\",2],\"cls\":[\"<s>\",1],\"trim_offsets\":true,"
        "\"add_prefix_space\":false}]}");
  tok = load(json);
  ASSERT_ENC(tok, "a", true, "1 0 2");
  kiln_tokenizer_free(tok);
}

static void test_decoders(void **state) {
  (void)state;
  const char *fmt =
      "{\"added_tokens\":[],\"normalizer\":null,\"pre_tokenizer\":null,\"post_processor\":null,"
      "\"decoder\":@@,\"model\":{\"type\":\"BPE\",\"vocab\":{\"\\u2581Hey\":0,\"\\u2581friend!\":1,"
      "\"_x_\":2,\"\\u2581\\u2581\":3},\"merges\":[]}}";
  char json[4096];
  int32_t ids[] = {0, 1, 2, 3};
  struct {
    const char *decoder, *want;
  } cases[] = {
      {"{\"type\":\"Metaspace\",\"replacement\":\"\\u2581\",\"prepend_scheme\":\"always\","
       "\"split\":true}",
       "Hey friend!_x_  "},
      {"{\"type\":\"Metaspace\",\"replacement\":\"\\u2581\",\"prepend_scheme\":\"never\",\"split\":"
       "true}",
       " Hey friend!_x_  "},
      {"{\"type\":\"Sequence\",\"decoders\":[{\"type\":\"Replace\",\"pattern\":{\"String\":\"_\"},"
       "\"content\":\"-\"},"
       "{\"type\":\"Fuse\"},{\"type\":\"Strip\",\"content\":\"\\u2581\",\"start\":1,\"stop\":2}]}",
       "Hey\xe2\x96\x81"
       "friend!-x-"},
      {"{\"type\":\"Replace\",\"pattern\":{\"Regex\":\"\\u2581+\"},\"content\":\" \"}",
       " Hey friend!_x_ "},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    subst(json, sizeof(json), fmt, cases[i].decoder);
    kiln_tokenizer_t *tok = load(json);
    char *s = dec(tok, ids, 4, false);
    if (strcmp(s, cases[i].want) != 0)
      fail_msg("%s: \"%s\", want \"%s\"", cases[i].decoder, s, cases[i].want);
    free(s);
    assert_stream(tok, ids, 4, false);
    kiln_tokenizer_free(tok);
  }
}

/* ---- errors ---------------------------------------------------------------------------- */

#define MODEL_OK \
  "\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1,\"ab\":2},\"merges\":[\"a b\"]}"

static void test_load_errors(void **state) {
  (void)state;
  expect_error("{\"model\":", KILN_ERR_INVALID_ARGUMENT, "tokenizer.json");
  expect_error("[1,2]", KILN_ERR_INVALID_ARGUMENT, "top level must be an object");
  expect_error("{\"normalizer\":null}", KILN_ERR_INVALID_ARGUMENT,
               "tokenizer.json: model: is missing");
  expect_error("{\"model\":{\"type\":\"BPE\",\"vocab\":[],\"merges\":[]}}",
               KILN_ERR_INVALID_ARGUMENT, "model: vocab must be an object");
  expect_error("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[\"a zz\"]}}",
               KILN_ERR_INVALID_ARGUMENT, "model: merges[0]: token 'zz' is not in the vocabulary");
  expect_error("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":0},\"merges\":[]}}",
               KILN_ERR_INVALID_ARGUMENT, "id 0 is used by both 'a' and 'b'");
  expect_error("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":-1},\"merges\":[]}}",
               KILN_ERR_INVALID_ARGUMENT, "vocab['a'] must be an integer id");
  expect_error("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[\"ab\"]}}",
               KILN_ERR_INVALID_ARGUMENT, "merges[0] must be");
  expect_error("{\"model\":{\"type\":\"WordPiece\",\"vocab\":{}}}", KILN_ERR_UNSUPPORTED,
               "model: type 'WordPiece' is not supported");
  expect_error("{\"model\":{\"type\":\"Unigram\",\"vocab\":[]}}", KILN_ERR_UNSUPPORTED,
               "model: type 'Unigram' is not supported");
  expect_error("{\"model\":{\"type\":\"BPE\",\"dropout\":0.1,\"vocab\":{},\"merges\":[]}}",
               KILN_ERR_UNSUPPORTED, "model: dropout must be null");
  expect_error(
      "{\"model\":{\"type\":\"BPE\",\"continuing_subword_prefix\":\"##\",\"vocab\":{},\"merges\":[]"
      "}}",
      KILN_ERR_UNSUPPORTED, "model: a non-empty continuing_subword_prefix is not supported");
  expect_error("{\"model\":{\"type\":\"BPE\",\"unk_token\":\"<unk>\",\"vocab\":{},\"merges\":[]}}",
               KILN_ERR_INVALID_ARGUMENT, "unk_token '<unk>' is not in the vocabulary");
  expect_error("{\"model\":{\"type\":\"BPE\",\"colour\":1,\"vocab\":{},\"merges\":[]}}",
               KILN_ERR_UNSUPPORTED, "model: field 'colour' is not supported");
  expect_error(
      "{\"pre_tokenizer\":{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Digits\"},"
      "{\"type\":\"UnicodeScripts\"}]}," MODEL_OK "}",
      KILN_ERR_UNSUPPORTED,
      "tokenizer.json: pre_tokenizer.pretokenizers[1]: type 'UnicodeScripts' is not supported");
  expect_error("{\"normalizer\":{\"type\":\"BertNormalizer\"}," MODEL_OK "}", KILN_ERR_UNSUPPORTED,
               "normalizer: type 'BertNormalizer' is not supported");
  expect_error(
      "{\"normalizer\":{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"NFC\"},"
      "{\"type\":\"Precompiled\",\"precompiled_charsmap\":\"\"}]}," MODEL_OK "}",
      KILN_ERR_UNSUPPORTED, "normalizer.normalizers[1]: type 'Precompiled' is not supported");
  expect_error("{\"decoder\":{\"type\":\"WordPiece\",\"prefix\":\"##\"}," MODEL_OK "}",
               KILN_ERR_UNSUPPORTED, "decoder: type 'WordPiece' is not supported");
  expect_error(
      "{\"post_processor\":{\"type\":\"BertProcessing\",\"cls\":[\"[CLS]\",0],\"sep\":[\"[SEP]\"]}"
      "," MODEL_OK "}",
      KILN_ERR_INVALID_ARGUMENT, "post_processor: sep must be [token, id]");
  /* A post-processor id past the vocabulary (found by fuzz_tokenizer: it reached encode's
   * output), in BertProcessing and in a TemplateProcessing nested in a Sequence. */
  expect_error(
      "{\"post_processor\":{\"type\":\"BertProcessing\",\"cls\":[\"[CLS]\",446],"
      "\"sep\":[\"[SEP]\",0]}," MODEL_OK "}",
      KILN_ERR_INVALID_ARGUMENT,
      "post_processor: token id 446 is out of range (vocabulary size");
  expect_error(
      "{\"post_processor\":{\"type\":\"Sequence\",\"processors\":[{\"type\":"
      "\"TemplateProcessing\",\"single\":[{\"SpecialToken\":{\"id\":\"<s>\",\"type_id\":0}},"
      "{\"Sequence\":{\"id\":\"A\",\"type_id\":0}}],\"pair\":[],\"special_tokens\":{\"<s>\":"
      "{\"id\":\"<s>\",\"ids\":[0,99999],\"tokens\":[\"<s>\"]}}}]}," MODEL_OK "}",
      KILN_ERR_INVALID_ARGUMENT, "token id 99999 is out of range");
  expect_error(
      "{\"pre_tokenizer\":{\"type\":\"Split\",\"pattern\":{\"Regex\":\"(\"},\"behavior\":"
      "\"Isolated\","
      "\"invert\":false}," MODEL_OK "}",
      KILN_ERR_INVALID_ARGUMENT, "pre_tokenizer.pattern: regex /(/");
  expect_error(
      "{\"pre_tokenizer\":{\"type\":\"Split\",\"pattern\":{\"Regex\":\"a\"},\"behavior\":"
      "\"Sideways\","
      "\"invert\":false}," MODEL_OK "}",
      KILN_ERR_UNSUPPORTED, "behavior 'Sideways' is not supported");
  expect_error("{\"truncation\":{\"max_length\":5}," MODEL_OK "}", KILN_ERR_UNSUPPORTED,
               "truncation");
  expect_error("{\"added_tokens\":[{\"content\":\"x\"}]," MODEL_OK "}", KILN_ERR_INVALID_ARGUMENT,
               "added_tokens[0]: id must be an integer");
  expect_error("{\"added_tokens\":{}," MODEL_OK "}", KILN_ERR_INVALID_ARGUMENT,
               "added_tokens: must be an array");
  expect_error("{\"nonsense\":1," MODEL_OK "}", KILN_ERR_UNSUPPORTED,
               "field 'nonsense' is not supported");

  /* Files that are not there / not tokenizer files. */
  kiln_tokenizer_t *tok = NULL;
  kiln_status_t st = kiln_tokenizer_load("/nonexistent/kiln/tokenizer", &tok);
  assert_null(tok);
  assert_int_equal(kiln_status_code(st), KILN_ERR_NOT_FOUND);
  kiln_status_free(st);
  char dir[] = "/tmp/kiln_tok_XXXXXX";
  assert_non_null(mkdtemp(dir));
  st = kiln_tokenizer_load(dir, &tok); /* a directory without tokenizer.json */
  assert_non_null(st);
  assert_null(tok);
  kiln_status_free(st);
  char path[256];
  snprintf(path, sizeof(path), "%s/tokenizer.json", dir);
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fputs("{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0}", f); /* truncated */
  fclose(f);
  st = kiln_tokenizer_load(dir, &tok);
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  kiln_status_free(st);
  f = fopen(path, "w");
  fputs("{" MODEL_OK "}", f);
  fclose(f);
  char cfg[256];
  snprintf(cfg, sizeof(cfg), "%s/tokenizer_config.json", dir);
  f = fopen(cfg, "w");
  fputs("{\"bos_token\":{\"content\":\"ab\"},\"eos_token\":\"b\",\"add_bos_token\":true}", f);
  fclose(f);
  assert_null(kiln_tokenizer_load(dir, &tok));
  assert_int_equal(kiln_tokenizer_bos_id(tok), 2);
  assert_int_equal(kiln_tokenizer_eos_id(tok), 1);
  assert_string_equal(kiln_tokenizer_bos_token(tok), "ab");
  assert_true(kiln_tokenizer_add_bos(tok));
  assert_false(kiln_tokenizer_add_eos(tok));
  kiln_tokenizer_free(tok);
  tok = NULL;
  assert_null(kiln_tokenizer_load(path, &tok)); /* the file directly */
  kiln_tokenizer_free(tok);
  unlink(cfg);
  unlink(path);
  rmdir(dir);
}

static void test_runtime_errors(void **state) {
  (void)state;
  kiln_tokenizer_t *tok = load("{" MODEL_OK "}");
  kiln_tokens_t ids = KILN_TOKENS_INIT;
  kiln_status_t st = kiln_tokenizer_encode(tok,
                                           "ab\xff"
                                           "ab",
                                           5, false, &ids);
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(kiln_status_message(st), "offset 2"));
  assert_int_equal(ids.len, 0);
  kiln_status_free(st);
  st = kiln_tokenizer_encode(tok, "a\xe4\xbd", 3, false, &ids); /* truncated sequence */
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  kiln_status_free(st);
  int32_t bad[] = {0, 12345};
  kiln_strbuf_t out = KILN_STRBUF_INIT;
  st = kiln_tokenizer_decode(tok, bad, 2, false, &out);
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(kiln_status_message(st), "token id 12345"));
  kiln_status_free(st);
  kiln_detok_t *d = NULL;
  assert_null(kiln_detok_create(tok, false, &d));
  st = kiln_detok_push(d, -3, &out);
  assert_non_null(strstr(kiln_status_message(st), "token id -3"));
  kiln_status_free(st);
  kiln_detok_free(d);
  kiln_strbuf_free(&out);
  /* NUL bytes are ordinary characters. */
  ASSERT_ENC(tok, "", false, "");
  st = kiln_tokenizer_encode(tok, "a\0b", 3, false, &ids);
  assert_null(st);
  kiln_tokens_free(&ids);
  kiln_tokenizer_free(tok);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_bpe_merge_order),       cmocka_unit_test(test_bpe_ignore_merges),
      cmocka_unit_test(test_bpe_byte_fallback_unk), cmocka_unit_test(test_normalizers),
      cmocka_unit_test(test_pretokenizers),         cmocka_unit_test(test_added_tokens),
      cmocka_unit_test(test_post_processors),       cmocka_unit_test(test_decoders),
      cmocka_unit_test(test_load_errors),           cmocka_unit_test(test_runtime_errors),
      cmocka_unit_test(tkt_golden_qwen3),           cmocka_unit_test(tkt_golden_llama3),
      cmocka_unit_test(tkt_golden_llama2),          cmocka_unit_test(tkt_golden_gemma3),
      cmocka_unit_test(tkt_golden_mistral_nemo),    cmocka_unit_test(tkt_golden_deepseek_v3),
      cmocka_unit_test(tkt_golden_gpt4o),           cmocka_unit_test(tkt_gguf_vocabs),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
