/* schema.c - JSON Schema to GBNF (kiln_schema_to_gbnf), and the GBNF of every constraint kind
 * (kiln_guide_to_gbnf).
 *
 * The output is always JSON that validates against the schema. Where JSON Schema allows a
 * choice, the grammar takes the narrower, conventional one (as OpenAI's structured outputs
 * and xgrammar do), so the output still validates:
 *   - object properties come in the schema's order; required ones always, optional ones may
 *     be left out; `additionalProperties` absent means none when the schema lists
 *     `properties` (any, when it lists none); extra properties (additionalProperties true or
 *     a schema) come after the listed ones, with keys that differ from theirs (raw
 *     characters, no escapes);
 *   - array items after `prefixItems` are allowed only when `items` says so;
 *   - numbers have at most 16 integer and 15 fraction digits and a two-digit exponent;
 *     strings' \u escapes exclude lone surrogates; at most 16 characters of [ \t\n] between tokens.
 * Keywords: type (one or a list), enum, const, anyOf, oneOf (as anyOf: its branches must not
 * overlap), allOf (object schemas, merged), $ref (JSON pointers into the document: #, #/$defs/x,
 * #/definitions/x, ...; recursion allowed), properties, required, additionalProperties,
 * items, prefixItems (and draft-7 items arrays with additionalItems), minItems, maxItems,
 * uniqueItems: false, minLength, maxLength, pattern, format (date, time, date-time, uuid,
 * email, ipv4), minimum, maximum, exclusiveMinimum, exclusiveMaximum (integer bounds for
 * numbers; any for integers), nullable (OpenAPI). Annotations are ignored (title,
 * description, default, examples, $schema, $id, $comment, deprecated, readOnly, writeOnly,
 * discriminator, x-*). Any other keyword is refused, naming it and where it is. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/json.h"
#include "core/guide/grammar.h"

#define SC_MAX_DEPTH 64
#define NUM_INT_DIGITS 16

typedef struct memo {
  const kiln_json_t *node;
  int32_t id;
} memo_t;

typedef struct sc {
  const kiln_json_t *root;
  kiln_strbuf_t *rules; /* complete rule lines */
  const char *what;
  kiln_status_t err;
  int32_t next_id;
  memo_t *memo;
  int32_t nmemo, capmemo;
  int depth;
  kiln_json_doc_t **docs; /* merged allOf documents: the memo holds their nodes until the end */
  int32_t ndocs;
} sc_t;

static void sc_fail(sc_t *c, const char *path, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void sc_fail(sc_t *c, const char *path, const char *fmt, ...) {
  if (c->err) return;
  char msg[600];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  c->err = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: %s%s%s", c->what,
                            path && *path ? path : "", path && *path ? ": " : "", msg);
}

/* ---- GBNF output helpers --------------------------------------------------------------------- */

/* A GBNF literal for the bytes s[0..n) (valid UTF-8). */
static void lit(kiln_strbuf_t *o, const char *s, size_t n) {
  kiln_strbuf_append_char(o, '"');
  for (size_t i = 0; i < n; i++) {
    unsigned char ch = (unsigned char)s[i];
    if (ch == '"' || ch == '\\')
      kiln_strbuf_printf(o, "\\%c", ch);
    else if (ch < 0x20 || ch == 0x7F)
      kiln_strbuf_printf(o, "\\x%02X", ch);
    else
      kiln_strbuf_append_char(o, (char)ch);
  }
  kiln_strbuf_append_char(o, '"');
}

/* A JSON value written compactly, as a GBNF literal. */
static void lit_json(kiln_strbuf_t *o, const kiln_json_t *v) {
  kiln_strbuf_t t = KILN_STRBUF_INIT;
  kiln_json_write(&t, v, false, false);
  if (!kiln_strbuf_ok(&t)) o->failed = true;
  lit(o, t.data ? t.data : "", t.len);
  kiln_strbuf_free(&t);
}

static int32_t new_id(sc_t *c) { return c->next_id++; }

/* ---- the fixed part ------------------------------------------------------------------------- */

static const char PRELUDE[] =
    "ws ::= [ \\t\\n]{0,16}\n"
    "json-value ::= json-object | json-array | json-string | json-number | \"true\" | \"false\" "
    "| \"null\"\n"
    "json-object ::= \"{\" ws ( json-member ( ws \",\" ws json-member )* ws )? \"}\"\n"
    "json-member ::= json-string ws \":\" ws json-value\n"
    "json-array ::= \"[\" ws ( json-value ( ws \",\" ws json-value )* ws )? \"]\"\n"
    "json-string ::= \"\\\"\" json-char* \"\\\"\"\n"
    "json-char ::= [^\"\\\\\\x00-\\x1F] | \"\\\\\" ( [\"\\\\/bfnrt] | \"u\" ( [0-9a-cA-C] "
    "[0-9a-fA-F]{3} | [dD] [0-7] [0-9a-fA-F]{2} | [eEfF] [0-9a-fA-F]{3} ) )\n"
    "json-int ::= \"-\"? ( \"0\" | [1-9] [0-9]{0,15} )\n"
    "json-frac ::= \".\" [0-9]{1,15}\n"
    "json-number ::= json-int json-frac? ( [eE] [-+]? [0-9]{1,2} )?\n"
    "json-bool ::= \"true\" | \"false\"\n"
    "json-key-char ::= [^\"\\\\\\x00-\\x1F]\n";

/* ---- integer and number ranges ----------------------------------------------------------- */

/* Digit strings of equal length n between s and t (s <= t). */
static void same_len(kiln_strbuf_t *o, const char *s, const char *t, int n) {
  if (n == 0) {
    kiln_strbuf_append_str(o, "\"\"");
    return;
  }
  int k = 0;
  while (k < n && s[k] == t[k]) k++;
  if (k > 0) {
    kiln_strbuf_printf(o, "\"%.*s\" ", k, s);
    if (k == n) return;
  }
  s += k;
  t += k;
  n -= k;
  bool s0 = true, t9 = true;
  for (int i = 1; i < n; i++) {
    s0 &= s[i] == '0';
    t9 &= t[i] == '9';
  }
  if (s0 && t9) {
    kiln_strbuf_printf(o, "[%c-%c]", s[0], t[0]);
    if (n > 1) kiln_strbuf_printf(o, " [0-9]{%d}", n - 1);
    return;
  }
  char nines[32], zeros[32];
  memset(nines, '9', sizeof(nines));
  memset(zeros, '0', sizeof(zeros));
  kiln_strbuf_append_str(o, "( ");
  /* s[0] followed by >= s[1..] */
  kiln_strbuf_printf(o, "\"%c\" ( ", s[0]);
  same_len(o, s + 1, nines, n - 1);
  kiln_strbuf_append_str(o, " )");
  if (s[0] + 1 <= t[0] - 1) {
    kiln_strbuf_printf(o, " | [%c-%c]", s[0] + 1, t[0] - 1);
    if (n > 1) kiln_strbuf_printf(o, " [0-9]{%d}", n - 1);
  }
  kiln_strbuf_printf(o, " | \"%c\" ( ", t[0]);
  same_len(o, zeros, t + 1, n - 1);
  kiln_strbuf_append_str(o, " ) )");
}

/* Non-negative integers in [a, b] without leading zeros; b < 0 means no upper bound (at most
 * NUM_INT_DIGITS digits). */
