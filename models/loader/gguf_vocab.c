/* gguf_vocab.c - the tokenizer a GGUF file carries (tokenizer.ggml.*), rewritten as the
 * tokenizer.json and tokenizer_config.json of the Hugging Face tokenizer it was converted from,
 * so that the one tokenizer implementation (models/tokenizer) runs both.
 *
 * What llama.cpp's converter keeps is enough to rebuild the Hugging Face pipeline for the two
 * vocabulary kinds most files use:
 *   - "gpt2" (byte-level BPE: Llama 3, Qwen2/3, Mistral Nemo, DeepSeek V3, GPT-4o-style): the
 *     tokens, the merges, and tokenizer.ggml.pre, the name of the pre-tokenizer, which selects
 *     the split regex and normalizer of that family (the table below holds the ones Kiln
 *     knows; any other name is refused: put the model's tokenizer.json beside the file);
 *   - "llama" (SentencePiece BPE: Llama 2, Mistral 7B, Gemma): the pieces and their scores, the
 *     merges rebuilt from the scores as Hugging Face's SentencePiece converter does (every
 *     split of a piece into two pieces is a merge; merges ranked by the merged piece's score,
 *     highest first, ties by piece id, a piece's own merges by the ids of its left then right
 *     part), byte fallback over the <0xXX> pieces, "▁" for spaces, a prefix "▁" when
 *     tokenizer.ggml.add_space_prefix (the default).
 * Token types: CONTROL and UNKNOWN tokens become special added tokens, USER_DEFINED ones
 * non-special added tokens (all matched before normalization, as the converter's do). What
 * the file cannot say is lost: a token Hugging Face marks non-special but the converter typed
 * CONTROL (it types every "<|...|>" token so) is skipped by skip_special_tokens.
 */
#include "models/loader/gguf.h"

#include "base/json.h"
#include "models/loader/gguf_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* llama.cpp's token types (tokenizer.ggml.token_type). */
enum {
  TT_NORMAL = 1,
  TT_UNKNOWN = 2,
  TT_CONTROL = 3,
  TT_USER_DEFINED = 4,
  TT_UNUSED = 5,
  TT_BYTE = 6
};

/* A byte-level BPE family by its tokenizer.ggml.pre name: the split regexes (applied in
 * order, each an Isolated split, or one Removed + inverted one), the normalizer, and whether
 * a word found whole in the vocabulary skips the merges (Hugging Face's ignore_merges). */
typedef struct pre_def {
  const char *names[3];
  const char *regex[3];
  bool invert; /* one regex whose matches are kept, the rest removed */
  bool nfc;
  bool ignore_merges;
} pre_def_t;

#define RE_CONTRACTIONS "(?i:'s|'t|'re|'ve|'m|'ll|'d)"
#define RE_TAIL " ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
static const pre_def_t pre_defs[] = {
    /* Llama 3 */
    {{"llama-bpe", "llama3", NULL},
     {RE_CONTRACTIONS "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}|" RE_TAIL, NULL, NULL},
     false,
     false,
     true},
    /* Qwen2, Qwen2.5, Qwen3 and the DeepSeek-R1 distills of Qwen */
    {{"qwen2", "deepseek-r1-qwen", NULL},
     {RE_CONTRACTIONS "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}|" RE_TAIL, NULL, NULL},
     false,
     true,
     false},
    /* Mistral Nemo, Pixtral (tekken) */
    {{"tekken", NULL, NULL},
     {"[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
      "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*"
      "|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
      NULL, NULL},
     false,
     false,
     true},
    /* DeepSeek V3 / R1 */
    {{"deepseek-v3", NULL, NULL},
     {"\\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
      "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}"
      "\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"},
     false,
     false,
     false},
    /* o200k (GPT-4o-style vocabularies) */
    {{"gpt-4o", NULL, NULL},
     {"[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
      "(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+"
      "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}"
      "\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
      NULL, NULL},
     true,
     false,
     false},
    /* GPT-2's own: the ByteLevel pre-tokenizer's built-in regex */
    {{"gpt-2", "default", NULL}, {NULL, NULL, NULL}, false, false, false},
};

/* ---- the vocabulary ------------------------------------------------------------------------ */

