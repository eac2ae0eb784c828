/* opts.c - parsing and --help for the subcommands' option tables (see opts.h). */
#include "opts.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#define OPTS_DEFAULT_WIDTH 22

/* The "cmd: " that starts a message, or nothing for a table without a command name. */
#define OPTS_PFX(cmd) (cmd) ? (cmd) : "", (cmd) ? ": " : ""

/* The row named by the first len characters of arg, or NULL. */
static const kiln_opt_t *opts_find(const kiln_opts_t *t, const char *arg, size_t len) {
  for (size_t i = 0; i < t->num_opts; i++) {
    const char *n = t->opts[i].name;
    if (strlen(n) == len && memcmp(n, arg, len) == 0) return &t->opts[i];
  }
  return NULL;
}

static kiln_status_t opts_unknown(const kiln_opts_t *t, const char *arg) {
  bool usage = (t->flags & KILN_OPTS_USAGE_ON_ERROR) && t->usage;
  return kiln_status_make(
      KILN_ERR_INVALID_ARGUMENT, "%s%s%s '%s'%s%s%s", OPTS_PFX(t->cmd),
      (t->flags & KILN_OPTS_SAY_UNKNOWN) ? "unknown option" : "unknown or incomplete option", arg,
      t->hint ? t->hint : "", usage ? "\n" : "", usage ? t->usage : "");
}

static kiln_status_t opts_missing(const kiln_opts_t *t, const char *arg) {
  if (!(t->flags & KILN_OPTS_SAY_MISSING)) return opts_unknown(t, arg);
  return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s%s%s needs a value", OPTS_PFX(t->cmd), arg);
}

static kiln_status_t opts_int(const char *cmd, const kiln_opt_t *o, const char *v, int64_t *out) {
  char *end;
  errno = 0;
  long long x = strtoll(v, &end, 10);
  if (errno || end == v || *end || x < o->imin || x > o->imax)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s%s%s wants an integer in [%lld, %lld], got '%s'", OPTS_PFX(cmd),
                            o->name, (long long)o->imin, (long long)o->imax, v);
  *out = x;
  return NULL;
}

static kiln_status_t opts_float(const char *cmd, const kiln_opt_t *o, const char *v, double *out) {
  char *end;
  errno = 0;
  double x = strtod(v, &end);
  if (errno || end == v || *end || !(x >= o->fmin && x <= o->fmax))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s%s%s wants a number in [%g, %g], got '%s'", OPTS_PFX(cmd), o->name,
                            o->fmin, o->fmax, v);
  *out = x;
  return NULL;
}

static kiln_status_t opts_append(kiln_opt_list_t *l, const char *v) {
  const char **grown = realloc(l->v, ((size_t)l->n + 2) * sizeof(*grown));
  if (!grown) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  grown[l->n++] = v;
  grown[l->n] = NULL;
  l->v = grown;
  return NULL;
}

/* Stores option o's value v (NULL for a flag) into args. */
static kiln_status_t opts_store(const kiln_opts_t *t, const kiln_opt_t *o, const char *v,
                                void *args) {
  void *field = (char *)args + o->offset;
  kiln_status_t st = NULL;
  switch (o->kind) {
    case KILN_OPT_FLAG: *(bool *)field = true; break;
    case KILN_OPT_STRING: *(const char **)field = v; break;
    case KILN_OPT_INT: st = opts_int(t->cmd, o, v, (int64_t *)field); break;
    case KILN_OPT_FLOAT: st = opts_float(t->cmd, o, v, (double *)field); break;
    case KILN_OPT_LIST: st = opts_append((kiln_opt_list_t *)field, v); break;
    case KILN_OPT_CUSTOM: st = o->parse(t->cmd, o->name, v, field); break;
    default: st = kiln_status_make(KILN_ERR_INTERNAL, "%s: bad option kind", o->name);
  }
  if (!st && o->seen) *(bool *)((char *)args + o->seen - 1) = true;
  return st;
}

