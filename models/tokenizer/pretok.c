/* pretok.c - tokenizer.json pre-tokenizers: ByteLevel, Split, Metaspace, Digits, Punctuation,
 * Whitespace, WhitespaceSplit and Sequence, splitting pieces the way HF's
 * NormalizedString::split does for each SplitDelimiterBehavior. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/tokenizer/tok_internal.h"

/* ---- the GPT-2 byte <-> unicode table -------------------------------------------------- */

/* Printable bytes stand for themselves; the other 68 map to U+0100 upwards in byte order. */
uint32_t ktok_byte_to_cp(unsigned char b) {
  if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174) return b;
  uint32_t k = 0;
  /* Count the non-printable bytes below b. */
  if (b <= 32) {
    k = b;
  } else if (b <= 160) { /* 127..160 come after 0..32 */
    k = 33 + (uint32_t)(b - 127);
  } else { /* 173 */
    k = 33 + 34;
  }
  return 256 + k;
}

int ktok_cp_to_byte(uint32_t cp) {
  if ((cp >= 33 && cp <= 126) || (cp >= 161 && cp <= 172) || (cp >= 174 && cp <= 255)) {
    return (int)cp;
  }
  if (cp < 256 || cp >= 256 + 68) return -1;
  uint32_t k = cp - 256;
  if (k <= 32) return (int)k;
  if (k < 33 + 34) return (int)(127 + (k - 33));
  return 173;
}

