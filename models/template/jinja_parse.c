/* jinja_parse.c - the Jinja parser: tokens to an AST, with Jinja2's grammar and precedence.
 *
 * Precedence, loosest first (jinja2/parser.py): inline if-else; or; and; not; comparisons
 * (== != < <= > >= in, not in; chained); + -; ~; * / // %; ** (left-associative, as in Jinja);
 * unary - +; then postfix .attr [sub] (call), then |filter and `is` tests, which therefore bind
 * tighter than any binary operator: `messages|length - 1` is `(messages|length) - 1`.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "models/template/template_internal.h"

enum { PARSE_MAX_DEPTH = 200 };

typedef struct parser {
  kiln_template_t *tpl;
  const tok_t *toks;
  size_t n, pos;
  kiln_status_t err;
  int depth;
  int loops; /* enclosing for loops, for break/continue */
} parser_t;

typedef struct nvec {
  tnode_t **v;
  size_t n, cap;
} nvec_t;

static const tok_t *cur(parser_t *p) { return &p->toks[p->pos < p->n ? p->pos : p->n - 1]; }
static const tok_t *peek(parser_t *p, size_t k) {
  size_t i = p->pos + k;
  return &p->toks[i < p->n ? i : p->n - 1];
}
static void adv(parser_t *p) {
  if (p->pos + 1 < p->n) p->pos++;
}

