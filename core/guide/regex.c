/* regex.c - regular expressions to GBNF (see kiln_regex_to_gbnf in grammar.h).
 *
 * The translation is one to one: a regex atom becomes a GBNF literal, character class or
 * group, quantifiers become GBNF's. Semantics are ECMAScript's (what JSON Schema validators
 * such as ajv use): \d = [0-9], \w = [A-Za-z0-9_], \s = the ECMAScript white space and line
 * terminators, . = anything but \n \r U+2028 U+2029.
 *
 * In JSON-string mode every character is written the way a JSON string needs it: '"' and
 * '\' as \" and \\, control characters as \b \f \n \r \t or \u00XX; everything else raw. The
 * pattern is then a search (JSON Schema's rule): a side without its anchor gets any string
 * content there. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/guide/grammar.h"

typedef struct rrange {
  uint32_t lo, hi;
} rrange_t;

typedef struct rx {
  const char *s, *p, *end;
  bool json;
  const char *what;
  kiln_strbuf_t *out;
  kiln_status_t err;
  int depth;
} rx_t;

#define RX_MAX_DEPTH 200

static void rx_fail(rx_t *x, const char *at, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void rx_fail(rx_t *x, const char *at, const char *fmt, ...) {
  if (x->err) return;
  char msg[400];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  x->err = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: offset %d: %s", x->what,
                            (int)(at - x->s), msg);
}

/* JSON string content: one character of a JSON string, any code point but lone surrogates. */
#define JSON_CHAR                                                                           \
  "([^\"\\\\\\x00-\\x1F] | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" ([0-9a-cA-C] [0-9a-fA-F]{3} | " \
  "[dD] [0-7] [0-9a-fA-F]{2} | [eEfF] [0-9a-fA-F]{3})))"

/* ---- ranges ------------------------------------------------------------------------------ */

typedef struct rset {
  rrange_t *r;
  int32_t n, cap;
  bool oom;
} rset_t;

static void rs_add(rset_t *s, uint32_t lo, uint32_t hi) {
  if (s->n == s->cap) {
    int32_t nc = s->cap ? s->cap * 2 : 16;
    rrange_t *nr = realloc(s->r, (size_t)nc * sizeof(*nr));
    if (!nr) {
      s->oom = true;
      return;
    }
    s->r = nr;
    s->cap = nc;
  }
  s->r[s->n++] = (rrange_t){lo, hi};
}

static int rcmp(const void *a, const void *b) {
  const rrange_t *x = a, *y = b;
  return x->lo < y->lo ? -1 : x->lo > y->lo;
}

static void rs_norm(rset_t *s) {
  if (!s->n) return;
  qsort(s->r, (size_t)s->n, sizeof(*s->r), rcmp);
  int32_t k = 0;
  for (int32_t i = 0; i < s->n; i++) {
    if (k && s->r[i].lo <= s->r[k - 1].hi + 1) {
      if (s->r[i].hi > s->r[k - 1].hi) s->r[k - 1].hi = s->r[i].hi;
    } else {
      s->r[k++] = s->r[i];
    }
  }
  s->n = k;
}

/* s = all code points not in s. */
static void rs_negate(rset_t *s) {
  rs_norm(s);
  rset_t o = {0};
  uint32_t next = 0;
  for (int32_t i = 0; i < s->n; i++) {
    if (s->r[i].lo > next) rs_add(&o, next, s->r[i].lo - 1);
    next = s->r[i].hi + 1;
  }
  if (next <= 0x10FFFF) rs_add(&o, next, 0x10FFFF);
  free(s->r);
  o.oom |= s->oom;
  *s = o;
}

static void rs_add_set(rset_t *s, const rset_t *t) {
  for (int32_t i = 0; i < t->n; i++) rs_add(s, t->r[i].lo, t->r[i].hi);
}

