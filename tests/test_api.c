/* test_api.c - the HTTP API's request parser and response writers (server/api.c), without a
 * server: every field's type and range errors name the field, the prompt and message forms,
 * defaults per route, and the writers' bodies parse back with the values put in. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "base/base64.h"
#include "base/json.h"
#include "models/template/tool_parse.h"
#include "core/guide/guide.h"
#include "server/api.h"
#include "server/tools.h"

static kiln_api_limits_t limits(void) {
  kiln_api_limits_t l;
  kiln_api_limits_default(&l);
  l.vocab_size = 1000;
  l.max_n = 4;
  return l;
}

static kiln_api_request_t *parse_ok(kiln_api_kind_t kind, const char *body) {
  kiln_api_limits_t l = limits();
  kiln_api_request_t *r = NULL;
  kiln_api_error_t err;
  if (!kiln_api_parse(kind, body, strlen(body), &l, &r, &err))
    fail_msg("refused %s: %d %s (param %s)", body, err.status, err.message, err.param);
  assert_non_null(r);
  return r;
}

/* The body is refused with status, naming param (NULL: none) and containing each fragment. */
static void parse_bad(kiln_api_kind_t kind, const char *body, int status, const char *param,
                      const char *fragment) {
  kiln_api_limits_t l = limits();
  kiln_api_request_t *r = NULL;
  kiln_api_error_t err;
  if (kiln_api_parse(kind, body, strlen(body), &l, &r, &err)) fail_msg("accepted %s", body);
  assert_null(r);
  if (err.status != status)
    fail_msg("%s: status %d, want %d (%s)", body, err.status, status, err.message);
  if (param && strcmp(err.param, param) != 0)
    fail_msg("%s: param '%s', want '%s' (%s)", body, err.param, param, err.message);
  if (!param && err.param[0]) fail_msg("%s: param '%s', want none", body, err.param);
  if (fragment && !strstr(err.message, fragment))
    fail_msg("%s: message '%s' lacks '%s'", body, err.message, fragment);
}

static void test_completion_defaults(void **state) {
  (void)state;
  kiln_api_request_t *r = parse_ok(KILN_API_COMPLETIONS, "{\"prompt\": \"hello\"}");
  assert_int_equal(r->num_prompts, 1);
  assert_string_equal(r->prompts[0].text, "hello");
  assert_int_equal(r->sp.max_tokens, 16); /* OpenAI's completions default */
  assert_false(r->max_tokens_given);
  assert_true(r->sp.temperature == 1.0f);
  assert_int_equal(r->sp.n, 1);
  assert_int_equal(r->logprobs, -1);
  assert_false(r->stream);
  assert_true(r->add_special_tokens);
  assert_null(r->model);
  kiln_api_request_free(r);

  r = parse_ok(KILN_API_CHAT, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}");
  assert_int_equal(r->sp.max_tokens, -1); /* chat: the rest of the context */
  assert_true(r->add_generation_prompt);
  assert_false(r->add_special_tokens); /* the template writes BOS itself */
  kiln_api_request_free(r);
}

static void test_every_field(void **state) {
  (void)state;
  kiln_api_request_t *r = parse_ok(
      KILN_API_COMPLETIONS,
      "{\"model\": \"m\", \"prompt\": [[1, 2, 3], [4]], \"max_tokens\": 7, \"temperature\": 0.5,"
      " \"top_p\": 0.9, \"top_k\": 5, \"min_p\": 0.1, \"n\": 2, \"best_of\": 2,"
      " \"stop\": [\"x\", \"yz\"], \"seed\": -3, \"presence_penalty\": 0.5,"
      " \"frequency_penalty\": -0.5, \"repetition_penalty\": 1.2, \"logit_bias\": {\"7\": -100,"
      " \"9\": 2.5}, \"logprobs\": 3, \"echo\": true, \"ignore_eos\": true, \"user\": \"u\","
      " \"stream\": true, \"stream_options\": {\"include_usage\": true}, \"min_tokens\": 2,"
      " \"stop_token_ids\": [5, 6], \"skip_special_tokens\": false, \"unknown_field\": {\"a\": "
      "1}}");
  assert_string_equal(r->model, "m");
  assert_int_equal(r->num_prompts, 2);
  assert_int_equal(r->prompts[0].num_ids, 3);
  assert_int_equal(r->prompts[0].ids[2], 3);
  assert_int_equal(r->prompts[1].ids[0], 4);
  assert_int_equal(r->sp.max_tokens, 7);
  assert_true(r->max_tokens_given);
  assert_true(r->sp.temperature == 0.5f && r->sp.top_p == 0.9f && r->sp.top_k == 5);
  assert_true(r->sp.min_p == 0.1f && r->sp.n == 2);
  assert_int_equal(r->sp.num_stop, 2);
  assert_string_equal(r->sp.stop[1], "yz");
  assert_true(r->sp.has_seed);
  assert_true(r->sp.seed == (uint64_t)-3);
  assert_true(r->sp.presence_penalty == 0.5f && r->sp.frequency_penalty == -0.5f);
  assert_true(r->sp.repetition_penalty == 1.2f);
  assert_int_equal(r->sp.num_logit_bias, 2);
  assert_int_equal(r->sp.logit_bias_ids[0], 7);
  assert_true(r->sp.logit_bias_values[0] == -100.0f && r->sp.logit_bias_values[1] == 2.5f);
  assert_int_equal(r->logprobs, 3);
  assert_int_equal(r->sp.logprobs, 3);
  assert_int_equal(r->sp.prompt_logprobs, 3); /* echo + logprobs: the prompt's too */
  assert_true(r->echo && r->sp.ignore_eos && r->stream && r->include_usage);
  assert_string_equal(r->user, "u");
  assert_int_equal(r->sp.min_tokens, 2);
  assert_int_equal(r->sp.num_stop_token_ids, 2);
  assert_int_equal(r->sp.stop_token_ids[1], 6);
  assert_false(r->sp.skip_special_tokens);
  kiln_api_request_free(r);

  /* nulls read as absent; max_completion_tokens wins over max_tokens; top_k -1 = off */
  r = parse_ok(KILN_API_CHAT,
               "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"temperature\": null,"
               " \"max_tokens\": 3, \"max_completion_tokens\": 9, \"top_k\": -1,"
               " \"logprobs\": true, \"top_logprobs\": 4, \"stop\": \"END\"}");
  assert_true(r->sp.temperature == 1.0f);
  assert_int_equal(r->sp.max_tokens, 9);
  assert_int_equal(r->sp.top_k, 0);
  assert_true(r->chat_logprobs);
  assert_int_equal(r->logprobs, 4);
  assert_int_equal(r->sp.num_stop, 1);
  assert_string_equal(r->sp.stop[0], "END");
  kiln_api_request_free(r);
}

/* Beam search: vLLM's use_beam_search with best_of as the width, the beam_width extra,
 * length_penalty and early_stopping; what it cannot go with is a 400 naming the field. */
static void test_beam_fields(void **state) {
  (void)state;
  const kiln_api_kind_t C = KILN_API_COMPLETIONS, H = KILN_API_CHAT;
  kiln_api_request_t *r = parse_ok(
      C, "{\"prompt\": \"x\", \"use_beam_search\": true, \"best_of\": 4, \"n\": 2, "
         "\"length_penalty\": 0.5, \"early_stopping\": \"never\", \"temperature\": 0}");
  assert_int_equal(r->sp.beam_width, 4);
  assert_int_equal(r->sp.n, 2);
  assert_true(r->sp.length_penalty == 0.5f);
  assert_int_equal(r->sp.early_stopping, KILN_EARLY_STOPPING_NEVER);
  kiln_api_request_free(r);
  r = parse_ok(C, "{\"prompt\": \"x\", \"beam_width\": 3, \"early_stopping\": true}");
  assert_int_equal(r->sp.beam_width, 3);
  assert_int_equal(r->sp.n, 1);
  assert_int_equal(r->sp.early_stopping, KILN_EARLY_STOPPING_TRUE);
  kiln_api_request_free(r);
  r = parse_ok(C, "{\"prompt\": \"x\", \"use_beam_search\": true, \"n\": 3}"); /* width n */
  assert_int_equal(r->sp.beam_width, 3);
  kiln_api_request_free(r);
  r = parse_ok(H, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
                  "\"beam_width\": 2}");
  assert_int_equal(r->sp.beam_width, 2);
  kiln_api_request_free(r);
  parse_bad(C, "{\"prompt\": \"x\", \"use_beam_search\": true, \"best_of\": 2, \"n\": 3}", 400,
            "n", "beam width");
  parse_bad(C, "{\"prompt\": \"x\", \"beam_width\": 2, \"best_of\": 3}", 400, "best_of", NULL);
  parse_bad(C, "{\"prompt\": \"x\", \"beam_width\": 9}", 400, "beam_width", NULL);
  parse_bad(C, "{\"prompt\": \"x\", \"beam_width\": 2, \"stream\": true}", 400, "stream",
            "beam search");
  parse_bad(C, "{\"prompt\": \"x\", \"beam_width\": 2, \"logprobs\": 1}", 400, "logprobs", NULL);
  parse_bad(H, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
               "\"beam_width\": 2, \"logprobs\": true}",
            400, "logprobs", NULL);
  parse_bad(C, "{\"prompt\": \"x\", \"beam_width\": 2, \"stop\": [\"a\"]}", 400, "stop", NULL);
  parse_bad(C, "{\"prompt\": \"x\", \"beam_width\": 2, \"presence_penalty\": 1}", 400,
            "presence_penalty", NULL);
  parse_bad(C, "{\"prompt\": \"x\", \"beam_width\": 2, \"early_stopping\": \"soon\"}", 400,
            "early_stopping", "never");
  parse_bad(C, "{\"prompt\": \"x\", \"length_penalty\": 2}", 400, "length_penalty",
            "beam search");
  parse_bad(C, "{\"prompt\": \"x\", \"early_stopping\": true}", 400, "early_stopping", NULL);
}

