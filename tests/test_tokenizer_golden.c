/* test_tokenizer_golden.c - the real tokenizers (Qwen3, Llama 3, Llama 2) against goldens
 * made by Hugging Face's own `tokenizers` (tests/data/tokenizer/<name>.jsonl), plus the
 * streaming detokenizer's invariant on goldens and on random id sequences. Part of the
 * test_tokenizer binary. The tokenizer files come from $KILN_TOKENIZER_CACHE
 * (tests/fetch_tokenizers.sh). */
#define _POSIX_C_SOURCE 200809L
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#if __has_include(<valgrind/valgrind.h>)
#include <valgrind/valgrind.h>
#endif

#include "base/json.h"
#include "models/model_tokenizer.h"
#include "models/tokenizer/tokenizer.h"

void tkt_golden_qwen3(void **state);
void tkt_golden_llama3(void **state);
void tkt_golden_llama2(void **state);
void tkt_golden_gemma3(void **state);
void tkt_golden_mistral_nemo(void **state);
void tkt_golden_deepseek_v3(void **state);
void tkt_golden_gpt4o(void **state);
void tkt_gguf_vocabs(void **state);

/* Prints s (at most max bytes) with control characters escaped. */
static void show(const char *label, const char *s, size_t n, size_t max) {
  fprintf(stderr, "    %s \"", label);
  for (size_t i = 0; i < n && i < max; i++) {
    unsigned char c = (unsigned char)s[i];
    if (c == '\n') {
      fputs("\\n", stderr);
    } else if (c == '\r') {
      fputs("\\r", stderr);
    } else if (c == '\t') {
      fputs("\\t", stderr);
    } else if (c < 0x20 || c == 0x7f) {
      fprintf(stderr, "\\x%02x", c);
    } else {
      fputc(c, stderr);
    }
  }
  fprintf(stderr, "%s\"\n", n > max ? "..." : "");
}

static void show_ids(const char *label, const int32_t *ids, size_t n, size_t at) {
  size_t from = at > 4 ? at - 4 : 0, to = at + 5 < n ? at + 5 : n;
  fprintf(stderr, "    %s (len %zu) [%s", label, n, from ? "... " : "");
  for (size_t i = from; i < to; i++) {
    fprintf(stderr, i == at ? "*%d* " : "%d ", (int)ids[i]);
  }
  fprintf(stderr, "%s]\n", to < n ? "..." : "");
}

/* Compares ids with the golden array; prints the first difference. */
static bool check_ids(const char *name, size_t line, const char *what, const char *text,
                      size_t text_len, const kiln_tokens_t *got, const kiln_json_t *want) {
  size_t n = kiln_json_len(want);
  int32_t *w = malloc((n ? n : 1) * sizeof(*w));
  assert_non_null(w);
  for (size_t i = 0; i < n; i++) {
    int64_t x = -1;
    kiln_json_int64(kiln_json_at(want, i), &x);
    w[i] = (int32_t)x;
  }
  size_t i = 0;
  while (i < n && i < got->len && w[i] == got->ids[i]) i++;
  bool ok = i == n && i == got->len;
  if (!ok) {
    fprintf(stderr, "  %s line %zu: %s differ at index %zu\n", name, line, what, i);
    show("text", text, text_len, 200);
    show_ids("want", w, n, i);
    show_ids("got ", got->ids, got->len, i);
  }
  free(w);
  return ok;
}

static bool check_text(const char *name, size_t line, const char *what, const char *text,
                       size_t text_len, const char *got, size_t got_len, const char *want,
                       size_t want_len) {
  if (got_len == want_len && memcmp(got, want, got_len) == 0) return true;
  size_t i = 0;
  while (i < got_len && i < want_len && got[i] == want[i]) i++;
  fprintf(stderr, "  %s line %zu: %s differs at byte %zu\n", name, line, what, i);
  show("text", text, text_len, 200);
  show("want", want, want_len, 300);
  show("got ", got, got_len, 300);
  return false;
}

