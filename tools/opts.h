/* opts.h - the `kiln` subcommands' options: one static table per command, from which its
 * parsing, its --help text and every option error come (as the INI keys come from the one
 * table in base/config.c).
 *
 * A command describes each option as one row: the name, the metavar shown in --help (NULL for
 * a flag), the help text, and where the value lands: an offset into the command's own argument
 * struct and a kind (flag, string, integer or number with a range, repeatable list, or the
 * command's own parser). kiln_opts_parse() fills the struct from argv; kiln_opts_print_help()
 * prints the table's usage text and the option list. Values are borrowed from argv; only a
 * LIST's array is allocated (kiln_opts_free() releases it). Tables are read-only data, so one
 * may be used from any thread; a parse writes only the struct it is given.
 *
 *   typedef struct my_args { const char *model; int64_t n; bool json; } my_args_t;
 *   static const kiln_opt_t my_rows[] = {
 *       KILN_OPT_STRING("--model", "DIR", my_args_t, model, "the model"),
 *       KILN_OPT_INT("--n", "N", my_args_t, n, 1, 64, "sequences (default 1)"),
 *       KILN_OPT_FLAG("--json", my_args_t, json, "one JSON object"),
 *   };
 *   static const kiln_opts_t my_opts = {.cmd = "mine", .usage = "usage: kiln mine ...\n",
 *                                       .opts = my_rows, .num_opts = KILN_OPTS_COUNT(my_rows)};
 */
#ifndef KILN_TOOLS_OPTS_H
#define KILN_TOOLS_OPTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "base/status.h"

typedef enum kiln_opt_kind {
  KILN_OPT_FLAG,   /* bool: set true; the option takes no value */
  KILN_OPT_STRING, /* const char *: the value, borrowed from argv; the last one given wins */
  KILN_OPT_INT,    /* int64_t: a decimal integer in [imin, imax] */
  KILN_OPT_FLOAT,  /* double: a number (strtod syntax) in [fmin, fmax] */
  KILN_OPT_LIST,   /* kiln_opt_list_t: every value given, in order (a repeatable option) */
  KILN_OPT_CUSTOM, /* any type: parse(cmd, name, value, field) checks and stores the value */
} kiln_opt_kind_t;

/* The values of a LIST option: v[0..n) borrowed from argv, v[n] = NULL; v is NULL while n is
 * 0. The array itself is malloc'ed by the parser (kiln_opts_free() frees it). */
typedef struct kiln_opt_list {
  const char **v;
  int32_t n;
} kiln_opt_list_t;

/* A CUSTOM option's parser: checks value and stores it into field (the row's offset into the
 * argument struct). cmd and name are for the message of a KILN_ERR_INVALID_ARGUMENT; cmd may be
 * NULL (a table without a command name). */
typedef kiln_status_t (*kiln_opt_parse_fn)(const char *cmd, const char *name, const char *value,
                                           void *field);

/* One option. Build rows with the KILN_OPT_* macros below, which check the field's type. */
typedef struct kiln_opt {
  const char *name;    /* "--max-tokens", as typed */
  const char *metavar; /* "N" in --help; NULL for a FLAG */
  const char *help;    /* --help text: one or more lines, '\n' between them; NULL = none */
  kiln_opt_kind_t kind;
  size_t offset;           /* of the value's field in the argument struct */
  size_t seen;             /* 0, or KILN_OPT_SEEN(): a bool field set true when the option comes */
  int64_t imin, imax;      /* an INT's range */
  double fmin, fmax;       /* a FLOAT's range */
  kiln_opt_parse_fn parse; /* a CUSTOM's parser */
} kiln_opt_t;

/* Table flags: each keeps one command's historical messages and syntax. */
enum {
  KILN_OPTS_EQUALS = 1u << 0,         /* "--name=value" is accepted beside "--name value" */
  KILN_OPTS_USAGE_ON_ERROR = 1u << 1, /* an unknown option's error ends with "\n" + usage */
  KILN_OPTS_SAY_UNKNOWN = 1u << 2,    /* "unknown option 'X'", not "unknown or incomplete ..." */
  KILN_OPTS_SAY_MISSING = 1u << 3,    /* a missing value: "X needs a value" (else as unknown) */
};

/* A command's options. */
typedef struct kiln_opts {
  const char *cmd;   /* names the command in errors ("generate", "bench serve"); NULL = none */
  const char *usage; /* the head of --help: synopsis and what the command does, '\n'-ended */
  const kiln_opt_t *opts;
  size_t num_opts;
  unsigned flags;   /* KILN_OPTS_* */
  const char *hint; /* appended to an unknown option's error (" (takes --seed N)"), or NULL */
  int width;        /* the option column of --help, in characters (0 = 22) */
  const struct kiln_opts *common; /* options every command takes, listed after its own */
} kiln_opts_t;

