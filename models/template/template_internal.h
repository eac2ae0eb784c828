/* template_internal.h - the Jinja interpreter's private types: tokens, AST, values and
 * the render context shared by the lexer, parser, evaluator, filters and methods.
 *
 * Memory: a compiled template owns one arena (tokens are temporary; AST nodes and literal
 * strings live in the template's arena). A render owns another arena for every value it makes;
 * values are immutable once built (the sandbox forbids mutating lists and dicts), so they are
 * shared freely and all die together when the render ends. Strings are (pointer, length) slices
 * that may point into the template, into a JSON document or into the render arena.
 */
#ifndef KILN_MODELS_TEMPLATE_INTERNAL_H
#define KILN_MODELS_TEMPLATE_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/arena.h"
#include "base/json.h"
#include "base/status.h"
#include "base/strbuf.h"
#include "models/template/template.h"

/* ---- values --------------------------------------------------------------------------------- */

typedef enum tv_kind {
  TV_UNDEF = 0,
  TV_NONE,
  TV_BOOL,
  TV_INT,
  TV_FLOAT,
  TV_STR,
  TV_LIST, /* also tuples (flag TV_F_TUPLE) */
  TV_DICT,
  TV_NS,
  TV_MACRO,
  TV_FUNC, /* a builtin global function */
  TV_LOOP,
  TV_CYCLER,
  TV_JOINER,
} tv_kind_t;

/* TV_F_GROUP: a (grouper, list) tuple from groupby that also has .grouper and .list */
enum { TV_F_TUPLE = 1, TV_F_SAFE = 2, TV_F_GROUP = 4 };

typedef enum tv_func {
  TF_RANGE,
  TF_NAMESPACE,
  TF_RAISE,
  TF_STRFTIME,
  TF_DICT,
  TF_CYCLER,
  TF_JOINER,
} tv_func_t;

typedef struct tlist tlist_t;
typedef struct tdict tdict_t;
typedef struct tloop tloop_t;
typedef struct tmacro tmacro_t;
typedef struct tnode tnode_t;
typedef struct tscope tscope_t;

typedef struct tv {
  uint8_t kind;
  uint8_t flags;
  union {
    bool b;
    int64_t i;
    double f;
    struct {
      const char *s;
      size_t n;
    } str;
    tlist_t *list;
    tdict_t *dict; /* dicts and namespaces */
    tloop_t *loop;
    tmacro_t *macro;
    tv_func_t func;
    const char *undef; /* TV_UNDEF: the hint for error messages ("'x' is undefined"), or NULL */
  } u;
} tv_t;

struct tlist {
  size_t n;
  tv_t *items;             /* native items, or NULL when json-backed */
  const kiln_json_t *json; /* a JSON array converted element by element on access */
  size_t cycle_pos;        /* cycler state (TV_CYCLER) */
};

struct tdict {
  size_t n, cap;
  tv_t *keys, *vals;       /* native members in insertion order */
  const kiln_json_t *json; /* a JSON object (read-only) */
};

struct tloop {
  tv_t *items;
  int64_t index0, length, depth0;
  const tnode_t *recurse; /* the for node when the loop is `recursive` */
  tscope_t *scope;
};

struct tmacro {
  const tnode_t *def;
  tscope_t *closure;
};

static inline tv_t tv_undef(const char *hint) {
  tv_t v = {TV_UNDEF, 0, {.undef = hint}};
  return v;
}
static inline tv_t tv_none(void) {
  tv_t v = {TV_NONE, 0, {.i = 0}};
  return v;
}
static inline tv_t tv_bool(bool b) {
  tv_t v = {TV_BOOL, 0, {.b = b}};
  return v;
}
static inline tv_t tv_int(int64_t i) {
  tv_t v = {TV_INT, 0, {.i = i}};
  return v;
}
static inline tv_t tv_float(double f) {
  tv_t v = {TV_FLOAT, 0, {.f = f}};
  return v;
}
static inline tv_t tv_str(const char *s, size_t n) {
  tv_t v = {TV_STR, 0, {.str = {s, n}}};
  return v;
}

/* ---- tokens and AST ------------------------------------------------------------------------- */

typedef enum tok_kind {
  TK_EOF = 0,
  TK_TEXT,      /* template data (already whitespace-controlled) */
  TK_VAR_BEGIN, /* {{ */
  TK_VAR_END,   /* }} */
  TK_BLOCK_BEGIN,
  TK_BLOCK_END,
  TK_NAME,
  TK_STRING, /* decoded value in s/n */
  TK_INT,
  TK_FLOAT,
  TK_OP, /* s/n: the operator text */
} tok_kind_t;

typedef struct tok {
  tok_kind_t kind;
  int line;
  const char *s;
  size_t n;
  int64_t i;
  double f;
} tok_t;

