/* jinja_value.c - Python value semantics for the Jinja interpreter: the arena values live in,
 * truthiness, equality and ordering, str()/repr(), JSON conversion both ways (json.dumps
 * formatting included) and UTF-8 code point helpers. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "models/template/template_internal.h"

/* ---- UTF-8 ---------------------------------------------------------------------------------- */

size_t utf8_count(const char *s, size_t n) {
  size_t c = 0;
  for (size_t i = 0; i < n; i++)
    if (((unsigned char)s[i] & 0xC0) != 0x80) c++;
  return c;
}

size_t utf8_next(const char *s, size_t n, size_t pos) {
  if (pos >= n) return n;
  pos++;
  while (pos < n && ((unsigned char)s[pos] & 0xC0) == 0x80) pos++;
  return pos;
}

size_t utf8_offset(const char *s, size_t n, size_t cp_index) {
  size_t pos = 0;
  while (cp_index > 0 && pos < n) {
    pos = utf8_next(s, n, pos);
    cp_index--;
  }
  return pos;
}

uint32_t utf8_decode_at(const char *s, size_t n, size_t pos, size_t *out_next) {
  utf8proc_int32_t cp = 0;
  utf8proc_ssize_t k =
      utf8proc_iterate((const utf8proc_uint8_t *)s + pos, (utf8proc_ssize_t)(n - pos), &cp);
  if (k <= 0) {
    *out_next = pos + 1;
    return 0xFFFD;
  }
  *out_next = pos + (size_t)k;
  return (uint32_t)cp;
}

