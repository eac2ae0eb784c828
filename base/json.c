/* json.c - a strict, non-recursive JSON parser into an arena-backed tree, and JSON writers. */
#define _POSIX_C_SOURCE 200809L /* fileno, fstat, newlocale, uselocale */
#include "json.h"

#include "arena.h"

#include <errno.h>
#include <float.h>
#include <locale.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* ---- the tree --------------------------------------------------------------------------------
 *
 * Every node is 32 bytes and lives in its document's arena. Arrays and objects hold their
 * children contiguously (an array is a kiln_json_t[n]; an object is a json_obj_t header followed
 * by json_member_t[n]), so kiln_json_at() and kiln_json_value_at() are O(1) and a parsed
 * document is a handful of large allocations, not one per node.
 */

enum {
  JSON_FLAG_TRUE = 1,   /* a bool that is true */
  JSON_FLAG_INT = 2,    /* a number written without fraction or exponent that fits int64: a.i */
  JSON_FLAG_BIGINT = 4, /* written without fraction or exponent, but outside int64 */
};

struct kiln_json {
  uint8_t type;
  uint8_t flags;
  uint32_t line, col; /* 1-based; col counts bytes; both saturate at UINT32_MAX */
  union {
    size_t n;  /* string: bytes; array: elements; object: members */
    int64_t i; /* number with JSON_FLAG_INT: the exact value */
  } a;
  union {
    double d;             /* number */
    const char *s;        /* string: n bytes + NUL, in the arena */
    kiln_json_t *items;   /* array: n elements */
    struct json_obj *obj; /* object */
  } b;
};

typedef struct json_member {
  const char *key; /* NUL-terminated, in the arena */
  size_t key_len;
  kiln_json_t val;
} json_member_t;

/* Objects with more than JSON_INDEX_MIN members get an open-addressing hash index: a linear
 * scan over a few keys beats hashing, and most objects in real documents are small. */
#define JSON_INDEX_MIN 8

typedef struct json_obj {
  uint32_t *index; /* NULL, or mask+1 slots holding member index + 1 (0 = empty) */
  size_t mask;
  uint64_t seed; /* per-document hash seed, so colliding keys cannot be precomputed */
  json_member_t members[];
} json_obj_t;

/* ---- the document ------------------------------------------------------------------------ */

struct kiln_json_doc {
  kiln_arena_t arena; /* every node, member array, index and string */
  uint64_t seed;
  kiln_json_t root;
};

static kiln_json_doc_t *doc_create(size_t text_len) {
  kiln_json_doc_t *doc = calloc(1, sizeof(*doc)); /* zeroed: an empty arena */
  if (!doc) return NULL;
  /* Nodes and decoded strings take roughly 1-2x the text: sizing the arena for that up front
   * keeps an 11 MB tokenizer.json in a few chunks (about 15% faster than 1 MiB chunks). */
  size_t expect = text_len > SIZE_MAX / 2 ? SIZE_MAX : text_len + text_len / 2;
  kiln_arena_expect(&doc->arena, expect);
  uintptr_t a = (uintptr_t)doc, b = (uintptr_t)&doc;
  doc->seed = ((uint64_t)a * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)b * 0xC2B2AE3D27D4EB4Full);
  return doc;
}

void kiln_json_doc_free(kiln_json_doc_t *doc) {
  if (!doc) return;
  kiln_arena_free(&doc->arena);
  free(doc);
}

const kiln_json_t *kiln_json_root(const kiln_json_doc_t *doc) { return doc ? &doc->root : NULL; }

/* ---- hashing ------------------------------------------------------------------------------ */

static inline uint64_t hash_mix(uint64_t h) {
  h ^= h >> 32;
  h *= 0xD6E8FEB86659FD93ull;
  h ^= h >> 32;
  return h;
}

static uint64_t hash_key(uint64_t seed, const char *s, size_t n) {
  uint64_t h = seed ^ ((uint64_t)n * 0x9E3779B97F4A7C15ull);
  while (n >= 8) {
    uint64_t w;
    memcpy(&w, s, 8);
    h = hash_mix(h ^ w) * 0x9FB21C651E98DF25ull;
    s += 8;
    n -= 8;
  }
  uint64_t w = 0;
  if (n) memcpy(&w, s, n);
  return hash_mix(hash_mix(h ^ w) ^ seed);
}

static inline bool key_eq(const json_member_t *m, const char *key, size_t n) {
  return m->key_len == n && (n == 0 || memcmp(m->key, key, n) == 0);
}

/* Index of the member that wins a lookup of key (the last one with that key), or SIZE_MAX. */
static size_t obj_find(const kiln_json_t *obj, const char *key, size_t n) {
  const json_obj_t *o = obj->b.obj;
  size_t count = obj->a.n;
  if (!o->index) {
    for (size_t i = count; i-- > 0;)
      if (key_eq(&o->members[i], key, n)) return i;
    return SIZE_MAX;
  }
  size_t slot = (size_t)hash_key(o->seed, key, n) & o->mask;
  for (;;) {
    uint32_t e = o->index[slot];
    if (!e) return SIZE_MAX;
    if (key_eq(&o->members[e - 1], key, n)) return e - 1;
    slot = (slot + 1) & o->mask;
  }
}

/* Builds the hash index of an object with count members (> JSON_INDEX_MIN); false on OOM. A
 * later duplicate replaces the earlier one in its slot, so lookups see the last. */
static bool obj_build_index(kiln_json_doc_t *doc, json_obj_t *o, size_t count) {
  size_t cap = 16;
  while (cap < count * 2) cap *= 2; /* load factor <= 1/2: short probe runs */
  uint32_t *index = kiln_arena_alloc(&doc->arena, cap * sizeof(uint32_t), 4);
  if (!index) return false;
  memset(index, 0, cap * sizeof(uint32_t));
  size_t mask = cap - 1;
  for (size_t i = 0; i < count; i++) {
    const json_member_t *m = &o->members[i];
    size_t slot = (size_t)hash_key(o->seed, m->key, m->key_len) & mask;
    for (;;) {
      uint32_t e = index[slot];
      if (!e || key_eq(&o->members[e - 1], m->key, m->key_len)) {
        index[slot] = (uint32_t)(i + 1);
        break;
      }
      slot = (slot + 1) & mask;
    }
  }
  o->index = index;
  o->mask = mask;
  return true;
}

