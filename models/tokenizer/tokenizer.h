/* tokenizer.h - Hugging Face tokenizer.json (BPE) in C: encode, decode, incremental detokenize.
 *
 * Semantics follow Hugging Face `tokenizers` exactly for the components implemented (see
 * docs in models/tokenizer/tok_internal.h for the list); anything else a file asks for is
 * refused at load with an error naming the component ("tokenizer.json:
 * pre_tokenizer.pretokenizers[1]: type 'UnicodeScripts' is not supported").
 *
 * Ownership: kiln_tokenizer_load() returns an owned tokenizer (free with
 * kiln_tokenizer_free()); every const char * it returns is borrowed and lives as long as the
 * tokenizer. kiln_tokens_t and kiln_strbuf_t outputs are owned by the caller, who
 * initialises them (KILN_TOKENS_INIT / KILN_STRBUF_INIT) and frees them; results are
 * appended.
 *
 * Thread-safety: a loaded tokenizer is immutable except for an internal word cache guarded
 * by a mutex, so any number of threads may encode/decode with one tokenizer at once. A
 * detokenizer (kiln_detok_t) belongs to one stream and is not thread-safe.
 */
#ifndef KILN_MODELS_TOKENIZER_H
#define KILN_MODELS_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/status.h"
#include "base/strbuf.h"

typedef struct kiln_tokenizer kiln_tokenizer_t;

/* A growable array of token ids. Zero-initialised is empty and valid. */
typedef struct kiln_tokens {
  int32_t *ids;
  size_t len;
  size_t cap;
} kiln_tokens_t;

#define KILN_TOKENS_INIT \
  { NULL, 0, 0 }

/* Appends one id; false on out-of-memory (the array is unchanged). */
bool kiln_tokens_push(kiln_tokens_t *t, int32_t id);
void kiln_tokens_free(kiln_tokens_t *t);

/* Loads a tokenizer from a directory holding tokenizer.json (and optionally
 * tokenizer_config.json beside it, read for bos/eos token strings and add_bos/add_eos), or
 * from a tokenizer.json path directly. Errors: KILN_ERR_NOT_FOUND / KILN_ERR_IO when the file
 * cannot be read, KILN_ERR_INVALID_ARGUMENT for a malformed file, KILN_ERR_UNSUPPORTED for a
 * component Kiln does not implement; the message names the file and the component path. On
 * error *out is NULL. */
kiln_status_t kiln_tokenizer_load(const char *dir_or_file, kiln_tokenizer_t **out);

/* Same, from the text of a tokenizer.json held in memory (name is used in messages). */
kiln_status_t kiln_tokenizer_load_json(const char *json, size_t len, const char *name,
                                       kiln_tokenizer_t **out);

/* Same, with the text of a tokenizer_config.json too (config may be NULL: none). */
kiln_status_t kiln_tokenizer_load_json_config(const char *json, size_t len, const char *config,
                                              size_t config_len, const char *name,
                                              kiln_tokenizer_t **out);

void kiln_tokenizer_free(kiln_tokenizer_t *tok);

/* Encodes len bytes of UTF-8 text (NUL bytes allowed) and appends the ids to out, as HF's
 * Tokenizer.encode(text, add_special_tokens).ids does: added tokens split out first, the text
 * between them normalized, pre-tokenized and run through the model, then the
 * post-processor's special tokens when add_special_tokens. Errors: KILN_ERR_INVALID_ARGUMENT
 * for invalid UTF-8 (naming the byte offset), KILN_ERR_OUT_OF_MEMORY. On error out keeps its
 * previous length. */
kiln_status_t kiln_tokenizer_encode(const kiln_tokenizer_t *tok, const char *text, size_t len,
                                    bool add_special_tokens, kiln_tokens_t *out);

