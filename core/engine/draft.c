/* draft.c - speculative decoding's draft model (see draft.h). */
#define _POSIX_C_SOURCE 200809L
#include "core/engine/draft.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

struct kiln_draft {
  kiln_runner_t runner;
  kiln_kv_manager_t *kv;
  kiln_sampler_t *sampler;
  int32_t bs, max_seqs, max_tokens, max_blocks;
  int64_t max_len;
  double seconds;
  /* per-forward scratch */
  int32_t *ids, *pos, *slots, *lens, *qsl, *tables, *rows, *row_req, *cursor;
  kiln_sample_row_t *srows;
  kiln_sample_out_t so;
};

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

kiln_status_t kiln_draft_create(const kiln_draft_options_t *o, kiln_draft_t **out) {
  *out = NULL;
  if (o->num_blocks < 1 || o->block_size < 1 || o->max_seqs < 1 || o->max_tokens < 1 ||
      o->runner.max_model_len < 1) {
    if (o->runner.destroy) o->runner.destroy(o->runner.ctx);
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "draft model: bad pool (%d blocks of %d), %d sequences, %d tokens",
                            o->num_blocks, o->block_size, o->max_seqs, o->max_tokens);
  }
  kiln_draft_t *d = calloc(1, sizeof(*d));
  if (!d) {
    if (o->runner.destroy) o->runner.destroy(o->runner.ctx);
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "draft model: out of memory");
  }
  d->runner = o->runner;
  d->bs = o->block_size;
  d->max_seqs = o->max_seqs;
  d->max_tokens = o->max_tokens;
  d->max_len = o->runner.max_model_len;
  d->max_blocks = (int32_t)((d->max_len + d->bs - 1) / d->bs);
  kiln_status_t st = kiln_kv_manager_create(o->num_blocks, o->block_size, false, &d->kv);
  if (!st)
    st = kiln_sampler_create(d->runner.backend, d->runner.device, d->runner.stream,
                             o->force_host_sampling, d->max_seqs, 1, d->runner.vocab_size,
                             &d->sampler);
  if (!st) {
    size_t S = (size_t)d->max_seqs, T = (size_t)d->max_tokens;
    d->ids = malloc(T * 4);
    d->pos = malloc(T * 4);
    d->slots = malloc(T * 4);
    d->lens = malloc(S * 4);
    d->qsl = malloc((S + 1) * 4);
    d->tables = calloc(S * (size_t)d->max_blocks, 4);
    d->rows = malloc(S * 4);
    d->row_req = malloc(S * 4);
    d->cursor = malloc(S * 4);
    d->srows = calloc(S, sizeof(*d->srows));
    d->so.tokens = malloc(S * 4);
    d->so.logprobs = malloc(S * 4);
    d->so.top_ids = malloc(S * 4);
    d->so.top_logprobs = malloc(S * 4);
    if (!d->ids || !d->pos || !d->slots || !d->lens || !d->qsl || !d->tables || !d->rows ||
        !d->row_req || !d->cursor || !d->srows || !d->so.tokens || !d->so.logprobs ||
        !d->so.top_ids || !d->so.top_logprobs)
      st = kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "draft model: out of memory for step buffers");
  }
  if (st) {
    kiln_draft_free(d);
    return st;
  }
  *out = d;
  return NULL;
}

void kiln_draft_free(kiln_draft_t *d) {
  if (!d) return;
  kiln_sampler_free(d->sampler);
  kiln_kv_manager_free(d->kv);
  if (d->runner.destroy) d->runner.destroy(d->runner.ctx);
  free(d->ids);
  free(d->pos);
  free(d->slots);
  free(d->lens);
  free(d->qsl);
  free(d->tables);
  free(d->rows);
  free(d->row_req);
  free(d->cursor);
  free(d->srows);
  free(d->so.tokens);
  free(d->so.logprobs);
  free(d->so.top_ids);
  free(d->so.top_logprobs);
  free(d);
}

kiln_kv_manager_t *kiln_draft_kv(kiln_draft_t *d) { return d->kv; }