/* ---- parser state ------------------------------------------------------------------------- */

typedef struct parse_frame {
  uint8_t type; /* KILN_JSON_ARRAY or KILN_JSON_OBJECT */
  size_t base;  /* stack index of the first child; the container itself sits at base - 1 */
} parse_frame_t;

typedef struct parser {
  const unsigned char *p, *end;
  const unsigned char *line_start;
  uint32_t line;
  const char *name;
  kiln_json_doc_t *doc;
  json_member_t *stack; /* values (and keys) of the open containers, innermost last */
  size_t stack_len, stack_cap;
  char *scratch; /* decoded strings with escapes, and number copies for strtod */
  size_t scratch_len, scratch_cap;
  kiln_status_t st;
  int depth;
  parse_frame_t frames[KILN_JSON_MAX_DEPTH];
} parser_t;

static uint32_t sat32(size_t v) { return v > UINT32_MAX ? UINT32_MAX : (uint32_t)v; }

/* Records an error at byte q ("name: line L, column C: what"); returns false for chaining. */
static bool parse_error(parser_t *ps, const unsigned char *q, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static bool parse_error(parser_t *ps, const unsigned char *q, const char *fmt, ...) {
  if (ps->st) return false;
  char what[160];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof(what), fmt, ap);
  va_end(ap);
  ps->st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: line %u, column %zu: %s", ps->name,
                            (unsigned)ps->line, (size_t)(q - ps->line_start) + 1, what);
  return false;
}

static bool parse_oom(parser_t *ps) {
  if (!ps->st)
    ps->st =
        kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory while parsing JSON", ps->name);
  return false;
}

/* Describes the byte at q for a message: 'x' for printable ASCII, else its hex value. */
static const char *describe_byte(const parser_t *ps, const unsigned char *q, char buf[16]) {
  if (q >= ps->end) return "end of input";
  if (*q >= 0x21 && *q < 0x7F)
    snprintf(buf, 16, "'%c'", *q);
  else
    snprintf(buf, 16, "byte 0x%02X", *q);
  return buf;
}

static bool scratch_reserve(parser_t *ps, size_t extra) {
  if (ps->scratch_cap - ps->scratch_len >= extra) return true;
  size_t cap = ps->scratch_cap ? ps->scratch_cap : 256;
  while (cap - ps->scratch_len < extra) {
    if (cap > SIZE_MAX / 2) return parse_oom(ps);
    cap *= 2;
  }
  char *p = realloc(ps->scratch, cap);
  if (!p) return parse_oom(ps);
  ps->scratch = p;
  ps->scratch_cap = cap;
  return true;
}

/* Pushes an empty slot for a value (with key, for an object member); returns its index. */
static bool stack_push(parser_t *ps, const char *key, size_t key_len) {
  if (ps->stack_len == ps->stack_cap) {
    size_t cap = ps->stack_cap ? ps->stack_cap * 2 : 256;
    if (cap > SIZE_MAX / sizeof(json_member_t)) return parse_oom(ps);
    json_member_t *s = realloc(ps->stack, cap * sizeof(json_member_t));
    if (!s) return parse_oom(ps);
    ps->stack = s;
    ps->stack_cap = cap;
  }
  json_member_t *m = &ps->stack[ps->stack_len++];
  m->key = key;
  m->key_len = key_len;
  return true;
}

#define SWAR_ONES 0x0101010101010101ull
#define SWAR_HIGH 0x8080808080808080ull

/* Skips whitespace, counting lines. (Skipping eight spaces a word at a time measured slower on
 * tokenizer.json, whose indents are mostly 4-8 spaces.) */
static inline void skip_ws(parser_t *ps) {
  const unsigned char *p = ps->p, *end = ps->end;
  while (p < end) {
    unsigned char c = *p;
    if (c == ' ') {
      p++;
    } else if (c == '\n') {
      p++;
      ps->line++;
      ps->line_start = p;
    } else if (c == '\t' || c == '\r') {
      p++;
    } else {
      break;
    }
  }
  ps->p = p;
}

/* ---- strings ------------------------------------------------------------------------------ */

/* 0: a byte a string may hold as is; 1: '"'; 2: '\\'; 3: a control character; 4: non-ASCII. */
static const unsigned char str_class[256] = {
    3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3,
    0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
    4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
    4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
    4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
};

/* Length (2-4) of the valid UTF-8 sequence at p (whose first byte is >= 0x80), or 0 with *why
 * set to what is wrong with it. */
static size_t utf8_seq(const unsigned char *p, const unsigned char *end, const char **why) {
  unsigned char c = p[0];
  size_t avail = (size_t)(end - p), n;
  if (c < 0xC0) {
    *why = "invalid UTF-8: unexpected continuation byte";
    return 0;
  }
  if (c < 0xC2) {
    *why = "invalid UTF-8: overlong encoding";
    return 0;
  }
  if (c >= 0xF5) {
    *why = "invalid UTF-8: byte 0xF5-0xFF never appears in UTF-8";
    return 0;
  }
  n = c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
  for (size_t k = 1; k < n; k++) {
    if (k >= avail || (p[k] & 0xC0) != 0x80) {
      *why = "invalid UTF-8: truncated multi-byte sequence";
      return 0;
    }
  }
  if ((c == 0xE0 && p[1] < 0xA0) || (c == 0xF0 && p[1] < 0x90)) {
    *why = "invalid UTF-8: overlong encoding";
    return 0;
  }
  if (c == 0xED && p[1] >= 0xA0) {
    *why = "invalid UTF-8: a UTF-16 surrogate (U+D800-U+DFFF) encoded in UTF-8";
    return 0;
  }
  if (c == 0xF4 && p[1] >= 0x90) {
    *why = "invalid UTF-8: code point above U+10FFFF";
    return 0;
  }
  return n;
}

