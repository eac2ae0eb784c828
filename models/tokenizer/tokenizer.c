/* tokenizer.c - loading tokenizer.json (+ tokenizer_config.json), the encode pipeline
 * (added tokens -> normalizer -> pre-tokenizer -> BPE -> post-processor) and the lookups. */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "models/tokenizer/tok_internal.h"

typedef struct ktok_enc_ctx enc_ctx_t;
static void enc_ctx_free(enc_ctx_t *c);

/* ---- kiln_tokens_t --------------------------------------------------------------------- */

bool kiln_tokens_push(kiln_tokens_t *t, int32_t id) {
  if (t->len == t->cap) {
    size_t cap = t->cap ? t->cap * 2 : 64;
    int32_t *ids = realloc(t->ids, cap * sizeof(*ids));
    if (!ids) return false;
    t->ids = ids;
    t->cap = cap;
  }
  t->ids[t->len++] = id;
  return true;
}

void kiln_tokens_free(kiln_tokens_t *t) {
  free(t->ids);
  t->ids = NULL;
  t->len = t->cap = 0;
}

/* ---- post-processors ------------------------------------------------------------------- */

static void post_free(ktok_post_t *p) {
  if (!p) return;
  for (size_t i = 0; i < p->n_children; i++) post_free(p->children[i]);
  free(p->children);
  for (size_t i = 0; i < p->n_items; i++) free(p->items[i].ids);
  free(p->items);
  free(p);
}

/* A [token, id] pair of Bert/RobertaProcessing. */
static kiln_status_t parse_tok_pair(kiln_arena_t *a, const kiln_json_t *v, const char *key,
                                    const char *path, ktok_tpl_item_t *item) {
  const kiln_json_t *p = kiln_json_get(v, key);
  int64_t id;
  if (!kiln_json_is(p, KILN_JSON_ARRAY) || kiln_json_len(p) != 2 ||
      !kiln_json_int64(kiln_json_at(p, 1), &id) || id < 0 || id > INT32_MAX) {
    return ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "%s must be [token, id]", key);
  }
  (void)a;
  item->ids = malloc(sizeof(*item->ids));
  if (!item->ids) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  item->ids[0] = (int32_t)id;
  item->n_ids = 1;
  return NULL;
}

static kiln_status_t parse_template(kiln_arena_t *a, const kiln_json_t *v, const char *path,
                                    ktok_post_t *p) {
  const kiln_json_t *single = kiln_json_get(v, "single");
  const kiln_json_t *specials = kiln_json_get(v, "special_tokens");
  char sub[512];
  if (!kiln_json_is(single, KILN_JSON_ARRAY)) {
    return ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "single must be an array");
  }
  size_t n = kiln_json_len(single);
  p->items = calloc(n ? n : 1, sizeof(*p->items));
  if (!p->items) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  p->n_items = n;
  for (size_t i = 0; i < n; i++) {
    const kiln_json_t *it = kiln_json_at(single, i);
    snprintf(sub, sizeof(sub), "%s.single[%zu]", path, i);
    const kiln_json_t *seq = kiln_json_get(it, "Sequence");
    const kiln_json_t *sp = kiln_json_get(it, "SpecialToken");
    if (kiln_json_len(it) != 1 || (!seq && !sp)) {
      return ktok_err(KILN_ERR_INVALID_ARGUMENT, sub,
                      "expected {\"Sequence\": ...} or {\"SpecialToken\": ...}");
    }
    const char *id = kiln_json_string(kiln_json_get(seq ? seq : sp, "id"), NULL);
    if (!id) return ktok_err(KILN_ERR_INVALID_ARGUMENT, sub, "id must be a string");
    if (seq) {
      if (strcmp(id, "A") != 0) {
        return ktok_err(KILN_ERR_UNSUPPORTED, sub,
                        "sequence '%s' in a single template is not supported", id);
      }
      p->items[i].is_sequence = true;
      continue;
    }
    const kiln_json_t *def = kiln_json_get(specials, id);
    const kiln_json_t *ids = kiln_json_get(def, "ids");
    if (!kiln_json_is(ids, KILN_JSON_ARRAY)) {
      return ktok_err(KILN_ERR_INVALID_ARGUMENT, sub,
                      "special token '%s' is not defined in special_tokens", id);
    }
    size_t k = kiln_json_len(ids);
    int32_t *arr = malloc((k ? k : 1) * sizeof(*arr));
    if (!arr) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
    for (size_t j = 0; j < k; j++) {
      int64_t x;
      if (!kiln_json_int64(kiln_json_at(ids, j), &x) || x < 0 || x > INT32_MAX) {
        free(arr);
        return ktok_err(KILN_ERR_INVALID_ARGUMENT, sub,
                        "special_tokens['%s'].ids[%zu] is not a valid id", id, j);
      }
      arr[j] = (int32_t)x;
    }
    p->items[i].ids = arr; /* owned by the item */
    p->items[i].n_ids = k;
  }
  return NULL;
}

