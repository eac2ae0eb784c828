/* cmd_template.c - `kiln template`: renders a tokenizer's chat template for a conversation and
 * prints the prompt exactly (no newline added), as transformers' apply_chat_template would. */
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "models/template/template.h"

typedef struct tp_args {
  const char *dir, *messages, *template_file;
  bool add_generation_prompt;
} tp_args_t;

static const char tp_usage[] =
    "usage: kiln template --tokenizer DIR --messages FILE.json [--add-generation-prompt]\n"
    "                     [--template FILE.jinja]\n"
    "FILE.json is a JSON array of messages, or an object {\"messages\": [...], \"tools\": [...],\n"
    "\"documents\": [...], \"add_generation_prompt\": bool, any other template variable}.\n"
    "--template renders FILE.jinja instead of the tokenizer's template (special tokens still come\n"
    "from DIR when it is given).\n";

static const kiln_opt_t tp_rows[] = {
    KILN_OPT_STRING("--tokenizer", "DIR", tp_args_t, dir,
                    "the folder with tokenizer_config.json (or chat_template.jinja)"),
    KILN_OPT_STRING("--messages", "FILE.json", tp_args_t, messages, "the conversation (required)"),
    KILN_OPT_FLAG("--add-generation-prompt", tp_args_t, add_generation_prompt,
                  "end with the assistant turn's opening"),
    KILN_OPT_STRING("--template", "FILE.jinja", tp_args_t, template_file,
                    "render this template instead of DIR's"),
};

static const kiln_opts_t tp_opts = {
    .cmd = "template",
    .usage = tp_usage,
    .opts = tp_rows,
    .num_opts = KILN_OPTS_COUNT(tp_rows),
    .flags =
        KILN_OPTS_EQUALS | KILN_OPTS_USAGE_ON_ERROR | KILN_OPTS_SAY_UNKNOWN | KILN_OPTS_SAY_MISSING,
    .width = 24,
    .common = &kiln_cli_common_opts,
};

/* Parses the options; *out_help when --help came (and was printed). */
static kiln_status_t tp_parse(kiln_cli_t *cli, tp_args_t *a, bool *out_help) {
  memset(a, 0, sizeof *a);
  kiln_status_t st = kiln_opts_parse(&tp_opts, cli->argc, cli->argv, a, out_help);
  if (st || *out_help) return st;
  if (!a->messages || (!a->dir && !a->template_file))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "template: --tokenizer DIR and --messages FILE are required\n%s",
                            tp_usage);
  return NULL;
}

/* Reads a template file and compiles it. */
static kiln_status_t tp_compile_file(const char *path, kiln_template_t **out) {
  FILE *f = fopen(path, "rb");
  if (!f) return kiln_status_make(KILN_ERR_NOT_FOUND, "template: cannot open %s", path);
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  char chunk[65536];
  size_t n;
  while ((n = fread(chunk, 1, sizeof chunk, f)) > 0) kiln_strbuf_append(&b, chunk, n);
  bool bad = ferror(f) || !kiln_strbuf_ok(&b);
  fclose(f);
  kiln_status_t st = bad ? kiln_status_make(KILN_ERR_IO, "template: cannot read %s", path)
                         : kiln_template_compile(kiln_strbuf_cstr(&b), b.len, path, out);
  kiln_strbuf_free(&b);
  return st;
}

int kiln_cmd_template(kiln_cli_t *cli) {
  tp_args_t a;
  kiln_chat_template_t *ct = NULL;
  kiln_template_t *own = NULL;
  kiln_json_doc_t *doc = NULL;
  kiln_strbuf_t out = KILN_STRBUF_INIT;
  bool help = false;
  kiln_status_t st = tp_parse(cli, &a, &help);
  if (st || help) goto done;
  if (a.dir && (st = kiln_chat_template_load(a.dir, &ct))) {
    /* a standalone template does not need the directory to have one */
    if (!a.template_file || kiln_status_code(st) != KILN_ERR_NOT_FOUND) goto done;
    kiln_status_free(st);
    st = NULL;
  }
  if (a.template_file && (st = tp_compile_file(a.template_file, &own))) goto done;
  if ((st = kiln_json_parse_file(a.messages, &doc))) goto done;
  const kiln_json_t *root = kiln_json_root(doc);
  kiln_template_vars_t vars = {.add_generation_prompt = a.add_generation_prompt};
  if (kiln_json_is(root, KILN_JSON_ARRAY)) {
    vars.messages = root;
  } else if (kiln_json_is(root, KILN_JSON_OBJECT)) {
    vars.messages = kiln_json_get(root, "messages");
    vars.tools = kiln_json_get(root, "tools");
    vars.documents = kiln_json_get(root, "documents");
    if (kiln_json_bool(kiln_json_get(root, "add_generation_prompt")))
      vars.add_generation_prompt = true;
    vars.extra = root; /* the fixed variables above override their copies in here */
    if (!kiln_json_is(vars.messages, KILN_JSON_ARRAY)) {
      st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: \"messages\" must be an array",
                            a.messages);
      goto done;
    }
  } else {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "%s: expected an array of messages or an object with \"messages\"",
                          a.messages);
    goto done;
  }
  if (own) {
    if (ct) vars.strings = kiln_chat_template_strings(ct, &vars.n_strings);
    st = kiln_template_render(own, &vars, &out);
  } else {
    st = kiln_chat_template_render(ct, &vars, &out);
  }
  if (!st && !kiln_strbuf_ok(&out))
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "template: out of memory");
  if (!st && out.len && fwrite(out.data, 1, out.len, stdout) != out.len)
    st = kiln_status_make(KILN_ERR_IO, "template: cannot write the output");
  if (!st && fflush(stdout) != 0)
    st = kiln_status_make(KILN_ERR_IO, "template: cannot write the output");
done:
  kiln_strbuf_free(&out);
  kiln_json_doc_free(doc);
  kiln_template_free(own);
  kiln_chat_template_free(ct);
  return st ? kiln_cli_fail(st) : 0;
}
