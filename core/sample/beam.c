/* beam.c - beam search's bookkeeping (beam.h gives the semantics). */
#include "core/sample/beam.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct cand {
  double sum;   /* cumulative logprob */
  int64_t flat; /* beam * vocab + token: the tie-break (lower first) */
  int32_t beam, token;
} cand_t;

struct kiln_beam {
  int32_t W, K, max_new;
  double lp;
  kiln_beam_early_stop_t early;
  int32_t *eos;
  int32_t num_eos;
  int32_t num_run, cur_len; /* running beams, and the tokens each has generated */
  bool done;
  int32_t *run_tok, *next_tok; /* [W, max_new] */
  double *run_sum, *next_sum;  /* [W] */
  cand_t *cand;                /* [K] best first */
  int32_t *hyp_tok;            /* [W, max_new] */
  kiln_beam_hyp_t *hyps;       /* [W] best first */
  int32_t num_hyps;
};

kiln_status_t kiln_beam_create(const kiln_beam_opts_t *o, kiln_beam_t **out) {
  *out = NULL;
  if (o->width < 1 || o->width > 1024)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "beam_width must be in [1, 1024] (got %d)",
                            (int)o->width);
  if (!isfinite(o->length_penalty))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "length_penalty must be finite");
  if ((unsigned)o->early_stopping > KILN_BEAM_EARLY_NEVER)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "early_stopping must be false, true or never (got %d)",
                            (int)o->early_stopping);
  if (o->max_new_tokens < 1)
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                            "beam search needs max_new_tokens >= 1 (got %d)", (int)o->max_new_tokens);
  if (o->num_eos < 0 || (o->num_eos && !o->eos))
    return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "beam search: bad end-of-sequence list");
  kiln_beam_t *b = calloc(1, sizeof(*b));
  if (!b) return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "beam search state");
  b->W = o->width;
  /* width 1 is greedy search (transformers' generate dispatches num_beams=1 there): one
   * candidate a step */
  b->K = o->width == 1 ? 1 : (o->num_eos + 1 > 2 ? o->num_eos + 1 : 2) * o->width;
  b->max_new = o->max_new_tokens;
  b->lp = (double)o->length_penalty;
  b->early = o->early_stopping;
  b->num_eos = o->num_eos;
  b->num_run = 1;
  size_t tw = (size_t)b->W * (size_t)b->max_new;
  b->eos = malloc((size_t)(o->num_eos ? o->num_eos : 1) * sizeof(int32_t));
  b->run_tok = malloc(tw * sizeof(int32_t));
  b->next_tok = malloc(tw * sizeof(int32_t));
  b->hyp_tok = malloc(tw * sizeof(int32_t));
  b->run_sum = calloc((size_t)b->W, sizeof(double));
  b->next_sum = calloc((size_t)b->W, sizeof(double));
  b->cand = malloc((size_t)b->K * sizeof(cand_t));
  b->hyps = calloc((size_t)b->W, sizeof(kiln_beam_hyp_t));
  if (!b->eos || !b->run_tok || !b->next_tok || !b->hyp_tok || !b->run_sum || !b->next_sum ||
      !b->cand || !b->hyps) {
    kiln_beam_free(b);
    return kiln_status_make(KILN_ERR_OUT_OF_MEMORY, "beam search state (width %d)", (int)o->width);
  }
  if (o->num_eos) memcpy(b->eos, o->eos, (size_t)o->num_eos * sizeof(int32_t));
  *out = b;
  return NULL;
}

void kiln_beam_free(kiln_beam_t *b) {
  if (!b) return;
  free(b->eos);
  free(b->run_tok);
  free(b->next_tok);
  free(b->hyp_tok);
  free(b->run_sum);
  free(b->next_sum);
  free(b->cand);
  free(b->hyps);
  free(b);
}

int32_t kiln_beam_num_running(const kiln_beam_t *b) { return b->done ? 0 : b->num_run; }
bool kiln_beam_done(const kiln_beam_t *b) { return b->done; }
int32_t kiln_beam_num_hyps(const kiln_beam_t *b) { return b->num_hyps; }
const kiln_beam_hyp_t *kiln_beam_hyp(const kiln_beam_t *b, int32_t i) {
  return i >= 0 && i < b->num_hyps ? &b->hyps[i] : NULL;
}

const int32_t *kiln_beam_running_tokens(const kiln_beam_t *b, int32_t i, int32_t *len,
                                        double *sum_logprob) {
  if (i < 0 || i >= b->num_run) return NULL;
  if (len) *len = b->cur_len;
  if (sum_logprob) *sum_logprob = b->run_sum[i];
  return b->run_tok + (size_t)i * (size_t)b->max_new;
}

static bool better(const cand_t *a, const cand_t *c) {
  return a->sum > c->sum || (a->sum == c->sum && a->flat < c->flat);
}

static bool is_eos(const kiln_beam_t *b, int32_t t) {
  for (int32_t i = 0; i < b->num_eos; i++)
    if (b->eos[i] == t) return true;
  return false;
}

