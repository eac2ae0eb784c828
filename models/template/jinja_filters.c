/* jinja_filters.c - Jinja's builtin filters and tests as transformers' environment has them
 * (tojson is transformers' override: json.dumps(x, ensure_ascii=False, indent=None,
 * separators=None, sort_keys=False), so no HTML escaping and Python's separators). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/template/template_internal.h"

typedef struct fargs {
  const tv_t *pos;
  size_t npos;
  const char *const *kwn;
  const tv_t *kwv;
  size_t nkw;
} fargs_t;

/* Argument i (0-based, after the filtered value) by position or by keyword name. */
static bool arg(const fargs_t *a, size_t i, const char *name, tv_t *out) {
  if (i < a->npos) {
    *out = a->pos[i];
    return true;
  }
  for (size_t k = 0; k < a->nkw; k++)
    if (name && !strcmp(a->kwn[k], name)) {
      *out = a->kwv[k];
      return true;
    }
  return false;
}

static bool arg_bool(const fargs_t *a, size_t i, const char *name, bool def) {
  tv_t v;
  return arg(a, i, name, &v) ? tv_truthy(&v) : def;
}

static bool need_str(tctx_t *ctx, const char *filter, const tv_t *v, tv_t *out) {
  (void)filter;
  return tv_to_str(ctx, v, out);
}

static bool arg_int(tctx_t *ctx, const fargs_t *a, size_t i, const char *name, int64_t def,
                    int64_t *out) {
  tv_t v;
  *out = def;
  if (!arg(a, i, name, &v) || v.kind == TV_NONE) return true;
  if (v.kind == TV_INT)
    *out = v.u.i;
  else if (v.kind == TV_BOOL)
    *out = v.u.b;
  else
    return tpl_fail(ctx, "argument '%s' must be an integer, not %s", name, tv_type_name(&v));
  return true;
}

/* Jinja's make_attrgetter: "a.b.0" walks keys (integer parts index lists). */
static tv_t attr_path(tctx_t *ctx, const tv_t *item, const tv_t *path) {
  tv_t cur = *item;
  if (path->kind == TV_INT) {
    if (cur.kind == TV_LIST) {
      int64_t i = path->u.i;
      if (i < 0) i += (int64_t)cur.u.list->n;
      if (i >= 0 && (size_t)i < cur.u.list->n) return tv_list_get(ctx, &cur, (size_t)i);
    }
    return tv_undef(NULL);
  }
  if (path->kind != TV_STR) return tv_undef(NULL);
  const char *s = path->u.str.s, *end = s + path->u.str.n;
  while (s <= end) {
    const char *dot = memchr(s, '.', (size_t)(end - s));
    size_t n = dot ? (size_t)(dot - s) : (size_t)(end - s);
    tv_t next = tv_undef(NULL);
    bool digits = n > 0;
    for (size_t k = 0; k < n; k++)
      if (s[k] < '0' || s[k] > '9') digits = false;
    if (cur.kind == TV_DICT || cur.kind == TV_NS) {
      if (!tv_dict_get_str(ctx, &cur, s, n, &next)) next = tv_undef(NULL);
    } else if (cur.kind == TV_LIST && digits) {
      size_t i = (size_t)strtoull(s, NULL, 10);
      next = i < cur.u.list->n ? tv_list_get(ctx, &cur, i) : tv_undef(NULL);
    }
    cur = next;
    if (!dot || cur.kind == TV_UNDEF) break;
    s = dot + 1;
  }
  return cur;
}

/* Lower-cases strings for Jinja's case-insensitive sort/unique/min/max/dictsort. */
static bool fold(tctx_t *ctx, const tv_t *v, bool case_sensitive, tv_t *out) {
  if (!case_sensitive && v->kind == TV_STR) return tpl_str_case(ctx, v, 'l', out);
  *out = *v;
  return true;
}

/* Stable merge sort of items by keys (tv_cmp); false with an error when unorderable. */
static bool sort_by(tctx_t *ctx, tv_t *items, tv_t *keys, size_t n, bool reverse) {
  if (n < 2) return true;
  tv_t *ti = tpl_alloc(ctx, n * sizeof *ti), *tk = tpl_alloc(ctx, n * sizeof *tk);
  if (!ti || !tk) return false;
  for (size_t width = 1; width < n; width *= 2) {
    for (size_t lo = 0; lo < n; lo += 2 * width) {
      size_t mid = lo + width < n ? lo + width : n, hi = lo + 2 * width < n ? lo + 2 * width : n;
      size_t i = lo, j = mid, k = lo;
      while (i < mid && j < hi) {
        int c;
        if (!tv_cmp(ctx, &keys[j], &keys[i], &c)) return false;
        bool take_right = reverse ? c > 0 : c < 0;
        if (take_right) {
          ti[k] = items[j];
          tk[k++] = keys[j++];
        } else {
          ti[k] = items[i];
          tk[k++] = keys[i++];
        }
      }
      while (i < mid) {
        ti[k] = items[i];
        tk[k++] = keys[i++];
      }
      while (j < hi) {
        ti[k] = items[j];
        tk[k++] = keys[j++];
      }
    }
    memcpy(items, ti, n * sizeof *ti);
    memcpy(keys, tk, n * sizeof *tk);
  }
  return true;
}

static bool make_list(tctx_t *ctx, const tv_t *items, size_t n, tv_t *out) {
  tv_t r = tv_new_list(ctx, n);
  if (r.kind != TV_LIST) return false;
  if (n) memcpy(r.u.list->items, items, n * sizeof *items);
  *out = r;
  return true;
}

static bool iter_copy(tctx_t *ctx, const tv_t *in, tv_t **items, size_t *n) {
  tv_t *src;
  if (!tv_iterate(ctx, in, &src, n)) return false;
  *items = tpl_alloc(ctx, (*n ? *n : 1) * sizeof **items);
  if (!*items) return false;
  if (*n) memcpy(*items, src, *n * sizeof *src);
  return true;
}

