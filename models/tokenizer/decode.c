/* decode.c - tokenizer.json decoders (ByteLevel, Metaspace, ByteFallback, Fuse, Strip,
 * Replace, Sequence) run as HF's decode_chain over the token strings, and
 * kiln_tokenizer_decode(). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/tokenizer/tok_internal.h"

/* ---- parsing --------------------------------------------------------------------------- */

static kiln_status_t parse_prepend(const kiln_json_t *v, const char *path,
                                   ktok_prepend_scheme_t *out) {
  bool aps;
  kiln_status_t st = ktok_json_bool(v, "add_prefix_space", true, path, &aps);
  if (st) return st;
  *out = aps ? TOK_PREPEND_ALWAYS : TOK_PREPEND_NEVER;
  const char *ps = kiln_json_string(kiln_json_get(v, "prepend_scheme"), NULL);
  if (!ps) return NULL;
  if (strcmp(ps, "always") == 0) {
    *out = TOK_PREPEND_ALWAYS;
  } else if (strcmp(ps, "first") == 0) {
    *out = TOK_PREPEND_FIRST;
  } else if (strcmp(ps, "never") == 0) {
    *out = TOK_PREPEND_NEVER;
  } else {
    return ktok_err(KILN_ERR_UNSUPPORTED, path, "prepend_scheme '%s' is not supported", ps);
  }
  return NULL;
}

static kiln_status_t parse_size(const kiln_json_t *v, const char *key, const char *path,
                                size_t *out) {
  int64_t x = 0;
  const kiln_json_t *f = kiln_json_get(v, key);
  if (!f) {
    *out = 0;
    return NULL;
  }
  if (!kiln_json_int64(f, &x) || x < 0) {
    return ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "%s must be a non-negative integer", key);
  }
  *out = (size_t)x;
  return NULL;
}

kiln_status_t ktok_decoder_parse(kiln_arena_t *a, const kiln_json_t *v, const char *path,
                                 ktok_decoder_t **out) {
  *out = NULL;
  if (!kiln_json_is(v, KILN_JSON_OBJECT)) {
    return ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "expected an object, not %s",
                    kiln_json_type_name(kiln_json_type(v)));
  }
  const char *type = kiln_json_string(kiln_json_get(v, "type"), NULL);
  if (!type) return ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "type is missing");
  ktok_decoder_t *d = calloc(1, sizeof(*d));
  if (!d) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
  kiln_status_t st = NULL;
  char sub[512];
  if (strcmp(type, "ByteLevel") == 0) {
    static const char *const keys[] = {"type", "add_prefix_space", "trim_offsets", "use_regex",
                                       NULL};
    d->type = TOK_DEC_BYTELEVEL;
    st = ktok_json_only(v, path, keys);
  } else if (strcmp(type, "Metaspace") == 0) {
    static const char *const keys[] = {
        "type", "replacement", "add_prefix_space", "prepend_scheme", "split", "str_rep", NULL};
    d->type = TOK_DEC_METASPACE;
    if (!(st = ktok_json_only(v, path, keys)) &&
        !(st = ktok_json_char(v, "replacement", 0x2581, path, &d->rep_cp))) {
      st = parse_prepend(v, path, &d->prepend_scheme);
    }
  } else if (strcmp(type, "ByteFallback") == 0) {
    static const char *const keys[] = {"type", NULL};
    d->type = TOK_DEC_BYTEFALLBACK;
    st = ktok_json_only(v, path, keys);
  } else if (strcmp(type, "Fuse") == 0) {
    static const char *const keys[] = {"type", NULL};
    d->type = TOK_DEC_FUSE;
    st = ktok_json_only(v, path, keys);
  } else if (strcmp(type, "Strip") == 0) {
    static const char *const keys[] = {"type", "content", "start", "stop", NULL};
    d->type = TOK_DEC_STRIP;
    if (!(st = ktok_json_only(v, path, keys)) &&
        !(st = ktok_json_char(v, "content", ' ', path, &d->strip_cp)) &&
        !(st = parse_size(v, "start", path, &d->strip_start))) {
      st = parse_size(v, "stop", path, &d->strip_stop);
    }
  } else if (strcmp(type, "Replace") == 0) {
    static const char *const keys[] = {"type", "pattern", "content", NULL};
    d->type = TOK_DEC_REPLACE;
    snprintf(sub, sizeof(sub), "%s.pattern", path);
    if (!(st = ktok_json_only(v, path, keys)) &&
        !(st = ktok_pattern_parse(a, kiln_json_get(v, "pattern"), sub, &d->pattern)) &&
        !(st = ktok_json_str(a, v, "content", path, &d->content, &d->content_len)) && !d->content) {
      st = ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "content is missing");
    }
  } else if (strcmp(type, "Sequence") == 0) {
    static const char *const keys[] = {"type", "decoders", NULL};
    d->type = TOK_DEC_SEQUENCE;
    const kiln_json_t *arr = kiln_json_get(v, "decoders");
    if (!(st = ktok_json_only(v, path, keys))) {
      if (!kiln_json_is(arr, KILN_JSON_ARRAY)) {
        st = ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "decoders must be an array");
      } else {
        size_t cnt = kiln_json_len(arr);
        d->children = calloc(cnt ? cnt : 1, sizeof(*d->children));
        if (!d->children) st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
        for (size_t i = 0; i < cnt && !st; i++) {
          snprintf(sub, sizeof(sub), "%s.decoders[%zu]", path, i);
          st = ktok_decoder_parse(a, kiln_json_at(arr, i), sub, &d->children[i]);
          if (!st) d->n_children++;
        }
      }
    }
  } else {
    st = ktok_err(KILN_ERR_UNSUPPORTED, path, "type '%s' is not supported", type);
  }
  if (st) {
    ktok_decoder_free(d);
    return st;
  }
  *out = d;
  return NULL;
}