/* Offers a finished hypothesis (beam's tokens + tok) to the set of the best W. */
static void add_hyp(kiln_beam_t *b, const cand_t *c) {
  int32_t len = b->cur_len + 1;
  double score = c->sum / pow((double)len, b->lp);
  int32_t at = b->num_hyps; /* insertion point: after every hypothesis scoring >= score */
  while (at > 0 && b->hyps[at - 1].score < score) at--;
  if (at >= b->W) return; /* not better than the worst of a full set */
  /* the slot of the hypothesis that falls out (or a free one) holds the new tokens */
  int32_t last = b->num_hyps < b->W ? b->num_hyps : b->W - 1;
  int32_t *dst;
  if (b->num_hyps < b->W) {
    dst = b->hyp_tok + (size_t)b->num_hyps * (size_t)b->max_new;
    b->num_hyps++;
  } else {
    dst = (int32_t *)b->hyps[last].tokens;
  }
  memmove(&b->hyps[at + 1], &b->hyps[at], (size_t)(last - at) * sizeof(kiln_beam_hyp_t));
  memcpy(dst, b->run_tok + (size_t)c->beam * (size_t)b->max_new, (size_t)b->cur_len * 4);
  dst[b->cur_len] = c->token;
  b->hyps[at] = (kiln_beam_hyp_t){.tokens = dst, .len = len, .sum_logprob = c->sum, .score = score};
}

kiln_status_t kiln_beam_step(kiln_beam_t *b, const float *logits, int64_t row_stride,
                             int32_t vocab, int32_t *parent, int32_t *token, int32_t *num_next) {
  *num_next = 0;
  if (b->done) return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "beam search: already done");
  if (vocab < 1) return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "beam search: vocab < 1");
  int32_t nc = 0, K = b->K;
  for (int32_t r = 0; r < b->num_run; r++) {
    const float *x = logits + (int64_t)r * row_stride;
    double m = -INFINITY;
    for (int32_t v = 0; v < vocab; v++) {
      if (isnan(x[v]))
        return kiln_status_make(KILN_ERR_INVALID_ARGUMENT, "beam search: NaN logit (beam %d, token %d)",
                                (int)r, (int)v);
      if ((double)x[v] > m) m = (double)x[v];
    }
    if (!isfinite(m))
      return kiln_status_make(KILN_ERR_INVALID_ARGUMENT,
                              "beam search: beam %d's logits have no finite maximum", (int)r);
    double s = 0.0;
    for (int32_t v = 0; v < vocab; v++) s += exp((double)x[v] - m);
    double lse = m + log(s);
    for (int32_t v = 0; v < vocab; v++) {
      if (x[v] == -INFINITY) continue;
      cand_t c = {.sum = b->run_sum[r] + ((double)x[v] - lse),
                  .flat = (int64_t)r * vocab + v, .beam = r, .token = v};
      if (nc == K && !better(&c, &b->cand[K - 1])) continue;
      int32_t at = nc < K ? nc++ : K - 1;
      while (at > 0 && better(&c, &b->cand[at - 1])) {
        b->cand[at] = b->cand[at - 1];
        at--;
      }
      b->cand[at] = c;
    }
  }
  bool last_step = b->cur_len + 1 >= b->max_new;
  /* finished: stop-hitting candidates among the first W (unless early stopping has a full set) */
  bool full_stop = b->early == KILN_BEAM_EARLY_TRUE && b->num_hyps == b->W;
  for (int32_t i = 0; i < nc && i < b->W && !full_stop; i++)
    if (last_step || is_eos(b, b->cand[i].token)) add_hyp(b, &b->cand[i]);
  /* running: the first W that did not */
  int32_t nn = 0;
  for (int32_t i = 0; i < nc && nn < b->W && !last_step; i++) {
    const cand_t *c = &b->cand[i];
    if (is_eos(b, c->token)) continue;
    int32_t *dst = b->next_tok + (size_t)nn * (size_t)b->max_new;
    memcpy(dst, b->run_tok + (size_t)c->beam * (size_t)b->max_new, (size_t)b->cur_len * 4);
    dst[b->cur_len] = c->token;
    b->next_sum[nn] = c->sum;
    parent[nn] = c->beam;
    token[nn] = c->token;
    nn++;
  }
  int32_t *tt = b->run_tok;
  b->run_tok = b->next_tok;
  b->next_tok = tt;
  double *ts = b->run_sum;
  b->run_sum = b->next_sum;
  b->next_sum = ts;
  b->num_run = nn;
  b->cur_len++;
  /* is it done? */
  bool done = nn == 0;
  if (!done && b->num_hyps == b->W) {
    if (b->early == KILN_BEAM_EARLY_TRUE) {
      done = true;
    } else {
      int32_t L = b->early == KILN_BEAM_EARLY_NEVER && b->lp > 0.0 ? b->max_new : b->cur_len;
      double best = b->run_sum[0] / pow((double)L, b->lp);
      done = !(best > b->hyps[b->W - 1].score);
    }
  }
  b->done = done;
  *num_next = done ? 0 : nn;
  return NULL;
}