static int hex_val(unsigned char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

/* The 4 hex digits at p as a code unit, or -1. */
static long hex4(const unsigned char *p, const unsigned char *end) {
  if (end - p < 4) return -1;
  long v = 0;
  for (int k = 0; k < 4; k++) {
    int h = hex_val(p[k]);
    if (h < 0) return -1;
    v = v * 16 + h;
  }
  return v;
}

static void scratch_put_utf8(parser_t *ps, unsigned cp) {
  char *o = ps->scratch + ps->scratch_len;
  if (cp < 0x80) {
    o[0] = (char)cp;
    ps->scratch_len += 1;
  } else if (cp < 0x800) {
    o[0] = (char)(0xC0 | (cp >> 6));
    o[1] = (char)(0x80 | (cp & 0x3F));
    ps->scratch_len += 2;
  } else if (cp < 0x10000) {
    o[0] = (char)(0xE0 | (cp >> 12));
    o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
    o[2] = (char)(0x80 | (cp & 0x3F));
    ps->scratch_len += 3;
  } else {
    o[0] = (char)(0xF0 | (cp >> 18));
    o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (char)(0x80 | (cp & 0x3F));
    ps->scratch_len += 4;
  }
}

/* Copies n decoded bytes into the arena, NUL-terminated. */
static const char *arena_strdup(parser_t *ps, const void *s, size_t n) {
  const char *d = kiln_arena_strndup(&ps->doc->arena, s, n);
  if (!d) (void)parse_oom(ps);
  return d;
}

/* Decodes the rest of a string that has escapes, from p (at a backslash) on; the bytes of the
 * string before p are [start, p). Works in the scratch buffer: the decoded form is never longer
 * than the text, so one reservation covers the whole string once its end is known. */
static bool parse_string_slow(parser_t *ps, const unsigned char *open, const unsigned char *start,
                              const unsigned char *p, const char **out_s, size_t *out_n) {
  const unsigned char *end = ps->end;
  ps->scratch_len = 0;
  /* The decoded string is at most as long as the rest of the input. */
  if (!scratch_reserve(ps, (size_t)(end - start))) return false;
  memcpy(ps->scratch, start, (size_t)(p - start));
  ps->scratch_len = (size_t)(p - start);
  for (;;) {
    const unsigned char *run = p;
    while (p < end && str_class[*p] == 0) p++;
    memcpy(ps->scratch + ps->scratch_len, run, (size_t)(p - run));
    ps->scratch_len += (size_t)(p - run);
    if (p >= end) return parse_error(ps, open, "unterminated string");
    unsigned char c = *p;
    if (c == '"') {
      ps->p = p + 1;
      *out_n = ps->scratch_len;
      *out_s = arena_strdup(ps, ps->scratch, ps->scratch_len);
      return *out_s != NULL;
    }
    if (c >= 0x80) {
      const char *why = NULL;
      size_t n = utf8_seq(p, end, &why);
      if (!n) return parse_error(ps, p, "%s", why);
      memcpy(ps->scratch + ps->scratch_len, p, n);
      ps->scratch_len += n;
      p += n;
      continue;
    }
    if (c < 0x20)
      return parse_error(ps, p, "control character U+%04X must be escaped in a string", c);
    /* a backslash */
    if (p + 1 >= end) return parse_error(ps, open, "unterminated string");
    unsigned char e = p[1];
    char simple = 0;
    switch (e) {
      case '"': simple = '"'; break;
      case '\\': simple = '\\'; break;
      case '/': simple = '/'; break;
      case 'b': simple = '\b'; break;
      case 'f': simple = '\f'; break;
      case 'n': simple = '\n'; break;
      case 'r': simple = '\r'; break;
      case 't': simple = '\t'; break;
      case 'u': break;
      default: {
        char buf[16];
        return parse_error(ps, p, "invalid escape: '\\' followed by %s",
                           describe_byte(ps, p + 1, buf));
      }
    }
    if (simple) {
      ps->scratch[ps->scratch_len++] = simple;
      p += 2;
      continue;
    }
    long u = hex4(p + 2, end);
    if (u < 0) return parse_error(ps, p, "invalid \\u escape: expected 4 hex digits");
    unsigned cp = (unsigned)u;
    if (cp >= 0xDC00 && cp <= 0xDFFF)
      return parse_error(ps, p, "lone low surrogate \\u%04X without a high surrogate before it",
                         cp);
    if (cp >= 0xD800 && cp <= 0xDBFF) {
      long lo = (end - p >= 12 && p[6] == '\\' && p[7] == 'u') ? hex4(p + 8, end) : -1;
      if (lo < 0xDC00 || lo > 0xDFFF)
        return parse_error(ps, p, "lone high surrogate \\u%04X not followed by a low surrogate",
                           cp);
      cp = 0x10000 + ((cp - 0xD800) << 10) + ((unsigned)lo - 0xDC00);
      p += 12;
    } else {
      p += 6;
    }
    scratch_put_utf8(ps, cp);
  }
}

/* Parses a string whose opening quote is at ps->p; the decoded bytes go to the arena. Plain
 * ASCII is skipped eight bytes at a time (a word with no '"', '\\', control or high byte), and
 * two-byte UTF-8 (common in byte-level BPE vocabularies: "\u0120" is Ġ) is checked inline. */
static bool parse_string(parser_t *ps, const char **out_s, size_t *out_n) {
  const unsigned char *open = ps->p, *start = open + 1, *p = start, *end = ps->end;
  for (;;) {
    while (end - p >= 8) {
      uint64_t w, q, b;
      memcpy(&w, p, 8);
      q = w ^ (SWAR_ONES * '"');
      b = w ^ (SWAR_ONES * '\\');
      if ((((q - SWAR_ONES) & ~q) | ((b - SWAR_ONES) & ~b) | ((w - SWAR_ONES * 0x20) & ~w) | w) &
          SWAR_HIGH)
        break;
      p += 8;
    }
    while (p < end && str_class[*p] == 0) p++;
    if (p >= end) return parse_error(ps, open, "unterminated string");
    unsigned char c = *p;
    if (c == '"') break;
    if (c >= 0xC2 && c <= 0xDF && end - p >= 2 && (p[1] & 0xC0) == 0x80) {
      p += 2;
      continue;
    }
    if (c >= 0x80) {
      const char *why = NULL;
      size_t n = utf8_seq(p, end, &why);
      if (!n) return parse_error(ps, p, "%s", why);
      p += n;
      continue;
    }
    if (c == '\\') return parse_string_slow(ps, open, start, p, out_s, out_n);
    return parse_error(ps, p, "control character U+%04X must be escaped in a string", c);
  }
  ps->p = p + 1;
  *out_n = (size_t)(p - start);
  *out_s = arena_strdup(ps, start, (size_t)(p - start));
  return *out_s != NULL;
}

/* ---- numbers ------------------------------------------------------------------------------ */

/* strtod and printf read and write the decimal point of LC_NUMERIC. Kiln never calls
 * setlocale, but a program embedding libkiln may, so number conversions switch the calling
 * thread (only it: uselocale is per thread) to the C locale and back. If the C locale object
 * cannot be made (out of memory on first use), conversions run in the caller's locale. */
static pthread_once_t json_locale_once = PTHREAD_ONCE_INIT;
static locale_t json_c_locale; /* never freed: one per process */

static void json_locale_init(void) { json_c_locale = newlocale(LC_NUMERIC_MASK, "C", (locale_t)0); }

/* Returns the locale to restore with numeric_end(), or (locale_t)0. */
static locale_t numeric_begin(void) {
  pthread_once(&json_locale_once, json_locale_init);
  return json_c_locale ? uselocale(json_c_locale) : (locale_t)0;
}

static void numeric_end(locale_t old) {
  if (old) uselocale(old);
}

/* strtod on a NUL-terminated copy of the number's n bytes (strtod must stop where the number
 * does, and the text need not be terminated). Returns false on overflow to infinity. */
static bool number_strtod(parser_t *ps, const unsigned char *s, size_t n, double *out) {
  ps->scratch_len = 0;
  if (!scratch_reserve(ps, n + 1)) return false;
  memcpy(ps->scratch, s, n);
  ps->scratch[n] = '\0';
  locale_t old = numeric_begin();
  errno = 0;
  double d = strtod(ps->scratch, NULL);
  bool overflow = errno == ERANGE && isinf(d);
  numeric_end(old);
  if (overflow) return false;
  *out = d;
  return true;
}

static bool is_digit(unsigned char c) { return c >= '0' && c <= '9'; }

static bool parse_number(parser_t *ps, kiln_json_t *v) {
  const unsigned char *start = ps->p, *p = start, *end = ps->end;
  bool neg = false, is_int = true;
  if (*p == '-') {
    neg = true;
    p++;
  }
  if (p >= end || !is_digit(*p)) {
    char buf[16];
    return parse_error(ps, p, "expected a digit after '-', got %s", describe_byte(ps, p, buf));
  }
  uint64_t mant = 0;
  size_t ndig = 0;
  if (*p == '0') {
    p++;
    if (p < end && is_digit(*p))
      return parse_error(ps, p - 1, "leading zeros are not allowed in numbers");
  } else {
    while (p < end && is_digit(*p)) {
      if (ndig < 19) mant = mant * 10 + (uint64_t)(*p - '0');
      ndig++;
      p++;
    }
  }
  if (p < end && *p == '.') {
    p++;
    if (p >= end || !is_digit(*p)) {
      char buf[16];
      return parse_error(ps, p, "expected a digit after the decimal point, got %s",
                         describe_byte(ps, p, buf));
    }
    while (p < end && is_digit(*p)) p++;
    is_int = false;
  }
  if (p < end && (*p == 'e' || *p == 'E')) {
    p++;
    if (p < end && (*p == '+' || *p == '-')) p++;
    if (p >= end || !is_digit(*p)) {
      char buf[16];
      return parse_error(ps, p, "expected a digit in the exponent, got %s",
                         describe_byte(ps, p, buf));
    }
    while (p < end && is_digit(*p)) p++;
    is_int = false;
  }
  v->type = KILN_JSON_NUMBER;
  v->flags = 0;
  /* Integers of up to 19 digits are exact in a uint64; the conversion to double rounds once,
   * correctly. Everything else goes through strtod. */
  if (is_int && ndig <= 19 && mant <= (neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX)) {
    v->flags = JSON_FLAG_INT;
    v->a.i = neg ? (mant == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)mant) : (int64_t)mant;
    v->b.d = neg ? -(double)mant : (double)mant;
  } else {
    v->a.i = 0;
    if (is_int) v->flags = JSON_FLAG_BIGINT;
    if (!number_strtod(ps, start, (size_t)(p - start), &v->b.d))
      return ps->st ? false : parse_error(ps, start, "number out of range (overflows a double)");
  }
  ps->p = p;
  return true;
}

