/* fuzz_api.c - libFuzzer target for the HTTP API's request parser and response writers: the
 * first byte picks the route, the rest is the body. A parsed request is turned into a response
 * (whole, and as stream chunks) holding its own prompt text and stop strings, and every body the
 * writers produce must parse back as JSON; a refused one must have a 4xx/5xx status and an
 * error body that parses. A chat request with tools is also readied for a Hermes-style template
 * and answered with its own messages as the model's reply, parsed for tool calls: the response
 * and every stream chunk (each tool-call delta in its own) must parse, and the arguments of every
 * call parse as a JSON object (or, for a named function, are the reply itself).
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
#include "server/tools.h"

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

/* Tool calling: the request readied for a template in the hermes format, its messages' text as
 * the reply (in pieces), the response and the stream written. */
static void check_tools(kiln_api_request_t *req) {
  static const char tpl[] =
      "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}<tool_call>{% endif %}";
  kiln_api_error_t err;
  if (!kiln_api_tools_prepare(req, tpl, sizeof(tpl) - 1, true, "auto", &err)) {
    CHECK(err.status >= 400 && err.message[0]);
    return;
  }
  kiln_api_choice_t c;
  memset(&c, 0, sizeof(c));
  c.stop_token = -1;
  CHECK(kiln_api_tool_state_init(&c, req));
  if (!c.tool) return;
  kiln_api_response_t r = {req, "chatcmpl-x", "m", 1, {3, 4, 1}};
  kiln_strbuf_t out = KILN_STRBUF_INIT;
  kiln_api_write_chunk(&out, &r, &c, false);
  const char *reply = req->messages_json;
  size_t len = req->messages_len;
  for (size_t at = 0; at < len;) {
    size_t n = 1 + (size_t)(unsigned char)reply[at] % 7;
    if (n > len - at) n = len - at;
    CHECK(kiln_api_tool_push(&c, reply + at, n, at + n == len));
    at += n;
    do {
      kiln_api_write_chunk(&out, &r, &c, false);
    } while (kiln_api_tool_delta_pending(&c));
  }
  if (!len) CHECK(kiln_api_tool_push(&c, "", 0, true));
  c.finish = KILN_FINISH_STOP;
  kiln_api_write_chunk(&out, &r, &c, false);
  CHECK(kiln_strbuf_ok(&out));
  check_json(out.data, out.len, true);
  kiln_strbuf_reset(&out);
  kiln_api_write_response(&out, &r, &c, 1);
  CHECK(kiln_strbuf_ok(&out));
  check_json(out.data, out.len, false);
  kiln_json_doc_t *doc = NULL;
  CHECK(kiln_json_parse(out.data, out.len, "out", &doc) == NULL);
  const kiln_json_t *calls = kiln_json_get(
      kiln_json_get(kiln_json_at(kiln_json_get(kiln_json_root(doc), "choices"), 0), "message"),
      "tool_calls");
  CHECK(kiln_json_len(calls) == (size_t)kiln_api_tool_num_calls(&c));
  for (size_t i = 0; i < kiln_json_len(calls) && req->tool_choice != KILN_API_TOOL_NAMED; i++) {
    size_t al = 0;
    const char *a = kiln_json_string(
        kiln_json_get(kiln_json_get(kiln_json_at(calls, i), "function"), "arguments"), &al);
    kiln_json_doc_t *ad = NULL;
    CHECK(a && kiln_json_parse(a, al, "arguments", &ad) == NULL);
    CHECK(kiln_json_is(kiln_json_root(ad), KILN_JSON_OBJECT));
    kiln_json_doc_free(ad);
  }
  kiln_json_doc_free(doc);
  kiln_strbuf_free(&out);
  kiln_api_choice_free(&c);
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
  if (kind == KILN_API_CHAT) check_tools(req);
  kiln_strbuf_free(&out);
  kiln_api_request_free(req);
  return 0;
}
