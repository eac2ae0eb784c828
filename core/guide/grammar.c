/* grammar.c - GBNF text to a byte-level grammar (see grammar.h): the parser, code points to
 * UTF-8 byte sequences, and the checks (undefined rules, left recursion, rules that derive
 * nothing). */
#include "core/guide/grammar.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the builder ------------------------------------------------------------------------ */

typedef struct gvec {
  kiln_gel_t *e;
  int32_t n, cap;
} gvec_t;

typedef struct grule {
  char *name;
  gvec_t *alts;
  int32_t n, cap;
  bool defined;
  int32_t line, col; /* of the first use or the definition, for messages */
  int32_t rep_star;  /* an optional chain link of x{m,n}: the rule x* over the same x, else -1 */
  int32_t rep_count; /* ... and how many more x it allows */
} grule_t;

typedef struct gb {
  grule_t *rules;
  int32_t n, cap;
  int32_t *map; /* open addressing: rule index + 1 */
  int32_t map_cap;
  uint64_t (*sets)[4];
  int32_t nsets, sets_cap;
  int32_t *smap;
  int32_t smap_cap;
  int64_t total; /* elements so far */
  bool oom;
  kiln_status_t err;
  const char *what;
  /* the parser */
  const char *src, *p, *end;
} gb_t;

static uint64_t hash_bytes(const void *d, size_t n) {
  const unsigned char *s = d;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ s[i]) * 1099511628211ull;
  return h ^ (h >> 29);
}

static void gb_pos(const gb_t *b, const char *at, int32_t *line, int32_t *col) {
  int32_t l = 1, c = 1;
  for (const char *q = b->src; q < at && q < b->end; q++) {
    if (*q == '\n') {
      l++;
      c = 1;
    } else {
      c++;
    }
  }
  *line = l;
  *col = c;
}

static void gb_fail(gb_t *b, const char *at, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void gb_fail(gb_t *b, const char *at, const char *fmt, ...) {
  if (b->err) return;
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  if (at) {
    int32_t l, c;
    gb_pos(b, at, &l, &c);
    b->err = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: line %d, column %d: %s", b->what,
                              (int)l, (int)c, msg);
  } else {
    b->err = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: %s", b->what, msg);
  }
}

static bool gb_ok(const gb_t *b) { return !b->err && !b->oom; }

static bool vec_push(gb_t *b, gvec_t *v, int32_t kind, int32_t arg) {
  if (!gb_ok(b)) return false;
  if (++b->total > KILN_GRAMMAR_MAX_ELEMENTS) {
    gb_fail(b, NULL, "the grammar is too large (more than %d elements)", KILN_GRAMMAR_MAX_ELEMENTS);
    return false;
  }
  if (v->n == v->cap) {
    int32_t nc = v->cap ? v->cap * 2 : 8;
    kiln_gel_t *ne = realloc(v->e, (size_t)nc * sizeof(*ne));
    if (!ne) {
      b->oom = true;
      return false;
    }
    v->e = ne;
    v->cap = nc;
  }
  v->e[v->n++] = (kiln_gel_t){kind, arg};
  return true;
}

static int32_t set_intern(gb_t *b, const uint64_t s[4]) {
  if (!gb_ok(b)) return 0;
  if (b->nsets * 2 >= b->smap_cap) {
    int32_t nc = b->smap_cap ? b->smap_cap * 2 : 256;
    int32_t *nm = calloc((size_t)nc, sizeof(int32_t));
    if (!nm) {
      b->oom = true;
      return 0;
    }
    for (int32_t i = 0; i < b->nsets; i++) {
      uint64_t h = hash_bytes(b->sets[i], 32);
      int32_t j = (int32_t)(h & (uint64_t)(nc - 1));
      while (nm[j]) j = (j + 1) & (nc - 1);
      nm[j] = i + 1;
    }
    free(b->smap);
    b->smap = nm;
    b->smap_cap = nc;
  }
  uint64_t h = hash_bytes(s, 32);
  int32_t j = (int32_t)(h & (uint64_t)(b->smap_cap - 1));
  while (b->smap[j]) {
    int32_t i = b->smap[j] - 1;
    if (!memcmp(b->sets[i], s, 32)) return i;
    j = (j + 1) & (b->smap_cap - 1);
  }
  if (b->nsets == b->sets_cap) {
    int32_t nc = b->sets_cap ? b->sets_cap * 2 : 64;
    void *ns = realloc(b->sets, (size_t)nc * 32);
    if (!ns) {
      b->oom = true;
      return 0;
    }
    b->sets = ns;
    b->sets_cap = nc;
  }
  memcpy(b->sets[b->nsets], s, 32);
  b->smap[j] = b->nsets + 1;
  return b->nsets++;
}

static void set_range(uint64_t s[4], unsigned lo, unsigned hi) {
  for (unsigned c = lo; c <= hi; c++) s[c >> 6] |= 1ull << (c & 63);
}

static bool push_byte_range(gb_t *b, gvec_t *v, unsigned lo, unsigned hi) {
  uint64_t s[4] = {0, 0, 0, 0};
  set_range(s, lo, hi);
  return vec_push(b, v, KILN_GEL_BYTES, set_intern(b, s));
}