typedef struct vocab {
  const gguf_meta_t *m;
  const char *file;
  int64_t n;
  const char **s; /* token i: s[i], len[i] bytes (into the file) */
  uint32_t *len;
  uint32_t *type; /* TT_*; TT_NORMAL when the file has no token_type */
  float *score;   /* NULL when the file has no scores */
  int32_t *table; /* open addressing: id + 1, 0 empty; the first id of each string */
  uint64_t mask;
} vocab_t;

static uint64_t hash_bytes(const char *s, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
  return h;
}

static int32_t vocab_find(const vocab_t *v, const char *s, size_t n) {
  for (uint64_t i = hash_bytes(s, n) & v->mask;; i = (i + 1) & v->mask) {
    int32_t e = v->table[i];
    if (!e) return -1;
    if (v->len[e - 1] == n && memcmp(v->s[e - 1], s, n) == 0) return e - 1;
  }
}

/* The length of a valid UTF-8 sequence at s (1..4), or 0. */
static size_t utf8_char(const unsigned char *s, size_t n) {
  if (!n) return 0;
  unsigned c = s[0];
  size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
  if (!len || len > n) return 0;
  uint32_t cp = len == 1 ? c : len == 2 ? c & 0x1F : len == 3 ? c & 0x0F : c & 0x07;
  for (size_t i = 1; i < len; i++) {
    if ((s[i] & 0xC0) != 0x80) return 0;
    cp = cp << 6 | (s[i] & 0x3F);
  }
  static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < min_cp[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return len;
}

static bool utf8_valid(const char *s, size_t n) {
  for (size_t i = 0, k; i < n; i += k)
    if (!(k = utf8_char((const unsigned char *)s + i, n - i))) return false;
  return true;
}

static void vocab_free(vocab_t *v) {
  free(v->s);
  free(v->len);
  free(v->type);
  free(v->score);
  free(v->table);
  v->s = NULL;
  v->len = NULL;
  v->type = NULL;
  v->score = NULL;
  v->table = NULL;
}

static kiln_status_t oom(const char *file) {
  return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "%s: out of memory for the tokenizer", file);
}

/* Fills v (zeroed here); the caller frees it with vocab_free() whatever the outcome. */
static kiln_status_t vocab_load(const gguf_meta_t *m, vocab_t *v) {
  memset(v, 0, sizeof(*v));
  v->m = m;
  v->file = gguf_meta_file(m);
  gguf_meta_array_t toks, types, scores;
  kiln_status_t st;
  if ((st = gguf_meta_array(m, "tokenizer.ggml.tokens", true, GGUF_STRING, &toks)) ||
      (st = gguf_meta_array(m, "tokenizer.ggml.token_type", false, GGUF_I32, &types)) ||
      (st = gguf_meta_array(m, "tokenizer.ggml.scores", false, GGUF_F32, &scores)))
    return st;
  if (toks.count == 0 || toks.count > INT32_MAX / 4)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: tokenizer.ggml.tokens holds %llu tokens (1 to %d)", v->file,
                            (unsigned long long)toks.count, INT32_MAX / 4);
  if ((types.data && types.count != toks.count) || (scores.data && scores.count != toks.count))
    return kiln_status_make(
        KILN_ERR_INVALID_ARGUMENT, "%s: tokenizer.ggml.%s holds %llu entries for %llu tokens",
        v->file, types.data && types.count != toks.count ? "token_type" : "scores",
        (unsigned long long)(types.data && types.count != toks.count ? types.count : scores.count),
        (unsigned long long)toks.count);
  v->n = (int64_t)toks.count;
  uint64_t cap = 2;
  while (cap < 2 * (uint64_t)v->n) cap <<= 1;
  v->mask = cap - 1;
  v->s = malloc((size_t)v->n * sizeof(*v->s));
  v->len = malloc((size_t)v->n * sizeof(*v->len));
  v->type = malloc((size_t)v->n * sizeof(*v->type));
  v->table = calloc(cap, sizeof(*v->table));
  if (scores.data) v->score = malloc((size_t)v->n * sizeof(*v->score));
  if (!v->s || !v->len || !v->type || !v->table || (scores.data && !v->score)) {
    return oom(v->file);
  }
  const uint8_t *p = toks.data;
  for (int64_t i = 0; i < v->n; i++) {
    uint64_t len;
    const char *s = gguf_array_next_str(&p, &len);
    if (len == 0 || len > UINT32_MAX || !utf8_valid(s, len)) {
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: tokenizer.ggml.tokens[%lld] is %s",
                              v->file, (long long)i, len == 0 ? "empty" : "not valid UTF-8");
    }
    v->s[i] = s;
    v->len[i] = (uint32_t)len;
    v->type[i] = types.data ? gguf_array_u32(&types, (uint64_t)i) : TT_NORMAL;
    if (v->type[i] < TT_NORMAL || v->type[i] > TT_BYTE) {
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s: tokenizer.ggml.token_type[%lld] is %u (1 to 6)", v->file,
                              (long long)i, v->type[i]);
    }
    if (v->score) {
      uint32_t u = gguf_array_u32(&scores, (uint64_t)i);
      memcpy(&v->score[i], &u, 4);
      if (v->score[i] != v->score[i]) v->score[i] = -1e30f; /* NaN ranks last */
    }
    if (vocab_find(v, s, len) >= 0) continue; /* a duplicate string: the first id keeps it */
    uint64_t h = hash_bytes(s, len) & v->mask;
    while (v->table[h]) h = (h + 1) & v->mask;
    v->table[h] = (int32_t)(i + 1);
  }
  return NULL;
}