void ktok_decoder_free(ktok_decoder_t *d) {
  if (!d) return;
  for (size_t i = 0; i < d->n_children; i++) ktok_decoder_free(d->children[i]);
  free(d->children);
  ktok_regex_free(d->pattern.re);
  free(d);
}

bool ktok_decoder_has_byte_fallback(const ktok_decoder_t *d) {
  if (!d) return false;
  if (d->type == TOK_DEC_BYTEFALLBACK) return true;
  for (size_t i = 0; i < d->n_children; i++) {
    if (ktok_decoder_has_byte_fallback(d->children[i])) return true;
  }
  return false;
}

/* ---- token string lists ---------------------------------------------------------------- */

typedef struct strlist {
  kiln_strbuf_t buf;
  size_t *off, *len;
  size_t n, cap;
} strlist_t;

static bool sl_add(strlist_t *l, const char *s, size_t n) {
  if (l->n == l->cap) {
    size_t cap = l->cap ? l->cap * 2 : 32;
    size_t *o = realloc(l->off, cap * sizeof(*o));
    if (!o) return false;
    l->off = o;
    size_t *ln = realloc(l->len, cap * sizeof(*ln));
    if (!ln) return false;
    l->len = ln;
    l->cap = cap;
  }
  l->off[l->n] = l->buf.len;
  l->len[l->n] = n;
  if (!kiln_strbuf_append(&l->buf, s, n)) return false;
  l->n++;
  return true;
}

/* Starts a new empty token that the caller fills by appending to l->buf. */
static bool sl_begin(strlist_t *l) { return sl_add(l, "", 0); }
static void sl_end(strlist_t *l) { l->len[l->n - 1] = l->buf.len - l->off[l->n - 1]; }

static void sl_reset(strlist_t *l) {
  kiln_strbuf_reset(&l->buf);
  l->n = 0;
}

