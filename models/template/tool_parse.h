/* tool_parse.h - tool calls in a model's output: which format a chat template teaches its model,
 * and parsing generated text into content and calls, whole or piece by piece as it streams.
 *
 * Formats (the text a model writes to call a function):
 *   hermes       Hermes, Qwen2.5, Qwen3: <tool_call>{"name": ..., "arguments": {...}}</tool_call>,
 *                any number of them, with text around them
 *   llama3_json  Llama 3.1 / 3.2: the whole reply is {"name": ..., "parameters": {...}}, optionally
 *                after <|python_tag|>; several are separated by ';'
 *   mistral      Mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...], or (newer
 *                tokenizers) [TOOL_CALLS]name[ARGS]{...}
 *   json         no marker: the whole reply is a JSON array [{"name": ..., "parameters": {...}}]
 *                (what tool_choice "required" constrains the output to)
 * In every format a call's arguments may be under "arguments" or "parameters", as an object, a
 * string holding one, or absent/null ({}).
 *
 * The result: content (the text outside calls) and calls (name, and the arguments re-serialised
 * as compact JSON text, kiln_json_write's form). Whitespace next to a call is not content, and a
 * reply of only calls has empty content. Text that starts like a call but is not a well-formed one
 * (bad JSON, no name, arguments not an object, an unterminated call) stays content, byte for byte:
 * parsing never loses text and never fails on model output (only out of memory is an error).
 *
 * Streaming: a kiln_tool_stream_t takes the text as it is generated and hands back the content
 * that can be sent now and each call once it is complete. It holds back only what may still turn
 * out to be part of a call: a tail that could be the start of a marker, whitespace that would be
 * dropped if a call followed, and a call under way. Whatever the split of the text into pieces,
 * the content and calls it produces are those of kiln_tool_parse on the whole text (that function
 * is the stream fed once).
 *
 * Ownership: calls and strings are malloc'ed and owned by the caller's kiln_tool_calls_t.
 * Thread-safety: no shared state; a stream is used by one thread at a time.
 */
#ifndef KILN_MODELS_TEMPLATE_TOOL_PARSE_H
#define KILN_MODELS_TEMPLATE_TOOL_PARSE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/status.h"
#include "base/strbuf.h"

typedef enum kiln_tool_format {
  KILN_TOOL_FORMAT_NONE = 0,
  KILN_TOOL_FORMAT_HERMES = 1,
  KILN_TOOL_FORMAT_LLAMA3_JSON = 2,
  KILN_TOOL_FORMAT_MISTRAL = 3,
  KILN_TOOL_FORMAT_JSON = 4,
} kiln_tool_format_t;

/* "none", "hermes", "llama3_json", "mistral", "json". */
const char *kiln_tool_format_name(kiln_tool_format_t f);

/* The format for a name above; false for an unknown name. */
bool kiln_tool_format_from_name(const char *name, kiln_tool_format_t *out);

/* The format a chat template's source teaches: a template that writes Mistral's [TOOL_CALLS]
 * (mistral), Hermes' <tool_call> tag (hermes), or Llama 3.1's <|python_tag|> or a
 * {"name": ..., "parameters": ...} call in a Llama 3 header layout (llama3_json); NONE when it
 * shows none of them. */
kiln_tool_format_t kiln_tool_format_detect(const char *source, size_t len);

/* Whether the format's marker is a special token (Mistral's [TOOL_CALLS], Llama's
 * <|python_tag|>) that the text keeps only when decoded with skip_special_tokens off. */
bool kiln_tool_format_marker_is_special(kiln_tool_format_t f);

typedef struct kiln_tool_call {
  char *name;      /* NUL-terminated */
  char *arguments; /* a JSON object as text, NUL-terminated */
  char id[48];     /* "" here; the caller names the call (the API's "call_...") */
} kiln_tool_call_t;

typedef struct kiln_tool_calls {
  kiln_tool_call_t *v;
  int32_t n, cap;
} kiln_tool_calls_t;

/* Appends a call (copies name and arguments). False on out-of-memory. */
bool kiln_tool_calls_add(kiln_tool_calls_t *c, const char *name, size_t name_len,
                         const char *arguments, size_t arguments_len);
void kiln_tool_calls_free(kiln_tool_calls_t *c);

/* Reads one call object, {"name": str, "arguments" | "parameters": object | str | null}, from
 * JSON text and appends it to calls with its arguments re-serialised. Returns false (calls
 * unchanged) when the text is not such an object; *oom tells out-of-memory apart. */
bool kiln_tool_call_from_json(const char *text, size_t len, kiln_tool_calls_t *calls, bool *oom);

/* Re-serialises a JSON object given as text (kiln_json_write's compact form) into out. False when
 * the text is not one JSON object (out unchanged then) or on out-of-memory (*oom set). */
bool kiln_tool_arguments_normalize(const char *text, size_t len, kiln_strbuf_t *out, bool *oom);

typedef struct kiln_tool_stream kiln_tool_stream_t;

/* A stream parser for format f (not NONE). KILN_ERR_INVALID_ARGUMENT for NONE or an unknown
 * value, OUT_OF_MEMORY. */
kiln_status_t kiln_tool_stream_create(kiln_tool_format_t f, kiln_tool_stream_t **out);
void kiln_tool_stream_free(kiln_tool_stream_t *s);

/* Feeds the next len bytes of the reply. Appends to content the text that is now known to be
 * content, and to calls each call now complete. Errors: OUT_OF_MEMORY only. */
kiln_status_t kiln_tool_stream_push(kiln_tool_stream_t *s, const char *text, size_t len,
                                    kiln_strbuf_t *content, kiln_tool_calls_t *calls);

/* The reply ended: flushes what was held (a call cut short is content). Further pushes are
 * ignored. Errors: OUT_OF_MEMORY only. */
kiln_status_t kiln_tool_stream_finish(kiln_tool_stream_t *s, kiln_strbuf_t *content,
                                      kiln_tool_calls_t *calls);

/* Calls the stream has produced so far. */
int32_t kiln_tool_stream_num_calls(const kiln_tool_stream_t *s);

/* Parses a whole reply: the stream fed once, then finished. */
kiln_status_t kiln_tool_parse(kiln_tool_format_t f, const char *text, size_t len,
                              kiln_strbuf_t *content, kiln_tool_calls_t *calls);

#endif /* KILN_MODELS_TEMPLATE_TOOL_PARSE_H */