static bool f_tojson(tctx_t *ctx, const tv_t *in, const fargs_t *a, tv_t *out) {
  tjson_opts_t o = {.indent = -1, .item_sep = ", ", .key_sep = ": "};
  tv_t v;
  o.ensure_ascii = arg_bool(a, 0, "ensure_ascii", false);
  if (arg(a, 1, "indent", &v) && v.kind != TV_NONE) {
    if (v.kind != TV_INT) return tpl_fail(ctx, "tojson: indent must be an integer");
    o.indent = v.u.i < 0 ? 0 : v.u.i > 64 ? 64 : (int)v.u.i;
    o.item_sep = ",";
  }
  if (arg(a, 2, "separators", &v) && v.kind != TV_NONE) {
    if (v.kind != TV_LIST || v.u.list->n != 2)
      return tpl_fail(ctx, "tojson: separators must be a pair of strings");
    tv_t s0 = tv_list_get(ctx, &v, 0), s1 = tv_list_get(ctx, &v, 1);
    if (s0.kind != TV_STR || s1.kind != TV_STR)
      return tpl_fail(ctx, "tojson: separators must be a pair of strings");
    o.item_sep = kiln_arena_strndup(&ctx->arena, s0.u.str.s, s0.u.str.n);
    o.key_sep = kiln_arena_strndup(&ctx->arena, s1.u.str.s, s1.u.str.n);
    if (!o.item_sep || !o.key_sep) return tpl_oom(ctx);
  }
  o.sort_keys = arg_bool(a, 3, "sort_keys", false);
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  bool ok = tv_write_json(ctx, &b, in, &o);
  if (ok) {
    *out = tv_from_buf(ctx, &b);
    ok = out->kind == TV_STR;
  }
  kiln_strbuf_free(&b);
  return ok;
}

static bool f_join(tctx_t *ctx, const tv_t *in, const fargs_t *a, tv_t *out) {
  tv_t sep = tv_str("", 0), attr, *items;
  size_t n;
  if (arg(a, 0, "d", &sep) && !tv_to_str(ctx, &sep, &sep)) return false;
  bool has_attr = arg(a, 1, "attribute", &attr);
  if (!tv_iterate(ctx, in, &items, &n)) return false;
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  bool ok = true;
  for (size_t i = 0; i < n && ok; i++) {
    if (i) kiln_strbuf_append(&b, sep.u.str.s, sep.u.str.n);
    tv_t x = has_attr ? attr_path(ctx, &items[i], &attr) : items[i];
    ok = tv_write_str(ctx, &b, &x);
  }
  if (ok) {
    *out = tv_from_buf(ctx, &b);
    ok = out->kind == TV_STR;
  }
  kiln_strbuf_free(&b);
  return ok;
}

static bool f_sort(tctx_t *ctx, const tv_t *in, const fargs_t *a, tv_t *out) {
  bool reverse = arg_bool(a, 0, "reverse", false), cs = arg_bool(a, 1, "case_sensitive", false);
  tv_t attr, *items, *keys;
  bool has_attr = arg(a, 2, "attribute", &attr) && attr.kind != TV_NONE;
  size_t n;
  if (!iter_copy(ctx, in, &items, &n)) return false;
  if (!(keys = tpl_alloc(ctx, (n ? n : 1) * sizeof *keys))) return false;
  for (size_t i = 0; i < n; i++) {
    tv_t k = has_attr ? attr_path(ctx, &items[i], &attr) : items[i];
    if (!fold(ctx, &k, cs, &keys[i])) return false;
  }
  if (!sort_by(ctx, items, keys, n, reverse)) return false;
  return make_list(ctx, items, n, out);
}

static bool f_dictsort(tctx_t *ctx, const tv_t *in, const fargs_t *a, tv_t *out) {
  bool cs = arg_bool(a, 0, "case_sensitive", false), reverse = arg_bool(a, 2, "reverse", false);
  tv_t by = tv_str("key", 3);
  arg(a, 1, "by", &by);
  bool by_value = by.kind == TV_STR && by.u.str.n == 5 && !memcmp(by.u.str.s, "value", 5);
  if (in->kind != TV_DICT)
    return tpl_fail(ctx, "dictsort: expected a mapping, got %s", tv_type_name(in));
  size_t n = tv_len(in);
  tv_t *items = tpl_alloc(ctx, (n ? n : 1) * sizeof *items),
       *keys = tpl_alloc(ctx, (n ? n : 1) * sizeof *keys);
  if (!items || !keys) return false;
  for (size_t i = 0; i < n; i++) {
    tv_t pair = tv_new_list(ctx, 2);
    if (pair.kind != TV_LIST) return false;
    pair.flags = TV_F_TUPLE;
    tv_dict_at(ctx, in, i, &pair.u.list->items[0], &pair.u.list->items[1]);
    items[i] = pair;
    if (!fold(ctx, &pair.u.list->items[by_value ? 1 : 0], cs, &keys[i])) return false;
  }
  if (!sort_by(ctx, items, keys, n, reverse)) return false;
  return make_list(ctx, items, n, out);
}

static bool f_unique(tctx_t *ctx, const tv_t *in, const fargs_t *a, tv_t *out) {
  bool cs = arg_bool(a, 0, "case_sensitive", false);
  tv_t attr, *items, *res, *seen;
  bool has_attr = arg(a, 1, "attribute", &attr) && attr.kind != TV_NONE;
  size_t n, k = 0;
  if (!tv_iterate(ctx, in, &items, &n)) return false;
  res = tpl_alloc(ctx, (n ? n : 1) * sizeof *res);
  seen = tpl_alloc(ctx, (n ? n : 1) * sizeof *seen);
  if (!res || !seen) return false;
  for (size_t i = 0; i < n; i++) {
    tv_t key = has_attr ? attr_path(ctx, &items[i], &attr) : items[i];
    if (!fold(ctx, &key, cs, &key)) return false;
    bool dup = false;
    for (size_t j = 0; j < k && !dup; j++) dup = tv_eq(&seen[j], &key);
    if (!dup) {
      seen[k] = key;
      res[k++] = items[i];
    }
  }
  return make_list(ctx, res, k, out);
}