static void test_field_errors(void **state) {
  (void)state;
  const kiln_api_kind_t C = KILN_API_COMPLETIONS, H = KILN_API_CHAT;
  parse_bad(C, "{\"prompt\": \"x\", \"max_tokens\": -1}", 400, "max_tokens", "at least 1");
  parse_bad(C, "{\"prompt\": \"x\", \"max_tokens\": 0}", 400, "max_tokens", "got 0");
  parse_bad(C, "{\"prompt\": \"x\", \"max_tokens\": \"5\"}", 400, "max_tokens", "integer");
  parse_bad(C, "{\"prompt\": \"x\", \"max_tokens\": 1.5}", 400, "max_tokens", "fraction");
  parse_bad(C, "{\"prompt\": \"x\", \"temperature\": -0.1}", 400, "temperature", "[0, 100]");
  parse_bad(C, "{\"prompt\": \"x\", \"temperature\": \"hot\"}", 400, "temperature", "number");
  parse_bad(C, "{\"prompt\": \"x\", \"top_p\": 0}", 400, "top_p", "(0, 1]");
  parse_bad(C, "{\"prompt\": \"x\", \"top_p\": 1.01}", 400, "top_p", NULL);
  parse_bad(C, "{\"prompt\": \"x\", \"top_k\": -2}", 400, "top_k", NULL);
  parse_bad(C, "{\"prompt\": \"x\", \"min_p\": 2}", 400, "min_p", NULL);
  parse_bad(C, "{\"prompt\": \"x\", \"n\": 0}", 400, "n", NULL);
  parse_bad(C, "{\"prompt\": \"x\", \"n\": 5}", 400, "n", "[1, 4]");
  parse_bad(C, "{\"prompt\": \"x\", \"best_of\": 3}", 400, "best_of", "best_of == n");
  parse_bad(C, "{\"prompt\": \"x\", \"presence_penalty\": 3}", 400, "presence_penalty", NULL);
  parse_bad(C, "{\"prompt\": \"x\", \"frequency_penalty\": -2.5}", 400, "frequency_penalty", NULL);
  parse_bad(C, "{\"prompt\": \"x\", \"repetition_penalty\": 0}", 400, "repetition_penalty", NULL);
  parse_bad(C, "{\"prompt\": \"x\", \"seed\": 1.5}", 400, "seed", NULL);
  parse_bad(C, "{\"prompt\": \"x\", \"stop\": 3}", 400, "stop", NULL);
  parse_bad(C, "{\"prompt\": \"x\", \"stop\": [\"a\", 3]}", 400, "stop", "stop[1]");
  parse_bad(C, "{\"prompt\": \"x\", \"stop\": [\"\"]}", 400, "stop", "empty");
  parse_bad(C, "{\"prompt\": \"x\", \"logit_bias\": {\"abc\": 1}}", 400, "logit_bias", "abc");
  parse_bad(C, "{\"prompt\": \"x\", \"logit_bias\": {\"5000\": 1}}", 400, "logit_bias", NULL);
  parse_bad(C, "{\"prompt\": \"x\", \"logit_bias\": {\"5\": 101}}", 400, "logit_bias", NULL);
  parse_bad(C, "{\"prompt\": \"x\", \"logit_bias\": [1]}", 400, "logit_bias", NULL);
  parse_bad(C, "{\"prompt\": \"x\", \"logprobs\": 21}", 400, "logprobs", NULL);
  parse_bad(C, "{\"prompt\": \"x\", \"logprobs\": true}", 400, "logprobs", "integer");
  parse_bad(C, "{\"prompt\": \"x\", \"echo\": 1}", 400, "echo", "boolean");
  parse_bad(C, "{\"prompt\": \"x\", \"stream\": \"yes\"}", 400, "stream", "boolean");
  parse_bad(C, "{\"prompt\": \"x\", \"stream_options\": {\"include_usage\": true}}", 400,
            "stream_options", "stream is true");
  parse_bad(C, "{\"prompt\": \"x\", \"stream\": true, \"stream_options\": {\"include_usage\": 1}}",
            400, "stream_options", NULL);
  parse_bad(C, "{\"prompt\": \"x\", \"stop_token_ids\": [1, -1]}", 400, "stop_token_ids", NULL);
  parse_bad(C, "{\"prompt\": \"x\", \"model\": 5}", 400, "model", "string");
  parse_bad(C, "{\"prompt\": \"x\", \"suffix\": \"y\"}", 400, "suffix", NULL);
  /* structured outputs: the parser takes the constraint (the engine compiles it) */
  parse_bad(C, "{\"prompt\": \"x\", \"response_format\": {\"type\": \"json\"}}", 400,
            "response_format", "type 'json' is not supported");
  parse_bad(C, "{\"prompt\": \"x\", \"response_format\": {\"type\": \"json_schema\"}}", 400,
            "response_format", "json_schema: must be an object");
  parse_bad(C,
            "{\"prompt\": \"x\", \"response_format\": {\"type\": \"json_schema\", \"json_schema\": "
            "{\"name\": 1, \"schema\": {}}}}",
            400, "response_format", "name: must be a string");
  parse_bad(C, "{\"prompt\": \"x\", \"guided_json\": 5}", 400, "guided_json", "JSON Schema");
  parse_bad(C, "{\"prompt\": \"x\", \"guided_regex\": \"\"}", 400, "guided_regex", "empty");
  parse_bad(C, "{\"prompt\": \"x\", \"guided_choice\": [\"a\", \"\"]}", 400, "guided_choice",
            "guided_choice[1]: must not be empty");
  parse_bad(C, "{\"prompt\": \"x\", \"guided_grammar\": [1]}", 400, "guided_grammar", "string");
  parse_bad(C,
            "{\"prompt\": \"x\", \"guided_regex\": \"a\", \"response_format\": {\"type\": "
            "\"json_object\"}}",
            400, "guided_regex", "only one constraint");
  parse_bad(C, "{\"prompt\": \"x\", \"structured_outputs\": {\"structural_tag\": {}}}", 400,
            "structured_outputs.structural_tag", "not supported");
  parse_bad(C, "{\"prompt\": \"x\", \"structured_outputs\": 3}", 400, "structured_outputs",
            "object");
  {
    kiln_api_request_t *r = NULL;
    kiln_api_error_t err;
    static const char *const ok[][3] = {
        {"{\"prompt\": \"x\", \"response_format\": {\"type\": \"json_schema\", \"json_schema\": "
         "{\"name\": \"n\", \"schema\": {\"type\": \"integer\"}, \"strict\": true}}}",
         "2", "{\"type\": \"integer\"}"},
        {"{\"prompt\": \"x\", \"response_format\": {\"type\": \"json_object\"}}", "1", ""},
        {"{\"prompt\": \"x\", \"response_format\": {\"type\": \"text\"}}", "0", ""},
        {"{\"prompt\": \"x\", \"guided_json\": \"{\\\"type\\\": \\\"string\\\"}\"}", "2",
         "{\"type\": \"string\"}"},
        {"{\"prompt\": \"x\", \"guided_regex\": \"a+\", \"guided_decoding_backend\": \"xgrammar\"}",
         "3", "a+"},
        {"{\"prompt\": \"x\", \"guided_choice\": [\"a\", \"b\"]}", "4", "[\"a\", \"b\"]"},
        {"{\"prompt\": \"x\", \"guided_grammar\": \"root ::= \\\"a\\\"\"}", "5", "root ::= \"a\""},
        {"{\"prompt\": \"x\", \"structured_outputs\": {\"regex\": \"b\"}}", "3", "b"},
        {"{\"prompt\": \"x\", \"structured_outputs\": {\"json_object\": true}}", "1", ""},
    };
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
      if (!kiln_api_parse(KILN_API_COMPLETIONS, ok[i][0], strlen(ok[i][0]), NULL, &r, &err))
        fail_msg("refused %s: %s", ok[i][0], err.message);
      assert_int_equal((int)r->sp.guide, atoi(ok[i][1]));
      if (ok[i][2][0]) {
        assert_non_null(r->sp.guide_spec);
        assert_int_equal(r->sp.guide_spec_len, strlen(ok[i][2]));
        assert_memory_equal(r->sp.guide_spec, ok[i][2], strlen(ok[i][2]));
      }
      kiln_api_request_free(r);
    }
  }
  /* prompts */
  parse_bad(C, "{}", 400, "prompt", "required");
  parse_bad(C, "{\"prompt\": \"\"}", 400, "prompt", "empty");
  parse_bad(C, "{\"prompt\": []}", 400, "prompt", "empty");
  parse_bad(C, "{\"prompt\": 5}", 400, "prompt", NULL);
  parse_bad(C, "{\"prompt\": [1, 1000]}", 400, "prompt", "outside the vocabulary");
  parse_bad(C, "{\"prompt\": [1, -2]}", 400, "prompt", NULL);
  parse_bad(C, "{\"prompt\": [\"a\", 7]}", 400, "prompt", "prompt[1]");
  parse_bad(C, "{\"prompt\": [[1], []]}", 400, "prompt", "empty");
  /* chat */
  parse_bad(H, "{}", 400, "messages", "required");
  parse_bad(H, "{\"messages\": []}", 400, "messages", "empty");
  parse_bad(H, "{\"messages\": {}}", 400, "messages", NULL);
  parse_bad(H, "{\"messages\": [\"hi\"]}", 400, "messages", "messages[0]");
  parse_bad(H, "{\"messages\": [{\"content\": \"hi\"}]}", 400, "messages", "role");
  parse_bad(H, "{\"messages\": [{\"role\": \"user\", \"content\": 5}]}", 400, "messages", NULL);
  parse_bad(H,
            "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\","
            " \"image_url\": {\"url\": \"x\"}}]}]}",
            400, "messages", "image_url");
  parse_bad(H, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"top_logprobs\": 2}",
            400, "top_logprobs", "logprobs");
  parse_bad(H, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"logprobs\": 2}", 400,
            "logprobs", "boolean");
  parse_bad(H, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"echo\": true}", 400,
            "echo", NULL);
  parse_bad(H, "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"tools\": {}}", 400,
            "tools", NULL);
  /* the body itself */
  parse_bad(C, "", 400, NULL, "malformed JSON");
  parse_bad(C, "{\"prompt\": \"x\",}", 400, NULL, "malformed JSON");
  parse_bad(C, "[1, 2]", 400, NULL, "JSON object");
  parse_bad(C, "\"prompt\"", 400, NULL, "JSON object");
  parse_bad(KILN_API_DETOKENIZE, "{\"tokens\": [1, 1000]}", 400, "tokens", NULL);
  parse_bad(KILN_API_DETOKENIZE, "{}", 400, "tokens", NULL);
  parse_bad(KILN_API_TOKENIZE, "{\"prompt\": 3}", 400, "prompt", NULL);
}