/* ---- writing ------------------------------------------------------------------------------- */

static void put(kiln_strbuf_t *o, const char *s) { kiln_strbuf_append(o, s, strlen(s)); }

static void put_str(kiln_strbuf_t *o, const char *s, size_t n) {
  kiln_json_write_string(o, s, n, false);
}

static void put_tok(kiln_strbuf_t *o, const vocab_t *v, int64_t id) {
  put_str(o, v->s[id], v->len[id]);
}

/* A token id from a metadata key: -1 when absent; an error when out of range. */
static kiln_status_t token_id(const vocab_t *v, const char *key, int64_t *out) {
  kiln_status_t st = gguf_meta_int(v->m, key, false, -1, out);
  if (st) return st;
  if (*out < -1 || *out >= v->n)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "%s: %s is %lld, outside the vocabulary of %lld tokens", v->file, key,
                            (long long)*out, (long long)v->n);
  return NULL;
}

static void put_added(kiln_strbuf_t *o, const vocab_t *v) {
  put(o, "\"added_tokens\": [");
  bool first = true;
  for (int64_t i = 0; i < v->n; i++) {
    uint32_t t = v->type[i];
    if (t != TT_CONTROL && t != TT_UNKNOWN && t != TT_USER_DEFINED) continue;
    if (vocab_find(v, v->s[i], v->len[i]) != i) continue; /* a duplicate string */
    char head[48];
    snprintf(head, sizeof(head), "%s{\"id\": %lld, \"content\": ", first ? "" : ", ", (long long)i);
    put(o, head);
    put_tok(o, v, i);
    put(o,
        ", \"single_word\": false, \"lstrip\": false, \"rstrip\": false, \"normalized\": false, "
        "\"special\": ");
    put(o, t == TT_USER_DEFINED ? "false}" : "true}");
    first = false;
  }
  put(o, "], ");
}

static void put_vocab(kiln_strbuf_t *o, const vocab_t *v) {
  put(o, "\"vocab\": {");
  bool first = true;
  for (int64_t i = 0; i < v->n; i++) {
    if (vocab_find(v, v->s[i], v->len[i]) != i) continue;
    if (!first) put(o, ", ");
    put_tok(o, v, i);
    char num[24];
    snprintf(num, sizeof(num), ": %lld", (long long)i);
    put(o, num);
    first = false;
  }
  put(o, "}");
}

/* One {"SpecialToken": ...} piece of a TemplateProcessing template. */
static void put_special_piece(kiln_strbuf_t *o, const vocab_t *v, int64_t id, const char *tid) {
  put(o, "{\"SpecialToken\": {\"id\": ");
  put_tok(o, v, id);
  put(o, ", \"type_id\": ");
  put(o, tid);
  put(o, "}}");
}