/* Every id a post-processor adds must be in the vocabulary (an out-of-range one would reach the
 * model's embedding): checked once the vocabulary size is known. */
static kiln_status_t post_check_ids(const ktok_post_t *p, size_t vocab_size) {
  if (!p) return NULL;
  for (size_t i = 0; i < p->n_items; i++) {
    for (size_t j = 0; j < p->items[i].n_ids; j++) {
      int32_t id = p->items[i].ids[j];
      if (id < 0 || (size_t)id >= vocab_size) {
        return ktok_err(KILN_ERR_INVALID_ARGUMENT, "post_processor",
                        "token id %d is out of range (vocabulary size %zu)", (int)id, vocab_size);
      }
    }
  }
  for (size_t i = 0; i < p->n_children; i++) {
    kiln_status_t st = post_check_ids(p->children[i], vocab_size);
    if (st) return st;
  }
  return NULL;
}

static kiln_status_t post_parse(kiln_arena_t *a, const kiln_json_t *v, const char *path,
                                ktok_post_t **out) {
  *out = NULL;
  const char *type = kiln_json_string(kiln_json_get(v, "type"), NULL);
  if (!type) return ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "type is missing");
  ktok_post_t *p = calloc(1, sizeof(*p));
  if (!p) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  kiln_status_t st = NULL;
  char sub[512];
  if (strcmp(type, "TemplateProcessing") == 0) {
    static const char *const keys[] = {"type", "single", "pair", "special_tokens", NULL};
    if (!(st = ktok_json_only(v, path, keys))) st = parse_template(a, v, path, p);
  } else if (strcmp(type, "ByteLevel") == 0) {
    static const char *const keys[] = {"type", "add_prefix_space", "trim_offsets", "use_regex",
                                       NULL};
    st = ktok_json_only(v, path, keys); /* offsets only: nothing to do for ids */
  } else if (strcmp(type, "BertProcessing") == 0 || strcmp(type, "RobertaProcessing") == 0) {
    static const char *const keys[] = {"type", "sep", "cls", "trim_offsets", "add_prefix_space",
                                       NULL};
    if (!(st = ktok_json_only(v, path, keys))) {
      p->items = calloc(3, sizeof(*p->items));
      if (!p->items) {
        st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
      } else {
        p->n_items = 3;
        p->items[1].is_sequence = true;
        if (!(st = parse_tok_pair(a, v, "cls", path, &p->items[0]))) {
          st = parse_tok_pair(a, v, "sep", path, &p->items[2]);
        }
      }
    }
  } else if (strcmp(type, "Sequence") == 0) {
    static const char *const keys[] = {"type", "processors", NULL};
    const kiln_json_t *arr = kiln_json_get(v, "processors");
    p->is_sequence = true;
    if (!(st = ktok_json_only(v, path, keys))) {
      if (!kiln_json_is(arr, KILN_JSON_ARRAY)) {
        st = ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "processors must be an array");
      } else {
        size_t cnt = kiln_json_len(arr);
        p->children = calloc(cnt ? cnt : 1, sizeof(*p->children));
        if (!p->children) st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
        for (size_t i = 0; i < cnt && !st; i++) {
          snprintf(sub, sizeof(sub), "%s.processors[%zu]", path, i);
          st = post_parse(a, kiln_json_at(arr, i), sub, &p->children[i]);
          if (!st) p->n_children++;
        }
      }
    }
  } else {
    st = ktok_err(KILN_ERR_UNSUPPORTED, path, "type '%s' is not supported", type);
  }
  if (st) {
    post_free(p);
    return st;
  }
  *out = p;
  return NULL;
}