static bool f_minmax(tctx_t *ctx, const tv_t *in, const fargs_t *a, bool want_max, tv_t *out) {
  bool cs = arg_bool(a, 0, "case_sensitive", false);
  tv_t attr, *items, best = tv_undef("No aggregated item, sequence was empty."),
                     bestk = tv_undef(NULL);
  bool has_attr = arg(a, 1, "attribute", &attr) && attr.kind != TV_NONE;
  size_t n;
  if (!tv_iterate(ctx, in, &items, &n)) return false;
  for (size_t i = 0; i < n; i++) {
    tv_t k = has_attr ? attr_path(ctx, &items[i], &attr) : items[i];
    if (!fold(ctx, &k, cs, &k)) return false;
    int c = 0;
    if (i && !tv_cmp(ctx, &k, &bestk, &c)) return false;
    if (i == 0 || (want_max ? c > 0 : c < 0)) {
      best = items[i];
      bestk = k;
    }
  }
  *out = best;
  return true;
}

static bool apply_named_test(tctx_t *ctx, const char *name, const tv_t *x, const tv_t *args,
                             size_t nargs, bool *r) {
  return tpl_apply_test(ctx, name, x, args, nargs, r);
}

/* select/reject/selectattr/rejectattr */
static bool f_select(tctx_t *ctx, const tv_t *in, const fargs_t *a, bool by_attr, bool keep,
                     tv_t *out) {
  tv_t *items, *res, attr = tv_none();
  size_t n, k = 0, first = 0;
  if (by_attr) {
    if (a->npos < 1) return tpl_fail(ctx, "selectattr/rejectattr need an attribute name");
    attr = a->pos[0];
    first = 1;
  }
  const char *test = NULL;
  char tname[64];
  if (a->npos > first) {
    const tv_t *t = &a->pos[first];
    if (t->kind != TV_STR || t->u.str.n >= sizeof tname)
      return tpl_fail(ctx, "the test name must be a string");
    memcpy(tname, t->u.str.s, t->u.str.n);
    tname[t->u.str.n] = '\0';
    if (!tpl_test_exists(tname)) return tpl_fail(ctx, "unknown test '%s'", tname);
    test = tname;
  }
  if (!tv_iterate(ctx, in, &items, &n)) return false;
  if (!(res = tpl_alloc(ctx, (n ? n : 1) * sizeof *res))) return false;
  for (size_t i = 0; i < n; i++) {
    tv_t x = by_attr ? attr_path(ctx, &items[i], &attr) : items[i];
    bool r;
    if (test) {
      size_t na = a->npos > first + 1 ? a->npos - first - 1 : 0;
      if (!apply_named_test(ctx, test, &x, a->pos + first + 1, na, &r)) return false;
    } else {
      r = tv_truthy(&x);
    }
    if (r == keep) res[k++] = items[i];
  }
  return make_list(ctx, res, k, out);
}

static bool f_map(tctx_t *ctx, const tv_t *in, const fargs_t *a, tv_t *out) {
  tv_t *items, attr, def;
  size_t n;
  if (!tv_iterate(ctx, in, &items, &n)) return false;
  tv_t r = tv_new_list(ctx, n);
  if (r.kind != TV_LIST) return false;
  if (a->npos == 0 && arg(a, 99, "attribute", &attr)) {
    bool has_def = arg(a, 99, "default", &def);
    for (size_t i = 0; i < n; i++) {
      tv_t x = attr_path(ctx, &items[i], &attr);
      r.u.list->items[i] = (x.kind == TV_UNDEF && has_def) ? def : x;
    }
  } else {
    if (a->npos < 1 || a->pos[0].kind != TV_STR || a->pos[0].u.str.n >= 64)
      return tpl_fail(ctx, "map: expected a filter name or attribute=");
    char fname[64];
    memcpy(fname, a->pos[0].u.str.s, a->pos[0].u.str.n);
    fname[a->pos[0].u.str.n] = '\0';
    if (!tpl_filter_exists(fname)) return tpl_fail(ctx, "unknown filter '%s'", fname);
    for (size_t i = 0; i < n; i++)
      if (!tpl_apply_filter(ctx, fname, &items[i], a->pos + 1, a->npos - 1, a->kwn, a->kwv, a->nkw,
                            &r.u.list->items[i]))
        return false;
  }
  *out = r;
  return true;
}

static bool splitlines_indent(tctx_t *ctx, const tv_t *in, const fargs_t *a, tv_t *out) {
  tv_t s, w;
  if (!tv_to_str(ctx, in, &s)) return false;
  char ind[256];
  size_t il = 4;
  memset(ind, ' ', sizeof ind);
  if (arg(a, 0, "width", &w)) {
    if (w.kind == TV_STR) {
      if (w.u.str.n > sizeof ind) return tpl_fail(ctx, "indent: width string too long");
      memcpy(ind, w.u.str.s, w.u.str.n);
      il = w.u.str.n;
    } else if (w.kind == TV_INT) {
      il = w.u.i < 0 ? 0 : w.u.i > 256 ? 256 : (size_t)w.u.i;
    } else {
      return tpl_fail(ctx, "indent: width must be an integer or a string");
    }
  }
  bool first = arg_bool(a, 1, "first", false), blank = arg_bool(a, 2, "blank", false);
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  if (first) kiln_strbuf_append(&b, ind, il);
  /* Jinja appends "\n" and splits with str.splitlines(): every line, including an empty last
   * one when s ends in a newline, is a line; lines after the first get the indentation (empty
   * ones only with blank=True). */
  const char *p = s.u.str.s, *end = p + s.u.str.n;
  bool line0 = true;
  for (;;) {
    const char *q = p;
    while (q < end && *q != '\n' && *q != '\r') q++;
    size_t ll = (size_t)(q - p);
    if (!line0) {
      kiln_strbuf_append_char(&b, '\n');
      if (blank || ll) kiln_strbuf_append(&b, ind, il);
    }
    kiln_strbuf_append(&b, p, ll);
    line0 = false;
    if (q >= end) break; /* the appended "\n" terminates this last line */
    if (*q == '\r' && q + 1 < end && q[1] == '\n') q++;
    p = q + 1;
  }
  bool ok = kiln_strbuf_ok(&b) || tpl_oom(ctx);
  if (ok) {
    *out = tv_from_buf(ctx, &b);
    ok = out->kind == TV_STR;
  }
  kiln_strbuf_free(&b);
  return ok;
}