/* Streams ids through a detokenizer; the pieces must concatenate to want. */
static bool check_stream(const kiln_tokenizer_t *tok, const char *name, size_t line,
                         const char *what, const char *text, size_t text_len, const int32_t *ids,
                         size_t n, bool skip, const char *want, size_t want_len) {
  kiln_detok_t *d = NULL;
  assert_null(kiln_detok_create(tok, skip, &d));
  kiln_strbuf_t acc = KILN_STRBUF_INIT, piece = KILN_STRBUF_INIT;
  bool ok = true;
  for (size_t i = 0; i < n; i++) {
    kiln_strbuf_reset(&piece);
    kiln_status_t st = kiln_detok_push(d, ids[i], &piece);
    if (st) {
      fprintf(stderr, "  %s line %zu: %s: push failed: %s\n", name, line, what,
              kiln_status_message(st));
      kiln_status_free(st);
      ok = false;
      break;
    }
    /* Never half a UTF-8 character: every piece is valid UTF-8 on its own. */
    for (size_t k = 0; k < piece.len;) {
      unsigned char c = (unsigned char)piece.data[k];
      size_t l = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : 4;
      if (k + l > piece.len) {
        fprintf(stderr, "  %s line %zu: %s: piece %zu ends inside a UTF-8 character\n", name, line,
                what, i);
        ok = false;
      }
      k += l;
    }
    kiln_strbuf_append(&acc, piece.data ? piece.data : "", piece.len);
  }
  if (ok) {
    assert_null(kiln_detok_flush(d, &acc));
    ok = check_text(name, line, what, text, text_len, acc.data ? acc.data : "", acc.len, want,
                    want_len);
  }
  kiln_strbuf_free(&acc);
  kiln_strbuf_free(&piece);
  kiln_detok_free(d);
  return ok;
}

static const char *cache_dir(void) {
  const char *c = getenv("KILN_TOKENIZER_CACHE");
  struct stat sb;
  if (!c || !*c || stat(c, &sb) != 0) return NULL;
  return c;
}

static char *read_file(const char *path, size_t *out_len) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  char chunk[65536];
  size_t n;
  while ((n = fread(chunk, 1, sizeof(chunk), f)) > 0) kiln_strbuf_append(&b, chunk, n);
  fclose(f);
  return kiln_strbuf_detach(&b, out_len);
}

/* Random id streams: the detokenizer must agree with decode on any sequence, including
 * byte tokens, partial UTF-8 and special tokens. */
static int random_streams(const kiln_tokenizer_t *tok, const char *name) {
  uint64_t seed = 0x243F6A8885A308D3ull;
  int failures = 0;
  size_t vs = kiln_tokenizer_vocab_size(tok);
  for (int round = 0; round < 300 && failures < 5; round++) {
    int32_t ids[48];
    size_t n = 1 + (size_t)(round % 47);
    for (size_t i = 0; i < n; i++) {
      seed = seed * 6364136223846793005ull + 1442695040888963407ull;
      uint32_t r = (uint32_t)(seed >> 33);
      int32_t id;
      do {
        /* Favour low ids (single bytes and byte tokens) to stress partial characters. */
        id = (int32_t)((r % 4) == 0 ? r % 300 : r % vs);
        r = r * 2654435761u + 1;
      } while (!kiln_tokenizer_id_to_token(tok, id, NULL));
      ids[i] = id;
    }
    for (int skip = 0; skip < 2; skip++) {
      kiln_strbuf_t want = KILN_STRBUF_INIT;
      assert_null(kiln_tokenizer_decode(tok, ids, n, skip, &want));
      char what[64];
      snprintf(what, sizeof(what), "random stream %d (skip=%d)", round, skip);
      if (!check_stream(tok, name, 0, what, "(random ids)", 12, ids, n, skip,
                        want.data ? want.data : "", want.len)) {
        failures++;
      }
      kiln_strbuf_free(&want);
    }
  }
  return failures;
}

static void run_goldens_on(const char *name, kiln_tokenizer_t *tok);