/* Content-part lists become one string; other members pass through; the result is valid
 * JSON for the template. */
static void test_messages_normalized(void **state) {
  (void)state;
  kiln_api_request_t *r =
      parse_ok(KILN_API_CHAT,
               "{\"messages\": [{\"role\": \"system\", \"content\": \"be brief\"},"
               " {\"role\": \"user\", \"name\": \"ann\", \"content\": [{\"type\": \"text\", "
               "\"text\": \"a\"},"
               " {\"type\": \"text\", \"text\": \"b\\u00e9\"}]}, {\"role\": \"assistant\", "
               "\"content\": null}],"
               " \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\"}}],"
               " \"chat_template_kwargs\": "
               "{\"enable_thinking\": false}}");
  kiln_json_doc_t *doc = NULL;
  assert_null(kiln_json_parse(r->messages_json, r->messages_len, "messages", &doc));
  const kiln_json_t *m = kiln_json_root(doc);
  assert_int_equal(kiln_json_len(m), 3);
  assert_string_equal(kiln_json_string(kiln_json_get(kiln_json_at(m, 1), "content"), NULL),
                      "a\nb\xc3\xa9");
  assert_string_equal(kiln_json_string(kiln_json_get(kiln_json_at(m, 1), "name"), NULL), "ann");
  assert_true(kiln_json_is(kiln_json_get(kiln_json_at(m, 2), "content"), KILN_JSON_NULL));
  kiln_json_doc_free(doc);
  assert_non_null(r->tools_json);
  assert_non_null(strstr(r->template_kwargs_json, "enable_thinking"));
  kiln_api_request_free(r);
}

/* image_url parts: decoded data URLs in r->images (with their message and part), {"type":
 * "image"} left in their place; every bad URL refused naming the part. */
static void test_image_parts(void **state) {
  (void)state;
  kiln_api_request_t *r =
      parse_ok(KILN_API_CHAT,
               "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"user\", "
               "\"content\": "
               "[{\"type\": \"text\", \"text\": \"look\"}, {\"type\": \"image_url\", "
               "\"image_url\": {\"url\": "
               "\"data:image/png;base64,aGVsbG8=\"}}, {\"type\": \"image_url\", \"image_url\": "
               "\"data:image/jpeg;base64,aGk\"}]}]}");
  assert_int_equal(r->num_images, 2);
  assert_int_equal(r->images[0].message, 1);
  assert_int_equal(r->images[0].part, 1);
  assert_int_equal(r->images[0].size, 5);
  assert_memory_equal(r->images[0].data, "hello", 5);
  assert_int_equal(r->images[1].part, 2);
  assert_int_equal(r->images[1].size, 2);
  assert_memory_equal(r->images[1].data, "hi", 2);
  kiln_json_doc_t *doc = NULL;
  assert_null(kiln_json_parse(r->messages_json, r->messages_len, "messages", &doc));
  const kiln_json_t *c = kiln_json_get(kiln_json_at(kiln_json_root(doc), 1), "content");
  assert_int_equal(kiln_json_len(c), 3);
  assert_string_equal(kiln_json_string(kiln_json_get(kiln_json_at(c, 0), "text"), NULL), "look");
  assert_string_equal(kiln_json_string(kiln_json_get(kiln_json_at(c, 1), "type"), NULL), "image");
  assert_null(kiln_json_get(kiln_json_at(c, 1), "image_url")); /* the bytes are not in the JSON */
  assert_string_equal(kiln_json_string(kiln_json_get(kiln_json_at(c, 2), "type"), NULL), "image");
  kiln_json_doc_free(doc);
  kiln_api_request_free(r);
#define IMG(url)                                                                  \
  "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\", " \
  "\"image_url\": {\"url\": \"" url "\"}}]}]}"
  parse_bad(KILN_API_CHAT, IMG("data:image/png;base64,aGV*bG8="), 400, "messages",
            "messages[0].content[0]: the data URL is not valid base64 (at character 3");
  parse_bad(KILN_API_CHAT, IMG("data:image/png;base64,aGVsb"), 400, "messages", "not valid base64");
  parse_bad(KILN_API_CHAT, IMG("data:image/png;base64,"), 400, "messages", "holds no image data");
  parse_bad(KILN_API_CHAT, IMG("data:image/bmp;base64,aGk="), 400, "messages",
            "unsupported image type 'image/bmp'");
  parse_bad(KILN_API_CHAT, IMG("data:image/png,aGk="), 400, "messages", "must be base64");
  parse_bad(KILN_API_CHAT, IMG("https://example.com/a.png"), 400, "messages",
            "messages[0].content[0]: image URLs are not fetched by this server");
  parse_bad(KILN_API_CHAT, IMG("file:///etc/passwd"), 400, "messages", "must be a data: URL");
#undef IMG
  /* limits: a text-only model, the count, the size; remote URLs when allowed */
  kiln_api_limits_t l = limits();
  kiln_api_error_t err;
  const char *two =
      "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\", "
      "\"image_url\": {\"url\": \"data:image/png;base64,aGk=\"}}, {\"type\": \"image_url\", "
      "\"image_url\": {\"url\": \"http://127.0.0.1/x.png\"}}]}]}";
  l.max_images = 0;
  assert_false(kiln_api_parse(KILN_API_CHAT, two, strlen(two), &l, &r, &err));
  assert_non_null(strstr(err.message,
                         "messages[0].content[0]: content of type 'image_url' is not "
                         "supported by this model (text only)"));
  l.max_images = 1;
  assert_false(kiln_api_parse(KILN_API_CHAT, two, strlen(two), &l, &r, &err));
  assert_non_null(strstr(err.message, "messages[0].content[1]: more than 1 images"));
  l.max_images = 2;
  l.max_image_bytes = 1;
  assert_false(kiln_api_parse(KILN_API_CHAT, two, strlen(two), &l, &r, &err));
  assert_non_null(
      strstr(err.message, "messages[0].content[0]: the image is over the limit of 1 bytes"));
  l.max_image_bytes = 100;
  l.allow_remote_images = true;
  assert_true(kiln_api_parse(KILN_API_CHAT, two, strlen(two), &l, &r, &err));
  assert_int_equal(r->num_images, 2);
  assert_string_equal(r->images[1].url, "http://127.0.0.1/x.png");
  assert_null(r->images[1].data);
  kiln_api_request_free(r);
}

