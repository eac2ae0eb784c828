/* jinja_eval.c - the evaluator: expressions to values and statements to output, with Jinja2's
 * scoping (a for loop body gets a fresh scope per iteration, so `set` inside a loop never leaks
 * out; macros see their defining scope at call time; `if` shares its enclosing scope) and
 * Python operator semantics. */
#define _POSIX_C_SOURCE 200809L
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "models/template/template_internal.h"

typedef enum xres { X_OK, X_ERR, X_BREAK, X_CONTINUE } xres_t;

static xres_t exec_body(tctx_t *ctx, tnode_t *const *body, size_t n, tscope_t *sc);
static bool out_limit(tctx_t *ctx);

/* ---- scopes --------------------------------------------------------------------------------- */

static tscope_t *scope_new(tctx_t *ctx, tscope_t *parent) {
  tscope_t *s = tpl_alloc(ctx, sizeof *s);
  if (s) s->parent = parent;
  return s;
}

static bool scope_set(tctx_t *ctx, tscope_t *sc, const char *name, size_t n, tv_t v) {
  for (size_t i = 0; i < sc->n; i++)
    if (sc->lens[i] == n && memcmp(sc->names[i], name, n) == 0) {
      sc->vals[i] = v;
      return true;
    }
  if (sc->n == sc->cap) {
    size_t cap = sc->cap ? sc->cap * 2 : 4;
    const char **names = tpl_alloc(ctx, cap * sizeof *names);
    size_t *lens = tpl_alloc(ctx, cap * sizeof *lens);
    tv_t *vals = tpl_alloc(ctx, cap * sizeof *vals);
    if (!names || !lens || !vals) return false;
    if (sc->n) {
      memcpy(names, sc->names, sc->n * sizeof *names);
      memcpy(lens, sc->lens, sc->n * sizeof *lens);
      memcpy(vals, sc->vals, sc->n * sizeof *vals);
    }
    sc->names = names;
    sc->lens = lens;
    sc->vals = vals;
    sc->cap = cap;
  }
  sc->names[sc->n] = name;
  sc->lens[sc->n] = n;
  sc->vals[sc->n] = v;
  sc->n++;
  return true;
}

static bool scope_get(const tscope_t *sc, const char *name, size_t n, tv_t *out) {
  for (; sc; sc = sc->parent)
    for (size_t i = sc->n; i-- > 0;)
      if (sc->lens[i] == n && memcmp(sc->names[i], name, n) == 0) {
        *out = sc->vals[i];
        return true;
      }
  return false;
}

bool tpl_scope_set(tctx_t *ctx, tscope_t *sc, const char *name, tv_t v) {
  return scope_set(ctx, sc, name, strlen(name), v);
}
tscope_t *tpl_scope_new(tctx_t *ctx, tscope_t *parent) { return scope_new(ctx, parent); }

/* ---- undefined ------------------------------------------------------------------------------ */