/* TemplateProcessing with bos and/or eos around each sequence; "null" when neither. */
static void put_post(kiln_strbuf_t *o, const vocab_t *v, int64_t bos, int64_t eos) {
  put(o, "\"post_processor\": ");
  if (bos < 0 && eos < 0) {
    put(o, "null, ");
    return;
  }
  put(o, "{\"type\": \"TemplateProcessing\", \"single\": [");
  for (int pair = 0; pair < 2; pair++) {
    for (int seq = 0; seq <= pair; seq++) {
      char tid[16];
      snprintf(tid, sizeof(tid), "%d", seq);
      if (seq) put(o, ", ");
      if (bos >= 0) {
        put_special_piece(o, v, bos, tid);
        put(o, ", ");
      }
      put(o, seq ? "{\"Sequence\": {\"id\": \"B\", \"type_id\": 1}}"
                 : "{\"Sequence\": {\"id\": \"A\", \"type_id\": 0}}");
      if (eos >= 0) {
        put(o, ", ");
        put_special_piece(o, v, eos, tid);
      }
    }
    put(o, pair ? "], " : "], \"pair\": [");
  }
  put(o, "\"special_tokens\": {");
  for (int k = 0; k < 2; k++) {
    int64_t id = k ? eos : bos;
    if (id < 0 || (k && id == bos)) continue;
    if (k && bos >= 0) put(o, ", ");
    put_tok(o, v, id);
    put(o, ": {\"id\": ");
    put_tok(o, v, id);
    char ids[64];
    snprintf(ids, sizeof(ids), ", \"ids\": [%lld], \"tokens\": [", (long long)id);
    put(o, ids);
    put_tok(o, v, id);
    put(o, "]}");
  }
  put(o, "}}, ");
}

/* The merges of a "gpt2" file (or a "llama" file that has them): "left right" strings, split at
 * the first space after the first byte (a token never holds a space in byte-level BPE). */
static kiln_status_t put_file_merges(kiln_strbuf_t *o, const vocab_t *v,
                                     const gguf_meta_array_t *mg) {
  put(o, "\"merges\": [");
  const uint8_t *p = mg->data;
  for (uint64_t i = 0; i < mg->count; i++) {
    uint64_t len;
    const char *s = gguf_array_next_str(&p, &len);
    const char *sp = len > 1 ? memchr(s + 1, ' ', len - 1) : NULL;
    if (!sp || !utf8_valid(s, len))
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "%s: tokenizer.ggml.merges[%llu] is not \"left right\" in UTF-8",
                              v->file, (unsigned long long)i);
    if (i) put(o, ", ");
    put(o, "[");
    put_str(o, s, (size_t)(sp - s));
    put(o, ", ");
    put_str(o, sp + 1, (size_t)(len - (uint64_t)(sp + 1 - s)));
    put(o, "]");
  }
  put(o, "]");
  return NULL;
}

typedef struct merge {
  int32_t piece, left, right;
} merge_t;

static const float *g_score; /* qsort has no context argument */

static int by_score_then_id(const void *a, const void *b) {
  int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
  float sx = g_score[x], sy = g_score[y];
  if (sx != sy) return sx > sy ? -1 : 1;
  return (x > y) - (x < y);
}

static int by_parts(const void *a, const void *b) {
  const merge_t *x = a, *y = b;
  if (x->left != y->left) return (x->left > y->left) - (x->left < y->left);
  return (x->right > y->right) - (x->right < y->right);
}

