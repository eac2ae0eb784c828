/* fuzz_tokenizer.c - libFuzzer target for models/tokenizer. The first byte picks a mode:
 *   even: the rest is a tokenizer.json; when it loads, encode/decode/stream a few strings;
 *   odd:  the rest is text (any bytes) for a fixed tokenizer that uses most components:
 *         encode, decode the ids, stream them (concatenation must equal the decode), then
 *         read the bytes as ids and check decode == stream again.
 *
 *   clang -std=c11 -g -O1 -fsanitize=fuzzer,address,undefined -I. tests/fuzz/fuzz_tokenizer.c \
 *     models/tokenizer/\*.c base/json.c base/strbuf.c base/status.c -lpcre2-8 -lutf8proc \
 *     -lpthread -lm -o /tmp/fuzz_tokenizer && /tmp/fuzz_tokenizer -max_total_time=60
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/tokenizer/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      abort();                                                                 \
    }                                                                          \
  } while (0)

static const char fixed_json[] =
    "{\"added_tokens\":["
    "{\"id\":40,\"content\":\"<s>\",\"special\":true,\"normalized\":false},"
    "{\"id\":41,\"content\":\"<m>\",\"lstrip\":true,\"rstrip\":true,\"special\":true,"
    "\"normalized\":false},"
    "{\"id\":42,\"content\":\"ab\",\"single_word\":true,\"normalized\":false},"
    "{\"id\":43,\"content\":\"CD\",\"normalized\":true}],"
    "\"normalizer\":{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"NFKC\"},{\"type\":"
    "\"Lowercase\"},"
    "{\"type\":\"Replace\",\"pattern\":{\"Regex\":\"\\\\s{3,}\"},\"content\":\"  \"}]},"
    "\"pre_tokenizer\":{\"type\":\"Sequence\",\"pretokenizers\":["
    "{\"type\":\"Split\",\"pattern\":{\"Regex\":\"\\\\p{N}| ?\\\\p{L}+|\\\\s+(?!\\\\S)|\\\\s+| "
    "?[^\\\\s\\\\p{L}\\\\p{N}]+\"},"
    "\"behavior\":\"Isolated\",\"invert\":false},{\"type\":\"Digits\",\"individual_digits\":true},"
    "{\"type\":\"Metaspace\",\"replacement\":\"\\u2581\",\"prepend_scheme\":\"first\",\"split\":"
    "true}]},"
    "\"post_processor\":{\"type\":\"TemplateProcessing\",\"single\":[{\"SpecialToken\":{\"id\":\"<"
    "s>\",\"type_id\":0}},"
    "{\"Sequence\":{\"id\":\"A\",\"type_id\":0}}],\"pair\":[],\"special_tokens\":{\"<s>\":{\"id\":"
    "\"<s>\",\"ids\":[40],\"tokens\":[\"<s>\"]}}},"
    "\"decoder\":{\"type\":\"Sequence\",\"decoders\":[{\"type\":\"Replace\",\"pattern\":{"
    "\"String\":\"\\u2581\"},\"content\":\" \"},"
    "{\"type\":\"ByteFallback\"},{\"type\":\"Fuse\"},{\"type\":\"Strip\",\"content\":\" "
    "\",\"start\":1,\"stop\":0}]},"
    "\"model\":{\"type\":\"BPE\",\"unk_token\":\"<unk>\",\"fuse_unk\":true,\"byte_fallback\":true,"
    "\"vocab\":{\"<unk>\":0,\"\\u2581\":1,\"a\":2,\"b\":3,\"c\":4,\"d\":5,\"1\":6,\"2\":7,"
    "\"\\u2581a\":8,"
    "\"ab\":9,\"\\u2581ab\":10,\" \":11,\"<0x00>\":12,\"<0x41>\":13,\"<0xC3>\":14,\"<0xA9>\":15,"
    "\"<0xE4>\":16,\"<0xBD>\":17,\"<0xA0>\":18,\"<0xF0>\":19,\"<0x9F>\":20,\"<0x98>\":21,\"<0x80>"
    "\":22,"
    "\"!\":23,\"\\u2581!\":24,\"<s>\":40},"
    "\"merges\":[\"\\u2581 a\",\"a b\",\"\\u2581a b\",\"\\u2581 !\"]}}";

static kiln_tokenizer_t *fixed_tok;

static void stream_check(const kiln_tokenizer_t *tok, const int32_t *ids, size_t n, bool skip) {
  kiln_strbuf_t want = KILN_STRBUF_INIT, got = KILN_STRBUF_INIT;
  kiln_status_t st = kiln_tokenizer_decode(tok, ids, n, skip, &want);
  kiln_detok_t *d = NULL;
  CHECK(kiln_detok_create(tok, skip, &d) == NULL);
  for (size_t i = 0; i < n; i++) {
    kiln_status_t ps = kiln_detok_push(d, ids[i], &got);
    CHECK((ps == NULL) == (kiln_tokenizer_id_to_token(tok, ids[i], NULL) != NULL));
    kiln_status_free(ps);
  }
  CHECK(kiln_detok_flush(d, &got) == NULL);
  if (!st) CHECK(want.len == got.len && (!want.len || memcmp(want.data, got.data, want.len) == 0));
  kiln_status_free(st);
  kiln_detok_free(d);
  kiln_strbuf_free(&want);
  kiln_strbuf_free(&got);
}

static void exercise(const kiln_tokenizer_t *tok, const char *text, size_t n) {
  for (int special = 0; special < 2; special++) {
    kiln_tokens_t ids = KILN_TOKENS_INIT;
    kiln_status_t st = kiln_tokenizer_encode(tok, text, n, special, &ids);
    if (st) {
      CHECK(ids.len == 0);
      kiln_status_free(st);
      continue;
    }
    for (size_t i = 0; i < ids.len; i++) {
      CHECK(ids.ids[i] >= 0 && (size_t)ids.ids[i] < kiln_tokenizer_vocab_size(tok));
    }
    stream_check(tok, ids.ids, ids.len, false);
    stream_check(tok, ids.ids, ids.len, true);
    kiln_tokens_free(&ids);
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size == 0) return 0;
  const char *rest = (const char *)data + 1;
  size_t n = size - 1;
  if (!(data[0] & 1)) {
    kiln_tokenizer_t *tok = NULL;
    kiln_status_t st = kiln_tokenizer_load_json(rest, n, "fuzz.json", &tok);
    CHECK((st == NULL) == (tok != NULL));
    kiln_status_free(st);
    if (tok) {
      static const char *const texts[] = {"", "a", "Hello world 123!", "<s> x  y\n\n z",
                                          "\xc3\xa9\xe4\xbd\xa0\xf0\x9f\x98\x80"};
      for (size_t i = 0; i < sizeof(texts) / sizeof(texts[0]); i++) {
        exercise(tok, texts[i], strlen(texts[i]));
      }
      kiln_tokenizer_free(tok);
    }
    return 0;
  }
  if (!fixed_tok) {
    kiln_status_t st =
        kiln_tokenizer_load_json(fixed_json, sizeof(fixed_json) - 1, "fixed", &fixed_tok);
    if (st) {
      fprintf(stderr, "fixed tokenizer: %s\n", kiln_status_message(st));
      abort();
    }
  }
  exercise(fixed_tok, rest, n);
  int32_t ids[64];
  size_t k = 0;
  for (size_t i = 0; i < n && k < 64; i++) ids[k++] = (int32_t)(data[1 + i] % 48);
  stream_check(fixed_tok, ids, k, false);
  stream_check(fixed_tok, ids, k, true);
  return 0;
}