/* The one loop behind kiln_opts_parse (rest NULL) and kiln_opts_extract. */
static kiln_status_t opts_run(const kiln_opts_t *t, int first, int argc, char **argv, void *args,
                              bool *out_help, char **rest, int *num_rest) {
  const bool pass = rest != NULL;
  for (int i = first; i < argc; i++) {
    const char *a = argv[i];
    if (!pass && (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0)) {
      kiln_opts_print_help(t, stdout);
      *out_help = true;
      return NULL;
    }
    const char *eq =
        (t->flags & KILN_OPTS_EQUALS) && strncmp(a, "--", 2) == 0 ? strchr(a, '=') : NULL;
    const kiln_opt_t *o = opts_find(t, a, eq ? (size_t)(eq - a) : strlen(a));
    if (o && eq && o->kind == KILN_OPT_FLAG) o = NULL; /* a flag takes no value */
    if (!o) {
      if (!pass) return opts_unknown(t, a);
      rest[(*num_rest)++] = argv[i];
      continue;
    }
    const char *v = NULL;
    if (eq) {
      v = eq + 1;
    } else if (o->kind != KILN_OPT_FLAG) {
      if (i + 1 >= argc) return opts_missing(t, a);
      v = argv[++i];
    }
    kiln_status_t st = opts_store(t, o, v, args);
    if (st) return st;
  }
  return NULL;
}

kiln_status_t kiln_opts_parse(const kiln_opts_t *t, int argc, char **argv, void *args,
                              bool *out_help) {
  *out_help = false;
  return opts_run(t, 1, argc, argv, args, out_help, NULL, NULL);
}

kiln_status_t kiln_opts_extract(const kiln_opts_t *t, int argc, char **argv, void *args,
                                char **rest, int *out_num_rest) {
  bool help = false;
  *out_num_rest = 0;
  return opts_run(t, 0, argc, argv, args, &help, rest, out_num_rest);
}

void kiln_opts_free(const kiln_opts_t *t, void *args) {
  for (size_t i = 0; i < t->num_opts; i++) {
    if (t->opts[i].kind != KILN_OPT_LIST) continue;
    kiln_opt_list_t *l = (kiln_opt_list_t *)((char *)args + t->opts[i].offset);
    free(l->v);
    l->v = NULL;
    l->n = 0;
  }
}

/* One line of the list: "  NAME METAVAR", padded to the column, then the help's lines, each
 * further one indented to the column. */
static void opts_row(FILE *f, int width, const char *name, const char *metavar, const char *help) {
  int len = (int)strlen(name) + (metavar ? 1 + (int)strlen(metavar) : 0);
  fprintf(f, "  %s%s%s", name, metavar ? " " : "", metavar ? metavar : "");
  if (!help || !*help) {
    fputc('\n', f);
    return;
  }
  if (len <= width)
    fprintf(f, "%*s", width - len + 1, "");
  else
    fprintf(f, "\n%*s", width + 3, "");
  for (const char *h = help;;) {
    const char *nl = strchr(h, '\n');
    int n = nl ? (int)(nl - h) : (int)strlen(h);
    fprintf(f, "%.*s\n", n, h);
    if (!nl || !nl[1]) break;
    h = nl + 1;
    fprintf(f, "%*s", width + 3, "");
  }
}

static int opts_width(const kiln_opts_t *t) { return t->width > 0 ? t->width : OPTS_DEFAULT_WIDTH; }

static void opts_rows(const kiln_opts_t *t, int width, FILE *f) {
  for (size_t i = 0; i < t->num_opts; i++)
    opts_row(f, width, t->opts[i].name, t->opts[i].metavar, t->opts[i].help);
}

void kiln_opts_print_rows(const kiln_opts_t *t, FILE *f) { opts_rows(t, opts_width(t), f); }

void kiln_opts_print_help(const kiln_opts_t *t, FILE *f) {
  int width = opts_width(t);
  if (t->usage) fputs(t->usage, f);
  fputs("\noptions:\n", f);
  opts_rows(t, width, f);
  opts_row(f, width, "-h, --help", NULL, "print this help and exit");
  if (t->common) {
    fputs("\ncommon options:\n", f);
    kiln_opts_print_rows(t->common, f); /* in its own column, as `kiln --help` shows them */
  }
}