double kiln_draft_seconds(const kiln_draft_t *d) { return d->seconds; }

void kiln_draft_zero_seconds(kiln_draft_t *d) { d->seconds = 0; }

/* Keeps the blocks of tokens 0..len-1 and releases the rest. */
static void trim(kiln_draft_t *d, kiln_draft_seq_t *s, int32_t len) {
  int32_t keep = (len + d->bs - 1) / d->bs;
  while (s->num_blocks > keep) kiln_kv_release(d->kv, s->blocks[--s->num_blocks]);
  if (s->len > len) s->len = len;
  if (s->base > s->len) s->base = s->len;
}

void kiln_draft_sync(kiln_draft_t *d, kiln_draft_seq_t *s, const int32_t *tokens, int32_t n) {
  int32_t keep = s->len;
  if (keep > s->base) {
    int32_t i = 0;
    while (s->base + i < keep && s->base + i < n && tokens[s->base + i] == s->prop[i]) i++;
    keep = s->base + i;
  }
  if (keep > n) keep = n;
  trim(d, s, keep);
  s->len = keep;
  s->base = keep;
}

void kiln_draft_release(kiln_draft_t *d, kiln_draft_seq_t *s) {
  trim(d, s, 0);
  free(s->blocks);
  memset(s, 0, sizeof(*s));
}

/* Gives s blocks for tokens 0..need-1, as many as the pool has. Returns the tokens covered. */
static int32_t grow(kiln_draft_t *d, kiln_draft_seq_t *s, int32_t need) {
  if (!s->blocks && !(s->blocks = malloc((size_t)d->max_blocks * 4))) return 0;
  int32_t want = (need + d->bs - 1) / d->bs;
  while (s->num_blocks < want) {
    int32_t b = kiln_kv_alloc(d->kv);
    if (b < 0) break;
    s->blocks[s->num_blocks++] = b;
  }
  int32_t have = s->num_blocks * d->bs;
  return have < need ? have : need;
}

/* One draft forward over the batch built in the scratch (S sequences, T tokens, R rows whose
 * requests are row_req), then argmax of each row into its request's out[j]. */
static kiln_status_t forward(kiln_draft_t *d, kiln_draft_req_t *reqs, int32_t S, int32_t T,
                             int32_t R, int32_t j) {
  kiln_batch_t b = {.num_tokens = T,
                    .num_seqs = S,
                    .token_ids = d->ids,
                    .positions = d->pos,
                    .slot_mapping = d->slots,
                    .seq_lens = d->lens,
                    .query_start_loc = d->qsl,
                    .block_tables = d->tables,
                    .max_blocks_per_seq = d->max_blocks,
                    .num_logits = R,
                    .logits_rows = d->rows};
  kiln_status_t st = d->runner.forward(d->runner.ctx, &b);
  if (st || !R) return st;
  kiln_sample_logits_t lg;
  d->runner.logits(d->runner.ctx, R, &lg);
  for (int32_t r = 0; r < R; r++)
    d->srows[r] = (kiln_sample_row_t){
        .logits_row = r, .temperature = 0, .top_p = 1, .repetition = 1, .num_top = -1};
  if ((st = kiln_sampler_run(d->sampler, &lg, d->srows, R, NULL, 0, &d->so))) return st;
  for (int32_t r = 0; r < R; r++) reqs[d->row_req[r]].out[j] = d->so.tokens[r];
  return NULL;
}

/* Adds tokens [from, from + count) of request i (ids from ids) to the batch as sequence S. */
static void add_seq(kiln_draft_t *d, const kiln_draft_seq_t *s, const int32_t *ids, int32_t from,
                    int32_t count, int32_t S, int32_t *T) {
  for (int32_t t = 0; t < count; t++) {
    int32_t p = from + t;
    d->ids[*T] = ids[t];
    d->pos[*T] = p;
    d->slots[*T] = s->blocks[p / d->bs] * d->bs + p % d->bs;
    (*T)++;
  }
  d->lens[S] = from + count;
  d->qsl[S + 1] = *T;
  memcpy(d->tables + (size_t)S * (size_t)d->max_blocks, s->blocks, (size_t)s->num_blocks * 4);
}