static bool pfail(parser_t *p, const tok_t *t, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static bool pfail(parser_t *p, const tok_t *t, const char *fmt, ...) {
  if (p->err) return false;
  char msg[300];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  p->err = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s:%d: %s", p->tpl->name, t->line, msg);
  return false;
}

/* Out of memory is not a syntax error: its own code, no line. */
static bool poom(parser_t *p) {
  if (!p->err) p->err = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", p->tpl->name);
  return false;
}

static bool is_op(const tok_t *t, const char *op) {
  size_t l = strlen(op);
  return t->kind == TK_OP && t->n == l && memcmp(t->s, op, l) == 0;
}
static bool is_name(const tok_t *t, const char *nm) {
  size_t l = strlen(nm);
  return t->kind == TK_NAME && t->n == l && memcmp(t->s, nm, l) == 0;
}

/* A short description of a token for messages. */
static const char *tok_desc(const tok_t *t, char *buf, size_t cap) {
  switch (t->kind) {
    case TK_EOF: return "end of template";
    case TK_TEXT: return "template data";
    case TK_VAR_BEGIN: return "'{{'";
    case TK_VAR_END: return "end of print statement";
    case TK_BLOCK_BEGIN: return "'{%'";
    case TK_BLOCK_END: return "end of statement block";
    case TK_STRING: return "string";
    case TK_INT: return "integer";
    case TK_FLOAT: return "float";
    default: snprintf(buf, cap, "'%.*s'", (int)(t->n > 40 ? 40 : t->n), t->s); return buf;
  }
}

static bool expect_op(parser_t *p, const char *op) {
  if (is_op(cur(p), op)) {
    adv(p);
    return true;
  }
  char b[64];
  return pfail(p, cur(p), "expected '%s', got %s", op, tok_desc(cur(p), b, sizeof b));
}

static bool expect_kind(parser_t *p, tok_kind_t k, const char *what) {
  if (cur(p)->kind == k) {
    adv(p);
    return true;
  }
  char b[64];
  return pfail(p, cur(p), "expected %s, got %s", what, tok_desc(cur(p), b, sizeof b));
}

static tnode_t *mk(parser_t *p, int kind, int line) {
  tnode_t *nd = kiln_arena_zalloc(&p->tpl->arena, sizeof *nd, KILN_ARENA_MAX_ALIGN);
  if (!nd) {
    poom(p);
    return NULL;
  }
  nd->kind = kind;
  nd->line = line;
  return nd;
}

static bool set_name(parser_t *p, tnode_t *nd, const char *s, size_t n) {
  char *c = kiln_arena_strndup(&p->tpl->arena, s, n);
  if (!c) {
    poom(p);
    return false;
  }
  nd->name = c;
  nd->name_len = n;
  return true;
}

static bool nv_push(parser_t *p, nvec_t *v, tnode_t *nd) {
  if (!nd) return false;
  if (v->n == v->cap) {
    size_t cap = v->cap ? v->cap * 2 : 4;
    tnode_t **a = kiln_arena_zalloc(&p->tpl->arena, cap * sizeof *a, KILN_ARENA_MAX_ALIGN);
    if (!a) {
      poom(p);
      return false;
    }
    if (v->n) memcpy(a, v->v, v->n * sizeof *a);
    v->v = a;
    v->cap = cap;
  }
  v->v[v->n++] = nd;
  return true;
}

static tnode_t *parse_expr(parser_t *p, bool with_cond);
static tnode_t *parse_unary(parser_t *p, bool with_filter);
static tnode_t *parse_primary(parser_t *p);
static tnode_t *parse_postfix(parser_t *p, tnode_t *nd);
static tnode_t *parse_or(parser_t *p);

static bool tuple_end(parser_t *p) {
  const tok_t *t = cur(p);
  return t->kind == TK_VAR_END || t->kind == TK_BLOCK_END || t->kind == TK_EOF || is_op(t, ")") ||
         is_name(t, "recursive") || is_name(t, "in") || is_op(t, "=") || is_op(t, "|");
}

/* expr [, expr]* as a tuple when there is a comma. with_cond=false stops before `if`
 * (for-loop iterables). explicit: inside parentheses, where "()" is the empty tuple. */
static tnode_t *parse_tuple(parser_t *p, bool with_cond, bool explicit) {
  int line = cur(p)->line;
  nvec_t v = {0};
  bool comma = false;
  for (;;) {
    if (v.n) {
      if (!is_op(cur(p), ",")) break;
      adv(p);
      comma = true;
    }
    if (tuple_end(p)) break;
    tnode_t *e = with_cond ? parse_expr(p, true) : parse_or(p);
    if (!nv_push(p, &v, e)) return NULL;
  }
  if (!comma && v.n == 1) return v.v[0];
  if (v.n == 0 && !explicit) {
    char b[64];
    pfail(p, cur(p), "expected an expression, got %s", tok_desc(cur(p), b, sizeof b));
    return NULL;
  }
  tnode_t *t = mk(p, N_TUPLE, line);
  if (!t) return NULL;
  t->items = v.v;
  t->n = v.n;
  return t;
}

static tnode_t *parse_expr(parser_t *p, bool with_cond) {
  if (++p->depth > PARSE_MAX_DEPTH) {
    pfail(p, cur(p), "expression nested too deeply");
    return NULL;
  }
  tnode_t *e = parse_or(p);
  while (e && with_cond && is_name(cur(p), "if")) {
    int line = cur(p)->line;
    adv(p);
    tnode_t *c = mk(p, N_COND, line);
    if (!c) return NULL;
    c->b = e;
    if (!(c->a = parse_or(p))) return NULL;
    if (is_name(cur(p), "else")) {
      adv(p);
      if (!(c->c = parse_expr(p, true))) return NULL;
    }
    e = c;
  }
  p->depth--;
  return e;
}

static tnode_t *parse_not(parser_t *p);
static tnode_t *parse_and(parser_t *p) {
  tnode_t *e = parse_not(p);
  while (e && is_name(cur(p), "and")) {
    tnode_t *n = mk(p, N_AND, cur(p)->line);
    adv(p);
    if (!n) return NULL;
    n->a = e;
    if (!(n->b = parse_not(p))) return NULL;
    e = n;
  }
  return e;
}

static tnode_t *parse_or(parser_t *p) {
  tnode_t *e = parse_and(p);
  while (e && is_name(cur(p), "or")) {
    tnode_t *n = mk(p, N_OR, cur(p)->line);
    adv(p);
    if (!n) return NULL;
    n->a = e;
    if (!(n->b = parse_and(p))) return NULL;
    e = n;
  }
  return e;
}

static tnode_t *parse_math1(parser_t *p);
static tnode_t *parse_compare(parser_t *p) {
  tnode_t *e = parse_math1(p);
  if (!e) return NULL;
  nvec_t v = {0};
  int ops[64];
  size_t nops = 0;
  int line = cur(p)->line;
  for (;;) {
    const tok_t *t = cur(p);
    int op = -1;
    if (is_op(t, "=="))
      op = CMP_EQ;
    else if (is_op(t, "!="))
      op = CMP_NE;
    else if (is_op(t, "<"))
      op = CMP_LT;
    else if (is_op(t, "<="))
      op = CMP_LE;
    else if (is_op(t, ">"))
      op = CMP_GT;
    else if (is_op(t, ">="))
      op = CMP_GE;
    else if (is_name(t, "in"))
      op = CMP_IN;
    else if (is_name(t, "not") && is_name(peek(p, 1), "in"))
      op = CMP_NOTIN;
    if (op < 0) break;
    adv(p);
    if (op == CMP_NOTIN) adv(p);
    if (nops == sizeof ops / sizeof *ops) {
      pfail(p, t, "too many chained comparisons");
      return NULL;
    }
    ops[nops++] = op;
    if (!nv_push(p, &v, parse_math1(p))) return NULL;
  }
  if (!nops) return e;
  tnode_t *c = mk(p, N_COMPARE, line);
  if (!c) return NULL;
  c->a = e;
  c->items = v.v;
  c->n = v.n;
  c->ops = kiln_arena_zalloc(&p->tpl->arena, nops * sizeof *c->ops, KILN_ARENA_MAX_ALIGN);
  if (!c->ops) {
    poom(p);
    return NULL;
  }
  memcpy(c->ops, ops, nops * sizeof *ops);
  return c;
}

static tnode_t *parse_not(parser_t *p) {
  if (is_name(cur(p), "not")) {
    tnode_t *n = mk(p, N_NOT, cur(p)->line);
    adv(p);
    if (!n) return NULL;
    if (++p->depth > PARSE_MAX_DEPTH) {
      pfail(p, cur(p), "expression nested too deeply");
      return NULL;
    }
    n->a = parse_not(p);
    p->depth--;
    return n->a ? n : NULL;
  }
  return parse_compare(p);
}

static tnode_t *bin(parser_t *p, int op, int line, tnode_t *a, tnode_t *b) {
  if (!a || !b) return NULL;
  tnode_t *n = mk(p, N_BIN, line);
  if (!n) return NULL;
  n->op = op;
  n->a = a;
  n->b = b;
  return n;
}

static tnode_t *parse_pow(parser_t *p) {
  tnode_t *e = parse_unary(p, true);
  while (e && is_op(cur(p), "**")) {
    int line = cur(p)->line;
    adv(p);
    e = bin(p, 'p', line, e, parse_unary(p, true));
  }
  return e;
}

static tnode_t *parse_math2(parser_t *p) {
  tnode_t *e = parse_pow(p);
  for (;;) {
    const tok_t *t = cur(p);
    int op = is_op(t, "*")    ? '*'
             : is_op(t, "/")  ? '/'
             : is_op(t, "//") ? 'f'
             : is_op(t, "%")  ? '%'
                              : 0;
    if (!e || !op) return e;
    adv(p);
    e = bin(p, op, t->line, e, parse_pow(p));
  }
}

static tnode_t *parse_concat(parser_t *p) {
  tnode_t *e = parse_math2(p);
  while (e && is_op(cur(p), "~")) {
    int line = cur(p)->line;
    adv(p);
    e = bin(p, '~', line, e, parse_math2(p));
  }
  return e;
}

static tnode_t *parse_math1(parser_t *p) {
  tnode_t *e = parse_concat(p);
  for (;;) {
    const tok_t *t = cur(p);
    int op = is_op(t, "+") ? '+' : is_op(t, "-") ? '-' : 0;
    if (!e || !op) return e;
    adv(p);
    e = bin(p, op, t->line, e, parse_concat(p));
  }
}

/* (args) after the '(' was seen: positional expressions then name=expr keywords. */
static bool parse_args(parser_t *p, tnode_t *call) {
  nvec_t v = {0};
  if (!expect_op(p, "(")) return false;
  bool kw = false;
  while (!is_op(cur(p), ")")) {
    if (v.n && !expect_op(p, ",")) return false;
    if (is_op(cur(p), ")")) break;
    const tok_t *t = cur(p);
    if (is_op(t, "*") || is_op(t, "**"))
      return pfail(p, t, "*args and **kwargs in calls are not supported");
    if (t->kind == TK_NAME && is_op(peek(p, 1), "=")) {
      tnode_t *k = mk(p, N_KWARG, t->line);
      if (!k || !set_name(p, k, t->s, t->n)) return false;
      adv(p);
      adv(p);
      if (!(k->a = parse_expr(p, true))) return false;
      if (!nv_push(p, &v, k)) return false;
      kw = true;
    } else {
      if (kw) return pfail(p, t, "positional argument follows keyword argument");
      if (!nv_push(p, &v, parse_expr(p, true))) return false;
    }
  }
  adv(p);
  call->items = v.v;
  call->n = v.n;
  return true;
}

/* A dotted name after '|' or 'is' ("tojson", "default"). */
static bool parse_dotted(parser_t *p, tnode_t *nd) {
  const tok_t *t = cur(p);
  if (t->kind != TK_NAME) {
    char b[64];
    return pfail(p, t, "expected a filter or test name, got %s", tok_desc(t, b, sizeof b));
  }
  adv(p);
  size_t len = t->n;
  while (is_op(cur(p), ".") && peek(p, 1)->kind == TK_NAME) {
    len = (size_t)(peek(p, 1)->s + peek(p, 1)->n - t->s);
    adv(p);
    adv(p);
  }
  return set_name(p, nd, t->s, len);
}

static tnode_t *parse_filter(parser_t *p, tnode_t *obj) {
  int line = cur(p)->line;
  adv(p); /* '|' */
  tnode_t *f = mk(p, N_FILTER, line);
  if (!f || !parse_dotted(p, f)) return NULL;
  f->a = obj;
  if (is_op(cur(p), "(") && !parse_args(p, f)) return NULL;
  return f;
}

static tnode_t *parse_test(parser_t *p, tnode_t *obj) {
  int line = cur(p)->line;
  adv(p); /* 'is' */
  tnode_t *t = mk(p, N_TEST, line);
  if (!t) return NULL;
  t->a = obj;
  if (is_name(cur(p), "not")) {
    t->op = 1;
    adv(p);
  }
  if (!parse_dotted(p, t)) return NULL;
  const tok_t *c = cur(p);
  if (is_op(c, "(")) {
    if (!parse_args(p, t)) return NULL;
  } else if ((c->kind == TK_NAME || c->kind == TK_STRING || c->kind == TK_INT ||
              c->kind == TK_FLOAT || is_op(c, "[") || is_op(c, "{")) &&
             !is_name(c, "else") && !is_name(c, "or") && !is_name(c, "and") && !is_name(c, "if") &&
             !is_name(c, "in") && !is_name(c, "not") && !is_name(c, "is")) {
    tnode_t *arg = parse_postfix(p, parse_primary(p));
    if (!arg) return NULL;
    t->items = kiln_arena_zalloc(&p->tpl->arena, sizeof *t->items, KILN_ARENA_MAX_ALIGN);
    if (!t->items) return NULL;
    t->items[0] = arg;
    t->n = 1;
  }
  return t;
}

static tnode_t *parse_subscript(parser_t *p, tnode_t *obj) {
  const tok_t *t = cur(p);
  if (is_op(t, ".")) {
    adv(p);
    const tok_t *a = cur(p);
    if (a->kind == TK_NAME) {
      adv(p);
      tnode_t *n = mk(p, N_ATTR, t->line);
      if (!n || !set_name(p, n, a->s, a->n)) return NULL;
      n->a = obj;
      return n;
    }
    if (a->kind == TK_INT) {
      adv(p);
      tnode_t *n = mk(p, N_ITEM, t->line), *k = mk(p, N_LIT, t->line);
      if (!n || !k) return NULL;
      k->lit = tv_int(a->i);
      n->a = obj;
      n->b = k;
      return n;
    }
    char b[64];
    pfail(p, a, "expected a name after '.', got %s", tok_desc(a, b, sizeof b));
    return NULL;
  }
  adv(p); /* '[' */
  tnode_t *parts[3] = {NULL, NULL, NULL};
  int np = 0;
  bool slice = false;
  for (;;) {
    if (is_op(cur(p), ":")) {
      slice = true;
      if (np == 2) {
        pfail(p, cur(p), "too many ':' in a slice");
        return NULL;
      }
      np++;
      adv(p);
      continue;
    }
    if (is_op(cur(p), "]")) break;
    if (parts[np]) {
      char b[64];
      pfail(p, cur(p), "expected ']', got %s", tok_desc(cur(p), b, sizeof b));
      return NULL;
    }
    if (!(parts[np] = parse_expr(p, true))) return NULL;
    if (is_op(cur(p), ",")) {
      pfail(p, cur(p), "tuple subscripts are not supported");
      return NULL;
    }
  }
  adv(p);
  if (!slice && !parts[0]) {
    pfail(p, t, "expected an expression inside '[]'");
    return NULL;
  }
  tnode_t *n = mk(p, slice ? N_SLICE : N_ITEM, t->line);
  if (!n) return NULL;
  n->a = obj;
  if (slice) {
    n->items = kiln_arena_zalloc(&p->tpl->arena, 3 * sizeof *n->items, KILN_ARENA_MAX_ALIGN);
    if (!n->items) return NULL;
    memcpy(n->items, parts, sizeof parts);
    n->n = 3;
  } else {
    n->b = parts[0];
  }
  return n;
}

static tnode_t *parse_postfix(parser_t *p, tnode_t *nd) {
  while (nd) {
    const tok_t *t = cur(p);
    if (is_op(t, ".") || is_op(t, "[")) {
      nd = parse_subscript(p, nd);
    } else if (is_op(t, "(")) {
      tnode_t *c = mk(p, N_CALL, t->line);
      if (!c) return NULL;
      c->a = nd;
      if (!parse_args(p, c)) return NULL;
      nd = c;
    } else {
      break;
    }
  }
  return nd;
}

static tnode_t *parse_filter_expr(parser_t *p, tnode_t *nd) {
  while (nd) {
    const tok_t *t = cur(p);
    if (is_op(t, "|"))
      nd = parse_filter(p, nd);
    else if (is_name(t, "is"))
      nd = parse_test(p, nd);
    else if (is_op(t, "("))
      nd = parse_postfix(p, nd);
    else
      break;
  }
  return nd;
}

static tnode_t *parse_unary(parser_t *p, bool with_filter) {
  const tok_t *t = cur(p);
  tnode_t *nd;
  if (++p->depth > PARSE_MAX_DEPTH) {
    pfail(p, t, "expression nested too deeply");
    return NULL;
  }
  if (is_op(t, "-") || is_op(t, "+")) {
    adv(p);
    nd = mk(p, t->s[0] == '-' ? N_NEG : N_POS, t->line);
    if (nd && !(nd->a = parse_unary(p, false))) nd = NULL;
  } else {
    nd = parse_primary(p);
  }
  nd = parse_postfix(p, nd);
  if (with_filter) nd = parse_filter_expr(p, nd);
  p->depth--;
  return nd;
}

static tnode_t *parse_primary(parser_t *p) {
  const tok_t *t = cur(p);
  tnode_t *nd;
  switch (t->kind) {
    case TK_NAME:
      adv(p);
      if (!(nd = mk(p, N_LIT, t->line))) return NULL;
      if (is_name(t, "true") || is_name(t, "True"))
        nd->lit = tv_bool(true);
      else if (is_name(t, "false") || is_name(t, "False"))
        nd->lit = tv_bool(false);
      else if (is_name(t, "none") || is_name(t, "None"))
        nd->lit = tv_none();
      else {
        nd->kind = N_NAME;
        if (!set_name(p, nd, t->s, t->n)) return NULL;
      }
      return nd;
    case TK_STRING: {
      if (!(nd = mk(p, N_LIT, t->line))) return NULL;
      adv(p);
      if (cur(p)->kind != TK_STRING) {
        nd->lit = tv_str(t->s, t->n);
        return nd;
      }
      /* adjacent literals concatenate: "a" "b" */
      kiln_strbuf_t sb = KILN_STRBUF_INIT;
      kiln_strbuf_append(&sb, t->s, t->n);
      while (cur(p)->kind == TK_STRING) {
        kiln_strbuf_append(&sb, cur(p)->s, cur(p)->n);
        adv(p);
      }
      char *s = kiln_strbuf_ok(&sb) ? kiln_arena_strndup(&p->tpl->arena, sb.data, sb.len) : NULL;
      nd->lit = tv_str(s, sb.len);
      kiln_strbuf_free(&sb);
      if (!s) {
        poom(p);
        return NULL;
      }
      return nd;
    }
    case TK_INT:
    case TK_FLOAT:
      adv(p);
      if (!(nd = mk(p, N_LIT, t->line))) return NULL;
      nd->lit = t->kind == TK_INT ? tv_int(t->i) : tv_float(t->f);
      return nd;
    default: break;
  }
  if (is_op(t, "(")) {
    adv(p);
    nd = parse_tuple(p, true, true);
    if (nd && !expect_op(p, ")")) return NULL;
    return nd;
  }
  if (is_op(t, "[") || is_op(t, "{")) {
    bool dict = is_op(t, "{");
    const char *close = dict ? "}" : "]";
    adv(p);
    nvec_t v = {0};
    while (!is_op(cur(p), close)) {
      if (v.n && !expect_op(p, ",")) return NULL;
      if (is_op(cur(p), close)) break;
      if (!nv_push(p, &v, parse_expr(p, true))) return NULL;
      if (dict) {
        if (!expect_op(p, ":")) return NULL;
        if (!nv_push(p, &v, parse_expr(p, true))) return NULL;
      }
    }
    adv(p);
    if (!(nd = mk(p, dict ? N_DICT : N_LIST, t->line))) return NULL;
    nd->items = v.v;
    nd->n = v.n;
    return nd;
  }
  char b[64];
  pfail(p, t, "unexpected %s", tok_desc(t, b, sizeof b));
  return NULL;
}

/* ---- statements ----------------------------------------------------------------------------- */

static bool parse_body(parser_t *p, const char *const *ends, const char *opener, nvec_t *out,
                       const tok_t **out_end);

/* Consumes "{% endX %}" (the '{%' and the name were already seen by parse_body). */
static bool end_block(parser_t *p) {
  return expect_kind(p, TK_BLOCK_END, "end of statement block");
}

static bool parse_target(parser_t *p, nvec_t *targets) {
  bool paren = is_op(cur(p), "(");
  if (paren) adv(p);
  for (;;) {
    const tok_t *t = cur(p);
    if (t->kind != TK_NAME) {
      char b[64];
      return pfail(p, t, "expected a loop or assignment target name, got %s",
                   tok_desc(t, b, sizeof b));
    }
    tnode_t *nd = mk(p, N_NAME, t->line);
    if (!nd || !set_name(p, nd, t->s, t->n) || !nv_push(p, targets, nd)) return false;
    adv(p);
    if (!is_op(cur(p), ",")) break;
    adv(p);
    if (paren && is_op(cur(p), ")")) break;
  }
  return paren ? expect_op(p, ")") : true;
}

static tnode_t *parse_for(parser_t *p, const tok_t *kw) {
  tnode_t *nd = mk(p, S_FOR, kw->line);
  nvec_t targets = {0}, body = {0}, ebody = {0};
  if (!nd || !parse_target(p, &targets)) return NULL;
  if (!is_name(cur(p), "in")) {
    char b[64];
    pfail(p, cur(p), "expected 'in' in the for loop, got %s", tok_desc(cur(p), b, sizeof b));
    return NULL;
  }
  adv(p);
  if (!(nd->a = parse_tuple(p, false, false))) return NULL;
  if (is_name(cur(p), "if")) {
    adv(p);
    if (!(nd->b = parse_expr(p, true))) return NULL;
  }
  if (is_name(cur(p), "recursive")) {
    adv(p);
    nd->op = 1;
  }
  if (!end_block(p)) return NULL;
  static const char *const ends[] = {"endfor", "else", NULL};
  const tok_t *end;
  p->loops++;
  bool ok = parse_body(p, ends, "for", &body, &end);
  p->loops--;
  if (!ok) return NULL;
  if (is_name(end, "else")) {
    static const char *const ends2[] = {"endfor", NULL};
    if (!end_block(p) || !parse_body(p, ends2, "for", &ebody, &end)) return NULL;
  }
  if (!end_block(p)) return NULL;
  nd->items = targets.v;
  nd->n = targets.n;
  nd->body = body.v;
  nd->nbody = body.n;
  nd->ebody = ebody.v;
  nd->nebody = ebody.n;
  return nd;
}

static tnode_t *parse_if(parser_t *p, const tok_t *kw) {
  tnode_t *nd = mk(p, S_IF, kw->line);
  nvec_t body = {0}, ebody = {0};
  if (!nd || !(nd->a = parse_tuple(p, true, false)) || !end_block(p)) return NULL;
  static const char *const ends[] = {"endif", "elif", "else", NULL};
  const tok_t *end;
  if (!parse_body(p, ends, "if", &body, &end)) return NULL;
  nd->body = body.v;
  nd->nbody = body.n;
  if (is_name(end, "elif")) {
    tnode_t *e = parse_if(p, end); /* consumes through the shared endif */
    if (!e || !nv_push(p, &ebody, e)) return NULL;
    nd->ebody = ebody.v;
    nd->nebody = ebody.n;
    return nd;
  }
  if (is_name(end, "else")) {
    static const char *const ends2[] = {"endif", NULL};
    if (!end_block(p) || !parse_body(p, ends2, "if", &ebody, &end)) return NULL;
    nd->ebody = ebody.v;
    nd->nebody = ebody.n;
  }
  return end_block(p) ? nd : NULL;
}

static tnode_t *parse_set(parser_t *p, const tok_t *kw) {
  tnode_t *nd = mk(p, S_SET, kw->line);
  if (!nd) return NULL;
  const tok_t *t = cur(p);
  if (t->kind == TK_NAME && is_op(peek(p, 1), ".") && peek(p, 2)->kind == TK_NAME) {
    /* set ns.attr = value */
    tnode_t *obj = mk(p, N_NAME, t->line), *attr = mk(p, N_ATTR, t->line);
    if (!obj || !attr || !set_name(p, obj, t->s, t->n)) return NULL;
    if (!set_name(p, attr, peek(p, 2)->s, peek(p, 2)->n)) return NULL;
    attr->a = obj;
    nd->a = attr;
    adv(p);
    adv(p);
    adv(p);
  } else {
    nvec_t targets = {0};
    if (!parse_target(p, &targets)) return NULL;
    nd->items = targets.v;
    nd->n = targets.n;
  }
  if (is_op(cur(p), "=")) {
    adv(p);
    if (!(nd->b = parse_tuple(p, true, false)) || !end_block(p)) return NULL;
    return nd;
  }
  if (nd->a || nd->n != 1) {
    char b[64];
    pfail(p, cur(p), "expected '=' in set, got %s", tok_desc(cur(p), b, sizeof b));
    return NULL;
  }
  /* block set, optionally filtered: {% set x | upper %}...{% endset %} */
  tnode_t *chain = NULL;
  while (is_op(cur(p), "|")) {
    if (!(chain = parse_filter(p, chain))) return NULL;
  }
  nd->c = chain;
  if (!end_block(p)) return NULL;
  nvec_t body = {0};
  static const char *const ends[] = {"endset", NULL};
  const tok_t *end;
  if (!parse_body(p, ends, "set", &body, &end) || !end_block(p)) return NULL;
  nd->body = body.v;
  nd->nbody = body.n;
  return nd;
}

/* Macro (or call-block caller) parameters "(a, b=1)" into *params. */
static bool parse_params(parser_t *p, nvec_t *params) {
  if (!expect_op(p, "(")) return false;
  bool defaults = false;
  while (!is_op(cur(p), ")")) {
    if (params->n && !expect_op(p, ",")) return false;
    if (is_op(cur(p), ")")) break;
    const tok_t *a = cur(p);
    if (a->kind != TK_NAME) {
      char b[64];
      return pfail(p, a, "expected a parameter name, got %s", tok_desc(a, b, sizeof b));
    }
    adv(p);
    tnode_t *pn = mk(p, N_NAME, a->line);
    if (!pn || !set_name(p, pn, a->s, a->n)) return false;
    if (is_op(cur(p), "=")) {
      adv(p);
      pn->kind = N_KWARG;
      if (!(pn->a = parse_expr(p, true))) return false;
      defaults = true;
    } else if (defaults) {
      return pfail(p, a, "non-default argument follows default argument");
    }
    if (!nv_push(p, params, pn)) return false;
  }
  adv(p);
  return true;
}

/* Whether body loads the name (outside nested macros), as Jinja's find_undeclared decides if a
 * macro takes caller, varargs or kwargs. */
static bool uses_name(const tnode_t *nd, const char *name, int depth) {
  if (!nd || depth > 4 * PARSE_MAX_DEPTH) return false;
  if (nd->kind == N_NAME && nd->name && !strcmp(nd->name, name)) return true;
  if (nd->kind == S_MACRO) return false;
  if (uses_name(nd->a, name, depth + 1) || uses_name(nd->b, name, depth + 1) ||
      uses_name(nd->c, name, depth + 1))
    return true;
  for (size_t i = 0; i < nd->n; i++)
    if (uses_name(nd->items[i], name, depth + 1)) return true;
  for (size_t i = 0; i < nd->nbody; i++)
    if (uses_name(nd->body[i], name, depth + 1)) return true;
  for (size_t i = 0; i < nd->nebody; i++)
    if (uses_name(nd->ebody[i], name, depth + 1)) return true;
  return false;
}

/* Sets a macro's MACRO_* flags from its body. */
static void macro_flags(tnode_t *nd) {
  nd->op = 0;
  for (size_t i = 0; i < nd->nbody; i++) {
    if (uses_name(nd->body[i], "caller", 0)) nd->op |= MACRO_CALLER;
    if (uses_name(nd->body[i], "varargs", 0)) nd->op |= MACRO_VARARGS;
    if (uses_name(nd->body[i], "kwargs", 0)) nd->op |= MACRO_KWARGS;
  }
}

static tnode_t *parse_macro(parser_t *p, const tok_t *kw) {
  tnode_t *nd = mk(p, S_MACRO, kw->line);
  const tok_t *t = cur(p);
  if (!nd) return NULL;
  if (t->kind != TK_NAME) {
    pfail(p, t, "expected a macro name");
    return NULL;
  }
  if (!set_name(p, nd, t->s, t->n)) return NULL;
  adv(p);
  nvec_t params = {0}, body = {0};
  if (!parse_params(p, &params) || !end_block(p)) return NULL;
  static const char *const ends[] = {"endmacro", NULL};
  const tok_t *end;
  int loops = p->loops;
  p->loops = 0;
  bool ok = parse_body(p, ends, "macro", &body, &end);
  p->loops = loops;
  if (!ok || !end_block(p)) return NULL;
  nd->items = params.v;
  nd->n = params.n;
  nd->body = body.v;
  nd->nbody = body.n;
  macro_flags(nd);
  return nd;
}

/* {% call[(params)] macro(args) %}body{% endcall %}: a is the call, b the caller (an S_MACRO
 * named "caller" holding the params and body). */
static tnode_t *parse_call_block(parser_t *p, const tok_t *kw) {
  tnode_t *nd = mk(p, S_CALLBLOCK, kw->line), *caller = mk(p, S_MACRO, kw->line);
  nvec_t params = {0}, body = {0};
  if (!nd || !caller || !set_name(p, caller, "caller", 6)) return NULL;
  if (is_op(cur(p), "(") && !parse_params(p, &params)) return NULL;
  const tok_t *t = cur(p);
  if (!(nd->a = parse_expr(p, true))) return NULL;
  if (nd->a->kind != N_CALL) {
    pfail(p, t, "expected call");
    return NULL;
  }
  if (!end_block(p)) return NULL;
  static const char *const ends[] = {"endcall", NULL};
  const tok_t *end;
  int loops = p->loops;
  p->loops = 0;
  bool ok = parse_body(p, ends, "call", &body, &end);
  p->loops = loops;
  if (!ok || !end_block(p)) return NULL;
  caller->items = params.v;
  caller->n = params.n;
  caller->body = body.v;
  caller->nbody = body.n;
  macro_flags(caller);
  nd->b = caller;
  return nd;
}

static tnode_t *parse_simple_block(parser_t *p, int kind, const tok_t *kw, const char *endname) {
  tnode_t *nd = mk(p, kind, kw->line);
  if (!nd || !end_block(p)) return NULL;
  const char *ends[] = {endname, NULL};
  nvec_t body = {0};
  const tok_t *end;
  if (!parse_body(p, ends, endname + 3, &body, &end) || !end_block(p)) return NULL;
  nd->body = body.v;
  nd->nbody = body.n;
  return nd;
}

static tnode_t *parse_statement(parser_t *p) {
  const tok_t *kw = cur(p);
  char b[64];
  if (kw->kind != TK_NAME) {
    pfail(p, kw, "expected a statement name, got %s", tok_desc(kw, b, sizeof b));
    return NULL;
  }
  adv(p);
  if (is_name(kw, "for")) return parse_for(p, kw);
  if (is_name(kw, "if")) return parse_if(p, kw);
  if (is_name(kw, "set")) return parse_set(p, kw);
  if (is_name(kw, "macro")) return parse_macro(p, kw);
  if (is_name(kw, "call")) return parse_call_block(p, kw);
  if (is_name(kw, "generation")) return parse_simple_block(p, S_SCOPE, kw, "endgeneration");
  if (is_name(kw, "break") || is_name(kw, "continue")) {
    if (!p->loops) {
      pfail(p, kw, "'%.*s' outside of a loop", (int)kw->n, kw->s);
      return NULL;
    }
    tnode_t *nd = mk(p, is_name(kw, "break") ? S_BREAK : S_CONTINUE, kw->line);
    return nd && end_block(p) ? nd : NULL;
  }
  if (is_name(kw, "filter")) {
    tnode_t *chain = NULL;
    do {
      /* the first filter has no leading '|'; fake one by parsing from the name */
      if (is_op(cur(p), "|")) {
        chain = parse_filter(p, chain);
      } else {
        tnode_t *f = mk(p, N_FILTER, cur(p)->line);
        if (!f || !parse_dotted(p, f)) return NULL;
        f->a = chain;
        if (is_op(cur(p), "(") && !parse_args(p, f)) return NULL;
        chain = f;
      }
      if (!chain) return NULL;
    } while (is_op(cur(p), "|"));
    tnode_t *blk = parse_simple_block(p, S_FILTERBLOCK, kw, "endfilter");
    if (!blk) return NULL;
    blk->a = chain;
    return blk;
  }
  if (is_name(kw, "with")) {
    nvec_t assigns = {0};
    while (cur(p)->kind == TK_NAME) {
      const tok_t *t = cur(p);
      if (!is_op(peek(p, 1), "=")) break;
      tnode_t *k = mk(p, N_KWARG, t->line);
      if (!k || !set_name(p, k, t->s, t->n)) return NULL;
      adv(p);
      adv(p);
      if (!(k->a = parse_expr(p, true)) || !nv_push(p, &assigns, k)) return NULL;
      if (!is_op(cur(p), ",")) break;
      adv(p);
    }
    tnode_t *blk = parse_simple_block(p, S_WITH, kw, "endwith");
    if (!blk) return NULL;
    blk->items = assigns.v;
    blk->n = assigns.n;
    return blk;
  }
  static const char *const unsupported[] = {"include", "import",     "from",  "extends", "block",
                                            "do",      "autoescape", "trans", NULL};
  for (int i = 0; unsupported[i]; i++)
    if (is_name(kw, unsupported[i])) {
      pfail(p, kw, "the '%s' tag is not supported in chat templates", unsupported[i]);
      return NULL;
    }
  pfail(p, kw, "unknown tag '%.*s'", (int)(kw->n > 40 ? 40 : kw->n), kw->s);
  return NULL;
}

/* Parses nodes until "{% <one of ends> " (left with the name consumed, *out_end the name token)
 * or EOF (only when ends is NULL). */
static bool parse_body(parser_t *p, const char *const *ends, const char *opener, nvec_t *out,
                       const tok_t **out_end) {
  for (;;) {
    const tok_t *t = cur(p);
    switch (t->kind) {
      case TK_EOF:
        if (!ends) return true;
        return pfail(p, t, "unexpected end of template: the '%s' block needs '{%% %s %%}'", opener,
                     ends[0]);
      case TK_TEXT: {
        tnode_t *nd = mk(p, S_TEXT, t->line);
        if (!nd) return false;
        nd->lit = tv_str(t->s, t->n);
        if (!nv_push(p, out, nd)) return false;
        adv(p);
        break;
      }
      case TK_VAR_BEGIN: {
        adv(p);
        tnode_t *nd = mk(p, S_OUTPUT, t->line);
        if (!nd || !(nd->a = parse_tuple(p, true, false))) return false;
        if (!expect_kind(p, TK_VAR_END, "end of print statement")) return false;
        if (!nv_push(p, out, nd)) return false;
        break;
      }
      case TK_BLOCK_BEGIN: {
        const tok_t *nm = peek(p, 1);
        if (ends) {
          for (int i = 0; ends[i]; i++)
            if (is_name(nm, ends[i])) {
              adv(p);
              adv(p);
              *out_end = nm;
              return true;
            }
        }
        static const char *const closers[] = {"endfor",        "endif",    "elif",      "else",
                                              "endset",        "endmacro", "endfilter", "endwith",
                                              "endgeneration", "endraw",   "endcall",   NULL};
        for (int i = 0; closers[i]; i++)
          if (is_name(nm, closers[i])) {
            if (ends)
              return pfail(p, nm, "unexpected '%s' inside the '%s' block (expected '%s')",
                           closers[i], opener, ends[0]);
            return pfail(p, nm, "unexpected '%s' with no open block", closers[i]);
          }
        adv(p);
        if (!nv_push(p, out, parse_statement(p))) return false;
        break;
      }
      default: {
        char b[64];
        return pfail(p, t, "unexpected %s", tok_desc(t, b, sizeof b));
      }
    }
  }
}

/* Jinja checks filter and test names when it compiles a template, except inside an `if` or an
 * inline if-expression (a "soft" frame), where an unknown name fails only when it runs. Loop,
 * macro, block-set, with and filter bodies start a new, non-soft frame. */
static bool check_names(parser_t *p, const tnode_t *nd, bool soft);
static bool check_list(parser_t *p, tnode_t *const *v, size_t n, bool soft) {
  for (size_t i = 0; i < n; i++)
    if (!check_names(p, v[i], soft)) return false;
  return true;
}
static bool check_names(parser_t *p, const tnode_t *nd, bool soft) {
  if (!nd) return true;
  if (++p->depth > 4 * PARSE_MAX_DEPTH)
    return pfail(p, &(tok_t){.line = nd->line}, "template nested too deeply");
  bool ok = true;
  if (!soft && nd->kind == N_FILTER && !tpl_filter_exists(nd->name))
    ok = pfail(p, &(tok_t){.line = nd->line}, "unknown filter '%s'", nd->name);
  if (ok && !soft && nd->kind == N_TEST && !tpl_test_exists(nd->name))
    ok = pfail(p, &(tok_t){.line = nd->line}, "unknown test '%s'", nd->name);
  bool inner = soft, kids = soft;
  switch (nd->kind) {
    case S_IF:
    case N_COND: kids = inner = true; break;
    case S_FOR: inner = false; break;
    case S_MACRO:
    case S_WITH:
    case S_SCOPE:
    case S_FILTERBLOCK:
      inner = false;
      kids = nd->kind == S_WITH ? soft : false;
      break;
    case S_SET:
      inner = false;
      kids = nd->body ? false : soft;
      break;
    default: break;
  }
  if (ok && nd->kind == S_FOR)
    ok = check_names(p, nd->a, soft) && check_names(p, nd->b, false);
  else if (ok)
    ok = check_names(p, nd->a, kids) && check_names(p, nd->b, kids);
  if (ok) ok = check_names(p, nd->c, kids) && check_list(p, nd->items, nd->n, kids);
  if (ok)
    ok = check_list(p, nd->body, nd->nbody, inner) && check_list(p, nd->ebody, nd->nebody, inner);
  p->depth--;
  return ok;
}

kiln_status_t tpl_parse(kiln_template_t *tpl, const tok_t *toks, size_t ntoks) {
  parser_t p = {.tpl = tpl, .toks = toks, .n = ntoks};
  nvec_t body = {0};
  if (parse_body(&p, NULL, NULL, &body, NULL)) {
    tpl->body = body.v;
    tpl->nbody = body.n;
    p.depth = 0;
    check_list(&p, tpl->body, tpl->nbody, false);
  }
  return p.err;
}
