/* test_textout.c - cmocka tests for core/engine/textout: stop strings over two synthetic
 * tokenizers (byte-level BPE; SentencePiece-style with byte fallback), case by case and as a
 * property test against a reference (the full decode, cut at the first stop string that ends
 * in text produced once check_stop is true).
 *
 * KILN_TEST_SEED sets the property test's seed (default: the time; printed to reproduce);
 * KILN_TEST_TRIALS its trials per tokenizer (default 1000: a few seconds under valgrind). */
#define _POSIX_C_SOURCE 200809L
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/engine/textout.h"
#include "base/strbuf.h"
#include "models/tokenizer/tokenizer.h"

/* ---- a byte-level BPE tokenizer: ids 0..255 are the bytes, then multi-byte tokens ---------- */

/* Tokens beyond the 256 bytes: whole words, whole multi-byte characters, a token holding half
 * a character ("\xE2\x82", the first two bytes of the euro sign) and one mixing both. */
static const char *const k_multi[] = {
    "ab",
    "abc",
    "bca",
    " a",
    "\xC3\xA9" /* é */,
    "\xE2\x82\xAC" /* € */,
    "a\xE2\x82\xAC"
    "b",
    "\xF0\x9F\x98\x80" /* 😀 */,
    "\xE2\x82",
    "ll",
    "hello",
    " the",
    "\xC3\xA9\xC3\xA9",
};
#define NUM_MULTI ((int32_t)(sizeof(k_multi) / sizeof(k_multi[0])))
#define SPECIAL_ID (256 + NUM_MULTI)
#define SPECIAL_TEXT "<|end|>"

static kiln_tokenizer_t *g_tok;

