/* fuzz_tool_parse.c - libFuzzer target for the tool-call parsers (models/template/tool_parse):
 * the first byte picks the format (% 4: hermes, llama3_json, mistral, json) and seeds the
 * places the reply is cut into pieces; the rest is a model's reply. Beyond "no crash": the stream
 * fed in those pieces, and byte by byte, gives exactly the whole-text parse; the content is a
 * subsequence of the reply (text is only ever dropped, whitespace next to calls and the calls
 * themselves, never made up); a reply without calls is its own content; every call has a name and
 * arguments that parse as a JSON object.
 *
 *   cmake -B build-fuzz -DCMAKE_C_COMPILER=clang -DKILN_FUZZ=ON -DKILN_BACKEND_CUDA=OFF &&
 *   cmake --build build-fuzz --target fuzz_tool_parse && build-fuzz/tests/fuzz_tool_parse
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/json.h"
#include "models/template/tool_parse.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      abort();                                                                 \
    }                                                                          \
  } while (0)

typedef struct out {
  kiln_strbuf_t content;
  kiln_tool_calls_t calls;
} out_t;

static void out_free(out_t *o) {
  kiln_strbuf_free(&o->content);
  kiln_tool_calls_free(&o->calls);
}

/* Feeds text in pieces: a cut after byte i where the seed's bit (i % 8) is set (every byte: 0xff).
 */
static void stream(kiln_tool_format_t f, const char *text, size_t len, unsigned seed, out_t *o) {
  kiln_tool_stream_t *s = NULL;
  CHECK(kiln_tool_stream_create(f, &s) == NULL);
  size_t at = 0;
  for (size_t i = 0; i < len; i++)
    if (seed & (1u << (i % 8)) || i + 1 == len) {
      CHECK(kiln_tool_stream_push(s, text + at, i + 1 - at, &o->content, &o->calls) == NULL);
      at = i + 1;
    }
  CHECK(kiln_tool_stream_finish(s, &o->content, &o->calls) == NULL);
  CHECK(kiln_tool_stream_num_calls(s) == o->calls.n);
  kiln_tool_stream_free(s);
}

static void same(const out_t *a, const out_t *b) {
  CHECK(a->content.len == b->content.len);
  CHECK(!a->content.len || !memcmp(a->content.data, b->content.data, a->content.len));
  CHECK(a->calls.n == b->calls.n);
  for (int32_t i = 0; i < a->calls.n; i++) {
    CHECK(!strcmp(a->calls.v[i].name, b->calls.v[i].name));
    CHECK(!strcmp(a->calls.v[i].arguments, b->calls.v[i].arguments));
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  static const kiln_tool_format_t formats[] = {KILN_TOOL_FORMAT_HERMES,
                                               KILN_TOOL_FORMAT_LLAMA3_JSON,
                                               KILN_TOOL_FORMAT_MISTRAL, KILN_TOOL_FORMAT_JSON};
  kiln_tool_format_t f = formats[data[0] % 4];
  unsigned seed = data[0];
  const char *text = (const char *)data + 1;
  size_t len = size - 1;
  out_t whole = {KILN_STRBUF_INIT, {0}};
  CHECK(kiln_tool_parse(f, text, len, &whole.content, &whole.calls) == NULL);
  /* content is a subsequence of the reply; without calls it is the reply */
  size_t j = 0;
  for (size_t i = 0; i < len && j < whole.content.len; i++)
    if (text[i] == whole.content.data[j]) j++;
  CHECK(j == whole.content.len);
  if (!whole.calls.n) CHECK(whole.content.len == len);
  for (int32_t i = 0; i < whole.calls.n; i++) {
    CHECK(whole.calls.v[i].name[0] != 0);
    kiln_json_doc_t *doc = NULL;
    const char *a = whole.calls.v[i].arguments;
    CHECK(kiln_json_parse(a, strlen(a), "arguments", &doc) == NULL);
    CHECK(kiln_json_is(kiln_json_root(doc), KILN_JSON_OBJECT));
    kiln_json_doc_free(doc);
  }
  out_t pieces = {KILN_STRBUF_INIT, {0}}, bytes = {KILN_STRBUF_INIT, {0}};
  stream(f, text, len, seed | 1u, &pieces);
  same(&whole, &pieces);
  stream(f, text, len, 0xffu, &bytes);
  same(&whole, &bytes);
  out_free(&whole);
  out_free(&pieces);
  out_free(&bytes);
  return 0;
}