kiln_status_t kiln_draft_propose(kiln_draft_t *d, kiln_draft_req_t *reqs, int32_t n) {
  double t0 = now_s();
  if (n > d->max_seqs) n = d->max_seqs;
  /* Plan: blocks for every token the draft will have seen (the sequence's and k - 1 of its
   * own proposals); fewer proposals when the pool is short, none when it has nothing. */
  int32_t kmax = 0;
  for (int32_t i = 0; i < n; i++) {
    kiln_draft_req_t *q = &reqs[i];
    kiln_draft_seq_t *s = q->seq;
    if (q->k > KILN_DRAFT_MAX_K) q->k = KILN_DRAFT_MAX_K;
    if (q->k > d->max_len - q->num_tokens + 1) q->k = (int32_t)(d->max_len - q->num_tokens + 1);
    if (q->k <= 0 || q->num_tokens < 1) {
      q->k = 0;
      continue;
    }
    /* Two tokens to feed (one at the least, for a one-token sequence): after a verification
     * the draft lacks one token (a rejection or a correction) or two (every proposal taken:
     * the last one was never fed, and the bonus token), so feeding one it already holds again
     * makes every sequence's catch-up two tokens: a uniform batch, which replays the draft's
     * multi-token decode graph (models/model.h) instead of running eagerly. */
    const int32_t feed = q->num_tokens >= 2 ? 2 : 1;
    if (s->len > q->num_tokens - feed) trim(d, s, q->num_tokens - feed);
    int32_t got = grow(d, s, q->num_tokens + q->k - 1);
    if (got < q->num_tokens) { /* not even the sequence's own tokens fit: give the pool back */
      kiln_draft_release(d, s);
      q->k = 0;
      continue;
    }
    q->k = got - q->num_tokens + 1;
    d->cursor[i] = s->len;
    if (q->k > kmax) kmax = q->k;
  }
  kiln_status_t st = NULL;
  /* Catch-up: the tokens the draft has not seen, at most max_tokens a forward; a sequence's
   * last one gives its first proposal. */
  for (;;) {
    int32_t S = 0, T = 0, R = 0;
    d->qsl[0] = 0;
    for (int32_t i = 0; i < n && T < d->max_tokens; i++) {
      kiln_draft_req_t *q = &reqs[i];
      if (!q->k || d->cursor[i] >= q->num_tokens) continue;
      int32_t c = d->cursor[i], cnt = q->num_tokens - c;
      if (cnt > d->max_tokens - T) cnt = d->max_tokens - T;
      add_seq(d, q->seq, q->tokens + c, c, cnt, S, &T);
      if (c + cnt == q->num_tokens) {
        d->rows[R] = T - 1;
        d->row_req[R++] = i;
      }
      d->cursor[i] = c + cnt;
      S++;
    }
    if (!S) break;
    if ((st = forward(d, reqs, S, T, R, 0))) break;
  }
  /* Then each proposal fed back gives the next. */
  for (int32_t j = 1; j < kmax && !st; j++) {
    int32_t S = 0, T = 0, R = 0;
    d->qsl[0] = 0;
    for (int32_t i = 0; i < n; i++) {
      kiln_draft_req_t *q = &reqs[i];
      if (q->k <= j) continue;
      add_seq(d, q->seq, &q->out[j - 1], q->num_tokens + j - 1, 1, S, &T);
      d->rows[R] = T - 1;
      d->row_req[R++] = i;
      S++;
    }
    st = forward(d, reqs, S, T, R, j);
  }
  for (int32_t i = 0; i < n; i++) {
    kiln_draft_req_t *q = &reqs[i];
    kiln_draft_seq_t *s = q->seq;
    if (st) {
      q->k = 0;
      continue;
    }
    if (!q->k) continue;
    s->len = q->num_tokens + q->k - 1;
    s->base = q->num_tokens;
    memcpy(s->prop, q->out, (size_t)(q->k - 1) * 4);
  }
  d->seconds += now_s() - t0;
  return st;
}
