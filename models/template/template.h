/* template.h - chat templates: a Jinja2 subset interpreter that renders prompts exactly as
 * Hugging Face transformers' apply_chat_template does, and the loader for the templates a
 * tokenizer directory ships.
 *
 * The language is Jinja2 as transformers configures it: ImmutableSandboxedEnvironment with
 * trim_blocks and lstrip_blocks on, autoescape off, the loopcontrols extension, the
 * {% generation %} tag, and the globals raise_exception(msg) and strftime_now(fmt). Values follow
 * Python semantics (str() and repr() of floats, lists and dicts, code-point string indexing).
 * The sandbox's immutability holds: list.append, dict.update and the like are errors, as there.
 *
 * Errors: every failure is a status whose message starts with "<name>:<line>: " (the template's
 * name and the template line), e.g. "chat_template:12: unknown filter 'frobnicate'".
 * raise_exception(msg) yields KILN_ERR_INVALID_ARGUMENT with msg after that prefix. A hostile
 * template cannot crash the process: nesting depth, loop iterations, output size and memory are
 * bounded (kiln_template_limits_t) and exceeding a bound is an error.
 *
 * Ownership: compile returns an owned template; render borrows the template and every JSON node
 * it is given and appends to a caller-owned buffer. Thread-safety: a compiled template is
 * immutable; any number of threads may render it at once (each render has its own state).
 */
#ifndef KILN_MODELS_TEMPLATE_TEMPLATE_H
#define KILN_MODELS_TEMPLATE_TEMPLATE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/json.h"
#include "base/status.h"
#include "base/strbuf.h"

typedef struct kiln_template kiln_template_t;

/* Bounds for one render. Zero fields take the default shown. */
typedef struct kiln_template_limits {
  size_t max_output;       /* bytes of output in any one buffer; default 64 MiB */
  size_t max_memory;       /* bytes the render may allocate in all; default 512 MiB */
  uint64_t max_iterations; /* loop iterations over the whole render; default 10,000,000 */
  int max_depth;           /* nested macro calls; default 100 */
} kiln_template_limits_t;

/* A named string variable (a special token such as bos_token). */
typedef struct kiln_template_string_var {
  const char *name;
  const char *value;
} kiln_template_string_var_t;

/* What a render sees, as transformers passes it:
 *   render(messages=..., tools=..., documents=..., add_generation_prompt=...,
 *          **special_tokens, **extra)
 * NULL JSON nodes read as Python None (messages too). Fields are borrowed for the render. */
typedef struct kiln_template_vars {
  const kiln_json_t *messages;  /* array of {"role":..., "content": str | list | null, ...} */
  const kiln_json_t *tools;     /* array or NULL */
  const kiln_json_t *documents; /* array or NULL */
  bool add_generation_prompt;
  const kiln_template_string_var_t *strings; /* bos_token, eos_token, ...; may be NULL */
  size_t n_strings;
  /* An object whose members become further variables (enable_thinking, ...). They override
   * strings of the same name but not the four fixed variables above. NULL for none. */
  const kiln_json_t *extra;
  const kiln_template_limits_t *limits; /* NULL for the defaults */
} kiln_template_vars_t;

/* Compiles len bytes of template source. name is used in error messages (copied). On error
 * *out_tpl is NULL and the status (KILN_ERR_INVALID_ARGUMENT for a syntax error, with its line,
 * or KILN_ERR_OUT_OF_MEMORY) says why. */
kiln_status_t kiln_template_compile(const char *source, size_t len, const char *name,
                                    kiln_template_t **out_tpl);

/* Renders tpl with vars and appends the result to out. On error, out holds whatever was there
 * before plus an unspecified partial result, and the status carries "<name>:<line>: ...". */
kiln_status_t kiln_template_render(const kiln_template_t *tpl, const kiln_template_vars_t *vars,
                                   kiln_strbuf_t *out);

/* The name given at compile time (borrowed). */
const char *kiln_template_name(const kiln_template_t *tpl);

/* The source text as given to compile (borrowed, NUL-terminated; *out_len its length when
 * out_len is not NULL). */
const char *kiln_template_source(const kiln_template_t *tpl, size_t *out_len);

/* Whether the template names the variable anywhere in its code (reads it, tests it, assigns
 * it, in a macro or not): "tools" tells whether a chat template can show tools to the model.
 * Text outside {{ }} and {% %} does not count. */
bool kiln_template_uses_variable(const kiln_template_t *tpl, const char *name);

/* NULL is a no-op. */
void kiln_template_free(kiln_template_t *tpl);

/* ---- chat templates of a tokenizer directory ----------------------------------------------- */

typedef struct kiln_chat_template kiln_chat_template_t;

/* Loads the chat templates of a Hugging Face tokenizer directory, with transformers' precedence:
 * a chat_template.jinja file (and additional_chat_templates/<name>.jinja files) take priority
 * over tokenizer_config.json's "chat_template", which is either a string or a list of
 * {"name": ..., "template": ...}. Special tokens (bos_token, eos_token, unk_token, pad_token,
 * sep_token, cls_token, mask_token; strings or {"content": ...} objects) come from
 * tokenizer_config.json. Every template is compiled here, so a syntax error is reported at load.
 * Errors: KILN_ERR_NOT_FOUND when the directory has no template at all, KILN_ERR_INVALID_ARGUMENT
 * for a malformed file or template, KILN_ERR_IO, KILN_ERR_OUT_OF_MEMORY. *out_ct is NULL then. */
kiln_status_t kiln_chat_template_load(const char *dir, kiln_chat_template_t **out_ct);

/* The same from the text of a tokenizer_config.json held in memory (no template files; name is
 * used in messages), as kiln_gguf_tokenizer() makes for a GGUF file. */
kiln_status_t kiln_chat_template_load_config(const char *json, size_t len, const char *name,
                                             kiln_chat_template_t **out_ct);

/* The template transformers would pick: "tool_use" when tools is a non-null value and such a
 * template exists, else "default" (the only one when the template is a plain string). NULL when
 * neither exists (the list form without "default"). Borrowed. */
const kiln_template_t *kiln_chat_template_select(const kiln_chat_template_t *ct, bool has_tools);

/* A named template, or NULL. Borrowed. */
const kiln_template_t *kiln_chat_template_get(const kiln_chat_template_t *ct, const char *name);

/* The special token strings found in tokenizer_config.json, ready for kiln_template_vars_t. */
const kiln_template_string_var_t *kiln_chat_template_strings(const kiln_chat_template_t *ct,
                                                             size_t *out_n);

/* Selects the template (as above), adds the special tokens to vars (the caller leaves
 * strings/n_strings empty) and renders. Errors as kiln_template_render, plus
 * KILN_ERR_NOT_FOUND when no template fits. */
kiln_status_t kiln_chat_template_render(const kiln_chat_template_t *ct,
                                        const kiln_template_vars_t *vars, kiln_strbuf_t *out);

void kiln_chat_template_free(kiln_chat_template_t *ct);

#endif /* KILN_MODELS_TEMPLATE_TEMPLATE_H */