static void run_goldens(const char *name) {
  const char *cache = cache_dir();
  if (!cache) {
    fprintf(stderr,
            "  SKIP %s: set KILN_TOKENIZER_CACHE to a directory filled by "
            "tests/fetch_tokenizers.sh to run the real-tokenizer tests\n",
            name);
    skip();
  }
  char path[4096];
  snprintf(path, sizeof(path), "%s/%s", cache, name);
  kiln_tokenizer_t *tok = NULL;
  kiln_status_t st = kiln_tokenizer_load(path, &tok);
  if (st) {
    fprintf(stderr, "  %s: %s\n", name, kiln_status_message(st));
    kiln_status_free(st);
    fail_msg("%s: cannot load the tokenizer", name);
  }
  run_goldens_on(name, tok);
}

/* The goldens of name (tests/data/tokenizer/name.jsonl, without a ".gguf" suffix name may
 * have) on tok, which this frees. */
static void run_goldens_on(const char *name, kiln_tokenizer_t *tok) {
  kiln_status_t st;
  char path[4096];
  size_t nl = strlen(name);
  if (nl > 5 && !strcmp(name + nl - 5, ".gguf")) nl -= 5;
  int failures = random_streams(tok, name);

  const char *src = getenv("KILN_SOURCE_DIR");
  snprintf(path, sizeof(path), "%s/tests/data/tokenizer/%.*s.jsonl", src ? src : "..", (int)nl,
           name);
  size_t len = 0;
  char *data = read_file(path, &len);
  if (!data) {
    kiln_tokenizer_free(tok);
    fail_msg("%s: goldens %s are missing (tools/dev/gen_tokenizer_goldens.py makes them)", name,
             path);
  }
  size_t lines = 0, passed = 0;
  for (char *p = data, *end; p < data + len; p = end + 1) {
    end = memchr(p, '\n', (size_t)(data + len - p));
    if (!end) end = data + len;
    if (end == p) continue;
    lines++;
    kiln_json_doc_t *doc = NULL;
    st = kiln_json_parse(p, (size_t)(end - p), path, &doc);
    if (st) {
      fprintf(stderr, "  %s line %zu: %s\n", name, lines, kiln_status_message(st));
      kiln_status_free(st);
      failures++;
      continue;
    }
    const kiln_json_t *row = kiln_json_root(doc);
    size_t tl = 0, dl = 0, dsl = 0;
    const char *text = kiln_json_string(kiln_json_get(row, "text"), &tl);
    const char *dec = kiln_json_string(kiln_json_get(row, "decoded"), &dl);
    const char *dec_skip = kiln_json_string(kiln_json_get(row, "decoded_skip"), &dsl);
    const kiln_json_t *want_ids = kiln_json_get(row, "ids");
    const kiln_json_t *want_special = kiln_json_get(row, "ids_special");
    assert_non_null(text);
    assert_non_null(dec);
    assert_non_null(dec_skip);
    bool ok = true;
    kiln_tokens_t ids = KILN_TOKENS_INIT, ids_sp = KILN_TOKENS_INIT;
    st = kiln_tokenizer_encode(tok, text, tl, false, &ids);
    if (!st) st = kiln_tokenizer_encode(tok, text, tl, true, &ids_sp);
    if (st) {
      fprintf(stderr, "  %s line %zu: encode failed: %s\n", name, lines, kiln_status_message(st));
      kiln_status_free(st);
      ok = false;
    } else {
      ok &= check_ids(name, lines, "ids (add_special_tokens=false)", text, tl, &ids, want_ids);
      ok &=
          check_ids(name, lines, "ids (add_special_tokens=true)", text, tl, &ids_sp, want_special);
    }
    /* Decode the golden ids (not ours), so decode is judged on its own. */
    size_t ns = kiln_json_len(want_special);
    int32_t *gold = malloc((ns ? ns : 1) * sizeof(*gold));
    assert_non_null(gold);
    for (size_t i = 0; i < ns; i++) {
      int64_t x = -1;
      kiln_json_int64(kiln_json_at(want_special, i), &x);
      gold[i] = (int32_t)x;
    }
    for (int skip = 0; skip < 2; skip++) {
      const char *want = skip ? dec_skip : dec;
      size_t wl = skip ? dsl : dl;
      kiln_strbuf_t out = KILN_STRBUF_INIT;
      st = kiln_tokenizer_decode(tok, gold, ns, skip, &out);
      if (st) {
        fprintf(stderr, "  %s line %zu: decode failed: %s\n", name, lines, kiln_status_message(st));
        kiln_status_free(st);
        ok = false;
      } else {
        ok &= check_text(name, lines, skip ? "decode (skip_special_tokens)" : "decode", text, tl,
                         out.data ? out.data : "", out.len, want, wl);
      }
      kiln_strbuf_free(&out);
      ok &= check_stream(tok, name, lines, skip ? "stream (skip_special)" : "stream", text, tl,
                         gold, ns, skip, want, wl);
    }
    free(gold);
    kiln_tokens_free(&ids);
    kiln_tokens_free(&ids_sp);
    kiln_json_doc_free(doc);
    if (ok) {
      passed++;
    } else {
      failures++;
    }
  }
  free(data);
  kiln_tokenizer_free(tok);
  fprintf(stderr, "  %s: %zu/%zu goldens pass (encode x2, decode x2, stream x2 each)%s\n", name,
          passed, lines, failures ? "" : "; random streams pass");
  if (failures) fail_msg("%s: %d failures", name, failures);
}