typedef enum tnode_kind {
  /* expressions */
  N_LIT,
  N_NAME,
  N_LIST,
  N_TUPLE,
  N_DICT,   /* items: key0, val0, key1, val1, ... */
  N_ATTR,   /* a.name */
  N_ITEM,   /* a[b] */
  N_SLICE,  /* a[b:c:d]; missing parts NULL; b,c in items[0..1], step in items[2] */
  N_CALL,   /* a(items...) ; keyword args are N_KWARG items */
  N_KWARG,  /* name=a */
  N_FILTER, /* a|name(items...) ; a NULL in a filter block */
  N_TEST,   /* a is [not] name(items...) ; op=1 when negated */
  N_NEG,
  N_POS,
  N_NOT,
  N_AND,
  N_OR,
  N_BIN,     /* op: '+', '-', '*', '/', 'f' (//), '%', 'p' (**), '~' */
  N_COMPARE, /* a, then items = operands; ops in the op codes array */
  N_COND,    /* b if a else c */
  /* statements */
  S_TEXT,
  S_OUTPUT,
  S_FOR,         /* items: targets, a: iterable, b: filter, body, ebody (else), op=1 recursive */
  S_IF,          /* a: cond, body, ebody */
  S_SET,         /* items: targets (N_NAME) or a: N_ATTR target; b: value; or body (block set) */
  S_MACRO,       /* name, items: params (N_NAME or N_KWARG with default), body, op: MACRO_* */
  S_CALLBLOCK,   /* a: the call (N_CALL), b: the caller (an S_MACRO named "caller") */
  S_FILTERBLOCK, /* a: filter chain (innermost a NULL), body */
  S_WITH,        /* items: N_KWARG assignments, body */
  S_SCOPE,       /* body in its own scope ({% generation %}) */
  S_BREAK,
  S_CONTINUE,
} tnode_kind_t;

/* S_MACRO op flags: the body uses caller / varargs / kwargs, so the macro accepts them. */
enum { MACRO_CALLER = 1, MACRO_VARARGS = 2, MACRO_KWARGS = 4 };

enum { CMP_EQ, CMP_NE, CMP_LT, CMP_LE, CMP_GT, CMP_GE, CMP_IN, CMP_NOTIN };

struct tnode {
  int kind;
  int op;
  int line;
  const char *name; /* NUL-terminated */
  size_t name_len;
  tnode_t *a, *b, *c;
  tnode_t **items;
  size_t n;
  int *ops; /* N_COMPARE: n operators */
  tnode_t **body;
  size_t nbody;
  tnode_t **ebody;
  size_t nebody;
  tv_t lit;
};

struct kiln_template {
  char *name;
  char *source; /* a copy of the source as given (kiln_template_source) */
  size_t source_len;
  kiln_arena_t arena;
  tnode_t **body;
  size_t nbody;
};

/* Lexes source (newlines normalised, one trailing newline dropped, as Jinja does) into tokens
 * allocated in a (arena). On a syntax error returns a status "<name>:<line>: ...". */
kiln_status_t tpl_lex(const char *src, size_t len, const char *name, kiln_arena_t *a,
                      tok_t **out_toks, size_t *out_n);

/* Parses tokens into the template body. */
kiln_status_t tpl_parse(kiln_template_t *tpl, const tok_t *toks, size_t ntoks);

/* ---- render context ------------------------------------------------------------------------- */

typedef struct tctx {
  const kiln_template_t *tpl;
  kiln_arena_t arena;
  kiln_strbuf_t *out;
  kiln_status_t err;
  int line; /* of the node being evaluated, for messages */
  int depth;
  uint64_t iterations;
  kiln_template_limits_t lim;
  tscope_t *globals;
} tctx_t;

struct tscope {
  tscope_t *parent;
  size_t n, cap;
  const char **names;
  size_t *lens;
  tv_t *vals;
};

/* Records the first error as "<name>:<line>: <msg>" (KILN_ERR_INVALID_ARGUMENT) and returns
 * false, so callers write `return tpl_fail(ctx, ...)`. */
