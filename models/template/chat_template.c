/* chat_template.c - finds, compiles and selects the chat templates of a Hugging Face tokenizer
 * directory the way transformers does (PreTrainedTokenizerBase.from_pretrained and
 * get_chat_template), and renders with the special tokens of tokenizer_config.json. */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "models/template/template_internal.h"

enum { MAX_TEMPLATES = 64 };

static const char *const k_special[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                        "pad_token", "cls_token", "mask_token"};
enum { N_SPECIAL = sizeof k_special / sizeof *k_special };

struct kiln_chat_template {
  size_t n;
  char *names[MAX_TEMPLATES];
  kiln_template_t *tpls[MAX_TEMPLATES];
  kiln_template_string_var_t strings[N_SPECIAL];
  char *values[N_SPECIAL];
  size_t n_strings;
};

/* Reads a whole file; KILN_ERR_NOT_FOUND when it does not exist. */
static kiln_status_t read_file(const char *path, char **out, size_t *out_len) {
  *out = NULL;
  FILE *f = fopen(path, "rb");
  if (!f) {
    if (errno == ENOENT) return kiln_status_make(KILN_ERR_NOT_FOUND, "%s: no such file", path);
    return kiln_status_make(KILN_ERR_IO, "%s: %s", path, strerror(errno));
  }
  kiln_strbuf_t b = KILN_STRBUF_INIT;
  char chunk[65536];
  size_t n;
  while ((n = fread(chunk, 1, sizeof chunk, f)) > 0) kiln_strbuf_append(&b, chunk, n);
  bool err = ferror(f);
  fclose(f);
  if (err) {
    kiln_strbuf_free(&b);
    return kiln_status_make(KILN_ERR_IO, "%s: read error", path);
  }
  if (!kiln_strbuf_ok(&b)) {
    kiln_strbuf_free(&b);
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
  }
  *out = kiln_strbuf_detach(&b, out_len);
  return *out ? NULL : kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
}

static kiln_status_t add_template(kiln_chat_template_t *ct, const char *name, const char *src,
                                  size_t len, const char *label) {
  if (ct->n == MAX_TEMPLATES)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "more than %d chat templates",
                            MAX_TEMPLATES);
  for (size_t i = 0; i < ct->n; i++)
    if (!strcmp(ct->names[i], name)) {
      /* a later definition wins, as a Python dict would keep it */
      kiln_template_t *t = NULL;
      kiln_status_t st = kiln_template_compile(src, len, label, &t);
      if (st) return st;
      kiln_template_free(ct->tpls[i]);
      ct->tpls[i] = t;
      return NULL;
    }
  char *nm = strdup(name);
  if (!nm) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  kiln_status_t st = kiln_template_compile(src, len, label, &ct->tpls[ct->n]);
  if (st) {
    free(nm);
    return st;
  }
  ct->names[ct->n++] = nm;
  return NULL;
}

static kiln_status_t load_file_template(kiln_chat_template_t *ct, const char *path,
                                        const char *name, const char *label, bool *found) {
  char *src = NULL;
  size_t len = 0;
  kiln_status_t st = read_file(path, &src, &len);
  if (kiln_status_code(st) == KILN_ERR_NOT_FOUND) {
    kiln_status_free(st);
    return NULL;
  }
  if (!st) {
    st = add_template(ct, name, src, len, label);
    *found = true;
  }
  free(src);
  return st;
}

/* chat_template.jinja and additional_chat_templates/<name>.jinja (transformers >= 4.50). */
static kiln_status_t load_jinja_files(kiln_chat_template_t *ct, const char *dir, bool *found) {
  char path[4096];
  snprintf(path, sizeof path, "%s/chat_template.jinja", dir);
  kiln_status_t st = load_file_template(ct, path, "default", "chat_template.jinja", found);
  if (st) return st;
  snprintf(path, sizeof path, "%s/additional_chat_templates", dir);
  DIR *d = opendir(path);
  if (!d) return NULL;
  struct dirent *e;
  while (!st && (e = readdir(d))) {
    size_t l = strlen(e->d_name);
    if (l <= 6 || strcmp(e->d_name + l - 6, ".jinja") != 0) continue;
    char name[256], file[4400], label[300];
    snprintf(name, sizeof name, "%.*s", (int)(l - 6), e->d_name);
    snprintf(file, sizeof file, "%s/%s", path, e->d_name);
    snprintf(label, sizeof label, "additional_chat_templates/%s", e->d_name);
    st = load_file_template(ct, file, name, label, found);
  }
  closedir(d);
  return st;
}