/* base64 against known encodings, with and without padding, and its errors. */
static void test_base64(void **state) {
  (void)state;
  static const char *const plain[] = {"", "f", "fo", "foo", "foob", "fooba", "foobar"};
  static const char *const enc[] = {"", "Zg==", "Zm8=", "Zm9v", "Zm9vYg==", "Zm9vYmE=", "Zm9vYmFy"};
  for (int i = 0; i < 7; i++) {
    for (int pad = 0; pad < 2; pad++) {
      size_t n = strlen(enc[i]);
      while (!pad && n && enc[i][n - 1] == '=') n--;
      unsigned char *out = NULL;
      size_t len = 99;
      int64_t at = 0;
      assert_true(kiln_base64_decode(enc[i], n, &out, &len, &at));
      assert_int_equal(len, strlen(plain[i]));
      if (len) assert_memory_equal(out, plain[i], len);
      free(out);
    }
  }
  unsigned char *out = NULL;
  size_t len = 0;
  int64_t at = 0;
  assert_false(kiln_base64_decode("Zm9v-mFy", 8, &out, &len, &at));
  assert_int_equal(at, 4);
  assert_false(kiln_base64_decode("Zm9vY", 5, &out, &len, &at)); /* 1 char past a group */
  assert_int_equal(at, 5);
  assert_false(kiln_base64_decode("Zm9v=mFy", 8, &out, &len, &at)); /* padding inside */
  assert_int_equal(at, 4);
  assert_null(out);
  /* Encoding: RFC 4648's vectors, then every byte value round-trips through both directions. */
  for (int i = 0; i < 7; i++) {
    kiln_strbuf_t sb = KILN_STRBUF_INIT;
    assert_true(kiln_base64_encode(plain[i], strlen(plain[i]), &sb));
    assert_int_equal(sb.len, strlen(enc[i]));
    if (sb.len) assert_memory_equal(sb.data, enc[i], sb.len);
    kiln_strbuf_free(&sb);
  }
  unsigned char all[256];
  for (int i = 0; i < 256; i++) all[i] = (unsigned char)(255 - i);
  for (size_t n = 250; n <= 256; n++) {
    kiln_strbuf_t sb = KILN_STRBUF_INIT;
    assert_true(kiln_base64_encode(all, n, &sb));
    assert_true(kiln_base64_decode(sb.data, sb.len, &out, &len, &at));
    assert_int_equal(len, n);
    assert_memory_equal(out, all, n);
    free(out);
    out = NULL;
    kiln_strbuf_free(&sb);
  }
}

static kiln_json_doc_t *parse_json(const char *text, size_t len) {
  kiln_json_doc_t *doc = NULL;
  kiln_status_t st = kiln_json_parse(text, len, "out", &doc);
  if (st) fail_msg("%s\n%.*s", kiln_status_message(st), (int)len, text);
  return doc;
}

static const kiln_json_t *path(const kiln_json_t *v, const char *p) {
  char buf[128];
  snprintf(buf, sizeof(buf), "%s", p);
  for (char *tok = strtok(buf, "."); tok && v; tok = strtok(NULL, "."))
    v = (tok[0] >= '0' && tok[0] <= '9') ? kiln_json_at(v, (size_t)atoi(tok))
                                         : kiln_json_get(v, tok);
  return v;
}

static kiln_api_token_t tok(int32_t id, float lp, const char *text, const char *alt, float alt_lp) {
  kiln_api_token_t t;
  memset(&t, 0, sizeof(t));
  t.id = id;
  t.logprob = lp;
  t.text = strdup(text);
  t.num_top = 1;
  t.top_ids = malloc(sizeof(int32_t));
  t.top_logprobs = malloc(sizeof(float));
  t.top_text = calloc(1, sizeof(char *));
  t.top_ids[0] = id + 1;
  t.top_logprobs[0] = alt_lp;
  t.top_text[0] = strdup(alt);
  return t;
}

static void test_write_completion(void **state) {
  (void)state;
  kiln_api_request_t *r =
      parse_ok(KILN_API_COMPLETIONS, "{\"prompt\": \"x\", \"logprobs\": 1, \"stop\": \"Z\"}");
  kiln_api_choice_t c[2];
  memset(c, 0, sizeof(c));
  c[0].index = 0;
  c[1].index = 1;
  kiln_strbuf_append_str(&c[0].text, "He said \"hi\"\n");
  kiln_api_token_t t = tok(5, -0.25f, "He", "She", -1.5f);
  assert_true(kiln_api_choice_push_token(&c[0], &t));
  t = tok(6, -INFINITY, " said", " told", -2.0f);
  assert_true(kiln_api_choice_push_token(&c[0], &t));
  c[0].finish = KILN_FINISH_STOP;
  c[0].stop_str = strdup("Z");
  c[1].finish = KILN_FINISH_LENGTH;
  c[1].stop_token = -1;
  kiln_api_response_t resp = {r, "cmpl-1", "tiny", 42, {3, 5, 1}};
  kiln_strbuf_t out = KILN_STRBUF_INIT;
  kiln_api_write_response(&out, &resp, c, 2);
  kiln_json_doc_t *doc = parse_json(out.data, out.len);
  const kiln_json_t *root = kiln_json_root(doc);
  assert_string_equal(kiln_json_string(path(root, "object"), NULL), "text_completion");
  assert_string_equal(kiln_json_string(path(root, "model"), NULL), "tiny");
  assert_string_equal(kiln_json_string(path(root, "choices.0.text"), NULL), "He said \"hi\"\n");
  assert_string_equal(kiln_json_string(path(root, "choices.0.finish_reason"), NULL), "stop");
  assert_string_equal(kiln_json_string(path(root, "choices.0.stop_reason"), NULL), "Z");
  assert_string_equal(kiln_json_string(path(root, "choices.1.finish_reason"), NULL), "length");
  assert_string_equal(kiln_json_string(path(root, "choices.0.logprobs.tokens.1"), NULL), " said");
  assert_true(kiln_json_number(path(root, "choices.0.logprobs.token_logprobs.0")) == -0.25);
  assert_true(kiln_json_number(path(root, "choices.0.logprobs.token_logprobs.1")) < -1000);
  assert_true(kiln_json_number(path(root, "choices.0.logprobs.top_logprobs.0.She")) == -1.5);
  assert_true(kiln_json_number(path(root, "choices.0.logprobs.text_offset.1")) == 2);
  assert_true(kiln_json_number(path(root, "usage.total_tokens")) == 8);
  assert_true(kiln_json_number(path(root, "usage.prompt_tokens_details.cached_tokens")) == 1);
  kiln_json_doc_free(doc);
  kiln_strbuf_free(&out);
  kiln_api_request_free(r);
  /* a token from stop_token_ids is the stop_reason; the model's EOS is not (null) */
  r = parse_ok(KILN_API_COMPLETIONS, "{\"prompt\": \"x\", \"stop_token_ids\": [7]}");
  resp.req = r;
  free(c[0].stop_str);
  c[0].stop_str = NULL;
  kiln_api_choice_reset_tokens(&c[0]);
  c[0].stop_token = 7;
  c[1].finish = KILN_FINISH_STOP;
  c[1].stop_token = 2;
  kiln_api_write_response(&out, &resp, c, 2);
  doc = parse_json(out.data, out.len);
  root = kiln_json_root(doc);
  assert_true(kiln_json_number(path(root, "choices.0.stop_reason")) == 7);
  assert_true(kiln_json_is(path(root, "choices.1.stop_reason"), KILN_JSON_NULL));
  kiln_json_doc_free(doc);
  kiln_strbuf_free(&out);
  kiln_api_choice_free(&c[0]);
  kiln_api_choice_free(&c[1]);
  kiln_api_request_free(r);
}