/* ---- the parser proper -------------------------------------------------------------------- */

/* Closes the innermost container: its children move from the stack into the arena. */
static bool close_container(parser_t *ps) {
  parse_frame_t *f = &ps->frames[--ps->depth];
  size_t n = ps->stack_len - f->base;
  json_member_t *kids = ps->stack + f->base;
  kiln_json_t *v = &ps->stack[f->base - 1].val;
  v->a.n = n;
  if (f->type == KILN_JSON_ARRAY) {
    v->b.items = NULL;
    if (n) {
      kiln_json_t *items = kiln_arena_alloc(&ps->doc->arena, n * sizeof(kiln_json_t), 8);
      if (!items) return parse_oom(ps);
      for (size_t i = 0; i < n; i++) items[i] = kids[i].val;
      v->b.items = items;
    }
  } else {
    json_obj_t *o =
        kiln_arena_alloc(&ps->doc->arena, sizeof(json_obj_t) + n * sizeof(json_member_t), 8);
    if (!o) return parse_oom(ps);
    o->index = NULL;
    o->mask = 0;
    o->seed = ps->doc->seed;
    if (n) memcpy(o->members, kids, n * sizeof(json_member_t));
    if (n > JSON_INDEX_MIN && !obj_build_index(ps->doc, o, n)) return parse_oom(ps);
    v->b.obj = o;
  }
  ps->stack_len = f->base;
  return true;
}