static void sl_free(strlist_t *l) {
  kiln_strbuf_free(&l->buf);
  free(l->off);
  free(l->len);
  memset(l, 0, sizeof(*l));
}

static const char *sl_str(const strlist_t *l, size_t i) {
  return l->buf.data ? l->buf.data + l->off[i] : "";
}

/* Rust's String::from_utf8_lossy: each maximal invalid subpart becomes one U+FFFD. */
static void utf8_lossy(const unsigned char *s, size_t n, kiln_strbuf_t *out) {
  size_t i = 0;
  while (i < n) {
    unsigned char c = s[i];
    if (c < 0x80) {
      size_t j = i;
      while (j < n && s[j] < 0x80) j++;
      kiln_strbuf_append(out, s + i, j - i);
      i = j;
      continue;
    }
    size_t need = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
      need = 1;
    } else if (c >= 0xE0 && c <= 0xEF) {
      need = 2;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      need = 3;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    }
    size_t k = 0;
    if (need) {
      while (k < need && i + 1 + k < n) {
        unsigned char cc = s[i + 1 + k];
        unsigned char l2 = k == 0 ? lo : 0x80, h2 = k == 0 ? hi : 0xBF;
        if (cc < l2 || cc > h2) break;
        k++;
      }
    }
    if (need && k == need) {
      kiln_strbuf_append(out, s + i, need + 1);
      i += need + 1;
    } else {
      kiln_strbuf_append(out, "\xEF\xBF\xBD", 3);
      i += 1 + k;
    }
  }
}

/* ---- the decoders ---------------------------------------------------------------------- */

static bool byte_token(const char *s, size_t n, unsigned char *out) {
  if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') return false;
  unsigned v = 0;
  for (int i = 3; i < 5; i++) {
    char c = s[i];
    unsigned d;
    if (c >= '0' && c <= '9') {
      d = (unsigned)(c - '0');
    } else if (c >= 'A' && c <= 'F') {
      d = (unsigned)(c - 'A' + 10);
    } else if (c >= 'a' && c <= 'f') {
      d = (unsigned)(c - 'a' + 10);
    } else {
      return false;
    }
    v = v * 16 + d;
  }
  *out = (unsigned char)v;
  return true;
}

static bool flush_bytes(strlist_t *out, kiln_strbuf_t *bytes, size_t count) {
  if (count == 0) return true;
  if (ktok_utf8_valid_prefix(bytes->data, bytes->len) == bytes->len) {
    if (!sl_add(out, bytes->data, bytes->len)) return false;
  } else {
    for (size_t i = 0; i < count; i++) {
      if (!sl_add(out, "\xEF\xBF\xBD", 3)) return false;
    }
  }
  kiln_strbuf_reset(bytes);
  return true;
}