static void uint_range(kiln_strbuf_t *o, uint64_t a, int64_t b) {
  char as[32], bs[32];
  int la = snprintf(as, sizeof(as), "%llu", (unsigned long long)a);
  int lb = b >= 0 ? snprintf(bs, sizeof(bs), "%lld", (long long)b) : NUM_INT_DIGITS;
  if (la > lb) lb = la;
  kiln_strbuf_append_str(o, "( ");
  bool first = true;
  for (int len = la; len <= lb; len++) {
    char lo[32], hi[32];
    if (len == la) {
      memcpy(lo, as, (size_t)la);
    } else {
      lo[0] = '1';
      memset(lo + 1, '0', (size_t)len - 1);
    }
    if (b >= 0 && len == lb) {
      memcpy(hi, bs, (size_t)lb);
    } else {
      memset(hi, '9', (size_t)len);
    }
    if (len == 1 && lo[0] > hi[0]) continue;
    if (!first) kiln_strbuf_append_str(o, " | ");
    first = false;
    if (len > 1 && b < 0 && len == la + 1 && lb > la + 1) {
      /* every longer length at once: [1-9] [0-9]{la, NUM_INT_DIGITS - 1} */
      kiln_strbuf_printf(o, "[1-9] [0-9]{%d,%d}", la, NUM_INT_DIGITS - 1);
      break;
    }
    kiln_strbuf_append_str(o, "( ");
    same_len(o, lo, hi, len);
    kiln_strbuf_append_str(o, " )");
  }
  if (first) kiln_strbuf_append_str(o, "[0-9]"); /* not reached: a <= b */
  kiln_strbuf_append_str(o, " )");
}

/* Integers in [lo, hi] (has_lo / has_hi false = unbounded). */
static void int_range(sc_t *c, kiln_strbuf_t *o, const char *path, bool has_lo, int64_t lo,
                      bool has_hi, int64_t hi) {
  if (has_lo && has_hi && lo > hi) {
    sc_fail(c, path, "the bounds leave no integer (minimum %lld > maximum %lld)", (long long)lo,
            (long long)hi);
    return;
  }
  if (!has_lo && !has_hi) {
    kiln_strbuf_append_str(o, "json-int");
    return;
  }
  kiln_strbuf_append_str(o, "( ");
  bool any = false;
  /* negative part: [lo, min(hi, -1)] -> "-" magnitude in [max(1, -hi), -lo] */
  if (!has_lo || lo < 0) {
    uint64_t mlo = has_hi && hi < 0 ? (uint64_t)(-(hi + 1)) + 1 : 1;
    int64_t mhi = has_lo ? (int64_t)((uint64_t)(-(lo + 1)) + 1) : -1;
    if (has_lo && lo == INT64_MIN) mhi = INT64_MAX;
    kiln_strbuf_append_str(o, "\"-\" ");
    uint_range(o, mlo, mhi);
    any = true;
  }
  if (!has_hi || hi >= 0) {
    if (any) kiln_strbuf_append_str(o, " | ");
    uint_range(o, has_lo && lo > 0 ? (uint64_t)lo : 0, has_hi ? hi : -1);
  }
  kiln_strbuf_append_str(o, " )");
}

/* Non-negative decimals m with a <= m (a < m when !inc_a) and m <= b (m < b when !inc_b);
 * b < 0: no upper bound. a and b are integers. */
static void mag_range(kiln_strbuf_t *o, int64_t a, bool inc_a, int64_t b, bool inc_b) {
  static const char ANYF[] = "( \".\" [0-9]{1,15} )?";
  static const char ZEROF[] = "( \".\" \"0\"{1,15} )?";
  static const char NZF[] = "\".\" \"0\"{0,14} [1-9] [0-9]{0,14}";
  kiln_strbuf_append_str(o, "( ");
  bool first = true;
#define ALT() (first ? (void)(first = false) : (void)kiln_strbuf_append_str(o, " | "))
  if (b < 0 || b - a >= 2) { /* integer part strictly between */
    ALT();
    uint_range(o, (uint64_t)a + 1, b < 0 ? -1 : b - 1);
    kiln_strbuf_printf(o, " %s", ANYF);
  }
  /* integer part a */
  if (b >= 0 && a == b) {
    if (inc_a && inc_b) {
      ALT();
      kiln_strbuf_printf(o, "\"%lld\" %s", (long long)a, ZEROF);
    }
  } else {
    ALT();
    kiln_strbuf_printf(o, "\"%lld\" %s", (long long)a, inc_a ? ANYF : NZF);
  }
  /* integer part b */
  if (b >= 0 && b > a && inc_b) {
    ALT();
    kiln_strbuf_printf(o, "\"%lld\" %s", (long long)b, ZEROF);
  }
  if (first) kiln_strbuf_append_str(o, "\"\"");
#undef ALT
  kiln_strbuf_append_str(o, " )");
}

/* ---- schema helpers ---------------------------------------------------------------------- */

static bool is_annotation(const char *k) {
  static const char *const ann[] = {
      "title",       "description", "default",       "examples",
      "$schema",     "$id",         "$comment",      "deprecated",
      "readOnly",    "writeOnly",   "discriminator", "$defs",
      "definitions", "$anchor",     "example",       "contentEncoding",
      NULL};
  if (!strncmp(k, "x-", 2)) return true;
  for (int i = 0; ann[i]; i++)
    if (!strcmp(k, ann[i])) return true;
  return false;
}

static const kiln_json_t *get(const kiln_json_t *n, const char *k) { return kiln_json_get(n, k); }

static void path_join(char *dst, size_t cap, const char *path, const char *k) {
  if (path && *path)
    snprintf(dst, cap, "%s.%s", path, k);
  else
    snprintf(dst, cap, "%s", k);
}

/* Resolves a $ref (a JSON pointer into the document). */
static const kiln_json_t *resolve(sc_t *c, const char *path, const char *ref) {
  if (ref[0] != '#') {
    sc_fail(c, path, "$ref '%s': only references into the schema itself (#/...) are supported",
            ref);
    return NULL;
  }
  const kiln_json_t *n = c->root;
  const char *p = ref + 1;
  if (*p && *p != '/') {
    sc_fail(c, path, "$ref '%s': anchors are not supported; use a JSON pointer (#/$defs/name)",
            ref);
    return NULL;
  }
  while (*p == '/') {
    p++;
    char tok[512];
    size_t k = 0;
    while (*p && *p != '/' && k + 1 < sizeof(tok)) {
      if (p[0] == '~' && p[1] == '0') {
        tok[k++] = '~';
        p += 2;
      } else if (p[0] == '~' && p[1] == '1') {
        tok[k++] = '/';
        p += 2;
      } else if (p[0] == '%' && p[1] && p[2]) {
        char hx[3] = {p[1], p[2], 0};
        tok[k++] = (char)strtol(hx, NULL, 16);
        p += 3;
      } else {
        tok[k++] = *p++;
      }
    }
    tok[k] = '\0';
    if (kiln_json_is(n, KILN_JSON_ARRAY)) {
      char *e;
      long i = strtol(tok, &e, 10);
      n = *e || e == tok ? NULL : kiln_json_at(n, (size_t)i);
    } else {
      n = kiln_json_getn(n, tok, k);
    }
    if (!n) {
      sc_fail(c, path, "$ref '%s' points to nothing", ref);
      return NULL;
    }
  }
  return n;
}

static int32_t gen(sc_t *c, const kiln_json_t *s, const char *path);

/* The type names a schema allows: a bit set of 1 << KILN_JSON_*, with integer as bit 6. */
enum {
  T_NULL = 1,
  T_BOOL = 2,
  T_NUMBER = 4,
  T_STRING = 8,
  T_ARRAY = 16,
  T_OBJECT = 32,
  T_INT = 64
};