/* Rewrites out[start..] as the processor's single template around it. */
static bool post_apply(const ktok_post_t *p, kiln_tokens_t *out, size_t start) {
  if (p->is_sequence) {
    for (size_t i = 0; i < p->n_children; i++) {
      if (!post_apply(p->children[i], out, start)) return false;
    }
    return true;
  }
  if (!p->items) return true;
  size_t n = out->len - start;
  int32_t *seq = malloc((n ? n : 1) * sizeof(*seq));
  if (!seq) return false;
  if (n) memcpy(seq, out->ids + start, n * sizeof(*seq));
  out->len = start;
  bool ok = true;
  for (size_t i = 0; i < p->n_items && ok; i++) {
    if (p->items[i].is_sequence) {
      for (size_t k = 0; k < n && ok; k++) ok = kiln_tokens_push(out, seq[k]);
    } else {
      for (size_t k = 0; k < p->items[i].n_ids && ok; k++)
        ok = kiln_tokens_push(out, p->items[i].ids[k]);
    }
  }
  free(seq); /* on failure the caller drops everything from start */
  return ok;
}

/* ---- loading --------------------------------------------------------------------------- */

static kiln_status_t load_added(kiln_tokenizer_t *tok, const kiln_json_t *arr) {
  if (!arr || kiln_json_is(arr, KILN_JSON_NULL)) return NULL;
  if (!kiln_json_is(arr, KILN_JSON_ARRAY)) {
    return ktok_err(KILN_ERR_INVALID_ARGUMENT, "added_tokens", "must be an array");
  }
  static const char *const keys[] = {"id",     "content",    "single_word", "lstrip",
                                     "rstrip", "normalized", "special",     NULL};
  size_t n = kiln_json_len(arr);
  tok->added = calloc(n ? n : 1, sizeof(*tok->added));
  if (!tok->added || !ktok_map_init(&tok->added_map, n)) {
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "added_tokens: out of memory");
  }
  char path[64];
  kiln_status_t st = NULL;
  for (size_t i = 0; i < n; i++) {
    const kiln_json_t *v = kiln_json_at(arr, i);
    snprintf(path, sizeof(path), "added_tokens[%zu]", i);
    if (!kiln_json_is(v, KILN_JSON_OBJECT)) {
      return ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "must be an object");
    }
    ktok_added_t *t = &tok->added[i];
    int64_t id;
    if ((st = ktok_json_only(v, path, keys))) return st;
    if (!kiln_json_int64(kiln_json_get(v, "id"), &id) || id < 0 || id >= (1 << 24)) {
      return ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "id must be an integer in [0, %d)", 1 << 24);
    }
    if ((st = ktok_json_str(&tok->arena, v, "content", path, &t->content, &t->len))) return st;
    if (!t->content) return ktok_err(KILN_ERR_INVALID_ARGUMENT, path, "content is missing");
    if ((st = ktok_json_bool(v, "special", false, path, &t->special))) return st;
    if ((st = ktok_json_bool(v, "single_word", false, path, &t->single_word))) return st;
    if ((st = ktok_json_bool(v, "lstrip", false, path, &t->lstrip))) return st;
    if ((st = ktok_json_bool(v, "rstrip", false, path, &t->rstrip))) return st;
    if ((st = ktok_json_bool(v, "normalized", !t->special, path, &t->normalized))) return st;
    /* HF: a token already in the model vocabulary keeps that id. */
    int32_t vid = ktok_map_get(&tok->bpe->vocab, t->content, t->len);
    t->id = vid >= 0 ? vid : (int32_t)id;
    tok->n_added++;
    if (t->len && !ktok_map_put(&tok->added_map, t->content, t->len, (int32_t)i, NULL)) {
      return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "added_tokens: out of memory");
    }
  }
  return NULL;
}

static bool is_null(const kiln_json_t *v) { return !v || kiln_json_is(v, KILN_JSON_NULL); }