static kiln_status_t dec_one(const ktok_decoder_t *d, ktok_match_ctx_t *mc, const strlist_t *in,
                             strlist_t *out) {
  sl_reset(out);
  switch (d->type) {
    case TOK_DEC_BYTELEVEL: {
      kiln_strbuf_t bytes = KILN_STRBUF_INIT;
      for (size_t i = 0; i < in->n; i++) {
        const char *s = sl_str(in, i);
        size_t n = in->len[i], start = bytes.len;
        bool all = true;
        for (size_t k = 0; k < n;) {
          uint32_t cp;
          int cl = ktok_utf8_decode(s + k, &cp);
          int b = ktok_cp_to_byte(cp);
          if (b < 0) {
            all = false;
            break;
          }
          kiln_strbuf_append_char(&bytes, (char)b);
          k += (size_t)cl;
        }
        if (!all) { /* a character outside the table: the token's own bytes, as HF */
          bytes.len = start;
          kiln_strbuf_append(&bytes, s, n);
        }
      }
      bool ok = sl_begin(out);
      if (ok) {
        utf8_lossy((const unsigned char *)(bytes.data ? bytes.data : ""), bytes.len, &out->buf);
        sl_end(out);
      }
      ok = ok && kiln_strbuf_ok(&bytes);
      kiln_strbuf_free(&bytes);
      if (!ok) goto oom;
      break;
    }
    case TOK_DEC_METASPACE: {
      char rep[4];
      int rl = ktok_utf8_encode(d->rep_cp, rep);
      for (size_t i = 0; i < in->n; i++) {
        const char *s = sl_str(in, i);
        size_t n = in->len[i];
        if (!sl_begin(out)) goto oom;
        bool drop = i == 0 && d->prepend_scheme != TOK_PREPEND_NEVER;
        for (size_t k = 0; k < n;) {
          if (k + (size_t)rl <= n && memcmp(s + k, rep, (size_t)rl) == 0) {
            if (!drop) kiln_strbuf_append_char(&out->buf, ' ');
            k += (size_t)rl;
          } else {
            kiln_strbuf_append_char(&out->buf, s[k]);
            k++;
          }
        }
        sl_end(out);
      }
      break;
    }
    case TOK_DEC_BYTEFALLBACK: {
      kiln_strbuf_t bytes = KILN_STRBUF_INIT;
      size_t count = 0;
      bool ok = true;
      for (size_t i = 0; i < in->n && ok; i++) {
        unsigned char b;
        if (byte_token(sl_str(in, i), in->len[i], &b)) {
          ok = kiln_strbuf_append_char(&bytes, (char)b);
          count++;
          continue;
        }
        ok = flush_bytes(out, &bytes, count) && sl_add(out, sl_str(in, i), in->len[i]);
        count = 0;
      }
      ok = ok && flush_bytes(out, &bytes, count);
      kiln_strbuf_free(&bytes);
      if (!ok) goto oom;
      break;
    }
    case TOK_DEC_FUSE:
      if (!sl_begin(out)) goto oom;
      for (size_t i = 0; i < in->n; i++) kiln_strbuf_append(&out->buf, sl_str(in, i), in->len[i]);
      sl_end(out);
      break;
    case TOK_DEC_STRIP: {
      char c[4];
      size_t cl = (size_t)ktok_utf8_encode(d->strip_cp, c);
      for (size_t i = 0; i < in->n; i++) {
        const char *s = sl_str(in, i);
        size_t b = 0, e = in->len[i];
        for (size_t k = 0; k < d->strip_start && b + cl <= e && memcmp(s + b, c, cl) == 0; k++) {
          b += cl;
        }
        for (size_t k = 0; k < d->strip_stop && e >= b + cl && memcmp(s + e - cl, c, cl) == 0;
             k++) {
          e -= cl;
        }
        if (!sl_add(out, s + b, e - b)) goto oom;
      }
      break;
    }
    case TOK_DEC_REPLACE:
      for (size_t i = 0; i < in->n; i++) {
        if (!sl_begin(out)) goto oom;
        kiln_status_t st = ktok_pattern_replace(&d->pattern, mc, sl_str(in, i), in->len[i],
                                                d->content, d->content_len, &out->buf);
        if (st) return st;
        sl_end(out);
      }
      break;
    case TOK_DEC_SEQUENCE:
      return kiln_status_make(KILN_ERR_INTERNAL, "decoder: nested sequence in dec_one");
  }
  if (!kiln_strbuf_ok(&out->buf)) goto oom;
  return NULL;
oom:
  return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "decoder: out of memory");
}

/* Runs d over *cur, leaving the result in *cur (other is scratch). */
static kiln_status_t dec_chain(const ktok_decoder_t *d, ktok_match_ctx_t *mc, strlist_t *cur,
                               strlist_t *other) {
  if (d->type != TOK_DEC_SEQUENCE) {
    kiln_status_t st = dec_one(d, mc, cur, other);
    if (st) return st;
    strlist_t t = *cur;
    *cur = *other;
    *other = t;
    return NULL;
  }
  for (size_t i = 0; i < d->n_children; i++) {
    kiln_status_t st = dec_chain(d->children[i], mc, cur, other);
    if (st) return st;
  }
  return NULL;
}