static void test_write_chat_stream(void **state) {
  (void)state;
  kiln_api_request_t *r =
      parse_ok(KILN_API_CHAT,
               "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}], \"stream\": true,"
               " \"stream_options\": {\"include_usage\": true}, \"logprobs\": true,"
               " \"top_logprobs\": 1}");
  kiln_api_choice_t c;
  memset(&c, 0, sizeof(c));
  c.stop_token = -1;
  kiln_api_response_t resp = {r, "chatcmpl-1", "tiny", 42, {3, 1, 0}};
  kiln_strbuf_t out = KILN_STRBUF_INIT;
  kiln_api_write_chunk(&out, &resp, &c, false); /* the role chunk */
  kiln_strbuf_append_str(&c.text, "caf\xc3\xa9");
  kiln_api_token_t t = tok(9, -0.5f, "caf\xc3\xa9", "tea", -3.0f);
  assert_true(kiln_api_choice_push_token(&c, &t));
  kiln_api_write_chunk(&out, &resp, &c, false);
  c.finish = KILN_FINISH_STOP;
  c.stop_token = 2;
  kiln_api_write_chunk(&out, &resp, &c, false);
  kiln_api_write_usage_chunk(&out, &resp);
  /* four events, each "data: {json}\n\n" */
  const char *p = out.data;
  const kiln_json_t *root;
  kiln_json_doc_t *docs[4];
  for (int i = 0; i < 4; i++) {
    assert_memory_equal(p, "data: ", 6);
    const char *e = strstr(p, "\n\n");
    assert_non_null(e);
    docs[i] = parse_json(p + 6, (size_t)(e - p - 6));
    p = e + 2;
  }
  assert_int_equal(*p, 0);
  root = kiln_json_root(docs[0]);
  assert_string_equal(kiln_json_string(path(root, "object"), NULL), "chat.completion.chunk");
  assert_string_equal(kiln_json_string(path(root, "choices.0.delta.role"), NULL), "assistant");
  assert_true(kiln_json_is(path(root, "usage"), KILN_JSON_NULL));
  root = kiln_json_root(docs[1]);
  assert_null(path(root, "choices.0.delta.role"));
  assert_string_equal(kiln_json_string(path(root, "choices.0.delta.content"), NULL), "caf\xc3\xa9");
  assert_true(kiln_json_number(path(root, "choices.0.logprobs.content.0.logprob")) == -0.5);
  assert_true(kiln_json_number(path(root, "choices.0.logprobs.content.0.bytes.3")) == 0xc3);
  assert_string_equal(
      kiln_json_string(path(root, "choices.0.logprobs.content.0.top_logprobs.0.token"), NULL),
      "tea");
  assert_true(kiln_json_is(path(root, "choices.0.finish_reason"), KILN_JSON_NULL));
  root = kiln_json_root(docs[2]);
  assert_string_equal(kiln_json_string(path(root, "choices.0.finish_reason"), NULL), "stop");
  assert_true(kiln_json_is(path(root, "choices.0.stop_reason"), KILN_JSON_NULL)); /* EOS */
  assert_null(path(root, "choices.0.delta.content"));
  root = kiln_json_root(docs[3]);
  assert_int_equal(kiln_json_len(path(root, "choices")), 0);
  assert_true(kiln_json_number(path(root, "usage.completion_tokens")) == 1);
  for (int i = 0; i < 4; i++) kiln_json_doc_free(docs[i]);
  kiln_strbuf_free(&out);
  kiln_api_choice_free(&c);
  kiln_api_request_free(r);
}

/* ---- tools ----------------------------------------------------------------------------------- */

#define MSGS "\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]"
#define TOOL_F                                                                                  \
  "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"d\", " \
  "\"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}}}}"
#define TOOL_G "{\"type\": \"function\", \"function\": {\"name\": \"now\"}}"

