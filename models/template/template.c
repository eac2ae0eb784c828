/* template.c - the public face of the Jinja interpreter: compile (lex + parse into the
 * template's arena), render (globals, variables, limits, errors with template lines). */
#define _POSIX_C_SOURCE 200809L
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/template/template_internal.h"

enum {
  DEFAULT_MAX_OUTPUT = 64u << 20,
  DEFAULT_MAX_MEMORY = 512u << 20,
  DEFAULT_MAX_ITERATIONS = 10000000,
  DEFAULT_MAX_DEPTH = 64,
};

bool tpl_fail(tctx_t *ctx, const char *fmt, ...) {
  if (ctx->err) return false;
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  va_list ap;
  va_start(ap, fmt);
  kiln_strbuf_vprintf(&b, fmt, ap);
  va_end(ap);
  if (kiln_strbuf_ok(&b))
    ctx->err = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s:%d: %s", ctx->tpl->name, ctx->line,
                                kiln_strbuf_cstr(&b));
  else
    ctx->err =
        kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s:%d: out of memory", ctx->tpl->name, ctx->line);
  kiln_strbuf_free(&b);
  return false;
}

bool tpl_oom(tctx_t *ctx) {
  if (ctx->err) return false;
  if (ctx->arena.limit_hit)
    ctx->err = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                                "%s:%d: the template used more than its memory limit of %zu bytes",
                                ctx->tpl->name, ctx->line, ctx->arena.limit);
  else
    ctx->err =
        kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s:%d: out of memory", ctx->tpl->name, ctx->line);
  return false;
}

kiln_status_t kiln_template_compile(const char *source, size_t len, const char *name,
                                    kiln_template_t **out_tpl) {
  *out_tpl = NULL;
  if (!name) name = "template";
  kiln_template_t *tpl = calloc(1, sizeof *tpl);
  if (!tpl) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", name);
  kiln_status_t st = NULL;
  tok_t *toks = NULL;
  size_t ntoks = 0;
  tpl->name = strdup(name);
  if (!tpl->name) {
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", name);
    goto fail;
  }
  tpl->source = malloc(len + 1);
  if (!tpl->source) {
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", name);
    goto fail;
  }
  if (len) memcpy(tpl->source, source, len);
  tpl->source[len] = 0;
  tpl->source_len = len;
  /* Tokens, the normalised source and literals all live in the template's arena. */
  st = tpl_lex(source ? source : "", source ? len : 0, tpl->name, &tpl->arena, &toks, &ntoks);
  if (st) goto fail;
  st = tpl_parse(tpl, toks, ntoks);
  if (st) goto fail;
  *out_tpl = tpl;
  return NULL;
fail:
  kiln_template_free(tpl);
  return st;
}

const char *kiln_template_name(const kiln_template_t *tpl) { return tpl->name; }

const char *kiln_template_source(const kiln_template_t *tpl, size_t *out_len) {
  if (out_len) *out_len = tpl->source_len;
  return tpl->source;
}

/* Whether the subtree reads or assigns the variable (macro bodies included). The AST's depth
 * is bounded by the parser, so the recursion is too. */
static bool refers_to(const tnode_t *nd, const char *name) {
  if (!nd) return false;
  if (nd->kind == N_NAME && nd->name && !strcmp(nd->name, name)) return true;
  if (refers_to(nd->a, name) || refers_to(nd->b, name) || refers_to(nd->c, name)) return true;
  for (size_t i = 0; i < nd->n; i++)
    if (refers_to(nd->items[i], name)) return true;
  for (size_t i = 0; i < nd->nbody; i++)
    if (refers_to(nd->body[i], name)) return true;
  for (size_t i = 0; i < nd->nebody; i++)
    if (refers_to(nd->ebody[i], name)) return true;
  return false;
}

bool kiln_template_uses_variable(const kiln_template_t *tpl, const char *name) {
  for (size_t i = 0; i < tpl->nbody; i++)
    if (refers_to(tpl->body[i], name)) return true;
  return false;
}

void kiln_template_free(kiln_template_t *tpl) {
  if (!tpl) return;
  kiln_arena_free(&tpl->arena);
  free(tpl->source);
  free(tpl->name);
  free(tpl);
}

static bool set_json(tctx_t *ctx, tscope_t *sc, const char *name, const kiln_json_t *j) {
  return tpl_scope_set(ctx, sc, name, j ? tv_from_json(ctx, j) : tv_none());
}

kiln_status_t kiln_template_render(const kiln_template_t *tpl, const kiln_template_vars_t *vars,
                                   kiln_strbuf_t *out) {
  static const kiln_template_vars_t no_vars = {0};
  static const struct {
    const char *name;
    tv_func_t f;
  } funcs[] = {{"range", TF_RANGE},
               {"namespace", TF_NAMESPACE},
               {"dict", TF_DICT},
               {"raise_exception", TF_RAISE},
               {"strftime_now", TF_STRFTIME}};
  if (!vars) vars = &no_vars;
  tctx_t ctx = {.tpl = tpl, .out = out};
  ctx.lim.max_output = DEFAULT_MAX_OUTPUT;
  ctx.lim.max_memory = DEFAULT_MAX_MEMORY;
  ctx.lim.max_iterations = DEFAULT_MAX_ITERATIONS;
  ctx.lim.max_depth = DEFAULT_MAX_DEPTH;
  if (vars->limits) {
    if (vars->limits->max_output) ctx.lim.max_output = vars->limits->max_output;
    if (vars->limits->max_memory) ctx.lim.max_memory = vars->limits->max_memory;
    if (vars->limits->max_iterations) ctx.lim.max_iterations = vars->limits->max_iterations;
    if (vars->limits->max_depth) ctx.lim.max_depth = vars->limits->max_depth;
  }
  ctx.arena.limit = ctx.lim.max_memory;
  tscope_t *g = tpl_scope_new(&ctx, NULL), *root = NULL;
  bool ok = g != NULL;
  for (size_t i = 0; ok && i < sizeof funcs / sizeof *funcs; i++) {
    tv_t f = {TV_FUNC, 0, {.func = funcs[i].f}};
    ok = tpl_scope_set(&ctx, g, funcs[i].name, f);
  }
  for (size_t i = 0; ok && i < vars->n_strings; i++)
    if (vars->strings[i].name && vars->strings[i].value)
      ok = tpl_scope_set(&ctx, g, vars->strings[i].name,
                         tv_str(vars->strings[i].value, strlen(vars->strings[i].value)));
  if (ok && vars->extra && kiln_json_is(vars->extra, KILN_JSON_OBJECT)) {
    size_t n = kiln_json_len(vars->extra);
    for (size_t i = 0; ok && i < n; i++) {
      size_t kl = 0;
      const char *k = kiln_json_key_at(vars->extra, i, &kl);
      char *key = kiln_arena_strndup(&ctx.arena, k ? k : "", kl);
      ok = key && set_json(&ctx, g, key, kiln_json_value_at(vars->extra, i));
    }
  }
  if (ok)
    ok = set_json(&ctx, g, "messages", vars->messages) && set_json(&ctx, g, "tools", vars->tools) &&
         set_json(&ctx, g, "documents", vars->documents) &&
         tpl_scope_set(&ctx, g, "add_generation_prompt", tv_bool(vars->add_generation_prompt));
  if (ok) root = tpl_scope_new(&ctx, g);
  if (root)
    tpl_exec_template(&ctx, root);
  else
    tpl_oom(&ctx);
  kiln_arena_free(&ctx.arena);
  return ctx.err;
}