static int32_t rule_find(const gb_t *b, const char *name, size_t n) {
  if (!b->map_cap) return -1;
  uint64_t h = hash_bytes(name, n);
  int32_t j = (int32_t)(h & (uint64_t)(b->map_cap - 1));
  while (b->map[j]) {
    const grule_t *r = &b->rules[b->map[j] - 1];
    if (strlen(r->name) == n && !memcmp(r->name, name, n)) return b->map[j] - 1;
    j = (j + 1) & (b->map_cap - 1);
  }
  return -1;
}

/* The rule called name, created (undefined) when new. */
static int32_t rule_get(gb_t *b, const char *name, size_t n, const char *at) {
  int32_t r = rule_find(b, name, n);
  if (r >= 0 || !gb_ok(b)) return r < 0 ? 0 : r;
  if (b->n * 2 >= b->map_cap) {
    int32_t nc = b->map_cap ? b->map_cap * 2 : 64;
    int32_t *nm = calloc((size_t)nc, sizeof(int32_t));
    if (!nm) {
      b->oom = true;
      return 0;
    }
    for (int32_t i = 0; i < b->n; i++) {
      uint64_t h = hash_bytes(b->rules[i].name, strlen(b->rules[i].name));
      int32_t j = (int32_t)(h & (uint64_t)(nc - 1));
      while (nm[j]) j = (j + 1) & (nc - 1);
      nm[j] = i + 1;
    }
    free(b->map);
    b->map = nm;
    b->map_cap = nc;
  }
  if (b->n == b->cap) {
    int32_t nc = b->cap ? b->cap * 2 : 32;
    grule_t *nr = realloc(b->rules, (size_t)nc * sizeof(*nr));
    if (!nr) {
      b->oom = true;
      return 0;
    }
    b->rules = nr;
    b->cap = nc;
  }
  grule_t *r2 = &b->rules[b->n];
  memset(r2, 0, sizeof(*r2));
  r2->rep_star = -1;
  if (!(r2->name = malloc(n + 1))) {
    b->oom = true;
    return 0;
  }
  memcpy(r2->name, name, n);
  r2->name[n] = '\0';
  if (at) gb_pos(b, at, &r2->line, &r2->col);
  uint64_t h = hash_bytes(name, n);
  int32_t j = (int32_t)(h & (uint64_t)(b->map_cap - 1));
  while (b->map[j]) j = (j + 1) & (b->map_cap - 1);
  b->map[j] = b->n + 1;
  return b->n++;
}

/* A fresh helper rule named after parent: parent-1, parent-2, ... */
static int32_t rule_anon(gb_t *b, int32_t parent) {
  char name[256];
  for (int32_t k = 1;; k++) {
    snprintf(name, sizeof(name), "%.200s-%d", gb_ok(b) ? b->rules[parent].name : "x", (int)k);
    if (rule_find(b, name, strlen(name)) < 0) break;
  }
  int32_t r = rule_get(b, name, strlen(name), NULL);
  if (gb_ok(b)) b->rules[r].defined = true;
  return r;
}

/* Adds an alternative (taking v's elements) to rule r. */
static void rule_add_alt(gb_t *b, int32_t r, gvec_t *v) {
  if (!gb_ok(b)) {
    free(v->e);
    memset(v, 0, sizeof(*v));
    return;
  }
  grule_t *ru = &b->rules[r];
  if (ru->n == ru->cap) {
    int32_t nc = ru->cap ? ru->cap * 2 : 4;
    gvec_t *na = realloc(ru->alts, (size_t)nc * sizeof(*na));
    if (!na) {
      b->oom = true;
      free(v->e);
      memset(v, 0, sizeof(*v));
      return;
    }
    ru->alts = na;
    ru->cap = nc;
  }
  ru->alts[ru->n++] = *v;
  memset(v, 0, sizeof(*v));
}

static void gb_free(gb_t *b) {
  for (int32_t i = 0; i < b->n; i++) {
    for (int32_t j = 0; j < b->rules[i].n; j++) free(b->rules[i].alts[j].e);
    free(b->rules[i].alts);
    free(b->rules[i].name);
  }
  free(b->rules);
  free(b->map);
  free(b->sets);
  free(b->smap);
}

/* ---- code points to UTF-8 ---------------------------------------------------------------- */

typedef struct cprange {
  uint32_t lo, hi;
} cprange_t;

static int utf8_enc(uint32_t cp, unsigned char *o) {
  if (cp < 0x80) {
    o[0] = (unsigned char)cp;
    return 1;
  }
  if (cp < 0x800) {
    o[0] = (unsigned char)(0xC0 | (cp >> 6));
    o[1] = (unsigned char)(0x80 | (cp & 63));
    return 2;
  }
  if (cp < 0x10000) {
    o[0] = (unsigned char)(0xE0 | (cp >> 12));
    o[1] = (unsigned char)(0x80 | ((cp >> 6) & 63));
    o[2] = (unsigned char)(0x80 | (cp & 63));
    return 3;
  }
  o[0] = (unsigned char)(0xF0 | (cp >> 18));
  o[1] = (unsigned char)(0x80 | ((cp >> 12) & 63));
  o[2] = (unsigned char)(0x80 | ((cp >> 6) & 63));
  o[3] = (unsigned char)(0x80 | (cp & 63));
  return 4;
}

/* Emits the UTF-8 byte-range sequences of code points [lo, hi] (same encoded length, no
 * surrogates) as alternatives of rule r; single bytes are collected in `ascii`. */
