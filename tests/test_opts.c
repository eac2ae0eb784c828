/* test_opts.c - cmocka tests for tools/opts: every kind of row, ranges and their messages, the
 * table flags that keep each command's wording, --name=value, lists, the "seen" flags, custom
 * parsers, taking the common options out of argv, and the --help layout against a text written
 * out by hand. */
#define _POSIX_C_SOURCE 200809L /* open_memstream */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tools/opts.h"

typedef struct t_args {
  const char *model;
  int64_t n, seed;
  double temp;
  bool json, has_seed;
  kiln_opt_list_t stop;
  int parity; /* CUSTOM: "even" -> 0, "odd" -> 1 */
} t_args_t;

static kiln_status_t t_parity(const char *cmd, const char *name, const char *value, void *field) {
  if (strcmp(value, "even") && strcmp(value, "odd"))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: %s wants even or odd, got '%s'", cmd,
                            name, value);
  *(int *)field = strcmp(value, "odd") == 0;
  return NULL;
}

static const kiln_opt_t t_rows[] = {
    KILN_OPT_STRING("--model", "DIR", t_args_t, model, "the model"),
    KILN_OPT_INT("--n", "N", t_args_t, n, 1, 8, "sequences\nper prompt"),
    KILN_OPT_INT_SEEN("--seed", "S", t_args_t, seed, has_seed, 0, INT64_MAX, "the seed"),
    KILN_OPT_FLOAT("--temperature", "T", t_args_t, temp, 0, 2, "0 = greedy"),
    KILN_OPT_FLAG("--json", t_args_t, json, "one JSON object"),
    KILN_OPT_LIST("--stop", "STR", t_args_t, stop, "repeatable"),
    KILN_OPT_CUSTOM("--parity", "P", t_args_t, parity, t_parity, NULL),
    KILN_OPT_FLAG("--a-very-long-option-name", t_args_t, json, "wraps to the next line"),
};

static kiln_opts_t t_table(unsigned flags) {
  kiln_opts_t t = {.cmd = "demo",
                   .usage = "usage: kiln demo [options]\n",
                   .opts = t_rows,
                   .num_opts = KILN_OPTS_COUNT(t_rows),
                   .flags = flags};
  return t;
}

/* Parses the NULL-terminated argument list (argv[0] = "demo") into *a, zeroed first. */
static kiln_status_t t_parse(const kiln_opts_t *t, t_args_t *a, bool *help, ...) {
  char *argv[32];
  int argc = 0;
  argv[argc++] = "demo";
  va_list ap;
  va_start(ap, help);
  for (char *s; (s = va_arg(ap, char *)) != NULL;) argv[argc++] = s;
  va_end(ap);
  memset(a, 0, sizeof(*a));
  return kiln_opts_parse(t, argc, argv, a, help);
}

/* Checks that st is an INVALID_ARGUMENT with exactly message want, and frees it. */
static void t_want_error(kiln_status_t st, const char *want) {
  assert_non_null(st);
  assert_int_equal(kiln_status_code(st), KILN_ERR_INVALID_ARGUMENT);
  assert_string_equal(kiln_status_message(st), want);
  kiln_status_free(st);
}

static void test_every_kind_lands(void **state) {
  (void)state;
  kiln_opts_t t = t_table(0);
  t_args_t a;
  bool help = true;
  assert_null(t_parse(&t, &a, &help, "--model", "m1", "--n", "8", "--temperature", "0.5", "--json",
                      "--stop", "x", "--model", "m2", "--stop", "--y", "--parity", "odd", NULL));
  assert_false(help);
  assert_string_equal(a.model, "m2"); /* the last one wins */
  assert_int_equal(a.n, 8);
  assert_true(a.temp == 0.5);
  assert_true(a.json);
  assert_false(a.has_seed);
  assert_int_equal(a.parity, 1);
  assert_int_equal(a.stop.n, 2);
  assert_string_equal(a.stop.v[0], "x");
  assert_string_equal(a.stop.v[1], "--y"); /* a value is the next argument, whatever it is */
  assert_null(a.stop.v[2]);
  kiln_opts_free(&t, &a);
  assert_null(a.stop.v);
  assert_int_equal(a.stop.n, 0);
  /* values not given keep what the struct had */
  a.n = 3;
  a.model = "kept";
  char *argv[] = {"demo", "--seed", "0"};
  assert_null(kiln_opts_parse(&t, 3, argv, &a, &help));
  assert_int_equal(a.n, 3);
  assert_string_equal(a.model, "kept");
  assert_true(a.has_seed);
  assert_int_equal(a.seed, 0);
}