/* The sets behind \d \w \s (ECMAScript). */
static void rs_class(rset_t *s, char c) {
  rset_t t = {0};
  char l = (char)(c | 0x20);
  if (l == 'd') {
    rs_add(&t, '0', '9');
  } else if (l == 'w') {
    rs_add(&t, '0', '9');
    rs_add(&t, 'A', 'Z');
    rs_add(&t, 'a', 'z');
    rs_add(&t, '_', '_');
  } else {
    static const uint32_t ws[][2] = {
        {9, 13},          {32, 32},         {0xA0, 0xA0},     {0x1680, 0x1680}, {0x2000, 0x200A},
        {0x2028, 0x2029}, {0x202F, 0x202F}, {0x205F, 0x205F}, {0x3000, 0x3000}, {0xFEFF, 0xFEFF}};
    for (size_t i = 0; i < sizeof(ws) / sizeof(ws[0]); i++) rs_add(&t, ws[i][0], ws[i][1]);
  }
  if (c >= 'A' && c <= 'Z') rs_negate(&t);
  rs_add_set(s, &t);
  s->oom |= t.oom;
  free(t.r);
}

/* ---- output ------------------------------------------------------------------------------ */

/* One code point inside a GBNF literal or class. */
static void emit_cp(kiln_strbuf_t *o, uint32_t cp) {
  if (cp == '"' || cp == '\\' || cp == ']' || cp == '[' || cp == '-' || cp == '^') {
    kiln_strbuf_append_char(o, '\\');
    kiln_strbuf_append_char(o, (char)cp);
  } else if (cp < 0x20 || cp == 0x7F) {
    kiln_strbuf_printf(o, "\\x%02X", (unsigned)cp);
  } else if (cp < 0x80) {
    kiln_strbuf_append_char(o, (char)cp);
  } else {
    kiln_strbuf_printf(o, "\\U%08X", (unsigned)cp);
  }
}

/* The JSON spelling of a character that JSON must escape, as a GBNF literal. */
static void emit_json_escape(kiln_strbuf_t *o, uint32_t cp) {
  static const char *const short_esc[32] = {
      [8] = "b", [9] = "t", [10] = "n", [12] = "f", [13] = "r"};
  if (cp == '"') {
    kiln_strbuf_append_str(o, "\"\\\\\\\"\"");
  } else if (cp == '\\') {
    kiln_strbuf_append_str(o, "\"\\\\\\\\\"");
  } else if (short_esc[cp]) {
    kiln_strbuf_printf(o, "\"\\\\%s\"", short_esc[cp]);
  } else {
    kiln_strbuf_printf(o, "\"\\\\u%04x\"", (unsigned)cp);
  }
}

static bool json_needs_escape(uint32_t cp) { return cp < 0x20 || cp == '"' || cp == '\\'; }

/* A normalized set as one GBNF term. */
static void emit_set(rx_t *x, rset_t *s) {
  kiln_strbuf_t *o = x->out;
  rs_norm(s);
  /* remove surrogates (they are not characters of a UTF-8 text) */
  rset_t t = {0};
  for (int32_t i = 0; i < s->n; i++) {
    uint32_t lo = s->r[i].lo, hi = s->r[i].hi;
    if (hi < 0xD800 || lo > 0xDFFF) {
      rs_add(&t, lo, hi);
      continue;
    }
    if (lo < 0xD800) rs_add(&t, lo, 0xD7FF);
    if (hi > 0xDFFF) rs_add(&t, 0xE000, hi);
  }
  rset_t raw = {0}, esc = {0};
  for (int32_t i = 0; i < t.n; i++)
    for (uint32_t lo = t.r[i].lo; lo <= t.r[i].hi;) {
      /* split at the characters JSON escapes */
      bool e = x->json && json_needs_escape(lo);
      uint32_t hi = lo;
      while (hi < t.r[i].hi && (x->json && json_needs_escape(hi + 1)) == e) hi++;
      if (e)
        rs_add(&esc, lo, hi);
      else
        rs_add(&raw, lo, hi);
      if (hi == 0xFFFFFFFFu) break;
      lo = hi + 1;
    }
  if (raw.n + esc.n == 0) {
    rx_fail(x, x->p, "an empty character class matches nothing");
  } else {
    bool grp = esc.n > 0;
    if (grp) kiln_strbuf_append_char(o, '(');
    if (raw.n) {
      kiln_strbuf_append_char(o, '[');
      for (int32_t i = 0; i < raw.n; i++) {
        emit_cp(o, raw.r[i].lo);
        if (raw.r[i].hi != raw.r[i].lo) {
          kiln_strbuf_append_char(o, '-');
          emit_cp(o, raw.r[i].hi);
        }
      }
      kiln_strbuf_append_char(o, ']');
    }
    bool first = raw.n == 0;
    for (int32_t i = 0; i < esc.n; i++)
      for (uint32_t c = esc.r[i].lo; c <= esc.r[i].hi; c++) {
        kiln_strbuf_append_str(o, first ? "" : " | ");
        first = false;
        emit_json_escape(o, c);
      }
    if (grp) kiln_strbuf_append_char(o, ')');
  }
  if (t.oom || raw.oom || esc.oom) s->oom = true;
  free(t.r);
  free(raw.r);
  free(esc.r);
}

