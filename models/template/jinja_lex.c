/* jinja_lex.c - the Jinja lexer: splits template source into data and tag tokens, applying
 * whitespace control exactly as Jinja2's lexer does with trim_blocks and lstrip_blocks on.
 *
 * Jinja's rules, which this file mirrors (jinja2/lexer.py, Lexer.tokeniter):
 *  1. Source newlines (\r\n, \r) become \n and one trailing newline is dropped.
 *  2. "{%-", "{{-", "{#-" strip all whitespace before the tag; "-%}", "-}}", "-#}" all after.
 *  3. trim_blocks: a block or comment end ("%}", "#}") swallows one directly following \n
 *     ("+%}" keeps it). Variable ends never do.
 *  4. lstrip_blocks: before a block or comment start (not "{{", not "{%+"), the whitespace run
 *     between the last newline of the preceding data and the tag is removed, provided it is all
 *     whitespace and non-empty; when the data holds no newline this applies only if the
 *     previous tag's end match itself ended in a newline (or at the start of the template).
 *  5. Tag ends are recognised only when ( [ { are balanced, so "{{ {'a': {}} }}" works.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/template/template_internal.h"

typedef struct lexer {
  const char *src;
  size_t n;
  size_t pos;
  const char *name;
  kiln_arena_t *arena;
  tok_t *toks;
  size_t ntoks, cap;
  size_t line_pos; /* position line_no was computed for */
  int line_no;
  kiln_status_t err;
} lexer_t;