static void test_tools_parse(void **state) {
  (void)state;
  const kiln_api_kind_t H = KILN_API_CHAT;
  /* defaults: auto, parallel; an empty list is no tools */
  kiln_api_request_t *r = parse_ok(H, "{" MSGS ", \"tools\": [" TOOL_F ", " TOOL_G "]}");
  assert_int_equal(r->tool_choice, KILN_API_TOOL_AUTO);
  assert_true(r->parallel_tool_calls);
  assert_int_equal(r->num_tools, 2);
  assert_non_null(strstr(r->tools_json, "get_weather"));
  assert_int_equal(r->sp.guide, KILN_GUIDE_NONE);
  kiln_api_request_free(r);
  r = parse_ok(H, "{" MSGS ", \"tools\": [], \"tool_choice\": \"auto\"}");
  assert_null(r->tools_json);
  kiln_api_request_free(r);
  r = parse_ok(H, "{" MSGS ", \"tools\": [" TOOL_F "], \"tool_choice\": \"none\"}");
  assert_int_equal(r->tool_choice, KILN_API_TOOL_NONE);
  assert_int_equal(r->sp.guide, KILN_GUIDE_NONE);
  kiln_api_request_free(r);
  /* a named function: its parameter schema is the guide */
  r = parse_ok(H, "{" MSGS ", \"tools\": [" TOOL_F ", " TOOL_G
                  "], \"tool_choice\": {\"type\": "
                  "\"function\", \"function\": {\"name\": \"get_weather\"}}}");
  assert_int_equal(r->tool_choice, KILN_API_TOOL_NAMED);
  assert_string_equal(r->tool_name, "get_weather");
  assert_int_equal(r->sp.guide, KILN_GUIDE_JSON_SCHEMA);
  assert_string_equal(r->sp.guide_spec,
                      "{\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}}");
  assert_int_equal(r->sp.guide_spec_len, strlen(r->sp.guide_spec));
  kiln_api_request_free(r);
  r = parse_ok(H, "{" MSGS ", \"tools\": [" TOOL_G
                  "], \"tool_choice\": {\"type\": "
                  "\"function\", \"function\": {\"name\": \"now\"}}}");
  assert_string_equal(r->sp.guide_spec, "{\"type\": \"object\", \"properties\": {}}");
  kiln_api_request_free(r);
  /* required: an array of {name, parameters} alternatives; one item without parallel calls */
  for (int par = 0; par < 2; par++) {
    char body[1024];
    snprintf(body, sizeof body,
             "{" MSGS ", \"tools\": [" TOOL_F ", " TOOL_G
             "], \"tool_choice\": \"required\", "
             "\"parallel_tool_calls\": %s}",
             par ? "true" : "false");
    r = parse_ok(H, body);
    assert_int_equal(r->tool_choice, KILN_API_TOOL_REQUIRED);
    assert_true(r->parallel_tool_calls == (par == 1));
    kiln_json_doc_t *doc = parse_json(r->sp.guide_spec, r->sp.guide_spec_len);
    const kiln_json_t *g = kiln_json_root(doc);
    assert_string_equal(kiln_json_string(path(g, "type"), NULL), "array");
    assert_true(kiln_json_number(path(g, "minItems")) == 1);
    if (par)
      assert_null(path(g, "maxItems"));
    else
      assert_true(kiln_json_number(path(g, "maxItems")) == 1);
    assert_int_equal(kiln_json_len(path(g, "items.anyOf")), 2);
    assert_string_equal(kiln_json_string(path(g, "items.anyOf.0.properties.name.enum.0"), NULL),
                        "get_weather");
    assert_string_equal(
        kiln_json_string(path(g, "items.anyOf.0.properties.parameters.properties.city.type"), NULL),
        "string");
    assert_string_equal(kiln_json_string(path(g, "items.anyOf.1.properties.name.enum.0"), NULL),
                        "now");
    assert_string_equal(kiln_json_string(path(g, "items.anyOf.1.required.1"), NULL), "parameters");
    kiln_json_doc_free(doc);
    kiln_api_request_free(r);
  }
  /* a tool schema's own $refs still resolve once it is embedded in the required wrapper (they
   * are rebased under its place there), and as the named function's whole document */
  {
#define TOOL_REF                                                                                 \
  "{\"type\": \"function\", \"function\": {\"name\": \"get_city\", \"parameters\": {\"$defs\": " \
  "{\"city\": {\"type\": \"string\", \"enum\": [\"Paris\", \"Rome\"]}}, \"type\": \"object\", "  \
  "\"properties\": {\"city\": {\"$ref\": \"#/$defs/city\"}}, \"required\": [\"city\"]}}}"
    static const char *const choices[] = {"\"required\"",
                                          "{\"type\": \"function\", \"function\": {\"name\": "
                                          "\"get_city\"}}"};
    static const char *const good[] = {
        "[{\"name\": \"get_city\", \"parameters\": {\"city\": \"Rome\"}}]",
        "{\"city\": \"Paris\"}"};
    static const char *const bad[] = {
        "[{\"name\": \"get_city\", \"parameters\": {\"city\": \"Lyon\"}}]", "{\"city\": \"Lyon\"}"};
    for (int i = 0; i < 2; i++) {
      char body[2048];
      snprintf(body, sizeof body,
               "{" MSGS ", \"tools\": [" TOOL_F ", " TOOL_REF "], \"tool_choice\": %s}",
               choices[i]);
      r = parse_ok(H, body);
      if (i == 0)
        assert_non_null(
            strstr(r->sp.guide_spec, "#/items/anyOf/1/properties/parameters/$defs/city"));
      kiln_guide_t *g = NULL;
      kiln_status_t st = kiln_guide_compile(NULL, KILN_GUIDE_JSON_SCHEMA, r->sp.guide_spec,
                                            r->sp.guide_spec_len, &g);
      if (st) fail_msg("%s", kiln_status_message(st));
      kiln_guide_matcher_t *m = NULL, *m2 = NULL;
      assert_null(kiln_guide_matcher_create(g, &m));
      assert_null(kiln_guide_matcher_create(g, &m2));
      assert_true(kiln_guide_matcher_accept_bytes(m, good[i], strlen(good[i])));
      assert_true(kiln_guide_matcher_accepting(m));
      assert_false(kiln_guide_matcher_accept_bytes(m2, bad[i], strlen(bad[i])) &&
                   kiln_guide_matcher_accepting(m2));
      kiln_guide_matcher_free(m);
      kiln_guide_matcher_free(m2);
      kiln_guide_release(g);
      kiln_api_request_free(r);
    }
#undef TOOL_REF
  }
  /* strict is fine where the arguments are constrained */
  r = parse_ok(H, "{" MSGS
                  ", \"tools\": [{\"type\": \"function\", \"function\": {\"name\": "
                  "\"f\", \"strict\": true}}], \"tool_choice\": \"required\"}");
  kiln_api_request_free(r);
  /* errors name the field */
  parse_bad(H, "{" MSGS ", \"tools\": [3]}", 400, "tools", "tools[0]: must be an object");
  parse_bad(H, "{" MSGS ", \"tools\": [{\"type\": \"custom\"}]}", 400, "tools", "tools[0].type");
  parse_bad(H, "{" MSGS ", \"tools\": [{\"type\": \"function\"}]}", 400, "tools",
            "tools[0].function");
  parse_bad(H, "{" MSGS ", \"tools\": [" TOOL_F ", {\"type\": \"function\", \"function\": {}}]}",
            400, "tools", "tools[1].function.name");
  parse_bad(H,
            "{" MSGS
            ", \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", "
            "\"parameters\": []}}]}",
            400, "tools", "tools[0].function.parameters");
  parse_bad(H,
            "{" MSGS
            ", \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", "
            "\"description\": 1}}]}",
            400, "tools", "description");
  parse_bad(H,
            "{" MSGS
            ", \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", "
            "\"strict\": true}}]}",
            400, "tools", "strict");
  parse_bad(H, "{" MSGS ", \"tools\": [" TOOL_F "], \"tool_choice\": \"sometimes\"}", 400,
            "tool_choice", "sometimes");
  parse_bad(H, "{" MSGS ", \"tools\": [" TOOL_F "], \"tool_choice\": 1}", 400, "tool_choice", NULL);
  parse_bad(H, "{" MSGS ", \"tools\": [" TOOL_F "], \"tool_choice\": {\"type\": \"function\"}}",
            400, "tool_choice", NULL);
  parse_bad(H,
            "{" MSGS ", \"tools\": [" TOOL_F
            "], \"tool_choice\": {\"type\": \"function\", "
            "\"function\": {\"name\": \"nope\"}}}",
            400, "tool_choice", "'nope' is not in tools");
  parse_bad(H,
            "{" MSGS
            ", \"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": "
            "\"f\"}}}",
            400, "tool_choice", NULL);
  parse_bad(H, "{" MSGS ", \"tool_choice\": \"required\"}", 400, "tool_choice", "needs tools");
  parse_bad(H, "{" MSGS ", \"tools\": [" TOOL_F "], \"parallel_tool_calls\": 1}", 400,
            "parallel_tool_calls", NULL);
}

static const char *const k_hermes_tpl =
    "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}<tool_call>{% endif %}";

