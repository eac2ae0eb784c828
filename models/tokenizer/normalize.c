/* normalize.c - tokenizer.json normalizers: Unicode forms (utf8proc), Lowercase, Replace,
 * Prepend, Strip, StripAccents and Sequence, with HF's semantics. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <utf8proc.h>

#include "models/tokenizer/tok_internal.h"

static const struct {
  const char *name;
  ktok_norm_type_t type;
} norm_types[] = {
    {"NFC", TOK_NORM_NFC},
    {"NFD", TOK_NORM_NFD},
    {"NFKC", TOK_NORM_NFKC},
    {"NFKD", TOK_NORM_NFKD},
    {"Lowercase", TOK_NORM_LOWERCASE},
    {"Replace", TOK_NORM_REPLACE},
    {"Prepend", TOK_NORM_PREPEND},
    {"Strip", TOK_NORM_STRIP},
    {"StripAccents", TOK_NORM_STRIP_ACCENTS},
    {"Sequence", TOK_NORM_SEQUENCE},
};

kiln_status_t ktok_normalizer_parse(kiln_arena_t *a, const kiln_json_t *v, const char *path,
                                    ktok_normalizer_t **out) {
  *out = NULL;
  if (!kiln_json_is(v, KILN_JSON_OBJECT)) {
    return ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "expected an object, not %s",
                    kiln_json_type_name(kiln_json_type(v)));
  }
  const char *type = kiln_json_string(kiln_json_get(v, "type"), NULL);
  if (!type) return ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "type is missing");
  int which = -1;
  for (size_t i = 0; i < sizeof(norm_types) / sizeof(norm_types[0]); i++) {
    if (strcmp(type, norm_types[i].name) == 0) which = (int)i;
  }
  if (which < 0) return ktok_err(KILN_ERR_UNSUPPORTED, path, "type '%s' is not supported", type);
  ktok_normalizer_t *n = calloc(1, sizeof(*n));
  if (!n) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
  n->type = norm_types[which].type;
  kiln_status_t st = NULL;
  char sub[512];
  switch (n->type) {
    case TOK_NORM_NFC:
    case TOK_NORM_NFD:
    case TOK_NORM_NFKC:
    case TOK_NORM_NFKD:
    case TOK_NORM_LOWERCASE:
    case TOK_NORM_STRIP_ACCENTS: {
      static const char *const keys[] = {"type", NULL};
      st = ktok_json_only(v, path, keys);
      break;
    }
    case TOK_NORM_REPLACE: {
      static const char *const keys[] = {"type", "pattern", "content", NULL};
      if ((st = ktok_json_only(v, path, keys))) break;
      snprintf(sub, sizeof(sub), "%s.pattern", path);
      if ((st = ktok_pattern_parse(a, kiln_json_get(v, "pattern"), sub, &n->pattern))) break;
      if ((st = ktok_json_str(a, v, "content", path, &n->content, &n->content_len))) break;
      if (!n->content) st = ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "content is missing");
      break;
    }
    case TOK_NORM_PREPEND: {
      static const char *const keys[] = {"type", "prepend", NULL};
      if ((st = ktok_json_only(v, path, keys))) break;
      if ((st = ktok_json_str(a, v, "prepend", path, &n->content, &n->content_len))) break;
      if (!n->content) st = ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "prepend is missing");
      break;
    }
    case TOK_NORM_STRIP: {
      static const char *const keys[] = {"type", "strip_left", "strip_right", NULL};
      if ((st = ktok_json_only(v, path, keys))) break;
      if ((st = ktok_json_bool(v, "strip_left", true, path, &n->left))) break;
      st = ktok_json_bool(v, "strip_right", true, path, &n->right);
      break;
    }
    case TOK_NORM_SEQUENCE: {
      static const char *const keys[] = {"type", "normalizers", NULL};
      if ((st = ktok_json_only(v, path, keys))) break;
      const kiln_json_t *arr = kiln_json_get(v, "normalizers");
      if (!kiln_json_is(arr, KILN_JSON_ARRAY)) {
        st = ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "normalizers must be an array");
        break;
      }
      size_t cnt = kiln_json_len(arr);
      n->children = calloc(cnt ? cnt : 1, sizeof(*n->children));
      if (!n->children) {
        st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
        break;
      }
      for (size_t i = 0; i < cnt && !st; i++) {
        snprintf(sub, sizeof(sub), "%s.normalizers[%zu]", path, i);
        st = ktok_normalizer_parse(a, kiln_json_at(arr, i), sub, &n->children[i]);
        if (!st) n->n_children++;
      }
      break;
    }
  }
  if (st) {
    ktok_normalizer_free(n);
    return st;
  }
  *out = n;
  return NULL;
}

void ktok_normalizer_free(ktok_normalizer_t *n) {
  if (!n) return;
  for (size_t i = 0; i < n->n_children; i++) ktok_normalizer_free(n->children[i]);
  free(n->children);
  ktok_regex_free(n->pattern.re);
  free(n);
}

/* Normalizes one stretch of text with utf8proc. */
static kiln_status_t norm_map(int opts, const char *s, size_t n, kiln_strbuf_t *out) {
  utf8proc_uint8_t *dst = NULL;
  utf8proc_ssize_t r =
      utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &dst, (utf8proc_option_t)opts);
  if (r < 0) {
    free(dst);
    if (r == UTF8PROC_ERROR_NOMEM) goto oom;
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "normalizer: %s", utf8proc_errmsg(r));
  }
  bool ok = kiln_strbuf_append(out, dst, (size_t)r);
  free(dst);
  if (!ok) goto oom;
  return NULL;
