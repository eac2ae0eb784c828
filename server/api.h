/* api.h - the OpenAI-compatible request and response formats: parsing a request body into
 * engine parameters, and writing completion objects, stream chunks and error bodies.
 *
 * Parsing needs no engine (so a fuzzer can drive it alone): it checks types and ranges and
 * names the field in its error, the way OpenAI's API does ("max_tokens: must be a non-negative
 * integer, got -1"). Unknown fields are ignored, as OpenAI does. The result owns every string
 * and array it holds; kiln_api_request_free releases it.
 *
 * Writing works on a kiln_api_choice_t per choice (its text, tokens and logprobs so far), so the
 * server can build a whole response or one chunk of a stream from the same state.
 *
 * Thread-safety: no shared state; any number of threads may parse and write at once.
 */
#ifndef KILN_SERVER_API_H
#define KILN_SERVER_API_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/json.h"
#include "base/strbuf.h"
#include "kiln/kiln.h"

typedef enum kiln_api_kind {
  KILN_API_COMPLETIONS = 0, /* POST /v1/completions */
  KILN_API_CHAT = 1,        /* POST /v1/chat/completions */
  KILN_API_TOKENIZE = 2,    /* POST /tokenize */
  KILN_API_DETOKENIZE = 3,  /* POST /detokenize */
} kiln_api_kind_t;

/* A parse error: the HTTP status, OpenAI's error type, the offending field (or NULL). */
typedef struct kiln_api_error {
  int status;
  const char *type; /* "invalid_request_error", "not_found_error", ... (static) */
  char param[64];   /* the field, "" when none */
  char message[512];
} kiln_api_error_t;

/* One prompt of a completions request: text, or token ids. */
typedef struct kiln_api_prompt {
  char *text; /* NUL-terminated, or NULL */
  size_t text_len;
  int32_t *ids; /* when text is NULL */
  int32_t num_ids;
} kiln_api_prompt_t;

/* Limits the parser checks against (from the engine, or fixed ones in a fuzzer). */
typedef struct kiln_api_limits {
  int32_t max_n;            /* most sequences per prompt (max_num_seqs) */
  int32_t max_prompts;      /* most prompts in one completions request */
  int32_t max_stop;         /* most stop strings */
  int32_t max_logprobs;     /* top logprobs, at most 20 */
  int32_t vocab_size;       /* logit_bias / stop_token_ids / prompt ids must be below it */
  int32_t max_images;       /* image parts per request; 0 = the model takes text only */
  size_t max_image_bytes;   /* a data URL's decoded bytes at most */
  bool allow_remote_images; /* http(s):// image URLs are accepted (to be fetched) */
} kiln_api_limits_t;

/* One image of a chat request, from an {"type": "image_url", "image_url": {"url": ...}} part of
 * messages[message].content[part]: a data URL's decoded bytes, or an http(s) URL to fetch. */
typedef struct kiln_api_image {
  int32_t message, part;
  unsigned char *data; /* owned; NULL for a remote URL */
  size_t size;
  char *url; /* owned; NULL for a data URL */
} kiln_api_image_t;

/* chat: how the reply may call the request's tools (server/tools.h) */
typedef enum kiln_api_tool_choice {
  KILN_API_TOOL_AUTO = 0, /* the default: the model may call tools; its calls are parsed */
  KILN_API_TOOL_NONE,     /* tools are shown, the reply is text */
  KILN_API_TOOL_REQUIRED, /* at least one call, held to the tools' schemas */
  KILN_API_TOOL_NAMED,    /* exactly one call of tool_name, arguments held to its schema */
} kiln_api_tool_choice_t;

typedef struct kiln_api_request {
  kiln_api_kind_t kind;
  char *model; /* NULL when not given */
  char *user;
  bool stream;
  bool include_usage;    /* stream_options.include_usage */
  bool continuous_usage; /* stream_options.continuous_usage_stats (vLLM): usage per chunk */
  bool echo;             /* completions: the prompt comes back before the completion */
  bool max_tokens_given; /* max_tokens or max_completion_tokens was set */
  /* completions: one or more prompts; tokenize: one */
  kiln_api_prompt_t *prompts;
  int32_t num_prompts;
  /* chat (and tokenize with messages): normalized messages, tools and template variables as
   * JSON text for kiln_engine_apply_chat_template */
  char *messages_json;
  size_t messages_len;
  char *tools_json;
  size_t tools_len;
  char *template_kwargs_json;
  size_t template_kwargs_len;
  bool add_generation_prompt;
  /* chat: tool calling (server/tools.c). tools_json is NULL for no tools or an empty list. */
  int32_t num_tools;
  kiln_api_tool_choice_t tool_choice;
  char *tool_name;          /* KILN_API_TOOL_NAMED: the function */
  bool parallel_tool_calls; /* default true; false: at most one call */
  bool tools_strict;        /* a tool has "strict": true */
  char *tool_guide;         /* REQUIRED / NAMED: the JSON schema sp.guide_spec points at */
  int tool_format;          /* kiln_tool_format_t of the reply (kiln_api_tools_prepare) */
  bool tool_short_ids;      /* call ids of 9 letters and digits, as Mistral's templates want */
  /* chat: the images of the messages, in order (the messages' JSON holds {"type": "image"}
   * parts where they were, so the template writes one image placeholder for each) */
  kiln_api_image_t *images;
  int32_t num_images;
  bool add_special_tokens; /* tokenize the text prompt with the tokenizer's BOS etc. */
  /* logprobs: completions' integer logprobs k (-1 = none); chat's logprobs + top_logprobs */
  bool chat_logprobs;
  int32_t logprobs; /* -1 = none, else the number of alternatives per token */
  /* detokenize */
  int32_t *tokens;
  int32_t num_tokens;
  /* the engine's parameters; the arrays below back its pointers */
  kiln_sampling_params_t sp;
  char **stop;
  int32_t num_stop;
  int32_t *stop_token_ids;
  int32_t *bias_ids;
  float *bias_values;
  /* structured outputs: sp.guide and sp.guide_spec (this text, owned) from response_format,
   * guided_json / guided_regex / guided_choice / guided_grammar or structured_outputs;
   * guide_field names the field given, for the engine's compile errors */
  char *guide_spec;
  char guide_field[64];
} kiln_api_request_t;