/* The merges of a SentencePiece vocabulary, rebuilt from the scores (see the top of the file). */
static kiln_status_t put_spm_merges(kiln_strbuf_t *o, const vocab_t *v) {
  if (!v->score)
    return kiln_status_make(
        KILN_ERR_INVALID_ARGUMENT,
        "%s: a \"llama\" (SentencePiece) vocabulary needs tokenizer.ggml.scores "
        "or tokenizer.ggml.merges; the file has neither",
        v->file);
  int32_t *order = malloc((size_t)v->n * sizeof(*order));
  size_t cap = 1024, n = 0;
  merge_t *all = malloc(cap * sizeof(*all)), local[256];
  if (!order || !all) {
    free(order);
    free(all);
    return oom(v->file);
  }
  for (int64_t i = 0; i < v->n; i++) order[i] = (int32_t)i;
  g_score = v->score;
  qsort(order, (size_t)v->n, sizeof(*order), by_score_then_id);
  for (int64_t k = 0; k < v->n; k++) {
    int32_t id = order[k];
    if (vocab_find(v, v->s[id], v->len[id]) != id) continue;
    const char *s = v->s[id];
    size_t len = v->len[id], nl = 0;
    for (size_t cut = utf8_char((const unsigned char *)s, len); cut < len && nl < 256;
         cut += utf8_char((const unsigned char *)s + cut, len - cut)) {
      int32_t l = vocab_find(v, s, cut), r = vocab_find(v, s + cut, len - cut);
      if (l >= 0 && r >= 0) local[nl++] = (merge_t){id, l, r};
    }
    qsort(local, nl, sizeof(*local), by_parts);
    if (n + nl > cap) {
      cap = 2 * (n + nl);
      merge_t *grown = realloc(all, cap * sizeof(*all));
      if (!grown) {
        free(order);
        free(all);
        return oom(v->file);
      }
      all = grown;
    }
    memcpy(all + n, local, nl * sizeof(*local));
    n += nl;
  }
  put(o, "\"merges\": [");
  for (size_t i = 0; i < n; i++) {
    put(o, i ? ", [" : "[");
    put_tok(o, v, all[i].left);
    put(o, ", ");
    put_tok(o, v, all[i].right);
    put(o, "]");
  }
  put(o, "]");
  free(order);
  free(all);
  return NULL;
}

static const pre_def_t *find_pre(const char *s, uint64_t len) {
  for (size_t i = 0; i < sizeof(pre_defs) / sizeof(pre_defs[0]); i++)
    for (int k = 0; k < 3 && pre_defs[i].names[k]; k++)
      if (strlen(pre_defs[i].names[k]) == len && memcmp(pre_defs[i].names[k], s, len) == 0)
        return &pre_defs[i];
  return NULL;
}

static void put_pre(kiln_strbuf_t *o, const pre_def_t *d) {
  put(o, "\"pre_tokenizer\": ");
  if (!d->regex[0]) {
    put(o,
        "{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, "
        "\"use_regex\": true}, ");
    return;
  }
  put(o, "{\"type\": \"Sequence\", \"pretokenizers\": [");
  for (int i = 0; i < 3 && d->regex[i]; i++) {
    put(o, "{\"type\": \"Split\", \"pattern\": {\"Regex\": ");
    put_str(o, d->regex[i], strlen(d->regex[i]));
    put(o, d->invert ? "}, \"behavior\": \"Removed\", \"invert\": true}, "
                     : "}, \"behavior\": \"Isolated\", \"invert\": false}, ");
  }
  put(o,
      "{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, "
      "\"use_regex\": false}]}, ");
}

/* tokenizer_config.json: the special token strings, add_bos/add_eos and the chat templates
 * (tokenizer.chat_template, and tokenizer.chat_template.<name> as named ones). */
static kiln_status_t put_config(kiln_strbuf_t *o, const vocab_t *v, int64_t bos, int64_t eos,
                                int64_t unk, int64_t pad, bool add_bos, bool add_eos) {
  put(o, "{");
  static const char *const names[4] = {"bos_token", "eos_token", "unk_token", "pad_token"};
  int64_t ids[4] = {bos, eos, unk, pad};
  for (int k = 0; k < 4; k++) {
    if (ids[k] < 0) continue;
    put(o, "\"");
    put(o, names[k]);
    put(o, "\": ");
    put_tok(o, v, ids[k]);
    put(o, ", ");
  }
  put(o, add_bos ? "\"add_bos_token\": true, " : "\"add_bos_token\": false, ");
  put(o, add_eos ? "\"add_eos_token\": true" : "\"add_eos_token\": false");
  const char *s;
  uint64_t len;
  kiln_status_t st = gguf_meta_str(v->m, "tokenizer.chat_template", false, &s, &len);
  if (st) return st;
  static const char prefix[] = "tokenizer.chat_template.";
  size_t np = sizeof(prefix) - 1;
  bool any = s != NULL;
  for (uint64_t i = 0; i < gguf_meta_count(v->m) && !any; i++) {
    uint64_t kl;
    const char *k = gguf_meta_key(v->m, i, &kl);
    any = kl > np && memcmp(k, prefix, np) == 0;
  }
  if (any) {
    put(o, ", \"chat_template\": [");
    bool first = true;
    if (s) {
      if (!utf8_valid(s, len))
        return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                                "%s: tokenizer.chat_template is not valid UTF-8", v->file);
      put(o, "{\"name\": \"default\", \"template\": ");
      put_str(o, s, len);
      put(o, "}");
      first = false;
    }
    for (uint64_t i = 0; i < gguf_meta_count(v->m); i++) {
      uint64_t kl;
      const char *k = gguf_meta_key(v->m, i, &kl);
      if (kl <= np || memcmp(k, prefix, np) != 0) continue;
      char key[256];
      snprintf(key, sizeof(key), "%.*s", kl > 255 ? 255 : (int)kl, k);
      if ((st = gguf_meta_str(v->m, key, true, &s, &len))) return st;
      if (!utf8_valid(s, len) || !utf8_valid(k + np, kl - np))
        return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "%s: %s is not valid UTF-8", v->file,
                                key);
      put(o, first ? "{\"name\": " : ", {\"name\": ");
      put_str(o, k + np, kl - np);
      put(o, ", \"template\": ");
      put_str(o, s, len);
      put(o, "}");
      first = false;
    }
    put(o, "]");
  }
  put(o, "}");
  return NULL;
}