static void emit_literal(rx_t *x, uint32_t cp) {
  if (x->json && json_needs_escape(cp)) {
    emit_json_escape(x->out, cp);
    return;
  }
  kiln_strbuf_append_char(x->out, '"');
  emit_cp(x->out, cp);
  kiln_strbuf_append_char(x->out, '"');
}

/* ---- the parser -------------------------------------------------------------------------- */

static int hexv(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

static bool read_hex(rx_t *x, const char *at, int n, uint32_t *out) {
  uint32_t v = 0;
  for (int i = 0; i < n; i++) {
    int h = x->p < x->end ? hexv(*x->p) : -1;
    if (h < 0) {
      rx_fail(x, at, "a hexadecimal escape needs %d digits", n);
      return false;
    }
    v = v * 16 + (uint32_t)h;
    x->p++;
  }
  *out = v;
  return true;
}

/* One UTF-8 character of the pattern. */
static bool read_utf8(rx_t *x, uint32_t *cp) {
  unsigned char c = (unsigned char)*x->p;
  int n = c < 0x80 ? 1 : c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 0;
  if (!n || x->p + n > x->end) {
    rx_fail(x, x->p, "invalid UTF-8");
    return false;
  }
  uint32_t v = n == 1 ? c : n == 2 ? c & 0x1F : n == 3 ? c & 0x0F : c & 0x07;
  for (int i = 1; i < n; i++) v = (v << 6) | ((unsigned char)x->p[i] & 63);
  x->p += n;
  *cp = v;
  return true;
}

/* An escape after '\' (x->p at the character after it). Returns 1 with *cp for a single
 * character, 2 with the class added to *set, 0 at an error. */
static int read_escape(rx_t *x, bool in_class, uint32_t *cp, rset_t *set) {
  const char *at = x->p - 1;
  if (x->p >= x->end) {
    rx_fail(x, at, "a backslash at the end of the pattern");
    return 0;
  }
  char c = *x->p++;
  switch (c) {
    case 'd':
    case 'D':
    case 'w':
    case 'W':
    case 's':
    case 'S': rs_class(set, c); return 2;
    case 't': *cp = '\t'; return 1;
    case 'n': *cp = '\n'; return 1;
    case 'r': *cp = '\r'; return 1;
    case 'f': *cp = '\f'; return 1;
    case 'v': *cp = '\v'; return 1;
    case '0':
      if (x->p < x->end && *x->p >= '0' && *x->p <= '9') {
        rx_fail(x, at, "octal escapes are not supported");
        return 0;
      }
      *cp = 0;
      return 1;
    case 'x': return read_hex(x, at, 2, cp) ? 1 : 0;
    case 'u':
      if (x->p < x->end && *x->p == '{') {
        x->p++;
        uint32_t v = 0;
        int nd = 0;
        while (x->p < x->end && hexv(*x->p) >= 0 && nd < 7)
          v = v * 16 + (uint32_t)hexv(*x->p++), nd++;
        if (!nd || x->p >= x->end || *x->p != '}' || v > 0x10FFFF) {
          rx_fail(x, at, "a bad \\u{...} escape");
          return 0;
        }
        x->p++;
        *cp = v;
        return 1;
      }
      if (!read_hex(x, at, 4, cp)) return 0;
      if (*cp >= 0xD800 && *cp <= 0xDBFF && x->end - x->p >= 6 && x->p[0] == '\\' &&
          x->p[1] == 'u') {
        const char *save = x->p;
        x->p += 2;
        uint32_t lo;
        if (read_hex(x, at, 4, &lo) && lo >= 0xDC00 && lo <= 0xDFFF) {
          *cp = 0x10000 + ((*cp - 0xD800) << 10) + (lo - 0xDC00);
          return 1;
        }
        x->p = save;
      }
      if (*cp >= 0xD800 && *cp <= 0xDFFF) {
        rx_fail(x, at, "a lone surrogate \\u%04X", (unsigned)*cp);
        return 0;
      }
      return 1;
    case 'b':
      if (in_class) {
        *cp = '\b';
        return 1;
      }
      rx_fail(x, at, "word boundaries (\\b) are not supported");
      return 0;
    case 'B': rx_fail(x, at, "word boundaries (\\B) are not supported"); return 0;
    case 'p':
    case 'P': rx_fail(x, at, "Unicode property classes (\\%c{...}) are not supported", c); return 0;
    case 'k': rx_fail(x, at, "backreferences (\\k<name>) are not supported"); return 0;
    case 'c': rx_fail(x, at, "control escapes (\\cX) are not supported"); return 0;
    case 'A':
    case 'Z':
    case 'z':
    case 'G':
      rx_fail(x, at, "the anchor \\%c is not supported (use ^ and $ at the ends)", c);
      return 0;
    default:
      if (c >= '1' && c <= '9') {
        rx_fail(x, at, "backreferences (\\%c) are not supported", c);
        return 0;
      }
      if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
        rx_fail(x, at, "unknown escape '\\%c'", c);
        return 0;
      }
      x->p--;
      return read_utf8(x, cp) ? 1 : 0;
  }
}