static kiln_status_t build(kiln_tokenizer_t *tok, const kiln_json_t *root) {
  static const char *const keys[] = {
      "version",       "truncation", "padding",        "added_tokens", "normalizer",
      "pre_tokenizer", "model",      "post_processor", "decoder",      NULL};
  kiln_status_t st;
  if (!kiln_json_is(root, KILN_JSON_OBJECT)) {
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "the top level must be an object");
  }
  if ((st = ktok_json_only(root, "(top level)", keys))) return st;
  if (!is_null(kiln_json_get(root, "truncation"))) {
    return ktok_err(KILN_ERR_UNSUPPORTED, "truncation",
                    "must be null (truncation is not supported)");
  }
  if (!is_null(kiln_json_get(root, "padding"))) {
    return ktok_err(KILN_ERR_UNSUPPORTED, "padding", "must be null (padding is not supported)");
  }
  const kiln_json_t *model = kiln_json_get(root, "model");
  if (!kiln_json_is(model, KILN_JSON_OBJECT)) {
    return ktok_err(KILN_ERR_INVALID_ARGUMENT, "model", model ? "must be an object" : "is missing");
  }
  const char *mtype = kiln_json_string(kiln_json_get(model, "type"), NULL);
  if (mtype ? strcmp(mtype, "BPE") != 0 : !kiln_json_get(model, "merges")) {
    return ktok_err(KILN_ERR_UNSUPPORTED, "model", "type '%s' is not supported (only BPE is)",
                    mtype ? mtype : "(none)");
  }
  if ((st = ktok_bpe_parse(&tok->arena, model, "model", &tok->bpe))) return st;
  const kiln_json_t *v;
  if (!is_null(v = kiln_json_get(root, "normalizer")) &&
      (st = ktok_normalizer_parse(&tok->arena, v, "normalizer", &tok->normalizer))) {
    return st;
  }
  if (!is_null(v = kiln_json_get(root, "pre_tokenizer")) &&
      (st = ktok_pretok_parse(&tok->arena, v, "pre_tokenizer", &tok->pretok))) {
    return st;
  }
  if (!is_null(v = kiln_json_get(root, "decoder")) &&
      (st = ktok_decoder_parse(&tok->arena, v, "decoder", &tok->decoder))) {
    return st;
  }
  if (!is_null(v = kiln_json_get(root, "post_processor")) &&
      (st = post_parse(&tok->arena, v, "post_processor", &tok->post))) {
    return st;
  }
  if ((st = load_added(tok, kiln_json_get(root, "added_tokens")))) return st;

  size_t vs = tok->bpe->n_ids_r;
  for (size_t i = 0; i < tok->n_added; i++) {
    if ((size_t)tok->added[i].id + 1 > vs) vs = (size_t)tok->added[i].id + 1;
  }
  tok->vocab_size = vs;
  if ((st = post_check_ids(tok->post, vs))) return st;
  tok->added_by_id = malloc((vs ? vs : 1) * sizeof(*tok->added_by_id));
  if (!tok->added_by_id) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
  for (size_t i = 0; i < vs; i++) tok->added_by_id[i] = -1;
  for (size_t i = 0; i < tok->n_added; i++) {
    if (tok->added[i].len) tok->added_by_id[tok->added[i].id] = (int32_t)i;
  }
  ktok_match_ctx_t mc;
  ktok_match_ctx_init(&mc);
  st = ktok_trie_build(&tok->trie_raw, tok->added, tok->n_added, false, NULL, &mc, &tok->arena);
  if (!st) {
    st = ktok_trie_build(&tok->trie_norm, tok->added, tok->n_added, true, tok->normalizer, &mc,
                         &tok->arena);
  }
  ktok_match_ctx_free(&mc);
  return st;
}

static int32_t lookup_token(const kiln_tokenizer_t *tok, const char *s) {
  return s ? kiln_tokenizer_token_to_id(tok, s, strlen(s)) : -1;
}

/* bos_token / eos_token are a string or an {"content": ...} object. */
static kiln_status_t config_token(kiln_tokenizer_t *tok, const kiln_json_t *cfg, const char *key,
                                  char **out) {
  const kiln_json_t *v = kiln_json_get(cfg, key);
  if (kiln_json_is(v, KILN_JSON_OBJECT)) v = kiln_json_get(v, "content");
  if (is_null(v)) return NULL;
  size_t n;
  const char *s = kiln_json_string(v, &n);
  if (!s) return ktok_err(KILN_ERR_INVALID_ARGUMENT, key, "must be a string or {\"content\": ...}");
  *out = kiln_arena_strndup(&tok->arena, s, n);
  return *out ? NULL : kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "out of memory");
}