oom:
  return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "normalizer: out of memory");
}

/* Every normal form maps ASCII to itself, an ASCII character is a starter that never
 * composes with what precedes it, and only what follows a starter can combine with it. So
 * only each run of non-ASCII characters, together with the ASCII character just before it,
 * needs utf8proc; the rest is copied. */
static kiln_status_t norm_unicode(ktok_norm_type_t type, const char *s, size_t n,
                                  kiln_strbuf_t *out) {
  int opts = UTF8PROC_STABLE;
  switch (type) {
    case TOK_NORM_NFC: opts |= UTF8PROC_COMPOSE; break;
    case TOK_NORM_NFD: opts |= UTF8PROC_DECOMPOSE; break;
    case TOK_NORM_NFKC: opts |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT; break;
    default: opts |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT; break;
  }
  if (!kiln_strbuf_reserve(out, n)) goto oom;
  size_t copied = 0, i = 0;
  while (i < n) {
    if ((unsigned char)s[i] < 0x80) {
      i++;
      continue;
    }
    size_t rs = i > copied ? i - 1 : i, j = i;
    while (j < n && (unsigned char)s[j] >= 0x80) j++;
    if (!kiln_strbuf_append(out, s + copied, rs - copied)) goto oom;
    kiln_status_t st = norm_map(opts, s + rs, j - rs, out);
    if (st) return st;
    copied = i = j;
  }
  if (!kiln_strbuf_append(out, s + copied, n - copied)) goto oom;
  return NULL;
oom:
  return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "normalizer: out of memory");
}

static kiln_status_t norm_lowercase(const char *s, size_t n, kiln_strbuf_t *out) {
  if (!kiln_strbuf_reserve(out, n)) goto oom;
  for (size_t i = 0; i < n;) {
    unsigned char c = (unsigned char)s[i];
    if (c < 0x80) {
      kiln_strbuf_append_char(out, (char)(c >= 'A' && c <= 'Z' ? c + 32 : c));
      i++;
      continue;
    }
    uint32_t cp;
    int cl = ktok_utf8_decode(s + i, &cp);
    i += (size_t)cl;
    if (cp == 0x130) { /* the one unconditional multi-character lowercase mapping */
      kiln_strbuf_append(out, "i\xcc\x87", 3);
      continue;
    }
    char buf[4];
    uint32_t lc = (uint32_t)utf8proc_tolower((utf8proc_int32_t)cp);
    kiln_strbuf_append(out, buf, (size_t)ktok_utf8_encode(lc, buf));
  }
  if (!kiln_strbuf_ok(out)) goto oom;
  return NULL;
oom:
  return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "normalizer: out of memory");
}

