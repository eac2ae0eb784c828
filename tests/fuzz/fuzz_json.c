/* fuzz_json.c - libFuzzer target for the JSON reader and writers: parse, and if that works,
 * check every lookup, write in all four modes, re-parse, and write again.
 *
 *   clang -std=c11 -g -O1 -fsanitize=fuzzer,address,undefined -I. tests/fuzz/fuzz_json.c \
 *     base/json.c base/strbuf.c base/status.c -lm -o /tmp/fuzz_json && /tmp/fuzz_json
 * -max_total_time=60
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/json.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      abort();                                                                 \
    }                                                                          \
  } while (0)

/* Every key of every object finds a member with that key, at its own index or later (the
 * last duplicate wins), and accessors agree with the type. Recursion is bounded by the
 * parser's depth limit. */
static void check_tree(const kiln_json_t *v) {
  kiln_json_type_t t = kiln_json_type(v);
  CHECK(t >= KILN_JSON_NULL && t <= KILN_JSON_OBJECT);
  if (t == KILN_JSON_STRING) {
    size_t n = 0;
    const char *s = kiln_json_string(v, &n);
    CHECK(s && s[n] == '\0');
  } else if (t == KILN_JSON_ARRAY) {
    size_t n = kiln_json_len(v);
    for (size_t i = 0; i < n; i++) check_tree(kiln_json_at(v, i));
    CHECK(kiln_json_at(v, n) == NULL);
  } else if (t == KILN_JSON_OBJECT) {
    size_t n = kiln_json_len(v);
    for (size_t i = 0; i < n; i++) {
      size_t klen = 0;
      const char *k = kiln_json_key_at(v, i, &klen);
      CHECK(k && k[klen] == '\0');
      const kiln_json_t *found = kiln_json_getn(v, k, klen);
      CHECK(found != NULL);
      if (n <= 64) {
        size_t j = 0;
        while (j < n && kiln_json_value_at(v, j) != found) j++;
        CHECK(j < n && j >= i);
        size_t jlen = 0;
        const char *jk = kiln_json_key_at(v, j, &jlen);
        CHECK(jlen == klen && memcmp(jk, k, klen) == 0);
        for (size_t m = j + 1; m < n; m++) { /* nothing later has the same key */
          size_t mlen = 0;
          const char *mk = kiln_json_key_at(v, m, &mlen);
          CHECK(!(mlen == klen && memcmp(mk, k, klen) == 0));
        }
      }
      check_tree(kiln_json_value_at(v, i));
    }
  } else if (t == KILN_JSON_NUMBER) {
    int64_t i64;
    if (kiln_json_int64(v, &i64) && !kiln_json_number_is_int(v))
      CHECK((double)i64 == kiln_json_number(v));
  }
}

/* Properties: parsing never crashes or leaks; a parsed document writes (in every mode) as text
 * that parses again and writes back to the same bytes. */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  kiln_json_doc_t *doc = NULL;
  kiln_status_t st = kiln_json_parse((const char *)data, size, "fuzz", &doc);
  if (st) {
    CHECK(doc == NULL);
    CHECK(strncmp(kiln_status_message(st), "fuzz: ", 6) == 0 ||
          kiln_status_code(st) == KILN_ERR_OUT_OF_MEMORY);
    kiln_status_free(st);
    return 0;
  }
  check_tree(kiln_json_root(doc));
  for (int mode = 0; mode < 4; mode++) {
    bool ascii = mode & 1, pretty = mode & 2;
    kiln_strbuf_t a = KILN_STRBUF_INIT, b = KILN_STRBUF_INIT;
    CHECK(kiln_json_write(&a, kiln_json_root(doc), ascii, pretty));
    kiln_json_doc_t *again = NULL;
    st = kiln_json_parse(a.data, a.len, "rewritten", &again);
    if (st) fprintf(stderr, "%s\n%s\n", kiln_status_message(st), a.data);
    CHECK(st == NULL);
    CHECK(kiln_json_write(&b, kiln_json_root(again), ascii, pretty));
    CHECK(a.len == b.len && memcmp(a.data, b.data, a.len) == 0);
    if (ascii)
      for (size_t i = 0; i < a.len; i++) CHECK((unsigned char)a.data[i] < 0x80);
    kiln_json_doc_free(again);
    kiln_strbuf_free(&a);
    kiln_strbuf_free(&b);
  }
  kiln_json_doc_free(doc);
  return 0;
}