static int type_bit(const char *t) {
  if (!strcmp(t, "null")) return T_NULL;
  if (!strcmp(t, "boolean")) return T_BOOL;
  if (!strcmp(t, "number")) return T_NUMBER;
  if (!strcmp(t, "integer")) return T_INT;
  if (!strcmp(t, "string")) return T_STRING;
  if (!strcmp(t, "array")) return T_ARRAY;
  if (!strcmp(t, "object")) return T_OBJECT;
  return 0;
}

static bool has_any(const kiln_json_t *s, const char *const *keys) {
  for (int i = 0; keys[i]; i++)
    if (get(s, keys[i])) return true;
  return false;
}

static const char *const STR_KEYS[] = {"minLength", "maxLength", "pattern", "format", NULL};
static const char *const NUM_KEYS[] = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                                       NULL};
static const char *const ARR_KEYS[] = {"items",           "prefixItems", "minItems", "maxItems",
                                       "additionalItems", "uniqueItems", NULL};
static const char *const OBJ_KEYS[] = {"properties", "required", "additionalProperties", NULL};

/* Reads a non-negative integer keyword (absent: dflt). */
static int64_t get_count(sc_t *c, const kiln_json_t *s, const char *k, int64_t dflt,
                         const char *path) {
  const kiln_json_t *v = get(s, k);
  if (!v) return dflt;
  int64_t x;
  if (!kiln_json_int64(v, &x) || x < 0) {
    sc_fail(c, path, "'%s' must be a non-negative integer", k);
    return dflt;
  }
  return x;
}

/* ---- strings ----------------------------------------------------------------------------- */

static void gen_format(sc_t *c, kiln_strbuf_t *o, const char *fmt, const char *path) {
  static const char DATE[] =
      "( [0-9]{4} \"-\" ( ( \"01\" | \"03\" | \"05\" | \"07\" | \"08\" | \"10\" | \"12\" ) \"-\" "
      "( \"0\" [1-9] | [12] [0-9] | \"3\" [01] ) | ( \"04\" | \"06\" | \"09\" | \"11\" ) \"-\" "
      "( \"0\" [1-9] | [12] [0-9] | \"30\" ) | \"02-\" ( \"0\" [1-9] | \"1\" [0-9] | \"2\" [0-8] "
      ") ) | ( [0-9]{2} ( \"0\" [48] | [2468] [048] | [13579] [26] ) | ( \"0\" [48] | [2468] "
      "[048] | [13579] [26] ) \"00\" ) \"-02-29\" )";
  static const char TIME[] =
      "( ( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] \":\" [0-5] [0-9] ( \".\" [0-9]{1,6} )? "
      "( \"Z\" | [+-] ( [01] [0-9] | \"2\" [0-3] ) \":\" [0-5] [0-9] ) )";
  static const char ATOM[] = "[a-zA-Z0-9!#$%&'*+/=?^_`{|}~\\-]+";
  static const char LABEL[] = "[a-zA-Z0-9] ( [a-zA-Z0-9\\-]{0,61} [a-zA-Z0-9] )?";
  static const char OCTET[] =
      "( \"25\" [0-5] | \"2\" [0-4] [0-9] | \"1\" [0-9] [0-9] | [1-9]? [0-9] )";
  kiln_strbuf_append_str(o, "\"\\\"\" ");
  if (!strcmp(fmt, "date")) {
    kiln_strbuf_append_str(o, DATE);
  } else if (!strcmp(fmt, "time")) {
    kiln_strbuf_append_str(o, TIME);
  } else if (!strcmp(fmt, "date-time")) {
    kiln_strbuf_printf(o, "%s \"T\" %s", DATE, TIME);
  } else if (!strcmp(fmt, "uuid")) {
    kiln_strbuf_append_str(o,
                           "[0-9a-f]{8} \"-\" [0-9a-f]{4} \"-\" [0-9a-f]{4} \"-\" [0-9a-f]{4} "
                           "\"-\" [0-9a-f]{12}");
  } else if (!strcmp(fmt, "email")) {
    kiln_strbuf_printf(o, "%s ( \".\" %s )* \"@\" ( %s \".\" )+ %s", ATOM, ATOM, LABEL, LABEL);
  } else if (!strcmp(fmt, "ipv4")) {
    kiln_strbuf_printf(o, "%s \".\" %s \".\" %s \".\" %s", OCTET, OCTET, OCTET, OCTET);
  } else {
    sc_fail(c, path,
            "format '%s' is not supported (supported: date, time, date-time, uuid, email, ipv4)",
            fmt);
  }
  kiln_strbuf_append_str(o, " \"\\\"\"");
}

static void gen_string(sc_t *c, kiln_strbuf_t *o, const kiln_json_t *s, const char *path) {
  const kiln_json_t *fmt = get(s, "format"), *pat = get(s, "pattern");
  bool lens = get(s, "minLength") || get(s, "maxLength");
  if (fmt) {
    if (!kiln_json_is(fmt, KILN_JSON_STRING)) {
      sc_fail(c, path, "'format' must be a string");
      return;
    }
    if (lens || pat) {
      sc_fail(c, path, "'format' together with minLength, maxLength or pattern is not supported");
      return;
    }
    gen_format(c, o, kiln_json_string(fmt, NULL), path);
    return;
  }
  if (pat) {
    size_t pl;
    const char *ps = kiln_json_string(pat, &pl);
    if (!ps) {
      sc_fail(c, path, "'pattern' must be a string");
      return;
    }
    if (lens) {
      sc_fail(c, path, "'pattern' together with minLength or maxLength is not supported");
      return;
    }
    int32_t id = new_id(c);
    char name[32], what[600];
    snprintf(name, sizeof(name), "p%d", (int)id);
    snprintf(what, sizeof(what), "%s: %s%spattern", c->what, path, *path ? "." : "");
    kiln_status_t st = kiln_regex_to_gbnf(ps, pl, true, name, what, c->rules);
    if (st) {
      if (!c->err)
        c->err = st;
      else
        kiln_status_free(st);
      return;
    }
    kiln_strbuf_printf(o, "\"\\\"\" p%d \"\\\"\"", (int)id);
    return;
  }
  if (lens) {
    int64_t mn = get_count(c, s, "minLength", 0, path), mx = get_count(c, s, "maxLength", -1, path);
    if (mx >= 0 && mx < mn) {
      sc_fail(c, path, "maxLength %lld is below minLength %lld", (long long)mx, (long long)mn);
      return;
    }
    if (mn > KILN_GRAMMAR_MAX_REPEAT || mx > KILN_GRAMMAR_MAX_REPEAT) {
      sc_fail(c, path, "string lengths above %d are not supported", KILN_GRAMMAR_MAX_REPEAT);
      return;
    }
    if (mx >= 0)
      kiln_strbuf_printf(o, "\"\\\"\" json-char{%lld,%lld} \"\\\"\"", (long long)mn, (long long)mx);
    else
      kiln_strbuf_printf(o, "\"\\\"\" json-char{%lld,} \"\\\"\"", (long long)mn);
    return;
  }
  kiln_strbuf_append_str(o, "json-string");
}

/* ---- numbers ----------------------------------------------------------------------------- */

