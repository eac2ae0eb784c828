/* jinja_methods.c - the Python methods templates call on values: str (startswith, strip,
 * split, replace, ...), dict (items, keys, values, get), list (index, count) and loop.cycle().
 * Methods that would mutate a list or dict are refused with the sandbox's own message, because
 * transformers renders in Jinja's ImmutableSandboxedEnvironment. */
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "models/template/template_internal.h"

static const char *const k_str_methods[] = {
    "startswith", "endswith", "strip", "lstrip",     "rstrip",  "split",   "rsplit",  "splitlines",
    "lower",      "upper",    "title", "capitalize", "replace", "find",    "rfind",   "index",
    "rindex",     "count",    "join",  "isdigit",    "isalpha", "isalnum", "isspace", "islower",
    "isupper",    "format",   "zfill", "casefold",   NULL};
static const char *const k_dict_methods[] = {"items", "keys", "values", "get", "copy", NULL};
static const char *const k_list_methods[] = {"index", "count", "copy", NULL};
static const char *const k_list_mutators[] = {"append",  "extend", "insert", "pop", "remove",
                                              "reverse", "sort",   "clear",  NULL};
static const char *const k_dict_mutators[] = {"update",     "pop",   "popitem",
                                              "setdefault", "clear", NULL};

static bool in_list(const char *const *l, const char *name) {
  for (int i = 0; l[i]; i++)
    if (!strcmp(l[i], name)) return true;
  return false;
}

bool tpl_has_method(const tv_t *obj, const char *name) {
  switch (obj->kind) {
    case TV_STR: return in_list(k_str_methods, name);
    case TV_DICT: return in_list(k_dict_methods, name) || in_list(k_dict_mutators, name);
    case TV_LIST: return in_list(k_list_methods, name) || in_list(k_list_mutators, name);
    case TV_LOOP: return !strcmp(name, "cycle");
    default: return false;
  }
}

/* ---- string helpers ------------------------------------------------------------------------- */

static bool finish(tctx_t *ctx, kiln_strbuf_t *b, tv_t *out) {
  bool ok = kiln_strbuf_ok(b) || tpl_oom(ctx);
  if (ok) {
    *out = tv_from_buf(ctx, b);
    ok = out->kind == TV_STR;
  }
  kiln_strbuf_free(b);
  return ok;
}

static bool cp_cased(uint32_t cp) {
  if (cp < 0x80) return (cp | 32) >= 'a' && (cp | 32) <= 'z';
  utf8proc_category_t c = utf8proc_category((utf8proc_int32_t)cp);
  return c == UTF8PROC_CATEGORY_LU || c == UTF8PROC_CATEGORY_LL || c == UTF8PROC_CATEGORY_LT;
}

static uint32_t cp_upper(uint32_t cp) {
  if (cp < 0x80) return (cp >= 'a' && cp <= 'z') ? cp - 32 : cp;
  return (uint32_t)utf8proc_toupper((utf8proc_int32_t)cp);
}
static uint32_t cp_lower(uint32_t cp) {
  if (cp < 0x80) return (cp >= 'A' && cp <= 'Z') ? cp + 32 : cp;
  return (uint32_t)utf8proc_tolower((utf8proc_int32_t)cp);
}
static uint32_t cp_title(uint32_t cp) {
  if (cp < 0x80) return cp_upper(cp);
  return (uint32_t)utf8proc_totitle((utf8proc_int32_t)cp);
}

bool tpl_str_case(tctx_t *ctx, const tv_t *s, int mode, tv_t *out) {
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  const char *p = s->u.str.s;
  size_t n = s->u.str.n, pos = 0;
  bool prev_cased = false, first = true, word_start = true;
  if (!kiln_strbuf_reserve(&b, n + 1)) return tpl_oom(ctx);
  while (pos < n) {
    size_t next;
    uint32_t cp = utf8_decode_at(p, n, pos, &next), r = cp;
    switch (mode) {
      case 'u': r = cp_upper(cp); break;
      case 'l': r = cp_lower(cp); break;
      case 'c': r = first ? cp_title(cp) : cp_lower(cp); break;
      case 't':
        r = cp_cased(cp) ? (prev_cased ? cp_lower(cp) : cp_title(cp)) : cp;
        prev_cased = cp_cased(cp);
        break;
      case 'j': {
        /* Jinja's title filter: split at runs of [-\s({[<]; each piece: first upper, rest lower */
        bool sep =
            cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<' || tpl_is_space_cp(cp);
        if (sep) {
          word_start = true;
          r = cp;
        } else {
          r = word_start ? cp_upper(cp) : cp_lower(cp);
          word_start = false;
        }
        break;
      }
    }
    first = false;
    if (r == cp)
      kiln_strbuf_append(&b, p + pos, next - pos);
    else
      kiln_strbuf_append_utf8(&b, r);
    pos = next;
  }
  return finish(ctx, &b, out);
}