static tv_t undef_fmt(tctx_t *ctx, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static tv_t undef_fmt(tctx_t *ctx, const char *fmt, ...) {
  char buf[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return tv_undef(kiln_arena_strndup(&ctx->arena, buf, strlen(buf)));
}

static const char *obj_desc(const tv_t *v, char *buf, size_t cap) {
  if (v->kind == TV_NONE) return "None";
  snprintf(buf, cap, "%s object", tv_type_name(v));
  return buf;
}

/* The error for using an undefined value. */
static bool undef_fail(tctx_t *ctx, const tv_t *v) {
  return tpl_fail(ctx, "%s", v->u.undef ? v->u.undef : "value is undefined");
}

/* ---- attribute and item access -------------------------------------------------------------- */

static bool loop_attr(tctx_t *ctx, const tloop_t *l, const char *name, tv_t *out) {
  int64_t i = l->index0, n = l->length;
  if (!strcmp(name, "index"))
    *out = tv_int(i + 1);
  else if (!strcmp(name, "index0"))
    *out = tv_int(i);
  else if (!strcmp(name, "revindex"))
    *out = tv_int(n - i);
  else if (!strcmp(name, "revindex0"))
    *out = tv_int(n - i - 1);
  else if (!strcmp(name, "first"))
    *out = tv_bool(i == 0);
  else if (!strcmp(name, "last"))
    *out = tv_bool(i == n - 1);
  else if (!strcmp(name, "length"))
    *out = tv_int(n);
  else if (!strcmp(name, "depth"))
    *out = tv_int(l->depth0 + 1);
  else if (!strcmp(name, "depth0"))
    *out = tv_int(l->depth0);
  else if (!strcmp(name, "previtem"))
    *out = i > 0 ? l->items[i - 1] : undef_fmt(ctx, "there is no previous item");
  else if (!strcmp(name, "nextitem"))
    *out = i + 1 < n ? l->items[i + 1] : undef_fmt(ctx, "there is no next item");
  else
    return false;
  return true;
}

static bool get_attr(tctx_t *ctx, const tv_t *obj, const char *name, size_t n, tv_t *out) {
  char b[64];
  switch (obj->kind) {
    case TV_UNDEF: return undef_fail(ctx, obj);
    case TV_DICT:
    case TV_NS:
      if (tv_dict_get_str(ctx, obj, name, n, out)) return true;
      break;
    case TV_LOOP:
      if (loop_attr(ctx, obj->u.loop, name, out)) return true;
      break;
    case TV_LIST:
      if ((obj->flags & TV_F_GROUP) && (!strcmp(name, "grouper") || !strcmp(name, "list"))) {
        *out = obj->u.list->items[name[0] == 'l'];
        return true;
      }
      break;
    default: break;
  }
  *out = undef_fmt(ctx, "'%s' has no attribute '%s'", obj_desc(obj, b, sizeof b), name);
  return true;
}

bool tpl_get_attr(tctx_t *ctx, const tv_t *obj, const char *name, size_t n, tv_t *out) {
  tv_t o = *obj;
  return get_attr(ctx, &o, name, n, out);
}

static bool index_of(tctx_t *ctx, const tv_t *k, int64_t *out) {
  if (k->kind == TV_INT)
    *out = k->u.i;
  else if (k->kind == TV_BOOL)
    *out = k->u.b;
  else
    return false;
  (void)ctx;
  return true;
}

static bool get_item(tctx_t *ctx, const tv_t *obj, const tv_t *key, tv_t *out) {
  char b[64];
  int64_t i;
  switch (obj->kind) {
    case TV_UNDEF: return undef_fail(ctx, obj);
    case TV_LIST:
      if (index_of(ctx, key, &i)) {
        int64_t n = (int64_t)obj->u.list->n;
        if (i < 0) i += n;
        if (i >= 0 && i < n) {
          *out = tv_list_get(ctx, obj, (size_t)i);
          return true;
        }
        *out = undef_fmt(ctx, "'%s' has no element %lld", obj_desc(obj, b, sizeof b),
                         (long long)key->u.i);
        return true;
      }
      break;
    case TV_STR:
      if (index_of(ctx, key, &i)) {
        const char *s = obj->u.str.s;
        size_t len = obj->u.str.n;
        int64_t n = (int64_t)utf8_count(s, len);
        if (i < 0) i += n;
        if (i >= 0 && i < n) {
          size_t off = utf8_offset(s, len, (size_t)i);
          *out = tv_str(s + off, utf8_next(s, len, off) - off);
          return true;
        }
        *out = undef_fmt(ctx, "'str object' has no element %lld", (long long)key->u.i);
        return true;
      }
      break;
    case TV_DICT:
      if (tv_dict_get(ctx, obj, key, out)) return true;
      break;
    default: break;
  }
  if (key->kind == TV_STR && obj->kind != TV_DICT) {
    tv_t tmp;
    if (!get_attr(ctx, obj, key->u.str.s, key->u.str.n, &tmp)) return false;
    if (tmp.kind != TV_UNDEF) {
      *out = tmp;
      return true;
    }
  }
  if (key->kind == TV_STR)
    *out = undef_fmt(ctx, "'%s' has no attribute '%.*s'", obj_desc(obj, b, sizeof b),
                     (int)(key->u.str.n > 100 ? 100 : key->u.str.n), key->u.str.s);
  else
    *out = undef_fmt(ctx, "'%s' has no element of type %s", obj_desc(obj, b, sizeof b),
                     tv_type_name(key));
  return true;
}

bool tpl_get_item(tctx_t *ctx, const tv_t *obj, const tv_t *key, tv_t *out) {
  tv_t o = *obj, k = *key;
  return get_item(ctx, &o, &k, out);
}

static bool slice_index(tctx_t *ctx, const tv_t *v, bool *present, int64_t *out) {
  *present = false;
  if (v->kind == TV_NONE) return true;
  if (!index_of(ctx, v, out))
    return tpl_fail(ctx, "slice indices must be integers or None, not %s", tv_type_name(v));
  *present = true;
  return true;
}

static bool eval_slice(tctx_t *ctx, const tnode_t *e, tscope_t *sc, tv_t *out) {
  tv_t obj, parts[3];
  if (!tpl_eval(ctx, e->a, sc, &obj)) return false;
  for (int k = 0; k < 3; k++) {
    parts[k] = tv_none();
    if (e->items[k] && !tpl_eval(ctx, e->items[k], sc, &parts[k])) return false;
  }
  if (obj.kind == TV_UNDEF) return undef_fail(ctx, &obj);
  if (obj.kind != TV_LIST && obj.kind != TV_STR)
    return tpl_fail(ctx, "'%s' object is not subscriptable with a slice", tv_type_name(&obj));
  bool has[3];
  int64_t v[3] = {0, 0, 1};
  for (int k = 0; k < 3; k++)
    if (!slice_index(ctx, &parts[k], &has[k], &v[k])) return false;
  int64_t step = has[2] ? v[2] : 1;
  if (step == 0) return tpl_fail(ctx, "slice step cannot be zero");
  int64_t len = (int64_t)tv_len(&obj);
  int64_t lower = step > 0 ? 0 : -1, upper = step > 0 ? len : len - 1;
  int64_t bounds[2];
  for (int k = 0; k < 2; k++) {
    if (!has[k]) {
      bounds[k] = (step > 0) == (k == 0) ? lower : upper;
      continue;
    }
    int64_t x = v[k];
    if (x < 0) {
      x += len;
      if (x < lower) x = lower;
    } else if (x > upper) {
      x = upper;
    }
    bounds[k] = x;
  }
  int64_t start = bounds[0], stop = bounds[1];
  size_t count = 0;
  if (step > 0 && start < stop) count = (size_t)((stop - start - 1) / step + 1);
  if (step < 0 && start > stop) count = (size_t)((start - stop - 1) / (-step) + 1);
  if (obj.kind == TV_STR) {
    const char *s = obj.u.str.s;
    size_t n = obj.u.str.n;
    if (step == 1) {
      size_t b = utf8_offset(s, n, (size_t)start);
      size_t e2 = count ? utf8_offset(s, n, (size_t)stop) : b;
      *out = tv_str(s + b, e2 - b);
      return true;
    }
    size_t *offs = tpl_alloc(ctx, ((size_t)len + 1) * sizeof *offs);
    char *d = tpl_alloc(ctx, n + 1);
    if (!offs || !d) return false;
    size_t pos = 0;
    for (int64_t i = 0; i <= len; i++) {
      offs[i] = pos;
      pos = utf8_next(s, n, pos);
    }
    size_t k = 0;
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
      size_t cl = offs[i + 1] - offs[i];
      memcpy(d + k, s + offs[i], cl);
      k += cl;
    }
    d[k] = '\0';
    *out = tv_str(d, k);
    return true;
  }
  tv_t r = tv_new_list(ctx, count);
  if (r.kind != TV_LIST) return false;
  r.flags = obj.flags & TV_F_TUPLE;
  size_t k = 0;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step)
    r.u.list->items[k++] = tv_list_get(ctx, &obj, (size_t)i);
  *out = r;
  return true;
}

/* ---- operators ------------------------------------------------------------------------------ */

static bool is_num(const tv_t *v) {
  return v->kind == TV_BOOL || v->kind == TV_INT || v->kind == TV_FLOAT;
}
static double as_f(const tv_t *v) {
  return v->kind == TV_FLOAT ? v->u.f : v->kind == TV_INT ? (double)v->u.i : (double)v->u.b;
}
static int64_t as_i(const tv_t *v) {
  return v->kind == TV_INT ? v->u.i : v->kind == TV_BOOL ? (int64_t)v->u.b : 0;
}