static bool f_round(tctx_t *ctx, const tv_t *in, const fargs_t *a, tv_t *out) {
  int64_t prec;
  tv_t method = tv_str("common", 6);
  if (!arg_int(ctx, a, 0, "precision", 0, &prec)) return false;
  arg(a, 1, "method", &method);
  if (in->kind == TV_INT || in->kind == TV_BOOL) {
    *out = tv_int(in->kind == TV_INT ? in->u.i : in->u.b);
    if (method.kind == TV_STR && method.u.str.n == 6 && !memcmp(method.u.str.s, "common", 6))
      return true;
    *out = tv_float((double)out->u.i);
    return true;
  }
  if (in->kind != TV_FLOAT)
    return tpl_fail(ctx, "round: expected a number, got %s", tv_type_name(in));
  double m = pow(10.0, (double)prec), x = in->u.f * m, r;
  if (method.kind == TV_STR && method.u.str.n == 4 && !memcmp(method.u.str.s, "ceil", 4))
    r = ceil(x);
  else if (method.kind == TV_STR && method.u.str.n == 5 && !memcmp(method.u.str.s, "floor", 5))
    r = floor(x);
  else if (prec >= 0 && prec <= 100 && fabs(in->u.f) < 1e300) {
    /* Python's round() rounds the exact binary value, ties to even: so does printf */
    char buf[512];
    snprintf(buf, sizeof buf, "%.*f", (int)prec, in->u.f);
    *out = tv_float(strtod(buf, NULL));
    return true;
  } else {
    r = nearbyint(x);
  }
  *out = tv_float(prec ? r / m : r);
  return true;
}

static bool parse_int_str(const tv_t *s, int64_t *out) {
  char buf[64];
  size_t k = 0;
  const char *p = s->u.str.s, *e = p + s->u.str.n;
  while (p < e && (*p == ' ' || (*p >= '\t' && *p <= '\r'))) p++;
  while (e > p && (e[-1] == ' ' || (e[-1] >= '\t' && e[-1] <= '\r'))) e--;
  if (p == e || (size_t)(e - p) >= sizeof buf) return false;
  for (const char *q = p; q < e; q++) {
    if (*q == '_') continue;
    if (!((*q >= '0' && *q <= '9') || ((*q == '-' || *q == '+') && q == p))) return false;
    buf[k++] = *q;
  }
  buf[k] = '\0';
  char *end;
  long long v = strtoll(buf, &end, 10);
  if (*end || end == buf) return false;
  *out = v;
  return true;
}

static bool parse_float_str(const tv_t *s, double *out) {
  char buf[128];
  if (s->u.str.n >= sizeof buf) return false;
  memcpy(buf, s->u.str.s, s->u.str.n);
  buf[s->u.str.n] = '\0';
  char *end;
  double v = strtod(buf, &end);
  while (*end == ' ' || (*end >= '\t' && *end <= '\r')) end++;
  if (end == buf || *end) return false;
  *out = v;
  return true;
}

/* groupby(attribute, default=None, case_sensitive=False): sorted (grouper, list) tuples that
 * also answer .grouper and .list (Jinja's _GroupTuple). */
static bool f_groupby(tctx_t *ctx, const tv_t *in, const fargs_t *a, tv_t *out) {
  tv_t attr, def = tv_none(), *items, *keys;
  size_t n, ng = 0;
  if (!arg(a, 0, "attribute", &attr)) return tpl_fail(ctx, "groupby: missing attribute");
  bool has_def = arg(a, 1, "default", &def) && def.kind != TV_NONE;
  bool cs = arg_bool(a, 2, "case_sensitive", false);
  if (!iter_copy(ctx, in, &items, &n)) return false;
  tv_t *raw = tpl_alloc(ctx, (n ? n : 1) * sizeof *raw);
  if (!raw || !(keys = tpl_alloc(ctx, (n ? n : 1) * sizeof *keys))) return false;
  for (size_t i = 0; i < n; i++) {
    tv_t k = attr_path(ctx, &items[i], &attr);
    if (k.kind == TV_UNDEF && has_def) k = def;
    if (!fold(ctx, &k, cs, &keys[i])) return false;
  }
  /* sort (item, key) pairs by key, keeping the original grouper of each item alongside */
  tv_t *pairs = tpl_alloc(ctx, (n ? n : 1) * 2 * sizeof *pairs);
  if (!pairs) return false;
  for (size_t i = 0; i < n; i++) {
    tv_t pr = tv_new_list(ctx, 2);
    if (pr.kind != TV_LIST) return false;
    pr.u.list->items[0] = items[i];
    raw[i] = attr_path(ctx, &items[i], &attr);
    if (raw[i].kind == TV_UNDEF && has_def) raw[i] = def;
    pr.u.list->items[1] = raw[i];
    pairs[i] = pr;
  }
  if (!sort_by(ctx, pairs, keys, n, false)) return false;
  tv_t *groups = tpl_alloc(ctx, (n ? n : 1) * sizeof *groups);
  if (!groups) return false;
  for (size_t i = 0; i < n;) {
    size_t j = i + 1;
    while (j < n && tv_eq(&keys[j], &keys[i])) j++;
    tv_t members = tv_new_list(ctx, j - i), g = tv_new_list(ctx, 2);
    if (members.kind != TV_LIST || g.kind != TV_LIST) return false;
    for (size_t k = i; k < j; k++) members.u.list->items[k - i] = pairs[k].u.list->items[0];
    g.flags = TV_F_TUPLE | TV_F_GROUP;
    g.u.list->items[0] = pairs[i].u.list->items[1];
    g.u.list->items[1] = members;
    groups[ng++] = g;
    i = j;
  }
  return make_list(ctx, groups, ng, out);
}