/* Whether cp is in the strip set (NULL = whitespace). */
static bool in_set(uint32_t cp, const tv_t *chars) {
  if (!chars || chars->kind != TV_STR) return tpl_is_space_cp(cp);
  size_t pos = 0, n = chars->u.str.n;
  while (pos < n) {
    size_t next;
    if (utf8_decode_at(chars->u.str.s, n, pos, &next) == cp) return true;
    pos = next;
  }
  return false;
}

bool tpl_str_strip(tctx_t *ctx, const tv_t *s, const tv_t *chars, int which, tv_t *out) {
  if (chars && chars->kind != TV_STR && chars->kind != TV_NONE)
    return tpl_fail(ctx, "strip arg must be None or str, not %s", tv_type_name(chars));
  const char *p = s->u.str.s;
  size_t n = s->u.str.n, b = 0, e = n;
  if (which != 'r')
    while (b < e) {
      size_t next;
      if (!in_set(utf8_decode_at(p, n, b, &next), chars)) break;
      b = next;
    }
  if (which != 'l')
    while (e > b) {
      size_t start = e - 1, next;
      while (start > b && ((unsigned char)p[start] & 0xC0) == 0x80) start--;
      if (!in_set(utf8_decode_at(p, n, start, &next), chars)) break;
      e = start;
    }
  *out = tv_str(p + b, e - b);
  return true;
}

static const char *find_bytes(const char *h, size_t hn, const char *nd, size_t nn) {
  if (nn == 0) return h;
  if (nn > hn) return NULL;
  for (size_t i = 0; i <= hn - nn; i++) {
    const char *q = memchr(h + i, nd[0], hn - nn - i + 1);
    if (!q) return NULL;
    i = (size_t)(q - h);
    if (memcmp(q, nd, nn) == 0) return q;
  }
  return NULL;
}

static const char *rfind_bytes(const char *h, size_t hn, const char *nd, size_t nn) {
  if (nn > hn) return NULL;
  for (size_t i = hn - nn + 1; i-- > 0;)
    if (memcmp(h + i, nd, nn) == 0) return h + i;
  return NULL;
}

bool tpl_str_replace(tctx_t *ctx, const tv_t *s, const tv_t *old, const tv_t *new_, int64_t count,
                     tv_t *out) {
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  const char *p = s->u.str.s, *end = p + s->u.str.n;
  size_t on = old->u.str.n;
  if (on == 0) {
    /* Python inserts new before every code point and at the end */
    size_t pos = 0, n = s->u.str.n;
    int64_t done = 0;
    while (count < 0 || done < count) {
      kiln_strbuf_append(&b, new_->u.str.s, new_->u.str.n);
      done++;
      if (pos >= n) break;
      size_t nx = utf8_next(p, n, pos);
      kiln_strbuf_append(&b, p + pos, nx - pos);
      pos = nx;
      if (b.len > ctx->lim.max_output) break;
    }
    kiln_strbuf_append(&b, p + pos, n - pos);
    return finish(ctx, &b, out);
  }
  int64_t done = 0;
  while (p < end && (count < 0 || done < count)) {
    const char *q = find_bytes(p, (size_t)(end - p), old->u.str.s, on);
    if (!q) break;
    kiln_strbuf_append(&b, p, (size_t)(q - p));
    kiln_strbuf_append(&b, new_->u.str.s, new_->u.str.n);
    p = q + on;
    done++;
    if (b.len > ctx->lim.max_output) return tpl_fail(ctx, "replace: result too large");
  }
  kiln_strbuf_append(&b, p, (size_t)(end - p));
  return finish(ctx, &b, out);
}

/* ---- argument helpers ----------------------------------------------------------------------- */

typedef struct margs {
  const tv_t *pos;
  size_t npos;
  const char *const *kwn;
  const tv_t *kwv;
  size_t nkw;
} margs_t;