static const char *op_name(int op) {
  switch (op) {
    case '+': return "+";
    case '-': return "-";
    case '*': return "*";
    case '/': return "/";
    case 'f': return "//";
    case '%': return "%";
    case 'p': return "** or pow()";
    default: return "?";
  }
}

static bool repeat(tctx_t *ctx, const tv_t *seq, int64_t times, tv_t *out) {
  if (times < 0) times = 0;
  if (seq->kind == TV_STR) {
    size_t n = seq->u.str.n;
    if (n && (uint64_t)times > ctx->lim.max_output / n)
      return tpl_fail(ctx, "string repetition result is too large");
    char *d = tpl_alloc(ctx, n * (size_t)times + 1);
    if (!d) return false;
    for (int64_t i = 0; i < times; i++) memcpy(d + (size_t)i * n, seq->u.str.s, n);
    d[n * (size_t)times] = '\0';
    *out = tv_str(d, n * (size_t)times);
    return true;
  }
  size_t n = seq->u.list->n;
  if (n && (uint64_t)times > (1u << 24) / n)
    return tpl_fail(ctx, "list repetition result is too large");
  tv_t r = tv_new_list(ctx, n * (size_t)times);
  if (r.kind != TV_LIST) return false;
  r.flags = seq->flags & TV_F_TUPLE;
  for (size_t i = 0; i < n * (size_t)times; i++) r.u.list->items[i] = tv_list_get(ctx, seq, i % n);
  *out = r;
  return true;
}

static bool binop(tctx_t *ctx, int op, const tv_t *a, const tv_t *b, tv_t *out) {
  if (op == '~') {
    tv_t x, y;
    if (!tv_to_str(ctx, a, &x) || !tv_to_str(ctx, b, &y)) return false;
    *out = tv_concat_str(ctx, x.u.str.s, x.u.str.n, y.u.str.s, y.u.str.n);
    return out->kind == TV_STR;
  }
  if (a->kind == TV_UNDEF) return undef_fail(ctx, a);
  /* str % Undefined formats the undefined (as ''), as Python would */
  if (op == '%' && a->kind == TV_STR) return tpl_str_percent(ctx, a, b, out);
  if (b->kind == TV_UNDEF) return undef_fail(ctx, b);
  if (is_num(a) && is_num(b)) {
    bool fl = a->kind == TV_FLOAT || b->kind == TV_FLOAT;
    int64_t x = as_i(a), y = as_i(b), r;
    double fx = as_f(a), fy = as_f(b);
    switch (op) {
      case '+':
        if (fl)
          *out = tv_float(fx + fy);
        else if (__builtin_add_overflow(x, y, &r))
          return tpl_fail(ctx, "integer overflow in +");
        else
          *out = tv_int(r);
        return true;
      case '-':
        if (fl)
          *out = tv_float(fx - fy);
        else if (__builtin_sub_overflow(x, y, &r))
          return tpl_fail(ctx, "integer overflow in -");
        else
          *out = tv_int(r);
        return true;
      case '*':
        if (fl)
          *out = tv_float(fx * fy);
        else if (__builtin_mul_overflow(x, y, &r))
          return tpl_fail(ctx, "integer overflow in *");
        else
          *out = tv_int(r);
        return true;
      case '/':
        if (fy == 0) return tpl_fail(ctx, "division by zero");
        *out = tv_float(fx / fy);
        return true;
      case 'f':
      case '%':
        if (fl) {
          if (fy == 0) return tpl_fail(ctx, "float division by zero");
          double q = __builtin_floor(fx / fy), m = fx - q * fy;
          if (op == '%') {
            m = __builtin_fmod(fx, fy);
            if (m != 0 && ((m < 0) != (fy < 0))) m += fy;
          }
          *out = tv_float(op == 'f' ? q : m);
          return true;
        }
        if (y == 0) return tpl_fail(ctx, "integer division or modulo by zero");
        if (x == INT64_MIN && y == -1) return tpl_fail(ctx, "integer overflow in //");
        {
          int64_t q = x / y, m = x % y;
          if (m != 0 && ((m < 0) != (y < 0))) {
            q--;
            m += y;
          }
          *out = tv_int(op == 'f' ? q : m);
        }
        return true;
      case 'p':
        if (!fl && y >= 0) {
          int64_t acc = 1, base = x;
          for (int64_t e = y; e > 0; e >>= 1) {
            if ((e & 1) && __builtin_mul_overflow(acc, base, &acc))
              return tpl_fail(ctx, "integer overflow in **");
            if (e > 1 && __builtin_mul_overflow(base, base, &base))
              return tpl_fail(ctx, "integer overflow in **");
          }
          *out = tv_int(acc);
          return true;
        }
        if (fx == 0 && fy < 0) return tpl_fail(ctx, "0.0 cannot be raised to a negative power");
        *out = tv_float(__builtin_pow(fx, fy));
        return true;
    }
  }
  if (op == '+' && a->kind == TV_STR && b->kind == TV_STR) {
    *out = tv_concat_str(ctx, a->u.str.s, a->u.str.n, b->u.str.s, b->u.str.n);
    return out->kind == TV_STR;
  }
  if (op == '+' && a->kind == TV_LIST && b->kind == TV_LIST &&
      (a->flags & TV_F_TUPLE) == (b->flags & TV_F_TUPLE)) {
    size_t na = a->u.list->n, nb = b->u.list->n;
    tv_t r = tv_new_list(ctx, na + nb);
    if (r.kind != TV_LIST) return false;
    r.flags = a->flags & TV_F_TUPLE;
    for (size_t i = 0; i < na; i++) r.u.list->items[i] = tv_list_get(ctx, a, i);
    for (size_t i = 0; i < nb; i++) r.u.list->items[na + i] = tv_list_get(ctx, b, i);
    *out = r;
    return true;
  }
  if (op == '*' && (a->kind == TV_STR || a->kind == TV_LIST) &&
      (b->kind == TV_INT || b->kind == TV_BOOL))
    return repeat(ctx, a, as_i(b), out);
  if (op == '*' && (b->kind == TV_STR || b->kind == TV_LIST) &&
      (a->kind == TV_INT || a->kind == TV_BOOL))
    return repeat(ctx, b, as_i(a), out);
  if (op == '+' && a->kind == TV_STR)
    return tpl_fail(ctx, "can only concatenate str (not \"%s\") to str", tv_type_name(b));
  if (op == '+' && a->kind == TV_LIST)
    return tpl_fail(ctx, "can only concatenate %s (not \"%s\") to %s", tv_type_name(a),
                    tv_type_name(b), tv_type_name(a));
  return tpl_fail(ctx, "unsupported operand type(s) for %s: '%s' and '%s'", op_name(op),
                  tv_type_name(a), tv_type_name(b));
}