/* A bound keyword: *has, *v (integer after rounding for integers), *inc. */
static bool read_bound(sc_t *c, const kiln_json_t *s, bool lower, bool integer, bool *has,
                       int64_t *v, bool *inc, const char *path) {
  const char *kin = lower ? "minimum" : "maximum",
             *kex = lower ? "exclusiveMinimum" : "exclusiveMaximum";
  const kiln_json_t *bi = get(s, kin), *be = get(s, kex);
  *has = false;
  *inc = true;
  double x = 0;
  bool ex = false;
  if (be && kiln_json_is(be, KILN_JSON_BOOL)) { /* draft 4: a flag on minimum / maximum */
    ex = kiln_json_bool(be);
    be = NULL;
  }
  if (bi && !kiln_json_is(bi, KILN_JSON_NUMBER)) {
    sc_fail(c, path, "'%s' must be a number", kin);
    return false;
  }
  if (be && !kiln_json_is(be, KILN_JSON_NUMBER)) {
    sc_fail(c, path, "'%s' must be a number", kex);
    return false;
  }
  if (bi) {
    *has = true;
    x = kiln_json_number(bi);
    *inc = !ex;
  }
  if (be) {
    double y = kiln_json_number(be);
    if (!*has || (lower ? y >= x : y <= x)) {
      x = y;
      *inc = false;
    }
    *has = true;
  }
  if (!*has) return true;
  if (!(fabs(x) < 9.0e15)) {
    sc_fail(c, path, "the bound %g is too large (at most 9e15 in magnitude)", x);
    return false;
  }
  if (integer) {
    double r = lower ? ceil(x) : floor(x);
    if (!*inc && r == x) r += lower ? 1 : -1;
    *v = (int64_t)r;
    *inc = true;
    return true;
  }
  if (x != floor(x)) {
    sc_fail(c, path, "'%s' = %g: only integer bounds are supported for numbers", be ? kex : kin, x);
    return false;
  }
  *v = (int64_t)x;
  return true;
}

static void gen_number(sc_t *c, kiln_strbuf_t *o, const kiln_json_t *s, bool integer,
                       const char *path) {
  bool hl, hh, il, ih;
  int64_t lo = 0, hi = 0;
  if (!read_bound(c, s, true, integer, &hl, &lo, &il, path) ||
      !read_bound(c, s, false, integer, &hh, &hi, &ih, path))
    return;
  if (integer) {
    int_range(c, o, path, hl, lo, hh, hi);
    return;
  }
  if (!hl && !hh) {
    kiln_strbuf_append_str(o, "json-number");
    return;
  }
  if (hl && hh && (lo > hi || (lo == hi && !(il && ih)))) {
    sc_fail(c, path, "the bounds leave no number");
    return;
  }
  kiln_strbuf_append_str(o, "( ");
  bool any = false;
  /* x >= 0 */
  if (!hh || hi > 0 || (hi == 0 && ih)) {
    int64_t a = hl && lo > 0 ? lo : 0;
    bool ia = hl && lo > 0 ? il : (hl && lo == 0 ? il : true);
    mag_range(o, a, ia, hh ? hi : -1, ih);
    any = true;
  }
  /* x < 0: "-" magnitude m > 0 with m >= -hi (hi < 0) and m <= -lo */
  if (!hl || lo < 0) {
    int64_t a = hh && hi < 0 ? -hi : 0;
    bool ia = hh && hi < 0 ? ih : false;
    if (any) kiln_strbuf_append_str(o, " | ");
    kiln_strbuf_append_str(o, "\"-\" ");
    mag_range(o, a, ia, hl ? -lo : -1, il);
  }
  kiln_strbuf_append_str(o, " )");
}

/* ---- arrays ------------------------------------------------------------------------------ */

static void gen_array(sc_t *c, kiln_strbuf_t *o, const kiln_json_t *s, const char *path) {
  char sub[1024];
  const kiln_json_t *items = get(s, "items"), *prefix = get(s, "prefixItems");
  const kiln_json_t *addl = get(s, "additionalItems");
  const kiln_json_t *uniq = get(s, "uniqueItems");
  if (uniq && (!kiln_json_is(uniq, KILN_JSON_BOOL) || kiln_json_bool(uniq))) {
    sc_fail(c, path, "'uniqueItems': true is not supported");
    return;
  }
  if (kiln_json_is(items, KILN_JSON_ARRAY)) { /* draft 7 tuple form */
    if (prefix) {
      sc_fail(c, path, "'items' as an array together with 'prefixItems'");
      return;
    }
    prefix = items;
    items = addl;
  } else if (addl) {
    sc_fail(c, path, "'additionalItems' needs 'items' as an array");
    return;
  }
  if (prefix && !kiln_json_is(prefix, KILN_JSON_ARRAY)) {
    sc_fail(c, path, "'prefixItems' must be an array");
    return;
  }
  int64_t np = prefix ? (int64_t)kiln_json_len(prefix) : 0;
  int64_t mn = get_count(c, s, "minItems", 0, path), mx = get_count(c, s, "maxItems", -1, path);
  if (c->err) return;
  /* items: absent = any value when there is no prefixItems, none after a prefix (strict) */
  bool more = true;
  int32_t item = -1;
  if (items && kiln_json_is(items, KILN_JSON_BOOL) && !kiln_json_bool(items)) {
    more = false;
  } else if (!items && prefix) {
    more = false;
  } else if (items) {
    path_join(sub, sizeof(sub), path, "items");
    item = gen(c, items, sub);
  }
  if (c->err) return;
  if (!more) mx = mx < 0 || mx > np ? np : mx;
  if (mx >= 0 && mx < mn) {
    sc_fail(c, path, "no array fits: at most %lld items but minItems %lld", (long long)mx,
            (long long)mn);
    return;
  }
  if (mn > KILN_GRAMMAR_MAX_REPEAT || mx > KILN_GRAMMAR_MAX_REPEAT) {
    sc_fail(c, path, "array lengths above %d are not supported", KILN_GRAMMAR_MAX_REPEAT);
    return;
  }
  int32_t *pids = np ? calloc((size_t)np, sizeof(int32_t)) : NULL;
  for (int64_t i = 0; i < np && !c->err; i++) {
    char k[64];
    snprintf(k, sizeof(k), "prefixItems[%lld]", (long long)i);
    path_join(sub, sizeof(sub), path, k);
    pids[i] = gen(c, kiln_json_at(prefix, (size_t)i), sub);
  }
  if (c->err) {
    free(pids);
    return;
  }
  /* element i (0-based) */
#define ELEM(i)                                             \
  ((i) < np    ? kiln_strbuf_printf(o, "s%d", (int)pids[i]) \
   : item >= 0 ? kiln_strbuf_printf(o, "s%d", (int)item)    \
               : kiln_strbuf_append_str(o, "json-value"))
  /* explicit positions 0 .. K-1, then a bounded chain or a loop */
  int64_t K = np > mn ? np : mn;
  if (mx >= 0 && K > mx) K = mx;
  /* "[" ws ( e0 ( ws "," ws e1 ( ... )? )? ws )? "]", optional from index mn on */
  kiln_strbuf_append_str(o, "\"[\" ws ");
  int64_t depth = 0;
  int64_t last = mx >= 0 ? mx : K; /* positions written out */
  for (int64_t i = 0; i < last; i++) {
    if (i >= mn) {
      kiln_strbuf_append_str(o, "( ");
      depth++;
    }
    if (i > 0) kiln_strbuf_append_str(o, "ws \",\" ws ");
    ELEM(i);
    kiln_strbuf_append_char(o, ' ');
  }
  if (mx < 0) { /* unbounded tail of item schema */
    kiln_strbuf_append_str(o, "( ");
    if (last > 0) kiln_strbuf_append_str(o, "ws \",\" ws ");
    ELEM(last);
    kiln_strbuf_append_str(o, " ( ws \",\" ws ");
    ELEM(last + 1 > np ? last + 1 : np);
    kiln_strbuf_append_str(o, " )* )? ");
  }
  for (int64_t i = 0; i < depth; i++) kiln_strbuf_append_str(o, ")? ");
  if (last > 0 || mx < 0) kiln_strbuf_append_str(o, "ws ");
  kiln_strbuf_append_str(o, "\"]\"");
#undef ELEM
  free(pids);
}

