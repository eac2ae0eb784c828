/* fuzz_api.c - libFuzzer target for the HTTP API's request parser and response writers: the
 * first byte picks the route, the rest is the body. A parsed request is turned into a response
 * (whole, and as stream chunks) holding its own prompt text and stop strings, and every body the
 * writers produce must parse back as JSON; a refused one must have a 4xx/5xx status and an
 * error body that parses.
 *
 *   cmake -B build-fuzz -DCMAKE_C_COMPILER=clang -DKILN_FUZZ=ON -DKILN_BACKEND_CUDA=OFF &&
 *   cmake --build build-fuzz --target fuzz_api && build-fuzz/tests/fuzz_api -max_total_time=60
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/json.h"
#include "server/api.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      abort();                                                                 \
    }                                                                          \
  } while (0)

/* Every "data: " event in text (or the whole text when it is no stream) parses as JSON. */
static void check_json(const char *text, size_t len, bool stream) {
  if (!stream) {
    kiln_json_doc_t *doc = NULL;
    kiln_status_t st = kiln_json_parse(text, len, "out", &doc);
    if (st) fprintf(stderr, "bad output: %s\n%.*s\n", kiln_status_message(st), (int)len, text);
    CHECK(st == NULL);
    kiln_json_doc_free(doc);
    return;
  }
  const char *p = text, *end = text + len;
  while (p < end) {
    CHECK(end - p > 6 && !memcmp(p, "data: ", 6));
    p += 6;
    const char *e = strstr(p, "\n\n");
    CHECK(e != NULL);
    check_json(p, (size_t)(e - p), false);
    p = e + 2;
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  kiln_api_kind_t kind = (kiln_api_kind_t)(data[0] % 4);
  kiln_api_limits_t lim;
  kiln_api_limits_default(&lim);
  lim.vocab_size = 5000;
  lim.max_n = 8;
  kiln_api_request_t *req = NULL;
  kiln_api_error_t err;
  kiln_strbuf_t out = KILN_STRBUF_INIT;
  if (!kiln_api_parse(kind, (const char *)data + 1, size - 1, &lim, &req, &err)) {
    CHECK(req == NULL);
    CHECK(err.status >= 400 && err.status < 600);
    CHECK(err.message[0] != 0);
    kiln_api_write_error(&out, &err);
    CHECK(kiln_strbuf_ok(&out));
    check_json(out.data, out.len, false);
    kiln_strbuf_free(&out);
    return 0;
  }
  CHECK(req != NULL);
  CHECK(req->sp.n >= 1 && req->sp.n <= lim.max_n);
  CHECK(req->sp.logprobs >= -1 && req->sp.logprobs <= 20);
  CHECK(req->sp.num_stop >= 0 && req->sp.num_stop <= lim.max_stop);
  for (int32_t i = 0; i < req->num_prompts; i++) {
    const kiln_api_prompt_t *p = &req->prompts[i];
    CHECK((p->text != NULL) != (p->ids != NULL));
    for (int32_t k = 0; k < p->num_ids; k++) CHECK(p->ids[k] >= 0 && p->ids[k] < lim.vocab_size);
  }
  if (kind == KILN_API_COMPLETIONS || kind == KILN_API_CHAT) {
    /* a response whose text is the request's own strings: any bytes must come out as JSON */
    kiln_api_choice_t c;
    memset(&c, 0, sizeof(c));
    c.stop_token = -1;
    if (req->num_prompts && req->prompts[0].text)
      kiln_strbuf_append(&c.text, req->prompts[0].text, req->prompts[0].text_len);
    if (req->messages_json) kiln_strbuf_append(&c.text, req->messages_json, req->messages_len);
    if (req->sp.logprobs >= 0) {
      kiln_api_token_t t;
      memset(&t, 0, sizeof(t));
      t.id = 1;
      t.logprob = req->echo ? NAN : -INFINITY;
      t.text = strdup(req->num_stop ? req->stop[0] : "x");
      t.num_top = 1;
      t.top_ids = malloc(sizeof(int32_t));
      t.top_logprobs = malloc(sizeof(float));
      t.top_text = calloc(1, sizeof(char *));
      if (t.text && t.top_ids && t.top_logprobs && t.top_text) {
        t.top_ids[0] = 2;
        t.top_logprobs[0] = -0.5f;
        t.top_text[0] = strdup("\xff\xfe");
        kiln_api_choice_push_token(&c, &t);
      } else {
        kiln_api_token_free(&t);
      }
    }
    if (req->num_stop) c.stop_str = strdup(req->stop[0]);
    c.finish = KILN_FINISH_STOP;
    kiln_api_response_t r = {req, "cmpl-x", "m\"odel", 1, {3, 4, 1}};
    kiln_api_write_response(&out, &r, &c, 1);
    CHECK(kiln_strbuf_ok(&out));
    check_json(out.data, out.len, false);
    kiln_strbuf_reset(&out);
    kiln_api_write_chunk(&out, &r, &c, true);
    kiln_api_write_chunk(&out, &r, &c, false);
    kiln_api_write_usage_chunk(&out, &r);
    CHECK(kiln_strbuf_ok(&out));
    check_json(out.data, out.len, true);
    kiln_api_choice_free(&c);
  }
  kiln_strbuf_free(&out);
  kiln_api_request_free(req);
  return 0;
}