/* The defaults: 256 sequences and prompts, 16 stop strings, 20 logprobs, any vocabulary, 8
 * images of at most 20 MiB each, no remote images. */
void kiln_api_limits_default(kiln_api_limits_t *l);

/* Parses a request body of the given kind. Returns true with *out_req set (owned), or false
 * with *err filled (status 400 for a malformed body, a wrong type or an out-of-range value;
 * 500 for out-of-memory) and *out_req NULL. */
bool kiln_api_parse(kiln_api_kind_t kind, const char *body, size_t len,
                    const kiln_api_limits_t *limits, kiln_api_request_t **out_req,
                    kiln_api_error_t *err);
void kiln_api_request_free(kiln_api_request_t *req);

/* Fills an error (printf-style message). */
void kiln_api_error_set(kiln_api_error_t *err, int status, const char *type, const char *param,
                        const char *fmt, ...) __attribute__((format(printf, 5, 6)));

/* Writes OpenAI's error body: {"error": {"message", "type", "param", "code"}}. */
void kiln_api_write_error(kiln_strbuf_t *out, const kiln_api_error_t *err);

/* ---- responses ---------------------------------------------------------------------------- */

/* Token text and logprob details the writer needs, per generated (or echoed prompt) token. */
typedef struct kiln_api_token {
  int32_t id;
  float logprob; /* NAN for "no logprob" (the first prompt token when echoing) */
  char *text;    /* the token on its own, decoded (owned) */
  int32_t num_top;
  int32_t *top_ids;
  float *top_logprobs;
  char **top_text; /* owned */
} kiln_api_token_t;

/* One choice's state. */
typedef struct kiln_api_choice {
  int32_t index;
  kiln_strbuf_t text;       /* everything generated so far (non-streaming) or not yet sent */
  kiln_api_token_t *tokens; /* tokens with logprobs not yet written (with logprobs only) */
  int32_t num_tokens, cap_tokens;
  size_t text_offset; /* completions logprobs' text_offset of the next token */
  bool started;       /* streaming: the first chunk (chat role, echo) went out */
  bool finish_sent;   /* streaming: the chunk with the finish reason went out */
  kiln_finish_reason_t finish;
  char *stop_str;     /* the matched stop string, or NULL */
  int32_t stop_token; /* the stop token, or -1 */
  int32_t completion_tokens;
  struct kiln_api_tool_state *tool; /* chat with tools: the reply's calls (server/tools.c) */
} kiln_api_choice_t;

void kiln_api_choice_reset_tokens(kiln_api_choice_t *c);
void kiln_api_choice_free(kiln_api_choice_t *c);
/* Appends a token (taking ownership of its strings and arrays). False on out-of-memory (the
 * token's allocations are freed then). */
bool kiln_api_choice_push_token(kiln_api_choice_t *c, kiln_api_token_t *t);
void kiln_api_token_free(kiln_api_token_t *t);

typedef struct kiln_api_response {
  const kiln_api_request_t *req;
  const char *id;    /* "cmpl-..." / "chatcmpl-..." */
  const char *model; /* the served name */
  int64_t created;   /* unix seconds */
  kiln_usage_t usage;
} kiln_api_response_t;

/* The whole non-streaming response object with every choice. */
void kiln_api_write_response(kiln_strbuf_t *out, const kiln_api_response_t *r,
                             kiln_api_choice_t *choices, int32_t num_choices);
/* One "data: {...}\n\n" stream event for a choice: what it holds now (text and token details,
 * which are consumed), with its finish reason when finished. For chat the first event of a
 * choice carries the role. with_usage adds the usage so far (continuous usage). */
void kiln_api_write_chunk(kiln_strbuf_t *out, const kiln_api_response_t *r, kiln_api_choice_t *c,
                          bool with_usage);
/* The final usage event of a stream with stream_options.include_usage (choices: []). */
void kiln_api_write_usage_chunk(kiln_strbuf_t *out, const kiln_api_response_t *r);
/* An error event inside a stream: data: {"error": {...}}. */
void kiln_api_write_stream_error(kiln_strbuf_t *out, const kiln_api_error_t *err);

/* The finish reason as the API names it ("stop", "length", "abort", "error"), or NULL. */
const char *kiln_api_finish_name(kiln_finish_reason_t f);

#endif /* KILN_SERVER_API_H */