static kiln_status_t load_config_templates(kiln_chat_template_t *ct, const kiln_json_t *tpl,
                                           const char *cfg_path) {
  size_t len = 0;
  if (kiln_json_is(tpl, KILN_JSON_STRING)) {
    const char *s = kiln_json_string(tpl, &len);
    return add_template(ct, "default", s, len, "chat_template");
  }
  if (kiln_json_is(tpl, KILN_JSON_ARRAY)) {
    for (size_t i = 0; i < kiln_json_len(tpl); i++) {
      const kiln_json_t *e = kiln_json_at(tpl, i);
      const char *name = kiln_json_string(kiln_json_get(e, "name"), NULL);
      const char *src = kiln_json_string(kiln_json_get(e, "template"), &len);
      if (!name || !src)
        return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                                "%s: chat_template[%zu] needs string \"name\" and \"template\"",
                                cfg_path, i);
      char label[300];
      snprintf(label, sizeof label, "chat_template.%s", name);
      kiln_status_t st =
          add_template(ct, name, src, len, strcmp(name, "default") ? label : "chat_template");
      if (st) return st;
    }
    return NULL;
  }
  if (kiln_json_is(tpl, KILN_JSON_OBJECT)) {
    for (size_t i = 0; i < kiln_json_len(tpl); i++) {
      const char *name = kiln_json_key_at(tpl, i, NULL);
      const char *src = kiln_json_string(kiln_json_value_at(tpl, i), &len);
      if (!src)
        return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: chat_template.%s is not a string",
                                cfg_path, name);
      char label[300];
      snprintf(label, sizeof label, "chat_template.%s", name);
      kiln_status_t st =
          add_template(ct, name, src, len, strcmp(name, "default") ? label : "chat_template");
      if (st) return st;
    }
    return NULL;
  }
  return kiln_status_make(
      KILN_ERR_INVALID_ARGUMENT,
      "%s: \"chat_template\" must be a string or a list of {name, template}, not %s", cfg_path,
      kiln_json_type_name(kiln_json_type(tpl)));
}

static kiln_status_t load_special_tokens(kiln_chat_template_t *ct, const kiln_json_t *cfg) {
  for (size_t i = 0; i < N_SPECIAL; i++) {
    const kiln_json_t *v = kiln_json_get(cfg, k_special[i]);
    if (kiln_json_is(v, KILN_JSON_OBJECT)) v = kiln_json_get(v, "content"); /* AddedToken */
    const char *s = kiln_json_string(v, NULL);
    if (!s) continue;
    char *copy = strdup(s);
    if (!copy) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
    ct->values[ct->n_strings] = copy;
    ct->strings[ct->n_strings].name = k_special[i];
    ct->strings[ct->n_strings].value = copy;
    ct->n_strings++;
  }
  return NULL;
}