/* Reads bos/eos and add_bos/add_eos from a parsed tokenizer_config.json (name in messages). */
static kiln_status_t apply_config(kiln_tokenizer_t *tok, const kiln_json_t *cfg, const char *name) {
  kiln_status_t st = NULL;
  if (!kiln_json_is(cfg, KILN_JSON_OBJECT)) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: the top level must be an object", name);
  }
  if (!st) st = config_token(tok, cfg, "bos_token", &tok->bos_token);
  if (!st) st = config_token(tok, cfg, "eos_token", &tok->eos_token);
  if (!st) st = ktok_json_bool(cfg, "add_bos_token", false, "add_bos_token", &tok->add_bos);
  if (!st) st = ktok_json_bool(cfg, "add_eos_token", false, "add_eos_token", &tok->add_eos);
  if (st && kiln_status_code(st) != KILN_ERR_OUT_OF_MEMORY) {
    st = kiln_status_annotate(st, "%s", name);
  }
  tok->bos_id = lookup_token(tok, tok->bos_token);
  tok->eos_id = lookup_token(tok, tok->eos_token);
  return st;
}

static kiln_status_t load_config(kiln_tokenizer_t *tok, const char *path) {
  struct stat sb;
  if (stat(path, &sb) != 0) return NULL; /* optional */
  kiln_json_doc_t *doc = NULL;
  kiln_status_t st = kiln_json_parse_file(path, &doc);
  if (st) return st;
  st = apply_config(tok, kiln_json_root(doc), path);
  kiln_json_doc_free(doc);
  return st;
}

static kiln_status_t load_doc(const kiln_json_t *root, const char *name, kiln_tokenizer_t **out) {
  kiln_tokenizer_t *tok = calloc(1, sizeof(*tok));
  if (!tok) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory", name);
  pthread_mutex_init(&tok->pool_lock, NULL);
  tok->bos_id = tok->eos_id = -1;
  kiln_status_t st = build(tok, root);
  if (st) {
    kiln_tokenizer_free(tok);
    return kiln_status_annotate(st, "%s", name);
  }
  *out = tok;
  return NULL;
}

kiln_status_t kiln_tokenizer_load_json(const char *json, size_t len, const char *name,
                                       kiln_tokenizer_t **out) {
  *out = NULL;
  kiln_json_doc_t *doc = NULL;
  kiln_status_t st = kiln_json_parse(json, len, name, &doc);
  if (st) return st;
  st = load_doc(kiln_json_root(doc), name, out);
  kiln_json_doc_free(doc);
  return st;
}

kiln_status_t kiln_tokenizer_load_json_config(const char *json, size_t len, const char *config,
                                              size_t config_len, const char *name,
                                              kiln_tokenizer_t **out) {
  kiln_status_t st = kiln_tokenizer_load_json(json, len, name, out);
  if (st || !config) return st;
  kiln_json_doc_t *doc = NULL;
  st = kiln_json_parse(config, config_len, name, &doc);
  if (!st) st = apply_config(*out, kiln_json_root(doc), name);
  kiln_json_doc_free(doc);
  if (st) {
    kiln_tokenizer_free(*out);
    *out = NULL;
  }
  return st;
}

kiln_status_t kiln_tokenizer_load(const char *dir_or_file, kiln_tokenizer_t **out) {
  *out = NULL;
  struct stat sb;
  if (stat(dir_or_file, &sb) != 0) {
    return kiln_status_make(KILN_ERR_NOT_FOUND, "tokenizer: %s: no such file or directory",
                            dir_or_file);
  }
  size_t n = strlen(dir_or_file);
  char *file = malloc(n + 32), *cfg = malloc(n + 32);
  kiln_status_t st = NULL;
  kiln_json_doc_t *doc = NULL;
  if (!file || !cfg) {
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "tokenizer: out of memory");
    goto done;
  }
  if (S_ISDIR(sb.st_mode)) {
    snprintf(file, n + 32, "%s/tokenizer.json", dir_or_file);
    snprintf(cfg, n + 32, "%s/tokenizer_config.json", dir_or_file);
  } else if (S_ISREG(sb.st_mode)) {
    snprintf(file, n + 32, "%s", dir_or_file);
    const char *slash = strrchr(dir_or_file, '/');
    if (slash) {
      snprintf(cfg, n + 32, "%.*s/tokenizer_config.json", (int)(slash - dir_or_file), dir_or_file);
    } else {
      snprintf(cfg, n + 32, "tokenizer_config.json");
    }
  } else {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "tokenizer: %s is not a file or directory",
                          dir_or_file);
    goto done;
  }
  if ((st = kiln_json_parse_file(file, &doc))) goto done;
  if ((st = load_doc(kiln_json_root(doc), file, out))) goto done;
  if ((st = load_config(*out, cfg))) {
    kiln_tokenizer_free(*out);
    *out = NULL;
  }