static void utf8_split(gb_t *b, int32_t r, uint32_t lo, uint32_t hi, uint64_t ascii[4]) {
  if (!gb_ok(b) || lo > hi) return;
  static const uint32_t bounds[] = {0x7F, 0x7FF, 0xFFFF};
  for (int i = 0; i < 3; i++)
    if (lo <= bounds[i] && hi > bounds[i]) {
      utf8_split(b, r, lo, bounds[i], ascii);
      utf8_split(b, r, bounds[i] + 1, hi, ascii);
      return;
    }
  if (hi < 0x80) {
    set_range(ascii, lo, hi);
    return;
  }
  unsigned char a[4], z[4];
  int n = utf8_enc(lo, a);
  utf8_enc(hi, z);
  for (int i = 1; i < n; i++) {
    uint32_t m = (1u << (6 * i)) - 1;
    if ((lo & ~m) != (hi & ~m)) {
      if ((lo & m) != 0) {
        utf8_split(b, r, lo, lo | m, ascii);
        utf8_split(b, r, (lo | m) + 1, hi, ascii);
        return;
      }
      if ((hi & m) != m) {
        utf8_split(b, r, lo, (hi & ~m) - 1, ascii);
        utf8_split(b, r, hi & ~m, hi, ascii);
        return;
      }
    }
  }
  gvec_t v = {0};
  for (int i = 0; i < n; i++) push_byte_range(b, &v, a[i], z[i]);
  rule_add_alt(b, r, &v);
}

static int cmp_range(const void *x, const void *y) {
  const cprange_t *a = x, *c = y;
  return a->lo < c->lo ? -1 : a->lo > c->lo;
}

/* Sorts and merges ranges in place, removes surrogates, negates over all code points when
 * neg; returns the new count (the array must hold n + 2 entries). */
static int32_t ranges_normalize(cprange_t *rg, int32_t n, bool neg) {
  if (n > 1) qsort(rg, (size_t)n, sizeof(*rg), cmp_range);
  int32_t k = 0;
  for (int32_t i = 0; i < n; i++) {
    if (k && rg[i].lo <= rg[k - 1].hi + 1) {
      if (rg[i].hi > rg[k - 1].hi) rg[k - 1].hi = rg[i].hi;
    } else {
      rg[k++] = rg[i];
    }
  }
  if (neg) {
    int32_t m = 0;
    uint32_t next = 0;
    /* negation, written over the sorted list from the back so it fits in place */
    cprange_t *out = malloc(((size_t)k + 1) * sizeof(*out));
    if (!out) return -1;
    for (int32_t i = 0; i < k; i++) {
      if (rg[i].lo > next) out[m++] = (cprange_t){next, rg[i].lo - 1};
      next = rg[i].hi + 1;
    }
    if (next <= 0x10FFFF) out[m++] = (cprange_t){next, 0x10FFFF};
    memcpy(rg, out, (size_t)m * sizeof(*rg));
    free(out);
    k = m;
  }
  /* split out the surrogates */
  int32_t m = 0;
  cprange_t *out = malloc(((size_t)k * 2 + 1) * sizeof(*out));
  if (!out) return -1;
  for (int32_t i = 0; i < k; i++) {
    uint32_t lo = rg[i].lo, hi = rg[i].hi > 0x10FFFF ? 0x10FFFF : rg[i].hi;
    if (lo > hi) continue;
    if (hi < 0xD800 || lo > 0xDFFF) {
      out[m++] = (cprange_t){lo, hi};
      continue;
    }
    if (lo < 0xD800) out[m++] = (cprange_t){lo, 0xD7FF};
    if (hi > 0xDFFF) out[m++] = (cprange_t){0xE000, hi};
  }
  memcpy(rg, out, (size_t)m * sizeof(*rg));
  free(out);
  return m;
}

/* Pushes a character class (normalized ranges) onto v: one byte set when every range is
 * ASCII, else a reference to a helper rule of parent with one alternative per UTF-8 shape. */
static void push_class(gb_t *b, int32_t parent, gvec_t *v, const cprange_t *rg, int32_t n) {
  if (!gb_ok(b)) return;
  bool ascii_only = true;
  for (int32_t i = 0; i < n; i++) ascii_only &= rg[i].hi < 0x80;
  uint64_t ascii[4] = {0, 0, 0, 0};
  if (ascii_only) {
    for (int32_t i = 0; i < n; i++) set_range(ascii, rg[i].lo, rg[i].hi);
    vec_push(b, v, KILN_GEL_BYTES, set_intern(b, ascii));
    return;
  }
  int32_t r = rule_anon(b, parent);
  for (int32_t i = 0; i < n; i++) utf8_split(b, r, rg[i].lo, rg[i].hi, ascii);
  if (ascii[0] | ascii[1]) {
    gvec_t a = {0};
    vec_push(b, &a, KILN_GEL_BYTES, set_intern(b, ascii));
    rule_add_alt(b, r, &a);
  }
  vec_push(b, v, KILN_GEL_RULE, r);
}

/* ---- the GBNF parser --------------------------------------------------------------------- */

static bool is_name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
         c == '_';
}