/* Decodes ids and appends the text to out, as HF's Tokenizer.decode(ids,
 * skip_special_tokens) does (invalid byte sequences become U+FFFD). An id that names no token
 * is KILN_ERR_INVALID_ARGUMENT ("token id 99999 is out of range (vocabulary size 32000)"). */
kiln_status_t kiln_tokenizer_decode(const kiln_tokenizer_t *tok, const int32_t *ids, size_t n,
                                    bool skip_special_tokens, kiln_strbuf_t *out);

/* One past the largest id of the model vocabulary and the added tokens. */
size_t kiln_tokenizer_vocab_size(const kiln_tokenizer_t *tok);
/* The token string of id (added tokens first, then the model vocabulary); NULL when none.
 * *out_len (may be NULL) receives its length. */
const char *kiln_tokenizer_id_to_token(const kiln_tokenizer_t *tok, int32_t id, size_t *out_len);
/* The id of a token string (added tokens first, then the model vocabulary); -1 when none. */
int32_t kiln_tokenizer_token_to_id(const kiln_tokenizer_t *tok, const char *token, size_t len);
/* True when id is an added token marked "special" (skipped by skip_special_tokens). */
bool kiln_tokenizer_is_special(const kiln_tokenizer_t *tok, int32_t id);
/* BOS/EOS ids from tokenizer_config.json's bos_token/eos_token; -1 when absent. */
int32_t kiln_tokenizer_bos_id(const kiln_tokenizer_t *tok);
int32_t kiln_tokenizer_eos_id(const kiln_tokenizer_t *tok);
/* tokenizer_config.json's add_bos_token / add_eos_token (false when absent). Informational:
 * encode follows tokenizer.json's post-processor, as HF's tokenizers library does. */
bool kiln_tokenizer_add_bos(const kiln_tokenizer_t *tok);
bool kiln_tokenizer_add_eos(const kiln_tokenizer_t *tok);
/* BOS/EOS token strings from tokenizer_config.json (NULL when absent). */
const char *kiln_tokenizer_bos_token(const kiln_tokenizer_t *tok);
const char *kiln_tokenizer_eos_token(const kiln_tokenizer_t *tok);

/* The bytes token id adds in the middle of a decoded text (constrained decoding works on
 * these): the decoder chain run over the token alone, without the rules for a text's first
 * token and without replacing partial UTF-8 characters (a byte-level token may hold half of
 * one). Errors: an id naming no token, out of memory. */
kiln_status_t kiln_tokenizer_token_bytes(const kiln_tokenizer_t *tok, int32_t id,
                                         kiln_strbuf_t *out);
/* True when decoding drops one leading space of a text's first token (a Metaspace decoder that
 * prepends one, or a Strip of a leading space after Fuse, as SentencePiece tokenizers do). */
bool kiln_tokenizer_strips_first_space(const kiln_tokenizer_t *tok);

/* ---- incremental detokenization ------------------------------------------------------- */

/* A streaming decoder: push ids one at a time and receive only text that is final (it can
 * never change however the stream continues; never half a UTF-8 character). The
 * concatenation of everything pushed out plus kiln_detok_flush() equals
 * kiln_tokenizer_decode() of all the ids with the same skip_special. The tokenizer must
 * outlive the detokenizer. */
typedef struct kiln_detok kiln_detok_t;

kiln_status_t kiln_detok_create(const kiln_tokenizer_t *tok, bool skip_special, kiln_detok_t **out);
/* Appends the newly final text (possibly none) to emitted. Errors as kiln_tokenizer_decode()
 * (an unknown id leaves the detokenizer unchanged). */
kiln_status_t kiln_detok_push(kiln_detok_t *d, int32_t id, kiln_strbuf_t *emitted);
/* Appends whatever is still held back (end of stream) and resets the detokenizer. */
kiln_status_t kiln_detok_flush(kiln_detok_t *d, kiln_strbuf_t *out);
void kiln_detok_free(kiln_detok_t *d);

#endif /* KILN_MODELS_TOKENIZER_H */