/* batch(linecount, fill_with=None) and slice(slices, fill_with=None), as lists of lists. */
static bool f_batch_slice(tctx_t *ctx, const tv_t *in, const fargs_t *a, bool is_slice, tv_t *out) {
  int64_t k;
  tv_t fill = tv_none(), *items;
  size_t n;
  const char *nm = is_slice ? "slices" : "linecount";
  if (!arg(a, 0, nm, &fill))
    return tpl_fail(ctx, "%s: missing argument '%s'", is_slice ? "slice" : "batch", nm);
  if (!arg_int(ctx, a, 0, nm, 0, &k)) return false;
  fill = tv_none();
  bool has_fill = arg(a, 1, "fill_with", &fill) && fill.kind != TV_NONE;
  if (!tv_iterate(ctx, in, &items, &n)) return false;
  if (k <= 0 && !is_slice) return tpl_fail(ctx, "batch: linecount must be positive");
  if (k <= 0 && is_slice)
    return tpl_fail(ctx,
                    k ? "slice: slices must be positive" : "integer division or modulo by zero");
  if (k > 100000) return tpl_fail(ctx, "%s: %s is too large", is_slice ? "slice" : "batch", nm);
  size_t per = is_slice ? n / (size_t)k : (size_t)k, extra = is_slice ? n % (size_t)k : 0;
  size_t nout = is_slice ? (size_t)k : (n + (size_t)k - 1) / (size_t)k;
  tv_t r = tv_new_list(ctx, nout);
  if (r.kind != TV_LIST) return false;
  size_t off = 0;
  for (size_t i = 0; i < nout; i++) {
    size_t start, end, len;
    if (is_slice) {
      start = off + i * per;
      if (i < extra) off++;
      end = off + (i + 1) * per;
    } else {
      start = i * per;
      end = start + per < n ? start + per : n;
    }
    len = end - start;
    bool pad = has_fill && (is_slice ? i >= extra : len < per);
    size_t m = is_slice ? len + pad : pad ? per : len;
    tv_t l = tv_new_list(ctx, m);
    if (l.kind != TV_LIST) return false;
    for (size_t j = 0; j < m; j++) l.u.list->items[j] = j < len ? items[start + j] : fill;
    r.u.list->items[i] = l;
  }
  *out = r;
  return true;
}

/* truncate(length=255, killwords=False, end='...', leeway=5) of Jinja 3.1. */
static bool f_truncate(tctx_t *ctx, const tv_t *in, const fargs_t *a, tv_t *out) {
  int64_t length, leeway;
  tv_t end = tv_str("...", 3), s;
  if (!arg_int(ctx, a, 0, "length", 255, &length) || !arg_int(ctx, a, 3, "leeway", 5, &leeway))
    return false;
  bool kill = arg_bool(a, 1, "killwords", false);
  if (arg(a, 2, "end", &end) && end.kind != TV_STR)
    return tpl_fail(ctx, "truncate: end must be a string, not %s", tv_type_name(&end));
  if (in->kind != TV_STR)
    return tpl_fail(ctx, "truncate: expected a string, not %s", tv_type_name(in));
  s = *in;
  int64_t endlen = (int64_t)utf8_count(end.u.str.s, end.u.str.n);
  int64_t len = (int64_t)utf8_count(s.u.str.s, s.u.str.n);
  if (length < endlen)
    return tpl_fail(ctx, "expected length >= %lld, got %lld", (long long)endlen, (long long)length);
  if (leeway < 0) return tpl_fail(ctx, "expected leeway >= 0, got %lld", (long long)leeway);
  if (len <= length + leeway) {
    *out = s;
    return true;
  }
  size_t cut = utf8_offset(s.u.str.s, s.u.str.n, (size_t)(length - endlen));
  if (!kill) {
    size_t k = cut;
    while (k > 0 && s.u.str.s[k - 1] != ' ') k--;
    if (k > 0) cut = k - 1;
  }
  *out = tv_concat_str(ctx, s.u.str.s, cut, end.u.str.s, end.u.str.n);
  return out->kind == TV_STR;
}

static const char *const k_filters[] = {
    "abs",    "attr",       "capitalize", "count",     "d",       "default", "dictsort",
    "e",      "escape",     "first",      "float",     "indent",  "int",     "items",
    "join",   "last",       "length",     "list",      "lower",   "map",     "max",
    "min",    "reject",     "rejectattr", "replace",   "reverse", "round",   "safe",
    "select", "selectattr", "sort",       "string",    "sum",     "title",   "tojson",
    "trim",   "unique",     "upper",      "wordcount", "center",  "groupby", "batch",
    "slice",  "truncate",   NULL};

bool tpl_filter_exists(const char *name) {
  for (int i = 0; k_filters[i]; i++)
    if (!strcmp(k_filters[i], name)) return true;
  return false;
}