static const char gpt2_pattern[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
static const char whitespace_pattern[] = "\\w+|[^\\w\\s]+";

/* ---- parsing --------------------------------------------------------------------------- */

static kiln_status_t parse_behavior(const kiln_json_t *v, const char *key, const char *path,
                                    ktok_split_behavior_t def, ktok_split_behavior_t *out) {
  static const char *const names[] = {"Removed", "Isolated", "MergedWithPrevious", "MergedWithNext",
                                      "Contiguous"};
  *out = def;
  const kiln_json_t *b = kiln_json_get(v, key);
  if (!b) return NULL;
  const char *s = kiln_json_string(b, NULL);
  for (int i = 0; s && i < 5; i++) {
    if (strcmp(s, names[i]) == 0) {
      *out = (ktok_split_behavior_t)i;
      return NULL;
    }
  }
  return ktok_err(KILN_ERR_UNSUPPORTED, path, "%s '%s' is not supported", key,
                  s ? s : "(not a string)");
}

kiln_status_t ktok_pretok_parse(kiln_arena_t *a, const kiln_json_t *v, const char *path,
                                ktok_pretok_t **out) {
  *out = NULL;
  if (!kiln_json_is(v, KILN_JSON_OBJECT)) {
    return ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "expected an object, not %s",
                    kiln_json_type_name(kiln_json_type(v)));
  }
  const char *type = kiln_json_string(kiln_json_get(v, "type"), NULL);
  if (!type) return ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "type is missing");
  ktok_pretok_t *p = calloc(1, sizeof(*p));
  if (!p) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
  kiln_status_t st = NULL;
  char sub[512];
  if (strcmp(type, "ByteLevel") == 0) {
    static const char *const keys[] = {"type", "add_prefix_space", "trim_offsets", "use_regex",
                                       NULL};
    p->type = TOK_PRE_BYTELEVEL;
    if (!(st = ktok_json_only(v, path, keys)) &&
        !(st = ktok_json_bool(v, "add_prefix_space", true, path, &p->add_prefix_space)) &&
        !(st = ktok_json_bool(v, "use_regex", true, path, &p->use_regex)) && p->use_regex) {
      st = ktok_regex_compile(gpt2_pattern, sizeof(gpt2_pattern) - 1, &p->pattern.re);
    }
  } else if (strcmp(type, "Split") == 0) {
    static const char *const keys[] = {"type", "pattern", "behavior", "invert", NULL};
    p->type = TOK_PRE_SPLIT;
    snprintf(sub, sizeof(sub), "%s.pattern", path);
    if (!(st = ktok_json_only(v, path, keys)) &&
        !(st = ktok_pattern_parse(a, kiln_json_get(v, "pattern"), sub, &p->pattern)) &&
        !(st = parse_behavior(v, "behavior", path, TOK_SPLIT_REMOVED, &p->behavior))) {
      if (!kiln_json_get(v, "behavior")) {
        st = ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "behavior is missing");
      } else {
        st = ktok_json_bool(v, "invert", false, path, &p->invert);
      }
    }
  } else if (strcmp(type, "Metaspace") == 0) {
    static const char *const keys[] = {
        "type", "replacement", "add_prefix_space", "prepend_scheme", "split", "str_rep", NULL};
    p->type = TOK_PRE_METASPACE;
    uint32_t rep;
    bool aps;
    if (!(st = ktok_json_only(v, path, keys)) &&
        !(st = ktok_json_char(v, "replacement", 0x2581, path, &rep)) &&
        !(st = ktok_json_bool(v, "add_prefix_space", true, path, &aps)) &&
        !(st = ktok_json_bool(v, "split", true, path, &p->split))) {
      p->rep_len = ktok_utf8_encode(rep, p->rep);
      p->prepend_scheme = aps ? TOK_PREPEND_ALWAYS : TOK_PREPEND_NEVER;
      const char *ps = kiln_json_string(kiln_json_get(v, "prepend_scheme"), NULL);
      if (ps && strcmp(ps, "always") == 0) {
        p->prepend_scheme = TOK_PREPEND_ALWAYS;
      } else if (ps && strcmp(ps, "first") == 0) {
        p->prepend_scheme = TOK_PREPEND_FIRST;
      } else if (ps && strcmp(ps, "never") == 0) {
        p->prepend_scheme = TOK_PREPEND_NEVER;
      } else if (ps) {
        st = ktok_err(KILN_ERR_UNSUPPORTED, path, "prepend_scheme '%s' is not supported", ps);
      }
    }
  } else if (strcmp(type, "Digits") == 0) {
    static const char *const keys[] = {"type", "individual_digits", NULL};
    p->type = TOK_PRE_DIGITS;
    if (!(st = ktok_json_only(v, path, keys))) {
      st = ktok_json_bool(v, "individual_digits", false, path, &p->individual_digits);
    }
  } else if (strcmp(type, "Punctuation") == 0) {
    static const char *const keys[] = {"type", "behavior", NULL};
    p->type = TOK_PRE_PUNCTUATION;
    if (!(st = ktok_json_only(v, path, keys))) {
      st = parse_behavior(v, "behavior", path, TOK_SPLIT_ISOLATED, &p->behavior);
    }
  } else if (strcmp(type, "Whitespace") == 0) {
    static const char *const keys[] = {"type", NULL};
    p->type = TOK_PRE_WHITESPACE;
    if (!(st = ktok_json_only(v, path, keys))) {
      st = ktok_regex_compile(whitespace_pattern, sizeof(whitespace_pattern) - 1, &p->pattern.re);
    }
  } else if (strcmp(type, "WhitespaceSplit") == 0) {
    static const char *const keys[] = {"type", NULL};
    p->type = TOK_PRE_WHITESPACE_SPLIT;
    st = ktok_json_only(v, path, keys);
  } else if (strcmp(type, "Sequence") == 0) {
    static const char *const keys[] = {"type", "pretokenizers", NULL};
    p->type = TOK_PRE_SEQUENCE;
    const kiln_json_t *arr = kiln_json_get(v, "pretokenizers");
    if (!(st = ktok_json_only(v, path, keys))) {
      if (!kiln_json_is(arr, KILN_JSON_ARRAY)) {
        st = ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "pretokenizers must be an array");
      } else {
        size_t cnt = kiln_json_len(arr);
        p->children = calloc(cnt ? cnt : 1, sizeof(*p->children));
        if (!p->children) st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
        for (size_t i = 0; i < cnt && !st; i++) {
          snprintf(sub, sizeof(sub), "%s.pretokenizers[%zu]", path, i);
          st = ktok_pretok_parse(a, kiln_json_at(arr, i), sub, &p->children[i]);
          if (!st) p->n_children++;
        }
      }
    }
  } else {
    st = ktok_err(KILN_ERR_UNSUPPORTED, path, "type '%s' is not supported", type);
  }
  if (st) {
    ktok_pretok_free(p);
    return st;
  }
  *out = p;
  return NULL;
}

void ktok_pretok_free(ktok_pretok_t *p) {
  if (!p) return;
  for (size_t i = 0; i < p->n_children; i++) ktok_pretok_free(p->children[i]);
  free(p->children);
  ktok_regex_free(p->pattern.re);
  free(p);
}

/* ---- splitting ------------------------------------------------------------------------- */