/* GPT-2's byte to character map, as UTF-8, JSON-escaped. */
static void put_byte_char(kiln_strbuf_t *b, unsigned char c) {
  static unsigned map[256];
  static bool init;
  if (!init) {
    unsigned n = 0;
    for (unsigned x = 0; x < 256; x++) {
      bool self = (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || x >= 174;
      map[x] = self ? x : 256 + n++;
    }
    init = true;
  }
  if (map[c] == '"' || map[c] == '\\') kiln_strbuf_append_char(b, '\\');
  kiln_strbuf_append_utf8(b, map[c]);
}

static kiln_tokenizer_t *make_tokenizer(void) {
  kiln_strbuf_t j = KILN_STRBUF_INIT;
  kiln_strbuf_printf(&j,
                     "{\"version\":\"1.0\",\"added_tokens\":[{\"id\":%d,\"content\":\"%s\","
                     "\"single_word\":false,\"lstrip\":false,\"rstrip\":false,"
                     "\"normalized\":false,\"special\":true}],\"normalizer\":null,"
                     "\"pre_tokenizer\":{\"type\":\"ByteLevel\",\"add_prefix_space\":false,"
                     "\"trim_offsets\":true,\"use_regex\":true},\"post_processor\":null,"
                     "\"decoder\":{\"type\":\"ByteLevel\",\"add_prefix_space\":true,"
                     "\"trim_offsets\":true,\"use_regex\":true},"
                     "\"model\":{\"type\":\"BPE\",\"dropout\":null,\"unk_token\":null,"
                     "\"continuing_subword_prefix\":null,\"end_of_word_suffix\":null,"
                     "\"fuse_unk\":false,\"byte_fallback\":false,\"vocab\":{",
                     SPECIAL_ID, SPECIAL_TEXT);
  for (int b = 0; b < 256; b++) {
    kiln_strbuf_append_char(&j, '"');
    put_byte_char(&j, (unsigned char)b);
    kiln_strbuf_printf(&j, "\":%d,", b);
  }
  for (int32_t i = 0; i < NUM_MULTI; i++) {
    kiln_strbuf_append_char(&j, '"');
    for (const char *c = k_multi[i]; *c; c++) put_byte_char(&j, (unsigned char)*c);
    kiln_strbuf_printf(&j, "\":%d%s", 256 + i, i + 1 < NUM_MULTI ? "," : "");
  }
  kiln_strbuf_append_str(&j, "},\"merges\":[]}}");
  assert_true(kiln_strbuf_ok(&j));
  kiln_tokenizer_t *tok = NULL;
  kiln_status_t st = kiln_tokenizer_load_json(j.data, j.len, "textout-test.json", &tok);
  if (st) fail_msg("tokenizer: %s", kiln_status_message(st));
  kiln_strbuf_free(&j);
  return tok;
}

/* The id of a token's text (a single byte, a k_multi entry or the special token). */
static int32_t tid(const char *s) {
  if (strlen(s) == 1) return (unsigned char)s[0];
  if (strcmp(s, SPECIAL_TEXT) == 0) return SPECIAL_ID;
  for (int32_t i = 0; i < NUM_MULTI; i++)
    if (strcmp(s, k_multi[i]) == 0) return 256 + i;
  fail_msg("no token '%s'", s);
  return -1;
}

/* A SentencePiece-style tokenizer with byte fallback (Llama 2's decoder: "▁" to space,
 * ByteFallback, Fuse, strip one leading space): the detokenizer holds runs of <0xNN> tokens
 * until they end, so more text comes out late, at finish. */
enum { SP_UNK = 0, SP_BOS = 1, SP_WORDS = 2, SP_BYTES = 11 };
static const char *const k_sp_words[] = {"\xE2\x96\x81",
                                         "a",
                                         "b",
                                         "c",
                                         "\xE2\x96\x81"
                                         "a",
                                         "ab",
                                         "\xE2\x96\x81the",
                                         "\xC3\xA9",
                                         "\xE2\x82\xAC"};
static kiln_tokenizer_t *g_sp;

static kiln_tokenizer_t *make_sp_tokenizer(void) {
  kiln_strbuf_t j = KILN_STRBUF_INIT;
  kiln_strbuf_append_str(
      &j,
      "{\"added_tokens\":[{\"id\":0,\"content\":\"<unk>\",\"special\":true,\"normalized\":false},"
      "{\"id\":1,\"content\":\"<s>\",\"special\":true,\"normalized\":false}],"
      "\"normalizer\":null,\"pre_tokenizer\":null,\"post_processor\":null,"
      "\"decoder\":{\"type\":\"Sequence\",\"decoders\":[{\"type\":\"Replace\",\"pattern\":{"
      "\"String\":\"\\u2581\"},\"content\":\" \"},{\"type\":\"ByteFallback\"},{\"type\":\"Fuse\"},"
      "{\"type\":\"Strip\",\"content\":\" \",\"start\":1,\"stop\":0}]},"
      "\"model\":{\"type\":\"BPE\",\"unk_token\":\"<unk>\",\"fuse_unk\":true,"
      "\"byte_fallback\":true,\"vocab\":{\"<unk>\":0,\"<s>\":1");
  for (int i = 0; i < SP_BYTES - SP_WORDS; i++)
    kiln_strbuf_printf(&j, ",\"%s\":%d", k_sp_words[i], SP_WORDS + i);
  for (int b = 0; b < 256; b++) kiln_strbuf_printf(&j, ",\"<0x%02X>\":%d", b, SP_BYTES + b);
  kiln_strbuf_append_str(&j, "},\"merges\":[]}}");
  assert_true(kiln_strbuf_ok(&j));
  kiln_tokenizer_t *tok = NULL;
  kiln_status_t st = kiln_tokenizer_load_json(j.data, j.len, "textout-sp.json", &tok);
  if (st) fail_msg("tokenizer: %s", kiln_status_message(st));
  kiln_strbuf_free(&j);
  return tok;
}

static int setup(void **state) {
  (void)state;
  g_tok = make_tokenizer();
  g_sp = make_sp_tokenizer();
  return 0;
}

static int teardown(void **state) {
  (void)state;
  kiln_tokenizer_free(g_tok);
  kiln_tokenizer_free(g_sp);
  return 0;
}

static bool valid_utf8(const char *s, size_t n) {
  size_t i = 0;
  while (i < n) {
    unsigned char c = (unsigned char)s[i];
    size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (!len || i + len > n) return false;
    for (size_t k = 1; k < len; k++)
      if (((unsigned char)s[i + k] & 0xC0) != 0x80) return false;
    i += len;
  }
  return true;
}

/* ---- one run ------------------------------------------------------------------------------ */

typedef struct run {
  kiln_strbuf_t text; /* everything emitted */
  int stop_push;      /* 1-based push that reported a stop, 0 if none */
  int32_t stop_index; /* what it reported, -1 if none */
  size_t *after;      /* emitted length after each push (n entries) */
} run_t;

/* Pushes ids with check_stop from push k (0-based) on; finish when no stop. Every emitted piece
 * must be whole UTF-8 characters. */
static void run_textout(const kiln_tokenizer_t *tok, const char *const *stop, int32_t nstop,
                        bool include, bool skip, const int32_t *ids, int n, int k, run_t *r) {
  kiln_textout_t *t = NULL;
  kiln_status_t st = kiln_textout_create(tok, skip, stop, nstop, include, &t);
  assert_null(st);
  kiln_strbuf_t piece = KILN_STRBUF_INIT;
  r->text = (kiln_strbuf_t)KILN_STRBUF_INIT;
  r->stop_push = 0;
  r->stop_index = -1;
  r->after = calloc((size_t)n + 1, sizeof(size_t));
  assert_non_null(r->after);
  for (int i = 0; i < n; i++) {
    int32_t stopped = 99;
    kiln_strbuf_reset(&piece);
    st = kiln_textout_push(t, ids[i], i >= k, &piece, &stopped);
    if (st) fail_msg("push: %s", kiln_status_message(st));
    if (!valid_utf8(piece.data, piece.len)) fail_msg("push %d emitted half a character", i);
    kiln_strbuf_append(&r->text, piece.data, piece.len);
    r->after[i] = r->text.len;
    if (stopped >= 0) {
      r->stop_push = i + 1;
      r->stop_index = stopped;
      /* Pushing more after a stop emits nothing and repeats the index. */
      kiln_strbuf_reset(&piece);
      st = kiln_textout_push(t, ids[i], true, &piece, &stopped);
      assert_null(st);
      assert_int_equal(piece.len, 0);
      assert_int_equal(stopped, r->stop_index);
      break;
    }
    assert_int_equal(stopped, -1);
  }
  kiln_strbuf_reset(&piece);
  st = kiln_textout_finish(t, &piece);
  assert_null(st);
  if (r->stop_push) assert_int_equal(piece.len, 0);
  assert_true(valid_utf8(piece.data, piece.len));
  kiln_strbuf_append(&r->text, piece.data, piece.len);
  /* finish is final. */
  kiln_strbuf_reset(&piece);
  assert_null(kiln_textout_finish(t, &piece));
  assert_int_equal(piece.len, 0);
  assert_true(kiln_strbuf_ok(&r->text));
  kiln_strbuf_free(&piece);
  kiln_textout_free(t);
}

static void run_free(run_t *r) {
  kiln_strbuf_free(&r->text);
  free(r->after);
}

/* Runs strings as tokens (each a tid() text) and checks the text and the stop. */
static void check_case(const char *const *stop, int32_t nstop, bool include, int k,
                       const char *const *toks, int n, const char *want, int want_push,
                       int32_t want_index) {
  int32_t ids[64];
  assert_true(n <= 64);
  for (int i = 0; i < n; i++) ids[i] = tid(toks[i]);
  run_t r;
  run_textout(g_tok, stop, nstop, include, false, ids, n, k, &r);
  assert_string_equal(kiln_strbuf_cstr(&r.text), want);
  assert_int_equal(r.stop_push, want_push);
  assert_int_equal(r.stop_index, want_index);
  run_free(&r);
}

#define N(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* ---- cases -------------------------------------------------------------------------------- */

static void test_straddle(void **state) {
  (void)state;
  const char *stop[] = {"bc"};
  const char *toks[] = {"ab", "c", "a"};
  check_case(stop, 1, false, 0, toks, N(toks), "a", 2, 0);
  check_case(stop, 1, true, 0, toks, N(toks), "abc", 2, 0);
  /* Across three tokens, one of them a whole word. */
  const char *stop2[] = {"xaby"};
  const char *toks2[] = {"x", "ab", "y", "z"};
  check_case(stop2, 1, false, 0, toks2, N(toks2), "", 3, 0);
  check_case(stop2, 1, true, 0, toks2, N(toks2), "xaby", 3, 0);
}

static void test_at_start(void **state) {
  (void)state;
  const char *stop[] = {"a"};
  const char *toks[] = {"ab", "c"};
  check_case(stop, 1, false, 0, toks, N(toks), "", 1, 0);
  check_case(stop, 1, true, 0, toks, N(toks), "a", 1, 0);
}

/* No stop: everything is emitted; finish flushes; the stop index is -1 throughout. */
static void test_no_match(void **state) {
  (void)state;
  const char *stop[] = {"zz", "q"};
  const char *toks[] = {"hello", " the", "z", "a"};
  check_case(stop, 2, false, 0, toks, N(toks), "hello theza", 0, -1);
  check_case(NULL, 0, false, 0, toks, N(toks), "hello theza", 0, -1);
}

/* min_tokens: a match must end in text from a push with check_stop; it may begin earlier. */
static void test_check_stop(void **state) {
  (void)state;
  const char *stop[] = {"a"};
  const char *toks[] = {"a", "b", "a", "c"};
  check_case(stop, 1, false, 1, toks, N(toks), "ab", 3, 0);
  check_case(stop, 1, false, 4, toks, N(toks), "abac", 0, -1); /* never checked */
  const char *stop2[] = {"bc"};
  const char *toks2[] = {"ab", "c", "d"};
  check_case(stop2, 1, false, 1, toks2, N(toks2), "a", 2, 0);     /* begins before the boundary */
  check_case(stop2, 1, false, 2, toks2, N(toks2), "abcd", 0, -1); /* ends before it */
  /* A stop string that ends at the boundary does not count, a later occurrence does. */
  const char *toks3[] = {"b", "c", "b", "c"};
  check_case(stop2, 1, true, 2, toks3, N(toks3), "bcbc", 4, 0);
}

/* The earliest end wins; at one end, the longest; then the first listed. Empty strings are
 * ignored but keep the caller's indices. */
static void test_priority(void **state) {
  (void)state;
  const char *toks[] = {"abc", "d"};
  const char *s1[] = {"bcd", "c"};
  check_case(s1, 2, false, 0, toks, N(toks), "ab", 1, 1);
  const char *s2[] = {"c", "bc", "abc"};
  check_case(s2, 3, false, 0, toks, N(toks), "", 1, 2);
  const char *s3[] = {"", "bc", "bc"};
  check_case(s3, 3, false, 0, toks, N(toks), "a", 1, 1);
  /* Prefixes of each other: "ab" completes first. */
  const char *s4[] = {"abcd", "ab"};
  const char *toks4[] = {"a", "b", "c", "d"};
  check_case(s4, 2, false, 0, toks4, N(toks4), "", 2, 1);
  check_case(s4, 2, true, 0, toks4, N(toks4), "ab", 2, 1);
}

static void test_multibyte(void **state) {
  (void)state;
  /* A stop string made of a character whose bytes arrive as separate tokens. */
  const char *stop[] = {"\xE2\x82\xAC"};
  const char *toks[] = {"a", "\xE2", "\x82", "\xAC", "b"};
  check_case(stop, 1, false, 0, toks, N(toks), "a", 4, 0);
  const char *toks2[] = {"\xE2\x82", "\xAC", "b"};
  check_case(stop, 1, true, 0, toks2, N(toks2), "\xE2\x82\xAC", 2, 0);
  /* é then é: the stop "éb" must not cut the first é in half. */
  const char *stop2[] = {
      "\xC3\xA9"
      "b"};
  const char *toks3[] = {"\xC3\xA9\xC3\xA9", "a", "\xC3\xA9", "b"};
  check_case(stop2, 1, false, 0, toks3, N(toks3),
             "\xC3\xA9\xC3\xA9"
             "a",
             4, 0);
}

/* Pushes tokens one by one and checks what each push emits. */
static void check_emits(const char *const *stop, int32_t nstop, const char *const *toks,
                        const char *const *want, int n, const char *want_finish) {
  kiln_textout_t *t = NULL;
  assert_null(kiln_textout_create(g_tok, false, stop, nstop, false, &t));
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  for (int i = 0; i < n; i++) {
    int32_t stopped;
    kiln_strbuf_reset(&b);
    assert_null(kiln_textout_push(t, tid(toks[i]), true, &b, &stopped));
    assert_int_equal(stopped, -1);
    if (strcmp(kiln_strbuf_cstr(&b), want[i]) != 0)
      fail_msg("push %d ('%s'): emitted '%s', want '%s'", i, toks[i], kiln_strbuf_cstr(&b),
               want[i]);
  }
  kiln_strbuf_reset(&b);
  assert_null(kiln_textout_finish(t, &b));
  assert_string_equal(kiln_strbuf_cstr(&b), want_finish);
  kiln_strbuf_free(&b);
  kiln_textout_free(t);
}

/* Only a tail that could still begin a stop string is held back. */
static void test_hold_back(void **state) {
  (void)state;
  const char *stop[] = {"xyz"};
  const char *toks[] = {"ab", "x", "y", "a", "x", "x", "y", "b"};
  const char *want[] = {"ab", "", "", "xya", "", "x", "", "xyb"};
  check_emits(stop, 1, toks, want, N(toks), "");
  /* Held text comes out at finish. */
  const char *toks2[] = {"a", "x", "y"};
  const char *want2[] = {"a", "", ""};
  check_emits(stop, 1, toks2, want2, N(toks2), "xy");
  /* A stop string beginning with a continuation byte (not valid UTF-8, matched bytewise):
   * holding its first byte would split é, so the whole é is held. */
  const char *stop3[] = {"\xA9z"};
  const char *toks3[] = {"a", "\xC3\xA9", "q"};
  const char *want3[] = {"a", "", "\xC3\xA9q"};
  check_emits(stop3, 1, toks3, want3, N(toks3), "");
  /* The detokenizer's own hold (half a character) adds to ours, nothing more. */
  const char *toks4[] = {"a", "\xE2\x82", "\xAC"};
  const char *want4[] = {"a", "", "\xE2\x82\xAC"};
  check_emits(NULL, 0, toks4, want4, N(toks4), "");
}

/* A stop string completed by text the detokenizer only releases at finish is still cut. */
static void test_stop_in_flush(void **state) {
  (void)state;
  const char *stop[] = {"a\xEF\xBF\xBD"}; /* "a" then U+FFFD */
  const char *toks[] = {"a", "\xE2\x82"}; /* an incomplete euro sign: U+FFFD at the end */
  check_case(stop, 1, false, 0, toks, N(toks), "", 0, -1);
  check_case(stop, 1, true, 0, toks, N(toks), "a\xEF\xBF\xBD", 0, -1);
  check_case(stop, 1, false, 2, toks, N(toks), "a\xEF\xBF\xBD", 0, -1); /* not checked */
}

static void test_skip_special(void **state) {
  (void)state;
  const char *stop[] = {"b" SPECIAL_TEXT};
  int32_t ids[] = {tid("a"), tid("b"), SPECIAL_ID, tid("c")};
  run_t r;
  run_textout(g_tok, stop, 1, false, false, ids, 4, 0, &r);
  assert_string_equal(kiln_strbuf_cstr(&r.text), "a");
  assert_int_equal(r.stop_push, 3);
  run_free(&r);
  run_textout(g_tok, stop, 1, false, true, ids, 4, 0, &r);
  assert_string_equal(kiln_strbuf_cstr(&r.text), "abc");
  assert_int_equal(r.stop_push, 0);
  run_free(&r);
}

static void test_no_tokenizer(void **state) {
  (void)state;
  const char *stop[] = {"a"};
  kiln_textout_t *t = NULL;
  assert_null(kiln_textout_create(NULL, true, stop, 1, false, &t));
  assert_non_null(t);
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  for (int i = 0; i < 5; i++) {
    int32_t stopped = 7;
    assert_null(kiln_textout_push(t, 'a', true, &b, &stopped));
    assert_int_equal(stopped, -1);
  }
  assert_null(kiln_textout_finish(t, &b));
  assert_int_equal(b.len, 0);
  kiln_textout_free(t);
  kiln_textout_free(NULL);
}

static void test_bad_id(void **state) {
  (void)state;
  kiln_textout_t *t = NULL;
  assert_null(kiln_textout_create(g_tok, false, NULL, 0, false, &t));
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  int32_t stopped = 0;
  /* An id beyond the tokenizer (a model vocabulary padded past it) adds no text. */
  assert_null(kiln_textout_push(t, 1 << 20, true, &b, &stopped));
  assert_int_equal(b.len, 0);
  assert_int_equal(stopped, -1);
  assert_null(kiln_textout_push(t, 'a', true, &b, &stopped)); /* still usable */
  assert_null(kiln_textout_finish(t, &b));
  assert_string_equal(kiln_strbuf_cstr(&b), "a");
  kiln_strbuf_free(&b);
  kiln_textout_free(t);
}

/* ---- the property test ------------------------------------------------------------------ */

static uint64_t g_seed, g_rng;

static uint64_t rnd(void) { /* splitmix64 */
  uint64_t z = (g_rng += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static int rnd_below(int n) { return n > 0 ? (int)(rnd() % (uint64_t)n) : 0; }

/* Characters the random text is made of (some multi-byte). */
static const char *const k_chars[] = {
    "a", "b", "c", " ", "l", "h", "e", "o", "\n", "\xC3\xA9", "\xE2\x82\xAC", "\xF0\x9F\x98\x80"};

/* A random token sequence: single characters (multi-byte ones as one token or byte by byte),
 * the multi-byte tokens, now and then a stray byte (U+FFFD) or the special token. */
static int random_ids(int32_t *ids, int max) {
  int n = rnd_below(max + 1);
  int i = 0;
  while (i < n) {
    int kind = rnd_below(20);
    if (kind < 8) {
      ids[i++] = tid(k_chars[rnd_below(N(k_chars))]);
    } else if (kind < 14) {
      ids[i++] = 256 + rnd_below(NUM_MULTI);
    } else if (kind < 18) {
      const char *c = k_chars[9 + rnd_below(3)];
      for (; *c && i < n; c++) ids[i++] = (unsigned char)*c;
    } else if (kind == 18) {
      ids[i++] = 0x80 + rnd_below(128);
    } else {
      ids[i++] = SPECIAL_ID;
    }
  }
  return n;
}

/* The same for the SentencePiece tokenizer: words, multi-byte characters as runs of byte
 * tokens, stray bytes, <s>. */
static int random_sp_ids(int32_t *ids, int max) {
  int n = rnd_below(max + 1);
  int i = 0;
  while (i < n) {
    int kind = rnd_below(20);
    if (kind < 10) {
      ids[i++] = SP_WORDS + rnd_below(SP_BYTES - SP_WORDS);
    } else if (kind < 16) {
      const char *c = k_chars[rnd_below(N(k_chars))];
      for (; *c && i < n; c++) ids[i++] = SP_BYTES + (unsigned char)*c;
    } else if (kind < 19) {
      ids[i++] = SP_BYTES + rnd_below(256);
    } else {
      ids[i++] = rnd_below(2) ? SP_BOS : SP_UNK;
    }
  }
  return n;
}

/* Start of the character holding byte i of s (valid UTF-8). */
static size_t char_start(const char *s, size_t i) {
  while (i > 0 && ((unsigned char)s[i] & 0xC0) == 0x80) i--;
  return i;
}

/* A random stop string (malloc'ed), valid UTF-8: a piece of the text (maybe its start), some
 * random characters, a prefix or an extension of an earlier stop string, or "". */
static char *random_stop(const char *text, size_t len, char *const *prev, int nprev) {
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  int kind = rnd_below(12);
  if (kind < 6 && len > 0) {
    size_t from = kind == 0 ? 0 : char_start(text, (size_t)rnd_below((int)len));
    size_t to = from + 1 + (size_t)rnd_below(8);
    if (to >= len)
      to = len;
    else
      to = char_start(text, to);
    if (to <= from) to = len;
    kiln_strbuf_append(&b, text + from, to - from);
  } else if (kind < 8 || nprev == 0) {
    int m = 1 + rnd_below(3);
    for (int i = 0; i < m; i++) kiln_strbuf_append_str(&b, k_chars[rnd_below(N(k_chars))]);
  } else if (kind < 10) {
    const char *p = prev[rnd_below(nprev)];
    size_t l = strlen(p);
    size_t cut = l ? char_start(p, (size_t)rnd_below((int)l)) : 0;
    kiln_strbuf_append(&b, p, cut ? cut : l);
  } else if (kind < 11) {
    kiln_strbuf_append_str(&b, prev[rnd_below(nprev)]);
    kiln_strbuf_append_str(&b, k_chars[rnd_below(N(k_chars))]);
  } /* else "": ignored by textout */
  assert_true(kiln_strbuf_ok(&b));
  return kiln_strbuf_detach(&b, NULL);
}

static void property(const char *name, const kiln_tokenizer_t *tok,
                     int (*gen)(int32_t *ids, int max)) {
  uint64_t seed = g_seed;
  g_rng = seed;
  enum { MAX_IDS = 40, MAX_STOP = 5 };
  const char *env = getenv("KILN_TEST_TRIALS");
  int trials = env && atoi(env) > 0 ? atoi(env) : 1000;
  int stops_hit = 0, straddles = 0, in_flush = 0;
  for (int trial = 0; trial < trials; trial++) {
    int32_t ids[MAX_IDS];
    int n = gen(ids, MAX_IDS);
    bool skip = rnd_below(2);
    bool include = rnd_below(2);
    int k = rnd_below(3) == 0 ? 0 : rnd_below(n + 1);

    /* Reference: the full decode, and how much of it a bare detokenizer gives after each push
     * (cum[i] after i pushes); the check_stop boundary is cum[k]. */
    kiln_strbuf_t full = KILN_STRBUF_INIT;
    assert_null(kiln_tokenizer_decode(tok, ids, (size_t)n, skip, &full));
    size_t cum[MAX_IDS + 1];
    kiln_detok_t *d = NULL;
    assert_null(kiln_detok_create(tok, skip, &d));
    kiln_strbuf_t dt = KILN_STRBUF_INIT;
    cum[0] = 0;
    for (int i = 0; i < n; i++) {
      assert_null(kiln_detok_push(d, ids[i], &dt));
      cum[i + 1] = dt.len;
    }
    assert_null(kiln_detok_flush(d, &dt));
    kiln_detok_free(d);
    assert_int_equal(dt.len, full.len);
    assert_memory_equal(dt.data, full.data, full.len);
    kiln_strbuf_free(&dt);

    char *stop[MAX_STOP];
    int nstop = rnd_below(MAX_STOP + 1);
    size_t maxlen = 0;
    for (int i = 0; i < nstop; i++) {
      stop[i] = random_stop(full.data, full.len, stop, i);
      if (strlen(stop[i]) > maxlen) maxlen = strlen(stop[i]);
    }

    /* The first stop string to end after the boundary (earliest end, then longest, then
     * first); none when check_stop is never true. */
    size_t want_len = full.len;
    int want_index = -1, want_push = 0;
    size_t boundary = cum[k];
    for (size_t e = boundary + 1; k < n && e <= full.len && want_index < 0; e++) {
      size_t best = 0;
      for (int i = 0; i < nstop; i++) {
        size_t l = strlen(stop[i]);
        if (l && l <= e && l > best && memcmp(full.data + e - l, stop[i], l) == 0) {
          best = l;
          want_index = i;
        }
      }
      if (want_index >= 0) {
        want_len = include ? e : e - best;
        for (int i = k + 1; i <= n && !want_push; i++)
          if (cum[i] >= e) want_push = i;
        if (!want_push) in_flush++;
        if (e - best < boundary) straddles++;
      }
    }

    run_t r;
    run_textout(tok, (const char *const *)stop, nstop, include, skip, ids, n, k, &r);
    if (r.text.len != want_len || memcmp(r.text.data, full.data, want_len) != 0 ||
        r.stop_push != want_push || (want_push && r.stop_index != want_index)) {
      fprintf(stderr, "seed %llu trial %d: n=%d k=%d include=%d skip=%d\n  text: ",
              (unsigned long long)seed, trial, n, k, include, skip);
      for (size_t i = 0; i < full.len; i++) fprintf(stderr, "%02x", (unsigned char)full.data[i]);
      for (int i = 0; i < nstop; i++) fprintf(stderr, "\n  stop[%d]: '%s'", i, stop[i]);
      fprintf(stderr, "\n  got %zu bytes, stop at push %d index %d; want %zu, push %d index %d\n",
              r.text.len, r.stop_push, r.stop_index, want_len, want_push, want_index);
      fail_msg("mismatch (seed %llu, trial %d)", (unsigned long long)seed, trial);
    }
    if (want_push) stops_hit++;
    /* Hold-back: never more than the longest stop - 1 bytes (+3 to a character boundary) on
     * top of the detokenizer's own; exactly none without stop strings. */
    int pushes = r.stop_push ? r.stop_push - 1 : n;
    for (int i = 0; i < pushes; i++) {
      assert_true(r.after[i] <= cum[i + 1]);
      if (maxlen == 0)
        assert_int_equal(r.after[i], cum[i + 1]);
      else
        assert_true(r.after[i] + (maxlen - 1) + 3 >= cum[i + 1]);
    }
    run_free(&r);
    for (int i = 0; i < nstop; i++) free(stop[i]);
    kiln_strbuf_free(&full);
  }
  printf(
      "test_textout %s: %d trials, %d stopped (%d straddling the check_stop boundary), %d "
      "cut in the final flush\n",
      name, trials, stops_hit, straddles, in_flush);
  assert_true(stops_hit > trials / 10);
}

static void test_property_byte_level(void **state) {
  (void)state;
  property("byte-level", g_tok, random_ids);
}

static void test_property_byte_fallback(void **state) {
  (void)state;
  property("byte-fallback", g_sp, random_sp_ids);
}

int main(void) {
  const char *env = getenv("KILN_TEST_SEED");
  g_seed =
      (env && *env) ? strtoull(env, NULL, 0) : (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
  printf("test_textout: seed %llu (set KILN_TEST_SEED=%llu to reproduce)\n",
         (unsigned long long)g_seed, (unsigned long long)g_seed);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_straddle),
      cmocka_unit_test(test_at_start),
      cmocka_unit_test(test_no_match),
      cmocka_unit_test(test_check_stop),
      cmocka_unit_test(test_priority),
      cmocka_unit_test(test_multibyte),
      cmocka_unit_test(test_hold_back),
      cmocka_unit_test(test_stop_in_flush),
      cmocka_unit_test(test_skip_special),
      cmocka_unit_test(test_no_tokenizer),
      cmocka_unit_test(test_bad_id),
      cmocka_unit_test(test_property_byte_level),
      cmocka_unit_test(test_property_byte_fallback),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