static bool marg(const margs_t *a, size_t i, const char *name, tv_t *out) {
  if (i < a->npos) {
    *out = a->pos[i];
    return true;
  }
  for (size_t k = 0; k < a->nkw; k++)
    if (!strcmp(a->kwn[k], name)) {
      *out = a->kwv[k];
      return true;
    }
  return false;
}

static bool need_str_arg(tctx_t *ctx, const margs_t *a, size_t i, const char *meth, tv_t *out) {
  if (!marg(a, i, "", out)) return tpl_fail(ctx, "%s() is missing an argument", meth);
  if (out->kind != TV_STR)
    return tpl_fail(ctx, "%s() argument must be str, not %s", meth, tv_type_name(out));
  return true;
}

static bool int_marg(tctx_t *ctx, const margs_t *a, size_t i, const char *name, int64_t def,
                     int64_t *out) {
  tv_t v;
  *out = def;
  if (!marg(a, i, name, &v) || v.kind == TV_NONE) return true;
  if (v.kind == TV_INT)
    *out = v.u.i;
  else if (v.kind == TV_BOOL)
    *out = v.u.b;
  else
    return tpl_fail(ctx, "'%s' object cannot be interpreted as an integer", tv_type_name(&v));
  return true;
}

static bool push(tctx_t *ctx, tv_t **items, size_t *n, size_t *cap, tv_t v) {
  if (*n == *cap) {
    size_t c = *cap ? *cap * 2 : 8;
    tv_t *t = tpl_alloc(ctx, c * sizeof *t);
    if (!t) return false;
    if (*n) memcpy(t, *items, *n * sizeof *t);
    *items = t;
    *cap = c;
  }
  (*items)[(*n)++] = v;
  return true;
}

static bool mk_list(tctx_t *ctx, tv_t *items, size_t n, tv_t *out) {
  tv_t r = tv_new_list(ctx, n);
  if (r.kind != TV_LIST) return false;
  if (n) memcpy(r.u.list->items, items, n * sizeof *items);
  *out = r;
  return true;
}

/* str.split / str.rsplit */
static bool str_split(tctx_t *ctx, const tv_t *s, const margs_t *a, bool right, tv_t *out) {
  tv_t sep = tv_none();
  int64_t maxsplit;
  marg(a, 0, "sep", &sep);
  if (!int_marg(ctx, a, 1, "maxsplit", -1, &maxsplit)) return false;
  if (sep.kind != TV_NONE && sep.kind != TV_STR)
    return tpl_fail(ctx, "must be str or None, not %s", tv_type_name(&sep));
  if (sep.kind == TV_STR && sep.u.str.n == 0) return tpl_fail(ctx, "empty separator");
  const char *p = s->u.str.s;
  size_t n = s->u.str.n;
  tv_t *items = NULL;
  size_t cnt = 0, cap = 0;
  int64_t splits = 0;
  if (sep.kind == TV_STR) {
    const char *sp = sep.u.str.s;
    size_t sn = sep.u.str.n;
    if (!right) {
      const char *cur = p, *end = p + n;
      for (;;) {
        const char *q = (maxsplit < 0 || splits < maxsplit)
                            ? find_bytes(cur, (size_t)(end - cur), sp, sn)
                            : NULL;
        if (!q) {
          if (!push(ctx, &items, &cnt, &cap, tv_str(cur, (size_t)(end - cur)))) return false;
          break;
        }
        if (!push(ctx, &items, &cnt, &cap, tv_str(cur, (size_t)(q - cur)))) return false;
        cur = q + sn;
        splits++;
      }
    } else {
      const char *end = p + n;
      for (;;) {
        const char *q =
            (maxsplit < 0 || splits < maxsplit) ? rfind_bytes(p, (size_t)(end - p), sp, sn) : NULL;
        if (!q) {
          if (!push(ctx, &items, &cnt, &cap, tv_str(p, (size_t)(end - p)))) return false;
          break;
        }
        if (!push(ctx, &items, &cnt, &cap, tv_str(q + sn, (size_t)(end - q - sn)))) return false;
        end = q;
        splits++;
      }
      for (size_t i = 0; i < cnt / 2; i++) {
        tv_t t = items[i];
        items[i] = items[cnt - 1 - i];
        items[cnt - 1 - i] = t;
      }
    }
    return mk_list(ctx, items, cnt, out);
  }
  /* whitespace split: runs of whitespace separate, ends ignored */
  if (!right) {
    size_t pos = 0;
    for (;;) {
      size_t next;
      while (pos < n && tpl_is_space_cp(utf8_decode_at(p, n, pos, &next))) pos = next;
      if (pos >= n) break;
      if (maxsplit >= 0 && splits >= maxsplit) {
        if (!push(ctx, &items, &cnt, &cap, tv_str(p + pos, n - pos))) return false;
        break;
      }
      size_t b = pos;
      while (pos < n && !tpl_is_space_cp(utf8_decode_at(p, n, pos, &next))) pos = next;
      if (!push(ctx, &items, &cnt, &cap, tv_str(p + b, pos - b))) return false;
      splits++;
    }
  } else {
    size_t e = n;
    for (;;) {
      while (e > 0) {
        size_t st = e - 1, nx;
        while (st > 0 && ((unsigned char)p[st] & 0xC0) == 0x80) st--;
        if (!tpl_is_space_cp(utf8_decode_at(p, n, st, &nx))) break;
        e = st;
      }
      if (e == 0) break;
      if (maxsplit >= 0 && splits >= maxsplit) {
        if (!push(ctx, &items, &cnt, &cap, tv_str(p, e))) return false;
        break;
      }
      size_t b = e;
      while (b > 0) {
        size_t st = b - 1, nx;
        while (st > 0 && ((unsigned char)p[st] & 0xC0) == 0x80) st--;
        if (tpl_is_space_cp(utf8_decode_at(p, n, st, &nx))) break;
        b = st;
      }
      if (!push(ctx, &items, &cnt, &cap, tv_str(p + b, e - b))) return false;
      e = b;
      splits++;
    }
    for (size_t i = 0; i < cnt / 2; i++) {
      tv_t t = items[i];
      items[i] = items[cnt - 1 - i];
      items[cnt - 1 - i] = t;
    }
  }
  return mk_list(ctx, items, cnt, out);
}