typedef struct span {
  size_t start, end;
  bool flag; /* is a match (before the behavior), or "remove" (after) */
} span_t;

typedef struct spans {
  span_t *v;
  size_t n, cap;
} spans_t;

static bool spans_push(spans_t *s, size_t start, size_t end, bool flag) {
  if (s->n == s->cap) {
    size_t cap = s->cap ? s->cap * 2 : 64;
    span_t *v = realloc(s->v, cap * sizeof(*v));
    if (!v) return false;
    s->v = v;
    s->cap = cap;
  }
  s->v[s->n++] = (span_t){start, end, flag};
  return true;
}

/* HF Pattern::find_matches for a regex or string pattern: spans covering s with flags. */
static kiln_status_t find_pattern(const ktok_pattern_t *pat, ktok_match_ctx_t *mc, const char *s,
                                  size_t n, spans_t *out) {
  out->n = 0;
  size_t prev = 0, pos = 0;
  bool have_last = false;
  size_t last_end = 0;
  kiln_status_t err = NULL;
  while (pos <= n) {
    size_t ms, me;
    int r = ktok_pattern_find(pat, mc, s, n, pos, &ms, &me, &err);
    if (r < 0) return err;
    if (r == 0) break;
    bool empty = me == ms;
    if (!(empty && have_last && ms == last_end)) {
      if (prev != ms && !spans_push(out, prev, ms, false)) goto oom;
      if (!spans_push(out, ms, me, true)) goto oom;
      prev = me;
      have_last = true;
      last_end = me;
    }
    if (empty) {
      if (ms >= n) break;
      pos = ms + (size_t)ktok_utf8_len((unsigned char)s[ms]);
    } else {
      pos = me;
    }
  }
  if (prev != n && !spans_push(out, prev, n, false)) goto oom;
  return NULL;
oom:
  return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "pre-tokenizer: out of memory");
}

typedef bool (*char_pred_t)(uint32_t cp, const void *arg);

/* HF Pattern::find_matches for a char predicate: every matching char is its own match. */
static kiln_status_t find_chars(char_pred_t pred, const void *arg, const char *s, size_t n,
                                spans_t *out) {
  out->n = 0;
  size_t last = 0;
  for (size_t i = 0; i < n;) {
    uint32_t cp;
    int cl = ktok_utf8_decode(s + i, &cp);
    if (pred(cp, arg)) {
      if (last < i && !spans_push(out, last, i, false)) goto oom;
      if (!spans_push(out, i, i + (size_t)cl, true)) goto oom;
      last = i + (size_t)cl;
    }
    i += (size_t)cl;
  }
  if (last < n && !spans_push(out, last, n, false)) goto oom;
  return NULL;
oom:
  return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "pre-tokenizer: out of memory");
}

/* Applies a SplitDelimiterBehavior to the match spans of one piece and appends the
 * resulting non-empty pieces to out. */
static kiln_status_t apply_behavior(spans_t *sp, ktok_split_behavior_t behavior, bool invert,
                                    const char *s, bool at_start, ktok_pieces_t *out) {
  if (invert) {
    for (size_t i = 0; i < sp->n; i++) sp->v[i].flag = !sp->v[i].flag;
  }
  size_t m = 0; /* merged spans are compacted in place; flag becomes "remove" */
  switch (behavior) {
    case TOK_SPLIT_REMOVED: m = sp->n; break;
    case TOK_SPLIT_ISOLATED:
      for (size_t i = 0; i < sp->n; i++) sp->v[i].flag = false;
      m = sp->n;
      break;
    case TOK_SPLIT_CONTIGUOUS: {
      bool prev_match = false;
      for (size_t i = 0; i < sp->n; i++) {
        bool is_match = sp->v[i].flag;
        if (is_match == prev_match && m > 0) {
          sp->v[m - 1].end = sp->v[i].end;
        } else {
          sp->v[m++] = (span_t){sp->v[i].start, sp->v[i].end, false};
        }
        prev_match = is_match;
      }
      break;
    }
    case TOK_SPLIT_MERGED_WITH_PREVIOUS: {
      bool prev_match = false;
      for (size_t i = 0; i < sp->n; i++) {
        bool is_match = sp->v[i].flag;
        if (is_match && !prev_match && m > 0) {
          sp->v[m - 1].end = sp->v[i].end;
        } else {
          sp->v[m++] = (span_t){sp->v[i].start, sp->v[i].end, false};
        }
        prev_match = is_match;
      }
      break;
    }
    case TOK_SPLIT_MERGED_WITH_NEXT: {
      /* Walk backwards, then the kept spans are in reverse order at the end of the array. */
      bool prev_match = false;
      size_t w = sp->n; /* write index from the top */
      for (size_t k = sp->n; k-- > 0;) {
        span_t cur = sp->v[k];
        if (cur.flag && !prev_match && w < sp->n) {
          sp->v[w].start = cur.start;
        } else {
          sp->v[--w] = (span_t){cur.start, cur.end, false};
        }
        prev_match = cur.flag;
      }
      memmove(sp->v, sp->v + w, (sp->n - w) * sizeof(span_t));
      m = sp->n - w;
      break;
    }
  }
  for (size_t i = 0; i < m; i++) {
    if (sp->v[i].flag) continue;
    size_t st = sp->v[i].start, en = sp->v[i].end;
    if (!ktok_pieces_add(out, s + st, en - st, at_start && st == 0)) {
      return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "pre-tokenizer: out of memory");
    }
  }
  return NULL;
}