bool tpl_apply_filter(tctx_t *ctx, const char *name, const tv_t *in, const tv_t *args, size_t nargs,
                      const char *const *kwnames, const tv_t *kwvals, size_t nkw, tv_t *out) {
  fargs_t a = {args, nargs, kwnames, kwvals, nkw};
  tv_t s, v;
  if (!strcmp(name, "batch")) return f_batch_slice(ctx, in, &a, false, out);
  if (!strcmp(name, "groupby")) return f_groupby(ctx, in, &a, out);
  switch (name[0]) {
    case 'a':
      if (!strcmp(name, "abs")) {
        if (in->kind == TV_INT) {
          if (in->u.i == INT64_MIN) return tpl_fail(ctx, "integer overflow in abs");
          *out = tv_int(in->u.i < 0 ? -in->u.i : in->u.i);
        } else if (in->kind == TV_BOOL)
          *out = tv_int(in->u.b);
        else if (in->kind == TV_FLOAT)
          *out = tv_float(fabs(in->u.f));
        else
          return tpl_fail(ctx, "bad operand type for abs(): '%s'", tv_type_name(in));
        return true;
      }
      if (!strcmp(name, "attr")) {
        if (!arg(&a, 0, "name", &v)) return tpl_fail(ctx, "attr: missing attribute name");
        /* getattr only: dict keys are not attributes */
        *out = in->kind == TV_NS && v.kind == TV_STR ? attr_path(ctx, in, &v) : tv_undef(NULL);
        return true;
      }
      break;
    case 'c':
      if (!strcmp(name, "capitalize"))
        return need_str(ctx, name, in, &s) && tpl_str_case(ctx, &s, 'c', out);
      if (!strcmp(name, "count")) goto length;
      if (!strcmp(name, "center")) {
        int64_t w;
        if (!tv_to_str(ctx, in, &s) || !arg_int(ctx, &a, 0, "width", 80, &w)) return false;
        int64_t len = (int64_t)tv_len(&s);
        if (w <= len) {
          *out = s;
          return true;
        }
        if (w > 1 << 20) return tpl_fail(ctx, "center: width too large");
        int64_t pad = w - len, left = pad / 2 + (pad & w & 1);
        kiln_strbuf_t b = KILN_STRBUF_INIT;
        for (int64_t i = 0; i < left; i++) kiln_strbuf_append_char(&b, ' ');
        kiln_strbuf_append(&b, s.u.str.s, s.u.str.n);
        for (int64_t i = 0; i < pad - left; i++) kiln_strbuf_append_char(&b, ' ');
        *out = tv_from_buf(ctx, &b);
        kiln_strbuf_free(&b);
        return out->kind == TV_STR;
      }
      break;
    case 'd':
      if (!strcmp(name, "default") || !strcmp(name, "d")) {
        tv_t def = tv_str("", 0);
        arg(&a, 0, "default_value", &def);
        bool boolean = arg_bool(&a, 1, "boolean", false);
        *out = (in->kind == TV_UNDEF || (boolean && !tv_truthy(in))) ? def : *in;
        return true;
      }
      if (!strcmp(name, "dictsort")) return f_dictsort(ctx, in, &a, out);
      break;
    case 'e':
      if (!strcmp(name, "e") || !strcmp(name, "escape")) {
        if (!tv_to_str(ctx, in, &s)) return false;
        kiln_strbuf_t b = KILN_STRBUF_INIT;
        for (size_t i = 0; i < s.u.str.n; i++) {
          char c = s.u.str.s[i];
          switch (c) {
            case '&': kiln_strbuf_append_str(&b, "&amp;"); break;
            case '<': kiln_strbuf_append_str(&b, "&lt;"); break;
            case '>': kiln_strbuf_append_str(&b, "&gt;"); break;
            case '"': kiln_strbuf_append_str(&b, "&#34;"); break;
            case '\'': kiln_strbuf_append_str(&b, "&#39;"); break;
            default: kiln_strbuf_append_char(&b, c);
          }
        }
        bool ok = kiln_strbuf_ok(&b) || tpl_oom(ctx);
        if (ok) *out = tv_from_buf(ctx, &b);
        kiln_strbuf_free(&b);
        return ok && out->kind == TV_STR;
      }
      break;
    case 'f':
      if (!strcmp(name, "first") || !strcmp(name, "last")) {
        tv_t *items;
        size_t n;
        if (!tv_iterate(ctx, in, &items, &n)) return false;
        *out = n ? items[name[0] == 'f' ? 0 : n - 1]
                 : tv_undef(name[0] == 'f' ? "No first item, sequence was empty."
                                           : "No last item, sequence was empty.");
        return true;
      }
      if (!strcmp(name, "float")) {
        double d = 0;
        tv_t def = tv_float(0.0);
        arg(&a, 0, "default", &def);
        if (in->kind == TV_FLOAT)
          *out = *in;
        else if (in->kind == TV_INT)
          *out = tv_float((double)in->u.i);
        else if (in->kind == TV_BOOL)
          *out = tv_float(in->u.b);
        else if (in->kind == TV_STR && parse_float_str(in, &d))
          *out = tv_float(d);
        else
          *out = def;
        return true;
      }
      break;
    case 'i':
      if (!strcmp(name, "indent")) return splitlines_indent(ctx, in, &a, out);
      if (!strcmp(name, "int")) {
        tv_t def = tv_int(0);
        arg(&a, 0, "default", &def);
        int64_t i;
        double d;
        if (in->kind == TV_INT)
          *out = *in;
        else if (in->kind == TV_BOOL)
          *out = tv_int(in->u.b);
        else if (in->kind == TV_FLOAT && isfinite(in->u.f) && fabs(in->u.f) < 9.2e18)
          *out = tv_int((int64_t)in->u.f);
        else if (in->kind == TV_STR && parse_int_str(in, &i))
          *out = tv_int(i);
        else if (in->kind == TV_STR && parse_float_str(in, &d) && isfinite(d) && fabs(d) < 9.2e18)
          *out = tv_int((int64_t)d);
        else
          *out = def;
        return true;
      }
      if (!strcmp(name, "items")) {
        if (in->kind == TV_UNDEF) return make_list(ctx, NULL, 0, out);
        if (in->kind != TV_DICT)
          return tpl_fail(ctx, "items: expected a mapping, got %s", tv_type_name(in));
        size_t n = tv_len(in);
        tv_t r = tv_new_list(ctx, n);
        if (r.kind != TV_LIST) return false;
        for (size_t i = 0; i < n; i++) {
          tv_t pair = tv_new_list(ctx, 2);
          if (pair.kind != TV_LIST) return false;
          pair.flags = TV_F_TUPLE;
          tv_dict_at(ctx, in, i, &pair.u.list->items[0], &pair.u.list->items[1]);
          r.u.list->items[i] = pair;
        }
        *out = r;
        return true;
      }
      break;
    case 'j':
      if (!strcmp(name, "join")) return f_join(ctx, in, &a, out);
      break;
    case 'l':
      if (!strcmp(name, "length")) {
      length:
        if (in->kind == TV_UNDEF) {
          *out = tv_int(0);
          return true;
        }
        if (in->kind != TV_STR && in->kind != TV_LIST && in->kind != TV_DICT && in->kind != TV_NS)
          return tpl_fail(ctx, "object of type '%s' has no len()", tv_type_name(in));
        *out = tv_int((int64_t)tv_len(in));
        return true;
      }
      if (!strcmp(name, "list")) {
        tv_t *items;
        size_t n;
        return iter_copy(ctx, in, &items, &n) && make_list(ctx, items, n, out);
      }
      if (!strcmp(name, "lower"))
        return need_str(ctx, name, in, &s) && tpl_str_case(ctx, &s, 'l', out);
      if (!strcmp(name, "last")) {
        tv_t *items;
        size_t n;
        if (!tv_iterate(ctx, in, &items, &n)) return false;
        *out = n ? items[n - 1] : tv_undef("No last item, sequence was empty.");
        return true;
      }
      break;
    case 'm':
      if (!strcmp(name, "map")) return f_map(ctx, in, &a, out);
      if (!strcmp(name, "max")) return f_minmax(ctx, in, &a, true, out);
      if (!strcmp(name, "min")) return f_minmax(ctx, in, &a, false, out);
      break;
    case 'r':
      if (!strcmp(name, "reject")) return f_select(ctx, in, &a, false, false, out);
      if (!strcmp(name, "rejectattr")) return f_select(ctx, in, &a, true, false, out);
      if (!strcmp(name, "replace")) {
        tv_t old, nw;
        int64_t count;
        if (!tv_to_str(ctx, in, &s)) return false;
        if (!arg(&a, 0, "old", &old) || !arg(&a, 1, "new", &nw))
          return tpl_fail(ctx, "replace: needs old and new");
        if (!tv_to_str(ctx, &old, &old) || !tv_to_str(ctx, &nw, &nw)) return false;
        if (!arg_int(ctx, &a, 2, "count", -1, &count)) return false;
        return tpl_str_replace(ctx, &s, &old, &nw, count, out);
      }
      if (!strcmp(name, "reverse")) {
        if (in->kind == TV_STR) {
          tv_t *items;
          size_t n;
          if (!tv_iterate(ctx, in, &items, &n)) return false;
          char *d = tpl_alloc(ctx, in->u.str.n + 1);
          if (!d) return false;
          size_t k = 0;
          for (size_t i = n; i-- > 0;) {
            memcpy(d + k, items[i].u.str.s, items[i].u.str.n);
            k += items[i].u.str.n;
          }
          *out = tv_str(d, k);
          return true;
        }
        tv_t *items;
        size_t n;
        if (!iter_copy(ctx, in, &items, &n)) return false;
        for (size_t i = 0; i < n / 2; i++) {
          tv_t t = items[i];
          items[i] = items[n - 1 - i];
          items[n - 1 - i] = t;
        }
        return make_list(ctx, items, n, out);
      }
      if (!strcmp(name, "round")) return f_round(ctx, in, &a, out);
      break;
    case 's':
      if (!strcmp(name, "safe")) {
        *out = *in;
        return true;
      }
      if (!strcmp(name, "select")) return f_select(ctx, in, &a, false, true, out);
      if (!strcmp(name, "selectattr")) return f_select(ctx, in, &a, true, true, out);
      if (!strcmp(name, "sort")) return f_sort(ctx, in, &a, out);
      if (!strcmp(name, "slice")) return f_batch_slice(ctx, in, &a, true, out);
      if (!strcmp(name, "string")) return tv_to_str(ctx, in, out);
      if (!strcmp(name, "sum")) {
        tv_t attr, *items, acc = tv_int(0);
        bool has_attr = arg(&a, 0, "attribute", &attr) && attr.kind != TV_NONE;
        arg(&a, 1, "start", &acc);
        size_t n;
        if (!tv_iterate(ctx, in, &items, &n)) return false;
        for (size_t i = 0; i < n; i++) {
          tv_t x = has_attr ? attr_path(ctx, &items[i], &attr) : items[i];
          bool xf = x.kind == TV_FLOAT, af = acc.kind == TV_FLOAT;
          if ((x.kind != TV_INT && x.kind != TV_BOOL && !xf) ||
              (acc.kind != TV_INT && acc.kind != TV_BOOL && !af))
            return tpl_fail(ctx, "sum: unsupported operand type(s) for +: '%s' and '%s'",
                            tv_type_name(&acc), tv_type_name(&x));
          if (xf || af) {
            double l = af ? acc.u.f : acc.kind == TV_INT ? (double)acc.u.i : acc.u.b;
            double r = xf ? x.u.f : x.kind == TV_INT ? (double)x.u.i : x.u.b;
            acc = tv_float(l + r);
          } else {
            int64_t l = acc.kind == TV_INT ? acc.u.i : acc.u.b,
                    r = x.kind == TV_INT ? x.u.i : x.u.b, res;
            if (__builtin_add_overflow(l, r, &res)) return tpl_fail(ctx, "integer overflow in sum");
            acc = tv_int(res);
          }
        }
        *out = acc;
        return true;
      }
      break;
    case 't':
      if (!strcmp(name, "tojson")) return f_tojson(ctx, in, &a, out);
      if (!strcmp(name, "truncate")) return f_truncate(ctx, in, &a, out);
      if (!strcmp(name, "trim")) {
        tv_t chars = tv_none();
        arg(&a, 0, "chars", &chars);
        return tv_to_str(ctx, in, &s) && tpl_str_strip(ctx, &s, &chars, 'b', out);
      }
      if (!strcmp(name, "title"))
        return need_str(ctx, name, in, &s) && tpl_str_case(ctx, &s, 'j', out);
      break;
    case 'u':
      if (!strcmp(name, "upper"))
        return need_str(ctx, name, in, &s) && tpl_str_case(ctx, &s, 'u', out);
      if (!strcmp(name, "unique")) return f_unique(ctx, in, &a, out);
      break;
    case 'w':
      if (!strcmp(name, "wordcount")) {
        if (!tv_to_str(ctx, in, &s)) return false;
        int64_t words = 0;
        bool inw = false;
        for (size_t i = 0; i < s.u.str.n; i++) {
          unsigned char c = (unsigned char)s.u.str.s[i];
          bool w = c >= 0x80 || c == '_' || (c >= '0' && c <= '9') ||
                   ((c | 32) >= 'a' && (c | 32) <= 'z');
          if (w && !inw) words++;
          inw = w;
        }
        *out = tv_int(words);
        return true;
      }
      break;
    default: break;
  }
  return tpl_fail(ctx, "unknown filter '%s'", name);
}