static bool affix(tctx_t *ctx, const tv_t *s, const margs_t *a, bool start, tv_t *out) {
  tv_t x;
  if (!marg(a, 0, "prefix", &x))
    return tpl_fail(ctx, "%s() takes at least 1 argument", start ? "startswith" : "endswith");
  tv_t *cands = &x;
  size_t nc = 1;
  if (x.kind == TV_LIST && (x.flags & TV_F_TUPLE)) {
    if (!tv_iterate(ctx, &x, &cands, &nc)) return false;
  }
  bool r = false;
  for (size_t i = 0; i < nc && !r; i++) {
    if (cands[i].kind != TV_STR)
      return tpl_fail(ctx, "%s first arg must be str or a tuple of str, not %s",
                      start ? "startswith" : "endswith", tv_type_name(&cands[i]));
    size_t k = cands[i].u.str.n;
    if (k <= s->u.str.n)
      r = memcmp(start ? s->u.str.s : s->u.str.s + s->u.str.n - k, cands[i].u.str.s, k) == 0;
  }
  *out = tv_bool(r);
  return true;
}

static bool str_method(tctx_t *ctx, const tv_t *s, const char *m, const margs_t *a, tv_t *out) {
  tv_t x, y;
  const char *p = s->u.str.s;
  size_t n = s->u.str.n;
  if (!strcmp(m, "startswith")) return affix(ctx, s, a, true, out);
  if (!strcmp(m, "endswith")) return affix(ctx, s, a, false, out);
  if (!strcmp(m, "strip") || !strcmp(m, "lstrip") || !strcmp(m, "rstrip")) {
    tv_t chars = tv_none();
    marg(a, 0, "chars", &chars);
    return tpl_str_strip(ctx, s, &chars, m[0] == 's' ? 'b' : m[0], out);
  }
  if (!strcmp(m, "split")) return str_split(ctx, s, a, false, out);
  if (!strcmp(m, "rsplit")) return str_split(ctx, s, a, true, out);
  if (!strcmp(m, "splitlines")) {
    tv_t *items = NULL;
    size_t cnt = 0, cap = 0, b = 0, i = 0;
    bool keep = false;
    if (marg(a, 0, "keepends", &x)) keep = tv_truthy(&x);
    while (i < n) {
      if (p[i] == '\n' || p[i] == '\r') {
        size_t e = i;
        if (p[i] == '\r' && i + 1 < n && p[i + 1] == '\n') i++;
        i++;
        if (!push(ctx, &items, &cnt, &cap, tv_str(p + b, (keep ? i : e) - b))) return false;
        b = i;
      } else {
        i++;
      }
    }
    if (b < n && !push(ctx, &items, &cnt, &cap, tv_str(p + b, n - b))) return false;
    return mk_list(ctx, items, cnt, out);
  }
  if (!strcmp(m, "lower") || !strcmp(m, "casefold")) return tpl_str_case(ctx, s, 'l', out);
  if (!strcmp(m, "upper")) return tpl_str_case(ctx, s, 'u', out);
  if (!strcmp(m, "title")) return tpl_str_case(ctx, s, 't', out);
  if (!strcmp(m, "capitalize")) return tpl_str_case(ctx, s, 'c', out);
  if (!strcmp(m, "replace")) {
    int64_t count;
    if (!need_str_arg(ctx, a, 0, m, &x) || !need_str_arg(ctx, a, 1, m, &y)) return false;
    if (!int_marg(ctx, a, 2, "count", -1, &count)) return false;
    return tpl_str_replace(ctx, s, &x, &y, count, out);
  }
  if (!strcmp(m, "find") || !strcmp(m, "rfind") || !strcmp(m, "index") || !strcmp(m, "rindex")) {
    if (!need_str_arg(ctx, a, 0, m, &x)) return false;
    bool r = m[0] == 'r';
    const char *q =
        r ? rfind_bytes(p, n, x.u.str.s, x.u.str.n) : find_bytes(p, n, x.u.str.s, x.u.str.n);
    if (!q && (m[r] == 'i')) return tpl_fail(ctx, "substring not found");
    *out = tv_int(q ? (int64_t)utf8_count(p, (size_t)(q - p)) : -1);
    return true;
  }
  if (!strcmp(m, "count")) {
    if (!need_str_arg(ctx, a, 0, m, &x)) return false;
    if (x.u.str.n == 0) {
      *out = tv_int((int64_t)utf8_count(p, n) + 1);
      return true;
    }
    int64_t c = 0;
    const char *cur = p, *end = p + n, *q;
    while ((q = find_bytes(cur, (size_t)(end - cur), x.u.str.s, x.u.str.n))) {
      c++;
      cur = q + x.u.str.n;
    }
    *out = tv_int(c);
    return true;
  }
  if (!strcmp(m, "join")) {
    tv_t *items;
    size_t cnt;
    if (!marg(a, 0, "iterable", &x)) return tpl_fail(ctx, "join() takes exactly one argument");
    if (!tv_iterate(ctx, &x, &items, &cnt)) return false;
    kiln_strbuf_t b = KILN_STRBUF_INIT;
    for (size_t i = 0; i < cnt; i++) {
      if (items[i].kind != TV_STR) {
        kiln_strbuf_free(&b);
        return tpl_fail(ctx, "sequence item %zu: expected str instance, %s found", i,
                        tv_type_name(&items[i]));
      }
      if (i) kiln_strbuf_append(&b, p, n);
      kiln_strbuf_append(&b, items[i].u.str.s, items[i].u.str.n);
    }
    return finish(ctx, &b, out);
  }
  if (!strncmp(m, "is", 2)) {
    bool r = n > 0, any_cased = false;
    size_t pos = 0;
    while (pos < n) {
      size_t next;
      uint32_t cp = utf8_decode_at(p, n, pos, &next);
      utf8proc_category_t c = utf8proc_category((utf8proc_int32_t)cp);
      bool alpha = c == UTF8PROC_CATEGORY_LU || c == UTF8PROC_CATEGORY_LL ||
                   c == UTF8PROC_CATEGORY_LT || c == UTF8PROC_CATEGORY_LM ||
                   c == UTF8PROC_CATEGORY_LO;
      bool digit = c == UTF8PROC_CATEGORY_ND;
      if (!strcmp(m, "isdigit") && !digit) r = false;
      if (!strcmp(m, "isalpha") && !alpha) r = false;
      if (!strcmp(m, "isalnum") && !alpha && !digit && c != UTF8PROC_CATEGORY_NL &&
          c != UTF8PROC_CATEGORY_NO)
        r = false;
      if (!strcmp(m, "isspace") && !tpl_is_space_cp(cp)) r = false;
      if (!strcmp(m, "islower") && (c == UTF8PROC_CATEGORY_LU || c == UTF8PROC_CATEGORY_LT))
        r = false;
      if (!strcmp(m, "isupper") && (c == UTF8PROC_CATEGORY_LL || c == UTF8PROC_CATEGORY_LT))
        r = false;
      if (cp_cased(cp)) any_cased = true;
      pos = next;
    }
    if (!strcmp(m, "islower") || !strcmp(m, "isupper")) r = r && any_cased;
    *out = tv_bool(r);
    return true;
  }
  if (!strcmp(m, "zfill")) {
    int64_t w;
    if (!int_marg(ctx, a, 0, "width", 0, &w)) return false;
    int64_t len = (int64_t)utf8_count(p, n);
    if (w <= len) {
      *out = *s;
      return true;
    }
    if (w > (1 << 20)) return tpl_fail(ctx, "zfill: width too large");
    kiln_strbuf_t b = KILN_STRBUF_INIT;
    size_t k = 0;
    if (n && (p[0] == '-' || p[0] == '+')) kiln_strbuf_append_char(&b, p[k++]);
    for (int64_t i = 0; i < w - len; i++) kiln_strbuf_append_char(&b, '0');
    kiln_strbuf_append(&b, p + k, n - k);
    return finish(ctx, &b, out);
  }
  if (!strcmp(m, "format")) return tpl_fail(ctx, "str.format() is not supported; use ~ or filters");
  return tpl_fail(ctx, "'str' object has no attribute '%s'", m);
}