/* Parses an object key (at ps->p, which must be '"') and the ':' after it, and pushes the slot
 * for its value. */
static bool parse_key(parser_t *ps) {
  if (ps->p >= ps->end || *ps->p != '"') {
    char buf[16];
    return parse_error(ps, ps->p, "expected a string key in an object, got %s",
                       describe_byte(ps, ps->p, buf));
  }
  const char *key;
  size_t key_len;
  if (!parse_string(ps, &key, &key_len)) return false;
  skip_ws(ps);
  if (ps->p >= ps->end || *ps->p != ':') {
    char buf[16];
    return parse_error(ps, ps->p, "expected ':' after an object key, got %s",
                       describe_byte(ps, ps->p, buf));
  }
  ps->p++;
  return stack_push(ps, key, key_len);
}

static bool match_literal(parser_t *ps, const char *lit, size_t n) {
  if ((size_t)(ps->end - ps->p) < n || memcmp(ps->p, lit, n) != 0)
    return parse_error(ps, ps->p, "invalid literal (expected %s)", lit);
  ps->p += n;
  return true;
}

/* Parses the value at ps->p into the top stack slot. Containers are opened here and filled by
 * the loop in parse_document, so nesting costs heap frames, never C stack. */
static bool parse_value(parser_t *ps) {
  skip_ws(ps);
  kiln_json_t *v = &ps->stack[ps->stack_len - 1].val;
  const unsigned char *p = ps->p;
  v->line = ps->line;
  v->col = sat32((size_t)(p - ps->line_start) + 1);
  v->flags = 0;
  v->a.n = 0;
  v->b.s = NULL;
  if (p >= ps->end) return parse_error(ps, p, "unexpected end of input, expected a value");
  switch (*p) {
    case '{':
    case '[':
      if (ps->depth >= KILN_JSON_MAX_DEPTH)
        return parse_error(ps, p, "nesting deeper than %d levels", KILN_JSON_MAX_DEPTH);
      v->type = *p == '{' ? KILN_JSON_OBJECT : KILN_JSON_ARRAY;
      ps->frames[ps->depth].type = v->type;
      ps->frames[ps->depth].base = ps->stack_len;
      ps->depth++;
      ps->p++;
      return true;
    case '"': {
      const char *s = NULL;
      size_t n = 0;
      v->type = KILN_JSON_STRING;
      if (!parse_string(ps, &s, &n)) return false;
      v = &ps->stack[ps->stack_len - 1].val;
      v->a.n = n;
      v->b.s = s;
      return true;
    }
    case 't':
      v->type = KILN_JSON_BOOL;
      v->flags = JSON_FLAG_TRUE;
      return match_literal(ps, "true", 4);
    case 'f': v->type = KILN_JSON_BOOL; return match_literal(ps, "false", 5);
    case 'n': v->type = KILN_JSON_NULL; return match_literal(ps, "null", 4);
    case '-':
    case '0':
    case '1':
    case '2':
    case '3':
    case '4':
    case '5':
    case '6':
    case '7':
    case '8':
    case '9': return parse_number(ps, v);
    case 'N':
    case 'I': return parse_error(ps, p, "NaN and Infinity are not valid JSON");
    default: {
      char buf[16];
      return parse_error(ps, p, "unexpected %s, expected a value", describe_byte(ps, p, buf));
    }
  }
}

static bool parse_document(parser_t *ps) {
  /* RFC 8259 section 8.1: a parser may ignore a UTF-8 byte order mark. */
  if (ps->end - ps->p >= 3 && ps->p[0] == 0xEF && ps->p[1] == 0xBB && ps->p[2] == 0xBF) ps->p += 3;
  if (!stack_push(ps, NULL, 0)) return false; /* the root's slot */
  if (!parse_value(ps)) return false;
  for (;;) {
    /* A value just ended, or a container just opened. */
    if (ps->depth == 0) break;
    parse_frame_t *f = &ps->frames[ps->depth - 1];
    skip_ws(ps);
    const unsigned char *p = ps->p;
    bool first = ps->stack_len == f->base;
    char close = f->type == KILN_JSON_ARRAY ? ']' : '}';
    if (p < ps->end && *p == (unsigned char)close) {
      ps->p++;
      if (!close_container(ps)) return false;
      continue;
    }
    if (!first) {
      if (p >= ps->end || *p != ',') {
        char buf[16];
        return parse_error(ps, p, "expected ',' or '%c' after %s, got %s", close,
                           f->type == KILN_JSON_ARRAY ? "an array element" : "an object member",
                           describe_byte(ps, p, buf));
      }
      ps->p++;
      skip_ws(ps);
      if (ps->p < ps->end && *ps->p == (unsigned char)close)
        return parse_error(ps, ps->p, "trailing comma before '%c'", close);
    }
    if (f->type == KILN_JSON_ARRAY) {
      if (!stack_push(ps, NULL, 0)) return false;
    } else {
      if (!parse_key(ps)) return false;
    }
    if (!parse_value(ps)) return false;
  }
  skip_ws(ps);
  if (ps->p < ps->end) {
    char buf[16];
    return parse_error(ps, ps->p, "unexpected %s after the document",
                       describe_byte(ps, ps->p, buf));
  }
  ps->doc->root = ps->stack[0].val;
  return true;
}