static void parse_class(rx_t *x) {
  const char *at = x->p - 1;
  rset_t s = {0};
  bool neg = false;
  if (x->p < x->end && *x->p == '^') {
    neg = true;
    x->p++;
  }
  bool first = true;
  for (;;) {
    if (x->p >= x->end) {
      rx_fail(x, at, "unterminated character class");
      break;
    }
    if (*x->p == ']' && !first) {
      x->p++;
      break;
    }
    if (*x->p == ']' && first) { /* ECMAScript: [] matches nothing, [^] anything */
      x->p++;
      if (!neg) {
        rx_fail(x, at, "an empty character class matches nothing");
        break;
      }
      rs_add(&s, 0, 0x10FFFF);
      neg = false;
      break;
    }
    first = false;
    uint32_t lo = 0, hi;
    int k;
    if (*x->p == '\\') {
      x->p++;
      k = read_escape(x, true, &lo, &s);
    } else if (*x->p == '[' && x->p + 1 < x->end && (x->p[1] == ':' || x->p[1] == '=')) {
      rx_fail(x, x->p, "POSIX classes ([:alpha:]) are not supported");
      k = 0;
    } else {
      k = read_utf8(x, &lo) ? 1 : 0;
    }
    if (!k) break;
    if (k == 2) continue;
    hi = lo;
    if (x->p + 1 < x->end && *x->p == '-' && x->p[1] != ']') {
      x->p++;
      int k2;
      if (*x->p == '\\') {
        x->p++;
        rset_t dummy = {0};
        k2 = read_escape(x, true, &hi, &dummy);
        free(dummy.r);
        if (k2 == 2) {
          rx_fail(x, at, "a range cannot end in a class escape");
          break;
        }
      } else {
        k2 = read_utf8(x, &hi) ? 1 : 0;
      }
      if (!k2) break;
      if (hi < lo) {
        rx_fail(x, at, "a character range out of order");
        break;
      }
    }
    rs_add(&s, lo, hi);
  }
  if (!x->err) {
    if (neg) rs_negate(&s);
    emit_set(x, &s);
  }
  if (s.oom && !x->err)
    x->err = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", x->what);
  free(s.r);
}

static void parse_alt(rx_t *x, bool top, bool *anch_start, bool *anch_end);

static bool parse_count(rx_t *x, long *v) {
  long n = 0;
  int nd = 0;
  while (x->p < x->end && *x->p >= '0' && *x->p <= '9') {
    n = n * 10 + (*x->p++ - '0');
    if (n > KILN_GRAMMAR_MAX_REPEAT) {
      rx_fail(x, x->p, "a repetition count above %d", KILN_GRAMMAR_MAX_REPEAT);
      return false;
    }
    nd++;
  }
  *v = n;
  return nd > 0;
}