static bool pred_numeric(uint32_t cp, const void *arg) {
  (void)arg;
  return ktok_is_numeric(cp);
}
static bool pred_punct(uint32_t cp, const void *arg) {
  (void)arg;
  return ktok_is_punctuation(cp);
}
static bool pred_space(uint32_t cp, const void *arg) {
  (void)arg;
  return ktok_is_whitespace(cp);
}
static bool pred_eq(uint32_t cp, const void *arg) { return cp == *(const uint32_t *)arg; }

/* Maps each byte of s to its ByteLevel character. */
static bool bytelevel_map(const char *s, size_t n, kiln_strbuf_t *out) {
  if (!kiln_strbuf_reserve(out, n * 2)) return false;
  for (size_t i = 0; i < n; i++) {
    uint32_t cp = ktok_byte_to_cp((unsigned char)s[i]);
    if (cp < 0x80) {
      out->data[out->len++] = (char)cp;
    } else {
      out->data[out->len++] = (char)(0xC0 | (cp >> 6));
      out->data[out->len++] = (char)(0x80 | (cp & 0x3F));
    }
  }
  out->data[out->len] = '\0';
  return true;
}

static kiln_status_t pretok_one(const ktok_pretok_t *pt, ktok_match_ctx_t *mc, ktok_pieces_t *in,
                                ktok_pieces_t *out) {
  ktok_pieces_reset(out);
  /* Scratch lives in the match context so that repeated calls do not allocate. */
  spans_t sp = {mc->spans, 0, mc->spans_cap};
  kiln_strbuf_t tmp = mc->tmp, tmp2 = mc->tmp2;
  kiln_status_t st = NULL;
  for (size_t i = 0; i < in->n && !st; i++) {
    const char *s = in->text.data + in->v[i].off;
    size_t n = in->v[i].len;
    bool at_start = in->v[i].at_start;
    switch (pt->type) {
      case TOK_PRE_SPLIT:
        if (!(st = find_pattern(&pt->pattern, mc, s, n, &sp))) {
          st = apply_behavior(&sp, pt->behavior, pt->invert, s, at_start, out);
        }
        break;
      case TOK_PRE_WHITESPACE:
        if (!(st = find_pattern(&pt->pattern, mc, s, n, &sp))) {
          st = apply_behavior(&sp, TOK_SPLIT_REMOVED, true, s, at_start, out);
        }
        break;
      case TOK_PRE_WHITESPACE_SPLIT:
        if (!(st = find_chars(pred_space, NULL, s, n, &sp))) {
          st = apply_behavior(&sp, TOK_SPLIT_REMOVED, false, s, at_start, out);
        }
        break;
      case TOK_PRE_DIGITS:
        if (!(st = find_chars(pred_numeric, NULL, s, n, &sp))) {
          st =
              apply_behavior(&sp, pt->individual_digits ? TOK_SPLIT_ISOLATED : TOK_SPLIT_CONTIGUOUS,
                             false, s, at_start, out);
        }
        break;
      case TOK_PRE_PUNCTUATION:
        if (!(st = find_chars(pred_punct, NULL, s, n, &sp))) {
          st = apply_behavior(&sp, pt->behavior, false, s, at_start, out);
        }
        break;
      case TOK_PRE_BYTELEVEL: {
        const char *src = s;
        size_t sn = n;
        if (pt->add_prefix_space && s[0] != ' ') {
          kiln_strbuf_reset(&tmp);
          kiln_strbuf_append_char(&tmp, ' ');
          kiln_strbuf_append(&tmp, s, n);
          if (!kiln_strbuf_ok(&tmp)) goto oom;
          src = tmp.data;
          sn = tmp.len;
        }
        if (pt->use_regex) {
          if ((st = find_pattern(&pt->pattern, mc, src, sn, &sp))) break;
        } else {
          sp.n = 0;
          if (!spans_push(&sp, 0, sn, false)) goto oom;
        }
        for (size_t k = 0; k < sp.n; k++) {
          size_t a = sp.v[k].start, e = sp.v[k].end;
          if (a == e) continue;
          kiln_strbuf_reset(&tmp2);
          if (!bytelevel_map(src + a, e - a, &tmp2)) goto oom;
          if (!ktok_pieces_add(out, tmp2.data, tmp2.len, at_start && a == 0)) goto oom;
        }
        break;
      }
      case TOK_PRE_METASPACE: {
        kiln_strbuf_t *b = &tmp;
        kiln_strbuf_reset(b);
        bool starts_rep = n >= (size_t)pt->rep_len && memcmp(s, pt->rep, (size_t)pt->rep_len) == 0;
        bool starts_space = s[0] == ' ';
        bool prepend = pt->prepend_scheme == TOK_PREPEND_ALWAYS ||
                       (pt->prepend_scheme == TOK_PREPEND_FIRST && at_start);
        /* The check is made after spaces are replaced, so a leading space counts as one. */
        if (prepend && !starts_rep && !starts_space)
          kiln_strbuf_append(b, pt->rep, (size_t)pt->rep_len);
        for (size_t k = 0; k < n; k++) {
          if (s[k] == ' ') {
            kiln_strbuf_append(b, pt->rep, (size_t)pt->rep_len);
          } else {
            kiln_strbuf_append_char(b, s[k]);
          }
        }
        if (!kiln_strbuf_ok(b)) goto oom;
        if (pt->split) {
          uint32_t rep_cp;
          ktok_utf8_decode(pt->rep, &rep_cp);
          if (!(st = find_chars(pred_eq, &rep_cp, b->data, b->len, &sp))) {
            st = apply_behavior(&sp, TOK_SPLIT_MERGED_WITH_NEXT, false, b->data, at_start, out);
          }
        } else if (!ktok_pieces_add(out, b->data, b->len, at_start)) {
          goto oom;
        }
        break;
      }
      case TOK_PRE_SEQUENCE:
        st = kiln_status_make(KILN_ERR_INTERNAL, "pre-tokenizer: nested sequence in pretok_one");
        break;
    }
  }
  goto done;
oom:
  st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "pre-tokenizer: out of memory");
