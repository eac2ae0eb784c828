/* jinja_methods.c - the Python methods templates call on values: str (startswith, strip,
 * split, replace, ...), dict (items, keys, values, get), list (index, count) and loop.cycle().
 * Methods that would mutate a list or dict are refused with the sandbox's own message, because
 * transformers renders in Jinja's ImmutableSandboxedEnvironment. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "models/template/template_internal.h"

static const char *const k_str_methods[] = {
    "startswith", "endswith",   "strip",   "lstrip",   "rstrip",     "split",
    "rsplit",     "splitlines", "lower",   "upper",    "title",      "capitalize",
    "replace",    "find",       "rfind",   "index",    "rindex",     "count",
    "join",       "isdigit",    "isalpha", "isalnum",  "isspace",    "islower",
    "isupper",    "format",     "zfill",   "casefold", "format_map", NULL};
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

static bool str_format(tctx_t *ctx, const tv_t *s, const margs_t *a, const tv_t *map, tv_t *out);

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
  if (!strcmp(m, "format")) return str_format(ctx, s, a, NULL, out);
  if (!strcmp(m, "format_map")) {
    tv_t map;
    if (a->npos != 1 || a->nkw) return tpl_fail(ctx, "format_map() takes exactly one argument");
    map = a->pos[0];
    if (map.kind != TV_DICT && map.kind != TV_NS)
      return tpl_fail(ctx, "format_map() argument must be a mapping, not %s", tv_type_name(&map));
    return str_format(ctx, s, a, &map, out);
  }
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

/* ---- str.format and printf-style % ------------------------------------------------------------
 * Both reduce to one spec (Python's format-spec mini-language, which the % conversions map onto)
 * and one formatter. What is not implemented ('n', 'z', '#' on floats, 'a', ...) is refused with
 * an error rather than formatted differently from Python. */

enum { FMT_MAX_WIDTH = 1 << 20, FMT_MAX_PREC = 1000 };

typedef struct fspec {
  uint32_t fill;
  char align; /* '<', '>', '^', '=', or 0 for the type's default */
  char sign;  /* '+', '-', ' ' */
  bool alt, zero, printf_mode;
  char grouping;       /* ',', '_' or 0 */
  int64_t width, prec; /* prec -1: none */
  char type;           /* 0 for none */
} fspec_t;

/* Pads body (sign and prefix come first for '=') to the spec's width. */
static bool fmt_pad(kiln_strbuf_t *out, const fspec_t *sp, const char *pre, size_t pren,
                    const char *body, size_t bn, char def_align) {
  size_t len = utf8_count(pre, pren) + utf8_count(body, bn);
  size_t pad = sp->width > 0 && (size_t)sp->width > len ? (size_t)sp->width - len : 0;
  char al = sp->align ? sp->align : def_align;
  size_t left = al == '>' || al == '=' ? pad : al == '^' ? pad / 2 : 0, right = pad - left;
  if (al != '=')
    for (size_t i = 0; i < left; i++) kiln_strbuf_append_utf8(out, sp->fill);
  kiln_strbuf_append(out, pre, pren);
  if (al == '=')
    for (size_t i = 0; i < left; i++) kiln_strbuf_append_utf8(out, sp->fill);
  kiln_strbuf_append(out, body, bn);
  for (size_t i = 0; i < right; i++) kiln_strbuf_append_utf8(out, sp->fill);
  return true;
}

/* Inserts sep every `every` digits of the leading run of digits of s (n bytes) into out. */
static void fmt_group(kiln_strbuf_t *out, const char *s, size_t n, char sep, int every) {
  size_t d = 0;
  while (d < n && s[d] >= '0' && s[d] <= '9') d++;
  if (every == 4)
    while (d < n && ((s[d] >= '0' && s[d] <= '9') || (s[d] >= 'a' && s[d] <= 'f') ||
                     (s[d] >= 'A' && s[d] <= 'F')))
      d++;
  for (size_t i = 0; i < d; i++) {
    kiln_strbuf_append_char(out, s[i]);
    if (sep && i + 1 < d && (d - i - 1) % (size_t)every == 0) kiln_strbuf_append_char(out, sep);
  }
  kiln_strbuf_append(out, s + d, n - d);
}

