/* tok_internal.h - the tokenizer's private structures, shared by the files of
 * models/tokenizer/ (ktok_util.c, bpe.c, normalize.c, pretok.c, added.c, decode.c, detok.c,
 * tokenizer.c).
 *
 * The encode pipeline mirrors Hugging Face tokenizers:
 *   1. added tokens whose "normalized" flag is false are split out of the raw text
 *      (leftmost-longest, lstrip/rstrip/single_word honoured);                  added.c
 *   2. every other segment is normalized (NFC/NFKC/NFD/NFKD, Lowercase, Replace, Prepend,
 *      Strip, StripAccents, Sequence), then normalized added tokens are split out; normalize.c
 *   3. the pieces are pre-tokenized (ByteLevel, Split, Metaspace, Digits, Punctuation,
 *      Whitespace, WhitespaceSplit, Sequence);                                     pretok.c
 *   4. each pre-token goes through the BPE model (merge ranks, byte fallback, unk, a word
 *      cache);                                                                        bpe.c
 *   5. the post-processor adds special tokens (TemplateProcessing, Bert, Roberta,
 *      ByteLevel, Sequence).                                                    tokenizer.c
 * Decoding runs the decoder chain (ByteLevel, Metaspace, ByteFallback, Fuse, Strip,
 * Replace, Sequence) over the token strings;                                       decode.c
 * the streaming detokenizer wraps it.                                               detok.c
 */
#ifndef KILN_MODELS_TOKENIZER_TOK_INTERNAL_H
#define KILN_MODELS_TOKENIZER_TOK_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/arena.h"
#include "base/json.h"
#include "base/status.h"
#include "base/strbuf.h"
#include "models/tokenizer/tokenizer.h"

/* ---- utilities (ktok_util.c) ------------------------------------------------------------ */

uint64_t ktok_hash(const void *data, size_t n);

/* An open-addressing map from byte strings (borrowed, must outlive the map) to int32. */
typedef struct ktok_map {
  uint32_t *slots; /* entry index + 1; 0 = empty */
  size_t mask;     /* slot count - 1 */
  const char **keys;
  uint32_t *key_lens;
  int32_t *vals;
  size_t n, cap;
} ktok_map_t;
bool ktok_map_init(ktok_map_t *m, size_t expected);
/* Inserts or overwrites; *out_old receives the previous value or -1. false on OOM. */
bool ktok_map_put(ktok_map_t *m, const char *key, size_t len, int32_t val, int32_t *out_old);
/* -1 when absent. */
int32_t ktok_map_get(const ktok_map_t *m, const char *key, size_t len);
void ktok_map_free(ktok_map_t *m);

/* UTF-8: length of the valid prefix of s (== n when all valid). */
size_t ktok_utf8_valid_prefix(const char *s, size_t n);
/* Decodes one code point of valid UTF-8 at s; returns its byte length. */
int ktok_utf8_decode(const char *s, uint32_t *out_cp);
/* Encodes cp into buf (4 bytes); returns the length. */
int ktok_utf8_encode(uint32_t cp, char *buf);
/* Byte length of the UTF-8 sequence whose lead byte is c (1 for continuation bytes). */
int ktok_utf8_len(unsigned char c);
/* Rust char::is_whitespace (Unicode White_Space). */
bool ktok_is_whitespace(uint32_t cp);
/* Rust regex \w: alphabetic, marks, decimal digits, connector punctuation, join controls. */
bool ktok_is_word_char(uint32_t cp);
/* Rust char::is_numeric (general categories Nd, Nl, No). */
bool ktok_is_numeric(uint32_t cp);
/* HF is_punc: ASCII punctuation or a Unicode P* category. */
bool ktok_is_punctuation(uint32_t cp);

/* A compiled PCRE2 pattern (UTF + UCP, JIT when available). */
typedef struct ktok_regex {
  pcre2_code *code;
  bool jit;
} ktok_regex_t;
/* Scratch for matching, one per encode call (PCRE2 match data is not shareable). */
typedef struct ktok_match_ctx {
  pcre2_match_data *md;
  pcre2_match_context *mctx; /* with a large JIT stack, made only when a match needs it */
  pcre2_jit_stack *jit_stack;
  /* Scratch reused by the pre-tokenizers between calls. */
  void *spans;
  size_t spans_cap;
  kiln_strbuf_t tmp, tmp2;
} ktok_match_ctx_t;

kiln_status_t ktok_regex_compile(const char *pattern, size_t len, ktok_regex_t **out);
void ktok_regex_free(ktok_regex_t *re);
/* Finds the first match in s[start..n) (s is valid UTF-8, checked by the caller). Returns 1
 * with *ms and *me set, 0 when none, -1 on a matching error (message in *err). */