static bool contains(tctx_t *ctx, const tv_t *hay, const tv_t *needle, bool *out) {
  switch (hay->kind) {
    case TV_UNDEF: *out = false; return true;
    case TV_STR: {
      if (needle->kind == TV_UNDEF) return undef_fail(ctx, needle);
      if (needle->kind != TV_STR)
        return tpl_fail(ctx, "'in <string>' requires string as left operand, not %s",
                        tv_type_name(needle));
      size_t hn = hay->u.str.n, nn = needle->u.str.n;
      *out = false;
      if (nn == 0) *out = true;
      for (size_t i = 0; !*out && nn <= hn && i <= hn - nn; i++)
        if (memcmp(hay->u.str.s + i, needle->u.str.s, nn) == 0) *out = true;
      return true;
    }
    case TV_LIST:
      *out = false;
      for (size_t i = 0; i < hay->u.list->n && !*out; i++) {
        tv_t x = tv_list_get(ctx, hay, i);
        *out = tv_eq(&x, needle);
      }
      return true;
    case TV_DICT:
    case TV_NS: {
      tv_t tmp;
      *out = tv_dict_get(ctx, hay, needle, &tmp);
      return true;
    }
    default: return tpl_fail(ctx, "argument of type '%s' is not iterable", tv_type_name(hay));
  }
}

static bool compare(tctx_t *ctx, int op, const tv_t *a, const tv_t *b, bool *out) {
  int c;
  switch (op) {
    case CMP_EQ: *out = tv_eq(a, b); return true;
    case CMP_NE: *out = !tv_eq(a, b); return true;
    case CMP_IN: return contains(ctx, b, a, out);
    case CMP_NOTIN:
      if (!contains(ctx, b, a, out)) return false;
      *out = !*out;
      return true;
    default: break;
  }
  if (a->kind == TV_UNDEF) return undef_fail(ctx, a);
  if (b->kind == TV_UNDEF) return undef_fail(ctx, b);
  if (!tv_cmp(ctx, a, b, &c)) return false;
  *out = op == CMP_LT ? c < 0 : op == CMP_LE ? c <= 0 : op == CMP_GT ? c > 0 : c >= 0;
  return true;
}

/* ---- calls ---------------------------------------------------------------------------------- */

typedef struct args {
  tv_t pos[16];
  size_t npos;
  const char *kwn[16];
  tv_t kwv[16];
  size_t nkw;
} args_t;

static bool eval_args(tctx_t *ctx, const tnode_t *call, tscope_t *sc, args_t *a) {
  a->npos = a->nkw = 0;
  for (size_t i = 0; i < call->n; i++) {
    const tnode_t *arg = call->items[i];
    if (arg->kind == N_KWARG) {
      if (a->nkw == 16) return tpl_fail(ctx, "too many keyword arguments");
      a->kwn[a->nkw] = arg->name;
      if (!tpl_eval(ctx, arg->a, sc, &a->kwv[a->nkw])) return false;
      a->nkw++;
    } else {
      if (a->npos == 16) return tpl_fail(ctx, "too many arguments");
      if (!tpl_eval(ctx, arg, sc, &a->pos[a->npos])) return false;
      a->npos++;
    }
  }
  return true;
}

/* Renders body into a fresh string value. */
static bool capture(tctx_t *ctx, tnode_t *const *body, size_t n, tscope_t *sc, tv_t *out,
                    bool *out_broke) {
  kiln_strbuf_t buf = KILN_STRBUF_INIT, *saved = ctx->out;
  ctx->out = &buf;
  xres_t r = exec_body(ctx, body, n, sc);
  ctx->out = saved;
  bool ok = r != X_ERR;
  if (ok && !kiln_strbuf_ok(&buf)) ok = tpl_oom(ctx);
  if (ok) {
    *out = tv_from_buf(ctx, &buf);
    ok = out->kind == TV_STR;
  }
  if (out_broke) *out_broke = r == X_BREAK || r == X_CONTINUE;
  kiln_strbuf_free(&buf);
  return ok;
}