static bool fmt_str(tctx_t *ctx, kiln_strbuf_t *out, const fspec_t *sp, const tv_t *s) {
  if (sp->type && sp->type != 's' && !sp->printf_mode)
    return tpl_fail(ctx, "Unknown format code '%c' for object of type 'str'", sp->type);
  if (!sp->printf_mode && sp->sign)
    return tpl_fail(ctx, "Sign not allowed in string format specifier");
  if (!sp->printf_mode && sp->alt)
    return tpl_fail(ctx, "Alternate form (#) not allowed in string format specifier");
  if (sp->align == '=')
    return tpl_fail(ctx, "'=' alignment not allowed in string format specifier");
  if (sp->grouping) return tpl_fail(ctx, "Cannot specify '%c' with 's'.", sp->grouping);
  size_t n = s->u.str.n;
  if (sp->prec >= 0) n = utf8_offset(s->u.str.s, n, (size_t)sp->prec);
  return fmt_pad(out, sp, "", 0, s->u.str.s, n, '<');
}

static bool fmt_int(tctx_t *ctx, kiln_strbuf_t *out, const fspec_t *sp, int64_t v) {
  char type = sp->type ? sp->type : 'd', digits[80], pre[4] = {0};
  size_t pn = 0;
  if (type == 'i' || type == 'u') type = 'd';
  if (!sp->printf_mode && sp->prec >= 0)
    return tpl_fail(ctx, "Precision not allowed in integer format specifier");
  if (type == 'c') {
    if (sp->sign) return tpl_fail(ctx, "Sign not allowed with integer format specifier 'c'");
    if (v < 0 || v > 0x10FFFF) return tpl_fail(ctx, "%%c arg not in range(0x110000)");
    char b[8];
    size_t k = 0;
    uint32_t cp = (uint32_t)v;
    if (cp < 0x80)
      b[k++] = (char)cp;
    else if (cp < 0x800) {
      b[k++] = (char)(0xC0 | (cp >> 6));
      b[k++] = (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      b[k++] = (char)(0xE0 | (cp >> 12));
      b[k++] = (char)(0x80 | ((cp >> 6) & 0x3F));
      b[k++] = (char)(0x80 | (cp & 0x3F));
    } else {
      b[k++] = (char)(0xF0 | (cp >> 18));
      b[k++] = (char)(0x80 | ((cp >> 12) & 0x3F));
      b[k++] = (char)(0x80 | ((cp >> 6) & 0x3F));
      b[k++] = (char)(0x80 | (cp & 0x3F));
    }
    return fmt_pad(out, sp, "", 0, b, k, '<');
  }
  uint64_t mag = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
  int base = type == 'd' ? 10 : type == 'x' || type == 'X' ? 16 : type == 'o' ? 8 : 2;
  if (!strchr("dxXob", type))
    return tpl_fail(ctx, "Unknown format code '%c' for object of type 'int'", type);
  if (sp->grouping == ',' && base != 10)
    return tpl_fail(ctx, "Cannot specify ',' with '%c'.", type);
  const char *dig = type == 'X' ? "0123456789ABCDEF" : "0123456789abcdef";
  char rev[72];
  size_t k = 0;
  do {
    rev[k++] = dig[mag % (uint64_t)base];
    mag /= (uint64_t)base;
  } while (mag);
  size_t dn = 0;
  if (sp->printf_mode && sp->prec > (int64_t)k) {
    if (sp->prec > 64) return tpl_fail(ctx, "precision too big");
    while (dn + k < (size_t)sp->prec) digits[dn++] = '0';
  }
  while (k) digits[dn++] = rev[--k];
  if (v < 0)
    pre[pn++] = '-';
  else if (sp->sign == '+' || sp->sign == ' ')
    pre[pn++] = sp->sign;
  if (sp->alt && base != 10) {
    pre[pn++] = '0';
    pre[pn++] = type == 'X' && sp->printf_mode ? 'X' : base == 16 ? 'x' : base == 8 ? 'o' : 'b';
  }
  if (sp->grouping && sp->zero && sp->fill == '0' && (!sp->align || sp->align == '='))
    return tpl_fail(ctx, "zero padding together with '%c' grouping is not supported", sp->grouping);
  kiln_strbuf_t g = KILN_STRBUF_INIT;
  fmt_group(&g, digits, dn, sp->grouping, base == 10 ? 3 : 4);
  bool ok = kiln_strbuf_ok(&g) || tpl_oom(ctx);
  if (ok) ok = fmt_pad(out, sp, pre, pn, g.data, g.len, sp->zero ? '=' : '>');
  kiln_strbuf_free(&g);
  return ok;
}

static bool fmt_float(tctx_t *ctx, kiln_strbuf_t *out, const fspec_t *sp, double x, char tname) {
  char type = sp->type, pre[2] = {0}, buf[FMT_MAX_PREC + 400];
  size_t pn = 0;
  if (type && !strchr("eEfFgG%", type))
    return tpl_fail(ctx, "Unknown format code '%c' for object of type '%s'", type,
                    tname == 'b'   ? "bool"
                    : tname == 'i' ? "int"
                                   : "float");
  if (sp->alt) return tpl_fail(ctx, "the '#' flag is not supported for floats");
  if (sp->prec > FMT_MAX_PREC)
    return tpl_fail(ctx, "format precision %lld is too large", (long long)sp->prec);
  if (fabs(x) >= 1e50 && (type == 'f' || type == 'F' || type == '%'))
    return tpl_fail(ctx, "fixed-point formatting of numbers this large is not supported");
  bool neg = signbit(x);
  double ax = fabs(x);
  int p = (int)sp->prec;
  if (isinf(ax) || isnan(ax)) {
    bool up = type == 'E' || type == 'F' || type == 'G';
    snprintf(buf, sizeof buf, "%s%s", isinf(ax) ? (up ? "INF" : "inf") : (up ? "NAN" : "nan"),
             type == '%' ? "%" : "");
  } else if (type == 0 && p < 0) {
    kiln_strbuf_t t = KILN_STRBUF_INIT;
    tv_write_float(&t, ax);
    snprintf(buf, sizeof buf, "%.*s", kiln_strbuf_ok(&t) ? (int)t.len : 0, t.data ? t.data : "");
    kiln_strbuf_free(&t);
  } else if (type == 0 || type == 'g' || type == 'G') {
    if (p < 0) p = 6;
    if (p == 0) p = 1;
    /* Python's '' type with a precision switches to exponent one digit earlier and keeps ".0" */
    int limit = type == 0 ? p - 1 : p;
    snprintf(buf, sizeof buf, "%.*e", p - 1, ax);
    int e = atoi(strchr(buf, 'e') + 1);
    if (e < -4 || e >= limit) {
      char *ep = strchr(buf, 'e'), tail[16];
      snprintf(tail, sizeof tail, "%s", ep);
      char *end = ep;
      if (memchr(buf, '.', (size_t)(ep - buf))) {
        while (end[-1] == '0') end--;
        if (end[-1] == '.') end--;
      }
      snprintf(end, sizeof buf - (size_t)(end - buf), "%s", tail);
    } else {
      snprintf(buf, sizeof buf, "%.*f", p - 1 - e > 0 ? p - 1 - e : 0, ax);
      size_t n = strlen(buf);
      if (strchr(buf, '.')) {
        while (buf[n - 1] == '0') n--;
        if (buf[n - 1] == '.') n--;
      }
      buf[n] = '\0';
      if (type == 0 && !strchr(buf, '.')) snprintf(buf + n, sizeof buf - n, ".0");
    }
    if (type == 'G')
      for (char *c = buf; *c; c++)
        if (*c == 'e') *c = 'E';
  } else if (type == 'e' || type == 'E') {
    snprintf(buf, sizeof buf, type == 'e' ? "%.*e" : "%.*E", p < 0 ? 6 : p, ax);
  } else if (type == '%') {
    snprintf(buf, sizeof buf, "%.*f%%", p < 0 ? 6 : p, ax * 100);
  } else {
    snprintf(buf, sizeof buf, "%.*f", p < 0 ? 6 : p, ax);
  }
  if (neg && !isnan(x))
    pre[pn++] = '-';
  else if (sp->sign == '+' || sp->sign == ' ')
    pre[pn++] = sp->sign;
  if (sp->grouping && sp->zero && sp->fill == '0' && (!sp->align || sp->align == '='))
    return tpl_fail(ctx, "zero padding together with '%c' grouping is not supported", sp->grouping);
  kiln_strbuf_t g = KILN_STRBUF_INIT;
  fmt_group(&g, buf, strlen(buf), sp->grouping, 3);
  bool ok = kiln_strbuf_ok(&g) || tpl_oom(ctx);
  if (ok) ok = fmt_pad(out, sp, pre, pn, g.data, g.len, sp->zero ? '=' : '>');
  kiln_strbuf_free(&g);
  return ok;
}

/* format(v, spec) for the value kinds a template has. */
static bool fmt_value(tctx_t *ctx, kiln_strbuf_t *out, const fspec_t *sp, const tv_t *v,
                      bool empty_spec) {
  if (empty_spec && v->kind != TV_UNDEF) return tv_write_str(ctx, out, v);
  if (sp->width > FMT_MAX_WIDTH)
    return tpl_fail(ctx, "format width %lld is larger than the limit of %d", (long long)sp->width,
                    FMT_MAX_WIDTH);
  switch (v->kind) {
    case TV_STR: return fmt_str(ctx, out, sp, v);
    case TV_BOOL:
    case TV_INT: {
      int64_t i = v->kind == TV_INT ? v->u.i : v->u.b;
      if (sp->type && strchr("eEfFgG%", sp->type))
        return fmt_float(ctx, out, sp, (double)i, v->kind == TV_INT ? 'i' : 'b');
      if (sp->type == 's' && !sp->printf_mode)
        return tpl_fail(ctx, "Unknown format code 's' for object of type '%s'", tv_type_name(v));
      return fmt_int(ctx, out, sp, i);
    }
    case TV_FLOAT:
      if (sp->grouping == '_' || (sp->type && strchr("dxXobcs", sp->type)))
        return tpl_fail(ctx, "Unknown format code '%c' for object of type 'float'",
                        sp->type ? sp->type : '_');
      return fmt_float(ctx, out, sp, v->u.f, 'f');
    case TV_UNDEF:
      if (empty_spec) return true;
      return tpl_fail(ctx, "unsupported format string passed to Undefined.__format__");
    default:
      return tpl_fail(ctx, "unsupported format string passed to %s.__format__", tv_type_name(v));
  }
}

static bool fmt_digits(const char **p, const char *end, int64_t *out) {
  if (*p >= end || **p < '0' || **p > '9') return false;
  int64_t v = 0;
  while (*p < end && **p >= '0' && **p <= '9') {
    if (v < (int64_t)1 << 40) v = v * 10 + (**p - '0');
    (*p)++;
  }
  *out = v;
  return true;
}

/* Parses a format spec ("[[fill]align][sign][#][0][width][,|_][.precision][type]"). */
static bool fmt_parse_spec(tctx_t *ctx, const char *s, size_t n, fspec_t *sp) {
  const char *p = s, *end = s + n;
  *sp = (fspec_t){.fill = ' ', .prec = -1};
  size_t next = n ? utf8_next(s, n, 0) : 0;
  if (n > next && strchr("<>^=", s[next]) && s[next]) {
    size_t nx;
    sp->fill = utf8_decode_at(s, n, 0, &nx);
    sp->align = s[next];
    p = s + next + 1;
  } else if (n && strchr("<>^=", s[0]) && s[0]) {
    sp->align = s[0];
    p++;
  }
  if (p < end && (*p == '+' || *p == '-' || *p == ' ')) sp->sign = *p++;
  if (p < end && *p == 'z') return tpl_fail(ctx, "the 'z' format option is not supported");
  if (p < end && *p == '#') {
    sp->alt = true;
    p++;
  }
  if (p < end && *p == '0') {
    sp->zero = true; /* fill '0'; numbers then default to '=' alignment, strings to '<' */
    if (!sp->align) sp->fill = '0';
    p++;
  }
  fmt_digits(&p, end, &sp->width);
  if (p < end && (*p == ',' || *p == '_')) sp->grouping = *p++;
  if (p < end && (*p == ',' || *p == '_')) return tpl_fail(ctx, "Cannot specify both ',' and '_'.");
  if (p < end && *p == '.') {
    p++;
    if (!fmt_digits(&p, end, &sp->prec)) return tpl_fail(ctx, "Format specifier missing precision");
  }
  if (p < end) sp->type = *p++;
  if (p < end || (sp->type && !strchr("sdbcoxXeEfFgG%", sp->type))) {
    if (sp->type == 'n') return tpl_fail(ctx, "the 'n' format type is not supported");
    return tpl_fail(ctx, "Invalid format specifier '%.*s'", (int)(n > 60 ? 60 : n), s);
  }
  return true;
}

typedef struct fmtargs {
  const tv_t *pos;
  size_t npos;
  const char *const *kwn;
  const tv_t *kwv;
  size_t nkw;
  const tv_t *map; /* format_map's mapping, or NULL */
  size_t auto_idx;
  int numbering; /* 0 unknown, 'a' automatic, 'm' manual */
} fmtargs_t;

/* Resolves "name.attr[key]..." the way Jinja's SandboxedFormatter does (env.getattr/getitem). */
static bool fmt_field(tctx_t *ctx, fmtargs_t *fa, const char *s, size_t n, tv_t *out) {
  size_t k = 0;
  while (k < n && s[k] != '.' && s[k] != '[') k++;
  const char *p = s;
  int64_t idx;
  if (k == 0) {
    if (fa->numbering == 'm')
      return tpl_fail(ctx,
                      "cannot switch from manual field specification to automatic field "
                      "numbering");
    fa->numbering = 'a';
    idx = (int64_t)fa->auto_idx++;
  } else if (fmt_digits(&p, s + k, &idx) && p == s + k) {
    if (fa->numbering == 'a')
      return tpl_fail(ctx,
                      "cannot switch from manual field specification to automatic field "
                      "numbering");
    fa->numbering = 'm';
  } else {
    idx = -1;
  }
  if (idx >= 0) {
    if (fa->map || (size_t)idx >= fa->npos) return tpl_fail(ctx, "tuple index out of range");
    *out = fa->pos[idx];
  } else {
    bool found = false;
    if (fa->map) {
      found = tv_dict_get_str(ctx, fa->map, s, k, out);
    } else {
      for (size_t i = 0; i < fa->nkw && !found; i++)
        if (strlen(fa->kwn[i]) == k && !memcmp(fa->kwn[i], s, k)) {
          *out = fa->kwv[i];
          found = true;
        }
    }
    if (!found) return tpl_fail(ctx, "'%.*s'", (int)(k > 60 ? 60 : k), s);
  }
  while (k < n) {
    if (s[k] == '.') {
      size_t b = ++k;
      while (k < n && s[k] != '.' && s[k] != '[') k++;
      if (k == b) return tpl_fail(ctx, "Empty attribute in format string");
      char name[128];
      if (k - b >= sizeof name) return tpl_fail(ctx, "format field attribute name too long");
      memcpy(name, s + b, k - b);
      name[k - b] = '\0';
      if (!tpl_get_attr(ctx, out, name, k - b, out)) return false;
    } else if (s[k] == '[') {
      size_t b = ++k;
      while (k < n && s[k] != ']') k++;
      if (k >= n) return tpl_fail(ctx, "Missing ']' in format string");
      if (k == b) return tpl_fail(ctx, "Empty attribute in format string");
      const char *q = s + b;
      int64_t i;
      tv_t key = fmt_digits(&q, s + k, &i) && q == s + k ? tv_int(i) : tv_str(s + b, k - b);
      if (!tpl_get_item(ctx, out, &key, out)) return false;
      k++;
    } else {
      return tpl_fail(ctx, "Only '.' or '[' may follow ']' in format field specifier");
    }
  }
  return true;
}

static bool fmt_run(tctx_t *ctx, kiln_strbuf_t *out, const char *s, size_t n, fmtargs_t *fa,
                    int depth) {
  if (depth > 2) return tpl_fail(ctx, "Max string recursion exceeded");
  size_t i = 0;
  while (i < n) {
    char c = s[i];
    if (c == '}') {
      if (i + 1 < n && s[i + 1] == '}') {
        kiln_strbuf_append_char(out, '}');
        i += 2;
        continue;
      }
      return tpl_fail(ctx, "Single '}' encountered in format string");
    }
    if (c != '{') {
      kiln_strbuf_append_char(out, c);
      i++;
      continue;
    }
    if (i + 1 < n && s[i + 1] == '{') {
      kiln_strbuf_append_char(out, '{');
      i += 2;
      continue;
    }
    /* find the matching '}' (nested braces belong to the spec) */
    size_t b = ++i, lvl = 1;
    while (i < n && lvl) {
      if (s[i] == '{') lvl++;
      if (s[i] == '}') lvl--;
      if (s[i] == '[') /* brackets in the field name may hold braces */
        while (i < n && s[i] != ']' && lvl == 1 && s[i] != ':' && s[i] != '!') i++;
      if (lvl) i++;
    }
    if (i >= n) {
      return tpl_fail(ctx, lvl && b < n ? "expected '}' before end of string"
                                        : "Single '{' encountered in format string");
    }
    const char *f = s + b;
    size_t fn = i - b, nm = 0;
    i++;
    while (nm < fn && f[nm] != '!' && f[nm] != ':') {
      if (f[nm] == '[')
        while (nm < fn && f[nm] != ']') nm++;
      if (nm < fn) nm++;
    }
    char conv = 0;
    size_t sb = nm;
    if (nm < fn && f[nm] == '!') {
      if (nm + 1 >= fn)
        return tpl_fail(ctx, "end of string while looking for conversion specifier");
      conv = f[nm + 1];
      sb = nm + 2;
      if (sb < fn && f[sb] != ':') return tpl_fail(ctx, "expected ':' after conversion specifier");
      if (conv == 'a') return tpl_fail(ctx, "the !a conversion is not supported");
      if (conv != 'r' && conv != 's') return tpl_fail(ctx, "Unknown conversion specifier %c", conv);
    }
    const char *spec = sb < fn ? f + sb + 1 : "";
    size_t specn = sb < fn ? fn - sb - 1 : 0;
    tv_t v;
    if (!fmt_field(ctx, fa, f, nm, &v)) return false;
    kiln_strbuf_t sbuf = KILN_STRBUF_INIT;
    if (memchr(spec, '{', specn)) {
      if (!fmt_run(ctx, &sbuf, spec, specn, fa, depth + 1)) {
        kiln_strbuf_free(&sbuf);
        return false;
      }
      if (!kiln_strbuf_ok(&sbuf)) {
        kiln_strbuf_free(&sbuf);
        return tpl_oom(ctx);
      }
      spec = sbuf.data ? sbuf.data : "";
      specn = sbuf.len;
    }
    if (conv) {
      kiln_strbuf_t t = KILN_STRBUF_INIT;
      bool ok = conv == 'r' ? tv_write_repr(ctx, &t, &v) : tv_write_str(ctx, &t, &v);
      if (ok && !kiln_strbuf_ok(&t)) ok = tpl_oom(ctx);
      if (ok) {
        v = tv_from_buf(ctx, &t);
        ok = v.kind == TV_STR;
      }
      kiln_strbuf_free(&t);
      if (!ok) {
        kiln_strbuf_free(&sbuf);
        return false;
      }
    }
    fspec_t sp;
    bool ok = fmt_parse_spec(ctx, spec, specn, &sp) && fmt_value(ctx, out, &sp, &v, specn == 0);
    kiln_strbuf_free(&sbuf);
    if (!ok) return false;
    if (out->len > ctx->lim.max_output)
      return tpl_fail(ctx, "output is larger than the limit of %zu bytes", ctx->lim.max_output);
  }
  return true;
}

static bool str_format(tctx_t *ctx, const tv_t *s, const margs_t *a, const tv_t *map, tv_t *out) {
  fmtargs_t fa = {a->pos, a->npos, a->kwn, a->kwv, a->nkw, map, 0, 0};
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  if (!fmt_run(ctx, &b, s->u.str.s, s->u.str.n, &fa, 0)) {
    kiln_strbuf_free(&b);
    return false;
  }
  return finish(ctx, &b, out);
}

bool tpl_str_percent(tctx_t *ctx, const tv_t *fmt, const tv_t *rhs, tv_t *out) {
  const char *s = fmt->u.str.s;
  size_t n = fmt->u.str.n, i = 0, next = 0, nargs = 1;
  const tv_t *args = rhs;
  tv_t *items = NULL;
  bool is_map = rhs->kind == TV_DICT || rhs->kind == TV_NS, used_map = false;
  if (rhs->kind == TV_LIST && (rhs->flags & TV_F_TUPLE)) {
    if (!tv_iterate(ctx, rhs, &items, &nargs)) return false;
    args = items;
  }
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  bool ok = true;
  while (ok && i < n) {
    if (s[i] != '%') {
      kiln_strbuf_append_char(&b, s[i++]);
      continue;
    }
    size_t start = i++;
    fspec_t sp = {.fill = ' ', .prec = -1, .printf_mode = true};
    tv_t v;
    bool have = false;
    if (i < n && s[i] == '(') {
      if (!is_map) {
        ok = tpl_fail(ctx, "format requires a mapping");
        break;
      }
      size_t kb = ++i, lvl = 1;
      while (i < n && lvl) {
        if (s[i] == '(') lvl++;
        if (s[i] == ')') lvl--;
        i++;
      }
      if (lvl) {
        ok = tpl_fail(ctx, "incomplete format key");
        break;
      }
      if (!tv_dict_get_str(ctx, rhs, s + kb, i - 1 - kb, &v)) {
        ok = tpl_fail(ctx, "'%.*s'", (int)(i - 1 - kb > 60 ? 60 : i - 1 - kb), s + kb);
        break;
      }
      have = used_map = true;
    }
    for (; i < n && strchr("#0- +", s[i]) && s[i]; i++) {
      if (s[i] == '#') sp.alt = true;
      if (s[i] == '0') sp.zero = true;
      if (s[i] == '-') sp.align = '<';
      if (s[i] == '+' || (s[i] == ' ' && sp.sign != '+')) sp.sign = s[i];
    }
    const char *p = s + i;
    for (int part = 0; part < 2 && ok; part++) {
      int64_t *dst = part ? &sp.prec : &sp.width;
      if (part) {
        if (p >= s + n || *p != '.') break;
        p++;
        *dst = 0;
      }
      if (p < s + n && *p == '*') {
        p++;
        if (have || next >= nargs) {
          ok = tpl_fail(ctx, have ? "* wants int" : "not enough arguments for format string");
          break;
        }
        const tv_t *w = &args[next++];
        if (w->kind != TV_INT && w->kind != TV_BOOL) {
          ok = tpl_fail(ctx, "* wants int");
          break;
        }
        *dst = w->kind == TV_INT ? w->u.i : w->u.b;
        if (!part && *dst < 0) {
          sp.align = '<';
          *dst = -*dst;
        }
      } else {
        fmt_digits(&p, s + n, dst);
      }
    }
    if (!ok) break;
    while (p < s + n && (*p == 'h' || *p == 'l' || *p == 'L')) p++;
    i = (size_t)(p - s);
    if (i >= n) {
      ok = tpl_fail(ctx, "incomplete format");
      break;
    }
    char t = s[i++];
    if (t == '%') {
      kiln_strbuf_append_char(&b, '%');
      continue;
    }
    if (!strchr("diouxXeEfFgGcrsa", t)) {
      ok = tpl_fail(ctx, "unsupported format character '%c' (0x%x) at index %zu", t,
                    (unsigned)(unsigned char)t, i - 1);
      break;
    }
    (void)start;
    if (!have) {
      if (next >= nargs) {
        ok = tpl_fail(ctx, "not enough arguments for format string");
        break;
      }
      v = args[next++];
    }
    if (sp.zero && sp.align != '<' && !strchr("rsac", t)) {
      sp.fill = '0';
      sp.align = '=';
    }
    if (sp.width > FMT_MAX_WIDTH) {
      ok = tpl_fail(ctx, "format width %lld is larger than the limit of %d", (long long)sp.width,
                    FMT_MAX_WIDTH);
      break;
    }
    if (!sp.align) sp.align = '>';
    if (t == 'a') {
      ok = tpl_fail(ctx, "the %%a conversion is not supported");
    } else if (t == 's' || t == 'r') {
      kiln_strbuf_t tb = KILN_STRBUF_INIT;
      ok = t == 'r' ? tv_write_repr(ctx, &tb, &v) : tv_write_str(ctx, &tb, &v);
      if (ok && !kiln_strbuf_ok(&tb)) ok = tpl_oom(ctx);
      if (ok) {
        tv_t sv = tv_str(tb.data ? tb.data : "", tb.len);
        sp.sign = 0;
        sp.alt = false;
        ok = fmt_str(ctx, &b, &sp, &sv);
      }
      kiln_strbuf_free(&tb);
    } else if (t == 'c') {
      if (v.kind == TV_STR && utf8_count(v.u.str.s, v.u.str.n) == 1) {
        sp.prec = -1;
        ok = fmt_str(ctx, &b, &sp, &v);
      } else if (v.kind == TV_INT || v.kind == TV_BOOL) {
        sp.type = 'c';
        sp.sign = 0;
        ok = fmt_int(ctx, &b, &sp, v.kind == TV_INT ? v.u.i : v.u.b);
      } else {
        ok = tpl_fail(ctx, "%%c requires an int or a unicode character, not %s", tv_type_name(&v));
      }
    } else if (v.kind != TV_INT && v.kind != TV_BOOL && v.kind != TV_FLOAT) {
      ok = tpl_fail(ctx, "%%%c format: %s is required, not %s", t,
                    strchr("diu", t) || strchr("eEfFgG", t) ? "a real number" : "an integer",
                    tv_type_name(&v));
    } else if (strchr("diuoxX", t)) {
      if (v.kind == TV_FLOAT && strchr("oxX", t)) {
        ok = tpl_fail(ctx, "%%%c format: an integer is required, not float", t);
      } else if (v.kind == TV_FLOAT && !(fabs(v.u.f) < 9.2e18)) {
        ok = tpl_fail(ctx, "cannot convert float %s to integer",
                      isnan(v.u.f) ? "NaN" : "infinity or a too large value");
      } else {
        sp.type = t;
        int64_t iv = v.kind == TV_INT ? v.u.i : v.kind == TV_BOOL ? v.u.b : (int64_t)v.u.f;
        ok = fmt_int(ctx, &b, &sp, iv);
      }
    } else {
      if (sp.alt) {
        ok = tpl_fail(ctx, "the '#' flag is not supported for floats");
        break;
      }
      sp.type = t;
      if (sp.prec < 0) sp.prec = 6;
      double d = v.kind == TV_FLOAT ? v.u.f : v.kind == TV_INT ? (double)v.u.i : v.u.b;
      ok = fmt_float(ctx, &b, &sp, d, 'f');
    }
    if (ok && b.len > ctx->lim.max_output)
      ok = tpl_fail(ctx, "output is larger than the limit of %zu bytes", ctx->lim.max_output);
  }
  if (ok && next < nargs && !used_map && !(is_map && next == 0))
    ok = tpl_fail(ctx, "not all arguments converted during string formatting");
  if (!ok) {
    kiln_strbuf_free(&b);
    return false;
  }
  return finish(ctx, &b, out);
}