const char *ktok_id_to_token(const kiln_tokenizer_t *tok, int32_t id, size_t *out_len) {
  if (id < 0 || (size_t)id >= tok->vocab_size) return NULL;
  int32_t ai = tok->added_by_id[id];
  if (ai >= 0) {
    if (out_len) *out_len = tok->added[ai].len;
    return tok->added[ai].content;
  }
  const ktok_bpe_t *b = tok->bpe;
  if ((size_t)id >= b->n_ids_r || !b->id_to_str[id]) return NULL;
  if (out_len) *out_len = b->id_to_len[id];
  return b->id_to_str[id];
}

kiln_status_t kiln_tokenizer_decode(const kiln_tokenizer_t *tok, const int32_t *ids, size_t n,
                                    bool skip_special_tokens, kiln_strbuf_t *out) {
  strlist_t a = {KILN_STRBUF_INIT, NULL, NULL, 0, 0}, b = a;
  ktok_match_ctx_t mc;
  ktok_match_ctx_init(&mc);
  kiln_status_t st = NULL;
  size_t out_len0 = out->len;
  for (size_t i = 0; i < n; i++) {
    size_t len = 0;
    const char *s = ktok_id_to_token(tok, ids[i], &len);
    if (!s) {
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "token id %d is out of range (vocabulary size %zu)", (int)ids[i],
                            tok->vocab_size);
      goto done;
    }
    if (skip_special_tokens && kiln_tokenizer_is_special(tok, ids[i])) continue;
    if (!sl_add(&a, s, len)) goto oom;
  }
  if (tok->decoder) {
    if ((st = dec_chain(tok->decoder, &mc, &a, &b))) goto done;
    for (size_t i = 0; i < a.n; i++) kiln_strbuf_append(out, sl_str(&a, i), a.len[i]);
  } else {
    for (size_t i = 0; i < a.n; i++) {
      if (i) kiln_strbuf_append_char(out, ' ');
      kiln_strbuf_append(out, sl_str(&a, i), a.len[i]);
    }
  }
  if (!kiln_strbuf_ok(out)) goto oom;
  goto done;
oom:
  st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "decode: out of memory");
done:
  if (st && out->data) {
    out->len = out_len0;
    out->data[out_len0] = '\0';
  }
  sl_free(&a);
  sl_free(&b);
  ktok_match_ctx_free(&mc);
  return st;
}

/* ---- one token's bytes (constrained decoding) ------------------------------------------- */

/* Runs decoder d over one token's string in place (buf), as a token in the middle of a text:
 * no first-token rules, no U+FFFD for partial characters. *fused: a Fuse ran earlier in the
 * chain (a Strip after it only touches the text's ends). */
