/* tool_parse.c - tool-call formats and the stream parser (see tool_parse.h).
 *
 * The parser keeps the text it has not decided on in buf and, after each push, decides as much
 * of its front as the text allows. States:
 *
 *   TEXT   content, watching for the format's start marker (hermes, mistral), or, while nothing
 *          but whitespace has come (at_start), for the start of a reply that is a call
 *          (llama3_json, json). Emits all but a tail that may begin a marker and the whitespace
 *          right before it (dropped if a call follows).
 *   CALL   a call region begins at buf[region] (buf[0, region) is the whitespace before it): the
 *          marker, then the call text from buf[body]. A hermes call ends at </tool_call>; the
 *          others at the end of their JSON value, found by a scanner that counts brackets outside
 *          strings (the value is then parsed for real). A well-formed call is taken and its
 *          region dropped; anything else is emitted as content, raw.
 *   NEXT   llama3_json after a call: whitespace and ';' separators, then another call or the
 *          rest as content.
 *   PLAIN  the rest of the reply is content.
 *
 * Every decision depends only on the text so far being a prefix of the whole, and is taken only
 * once the text settles it, so the output does not depend on how the reply is split.
 */
#define _POSIX_C_SOURCE 200809L
#include "models/template/tool_parse.h"

#include <stdlib.h>
#include <string.h>

#include "base/json.h"

static const char HERMES_START[] = "<tool_call>";
static const char HERMES_END[] = "</tool_call>";
static const char MISTRAL_START[] = "[TOOL_CALLS]";
static const char MISTRAL_ARGS[] = "[ARGS]";
static const char PYTHON_TAG[] = "<|python_tag|>";

const char *kiln_tool_format_name(kiln_tool_format_t f) {
  switch (f) {
    case KILN_TOOL_FORMAT_NONE: return "none";
    case KILN_TOOL_FORMAT_HERMES: return "hermes";
    case KILN_TOOL_FORMAT_LLAMA3_JSON: return "llama3_json";
    case KILN_TOOL_FORMAT_MISTRAL: return "mistral";
    case KILN_TOOL_FORMAT_JSON: return "json";
  }
  return "?";
}

bool kiln_tool_format_from_name(const char *name, kiln_tool_format_t *out) {
  for (int f = KILN_TOOL_FORMAT_NONE; f <= KILN_TOOL_FORMAT_JSON; f++)
    if (name && !strcmp(name, kiln_tool_format_name((kiln_tool_format_t)f))) {
      *out = (kiln_tool_format_t)f;
      return true;
    }
  return false;
}

static const char *find_n(const char *s, size_t n, const char *what) {
  size_t wl = strlen(what);
  for (size_t i = 0; wl <= n && i <= n - wl; i++)
    if (s[i] == what[0] && !memcmp(s + i, what, wl)) return s + i;
  return NULL;
}

kiln_tool_format_t kiln_tool_format_detect(const char *src, size_t len) {
  if (!src) return KILN_TOOL_FORMAT_NONE;
  if (find_n(src, len, MISTRAL_START)) return KILN_TOOL_FORMAT_MISTRAL;
  if (find_n(src, len, HERMES_START)) return KILN_TOOL_FORMAT_HERMES;
  if (find_n(src, len, PYTHON_TAG) ||
      (find_n(src, len, "\"parameters\"") && find_n(src, len, "<|start_header_id|>")))
    return KILN_TOOL_FORMAT_LLAMA3_JSON;
  return KILN_TOOL_FORMAT_NONE;
}

bool kiln_tool_format_marker_is_special(kiln_tool_format_t f) {
  return f == KILN_TOOL_FORMAT_MISTRAL || f == KILN_TOOL_FORMAT_LLAMA3_JSON;
}

/* ---- calls ----------------------------------------------------------------------------------- */

static char *dup_n(const char *s, size_t n) {
  char *d = malloc(n + 1);
  if (d) {
    if (n) memcpy(d, s, n);
    d[n] = 0;
  }
  return d;
}