kiln_status_t kiln_json_parse(const char *text, size_t len, const char *name,
                              kiln_json_doc_t **out_doc) {
  *out_doc = NULL;
  if (!name) name = "<json>";
  if (!text && len) return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: no text", name);
  parser_t *ps = calloc(1, sizeof(*ps));
  if (!ps) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", name);
  ps->p = (const unsigned char *)(text ? text : "");
  ps->end = ps->p + len;
  ps->line_start = ps->p;
  ps->line = 1;
  ps->name = name;
  ps->doc = doc_create(len);
  if (!ps->doc) {
    parse_oom(ps);
  } else if (parse_document(ps)) {
    *out_doc = ps->doc;
    ps->doc = NULL;
  }
  kiln_status_t st = ps->st;
  kiln_json_doc_free(ps->doc);
  free(ps->stack);
  free(ps->scratch);
  free(ps);
  return st;
}

kiln_status_t kiln_json_parse_file(const char *path, kiln_json_doc_t **out_doc) {
  *out_doc = NULL;
  kiln_status_t st = NULL;
  char *buf = NULL;
  size_t len = 0, cap = 0;
  FILE *f = fopen(path, "rb");
  if (!f) {
    int e = errno;
    return kiln_status_make(e == ENOENT ? KILN_ERR_NOT_FOUND : KILN_ERR_IO, "%s: %s", path,
                            strerror(e));
  }
  /* Size hint from the file length; the read loop below also copes with pipes. */
  struct stat sb;
  if (fstat(fileno(f), &sb) == 0) {
    if (S_ISDIR(sb.st_mode)) {
      st = kiln_status_make(KILN_ERR_IO, "%s: %s", path, strerror(EISDIR));
      goto done;
    }
    if (S_ISREG(sb.st_mode) && sb.st_size > 0 && (uintmax_t)sb.st_size < SIZE_MAX / 2)
      cap = (size_t)sb.st_size + 1;
  }
  if (cap < 4096) cap = 4096;
  buf = malloc(cap);
  if (!buf) goto oom;
  for (;;) {
    if (len == cap) {
      char *nb = cap <= SIZE_MAX / 2 ? realloc(buf, cap * 2) : NULL;
      if (!nb) goto oom;
      buf = nb;
      cap *= 2;
    }
    size_t got = fread(buf + len, 1, cap - len, f);
    len += got;
    if (got == 0) {
      if (ferror(f)) {
        st = kiln_status_make(KILN_ERR_IO, "%s: read failed: %s", path, strerror(errno));
        goto done;
      }
      break;
    }
  }
  st = kiln_json_parse(buf, len, path, out_doc);
  goto done;
oom:
  st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory reading %zu bytes", path, cap);
done:
  free(buf);
  fclose(f);
  return st;
}

/* ---- accessors ---------------------------------------------------------------------------- */

kiln_json_type_t kiln_json_type(const kiln_json_t *v) {
  return v ? (kiln_json_type_t)v->type : KILN_JSON_NULL;
}

const char *kiln_json_type_name(kiln_json_type_t t) {
  switch (t) {
    case KILN_JSON_NULL: return "null";
    case KILN_JSON_BOOL: return "bool";
    case KILN_JSON_NUMBER: return "number";
    case KILN_JSON_STRING: return "string";
    case KILN_JSON_ARRAY: return "array";
    case KILN_JSON_OBJECT: return "object";
  }
  return "unknown";
}

bool kiln_json_is(const kiln_json_t *v, kiln_json_type_t t) { return kiln_json_type(v) == t; }

bool kiln_json_bool(const kiln_json_t *v) {
  return v && v->type == KILN_JSON_BOOL && (v->flags & JSON_FLAG_TRUE);
}

double kiln_json_number(const kiln_json_t *v) {
  return v && v->type == KILN_JSON_NUMBER ? v->b.d : 0.0;
}

bool kiln_json_number_is_int(const kiln_json_t *v) {
  return v && v->type == KILN_JSON_NUMBER && (v->flags & JSON_FLAG_INT);
}

bool kiln_json_int64(const kiln_json_t *v, int64_t *out) {
  if (!v || v->type != KILN_JSON_NUMBER) return false;
  if (v->flags & JSON_FLAG_INT) {
    *out = v->a.i;
    return true;
  }
  if (v->flags & JSON_FLAG_BIGINT) return false; /* its double may be +-2^63 exactly */
  double d = v->b.d;
  /* -2^63 is a double; 2^63 is the first double above INT64_MAX. */
  if (!(d >= -9223372036854775808.0 && d < 9223372036854775808.0) || d != trunc(d)) return false;
  *out = (int64_t)d;
  return true;
}

const char *kiln_json_string(const kiln_json_t *v, size_t *out_len) {
  if (!v || v->type != KILN_JSON_STRING) {
    if (out_len) *out_len = 0;
    return NULL;
  }
  if (out_len) *out_len = v->a.n;
  return v->b.s;
}

size_t kiln_json_len(const kiln_json_t *v) {
  return v && (v->type == KILN_JSON_ARRAY || v->type == KILN_JSON_OBJECT) ? v->a.n : 0;
}

const kiln_json_t *kiln_json_at(const kiln_json_t *v, size_t i) {
  if (!v || v->type != KILN_JSON_ARRAY || i >= v->a.n) return NULL;
  return &v->b.items[i];
}

const kiln_json_t *kiln_json_getn(const kiln_json_t *obj, const char *key, size_t key_len) {
  if (!obj || obj->type != KILN_JSON_OBJECT || !key) return NULL;
  size_t i = obj_find(obj, key, key_len);
  return i == SIZE_MAX ? NULL : &obj->b.obj->members[i].val;
}

const kiln_json_t *kiln_json_get(const kiln_json_t *obj, const char *key) {
  return key ? kiln_json_getn(obj, key, strlen(key)) : NULL;
}

const char *kiln_json_key_at(const kiln_json_t *obj, size_t i, size_t *out_len) {
  if (!obj || obj->type != KILN_JSON_OBJECT || i >= obj->a.n) {
    if (out_len) *out_len = 0;
    return NULL;
  }
  const json_member_t *m = &obj->b.obj->members[i];
  if (out_len) *out_len = m->key_len;
  return m->key;
}