static kiln_status_t tb_dec(const ktok_decoder_t *d, ktok_match_ctx_t *mc, kiln_strbuf_t *buf,
                            bool *fused) {
  kiln_strbuf_t o = KILN_STRBUF_INIT;
  const char *s = buf->data ? buf->data : "";
  size_t n = buf->len;
  kiln_status_t st = NULL;
  switch (d->type) {
    case TOK_DEC_BYTELEVEL: {
      bool all = true;
      for (size_t k = 0; k < n && all;) {
        uint32_t cp;
        int cl = ktok_utf8_decode(s + k, &cp);
        int b = ktok_cp_to_byte(cp);
        if (b < 0) all = false;
        else kiln_strbuf_append_char(&o, (char)b);
        k += (size_t)cl;
      }
      if (!all) {
        kiln_strbuf_reset(&o);
        kiln_strbuf_append(&o, s, n);
      }
      break;
    }
    case TOK_DEC_METASPACE: {
      char rep[4];
      int rl = ktok_utf8_encode(d->rep_cp, rep);
      for (size_t k = 0; k < n;) {
        if (k + (size_t)rl <= n && memcmp(s + k, rep, (size_t)rl) == 0) {
          kiln_strbuf_append_char(&o, ' ');
          k += (size_t)rl;
        } else {
          kiln_strbuf_append_char(&o, s[k++]);
        }
      }
      break;
    }
    case TOK_DEC_BYTEFALLBACK: {
      unsigned char b;
      if (byte_token(s, n, &b))
        kiln_strbuf_append_char(&o, (char)b);
      else
        kiln_strbuf_append(&o, s, n);
      break;
    }
    case TOK_DEC_FUSE:
      *fused = true;
      return NULL;
    case TOK_DEC_STRIP: {
      if (*fused) return NULL;
      char c[4];
      size_t cl = (size_t)ktok_utf8_encode(d->strip_cp, c);
      size_t b = 0, e = n;
      for (size_t k = 0; k < d->strip_start && b + cl <= e && memcmp(s + b, c, cl) == 0; k++) b += cl;
      for (size_t k = 0; k < d->strip_stop && e >= b + cl && memcmp(s + e - cl, c, cl) == 0; k++)
        e -= cl;
      kiln_strbuf_append(&o, s + b, e - b);
      break;
    }
    case TOK_DEC_REPLACE:
      st = ktok_pattern_replace(&d->pattern, mc, s, n, d->content, d->content_len, &o);
      break;
    case TOK_DEC_SEQUENCE:
      for (size_t i = 0; i < d->n_children && !st; i++) st = tb_dec(d->children[i], mc, buf, fused);
      return st;
  }
  if (!st && !kiln_strbuf_ok(&o)) st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "decoder: out of memory");
  if (!st) {
    kiln_strbuf_reset(buf);
    kiln_strbuf_append(buf, o.data ? o.data : "", o.len);
  }
  kiln_strbuf_free(&o);
  return st;
}

kiln_status_t kiln_tokenizer_token_bytes(const kiln_tokenizer_t *tok, int32_t id,
                                         kiln_strbuf_t *out) {
  size_t len = 0;
  const char *s = ktok_id_to_token(tok, id, &len);
  if (!s)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "token id %d is out of range (vocabulary size %zu)", (int)id,
                            tok->vocab_size);
  kiln_strbuf_t buf = KILN_STRBUF_INIT;
  if (!tok->decoder) kiln_strbuf_append_char(&buf, ' '); /* joined with spaces */
  kiln_strbuf_append(&buf, s, len);
  kiln_status_t st = NULL;
  if (tok->decoder) {
    ktok_match_ctx_t mc;
    ktok_match_ctx_init(&mc);
    bool fused = false;
    st = tb_dec(tok->decoder, &mc, &buf, &fused);
    ktok_match_ctx_free(&mc);
  }
  if (!st) {
    kiln_strbuf_append(out, buf.data ? buf.data : "", buf.len);
    if (!kiln_strbuf_ok(out) || !kiln_strbuf_ok(&buf))
      st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "token bytes: out of memory");
  }
  kiln_strbuf_free(&buf);
  return st;
}

static bool strips_first(const ktok_decoder_t *d, bool *fused) {
  switch (d->type) {
    case TOK_DEC_METASPACE: return d->prepend_scheme != TOK_PREPEND_NEVER;
    case TOK_DEC_FUSE: *fused = true; return false;
    case TOK_DEC_STRIP: return *fused && d->strip_start > 0 && d->strip_cp == ' ';
    case TOK_DEC_SEQUENCE:
      for (size_t i = 0; i < d->n_children; i++)
        if (strips_first(d->children[i], fused)) return true;
      return false;
    default: return false;
  }
}

bool kiln_tokenizer_strips_first_space(const kiln_tokenizer_t *tok) {
  bool fused = false;
  return tok->decoder && strips_first(tok->decoder, &fused);
}
