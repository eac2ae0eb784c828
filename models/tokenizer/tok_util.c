/* ktok_util.c - the tokenizer's plumbing: hash map, UTF-8 and Unicode classes,
 * PCRE2 wrappers, Split/Replace patterns, JSON field helpers and piece lists. */
#define _GNU_SOURCE /* memmem */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <utf8proc.h>

#include "models/tokenizer/tok_internal.h"

/* ---- hashing and the string map -------------------------------------------------------- */

static inline uint64_t ktok_mix(uint64_t h) {
  h ^= h >> 32;
  h *= 0xd6e8feb86659fd93ull;
  h ^= h >> 32;
  return h;
}

uint64_t ktok_hash(const void *data, size_t n) {
  const unsigned char *p = data;
  uint64_t h = 0x9e3779b97f4a7c15ull ^ (n * 0xff51afd7ed558ccdull);
  while (n >= 8) {
    uint64_t w;
    memcpy(&w, p, 8);
    h = (h ^ ktok_mix(w)) * 0x9fb21c651e98df25ull;
    p += 8;
    n -= 8;
  }
  uint64_t w = 0;
  if (n) memcpy(&w, p, n);
  h = (h ^ ktok_mix(w ^ n)) * 0x9fb21c651e98df25ull;
  return ktok_mix(h);
}

bool ktok_map_init(ktok_map_t *m, size_t expected) {
  memset(m, 0, sizeof(*m));
  size_t slots = 16;
  while (slots < expected * 2) slots <<= 1;
  m->slots = calloc(slots, sizeof(*m->slots));
  if (!m->slots) return false;
  m->mask = slots - 1;
  return true;
}

static bool ktok_map_grow(ktok_map_t *m) {
  size_t slots = (m->mask + 1) * 2;
  uint32_t *ns = calloc(slots, sizeof(*ns));
  if (!ns) return false;
  for (size_t i = 0; i < m->n; i++) {
    size_t h = (size_t)ktok_hash(m->keys[i], m->key_lens[i]) & (slots - 1);
    while (ns[h]) h = (h + 1) & (slots - 1);
    ns[h] = (uint32_t)i + 1;
  }
  free(m->slots);
  m->slots = ns;
  m->mask = slots - 1;
  return true;
}

bool ktok_map_put(ktok_map_t *m, const char *key, size_t len, int32_t val, int32_t *out_old) {
  if (out_old) *out_old = -1;
  size_t h = (size_t)ktok_hash(key, len) & m->mask;
  while (m->slots[h]) {
    uint32_t e = m->slots[h] - 1;
    if (m->key_lens[e] == len && memcmp(m->keys[e], key, len) == 0) {
      if (out_old) *out_old = m->vals[e];
      m->vals[e] = val;
      return true;
    }
    h = (h + 1) & m->mask;
  }
  if (m->n == m->cap) {
    size_t cap = m->cap ? m->cap * 2 : 64;
    const char **k = realloc(m->keys, cap * sizeof(*k));
    if (!k) return false;
    m->keys = k;
    uint32_t *kl = realloc(m->key_lens, cap * sizeof(*kl));
    if (!kl) return false;
    m->key_lens = kl;
    int32_t *v = realloc(m->vals, cap * sizeof(*v));
    if (!v) return false;
    m->vals = v;
    m->cap = cap;
  }
  size_t e = m->n++;
  m->keys[e] = key;
  m->key_lens[e] = (uint32_t)len;
  m->vals[e] = val;
  m->slots[h] = (uint32_t)e + 1;
  if (m->n * 2 > m->mask + 1 && !ktok_map_grow(m)) return false;
  return true;
}

int32_t ktok_map_get(const ktok_map_t *m, const char *key, size_t len) {
  if (!m->slots) return -1;
  size_t h = (size_t)ktok_hash(key, len) & m->mask;
  while (m->slots[h]) {
    uint32_t e = m->slots[h] - 1;
    if (m->key_lens[e] == len && memcmp(m->keys[e], key, len) == 0) return m->vals[e];
    h = (h + 1) & m->mask;
  }
  return -1;
}