const kiln_json_t *kiln_json_value_at(const kiln_json_t *obj, size_t i) {
  if (!obj || obj->type != KILN_JSON_OBJECT || i >= obj->a.n) return NULL;
  return &obj->b.obj->members[i].val;
}

void kiln_json_position(const kiln_json_t *v, int *out_line, int *out_col) {
  int line = 0, col = 0;
  if (v) {
    line = v->line > INT32_MAX ? INT32_MAX : (int)v->line;
    col = v->col > INT32_MAX ? INT32_MAX : (int)v->col;
  }
  if (out_line) *out_line = line;
  if (out_col) *out_col = col;
}

/* ---- writing ------------------------------------------------------------------------------ */

static const char hex_digits[] = "0123456789abcdef";

static bool put_u_escape(kiln_strbuf_t *out, unsigned u) {
  char e[6] = {'\\',
               'u',
               hex_digits[(u >> 12) & 15],
               hex_digits[(u >> 8) & 15],
               hex_digits[(u >> 4) & 15],
               hex_digits[u & 15]};
  return kiln_strbuf_append(out, e, 6);
}

/* Python's json.dumps escapes exactly: '"', '\\', C0 controls, and with ensure_ascii also
 * DEL and everything non-ASCII (hex digits lower case, as Python writes them). */
bool kiln_json_write_string(kiln_strbuf_t *out, const char *s, size_t n, bool ensure_ascii) {
  const unsigned char *p = (const unsigned char *)s, *end = p + n;
  if (!kiln_strbuf_reserve(out, n + 2)) return false;
  bool ok = kiln_strbuf_append_char(out, '"');
  while (ok && p < end) {
    const unsigned char *run = p;
    while (p < end && *p >= 0x20 && *p != '"' && *p != '\\' && *p < 0x7F) p++;
    if (p > run) ok = kiln_strbuf_append(out, run, (size_t)(p - run));
    if (!ok || p >= end) break;
    unsigned char c = *p;
    if (c < 0x80) {
      p++;
      switch (c) {
        case '"': ok = kiln_strbuf_append(out, "\\\"", 2); break;
        case '\\': ok = kiln_strbuf_append(out, "\\\\", 2); break;
        case '\n': ok = kiln_strbuf_append(out, "\\n", 2); break;
        case '\r': ok = kiln_strbuf_append(out, "\\r", 2); break;
        case '\t': ok = kiln_strbuf_append(out, "\\t", 2); break;
        case '\b': ok = kiln_strbuf_append(out, "\\b", 2); break;
        case '\f': ok = kiln_strbuf_append(out, "\\f", 2); break;
        default:
          ok = (c == 0x7F && !ensure_ascii) ? kiln_strbuf_append_char(out, (char)c)
                                            : put_u_escape(out, c);
      }
      continue;
    }
    const char *why;
    size_t len = utf8_seq(p, end, &why);
    unsigned cp;
    if (!len) {
      cp = 0xFFFD;
      len = 1;
    } else if (len == 2) {
      cp = ((p[0] & 0x1Fu) << 6) | (p[1] & 0x3Fu);
    } else if (len == 3) {
      cp = ((p[0] & 0x0Fu) << 12) | ((p[1] & 0x3Fu) << 6) | (p[2] & 0x3Fu);
    } else {
      cp = ((p[0] & 0x07u) << 18) | ((p[1] & 0x3Fu) << 12) | ((p[2] & 0x3Fu) << 6) | (p[3] & 0x3Fu);
    }
    if (!ensure_ascii) {
      ok = cp == 0xFFFD && len == 1 ? kiln_strbuf_append(out, "\xEF\xBF\xBD", 3)
                                    : kiln_strbuf_append(out, p, len);
    } else if (cp >= 0x10000) {
      cp -= 0x10000;
      ok = put_u_escape(out, 0xD800 + (cp >> 10)) && put_u_escape(out, 0xDC00 + (cp & 0x3FF));
    } else {
      ok = put_u_escape(out, cp);
    }
    p += len;
  }
  return ok && kiln_strbuf_append_char(out, '"');
}

static bool write_int64(kiln_strbuf_t *out, int64_t i) {
  char buf[24], *e = buf + sizeof(buf), *q = e;
  uint64_t u = i < 0 ? 0 - (uint64_t)i : (uint64_t)i;
  do {
    *--q = (char)('0' + u % 10);
    u /= 10;
  } while (u);
  if (i < 0) *--q = '-';
  return kiln_strbuf_append(out, q, (size_t)(e - q));
}

/* Python's float repr: the shortest digit string that reads back as x (the closest one when
 * several are that short), in fixed notation when the decimal exponent is in [-4, 16) (with
 * ".0" when there is no fraction), else as d[.ddd]e+XX with at least two exponent digits.
 *
 * The digits come from printf's correctly rounded %.{14,15,16}e: any decimal of <= 15
 * significant digits survives a trip through a normal double (DBL_DIG), so 15 digits with
 * trailing zeros stripped is the shortest form whenever one of <= 15 digits exists; of several
 * 16-digit forms the correctly rounded one is the closest; 17 always works. Subnormals hold
 * fewer digits (5e-324 is one), so for them every precision from 1 up is tried. Runs in the C
 * locale (see numeric_begin); the digit scan below would cope with any decimal point anyway. */