/* A quantifier after an atom, written to the output; false when there is none. */
static void parse_quant(rx_t *x) {
  if (x->p >= x->end) return;
  const char *at = x->p;
  char c = *x->p;
  if (c == '*' || c == '+' || c == '?') {
    x->p++;
    kiln_strbuf_append_char(x->out, c);
  } else if (c == '{') {
    x->p++;
    long lo, hi = -2;
    if (!parse_count(x, &lo)) {
      if (!x->err)
        rx_fail(x, at, "'{' must start a quantifier {m}, {m,} or {m,n} (escape it as \\{)");
      return;
    }
    if (x->p < x->end && *x->p == ',') {
      x->p++;
      hi = -1;
      if (x->p < x->end && *x->p != '}' && !parse_count(x, &hi)) {
        if (!x->err) rx_fail(x, at, "a bad quantifier");
        return;
      }
    }
    if (x->p >= x->end || *x->p != '}') {
      rx_fail(x, at, "a quantifier without its '}'");
      return;
    }
    x->p++;
    if (hi >= 0 && hi < lo) {
      rx_fail(x, at, "{%ld,%ld}: the maximum is below the minimum", lo, hi);
      return;
    }
    if (hi == -2)
      kiln_strbuf_printf(x->out, "{%ld}", lo);
    else if (hi == -1)
      kiln_strbuf_printf(x->out, "{%ld,}", lo);
    else
      kiln_strbuf_printf(x->out, "{%ld,%ld}", lo, hi);
  } else {
    return;
  }
  if (x->p < x->end && *x->p == '?') x->p++; /* lazy: the same language */
  if (x->p < x->end && *x->p == '+') {
    rx_fail(x, x->p, "possessive quantifiers are not supported");
    return;
  }
  if (x->p < x->end && (*x->p == '*' || *x->p == '+' || *x->p == '?' || *x->p == '{'))
    rx_fail(x, x->p, "a quantifier cannot follow another one");
}

/* A sequence of atoms, up to '|' or ')' or the end. */
static void parse_seq(rx_t *x, bool top, bool *anch_start, bool *anch_end) {
  bool any = false;
  kiln_strbuf_append_char(x->out, '(');
  while (!x->err && x->p < x->end && *x->p != '|' && *x->p != ')') {
    const char *at = x->p;
    char c = *x->p;
    if (c == '^') {
      x->p++;
      if (!top || any) {
        rx_fail(x, at, "'^' is supported only at the start of the pattern");
        return;
      }
      *anch_start = true;
      continue;
    }
    if (c == '$') {
      x->p++;
      if (!top || (x->p < x->end && *x->p != '|')) {
        rx_fail(x, at, "'$' is supported only at the end of the pattern");
        return;
      }
      *anch_end = true;
      continue;
    }
    if (*anch_end) {
      rx_fail(x, at, "nothing may follow '$'");
      return;
    }
    if (c == '*' || c == '+' || c == '?' ||
        (c == '{' && x->p + 1 < x->end && x->p[1] >= '0' && x->p[1] <= '9')) {
      rx_fail(x, at, "'%c' has nothing to repeat", c);
      return;
    }
    kiln_strbuf_append_char(x->out, ' ');
    if (c == '(') {
      x->p++;
      if (x->p < x->end && *x->p == '?') {
        x->p++;
        if (x->p < x->end && *x->p == ':') {
          x->p++;
        } else if (x->p < x->end && (*x->p == 'P' || *x->p == '<') &&
                   !(x->p + 1 < x->end && *x->p == '<' && (x->p[1] == '=' || x->p[1] == '!'))) {
          if (*x->p == 'P') x->p++;
          if (x->p >= x->end || *x->p != '<') {
            rx_fail(x, at, "(?P must be followed by <name>");
            return;
          }
          while (x->p < x->end && *x->p != '>') x->p++;
          if (x->p >= x->end) {
            rx_fail(x, at, "an unterminated group name");
            return;
          }
          x->p++;
        } else if (x->p < x->end && (*x->p == '=' || *x->p == '!' || *x->p == '<')) {
          rx_fail(x, at, "lookaround assertions are not supported");
          return;
        } else {
          rx_fail(x, at, "inline flags and other (?...) groups are not supported");
          return;
        }
      }
      if (++x->depth > RX_MAX_DEPTH) {
        rx_fail(x, at, "groups nested more than %d deep", RX_MAX_DEPTH);
        return;
      }
      bool a = false, z = false;
      parse_alt(x, false, &a, &z);
      x->depth--;
      if (x->err) return;
      if (x->p >= x->end || *x->p != ')') {
        rx_fail(x, at, "'(' without a matching ')'");
        return;
      }
      x->p++;
    } else if (c == '[') {
      x->p++;
      parse_class(x);
    } else if (c == '.') {
      x->p++;
      rset_t s = {0};
      rs_add(&s, '\n', '\n');
      rs_add(&s, '\r', '\r');
      rs_add(&s, 0x2028, 0x2029);
      rs_negate(&s);
      emit_set(x, &s);
      free(s.r);
    } else if (c == '\\') {
      x->p++;
      uint32_t cp = 0;
      rset_t s = {0};
      int k = read_escape(x, false, &cp, &s);
      if (k == 1) emit_literal(x, cp);
      if (k == 2) emit_set(x, &s);
      free(s.r);
    } else if (c == ')') {
      break;
    } else {
      uint32_t cp;
      if (read_utf8(x, &cp)) emit_literal(x, cp);
    }
    if (x->err) return;
    parse_quant(x);
    any = true;
  }
  if (!any) kiln_strbuf_append_str(x->out, " \"\"");
  kiln_strbuf_append_str(x->out, " )");
}