static kiln_status_t norm_one(const ktok_normalizer_t *nz, ktok_match_ctx_t *mc, const char *s,
                              size_t n, kiln_strbuf_t *out) {
  switch (nz->type) {
    case TOK_NORM_NFC:
    case TOK_NORM_NFD:
    case TOK_NORM_NFKC:
    case TOK_NORM_NFKD: return norm_unicode(nz->type, s, n, out);
    case TOK_NORM_LOWERCASE: return norm_lowercase(s, n, out);
    case TOK_NORM_REPLACE:
      return ktok_pattern_replace(&nz->pattern, mc, s, n, nz->content, nz->content_len, out);
    case TOK_NORM_PREPEND:
      if (n) kiln_strbuf_append(out, nz->content, nz->content_len); /* HF: only when non-empty */
      kiln_strbuf_append(out, s, n);
      break;
    case TOK_NORM_STRIP: {
      size_t b = 0, e = n;
      while (nz->left && b < e) {
        uint32_t cp;
        int cl = ktok_utf8_decode(s + b, &cp);
        if (!ktok_is_whitespace(cp)) break;
        b += (size_t)cl;
      }
      while (nz->right && e > b) {
        size_t p = e - 1;
        while (p > b && ((unsigned char)s[p] & 0xC0) == 0x80) p--;
        uint32_t cp;
        ktok_utf8_decode(s + p, &cp);
        if (!ktok_is_whitespace(cp)) break;
        e = p;
      }
      kiln_strbuf_append(out, s + b, e - b);
      break;
    }
    case TOK_NORM_STRIP_ACCENTS:
      for (size_t i = 0; i < n;) {
        uint32_t cp;
        int cl = ktok_utf8_decode(s + i, &cp);
        if (cp < 0x80 || utf8proc_category((utf8proc_int32_t)cp) != UTF8PROC_CATEGORY_MN) {
          kiln_strbuf_append(out, s + i, (size_t)cl);
        }
        i += (size_t)cl;
      }
      break;
    case TOK_NORM_SEQUENCE: return ktok_normalize(nz, mc, s, n, out);
  }
  if (!kiln_strbuf_ok(out))
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "normalizer: out of memory");
  return NULL;
}

kiln_status_t ktok_normalize(const ktok_normalizer_t *nz, ktok_match_ctx_t *mc, const char *s,
                             size_t n, kiln_strbuf_t *out) {
  if (nz->type != TOK_NORM_SEQUENCE) return norm_one(nz, mc, s, n, out);
  if (nz->n_children == 0) {
    if (!kiln_strbuf_append(out, s, n)) {
      return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "normalizer: out of memory");
    }
    return NULL;
  }
  /* Ping-pong between two scratch buffers; the last step writes into out. */
  kiln_strbuf_t bufs[2] = {KILN_STRBUF_INIT, KILN_STRBUF_INIT};
  const char *cur = s;
  size_t cur_n = n;
  kiln_status_t st = NULL;
  for (size_t i = 0; i < nz->n_children && !st; i++) {
    bool last = i + 1 == nz->n_children;
    kiln_strbuf_t *dst = last ? out : &bufs[i & 1];
    if (!last) kiln_strbuf_reset(dst);
    st = norm_one(nz->children[i], mc, cur, cur_n, dst);
    if (!last) {
      cur = dst->data ? dst->data : "";
      cur_n = dst->len;
    }
  }
  kiln_strbuf_free(&bufs[0]);
  kiln_strbuf_free(&bufs[1]);
  return st;
}
