/* model_tokenizer.c - see model_tokenizer.h. */
#include "models/model_tokenizer.h"

#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "base/strbuf.h"
#include "models/loader/gguf.h"
#include "models/model.h"

static bool is_gguf_path(const char *p) {
  size_t n = strlen(p);
  return n > 5 && strcmp(p + n - 5, ".gguf") == 0;
}

kiln_status_t kiln_model_open_tokenizer(const char *model_path, kiln_tokenizer_t **out_tok,
                                        kiln_chat_template_t **out_chat,
                                        kiln_status_t *out_chat_error,
                                        kiln_tokenizer_source_t *out_source) {
  *out_tok = NULL;
  if (out_chat) *out_chat = NULL;
  if (out_chat_error) *out_chat_error = NULL;
  if (out_source) *out_source = KILN_TOKENIZER_NONE;
  char dir[4096], tj[4200];
  kiln_status_t st = kiln_model_tokenizer_dir(model_path, dir, sizeof(dir));
  if (st) return st;
  snprintf(tj, sizeof(tj), "%s/tokenizer.json", dir);
  struct stat sb;
  kiln_status_t ct = NULL;
  if (stat(tj, &sb) == 0) {
    if ((st = kiln_tokenizer_load(dir, out_tok))) return st;
    if (out_source) *out_source = KILN_TOKENIZER_JSON;
    if (out_chat) ct = kiln_chat_template_load(dir, out_chat);
  } else if (is_gguf_path(model_path)) {
    kiln_strbuf_t tok = KILN_STRBUF_INIT, cfg = KILN_STRBUF_INIT;
    st = kiln_gguf_tokenizer(model_path, &tok, &cfg);
    if (kiln_status_code(st) == KILN_ERR_NOT_FOUND) {
      kiln_status_free(st);
      st = NULL;
    } else if (!st) {
      char name[4200];
      snprintf(name, sizeof(name), "%s (its tokenizer metadata)", model_path);
      st = kiln_tokenizer_load_json_config(tok.data, tok.len, cfg.data, cfg.len, name, out_tok);
      if (!st && out_source) *out_source = KILN_TOKENIZER_GGUF;
      if (!st && out_chat) ct = kiln_chat_template_load_config(cfg.data, cfg.len, name, out_chat);
    }
    kiln_strbuf_free(&tok);
    kiln_strbuf_free(&cfg);
    if (st) return st;
  }
  if (ct && kiln_status_code(ct) == KILN_ERR_OUT_OF_MEMORY) {
    kiln_tokenizer_free(*out_tok);
    *out_tok = NULL;
    return ct;
  }
  if (ct && kiln_status_code(ct) == KILN_ERR_NOT_FOUND) {
    kiln_status_free(ct);
    ct = NULL;
  }
  if (out_chat_error) {
    *out_chat_error = ct;
  } else {
    kiln_status_free(ct);
  }
  return NULL;
}