/* Skips spaces, tabs and comments; newlines too when nl. */
static void skip_space(gb_t *b, bool nl) {
  while (b->p < b->end) {
    char c = *b->p;
    if (c == ' ' || c == '\t' || c == '\r') {
      b->p++;
    } else if (c == '#') {
      while (b->p < b->end && *b->p != '\n') b->p++;
    } else if (c == '\n' && nl) {
      b->p++;
    } else if (c == '\\' && b->p + 1 < b->end && b->p[1] == '\n') {
      b->p += 2; /* a line continuation */
    } else {
      break;
    }
  }
}

static int hexval(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

/* Reads one character of a literal or class (escapes, UTF-8); false at an error. */
static bool read_char(gb_t *b, uint32_t *cp) {
  const char *at = b->p;
  if (b->p >= b->end) {
    gb_fail(b, at, "unexpected end of the grammar");
    return false;
  }
  unsigned char c = (unsigned char)*b->p;
  if (c == '\\') {
    if (b->p + 1 >= b->end) {
      gb_fail(b, at, "a backslash at the end");
      return false;
    }
    char e = b->p[1];
    b->p += 2;
    int nd = 0;
    switch (e) {
      case 'n': *cp = '\n'; return true;
      case 'r': *cp = '\r'; return true;
      case 't': *cp = '\t'; return true;
      case 'f': *cp = '\f'; return true;
      case 'v': *cp = '\v'; return true;
      case '0': *cp = 0; return true;
      case '\\':
      case '"':
      case '[':
      case ']':
      case '-':
      case '^':
      case '\'':
      case '/':
      case '.':
      case '(':
      case ')':
      case '|':
      case '*':
      case '+':
      case '?':
      case '{':
      case '}':
      case '$': *cp = (uint32_t)e; return true;
      case 'x': nd = 2; break;
      case 'u': nd = 4; break;
      case 'U': nd = 8; break;
      default: gb_fail(b, at, "unknown escape '\\%c'", e); return false;
    }
    uint32_t v = 0;
    for (int i = 0; i < nd; i++) {
      int h = b->p < b->end ? hexval(*b->p) : -1;
      if (h < 0) {
        gb_fail(b, at, "\\%c needs %d hexadecimal digits", e, nd);
        return false;
      }
      v = v * 16 + (uint32_t)h;
      b->p++;
    }
    if (v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) {
      gb_fail(b, at, "U+%X is not a Unicode scalar value", (unsigned)v);
      return false;
    }
    *cp = v;
    return true;
  }
  int n = c < 0x80 ? 1 : c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 0;
  if (!n || b->p + n > b->end) {
    gb_fail(b, at, "invalid UTF-8");
    return false;
  }
  uint32_t v = n == 1 ? c : n == 2 ? c & 0x1F : n == 3 ? c & 0x0F : c & 0x07;
  for (int i = 1; i < n; i++) {
    unsigned char d = (unsigned char)b->p[i];
    if ((d & 0xC0) != 0x80) {
      gb_fail(b, at, "invalid UTF-8");
      return false;
    }
    v = (v << 6) | (d & 63);
  }
  b->p += n;
  *cp = v;
  return true;
}

static void push_literal_cp(gb_t *b, gvec_t *v, uint32_t cp) {
  unsigned char o[4];
  int n = utf8_enc(cp, o);
  for (int i = 0; i < n; i++) push_byte_range(b, v, o[i], o[i]);
}

static void parse_alternates(gb_t *b, int32_t rule, bool nested);

/* A character class after '['. */
static void parse_class(gb_t *b, int32_t rule, gvec_t *v) {
  const char *at = b->p - 1;
  bool neg = false;
  if (b->p < b->end && *b->p == '^') {
    neg = true;
    b->p++;
  }
  int32_t n = 0, cap = 16;
  cprange_t *rg = malloc((size_t)(cap + 2) * sizeof(*rg));
  if (!rg) {
    b->oom = true;
    return;
  }
  for (;;) {
    if (b->p >= b->end) {
      gb_fail(b, at, "unterminated character class");
      break;
    }
    if (*b->p == ']') {
      b->p++;
      break;
    }
    uint32_t lo, hi;
    if (!read_char(b, &lo)) break;
    hi = lo;
    if (b->p + 1 < b->end && *b->p == '-' && b->p[1] != ']') {
      b->p++;
      if (!read_char(b, &hi)) break;
      if (hi < lo) {
        gb_fail(b, at, "a range from U+%X down to U+%X", (unsigned)lo, (unsigned)hi);
        break;
      }
    }
    if (n == cap) {
      cap *= 2;
      cprange_t *nr = realloc(rg, (size_t)(cap + 2) * sizeof(*rg));
      if (!nr) {
        b->oom = true;
        break;
      }
      rg = nr;
    }
    rg[n++] = (cprange_t){lo, hi};
  }
  if (gb_ok(b)) {
    int32_t m = ranges_normalize(rg, n, neg);
    if (m < 0)
      b->oom = true;
    else if (m == 0)
      vec_push(b, v, KILN_GEL_BYTES, set_intern(b, (uint64_t[4]){0, 0, 0, 0}));
    else
      push_class(b, rule, v, rg, m);
  }
  free(rg);
}

/* Wraps v[from..] into a helper rule when it is longer than one element; returns the single
 * element that stands for it. */
static kiln_gel_t atom_of(gb_t *b, int32_t rule, gvec_t *v, int32_t from) {
  if (v->n - from == 1) {
    kiln_gel_t e = v->e[from];
    v->n = from;
    b->total--;
    return e;
  }
  int32_t r = rule_anon(b, rule);
  gvec_t a = {0};
  for (int32_t i = from; i < v->n && gb_ok(b); i++) vec_push(b, &a, v->e[i].kind, v->e[i].arg);
  b->total -= v->n - from;
  v->n = from;
  rule_add_alt(b, r, &a);
  return (kiln_gel_t){KILN_GEL_RULE, r};
}

/* r ::= x r | "" : zero or more x. */
static int32_t star_rule(gb_t *b, int32_t rule, kiln_gel_t x) {
  int32_t r = rule_anon(b, rule);
  gvec_t a = {0}, e = {0};
  vec_push(b, &a, x.kind, x.arg);
  vec_push(b, &a, KILN_GEL_RULE, r);
  rule_add_alt(b, r, &a);
  rule_add_alt(b, r, &e);
  return r;
}

/* Repeats the atom v[from..] between lo and hi times (hi < 0: unbounded). The optional part
 * of a bounded repetition is a chain of rules, each link recording the x* rule over the same
 * x and its count (rep_star, rep_count), so that the matcher can classify tokens in a link
 * from the unbounded rule's classification (guide.c: only tokens longer than the count can
 * tell them apart). */
static void apply_repeat(gb_t *b, int32_t rule, gvec_t *v, int32_t from, int64_t lo, int64_t hi) {
  if (!gb_ok(b)) return;
  kiln_gel_t x = atom_of(b, rule, v, from);
  for (int64_t i = 0; i < lo && gb_ok(b); i++) vec_push(b, v, x.kind, x.arg);
  if (hi < 0) {
    vec_push(b, v, KILN_GEL_RULE, star_rule(b, rule, x));
    return;
  }
  if (hi == lo) return;
  const int32_t star = star_rule(b, rule, x);
  /* opt_k ::= x opt_{k-1} | "" ; opt_1 ::= x | "" */
  int32_t prev = -1;
  for (int64_t k = 1; k <= hi - lo && gb_ok(b); k++) {
    int32_t r = rule_anon(b, rule);
    gvec_t a = {0}, e = {0};
    vec_push(b, &a, x.kind, x.arg);
    if (prev >= 0) vec_push(b, &a, KILN_GEL_RULE, prev);
    rule_add_alt(b, r, &a);
    rule_add_alt(b, r, &e);
    if (gb_ok(b)) {
      b->rules[r].rep_star = star;
      b->rules[r].rep_count = (int32_t)k;
    }
    prev = r;
  }
  if (gb_ok(b)) vec_push(b, v, KILN_GEL_RULE, prev);
}

static bool parse_int(gb_t *b, int64_t *out) {
  const char *at = b->p;
  int64_t v = 0;
  int nd = 0;
  while (b->p < b->end && *b->p >= '0' && *b->p <= '9') {
    v = v * 10 + (*b->p - '0');
    if (v > KILN_GRAMMAR_MAX_REPEAT) {
      gb_fail(b, at, "a repetition bound above %d", KILN_GRAMMAR_MAX_REPEAT);
      return false;
    }
    b->p++;
    nd++;
  }
  *out = v;
  return nd > 0;
}

/* One sequence: atoms with their repetition operators, up to '|', ')' or the rule's end. */
static void parse_sequence(gb_t *b, int32_t rule, bool nested, gvec_t *v) {
  int32_t last = -1; /* where the last atom starts in v */
  /* What the last atom's repeats amount to (stacked ones fold: (x*)+ = x*, (x+)+ = x+,
   * (x?)? = x?, and x+ under ?, * or {0,n} is x*): 0 nothing foldable, 1 x*, 2 x+, 3 x?. A
   * run of stacked operators (a fuzzer's "x*+++++...") would otherwise nest a rule per
   * operator, each alternative of which the matcher explores. */
  int last_rep = 0;
  for (;;) {
    skip_space(b, nested);
    if (!gb_ok(b) || b->p >= b->end) return;
    const char *at = b->p;
    char c = *b->p;
    if (c == '|' || c == ')' || c == '\n') return;
    if (c == '"') {
      b->p++;
      last = v->n, last_rep = 0;
      while (gb_ok(b)) {
        if (b->p >= b->end) {
          gb_fail(b, at, "unterminated literal");
          return;
        }
        if (*b->p == '"') {
          b->p++;
          break;
        }
        uint32_t cp;
        if (!read_char(b, &cp)) return;
        push_literal_cp(b, v, cp);
      }
      if (v->n == last) last = -1; /* "" is nothing */
    } else if (c == '[') {
      b->p++;
      last = v->n, last_rep = 0;
      parse_class(b, rule, v);
    } else if (c == '.') {
      b->p++;
      last = v->n, last_rep = 0;
      cprange_t rg[3] = {{0, 0x10FFFF}};
      int32_t m = ranges_normalize(rg, 1, false);
      push_class(b, rule, v, rg, m);
    } else if (c == '(') {
      b->p++;
      int32_t r = rule_anon(b, rule);
      parse_alternates(b, r, true);
      skip_space(b, true);
      if (!gb_ok(b)) return;
      if (b->p >= b->end || *b->p != ')') {
        gb_fail(b, at, "'(' without a matching ')'");
        return;
      }
      b->p++;
      last = v->n, last_rep = 0;
      vec_push(b, v, KILN_GEL_RULE, r);
    } else if (is_name_char(c)) {
      const char *s = b->p;
      while (b->p < b->end && is_name_char(*b->p)) b->p++;
      const char *e = b->p;
      skip_space(b, false);
      if (b->end - b->p >= 3 && !memcmp(b->p, "::=", 3)) {
        gb_fail(b, s, "a new rule starts here: end the previous rule's line first");
        return;
      }
      last = v->n, last_rep = 0;
      vec_push(b, v, KILN_GEL_RULE, rule_get(b, s, (size_t)(e - s), s));
    } else if (c == '*' || c == '+' || c == '?' || c == '{') {
      if (last < 0) {
        gb_fail(b, at, "'%c' has nothing to repeat", c);
        return;
      }
      b->p++;
      int64_t lo = 0, hi = -1;
      if (c == '+') lo = 1;
      if (c == '?') hi = 1;
      if (c == '{') {
        skip_space(b, false);
        if (!parse_int(b, &lo)) {
          gb_fail(b, at, "'{' needs a count: x{m}, x{m,} or x{m,n}");
          return;
        }
        skip_space(b, false);
        hi = lo;
        if (b->p < b->end && *b->p == ',') {
          b->p++;
          skip_space(b, false);
          hi = -1;
          if (b->p < b->end && *b->p >= '0' && *b->p <= '9' && !parse_int(b, &hi)) return;
          if (!gb_ok(b)) return;
        }
        skip_space(b, false);
        if (b->p >= b->end || *b->p != '}') {
          gb_fail(b, at, "'{' without a matching '}'");
          return;
        }
        b->p++;
        if (hi >= 0 && hi < lo) {
          gb_fail(b, at, "x{%lld,%lld}: the maximum is below the minimum", (long long)lo,
                  (long long)hi);
          return;
        }
      }
      const bool unb = hi < 0 && lo <= 1; /* * or + */
      const bool opt = lo == 0 && hi == 1;   /* ? */
      if ((last_rep == 1 && (unb || opt)) || (last_rep == 2 && unb && lo == 1) ||
          (last_rep == 3 && opt))
        continue; /* the language is already that */
      apply_repeat(b, rule, v, last, lo, hi);
      /* the repeated atom is the last one again (x** is fine) */
      last_rep = unb ? (lo == 0 ? 1 : 2) : opt ? (last_rep == 2 ? 1 : 3)
                 : (last_rep == 2 && lo == 0 && hi != 0) ? 1 : 0;
    } else if (c == '<') {
      gb_fail(b, at, "token references (<...>) are not supported; write the text as a literal");
      return;
    } else {
      gb_fail(b, at, "unexpected '%c'", c);
      return;
    }
  }
}

static void parse_alternates(gb_t *b, int32_t rule, bool nested) {
  for (;;) {
    gvec_t v = {0};
    parse_sequence(b, rule, nested, &v);
    rule_add_alt(b, rule, &v);
    if (!gb_ok(b)) return;
    skip_space(b, nested);
    if (b->p < b->end && *b->p == '|') {
      b->p++;
      skip_space(b, true);
      continue;
    }
    return;
  }
}

static void parse_grammar(gb_t *b) {
  for (;;) {
    skip_space(b, true);
    if (!gb_ok(b) || b->p >= b->end) return;
    const char *s = b->p;
    while (b->p < b->end && is_name_char(*b->p)) b->p++;
    if (b->p == s) {
      gb_fail(b, s, "expected a rule name");
      return;
    }
    const char *e = b->p;
    skip_space(b, false);
    if (b->end - b->p < 3 || memcmp(b->p, "::=", 3)) {
      gb_fail(b, b->p, "expected '::=' after the rule name '%.*s'", (int)(e - s), s);
      return;
    }
    b->p += 3;
    int32_t r = rule_get(b, s, (size_t)(e - s), s);
    if (!gb_ok(b)) return;
    if (b->rules[r].defined) {
      gb_fail(b, s, "rule '%s' is defined twice", b->rules[r].name);
      return;
    }
    b->rules[r].defined = true;
    gb_pos(b, s, &b->rules[r].line, &b->rules[r].col);
    skip_space(b, true);
    parse_alternates(b, r, false);
    skip_space(b, false);
    if (!gb_ok(b)) return;
    if (b->p < b->end && *b->p != '\n') {
      gb_fail(b, b->p, "unexpected '%c'", *b->p);
      return;
    }
  }
}

/* ---- checks and the compact form ---------------------------------------------------------- */

/* Left recursion. Rule r reaches s "at its left edge" when an alternative of r starts with
 * s, or with rules that may match "" followed by s; the edge is a tail edge when s is the last
 * element of that alternative. A cycle of left edges makes the stack grow without consuming
 * input, except a cycle of tail edges only: there the continuation stays the same node (stacks
 * are flattened at tail positions and hash-consed), so the closure revisits a node it has seen
 * and stops; x ::= y x | "" with a nullable y is such a grammar, and fine. So the grammar is
 * refused when a non-tail left edge joins two rules of one strongly connected component
 * (Tarjan's algorithm, iterative: chains of helper rules run deep). Returns the rule named in
 * the error, or -1. */
typedef struct ledge {
  int32_t to;
  bool tail;
} ledge_t;

static int32_t left_recursion(const gb_t *b, const bool *nullable, bool *oom) {
  const int32_t R = b->n;
  int32_t *off = calloc((size_t)R + 1, sizeof(int32_t));
  int64_t ne = 0;
  for (int pass = 0; pass < 2 && off; pass++) {
    ledge_t *ed = NULL;
    if (pass == 1 && !(ed = malloc((size_t)(ne ? ne : 1) * sizeof(*ed)))) break;
    int64_t k = 0;
    for (int32_t r = 0; r < R; r++) {
      if (pass == 1) off[r] = (int32_t)k;
      const grule_t *ru = &b->rules[r];
      for (int32_t a = 0; a < ru->n; a++)
        for (int32_t i = 0; i < ru->alts[a].n; i++) {
          kiln_gel_t e = ru->alts[a].e[i];
          if (e.kind != KILN_GEL_RULE) break;
          if (pass == 1) ed[k] = (ledge_t){e.arg, i == ru->alts[a].n - 1};
          k++;
          if (!nullable[e.arg]) break;
        }
    }
    if (pass == 0) {
      ne = k;
      continue;
    }
    off[R] = (int32_t)k;
    /* Tarjan */
    int32_t *idx = malloc((size_t)R * sizeof(int32_t)), *low = malloc((size_t)R * sizeof(int32_t));
    int32_t *comp = malloc((size_t)R * sizeof(int32_t)), *st = malloc((size_t)R * sizeof(int32_t));
    int32_t *cs = malloc((size_t)R * sizeof(int32_t)), *ci = malloc((size_t)R * sizeof(int32_t));
    bool *on = calloc((size_t)R, 1);
    int32_t found = -1;
    if (!idx || !low || !comp || !st || !cs || !ci || !on) {
      *oom = true;
    } else {
      for (int32_t r = 0; r < R; r++) idx[r] = -1;
      int32_t counter = 0, sp = 0, nc = 0;
      for (int32_t r0 = 0; r0 < R; r0++) {
        if (idx[r0] >= 0) continue;
        int32_t csp = 0;
        cs[csp] = r0;
        ci[csp++] = off[r0];
        idx[r0] = low[r0] = counter++;
        st[sp++] = r0;
        on[r0] = true;
        while (csp > 0) {
          int32_t v = cs[csp - 1];
          if (ci[csp - 1] < off[v + 1]) {
            int32_t w = ed[ci[csp - 1]++].to;
            if (idx[w] < 0) {
              idx[w] = low[w] = counter++;
              st[sp++] = w;
              on[w] = true;
              cs[csp] = w;
              ci[csp++] = off[w];
            } else if (on[w] && idx[w] < low[v]) {
              low[v] = idx[w];
            }
            continue;
          }
          if (low[v] == idx[v]) {
            int32_t w;
            do {
              w = st[--sp];
              on[w] = false;
              comp[w] = nc;
            } while (w != v);
            nc++;
          }
          csp--;
          if (csp > 0 && low[v] < low[cs[csp - 1]]) low[cs[csp - 1]] = low[v];
        }
      }
      for (int32_t r = 0; r < R && found < 0; r++)
        for (int32_t j = off[r]; j < off[r + 1]; j++)
          if (!ed[j].tail && comp[ed[j].to] == comp[r]) {
            found = r;
            break;
          }
    }
    free(idx);
    free(low);
    free(comp);
    free(st);
    free(cs);
    free(ci);
    free(on);
    free(ed);
    free(off);
    return found;
  }
  *oom = true;
  free(off);
  return -1;
}

static kiln_status_t finish(gb_t *b, const char *start, kiln_grammar_t **out) {
  const int32_t R = b->n;
  int32_t root = rule_find(b, start, strlen(start));
  if (root < 0) {
    gb_fail(b, NULL, "the grammar has no '%s' rule", start);
    return NULL;
  }
  for (int32_t r = 0; r < R; r++)
    if (!b->rules[r].defined) {
      gb_fail(b, NULL, "rule '%s' (line %d) is used but never defined", b->rules[r].name,
              (int)b->rules[r].line);
      return NULL;
    }
  bool *prod = calloc((size_t)R, 1), *nul = calloc((size_t)R, 1);
  if (!prod || !nul) {
    b->oom = true;
    goto done;
  }
  /* productive and nullable rules (fixpoints) */
  for (bool ch = true; ch;) {
    ch = false;
    for (int32_t r = 0; r < R; r++) {
      const grule_t *ru = &b->rules[r];
      for (int32_t a = 0; a < ru->n && !(prod[r] && nul[r]); a++) {
        bool p = true, z = true;
        for (int32_t i = 0; i < ru->alts[a].n; i++) {
          kiln_gel_t e = ru->alts[a].e[i];
          if (e.kind == KILN_GEL_BYTES) {
            const uint64_t *s = b->sets[e.arg];
            p &= (s[0] | s[1] | s[2] | s[3]) != 0;
            z = false;
          } else {
            p &= prod[e.arg];
            z &= nul[e.arg];
          }
        }
        if (p && !prod[r]) prod[r] = ch = true;
        if (z && !nul[r]) nul[r] = ch = true;
      }
    }
  }
  if (!prod[root]) {
    gb_fail(b, NULL, "the grammar matches no string (rule '%s' never finishes)", start);
    goto done;
  }
  bool loom = false;
  int32_t cyc = left_recursion(b, nul, &loom);
  if (loom) {
    b->oom = true;
    goto done;
  }
  if (cyc >= 0) {
    gb_fail(b, NULL,
            "rule '%s' is left-recursive (it can reach itself before matching any "
            "character); rewrite it with repetition, e.g. x ::= y (\",\" y)*",
            b->rules[cyc].name);
    goto done;
  }
  /* the compact form, without the alternatives that can never finish */
  kiln_grammar_t *g = calloc(1, sizeof(*g));
  if (!g) {
    b->oom = true;
    goto done;
  }
  int64_t nalts = 0, nel = 0;
  for (int32_t r = 0; r < R; r++)
    for (int32_t a = 0; a < b->rules[r].n; a++) {
      nalts++;
      nel += b->rules[r].alts[a].n + 1;
    }
  g->num_rules = R;
  g->num_sets = b->nsets;
  g->root = root;
  g->rule_alt = calloc((size_t)R + 1, sizeof(int32_t));
  g->alt_start = calloc((size_t)nalts + 1, sizeof(int32_t));
  g->el = calloc((size_t)nel + 1, sizeof(kiln_gel_t));
  g->el_rule = calloc((size_t)nel + 1, sizeof(int32_t));
  g->sets = calloc((size_t)b->nsets + 1, 32);
  g->names = calloc((size_t)R, sizeof(char *));
  g->nullable = calloc((size_t)R, 1);
  g->rep_pos = malloc((size_t)R * sizeof(int32_t));
  g->rep_count = calloc((size_t)R, sizeof(int32_t));
  if (!g->rule_alt || !g->alt_start || !g->el || !g->el_rule || !g->sets || !g->names ||
      !g->nullable || !g->rep_pos || !g->rep_count) {
    kiln_grammar_free(g);
    b->oom = true;
    goto done;
  }
  if (b->nsets) memcpy(g->sets, b->sets, (size_t)b->nsets * 32);
  memcpy(g->nullable, nul, (size_t)R);
  int32_t na = 0, ne = 0;
  for (int32_t r = 0; r < R; r++) {
    g->rule_alt[r] = na;
    g->names[r] = b->rules[r].name;
    b->rules[r].name = NULL;
    const grule_t *ru = &b->rules[r];
    for (int32_t a = 0; a < ru->n; a++) {
      bool ok = true;
      for (int32_t i = 0; i < ru->alts[a].n; i++) {
        kiln_gel_t e = ru->alts[a].e[i];
        if (e.kind == KILN_GEL_RULE
                ? !prod[e.arg]
                : !(b->sets[e.arg][0] | b->sets[e.arg][1] | b->sets[e.arg][2] | b->sets[e.arg][3]))
          ok = false;
      }
      if (!ok) continue;
      g->alt_start[na++] = ne;
      for (int32_t i = 0; i < ru->alts[a].n; i++) {
        g->el_rule[ne] = r;
        g->el[ne++] = ru->alts[a].e[i];
      }
      g->el_rule[ne] = r;
      g->el[ne++] = (kiln_gel_t){KILN_GEL_END, 0};
    }
  }
  g->rule_alt[R] = na;
  g->num_alts = na;
  g->num_el = ne;
  /* links of bounded repetitions: where their x* rule refers to itself ("x S", x not nullable) */
  for (int32_t r = 0; r < R; r++) {
    g->rep_pos[r] = -1;
    const int32_t S = b->rules[r].rep_star;
    if (S < 0) continue;
    for (int32_t a = g->rule_alt[S]; a < g->rule_alt[S + 1]; a++) {
      const int32_t p = g->alt_start[a];
      const kiln_gel_t x = g->el[p];
      if (x.kind == KILN_GEL_END || g->el[p + 1].kind != KILN_GEL_RULE ||
          g->el[p + 1].arg != S || g->el[p + 2].kind != KILN_GEL_END)
        continue;
      if (x.kind == KILN_GEL_RULE && nul[x.arg]) continue;
      g->rep_pos[r] = p + 1;
      g->rep_count[r] = b->rules[r].rep_count;
    }
  }
  *out = g;
done:
  free(prod);
  free(nul);
  return NULL;
}

kiln_status_t kiln_grammar_compile(const char *text, size_t len, const char *what,
                                   const char *start, kiln_grammar_t **out) {
  *out = NULL;
  gb_t b;
  memset(&b, 0, sizeof(b));
  b.what = what ? what : "grammar";
  b.src = b.p = text;
  b.end = text + len;
  parse_grammar(&b);
  if (gb_ok(&b)) finish(&b, start ? start : "root", out);
  kiln_status_t st = b.err;
  if (!st && b.oom) st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", b.what);
  if (st && *out) {
    kiln_grammar_free(*out);
    *out = NULL;
  }
  gb_free(&b);
  return st;
}

void kiln_grammar_free(kiln_grammar_t *g) {
  if (!g) return;
  if (g->names)
    for (int32_t r = 0; r < g->num_rules; r++) free(g->names[r]);
  free(g->names);
  free(g->rule_alt);
  free(g->alt_start);
  free(g->el);
  free(g->el_rule);
  free(g->sets);
  free(g->nullable);
  free(g->rep_pos);
  free(g->rep_count);
  free(g);
}
