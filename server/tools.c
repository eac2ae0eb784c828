/* tools.c - OpenAI tool calling for chat completions (see tools.h). */
#define _GNU_SOURCE /* getrandom */
#include "server/tools.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "models/template/tool_parse.h"

/* ---- errors ---------------------------------------------------------------------------------- */

static bool bad(kiln_api_error_t *err, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static bool bad(kiln_api_error_t *err, const char *param, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char msg[sizeof(err->message)];
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  kiln_api_error_set(err, 400, "invalid_request_error", param, "%s", msg);
  return false;
}

static bool oom(kiln_api_error_t *err) {
  kiln_api_error_set(err, 500, "server_error", NULL, "out of memory");
  return false;
}

static bool absent(const kiln_json_t *v) { return !v || kiln_json_is(v, KILN_JSON_NULL); }

static const char *type_of(const kiln_json_t *v) { return kiln_json_type_name(kiln_json_type(v)); }

static char *dup_n(const char *s, size_t n) {
  char *d = malloc(n + 1);
  if (d) {
    memcpy(d, s, n);
    d[n] = 0;
  }
  return d;
}

/* ---- parsing the request --------------------------------------------------------------------- */

/* tools[i]: {"type": "function", "function": {"name": str, "description"?: str, "parameters"?:
 * object, "strict"?: bool}}. */
static bool check_tool(const kiln_json_t *t, size_t i, kiln_api_request_t *r,
                       kiln_api_error_t *err) {
  if (!kiln_json_is(t, KILN_JSON_OBJECT))
    return bad(err, "tools", "tools[%zu]: must be an object, got %s", i, type_of(t));
  const kiln_json_t *ty = kiln_json_get(t, "type");
  const char *tys = kiln_json_string(ty, NULL);
  if (!tys || strcmp(tys, "function") != 0)
    return bad(err, "tools", "tools[%zu].type: only \"function\" tools are supported, got %s", i,
               tys ? tys : type_of(ty));
  const kiln_json_t *f = kiln_json_get(t, "function");
  if (!kiln_json_is(f, KILN_JSON_OBJECT))
    return bad(err, "tools", "tools[%zu].function: must be an object, got %s", i,
               f ? type_of(f) : "nothing");
  size_t nl = 0;
  const char *name = kiln_json_string(kiln_json_get(f, "name"), &nl);
  if (!name || !nl || memchr(name, 0, nl))
    return bad(err, "tools", "tools[%zu].function.name: must be a non-empty string", i);
  const kiln_json_t *d = kiln_json_get(f, "description");
  if (!absent(d) && !kiln_json_is(d, KILN_JSON_STRING))
    return bad(err, "tools", "tools[%zu].function.description: must be a string, got %s", i,
               type_of(d));
  const kiln_json_t *p = kiln_json_get(f, "parameters");
  if (!absent(p) && !kiln_json_is(p, KILN_JSON_OBJECT))
    return bad(err, "tools", "tools[%zu].function.parameters: must be a JSON Schema object, got %s",
               i, type_of(p));
  const kiln_json_t *s = kiln_json_get(f, "strict");
  if (!absent(s) && !kiln_json_is(s, KILN_JSON_BOOL))
    return bad(err, "tools", "tools[%zu].function.strict: must be a boolean, got %s", i,
               type_of(s));
  if (kiln_json_is(s, KILN_JSON_BOOL) && kiln_json_bool(s)) r->tools_strict = true;
  return true;
}

static const kiln_json_t *tool_named(const kiln_json_t *tools, const char *name, size_t nl) {
  for (size_t i = 0; i < kiln_json_len(tools); i++) {
    size_t l = 0;
    const char *n = kiln_json_string(
        kiln_json_get(kiln_json_get(kiln_json_at(tools, i), "function"), "name"), &l);
    if (n && l == nl && !memcmp(n, name, nl)) return kiln_json_at(tools, i);
  }
  return NULL;
}

/* v written with every "$ref": "#..." inside rebased under the JSON pointer base: a schema
 * embedded at base in a larger document keeps its references into itself. */
static void write_rebased(kiln_strbuf_t *sb, const kiln_json_t *v, const char *base) {
  if (kiln_json_is(v, KILN_JSON_OBJECT)) {
    kiln_strbuf_append_char(sb, '{');
    for (size_t k = 0; k < kiln_json_len(v); k++) {
      size_t kl;
      const char *key = kiln_json_key_at(v, k, &kl);
      const kiln_json_t *x = kiln_json_value_at(v, k);
      if (k) kiln_strbuf_append_str(sb, ", ");
      kiln_json_write_string(sb, key, kl, false);
      kiln_strbuf_append_str(sb, ": ");
      size_t rl = 0;
      const char *ref = kl == 4 && !memcmp(key, "$ref", 4) ? kiln_json_string(x, &rl) : NULL;
      if (ref && rl >= 1 && ref[0] == '#' && (rl == 1 || ref[1] == '/')) {
        const size_t bl = strlen(base);
        char *r = malloc(bl + rl + 1);
        if (r) { /* out of memory: the reference as written (the compile then names it) */
          r[0] = '#';
          memcpy(r + 1, base, bl);
          memcpy(r + 1 + bl, ref + 1, rl - 1);
          kiln_json_write_string(sb, r, bl + rl, false);
        } else {
          kiln_json_write_string(sb, ref, rl, false);
        }
        free(r);
      } else {
        write_rebased(sb, x, base);
      }
    }
    kiln_strbuf_append_char(sb, '}');
  } else if (kiln_json_is(v, KILN_JSON_ARRAY)) {
    kiln_strbuf_append_char(sb, '[');
    for (size_t i = 0; i < kiln_json_len(v); i++) {
      if (i) kiln_strbuf_append_str(sb, ", ");
      write_rebased(sb, kiln_json_at(v, i), base);
    }
    kiln_strbuf_append_char(sb, ']');
  } else {
    kiln_json_write(sb, v, false, false);
  }
}

/* A function's parameter schema (an object with no properties when it has none), its "$ref"s
 * rebased under base (NULL: the schema is the document). */
static void write_params(kiln_strbuf_t *sb, const kiln_json_t *tool, const char *base) {
  const kiln_json_t *p = kiln_json_get(kiln_json_get(tool, "function"), "parameters");
  if (kiln_json_is(p, KILN_JSON_OBJECT) && base)
    write_rebased(sb, p, base);
  else if (kiln_json_is(p, KILN_JSON_OBJECT))
    kiln_json_write(sb, p, false, false);
  else
    kiln_strbuf_append_str(sb, "{\"type\": \"object\", \"properties\": {}}");
}

/* The schema tool_choice "required" holds the reply to: [{"name": one of the tools,
 * "parameters": that tool's schema}, ...], at least one item, at most one without
 * parallel_tool_calls. */
static void write_required_schema(kiln_strbuf_t *sb, const kiln_json_t *tools, bool parallel) {
  kiln_strbuf_append_str(sb, "{\"type\": \"array\", \"minItems\": 1, ");
  if (!parallel) kiln_strbuf_append_str(sb, "\"maxItems\": 1, ");
  kiln_strbuf_append_str(sb, "\"items\": {\"anyOf\": [");
  for (size_t i = 0; i < kiln_json_len(tools); i++) {
    const kiln_json_t *t = kiln_json_at(tools, i);
    size_t nl = 0;
    const char *name = kiln_json_string(kiln_json_get(kiln_json_get(t, "function"), "name"), &nl);
    if (i) kiln_strbuf_append_str(sb, ", ");
    kiln_strbuf_append_str(sb,
                           "{\"type\": \"object\", \"properties\": {\"name\": {\"type\": "
                           "\"string\", \"enum\": [");
    kiln_json_write_string(sb, name, nl, false);
    kiln_strbuf_append_str(sb, "]}, \"parameters\": ");
    char base[64];
    snprintf(base, sizeof(base), "/items/anyOf/%zu/properties/parameters", i);
    write_params(sb, t, base);
    kiln_strbuf_append_str(sb, "}, \"required\": [\"name\", \"parameters\"]}");
  }
  kiln_strbuf_append_str(sb, "]}}");
}

bool kiln_api_parse_tools(const kiln_json_t *root, kiln_api_request_t *r, kiln_api_error_t *err) {
  r->parallel_tool_calls = true;
  r->tool_choice = KILN_API_TOOL_AUTO;
  const kiln_json_t *ptc = kiln_json_get(root, "parallel_tool_calls");
  if (!absent(ptc)) {
    if (!kiln_json_is(ptc, KILN_JSON_BOOL))
      return bad(err, "parallel_tool_calls", "parallel_tool_calls: must be a boolean, got %s",
                 type_of(ptc));
    r->parallel_tool_calls = kiln_json_bool(ptc);
  }
  const kiln_json_t *tools = kiln_json_get(root, "tools");
  if (!absent(tools)) {
    if (!kiln_json_is(tools, KILN_JSON_ARRAY))
      return bad(err, "tools", "tools: must be a list, got %s", type_of(tools));
    size_t n = kiln_json_len(tools);
    if (n > 4096) return bad(err, "tools", "tools: at most 4096 tools, got %zu", n);
    for (size_t i = 0; i < n; i++)
      if (!check_tool(kiln_json_at(tools, i), i, r, err)) return false;
    r->num_tools = (int32_t)n;
    if (n) { /* an empty list is no tools */
      kiln_strbuf_t sb = KILN_STRBUF_INIT;
      kiln_json_write(&sb, tools, false, false);
      if (!kiln_strbuf_ok(&sb) || !(r->tools_json = kiln_strbuf_detach(&sb, &r->tools_len))) {
        kiln_strbuf_free(&sb);
        return oom(err);
      }
    }
  }
  const kiln_json_t *tc = kiln_json_get(root, "tool_choice");
  if (!absent(tc)) {
    const char *s = kiln_json_string(tc, NULL);
    if (s) {
      if (!strcmp(s, "none"))
        r->tool_choice = KILN_API_TOOL_NONE;
      else if (!strcmp(s, "auto"))
        r->tool_choice = KILN_API_TOOL_AUTO;
      else if (!strcmp(s, "required"))
        r->tool_choice = KILN_API_TOOL_REQUIRED;
      else
        return bad(err, "tool_choice",
                   "tool_choice: must be \"none\", \"auto\", \"required\" or {\"type\": "
                   "\"function\", \"function\": {\"name\": ...}}, got \"%.64s\"",
                   s);
    } else if (kiln_json_is(tc, KILN_JSON_OBJECT)) {
      const char *ty = kiln_json_string(kiln_json_get(tc, "type"), NULL);
      size_t nl = 0;
      const char *name =
          kiln_json_string(kiln_json_get(kiln_json_get(tc, "function"), "name"), &nl);
      if (!ty || strcmp(ty, "function") != 0 || !name)
        return bad(err, "tool_choice",
                   "tool_choice: an object must be {\"type\": \"function\", \"function\": "
                   "{\"name\": ...}}");
      if (!r->tools_json || !tool_named(tools, name, nl))
        return bad(err, "tool_choice", "tool_choice: the function '%.*s' is not in tools",
                   (int)(nl > 64 ? 64 : nl), name);
      r->tool_choice = KILN_API_TOOL_NAMED;
      if (!(r->tool_name = dup_n(name, nl))) return oom(err);
    } else {
      return bad(err, "tool_choice", "tool_choice: must be a string or an object, got %s",
                 type_of(tc));
    }
  }
  if (r->tool_choice == KILN_API_TOOL_REQUIRED && !r->tools_json)
    return bad(err, "tool_choice", "tool_choice: \"required\" needs tools");
  if (r->kind != KILN_API_CHAT) return true; /* /tokenize: only the tools, for the template */
  /* strict: the arguments must match the schema, which only constrained decoding promises */
  if (r->tools_strict && r->tool_choice == KILN_API_TOOL_AUTO && r->tools_json)
    return bad(err, "tools",
               "tools: \"strict\": true is not supported with tool_choice \"auto\" (the "
               "arguments of a call the model chooses to make are not constrained); use "
               "tool_choice \"required\" or a named function, whose arguments are");
  if (r->tool_choice == KILN_API_TOOL_REQUIRED || r->tool_choice == KILN_API_TOOL_NAMED) {
    if (r->sp.guide != KILN_GUIDE_NONE)
      return bad(err, "tool_choice",
                 "tool_choice: \"required\" or a named function constrains the reply, which "
                 "cannot be combined with another constraint (response_format, guided_*)");
    kiln_strbuf_t sb = KILN_STRBUF_INIT;
    if (r->tool_choice == KILN_API_TOOL_NAMED)
      write_params(&sb, tool_named(tools, r->tool_name, strlen(r->tool_name)), NULL);
    else
      write_required_schema(&sb, tools, r->parallel_tool_calls);
    size_t len = 0;
    if (!kiln_strbuf_ok(&sb) || !(r->tool_guide = kiln_strbuf_detach(&sb, &len))) {
      kiln_strbuf_free(&sb);
      return oom(err);
    }
    r->sp.guide = KILN_GUIDE_JSON_SCHEMA;
    r->sp.guide_spec = r->tool_guide;
    r->sp.guide_spec_len = len;
  }
  return true;
}

/* ---- the template's view of the messages ------------------------------------------------------
 */

/* Writes obj with member `skip` left out (kiln_json_write's form), without the closing brace;
 * returns whether anything was written. */
static bool write_members_but(kiln_strbuf_t *sb, const kiln_json_t *obj, const char *skip1,
                              const char *skip2) {
  bool any = false;
  for (size_t k = 0; k < kiln_json_len(obj); k++) {
    size_t kl;
    const char *key = kiln_json_key_at(obj, k, &kl);
    const kiln_json_t *val = kiln_json_value_at(obj, k);
    if (kiln_json_getn(obj, key, kl) != val) continue; /* a duplicate: its last value, once */
    if ((strlen(skip1) == kl && !memcmp(key, skip1, kl)) ||
        (skip2 && strlen(skip2) == kl && !memcmp(key, skip2, kl)))
      continue;
    kiln_strbuf_append_str(sb, any ? ", " : "{");
    any = true;
    kiln_json_write_string(sb, key, kl, false);
    kiln_strbuf_append_str(sb, ": ");
    kiln_json_write(sb, val, false, false);
  }
  if (!any) kiln_strbuf_append_char(sb, '{');
  return any;
}

/* An assistant message's tool_calls with every function {"name", "arguments": an object}. */
static bool write_tool_calls(kiln_strbuf_t *sb, const kiln_json_t *calls, size_t mi,
                             kiln_api_error_t *err) {
  kiln_strbuf_append_char(sb, '[');
  for (size_t j = 0; j < kiln_json_len(calls); j++) {
    const kiln_json_t *tc = kiln_json_at(calls, j);
    if (!kiln_json_is(tc, KILN_JSON_OBJECT))
      return bad(err, "messages", "messages[%zu].tool_calls[%zu]: must be an object, got %s", mi, j,
                 type_of(tc));
    const kiln_json_t *f = kiln_json_get(tc, "function");
    if (!kiln_json_is(f, KILN_JSON_OBJECT))
      return bad(err, "messages", "messages[%zu].tool_calls[%zu].function: must be an object", mi,
                 j);
    if (!kiln_json_is(kiln_json_get(f, "name"), KILN_JSON_STRING))
      return bad(err, "messages", "messages[%zu].tool_calls[%zu].function.name: must be a string",
                 mi, j);
    if (j) kiln_strbuf_append_str(sb, ", ");
    bool any = write_members_but(sb, tc, "function", NULL);
    /* the function as OpenAI defines it, {"name", "arguments"}: members a client library adds
     * (the openai SDK's runner keeps "parsed_arguments") are not for the template */
    kiln_strbuf_append_str(sb, any ? ", \"function\": {\"name\": " : "\"function\": {\"name\": ");
    kiln_json_write(sb, kiln_json_get(f, "name"), false, false);
    kiln_strbuf_append_str(sb, ", \"arguments\": ");
    const kiln_json_t *a = kiln_json_get(f, "arguments");
    size_t al = 0;
    const char *as = kiln_json_string(a, &al);
    bool mem = false;
    if (absent(a) || (as && al == 0)) {
      kiln_strbuf_append_str(sb, "{}"); /* none given: no arguments */
    } else if (kiln_json_is(a, KILN_JSON_OBJECT)) {
      kiln_json_write(sb, a, false, false);
    } else if (!as || !kiln_tool_arguments_normalize(as, al, sb, &mem)) {
      if (mem) return oom(err);
      return bad(err, "messages",
                 "messages[%zu].tool_calls[%zu].function.arguments: must be a JSON object, or a "
                 "string holding one",
                 mi, j);
    }
    kiln_strbuf_append_str(sb, "}}");
  }
  kiln_strbuf_append_char(sb, ']');
  return true;
}

/* Rewrites r->messages_json: in messages with tool_calls, arguments become objects and a null or
 * missing content "". */
static bool normalize_messages(kiln_api_request_t *r, kiln_api_error_t *err) {
  kiln_json_doc_t *doc = NULL;
  kiln_status_t st = kiln_json_parse(r->messages_json, r->messages_len, "messages", &doc);
  if (st) {
    kiln_status_free(st);
    return oom(err); /* the parser wrote valid JSON: only memory can fail */
  }
  const kiln_json_t *m = kiln_json_root(doc);
  kiln_strbuf_t sb = KILN_STRBUF_INIT;
  kiln_strbuf_append_char(&sb, '[');
  bool ok = true;
  for (size_t i = 0; ok && i < kiln_json_len(m); i++) {
    const kiln_json_t *msg = kiln_json_at(m, i);
    const kiln_json_t *calls = kiln_json_get(msg, "tool_calls");
    if (i) kiln_strbuf_append_str(&sb, ", ");
    if (!kiln_json_is(calls, KILN_JSON_ARRAY)) {
      kiln_json_write(&sb, msg, false, false);
      continue;
    }
    const kiln_json_t *content = kiln_json_get(msg, "content");
    bool any = write_members_but(&sb, msg, "tool_calls", absent(content) ? "content" : NULL);
    if (absent(content)) {
      kiln_strbuf_append_str(&sb, any ? ", \"content\": \"\"" : "\"content\": \"\"");
      any = true;
    }
    kiln_strbuf_append_str(&sb, any ? ", \"tool_calls\": " : "\"tool_calls\": ");
    ok = write_tool_calls(&sb, calls, i, err);
    kiln_strbuf_append_char(&sb, '}');
  }
  kiln_strbuf_append_char(&sb, ']');
  kiln_json_doc_free(doc);
  if (!ok) {
    kiln_strbuf_free(&sb);
    return false;
  }
  size_t len = 0;
  char *text = kiln_strbuf_ok(&sb) ? kiln_strbuf_detach(&sb, &len) : NULL;
  kiln_strbuf_free(&sb);
  if (!text) return oom(err);
  free(r->messages_json);
  r->messages_json = text;
  r->messages_len = len;
  return true;
}

bool kiln_api_tools_prepare(kiln_api_request_t *r, const char *src, size_t src_len,
                            bool renders_tools, const char *tool_parser, kiln_api_error_t *err) {
  r->tool_format = KILN_TOOL_FORMAT_NONE;
  if (!src) return true; /* no chat template: rendering says so */
  if (r->tools_json && !renders_tools)
    return bad(err, "tools",
               "tools: the model's chat template does not render tools (it never uses the "
               "`tools` variable), so the model cannot be told about them");
  kiln_tool_format_t tf = kiln_tool_format_detect(src, src_len);
  r->tool_short_ids = tf == KILN_TOOL_FORMAT_MISTRAL;
  if (tf != KILN_TOOL_FORMAT_NONE && r->messages_json &&
      memmem(r->messages_json, r->messages_len, "\"tool_calls\"", 12) &&
      !normalize_messages(r, err))
    return false;
  if (r->kind != KILN_API_CHAT || !r->tools_json) return true;
  switch (r->tool_choice) {
    case KILN_API_TOOL_NONE:
    case KILN_API_TOOL_NAMED: return true;
    case KILN_API_TOOL_REQUIRED: r->tool_format = KILN_TOOL_FORMAT_JSON; return true;
    case KILN_API_TOOL_AUTO: break;
  }
  kiln_tool_format_t pf = tf;
  if (tool_parser && strcmp(tool_parser, "auto") != 0 &&
      !kiln_tool_format_from_name(tool_parser, &pf))
    pf = KILN_TOOL_FORMAT_NONE;
  if (pf == KILN_TOOL_FORMAT_NONE) {
    if (tool_parser && !strcmp(tool_parser, "none"))
      return bad(err, "tools",
                 "tools: this server does not parse tool calls ([server] tool_parser = none): "
                 "send tool_choice \"none\", \"required\" or a named function");
    return bad(err, "tools",
               "tools: the model's chat template uses none of the tool-call formats Kiln parses "
               "(hermes <tool_call>, llama3_json, mistral [TOOL_CALLS]): set [server] "
               "tool_parser, or send tool_choice \"none\", \"required\" or a named function");
  }
  r->tool_format = pf;
  if (kiln_tool_format_marker_is_special(pf)) r->sp.skip_special_tokens = false;
  return true;
}

bool kiln_api_tools_submit_error(const kiln_api_request_t *r, kiln_status_t st,
                                 kiln_api_error_t *err) {
  if (!r->tool_guide || kiln_status_code(st) != KILN_ERR_UNSUPPORTED) return false;
  bad(err, "tool_choice",
      "tool_choice: %s needs constrained decoding, which this engine does not support (%s)",
      r->tool_choice == KILN_API_TOOL_NAMED ? "a named function" : "\"required\"",
      kiln_status_message(st));
  return true;
}

/* ---- the reply ------------------------------------------------------------------------------- */

struct kiln_api_tool_state {
  bool named;
  bool parallel;
  bool short_ids;
  kiln_tool_stream_t *parser; /* auto, required */
  kiln_tool_calls_t calls;
  int32_t sent; /* streaming: deltas out, two per call (its header, its arguments) */
  /* named */
  const char *name; /* the request's */
  char id[48];
  kiln_strbuf_t raw;
  size_t raw_sent;
  bool header_sent, done;
};

/* "call_" and 24 letters and digits, or 9 of them for Mistral's templates. */
static void make_id(bool short_id, char *out, size_t size) {
  static const char an[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  unsigned char b[24];
  if (getrandom(b, sizeof(b), 0) != (ssize_t)sizeof(b)) {
    static atomic_uint_fast64_t ctr;
    uint64_t x = atomic_fetch_add(&ctr, 1) + (uint64_t)time(NULL) * 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < sizeof(b); i++, x = x * 6364136223846793005ull + 1442695040888963407ull)
      b[i] = (unsigned char)(x >> 56);
  }
  size_t n = short_id ? 9 : 24, o = 0;
  if (!short_id) o = (size_t)snprintf(out, size, "call_");
  for (size_t i = 0; i < n && o + 1 < size; i++) out[o++] = an[b[i] % 62];
  out[o] = 0;
}

bool kiln_api_tool_state_init(kiln_api_choice_t *c, const kiln_api_request_t *r) {
  c->tool = NULL;
  bool named = r->kind == KILN_API_CHAT && r->tools_json && r->tool_choice == KILN_API_TOOL_NAMED;
  if (!named && r->tool_format == KILN_TOOL_FORMAT_NONE) return true;
  struct kiln_api_tool_state *t = calloc(1, sizeof(*t));
  if (!t) return false;
  t->named = named;
  t->parallel = r->parallel_tool_calls;
  t->short_ids = r->tool_short_ids;
  if (named) {
    t->name = r->tool_name;
    make_id(t->short_ids, t->id, sizeof(t->id));
  } else {
    kiln_status_t st = kiln_tool_stream_create((kiln_tool_format_t)r->tool_format, &t->parser);
    if (st) {
      kiln_status_free(st);
      free(t);
      return false;
    }
  }
  c->tool = t;
  return true;
}

void kiln_api_tool_state_free(kiln_api_choice_t *c) {
  struct kiln_api_tool_state *t = c->tool;
  if (!t) return;
  kiln_tool_stream_free(t->parser);
  kiln_tool_calls_free(&t->calls);
  kiln_strbuf_free(&t->raw);
  free(t);
  c->tool = NULL;
}

bool kiln_api_tool_push(kiln_api_choice_t *c, const char *text, size_t len, bool last) {
  struct kiln_api_tool_state *t = c->tool;
  if (t->named) {
    if (t->done) return true;
    if (len && !kiln_strbuf_append(&t->raw, text, len)) return false;
    if (!last) return true;
    t->done = true;
    if (!t->raw.len) return true; /* nothing came (cancelled): no call */
    kiln_strbuf_t args = KILN_STRBUF_INIT;
    bool mem = false;
    bool ok = kiln_tool_arguments_normalize(t->raw.data, t->raw.len, &args, &mem);
    if (mem) return false;
    /* cut short (length): the text as it came, which finish_reason "length" explains */
    const char *a = ok ? kiln_strbuf_cstr(&args) : t->raw.data;
    size_t al = ok ? args.len : t->raw.len;
    ok = kiln_tool_calls_add(&t->calls, t->name, strlen(t->name), a, al);
    kiln_strbuf_free(&args);
    if (!ok) return false;
    memcpy(t->calls.v[0].id, t->id, sizeof(t->id));
    return true;
  }
  int32_t before = t->calls.n;
  kiln_status_t st = kiln_tool_stream_push(t->parser, text, len, &c->text, &t->calls);
  if (!st && last) st = kiln_tool_stream_finish(t->parser, &c->text, &t->calls);
  if (st) {
    kiln_status_free(st);
    return false;
  }
  /* without parallel_tool_calls only the first call stands (as vLLM does) */
  while (!t->parallel && t->calls.n > 1) {
    t->calls.n--;
    free(t->calls.v[t->calls.n].name);
    free(t->calls.v[t->calls.n].arguments);
  }
  for (int32_t i = before; i < t->calls.n; i++)
    make_id(t->short_ids, t->calls.v[i].id, sizeof(t->calls.v[i].id));
  return true;
}

int32_t kiln_api_tool_num_calls(const kiln_api_choice_t *c) {
  return c->tool ? c->tool->calls.n : 0;
}

const char *kiln_api_choice_finish_name(const kiln_api_choice_t *c) {
  if (c->finish == KILN_FINISH_STOP && kiln_api_tool_num_calls(c) > 0) return "tool_calls";
  return kiln_api_finish_name(c->finish);
}

static void write_str(kiln_strbuf_t *o, const char *s) {
  kiln_json_write_string(o, s, strlen(s), false);
}

void kiln_api_write_message_body(kiln_strbuf_t *out, const kiln_api_choice_t *c) {
  int32_t n = kiln_api_tool_num_calls(c);
  kiln_strbuf_append_str(out, "\"content\": ");
  if (n && !c->text.len)
    kiln_strbuf_append_str(out, "null");
  else
    kiln_json_write_string(out, kiln_strbuf_cstr(&c->text), c->text.len, false);
  if (!n) return;
  kiln_strbuf_append_str(out, ", \"tool_calls\": [");
  for (int32_t i = 0; i < n; i++) {
    const kiln_tool_call_t *k = &c->tool->calls.v[i];
    kiln_strbuf_append_str(out, i ? ", {\"id\": " : "{\"id\": ");
    write_str(out, k->id);
    kiln_strbuf_append_str(out, ", \"type\": \"function\", \"function\": {\"name\": ");
    write_str(out, k->name);
    kiln_strbuf_append_str(out, ", \"arguments\": ");
    write_str(out, k->arguments);
    kiln_strbuf_append_str(out, "}}");
  }
  kiln_strbuf_append_char(out, ']');
}

bool kiln_api_tool_delta_pending(const kiln_api_choice_t *c) {
  const struct kiln_api_tool_state *t = c->tool;
  if (!t) return false;
  if (t->named) return !t->header_sent || t->raw.len > t->raw_sent;
  return t->sent < 2 * t->calls.n;
}

static void write_header(kiln_strbuf_t *o, bool comma, int32_t index, const char *id,
                         const char *name) {
  kiln_strbuf_printf(o, "%s\"tool_calls\": [{\"index\": %d, \"id\": ", comma ? ", " : "", index);
  write_str(o, id);
  kiln_strbuf_append_str(o, ", \"type\": \"function\", \"function\": {\"name\": ");
  write_str(o, name);
  kiln_strbuf_append_str(o, ", \"arguments\": \"\"}}]");
}

static void write_fragment(kiln_strbuf_t *o, bool comma, int32_t index, const char *s, size_t n) {
  kiln_strbuf_printf(o, "%s\"tool_calls\": [{\"index\": %d, \"function\": {\"arguments\": ",
                     comma ? ", " : "", index);
  kiln_json_write_string(o, s, n, false);
  kiln_strbuf_append_str(o, "}}]");
}

void kiln_api_write_tool_delta(kiln_strbuf_t *out, kiln_api_choice_t *c, bool comma) {
  struct kiln_api_tool_state *t = c->tool;
  if (!kiln_api_tool_delta_pending(c)) return;
  if (t->named) {
    if (!t->header_sent) {
      write_header(out, comma, 0, t->id, t->name);
      t->header_sent = true;
    } else {
      write_fragment(out, comma, 0, t->raw.data + t->raw_sent, t->raw.len - t->raw_sent);
      t->raw_sent = t->raw.len;
    }
    return;
  }
  int32_t k = t->sent / 2;
  const kiln_tool_call_t *call = &t->calls.v[k];
  if (t->sent % 2 == 0)
    write_header(out, comma, k, call->id, call->name);
  else
    write_fragment(out, comma, k, call->arguments, strlen(call->arguments));
  t->sent++;
}