static bool call_macro(tctx_t *ctx, const tmacro_t *m, const tv_t *args, size_t nargs,
                       const char *const *kwn, const tv_t *kwv, size_t nkw, tv_t *out) {
  const tnode_t *def = m->def;
  if (nargs > def->n && !(def->op & MACRO_VARARGS))
    return tpl_fail(ctx, "macro '%s' takes not more than %zu argument(s)", def->name, def->n);
  if (ctx->depth >= ctx->lim.max_depth)
    return tpl_fail(ctx, "recursion too deep: more than %d nested macro calls", ctx->lim.max_depth);
  tscope_t *sc = scope_new(ctx, m->closure);
  if (!sc) return false;
  tv_t kwargs = tv_new_dict(ctx);
  if (kwargs.kind != TV_DICT) return false;
  for (size_t k = 0; k < nkw; k++) {
    bool found = false;
    for (size_t i = 0; i < def->n; i++)
      if (!strcmp(def->items[i]->name, kwn[k])) found = true;
    if (found) continue;
    if (!strcmp(kwn[k], "caller") && (def->op & MACRO_CALLER)) {
      if (!scope_set(ctx, sc, "caller", 6, kwv[k])) return false;
    } else if (def->op & MACRO_KWARGS) {
      if (!tv_dict_set(ctx, &kwargs, tv_str(kwn[k], strlen(kwn[k])), kwv[k])) return false;
    } else {
      return tpl_fail(ctx, "macro '%s' takes no keyword argument '%s'", def->name, kwn[k]);
    }
  }
  if (def->op & MACRO_KWARGS) {
    if (!scope_set(ctx, sc, "kwargs", 6, kwargs)) return false;
  }
  if (def->op & MACRO_VARARGS) {
    size_t nv = nargs > def->n ? nargs - def->n : 0;
    tv_t va = tv_new_list(ctx, nv);
    if (va.kind != TV_LIST) return false;
    va.flags = TV_F_TUPLE;
    for (size_t i = 0; i < nv; i++) va.u.list->items[i] = args[def->n + i];
    if (!scope_set(ctx, sc, "varargs", 7, va)) return false;
  }
  for (size_t i = 0; i < def->n; i++) {
    const tnode_t *p = def->items[i];
    tv_t v = tv_undef(NULL);
    bool set = false;
    if (i < nargs) {
      v = args[i];
      set = true;
    }
    for (size_t k = 0; k < nkw; k++)
      if (!strcmp(p->name, kwn[k])) {
        if (set)
          return tpl_fail(ctx, "macro '%s' got multiple values for argument '%s'", def->name,
                          p->name);
        v = kwv[k];
        set = true;
      }
    if (!set && p->kind == N_KWARG) {
      if (!tpl_eval(ctx, p->a, sc, &v)) return false;
    } else if (!set) {
      char buf[160];
      snprintf(buf, sizeof buf, "parameter '%s' was not provided", p->name);
      v = tv_undef(kiln_arena_strndup(&ctx->arena, buf, strlen(buf)));
    }
    if (!scope_set(ctx, sc, p->name, p->name_len, v)) return false;
  }
  ctx->depth++;
  int line = ctx->line;
  bool ok = capture(ctx, def->body, def->nbody, sc, out, NULL);
  ctx->line = line;
  ctx->depth--;
  return ok;
}