/* ---- objects ----------------------------------------------------------------------------- */

typedef struct prop {
  const char *key;
  size_t klen;
  const kiln_json_t *schema;
  bool required;
  int32_t id;
} prop_t;

/* Keys that differ from every one of keys[0..n) (raw characters, no escapes): a trie walk.
 * prefix is the part matched so far. */
static void gen_other_key(kiln_strbuf_t *o, prop_t *ps, int32_t n, const char *prefix, size_t pl) {
  /* children: the distinct next bytes among the keys that start with prefix */
  bool is_key = false;
  unsigned char next[256];
  int nn = 0;
  for (int32_t i = 0; i < n; i++) {
    if (ps[i].klen < pl || memcmp(ps[i].key, prefix, pl)) continue;
    if (ps[i].klen == pl) {
      is_key = true;
      continue;
    }
    unsigned char b = (unsigned char)ps[i].key[pl];
    bool seen = false;
    for (int k = 0; k < nn; k++) seen |= next[k] == b;
    if (!seen) next[nn++] = b;
  }
  kiln_strbuf_append_str(o, "( ");
  bool first = true;
  if (!is_key) {
    kiln_strbuf_append_str(o, "\"\\\"\"");
    first = false;
  }
  /* a byte no key continues with: the key is new from here. Multi-byte characters are
   * compared by their first byte: a character starting like a key's is followed into it. */
  kiln_strbuf_append_str(o, first ? "" : " | ");
  first = false;
  kiln_strbuf_append_str(o, "[^\"\\\\\\x00-\\x1F");
  for (int k = 0; k < nn; k++)
    if (next[k] < 0x80) {
      if (next[k] == ']' || next[k] == '\\' || next[k] == '^' || next[k] == '-' || next[k] == '[')
        kiln_strbuf_printf(o, "\\%c", next[k]);
      else
        kiln_strbuf_append_char(o, (char)next[k]);
    }
  /* non-ASCII first bytes of keys: exclude every non-ASCII character (they are then only
   * reachable through the key's own branch) */
  bool non_ascii = false;
  for (int k = 0; k < nn; k++) non_ascii |= next[k] >= 0x80;
  if (non_ascii) kiln_strbuf_append_str(o, "\\x80-\\U0010FFFF");
  kiln_strbuf_append_str(o, "] json-key-char* \"\\\"\"");
  for (int k = 0; k < nn; k++) {
    char np2[1024];
    if (pl + 1 >= sizeof(np2)) continue;
    if (pl) memcpy(np2, prefix, pl);
    np2[pl] = (char)next[k];
    if (next[k] >= 0x80) {
      /* follow the whole character of the first key that has it, then any */
      continue;
    }
    kiln_strbuf_append_str(o, " | ");
    char b = (char)next[k];
    lit(o, &b, 1);
    kiln_strbuf_append_char(o, ' ');
    gen_other_key(o, ps, n, np2, pl + 1);
  }
  kiln_strbuf_append_str(o, " )");
}

static void gen_object(sc_t *c, kiln_strbuf_t *o, const kiln_json_t *s, const char *path) {
  char sub[1024];
  const kiln_json_t *props = get(s, "properties"), *req = get(s, "required"),
                    *addl = get(s, "additionalProperties");
  if (props && !kiln_json_is(props, KILN_JSON_OBJECT)) {
    sc_fail(c, path, "'properties' must be an object");
    return;
  }
  if (req && !kiln_json_is(req, KILN_JSON_ARRAY)) {
    sc_fail(c, path, "'required' must be an array of strings");
    return;
  }
  int32_t n = (int32_t)kiln_json_len(props);
  prop_t *ps = calloc((size_t)n + 1, sizeof(*ps));
  if (!ps) {
    c->rules->failed = true;
    return;
  }
  for (int32_t i = 0; i < n; i++) {
    ps[i].key = kiln_json_key_at(props, (size_t)i, &ps[i].klen);
    ps[i].schema = kiln_json_value_at(props, (size_t)i);
  }
  for (size_t j = 0; j < kiln_json_len(req); j++) {
    size_t rl;
    const char *r = kiln_json_string(kiln_json_at(req, j), &rl);
    if (!r) {
      sc_fail(c, path, "'required' must be an array of strings");
      free(ps);
      return;
    }
    bool found = false;
    for (int32_t i = 0; i < n; i++)
      if (ps[i].klen == rl && !memcmp(ps[i].key, r, rl)) found = ps[i].required = true;
    if (!found) {
      sc_fail(c, path, "required property '%s' is not in 'properties'", r);
      free(ps);
      return;
    }
  }
  /* extra properties: a schema id, -2 = any value, -1 = none */
  int32_t extra = props ? -1 : -2;
  if (addl) {
    if (kiln_json_is(addl, KILN_JSON_BOOL)) {
      extra = kiln_json_bool(addl) ? -2 : -1;
    } else if (kiln_json_is(addl, KILN_JSON_OBJECT)) {
      path_join(sub, sizeof(sub), path, "additionalProperties");
      extra = gen(c, addl, sub);
    } else {
      sc_fail(c, path, "'additionalProperties' must be a boolean or a schema");
    }
  }
  for (int32_t i = 0; i < n && !c->err; i++) {
    char k[600];
    snprintf(k, sizeof(k), "properties.%.*s", (int)(ps[i].klen > 500 ? 500 : ps[i].klen),
             ps[i].key);
    path_join(sub, sizeof(sub), path, k);
    ps[i].id = gen(c, ps[i].schema, sub);
  }
  if (c->err) {
    free(ps);
    return;
  }
  if (!props && extra == -2) {
    kiln_strbuf_append_str(o, "json-object");
    free(ps);
    return;
  }
  /* The members in order: N_i = no comma needed before the next member, C_i = a comma. Each
   * is a helper rule s<base>-n<i> / -c<i>; index n is the tail (extra properties or nothing). */
  int32_t base = new_id(c);
  kiln_strbuf_t defs = KILN_STRBUF_INIT;
  for (int32_t i = 0; i <= n; i++)
    for (int cm = 0; cm < 2; cm++) {
      kiln_strbuf_printf(&defs, "s%d-%c%d ::= ", (int)base, cm ? 'c' : 'n', (int)i);
      if (i == n) {
        if (extra == -1) {
          kiln_strbuf_append_str(&defs, "\"\"");
        } else {
          /* ( sep member ) ( "," member )* */
          kiln_strbuf_append_str(&defs, "( ");
          if (cm) kiln_strbuf_append_str(&defs, "\",\" ws ");
          kiln_strbuf_printf(&defs, "s%d-xm ( ws \",\" ws s%d-xm )* ws )?", (int)base, (int)base);
        }
      } else {
        if (cm) kiln_strbuf_append_str(&defs, "\",\" ws ");
        kiln_strbuf_t kj = KILN_STRBUF_INIT;
        kiln_json_write_string(&kj, ps[i].key, ps[i].klen, false);
        lit(&defs, kj.data ? kj.data : "", kj.len);
        kiln_strbuf_free(&kj);
        kiln_strbuf_printf(&defs, " ws \":\" ws s%d ws s%d-c%d", (int)ps[i].id, (int)base,
                           (int)i + 1);
        if (!ps[i].required)
          kiln_strbuf_printf(&defs, " | s%d-%c%d", (int)base, cm ? 'c' : 'n', (int)i + 1);
      }
      kiln_strbuf_append_char(&defs, '\n');
    }
  if (extra != -1) {
    kiln_strbuf_printf(&defs, "s%d-xm ::= \"\\\"\" ", (int)base);
    gen_other_key(&defs, ps, n, "", 0);
    kiln_strbuf_append_str(&defs, " ws \":\" ws ");
    if (extra == -2)
      kiln_strbuf_append_str(&defs, "json-value\n");
    else
      kiln_strbuf_printf(&defs, "s%d\n", (int)extra);
  }
  if (!kiln_strbuf_ok(&defs)) c->rules->failed = true;
  if (defs.data) kiln_strbuf_append(c->rules, defs.data, defs.len);
  kiln_strbuf_free(&defs);
  kiln_strbuf_printf(o, "\"{\" ws s%d-n0 \"}\"", (int)base);
  free(ps);
}