static bool is_ws(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

static int line_at(lexer_t *lx, size_t pos) {
  /* Positions asked for only grow (with small lookbacks inside one tag), so count forward. */
  if (pos < lx->line_pos) {
    lx->line_pos = 0;
    lx->line_no = 1;
  }
  for (size_t i = lx->line_pos; i < pos && i < lx->n; i++)
    if (lx->src[i] == '\n') lx->line_no++;
  lx->line_pos = pos;
  return lx->line_no;
}

static bool lex_fail(lexer_t *lx, size_t pos, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static bool lex_fail(lexer_t *lx, size_t pos, const char *fmt, ...) {
  char msg[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (!lx->err)
    lx->err =
        kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s:%d: %s", lx->name, line_at(lx, pos), msg);
  return false;
}

/* Out of memory is not a syntax error: its own code, no line. */
static bool lex_oom(lexer_t *lx) {
  if (!lx->err) lx->err = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", lx->name);
  return false;
}

static tok_t *lex_push(lexer_t *lx, tok_kind_t kind, size_t pos, const char *s, size_t n) {
  if (lx->ntoks == lx->cap) {
    size_t cap = lx->cap ? lx->cap * 2 : 256;
    tok_t *t = kiln_arena_zalloc(lx->arena, cap * sizeof *t, KILN_ARENA_MAX_ALIGN);
    if (!t) {
      lex_oom(lx);
      return NULL;
    }
    if (lx->ntoks) memcpy(t, lx->toks, lx->ntoks * sizeof *t);
    lx->toks = t;
    lx->cap = cap;
  }
  tok_t *t = &lx->toks[lx->ntoks++];
  memset(t, 0, sizeof *t);
  t->kind = kind;
  t->line = line_at(lx, pos);
  t->s = s;
  t->n = n;
  return t;
}

/* Emits data [b, e) with whitespace control for the tag that follows (sign '-', '+' or 0;
 * lstrip applies only before blocks and comments). */
static bool lex_data(lexer_t *lx, size_t b, size_t e, char sign, bool lstrip_ok,
                     bool line_starting) {
  if (sign == '-') {
    while (e > b && is_ws(lx->src[e - 1])) e--;
  } else if (sign != '+' && lstrip_ok) {
    size_t l = e;
    while (l > b && lx->src[l - 1] != '\n') l--;
    bool has_nl = l > b;
    if ((has_nl || line_starting) && l < e) {
      bool all_ws = true;
      for (size_t i = l; i < e; i++)
        if (!is_ws(lx->src[i])) all_ws = false;
      if (all_ws) e = l;
    }
  }
  if (e > b && !lex_push(lx, TK_TEXT, b, lx->src + b, e - b)) return false;
  return true;
}

static int hexval(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

static bool put_cp(kiln_strbuf_t *b, uint32_t cp) {
  if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) cp = 0xFFFD;
  return kiln_strbuf_append_utf8(b, cp);
}

/* Decodes a string literal body [b, e) with Python's unicode-escape rules. */
static bool lex_string(lexer_t *lx, size_t b, size_t e) {
  kiln_strbuf_t sb = KILN_STRBUF_INIT;
  const char *s = lx->src;
  size_t i = b;
  bool ok = true;
  while (i < e && ok) {
    if (s[i] != '\\' || i + 1 >= e) {
      size_t j = i;
      while (j < e && s[j] != '\\') j++;
      if (j == i) j = i + 1;
      kiln_strbuf_append(&sb, s + i, j - i);
      i = j;
      continue;
    }
    char c = s[i + 1];
    i += 2;
    switch (c) {
      case '\n': break;
      case '\\': kiln_strbuf_append_char(&sb, '\\'); break;
      case '\'': kiln_strbuf_append_char(&sb, '\''); break;
      case '"': kiln_strbuf_append_char(&sb, '"'); break;
      case 'a': kiln_strbuf_append_char(&sb, '\a'); break;
      case 'b': kiln_strbuf_append_char(&sb, '\b'); break;
      case 'f': kiln_strbuf_append_char(&sb, '\f'); break;
      case 'n': kiln_strbuf_append_char(&sb, '\n'); break;
      case 'r': kiln_strbuf_append_char(&sb, '\r'); break;
      case 't': kiln_strbuf_append_char(&sb, '\t'); break;
      case 'v': kiln_strbuf_append_char(&sb, '\v'); break;
      case 'x':
      case 'u':
      case 'U': {
        int digits = c == 'x' ? 2 : c == 'u' ? 4 : 8;
        uint32_t cp = 0;
        for (int k = 0; k < digits; k++) {
          int h = i + (size_t)k < e ? hexval(s[i + (size_t)k]) : -1;
          if (h < 0) {
            ok = lex_fail(lx, b, "truncated \\%c escape in a string literal", c);
            break;
          }
          cp = cp * 16 + (uint32_t)h;
        }
        if (!ok) break;
        i += (size_t)digits;
        /* A \uD83D\uDE00 pair combines, as Python's str would hold it when printed as UTF-8. */
        if (cp >= 0xD800 && cp <= 0xDBFF && i + 6 <= e && s[i] == '\\' && s[i + 1] == 'u') {
          uint32_t lo = 0;
          bool good = true;
          for (int k = 0; k < 4; k++) {
            int h = hexval(s[i + 2 + (size_t)k]);
            if (h < 0) good = false;
            lo = lo * 16 + (uint32_t)(h < 0 ? 0 : h);
          }
          if (good && lo >= 0xDC00 && lo <= 0xDFFF) {
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            i += 6;
          }
        }
        put_cp(&sb, cp);
        break;
      }
      case 'N': ok = lex_fail(lx, b, "\\N{...} escapes are not supported"); break;
      default:
        if (c >= '0' && c <= '7') {
          uint32_t cp = (uint32_t)(c - '0');
          for (int k = 0; k < 2 && i < e && s[i] >= '0' && s[i] <= '7'; k++, i++)
            cp = cp * 8 + (uint32_t)(s[i] - '0');
          put_cp(&sb, cp);
        } else {
          kiln_strbuf_append_char(&sb, '\\');
          kiln_strbuf_append_char(&sb, c);
        }
    }
  }
  if (ok && !kiln_strbuf_ok(&sb)) ok = lex_oom(lx);
  if (ok) {
    char *v = kiln_arena_strndup(lx->arena, sb.data ? sb.data : "", sb.len);
    if (!v || !lex_push(lx, TK_STRING, b, v, sb.len)) ok = lex_oom(lx);
  }
  kiln_strbuf_free(&sb);
  return ok;
}

static bool is_digit(char c) { return c >= '0' && c <= '9'; }
static bool is_name_start(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (unsigned char)c >= 0x80;
}
static bool is_name_char(char c) { return is_name_start(c) || is_digit(c); }

/* Scans digits with '_' separators ("1_000") from p; returns the end. */
static size_t scan_digits(const char *s, size_t n, size_t p) {
  while (p < n && (is_digit(s[p]) ||
                   (s[p] == '_' && p + 1 < n && is_digit(s[p + 1]) && p > 0 && is_digit(s[p - 1]))))
    p++;
  return p;
}

static bool lex_number(lexer_t *lx, size_t *pp) {
  const char *s = lx->src;
  size_t p = *pp, n = lx->n, start = p;
  char buf[128];
  size_t e = scan_digits(s, n, p);
  bool is_float = false;
  bool after_dot = start > 0 && s[start - 1] == '.';
  size_t fe = e;
  if (!after_dot) {
    if (fe + 1 < n && s[fe] == '.' && is_digit(s[fe + 1])) {
      fe = scan_digits(s, n, fe + 1);
      is_float = true;
    }
    if (fe < n && (s[fe] == 'e' || s[fe] == 'E')) {
      size_t q = fe + 1;
      if (q < n && (s[q] == '+' || s[q] == '-')) q++;
      if (q < n && is_digit(s[q])) {
        fe = scan_digits(s, n, q);
        is_float = true;
      }
    }
  }
  if (is_float) e = fe;
  size_t k = 0;
  for (size_t i = start; i < e && k + 1 < sizeof buf; i++)
    if (s[i] != '_') buf[k++] = s[i];
  buf[k] = '\0';
  if (e - start >= sizeof buf - 1) return lex_fail(lx, start, "number literal too long");
  tok_t *t = lex_push(lx, is_float ? TK_FLOAT : TK_INT, start, s + start, e - start);
  if (!t) return false;
  if (is_float) {
    t->f = strtod(buf, NULL);
  } else {
    /* Python ints are unbounded; ours are int64. */
    int64_t v = 0;
    for (size_t i = 0; i < k; i++) {
      int d = buf[i] - '0';
      if (v > (INT64_MAX - d) / 10)
        return lex_fail(lx, start, "integer literal %s is too large", buf);
      v = v * 10 + d;
    }
    t->i = v;
  }
  *pp = e;
  return true;
}

static const char *const ops2[] = {"//", "**", "==", "!=", ">=", "<="};
static const char ops1[] = "+-/*%~[](){}><=.:|,;";

/* Lexes the inside of a {{ }} or {% %} tag starting at *pp; stops after the end delimiter and
 * applies the end's whitespace control. Sets *out_line_starting. */
static bool lex_tag(lexer_t *lx, size_t *pp, bool block, bool *out_line_starting) {
  const char *s = lx->src;
  size_t n = lx->n, p = *pp;
  char stack[64];
  int depth = 0;
  size_t open = p;
  for (;;) {
    if (p >= n)
      return lex_fail(lx, open, "unexpected end of template, expected '%s'", block ? "%}" : "}}");
    if (depth == 0) {
      char c0 = s[p];
      const char *end = block ? "%}" : "}}";
      size_t endlen = 0;
      char sign = 0;
      if ((c0 == '-' || (block && c0 == '+')) && p + 2 < n + 1 && strncmp(s + p + 1, end, 2) == 0) {
        sign = c0;
        endlen = 3;
      } else if (p + 1 < n && strncmp(s + p, end, 2) == 0) {
        endlen = 2;
      }
      if (endlen) {
        if (!lex_push(lx, block ? TK_BLOCK_END : TK_VAR_END, p, s + p, endlen)) return false;
        p += endlen;
        if (sign == '-') {
          while (p < n && is_ws(s[p])) p++;
        } else if (block && sign == 0 && p < n && s[p] == '\n') {
          p++;
        }
        *out_line_starting = s[p - 1] == '\n';
        *pp = p;
        return true;
      }
    }
    char c = s[p];
    if (is_ws(c)) {
      p++;
      continue;
    }
    if (is_digit(c)) {
      if (!lex_number(lx, &p)) return false;
      continue;
    }
    if (is_name_start(c)) {
      size_t b = p;
      while (p < n && is_name_char(s[p])) p++;
      if (!lex_push(lx, TK_NAME, b, s + b, p - b)) return false;
      continue;
    }
    if (c == '\'' || c == '"') {
      size_t b = p + 1, q = b;
      while (q < n && s[q] != c) q += s[q] == '\\' ? 2 : 1;
      if (q >= n) return lex_fail(lx, p, "unterminated string literal");
      if (!lex_string(lx, b, q)) return false;
      p = q + 1;
      continue;
    }
    size_t oplen = 0;
    for (size_t k = 0; k < sizeof ops2 / sizeof *ops2; k++)
      if (p + 1 < n && s[p] == ops2[k][0] && s[p + 1] == ops2[k][1]) oplen = 2;
    if (!oplen && strchr(ops1, c) && c) oplen = 1;
    if (!oplen) {
      if (c == '!') return lex_fail(lx, p, "unexpected char '!'");
      return lex_fail(lx, p, "unexpected char '%c'", c);
    }
    if (oplen == 1 && (c == '(' || c == '[' || c == '{')) {
      if (depth == (int)sizeof stack) return lex_fail(lx, p, "brackets nested too deeply");
      stack[depth++] = c == '(' ? ')' : c == '[' ? ']' : '}';
    } else if (oplen == 1 && (c == ')' || c == ']' || c == '}')) {
      if (depth == 0) return lex_fail(lx, p, "unexpected '%c'", c);
      if (stack[depth - 1] != c)
        return lex_fail(lx, p, "unexpected '%c', expected '%c'", c, stack[depth - 1]);
      depth--;
    }
    if (!lex_push(lx, TK_OP, p, s + p, oplen)) return false;
    p += oplen;
  }
}

/* Matches "raw" / "endraw" after "{%" at p: [-+]? \s* word \s* then the end; returns the
 * position after the whole tag (with its whitespace control) or 0. Sets *out_sign (the sign
 * after "{%") and *out_line_starting. trim: whether "%}" swallows a newline (endraw yes, raw no).
 */
static size_t match_raw_tag(lexer_t *lx, size_t p, const char *word, bool trim, char *out_sign,
                            bool *out_line_starting) {
  const char *s = lx->src;
  size_t n = lx->n, wl = strlen(word);
  char sign = 0;
  if (p < n && (s[p] == '-' || s[p] == '+')) sign = s[p++];
  while (p < n && is_ws(s[p])) p++;
  if (p + wl > n || memcmp(s + p, word, wl) != 0) return 0;
  p += wl;
  while (p < n && is_ws(s[p])) p++;
  if (trim && p + 2 < n && s[p] == '+' && s[p + 1] == '%' && s[p + 2] == '}') {
    p += 3;
  } else if (p + 2 < n && s[p] == '-' && s[p + 1] == '%' && s[p + 2] == '}') {
    p += 3;
    while (p < n && is_ws(s[p])) p++;
  } else if (p + 1 < n && s[p] == '%' && s[p + 1] == '}') {
    p += 2;
    if (trim && p < n && s[p] == '\n') p++;
  } else {
    return 0;
  }
  *out_sign = sign;
  *out_line_starting = s[p - 1] == '\n';
  return p;
}

static size_t find_tag_start(const char *s, size_t n, size_t p) {
  for (; p + 1 < n; p++) {
    const char *q = memchr(s + p, '{', n - p - 1);
    if (!q) return n;
    p = (size_t)(q - s);
    char c = s[p + 1];
    if (c == '{' || c == '%' || c == '#') return p;
  }
  return n;
}

static bool lex_run(lexer_t *lx) {
  const char *s = lx->src;
  size_t n = lx->n, pos = 0;
  bool line_starting = true;
  while (pos < n) {
    size_t t = find_tag_start(s, n, pos);
    if (t >= n) return lex_data(lx, pos, n, 0, false, false);
    char kind = s[t + 1];
    size_t p = t + 2;
    char sign = (p < n && (s[p] == '-' || s[p] == '+')) ? s[p] : 0;
    if (kind == '%') {
      char rsign;
      bool ls;
      size_t after = match_raw_tag(lx, p, "raw", false, &rsign, &ls);
      if (after) {
        if (!lex_data(lx, pos, t, rsign, true, line_starting)) return false;
        /* the body runs to the first complete endraw tag */
        size_t q = after, end = 0, body_end = 0;
        char esign = 0;
        bool els = false;
        while ((q = find_tag_start(s, n, q)) < n) {
          if (s[q + 1] == '%' && (end = match_raw_tag(lx, q + 2, "endraw", true, &esign, &els))) {
            body_end = q;
            break;
          }
          q++;
        }
        if (!end) return lex_fail(lx, t, "Missing end of raw directive");
        if (!lex_data(lx, after, body_end, esign, true, ls)) return false;
        line_starting = els;
        pos = end;
        continue;
      }
    }
    if (!lex_data(lx, pos, t, sign, kind != '{', line_starting)) return false;
    if (sign) p++;
    if (kind == '#') {
      size_t e = p;
      while (e + 1 < n && !(s[e] == '#' && s[e + 1] == '}')) e++;
      if (e + 1 >= n) return lex_fail(lx, t, "Missing end of comment tag");
      size_t after = e + 2;
      if (e > p && s[e - 1] == '-') {
        while (after < n && is_ws(s[after])) after++;
      } else if (!(e > p && s[e - 1] == '+') && after < n && s[after] == '\n') {
        after++;
      }
      line_starting = s[after - 1] == '\n';
      pos = after;
      continue;
    }
    bool block = kind == '%';
    if (!lex_push(lx, block ? TK_BLOCK_BEGIN : TK_VAR_BEGIN, t, s + t, p - t)) return false;
    if (!lex_tag(lx, &p, block, &line_starting)) return false;
    pos = p;
  }
  return true;
}

kiln_status_t tpl_lex(const char *src, size_t len, const char *name, kiln_arena_t *a,
                      tok_t **out_toks, size_t *out_n) {
  *out_toks = NULL;
  *out_n = 0;
  char *norm = kiln_arena_zalloc(a, len + 1, KILN_ARENA_MAX_ALIGN);
  if (!norm) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", name);
  size_t k = 0;
  for (size_t i = 0; i < len; i++) {
    if (src[i] == '\r') {
      norm[k++] = '\n';
      if (i + 1 < len && src[i + 1] == '\n') i++;
    } else {
      norm[k++] = src[i];
    }
  }
  if (k > 0 && norm[k - 1] == '\n') k--;
  norm[k] = '\0';
  lexer_t lx = {.src = norm, .n = k, .name = name, .arena = a, .line_no = 1};
  if (lex_run(&lx)) lex_push(&lx, TK_EOF, k, norm + k, 0);
  if (lx.err) return lx.err;
  *out_toks = lx.toks;
  *out_n = lx.ntoks;
  return NULL;
}