bool kiln_tool_calls_add(kiln_tool_calls_t *c, const char *name, size_t name_len,
                         const char *arguments, size_t arguments_len) {
  if (c->n == c->cap) {
    int32_t cap = c->cap ? 2 * c->cap : 4;
    kiln_tool_call_t *v = realloc(c->v, (size_t)cap * sizeof(*v));
    if (!v) return false;
    c->v = v;
    c->cap = cap;
  }
  kiln_tool_call_t *t = &c->v[c->n];
  memset(t, 0, sizeof(*t));
  t->name = dup_n(name, name_len);
  t->arguments = dup_n(arguments, arguments_len);
  if (!t->name || !t->arguments) {
    free(t->name);
    free(t->arguments);
    return false;
  }
  c->n++;
  return true;
}

void kiln_tool_calls_free(kiln_tool_calls_t *c) {
  for (int32_t i = 0; i < c->n; i++) {
    free(c->v[i].name);
    free(c->v[i].arguments);
  }
  free(c->v);
  memset(c, 0, sizeof(*c));
}

/* Writes an arguments value (an object, a string holding one, or absent/null for {}) into out.
 * False when it is none of those (or on out-of-memory, with *oom set). */
static bool write_arguments(const kiln_json_t *a, kiln_strbuf_t *out, bool *oom) {
  if (!a || kiln_json_is(a, KILN_JSON_NULL)) {
    if (!kiln_strbuf_append_str(out, "{}")) *oom = true;
    return !*oom;
  }
  if (kiln_json_is(a, KILN_JSON_OBJECT)) {
    if (!kiln_json_write(out, a, false, false)) *oom = true;
    return !*oom;
  }
  size_t n;
  const char *s = kiln_json_string(a, &n);
  return s && kiln_tool_arguments_normalize(s, n, out, oom);
}

bool kiln_tool_arguments_normalize(const char *text, size_t len, kiln_strbuf_t *out, bool *oom) {
  kiln_json_doc_t *doc = NULL;
  kiln_status_t st = kiln_json_parse(text, len, "arguments", &doc);
  if (st) {
    if (kiln_status_code(st) == KILN_ERR_OUT_OF_MEMORY) *oom = true;
    kiln_status_free(st);
    return false;
  }
  bool ok = kiln_json_is(kiln_json_root(doc), KILN_JSON_OBJECT);
  if (ok && !kiln_json_write(out, kiln_json_root(doc), false, false)) *oom = true, ok = false;
  kiln_json_doc_free(doc);
  return ok;
}

/* A call object node: {"name": non-empty str without NUL, "arguments" | "parameters": ...}. */
static bool call_from_node(const kiln_json_t *o, kiln_tool_calls_t *calls, bool *oom) {
  if (!kiln_json_is(o, KILN_JSON_OBJECT)) return false;
  size_t nl = 0;
  const char *name = kiln_json_string(kiln_json_get(o, "name"), &nl);
  if (!name || !nl || memchr(name, 0, nl)) return false;
  const kiln_json_t *a = kiln_json_get(o, "arguments");
  if (!a) a = kiln_json_get(o, "parameters");
  kiln_strbuf_t args = KILN_STRBUF_INIT;
  bool ok = write_arguments(a, &args, oom);
  if (ok && !kiln_tool_calls_add(calls, name, nl, kiln_strbuf_cstr(&args), args.len))
    *oom = true, ok = false;
  kiln_strbuf_free(&args);
  return ok;
}

/* Parses text as one JSON value; NULL (with *oom set on out-of-memory) when it is not JSON. */
static kiln_json_doc_t *parse_json(const char *text, size_t len, bool *oom) {
  kiln_json_doc_t *doc = NULL;
  kiln_status_t st = kiln_json_parse(text, len, "tool call", &doc);
  if (st) {
    if (kiln_status_code(st) == KILN_ERR_OUT_OF_MEMORY) *oom = true;
    kiln_status_free(st);
    return NULL;
  }
  return doc;
}

