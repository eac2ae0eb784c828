/* engine/textout.c - one sequence's streamed text: incremental detokenization plus stop strings.
 *
 * State: the detokenizer (models/tokenizer/detok.c) turns ids into final text; `pending` holds
 * the final text not yet handed to the caller. After each push:
 *
 *     pending = held tail (from before) + new text (this push's detokenizer output)
 *       1. if check_stop: look for a stop string ENDING inside the new text; the earliest end
 *          wins (a tie: the longest string, then the lowest index). Emit pending up to the
 *          match (or through it, with include_stop_str_in_output), drop the rest, stop.
 *       2. else hold back the longest suffix of pending that is a proper prefix of some stop
 *          string (moved back to a UTF-8 character boundary) and emit the rest.
 *
 * Rules, and why:
 *   - The min_tokens rule (check_stop): a match must END in text produced by a push with
 *     check_stop true (or by finish, when the last push had it); it may BEGIN in earlier text,
 *     emitted-or-held, produced while check_stop was false. This is vLLM's behaviour: its
 *     stop check is skipped until min_tokens are out, then searches the new characters plus
 *     (stop length - 1) before them. "Produced by a push" means what the detokenizer released on
 *     that push: text it held for an incomplete UTF-8 character counts for the push that
 *     completed it.
 *   - Earliest end: it is the match a character-by-character stream would hit first, so the
 *     result depends on the text only, not on how the tokens split it. (vLLM instead takes the
 *     first stop string in list order found in the window.)
 *   - Hold-back: a match found later must end in later text, so it can only begin in a suffix
 *     of pending that is a proper prefix of a stop string; the longest such suffix is exactly
 *     what must be held (never more than longest stop - 1 bytes, plus up to 3 to reach a
 *     character boundary). So a match that ends in new text never begins in text already
 *     emitted: pending always holds it whole. Without stop strings nothing is held beyond what
 *     the detokenizer holds. Cost per push: O(new bytes x stops) to search, O(longest stop x
 *     stops) byte compares (first byte filtered) for the hold.
 *   - Stop strings are matched bytewise; text from the detokenizer is valid UTF-8 (invalid
 *     bytes decode as U+FFFD), so emitted pieces always end on a character boundary.
 *   - finish flushes the detokenizer and still applies step 1 to that last text (when the last
 *     push had check_stop), so that emitted == decode(ids) cut at the stop string holds in
 *     every case; finish cannot report the match (its signature has no out parameter), the
 *     sequence was ending anyway.
 * After a stop or finish, push and finish emit nothing (push reports the stop index again).
 */
#include "core/engine/textout.h"

#include <stdlib.h>
#include <string.h>

typedef struct stop_str {
  char *s;
  size_t len;
  int32_t index; /* in the caller's array (empty strings are dropped, indices kept) */
} stop_str_t;

struct kiln_textout {
  const kiln_tokenizer_t *tok;
  kiln_detok_t *detok; /* NULL without a tokenizer */
  stop_str_t *stop;
  int32_t num_stop;
  size_t max_stop; /* longest stop string, bytes */
  bool include_stop;
  bool last_check; /* check_stop of the latest push */
  bool done;       /* stopped or finished */
  int32_t stopped; /* the matched stop string's index, or -1 */
  kiln_strbuf_t pending;
};

static kiln_status_t oom(void) {
  return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "textout: out of memory");
}

kiln_status_t kiln_textout_create(const kiln_tokenizer_t *tok, bool skip_special,
                                  const char *const *stop, int32_t num_stop,
                                  bool include_stop_str_in_output, kiln_textout_t **out) {
  *out = NULL;
  kiln_status_t st = NULL;
  kiln_textout_t *t = calloc(1, sizeof(*t));
  if (!t) return oom();
  t->include_stop = include_stop_str_in_output;
  t->stopped = -1;
  if (!tok) goto done; /* no text: nothing to track */
  t->tok = tok;
  st = kiln_detok_create(tok, skip_special, &t->detok);
  if (st) goto fail;
  if (num_stop > 0) {
    t->stop = calloc((size_t)num_stop, sizeof(*t->stop));
    if (!t->stop) goto fail_oom;
  }
  for (int32_t i = 0; i < num_stop; i++) {
    size_t len = stop[i] ? strlen(stop[i]) : 0;
    if (!len) continue;
    stop_str_t *s = &t->stop[t->num_stop];
    s->s = malloc(len + 1);
    if (!s->s) goto fail_oom;
    memcpy(s->s, stop[i], len + 1);
    s->len = len;
    s->index = i;
    t->num_stop++;
    if (len > t->max_stop) t->max_stop = len;
  }
done:
  *out = t;
  return NULL;
fail_oom:
  st = oom();
fail:
  kiln_textout_free(t);
  return st;
}