/* ---- allOf ------------------------------------------------------------------------------- */

/* Merges the object schemas of an allOf (and the node's own object keywords) into one
 * properties / required set, written as a synthetic document. */
static const kiln_json_t *merge_all_of(sc_t *c, const kiln_json_t *s, const char *path,
                                       kiln_json_doc_t **own) {
  const kiln_json_t *all = get(s, "allOf");
  if (!kiln_json_is(all, KILN_JSON_ARRAY) || !kiln_json_len(all)) {
    sc_fail(c, path, "'allOf' must be a non-empty array");
    return NULL;
  }
  size_t nb = kiln_json_len(all) + 1;
  const kiln_json_t **br = calloc(nb, sizeof(*br));
  if (!br) return NULL;
  size_t k = 0;
  br[k++] = s;
  for (size_t i = 0; i + 1 < nb; i++) {
    const kiln_json_t *b = kiln_json_at(all, i);
    for (int hops = 0; kiln_json_is(b, KILN_JSON_OBJECT) && get(b, "$ref") && hops < 32; hops++) {
      const char *ref = kiln_json_string(get(b, "$ref"), NULL);
      b = ref ? resolve(c, path, ref) : NULL;
    }
    if (c->err) break;
    br[k++] = b;
  }
  kiln_strbuf_t t = KILN_STRBUF_INIT;
  kiln_strbuf_append_str(&t, "{\"type\": \"object\", \"properties\": {");
  int nprops = 0;
  bool *strict = calloc(k, 1); /* branches with additionalProperties: false */
  if (!strict) {
    free(br);
    kiln_strbuf_free(&t);
    c->rules->failed = true;
    return NULL;
  }
  /* properties in branch order; a property named twice must have the same schema. A branch
   * with additionalProperties: false allows only its own properties, so the merged object has
   * those every such branch lists (a required one that some branch forbids: no object fits). */
  for (size_t i = 0; i < k && !c->err; i++) {
    const kiln_json_t *b = br[i];
    if (!kiln_json_is(b, KILN_JSON_OBJECT)) {
      sc_fail(c, path, "allOf[%zu] is not a schema object", i - 1);
      break;
    }
    const kiln_json_t *a = get(b, "additionalProperties");
    strict[i] = kiln_json_is(a, KILN_JSON_BOOL) && !kiln_json_bool(a);
  }
  for (size_t i = 0; i < k && !c->err; i++) {
    const kiln_json_t *b = br[i];
    if (!kiln_json_is(b, KILN_JSON_OBJECT)) {
      sc_fail(c, path, "allOf[%zu] is not a schema object", i - 1);
      break;
    }
    for (size_t m = 0; m < kiln_json_len(b); m++) {
      const char *key = kiln_json_key_at(b, m, NULL);
      if (i > 0 && !strcmp(key, "type")) {
        const char *tv = kiln_json_string(kiln_json_value_at(b, m), NULL);
        if (!tv || strcmp(tv, "object")) {
          sc_fail(c, path, "allOf is supported for object schemas only (allOf[%zu] has type %s)",
                  i - 1, tv ? tv : "(a list)");
          break;
        }
        continue;
      }
      if (!strcmp(key, "allOf") || !strcmp(key, "properties") || !strcmp(key, "required") ||
          is_annotation(key) || (i == 0 && !strcmp(key, "type")))
        continue;
      if (!strcmp(key, "additionalProperties")) {
        const kiln_json_t *a = kiln_json_value_at(b, m);
        if (kiln_json_is(a, KILN_JSON_BOOL) && !kiln_json_bool(a)) {
          strict[i] = true;
          continue;
        }
      }
      sc_fail(c, path, "allOf: '%s' in %s%zu%s cannot be merged (only properties and required)",
              key, i ? "allOf[" : "the schema itself", i ? i - 1 : 0, i ? "]" : "");
      break;
    }
    const kiln_json_t *p = get(b, "properties");
    for (size_t m = 0; m < kiln_json_len(p) && !c->err; m++) {
      size_t kl;
      const char *key = kiln_json_key_at(p, m, &kl);
      bool dup = false;
      for (size_t j = 0; j < i && !dup; j++) {
        const kiln_json_t *q = kiln_json_getn(get(br[j], "properties"), key, kl);
        if (q) {
          dup = true;
          kiln_strbuf_t x = KILN_STRBUF_INIT, y = KILN_STRBUF_INIT;
          kiln_json_write(&x, q, false, false);
          kiln_json_write(&y, kiln_json_value_at(p, m), false, false);
          if (x.len != y.len || (x.len && memcmp(x.data, y.data, x.len)))
            sc_fail(c, path, "allOf: property '%s' has different schemas in two branches", key);
          kiln_strbuf_free(&x);
          kiln_strbuf_free(&y);
        }
      }
      if (dup) continue;
      bool allowed = true;
      for (size_t j = 0; j < k; j++)
        if (strict[j] && !kiln_json_getn(get(br[j], "properties"), key, kl)) allowed = false;
      if (!allowed) continue; /* some branch forbids it: it never appears */
      if (nprops++) kiln_strbuf_append_str(&t, ", ");
      kiln_json_write_string(&t, key, kl, false);
      kiln_strbuf_append_str(&t, ": ");
      kiln_json_write(&t, kiln_json_value_at(p, m), false, false);
    }
  }
  kiln_strbuf_append_str(&t, "}, \"required\": [");
  int nreq = 0;
  for (size_t i = 0; i < k && !c->err; i++) {
    const kiln_json_t *r = get(br[i], "required");
    for (size_t m = 0; m < kiln_json_len(r) && !c->err; m++) {
      size_t kl;
      const char *key = kiln_json_string(kiln_json_at(r, m), &kl);
      for (size_t j = 0; key && j < k; j++)
        if (strict[j] && !kiln_json_getn(get(br[j], "properties"), key, kl)) {
          sc_fail(c, path,
                  "allOf: no object fits: property '%s' is required, but %s%zu%s forbids it "
                  "(additionalProperties: false)",
                  key, j ? "allOf[" : "the schema itself", j ? j - 1 : 0, j ? "]" : "");
          break;
        }
      if (nreq++) kiln_strbuf_append_str(&t, ", ");
      kiln_json_write(&t, kiln_json_at(r, m), false, false);
    }
  }
  kiln_strbuf_append_str(&t, "]");
  kiln_strbuf_append_str(&t, ", \"additionalProperties\": false}");
  free(br);
  free(strict);
  if (c->err || !kiln_strbuf_ok(&t)) {
    kiln_strbuf_free(&t);
    return NULL;
  }
  /* $refs inside the merged properties point into the original document, so the merged
   * document is resolved against it (c->root stays). */
  kiln_status_t st = kiln_json_parse(t.data, t.len, "allOf", own);
  kiln_strbuf_free(&t);
  if (st) {
    c->err = st;
    return NULL;
  }
  return kiln_json_root(*own);
}