kiln_status_t kiln_chat_template_load(const char *dir, kiln_chat_template_t **out_ct) {
  *out_ct = NULL;
  kiln_chat_template_t *ct = calloc(1, sizeof *ct);
  kiln_json_doc_t *doc = NULL;
  kiln_status_t st = NULL;
  char cfg_path[4096];
  bool have_files = false;
  if (!ct) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  snprintf(cfg_path, sizeof cfg_path, "%s/tokenizer_config.json", dir);
  st = kiln_json_parse_file(cfg_path, &doc);
  if (kiln_status_code(st) == KILN_ERR_NOT_FOUND) {
    kiln_status_free(st);
    st = NULL;
  }
  if (st) goto fail;
  /* Template files, when present, replace whatever tokenizer_config.json holds. */
  st = load_jinja_files(ct, dir, &have_files);
  if (st) goto fail;
  const kiln_json_t *cfg = doc ? kiln_json_root(doc) : NULL;
  if (doc && !kiln_json_is(cfg, KILN_JSON_OBJECT)) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: not a JSON object", cfg_path);
    goto fail;
  }
  if (!have_files) {
    const kiln_json_t *tpl = kiln_json_get(cfg, "chat_template");
    if (tpl && !kiln_json_is(tpl, KILN_JSON_NULL)) {
      st = load_config_templates(ct, tpl, cfg_path);
      if (st) goto fail;
    }
  }
  if (ct->n == 0) {
    st = kiln_status_make(KILN_ERR_NOT_FOUND,
                          "no chat template (tokenizer_config.json has no \"chat_template\" and "
                          "there is no chat_template.jinja)");
    goto fail;
  }
  if (cfg) st = load_special_tokens(ct, cfg);
  if (st) goto fail;
  kiln_json_doc_free(doc);
  *out_ct = ct;
  return NULL;
fail:
  kiln_json_doc_free(doc);
  kiln_chat_template_free(ct);
  return kiln_status_annotate(st, "chat template of %s", dir);
}

kiln_status_t kiln_chat_template_load_config(const char *json, size_t len, const char *name,
                                             kiln_chat_template_t **out_ct) {
  *out_ct = NULL;
  kiln_chat_template_t *ct = calloc(1, sizeof *ct);
  if (!ct) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  kiln_json_doc_t *doc = NULL;
  kiln_status_t st = kiln_json_parse(json, len, name, &doc);
  const kiln_json_t *cfg = doc ? kiln_json_root(doc) : NULL;
  if (!st && !kiln_json_is(cfg, KILN_JSON_OBJECT))
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: not a JSON object", name);
  const kiln_json_t *tpl = st ? NULL : kiln_json_get(cfg, "chat_template");
  if (!st && tpl && !kiln_json_is(tpl, KILN_JSON_NULL)) st = load_config_templates(ct, tpl, name);
  if (!st && ct->n == 0)
    st = kiln_status_make(KILN_ERR_NOT_FOUND, "no chat template (%s has none)", name);
  if (!st) st = load_special_tokens(ct, cfg);
  kiln_json_doc_free(doc);
  if (st) {
    kiln_chat_template_free(ct);
    return kiln_status_annotate(st, "chat template of %s", name);
  }
  *out_ct = ct;
  return NULL;
}

const kiln_template_t *kiln_chat_template_get(const kiln_chat_template_t *ct, const char *name) {
  for (size_t i = 0; i < ct->n; i++)
    if (!strcmp(ct->names[i], name)) return ct->tpls[i];
  return NULL;
}

const kiln_template_t *kiln_chat_template_select(const kiln_chat_template_t *ct, bool has_tools) {
  const kiln_template_t *t = has_tools ? kiln_chat_template_get(ct, "tool_use") : NULL;
  return t ? t : kiln_chat_template_get(ct, "default");
}

const kiln_template_string_var_t *kiln_chat_template_strings(const kiln_chat_template_t *ct,
                                                             size_t *out_n) {
  *out_n = ct->n_strings;
  return ct->strings;
}

kiln_status_t kiln_chat_template_render(const kiln_chat_template_t *ct,
                                        const kiln_template_vars_t *vars, kiln_strbuf_t *out) {
  bool has_tools = vars->tools && !kiln_json_is(vars->tools, KILN_JSON_NULL);
  const kiln_template_t *t = kiln_chat_template_select(ct, has_tools);
  if (!t)
    return kiln_status_make(KILN_ERR_NOT_FOUND,
                            "this model has several chat templates and none is named \"default\"");
  kiln_template_vars_t v = *vars;
  v.strings = ct->strings;
  v.n_strings = ct->n_strings;
  return kiln_template_render(t, &v, out);
}

void kiln_chat_template_free(kiln_chat_template_t *ct) {
  if (!ct) return;
  for (size_t i = 0; i < ct->n; i++) {
    free(ct->names[i]);
    kiln_template_free(ct->tpls[i]);
  }
  for (size_t i = 0; i < ct->n_strings; i++) free(ct->values[i]);
  free(ct);
}