done:
  mc->spans = sp.v;
  mc->spans_cap = sp.cap;
  mc->tmp = tmp;
  mc->tmp2 = tmp2;
  return st;
}

kiln_status_t ktok_pretokenize(const ktok_pretok_t *pt, ktok_match_ctx_t *mc, ktok_pieces_t *in,
                               ktok_pieces_t *out, ktok_pieces_t *tmp) {
  if (pt->type != TOK_PRE_SEQUENCE) return pretok_one(pt, mc, in, out);
  /* Rotate through three buffers: the input is consumed and may be reused as scratch. */
  ktok_pieces_t *bufs[3] = {in, out, tmp};
  int src = 0;
  for (size_t i = 0; i < pt->n_children; i++) {
    int dst = src == 1 ? 2 : 1;
    int scratch = 3 - src - dst;
    kiln_status_t st = ktok_pretokenize(pt->children[i], mc, bufs[src], bufs[dst], bufs[scratch]);
    if (st) return st;
    src = dst;
  }
  if (src == 0) { /* empty sequence: copy through */
    ktok_pieces_reset(out);
    for (size_t i = 0; i < in->n; i++) {
      if (!ktok_pieces_add(out, in->text.data + in->v[i].off, in->v[i].len, in->v[i].at_start)) {
        return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "pre-tokenizer: out of memory");
      }
    }
  } else if (src == 2) {
    ktok_pieces_t t = *out;
    *out = *tmp;
    *tmp = t;
  }
  return NULL;
}