#define KILN_OPTS_COUNT(rows) (sizeof(rows) / sizeof((rows)[0]))

/* The offset of T's field f, which must have type `type` (a mismatch is a compile error:
 * comparing pointers of distinct types). */
#define KILN_OPT__AT(T, f, type) (offsetof(T, f) + 0 * sizeof(&((T *)0)->f == (type *)0))
/* For .seen: bool field f of T, set true when the option is given. */
#define KILN_OPT_SEEN(T, f) (KILN_OPT__AT(T, f, bool) + 1)

#define KILN_OPT_FLAG(nm, T, f, hl) \
  { .name = (nm), .help = (hl), .kind = KILN_OPT_FLAG, .offset = KILN_OPT__AT(T, f, bool) }
#define KILN_OPT_STRING(nm, mv, T, f, hl)                                 \
  {                                                                       \
    .name = (nm), .metavar = (mv), .help = (hl), .kind = KILN_OPT_STRING, \
    .offset = KILN_OPT__AT(T, f, const char *)                            \
  }
#define KILN_OPT_INT(nm, mv, T, f, lo, hi, hl)                         \
  {                                                                    \
    .name = (nm), .metavar = (mv), .help = (hl), .kind = KILN_OPT_INT, \
    .offset = KILN_OPT__AT(T, f, int64_t), .imin = (lo), .imax = (hi)  \
  }
/* An INT that also sets bool field sf of T when given (a default that depends on "given"). */
#define KILN_OPT_INT_SEEN(nm, mv, T, f, sf, lo, hi, hl)                                \
  {                                                                                    \
    .name = (nm), .metavar = (mv), .help = (hl), .kind = KILN_OPT_INT,                 \
    .offset = KILN_OPT__AT(T, f, int64_t), .seen = KILN_OPT_SEEN(T, sf), .imin = (lo), \
    .imax = (hi)                                                                       \
  }
#define KILN_OPT_FLOAT(nm, mv, T, f, lo, hi, hl)                         \
  {                                                                      \
    .name = (nm), .metavar = (mv), .help = (hl), .kind = KILN_OPT_FLOAT, \
    .offset = KILN_OPT__AT(T, f, double), .fmin = (lo), .fmax = (hi)     \
  }
#define KILN_OPT_LIST(nm, mv, T, f, hl)                                 \
  {                                                                     \
    .name = (nm), .metavar = (mv), .help = (hl), .kind = KILN_OPT_LIST, \
    .offset = KILN_OPT__AT(T, f, kiln_opt_list_t)                       \
  }
#define KILN_OPT_CUSTOM(nm, mv, T, f, fn, hl)                             \
  {                                                                       \
    .name = (nm), .metavar = (mv), .help = (hl), .kind = KILN_OPT_CUSTOM, \
    .offset = offsetof(T, f), .parse = (fn)                               \
  }

/* Parses argv[1..argc) (argv[0] is the command's name) by table t into args, the struct the
 * rows' offsets are into (NULL for a table without rows); fields of options not given keep the
 * values they had, so set the defaults first. A value is the next argument, whatever it looks
 * like ("--prompt --x" gives the prompt "--x"). --help or -h prints kiln_opts_print_help(t) on
 * stdout, sets *out_help and stops (what follows is not looked at): the command then exits 0.
 * Errors, with the first bad argument: KILN_ERR_INVALID_ARGUMENT for an unknown option, a
 * missing value, a value out of range or one the CUSTOM parser rejects (the message names the
 * command and the option, as t->flags ask); KILN_ERR_OUT_OF_MEMORY growing a LIST. args then
 * holds what came before (kiln_opts_free() still applies). */
kiln_status_t kiln_opts_parse(const kiln_opts_t *t, int argc, char **argv, void *args,
                              bool *out_help);

/* Takes t's options out of argv[0..argc), wherever they are, into args, and copies the other
 * arguments (--help among them), in order, into rest (room for argc) with their count in
 * *out_num_rest: the options every command shares, before the command sees its own. Errors as
 * kiln_opts_parse()'s, for t's options only. */
kiln_status_t kiln_opts_extract(const kiln_opts_t *t, int argc, char **argv, void *args,
                                char **rest, int *out_num_rest);

/* Frees the arrays of args' LIST fields (and zeroes them). */
void kiln_opts_free(const kiln_opts_t *t, void *args);

/* Writes --help: t->usage, "options:" with a line per row (name, metavar, then the help text
 * from column width + 3, on the next line when the name is longer), -h/--help, then the common
 * options (in t->common's column). */
void kiln_opts_print_help(const kiln_opts_t *t, FILE *f);

/* Writes the option lines alone, in t's column width. */
void kiln_opts_print_rows(const kiln_opts_t *t, FILE *f);

#endif /* KILN_TOOLS_OPTS_H */