bool tpl_call_method(tctx_t *ctx, const tv_t *obj, const char *name, const tv_t *args, size_t nargs,
                     const char *const *kwnames, const tv_t *kwvals, size_t nkw, tv_t *out) {
  margs_t a = {args, nargs, kwnames, kwvals, nkw};
  tv_t x;
  switch (obj->kind) {
    case TV_STR: return str_method(ctx, obj, name, &a, out);
    case TV_DICT: {
      if (in_list(k_dict_mutators, name))
        return tpl_fail(ctx, "access to attribute '%s' of 'dict' object is unsafe.", name);
      size_t n = tv_len(obj);
      if (!strcmp(name, "get")) {
        if (!marg(&a, 0, "key", &x))
          return tpl_fail(ctx, "get expected at least 1 argument, got 0");
        if (!tv_dict_get(ctx, obj, &x, out)) {
          *out = tv_none();
          marg(&a, 1, "default", out);
        }
        return true;
      }
      if (!strcmp(name, "copy")) {
        *out = *obj;
        return true;
      }
      tv_t r = tv_new_list(ctx, n);
      if (r.kind != TV_LIST) return false;
      for (size_t i = 0; i < n; i++) {
        tv_t k, v;
        tv_dict_at(ctx, obj, i, &k, &v);
        if (!strcmp(name, "keys")) {
          r.u.list->items[i] = k;
        } else if (!strcmp(name, "values")) {
          r.u.list->items[i] = v;
        } else {
          tv_t pair = tv_new_list(ctx, 2);
          if (pair.kind != TV_LIST) return false;
          pair.flags = TV_F_TUPLE;
          pair.u.list->items[0] = k;
          pair.u.list->items[1] = v;
          r.u.list->items[i] = pair;
        }
      }
      *out = r;
      return true;
    }
    case TV_LIST: {
      if (in_list(k_list_mutators, name))
        return tpl_fail(ctx, "access to attribute '%s' of '%s' object is unsafe.", name,
                        tv_type_name(obj));
      if (!strcmp(name, "copy")) {
        *out = *obj;
        return true;
      }
      if (!marg(&a, 0, "value", &x)) return tpl_fail(ctx, "%s() takes exactly one argument", name);
      int64_t c = 0;
      for (size_t i = 0; i < obj->u.list->n; i++) {
        tv_t e = tv_list_get(ctx, obj, i);
        if (tv_eq(&e, &x)) {
          if (!strcmp(name, "index")) {
            *out = tv_int((int64_t)i);
            return true;
          }
          c++;
        }
      }
      if (!strcmp(name, "index")) return tpl_fail(ctx, "list.index(x): x not in list");
      *out = tv_int(c);
      return true;
    }
    case TV_LOOP: {
      if (nargs == 0) return tpl_fail(ctx, "no items for cycling given");
      *out = args[obj->u.loop->index0 % (int64_t)nargs];
      return true;
    }
    default: return tpl_fail(ctx, "'%s' object has no attribute '%s'", tv_type_name(obj), name);
  }
}