bool tpl_fail(tctx_t *ctx, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
bool tpl_oom(tctx_t *ctx);
void *tpl_alloc(tctx_t *ctx, size_t n); /* arena alloc; records an error on failure */

/* values (jinja_value.c) */
const char *tv_type_name(const tv_t *v); /* Python's type name: "str", "int", "NoneType", ... */
bool tv_truthy(const tv_t *v);
bool tv_is_seq(const tv_t *v); /* list/tuple (not str/dict) */
bool tv_is_iterable(const tv_t *v);
size_t tv_len(const tv_t *v); /* items of a list/dict; code points of a string */
tv_t tv_list_get(tctx_t *ctx, const tv_t *list, size_t i);
bool tv_dict_get(tctx_t *ctx, const tv_t *dict, const tv_t *key, tv_t *out);
bool tv_dict_get_str(tctx_t *ctx, const tv_t *dict, const char *key, size_t n, tv_t *out);
void tv_dict_at(tctx_t *ctx, const tv_t *dict, size_t i, tv_t *out_key, tv_t *out_val);
tv_t tv_from_json(tctx_t *ctx, const kiln_json_t *j);
tv_t tv_new_list(tctx_t *ctx, size_t n); /* n items, all undefined; NULL items on error */
tv_t tv_new_dict(tctx_t *ctx);
bool tv_dict_set(tctx_t *ctx, tv_t *dict, tv_t key, tv_t val); /* native dicts/namespaces */
/* Materialises any iterable (list, dict keys, string code points, undefined = empty) into an
 * array of n values. */
bool tv_iterate(tctx_t *ctx, const tv_t *v, tv_t **out_items, size_t *out_n);
bool tv_eq(const tv_t *a, const tv_t *b);
/* Python ordering (<): sets *out_cmp to -1/0/1; false with an error when unorderable. */
bool tv_cmp(tctx_t *ctx, const tv_t *a, const tv_t *b, int *out_cmp);
/* str(v) and repr(v) appended to out. */
bool tv_write_str(tctx_t *ctx, kiln_strbuf_t *out, const tv_t *v);
bool tv_write_repr(tctx_t *ctx, kiln_strbuf_t *out, const tv_t *v);
/* str(v) as a string value (no copy when v is a string). */
bool tv_to_str(tctx_t *ctx, const tv_t *v, tv_t *out);
bool tv_write_float(kiln_strbuf_t *out, double x); /* Python repr(float) */
typedef struct tjson_opts {
  int indent; /* -1 = none */
  bool sort_keys;
  bool ensure_ascii;
  const char *item_sep, *key_sep;
} tjson_opts_t;
bool tv_write_json(tctx_t *ctx, kiln_strbuf_t *out, const tv_t *v, const tjson_opts_t *o);
tv_t tv_concat_str(tctx_t *ctx, const char *a, size_t an, const char *b, size_t bn);
tv_t tv_from_buf(tctx_t *ctx, const kiln_strbuf_t *b); /* copies into the arena */

/* UTF-8 helpers */
size_t utf8_count(const char *s, size_t n);
size_t utf8_offset(const char *s, size_t n, size_t cp_index); /* byte offset; n when past end */
size_t utf8_next(const char *s, size_t n, size_t pos);        /* start of the next char */

/* evaluator (jinja_eval.c) */
tscope_t *tpl_scope_new(tctx_t *ctx, tscope_t *parent);
bool tpl_scope_set(tctx_t *ctx, tscope_t *sc, const char *name, tv_t v);
bool tpl_exec_template(tctx_t *ctx, tscope_t *sc); /* renders ctx->tpl into ctx->out */
bool tpl_eval(tctx_t *ctx, const tnode_t *e, tscope_t *sc, tv_t *out);
/* obj.name and obj[key] with Jinja's sandboxed getattr/getitem (a miss is an undefined). */
bool tpl_get_attr(tctx_t *ctx, const tv_t *obj, const char *name, size_t n, tv_t *out);
bool tpl_get_item(tctx_t *ctx, const tv_t *obj, const tv_t *key, tv_t *out);
bool tpl_call_value(tctx_t *ctx, const tv_t *fn, const tv_t *args, size_t nargs,
                    const char *const *kwnames, const tv_t *kwvals, size_t nkw, tv_t *out);

/* filters, tests (jinja_filters.c) */
bool tpl_apply_filter(tctx_t *ctx, const char *name, const tv_t *in, const tv_t *args, size_t nargs,
                      const char *const *kwnames, const tv_t *kwvals, size_t nkw, tv_t *out);
bool tpl_apply_test(tctx_t *ctx, const char *name, const tv_t *in, const tv_t *args, size_t nargs,
                    bool *out);
bool tpl_filter_exists(const char *name);
bool tpl_test_exists(const char *name);

/* methods (jinja_methods.c): obj.name(args) */
bool tpl_call_method(tctx_t *ctx, const tv_t *obj, const char *name, const tv_t *args, size_t nargs,
                     const char *const *kwnames, const tv_t *kwvals, size_t nkw, tv_t *out);
/* Whether obj.name names a method (so attribute access yields a method rather than a key). */
bool tpl_has_method(const tv_t *obj, const char *name);
/* String helpers shared with the filters. mode: 'u' upper, 'l' lower, 'c' capitalize,
 * 't' str.title(), 'j' Jinja's title filter. which: 'b' both ends, 'l' left, 'r' right;
 * chars NULL or None strips whitespace. */
bool tpl_str_case(tctx_t *ctx, const tv_t *s, int mode, tv_t *out);
bool tpl_str_strip(tctx_t *ctx, const tv_t *s, const tv_t *chars, int which, tv_t *out);
bool tpl_str_replace(tctx_t *ctx, const tv_t *s, const tv_t *old, const tv_t *new_, int64_t count,
                     tv_t *out);
/* fmt % rhs (Python's printf-style formatting; rhs a tuple of arguments, a mapping or one value).
 */
bool tpl_str_percent(tctx_t *ctx, const tv_t *fmt, const tv_t *rhs, tv_t *out);
/* Python whitespace for str.strip()/split() */
bool tpl_is_space_cp(uint32_t cp);
uint32_t utf8_decode_at(const char *s, size_t n, size_t pos, size_t *out_next);

#endif /* KILN_MODELS_TEMPLATE_INTERNAL_H */
