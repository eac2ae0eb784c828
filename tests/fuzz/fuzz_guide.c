/* fuzz_guide.c - libFuzzer target for constrained decoding: the input's first byte picks the
 * kind (JSON Schema, regex, choice list, GBNF grammar), the bytes up to the first NUL are the
 * spec and the rest a text. A spec that compiles is run over the text byte by byte, and its
 * masks over a small vocabulary (every byte, some words and JSON punctuation) are checked
 * against each token's own acceptance for a few steps.
 *
 *   build with -DKILN_FUZZ=ON (clang), then tests/fuzz/run_fuzzers.sh BUILD 60 guide */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/guide/guide.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      abort();                                                                 \
    }                                                                          \
  } while (0)

static kiln_guide_vocab_t *g_vocab;

static void make_vocab(void) {
  static const char *const words[] = {"\"}", "\",", "\":", "{\"", "}]", "true", "null", "12",
                                      " a", "ab", "é", "\xc3", "\xa9", "\\n", "[", "::=", "x"};
  enum { NW = sizeof(words) / sizeof(words[0]) };
  static char bytes[256];
  const char *tok[256 + NW];
  size_t len[256 + NW];
  for (int i = 0; i < 256; i++) {
    bytes[i] = (char)i;
    tok[i] = &bytes[i];
    len[i] = 1;
  }
  for (int i = 0; i < NW; i++) {
    tok[256 + i] = words[i];
    len[256 + i] = strlen(words[i]);
  }
  CHECK(!kiln_guide_vocab_create_bytes(256 + NW, tok, len, NULL, &g_vocab));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!g_vocab) make_vocab();
  if (size < 1 || size > 4096) return 0;
  static const kiln_guide_kind_t kinds[] = {KILN_GUIDE_JSON_SCHEMA, KILN_GUIDE_REGEX,
                                            KILN_GUIDE_CHOICE, KILN_GUIDE_GRAMMAR,
                                            KILN_GUIDE_JSON_OBJECT};
  kiln_guide_kind_t kind = kinds[data[0] % 5];
  const uint8_t *spec = data + 1, *nul = memchr(spec, 0, size - 1);
  size_t sl = nul ? (size_t)(nul - spec) : size - 1;
  const uint8_t *text = nul ? nul + 1 : data + size;
  size_t tl = (size_t)(data + size - text);
  char *s = malloc(sl + 1);
  CHECK(s);
  memcpy(s, spec, sl);
  s[sl] = 0;
  kiln_guide_t *g = NULL;
  /* a fresh compile each time (the vocabulary's cache would answer repeats) */
  kiln_status_t st = kiln_guide_compile(NULL, kind, s, sl, &g);
  if (st) {
    CHECK(kiln_status_code(st) == KILN_ERR_INVALID_ARGUMENT ||
          kiln_status_code(st) == KILN_ERR_OUT_OF_MEMORY);
    kiln_status_free(st);
    free(s);
    return 0;
  }
  kiln_guide_matcher_t *m = NULL;
  CHECK(!kiln_guide_matcher_create(g, &m));
  for (size_t i = 0; i < tl && kiln_guide_matcher_accept_bytes(m, text + i, 1); i++) {
  }
  kiln_guide_matcher_free(m);
  kiln_guide_release(g);
  /* masks over the small vocabulary against each token's acceptance */
  if (!kiln_guide_compile(g_vocab, kind, s, sl, &g)) {
    const int32_t V = kiln_guide_vocab_size(g_vocab);
    uint32_t mask[(256 + 32 + 31) / 32 + 1];
    CHECK(!kiln_guide_matcher_create(g, &m));
    for (int step = 0; step < 4; step++) {
      CHECK(!kiln_guide_matcher_fill_mask(m, mask));
      int32_t pick = -1;
      for (int32_t t = 0; t < V; t++) {
        kiln_guide_matcher_t *c = NULL;
        CHECK(!kiln_guide_matcher_clone(m, &c));
        bool ok = kiln_guide_matcher_accept_token(c, t);
        kiln_guide_matcher_free(c);
        CHECK(ok == (((mask[t >> 5] >> (t & 31)) & 1) != 0));
        if (ok && (pick < 0 || (size_t)t == (tl ? text[step % tl] : 0))) pick = t;
      }
      if (pick < 0) break;
      CHECK(kiln_guide_matcher_accept_token(m, pick));
    }
    kiln_guide_matcher_free(m);
    kiln_guide_release(g);
  }
  free(s);
  return 0;
}
