/* detok.c - incremental detokenization for streaming.
 *
 * The stream keeps a window of ids [prefix, end) and two marks, as HF's DecodeStream and
 * vLLM do:
 *
 *     ids:   ... | prefix ........ read | ........ end
 *                  \__ context: already emitted, decoded again so that the decoders'
 *                      first-token rules (Strip, Metaspace) and byte merging see what
 *                      came before
 *
 * On each push, text = decode(ids[prefix..end]); when it is longer than
 * decode(ids[prefix..read]) (the part already emitted), starts with it and does not end in
 * U+FFFD (an incomplete UTF-8 sequence), the difference is final and emitted; then
 * prefix = read, read = end. Two refinements keep concatenation == full decode:
 *   1. skipped special tokens never enter the window (decode drops them anyway, and a
 *      skipped token as the context would let the next token take the first-token rules);
 *   2. with a ByteFallback decoder nothing is emitted while the last token is a <0xNN>
 *      byte token: a run of byte tokens decodes as a whole (valid UTF-8, or one U+FFFD per
 *      byte), so its text is final only once the run ends.
 */
#include <stdlib.h>
#include <string.h>

#include "models/tokenizer/tok_internal.h"

struct kiln_detok {
  const kiln_tokenizer_t *tok;
  bool skip_special;
  bool byte_fallback;
  kiln_tokens_t ids;
  size_t prefix, read;
  kiln_strbuf_t prefix_text; /* decode(ids[prefix..read]) */
  kiln_strbuf_t text;        /* scratch */
};

kiln_status_t kiln_detok_create(const kiln_tokenizer_t *tok, bool skip_special,
                                kiln_detok_t **out) {
  *out = NULL;
  kiln_detok_t *d = calloc(1, sizeof(*d));
  if (!d) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "detokenizer: out of memory");
  d->tok = tok;
  d->skip_special = skip_special;
  d->byte_fallback = ktok_decoder_has_byte_fallback(tok->decoder);
  *out = d;
  return NULL;
}

void kiln_detok_free(kiln_detok_t *d) {
  if (!d) return;
  kiln_tokens_free(&d->ids);
  kiln_strbuf_free(&d->prefix_text);
  kiln_strbuf_free(&d->text);
  free(d);
}

static bool is_byte_token(const char *s, size_t n) {
  return n == 6 && memcmp(s, "<0x", 3) == 0 && s[5] == '>';
}

static bool ends_incomplete(const kiln_strbuf_t *b) {
  return b->len >= 3 && memcmp(b->data + b->len - 3, "\xEF\xBF\xBD", 3) == 0;
}

/* Drops ids before the context once the window has drifted far enough. */
static void compact(kiln_detok_t *d) {
  if (d->prefix < 256) return;
  memmove(d->ids.ids, d->ids.ids + d->prefix, (d->ids.len - d->prefix) * sizeof(int32_t));
  d->ids.len -= d->prefix;
  d->read -= d->prefix;
  d->prefix = 0;
}

kiln_status_t kiln_detok_push(kiln_detok_t *d, int32_t id, kiln_strbuf_t *emitted) {
  size_t len = 0;
  const char *s = ktok_id_to_token(d->tok, id, &len);
  if (!s) {
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "token id %d is out of range (vocabulary size %zu)", (int)id,
                            d->tok->vocab_size);
  }
  if (d->skip_special && kiln_tokenizer_is_special(d->tok, id)) return NULL;
  if (!kiln_tokens_push(&d->ids, id)) {
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "detokenizer: out of memory");
  }
  if (d->byte_fallback && is_byte_token(s, len)) return NULL;
  kiln_strbuf_reset(&d->text);
  kiln_status_t st = kiln_tokenizer_decode(d->tok, d->ids.ids + d->prefix, d->ids.len - d->prefix,
                                           d->skip_special, &d->text);
  if (st) {
    d->ids.len--;
    return st;
  }
  size_t pl = d->prefix_text.len;
  if (d->text.len <= pl || ends_incomplete(&d->text) ||
      (pl && memcmp(d->text.data, d->prefix_text.data, pl) != 0)) {
    return NULL;
  }
  if (!kiln_strbuf_append(emitted, d->text.data + pl, d->text.len - pl)) {
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "detokenizer: out of memory");
  }
  d->prefix = d->read;
  d->read = d->ids.len;
  kiln_strbuf_reset(&d->prefix_text);
  st = kiln_tokenizer_decode(d->tok, d->ids.ids + d->prefix, d->read - d->prefix, d->skip_special,
                             &d->prefix_text);
  compact(d);
  return st;
}

kiln_status_t kiln_detok_flush(kiln_detok_t *d, kiln_strbuf_t *out) {
  kiln_strbuf_reset(&d->text);
  kiln_status_t st = NULL;
  if (d->ids.len > d->prefix) {
    st = kiln_tokenizer_decode(d->tok, d->ids.ids + d->prefix, d->ids.len - d->prefix,
                               d->skip_special, &d->text);
  }
  size_t pl = d->prefix_text.len;
  if (!st && d->text.len > pl && !kiln_strbuf_append(out, d->text.data + pl, d->text.len - pl)) {
    st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "detokenizer: out of memory");
  }
  d->ids.len = 0;
  d->prefix = d->read = 0;
  kiln_strbuf_reset(&d->prefix_text);
  return st;
}
