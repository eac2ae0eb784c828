/* cmd_tokenize.c - `kiln tokenize` (text on stdin -> ids) and `kiln detokenize` (ids on
 * stdin -> text), both through models/tokenizer. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "models/model_tokenizer.h"
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

static const kiln_opt_t tk_encode_rows[] = {
    KILN_OPT_STRING("--tokenizer", "DIR|FILE.gguf", tk_args_t, dir,
                    "the folder with tokenizer.json, or a .gguf model (required)"),
    KILN_OPT_FLAG("--special", tk_args_t, special,
                  "add the post-processor's special tokens (BOS, ...)"),
    KILN_OPT_FLAG("--json", tk_args_t, json, "print the ids as one JSON array"),
};

static const kiln_opts_t tk_encode_opts = {
    .cmd = "tokenize",
    .usage =
        "usage: kiln tokenize --tokenizer DIR|FILE.gguf [--special] [--json] < TEXT\n"
        "Encodes stdin as Hugging Face's tokenizers would (tokenizer.json in DIR; for a .gguf\n"
        "file, the tokenizer.json beside it or else the tokenizer in its metadata) and prints\n"
        "the token ids, separated by spaces.\n",
    .opts = tk_encode_rows,
    .num_opts = KILN_OPTS_COUNT(tk_encode_rows),
    .flags = KILN_OPTS_EQUALS,
    .common = &kiln_cli_common_opts,
};

static const kiln_opt_t tk_decode_rows[] = {
    KILN_OPT_STRING("--tokenizer", "DIR|FILE.gguf", tk_args_t, dir,
                    "the folder with tokenizer.json, or a .gguf model (required)"),
    KILN_OPT_FLAG("--skip-special", tk_args_t, skip_special,
                  "leave special tokens out of the text"),
};

static const kiln_opts_t tk_decode_opts = {
    .cmd = "detokenize",
    .usage =
        "usage: kiln detokenize --tokenizer DIR|FILE.gguf [--skip-special] < IDS\n"
        "Decodes the token ids on stdin (separated by spaces or commas, optionally in one\n"
        "JSON array) and prints the text exactly (no newline added).\n",
    .opts = tk_decode_rows,
    .num_opts = KILN_OPTS_COUNT(tk_decode_rows),
    .flags = KILN_OPTS_EQUALS,
    .common = &kiln_cli_common_opts,
};

/* Parses the command's options by table t; *out_help when --help came (and was printed). */
static kiln_status_t tk_parse(kiln_cli_t *cli, const kiln_opts_t *t, tk_args_t *a, bool *out_help) {
  memset(a, 0, sizeof(*a));
  kiln_status_t st = kiln_opts_parse(t, cli->argc, cli->argv, a, out_help);
  if (st || *out_help) return st;
  if (!a->dir) {
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: --tokenizer DIR is required", t->cmd);
  }
  return NULL;
}

/* What both commands start with: their options (by table t), the tokenizer, and all of stdin.
 * On error, or after --help (*out_help), nothing is held. */
static kiln_status_t tk_open(kiln_cli_t *cli, const kiln_opts_t *t, tk_args_t *a, bool *out_help,
                             kiln_tokenizer_t **out_tok, char **out_text, size_t *out_len) {
  *out_tok = NULL;
  *out_text = NULL;
  kiln_status_t st = tk_parse(cli, t, a, out_help);
  if (st || *out_help) return st;
  size_t n = strlen(a->dir);
  if (n > 5 && !strcmp(a->dir + n - 5, ".gguf")) {
    if ((st = kiln_model_open_tokenizer(a->dir, out_tok, NULL, NULL, NULL))) return st;
    if (!*out_tok)
      return kiln_status_make(KILN_ERR_NOT_FOUND,
                              "%s: %s holds no tokenizer and has no tokenizer.json beside it",
                              t->cmd, a->dir);
  } else if ((st = kiln_tokenizer_load(a->dir, out_tok))) {
    return st;
  }
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
  bool help = false;
  kiln_status_t st = tk_open(cli, &tk_encode_opts, &a, &help, &tok, &text, &len);
  if (st) return kiln_cli_fail(st);
  if (help) return 0;
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
  bool help = false;
  kiln_status_t st = tk_open(cli, &tk_decode_opts, &a, &help, &tok, &text, &len);
  if (st) return kiln_cli_fail(st);
  if (help) return 0;
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