static void parse_alt(rx_t *x, bool top, bool *anch_start, bool *anch_end) {
  kiln_strbuf_append_char(x->out, '(');
  bool first = true;
  for (;;) {
    bool a = false, z = false;
    if (!first) kiln_strbuf_append_str(x->out, " |");
    kiln_strbuf_append_char(x->out, ' ');
    if (top && x->json) {
      /* search semantics: each top-level alternative gets its unanchored sides */
      kiln_strbuf_t *real = x->out;
      kiln_strbuf_t tmp = KILN_STRBUF_INIT;
      x->out = &tmp;
      parse_seq(x, top, &a, &z);
      x->out = real;
      kiln_strbuf_append_char(real, '(');
      if (!a) kiln_strbuf_append_str(real, " " JSON_CHAR "*");
      kiln_strbuf_append_char(real, ' ');
      if (kiln_strbuf_ok(&tmp)) kiln_strbuf_append(real, tmp.data, tmp.len);
      if (!z) kiln_strbuf_append_str(real, " " JSON_CHAR "*");
      kiln_strbuf_append_str(real, " )");
      if (!kiln_strbuf_ok(&tmp)) real->failed = true;
      kiln_strbuf_free(&tmp);
    } else {
      parse_seq(x, top, &a, &z);
    }
    *anch_start |= a;
    *anch_end |= z;
    first = false;
    if (x->err) return;
    if (x->p < x->end && *x->p == '|') {
      x->p++;
      continue;
    }
    break;
  }
  kiln_strbuf_append_str(x->out, " )");
}

kiln_status_t kiln_regex_to_gbnf(const char *re, size_t len, bool json_string, const char *name,
                                 const char *what, kiln_strbuf_t *out) {
  rx_t x;
  memset(&x, 0, sizeof(x));
  x.s = x.p = re;
  x.end = re + len;
  x.json = json_string;
  x.what = what ? what : "regex";
  x.out = out;
  size_t len0 = out->len;
  kiln_strbuf_printf(out, "%s ::= ", name);
  bool a = false, z = false;
  parse_alt(&x, true, &a, &z);
  if (!x.err && x.p < x.end) rx_fail(&x, x.p, "')' without a matching '('");
  kiln_strbuf_append_char(out, '\n');
  if (!x.err && !kiln_strbuf_ok(out))
    x.err = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", x.what);
  if (x.err && kiln_strbuf_ok(out)) {
    out->len = len0;
    if (out->data) out->data[len0] = '\0';
  }
  return x.err;
}