/* ---- tests ---------------------------------------------------------------------------------- */

static const char *const k_tests[] = {
    "defined",     "undefined", "none",    "boolean",  "true",     "false",    "string", "number",
    "integer",     "float",     "mapping", "iterable", "sequence", "callable", "odd",    "even",
    "divisibleby", "equalto",   "eq",      "==",       "ne",       "!=",       "lt",     "<",
    "gt",          ">",         "le",      "<=",       "ge",       ">=",       "in",     "lower",
    "upper",       "sameas",    "escaped", "filter",   "test",     NULL};

bool tpl_test_exists(const char *name) {
  for (int i = 0; k_tests[i]; i++)
    if (!strcmp(k_tests[i], name)) return true;
  return false;
}

static bool int_arg(tctx_t *ctx, const char *test, const tv_t *v, int64_t *out) {
  if (v->kind == TV_INT)
    *out = v->u.i;
  else if (v->kind == TV_BOOL)
    *out = v->u.b;
  else
    return tpl_fail(ctx, "test '%s' needs an integer, got %s", test, tv_type_name(v));
  return true;
}

bool tpl_apply_test(tctx_t *ctx, const char *name, const tv_t *in, const tv_t *args, size_t nargs,
                    bool *out) {
  int k = in->kind;
  int64_t x = 0, y = 0;
  if (!strcmp(name, "defined"))
    *out = k != TV_UNDEF;
  else if (!strcmp(name, "undefined"))
    *out = k == TV_UNDEF;
  else if (!strcmp(name, "none"))
    *out = k == TV_NONE;
  else if (!strcmp(name, "boolean"))
    *out = k == TV_BOOL;
  else if (!strcmp(name, "true"))
    *out = k == TV_BOOL && in->u.b;
  else if (!strcmp(name, "false"))
    *out = k == TV_BOOL && !in->u.b;
  else if (!strcmp(name, "string"))
    *out = k == TV_STR;
  else if (!strcmp(name, "number"))
    *out = k == TV_INT || k == TV_FLOAT || k == TV_BOOL;
  else if (!strcmp(name, "integer"))
    *out = k == TV_INT;
  else if (!strcmp(name, "float"))
    *out = k == TV_FLOAT;
  else if (!strcmp(name, "mapping"))
    *out = k == TV_DICT;
  else if (!strcmp(name, "iterable"))
    *out = tv_is_iterable(in);
  else if (!strcmp(name, "sequence"))
    *out = k == TV_STR || k == TV_LIST || k == TV_DICT;
  else if (!strcmp(name, "callable"))
    *out = k == TV_MACRO || k == TV_FUNC || k == TV_LOOP;
  else if (!strcmp(name, "escaped"))
    *out = false;
  else if (!strcmp(name, "odd") || !strcmp(name, "even")) {
    if (!int_arg(ctx, name, in, &x)) return false;
    *out = ((x % 2) != 0) == (name[0] == 'o');
  } else if (!strcmp(name, "divisibleby")) {
    if (nargs != 1) return tpl_fail(ctx, "test 'divisibleby' needs one argument");
    if (!int_arg(ctx, name, in, &x) || !int_arg(ctx, name, &args[0], &y)) return false;
    if (y == 0) return tpl_fail(ctx, "integer division or modulo by zero");
    *out = y == -1 || x % y == 0;
  } else if (!strcmp(name, "lower") || !strcmp(name, "upper")) {
    /* str.islower(): has a cased character and none of the other case */
    tv_t s;
    if (!tv_to_str(ctx, in, &s)) return false;
    bool any = false, bad = false;
    for (size_t i = 0; i < s.u.str.n; i++) {
      char c = s.u.str.s[i];
      bool lo = c >= 'a' && c <= 'z', up = c >= 'A' && c <= 'Z';
      if (lo || up) any = true;
      if ((name[0] == 'l' && up) || (name[0] == 'u' && lo)) bad = true;
    }
    *out = any && !bad;
  } else if (!strcmp(name, "filter") || !strcmp(name, "test")) {
    if (k != TV_STR || in->u.str.n >= 64) {
      *out = false;
      return true;
    }
    char nm[64];
    memcpy(nm, in->u.str.s, in->u.str.n);
    nm[in->u.str.n] = '\0';
    *out = name[0] == 'f' ? tpl_filter_exists(nm) : tpl_test_exists(nm);
  } else {
    int op = -1;
    static const struct {
      const char *n;
      int op;
    } cmp[] = {{"equalto", CMP_EQ}, {"eq", CMP_EQ}, {"==", CMP_EQ}, {"sameas", CMP_EQ},
               {"ne", CMP_NE},      {"!=", CMP_NE}, {"lt", CMP_LT}, {"<", CMP_LT},
               {"gt", CMP_GT},      {">", CMP_GT},  {"le", CMP_LE}, {"<=", CMP_LE},
               {"ge", CMP_GE},      {">=", CMP_GE}, {"in", CMP_IN}};
    for (size_t i = 0; i < sizeof cmp / sizeof *cmp; i++)
      if (!strcmp(cmp[i].n, name)) op = cmp[i].op;
    if (op < 0) return tpl_fail(ctx, "unknown test '%s'", name);
    if (nargs != 1) return tpl_fail(ctx, "test '%s' needs one argument", name);
    const tv_t *b = &args[0];
    if (!strcmp(name, "sameas")) {
      bool scalar = k == TV_NONE || k == TV_BOOL || k == TV_UNDEF;
      *out = scalar ? (b->kind == k && (k != TV_BOOL || b->u.b == in->u.b)) : tv_eq(in, b);
      return true;
    }
    int c;
    switch (op) {
      case CMP_EQ: *out = tv_eq(in, b); break;
      case CMP_NE: *out = !tv_eq(in, b); break;
      case CMP_IN: {
        if (b->kind == TV_STR) {
          if (k != TV_STR)
            return tpl_fail(ctx, "'in <string>' requires string as left operand, not %s",
                            tv_type_name(in));
          *out = false;
          for (size_t i = 0; !*out && in->u.str.n <= b->u.str.n && i <= b->u.str.n - in->u.str.n;
               i++)
            *out = memcmp(b->u.str.s + i, in->u.str.s, in->u.str.n) == 0;
        } else if (b->kind == TV_LIST) {
          *out = false;
          for (size_t i = 0; i < b->u.list->n && !*out; i++) {
            tv_t e = tv_list_get(ctx, b, i);
            *out = tv_eq(&e, in);
          }
        } else if (b->kind == TV_DICT) {
          tv_t tmp;
          *out = tv_dict_get(ctx, b, in, &tmp);
        } else if (b->kind == TV_UNDEF) {
          *out = false;
        } else {
          return tpl_fail(ctx, "argument of type '%s' is not iterable", tv_type_name(b));
        }
        break;
      }
      default:
        if (!tv_cmp(ctx, in, b, &c)) return false;
        *out = op == CMP_LT ? c < 0 : op == CMP_LE ? c <= 0 : op == CMP_GT ? c > 0 : c >= 0;
    }
  }
  return true;
}