void kiln_textout_free(kiln_textout_t *t) {
  if (!t) return;
  kiln_detok_free(t->detok);
  for (int32_t i = 0; t->stop && i < t->num_stop; i++) free(t->stop[i].s);
  free(t->stop);
  kiln_strbuf_free(&t->pending);
  free(t);
}

/* The earliest-ending stop string match in pending whose end lies after byte `from` (its last
 * byte at >= from); ties to the longest, then the first. Returns its position in t->stop or
 * -1; *out_end is one past its last byte. */
static int32_t find_stop(const kiln_textout_t *t, size_t from, size_t *out_end) {
  const char *p = t->pending.data;
  for (size_t end = from + 1; end <= t->pending.len; end++) {
    int32_t best = -1;
    for (int32_t i = 0; i < t->num_stop; i++) {
      const stop_str_t *s = &t->stop[i];
      if (s->len > end || p[end - 1] != s->s[s->len - 1]) continue;
      if (memcmp(p + end - s->len, s->s, s->len) != 0) continue;
      if (best < 0 || s->len > t->stop[best].len) best = i;
    }
    if (best >= 0) {
      *out_end = end;
      return best;
    }
  }
  return -1;
}

/* Bytes at the end of pending that must be held: the longest suffix that is a proper prefix
 * of a stop string, extended back to the start of a UTF-8 character. */
static size_t hold_len(const kiln_textout_t *t) {
  const char *p = t->pending.data;
  size_t n = t->pending.len;
  if (!t->num_stop || !n) return 0;
  size_t hold = 0;
  size_t l = t->max_stop - 1 < n ? t->max_stop - 1 : n;
  for (; l > 0 && !hold; l--) {
    for (int32_t i = 0; i < t->num_stop; i++) {
      const stop_str_t *s = &t->stop[i];
      if (s->len > l && p[n - l] == s->s[0] && memcmp(p + n - l, s->s, l) == 0) {
        hold = l;
        break;
      }
    }
  }
  /* Never split a character: back over continuation bytes (at most 3 in valid UTF-8). */
  for (int k = 0; k < 3 && hold > 0 && hold < n && ((unsigned char)p[n - hold] & 0xC0) == 0x80;
       k++) {
    hold++;
  }
  return hold;
}

/* Moves pending[0..n) to emit and keeps the rest. */
static kiln_status_t emit_front(kiln_textout_t *t, size_t n, kiln_strbuf_t *emit) {
  if (!n) return NULL;
  if (!kiln_strbuf_append(emit, t->pending.data, n)) return oom();
  memmove(t->pending.data, t->pending.data + n, t->pending.len - n + 1); /* with the NUL */
  t->pending.len -= n;
  return NULL;
}

/* Steps 1 and 2 of the file comment over pending, whose bytes from new_from on are new.
 * final: the stream ends here, hold nothing. */
static kiln_status_t process(kiln_textout_t *t, size_t new_from, bool check, bool final,
                             kiln_strbuf_t *emit) {
  if (check && t->num_stop && t->pending.len > new_from) {
    size_t end = 0;
    int32_t m = find_stop(t, new_from, &end);
    if (m >= 0) {
      kiln_status_t st = emit_front(t, t->include_stop ? end : end - t->stop[m].len, emit);
      if (st) return st;
      kiln_strbuf_reset(&t->pending);
      t->stopped = t->stop[m].index;
      t->done = true;
      return NULL;
    }
  }
  return emit_front(t, t->pending.len - (final ? 0 : hold_len(t)), emit);
}

kiln_status_t kiln_textout_push(kiln_textout_t *t, int32_t id, bool check_stop, kiln_strbuf_t *emit,
                                int32_t *stopped) {
  *stopped = t->stopped;
  if (!t->detok || t->done) return NULL;
  /* An id the tokenizer does not have (a model vocabulary padded beyond the tokenizer's) has
   * no text: it adds nothing, as in vLLM, instead of failing the request. */
  size_t tlen;
  if (!kiln_tokenizer_id_to_token(t->tok, id, &tlen)) return NULL;
  size_t new_from = t->pending.len;
  kiln_status_t st = kiln_detok_push(t->detok, id, &t->pending);
  if (st) return st;
  t->last_check = check_stop;
  st = process(t, new_from, check_stop, false, emit);
  *stopped = t->stopped;
  return st;
}

int32_t kiln_textout_stopped(const kiln_textout_t *t) { return t->stopped; }

kiln_status_t kiln_textout_finish(kiln_textout_t *t, kiln_strbuf_t *emit) {
  if (!t->detok || t->done) return NULL;
  size_t new_from = t->pending.len;
  kiln_status_t st = kiln_detok_flush(t->detok, &t->pending);
  if (st) return st;
  st = process(t, new_from, t->last_check, true, emit);
  if (!st) t->done = true;
  return st;
}
