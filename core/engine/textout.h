/* textout.h - one sequence's text as it is generated: incremental detokenization
 * (models/tokenizer's kiln_detok_t) plus stop strings.
 *
 * Text that could still turn out to be the start of a stop string is held back: after each
 * token, everything but the last (longest stop string - 1) bytes of the not-yet-emitted text
 * is emitted, unless a stop string has matched. When a stop string matches, the text is cut
 * before it (or after it, with include_stop_str_in_output) and nothing more is emitted.
 * Matching starts from text produced after min_tokens have been generated (the caller says
 * when with check_stop); a stop string may straddle token boundaries and may begin inside
 * text already emitted-or-held (the search covers the held-back tail plus the new text).
 * When the sequence ends without a stop string, kiln_textout_finish flushes the rest (the
 * held-back bytes and whatever the detokenizer kept for an incomplete UTF-8 sequence).
 *
 * The concatenation of everything emitted equals decode(all output ids) truncated at the
 * stop string (the property the tests check). Without a tokenizer, textout only tracks
 * nothing and emits nothing (token ids still flow). Ids the tokenizer does not know (a model
 * vocabulary padded beyond it) add no text.
 */
#ifndef KILN_CORE_ENGINE_TEXTOUT_H
#define KILN_CORE_ENGINE_TEXTOUT_H

#include <stdbool.h>
#include <stdint.h>

#include "base/status.h"
#include "base/strbuf.h"
#include "models/tokenizer/tokenizer.h"

typedef struct kiln_textout kiln_textout_t;

/* tok may be NULL (no text). stop: num_stop strings (copied; empty strings are ignored). */
kiln_status_t kiln_textout_create(const kiln_tokenizer_t *tok, bool skip_special,
                                  const char *const *stop, int32_t num_stop,
                                  bool include_stop_str_in_output, kiln_textout_t **out);
void kiln_textout_free(kiln_textout_t *t);

/* Adds one generated token. Appends the text that became final to emit. check_stop: whether
 * stop strings may match from this token on. *stopped = the index of the stop string that
 * matched (then the sequence must finish), else -1. */
kiln_status_t kiln_textout_push(kiln_textout_t *t, int32_t id, bool check_stop,
                                kiln_strbuf_t *emit, int32_t *stopped);

/* The sequence ended (not by a stop string): appends everything still held back to emit.
 * The flushed text may itself complete a stop string (then kiln_textout_stopped says which). */
kiln_status_t kiln_textout_finish(kiln_textout_t *t, kiln_strbuf_t *emit);

/* The index of the stop string that matched (on a push or at finish), or -1. */
int32_t kiln_textout_stopped(const kiln_textout_t *t);

#endif /* KILN_CORE_ENGINE_TEXTOUT_H */
