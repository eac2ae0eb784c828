/* beam.h - beam search's bookkeeping for one request, with the semantics of transformers'
 * generate(num_beams=W, length_penalty=lp, early_stopping=...) for one prompt (its vectorized
 * _beam_search):
 *
 *   - each step, every running beam's logits row becomes log-softmax (double), added to the
 *     beam's cumulative logprob; of all beams x vocab candidates the best
 *     K = max(2, 1 + num_eos) * W are kept (ties: lower beam, then lower token id first);
 *   - a candidate "hits a stop" when its token is an end-of-sequence id, or when it reaches
 *     max_new_tokens (every candidate of the last step); such a candidate among the first W
 *     of the K becomes a finished hypothesis with
 *         score = sum_logprobs / generated_len ^ lp
 *     where generated_len counts the generated tokens including the end-of-sequence token
 *     (transformers: cur_len + 1 - prompt_len); at most W finished hypotheses are kept, the
 *     best by score (a new one must beat the worst to enter a full set);
 *   - the next running beams are the first W of the K that did not hit a stop;
 *   - the search ends when no candidate can continue, at max_new_tokens, or when the finished
 *     set is full and: early_stopping TRUE; or (FALSE) the best running beam's
 *     sum / cur_len ^ lp cannot beat the worst finished score; or (NEVER) the same with
 *     max_new_tokens instead of cur_len when lp > 0 (the best score it could still reach).
 * Width 1 is greedy search (argmax until an end-of-sequence token or the length), as
 * transformers' generate runs num_beams=1. The one deliberate difference: transformers starts with W - 1 placeholder beams at -1e9
 * that can fill candidate lists when vocab < K; here only real beams are candidates (the same
 * result whenever vocab_size >= K, i.e. for every real model).
 *
 * The caller owns the KV side: after kiln_beam_step, new running beam j continues old running
 * beam parent[j] with token[j] (several new beams may share a parent; a parent nobody names is
 * dropped).
 *
 * Thread-safety: none.
 */
#ifndef KILN_CORE_SAMPLE_BEAM_H
#define KILN_CORE_SAMPLE_BEAM_H

#include <stdbool.h>
#include <stdint.h>

#include "base/status.h"

typedef enum kiln_beam_early_stop {
  KILN_BEAM_EARLY_FALSE = 0, /* transformers' early_stopping=False (the default) */
  KILN_BEAM_EARLY_TRUE = 1,  /* stop as soon as W hypotheses are finished */
  KILN_BEAM_EARLY_NEVER = 2, /* "never": stop only when no better hypothesis is possible */
} kiln_beam_early_stop_t;

typedef struct kiln_beam_opts {
  int32_t width;          /* W in [1, 1024] */
  float length_penalty;   /* lp (transformers' default 1.0) */
  kiln_beam_early_stop_t early_stopping;
  int32_t max_new_tokens; /* >= 1 */
  const int32_t *eos;     /* end-of-sequence ids (copied); none = only the length ends */
  int32_t num_eos;
} kiln_beam_opts_t;

typedef struct kiln_beam_hyp {
  const int32_t *tokens; /* the generated tokens, the end-of-sequence token included */
  int32_t len;
  double sum_logprob;    /* cumulative logprob */
  double score;          /* sum_logprob / len ^ length_penalty */
} kiln_beam_hyp_t;

typedef struct kiln_beam kiln_beam_t;

/* Errors: KILN_ERR_INVALID_ARGUMENT naming the option, KILN_ERR_OUT_OF_MEMORY. */
kiln_status_t kiln_beam_create(const kiln_beam_opts_t *o, kiln_beam_t **out);
void kiln_beam_free(kiln_beam_t *b);

/* Running beams the next step reads a logits row for (1 before the first step; 0 when done). */
int32_t kiln_beam_num_running(const kiln_beam_t *b);
/* Running beam i's generated tokens so far, and its cumulative logprob. */
const int32_t *kiln_beam_running_tokens(const kiln_beam_t *b, int32_t i, int32_t *len,
                                        double *sum_logprob);
bool kiln_beam_done(const kiln_beam_t *b);

/* One step: logits holds kiln_beam_num_running rows of vocab floats, row i at
 * logits + i * row_stride (beam i's next-token logits, processed as the caller wants). Writes
 * parent[j], token[j] for each new running beam j (at most W entries) and returns their count
 * in *num_next (0 when the search ended). Errors: KILN_ERR_INVALID_ARGUMENT (done already, a
 * vocab below 1, a NaN logit or a row without a finite one), KILN_ERR_OUT_OF_MEMORY. */
kiln_status_t kiln_beam_step(kiln_beam_t *b, const float *logits, int64_t row_stride,
                             int32_t vocab, int32_t *parent, int32_t *token, int32_t *num_next);

/* The finished hypotheses, best score first (ties: the earlier finished first). */
int32_t kiln_beam_num_hyps(const kiln_beam_t *b);
const kiln_beam_hyp_t *kiln_beam_hyp(const kiln_beam_t *b, int32_t i);

#endif /* KILN_CORE_SAMPLE_BEAM_H */