void ktok_map_free(ktok_map_t *m) {
  free(m->slots);
  free(m->keys);
  free(m->key_lens);
  free(m->vals);
  memset(m, 0, sizeof(*m));
}

/* ---- UTF-8 and character classes ------------------------------------------------------- */

size_t ktok_utf8_valid_prefix(const char *str, size_t n) {
  const unsigned char *s = (const unsigned char *)str;
  size_t i = 0;
  while (i < n) {
    unsigned char c = s[i];
    if (c < 0x80) {
      i++;
      continue;
    }
    size_t need;
    uint32_t cp, min;
    if ((c & 0xE0) == 0xC0) {
      need = 1, cp = c & 0x1F, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      need = 2, cp = c & 0x0F, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      need = 3, cp = c & 0x07, min = 0x10000;
    } else {
      return i;
    }
    if (i + need >= n) return i; /* truncated sequence */
    for (size_t k = 1; k <= need; k++) {
      if ((s[i + k] & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (s[i + k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return i;
    i += need + 1;
  }
  return n;
}

int ktok_utf8_len(unsigned char c) {
  if (c < 0x80) return 1;
  if ((c & 0xE0) == 0xC0) return 2;
  if ((c & 0xF0) == 0xE0) return 3;
  if ((c & 0xF8) == 0xF0) return 4;
  return 1;
}

int ktok_utf8_decode(const char *str, uint32_t *out_cp) {
  const unsigned char *s = (const unsigned char *)str;
  unsigned char c = s[0];
  if (c < 0x80) {
    *out_cp = c;
    return 1;
  }
  if ((c & 0xE0) == 0xC0) {
    *out_cp = ((uint32_t)(c & 0x1F) << 6) | (s[1] & 0x3F);
    return 2;
  }
  if ((c & 0xF0) == 0xE0) {
    *out_cp = ((uint32_t)(c & 0x0F) << 12) | ((uint32_t)(s[1] & 0x3F) << 6) | (s[2] & 0x3F);
    return 3;
  }
  *out_cp = ((uint32_t)(c & 0x07) << 18) | ((uint32_t)(s[1] & 0x3F) << 12) |
            ((uint32_t)(s[2] & 0x3F) << 6) | (s[3] & 0x3F);
  return 4;
}

int ktok_utf8_encode(uint32_t cp, char *buf) {
  if (cp < 0x80) {
    buf[0] = (char)cp;
    return 1;
  }
  if (cp < 0x800) {
    buf[0] = (char)(0xC0 | (cp >> 6));
    buf[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
  }
  if (cp < 0x10000) {
    buf[0] = (char)(0xE0 | (cp >> 12));
    buf[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
    buf[2] = (char)(0x80 | (cp & 0x3F));
    return 3;
  }
  buf[0] = (char)(0xF0 | (cp >> 18));
  buf[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
  buf[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
  buf[3] = (char)(0x80 | (cp & 0x3F));
  return 4;
}

bool ktok_is_whitespace(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

bool ktok_is_word_char(uint32_t cp) {
  if (cp < 0x80) {
    return (cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') ||
           cp == '_';
  }
  if (cp == 0x200C || cp == 0x200D) return true;
  switch (utf8proc_category((utf8proc_int32_t)cp)) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_PC: return true;
    default: return false;
  }
}

bool ktok_is_numeric(uint32_t cp) {
  if (cp < 0x80) return cp >= '0' && cp <= '9';
  utf8proc_category_t c = utf8proc_category((utf8proc_int32_t)cp);
  return c == UTF8PROC_CATEGORY_ND || c == UTF8PROC_CATEGORY_NL || c == UTF8PROC_CATEGORY_NO;
}

bool ktok_is_punctuation(uint32_t cp) {
  if (cp < 0x80) {
    return (cp >= 33 && cp <= 47) || (cp >= 58 && cp <= 64) || (cp >= 91 && cp <= 96) ||
           (cp >= 123 && cp <= 126);
  }
  switch (utf8proc_category((utf8proc_int32_t)cp)) {
    case UTF8PROC_CATEGORY_PC:
    case UTF8PROC_CATEGORY_PD:
    case UTF8PROC_CATEGORY_PS:
    case UTF8PROC_CATEGORY_PE:
    case UTF8PROC_CATEGORY_PI:
    case UTF8PROC_CATEGORY_PF:
    case UTF8PROC_CATEGORY_PO: return true;
    default: return false;
  }
}

/* ---- PCRE2 ----------------------------------------------------------------------------- */

kiln_status_t ktok_regex_compile(const char *pattern, size_t len, ktok_regex_t **out) {
  *out = NULL;
  int errcode = 0;
  PCRE2_SIZE erroff = 0;
  pcre2_code *code =
      pcre2_compile((PCRE2_SPTR)pattern, len, PCRE2_UTF | PCRE2_UCP, &errcode, &erroff, NULL);
  if (!code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(errcode, msg, sizeof(msg));
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "regex /%.*s/: %s at offset %zu",
                            (int)(len > 200 ? 200 : len), pattern, (const char *)msg,
                            (size_t)erroff);
  }
  ktok_regex_t *re = malloc(sizeof(*re));
  if (!re) {
    pcre2_code_free(code);
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "regex: out of memory");
  }
  re->code = code;
  /* JIT is an optimisation: when the platform lacks it, the interpreter gives the same
   * answers. KILN_PCRE2_JIT=0 turns it off: valgrind cannot follow JIT-compiled code and reports
   * its reads as uninitialised (make test-memcheck sets it). */
  const char *jit_env = getenv("KILN_PCRE2_JIT");
  re->jit =
      !(jit_env && strcmp(jit_env, "0") == 0) && pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  *out = re;
  return NULL;
}

void ktok_regex_free(ktok_regex_t *re) {
  if (!re) return;
  pcre2_code_free(re->code);
  free(re);
}

bool ktok_match_ctx_init(ktok_match_ctx_t *mc) {
  memset(mc, 0, sizeof(*mc));
  return true;
}

void ktok_match_ctx_free(ktok_match_ctx_t *mc) {
  if (mc->md) pcre2_match_data_free(mc->md);
  if (mc->mctx) pcre2_match_context_free(mc->mctx);
  if (mc->jit_stack) pcre2_jit_stack_free(mc->jit_stack);
  free(mc->spans);
  kiln_strbuf_free(&mc->tmp);
  kiln_strbuf_free(&mc->tmp2);
  memset(mc, 0, sizeof(*mc));
}

int ktok_regex_find(const ktok_regex_t *re, ktok_match_ctx_t *mc, const char *s, size_t n,
                    size_t start, size_t *ms, size_t *me, kiln_status_t *err) {
  if (!mc->md && !(mc->md = pcre2_match_data_create(1, NULL))) {
    *err = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "regex: out of memory");
    return -1;
  }
  /* The input was validated once by the caller: re-validating on every call would make the
   * match loop quadratic. */
  int rc = pcre2_match(re->code, (PCRE2_SPTR)s, n, start, PCRE2_NO_UTF_CHECK, mc->md, mc->mctx);
  if (rc == PCRE2_ERROR_JIT_STACKLIMIT && !mc->jit_stack) {
    /* The default 32 KiB JIT stack was too small (long runs): give it room and retry. */
    mc->mctx = pcre2_match_context_create(NULL);
    mc->jit_stack = pcre2_jit_stack_create(64 * 1024, 64 * 1024 * 1024, NULL);
    if (mc->mctx && mc->jit_stack) {
      pcre2_jit_stack_assign(mc->mctx, NULL, mc->jit_stack);
      rc = pcre2_match(re->code, (PCRE2_SPTR)s, n, start, PCRE2_NO_UTF_CHECK, mc->md, mc->mctx);
    }
  }
  if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {
    rc = pcre2_match(re->code, (PCRE2_SPTR)s, n, start, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, mc->md,
                     mc->mctx);
  }
  if (rc == PCRE2_ERROR_NOMATCH) return 0;
  if (rc < 0) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(rc, msg, sizeof(msg));
    *err = kiln_status_make(KILN_ERR_INTERNAL, "regex match failed: %s", (const char *)msg);
    return -1;
  }
  PCRE2_SIZE *ov = pcre2_get_ovector_pointer(mc->md);
  *ms = ov[0];
  *me = ov[1];
  if (*me < *ms) *me = *ms; /* \K tricks; not expected in tokenizer patterns */
  return 1;
}

/* ---- patterns -------------------------------------------------------------------------- */

kiln_status_t ktok_pattern_parse(kiln_arena_t *a, const kiln_json_t *v, const char *path,
                                 ktok_pattern_t *out) {
  memset(out, 0, sizeof(*out));
  if (!kiln_json_is(v, KILN_JSON_OBJECT) || kiln_json_len(v) != 1) {
    return ktok_err(KILN_ERR_INVALID_ARGUMENT, path,
                    "expected {\"String\": ...} or {\"Regex\": ...}");
  }
  size_t klen = 0, slen = 0;
  const char *key = kiln_json_key_at(v, 0, &klen);
  const char *s = kiln_json_string(kiln_json_value_at(v, 0), &slen);
  if (!s) return ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "pattern is not a string");
  if (klen == 6 && memcmp(key, "String", 6) == 0) {
    if (slen == 0)
      return ktok_err(KILN_ERR_UNSUPPORTED, path, "an empty String pattern is not supported");
    out->str = kiln_arena_strndup(a, s, slen);
    out->len = slen;
    if (!out->str) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
    return NULL;
  }
  if (klen == 5 && memcmp(key, "Regex", 5) == 0) {
    kiln_status_t st = ktok_regex_compile(s, slen, &out->re);
    return st ? kiln_status_annotate(st, "%s", path) : NULL;
  }
  return ktok_err(KILN_ERR_UNSUPPORTED, path, "pattern kind '%.*s' is not supported", (int)klen,
                  key);
}

int ktok_pattern_find(const ktok_pattern_t *p, ktok_match_ctx_t *mc, const char *s, size_t n,
                      size_t start, size_t *ms, size_t *me, kiln_status_t *err) {
  if (p->re) return ktok_regex_find(p->re, mc, s, n, start, ms, me, err);
  if (start >= n || p->len == 0) return 0;
  const char *hit = memmem(s + start, n - start, p->str, p->len);
  if (!hit) return 0;
  *ms = (size_t)(hit - s);
  *me = *ms + p->len;
  return 1;
}

kiln_status_t ktok_pattern_replace(const ktok_pattern_t *p, ktok_match_ctx_t *mc, const char *s,
                                   size_t n, const char *content, size_t clen, kiln_strbuf_t *out) {
  size_t pos = 0, copied = 0;
  bool have_last = false;
  size_t last_end = 0;
  kiln_status_t err = NULL;
  while (pos <= n) {
    size_t ms, me;
    int r = ktok_pattern_find(p, mc, s, n, pos, &ms, &me, &err);
    if (r < 0) return err;
    if (r == 0) break;
    if (me == ms) {
      /* Empty match: not right after the previous match, and always make progress. */
      if (!(have_last && ms == last_end)) {
        kiln_strbuf_append(out, s + copied, ms - copied);
        kiln_strbuf_append(out, content, clen);
        copied = ms;
      }
      if (ms >= n) break;
      pos = ms + (size_t)ktok_utf8_len((unsigned char)s[ms]);
      continue;
    }
    kiln_strbuf_append(out, s + copied, ms - copied);
    kiln_strbuf_append(out, content, clen);
    copied = me;
    pos = me;
    have_last = true;
    last_end = me;
  }
  kiln_strbuf_append(out, s + copied, n - copied);
  if (!kiln_strbuf_ok(out)) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  return NULL;
}

/* ---- JSON helpers ---------------------------------------------------------------------- */

kiln_status_t ktok_err(kiln_status_code_t code, const char *path, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  return kiln_status_make(code, "%s: %s", path, msg);
}

kiln_status_t ktok_json_bool(const kiln_json_t *obj, const char *key, bool def, const char *path,
                             bool *out) {
  const kiln_json_t *v = kiln_json_get(obj, key);
  if (!v || kiln_json_is(v, KILN_JSON_NULL)) {
    *out = def;
    return NULL;
  }
  if (!kiln_json_is(v, KILN_JSON_BOOL)) {
    return ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "%s must be a bool, not %s", key,
                    kiln_json_type_name(kiln_json_type(v)));
  }
  *out = kiln_json_bool(v);
  return NULL;
}

kiln_status_t ktok_json_str(kiln_arena_t *a, const kiln_json_t *obj, const char *key,
                            const char *path, char **out, size_t *out_len) {
  *out = NULL;
  if (out_len) *out_len = 0;
  const kiln_json_t *v = kiln_json_get(obj, key);
  if (!v || kiln_json_is(v, KILN_JSON_NULL)) return NULL;
  size_t n = 0;
  const char *s = kiln_json_string(v, &n);
  if (!s) {
    return ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "%s must be a string, not %s", key,
                    kiln_json_type_name(kiln_json_type(v)));
  }
  *out = kiln_arena_strndup(a, s, n);
  if (!*out) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  if (out_len) *out_len = n;
  return NULL;
}

kiln_status_t ktok_json_char(const kiln_json_t *obj, const char *key, uint32_t def,
                             const char *path, uint32_t *out) {
  *out = def;
  const kiln_json_t *v = kiln_json_get(obj, key);
  if (!v || kiln_json_is(v, KILN_JSON_NULL)) return NULL;
  size_t n = 0;
  const char *s = kiln_json_string(v, &n);
  if (!s || n == 0 || (size_t)ktok_utf8_len((unsigned char)s[0]) != n) {
    return ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "%s must be a one-character string", key);
  }
  ktok_utf8_decode(s, out);
  return NULL;
}

kiln_status_t ktok_json_only(const kiln_json_t *obj, const char *path, const char *const *keys) {
  size_t n = kiln_json_len(obj);
  for (size_t i = 0; i < n; i++) {
    size_t klen = 0;
    const char *k = kiln_json_key_at(obj, i, &klen);
    bool known = false;
    for (const char *const *p = keys; *p; p++) {
      if (strlen(*p) == klen && memcmp(*p, k, klen) == 0) {
        known = true;
        break;
      }
    }
    if (!known) {
      return ktok_err(KILN_ERR_UNSUPPORTED, path, "field '%.*s' is not supported", (int)klen, k);
    }
  }
  return NULL;
}

/* ---- pieces ---------------------------------------------------------------------------- */

bool ktok_pieces_add(ktok_pieces_t *p, const char *s, size_t n, bool at_start) {
  if (n == 0) return true;
  if (p->n == p->cap) {
    size_t cap = p->cap ? p->cap * 2 : 64;
    ktok_piece_t *v = realloc(p->v, cap * sizeof(*v));
    if (!v) return false;
    p->v = v;
    p->cap = cap;
  }
  size_t off = p->text.len;
  if (!kiln_strbuf_append(&p->text, s, n)) return false;
  p->v[p->n++] = (ktok_piece_t){off, n, at_start};
  return true;
}

void ktok_pieces_reset(ktok_pieces_t *p) {
  kiln_strbuf_reset(&p->text);
  p->n = 0;
}

void ktok_pieces_free(ktok_pieces_t *p) {
  kiln_strbuf_free(&p->text);
  free(p->v);
  memset(p, 0, sizeof(*p));
}
