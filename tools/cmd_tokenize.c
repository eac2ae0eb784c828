/* cmd_tokenize.c - `kiln tokenize` (text on stdin -> ids) and `kiln detokenize` (ids on
 * stdin -> text), both through models/tokenizer. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "models/tokenizer/tokenizer.h"

/* Reads all of stdin; NULL on failure. */
static char *tk_read_stdin(size_t *out_len) {
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  char chunk[65536];
  size_t n;
  while ((n = fread(chunk, 1, sizeof(chunk), stdin)) > 0) {
    if (!kiln_strbuf_append(&b, chunk, n)) break;
  }
  if (ferror(stdin) || !kiln_strbuf_ok(&b)) {
    kiln_strbuf_free(&b);
    return NULL;
  }
  return kiln_strbuf_detach(&b, out_len);
}

typedef struct tk_args {
  const char *dir;
  bool special, json, skip_special;
} tk_args_t;

/* Parses the subcommand's options; allowed flags are named in `flags` (e.g. "sj"). */
static kiln_status_t tk_parse(kiln_cli_t *cli, const char *flags, tk_args_t *a) {
  memset(a, 0, sizeof(*a));
  const char *name = cli->argv[0];
  for (int i = 1; i < cli->argc; i++) {
    const char *arg = cli->argv[i];
    if (strcmp(arg, "--tokenizer") == 0 && i + 1 < cli->argc) {
      a->dir = cli->argv[++i];
    } else if (strncmp(arg, "--tokenizer=", 12) == 0) {
      a->dir = arg + 12;
    } else if (strcmp(arg, "--special") == 0 && strchr(flags, 's')) {
      a->special = true;
    } else if (strcmp(arg, "--json") == 0 && strchr(flags, 'j')) {
      a->json = true;
    } else if (strcmp(arg, "--skip-special") == 0 && strchr(flags, 'k')) {
      a->skip_special = true;
    } else {
      return kiln_cli_bad_option(name, arg, NULL);
    }
  }
  if (!a->dir) {
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: --tokenizer DIR is required", name);
  }
  return NULL;
}

/* What both commands start with: their options, the tokenizer, and all of stdin. On error
 * nothing is held. */
static kiln_status_t tk_open(kiln_cli_t *cli, const char *flags, tk_args_t *a,
                             kiln_tokenizer_t **out_tok, char **out_text, size_t *out_len) {
  *out_tok = NULL;
  *out_text = NULL;
  kiln_status_t st = tk_parse(cli, flags, a);
  if (!st) st = kiln_tokenizer_load(a->dir, out_tok);
  if (st) return st;
  *out_text = tk_read_stdin(out_len);
  if (!*out_text) {
    kiln_tokenizer_free(*out_tok);
    *out_tok = NULL;
    return kiln_status_make(KILN_ERR_IO, "%s: cannot read stdin", cli->argv[0]);
  }
  return NULL;
}

int kiln_cmd_tokenize(kiln_cli_t *cli) {
  tk_args_t a;
  kiln_tokenizer_t *tok;
  char *text;
  size_t len = 0;
  kiln_status_t st = tk_open(cli, "sj", &a, &tok, &text, &len);
  if (st) return kiln_cli_fail(st);
  kiln_tokens_t ids = KILN_TOKENS_INIT;
  st = kiln_tokenizer_encode(tok, text, len, a.special, &ids);
  free(text);
  if (st) {
    kiln_tokenizer_free(tok);
    return kiln_cli_fail(kiln_status_annotate(st, "tokenize"));
  }
  if (a.json) putchar('[');
  for (size_t i = 0; i < ids.len; i++) {
    printf(i ? (a.json ? ", %d" : " %d") : "%d", (int)ids.ids[i]);
  }
  printf(a.json ? "]\n" : "\n");
  kiln_tokens_free(&ids);
  kiln_tokenizer_free(tok);
  return fflush(stdout) == 0 ? 0 : 1;
}

/* Parses ids separated by whitespace and/or commas, optionally inside one JSON array. */
static kiln_status_t tk_parse_ids(const char *s, kiln_tokens_t *out) {
  const char *p = s;
  while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r') p++;
  bool bracket = *p == '[';
  if (bracket) p++;
  for (;;) {
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r' || *p == ',') p++;
    if (!*p) break;
    if (*p == ']' && bracket) {
      bracket = false;
      p++;
      continue;
    }
    char *end;
    errno = 0;
    long long v = strtoll(p, &end, 10);
    if (end == p || errno || (*end && !strchr(" \t\r\n,]", *end))) {
      int n = 0;
      while (p[n] && !strchr(" \t\r\n,]", p[n]) && n < 32) n++;
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "detokenize: '%.*s' is not a token id", n,
                              p);
    }
    if (v < 0 || v > INT32_MAX) {
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "detokenize: token id %lld is out of range", v);
    }
    if (!kiln_tokens_push(out, (int32_t)v)) {
      return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "detokenize: out of memory");
    }
    p = end;
  }
  if (bracket) return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "detokenize: missing ']'");
  return NULL;
}

int kiln_cmd_detokenize(kiln_cli_t *cli) {
  tk_args_t a;
  kiln_tokenizer_t *tok;
  char *text;
  size_t len = 0;
  kiln_status_t st = tk_open(cli, "k", &a, &tok, &text, &len);
  if (st) return kiln_cli_fail(st);
  kiln_tokens_t ids = KILN_TOKENS_INIT;
  kiln_strbuf_t out = KILN_STRBUF_INIT;
  if (strlen(text) != len) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "detokenize: the input contains a NUL byte");
  } else {
    st = tk_parse_ids(text, &ids);
  }
  if (!st) {
    st = kiln_status_annotate(kiln_tokenizer_decode(tok, ids.ids, ids.len, a.skip_special, &out),
                              "detokenize");
  }
  free(text);
  int rc = 0;
  if (st) {
    rc = kiln_cli_fail(st);
  } else {
    fwrite(out.data ? out.data : "", 1, out.len, stdout);
    rc = fflush(stdout) == 0 ? 0 : 1;
  }
  kiln_strbuf_free(&out);
  kiln_tokens_free(&ids);
  kiln_tokenizer_free(tok);
  return rc;
}