/* ---- one schema -------------------------------------------------------------------------- */

/* The body of schema s (one GBNF expression, possibly followed by helper rule lines). */
static void gen_body(sc_t *c, kiln_strbuf_t *o, const kiln_json_t *s, const char *path) {
  char sub[1024];
  if (kiln_json_is(s, KILN_JSON_BOOL)) {
    if (kiln_json_bool(s))
      kiln_strbuf_append_str(o, "json-value");
    else
      sc_fail(c, path, "the schema 'false' matches nothing");
    return;
  }
  if (!kiln_json_is(s, KILN_JSON_OBJECT)) {
    sc_fail(c, path, "a schema must be an object or a boolean, not %s",
            kiln_json_type_name(kiln_json_type(s)));
    return;
  }
  /* every keyword must be known */
  static const char *const known[] = {"type",
                                      "enum",
                                      "const",
                                      "anyOf",
                                      "oneOf",
                                      "allOf",
                                      "$ref",
                                      "properties",
                                      "required",
                                      "additionalProperties",
                                      "items",
                                      "prefixItems",
                                      "additionalItems",
                                      "minItems",
                                      "maxItems",
                                      "uniqueItems",
                                      "minLength",
                                      "maxLength",
                                      "pattern",
                                      "format",
                                      "minimum",
                                      "maximum",
                                      "exclusiveMinimum",
                                      "exclusiveMaximum",
                                      "nullable",
                                      NULL};
  for (size_t i = 0; i < kiln_json_len(s); i++) {
    const char *k = kiln_json_key_at(s, i, NULL);
    bool ok = is_annotation(k);
    for (int j = 0; !ok && known[j]; j++) ok = !strcmp(k, known[j]);
    if (!ok) {
      sc_fail(c, path, "keyword '%s' is not supported", k);
      return;
    }
  }
  const kiln_json_t *nl = get(s, "nullable");
  bool nullable = nl && kiln_json_bool(nl);
  if (nullable) kiln_strbuf_append_str(o, "( \"null\" | ");
  /* keywords that stand alone */
  int constraining = 0;
  for (size_t i = 0; i < kiln_json_len(s); i++) {
    const char *k = kiln_json_key_at(s, i, NULL);
    if (!is_annotation(k) && strcmp(k, "nullable")) constraining++;
  }
  const kiln_json_t *en = get(s, "enum"), *cn = get(s, "const"), *ref = get(s, "$ref");
  const kiln_json_t *any = get(s, "anyOf"), *one = get(s, "oneOf"), *all = get(s, "allOf");
  const kiln_json_t *ty = get(s, "type");
  if (en || cn) {
    if (constraining > 1 + (ty ? 1 : 0)) {
      sc_fail(c, path, "'%s' together with other constraints (besides type) is not supported",
              en ? "enum" : "const");
      return;
    }
    int tmask = 0;
    if (kiln_json_is(ty, KILN_JSON_STRING)) tmask = type_bit(kiln_json_string(ty, NULL));
    for (size_t i = 0; i < kiln_json_len(ty); i++)
      tmask |= type_bit(kiln_json_string(kiln_json_at(ty, i), NULL)
                            ? kiln_json_string(kiln_json_at(ty, i), NULL)
                            : "");
    if (en && !kiln_json_is(en, KILN_JSON_ARRAY)) {
      sc_fail(c, path, "'enum' must be an array");
      return;
    }
    kiln_strbuf_append_str(o, "( ");
    int nv = 0;
    size_t cnt = en ? kiln_json_len(en) : 1;
    for (size_t i = 0; i < cnt; i++) {
      const kiln_json_t *v = en ? kiln_json_at(en, i) : cn;
      if (tmask) {
        int vb = 0;
        switch (kiln_json_type(v)) {
          case KILN_JSON_NULL: vb = T_NULL; break;
          case KILN_JSON_BOOL: vb = T_BOOL; break;
          case KILN_JSON_NUMBER:
            vb = kiln_json_number(v) == floor(kiln_json_number(v)) ? T_INT | T_NUMBER : T_NUMBER;
            break;
          case KILN_JSON_STRING: vb = T_STRING; break;
          case KILN_JSON_ARRAY: vb = T_ARRAY; break;
          case KILN_JSON_OBJECT: vb = T_OBJECT; break;
        }
        if (!(vb & tmask)) continue;
      }
      if (nv++) kiln_strbuf_append_str(o, " | ");
      lit_json(o, v);
    }
    if (!nv) {
      sc_fail(c, path, "no value of '%s' has the schema's type", en ? "enum" : "const");
      return;
    }
    kiln_strbuf_append_str(o, " )");
    if (nullable) kiln_strbuf_append_str(o, " )");
    return;
  }
  if (ref) {
    if (constraining > 1) {
      sc_fail(c, path, "'$ref' together with other constraints is not supported");
      return;
    }
    const char *r = kiln_json_string(ref, NULL);
    if (!r) {
      sc_fail(c, path, "'$ref' must be a string");
      return;
    }
    const kiln_json_t *t = resolve(c, path, r);
    if (!t) return;
    path_join(sub, sizeof(sub), path, r);
    int32_t id = gen(c, t, r);
    kiln_strbuf_printf(o, "s%d", (int)id);
    if (nullable) kiln_strbuf_append_str(o, " )");
    return;
  }
  if (any || one) {
    if (any && one) {
      sc_fail(c, path, "'anyOf' together with 'oneOf' is not supported");
      return;
    }
    if (constraining > 1) {
      sc_fail(c, path,
              "'%s' together with other constraints is not supported; move them into each branch",
              any ? "anyOf" : "oneOf");
      return;
    }
    const kiln_json_t *br = any ? any : one;
    if (!kiln_json_is(br, KILN_JSON_ARRAY) || !kiln_json_len(br)) {
      sc_fail(c, path, "'%s' must be a non-empty array", any ? "anyOf" : "oneOf");
      return;
    }
    size_t nb = kiln_json_len(br);
    int32_t *ids = calloc(nb, sizeof(int32_t));
    if (!ids) {
      o->failed = true;
      return;
    }
    for (size_t i = 0; i < nb && !c->err; i++) {
      char k[64];
      snprintf(k, sizeof(k), "%s[%zu]", any ? "anyOf" : "oneOf", i);
      path_join(sub, sizeof(sub), path, k);
      ids[i] = gen(c, kiln_json_at(br, i), sub);
    }
    kiln_strbuf_append_str(o, "( ");
    for (size_t i = 0; i < nb; i++) kiln_strbuf_printf(o, "%ss%d", i ? " | " : "", (int)ids[i]);
    kiln_strbuf_append_str(o, " )");
    free(ids);
    if (nullable) kiln_strbuf_append_str(o, " )");
    return;
  }
  if (all) {
    kiln_json_doc_t *own = NULL;
    const kiln_json_t *m = merge_all_of(c, s, path, &own);
    if (m) gen_object(c, o, m, path); /* inline: the merged nodes are not the document's */
    kiln_json_doc_t **nd = own ? realloc(c->docs, ((size_t)c->ndocs + 1) * sizeof(*nd)) : NULL;
    if (nd) {
      c->docs = nd;
      c->docs[c->ndocs++] = own;
    } else {
      kiln_json_doc_free(own);
      if (own) sc_fail(c, path, "out of memory");
    }
    if (nullable) kiln_strbuf_append_str(o, " )");
    return;
  }
  /* the types */
  int tmask = 0;
  if (kiln_json_is(ty, KILN_JSON_STRING)) {
    tmask = type_bit(kiln_json_string(ty, NULL));
    if (!tmask) {
      sc_fail(c, path, "unknown type '%s'", kiln_json_string(ty, NULL));
      return;
    }
  } else if (kiln_json_is(ty, KILN_JSON_ARRAY)) {
    for (size_t i = 0; i < kiln_json_len(ty); i++) {
      const char *t = kiln_json_string(kiln_json_at(ty, i), NULL);
      int b = t ? type_bit(t) : 0;
      if (!b) {
        sc_fail(c, path, "unknown type in 'type'[%zu]", i);
        return;
      }
      tmask |= b;
    }
  } else if (ty) {
    sc_fail(c, path, "'type' must be a string or an array of strings");
    return;
  } else {
    /* no type: the keywords say which (a narrower output still validates) */
    if (has_any(s, OBJ_KEYS)) tmask |= T_OBJECT;
    if (has_any(s, ARR_KEYS)) tmask |= T_ARRAY;
    if (has_any(s, STR_KEYS)) tmask |= T_STRING;
    if (has_any(s, NUM_KEYS)) tmask |= T_NUMBER;
    if (!tmask) {
      kiln_strbuf_append_str(o, "json-value");
      if (nullable) kiln_strbuf_append_str(o, " )");
      return;
    }
  }
  if ((tmask & T_INT) && (tmask & T_NUMBER)) tmask &= ~T_INT;
  kiln_strbuf_append_str(o, "( ");
  bool first = true;
#define SEP() (first ? (void)(first = false) : (void)kiln_strbuf_append_str(o, " | "))
  if (tmask & T_NULL) SEP(), kiln_strbuf_append_str(o, "\"null\"");
  if (tmask & T_BOOL) SEP(), kiln_strbuf_append_str(o, "json-bool");
  if (tmask & (T_NUMBER | T_INT)) SEP(), gen_number(c, o, s, (tmask & T_INT) != 0, path);
  if (tmask & T_STRING) SEP(), gen_string(c, o, s, path);
  if (tmask & T_ARRAY) SEP(), gen_array(c, o, s, path);
  if (tmask & T_OBJECT) SEP(), gen_object(c, o, s, path);
#undef SEP
  kiln_strbuf_append_str(o, " )");
  if (nullable) kiln_strbuf_append_str(o, " )");
}