void tkt_golden_qwen3(void **state) {
  (void)state;
  run_goldens("qwen3");
}

void tkt_golden_llama3(void **state) {
  (void)state;
  run_goldens("llama3");
}

void tkt_golden_llama2(void **state) {
  (void)state;
  run_goldens("llama2");
}

void tkt_golden_gemma3(void **state) {
  (void)state;
  run_goldens("gemma3");
}

void tkt_golden_mistral_nemo(void **state) {
  (void)state;
  run_goldens("mistral_nemo");
}

void tkt_golden_deepseek_v3(void **state) {
  (void)state;
  run_goldens("deepseek_v3");
}

void tkt_golden_gpt4o(void **state) {
  (void)state;
  run_goldens("gpt4o");
}

/* The same goldens through the tokenizer a GGUF file carries: tests/make_gguf_vocab.py wrote
 * each real tokenizer's tokenizer.ggml.* metadata as llama.cpp's converter does into
 * $KILN_GGUF_VOCABS/<name>.gguf (a vocabulary-only file), and Kiln rebuilds the tokenizer from
 * it alone (kiln_model_open_tokenizer: no tokenizer.json beside it). The SentencePiece ones
 * (llama2, gemma3) rebuild their merges from the scores. Under valgrind (or KILN_TEST_QUICK)
 * only llama2 and qwen3, one of each kind. */
void tkt_gguf_vocabs(void **state) {
  (void)state;
  const char *dir = getenv("KILN_GGUF_VOCABS");
  if (!dir || !cache_dir()) {
    fprintf(stderr, "  SKIP: KILN_GGUF_VOCABS and KILN_TOKENIZER_CACHE are needed\n");
    skip();
  }
  static const char *const names[] = {"llama2", "qwen3",       "llama3", "mistral_nemo",
                                      "gemma3", "deepseek_v3", "gpt4o"};
  size_t n = sizeof(names) / sizeof(names[0]);
  const char *quick = getenv("KILN_TEST_QUICK");
  if (quick && *quick && strcmp(quick, "0") != 0) n = 2;
#ifdef RUNNING_ON_VALGRIND
  if (RUNNING_ON_VALGRIND) n = 2;
#endif
  for (size_t i = 0; i < n; i++) {
    char path[4096], label[64];
    snprintf(path, sizeof(path), "%s/%s.gguf", dir, names[i]);
    snprintf(label, sizeof(label), "%s.gguf", names[i]);
    kiln_tokenizer_t *tok = NULL;
    kiln_chat_template_t *chat = NULL;
    kiln_status_t ct = NULL;
    kiln_tokenizer_source_t src;
    kiln_status_t st = kiln_model_open_tokenizer(path, &tok, &chat, &ct, &src);
    if (st) fprintf(stderr, "  %s: %s\n", label, kiln_status_message(st));
    assert_null(st);
    assert_non_null(tok);
    assert_int_equal(src, KILN_TOKENIZER_GGUF);
    if (ct) fprintf(stderr, "  %s: chat template: %s\n", label, kiln_status_message(ct));
    assert_null(ct);
    kiln_chat_template_free(chat);
    run_goldens_on(label, tok);
  }
}