int ktok_regex_find(const ktok_regex_t *re, ktok_match_ctx_t *mc, const char *s, size_t n,
                    size_t start, size_t *ms, size_t *me, kiln_status_t *err);
bool ktok_match_ctx_init(ktok_match_ctx_t *mc);
void ktok_match_ctx_free(ktok_match_ctx_t *mc);

/* A Split/Replace pattern: a literal string or a regex. */
typedef struct ktok_pattern {
  char *str; /* literal (arena-owned), when re == NULL */
  size_t len;
  ktok_regex_t *re;
} ktok_pattern_t;
/* Parses {"String": s} or {"Regex": r} found at path. */
kiln_status_t ktok_pattern_parse(kiln_arena_t *a, const kiln_json_t *v, const char *path,
                                 ktok_pattern_t *out);
/* Next match of p in s[start..n) as ktok_regex_find (literal: memmem; empty literal: none). */
int ktok_pattern_find(const ktok_pattern_t *p, ktok_match_ctx_t *mc, const char *s, size_t n,
                      size_t start, size_t *ms, size_t *me, kiln_status_t *err);
/* Appends s with every match of p replaced by content (non-overlapping, left to right). */
kiln_status_t ktok_pattern_replace(const ktok_pattern_t *p, ktok_match_ctx_t *mc, const char *s,
                                   size_t n, const char *content, size_t clen, kiln_strbuf_t *out);