/* Generates (once per schema node) the rule s<id> for schema s; returns id. */
static int32_t gen(sc_t *c, const kiln_json_t *s, const char *path) {
  if (c->err) return 0;
  for (int32_t i = 0; i < c->nmemo; i++)
    if (c->memo[i].node == s) return c->memo[i].id;
  if (++c->depth > SC_MAX_DEPTH) {
    sc_fail(c, path, "the schema is nested more than %d levels deep", SC_MAX_DEPTH);
    c->depth--;
    return 0;
  }
  int32_t id = new_id(c);
  if (c->nmemo == c->capmemo) {
    int32_t nc = c->capmemo ? c->capmemo * 2 : 32;
    memo_t *nm = realloc(c->memo, (size_t)nc * sizeof(*nm));
    if (!nm) {
      c->rules->failed = true;
      c->depth--;
      return id;
    }
    c->memo = nm;
    c->capmemo = nc;
  }
  c->memo[c->nmemo++] = (memo_t){s, id};
  kiln_strbuf_t body = KILN_STRBUF_INIT;
  gen_body(c, &body, s, path);
  if (!kiln_strbuf_ok(&body)) c->rules->failed = true;
  if (!c->err) {
    kiln_strbuf_printf(c->rules, "s%d ::= ", (int)id);
    if (body.data) kiln_strbuf_append(c->rules, body.data, body.len);
    kiln_strbuf_append_char(c->rules, '\n');
  }
  kiln_strbuf_free(&body);
  c->depth--;
  return id;
}

kiln_status_t kiln_schema_to_gbnf(const char *json, size_t len, const char *what,
                                  kiln_strbuf_t *out) {
  kiln_json_doc_t *doc = NULL;
  char name[128];
  snprintf(name, sizeof(name), "%s", what ? what : "json_schema");
  kiln_status_t st = kiln_json_parse(json, len, name, &doc);
  if (st) return st;
  sc_t c;
  memset(&c, 0, sizeof(c));
  c.root = kiln_json_root(doc);
  c.rules = out;
  c.what = name;
  kiln_strbuf_append_str(out, PRELUDE);
  int32_t id = gen(&c, c.root, "");
  if (!c.err) kiln_strbuf_printf(out, "root ::= s%d\n", (int)id);
  if (!c.err && !kiln_strbuf_ok(out))
    c.err = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", name);
  free(c.memo);
  for (int32_t i = 0; i < c.ndocs; i++) kiln_json_doc_free(c.docs[i]);
  free(c.docs);
  kiln_json_doc_free(doc);
  return c.err;
}

const char *kiln_guide_kind_name(kiln_guide_kind_t kind) {
  switch (kind) {
    case KILN_GUIDE_JSON_OBJECT: return "json_object";
    case KILN_GUIDE_JSON_SCHEMA: return "json_schema";
    case KILN_GUIDE_REGEX: return "regex";
    case KILN_GUIDE_CHOICE: return "choice";
    case KILN_GUIDE_GRAMMAR: return "grammar";
    default: return "none";
  }
}

kiln_status_t kiln_guide_to_gbnf(kiln_guide_kind_t kind, const char *spec, size_t len,
                                 kiln_strbuf_t *out) {
  const char *what = kiln_guide_kind_name(kind);
  switch (kind) {
    case KILN_GUIDE_JSON_OBJECT:
      kiln_strbuf_append_str(out, PRELUDE);
      kiln_strbuf_append_str(out, "root ::= json-object\n");
      break;
    case KILN_GUIDE_JSON_SCHEMA:
      if (!spec)
        return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: the schema is missing", what);
      return kiln_schema_to_gbnf(spec, len, what, out);
    case KILN_GUIDE_REGEX:
      if (!spec)
        return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: the pattern is missing", what);
      return kiln_regex_to_gbnf(spec, len, false, "root", what, out);
    case KILN_GUIDE_CHOICE: {
      if (!spec)
        return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: the list is missing", what);
      kiln_json_doc_t *doc = NULL;
      kiln_status_t st = kiln_json_parse(spec, len, what, &doc);
      if (st) return st;
      const kiln_json_t *a = kiln_json_root(doc);
      if (!kiln_json_is(a, KILN_JSON_ARRAY) || !kiln_json_len(a)) {
        kiln_json_doc_free(doc);
        return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                                "%s: must be a non-empty array of strings", what);
      }
      kiln_strbuf_append_str(out, "root ::= ");
      for (size_t i = 0; i < kiln_json_len(a); i++) {
        size_t sl;
        const char *s = kiln_json_string(kiln_json_at(a, i), &sl);
        if (!s || !sl) {
          kiln_json_doc_free(doc);
          return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s[%zu]: must be a non-empty string",
                                  what, i);
        }
        if (i) kiln_strbuf_append_str(out, " | ");
        lit(out, s, sl);
      }
      kiln_strbuf_append_char(out, '\n');
      kiln_json_doc_free(doc);
      break;
    }
    case KILN_GUIDE_GRAMMAR:
      if (!spec)
        return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: the grammar is missing", what);
      kiln_strbuf_append(out, spec, len);
      break;
    default:
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "guide: unknown kind %d", (int)kind);
  }
  if (!kiln_strbuf_ok(out))
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", what);
  return NULL;
}