static void test_ranges_and_messages(void **state) {
  (void)state;
  kiln_opts_t t = t_table(0);
  t_args_t a;
  bool help;
  t_want_error(t_parse(&t, &a, &help, "--n", "9", NULL),
               "demo: --n wants an integer in [1, 8], got '9'");
  t_want_error(t_parse(&t, &a, &help, "--n", "0", NULL),
               "demo: --n wants an integer in [1, 8], got '0'");
  t_want_error(t_parse(&t, &a, &help, "--n", "2x", NULL),
               "demo: --n wants an integer in [1, 8], got '2x'");
  t_want_error(t_parse(&t, &a, &help, "--n", "", NULL),
               "demo: --n wants an integer in [1, 8], got ''");
  t_want_error(t_parse(&t, &a, &help, "--seed", "99999999999999999999", NULL),
               "demo: --seed wants an integer in [0, 9223372036854775807], got "
               "'99999999999999999999'");
  t_want_error(t_parse(&t, &a, &help, "--temperature", "nan", NULL),
               "demo: --temperature wants a number in [0, 2], got 'nan'");
  t_want_error(t_parse(&t, &a, &help, "--temperature", "2.5", NULL),
               "demo: --temperature wants a number in [0, 2], got '2.5'");
  t_want_error(t_parse(&t, &a, &help, "--parity", "three", NULL),
               "demo: --parity wants even or odd, got 'three'");
  /* a bad value does not set the "seen" flag */
  t_want_error(t_parse(&t, &a, &help, "--seed", "-1", NULL),
               "demo: --seed wants an integer in [0, 9223372036854775807], got '-1'");
  assert_false(a.has_seed);
  /* the bounds themselves are in range */
  assert_null(t_parse(&t, &a, &help, "--n", "1", "--temperature", "2", "--seed",
                      "9223372036854775807", NULL));
  assert_int_equal(a.seed, INT64_MAX);
}

static void test_unknown_and_missing_wording(void **state) {
  (void)state;
  t_args_t a;
  bool help;
  kiln_opts_t t = t_table(0);
  t_want_error(t_parse(&t, &a, &help, "--frob", NULL),
               "demo: unknown or incomplete option '--frob'");
  t_want_error(t_parse(&t, &a, &help, "--json", "--model", NULL),
               "demo: unknown or incomplete option '--model'");
  t_want_error(t_parse(&t, &a, &help, "--model=x", NULL),
               "demo: unknown or incomplete option '--model=x'");
  t_want_error(t_parse(&t, &a, &help, "stray", NULL), "demo: unknown or incomplete option 'stray'");
  t = t_table(KILN_OPTS_USAGE_ON_ERROR);
  t_want_error(t_parse(&t, &a, &help, "--frob", NULL),
               "demo: unknown or incomplete option '--frob'\nusage: kiln demo [options]\n");
  t = t_table(KILN_OPTS_SAY_UNKNOWN | KILN_OPTS_SAY_MISSING | KILN_OPTS_USAGE_ON_ERROR);
  t_want_error(t_parse(&t, &a, &help, "--frob", NULL),
               "demo: unknown option '--frob'\nusage: kiln demo [options]\n");
  t_want_error(t_parse(&t, &a, &help, "--model", NULL), "demo: --model needs a value");
  t = t_table(KILN_OPTS_SAY_UNKNOWN);
  t.hint = " (takes --n N)";
  t_want_error(t_parse(&t, &a, &help, "--n", NULL), "demo: unknown option '--n' (takes --n N)");
  t.cmd = NULL;
  t_want_error(t_parse(&t, &a, &help, "--x", NULL), "unknown option '--x' (takes --n N)");
  t_want_error(t_parse(&t, &a, &help, "--n", "x", NULL), "--n wants an integer in [1, 8], got 'x'");
}

static void test_equals(void **state) {
  (void)state;
  kiln_opts_t t = t_table(KILN_OPTS_EQUALS);
  t_args_t a;
  bool help;
  assert_null(t_parse(&t, &a, &help, "--model=a=b", "--n=4", "--stop=", "--stop", "s", NULL));
  assert_string_equal(a.model, "a=b");
  assert_int_equal(a.n, 4);
  assert_int_equal(a.stop.n, 2);
  assert_string_equal(a.stop.v[0], "");
  kiln_opts_free(&t, &a);
  t_want_error(t_parse(&t, &a, &help, "--json=1", NULL),
               "demo: unknown or incomplete option '--json=1'"); /* a flag takes no value */
  t_want_error(t_parse(&t, &a, &help, "--mod=x", NULL),
               "demo: unknown or incomplete option '--mod=x'"); /* no prefix matching */
  t_want_error(t_parse(&t, &a, &help, "--n=9", NULL),
               "demo: --n wants an integer in [1, 8], got '9'");
}