static void test_tools_prepare(void **state) {
  (void)state;
  const kiln_api_kind_t H = KILN_API_CHAT;
  kiln_api_error_t err;
  const char *plain = "{% for m in messages %}{{ m.content }}{% endfor %}";
  /* a template that never uses tools: 400 on tools, with tools or tool_choice none */
  kiln_api_request_t *r = parse_ok(H, "{" MSGS ", \"tools\": [" TOOL_F "]}");
  assert_false(kiln_api_tools_prepare(r, plain, strlen(plain), false, "auto", &err));
  assert_int_equal(err.status, 400);
  assert_string_equal(err.param, "tools");
  assert_non_null(strstr(err.message, "does not render tools"));
  /* the hermes format from the template; auto parses */
  assert_true(kiln_api_tools_prepare(r, k_hermes_tpl, strlen(k_hermes_tpl), true, "auto", &err));
  assert_int_equal(r->tool_format, KILN_TOOL_FORMAT_HERMES);
  assert_true(r->sp.skip_special_tokens);
  /* [server] tool_parser overrides; mistral's marker needs special tokens in the text */
  assert_true(kiln_api_tools_prepare(r, k_hermes_tpl, strlen(k_hermes_tpl), true, "mistral", &err));
  assert_int_equal(r->tool_format, KILN_TOOL_FORMAT_MISTRAL);
  assert_false(r->sp.skip_special_tokens);
  assert_false(kiln_api_tools_prepare(r, k_hermes_tpl, strlen(k_hermes_tpl), true, "none", &err));
  assert_string_equal(err.param, "tools");
  assert_non_null(strstr(err.message, "tool_parser = none"));
  /* a template with tools but no known format */
  const char *odd = "{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}";
  assert_false(kiln_api_tools_prepare(r, odd, strlen(odd), true, "auto", &err));
  assert_non_null(strstr(err.message, "tool_parser"));
  assert_true(kiln_api_tools_prepare(r, odd, strlen(odd), true, "llama3_json", &err));
  assert_int_equal(r->tool_format, KILN_TOOL_FORMAT_LLAMA3_JSON);
  kiln_api_request_free(r);
  /* tool_choice none: the tools are shown, the reply not parsed; required parses its JSON */
  r = parse_ok(H, "{" MSGS ", \"tools\": [" TOOL_F "], \"tool_choice\": \"none\"}");
  assert_true(kiln_api_tools_prepare(r, odd, strlen(odd), true, "auto", &err));
  assert_int_equal(r->tool_format, KILN_TOOL_FORMAT_NONE);
  kiln_api_request_free(r);
  r = parse_ok(H, "{" MSGS ", \"tools\": [" TOOL_F "], \"tool_choice\": \"required\"}");
  assert_true(kiln_api_tools_prepare(r, odd, strlen(odd), true, "auto", &err));
  assert_int_equal(r->tool_format, KILN_TOOL_FORMAT_JSON);
  kiln_api_request_free(r);
  /* assistant tool_calls: arguments strings become objects, null content "", for a template
   * in a known format; untouched for others (DeepSeek's template wants the string) */
  const char *hist =
      "{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}, {\"role\": \"assistant\", "
      "\"content\": null, \"tool_calls\": [{\"id\": \"call_1\", \"type\": \"function\", "
      "\"function\": {\"name\": \"f\", \"arguments\": \"{\\\"a\\\":1}\", \"parsed_arguments\": "
      "null}}, "
      "{\"id\": \"call_2\", "
      "\"type\": \"function\", \"function\": {\"name\": \"g\", \"arguments\": \"\"}}]}, {\"role\": "
      "\"tool\", \"tool_call_id\": \"call_1\", \"content\": \"ok\"}]}";
  r = parse_ok(H, hist);
  assert_true(kiln_api_tools_prepare(r, plain, strlen(plain), false, "auto", &err));
  assert_non_null(strstr(r->messages_json, "\"arguments\": \"{\\\"a\\\":1}\""));
  assert_true(kiln_api_tools_prepare(r, k_hermes_tpl, strlen(k_hermes_tpl), true, "auto", &err));
  kiln_json_doc_t *doc = parse_json(r->messages_json, r->messages_len);
  const kiln_json_t *m = kiln_json_root(doc);
  assert_int_equal(kiln_json_len(m), 3);
  assert_string_equal(kiln_json_string(path(m, "1.content"), NULL), "");
  assert_string_equal(kiln_json_string(path(m, "1.role"), NULL), "assistant");
  assert_true(kiln_json_number(path(m, "1.tool_calls.0.function.arguments.a")) == 1);
  assert_string_equal(kiln_json_string(path(m, "1.tool_calls.0.id"), NULL), "call_1");
  assert_string_equal(kiln_json_string(path(m, "1.tool_calls.0.function.name"), NULL), "f");
  assert_int_equal(kiln_json_len(path(m, "1.tool_calls.1.function.arguments")), 0);
  assert_true(kiln_json_is(path(m, "1.tool_calls.1.function.arguments"), KILN_JSON_OBJECT));
  assert_string_equal(kiln_json_string(path(m, "2.tool_call_id"), NULL), "call_1");
  assert_null(path(m, "1.tool_calls.0.function.parsed_arguments")); /* not OpenAI's: dropped */
  kiln_json_doc_free(doc);
  kiln_api_request_free(r);
  r = parse_ok(H,
               "{\"messages\": [{\"role\": \"assistant\", \"tool_calls\": [{\"function\": "
               "{\"name\": \"f\", \"arguments\": \"{oops\"}}]}]}");
  assert_false(kiln_api_tools_prepare(r, k_hermes_tpl, strlen(k_hermes_tpl), true, "auto", &err));
  assert_string_equal(err.param, "messages");
  assert_non_null(strstr(err.message, "messages[0].tool_calls[0].function.arguments"));
  kiln_api_request_free(r);
  r = parse_ok(H,
               "{\"messages\": [{\"role\": \"assistant\", \"tool_calls\": [{\"function\": "
               "{\"arguments\": {}}}]}]}");
  assert_false(kiln_api_tools_prepare(r, k_hermes_tpl, strlen(k_hermes_tpl), true, "auto", &err));
  assert_non_null(strstr(err.message, "messages[0].tool_calls[0].function.name"));
  kiln_api_request_free(r);
  r = parse_ok(H, "{\"messages\": [{\"role\": \"assistant\", \"tool_calls\": [7]}]}");
  assert_false(kiln_api_tools_prepare(r, k_hermes_tpl, strlen(k_hermes_tpl), true, "auto", &err));
  assert_non_null(strstr(err.message, "messages[0].tool_calls[0]: must be an object"));
  kiln_api_request_free(r);
  /* the engine lacks constrained decoding: a 400 on tool_choice */
  r = parse_ok(H, "{" MSGS ", \"tools\": [" TOOL_F "], \"tool_choice\": \"required\"}");
  kiln_status_t st = kiln_status_make(KILN_ERR_UNSUPPORTED, "no guides");
  assert_true(kiln_api_tools_submit_error(r, st, &err));
  assert_int_equal(err.status, 400);
  assert_string_equal(err.param, "tool_choice");
  assert_non_null(strstr(err.message, "constrained decoding"));
  kiln_status_free(st);
  kiln_api_request_free(r);
}

/* A choice of a request prepared for the hermes template (or as the body says). */
static kiln_api_request_t *tool_request(const char *body, kiln_api_choice_t *c) {
  kiln_api_request_t *r = parse_ok(KILN_API_CHAT, body);
  kiln_api_error_t err;
  if (!kiln_api_tools_prepare(r, k_hermes_tpl, strlen(k_hermes_tpl), true, "auto", &err))
    fail_msg("%s", err.message);
  memset(c, 0, sizeof(*c));
  c->stop_token = -1;
  assert_true(kiln_api_tool_state_init(c, r));
  return r;
}

/* Splits "data: {json}\n\n" events into documents. */
static int events(const char *p, kiln_json_doc_t **docs, int max) {
  int n = 0;
  while (*p) {
    assert_memory_equal(p, "data: ", 6);
    const char *e = strstr(p, "\n\n");
    assert_non_null(e);
    assert_true(n < max);
    docs[n++] = parse_json(p + 6, (size_t)(e - p - 6));
    p = e + 2;
  }
  return n;
}