static bool call_func(tctx_t *ctx, tv_func_t f, const tv_t *args, size_t nargs,
                      const char *const *kwn, const tv_t *kwv, size_t nkw, tv_t *out) {
  switch (f) {
    case TF_RANGE: {
      int64_t v[3] = {0, 0, 1};
      if (nargs < 1 || nargs > 3 || nkw)
        return tpl_fail(ctx, "range() takes 1 to 3 integer arguments");
      for (size_t i = 0; i < nargs; i++) {
        if (args[i].kind != TV_INT && args[i].kind != TV_BOOL)
          return tpl_fail(ctx, "'%s' object cannot be interpreted as an integer",
                          tv_type_name(&args[i]));
        v[nargs == 1 ? 1 : i] = as_i(&args[i]);
      }
      int64_t start = v[0], stop = v[1], step = v[2];
      if (step == 0) return tpl_fail(ctx, "range() arg 3 must not be zero");
      uint64_t count = 0;
      if (step > 0 && start < stop)
        count = ((uint64_t)stop - (uint64_t)start - 1) / (uint64_t)step + 1;
      if (step < 0 && start > stop)
        count = ((uint64_t)start - (uint64_t)stop - 1) / (uint64_t)(-step) + 1;
      if (count > 100000)
        return tpl_fail(ctx,
                        "Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
      tv_t r = tv_new_list(ctx, (size_t)count);
      if (r.kind != TV_LIST) return false;
      for (uint64_t i = 0; i < count; i++) r.u.list->items[i] = tv_int(start + (int64_t)i * step);
      *out = r;
      return true;
    }
    case TF_NAMESPACE:
    case TF_DICT: {
      tv_t d = tv_new_dict(ctx);
      if (d.kind != TV_DICT) return false;
      if (nargs > 1)
        return tpl_fail(ctx, "%s() takes at most one positional argument",
                        f == TF_DICT ? "dict" : "namespace");
      if (nargs == 1) {
        if (args[0].kind != TV_DICT && args[0].kind != TV_NS)
          return tpl_fail(ctx, "%s() needs a mapping, not %s", f == TF_DICT ? "dict" : "namespace",
                          tv_type_name(&args[0]));
        size_t n = tv_len(&args[0]);
        for (size_t i = 0; i < n; i++) {
          tv_t k, v;
          tv_dict_at(ctx, &args[0], i, &k, &v);
          if (!tv_dict_set(ctx, &d, k, v)) return false;
        }
      }
      for (size_t i = 0; i < nkw; i++) {
        size_t l = strlen(kwn[i]);
        if (!tv_dict_set(ctx, &d, tv_str(kwn[i], l), kwv[i])) return false;
      }
      if (f == TF_NAMESPACE) d.kind = TV_NS;
      *out = d;
      return true;
    }
    case TF_RAISE: {
      tv_t msg = tv_str("", 0);
      if (nargs >= 1 && !tv_to_str(ctx, &args[0], &msg)) return false;
      return tpl_fail(ctx, "%.*s", (int)(msg.u.str.n > INT_MAX ? INT_MAX : msg.u.str.n),
                      msg.u.str.s);
    }
    case TF_STRFTIME: {
      if (nargs != 1 || args[0].kind != TV_STR)
        return tpl_fail(ctx, "strftime_now() takes one string argument");
      char fmt[256], buf[512];
      if (args[0].u.str.n >= sizeof fmt) return tpl_fail(ctx, "strftime_now(): format too long");
      memcpy(fmt, args[0].u.str.s, args[0].u.str.n);
      fmt[args[0].u.str.n] = '\0';
      time_t now = time(NULL);
      struct tm tmv;
      if (!localtime_r(&now, &tmv)) return tpl_fail(ctx, "strftime_now(): no local time");
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wformat-nonliteral"
      size_t n = strftime(buf, sizeof buf, fmt, &tmv);
#pragma GCC diagnostic pop
      *out = tv_concat_str(ctx, buf, n, "", 0);
      return out->kind == TV_STR;
    }
    default: return tpl_fail(ctx, "this function is not supported");
  }
}

static xres_t exec_for_items(tctx_t *ctx, const tnode_t *st, tscope_t *sc, const tv_t *iter,
                             int64_t depth0);

bool tpl_call_value(tctx_t *ctx, const tv_t *fn, const tv_t *args, size_t nargs,
                    const char *const *kwnames, const tv_t *kwvals, size_t nkw, tv_t *out) {
  switch (fn->kind) {
    case TV_MACRO: return call_macro(ctx, fn->u.macro, args, nargs, kwnames, kwvals, nkw, out);
    case TV_FUNC: return call_func(ctx, fn->u.func, args, nargs, kwnames, kwvals, nkw, out);
    case TV_LOOP: {
      const tloop_t *l = fn->u.loop;
      if (!l->recurse)
        return tpl_fail(ctx, "the loop is not recursive: use 'for ... recursive' to call loop()");
      if (nargs != 1) return tpl_fail(ctx, "loop() takes one iterable");
      if (ctx->depth >= ctx->lim.max_depth)
        return tpl_fail(ctx, "recursion too deep in a recursive loop");
      kiln_strbuf_t buf = KILN_STRBUF_INIT, *saved = ctx->out;
      ctx->out = &buf;
      ctx->depth++;
      xres_t r = exec_for_items(ctx, l->recurse, l->scope, &args[0], l->depth0 + 1);
      ctx->depth--;
      ctx->out = saved;
      bool ok = r != X_ERR && (kiln_strbuf_ok(&buf) || tpl_oom(ctx));
      if (ok) {
        *out = tv_from_buf(ctx, &buf);
        ok = out->kind == TV_STR;
      }
      kiln_strbuf_free(&buf);
      return ok;
    }
    case TV_UNDEF: return undef_fail(ctx, fn);
    default: return tpl_fail(ctx, "'%s' object is not callable", tv_type_name(fn));
  }
}

static bool eval_call(tctx_t *ctx, const tnode_t *e, tscope_t *sc, tv_t *out) {
  args_t a;
  const tnode_t *callee = e->a;
  if (callee->kind == N_ATTR) {
    tv_t obj;
    if (!tpl_eval(ctx, callee->a, sc, &obj)) return false;
    if (obj.kind == TV_UNDEF) return undef_fail(ctx, &obj);
    if (tpl_has_method(&obj, callee->name)) {
      if (!eval_args(ctx, e, sc, &a)) return false;
      ctx->line = e->line;
      return tpl_call_method(ctx, &obj, callee->name, a.pos, a.npos, a.kwn, a.kwv, a.nkw, out);
    }
    tv_t fn;
    if (!get_attr(ctx, &obj, callee->name, callee->name_len, &fn)) return false;
    if (fn.kind == TV_UNDEF) {
      char b[64];
      return tpl_fail(ctx, "'%s' has no method '%s'", obj_desc(&obj, b, sizeof b), callee->name);
    }
    if (!eval_args(ctx, e, sc, &a)) return false;
    ctx->line = e->line;
    return tpl_call_value(ctx, &fn, a.pos, a.npos, a.kwn, a.kwv, a.nkw, out);
  }
  tv_t fn;
  if (!tpl_eval(ctx, callee, sc, &fn) || !eval_args(ctx, e, sc, &a)) return false;
  ctx->line = e->line;
  return tpl_call_value(ctx, &fn, a.pos, a.npos, a.kwn, a.kwv, a.nkw, out);
}

/* {% call %}: the call of st->a with the caller macro as an extra `caller` keyword. */
static bool exec_call_block(tctx_t *ctx, const tnode_t *st, tscope_t *sc, tmacro_t *caller) {
  args_t a;
  tv_t fn, v;
  const tnode_t *call = st->a;
  if (!tpl_eval(ctx, call->a, sc, &fn) || !eval_args(ctx, call, sc, &a)) return false;
  if (a.nkw == 16) return tpl_fail(ctx, "too many keyword arguments");
  a.kwn[a.nkw] = "caller";
  a.kwv[a.nkw++] = (tv_t){TV_MACRO, 0, {.macro = caller}};
  ctx->line = st->line;
  if (fn.kind != TV_MACRO)
    return tpl_fail(ctx, "{%% call %%} needs a macro, not %s", tv_type_name(&fn));
  if (!tpl_call_value(ctx, &fn, a.pos, a.npos, a.kwn, a.kwv, a.nkw, &v)) return false;
  return tv_write_str(ctx, ctx->out, &v) && out_limit(ctx);
}

/* Applies a filter node (and its inner chain, for filter blocks) to in. */
static bool apply_filter_node(tctx_t *ctx, const tnode_t *f, tscope_t *sc, tv_t in, tv_t *out) {
  args_t a;
  if (!eval_args(ctx, f, sc, &a)) return false;
  ctx->line = f->line;
  return tpl_apply_filter(ctx, f->name, &in, a.pos, a.npos, a.kwn, a.kwv, a.nkw, out);
}

/* Filter chain of a filter block / block set: the innermost filter has a == NULL. */
static bool apply_chain(tctx_t *ctx, const tnode_t *f, tscope_t *sc, tv_t in, tv_t *out) {
  if (f->a) {
    if (!apply_chain(ctx, f->a, sc, in, &in)) return false;
  }
  return apply_filter_node(ctx, f, sc, in, out);
}

/* ---- expressions ---------------------------------------------------------------------------- */

bool tpl_eval(tctx_t *ctx, const tnode_t *e, tscope_t *sc, tv_t *out) {
  ctx->line = e->line;
  switch (e->kind) {
    case N_LIT: *out = e->lit; return true;
    case N_NAME:
      if (!scope_get(sc, e->name, e->name_len, out))
        *out = undef_fmt(ctx, "'%s' is undefined", e->name);
      return true;
    case N_LIST:
    case N_TUPLE: {
      tv_t r = tv_new_list(ctx, e->n);
      if (r.kind != TV_LIST) return false;
      if (e->kind == N_TUPLE) r.flags = TV_F_TUPLE;
      for (size_t i = 0; i < e->n; i++)
        if (!tpl_eval(ctx, e->items[i], sc, &r.u.list->items[i])) return false;
      *out = r;
      return true;
    }
    case N_DICT: {
      tv_t d = tv_new_dict(ctx);
      if (d.kind != TV_DICT) return false;
      for (size_t i = 0; i + 1 < e->n; i += 2) {
        tv_t k, v;
        if (!tpl_eval(ctx, e->items[i], sc, &k) || !tpl_eval(ctx, e->items[i + 1], sc, &v))
          return false;
        if (k.kind == TV_LIST && !(k.flags & TV_F_TUPLE))
          return tpl_fail(ctx, "unhashable type: 'list'");
        if (k.kind == TV_DICT) return tpl_fail(ctx, "unhashable type: 'dict'");
        if (!tv_dict_set(ctx, &d, k, v)) return false;
      }
      *out = d;
      return true;
    }
    case N_ATTR: {
      tv_t obj;
      if (!tpl_eval(ctx, e->a, sc, &obj)) return false;
      ctx->line = e->line;
      return get_attr(ctx, &obj, e->name, e->name_len, out);
    }
    case N_ITEM: {
      tv_t obj, key;
      if (!tpl_eval(ctx, e->a, sc, &obj) || !tpl_eval(ctx, e->b, sc, &key)) return false;
      ctx->line = e->line;
      return get_item(ctx, &obj, &key, out);
    }
    case N_SLICE: return eval_slice(ctx, e, sc, out);
    case N_CALL: return eval_call(ctx, e, sc, out);
    case N_FILTER: {
      tv_t in;
      if (!tpl_eval(ctx, e->a, sc, &in)) return false;
      return apply_filter_node(ctx, e, sc, in, out);
    }
    case N_TEST: {
      tv_t in;
      args_t a;
      bool r;
      if (!tpl_eval(ctx, e->a, sc, &in) || !eval_args(ctx, e, sc, &a)) return false;
      ctx->line = e->line;
      if (a.nkw) return tpl_fail(ctx, "tests take no keyword arguments");
      if (!tpl_apply_test(ctx, e->name, &in, a.pos, a.npos, &r)) return false;
      *out = tv_bool(e->op ? !r : r);
      return true;
    }
    case N_NEG:
    case N_POS: {
      tv_t v;
      if (!tpl_eval(ctx, e->a, sc, &v)) return false;
      ctx->line = e->line;
      if (v.kind == TV_UNDEF) return undef_fail(ctx, &v);
      if (v.kind == TV_FLOAT)
        *out = tv_float(e->kind == N_NEG ? -v.u.f : v.u.f);
      else if (v.kind == TV_INT || v.kind == TV_BOOL) {
        int64_t i = as_i(&v);
        if (e->kind == N_NEG && i == INT64_MIN) return tpl_fail(ctx, "integer overflow in unary -");
        *out = tv_int(e->kind == N_NEG ? -i : i);
      } else {
        return tpl_fail(ctx, "bad operand type for unary %c: '%s'", e->kind == N_NEG ? '-' : '+',
                        tv_type_name(&v));
      }
      return true;
    }
    case N_NOT: {
      tv_t v;
      if (!tpl_eval(ctx, e->a, sc, &v)) return false;
      *out = tv_bool(!tv_truthy(&v));
      return true;
    }
    case N_AND:
    case N_OR: {
      tv_t v;
      if (!tpl_eval(ctx, e->a, sc, &v)) return false;
      if (tv_truthy(&v) == (e->kind == N_OR)) {
        *out = v;
        return true;
      }
      return tpl_eval(ctx, e->b, sc, out);
    }
    case N_BIN: {
      tv_t a, b;
      if (!tpl_eval(ctx, e->a, sc, &a) || !tpl_eval(ctx, e->b, sc, &b)) return false;
      ctx->line = e->line;
      return binop(ctx, e->op, &a, &b, out);
    }
    case N_COMPARE: {
      tv_t left;
      if (!tpl_eval(ctx, e->a, sc, &left)) return false;
      for (size_t i = 0; i < e->n; i++) {
        tv_t right;
        bool r;
        if (!tpl_eval(ctx, e->items[i], sc, &right)) return false;
        ctx->line = e->line;
        if (!compare(ctx, e->ops[i], &left, &right, &r)) return false;
        if (!r) {
          *out = tv_bool(false);
          return true;
        }
        left = right;
      }
      *out = tv_bool(true);
      return true;
    }
    case N_COND: {
      tv_t c;
      if (!tpl_eval(ctx, e->a, sc, &c)) return false;
      if (tv_truthy(&c)) return tpl_eval(ctx, e->b, sc, out);
      if (e->c) return tpl_eval(ctx, e->c, sc, out);
      *out = undef_fmt(
          ctx,
          "the inline if-expression on line %d evaluated to false and no else section was defined",
          e->line);
      return true;
    }
    case N_KWARG: return tpl_fail(ctx, "unexpected keyword argument");
    default: return tpl_fail(ctx, "internal error: node %d is not an expression", e->kind);
  }
}

/* ---- statements ----------------------------------------------------------------------------- */

static bool out_limit(tctx_t *ctx) {
  if (!kiln_strbuf_ok(ctx->out)) return tpl_oom(ctx);
  if (ctx->out->len > ctx->lim.max_output)
    return tpl_fail(ctx, "output is larger than the limit of %zu bytes", ctx->lim.max_output);
  return true;
}

static bool assign(tctx_t *ctx, tnode_t *const *targets, size_t n, tscope_t *sc, const tv_t *v) {
  if (n == 1) return scope_set(ctx, sc, targets[0]->name, targets[0]->name_len, *v);
  tv_t *items;
  size_t m;
  if (v->kind == TV_UNDEF) return undef_fail(ctx, v);
  if (!tv_iterate(ctx, v, &items, &m)) return false;
  if (m != n)
    return tpl_fail(ctx,
                    m > n ? "too many values to unpack (expected %zu)"
                          : "not enough values to unpack (expected %zu, got %zu)",
                    n, m);
  for (size_t i = 0; i < n; i++)
    if (!scope_set(ctx, sc, targets[i]->name, targets[i]->name_len, items[i])) return false;
  return true;
}

static xres_t exec_for_items(tctx_t *ctx, const tnode_t *st, tscope_t *sc, const tv_t *iter,
                             int64_t depth0) {
  tv_t *items;
  size_t n;
  if (!tv_iterate(ctx, iter, &items, &n)) return X_ERR;
  if (st->b) {
    /* `for x in xs if cond`: filter first, so loop.length counts what is iterated */
    tv_t *kept = tpl_alloc(ctx, (n ? n : 1) * sizeof *kept);
    size_t k = 0;
    if (!kept) return X_ERR;
    for (size_t i = 0; i < n; i++) {
      tscope_t *fs = scope_new(ctx, sc);
      tv_t c;
      if (!fs || !assign(ctx, st->items, st->n, fs, &items[i])) return X_ERR;
      if (!tpl_eval(ctx, st->b, fs, &c)) return X_ERR;
      if (tv_truthy(&c)) kept[k++] = items[i];
    }
    items = kept;
    n = k;
  }
  if (n == 0) {
    tscope_t *es = scope_new(ctx, sc);
    if (!es) return X_ERR;
    xres_t r = exec_body(ctx, st->ebody, st->nebody, es);
    return r == X_ERR ? X_ERR : X_OK;
  }
  tloop_t *loop = tpl_alloc(ctx, sizeof *loop);
  if (!loop) return X_ERR;
  loop->items = items;
  loop->length = (int64_t)n;
  loop->depth0 = depth0;
  loop->recurse = st->op ? st : NULL;
  loop->scope = sc;
  tv_t lv = {TV_LOOP, 0, {.loop = loop}};
  for (size_t i = 0; i < n; i++) {
    if (++ctx->iterations > ctx->lim.max_iterations) {
      ctx->line = st->line;
      tpl_fail(ctx, "more than %llu loop iterations", (unsigned long long)ctx->lim.max_iterations);
      return X_ERR;
    }
    loop->index0 = (int64_t)i;
    tscope_t *is = scope_new(ctx, sc);
    if (!is || !scope_set(ctx, is, "loop", 4, lv)) return X_ERR;
    ctx->line = st->line;
    if (!assign(ctx, st->items, st->n, is, &items[i])) return X_ERR;
    xres_t r = exec_body(ctx, st->body, st->nbody, is);
    if (r == X_ERR) return X_ERR;
    if (r == X_BREAK) break;
  }
  return X_OK;
}

static xres_t exec_stmt(tctx_t *ctx, const tnode_t *st, tscope_t *sc) {
  ctx->line = st->line;
  switch (st->kind) {
    case S_TEXT:
      kiln_strbuf_append(ctx->out, st->lit.u.str.s, st->lit.u.str.n);
      return out_limit(ctx) ? X_OK : X_ERR;
    case S_OUTPUT: {
      tv_t v;
      if (!tpl_eval(ctx, st->a, sc, &v) || !tv_write_str(ctx, ctx->out, &v)) return X_ERR;
      return out_limit(ctx) ? X_OK : X_ERR;
    }
    case S_IF: {
      tv_t c;
      if (!tpl_eval(ctx, st->a, sc, &c)) return X_ERR;
      return tv_truthy(&c) ? exec_body(ctx, st->body, st->nbody, sc)
                           : exec_body(ctx, st->ebody, st->nebody, sc);
    }
    case S_FOR: {
      tv_t it;
      if (!tpl_eval(ctx, st->a, sc, &it)) return X_ERR;
      ctx->line = st->line;
      return exec_for_items(ctx, st, sc, &it, 0);
    }
    case S_SET: {
      tv_t v;
      if (st->b) {
        if (!tpl_eval(ctx, st->b, sc, &v)) return X_ERR;
      } else {
        if (!capture(ctx, st->body, st->nbody, sc, &v, NULL)) return X_ERR;
        if (st->c && !apply_chain(ctx, st->c, sc, v, &v)) return X_ERR;
      }
      ctx->line = st->line;
      if (st->a) {
        tv_t ns;
        const tnode_t *t = st->a;
        if (!scope_get(sc, t->a->name, t->a->name_len, &ns)) {
          tpl_fail(ctx, "'%s' is undefined", t->a->name);
          return X_ERR;
        }
        if (ns.kind != TV_NS) {
          tpl_fail(ctx, "cannot assign attribute on non-namespace object");
          return X_ERR;
        }
        return tv_dict_set(ctx, &ns, tv_str(t->name, t->name_len), v) ? X_OK : X_ERR;
      }
      return assign(ctx, st->items, st->n, sc, &v) ? X_OK : X_ERR;
    }
    case S_MACRO: {
      tmacro_t *m = tpl_alloc(ctx, sizeof *m);
      if (!m) return X_ERR;
      m->def = st;
      m->closure = sc;
      tv_t v = {TV_MACRO, 0, {.macro = m}};
      return scope_set(ctx, sc, st->name, st->name_len, v) ? X_OK : X_ERR;
    }
    case S_CALLBLOCK: {
      tmacro_t *m = tpl_alloc(ctx, sizeof *m);
      if (!m) return X_ERR;
      m->def = st->b;
      m->closure = sc;
      return exec_call_block(ctx, st, sc, m) ? X_OK : X_ERR;
    }
    case S_FILTERBLOCK: {
      tv_t v;
      if (!capture(ctx, st->body, st->nbody, sc, &v, NULL) || !apply_chain(ctx, st->a, sc, v, &v) ||
          !tv_write_str(ctx, ctx->out, &v))
        return X_ERR;
      return out_limit(ctx) ? X_OK : X_ERR;
    }
    case S_WITH: {
      tscope_t *ws = scope_new(ctx, sc);
      if (!ws) return X_ERR;
      for (size_t i = 0; i < st->n; i++) {
        tv_t v;
        if (!tpl_eval(ctx, st->items[i]->a, sc, &v) ||
            !scope_set(ctx, ws, st->items[i]->name, st->items[i]->name_len, v))
          return X_ERR;
      }
      return exec_body(ctx, st->body, st->nbody, ws);
    }
    case S_SCOPE: {
      tscope_t *ss = scope_new(ctx, sc);
      if (!ss) return X_ERR;
      return exec_body(ctx, st->body, st->nbody, ss);
    }
    case S_BREAK: return X_BREAK;
    case S_CONTINUE: return X_CONTINUE;
    default: tpl_fail(ctx, "internal error: node %d is not a statement", st->kind); return X_ERR;
  }
}

static xres_t exec_body(tctx_t *ctx, tnode_t *const *body, size_t n, tscope_t *sc) {
  for (size_t i = 0; i < n; i++) {
    xres_t r = exec_stmt(ctx, body[i], sc);
    if (r != X_OK) return r;
  }
  return X_OK;
}

bool tpl_exec_template(tctx_t *ctx, tscope_t *sc) {
  return exec_body(ctx, ctx->tpl->body, ctx->tpl->nbody, sc) != X_ERR;
}