done:
  kiln_json_doc_free(doc);
  free(file);
  free(cfg);
  return st;
}

void kiln_tokenizer_free(kiln_tokenizer_t *tok) {
  if (!tok) return;
  for (int i = 0; i < tok->n_pool; i++) enc_ctx_free(tok->pool[i]);
  pthread_mutex_destroy(&tok->pool_lock);
  ktok_bpe_free(tok->bpe);
  ktok_normalizer_free(tok->normalizer);
  ktok_pretok_free(tok->pretok);
  ktok_decoder_free(tok->decoder);
  post_free(tok->post);
  free(tok->added);
  ktok_map_free(&tok->added_map);
  free(tok->added_by_id);
  ktok_trie_free(&tok->trie_raw);
  ktok_trie_free(&tok->trie_norm);
  kiln_arena_free(&tok->arena);
  free(tok);
}

/* ---- encoding -------------------------------------------------------------------------- */

struct ktok_enc_ctx {
  ktok_match_ctx_t mc;
  ktok_pieces_t p[3];
  kiln_strbuf_t norm;
  ktok_bpe_work_t work;
};

static void enc_ctx_free(enc_ctx_t *c) {
  if (!c) return;
  for (int i = 0; i < 3; i++) ktok_pieces_free(&c->p[i]);
  kiln_strbuf_free(&c->norm);
  ktok_bpe_work_free(&c->work);
  ktok_match_ctx_free(&c->mc);
  free(c);
}

/* Takes a scratch context from the pool (or makes one); NULL on out-of-memory. */
static enc_ctx_t *enc_ctx_get(const kiln_tokenizer_t *ctok) {
  kiln_tokenizer_t *tok = (kiln_tokenizer_t *)ctok; /* the pool is the mutable part */
  enc_ctx_t *c = NULL;
  pthread_mutex_lock(&tok->pool_lock);
  if (tok->n_pool > 0) c = tok->pool[--tok->n_pool];
  pthread_mutex_unlock(&tok->pool_lock);
  if (!c) {
    c = calloc(1, sizeof(*c));
    if (c) ktok_match_ctx_init(&c->mc);
  }
  return c;
}

/* Returns a context to the pool; contexts that grew huge are freed instead. */
static void enc_ctx_put(const kiln_tokenizer_t *ctok, enc_ctx_t *c) {
  kiln_tokenizer_t *tok = (kiln_tokenizer_t *)ctok;
  if (c->p[0].text.cap > (4u << 20) || c->norm.cap > (4u << 20) || c->work.sym_cap > (1u << 20)) {
    enc_ctx_free(c);
    return;
  }
  pthread_mutex_lock(&tok->pool_lock);
  if (tok->n_pool < KTOK_CTX_POOL) {
    tok->pool[tok->n_pool++] = c;
    c = NULL;
  }
  pthread_mutex_unlock(&tok->pool_lock);
  enc_ctx_free(c);
}

/* Normalized text (one segment between raw added tokens): split out normalized added tokens,
 * pre-tokenize the rest and run the model. */