bool kiln_tool_call_from_json(const char *text, size_t len, kiln_tool_calls_t *calls, bool *oom) {
  kiln_json_doc_t *doc = parse_json(text, len, oom);
  if (!doc) return false;
  bool ok = call_from_node(kiln_json_root(doc), calls, oom);
  kiln_json_doc_free(doc);
  return ok;
}

/* A JSON array of call objects (every one well-formed, at least one), or one call object: all
 * its calls are appended, or none. */
static bool calls_from_json(const char *text, size_t len, kiln_tool_calls_t *calls, bool *oom) {
  kiln_json_doc_t *doc = parse_json(text, len, oom);
  if (!doc) return false;
  const kiln_json_t *r = kiln_json_root(doc);
  int32_t before = calls->n;
  bool ok;
  if (kiln_json_is(r, KILN_JSON_ARRAY)) {
    size_t n = kiln_json_len(r);
    ok = n > 0;
    for (size_t i = 0; ok && i < n; i++) ok = call_from_node(kiln_json_at(r, i), calls, oom);
  } else {
    ok = call_from_node(r, calls, oom);
  }
  if (!ok)
    while (calls->n > before) {
      calls->n--;
      free(calls->v[calls->n].name);
      free(calls->v[calls->n].arguments);
    }
  kiln_json_doc_free(doc);
  return ok;
}

/* ---- the stream ------------------------------------------------------------------------------ */

enum { ST_TEXT, ST_CALL, ST_NEXT, ST_PLAIN, ST_DONE };
/* How a mistral call region reads after its marker. */
enum { MODE_UNKNOWN, MODE_JSON, MODE_NAME, MODE_ARGS };

struct kiln_tool_stream {
  kiln_tool_format_t f;
  int st;
  bool at_start;   /* llama3_json / json: only whitespace so far */
  bool after_call; /* whitespace before the next content is dropped */
  kiln_strbuf_t buf;
  /* ST_CALL */
  size_t region; /* the marker's offset in buf ([0, region) is whitespace) */
  size_t body;   /* where the call text starts */
  size_t scan;   /* how far the end search / JSON scanner got */
  int mode;
  size_t name_end; /* mistral name[ARGS]: the name is buf[body, name_end) */
  size_t json_at;  /* where the JSON value starts */
  int64_t depth;
  bool in_str, esc;
  int32_t ncalls;
  bool oom;
};

static bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

static size_t lead_ws(const char *s, size_t n) {
  size_t i = 0;
  while (i < n && is_ws(s[i])) i++;
  return i;
}

static size_t trail_ws(const char *s, size_t n) {
  size_t i = 0;
  while (i < n && is_ws(s[n - 1 - i])) i++;
  return i;
}

/* Whether s[0, n) is a prefix of what (n shorter than it). */
static bool is_prefix(const char *s, size_t n, const char *what) {
  return n < strlen(what) && !memcmp(s, what, n);
}

/* The longest suffix of s[0, n) that is a proper prefix of what. */
static size_t marker_tail(const char *s, size_t n, const char *what) {
  size_t wl = strlen(what);
  for (size_t h = wl - 1 < n ? wl - 1 : n; h > 0; h--)
    if (!memcmp(s + n - h, what, h)) return h;
  return 0;
}

static void drop(kiln_tool_stream_t *s, size_t n) {
  if (n >= s->buf.len) {
    kiln_strbuf_reset(&s->buf);
    return;
  }
  memmove(s->buf.data, s->buf.data + n, s->buf.len - n);
  s->buf.len -= n;
  s->buf.data[s->buf.len] = 0;
}

static void emit(kiln_tool_stream_t *s, size_t n, kiln_strbuf_t *content) {
  if (n > s->buf.len) n = s->buf.len;
  if (n && !kiln_strbuf_append(content, s->buf.data, n)) s->oom = true;
  drop(s, n);
}

static void start_call(kiln_tool_stream_t *s, size_t region, size_t body) {
  s->st = ST_CALL;
  s->region = region;
  s->body = s->scan = body;
  s->mode = MODE_UNKNOWN;
  s->name_end = s->json_at = 0;
  s->depth = 0;
  s->in_str = s->esc = false;
}