static void test_help_stops_parsing(void **state) {
  (void)state;
  kiln_opts_t t = t_table(0);
  t_args_t a;
  bool help = false;
  assert_null(t_parse(&t, &a, &help, "--n", "2", "-h", "--frob", NULL));
  assert_true(help);
  assert_int_equal(a.n, 2);
  help = false;
  assert_null(t_parse(&t, &a, &help, "--help", NULL));
  assert_true(help);
  /* an error before it wins; --help as a value is a value */
  t_want_error(t_parse(&t, &a, &help, "--frob", "--help", NULL),
               "demo: unknown or incomplete option '--frob'");
  assert_null(t_parse(&t, &a, &help, "--model", "--help", NULL));
  assert_false(help);
  assert_string_equal(a.model, "--help");
}

static void test_no_options_table(void **state) {
  (void)state;
  kiln_opts_t t = {.cmd = "info", .usage = "usage: kiln info\n"};
  char *argv[] = {"info", "--x"};
  bool help = false;
  assert_null(kiln_opts_parse(&t, 1, argv, NULL, &help));
  assert_false(help);
  t_want_error(kiln_opts_parse(&t, 2, argv, NULL, &help),
               "info: unknown or incomplete option '--x'");
}

typedef struct t_common {
  const char *config;
  kiln_opt_list_t sets;
} t_common_t;

static const kiln_opt_t t_common_rows[] = {
    KILN_OPT_STRING("--config", "FILE", t_common_t, config, "INI file"),
    KILN_OPT_LIST("--set", "k=v", t_common_t, sets, "override"),
};

static const kiln_opts_t t_common = {.opts = t_common_rows,
                                     .num_opts = KILN_OPTS_COUNT(t_common_rows),
                                     .flags = KILN_OPTS_EQUALS | KILN_OPTS_SAY_MISSING,
                                     .width = 14};

static void test_extract(void **state) {
  (void)state;
  char *argv[] = {"gen", "--set", "a=1", "--n", "3", "--help", "--config=x.ini", "--set=b=2", "-q"};
  char *rest[9];
  int nrest = -1;
  t_common_t c = {NULL, {NULL, 0}};
  assert_null(kiln_opts_extract(&t_common, 9, argv, &c, rest, &nrest));
  assert_int_equal(nrest, 5);
  assert_string_equal(rest[0], "gen");
  assert_string_equal(rest[1], "--n");
  assert_string_equal(rest[2], "3");
  assert_string_equal(rest[3], "--help"); /* for the command */
  assert_string_equal(rest[4], "-q");
  assert_string_equal(c.config, "x.ini");
  assert_int_equal(c.sets.n, 2);
  assert_string_equal(c.sets.v[0], "a=1");
  assert_string_equal(c.sets.v[1], "b=2");
  kiln_opts_free(&t_common, &c);
  char *bad[] = {"gen", "--config"};
  t_want_error(kiln_opts_extract(&t_common, 2, bad, &c, rest, &nrest), "--config needs a value");
}

/* The whole --help text, written out: the column (22 + 3), a help of two lines, a name too
 * long for the column, a row without help, then the common options in their own column. */
static void test_help_layout(void **state) {
  (void)state;
  kiln_opts_t t = t_table(0);
  t.common = &t_common;
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  assert_non_null(f);
  kiln_opts_print_help(&t, f);
  fclose(f);
  const char *want =
      "usage: kiln demo [options]\n"
      "\n"
      "options:\n"
      "  --model DIR            the model\n"
      "  --n N                  sequences\n"
      "                         per prompt\n"
      "  --seed S               the seed\n"
      "  --temperature T        0 = greedy\n"
      "  --json                 one JSON object\n"
      "  --stop STR             repeatable\n"
      "  --parity P\n"
      "  --a-very-long-option-name\n"
      "                         wraps to the next line\n"
      "  -h, --help             print this help and exit\n"
      "\n"
      "common options:\n"
      "  --config FILE  INI file\n"
      "  --set k=v      override\n";
  assert_string_equal(buf, want);
  free(buf);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_every_kind_lands),
      cmocka_unit_test(test_ranges_and_messages),
      cmocka_unit_test(test_unknown_and_missing_wording),
      cmocka_unit_test(test_equals),
      cmocka_unit_test(test_help_stops_parsing),
      cmocka_unit_test(test_no_options_table),
      cmocka_unit_test(test_extract),
      cmocka_unit_test(test_help_layout),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