bool kiln_json_write_double(kiln_strbuf_t *out, double x) {
  if (isnan(x)) return kiln_strbuf_append(out, "NaN", 3);
  if (isinf(x)) return kiln_strbuf_append_str(out, x > 0 ? "Infinity" : "-Infinity");
  char tmp[64];
  locale_t old = numeric_begin();
  for (int prec = fabs(x) < DBL_MIN ? 1 : 15; prec <= 17; prec++) {
    snprintf(tmp, sizeof(tmp), "%.*e", prec - 1, x);
    if (prec == 17 || strtod(tmp, NULL) == x) break;
  }
  numeric_end(old);
  char digits[24];
  int nd = 0, exp10 = 0;
  const char *q = tmp;
  bool neg = *q == '-';
  if (neg) q++;
  for (; *q && *q != 'e' && *q != 'E'; q++)
    if (*q >= '0' && *q <= '9' && nd < 20) digits[nd++] = *q;
  if (*q) exp10 = (int)strtol(q + 1, NULL, 10);
  if (nd == 0) digits[nd++] = '0'; /* cannot happen with a working printf */
  while (nd > 1 && digits[nd - 1] == '0') nd--;

  char buf[64], *o = buf;
  if (neg) *o++ = '-';
  if (exp10 >= -4 && exp10 < 16) {
    if (exp10 >= 0) {
      for (int k = 0; k <= exp10; k++) *o++ = k < nd ? digits[k] : '0';
      *o++ = '.';
      if (nd > exp10 + 1) {
        for (int k = exp10 + 1; k < nd; k++) *o++ = digits[k];
      } else {
        *o++ = '0';
      }
    } else {
      *o++ = '0';
      *o++ = '.';
      for (int k = 0; k < -exp10 - 1; k++) *o++ = '0';
      for (int k = 0; k < nd; k++) *o++ = digits[k];
    }
  } else {
    *o++ = digits[0];
    if (nd > 1) {
      *o++ = '.';
      for (int k = 1; k < nd; k++) *o++ = digits[k];
    }
    o += snprintf(o, (size_t)(buf + sizeof(buf) - o), "e%c%02d", exp10 < 0 ? '-' : '+',
                  exp10 < 0 ? -exp10 : exp10);
  }
  return kiln_strbuf_append(out, buf, (size_t)(o - buf));
}

bool kiln_json_write_number(kiln_strbuf_t *out, double x) {
  if (isfinite(x) && fabs(x) < 9007199254740992.0 && x == trunc(x)) {
    if (x == 0 && signbit(x)) return kiln_strbuf_append(out, "-0", 2);
    return write_int64(out, (int64_t)x);
  }
  return kiln_json_write_double(out, x);
}

static bool write_indent(kiln_strbuf_t *out, int level) {
  if (!kiln_strbuf_append_char(out, '\n')) return false;
  for (int k = 0; k < level; k++)
    if (!kiln_strbuf_append(out, "  ", 2)) return false;
  return true;
}

/* Writes an object's members the way Python would after json.loads: a duplicated key appears
 * once, at its first position, with its last value. seen is NULL when there are no duplicates. */
static bool write_value(kiln_strbuf_t *out, const kiln_json_t *v, bool ensure_ascii, bool pretty,
                        int level);

static bool write_object(kiln_strbuf_t *out, const kiln_json_t *v, bool ensure_ascii, bool pretty,
                         int level) {
  size_t n = v->a.n;
  const json_member_t *m = v->b.obj->members;
  if (n == 0) return kiln_strbuf_append(out, "{}", 2);
  unsigned char *seen = NULL;
  for (size_t i = 0; i < n; i++) {
    if (obj_find(v, m[i].key, m[i].key_len) != i) {
      seen = calloc(n, 1);
      if (!seen) {
        out->failed = true;
        return false;
      }
      break;
    }
  }
  bool ok = kiln_strbuf_append_char(out, '{'), any = false;
  for (size_t i = 0; ok && i < n; i++) {
    size_t w = i;
    if (seen) {
      w = obj_find(v, m[i].key, m[i].key_len);
      if (seen[w]) continue;
      seen[w] = 1;
    }
    if (any) ok = kiln_strbuf_append(out, ",", 1) && (pretty || kiln_strbuf_append_char(out, ' '));
    any = true;
    if (ok && pretty) ok = write_indent(out, level + 1);
    ok = ok && kiln_json_write_string(out, m[i].key, m[i].key_len, ensure_ascii) &&
         kiln_strbuf_append(out, ": ", 2) &&
         write_value(out, &m[w].val, ensure_ascii, pretty, level + 1);
  }
  free(seen);
  if (ok && pretty) ok = write_indent(out, level);
  return ok && kiln_strbuf_append_char(out, '}');
}

/* Recursion is bounded: a tree comes from the parser, which caps nesting at
 * KILN_JSON_MAX_DEPTH. */
static bool write_value(kiln_strbuf_t *out, const kiln_json_t *v, bool ensure_ascii, bool pretty,
                        int level) {
  switch (kiln_json_type(v)) {
    case KILN_JSON_NULL: return kiln_strbuf_append(out, "null", 4);
    case KILN_JSON_BOOL:
      return kiln_json_bool(v) ? kiln_strbuf_append(out, "true", 4)
                               : kiln_strbuf_append(out, "false", 5);
    case KILN_JSON_NUMBER:
      return (v->flags & JSON_FLAG_INT) ? write_int64(out, v->a.i)
                                        : kiln_json_write_double(out, v->b.d);
    case KILN_JSON_STRING: return kiln_json_write_string(out, v->b.s, v->a.n, ensure_ascii);
    case KILN_JSON_ARRAY: {
      size_t n = v->a.n;
      if (n == 0) return kiln_strbuf_append(out, "[]", 2);
      bool ok = kiln_strbuf_append_char(out, '[');
      for (size_t i = 0; ok && i < n; i++) {
        if (i)
          ok = kiln_strbuf_append(out, ",", 1) && (pretty || kiln_strbuf_append_char(out, ' '));
        if (ok && pretty) ok = write_indent(out, level + 1);
        ok = ok && write_value(out, &v->b.items[i], ensure_ascii, pretty, level + 1);
      }
      if (ok && pretty) ok = write_indent(out, level);
      return ok && kiln_strbuf_append_char(out, ']');
    }
    case KILN_JSON_OBJECT: return write_object(out, v, ensure_ascii, pretty, level);
  }
  return false;
}

bool kiln_json_write(kiln_strbuf_t *out, const kiln_json_t *v, bool ensure_ascii, bool pretty) {
  return write_value(out, v, ensure_ascii, pretty, 0);
}