static kiln_status_t encode_normalized(const kiln_tokenizer_t *tok, enc_ctx_t *c, const char *s,
                                       size_t n, bool seg_at_start, kiln_tokens_t *out) {
  ktok_split_t *splits = NULL;
  size_t ns = 0;
  kiln_status_t st = ktok_added_split(&tok->trie_norm, tok->added, s, n, &splits, &ns);
  if (st) return st;
  for (size_t i = 0; i < ns && !st; i++) {
    if (splits[i].token >= 0) {
      if (!kiln_tokens_push(out, tok->added[splits[i].token].id)) goto oom;
      continue;
    }
    ktok_pieces_reset(&c->p[0]);
    if (!ktok_pieces_add(&c->p[0], s + splits[i].start, splits[i].stop - splits[i].start,
                         seg_at_start && splits[i].start == 0)) {
      goto oom;
    }
    ktok_pieces_t *res = &c->p[0];
    if (tok->pretok) {
      if ((st = ktok_pretokenize(tok->pretok, &c->mc, &c->p[0], &c->p[1], &c->p[2]))) break;
      res = &c->p[1];
    }
    for (size_t k = 0; k < res->n && !st; k++) {
      st =
          ktok_bpe_tokenize(tok->bpe, &c->work, res->text.data + res->v[k].off, res->v[k].len, out);
    }
  }
  free(splits);
  return st;
oom:
  free(splits);
  return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "encode: out of memory");
}

kiln_status_t kiln_tokenizer_encode(const kiln_tokenizer_t *tok, const char *text, size_t len,
                                    bool add_special_tokens, kiln_tokens_t *out) {
  size_t valid = ktok_utf8_valid_prefix(text, len);
  if (valid != len) {
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "encode: the input is not valid UTF-8 (byte 0x%02x at offset %zu)",
                            (unsigned char)text[valid], valid);
  }
  size_t start_len = out->len;
  enc_ctx_t *cp = enc_ctx_get(tok);
  if (!cp) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "encode: out of memory");
  enc_ctx_t c = *cp; /* a local copy for brevity; written back before it is pooled */
  ktok_split_t *splits = NULL;
  size_t ns = 0;
  kiln_status_t st = ktok_added_split(&tok->trie_raw, tok->added, text, len, &splits, &ns);
  for (size_t i = 0; i < ns && !st; i++) {
    if (splits[i].token >= 0) {
      if (!kiln_tokens_push(out, tok->added[splits[i].token].id)) goto oom;
      continue;
    }
    const char *seg = text + splits[i].start;
    size_t seg_n = splits[i].stop - splits[i].start;
    if (tok->normalizer) {
      kiln_strbuf_reset(&c.norm);
      if ((st = ktok_normalize(tok->normalizer, &c.mc, seg, seg_n, &c.norm))) break;
      seg = c.norm.data ? c.norm.data : "";
      seg_n = c.norm.len;
    }
    st = encode_normalized(tok, &c, seg, seg_n, splits[i].start == 0, out);
  }
  if (!st && add_special_tokens && tok->post && !post_apply(tok->post, out, start_len)) goto oom;
  goto done;
oom:
  st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "encode: out of memory");
done:
  if (st) out->len = start_len;
  free(splits);
  *cp = c;
  enc_ctx_put(tok, cp);
  return st;
}

/* ---- lookups --------------------------------------------------------------------------- */

size_t kiln_tokenizer_vocab_size(const kiln_tokenizer_t *tok) { return tok->vocab_size; }

const char *kiln_tokenizer_id_to_token(const kiln_tokenizer_t *tok, int32_t id, size_t *out_len) {
  return ktok_id_to_token(tok, id, out_len);
}

int32_t kiln_tokenizer_token_to_id(const kiln_tokenizer_t *tok, const char *token, size_t len) {
  int32_t ai = ktok_map_get(&tok->added_map, token, len);
  if (ai >= 0) return tok->added[ai].id;
  return ktok_map_get(&tok->bpe->vocab, token, len);
}

bool kiln_tokenizer_is_special(const kiln_tokenizer_t *tok, int32_t id) {
  if (id < 0 || (size_t)id >= tok->vocab_size) return false;
  int32_t ai = tok->added_by_id[id];
  return ai >= 0 && tok->added[ai].special;
}

int32_t kiln_tokenizer_bos_id(const kiln_tokenizer_t *tok) { return tok->bos_id; }
int32_t kiln_tokenizer_eos_id(const kiln_tokenizer_t *tok) { return tok->eos_id; }
bool kiln_tokenizer_add_bos(const kiln_tokenizer_t *tok) { return tok->add_bos; }
bool kiln_tokenizer_add_eos(const kiln_tokenizer_t *tok) { return tok->add_eos; }
const char *kiln_tokenizer_bos_token(const kiln_tokenizer_t *tok) { return tok->bos_token; }
const char *kiln_tokenizer_eos_token(const kiln_tokenizer_t *tok) { return tok->eos_token; }