bool tpl_is_space_cp(uint32_t cp) {
  /* Python's str.isspace(): the Unicode White_Space characters plus \x1c-\x1f. */
  if (cp == ' ' || (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x1F)) return true;
  if (cp < 0x80) return false;
  return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
         cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

/* ---- basics --------------------------------------------------------------------------------- */

const char *tv_type_name(const tv_t *v) {
  switch (v->kind) {
    case TV_UNDEF: return "Undefined";
    case TV_NONE: return "NoneType";
    case TV_BOOL: return "bool";
    case TV_INT: return "int";
    case TV_FLOAT: return "float";
    case TV_STR: return "str";
    case TV_LIST: return (v->flags & TV_F_TUPLE) ? "tuple" : "list";
    case TV_DICT: return "dict";
    case TV_NS: return "Namespace";
    case TV_MACRO: return "Macro";
    case TV_FUNC: return "function";
    case TV_LOOP: return "LoopContext";
    case TV_CYCLER: return "Cycler";
    case TV_JOINER: return "Joiner";
  }
  return "object";
}

size_t tv_len(const tv_t *v) {
  switch (v->kind) {
    case TV_STR: return utf8_count(v->u.str.s, v->u.str.n);
    case TV_LIST: return v->u.list->n;
    case TV_DICT:
    case TV_NS: return v->u.dict->json ? kiln_json_len(v->u.dict->json) : v->u.dict->n;
    default: return 0;
  }
}

bool tv_truthy(const tv_t *v) {
  switch (v->kind) {
    case TV_UNDEF:
    case TV_NONE: return false;
    case TV_BOOL: return v->u.b;
    case TV_INT: return v->u.i != 0;
    case TV_FLOAT: return v->u.f != 0.0;
    case TV_STR: return v->u.str.n != 0;
    case TV_LIST:
    case TV_DICT: return tv_len(v) != 0;
    default: return true;
  }
}

bool tv_is_seq(const tv_t *v) { return v->kind == TV_LIST; }

bool tv_is_iterable(const tv_t *v) {
  return v->kind == TV_LIST || v->kind == TV_DICT || v->kind == TV_STR || v->kind == TV_UNDEF ||
         v->kind == TV_LOOP;
}

void *tpl_alloc(tctx_t *ctx, size_t n) {
  void *p = kiln_arena_zalloc(&ctx->arena, n, KILN_ARENA_MAX_ALIGN);
  if (!p) tpl_oom(ctx);
  return p;
}

tv_t tv_new_list(tctx_t *ctx, size_t n) {
  tv_t v = {TV_LIST, 0, {.list = NULL}};
  tlist_t *l = tpl_alloc(ctx, sizeof *l);
  if (!l) return tv_undef(NULL);
  l->n = n;
  l->items = tpl_alloc(ctx, (n ? n : 1) * sizeof *l->items);
  if (!l->items) return tv_undef(NULL);
  v.u.list = l;
  return v;
}

tv_t tv_new_dict(tctx_t *ctx) {
  tv_t v = {TV_DICT, 0, {.dict = NULL}};
  v.u.dict = tpl_alloc(ctx, sizeof(tdict_t));
  if (!v.u.dict) return tv_undef(NULL);
  return v;
}

tv_t tv_from_json(tctx_t *ctx, const kiln_json_t *j) {
  switch (kiln_json_type(j)) {
    case KILN_JSON_NULL: return tv_none();
    case KILN_JSON_BOOL: return tv_bool(kiln_json_bool(j));
    case KILN_JSON_NUMBER: {
      int64_t i;
      /* "1.0" stays a float, as Python's json.loads keeps it: tojson must print it back. */
      if (kiln_json_number_is_int(j) && kiln_json_int64(j, &i)) return tv_int(i);
      return tv_float(kiln_json_number(j));
    }
    case KILN_JSON_STRING: {
      size_t n = 0;
      const char *s = kiln_json_string(j, &n);
      return tv_str(s, n);
    }
    case KILN_JSON_ARRAY: {
      tlist_t *l = tpl_alloc(ctx, sizeof *l);
      if (!l) return tv_undef(NULL);
      l->n = kiln_json_len(j);
      l->json = j;
      tv_t v = {TV_LIST, 0, {.list = l}};
      return v;
    }
    case KILN_JSON_OBJECT: {
      tdict_t *d = tpl_alloc(ctx, sizeof *d);
      if (!d) return tv_undef(NULL);
      d->json = j;
      tv_t v = {TV_DICT, 0, {.dict = d}};
      return v;
    }
  }
  return tv_none();
}

tv_t tv_list_get(tctx_t *ctx, const tv_t *list, size_t i) {
  tlist_t *l = list->u.list;
  if (i >= l->n) return tv_undef(NULL);
  if (l->items) return l->items[i];
  return tv_from_json(ctx, kiln_json_at(l->json, i));
}

bool tv_dict_get_str(tctx_t *ctx, const tv_t *dict, const char *key, size_t n, tv_t *out) {
  tdict_t *d = dict->u.dict;
  if (d->json) {
    const kiln_json_t *m = kiln_json_getn(d->json, key, n);
    if (!m) return false;
    *out = tv_from_json(ctx, m);
    return true;
  }
  for (size_t i = d->n; i-- > 0;) {
    const tv_t *k = &d->keys[i];
    if (k->kind == TV_STR && k->u.str.n == n && memcmp(k->u.str.s, key, n) == 0) {
      *out = d->vals[i];
      return true;
    }
  }
  return false;
}

bool tv_dict_get(tctx_t *ctx, const tv_t *dict, const tv_t *key, tv_t *out) {
  if (key->kind == TV_STR) return tv_dict_get_str(ctx, dict, key->u.str.s, key->u.str.n, out);
  tdict_t *d = dict->u.dict;
  if (d->json) return false;
  for (size_t i = 0; i < d->n; i++)
    if (tv_eq(&d->keys[i], key)) {
      *out = d->vals[i];
      return true;
    }
  return false;
}

void tv_dict_at(tctx_t *ctx, const tv_t *dict, size_t i, tv_t *out_key, tv_t *out_val) {
  tdict_t *d = dict->u.dict;
  if (d->json) {
    size_t kn = 0;
    const char *k = kiln_json_key_at(d->json, i, &kn);
    *out_key = tv_str(k, kn);
    *out_val = tv_from_json(ctx, kiln_json_value_at(d->json, i));
    return;
  }
  *out_key = d->keys[i];
  *out_val = d->vals[i];
}

bool tv_dict_set(tctx_t *ctx, tv_t *dict, tv_t key, tv_t val) {
  tdict_t *d = dict->u.dict;
  if (d->json) return tpl_fail(ctx, "cannot modify a read-only mapping");
  for (size_t i = 0; i < d->n; i++)
    if (tv_eq(&d->keys[i], &key)) {
      d->vals[i] = val;
      return true;
    }
  if (d->n == d->cap) {
    size_t cap = d->cap ? d->cap * 2 : 4;
    tv_t *k = tpl_alloc(ctx, cap * sizeof *k), *v = tpl_alloc(ctx, cap * sizeof *v);
    if (!k || !v) return false;
    if (d->n) {
      memcpy(k, d->keys, d->n * sizeof *k);
      memcpy(v, d->vals, d->n * sizeof *v);
    }
    d->keys = k;
    d->vals = v;
    d->cap = cap;
  }
  d->keys[d->n] = key;
  d->vals[d->n] = val;
  d->n++;
  return true;
}

bool tv_iterate(tctx_t *ctx, const tv_t *v, tv_t **out_items, size_t *out_n) {
  *out_items = NULL;
  *out_n = 0;
  size_t n;
  tv_t *items;
  switch (v->kind) {
    case TV_UNDEF: return true;
    case TV_LIST:
      n = v->u.list->n;
      if (v->u.list->items) {
        *out_items = v->u.list->items;
        *out_n = n;
        return true;
      }
      if (!(items = tpl_alloc(ctx, (n ? n : 1) * sizeof *items))) return false;
      for (size_t i = 0; i < n; i++) items[i] = tv_list_get(ctx, v, i);
      break;
    case TV_DICT:
    case TV_NS:
      n = tv_len(v);
      if (!(items = tpl_alloc(ctx, (n ? n : 1) * sizeof *items))) return false;
      for (size_t i = 0; i < n; i++) {
        tv_t val;
        tv_dict_at(ctx, v, i, &items[i], &val);
      }
      break;
    case TV_STR: {
      const char *s = v->u.str.s;
      size_t len = v->u.str.n;
      n = utf8_count(s, len);
      if (!(items = tpl_alloc(ctx, (n ? n : 1) * sizeof *items))) return false;
      size_t pos = 0;
      for (size_t i = 0; i < n; i++) {
        size_t nx = utf8_next(s, len, pos);
        items[i] = tv_str(s + pos, nx - pos);
        pos = nx;
      }
      break;
    }
    default: return tpl_fail(ctx, "'%s' object is not iterable", tv_type_name(v));
  }
  *out_items = items;
  *out_n = n;
  return true;
}

/* ---- comparison ----------------------------------------------------------------------------- */

static bool is_num(const tv_t *v) {
  return v->kind == TV_BOOL || v->kind == TV_INT || v->kind == TV_FLOAT;
}
static double num_f(const tv_t *v) {
  return v->kind == TV_FLOAT ? v->u.f : v->kind == TV_INT ? (double)v->u.i : (double)v->u.b;
}
static int64_t num_i(const tv_t *v) { return v->kind == TV_INT ? v->u.i : (int64_t)v->u.b; }

/* A JSON node as a value without allocating: containers are wrapped in caller storage. */
static tv_t json_wrap(const kiln_json_t *j, tlist_t *tl, tdict_t *td) {
  switch (kiln_json_type(j)) {
    case KILN_JSON_ARRAY:
      memset(tl, 0, sizeof *tl);
      tl->n = kiln_json_len(j);
      tl->json = j;
      return (tv_t){TV_LIST, 0, {.list = tl}};
    case KILN_JSON_OBJECT:
      memset(td, 0, sizeof *td);
      td->json = j;
      return (tv_t){TV_DICT, 0, {.dict = td}};
    default: return tv_from_json(NULL, j); /* scalars never allocate */
  }
}

static tv_t elem_at(const tv_t *l, size_t i, tlist_t *tl, tdict_t *td) {
  if (l->u.list->items) return l->u.list->items[i];
  return json_wrap(kiln_json_at(l->u.list->json, i), tl, td);
}

static tv_t member_at(const tv_t *d, size_t i, tv_t *out_key, tlist_t *tl, tdict_t *td) {
  const tdict_t *dd = d->u.dict;
  if (!dd->json) {
    *out_key = dd->keys[i];
    return dd->vals[i];
  }
  size_t kn = 0;
  const char *k = kiln_json_key_at(dd->json, i, &kn);
  *out_key = tv_str(k, kn);
  return json_wrap(kiln_json_value_at(dd->json, i), tl, td);
}

/* d[key] without allocating; false when absent. */
static bool lookup_noalloc(const tv_t *d, const tv_t *key, tv_t *out, tlist_t *tl, tdict_t *td) {
  const tdict_t *dd = d->u.dict;
  if (dd->json) {
    if (key->kind != TV_STR) return false;
    const kiln_json_t *m = kiln_json_getn(dd->json, key->u.str.s, key->u.str.n);
    if (!m) return false;
    *out = json_wrap(m, tl, td);
    return true;
  }
  for (size_t i = dd->n; i-- > 0;)
    if (tv_eq(&dd->keys[i], key)) {
      *out = dd->vals[i];
      return true;
    }
  return false;
}

bool tv_eq(const tv_t *a, const tv_t *b) {
  if (is_num(a) && is_num(b)) {
    if (a->kind == TV_FLOAT || b->kind == TV_FLOAT) return num_f(a) == num_f(b);
    return num_i(a) == num_i(b);
  }
  if (a->kind != b->kind) return false;
  switch (a->kind) {
    case TV_UNDEF:
    case TV_NONE: return true;
    case TV_STR: return a->u.str.n == b->u.str.n && memcmp(a->u.str.s, b->u.str.s, a->u.str.n) == 0;
    case TV_LIST:
      if ((a->flags & TV_F_TUPLE) != (b->flags & TV_F_TUPLE) || a->u.list->n != b->u.list->n)
        return false;
      for (size_t i = 0; i < a->u.list->n; i++) {
        tlist_t l1, l2;
        tdict_t d1, d2;
        tv_t x = elem_at(a, i, &l1, &d1), y = elem_at(b, i, &l2, &d2);
        if (!tv_eq(&x, &y)) return false;
      }
      return true;
    case TV_DICT: {
      if (a->u.dict == b->u.dict) return true;
      size_t n = tv_len(a);
      if (n != tv_len(b)) return false;
      for (size_t i = 0; i < n; i++) {
        tlist_t l1, l2;
        tdict_t d1, d2;
        tv_t k, y;
        tv_t x = member_at(a, i, &k, &l1, &d1);
        if (!lookup_noalloc(b, &k, &y, &l2, &d2) || !tv_eq(&x, &y)) return false;
      }
      return true;
    }
    case TV_NS: return a->u.dict == b->u.dict;
    case TV_MACRO: return a->u.macro == b->u.macro;
    case TV_FUNC: return a->u.func == b->u.func;
    case TV_LOOP: return a->u.loop == b->u.loop;
    default: return a->u.list == b->u.list;
  }
}

bool tv_cmp(tctx_t *ctx, const tv_t *a, const tv_t *b, int *out_cmp) {
  if (is_num(a) && is_num(b)) {
    if (a->kind == TV_FLOAT || b->kind == TV_FLOAT) {
      double x = num_f(a), y = num_f(b);
      *out_cmp = x < y ? -1 : x > y ? 1 : 0;
    } else {
      int64_t x = num_i(a), y = num_i(b);
      *out_cmp = x < y ? -1 : x > y ? 1 : 0;
    }
    return true;
  }
  if (a->kind == TV_STR && b->kind == TV_STR) {
    size_t n = a->u.str.n < b->u.str.n ? a->u.str.n : b->u.str.n;
    int c = n ? memcmp(a->u.str.s, b->u.str.s, n) : 0;
    if (c == 0) c = a->u.str.n < b->u.str.n ? -1 : a->u.str.n > b->u.str.n ? 1 : 0;
    *out_cmp = c < 0 ? -1 : c > 0 ? 1 : 0;
    return true;
  }
  if (a->kind == TV_LIST && b->kind == TV_LIST &&
      (a->flags & TV_F_TUPLE) == (b->flags & TV_F_TUPLE)) {
    size_t na = a->u.list->n, nb = b->u.list->n;
    for (size_t i = 0; i < na && i < nb; i++) {
      tv_t x = tv_list_get(ctx, a, i), y = tv_list_get(ctx, b, i);
      if (tv_eq(&x, &y)) continue;
      return tv_cmp(ctx, &x, &y, out_cmp);
    }
    *out_cmp = na < nb ? -1 : na > nb ? 1 : 0;
    return true;
  }
  return tpl_fail(ctx, "'<' not supported between instances of '%s' and '%s'", tv_type_name(a),
                  tv_type_name(b));
}

/* ---- str() and repr() ----------------------------------------------------------------------- */

bool tv_write_float(kiln_strbuf_t *out, double x) {
  if (isnan(x)) return kiln_strbuf_append_str(out, "nan");
  if (isinf(x)) return kiln_strbuf_append_str(out, x < 0 ? "-inf" : "inf");
  if (x == 0) return kiln_strbuf_append_str(out, signbit(x) ? "-0.0" : "0.0");
  char buf[64];
  int prec;
  for (prec = 1; prec <= 17; prec++) {
    snprintf(buf, sizeof buf, "%.*e", prec - 1, x);
    if (strtod(buf, NULL) == x) break;
  }
  /* buf: [-]d[.ddd]e[+-]XX -> digits and decimal exponent */
  char digits[32];
  int nd = 0, exp10 = 0;
  bool neg = buf[0] == '-';
  const char *p = buf + (neg ? 1 : 0);
  for (; *p && *p != 'e'; p++)
    if (*p >= '0' && *p <= '9') digits[nd++] = *p;
  if (*p == 'e') exp10 = atoi(p + 1);
  while (nd > 1 && digits[nd - 1] == '0') nd--;
  digits[nd] = '\0';
  kiln_strbuf_t *o = out;
  if (neg) kiln_strbuf_append_char(o, '-');
  if (exp10 < -4 || exp10 >= 16) {
    kiln_strbuf_append_char(o, digits[0]);
    if (nd > 1) {
      kiln_strbuf_append_char(o, '.');
      kiln_strbuf_append(o, digits + 1, (size_t)nd - 1);
    }
    return kiln_strbuf_printf(o, "e%c%02d", exp10 < 0 ? '-' : '+', exp10 < 0 ? -exp10 : exp10);
  }
  if (exp10 < 0) {
    kiln_strbuf_append_str(o, "0.");
    for (int i = 0; i < -exp10 - 1; i++) kiln_strbuf_append_char(o, '0');
    return kiln_strbuf_append(o, digits, (size_t)nd);
  }
  int intdigits = exp10 + 1;
  for (int i = 0; i < intdigits; i++) kiln_strbuf_append_char(o, i < nd ? digits[i] : '0');
  kiln_strbuf_append_char(o, '.');
  if (nd > intdigits) return kiln_strbuf_append(o, digits + intdigits, (size_t)(nd - intdigits));
  return kiln_strbuf_append_char(o, '0');
}

static bool cp_printable(uint32_t cp) {
  if (cp == ' ') return true;
  if (cp < 0x20 || cp == 0x7F) return false;
  if (cp < 0x7F) return true;
  switch (utf8proc_category((utf8proc_int32_t)cp)) {
    case UTF8PROC_CATEGORY_CC:
    case UTF8PROC_CATEGORY_CF:
    case UTF8PROC_CATEGORY_CS:
    case UTF8PROC_CATEGORY_CO:
    case UTF8PROC_CATEGORY_CN:
    case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP:
    case UTF8PROC_CATEGORY_ZS: return false;
    default: return true;
  }
}

static bool write_str_repr(kiln_strbuf_t *out, const char *s, size_t n) {
  bool has_sq = memchr(s, '\'', n) != NULL, has_dq = memchr(s, '"', n) != NULL;
  char q = (has_sq && !has_dq) ? '"' : '\'';
  kiln_strbuf_append_char(out, q);
  size_t pos = 0;
  while (pos < n) {
    size_t next;
    uint32_t cp = utf8_decode_at(s, n, pos, &next);
    if (cp == (uint32_t)q || cp == '\\') {
      kiln_strbuf_append_char(out, '\\');
      kiln_strbuf_append_char(out, (char)cp);
    } else if (cp == '\n') {
      kiln_strbuf_append_str(out, "\\n");
    } else if (cp == '\r') {
      kiln_strbuf_append_str(out, "\\r");
    } else if (cp == '\t') {
      kiln_strbuf_append_str(out, "\\t");
    } else if (cp_printable(cp)) {
      kiln_strbuf_append(out, s + pos, next - pos);
    } else if (cp < 0x100) {
      kiln_strbuf_printf(out, "\\x%02x", cp);
    } else if (cp < 0x10000) {
      kiln_strbuf_printf(out, "\\u%04x", cp);
    } else {
      kiln_strbuf_printf(out, "\\U%08x", cp);
    }
    pos = next;
  }
  return kiln_strbuf_append_char(out, q);
}

static bool write_container(tctx_t *ctx, kiln_strbuf_t *out, const tv_t *v) {
  if (++ctx->depth > 200) {
    ctx->depth--;
    return tpl_fail(ctx, "value nested too deeply to print");
  }
  bool ok = true;
  if (v->kind == TV_LIST) {
    bool tuple = v->flags & TV_F_TUPLE;
    size_t n = v->u.list->n;
    kiln_strbuf_append_char(out, tuple ? '(' : '[');
    for (size_t i = 0; i < n && ok; i++) {
      if (i) kiln_strbuf_append_str(out, ", ");
      tv_t x = tv_list_get(ctx, v, i);
      ok = tv_write_repr(ctx, out, &x);
    }
    if (tuple && n == 1) kiln_strbuf_append_char(out, ',');
    kiln_strbuf_append_char(out, tuple ? ')' : ']');
  } else {
    if (v->kind == TV_NS) kiln_strbuf_append_str(out, "<Namespace ");
    kiln_strbuf_append_char(out, '{');
    size_t n = tv_len(v);
    for (size_t i = 0; i < n && ok; i++) {
      tv_t k, x;
      tv_dict_at(ctx, v, i, &k, &x);
      if (i) kiln_strbuf_append_str(out, ", ");
      ok = tv_write_repr(ctx, out, &k);
      kiln_strbuf_append_str(out, ": ");
      if (ok) ok = tv_write_repr(ctx, out, &x);
    }
    kiln_strbuf_append_char(out, '}');
    if (v->kind == TV_NS) kiln_strbuf_append_char(out, '>');
  }
  ctx->depth--;
  return ok && (kiln_strbuf_ok(out) || tpl_oom(ctx));
}

bool tv_write_str(tctx_t *ctx, kiln_strbuf_t *out, const tv_t *v) {
  bool ok = true;
  switch (v->kind) {
    case TV_UNDEF: return true;
    case TV_NONE: ok = kiln_strbuf_append_str(out, "None"); break;
    case TV_BOOL: ok = kiln_strbuf_append_str(out, v->u.b ? "True" : "False"); break;
    case TV_INT: ok = kiln_strbuf_printf(out, "%lld", (long long)v->u.i); break;
    case TV_FLOAT: ok = tv_write_float(out, v->u.f); break;
    case TV_STR: ok = kiln_strbuf_append(out, v->u.str.s, v->u.str.n); break;
    case TV_LIST:
    case TV_DICT:
    case TV_NS: return write_container(ctx, out, v);
    case TV_MACRO: ok = kiln_strbuf_printf(out, "<Macro '%s'>", v->u.macro->def->name); break;
    case TV_LOOP:
      ok = kiln_strbuf_printf(out, "<LoopContext %lld/%lld>", (long long)(v->u.loop->index0 + 1),
                              (long long)v->u.loop->length);
      break;
    default: ok = kiln_strbuf_printf(out, "<%s object>", tv_type_name(v)); break;
  }
  return ok || tpl_oom(ctx);
}

bool tv_write_repr(tctx_t *ctx, kiln_strbuf_t *out, const tv_t *v) {
  if (v->kind == TV_STR) return write_str_repr(out, v->u.str.s, v->u.str.n) || tpl_oom(ctx);
  if (v->kind == TV_UNDEF) return kiln_strbuf_append_str(out, "Undefined") || tpl_oom(ctx);
  return tv_write_str(ctx, out, v);
}

tv_t tv_concat_str(tctx_t *ctx, const char *a, size_t an, const char *b, size_t bn) {
  if (an > SIZE_MAX / 2 || bn > SIZE_MAX / 2) return tv_undef(NULL);
  char *d = kiln_arena_zalloc(&ctx->arena, an + bn + 1, KILN_ARENA_MAX_ALIGN);
  if (!d) {
    tpl_oom(ctx);
    return tv_undef(NULL);
  }
  if (an) memcpy(d, a, an);
  if (bn) memcpy(d + an, b, bn);
  d[an + bn] = '\0';
  return tv_str(d, an + bn);
}

tv_t tv_from_buf(tctx_t *ctx, const kiln_strbuf_t *b) {
  return tv_concat_str(ctx, b->data ? b->data : "", b->len, "", 0);
}

bool tv_to_str(tctx_t *ctx, const tv_t *v, tv_t *out) {
  if (v->kind == TV_STR) {
    *out = *v;
    return true;
  }
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  bool ok = tv_write_str(ctx, &b, v);
  if (ok && !kiln_strbuf_ok(&b)) ok = tpl_oom(ctx);
  if (ok) {
    *out = tv_from_buf(ctx, &b);
    ok = out->kind == TV_STR;
  }
  kiln_strbuf_free(&b);
  return ok;
}

/* ---- json.dumps ----------------------------------------------------------------------------- */

static void json_newline(kiln_strbuf_t *out, const tjson_opts_t *o, int level) {
  kiln_strbuf_append_char(out, '\n');
  for (int i = 0; i < level * o->indent; i++) kiln_strbuf_append_char(out, ' ');
}

/* A dict key as json.dumps converts it (str as is; int, float, bool, None to text). */
static bool json_key(tctx_t *ctx, const tv_t *k, tv_t *out) {
  switch (k->kind) {
    case TV_STR: *out = *k; return true;
    case TV_BOOL: *out = tv_str(k->u.b ? "true" : "false", k->u.b ? 4 : 5); return true;
    case TV_NONE: *out = tv_str("null", 4); return true;
    case TV_INT:
    case TV_FLOAT: return tv_to_str(ctx, k, out);
    default:
      return tpl_fail(ctx, "tojson: keys must be str, int, float, bool or None, not %s",
                      tv_type_name(k));
  }
}

typedef struct jpair {
  tv_t k, v;
} jpair_t;

static int jpair_cmp(const void *a, const void *b) {
  const tv_t *x = &((const jpair_t *)a)->k, *y = &((const jpair_t *)b)->k;
  size_t n = x->u.str.n < y->u.str.n ? x->u.str.n : y->u.str.n;
  int c = n ? memcmp(x->u.str.s, y->u.str.s, n) : 0;
  if (c) return c;
  return x->u.str.n < y->u.str.n ? -1 : x->u.str.n > y->u.str.n;
}

static bool json_rec(tctx_t *ctx, kiln_strbuf_t *out, const tv_t *v, const tjson_opts_t *o,
                     int level) {
  switch (v->kind) {
    case TV_NONE: return kiln_strbuf_append_str(out, "null");
    case TV_BOOL: return kiln_strbuf_append_str(out, v->u.b ? "true" : "false");
    case TV_INT: return kiln_strbuf_printf(out, "%lld", (long long)v->u.i);
    case TV_FLOAT:
      if (isnan(v->u.f)) return kiln_strbuf_append_str(out, "NaN");
      if (isinf(v->u.f)) return kiln_strbuf_append_str(out, v->u.f < 0 ? "-Infinity" : "Infinity");
      return tv_write_float(out, v->u.f);
    case TV_STR: return kiln_json_write_string(out, v->u.str.s, v->u.str.n, o->ensure_ascii);
    case TV_LIST:
    case TV_DICT: break;
    default:
      return tpl_fail(ctx, "tojson: Object of type %s is not JSON serializable", tv_type_name(v));
  }
  if (level > 200) return tpl_fail(ctx, "tojson: value nested too deeply");
  bool is_list = v->kind == TV_LIST;
  size_t n = tv_len(v);
  if (n == 0) return kiln_strbuf_append_str(out, is_list ? "[]" : "{}");
  kiln_strbuf_append_char(out, is_list ? '[' : '{');
  jpair_t *pairs = NULL;
  if (!is_list) {
    if (!(pairs = tpl_alloc(ctx, n * sizeof *pairs))) return false;
    for (size_t i = 0; i < n; i++) {
      tv_t k;
      tv_dict_at(ctx, v, i, &k, &pairs[i].v);
      if (!json_key(ctx, &k, &pairs[i].k)) return false;
    }
    if (o->sort_keys) qsort(pairs, n, sizeof *pairs, jpair_cmp);
  }
  for (size_t i = 0; i < n; i++) {
    if (i) kiln_strbuf_append_str(out, o->item_sep);
    if (o->indent >= 0) json_newline(out, o, level + 1);
    if (is_list) {
      tv_t x = tv_list_get(ctx, v, i);
      if (!json_rec(ctx, out, &x, o, level + 1)) return false;
    } else {
      kiln_json_write_string(out, pairs[i].k.u.str.s, pairs[i].k.u.str.n, o->ensure_ascii);
      kiln_strbuf_append_str(out, o->key_sep);
      if (!json_rec(ctx, out, &pairs[i].v, o, level + 1)) return false;
    }
  }
  if (o->indent >= 0) json_newline(out, o, level);
  return kiln_strbuf_append_char(out, is_list ? ']' : '}');
}

bool tv_write_json(tctx_t *ctx, kiln_strbuf_t *out, const tv_t *v, const tjson_opts_t *o) {
  if (!json_rec(ctx, out, v, o, 0)) return ctx->err ? false : tpl_oom(ctx);
  return kiln_strbuf_ok(out) || tpl_oom(ctx);
}