/* A call region ended at buf[end): taken (well-formed) or emitted as content. */
static void end_call(kiln_tool_stream_t *s, size_t end, bool taken, kiln_tool_calls_t *calls,
                     kiln_strbuf_t *content, int32_t before) {
  if (taken) {
    s->ncalls += calls->n - before;
    drop(s, end);
    s->after_call = true;
    s->st = s->f == KILN_TOOL_FORMAT_LLAMA3_JSON ? ST_NEXT
            : s->f == KILN_TOOL_FORMAT_JSON      ? ST_PLAIN
                                                 : ST_TEXT;
  } else {
    emit(s, end, content);
    s->after_call = false;
    s->st =
        s->f == KILN_TOOL_FORMAT_LLAMA3_JSON || s->f == KILN_TOOL_FORMAT_JSON ? ST_PLAIN : ST_TEXT;
  }
}

/* Advances the JSON scanner from s->scan; returns the end offset (one past the value) once the
 * value that starts at s->json_at closes, else 0. */
static size_t scan_json(kiln_tool_stream_t *s) {
  const char *b = s->buf.data;
  for (size_t i = s->scan; i < s->buf.len; i++) {
    char c = b[i];
    if (s->in_str) {
      if (s->esc)
        s->esc = false;
      else if (c == '\\')
        s->esc = true;
      else if (c == '"')
        s->in_str = false;
      continue;
    }
    if (c == '"') {
      s->in_str = true;
    } else if (c == '{' || c == '[') {
      s->depth++;
    } else if (c == '}' || c == ']') {
      if (--s->depth <= 0) {
        s->scan = i + 1;
        return i + 1;
      }
    }
  }
  s->scan = s->buf.len;
  return 0;
}

static bool is_name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '-' || c == '.';
}

/* One step in ST_CALL; returns false when it needs more text (or the reply ended: fin). */
static bool step_call(kiln_tool_stream_t *s, bool fin, kiln_strbuf_t *content,
                      kiln_tool_calls_t *calls) {
  const char *b = s->buf.data;
  const size_t n = s->buf.len;
  const int32_t before = calls->n;
  if (s->f == KILN_TOOL_FORMAT_HERMES) {
    const size_t el = sizeof(HERMES_END) - 1;
    size_t from = s->scan;
    const char *e = find_n(b + from, n - from, HERMES_END);
    if (!e) {
      s->scan = n >= s->body + el ? n - el + 1 : s->body;
      if (!fin) return false;
      /* cut short before </tool_call>: a complete call object still counts */
      size_t a = s->body + lead_ws(b + s->body, n - s->body);
      size_t z = n - trail_ws(b + a, n - a);
      bool ok = kiln_tool_call_from_json(b + a, z - a, calls, &s->oom);
      end_call(s, n, ok, calls, content, before);
      return true;
    }
    size_t at = (size_t)(e - b);
    size_t a = s->body + lead_ws(b + s->body, at - s->body);
    size_t z = at - trail_ws(b + a, at - a);
    bool ok = kiln_tool_call_from_json(b + a, z - a, calls, &s->oom);
    end_call(s, at + el, ok, calls, content, before);
    return true;
  }
  /* mistral, llama3_json, json: find where the JSON (or mistral's name) starts */
  if (s->mode == MODE_UNKNOWN) {
    size_t p = s->body + lead_ws(b + s->body, n - s->body);
    if (p == n) {
      if (fin) end_call(s, n, false, calls, content, before);
      return fin;
    }
    char c = b[p];
    if (c == '{' || (c == '[' && s->f != KILN_TOOL_FORMAT_LLAMA3_JSON)) {
      s->mode = MODE_JSON;
    } else if (s->f == KILN_TOOL_FORMAT_MISTRAL && is_name_char(c)) {
      s->mode = MODE_NAME;
    } else {
      end_call(s, p, false, calls, content, before); /* not a call: content up to here */
      return true;
    }
    s->json_at = s->scan = p;
    s->body = p;
  }
  if (s->mode == MODE_NAME) {
    size_t p = s->scan;
    while (p < n && is_name_char(b[p])) p++;
    s->scan = p;
    if (p == n) {
      if (fin) end_call(s, n, false, calls, content, before);
      return fin;
    }
    s->name_end = p;
    size_t al = sizeof(MISTRAL_ARGS) - 1;
    if (n - p < al && is_prefix(b + p, n - p, MISTRAL_ARGS)) {
      if (fin) end_call(s, n, false, calls, content, before);
      return fin;
    }
    if (n - p < al || memcmp(b + p, MISTRAL_ARGS, al) != 0) {
      end_call(s, p, false, calls, content, before);
      return true;
    }
    s->mode = MODE_ARGS;
    s->scan = p + al;
    s->json_at = 0;
  }
  if (s->mode == MODE_ARGS && !s->json_at) {
    size_t p = s->scan + lead_ws(b + s->scan, n - s->scan);
    if (p == n) {
      if (fin) end_call(s, n, false, calls, content, before);
      return fin;
    }
    if (b[p] != '{') {
      end_call(s, p, false, calls, content, before);
      return true;
    }
    s->json_at = s->scan = p;
  }
  size_t end = scan_json(s);
  if (!end) {
    if (fin) end_call(s, n, false, calls, content, before);
    return fin;
  }
  bool ok;
  if (s->mode == MODE_ARGS) {
    kiln_strbuf_t args = KILN_STRBUF_INIT;
    ok = kiln_tool_arguments_normalize(b + s->json_at, end - s->json_at, &args, &s->oom);
    if (ok && !kiln_tool_calls_add(calls, b + s->body, s->name_end - s->body,
                                   kiln_strbuf_cstr(&args), args.len))
      s->oom = true, ok = false;
    kiln_strbuf_free(&args);
  } else if (s->f == KILN_TOOL_FORMAT_LLAMA3_JSON) {
    ok = kiln_tool_call_from_json(b + s->json_at, end - s->json_at, calls, &s->oom);
  } else {
    ok = calls_from_json(b + s->json_at, end - s->json_at, calls, &s->oom);
  }
  end_call(s, end, ok, calls, content, before);
  return true;
}