static bool key_is(const char *s, uint64_t len, const char *want) {
  return strlen(want) == len && memcmp(s, want, len) == 0;
}

kiln_status_t kiln_gguf_tokenizer(const char *path, kiln_strbuf_t *tokenizer_json,
                                  kiln_strbuf_t *config_json) {
  gguf_meta_t *m = NULL;
  kiln_status_t st = gguf_meta_open(path, &m);
  if (st) return st;
  const char *file = gguf_meta_file(m);
  const char *model, *pre;
  uint64_t model_len, pre_len;
  vocab_t v = {0};
  kiln_strbuf_t *o = tokenizer_json;
  if ((st = gguf_meta_str(m, "tokenizer.ggml.model", false, &model, &model_len))) goto done;
  if (!model || key_is(model, model_len, "none") || key_is(model, model_len, "no_vocab")) {
    st = kiln_status_make(KILN_ERR_NOT_FOUND,
                          "%s holds no tokenizer (no tokenizer.ggml.model): put the model's "
                          "tokenizer.json beside it",
                          file);
    goto done;
  }
  bool spm = key_is(model, model_len, "llama");
  if (!spm && !key_is(model, model_len, "gpt2")) {
    st = kiln_status_make(KILN_ERR_UNSUPPORTED,
                          "%s: tokenizer.ggml.model \"%.*s\" is not supported (gpt2 and llama "
                          "are): put the model's tokenizer.json beside the file",
                          file, model_len > 64 ? 64 : (int)model_len, model);
    goto done;
  }
  if ((st = gguf_meta_str(m, "tokenizer.ggml.pre", false, &pre, &pre_len))) goto done;
  const pre_def_t *pd = NULL;
  if (!spm) {
    pd = pre ? find_pre(pre, pre_len) : find_pre("default", 7);
    if (!pd) {
      st = kiln_status_make(KILN_ERR_UNSUPPORTED,
                            "%s: tokenizer.ggml.pre \"%.*s\" is not a pre-tokenizer Kiln knows "
                            "(llama-bpe, qwen2, deepseek-r1-qwen, tekken, deepseek-v3, gpt-4o, "
                            "gpt-2, default): put the model's tokenizer.json beside the file",
                            file, pre_len > 64 ? 64 : (int)pre_len, pre);
      goto done;
    }
  }
  bool space_prefix, remove_ws, add_bos, add_eos;
  if ((st = gguf_meta_bool(m, "tokenizer.ggml.add_space_prefix", spm, &space_prefix)) ||
      (st = gguf_meta_bool(m, "tokenizer.ggml.remove_extra_whitespaces", false, &remove_ws)) ||
      (st = gguf_meta_bool(m, "tokenizer.ggml.add_bos_token", spm, &add_bos)) ||
      (st = gguf_meta_bool(m, "tokenizer.ggml.add_eos_token", false, &add_eos)))
    goto done;
  if (remove_ws || (!spm && space_prefix)) {
    st = kiln_status_make(KILN_ERR_UNSUPPORTED,
                          "%s: tokenizer.ggml.%s is true, which Kiln does not support for a "
                          "\"%.*s\" vocabulary: put the model's tokenizer.json beside the file",
                          file, remove_ws ? "remove_extra_whitespaces" : "add_space_prefix",
                          (int)model_len, model);
    goto done;
  }
  if ((st = vocab_load(m, &v))) goto done;
  int64_t bos, eos, unk, pad;
  if ((st = token_id(&v, "tokenizer.ggml.bos_token_id", &bos)) ||
      (st = token_id(&v, "tokenizer.ggml.eos_token_id", &eos)) ||
      (st = token_id(&v, "tokenizer.ggml.unknown_token_id", &unk)) ||
      (st = token_id(&v, "tokenizer.ggml.padding_token_id", &pad)))
    goto done;
  if (unk < 0)
    for (int64_t i = 0; i < v.n && unk < 0; i++)
      if (v.type[i] == TT_UNKNOWN) unk = i;
  if ((add_bos && bos < 0) || (add_eos && eos < 0)) {
    st = kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                          "%s: tokenizer.ggml.add_%s_token is true but there is no "
                          "tokenizer.ggml.%s_token_id",
                          file, add_bos && bos < 0 ? "bos" : "eos",
                          add_bos && bos < 0 ? "bos" : "eos");
    goto done;
  }
  gguf_meta_array_t merges;
  if ((st = gguf_meta_array(m, "tokenizer.ggml.merges", !spm, GGUF_STRING, &merges))) goto done;

  put(o, "{\"version\": \"1.0\", \"truncation\": null, \"padding\": null, ");
  put_added(o, &v);
  if (spm) {
    put(o, "\"normalizer\": ");
    put(o, space_prefix ? "{\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"Prepend\", "
                          "\"prepend\": \"\u2581\"}, {\"type\": \"Replace\", \"pattern\": "
                          "{\"String\": \" \"}, \"content\": \"\u2581\"}]}, "
                        : "{\"type\": \"Replace\", \"pattern\": {\"String\": \" \"}, \"content\": "
                          "\"\u2581\"}, ");
    put(o, "\"pre_tokenizer\": null, ");
  } else {
    put(o, pd->nfc ? "\"normalizer\": {\"type\": \"NFC\"}, " : "\"normalizer\": null, ");
    put_pre(o, pd);
  }
  put_post(o, &v, add_bos ? bos : -1, add_eos ? eos : -1);
  if (spm) {
    put(o,
        "\"decoder\": {\"type\": \"Sequence\", \"decoders\": [{\"type\": \"Replace\", "
        "\"pattern\": {\"String\": \"\u2581\"}, \"content\": \" \"}, {\"type\": "
        "\"ByteFallback\"}, {\"type\": \"Fuse\"}");
    put(o, space_prefix ? ", {\"type\": \"Strip\", \"content\": \" \", \"start\": 1, \"stop\": "
                          "0}]}, "
                        : "]}, ");
  } else {
    put(o,
        "\"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": true, \"trim_offsets\": "
        "true, \"use_regex\": true}, ");
  }
  put(o, "\"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": ");
  if (spm && unk >= 0) {
    put_tok(o, &v, unk);
  } else {
    put(o, "null");
  }
  put(o, ", \"continuing_subword_prefix\": null, \"end_of_word_suffix\": null, ");
  put(o, spm ? "\"fuse_unk\": true, \"byte_fallback\": true, "
             : "\"fuse_unk\": false, \"byte_fallback\": false, ");
  put(o, pd && pd->ignore_merges ? "\"ignore_merges\": true, " : "\"ignore_merges\": false, ");
  put_vocab(o, &v);
  put(o, ", ");
  st = merges.data ? put_file_merges(o, &v, &merges) : put_spm_merges(o, &v);
  if (st) goto done;
  put(o, "}}");
  if ((st = put_config(config_json, &v, bos, eos, unk, pad, add_bos, add_eos))) goto done;
  if (!kiln_strbuf_ok(tokenizer_json) || !kiln_strbuf_ok(config_json)) st = oom(file);
done:
  vocab_free(&v);
  gguf_meta_free(m);
  return st;
}