static void test_write_tool_calls(void **state) {
  (void)state;
  /* non-streaming: content and two calls with ids; finish_reason tool_calls */
  kiln_api_choice_t c;
  kiln_api_request_t *r = tool_request("{" MSGS ", \"tools\": [" TOOL_F "]}", &c);
  const char *reply =
      "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
      "{\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", "
      "\"arguments\": {\"city\": \"Rome\"}}\n</tool_call>";
  for (size_t i = 0, n = 0; reply[i]; i += n) {
    n = strlen(reply + i) < 3 ? strlen(reply + i) : 3;
    assert_true(kiln_api_tool_push(&c, reply + i, n, reply[i + n] == 0));
  }
  c.finish = KILN_FINISH_STOP;
  assert_int_equal(kiln_api_tool_num_calls(&c), 2);
  kiln_api_response_t resp = {r, "chatcmpl-1", "tiny", 42, {3, 40, 0}};
  kiln_strbuf_t out = KILN_STRBUF_INIT;
  kiln_api_write_response(&out, &resp, &c, 1);
  kiln_json_doc_t *doc = parse_json(out.data, out.len);
  const kiln_json_t *root = kiln_json_root(doc);
  assert_string_equal(kiln_json_string(path(root, "choices.0.finish_reason"), NULL), "tool_calls");
  assert_string_equal(kiln_json_string(path(root, "choices.0.message.content"), NULL),
                      "Let me look.");
  const kiln_json_t *tc = path(root, "choices.0.message.tool_calls");
  assert_int_equal(kiln_json_len(tc), 2);
  assert_string_equal(kiln_json_string(path(tc, "0.type"), NULL), "function");
  assert_string_equal(kiln_json_string(path(tc, "0.function.name"), NULL), "get_weather");
  assert_string_equal(kiln_json_string(path(tc, "1.function.arguments"), NULL),
                      "{\"city\": \"Rome\"}");
  const char *id0 = kiln_json_string(path(tc, "0.id"), NULL);
  assert_int_equal(strlen(id0), 29);
  assert_memory_equal(id0, "call_", 5);
  assert_string_not_equal(id0, kiln_json_string(path(tc, "1.id"), NULL));
  kiln_json_doc_free(doc);
  kiln_strbuf_reset(&out);
  kiln_api_choice_free(&c);
  kiln_api_request_free(r);

  /* streaming: role, content, then per call a header (id, type, name, arguments "") and its
   * arguments, then the finish reason; parallel_tool_calls false keeps the first call only */
  r = tool_request(
      "{" MSGS ", \"stream\": true, \"parallel_tool_calls\": false, \"tools\": [" TOOL_F "]}", &c);
  resp.req = r;
  kiln_api_write_chunk(&out, &resp, &c, false); /* the role */
  assert_true(kiln_api_tool_push(&c, reply, strlen(reply), true));
  assert_int_equal(kiln_api_tool_num_calls(&c), 1);
  do {
    kiln_api_write_chunk(&out, &resp, &c, false);
  } while (kiln_api_tool_delta_pending(&c));
  c.finish = KILN_FINISH_STOP;
  kiln_api_write_chunk(&out, &resp, &c, false);
  kiln_json_doc_t *docs[8];
  int n = events(out.data, docs, 8);
  assert_int_equal(n, 4);
  root = kiln_json_root(docs[0]);
  assert_string_equal(kiln_json_string(path(root, "choices.0.delta.role"), NULL), "assistant");
  root = kiln_json_root(docs[1]); /* the content, and the first call's header */
  assert_string_equal(kiln_json_string(path(root, "choices.0.delta.content"), NULL),
                      "Let me look.");
  tc = path(root, "choices.0.delta.tool_calls");
  assert_int_equal(kiln_json_len(tc), 1);
  assert_true(kiln_json_number(path(tc, "0.index")) == 0);
  assert_memory_equal(kiln_json_string(path(tc, "0.id"), NULL), "call_", 5);
  assert_string_equal(kiln_json_string(path(tc, "0.type"), NULL), "function");
  assert_string_equal(kiln_json_string(path(tc, "0.function.name"), NULL), "get_weather");
  assert_string_equal(kiln_json_string(path(tc, "0.function.arguments"), NULL), "");
  root = kiln_json_root(docs[2]);
  tc = path(root, "choices.0.delta.tool_calls");
  assert_null(path(tc, "0.id"));
  assert_null(path(tc, "0.function.name"));
  assert_string_equal(kiln_json_string(path(tc, "0.function.arguments"), NULL),
                      "{\"city\": \"Paris\"}");
  assert_true(kiln_json_is(path(root, "choices.0.finish_reason"), KILN_JSON_NULL));
  root = kiln_json_root(docs[3]);
  assert_string_equal(kiln_json_string(path(root, "choices.0.finish_reason"), NULL), "tool_calls");
  assert_null(path(root, "choices.0.delta.tool_calls"));
  for (int i = 0; i < n; i++) kiln_json_doc_free(docs[i]);
  kiln_strbuf_reset(&out);
  kiln_api_choice_free(&c);
  kiln_api_request_free(r);

  /* a named function: the reply is the arguments, streamed as fragments after the header */
  r = tool_request("{" MSGS ", \"stream\": true, \"tools\": [" TOOL_F
                   "], \"tool_choice\": "
                   "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\"}}}",
                   &c);
  resp.req = r;
  kiln_api_write_chunk(&out, &resp, &c, false); /* the role and the header */
  assert_true(kiln_api_tool_push(&c, "{\"city\":", 8, false));
  kiln_api_write_chunk(&out, &resp, &c, false);
  assert_true(kiln_api_tool_push(&c, " \"Oslo\"}", 8, true));
  kiln_api_write_chunk(&out, &resp, &c, false);
  assert_false(kiln_api_tool_delta_pending(&c));
  c.finish = KILN_FINISH_STOP;
  kiln_api_write_chunk(&out, &resp, &c, false);
  n = events(out.data, docs, 8);
  assert_int_equal(n, 4);
  root = kiln_json_root(docs[0]);
  assert_string_equal(kiln_json_string(path(root, "choices.0.delta.role"), NULL), "assistant");
  assert_string_equal(
      kiln_json_string(path(root, "choices.0.delta.tool_calls.0.function.name"), NULL),
      "get_weather");
  assert_string_equal(
      kiln_json_string(path(root, "choices.0.delta.tool_calls.0.function.arguments"), NULL), "");
  assert_string_equal(
      kiln_json_string(
          path(kiln_json_root(docs[1]), "choices.0.delta.tool_calls.0.function.arguments"), NULL),
      "{\"city\":");
  assert_string_equal(
      kiln_json_string(
          path(kiln_json_root(docs[2]), "choices.0.delta.tool_calls.0.function.arguments"), NULL),
      " \"Oslo\"}");
  assert_string_equal(
      kiln_json_string(path(kiln_json_root(docs[3]), "choices.0.finish_reason"), NULL),
      "tool_calls");
  for (int i = 0; i < n; i++) kiln_json_doc_free(docs[i]);
  kiln_strbuf_reset(&out);
  /* ... and whole: the arguments re-serialised, no content */
  kiln_api_write_response(&out, &resp, &c, 1);
  doc = parse_json(out.data, out.len);
  root = kiln_json_root(doc);
  assert_true(kiln_json_is(path(root, "choices.0.message.content"), KILN_JSON_NULL));
  assert_string_equal(
      kiln_json_string(path(root, "choices.0.message.tool_calls.0.function.arguments"), NULL),
      "{\"city\": \"Oslo\"}");
  kiln_json_doc_free(doc);
  kiln_strbuf_reset(&out);
  kiln_api_choice_free(&c);
  kiln_api_request_free(r);

  /* tool_choice required: the constrained reply is a JSON array of {name, parameters} */
  r = parse_ok(KILN_API_CHAT, "{" MSGS ", \"tools\": [" TOOL_F ", " TOOL_G
                              "], "
                              "\"tool_choice\": \"required\"}");
  resp.req = r;
  {
    kiln_api_error_t err;
    assert_true(kiln_api_tools_prepare(r, k_hermes_tpl, strlen(k_hermes_tpl), true, "auto", &err));
  }
  memset(&c, 0, sizeof(c));
  c.stop_token = -1;
  assert_true(kiln_api_tool_state_init(&c, r));
  const char *arr =
      "[{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}, "
      "{\"name\": \"now\", \"parameters\": {}}]";
  assert_true(kiln_api_tool_push(&c, arr, 20, false));
  assert_true(kiln_api_tool_push(&c, arr + 20, strlen(arr) - 20, true));
  c.finish = KILN_FINISH_STOP;
  kiln_api_write_response(&out, &resp, &c, 1);
  doc = parse_json(out.data, out.len);
  root = kiln_json_root(doc);
  assert_string_equal(kiln_json_string(path(root, "choices.0.finish_reason"), NULL), "tool_calls");
  assert_true(kiln_json_is(path(root, "choices.0.message.content"), KILN_JSON_NULL));
  assert_string_equal(
      kiln_json_string(path(root, "choices.0.message.tool_calls.0.function.arguments"), NULL),
      "{\"city\": \"Rome\"}");
  assert_string_equal(
      kiln_json_string(path(root, "choices.0.message.tool_calls.1.function.name"), NULL), "now");
  kiln_json_doc_free(doc);
  kiln_strbuf_reset(&out);
  kiln_api_choice_free(&c);
  kiln_api_request_free(r);

  /* a reply cut short (length): no calls, the text as content, finish_reason length */
  r = tool_request("{" MSGS ", \"tools\": [" TOOL_F "]}", &c);
  resp.req = r;
  assert_true(kiln_api_tool_push(&c, "<tool_call>{\"name\": \"get_w", 27, true));
  c.finish = KILN_FINISH_LENGTH;
  kiln_api_write_response(&out, &resp, &c, 1);
  doc = parse_json(out.data, out.len);
  root = kiln_json_root(doc);
  assert_string_equal(kiln_json_string(path(root, "choices.0.finish_reason"), NULL), "length");
  assert_string_equal(kiln_json_string(path(root, "choices.0.message.content"), NULL),
                      "<tool_call>{\"name\": \"get_w");
  assert_null(path(root, "choices.0.message.tool_calls"));
  kiln_json_doc_free(doc);
  kiln_strbuf_free(&out);
  kiln_api_choice_free(&c);
  kiln_api_request_free(r);
}

static void test_write_error(void **state) {
  (void)state;
  kiln_api_error_t e;
  kiln_api_error_set(&e, 400, "invalid_request_error", "max_tokens", "max_tokens: bad \"%d\"", 3);
  kiln_strbuf_t out = KILN_STRBUF_INIT;
  kiln_api_write_error(&out, &e);
  kiln_json_doc_t *doc = parse_json(out.data, out.len);
  const kiln_json_t *root = kiln_json_root(doc);
  assert_string_equal(kiln_json_string(path(root, "error.message"), NULL), "max_tokens: bad \"3\"");
  assert_string_equal(kiln_json_string(path(root, "error.type"), NULL), "invalid_request_error");
  assert_string_equal(kiln_json_string(path(root, "error.param"), NULL), "max_tokens");
  assert_true(kiln_json_number(path(root, "error.code")) == 400);
  kiln_json_doc_free(doc);
  kiln_strbuf_free(&out);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_completion_defaults), cmocka_unit_test(test_every_field),
      cmocka_unit_test(test_field_errors),        cmocka_unit_test(test_messages_normalized),
      cmocka_unit_test(test_beam_fields),
      cmocka_unit_test(test_image_parts),         cmocka_unit_test(test_base64),
      cmocka_unit_test(test_write_completion),    cmocka_unit_test(test_write_chat_stream),
      cmocka_unit_test(test_tools_parse),         cmocka_unit_test(test_tools_prepare),
      cmocka_unit_test(test_write_tool_calls),    cmocka_unit_test(test_write_error),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