/* Runs the state machine over buf as far as the text allows. */
static void run(kiln_tool_stream_t *s, bool fin, kiln_strbuf_t *content, kiln_tool_calls_t *calls) {
  for (;;) {
    if (s->oom) return;
    if (s->after_call && s->st != ST_CALL) {
      size_t k = lead_ws(s->buf.data, s->buf.len);
      drop(s, k);
      if (!s->buf.len) return;
      if (s->st != ST_NEXT) s->after_call = false;
    }
    const char *b = s->buf.data;
    const size_t n = s->buf.len;
    switch (s->st) {
      case ST_TEXT: {
        if (!n) return;
        if (s->at_start) { /* llama3_json, json: is the reply a call? */
          size_t k = lead_ws(b, n);
          if (k == n) {
            if (fin) emit(s, n, content);
            return;
          }
          s->at_start = false;
          const size_t tl = sizeof(PYTHON_TAG) - 1;
          if (s->f == KILN_TOOL_FORMAT_LLAMA3_JSON && n - k >= tl &&
              !memcmp(b + k, PYTHON_TAG, tl)) {
            start_call(s, k, k + tl);
          } else if (s->f == KILN_TOOL_FORMAT_LLAMA3_JSON && is_prefix(b + k, n - k, PYTHON_TAG) &&
                     !fin) {
            s->at_start = true;
            return;
          } else if (b[k] == '{' || (b[k] == '[' && s->f == KILN_TOOL_FORMAT_JSON)) {
            start_call(s, k, k);
          } else {
            s->st = ST_PLAIN;
          }
          continue;
        }
        const char *marker = s->f == KILN_TOOL_FORMAT_HERMES ? HERMES_START : MISTRAL_START;
        const char *m = find_n(b, n, marker);
        if (m) {
          size_t pos = (size_t)(m - b);
          size_t t = pos - trail_ws(b, pos);
          emit(s, t, content);
          start_call(s, pos - t, pos - t + strlen(marker));
          continue;
        }
        if (fin) {
          emit(s, n, content);
          return;
        }
        size_t h = marker_tail(b, n, marker);
        size_t t = n - h;
        emit(s, t - trail_ws(b, t), content);
        return;
      }
      case ST_CALL:
        if (!step_call(s, fin, content, calls)) return;
        continue;
      case ST_NEXT: { /* llama3_json after a call: separators, then a call or content */
        size_t k = lead_ws(b, n);
        if (k < n && b[k] == ';') {
          drop(s, k + 1);
          continue;
        }
        if (k == n) {
          drop(s, n);
          return;
        }
        const size_t tl = sizeof(PYTHON_TAG) - 1;
        if (n - k >= tl && !memcmp(b + k, PYTHON_TAG, tl)) {
          start_call(s, k, k + tl);
        } else if (is_prefix(b + k, n - k, PYTHON_TAG) && !fin) {
          return;
        } else if (b[k] == '{') {
          start_call(s, k, k);
        } else {
          s->after_call = true;
          s->st = ST_PLAIN;
        }
        continue;
      }
      case ST_PLAIN: emit(s, n, content); return;
      default: return;
    }
  }
}

