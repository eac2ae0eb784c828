/* tools.h - OpenAI tool calling for chat completions: the request's tools, tool_choice and
 * parallel_tool_calls; what the model's chat template needs of the messages; the reply parsed
 * into message.tool_calls (models/template/tool_parse); and the tool-call parts of responses and
 * stream chunks.
 *
 * How each tool_choice runs:
 *   auto (the default with tools)  the template shows the tools; the reply is parsed in the
 *                                  format of the template (or [server] tool_parser)
 *   none                           the template shows the tools; the reply is text, not parsed
 *   required                       constrained decoding (KILN_GUIDE_JSON_SCHEMA) to a JSON array of
 *                                  {"name", "parameters"} items, one of the tools each (at most one
 *                                  item without parallel_tool_calls), read as the calls
 *   {"type": "function", ...}      constrained to the function's parameter schema: the reply is
 *                                  the arguments of one call of that function
 *
 * Thread-safety: no shared state.
 */
#ifndef KILN_SERVER_TOOLS_H
#define KILN_SERVER_TOOLS_H

#include <stdbool.h>
#include <stddef.h>

#include "base/json.h"
#include "base/status.h"
#include "base/strbuf.h"
#include "server/api.h"

/* Parses tools, tool_choice and parallel_tool_calls of a chat (or tokenize) request body into r
 * (after the sampling fields: a guide set by those is a conflict). False with *err set (400
 * naming the field; 500 on out-of-memory). */
bool kiln_api_parse_tools(const kiln_json_t *root, kiln_api_request_t *r, kiln_api_error_t *err);

/* Readies a parsed chat (or tokenize) request for the model's chat template, given the
 * template's source (NULL when the model has none), whether it uses `tools`, and the
 * [server] tool_parser setting ("auto", or a format name):
 *   - tools for a template that never uses them: 400 on tools;
 *   - for a template in a known tool format, assistant messages' tool_calls get their
 *     arguments as objects (clients send JSON strings; the templates write objects) and their
 *     null content as "" (vLLM does the same); a bad arguments string is a 400 on messages;
 *   - chat with tool_choice auto: the format to parse the reply with (400 on tools when there
 *     is none), and skip_special_tokens off when its marker is a special token.
 * False with *err set. */
bool kiln_api_tools_prepare(kiln_api_request_t *r, const char *template_src, size_t template_len,
                            bool renders_tools, const char *tool_parser, kiln_api_error_t *err);

/* A refusal of the engine's that concerns the request's tool_choice (constrained decoding not
 * supported): fills *err (400 on tool_choice) and returns true; else false. */
bool kiln_api_tools_submit_error(const kiln_api_request_t *r, kiln_status_t st,
                                 kiln_api_error_t *err);

/* Sets up a choice's tool-call state for the request (nothing when its reply is plain text).
 * False on out-of-memory. */
bool kiln_api_tool_state_init(kiln_api_choice_t *c, const kiln_api_request_t *r);
void kiln_api_tool_state_free(kiln_api_choice_t *c);

/* Takes the next text of a choice with tool-call state: content goes to c->text, calls to the
 * state. last: the reply ended (held text is flushed). False on out-of-memory. */
bool kiln_api_tool_push(kiln_api_choice_t *c, const char *text, size_t len, bool last);

/* The calls of a choice so far (0 without tool-call state). */
int32_t kiln_api_tool_num_calls(const kiln_api_choice_t *c);

/* The choice's finish reason as the API names it: "tool_calls" for a reply that stopped by
 * itself with calls, else kiln_api_finish_name's. */
const char *kiln_api_choice_finish_name(const kiln_api_choice_t *c);

/* Non-streaming: the message's "content" and, with calls, "tool_calls" members (without braces):
 * "content": "..." | null, "tool_calls": [{"id", "type": "function", "function": {"name",
 * "arguments"}}]. */
void kiln_api_write_message_body(kiln_strbuf_t *out, const kiln_api_choice_t *c);

/* Streaming: whether a tool-call delta waits to be sent, and writing it (a "tool_calls": [...]
 * member of the delta object, after ", " with comma; consumed): first {"index", "id", "type",
 * "function":
 * {"name", "arguments": ""}}, then {"index", "function": {"arguments": fragment}}. */
bool kiln_api_tool_delta_pending(const kiln_api_choice_t *c);
void kiln_api_write_tool_delta(kiln_strbuf_t *out, kiln_api_choice_t *c, bool comma);

#endif /* KILN_SERVER_TOOLS_H */