/* JSON helpers for the loader: messages name the file and component path. */
kiln_status_t ktok_err(kiln_status_code_t code, const char *path, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Reads an optional bool member (default when absent/null). */
kiln_status_t ktok_json_bool(const kiln_json_t *obj, const char *key, bool def, const char *path,
                             bool *out);
/* Reads an optional string member (NULL when absent/null), copied to the arena. */
kiln_status_t ktok_json_str(kiln_arena_t *a, const kiln_json_t *obj, const char *key,
                            const char *path, char **out, size_t *out_len);
/* Reads a single-character string member (e.g. Metaspace's replacement). */
kiln_status_t ktok_json_char(const kiln_json_t *obj, const char *key, uint32_t def,
                             const char *path, uint32_t *out);
/* Refuses members other than those listed (NULL-terminated): a field we do not know could
 * change behaviour silently. */
kiln_status_t ktok_json_only(const kiln_json_t *obj, const char *path, const char *const *keys);

/* ---- pieces: the strings flowing through pre-tokenization ------------------------------- */

typedef struct ktok_piece {
  size_t off, len; /* into the owning ktok_pieces_t's text */
  bool at_start;   /* begins at original offset 0 (Metaspace prepend_scheme "first") */
} ktok_piece_t;

typedef struct ktok_pieces {
  kiln_strbuf_t text;
  ktok_piece_t *v;
  size_t n, cap;
} ktok_pieces_t;

/* Appends s[0..n) as a new piece (skipped when empty, as HF drops empty splits). */
bool ktok_pieces_add(ktok_pieces_t *p, const char *s, size_t n, bool at_start);
void ktok_pieces_reset(ktok_pieces_t *p);
void ktok_pieces_free(ktok_pieces_t *p);

/* ---- normalizers (normalize.c) --------------------------------------------------------- */

typedef enum ktok_norm_type {
  TOK_NORM_NFC,
  TOK_NORM_NFD,
  TOK_NORM_NFKC,
  TOK_NORM_NFKD,
  TOK_NORM_LOWERCASE,
  TOK_NORM_REPLACE,
  TOK_NORM_PREPEND,
  TOK_NORM_STRIP,
  TOK_NORM_STRIP_ACCENTS,
  TOK_NORM_SEQUENCE,
} ktok_norm_type_t;

typedef struct ktok_normalizer {
  ktok_norm_type_t type;
  ktok_pattern_t pattern; /* Replace */
  char *content;          /* Replace content / Prepend string */
  size_t content_len;
  bool left, right;                  /* Strip */
  struct ktok_normalizer **children; /* Sequence */
  size_t n_children;
} ktok_normalizer_t;

kiln_status_t ktok_normalizer_parse(kiln_arena_t *a, const kiln_json_t *v, const char *path,
                                    ktok_normalizer_t **out);
void ktok_normalizer_free(ktok_normalizer_t *n);
/* Appends the normalized form of s[0..n) to out. */
kiln_status_t ktok_normalize(const ktok_normalizer_t *nz, ktok_match_ctx_t *mc, const char *s,
                             size_t n, kiln_strbuf_t *out);

/* ---- pre-tokenizers (pretok.c) --------------------------------------------------------- */

typedef enum ktok_split_behavior {
  TOK_SPLIT_REMOVED,
  TOK_SPLIT_ISOLATED,
  TOK_SPLIT_MERGED_WITH_PREVIOUS,
  TOK_SPLIT_MERGED_WITH_NEXT,
  TOK_SPLIT_CONTIGUOUS,
} ktok_split_behavior_t;

typedef enum ktok_pretok_type {
  TOK_PRE_BYTELEVEL,
  TOK_PRE_SPLIT,
  TOK_PRE_METASPACE,
  TOK_PRE_DIGITS,
  TOK_PRE_PUNCTUATION,
  TOK_PRE_WHITESPACE,
  TOK_PRE_WHITESPACE_SPLIT,
  TOK_PRE_SEQUENCE,
} ktok_pretok_type_t;

typedef enum ktok_prepend_scheme {
  TOK_PREPEND_ALWAYS,
  TOK_PREPEND_FIRST,
  TOK_PREPEND_NEVER,
} ktok_prepend_scheme_t;

typedef struct ktok_pretok {
  ktok_pretok_type_t type;
  ktok_pattern_t pattern;           /* Split; Whitespace's and ByteLevel's built-in regex */
  ktok_split_behavior_t behavior;   /* Split, Punctuation */
  bool invert;                      /* Split */
  bool add_prefix_space, use_regex; /* ByteLevel */
  char rep[4];                      /* Metaspace replacement, UTF-8 */
  int rep_len;
  ktok_prepend_scheme_t prepend_scheme;
  bool split;                    /* Metaspace */
  bool individual_digits;        /* Digits */
  struct ktok_pretok **children; /* Sequence */
  size_t n_children;
} ktok_pretok_t;

kiln_status_t ktok_pretok_parse(kiln_arena_t *a, const kiln_json_t *v, const char *path,
                                ktok_pretok_t **out);
void ktok_pretok_free(ktok_pretok_t *p);
/* Pre-tokenizes every piece of in into out (out is reset first); tmp is scratch. */
kiln_status_t ktok_pretokenize(const ktok_pretok_t *pt, ktok_match_ctx_t *mc, ktok_pieces_t *in,
                               ktok_pieces_t *out, ktok_pieces_t *tmp);

/* The GPT-2 byte <-> unicode table (ByteLevel): the code point standing for byte b. */
uint32_t ktok_byte_to_cp(unsigned char b);
/* Inverse: code point -> byte, -1 when cp is not one of the 256. */
int ktok_cp_to_byte(uint32_t cp);

/* ---- the BPE model (bpe.c) ------------------------------------------------------------- */

typedef struct ktok_merge_entry {
  uint64_t key; /* (left id << 32) | right id; 0 slots marked by rank < 0 */
  int32_t rank;
  int32_t new_id;
} ktok_merge_entry_t;

#define TOK_CACHE_SLOTS 16384
#define TOK_CACHE_MAX_WORD 64 /* bytes; longer words are not cached */

typedef struct ktok_cache_entry {
  char *word; /* malloc'ed, NULL = empty */
  uint32_t word_len;
  uint32_t n_ids;
  int32_t *ids; /* malloc'ed */
} ktok_cache_entry_t;

typedef struct ktok_bpe {
  ktok_map_t vocab;       /* token string -> id */
  const char **id_to_str; /* [n_ids_r] borrowed arena strings, NULL = hole */
  uint32_t *id_to_len;
  size_t n_ids_r;
  ktok_merge_entry_t *merges; /* open addressing, [merge_mask + 1] */
  size_t merge_mask;
  int32_t char_ids[0x10000]; /* single-code-point tokens below U+10000, -1 = none */
  int32_t byte_ids[256];     /* <0xNN> tokens when byte_fallback, -1 = none */
  int32_t unk_id;            /* -1 when no unk_token */
  bool fuse_unk, byte_fallback, ignore_merges;
  pthread_mutex_t cache_lock;
  ktok_cache_entry_t *cache; /* [TOK_CACHE_SLOTS] */
} ktok_bpe_t;

kiln_status_t ktok_bpe_parse(kiln_arena_t *a, const kiln_json_t *v, const char *path,
                             ktok_bpe_t **out);
void ktok_bpe_free(ktok_bpe_t *b);

/* Per-call scratch for BPE. */
typedef struct ktok_bpe_work {
  struct ktok_symbol *sym;
  size_t sym_cap;
  struct ktok_heap_item *heap;
  size_t heap_cap;
  int32_t *ids;
  size_t ids_cap;
} ktok_bpe_work_t;
void ktok_bpe_work_free(ktok_bpe_work_t *w);
/* Tokenizes one pre-token and appends its ids. */
kiln_status_t ktok_bpe_tokenize(ktok_bpe_t *b, ktok_bpe_work_t *w, const char *s, size_t n,
                                kiln_tokens_t *out);

/* ---- added tokens (added.c) ------------------------------------------------------------ */

typedef struct ktok_added {
  int32_t id;
  char *content;
  size_t len;
  bool single_word, lstrip, rstrip, normalized, special;
} ktok_added_t;

/* A byte trie over the tokens of one matching set (leftmost-longest matching). */
typedef struct ktok_trie_node {
  int32_t first_child, next_sibling;
  int32_t token; /* index into ktok_added_t array, -1 = none */
  unsigned char byte;
} ktok_trie_node_t;

typedef struct ktok_trie {
  ktok_trie_node_t *nodes;
  size_t n, cap;
  int32_t root_child[256]; /* first-level nodes by byte, -1 = none */
} ktok_trie_t;

/* Builds a trie over the added tokens with normalized == want_normalized. For normalized
 * ones the pattern is the token content passed through nz (may be NULL). */
kiln_status_t ktok_trie_build(ktok_trie_t *t, const ktok_added_t *added, size_t n,
                              bool want_normalized, const ktok_normalizer_t *nz,
                              ktok_match_ctx_t *mc, kiln_arena_t *a);
void ktok_trie_free(ktok_trie_t *t);

/* One split of a string by an added-token trie: [start, stop) is either an added token
 * (token >= 0, index into the added array) or plain text (token == -1). */
typedef struct ktok_split {
  size_t start, stop;
  int32_t token;
} ktok_split_t;

/* Splits s[0..n) as HF AddedVocabulary::find_matches does; *out is malloc'ed. */
kiln_status_t ktok_added_split(const ktok_trie_t *t, const ktok_added_t *added, const char *s,
                               size_t n, ktok_split_t **out, size_t *out_n);

/* ---- decoders (decode.c) --------------------------------------------------------------- */

typedef enum ktok_dec_type {
  TOK_DEC_BYTELEVEL,
  TOK_DEC_METASPACE,
  TOK_DEC_BYTEFALLBACK,
  TOK_DEC_FUSE,
  TOK_DEC_STRIP,
  TOK_DEC_REPLACE,
  TOK_DEC_SEQUENCE,
} ktok_dec_type_t;

typedef struct ktok_decoder {
  ktok_dec_type_t type;
  uint32_t rep_cp; /* Metaspace replacement */
  ktok_prepend_scheme_t prepend_scheme;
  uint32_t strip_cp; /* Strip content */
  size_t strip_start, strip_stop;
  ktok_pattern_t pattern; /* Replace */
  char *content;
  size_t content_len;
  struct ktok_decoder **children; /* Sequence */
  size_t n_children;
} ktok_decoder_t;

kiln_status_t ktok_decoder_parse(kiln_arena_t *a, const kiln_json_t *v, const char *path,
                                 ktok_decoder_t **out);
void ktok_decoder_free(ktok_decoder_t *d);
/* True when the chain contains a ByteFallback decoder (the detokenizer holds byte runs). */
bool ktok_decoder_has_byte_fallback(const ktok_decoder_t *d);

/* ---- post-processors (tokenizer.c) ----------------------------------------------------- */

typedef struct ktok_tpl_item {
  bool is_sequence;
  int32_t *ids; /* special token ids (malloc'ed, owned) */
  size_t n_ids;
} ktok_tpl_item_t;

typedef struct ktok_post {
  bool is_sequence;
  ktok_tpl_item_t *items; /* single template; NULL for no-op processors */
  size_t n_items;
  struct ktok_post **children;
  size_t n_children;
} ktok_post_t;

/* ---- the tokenizer --------------------------------------------------------------------- */

struct ktok_enc_ctx; /* tokenizer.c: per-call encode scratch */
#define KTOK_CTX_POOL 8

struct kiln_tokenizer {
  kiln_arena_t arena;
  /* Encode scratch kept between calls (PCRE2 match data, buffers): a small pool so that
   * concurrent callers each get their own. */
  pthread_mutex_t pool_lock;
  struct ktok_enc_ctx *pool[KTOK_CTX_POOL];
  int n_pool;
  ktok_bpe_t *bpe;
  ktok_normalizer_t *normalizer; /* NULL = none */
  ktok_pretok_t *pretok;         /* NULL = none */
  ktok_decoder_t *decoder;       /* NULL = join with " " */
  ktok_post_t *post;             /* NULL = none */
  ktok_added_t *added;           /* [n_added] */
  size_t n_added;
  ktok_map_t added_map; /* content -> index into added */
  int32_t *added_by_id; /* [vocab_size] index into added, -1 = none */
  ktok_trie_t trie_raw, trie_norm;
  size_t vocab_size;
  int32_t bos_id, eos_id;
  char *bos_token, *eos_token;
  bool add_bos, add_eos;
};

/* The token string of id, or NULL (no bounds assumptions on id). */
const char *ktok_id_to_token(const kiln_tokenizer_t *tok, int32_t id, size_t *out_len);

#endif /* KILN_MODELS_TOKENIZER_TOK_INTERNAL_H */