kiln_status_t kiln_tool_stream_create(kiln_tool_format_t f, kiln_tool_stream_t **out) {
  *out = NULL;
  if (f <= KILN_TOOL_FORMAT_NONE || f > KILN_TOOL_FORMAT_JSON)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "tool parser: no such format %d", (int)f);
  kiln_tool_stream_t *s = calloc(1, sizeof(*s));
  if (!s) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "tool parser: out of memory");
  s->f = f;
  s->st = ST_TEXT;
  s->at_start = f == KILN_TOOL_FORMAT_LLAMA3_JSON || f == KILN_TOOL_FORMAT_JSON;
  *out = s;
  return NULL;
}

void kiln_tool_stream_free(kiln_tool_stream_t *s) {
  if (!s) return;
  kiln_strbuf_free(&s->buf);
  free(s);
}

static kiln_status_t stream_status(kiln_tool_stream_t *s, kiln_strbuf_t *content) {
  if (s->oom || !kiln_strbuf_ok(&s->buf) || !kiln_strbuf_ok(content)) {
    s->oom = true;
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "tool parser: out of memory");
  }
  return NULL;
}

kiln_status_t kiln_tool_stream_push(kiln_tool_stream_t *s, const char *text, size_t len,
                                    kiln_strbuf_t *content, kiln_tool_calls_t *calls) {
  if (s->st == ST_DONE || s->oom) return stream_status(s, content);
  if (len && !kiln_strbuf_append(&s->buf, text, len)) s->oom = true;
  run(s, false, content, calls);
  return stream_status(s, content);
}

kiln_status_t kiln_tool_stream_finish(kiln_tool_stream_t *s, kiln_strbuf_t *content,
                                      kiln_tool_calls_t *calls) {
  if (s->st == ST_DONE || s->oom) return stream_status(s, content);
  run(s, true, content, calls);
  if (!s->oom) { /* whatever is left is content, unless it only separates calls */
    if (s->after_call) drop(s, lead_ws(s->buf.data, s->buf.len));
    emit(s, s->buf.len, content);
  }
  s->st = ST_DONE;
  return stream_status(s, content);
}

int32_t kiln_tool_stream_num_calls(const kiln_tool_stream_t *s) { return s->ncalls; }

kiln_status_t kiln_tool_parse(kiln_tool_format_t f, const char *text, size_t len,
                              kiln_strbuf_t *content, kiln_tool_calls_t *calls) {
  kiln_tool_stream_t *s = NULL;
  kiln_status_t st = kiln_tool_stream_create(f, &s);
  if (!st) st = kiln_tool_stream_push(s, text, len, content, calls);
  if (!st) st = kiln_tool_stream_finish(s, content, calls);
  kiln_tool_stream_free(s);
  return st;
}
